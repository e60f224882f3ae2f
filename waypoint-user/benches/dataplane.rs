//! Dataplane benchmark: direct TCP vs the eBPF, splice and copy dataplanes, side by side
//! in one run on loopback.
//!
//! Run as root (the eBPF variants load programs):
//! `cargo bench -p waypoint-user --bench dataplane -- [--quick] [--json PATH] [--only a,b]`
//!
//! Per dataplane it measures bulk throughput (1 and 8 streams, client → proxy → discarding
//! sink), ping-pong latency (64-byte round trips through an echo server) and CPU cost.
//! CPU cost is machine-wide (/proc/stat), because the eBPF path does its work in softirq
//! and kworkers that no per-process figure would show.
//!
//! The proxy runs on its own 2-worker tokio runtime; the load generator and the servers
//! are plain threads with blocking sockets, so the proxy never competes with them for its
//! runtime's workers (only for the 2 CPUs, like a real node would).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "benchmark")]

use std::{
    fmt::Write as _,
    io::{self, Read as _, Write as _},
    net::{Shutdown, SocketAddr, TcpListener as StdListener, TcpStream as StdStream},
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use tokio::{io::AsyncReadExt as _, net::TcpListener, runtime::Runtime};
use waypoint::dataplane::{copy::UserspaceCopy, ebpf, splice::Splice, Dataplane, End, Limits};

/// Size of the fixed first message, standing in for a TLS ClientHello.
const HELLO_LEN: usize = 517;
/// Size of the servers' answer to the hello, standing in for the start of a ServerHello.
/// Clients wait for it before sending more (as TLS does), unless `--eager`.
const REPLY_LEN: usize = 128;
/// Ping-pong message size.
const PING_LEN: usize = 64;
/// Write and read chunk of the bulk client and sink.
const CHUNK: usize = 256 * 1024;
/// Name of the proxy runtime's threads, used to find their CPU time in /proc/self/task.
const PROXY_THREAD: &str = "wp-proxy";
/// Upper bound for any teardown wait: a stuck dataplane must not hang the benchmark.
const TEARDOWN_TIMEOUT: Duration = Duration::from_secs(30);

struct Settings {
    quick: bool,
    /// Bulk clients stream right after the hello instead of waiting for the reply.
    eager: bool,
    json: Option<String>,
    only: Option<Vec<String>>,
    reps: usize,
    warmup: Duration,
    duration: Duration,
    pings_warmup: usize,
    pings: usize,
}

fn settings() -> Settings {
    let mut quick = false;
    let mut eager = false;
    let mut json = None;
    let mut only = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => quick = true,
            "--eager" => eager = true,
            "--json" => json = Some(args.next().expect("--json needs a path")),
            "--only" => {
                only = Some(
                    args.next()
                        .expect("--only needs a comma-separated list of variants")
                        .split(',')
                        .map(str::to_owned)
                        .collect(),
                );
            }
            // `cargo bench` passes `--bench`; ignore it and any libtest-style filters.
            _ => {}
        }
    }
    if quick {
        Settings {
            quick,
            eager,
            json,
            only,
            reps: 1,
            warmup: Duration::from_millis(250),
            duration: Duration::from_secs(1),
            pings_warmup: 200,
            pings: 2_000,
        }
    } else {
        Settings {
            quick,
            eager,
            json,
            only,
            reps: 3,
            warmup: Duration::from_millis(500),
            duration: Duration::from_secs(3),
            pings_warmup: 2_000,
            pings: 20_000,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Machine and process CPU accounting.

/// Jiffies from the aggregate `cpu` line of /proc/stat.
#[derive(Clone, Copy, Default)]
struct CpuStat {
    user: u64,
    nice: u64,
    system: u64,
    idle: u64,
    iowait: u64,
    irq: u64,
    softirq: u64,
    steal: u64,
}

impl CpuStat {
    fn read() -> CpuStat {
        let text = std::fs::read_to_string("/proc/stat").expect("read /proc/stat");
        let line = text.lines().next().expect("/proc/stat has a cpu line");
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|f| f.parse().expect("/proc/stat field is a number"))
            .collect();
        let at = |i: usize| v.get(i).copied().unwrap_or(0);
        CpuStat {
            user: at(0),
            nice: at(1),
            system: at(2),
            idle: at(3),
            iowait: at(4),
            irq: at(5),
            softirq: at(6),
            steal: at(7),
        }
    }

    fn delta(&self, before: &CpuStat) -> CpuStat {
        CpuStat {
            user: self.user - before.user,
            nice: self.nice - before.nice,
            system: self.system - before.system,
            idle: self.idle - before.idle,
            iowait: self.iowait - before.iowait,
            irq: self.irq - before.irq,
            softirq: self.softirq - before.softirq,
            steal: self.steal - before.steal,
        }
    }

    /// Jiffies spent doing work (guest time is already inside user).
    fn busy(&self) -> u64 {
        self.user + self.nice + self.system + self.irq + self.softirq
    }

    fn total(&self) -> u64 {
        self.busy() + self.idle + self.iowait + self.steal
    }

    fn json(&self, hz: f64) -> Value {
        let s = |j: u64| j as f64 / hz;
        json!({
            "user_s": s(self.user), "nice_s": s(self.nice), "system_s": s(self.system),
            "idle_s": s(self.idle), "iowait_s": s(self.iowait), "irq_s": s(self.irq),
            "softirq_s": s(self.softirq), "steal_s": s(self.steal),
        })
    }
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

/// User + system CPU seconds of this whole process (load generator, servers and proxy).
fn process_cpu() -> f64 {
    // SAFETY: rusage is plain old data; getrusage writes one struct through the pointer.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: see above; RUSAGE_SELF is always valid.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    assert_eq!(rc, 0, "getrusage");
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// CPU seconds (user + system) of the proxy runtime's threads only.
///
/// Threads that exited are not counted; the runtime's workers live for the whole run.
fn proxy_threads_cpu(hz: f64) -> f64 {
    let mut jiffies = 0u64;
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    for task in dir.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        // Format: "tid (comm) state ..."; comm may contain spaces, so split at the parens.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if !stat[open + 1..close].starts_with(PROXY_THREAD) {
            continue;
        }
        // After ")": field 3 (state) is index 0, so utime (14) and stime (15) are 11, 12.
        let rest: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        let field = |i: usize| rest.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
        jiffies += field(11) + field(12);
    }
    jiffies as f64 / hz
}

fn loadavg() -> (f64, String) {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let one = text
        .split_whitespace()
        .next()
        .and_then(|f| f.parse().ok())
        .unwrap_or(0.0);
    (one, text.trim().to_owned())
}

// ---------------------------------------------------------------------------------------
// Servers: plain threads with blocking sockets, one thread per connection.

/// A server that reads the hello, then discards everything until EOF.
struct Sink {
    addr: SocketAddr,
    /// Bytes received after the hello, over all connections.
    bytes: Arc<AtomicU64>,
    /// Connections not yet closed.
    open: Arc<AtomicUsize>,
}

fn start_sink() -> Sink {
    let listener = StdListener::bind("127.0.0.1:0").expect("bind sink");
    let addr = listener.local_addr().expect("sink addr");
    let bytes = Arc::new(AtomicU64::new(0));
    let open = Arc::new(AtomicUsize::new(0));
    let (b, o) = (bytes.clone(), open.clone());
    thread::Builder::new()
        .name("sink-accept".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut s) = conn else { continue };
                let (b, o) = (b.clone(), o.clone());
                // Counted before the thread starts so a waiter never sees a false zero.
                o.fetch_add(1, Relaxed);
                thread::spawn(move || {
                    let _ = s.set_nodelay(true);
                    let _ = s.set_read_timeout(Some(TEARDOWN_TIMEOUT));
                    let mut hello = [0u8; HELLO_LEN];
                    if s.read_exact(&mut hello).is_ok() && s.write_all(&[0x16; REPLY_LEN]).is_ok() {
                        let mut buf = vec![0u8; CHUNK];
                        while let Ok(n @ 1..) = s.read(&mut buf) {
                            b.fetch_add(n as u64, Relaxed);
                        }
                    }
                    drop(s);
                    o.fetch_sub(1, Relaxed);
                });
            }
        })
        .expect("spawn sink");
    Sink { addr, bytes, open }
}

