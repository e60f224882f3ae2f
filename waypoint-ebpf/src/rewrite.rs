//! Splicing by rewriting packet headers: a TC classifier on the ingress of `lo`.
//!
//! For a connection the daemon splices this way, `REWRITES` holds one entry per
//! direction, keyed by the 4-tuple the packet arrives with: the client's packets to the
//! waypoint's accepted socket (A) leave with the 4-tuple of the waypoint's socket to the
//! pod (B), and the pod's packets to B with A's. Sequence and acknowledgement numbers,
//! SACK blocks and timestamps move into the other connection's number space, so client
//! and pod hold one TCP conversation and neither of the waypoint's sockets sees a packet.
//! See `waypoint_common::Rewrite` for the fields and docs/ARCHITECTURE.md for the
//! hand-over.
//!
//! A rewritten packet leaves through the interface towards its new destination
//! (`bpf_fib_lookup`, `bpf_redirect_neigh`), or goes up the local stack if that is this
//! host. The program is attached to the ingress of every interface of the node.

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup, BPF_FIB_LKUP_RET_FWD_DISABLED, BPF_FIB_LKUP_RET_NOT_FWDED,
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, BPF_F_NO_PREALLOC, BPF_F_PSEUDO_HDR,
        BPF_RB_NO_WAKEUP, TC_ACT_OK,
    },
    cty::c_void,
    helpers::{
        bpf_fib_lookup as fib_lookup_helper, bpf_ktime_get_ns, bpf_l3_csum_replace,
        bpf_l4_csum_replace, bpf_redirect_neigh, bpf_skb_load_bytes, bpf_skb_store_bytes,
    },
    macros::{classifier, map},
    maps::{Array, HashMap, PerCpuArray},
    programs::TcContext,
};
use core::intrinsics::{atomic_and, atomic_cxchg, atomic_or, atomic_xadd, AtomicOrdering};
use waypoint_common::{
    Rewrite, RewriteEnd, RewriteKey, RewriteStat, Stat, DEFAULT_MAX_REWRITES, END_CLIENT_RST,
    END_CLOSED, END_GONE, END_POD_RST, PORT_CLIENT_TO, PORT_POD_FROM, REWRITE_FILLS_CAPACITY,
    REWRITE_FIN, REWRITE_FROM_POD, REWRITE_RST, REWRITE_STAT_COUNT, REWRITE_WATCH, TS_ADD_LEARNED,
};

// Not preallocated, for the same reason as SLOTS: the program writes through the pointer
// it looked up, and a removed element must not be handed to another connection meanwhile.
#[map]
static REWRITES: HashMap<RewriteKey, Rewrite> =
    HashMap::with_max_entries(DEFAULT_MAX_REWRITES, BPF_F_NO_PREALLOC);

/// See `waypoint_common::REWRITE_FILLS_MAP`: by the pod's entry key, the end of what B
/// sent on the client's behalf. Replaced whole by userspace (an update swaps the element
/// in), so the program never reads half of one.
#[map]
static REWRITE_FILLS: HashMap<RewriteKey, u32> =
    HashMap::with_max_entries(REWRITE_FILLS_CAPACITY, BPF_F_NO_PREALLOC);

#[map]
static REWRITE_STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(REWRITE_STAT_COUNT, 0);

/// By TCP port: [`PORT_CLIENT_TO`] and [`PORT_POD_FROM`] bits (see
/// `waypoint_common::REWRITE_PORTS_MAP`). The program runs on every TCP packet of the
/// node; an array read is a load at a computed address, where a miss in `REWRITES` hashes
/// the 4-tuple and walks a bucket.
#[map]
static REWRITE_PORTS: Array<u8> = Array::with_max_entries(65536, 0);

const ETH_P_IP: u16 = 0x0800;
const IPPROTO_TCP: u8 = 6;
const IP_OFF: u32 = 14;
const IP_CSUM: u32 = IP_OFF + 10;
const IP_SADDR: u32 = IP_OFF + 12;
const TCP_OFF: u32 = IP_OFF + 20;
const TCP_ACK: u32 = TCP_OFF + 8;
const TCP_CSUM: u32 = TCP_OFF + 16;
const OPT_OFF: u32 = TCP_OFF + 20;
const MAX_OPTS: u32 = 40;

