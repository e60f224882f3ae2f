//! The comparison run: in each repetition starts, measures and stops every router in
//! turn (repetition-major, so a burst of background load spoils one run of several
//! routers rather than every run of one; one router at a time, so none taxes another's
//! figures), and collects the samples.

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use crate::{
    cli::Figure,
    load::{self, Bulk, Latency},
    routers::{Kind, Router, Setup},
    servers::Servers,
    sys,
};

/// How long and how much of everything.
#[derive(Clone, Debug)]
pub struct Settings {
    pub quick: bool,
    pub reps: usize,
    pub warmup: Duration,
    pub duration: Duration,
    pub bulk_conns: Vec<usize>,
    pub pings_warmup: usize,
    pub pings: usize,
    pub setups: usize,
    /// Round trips of the wake figure, each after `wake_pause` idle.
    pub wakes: usize,
    pub wake_pause: Duration,
    /// Concurrent openers of the churn figure, one run each.
    pub churn_openers: Vec<usize>,
    /// How long each churn run opens connections.
    pub churn_duration: Duration,
    pub idle_conns: usize,
    /// RLIMIT_NOFILE of this process and the routers.
    pub nofile: u64,
    pub kinds: Vec<Kind>,
    pub waypoint_bin: PathBuf,
    /// Temporary directory for the routers' configs and logs.
    pub work: PathBuf,
    /// The CPU every process is pinned to in the pinned measurements.
    pub pin_cpu: usize,
    /// The figures measured (`--figures`).
    pub figures: Vec<Figure>,
}

impl Settings {
    fn wants(&self, f: Figure) -> bool {
        self.figures.contains(&f)
    }
}

/// Memory of a fresh router holding idle connections.
#[derive(Clone, Debug)]
pub struct Memory {
    pub rss_before: u64,
    pub rss_after: u64,
    pub opened: usize,
    pub wanted: usize,
    /// Why fewer than `wanted` were opened.
    pub error: Option<String>,
    /// The waypoint's `waypoint_connections_parked` when RSS was read (None: not a
    /// waypoint, or its admin server did not answer).
    pub parked: Option<f64>,
    /// The waypoint's `waypoint_heap_allocated_bytes` beside each RSS reading (None: not
    /// a waypoint): its live heap, which RSS cannot tell from freed memory kept for reuse.
    pub heap: Option<(f64, f64)>,
}

impl Memory {
    pub fn per_conn(&self) -> f64 {
        if self.opened == 0 {
            return f64::NAN;
        }
        self.rss_after.saturating_sub(self.rss_before) as f64 / self.opened as f64
    }

    /// Live heap bytes per connection (the allocator's count), where known.
    pub fn heap_per_conn(&self) -> Option<f64> {
        let (before, after) = self.heap?;
        (self.opened > 0).then(|| (after - before) / self.opened as f64)
    }
}

/// One run of the setup figure.
#[derive(Clone, Debug)]
pub struct SetupRun {
    pub latency: Latency,
    pub conn_per_s: f64,
    /// CPU time the router's processes ran per connection, µs (NaN: no router).
    pub router_cpu_us: f64,
    /// CPU time this process (load generator and servers) ran per connection, µs.
    pub bench_cpu_us: f64,
}

/// One run of the churn figure.
#[derive(Clone, Debug)]
pub struct ChurnRun {
    pub conn_per_s: f64,
    /// Opens cut short by a reset.
    pub resets: u64,
    /// Opens that failed otherwise.
    pub failed: u64,
    /// CPU time the router's processes ran per completed connection, µs (NaN: no
    /// router).
    pub router_cpu_us: f64,
}

/// Everything measured for one router.
#[derive(Debug)]
pub struct Results {
    pub kind: Kind,
    /// Per connection count in `Settings::bulk_conns` order.
    pub bulk: Vec<Vec<Bulk>>,
    /// [unpinned, pinned].
    pub ping: [Vec<Latency>; 2],
    /// [unpinned, pinned].
    pub setup: [Vec<SetupRun>; 2],
    /// Round trips after an idle pause, unpinned.
    pub wake: Vec<Latency>,
    /// Per opener count in `Settings::churn_openers` order, unpinned.
    pub churn: Vec<Vec<ChurnRun>>,
    pub memory: Vec<Memory>,
    /// The waypoint's connections by the path they took and why
    /// (`waypoint_dataplane_path_total`), summed over its measured turns.
    pub paths: std::collections::BTreeMap<(String, String), f64>,
    /// Rewritten connections whose linger the daemon cut short
    /// (`waypoint_rewrite_lingers_cut_total`), summed over its measured turns.
    pub lingers_cut: f64,
    pub errors: Vec<String>,
}

