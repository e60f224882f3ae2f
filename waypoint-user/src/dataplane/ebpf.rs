//! The eBPF dataplane: the kernel moves the bytes.
//!
//! Both sockets of a connection go into one SockHash, each under its **peer's** cookie,
//! with the SK_SKB stream verdict program (waypoint-ebpf) attached to it. A segment that
//! arrives on one socket is redirected to the other socket's egress without a wake-up of
//! this process. Userspace keeps three jobs, one task per connection:
//!
//! 1. **Ordering at the edges.** The initial bytes (the ClientHello) and anything the
//!    verdict passes instead of redirecting are forwarded from userspace, and the verdict
//!    redirects nothing while userspace holds bytes (`passed != consumed`).
//! 2. **Backpressure.** The kernel parks redirected bytes in the peer's backlog without
//!    limit if the peer's TCP cannot take them. Userspace grants the verdict a *credit*:
//!    the bytes the peer's TCP has already taken plus `max_inflight`. Past it the verdict
//!    passes, the source's receive buffer fills and the sender's window closes.
//! 3. **Close semantics.** The verdict never redirects an empty segment (a bare FIN), so
//!    userspace sees EOF, waits until the peer's TCP holds every byte sent before it, and
//!    only then shuts the peer's write side. A reset is passed on as an abort.
//!
//! "The peer's TCP holds N bytes" is measured as `tcpi_bytes_acked + SIOCOUTQ`, read in
//! that order so that the sum never overstates what TCP holds. The baseline it is
//! counted from is read until no ack moved between the two reads: an understated
//! baseline would let a FIN overtake the last redirected bytes.

use std::{
    future::Future,
    io,
    os::fd::{AsFd, BorrowedFd},
    pin::Pin,
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Arc, Mutex, MutexGuard,
    },
    task::{ready, Context, Poll},
    time::{Duration, Instant},
};

use aya::{
    maps::{Array, HashMap, MapData, PerCpuArray, RingBuf, SockHash},
    programs::{SchedClassifier, SkSkb},
    Ebpf as Loaded, EbpfLoader,
};
use futures::future::Either;
use tracing::{debug, info, warn};
use waypoint_common::{
    Rewrite, RewriteKey, RewriteStat, Stat, ENDS_MAP, FLOWS_MAP, PEERS_MAP, POD_PORT, PORTS_PINNED,
    REWRITES_MAP, REWRITE_FILLS_MAP, REWRITE_PORTS_MAP, REWRITE_PROG, REWRITE_STATS_MAP,
    SIGNALS_MAP, SKB_SEQ_OFFSET, SKB_SK_OFFSET, SLOTS_MAP, SOCK_OPS_SK_OFFSET, STATS_MAP,
    TCP_COPIED_SEQ_OFFSET, TCP_TSOFFSET_OFFSET, VERDICT_PROG,
};

use super::bpf_cmd::per_cpu_total;
use super::established::Records;
use super::flows::{self, FlowTable};
use super::links;
use super::rewrite::{self, Rewriter};
use super::signals::{self, Signals};
use super::tally::{Taken, Tally};
use super::{btf, End, Kind, Limits, Outcome, Socket};
use super::{handoff, pins};

/// The eBPF object built by waypoint-user's build script from waypoint-ebpf.
pub(super) static OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/waypoint"));

/// Default bound on bytes in flight inside the kernel per direction of a connection.
pub const DEFAULT_MAX_INFLIGHT: u64 = 4 * 1024 * 1024;

/// Largest send buffer forced on a bulk direction's destination. The kernel's redirect
/// worker sleeps one timer tick (4 ms at HZ=250) when the destination's send buffer is
/// half full; half of 16 MiB is more than a tick of loopback bulk, so the destination
/// does not run dry meanwhile. See docs/ARCHITECTURE.md.
pub const DEFAULT_BULK_SEND_BUFFER: usize = 16 * 1024 * 1024;

/// Default for [`Config::move_after`]: a connection moves into the SockHash once it
/// has carried this many bytes, both directions together. A TLS handshake and a few small
/// requests stay below it.
pub const DEFAULT_MOVE_AFTER: u64 = 16 * 1024;

/// Read size for the bytes the verdict passes. Each read drains more of the queue than
/// the 64 KiB used before, so userspace catches up with a bulk sender sooner and the flow
/// returns to the kernel path: quick bench, 3 interleaved runs each, eBPF 1/8/64
/// connections went from 13.9/17.7/16.0 to 17.9/18.9/18.5 Gbit/s (1 MiB: no better).
const PASS_BUFFER: usize = 256 * 1024;

/// How often the credit is refreshed while a direction is moving bytes.
const REFRESH_INTERVAL: Duration = Duration::from_millis(1);

