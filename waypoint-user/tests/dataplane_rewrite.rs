//! The rewrite splice (`--rewrite-splice`): connections whose client and pod are on this
//! host have their packet headers rewritten by a TC program on `lo`. Each test loads
//! its own dataplane (a TCX program each, chained on `lo`), so that its counters and map
//! entries are its own.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
mod common;

use std::{sync::Arc, time::Duration};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
};
use waypoint::dataplane::{
    ebpf,
    rewrite::{self, Refusal},
    Dataplane, End, Limits, Taken,
};
use waypoint_common::RewriteStat;

const HELLO: usize = 517;
const ANSWER: u8 = 0xa5;

fn load() -> (Arc<Dataplane>, Arc<ebpf::Ebpf>) {
    common::require_root();
    let e = Arc::new(
        ebpf::Ebpf::load(ebpf::Config {
            move_after: 0,
            rewrite_splice: true,
            ..ebpf::Config::default()
        })
        .expect("the eBPF dataplane with the rewrite program must load (root, TCX kernel)"),
    );
    (Arc::new(Dataplane::Ebpf(e.clone())), e)
}

/// The map's entries and the `live` count once every ended connection's linger is over
/// (`LINGER`, and the sweep after it).
async fn after_linger(e: &ebpf::Ebpf) -> (usize, u64) {
    let deadline = tokio::time::Instant::now() + rewrite::LINGER + Duration::from_secs(2);
    loop {
        let now = (e.rewrite_entries(), e.rewrite_counts().unwrap().0.live);
        if now == (0, 0) || tokio::time::Instant::now() >= deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn stat(e: &ebpf::Ebpf, which: RewriteStat) -> u64 {
    let (_, stats) = e.rewrite_counts().unwrap();
    stats.into_iter().find(|(s, _)| *s == which).unwrap().1
}

/// Client side of a connection through `proxy`: sends the hello, waits for the answer.
async fn client(proxy: std::net::SocketAddr) -> TcpStream {
    let mut c = TcpStream::connect(proxy).await.unwrap();
    hello_answered(&mut c).await;
    c
}

/// The pod of an echo test: accepts, checks the hello, answers, then echoes until the
/// client closes.
async fn echo_pod(listener: &TcpListener) {
    let mut s = server(listener).await;
    let mut buf = vec![0u8; 70_000];
    loop {
        let n = s.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        s.write_all(&buf[..n]).await.unwrap();
    }
}

/// Sends the hello and checks the answer.
async fn hello_answered(c: &mut TcpStream) {
    let hello: Vec<u8> = (0..HELLO).map(|i| i as u8).collect();
    c.write_all(&hello).await.unwrap();
    let mut answer = [0u8; 1];
    c.read_exact(&mut answer).await.unwrap();
    assert_eq!(answer, [ANSWER]);
}

/// `rounds` echoes of the `sizes` in turn, each checked, then a close answered by the
/// pod's close; returns the bytes echoed.
async fn echo_rounds(c: &mut TcpStream, rounds: u64, sizes: &[usize]) -> u64 {
    let mut total = 0u64;
    for i in 0..rounds {
        let len = sizes[(i % sizes.len() as u64) as usize];
        let mut msg = vec![0u8; len];
        common::pattern_fill(i, 0, &mut msg);
        c.write_all(&msg).await.unwrap();
        let mut back = vec![0u8; len];
        c.read_exact(&mut back).await.unwrap();
        assert_eq!(common::pattern_mismatch(i, 0, &back), None, "echo {i}");
        total += len as u64;
    }
    c.shutdown().await.unwrap();
    let mut rest = Vec::new();
    c.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
    total
}

/// Server side: accepts, checks the hello, answers.
async fn server(listener: &TcpListener) -> TcpStream {
    let (mut s, _) = listener.accept().await.unwrap();
    let mut hello = vec![0u8; HELLO];
    s.read_exact(&mut hello).await.unwrap();
    assert!(
        hello.iter().enumerate().all(|(i, b)| *b == i as u8),
        "the hello arrives first and intact"
    );
    s.write_all(&[ANSWER]).await.unwrap();
    s
}

/// 256 MiB each way at once, SHA-256 compared, through rewritten packets only: the
/// connection is counted as rewritten, the program rewrote its packets, and
/// its entries are gone once it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_256mib_each_way_intact() {
    const TOTAL: u64 = 256 * 1024 * 1024;
    let (dp, e) = load();
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut proxy = common::proxy(
        dp.clone(),
        back.local_addr().unwrap(),
        HELLO,
        Limits::default(),
    )
    .await;
    let addr = proxy.addr;
    let c = tokio::spawn(async move {
        let c = client(addr).await;
        let (r, w) = c.into_split();
        tokio::join!(common::send_random(w, TOTAL, 1), common::recv_all(r))
    });
    let s = server(&back).await;
    let (r, w) = s.into_split();
    let (sent_back, got) = tokio::join!(common::send_random(w, TOTAL, 2), common::recv_all(r));
    let (client_sent, client_got) = c.await.unwrap();
    assert_eq!(got, (TOTAL, client_sent), "client → pod intact");
    assert_eq!(client_got, (TOTAL, sent_back), "pod → client intact");
    let outcome = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(outcome.downstream_to_upstream, TOTAL + HELLO as u64);
    assert_eq!(outcome.upstream_to_downstream, TOTAL + 1);
    let (counts, stats) = e.rewrite_counts().unwrap();
    eprintln!("{counts:?} {stats:?}");
    assert_eq!(counts.rewritten, 1, "rewritten, not by the SockHash");
    // Its path: the rewrite. With the rewrite on, every path the eBPF dataplane can take
    // is listed: rewritten, redirected for each refusal, copied short or as a fallback.
    let paths = dp.paths();
    assert_eq!(paths.len(), 1 + Refusal::ALL.len() + 2, "{paths:?}");
    let took: Vec<_> = paths.into_iter().filter(|(_, n)| *n > 0).collect();
    assert_eq!(took, [(Taken::Rewritten, 1)]);
    assert_eq!(counts.stranded, 0);
    assert!(
        stat(&e, RewriteStat::Rewritten) > 1_000,
        "the program rewrote the connection's packets"
    );
    assert_eq!(stat(&e, RewriteStat::BadOptions), 0);
    // The outcome comes at the end; the entries stay for a last ACK or a resent FIN,
    // and go after the linger.
    assert_eq!(e.rewrite_entries(), 2, "the entries linger");
    assert_eq!(counts.live, 1);
    assert_eq!(
        after_linger(&e).await,
        (0, 0),
        "the entries are removed after the linger"
    );
}

/// Request/response: 2,000 echoes of varying sizes, each checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echoes_are_intact() {
    echoes(true).await;
}

/// The same with sockets the dataplane did not see before their handshakes: their
/// sequence numbers are read in repair mode instead of computed from the records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echoes_are_intact_read_in_repair_mode() {
    echoes(false).await;
}

/// A proxy whose sockets are marked for their handshake records, or not.
async fn proxy_marked(
    mark: bool,
    dp: Arc<Dataplane>,
    upstream: std::net::SocketAddr,
) -> common::Proxy {
    if mark {
        common::proxy(dp, upstream, HELLO, Limits::default()).await
    } else {
        common::proxy_unmarked(dp, upstream, HELLO, Limits::default()).await
    }
}

async fn echoes(mark: bool) {
    let (dp, e) = load();
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut proxy = proxy_marked(mark, dp, back.local_addr().unwrap()).await;
    let addr = proxy.addr;
    let pod = echo_pod(&back);
    let cl = async {
        let mut c = client(addr).await;
        echo_rounds(&mut c, 2_000, &[1, 64, 1_400, 9_000, 65_000]).await
    };
    let ((), total) = tokio::join!(pod, cl);
    let outcome = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(outcome.downstream_to_upstream, total + HELLO as u64);
    assert_eq!(outcome.upstream_to_downstream, total + 1);
    let counts = e.rewrite_counts().unwrap().0;
    assert_eq!(counts.rewritten, 1);
    // The sequence numbers came from the handshake records (see `established.rs`), or
    // from repair mode.
    assert_eq!(counts.recorded, u64::from(mark));
    assert_eq!(after_linger(&e).await, (0, 0));
}

