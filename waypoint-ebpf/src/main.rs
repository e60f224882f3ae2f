//! The waypoint's in-kernel splice.
//!
//! One SK_SKB stream verdict program over one SockHash. Each redirected socket is stored in
//! `PEERS` under its **peer's** cookie, so a segment arriving on socket A is redirected to
//! the egress of `PEERS[cookie(A)]` = B, and bytes flow A→B without reaching userspace.
//!
//! The program never drops a byte: whenever it does not redirect, it returns SK_PASS and
//! the bytes stay readable on the source socket for the daemon to forward itself. See
//! `waypoint_common::Flow` for the two conditions under which it redirects, and
//! docs/ARCHITECTURE.md for why (ordering, and a bounded in-flight backlog).
//!
//! It also cuts off bytes a segment repeats. TCP queues a segment that starts below
//! `rcv_nxt` whole (after a retransmission overtook the original), and an ordinary reader
//! skips the repeat by reading from `copied_seq`; the verdict path is handed the whole
//! segment and would forward the repeat a second time. So the program tracks, per socket,
//! the sequence number after the last byte it saw, and trims what lies below it.
#![no_std]
#![no_main]
// BPF atomics (compare-and-exchange, fetch-and-add): the bpfel target has no `atomic-cas`,
// so core's atomic types offer only loads and stores on it.
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod established;
mod rewrite;

use aya_ebpf::{
    bindings::{
        sk_action::{SK_DROP, SK_PASS},
        BPF_F_MMAPABLE, BPF_F_NO_PREALLOC,
    },
    helpers::{bpf_get_socket_cookie, bpf_probe_read_kernel},
    macros::{map, stream_verdict},
    maps::{Array, HashMap, PerCpuArray, RingBuf, SockHash},
    programs::SkBuffContext,
};
use waypoint_common::{Flow, Signal, Stat, DEFAULT_MAX_SOCKETS, SIGNALS_BYTES, STAT_COUNT};

#[map]
static PEERS: SockHash<u64> = SockHash::with_max_entries(DEFAULT_MAX_SOCKETS, 0);

// Not preallocated: in a preallocated hash map a removed element goes straight back to
// the free list and can be reused for another cookie while a verdict still reads it
// through the pointer it looked up. (The slot's `owner` check below catches that too.)
#[map]
static SLOTS: HashMap<u64, u32> = HashMap::with_max_entries(DEFAULT_MAX_SOCKETS, BPF_F_NO_PREALLOC);

// Mapped into the daemon's memory: it writes budgets and reads counters without syscalls.
#[map]
static FLOWS: Array<Flow> = Array::with_max_entries(DEFAULT_MAX_SOCKETS, BPF_F_MMAPABLE);

// Tells the daemon which sockets started passing bytes (see `waypoint_common::Signal`).
#[map]
static SIGNALS: RingBuf = RingBuf::with_byte_size(SIGNALS_BYTES, 0);

// Tells the daemon which rewritten connections ended, without waking it (see
// `waypoint_common::ENDS_MAP`).
#[map]
static ENDS: RingBuf = RingBuf::with_byte_size(SIGNALS_BYTES, 0);

#[map]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(STAT_COUNT, 0);

// Kernel structure offsets, set by the loader from the running kernel's BTF (see
// `waypoint_common::SKB_SEQ_OFFSET`). They live in .rodata, which is frozen before the
// program is verified, so the verifier knows them as constants: with 0, the overlap
// check is dead code and never needs bpf_probe_read_kernel (CAP_PERFMON).
#[unsafe(no_mangle)]
static SKB_SEQ_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SKB_SK_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TCP_COPIED_SEQ_OFFSET: u32 = 0;

/// `bpf_skb_adjust_room` removes at most 0xfff bytes per call.
const TRIM_STEP: u32 = 0xfff;
/// Calls per segment: 16 × 4095 bytes covers the overlap of a retransmitted segment
/// (a GSO segment of a standard MTU, or of loopback's 64 KiB).
const TRIM_STEPS: u32 = 16;

/// The longest repeat the program cuts. A longer one goes to userspace, which drops it
/// (`Flow::skips`): the repeat at a socket's entry into the SockHash (what the
/// userspace copy read of a queued segment) can be as long as a segment TCP coalesced in
/// a queue nobody read, hundreds of KB. The loader lowers it only in tests.
#[unsafe(no_mangle)]
static TRIM_LIMIT: u32 = TRIM_STEPS * TRIM_STEP;

#[stream_verdict]
pub fn waypoint_verdict(ctx: SkBuffContext) -> u32 {
    verdict(&ctx)
}

