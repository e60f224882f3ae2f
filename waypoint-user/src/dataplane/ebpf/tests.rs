//! Tests of the eBPF dataplane on the running kernel (root; never skipped).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::{
    ops::Range,
    os::fd::AsRawFd as _,
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

use crate::dataplane::{flows::Budget, queued};

use super::sockhash::*;
use super::*;

/// A connection moved from the copy into the SockHash (`Entry::Kick`), forwarded to its
/// end.
async fn moved(dp: &Ebpf, down: TcpStream, up: TcpStream, limits: Limits) -> Outcome {
    dp.redirect(
        down,
        up,
        (Vec::new(), Vec::new()),
        limits,
        Entry::Kick,
        None,
    )
    .await
    .unwrap()
}

/// The eBPF dataplane with every connection in the SockHash from its first byte.
fn kernel_from_the_first_byte() -> Ebpf {
    Ebpf::load(Config {
        move_after: 0,
        ..Config::default()
    })
    .unwrap()
}

async fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (b, _) = l.accept().await.unwrap();
    (a, b)
}

/// A rewritten connection's task holds [`Rewriting`] (its `Rewritten` inline) for the
/// connection's life, in an enum beside the SockHash path's future: it must take no
/// more room than that, or every connection pays for it. Printed for
/// docs/ARCHITECTURE.md.
#[test]
fn the_rewrite_path_is_no_bigger_than_the_sockhash_path() {
    fn returned<A, B, C, D, E, F, R>(_: fn(A, B, C, D, E, F) -> R) -> usize {
        size_of::<R>()
    }
    let sockhash = returned(Ebpf::forward_sockmap);
    let rewriting = size_of::<Rewriting>();
    let rewritten = size_of::<rewrite::Rewritten>();
    eprintln!("sockhash path {sockhash} B, rewrite path {rewriting} B (Rewritten {rewritten} B)");
    assert!(
        rewriting <= sockhash,
        "the rewrite path ({rewriting} B) outgrew the SockHash path ({sockhash} B)"
    );
}

