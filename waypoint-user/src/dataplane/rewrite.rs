//! Rewriting a connection's packet headers (`--rewrite-splice`): the TC program
//! `waypoint_rewrite`, on the ingress of every interface of the node (see waypoint-ebpf),
//! turns the client's packets to the waypoint's accepted socket A into packets of the
//! waypoint's socket B to the pod, and back, and sends them on towards their new
//! destination. Client and pod then hold one TCP conversation: no second connection
//! carries the bytes, and no socket of the daemon's sees them.
//!
//! IPv4 only; a connection whose two sides negotiated different TCP options, window
//! scales or MSS takes the SockHash redirect ([`Refused`]).
//!
//! **Hand-over**, right after the router read the ClientHello from A and dialed B:
//! 1. A goes into repair mode (`TCP_REPAIR`), which lets the daemon read its sequence
//!    numbers; what A holds unread is read first and sent on with the hello.
//! 2. Both entries go into the map, and B sends the hello. From now on every packet is
//!    rewritten. B keeps only the job of retransmitting the hello: the program hands it
//!    the pod's first pure ACK (see `Rewrite::watch`).
//! 3. A packet that passed the program before the entries were in may still be on its
//!    way into A or B. One RCU grace period (`membarrier(MEMBARRIER_CMD_GLOBAL)`, shared
//!    by every hand-over waiting at the time, [`Grace`]) later, every such packet has
//!    landed. Bytes that landed in A (a client that sent on behind its hello) are sent on
//!    by B, right behind the hello, where the client's entry put them in the pod's number
//!    space ([`Rewriter::fill`]). Anything else that landed (in B: a pod whose packets
//!    arrive through an interface without the program) would be lost between the two
//!    conversations: the rewrite is undone and both ends are reset ("stranded").
//! 4. A is closed silently (repair mode sends neither FIN nor RST). B stays open,
//!    holding its 4-tuple, so that no other connection to the pod gets the same one.
//!    Once the pod has acknowledged all B sent, B goes into repair mode too
//!    ([`silence`]): it has nothing left to resend, and a daemon killed with SIGKILL
//!    then closes it without a FIN. (A FIN from B, below what the pod has received
//!    through the rewrite, is answered with an ACK that B drops, and the two trade
//!    ACKs until B's orphan retries run out, the pod's end open all that time.)
//!
//! **End:** the program reports the connection's end (how, and the bytes each way) at a
//! RST or at the second FIN, through a ring read within 100 ms rather than at once (see
//! `signals.rs`). The connection's task returns its outcome then; the entries stay
//! [`LINGER`] longer for the last ACK and any retransmitted FIN, and one thread removes
//! those of every connection whose linger is over, a batch every [`SWEEP_INTERVAL`],
//! and closes their B silently ([`Rewriter::sweep`]). A connection idle for the
//! idle timeout, or past its lifetime, loses its entries at once, and both ends get a
//! reset (from a raw socket, at the sequence number each expects next).

use std::{
    collections::VecDeque,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd},
    sync::{
        atomic::{
            AtomicBool, AtomicU32, AtomicU64, AtomicU8,
            Ordering::{Acquire, Relaxed, Release, SeqCst},
        },
        Arc, Mutex, MutexGuard,
    },
    time::{Duration, Instant},
};

use aya::maps::{Array, HashMap, IterableMap as _, MapData, MapError, PerCpuArray};
use tracing::{debug, warn};
use waypoint_common::{
    Rewrite, RewriteKey, RewriteStat, ESTABLISHED_TS_OFFSET, PORT_CLIENT_TO, PORT_POD_FROM,
    REWRITE_FIN, REWRITE_FROM_POD, REWRITE_RST, REWRITE_SLOT_BASE, REWRITE_WATCH,
};

use super::background::{Background, JOIN_WITHIN};
use super::bpf_cmd::{self, per_cpu_total};
use super::established::Records;
use super::signals::Signals;
use super::{End, Socket, TCP_CLOSE_WAIT, TCP_ESTABLISHED};

/// Least time from the start of one forced grace period to the start of the next.
const GRACE_INTERVAL: Duration = Duration::from_millis(100);

