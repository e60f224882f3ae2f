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
    pin::Pin,
    task::{ready, Context, Poll},
    time::Duration,
};

use futures::FutureExt as _;
use tokio::{
    io::Interest,
    net::TcpStream,
    time::{Instant, Sleep},
};
use tracing::debug;

use super::{
    abort_on_close, classify_read_error, classify_write_error,
    flows::FlowCell,
    forced_end,
    park::{Parked, Parker},
    shutdown_write,
    stall::Watchdog,
    tally::Tally,
    DirEnd, End, Kind, Limits, Outcome,
};

/// Size of a direction's heap buffer, once it has one.
const BUF_SIZE: usize = 64 * 1024;

/// Reads go into a stack buffer of this size until one fills it; then the direction
/// switches to a heap buffer of [`BUF_SIZE`] for good. An idle or request/response
/// connection then holds no buffer at all (a 64 KiB one per direction, with a page or two
/// touched, was most of the memory of an idle copied connection).
const SMALL_READ: usize = 4096;

/// The userspace copy dataplane. It keeps only its counts.
#[derive(Clone, Debug)]
pub struct UserspaceCopy {
    tally: &'static Tally,
}

impl Default for UserspaceCopy {
    fn default() -> Self {
        UserspaceCopy::new()
    }
}

impl UserspaceCopy {
    /// A copy dataplane with counts of its own.
    pub fn new() -> Self {
        UserspaceCopy {
            tally: Tally::leak(Kind::Copy),
        }
    }

    pub(super) fn tally(&self) -> &'static Tally {
        self.tally
    }

    /// See [`super::Dataplane::forward`].
    pub fn forward(
        &self,
        downstream: TcpStream,
        upstream: TcpStream,
        initial: Vec<u8>,
        limits: Limits,
    ) -> impl Future<Output = io::Result<Outcome>> + Send + 'static {
        to_end(downstream, upstream, initial, limits, self.tally).map(Ok)
    }
}

/// Copies a connection to its end, counting its stall and parkings in `tally` (the eBPF
/// dataplane's userspace fallback runs here too).
pub(crate) fn to_end(
    downstream: TcpStream,
    upstream: TcpStream,
    initial: Vec<u8>,
    limits: Limits,
    tally: &'static Tally,
) -> impl Future<Output = Outcome> + Send + 'static {
    // A combinator, not an `async` block, which would keep the arguments it moved into
    // the copy for the connection's whole life.
    copy(downstream, upstream, initial, limits, NEVER, tally).map(|(copied, (d2u, u2d))| {
        let end = match copied {
            Copied::Ended(end) => end,
            // Cannot happen: no connection carries `NEVER` bytes.
            Copied::Move { .. } => End::Error(io::ErrorKind::Unsupported),
        };
        Outcome {
            downstream_to_upstream: d2u,
            upstream_to_downstream: u2d,
            end,
        }
    })
}

/// As [`to_end`], for the eBPF dataplane's fallback: `initial` holds the bytes to write
/// downstream to upstream and upstream to downstream first, and `gate`, if any, names a
/// source socket that is in the SockHash while the copy reads it (see [`Gate`]).
pub(super) fn to_end_gated<'a>(
    downstream: TcpStream,
    upstream: TcpStream,
    initial: [Vec<u8>; 2],
    limits: Limits,
    gate: Option<Gate<'a>>,
    tally: &'static Tally,
) -> impl Future<Output = Outcome> + Send + 'a {
    let progress = Progress::start(limits, tally);
    let phase = CopyPhase {
        phase: Phase::Copying {
            down: downstream,
            up: upstream,
            copier: Box::pin(Copier::resume(initial, limits, NEVER, progress)),
        },
        limits,
        move_after: NEVER,
        gate: gate.map(Box::new),
    };
    phase.map(|(copied, (d2u, u2d))| Outcome {
        downstream_to_upstream: d2u,
        upstream_to_downstream: u2d,
        end: match copied {
            Copied::Ended(end) => end,
            Copied::Move { .. } => End::Error(io::ErrorKind::Unsupported),
        },
    })
}

