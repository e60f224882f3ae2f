//! The stall watchdog: a connection with bytes held inside the waypoint and no progress
//! for `--stall-after` is counted (`waypoint_dataplane_stalls_total{dataplane}`) and
//! logged once, at warn, with its state.
//!
//! A connection is **stalled** when, at one of its idle checks:
//! 1. bytes are held between the peers in some direction: the source's TCP received
//!    them and the destination's TCP has not taken them (`tcpi_bytes_received` against
//!    `tcpi_bytes_acked + SIOCOUTQ`, as [`super::holds_bytes`] counts);
//! 2. that direction's destination has nothing unsent or unacknowledged (SIOCOUTQ 0):
//!    it is not waiting on its own peer. Backpressure from a slow reader keeps bytes in
//!    the destination's send queue (its peer's window is closed, or the bytes are on the
//!    wire), so it never counts; held bytes that nothing hands to an idle destination do;
//! 3. nothing changed for the window: neither the daemon's own byte count (the caller's
//!    `progress`) nor either socket's TCP counts (bytes received, bytes acknowledged).
//!
//! Cost, per idle check: nothing when the daemon moved bytes since the last one; else one
//! `TCP_INFO` read per socket; and, once the counts have been still for the window, one
//! SIOCOUTQ read per socket, once. A connection found not stalled stays so while its
//! counts stay (its held bytes can only shrink, and a send queue empties only as the peer
//! acknowledges), so it is not looked at closer again until they move.
//!
//! A connection is counted at most once; after that its watchdog is off.
//!
//! On the SockHash path ([`Watchdog::waking_backlogs`]) the watchdog also wakes: held
//! bytes towards an idle destination there can sit in the destination's kernel backlog,
//! which kernels without the 2023 sockmap fixes leave asleep (see
//! [`crate::sys::wake_writer`]). So at the first idle check that finds the counts still,
//! rather than after the window, such a destination's backlog is woken, once per still
//! period, whether or not the stall window is on. A connection the wake gets going again
//! moves its counts and is never counted.

use std::{
    fmt,
    os::fd::AsFd,
    time::{Duration, Instant},
};

use tracing::{debug, warn};

use super::{flows::FlowCell, queued, tally::Tally, tcp_info, unsent_or_unacked, Carried};
use crate::sys::wake_writer;

/// Default for [`super::Limits::stall_after`].
pub const DEFAULT_STALL_AFTER: Duration = Duration::from_secs(10);

/// One connection's watchdog. Fed at the connection's idle checks ([`Watchdog::check`]).
#[derive(Debug)]
pub(super) struct Watchdog {
    /// Where a stall is counted.
    tally: &'static Tally,
    /// The window; None: off (disabled, or this connection was counted already).
    after: Option<Duration>,
    /// When `counts` was first seen; None: the daemon moved bytes at the last check.
    since: Option<Instant>,
    /// Both sockets' bytes received and acknowledged, summed: each only grows, so an
    /// equal sum means that none of them moved.
    counts: u64,
    /// The connection was found not stalled at these counts.
    clear: bool,
    /// The connection was counted (and the watchdog turned off).
    fired: bool,
    /// Wakes the backlog of a destination that holds bytes and sends none.
    wakes: bool,
    /// The backlogs were woken at `counts`.
    woken: bool,
}

impl Watchdog {
    /// A watchdog counting into `tally`; `after` None: off.
    pub(super) fn new(tally: &'static Tally, after: Option<Duration>) -> Watchdog {
        Watchdog::resume(tally, after, false)
    }

    /// A connection's watchdog in a new phase (the copy resumed after parking): off if
    /// it `fired` already.
    pub(super) fn resume(tally: &'static Tally, after: Option<Duration>, fired: bool) -> Watchdog {
        Watchdog {
            tally,
            after: after.filter(|_| !fired),
            since: None,
            counts: 0,
            clear: false,
            fired,
            wakes: false,
            woken: false,
        }
    }

    /// This watchdog also wakes the kernel backlogs of destinations that hold bytes and
    /// send none (see the module's comment): for connections in the SockHash.
    pub(super) fn waking_backlogs(self) -> Watchdog {
        Watchdog {
            wakes: true,
            ..self
        }
    }