/// A connection between two sockets of this host that no waypoint is part of: ten
/// round trips of 1 KiB, then both close.
async fn unrelated_connection() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (mut s, _) = l.accept().await.unwrap();
    let mut buf = [0u8; 1024];
    for _ in 0..10 {
        c.write_all(&buf).await.unwrap();
        s.read_exact(&mut buf).await.unwrap();
        s.write_all(&buf).await.unwrap();
        c.read_exact(&mut buf).await.unwrap();
    }
    drop(c);
    assert_eq!(s.read(&mut buf).await.unwrap(), 0);
}

/// The program runs on every TCP packet of the node, but looks up in its map only those
/// to a port that clients of rewritten connections send to, or from one their pods send
/// from: other connections cost no lookup, before a splice and after one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_packets_of_rewritten_ports_are_looked_up() {
    let (dp, e) = load();
    unrelated_connection().await;
    assert_eq!(
        stat(&e, RewriteStat::LookedUp),
        0,
        "no port is rewritten yet"
    );
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut proxy = common::proxy(dp, back.local_addr().unwrap(), HELLO, Limits::default()).await;
    let addr = proxy.addr;
    let pod = echo_pod(&back);
    let cl = async {
        let mut c = client(addr).await;
        echo_rounds(&mut c, 10, &[1_000]).await
    };
    tokio::join!(pod, cl);
    let outcome = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(e.rewrite_counts().unwrap().0.rewritten, 1);
    let looked = stat(&e, RewriteStat::LookedUp);
    assert!(
        looked >= stat(&e, RewriteStat::Rewritten) && looked > 20,
        "the rewritten connection's packets are looked up ({looked})"
    );
    assert_eq!(after_linger(&e).await, (0, 0));
    let looked = stat(&e, RewriteStat::LookedUp);
    unrelated_connection().await;
    assert_eq!(
        stat(&e, RewriteStat::LookedUp),
        looked,
        "a connection between other ports was looked up"
    );
}

/// A reset from the pod reaches the client, and the connection ends as such.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_reset_reaches_client() {
    let (dp, e) = load();
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut proxy = common::proxy(dp, back.local_addr().unwrap(), HELLO, Limits::default()).await;
    let addr = proxy.addr;
    let c = tokio::spawn(async move {
        let mut c = client(addr).await;
        c.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 16];
        c.read(&mut buf).await
    });
    let mut s = server(&back).await;
    let mut ping = [0u8; 4];
    s.read_exact(&mut ping).await.unwrap();
    assert_eq!(&ping, b"ping");
    socket2::SockRef::from(&s)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(s);
    let read = c.await.unwrap();
    assert_eq!(
        read.map_err(|e| e.kind()),
        Err(std::io::ErrorKind::ConnectionReset),
        "the client sees the pod's reset"
    );
    let outcome = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
    assert_eq!(outcome.end, End::UpstreamReset);
    assert_eq!(after_linger(&e).await, (0, 0));
}

/// A client that reuses its port while its last connection's entries still linger (it
/// reset that one, so it holds no TIME_WAIT): the SYN makes the program drop the old
/// entries, the new connection is rewritten under the same client 4-tuple, and the old
/// connection's end, once its linger is over, leaves the new one's entry alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reusing_its_port_keeps_its_new_connection() {
    let (dp, e) = load();
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut proxy = common::proxy(dp, back.local_addr().unwrap(), HELLO, Limits::default()).await;
    let addr = proxy.addr;
    let dial = |port: u16| {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.set_reuse_address(true).unwrap();
        let local = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        s.bind(&local.into()).unwrap();
        s.connect(&addr.into()).unwrap();
        s.set_nonblocking(true).unwrap();
        TcpStream::from_std(s.into()).unwrap()
    };
    let mut first = dial(0);
    let port = first.local_addr().unwrap().port();
    let ((), mut pod_first) = tokio::join!(hello_answered(&mut first), server(&back));
    socket2::SockRef::from(&first)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(first);
    let mut buf = [0u8; 4];
    let read = pod_first.read(&mut buf).await.map_err(|e| e.kind());
    assert_eq!(read, Err(std::io::ErrorKind::ConnectionReset));
    // The first connection's entries linger now; the same 4-tuple again.
    let mut second = dial(port);
    let ((), mut pod_second) = tokio::join!(hello_answered(&mut second), server(&back));
    assert_eq!(stat(&e, RewriteStat::Syn), 1, "the SYN met the old entries");
    // The first connection ended with the SYN (the program removed its entries). Once
    // its linger is over, its removal leaves the client's key, the second
    // connection's now, alone.
    let o = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
    assert_eq!(o.end, End::DownstreamReset, "{o:?}");
    let live = || e.rewrite_counts().unwrap().0.live;
    assert_eq!(live(), 2, "the first connection lingers");
    let deadline = tokio::time::Instant::now() + rewrite::LINGER + Duration::from_secs(2);
    while live() > 1 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(live(), 1, "the first connection's linger is over");
    assert_eq!(
        e.rewrite_entries(),
        2,
        "the second connection's entries stay"
    );
    second.write_all(b"ping").await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), pod_second.read_exact(&mut buf)).await;
    assert!(
        matches!(got, Ok(Ok(4))),
        "the new connection still carries bytes: {got:?}"
    );
    assert_eq!(&buf, b"ping");
    pod_second.write_all(b"pong").await.unwrap();
    second.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"pong");
    let (counts, _) = e.rewrite_counts().unwrap();
    assert_eq!(counts.rewritten, 2, "{counts:?}");
    drop(second);
    drop(pod_second);
    let o = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
    assert_eq!(o.downstream_to_upstream, HELLO as u64 + 4, "{o:?}");
    assert_eq!(after_linger(&e).await, (0, 0));
}

/// A half-close passes through: the client shuts its side, the pod reads EOF and goes on
/// writing, and the client reads all of it before its EOF.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_passes_through() {
    const REPLY: usize = 3 << 20;
    let (dp, _e) = load();
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut proxy = common::proxy(dp, back.local_addr().unwrap(), HELLO, Limits::default()).await;
    let addr = proxy.addr;
    let c = tokio::spawn(async move {
        let mut c = client(addr).await;
        c.write_all(b"request").await.unwrap();
        c.shutdown().await.unwrap();
        let mut got = Vec::new();
        c.read_to_end(&mut got).await.unwrap();
        got
    });
    let mut s = server(&back).await;
    let mut req = Vec::new();
    s.read_to_end(&mut req).await.unwrap();
    assert_eq!(req, b"request");
    let mut reply = vec![0u8; REPLY];
    common::pattern_fill(9, 0, &mut reply);
    s.write_all(&reply).await.unwrap();
    s.shutdown().await.unwrap();
    let got = c.await.unwrap();
    assert_eq!(got.len(), REPLY);
    assert_eq!(common::pattern_mismatch(9, 0, &got), None);
    let outcome = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
    assert_eq!(outcome.end, End::Closed);
}

/// Clients that stream right behind their hello, without waiting for an answer: the
/// hand-over refuses them when the waypoint's socket holds their bytes (the SockHash
/// takes them), or finds a packet that slipped into that socket (both ends reset).
/// Whatever it does, no byte is lost or corrupted silently: the pod gets every byte in
/// order and then EOF, or one of the two ends sees a reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_clients_lose_nothing_silently() {
    eager_clients(true).await;
}

/// The same, with the sequence numbers read in repair mode (sockets not marked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_clients_lose_nothing_silently_read_in_repair_mode() {
    eager_clients(false).await;
}

