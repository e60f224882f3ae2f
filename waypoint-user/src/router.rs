//! The tunnel listener: accepts connections on `<node_ip>:<tunnel-port>`, reads the
//! cleartext ClientHello, routes on its structured SNI to a ready pod of an exported
//! service in this cluster, dials the pod's `:15008`, and hands both sockets and the
//! bytes read so far to the dataplane. It never terminates TLS and never rewrites a byte.
//!
//! Every connection that does not reach a pod is closed and counted under one reason
//! (`waypoint_connections_rejected_total{reason}`), with rate-limited logs; a rejection
//! only ever touches its own connection.

pub mod metrics;
pub mod route;

use std::{
    collections::HashMap,
    future::Future,
    net::SocketAddr,
    pin::Pin,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    task::{ready, Context, Poll},
    time::{Duration, Instant},
};

use bytes::BytesMut;
use futures::{future::Either, FutureExt as _};
use prometheus_client::metrics::gauge::Gauge;
use tokio::{
    io::unix::AsyncFd,
    net::{TcpListener, TcpSocket, TcpStream},
};
use tokio_util::{
    sync::{CancellationToken, WaitForCancellationFutureOwned},
    task::TaskTracker,
};
use tracing::{debug, info, warn, Instrument as _};

use crate::{
    dataplane::{self, Dataplane, Limits, Outcome, Socket},
    sni,
    store::Store,
};

pub use metrics::Metrics;
pub use route::{Balancer, NoRoute, Policy, Scope};

/// Settings of the router (derived from [`crate::config::Config`]).
#[derive(Clone, Debug)]
pub struct Config {
    /// The mesh domain every routable SNI ends with.
    pub mesh_domain: String,
    /// The pods' inbound port: the only port ever dialed.
    pub pod_port: u16,
    /// Deadline for the whole ClientHello to arrive.
    pub hello_timeout: Duration,
    /// Largest ClientHello accepted, in bytes.
    pub max_hello_bytes: usize,
    /// Deadline for one upstream connect.
    pub connect_timeout: Duration,
    /// Upstream connect attempts per connection (each to a different pod).
    pub connect_attempts: u32,
    /// Routed plus pending connections beyond which new ones are refused.
    pub max_connections: usize,
    /// Connections still sending their hello beyond which new ones are refused.
    pub max_pending_handshakes: usize,
    /// Which pods this waypoint may route to.
    pub policy: Policy,
    /// Per-connection limits for the dataplane.
    pub limits: Limits,
}

/// A listening socket that a new daemon can bind while the old one still drains
/// (SO_REUSEPORT, same user only): a rolling update with overlap must not fail on
/// "address in use", and the old daemon stops accepting as soon as it drains. The tunnel
/// listeners are bound in [`crate::workers`], the same way.
pub(crate) fn listen(addr: SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}

/// Connects to `addr`. A pod on this node (behind loopback or a veth) completes the
/// handshake inside the `connect` call, which returns EINPROGRESS all the same; one
/// TCP_INFO read then spares the wait for writability that tokio's `connect` makes:
/// another turn of the worker's event loop, and an SO_ERROR read, per connection.
/// The socket is registered with the reactor only if it had to be waited for (see
/// [`Socket`]). The dataplane sees it before the handshake ([`Dataplane::mark_dial`]).
async fn connect(addr: SocketAddr, dataplane: &Dataplane) -> std::io::Result<Socket> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM.nonblocking().cloexec(),
        None,
    )?;
    dataplane.mark_dial(std::os::fd::AsFd::as_fd(&socket), addr.port());
    match socket.connect(&addr.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {
            if crate::sys::tcp_info(&socket)?.tcpi_state != dataplane::TCP_ESTABLISHED {
                let stream = TcpStream::from_std(socket.into())?;
                stream.writable().await?;
                if let Some(e) = stream.take_error()? {
                    return Err(e);
                }
                return Ok(Socket::Registered(stream));
            }
        }
        Err(e) => return Err(e),
    }
    Ok(Socket::Ready(socket.into()))
}

