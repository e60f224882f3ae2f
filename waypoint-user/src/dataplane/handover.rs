//! Handing a connection from the userspace copy over to the kernel once it has carried
//! enough bytes (`--splice-after`).
//!
//! Putting a socket into the SockHash costs a psock, its destruction on a kworker, and
//! map updates: about 20 µs per connection on loopback, more than a short connection
//! gains from the kernel path. So the eBPF dataplane can start every connection in the
//! copy pumps ([`super::copy`]) and move it into the SockHash once both directions
//! together have carried `threshold` bytes.
//!
//! The move is only safe while neither pump holds bytes it has read but not written:
//! those would be lost, or overtaken by the kernel. A pump holds no bytes while it waits
//! for its source to turn readable. So a pump that finds the threshold reached, at a
//! moment the other pump is waiting for its source, *parks* (stops reading for good) and
//! wakes the other, which parks in turn before it reads anything more. Once both are
//! parked the caller drops them and inserts the sockets. A pump never waits for the other
//! while the other holds bytes: the other may be blocked writing to a peer that only
//! reads once its own writes go through, and parking would then deadlock the connection.
//! If the moment never comes, the connection just stays in the copy.

use std::{
    io,
    pin::pin,
    sync::atomic::{
        AtomicBool, AtomicU64, AtomicU8,
        Ordering::{Relaxed, SeqCst},
    },
};

use tokio::{net::TcpStream, sync::Notify};

/// Copying; parking once the threshold is reached.
const OPEN: u8 = 0;
/// A pump parked: the other parks at its next chance.
const PARKING: u8 = 1;
/// A direction ended (EOF): a half-closed connection is not moved.
const OFF: u8 = 2;

/// Which pump: the downstream's (reading the client) or the upstream's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// Reads downstream, writes upstream.
    Down = 0,
    /// Reads upstream, writes downstream.
    Up = 1,
}

impl Side {
    fn other(self) -> Side {
        match self {
            Side::Down => Side::Up,
            Side::Up => Side::Down,
        }
    }
}

/// The state the two pumps of one connection share (one task polls both; atomics only
/// because the connection's future must be `Send`).
#[derive(Debug)]
pub(crate) struct Handover {
    threshold: u64,
    moved: AtomicU64,
    state: AtomicU8,
    /// Pump `i` is waiting for its source to turn readable: it holds no bytes.
    waiting: [AtomicBool; 2],
    parked: AtomicU8,
    notify: Notify,
}

impl Handover {
    pub(crate) fn new(threshold: u64) -> Handover {
        Handover {
            threshold,
            moved: AtomicU64::new(0),
            state: AtomicU8::new(OPEN),
            waiting: [AtomicBool::new(false), AtomicBool::new(false)],
            parked: AtomicU8::new(0),
            notify: Notify::new(),
        }
    }

    /// A pump wrote `n` bytes.
    pub(crate) fn moved(&self, n: usize) {
        self.moved.fetch_add(n as u64, Relaxed);
    }

    /// A direction ended: the connection stays in the copy.
    pub(crate) fn off(&self) {
        self.state.store(OFF, SeqCst);
    }

    /// Called by a pump holding no bytes: parks it (never to return) if the connection
    /// is to be moved now.
    pub(crate) async fn rest(&self, side: Side) {
        let park = match self.state.load(SeqCst) {
            PARKING => true,
            OPEN => {
                let due = self.moved.load(Relaxed) >= self.threshold
                    && self.waiting[side.other() as usize].load(SeqCst);
                if due {
                    self.state.store(PARKING, SeqCst);
                    // Wakes the other pump out of its wait for its source.
                    self.notify.notify_waiters();
                }
                due
            }
            _ => false,
        };
        if park {
            self.parked.fetch_add(1, SeqCst);
            // Wakes `both_parked`.
            self.notify.notify_waiters();
            std::future::pending::<()>().await;
        }
    }

    /// Marks pump `side` as waiting for its source (holding no bytes) until the returned
    /// guard drops.
    pub(crate) fn waiting(&self, side: Side) -> Waiting<'_> {
        let flag = &self.waiting[side as usize];
        flag.store(true, SeqCst);
        Waiting(flag)
    }

    /// Resolves once a pump parked: a pump waiting for its source races this (first)
    /// against readability, so that it parks before it reads anything more.
    pub(crate) async fn parking(&self) {
        loop {
            let mut notified = pin!(self.notify.notified());
            notified.as_mut().enable();
            if self.state.load(SeqCst) == PARKING {
                return;
            }
            notified.await;
        }
    }

    /// Resolves once both pumps are parked: they hold no bytes and can be dropped.
    pub(crate) async fn both_parked(&self) {
        loop {
            let mut notified = pin!(self.notify.notified());
            notified.as_mut().enable();
            if self.parked.load(SeqCst) == 2 {
                return;
            }
            notified.await;
        }
    }
}