/// A quiet-machine check, taken before each repetition while nothing of ours runs.
#[derive(Clone, Debug)]
pub struct Probe {
    pub rep: usize,
    pub idle_pct: f64,
    pub loadavg: String,
    /// The busiest other processes over the probe (name, CPU s).
    pub top: Vec<(String, f64)>,
}

/// The whole run.
pub struct Run {
    pub settings: Settings,
    pub results: Vec<Results>,
    pub probes: Vec<Probe>,
    pub hz: f64,
    pub wall_s: f64,
    pub loadavg_after: String,
}

/// Idle share below which the machine counts as busy.
pub const BUSY_IDLE_PCT: f64 = 90.0;
/// Other processes' CPU share of one CPU during a bulk window beyond which it was busy.
pub const BUSY_FOREIGN_SHARE: f64 = 0.05;

pub fn run(s: Settings, servers: &Servers) -> anyhow::Result<Run> {
    let hz = sys::hz();
    let me = std::process::id() as i32;
    let started = Instant::now();
    let setup = Setup {
        dir: &s.work,
        servers,
        waypoint_bin: &s.waypoint_bin,
        max_connections: s.idle_conns + 1024,
        nofile: s.nofile,
        log_filter: "warn",
        waypoint_args: &[],
    };
    // The memory runs start second instances: their configs, pid files and logs go apart.
    let mem_dir = s.work.join("memory");
    std::fs::create_dir_all(&mem_dir)?;
    let mem_setup = Setup {
        dir: &mem_dir,
        ..setup
    };
    // Each router runs only while it is measured: the waypoint's rewrite program sits on
    // every interface's ingress, lo included, and would run (and find nothing) for every
    // packet of the others too, direct TCP's included. Each is started once first, so
    // that one that cannot start fails the run before any measurement.
    for &kind in &s.kinds {
        eprintln!("starting {}", kind.name());
        Router::start(kind, &setup)?.stop();
    }
    let mut results: Vec<Results> = s
        .kinds
        .iter()
        .map(|&kind| Results {
            kind,
            bulk: vec![Vec::new(); s.bulk_conns.len()],
            ping: [Vec::new(), Vec::new()],
            setup: [Vec::new(), Vec::new()],
            wake: Vec::new(),
            churn: vec![Vec::new(); s.churn_openers.len()],
            memory: Vec::new(),
            paths: std::collections::BTreeMap::new(),
            lingers_cut: 0.0,
            errors: Vec::new(),
        })
        .collect();
    let mut probes = Vec::new();
    for rep in 1..=s.reps {
        let probe = Probe {
            rep,
            idle_pct: sys::idle_probe(Duration::from_secs(1))?,
            loadavg: sys::loadavg().1,
            top: sys::top_foreign(&[me], Duration::from_millis(500), hz),
        };
        eprintln!(
            "[rep {rep}] quiet check: idle {:.0}%, loadavg {}{}",
            probe.idle_pct,
            probe.loadavg,
            if probe.idle_pct < BUSY_IDLE_PCT {
                format!(" — BUSY: {}", top_line(&probe.top))
            } else {
                String::new()
            }
        );
        probes.push(probe);
        for out in results.iter_mut() {
            match Router::start(out.kind, &setup) {
                Ok(mut r) => {
                    measure(&s, servers, &r, out, rep, me, hz);
                    for (key, n) in r.admin.map(paths).unwrap_or_default() {
                        *out.paths.entry(key).or_default() += n;
                    }
                    out.lingers_cut += r
                        .admin
                        .and_then(|a| crate::scale::metric(a, "waypoint_rewrite_lingers_cut_total"))
                        .unwrap_or(0.0);
                    r.stop();
                }
                Err(e) => {
                    eprintln!("[rep {rep}] {:<8} FAILED to start: {e}", out.kind.name());
                    out.errors.push(format!("rep {rep} start: {e}"));
                }
            }
        }
        for (kind, out) in s.kinds.iter().zip(results.iter_mut()) {
            if *kind == Kind::Direct || !s.wants(Figure::Memory) || !kind.measures(Figure::Memory) {
                continue;
            }
            match memory(&s, &mem_setup, *kind) {
                Ok(m) => {
                    if let Some(e) = &m.error {
                        out.errors.push(format!(
                            "rep {rep} memory: only {} of {} idle connections opened ({e}); the figure is over those",
                            m.opened, m.wanted
                        ));
                    }
                    eprintln!(
                        "[rep {rep}] {:<8} memory: {} idle connections{}, RSS {:.1} → {:.1} MiB, {:.0} B/conn{}",
                        kind.name(),
                        m.opened,
                        m.parked.map_or(String::new(), |p| format!(" ({p} parked)")),
                        m.rss_before as f64 / 1048576.0,
                        m.rss_after as f64 / 1048576.0,
                        m.per_conn(),
                        m.heap_per_conn()
                            .map_or(String::new(), |h| format!("; live heap {h:.0} B/conn"))
                    );
                    out.memory.push(m);
                }
                Err(e) => {
                    eprintln!("[rep {rep}] {:<8} memory FAILED: {e:#}", kind.name());
                    out.errors.push(format!("rep {rep} memory: {e:#}"));
                }
            }
        }
    }
    Ok(Run {
        settings: s,
        results,
        probes,
        hz,
        wall_s: started.elapsed().as_secs_f64(),
        loadavg_after: sys::loadavg().1,
    })
}