const TCP_REPAIR: libc::c_int = 19;
const TCP_REPAIR_QUEUE: libc::c_int = 20;
const TCP_QUEUE_SEQ: libc::c_int = 21;
const TCP_TIMESTAMP: libc::c_int = 24;
const TCP_RECV_QUEUE: libc::c_int = 1;
const TCP_SEND_QUEUE: libc::c_int = 2;
/// Leaves repair mode without sending a window probe.
const TCP_REPAIR_OFF_NO_WP: libc::c_int = -1;
/// `tcpi_options` bits (include/uapi/linux/tcp.h).
const TCPI_OPT_TIMESTAMPS: u8 = 1;
const TCPI_OPT_SACK: u8 = 2;
const TCPI_OPT_WSCALE: u8 = 4;

/// Why a connection was not rewritten (it takes the SockHash redirect instead).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Not IPv4.
    NotIpv4,
    /// The two connections negotiated different TCP options or window scales.
    Options,
    /// A kept receiving bytes while the daemon read them, or held unacknowledged bytes.
    Busy,
    /// The map is full, or a socket option failed.
    Setup,
    /// One end is on this host and the other is not: a rewritten packet for this host
    /// would arrive on another interface than lo with one of this host's addresses as its
    /// source, which the stack drops as a martian.
    Local,
    /// The daemon is leaving (SIGTERM): it rewrites nothing more, and the connection
    /// drains on the SockHash.
    Leaving,
}

impl Refusal {
    /// Every reason, for metrics.
    pub const ALL: [Refusal; 6] = [
        Refusal::NotIpv4,
        Refusal::Options,
        Refusal::Busy,
        Refusal::Setup,
        Refusal::Local,
        Refusal::Leaving,
    ];

    /// A short label for logs.
    pub const fn as_str(self) -> &'static str {
        match self {
            Refusal::NotIpv4 => "not_ipv4",
            Refusal::Options => "options",
            Refusal::Busy => "busy",
            Refusal::Setup => "setup",
            Refusal::Local => "local",
            Refusal::Leaving => "leaving",
        }
    }

    /// The `result` label of `waypoint_rewrite_connections_total`.
    pub const fn metric_label(self) -> &'static str {
        match self {
            Refusal::NotIpv4 => "refused_not_ipv4",
            Refusal::Options => "refused_options",
            Refusal::Busy => "refused_busy",
            Refusal::Setup => "refused_setup",
            Refusal::Local => "refused_local",
            Refusal::Leaving => "refused_leaving",
        }
    }
}

/// A connection handed back untouched (A out of repair mode), with the bytes read so far.
pub struct Refused {
    /// Why.
    pub reason: Refusal,
    /// The client's connection.
    pub downstream: Socket,
    /// The pod's connection.
    pub upstream: Socket,
    /// The hello and whatever was read behind it.
    pub initial: Vec<u8>,
}

/// Counters of the rewrite splice, process-wide.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Connections rewritten.
    pub rewritten: u64,
    /// Connections refused, by [`Refusal::ALL`] order.
    pub refused: [u64; Refusal::ALL.len()],
    /// Connections undone at the hand-over because a packet landed in A or B (step 4) that
    /// B could not carry on the client's behalf: both ends reset.
    pub stranded: u64,
    /// Hand-overs whose client sent on before the entries were in: B carried the bytes
    /// that landed in A (and a FIN), and the connection went on rewritten (step 4).
    pub filled: u64,
    /// Rewritten connections whose entries are in the map: open, or ended and lingering.
    pub live: u64,
    /// Ended connections whose linger was cut short: more than `linger_limit` lingered.
    pub lingers_cut: u64,
    /// How many ended connections may linger at once on this node ([`linger_limit`]).
    pub linger_limit: u64,
    /// Hand-overs under way: from reading the sequence numbers to the grace check.
    pub pending: u64,
    /// Hand-overs that computed the sequence numbers from the sockets' handshake records
    /// (the others read them in repair mode).
    pub recorded: u64,
    /// Rewritten connections whose B still waits for the pod to acknowledge what it sent
    /// (not in repair mode yet, see [`silence`]).
    pub unacknowledged: u64,
}

/// The rewrite program's maps, as the loader hands them over.
pub(super) struct Maps {
    /// `REWRITES_MAP`.
    pub rewrites: HashMap<MapData, RewriteKey, Rewrite>,
    /// `REWRITE_PORTS_MAP`.
    pub ports: Array<MapData, u8>,
    /// `REWRITE_STATS_MAP`.
    pub stats: PerCpuArray<MapData, u64>,
    /// `REWRITE_FILLS_MAP`.
    pub fills: HashMap<MapData, RewriteKey, u32>,
}