async fn eager_clients(mark: bool) {
    const CONNS: u64 = 30;
    const STREAM: u64 = 2 << 20;
    let (dp, e) = load();
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = proxy_marked(mark, dp, back.local_addr().unwrap()).await;
    let addr = proxy.addr;
    let mut intact = 0;
    let mut reset = 0;
    for seed in 0..CONNS {
        let c = tokio::spawn(async move {
            let mut c = TcpStream::connect(addr).await.unwrap();
            let hello: Vec<u8> = (0..HELLO).map(|i| i as u8).collect();
            c.write_all(&hello).await?;
            let mut buf = vec![0u8; 64 * 1024];
            let mut off = 0u64;
            while off < STREAM {
                let n = (buf.len() as u64).min(STREAM - off) as usize;
                common::pattern_fill(seed, off, &mut buf[..n]);
                c.write_all(&buf[..n]).await?;
                off += n as u64;
            }
            c.shutdown().await?;
            let mut rest = Vec::new();
            c.read_to_end(&mut rest).await?;
            Ok::<_, std::io::Error>(())
        });
        let (mut s, _) = back.accept().await.unwrap();
        let mut hello = vec![0u8; HELLO];
        s.read_exact(&mut hello).await.unwrap();
        assert!(hello.iter().enumerate().all(|(i, b)| *b == i as u8));
        let mut got = 0u64;
        let mut buf = vec![0u8; 64 * 1024];
        let pod = loop {
            // Bounded: a stalled connection fails here, not at its idle timeout (an hour).
            let read = tokio::time::timeout(Duration::from_secs(30), s.read(&mut buf))
                .await
                .unwrap_or_else(|_| panic!("connection {seed}: stalled at byte {got}"));
            match read {
                Ok(0) => break Ok(()),
                Ok(n) => {
                    assert_eq!(
                        common::pattern_mismatch(seed, got, &buf[..n]),
                        None,
                        "connection {seed}: bytes corrupted or out of order at {got}"
                    );
                    got += n as u64;
                }
                Err(e) => break Err(e),
            }
        };
        drop(s);
        let client = tokio::time::timeout(Duration::from_secs(30), c)
            .await
            .expect("the client finishes")
            .unwrap();
        match (pod, client) {
            (Ok(()), Ok(())) => {
                assert_eq!(got, STREAM, "connection {seed}: EOF before every byte");
                intact += 1;
            }
            (p, c) => {
                let kinds = (p.map_err(|e| e.kind()), c.map_err(|e| e.kind()));
                assert!(
                    matches!(kinds.0, Err(std::io::ErrorKind::ConnectionReset))
                        || matches!(
                            kinds.1,
                            Err(std::io::ErrorKind::ConnectionReset
                                | std::io::ErrorKind::BrokenPipe)
                        ),
                    "connection {seed}: ended with {kinds:?}, neither intact nor reset"
                );
                reset += 1;
            }
        }
    }
    let (counts, _) = e.rewrite_counts().unwrap();
    eprintln!("intact {intact}, reset {reset}: {counts:?}");
    assert_eq!(
        counts.rewritten + counts.refused.iter().sum::<u64>(),
        CONNS,
        "every connection was rewritten or refused"
    );
    assert_eq!(
        reset, counts.stranded,
        "a reset only where the hand-over found stranded bytes"
    );
    let expected = if mark { counts.rewritten } else { 0 };
    assert_eq!(counts.recorded, expected);
}

/// Reads until the stream fails or ends: the error kind, or None at EOF.
async fn read_until_error(s: &mut TcpStream) -> Option<std::io::ErrorKind> {
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf).await {
            Ok(0) => return None,
            Ok(_) => {}
            Err(e) => return Some(e.kind()),
        }
    }
}

/// Both ends learn of the connection's end by a reset, within 10 s: the pod's stream
/// `pod`, and the client task `client` (which reads until an error).
async fn both_reset(
    pod: &mut TcpStream,
    client: tokio::task::JoinHandle<Option<std::io::ErrorKind>>,
) {
    let pod = tokio::time::timeout(Duration::from_secs(10), read_until_error(pod))
        .await
        .expect("the pod learns of the end");
    let client = tokio::time::timeout(Duration::from_secs(10), client)
        .await
        .expect("the client learns of the end")
        .unwrap();
    assert_eq!(client, Some(std::io::ErrorKind::ConnectionReset), "client");
    assert_eq!(pod, Some(std::io::ErrorKind::ConnectionReset), "pod");
}

/// A packet that lands in the waypoint's accepted socket during the hand-over (here: the
/// client sends while the hand-over is held between reading the sequence numbers and
/// inserting the entries) is carried on by the waypoint's socket to the pod, right behind
/// the hello: the pod gets every byte in order, the client's later bytes (rewritten)
/// follow, and the pod's acknowledgement of the carried bytes reaches that socket (the
/// fill map is empty before the linger ends). Fails with the reset the hand-over did
/// before (`stranded`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_landed_at_the_hand_over_reach_the_pod() {
    landed(true, false).await;
}

/// The same, with the sequence numbers read in repair mode (sockets not marked): the
/// check reads the receive queues' sequence numbers instead of `TCP_INFO`'s counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_landed_at_the_hand_over_reach_the_pod_read_in_repair_mode() {
    landed(false, false).await;
}

/// The client sends its last bytes and its FIN during the hand-over: the waypoint's
/// socket sends both on, the pod answers and closes, and the connection's end is seen
/// at once (not at the idle timeout), with every byte counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fin_landed_at_the_hand_over_reaches_the_pod() {
    landed(true, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fin_landed_at_the_hand_over_reaches_the_pod_read_in_repair_mode() {
    landed(false, true).await;
}

async fn landed(mark: bool, fin: bool) {
    const EARLY: &[u8] = b"sent before the server answered";
    const LATER: &[u8] = b"sent after the answer";
    common::require_root();
    let e = Arc::new(
        ebpf::Ebpf::load(ebpf::Config {
            move_after: 0,
            rewrite_splice: true,
            hooks: ebpf::Hooks {
                rewrite_handover_pause: Some(Duration::from_secs(1)),
                ..ebpf::Hooks::default()
            },
            ..ebpf::Config::default()
        })
        .unwrap(),
    );
    let dp = Arc::new(Dataplane::Ebpf(e.clone()));
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut proxy = proxy_marked(mark, dp, back.local_addr().unwrap()).await;
    let addr = proxy.addr;
    let held = e.clone();
    // On its own thread, not a worker: the pause blocks the worker that runs the
    // hand-over, and a client task woken on that worker (into its LIFO slot, which the
    // other worker cannot steal) would wait out the pause and send too late.
    let c = tokio::task::spawn_blocking(move || {
        use std::io::{Read as _, Write as _};
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        let hello: Vec<u8> = (0..HELLO).map(|i| i as u8).collect();
        c.write_all(&hello).unwrap();
        // Once the hand-over has read the sequence numbers, it is held before it inserts
        // the entries: what the client sends now lands in the waypoint's socket.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while held.rewrite_counts().unwrap().0.pending == 0 {
            assert!(std::time::Instant::now() < deadline, "the hand-over starts");
            std::thread::sleep(Duration::from_millis(1));
        }
        c.write_all(EARLY).unwrap();
        if fin {
            c.shutdown(std::net::Shutdown::Write).unwrap();
        }
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut answer = [0u8; 1];
        c.read_exact(&mut answer).unwrap();
        assert_eq!(answer[0], ANSWER);
        if !fin {
            c.write_all(LATER).unwrap();
            c.shutdown(std::net::Shutdown::Write).unwrap();
        }
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).unwrap();
        rest
    });
    let mut s = server(&back).await;
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut got))
        .await
        .expect("the pod gets the client's FIN")
        .unwrap();
    let mut want = EARLY.to_vec();
    if !fin {
        want.extend_from_slice(LATER);
    }
    assert_eq!(got, want, "every byte, in order, then the FIN");
    s.write_all(b"bye").await.unwrap();
    drop(s);
    assert_eq!(c.await.unwrap(), b"bye");
    let outcome = common::next_outcome(&mut proxy, Duration::from_secs(5)).await;
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(
        (
            outcome.downstream_to_upstream,
            outcome.upstream_to_downstream
        ),
        ((HELLO + want.len()) as u64, 4),
        "each byte counted once"
    );
    // Before the linger ends (which takes the fill out too), the pod's pure ACK of the
    // carried bytes reached B: it acknowledges them at once, since the client sends on.
    // (A FIN is acknowledged late: `tcp_fin` enters the delayed-ACK mode, and this pod
    // answers and closes within that time; its ACK rides on its answer, to the client.)
    if !fin {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while e.rewrite_fills() != 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the pod's ACK of the carried bytes reached B"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let (counts, _) = e.rewrite_counts().unwrap();
    assert_eq!(
        (
            counts.rewritten,
            counts.filled,
            counts.stranded,
            counts.pending
        ),
        (1, 1, 0, 0)
    );
    assert_eq!(counts.recorded, u64::from(mark));
    assert_eq!(after_linger(&e).await, (0, 0));
    assert_eq!(e.rewrite_fills(), 0, "the fill goes with the entries");
}

