//! `bpf(2)` commands aya does not wrap, and reading aya's maps the way both BPF paths
//! need (`per_cpu_total`). The commands: several elements of a map inserted or removed in
//! one system call (`BPF_MAP_UPDATE_BATCH`, `BPF_MAP_DELETE_BATCH`, kernel 5.6+; the
//! rewrite splice puts in two entries per connection, one call instead of two on every
//! connection's setup path, and takes out those of every connection whose linger ended
//! in one call), and the raw call itself (the tests also run programs with
//! `BPF_PROG_TEST_RUN`).

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd},
};

use aya::{
    maps::{MapData, PerCpuArray},
    Pod,
};

/// Entry `index` of a per-CPU statistics array, summed over CPUs (0 if unreadable).
pub(super) fn per_cpu_total(stats: &PerCpuArray<MapData, u64>, index: u32) -> u64 {
    stats.get(&index, 0).map(|v| v.iter().sum()).unwrap_or(0)
}

const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

/// The batch commands' part of `union bpf_attr` (include/uapi/linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct Batch {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// A batch that stopped early: `done` elements were processed (in order) before `error`.
#[derive(Debug)]
pub struct Partial {
    pub done: usize,
    pub error: io::Error,
}

/// Inserts or replaces `keys[i]` → `values[i]`, in order.
pub fn update<K: Pod, V: Pod, const N: usize>(
    map: BorrowedFd<'_>,
    keys: &[K; N],
    values: &[V; N],
) -> Result<(), Partial> {
    run(BPF_MAP_UPDATE_BATCH, map, keys, values.as_ptr() as u64)
}

/// Removes `keys`, in order. A key that is not there stops the batch ([`Partial`],
/// `ENOENT`): the caller removes the rest one by one if it wants them gone.
pub fn delete<K: Pod>(map: BorrowedFd<'_>, keys: &[K]) -> Result<(), Partial> {
    run(BPF_MAP_DELETE_BATCH, map, keys, 0)
}

/// `cmd` over `keys` (and `values`, as many, for an update).
fn run<K: Pod>(
    cmd: libc::c_long,
    map: BorrowedFd<'_>,
    keys: &[K],
    values: u64,
) -> Result<(), Partial> {
    let Ok(count) = u32::try_from(keys.len()) else {
        return Err(Partial {
            done: 0,
            error: io::Error::from_raw_os_error(libc::E2BIG),
        });
    };
    let mut attr = Batch {
        keys: keys.as_ptr() as u64,
        values,
        count,
        map_fd: map.as_raw_fd() as u32,
        ..Batch::default()
    };
    // SAFETY: `keys` (and `values`, for an update) hold `count` elements of the map's
    // key (value) type, laid out as the kernel reads them (`Pod`), and live for the call.
    if let Err(error) = unsafe { call(cmd, &mut attr) } {
        // The kernel writes back how many it processed.
        let done = attr.count as usize;
        return Err(Partial { done, error });
    }
    Ok(())
}

/// `bpf(cmd, attr, size_of::<A>())`.
///
/// # Safety
/// `A` must be `cmd`'s part of `union bpf_attr`, and every pointer in `attr` must point
/// to memory that the command may read or write as it documents, for the call.
pub unsafe fn call<A>(cmd: libc::c_long, attr: &mut A) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a valid block of the size passed; the rest is the caller's.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(attr), size_of::<A>()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc)
}
