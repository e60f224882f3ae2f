//! One direction of a connection in the SockHash: what the verdict passes is read and
//! written by userspace, in order with what it redirects; the credit that bounds the
//! bytes in flight in the kernel is refreshed; EOF is passed on once the destination's
//! TCP holds every byte.

use std::{
    io,
    net::TcpStream as StdTcpStream,
    os::fd::{AsFd, BorrowedFd},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
        Mutex,
    },
    time::{Duration, Instant},
};

use nix::sys::{
    epoll::EpollFlags,
    socket::{setsockopt, sockopt},
};
use tracing::{debug, trace};

use crate::dataplane::flows::{Budget, FlowCell};
use crate::dataplane::send_buffer::DrainProbe;
use crate::dataplane::socket_io::{self, Writable};
use crate::dataplane::watch::Watch;
use crate::dataplane::{classify_read_error, classify_write_error, shutdown_write, DirEnd};
use crate::sys::wake_writer;

use super::sockhash::*;
/// The eBPF object built by waypoint-user's build script from waypoint-ebpf.
use super::*;

/// One direction of a redirected connection: bytes arriving on `src` go to `dst`.
pub(super) struct Direction<'a> {
    pub(super) dp: &'a Ebpf,
    pub(super) src: &'a StdTcpStream,
    /// src's record: the verdict's budget for src, and its counters.
    pub(super) flow: &'a FlowCell,
    /// src's slot, as the verdict's signals name it.
    pub(super) slot: u32,
    /// Both sockets' readiness.
    pub(super) watch: &'a Watch<'a>,
    /// src's index in `watch` (dst's is the other).
    pub(super) side: usize,
    pub(super) dst: &'a StdTcpStream,
    /// `handed(dst)` before anything was sent.
    pub(super) dst_base: u64,
    /// Bytes userspace wrote to `dst` (initial bytes and passed segments).
    pub(super) user_bytes: &'a AtomicU64,
    /// "d2u" or "u2d", for traces.
    pub(super) name: &'static str,
    /// Sizes dst's send buffer after budget trips.
    pub(super) drain: Mutex<DrainProbe>,
    /// The full budget was published before the sockets went in (no initial bytes).
    pub(super) open: bool,
}

/// A direction's destination as [`socket_io::write_all`] sees it: the connection's epoll set
/// tells when it has room.
struct Dst<'d, 'a> {
    dir: &'d Direction<'a>,
    /// Whether a write found no room (dst is then watched for it).
    waited: AtomicBool,
}

impl AsFd for Dst<'_, '_> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.dir.dst.as_fd()
    }
}

impl Writable for Dst<'_, '_> {
    async fn when_writable(
        &self,
        mut write: impl FnMut() -> io::Result<usize>,
    ) -> io::Result<usize> {
        loop {
            self.waited.store(true, Relaxed);
            retry(self.dir.watch.wait(1 - self.dir.side, EpollFlags::EPOLLOUT)).await?;
            match write() {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return r,
            }
        }
    }
}

