//! Registering descriptors with tokio's reactor without `unsafe` at the call site.
//!
//! tokio makes `AsyncFd::register_with_interest` unsafe: the descriptor must stay open,
//! and the same, for as long as the registration lives. The types accepted here
//! guarantee that by what they are: a listener or epoll set that the `AsyncFd` owns, or a
//! descriptor borrowed for a lifetime that bounds the `AsyncFd`'s.

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd, RawFd},
    sync::Arc,
};

use nix::sys::epoll::Epoll;
use tokio::io::{unix::AsyncFd, Interest};

mod sealed {
    pub trait Sealed {}
}

/// A descriptor holder whose `as_raw_fd` names one descriptor, open for the holder's
/// whole life. Sealed: only the types below.
pub(crate) trait Registrable: AsRawFd + sealed::Sealed {}

impl sealed::Sealed for std::net::TcpListener {}
impl Registrable for std::net::TcpListener {}
impl sealed::Sealed for BorrowedFd<'_> {}
impl Registrable for BorrowedFd<'_> {}
impl sealed::Sealed for SharedEpoll {}
impl Registrable for SharedEpoll {}

/// An epoll set shared between its user and the reactor's registration: the `Arc`
/// keeps the set's descriptor open while either holds it.
#[derive(Clone)]
pub(crate) struct SharedEpoll(Arc<Epoll>);

impl SharedEpoll {
    /// Shares `epoll`.
    pub(crate) fn new(epoll: Epoll) -> SharedEpoll {
        SharedEpoll(Arc::new(epoll))
    }
}

impl std::ops::Deref for SharedEpoll {
    type Target = Epoll;

    fn deref(&self) -> &Epoll {
        &self.0
    }
}

impl AsRawFd for SharedEpoll {
    fn as_raw_fd(&self) -> RawFd {
        self.0 .0.as_raw_fd()
    }
}

/// Registers `inner` with the current runtime's reactor for `interest`.
pub(crate) fn register<T: Registrable>(inner: T, interest: Interest) -> io::Result<AsyncFd<T>> {
    // SAFETY: a `Registrable` owns its descriptor (the listener; the epoll set, kept
    // open by the `Arc` the registration holds) or borrows it for a lifetime the
    // `AsyncFd<BorrowedFd<'a>>` cannot outlive, and `as_raw_fd` returns that one
    // descriptor on every call.
    unsafe { AsyncFd::register_with_interest(inner, interest) }.map_err(|e| e.into_parts().1)
}
