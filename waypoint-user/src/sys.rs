//! The system calls the daemon makes that neither std, socket2 nor nix wraps.
//!
//! This is the home of `unsafe` for system calls: everything here takes a descriptor the
//! caller keeps open for the call and returns the OS error as an `io::Error`, so callers
//! stay safe code. Outside it, `unsafe` remains only where a contract spans more than
//! one call: the BPF map code (`dataplane/flows.rs`, which maps the FLOWS array;
//! `dataplane/bpf_cmd.rs`, the raw `bpf()` command), and the registrations of descriptors
//! with tokio's reactor (`AsyncFd::register_with_interest`), whose owners keep the
//! descriptor open for the registration's life.

mod process;
mod socket;

pub(crate) use process::{
    membarrier_global, monotonic_ms, raise_memlock_limit, raise_nofile_limit,
};
pub(crate) use socket::{
    cookie, getsockopt_u32, ioctl_int, peek, queued, recv_spare, set_rcvlowat, setsockopt_int,
    tcp_info, unsent_or_unacked, wake_writer,
};
