//! The load generator: plain threads with blocking sockets, every loop bounded by a count
//! or a deadline, every socket with read and write timeouts.

use std::{
    io::{Read as _, Write as _},
    net::{Shutdown, TcpStream},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use crate::{
    routers::Target,
    servers::{Servers, ANSWER},
    sys::{self, CpuStat, Foreign},
};

/// Longest any single socket operation may block.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Write chunk of bulk clients.
const CHUNK: usize = 256 * 1024;
/// Ping-pong message size.
pub const PING_LEN: usize = 64;

/// Errors generating load.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A socket operation failed.
    #[error("{what} via {addr}: {source}")]
    Io {
        /// What the client was doing.
        what: &'static str,
        /// Where it connected.
        addr: std::net::SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The server answered something else than expected.
    #[error("{what} via {addr}: unexpected bytes {got:?}")]
    Answer {
        /// What the client was doing.
        what: &'static str,
        /// Where it connected.
        addr: std::net::SocketAddr,
        /// What came back.
        got: Vec<u8>,
    },
    /// Reading the machine's counters failed.
    #[error(transparent)]
    Sys(#[from] sys::Error),
    /// A client thread panicked or could not start.
    #[error("load thread: {0}")]
    Thread(String),
}

fn io<'a>(what: &'static str, t: &'a Target) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        what,
        addr: t.addr,
        source,
    }
}

/// Connects, sends the hello (plus `extra`) and waits for the server's answer byte (and
/// the echo of `extra`): the connection is then established end to end.
pub fn open(t: &Target, extra: &[u8]) -> Result<TcpStream, Error> {
    let mut c = TcpStream::connect_timeout(&t.addr, IO_TIMEOUT).map_err(io("connect", t))?;
    c.set_nodelay(true).map_err(io("TCP_NODELAY", t))?;
    c.set_read_timeout(Some(IO_TIMEOUT))
        .map_err(io("timeout", t))?;
    c.set_write_timeout(Some(IO_TIMEOUT))
        .map_err(io("timeout", t))?;
    let mut first = Vec::with_capacity(t.hello.len() + extra.len());
    first.extend_from_slice(&t.hello);
    first.extend_from_slice(extra);
    c.write_all(&first).map_err(io("send hello", t))?;
    let mut back = vec![0u8; 1 + extra.len()];
    c.read_exact(&mut back).map_err(io("read answer", t))?;
    if back[0] != ANSWER || back[1..] != *extra {
        return Err(Error::Answer {
            what: "answer",
            addr: t.addr,
            got: back,
        });
    }
    Ok(c)
}

/// Half-closes and waits (bounded by the read timeout) for the close to come back, so the
/// next measurement starts with nothing in flight.
fn close(mut c: TcpStream) {
    let _ = c.shutdown(Shutdown::Write);
    let mut scratch = [0u8; 4096];
    while let Ok(1..) = c.read(&mut scratch) {}
}

/// One bulk run.
#[derive(Clone, Debug)]
pub struct Bulk {
    pub bytes: u64,
    pub secs: f64,
    pub cpu: CpuStat,
    /// CPU seconds other processes took during the window.
    pub foreign_s: f64,
}

impl Bulk {
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 * 8.0 / 1e9 / self.secs
    }
    /// Machine-wide CPU seconds per GB moved (user+nice+system+irq+softirq).
    pub fn cpu_s_per_gb(&self, hz: f64) -> f64 {
        self.cpu.busy() as f64 / hz / (self.bytes as f64 / 1e9)
    }
}

