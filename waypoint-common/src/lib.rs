//! Types shared between the waypoint's eBPF programs and the daemon.
//!
//! Everything here is `#[repr(C)]` with explicit padding: the verifier rejects reads of
//! uninitialised padding, and both sides must agree on the layout byte for byte.
//!
//! The in-kernel splice keeps one [`Flow`] record per redirected socket, in a slot of the
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
/// Name of the ring buffer through which the verdict tells the daemon that a redirected
/// socket has bytes for it to read (see [`Signal`]).
pub const SIGNALS_MAP: &str = "SIGNALS";
/// Size of [`SIGNALS_MAP`] in bytes (a power of two, whole pages): 16,384 records of 16
/// bytes (the kernel's 8-byte header and a [`Signal`]).
pub const SIGNALS_BYTES: u32 = 256 * 1024;
/// Name of the ring buffer through which the rewrite program reports that a rewritten
/// connection ended (a [`RewriteEnd`]). Its records wake nobody: the daemon reads them
/// at its next look at the rings, within 100 ms, which an end can wait for (its entries
/// linger seconds anyway). A wake-up per end would cost an interrupt and a thread's turn
/// on every connection. Sized as [`SIGNALS_MAP`] (records of 32 bytes: 8,192 of them).
pub const ENDS_MAP: &str = "ENDS";
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
/// Name of the global holding the longest repeat the verdict cuts (bytes). The object's
/// own value is what the program can cut; tests lower it to make every repeat go to
/// userspace.
pub const TRIM_LIMIT: &str = "TRIM_LIMIT";

/// Default capacity of the per-socket maps (two sockets per redirected connection). The
/// daemon resizes them at load time from its connection limit.
pub const DEFAULT_MAX_SOCKETS: u32 = 262_144;

/// One redirected socket's record: the limits userspace sets, and what the verdict did with
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
/// Every byte that arrives on a redirected socket is counted exactly once, either as
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
    /// Kernel: repeats the verdict could not cut, which userspace drops as it reads
    /// them, in the order they came. Each is set once, before the segment that holds it
    /// is passed, and never changed after: userspace reads them without a lock and never
    /// sees half of an update. A socket has room for [`SKIPS`] of them.
    pub skips: [Skip; SKIPS],
}

/// Repeats the verdict could not cut that one socket can hand to userspace (see
/// [`Flow::skips`]). One more is forwarded as it is and counted ([`Stat::TrimFailed`]).
pub const SKIPS: usize = 4;

/// A repeat the verdict could not cut: `len` bytes of the socket's stream of passed bytes,
/// from offset `at`, that userspace drops.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Skip {
    /// Where the repeat starts, as an offset in the stream of `passed` bytes.
    pub at: u64,
    /// Its length; 0 while the record is unused.
    pub len: u32,
    /// Explicit padding (the verifier rejects reads of uninitialised padding).
    pub _pad: u32,
}

/// A ring-buffer record: the socket in flow slot `slot` has bytes for userspace, and
/// userspace had read everything before. The daemon waits for these instead of waiting
/// for its redirected sockets to turn readable: the kernel wakes readers of a redirected socket
/// after every segment, also one it redirected away, so a redirected connection would
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
    /// userspace either (the socket's [`SKIPS`] skip records were used already):
    /// forwarded as they are. Never expected; a counted defect, not a silent one.
    TrimFailed = 8,
    /// Segments passed with a repeated head that the program could not cut (longer than
    /// it cuts, or the kernel had no memory to pull the head): userspace drops the
    /// repeat (see [`Flow::skips`]).
    PassedRepeat = 9,
    /// Signals (see [`Signal`]) that did not fit into the full ring buffer. The daemon
    /// then wakes every waiting connection to look for itself.
    SignalLost = 10,
    /// Segments whose repeated head the kernel could not pull into the segment's linear
    /// part for cutting (no memory for it): the repeat is left whole, and counted again
    /// as [`Stat::PassedRepeat`] (or [`Stat::TrimFailed`]).
    CutRefused = 11,
}

