//! The SockHash path of the eBPF dataplane: a connection's copy phase and its move into
//! the kernel ([`Ebpf::forward_sockmap`]), the sockets' entry into the SockHash
//! ([`Ebpf::enter`]: baselines, records, drain, credit, insertion, kick), the fallback to
//! the userspace copy, the kernel phase's two [`Direction`]s under `drive`, and the
//! socket helpers they share.

use std::{
    future::Future,
    io::{self},
    net::TcpStream as StdTcpStream,
    ops::Range,
    os::fd::AsFd,
    pin::pin,
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Arc, Mutex,
    },
    time::Instant,
};

use futures::{future::Either, FutureExt as _};
use nix::sys::{
    epoll::EpollFlags,
    socket::{setsockopt, sockopt},
};
use tokio::net::TcpStream;
use tracing::debug;

use crate::dataplane::flows::{Budget, FlowCell, FlowRef};
use crate::dataplane::send_buffer::DrainProbe;
use crate::dataplane::watch::Watch;
use crate::dataplane::TCP_ESTABLISHED;
use crate::dataplane::{
    abort_on_close,
    copy::{self, copy, Copied},
    drive, fin_sent, queued, read_now, resets_on_close, shutdown_write,
    stall::Watchdog,
    tcp_info, unsent_or_unacked, write_now, End, Limits, Outcome, TCP_CLOSE,
};

use super::direction::Direction;
/// The eBPF object built by waypoint-user's build script from waypoint-ebpf.
use super::*;
use crate::dataplane::rewrite::Refusal;
use crate::dataplane::tally::Taken;

/// How a connection's sockets enter the SockHash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Entry {
    /// Read everything queued on both sockets first and write it from userspace: the
    /// safe way, whatever is queued (a partly read hello) and whether or not the verdict
    /// can cut repeated bytes.
    Drain,
    /// For a connection moved from the copy, with the repeat check on: only the socket
    /// with less queued goes in drained, first. The other goes in second, with its queue
    /// as it is, and a kick runs the verdict over that queue at once: with its peer in
    /// place and credit published, the queue is redirected in order, and the repeat
    /// check cuts what the copy had read of its first segment. No byte of a steady sender
    /// passes through userspace at the move.
    Kick,
}

