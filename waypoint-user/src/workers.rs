//! The tunnel workers: one thread per core, each running a single-threaded tokio runtime
//! with its own listener on the tunnel address (SO_REUSEPORT, so the kernel spreads new
//! connections over them).
//!
//! A connection then lives on the thread that accepted it, from the hello to the close,
//! as in nginx's worker processes. With one work-stealing runtime instead, a new
//! connection's task and its wake-ups moved between the threads, and every move cost a
//! futex or eventfd wake of the other thread (see docs/PERFORMANCE.md). The control plane
//! (registry, admin server) stays on the daemon's main runtime.

use std::{net::SocketAddr, sync::Arc, thread::JoinHandle};

use tokio::{io::Interest, sync::oneshot};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{info, warn, Instrument as _};

use crate::router::Router;

/// Accept backlog of each worker's listener.
const BACKLOG: i32 = 4096;

/// Errors starting the workers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A listener could not be bound.
    #[error("binding the tunnel listener on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The CPUs this process may run on could not be read (for `pin`).
    #[error("reading the CPUs this process may run on: {0}")]
    Affinity(#[source] nix::Error),
    /// A worker's runtime could not be built or its thread started.
    #[error("starting tunnel worker {worker}: {source}")]
    Start {
        /// The worker's index.
        worker: usize,
        /// The cause.
        source: std::io::Error,
    },
}

/// How many workers `requested` means: itself, or with 0 one per CPU this process may
/// run on (its affinity mask and cgroup quota, as the standard library reads them).
pub fn count(requested: usize) -> usize {
    if requested > 0 {
        return requested;
    }
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// How long the kernel holds a connection that has sent nothing before handing it to a
/// worker anyway (TCP_DEFER_ACCEPT, in seconds): the SYN-ACK's first retransmission, at
/// the initial RTO of 1 s, after which the client's next ACK makes it acceptable. The
/// router counts that second in the client's hello deadline ([`DEFER_ACCEPT`]).
const DEFER_ACCEPT_SECS: libc::c_int = 1;

/// [`DEFER_ACCEPT_SECS`]: how long a client that sent nothing was connected before it
/// was accepted.
pub(crate) const DEFER_ACCEPT: std::time::Duration = std::time::Duration::from_secs(1);

/// A listening socket that other listeners in this process, and a new daemon while this
/// one drains, can bind too (SO_REUSEPORT, same user only).
///
/// Two options save work on every connection:
/// - TCP_NODELAY here is inherited by every accepted socket (Linux copies the listener's
///   TCP options into the child), so no `setsockopt` per connection.
/// - TCP_DEFER_ACCEPT: the client speaks first (its ClientHello), so the kernel queues a
///   connection for `accept` only once its first bytes are in. The worker then wakes
///   once per connection and reads the hello at once, instead of waking for the accept,
///   finding nothing to read (EAGAIN) and waiting again. A client that connects and
///   stays silent costs the kernel a request socket, not a worker's pending slot, until
///   it is handed over after [`DEFER_ACCEPT_SECS`].
///
/// With `cpu`, the listener asks for the connections whose SYN that CPU handled
/// (SO_INCOMING_CPU).
///
/// With `mss`, the MSS the listener advertises is at most that (TCP_MAXSEG, inherited by
/// accepted sockets): see [`Listen::mss`].
fn listen(
    addr: SocketAddr,
    cpu: Option<usize>,
    mss: Option<u32>,
) -> std::io::Result<std::net::TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM.nonblocking().cloexec(),
        None,
    )?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_tcp_nodelay(true)?;
    set_defer_accept(&socket, DEFER_ACCEPT_SECS)?;
    if let Some(mss) = mss {
        socket.set_tcp_mss(mss)?;
    }
    if let Some(cpu) = cpu {
        socket.set_cpu_affinity(cpu)?;
    }
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

/// TCP_DEFER_ACCEPT, which neither socket2 nor nix wraps.
fn set_defer_accept(socket: &socket2::Socket, secs: libc::c_int) -> std::io::Result<()> {
    crate::sys::setsockopt_int(socket, libc::IPPROTO_TCP, libc::TCP_DEFER_ACCEPT, secs)
}

/// The CPUs this process may run on, in order.
fn allowed_cpus() -> Result<Vec<usize>, Error> {
    let set =
        nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).map_err(Error::Affinity)?;
    Ok((0..nix::sched::CpuSet::count())
        .filter(|&cpu| set.is_set(cpu).unwrap_or(false))
        .collect())
}

