//! 1,000 concurrent connections through each dataplane to an echo server: every echo is
//! exact, every connection ends `Closed` with exact counts, and afterwards nothing is left
//! behind: no file descriptors, no eBPF map entries.
//!
//! The tests run one at a time (a lock serialises them): the leak checks compare
//! process-wide figures (open fds, map entries) with a baseline taken at the start, which
//! another test running alongside would disturb. Keep other tests out of this file.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod common;

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpSocket, TcpStream},
    task::JoinSet,
};
use waypoint::dataplane::{Dataplane, End, Kind, Limits, Outcome};

const CONNECTIONS: usize = 1000;
const HELLO: usize = 517;
const PAYLOAD: usize = 64 * 1024;
/// Bound on the whole run: fail rather than hang.
const BOUND: Duration = Duration::from_secs(120);
/// Closes finish asynchronously (echo tasks, the runtime's deregistration): how long to
/// wait for the fd count to come back.
const SETTLE: Duration = Duration::from_secs(5);

static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn thousand_connections_ebpf() {
    run(Kind::Ebpf);
}

#[test]
fn thousand_connections_splice() {
    run(Kind::Splice);
}

#[test]
fn thousand_connections_copy() {
    run(Kind::Copy);
}

fn run(kind: Kind) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    raise_nofile();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(many(kind));
}

/// Raises the soft RLIMIT_NOFILE to 65,536, or to the hard limit if that is lower (a
/// container may deny CAP_SYS_RESOURCE even to root), and checks that it is enough: 4 fds
/// per connection (client, proxy downstream and upstream, server) plus the splice
/// dataplane's 4 pipe ends, about 8,000 at once.
fn raise_nofile() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    const WANT: u64 = 65_536;
    const NEED: u64 = 8 * CONNECTIONS as u64 + 1024;
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    let soft = WANT.min(hard);
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
    assert!(
        soft >= NEED,
        "RLIMIT_NOFILE hard limit {hard} is below the {NEED} fds this test needs"
    );
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn hello() -> Vec<u8> {
    let mut h = vec![0u8; HELLO];
    common::pattern_fill(0, 0, &mut h);
    h
}

/// An echo server: each connection gets back what it sent, then FIN after the client's.
async fn echo_server() -> std::net::SocketAddr {
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    // Room for every connection at once (tokio's default backlog is 1024).
    let listener = sock.listen(4096).unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (s, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let (mut r, mut w) = s.into_split();
                tokio::io::copy(&mut r, &mut w).await.unwrap();
                w.shutdown().await.unwrap();
            });
        }
    });
    addr
}

/// One client: sends the initial bytes and its own payload, checks that exactly the same
/// bytes come back, then closes (FIN) and expects EOF.
///
/// The FIN goes only after the echo: a FIN that reaches the proxy before the dataplane
/// takes over is a separate case with its own tests (dataplane_close.rs); under this
/// load it would hit many connections and hide what this test is about, cleanup.
async fn client(proxy: std::net::SocketAddr, i: usize) {
    let c = TcpStream::connect(proxy)
        .await
        .unwrap_or_else(|e| panic!("client {i}: connect: {e}"));
    let (mut r, mut w) = c.into_split();
    let mut payload = vec![0u8; PAYLOAD];
    common::pattern_fill(1000 + i as u64, 0, &mut payload);
    let send = async {
        w.write_all(&hello()).await.unwrap();
        w.write_all(&payload).await.unwrap();
    };
    let mut back = vec![0u8; HELLO + PAYLOAD];
    let recv = r.read_exact(&mut back);
    let ((), got) = tokio::join!(send, recv);
    got.unwrap_or_else(|e| panic!("client {i}: read: {e}"));
    assert!(
        back[..HELLO] == hello()[..],
        "client {i}: echoed initial bytes"
    );
    if let Some(at) = common::pattern_mismatch(1000 + i as u64, 0, &back[HELLO..]) {
        panic!("client {i}: echoed payload wrong at offset {at}");
    }
    w.shutdown().await.unwrap();
    let mut rest = Vec::new();
    r.read_to_end(&mut rest)
        .await
        .unwrap_or_else(|e| panic!("client {i}: read after FIN: {e}"));
    assert!(
        rest.is_empty(),
        "client {i}: {} bytes past the echo",
        rest.len()
    );
}