const FIN: u8 = 0x01;
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const ACK: u8 = 0x10;

/// Ethernet, IPv4 without options and TCP, as they lie in the packet.
#[repr(C, packed)]
#[derive(Clone, Copy)]
struct Headers {
    _macs: [u8; 12],
    proto: u16,
    ver_ihl: u8,
    _tos: u8,
    tot_len: u16,
    _id: u16,
    _frag: u16,
    _ttl: u8,
    protocol: u8,
    _ip_csum: u16,
    saddr: u32,
    daddr: u32,
    sport: u16,
    dport: u16,
    seq: u32,
    ack: u32,
    doff: u8,
    flags: u8,
    _window: u16,
    _csum: u16,
    _urg: u16,
}

/// "Not mine": the next program on the interface (TCX), or the stack, decides. Several
/// daemons (tests, or a restart overlapping the old process) may each attach one.
const TC_ACT_UNSPEC: i32 = -1;

const TC_ACT_SHOT: i32 = 2;
/// The loopback device's index, the same in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;
const AF_INET: u8 = 2;

#[classifier]
pub fn waypoint_rewrite(ctx: TcContext) -> i32 {
    match rewrite(&ctx) {
        Some(to) => deliver(&ctx, &to),
        None => TC_ACT_UNSPEC,
    }
}

/// Sends a rewritten packet on its way: out of the interface towards its new
/// destination, or up the local stack if that is this host and it came in on lo. The
/// stack's own forwarding would drop it: its source is now one of this host's addresses
/// ("martian").
#[inline(always)]
fn deliver(ctx: &TcContext, to: &RewriteKey) -> i32 {
    // SAFETY: the context's skb, valid for the call.
    let ingress = unsafe { (*ctx.skb.skb).ingress_ifindex };
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut fib: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    fib.family = AF_INET;
    fib.l4_protocol = IPPROTO_TCP;
    fib.sport = to.sport;
    fib.dport = to.dport;
    fib.ifindex = ingress;
    fib.__bindgen_anon_3.ipv4_src = to.saddr;
    fib.__bindgen_anon_4.ipv4_dst = to.daddr;
    // SAFETY: the context's skb and a parameter block of the size passed.
    let rc = unsafe {
        fib_lookup_helper(
            ctx.skb.skb.cast::<c_void>(),
            &raw mut fib,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    } as u32;
    match rc {
        BPF_FIB_LKUP_RET_SUCCESS | BPF_FIB_LKUP_RET_NO_NEIGH => {
            // SAFETY: no parameters: the helper resolves the next hop itself.
            unsafe { bpf_redirect_neigh(fib.ifindex, core::ptr::null_mut(), 0, 0) as i32 }
        }
        // Arrived on lo: sent by this host to one of its addresses. With forwarding off
        // (not a node, a test machine), the lookup stops at that, and the packet is for
        // this host too.
        BPF_FIB_LKUP_RET_NOT_FWDED | BPF_FIB_LKUP_RET_FWD_DISABLED
            if ingress == LOOPBACK_IFINDEX =>
        {
            TC_ACT_OK
        }
        // No route; or for this host but arrived on another interface than lo, which the
        // stack would drop (its source is one of this host's addresses, a martian) and
        // the program cannot route: the daemon does not splice such connections
        // (`Refusal::Local`).
        _ => {
            count(RewriteStat::Unroutable);
            TC_ACT_SHOT
        }
    }
}

/// `port` has `bit` in [`REWRITE_PORTS`].
#[inline(always)]
fn port_has(port: u16, bit: u8) -> bool {
    REWRITE_PORTS
        .get(u32::from(port))
        .is_some_and(|b| *b & bit != 0)
}

#[inline(always)]
fn count(stat: RewriteStat) {
    if let Some(slot) = REWRITE_STATS.get_ptr_mut(stat as u32) {
        // SAFETY: a successful lookup in a per-CPU array: valid, and only this CPU
        // touches this slot.
        unsafe { *slot += 1 };
    }
}

/// Moves the entry's `next_seq` from `seen` (as read before) up to `end`, and counts the
/// bytes that moved it. Atomically: two CPUs can rewrite packets of one direction at once
/// (the sender's thread migrated, and its packets sit in two CPUs' backlogs), and a plain
/// read-modify-write would count the bytes between the old `next_seq` and each `end`
/// twice. Each failed exchange means another CPU moved `next_seq` meanwhile; after
/// [`ADVANCE_TRIES`] of them in a row the bytes go uncounted (`RewriteStat::Uncounted`;
/// the packet is rewritten all the same).
#[inline(always)]
fn advance(r: &mut Rewrite, mut seen: u32, end: u32) {
    // `next_seq` and the zero `_pad` after it, as one little-endian word: its value is
    // `next_seq`'s.
    let at = (&raw mut r.next_seq).cast::<u64>();
    for _ in 0..ADVANCE_TRIES {
        if seq_ge(seen, end) {
            return;
        }
        // SAFETY: `at` points into a map element that stays valid for this invocation
        // (see `rewrite`), 8-byte aligned (asserted in waypoint-common); other CPUs
        // touch it only atomically.
        let (was, swapped) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::Relaxed }, { AtomicOrdering::Relaxed }>(
                at,
                u64::from(seen),
                u64::from(end),
            )
        };
        if swapped {
            let moved = u64::from(end.wrapping_sub(seen));
            // SAFETY: as for `at`.
            unsafe {
                atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut r.bytes, moved)
            };
            return;
        }
        seen = was as u32;
    }
    if !seq_ge(seen, end) {
        count(RewriteStat::Uncounted);
    }
}

