//! Moving the bytes of one routed connection between the downstream socket (accepted on
//! the tunnel port) and the upstream socket (dialed to a pod's `:15008`), in both
//! directions, until both sides are done.
//!
//! Three implementations sit behind one API ([`Dataplane::forward`]):
//! - [`ebpf`]: the kernel moves the bytes (SockHash + SK_SKB stream verdict);
//! - [`splice`]: splice(2) through a pipe per direction, driven by tokio readiness;
//! - [`copy`]: a portable userspace copy.
//!
//! They share the connection semantics implemented in [`drive`]: a FIN from one side is
//! passed on as a half-close to the other only after every byte before it; a reset from
//! one side aborts the other; an idle or over-age connection is closed. A connection that
//! holds bytes and makes no progress is counted and logged once ([`stall`]).

pub mod adopt;
mod background;
mod bpf_cmd;
mod btf;
pub mod choice;
pub mod clsact;
pub mod copy;
pub mod ebpf;
mod established;
mod flows;
mod handoff;
pub mod links;
mod orphans;
mod park;
pub mod pins;
#[cfg(test)]
mod program_runs;
pub mod rewrite;
mod send_buffer;
mod signals;
mod socket_io;
pub mod splice;
mod stall;
mod tally;
mod watch;

pub use stall::DEFAULT_STALL_AFTER;
pub use tally::Taken;

pub(crate) use crate::sys::{queued, tcp_info, unsent_or_unacked};
pub(crate) use socket_io::{read_now, write_all, write_now};

use std::{
    future::Future,
    io,
    os::fd::AsFd,
    pin::{pin, Pin},
    time::{Duration, Instant},
};
use tracing::debug;

use futures::future::{Either, TryFutureExt as _};
use tokio::net::TcpStream;

/// Which implementation moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// In the kernel: SockHash + SK_SKB stream verdict redirect (needs CAP_BPF, CAP_NET_ADMIN; CAP_PERFMON for the repeat check).
    Ebpf,
    /// splice(2) through pipes: zero-copy in the kernel, driven from userspace.
    Splice,
    /// Userspace read/write copy: portable, slowest.
    Copy,
    /// The fastest the kernel takes: eBPF with the rewrite splice (each connection rewritten
    /// where it qualifies, else redirected), eBPF without it, splice.
    Auto,
}

impl Kind {
    /// The label used in logs and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Kind::Ebpf => "ebpf",
            Kind::Splice => "splice",
            Kind::Copy => "copy",
            Kind::Auto => "auto",
        }
    }
}

/// Limits applied to every forwarded connection.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Close a connection when no byte moved in either direction for this long (see
    /// [`forced_end`] for how).
    pub idle_timeout: Duration,
    /// Close a connection this long after it started, whatever it is doing (None: never;
    /// see [`forced_end`]).
    pub max_lifetime: Option<Duration>,
    /// Park a connection in the copy (the copy dataplane, or the eBPF dataplane before
    /// `--move-after`) once no byte moved for this long (None: never). See [`park`].
    pub park_after: Option<Duration>,
    /// Count and log a connection that holds bytes between its peers, none of which
    /// moved for this long, towards a destination that waits on nothing (None: never).
    /// See [`stall`].
    pub stall_after: Option<Duration>,
}

/// Default for [`Limits::park_after`].
pub const DEFAULT_PARK_AFTER: Duration = Duration::from_millis(100);

impl Default for Limits {
    fn default() -> Self {
        Limits {
            idle_timeout: Duration::from_secs(3600),
            max_lifetime: None,
            park_after: Some(DEFAULT_PARK_AFTER),
            stall_after: Some(DEFAULT_STALL_AFTER),
        }
    }
}

impl Limits {
    /// How often a connection's idle check runs (the idle timeout, and the stall
    /// watchdog): a quarter of the idle timeout and half the stall window, but at least
    /// every 5 s and at most every 10 ms. The idle timeout then fires within 25 % of its
    /// setting, and a stall is counted between one and two windows after its counts
    /// last moved (the window starts at the first check that finds them still).
    pub(crate) fn check_every(&self) -> Duration {
        let idle = self.idle_timeout / 4;
        let stall = self.stall_after.map_or(idle, |s| s / 2);
        idle.min(stall)
            .clamp(Duration::from_millis(10), Duration::from_secs(5))
    }
}