#[inline(always)]
fn count(stat: Stat) {
    if let Some(slot) = STATS.get_ptr_mut(stat as u32) {
        // SAFETY: the pointer comes from a successful lookup in a per-CPU array, so it is
        // valid and only this CPU touches this slot.
        unsafe { *slot += 1 };
    }
}

/// Passes `len` bytes to userspace, and tells it so if it had read everything before:
/// userspace does not wait for its redirected sockets to turn readable (see
/// `waypoint_common::Signal`). Counting first, so that a woken reader sees the bytes
/// counted (the kernel queues them right after the verdict returns).
#[inline(always)]
fn pass(flow: &mut Flow, slot: u32, consumed: u64, len: u64, stat: Stat) -> u32 {
    let first = flow.passed == consumed;
    flow.passed += len;
    count(stat);
    if first {
        let signal = Signal { slot, _pad: 0 };
        if SIGNALS.output::<Signal>(&signal, 0).is_err() {
            count(Stat::SignalLost);
        }
    }
    SK_PASS
}

#[inline(always)]
fn verdict(ctx: &SkBuffContext) -> u32 {
    let len = u64::from(ctx.len());
    // A bare FIN arrives as an empty segment. It carries no byte: TCP has already
    // marked the socket shut for reading, which is how the daemon sees EOF. Redirecting
    // it breaks the peer's pipe (EPIPE), and passing it is no better: when the socket's
    // psock backlog is busy the kernel queues it there, and an empty segment ends that
    // backlog with a "hard error" that disables the socket's egress for good. So drop it.
    if len == 0 {
        count(Stat::DroppedEmpty);
        return SK_DROP;
    }
    // SAFETY: the skb pointer is the program's context, valid for the whole invocation.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.skb.skb.cast()) };

    // SAFETY: a successful lookup; the value is copied out at once.
    let Some(slot) = (unsafe { SLOTS.get(cookie) }).copied() else {
        count(Stat::PassedUnknown);
        return SK_PASS;
    };
    let Some(flow) = FLOWS.get_ptr_mut(slot) else {
        count(Stat::PassedUnknown);
        return SK_PASS;
    };
    // SAFETY: the pointer is from a successful array lookup, valid while the map lives.
    // Verdicts for one socket run under that socket's lock, so nothing else writes the
    // kernel's fields concurrently; userspace writes only its own fields, which are read
    // with volatile loads (userspace may change them at any time).
    let flow = unsafe { &mut *flow };
    // SAFETY: a read of a field of the valid record above.
    if unsafe { core::ptr::read_volatile(&flow.owner) } != cookie {
        // The slot is being handed to another socket: not ours any more.
        count(Stat::PassedUnknown);
        return SK_PASS;
    }
    // SAFETY: a read of a field of the valid record above; userspace writes it at any
    // time, and it only grows. An old value makes a pass look like the first one (an
    // extra signal) or not (userspace is reading then anyway).
    let consumed = unsafe { core::ptr::read_volatile(&flow.consumed) };
    // SAFETY: a read of a plain global; volatile so the loader's value is used.
    let seq_offset = unsafe { core::ptr::read_volatile(&SKB_SEQ_OFFSET) };
    let len = if seq_offset == 0 {
        len
    } else {
        match trim_repeat(ctx, flow, seq_offset, len as u32) {
            Trim::Kept(kept) => u64::from(kept),
            Trim::Whole => {
                count(Stat::DroppedDuplicate);
                return SK_DROP;
            }
            Trim::Skip(kept) => {
                // Userspace drops the repeat as it reads; from here on everything is
                // passed until it has caught up, as after any pass.
                return pass(flow, slot, consumed, u64::from(kept), Stat::PassedRepeat);
            }
        }
    };
    // SAFETY: a read of a field of the valid record above. Userspace raises `consumed`
    // and `credit` separately; either order of seeing the two is safe, because both only
    // grow: an old `consumed` fails the ordering check, an old `credit` is the smaller
    // bound.
    let credit = unsafe { core::ptr::read_volatile(&flow.credit) };

    if flow.passed != consumed {
        // Userspace still holds bytes that came before this segment.
        flow.passed += len;
        count(Stat::PassedOrdering);
        return SK_PASS;
    }
    if flow.redirected + len > credit {
        return pass(flow, slot, consumed, len, Stat::PassedBudget);
    }
    // Flags 0: to the peer's egress (its TCP send path), not its receive queue.
    let action = PEERS.redirect_skb(ctx, cookie, 0);
    if action == i64::from(SK_PASS) {
        flow.redirected += len;
        count(Stat::Redirected);
        SK_PASS
    } else {
        // The helper's failure is SK_DROP. Dropping would lose bytes the sender already
        // saw ACKed, so keep them here for userspace instead.
        pass(flow, slot, consumed, len, Stat::PassedNoPeer)
    }
}

