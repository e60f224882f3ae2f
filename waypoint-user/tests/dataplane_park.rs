//! Idle connections parked outside tokio (`--park-after`): a parked connection wakes on
//! bytes, FIN or RST from either side and on its deadlines, loses no byte, and leaves no
//! slot behind when it ends or is dropped. For the copy dataplane and for the eBPF
//! dataplane's copy phase (which then still moves into the kernel). Needs root for the
//! eBPF runs (CI is root); never skipped.
//!
//! Each on a work-stealing runtime (the process's parker and its thread) and on a
//! single-threaded one (the runtime's own parker, as on a tunnel worker).
//!
//! Each test's dataplane counts its own parkings, so the tests run side by side.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod common;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
};
use waypoint::dataplane::{
    copy::UserspaceCopy,
    ebpf::{self, Ebpf},
    Dataplane, End, Kind, Limits,
};

const HELLO: usize = 517;
const PARK_AFTER: Duration = Duration::from_millis(20);
const WITHIN: Duration = Duration::from_secs(10);
/// The eBPF dataplane's threshold here: the tests below stay under it until they say so.
const THRESHOLD: u64 = 64 * 1024;

macro_rules! both {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn copy() {
                    super::$name(waypoint::dataplane::Kind::Copy).await
                }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn ebpf() {
                    super::$name(waypoint::dataplane::Kind::Ebpf).await
                }
                // A single-threaded runtime, as a tunnel worker runs: the runtime's own
                // parker, driven by its reactor, instead of the process's thread.
                #[tokio::test]
                async fn copy_one_thread() {
                    super::$name(waypoint::dataplane::Kind::Copy).await
                }
                #[tokio::test]
                async fn ebpf_one_thread() {
                    super::$name(waypoint::dataplane::Kind::Ebpf).await
                }
            }
        )*
    };
}

both!(
    bytes_wake_a_parked_connection_both_ways,
    fin_while_parked_is_passed_on,
    reset_while_parked_aborts_the_other_side,
    idle_timeout_closes_a_parked_connection,
    lifetime_closes_a_parked_connection,
);

fn dataplane(kind: Kind) -> Arc<Dataplane> {
    match kind {
        Kind::Copy => Arc::new(Dataplane::Copy(UserspaceCopy::new())),
        Kind::Ebpf => {
            common::require_root();
            Arc::new(Dataplane::Ebpf(Arc::new(
                Ebpf::load(ebpf::Config {
                    move_after: THRESHOLD,
                    ..ebpf::Config::default()
                })
                .expect("eBPF dataplane must load: tests run as root on a sockmap kernel"),
            )))
        }
        _ => unreachable!("parking is a copy-phase feature"),
    }
}

fn limits() -> Limits {
    Limits {
        park_after: Some(PARK_AFTER),
        ..Limits::default()
    }
}

/// A proxy in front of a fresh listener, the client connected and its hello sent, the
/// server's end accepted and the hello read.
async fn connected(dp: &Arc<Dataplane>, limits: Limits) -> (common::Proxy, TcpStream, TcpStream) {
    let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = common::proxy(dp.clone(), server.local_addr().unwrap(), HELLO, limits).await;
    let mut client = TcpStream::connect(proxy.addr).await.unwrap();
    client.write_all(&[7u8; HELLO]).await.unwrap();
    let (mut s, _) = server.accept().await.unwrap();
    let mut got = vec![0u8; HELLO];
    s.read_exact(&mut got).await.unwrap();
    assert_eq!(got, [7u8; HELLO]);
    (proxy, client, s)
}

