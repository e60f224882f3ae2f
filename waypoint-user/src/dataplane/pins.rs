//! What a rewriting daemon leaves in bpffs, so that its connections outlive it.
//!
//! A rewritten connection needs no socket of the daemon's: its packets are rewritten by
//! the TC program from the entries in `REWRITES`. Both live as long as something holds
//! them. A netlink filter holds its program (and the program its maps) until someone
//! removes it; a TCX link goes with its last descriptor, so the daemon pins each one.
//! The rewrite map is pinned beside them, under a name that carries its layout's
//! version ([`REWRITES_PIN`]), so that a later daemon can find the connections and end
//! them when they end (see `adopt.rs`).
//!
//! Layout: `<--pin-dir>/net-<netns inode>/rewrite-<program id>/`, holding
//! `rewrites-v1` and, with TCX, `link-<interface index>` per attachment. The network
//! namespace's directory keeps the daemons of different namespaces (one per node, or
//! one per test) apart: each sees only its own interfaces and owner names.

use std::{
    io,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use tracing::warn;

/// `--pin-dir`'s default: in bpffs where the DaemonSet mounts the host's (writable).
pub const DEFAULT_DIR: &str = "/sys/fs/bpf/waypoint";

/// The pinned rewrite map's name: its entries' layout (`waypoint_common::Rewrite` and
/// `RewriteKey`) is version 1. A change to either takes the next number, and a daemon
/// adopts only the version it reads.
pub const REWRITES_PIN: &str = "rewrites-v1";

/// The prefix of every version's pinned rewrite map.
pub const REWRITES_PIN_PREFIX: &str = "rewrites-v";

/// The prefix of a program's directory.
pub const PROGRAM_PREFIX: &str = "rewrite-";

/// The prefix of a pinned TCX link.
pub const LINK_PREFIX: &str = "link-";

/// The directory of this thread's network namespace under `root`.
pub fn namespace_dir(root: &Path) -> io::Result<PathBuf> {
    let ino = std::fs::metadata("/proc/thread-self/ns/net")?.ino();
    Ok(root.join(format!("net-{ino}")))
}

/// A rewrite program's directory: removed on drop unless [`ProgramDir::keep`] was
/// called.
#[derive(Debug)]
pub struct ProgramDir {
    path: PathBuf,
    keep: bool,
    /// The program's owner name, taken before the directory is made, until the links
    /// take it ([`ProgramDir::take_owner`]).
    owner: Option<super::orphans::Owner>,
}

impl ProgramDir {
    /// Creates the directory of program `prog_id` under `root` (and its parents), its
    /// owner name held first: an adopter that saw the directory before the name was
    /// taken would take it for a gone daemon's, and remove it.
    pub fn create(root: &Path, prog_id: u32) -> io::Result<ProgramDir> {
        let owner = super::orphans::Owner::hold(prog_id)?;
        let path = namespace_dir(root)?.join(format!("{PROGRAM_PREFIX}{prog_id}"));
        std::fs::create_dir_all(&path)?;
        Ok(ProgramDir {
            path,
            keep: false,
            owner: Some(owner),
        })
    }

    /// The program's owner name, for whoever marks the program as live from now on.
    pub fn take_owner(&mut self) -> Option<super::orphans::Owner> {
        self.owner.take()
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where the link to interface `index` is pinned.
    pub fn link(&self, index: u32) -> PathBuf {
        self.path.join(format!("{LINK_PREFIX}{index}"))
    }

    /// Leaves the directory and its pins for the next daemon.
    pub fn keep(&mut self) {
        self.keep = true;
    }
}

impl Drop for ProgramDir {
    fn drop(&mut self) {
        if !self.keep {
            remove(&self.path);
        }
    }
}

/// Removes a program's directory and its pins (a pinned link or map goes with its last
/// reference). A failure is logged.
pub fn remove(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != io::ErrorKind::NotFound {
            warn!(dir = %dir.display(), error = %e, "a rewrite program's pins could not be removed");
        }
    }
}

/// The program id a directory's name carries.
pub fn program_id(dir: &Path) -> Option<u32> {
    dir.file_name()?
        .to_str()?
        .strip_prefix(PROGRAM_PREFIX)?
        .parse()
        .ok()
}

/// Removes the rewrite programs pinned under `root` (in this thread's network
/// namespace) whose daemon is gone, with their connections (they end at their next
/// packet): what an uninstall does, and a test that leaves no state behind. A program
/// a live daemon or adopter owns is left. How many it removed; a failure is logged.
pub fn remove_unowned(root: &Path) -> usize {
    let Ok(entries) = namespace_dir(root).and_then(std::fs::read_dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(id) = program_id(&path) else {
            continue;
        };
        // Held while its filters go: no adopter takes it meanwhile.
        let Ok(_owner) = super::orphans::Owner::hold(id) else {
            continue;
        };
        // A TCX link goes with its pin (nothing else holds it); a netlink filter must be
        // removed.
        super::orphans::remove_program(id);
        remove(&path);
        removed += 1;
    }
    removed
}
