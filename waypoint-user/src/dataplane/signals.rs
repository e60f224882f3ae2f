//! Wake-ups for redirected sockets, sent by the verdict.
//!
//! A redirected connection must not wait for its sockets to turn readable: since Linux 6.4
//! the kernel wakes a redirected socket's readers after every segment the verdict handles,
//! including those it redirected away (`sk_psock_verdict_data_ready` calls the saved
//! `data_ready`). A connection in tokio's reactor would wake its worker thread once per
//! segment, about once per request and once per response, for nothing.
//!
//! So the verdict says itself when a socket has bytes for userspace: when it passes a
//! segment and userspace had read everything before, it writes a
//! [`waypoint_common::Signal`] (the socket's flow slot) into a ring buffer. One thread
//! reads the ring and wakes the task waiting on that slot ([`Signals::wait`]).
//!
//! **No lost wake-ups.** A waiting task checks the flow's counters after registering its
//! waker and at every poll, so a signal that comes before the wait starts is not needed.
//! The verdict decides "first pass" from `consumed` as it last read it, so a pass that
//! races userspace's catching up sends no signal; the direction then still refreshes its
//! credit every millisecond for a while after each catch-up (see `ebpf.rs`), and each of
//! those polls checks the counters. A full ring drops signals: the verdict counts
//! [`Stat::SignalLost`], and the thread, which reads that count every
//! [`LOSS_CHECK`], then wakes every waiting task to look for itself.
//!
//! **Ends of rewritten connections** come through a second ring
//! ([`waypoint_common::ENDS_MAP`]) whose records wake nobody: the thread reads it
//! whenever it wakes, at the latest every [`LOSS_CHECK`]. An end can wait that long (its
//! entries linger for seconds after it anyway), and a wake-up per end cost more than the
//! rest of the connection's hand-over: the program's ring raises an interrupt on the CPU
//! it runs on (a VM exit on a virtual machine), then this thread and the connection's
//! worker each take a turn, about 18 µs of a new connection's setup on one CPU.

use super::background::{Background, JOIN_WITHIN};
use std::{
    collections::HashMap,
    future::Future,
    io,
    os::fd::AsFd,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
        Arc, Mutex, MutexGuard,
    },
    task::{Context, Poll, Waker},
    time::Duration,
};

use aya::maps::{MapData, PerCpuArray, RingBuf};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use tracing::{debug, warn};
use waypoint_common::{RewriteEnd, Stat};

/// How often the thread checks whether the verdict lost signals (and notices that the
/// dataplane was dropped).
const LOSS_CHECK: Duration = Duration::from_millis(100);

/// Errors starting the signal thread.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The thread could not be spawned.
    #[error("starting the eBPF signal thread: {0}")]
    Thread(#[source] io::Error),
}

/// The tasks waiting for a signal, by flow slot, and the thread's counters.
pub(super) struct Signals {
    waiters: Mutex<HashMap<u32, Waiter>>,
    /// Set when the dataplane is dropped: the thread exits.
    stop: AtomicBool,
    /// Records read from the ring.
    received: AtomicU64,
    /// Times the thread woke every waiting task because signals were lost.
    sweeps: AtomicU64,
    /// The thread, joined by [`Signals::stop`].
    thread: Mutex<Option<Background>>,
    /// Tests stop the thread from reading the ring, to fill it.
    #[cfg(test)]
    paused: AtomicBool,
    /// Set by the thread once it honours `paused`.
    #[cfg(test)]
    idle: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section is one map operation: a panic cannot leave it half-done.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A registered slot.
enum Waiter {
    /// Registered by [`Signals::expect`], with no task to wake yet.
    Expected,
    /// A task to wake at the slot's next signal.
    Task(Waker),
    /// A rewritten connection's end came, for its task to collect ([`Rearm::Ended`]).
    Ended(RewriteEnd),
}

/// What [`Signals::rearm`] found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Rearm {
    /// Registered since the last call: no signal came.
    Quiet,
    /// A signal or a sweep took the registration, or there was none: look.
    Signalled,
    /// A rewritten connection's end, as the program reported it (the slot is no longer
    /// registered).
    Ended(RewriteEnd),
}

