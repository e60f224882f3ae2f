//! A connection rewritten, after its hand-over: [`Rewritten`] waits for the
//! program's report of its end (or its idle timeout or lifetime), then lets its entries
//! linger ([`Lingering`]) for the last ACK and any resent FIN.

use std::{
    future::Future,
    os::fd::{AsRawFd, OwnedFd},
    pin::Pin,
    sync::atomic::Ordering::Relaxed,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use tracing::debug;
use waypoint_common::{RewriteEnd, END_CLIENT_RST, END_CLOSED, END_GONE, END_POD_RST};

use crate::dataplane::signals::Rearm;
use crate::dataplane::{End, Limits, Outcome};

use super::*;

/// What the hand-over leaves of a rewritten connection: all [`Rewritten`] needs.
pub(in crate::dataplane) struct HandedOver {
    pub(super) addrs: Addrs,
    pub(super) slot: u32,
    /// B, kept for its 4-tuple (and, until the pod acknowledges it, to resend the hello).
    pub(super) upstream: OwnedFd,
    /// B is in repair mode: the pod acknowledged all it sent (see [`silence`]).
    pub(super) silent: bool,
    /// The hello's length and what was read behind it: the daemon sent them itself.
    pub(super) initial_len: u64,
    /// Bytes B carried for the client at the hand-over (see `Rewriter::fill`). The
    /// client's entry counts them too once the client sends more (its count runs from
    /// the end of the hello), not otherwise.
    pub(super) carried: u32,
    /// When the hand-over started, for the lifetime.
    pub(super) start: Instant,
    /// B carried bytes that landed in A, and the fill map may hold an element for them
    /// (see `Rewriter::fill`).
    pub(super) filled: bool,
    /// B sent the client's FIN: the program may have missed the end (the pod's FIN came
    /// before the client's entry said FIN), so the first poll looks at the entries.
    pub(super) look: bool,
}

pin_project_lite::pin_project! {
    /// The rewritten phase: waits for the connection's end (a signal from the program, the
    /// idle timeout, the lifetime) and returns the outcome, leaving the entries of an end
    /// that came by itself to linger ([`Rewriter::sweep`]).
    ///
    /// Hand-written, and all of a rewritten connection's state in the daemon (about 250
    /// bytes, inline in the connection's task): an `async fn` would hold the hand-over's
    /// state beside it. Dropped before its end (the drain deadline), it ends the
    /// connection: entries out, both ends reset.
    pub(in crate::dataplane) struct Rewritten {
        #[pin]
        timer: tokio::time::Sleep,
        conn: Conn,
    }
}

/// [`Rewritten`] without its timer.
pub(super) struct Conn {
    pub(super) rewriter: Arc<Rewriter>,
    pub(super) addrs: Addrs,
    pub(super) slot: u32,
    /// B; None once handed to the linger ([`Lingering`]).
    pub(super) upstream: Option<OwnedFd>,
    pub(super) initial_len: u64,
    /// See [`HandedOver::carried`].
    pub(super) carried: u32,
    /// See [`HandedOver::filled`].
    pub(super) filled: bool,
    pub(super) idle_timeout: Duration,
    /// When the lifetime ends, if it does.
    pub(super) lifetime_end: Option<Instant>,
    /// When the idle timeout (or the lifetime) is looked at next.
    pub(super) due: Instant,
    /// B is in repair mode ([`silence`]); until it is, the timer also wakes the task
    /// every [`SILENCE_CHECK`] to try again. While B is here and not silent, the
    /// connection counts in [`Counts::unacknowledged`].
    pub(super) silent: bool,
    pub(super) phase: Phase,
}

/// How often a rewritten connection whose B still waits for the pod's acknowledgement
/// tries to put B into repair mode ([`silence`]). The pod acknowledges the hello with its
/// first pure ACK, at the latest when B resends the hello (an RTO, 200 ms at least).
pub(super) const SILENCE_CHECK: Duration = Duration::from_millis(100);

/// Where a rewritten connection is in its life. One enum rather than a field per phase:
/// it sizes every rewritten connection's task.
#[derive(Clone, Copy)]
pub(super) enum Phase {
    /// Going on.
    Live {
        /// Packets rewritten at the last timer, both directions.
        seen: u64,
        /// Registered for the slot's signals.
        registered: bool,
        /// Look at the entries at the next poll, signal or not.
        look: bool,
    },
    /// The outcome returned; the entries gone, or lingering ([`Rewriter::sweep`]).
    Done,
}

impl Rewritten {
    /// `rewriter` must be the one that handed the connection over.
    pub fn new(rewriter: Arc<Rewriter>, handed: HandedOver, limits: Limits) -> Rewritten {
        let HandedOver {
            addrs,
            slot,
            upstream,
            silent,
            initial_len,
            carried,
            start,
            filled,
            look,
        } = handed;
        let now = Instant::now();
        let lifetime_end = limits.max_lifetime.map(|l| start + l);
        let mut conn = Conn {
            rewriter,
            addrs,
            slot,
            upstream: Some(upstream),
            initial_len,
            carried,
            filled,
            idle_timeout: limits.idle_timeout,
            lifetime_end,
            due: now,
            silent,
            // Registered by the hand-over, before the entries went in; no packet was
            // rewritten before them.
            phase: Phase::Live {
                seen: 0,
                registered: true,
                look,
            },
        };
        conn.due = conn.deadline(now);
        if !silent {
            conn.rewriter.unacknowledged.fetch_add(1, Relaxed);
        }
        Rewritten {
            timer: tokio::time::sleep_until(conn.wake(now).into()),
            conn,
        }
    }
}

impl Conn {
    /// When to look at the connection next: the idle timeout from `now`, or the end of
    /// its lifetime if sooner.
    pub(super) fn deadline(&self, now: Instant) -> Instant {
        let idle = now + self.idle_timeout;
        self.lifetime_end.map_or(idle, |l| l.min(idle))
    }

    /// When the timer wakes the task next: at [`Conn::due`], or sooner while B is not
    /// silent yet.
    pub(super) fn wake(&self, now: Instant) -> Instant {
        if self.silent {
            self.due
        } else {
            self.due.min(now + SILENCE_CHECK)
        }
    }

    /// Tries again to put B into repair mode ([`silence`]).
    pub(super) fn silence(&mut self) {
        if let (false, Some(b)) = (self.silent, &self.upstream) {
            self.silent = silence(b);
            if self.silent {
                self.rewriter.unacknowledged.fetch_sub(1, Relaxed);
            }
        }
    }

    /// Takes B out of the connection (to the linger), and out of
    /// [`Counts::unacknowledged`]: the connection has ended.
    fn take_upstream(&mut self) -> Option<OwnedFd> {
        let b = self.upstream.take();
        if b.is_some() && !self.silent {
            self.rewriter.unacknowledged.fetch_sub(1, Relaxed);
        }
        b
    }

    pub(super) fn unregister(&mut self) {
        if let Phase::Live { registered, .. } = &mut self.phase {
            if std::mem::take(registered) {
                self.rewriter.signals.unregister(self.slot);
            }
        }
    }

    /// The outcome of a connection that ended by itself (`bytes` from its end: final,
    /// nothing follows a reset or the second FIN). Its entries and B go to the linger.
    pub(super) fn ended(&mut self, end: End, bytes: (u64, u64)) -> Outcome {
        self.unregister();
        if let Some(upstream) = self.take_upstream() {
            let mut queue = lock(&self.rewriter.lingering);
            // Read under the lock: the queue stays in order of `due` whichever worker
            // pushes.
            queue.push_back(Lingering {
                due: Instant::now() + LINGER,
                entries: self.addrs.entries(),
                slot: self.slot,
                upstream,
                filled: self.filled,
            });
        }
        self.done(end, bytes)
    }

    /// The outcome of an end the daemon decided: the entries go at once and both ends
    /// get a reset.
    pub(super) fn aborted(&mut self, end: End) -> Outcome {
        self.unregister();
        let entries = self.addrs.entries();
        let bytes = self.rewriter.abort(&self.addrs, &entries, self.slot, None);
        if self.filled {
            self.rewriter.forget_fill(&entries);
        }
        // B closes (silently) when the task drops.
        self.done(end, bytes)
    }

    /// The outcome of a connection left to the next daemon ([`Rewriter::leave`]): its
    /// entries stay, its B goes aside for the adopter.
    fn left(&mut self) -> Outcome {
        self.unregister();
        let bytes = self.rewriter.state(&self.addrs.entries()).bytes;
        self.silence();
        if let Some(b) = self.take_upstream() {
            lock(&self.rewriter.left).push((self.slot, b));
        }
        self.done(End::HandedOver, bytes)
    }

    pub(super) fn done(&mut self, end: End, (d2u, u2d): (u64, u64)) -> Outcome {
        self.phase = Phase::Done;
        Outcome {
            downstream_to_upstream: self.initial_len + d2u.max(u64::from(self.carried)),
            upstream_to_downstream: u2d,
            end,
        }
    }
}

impl Future for Rewritten {
    type Output = Outcome;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Outcome> {
        let mut this = self.project();
        let c = this.conn;
        loop {
            let (seen, registered, look) = match c.phase {
                // Polled after its end: nothing more to say.
                Phase::Done => return Poll::Pending,
                Phase::Live {
                    seen,
                    registered,
                    look,
                } => (seen, registered, look),
            };
            if c.rewriter.leaving.load(Relaxed) {
                return Poll::Ready(c.left());
            }
            let rearm = c.rewriter.signals.rearm(c.slot, cx.waker());
            if let Rearm::Ended(e) = rearm {
                // As the program saw it: no look at the entries. `rearm` unregistered
                // the slot.
                if let Some((end, bytes)) = reported(&e) {
                    return Poll::Ready(c.ended(end, bytes));
                }
            }
            // Still registered since the last look: no signal came, and the entries
            // need no look (two system calls) unless the timer fired.
            let quiet = rearm == Rearm::Quiet && registered && !look;
            c.phase = Phase::Live {
                seen,
                registered: true,
                look: false,
            };
            let timer = this.timer.as_mut().poll(cx).is_ready();
            if quiet && !timer {
                return Poll::Pending;
            }
            // After the registration: a signal sent from here on wakes this task.
            let state = c.rewriter.state(&c.addrs.entries());
            if let Some(end) = state.end {
                return Poll::Ready(c.ended(end, state.bytes));
            }
            if !timer {
                return Poll::Pending;
            }
            let now = Instant::now();
            if now < c.due {
                // Woken early, to silence B.
                c.silence();
                this.timer.as_mut().reset(c.wake(now).into());
                continue;
            }
            if c.lifetime_end.is_some_and(|l| now >= l) {
                return Poll::Ready(c.aborted(End::LifetimeExceeded));
            }
            // `state` was read after the timer fired.
            if state.packets == seen {
                return Poll::Ready(c.aborted(End::IdleTimeout));
            }
            c.phase = Phase::Live {
                seen: state.packets,
                registered: true,
                look: false,
            };
            c.due = c.deadline(now);
            c.silence();
            this.timer.as_mut().reset(c.wake(now).into());
        }
    }
}

/// How a connection ended and the bytes each direction carried, from the program's
/// record; None for a record this build does not know (the entries tell then).
pub(super) fn reported(e: &RewriteEnd) -> Option<(End, (u64, u64))> {
    let end = match e.how {
        END_CLOSED => End::Closed,
        END_CLIENT_RST => End::DownstreamReset,
        END_POD_RST => End::UpstreamReset,
        // As `Rewriter::state` says of entries the program removed.
        END_GONE => return Some((End::DownstreamReset, (0, 0))),
        _ => return None,
    };
    Some((end, (e.client_bytes, e.pod_bytes)))
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Counted since its hand-over began (`Rewriter::hand_over`).
        self.rewriter
            .tasks
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        if let Phase::Live { .. } = self.phase {
            self.unregister();
            debug!(client = %self.addrs.client, "rewritten connection ended by the daemon: both ends reset");
            let entries = self.addrs.entries();
            self.rewriter.abort(&self.addrs, &entries, self.slot, None);
            if self.filled {
                self.rewriter.forget_fill(&entries);
            }
        }
        // Silent: the pod learnt of the end from the client, or from its reset.
        if let Some(b) = self.take_upstream() {
            let _ = set_repair(b.as_raw_fd(), 1);
        }
    }
}
