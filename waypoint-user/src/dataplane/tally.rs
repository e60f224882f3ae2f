//! What one dataplane counts of its connections besides how they end: the connections
//! its stall watchdog caught (see [`super::stall`]), the kernel backlogs it woke (see
//! [`crate::sys::wake_writer`]) and its idle connections parked (see [`super::park`]). Each [`super::Dataplane`] has its own, so two in one process (as in
//! a test binary) count apart.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

use super::{Kind, Parking};

/// One dataplane's counts. Shared by reference with every connection it carries (their
/// copy phases, watchdogs and parked slots).
#[derive(Debug)]
pub(crate) struct Tally {
    /// Which dataplane counts here (the eBPF dataplane's copy phase and fallback count
    /// as `ebpf`).
    kind: Kind,
    stalls: AtomicU64,
    wakeups: AtomicU64,
    parked: AtomicUsize,
    parks: AtomicU64,
    park_failures: AtomicU64,
}

impl Tally {
    /// A tally for a new dataplane of `kind`, kept for the rest of the process.
    ///
    /// Leaked on purpose: a process builds one dataplane (a test binary a few dozen), and
    /// a `&'static` keeps each connection's copy progress `Copy` and 8 bytes, with no
    /// reference count to touch as a connection parks and wakes.
    pub(crate) fn leak(kind: Kind) -> &'static Tally {
        Box::leak(Box::new(Tally {
            kind,
            stalls: AtomicU64::new(0),
            wakeups: AtomicU64::new(0),
            parked: AtomicUsize::new(0),
            parks: AtomicU64::new(0),
            park_failures: AtomicU64::new(0),
        }))
    }

    /// The dataplane counted here.
    pub(crate) fn kind(&self) -> Kind {
        self.kind
    }

    /// A connection was caught stalled (once per connection).
    pub(crate) fn stalled(&self) {
        self.stalls.fetch_add(1, Relaxed);
    }

    /// Connections caught stalled so far.
    pub(crate) fn stalls(&self) -> u64 {
        self.stalls.load(Relaxed)
    }

    /// A destination's SockHash backlog, holding redirected bytes that it did not send,
    /// was woken.
    pub(crate) fn woke(&self) {
        self.wakeups.fetch_add(1, Relaxed);
    }

    /// Backlog wake-ups so far.
    pub(crate) fn wakeups(&self) -> u64 {
        self.wakeups.load(Relaxed)
    }

    /// An idle connection was parked.
    pub(crate) fn parked(&self) {
        self.parks.fetch_add(1, Relaxed);
        self.parked.fetch_add(1, Relaxed);
    }

    /// A parked connection left the parker (woken, or dropped while parked).
    pub(crate) fn unparked(&self) {
        self.parked.fetch_sub(1, Relaxed);
    }

    /// An idle connection could not be parked and stayed in tokio.
    pub(crate) fn park_failed(&self) {
        self.park_failures.fetch_add(1, Relaxed);
    }

    /// The parking counts.
    pub(crate) fn parking(&self) -> Parking {
        Parking {
            parked: self.parked.load(Relaxed),
            parks: self.parks.load(Relaxed),
            failures: self.park_failures.load(Relaxed),
        }
    }
}
