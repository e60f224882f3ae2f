//! Rewritten connections whose daemon is gone: the next daemon adopts them.
//!
//! A rewritten connection lives in the kernel: its TC program, pinned or held by its
//! netlink filter, and its two entries in the pinned `REWRITES` map (see `pins.rs`). It
//! goes on flowing while no daemon runs. What it lacks is someone to end it: to remove
//! its entries once it ended (after the linger), to reset it at the idle timeout, and
//! to hold the 4-tuple of the daemon's socket to the pod (B), so that no new connection
//! to the pod gets it (its packets would match the old entries). And the program itself
//! must go once its last connection has.
//!
//! Every daemon, whichever dataplane it runs, looks at its start, before it dials
//! anything, and then every [`SCAN`], for program directories whose owner name is free
//! (see `orphans.rs`: the name goes with the process, however it ends). It takes the
//! name (so that no other daemon adopts the same program), opens the pinned map of the
//! layout it reads ([`pins::REWRITES_PIN`]; another version's is refused, logged, and
//! its program removed: its connections end at their next packet), and from then on,
//! every [`SCAN`]:
//! - holds each B's 4-tuple with a socket in repair mode (bound, "connected" without a
//!   packet, closed without one);
//! - ends a connection whose entries say it ended (a reset, or a FIN each way) [`LINGER`]
//!   later: entries out, then its holder closed;
//! - resets both ends of a connection idle for the idle timeout, or older than the
//!   lifetime counted from its adoption (from a raw socket, at the sequence number each
//!   expects next, as the daemon that rewrote it would have);
//! - once no entry is left, detaches the program (unpins its links, or removes its
//!   netlink filters) and removes its directory.

use std::{
    collections::BTreeMap,
    io,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    os::fd::{AsFd as _, AsRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
        Arc, Mutex, MutexGuard,
    },
    time::{Duration, Instant},
};

use aya::{
    maps::{HashMap, IterableMap as _, Map, MapData},
    programs::links::PinnedLink,
};
use tracing::{info, warn};
use waypoint_common::{Rewrite, RewriteKey, REWRITE_FIN, REWRITE_FROM_POD, REWRITE_RST};

use super::background::{Background, JOIN_WITHIN};
use super::rewrite::{send_rst, LINGER};
use super::{bpf_cmd, handoff, orphans, pins};

/// How often the adopter looks for programs to adopt and at the connections it holds.
pub const SCAN: Duration = Duration::from_millis(500);

const TCP_REPAIR: libc::c_int = 19;

/// Errors of starting the adopter.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Its thread could not be started.
    #[error("starting the adopter's thread: {0}")]
    Thread(#[source] io::Error),
}

/// The adopter's limits (the daemon's own) and where it looks.
#[derive(Clone, Debug)]
pub struct Config {
    /// A connection that carried no packet for this long is reset.
    pub idle_timeout: Duration,
    /// A connection adopted this long ago is reset.
    pub max_lifetime: Option<Duration>,
    /// Where the daemons pin their programs (`--pin-dir`).
    pub pin_dir: PathBuf,
}

/// What the adopter counts.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    /// Programs held now.
    pub programs: u64,
    /// Connections held now.
    pub connections: u64,
    /// Connections adopted since start.
    pub adopted: u64,
    /// Connections reset at the idle timeout or the lifetime.
    pub reset: u64,
    /// Programs whose map's layout this daemon does not read: removed.
    pub refused: u64,
}

#[derive(Debug, Default)]
struct Shared {
    programs: AtomicU64,
    connections: AtomicU64,
    adopted: AtomicU64,
    reset: AtomicU64,
    refused: AtomicU64,
    stop: AtomicBool,
}

/// Adopts dead daemons' rewritten connections (see the module documentation), in a
/// thread (`waypoint-adopt`), until dropped. A program still held then stays, with its
/// connections, for the next daemon.
#[derive(Debug)]
pub struct Adopter {
    shared: Arc<Shared>,
    state: Arc<Mutex<State>>,
    thread: Mutex<Option<Background>>,
}