pub fn top_line(top: &[(String, f64)]) -> String {
    top.iter()
        .map(|(n, s)| format!("{n} {s:.2}s"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One repetition of every throughput and latency figure for one router. A failing
/// figure is recorded and the rest still run.
fn measure(
    s: &Settings,
    servers: &Servers,
    r: &Router,
    out: &mut Results,
    rep: usize,
    me: i32,
    hz: f64,
) {
    let name = r.kind.name();
    for (i, &conns) in s.bulk_conns.iter().enumerate() {
        if !s.wants(Figure::Bulk) {
            break;
        }
        match load::bulk(&r.sink, servers, conns, s.warmup, s.duration, &[me], hz) {
            Ok(b) => {
                let busy = b.foreign_s / b.secs > BUSY_FOREIGN_SHARE;
                eprintln!(
                    "[rep {rep}] {name:<8} bulk x{conns:<3} {:6.2} Gbit/s, {:.2} CPU s/GB, idle {:.0}%{}",
                    b.gbps(),
                    b.cpu_s_per_gb(hz),
                    b.cpu.idle_pct(),
                    if busy {
                        format!(" (other processes took {:.0}% of a CPU)", 100.0 * b.foreign_s / b.secs)
                    } else {
                        String::new()
                    }
                );
                out.bulk[i].push(b);
            }
            Err(e) => {
                eprintln!("[rep {rep}] {name:<8} bulk x{conns} FAILED: {e}");
                out.errors.push(format!("rep {rep} bulk x{conns}: {e}"));
            }
        }
    }
    for (slot, pinned) in [(0, false), (1, true)] {
        if !s.wants(Figure::Latency) && !s.wants(Figure::Setup) && !s.wants(Figure::Wake) {
            break;
        }
        if pinned {
            match sys::pin(&[me], Some(s.pin_cpu)) {
                Ok(refused) if !refused.is_empty() => eprintln!(
                    "[rep {rep}] {name:<8} note: threads that could not be pinned: {}",
                    refused.join(", ")
                ),
                Ok(_) => {}
                Err(e) => {
                    out.errors.push(format!("rep {rep} pinning: {e}"));
                    continue;
                }
            }
        }
        let label = if pinned { "pinned" } else { "unpinned" };
        if !pinned && s.wants(Figure::Wake) {
            match load::after_idle(&r.echo, s.wake_pause, s.wakes) {
                Ok(l) => {
                    eprintln!(
                        "[rep {rep}] {name:<8} round trip after {} ms idle: p50 {:.1} µs, p99 {:.1}",
                        s.wake_pause.as_millis(),
                        l.p50,
                        l.p99
                    );
                    out.wake.push(l);
                }
                Err(e) => {
                    eprintln!("[rep {rep}] {name:<8} wake FAILED: {e}");
                    out.errors.push(format!("rep {rep} wake: {e}"));
                }
            }
        }
        if s.wants(Figure::Latency) {
            match load::ping_pong(&r.echo, s.pings_warmup, s.pings) {
                Ok(l) => {
                    eprintln!(
                        "[rep {rep}] {name:<8} ping-pong {label}: p50 {:.1} µs, p99 {:.1}, p99.9 {:.1}",
                        l.p50, l.p99, l.p999
                    );
                    out.ping[slot].push(l);
                }
                Err(e) => {
                    eprintln!("[rep {rep}] {name:<8} ping-pong {label} FAILED: {e}");
                    out.errors.push(format!("rep {rep} ping-pong {label}: {e}"));
                }
            }
        }
        if s.wants(Figure::Setup) && r.kind.measures(Figure::Setup) {
            // Where each connection's CPU goes: the router's own processes, or this
            // one (the client's and the server's sockets, and the kernel's work for the
            // packets they send). The scheduler's clock: no tracer slows the run down.
            let cpu_before = (r.pid().map(sys::cpu_ns_tree), sys::cpu_ns_self());
            match load::setup(&r.echo, servers, s.setups) {
                Ok((l, rate)) => {
                    // The waypoint's end of each connection too (the rewrite splice's
                    // comes 3 s after the close); and none of it in the next figure.
                    if let Some(admin) = r.admin {
                        if !crate::scale::wait_closed(admin, crate::scale::CLOSE_WAIT) {
                            out.errors.push(format!(
                                "rep {rep} setup {label}: connections still open {:?} after the run; its CPU figure is short of their end",
                                crate::scale::CLOSE_WAIT
                            ));
                        }
                    }
                    let per_conn = |ns: u64| ns as f64 / 1e3 / s.setups as f64;
                    let router_cpu_us = match (r.pid(), cpu_before.0) {
                        (Some(pid), Some(before)) => {
                            per_conn(sys::cpu_ns_tree(pid).saturating_sub(before))
                        }
                        _ => f64::NAN,
                    };
                    let bench_cpu_us = per_conn(sys::cpu_ns_self().saturating_sub(cpu_before.1));
                    eprintln!(
                        "[rep {rep}] {name:<8} setup {label}: p50 {:.1} µs, p99 {:.1}, {rate:.0} conn/s; CPU per conn: router {router_cpu_us:.1} µs, load generator and servers {bench_cpu_us:.1} µs",
                        l.p50, l.p99
                    );
                    out.setup[slot].push(SetupRun {
                        latency: l,
                        conn_per_s: rate,
                        router_cpu_us,
                        bench_cpu_us,
                    });
                }
                Err(e) => {
                    eprintln!("[rep {rep}] {name:<8} setup {label} FAILED: {e}");
                    out.errors.push(format!("rep {rep} setup {label}: {e}"));
                }
            }
        }
        if pinned {
            if let Err(e) = sys::pin(&[me], None) {
                out.errors.push(format!("rep {rep} unpinning: {e}"));
            }
        }
    }
    if !s.wants(Figure::Churn) || !r.kind.measures(Figure::Churn) {
        return;
    }
    for (i, &openers) in s.churn_openers.iter().enumerate() {
        let cpu_before = r.pid().map(sys::cpu_ns_tree);
        match load::churn(&r.echo, servers, openers, s.churn_duration) {
            Ok(c) => {
                // The waypoint's end of each connection too, and none of it in the next
                // run (the rewrite splice's comes 3 s after the close).
                if let Some(admin) = r.admin {
                    if !crate::scale::wait_closed(admin, crate::scale::CLOSE_WAIT) {
                        out.errors.push(format!(
                            "rep {rep} churn x{openers}: connections still open {:?} after the run",
                            crate::scale::CLOSE_WAIT
                        ));
                    }
                }
                let router_cpu_us = match (r.pid(), cpu_before) {
                    (Some(pid), Some(before)) if c.completed > 0 => {
                        sys::cpu_ns_tree(pid).saturating_sub(before) as f64
                            / 1e3
                            / c.completed as f64
                    }
                    _ => f64::NAN,
                };
                eprintln!(
                    "[rep {rep}] {name:<8} churn x{openers:<3} {:.0} conn/s, {} resets, {} failed; router CPU per conn {router_cpu_us:.1} µs{}",
                    c.conn_per_s(),
                    c.resets,
                    c.failed,
                    c.first_error
                        .as_ref()
                        .map_or(String::new(), |e| format!("; first failure: {e}"))
                );
                out.churn[i].push(ChurnRun {
                    conn_per_s: c.conn_per_s(),
                    resets: c.resets,
                    failed: c.failed,
                    router_cpu_us,
                });
            }
            Err(e) => {
                eprintln!("[rep {rep}] {name:<8} churn x{openers} FAILED: {e}");
                out.errors.push(format!("rep {rep} churn x{openers}: {e}"));
            }
        }
    }
}

/// A fresh router of `kind` (so earlier runs' allocations do not hide the growth) holding
/// `idle_conns` established, idle connections.
fn memory(s: &Settings, setup: &Setup<'_>, kind: Kind) -> anyhow::Result<Memory> {
    let mut r = Router::start(kind, setup)?;
    let pid = r
        .pid()
        .ok_or_else(|| anyhow::anyhow!("{} has no process", kind.name()))?;
    std::thread::sleep(Duration::from_millis(300));
    let heap = || {
        r.admin
            .and_then(|a| crate::scale::metric(a, "waypoint_heap_allocated_bytes"))
    };
    let heap_before = heap();
    let rss_before = sys::rss_tree(pid);
    let (conns, err) = load::open_idle(&r.echo, s.idle_conns);
    // Let the router finish its per-connection work (eBPF insertion), and the waypoint
    // park its idle connections (one to two times --park-after after their last byte).
    std::thread::sleep(Duration::from_secs(1));
    let opened = conns.len();
    // Splice never parks: nothing to wait for.
    let parked = r
        .admin
        .filter(|_| kind != Kind::Splice)
        .and_then(|a| crate::scale::wait_parked(&[a], opened, crate::scale::PARK_WAIT));
    let rss_after = sys::rss_tree(pid);
    let heap = heap_before.zip(heap());
    drop(conns);
    r.stop();
    let m = Memory {
        rss_before,
        rss_after,
        opened,
        wanted: s.idle_conns,
        error: err.map(|e| e.to_string()),
        parked,
        heap,
    };
    // A router that stops accepting part way (out of file descriptors: splice holds two
    // pipes per connection) still gives a per-connection figure, flagged.
    if opened < s.idle_conns / 10 {
        anyhow::bail!(
            "opened {opened} of {} idle connections: {}",
            s.idle_conns,
            m.error.as_deref().unwrap_or("no error")
        );
    }
    Ok(m)
}

/// The waypoint's `waypoint_dataplane_path_total` samples at `admin` (empty when its
/// /metrics does not answer).
fn paths(admin: std::net::SocketAddr) -> Vec<((String, String), f64)> {
    crate::scale::metrics_text(admin).map_or_else(Vec::new, |t| parse_paths(&t))
}

/// `waypoint_dataplane_path_total` in an exposition: (path, reason) → connections.
fn parse_paths(text: &str) -> Vec<((String, String), f64)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("waypoint_dataplane_path_total{"))
        .filter_map(|l| {
            let (labels, value) = l.split_once("} ")?;
            let label = |name: &str| {
                let rest = labels.split(&format!("{name}=\"")).nth(1)?;
                Some(rest.split('"').next()?.to_owned())
            };
            Some((
                (label("path")?, label("reason")?),
                value.trim().parse().ok()?,
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    /// The path counts are read off the exposition by label, whatever their order, and
    /// nothing else is taken for them.
    #[test]
    fn path_samples_are_read_by_label() {
        let text = "# TYPE waypoint_dataplane_path counter\n\
            waypoint_dataplane_path_total{path=\"rewrite\",reason=\"qualified\"} 7\n\
            waypoint_dataplane_path_total{reason=\"busy\",path=\"redirect\"} 2\n\
            waypoint_dataplane_stalls_total{dataplane=\"ebpf\"} 0\n";
        let key = |p: &str, r: &str| (p.to_owned(), r.to_owned());
        assert_eq!(
            super::parse_paths(text),
            [
                (key("rewrite", "qualified"), 7.0),
                (key("redirect", "busy"), 2.0)
            ]
        );
    }
}
