//! Rewrite filters a killed daemon left behind (kernels before 6.6).
//!
//! A netlink filter is not tied to the process that added it: a daemon killed with
//! SIGKILL leaves its rewrite program on every interface, with its map of rewritten
//! connections. Nobody ends those connections any more, and their entries would rewrite
//! the packets of any new connection that takes one of their 4-tuples: the next daemon,
//! dialing a pod from a port the dead one's socket freed, would have the pod's answers
//! rewritten into a dead connection's client. (A TCX link goes with its process.)
//!
//! So each daemon marks its program as owned, for as long as it lives, with an abstract
//! unix socket named for the program's id ([`Owner`]): the kernel frees the name with the
//! process, however it ends, and the name is seen from every process of the network
//! namespace, whatever its PID namespace (every daemon of a node runs in the host's).
//! Every daemon, whichever dataplane it runs, removes at its start the rewrite filters
//! whose program no one owns ([`remove_everywhere`]), and a rewriting one again right
//! before its first attachment (a test loads the dataplane without the daemon's start).
//! Their connections then end at their next packet: the client's and the pod's reach
//! sockets that are gone, and are answered with a reset.
//!
//! Except a program whose map is pinned (see `pins.rs`): its daemon marked it so
//! ([`PORTS_PINNED`]), and the adopter of its pin directory takes its connections over
//! (see `adopt.rs`). Between a daemon's end and its successor's adoption no one owns
//! it; a daemon starting then, or one that pins elsewhere, leaves it in place.

use std::{collections::BTreeMap, io, os::fd::OwnedFd};

use aya::maps::{Array, Map, MapData, MapError, MapInfo};
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};
use tracing::{debug, info, warn};
use waypoint_common::{PORTS_PINNED, REWRITE_PORTS_MAP};

use super::clsact;

/// The names of the programs whose filters are looked at: this build's, and any other
/// version's that keeps the prefix.
const PREFIX: &str = "waypoint_rewrite";

/// The mark of a daemon's rewrite program: held until dropped (or the process ends).
#[derive(Debug)]
pub struct Owner {
    _socket: OwnedFd,
}

impl Owner {
    /// Marks program `prog_id` as this process's.
    pub fn hold(prog_id: u32) -> io::Result<Owner> {
        let socket = bind(prog_id)?;
        Ok(Owner { _socket: socket })
    }
}

/// The abstract socket name of program `prog_id`'s owner.
fn name(prog_id: u32) -> String {
    format!("waypoint/rewrite-program/{prog_id}")
}