/// A source socket the copy reads while it is in the eBPF dataplane's SockHash: a
/// connection whose other socket could not go in (a FIN raced the insertion) is copied in
/// userspace, and the socket that did get in stays there, at zero credit, until the
/// copy ends (removing it would discard what the kernel queued for it). Everything that
/// arrives on it then goes through the verdict, which passes it to the socket's psock,
/// and the copy reads it from there. TCP reports EOF as soon as it has processed the
/// FIN, while bytes passed before it can still wait in the psock's backlog, behind a
/// failed or deferred enqueue: EOF on such a source is final only once the copy has read
/// every byte the verdict passed.
pub(super) struct Gate<'a> {
    /// The direction that reads the socket: 0 downstream to upstream, 1 upstream to
    /// downstream.
    pub(super) side: usize,
    /// The socket's record: `passed` counts what the verdict passed to it.
    pub(super) flow: &'a FlowCell,
    /// Bytes the direction writes that were not read from the socket after it went in
    /// (its initial bytes).
    pub(super) base: u64,
}

impl Gate<'_> {
    /// The verdict passed bytes the direction has not read yet; `moved` is what it
    /// wrote so far, all it read included.
    fn behind(&self, moved: u64) -> bool {
        self.flow.counters().passed > moved.saturating_sub(self.base)
    }
}

/// A `move_after` that is never reached.
pub(crate) const NEVER: u64 = u64::MAX;

/// How [`copy`] ended.
pub(crate) enum Copied {
    /// The connection ended; the sockets are closed the right way (FIN or RST).
    Ended(End),
    /// The connection carried `move_after` bytes and neither direction holds any: the
    /// sockets, with what is queued in them unread.
    Move {
        down: TcpStream,
        up: TcpStream,
        /// The stall watchdog counted the connection already: it is counted once.
        stalled: bool,
    },
}

/// Copies both directions with a [`Copier`] until the connection ends or is to move, and
/// parks it (see [`super::park`]) whenever it has been idle for `limits.park_after`.
/// Resolves with how it ended and the bytes moved downstream to upstream (the initial
/// bytes included) and upstream to downstream.
///
/// Hand-written rather than an `async` block: a block keeps everything it captured in
/// every state, so a parked connection's task would still carry both tokio sockets and
/// the copy's arguments. This is about 150 B, and the [`Copier`] is boxed so that parking
/// frees it.
pub(crate) struct CopyPhase<'a> {
    phase: Phase,
    limits: Limits,
    move_after: u64,
    /// Boxed: only the eBPF dataplane's fallback has one.
    gate: Option<Box<Gate<'a>>>,
}

enum Phase {
    Copying {
        down: TcpStream,
        up: TcpStream,
        copier: Pin<Box<Copier>>,
    },
    Parked {
        parked: Parked,
        progress: Progress,
    },
    Done,
}

/// See [`CopyPhase`]. A stall and parkings are counted in `tally`.
pub(crate) fn copy(
    down: TcpStream,
    up: TcpStream,
    initial: Vec<u8>,
    limits: Limits,
    move_after: u64,
    tally: &'static Tally,
) -> CopyPhase<'static> {
    let progress = Progress::start(limits, tally);
    CopyPhase {
        phase: Phase::Copying {
            down,
            up,
            copier: Box::pin(Copier::resume(
                [initial, Vec::new()],
                limits,
                move_after,
                progress,
            )),
        },
        limits,
        move_after,
        gate: None,
    }
}