/// Accepts one connection from `listener`: nonblocking and close-on-exec from the
/// `accept4` call, and not registered with the reactor (see [`Socket`]).
async fn accept(
    listener: &AsyncFd<std::net::TcpListener>,
) -> std::io::Result<(std::net::TcpStream, SocketAddr)> {
    loop {
        let mut ready = listener.readable().await?;
        let accepted = ready.try_io(|l| {
            socket2::SockRef::from(l.get_ref()).accept4(libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC)
        });
        // Err: the queue was empty after all (readiness cleared), wait again.
        if let Ok(accepted) = accepted {
            let (socket, peer) = accepted?;
            let peer = peer.as_socket().ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::InvalidData, "peer is not an IP address")
            })?;
            return Ok((socket.into(), peer));
        }
    }
}

/// Logs a rejection at most once per second per reason, with the number suppressed.
#[derive(Debug, Default)]
struct RateLimitedLog {
    last: Mutex<HashMap<&'static str, (Instant, u64)>>,
}

impl RateLimitedLog {
    fn log(&self, reason: &'static str, peer: SocketAddr, detail: &dyn std::fmt::Display) {
        if let Some(suppressed) = self.due(reason) {
            warn!(reason, %peer, suppressed, "rejected connection: {detail}");
        }
    }

    /// Whether a line for `reason` is due (none in the last second), with how many were
    /// suppressed since the last one.
    fn due(&self, reason: &'static str) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let entry = last
            .entry(reason)
            .or_insert((now - Duration::from_secs(2), 0));
        if now.duration_since(entry.0) >= Duration::from_secs(1) {
            let suppressed = entry.1;
            *entry = (now, 0);
            Some(suppressed)
        } else {
            entry.1 += 1;
            None
        }
    }
}

/// Holds one unit of a counter (and its gauge); gives it back when dropped.
struct Slot {
    count: Arc<AtomicUsize>,
    gauge: Gauge,
}

impl Slot {
    /// Takes a unit; also returns the count before it.
    fn take(count: &Arc<AtomicUsize>, gauge: &Gauge) -> (Slot, usize) {
        let before = count.fetch_add(1, Ordering::SeqCst);
        gauge.inc();
        let slot = Slot {
            count: count.clone(),
            gauge: gauge.clone(),
        };
        (slot, before)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::SeqCst);
        self.gauge.dec();
    }
}

/// A connection that reached a pod, handed from the hello phase to the forwarding phase.
struct Routed {
    router: Arc<Router>,
    down: Socket,
    up: Socket,
    /// The bytes read so far (the ClientHello).
    initial: Vec<u8>,
    _lease: route::Lease,
    _active: Slot,
    kill: CancellationToken,
}

impl Routed {
    /// The forwarding phase: hands the connection to the dataplane until it ends, or
    /// until `kill` (the end of a drain).
    fn forward(self) -> Forwarding<impl Future<Output = Result<Outcome, dataplane::Error>>> {
        let Routed {
            router,
            down,
            up,
            initial,
            _lease,
            _active,
            kill,
        } = self;
        let forward = router
            .dataplane
            .forward(down, up, initial, router.config.limits);
        Forwarding {
            forward,
            killed: kill.cancelled_owned(),
            router,
            _lease,
            _active,
        }
    }
}

pin_project_lite::pin_project! {
    /// See [`Routed::forward`]. Hand-written rather than an `async` block with a
    /// `select!`: the block would also keep the sockets and the hello it moved into the
    /// dataplane, for the connection's whole life.
    struct Forwarding<F> {
        #[pin]
        forward: F,
        #[pin]
        killed: WaitForCancellationFutureOwned,
        router: Arc<Router>,
        _lease: route::Lease,
        _active: Slot,
    }
}

impl<F: Future<Output = Result<Outcome, dataplane::Error>>> Future for Forwarding<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        let metrics = &this.router.metrics;
        if this.killed.poll(cx).is_ready() {
            metrics
                .closed
                .get_or_create(&metrics::EndLabel {
                    end: "drain_deadline",
                })
                .inc();
            debug!("closed at the drain deadline");
            return Poll::Ready(());
        }
        match ready!(this.forward.poll(cx)) {
            Ok(o) => {
                metrics
                    .closed
                    .get_or_create(&metrics::EndLabel {
                        end: o.end.as_str(),
                    })
                    .inc();
                for (direction, n) in [
                    ("downstream_to_upstream", o.downstream_to_upstream),
                    ("upstream_to_downstream", o.upstream_to_downstream),
                ] {
                    metrics
                        .bytes
                        .get_or_create(&metrics::DirectionLabel { direction })
                        .inc_by(n);
                }
                debug!(
                    end = o.end.as_str(),
                    down_to_up = o.downstream_to_upstream,
                    up_to_down = o.upstream_to_downstream,
                    "connection closed"
                );
            }
            Err(e) => {
                metrics
                    .closed
                    .get_or_create(&metrics::EndLabel { end: "setup_error" })
                    .inc();
                warn!(error = %e, "dataplane could not take the connection");
            }
        }
        Poll::Ready(())
    }
}

