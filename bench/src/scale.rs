//! The scale check: N (default 100,000) concurrent connections through the waypoint on one
//! node (loopback), each established end to end (hello routed, the pod's answer back),
//! held open together, spot-checked, then closed; with the daemons' RSS at the peak.
//!
//! Every process's file table is bounded by RLIMIT_NOFILE; where it cannot be raised
//! (a container without CAP_SYS_RESOURCE) the connections are spread: several waypoint
//! daemons share the tunnel address with SO_REUSEPORT (as during a rolling update), and
//! the client and server ends live in helper processes (`worker`). The report says how
//! many of each it took.
//!
//! Loopback has one destination address per listener, so each client process binds its
//! own 127.0.3.x source (IP_BIND_ADDRESS_NO_PORT: ports are picked per 4-tuple) and the
//! waypoint dials several echo "pods" at 127.0.1.x.

pub mod worker;

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    process::{ChildStdin, Command},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};
use serde_json::{json, Value};

use crate::{
    procs::Group,
    routers::{Kind, Router, Setup},
    servers::Servers,
    sys,
};

const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// What to run.
pub struct Settings {
    pub connections: usize,
    pub kind: Kind,
    pub deadline: Duration,
    pub waypoint_bin: PathBuf,
    pub work: PathBuf,
}

/// One sample of the waypoint's metric `name` (None: no answer, or no such sample).
pub fn metric(admin: SocketAddr, name: &str) -> Option<f64> {
    metrics_text(admin)?.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// The waypoint's whole `/metrics` page.
pub fn metrics_text(admin: SocketAddr) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&admin, IO_TIMEOUT).ok()?;
    s.set_read_timeout(Some(IO_TIMEOUT)).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    Some(text)
}

/// How long the benchmarks wait at most for the waypoint to park every idle connection
/// (one to two times `--park-after`, default 100 ms, after its last byte): enough for a
/// daemon given `--park-after 5s`.
pub const PARK_WAIT: Duration = Duration::from_secs(12);

