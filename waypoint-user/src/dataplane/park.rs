//! Idle connections, parked outside tokio's reactor.
//!
//! In tokio an idle connection costs its copy's state (about 300 B, boxed) and a
//! `ScheduledIo` per socket (about 270 B each with its `Arc` and 128-byte alignment), for
//! as long as it stays open; mesh clients keep pools of such connections. A connection
//! whose copy moved no byte for `--park-after` hands its two sockets to the [`Parker`]
//! instead: they leave tokio's reactor for one shared epoll set, and the copy's state is
//! freed. What stays is a slot here (about 40 B), a deadline entry, and the connection's
//! task holding the two descriptors and its byte counts.
//!
//! One thread waits on that epoll set and on the parked connections' deadlines (idle
//! timeout, lifetime). It wakes a connection's task when either socket turns readable or
//! hangs up, or when its deadline falls due; the task takes its sockets back into tokio
//! and goes on copying, or closes the connection. The thread is not on any hot path: a
//! connection only meets it after being idle, and a wake costs one more thread hop.

use std::{
    collections::BTreeSet,
    future::Future,
    io,
    net::TcpStream,
    os::fd::AsFd,
    pin::Pin,
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Mutex, MutexGuard, OnceLock,
    },
    task::{Context, Poll, Waker},
    time::Instant,
};

use nix::{
    errno::Errno,
    sys::{
        epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout},
        eventfd::{EfdFlags, EventFd},
    },
};
use slab::Slab;
use tracing::{debug, warn};

/// Epoll data of the eventfd that interrupts the thread's wait (a parked connection's
/// data is its slot key and generation, never all ones).
const KICK: u64 = u64::MAX;

/// Events taken from the epoll set per wait.
const EVENTS: usize = 256;

/// Why a parked connection was woken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wake {
    /// A socket turned readable, hung up or has an error.
    Ready,
    /// Its deadline fell due.
    Deadline,
}

/// Errors starting the parker (then connections are never parked).
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// epoll_create1 or eventfd failed.
    #[error("creating the parker's epoll set: {0}")]
    Epoll(#[from] Errno),
    /// The thread could not be started.
    #[error("starting the parker thread: {0}")]
    Thread(#[from] io::Error),
}

/// The parked connections of this process, and the thread that watches them.
pub(crate) struct Parker {
    epoll: Epoll,
    kick: EventFd,
    state: Mutex<State>,
    parks: AtomicU64,
    failures: AtomicU64,
}

struct State {
    slots: Slab<Slot>,
    /// Every parked connection's deadline, by slot key.
    deadlines: BTreeSet<(Instant, usize)>,
    /// When the thread's current wait times out (None: it waits for events only).
    wait_until: Option<Instant>,
    next_gen: u32,
}

struct Slot {
    /// Tells this parking from an earlier one that used the same key: an event the thread
    /// read just before that one ended must not wake this one.
    gen: u32,
    deadline: Option<Instant>,
    waker: Option<Waker>,
    woken: Option<Wake>,
}

impl State {
    /// Marks slot `key` woken (unless it is woken already, or no longer parking `gen`)
    /// and hands out its waker.
    fn wake(&mut self, key: usize, gen: Option<u32>, why: Wake, wakers: &mut Vec<Waker>) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        if gen.is_some_and(|g| g != slot.gen) || slot.woken.is_some() {
            return;
        }
        slot.woken = Some(why);
        wakers.extend(slot.waker.take());
    }

    fn remove(&mut self, key: usize) {
        if let Some(slot) = self.slots.try_remove(key) {
            if let Some(d) = slot.deadline {
                self.deadlines.remove(&(d, key));
            }
        }
    }
}

/// The process's parker: one epoll set and one thread serve every dataplane.
static PARKER: OnceLock<Option<Parker>> = OnceLock::new();

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic while holding the lock cannot leave a slot half-written: every update is
    // a single assignment or collection call.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn data(key: usize, gen: u32) -> u64 {
    (u64::from(gen) << 32) | (key as u64 & 0xffff_ffff)
}