impl Future for CopyPhase<'_> {
    type Output = (Copied, (u64, u64));

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        loop {
            match &mut this.phase {
                Phase::Copying { down, up, copier } => {
                    let gate = this.gate.as_deref();
                    let stop = ready!(copier.as_mut().poll_copy_gated(cx, down, up, gate));
                    let progress = copier.progress();
                    let moved = (progress.moved[0], progress.moved[1]);
                    let Phase::Copying { down, up, .. } =
                        std::mem::replace(&mut this.phase, Phase::Done)
                    else {
                        unreachable!("matched above")
                    };
                    match stop {
                        Stop::Ended(end) => return Poll::Ready((Copied::Ended(end), moved)),
                        Stop::Move => {
                            let stalled = progress.stalled;
                            return Poll::Ready((Copied::Move { down, up, stalled }, moved));
                        }
                        Stop::Park => {}
                    }
                    match park(down, up, progress.deadline(this.limits), progress.tally) {
                        Ok(parked) => this.phase = Phase::Parked { parked, progress },
                        Err(Unparked::Back(down, up)) => {
                            // Counted and logged in `park`: this connection stays in tokio.
                            this.limits.park_after = None;
                            this.resume(down, up, progress);
                        }
                        Err(Unparked::Lost(e)) => {
                            debug!(error = %e, "connection lost while parking");
                            return Poll::Ready((Copied::Ended(End::Error(e.kind())), moved));
                        }
                    }
                }
                Phase::Parked { parked, progress } => {
                    let (why, [down, up]) = ready!(Pin::new(parked).poll(cx));
                    let progress = *progress;
                    debug!(woken_by = ?why, "parked connection woken");
                    match unpark(down, up) {
                        Ok((down, up)) => this.resume(down, up, progress),
                        Err(e) => {
                            debug!(error = %e, "connection lost while unparking");
                            let moved = (progress.moved[0], progress.moved[1]);
                            this.phase = Phase::Done;
                            return Poll::Ready((Copied::Ended(End::Error(e.kind())), moved));
                        }
                    }
                }
                // Polled after it resolved: a caller's bug, but nothing to do here.
                Phase::Done => return Poll::Pending,
            }
        }
    }
}

impl CopyPhase<'_> {
    fn resume(&mut self, down: TcpStream, up: TcpStream, progress: Progress) {
        let copier = Copier::resume(Default::default(), self.limits, self.move_after, progress);
        self.phase = Phase::Copying {
            down,
            up,
            copier: Box::pin(copier),
        };
    }
}

/// A connection [`park`] did not park.
enum Unparked {
    /// The parker could not take it: the sockets, still in tokio.
    Back(TcpStream, TcpStream),
    /// A socket could not leave tokio's reactor (epoll_ctl failed). The other socket
    /// was closed with RST.
    Lost(io::Error),
}

/// Takes a connection's sockets out of tokio's reactor and parks them until one turns
/// readable or hangs up, or `deadline` falls due; counted in `tally`.
fn park(
    down: TcpStream,
    up: TcpStream,
    deadline: Option<Instant>,
    tally: &'static Tally,
) -> Result<Parked, Unparked> {
    let Some(parker) = Parker::get() else {
        return Err(Unparked::Back(down, up));
    };
    let down = down.into_std().map_err(Unparked::Lost)?;
    let up = match up.into_std() {
        Ok(up) => up,
        Err(e) => {
            let _ = socket2::SockRef::from(&down).set_linger(Some(Duration::ZERO));
            return Err(Unparked::Lost(e));
        }
    };
    match parker.park([down, up], deadline.map(Instant::into_std), tally) {
        Ok(parked) => Ok(parked),
        Err((e, [down, up])) => {
            debug!(error = %e, "connection not parked");
            let (down, up) = unpark(down, up).map_err(Unparked::Lost)?;
            Err(Unparked::Back(down, up))
        }
    }
}

/// Brings parked sockets back into tokio's reactor. On error the connection is lost and
/// the other socket is closed with RST.
fn unpark(
    down: std::net::TcpStream,
    up: std::net::TcpStream,
) -> io::Result<(TcpStream, TcpStream)> {
    // Still non-blocking: `into_std` leaves the descriptors' flags as they were.
    let down = match TcpStream::from_std(down) {
        Ok(d) => d,
        Err(e) => {
            let _ = socket2::SockRef::from(&up).set_linger(Some(Duration::ZERO));
            return Err(e);
        }
    };
    match TcpStream::from_std(up) {
        Ok(up) => Ok((down, up)),
        Err(e) => {
            abort_on_close(&down);
            Err(e)
        }
    }
}

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
    /// Nothing moved for `park_after`, neither direction holds bytes or has ended, and
    /// no waker is needed: the connection can be parked (see [`copy`]).
    Park,
}

