//! The eBPF dataplane's move from the userspace copy into the kernel (`move_after`):
//! a connection starts in the copy and enters the SockHash once it has carried the
//! threshold. Every test loads its own dataplane, so that its counters are its own.
//! Needs root (CI is root); never skipped.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod common;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
};
use waypoint::dataplane::{
    ebpf::{self, Ebpf},
    Dataplane, End, Limits,
};
use waypoint_common::Stat;

const HELLO: usize = 517;
const THRESHOLD: u64 = 16 * 1024;
const WITHIN: Duration = Duration::from_secs(30);

fn dataplane(move_after: u64) -> Arc<Dataplane> {
    common::require_root();
    Arc::new(Dataplane::Ebpf(Arc::new(
        Ebpf::load(ebpf::Config {
            move_after,
            ..ebpf::Config::default()
        })
        .expect("eBPF dataplane must load: tests run as root on a sockmap kernel"),
    )))
}

fn ebpf(dp: &Dataplane) -> &Ebpf {
    match dp {
        Dataplane::Ebpf(e) => e,
        _ => unreachable!("an eBPF dataplane"),
    }
}

fn redirected(e: &Ebpf) -> u64 {
    e.stats()
        .into_iter()
        .find(|(s, _)| *s == Stat::Redirected)
        .map_or(0, |(_, n)| n)
}

/// A proxy in front of a fresh listener, the client connected and its hello sent, the
/// server's end accepted and the hello checked.
async fn connected(dp: &Arc<Dataplane>, limits: Limits) -> (common::Proxy, TcpStream, TcpStream) {
    let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = common::proxy(dp.clone(), server.local_addr().unwrap(), HELLO, limits).await;
    let mut client = TcpStream::connect(proxy.addr).await.unwrap();
    let hello: Vec<u8> = (0..HELLO).map(|i| i as u8).collect();
    client.write_all(&hello).await.unwrap();
    let (mut s, _) = server.accept().await.unwrap();
    let mut got = vec![0u8; HELLO];
    s.read_exact(&mut got).await.unwrap();
    assert_eq!(got, hello, "the hello arrives first and intact");
    (proxy, client, s)
}

/// Writes `len` bytes of stream `seed` in writes of varying size, then shuts down.
async fn send_pattern(mut w: impl AsyncWrite + Unpin, seed: u64, len: u64) {
    let mut buf = vec![0u8; 96 * 1024];
    let mut off = 0u64;
    let mut step = 1usize;
    while off < len {
        // 1 B .. 96 KiB, so that reads end mid-segment in the copy.
        step = (step * 7 + 13) % buf.len() + 1;
        let n = (len - off).min(step as u64) as usize;
        common::pattern_fill(seed, off, &mut buf[..n]);
        w.write_all(&buf[..n]).await.unwrap();
        off += n as u64;
    }
    w.shutdown().await.unwrap();
}

/// Reads to EOF, checking every byte against stream `seed`; returns the count.
async fn recv_pattern(mut r: impl AsyncRead + Unpin, seed: u64) -> u64 {
    let mut buf = vec![0u8; 64 * 1024];
    let mut off = 0u64;
    loop {
        let n = r.read(&mut buf).await.unwrap();
        if n == 0 {
            return off;
        }
        assert_eq!(
            common::pattern_mismatch(seed, off, &buf[..n]),
            None,
            "stream {seed}"
        );
        off += n as u64;
    }
}

/// Both directions stream at once, in writes of odd sizes, across the move: every byte
/// arrives in order, the connection was moved (not a fallback), and the kernel carried
/// part of it. A sender that outruns the move's drain (more than 1 MiB queued while the
/// worker was off the CPU, on a loaded machine) makes the connection fall back to the
/// copy, intact: that attempt counts only for its bytes, and the next one must move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn move_while_both_directions_stream() {
    const ATTEMPTS: u32 = 3;
    let dp = dataplane(THRESHOLD);
    let e = ebpf(&dp);
    for attempt in 1..=ATTEMPTS {
        let (handovers, fallbacks, kernel) = (e.handovers(), e.fallbacks(), redirected(e));
        stream_both_ways_intact(&dp).await;
        // A move that cannot enter the SockHash counts as moved and as fallen back.
        let moved = e.handovers() - handovers;
        let fell_back = e.fallbacks() - fallbacks;
        assert_eq!(moved, 1, "moved once");
        assert!(fell_back <= 1, "fell back {fell_back} times");
        if fell_back == 0 {
            assert!(redirected(e) > kernel, "the kernel path was not used");
            return;
        }
        eprintln!("attempt {attempt}: the move fell back to the copy (loaded machine?)");
    }
    panic!("{ATTEMPTS} connections in a row fell back instead of moving");
}

/// One connection of [`move_while_both_directions_stream`]: 32 MiB each way at once,
/// every byte checked, a clean close with every byte counted.
async fn stream_both_ways_intact(dp: &Arc<Dataplane>) {
    const LEN: u64 = 32 << 20;
    let (mut proxy, client, server) = connected(dp, Limits::default()).await;
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let run = async {
        tokio::join!(
            send_pattern(cw, 1, LEN),
            recv_pattern(sr, 1),
            send_pattern(sw, 2, LEN),
            recv_pattern(cr, 2),
        )
    };
    let ((), up, (), down) = tokio::time::timeout(WITHIN, run).await.expect("no stall");
    assert_eq!((up, down), (LEN, LEN));
    let outcome = common::next_outcome(&mut proxy, WITHIN).await;
    eprintln!("{outcome:?}; verdict stats {:?}", ebpf(dp).stats());
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(outcome.downstream_to_upstream, HELLO as u64 + LEN);
    assert_eq!(outcome.upstream_to_downstream, LEN);
}

