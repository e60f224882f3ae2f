//! Close semantics through every dataplane: half-closes in both orders, a full close,
//! resets from either side, a bare FIN right after the initial bytes, and the idle and
//! lifetime limits. Each scenario runs once per dataplane (`<scenario>::{ebpf,splice,copy}`)
//! and once through what `--dataplane auto` runs on this kernel (`<scenario>::auto`: the
//! rewrite splice where the kernel carries it, else splice).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

mod common;

use std::time::{Duration, Instant};

use tokio::{
    io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    sync::oneshot,
    time::timeout,
};
use waypoint::dataplane::{End, Kind, Limits, Outcome};

/// Length of the initial bytes (a ClientHello stand-in) the proxy reads before forwarding.
const HELLO: usize = 517;
/// Seeds of the pattern streams: the initial bytes, then each direction's payload.
const SEED_HELLO: u64 = 0;
const SEED_UP: u64 = 1;
const SEED_DOWN: u64 = 2;
/// Bound on waiting for something that should happen promptly: a broken dataplane makes
/// the test fail with a message instead of hanging.
const BOUND: Duration = Duration::from_secs(10);
/// Bound on a whole scenario: a step without its own bound that waits for ever (a write
/// no one reads) fails the test instead of stalling the suite.
const SCENARIO_BOUND: Duration = Duration::from_secs(120);
/// How much must have flowed before a reset, so the reset hits a busy connection.
const FLOWING: u64 = 1024 * 1024;

macro_rules! for_each_dataplane {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            use waypoint::dataplane::Kind;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ebpf() {
                super::bounded(super::$scenario(Kind::Ebpf)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn splice() {
                super::bounded(super::$scenario(Kind::Splice)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn copy() {
                super::bounded(super::$scenario(Kind::Copy)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn auto() {
                super::bounded(super::$scenario(Kind::Auto)).await;
            }
        }
    )*};
}

for_each_dataplane!(
    half_close_client_first,
    half_close_server_first,
    server_full_close_after_response,
    client_reset_while_flowing,
    server_reset_while_flowing,
    bare_fin_after_initial_bytes,
    bare_fin_without_initial_bytes,
    data_and_fin_queued_before_forwarding,
    upstream_fin_queued_before_forwarding,
    idle_timeout_closes_silent_connection,
    idle_timeout_resets_both_when_bytes_are_held,
    trickle_keeps_connection_open,
    lifetime_closes_silent_connection,
    lifetime_closes_busy_connection,
);

/// Runs a scenario within [`SCENARIO_BOUND`].
async fn bounded(scenario: impl std::future::Future<Output = ()>) {
    timeout(SCENARIO_BOUND, scenario)
        .await
        .unwrap_or_else(|_| panic!("the scenario did not finish within {SCENARIO_BOUND:?}"));
}

/// A server listener and a proxy in front of it.
async fn setup(kind: Kind, initial_len: usize, limits: Limits) -> (TcpListener, common::Proxy) {
    let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = common::proxy(
        common::dataplane(kind),
        server.local_addr().unwrap(),
        initial_len,
        limits,
    )
    .await;
    (server, proxy)
}

fn hello() -> Vec<u8> {
    let mut h = vec![0u8; HELLO];
    common::pattern_fill(SEED_HELLO, 0, &mut h);
    h
}

/// Connects through the proxy and sends the initial bytes.
async fn connect_with_hello(proxy: &common::Proxy) -> TcpStream {
    let mut c = TcpStream::connect(proxy.addr).await.unwrap();
    c.write_all(&hello()).await.unwrap();
    c
}

/// Accepts the proxied connection and checks that the initial bytes arrive first, intact.
async fn accept_hello(server: &TcpListener) -> TcpStream {
    let (mut s, _) = timeout(BOUND, server.accept())
        .await
        .expect("the proxy dials the server")
        .unwrap();
    let mut h = vec![0u8; HELLO];
    timeout(BOUND, s.read_exact(&mut h))
        .await
        .expect("initial bytes arrive")
        .unwrap();
    assert_eq!(h, hello(), "initial bytes arrive first and intact");
    s
}

/// Writes `len` bytes of stream `seed`.
async fn send_pattern(w: &mut (impl AsyncWrite + Unpin), seed: u64, len: u64) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut off = 0u64;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        common::pattern_fill(seed, off, &mut buf[..n]);
        timeout(BOUND, w.write_all(&buf[..n]))
            .await
            .unwrap_or_else(|_| panic!("no room to write for {BOUND:?} after {off} bytes"))
            .unwrap();
        off += n as u64;
    }
}

/// Reads to EOF, checking every byte against stream `seed`; returns how many arrived.
async fn recv_to_eof(r: &mut (impl AsyncRead + Unpin), seed: u64, what: &str) -> u64 {
    let read = async {
        let mut buf = vec![0u8; 64 * 1024];
        let mut total = 0u64;
        loop {
            let n = r
                .read(&mut buf)
                .await
                .unwrap_or_else(|e| panic!("{what}: read failed after {total} bytes: {e}"));
            if n == 0 {
                return total;
            }
            if let Some(at) = common::pattern_mismatch(seed, total, &buf[..n]) {
                panic!("{what}: wrong byte at offset {at}");
            }
            total += n as u64;
        }
    };
    timeout(BOUND, read)
        .await
        .unwrap_or_else(|_| panic!("{what}: no EOF within {BOUND:?}"))
}

/// Reads to EOF (None) or to an error (its kind), checking every byte against stream
/// `seed`; returns the count too.
async fn recv_to_end(
    r: &mut (impl AsyncRead + Unpin),
    seed: u64,
    what: &str,
) -> (u64, Option<std::io::ErrorKind>) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    loop {
        let n = match timeout(BOUND, r.read(&mut buf)).await {
            Err(_) => panic!("{what}: neither data nor an end for {BOUND:?} after {total} bytes"),
            Ok(Ok(0)) => return (total, None),
            Ok(Ok(n)) => n,
            Ok(Err(e)) => return (total, Some(e.kind())),
        };
        if let Some(at) = common::pattern_mismatch(seed, total, &buf[..n]) {
            panic!("{what}: wrong byte at offset {at}");
        }
        total += n as u64;
    }
}