impl Ebpf {
    /// The SockHash redirect (after the copy, see [`Config::move_after`]).
    ///
    /// The kernel phase ([`Ebpf::redirect`], about 2.6 KB of state in a debug build) is boxed: inline, it
    /// would size every connection's task, and most connections (short or idle ones)
    /// never leave the copy.
    ///
    /// Owns a handle on the dataplane rather than borrowing it, so that the connection's
    /// task can hold this future without an `async` block around it.
    pub(super) fn forward_sockmap(
        self: &Arc<Self>,
        downstream: TcpStream,
        upstream: TcpStream,
        initial: Vec<u8>,
        limits: Limits,
        why: Option<Refusal>,
    ) -> impl Future<Output = Result<Outcome, Error>> + Send + 'static {
        let dp = Arc::clone(self);
        if self.config.move_after == 0 {
            return Either::Left(Box::pin(async move {
                dp.redirect(
                    downstream,
                    upstream,
                    (initial, Vec::new()),
                    limits,
                    Entry::Drain,
                    why,
                )
                .await
            }));
        }
        let start = Instant::now();
        // The copy first (see [`copy()`]), parked while idle, then the kernel phase,
        // chained with a combinator: an `async` block would keep the arguments it moved
        // into the copy, and the copy's state, for the connection's whole life.
        let copy = copy(
            downstream,
            upstream,
            initial,
            limits,
            self.config.move_after,
            self.tally,
        );
        Either::Right(copy.then(move |(copied, (d2u, u2d))| match copied {
            Copied::Move { down, up, stalled } => Either::Left(Box::pin(async move {
                // A connection is counted as stalled once, whichever phase saw it.
                let limits = Limits {
                    stall_after: limits.stall_after.filter(|_| !stalled),
                    ..limits
                };
                dp.after_move(down, up, (d2u, u2d), limits, start, why)
                    .await
            })),
            Copied::Ended(end) => {
                dp.tally.took(Taken::CopiedShort);
                Either::Right(std::future::ready(Ok(Outcome {
                    downstream_to_upstream: d2u,
                    upstream_to_downstream: u2d,
                    end,
                })))
            }
        }))
    }

    /// The kernel phase of a connection that carried `moved` bytes (downstream to
    /// upstream, upstream to downstream) in the copy, accepted at `start`.
    pub(super) async fn after_move(
        &self,
        downstream: TcpStream,
        upstream: TcpStream,
        (d2u, u2d): (u64, u64),
        limits: Limits,
        start: Instant,
        why: Option<Refusal>,
    ) -> Result<Outcome, Error> {
        self.handovers.fetch_add(1, Relaxed);
        debug!(d2u, u2d, "moving the connection into the kernel");
        // The lifetime counts from the accept, not from the move.
        let limits = Limits {
            max_lifetime: limits
                .max_lifetime
                .map(|l| l.saturating_sub(start.elapsed())),
            ..limits
        };
        if self.repeat_check {
            let mut outcome = self
                .redirect(
                    downstream,
                    upstream,
                    (Vec::new(), Vec::new()),
                    limits,
                    Entry::Kick,
                    why,
                )
                .await?;
            outcome.downstream_to_upstream += d2u;
            outcome.upstream_to_downstream += u2d;
            return Ok(outcome);
        }
        let settled = match settle(&downstream, &upstream) {
            Ok(s) => s,
            Err(e) => {
                // What it read and did not write would be lost behind a FIN.
                abort_on_close(&downstream);
                abort_on_close(&upstream);
                return Err(e.into());
            }
        };
        debug!(
            d2u = settled.d2u,
            u2d = settled.u2d,
            d2u_rest = settled.down_rest.len(),
            u2d_rest = settled.up_rest.len(),
            "settled before the move"
        );
        let mut outcome = self
            .redirect(
                downstream,
                upstream,
                (settled.down_rest, settled.up_rest),
                limits,
                Entry::Drain,
                why,
            )
            .await?;
        outcome.downstream_to_upstream += d2u + settled.d2u;
        outcome.upstream_to_downstream += u2d + settled.u2d;
        Ok(outcome)
    }

    /// Moves the connection into the SockHash (or, if it cannot enter, copies it in
    /// userspace) and forwards it to the end.
    /// `down_initial` and `up_initial` are written to the upstream and the downstream
    /// first.
    pub(super) async fn redirect(
        &self,
        downstream: TcpStream,
        upstream: TcpStream,
        (mut down_initial, mut up_initial): (Vec<u8>, Vec<u8>),
        limits: Limits,
        entry: Entry,
        why: Option<Refusal>,
    ) -> Result<Outcome, Error> {
        let entered = self.enter(
            &downstream,
            &upstream,
            &mut down_initial,
            &mut up_initial,
            entry,
        );
        let Entered {
            mut reg,
            down_base,
            up_base,
            open,
            attached,
        } = match entered {
            Ok(e) => e,
            Err(e) => {
                // Bytes may be held (what the drain read is in the initial buffers): a
                // FIN would tell both peers their streams were whole.
                abort_on_close(&downstream);
                abort_on_close(&upstream);
                return Err(e.into());
            }
        };
        let Some((down_flow, up_flow)) = attached else {
            self.fallbacks.fetch_add(1, Relaxed);
            self.tally.took(Taken::CopiedFallback);
            for i in 0..2 {
                reg.set_credit(i, 0);
            }
            // `reg` stays alive until the copy ends: a socket that did get in keeps zero
            // credit, so everything arriving on it is passed and read by the copy, and
            // removing it earlier would discard what the kernel queued for it.
            let initial = [down_initial, up_initial];
            let gate = reg.lone_entrant([initial[0].len() as u64, initial[1].len() as u64]);
            debug!(
                in_sockhash = gate
                    .as_ref()
                    .map_or("neither", |g| ["downstream", "upstream"][g.side]),
                "sockets could not enter the SockHash: forwarding in userspace"
            );
            let outcome =
                copy::to_end_gated(downstream, upstream, initial, limits, gate, self.tally).await;
            drop(reg);
            return Ok(outcome);
        };
        // Both sockets are in: the kernel carries it from here.
        self.tally.took(Taken::Redirected(why));
        let Some([down_slot, up_slot]) = reg.slots() else {
            abort_on_close(&downstream);
            abort_on_close(&upstream);
            return Err(Error::Io(io::Error::other("flow records vanished")));
        };
        // Out of tokio's reactor, which would wake this thread at every segment (see
        // `watch.rs`). On failure both sockets close with a reset: bytes may be lost.
        let downstream = downstream.into_std()?;
        let upstream = match upstream.into_std() {
            Ok(u) => u,
            Err(e) => {
                abort_on_close(&downstream);
                return Err(e.into());
            }
        };
        let watch = match Watch::new([downstream.as_fd(), upstream.as_fd()]) {
            Ok(w) => w,
            Err(e) => {
                abort_on_close(&downstream);
                abort_on_close(&upstream);
                return Err(e.into());
            }
        };

        let d2u_user = AtomicU64::new(0);
        let u2d_user = AtomicU64::new(0);
        let d2u = Direction {
            dp: self,
            src: &downstream,
            flow: down_flow,
            slot: down_slot,
            watch: &watch,
            side: 0,
            dst: &upstream,
            dst_base: up_base,
            user_bytes: &d2u_user,
            name: "d2u",
            drain: Mutex::new(DrainProbe::new(
                self.config.bulk_send_buffer.saturating_mul(2),
            )),
            open: open[0],
        };
        let u2d = Direction {
            dp: self,
            src: &upstream,
            flow: up_flow,
            slot: up_slot,
            watch: &watch,
            side: 1,
            dst: &downstream,
            dst_base: down_base,
            user_bytes: &u2d_user,
            name: "u2d",
            drain: Mutex::new(DrainProbe::new(
                self.config.bulk_send_buffer.saturating_mul(2),
            )),
            open: open[1],
        };
        let redirected = |f: &FlowCell| f.counters().redirected;
        let d2u_run = pin!(d2u.run(down_initial));
        let u2d_run = pin!(u2d.run(up_initial));
        let mut watchdog = Watchdog::new(self.tally, limits.stall_after).waking_backlogs();
        let end = drive(
            &downstream,
            &upstream,
            limits,
            d2u_run,
            u2d_run,
            || {
                redirected(down_flow)
                    + redirected(up_flow)
                    + d2u_user.load(Relaxed)
                    + u2d_user.load(Relaxed)
            },
            |now, moved| {
                let flows = Some([down_flow, up_flow]);
                let stalled = watchdog.check(now, moved, &downstream, &upstream, flows);
                // The stall of a socket left with an uncut repeat is no mystery, and no
                // wait ends it: the kernel holds arriving bytes until more arrive than
                // the repeat was long (the count of read bytes is that far ahead), and
                // a peer waiting for an answer sends none. A reset tells both peers.
                let uncut = down_flow.skipped() + up_flow.skipped();
                (stalled && uncut > 0).then(|| {
                    warn!(
                        uncut,
                        "ending a connection whose bytes the kernel holds back after a \
                         repeat it could not cut"
                    );
                    End::Stranded
                })
            },
        )
        .await;
        // Stop the verdict first so the counters are final when read.
        reg.detach();
        debug!(
            d2u_redirected = redirected(down_flow),
            d2u_user = d2u_user.load(Relaxed),
            u2d_redirected = redirected(up_flow),
            u2d_user = u2d_user.load(Relaxed),
            "redirected connection ended"
        );
        if end == End::Closed {
            // Both directions saw EOF and waited until dst's TCP held every byte before
            // passing the FIN on: the counts are exact, no need to ask TCP again.
            return Ok(Outcome {
                downstream_to_upstream: redirected(down_flow) + d2u_user.load(Relaxed),
                upstream_to_downstream: redirected(up_flow) + u2d_user.load(Relaxed),
                end,
            });
        }
        // Both sides get a FIN at a forced end, unless `drive` found bytes held between
        // them and arranged resets.
        let graceful =
            matches!(end, End::IdleTimeout | End::LifetimeExceeded) && !resets_on_close(&upstream);
        let outcome = Outcome {
            downstream_to_upstream: delivered(
                &upstream,
                up_base,
                redirected(down_flow) + d2u_user.load(Relaxed),
                graceful,
            ),
            upstream_to_downstream: delivered(
                &downstream,
                down_base,
                redirected(up_flow) + u2d_user.load(Relaxed),
                graceful,
            ),
            end,
        };
        drop(reg);
        Ok(outcome)
    }

    /// The setup of [`Ebpf::redirect`], up to the sockets' insertion: baselines, records,
    /// the drain, credit, insertion and kick. On an error the caller resets both sockets.
    pub(super) fn enter<'s>(
        &'s self,
        downstream: &TcpStream,
        upstream: &TcpStream,
        down_initial: &mut Vec<u8>,
        up_initial: &mut Vec<u8>,
        entry: Entry,
    ) -> io::Result<Entered<'s>> {
        if let Some(size) = self.config.socket_buffer {
            for s in [downstream, upstream] {
                set_buffers(s, size)?;
            }
        }
        let down = cookie(downstream)?;
        let up = cookie(upstream)?;
        // Nothing can be redirected before a budget is published: these are the TCP
        // baselines. They also give the sockets' states: the kernel only accepts
        // established TCP sockets in a SockHash. A client that sent its FIN right behind
        // the hello (or a pod that already closed) is served by the userspace copy
        // instead: same semantics, slower. The same goes when the insertion fails anyway
        // (a FIN racing this check, full maps, no free flow slot).
        // The baselines must be exact (see `handed_exact`); a connection whose acks kept
        // moving through every read is copied instead.
        let (down_tcp, down_exact) = handed_exact(downstream)?;
        let (up_tcp, up_exact) = handed_exact(upstream)?;
        let mut reg = Registration::new(self, down, up);
        // A segment that userspace has partly read (the router stops reading mid-segment
        // after the ClientHello) would go through the verdict from its start, and its
        // read part be delivered a second time. Reading everything queued now leaves no
        // partly-read segment behind; what arrives later is whole. The drain comes last,
        // right before the insertion, so that little can arrive in between, and a kick
        // after the insertion sends that little through the verdict. With `Kick`, only
        // the socket that goes in first is drained (see [`Entry`]).
        let down_first = match entry {
            Entry::Drain => true,
            Entry::Kick => queued(downstream)? <= queued(upstream)?,
        };
        let drained = match (entry, down_first) {
            (Entry::Drain, _) => {
                drain_queued(downstream, down_initial)? && drain_queued(upstream, up_initial)?
            }
            (Entry::Kick, true) => drain_queued(downstream, down_initial)?,
            (Entry::Kick, false) => drain_queued(upstream, up_initial)?,
        };
        #[cfg(any(test, feature = "test-hooks"))]
        if let Some(pause) = self.config.hooks.sockhash_entry_pause {
            // A blocking sleep, like the rewrite hand-over's.
            std::thread::sleep(pause);
        }
        // A direction with nothing to write first gets its credit before its socket goes
        // in, so that what arrives from now on is redirected, in order, instead of being
        // passed: once passed, a steady sender keeps the direction in userspace until
        // userspace wins a race with it (docs/PERFORMANCE.md). The pod's direction opens
        // this way before the hello goes out; it answers within microseconds.
        let open = [down_initial.is_empty(), up_initial.is_empty()];
        for (i, open) in open.into_iter().enumerate() {
            if open {
                reg.set_credit(i, self.config.max_inflight);
            }
        }
        let attached = if drained
            && down_exact
            && up_exact
            && down_tcp.state == TCP_ESTABLISHED
            && up_tcp.state == TCP_ESTABLISHED
        {
            reg.attach((down, downstream), (up, upstream), down_first)
        } else {
            None
        };
        #[cfg(any(test, feature = "test-hooks"))]
        let kick = !self.config.hooks.sockhash_entry_no_kick;
        #[cfg(not(any(test, feature = "test-hooks")))]
        let kick = true;
        if attached.is_some() && kick {
            // The insertion alone does not run the verdict over what is queued: with
            // `Kick`, the second socket's queue; with either, whatever arrived after its
            // drain. Left queued, those bytes wait for the next segment to arrive, and a
            // client that waits for an answer, or whose window they filled, sends none
            // (a connection stalled until its idle timeout). Segments that arrived after
            // a drain are whole.
            set_rcvlowat(downstream)?;
            set_rcvlowat(upstream)?;
        }
        Ok(Entered {
            reg,
            down_base: down_tcp.bytes,
            up_base: up_tcp.bytes,
            open,
            attached,
        })
    }
}

