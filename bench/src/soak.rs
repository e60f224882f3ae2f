//! The soak: thousands of mixed connections through one waypoint per dataplane, every
//! byte checked, under CPU contention, bounded in time. It proves the byte path by
//! volume: a connection that does not finish by its deadline, ends early, or carries one
//! wrong byte fails the run.
//!
//! One process holds everything but the waypoint: the clients (a runtime of their own),
//! the pod (`soak::server`, another runtime) and the busy threads. Connections speak real
//! TLS end to end (rustls both sides, the e2e's test PKI) or raw (the recorded hello with
//! the client's bytes right behind it). Each connection's plan (`soak::scenario`) is a
//! function of its seed; a failure prints the seed, both waypoint sockets' TCP state
//! (`ss`) and the waypoint's dataplane counters.

mod client;
mod netem;
mod scenario;
mod server;
mod wire;

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::Context as _;
use rustls_pki_types::ServerName;
use serde_json::json;

pub use client::Mode;
use client::{Client, Ended};
use scenario::{mix, Header, Scenario, Spec};
use waypoint_e2e::{pki, tls};

use crate::{
    hello,
    routers::{Kind, Router, Setup},
    scale,
    servers::Servers,
};

/// Failures reported in full (with `ss` and the counters); the rest are counted.
const DIAGNOSED: usize = 5;
/// How long the pod's connections may take to end after the last client finished.
const POD_CLOSE_WAIT: Duration = Duration::from_secs(15);
/// The soak's pod address (its port is the kernel's pick, the waypoint's `--pod-port`).
const POD_IP: [u8; 4] = [127, 0, 5, 1];

/// What a soak run does.
pub struct Settings {
    /// Each dataplane with the modes its connections mix.
    pub kinds: Vec<(Kind, Vec<Mode>)>,
    /// How long new connections are started, per dataplane.
    pub duration: Duration,
    /// Connections open at once.
    pub parallel: usize,
    /// Threads that keep CPUs busy meanwhile.
    pub busy: usize,
    /// A connection not finished after this long fails.
    pub deadline: Duration,
    pub seed: u64,
    /// Every connection uses this seed (replays one failed connection's plan).
    pub replay: Option<u64>,
    /// tc's netem parameters for loopback during the run (see [`netem`]).
    pub netem: Option<String>,
    pub waypoint_bin: PathBuf,
    pub work: PathBuf,
}

/// One failed connection.
#[derive(Debug)]
struct Failure {
    id: u64,
    seed: u64,
    mode: Mode,
    scenario: Scenario,
    size: u64,
    error: String,
    elapsed: Duration,
    sent: u64,
    received: u64,
    report: Option<String>,
    /// The client's port: the waypoint's log names the connection by it.
    client_port: Option<u16>,
    /// The waypoint's log lines for this connection, read after the run.
    trail: Option<String>,
    /// What the pod's side of the same connection failed with, if it did.
    pod_error: Option<String>,
}

/// Counts per (mode, scenario).
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    connections: u64,
    failed: u64,
    bytes: u64,
}

/// What one dataplane's run gave.
struct Outcome {
    kind: Kind,
    tallies: BTreeMap<(Mode, Scenario), Tally>,
    failures: Vec<Failure>,
    /// Pod-side failures of connections the clients saw succeed, or before a header.
    pod_failures: Vec<server::Failure>,
    /// Pod-side connections still open after every client finished.
    left_open: u64,
    /// Those of them past their header: id, scenario, and `ss` of the pod's side.
    left_open_report: String,
    pod_checked: u64,
    router_died: bool,
    counters: String,
    /// The waypoint's warnings and errors, on a failure.
    log: String,
    wall: Duration,
}

impl Outcome {
    fn failed(&self) -> u64 {
        self.tallies.values().map(|t| t.failed).sum::<u64>()
            + self.pod_failures.len() as u64
            + self.left_open
            + u64::from(self.router_died)
    }