/// `conns` clients stream into the sink through `t` for `duration` after `warmup`;
/// measures the sink's bytes and machine CPU in the window.
pub fn bulk(
    t: &Target,
    servers: &Servers,
    conns: usize,
    warmup: Duration,
    duration: Duration,
    ours: &[i32],
    hz: f64,
) -> Result<Bulk, Error> {
    let open0 = servers.open.load(Relaxed);
    let stop = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::with_capacity(conns);
    for _ in 0..conns {
        let (t, halt, up) = (t.clone(), stop.clone(), ready.clone());
        let h = thread::Builder::new()
            .name("bench-bulk".into())
            .spawn(move || -> Result<(), Error> {
                let c = open(&t, &[]);
                up.fetch_add(1, Relaxed);
                let mut c = c?;
                let buf = vec![0x5a_u8; CHUNK];
                while !halt.load(Relaxed) {
                    c.write_all(&buf).map_err(io("bulk write", &t))?;
                }
                close(c);
                Ok(())
            })
            .map_err(|e| Error::Thread(e.to_string()));
        match h {
            Ok(h) => clients.push(h),
            Err(e) => {
                stop.store(true, Relaxed);
                return Err(e);
            }
        }
    }
    let deadline = Instant::now() + IO_TIMEOUT;
    while ready.load(Relaxed) < conns && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(1));
    }
    thread::sleep(warmup);
    let (b0, c0, f0, t0) = (
        servers.sunk.load(Relaxed),
        CpuStat::read()?,
        Foreign::start(ours),
        Instant::now(),
    );
    thread::sleep(duration);
    let (b1, c1, t1) = (servers.sunk.load(Relaxed), CpuStat::read()?, Instant::now());
    let foreign_s = f0.seconds(hz);
    stop.store(true, Relaxed);
    let mut first_error = None;
    for h in clients {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(_) => {
                first_error.get_or_insert(Error::Thread("a bulk client panicked".into()));
            }
        }
    }
    settle(servers, open0);
    if let Some(e) = first_error {
        return Err(e);
    }
    Ok(Bulk {
        bytes: b1.saturating_sub(b0),
        secs: (t1 - t0).as_secs_f64(),
        cpu: c1.since(&c0),
        foreign_s,
    })
}

/// Waits (bounded) until the servers hold no more than `open0` connections.
fn settle(servers: &Servers, open0: u64) {
    let deadline = Instant::now() + IO_TIMEOUT;
    while servers.open.load(Relaxed) > open0 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(1));
    }
}

/// Quantiles of a latency sample, in µs.
#[derive(Clone, Debug)]
pub struct Latency {
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub n: usize,
}

impl Latency {
    fn of(mut ns: Vec<u64>) -> Latency {
        ns.sort_unstable();
        let q = |p: f64| {
            if ns.is_empty() {
                return f64::NAN;
            }
            ns[((ns.len() - 1) as f64 * p).round() as usize] as f64 / 1e3
        };
        Latency {
            p50: q(0.5),
            p99: q(0.99),
            p999: q(0.999),
            n: ns.len(),
        }
    }
}

/// `warmup + n` round trips of `PING_LEN` bytes through the echo server on one connection.
pub fn ping_pong(t: &Target, warmup: usize, n: usize) -> Result<Latency, Error> {
    let mut c = open(t, &[])?;
    let msg = [0x42_u8; PING_LEN];
    let mut back = [0u8; PING_LEN];
    let mut rtt = Vec::with_capacity(n);
    for i in 0..warmup + n {
        let start = Instant::now();
        c.write_all(&msg).map_err(io("ping", t))?;
        c.read_exact(&mut back).map_err(io("pong", t))?;
        if i >= warmup {
            rtt.push(start.elapsed().as_nanos() as u64);
        }
    }
    close(c);
    Ok(Latency::of(rtt))
}

/// `n` round trips of 64 B on one connection, each after `pause` idle: long enough for
/// a router that parks idle connections (the waypoint's `--park-after`, 100 ms) to have
/// parked it, so what waking it costs shows.
pub fn after_idle(t: &Target, pause: Duration, n: usize) -> Result<Latency, Error> {
    let mut c = open(t, &[])?;
    let msg = [0x42_u8; PING_LEN];
    let mut back = [0u8; PING_LEN];
    let mut rtt = Vec::with_capacity(n);
    for _ in 0..n {
        thread::sleep(pause);
        let start = Instant::now();
        c.write_all(&msg).map_err(io("ping", t))?;
        c.read_exact(&mut back).map_err(io("pong", t))?;
        rtt.push(start.elapsed().as_nanos() as u64);
    }
    close(c);
    Ok(Latency::of(rtt))
}