/// Refreshes in a row that found nothing new before a direction stops refreshing; the
/// verdict's next signal wakes it again. Each refresh also looks for passed bytes, which
/// covers a pass that raced the direction's catching up and sent no signal (see
/// `signals.rs`).
const IDLE_REFRESHES: u32 = 8;

/// Settings of the eBPF dataplane.
#[derive(Clone, Debug)]
pub struct Config {
    /// Bytes allowed in flight in the kernel per direction (redirected but not yet taken
    /// by the destination's TCP). Bounds memory under a slow reader.
    pub max_inflight: u64,
    /// Forced send and receive buffer size for redirected sockets (SO_SNDBUFFORCE /
    /// SO_RCVBUFFORCE); None keeps the kernel's autotuning.
    pub socket_buffer: Option<usize>,
    /// Cap on the send buffer forced on a destination (SO_SNDBUFFORCE) when its direction
    /// trips the in-flight budget and the destination drains fast enough to need it; 0
    /// leaves every buffer to autotuning. See [`DEFAULT_BULK_SEND_BUFFER`].
    pub bulk_send_buffer: usize,
    /// Capacity of the per-socket maps and of the rewrite map: two entries per connection.
    pub max_sockets: u32,
    /// A connection is copied in userspace until both directions together have carried
    /// this many bytes, and only then moved into the SockHash: a psock costs more than a
    /// short connection gains from the kernel path. 0 moves every connection at once.
    pub move_after: u64,
    /// Size in bytes of the ring through which the verdict wakes quiet connections (a
    /// power of two and a multiple of the page size; see `signals.rs`). A record is 16
    /// bytes; a full ring loses records, and the daemon then wakes every waiting
    /// connection instead.
    pub signal_ring_bytes: u32,
    /// Splice connections by rewriting their packets' headers in a TC program on every
    /// interface (see `rewrite.rs`); those it refuses take the SockHash.
    pub rewrite_splice: bool,
    /// The port the daemon dials pods on: the kernel records the handshake of every
    /// socket of the daemon's cgroup that connects to it (see `established.rs`), so
    /// that the daemon need not mark them. None: only marked sockets are recorded.
    pub pod_port: Option<u16>,
    /// Where the rewrite program's links and map are pinned (see `pins.rs`).
    pub pin_dir: std::path::PathBuf,
    /// Hooks that hold a race open for a test (feature `test-hooks`, which only the
    /// crate's own tests turn on).
    #[cfg(any(test, feature = "test-hooks"))]
    pub hooks: Hooks,
}

/// Test hooks of the eBPF dataplane: each makes a rare interleaving certain.
#[cfg(any(test, feature = "test-hooks"))]
#[derive(Clone, Copy, Debug, Default)]
pub struct Hooks {
    /// The rewrite hand-over sleeps this long between reading the sockets' sequence
    /// numbers and inserting the entries, so that a test can land a packet in the
    /// waypoint's socket meanwhile.
    pub rewrite_handover_pause: Option<Duration>,
    /// The SockHash entry sleeps this long between draining the sockets' queues and
    /// inserting them, so that a test can land bytes in between.
    pub sockhash_entry_pause: Option<Duration>,
    /// The SockHash entry leaves out the kick after the insertion, so that bytes landing
    /// between the drain and the insertion (see `sockhash_entry_pause`) stay stranded: a
    /// real stall, for the stall watchdog's test.
    pub sockhash_entry_no_kick: bool,
    /// The longest repeat the verdict cuts (the object's own limit when None): 0 hands
    /// every repeat to userspace, as a kernel short of memory for the cut would.
    pub trim_limit: Option<u32>,
    /// The rewrite program is attached through netlink, on clsact qdiscs, as on a kernel
    /// without TCX.
    pub tc_netlink: bool,
    /// Loading the rewrite program fails, as on a kernel whose verifier refuses it.
    pub refuse_rewrite: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_inflight: DEFAULT_MAX_INFLIGHT,
            socket_buffer: None,
            bulk_send_buffer: DEFAULT_BULK_SEND_BUFFER,
            max_sockets: waypoint_common::DEFAULT_MAX_SOCKETS,
            move_after: DEFAULT_MOVE_AFTER,
            signal_ring_bytes: waypoint_common::SIGNALS_BYTES,
            rewrite_splice: false,
            pod_port: None,
            pin_dir: pins::DEFAULT_DIR.into(),
            #[cfg(any(test, feature = "test-hooks"))]
            hooks: Hooks::default(),
        }
    }
}