/// A connection's entries in the maps; removed on drop, whatever way the connection ends.
pub(super) struct Registration<'a> {
    pub(super) dp: &'a Ebpf,
    /// Downstream and upstream cookies.
    pub(super) cookies: [u64; 2],
    /// The sockets' flow records, downstream first; None when they could not be made.
    /// Fields drop after `Drop::drop`, so the records go after the sockets left the
    /// SockHash.
    pub(super) flows: Option<[FlowRef<'a>; 2]>,
    /// Which of the sockets are in the SockHash, under the peer's cookie: removing the
    /// others would only cost a syscall that fails.
    pub(super) inserted: [bool; 2],
}

/// What [`Ebpf::enter`] set up.
pub(super) struct Entered<'a> {
    pub(super) reg: Registration<'a>,
    /// `handed()` of the downstream and the upstream before anything was sent.
    pub(super) down_base: u64,
    pub(super) up_base: u64,
    /// The directions whose credit was published before the insertion.
    pub(super) open: [bool; 2],
    /// The downstream's and the upstream's records, when both sockets went in.
    pub(super) attached: Option<(&'a FlowCell, &'a FlowCell)>,
}

impl<'a> Registration<'a> {
    /// Creates the flow records, with zero credit: until userspace has written the initial
    /// bytes (or [`Registration::set_credit`] opens a direction), every segment, including
    /// any still queued when the socket went in (the kernel runs those through the verdict
    /// at the next data-ready, not at the insertion), is passed to userspace, never
    /// redirected or dropped.
    pub(super) fn new(dp: &'a Ebpf, down: u64, up: u64) -> Self {
        let flows = match (dp.flows.register(down), dp.flows.register(up)) {
            (Ok(d), Ok(u)) => Some([d, u]),
            (Err(e), _) | (_, Err(e)) => {
                debug!(error = %e, "flow records not created");
                None
            }
        };
        Registration {
            dp,
            cookies: [down, up],
            flows,
            inserted: [false; 2],
        }
    }