async fn many(kind: Kind) {
    // Everything long-lived is created before the baselines: the dataplane (the eBPF
    // maps and program are fds), the echo server's listener and the proxy's.
    let dp = common::dataplane(kind);
    let maps_before = map_counts(&dp);
    let stats_before = ebpf_stats(&dp);
    let server = echo_server().await;
    let mut proxy = common::proxy(dp.clone(), server, HELLO, Limits::default()).await;
    // The parker's epoll set and eventfd live as long as the process: open them first.
    assert!(waypoint::dataplane::start_parking());
    let fds_before = open_fds();

    let started = Instant::now();
    let mut clients = JoinSet::new();
    for i in 0..CONNECTIONS {
        clients.spawn(client(proxy.addr, i));
    }
    let (peak, failed) = tokio::time::timeout(BOUND, async {
        let mut peak = 0;
        let mut failed = Vec::new();
        while let Some(r) = clients.join_next().await {
            peak = peak.max(open_fds());
            if let Err(e) = r {
                failed.push(e);
            }
        }
        (peak, failed)
    })
    .await
    .unwrap_or_else(|_| panic!("{kind:?}: clients did not finish within {BOUND:?}"));
    let clients_done = started.elapsed();
    // Outcomes of failed connections may never come: wait for them all only if every
    // client succeeded, but show what did come either way.
    let mut outcomes = Vec::with_capacity(CONNECTIONS);
    while outcomes.len() < CONNECTIONS {
        let within = if failed.is_empty() {
            Duration::from_secs(10)
        } else {
            Duration::from_secs(1)
        };
        match tokio::time::timeout(within, proxy.outcomes.recv()).await {
            Ok(Some(o)) => outcomes.push(o),
            _ => break,
        }
    }
    let mut ends = std::collections::BTreeMap::new();
    for o in &outcomes {
        *ends.entry(o.end.as_str()).or_insert(0) += 1;
    }
    eprintln!("{kind:?}: {} outcomes, by end: {ends:?}", outcomes.len());
    assert!(
        failed.is_empty(),
        "{kind:?}: {} of {CONNECTIONS} clients failed (see their panics above)",
        failed.len()
    );
    assert_eq!(
        outcomes.len(),
        CONNECTIONS,
        "{kind:?}: one outcome per connection"
    );
    let want = Outcome {
        downstream_to_upstream: (HELLO + PAYLOAD) as u64,
        upstream_to_downstream: (HELLO + PAYLOAD) as u64,
        end: End::Closed,
    };
    let wrong: Vec<_> = outcomes.iter().filter(|o| **o != want).collect();
    assert!(
        wrong.is_empty(),
        "{kind:?}: {} of {CONNECTIONS} outcomes differ from {want:?}, e.g. {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );

    // Every socket and pipe is closed: poll until the count is back (closes by other
    // tasks may still be in progress), then insist.
    let deadline = Instant::now() + SETTLE;
    let mut fds_after = open_fds();
    while fds_after != fds_before && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        fds_after = open_fds();
    }
    let maps_after = map_counts(&dp);
    eprintln!(
        "{kind:?}: {CONNECTIONS} connections done in {:.2} s; fds {fds_before} before, \
         peak {peak}, {fds_after} after; maps {maps_before:?} before, {maps_after:?} after",
        clients_done.as_secs_f64()
    );
    if let (Some(before), Some(after)) = (stats_before, ebpf_stats(&dp)) {
        let delta: Vec<_> = before
            .iter()
            .zip(&after)
            .map(|((stat, b), (_, a))| (stat.label(), a - b))
            .collect();
        eprintln!("{kind:?}: verdict segments: {delta:?}");
    }
    assert_eq!(
        fds_after, fds_before,
        "{kind:?}: open fds back to the baseline"
    );
    assert_eq!(
        maps_after, maps_before,
        "{kind:?}: no eBPF map entries left"
    );
}

fn map_counts(dp: &Dataplane) -> Option<waypoint::dataplane::ebpf::MapCounts> {
    match dp {
        Dataplane::Ebpf(e) => Some(e.map_counts()),
        _ => None,
    }
}

fn ebpf_stats(dp: &Dataplane) -> Option<Vec<(waypoint_common::Stat, u64)>> {
    match dp {
        Dataplane::Ebpf(e) => Some(e.stats()),
        _ => None,
    }
}