/// Waits until `n` connections are parked and at least `parks` parkings happened.
async fn parked(dp: &Dataplane, n: usize, parks: u64, what: &str) {
    let deadline = Instant::now() + WITHIN;
    loop {
        let p = dp.parking();
        if p.parked == n && p.parks >= parks {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: want {n} parked after {parks} parkings, have {p:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn exchange(from: &mut TcpStream, to: &mut TcpStream, len: usize, seed: u64) {
    let mut sent = vec![0u8; len];
    common::pattern_fill(seed, 0, &mut sent);
    from.write_all(&sent).await.unwrap();
    let mut got = vec![0u8; len];
    tokio::time::timeout(WITHIN, to.read_exact(&mut got))
        .await
        .expect("bytes after the park never came")
        .unwrap();
    assert!(got == sent, "bytes lost or changed across the park");
}

/// A parked connection wakes for bytes from either side, parks again, and after five
/// rounds ends cleanly with exact counts; its slot is gone.
async fn bytes_wake_a_parked_connection_both_ways(kind: Kind) {
    let dp = dataplane(kind);
    let (mut proxy, mut client, mut server) = connected(&dp, limits()).await;
    let (mut d2u, mut u2d) = (HELLO as u64, 0u64);
    for round in 0..5u64 {
        parked(&dp, 1, 2 * round + 1, "before a client write").await;
        exchange(&mut client, &mut server, 1000, round).await;
        d2u += 1000;
        parked(&dp, 1, 2 * round + 2, "before a server write").await;
        exchange(&mut server, &mut client, 3000, 100 + round).await;
        u2d += 3000;
    }
    client.shutdown().await.unwrap();
    server.shutdown().await.unwrap();
    let mut rest = Vec::new();
    server.read_to_end(&mut rest).await.unwrap();
    client.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
    let o = common::next_outcome(&mut proxy, WITHIN).await;
    assert_eq!(o.end, End::Closed);
    assert_eq!(
        (o.downstream_to_upstream, o.upstream_to_downstream),
        (d2u, u2d)
    );
    parked(&dp, 0, 0, "after the close").await;
}

/// A FIN that arrives while the connection is parked reaches the other side, which can
/// still answer: the half-close semantics hold across the park.
async fn fin_while_parked_is_passed_on(kind: Kind) {
    let dp = dataplane(kind);
    let (mut proxy, mut client, mut server) = connected(&dp, limits()).await;
    parked(&dp, 1, 1, "before the FIN").await;
    client.shutdown().await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(WITHIN, server.read_to_end(&mut got))
        .await
        .expect("the FIN was not passed on")
        .unwrap();
    assert!(got.is_empty());
    server
        .write_all(b"answer after the half-close")
        .await
        .unwrap();
    server.shutdown().await.unwrap();
    let mut got = Vec::new();
    client.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"answer after the half-close");
    let o = common::next_outcome(&mut proxy, WITHIN).await;
    assert_eq!(o.end, End::Closed);
    assert_eq!(o.upstream_to_downstream, 27);
    parked(&dp, 0, 0, "after the close").await;
}

/// A reset from the client while parked aborts the server's side.
async fn reset_while_parked_aborts_the_other_side(kind: Kind) {
    let dp = dataplane(kind);
    let (mut proxy, client, mut server) = connected(&dp, limits()).await;
    parked(&dp, 1, 1, "before the reset").await;
    socket2::SockRef::from(&client)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(client);
    let mut buf = [0u8; 16];
    let r = tokio::time::timeout(WITHIN, server.read(&mut buf))
        .await
        .expect("the reset was not passed on");
    assert!(
        matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "the server should see a reset, got {r:?}"
    );
    let o = common::next_outcome(&mut proxy, WITHIN).await;
    assert_eq!(o.end, End::DownstreamReset);
    parked(&dp, 0, 0, "after the reset").await;
}

/// A parked connection with `limits` closes with `end`, `after` the accept give or take
/// two park cadences, though nothing wakes it but its deadline; both ends see the close.
async fn closes_while_parked(kind: Kind, limits: Limits, end: End, after: Duration) {
    let dp = dataplane(kind);
    let started = Instant::now();
    let (mut proxy, mut client, mut server) = connected(&dp, limits).await;
    parked(&dp, 1, 1, "while idle").await;
    let o = common::next_outcome(&mut proxy, WITHIN).await;
    let took = started.elapsed();
    assert_eq!(o.end, end);
    // The idle check runs on the park cadence: it may fire late, never early.
    assert!(took >= after, "{end:?} after {took:?}, due after {after:?}");
    assert!(
        took < after * 3,
        "{end:?} after {took:?}, due after {after:?}: the deadline did not wake it"
    );
    let mut buf = Vec::new();
    let _ = client.read_to_end(&mut buf).await;
    let _ = server.read_to_end(&mut buf).await;
    parked(&dp, 0, 0, "after the close").await;
}

/// The idle timeout of a parked connection is kept by the parker.
async fn idle_timeout_closes_a_parked_connection(kind: Kind) {
    let idle = Duration::from_millis(600);
    let limits = Limits {
        idle_timeout: idle,
        ..limits()
    };
    closes_while_parked(kind, limits, End::IdleTimeout, idle).await;
}

/// The lifetime of a parked connection is kept too.
async fn lifetime_closes_a_parked_connection(kind: Kind) {
    let lifetime = Duration::from_millis(700);
    let limits = Limits {
        max_lifetime: Some(lifetime),
        ..limits()
    };
    closes_while_parked(kind, limits, End::LifetimeExceeded, lifetime).await;
}

/// A parked connection whose task is dropped (a drain deadline, a shutdown) gives its
/// slot back and closes both sockets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_parked_connection_frees_its_slot() {
    let dp = dataplane(Kind::Copy);
    let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut client = TcpStream::connect(front.local_addr().unwrap())
        .await
        .unwrap();
    let (down, _) = front.accept().await.unwrap();
    let up = TcpStream::connect(server.local_addr().unwrap())
        .await
        .unwrap();
    let (mut s, _) = server.accept().await.unwrap();
    let task = tokio::spawn({
        let dp = dp.clone();
        async move {
            dp.forward(down.into(), up.into(), b"hi".to_vec(), limits())
                .await
        }
    });
    let mut hi = [0u8; 2];
    s.read_exact(&mut hi).await.unwrap();
    parked(&dp, 1, 1, "before the drop").await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    parked(&dp, 0, 0, "after the drop").await;
    let mut buf = Vec::new();
    let r = tokio::time::timeout(WITHIN, client.read_to_end(&mut buf)).await;
    assert!(r.is_ok(), "the client's socket was not closed");
    let r = tokio::time::timeout(WITHIN, s.read_to_end(&mut buf)).await;
    assert!(r.is_ok(), "the server's socket was not closed");
}

/// The eBPF dataplane: a connection parked below `--move-after` that then streams
/// moves into the kernel as usual, with every byte intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_connection_still_moves_into_the_kernel() {
    let dp = dataplane(Kind::Ebpf);
    let Dataplane::Ebpf(e) = &*dp else {
        unreachable!()
    };
    let (mut proxy, mut client, mut server) = connected(&dp, limits()).await;
    parked(&dp, 1, 1, "before streaming").await;
    const LEN: usize = 4 << 20;
    let writer = tokio::spawn(async move {
        let mut buf = vec![0u8; LEN];
        common::pattern_fill(9, 0, &mut buf);
        client.write_all(&buf).await.unwrap();
        client.shutdown().await.unwrap();
        client
    });
    let mut got = Vec::new();
    tokio::time::timeout(WITHIN, server.read_to_end(&mut got))
        .await
        .expect("the stream did not finish")
        .unwrap();
    assert_eq!(got.len(), LEN);
    assert_eq!(common::pattern_mismatch(9, 0, &got), None);
    server.shutdown().await.unwrap();
    let mut client = writer.await.unwrap();
    let mut rest = Vec::new();
    client.read_to_end(&mut rest).await.unwrap();
    let o = common::next_outcome(&mut proxy, WITHIN).await;
    assert_eq!(o.end, End::Closed);
    assert_eq!(o.downstream_to_upstream, (HELLO + LEN) as u64);
    assert_eq!(
        e.handovers(),
        1,
        "the connection should have moved into the kernel"
    );
    assert_eq!(e.fallbacks(), 0);
    parked(&dp, 0, 0, "after the close").await;
}