/// Reads until the stream fails, checking the bytes against stream `seed`; sends on
/// `flowing` once `FLOWING` bytes arrived. A clean EOF is a failure: the peer reset.
async fn recv_until_error(
    r: &mut TcpStream,
    seed: u64,
    flowing: oneshot::Sender<()>,
    what: &str,
) -> (u64, std::io::Error) {
    let mut flowing = Some(flowing);
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    loop {
        let n = match timeout(BOUND, r.read(&mut buf)).await {
            Err(_) => panic!("{what}: neither data nor an error for {BOUND:?} after {total} bytes"),
            Ok(Ok(0)) => panic!("{what}: clean EOF after {total} bytes, but the peer reset"),
            Ok(Ok(n)) => n,
            Ok(Err(e)) => return (total, e),
        };
        if let Some(at) = common::pattern_mismatch(seed, total, &buf[..n]) {
            panic!("{what}: wrong byte at offset {at}");
        }
        total += n as u64;
        if total >= FLOWING {
            if let Some(tx) = flowing.take() {
                let _ = tx.send(());
            }
        }
    }
}

/// Writes stream `seed` as fast as the connection takes it until `stop` fires, then
/// resets the connection (SO_LINGER 0 + close). Returns the bytes written and when the
/// reset was sent.
async fn write_then_reset(
    mut s: TcpStream,
    seed: u64,
    mut stop: oneshot::Receiver<()>,
) -> (u64, Instant) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut off = 0u64;
    loop {
        common::pattern_fill(seed, off, &mut buf);
        tokio::select! {
            _ = &mut stop => break,
            r = s.write(&buf) => off += r.unwrap() as u64,
        }
    }
    socket2::SockRef::from(&s)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(s);
    (off, Instant::now())
}

/// A byte sent once the connection is up, ahead of the payload.
const READY: &[u8] = b"R";