impl Direction<'_> {
    /// By reference: taken by value, the Direction would be stored twice in the future.
    /// `initial` is owned so that its buffer (the hello's) is freed once written, not
    /// held for the connection's lifetime.
    pub(super) async fn run(&self, initial: Vec<u8>) -> DirEnd {
        match self.run_inner(initial).await {
            Ok(end) => end,
            Err(end) => end,
        }
    }

    async fn run_inner(&self, initial: Vec<u8>) -> Result<DirEnd, DirEnd> {
        if !initial.is_empty() {
            self.write_all(&initial)
                .await
                .map_err(classify_write_error)?;
            self.user_bytes.fetch_add(initial.len() as u64, Relaxed);
        }
        drop(initial);
        let mut budget = self.full_budget();
        if !self.open {
            self.publish(budget);
        }

        // Allocated when the verdict passes something (or at EOF), and freed again once
        // the direction goes quiet: most redirected connections never need it, and a buffer
        // per direction up front was most of the daemon's memory per idle connection.
        // Never zeroed: reads go into its spare capacity (zeroing 256 KiB at every EOF
        // was a tenth of the cost of a short connection).
        let mut buf = Vec::new();
        // No refreshes until the verdict first passes something. The first credit covers
        // `max_inflight` bytes, which most connections never send; a flow that does
        // trips the budget once, and refreshing starts from there. Refreshing from the
        // start cost every new connection 16 timer wake-ups and 32 TCP_INFO/SIOCOUTQ
        // reads, and its first timer woke an idle worker thread.
        let mut quiet_refreshes = IDLE_REFRESHES;
        loop {
            let refreshing = quiet_refreshes < IDLE_REFRESHES;
            tokio::select! {
                biased;
                r = self.readable(budget.consumed) => {
                    r.map_err(classify_read_error)?;
                    if self.forward_passed(&mut buf, &mut budget).await? {
                        return self.finish(&mut buf, &mut budget).await;
                    }
                    quiet_refreshes = 0;
                }
                _ = tokio::time::sleep(REFRESH_INTERVAL), if refreshing => {
                    let credit = self.credit()?;
                    trace!(dir = self.name, credit, "credit refresh");
                    if credit != budget.credit {
                        budget.credit = credit;
                        self.publish(budget);
                        quiet_refreshes = 0;
                    } else {
                        quiet_refreshes += 1;
                        if quiet_refreshes == IDLE_REFRESHES {
                            buf = Vec::new();
                        }
                    }
                }
            }
        }
    }

    /// Waits until src has bytes the verdict passed, or hangs up. Never for a segment the
    /// verdict redirected: the kernel wakes src's readers for those too (see `watch.rs`).
    async fn readable(&self, consumed: u64) -> io::Result<()> {
        let behind = || self.flow.counters().passed != consumed;
        if behind() {
            // The verdict counts a segment just before the kernel queues it. Bounded, as
            // every wait for readiness here (see `retry`).
            retry(self.watch.wait(self.side, EpollFlags::EPOLLIN)).await?;
            return Ok(());
        }
        // Nothing passed: only a signal from the verdict, a FIN or a reset matter now.
        self.watch.unwant(self.side, EpollFlags::EPOLLIN)?;
        tokio::select! {
            biased;
            () = self.dp.signals.wait(self.slot, behind) => Ok(()),
            r = self.watch.wait(self.side, EpollFlags::EPOLLRDHUP) => r.map(drop),
        }
    }

    /// Writes all of `bytes` to dst, waiting for room as needed.
    async fn write_all(&self, bytes: &[u8]) -> io::Result<()> {
        let dst = Dst {
            dir: self,
            waited: AtomicBool::new(false),
        };
        let written = socket_io::write_all(&dst, bytes).await;
        if dst.waited.load(Relaxed) {
            // Writable is dst's usual state: watching for it would report every ack.
            self.watch.unwant(1 - self.side, EpollFlags::EPOLLOUT)?;
        }
        written
    }

    /// Reads what the verdict passed and forwards it. Returns true at EOF.
    async fn forward_passed(&self, buf: &mut Vec<u8>, budget: &mut Budget) -> Result<bool, DirEnd> {
        let mut synced = false;
        loop {
            // Reads and writes that never block do not yield: a sender as fast as this
            // loop kept it going for seconds, and every other connection of the worker
            // (accepts included) waited. tokio's readiness cache used to end the loop;
            // raw reads do not.
            tokio::task::consume_budget().await;
            buf.clear();
            if buf.capacity() < PASS_BUFFER {
                buf.reserve_exact(PASS_BUFFER);
            }
            let n = match read_spare(self.src, buf) {
                Ok(0) => return Ok(true),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(classify_read_error(e)),
            };
            // The verdict passes everything from the first passed segment until
            // `consumed` catches up with `passed`, so `redirected` is frozen now. Let the
            // kernel hand every redirected byte to dst's TCP before writing after them.
            trace!(
                dir = self.name,
                n,
                consumed = budget.consumed,
                "passed bytes read"
            );
            if !synced {
                self.start_drain_probe();
                self.wait_handed().await?;
                synced = true;
            }
            // Repeats the verdict could not cut (see `waypoint_common::Flow::skips`) are
            // dropped here; everything else goes on in order.
            let skips = self.flow.skips();
            let mut written = n;
            if skips.iter().all(|s| s.is_empty()) {
                self.write_all(&buf[..n])
                    .await
                    .map_err(classify_write_error)?;
            } else {
                let parts = kept(budget.consumed, n, &skips);
                written = parts.iter().map(|p| p.len()).sum();
                if written < n {
                    debug!(
                        dir = self.name,
                        len = n - written,
                        "dropped a repeat the verdict could not cut"
                    );
                }
                for part in parts {
                    self.write_all(&buf[part])
                        .await
                        .map_err(classify_write_error)?;
                }
            }
            self.user_bytes.fetch_add(written as u64, Relaxed);
            budget.consumed += n as u64;
            // A steady stream can keep this loop busy for long: measure here too.
            self.measure_drain(None);
        }
        budget.credit = self.credit()?;
        self.publish(*budget);
        Ok(false)
    }

    /// EOF from src: forward what the verdict passed but userspace has not read yet, and
    /// once dst's TCP holds every byte, pass the FIN on.
    ///
    /// recv() returns 0 as soon as the FIN is processed, but bytes the verdict passed
    /// earlier can still sit in the psock's backlog queue behind segments redirected *to*
    /// src (the kernel keeps one FIFO for both): EOF is only final once userspace has
    /// consumed every passed byte.
    async fn finish(&self, buf: &mut Vec<u8>, budget: &mut Budget) -> Result<DirEnd, DirEnd> {
        loop {
            let passed = self.flow.counters().passed;
            trace!(dir = self.name, passed, consumed = budget.consumed, "eof");
            if budget.consumed >= passed {
                break;
            }
            // The kworker moves them within microseconds; poll rather than rely on a
            // wake-up, since EOF keeps the socket readable.
            tokio::time::sleep(Duration::from_micros(200)).await;
            self.forward_passed(buf, budget).await?;
        }
        self.wait_handed().await?;
        shutdown_write(self.dst).map_err(classify_write_error)?;
        Ok(DirEnd::Eof)
    }

    /// Waits until dst's TCP has taken every redirected and userspace-written byte.
    /// Only valid while `redirected` cannot grow (after a pass or at EOF).
    async fn wait_handed(&self) -> Result<(), DirEnd> {
        let redirected = self.flow.counters().redirected;
        if redirected == 0 {
            // Only userspace wrote to dst, and a write returns once TCP holds the bytes.
            return Ok(());
        }
        let target = redirected + self.user_bytes.load(Relaxed);
        let mut spins = 0u32;
        let mut asleep = Asleep::new();
        loop {
            let h = handed(self.dst).map_err(DirEnd::Error)?;
            if h.bytes.saturating_sub(self.dst_base) >= target {
                trace!(dir = self.name, target, spins, "destination caught up");
                return Ok(());
            }
            if spins % 1000 == 999 {
                let err = socket2::SockRef::from(self.dst).take_error();
                trace!(
                    dir = self.name,
                    target,
                    handed = h.bytes.saturating_sub(self.dst_base),
                    ?err,
                    state = h.state,
                    "still waiting for the destination"
                );
            }
            if h.closed {
                // Reset or aborted: the parked bytes will never be sent.
                return Err(DirEnd::DestReset);
            }
            // The kworker usually drains within microseconds: yield a few times before
            // falling back to the timer.
            spins += 1;
            if spins < 64 {
                tokio::task::yield_now().await;
            } else {
                if asleep.still(h) {
                    self.wake_backlog(target, h.bytes.saturating_sub(self.dst_base));
                }
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        }
    }

    /// Wakes dst's backlog, which holds redirected bytes that it does not send (see
    /// [`Asleep`]).
    fn wake_backlog(&self, target: u64, handed: u64) {
        match wake_writer(self.dst) {
            Ok(()) => {
                self.dp.tally.woke();
                debug!(
                    dir = self.name,
                    target, handed, "woke the destination's backlog"
                );
            }
            Err(e) => {
                debug!(dir = self.name, error = %e, "could not wake the destination's backlog")
            }
        }
    }

    /// After a budget trip: starts measuring how fast dst drains, unless a measurement
    /// is running or the buffer is sized already (see `dataplane/send_buffer.rs`).
    fn start_drain_probe(&self) {
        let mut probe = lock(&self.drain);
        if probe.idle() {
            if let Ok(h) = handed(self.dst) {
                probe.start(Instant::now(), h.acked);
            }
        }
    }

    /// Finishes a drain measurement if one is due, and raises dst's send buffer if the
    /// measurement asks for it. `acked` is dst's `bytes_acked` when the caller has just
    /// read it; otherwise it is read here, and only if a measurement is due.
    fn measure_drain(&self, acked: Option<u64>) {
        let mut probe = lock(&self.drain);
        let now = Instant::now();
        if !probe.due(now) {
            return;
        }
        let acked = match acked.map_or_else(|| handed(self.dst).map(|h| h.acked), Ok) {
            Ok(acked) => acked,
            Err(_) => return,
        };
        let have = socket2::SockRef::from(self.dst)
            .send_buffer_size()
            .unwrap_or(usize::MAX);
        let Some(want) = probe.finish(now, acked, have) else {
            return;
        };
        // SO_SNDBUFFORCE takes half: the kernel doubles it.
        match setsockopt(self.dst, sockopt::SndBufForce, &(want / 2)) {
            Ok(()) => debug!(
                dir = self.name,
                from = have,
                to = want,
                "destination send buffer raised"
            ),
            Err(e) => {
                probe.give_up();
                debug!(dir = self.name, error = %e, "destination send buffer not raised");
            }
        }
    }

    /// The credit that keeps at most `max_inflight` redirected bytes outside dst's TCP.
    fn credit(&self) -> Result<u64, DirEnd> {
        let h = handed(self.dst).map_err(DirEnd::Error)?;
        self.measure_drain(Some(h.acked));
        let redirected_in_tcp = h
            .bytes
            .saturating_sub(self.dst_base)
            .saturating_sub(self.user_bytes.load(Relaxed));
        Ok(redirected_in_tcp + self.dp.config.max_inflight)
    }

    /// The budget of a direction that has nothing in userspace.
    fn full_budget(&self) -> Budget {
        Budget {
            credit: self.dp.config.max_inflight,
            consumed: 0,
        }
    }

    fn publish(&self, budget: Budget) {
        self.flow.publish(budget);
    }
}