/// A signal for `slot`: its registration goes, and the task to wake, if it has one.
fn take(waiters: &mut HashMap<u32, Waiter>, slot: u32) -> Option<Waker> {
    match waiters.remove(&slot)? {
        Waiter::Task(w) => Some(w),
        // Not for a SockHash slot; kept for its task.
        Waiter::Ended(end) => {
            waiters.insert(slot, Waiter::Ended(end));
            None
        }
        Waiter::Expected => None,
    }
}

/// A rewritten connection's end: kept in its registration for its task, which is woken.
/// Nothing if the slot is not registered (the connection is gone, or already ended).
fn ended(waiters: &mut HashMap<u32, Waiter>, end: RewriteEnd) -> Option<Waker> {
    let waiter = waiters.get_mut(&end.slot)?;
    match std::mem::replace(waiter, Waiter::Ended(end)) {
        Waiter::Task(w) => Some(w),
        Waiter::Expected => None,
        // The first end counts (a reset after both FINs is not news).
        first @ Waiter::Ended(_) => {
            *waiter = first;
            None
        }
    }
}

/// Parses a record of the ENDS ring.
fn parse_end(record: &[u8]) -> Option<RewriteEnd> {
    let u32_at = |i: usize| Some(u32::from_ne_bytes(record.get(i..i + 4)?.try_into().ok()?));
    let u64_at = |i: usize| Some(u64::from_ne_bytes(record.get(i..i + 8)?.try_into().ok()?));
    Some(RewriteEnd {
        slot: u32_at(0)?,
        how: u32_at(4)?,
        client_bytes: u64_at(8)?,
        pod_bytes: u64_at(16)?,
    })
}

impl Signals {
    /// Starts the thread that reads `ring` and, if given, the ring of rewritten
    /// connections' ends `ends`; `stats` is a handle on the verdict's statistics, for
    /// [`Stat::SignalLost`].
    pub fn start(
        ring: RingBuf<MapData>,
        ends: Option<RingBuf<MapData>>,
        stats: PerCpuArray<MapData, u64>,
    ) -> Result<Arc<Signals>, Error> {
        let signals = Arc::new(Signals {
            waiters: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            received: AtomicU64::new(0),
            sweeps: AtomicU64::new(0),
            thread: Mutex::new(None),
            #[cfg(test)]
            paused: AtomicBool::new(false),
            #[cfg(test)]
            idle: AtomicBool::new(false),
        });
        let s = signals.clone();
        let thread = Background::spawn("waypoint-signals", move || s.run(ring, ends, stats))
            .map_err(Error::Thread)?;
        *lock(&signals.thread) = Some(thread);
        Ok(signals)
    }

    /// Makes the thread exit (within [`LOSS_CHECK`]) and joins it.
    pub fn stop(&self) {
        self.stop.store(true, Relaxed);
        let thread = lock(&self.thread).take();
        if let Some(mut t) = thread {
            t.join(JOIN_WITHIN);
        }
    }