/// The rewrite splice: the program's map and statistics, attached by [`super::ebpf`].
pub(super) struct Rewriter {
    map: Mutex<HashMap<MapData, RewriteKey, Rewrite>>,
    /// `REWRITE_FILLS_MAP`: see [`Rewriter::fill`].
    fills: Mutex<HashMap<MapData, RewriteKey, u32>>,
    /// The SockHash redirect's signals, which the program shares (slots from
    /// [`REWRITE_SLOT_BASE`]).
    signals: Arc<Signals>,
    stats: PerCpuArray<MapData, u64>,
    grace: Arc<Grace>,
    next_slot: AtomicU32,
    rewritten: AtomicU64,
    refused: [AtomicU64; Refusal::ALL.len()],
    stranded: AtomicU64,
    filled: AtomicU64,
    live: AtomicU64,
    pending: AtomicU64,
    /// See `ebpf::Config::rewrite_handover_pause`.
    pause: Option<Duration>,
    /// The sockets' records of their handshakes, when the program is attached.
    records: Option<Records>,
    /// Hand-overs that took their sequence numbers from the records.
    recorded: AtomicU64,
    /// See [`Counts::unacknowledged`]; kept by [`Rewritten`].
    unacknowledged: AtomicU64,
    /// The port whose dials the kernel records unmarked (`ebpf::Config::pod_port`).
    pod_port: Option<u16>,
    /// Ended connections whose entries linger, oldest first ([`Rewriter::sweep`]).
    lingering: Mutex<VecDeque<Lingering>>,
    /// How many may linger at once ([`linger_limit`]).
    linger_limit: usize,
    /// Lingers cut short by the limit.
    lingers_cut: AtomicU64,
    /// The ports whose packets the program looks up.
    ports: Ports,
    /// The linger thread ([`Rewriter::start_sweeping`]), and the flag that stops it.
    sweeper: Mutex<Option<Background>>,
    stopping: AtomicBool,
    /// The daemon leaves its connections to the next one ([`Rewriter::leave`]).
    leaving: AtomicBool,
    /// The Bs of the connections left, by slot, for the adopter.
    left: Mutex<Vec<(u32, OwnedFd)>>,
    /// Hand-overs under way and [`Rewritten`] tasks alive.
    tasks: AtomicU64,
}

/// The program's port filter (`REWRITE_PORTS_MAP`), and the bits set in it so far, so
/// that only the first connection through a port writes to the map. Bits are never
/// cleared: a port costs the node's packets to or from it a lookup, nothing more.
struct Ports {
    map: Mutex<Array<MapData, u8>>,
    set: Box<[AtomicU8]>,
}

impl Ports {
    fn new(map: Array<MapData, u8>) -> Self {
        Ports {
            map: Mutex::new(map),
            set: (0..=u16::MAX).map(|_| AtomicU8::new(0)).collect(),
        }
    }