/// Connection setup: `n` sequential connections, each connect + hello + one byte echoed,
/// then closed. Returns the latency of each and connections per second.
pub fn setup(t: &Target, servers: &Servers, n: usize) -> Result<(Latency, f64), Error> {
    let open0 = servers.open.load(Relaxed);
    let mut ns = Vec::with_capacity(n);
    let start = Instant::now();
    for _ in 0..n {
        let t0 = Instant::now();
        let c = open(t, &[0x01])?;
        ns.push(t0.elapsed().as_nanos() as u64);
        drop(c);
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    settle(servers, open0);
    Ok((Latency::of(ns), rate))
}

/// What the churn's openers did in their window.
#[derive(Clone, Debug)]
pub struct Churn {
    /// Connections opened end to end (the answer byte and the echo back) and closed.
    pub completed: u64,
    /// Opens a reset cut short (ECONNRESET, ECONNABORTED, EPIPE, or the peer's close
    /// before the answer).
    pub resets: u64,
    /// Opens that failed otherwise (refused, timed out, a wrong answer).
    pub failed: u64,
    /// The first failure of either kind, for the log.
    pub first_error: Option<String>,
    pub secs: f64,
}

impl Churn {
    pub fn conn_per_s(&self) -> f64 {
        self.completed as f64 / self.secs
    }
}

/// Churn: `openers` threads each open connections through `t` (connect, hello, one byte
/// echoed), close them, and open the next at once, for `duration`. A failed open is
/// counted, not fatal: under churn a router may run out of something, and what it does
/// then (slow down, or reset) is what this measures.
pub fn churn(
    t: &Target,
    servers: &Servers,
    openers: usize,
    duration: Duration,
) -> Result<Churn, Error> {
    let open0 = servers.open.load(Relaxed);
    let start = Instant::now();
    let deadline = start + duration;
    let mut threads = Vec::with_capacity(openers);
    for _ in 0..openers {
        let t = t.clone();
        let h = thread::Builder::new()
            .name("bench-churn".into())
            .spawn(move || {
                let mut tally = Churn {
                    completed: 0,
                    resets: 0,
                    failed: 0,
                    first_error: None,
                    secs: 0.0,
                };
                while Instant::now() < deadline {
                    match open(&t, &[0x01]) {
                        Ok(c) => {
                            drop(c);
                            tally.completed += 1;
                        }
                        Err(e) => {
                            let reset = matches!(
                                &e,
                                Error::Io { source, .. } if matches!(
                                    source.kind(),
                                    std::io::ErrorKind::ConnectionReset
                                        | std::io::ErrorKind::ConnectionAborted
                                        | std::io::ErrorKind::BrokenPipe
                                        | std::io::ErrorKind::UnexpectedEof
                                )
                            );
                            if reset {
                                tally.resets += 1;
                            } else {
                                tally.failed += 1;
                            }
                            tally.first_error.get_or_insert_with(|| e.to_string());
                        }
                    }
                }
                tally
            })
            .map_err(|e| Error::Thread(e.to_string()))?;
        threads.push(h);
    }
    let mut all = Churn {
        completed: 0,
        resets: 0,
        failed: 0,
        first_error: None,
        secs: 0.0,
    };
    for h in threads {
        let one = h
            .join()
            .map_err(|_| Error::Thread("a churn opener panicked".into()))?;
        all.completed += one.completed;
        all.resets += one.resets;
        all.failed += one.failed;
        if all.first_error.is_none() {
            all.first_error = one.first_error;
        }
    }
    all.secs = start.elapsed().as_secs_f64();
    settle(servers, open0);
    Ok(all)
}

/// Opens `n` echo connections through `t` and keeps them idle; returns them (the caller
/// measures and then drops them). Stops at the first error, returning what it opened.
pub fn open_idle(t: &Target, n: usize) -> (Vec<TcpStream>, Option<Error>) {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        match open(t, &[0x01]) {
            Ok(c) => conns.push(c),
            Err(e) => return (conns, Some(e)),
        }
    }
    (conns, None)
}