/// Waits for the [`READY`] byte. Any byte after the initial ones is only delivered once
/// the dataplane has taken over both sockets (the eBPF dataplane writes queued bytes after
/// registering them), so a half-close after this happens mid-connection, not before the
/// dataplane started (that case has its own tests below).
async fn wait_ready(s: &mut TcpStream) {
    let mut b = [0u8; 1];
    timeout(BOUND, s.read_exact(&mut b))
        .await
        .expect("ready byte arrives")
        .unwrap();
    assert_eq!(b, READY, "ready byte");
}

/// How the waypoint ends a connection at its idle timeout or lifetime, seen by `what`:
/// with a FIN where the waypoint's sockets carry the bytes; with a reset where the
/// connection is rewritten (client and pod hold one TCP conversation, whose sequence
/// numbers only the two ends know, so a FIN from the waypoint cannot be placed in it).
async fn expect_ended(s: &mut TcpStream, kind: Kind, what: &str) {
    if kind == Kind::Auto && common::rewrites(&common::auto()) {
        let mut b = [0u8; 1];
        let r = timeout(BOUND, s.read(&mut b))
            .await
            .unwrap_or_else(|_| panic!("{what}: no reset within {BOUND:?}"));
        assert!(
            matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
            "{what}: a rewritten connection is ended with a reset, got {r:?}"
        );
    } else {
        expect_eof(s, what).await;
    }
}

/// Reads exactly until EOF and expects nothing: the peer closed without sending.
async fn expect_eof(s: &mut TcpStream, what: &str) {
    let mut b = [0u8; 1];
    let n = timeout(BOUND, s.read(&mut b))
        .await
        .unwrap_or_else(|_| panic!("{what}: no EOF within {BOUND:?}"))
        .unwrap_or_else(|e| panic!("{what}: expected a clean EOF, got {e}"));
    assert_eq!(n, 0, "{what}: expected EOF, got data");
}

/// (a) The client shuts its write side first; the server, having seen that EOF, sends a
/// lot afterwards and the client, half-closed, receives all of it.
async fn half_close_client_first(kind: Kind) {
    const UP: u64 = 4 * 1024 * 1024;
    // Above the eBPF in-flight limit (4 MiB), so the credit path is exercised after the
    // half-close.
    const DOWN: u64 = 12 * 1024 * 1024;
    let (server, mut proxy) = setup(kind, HELLO, Limits::default()).await;
    let mut c = connect_with_hello(&proxy).await;
    let client = tokio::spawn(async move {
        wait_ready(&mut c).await;
        send_pattern(&mut c, SEED_UP, UP).await;
        c.shutdown().await.unwrap();
        recv_to_eof(&mut c, SEED_DOWN, "client after its own FIN").await
    });

    let mut s = accept_hello(&server).await;
    s.write_all(READY).await.unwrap();
    let got = recv_to_eof(&mut s, SEED_UP, "server").await;
    assert_eq!(
        got, UP,
        "{kind:?}: server gets every byte before the client's FIN"
    );
    // The client is half-closed now: everything from here on flows one way only.
    send_pattern(&mut s, SEED_DOWN, DOWN).await;
    s.shutdown().await.unwrap();
    let client_got = timeout(BOUND, client)
        .await
        .expect("client finishes")
        .unwrap();
    assert_eq!(
        client_got, DOWN,
        "{kind:?}: half-closed client gets every byte"
    );

    let out = common::next_outcome(&mut proxy, BOUND).await;
    assert_eq!(
        out,
        Outcome {
            downstream_to_upstream: HELLO as u64 + UP,
            upstream_to_downstream: READY.len() as u64 + DOWN,
            end: End::Closed,
        },
        "{kind:?}"
    );
}