impl Parker {
    /// The process's parker, started at the first call. None if it could not be started
    /// (logged once): connections then stay in tokio while idle.
    pub(crate) fn get() -> Option<&'static Parker> {
        PARKER
            .get_or_init(|| match Parker::new() {
                Ok(p) => Some(p),
                Err(e) => {
                    warn!(error = %e, "idle connections will not be parked");
                    None
                }
            })
            .as_ref()
            .inspect(|p| p.start())
    }

    /// The parker, if one was started.
    pub(crate) fn started() -> Option<&'static Parker> {
        PARKER.get().and_then(Option::as_ref)
    }

    fn new() -> Result<Parker, Error> {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        let kick = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
        epoll.add(kick.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, KICK))?;
        Ok(Parker {
            epoll,
            kick,
            state: Mutex::new(State {
                slots: Slab::new(),
                deadlines: BTreeSet::new(),
                wait_until: None,
                next_gen: 0,
            }),
            parks: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        })
    }

    /// Starts the thread, once.
    fn start(&'static self) {
        static STARTED: OnceLock<()> = OnceLock::new();
        STARTED.get_or_init(|| {
            let spawned = std::thread::Builder::new()
                .name("waypoint-park".into())
                .spawn(move || self.run());
            if let Err(e) = spawned {
                // Parked connections would never wake: park none. They were none yet.
                warn!(error = %Error::Thread(e), "idle connections will not be parked");
                lock(&self.state).next_gen = u32::MAX;
            }
        });
    }

    /// Connections parked now, parkings so far, and parkings that failed (the
    /// connection then stays in tokio).
    pub(crate) fn counts(&self) -> (usize, u64, u64) {
        let parked = lock(&self.state).slots.len();
        (
            parked,
            self.parks.load(Relaxed),
            self.failures.load(Relaxed),
        )
    }

    /// Parks `socks` until either turns readable or hangs up, or until `deadline`.
    /// On error the sockets come back, not parked.
    pub(crate) fn park(
        &'static self,
        socks: [TcpStream; 2],
        deadline: Option<Instant>,
    ) -> Result<Parked, (io::Error, [TcpStream; 2])> {
        self.try_park(socks, deadline).inspect_err(|_| {
            self.failures.fetch_add(1, Relaxed);
        })
    }

    fn try_park(
        &'static self,
        socks: [TcpStream; 2],
        deadline: Option<Instant>,
    ) -> Result<Parked, (io::Error, [TcpStream; 2])> {
        let (key, gen) = {
            let mut st = lock(&self.state);
            if st.next_gen == u32::MAX {
                return Err((io::Error::other("the parker thread is not running"), socks));
            }
            // Generations wrap below the marker of a parker without a thread.
            let gen = st.next_gen;
            st.next_gen = (gen + 1) % (u32::MAX - 1);
            let key = st.slots.insert(Slot {
                gen,
                deadline,
                waker: None,
                woken: None,
            });
            if key > u32::MAX as usize - 1 {
                st.slots.remove(key);
                return Err((io::Error::other("too many parked connections"), socks));
            }
            if let Some(d) = deadline {
                st.deadlines.insert((d, key));
                if st.wait_until.is_none_or(|w| d < w) {
                    st.wait_until = Some(d);
                    // The thread sleeps past this deadline: make it look again.
                    let _ = self.kick.write(1);
                }
            }
            (key, gen)
        };
        // One-shot: after the first event a socket stays quiet until it is removed, so a
        // busy socket cannot make the thread spin before its task runs.
        let flags = EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP | EpollFlags::EPOLLONESHOT;
        for (i, s) in socks.iter().enumerate() {
            if let Err(e) = self
                .epoll
                .add(s.as_fd(), EpollEvent::new(flags, data(key, gen)))
            {
                for s in &socks[..i] {
                    let _ = self.epoll.delete(s.as_fd());
                }
                lock(&self.state).remove(key);
                return Err((e.into(), socks));
            }
        }
        self.parks.fetch_add(1, Relaxed);
        Ok(Parked {
            parker: self,
            key,
            socks: Some(socks),
        })
    }

    /// Takes the sockets out of the epoll set and frees the slot.
    fn unpark(&self, key: usize, socks: &[TcpStream; 2]) {
        for s in socks {
            // Only fails for a socket that is not in the set; nothing to undo then.
            let _ = self.epoll.delete(s.as_fd());
        }
        lock(&self.state).remove(key);
    }

    /// The thread: waits for events and deadlines, wakes the tasks they concern.
    fn run(&self) {
        let mut events = [EpollEvent::empty(); EVENTS];
        let mut wakers = Vec::new();
        loop {
            let timeout = {
                let mut st = lock(&self.state);
                let next = st.deadlines.first().map(|&(d, _)| d);
                st.wait_until = next;
                next.map_or(EpollTimeout::NONE, |d| {
                    // Rounded up: a wait that ends early only loops once more.
                    let ms = d.saturating_duration_since(Instant::now()).as_micros();
                    EpollTimeout::try_from(ms.div_ceil(1000)).unwrap_or(EpollTimeout::MAX)
                })
            };
            let n = match self.epoll.wait(&mut events, timeout) {
                Ok(n) => n,
                Err(Errno::EINTR) => 0,
                Err(e) => {
                    // Not expected on a valid epoll fd; do not spin if it happens.
                    warn!(error = %e, "parker: epoll_wait failed");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    0
                }
            };
            let mut st = lock(&self.state);
            for ev in &events[..n] {
                if ev.data() == KICK {
                    let _ = self.kick.read();
                    continue;
                }
                let (key, gen) = ((ev.data() & 0xffff_ffff) as usize, (ev.data() >> 32) as u32);
                st.wake(key, Some(gen), Wake::Ready, &mut wakers);
            }
            let now = Instant::now();
            while let Some(&(d, key)) = st.deadlines.first() {
                if d > now {
                    break;
                }
                st.deadlines.pop_first();
                if let Some(slot) = st.slots.get_mut(key) {
                    slot.deadline = None;
                }
                st.wake(key, None, Wake::Deadline, &mut wakers);
            }
            drop(st);
            if !wakers.is_empty() {
                debug!(n = wakers.len(), "waking parked connections");
            }
            for w in wakers.drain(..) {
                w.wake();
            }
        }
    }
}

/// A parked connection: resolves with its sockets once woken. Dropped before that, it
/// takes them out of the epoll set before they close (a descriptor number closed first
/// could already belong to another parked connection).
pub(crate) struct Parked {
    parker: &'static Parker,
    key: usize,
    socks: Option<[TcpStream; 2]>,
}

impl Future for Parked {
    type Output = (Wake, [TcpStream; 2]);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let woken = {
            let mut st = lock(&self.parker.state);
            let Some(slot) = st.slots.get_mut(self.key) else {
                // Not reachable: the slot lives until this future takes the sockets.
                return Poll::Pending;
            };
            match slot.woken {
                Some(why) => why,
                None => {
                    if !slot.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                        slot.waker = Some(cx.waker().clone());
                    }
                    return Poll::Pending;
                }
            }
        };
        let Some(socks) = self.socks.take() else {
            return Poll::Pending;
        };
        self.parker.unpark(self.key, &socks);
        Poll::Ready((woken, socks))
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        if let Some(socks) = &self.socks {
            self.parker.unpark(self.key, socks);
        }
    }
}