/// How a forwarded connection ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// Both sides sent FIN and every byte was delivered to the other side's TCP.
    Closed,
    /// The downstream peer reset; the upstream was aborted.
    DownstreamReset,
    /// The upstream peer reset; the downstream was aborted.
    UpstreamReset,
    /// Nothing moved for `idle_timeout`; both sides were closed.
    IdleTimeout,
    /// The connection outlived `max_lifetime`; both sides were closed.
    LifetimeExceeded,
    /// A local I/O error other than a reset; both sides were aborted.
    Error(io::ErrorKind),
    /// Bytes the kernel will not hand on were held for `stall_after`: a repeat the
    /// verdict could not cut left the socket's count of read bytes ahead of what it
    /// read, so the kernel holds back arriving bytes (see docs/ARCHITECTURE.md, "repeat
    /// check"). Both sides were aborted.
    Stranded,
    /// The daemon left: a rewritten connection, handed to the next daemon with its
    /// program (see `dataplane/adopt.rs`), and still open.
    HandedOver,
}

impl End {
    /// A short label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            End::Closed => "closed",
            End::DownstreamReset => "downstream_reset",
            End::UpstreamReset => "upstream_reset",
            End::IdleTimeout => "idle_timeout",
            End::LifetimeExceeded => "lifetime_exceeded",
            End::Error(_) => "error",
            End::Stranded => "stranded",
            End::HandedOver => "handed_over",
        }
    }
}

/// What [`Dataplane::forward`] resolves with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// Bytes delivered from downstream to upstream, including the initial bytes.
    pub downstream_to_upstream: u64,
    /// Bytes delivered from upstream to downstream.
    pub upstream_to_downstream: u64,
    /// How the connection ended.
    pub end: End,
}

/// Errors setting up a forwarded connection (before any byte moved).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The eBPF dataplane could not register the sockets.
    #[error("ebpf dataplane: {0}")]
    Ebpf(#[from] ebpf::Error),
    /// A socket option or pipe could not be set up.
    #[error("dataplane setup: {0}")]
    Io(#[from] io::Error),
}

/// A dataplane's idle connections parked outside tokio (see [`park`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Parking {
    /// Parked now.
    pub parked: usize,
    /// Parkings so far.
    pub parks: u64,
    /// Parkings that failed (the connection stayed in tokio; logged at debug).
    pub failures: u64,
}

/// Starts the process's parker (an epoll set, an eventfd and a thread), which serves
/// connections off single-threaded runtimes, now rather than at the first idle
/// connection, so that its descriptors are there from the start. False if it cannot
/// start: then no such connection is parked (logged). (A single-threaded runtime, such
/// as a tunnel worker's, starts its own parker at its first parking.)
pub fn start_parking() -> bool {
    park::Parker::process().is_some()
}

/// The dataplane chosen at start.
pub enum Dataplane {
    /// See [`ebpf`].
    Ebpf(std::sync::Arc<ebpf::Ebpf>),
    /// See [`splice`].
    Splice(splice::Splice),
    /// See [`copy`].
    Copy(copy::UserspaceCopy),
}

impl Dataplane {
    /// Which implementation this is.
    pub fn kind(&self) -> Kind {
        match self {
            Dataplane::Ebpf(_) => Kind::Ebpf,
            Dataplane::Splice(_) => Kind::Splice,
            Dataplane::Copy(_) => Kind::Copy,
        }
    }

    /// Leaves the rewritten connections to the next daemon (see [`ebpf::Ebpf::leave`]);
    /// whether there were any to leave (only the eBPF dataplane rewrites).
    pub fn leave(&self) -> bool {
        matches!(self, Dataplane::Ebpf(e) if e.leave())
    }

    /// After [`Dataplane::leave`]: hands the rewritten connections to the next daemon
    /// (see [`ebpf::Ebpf::pass_on`]); the sockets it took, None if none came.
    pub fn pass_on(&self, within: std::time::Duration) -> Option<usize> {
        match self {
            Dataplane::Ebpf(e) => e.pass_on(within),
            _ => None,
        }
    }