    /// Publishes socket `i`'s credit (0: the downstream, 1: the upstream), with nothing
    /// consumed: for a direction with no bytes in userspace.
    pub(super) fn set_credit(&self, i: usize, credit: u64) {
        if let Some(f) = self.flows.as_ref().and_then(|f| f.get(i)) {
            f.cell().publish(Budget {
                credit,
                consumed: 0,
            });
        }
    }

    /// Inserts both sockets, each under its peer's cookie, and returns the downstream's
    /// and the upstream's records. None when the connection must be served in userspace
    /// instead.
    ///
    /// Usually the downstream goes first (`down_first`): it is the socket a client may
    /// have half-closed already. A socket inserted first has no peer in the SockHash
    /// until the second is in, so what the verdict sees on it meanwhile is passed.
    pub(super) fn attach(
        &mut self,
        down: (u64, &TcpStream),
        up: (u64, &TcpStream),
        down_first: bool,
    ) -> Option<(&'a FlowCell, &'a FlowCell)> {
        let cells = self.flows.as_ref().map(|[d, u]| (d.cell(), u.cell()))?;
        let mut peers = lock(&self.dp.peers);
        // The downstream goes in under the upstream's cookie, so `inserted[1]` marks key
        // `up`.
        let (a, b) = ((1, up.0, down.1), (0, down.0, up.1));
        let order = if down_first { [a, b] } else { [b, a] };
        for (i, key, sock) in order {
            if let Err(e) = peers.insert(key, sock.as_fd(), 0) {
                debug!(error = %map_error_chain(&e), "socket not inserted into the SockHash");
                return None;
            }
            self.inserted[i] = true;
        }
        Some(cells)
    }