/// Whether dst's backlog sleeps with redirected bytes, as seen by [`Direction::wait_handed`]
/// between its sleeps: dst's TCP took none of them for `wake_after` looks in a row while
/// its send queue was empty, so no ack of dst's own bytes is coming that could get the
/// backlog going. The kernel's backlog sends at once what the verdict redirects; one that
/// found dst not writeable waits for dst's write-space callback, which kernels without
/// the 2023 sockmap series never run for it (`sys::wake_writer`). Each wake without
/// progress doubles the wait for the next.
struct Asleep {
    /// dst's `handed` at the last look, if its send queue was empty then.
    last: Option<u64>,
    /// Looks in a row with `last` unchanged.
    looks: u32,
    /// Looks before a wake.
    wake_after: u32,
}

impl Asleep {
    /// Looks before the first wake: with the daemon's 200 µs sleeps (a millisecond or
    /// more, as the timer rounds), the kernel had ten chances to send.
    const FIRST: u32 = 10;
    /// Most looks between wakes.
    const MOST: u32 = 5_000;

    fn new() -> Asleep {
        Asleep {
            last: None,
            looks: 0,
            wake_after: Asleep::FIRST,
        }
    }

    /// Takes one look at dst; true when its backlog is to be woken.
    fn still(&mut self, h: Handed) -> bool {
        let idle = h.bytes == h.acked;
        if !idle || self.last != Some(h.bytes) {
            self.last = idle.then_some(h.bytes);
            self.looks = 0;
            return false;
        }
        self.looks += 1;
        if self.looks < self.wake_after {
            return false;
        }
        self.looks = 0;
        self.wake_after = self.wake_after.saturating_mul(2).min(Asleep::MOST);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(bytes: u64, acked: u64) -> Handed {
        Handed {
            bytes,
            acked,
            closed: false,
            state: crate::dataplane::TCP_ESTABLISHED,
        }
    }

    /// Looks until the first wake, from a fresh look at `h`.
    fn looks_to_wake(a: &mut Asleep, h: Handed) -> Option<u32> {
        (1..=Asleep::MOST + 1).find(|_| a.still(h))
    }

    #[test]
    fn a_backlog_is_woken_only_while_dst_is_idle_and_still() {
        let mut a = Asleep::new();
        // The first look only records; then FIRST still looks wake.
        assert_eq!(looks_to_wake(&mut a, at(100, 100)), Some(Asleep::FIRST + 1));
        // Without progress the next wake waits twice as long.
        assert_eq!(looks_to_wake(&mut a, at(100, 100)), Some(Asleep::FIRST * 2));

        // A send queue that holds bytes waits on acks, never on a wake.
        let mut a = Asleep::new();
        assert_eq!(looks_to_wake(&mut a, at(150, 100)), None);

        // Progress starts the count again.
        let mut a = Asleep::new();
        for _ in 0..Asleep::FIRST - 1 {
            assert!(!a.still(at(100, 100)));
        }
        assert!(!a.still(at(120, 120)), "moved");
        assert_eq!(looks_to_wake(&mut a, at(120, 120)), Some(Asleep::FIRST));

        // The wait between wakes stops growing.
        let mut a = Asleep::new();
        for _ in 0..20 {
            assert!(looks_to_wake(&mut a, at(1, 1)).is_some());
        }
        assert_eq!(a.wake_after, Asleep::MOST);
    }
}
