//! The portable dataplane: a userspace read/write copy per direction.
//!
//! Slowest of the three, but needs nothing from the kernel beyond TCP. It is also the
//! reference the other dataplanes are tested against, and the eBPF dataplane's first
//! phase (`--splice-after`).
//!
//! Both directions and the connection's timer are one hand-written future, [`Copier`],
//! polled by the connection's task. Written as `async` pumps plus `drive()`, the same
//! logic took 1.4 KB per connection (each pump's readiness future, the select, a ticker
//! and a deadline, every argument stored twice); an idle connection's memory is mostly
//! this future, kept for the connection's whole life. The `Copier` is about 300 B.
//! It also knows at every poll whether a direction holds bytes it has read but not yet
//! written, which is what moving a connection into the kernel has to wait for.

use std::{
    future::Future,
    io,
    pin::{pin, Pin},
    task::{ready, Context, Poll},
    time::Duration,
};

use tokio::{
    net::TcpStream,
    time::{Instant, Sleep},
};

use super::{
    abort_on_close, classify_read_error, classify_write_error, shutdown_write, DirEnd, End, Limits,
    Outcome,
};

/// Size of a direction's heap buffer, once it has one.
const BUF_SIZE: usize = 64 * 1024;

/// Reads go into a stack buffer of this size until one fills it; then the direction
/// switches to a heap buffer of [`BUF_SIZE`] for good. An idle or request/response
/// connection then holds no buffer at all (a 64 KiB one per direction, with a page or two
/// touched, was most of the memory of an idle copied connection).
const SMALL_READ: usize = 4096;

/// The userspace copy dataplane. Stateless.
#[derive(Clone, Debug, Default)]
pub struct Copy;

impl Copy {
    /// See [`super::Dataplane::forward`].
    #[allow(
        clippy::manual_async_fn,
        reason = "an `async fn` stores its arguments twice"
    )]
    pub fn forward(
        &self,
        downstream: TcpStream,
        upstream: TcpStream,
        initial: Vec<u8>,
        limits: Limits,
    ) -> impl Future<Output = io::Result<Outcome>> + Send + '_ {
        // An `async move` block, not an `async fn`: the latter stores every argument
        // twice in its state (as passed, and as the body's binding).
        async move {
            let mut copier = pin!(Copier::new(&downstream, &upstream, initial, limits, NEVER));
            let end = match copier.as_mut().await {
                Stop::Ended(end) => end,
                // Cannot happen: no connection carries `NEVER` bytes.
                Stop::Move => End::Error(io::ErrorKind::Unsupported),
            };
            Ok(copier.outcome(end))
        }
    }
}

/// A `move_after` that is never reached.
pub(crate) const NEVER: u64 = u64::MAX;

/// Writes all of `buf` to `sock`, waiting for send-buffer space as needed.
pub(crate) async fn write_all(sock: &TcpStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        sock.writable().await?;
        match sock.try_write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Why a [`Copier`] stopped.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// The connection ended; the sockets are set up to close the right way (FIN or RST)
    /// when dropped.
    Ended(End),
    /// The connection carried `move_after` bytes and neither direction holds any: the
    /// sockets can be handed to another dataplane. What is queued in them is unread.
    Move,
}

/// One direction's state.
#[derive(Default)]
struct Dir {
    /// Bytes read but not yet written are `buf[off..]`.
    buf: Vec<u8>,
    off: usize,
    /// `buf` is the heap read buffer (a read filled the stack buffer once).
    big: bool,
    /// The source sent FIN and it was passed on.
    done: bool,
    /// Bytes written to the destination.
    moved: u64,
}

/// Reads per direction per poll at most (16 MiB with the heap buffer): a connection whose
/// source never runs dry and whose destination never fills still lets other tasks run.
const READS_BEFORE_YIELD: usize = 256;

/// What one poll of a direction came to, when not `Pending`.
enum Step {
    /// The source's FIN was passed on: this direction is done.
    Eof,
    /// Stopped before reading, holding no bytes, with no waker registered: the
    /// connection is to move.
    Stopped,
}