    /// After a failed [`Registration::attach`]: the socket that did go in, if one did, as
    /// the copy's [`copy::Gate`]. `initial` is what the copy writes first, downstream to
    /// upstream and upstream to downstream.
    pub(super) fn lone_entrant(&self, initial: [u64; 2]) -> Option<copy::Gate<'a>> {
        let flows = self.flows.as_ref()?;
        // `inserted[1]` marks the downstream (stored under the upstream's cookie), read
        // by direction 0; `inserted[0]` the upstream, read by direction 1.
        let side = match self.inserted {
            [false, true] => 0,
            [true, false] => 1,
            _ => return None,
        };
        Some(copy::Gate {
            side,
            flow: flows[side].cell(),
            base: initial[side],
        })
    }

    /// The flow slots of the downstream and the upstream (None without records).
    pub(super) fn slots(&self) -> Option<[u32; 2]> {
        self.flows.as_ref().map(|[d, u]| [d.slot(), u.slot()])
    }

    /// Takes the sockets out of the SockHash: the verdict no longer runs for them.
    pub(super) fn detach(&mut self) {
        for (c, inserted) in self.cookies.iter().zip(&mut self.inserted) {
            if std::mem::take(inserted) {
                // ENOENT: already unlinked by close. Nothing to undo.
                let _ = lock(&self.dp.peers).remove(c);
            }
        }
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        // Sockets first, so the verdict stops running before its records go (the
        // `flows` field is dropped after this).
        self.detach();
    }
}

