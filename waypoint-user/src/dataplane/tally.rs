//! What one dataplane counts of its connections besides how they end: the path each took
//! and why ([`Taken`]), the connections its stall watchdog caught (see [`super::stall`]),
//! the kernel backlogs it woke (see [`crate::sys::wake_writer`]) and its idle connections
//! parked (see [`super::park`]). Each [`super::Dataplane`] has its own, so two in one
//! process (as in a test binary) count apart.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

use super::{rewrite::Refusal, Kind, Parking};

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
    /// Connections by [`Taken::index`].
    taken: [AtomicU64; Taken::COUNT],
}

/// The path one connection took, and why not the faster one above it (rewrite, then
/// the SockHash redirect, then the copy). Counted once per connection, when the path is
/// final; a connection that fails before that (its setup errs) is not counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Taken {
    /// The rewrite program carries it (`--rewrite-splice`).
    Rewritten,
    /// The SockHash redirect: the rewrite is off (`None`), or refused it (why).
    Redirected(Option<Refusal>),
    /// The eBPF dataplane's copy, to the end: the connection ended before it carried
    /// `--move-after` bytes.
    CopiedShort,
    /// The eBPF dataplane's copy, to the end: a socket could not enter the SockHash.
    CopiedFallback,
    /// The splice dataplane.
    Spliced,
    /// The copy dataplane.
    Copied,
}

impl Taken {
    /// Every value, in [`Taken::index`] order.
    pub const ALL: [Taken; 12] = [
        Taken::Rewritten,
        Taken::Redirected(None),
        Taken::Redirected(Some(Refusal::ALL[0])),
        Taken::Redirected(Some(Refusal::ALL[1])),
        Taken::Redirected(Some(Refusal::ALL[2])),
        Taken::Redirected(Some(Refusal::ALL[3])),
        Taken::Redirected(Some(Refusal::ALL[4])),
        Taken::Redirected(Some(Refusal::ALL[5])),
        Taken::CopiedShort,
        Taken::CopiedFallback,
        Taken::Spliced,
        Taken::Copied,
    ];
    const COUNT: usize = Taken::ALL.len();

    /// Its place in [`Taken::ALL`].
    fn index(self) -> usize {
        match self {
            Taken::Rewritten => 0,
            Taken::Redirected(None) => 1,
            Taken::Redirected(Some(r)) => 2 + r as usize,
            Taken::CopiedShort => 8,
            Taken::CopiedFallback => 9,
            Taken::Spliced => 10,
            Taken::Copied => 11,
        }
    }

    /// The metric's labels: the path, and why.
    pub fn labels(self) -> (&'static str, &'static str) {
        match self {
            Taken::Rewritten => ("rewrite", "qualified"),
            Taken::Redirected(None) => ("redirect", "rewrite_off"),
            Taken::Redirected(Some(r)) => ("redirect", r.as_str()),
            Taken::CopiedShort => ("copy", "short"),
            Taken::CopiedFallback => ("copy", "fallback"),
            Taken::Spliced => ("splice", "dataplane"),
            Taken::Copied => ("copy", "dataplane"),
        }
    }
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
            taken: std::array::from_fn(|_| AtomicU64::new(0)),
        }))
    }

    /// The dataplane counted here.
    pub(crate) fn kind(&self) -> Kind {
        self.kind
    }

    /// A connection's path is final.
    pub(crate) fn took(&self, path: Taken) {
        self.taken[path.index()].fetch_add(1, Relaxed);
    }

    /// Connections by the path they took, in [`Taken::ALL`] order.
    pub(crate) fn taken(&self) -> [(Taken, u64); Taken::COUNT] {
        Taken::ALL.map(|t| (t, self.taken[t.index()].load(Relaxed)))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path has its own counter and its own labels.
    #[test]
    fn every_path_counts_apart() {
        let tally = Tally::leak(Kind::Ebpf);
        for (i, t) in Taken::ALL.into_iter().enumerate() {
            assert_eq!(t.index(), i, "{t:?}");
            for _ in 0..=i {
                tally.took(t);
            }
        }
        for (i, (t, n)) in tally.taken().into_iter().enumerate() {
            assert_eq!((t, n), (Taken::ALL[i], i as u64 + 1));
        }
        let mut labels: Vec<_> = Taken::ALL.map(Taken::labels).to_vec();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), Taken::ALL.len(), "two paths share labels");
    }
}
