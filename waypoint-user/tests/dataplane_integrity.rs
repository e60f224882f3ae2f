//! Bulk integrity through every dataplane: 256 MiB of random data each way at once,
//! SHA-256 compared end to end.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod common;

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
};
use waypoint::dataplane::{End, Kind, Limits};

const TOTAL: u64 = 256 * 1024 * 1024;
const HELLO: usize = 517;

/// The server's one-byte answer to the hello.
const ANSWER: u8 = 0xa5;

/// For the eBPF dataplane: its copy fallbacks so far, and segments redirected so far.
fn ebpf_counts(kind: Kind) -> Option<(u64, u64)> {
    let dp = common::dataplane(kind);
    let waypoint::dataplane::Dataplane::Ebpf(e) = &*dp else {
        return None;
    };
    let redirected = e
        .stats()
        .into_iter()
        .find(|(s, _)| *s == waypoint_common::Stat::Redirected)
        .map(|(_, n)| n)
        .unwrap();
    Some((e.fallbacks(), redirected))
}

async fn bulk_both_ways(kind: Kind) {
    let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut proxy = common::proxy(
        common::dataplane(kind),
        server.local_addr().unwrap(),
        HELLO,
        Limits::default(),
    )
    .await;

    let client = tokio::spawn(async move {
        let mut c = TcpStream::connect(proxy.addr).await.unwrap();
        let hello: Vec<u8> = (0..HELLO).map(|i| i as u8).collect();
        c.write_all(&hello).await.unwrap();
        // Stream only once the server answered, as a TLS client does after its hello. A
        // client streaming right behind the hello can fill more than the eBPF dataplane
        // drains before insertion, and that connection is copied in userspace instead.
        let mut answer = [0u8; 1];
        c.read_exact(&mut answer).await.unwrap();
        assert_eq!(answer, [ANSWER]);
        let (r, w) = c.into_split();
        let (sent, got) = tokio::join!(common::send_random(w, TOTAL, 1), common::recv_all(r));
        (sent, got, proxy.outcomes.recv().await.unwrap())
    });
    let before = ebpf_counts(kind);
    let (s, _) = server.accept().await.unwrap();
    let (r, mut w) = s.into_split();
    let mut r = r;
    let mut hello = vec![0u8; HELLO];
    r.read_exact(&mut hello).await.unwrap();
    assert!(
        hello.iter().enumerate().all(|(i, b)| *b == i as u8),
        "initial bytes arrive first and intact"
    );
    w.write_all(&[ANSWER]).await.unwrap();
    let (sent_back, got) = tokio::join!(common::send_random(w, TOTAL, 2), common::recv_all(r));
    let (client_sent, client_got, outcome) = client.await.unwrap();

    let dp = common::dataplane(kind);
    if let waypoint::dataplane::Dataplane::Ebpf(e) = &*dp {
        // How much went through the kernel fast path vs userspace, and how often the
        // destination's backlog had to be woken, for the log.
        eprintln!(
            "{kind:?}: {outcome:?}; verdict stats {:?}; backlog wake-ups {}",
            e.stats(),
            dp.backlog_wakeups()
        );
    }
    if let (Some((fallbacks, redirected)), Some((fallbacks0, redirected0))) =
        (ebpf_counts(kind), before)
    {
        assert_eq!(
            fallbacks, fallbacks0,
            "the connection fell back to the copy"
        );
        assert!(
            redirected > redirected0,
            "the verdict redirected nothing: the kernel path was not tested"
        );
    }
    assert_eq!(
        got,
        (TOTAL, client_sent),
        "{kind:?}: downstream→upstream intact"
    );
    assert_eq!(
        client_got,
        (TOTAL, sent_back),
        "{kind:?}: upstream→downstream intact"
    );
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(outcome.downstream_to_upstream, TOTAL + HELLO as u64);
    assert_eq!(outcome.upstream_to_downstream, TOTAL + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_256mib_each_way_ebpf() {
    bulk_both_ways(Kind::Ebpf).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_256mib_each_way_splice() {
    bulk_both_ways(Kind::Splice).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_256mib_each_way_copy() {
    bulk_both_ways(Kind::Copy).await;
}

/// Dials `back` and forwards `downstream`, whose `hello` was read, to it through `dp`, in
/// a task of its own; returns the server's end and the task.
async fn forward_to(
    dp: &std::sync::Arc<waypoint::dataplane::Dataplane>,
    back: &TcpListener,
    downstream: TcpStream,
    hello: &[u8],
) -> (
    TcpStream,
    tokio::task::JoinHandle<Result<waypoint::dataplane::Outcome, waypoint::dataplane::Error>>,
) {
    let upstream = TcpStream::connect(back.local_addr().unwrap())
        .await
        .unwrap();
    let (server, _) = back.accept().await.unwrap();
    let forward = dp.forward(
        downstream.into(),
        upstream.into(),
        hello.to_vec(),
        Limits::default(),
    );
    (server, tokio::spawn(forward))
}

/// Bytes queued on the downstream socket (SIOCINQ).
fn queued(sock: &impl std::os::fd::AsRawFd) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD (= SIOCINQ) writes one int through the pointer.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::FIONREAD, &mut n) };
    assert_eq!(rc, 0, "SIOCINQ: {}", std::io::Error::last_os_error());
    usize::try_from(n).unwrap()
}

/// A client that streams right behind its hello, so that more is queued than the eBPF
/// dataplane drains before it inserts the sockets: that connection must be copied in
/// userspace instead, every byte in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_sender_falls_back_intact_ebpf() {
    const EAGER: u64 = 6 << 20;
    const SEED: u64 = 77;
    // Its own instance: the shared one's fallback count is checked by the bulk test,
    // which may run at the same time.
    common::require_root();
    let dp = std::sync::Arc::new(waypoint::dataplane::Dataplane::Ebpf(std::sync::Arc::new(
        waypoint::dataplane::ebpf::Ebpf::load(waypoint::dataplane::ebpf::Config {
            move_after: 0,
            ..waypoint::dataplane::ebpf::Config::default()
        })
        .unwrap(),
    )));
    let waypoint::dataplane::Dataplane::Ebpf(e) = &*dp else {
        unreachable!("an eBPF dataplane")
    };
    let fallbacks = e.fallbacks();
    let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut client = TcpStream::connect(front.local_addr().unwrap())
        .await
        .unwrap();
    let (mut downstream, _) = front.accept().await.unwrap();
    // Room for more than the dataplane's 1 MiB drain while nobody reads. FORCE (root):
    // SO_RCVBUF stops at `net.core.rmem_max`, 208 KiB on a stock kernel.
    let size: libc::c_int = 2 << 20; // doubled by the kernel
                                     // SAFETY: setsockopt reads one int, which lives for the call.
    let rc = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&downstream),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&raw const size).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_RCVBUFFORCE: {}", std::io::Error::last_os_error());
    let writer = tokio::spawn(async move {
        client.write_all(&[7u8; HELLO]).await.unwrap();
        let mut buf = vec![0u8; 256 * 1024];
        let mut off = 0u64;
        while off < EAGER {
            let n = (buf.len() as u64).min(EAGER - off) as usize;
            common::pattern_fill(SEED, off, &mut buf[..n]);
            client.write_all(&buf[..n]).await.unwrap();
            off += n as u64;
        }
        client.shutdown().await.unwrap();
        client
    });
    let mut hello = [0u8; HELLO];
    downstream.read_exact(&mut hello).await.unwrap();
    let waited = std::time::Instant::now();
    while queued(&downstream) <= 1 << 20 {
        assert!(
            waited.elapsed() < std::time::Duration::from_secs(10),
            "the client never queued more than 1 MiB ({} bytes)",
            queued(&downstream)
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let (mut server, forward) = forward_to(&dp, &back, downstream, &hello).await;
    let mut got = vec![0u8; HELLO];
    server.read_exact(&mut got).await.unwrap();
    assert_eq!(got, [7u8; HELLO], "the hello first");
    let mut buf = vec![0u8; 256 * 1024];
    let mut off = 0u64;
    loop {
        let n = server.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        if let Some(bad) = common::pattern_mismatch(SEED, off, &buf[..n]) {
            panic!("wrong byte at offset {bad} of the eager stream");
        }
        off += n as u64;
    }
    assert_eq!(off, EAGER, "every eager byte, then EOF");
    server.shutdown().await.unwrap();
    let mut client = writer.await.unwrap();
    assert_eq!(client.read(&mut buf).await.unwrap(), 0);
    let outcome = forward.await.unwrap().unwrap();
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(outcome.downstream_to_upstream, HELLO as u64 + EAGER);
    assert_eq!(outcome.upstream_to_downstream, 0);
    assert_eq!(
        e.fallbacks(),
        fallbacks + 1,
        "the eager connection was not served by the copy fallback"
    );
}

/// Bytes that arrive between the drain and the insertion into the SockHash (a pause holds
/// that moment open here) are queued where the verdict only looks when more data
/// arrives. A client that then waits for an answer, or whose window they filled (seen
/// once in CI: a connection stalled with a full window until its idle timeout, an hour),
/// sends nothing more. They must be forwarded, in order, and the connection redirected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_landing_between_drain_and_insertion_flow_on_ebpf() {
    /// Queued behind the hello when the dataplane takes over: the drain takes it.
    const FIRST: usize = 1_000;
    const REQUEST: usize = 100_000;
    const SEED: u64 = 78;
    const PAUSE: std::time::Duration = std::time::Duration::from_secs(1);
    common::require_root();
    let e = std::sync::Arc::new(
        waypoint::dataplane::ebpf::Ebpf::load(waypoint::dataplane::ebpf::Config {
            move_after: 0,
            hooks: waypoint::dataplane::ebpf::Hooks {
                sockhash_entry_pause: Some(PAUSE),
                ..waypoint::dataplane::ebpf::Hooks::default()
            },
            ..waypoint::dataplane::ebpf::Config::default()
        })
        .unwrap(),
    );
    let dp = std::sync::Arc::new(waypoint::dataplane::Dataplane::Ebpf(e.clone()));
    let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = front.local_addr().unwrap();
    let (go, started) = std::sync::mpsc::channel::<()>();
    // On its own thread: the pause blocks the worker that runs the entry.
    let client = tokio::task::spawn_blocking(move || {
        use std::io::{Read as _, Write as _};
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        let mut stream = vec![0u8; FIRST + REQUEST];
        common::pattern_fill(SEED, 0, &mut stream);
        c.write_all(&[7u8; HELLO]).unwrap();
        c.write_all(&stream[..FIRST]).unwrap();
        // The drain is done, the insertion 1 s away.
        started.recv().unwrap();
        c.write_all(&stream[FIRST..]).unwrap();
        c.set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        let mut answer = [0u8; 1];
        c.read_exact(&mut answer).unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).unwrap();
        (answer[0], rest.len())
    });
    let (mut downstream, _) = front.accept().await.unwrap();
    let mut hello = [0u8; HELLO];
    downstream.read_exact(&mut hello).await.unwrap();
    let waited = std::time::Instant::now();
    while queued(&downstream) < FIRST {
        assert!(waited.elapsed() < PAUSE * 10, "the first bytes arrive");
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    // A second descriptor of the waypoint's socket, to see the drain empty its queue;
    // closed before the connection ends, which it would otherwise keep open.
    let probe = std::os::fd::AsFd::as_fd(&downstream)
        .try_clone_to_owned()
        .unwrap();
    let (mut server, forward) = forward_to(&dp, &back, downstream, &hello).await;
    while queued(&probe) != 0 {
        assert!(
            waited.elapsed() < PAUSE * 10,
            "the dataplane drains the queue"
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    drop(probe);
    go.send(()).unwrap();
    let mut got = vec![0u8; HELLO + FIRST + REQUEST];
    tokio::time::timeout(PAUSE * 10, server.read_exact(&mut got))
        .await
        .expect("the request is forwarded, not stranded")
        .unwrap();
    assert_eq!(got[..HELLO], [7u8; HELLO], "the hello first");
    assert_eq!(
        common::pattern_mismatch(SEED, 0, &got[HELLO..]),
        None,
        "the first bytes and the request intact, in order"
    );
    server.write_all(&[ANSWER]).await.unwrap();
    let mut rest = Vec::new();
    server.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
    server.shutdown().await.unwrap();
    assert_eq!(client.await.unwrap(), (ANSWER, 0));
    let outcome = forward.await.unwrap().unwrap();
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(
        outcome.downstream_to_upstream,
        (HELLO + FIRST + REQUEST) as u64
    );
    assert_eq!(outcome.upstream_to_downstream, 1);
    assert_eq!(e.fallbacks(), 0, "redirected, not copied");
}