/// Waits for `ready`, or for [`REFRESH_INTERVAL`] at most: the caller then tries its read
/// or write again either way. Without the bound, a write waiting for EPOLLOUT stalled for
/// good in 2 of 16 bulk benchmark repetitions: the destination was idle and writable
/// (nothing queued, nothing unacknowledged) and the wake-up never came. Why is not known:
/// TCP memory stayed below `tcp_mem`'s low mark, so it was not a write refused for want
/// of memory. The bound costs a timer wake-up per millisecond only while a direction is
/// blocked.
pub(super) async fn retry(ready: impl Future<Output = io::Result<EpollFlags>>) -> io::Result<()> {
    match tokio::time::timeout(REFRESH_INTERVAL, ready).await {
        Ok(r) => r.map(drop),
        Err(_) => Ok(()),
    }
}

/// What a socket's TCP has taken from its writers so far.
#[derive(Clone, Copy, Debug)]
pub(super) struct Handed {
    /// Bytes acknowledged by the peer plus bytes queued (sent or not).
    pub(super) bytes: u64,
    /// The first term of `bytes`.
    pub(super) acked: u64,
    /// The socket is closed (reset or aborted).
    pub(super) closed: bool,
    pub(super) state: u8,
}

pub(super) fn handed(sock: &impl AsFd) -> io::Result<Handed> {
    // TCP_INFO first, SIOCOUTQ second: acks between the two calls move bytes out of the
    // queue after bytes_acked was read, so the sum can only understate.
    let info = tcp_info(sock)?;
    let outq = unsent_or_unacked(sock)?;
    Ok(Handed {
        bytes: info.tcpi_bytes_acked + outq,
        acked: info.tcpi_bytes_acked,
        closed: info.tcpi_state == TCP_CLOSE,
        state: info.tcpi_state,
    })
}

