//! Keeps the rewrite program on the ingress of every network interface of the namespace,
//! including the ones that appear after start: on a CNI without a bridge each new pod
//! brings a veth of its own, and a pod whose answers arrive on an interface without the
//! program would answer into the waypoint's socket (B) instead of the client.
//!
//! A netlink socket subscribed to link changes wakes a thread (`waypoint-links`), which
//! lists the interfaces (one `RTM_GETLINK` dump, in this thread's namespace) and attaches
//! the program to each new one. The message itself is not parsed: any change, a missed
//! one (a full socket buffer) or a second without any leads to the same comparison, so
//! nothing depends on reading every message. An interface that went (deleted, or moved
//! into a pod's namespace) has lost its attachment in the kernel; its link is dropped
//! here, so that a node with pod churn does not collect them.
//!
//! Where the kernel has no TCX (before 6.6) the program is a netlink filter on the
//! interface's clsact qdisc, which the daemon adds where none is and removes on exit
//! (see `clsact.rs`). Such a filter outlives its daemon; a TCX link is pinned in bpffs
//! (see `pins.rs`) so that it does too. A daemon that leaves its rewritten connections
//! to the next one ([`Links::leave`]) leaves its attachments; otherwise it removes them
//! on exit. A killed daemon's are adopted by the next one (see `adopt.rs`), or removed
//! (see `orphans.rs`).

use std::{
    collections::{BTreeMap, BTreeSet},
    os::fd::{AsFd as _, AsRawFd as _, OwnedFd},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
        Arc, Mutex, Weak,
    },
    time::Duration,
};

use aya::{
    programs::{
        links::{FdLink, LinkError, PinnedLink},
        tc::{NlOptions, SchedClassifierLinkId, TcAttachOptions},
        ProgramError, SchedClassifier, TcAttachType,
    },
    util::KernelVersion,
};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{self, AddressFamily, NetlinkAddr, SockFlag, SockProtocol, SockType};
use tracing::{debug, info, warn};

use super::background::{Background, JOIN_WITHIN};
use super::clsact;
use super::orphans;
use super::pins::ProgramDir;

/// How long the thread waits for a link change before it compares anyway (and looks
/// whether the dataplane is still there).
const RESCAN: Duration = Duration::from_secs(1);

