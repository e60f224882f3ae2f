//! Where a closing tunnel listener's queued connections go.
//!
//! Every daemon's tunnel listeners share one SO_REUSEPORT group on the node, and a
//! rolling update closes the old daemon's listeners while the new daemon's listen. When
//! a listener closes, the kernel moves the connections queued on it (and the handshakes
//! still in flight towards it) to another listener of the group: by hash among all that
//! still listen, the old daemon's other listeners included, which close soon after. A
//! connection handed to a listener that closes meanwhile is reset.
//!
//! This program, attached to the group by the newest daemon (the last one attached
//! wins), picks the target among that daemon's own listeners, which stay open: one move
//! per connection. It leaves new connections to the kernel's hash (returning SK_PASS
//! with no socket chosen) and, when none of its listeners can take a connection (they
//! are closing too), leaves that to the hash as well.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::sk_action::SK_PASS,
    macros::{map, sk_reuseport},
    maps::ReusePortSockArray,
    programs::SkReuseportContext,
};
use waypoint_common::MAX_LISTENERS;

/// The attaching daemon's listeners, one per worker; the loader sizes it.
#[map]
static LISTENERS: ReusePortSockArray = ReusePortSockArray::with_max_entries(MAX_LISTENERS, 0);

/// How many entries `LISTENERS` has (set by the loader; .rodata, so a constant to the
/// verifier).
#[unsafe(no_mangle)]
static LISTENER_COUNT: u32 = 1;

#[sk_reuseport(migrate)]
pub fn waypoint_migrate(ctx: SkReuseportContext) -> u32 {
    if ctx.migrating_sk().is_none() {
        // A new connection: the kernel's hash (and SO_INCOMING_CPU) choose.
        return SK_PASS;
    }
    // SAFETY: a plain read of a .rodata global the loader set.
    let count = unsafe { core::ptr::read_volatile(&LISTENER_COUNT) };
    if count == 0 {
        return SK_PASS;
    }
    let start = ctx.hash() % count;
    // An entry is empty once its listener closed; the first that takes it wins.
    for i in 0..MAX_LISTENERS {
        if i >= count {
            break;
        }
        let mut key = start + i;
        if key >= count {
            key -= count;
        }
        if LISTENERS.select_reuseport(&ctx, key).is_ok() {
            return SK_PASS;
        }
    }
    SK_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