impl Adopter {
    /// Looks once (before this returns: the caller dials nothing before), then starts
    /// the thread that goes on looking. Without bpffs there is nothing to look at.
    pub fn start(config: Config) -> Result<Adopter, Error> {
        let shared = Arc::new(Shared::default());
        let dir = pins::namespace_dir(&config.pin_dir).ok();
        let mut state = State {
            config,
            held: BTreeMap::new(),
            dir,
        };
        state.scan(&shared);
        let state = Arc::new(Mutex::new(state));
        let (thread_shared, thread_state) = (shared.clone(), state.clone());
        let thread = Background::spawn("waypoint-adopt", move || {
            while !thread_shared.stop.load(Relaxed) {
                std::thread::park_timeout(SCAN);
                if thread_shared.stop.load(Relaxed) {
                    break;
                }
                lock(&thread_state).scan(&thread_shared);
            }
            // What is still held stays for the next daemon: the owner names go with
            // the state, the holders close silently.
        })
        .map_err(Error::Thread)?;
        Ok(Adopter {
            shared,
            state,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Stops adopting and hands what it holds to the next daemon: for each program, it
    /// offers the connections' sockets (see `handoff.rs`), lets go of the owner name, and
    /// waits up to `within` in all for an adopter. The sockets taken; None if it held
    /// nothing or nobody came.
    pub fn pass_on(&self, within: Duration) -> Option<usize> {
        self.stop();
        let held = std::mem::take(&mut lock(&self.state).held);
        if held.is_empty() {
            return None;
        }
        let deadline = Instant::now() + within;
        let mut offers = Vec::new();
        for (id, mut program) in held {
            let sockets: Vec<(u32, OwnedFd)> = program
                .conns
                .iter_mut()
                .filter_map(|(slot, c)| {
                    let h = c.holder.take()?;
                    h.connected.then(|| (*slot, h.into_fd()))
                })
                .collect();
            let offer = handoff::Offer::listen(id)
                .map_err(|e| warn!(prog_id = id, error = %e,
                    "offering the adopted connections' sockets failed: the next daemon holds their ports itself"))
                .ok();
            // Lets go of the owner name (and this process's references; the pins stay).
            drop(program);
            offers.push((offer, sockets));
        }
        self.shared.programs.store(0, Relaxed);
        self.shared.connections.store(0, Relaxed);
        let mut taken = None;
        for (offer, sockets) in offers {
            let Some(offer) = offer else { continue };
            match offer.give(&sockets, deadline.saturating_duration_since(Instant::now())) {
                Ok(true) => *taken.get_or_insert(0) += sockets.len(),
                Ok(false) => {}
                Err(e) => warn!(error = %e, "handing the adopted connections' sockets on failed"),
            }
        }
        taken
    }

    fn stop(&self) {
        self.shared.stop.store(true, Relaxed);
        let thread = lock(&self.thread).take();
        if let Some(mut t) = thread {
            t.unpark();
            t.join(JOIN_WITHIN);
        }
    }

    /// The counts now.
    pub fn counts(&self) -> Counts {
        let s = &self.shared;
        Counts {
            programs: s.programs.load(Relaxed),
            connections: s.connections.load(Relaxed),
            adopted: s.adopted.load(Relaxed),
            reset: s.reset.load(Relaxed),
            refused: s.refused.load(Relaxed),
        }
    }
}

impl Drop for Adopter {
    fn drop(&mut self) {
        self.stop();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A scan that panicked leaves nothing half-done that the next one would trip on.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The thread's state.
#[derive(Debug)]
struct State {
    config: Config,
    /// By program id.
    held: BTreeMap<u32, Program>,
    /// This namespace's directory in bpffs.
    dir: Option<PathBuf>,
}

/// An adopted program.
#[derive(Debug)]
struct Program {
    dir: PathBuf,
    map: HashMap<MapData, RewriteKey, Rewrite>,
    /// Its TCX links (none for netlink filters).
    links: Vec<PinnedLink>,
    /// By slot.
    conns: BTreeMap<u32, Conn>,
    _owner: orphans::Owner,
}

/// An adopted connection.
#[derive(Debug)]
struct Conn {
    /// B's 4-tuple: the waypoint's address and port, and the pod's.
    b_local: SocketAddrV4,
    pod: SocketAddrV4,
    /// Bound to B's address; connected (in repair mode) once B's socket is gone.
    holder: Option<Holder>,
    adopted: Instant,
    /// Packets both ways when last seen, and since when.
    packets: u64,
    quiet_since: Instant,
    /// When its end was seen.
    ended: Option<Instant>,
}

#[derive(Debug)]
struct Holder {
    fd: OwnedFd,
    connected: bool,
    /// In repair mode: closes without a packet. A B handed over by a leaving daemon may
    /// still wait for the pod's acknowledgement of what it sent (see `silence` in
    /// `rewrite/tcp.rs`).
    silent: bool,
}

impl Holder {
    fn into_fd(self) -> OwnedFd {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped nor used again; its descriptor is read out
        // exactly once (the other fields are plain values).
        unsafe { std::ptr::read(&this.fd) }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        // Its connection is over (its entries went first): whatever B still had to
        // resend, no packet of it is wanted now.
        let _ = crate::sys::setsockopt_int(self.fd.as_raw_fd(), libc::IPPROTO_TCP, TCP_REPAIR, 1);
    }
}

/// One connection's entries, as read.
#[derive(Default)]
struct Pair {
    client: Option<(RewriteKey, Rewrite)>,
    pod: Option<(RewriteKey, Rewrite)>,
}

impl State {
    fn scan(&mut self, shared: &Shared) {
        self.find(shared);
        let now = Instant::now();
        let mut done = Vec::new();
        for (id, program) in &mut self.held {
            if program.tend(&self.config, now, shared) {
                done.push(*id);
            }
        }
        for id in done {
            if let Some(p) = self.held.remove(&id) {
                p.detach(id);
            }
        }
        let conns = self.held.values().map(|p| p.conns.len() as u64).sum();
        shared.connections.store(conns, Relaxed);
        shared.programs.store(self.held.len() as u64, Relaxed);
    }

    /// Adopts the programs whose owner is gone.
    fn find(&mut self, shared: &Shared) {
        let Some(dir) = &self.dir else { return };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(id) = pins::program_id(&path) else {
                continue;
            };
            if self.held.contains_key(&id) {
                continue;
            }
            // Taking the name fails while its daemon (or another adopter) lives.
            let Ok(owner) = orphans::Owner::hold(id) else {
                continue;
            };
            match Program::open(&path, owner) {
                Ok(p) => {
                    let n = p.conns.len() as u64;
                    shared.adopted.fetch_add(n, Relaxed);
                    info!(
                        prog_id = id,
                        connections = n,
                        "adopted the rewritten connections of a daemon that left or is gone"
                    );
                    self.held.insert(id, p);
                }
                Err(Refusal::Layout(found)) => {
                    shared.refused.fetch_add(1, Relaxed);
                    warn!(prog_id = id, found = %found, reads = pins::REWRITES_PIN,
                        "a gone daemon's rewritten connections are kept in a layout this \
                         daemon does not read: its program is removed, and they end at their \
                         next packet");
                    detach_all(id, &path, Vec::new());
                }
                Err(Refusal::Gone) => {
                    info!(
                        prog_id = id,
                        "a gone daemon's rewrite program is no longer attached: its pins removed"
                    );
                    pins::remove(&path);
                }
                Err(Refusal::Io(e)) => {
                    warn!(prog_id = id, dir = %path.display(), error = %e,
                        "a gone daemon's rewrite pins could not be opened: removed");
                    detach_all(id, &path, Vec::new());
                }
            }
        }
    }
}

enum Refusal {
    /// Another layout's map (its file name).
    Layout(String),
    /// Nothing holds the program on an interface any more: nothing to adopt.
    Gone,
    Io(String),
}

impl Program {
    fn open(dir: &Path, owner: orphans::Owner) -> Result<Program, Refusal> {
        let mut links = Vec::new();
        let mut other = None;
        for entry in std::fs::read_dir(dir)
            .map_err(|e| Refusal::Io(e.to_string()))?
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(pins::LINK_PREFIX) {
                match PinnedLink::from_pin(entry.path()) {
                    Ok(l) => links.push(l),
                    Err(e) => warn!(pin = %entry.path().display(), error = %e,
                        "a pinned rewrite link could not be opened"),
                }
            } else if name.starts_with(pins::REWRITES_PIN_PREFIX) && name != pins::REWRITES_PIN {
                other = Some(name);
            }
        }
        let id = pins::program_id(dir).unwrap_or_default();
        if links.is_empty() && !orphans::filtering(id) {
            return Err(Refusal::Gone);
        }
        let path = dir.join(pins::REWRITES_PIN);
        let data = match MapData::from_pin(&path) {
            Ok(d) => d,
            Err(e) => {
                return Err(match other {
                    Some(name) => Refusal::Layout(name),
                    None => Refusal::Io(e.to_string()),
                })
            }
        };
        // Checks the key's and the value's size.
        let map: HashMap<MapData, RewriteKey, Rewrite> =
            Map::HashMap(data)
                .try_into()
                .map_err(|e: aya::maps::MapError| {
                    Refusal::Layout(format!("{}: {e}", pins::REWRITES_PIN))
                })?;
        let mut program = Program {
            dir: dir.to_owned(),
            map,
            links,
            conns: BTreeMap::new(),
            _owner: owner,
        };
        // A leaving daemon hands its Bs over: their ports are never free.
        let mut received: BTreeMap<u32, OwnedFd> = match handoff::receive(id) {
            Ok(s) => s.into_iter().collect(),
            Err(e) => {
                warn!(prog_id = id, error = %e,
                    "taking the leaving daemon's sockets failed: holding their ports instead");
                BTreeMap::new()
            }
        };
        let now = Instant::now();
        let mut ended = Vec::new();
        for (slot, pair) in program.pairs() {
            if pair.ended() {
                // Ended before the adoption, when is not known: its linger is cut short
                // (a lost last ACK then costs the end that resends its FIN a reset, after
                // both ends have closed), and its port needs no holding.
                ended.extend(pair.client.map(|c| c.0));
                ended.extend(pair.pod.map(|p| p.0));
                continue;
            }
            if let Some(conn) = Conn::new(&pair, now, received.remove(&slot)) {
                program.conns.insert(slot, conn);
            }
        }
        program.delete(&ended);
        // Sockets of connections whose entries went meanwhile.
        for (_, fd) in received {
            drop(Holder {
                fd,
                connected: true,
                silent: false,
            });
        }
        Ok(program)
    }

    /// The entries, by slot.
    fn pairs(&self) -> BTreeMap<u32, Pair> {
        let mut pairs: BTreeMap<u32, Pair> = BTreeMap::new();
        for (key, value) in self.map.iter().flatten() {
            let pair = pairs.entry(value.slot).or_default();
            if value.flags & REWRITE_FROM_POD != 0 {
                pair.pod = Some((key, value));
            } else {
                pair.client = Some((key, value));
            }
        }
        pairs
    }

    /// One look at every connection; whether the program is done (no entry left).
    fn tend(&mut self, config: &Config, now: Instant, shared: &Shared) -> bool {
        let pairs = self.pairs();
        let mut delete = Vec::new();
        for (slot, pair) in &pairs {
            let conn = match self.conns.entry(*slot) {
                std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::btree_map::Entry::Vacant(v) => {
                    // A connection the dead daemon had not handed over yet when it went:
                    // adopted now.
                    let Some(conn) = Conn::new(pair, now, None) else {
                        continue;
                    };
                    shared.adopted.fetch_add(1, Relaxed);
                    v.insert(conn)
                }
            };
            conn.hold();
            let packets =
                pair.client.map_or(0, |c| c.1.packets) + pair.pod.map_or(0, |p| p.1.packets);
            if packets != conn.packets {
                conn.packets = packets;
                conn.quiet_since = now;
            }
            if conn.ended.is_none() && pair.ended() {
                conn.ended = Some(now);
            }
            let over = conn.ended.is_some_and(|t| now.duration_since(t) >= LINGER);
            let idle = now.duration_since(conn.quiet_since) >= config.idle_timeout;
            let old = config
                .max_lifetime
                .is_some_and(|l| now.duration_since(conn.adopted) >= l);
            if over || (conn.ended.is_none() && (idle || old)) {
                if !over {
                    pair.reset();
                    shared.reset.fetch_add(1, Relaxed);
                }
                delete.extend(pair.client.map(|c| c.0));
                delete.extend(pair.pod.map(|p| p.0));
            }
        }
        if !delete.is_empty() {
            self.delete(&delete);
        }
        // Gone from the map (just now, or by the program: a SYN that reused the client's
        // 4-tuple): their holders close, silently, after their entries went.
        let remaining = self.pairs();
        self.conns.retain(|s, _| remaining.contains_key(s));
        remaining.is_empty()
    }

    fn delete(&self, keys: &[RewriteKey]) {
        let fd = self.map.map().fd().as_fd();
        let mut rest = keys;
        while !rest.is_empty() {
            match bpf_cmd::delete(fd, rest) {
                Ok(()) => return,
                Err(e) if e.error.raw_os_error() == Some(libc::ENOENT) => {
                    rest = rest.get(e.done + 1..).unwrap_or_default();
                }
                Err(e) => {
                    for key in rest.iter().skip(e.done) {
                        let _ = bpf_cmd::delete(fd, std::slice::from_ref(key));
                    }
                    return;
                }
            }
        }
    }

    fn detach(self, id: u32) {
        info!(
            prog_id = id,
            "the adopted rewrite program's last connection ended: removed"
        );
        let Program {
            dir,
            links,
            map,
            conns,
            _owner,
            ..
        } = self;
        drop(map);
        drop(conns);
        detach_all(id, &dir, links);
    }
}

/// Detaches program `id`: unpins its TCX links, removes its netlink filters, then its
/// directory.
fn detach_all(id: u32, dir: &Path, links: Vec<PinnedLink>) {
    for link in links {
        if let Err(e) = link.unpin() {
            warn!(prog_id = id, error = %e, "an adopted rewrite link could not be unpinned");
        }
    }
    orphans::remove_program(id);
    pins::remove(dir);
}

impl Pair {
    /// A reset either way, or a FIN each way.
    fn ended(&self) -> bool {
        let flags = |e: &Option<(RewriteKey, Rewrite)>| e.map_or(REWRITE_RST, |e| e.1.flags);
        let (c, p) = (flags(&self.client), flags(&self.pod));
        (c | p) & REWRITE_RST != 0 || c & p & REWRITE_FIN != 0
    }

    /// Resets both ends, each at the sequence number it expects next (see
    /// `Rewriter::abort`).
    fn reset(&self) {
        if let Some((_, p)) = self.pod {
            // To the client, from the address it connected to.
            let (a_local, client) = (addr(p.to.saddr, p.to.sport), addr(p.to.daddr, p.to.dport));
            let _ = send_rst(a_local, client, p.next_seq.wrapping_add(p.seq_add));
        }
        if let Some((_, c)) = self.client {
            let (b_local, pod) = (addr(c.to.saddr, c.to.sport), addr(c.to.daddr, c.to.dport));
            let _ = send_rst(b_local, pod, c.next_seq.wrapping_add(c.seq_add));
        }
    }
}

impl Conn {
    /// `b`: the connection's B, handed over by its leaving daemon.
    fn new(pair: &Pair, now: Instant, b: Option<OwnedFd>) -> Option<Conn> {
        // B's tuple: where the client's packets leave to, or where the pod's come to.
        let (b_local, pod) = match (&pair.client, &pair.pod) {
            (Some((_, c)), _) => (addr(c.to.saddr, c.to.sport), addr(c.to.daddr, c.to.dport)),
            (None, Some((k, _))) => (addr(k.daddr, k.dport), addr(k.saddr, k.sport)),
            (None, None) => return None,
        };
        let mut conn = Conn {
            b_local,
            pod,
            holder: b.map(|fd| Holder {
                fd,
                connected: true,
                silent: false,
            }),
            adopted: now,
            packets: 0,
            quiet_since: now,
            ended: None,
        };
        conn.hold();
        Some(conn)
    }

    /// Binds the holder, and connects it once B's socket is gone; puts a handed-over B
    /// into repair mode once the pod acknowledged all it sent.
    fn hold(&mut self) {
        if let Some(h) = &mut self.holder {
            if h.connected {
                if !h.silent {
                    h.silent = crate::sys::unsent_or_unacked(&h.fd).is_ok_and(|n| n == 0)
                        && crate::sys::setsockopt_int(
                            h.fd.as_raw_fd(),
                            libc::IPPROTO_TCP,
                            TCP_REPAIR,
                            1,
                        )
                        .is_ok();
                }
                return;
            }
        }
        if self.holder.is_none() {
            match bound(self.b_local) {
                Ok(fd) => {
                    self.holder = Some(Holder {
                        fd,
                        connected: false,
                        silent: true,
                    })
                }
                Err(e) => {
                    warn!(b = %self.b_local, error = %e,
                        "an adopted connection's port could not be held");
                    return;
                }
            }
        }
        if let Some(h) = &mut self.holder {
            let addr = socket2::SockAddr::from(SocketAddr::V4(self.pod));
            let sock = socket2::SockRef::from(&h.fd);
            // In repair mode the connect sends nothing; it fails while B's own socket
            // still holds the 4-tuple.
            h.connected = sock.connect(&addr).is_ok();
        }
    }
}

/// A socket in repair mode bound to `local` (beside a B that set SO_REUSEADDR too).
fn bound(local: SocketAddrV4) -> io::Result<OwnedFd> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    crate::sys::setsockopt_int(s.as_raw_fd(), libc::IPPROTO_TCP, TCP_REPAIR, 1)?;
    s.bind(&SocketAddr::V4(local).into())?;
    Ok(s.into())
}

/// A map's address and port (the address in network order as stored, the port in
/// network order).
fn addr(ip: u32, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::from(ip.to_ne_bytes()), u16::from_be(port))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    /// A daemon's directory is never taken for a gone daemon's, not even in the moment
    /// between its making and the program's attachment: its owner name is held first.
    #[test]
    fn a_live_daemons_new_directory_is_left_alone() {
        let root = std::env::temp_dir().join(format!("waypoint-adopt-test-{}", std::process::id()));
        let id = u32::MAX - 3 - u32::from(std::process::id() as u16);
        let dir = pins::ProgramDir::create(&root, id).unwrap();
        // Its scan at start runs before this returns.
        let adopter = Adopter::start(Config {
            idle_timeout: Duration::from_secs(60),
            max_lifetime: None,
            pin_dir: root.clone(),
        })
        .unwrap();
        assert!(
            dir.path().exists(),
            "the adopter removed a live daemon's directory"
        );
        assert_eq!(adopter.counts().programs, 0);
        drop(adopter);
        drop(dir);
        std::fs::remove_dir_all(root).unwrap();
    }
}
