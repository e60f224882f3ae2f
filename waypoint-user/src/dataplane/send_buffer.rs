//! Sizing a bulk destination's send buffer from how fast it drains (eBPF dataplane).
//!
//! The kernel's redirect worker (`sk_psock_backlog`) sleeps one timer tick whenever the
//! destination's send buffer is half full, and nothing wakes it earlier: the
//! destination's write-space callback only calls `schedule_delayed_work(.., 0)`, which
//! does nothing while the tick's timer is pending. A destination that drains its queue
//! within the tick then sits idle for the rest of it. So after a budget trip the
//! dataplane measures how many bytes the destination drains per tick and makes its send
//! buffer hold [`BUFFER_TICKS`] of them. A slow reader drains little and keeps its
//! autotuned buffer. See docs/ARCHITECTURE.md ("Bulk send buffer").

use std::time::{Duration, Instant};

/// The redirect worker's sleep: one jiffy, 4 ms at HZ=250. (With HZ=100 it is 10 ms; the
/// buffer is then sized short, and the next budget trip sizes it again.)
const WORKER_TICK: Duration = Duration::from_millis(4);

/// Ticks of drain the send buffer is sized to. The worker sleeps once the queue's memory
/// reaches half the buffer, and that memory counts skb overhead as well as payload: 8
/// ticks leave more than 2 ticks of payload queued when the worker goes to sleep.
const BUFFER_TICKS: u128 = 8;

/// One direction's measurement state. All sizes are in the kernel's terms, i.e. what
/// `getsockopt(SO_SNDBUF)` reports: twice what `SO_SNDBUFFORCE` was given.
#[derive(Debug)]
pub(crate) struct DrainProbe {
    /// The largest buffer it may ask for; 0 disables sizing.
    cap: usize,
    /// When the running measurement started, and the destination's `bytes_acked` then.
    start: Option<(Instant, u64)>,
    /// The buffer reached the cap (or cannot be set): nothing left to do.
    done: bool,
}

impl DrainProbe {
    pub(crate) fn new(cap: usize) -> DrainProbe {
        DrainProbe {
            cap,
            start: None,
            done: cap == 0,
        }
    }

    /// Whether a budget trip should start a measurement now.
    pub(crate) fn idle(&self) -> bool {
        !self.done && self.start.is_none()
    }

    pub(crate) fn start(&mut self, now: Instant, acked: u64) {
        if self.idle() {
            self.start = Some((now, acked));
        }
    }

    /// Whether the running measurement spans a tick and can be finished.
    pub(crate) fn due(&self, now: Instant) -> bool {
        matches!(self.start, Some((since, _)) if now.duration_since(since) >= WORKER_TICK)
    }

    /// Finishes a due measurement. Returns the send buffer to set, when [`BUFFER_TICKS`]
    /// of the measured drain (at most the cap) exceed `have`, the buffer now.
    pub(crate) fn finish(&mut self, now: Instant, acked: u64, have: usize) -> Option<usize> {
        if !self.due(now) {
            return None;
        }
        let (since, base) = self.start.take()?;
        let elapsed = now.duration_since(since).as_nanos().max(1);
        let per_tick = u128::from(acked.saturating_sub(base)) * WORKER_TICK.as_nanos() / elapsed;
        let want = usize::try_from(per_tick * BUFFER_TICKS)
            .unwrap_or(usize::MAX)
            .min(self.cap);
        if want <= have {
            self.done = have >= self.cap;
            return None;
        }
        self.done = want >= self.cap;
        Some(want)
    }

    /// Stops sizing (the buffer could not be set).
    pub(crate) fn give_up(&mut self) {
        self.done = true;
        self.start = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;
    const CAP: usize = 32 * MIB;
    const AUTOTUNED: usize = 4 * MIB;

    fn measured(
        probe: &mut DrainProbe,
        drained: u64,
        over: Duration,
        have: usize,
    ) -> Option<usize> {
        let t0 = Instant::now();
        probe.start(t0, 1_000);
        probe.finish(t0 + over, 1_000 + drained, have)
    }

    #[test]
    fn disabled_never_measures() {
        let probe = DrainProbe::new(0);
        assert!(!probe.idle());
    }

    #[test]
    fn slow_reader_keeps_its_buffer_and_is_measured_again() {
        let mut probe = DrainProbe::new(CAP);
        // 20 KB per tick: 5 MB/s.
        assert_eq!(measured(&mut probe, 20_000, WORKER_TICK, AUTOTUNED), None);
        assert!(probe.idle(), "a later trip measures again");
    }

    #[test]
    fn fast_drain_raises_to_eight_ticks() {
        let mut probe = DrainProbe::new(CAP);
        let got = measured(&mut probe, 2 * MIB as u64, WORKER_TICK, AUTOTUNED);
        assert_eq!(got, Some(16 * MIB));
        assert!(
            probe.idle(),
            "below the cap: the next trip may raise it further"
        );
    }

    #[test]
    fn rate_is_per_tick_whatever_the_window() {
        let mut probe = DrainProbe::new(CAP);
        let got = measured(&mut probe, 8 * MIB as u64, 4 * WORKER_TICK, AUTOTUNED);
        assert_eq!(got, Some(16 * MIB));
    }

    #[test]
    fn very_fast_drain_stops_at_the_cap() {
        let mut probe = DrainProbe::new(CAP);
        let got = measured(&mut probe, 64 * MIB as u64, WORKER_TICK, AUTOTUNED);
        assert_eq!(got, Some(CAP));
        assert!(!probe.idle(), "at the cap: done");
    }

    #[test]
    fn buffer_at_the_cap_is_done() {
        let mut probe = DrainProbe::new(CAP);
        assert_eq!(measured(&mut probe, 1, WORKER_TICK, CAP), None);
        assert!(!probe.idle());
    }

    #[test]
    fn not_due_before_a_tick() {
        let mut probe = DrainProbe::new(CAP);
        let t0 = Instant::now();
        probe.start(t0, 0);
        let early = t0 + WORKER_TICK / 2;
        assert!(!probe.due(early));
        assert_eq!(probe.finish(early, 64 * MIB as u64, AUTOTUNED), None);
        assert!(probe.due(t0 + WORKER_TICK), "still measuring");
    }

    #[test]
    fn a_running_measurement_is_not_restarted() {
        let mut probe = DrainProbe::new(CAP);
        let t0 = Instant::now();
        probe.start(t0, 0);
        probe.start(t0 + WORKER_TICK, 5 * MIB as u64);
        assert_eq!(
            probe.finish(t0 + WORKER_TICK, 2 * MIB as u64, AUTOTUNED),
            Some(16 * MIB)
        );
    }

    #[test]
    fn acked_going_backwards_reads_as_no_drain() {
        let mut probe = DrainProbe::new(CAP);
        let t0 = Instant::now();
        probe.start(t0, 100);
        assert_eq!(probe.finish(t0 + WORKER_TICK, 0, AUTOTUNED), None);
    }

    #[test]
    fn give_up_stops_sizing() {
        let mut probe = DrainProbe::new(CAP);
        probe.start(Instant::now(), 0);
        probe.give_up();
        assert!(!probe.idle());
        assert!(!probe.due(Instant::now() + WORKER_TICK));
    }
}
