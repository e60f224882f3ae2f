//! The waypoint's in-kernel splice.
//!
//! One SK_SKB stream verdict program over one SockHash. Each spliced socket is stored in
//! `PEERS` under its **peer's** cookie, so a segment arriving on socket A is redirected to
//! the egress of `PEERS[cookie(A)]` = B, and bytes flow A→B without reaching userspace.
//!
//! The program never drops a byte: whenever it does not redirect, it returns SK_PASS and
//! the bytes stay readable on the source socket for the daemon to forward itself. See
//! `waypoint_common::FlowBudget` for the two conditions under which it redirects, and
//! docs/ARCHITECTURE.md for why (ordering, and a bounded in-flight backlog).
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{
        sk_action::{SK_DROP, SK_PASS},
        BPF_F_NO_PREALLOC,
    },
    helpers::bpf_get_socket_cookie,
    macros::{map, stream_verdict},
    maps::{HashMap, PerCpuArray, SockHash},
    programs::SkBuffContext,
};
use waypoint_common::{FlowBudget, FlowCounters, Stat, DEFAULT_MAX_SOCKETS, STAT_COUNT};

#[map]
static PEERS: SockHash<u64> = SockHash::with_max_entries(DEFAULT_MAX_SOCKETS, 0);

// Not preallocated: in a preallocated hash map an element replaced by an update (or
// removed) goes straight back to the free list and can be reused by the next update of
// *another* key while a verdict still reads it through the pointer it looked up. With
// BUDGETS updated every millisecond by every connection, a verdict could then read
// another flow's credit and consumed, see "caught up" while userspace still holds bytes,
// and redirect out of order. Without preallocation, replaced elements are freed only
// after an RCU grace period, and the verdict runs inside one.
#[map]
static COUNTERS: HashMap<u64, FlowCounters> =
    HashMap::with_max_entries(DEFAULT_MAX_SOCKETS, BPF_F_NO_PREALLOC);

#[map]
static BUDGETS: HashMap<u64, FlowBudget> =
    HashMap::with_max_entries(DEFAULT_MAX_SOCKETS, BPF_F_NO_PREALLOC);

#[map]
static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(STAT_COUNT, 0);

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

    let Some(counters) = COUNTERS.get_ptr_mut(cookie) else {
        count(Stat::PassedUnknown);
        return SK_PASS;
    };
    // SAFETY: the pointer is from a successful lookup. Verdicts for one socket run under
    // that socket's lock, so nothing else writes this value concurrently; userspace only
    // reads it.
    let counters = unsafe { &mut *counters };
    // SAFETY: a successful lookup; the value is copied out before use.
    let Some(budget) = (unsafe { BUDGETS.get(cookie) }).copied() else {
        counters.passed += len;
        count(Stat::PassedUnknown);
        return SK_PASS;
    };

    if counters.passed != budget.consumed {
        // Userspace still holds bytes that came before this segment.
        counters.passed += len;
        count(Stat::PassedOrdering);
        return SK_PASS;
    }
    if counters.redirected + len > budget.credit {
        counters.passed += len;
        count(Stat::PassedBudget);
        return SK_PASS;
    }
    // Flags 0: to the peer's egress (its TCP send path), not its receive queue.
    let action = PEERS.redirect_skb(ctx, cookie, 0);
    if action == i64::from(SK_PASS) {
        counters.redirected += len;
        count(Stat::Redirected);
        SK_PASS
    } else {
        // The helper's failure is SK_DROP. Dropping would lose bytes the sender already
        // saw ACKed, so keep them here for userspace instead.
        counters.passed += len;
        count(Stat::PassedNoPeer);
        SK_PASS
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
