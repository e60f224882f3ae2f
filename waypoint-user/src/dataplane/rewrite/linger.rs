//! The linger: an ended rewritten connection's entries, and its B, stay [`LINGER`] for
//! the last ACK and any resent FIN, at most [`linger_limit`] of them at once; one thread
//! ([`Rewriter::start_sweeping`]) ends those whose linger is over.

use std::{
    io,
    os::fd::{AsRawFd as _, OwnedFd},
    sync::{atomic::Ordering::Relaxed, Arc},
    time::{Duration, Instant},
};

use tracing::{debug, warn};

use super::*;

/// How long the entries of an ended connection stay: the last ACK, or a retransmitted
/// FIN, must still be rewritten (an RTO is 200 ms at least, doubling).
pub const LINGER: Duration = Duration::from_secs(3);

/// How often the lingering connections whose linger is over are ended.
pub(super) const SWEEP_INTERVAL: Duration = Duration::from_millis(100);

/// The fewest connections allowed to linger at once, whatever the node's ports and
/// descriptors (see [`linger_limit`]).
pub(super) const MIN_LINGERING: usize = 256;

/// How many ended connections may linger at once before the oldest lose the rest of
/// their [`LINGER`]: a quarter of the ephemeral port range, and of the open-file limit.
///
/// Each lingering connection holds its B, and with it a local port to the pod. The
/// kernel's `connect` picks ports of one parity first (half the range), each dial to a
/// destination from where the last one ended: while fewer than that half are held, the
/// port it tries first is free, and it checks one 4-tuple. Past it, every dial walks the
/// held ports (under 16 openers, 3 s of linger held about 17,600 of the 28,232 and cost
/// 209.8 µs of CPU per connection, most of it in that walk). A quarter leaves room for
/// the node's other connections. The descriptors: a connection holds two while open,
/// one while it lingers. A linger cut short costs nothing unless the connection's last
/// ACK is lost: the end that resends its FIN is answered with a reset rather than an
/// ACK, after both ends have closed.
pub(super) fn linger_limit(ports: (u16, u16), open_files: u64) -> usize {
    let ports = (usize::from(ports.1) - usize::from(ports.0) + 1) / 4;
    let files = usize::try_from(open_files / 4).unwrap_or(usize::MAX);
    ports.min(files).max(MIN_LINGERING)
}

/// This node's [`linger_limit`]; the kernel's defaults where a figure cannot be read.
pub(super) fn node_linger_limit() -> usize {
    let ports = crate::sys::ephemeral_ports().unwrap_or_else(|e| {
        warn!(error = %e, "reading the ephemeral port range; taking 32768-60999");
        (32768, 60999)
    });
    let files = crate::sys::nofile_limit().unwrap_or_else(|e| {
        warn!(error = %e, "reading the open file limit; taking 1024");
        1024
    });
    let limit = linger_limit(ports, files);
    debug!(
        limit,
        ?ports,
        files,
        "rewrite: connections that may linger at once"
    );
    limit
}

/// An ended connection whose entries linger ([`LINGER`]) until [`Rewriter::sweep`]
/// removes them, or the rewriter goes; B closes silently when it drops.
pub(super) struct Lingering {
    pub(super) due: Instant,
    pub(super) entries: Entries,
    pub(super) slot: u32,
    pub(super) upstream: OwnedFd,
    /// See [`HandedOver::filled`].
    pub(super) filled: bool,
}

impl Drop for Lingering {
    fn drop(&mut self) {
        let _ = set_repair(self.upstream.as_raw_fd(), 1);
    }
}

impl Rewriter {
    /// Starts the thread that ends the lingering connections ([`Rewriter::sweep`]); it
    /// exits at [`Rewriter::stop`], or once the rewriter is gone.
    pub fn start_sweeping(self: &Arc<Self>) -> io::Result<()> {
        let weak = Arc::downgrade(self);
        let thread = Background::spawn("waypoint-linger", move || loop {
            std::thread::park_timeout(SWEEP_INTERVAL);
            let Some(rewriter) = weak.upgrade() else {
                return;
            };
            if rewriter.stopping.load(Relaxed) {
                return;
            }
            rewriter.sweep(Instant::now());
        })?;
        *lock(&self.sweeper) = Some(thread);
        Ok(())
    }

    /// Removes the entries of every connection whose linger is over, and of the oldest
    /// beyond the [`linger_limit`], all in one map call, and closes their B (silently).
    /// One thread's turn every [`SWEEP_INTERVAL`] for all of them, rather than a timer
    /// and a turn of its worker for each; and the connection's task is gone at its end,
    /// not 3 s later. (Measured here: 9.3 µs of CPU per connection on this thread, 10.2
    /// µs on the workers before; most of it closing B.)
    pub(super) fn sweep(&self, now: Instant) {
        let due: Vec<Lingering> = {
            let mut queue = lock(&self.lingering);
            // In order of `due` (see `Conn::ended`).
            let over = queue.iter().take_while(|l| l.due <= now).count();
            let cut = (queue.len() - over).saturating_sub(self.linger_limit);
            if cut > 0 {
                self.lingers_cut.fetch_add(cut as u64, Relaxed);
            }
            queue.drain(..over + cut).collect()
        };
        self.end_lingering(due);
    }

    /// Removes the entries of `due`, then closes their B (silently): in that order,
    /// because a closed B frees its port for the next dial to the same pod, whose
    /// packets would otherwise still match the entries and be rewritten into the old
    /// client's conversation.
    fn end_lingering(&self, due: Vec<Lingering>) {
        if due.is_empty() {
            return;
        }
        let mut keys = Vec::with_capacity(2 * due.len());
        for l in &due {
            if self.client_ours(&l.entries, l.slot) {
                keys.push(l.entries.from_client);
            }
            keys.push(l.entries.from_pod);
        }
        self.delete(&keys);
        for l in due.iter().filter(|l| l.filled) {
            self.forget_fill(&l.entries);
        }
        self.live.fetch_sub(due.len() as u64, Relaxed);
        // Each B closes silently as it drops.
        drop(due);
    }
}

impl Drop for Rewriter {
    /// The program may outlive the rewriter for a while (it goes with the dataplane's
    /// other parts, or with the process): the lingering connections' entries go before
    /// their B frees its port (see [`Rewriter::end_lingering`]). Under a rolling restart
    /// the next daemon dials the same pod from those ports at once.
    fn drop(&mut self) {
        let all = std::mem::take(&mut *lock(&self.lingering));
        self.end_lingering(all.into());
    }
}