/// Number of entries in the statistics array.
pub const STAT_COUNT: u32 = 12;

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
        Stat::CutRefused,
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
            Stat::CutRefused => "cut_refused",
        }
    }
}

/// Name of the TC classifier that splices same-host connections by rewriting packet
/// headers (see [`Rewrite`]).
pub const REWRITE_PROG: &str = "waypoint_rewrite";
/// Name of the hash map from a packet's 4-tuple ([`RewriteKey`]) to its [`Rewrite`].
pub const REWRITES_MAP: &str = "REWRITES";
/// Name of the per-CPU array of the rewrite program's statistics, by [`RewriteStat`].
pub const REWRITE_STATS_MAP: &str = "REWRITE_STATS";
/// Name of the hash map of the hand-overs whose client sent more than the hello before
/// the entries were in (see docs/ARCHITECTURE.md, *Hand-over*, step 4): keyed by the
/// pod's entry key ([`RewriteKey`] of the pod's packets to B), the sequence number, in
/// B's space, after what B sent on the client's behalf (the hello, those bytes, a FIN).
/// The program hands the pod's first pure ACK at or past it to B, its ack lowered to it,
/// and removes the element: B then holds nothing to retransmit. Written by userspace
/// once per such hand-over, removed by the program (or by userspace at the end).
pub const REWRITE_FILLS_MAP: &str = "REWRITE_FILLS";
/// Capacity of [`REWRITE_FILLS_MAP`]: hand-overs at once whose B waits for the pod's
/// acknowledgement of the stranded bytes it carried (each lasts about one round trip).
/// A hand-over that finds it full resets both ends, counted as stranded.
pub const REWRITE_FILLS_CAPACITY: u32 = 4096;
/// Default capacity of [`REWRITES_MAP`] (two entries per rewritten connection); the
/// daemon sets it to its socket maps' capacity at load time. Entries are allocated as
/// they are inserted.
pub const DEFAULT_MAX_REWRITES: u32 = DEFAULT_MAX_SOCKETS;
/// Signal slots at and above this value name rewritten connections, below it flow
/// slots of the SockHash splice (each in its own ring: [`ENDS_MAP`], [`SIGNALS_MAP`]).
pub const REWRITE_SLOT_BASE: u32 = 0x8000_0000;

/// A TCP/IPv4 packet's 4-tuple, every field in network byte order as in the packet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RewriteKey {
    /// Source address.
    pub saddr: u32,
    /// Destination address.
    pub daddr: u32,
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
}

/// One direction of a connection rewritten headers: the packets the client
/// sends to the waypoint's accepted socket (A) leave as if the waypoint's socket to the
/// pod (B) had sent them, and the pod's packets to B leave as if A had sent them. Client
/// and pod then talk through one TCP connection's worth of kernel work, and neither of
/// the waypoint's sockets sees a packet. Sequence numbers, acknowledgements, SACK blocks
/// and timestamps are moved from one connection's number space into the other's.
///
/// Fields marked "userspace" are set once, before the entry is inserted; the program
/// writes only the fields marked "kernel".
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rewrite {
    /// Userspace: the 4-tuple the packet leaves with.
    pub to: RewriteKey,
    /// Userspace: the connection's signal slot ([`REWRITE_SLOT_BASE`] and up).
    pub slot: u32,
    /// Userspace: added to the sequence number (modulo 2^32).
    pub seq_add: u32,
    /// Userspace: added to the acknowledgement number and to SACK block edges.
    pub ack_add: u32,
    /// Userspace: host order. While [`REWRITE_WATCH`] is set, the first pure ACK from
    /// this direction's sender goes to the waypoint's own socket instead, with its ack
    /// lowered to this value: that socket sent the ClientHello, and would otherwise
    /// retransmit it for ever, since every other acknowledgement of it is rewritten away.
    pub watch: u32,
    /// Userspace: the TSval clock of the socket whose identity the packet takes on, as an
    /// offset from CLOCK_MONOTONIC in milliseconds.
    pub ts_off: u32,
    /// Kernel: taken off TSecr; the reverse direction's TSval addend (`ts_add`), so that
    /// the receiver sees its own clock echoed. Written once, by the packet that learned
    /// that addend.
    pub ecr_sub: u32,
    /// Kernel: 0 until learned, then [`TS_ADD_LEARNED`] with, in the low 32 bits, what is
    /// added to TSval: the sender's clock to that socket's clock, learned from the first
    /// packet with a timestamp. Learned with one 64-bit compare-and-exchange, so that
    /// packets handled on two CPUs at once all take the one value: two values a few
    /// milliseconds apart make the later, smaller one look old to the receiver's PAWS
    /// check, which drops it.
    pub ts_add: u64,
    /// Kernel and userspace ([`REWRITE_TS_LEARNED`], ...). 64 bits wide and aligned:
    /// the program sets and clears bits with 64-bit atomic instructions, since two CPUs
    /// can handle packets of one direction at once (32-bit ones need the 32-bit ALU code
    /// generation, which makes the verifier's walk through the program several times
    /// longer).
    pub flags: u64,
    /// Userspace: the sender's sequence number of the first byte after the waypoint's
    /// snapshot. Kernel: advanced to the end of the highest segment seen.
    pub next_seq: u32,
    /// Zero. With `next_seq`, one aligned 8-byte word, which the program moves with a
    /// 64-bit compare-and-exchange (see `flags` for why not a 32-bit one).
    pub _pad: u32,
    /// Kernel: payload bytes that advanced `next_seq` (each byte once, retransmissions
    /// not counted).
    pub bytes: u64,
    /// Kernel: packets rewritten.
    pub packets: u64,
}

