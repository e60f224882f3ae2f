//! The portable dataplane: a userspace read/write copy per direction.
//!
//! Slowest of the three, but needs nothing from the kernel beyond TCP. It is also the
//! reference the other dataplanes are tested against, and the eBPF dataplane's first
//! phase (`--move-after`).
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
use tokio::{net::TcpStream, time::Instant};
use tracing::debug;

use super::{
    abort_on_close,
    flows::FlowCell,
    park::{Parked, Parker},
    tally::Tally,
    End, Kind, Limits, Outcome,
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

mod copier;
#[cfg(test)]
mod tests;

pub(crate) use copier::{Copier, Progress, Stop};