/// Compare-and-exchange attempts in [`advance`] before it gives up counting a packet.
const ADVANCE_TRIES: u32 = 8;

/// Sets bits of the entry's flags without losing another CPU's bits set meanwhile.
#[inline(always)]
fn flags_or(r: &mut Rewrite, bits: u64) {
    // SAFETY: as in `advance`.
    unsafe { atomic_or::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut r.flags, bits) };
}

/// Clears the bits of the entry's flags not in `keep`, atomically (see [`flags_or`]).
#[inline(always)]
fn flags_and(r: &mut Rewrite, keep: u64) {
    // SAFETY: as in `advance`.
    unsafe { atomic_and::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut r.flags, keep) };
}

/// `a` is at or after `b` in sequence space.
#[inline(always)]
fn seq_ge(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) >= 0
}

/// Replaces the 4 bytes at `off` (`from`, as read from the packet) with `to`, and fixes
/// the TCP checksum. For the one field the diverted ACK changes; a rewrite collects its
/// changes in a [`Csum`] instead.
#[inline(always)]
fn put32(ctx: &TcContext, off: u32, from: u32, to: u32) {
    if from == to {
        return;
    }
    let skb = ctx.skb.skb;
    // SAFETY: the context's skb, valid for the call; `to` lives on the stack for the
    // call's duration. The helpers check the offsets against the packet.
    unsafe {
        bpf_l4_csum_replace(skb, TCP_CSUM, u64::from(from), u64::from(to), 4);
        bpf_skb_store_bytes(skb, off, (&raw const to).cast(), 4, 0);
    }
}

/// The checksum change of a rewrite, collected field by field and applied at the end
/// with three helper calls (one per checksum field and kind), where a call per field and
/// checksum took most of a rewritten packet's time. Ones' complement sums of the 16-bit
/// words taken out (negated) and put in, as they lie in memory: the sum does not depend
/// on the byte order it is taken in. Kept apart for the fields in the pseudo header
/// (the addresses), which the IP checksum covers too and which alone go into the TCP
/// checksum of a packet whose checksum the device is still to complete
/// (CHECKSUM_PARTIAL): the helper tells the two by a flag.
#[derive(Clone, Copy, Default)]
struct Csum {
    pseudo: u64,
    plain: u64,
}

impl Csum {
    #[inline(always)]
    fn words(v: u32) -> u64 {
        u64::from(v >> 16) + u64::from(v & 0xffff)
    }

    /// The change of `from` to `to` in the pseudo header (`pseudo`) or elsewhere.
    #[inline(always)]
    fn change(&mut self, from: u32, to: u32, pseudo: bool) {
        if from == to {
            return;
        }
        let d = Self::words(!from) + Self::words(to);
        if pseudo {
            self.pseudo += d;
        } else {
            self.plain += d;
        }
    }