/// (b) The server shuts its write side first; the client, having seen that EOF, sends a
/// lot afterwards and the half-closed server receives all of it.
async fn half_close_server_first(kind: Kind) {
    const DOWN: u64 = 4 * 1024 * 1024;
    const UP: u64 = 12 * 1024 * 1024;
    let (server, mut proxy) = setup(kind, HELLO, Limits::default()).await;
    let mut c = connect_with_hello(&proxy).await;
    c.write_all(READY).await.unwrap();
    let client = tokio::spawn(async move {
        let got = recv_to_eof(&mut c, SEED_DOWN, "client").await;
        // The server is half-closed now: everything from here on flows one way only.
        send_pattern(&mut c, SEED_UP, UP).await;
        c.shutdown().await.unwrap();
        got
    });

    let mut s = accept_hello(&server).await;
    wait_ready(&mut s).await;
    send_pattern(&mut s, SEED_DOWN, DOWN).await;
    s.shutdown().await.unwrap();
    let got = recv_to_eof(&mut s, SEED_UP, "server after its own FIN").await;
    assert_eq!(got, UP, "{kind:?}: half-closed server gets every byte");
    let client_got = timeout(BOUND, client)
        .await
        .expect("client finishes")
        .unwrap();
    assert_eq!(
        client_got, DOWN,
        "{kind:?}: client gets every byte before the server's FIN"
    );

    let out = common::next_outcome(&mut proxy, BOUND).await;
    assert_eq!(
        out,
        Outcome {
            downstream_to_upstream: HELLO as u64 + READY.len() as u64 + UP,
            upstream_to_downstream: DOWN,
            end: End::Closed,
        },
        "{kind:?}"
    );
}

/// (c) Request/response where the server closes its socket (not just its write side)
/// right after writing the response: the client still gets the whole response, then EOF.
async fn server_full_close_after_response(kind: Kind) {
    const REQUEST: u64 = 1000;
    const RESPONSE: u64 = 6 * 1024 * 1024;
    let (server, mut proxy) = setup(kind, HELLO, Limits::default()).await;
    let mut c = connect_with_hello(&proxy).await;
    send_pattern(&mut c, SEED_UP, REQUEST).await;

    let mut s = accept_hello(&server).await;
    let mut req = vec![0u8; REQUEST as usize];
    timeout(BOUND, s.read_exact(&mut req))
        .await
        .expect("request arrives")
        .unwrap();
    assert_eq!(
        common::pattern_mismatch(SEED_UP, 0, &req),
        None,
        "{kind:?}: request intact"
    );
    // The client reads while the server writes: where client and pod share one TCP
    // conversation (the rewrite splice), nothing but the two ends' buffers holds the
    // response, and they need not hold 6 MiB.
    let server = tokio::spawn(async move {
        send_pattern(&mut s, SEED_DOWN, RESPONSE).await;
        // Everything the client sent was read, so this close sends FIN, not RST.
        drop(s);
    });

    let got = recv_to_eof(&mut c, SEED_DOWN, "client").await;
    server.await.unwrap();
    assert_eq!(
        got, RESPONSE,
        "{kind:?}: client gets the whole response before EOF"
    );
    drop(c);

    let out = common::next_outcome(&mut proxy, BOUND).await;
    assert_eq!(
        out,
        Outcome {
            downstream_to_upstream: HELLO as u64 + REQUEST,
            upstream_to_downstream: RESPONSE,
            end: End::Closed,
        },
        "{kind:?}"
    );
}

/// (d) The client resets while sending as fast as it can: the server must see a reset
/// (ECONNRESET), not a clean EOF that would pass a truncated stream off as complete.
///
/// The server only reads: a write failing first would consume the socket's pending
/// error and turn the read's result into a plain EOF.
async fn client_reset_while_flowing(kind: Kind) {
    let (server, mut proxy) = setup(kind, HELLO, Limits::default()).await;
    let c = connect_with_hello(&proxy).await;
    let (flowing_tx, flowing_rx) = oneshot::channel();
    let client = tokio::spawn(write_then_reset(c, SEED_UP, flowing_rx));

    let mut s = accept_hello(&server).await;
    let (got, err) = recv_until_error(&mut s, SEED_UP, flowing_tx, "server").await;
    let observed = Instant::now();
    let (sent, reset_at) = client.await.unwrap();
    eprintln!(
        "{kind:?}: client wrote {sent} bytes, server read {got} then {err} {:?} after the reset",
        observed.duration_since(reset_at)
    );
    assert_eq!(
        err.kind(),
        std::io::ErrorKind::ConnectionReset,
        "{kind:?}: server sees the client's reset as a reset"
    );

    let out = common::next_outcome(&mut proxy, BOUND).await;
    assert_eq!(out.end, End::DownstreamReset, "{kind:?}: {out:?}");
    // Counted bytes were handed to the upstream's TCP; the abort may discard some of
    // them before the server reads them, never the reverse.
    assert!(
        out.downstream_to_upstream >= HELLO as u64 + got,
        "{kind:?}: {out:?} counts fewer bytes than the server read ({got} + initial)"
    );
    assert!(
        out.downstream_to_upstream <= HELLO as u64 + sent,
        "{kind:?}: {out:?}, client sent {sent}"
    );
    assert_eq!(out.upstream_to_downstream, 0, "{kind:?}: {out:?}");
}