    /// Where a stall is counted.
    pub(super) fn tally(&self) -> &'static Tally {
        self.tally
    }

    /// Whether this connection was counted as stalled (its watchdog is off since).
    pub(super) fn fired(&self) -> bool {
        self.fired
    }

    /// At an idle check: `moved` says whether the daemon moved bytes since the last
    /// one. Counts and logs the connection if it is stalled (see the module's comment);
    /// true if it did so now. `flows` are the eBPF kernel phase's records of the
    /// downstream and the upstream socket, for the log.
    pub(super) fn check(
        &mut self,
        now: Instant,
        moved: bool,
        downstream: &impl AsFd,
        upstream: &impl AsFd,
        flows: Option<[&FlowCell; 2]>,
    ) -> bool {
        let wake = self.wakes && !self.woken;
        if self.after.is_none() && !wake {
            return false;
        }
        if moved {
            self.since = None;
            return false;
        }
        // A socket that cannot be read is reset or closed: the connection is ending.
        let (Ok(down), Ok(up)) = (tcp_info(downstream), tcp_info(upstream)) else {
            return false;
        };
        let counts = [down, up].iter().fold(0u64, |sum, i| {
            sum.wrapping_add(i.tcpi_bytes_received)
                .wrapping_add(i.tcpi_bytes_acked)
        });
        let since = match self.since {
            Some(since) if counts == self.counts => since,
            _ => {
                self.since = Some(now);
                self.counts = counts;
                self.clear = false;
                self.woken = false;
                return false;
            }
        };
        let still = now.saturating_duration_since(since);
        let due = self.after.is_some_and(|after| still >= after);
        if self.clear || !(due || wake) {
            return false;
        }
        let (Ok(down_outq), Ok(up_outq)) =
            (unsent_or_unacked(downstream), unsent_or_unacked(upstream))
        else {
            return false;
        };
        let (Ok(d), Ok(u)) = (
            Carried::from_info(&down, down_outq, false),
            Carried::from_info(&up, up_outq, true),
        ) else {
            return false;
        };
        let d2u_held = d.received.saturating_sub(u.taken);
        let u2d_held = u.received.saturating_sub(d.taken);
        let towards_idle = [d2u_held > 0 && up_outq == 0, u2d_held > 0 && down_outq == 0];
        if towards_idle == [false, false] {
            self.clear = true;
            return false;
        }
        if !due {
            self.woken = true;
            let dsts = [upstream.as_fd(), downstream.as_fd()];
            for (dst, _) in dsts.iter().zip(towards_idle).filter(|(_, idle)| *idle) {
                if wake_writer(dst).is_ok() {
                    self.tally.woke();
                }
            }
            debug!(
                d2u_held,
                u2d_held, "woke the backlog of a destination that holds bytes and sends none"
            );
            return false;
        }
        self.after = None;
        self.fired = true;
        self.tally.stalled();
        // SIOCINQ too, for the log only: once per connection.
        let side = |info: &libc::tcp_info, outq, inq: std::io::Result<usize>| SocketState {
            info: *info,
            outq,
            inq: inq.ok(),
        };
        let [d2u_flow, u2d_flow] =
            flows.map_or([None, None], |f| f.map(|f| Some(f.state().to_string())));
        warn!(
            dataplane = self.tally.kind().as_str(),
            still_ms = u64::try_from(still.as_millis()).unwrap_or(u64::MAX),
            d2u_held,
            u2d_held,
            downstream = %side(&down, down_outq, queued(downstream)),
            upstream = %side(&up, up_outq, queued(upstream)),
            d2u_flow = d2u_flow.as_deref().unwrap_or("-"),
            u2d_flow = u2d_flow.as_deref().unwrap_or("-"),
            "connection stalled: bytes held inside the waypoint, none moving"
        );
        true
    }
}

/// One socket's state, for the stall's log line.
struct SocketState {
    info: libc::tcp_info,
    outq: u64,
    /// SIOCINQ: received and not yet read. For a socket in the SockHash, the bytes the
    /// verdict passed that the daemon has not read; its TCP receive queue is not counted.
    inq: Option<usize>,
}

