//! The copy's tests: both directions, half-closes, resets, timers, the move and parking.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::{future::poll_fn, os::fd::AsRawFd as _, pin::pin, time::Duration};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

use super::*;

/// A connected pair: (the peer's end, the router's end).
async fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let peer = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (router, _) = l.accept().await.unwrap();
    (peer, router)
}

/// Like [`pair`], with small buffers both ways: little fits between the router's
/// end and a peer that does not read.
async fn small_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.set_recv_buffer_size(16 * 1024).unwrap();
    let peer = s.connect(l.local_addr().unwrap()).await.unwrap();
    let (router, _) = l.accept().await.unwrap();
    socket2::SockRef::from(&router)
        .set_send_buffer_size(16 * 1024)
        .unwrap();
    (peer, router)
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

/// Reads `server` until its stream pauses for 500 ms: then the copy has nothing left
/// to write.
fn read_until_pause(mut server: TcpStream) -> tokio::task::JoinHandle<Vec<u8>> {
    tokio::spawn(async move {
        let mut got = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(500), server.read(&mut buf)).await
        {
            assert!(n > 0, "unexpected EOF");
            got.extend_from_slice(&buf[..n]);
        }
        got
    })
}

/// Polls `copier` over `down` and `up` until it stops, for at most 10 s.
async fn run(mut copier: Pin<&mut Copier>, down: &TcpStream, up: &TcpStream) -> Stop {
    tokio::time::timeout(
        Duration::from_secs(10),
        poll_fn(|cx| copier.as_mut().poll_copy(cx, down, up)),
    )
    .await
    .expect("the copy never stopped")
}

/// After a move: what the server got plus what is still queued in `down`, unread, is
/// what was sent. `down`'s rest is read before the writer is awaited: it may be
/// waiting for room in that socket.
async fn nothing_lost(
    mut got: Vec<u8>,
    mut down: TcpStream,
    writer: tokio::task::JoinHandle<TcpStream>,
    sent: &[u8],
) {
    let mut rest = vec![0u8; sent.len() - got.len()];
    down.read_exact(&mut rest).await.unwrap();
    let _client = writer.await.unwrap();
    got.extend_from_slice(&rest);
    assert!(got == sent, "bytes lost or reordered at the move");
}

/// The move waits while a direction holds bytes it read but could not write (its
/// destination does not read), and once it happens, nothing was lost: what the
/// server got plus what is still queued in the router's socket is what was sent.
#[tokio::test]
async fn no_move_while_a_direction_holds_bytes() {
    const SENT: usize = 4 * 1024 * 1024;
    const HELD: usize = 1024 * 1024;
    let (mut client, down) = pair().await;
    let (server, up) = small_pair().await;
    let sent = pattern(SENT);
    let writer = {
        let rest = sent[HELD..].to_vec();
        tokio::spawn(async move {
            client.write_all(&rest).await.unwrap();
            // Kept open: an EOF would rule the move out.
            client
        })
    };
    // The copy starts with 1 MiB to write (as the router hands over what it read),
    // far more than fits towards the server, and the rest queued in `down`: past
    // its threshold (0) at once, it holds bytes. Bytes queued in `down` first, so
    // there are some it must not read.
    down.readable().await.unwrap();
    let mut copier = pin!(Copier::new(sent[..HELD].to_vec(), Limits::default(), 0));
    let early = tokio::time::timeout(
        Duration::from_millis(300),
        poll_fn(|cx| copier.as_mut().poll_copy(cx, &down, &up)),
    )
    .await;
    assert!(early.is_err(), "moved while holding bytes: {early:?}");
    assert!(
        !copier.dirs[0].idle(),
        "the copy should hold unwritten bytes"
    );

    let reader = read_until_pause(server);
    assert_eq!(run(copier.as_mut(), &down, &up).await, Stop::Move);
    let (d2u, u2d) = copier.moved();
    assert_eq!(u2d, 0);
    let got = reader.await.unwrap();
    assert_eq!(got.len() as u64, d2u, "written is what the server got");
    assert!(d2u >= HELD as u64);
    assert!(
        !copier.dirs[0].full,
        "the move comes right after a read that left downstream's queue empty"
    );
    nothing_lost(got, down, writer, &sent).await;
}