    /// Stops the thread from reading the ring, or lets it go on. Returns once the thread
    /// honours a pause (it may be in a wait of up to [`LOSS_CHECK`]).
    #[cfg(test)]
    pub fn pause(&self, paused: bool) {
        self.paused.store(paused, Relaxed);
        while paused && !self.idle.load(Relaxed) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Tasks waiting for a signal now.
    #[cfg(test)]
    pub fn waiting(&self) -> usize {
        lock(&self.waiters).len()
    }

    /// Records read from the ring so far.
    pub fn received(&self) -> u64 {
        self.received.load(Relaxed)
    }

    /// Times every waiting task was woken because signals were lost.
    pub fn sweeps(&self) -> u64 {
        self.sweeps.load(Relaxed)
    }

    fn run(
        &self,
        mut ring: RingBuf<MapData>,
        mut ends: Option<RingBuf<MapData>>,
        stats: PerCpuArray<MapData, u64>,
    ) {
        let lost = || -> u64 {
            stats
                .get(&(Stat::SignalLost as u32), 0)
                .map(|v| v.iter().sum())
                .unwrap_or(0)
        };
        let mut lost_seen = lost();
        let timeout = PollTimeout::try_from(LOSS_CHECK).unwrap_or(PollTimeout::NONE);
        let mut wakers = Vec::new();
        while !self.stop.load(Relaxed) {
            #[cfg(test)]
            {
                let paused = self.paused.load(Relaxed);
                self.idle.store(paused, Relaxed);
                if paused {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
            }
            let mut fds = [PollFd::new(ring.as_fd(), PollFlags::POLLIN)];
            let mut sweep = false;
            match poll(&mut fds, timeout) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    // Cannot wait for records: wake every waiting task at the check's pace
                    // instead, so that none hangs.
                    warn!(error = %e, "polling the eBPF signal ring failed");
                    std::thread::sleep(LOSS_CHECK);
                    sweep = true;
                }
            }
            {
                let mut waiters = lock(&self.waiters);
                while let Some(record) = ring.next() {
                    self.received.fetch_add(1, Relaxed);
                    let Some(slot) = record.get(..4).and_then(|b| b.try_into().ok()) else {
                        continue;
                    };
                    wakers.extend(take(&mut waiters, u32::from_ne_bytes(slot)));
                }
                while let Some(record) = ends.as_mut().and_then(RingBuf::next) {
                    self.received.fetch_add(1, Relaxed);
                    if let Some(end) = parse_end(&record) {
                        wakers.extend(ended(&mut waiters, end));
                    }
                }
            }
            let now_lost = lost();
            if now_lost != lost_seen {
                lost_seen = now_lost;
                debug!(
                    lost = now_lost,
                    "signals lost: waking every waiting connection"
                );
                sweep = true;
            }
            if sweep {
                self.sweeps.fetch_add(1, Relaxed);
                self.take_waiting(&mut wakers);
            }
            // Outside the lock: a woken task may register again at once.
            wakers.drain(..).for_each(Waker::wake);
        }
    }

    /// Wakes every task waiting for a signal, as after a lost one: each looks for
    /// itself (and registers again).
    pub fn wake_all(&self) {
        let mut wakers = Vec::new();
        self.take_waiting(&mut wakers);
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Takes every registration but the ends waiting for their tasks, the tasks' wakers
    /// into `wakers` (to be woken outside the lock: a woken task may register again at
    /// once).
    fn take_waiting(&self, wakers: &mut Vec<Waker>) {
        lock(&self.waiters).retain(|_, w| match std::mem::replace(w, Waiter::Expected) {
            Waiter::Task(t) => {
                wakers.push(t);
                false
            }
            Waiter::Expected => false,
            end @ Waiter::Ended(_) => {
                *w = end;
                true
            }
        });
    }

    /// Has `waker` woken at slot `slot`'s next signals, until [`Signals::unregister`].
    /// The caller checks its condition after this call, so that a signal sent between
    /// the check and the registration cannot be missed.
    pub fn register(&self, slot: u32, waker: &Waker) {
        self.rearm(slot, waker);
    }

    /// Registers `slot` with no task to wake, so that a later [`Signals::rearm`] tells
    /// whether a signal came in between: for a slot that can be signalled before its
    /// task is ready to wait, and that task would only be woken for nothing.
    pub fn expect(&self, slot: u32) {
        lock(&self.waiters).insert(slot, Waiter::Expected);
    }

    /// [`Signals::register`], and what came since the last call: nothing
    /// ([`Rearm::Quiet`]), a signal or a sweep, or no registration at all
    /// ([`Rearm::Signalled`]), or a rewritten connection's end ([`Rearm::Ended`], the
    /// slot then left unregistered). A task that registered (or was
    /// [`Signals::expect`]ed) before its slot could be signalled looks at its state only
    /// when this says so, instead of at every poll.
    pub fn rearm(&self, slot: u32, waker: &Waker) -> Rearm {
        let mut waiters = lock(&self.waiters);
        match waiters.get_mut(&slot) {
            Some(Waiter::Task(w)) => {
                if !w.will_wake(waker) {
                    w.clone_from(waker);
                }
                Rearm::Quiet
            }
            Some(w @ Waiter::Expected) => {
                *w = Waiter::Task(waker.clone());
                Rearm::Quiet
            }
            Some(Waiter::Ended(end)) => {
                let end = *end;
                waiters.remove(&slot);
                Rearm::Ended(end)
            }
            None => {
                waiters.insert(slot, Waiter::Task(waker.clone()));
                Rearm::Signalled
            }
        }
    }

    /// Undoes [`Signals::register`].
    pub fn unregister(&self, slot: u32) {
        lock(&self.waiters).remove(&slot);
    }

    /// Resolves once `ready` returns true: checked at every poll, after the task's waker
    /// is registered for slot `slot`'s signals. `ready` must turn true before the signal
    /// is sent (the verdict counts a passed segment before it signals).
    pub fn wait<F: Fn() -> bool>(&self, slot: u32, ready: F) -> Wait<'_, F> {
        Wait {
            signals: self,
            slot,
            ready,
            registered: false,
        }
    }
}