    /// Sets `bit` of `port`, unless it is set already.
    fn allow(&self, port: u16, bit: u8) -> Result<(), MapError> {
        let Some(set) = self.set.get(usize::from(port)) else {
            return Ok(());
        };
        if set.load(Acquire) & bit != 0 {
            return Ok(());
        }
        let mut map = lock(&self.map);
        let bits = set.load(Acquire) | bit;
        map.set(u32::from(port), bits, 0)?;
        set.store(bits, Release);
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Each critical section is one map syscall: a panic cannot leave it half-done.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the hand-over keeps of its first steps.
struct Prepared {
    addrs: Addrs,
    entries: Entries,
    slot: u32,
    hello_end: u32,
    /// How step 3 tells whether a packet landed in A or B.
    probe: Probe,
}

/// One direction's key and value, and the other's.
#[derive(Clone, Copy)]
struct Entries {
    from_client: RewriteKey,
    from_pod: RewriteKey,
}

impl Rewriter {
    pub fn new(
        maps: Maps,
        signals: Arc<Signals>,
        pause: Option<Duration>,
        records: Option<Records>,
        pod_port: Option<u16>,
    ) -> Self {
        let Maps {
            rewrites,
            ports,
            stats,
            fills,
        } = maps;
        Rewriter {
            map: Mutex::new(rewrites),
            fills: Mutex::new(fills),
            signals,
            stats,
            grace: Grace::start(),
            next_slot: AtomicU32::new(0),
            rewritten: AtomicU64::new(0),
            refused: Default::default(),
            stranded: AtomicU64::new(0),
            filled: AtomicU64::new(0),
            live: AtomicU64::new(0),
            pending: AtomicU64::new(0),
            pause,
            records,
            recorded: AtomicU64::new(0),
            unacknowledged: AtomicU64::new(0),
            pod_port,
            lingering: Mutex::new(VecDeque::new()),
            linger_limit: node_linger_limit(),
            lingers_cut: AtomicU64::new(0),
            ports: Ports::new(ports),
            sweeper: Mutex::new(None),
            stopping: AtomicBool::new(false),
            leaving: AtomicBool::new(false),
            left: Mutex::new(Vec::new()),
            tasks: AtomicU64::new(0),
        }
    }

    /// Leaves every rewritten connection to the next daemon: from now on each
    /// [`Rewritten`] returns at its next poll (all are woken) with its B put aside, and
    /// the lingering ones' Bs too, their entries left in place (see `adopt.rs`).
    pub fn leave(&self) {
        // Before `all_left` reads the count: a hand-over counted after that read sees
        // the flag (`hand_over`).
        self.leaving.store(true, SeqCst);
        let lingering = std::mem::take(&mut *lock(&self.lingering));
        {
            let mut left = lock(&self.left);
            for l in lingering {
                // A second descriptor of B: the linger's closes (silently) as it drops.
                match l.upstream.try_clone() {
                    Ok(b) => left.push((l.slot, b)),
                    Err(e) => {
                        warn!(error = %e, "a lingering connection's socket could not be kept for the next daemon")
                    }
                }
            }
        }
        self.signals.wake_all();
    }

    /// Whether any connection is rewritten, lingering or being handed over.
    pub fn has_connections(&self) -> bool {
        self.live.load(Relaxed) > 0 || self.pending.load(Relaxed) > 0
    }

    /// Whether the rewritten connections have all been put aside: no hand-over and no
    /// [`Rewritten`] left.
    pub fn all_left(&self) -> bool {
        self.tasks.load(SeqCst) == 0
    }

    /// The Bs put aside by [`Rewriter::leave`], by slot.
    pub fn take_left(&self) -> Vec<(u32, OwnedFd)> {
        std::mem::take(&mut *lock(&self.left))
    }

    /// Stops and joins the rewriter's threads (linger and grace). Connections still
    /// lingering keep their entries until the maps go.
    pub fn stop(&self) {
        self.stopping.store(true, Relaxed);
        let sweeper = lock(&self.sweeper).take();
        if let Some(mut t) = sweeper {
            t.unpark();
            t.join(JOIN_WITHIN);
        }
        self.grace.stop();
    }

    /// Marks a socket about to connect to `port` (see [`Rewriter::mark`]), unless the
    /// kernel records it anyway: a dial to the pods' port.
    pub fn mark_dial(&self, socket: BorrowedFd<'_>, port: u16) {
        if self.pod_port != Some(port) {
            self.mark(socket);
        }
    }

    /// Marks a listener (for the sockets it accepts) or a socket about to connect, so
    /// that the hand-over finds its record (see [`Records`]). Without one it reads the
    /// socket instead.
    pub fn mark(&self, socket: BorrowedFd<'_>) {
        if let Some(r) = &self.records {
            if let Err(e) = r.mark(socket) {
                debug!(error = %e, "rewrite: marking a socket for its handshake record failed");
            }
        }
    }

    /// The counters so far.
    pub fn counts(&self) -> Counts {
        Counts {
            rewritten: self.rewritten.load(Relaxed),
            refused: std::array::from_fn(|i| self.refused[i].load(Relaxed)),
            stranded: self.stranded.load(Relaxed),
            filled: self.filled.load(Relaxed),
            live: self.live.load(Relaxed),
            lingers_cut: self.lingers_cut.load(Relaxed),
            linger_limit: self.linger_limit as u64,
            pending: self.pending.load(Relaxed),
            recorded: self.recorded.load(Relaxed),
            unacknowledged: self.unacknowledged.load(Relaxed),
        }
    }

    /// The program's statistics, summed over CPUs, in [`RewriteStat::ALL`] order.
    pub fn stats(&self) -> Vec<(RewriteStat, u64)> {
        RewriteStat::ALL
            .iter()
            .map(|&s| (s, per_cpu_total(&self.stats, s as u32)))
            .collect()
    }

    /// Entries in the map (walks it: diagnostics and tests only).
    pub fn entries(&self) -> usize {
        lock(&self.map).keys().count()
    }

    /// Elements in the fill map (walks it: diagnostics and tests only).
    pub fn fills(&self) -> usize {
        lock(&self.fills).keys().count()
    }

    fn refuse(
        &self,
        reason: Refusal,
        downstream: Socket,
        upstream: Socket,
        initial: Vec<u8>,
    ) -> Refused {
        self.refused[reason as usize].fetch_add(1, Relaxed);
        debug!(reason = reason.as_str(), "not rewritten");
        Refused {
            reason,
            downstream,
            upstream,
            initial,
        }
    }

    /// Steps 1 to 4 of the hand-over: the connection rewritten (to be followed by
    /// [`Rewritten`]), ended at the hand-over, or handed back untouched.
    pub async fn hand_over(
        &self,
        downstream: Socket,
        upstream: Socket,
        initial: Vec<u8>,
    ) -> Result<Result<HandedOver, io::Error>, Refused> {
        // Counted from here until its `Rewritten` is gone (see `Rewriter::all_left`); a
        // daemon that leaves rewrites nothing more (in this order: see `leave`).
        self.tasks.fetch_add(1, SeqCst);
        let mut counted = Counted {
            tasks: &self.tasks,
            armed: true,
        };
        if self.leaving.load(SeqCst) {
            return Err(self.refuse(Refusal::Leaving, downstream, upstream, initial));
        }
        let result = self.hand_over_counted(downstream, upstream, initial).await;
        // A rewritten connection's count goes to its `Rewritten`, made at once.
        counted.armed = !matches!(result, Ok(Ok(_)));
        result
    }

    async fn hand_over_counted(
        &self,
        downstream: Socket,
        upstream: Socket,
        initial: Vec<u8>,
    ) -> Result<Result<HandedOver, io::Error>, Refused> {
        let start = Instant::now();
        // Synchronous, so that none of its working state stays in this future across
        // the awaits below.
        let p = match self.prepare(&downstream, &upstream, &initial) {
            Ok(p) => p,
            Err(reason) => return Err(self.refuse(reason, downstream, upstream, initial)),
        };
        let Prepared {
            addrs,
            entries,
            slot,
            hello_end,
            probe,
        } = p;
        let b = upstream.as_raw_fd();
        self.live.fetch_add(1, Relaxed);
        self.rewritten.fetch_add(1, Relaxed);
        // Declared before the guard, so that it closes after the guard ran.
        let mut upstream = upstream;
        let mut undo = Undo {
            rewriter: self,
            addrs,
            slot,
            b,
            pending: true,
            armed: true,
        };
        let sent = upstream.write_all(&initial).await;
        let initial_len = initial.len() as u64;
        drop(initial);
        // Step 4: after a grace period, nothing that passed the program before the
        // entries were in is still on its way to A or B.
        self.grace.wait().await;
        let landed = match sent {
            Ok(()) => probe.landed(&downstream, &upstream),
            Err(_) => Landed::Other,
        };
        let fill = match landed {
            Landed::Nothing => Some(Fill::default()),
            Landed::Client(k) => {
                let fill = self.fill(&downstream, &upstream, k, &entries, slot, hello_end);
                if fill.is_some() {
                    self.filled.fetch_add(1, Relaxed);
                }
                fill
            }
            Landed::Other => None,
        };
        self.pending.fetch_sub(1, Relaxed);
        undo.pending = false;
        undo.armed = false;
        let Some(fill) = fill else {
            self.stranded.fetch_add(1, Relaxed);
            warn!(
                client = %addrs.client,
                "a packet reached the waypoint's socket during the rewrite hand-over that the \
                 waypoint could not pass on (a pod that spoke first, an interface without the \
                 program, a reset, or bytes out of order): both ends reset"
            );
            self.signals.unregister(slot);
            // The pod holds everything up to the hello and waits for the stranded bytes.
            self.abort(&addrs, &entries, slot, Some(hello_end));
            // Silent, both: the resets are out.
            let _ = set_repair(b, 1);
            drop(downstream);
            drop(upstream);
            return Ok(match sent {
                Ok(()) => Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "bytes stranded at the rewrite hand-over",
                )),
                Err(e) => Err(e),
            });
        };
        // Silent: A is in repair mode.
        drop(downstream);
        // B only holds its 4-tuple now, out of the reactor (the diverted ACK would wake
        // it).
        let upstream = match upstream.into_std() {
            Ok(s) => OwnedFd::from(s),
            Err(e) => {
                // Taking it out of epoll failed, and closed it: its FIN is out of place
                // in the rewritten conversation.
                self.signals.unregister(slot);
                self.abort(&addrs, &entries, slot, None);
                if fill.filled {
                    self.forget_fill(&entries);
                }
                return Ok(Err(e));
            }
        };
        // Most pods have acknowledged the hello by now (one RTT on the node, against a
        // grace period): B is silenced here, the rest by `Rewritten`.
        let silent = silence(&upstream);
        Ok(Ok(HandedOver {
            addrs,
            slot,
            upstream,
            silent,
            initial_len,
            carried: fill.data,
            start,
            filled: fill.filled,
            look: fill.fin,
        }))
    }

