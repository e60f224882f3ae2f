//! Records the sequence numbers of the daemon's sockets at the end of their handshake, in
//! the socket's own storage (see `waypoint_common::Established`).
//!
//! Attached to the daemon's cgroup (SOCK_OPS), so it runs at every TCP socket's
//! callbacks there; it acts only at the two "established" callbacks and only on sockets
//! that already have a record: the daemon puts an empty one on its listeners, whose
//! record the kernel copies into every socket they accept (the map's `BPF_F_CLONE`), and
//! on each socket it dials before the connect. A socket that connects to the pods' port
//! (`POD_PORT`) gets its record here instead, which spares the daemon that system call
//! (the storage's allocation is the same, without the syscall's file lookup and copies).
//! Every other socket costs one storage lookup that finds nothing.

use core::ffi::c_void;

use aya_ebpf::{
    bindings::{
        bpf_map_type::BPF_MAP_TYPE_SK_STORAGE, BPF_F_CLONE, BPF_F_NO_PREALLOC,
        BPF_SK_STORAGE_GET_F_CREATE, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
    },
    helpers::{bpf_probe_read_kernel, bpf_sk_storage_get},
    macros::{btf_map, sock_ops},
    programs::SockOpsContext,
};
use waypoint_common::{Established, ESTABLISHED_SET, ESTABLISHED_TS_OFFSET, ESTABLISHED_V4};

/// The layout the loader reads a BTF map definition from (as libbpf's `__uint` and
/// `__type` fields). aya-ebpf's own `SkStorage` fixes the flags to `BPF_F_NO_PREALLOC`
/// alone; the record must also be cloned into accepted sockets.
#[repr(C)]
pub struct SkStorageDef {
    r#type: *const [i32; BPF_MAP_TYPE_SK_STORAGE as usize],
    key: *const i32,
    value: *const Established,
    max_entries: *const [i32; 0],
    map_flags: *const [i32; (BPF_F_NO_PREALLOC | BPF_F_CLONE) as usize],
}

// SAFETY: the fields are placeholders the loader reads from BTF; nothing dereferences
// them, and only the map's address is passed to helpers.
unsafe impl Sync for SkStorageDef {}

#[btf_map]
static ESTABLISHED: SkStorageDef = SkStorageDef {
    r#type: core::ptr::null(),
    key: core::ptr::null(),
    value: core::ptr::null(),
    max_entries: core::ptr::null(),
    map_flags: core::ptr::null(),
};

// Kernel structure offsets, set by the loader from the running kernel's BTF (see
// `waypoint_common::TCP_TSOFFSET_OFFSET`); 0 for the second leaves `ts_offset` unread.
#[unsafe(no_mangle)]
static SOCK_OPS_SK_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TCP_TSOFFSET_OFFSET: u32 = 0;
/// The port the daemon dials pods on (host byte order; 0: none), set by the loader.
#[unsafe(no_mangle)]
static POD_PORT: u32 = 0;

const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;
/// The third word of an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`), as loaded.
const V4_MAPPED: u32 = u32::from_be(0x0000_ffff);

#[sock_ops]
pub fn waypoint_established(ctx: SockOpsContext) -> u32 {
    let op = ctx.op();
    if op == BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB || op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB {
        // Read once: the verifier refuses a second read of a context field through a
        // pointer the compiler moved (it did, for the record below).
        let remote_port = u32::from_be(ctx.remote_port());
        // SAFETY: a plain global; volatile so the loader's value is used.
        let pod_port = unsafe { core::ptr::read_volatile(&POD_PORT) };
        let create =
            op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB && pod_port != 0 && remote_port == pod_port;
        let flags = if create {
            BPF_SK_STORAGE_GET_F_CREATE.into()
        } else {
            0
        };
        record(&ctx, remote_port as u16, flags);
    }
    // Anything else would make the kernel ignore the context's reply (left zero: the
    // defaults) or refuse the operation.
    1
}

/// Fills the socket's record; with `BPF_SK_STORAGE_GET_F_CREATE` in `flags` the record
/// is created (zeroed) if the daemon did not mark the socket.
#[inline(always)]
fn record(ctx: &SockOpsContext, remote_port: u16, flags: u64) {
    let ops = ctx.ops;
    // SAFETY: the context, valid for the call; `sk` is readable at the established
    // callbacks (the verifier checks it for null below).
    let sk = unsafe { (*ops).__bindgen_anon_2.sk };
    if sk.is_null() {
        return;
    }
    // SAFETY: the map's address and a socket from the context; no initial value (zeroes
    // when created).
    let rec = unsafe {
        bpf_sk_storage_get(
            (&raw const ESTABLISHED).cast_mut().cast::<c_void>(),
            sk.cast(),
            core::ptr::null_mut(),
            flags,
        )
    }
    .cast::<Established>();
    if rec.is_null() {
        return;
    }
    // SAFETY: context fields of an established (full) socket.
    let (snd_una, rcv_nxt, acked, received, family) = unsafe {
        (
            (*ops).snd_una,
            (*ops).rcv_nxt,
            (*ops).bytes_acked,
            (*ops).bytes_received,
            (*ops).family,
        )
    };
    let mut flags = ESTABLISHED_SET;
    let (mut local, mut remote) = (0, 0);
    if family == AF_INET {
        local = ctx.local_ip4();
        remote = ctx.remote_ip4();
        flags |= ESTABLISHED_V4;
    } else if family == AF_INET6 {
        let (l, r) = (ctx.local_ip6(), ctx.remote_ip6());
        if l[0] == 0
            && l[1] == 0
            && l[2] == V4_MAPPED
            && r[0] == 0
            && r[1] == 0
            && r[2] == V4_MAPPED
        {
            local = l[3];
            remote = r[3];
            flags |= ESTABLISHED_V4;
        }
    }
    let mut ts_offset = 0;
    if let Some(ts) = tsoffset(ops.cast::<u8>()) {
        ts_offset = ts;
        flags |= ESTABLISHED_TS_OFFSET;
    }
    // SAFETY: the storage's value for this socket, valid for the program's run.
    let rec = unsafe { &mut *rec };
    rec.snd_base = snd_una.wrapping_sub(acked as u32);
    rec.rcv_base = rcv_nxt.wrapping_sub(received as u32);
    rec.ts_offset = ts_offset;
    rec.local_ip4 = local;
    rec.remote_ip4 = remote;
    rec.local_port = ctx.local_port() as u16;
    rec.remote_port = remote_port;
    rec.flags = flags;
}

/// The socket's `tsoffset`, when the loader found the offsets: the kernel context (a
/// `struct bpf_sock_ops_kern`) holds the socket's address, read with the helper since
/// no context field exposes it as a plain value.
#[inline(always)]
fn tsoffset(kern: *const u8) -> Option<u32> {
    // SAFETY: plain globals; volatile so the loader's values are used.
    let (sk_offset, ts_offset) = unsafe {
        (
            core::ptr::read_volatile(&SOCK_OPS_SK_OFFSET),
            core::ptr::read_volatile(&TCP_TSOFFSET_OFFSET),
        )
    };
    if ts_offset == 0 {
        return None;
    }
    // SAFETY: offsets from the running kernel's BTF into `struct bpf_sock_ops_kern` and
    // `struct tcp_sock` (the callbacks above are TCP's); the helper faults safely.
    let sk = unsafe { bpf_probe_read_kernel(kern.add(sk_offset as usize).cast::<u64>()) }.ok()?;
    if sk == 0 {
        return None;
    }
    // SAFETY: as above.
    unsafe { bpf_probe_read_kernel((sk as usize + ts_offset as usize) as *const u32) }.ok()
}