/// Errors of watching the interfaces.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The netlink socket for link changes could not be set up.
    #[error("subscribing to link changes (netlink): {0}")]
    Netlink(#[source] nix::Error),
    /// The interfaces could not be listed.
    #[error("listing the network interfaces: {0}")]
    List(#[source] nix::Error),
    /// The program could not be attached to an interface present at start.
    #[error("attaching the rewrite program to {interface}: {source}")]
    Attach {
        /// The interface.
        interface: String,
        /// The cause.
        source: AttachError,
    },
    /// The program is missing from the object.
    #[error("the rewrite program is missing from the object")]
    Missing,
    /// The watching thread could not be started.
    #[error("starting the link watcher: {0}")]
    Thread(#[source] std::io::Error),
    /// The program's id could not be read, or its owner's mark not set (see
    /// `orphans.rs`).
    #[error("marking the rewrite program as this daemon's: {0}")]
    Owner(#[source] std::io::Error),
}

/// Why the program could not be attached to an interface.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The interface's clsact qdisc could not be added (a netlink attachment needs it).
    #[error("adding the clsact qdisc: {0}")]
    Qdisc(#[source] clsact::Error),
    /// The kernel refused the program.
    #[error(transparent)]
    Program(#[from] ProgramError),
    /// The TCX link could not be pinned (see `pins.rs`).
    #[error("pinning the link: {0}")]
    Pin(String),
}

/// How the program is attached to an interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attach {
    /// A TCX link (Linux 6.6 and later): programs of several owners chain without a
    /// qdisc.
    Tcx,
    /// A netlink filter on the interface's clsact qdisc, which the daemon adds where
    /// none is: what kernels without TCX have.
    Netlink,
}

impl Attach {
    /// What the running kernel offers (aya's own choice: TCX from 6.6).
    pub fn native() -> Attach {
        let tcx = KernelVersion::new(6, 6, 0);
        if KernelVersion::current().is_ok_and(|v| v >= tcx) {
            Attach::Tcx
        } else {
            Attach::Netlink
        }
    }
}

/// What [`Links`] reports.
#[derive(Debug, Default, Clone, Copy)]
pub struct LinkCounts {
    /// Interfaces the program is attached to now.
    pub attached: u64,
    /// Attachments that failed after start (each interface and name once).
    pub failed: u64,
}

/// The attachments of the rewrite program, kept up to date by a thread for as long as
/// this lives (the drop stops the thread and joins it).
pub struct Links {
    shared: Arc<Shared>,
    /// The write end of the pipe the thread polls beside the netlink socket: closing it
    /// wakes the thread, which then exits.
    stop: Option<OwnedFd>,
    thread: Option<Background>,
    /// The mark that the program is this live daemon's, until [`Links::release_owner`].
    owner: Mutex<Option<orphans::Owner>>,
    /// The program's id.
    prog_id: u32,
    /// The program's links and map are pinned (see `pins.rs`).
    pinned: bool,
}

impl Drop for Links {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = &mut self.thread {
            t.join(JOIN_WITHIN);
        }
    }
}

struct Shared {
    attached: AtomicU64,
    failed: AtomicU64,
    /// The attachments stay when the thread ends (see [`Links::leave`]).
    leave: AtomicBool,
}

/// One attachment.
enum Held {
    /// In the program's own list (a netlink filter, or a TCX link without bpffs).
    Owned(SchedClassifierLinkId),
    /// A TCX link pinned in the program's directory.
    Pinned(PinnedLink),
}

/// The thread's own state.
struct Attached {
    how: Attach,
    /// Interface index → its name when attached, and the link.
    links: BTreeMap<u32, (String, Held)>,
    /// (index, name) pairs whose attachment failed: not tried again (a renamed interface
    /// is a new pair, and is).
    failed: BTreeSet<(u32, String)>,
    /// Interfaces whose clsact qdisc the daemon added (removed on exit).
    qdiscs: BTreeSet<u32>,
    /// Where the program's TCX links and map are pinned; None without bpffs (its
    /// connections then end with the daemon).
    dir: Option<ProgramDir>,
}

impl Links {
    /// Attaches `program` (by name in `object`) to every interface now present, `how`
    /// says how (failing if any refuses), and starts the thread that follows the
    /// changes. The thread holds the object only while it attaches: dropping the last
    /// other owner unloads it. `dir` is where TCX links are pinned.
    pub fn start<O>(
        object: &Arc<Mutex<O>>,
        program: &'static str,
        how: Attach,
        dir: Option<ProgramDir>,
    ) -> Result<Links, Error>
    where
        O: ProgramOwner + Send + 'static,
    {
        let sock = subscribe()?;
        let shared = Arc::new(Shared {
            attached: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            leave: AtomicBool::new(false),
        });
        let mut watch = Attached {
            how,
            links: BTreeMap::new(),
            failed: BTreeSet::new(),
            qdiscs: BTreeSet::new(),
            dir,
        };
        let owner;
        let prog_id;
        let pinned = watch.dir.is_some();
        {
            let mut o = object.lock().unwrap_or_else(|p| p.into_inner());
            let prog = o.classifier(program).ok_or(Error::Missing)?;
            if how == Attach::Netlink {
                // Once, here: an interface that appears later has no dead daemon's
                // filter on it.
                orphans::remove_everywhere();
            }
            // Before the first attachment: another daemon starting now must not take ours
            // for a dead one's.
            let id = prog
                .info()
                .map_err(|e| Error::Owner(std::io::Error::other(e)))?
                .id();
            prog_id = id;
            owner = Some(match watch.dir.as_mut().and_then(ProgramDir::take_owner) {
                Some(o) => o,
                None => orphans::Owner::hold(id).map_err(Error::Owner)?,
            });
            for (index, name) in interfaces()? {
                if let Err(source) = watch.attach(prog, index, &name) {
                    watch.release(Some(prog), false);
                    return Err(Error::Attach {
                        interface: name,
                        source,
                    });
                }
            }
            info!(
                interfaces = ?watch.links.values().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
                ?how,
                qdiscs_added = watch.qdiscs.len(),
                "rewrite program attached"
            );
        }
        shared.attached.store(watch.links.len() as u64, Relaxed);
        let weak = Arc::downgrade(object);
        let thread_shared = shared.clone();
        let (stop_rd, stop) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(Error::Netlink)?;
        let thread = Background::spawn("waypoint-links", move || {
            run(&sock, &stop_rd, &weak, program, &mut watch, &thread_shared);
            let object = weak.upgrade();
            let mut o = object
                .as_ref()
                .map(|o| o.lock().unwrap_or_else(|p| p.into_inner()));
            let leave = thread_shared.leave.load(Relaxed);
            watch.release(o.as_mut().and_then(|o| o.classifier(program)), leave);
        })
        .map_err(Error::Thread)?;
        Ok(Links {
            shared,
            stop: Some(stop),
            thread: Some(thread),
            owner: Mutex::new(owner),
            prog_id,
            pinned,
        })
    }

    /// Leaves the attachments (and their pins) in place when this goes, for the next
    /// daemon to adopt with the connections they rewrite.
    pub fn leave(&self) {
        self.shared.leave.store(true, Relaxed);
    }

    /// Lets go of the program's owner name: another daemon may adopt it from now on.
    pub fn release_owner(&self) {
        drop(self.owner.lock().unwrap_or_else(|p| p.into_inner()).take());
    }

    /// The program's id.
    pub fn prog_id(&self) -> u32 {
        self.prog_id
    }

    /// Whether the program's links and map are pinned: its connections can outlive this
    /// daemon.
    pub fn pinned(&self) -> bool {
        self.pinned
    }

    /// The attachments now, and the failures since start.
    pub fn counts(&self) -> LinkCounts {
        LinkCounts {
            attached: self.shared.attached.load(Relaxed),
            failed: self.shared.failed.load(Relaxed),
        }
    }
}

/// What owns the loaded programs: the thread finds the classifier through it.
pub trait ProgramOwner {
    /// The classifier `name`, if the object has it.
    fn classifier(&mut self, name: &str) -> Option<&mut SchedClassifier>;
}

impl ProgramOwner for aya::Ebpf {
    fn classifier(&mut self, name: &str) -> Option<&mut SchedClassifier> {
        self.program_mut(name)?.try_into().ok()
    }
}

/// A netlink socket that receives the link changes of this thread's namespace, and
/// times out after [`RESCAN`].
fn subscribe() -> Result<OwnedFd, Error> {
    let sock = socket::socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkRoute,
    )
    .map_err(Error::Netlink)?;
    let groups = libc::RTMGRP_LINK as u32;
    socket::bind(sock.as_raw_fd(), &NetlinkAddr::new(0, groups)).map_err(Error::Netlink)?;
    let timeout = nix::sys::time::TimeVal::new(RESCAN.as_secs() as libc::time_t, 0);
    socket::setsockopt(&sock, socket::sockopt::ReceiveTimeout, &timeout).map_err(Error::Netlink)?;
    Ok(sock)
}

/// The interfaces of this thread's namespace, by index.
fn interfaces() -> Result<Vec<(u32, String)>, Error> {
    let list = nix::net::if_::if_nameindex().map_err(Error::List)?;
    Ok(list
        .iter()
        .map(|i| (i.index(), i.name().to_string_lossy().into_owned()))
        .collect())
}

fn run<O: ProgramOwner>(
    sock: &OwnedFd,
    stop: &OwnedFd,
    object: &Weak<Mutex<O>>,
    program: &str,
    watch: &mut Attached,
    shared: &Shared,
) {
    // Messages are only a cue; 16 KiB holds several (a larger one is cut, harmlessly).
    let mut buf = vec![0u8; 16 * 1024];
    let timeout = PollTimeout::try_from(RESCAN).unwrap_or(PollTimeout::NONE);
    loop {
        let mut fds = [
            PollFd::new(sock.as_fd(), PollFlags::POLLIN),
            PollFd::new(stop.as_fd(), PollFlags::POLLIN),
        ];
        // An error here is met again by the read below.
        let _ = poll(&mut fds, timeout);
        if fds[1].any().unwrap_or(true) {
            debug!("link watcher: stopped");
            return;
        }
        match socket::recv(sock.as_raw_fd(), &mut buf, socket::MsgFlags::MSG_DONTWAIT) {
            // A change, a second without one, or changes lost to a full buffer: compare.
            Ok(_) | Err(nix::Error::EAGAIN | nix::Error::EINTR | nix::Error::ENOBUFS) => {}
            Err(e) => {
                warn!(error = %e, "link watcher: reading link changes failed; comparing every second");
                std::thread::sleep(RESCAN);
            }
        }
        let Some(object) = object.upgrade() else {
            debug!("link watcher: dataplane gone, stopping");
            return;
        };
        let current = match interfaces() {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "link watcher");
                continue;
            }
        };
        let mut o = object.lock().unwrap_or_else(|p| p.into_inner());
        let Some(prog) = o.classifier(program) else {
            return;
        };
        watch.sync(prog, &current, shared);
    }
}