    /// Steps 1 and 2 of the hand-over: the checks, the sequence numbers, the entries.
    /// On refusal A is out of repair mode again. The slot is registered for signals
    /// ([`Signals::expect`]) before the entries go in, so that [`Rewritten`] knows whether
    /// an end came before its first poll without looking at the entries; a connection
    /// that ends during the hand-over wakes nobody.
    fn prepare(
        &self,
        downstream: &Socket,
        upstream: &Socket,
        initial: &[u8],
    ) -> Result<Prepared, Refusal> {
        // Both sockets' records, or neither: read from the sockets then.
        let recorded = self
            .records
            .as_ref()
            .and_then(|r| Some((r.get(downstream.as_fd())?, r.get(upstream.as_fd())?)));
        let addrs = match &recorded {
            Some((ra, rb)) => Addrs::recorded(ra, rb),
            None => Addrs::of(downstream, upstream),
        }
        .ok_or(Refusal::NotIpv4)?;
        if addrs.client_here() != addrs.pod_here() {
            return Err(Refusal::Local);
        }
        let a = downstream.as_raw_fd();
        let (Ok(info_a), Ok(info_b)) = (info(downstream), info(upstream)) else {
            return Err(Refusal::Setup);
        };
        if !info_a.lines_up_with(&info_b) {
            return Err(Refusal::Options);
        }
        // Neither socket has sent a byte: a rewritten packet cannot acknowledge them.
        if info_a.unacked != 0 || info_b.unacked != 0 {
            return Err(Refusal::Busy);
        }
        // A pod that spoke first (or closed) is not for this splice: what B holds would
        // be lost between the two conversations.
        if info_b.bytes_received != 0 {
            return Err(Refusal::Busy);
        }
        let from_records = recorded.is_some();
        let (seqs, probe, recorded_ts) = match recorded {
            Some((ra, rb)) => {
                // A received exactly what the router read from it: nothing unread (a
                // client that streams on, see `snapshot`), no FIN. Nothing waits in
                // either send queue.
                if info_a.bytes_received != initial.len() as u64
                    || info_a.notsent != 0
                    || info_b.notsent != 0
                {
                    return Err(Refusal::Busy);
                }
                // Only so that A closes silently at step 4 (or at an abort).
                if let Err(e) = set_repair(a, 1) {
                    debug!(error = %e, "rewrite hand-over: repair mode failed");
                    return Err(Refusal::Setup);
                }
                self.pending.fetch_add(1, Relaxed);
                let seq = |base: u32, count: u64| base.wrapping_add(count as u32);
                let seqs = Seqs {
                    a_snd: seq(ra.snd_base, info_a.bytes_acked),
                    a_rcv: seq(ra.rcv_base, info_a.bytes_received),
                    b_snd: seq(rb.snd_base, info_b.bytes_acked),
                    b_rcv: seq(rb.rcv_base, info_b.bytes_received),
                };
                let probe = Probe::Received {
                    a: info_a.bytes_received,
                    b: info_b.bytes_received,
                };
                let ts = (ra.flags & rb.flags & ESTABLISHED_TS_OFFSET != 0)
                    .then_some((ra.ts_offset, rb.ts_offset));
                (seqs, probe, ts)
            }
            None => match snapshot(downstream, upstream) {
                Ok(Some(s)) => {
                    self.pending.fetch_add(1, Relaxed);
                    let probe = Probe::Queues {
                        a_rcv: s.a_rcv,
                        b_rcv: s.b_rcv,
                    };
                    (s, probe, None)
                }
                Ok(None) => return Err(Refusal::Busy),
                Err(e) => {
                    debug!(error = %e, "rewrite hand-over: socket options failed");
                    let _ = set_repair(a, TCP_REPAIR_OFF_NO_WP);
                    return Err(Refusal::Setup);
                }
            },
        };
        let timestamps = info_a.options & TCPI_OPT_TIMESTAMPS != 0;
        let (ts_a, ts_b) = match (timestamps, recorded_ts) {
            (false, _) => (0, 0),
            (true, Some(ts)) => ts,
            (true, None) => {
                let (Ok(x), Ok(y)) = (ts_clock(a), ts_clock(upstream.as_raw_fd())) else {
                    let _ = set_repair(a, TCP_REPAIR_OFF_NO_WP);
                    self.pending.fetch_sub(1, Relaxed);
                    return Err(Refusal::Setup);
                };
                (x, y)
            }
        };
        if let Some(pause) = self.pause {
            // Tests only (a blocking sleep: the hand-over has no await before here).
            std::thread::sleep(pause);
        }
        let slot = REWRITE_SLOT_BASE | (self.next_slot.fetch_add(1, Relaxed) & !REWRITE_SLOT_BASE);
        let hello_end = seqs.b_snd.wrapping_add(initial.len() as u32);
        let entries = addrs.entries();
        let from_client = Rewrite {
            to: key(addrs.b_local, addrs.pod),
            slot,
            seq_add: hello_end.wrapping_sub(seqs.a_rcv),
            ack_add: seqs.b_rcv.wrapping_sub(seqs.a_snd),
            ts_off: ts_b,
            next_seq: seqs.a_rcv,
            ..Rewrite::default()
        };
        let from_pod = Rewrite {
            to: key(addrs.a_local, addrs.client),
            slot,
            seq_add: seqs.a_snd.wrapping_sub(seqs.b_rcv),
            ack_add: seqs.a_rcv.wrapping_sub(hello_end),
            watch: hello_end,
            ts_off: ts_a,
            flags: REWRITE_WATCH | REWRITE_FROM_POD,
            next_seq: seqs.b_rcv,
            ..Rewrite::default()
        };
        // Before the entries: the program looks up only packets to or from these ports.
        if let Err(e) = self
            .ports
            .allow(addrs.a_local.port(), PORT_CLIENT_TO)
            .and_then(|()| self.ports.allow(addrs.pod.port(), PORT_POD_FROM))
        {
            debug!(error = %e, "rewrite hand-over: setting the port filter failed");
            let _ = set_repair(a, TCP_REPAIR_OFF_NO_WP);
            self.pending.fetch_sub(1, Relaxed);
            return Err(Refusal::Setup);
        }
        self.signals.expect(slot);
        let mut map = lock(&self.map);
        // One call for both. The pod's direction first: the client's packets are
        // rewritten from the moment its entry is in, and the pod may answer at once.
        let inserted = bpf_cmd::update(
            map.map().fd().as_fd(),
            &[entries.from_pod, entries.from_client],
            &[from_pod, from_client],
        );
        if let Err(e) = inserted {
            if e.done > 0 {
                let _ = map.remove(&entries.from_pod);
            }
            drop(map);
            self.signals.unregister(slot);
            debug!(error = %e.error, "rewrite hand-over: map insert failed");
            let _ = set_repair(a, TCP_REPAIR_OFF_NO_WP);
            self.pending.fetch_sub(1, Relaxed);
            return Err(Refusal::Setup);
        }
        if from_records {
            self.recorded.fetch_add(1, Relaxed);
        }
        Ok(Prepared {
            addrs,
            entries,
            slot,
            hello_end,
            probe,
        })
    }