enum Trim {
    /// The segment goes on with this many bytes.
    Kept(u32),
    /// Every byte was a repeat, and all were cut: drop the empty segment.
    Whole,
    /// The repeat could not be cut: pass the segment (this many bytes) to userspace,
    /// which drops the repeat, as the socket's skip records say.
    Skip(u32),
}

/// Cuts the bytes of this segment that lie below the socket's `next_seq` (already seen)
/// and advances `next_seq` past it.
#[inline(always)]
fn trim_repeat(ctx: &SkBuffContext, flow: &mut Flow, seq_offset: u32, len: u32) -> Trim {
    let skb = ctx.skb.skb.cast::<u8>().cast_const();
    // SAFETY: the context is the kernel's `struct sk_buff`, and `seq_offset` is where the
    // running kernel's BTF puts `TCP_SKB_CB(skb)->seq` in it; the helper faults safely.
    let Ok(seq) = (unsafe { bpf_probe_read_kernel(skb.add(seq_offset as usize).cast::<u32>()) })
    else {
        return Trim::Kept(len);
    };
    if flow.seq_known == 0 {
        // The first segment: the socket's reader (userspace so far) has consumed up to
        // copied_seq, so anything below it is a repeat too.
        flow.next_seq = copied_seq(skb).unwrap_or(seq);
        flow.seq_known = 1;
    }
    // Sequence numbers wrap: the signed distance says which side of next_seq we are on.
    let repeat = flow.next_seq.wrapping_sub(seq) as i32;
    if repeat <= 0 {
        flow.next_seq = seq.wrapping_add(len);
        return Trim::Kept(len);
    }
    let repeat = repeat as u32;
    let cut = repeat.min(len);
    // SAFETY: a read of a plain global; volatile so the loader's value is used.
    let limit = unsafe { core::ptr::read_volatile(&TRIM_LIMIT) };
    let mut left = cut;
    if cut <= limit && cut <= TRIM_STEPS * TRIM_STEP {
        // Each cut first pulls the bytes it removes into the segment's linear part.
        // Pulling them all at once costs one allocation of the head; cut by cut, the
        // kernel would re-allocate and copy a head 4 KB longer sixteen times.
        let pulled = cut <= TRIM_STEP || ctx.pull_data(cut).is_ok();
        if !pulled {
            count(Stat::CutRefused);
        }
        for _ in 0..TRIM_STEPS {
            if left == 0 || !pulled {
                break;
            }
            let step = left.min(TRIM_STEP);
            if ctx.adjust_room(-(step as i32), 0, 0).is_err() {
                count(Stat::CutRefused);
                break;
            }
            left -= step;
        }
    }
    let removed = cut - left;
    flow.trimmed += u64::from(removed);
    if repeat < len {
        flow.next_seq = seq.wrapping_add(len);
    }
    let kept = len - removed;
    if left == 0 {
        if repeat >= len {
            return Trim::Whole;
        }
        count(Stat::Trimmed);
        return Trim::Kept(kept);
    }
    // The segment still starts with `left` repeated bytes: record them for userspace,
    // in the socket's first free record. Records are never changed once set, because
    // userspace reads them without locks.
    for skip in flow.skips.iter_mut() {
        if skip.len == 0 {
            skip.at = flow.passed;
            skip.len = left;
            return Trim::Skip(kept);
        }
    }
    // Duplicated bytes, counted, rather than a dropped segment whose new bytes would be
    // lost.
    count(Stat::TrimFailed);
    Trim::Kept(kept)
}

/// The socket's `copied_seq`, when the loader found its offset.
#[inline(always)]
fn copied_seq(skb: *const u8) -> Option<u32> {
    // SAFETY: plain globals; volatile so the loader's values are used.
    let (sk_offset, copied_offset) = unsafe {
        (
            core::ptr::read_volatile(&SKB_SK_OFFSET),
            core::ptr::read_volatile(&TCP_COPIED_SEQ_OFFSET),
        )
    };
    if sk_offset == 0 || copied_offset == 0 {
        return None;
    }
    // SAFETY: offsets from the running kernel's BTF into `struct sk_buff` and `struct
    // tcp_sock` (the socket of a stream verdict is TCP); the helper faults safely.
    let sk = unsafe { bpf_probe_read_kernel(skb.add(sk_offset as usize).cast::<u64>()) }.ok()?;
    if sk == 0 {
        return None;
    }
    // SAFETY: as above.
    unsafe { bpf_probe_read_kernel((sk as usize + copied_offset as usize) as *const u32) }.ok()
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