// The program's atomic instructions need `flags` and `next_seq` on 8-byte boundaries.
const _: () = assert!(core::mem::offset_of!(Rewrite, flags) % 8 == 0);
const _: () = assert!(core::mem::offset_of!(Rewrite, next_seq) % 8 == 0);
const _: () = assert!(core::mem::offset_of!(Rewrite, ts_add) % 8 == 0);
const _: () = assert!(core::mem::size_of::<Rewrite>() == 80);

/// [`Rewrite::ts_add`]: learned (the addend itself is the low 32 bits).
pub const TS_ADD_LEARNED: u64 = 1 << 32;
/// [`Rewrite::flags`]: the first pure ACK goes to the waypoint's socket (see
/// [`Rewrite::watch`]); cleared by the program when it did so.
pub const REWRITE_WATCH: u64 = 2;
/// [`Rewrite::flags`]: this direction's sender sent FIN.
pub const REWRITE_FIN: u64 = 4;
/// [`Rewrite::flags`]: this direction's sender sent RST.
pub const REWRITE_RST: u64 = 8;
/// [`Rewrite::flags`]: a SYN came with this 4-tuple: the connection is gone (the client
/// reuses its port). The program removed both entries.
pub const REWRITE_SYN: u64 = 16;
/// [`Rewrite::flags`]: set by userspace on the pod's direction, so that the program can
/// tell the directions apart in a [`RewriteEnd`].
pub const REWRITE_FROM_POD: u64 = 32;

/// A record of [`ENDS_MAP`]: a rewritten connection's end as the program saw it, so
/// that the daemon need not look at the entries to learn it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RewriteEnd {
    /// The connection's slot ([`REWRITE_SLOT_BASE`] and up).
    pub slot: u32,
    /// How it ended: [`END_CLOSED`], [`END_CLIENT_RST`], [`END_POD_RST`] or [`END_GONE`].
    pub how: u32,
    /// Bytes carried from the client.
    pub client_bytes: u64,
    /// Bytes carried from the pod.
    pub pod_bytes: u64,
}
// The daemon parses the ring's records by these offsets (slot, how, client, pod bytes).
const _: () = assert!(core::mem::size_of::<RewriteEnd>() == 24);

/// [`RewriteEnd::how`]: both sides sent FIN.
pub const END_CLOSED: u32 = 1;
/// [`RewriteEnd::how`]: the client sent RST.
pub const END_CLIENT_RST: u32 = 2;
/// [`RewriteEnd::how`]: the pod sent RST.
pub const END_POD_RST: u32 = 3;
/// [`RewriteEnd::how`]: a SYN came with the client's 4-tuple (it reuses its port); the
/// program removed both entries. Bytes are not counted.
pub const END_GONE: u32 = 4;