impl Dir {
    /// Holds no bytes read but not yet written.
    fn idle(&self) -> bool {
        self.off == self.buf.len()
    }

    /// Copies from `src` to `dst` until neither can go on now. With `stop`, stops before
    /// the next read instead, once it holds no bytes.
    fn poll(
        &mut self,
        cx: &mut Context<'_>,
        src: &TcpStream,
        dst: &TcpStream,
        stop: bool,
    ) -> Poll<Result<Step, DirEnd>> {
        // Each socket operation is tried first, and its readiness polled only when it
        // would block, as `async` pumps awaiting `readable()` did: a readiness poll spends
        // tokio's cooperative budget, and polling it before every read made the loop yield
        // every 64 reads (measured: 3x the context switches, -10 % bulk on one
        // connection). The loop still yields after `READS_BEFORE_YIELD` reads.
        for _ in 0..READS_BEFORE_YIELD {
            while !self.idle() {
                match dst.try_write(&self.buf[self.off..]) {
                    Ok(n) => {
                        self.off += n;
                        self.moved += n as u64;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if let Err(e) = ready!(dst.poll_write_ready(cx)) {
                            return Poll::Ready(Err(classify_write_error(e)));
                        }
                    }
                    Err(e) => return Poll::Ready(Err(classify_write_error(e))),
                }
            }
            if self.big {
                self.buf.clear();
            } else {
                // A small direction keeps no buffer between reads.
                self.buf = Vec::new();
            }
            self.off = 0;
            if stop {
                return Poll::Ready(Ok(Step::Stopped));
            }
            let read = if self.big {
                if self.buf.capacity() < BUF_SIZE {
                    self.buf.reserve_exact(BUF_SIZE);
                }
                src.try_read_buf(&mut self.buf)
            } else {
                let mut small = [0u8; SMALL_READ];
                match src.try_read(&mut small) {
                    Ok(n) if n > 0 => {
                        self.big = n == SMALL_READ;
                        // Written at once: most reads then need no heap buffer at all.
                        let written = match dst.try_write(&small[..n]) {
                            Ok(w) => w,
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
                            Err(e) => return Poll::Ready(Err(classify_write_error(e))),
                        };
                        self.moved += written as u64;
                        self.buf.extend_from_slice(&small[written..n]);
                        Ok(n)
                    }
                    r => r,
                }
            };
            match read {
                Ok(0) => {
                    return Poll::Ready(match shutdown_write(dst) {
                        Ok(()) => Ok(Step::Eof),
                        Err(e) => Err(classify_write_error(e)),
                    })
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if let Err(e) = ready!(src.poll_read_ready(cx)) {
                        return Poll::Ready(Err(classify_read_error(e)));
                    }
                }
                Err(e) => return Poll::Ready(Err(classify_read_error(e))),
            }
        }
        // A source and destination that never block: let other tasks run.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

pin_project_lite::pin_project! {
    /// Both directions of one connection, copied with the shared connection semantics
    /// (see `drive()` in `dataplane.rs`): a FIN is passed on after every byte before it,
    /// a reset on one side aborts the other, idle and over-age connections are closed.
    /// Optionally stops once the connection carried `move_after` bytes, at a moment
    /// neither direction holds bytes (see [`Stop::Move`]).
    pub(crate) struct Copier<'a> {
        down: &'a TcpStream,
        up: &'a TcpStream,
        // Downstream to upstream, then upstream to downstream.
        dirs: [Dir; 2],
        // Which direction is polled first: alternates, for fairness.
        first: usize,
        move_after: u64,
        idle_timeout: Duration,
        // Idle-check cadence, as in `drive()`.
        tick: Duration,
        lifetime_end: Option<Instant>,
        last_progress: u64,
        last_change: Instant,
        #[pin]
        timer: Sleep,
    }
}

impl<'a> Copier<'a> {
    /// `initial` is written to upstream before anything read from downstream.
    pub(crate) fn new(
        down: &'a TcpStream,
        up: &'a TcpStream,
        initial: Vec<u8>,
        limits: Limits,
        move_after: u64,
    ) -> Copier<'a> {
        let now = Instant::now();
        let tick = idle_tick(limits.idle_timeout);
        let lifetime_end = limits.max_lifetime.map(|l| now + l);
        let first_fire = lifetime_end.map_or(now + tick, |end| end.min(now + tick));
        Copier {
            down,
            up,
            dirs: [
                Dir {
                    buf: initial,
                    ..Dir::default()
                },
                Dir::default(),
            ],
            first: 0,
            move_after,
            idle_timeout: limits.idle_timeout,
            tick,
            lifetime_end,
            last_progress: 0,
            last_change: now,
            timer: tokio::time::sleep_until(first_fire),
        }
    }