    fn get(&self, key: &RewriteKey) -> Option<Rewrite> {
        lock(&self.map).get(key, 0).ok()
    }

    /// Whether the client's entry is still `slot`'s. The client's 4-tuple may belong to
    /// a new connection by now: a SYN with it made the program remove ours, and the new
    /// connection's hand-over put in its own under the same key (the client reused its
    /// port within the linger). That entry is not ours to remove: its slot tells. (A SYN
    /// landing between the look and the removal, microseconds apart, is not caught.)
    fn client_ours(&self, entries: &Entries, slot: u32) -> bool {
        self.get(&entries.from_client)
            .is_some_and(|c| c.slot == slot)
    }

    /// Removes the pod's entry, and the client's too if `client_ours` (see
    /// [`Rewriter::client_ours`]). The pod's 4-tuple is ours alone: B holds it until after.
    fn remove_known(&self, entries: &Entries, client_ours: bool) {
        if client_ours {
            self.delete(&[entries.from_client, entries.from_pod]);
        } else {
            self.delete(&[entries.from_pod]);
        }
        self.live.fetch_sub(1, Relaxed);
    }

    /// Removes `keys` from the map, in as few calls as it takes: a key already gone (the
    /// program removed it) stops a batch, and the next call starts behind it.
    fn delete(&self, keys: &[RewriteKey]) {
        let mut map = lock(&self.map);
        let mut rest = keys;
        while !rest.is_empty() {
            match bpf_cmd::delete(map.map().fd().as_fd(), rest) {
                Ok(()) => return,
                Err(e) if e.error.raw_os_error() == Some(libc::ENOENT) => {
                    rest = rest.get(e.done + 1..).unwrap_or_default();
                }
                // No batch command (before Linux 5.6): one by one.
                Err(e) => {
                    for key in rest.iter().skip(e.done) {
                        let _ = map.remove(key);
                    }
                    return;
                }
            }
        }
    }