/// Bytes that arrived since tokio's reactor last turned are drained all the same. With
/// `try_read` they stayed queued, and a pod's banner waited in the SockHash for the
/// pod's next segment, which never came (about one run in twenty of the rewrite
/// tests' pod-speaks-first case).
#[tokio::test]
async fn drain_reads_what_the_reactor_has_not_seen() {
    let (a, b) = pair().await;
    let mut probe = [0u8; 8];
    // An empty read clears tokio's readiness, as the router's reads of the socket do.
    assert_eq!(
        b.try_read(&mut probe).unwrap_err().kind(),
        io::ErrorKind::WouldBlock
    );
    // No await from here on: the reactor cannot turn on this thread.
    assert_eq!(socket2::SockRef::from(&a).send(b"banner").unwrap(), 6);
    let deadline = Instant::now() + Duration::from_secs(5);
    while queued(&b).unwrap() < 6 {
        assert!(Instant::now() < deadline, "the bytes never arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        b.try_read(&mut probe).unwrap_err().kind(),
        io::ErrorKind::WouldBlock,
        "tokio has not seen the bytes: the case this test is about"
    );
    let mut got = Vec::new();
    assert!(drain_queued(&b, &mut got).unwrap());
    assert_eq!(got, b"banner");
    assert_eq!(queued(&b).unwrap(), 0);
}

fn stat(dp: &Ebpf, which: Stat) -> u64 {
    dp.stats()
        .into_iter()
        .find(|(s, _)| *s == which)
        .map_or(0, |(_, n)| n)
}

/// A slot claimed by another socket (a reuse in progress) is never used: the
/// verdict passes the bytes to userspace instead of redirecting them on a budget
/// that is not theirs. Needs root; never skipped.
#[tokio::test]
async fn verdict_ignores_a_slot_owned_by_another_socket() {
    // SAFETY: geteuid has no preconditions.
    assert!(nix::unistd::geteuid().is_root(), "needs root (eBPF)");
    let dp = Ebpf::load(Config::default()).expect("the eBPF dataplane loads");
    let (mut client, down) = pair().await;
    let (up, mut server) = pair().await;
    let (dc, uc) = (cookie(&down).unwrap(), cookie(&up).unwrap());
    let mut reg = Registration::new(&dp, dc, uc);
    let (down_flow, _) = reg.attach((dc, &down), (uc, &up), true).expect("attached");
    down_flow.publish(Budget {
        credit: 1 << 20,
        consumed: 0,
    });

    down_flow.set_owner(dc ^ 1);
    let unknown = stat(&dp, Stat::PassedUnknown);
    client.write_all(b"hello").await.unwrap();
    let mut got = [0u8; 5];
    tokio::time::timeout(Duration::from_secs(5), async {
        down.readable().await.unwrap();
        assert_eq!(down.try_read(&mut got).unwrap(), 5);
    })
    .await
    .expect("the bytes stay readable on the source");
    assert_eq!(&got, b"hello");
    assert_eq!(stat(&dp, Stat::PassedUnknown), unknown + 1);
    assert_eq!(down_flow.counters(), flows::Counters::default());

    // The same socket with its own slot again: redirected to the peer.
    down_flow.set_owner(dc);
    client.write_all(b"world").await.unwrap();
    let mut got = [0u8; 5];
    tokio::time::timeout(Duration::from_secs(5), server.read_exact(&mut got))
        .await
        .expect("redirected to the peer")
        .unwrap();
    assert_eq!(&got, b"world");
    assert_eq!(down_flow.counters().redirected, 5);
    drop(reg);
}

/// Signals that a full ring lost do not leave their connections waiting: the signal
/// thread sees the verdict's count of lost signals grow and wakes every waiting
/// connection. Needs root; never skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_signals_wake_every_waiting_connection() {
    // SAFETY: geteuid has no preconditions.
    assert!(nix::unistd::geteuid().is_root(), "needs root (eBPF)");
    // More connections than a one-page ring holds records (4096 / 16).
    const CONNS: usize = 400;
    let dp = Arc::new(
        Ebpf::load(Config {
            move_after: 0,
            // Every segment trips the budget: each first one is signalled.
            max_inflight: 1,
            signal_ring_bytes: 4096,
            ..Config::default()
        })
        .expect("the eBPF dataplane loads"),
    );
    let mut ends = Vec::new();
    let mut tasks = Vec::new();
    for _ in 0..CONNS {
        let (client, down) = pair().await;
        let (up, server) = pair().await;
        let limits = Limits {
            idle_timeout: Duration::from_secs(3600),
            ..Limits::default()
        };
        tasks.push(tokio::spawn(dp.forward(
            down.into(),
            up.into(),
            Vec::new(),
            limits,
        )));
        ends.push((client, server));
    }
    tokio::time::timeout(Duration::from_secs(10), async {
        while dp.map_counts().peers < 2 * CONNS {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("every connection enters the SockHash");
    // Every direction of every connection waits for a signal.
    tokio::time::timeout(Duration::from_secs(10), async {
        while dp.signals.waiting() < 2 * CONNS {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("every direction waits for a signal");

    dp.pause_signals(true);
    for (client, _) in &mut ends {
        client.write_all(&[5u8; 64]).await.unwrap();
    }
    tokio::time::timeout(Duration::from_secs(10), async {
        while stat(&dp, Stat::SignalLost) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the full ring loses signals");
    dp.pause_signals(false);

    // Within 3 s: the connections' own idle-check timers (every 5 s with these
    // limits) would wake them too, and must not be what did.
    let woken = Instant::now() + Duration::from_secs(3);
    for (i, (_, server)) in ends.iter_mut().enumerate() {
        let mut got = [0u8; 64];
        tokio::time::timeout_at(woken.into(), server.read_exact(&mut got))
            .await
            .unwrap_or_else(|_| panic!("connection {i} was not woken"))
            .unwrap();
        assert_eq!(got, [5u8; 64]);
    }
    let (_, sweeps) = dp.signals();
    assert!(sweeps >= 1, "the loss was seen");
    println!(
        "{} signals lost, {} read, {sweeps} sweeps",
        stat(&dp, Stat::SignalLost),
        dp.signals().0
    );
    drop(ends);
    for t in tasks {
        t.await.unwrap().unwrap();
    }
}

/// Ends of rewritten connections that a full ring lost (their ring wakes nobody, so
/// only the signal thread's count of losses can tell) still end their connections:
/// the thread sees the loss and wakes every waiting one. Without it they would wait
/// for their idle timeout (an hour here). Needs root; never skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_ends_of_rewritten_connections_still_end_them() {
    // SAFETY: geteuid has no preconditions.
    assert!(nix::unistd::geteuid().is_root(), "needs root (eBPF)");
    // More connections than a one-page ring holds records (4096 / 16).
    const CONNS: usize = 300;
    let dp = Arc::new(
        Ebpf::load(Config {
            move_after: 0,
            rewrite_splice: true,
            signal_ring_bytes: 4096,
            ..Config::default()
        })
        .expect("the eBPF dataplane with the rewrite program loads"),
    );
    let limits = Limits {
        idle_timeout: Duration::from_secs(3600),
        ..Limits::default()
    };
    let mut ends = Vec::new();
    let mut tasks = Vec::new();
    for _ in 0..CONNS {
        let (client, down) = pair().await;
        let (up, mut server) = pair().await;
        tasks.push(tokio::spawn(dp.forward(
            down.into(),
            up.into(),
            b"hello".to_vec(),
            limits,
        )));
        let mut hello = [0u8; 5];
        server.read_exact(&mut hello).await.unwrap();
        assert_eq!(&hello, b"hello");
        ends.push((client, server));
    }
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let (c, _) = dp.rewrite_counts().unwrap();
            if c.rewritten == CONNS as u64 && c.pending == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("every connection is rewritten and handed over");

    dp.pause_signals(true);
    // Both ends close: two FINs each, and the second one's end record.
    drop(ends);
    tokio::time::timeout(Duration::from_secs(10), async {
        while stat(&dp, Stat::SignalLost) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the full ring loses ends");
    dp.pause_signals(false);

    // The linger (3 s) and a look at the ring (at most 100 ms) later.
    let deadline = Instant::now() + rewrite::LINGER + Duration::from_secs(3);
    for (i, t) in tasks.into_iter().enumerate() {
        let outcome = tokio::time::timeout_at(deadline.into(), t)
            .await
            .unwrap_or_else(|_| panic!("connection {i} did not end"))
            .unwrap()
            .unwrap();
        assert_eq!(outcome.end, End::Closed, "connection {i}");
    }
    let (read, sweeps) = dp.signals();
    assert!(sweeps >= 1, "the loss was seen");
    println!(
        "{} ends lost, {read} read, {sweeps} sweeps",
        stat(&dp, Stat::SignalLost)
    );
}

/// With every flow slot taken, a new connection is counted as a fallback and
/// served by the userspace copy, every byte intact. Needs root; never skipped.
#[tokio::test]
async fn no_free_slot_falls_back_to_userspace() {
    // SAFETY: geteuid has no preconditions.
    assert!(nix::unistd::geteuid().is_root(), "needs root (eBPF)");
    let dp = Arc::new(
        Ebpf::load(Config {
            max_sockets: 2,
            move_after: 0,
            ..Config::default()
        })
        .expect("the eBPF dataplane loads"),
    );
    // One connection holds both slots.
    let (_a, b) = pair().await;
    let (c, _d) = pair().await;
    let _held = Registration::new(&dp, cookie(&b).unwrap(), cookie(&c).unwrap());
    assert_eq!(dp.map_counts().flows, 2);

    let (mut client, down) = pair().await;
    let (up, mut server) = pair().await;
    let forward = dp.forward(down.into(), up.into(), b"hi".to_vec(), Limits::default());
    let peers = async {
        client.write_all(b"abc").await.unwrap();
        let mut got = [0u8; 5];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hiabc");
        server.write_all(b"xyz").await.unwrap();
        let mut got = [0u8; 3];
        client.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"xyz");
        client.shutdown().await.unwrap();
        server.shutdown().await.unwrap();
    };
    let (outcome, ()) = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(forward, peers)
    })
    .await
    .expect("the connection ends");
    let outcome = outcome.expect("served in userspace");
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(outcome.downstream_to_upstream, 5);
    assert_eq!(outcome.upstream_to_downstream, 3);
    assert_eq!(dp.fallbacks(), 1);
    assert_eq!(dp.map_counts().flows, 2, "the held records are untouched");
}

/// Waits until `sock` has at least `n` bytes queued and tokio has seen it readable.
async fn queued_at_least(sock: &TcpStream, n: usize) {
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if crate::sys::queued(sock).unwrap() >= n {
                // And tokio knows: its try_read does not even try before that.
                sock.readable().await.unwrap();
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the bytes arrive");
}

/// What is queued on both sockets is forwarded before they enter the SockHash.
#[tokio::test]
async fn settle_forwards_what_is_queued() {
    let (mut client, down) = pair().await;
    let (up, mut server) = pair().await;
    let a: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    client.write_all(&a).await.unwrap();
    server.write_all(b"answer").await.unwrap();
    queued_at_least(&down, a.len()).await;
    queued_at_least(&up, 6).await;
    let s = settle(&down, &up).unwrap();
    assert_eq!((s.d2u, s.u2d), (a.len() as u64, 6));
    assert!(s.down_rest.is_empty() && s.up_rest.is_empty());
    let mut got = vec![0u8; a.len()];
    server.read_exact(&mut got).await.unwrap();
    assert_eq!(got, a);
    let mut got = [0u8; 6];
    client.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"answer");
}

/// A destination that takes no more is not waited for: the rest is handed back, in
/// order, and nothing is lost.
#[tokio::test]
async fn settle_hands_back_what_it_cannot_write_at_once() {
    let (mut client, down) = pair().await;
    let (up, mut server) = pair().await;
    // Small buffers on the way to the server, which does not read yet.
    socket2::SockRef::from(&up)
        .set_send_buffer_size(4096)
        .unwrap();
    socket2::SockRef::from(&server)
        .set_recv_buffer_size(4096)
        .unwrap();
    let a: Vec<u8> = (0..300_000u32).map(|i| (i % 241) as u8).collect();
    let writer = tokio::spawn(async move {
        client.write_all(&a).await.unwrap();
        (client, a)
    });
    queued_at_least(&down, 64 * 1024).await;
    let s = settle(&down, &up).unwrap();
    assert!(!s.down_rest.is_empty(), "the destination was full: {s:?}");
    assert_eq!(s.u2d, 0);
    // The written part, then the rest, then what the client sends later: the stream.
    let mut got = vec![0u8; s.d2u as usize];
    let (_client, a) = tokio::join!(server.read_exact(&mut got), writer);
    let (_client, a) = a.unwrap();
    drop(_client);
    let rest_at = s.d2u as usize;
    assert_eq!(got, a[..rest_at]);
    assert_eq!(s.down_rest, a[rest_at..rest_at + s.down_rest.len()]);
}

/// What `Entry::Kick` relies on: bytes queued before the insertion, the first of them
/// already read, are redirected once SO_RCVLOWAT is set (the insertion alone leaves
/// them queued on 6.18), and the repeat check cuts what was read.
#[tokio::test]
async fn queued_bytes_are_redirected_at_insertion() {
    let dp = kernel_from_the_first_byte();
    let (mut client, down) = pair().await;
    let (up, mut server) = pair().await;
    client.write_all(b"queued bytes").await.unwrap();
    queued_at_least(&down, 12).await;
    let mut two = [0u8; 2];
    assert_eq!(down.try_read(&mut two).unwrap(), 2);
    let (dc, uc) = (cookie(&down).unwrap(), cookie(&up).unwrap());
    let mut reg = Registration::new(&dp, dc, uc);
    reg.set_credit(0, 1 << 20);
    reg.set_credit(1, 1 << 20);
    {
        let mut peers = lock(&dp.peers);
        peers.insert(dc, up.as_fd(), 0).unwrap();
        reg.inserted[0] = true;
        peers.insert(uc, down.as_fd(), 0).unwrap();
        reg.inserted[1] = true;
    }
    set_rcvlowat(&down).unwrap();
    let mut got = [0u8; 10];
    tokio::time::timeout(Duration::from_secs(3), server.read_exact(&mut got))
        .await
        .expect("redirected at insertion")
        .unwrap();
    assert_eq!(&got, b"eued bytes");
    assert_eq!(stat(&dp, Stat::Trimmed), 1);
    drop(reg);
}

#[test]
#[allow(clippy::single_range_in_vec_init, reason = "ranges, one of them")]
fn kept_is_the_part_of_a_read_that_no_repeat_covers() {
    // No repeat.
    assert_eq!(kept(100, 50, &[0..0, 0..0]), vec![0..50]);
    // Before, inside, across the start, across the end, around, after.
    assert_eq!(kept(100, 50, &[10..90]), vec![0..50]);
    assert_eq!(kept(100, 50, &[110..120]), vec![0..10, 20..50]);
    assert_eq!(kept(100, 50, &[90..120]), vec![20..50]);
    assert_eq!(kept(100, 50, &[140..200]), vec![0..40]);
    assert_eq!(kept(100, 50, &[90..200]), Vec::<Range<usize>>::new());
    assert_eq!(kept(100, 50, &[150..200]), vec![0..50]);
    // Several in one read, in any order, and one reaching into the next read.
    assert_eq!(
        kept(100, 50, &[130..135, 105..110, 0..0, 145..160]),
        vec![0..5, 10..30, 35..45]
    );
    assert_eq!(kept(150, 50, &[145..160]), vec![10..50]);
}

/// A client that sent `sent` bytes, all queued in the waypoint's socket (which TCP
/// coalesces into segments of hundreds of KB, nobody reading), of which the copy read
/// the first `read`; the socket to the pod, and the pod. Returns (client, down, up,
/// server, what was sent).
async fn queued_and_partly_read(
    sent: usize,
    read: usize,
) -> (TcpStream, TcpStream, TcpStream, TcpStream, Vec<u8>) {
    let (mut client, down) = pair().await;
    let (up, server) = pair().await;
    socket2::SockRef::from(&down)
        .set_recv_buffer_size(8 << 20)
        .unwrap();
    let bytes: Vec<u8> = (0..sent as u32).map(|i| (i % 251) as u8).collect();
    client.write_all(&bytes).await.unwrap();
    queued_at_least(&down, sent).await;
    let mut buf = vec![0u8; read];
    let mut n = 0;
    while n < read {
        n += down.try_read(&mut buf[n..]).unwrap();
    }
    (client, down, up, server, bytes)
}

/// A copy that read far into a long queued segment leaves a repeat longer than the
/// verdict cuts: TCP coalesces a queue that nobody reads into segments of hundreds of
/// KB. That segment goes to userspace, which drops the repeat: the server gets exactly
/// what the copy had not read, once (before this, what lay beyond the 262,080 bytes
/// the verdict used to cut went through twice).
#[tokio::test]
async fn a_long_repeat_at_the_move_is_dropped_in_userspace() {
    const SENT: usize = 2 << 20;
    const READ: usize = 400_000;
    let dp = kernel_from_the_first_byte();
    // What the copy read before the move.
    let (mut client, down, up, mut server, sent) = queued_and_partly_read(SENT, READ).await;
    let dp = &dp;
    let redirected = moved(dp, down, up, Limits::default());
    let check = async {
        let mut got = vec![0u8; SENT - READ];
        tokio::time::timeout(Duration::from_secs(5), server.read_exact(&mut got))
            .await
            .expect("the queue reached the server")
            .unwrap();
        let first = got.iter().zip(&sent[READ..]).position(|(a, b)| a != b);
        assert_eq!(first, None, "bytes repeated or lost at the move");
        client.shutdown().await.unwrap();
        let mut rest = Vec::new();
        server.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "{} bytes more than sent", rest.len());
        server.shutdown().await.unwrap();
    };
    let (outcome, ()) = tokio::join!(redirected, check);
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(outcome.downstream_to_upstream, (SENT - READ) as u64);
    assert_eq!(
        stat(dp, Stat::PassedRepeat),
        1,
        "the long repeat went to userspace"
    );
    assert_eq!(stat(dp, Stat::TrimFailed), 0);
}

/// The kernel's side of the trap the copy avoids (see `Dir::full` in copy.rs): after a
/// long repeat went to userspace at the move, TCP counts the repeat twice in the
/// socket's `copied_seq`, and reports nothing to read until as many new bytes
/// arrived. A client that then sends a little and waits for its answer is stuck.
/// Kept as a test of the kernel: if it ever fails, the kernel has changed, and the
/// copy's restriction can be revisited.
#[tokio::test]
async fn a_long_repeat_at_the_move_strands_the_bytes_behind_it() {
    const SENT: usize = 2 << 20;
    const READ: usize = 400_000;
    const MORE: usize = 1000;
    let dp = kernel_from_the_first_byte();
    let (mut client, down, up, mut server, _) = queued_and_partly_read(SENT, READ).await;
    let dp = &dp;
    let limits = Limits {
        idle_timeout: Duration::from_secs(3),
        ..Limits::default()
    };
    let redirected = moved(dp, down, up, limits);
    let check = async {
        let mut got = vec![0u8; SENT - READ];
        server.read_exact(&mut got).await.unwrap();
        client.write_all(&[7u8; MORE]).await.unwrap();
        let mut more = vec![0u8; MORE];
        let late = tokio::time::timeout(Duration::from_secs(1), server.read_exact(&mut more)).await;
        assert!(
            late.is_err(),
            "the bytes behind a long repeat were not stranded"
        );
    };
    let (outcome, ()) = tokio::join!(redirected, check);
    assert_eq!(stat(dp, Stat::PassedRepeat), 1);
    // The idle timeout ends it, with a reset: bytes are held.
    assert_eq!(outcome.end, End::IdleTimeout);
}

/// A FIN that races the insertion: the socket with less queued (the pod's) goes in
/// first, the client's FIN lands during the pause before the insertion, and the
/// client's socket is refused. The connection is copied in userspace while the pod's
/// socket stays in the SockHash: its bytes go through the verdict (passed, at zero
/// credit) and the copy reads them from the psock, its EOF gated on the verdict's
/// count (see `copy::Gate`). Every byte arrives both ways, in order, and both FINs
/// are passed on: a wrong base for the count would hold the pod's FIN forever.
#[tokio::test]
async fn a_fin_racing_the_insertion_leaves_one_socket_in_and_loses_nothing() {
    const UP: usize = 300_000;
    let dp = Ebpf::load(Config {
        move_after: 0,
        hooks: Hooks {
            sockhash_entry_pause: Some(Duration::from_millis(300)),
            ..Hooks::default()
        },
        ..Config::default()
    })
    .unwrap();
    let (mut client, down) = pair().await;
    let (up, mut server) = pair().await;
    let to_pod: Vec<u8> = (0..64 * 1024).map(|i| (i % 241) as u8).collect();
    let to_client: Vec<u8> = (0..UP).map(|i| (i % 239) as u8).collect();
    client.write_all(&to_pod).await.unwrap();
    server.write_all(&to_client[..100]).await.unwrap();
    queued_at_least(&down, to_pod.len()).await;
    queued_at_least(&up, 100).await;
    // The client half-closes while the dataplane sleeps between its drain and the
    // insertion (a blocking sleep on this thread, so from another one).
    let fd = client.as_raw_fd();
    let fin = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        // The descriptor stays open (the test holds `client`) until joined.
        nix::sys::socket::shutdown(fd, nix::sys::socket::Shutdown::Write).unwrap();
    });
    let dp = &dp;
    let redirected = moved(dp, down, up, Limits::default());
    let check = async {
        let mut got = Vec::new();
        let pod = async {
            server.read_to_end(&mut got).await.unwrap();
            server.write_all(&to_client[100..]).await.unwrap();
            server.shutdown().await.unwrap();
        };
        let mut back = Vec::new();
        let reader = client.read_to_end(&mut back);
        let (_, read) = tokio::join!(pod, reader);
        read.unwrap();
        assert!(got == to_pod, "the pod's bytes differ");
        assert!(back == to_client, "the client's bytes differ");
    };
    let (outcome, ()) = tokio::time::timeout(Duration::from_secs(20), async {
        tokio::join!(redirected, check)
    })
    .await
    .expect("the connection never ended");
    fin.join().unwrap();
    assert_eq!(dp.fallbacks(), 1);
    assert!(
        stat(dp, Stat::PassedBudget) + stat(dp, Stat::PassedOrdering) > 0,
        "the pod's bytes did not go through the verdict"
    );
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(outcome.downstream_to_upstream, to_pod.len() as u64);
    assert_eq!(outcome.upstream_to_downstream, UP as u64);
}

/// A queue that TCP coalesced into long segments, partly read when the copy reaches
/// its threshold: the copy reads on until a read leaves the queue empty, so that no
/// segment is partly read at the move, no repeat reaches the verdict, and a client
/// that sends a little more after the move and waits for its answer gets it through
/// (it was stuck behind the repeat: `a_long_repeat_at_the_move_strands_the_bytes_behind_it`).
#[tokio::test]
async fn the_move_leaves_no_partly_read_segment_behind() {
    const SENT: usize = 2 << 20;
    const MORE: usize = 1000;
    let dp = Arc::new(
        Ebpf::load(Config {
            move_after: 400_000,
            ..Config::default()
        })
        .unwrap(),
    );
    let (mut client, down, up, mut server, sent) = queued_and_partly_read(SENT, 0).await;
    let forwarded = dp.forward_sockmap(down, up, Vec::new(), Limits::default(), None);
    let check = async {
        let mut got = vec![0u8; SENT];
        server.read_exact(&mut got).await.unwrap();
        assert!(got == sent, "bytes repeated or lost at the move");
        client.write_all(&[7u8; MORE]).await.unwrap();
        let mut more = vec![0u8; MORE];
        tokio::time::timeout(Duration::from_secs(5), server.read_exact(&mut more))
            .await
            .expect("the bytes sent after the move reached the server")
            .unwrap();
        assert_eq!(more, vec![7u8; MORE]);
        client.shutdown().await.unwrap();
        let mut rest = Vec::new();
        server.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "{} bytes more than sent", rest.len());
        server.shutdown().await.unwrap();
    };
    let (outcome, ()) = tokio::join!(forwarded, check);
    let outcome = outcome.unwrap();
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(outcome.downstream_to_upstream, (SENT + MORE) as u64);
    assert_eq!(dp.handovers(), 1, "the connection moved into the kernel");
    assert_eq!(stat(&dp, Stat::PassedRepeat), 0);
}

/// Only the verdict's own refusal is retried without the repeat check: a failure of the
/// rewrite program (or of anything else) is reported as itself, not as a missing
/// CAP_PERFMON.
#[test]
fn only_a_refused_verdict_is_retried_without_the_repeat_check() {
    use aya::programs::ProgramError::NotLoaded;
    assert!(Error::Verdict(NotLoaded).refused_verdict());
    assert!(!Error::Rewrite(NotLoaded).refused_verdict());
    assert!(!Error::Program(NotLoaded).refused_verdict());
    assert!(!Error::Linger(io::ErrorKind::Other.into()).refused_verdict());
}

/// A baseline read while acks arrive is exact, or says it is not: the bytes a socket's
/// TCP took are read again and again while a slow reader's window updates ack the
/// sender's queue, and every figure called exact must be what was written. (A single
/// `handed` read understates whenever an ack lands between its two system calls; the
/// test prints how often that happened.)
#[test]
fn an_exact_baseline_is_exact_while_acks_arrive() {
    use std::io::{Read as _, Write as _};
    const SENT: usize = 32 << 20;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut tx = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut rx, _) = l.accept().unwrap();
    // SO_SNDBUFFORCE (root): room for all of it, past `wmem_max`.
    crate::sys::setsockopt_int(&tx, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, 2 * SENT as i32)
        .unwrap();
    socket2::SockRef::from(&rx)
        .set_recv_buffer_size(64 << 10)
        .unwrap();
    let (base, exact) = handed_exact(&tx).unwrap();
    assert!(exact, "an idle socket's figure did not settle");
    tx.set_nonblocking(true).unwrap();
    let mut left = SENT;
    let chunk = vec![7u8; 64 << 10];
    while left > 0 {
        match tx.write(&chunk[..left.min(chunk.len())]) {
            Ok(n) => left -= n,
            Err(e) => panic!("the send buffer should hold it all: {e}"),
        }
    }
    // A paced reader behind a small window: each read opens the window, and the
    // sender's TCP sends more and takes the reader's acks (some 350 in 0.3 s here).
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 16 << 10];
        let mut got = 0;
        while got < SENT {
            let n = rx.read(&mut buf).unwrap();
            assert!(n > 0, "EOF after {got} bytes");
            got += n;
            std::thread::sleep(Duration::from_micros(50));
        }
    });
    let (mut exact_reads, mut inexact, mut understated) = (0u32, 0u32, 0u32);
    let (mut acks, mut last_acked) = (0u32, 0u64);
    while !reader.is_finished() {
        let (h, exact) = handed_exact(&tx).unwrap();
        if h.acked != last_acked {
            acks += 1;
            last_acked = h.acked;
        }
        if exact {
            assert_eq!(h.bytes - base.bytes, SENT as u64, "an exact figure was not");
            exact_reads += 1;
        } else {
            inexact += 1;
        }
        if handed(&tx).unwrap().bytes - base.bytes < SENT as u64 {
            understated += 1;
        }
    }
    reader.join().unwrap();
    eprintln!(
        "{exact_reads} exact reads, {inexact} not settled, {acks} acks seen; single reads \
         understated {understated} times"
    );
    assert!(exact_reads > 100, "too few reads while acks arrived");
}