    fn tally(&self) -> &'static tally::Tally {
        match self {
            Dataplane::Ebpf(e) => e.tally(),
            Dataplane::Splice(s) => s.tally(),
            Dataplane::Copy(c) => c.tally(),
        }
    }

    /// Connections this dataplane counted as stalled so far (see [`stall`]; each once,
    /// and logged at warn). The eBPF dataplane's copy phase and fallback count here too.
    pub fn stalls(&self) -> u64 {
        self.tally().stalls()
    }

    /// Times this dataplane woke the kernel's backlog of a socket in the SockHash that
    /// held redirected bytes and sent none (see [`crate::sys::wake_writer`]): kernels
    /// without the 2023 sockmap fixes (Linux 6.4; 6.1.32) leave such a backlog asleep. Zero
    /// but for the eBPF dataplane.
    pub fn backlog_wakeups(&self) -> u64 {
        self.tally().wakeups()
    }

    /// Connections by the path they took and why (see [`Taken`]): every path this
    /// dataplane can take, zeros included.
    pub fn paths(&self) -> Vec<(Taken, u64)> {
        let rewrite = matches!(self, Dataplane::Ebpf(e) if e.rewrites());
        let applies = |t: &Taken| match (self, t) {
            (Dataplane::Splice(_), t) => *t == Taken::Spliced,
            (Dataplane::Copy(_), t) => *t == Taken::Copied,
            (Dataplane::Ebpf(_), Taken::Rewritten) => rewrite,
            (Dataplane::Ebpf(_), Taken::Redirected(why)) => why.is_some() == rewrite,
            (Dataplane::Ebpf(_), Taken::CopiedShort | Taken::CopiedFallback) => true,
            (Dataplane::Ebpf(_), Taken::Spliced | Taken::Copied) => false,
        };
        self.tally()
            .taken()
            .into_iter()
            .filter(|(t, _)| applies(t))
            .collect()
    }

    /// This dataplane's parked connections' counts; all zero before its first parking.
    pub fn parking(&self) -> Parking {
        self.tally().parking()
    }

    /// Tells the dataplane about a listener whose accepted sockets it will forward,
    /// before they arrive: the rewrite splice has the kernel record the sequence numbers
    /// of such sockets at their handshake (see `dataplane/established.rs`), which spares
    /// the hand-over reading them. Optional: a socket not marked is read at the
    /// hand-over instead.
    pub fn mark_listener(&self, listener: std::os::fd::BorrowedFd<'_>) {
        if let Dataplane::Ebpf(e) = self {
            e.mark_listener(listener);
        }
    }

    /// As [`Dataplane::mark_listener`], for a socket about to connect to a pod on
    /// `port`.
    pub fn mark_dial(&self, socket: std::os::fd::BorrowedFd<'_>, port: u16) {
        if let Dataplane::Ebpf(e) = self {
            e.mark_dial(socket, port);
        }
    }

    /// Moves bytes between `downstream` and `upstream` until both directions are done.
    ///
    /// `initial` holds bytes already read from downstream (the ClientHello): they are
    /// delivered to upstream first, before anything else from downstream.
    ///
    /// Not an `async fn`: that would store the arguments once more in every connection's
    /// task, on top of the chosen dataplane's future that holds them anyway. The future
    /// borrows nothing, so a connection's task can hold it without an `async` block
    /// (which would keep the arguments it moved into it for the connection's life).
    pub fn forward(
        &self,
        downstream: Socket,
        upstream: Socket,
        initial: Vec<u8>,
        limits: Limits,
    ) -> impl Future<Output = Result<Outcome, Error>> + Send + 'static {
        match self {
            Dataplane::Ebpf(d) => Either::Left(
                d.forward(downstream, upstream, initial, limits)
                    .map_err(Error::from),
            ),
            // Boxed: its state (two pumps with pipes, 1.4 KB) would otherwise size every
            // connection's task, whichever dataplane runs.
            Dataplane::Splice(d) => {
                d.tally().took(tally::Taken::Spliced);
                let d = d.clone();
                Either::Right(Either::Left(
                    Box::pin(async move {
                        let (downstream, upstream) = Socket::register_both(downstream, upstream)?;
                        d.forward(downstream, upstream, initial, limits).await
                    })
                    .map_err(Error::from),
                ))
            }
            Dataplane::Copy(d) => {
                d.tally().took(tally::Taken::Copied);
                let d = d.clone();
                Either::Right(Either::Right(
                    futures::future::ready(Socket::register_both(downstream, upstream))
                        .and_then(move |(down, up)| d.forward(down, up, initial, limits))
                        .map_err(Error::from),
                ))
            }
        }
    }
}