/// See [`Signals::wait`]. Unregisters on drop.
pub(super) struct Wait<'a, F> {
    signals: &'a Signals,
    slot: u32,
    ready: F,
    registered: bool,
}

impl<F> Wait<'_, F> {
    fn unregister(&mut self) {
        if std::mem::take(&mut self.registered) {
            self.signals.unregister(self.slot);
        }
    }
}

impl<F: Fn() -> bool + Unpin> Future for Wait<'_, F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        this.signals.register(this.slot, cx.waker());
        this.registered = true;
        if (this.ready)() {
            this.unregister();
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

impl<F> Drop for Wait<'_, F> {
    fn drop(&mut self) {
        self.unregister();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signals() -> Signals {
        Signals {
            waiters: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            received: AtomicU64::new(0),
            sweeps: AtomicU64::new(0),
            thread: Mutex::new(None),
            paused: AtomicBool::new(false),
            idle: AtomicBool::new(false),
        }
    }

    #[test]
    fn rearm_tells_whether_a_signal_came_since() {
        let s = signals();
        let waker = Waker::noop();
        // Expected before it can be signalled: no signal yet, and none to wake.
        s.expect(7);
        assert_eq!(s.rearm(7, waker), Rearm::Quiet, "no signal came");
        assert_eq!(s.rearm(7, waker), Rearm::Quiet);
        assert!(
            take(&mut lock(&s.waiters), 7).is_some(),
            "the task is not woken"
        );
        assert_eq!(s.rearm(7, waker), Rearm::Signalled, "a signal came");
        // Signalled while only expected: nobody to wake, and the next rearm knows.
        s.expect(8);
        assert!(take(&mut lock(&s.waiters), 8).is_none());
        assert_eq!(s.rearm(8, waker), Rearm::Signalled);
        // Never registered: as if signalled.
        assert_eq!(s.rearm(9, waker), Rearm::Signalled);
        s.unregister(9);
        assert_eq!(s.waiting(), 2);
    }

    #[test]
    fn an_end_is_kept_for_its_task_once() {
        let s = signals();
        let waker = Waker::noop();
        let end = |how| RewriteEnd {
            slot: 5,
            how,
            client_bytes: 10,
            pod_bytes: 20,
        };
        // Not registered: dropped, nothing kept.
        assert!(ended(&mut lock(&s.waiters), end(1)).is_none());
        assert_eq!(s.waiting(), 0);
        // Expected: kept, nobody to wake; the first end counts, not a later one.
        s.expect(5);
        assert!(ended(&mut lock(&s.waiters), end(1)).is_none());
        assert!(ended(&mut lock(&s.waiters), end(3)).is_none());
        // A SockHash-style signal for the slot leaves it too.
        assert!(take(&mut lock(&s.waiters), 5).is_none());
        assert_eq!(s.rearm(5, waker), Rearm::Ended(end(1)));
        assert_eq!(s.waiting(), 0, "collected once, the slot is unregistered");
        // Waiting: its task is woken.
        s.register(5, waker);
        assert!(ended(&mut lock(&s.waiters), end(2)).is_some());
        assert_eq!(s.rearm(5, waker), Rearm::Ended(end(2)));
        // Parsed from a ring record as the program lays it out.
        let mut record = Vec::new();
        record.extend(5u32.to_ne_bytes());
        record.extend(2u32.to_ne_bytes());
        record.extend(10u64.to_ne_bytes());
        record.extend(20u64.to_ne_bytes());
        assert_eq!(parse_end(&record), Some(end(2)));
        assert_eq!(parse_end(&record[..20]), None);
    }
}
