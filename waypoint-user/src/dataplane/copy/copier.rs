//! The [`Copier`]: both directions of a copied connection and its timer as one
//! hand-written state machine, and why it stops (the end, the move, parking).

use std::{
    future::Future,
    io,
    pin::Pin,
    task::{ready, Context, Poll},
    time::Duration,
};

use tokio::{
    io::Interest,
    net::TcpStream,
    time::{Instant, Sleep},
};

use super::{Gate, BUF_SIZE, SMALL_READ};
#[cfg(test)]
use crate::dataplane::Kind;
use crate::dataplane::{
    abort_on_close, classify_read_error, classify_write_error, forced_end, shutdown_write,
    stall::Watchdog, tally::Tally, DirEnd, End, Limits,
};

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
    pub(super) moved: [u64; 2],
    /// When the idle check last saw bytes move.
    last_change: Instant,
    lifetime_end: Option<Instant>,
    /// Handed on from a parked connection.
    resumed: bool,
    /// Where a stall and parkings are counted.
    pub(super) tally: &'static Tally,
    /// The stall watchdog counted the connection already: it is counted once.
    pub(super) stalled: bool,
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
    pub(super) fn deadline(&self, limits: Limits) -> Option<Instant> {
        let idle = self.last_change.checked_add(limits.idle_timeout);
        match (idle, self.lifetime_end) {
            (Some(i), Some(l)) => Some(i.min(l)),
            (i, l) => i.or(l),
        }
    }
}

/// One direction's state.
#[derive(Default)]
pub(super) struct Dir {
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
    pub(super) full: bool,
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
    pub(super) fn idle(&self) -> bool {
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
        pub(super) dirs: [Dir; 2],
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