    /// Bytes written downstream to upstream (the initial bytes included) and upstream to
    /// downstream so far.
    pub(crate) fn moved(&self) -> (u64, u64) {
        (self.dirs[0].moved, self.dirs[1].moved)
    }

    /// The outcome of a connection that ended with `end`.
    pub(crate) fn outcome(&self, end: End) -> Outcome {
        let (d2u, u2d) = self.moved();
        Outcome {
            downstream_to_upstream: d2u,
            upstream_to_downstream: u2d,
            end,
        }
    }
}

/// The idle check's cadence: a quarter of the idle timeout, but at least every 5 s and at
/// most every 10 ms, so the timeout fires within 25 % of its setting.
pub(crate) fn idle_tick(idle_timeout: Duration) -> Duration {
    (idle_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(5))
}

impl Future for Copier<'_> {
    type Output = Stop;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Stop> {
        let mut this = self.project();
        let sockets = [(*this.down, *this.up), (*this.up, *this.down)];
        *this.first ^= 1;
        loop {
            let mut stopped = false;
            for i in [*this.first, *this.first ^ 1] {
                if this.dirs[i].done {
                    continue;
                }
                let due = due(this.dirs, *this.move_after) && this.dirs[i ^ 1].idle();
                let (src, dst) = sockets[i];
                match this.dirs[i].poll(cx, src, dst, due) {
                    Poll::Pending => {}
                    Poll::Ready(Ok(Step::Eof)) => this.dirs[i].done = true,
                    Poll::Ready(Ok(Step::Stopped)) => stopped = true,
                    Poll::Ready(Err(e)) => {
                        return Poll::Ready(Stop::Ended(failed(i, e, this.down, this.up)))
                    }
                }
            }
            if this.dirs.iter().all(|d| d.done) {
                return Poll::Ready(Stop::Ended(End::Closed));
            }
            if due(this.dirs, *this.move_after) && this.dirs.iter().all(Dir::idle) {
                return Poll::Ready(Stop::Move);
            }
            // A direction that stopped registered no waker; the move fell through (the
            // other direction reached EOF meanwhile), so it has to go on.
            if !stopped {
                break;
            }
        }
        while this.timer.as_mut().poll(cx).is_ready() {
            let now = Instant::now();
            if this.lifetime_end.is_some_and(|end| now >= end) {
                return Poll::Ready(Stop::Ended(End::LifetimeExceeded));
            }
            let progress = this.dirs[0].moved + this.dirs[1].moved;
            if progress != *this.last_progress {
                *this.last_progress = progress;
                *this.last_change = now;
            } else if now.duration_since(*this.last_change) >= *this.idle_timeout {
                return Poll::Ready(Stop::Ended(End::IdleTimeout));
            }
            let next = now + *this.tick;
            let next = this.lifetime_end.map_or(next, |end| end.min(next));
            this.timer.as_mut().reset(next);
        }
        Poll::Pending
    }
}

/// The connection is to move: it carried `move_after` bytes and no direction ended.
fn due(dirs: &[Dir; 2], move_after: u64) -> bool {
    dirs[0].moved + dirs[1].moved >= move_after && !dirs[0].done && !dirs[1].done
}