/// Request/response: 64-byte pings, each echoed. The move happens mid-conversation, and
/// every echo matches its ping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn move_during_request_response() {
    const ROUNDS: u64 = 2_000;
    let dp = dataplane(THRESHOLD);
    let e = ebpf(&dp);
    let (mut proxy, mut client, mut server) = connected(&dp, Limits::default()).await;
    let echo = tokio::spawn(async move {
        let mut buf = [0u8; 64];
        loop {
            match server.read_exact(&mut buf).await {
                Ok(_) => server.write_all(&buf).await.unwrap(),
                Err(_) => return,
            }
        }
    });
    let mut ping = [0u8; 64];
    let mut pong = [0u8; 64];
    tokio::time::timeout(WITHIN, async {
        for i in 0..ROUNDS {
            common::pattern_fill(3, i * 64, &mut ping);
            client.write_all(&ping).await.unwrap();
            client.read_exact(&mut pong).await.unwrap();
            assert_eq!(ping, pong, "round {i}");
        }
    })
    .await
    .expect("no stall");
    let before = redirected(e);
    client.shutdown().await.unwrap();
    let mut rest = Vec::new();
    client.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
    echo.await.unwrap();
    let outcome = common::next_outcome(&mut proxy, WITHIN).await;
    assert_eq!(outcome.downstream_to_upstream, HELLO as u64 + ROUNDS * 64);
    assert_eq!(outcome.upstream_to_downstream, ROUNDS * 64);
    assert_eq!(e.handovers(), 1);
    assert!(before > 0, "pings after the move go through the kernel");
}

/// A connection that ends below the threshold never enters the SockHash: it is copied,
/// with the same close semantics (half-close both ways).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_connection_stays_in_the_copy() {
    let dp = dataplane(THRESHOLD);
    let e = ebpf(&dp);
    let (mut proxy, client, server) = connected(&dp, Limits::default()).await;
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    // The client finishes first; the server answers after its EOF.
    send_pattern(cw, 4, 1000).await;
    assert_eq!(recv_pattern(sr, 4).await, 1000);
    send_pattern(sw, 5, 3000).await;
    assert_eq!(recv_pattern(cr, 5).await, 3000);
    let outcome = common::next_outcome(&mut proxy, WITHIN).await;
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(outcome.downstream_to_upstream, HELLO as u64 + 1000);
    assert_eq!(outcome.upstream_to_downstream, 3000);
    assert_eq!(e.handovers(), 0);
    assert_eq!(e.fallbacks(), 0);
    assert_eq!(redirected(e), 0, "nothing went through the kernel");
    assert_eq!(e.map_counts().peers, 0);
}

/// FINs right at the threshold, from both sides at once, many times: whichever wins
/// (the move or the half-close), no connection hangs and no byte is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_racing_the_move() {
    const CONNS: u64 = 40;
    let dp = dataplane(THRESHOLD);
    let e = ebpf(&dp);
    for i in 0..CONNS {
        let (mut proxy, client, server) = connected(&dp, Limits::default()).await;
        let (cr, cw) = client.into_split();
        let (sr, sw) = server.into_split();
        // From well below the threshold (4 KiB each way) to well above (24 KiB), so that
        // the move happens at every distance from the FINs, or not at all.
        let len = THRESHOLD / 4 + i * 512;
        let run = async {
            tokio::join!(
                send_pattern(cw, 10 + i, len),
                recv_pattern(sr, 10 + i),
                send_pattern(sw, 100 + i, len),
                recv_pattern(cr, 100 + i),
            )
        };
        let ((), up, (), down) = tokio::time::timeout(WITHIN, run)
            .await
            .unwrap_or_else(|_| panic!("connection {i} hung"));
        assert_eq!((up, down), (len, len), "connection {i}");
        let outcome = common::next_outcome(&mut proxy, WITHIN).await;
        assert_eq!(outcome.end, End::Closed, "connection {i}");
        assert_eq!(outcome.downstream_to_upstream, HELLO as u64 + len);
        assert_eq!(outcome.upstream_to_downstream, len);
    }
    eprintln!(
        "moved {} of {CONNS}, fallbacks {}, verdict stats {:?}",
        e.handovers(),
        e.fallbacks(),
        e.stats()
    );
}

/// The lifetime limit counts from the accept, not from the move: a connection that
/// trickles below the threshold for most of its lifetime and then crosses it is still
/// closed when its lifetime is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifetime_counts_from_the_accept() {
    const LIFETIME: Duration = Duration::from_secs(3);
    let dp = dataplane(THRESHOLD);
    let e = ebpf(&dp);
    let limits = Limits {
        max_lifetime: Some(LIFETIME),
        ..Limits::default()
    };
    let start = Instant::now();
    let (mut proxy, mut client, mut server) = connected(&dp, limits).await;
    let chunk = [7u8; 100];
    let mut got = [0u8; 100];
    // About 2 s below the threshold.
    for _ in 0..20 {
        client.write_all(&chunk).await.unwrap();
        server.read_exact(&mut got).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let big = vec![9u8; 2 * THRESHOLD as usize];
    client.write_all(&big).await.unwrap();
    let mut sink = vec![0u8; big.len()];
    server.read_exact(&mut sink).await.unwrap();
    let outcome = common::next_outcome(&mut proxy, WITHIN).await;
    let lived = start.elapsed();
    assert_eq!(outcome.end, End::LifetimeExceeded);
    assert_eq!(e.handovers(), 1, "it was moved before its lifetime ended");
    // Restarted at the move, it would have lived at least 2 s + 3 s.
    assert!(
        lived < LIFETIME + Duration::from_millis(1500),
        "closed after {lived:?}, lifetime {LIFETIME:?}"
    );
}