impl Attached {
    /// Drops the links of interfaces that went, and attaches to new ones.
    fn sync(&mut self, prog: &mut SchedClassifier, current: &[(u32, String)], shared: &Shared) {
        let present: BTreeSet<u32> = current.iter().map(|(i, _)| *i).collect();
        let gone: Vec<u32> = self
            .links
            .keys()
            .filter(|i| !present.contains(i))
            .copied()
            .collect();
        for index in gone {
            if let Some((name, held)) = self.links.remove(&index) {
                // The kernel detached it with the interface; this frees our side.
                match held {
                    Held::Owned(id) => drop(prog.take_link(id)),
                    Held::Pinned(link) => drop(link.unpin()),
                }
                debug!(interface = %name, index, "interface gone");
            }
            // Its qdisc went with it.
            self.qdiscs.remove(&index);
        }
        self.failed.retain(|(i, _)| present.contains(i));
        for (index, name) in current {
            if self.links.contains_key(index) || self.failed.contains(&(*index, name.clone())) {
                continue;
            }
            match self.attach(prog, *index, name) {
                Ok(()) => {
                    info!(interface = %name, index, "rewrite program attached to a new interface");
                }
                Err(e) => {
                    // Gone again before the attach (a CNI's temporary name), or refused.
                    // Its pods' hand-overs end as `stranded` rather than hang.
                    warn!(interface = %name, index, error = %e,
                        "rewrite program could not be attached to a new interface");
                    shared.failed.fetch_add(1, Relaxed);
                    self.failed.insert((*index, name.clone()));
                }
            }
        }
        shared.attached.store(self.links.len() as u64, Relaxed);
    }