/// Why a connection did not reach a pod.
#[derive(Debug, thiserror::Error)]
enum Reject {
    #[error("client hello: {0}")]
    Hello(#[from] sni::ReadHelloError),
    #[error("client hello not complete within {0:?}")]
    HelloTimeout(Duration),
    #[error("sni {sni:?}: {source}")]
    Sni { sni: String, source: sni::SniError },
    #[error("{target}: {source}")]
    NoRoute { target: String, source: NoRoute },
    #[error("{target}: every connect attempt failed (last: {last})")]
    Connect { target: String, last: String },
}

impl Reject {
    fn reason(&self) -> &'static str {
        match self {
            Reject::Hello(sni::ReadHelloError::Eof { .. }) => "client_closed",
            Reject::Hello(e) => e.reason(),
            Reject::HelloTimeout(_) => "hello_timeout",
            Reject::Sni { source, .. } => source.reason(),
            Reject::NoRoute { source, .. } => source.reason(),
            Reject::Connect { .. } => "upstream_connect_failed",
        }
    }
}

/// The router. Shared by every connection task.
pub struct Router {
    config: Config,
    store: Store,
    dataplane: Arc<Dataplane>,
    balancer: Balancer,
    metrics: Metrics,
    log: RateLimitedLog,
    active: Arc<AtomicUsize>,
    pending: Arc<AtomicUsize>,
}

impl Router {
    /// A router over `store`, forwarding with `dataplane`.
    pub fn new(
        config: Config,
        store: Store,
        dataplane: Arc<Dataplane>,
        metrics: Metrics,
    ) -> Router {
        Router {
            config,
            store,
            dataplane,
            balancer: Balancer::default(),
            metrics,
            log: RateLimitedLog::default(),
            active: Arc::default(),
            pending: Arc::default(),
        }
    }

    /// Which dataplane forwards the routed connections.
    pub fn dataplane_kind(&self) -> dataplane::Kind {
        self.dataplane.kind()
    }

    /// Routed connections open now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }

