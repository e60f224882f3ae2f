//! Types shared between the waypoint's eBPF programs and the daemon.
//!
//! Everything here is `#[repr(C)]` with explicit padding: the verifier rejects reads of
//! uninitialised padding, and both sides must agree on the layout byte for byte.
//!
//! The in-kernel splice keeps one [`Flow`] record per spliced socket, in a slot of the
//! `FLOWS` array that the daemon maps into its memory: the daemon sets a socket's budget
//! and reads its counters with plain memory accesses, not syscalls. `SLOTS` maps a
//! socket's cookie (`SO_COOKIE`) to its slot.
#![no_std]
#![deny(rust_2018_idioms)]
#![deny(unsafe_code)]

/// Name of the SockHash that maps a socket's cookie to its **peer** socket.
pub const PEERS_MAP: &str = "PEERS";
/// Name of the hash map from a socket's cookie to its slot in [`FLOWS_MAP`].
pub const SLOTS_MAP: &str = "SLOTS";
/// Name of the memory-mappable array of [`Flow`] records.
pub const FLOWS_MAP: &str = "FLOWS";
/// Name of the per-CPU array of verdict statistics, indexed by [`Stat`].
pub const STATS_MAP: &str = "STATS";
/// Name of the ring buffer through which the verdict tells the daemon that a spliced
/// socket has bytes for it to read (see [`Signal`]).
pub const SIGNALS_MAP: &str = "SIGNALS";
/// Size of [`SIGNALS_MAP`] in bytes (a power of two, whole pages): 16,384 records of 16
/// bytes (the kernel's 8-byte header and a [`Signal`]).
pub const SIGNALS_BYTES: u32 = 256 * 1024;
/// Name of the SK_SKB stream verdict program.
pub const VERDICT_PROG: &str = "waypoint_verdict";

/// Name of the program's global holding the offset of `TCP_SKB_CB(skb)->seq` (the
/// segment's first sequence number) in `struct sk_buff`, read from the running kernel's
/// BTF at load. 0 turns the overlap check off.
pub const SKB_SEQ_OFFSET: &str = "SKB_SEQ_OFFSET";
/// Name of the global holding the offset of `sk` in `struct sk_buff` (0: unknown).
pub const SKB_SK_OFFSET: &str = "SKB_SK_OFFSET";
/// Name of the global holding the offset of `copied_seq` in `struct tcp_sock` (0:
/// unknown; the check then starts from the first segment the verdict sees).
pub const TCP_COPIED_SEQ_OFFSET: &str = "TCP_COPIED_SEQ_OFFSET";

/// Default capacity of the per-socket maps (two sockets per spliced connection). The
/// daemon resizes them at load time from its connection limit.
pub const DEFAULT_MAX_SOCKETS: u32 = 262_144;

/// One spliced socket's record: the limits userspace sets, and what the verdict did with
/// the bytes arriving on the socket. Each field has one writer, so neither side ever
/// overwrites the other's updates.
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
///
/// Every byte that arrives on a spliced socket is counted exactly once, either as
/// `redirected` (sent to the peer's egress in the kernel) or as `passed` (left in this
/// socket's receive queue for userspace to read and forward).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flow {
    /// Userspace: the cookie of the socket this slot serves. The verdict ignores a slot
    /// whose owner is not the socket it runs for (a slot being reused).
    pub owner: u64,
    /// Userspace: highest value of `redirected` allowed.
    pub credit: u64,
    /// Userspace: bytes of `passed` that userspace has read and queued on the peer.
    pub consumed: u64,
    /// Kernel: bytes redirected to the peer socket's egress.
    pub redirected: u64,
    /// Kernel: bytes left in this socket's receive queue for userspace.
    pub passed: u64,
    /// Kernel: bytes cut from the head of segments because they had been delivered
    /// already (counted in neither of the above).
    pub trimmed: u64,
    /// Kernel: the sequence number after the last byte seen, valid when `seq_known` is 1.
    pub next_seq: u32,
    /// Kernel: 1 once `next_seq` is set.
    pub seq_known: u32,
    /// Kernel: where a repeat that the verdict could not cut starts, as an offset in the
    /// stream of `passed` bytes. Userspace drops `skip_len` bytes from there when it
    /// reads them. Set at most once per socket, before the segment is passed, and never
    /// changed after: userspace never sees half of an update.
    pub skip_at: u64,
    /// Kernel: length of that repeat; 0 while there is none.
    pub skip_len: u32,
    /// Explicit padding (the verifier rejects reads of uninitialised padding).
    pub _pad: u32,
}

/// A ring-buffer record: the socket in flow slot `slot` has bytes for userspace, and
/// userspace had read everything before. The daemon waits for these instead of waiting
/// for its spliced sockets to turn readable: the kernel wakes readers of a spliced socket
/// after every segment, also one it redirected away, so a spliced connection would
/// wake its thread once per segment.
///
/// One record per switch from redirecting to passing, not per passed segment: while
/// userspace holds bytes it reads the socket anyway.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Signal {
    /// The socket's slot in [`FLOWS_MAP`].
    pub slot: u32,
    /// Explicit padding (records are 8-byte aligned).
    pub _pad: u32,
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
    /// Segments whose head repeated bytes already delivered; the repeat was cut off.
    Trimmed = 6,
    /// Segments made only of bytes already delivered, dropped.
    DroppedDuplicate = 7,
    /// Segments with a repeated head that could not be cut and could not be handed to
    /// userspace either (the socket's one skip record was used already): forwarded as
    /// they are. Never expected; a counted defect, not a silent one.
    TrimFailed = 8,
    /// Segments passed with a repeated head that the program could not cut (longer than
    /// it trims in one pass, or no memory to pull the head): userspace drops the repeat
    /// (see [`Flow::skip_at`]).
    PassedRepeat = 9,
    /// Signals (see [`Signal`]) that did not fit into the full ring buffer. The daemon
    /// then wakes every waiting connection to look for itself.
    SignalLost = 10,
}

/// Number of entries in the statistics array.
pub const STAT_COUNT: u32 = 11;

impl Stat {
    /// Every statistic, in index order.
    pub const ALL: [Stat; STAT_COUNT as usize] = [
        Stat::Redirected,
        Stat::PassedOrdering,
        Stat::PassedBudget,
        Stat::PassedUnknown,
        Stat::PassedNoPeer,
        Stat::DroppedEmpty,
        Stat::Trimmed,
        Stat::DroppedDuplicate,
        Stat::TrimFailed,
        Stat::PassedRepeat,
        Stat::SignalLost,
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
            Stat::Trimmed => "trimmed",
            Stat::DroppedDuplicate => "dropped_duplicate",
            Stat::TrimFailed => "trim_failed",
            Stat::PassedRepeat => "passed_repeat",
            Stat::SignalLost => "signal_lost",
        }
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: #[repr(C)], made only of integer fields laid out without padding, and valid
    // for any bit pattern.
    #[allow(unsafe_code, reason = "aya::Pod is an unsafe marker trait")]
    unsafe impl aya::Pod for super::Flow {}
}