/// Indexes of the rewrite program's per-CPU statistics.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RewriteStat {
    /// Packets rewritten.
    Rewritten = 0,
    /// Pure ACKs handed to the waypoint's socket that sent the hello (see
    /// [`Rewrite::watch`]).
    Diverted = 1,
    /// Packets whose TCP options could not be parsed whole: rewritten without their
    /// timestamps or SACK blocks translated. Never expected from Linux peers.
    BadOptions = 2,
    /// SYNs with a rewritten 4-tuple: both entries removed, the SYN passed on.
    Syn = 3,
    /// Rewritten packets with no route to their new destination (or too big for it):
    /// dropped, and left to TCP's retransmission.
    Unroutable = 4,
    /// Data packets rewritten whose bytes went uncounted: other CPUs moved the entry's
    /// `next_seq` 8 times in a row while this one tried to (see the program's
    /// `advance`). Counted also in `Rewritten`.
    Uncounted = 5,
    /// Packets looked up in the rewrite map: those to a port that clients of rewritten
    /// connections send to, or from a port that their pods send from (see
    /// [`REWRITE_PORTS_MAP`]). Every other TCP packet of the node is let through on two
    /// array reads.
    LookedUp = 6,
}

/// Number of entries in the rewrite statistics array.
pub const REWRITE_STAT_COUNT: u32 = 7;

/// Name of the array, indexed by TCP port (host byte order), of the ports whose packets
/// the rewrite program looks up in [`REWRITES_MAP`]: [`PORT_CLIENT_TO`],
/// [`PORT_POD_FROM`] bits. The daemon sets a port's bit before the first entry that
/// needs it goes in, and never clears it.
pub const REWRITE_PORTS_MAP: &str = "REWRITE_PORTS";
/// [`REWRITE_PORTS_MAP`]: clients send to this port (a waypoint listener's).
pub const PORT_CLIENT_TO: u8 = 1;
/// [`REWRITE_PORTS_MAP`]: pods send from this port.
pub const PORT_POD_FROM: u8 = 2;
/// [`REWRITE_PORTS_MAP`], at index 0 only (port 0, which no connection uses, and whose
/// other bits stay clear): the program's map of connections is pinned in bpffs, so the
/// program belongs to the next daemon that reads that pin directory, which adopts it.
/// The daemon that finds a netlink filter no one owns leaves such a program in place.
pub const PORTS_PINNED: u8 = 0x80;

impl RewriteStat {
    /// Every statistic, in index order.
    pub const ALL: [RewriteStat; REWRITE_STAT_COUNT as usize] = [
        RewriteStat::Rewritten,
        RewriteStat::Diverted,
        RewriteStat::BadOptions,
        RewriteStat::Syn,
        RewriteStat::Unroutable,
        RewriteStat::Uncounted,
        RewriteStat::LookedUp,
    ];

    /// A short label for metrics.
    pub const fn label(self) -> &'static str {
        match self {
            RewriteStat::Rewritten => "rewritten",
            RewriteStat::Diverted => "diverted",
            RewriteStat::BadOptions => "bad_options",
            RewriteStat::Syn => "syn",
            RewriteStat::Unroutable => "unroutable",
            RewriteStat::Uncounted => "uncounted",
            RewriteStat::LookedUp => "looked_up",
        }
    }
}

/// Name of the SOCK_OPS program that records the sequence numbers of the daemon's
/// sockets when they are established (see [`Established`]).
pub const ESTABLISHED_PROG: &str = "waypoint_established";
/// Name of the socket-local storage ([`Established`] per socket) that the program fills.
/// Created with `BPF_F_CLONE`: a listener's record is copied into every socket it
/// accepts, which is how the program knows the daemon's accepted sockets.
pub const ESTABLISHED_MAP: &str = "ESTABLISHED";
/// Name of the global holding the offset of `sk` in `struct bpf_sock_ops_kern` (0:
/// unknown; timestamps offsets are then not recorded).
pub const SOCK_OPS_SK_OFFSET: &str = "SOCK_OPS_SK_OFFSET";
/// Name of the global holding the offset of `tsoffset` in `struct tcp_sock` (0: unknown).
pub const TCP_TSOFFSET_OFFSET: &str = "TCP_TSOFFSET_OFFSET";
/// Name of the global holding the port the daemon dials pods on (0: none): the
/// established program gives every socket that connects to it a record, unmarked.
pub const POD_PORT: &str = "POD_PORT";