    /// Accepts until `stop` is cancelled, as worker number `worker`. Connection tasks run
    /// on `tracker`, on the caller's runtime; cancelling `kill` closes the ones still open
    /// (the end of a drain).
    pub async fn serve(
        self: Arc<Self>,
        worker: u32,
        listener: AsyncFd<std::net::TcpListener>,
        stop: CancellationToken,
        kill: CancellationToken,
        tracker: TaskTracker,
    ) {
        self.dataplane
            .mark_listener(std::os::fd::AsFd::as_fd(listener.get_ref()));
        if let Ok(addr) = listener.get_ref().local_addr() {
            debug!(%addr, worker, dataplane = self.dataplane.kind().as_str(), "tunnel listener accepting");
        }
        let mut next_id: u64 = 0;
        let accepted = self
            .metrics
            .accepted
            .get_or_create(&metrics::WorkerLabel { worker })
            .clone();
        loop {
            let (stream, peer) = tokio::select! {
                _ = stop.cancelled() => break,
                r = accept(&listener) => match r {
                    Ok(c) => c,
                    Err(e) => {
                        // EMFILE/ENFILE/ENOBUFS: the connection waits in the backlog;
                        // back off briefly instead of spinning on the error. Counted at
                        // every try, logged once a second.
                        self.metrics.reject("accept_error");
                        if let Some(suppressed) = self.log.due("accept_error") {
                            warn!(error = %e, suppressed, "accept failed; the connection waits in the backlog");
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                },
            };
            accepted.inc();
            // Taken here, not in the task, so a burst of accepts cannot overshoot the
            // limit before the tasks run; and taken before the check, so that the other
            // workers' accept loops cannot either.
            let (pending, before) = Slot::take(&self.pending, &self.metrics.pending);
            if before >= self.config.max_pending_handshakes
                || before + self.active() >= self.config.max_connections
            {
                drop(pending);
                self.metrics.reject("overload");
                self.log.log("overload", peer, &"connection limit reached");
                drop(stream);
                continue;
            }
            next_id += 1;
            let span = tracing::info_span!("conn", id = next_id, %peer);
            let router = self.clone();
            let kill = kill.clone();
            tracker.spawn(router.handle(stream, peer, pending, kill).instrument(span));
        }
        // One listener closes at a time in this process. A closing listener hands the
        // connections queued on it to another open listener of the port
        // (tcp_migrate_req), possibly this daemon's next worker's; the kernel resets a
        // connection handed to a listener that stopped listening meanwhile (counted as
        // TCPMigrateReqFailure). One at a time, the queue moves on from worker to worker
        // until it reaches the next daemon's listeners.
        static CLOSING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let one_at_a_time = CLOSING.lock().unwrap_or_else(|p| p.into_inner());
        drop(listener);
        drop(one_at_a_time);
        info!("tunnel listener stopped accepting");
    }

    /// One connection, from the hello to the close. Takes the router by `Arc` and is
    /// spawned as is.
    ///
    /// Two phases chained with a combinator, not one `async` block: a block keeps what it
    /// captured, and its locals, for the connection's whole life, and most of a routed
    /// connection's life is spent idle. The hello phase (about 700 B with the connect)
    /// is boxed and freed once the connection is routed.
    fn handle(
        self: Arc<Self>,
        down: std::net::TcpStream,
        peer: SocketAddr,
        pending: Slot,
        kill: CancellationToken,
    ) -> impl Future<Output = ()> + Send {
        Box::pin(self.admit(down, peer, pending, kill)).then(|routed| match routed {
            Some(r) => Either::Left(r.forward()),
            None => Either::Right(std::future::ready(())),
        })
    }

    /// The hello phase: reads the hello, routes it and dials the pod. None when the
    /// connection was rejected (counted and logged here) or killed.
    async fn admit(
        self: Arc<Self>,
        down: std::net::TcpStream,
        peer: SocketAddr,
        pending: Slot,
        kill: CancellationToken,
    ) -> Option<Routed> {
        let started = Instant::now();
        let mut buf = BytesMut::with_capacity(2048);
        // The lease counts this pod's connections for balancing until the end.
        let route = async {
            let (down, hello) = self.read_hello(down, &mut buf).await?;
            match self.dial(&hello).await {
                Ok((up, lease)) => Ok((down, up, lease)),
                Err(reject) => Err((reject, Some(down))),
            }
        };
        let (down, up, lease) = match tokio::select! {
            r = route => r,
            _ = kill.cancelled() => return None,
        } {
            Ok(routed) => routed,
            // The client's socket closes only after its rejection is counted: a client
            // that sees the close may look at the metric at once.
            Err((reject, _down)) => {
                let reason = reject.reason();
                self.metrics.reject(reason);
                self.log.log(reason, peer, &reject);
                return None;
            }
        };
        drop(pending);
        let (active, _) = Slot::take(&self.active, &self.metrics.active);
        self.metrics
            .handshake
            .observe(started.elapsed().as_secs_f64());
        self.metrics.opened.inc();
        // Latency matters more than packet count for request/response traffic; the
        // dataplanes write in large chunks anyway.
        // `down` has TCP_NODELAY from its listener (see workers::listen).
        let _ = socket2::SockRef::from(&up).set_tcp_nodelay(true);
        Some(Routed {
            router: self,
            down,
            up,
            initial: Vec::from(buf),
            _lease: lease,
            _active: active,
            kill,
        })
    }
    /// Reads the hello into `buf`. The client's socket is registered with the reactor
    /// only if its hello was not whole at once (see [`Socket`]); it comes back with a
    /// rejection too (unless registering it failed, which closed it).
    async fn read_hello(
        &self,
        down: std::net::TcpStream,
        buf: &mut BytesMut,
    ) -> Result<(Socket, sni::Hello), (Reject, Option<Socket>)> {
        let cfg = &self.config;
        match sni::read_client_hello_now(&mut &down, buf, cfg.max_hello_bytes) {
            Ok(Some(hello)) => return Ok((Socket::Ready(down), hello)),
            Ok(None) => {}
            Err(e) => return Err((e.into(), Some(Socket::Ready(down)))),
        }
        // The deadline counts from the handshake. A client with bytes at the accept was
        // handed over as they came (TCP_DEFER_ACCEPT), right after its handshake as a
        // rule; one with none was held by the kernel for its deferral first.
        let deadline = if buf.is_empty() {
            cfg.hello_timeout
                .saturating_sub(crate::workers::DEFER_ACCEPT)
        } else {
            cfg.hello_timeout
        };
        let mut down = match TcpStream::from_std(down) {
            Ok(down) => down,
            Err(e) => return Err((sni::ReadHelloError::from(e).into(), None)),
        };
        let read = tokio::time::timeout(
            deadline,
            sni::read_client_hello(&mut down, buf, cfg.max_hello_bytes),
        )
        .await;
        let down = Socket::Registered(down);
        match read {
            Ok(Ok(hello)) => Ok((down, hello)),
            Ok(Err(e)) => Err((e.into(), Some(down))),
            Err(_) => Err((Reject::HelloTimeout(cfg.hello_timeout), Some(down))),
        }
    }

    /// Picks a pod for the hello's SNI and connects to it.
    async fn dial(&self, hello: &sni::Hello) -> Result<(Socket, route::Lease), Reject> {
        let cfg = &self.config;
        let target =
            sni::parse_sni(hello.sni(), &cfg.mesh_domain).map_err(|source| Reject::Sni {
                sni: hello.sni().to_owned(),
                source,
            })?;
        let label = || format!("{}.{}:{}", target.service, target.namespace, target.port);
        let snapshot = self.store.snapshot();
        let mut candidates = cfg
            .policy
            .candidates(&snapshot, &target)
            .map_err(|source| Reject::NoRoute {
                target: label(),
                source,
            })?;
        let mut last = String::from("no candidate");
        for attempt in 0..cfg.connect_attempts.max(1) {
            let Some((ep, lease)) = candidates.pick(&self.balancer) else {
                break;
            };
            if attempt > 0 {
                self.metrics.upstream_retries.inc();
            }
            let addr = SocketAddr::new(ep.pod_ip, cfg.pod_port);
            match tokio::time::timeout(cfg.connect_timeout, connect(addr, &self.dataplane)).await {
                Ok(Ok(up)) => {
                    debug!(pod = %addr, node = %ep.node_name, "routed");
                    return Ok((up, lease));
                }
                Ok(Err(e)) => last = format!("{addr}: {e}"),
                Err(_) => last = format!("{addr}: timed out after {:?}", cfg.connect_timeout),
            }
            debug!(attempt, "upstream connect failed: {last}");
        }
        Err(Reject::Connect {
            target: label(),
            last,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[tokio::test]
    async fn connect_returns_established_streams_and_errors() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stream = connect(
            addr,
            &Dataplane::Copy(dataplane::copy::UserspaceCopy::new()),
        )
        .await
        .unwrap();
        let info = crate::sys::tcp_info(&stream).unwrap();
        assert_eq!(info.tcpi_state, dataplane::TCP_ESTABLISHED);
        // Done inside `connect(2)`: not registered with the reactor.
        assert!(matches!(stream, Socket::Ready(_)), "{stream:?}");
        let peer = socket2::SockRef::from(&stream).peer_addr().unwrap();
        assert_eq!(peer.as_socket(), Some(addr));
        drop(listener);
        let refused = connect(
            addr,
            &Dataplane::Copy(dataplane::copy::UserspaceCopy::new()),
        )
        .await
        .unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
    }

    /// A handshake that is not done when `connect` returns (here: a listener whose
    /// accept queue is full drops the SYN) is waited for, not handed on half-open.
    #[tokio::test]
    async fn connect_waits_for_a_handshake_still_going() {
        let socket =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket
            .bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        socket.listen(0).unwrap();
        let addr = socket.local_addr().unwrap().as_socket().unwrap();
        let copy = Dataplane::Copy(dataplane::copy::UserspaceCopy::new());
        // Fill the accept queue (backlog 0 holds one) and never accept.
        let mut held = Vec::new();
        let mut pending = None;
        for _ in 0..8 {
            let attempt =
                tokio::time::timeout(Duration::from_millis(300), connect(addr, &copy)).await;
            match attempt {
                Ok(Ok(s)) => held.push(s),
                Ok(Err(e)) => panic!("connect failed: {e}"),
                Err(_) => {
                    pending = Some(());
                    break;
                }
            }
        }
        assert!(
            pending.is_some(),
            "every connect returned at once ({} held): none waited for its handshake",
            held.len()
        );
        for s in &held {
            assert_eq!(
                crate::sys::tcp_info(s).unwrap().tcpi_state,
                dataplane::TCP_ESTABLISHED
            );
        }
    }
}