/// A pump's gate (see [`super::copy::Gate`]) on its connection's handover.
pub(crate) struct Gate<'a> {
    pub(crate) handover: &'a Handover,
    pub(crate) side: Side,
}

impl super::copy::Gate for Gate<'_> {
    async fn wait(&self, src: &TcpStream) -> Option<io::Result<()>> {
        let h = self.handover;
        h.rest(self.side).await;
        let _waiting = h.waiting(self.side);
        // The parking check first: once the other pump parked, nothing more is read.
        tokio::select! {
            biased;
            () = h.parking() => None,
            r = src.readable() => Some(r),
        }
    }

    fn moved(&self, n: usize) {
        self.handover.moved(n);
    }

    fn ended(&self) {
        self.handover.off();
    }
}

/// See [`Handover::waiting`].
pub(crate) struct Waiting<'a>(&'a AtomicBool);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.store(false, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

    use std::{future::Future, pin::pin, task::Poll};

    use super::*;

    /// What a pump does while it waits for its source; None: it is to park.
    async fn wait_source<F: Future>(h: &Handover, side: Side, readable: F) -> Option<F::Output> {
        let _waiting = h.waiting(side);
        tokio::select! {
            biased;
            () = h.parking() => None,
            r = readable => Some(r),
        }
    }

    /// Polls `f` once.
    fn poll_once<F: Future>(f: std::pin::Pin<&mut F>) -> Poll<F::Output> {
        let waker = std::task::Waker::noop();
        f.poll(&mut std::task::Context::from_waker(waker))
    }

    #[test]
    fn below_the_threshold_nobody_parks() {
        let h = Handover::new(100);
        h.moved(99);
        let mut up_wait = pin!(wait_source(&h, Side::Up, std::future::pending::<()>()));
        assert!(poll_once(up_wait.as_mut()).is_pending());
        let mut rest = pin!(h.rest(Side::Down));
        assert!(poll_once(rest.as_mut()).is_ready(), "below the threshold");
    }

    #[test]
    fn parks_only_while_the_other_pump_waits_for_its_source() {
        let h = Handover::new(100);
        h.moved(100);
        // The other pump is busy writing (not waiting): no parking.
        let mut rest = pin!(h.rest(Side::Down));
        assert!(poll_once(rest.as_mut()).is_ready());

        // Now it waits for its source: the first pump parks, the other is woken and
        // parks before reading, and both_parked resolves.
        let mut up_wait = pin!(wait_source(&h, Side::Up, std::future::pending::<()>()));
        assert!(poll_once(up_wait.as_mut()).is_pending());
        let mut down_rest = pin!(h.rest(Side::Down));
        assert!(
            poll_once(down_rest.as_mut()).is_pending(),
            "parked for good"
        );
        let mut all = pin!(h.both_parked());
        assert!(poll_once(all.as_mut()).is_pending());
        assert_eq!(poll_once(up_wait.as_mut()), Poll::Ready(None));
        let mut up_rest = pin!(h.rest(Side::Up));
        assert!(poll_once(up_rest.as_mut()).is_pending());
        assert!(poll_once(all.as_mut()).is_ready());
    }

    #[test]
    fn a_pump_arriving_after_the_other_parked_does_not_read() {
        let h = Handover::new(10);
        h.moved(10);
        let mut up_wait = pin!(wait_source(&h, Side::Up, std::future::pending::<()>()));
        assert!(poll_once(up_wait.as_mut()).is_pending());
        let mut down_rest = pin!(h.rest(Side::Down));
        assert!(poll_once(down_rest.as_mut()).is_pending());
        // A fresh wait (the source would be readable at once) must not read.
        let mut again = pin!(wait_source(&h, Side::Up, std::future::ready(())));
        assert_eq!(poll_once(again.as_mut()), Poll::Ready(None));
    }

    #[test]
    fn no_parking_after_a_direction_ended() {
        let h = Handover::new(10);
        h.moved(10);
        h.off();
        let mut up_wait = pin!(wait_source(&h, Side::Up, std::future::pending::<()>()));
        assert!(poll_once(up_wait.as_mut()).is_pending());
        let mut rest = pin!(h.rest(Side::Down));
        assert!(poll_once(rest.as_mut()).is_ready());
    }
}
