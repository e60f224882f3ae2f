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
//! Something waits on that epoll set and on the parked connections' deadlines (idle
//! timeout, lifetime). It wakes a connection's task when either socket turns readable or
//! hangs up, or when its deadline falls due; the task takes its sockets back into tokio
//! and goes on copying, or closes the connection. That something is one of two:
//! - On a single-threaded runtime (the daemon's tunnel workers), each runtime has its own
//!   parker, driven by a task on that runtime: the epoll set is registered in the
//!   runtime's own reactor, so a parked socket's byte wakes the worker thread directly,
//!   as an unparked socket's does, and the connection's task is woken on that thread.
//! - Elsewhere (a work-stealing runtime), one parker for the process, watched by its
//!   own thread. A wake then costs one more thread hop: the parker thread's, which on a
//!   VM means waking an idle vCPU first (about 0.3 ms on the benchmark VM).

use std::{
    cell::RefCell,
    sync::{atomic::AtomicBool, Arc},
};
use std::{
    collections::BTreeSet,
    future::Future,
    io,
    net::TcpStream,
    os::fd::AsFd,
    pin::Pin,
    sync::{atomic::Ordering::Relaxed, Mutex, MutexGuard, OnceLock},
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

use super::tally::Tally;
use crate::sys::{self, SharedEpoll};

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
    /// The thread could not be started, or the epoll set not registered in the
    /// runtime's reactor.
    #[error("starting the parker: {0}")]
    Thread(#[from] io::Error),
}

/// Parked connections and what watches them: a thread (the process's parker) or a task
/// on a single-threaded runtime (that runtime's parker).
pub(crate) struct Parker {
    epoll: SharedEpoll,
    kick: EventFd,
    state: Mutex<State>,
    /// False once the driving thread or task is gone: then nothing may park here.
    driven: AtomicBool,
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

/// The process's parker: one epoll set and one thread serve every dataplane that does
/// not run on a single-threaded runtime.
static PARKER: OnceLock<Option<Arc<Parker>>> = OnceLock::new();

thread_local! {
    /// This thread's parker, driven by a task on the single-threaded runtime it runs.
    static LOCAL: RefCell<Option<Arc<Parker>>> = const { RefCell::new(None) };
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic while holding the lock cannot leave a slot half-written: every update is
    // a single assignment or collection call.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn data(key: usize, gen: u32) -> u64 {
    (u64::from(gen) << 32) | (key as u64 & 0xffff_ffff)
}

/// Marks its parker undriven when the driving task ends (its runtime dropped it).
struct Driving(Arc<Parker>);

impl Drop for Driving {
    fn drop(&mut self) {
        self.0.driven.store(false, Relaxed);
    }
}

impl Parker {
    /// The parker for a connection of the calling task: on a single-threaded runtime,
    /// that runtime's (started at the first call); elsewhere the process's (started at
    /// the first call). None if neither can be started (logged): connections then stay
    /// in tokio while idle.
    pub(crate) fn get() -> Option<Arc<Parker>> {
        let single = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread);
        if single {
            if let Some(p) = Parker::local() {
                return Some(p);
            }
        }
        Parker::process()
    }

    /// The process's parker and its thread.
    pub(crate) fn process() -> Option<Arc<Parker>> {
        PARKER
            .get_or_init(|| match Parker::new() {
                Ok(p) => Some(Arc::new(p)),
                Err(e) => {
                    warn!(error = %e, "idle connections will not be parked");
                    None
                }
            })
            .clone()
            .inspect(|p| p.clone().start())
    }

    /// This thread's parker, with a task driving it on the current (single-threaded)
    /// runtime; a new one when there is none or the runtime of the last one is gone.
    /// None if it cannot be started (logged at debug; the process's parker serves).
    fn local() -> Option<Arc<Parker>> {
        LOCAL.with(|local| {
            let mut local = local.borrow_mut();
            if let Some(p) = local.as_ref().filter(|p| p.driven.load(Relaxed)) {
                return Some(p.clone());
            }
            let started = Parker::new().map(Arc::new).and_then(|p| {
                let fd = sys::register(p.epoll.clone(), tokio::io::Interest::READABLE)
                    .map_err(Error::Thread)?;
                p.driven.store(true, Relaxed);
                // The guard is part of the task from its creation: a task dropped before
                // its first poll still marks the parker undriven.
                tokio::spawn(p.clone().drive(fd, Driving(p.clone())));
                Ok(p)
            });
            match started {
                Ok(p) => {
                    *local = Some(p.clone());
                    Some(p)
                }
                Err(e) => {
                    debug!(error = %e, "no parker on this runtime; the process's serves");
                    None
                }
            }
        })
    }

    fn new() -> Result<Parker, Error> {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        let kick = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
        epoll.add(kick.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, KICK))?;
        Ok(Parker {
            epoll: SharedEpoll::new(epoll),
            kick,
            state: Mutex::new(State {
                slots: Slab::new(),
                deadlines: BTreeSet::new(),
                wait_until: None,
                next_gen: 0,
            }),
            driven: AtomicBool::new(false),
        })
    }

    /// Starts the process parker's thread, once.
    fn start(self: Arc<Self>) {
        static STARTED: OnceLock<()> = OnceLock::new();
        STARTED.get_or_init(|| {
            self.driven.store(true, Relaxed);
            let parker = self.clone();
            let spawned = std::thread::Builder::new()
                .name("waypoint-park".into())
                .spawn(move || parker.run());
            if let Err(e) = spawned {
                // Parked connections would never wake: park none. They were none yet.
                warn!(error = %Error::Thread(e), "idle connections will not be parked");
                self.driven.store(false, Relaxed);
            }
        });
    }

    /// Parks `socks` until either turns readable or hangs up, or until `deadline`,
    /// counted in `tally` (the dataplane's). On error the sockets come back, not parked.
    pub(crate) fn park(
        self: &Arc<Self>,
        socks: [TcpStream; 2],
        deadline: Option<Instant>,
        tally: &'static Tally,
    ) -> Result<Parked, (io::Error, [TcpStream; 2])> {
        match self.try_park(socks, deadline) {
            Ok((key, socks)) => {
                tally.parked();
                Ok(Parked {
                    parker: self.clone(),
                    key,
                    socks: Some(socks),
                    tally,
                })
            }
            Err(e) => {
                tally.park_failed();
                Err(e)
            }
        }
    }

    /// Adds `socks` to the epoll set in a new slot: its key.
    fn try_park(
        &self,
        socks: [TcpStream; 2],
        deadline: Option<Instant>,
    ) -> Result<(usize, [TcpStream; 2]), (io::Error, [TcpStream; 2])> {
        let (key, gen) = {
            let mut st = lock(&self.state);
            if !self.driven.load(Relaxed) {
                return Err((io::Error::other("the parker is not running"), socks));
            }
            let gen = st.next_gen;
            st.next_gen = gen.wrapping_add(1);
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
        Ok((key, socks))
    }

    /// Takes the sockets out of the epoll set and frees the slot.
    fn unpark(&self, key: usize, socks: &[TcpStream; 2]) {
        for s in socks {
            // Only fails for a socket that is not in the set; nothing to undo then.
            let _ = self.epoll.delete(s.as_fd());
        }
        lock(&self.state).remove(key);
    }

    /// The earliest deadline, which the next wait must end at.
    fn next_deadline(&self) -> Option<Instant> {
        let mut st = lock(&self.state);
        let next = st.deadlines.first().map(|&(d, _)| d);
        st.wait_until = next;
        next
    }

    /// The process parker's thread: waits for events and deadlines, wakes the tasks
    /// they concern.
    fn run(&self) {
        let mut events = [EpollEvent::empty(); EVENTS];
        let mut wakers = Vec::new();
        loop {
            let timeout = self.next_deadline().map_or(EpollTimeout::NONE, |d| {
                // Rounded up: a wait that ends early only loops once more.
                let ms = d.saturating_duration_since(Instant::now()).as_micros();
                EpollTimeout::try_from(ms.div_ceil(1000)).unwrap_or(EpollTimeout::MAX)
            });
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
            self.dispatch(&events[..n], &mut wakers);
        }
    }

    /// A runtime parker's task: the same loop, with the epoll set in the runtime's
    /// reactor and the deadline on its timer.
    async fn drive(self: Arc<Self>, fd: tokio::io::unix::AsyncFd<SharedEpoll>, _driving: Driving) {
        let mut events = [EpollEvent::empty(); EVENTS];
        let mut wakers = Vec::new();
        loop {
            let next = self.next_deadline();
            let deadline = async move {
                match next {
                    Some(d) => tokio::time::sleep_until(d.into()).await,
                    None => std::future::pending().await,
                }
            };
            let n = tokio::select! {
                ready = fd.readable() => match ready {
                    Ok(mut guard) => match self.epoll.wait(&mut events, EpollTimeout::ZERO) {
                        Ok(n) => {
                            // Fewer than asked for: the set is drained, wait for the next
                            // edge. (tokio keeps the readiness if a new event came since.)
                            if n < EVENTS {
                                guard.clear_ready();
                            }
                            n
                        }
                        Err(Errno::EINTR) => 0,
                        Err(e) => {
                            warn!(error = %e, "parker: epoll_wait failed");
                            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                            0
                        }
                    },
                    Err(e) => {
                        // Not expected for a registered epoll fd; do not spin.
                        warn!(error = %e, "parker: reactor error");
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                        0
                    }
                },
                () = deadline => 0,
            };
            self.dispatch(&events[..n], &mut wakers);
        }
    }

    /// Wakes the tasks of `events` and of every deadline due.
    fn dispatch(&self, events: &[EpollEvent], wakers: &mut Vec<Waker>) {
        {
            let mut st = lock(&self.state);
            for ev in events {
                if ev.data() == KICK {
                    let _ = self.kick.read();
                    continue;
                }
                let (key, gen) = ((ev.data() & 0xffff_ffff) as usize, (ev.data() >> 32) as u32);
                st.wake(key, Some(gen), Wake::Ready, wakers);
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
                st.wake(key, None, Wake::Deadline, wakers);
            }
        }
        if !wakers.is_empty() {
            debug!(n = wakers.len(), "waking parked connections");
        }
        for w in wakers.drain(..) {
            w.wake();
        }
    }
}

/// A parked connection: resolves with its sockets once woken. Dropped before that, it
/// takes them out of the epoll set before they close (a descriptor number closed first
/// could already belong to another parked connection).
pub(crate) struct Parked {
    parker: Arc<Parker>,
    key: usize,
    socks: Option<[TcpStream; 2]>,
    /// The dataplane's counts, which hold this connection as parked until it leaves.
    tally: &'static Tally,
}

impl Parked {
    fn leave(&self, socks: &[TcpStream; 2]) {
        self.parker.unpark(self.key, socks);
        self.tally.unparked();
    }
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
        self.leave(&socks);
        Poll::Ready((woken, socks))
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        if let Some(socks) = &self.socks {
            self.leave(socks);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
    use super::*;
    use crate::dataplane::{Kind, Parking};

    /// A single-threaded runtime gets its own parker, the same one for every call on
    /// it, and a new one once that runtime is gone; a work-stealing runtime gets the
    /// process's.
    #[test]
    fn a_single_threaded_runtime_has_its_own_parker() {
        let one = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
        };
        let rt = one();
        let (first, again) =
            rt.block_on(async { (Parker::get().unwrap(), Parker::get().unwrap()) });
        assert!(Arc::ptr_eq(&first, &again));
        let process = Parker::process().unwrap();
        assert!(!Arc::ptr_eq(&first, &process));
        assert!(first.driven.load(Relaxed));
        drop(rt);
        // Its driving task went with the runtime: nothing may park there any more. A
        // parking there fails, gives the sockets back and is counted.
        assert!(!first.driven.load(Relaxed));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let tally = Tally::leak(Kind::Copy);
        let Err((e, back)) = first.park([c, s], None, tally) else {
            panic!("parked on a parker nothing drives");
        };
        assert!(e.to_string().contains("not running"), "{e}");
        assert_eq!(back.len(), 2);
        assert_eq!(
            tally.parking(),
            Parking {
                parked: 0,
                parks: 0,
                failures: 1
            }
        );
        let next = one().block_on(async { Parker::get().unwrap() });
        assert!(!Arc::ptr_eq(&first, &next));

        let stealing = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let got = stealing.block_on(async { Parker::get().unwrap() });
        assert!(Arc::ptr_eq(&got, &process));
    }

    /// A parking on a runtime's parker wakes on the runtime's own reactor, with no
    /// other thread involved: the runtime has one thread, and this test's.
    #[test]
    fn a_runtime_parker_wakes_on_bytes_and_on_its_deadline() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            use std::io::Write as _;
            let pair = || {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
                let (s, _) = l.accept().unwrap();
                c.set_nonblocking(true).unwrap();
                s.set_nonblocking(true).unwrap();
                (c, s)
            };
            let parker = Parker::get().unwrap();
            let tally = Tally::leak(Kind::Copy);
            let ((mut c1, s1), (c2, s2)) = (pair(), pair());
            let parked = parker
                .park([s1, s2], None, tally)
                .map_err(|(e, _)| e)
                .unwrap();
            assert_eq!((tally.parking().parked, tally.parking().parks), (1, 1));
            c1.write_all(b"x").unwrap();
            let (why, _socks) = tokio::time::timeout(std::time::Duration::from_secs(5), parked)
                .await
                .expect("a byte did not wake the parked connection");
            assert_eq!(why, Wake::Ready);
            assert_eq!((tally.parking().parked, tally.parking().parks), (0, 1));

            let ((_c3, s3), (_c4, s4)) = (pair(), pair());
            let deadline = Instant::now() + std::time::Duration::from_millis(50);
            let parked = parker
                .park([s3, s4], Some(deadline), tally)
                .map_err(|(e, _)| e)
                .unwrap();
            let (why, _socks) = tokio::time::timeout(std::time::Duration::from_secs(5), parked)
                .await
                .expect("the deadline did not wake the parked connection");
            assert_eq!(why, Wake::Deadline);
            assert!(Instant::now() >= deadline);
            let ((_c5, s5), (_c6, s6)) = (pair(), pair());
            let parked = parker
                .park([s5, s6], None, tally)
                .map_err(|(e, _)| e)
                .unwrap();
            assert_eq!(tally.parking().parked, 1);
            // A connection dropped while parked (its task ended) leaves the count too.
            drop(parked);
            assert_eq!(
                tally.parking(),
                Parking {
                    parked: 0,
                    parks: 3,
                    failures: 0
                }
            );
            drop(c2);
        });
    }
}
