//! The system calls the daemon makes that neither std, socket2 nor nix wraps.
//!
//! This is the home of `unsafe` for system calls: everything here takes a descriptor the
//! caller keeps open for the call and returns the OS error as an `io::Error`, so callers
//! stay safe code; registering a descriptor with tokio's reactor is here too
//! ([`register`]). Outside it, `unsafe` remains only in the BPF map code
//! (`dataplane/flows.rs`, which maps the FLOWS array; `dataplane/bpf_cmd.rs`, the raw
//! `bpf()` command).

mod process;
mod reactor;
mod socket;

pub(crate) use process::{
    enable_request_migration, ephemeral_ports, membarrier_global, monotonic_ms, nofile_limit,
    raise_memlock_limit, raise_nofile_limit,
};
pub(crate) use reactor::{register, SharedEpoll};
pub(crate) use socket::{
    cookie, getsockopt_u32, ioctl_int, peek, queued, recv_spare, set_rcvlowat, setsockopt_int,
    tcp_info, unsent_or_unacked, wake_writer,
};