/// What a [`Copier`] hands on to the next one when the connection is parked: its byte
/// counts and the state of its idle and lifetime checks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Progress {
    /// Bytes written downstream to upstream and upstream to downstream.
    moved: [u64; 2],
    /// When the idle check last saw bytes move.
    last_change: Instant,
    lifetime_end: Option<Instant>,
    /// Handed on from a parked connection.
    resumed: bool,
    /// Where a stall and parkings are counted.
    tally: &'static Tally,
    /// The stall watchdog counted the connection already: it is counted once.
    stalled: bool,
}

impl Progress {
    /// A connection starting now.
    pub(crate) fn start(limits: Limits, tally: &'static Tally) -> Progress {
        let now = Instant::now();
        Progress {
            moved: [0; 2],
            last_change: now,
            lifetime_end: limits.max_lifetime.map(|l| now + l),
            resumed: false,
            tally,
            stalled: false,
        }
    }

    /// When a parked connection must wake to be closed: idle for the whole timeout, or
    /// at the end of its lifetime.
    fn deadline(&self, limits: Limits) -> Option<Instant> {
        let idle = self.last_change.checked_add(limits.idle_timeout);
        match (idle, self.lifetime_end) {
            (Some(i), Some(l)) => Some(i.min(l)),
            (i, l) => i.or(l),
        }
    }
}

/// One direction's state.
#[derive(Default)]
struct Dir {
    /// Bytes read but not yet written are `buf[off..]`.
    buf: Vec<u8>,
    off: usize,
    /// `buf` is the heap read buffer (a read filled the stack buffer once).
    big: bool,
    /// The last read filled its buffer: it may have stopped inside a segment, which then
    /// sits partly read at the head of the source's queue. Such a source must not enter
    /// the SockHash: the verdict would get the segment whole, from its start, and a
    /// repeat longer than it can cut goes to userspace, which moves the socket's
    /// `copied_seq` past bytes TCP has not yet handed over (see [`Dir::poll`]).
    full: bool,
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