/// How one direction ended, as seen by the pump reading its source.
#[derive(Debug)]
pub(crate) enum DirEnd {
    /// The source sent FIN; the pump delivered every byte and shut the destination's
    /// write side.
    Eof,
    /// The source reset (ECONNRESET and friends) while being read.
    SourceReset,
    /// The destination reset while being written.
    DestReset,
    /// Any other I/O error, on either socket.
    Error(io::Error),
}

fn is_reset(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

/// Classifies an I/O error from reading the source socket.
pub(crate) fn classify_read_error(e: io::Error) -> DirEnd {
    if is_reset(&e) {
        DirEnd::SourceReset
    } else {
        DirEnd::Error(e)
    }
}

/// Classifies an I/O error from writing the destination socket.
pub(crate) fn classify_write_error(e: io::Error) -> DirEnd {
    if is_reset(&e) {
        DirEnd::DestReset
    } else {
        DirEnd::Error(e)
    }
}

/// Makes the next close of `sock` send RST instead of FIN (SO_LINGER with zero timeout).
pub(crate) fn abort_on_close(sock: &impl AsFd) {
    // Failure only means the peer sees FIN instead of RST; nothing better to do.
    let _ = socket2::SockRef::from(sock).set_linger(Some(Duration::ZERO));
}

/// A connection as the router hands it over: registered with tokio's reactor only if
/// the router had to wait on it. The client's hello is usually whole when its connection
/// is accepted (the listener defers the accept until data came), and a pod on this node
/// answers inside `connect(2)`; the rewrite splice never waits on either socket:
/// registering them and taking them out again would cost that path four `epoll_ctl`
/// calls and two reactor slots per connection. The paths that wait on a socket register
/// it ([`Socket::into_tokio`]).
#[derive(Debug)]
pub enum Socket {
    /// Connected, nonblocking, not registered.
    Ready(std::net::TcpStream),
    /// Registered with the reactor of the runtime it was created in.
    Registered(TcpStream),
}

impl Socket {
    /// The socket registered with the current runtime's reactor (which must exist: the
    /// dataplanes run in the worker's runtime).
    pub fn into_tokio(self) -> io::Result<TcpStream> {
        match self {
            Socket::Ready(s) => TcpStream::from_std(s),
            Socket::Registered(s) => Ok(s),
        }
    }

    /// Both sockets registered (see [`Socket::into_tokio`]).
    pub fn register_both(a: Socket, b: Socket) -> io::Result<(TcpStream, TcpStream)> {
        Ok((a.into_tokio()?, b.into_tokio()?))
    }

    /// The socket out of the reactor (a registered one is taken out of it).
    pub fn into_std(self) -> io::Result<std::net::TcpStream> {
        match self {
            Socket::Ready(s) => Ok(s),
            Socket::Registered(s) => s.into_std(),
        }
    }

    /// Writes all of `buf`: what the socket takes at once, the rest as it drains. An
    /// unregistered socket is registered only while it has to be waited for, and stays
    /// the caller's whatever happens (the rewrite hand-over must silence it before it
    /// closes).
    pub(crate) async fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        match self {
            Socket::Registered(s) => socket_io::write_all(s, buf).await,
            Socket::Ready(s) => socket_io::write_all_unregistered(s, buf).await,
        }
    }
}

impl From<TcpStream> for Socket {
    fn from(s: TcpStream) -> Socket {
        Socket::Registered(s)
    }
}