/// A burst queued at once (as while a connection was parked) is copied past the
/// threshold until a read leaves the queue empty: a move right after a full read
/// could leave a segment partly read (see `Dir::full`). The move is still checked at
/// every read, and comes at the first such read.
#[tokio::test]
async fn past_the_threshold_the_move_waits_for_a_read_that_empties_the_queue() {
    const SENT: usize = 4 * 1024 * 1024;
    const THRESHOLD: u64 = 100_000;
    let (mut client, down) = pair().await;
    let (server, up) = pair().await;
    let sent = pattern(SENT);
    let writer = {
        let sent = sent.clone();
        tokio::spawn(async move {
            client.write_all(&sent).await.unwrap();
            client
        })
    };
    let reader = read_until_pause(server);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut copier = pin!(Copier::new(Vec::new(), Limits::default(), THRESHOLD));
    assert_eq!(run(copier.as_mut(), &down, &up).await, Stop::Move);
    let (d2u, _) = copier.moved();
    assert!(
        d2u >= THRESHOLD,
        "moved after {d2u} bytes, threshold {THRESHOLD}"
    );
    assert!(
        !copier.dirs[0].full,
        "the move comes right after a read that left the queue empty"
    );
    let got = reader.await.unwrap();
    assert_eq!(got.len() as u64, d2u);
    nothing_lost(got, down, writer, &sent).await;
}

/// Below the threshold, a connection never moves and ends as usual.
#[tokio::test]
async fn below_the_threshold_it_ends_in_the_copy() {
    let (mut client, down) = pair().await;
    let (mut server, up) = pair().await;
    let mut copier = pin!(Copier::new(b"hello".to_vec(), Limits::default(), 1024));
    client.write_all(b" world").await.unwrap();
    client.shutdown().await.unwrap();
    server.write_all(b"bye").await.unwrap();
    server.shutdown().await.unwrap();
    assert_eq!(
        run(copier.as_mut(), &down, &up).await,
        Stop::Ended(End::Closed)
    );
    assert_eq!(copier.moved(), (11, 3));
    let mut got = Vec::new();
    server.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"hello world");
    let mut got = Vec::new();
    client.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"bye");
}

/// A gated source (a socket in the SockHash, see [`Gate`]) whose FIN TCP processed
/// while the verdict's count says bytes are still on their way: the copy holds the
/// FIN back, waiting for the socket to turn readable again, and passes it on once it
/// has read what the verdict passed. Nothing but the gate holds it: without one the
/// same stream ends at once.
#[tokio::test]
async fn a_gated_eof_waits_for_every_passed_byte() {
    const SENT: usize = 100_000;
    let (mut client, down) = pair().await;
    let (mut pod, up) = pair().await;
    let up_fd = up.as_raw_fd();
    let flow: &'static FlowCell = Box::leak(Box::default());
    // 10 bytes more than the pod sends are "on their way": initial bytes (written
    // first, not read from the socket) do not count as read.
    flow.set_passed(SENT as u64 + 10);
    let gate = Gate {
        side: 1,
        flow,
        base: 3,
    };
    let copy = tokio::spawn(to_end_gated(
        down,
        up,
        [Vec::new(), b"hi!".to_vec()],
        Limits::default(),
        Some(gate),
        Tally::leak(Kind::Ebpf),
    ));
    let sent = pattern(SENT);
    pod.write_all(&sent).await.unwrap();
    pod.shutdown().await.unwrap();
    let mut got = vec![0u8; 3 + SENT];
    client.read_exact(&mut got).await.unwrap();
    assert_eq!(&got[..3], b"hi!");
    assert!(got[3..] == sent[..]);
    let mut more = [0u8; 16];
    let early = tokio::time::timeout(Duration::from_millis(300), client.read(&mut more)).await;
    assert!(
        early.is_err(),
        "the FIN went through before the passed bytes: {early:?}"
    );

    // The count catches up (as the psock's enqueue would make the bytes readable) and
    // the socket turns readable: SO_RCVLOWAT makes TCP report it at once, as the
    // enqueue's wake-up would.
    flow.set_passed(SENT as u64);
    // The copy holds the socket open.
    crate::sys::set_rcvlowat(up_fd, 1).unwrap();
    let eof = tokio::time::timeout(Duration::from_secs(5), client.read(&mut more))
        .await
        .expect("the FIN never came");
    assert_eq!(eof.unwrap(), 0);
    drop(client);
    drop(pod);
    let outcome = copy.await.unwrap();
    assert_eq!(outcome.upstream_to_downstream, 3 + SENT as u64);
}