/// A rewritten connection idle for the idle timeout is ended by the daemon: both ends get
/// a reset they accept, and the entries go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_timeout_resets_both_ends() {
    let (dp, e) = load();
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let limits = Limits {
        idle_timeout: Duration::from_millis(500),
        ..Limits::default()
    };
    let mut proxy = common::proxy(dp, back.local_addr().unwrap(), HELLO, limits).await;
    let addr = proxy.addr;
    let c = tokio::spawn(async move {
        let mut c = client(addr).await;
        c.write_all(b"ping").await.unwrap();
        let mut pong = [0u8; 4];
        c.read_exact(&mut pong).await.unwrap();
        read_until_error(&mut c).await
    });
    let mut s = server(&back).await;
    let mut ping = [0u8; 4];
    s.read_exact(&mut ping).await.unwrap();
    s.write_all(b"pong").await.unwrap();
    both_reset(&mut s, c).await;
    let outcome = common::next_outcome(&mut proxy, Duration::from_secs(10)).await;
    assert_eq!(outcome.end, End::IdleTimeout);
    assert_eq!(outcome.downstream_to_upstream, HELLO as u64 + 4);
    assert_eq!(outcome.upstream_to_downstream, 1 + 4);
    assert_eq!(e.rewrite_entries(), 0);
}

/// A rewritten connection that carries a message every 50 ms is ended at its lifetime:
/// both ends get a reset, the entries go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifetime_ends_a_busy_connection() {
    let (dp, e) = load();
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let limits = Limits {
        max_lifetime: Some(Duration::from_secs(1)),
        ..Limits::default()
    };
    let mut proxy = common::proxy(dp, back.local_addr().unwrap(), HELLO, limits).await;
    let addr = proxy.addr;
    let c = tokio::spawn(async move {
        let mut c = client(addr).await;
        // Bounded: 200 pings would take 10 s, five times the lifetime. A socket reports
        // a reset once: the first error is the answer.
        for _ in 0..200 {
            if let Err(e) = c.write_all(b"ping").await {
                return Some(e.kind());
            }
            let mut pong = [0u8; 4];
            if let Err(e) = c.read_exact(&mut pong).await {
                return Some(e.kind());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        read_until_error(&mut c).await
    });
    let mut s = server(&back).await;
    let pod = tokio::spawn(async move {
        let mut ping = [0u8; 4];
        loop {
            if let Err(e) = s.read_exact(&mut ping).await {
                return Some(e.kind());
            }
            if let Err(e) = s.write_all(b"pong").await {
                return Some(e.kind());
            }
        }
    });
    let started = std::time::Instant::now();
    let outcome = common::next_outcome(&mut proxy, Duration::from_secs(10)).await;
    assert_eq!(outcome.end, End::LifetimeExceeded);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        outcome.downstream_to_upstream > HELLO as u64 + 4 * 5,
        "the connection was busy: {outcome:?}"
    );
    let client = tokio::time::timeout(Duration::from_secs(10), c)
        .await
        .expect("the client learns of the end")
        .unwrap();
    assert_eq!(client, Some(std::io::ErrorKind::ConnectionReset), "client");
    let pod = tokio::time::timeout(Duration::from_secs(10), pod)
        .await
        .expect("the pod learns of the end")
        .unwrap();
    assert_eq!(pod, Some(std::io::ErrorKind::ConnectionReset), "pod");
    assert_eq!(e.rewrite_entries(), 0);
    assert_eq!(e.rewrite_counts().unwrap().0.live, 0);
}

/// A rewritten connection whose forwarding is dropped (as at the drain deadline) is ended,
/// not left half rewritten: both ends get a reset, the entries go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_rewritten_connection_resets_both_ends() {
    let (dp, e) = load();
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = front.local_addr().unwrap();
    let c = tokio::spawn(async move {
        let mut c = client(addr).await;
        c.write_all(b"ping").await.unwrap();
        let mut pong = [0u8; 4];
        c.read_exact(&mut pong).await.unwrap();
        assert_eq!(&pong, b"pong");
        read_until_error(&mut c).await
    });
    let (mut down, _) = front.accept().await.unwrap();
    let mut initial = vec![0u8; HELLO];
    down.read_exact(&mut initial).await.unwrap();
    let up = TcpStream::connect(back.local_addr().unwrap())
        .await
        .unwrap();
    let forwarding = tokio::spawn(dp.forward(down.into(), up.into(), initial, Limits::default()));
    let mut s = server(&back).await;
    let mut ping = [0u8; 4];
    s.read_exact(&mut ping).await.unwrap();
    s.write_all(b"pong").await.unwrap();
    // Rewritten, and past the hand-over.
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let (counts, _) = e.rewrite_counts().unwrap();
            if counts.rewritten == 1 && counts.pending == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the hand-over ends");
    assert_eq!(e.rewrite_entries(), 2);
    forwarding.abort();
    assert!(forwarding.await.unwrap_err().is_cancelled());
    both_reset(&mut s, c).await;
    assert_eq!(e.rewrite_entries(), 0);
    assert_eq!(e.rewrite_counts().unwrap().0.live, 0);
}

/// With the rewrite map full (room for one connection and a half), the next connection
/// is refused and goes through the SockHash path intact; the refusal is counted, and the
/// one entry of it that fitted is taken out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_map_refuses_to_the_sockhash_path() {
    common::require_root();
    let e = Arc::new(
        ebpf::Ebpf::load(ebpf::Config {
            move_after: 0,
            rewrite_splice: true,
            // The map's size too: the second connection's first entry fits, its second
            // does not.
            max_sockets: 3,
            ..ebpf::Config::default()
        })
        .unwrap(),
    );
    let dp = Arc::new(Dataplane::Ebpf(e.clone()));
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut proxy = common::proxy(dp, back.local_addr().unwrap(), HELLO, Limits::default()).await;
    let addr = proxy.addr;
    let mut conns = Vec::new();
    for _ in 0..2 {
        let c = tokio::spawn(client(addr));
        let s = server(&back).await;
        conns.push((c.await.unwrap(), s));
    }
    let (counts, _) = e.rewrite_counts().unwrap();
    assert_eq!(counts.rewritten, 1, "{counts:?}");
    assert_eq!(
        counts.refused,
        [0, 0, 0, 1, 0, 0],
        "refused for lack of room (setup)"
    );
    assert_eq!(
        e.rewrite_entries(),
        2,
        "the refused connection's entry went"
    );
    for (i, (c, s)) in conns.iter_mut().enumerate() {
        let mut msg = vec![0u8; 100_000];
        common::pattern_fill(i as u64, 0, &mut msg);
        c.write_all(&msg).await.unwrap();
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got).await.unwrap();
        assert_eq!(got, msg, "connection {i}, client to pod");
        s.write_all(&msg).await.unwrap();
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(got, msg, "connection {i}, pod to client");
    }
    for (c, s) in conns {
        drop(c);
        drop(s);
    }
    for _ in 0..2 {
        let o = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
        assert_eq!(o.downstream_to_upstream, HELLO as u64 + 100_000, "{o:?}");
    }
    assert_eq!(after_linger(&e).await, (0, 0));
}