/// A server that reads the hello, then echoes every byte back.
fn start_echo() -> SocketAddr {
    let listener = StdListener::bind("127.0.0.1:0").expect("bind echo");
    let addr = listener.local_addr().expect("echo addr");
    thread::Builder::new()
        .name("echo-accept".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut s) = conn else { continue };
                thread::spawn(move || {
                    let _ = s.set_nodelay(true);
                    let _ = s.set_read_timeout(Some(TEARDOWN_TIMEOUT));
                    let mut hello = [0u8; HELLO_LEN];
                    if s.read_exact(&mut hello).is_err() || s.write_all(&[0x16; REPLY_LEN]).is_err()
                    {
                        return;
                    }
                    let mut buf = [0u8; 4096];
                    while let Ok(n @ 1..) = s.read(&mut buf) {
                        if s.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                });
            }
        })
        .expect("spawn echo");
    addr
}

// ---------------------------------------------------------------------------------------
// The proxy: accept → read the hello → connect upstream → forward.

/// Per-proxy bookkeeping, so a run can wait for its connections to finish and report
/// connections that did not end cleanly.
#[derive(Default)]
struct ProxyCounters {
    active: AtomicUsize,
    not_closed: AtomicU64,
    errors: AtomicU64,
}

fn start_proxy(
    rt: &Runtime,
    dp: Arc<Dataplane>,
    target: SocketAddr,
    counters: Arc<ProxyCounters>,
    limits: Limits,
) -> SocketAddr {
    let std_listener = StdListener::bind("127.0.0.1:0").expect("bind proxy");
    let addr = std_listener.local_addr().expect("proxy addr");
    std_listener
        .set_nonblocking(true)
        .expect("nonblocking proxy listener");
    rt.spawn(async move {
        let listener = TcpListener::from_std(std_listener).expect("register proxy listener");
        loop {
            let Ok((mut down, _)) = listener.accept().await else {
                continue;
            };
            let (dp, counters) = (dp.clone(), counters.clone());
            counters.active.fetch_add(1, Relaxed);
            tokio::spawn(async move {
                let result = async {
                    let mut hello = [0u8; HELLO_LEN];
                    down.read_exact(&mut hello).await?;
                    let up = tokio::net::TcpStream::connect(target).await?;
                    down.set_nodelay(true)?;
                    up.set_nodelay(true)?;
                    dp.forward(down.into(), up.into(), hello.to_vec(), limits)
                        .await
                        .map_err(io::Error::other)
                }
                .await;
                match result {
                    Ok(o) if o.end == End::Closed => {}
                    Ok(o) => {
                        eprintln!("  warning: proxied connection ended {:?}", o.end);
                        counters.not_closed.fetch_add(1, Relaxed);
                    }
                    Err(e) => {
                        eprintln!("  warning: proxied connection failed: {e:?}");
                        counters.errors.fetch_add(1, Relaxed);
                    }
                }
                counters.active.fetch_sub(1, Relaxed);
            });
        }
    });
    addr
}