/// (e) The server resets while sending as fast as it can: the client must see a reset.
/// The client only reads, for the reason given at (d).
async fn server_reset_while_flowing(kind: Kind) {
    let (server, mut proxy) = setup(kind, HELLO, Limits::default()).await;
    let mut c = connect_with_hello(&proxy).await;
    let s = accept_hello(&server).await;
    let (flowing_tx, flowing_rx) = oneshot::channel();
    let srv = tokio::spawn(write_then_reset(s, SEED_DOWN, flowing_rx));

    let (got, err) = recv_until_error(&mut c, SEED_DOWN, flowing_tx, "client").await;
    let observed = Instant::now();
    let (sent, reset_at) = srv.await.unwrap();
    eprintln!(
        "{kind:?}: server wrote {sent} bytes, client read {got} then {err} {:?} after the reset",
        observed.duration_since(reset_at)
    );
    assert_eq!(
        err.kind(),
        std::io::ErrorKind::ConnectionReset,
        "{kind:?}: client sees the server's reset as a reset"
    );

    let out = common::next_outcome(&mut proxy, BOUND).await;
    assert_eq!(out.end, End::UpstreamReset, "{kind:?}: {out:?}");
    assert!(
        out.upstream_to_downstream >= got,
        "{kind:?}: {out:?} counts fewer bytes than the client read ({got})"
    );
    assert!(
        out.upstream_to_downstream <= sent,
        "{kind:?}: {out:?}, server sent {sent}"
    );
    assert_eq!(
        out.downstream_to_upstream, HELLO as u64,
        "{kind:?}: {out:?}"
    );
}

/// (f) The client sends the initial bytes and its FIN at once, and the FIN has arrived
/// before the dataplane takes over (the proxy is held until the client's socket shows the
/// FIN acknowledged). The server gets exactly the initial bytes, then EOF.
async fn bare_fin_after_initial_bytes(kind: Kind) {
    fin_queued_before_forwarding(kind, HELLO, 0).await;
}

/// (f) As above, without initial bytes: connect, then FIN at once.
async fn bare_fin_without_initial_bytes(kind: Kind) {
    fin_queued_before_forwarding(kind, 0, 0).await;
}

/// (f) As above, with payload queued after the initial bytes and before the FIN.
async fn data_and_fin_queued_before_forwarding(kind: Kind) {
    fin_queued_before_forwarding(kind, HELLO, 32 * 1024).await;
}