    fn connections(&self) -> u64 {
        self.tallies.values().map(|t| t.connections).sum()
    }
}

/// Runs the soak on every dataplane of `s`; Ok(false) when a connection failed.
pub fn run(s: &Settings) -> anyhow::Result<bool> {
    let nofile = crate::sys::raise_nofile(65_536)?;
    let pki_dir = s.work.join("pki");
    let pki = pki::Pki::generate(
        &pki_dir,
        &[
            (hello::NAMESPACE, hello::ECHO_SERVICE),
            (hello::NAMESPACE, "soak"),
        ],
    )?;
    let server_tls = Arc::new(tls::server_config(&pki.files(hello::ECHO_SERVICE))?);
    let client_tls = tls::client_config(
        &pki.files("soak"),
        hello::ECHO_SNI,
        &pki::spiffe_id(hello::NAMESPACE, hello::ECHO_SERVICE),
    )?;
    let raw_hello = hello::with_sni(hello::ECHO_SNI)?;
    let pod = server::Server::start(
        SocketAddr::new(IpAddr::from(POD_IP), 0),
        raw_hello.clone(),
        server_tls,
    )?;
    // The waypoint only needs the endpoint list: the soak's pod as the echo service.
    let registry = Servers::start(&[], IpAddr::from([127, 0, 5, 250]), 0, 1)?
        .advertising(vec![pod.addr.ip()], pod.addr.port());
    let setup = Setup {
        dir: &s.work,
        servers: &registry,
        waypoint_bin: &s.waypoint_bin,
        max_connections: 4 * s.parallel + 1024,
        nofile,
        // Each connection's path through the dataplane (copy, move, fallback, kernel, the
        // byte counts at its end), for the account of a failed one.
        log_filter: SOAK_LOG,
        // On the impaired path a SYN or SYN-ACK is lost now and then (1 % each), and TCP
        // sends the SYN again after 1 s, then 3 s: the default 2 s deadline would fail
        // the connect to the soak's only pod after two losses in a row (seen once in
        // some 4,500 connections), which is the deadline doing its job, not the byte
        // path. 10 s covers three.
        waypoint_args: if s.netem.is_some() {
            &["--connect-timeout", "10s"]
        } else {
            &[]
        },
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("soak-client")
        .enable_all()
        .build()
        .context("building the clients' runtime")?;
    // Before the first waypoint starts, after the pod and registry: what the dataplanes
    // carry crosses the impaired path from the first connection on.
    let netem = s.netem.as_deref().map(netem::Netem::apply).transpose()?;
    eprintln!(
        "soak: {} s per dataplane, {} connections at once, {} busy thread(s), deadline {:?}, seed {}{}{}",
        s.duration.as_secs_f64(),
        s.parallel,
        s.busy,
        s.deadline,
        s.seed,
        s.replay.map(|r| format!(", every connection replays seed {r}")).unwrap_or_default(),
        netem.as_ref().map(|n| format!(", netem on lo: {}", n.spec())).unwrap_or_default()
    );
    let mut outcomes = Vec::new();
    for (kind, modes) in &s.kinds {
        let kind = *kind;
        let mut router = Router::start(kind, &setup)
            .with_context(|| format!("starting the waypoint ({})", kind.name()))?;
        let client = Client {
            target: router.echo.addr,
            hello: Arc::new(raw_hello.clone()),
            tls: tokio_rustls::TlsConnector::from(Arc::new(client_tls.clone())),
            sni: ServerName::try_from(hello::ECHO_SNI.to_owned())
                .context("the soak's SNI is no DNS name")?,
            deadline: s.deadline,
        };
        let outcome = rt.block_on(soak_one(s, kind, modes, &client, &pod, router.admin));
        let mut outcome = outcome;
        outcome.router_died = !router.alive();
        router.stop();
        if outcome.failed() > 0 {
            // The daemon's own account: the stall watchdog logs each stalled connection
            // with its sockets' state and its FLOWS records.
            if let Some(log) = router.log.as_deref() {
                outcome.log = warnings(log);
                trails(log, &mut outcome.failures);
            }
        }
        eprintln!("{}", describe(&outcome));
        outcomes.push(outcome);
    }
    drop(netem);
    rt.shutdown_background();
    pod.shutdown();
    registry.shutdown();
    println!("{}", summary(s, &outcomes));
    Ok(outcomes.iter().all(|o| o.failed() == 0))
}

/// One dataplane's run: `parallel` lanes start connections until the duration is over,
/// then every connection finishes or meets its deadline.
async fn soak_one(
    s: &Settings,
    kind: Kind,
    modes: &[Mode],
    client: &Client,
    pod: &server::Server,
    admin: Option<SocketAddr>,
) -> Outcome {
    let started = Instant::now();
    let stop_busy = Arc::new(AtomicBool::new(false));
    let busy: Vec<_> = (0..s.busy)
        .map(|_| {
            let stop = stop_busy.clone();
            std::thread::spawn(move || {
                let mut x = 0u64;
                while !stop.load(Relaxed) {
                    x = std::hint::black_box(mix(x));
                }
            })
        })
        .collect();
    if let Ok(mut f) = pod.state.failures.lock() {
        f.clear();
    }
    let pod_checked_before = pod.state.checked.load(Relaxed);
    let next = Arc::new(AtomicU64::new(0));
    let tallies = Arc::new(Mutex::new(BTreeMap::new()));
    let failures = Arc::new(Mutex::new(Vec::new()));
    let mut lanes = tokio::task::JoinSet::new();
    for _ in 0..s.parallel {
        let lane = Lane {
            client: client.clone(),
            next: next.clone(),
            tallies: tallies.clone(),
            failures: failures.clone(),
            modes: modes.to_vec(),
            seed: s.seed,
            replay: s.replay,
            until: started + s.duration,
            pod: pod.state.clone(),
            admin,
        };
        lanes.spawn(lane.run());
    }
    while lanes.join_next().await.is_some() {}
    // Every client is done: the pod's side of each connection must end too (an abort's
    // reset, every other connection's close, passed on by the waypoint).
    let wait = Instant::now();
    while pod.state.open.load(Relaxed) > 0 && wait.elapsed() < POD_CLOSE_WAIT {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left_open_report = if pod.state.open.load(Relaxed) > 0 {
        left_open_report(&pod.state).await
    } else {
        String::new()
    };
    stop_busy.store(true, Relaxed);
    for b in busy {
        let _ = b.join();
    }
    let tallies = std::mem::take(&mut *tallies.lock().unwrap_or_else(|p| p.into_inner()));
    let mut failures = std::mem::take(&mut *failures.lock().unwrap_or_else(|p| p.into_inner()));
    failures.sort_by_key(|f| f.id);
    // Pod-side failures of connections whose client failed are that failure, seen from
    // the other end (shown with it); the rest count on their own.
    let mut pod_failures = Vec::new();
    if let Ok(f) = pod.state.failures.lock() {
        for pf in f.iter() {
            match failures.iter_mut().find(|c| pf.id == Some(c.id)) {
                Some(c) => c.pod_error = Some(pf.error.clone()),
                None => pod_failures.push(pf.clone()),
            }
        }
    }
    let counters = match admin {
        Some(a) => tokio::task::spawn_blocking(move || counters(a))
            .await
            .unwrap_or_default(),
        None => String::new(),
    };
    Outcome {
        kind,
        tallies,
        failures,
        pod_failures,
        left_open: pod.state.open.load(Relaxed),
        left_open_report,
        pod_checked: pod.state.checked.load(Relaxed) - pod_checked_before,
        router_died: false,
        counters,
        log: String::new(),
        wall: started.elapsed(),
    }
}

/// One of the soak's parallel connection loops.
struct Lane {
    client: Client,
    next: Arc<AtomicU64>,
    tallies: Arc<Mutex<BTreeMap<(Mode, Scenario), Tally>>>,
    failures: Arc<Mutex<Vec<Failure>>>,
    modes: Vec<Mode>,
    seed: u64,
    replay: Option<u64>,
    until: Instant,
    pod: Arc<server::State>,
    admin: Option<SocketAddr>,
}

impl Lane {
    async fn run(self) {
        while Instant::now() < self.until {
            let id = self.next.fetch_add(1, Relaxed);
            let seed = self.replay.unwrap_or_else(|| mix(self.seed ^ mix(id)));
            let spec = Spec::from_seed(seed);
            let mode = self.modes[(mix(seed ^ 0x6d6f_6465) % self.modes.len() as u64) as usize];
            let header = Header {
                id,
                spec: spec.clone(),
            };
            let progress = wire::Progress::default();
            let Ended {
                result,
                socket,
                elapsed,
            } = self.client.run(&header, mode, &progress).await;
            let received = progress.received.load(Relaxed);
            let failed = result.is_err();
            if let Ok(mut t) = self.tallies.lock() {
                let t = t.entry((mode, spec.scenario)).or_default();
                t.connections += 1;
                t.failed += u64::from(failed);
                t.bytes += received;
            }
            let Err(error) = result else { continue };
            let diagnose = self
                .failures
                .lock()
                .map(|f| f.len() < DIAGNOSED)
                .unwrap_or(false);
            let report = if diagnose {
                Some(self.report(socket.as_ref(), id).await)
            } else {
                None
            };
            let client_port = socket
                .as_ref()
                .and_then(|s| s.local_addr().ok())
                .map(|a| a.port());
            drop(socket);
            if let Ok(mut f) = self.failures.lock() {
                f.push(Failure {
                    id,
                    seed,
                    mode,
                    scenario: spec.scenario,
                    size: spec.size,
                    error: error.to_string(),
                    elapsed,
                    sent: progress.sent.load(Relaxed),
                    received,
                    report,
                    client_port,
                    trail: None,
                    pod_error: None,
                });
            }
        }
    }

    /// Both of the waypoint's sockets of a failed connection as `ss` shows them (found by
    /// the client's port and by the port the waypoint dialed the pod from), and the
    /// waypoint's counters, taken while the connection is still open.
    async fn report(&self, socket: Option<&tokio::net::TcpStream>, id: u64) -> String {
        let mut out = String::new();
        let client_port = socket.and_then(|s| s.local_addr().ok()).map(|a| a.port());
        let pod_port = self
            .pod
            .peers
            .lock()
            .ok()
            .and_then(|p| p.get(&id).map(|(addr, _)| addr.port()));
        for (what, port) in [("client side", client_port), ("pod side", pod_port)] {
            let Some(port) = port else {
                let _ = writeln!(out, "  {what}: no socket known");
                continue;
            };
            let _ = writeln!(out, "  {what} (port {port}):");
            out.push_str(&sockets_on(port).await);
        }
        if let Some(a) = self.admin {
            let c = tokio::task::spawn_blocking(move || counters(a))
                .await
                .unwrap_or_default();
            let _ = writeln!(out, "  waypoint counters then:\n{c}");
        }
        out
    }
}

/// The waypoint's dataplane counters (its /metrics, the lines that tell how bytes
/// moved), indented.
fn counters(admin: SocketAddr) -> String {
    const SHOWN: [&str; 5] = [
        "waypoint_ebpf_",
        "waypoint_dataplane_",
        "waypoint_rewrite_connections_total",
        "waypoint_rewrite_packets_total",
        "waypoint_connections_total",
    ];
    let Some(text) = scale::metrics_text(admin) else {
        return "    (the waypoint's /metrics did not answer)\n".into();
    };
    let mut out = String::new();
    for l in text.lines() {
        if SHOWN.iter().any(|p| l.starts_with(p)) && !l.ends_with(" 0") {
            let _ = writeln!(out, "    {l}");
        }
    }
    out
}

/// Warnings and errors in the waypoint's log (its last [`LOG_LINES`]), indented, colour
/// codes taken out.
fn warnings(log: &std::path::Path) -> String {
    let Ok(text) = std::fs::read_to_string(log) else {
        return format!("    (no log at {})\n", log.display());
    };
    let lines: Vec<String> = text
        .lines()
        .map(plain)
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .collect();
    let mut out = String::new();
    for l in &lines[lines.len().saturating_sub(LOG_LINES)..] {
        let _ = writeln!(out, "    {l}");
    }
    out
}

/// A log line with its ANSI colour codes taken out.
fn plain(l: &str) -> String {
    let mut out = String::with_capacity(l.len());
    let mut chars = l.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // An ANSI colour sequence: ESC [ ... m.
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The pod-side connections still open (those past their header), each with `ss` of
/// the socket pair between the waypoint and the pod.
async fn left_open_report(pod: &server::State) -> String {
    let open: Vec<(u64, SocketAddr, Scenario)> = pod
        .peers
        .lock()
        .map(|p| p.iter().map(|(id, (a, s))| (*id, *a, *s)).collect())
        .unwrap_or_default();
    let mut out = String::new();
    for (id, addr, scenario) in open {
        let port = addr.port();
        let _ = writeln!(
            out,
            "  open: connection {id} ({}), the waypoint's socket to the pod on port {port}:",
            scenario.name()
        );
        out.push_str(&sockets_on(port).await);
    }
    out
}

/// `ss` of the TCP sockets on `port` (either end), each line indented.
async fn sockets_on(port: u16) -> String {
    let filter = format!("( sport = :{port} or dport = :{port} )");
    let ss = tokio::process::Command::new("ss")
        .args(["-tniem", "state", "all", &filter])
        .output()
        .await;
    let text = match ss {
        Ok(o) => String::from_utf8_lossy(&o.stdout).into_owned(),
        Err(e) => format!("ss: {e}"),
    };
    let mut out = String::new();
    for l in text.lines() {
        let _ = writeln!(out, "    {}", l.trim_end());
    }
    out
}

/// Lines of the waypoint's log a failed run shows.
const LOG_LINES: usize = 20;

/// The soak's waypoint logs each connection's path through the dataplane (a few debug
/// lines per connection).
const SOAK_LOG: &str = "warn,waypoint::router=debug,waypoint::dataplane=debug";

/// Lines of the waypoint's log about one connection that a failure shows at most.
const TRAIL_LINES: usize = 40;

/// Connections from a failure's client port that its account shows (a port is reused
/// over a run; the waypoint numbers its connections, so each shows as its own).
const TRAIL_CONNECTIONS: usize = 3;

/// Fills in each diagnosed failure's `trail`: the waypoint's log lines in the spans of
/// the last connections from the failure's client port.
fn trails(log: &std::path::Path, failures: &mut [Failure]) {
    let Ok(text) = std::fs::read_to_string(log) else {
        return;
    };
    // The waypoint's connection number, from the span: `conn{id=N peer=...}`.
    let conn = |l: &str| {
        l.split("conn{id=")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .map(str::to_owned)
    };
    for f in failures.iter_mut().filter(|f| f.report.is_some()) {
        let Some(port) = f.client_port else { continue };
        let key = format!("peer=127.0.0.1:{port}}}");
        let lines: Vec<String> = text
            .lines()
            .map(plain)
            .filter(|l| l.contains(&key))
            .collect();
        let mut ids: Vec<String> = Vec::new();
        for id in lines.iter().filter_map(|l| conn(l)) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        let shown = &ids[ids.len().saturating_sub(TRAIL_CONNECTIONS)..];
        let picked: Vec<&String> = lines
            .iter()
            .filter(|l| conn(l).is_some_and(|id| shown.contains(&id)))
            .collect();
        let mut trail = String::new();
        for l in &picked[picked.len().saturating_sub(TRAIL_LINES)..] {
            let _ = writeln!(trail, "    {l}");
        }
        if trail.is_empty() {
            trail = format!("    (no line names {key})\n");
        }
        f.trail = Some(trail);
    }
}

/// One dataplane's result, for the log as it goes.
fn describe(o: &Outcome) -> String {
    let mut out = format!(
        "soak {}: {} connections, {} failed, {:.1} GB checked at the pod, {:.0} s",
        o.kind.name(),
        o.connections(),
        o.failed(),
        o.pod_checked as f64 / 1e9,
        o.wall.as_secs_f64()
    );
    for f in &o.failures {
        let _ = write!(
            out,
            "\n  FAILED connection {} ({} {}, size {}, replay with --replay {}): {} after {:.1} s, sent {} B, received {} B",
            f.id,
            f.mode.name(),
            f.scenario.name(),
            f.size,
            f.seed,
            f.error,
            f.elapsed.as_secs_f64(),
            f.sent,
            f.received
        );
        if let Some(e) = &f.pod_error {
            let _ = write!(out, "\n  the pod's side of it failed: {e}");
        }
        if let Some(r) = &f.report {
            let _ = write!(out, "\n{}", r.trim_end());
        }
        if let Some(t) = &f.trail {
            let _ = write!(out, "\n  the waypoint's log of it:\n{}", t.trim_end());
        }
    }
    for f in &o.pod_failures {
        let _ = write!(
            out,
            "\n  FAILED at the pod: connection {} ({}): {}",
            f.id.map_or("before its header".into(), |i| i.to_string()),
            f.scenario.map_or("?", Scenario::name),
            f.error
        );
    }
    if o.left_open > 0 {
        let _ = write!(
            out,
            "\n  FAILED: {} pod-side connection(s) still open {} s after every client finished",
            o.left_open,
            POD_CLOSE_WAIT.as_secs()
        );
        let _ = write!(out, "\n{}", o.left_open_report.trim_end());
    }
    if o.router_died {
        let _ = write!(out, "\n  FAILED: the waypoint exited during the run");
    }
    if !o.log.is_empty() {
        let _ = write!(out, "\n  the waypoint's warnings:\n{}", o.log.trim_end());
    }
    if !o.counters.is_empty() {
        let _ = write!(out, "\n  counters at the end:\n{}", o.counters.trim_end());
    }
    out
}

/// The closing table: per dataplane, mode and scenario, connections, failures and bytes
/// the clients checked; then the JSON line the docs quote from.
fn summary(s: &Settings, outcomes: &[Outcome]) -> String {
    let mut out = String::from(
        "\n| dataplane | mode | scenario | connections | failed | MB checked by clients |\n|---|---|---|---|---|---|\n",
    );
    for o in outcomes {
        for ((mode, scenario), t) in &o.tallies {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {:.1} |",
                o.kind.name(),
                mode.name(),
                scenario.name(),
                t.connections,
                t.failed,
                t.bytes as f64 / 1e6
            );
        }
    }
    let mut total = json!({});
    for o in outcomes {
        total[o.kind.name()] = json!({
            "connections": o.connections(),
            "failed": o.failed(),
            "pod_bytes_checked": o.pod_checked,
            "seconds": o.wall.as_secs_f64(),
        });
    }
    let _ = writeln!(
        out,
        "\nsoak seed {} ({} s per dataplane, {} at once, {} busy{}): {}",
        s.seed,
        s.duration.as_secs_f64(),
        s.parallel,
        s.busy,
        s.netem
            .as_deref()
            .map(|n| format!(", netem {n}"))
            .unwrap_or_default(),
        total
    );
    // Every failure counts against the connections, also those that are no one
    // connection's (a pod-side failure before the header, a connection left open, the
    // waypoint's exit).
    let failed: u64 = outcomes.iter().map(Outcome::failed).sum();
    let connections: u64 = outcomes.iter().map(Outcome::connections).sum();
    let passed = connections.saturating_sub(failed);
    let _ = write!(out, "soak: {passed} passed, {failed} failed");
    out
}