impl std::os::fd::AsRawFd for Socket {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.as_fd().as_raw_fd()
    }
}

impl AsFd for Socket {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            Socket::Ready(s) => s.as_fd(),
            Socket::Registered(s) => s.as_fd(),
        }
    }
}

/// `TCP_ESTABLISHED` from include/net/tcp_states.h (`tcp_info::tcpi_state`).
pub(crate) const TCP_ESTABLISHED: u8 = 1;
/// `TCP_CLOSE`: the state of a reset or aborted socket.
pub(crate) const TCP_CLOSE: u8 = 7;
const TCP_FIN_WAIT1: u8 = 4;
const TCP_FIN_WAIT2: u8 = 5;
const TCP_TIME_WAIT: u8 = 6;
/// `TCP_CLOSE_WAIT`: the peer's FIN received.
pub(crate) const TCP_CLOSE_WAIT: u8 = 8;
const TCP_LAST_ACK: u8 = 9;
const TCP_CLOSING: u8 = 11;

/// The socket's FIN is queued or sent: it counts one sequence number in what its TCP
/// took from its writers (`tcpi_bytes_acked` + SIOCOUTQ).
pub(crate) fn fin_sent(state: u8) -> bool {
    matches!(
        state,
        TCP_FIN_WAIT1 | TCP_FIN_WAIT2 | TCP_TIME_WAIT | TCP_LAST_ACK | TCP_CLOSING
    )
}

/// The peer's FIN arrived: it counts one in `tcpi_bytes_received`.
fn fin_received(state: u8) -> bool {
    matches!(
        state,
        TCP_CLOSE_WAIT | TCP_LAST_ACK | TCP_CLOSING | TCP_TIME_WAIT
    )
}

/// What a socket's TCP received from its peer and took from its writers over its life,
/// FINs and SYN taken out.
struct Carried {
    received: u64,
    taken: u64,
}

impl Carried {
    /// `dialed`: the socket connected (its SYN counts one in `tcpi_bytes_acked`; an
    /// accepted socket's SYN-ACK does not).
    fn of(sock: &impl AsFd, dialed: bool) -> io::Result<Carried> {
        // TCP_INFO first, SIOCOUTQ second, as in `ebpf::handed`: the sum understates at
        // worst, which reads as held.
        let info = tcp_info(sock)?;
        let outq = unsent_or_unacked(sock)?;
        Carried::from_info(&info, outq, dialed)
    }

    /// As [`Carried::of`], from the socket's `TCP_INFO` and then its SIOCOUTQ.
    fn from_info(info: &libc::tcp_info, outq: u64, dialed: bool) -> io::Result<Carried> {
        let state = info.tcpi_state;
        if state == TCP_CLOSE {
            return Err(io::ErrorKind::NotConnected.into());
        }
        Ok(Carried {
            received: info
                .tcpi_bytes_received
                .saturating_sub(u64::from(fin_received(state))),
            taken: (info.tcpi_bytes_acked + outq)
                .saturating_sub(u64::from(fin_sent(state)) + u64::from(dialed)),
        })
    }
}

/// Whether bytes are held between the two peers: received by one side's TCP and not
/// (yet) taken by the other side's, whether they wait unread in a socket, in the
/// daemon's buffers, a pipe or the kernel's redirect backlog. Every byte one peer sends
/// is forwarded to the other, the ClientHello included, so over the connection's life
/// the two counts meet once nothing is on the way. `downstream` was accepted,
/// `upstream` dialed, as the router does. Unknown (a socket reset, or a failed read)
/// counts as held.
pub(crate) fn holds_bytes(downstream: &impl AsFd, upstream: &impl AsFd) -> bool {
    match (Carried::of(downstream, false), Carried::of(upstream, true)) {
        (Ok(d), Ok(u)) => d.received > u.taken || u.received > d.taken,
        _ => true,
    }
}

/// A forced end (idle timeout, lifetime): both sides close with FIN when nothing is on
/// the way between them, and are reset otherwise. A FIN behind bytes that will never
/// arrive would tell the peer that the stream it got was whole.
pub(crate) fn forced_end(end: End, downstream: &impl AsFd, upstream: &impl AsFd) -> End {
    if holds_bytes(downstream, upstream) {
        debug!(
            end = end.as_str(),
            "bytes held between the peers: both reset"
        );
        abort_on_close(downstream);
        abort_on_close(upstream);
    }
    end
}