async fn fin_queued_before_forwarding(kind: Kind, initial_len: usize, extra: u64) {
    let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (mut proxy, gate) = common::proxy_gated(
        common::dataplane(kind),
        server.local_addr().unwrap(),
        initial_len,
        Limits::default(),
    )
    .await;
    let mut c = TcpStream::connect(proxy.addr).await.unwrap();
    c.write_all(&hello()[..initial_len]).await.unwrap();
    send_pattern(&mut c, SEED_UP, extra).await;
    c.shutdown().await.unwrap();
    // FIN_WAIT2: the proxy's socket has the FIN (it is in CLOSE_WAIT).
    common::wait_tcp_state(&c, common::TCP_FIN_WAIT2, BOUND).await;
    gate.add_permits(1);

    let (mut s, _) = timeout(BOUND, server.accept()).await.unwrap().unwrap();
    let mut h = vec![0u8; initial_len];
    timeout(BOUND, s.read_exact(&mut h))
        .await
        .expect("initial bytes arrive")
        .unwrap();
    assert_eq!(h, hello()[..initial_len], "{kind:?}: initial bytes first");
    let got = recv_to_eof(&mut s, SEED_UP, "server").await;
    assert_eq!(got, extra, "{kind:?}: every queued byte, then EOF");
    drop(s);
    expect_eof(&mut c, "client").await;

    let out = common::next_outcome(&mut proxy, BOUND).await;
    assert_eq!(
        out,
        Outcome {
            downstream_to_upstream: initial_len as u64 + extra,
            upstream_to_downstream: 0,
            end: End::Closed,
        },
        "{kind:?}"
    );
}

/// The upstream answers and half-closes at once (a banner, an error page), and its FIN
/// has arrived before the dataplane takes over. The client gets the answer and EOF, and
/// can still send afterwards.
async fn upstream_fin_queued_before_forwarding(kind: Kind) {
    const BANNER: u64 = 1000;
    const UP: u64 = 1024 * 1024;
    let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (mut proxy, gate) = common::proxy_gated(
        common::dataplane(kind),
        server.local_addr().unwrap(),
        HELLO,
        Limits::default(),
    )
    .await;
    let mut c = connect_with_hello(&proxy).await;
    // The proxy dials before waiting at the gate; the initial bytes come after it.
    let (mut s, _) = timeout(BOUND, server.accept()).await.unwrap().unwrap();
    send_pattern(&mut s, SEED_DOWN, BANNER).await;
    s.shutdown().await.unwrap();
    common::wait_tcp_state(&s, common::TCP_FIN_WAIT2, BOUND).await;
    gate.add_permits(1);

    let got = recv_to_eof(&mut c, SEED_DOWN, "client").await;
    assert_eq!(
        got, BANNER,
        "{kind:?}: client gets the whole answer, then EOF"
    );
    // Sent while the server reads: the ends' buffers alone need not hold it all.
    let client = tokio::spawn(async move {
        send_pattern(&mut c, SEED_UP, UP).await;
        c.shutdown().await.unwrap();
    });

    let mut h = vec![0u8; HELLO];
    timeout(BOUND, s.read_exact(&mut h))
        .await
        .expect("initial bytes arrive")
        .unwrap();
    assert_eq!(h, hello(), "{kind:?}: initial bytes first");
    let got = recv_to_eof(&mut s, SEED_UP, "server after its own FIN").await;
    assert_eq!(got, UP, "{kind:?}: half-closed server gets every byte");
    client.await.unwrap();
    drop(s);

    let out = common::next_outcome(&mut proxy, BOUND).await;
    assert_eq!(
        out,
        Outcome {
            downstream_to_upstream: HELLO as u64 + UP,
            upstream_to_downstream: BANNER,
            end: End::Closed,
        },
        "{kind:?}"
    );
}

/// The copy parks a silent connection after 100 ms: its idle timeout then falls due
/// while it is parked.
const SHORT_IDLE: Limits = Limits {
    idle_timeout: Duration::from_millis(300),
    max_lifetime: None,
    park_after: Some(waypoint::dataplane::DEFAULT_PARK_AFTER),
    stall_after: Some(waypoint::dataplane::DEFAULT_STALL_AFTER),
};

/// (g) A connection that goes silent is closed by the proxy: both ends see EOF (a reset
/// where it is rewritten, see [`expect_ended`]).
async fn idle_timeout_closes_silent_connection(kind: Kind) {
    let (server, mut proxy) = setup(kind, HELLO, SHORT_IDLE).await;
    let mut c = connect_with_hello(&proxy).await;
    let mut s = accept_hello(&server).await;
    let silent_since = Instant::now();

    let out = common::next_outcome(&mut proxy, Duration::from_secs(5)).await;
    eprintln!(
        "{kind:?}: closed {:?} after going silent",
        silent_since.elapsed()
    );
    assert_eq!(
        out,
        Outcome {
            downstream_to_upstream: HELLO as u64,
            upstream_to_downstream: 0,
            end: End::IdleTimeout,
        },
        "{kind:?}"
    );
    expect_ended(&mut c, kind, "client").await;
    expect_ended(&mut s, kind, "server").await;
}