/// Restricts the calling thread to `cpu`.
fn pin_thread(cpu: usize) -> nix::Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu)?;
    // Pid 0: the calling thread.
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
}

struct Worker {
    /// Fires (or is dropped) once the worker's listener is closed.
    accepting: Option<oneshot::Receiver<()>>,
    thread: Option<JoinHandle<()>>,
}

/// How the workers listen.
#[derive(Clone, Copy, Debug, Default)]
pub struct Listen {
    /// Worker threads, each with its own listener (at least 1).
    pub workers: usize,
    /// Pin worker i to the i-th CPU this process may run on (see [`Workers::start`]).
    pub pin: bool,
    /// The largest MSS the listeners advertise (TCP_MAXSEG), below the route's when the
    /// pods' links carry smaller packets than the node's: the rewrite splice needs both
    /// sides of a connection to advertise one MSS (see `--tunnel-mss`).
    pub mss: Option<u32>,
    /// Attach the migration program to the listeners' group, so that the connections
    /// queued on a closing listener move to these listeners (see `migrate.rs`).
    pub migrate: bool,
}

/// The running workers.
pub struct Workers {
    workers: Vec<Worker>,
    addr: SocketAddr,
    /// Held for the daemon's life (see `migrate.rs`).
    migration: Option<crate::migrate::Migration>,
}

impl Workers {
    /// Binds `n` listeners on `addr` (the first decides the port when it is 0) and starts
    /// a worker on each, serving `router` until `stop`; connection tasks are tracked by
    /// `tracker`, and a worker's thread ends once `tracker` is closed and empty. Nothing
    /// is started when any listener or runtime fails. With `pin`, worker i runs on the
    /// i-th CPU this process may run on (round robin when there are more workers than
    /// CPUs) and takes the connections that arrive on it.
    pub fn start(
        listen_as: Listen,
        addr: SocketAddr,
        router: &Arc<Router>,
        stop: &CancellationToken,
        kill: &CancellationToken,
        tracker: &TaskTracker,
    ) -> Result<Workers, Error> {
        let n = listen_as.workers.max(1);
        let cpus = if listen_as.pin {
            allowed_cpus()?
        } else {
            Vec::new()
        };
        // None when not pinned (or, defensively, when the mask is empty).
        let cpu_of = |worker: usize| (!cpus.is_empty()).then(|| cpus[worker % cpus.len()]);
        let bind = |addr, cpu| {
            listen(addr, cpu, listen_as.mss).map_err(|source| Error::Bind { addr, source })
        };
        let first = bind(addr, cpu_of(0))?;
        let addr = first
            .local_addr()
            .map_err(|source| Error::Bind { addr, source })?;
        let mut listeners = vec![first];
        for worker in 1..n {
            listeners.push(bind(addr, cpu_of(worker))?);
        }
        let migration = if listen_as.migrate {
            match crate::migrate::attach(&listeners) {
                Ok(m) => {
                    info!("a closing listener's queued connections move to this daemon's listeners (reuseport program attached)");
                    Some(m)
                }
                Err(e) => {
                    warn!(error = %e, "the migration program could not be attached: a closing listener's queued connections move where net.ipv4.tcp_migrate_req sends them, if it is on");
                    None
                }
            }
        } else {
            None
        };
        // Every runtime and listener registration first, so that a failure leaves
        // nothing running.
        let mut ready = Vec::with_capacity(n);
        for (worker, std_listener) in listeners.into_iter().enumerate() {
            let start = |source| Error::Start { worker, source };
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(start)?;
            let listener = {
                let _entered = runtime.enter();
                // Accepted sockets come out unregistered (see `dataplane::Socket`).
                crate::sys::register(std_listener, Interest::READABLE).map_err(start)?
            };
            ready.push((runtime, listener));
        }
        let mut workers = Vec::with_capacity(n);
        for (worker, (runtime, listener)) in ready.into_iter().enumerate() {
            let (accepting_tx, accepting_rx) = oneshot::channel();
            // At most a few hundred: the count of CPUs.
            let index = u32::try_from(worker).unwrap_or(u32::MAX);
            let (w_router, w_stop, w_kill, w_tracker) =
                (router.clone(), stop.clone(), kill.clone(), tracker.clone());
            let cpu = cpu_of(worker);
            let spawned = std::thread::Builder::new()
                .name(format!("waypoint-w{worker}"))
                .spawn(move || {
                    if let Some(cpu) = cpu {
                        // Still serves unpinned: slower, not wrong.
                        if let Err(e) = pin_thread(cpu) {
                            warn!(worker, cpu, error = %e, "could not pin the tunnel worker");
                        }
                    }
                    runtime.block_on(async move {
                        let span = tracing::info_span!("worker", id = worker);
                        w_router
                            .serve(index, listener, w_stop, w_kill, w_tracker.clone())
                            .instrument(span)
                            .await;
                        // serve dropped the listener.
                        let _ = accepting_tx.send(());
                        // This runtime runs its connections until every worker's are done.
                        w_tracker.wait().await;
                    });
                });
            match spawned {
                Ok(thread) => workers.push(Worker {
                    accepting: Some(accepting_rx),
                    thread: Some(thread),
                }),
                Err(source) => {
                    // The ones already running stop with the caller's tokens; make them.
                    stop.cancel();
                    kill.cancel();
                    tracker.close();
                    return Err(Error::Start { worker, source });
                }
            }
        }
        info!(workers = n, pinned = listen_as.pin, mss = ?listen_as.mss, %addr, dataplane = router.dataplane_kind().as_str(), "tunnel listeners accepting");
        Ok(Workers {
            workers,
            addr,
            migration,
        })
    }