/// Polls `done` every millisecond until it holds or `TEARDOWN_TIMEOUT` passes.
fn wait_for(what: &str, done: impl Fn() -> bool) {
    let start = Instant::now();
    while !done() {
        if start.elapsed() > TEARDOWN_TIMEOUT {
            eprintln!("  warning: timed out waiting for {what}");
            return;
        }
        thread::sleep(Duration::from_millis(1));
    }
}

/// Connects, sends the hello and, unless `eager`, waits for the server's reply.
fn connect(addr: SocketAddr, eager: bool) -> StdStream {
    let mut s = StdStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("TCP_NODELAY");
    s.set_read_timeout(Some(TEARDOWN_TIMEOUT))
        .expect("read timeout");
    s.set_write_timeout(Some(TEARDOWN_TIMEOUT))
        .expect("write timeout");
    s.write_all(&[0x16; HELLO_LEN]).expect("send hello");
    if !eager {
        let mut reply = [0u8; REPLY_LEN];
        s.read_exact(&mut reply).expect("receive the hello reply");
    }
    s
}

// ---------------------------------------------------------------------------------------
// A variant under test.

struct Variant {
    name: &'static str,
    dp: Option<Arc<Dataplane>>,
    /// Where the bulk client and the ping-pong client connect.
    bulk_addr: SocketAddr,
    echo_addr: SocketAddr,
    counters: Arc<ProxyCounters>,
    bulk: [Vec<BulkSample>; 2],
    ping: Vec<PingSample>,
    /// Round trips after an idle pause (p50 µs per repetition).
    wake: Vec<f64>,
}