    /// The connection as its entries tell it: one lookup of each.
    fn state(&self, entries: &Entries) -> State {
        let (Some(c), Some(p)) = (self.get(&entries.from_client), self.get(&entries.from_pod))
        else {
            // The program removed them: a SYN reused the client's 4-tuple.
            return State {
                end: Some(End::DownstreamReset),
                packets: 0,
                bytes: (0, 0),
            };
        };
        let end = if c.flags & REWRITE_RST != 0 {
            Some(End::DownstreamReset)
        } else if p.flags & REWRITE_RST != 0 {
            Some(End::UpstreamReset)
        } else if c.flags & p.flags & REWRITE_FIN != 0 {
            Some(End::Closed)
        } else {
            None
        };
        State {
            end,
            packets: c.packets + p.packets,
            bytes: (c.bytes, p.bytes),
        }
    }

    /// Removes the entries and resets both ends, each at the sequence number it expects
    /// next (what the program saw the other end send, moved into its number space), or
    /// the pod at `pod_seq`. Returns the bytes each direction carried.
    ///
    /// The client's entry counts only if it is `slot`'s (see [`Rewriter::remove`]): a
    /// new connection's client is not reset.
    fn abort(
        &self,
        addrs: &Addrs,
        entries: &Entries,
        slot: u32,
        pod_seq: Option<u32>,
    ) -> (u64, u64) {
        let c = self.get(&entries.from_client).filter(|c| c.slot == slot);
        let p = self.get(&entries.from_pod);
        self.remove_known(entries, c.is_some());
        let mut sent = 0;
        if let Some(p) = p {
            let seq = p.next_seq.wrapping_add(p.seq_add);
            sent += u32::from(send_rst(addrs.a_local, addrs.client, seq).is_ok());
        }
        if let Some(c) = c {
            let seq = pod_seq.unwrap_or(c.next_seq.wrapping_add(c.seq_add));
            sent += u32::from(send_rst(addrs.b_local, addrs.pod, seq).is_ok());
        }
        if sent < 2 {
            warn!(
                "resetting a rewritten connection's ends failed (no CAP_NET_RAW?): they learn \
                   of its end at their next packet"
            );
        }
        (c.map_or(0, |r| r.bytes), p.map_or(0, |r| r.bytes))
    }
}