/// The bytes of one direction that reached `dst`'s TCP: `counted` (what the verdict
/// redirected plus what userspace wrote), less what never left the kernel's backlog.
///
/// A clean end waits for the backlog to drain, but a forced one (idle, lifetime, a reset)
/// does not: redirected bytes still parked in dst's psock are discarded when the socket
/// leaves the SockHash, and counting them would report bytes nobody received. For a
/// `graceful` end (both sides get a FIN) dst's write side is shut first: that fences the
/// backlog worker, whose send in progress completes under the socket lock and whose later
/// sends fail, so the figure read next is final. Call only after the verdict is detached.
pub(super) fn delivered(dst: &impl AsFd, base: u64, counted: u64, graceful: bool) -> u64 {
    if graceful {
        // ENOTCONN after a reset: nothing left to fence.
        let _ = shutdown_write(dst);
    }
    match handed_exact(dst) {
        // Once our FIN is queued it counts one sequence number in `handed`. A figure that
        // acks kept moving understates at worst, as `handed` does.
        Ok((h, _)) => {
            let fin = u64::from(fin_sent(h.state));
            counted.min(h.bytes.saturating_sub(base).saturating_sub(fin))
        }
        // Unknown: the verdict's count is the best figure left.
        Err(_) => counted,
    }
}

/// [`handed`], read until no ack moved bytes between its two syscalls, so that the
/// figure is exact rather than a lower bound; with whether it is (acks can keep moving
/// for all of [`EXACT_TRIES`], though they stop within microseconds of a quiet socket).
///
/// A figure the SockHash counts *from* must be exact. [`handed`] understates when an ack
/// lands between its syscalls, and an understated baseline overstates every later
/// `handed - base`: [`Direction`]'s wait for the destination's TCP to hold every
/// redirected byte then ends while the last of them still wait in the kernel's backlog,
/// the FIN goes out ahead of them, and the kernel drops them when it finds the socket
/// shut (EPIPE). The soak saw it about once in 40,000 ping-pongs: the last bytes of the
/// copy before the move were acked mid-read, and the client's TLS close_notify was lost.
pub(super) fn handed_exact(sock: &impl AsFd) -> io::Result<(Handed, bool)> {
    let mut h = handed(sock)?;
    for _ in 0..EXACT_TRIES {
        let acked = tcp_info(sock)?.tcpi_bytes_acked;
        if acked == h.acked {
            return Ok((h, true));
        }
        h = handed(sock)?;
    }
    Ok((h, false))
}

/// Reads of [`handed`] that [`handed_exact`] tries.
const EXACT_TRIES: usize = 16;

/// Most bytes read from one socket before it enters the SockHash. A client streaming
/// right behind its hello would otherwise keep the read going for the whole transfer.
pub(super) const DRAIN_CAP: usize = 1024 * 1024;

/// The parts of a read of `n` passed bytes, at offset `at` of the socket's stream of
/// passed bytes, that go on to the peer: all but the bytes the skip records cover (see
/// `waypoint_common::Flow::skips`), in order.
pub(super) fn kept(at: u64, n: usize, skips: &[Range<u64>]) -> Vec<Range<usize>> {
    let end_of_read = at + n as u64;
    let mut cut: Vec<Range<usize>> = skips
        .iter()
        .map(|skip| {
            let start = skip.start.clamp(at, end_of_read);
            let end = skip.end.clamp(start, end_of_read);
            (start - at) as usize..(end - at) as usize
        })
        .filter(|r| !r.is_empty())
        .collect();
    cut.sort_by_key(|r| r.start);
    let mut parts = Vec::with_capacity(cut.len() + 1);
    let mut from = 0;
    for r in cut {
        if r.start > from {
            parts.push(from..r.start);
        }
        from = from.max(r.end);
    }
    if from < n {
        parts.push(from..n);
    }
    parts
}

