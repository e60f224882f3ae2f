//! A redirected connection's two sockets, watched only for what its directions wait on.
//!
//! tokio registers every socket for reading and writing at once, and the kernel wakes a
//! redirected socket's readers after every segment, also one redirected away (see
//! `signals.rs`): a redirected connection in tokio's reactor wakes its thread once per
//! segment. So while redirected, the connection's sockets leave tokio for an epoll set of
//! their own, registered in tokio as one descriptor. Each socket's interest there is
//! EPOLLRDHUP (a FIN or a reset: their wake-ups carry no event key, so they always match,
//! while a segment's wake-up carries only EPOLLIN-class keys and matches nothing), plus
//! EPOLLIN or EPOLLOUT only while a direction is reading passed bytes or waiting to
//! write. Edge-triggered: each wake-up is reported once, and a hang-up stays noted here
//! until a direction asks for it.

use std::{
    io,
    os::fd::BorrowedFd,
    sync::{Mutex, MutexGuard},
};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use tokio::io::{unix::AsyncFd, Interest};

use crate::sys::{self, SharedEpoll};

/// Events taken from the epoll set per call: two sockets, so one call nearly always.
const EVENTS: usize = 4;

/// The two sockets of a redirected connection (0: downstream, 1: upstream) in an epoll set.
pub(super) struct Watch<'a> {
    fd: AsyncFd<SharedEpoll>,
    socks: [BorrowedFd<'a>; 2],
    state: Mutex<State>,
}

struct State {
    /// Each socket's interest now, without EPOLLET.
    interest: [EpollFlags; 2],
    /// Events reported and not yet taken. EPOLLIN and EPOLLOUT are taken by the wait
    /// that asked for them; hang-ups and errors stay (they are states, not edges).
    pending: [EpollFlags; 2],
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // Every critical section is a few flag updates and at most one epoll_ctl: a panic
    // cannot leave it half-done.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Always reported, whatever the interest.
fn hangup() -> EpollFlags {
    EpollFlags::EPOLLERR | EpollFlags::EPOLLHUP
}

impl<'a> Watch<'a> {
    /// Moves `socks` into a new epoll set, watched for hang-ups only. The sockets must
    /// have left tokio's reactor.
    pub fn new(socks: [BorrowedFd<'a>; 2]) -> io::Result<Watch<'a>> {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        let base = EpollFlags::EPOLLRDHUP;
        for (i, s) in socks.iter().enumerate() {
            epoll.add(s, EpollEvent::new(base | EpollFlags::EPOLLET, i as u64))?;
        }
        let fd = sys::register(SharedEpoll::new(epoll), Interest::READABLE)?;
        Ok(Watch {
            fd,
            socks,
            state: Mutex::new(State {
                interest: [base; 2],
                pending: [EpollFlags::empty(); 2],
            }),
        })
    }

    /// Waits until socket `i` reports one of `want` (EPOLLIN, EPOLLOUT or EPOLLRDHUP), an
    /// error or a hang-up, and returns what it reported. A wait for EPOLLIN also ends at
    /// EPOLLRDHUP. The interest added for it stays until [`Watch::unwant`].
    pub async fn wait(&self, i: usize, want: EpollFlags) -> io::Result<EpollFlags> {
        self.want(i, want, true)?;
        let mut mask = want | hangup();
        if want.contains(EpollFlags::EPOLLIN) {
            mask |= EpollFlags::EPOLLRDHUP;
        }
        loop {
            // A wake-up that brings only other events must not loop without yielding.
            tokio::task::consume_budget().await;
            {
                let mut st = lock(&self.state);
                let got = st.pending[i] & mask;
                if !got.is_empty() {
                    st.pending[i] &= !(got & (EpollFlags::EPOLLIN | EpollFlags::EPOLLOUT));
                    return Ok(got);
                }
            }
            let mut guard = self.fd.readable().await?;
            if self.collect()? == 0 {
                guard.clear_ready();
            }
        }
    }

    /// Stops watching socket `i` for `flags` (EPOLLIN or EPOLLOUT).
    pub fn unwant(&self, i: usize, flags: EpollFlags) -> io::Result<()> {
        self.want(i, flags, false)
    }

    fn want(&self, i: usize, flags: EpollFlags, on: bool) -> io::Result<()> {
        let flags = flags & (EpollFlags::EPOLLIN | EpollFlags::EPOLLOUT);
        let mut st = lock(&self.state);
        let now = st.interest[i];
        let next = if on { now | flags } else { now & !flags };
        if next == now {
            return Ok(());
        }
        // A modification looks at the socket again: if it is ready for the new interest
        // already, the event is queued, so nothing that happened before is missed.
        let mut event = EpollEvent::new(next | EpollFlags::EPOLLET, i as u64);
        self.fd.get_ref().modify(self.socks[i], &mut event)?;
        st.interest[i] = next;
        Ok(())
    }

    /// Moves the reported events into `pending`. Returns how many there were.
    fn collect(&self) -> io::Result<usize> {
        let mut total = 0;
        loop {
            let mut events = [EpollEvent::empty(); EVENTS];
            let n = match self.fd.get_ref().wait(&mut events, EpollTimeout::ZERO) {
                Ok(n) => n,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            };
            let mut st = lock(&self.state);
            for e in &events[..n] {
                if let Some(p) = st.pending.get_mut(e.data() as usize) {
                    *p |= e.events();
                }
            }
            total += n;
            if n < EVENTS {
                return Ok(total);
            }
        }
    }
}
