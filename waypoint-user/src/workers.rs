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

use tokio::{net::TcpListener, sync::oneshot};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{info, Instrument as _};

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

/// A listening socket that other listeners in this process, and a new daemon while this
/// one drains, can bind too (SO_REUSEPORT, same user only).
fn listen(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM.nonblocking().cloexec(),
        None,
    )?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

struct Worker {
    /// Fires (or is dropped) once the worker's listener is closed.
    accepting: Option<oneshot::Receiver<()>>,
    thread: Option<JoinHandle<()>>,
}

/// The running workers.
pub struct Workers {
    workers: Vec<Worker>,
    addr: SocketAddr,
}

impl Workers {
    /// Binds `n` listeners on `addr` (the first decides the port when it is 0) and starts
    /// a worker on each, serving `router` until `stop`; connection tasks are tracked by
    /// `tracker`, and a worker's thread ends once `tracker` is closed and empty. Nothing
    /// is started when any listener or runtime fails.
    pub fn start(
        n: usize,
        addr: SocketAddr,
        router: &Arc<Router>,
        stop: &CancellationToken,
        kill: &CancellationToken,
        tracker: &TaskTracker,
    ) -> Result<Workers, Error> {
        let n = n.max(1);
        let bind = |addr| listen(addr).map_err(|source| Error::Bind { addr, source });
        let first = bind(addr)?;
        let addr = first
            .local_addr()
            .map_err(|source| Error::Bind { addr, source })?;
        let mut listeners = vec![first];
        for _ in 1..n {
            listeners.push(bind(addr)?);
        }
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
                TcpListener::from_std(std_listener).map_err(start)?
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
            let spawned = std::thread::Builder::new()
                .name(format!("waypoint-w{worker}"))
                .spawn(move || {
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
        info!(workers = n, %addr, dataplane = router.dataplane_kind().as_str(), "tunnel listeners accepting");
        Ok(Workers { workers, addr })
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
                crate::dataplane::copy::Copy,
            )),
            crate::router::Metrics::new(&mut prometheus_client::registry::Registry::default()),
        ));
        let (stop, kill, tracker) = (
            CancellationToken::new(),
            CancellationToken::new(),
            TaskTracker::new(),
        );
        let Err(e) = Workers::start(2, addr, &router, &stop, &kill, &tracker) else {
            panic!("bound a port that is taken");
        };
        assert!(matches!(e, Error::Bind { .. }), "{e}");
        assert!(e.to_string().contains(&addr.to_string()), "{e}");
        assert!(tracker.is_empty());
        // The router was never handed to a worker.
        assert_eq!(Arc::strong_count(&router), 1);
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