/// Reads everything queued on `sock` into `buf`, without waiting. Returns false when the
/// queue was not empty after [`DRAIN_CAP`] bytes: a partly read segment may remain, so
/// the socket must not enter the SockHash.
pub(super) fn drain_queued(sock: &TcpStream, buf: &mut Vec<u8>) -> io::Result<bool> {
    // Nearly always nothing is queued: the first read goes to the stack, so that case
    // allocates nothing. (A 64 KiB chunk per socket, freed at once, fragmented the heap
    // around each connection's long-lived allocations: ~35 KB of RSS per idle
    // connection.)
    let mut first = [0u8; 4096];
    let mut chunk = Vec::new();
    let mut read = 0;
    while read < DRAIN_CAP {
        let into: &mut [u8] = if read == 0 {
            &mut first
        } else {
            if chunk.is_empty() {
                chunk = vec![0u8; 64 * 1024];
            }
            &mut chunk
        };
        // Not `try_read`: it skips the read while tokio has not seen the bytes arrive,
        // and they would stay queued as the socket goes in (found with a pod speaking
        // first, whose banner then waited for its next segment).
        match read_now(sock, into) {
            // EOF already: the FIN stays visible to whoever reads next.
            Ok(0) => return Ok(true),
            Ok(n) => {
                buf.extend_from_slice(&into[..n]);
                read += n;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

/// Reads from `sock` into the spare capacity of `buf` (which must have some), without
/// zeroing it first, and extends `buf` by what was read.
pub(super) fn read_spare(sock: &StdTcpStream, buf: &mut Vec<u8>) -> io::Result<usize> {
    crate::sys::recv_spare(sock, buf)
}

/// Rounds of [`settle`]: each forwards what arrived during the previous one.
pub(super) const SETTLE_ROUNDS: usize = 8;

/// What [`settle`] did.
#[derive(Debug, Default)]
pub(super) struct Settled {
    /// Bytes forwarded downstream → upstream and upstream → downstream.
    pub(super) d2u: u64,
    pub(super) u2d: u64,
    /// Bytes read that could not be written without waiting: they go first.
    pub(super) down_rest: Vec<u8>,
    pub(super) up_rest: Vec<u8>,
}

/// Forwards what is queued on a connection that is about to enter the SockHash, for as
/// long as that needs no waiting, so that it enters with nothing held in userspace and
/// both directions start on the kernel path. A steady sender queues more while userspace
/// forwards, hence the rounds: under loopback bulk the queue shrinks each round. What
/// cannot be written at once (a full send buffer) is returned instead: waiting here
/// would escape the idle and lifetime limits, which only `drive` enforces.
pub(super) fn settle(down: &TcpStream, up: &TcpStream) -> io::Result<Settled> {
    let mut s = Settled::default();
    for _ in 0..SETTLE_ROUNDS {
        let (mut d, mut u) = (Vec::new(), Vec::new());
        // A full drain (1 MiB) is fine here: the next round reads on.
        drain_queued(down, &mut d)?;
        drain_queued(up, &mut u)?;
        if d.is_empty() && u.is_empty() {
            break;
        }
        // An error stops a direction's write too: the direction meets it again when it
        // writes the rest, and reports it the usual way.
        let now = |sock: &TcpStream, buf: &[u8]| write_now(sock, buf).unwrap_or(0);
        let (dn, un) = (now(up, &d), now(down, &u));
        s.d2u += dn as u64;
        s.u2d += un as u64;
        if dn < d.len() || un < u.len() {
            d.drain(..dn);
            u.drain(..un);
            s.down_rest = d;
            s.up_rest = u;
            break;
        }
    }
    Ok(s)
}

/// Sets SO_RCVLOWAT to 1 (its default). The kernel then checks at once whether the socket
/// has data to report (`tcp_set_rcvlowat` → `tcp_data_ready`), which runs the verdict on
/// segments queued before the socket entered the SockHash; the insertion alone does not.
pub(super) fn set_rcvlowat(sock: &TcpStream) -> io::Result<()> {
    crate::sys::set_rcvlowat(sock, 1)
}

pub(super) fn cookie(sock: &TcpStream) -> io::Result<u64> {
    crate::sys::cookie(sock)
}

pub(super) fn set_buffers(sock: &TcpStream, size: usize) -> io::Result<()> {
    setsockopt(sock, sockopt::SndBufForce, &size)?;
    setsockopt(sock, sockopt::RcvBufForce, &size)?;
    Ok(())
}