    /// Whether the migration program is attached to the listeners' group.
    pub fn migrates(&self) -> bool {
        self.migration.is_some()
    }

    /// The address every worker listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Resolves once every worker has closed its listener (after `stop`).
    pub async fn stopped_accepting(&mut self) {
        for w in &mut self.workers {
            if let Some(rx) = w.accepting.take() {
                // An error means the worker's thread ended (it dropped the sender).
                let _ = rx.await;
            }
        }
    }

    /// Waits for every worker's thread to end (after the tracker was closed and
    /// emptied), without blocking the caller's runtime.
    pub async fn join(&mut self) {
        let threads: Vec<_> = self
            .workers
            .iter_mut()
            .filter_map(|w| w.thread.take())
            .collect();
        if threads.is_empty() {
            return;
        }
        let joined = tokio::task::spawn_blocking(move || {
            for t in threads {
                // A panicked worker already logged its panic; nothing more to do here.
                let _ = t.join();
            }
        });
        let _ = joined.await;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn zero_means_one_per_cpu() {
        assert_eq!(count(3), 3);
        let cpus = std::thread::available_parallelism().unwrap().get();
        assert_eq!(count(0), cpus);
    }

    /// A listener with an MSS advertises it (lo's MTU would give 65,483) and its accepted
    /// sockets keep it: the client sends no larger segment.
    #[test]
    fn a_listener_with_an_mss_advertises_it() {
        use std::io::Write as _;
        let listener = listen("127.0.0.1:0".parse().unwrap(), None, Some(1000)).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut client = std::net::TcpStream::connect(addr).unwrap();
        client.write_all(b"hi").unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let accepted = loop {
            match listener.accept() {
                Ok((c, _)) => break c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(std::time::Instant::now() < deadline, "never accepted");
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        // Less the timestamps option (12 bytes) when it was negotiated.
        let advmss = crate::sys::tcp_info(&accepted).unwrap().tcpi_advmss;
        assert!((988..=1000).contains(&advmss), "{advmss}");
        let snd_mss = crate::sys::tcp_info(&client).unwrap().tcpi_snd_mss;
        assert!((988..=1000).contains(&snd_mss), "{snd_mss}");
    }

    /// An accepted socket comes with TCP_NODELAY (the router no longer sets it) and only
    /// once the client has sent something (TCP_DEFER_ACCEPT).
    #[test]
    fn accepted_sockets_have_nodelay_and_data() {
        use std::io::{Read as _, Write as _};
        let listener = listen("127.0.0.1:0".parse().unwrap(), None, None).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut client = std::net::TcpStream::connect(addr).unwrap();
        // Connected from the client's side, but nothing sent: not acceptable yet (the
        // kernel would hand it over after DEFER_ACCEPT_SECS, far longer than this).
        let e = listener.accept().unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
        client.write_all(b"hi").unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let (mut accepted, _) = loop {
            match listener.accept() {
                Ok(c) => break c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(std::time::Instant::now() < deadline, "never accepted");
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        assert!(accepted.nodelay().unwrap(), "TCP_NODELAY not inherited");
        // The bytes came with the connection: readable without waiting.
        accepted.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 2];
        accepted.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hi");
    }

    /// A port held by a socket without SO_REUSEPORT cannot be shared: a clear error, and
    /// no worker left running.
    #[tokio::test]
    async fn a_taken_port_is_an_error() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let store = crate::store::Store::new();
        let router = Arc::new(Router::new(
            test_router_config(),
            store,
            Arc::new(crate::dataplane::Dataplane::Copy(
                crate::dataplane::copy::UserspaceCopy::new(),
            )),
            crate::router::Metrics::new(&mut prometheus_client::registry::Registry::default()),
        ));
        let (stop, kill, tracker) = (
            CancellationToken::new(),
            CancellationToken::new(),
            TaskTracker::new(),
        );
        let two = Listen {
            workers: 2,
            ..Listen::default()
        };
        let Err(e) = Workers::start(two, addr, &router, &stop, &kill, &tracker) else {
            panic!("bound a port that is taken");
        };
        assert!(matches!(e, Error::Bind { .. }), "{e}");
        assert!(e.to_string().contains(&addr.to_string()), "{e}");
        assert!(tracker.is_empty());
        // The router was never handed to a worker.
        assert_eq!(Arc::strong_count(&router), 1);
    }

    /// With `pin`, worker i runs on the i-th allowed CPU, and a connection whose SYN that
    /// CPU handled (on loopback: the CPU the client runs on) goes to worker i.
    #[tokio::test]
    async fn pinned_workers_take_the_connections_of_their_cpu() {
        use std::io::{Read as _, Write as _};
        let cpus = allowed_cpus().unwrap();
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = crate::router::Metrics::new(&mut registry);
        let router = Arc::new(Router::new(
            test_router_config(),
            crate::store::Store::new(),
            Arc::new(crate::dataplane::Dataplane::Copy(
                crate::dataplane::copy::UserspaceCopy::new(),
            )),
            metrics.clone(),
        ));
        let (stop, kill, tracker) = (
            CancellationToken::new(),
            CancellationToken::new(),
            TaskTracker::new(),
        );
        let n = cpus.len();
        let mut workers = Workers::start(
            Listen {
                workers: n,
                pin: true,
                mss: None,
                migrate: false,
            },
            "127.0.0.1:0".parse().unwrap(),
            &router,
            &stop,
            &kill,
            &tracker,
        )
        .unwrap();
        let addr = workers.local_addr();
        let accepted = |worker: usize| {
            metrics
                .accepted
                .get_or_create(&crate::router::metrics::WorkerLabel {
                    worker: u32::try_from(worker).unwrap(),
                })
                .get()
        };
        for (worker, &cpu) in cpus.iter().enumerate() {
            let before: Vec<u64> = (0..n).map(accepted).collect();
            // Eight, so that the kernel's hash alone would be caught. Not TLS: the
            // router rejects each and closes, after counting the accept.
            tokio::task::spawn_blocking(move || {
                pin_thread(cpu).unwrap();
                for _ in 0..8 {
                    let mut c = std::net::TcpStream::connect(addr).unwrap();
                    c.write_all(b"not a hello").unwrap();
                    let mut rest = Vec::new();
                    let _ = c.read_to_end(&mut rest);
                }
            })
            .await
            .unwrap();
            let after: Vec<u64> = (0..n).map(accepted).collect();
            let mut expected = before.clone();
            expected[worker] += 8;
            assert_eq!(
                after, expected,
                "a connection from CPU {cpu} (worker {worker})"
            );
            assert!(
                thread_pinned(&format!("waypoint-w{worker}"), cpu),
                "worker {worker} is not pinned to CPU {cpu}"
            );
        }
        stop.cancel();
        workers.stopped_accepting().await;
        tracker.close();
        workers.join().await;
    }

    /// Whether a thread of this process named `name` may run only on `cpu`.
    fn thread_pinned(name: &str, cpu: usize) -> bool {
        std::fs::read_dir("/proc/self/task").unwrap().any(|task| {
            let dir = task.unwrap().path();
            let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
            comm.trim() == name
                && status.lines().any(|l| {
                    l.split_whitespace().collect::<Vec<_>>()
                        == ["Cpus_allowed_list:", &cpu.to_string()]
                })
        })
    }

    fn test_router_config() -> crate::router::Config {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Args {
            #[command(flatten)]
            config: crate::config::Config,
        }
        Args::try_parse_from(["waypoint"]).unwrap().config.router()
    }
}