/// (g) The idle timeout of a connection with bytes still on the way: the server reads
/// nothing while the client writes more than every buffer between them holds, until
/// nothing moves. Both sides are reset: a FIN would tell the server that the stream it
/// got was whole. The server still reads every byte that reached it, in order, then the
/// reset.
async fn idle_timeout_resets_both_when_bytes_are_held(kind: Kind) {
    const MORE_THAN_HELD: u64 = 64 << 20;
    let (server, mut proxy) = setup(kind, HELLO, SHORT_IDLE).await;
    let mut c = connect_with_hello(&proxy).await;
    let mut s = accept_hello(&server).await;
    let client = tokio::spawn(async move {
        let mut buf = vec![0u8; 256 * 1024];
        let mut sent = 0u64;
        while sent < MORE_THAN_HELD {
            common::pattern_fill(SEED_UP, sent, &mut buf);
            if let Err(e) = c.write_all(&buf).await {
                return (sent, Some(e.kind()));
            }
            sent += buf.len() as u64;
        }
        (sent, None)
    });
    let out = common::next_outcome(&mut proxy, BOUND).await;
    assert_eq!(out.end, End::IdleTimeout, "{kind:?}: {out:?}");
    let (got, end) = recv_to_end(&mut s, SEED_UP, "server").await;
    assert_eq!(
        end,
        Some(std::io::ErrorKind::ConnectionReset),
        "{kind:?}: the server's end after {got} bytes, with bytes held on the way"
    );
    let (sent, client_err) = timeout(BOUND, client)
        .await
        .expect("the client's write ends")
        .unwrap();
    assert!(
        matches!(
            client_err,
            Some(std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe)
        ),
        "{kind:?}: client: {client_err:?} after {sent} bytes"
    );
    assert!(
        got < sent,
        "{kind:?}: the server got {got} bytes of the {sent} the client's writes took"
    );
    // What the upstream socket took: at a reset, what it had not sent yet is dropped.
    assert!(
        (HELLO as u64 + got..=HELLO as u64 + sent).contains(&out.downstream_to_upstream),
        "{kind:?}: {out:?}, server got {got}, client sent {sent}"
    );
}

/// (g) A connection trickling one byte every 100 ms for 1 s (more than three idle
/// timeouts) stays open, and still works both ways afterwards.
async fn trickle_keeps_connection_open(kind: Kind) {
    const TRICKLE: u64 = 10;
    let (server, mut proxy) = setup(kind, HELLO, SHORT_IDLE).await;
    let mut c = connect_with_hello(&proxy).await;
    let mut s = accept_hello(&server).await;

    let mut ticker = tokio::time::interval(Duration::from_millis(100));
    let mut b = [0u8; 1];
    for i in 0..TRICKLE {
        ticker.tick().await;
        common::pattern_fill(SEED_UP, i, &mut b);
        c.write_all(&b).await.unwrap();
        let mut r = [0u8; 1];
        timeout(BOUND, s.read_exact(&mut r))
            .await
            .expect("trickled byte arrives")
            .unwrap_or_else(|e| panic!("{kind:?}: connection broke at trickled byte {i}: {e}"));
        assert_eq!(r, b, "{kind:?}: trickled byte {i}");
    }
    assert!(
        proxy.outcomes.try_recv().is_err(),
        "{kind:?}: the proxy ended a connection that was never idle for 300 ms"
    );

    // Still open both ways: a byte back, then a clean close.
    s.write_all(b"!").await.unwrap();
    timeout(BOUND, c.read_exact(&mut b)).await.unwrap().unwrap();
    assert_eq!(&b, b"!");
    c.shutdown().await.unwrap();
    expect_eof(&mut s, "server").await;
    s.shutdown().await.unwrap();
    expect_eof(&mut c, "client").await;

    let out = common::next_outcome(&mut proxy, BOUND).await;
    assert_eq!(
        out,
        Outcome {
            downstream_to_upstream: HELLO as u64 + TRICKLE,
            upstream_to_downstream: 1,
            end: End::Closed,
        },
        "{kind:?}"
    );
}