    /// A sum folded into 16 bits: a valid checksum difference for the helpers (their
    /// "size 0" form). A packet's worth of words sums to far less than 2^32, and two
    /// folds bring anything below that to 16 bits.
    #[inline(always)]
    fn fold(sum: u64) -> u64 {
        let s = (sum & 0xffff) + (sum >> 16);
        (s & 0xffff) + (s >> 16)
    }

    #[inline(always)]
    fn apply(&self, ctx: &TcContext) {
        let skb = ctx.skb.skb;
        let (pseudo, plain) = (Self::fold(self.pseudo), Self::fold(self.plain));
        // SAFETY: the context's skb, valid for the call; the helpers check the offsets
        // against the packet.
        unsafe {
            if pseudo != 0 {
                bpf_l3_csum_replace(skb, IP_CSUM, 0, pseudo, 0);
                bpf_l4_csum_replace(skb, TCP_CSUM, 0, pseudo, u64::from(BPF_F_PSEUDO_HDR));
            }
            if plain != 0 {
                bpf_l4_csum_replace(skb, TCP_CSUM, 0, plain, 0);
            }
        }
    }
}

/// Writes `N` bytes at `off`, the checksums left to a [`Csum`].
#[inline(always)]
fn store<const N: usize>(ctx: &TcContext, off: u32, bytes: &[u8; N]) {
    // SAFETY: the context's skb, valid for the call; `bytes` lives for the call. The
    // helper checks the offset against the packet.
    unsafe { bpf_skb_store_bytes(ctx.skb.skb, off, bytes.as_ptr().cast(), N as u32, 0) };
}

/// Four bytes as they lie in memory.
#[inline(always)]
fn raw(v: u32) -> [u8; 4] {
    v.to_ne_bytes()
}

/// Reports a connection's end to the daemon, without waking it (see
/// `waypoint_common::ENDS_MAP`).
fn signal_end(end: &RewriteEnd) {
    if crate::ENDS
        .output::<RewriteEnd>(end, u64::from(BPF_RB_NO_WAKEUP))
        .is_err()
    {
        crate::count(Stat::SignalLost);
    }
}

/// Whether this packet of entry `r` (under `key`) goes to the waypoint's socket B
/// instead, as it arrived but for its ack, rather than being rewritten: a pure ACK of the
/// pod while B waits for one. The first pure ACK at or past the hello's end
/// ([`REWRITE_WATCH`], `Rewrite::watch`) stops B's retransmission of the hello; if B also
/// carried bytes that landed in A during the hand-over (`REWRITE_FILLS`), the one at or
/// past their end does, for the hello and them. Every pure ACK before that goes to B too,
/// unchanged: it acknowledges no more than B sent. (A lost pure ACK costs the client
/// nothing: the next one says the same or more.) `ack` as in the packet; `bits`: the
/// payload length shifted left by 8, or'ed with the TCP flags.
///
/// Out of line, a BPF subprogram: inlined, its checks on the payload length and the
/// flags split the verifier's walk through the rest of the program in two (about
/// 270,000 instructions verified instead of 136,000); a call leaves the caller's state
/// as it was but for the result.
#[inline(never)]
fn diverted(ctx: &TcContext, r: &mut Rewrite, key: &RewriteKey, ack: u32, bits: u64) -> bool {
    let (payload, tcp_flags) = (bits >> 8, bits as u8);
    if r.flags & REWRITE_FROM_POD == 0 || payload != 0 || tcp_flags & (FIN | RST) != 0 {
        return false;
    }
    // SAFETY: a copy out of the element, valid for this invocation (RCU).
    let fill = unsafe { REWRITE_FILLS.get(key) }.copied();
    if r.flags & REWRITE_WATCH == 0 && fill.is_none() {
        return false;
    }
    let until = fill.unwrap_or(r.watch);
    if seq_ge(u32::from_be(ack), until) {
        put32(ctx, TCP_ACK, ack, until.to_be());
        flags_and(r, !REWRITE_WATCH);
        if fill.is_some() {
            let _ = REWRITE_FILLS.remove(key);
        }
    }
    count(RewriteStat::Diverted);
    true
}

