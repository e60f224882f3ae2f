//! Several elements of a BPF map inserted or removed in one system call
//! (`BPF_MAP_UPDATE_BATCH`, `BPF_MAP_DELETE_BATCH`, kernel 5.6+), which aya does not
//! wrap. The rewrite splice puts in and takes out two entries per connection; one call
//! instead of two on every connection's setup path.

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd},
};

use aya::Pod;

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
pub fn delete<K: Pod, const N: usize>(map: BorrowedFd<'_>, keys: &[K; N]) -> Result<(), Partial> {
    run(BPF_MAP_DELETE_BATCH, map, keys, 0)
}

fn run<K: Pod, const N: usize>(
    cmd: libc::c_long,
    map: BorrowedFd<'_>,
    keys: &[K; N],
    values: u64,
) -> Result<(), Partial> {
    let mut attr = Batch {
        keys: keys.as_ptr() as u64,
        values,
        count: N as u32,
        map_fd: map.as_raw_fd() as u32,
        ..Batch::default()
    };
    // SAFETY: `attr` is the command's attribute block, of the size passed. `keys` (and
    // `values`, for an update) hold `count` elements of the map's key (value) type, laid
    // out as the kernel reads them (`Pod`), and live for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            &raw mut attr,
            std::mem::size_of::<Batch>(),
        )
    };
    if rc < 0 {
        let error = io::Error::last_os_error();
        // The kernel writes back how many it processed.
        let done = attr.count as usize;
        return Err(Partial { done, error });
    }
    Ok(())
}