/// Binds the owner's name of `prog_id`: fails with `EADDRINUSE` while its owner lives.
fn bind(prog_id: u32) -> io::Result<OwnedFd> {
    let socket = socket::socket(
        AddressFamily::Unix,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let addr = UnixAddr::new_abstract(name(prog_id).as_bytes())?;
    socket::bind(std::os::fd::AsRawFd::as_raw_fd(&socket), &addr)?;
    Ok(socket)
}

/// Whether program `prog_id` has an owner.
fn owned(prog_id: u32) -> io::Result<bool> {
    match bind(prog_id) {
        // Nobody holds the name; the probe lets it go again as it drops.
        Ok(_) => Ok(false),
        Err(e) if e.raw_os_error() == Some(libc::EADDRINUSE) => Ok(true),
        Err(e) => Err(e),
    }
}

/// Whether program `prog_id` carries the mark of a pinned one ([`PORTS_PINNED`] in its
/// `REWRITE_PORTS`): its connections are kept for the next daemon of its pin directory,
/// which adopts them. Found through the program's map ids: a walk of the loaded
/// programs, then a few `bpf` calls (only for a filter no one owns).
fn pinned(prog_id: u32) -> Result<bool, String> {
    let info = aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .find(|p| p.id() == prog_id)
        .ok_or("the program is not loaded")?;
    let ids = info
        .map_ids()
        .map_err(|e| e.to_string())?
        .ok_or("the kernel does not tell a program's maps")?;
    for id in ids {
        let Ok(map) = MapInfo::from_id(id) else {
            continue;
        };
        if map.name_as_str() != Some(REWRITE_PORTS_MAP) {
            continue;
        }
        let data = MapData::from_id(id).map_err(|e| e.to_string())?;
        let ports: Array<MapData, u8> = Map::Array(data)
            .try_into()
            .map_err(|e: MapError| e.to_string())?;
        let mark = ports.get(&0, 0).map_err(|e| e.to_string())?;
        return Ok(mark & PORTS_PINNED != 0);
    }
    Err(format!("the program has no {REWRITE_PORTS_MAP}"))
}

/// Removes the rewrite filters no one owns on every interface of this thread's network
/// namespace: at the start of every daemon, whichever dataplane it runs (one netlink
/// dump per interface). A failure is logged.
pub fn remove_everywhere() {
    match nix::net::if_::if_nameindex() {
        Ok(list) => {
            // A pinned program's filter sits on every interface: its mark is read once.
            let mut pinned_ids = BTreeMap::new();
            for i in list.iter() {
                remove(
                    i.index(),
                    &i.name().to_string_lossy(),
                    None,
                    &mut pinned_ids,
                );
            }
        }
        Err(e) => warn!(error = %e,
            "listing the interfaces, to remove the rewrite filters a killed daemon left, failed"),
    }
}

/// Whether program `prog_id` is a netlink filter on an interface of this thread's
/// network namespace (one netlink dump per interface).
pub fn filtering(prog_id: u32) -> bool {
    let Ok(list) = nix::net::if_::if_nameindex() else {
        return false;
    };
    list.iter().any(|i| {
        clsact::ingress_bpf_filters(i.index())
            .is_ok_and(|f| f.iter().any(|f| f.prog_id == Some(prog_id)))
    })
}

/// Removes the filters of program `prog_id` (an adopted one whose connections ended) on
/// every interface of this thread's network namespace. A failure is logged.
pub fn remove_program(prog_id: u32) {
    let Ok(list) = nix::net::if_::if_nameindex() else {
        return;
    };
    for i in list.iter() {
        remove(
            i.index(),
            &i.name().to_string_lossy(),
            Some(prog_id),
            &mut BTreeMap::new(),
        );
    }
}

/// Removes the rewrite filters on interface `index` (`interface` names it in logs) whose
/// program has no owner and is not pinned (`pinned_ids` keeps what was read of the
/// marks), or program `only`'s; how many it removed. A failure is logged,
/// and leaves the filter.
fn remove(
    index: u32,
    interface: &str,
    only: Option<u32>,
    pinned_ids: &mut BTreeMap<u32, Result<bool, String>>,
) -> usize {
    let filters = match clsact::ingress_bpf_filters(index) {
        Ok(f) => f,
        Err(e) => {
            warn!(interface, error = %e,
                "listing the interface's filters, to remove the ones a killed daemon left, failed");
            return 0;
        }
    };
    let mut removed = 0;
    for f in filters {
        let (Some(name), Some(id)) = (&f.name, f.prog_id) else {
            continue;
        };
        if !name.starts_with(PREFIX) || only.is_some_and(|o| o != id) {
            continue;
        }
        if only.is_none() {
            match owned(id) {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => {
                    warn!(interface, prog_id = id, error = %e,
                        "could not tell whether a rewrite filter's daemon lives; left");
                    continue;
                }
            }
            match pinned_ids.entry(id).or_insert_with(|| pinned(id)) {
                Ok(true) => {
                    debug!(interface, prog_id = id,
                        "a gone daemon's rewrite filter is pinned: left to the daemon that adopts it");
                    continue;
                }
                Ok(false) => {}
                // Removed: a filter no one ends would rewrite new connections' packets.
                Err(e) => warn!(interface, prog_id = id, error = %e,
                    "could not tell whether a gone daemon's rewrite program is pinned; removed"),
            }
        }
        match clsact::remove_filter(&f) {
            Ok(()) => {
                removed += 1;
                info!(interface, prog_id = id,
                    "removed the rewrite filter of a daemon that is gone: its connections end at their next packet");
            }
            Err(e) => warn!(interface, prog_id = id, error = %e,
                "the rewrite filter of a daemon that is gone could not be removed: its \
                 connections' entries may rewrite new connections' packets"),
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    /// The mark is seen while held and gone once dropped; holding it twice fails.
    #[test]
    fn an_owner_is_seen_while_it_lives() {
        // An id no program has: the test's own, far above what a host allocates.
        let id = u32::MAX - u32::from(std::process::id() as u16);
        assert!(!owned(id).unwrap());
        let owner = Owner::hold(id).unwrap();
        assert!(owned(id).unwrap());
        assert_eq!(
            Owner::hold(id).unwrap_err().raw_os_error(),
            Some(libc::EADDRINUSE)
        );
        drop(owner);
        assert!(!owned(id).unwrap());
    }
}