/// Rewrites the packet if it belongs to a rewritten connection, and returns the 4-tuple
/// it now has; None if it is not ours (or is a SYN that ended the splice).
#[inline(always)]
fn rewrite(ctx: &TcContext) -> Option<RewriteKey> {
    let skb = ctx.skb.skb;
    let mut h = core::mem::MaybeUninit::<Headers>::uninit();
    let size = core::mem::size_of::<Headers>() as u32;
    // SAFETY: the helper writes at most `size` bytes into `h`, which has that size, and
    // fails on a shorter packet (which is then not ours).
    if unsafe { bpf_skb_load_bytes(skb.cast::<c_void>(), 0, h.as_mut_ptr().cast(), size) } < 0 {
        return None;
    }
    // SAFETY: fully written by the successful load above; every bit pattern is valid.
    let h = unsafe { h.assume_init() };
    if h.proto != ETH_P_IP.to_be() || h.ver_ihl != 0x45 || h.protocol != IPPROTO_TCP {
        return None;
    }
    // A SYN-ACK answers the SYN of a new connection, never a packet of a rewritten one
    // (whose 4-tuples the waypoint's sockets hold): no lookup. Each new connection has
    // two, and a new 4-tuple's lookup is a cold one.
    if h.flags & (SYN | ACK) == SYN | ACK {
        return None;
    }
    // Only a client's packet to A's port, or a pod's from its port, can be ours.
    if !port_has(u16::from_be(h.dport), PORT_CLIENT_TO)
        && !port_has(u16::from_be(h.sport), PORT_POD_FROM)
    {
        return None;
    }
    count(RewriteStat::LookedUp);
    let key = RewriteKey {
        saddr: h.saddr,
        daddr: h.daddr,
        sport: h.sport,
        dport: h.dport,
    };
    let Some(r) = REWRITES.get_ptr_mut(&key) else {
        return None;
    };
    // SAFETY: a successful lookup in a non-preallocated hash map: the element stays
    // valid for this invocation (RCU), even if userspace removes it meanwhile.
    let r = unsafe { &mut *r };
    let w = *r;
    let reverse = RewriteKey {
        saddr: w.to.daddr,
        daddr: w.to.saddr,
        sport: w.to.dport,
        dport: w.to.sport,
    };
    if h.flags & SYN != 0 {
        // A new connection with a rewritten 4-tuple: the rewritten one is gone (the client
        // reuses its port). Let the SYN through to the listener, and forget the splice.
        count(RewriteStat::Syn);
        let _ = REWRITES.remove(&key);
        let _ = REWRITES.remove(&reverse);
        signal_end(&RewriteEnd {
            slot: w.slot,
            how: END_GONE,
            ..RewriteEnd::default()
        });
        return None;
    }
    let doff = u32::from(h.doff >> 4) * 4;
    let payload = u32::from(u16::from_be(h.tot_len))
        .saturating_sub(20)
        .saturating_sub(doff);
    let seq = u32::from_be(h.seq);
    let ack = u32::from_be(h.ack);
    if diverted(
        ctx,
        r,
        &key,
        h.ack,
        (u64::from(payload) << 8) | u64::from(h.flags),
    ) {
        // To the waypoint's own socket, unchanged otherwise: the stack delivers it.
        return None;
    }
    let end = seq.wrapping_add(payload);
    // A FIN or a reset lies at the end of what its sender sent: it claims the bytes
    // before it even when their segment is still in another CPU's backlog (a sender
    // that migrated), so the end reported below counts every byte the receiver can read.
    if payload > 0 || h.flags & (FIN | RST) != 0 {
        advance(r, w.next_seq, end);
    }
    // SAFETY: `r` is valid (above); the field is 8-byte aligned (`Rewrite` is `repr(C)`).
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut r.packets, 1) };
    let mut ended = false;
    if h.flags & RST != 0 {
        flags_or(r, REWRITE_RST);
        ended = true;
    }
    if h.flags & FIN != 0 && w.flags & REWRITE_FIN == 0 {
        flags_or(r, REWRITE_FIN);
        if let Some(back) = REWRITES.get_ptr(&reverse) {
            // SAFETY: as for `r`.
            ended = unsafe { (*back).flags } & REWRITE_FIN != 0;
        }
    }

    // Addresses, ports, sequence and acknowledgement numbers lie together (offsets 26
    // to 46): one store. The addresses are in the pseudo header.
    let mut csum = Csum::default();
    csum.change(h.saddr, w.to.saddr, true);
    csum.change(h.daddr, w.to.daddr, true);
    let ports = u32::from(h.sport) | (u32::from(h.dport) << 16);
    let to_ports = u32::from(w.to.sport) | (u32::from(w.to.dport) << 16);
    let to_seq = seq.wrapping_add(w.seq_add).to_be();
    let to_ack = ack.wrapping_add(w.ack_add).to_be();
    csum.change(ports, to_ports, false);
    csum.change(h.seq, to_seq, false);
    csum.change(h.ack, to_ack, false);
    let mut block = [0u8; 20];
    block[0..4].copy_from_slice(&raw(w.to.saddr));
    block[4..8].copy_from_slice(&raw(w.to.daddr));
    block[8..12].copy_from_slice(&raw(to_ports));
    block[12..16].copy_from_slice(&raw(to_seq));
    block[16..20].copy_from_slice(&raw(to_ack));
    store(ctx, IP_SADDR, &block);
    if doff > 20 {
        options(ctx, r, &w, &reverse, doff - 20, &mut csum);
    }
    csum.apply(ctx);
    count(RewriteStat::Rewritten);
    if ended {
        let from_pod = w.flags & REWRITE_FROM_POD != 0;
        // SAFETY: as for `r`.
        let back = REWRITES
            .get_ptr(&reverse)
            .map_or(0, |b| unsafe { (*b).bytes });
        let (client_bytes, pod_bytes) = if from_pod {
            (back, r.bytes)
        } else {
            (r.bytes, back)
        };
        let how = match (h.flags & RST != 0, from_pod) {
            (true, true) => END_POD_RST,
            (true, false) => END_CLIENT_RST,
            (false, _) => END_CLOSED,
        };
        signal_end(&RewriteEnd {
            slot: w.slot,
            how,
            client_bytes,
            pod_bytes,
        });
    }
    Some(w.to)
}