/// `max_lifetime` closes a silent connection whose idle timeout is far away.
async fn lifetime_closes_silent_connection(kind: Kind) {
    let limits = Limits {
        idle_timeout: Duration::from_secs(60),
        max_lifetime: Some(Duration::from_millis(500)),
        ..Limits::default()
    };
    let (server, mut proxy) = setup(kind, HELLO, limits).await;
    let mut c = connect_with_hello(&proxy).await;
    let started = Instant::now();
    let mut s = accept_hello(&server).await;

    let out = common::next_outcome(&mut proxy, BOUND).await;
    eprintln!(
        "{kind:?}: silent connection closed {:?} after connecting (max_lifetime 500 ms)",
        started.elapsed()
    );
    assert_eq!(
        out,
        Outcome {
            downstream_to_upstream: HELLO as u64,
            upstream_to_downstream: 0,
            end: End::LifetimeExceeded,
        },
        "{kind:?}"
    );
    expect_ended(&mut c, kind, "client").await;
    expect_ended(&mut s, kind, "server").await;
}

/// `max_lifetime` closes a connection that keeps moving bytes (so it is never idle).
async fn lifetime_closes_busy_connection(kind: Kind) {
    let limits = Limits {
        idle_timeout: Duration::from_millis(300),
        max_lifetime: Some(Duration::from_secs(1)),
        ..Limits::default()
    };
    let (server, mut proxy) = setup(kind, HELLO, limits).await;
    let mut c = connect_with_hello(&proxy).await;
    let started = Instant::now();
    let mut s = accept_hello(&server).await;

    // One byte every 50 ms until the proxy closes the connection; the client reads
    // nothing, so its read returning is the close. That close may be a reset: a byte on
    // its way when the lifetime ends is held between the two sides (which resets both),
    // or arrives after the proxy stopped reading (unread data at close time).
    let client = tokio::spawn(async move {
        let mut ticker = tokio::time::interval(Duration::from_millis(50));
        let mut sent = 0u64;
        let mut b = [0u8; 1];
        loop {
            tokio::select! {
                r = c.read(&mut b) => {
                    assert!(
                        matches!(&r, Ok(0)) || matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
                        "client: expected EOF or a reset, got {r:?}"
                    );
                    return sent;
                }
                _ = ticker.tick() => {
                    common::pattern_fill(SEED_UP, sent, &mut b);
                    if c.write_all(&b).await.is_err() {
                        return sent;
                    }
                    sent += 1;
                }
            }
        }
    });
    let (got, end) = recv_to_end(&mut s, SEED_UP, "server").await;

    let out = common::next_outcome(&mut proxy, BOUND).await;
    eprintln!(
        "{kind:?}: busy connection closed {:?} after connecting (max_lifetime 1 s), \
         the server saw {end:?}",
        started.elapsed()
    );
    let sent = timeout(BOUND, client)
        .await
        .expect("client sees the close")
        .unwrap();
    assert_eq!(out.end, End::LifetimeExceeded, "{kind:?}: {out:?}");
    assert!(
        got >= 10,
        "{kind:?}: the connection was busy ({got} bytes arrived)"
    );
    match end {
        // Nothing was on the way: the count is exact.
        None => assert_eq!(
            out.downstream_to_upstream,
            HELLO as u64 + got,
            "{kind:?}: counted bytes are the ones delivered (client sent {sent})"
        ),
        Some(std::io::ErrorKind::ConnectionReset) => assert!(
            out.downstream_to_upstream >= HELLO as u64 + got,
            "{kind:?}: {out:?}, the server got {got}"
        ),
        Some(e) => panic!("{kind:?}: server: {e:?} after {got} bytes"),
    }
    assert_eq!(out.upstream_to_downstream, 0, "{kind:?}: {out:?}");
}
