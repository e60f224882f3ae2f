//! Types shared between the waypoint's eBPF programs and the daemon.
//!
//! Everything here is `#[repr(C)]` with explicit padding: the verifier rejects reads of
//! uninitialised padding, and both sides must agree on the layout byte for byte.
//!
//! The in-kernel splice keeps two records per spliced socket, both keyed by that socket's
//! cookie (`SO_COOKIE`). They are split by writer so that neither side ever overwrites a
//! field the other owns: a map update from userspace replaces the whole value.
#![no_std]
#![deny(rust_2018_idioms)]
#![deny(unsafe_code)]

/// Name of the SockHash that maps a socket's cookie to its **peer** socket.
pub const PEERS_MAP: &str = "PEERS";
/// Name of the hash map of [`FlowCounters`], written only by the kernel.
pub const COUNTERS_MAP: &str = "COUNTERS";
/// Name of the hash map of [`FlowBudget`], written only by userspace.
pub const BUDGETS_MAP: &str = "BUDGETS";
/// Name of the per-CPU array of verdict statistics, indexed by [`Stat`].
pub const STATS_MAP: &str = "STATS";
/// Name of the SK_SKB stream verdict program.
pub const VERDICT_PROG: &str = "waypoint_verdict";

/// Default capacity of the per-socket maps (two sockets per spliced connection). The
/// daemon resizes them at load time from its connection limit.
pub const DEFAULT_MAX_SOCKETS: u32 = 262_144;

/// What the verdict program did with the bytes arriving on one socket, written only by
/// the kernel.
///
/// Every byte that arrives on a spliced socket is counted exactly once, either as
/// `redirected` (sent to the peer's egress in the kernel) or as `passed` (left in this
/// socket's receive queue for userspace to read and forward).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowCounters {
    /// Bytes redirected to the peer socket's egress.
    pub redirected: u64,
    /// Bytes left in this socket's receive queue for userspace.
    pub passed: u64,
}

/// The limits userspace sets for one socket, written only by userspace.
///
/// The verdict program redirects a segment only when both hold:
/// - `passed == consumed`: userspace has forwarded every byte it was handed, so a redirect
///   cannot overtake bytes still in userspace (ordering);
/// - `redirected + len <= credit`: the bytes parked in the kernel between this socket and
///   the peer's TCP send queue stay under the in-flight limit (backpressure).
///
/// Otherwise the segment stays in this socket's receive queue: it counts against the
/// receive buffer, the sender's window closes, and userspace forwards it with ordinary
/// flow control.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowBudget {
    /// Highest value of `redirected` allowed.
    pub credit: u64,
    /// Bytes of `passed` that userspace has read and queued on the peer.
    pub consumed: u64,
}

/// Indexes of the verdict program's per-CPU statistics.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stat {
    /// Segments redirected to the peer.
    Redirected = 0,
    /// Segments passed because userspace still holds bytes (ordering).
    PassedOrdering = 1,
    /// Segments passed because the in-flight limit was reached (backpressure).
    PassedBudget = 2,
    /// Segments passed because the socket had no flow records (not ours, or not yet).
    PassedUnknown = 3,
    /// Segments passed because the peer was missing from the SockHash.
    PassedNoPeer = 4,
    /// Zero-length segments (a bare FIN) dropped: they carry no byte.
    DroppedEmpty = 5,
}

/// Number of entries in the statistics array.
pub const STAT_COUNT: u32 = 6;

impl Stat {
    /// Every statistic, in index order.
    pub const ALL: [Stat; STAT_COUNT as usize] = [
        Stat::Redirected,
        Stat::PassedOrdering,
        Stat::PassedBudget,
        Stat::PassedUnknown,
        Stat::PassedNoPeer,
        Stat::DroppedEmpty,
    ];

    /// A short label for metrics.
    pub const fn label(self) -> &'static str {
        match self {
            Stat::Redirected => "redirected",
            Stat::PassedOrdering => "passed_ordering",
            Stat::PassedBudget => "passed_budget",
            Stat::PassedUnknown => "passed_unknown",
            Stat::PassedNoPeer => "passed_no_peer",
            Stat::DroppedEmpty => "dropped_empty",
        }
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: both are #[repr(C)], made only of u64 fields (no padding), and valid for any
    // bit pattern.
    #[allow(unsafe_code, reason = "aya::Pod is an unsafe marker trait")]
    unsafe impl aya::Pod for super::FlowCounters {}
    // SAFETY: as above.
    #[allow(unsafe_code, reason = "aya::Pod is an unsafe marker trait")]
    unsafe impl aya::Pod for super::FlowBudget {}
}