/// Takes a hand-over out of [`Rewriter::all_left`]'s count when dropped armed.
struct Counted<'a> {
    tasks: &'a AtomicU64,
    armed: bool,
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.tasks.fetch_sub(1, SeqCst);
        }
    }
}

/// What [`Rewriter::state`] read.
struct State {
    /// How the connection ended; None while it goes on.
    end: Option<End>,
    /// Packets rewritten, both directions.
    packets: u64,
    /// Bytes carried from the client and from the pod.
    bytes: (u64, u64),
}

/// Ends a hand-over dropped half-way (at the drain deadline): entries out, both ends
/// reset, B silent.
struct Undo<'a> {
    rewriter: &'a Rewriter,
    addrs: Addrs,
    slot: u32,
    b: RawFd,
    /// Still counted in `pending`.
    pending: bool,
    armed: bool,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if self.pending {
            self.rewriter.pending.fetch_sub(1, Relaxed);
        }
        debug!(client = %self.addrs.client, "rewrite hand-over dropped half-way: both ends reset");
        self.rewriter.signals.unregister(self.slot);
        self.rewriter
            .abort(&self.addrs, &self.addrs.entries(), self.slot, None);
        // B is still open: its owner drops after this guard.
        let _ = set_repair(self.b, 1);
    }
}

mod fill;
mod grace;
mod linger;
mod rewritten;
mod tcp;

use fill::*;
use grace::*;
pub use linger::LINGER;
use linger::*;
pub(super) use rewritten::{HandedOver, Rewritten};
use tcp::*;
pub(super) use tcp::{can_send_resets, send_rst};
#[cfg(test)]
pub(super) use tcp::{snapshot, ts_clock, Seqs};

#[cfg(test)]
mod tests;