/// Reads `N` bytes of the packet at `off`; None past its end.
#[inline(always)]
fn load<const N: usize>(ctx: &TcContext, off: u32) -> Option<[u8; N]> {
    let mut buf = [0u8; N];
    // SAFETY: at most N bytes into a buffer of that size; the helper checks the offset
    // against the packet.
    let r = unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb.cast::<c_void>(),
            off,
            buf.as_mut_ptr().cast(),
            N as u32,
        )
    };
    (r >= 0).then_some(buf)
}

/// Translates the timestamps and SACK blocks among the TCP options (`len` bytes). Each
/// field is read from the packet where it lies (the verifier refuses reads from a stack
/// buffer at an offset it cannot bound).
#[inline(always)]
fn options(
    ctx: &TcContext,
    r: &mut Rewrite,
    w: &Rewrite,
    reverse: &RewriteKey,
    len: u32,
    csum: &mut Csum,
) {
    if len > MAX_OPTS {
        count(RewriteStat::BadOptions);
        return;
    }
    // What nearly every segment of a connection with timestamps carries (Linux's
    // layout): NOP, NOP, timestamps. One load instead of five.
    if len == 12 {
        if let Some(o) = load::<12>(ctx, OPT_OFF) {
            if o[..4] == [1, 1, 8, 10] {
                let ts = [o[4], o[5], o[6], o[7], o[8], o[9], o[10], o[11]];
                timestamps(ctx, r, w, reverse, OPT_OFF + 4, ts, csum);
                return;
            }
        }
    }
    let mut i = 0u32;
    // Each option is at least one byte; 20 steps cover 40 bytes of options that are not
    // all padding.
    for _ in 0..20 {
        if i >= len {
            return;
        }
        let Some([kind]) = load::<1>(ctx, OPT_OFF + i) else {
            count(RewriteStat::BadOptions);
            return;
        };
        match kind {
            0 => return,
            1 => {
                i += 1;
                continue;
            }
            _ => {}
        }
        let olen = match load::<1>(ctx, OPT_OFF + i + 1) {
            Some([l]) if l >= 2 && i + u32::from(l) <= len => u32::from(l),
            _ => {
                count(RewriteStat::BadOptions);
                return;
            }
        };
        match (kind, olen) {
            (8, 10) => {
                let Some(ts) = load::<8>(ctx, OPT_OFF + i + 2) else {
                    count(RewriteStat::BadOptions);
                    return;
                };
                timestamps(ctx, r, w, reverse, OPT_OFF + i + 2, ts, csum);
            }
            (5, _) => {
                // SACK blocks are acknowledgements: they move like the ack number.
                for b in 0..4u32 {
                    let at = i + 2 + b * 8;
                    if at + 8 > i + olen {
                        break;
                    }
                    let Some(edges) = load::<8>(ctx, OPT_OFF + at) else {
                        count(RewriteStat::BadOptions);
                        return;
                    };
                    let left = u32::from_ne_bytes([edges[0], edges[1], edges[2], edges[3]]);
                    let right = u32::from_ne_bytes([edges[4], edges[5], edges[6], edges[7]]);
                    let moved = |e: u32| u32::from_be(e).wrapping_add(w.ack_add).to_be();
                    let (to_left, to_right) = (moved(left), moved(right));
                    csum.change(left, to_left, false);
                    csum.change(right, to_right, false);
                    let mut block = [0u8; 8];
                    block[0..4].copy_from_slice(&raw(to_left));
                    block[4..8].copy_from_slice(&raw(to_right));
                    store(ctx, OPT_OFF + at, &block);
                }
            }
            _ => {}
        }
        i += olen;
    }
}