/// The socket closes with RST (see [`abort_on_close`]).
pub(crate) fn resets_on_close(sock: &impl AsFd) -> bool {
    socket2::SockRef::from(sock)
        .linger()
        .is_ok_and(|l| l == Some(Duration::ZERO))
}

/// Shuts the write side of `sock` (sends FIN after everything queued).
pub(crate) fn shutdown_write(sock: &impl AsFd) -> io::Result<()> {
    match socket2::SockRef::from(sock).shutdown(std::net::Shutdown::Write) {
        // The peer already went away: its reset is reported by the other direction.
        Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(()),
        r => r,
    }
}

/// Runs both directions of one connection to completion with the shared semantics:
/// half-closes pass through, a reset on one side aborts the other, idle and lifetime
/// limits close both.
///
/// `down_to_up` reads downstream and writes upstream, `up_to_down` the reverse.
/// `progress` returns a number that grows whenever bytes move (used for the idle timer);
/// it is only called every few seconds at most. `watchdog` runs the connection's stall
/// watchdog ([`stall::Watchdog::check`]) at each idle check, told whether `progress`
/// moved since the last one. Both sockets are closed by the caller dropping them; this
/// function only arranges *how* (FIN or RST).
///
/// The directions come pinned by the caller: taken by value, each would be stored twice
/// in this future (as the argument, and pinned), which was a third of the memory of an
/// idle connection.
async fn drive<A, B>(
    downstream: &impl AsFd,
    upstream: &impl AsFd,
    limits: Limits,
    mut down_to_up: Pin<&mut A>,
    mut up_to_down: Pin<&mut B>,
    progress: impl Fn() -> u64,
    mut watchdog: impl FnMut(Instant, bool) -> Option<End>,
) -> End
where
    A: Future<Output = DirEnd>,
    B: Future<Output = DirEnd>,
{
    let mut d2u_done = false;
    let mut u2d_done = false;

    let tick = limits.check_every();
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + tick, tick);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_progress = progress();
    let mut last_change = Instant::now();
    // Only polled when there is a lifetime limit.
    let deadline = tokio::time::sleep(limits.max_lifetime.unwrap_or(Duration::ZERO));
    let mut deadline = pin!(deadline);

    // A reset on one side is passed on as an abort of the other: both sockets close
    // with RST when the caller drops them.
    let reset = |end: End| {
        abort_on_close(downstream);
        abort_on_close(upstream);
        end
    };
    let fail = |e: &io::Error| {
        abort_on_close(downstream);
        abort_on_close(upstream);
        End::Error(e.kind())
    };

    loop {
        tokio::select! {
            r = &mut down_to_up, if !d2u_done => match r {
                DirEnd::Eof => d2u_done = true,
                DirEnd::SourceReset => return reset(End::DownstreamReset),
                DirEnd::DestReset => return reset(End::UpstreamReset),
                DirEnd::Error(e) => return fail(&e),
            },
            r = &mut up_to_down, if !u2d_done => match r {
                DirEnd::Eof => u2d_done = true,
                DirEnd::SourceReset => return reset(End::UpstreamReset),
                DirEnd::DestReset => return reset(End::DownstreamReset),
                DirEnd::Error(e) => return fail(&e),
            },
            _ = &mut deadline, if limits.max_lifetime.is_some() => {
                return forced_end(End::LifetimeExceeded, downstream, upstream);
            }
            _ = ticker.tick() => {
                let now = Instant::now();
                let count = progress();
                let moved = count != last_progress;
                if moved {
                    last_progress = count;
                    last_change = now;
                } else if now.duration_since(last_change) >= limits.idle_timeout {
                    return forced_end(End::IdleTimeout, downstream, upstream);
                }
                if let Some(end) = watchdog(now, moved) {
                    return reset(end);
                }
            }
        }
        if d2u_done && u2d_done {
            return End::Closed;
        }
    }
}