impl fmt::Display for SocketState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.info;
        write!(
            f,
            "state={} received={} acked={} outq={} notsent={} inq={} rcv_wnd={} snd_wnd={} \
             probes={} backoff={}",
            i.tcpi_state,
            i.tcpi_bytes_received,
            i.tcpi_bytes_acked,
            self.outq,
            i.tcpi_notsent_bytes,
            self.inq.map_or_else(|| "?".to_owned(), |n| n.to_string()),
            i.tcpi_rcv_wnd,
            i.tcpi_snd_wnd,
            i.tcpi_probes,
            i.tcpi_backoff,
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use std::io::{Read as _, Write as _};
    use std::net::{TcpListener, TcpStream};

    use super::*;
    use crate::dataplane::Kind;

    /// A connected pair: (the peer's end, the waypoint's end).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (waypoint, _) = l.accept().unwrap();
        (peer, waypoint)
    }

    /// Checks `w` over `(down, up)` as the idle checks would: every `tick`, with nothing
    /// moved by the daemon, `checks` times. True if a check reported a stall.
    fn run(
        w: &mut Watchdog,
        down: &TcpStream,
        up: &TcpStream,
        tick: Duration,
        checks: u32,
    ) -> bool {
        let start = Instant::now();
        (1..=checks).any(|k| w.check(start + tick * k, false, down, up, None))
    }

    /// Bytes the downstream received that nobody reads, towards an idle upstream: a
    /// stall, reported once the counts have been still for the window, and only once.
    #[test]
    fn bytes_nobody_forwards_are_a_stall_once() {
        let (mut client, down) = pair();
        let (up, _pod) = pair();
        client.write_all(&[1u8; 1000]).unwrap();
        // Wait for the bytes to land and be acknowledged, so the counts are still.
        std::thread::sleep(Duration::from_millis(50));
        let tally = Tally::leak(Kind::Copy);
        let mut w = Watchdog::new(tally, Some(Duration::from_secs(1)));
        let tick = Duration::from_millis(500);
        let start = Instant::now();
        assert!(!w.check(start, false, &down, &up, None), "first look");
        assert!(
            !w.check(start + tick, false, &down, &up, None),
            "half a window"
        );
        assert!(
            w.check(start + tick * 2, false, &down, &up, None),
            "a window"
        );
        assert!(w.fired());
        assert!(!run(&mut w, &down, &up, tick, 8), "counted once");
        assert_eq!(tally.stalls(), 1);
    }

    /// A waking watchdog wakes the idle destination at the first still check, once per
    /// still period, and still counts the stall after the window if nothing moved; with
    /// the window off it only wakes. A watchdog that does not wake never does.
    #[test]
    fn a_waking_watchdog_wakes_first_then_counts() {
        let (mut client, down) = pair();
        let (up, _pod) = pair();
        client.write_all(&[1u8; 1000]).unwrap();
        // Still counts: the bytes landed in `down` and the client has its ack.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !(tcp_info(&down).unwrap().tcpi_bytes_received == 1000
            && unsent_or_unacked(&client).unwrap() == 0)
        {
            assert!(Instant::now() < deadline, "the bytes never landed");
            std::thread::yield_now();
        }
        let tick = Duration::from_millis(500);
        let start = Instant::now();

        let tally = Tally::leak(Kind::Ebpf);
        let mut w = Watchdog::new(tally, Some(Duration::from_secs(1))).waking_backlogs();
        assert!(!w.check(start, false, &down, &up, None), "first look");
        assert!(!w.check(start + tick, false, &down, &up, None), "woken");
        assert_eq!((tally.wakeups(), tally.stalls()), (1, 0));
        assert!(
            w.check(start + tick * 2, false, &down, &up, None),
            "a window"
        );
        assert_eq!((tally.wakeups(), tally.stalls()), (1, 1));
        assert!(!run(&mut w, &down, &up, tick, 8));
        assert_eq!(
            (tally.wakeups(), tally.stalls()),
            (1, 1),
            "once per still period"
        );

        let tally = Tally::leak(Kind::Ebpf);
        let mut w = Watchdog::new(tally, None).waking_backlogs();
        assert!(!run(&mut w, &down, &up, tick, 8));
        assert_eq!(
            (tally.wakeups(), tally.stalls()),
            (1, 0),
            "window off: wakes only"
        );

        let tally = Tally::leak(Kind::Copy);
        let mut w = Watchdog::new(tally, Some(Duration::from_secs(1)));
        assert!(run(&mut w, &down, &up, tick, 8));
        assert_eq!((tally.wakeups(), tally.stalls()), (0, 1), "not waking");
    }

    /// The daemon moving bytes restarts the window: no stall while it does.
    #[test]
    fn progress_restarts_the_window() {
        let (mut client, down) = pair();
        let (up, _pod) = pair();
        client.write_all(&[1u8; 1000]).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let mut w = Watchdog::new(Tally::leak(Kind::Copy), Some(Duration::from_secs(1)));
        let start = Instant::now();
        let tick = Duration::from_millis(500);
        for k in 0..8 {
            let moved = k % 2 == 1;
            assert!(!w.check(start + tick * k, moved, &down, &up, None));
        }
    }

    /// An idle connection that holds nothing is not stalled, however long it is still;
    /// nor is one whose held bytes wait in the destination's send queue (a reader that
    /// stopped: backpressure).
    #[test]
    fn idle_and_backpressure_are_not_stalls() {
        let (_client, down) = pair();
        let (up, _pod) = pair();
        let mut w = Watchdog::new(Tally::leak(Kind::Copy), Some(Duration::from_secs(1)));
        assert!(
            !run(&mut w, &down, &up, Duration::from_millis(500), 8),
            "idle"
        );

        // The pod stops reading: what the waypoint forwards fills the pod's window, then
        // the upstream's send queue; then the rest waits, unread, in the downstream.
        let (mut client, down) = pair();
        let (up, _pod) = pair();
        for s in [&client, &down, &up] {
            s.set_nonblocking(true).unwrap();
        }
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let _ = client.write(&buf);
            let n = (&down).read(&mut buf).unwrap_or(0);
            if n > 0 && (&up).write(&buf[..n]).is_err() {
                break;
            }
        }
        while client.write(&buf).is_ok() {}
        std::thread::sleep(Duration::from_millis(50));
        let mut w = Watchdog::new(Tally::leak(Kind::Copy), Some(Duration::from_secs(1)));
        assert!(
            !run(&mut w, &down, &up, Duration::from_millis(500), 8),
            "backpressure"
        );
    }

    /// Off: never reads, never reports.
    #[test]
    fn off_is_off() {
        let (mut client, down) = pair();
        let (up, _pod) = pair();
        client.write_all(&[1u8; 1000]).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let mut w = Watchdog::new(Tally::leak(Kind::Copy), None);
        assert!(!run(&mut w, &down, &up, Duration::from_secs(5), 8));
    }
}