/// What the established program records of a socket the daemon marked (a record in the
/// socket's storage, all zero, put there by the daemon before the socket connects, or
/// copied from its listener), at the moment the handshake completes. It lets the rewrite
/// hand-over compute both sockets' sequence numbers from `TCP_INFO`'s byte counters
/// instead of reading them in repair mode, and their addresses without asking.
///
/// Both bases are invariants of the socket: the kernel advances `snd_una` with
/// `bytes_acked` and `rcv_nxt` with `bytes_received` (a FIN included in each), and only
/// repair mode sets them otherwise.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Established {
    /// `snd_una - bytes_acked`: the sequence number after the socket's SYN.
    pub snd_base: u32,
    /// `rcv_nxt - bytes_received`: the sequence number after the peer's SYN.
    pub rcv_base: u32,
    /// `tsoffset`: what the socket adds to the clock for its TCP timestamps
    /// ([`ESTABLISHED_TS_OFFSET`] says it was read).
    pub ts_offset: u32,
    /// The socket's own IPv4 address, network byte order ([`ESTABLISHED_V4`]).
    pub local_ip4: u32,
    /// The peer's IPv4 address, network byte order ([`ESTABLISHED_V4`]).
    pub remote_ip4: u32,
    /// The socket's own port, host byte order.
    pub local_port: u16,
    /// The peer's port, host byte order.
    pub remote_port: u16,
    /// [`ESTABLISHED_SET`], [`ESTABLISHED_V4`], [`ESTABLISHED_TS_OFFSET`].
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<Established>() == 28);

/// [`Established::flags`]: the program filled the record (the socket is established).
pub const ESTABLISHED_SET: u32 = 1;
/// [`Established::flags`]: the connection is IPv4 (or IPv4-mapped IPv6); the addresses
/// are set.
pub const ESTABLISHED_V4: u32 = 2;
/// [`Established::flags`]: [`Established::ts_offset`] was read.
pub const ESTABLISHED_TS_OFFSET: u32 = 4;

#[cfg(feature = "user")]
mod pod {
    // SAFETY: #[repr(C)], made only of integer fields laid out without padding, and valid
    // for any bit pattern.
    #[allow(unsafe_code, reason = "aya::Pod is an unsafe marker trait")]
    unsafe impl aya::Pod for super::Flow {}
    // SAFETY: as above: #[repr(C)] integers, no implicit padding (12 bytes).
    #[allow(unsafe_code, reason = "aya::Pod is an unsafe marker trait")]
    unsafe impl aya::Pod for super::RewriteKey {}
    // SAFETY: as above: #[repr(C)] integers with explicit padding (72 bytes).
    #[allow(unsafe_code, reason = "aya::Pod is an unsafe marker trait")]
    unsafe impl aya::Pod for super::Rewrite {}
    // SAFETY: as above: #[repr(C)] integers, no implicit padding (28 bytes).
    #[allow(unsafe_code, reason = "aya::Pod is an unsafe marker trait")]
    unsafe impl aya::Pod for super::Established {}
}

/// The program that moves a closing tunnel listener's queued connections to the newest
/// daemon's listeners (waypoint-ebpf's `reuseport` object).
pub const MIGRATE_PROG: &str = "waypoint_migrate";
/// Its REUSEPORT_SOCKARRAY: the listeners of the daemon that attached it, one per worker.
pub const LISTENERS_MAP: &str = "LISTENERS";
/// Its global: how many entries `LISTENERS` has (set by the loader).
pub const LISTENER_COUNT: &str = "LISTENER_COUNT";
/// The most listeners (workers) one daemon puts in `LISTENERS`.
pub const MAX_LISTENERS: u32 = 1024;