/// Errors of the eBPF dataplane.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The object could not be loaded (no CAP_BPF, old kernel, verifier rejection).
    #[error("loading the eBPF object failed (needs root or CAP_BPF+CAP_NET_ADMIN and a kernel with sockmap): {0}")]
    Load(#[from] aya::EbpfError),
    /// The verdict program could not be attached, or a program was not of its kind.
    #[error("attaching the stream verdict failed: {0}")]
    Program(#[from] aya::programs::ProgramError),
    /// The kernel refused the verdict program (its verifier, or a missing capability).
    #[error("the kernel refused the stream verdict: {0}")]
    Verdict(#[source] aya::programs::ProgramError),
    /// A map is missing from the object or could not be used.
    #[error("eBPF map {name}: {reason}")]
    Map {
        /// The map's name.
        name: &'static str,
        /// What went wrong.
        reason: String,
    },
    /// A map operation for one connection failed (e.g. the maps are full).
    #[error("eBPF map update failed: {}", map_error_chain(.0))]
    Update(#[from] aya::maps::MapError),
    /// The flow records could not be set up.
    #[error(transparent)]
    Flows(#[from] flows::Error),
    /// The rewrite program could not be loaded or attached to an interface.
    #[error("loading or attaching the rewrite program: {0}")]
    Rewrite(aya::programs::ProgramError),
    /// The rewrite program could not be kept on the interfaces.
    #[error(transparent)]
    Links(#[from] links::Error),
    /// No raw socket could be opened: the rewrite resets a rewritten connection's ends
    /// from one, so without it (no CAP_NET_RAW) an idle timeout, a lifetime or a drain
    /// could not end them.
    #[error("the rewrite splice resets ends from a raw socket, which needs CAP_NET_RAW: {0}")]
    RawSocket(#[source] io::Error),
    /// The thread that reads the verdict's signals could not be started.
    #[error(transparent)]
    Signals(#[from] signals::Error),
    /// The thread that ends rewritten connections after their linger could not be
    /// started.
    #[error("starting the rewrite linger thread: {0}")]
    Linger(#[source] io::Error),
    /// A socket option failed.
    #[error("socket setup: {0}")]
    Io(#[from] io::Error),
}

/// Offsets of the kernel fields the verdict reads, for the running kernel (0: off).
#[derive(Clone, Copy, Debug, Default)]
struct KernelOffsets {
    /// `TCP_SKB_CB(skb)->seq` in `struct sk_buff`.
    skb_seq: u32,
    /// `sk` in `struct sk_buff`.
    skb_sk: u32,
    /// `copied_seq` in `struct tcp_sock`.
    tcp_copied_seq: u32,
    /// `sk` in `struct bpf_sock_ops_kern` and `tsoffset` in `struct tcp_sock`, for the
    /// established program (0, 0: its records carry no timestamp offset).
    sock_ops_sk: u32,
    tcp_tsoffset: u32,
}

impl KernelOffsets {
    fn from_btf() -> Result<KernelOffsets, btf::Error> {
        let btf = btf::Btf::vmlinux()?;
        Ok(KernelOffsets {
            skb_seq: btf.member_offset("sk_buff", "cb")?
                + btf.member_offset("tcp_skb_cb", "seq")?,
            skb_sk: btf.member_offset("sk_buff", "sk")?,
            tcp_copied_seq: btf.member_offset("tcp_sock", "copied_seq")?,
            // Apart: without them only the timestamp offsets are read with a socket
            // option at each hand-over.
            ..match (
                btf.member_offset("bpf_sock_ops_kern", "sk"),
                btf.member_offset("tcp_sock", "tsoffset"),
            ) {
                (Ok(sock_ops_sk), Ok(tcp_tsoffset)) => KernelOffsets {
                    sock_ops_sk,
                    tcp_tsoffset,
                    ..KernelOffsets::default()
                },
                _ => KernelOffsets::default(),
            }
        })
    }
}

/// Live entry counts of the per-socket maps, for tests and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapCounts {
    /// Sockets in the SockHash.
    pub peers: usize,
    /// Entries of the cookie → slot map.
    pub slots: usize,
    /// Flow records in use.
    pub flows: usize,
}

/// The loaded and attached eBPF dataplane. Dropping it detaches the program.
pub struct Ebpf {
    config: Config,
    repeat_check: bool,
    peers: Mutex<SockHash<MapData, u64>>,
    flows: FlowTable,
    stats: PerCpuArray<MapData, u64>,
    /// Wakes redirected connections that have bytes to read (see `signals.rs`).
    signals: Arc<Signals>,
    fallbacks: AtomicU64,
    handovers: AtomicU64,
    /// Stalls and parkings of its connections (the copy phase's and the fallback's too).
    tally: &'static Tally,
    /// The rewrite splice, with `rewrite_splice`.
    rewrite: Option<Arc<Rewriter>>,
    /// The rewrite program's attachments to the interfaces, with `rewrite_splice`.
    links: Option<links::Links>,
    // Owns the programs and their attachments (shared with the thread of `links`, which
    // holds it only while it attaches).
    _loaded: Arc<Mutex<Loaded>>,
}

type SockmapForward = Pin<Box<dyn Future<Output = Result<Outcome, Error>> + Send>>;

/// What the rewrite hand-over led to.
#[allow(
    clippy::large_enum_variant,
    reason = "a rewritten connection lives in `Rewritten` for its whole life, inline in its \
              task; the other variants are momentary, and a box would cost an allocation \
              per connection"
)]
enum HandOver {
    Rewritten(rewrite::Rewritten),
    /// Refused: the SockHash redirect takes it.
    Sockmap(SockmapForward),
    /// Ended at the hand-over.
    Ended(Outcome),
}

pin_project_lite::pin_project! {
    /// [`Ebpf::forward`] with the rewrite splice. Hand-written, so that a rewritten
    /// connection's task holds only [`rewrite::Rewritten`] (inline): the hand-over, and the
    /// SockHash path of a refused connection, are boxed and the box is freed once done.
    #[project = RewritingProj]
    enum Rewriting {
        HandOver { fut: Pin<Box<dyn Future<Output = HandOver> + Send>> },
        Rewritten { #[pin] rewritten: rewrite::Rewritten },
        Sockmap { fut: SockmapForward },
    }
}

impl Future for Rewriting {
    type Output = Result<Outcome, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let next = match self.as_mut().project() {
                RewritingProj::HandOver { fut } => ready!(fut.as_mut().poll(cx)),
                RewritingProj::Rewritten { rewritten } => return rewritten.poll(cx).map(Ok),
                RewritingProj::Sockmap { fut } => return fut.as_mut().poll(cx),
            };
            match next {
                HandOver::Rewritten(rewritten) => self.set(Rewriting::Rewritten { rewritten }),
                HandOver::Sockmap(fut) => self.set(Rewriting::Sockmap { fut }),
                HandOver::Ended(outcome) => return Poll::Ready(Ok(outcome)),
            }
        }
    }
}

/// aya's map errors keep the errno in their source; show it.
fn map_error_chain(e: &aya::maps::MapError) -> String {
    use std::error::Error as _;
    match e.source() {
        Some(src) => format!("{e}: {src}"),
        None => e.to_string(),
    }
}

impl Error {
    /// The error on one line of at most about 300 characters: a verifier's refusal keeps
    /// the system call's error and the verifier's last words (its log can run to
    /// thousands of lines, which the full error carries).
    pub fn brief(&self) -> String {
        use aya::programs::ProgramError;
        let verifier = match self {
            Error::Verdict(ProgramError::LoadError {
                io_error,
                verifier_log,
            })
            | Error::Rewrite(ProgramError::LoadError {
                io_error,
                verifier_log,
            }) => Some((io_error, verifier_log.to_string())),
            _ => None,
        };
        let line = match verifier {
            Some((io_error, log)) => {
                let program = match self {
                    Error::Verdict(_) => "stream verdict",
                    _ => "rewrite program",
                };
                // The last lines are statistics ("processed N insns", "verification
                // time"); the refusal is the line before them.
                let last = log
                    .lines()
                    .map(str::trim)
                    .rfind(|l| {
                        !l.is_empty()
                            && !l.starts_with("processed ")
                            && !l.starts_with("verification time")
                            && !l.starts_with("stack depth")
                    })
                    .unwrap_or("(no verifier log)");
                format!("the kernel refused the {program} ({io_error}): {last}")
            }
            None => self.to_string().replace('\n', " "),
        };
        const MAX: usize = 300;
        match line.char_indices().nth(MAX) {
            Some((cut, _)) => format!("{}…", &line[..cut]),
            None => line,
        }
    }

    /// The kernel refused the verdict program itself: the one failure that loading it
    /// without the repeat check (no `bpf_probe_read_kernel`, no CAP_PERFMON) can cure.
    fn refused_verdict(&self) -> bool {
        matches!(self, Error::Verdict(_))
    }
}

fn map_error(name: &'static str, reason: impl ToString) -> Error {
    Error::Map {
        name,
        reason: reason.to_string(),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave a map half-updated (each operation is
    // one syscall), so a poisoned lock is still safe to use.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Ebpf {
    /// Loads the verdict program and its maps and attaches the program to the SockHash.
    ///
    /// The repeat check (see waypoint-ebpf) needs kernel offsets from BTF and
    /// bpf_probe_read_kernel (CAP_PERFMON). Without either, the program is loaded with
    /// the check off, and a warning says so: segments that repeat delivered bytes are
    /// then forwarded whole.
    pub fn load(config: Config) -> Result<Ebpf, Error> {
        raise_memlock_limit();
        let offsets = match KernelOffsets::from_btf() {
            Ok(o) => Some(o),
            Err(e) => {
                warn!(error = %e, "kernel offsets unknown: the eBPF repeat check is off");
                None
            }
        };
        match (offsets, Ebpf::load_with(config.clone(), offsets)) {
            (Some(_), Err(e)) if e.refused_verdict() => {
                warn!(
                    error = %e.brief(),
                    "the kernel refused the stream verdict with the repeat check (it reads kernel \
                     memory: CAP_PERFMON, and the running kernel's BTF); loading it without: \
                     segments that repeat delivered bytes will be forwarded whole"
                );
                Ebpf::load_with(config, None)
            }
            // Anything else (the rewrite program, a map, the links) fails the same without
            // the check: its own error says what failed.
            (_, r) => r,
        }
    }

    fn load_with(config: Config, offsets: Option<KernelOffsets>) -> Result<Ebpf, Error> {
        let o = offsets.unwrap_or_default();
        let pod_port = u32::from(config.pod_port.unwrap_or(0));
        let mut loader = EbpfLoader::new();
        loader
            .map_max_entries(PEERS_MAP, config.max_sockets)
            .map_max_entries(SLOTS_MAP, config.max_sockets)
            .map_max_entries(FLOWS_MAP, config.max_sockets)
            // Two entries per connection rewritten, as two sockets per
            // connection in the SockHash.
            .map_max_entries(REWRITES_MAP, config.max_sockets)
            .map_max_entries(SIGNALS_MAP, config.signal_ring_bytes)
            .map_max_entries(ENDS_MAP, config.signal_ring_bytes)
            .override_global(SKB_SEQ_OFFSET, &o.skb_seq, true)
            .override_global(SKB_SK_OFFSET, &o.skb_sk, true)
            .override_global(TCP_COPIED_SEQ_OFFSET, &o.tcp_copied_seq, true)
            .override_global(SOCK_OPS_SK_OFFSET, &o.sock_ops_sk, true)
            .override_global(TCP_TSOFFSET_OFFSET, &o.tcp_tsoffset, true)
            .override_global(POD_PORT, &pod_port, true);
        #[cfg(any(test, feature = "test-hooks"))]
        let trim_limit = config.hooks.trim_limit;
        #[cfg(any(test, feature = "test-hooks"))]
        if let Some(limit) = &trim_limit {
            loader.override_global(waypoint_common::TRIM_LIMIT, limit, true);
        }
        let mut loaded = loader.load(OBJECT)?;
        let take = |loaded: &mut Loaded, name: &'static str| {
            loaded
                .take_map(name)
                .ok_or_else(|| map_error(name, "missing from the object"))
        };
        let peers: SockHash<MapData, u64> = take(&mut loaded, PEERS_MAP)?
            .try_into()
            .map_err(|e| map_error(PEERS_MAP, e))?;
        let slots: HashMap<MapData, u64, u32> = take(&mut loaded, SLOTS_MAP)?
            .try_into()
            .map_err(|e| map_error(SLOTS_MAP, e))?;
        let aya::maps::Map::Array(flows) = take(&mut loaded, FLOWS_MAP)? else {
            return Err(map_error(FLOWS_MAP, "not an array"));
        };
        let flows = FlowTable::new(flows, slots, config.max_sockets)?;
        let aya::maps::Map::PerCpuArray(stats) = take(&mut loaded, STATS_MAP)? else {
            return Err(map_error(STATS_MAP, "not a per-CPU array"));
        };
        // A second handle for the signal thread, which reads the count of lost signals.
        let stats_fd = stats.fd().as_fd().try_clone_to_owned()?;
        let signal_stats: PerCpuArray<MapData, u64> = aya::maps::Map::PerCpuArray(
            MapData::from_fd(stats_fd).map_err(|e| map_error(STATS_MAP, e))?,
        )
        .try_into()
        .map_err(|e| map_error(STATS_MAP, e))?;
        let stats: PerCpuArray<MapData, u64> = aya::maps::Map::PerCpuArray(stats)
            .try_into()
            .map_err(|e| map_error(STATS_MAP, e))?;
        let ring: RingBuf<MapData> = take(&mut loaded, SIGNALS_MAP)?
            .try_into()
            .map_err(|e| map_error(SIGNALS_MAP, e))?;
        let prog: &mut SkSkb = loaded
            .program_mut(VERDICT_PROG)
            .ok_or_else(|| map_error("program", "stream verdict missing from the object"))?
            .try_into()?;
        prog.load().map_err(Error::Verdict)?;
        prog.attach(peers.fd())?;
        let rewrite = if config.rewrite_splice {
            let map = take(&mut loaded, REWRITES_MAP)?;
            let mut ports: Array<MapData, u8> = take(&mut loaded, REWRITE_PORTS_MAP)?
                .try_into()
                .map_err(|e| map_error(REWRITE_PORTS_MAP, e))?;
            let aya::maps::Map::PerCpuArray(rstats) = take(&mut loaded, REWRITE_STATS_MAP)? else {
                return Err(map_error(REWRITE_STATS_MAP, "not a per-CPU array"));
            };
            let rstats: PerCpuArray<MapData, u64> = aya::maps::Map::PerCpuArray(rstats)
                .try_into()
                .map_err(|e| map_error(REWRITE_STATS_MAP, e))?;
            let fills: HashMap<MapData, RewriteKey, u32> = take(&mut loaded, REWRITE_FILLS_MAP)?
                .try_into()
                .map_err(|e| map_error(REWRITE_FILLS_MAP, e))?;
            let prog: &mut SchedClassifier = loaded
                .program_mut(REWRITE_PROG)
                .ok_or_else(|| map_error("program", "rewrite classifier missing from the object"))?
                .try_into()?;
            #[cfg(any(test, feature = "test-hooks"))]
            if config.hooks.refuse_rewrite {
                return Err(Error::Rewrite(aya::programs::ProgramError::SyscallError(
                    aya::sys::SyscallError {
                        call: "bpf_prog_load (refused by a test hook)",
                        io_error: io::Error::from_raw_os_error(libc::EINVAL),
                    },
                )));
            }
            rewrite::can_send_resets().map_err(Error::RawSocket)?;
            prog.load().map_err(Error::Rewrite)?;
            let dir = pin_rewrites(&config.pin_dir, prog, &map, &mut ports);
            let map: HashMap<MapData, RewriteKey, Rewrite> =
                map.try_into().map_err(|e| map_error(REWRITES_MAP, e))?;
            let records = match Records::attach(&mut loaded) {
                Ok(r) => Some(r),
                Err(e) => {
                    warn!(
                        error = %e,
                        "sockets' handshakes not recorded: the rewrite hand-over reads their \
                         sequence numbers with socket options (about 17 more system calls per \
                         connection)"
                    );
                    None
                }
            };
            let ends: RingBuf<MapData> = take(&mut loaded, ENDS_MAP)?
                .try_into()
                .map_err(|e| map_error(ENDS_MAP, e))?;
            let maps = rewrite::Maps {
                rewrites: map,
                ports,
                stats: rstats,
                fills,
            };
            Some((maps, ends, records, dir))
        } else {
            None
        };
        let loaded = Arc::new(Mutex::new(loaded));
        // Every interface, also the ones that appear later: the client's packets arrive
        // on the uplink, the pod's on its veth or the bridge (see `links.rs`).
        let (rewrite, ends) = match rewrite {
            Some((maps, ends, records, dir)) => (Some((maps, records, dir)), Some(ends)),
            None => (None, None),
        };
        let (links, rewrite) = match rewrite {
            Some((maps, records, dir)) => (
                Some(links::Links::start(
                    &loaded,
                    REWRITE_PROG,
                    attach_how(&config),
                    dir,
                )?),
                Some((maps, records)),
            ),
            None => (None, None),
        };
        let signals = Signals::start(ring, ends, signal_stats)?;
        let rewrite = match rewrite {
            Some((maps, records)) => {
                let rewriter = Arc::new(Rewriter::new(
                    maps,
                    signals.clone(),
                    #[cfg(any(test, feature = "test-hooks"))]
                    config.hooks.rewrite_handover_pause,
                    #[cfg(not(any(test, feature = "test-hooks")))]
                    None,
                    records,
                    config.pod_port,
                ));
                rewriter.start_sweeping().map_err(Error::Linger)?;
                Some(rewriter)
            }
            None => None,
        };
        info!(
            max_inflight = config.max_inflight,
            socket_buffer = ?config.socket_buffer,
            bulk_send_buffer = config.bulk_send_buffer,
            max_sockets = config.max_sockets,
            move_after = config.move_after,
            repeat_check = offsets.is_some(),
            rewrite_splice = config.rewrite_splice,
            "eBPF dataplane attached"
        );
        Ok(Ebpf {
            config,
            repeat_check: offsets.is_some(),
            peers: Mutex::new(peers),
            flows,
            stats,
            signals,
            fallbacks: AtomicU64::new(0),
            handovers: AtomicU64::new(0),
            tally: Tally::leak(Kind::Ebpf),
            rewrite,
            links,
            _loaded: loaded,
        })
    }

    /// The settings in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    pub(super) fn tally(&self) -> &'static Tally {
        self.tally
    }

    /// Whether the verdict cuts bytes that segments repeat (see [`Ebpf::load`]).
    pub fn repeat_check(&self) -> bool {
        self.repeat_check
    }

    /// Counts the entries of the per-socket maps (walks them: diagnostics only).
    pub fn map_counts(&self) -> MapCounts {
        MapCounts {
            peers: lock(&self.peers).keys().count(),
            slots: self.flows.slot_entries(),
            flows: self.flows.in_use(),
        }
    }

    /// The verdict program's statistics, summed over CPUs, in [`Stat::ALL`] order.
    pub fn stats(&self) -> Vec<(Stat, u64)> {
        Stat::ALL
            .iter()
            .map(|&s| (s, per_cpu_total(&self.stats, s as u32)))
            .collect()
    }

    /// Signals read from the verdict's ring, and times every waiting connection was woken
    /// because some were lost (see `signals.rs`).
    pub fn signals(&self) -> (u64, u64) {
        (self.signals.received(), self.signals.sweeps())
    }

    /// Leaves the rewritten connections to the next daemon, where the program is pinned
    /// (see `adopt.rs`): each returns with its socket to the pod (B) put aside, its
    /// entries and the program left in place. Whether it does: not without pins (they
    /// then end at the drain deadline as any connection), nor without a connection to
    /// leave (the program then goes with the daemon, as on a node the waypoint leaves).
    pub fn leave(&self) -> bool {
        let (Some(r), Some(l)) = (&self.rewrite, &self.links) else {
            return false;
        };
        if !l.pinned() || !r.has_connections() {
            return false;
        }
        l.leave();
        r.leave();
        true
    }

    /// After [`Ebpf::leave`]: waits (up to `within`) until every rewritten connection has
    /// put its B aside, offers the Bs to the program's adopter (`handoff.rs`), lets go of
    /// the program's owner name so that another daemon adopts it, and waits for one for
    /// what is left of `within`. The sockets an adopter took; None if none came (the
    /// Bs then close with this process, and the adopter binds their ports again).
    pub fn pass_on(&self, within: Duration) -> Option<usize> {
        let (Some(r), Some(l)) = (&self.rewrite, &self.links) else {
            return None;
        };
        let deadline = Instant::now() + within;
        while !r.all_left() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let sockets = r.take_left();
        let offer = match handoff::Offer::listen(l.prog_id()) {
            Ok(o) => Some(o),
            Err(e) => {
                warn!(error = %e, "offering the rewritten connections' sockets to the next daemon failed: it holds their ports itself");
                None
            }
        };
        l.release_owner();
        let offer = offer?;
        match offer.give(&sockets, deadline.saturating_duration_since(Instant::now())) {
            Ok(true) => Some(sockets.len()),
            Ok(false) => None,
            Err(e) => {
                warn!(error = %e, "handing the rewritten connections' sockets to the next daemon failed: it holds their ports itself");
                None
            }
        }
    }

    /// The rewrite splice's counters and the program's statistics (in
    /// [`RewriteStat::ALL`] order); None without `rewrite_splice`.
    pub fn rewrite_counts(&self) -> Option<(rewrite::Counts, Vec<(RewriteStat, u64)>)> {
        self.rewrite.as_ref().map(|r| (r.counts(), r.stats()))
    }

    /// Marks a listener, for the sockets it accepts, for the rewrite hand-over (see
    /// `established.rs`); nothing without the rewrite splice.
    pub fn mark_listener(&self, listener: BorrowedFd<'_>) {
        if let Some(r) = &self.rewrite {
            r.mark(listener);
        }
    }

    /// Marks a socket about to connect to `port` for the rewrite hand-over, unless the
    /// kernel records it anyway ([`Config::pod_port`]).
    pub fn mark_dial(&self, socket: BorrowedFd<'_>, port: u16) {
        if let Some(r) = &self.rewrite {
            r.mark_dial(socket, port);
        }
    }

    /// The rewrite program's attachments to the interfaces; None without the rewrite
    /// splice.
    pub fn rewrite_links(&self) -> Option<links::LinkCounts> {
        self.links.as_ref().map(links::Links::counts)
    }

    /// Entries in the rewrite map (walks it: tests and diagnostics); 0 without it.
    pub fn rewrite_entries(&self) -> usize {
        self.rewrite.as_deref().map_or(0, Rewriter::entries)
    }

    /// Elements in the rewrite program's fill map (walks it: tests and diagnostics): hand-
    /// overs whose B still waits for the pod to acknowledge what it carried for the client.
    pub fn rewrite_fills(&self) -> usize {
        self.rewrite.as_deref().map_or(0, Rewriter::fills)
    }

    /// The rewrite splice, for its own tests.
    #[cfg(test)]
    pub(super) fn rewriter(&self) -> Option<&Arc<Rewriter>> {
        self.rewrite.as_ref()
    }

    /// The rewrite is on (`--rewrite-splice`, and the kernel took its program).
    pub fn rewrites(&self) -> bool {
        self.rewrite.is_some()
    }

    /// See [`super::Dataplane::forward`]: the rewrite splice for a connection it can
    /// take (see `rewrite.rs`), else [`Ebpf::forward_sockmap`].
    pub fn forward(
        self: &Arc<Self>,
        downstream: Socket,
        upstream: Socket,
        initial: Vec<u8>,
        limits: Limits,
    ) -> impl Future<Output = Result<Outcome, Error>> + Send + 'static {
        if self.rewrite.is_none() {
            let dp = Arc::clone(self);
            return Either::Left(futures::TryFutureExt::and_then(
                futures::future::ready(
                    Socket::register_both(downstream, upstream).map_err(Error::from),
                ),
                move |(down, up)| dp.forward_sockmap(down, up, initial, limits, None),
            ));
        }
        let dp = Arc::clone(self);
        Either::Right(Rewriting::HandOver {
            fut: Box::pin(async move {
                let sockmap = |downstream, upstream, initial, why| match Socket::register_both(
                    downstream, upstream,
                ) {
                    Ok((down, up)) => HandOver::Sockmap(Box::pin(
                        dp.forward_sockmap(down, up, initial, limits, why),
                    )),
                    Err(e) => HandOver::Ended(Outcome {
                        downstream_to_upstream: 0,
                        upstream_to_downstream: 0,
                        end: End::Error(e.kind()),
                    }),
                };
                let Some(rewriter) = dp.rewrite.clone() else {
                    return sockmap(downstream, upstream, initial, None);
                };
                match rewriter.hand_over(downstream, upstream, initial).await {
                    Ok(Ok(handed)) => {
                        dp.tally.took(Taken::Rewritten);
                        HandOver::Rewritten(rewrite::Rewritten::new(rewriter, handed, limits))
                    }
                    Ok(Err(e)) => HandOver::Ended(Outcome {
                        downstream_to_upstream: 0,
                        upstream_to_downstream: 0,
                        end: End::Error(e.kind()),
                    }),
                    Err(refused) => sockmap(
                        refused.downstream,
                        refused.upstream,
                        refused.initial,
                        Some(refused.reason),
                    ),
                }
            }),
        })
    }

    /// Stops the signal thread from reading the ring, or lets it go on.
    #[cfg(test)]
    fn pause_signals(&self, paused: bool) {
        self.signals.pause(paused);
    }

    /// Connections served by the userspace copy because a socket could not enter the
    /// SockHash (already half-closed when routed).
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks.load(Relaxed)
    }

    /// Connections that carried `move_after` bytes in the copy they started in and went
    /// on to enter the SockHash. Those that then could not enter are counted in
    /// [`Ebpf::fallbacks`] as well; connections that end below the threshold in neither.
    pub fn handovers(&self) -> u64 {
        self.handovers.load(Relaxed)
    }
}

impl Drop for Ebpf {
    /// Stops and joins the dataplane's threads (the links thread as `links` drops).
    fn drop(&mut self) {
        self.signals.stop();
        if let Some(rewriter) = &self.rewrite {
            rewriter.stop();
        }
    }
}

/// Creates the rewrite program's directory in bpffs, pins its map there (see
/// `pins.rs`), and marks the program as pinned ([`PORTS_PINNED`]): the daemon that
/// finds its netlink filter with no owner leaves it to the adopter. Without bpffs (or a
/// writable one) the daemon's rewritten connections end with it: logged, and None.
fn pin_rewrites(
    root: &std::path::Path,
    prog: &SchedClassifier,
    map: &aya::maps::Map,
    ports: &mut Array<MapData, u8>,
) -> Option<pins::ProgramDir> {
    let pinned = prog
        .info()
        .map_err(|e| e.to_string())
        .and_then(|info| pins::ProgramDir::create(root, info.id()).map_err(|e| e.to_string()))
        .and_then(|dir| {
            map.pin(dir.path().join(pins::REWRITES_PIN))
                .map(|()| dir)
                .map_err(|e| e.to_string())
        })
        .and_then(|dir| {
            ports
                .set(0, PORTS_PINNED, 0)
                .map(|()| dir)
                .map_err(|e| format!("marking the program as pinned: {e}"))
        });
    match pinned {
        Ok(dir) => Some(dir),
        Err(e) => {
            warn!(error = %e, dir = %root.display(),
                "the rewrite map could not be pinned: rewritten connections end with the daemon");
            None
        }
    }
}

/// How the rewrite program is attached: what the kernel offers, unless a test asks for
/// the netlink attachment of kernels without TCX.
fn attach_how(config: &Config) -> links::Attach {
    #[cfg(any(test, feature = "test-hooks"))]
    if config.hooks.tc_netlink {
        return links::Attach::Netlink;
    }
    let _ = config;
    links::Attach::native()
}

/// Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK; later ones to the memory cgroup.
fn raise_memlock_limit() {
    if let Err(e) = crate::sys::raise_memlock_limit() {
        debug!("could not raise RLIMIT_MEMLOCK: {e}");
    }
}

mod direction;
mod sockhash;
#[cfg(test)]
mod tests;