/// A pod that speaks before the hello is forwarded (a banner, or a banner and its FIN)
/// left bytes in the waypoint's socket B that a rewritten conversation would lose: the
/// hand-over refuses it (counted as busy) and the SockHash path carries everything,
/// the banner first.
async fn pod_that_speaks_first(close_after_banner: bool) {
    const BANNER: &[u8] = b"220 pod speaking first\r\n";
    let (dp, e) = load();
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (mut proxy, gate) =
        common::proxy_gated(dp, back.local_addr().unwrap(), HELLO, Limits::default()).await;
    let addr = proxy.addr;
    let client = tokio::spawn(async move {
        let mut c = TcpStream::connect(addr).await.unwrap();
        let hello: Vec<u8> = (0..HELLO).map(|i| i as u8).collect();
        c.write_all(&hello).await.unwrap();
        c
    });
    let (mut s, _) = back.accept().await.unwrap();
    s.write_all(BANNER).await.unwrap();
    if close_after_banner {
        s.shutdown().await.unwrap();
    }
    // The waypoint's socket B holds the banner (and the FIN) once the pod has nothing
    // unacknowledged.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while common::tcp_info(&s).tcpi_unacked != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "B never acknowledged the banner"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    gate.add_permits(1);
    let mut c = client.await.unwrap();
    let mut hello = vec![0u8; HELLO];
    s.read_exact(&mut hello).await.unwrap();
    assert!(
        hello.iter().enumerate().all(|(i, b)| *b == i as u8),
        "hello intact"
    );
    let mut banner = vec![0u8; BANNER.len()];
    c.read_exact(&mut banner).await.unwrap();
    assert_eq!(banner, BANNER);
    let mut msg = vec![0u8; 100_000];
    common::pattern_fill(7, 0, &mut msg);
    c.write_all(&msg).await.unwrap();
    let mut got = vec![0u8; msg.len()];
    s.read_exact(&mut got).await.unwrap();
    assert_eq!(got, msg, "client to pod");
    if close_after_banner {
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "the pod's FIN, and nothing after it");
    } else {
        s.write_all(&msg).await.unwrap();
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(got, msg, "pod to client");
    }
    let (counts, _) = e.rewrite_counts().unwrap();
    assert_eq!(counts.rewritten, 0, "{counts:?}");
    assert_eq!(counts.refused, [0, 0, 1, 0, 0, 0], "refused as busy");
    drop(c);
    drop(s);
    let o = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
    assert_eq!(o.downstream_to_upstream, HELLO as u64 + 100_000, "{o:?}");
    let back_bytes = if close_after_banner { 0 } else { 100_000 };
    assert_eq!(
        o.upstream_to_downstream,
        (BANNER.len() + back_bytes) as u64,
        "{o:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_speaking_first_is_refused_to_the_sockhash_path() {
    pod_that_speaks_first(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_closing_first_is_refused_to_the_sockhash_path() {
    pod_that_speaks_first(true).await;
}

/// Pods and clients behind veths that appear after the dataplane started (a CNI without
/// a bridge gives every new pod one): the program is attached to each new interface, the
/// pod's answers are rewritten to the client instead of landing in the waypoint's
/// socket, and an attachment is forgotten when its interface goes. Runs in a network
/// namespace of its own (its thread's, and the runtime's threads', built after the
/// unshare), so that the interfaces it adds and counts are its own.
#[test]
fn pods_on_interfaces_added_after_start_are_rewritten() {
    let (dp, e) = own_node();
    assert_eq!(
        e.rewrite_links().unwrap().attached,
        1,
        "only lo in a new namespace"
    );
    let pod = Peer::new("pod", 232);
    let remote = Peer::new("cli", 233);
    runtime().block_on(async {
        let links = || e.rewrite_links().unwrap();
        // From another host: in through one new veth, out through the other.
        let (mut proxy, stream) = across(&e, dp, &pod, &remote).await;
        assert_eq!(links().failed, 0);
        let port = proxy.addr.port();
        let total = echo_through(stream).await;
        let outcome = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
        assert_eq!(outcome.end, End::Closed);
        assert_eq!(outcome.upstream_to_downstream, total + 1);
        let (counts, _) = e.rewrite_counts().unwrap();
        assert_eq!(counts.rewritten, 1, "rewritten");
        assert_eq!(counts.stranded, 0);
        assert!(stat(&e, RewriteStat::Rewritten) > 200);
        assert_eq!(stat(&e, RewriteStat::Unroutable), 0);
        // From this host, to one of its addresses; and over loopback. The pod's
        // rewritten packets would come in on its veth with a source of this host's: the
        // stack drops such martians, so these are not rewritten (lo's MTU set to the veths'
        // so that the MSS check does not refuse them first).
        ip(&["link", "set", "lo", "mtu", "1500"]);
        let from_here = [
            (remote.node_ip(), port),
            ("127.0.0.1".parse().unwrap(), port),
        ];
        for (i, to) in from_here.into_iter().enumerate() {
            let total = echo_through(std::net::TcpStream::connect(to).unwrap()).await;
            let outcome = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
            assert_eq!(outcome.end, End::Closed);
            assert_eq!(outcome.upstream_to_downstream, total + 1);
            let (counts, _) = e.rewrite_counts().unwrap();
            let local = Refusal::ALL
                .iter()
                .position(|r| *r == Refusal::Local)
                .unwrap();
            assert_eq!(counts.refused[local], i as u64 + 1, "{counts:?}");
            assert_eq!(counts.rewritten, 1);
        }
        drop(pod);
        until("the gone veth forgotten", || links().attached == 2).await;
    });
}

/// On a kernel without TCX the rewrite program is a netlink filter on each interface's
/// clsact qdisc (forced here with a test hook; 6.1 and older attach this way). A stock
/// node has no such qdisc: the daemon adds one, splices through it, and on exit removes
/// the qdiscs it added, unless another program's filter uses one by then; a qdisc it
/// found it leaves. In a network namespace of its own, with `lo` its only interface.
#[test]
fn without_tcx_the_program_sits_on_clsact_qdiscs_the_daemon_adds() {
    common::require_root();
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
    ip(&["link", "set", "lo", "up"]);
    assert!(!clsact_on_lo(), "a new namespace has no clsact qdisc");
    // A runtime per connection: dropped, it drops the proxy's task, and with it the
    // task's handle on the dataplane.

    // Added, and rewritten through.
    let (dp, a) = load_netlink();
    assert_eq!(a.rewrite_links().unwrap().attached, 1);
    assert!(clsact_on_lo(), "the daemon added the qdisc");
    assert_eq!(ingress_filters_on_lo(), 1);
    runtime().block_on(rewritten_echo(dp, &a));

    // A second daemon finds the qdisc and puts its filter beside the first's; the first
    // leaves the qdisc it added, which the second still uses and splices through.
    let (dp, b) = load_netlink();
    assert_eq!(ingress_filters_on_lo(), 2);
    drop(a);
    assert!(clsact_on_lo(), "left: another daemon's filter uses it");
    assert_eq!(ingress_filters_on_lo(), 1, "the first daemon's filter went");
    runtime().block_on(rewritten_echo(dp, &b));
    // ... and the second leaves the qdisc it found.
    drop(b);
    assert!(clsact_on_lo(), "left: it was there before the daemon");
    assert_eq!(ingress_filters_on_lo(), 0);

    // Without anyone else's filter, the qdisc a daemon added goes with it.
    let st = std::process::Command::new("tc")
        .args(["qdisc", "del", "dev", "lo", "clsact"])
        .status()
        .unwrap();
    assert!(st.success());
    let (_dp, c) = load_netlink();
    assert!(clsact_on_lo());
    drop(_dp);
    drop(c);
    assert!(!clsact_on_lo(), "the daemon removed the qdisc it added");
}

/// A dataplane whose rewrite program is attached through netlink (see
/// [`without_tcx_the_program_sits_on_clsact_qdiscs_the_daemon_adds`]).
fn load_netlink() -> (Arc<Dataplane>, Arc<ebpf::Ebpf>) {
    load_netlink_pinned_in(waypoint::dataplane::pins::DEFAULT_DIR)
}

/// The same, pinned under `pin_dir`.
fn load_netlink_pinned_in(pin_dir: &str) -> (Arc<Dataplane>, Arc<ebpf::Ebpf>) {
    let e = Arc::new(
        ebpf::Ebpf::load(ebpf::Config {
            move_after: 0,
            rewrite_splice: true,
            hooks: ebpf::Hooks {
                tc_netlink: true,
                ..ebpf::Hooks::default()
            },
            pin_dir: pin_dir.into(),
            ..ebpf::Config::default()
        })
        .expect("the rewrite program attaches through netlink"),
    );
    (Arc::new(Dataplane::Ebpf(e.clone())), e)
}

fn clsact_on_lo() -> bool {
    let out = std::process::Command::new("tc")
        .args(["qdisc", "show", "dev", "lo"])
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout).contains("clsact")
}

fn ingress_filters_on_lo() -> usize {
    let out = std::process::Command::new("tc")
        .args(["filter", "show", "dev", "lo", "ingress"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        // A filter's line with its handle (tc shows its chain on a line before).
        .filter(|l| l.contains(" bpf ") && l.contains(" handle "))
        .count()
}

/// Set in the child process of
/// [`without_tcx_the_next_daemon_removes_the_filter_a_killed_one_left`]: `pinned`, or
/// `unpinned` (its bpffs directory cannot be made).
const KILLED_CHILD: &str = "WAYPOINT_TEST_KILLED_DAEMON";

/// A netlink filter outlives the daemon that added it when that daemon is killed with
/// SIGKILL (no destructor runs), and so do its entries. When its map could not be
/// pinned, nobody can adopt its connections: the next daemon removes it at its start,
/// whichever dataplane it runs, and a rewriting one then rewrites through its own. When
/// it is pinned, it is left to the adopter (which takes it, finds no connection, and
/// removes it), however many daemons start meanwhile. A live daemon's filter it leaves
/// (the test above: two daemons side by side). The killed daemon is this test binary
/// run again, as a child, in this test's network namespace.
#[test]
fn without_tcx_the_next_daemon_removes_the_filter_a_killed_one_left() {
    common::require_root();
    if let Some(how) = std::env::var_os(KILLED_CHILD) {
        let pin_dir = if how == "pinned" {
            waypoint::dataplane::pins::DEFAULT_DIR
        } else {
            "/dev/null/no-pins"
        };
        let _kept = load_netlink_pinned_in(pin_dir);
        println!("ready");
        // Killed long before this.
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
    ip(&["link", "set", "lo", "up"]);
    let killed = |how: &str| {
        let test = "without_tcx_the_next_daemon_removes_the_filter_a_killed_one_left";
        run_then_kill(test, (KILLED_CHILD, how), || {
            assert_eq!(ingress_filters_on_lo(), 1)
        });
        assert_eq!(ingress_filters_on_lo(), 1, "the filter outlives its daemon");
    };
    let copy_starts = || {
        let (copy, _) = waypoint::dataplane::choice::choose(
            waypoint::dataplane::Kind::Copy,
            ebpf::Config::default(),
            64 * 1024,
        )
        .unwrap();
        drop(copy);
    };
    // A daemon without the rewrite removes it too: its dials are as exposed.
    killed("unpinned");
    copy_starts();
    assert_eq!(
        ingress_filters_on_lo(),
        0,
        "removed by a copy dataplane's start"
    );
    killed("unpinned");
    let (dp, e) = load_netlink();
    assert_eq!(
        ingress_filters_on_lo(),
        1,
        "the killed daemon's filter went, and the next one's is on"
    );
    runtime().block_on(rewritten_echo(dp, &e));
    drop(e);
    assert_eq!(ingress_filters_on_lo(), 0);

    // Pinned: daemons that start leave it, whichever dataplane they run.
    killed("pinned");
    copy_starts();
    let (_dp, e) = load_netlink_pinned_in("/dev/null/no-pins");
    assert_eq!(
        ingress_filters_on_lo(),
        2,
        "a pinned program's filter is left to its adopter"
    );
    drop((_dp, e));
    assert_eq!(ingress_filters_on_lo(), 1);
    // The adopter of its directory takes it, finds no connection, and removes it.
    let adopter = waypoint::dataplane::adopt::Adopter::start(waypoint::dataplane::adopt::Config {
        idle_timeout: Duration::from_secs(60),
        max_lifetime: None,
        pin_dir: waypoint::dataplane::pins::DEFAULT_DIR.into(),
    })
    .unwrap();
    assert_eq!(adopter.counts().refused, 0);
    assert_eq!(ingress_filters_on_lo(), 0, "the adopter removed it");
    let dir =
        waypoint::dataplane::pins::namespace_dir(waypoint::dataplane::pins::DEFAULT_DIR.as_ref())
            .unwrap();
    assert_eq!(
        std::fs::read_dir(dir).map_or(0, |d| d.count()),
        0,
        "and its pins"
    );
}

/// Set in the child process of [`another_layouts_pins_are_refused_and_removed`].
const LAYOUT_CHILD: &str = "WAYPOINT_TEST_LAYOUT_DAEMON";

/// A killed daemon's pins in a layout this daemon does not read, by name (a later
/// version's `rewrites-v2`) or by its entries' sizes (another map pinned as
/// `rewrites-v1`): the adopter refuses the program, counts it, and removes it with its
/// directory, rather than read entries it would misunderstand. The killed daemon is
/// this test binary run again, as a child, in this test's network namespace; its
/// program is attached however the kernel attaches it (TCX, or a netlink filter).
#[test]
fn another_layouts_pins_are_refused_and_removed() {
    common::require_root();
    use waypoint::dataplane::{adopt, pins};
    if std::env::var_os(LAYOUT_CHILD).is_some() {
        let _kept = ebpf::Ebpf::load(ebpf::Config {
            move_after: 0,
            rewrite_splice: true,
            ..ebpf::Config::default()
        })
        .expect("the rewrite program loads");
        println!("ready");
        // Killed long before this.
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
    ip(&["link", "set", "lo", "up"]);
    let root: &std::path::Path = pins::DEFAULT_DIR.as_ref();
    let killed = || -> (u32, std::path::PathBuf) {
        let test = "another_layouts_pins_are_refused_and_removed";
        run_then_kill(test, (LAYOUT_CHILD, "1"), || {});
        let dirs: Vec<_> = std::fs::read_dir(pins::namespace_dir(root).unwrap())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(dirs.len(), 1, "the killed daemon's pins: {dirs:?}");
        let dir = dirs.into_iter().next().unwrap();
        (pins::program_id(&dir).unwrap(), dir)
    };
    let refused_and_removed = |id: u32, dir: &std::path::Path| {
        let adopter = adopt::Adopter::start(adopt::Config {
            idle_timeout: Duration::from_secs(60),
            max_lifetime: None,
            pin_dir: root.into(),
        })
        .unwrap();
        let counts = adopter.counts();
        assert_eq!((counts.refused, counts.programs), (1, 0));
        assert!(!dir.exists(), "its directory went");
        // Nothing holds the program any more: the kernel frees it.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while aya::programs::loaded_programs().any(|p| p.is_ok_and(|p| p.id() == id)) {
            assert!(
                std::time::Instant::now() < deadline,
                "program {id} still loaded"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };

    // A later version's name.
    let (id, dir) = killed();
    std::fs::rename(dir.join(pins::REWRITES_PIN), dir.join("rewrites-v2")).unwrap();
    refused_and_removed(id, &dir);

    // The name this daemon reads, over entries of other sizes: another of the
    // program's maps (REWRITE_FILLS: the same key, a u32 value).
    let (id, dir) = killed();
    std::fs::remove_file(dir.join(pins::REWRITES_PIN)).unwrap();
    let program = aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .find(|p| p.id() == id)
        .unwrap();
    let fills = program
        .map_ids()
        .unwrap()
        .unwrap()
        .into_iter()
        .find(|m| {
            aya::maps::MapInfo::from_id(*m).unwrap().name_as_str()
                == Some(waypoint_common::REWRITE_FILLS_MAP)
        })
        .unwrap();
    aya::maps::MapData::from_id(fills)
        .unwrap()
        .pin(dir.join(pins::REWRITES_PIN))
        .unwrap();
    refused_and_removed(id, &dir);
}

/// Runs `test` of this binary again, as a child with the environment variable `env`,
/// waits for it to print `ready` (its program loaded), runs `then`, and kills it with
/// SIGKILL: a daemon that ends with no destructor run.
fn run_then_kill(test: &str, env: (&str, &str), then: impl FnOnce()) {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture"])
        .env(env.0, env.1)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let ready = std::io::BufRead::lines(std::io::BufReader::new(stdout))
        .map_while(Result::ok)
        .any(|l| l == "ready");
    assert!(ready, "the child loaded its program");
    then();
    child.kill().unwrap();
    child.wait().unwrap();
}

/// One connection over `lo`, rewritten: 200 echoes and a close.
async fn rewritten_echo(dp: Arc<Dataplane>, e: &ebpf::Ebpf) {
    let rewritten = e.rewrite_counts().unwrap().0.rewritten;
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut proxy = proxy_marked(true, dp, back.local_addr().unwrap()).await;
    let addr = proxy.addr;
    let cl = async {
        let mut c = client(addr).await;
        echo_rounds(&mut c, 200, &[1, 1_400, 65_000]).await
    };
    let ((), total) = tokio::join!(echo_pod(&back), cl);
    let outcome = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(outcome.upstream_to_downstream, total + 1);
    assert_eq!(
        e.rewrite_counts().unwrap().0.rewritten,
        rewritten + 1,
        "rewritten"
    );
}

/// A lossy path both ways (3 % of the packets reaching the client and the pod dropped,
/// by nft): 32 MiB echoed intact, and the ends recovered on rewritten numbers: each
/// sender recovered with SACK blocks and discarded none as outside its window (untranslated
/// SACK edges would be), and neither end dropped more than the path's odd segment for an
/// old timestamp.
#[test]
fn a_lossy_path_recovers_with_rewritten_sack_blocks() {
    const TOTAL: u64 = 32 * 1024 * 1024;
    let (dp, e) = own_node();
    let pod = Peer::new("pod", 234);
    let remote = Peer::new("cli", 235);
    pod.lossy(3);
    remote.lossy(3);
    runtime().block_on(async {
        let (mut proxy, stream) = across(&e, dp, &pod, &remote).await;
        stream.set_nonblocking(true).unwrap();
        let mut c = TcpStream::from_std(stream).unwrap();
        let (sent, got) = tokio::time::timeout(Duration::from_secs(120), async move {
            hello_answered(&mut c).await;
            let (r, w) = c.into_split();
            tokio::join!(common::send_random(w, TOTAL, 7), common::recv_all(r))
        })
        .await
        .expect("32 MiB echoed over the lossy path within 120 s");
        assert_eq!(got, (TOTAL, sent), "echoed intact");
        let outcome = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
        assert_eq!(outcome.end, End::Closed);
        let (counts, _) = e.rewrite_counts().unwrap();
        assert_eq!(counts.rewritten, 1, "rewritten: {counts:?}");
        assert_eq!(counts.stranded, 0);
        assert_eq!(stat(&e, RewriteStat::BadOptions), 0);
        for (end, peer) in [("client", &remote), ("pod", &pod)] {
            let n = peer.netstat();
            eprintln!(
                "{end}: SACK recoveries {}, SACK blocks discarded {}, PAWS drops {}, \
                 fast retransmits {}, D-SACKs received {}, timeouts {}, loss probes {}",
                n("TCPSackRecovery"),
                n("TCPSACKDiscard"),
                n("PAWSEstab"),
                n("TCPFastRetrans"),
                n("TCPDSACKRecv"),
                n("TCPTimeouts"),
                n("TCPLossProbes"),
            );
            assert!(n("TCPSackRecovery") > 0, "{end} recovered with SACK blocks");
            assert_eq!(n("TCPSACKDiscard"), 0, "{end} discarded SACK blocks");
            // Timestamps translated with two clock offsets would have the receiver drop
            // the segments of the smaller one again and again. One or two drops are the
            // path's: a segment held in one CPU's backlog while a later one, sent 2 ms
            // or more afterwards by a sender that moved to the other CPU, goes first
            // (seen in a 2-vCPU TCG guest: 1 of some 25,000 segments). The race of two
            // first packets over the offset has its own test
            // (`concurrent_first_timestamps_learn_one_clock_offset`).
            assert!(
                n("PAWSEstab") <= 2,
                "{end} dropped {} segments for their timestamps",
                n("PAWSEstab")
            );
        }
    });
}

/// A pod whose path has another MTU than the client's (an MSS the client was not told)
/// is not rewritten: the SockHash serves it, intact.
#[test]
fn a_different_mss_is_refused_to_the_sockhash_path() {
    let (dp, e) = own_node();
    let pod = Peer::new("pod", 236);
    let remote = Peer::new("cli", 237);
    ip(&["link", "set", "pod", "mtu", "9000"]);
    ip(&["-n", &pod.ns, "link", "set", "eth0", "mtu", "9000"]);
    runtime().block_on(async {
        let (mut proxy, stream) = across(&e, dp, &pod, &remote).await;
        let total = echo_through(stream).await;
        let outcome = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
        assert_eq!(outcome.end, End::Closed);
        assert_eq!(outcome.upstream_to_downstream, total + 1);
        let (counts, _) = e.rewrite_counts().unwrap();
        assert_eq!(counts.refused[Refusal::Options as usize], 1, "{counts:?}");
        assert_eq!(counts.rewritten, 0);
    });
}

/// An IPv6 connection is not rewritten (the program rewrites IPv4): the SockHash serves
/// it, intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_is_refused_to_the_sockhash_path() {
    let (dp, e) = load();
    let back = TcpListener::bind("[::1]:0").await.unwrap();
    let bind = "[::1]:0".parse().unwrap();
    let upstream = back.local_addr().unwrap();
    let mut proxy = common::proxy_at(bind, dp.clone(), upstream, HELLO, Limits::default()).await;
    let pod = echo_pod(&back);
    let stream = std::net::TcpStream::connect(proxy.addr).unwrap();
    let ((), total) = tokio::join!(pod, echo_through(stream));
    let outcome = common::next_outcome(&mut proxy, Duration::from_secs(30)).await;
    assert_eq!(outcome.end, End::Closed);
    assert_eq!(outcome.upstream_to_downstream, total + 1);
    let (counts, _) = e.rewrite_counts().unwrap();
    assert_eq!(counts.refused[Refusal::NotIpv4 as usize], 1, "{counts:?}");
    assert_eq!(counts.rewritten, 0);
    // Its path, and why not the rewrite: the SockHash, for want of IPv4.
    let took: Vec<_> = dp.paths().into_iter().filter(|(_, n)| *n > 0).collect();
    assert_eq!(took, [(Taken::Redirected(Some(Refusal::NotIpv4)), 1)]);
}

/// Once the program is on both peers' veths: the pod serving, a proxy to it on every
/// address of this node, and a connection to it from the remote peer.
async fn across(
    e: &ebpf::Ebpf,
    dp: Arc<Dataplane>,
    pod: &Peer,
    remote: &Peer,
) -> (common::Proxy, std::net::TcpStream) {
    until("the program on both veths", || {
        e.rewrite_links().unwrap().attached == 3
    })
    .await;
    let upstream = pod.serve();
    let bind = "0.0.0.0:0".parse().unwrap();
    let proxy = common::proxy_at(bind, dp, upstream, HELLO, Limits::default()).await;
    let stream = remote.connect((remote.node_ip(), proxy.addr.port()).into());
    (proxy, stream)
}

/// This thread as a node in a network namespace of its own: lo up, forwarding on (a node
/// forwards; without it, the route lookup the program makes for a packet that came in on
/// a veth stops at "forwarding disabled"), and the dataplane loaded there. Build the
/// runtime afterwards ([`runtime`]), so that its threads and sockets live there too.
fn own_node() -> (Arc<Dataplane>, Arc<ebpf::Ebpf>) {
    common::require_root();
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
    ip(&["link", "set", "lo", "up"]);
    let st = std::process::Command::new("sysctl")
        .args(["-qw", "net.ipv4.ip_forward=1"])
        .status()
        .unwrap();
    assert!(st.success());
    load()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Sends the hello through `stream`, checks the answer, then 200 echoes of every size
/// and a close; returns the echoed bytes. Fails after 30 s.
async fn echo_through(stream: std::net::TcpStream) -> u64 {
    stream.set_nonblocking(true).unwrap();
    let mut c = TcpStream::from_std(stream).unwrap();
    tokio::time::timeout(Duration::from_secs(30), async move {
        hello_answered(&mut c).await;
        echo_rounds(&mut c, 200, &[1, 1_400, 9_000, 65_000]).await
    })
    .await
    .expect("the hello answered and every echo back within 30 s")
}

/// Waits up to 10 s for `cond`.
async fn until(what: &str, cond: impl Fn() -> bool) {
    let start = std::time::Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn ip(args: &[&str]) {
    let st = std::process::Command::new("ip")
        .args(args)
        .status()
        .unwrap();
    assert!(st.success(), "ip {args:?}: {st}");
}

/// Another host (a pod, or a client elsewhere) in a namespace of its own, behind a veth
/// of this thread's namespace, routed without a bridge: 10.`net`.0.2, this side
/// 10.`net`.0.1. Removed on drop (its veth goes with it).
struct Peer {
    ns: String,
    name: String,
    net: u8,
}

impl Peer {
    fn new(name: &str, net: u8) -> Peer {
        // Tests of one binary run at once, in one process: the net number tells them apart.
        let ns = format!("wplate-{name}{net}-{}", std::process::id());
        ip(&["netns", "add", &ns]);
        let peer = Peer {
            ns: ns.clone(),
            name: name.to_owned(),
            net,
        };
        ip(&[
            "link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        ip(&["addr", "add", &format!("10.{net}.0.1/30"), "dev", name]);
        ip(&["link", "set", name, "up"]);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("10.{net}.0.2/30"),
            "dev",
            "eth0",
        ]);
        ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        ip(&[
            "-n",
            &ns,
            "route",
            "add",
            "default",
            "via",
            &format!("10.{net}.0.1"),
        ]);
        peer
    }

    /// This side's address.
    fn node_ip(&self) -> std::net::Ipv4Addr {
        std::net::Ipv4Addr::new(10, self.net, 0, 1)
    }

    /// Runs `f` on a thread inside the namespace: sockets it creates stay there.
    fn within<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        common::in_netns(&self.ns, f)
    }

    /// Drops `percent` % of the TCP packets that arrive in the namespace, but for SYN,
    /// FIN and RST (nft; netem is not on every kernel). On arrival: a packet dropped on
    /// its way out is not lost, its sender is told and sends it again.
    fn lossy(&self, percent: u32) {
        let rules = format!(
            "table ip loss {{\n chain lose {{\n type filter hook input priority 0;\n \
             tcp flags & (syn | fin | rst) == 0 numgen random mod 100 < {percent} drop\n }}\n}}\n"
        );
        let mut nft = std::process::Command::new("ip")
            .args(["netns", "exec", &self.ns, "nft", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write as _;
        nft.stdin
            .take()
            .unwrap()
            .write_all(rules.as_bytes())
            .unwrap();
        assert!(nft.wait().unwrap().success(), "nft: {rules}");
    }

    /// The namespace's TCP counters (`TcpExt` of /proc/net/netstat), by name; 0 for a
    /// name not there.
    fn netstat(&self) -> impl Fn(&str) -> u64 {
        let text =
            self.within(|| std::fs::read_to_string("/proc/thread-self/net/netstat").unwrap());
        let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("TcpExt:")).collect();
        let names = lines[0].split_whitespace().skip(1);
        let values = lines[1]
            .split_whitespace()
            .skip(1)
            .map(|v| v.parse::<u64>().unwrap());
        let map: std::collections::HashMap<String, u64> =
            names.map(str::to_owned).zip(values).collect();
        move |name| map.get(name).copied().unwrap_or(0)
    }

    /// A connection to `to` from inside the namespace.
    fn connect(&self, to: std::net::SocketAddr) -> std::net::TcpStream {
        self.within(move || std::net::TcpStream::connect(to).unwrap())
    }

    /// Starts an echo server inside (a thread per connection): checks the hello,
    /// answers, then echoes until the client closes. Returns its address.
    fn serve(&self) -> std::net::SocketAddr {
        use std::io::{Read as _, Write as _};
        let ip = std::net::Ipv4Addr::new(10, self.net, 0, 2);
        let listener = self.within(move || std::net::TcpListener::bind((ip, 0)).unwrap());
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(mut s) = s else { return };
                std::thread::spawn(move || {
                    let mut hello = vec![0u8; HELLO];
                    s.read_exact(&mut hello).unwrap();
                    assert!(hello.iter().enumerate().all(|(i, b)| *b == i as u8));
                    s.write_all(&[ANSWER]).unwrap();
                    let mut buf = vec![0u8; 70_000];
                    loop {
                        match s.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => s.write_all(&buf[..n]).unwrap(),
                        }
                    }
                });
            }
        });
        addr
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // The pair first: a socket still open inside keeps the namespace alive.
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.name])
            .status();
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.ns])
            .status();
    }
}