/// Waits (at most `bound`) until the daemons at `admins` have parked `want` connections
/// between them; the count last read (None: a daemon did not answer).
pub fn wait_parked(admins: &[SocketAddr], want: usize, bound: Duration) -> Option<f64> {
    let t = Instant::now();
    loop {
        let parked: Option<f64> = admins
            .iter()
            .map(|&a| metric(a, "waypoint_connections_parked"))
            .sum();
        if parked.is_none_or(|p| p >= want as f64) || t.elapsed() >= bound {
            return parked;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// How long the benchmarks wait at most for a waypoint to close the connections of a
/// finished figure: the rewrite splice keeps an ended connection's entries, and its
/// socket to the pod, 3 s (`LINGER`) before it removes and closes them.
pub const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Waits (at most `bound`, polling every 250 ms so that the polling itself costs the
/// daemon little) until the daemon at `admin` holds no connection, lingering ones of
/// the rewrite splice included; whether it got there.
pub fn wait_closed(admin: SocketAddr, bound: Duration) -> bool {
    let t = Instant::now();
    loop {
        let open = metric(admin, "waypoint_active_connections").map(|n| {
            // Only with --rewrite-splice.
            n + metric(admin, "waypoint_rewrite_live").unwrap_or(0.0)
        });
        match open {
            Some(n) if n <= 0.0 => return true,
            None => return false,
            Some(_) if t.elapsed() >= bound => return false,
            Some(_) => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

/// Sum of the daemons' open connections (None when a daemon did not answer).
fn active(routers: &[Router]) -> Option<f64> {
    routers
        .iter()
        .map(|r| metric(r.admin?, "waypoint_active_connections"))
        .sum()
}

/// A helper process with a pipe to its stdin and a line reader on its stdout.
struct Helper {
    group: Group,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Helper {
    fn spawn(args: &[String], log: PathBuf) -> anyhow::Result<Helper> {
        let exe = std::env::current_exe().context("finding this binary")?;
        let mut cmd = Command::new(exe);
        cmd.args(args);
        let (group, stdin, stdout) = Group::spawn_piped(cmd, &log)?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Ok(Helper {
            group,
            stdin: Some(stdin),
            lines: rx,
        })
    }

    fn line(&self, timeout: Duration) -> Option<String> {
        self.lines.recv_timeout(timeout).ok()
    }

    fn send(&mut self, cmd: &str) {
        if let Some(s) = self.stdin.as_mut() {
            let _ = writeln!(s, "{cmd}");
        }
    }

    /// Closes stdin (the helper exits) and waits a little before the group is killed.
    fn finish(mut self) {
        self.stdin = None;
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline && self.group.exited().is_none() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Runs the check; returns the Markdown summary, the JSON document and whether it passed.
pub fn run(s: &Settings) -> anyhow::Result<(String, Value, bool)> {
    let started = Instant::now();
    let n = s.connections;
    let nofile = sys::raise_nofile((2 * n + 65_536) as u64)? as usize;
    // Room for listeners, logs, eBPF maps and the like in every process.
    let room = nofile.saturating_sub(256).max(1000);
    // Each waypoint holds two sockets per connection; REUSEPORT spreads connections by
    // hash, not evenly, so aim for 65% of each daemon's capacity.
    let daemons = if 2 * n + 256 <= nofile {
        1
    } else {
        n.div_ceil(room / 2 * 65 / 100)
    };
    let pods = n.div_ceil(room * 3 / 4).clamp(8, 200);
    let clients = n.div_ceil(room * 9 / 10).clamp(1, 200);
    let mut notes = vec![format!(
        "RLIMIT_NOFILE {nofile}: {daemons} waypoint daemon(s) sharing the tunnel address (SO_REUSEPORT), {pods} echo pod process(es), {clients} client process(es)"
    )];
    if let Some((count, max)) = sys::conntrack() {
        if (max as usize) < 3 * n {
            notes.push(format!(
                "conntrack is loaded (nf_conntrack_max {max}, {count} in use): two tracked flows per proxied connection may fill it"
            ));
        }
    }
    eprintln!("scale: {}", notes.join("; "));

    // The pods: helper processes, one address each, one port for all.
    let port = free_port()?;
    let pod_ips: Vec<IpAddr> = (0..pods)
        .map(|i| IpAddr::from([127, 0, 1, 1 + i as u8]))
        .collect();
    let mut servers = Vec::new();
    for (i, ip) in pod_ips.iter().enumerate() {
        let h = Helper::spawn(
            &[
                "scale-server".into(),
                "--ip".into(),
                ip.to_string(),
                "--sink-ip".into(),
                format!("127.0.2.{}", i + 1),
                "--port".into(),
                port.to_string(),
            ],
            s.work.join(format!("pod-{i}.log")),
        )?;
        if h.line(IO_TIMEOUT).as_deref() != Some("ready") {
            bail!("echo pod {ip} did not start; see {}", s.work.display());
        }
        servers.push(h);
    }
    // Only the endpoint list matters to the waypoint; the in-process servers are not
    // used (port 0 keeps them out of the way).
    let registry = Servers::start(&[], IpAddr::from([127, 0, 2, 250]), 0, 1)?
        .advertising(pod_ips.clone(), port);
    let setup = Setup {
        dir: &s.work,
        servers: &registry,
        waypoint_bin: &s.waypoint_bin,
        max_connections: n + 1024,
        nofile: nofile as u64,
        log_filter: "warn",
        waypoint_args: &[],
    };
    let listen = SocketAddr::new(IpAddr::from([127, 0, 0, 1]), free_port()?);
    let mut routers = Vec::new();
    for i in 0..daemons {
        routers.push(Router::start_at(s.kind, &setup, Some(listen), i)?);
    }
    std::thread::sleep(Duration::from_millis(300));
    let rss_of = |routers: &[Router]| -> u64 {
        routers
            .iter()
            .filter_map(Router::pid)
            .map(sys::rss_tree)
            .sum()
    };
    let rss_before = rss_of(&routers);
    // The daemons' live heap (the allocator's count), beside RSS.
    let heap_of = |routers: &[Router]| -> Option<f64> {
        routers
            .iter()
            .map(|r| metric(r.admin?, "waypoint_heap_allocated_bytes"))
            .sum()
    };
    let heap_before = heap_of(&routers);

    eprintln!(
        "scale: opening {n} connections through {daemons} waypoint(s) ({}) at {listen}",
        s.kind.name()
    );
    let t_open = Instant::now();
    let per_client = n.div_ceil(clients);
    let mut helpers = Vec::new();
    for c in 0..clients {
        let count = per_client.min(n.saturating_sub(c * per_client));
        helpers.push(Helper::spawn(
            &[
                "scale-client".into(),
                "--target".into(),
                listen.to_string(),
                "--source".into(),
                format!("127.0.3.{}", c + 1),
                "--count".into(),
                count.to_string(),
                "--timeout".into(),
                s.deadline.as_secs().to_string(),
            ],
            s.work.join(format!("client-{c}.log")),
        )?);
    }
    let mut opened = 0usize;
    let mut errors = 0usize;
    let mut first_errors = Vec::new();
    for h in &helpers {
        let wait = s.deadline.saturating_sub(t_open.elapsed()) + IO_TIMEOUT;
        match h
            .line(wait)
            .and_then(|l| serde_json::from_str::<Value>(&l).ok())
        {
            Some(v) => {
                opened += v["opened"].as_u64().unwrap_or(0) as usize;
                errors += v["errors"].as_u64().unwrap_or(0) as usize;
                if let Some(e) = v["first_error"].as_str() {
                    first_errors.push(e.to_owned());
                }
            }
            None => first_errors.push("a client process did not report".into()),
        }
    }
    let open_s = t_open.elapsed().as_secs_f64();
    eprintln!("scale: {opened} established in {open_s:.1} s, {errors} failed");
    std::thread::sleep(Duration::from_secs(2));
    let admins: Vec<SocketAddr> = routers.iter().filter_map(|r| r.admin).collect();
    let parked = wait_parked(&admins, opened, PARK_WAIT);
    // Connections rewritten (`--rewrite-splice`) are not parked: counted apart.
    let rewritten: Option<f64> = admins
        .iter()
        .map(|&a| metric(a, "waypoint_rewrite_live"))
        .sum();
    let rss_peak = rss_of(&routers);
    let heap_peak = heap_of(&routers);
    let active_peak = active(&routers);
    let per_daemon: Vec<Option<f64>> = routers
        .iter()
        .map(|r| metric(r.admin?, "waypoint_active_connections"))
        .collect();

    let (mut checked, mut check_failed) = (0usize, 0usize);
    for h in &mut helpers {
        h.send("check");
    }
    for h in &helpers {
        match h
            .line(Duration::from_secs(60))
            .and_then(|l| serde_json::from_str::<Value>(&l).ok())
        {
            Some(v) => {
                checked += v["checked"].as_u64().unwrap_or(0) as usize;
                check_failed += v["failed"].as_u64().unwrap_or(0) as usize;
            }
            None => check_failed += 1,
        }
    }
    let t_close = Instant::now();
    for h in &mut helpers {
        h.send("close");
    }
    for h in helpers {
        h.finish();
    }
    let mut drained = false;
    while t_close.elapsed() < Duration::from_secs(60) {
        if active(&routers) == Some(0.0) {
            drained = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let close_s = t_close.elapsed().as_secs_f64();
    let mut alive = true;
    for r in &mut routers {
        alive &= r.alive();
        r.stop();
    }
    for h in servers {
        h.finish();
    }
    registry.shutdown();

    let ok = opened == n && errors == 0 && check_failed == 0 && drained && alive;
    let per_conn = rss_peak.saturating_sub(rss_before) as f64 / opened.max(1) as f64;
    let heap_per_conn = heap_before
        .zip(heap_peak)
        .map(|(b, p)| (p - b) / opened.max(1) as f64);
    let mib = |b: u64| b as f64 / 1048576.0;
    let mut md = format!(
        "## Scale check: {n} concurrent connections through the waypoint ({})\n\n",
        s.kind.name()
    );
    md.push_str(&format!(
        "| result | {} |\n|---|---|\n\
         | established (hello routed, pod's answer back) | {opened} of {n} in {open_s:.1} s ({:.0} conn/s) |\n\
         | failed connects | {errors}{} |\n\
         | waypoint_active_connections at the peak (sum) | {} |\n\
         | per daemon | {} |\n\
         | spot check (1 byte echoed on every 997th) | {} of {checked} ok |\n\
         | daemons' RSS before → at the peak | {:.1} MiB → {:.1} MiB ({per_conn:.0} B per connection; {} parked{}) |\n\
         | daemons' live heap per connection (the allocator's count) | {} |\n\
         | all closed and drained | {} in {close_s:.1} s |\n\
         | daemons alive throughout | {} |\n",
        if ok { "✅ passed" } else { "❌ failed" },
        opened as f64 / open_s.max(1e-9),
        first_errors
            .first()
            .map(|e| format!(" (first: {e})"))
            .unwrap_or_default(),
        active_peak.map_or("–".into(), |a| format!("{a:.0}")),
        per_daemon
            .iter()
            .map(|a| a.map_or("–".into(), |a| format!("{a:.0}")))
            .collect::<Vec<_>>()
            .join(", "),
        checked.saturating_sub(check_failed),
        mib(rss_before),
        mib(rss_peak),
        parked.map_or("–".into(), |p| format!("{p:.0}")),
        rewritten.map_or(String::new(), |r| format!(", {r:.0} rewritten")),
        heap_per_conn.map_or("–".into(), |h| format!("{h:.0} B")),
        if drained { "yes" } else { "NO" },
        if alive { "yes" } else { "NO" },
    ));
    md.push('\n');
    for note in &notes {
        md.push_str(&format!("- {note}\n"));
    }
    let doc = json!({
        "connections": n, "dataplane": s.kind.name(), "passed": ok,
        "established": opened, "failed": errors, "first_errors": first_errors,
        "open_secs": open_s, "daemons": daemons, "pods": pods, "client_processes": clients,
        "active_at_peak": active_peak, "active_per_daemon": per_daemon,
        "spot_checked": checked, "spot_check_failed": check_failed,
        "rss_before_bytes": rss_before, "rss_peak_bytes": rss_peak, "rss_bytes_per_conn": per_conn,
        "heap_bytes_per_conn": heap_per_conn,
        "parked_at_peak": parked, "rewrite_live_at_peak": rewritten,
        "drained": drained, "close_secs": close_s, "daemons_alive": alive, "rlimit_nofile": nofile,
        "notes": notes, "wall_secs": started.elapsed().as_secs_f64(),
    });
    Ok((md, doc, ok))
}