    /// Attaches the program to one interface, adding its clsact qdisc first where the
    /// attachment needs one and it has none.
    fn attach(
        &mut self,
        prog: &mut SchedClassifier,
        index: u32,
        name: &str,
    ) -> Result<(), AttachError> {
        let attached = match self.how {
            Attach::Tcx => {
                let id = prog.attach(name, TcAttachType::Ingress)?;
                let held = match &self.dir {
                    Some(dir) => Held::Pinned(pin(prog, id, &dir.link(index))?),
                    None => Held::Owned(id),
                };
                self.links.insert(index, (name.to_owned(), held));
                return Ok(());
            }
            Attach::Netlink => {
                if clsact::add(index).map_err(AttachError::Qdisc)? {
                    self.qdiscs.insert(index);
                }
                prog.attach_with_options(
                    name,
                    TcAttachType::Ingress,
                    TcAttachOptions::Netlink(NlOptions::default()),
                )
            }
        };
        let id = attached?;
        self.links.insert(index, (name.to_owned(), Held::Owned(id)));
        Ok(())
    }

    /// Detaches the program from the interfaces whose clsact qdisc the daemon added
    /// (all of them go with the program anyway, when `prog` is None), then removes each
    /// such qdisc that no other filter uses; unpins the pinned links. With `leave`, it
    /// leaves every attachment, pin and qdisc in place instead.
    fn release(&mut self, mut prog: Option<&mut SchedClassifier>, leave: bool) {
        if leave {
            for (_, (_, held)) in std::mem::take(&mut self.links) {
                match held {
                    // Its pin holds it.
                    Held::Pinned(link) => drop(link),
                    // A netlink filter stays until removed; taken out of the program's
                    // list, which would detach it when the program goes.
                    Held::Owned(id) => {
                        if let Some(p) = prog.as_deref_mut() {
                            if let Ok(link) = p.take_link(id) {
                                std::mem::forget(link);
                            }
                        }
                    }
                }
            }
            if let Some(dir) = &mut self.dir {
                dir.keep();
            }
            self.qdiscs.clear();
            return;
        }
        let pinned: Vec<u32> = self
            .links
            .iter()
            .filter(|(_, (_, h))| matches!(h, Held::Pinned(_)))
            .map(|(i, _)| *i)
            .collect();
        for index in pinned {
            if let Some((_, Held::Pinned(link))) = self.links.remove(&index) {
                if let Err(e) = link.unpin() {
                    warn!(error = %e, "a pinned rewrite link could not be unpinned");
                }
            }
        }
        for index in std::mem::take(&mut self.qdiscs) {
            if let (Some(p), Some((_, Held::Owned(id)))) =
                (prog.as_deref_mut(), self.links.remove(&index))
            {
                // Dropping an owned link detaches it.
                drop(p.take_link(id));
            }
            match clsact::filters(index) {
                Ok(0) => match clsact::remove(index) {
                    Ok(()) => debug!(index, "clsact qdisc removed"),
                    Err(e) => {
                        warn!(index, error = %e, "the clsact qdisc the daemon added could not be removed")
                    }
                },
                Ok(others) => info!(
                    index,
                    others, "the clsact qdisc the daemon added is left: other filters use it"
                ),
                Err(e) => warn!(index, error = %e,
                    "the clsact qdisc the daemon added is left: its filters could not be listed"),
            }
        }
    }
}

/// Takes TCX link `id` out of the program's list and pins it at `path`: the pin then
/// holds it, whatever becomes of this process.
fn pin(
    prog: &mut SchedClassifier,
    id: SchedClassifierLinkId,
    path: &std::path::Path,
) -> Result<PinnedLink, AttachError> {
    let link = prog.take_link(id)?;
    let fd: FdLink = link
        .try_into()
        .map_err(|e: LinkError| AttachError::Pin(e.to_string()))?;
    // A failed pin drops the link, which detaches it.
    fd.pin(path).map_err(|e| AttachError::Pin(e.to_string()))
}