/// TSval moves into the clock of the socket whose identity the packet takes on, TSecr
/// back into the receiver's own: every connection has its own random TSval offset, and
/// a receiver's PAWS check drops segments whose TSval looks older than the last one.
/// `off`: the packet offset of TSval; `ts`: the option's eight bytes found there.
#[inline(always)]
fn timestamps(
    ctx: &TcContext,
    r: &mut Rewrite,
    w: &Rewrite,
    reverse: &RewriteKey,
    off: u32,
    ts: [u8; 8],
    csum: &mut Csum,
) {
    let val_raw = u32::from_ne_bytes([ts[0], ts[1], ts[2], ts[3]]);
    let ecr_raw = u32::from_ne_bytes([ts[4], ts[5], ts[6], ts[7]]);
    let tsval = u32::from_be(val_raw);
    let add = if w.ts_add & TS_ADD_LEARNED != 0 {
        w.ts_add as u32
    } else {
        // SAFETY: the helper has no preconditions.
        let now = (unsafe { bpf_ktime_get_ns() } / 1_000_000) as u32;
        let mine = now.wrapping_add(w.ts_off).wrapping_sub(tsval);
        // One learner wins; a packet that lost the race takes the winner's value (see
        // `Rewrite::ts_add`).
        // SAFETY: as for `at` in `advance`: the field is in the map element, 8-byte
        // aligned (asserted in waypoint-common), and other CPUs touch it only atomically.
        let (was, won) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::Relaxed }, { AtomicOrdering::Relaxed }>(
                &raw mut r.ts_add,
                0,
                TS_ADD_LEARNED | u64::from(mine),
            )
        };
        if won {
            if let Some(back) = REWRITES.get_ptr_mut(reverse) {
                // SAFETY: as for `r` in `rewrite`.
                unsafe { (*back).ecr_sub = mine };
            }
            mine
        } else {
            was as u32
        }
    };
    let to_val = tsval.wrapping_add(add).to_be();
    let tsecr = u32::from_be(ecr_raw);
    let to_ecr = if tsecr == 0 {
        ecr_raw
    } else {
        tsecr.wrapping_sub(w.ecr_sub).to_be()
    };
    csum.change(val_raw, to_val, false);
    csum.change(ecr_raw, to_ecr, false);
    let mut block = [0u8; 8];
    block[0..4].copy_from_slice(&raw(to_val));
    block[4..8].copy_from_slice(&raw(to_ecr));
    store(ctx, off, &block);
}