    /// Copies from `src` to `dst` until neither can go on now. Once this call has moved
    /// `stop_after` bytes (0: at once), stops before the next read instead, holding no
    /// bytes: checked at every read, so that a burst queued while the connection was
    /// parked does not keep it in the copy past its move.
    fn poll(
        &mut self,
        cx: &mut Context<'_>,
        src: &TcpStream,
        dst: &TcpStream,
        stop_after: u64,
        gate: Option<&Gate<'_>>,
    ) -> Poll<Result<Step, DirEnd>> {
        let start = self.moved;
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
            // Only after a read that left the source's queue empty (or found it so): no
            // segment is then partly read. A repeat the verdict cannot cut is passed to
            // userspace with a skip record, and reading it advances the socket's
            // `copied_seq` by the repeat a second time; TCP then reports nothing to read
            // (`rcv_nxt - copied_seq <= 0`) until that many new bytes arrived, and the
            // last bytes before any pause wait for a segment that may never come (a
            // client waiting for its answer stalled until the idle timeout:
            // `the_move_leaves_no_partly_read_segment_behind`).
            if self.moved - start >= stop_after && !self.full {
                return Poll::Ready(Ok(Step::Stopped));
            }
            let read = if self.big {
                if self.buf.capacity() < BUF_SIZE {
                    self.buf.reserve_exact(BUF_SIZE);
                }
                let room = self.buf.capacity();
                let read = read_buf(src, &mut self.buf, gate, self.moved);
                self.full = matches!(read, Ok(n) if n == room);
                read
            } else {
                let mut small = [0u8; SMALL_READ];
                match read(src, &mut small, gate, self.moved) {
                    Ok(n) if n > 0 => {
                        self.big = n == SMALL_READ;
                        self.full = self.big;
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
                    self.full = false;
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

/// `try_read`, except that a gated source's EOF (see [`Gate`]) only counts once the copy
/// has read every byte the verdict passed: before that it reads as "would block", and the
/// direction waits for the socket to turn readable again (the psock's enqueue wakes it).
/// `moved` is what the direction wrote so far; it holds nothing when it reads.
fn read(src: &TcpStream, buf: &mut [u8], gate: Option<&Gate<'_>>, moved: u64) -> io::Result<usize> {
    let Some(gate) = gate else {
        return src.try_read(buf);
    };
    // `try_io` clears tokio's readiness on "would block" only if no event arrived since
    // it was read, so a wake-up between this read and the clearing is not lost.
    src.try_io(Interest::READABLE, || {
        let n = io::Read::read(&mut &*socket2::SockRef::from(src), buf)?;
        gated(n, gate, moved)
    })
}

/// As [`read`], into the spare capacity of `buf` (which must have some).
fn read_buf(
    src: &TcpStream,
    buf: &mut Vec<u8>,
    gate: Option<&Gate<'_>>,
    moved: u64,
) -> io::Result<usize> {
    let Some(gate) = gate else {
        return src.try_read_buf(buf);
    };
    src.try_io(Interest::READABLE, || {
        let n = crate::sys::recv_spare(src, buf)?;
        gated(n, gate, moved)
    })
}

/// A read of `n` bytes from a gated source: EOF while the verdict has passed bytes the
/// direction has not read yet is "would block".
fn gated(n: usize, gate: &Gate<'_>, moved: u64) -> io::Result<usize> {
    if n == 0 && gate.behind(moved) {
        return Err(io::ErrorKind::WouldBlock.into());
    }
    Ok(n)
}

pin_project_lite::pin_project! {
    /// Both directions of one connection, copied with the shared connection semantics
    /// (see `drive()` in `dataplane.rs`): a FIN is passed on after every byte before it,
    /// a reset on one side aborts the other, idle and over-age connections are closed.
    /// Optionally stops once the connection carried `move_after` bytes, at a moment
    /// neither direction holds bytes (see [`Stop::Move`]).
    pub(crate) struct Copier {
        // Downstream to upstream, then upstream to downstream.
        dirs: [Dir; 2],
        // Which direction is polled first: alternates, for fairness.
        first: usize,
        move_after: u64,
        idle_timeout: Duration,
        park_after: Option<Duration>,
        // Timer cadence: the idle check's (as in `drive()`), or `park_after` if shorter.
        tick: Duration,
        lifetime_end: Option<Instant>,
        last_progress: u64,
        last_change: Instant,
        watchdog: Watchdog,
        #[pin]
        timer: Sleep,
    }
}

impl Copier {
    /// `initial` is written to upstream before anything read from downstream.
    #[cfg(test)]
    pub(crate) fn new(initial: Vec<u8>, limits: Limits, move_after: u64) -> Copier {
        Copier::resume(
            [initial, Vec::new()],
            limits,
            move_after,
            Progress::start(limits, Tally::leak(Kind::Copy)),
        )
    }

    /// Goes on from `progress`: a new connection's (with its `initial` bytes, downstream
    /// to upstream and upstream to downstream, written before anything read) or a
    /// parked one's. A parked connection's first timer fire is at once, so a deadline
    /// that woke it closes it without waiting a tick.
    pub(crate) fn resume(
        initial: [Vec<u8>; 2],
        limits: Limits,
        move_after: u64,
        progress: Progress,
    ) -> Copier {
        let now = Instant::now();
        let tick = limits.check_every();
        let tick = limits
            .park_after
            .map_or(tick, |p| tick.min(p.max(MIN_PARK_AFTER)));
        let first_fire = if progress.resumed { now } else { now + tick };
        let first_fire = progress
            .lifetime_end
            .map_or(first_fire, |end| end.min(first_fire));
        let dir = |moved, buf| Dir {
            buf,
            moved,
            ..Dir::default()
        };
        let [down_initial, up_initial] = initial;
        let mut dirs = [
            dir(progress.moved[0], down_initial),
            dir(progress.moved[1], up_initial),
        ];
        // The router read the hello from downstream and may have stopped inside a
        // segment: the copy reads downstream at least once before a move. (A parked
        // connection's last reads found both queues empty.)
        dirs[0].full = !progress.resumed;
        Copier {
            dirs,
            first: 0,
            move_after,
            idle_timeout: limits.idle_timeout,
            park_after: limits.park_after,
            tick,
            lifetime_end: progress.lifetime_end,
            last_progress: progress.moved[0] + progress.moved[1],
            last_change: progress.last_change,
            watchdog: Watchdog::resume(progress.tally, limits.stall_after, progress.stalled),
            timer: tokio::time::sleep_until(first_fire),
        }
    }

    /// Bytes written downstream to upstream (the initial bytes included) and upstream to
    /// downstream so far.
    #[cfg(test)]
    pub(crate) fn moved(&self) -> (u64, u64) {
        (self.dirs[0].moved, self.dirs[1].moved)
    }

    /// What a following [`Copier::resume`] goes on from.
    pub(crate) fn progress(&self) -> Progress {
        Progress {
            moved: [self.dirs[0].moved, self.dirs[1].moved],
            last_change: self.last_change,
            lifetime_end: self.lifetime_end,
            resumed: true,
            tally: self.watchdog.tally(),
            stalled: self.watchdog.fired(),
        }
    }
}

/// The shortest `park_after` honoured: a shorter one would run the timer more often than
/// a connection's bytes are worth.
const MIN_PARK_AFTER: Duration = Duration::from_millis(10);

impl Copier {
    /// Copies between `down` and `up` (the same sockets at every call) until neither
    /// direction can go on now, or the connection stops.
    #[cfg(test)]
    pub(crate) fn poll_copy(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        down: &TcpStream,
        up: &TcpStream,
    ) -> Poll<Stop> {
        self.poll_copy_gated(cx, down, up, None)
    }

    /// As [`Copier::poll_copy`], with a source that is in the SockHash (see [`Gate`]).
    pub(super) fn poll_copy_gated(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        down: &TcpStream,
        up: &TcpStream,
        gate: Option<&Gate<'_>>,
    ) -> Poll<Stop> {
        let mut this = self.project();
        let sockets = [(down, up), (up, down)];
        *this.first ^= 1;
        loop {
            let mut stopped = false;
            for i in [*this.first, *this.first ^ 1] {
                if this.dirs[i].done {
                    continue;
                }
                // The move needs the other direction idle, and it is not polled meanwhile.
                let stop_after = if this.dirs[i ^ 1].idle() && !this.dirs[i ^ 1].done {
                    let total = this.dirs[0].moved + this.dirs[1].moved;
                    this.move_after.saturating_sub(total)
                } else {
                    u64::MAX
                };
                let (src, dst) = sockets[i];
                let gate = gate.filter(|g| g.side == i);
                match this.dirs[i].poll(cx, src, dst, stop_after, gate) {
                    Poll::Pending => {}
                    Poll::Ready(Ok(Step::Eof)) => this.dirs[i].done = true,
                    Poll::Ready(Ok(Step::Stopped)) => stopped = true,
                    Poll::Ready(Err(e)) => return Poll::Ready(Stop::Ended(failed(i, e, down, up))),
                }
            }
            if this.dirs.iter().all(|d| d.done) {
                return Poll::Ready(Stop::Ended(End::Closed));
            }
            if due(this.dirs, *this.move_after) && this.dirs.iter().all(|d| d.idle() && !d.full) {
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
                return Poll::Ready(Stop::Ended(forced_end(End::LifetimeExceeded, down, up)));
            }
            let progress = this.dirs[0].moved + this.dirs[1].moved;
            let moved = progress != *this.last_progress;
            if moved {
                *this.last_progress = progress;
                *this.last_change = now;
            } else {
                let quiet = now.duration_since(*this.last_change);
                if quiet >= *this.idle_timeout {
                    return Poll::Ready(Stop::Ended(forced_end(End::IdleTimeout, down, up)));
                }
                // Both directions were polled above and registered their wakers: nothing
                // is buffered, nothing has ended, and (not having moved) the connection is
                // not due to move.
                if this.park_after.is_some_and(|p| quiet >= p)
                    && this.dirs.iter().all(|d| d.idle() && !d.done)
                {
                    return Poll::Ready(Stop::Park);
                }
            }
            this.watchdog.check(now.into_std(), moved, down, up, None);
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
}