/// `auto` with the rewrite splice asked for, on the running kernel: where the kernel
/// has the 2023 sockmap fixes (6.1.32, 6.4; all of them load the rewrite program, whose
/// atomics need 5.12) it takes the rewrite splice; below, it runs splice and says why.
/// The rung between, the SockHash redirect when only the rewrite program is refused,
/// is `choice`'s unit test. The kernel matrix (`cargo xtask kernels`) runs this on 5.10,
/// 6.1 and 6.12.
#[test]
fn auto_takes_the_rewrite_splice_where_the_kernel_loads_it() {
    use waypoint::dataplane::{choice, Kind};
    common::require_root();
    let config = ebpf::Config {
        rewrite_splice: true,
        ..ebpf::Config::default()
    };
    let (dp, chosen) = choice::choose(Kind::Auto, config, 1 << 16).unwrap();
    let kernel = aya::util::KernelVersion::current().unwrap();
    if choice::sockmap_fixed(kernel) {
        let Dataplane::Ebpf(e) = &dp else {
            panic!("{chosen}");
        };
        assert!(e.config().rewrite_splice, "{chosen}");
        assert_eq!(chosen.to_string(), "dataplane ebpf-rewrite (probed)");
    } else {
        assert!(matches!(dp, Dataplane::Splice(_)), "{chosen}");
        assert_eq!(
            chosen.to_string(),
            format!(
                "dataplane splice (sockmap_unfixed): kernel {kernel} lacks the 2023 sockmap \
                 fixes (6.4, 6.1.32) that the SockHash redirect needs"
            )
        );
    }
}