impl Variant {
    fn ebpf_stats(&self) -> Option<Vec<(&'static str, u64)>> {
        match self.dp.as_deref() {
            Some(Dataplane::Ebpf(e)) => {
                Some(e.stats().into_iter().map(|(s, n)| (s.label(), n)).collect())
            }
            _ => None,
        }
    }

    /// Waits until every proxied connection of this variant has finished.
    fn settle(&self) {
        let c = self.counters.clone();
        wait_for("proxied connections to finish", move || {
            c.active.load(Relaxed) == 0
        });
    }
}

fn stats_delta(
    before: &Option<Vec<(&'static str, u64)>>,
    after: &Option<Vec<(&'static str, u64)>>,
) -> Option<Vec<(&'static str, u64)>> {
    let (Some(b), Some(a)) = (before, after) else {
        return None;
    };
    Some(
        a.iter()
            .zip(b)
            .map(|((label, n), (_, m))| (*label, n - m))
            .collect(),
    )
}

fn stats_line(delta: &[(&'static str, u64)]) -> String {
    let total: u64 = delta.iter().map(|(_, n)| n).sum();
    let redirected = delta
        .iter()
        .find(|(l, _)| *l == "redirected")
        .map_or(0, |(_, n)| *n);
    let mut line = format!(
        "segments redirected {:.1}% of {total}:",
        pct(redirected, total)
    );
    for (label, n) in delta {
        let _ = write!(line, " {label}={n}");
    }
    line
}

fn pct(part: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        100.0 * part as f64 / total as f64
    }
}

// ---------------------------------------------------------------------------------------
// Bulk throughput.

struct BulkSample {
    bytes: u64,
    secs: f64,
    cpu: CpuStat,
    process_cpu_s: f64,
    proxy_cpu_s: f64,
    ebpf: Option<Vec<(&'static str, u64)>>,
    hz: f64,
}

impl BulkSample {
    fn gbps(&self) -> f64 {
        self.bytes as f64 * 8.0 / 1e9 / self.secs
    }
    fn gb(&self) -> f64 {
        self.bytes as f64 / 1e9
    }
    fn cpu_s_per_gb(&self) -> f64 {
        self.cpu.busy() as f64 / self.hz / self.gb()
    }
    fn process_cpu_s_per_gb(&self) -> f64 {
        self.process_cpu_s / self.gb()
    }
    fn proxy_cpu_s_per_gb(&self) -> f64 {
        self.proxy_cpu_s / self.gb()
    }
    fn idle_pct(&self) -> f64 {
        pct(self.cpu.idle + self.cpu.iowait, self.cpu.total())
    }
    fn json(&self) -> Value {
        json!({
            "bytes": self.bytes,
            "secs": self.secs,
            "gbit_per_s": self.gbps(),
            "machine_cpu_s": self.cpu.busy() as f64 / self.hz,
            "machine_cpu_s_per_gb": self.cpu_s_per_gb(),
            "machine_cpu": self.cpu.json(self.hz),
            "machine_idle_pct": self.idle_pct(),
            "process_cpu_s": self.process_cpu_s,
            "process_cpu_s_per_gb": self.process_cpu_s_per_gb(),
            "proxy_threads_cpu_s": self.proxy_cpu_s,
            "proxy_threads_cpu_s_per_gb": self.proxy_cpu_s_per_gb(),
            "ebpf_stats_delta": self.ebpf.as_ref().map(|d| {
                d.iter().map(|(l, n)| ((*l).to_owned(), json!(n))).collect::<serde_json::Map<_, _>>()
            }),
        })
    }
}

fn bulk(v: &Variant, sink: &Sink, streams: usize, s: &Settings, hz: f64) -> BulkSample {
    let stop = Arc::new(AtomicBool::new(false));
    let connected = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..streams)
        .map(|_| {
            let (stop, connected, addr) = (stop.clone(), connected.clone(), v.bulk_addr);
            let eager = s.eager;
            thread::spawn(move || {
                let mut c = connect(addr, eager);
                connected.fetch_add(1, Relaxed);
                let buf = vec![0x5a_u8; CHUNK];
                // Bounded: stops at the flag, or at the first error (logged below).
                while !stop.load(Relaxed) {
                    if let Err(e) = c.write_all(&buf) {
                        eprintln!("  warning: bulk client write failed: {e}");
                        return;
                    }
                }
                // Half-close and wait for the close to travel back through the proxy, so
                // the next measurement starts with nothing in flight.
                let _ = c.shutdown(Shutdown::Write);
                let mut scratch = [0u8; 1024];
                loop {
                    match c.read(&mut scratch) {
                        Ok(0) => return,
                        Ok(_) => {}
                        Err(e) => {
                            eprintln!("  warning: bulk client waiting for EOF: {e}");
                            return;
                        }
                    }
                }
            })
        })
        .collect();
    let c = connected.clone();
    wait_for("bulk clients to connect", move || {
        c.load(Relaxed) == streams
    });
    thread::sleep(s.warmup);

    let (b0, cpu0, p0, x0, e0, t0) = (
        sink.bytes.load(Relaxed),
        CpuStat::read(),
        process_cpu(),
        proxy_threads_cpu(hz),
        v.ebpf_stats(),
        Instant::now(),
    );
    thread::sleep(s.duration);
    let (b1, cpu1, p1, x1, e1, t1) = (
        sink.bytes.load(Relaxed),
        CpuStat::read(),
        process_cpu(),
        proxy_threads_cpu(hz),
        v.ebpf_stats(),
        Instant::now(),
    );

    stop.store(true, Relaxed);
    for c in clients {
        c.join().expect("bulk client thread");
    }
    let open = sink.open.clone();
    wait_for("sink connections to close", move || open.load(Relaxed) == 0);
    v.settle();

    BulkSample {
        bytes: b1 - b0,
        secs: (t1 - t0).as_secs_f64(),
        cpu: cpu1.delta(&cpu0),
        process_cpu_s: p1 - p0,
        proxy_cpu_s: x1 - x0,
        ebpf: stats_delta(&e0, &e1),
        hz,
    }
}

// ---------------------------------------------------------------------------------------
// Ping-pong latency.

struct PingSample {
    p50_us: f64,
    p99_us: f64,
    mean_us: f64,
    max_us: f64,
    ebpf: Option<Vec<(&'static str, u64)>>,
}

impl PingSample {
    fn json(&self) -> Value {
        json!({
            "p50_us": self.p50_us, "p99_us": self.p99_us,
            "mean_us": self.mean_us, "max_us": self.max_us,
            "ebpf_stats_delta": self.ebpf.as_ref().map(|d| {
                d.iter().map(|(l, n)| ((*l).to_owned(), json!(n))).collect::<serde_json::Map<_, _>>()
            }),
        })
    }
}

fn ping_pong(v: &Variant, s: &Settings) -> PingSample {
    let e0 = v.ebpf_stats();
    let mut c = connect(v.echo_addr, false);
    let msg = [0x42_u8; PING_LEN];
    let mut back = [0u8; PING_LEN];
    let mut rtt_ns = Vec::with_capacity(s.pings);
    for i in 0..s.pings_warmup + s.pings {
        let ns = round_trip(&mut c, &msg, &mut back);
        if i >= s.pings_warmup {
            rtt_ns.push(ns);
        }
    }
    hang_up(c, v);
    let e1 = v.ebpf_stats();

    rtt_ns.sort_unstable();
    let q = |p: f64| rtt_ns[((rtt_ns.len() - 1) as f64 * p).round() as usize] as f64 / 1e3;
    PingSample {
        p50_us: q(0.50),
        p99_us: q(0.99),
        mean_us: rtt_ns.iter().sum::<u64>() as f64 / rtt_ns.len() as f64 / 1e3,
        max_us: q(1.0),
        ebpf: stats_delta(&e0, &e1),
    }
}

/// One ping and its echo; nanoseconds.
fn round_trip(c: &mut StdStream, msg: &[u8], back: &mut [u8]) -> u64 {
    let t = Instant::now();
    c.write_all(msg).expect("ping write");
    c.read_exact(back).expect("pong read");
    t.elapsed().as_nanos() as u64
}

/// Closes a ping-pong connection cleanly and waits for the proxy to finish it.
fn hang_up(mut c: StdStream, v: &Variant) {
    let _ = c.shutdown(Shutdown::Write);
    let mut scratch = [0u8; 64];
    while let Ok(1..) = c.read(&mut scratch) {}
    drop(c);
    v.settle();
}

/// Round trips after an idle pause: long enough for the copy to park the connection
/// (`--park-after` 100 ms), so what the wake costs shows.
const IDLE_PAUSE: Duration = Duration::from_millis(300);
const WAKES: usize = 30;

/// p50 of `WAKES` 64-byte round trips on one fresh connection, each after `IDLE_PAUSE`.
fn after_idle(v: &Variant) -> f64 {
    let mut c = connect(v.echo_addr, false);
    let msg = [0x42_u8; PING_LEN];
    let mut back = [0u8; PING_LEN];
    let mut rtt_ns = Vec::with_capacity(WAKES);
    for _ in 0..WAKES {
        thread::sleep(IDLE_PAUSE);
        rtt_ns.push(round_trip(&mut c, &msg, &mut back));
    }
    hang_up(c, v);
    rtt_ns.sort_unstable();
    rtt_ns[rtt_ns.len() / 2] as f64 / 1e3
}

// ---------------------------------------------------------------------------------------
// Summaries.

/// Median with min and max; NaN-free inputs assumed.
fn spread(mut xs: Vec<f64>) -> (f64, f64, f64) {
    if xs.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    let median = if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    };
    (median, xs[0], xs[n - 1])
}

fn cell(xs: Vec<f64>, decimals: usize) -> String {
    let (m, lo, hi) = spread(xs);
    if lo == hi {
        format!("{m:.decimals$}")
    } else {
        format!("{m:.decimals$} ({lo:.decimals$}–{hi:.decimals$})")
    }
}

fn summary_json(xs: Vec<f64>) -> Value {
    let (m, lo, hi) = spread(xs.clone());
    json!({ "median": m, "min": lo, "max": hi, "runs": xs })
}

fn main() {
    let s = settings();
    let hz = clock_ticks();

    // A busy machine makes every figure meaningless; say so up front.
    let (load1, load_text) = loadavg();
    let idle_probe = {
        let a = CpuStat::read();
        thread::sleep(Duration::from_secs(1));
        let d = CpuStat::read().delta(&a);
        pct(d.idle + d.iowait, d.total())
    };
    let cpus = thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "# waypoint dataplane benchmark ({} mode)\n",
        if s.quick { "quick" } else { "full" }
    );
    println!("- CPUs: {cpus}; loadavg before: {load_text}; idle over 1 s before: {idle_probe:.0}%");
    if load1 > 0.5 || idle_probe < 90.0 {
        println!(
            "- **WARNING: the machine looks busy (1-min load {load1:.2}, idle {idle_probe:.0}%); figures will be noisy.**"
        );
    }
    println!(
        "- bulk: {} s per run after {} ms warm-up; ping-pong: {} round trips of {PING_LEN} B after {}; {} run(s) per figure, median (min–max)",
        s.duration.as_secs_f64(),
        s.warmup.as_millis(),
        s.pings,
        s.pings_warmup,
        s.reps
    );
    println!(
        "- each connection: {HELLO_LEN}-byte hello, server answers {REPLY_LEN} bytes; bulk clients {}",
        if s.eager {
            "stream right after the hello (--eager)"
        } else {
            "wait for the answer before streaming (as TLS does)"
        }
    );
    println!();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(PROXY_THREAD)
        .enable_all()
        .build()
        .expect("proxy runtime");
    let sink = start_sink();
    let echo = start_echo();

    let ebpf_dp = |config: ebpf::Config| {
        let dp = ebpf::Ebpf::load(config)
            .expect("loading the eBPF dataplane (run as root on a sockmap kernel)");
        Some(Arc::new(Dataplane::Ebpf(Arc::new(dp))))
    };
    let candidates = [
        "direct",
        "ebpf",
        "ebpf-16m",
        "ebpf-inflight16m",
        "ebpf-both16m",
        "splice",
        "copy",
        "copy-nopark",
    ];
    let wanted = |name: &str| s.only.as_ref().is_none_or(|o| o.iter().any(|w| w == name));
    let mut variants: Vec<Variant> = Vec::new();
    for name in candidates {
        if !wanted(name) {
            continue;
        }
        let dp: Option<Arc<Dataplane>> = match name {
            "direct" => None,
            "ebpf" => ebpf_dp(ebpf::Config::default()),
            "ebpf-16m" => ebpf_dp(ebpf::Config {
                socket_buffer: Some(16 << 20),
                ..Default::default()
            }),
            "ebpf-inflight16m" => ebpf_dp(ebpf::Config {
                max_inflight: 16 << 20,
                ..Default::default()
            }),
            "ebpf-both16m" => ebpf_dp(ebpf::Config {
                socket_buffer: Some(16 << 20),
                max_inflight: 16 << 20,
                ..Default::default()
            }),
            "splice" => Some(Arc::new(Dataplane::Splice(Splice::default()))),
            "copy" | "copy-nopark" => Some(Arc::new(Dataplane::Copy(UserspaceCopy::new()))),
            _ => unreachable!("listed above"),
        };
        let limits = Limits {
            park_after: if name.ends_with("-nopark") {
                None
            } else {
                Limits::default().park_after
            },
            ..Limits::default()
        };
        let counters = Arc::new(ProxyCounters::default());
        let (bulk_addr, echo_addr) = match &dp {
            None => (sink.addr, echo),
            Some(dp) => (
                start_proxy(&rt, dp.clone(), sink.addr, counters.clone(), limits),
                start_proxy(&rt, dp.clone(), echo, counters.clone(), limits),
            ),
        };
        variants.push(Variant {
            name,
            dp,
            bulk_addr,
            echo_addr,
            counters,
            bulk: [Vec::new(), Vec::new()],
            ping: Vec::new(),
            wake: Vec::new(),
        });
    }

    // Repetition-major order: each round measures every variant once, so a burst of
    // background load hits one run of several variants, not all runs of one.
    let started = Instant::now();
    for rep in 1..=s.reps {
        for v in &mut variants {
            for (slot, streams) in [(0, 1), (1, 8)] {
                let sample = bulk(v, &sink, streams, &s, hz);
                eprintln!(
                    "[rep {rep}] {:<16} bulk x{streams}: {:6.2} Gbit/s, machine {:.2} CPU s/GB (idle {:.0}%), process {:.2}, proxy threads {:.2}",
                    v.name,
                    sample.gbps(),
                    sample.cpu_s_per_gb(),
                    sample.idle_pct(),
                    sample.process_cpu_s_per_gb(),
                    sample.proxy_cpu_s_per_gb(),
                );
                if let Some(d) = &sample.ebpf {
                    eprintln!("{:>26} {}", "", stats_line(d));
                }
                v.bulk[slot].push(sample);
            }
            let p = ping_pong(v, &s);
            eprintln!(
                "[rep {rep}] {:<16} ping-pong: p50 {:.1} µs, p99 {:.1} µs, max {:.0} µs",
                v.name, p.p50_us, p.p99_us, p.max_us
            );
            if let Some(d) = &p.ebpf {
                eprintln!("{:>26} {}", "", stats_line(d));
            }
            v.ping.push(p);
            let w = after_idle(v);
            eprintln!(
                "[rep {rep}] {:<16} after {} ms idle: p50 {w:.1} µs ({WAKES} round trips)",
                v.name,
                IDLE_PAUSE.as_millis()
            );
            v.wake.push(w);
        }
    }
    let (load1_after, load_after) = loadavg();

    // Results.
    println!("| dataplane | 1-stream Gbit/s | 8-stream Gbit/s | p50 µs | p99 µs | after {} ms idle, p50 µs | CPU s/GB 1-stream | CPU s/GB 8-stream |", IDLE_PAUSE.as_millis());
    println!("|---|---|---|---|---|---|---|---|");
    for v in &variants {
        let g = |i: usize| v.bulk[i].iter().map(BulkSample::gbps).collect::<Vec<_>>();
        let c = |i: usize| {
            v.bulk[i]
                .iter()
                .map(BulkSample::cpu_s_per_gb)
                .collect::<Vec<_>>()
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            v.name,
            cell(g(0), 1),
            cell(g(1), 1),
            cell(v.ping.iter().map(|p| p.p50_us).collect(), 0),
            cell(v.ping.iter().map(|p| p.p99_us).collect(), 0),
            cell(v.wake.clone(), 0),
            cell(c(0), 2),
            cell(c(1), 2),
        );
    }
    println!();
    println!("Details (medians, 1-stream / 8-stream): process CPU s/GB includes the load generator and servers; proxy-thread CPU s/GB is the proxy runtime's threads only (excludes softirq and kworkers); idle is machine-wide.\n");
    println!("| dataplane | process CPU s/GB | proxy-thread CPU s/GB | idle % | eBPF segments redirected % |");
    println!("|---|---|---|---|---|");
    for v in &variants {
        let m = |i: usize, f: fn(&BulkSample) -> f64| spread(v.bulk[i].iter().map(f).collect()).0;
        let redirected = |i: usize| {
            let (mut r, mut t) = (0u64, 0u64);
            for d in v.bulk[i].iter().filter_map(|b| b.ebpf.as_ref()) {
                for (l, n) in d {
                    t += n;
                    if *l == "redirected" {
                        r += n;
                    }
                }
            }
            if v.bulk[i].iter().any(|b| b.ebpf.is_some()) {
                format!("{:.1}", pct(r, t))
            } else {
                "–".to_owned()
            }
        };
        println!(
            "| {} | {:.2} / {:.2} | {:.2} / {:.2} | {:.0} / {:.0} | {} / {} |",
            v.name,
            m(0, BulkSample::process_cpu_s_per_gb),
            m(1, BulkSample::process_cpu_s_per_gb),
            m(0, BulkSample::proxy_cpu_s_per_gb),
            m(1, BulkSample::proxy_cpu_s_per_gb),
            m(0, BulkSample::idle_pct),
            m(1, BulkSample::idle_pct),
            redirected(0),
            redirected(1),
        );
    }
    println!();
    println!(
        "- loadavg after: {load_after}; wall time {:.0} s",
        started.elapsed().as_secs_f64()
    );
    let mut unclean = false;
    for v in &variants {
        let (n, e) = (
            v.counters.not_closed.load(Relaxed),
            v.counters.errors.load(Relaxed),
        );
        if n + e > 0 {
            unclean = true;
            println!(
                "- **{}: {n} connection(s) did not end Closed, {e} failed**",
                v.name
            );
        }
    }
    if !unclean {
        println!("- every proxied connection ended Closed");
    }
    if load1_after > 2.0 {
        println!("- **WARNING: load rose during the run (other work on the machine?)**");
    }

    if let Some(path) = &s.json {
        let doc = json!({
            "mode": if s.quick { "quick" } else { "full" },
            "cpus": cpus,
            "clock_ticks_per_s": hz,
            "loadavg_before": load_text,
            "idle_pct_before": idle_probe,
            "loadavg_after": load_after,
            "settings": {
                "reps": s.reps,
                "bulk_secs": s.duration.as_secs_f64(),
                "bulk_warmup_secs": s.warmup.as_secs_f64(),
                "pings": s.pings,
                "pings_warmup": s.pings_warmup,
                "hello_bytes": HELLO_LEN,
                "reply_bytes": REPLY_LEN,
                "eager": s.eager,
                "ping_bytes": PING_LEN,
                "chunk_bytes": CHUNK,
            },
            "variants": variants.iter().map(|v| json!({
                "name": v.name,
                "bulk_1_stream": {
                    "gbit_per_s": summary_json(v.bulk[0].iter().map(BulkSample::gbps).collect()),
                    "machine_cpu_s_per_gb": summary_json(v.bulk[0].iter().map(BulkSample::cpu_s_per_gb).collect()),
                    "runs": v.bulk[0].iter().map(BulkSample::json).collect::<Vec<_>>(),
                },
                "bulk_8_streams": {
                    "gbit_per_s": summary_json(v.bulk[1].iter().map(BulkSample::gbps).collect()),
                    "machine_cpu_s_per_gb": summary_json(v.bulk[1].iter().map(BulkSample::cpu_s_per_gb).collect()),
                    "runs": v.bulk[1].iter().map(BulkSample::json).collect::<Vec<_>>(),
                },
                "ping_pong": {
                    "p50_us": summary_json(v.ping.iter().map(|p| p.p50_us).collect()),
                    "p99_us": summary_json(v.ping.iter().map(|p| p.p99_us).collect()),
                    "runs": v.ping.iter().map(PingSample::json).collect::<Vec<_>>(),
                },
                "after_idle_p50_us": summary_json(v.wake.clone()),
                "connections_not_closed": v.counters.not_closed.load(Relaxed),
                "connections_failed": v.counters.errors.load(Relaxed),
            })).collect::<Vec<_>>(),
        });
        std::fs::write(
            path,
            serde_json::to_string_pretty(&doc).expect("serialize results"),
        )
        .expect("write --json file");
        println!("- raw figures written to {path}");
    }
}