/// Maps how direction `i` failed to how the connection ends, and makes both sockets
/// close with RST: a reset on one side is passed on as an abort of the other.
fn failed(i: usize, e: DirEnd, down: &TcpStream, up: &TcpStream) -> End {
    let end = match (i, e) {
        (0, DirEnd::SourceReset) | (1, DirEnd::DestReset) => End::DownstreamReset,
        (_, DirEnd::SourceReset) | (_, DirEnd::DestReset) => End::UpstreamReset,
        (_, DirEnd::Error(e)) => End::Error(e.kind()),
        // Not produced by `Dir::poll`, which reports EOF as a `Step`.
        (_, DirEnd::Eof) => End::Closed,
    };
    if end != End::Closed {
        abort_on_close(down);
        abort_on_close(up);
    }
    end
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

    use std::time::Duration;

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

    /// The move waits while a direction holds bytes it read but could not write (its
    /// destination does not read), and once it happens, nothing was lost: what the
    /// server got plus what is still queued in the router's socket is what was sent.
    #[tokio::test]
    async fn no_move_while_a_direction_holds_bytes() {
        const SENT: usize = 4 * 1024 * 1024;
        let (mut client, down) = pair().await;
        let (mut server, up) = small_pair().await;
        let sent = pattern(SENT);
        let writer = {
            let sent = sent.clone();
            tokio::spawn(async move {
                client.write_all(&sent).await.unwrap();
                // Kept open: an EOF would rule the move out.
                client
            })
        };
        // Much more is queued in `down` than fits towards the server, before the first
        // poll: the copy fills what fits and then holds bytes, past its threshold.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut copier = pin!(Copier::new(&down, &up, Vec::new(), Limits::default(), 1));
        let early = tokio::time::timeout(Duration::from_millis(300), copier.as_mut()).await;
        assert!(early.is_err(), "moved while holding bytes: {early:?}");
        assert!(
            !copier.dirs[0].idle(),
            "the copy should hold unwritten bytes"
        );

        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buf = vec![0u8; 64 * 1024];
            // Reads until the stream pauses: then the copy has nothing left to write.
            while let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_millis(500), server.read(&mut buf)).await
            {
                assert!(n > 0, "unexpected EOF");
                got.extend_from_slice(&buf[..n]);
            }
            got
        });
        let stop = tokio::time::timeout(Duration::from_secs(10), copier.as_mut())
            .await
            .expect("the move never came");
        assert_eq!(stop, Stop::Move);
        let (d2u, u2d) = copier.moved();
        assert_eq!(u2d, 0);
        let mut got = reader.await.unwrap();
        assert_eq!(got.len() as u64, d2u, "written is what the server got");
        // The rest is still in the router's downstream socket, unread (read before the
        // writer is awaited: it may be waiting for room in that socket).
        let mut rest = vec![0u8; SENT - got.len()];
        let mut down = down;
        down.read_exact(&mut rest).await.unwrap();
        let _client = writer.await.unwrap();
        got.extend_from_slice(&rest);
        assert!(got == sent, "bytes lost or reordered at the move");
    }

    /// Below the threshold, a connection never moves and ends as usual.
    #[tokio::test]
    async fn below_the_threshold_it_ends_in_the_copy() {
        let (mut client, down) = pair().await;
        let (mut server, up) = pair().await;
        let mut copier = pin!(Copier::new(
            &down,
            &up,
            b"hello".to_vec(),
            Limits::default(),
            1024
        ));
        client.write_all(b" world").await.unwrap();
        client.shutdown().await.unwrap();
        server.write_all(b"bye").await.unwrap();
        server.shutdown().await.unwrap();
        let stop = tokio::time::timeout(Duration::from_secs(5), copier.as_mut())
            .await
            .unwrap();
        assert_eq!(stop, Stop::Ended(End::Closed));
        assert_eq!(copier.moved(), (11, 3));
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"hello world");
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"bye");
    }
}
