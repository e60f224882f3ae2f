//! Wires the daemon together: chooses the dataplane, loads the endpoint store, binds the
//! tunnel listener and the admin server, and on SIGTERM drains.

use std::sync::Arc;

use anyhow::Context as _;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{debug, info, warn};

use crate::{
    admin::{Admin, Api, Readiness},
    config::Config,
    dataplane::{adopt, choice, Dataplane},
    kubernetes,
    metrics::Metrics,
    registry::{self, etcd},
    router::{self, Router},
    sni,
    store::{Snapshot, Store},
    workers::{self, Workers},
};

/// A running daemon: what tests and `run` hold on to.
pub struct App {
    /// The endpoint store.
    pub store: Store,
    /// The router.
    pub router: Arc<Router>,
    /// Readiness, as served on /readyz.
    pub ready: Arc<Readiness>,
    /// The tunnel listener's address.
    pub tunnel_addr: std::net::SocketAddr,
    /// The admin server's address.
    pub admin_addr: std::net::SocketAddr,
    /// The etcd watcher, with `--registry etcd:...`.
    pub watcher: Option<etcd::WatcherHandle>,
    config: Config,
    stop: CancellationToken,
    kill: CancellationToken,
    tracker: TaskTracker,
    /// The tunnel workers; they own the listeners.
    workers: Workers,
    /// The dataplane, which leaves its rewritten connections to the next daemon.
    dataplane: Arc<Dataplane>,
    /// Adopts gone daemons' rewritten connections, and hands them on.
    adopter: Arc<adopt::Adopter>,
    /// The admin server's task, which owns its listener: awaited at the end of the
    /// shutdown, so that once [`App::shutdown`] returns nothing listens on the admin
    /// address.
    admin: tokio::task::JoinHandle<()>,
    /// Stops the admin server: last, after the hand-over of the rewritten connections,
    /// so that metrics and `/readyz` (503) answer for as long as the process runs.
    admin_stop: CancellationToken,
}

impl App {
    /// Starts everything; returns once the listener is bound and the daemon is ready.
    pub async fn start(config: Config) -> anyhow::Result<App> {
        info!(?config, "starting");
        sni::validate_mesh_domain(&config.mesh_domain)
            .map_err(|e| anyhow::anyhow!("--mesh-domain {:?}: {e}", config.mesh_domain))?;
        // Before any dial: a gone daemon's rewritten connections hold 4-tuples to the
        // pods that no new connection may take.
        let adopter = Arc::new(
            adopt::Adopter::start(adopt::Config {
                idle_timeout: config.idle_timeout,
                max_lifetime: config.max_lifetime,
                pin_dir: config.pin_dir.clone(),
            })
            .context("starting the adopter")?,
        );
        let (dataplane, chosen) = choice::choose(
            config.dataplane,
            config.ebpf(),
            usize::try_from(config.pipe_size).unwrap_or(usize::MAX),
        )?;
        // No process parker: connections run on the tunnel workers' single-threaded
        // runtimes, and each starts its own parker at its first idle connection.
        let dataplane = Arc::new(dataplane);
        let mut metrics = Metrics::new(dataplane.clone(), &chosen);
        metrics.register_adopter(adopter.clone());
        let migration = metrics.register_migration();
        let router_metrics = router::Metrics::new(metrics.registry_mut());
        let registry_metrics = registry::metrics::Metrics::new(metrics.registry_mut());
        let kubernetes_metrics = if config.kubernetes {
            kubernetes::Metrics::new(metrics.registry_mut())
        } else {
            kubernetes::Metrics::unregistered()
        };
        let metrics = Arc::new(metrics);
        let ready = Arc::new(Readiness::default());
        let stop = CancellationToken::new();
        let kill = CancellationToken::new();
        let tracker = TaskTracker::new();
        // A start that fails half-way stops what it already started (the registry tasks,
        // the tunnel workers' threads) instead of leaving it running in the process.
        let (stop_on_error, kill_on_error) = (stop.clone().drop_guard(), kill.clone().drop_guard());

        let store = Store::new();
        let mut etcd_health = None;
        let mut watcher = None;
        if config.local_endpoints.is_some() && config.kubernetes {
            anyhow::bail!(
                "--kubernetes and --local-endpoints both say which pods this node registers: give one"
            );
        }
        if config.local_endpoints.is_some()
            && !matches!(config.registry, Some(registry::Location::Etcd(_)))
        {
            anyhow::bail!("--local-endpoints registers pods in etcd: it needs --registry etcd:URL");
        }
        check_node_ip(&config)?;
        if config.kubernetes && !matches!(config.registry, Some(registry::Location::Etcd(_))) {
            anyhow::bail!("--kubernetes registers pods in etcd: it needs --registry etcd:URL");
        }
        match &config.registry {
            Some(registry::Location::File(path)) => {
                registry::file::run(path.clone(), store.clone(), stop.clone()).await?;
            }
            Some(registry::Location::Etcd(urls)) => {
                let connector =
                    etcd::Connector::new(urls.clone(), &config.etcd).context("--registry etcd")?;
                // The watcher outlives the drain: established connections keep routing
                // decisions current until the end. It stops on kill.
                watcher = Some(
                    etcd::Watcher::new(connector.clone(), store.clone(), registry_metrics.clone())
                        .spawn(kill.clone()),
                );
                let source = if let Some(path) = &config.local_endpoints {
                    // Fail at start on a broken file; later breakage keeps the last set.
                    etcd::load_local(path)?;
                    Some(etcd::LocalSource::File(path.clone()))
                } else if config.kubernetes {
                    // Only the client configuration can fail here: an API server that is
                    // down is waited for (the registrar writes nothing until every watched
                    // set is listed), like etcd.
                    let client = kubernetes::client().await.context("--kubernetes")?;
                    let live = kubernetes::Source::new(
                        client,
                        kubernetes::Config::new(config.identity()),
                        kubernetes_metrics.clone(),
                    )
                    .spawn(kill.clone());
                    Some(etcd::LocalSource::Watch(live))
                } else {
                    None
                };
                if let Some(source) = source {
                    let registrar = etcd::Registrar::new(
                        connector,
                        config.identity(),
                        source,
                        config.registry_lease_ttl,
                        registry_metrics.clone(),
                    );
                    // Stops (and revokes the lease) when the drain starts, so that other
                    // nodes stop sending new connections here while old ones finish; the
                    // tracker makes the drain wait for the revoke.
                    tracker.spawn(registrar.run(stop.clone()));
                }
                etcd_health = Some(registry_metrics.clone());
            }
            None => {
                warn!("no --registry: the endpoint store is empty and every connection will be rejected");
                store.replace(Snapshot::new([], true));
            }
        }

        let router = Arc::new(Router::new(
            config.router(),
            store.clone(),
            dataplane.clone(),
            router_metrics,
        ));
        if config.migrate_requests {
            migrate_requests();
        }
        let mss = config.tunnel_mss.map(|m| m.resolve(config.tunnel_addr));
        if let Some(mss) = mss {
            info!(mss, asked = ?config.tunnel_mss, "tunnel listeners advertise at most this MSS");
        }
        let workers = Workers::start(
            workers::Listen {
                workers: workers::count(usize::from(config.workers)),
                pin: config.pin_workers,
                mss,
                migrate: config.migrate_requests,
            },
            config.tunnel_addr,
            &router,
            &stop,
            &kill,
            &tracker,
        )?;
        let tunnel_addr = workers.local_addr();
        migration.set(i64::from(workers.migrates()));

        let admin = Admin::bind(config.admin_addr).await?;
        let admin_addr = admin.local_addr()?;
        // The admin server outlives the drain and the hand-over (metrics stay scrapable).
        let api = Arc::new(Api {
            store: store.clone(),
            viewer: config.viewer(),
            registry: etcd_health,
            dataplane: chosen.to_string(),
        });
        let admin_stop = CancellationToken::new();
        let admin = tokio::spawn(admin.serve(metrics, ready.clone(), api, admin_stop.clone()));

        // Ready: listener bound, dataplane chosen, store synced. etcd may not be reachable
        // yet: readiness then follows the first sync (liveness never waits for etcd).
        // After that it stays ready while etcd is away: the last known state is served.
        if store.is_synced() {
            ready.set(true);
            info!(%tunnel_addr, %admin_addr, "ready");
        } else {
            let (store, ready, stop) = (store.clone(), ready.clone(), stop.clone());
            tokio::spawn(async move {
                let mut rx = store.subscribe();
                tokio::select! {
                    _ = stop.cancelled() => {}
                    r = rx.wait_for(|s| s.synced) => if r.is_ok() && !stop.is_cancelled() {
                        ready.set(true);
                        info!(%tunnel_addr, %admin_addr, "ready");
                    },
                }
            });
        }
        stop_on_error.disarm();
        kill_on_error.disarm();
        Ok(App {
            store,
            router,
            ready,
            tunnel_addr,
            admin_addr,
            watcher,
            config,
            stop,
            kill,
            tracker,
            workers,
            dataplane,
            adopter,
            admin,
            admin_stop,
        })
    }

    /// Drains: not ready, stop accepting, let established connections finish until the
    /// drain deadline, then close the rest.
    pub async fn shutdown(mut self) {
        info!(
            active = self.router.active(),
            "draining: not ready, no longer accepting"
        );
        self.ready.set(false);
        self.stop.cancel();
        // The listeners are closed once the accept loops have returned: from then on new
        // connections go to a successor bound with SO_REUSEPORT (or are refused).
        self.workers.stopped_accepting().await;
        // Rewritten connections need no daemon: they go to the next one, not through
        // the drain, which goes on meanwhile.
        let leaving = self.dataplane.leave();
        let (dataplane, adopter) = (self.dataplane.clone(), self.adopter.clone());
        let handing = tokio::task::spawn_blocking(move || {
            let own = leaving.then(|| dataplane.pass_on(HAND_OVER_WAIT));
            let adopted = adopter.pass_on(HAND_OVER_WAIT);
            (own, adopted)
        });
        self.tracker.close();
        if tokio::time::timeout(self.config.drain_timeout, self.tracker.wait())
            .await
            .is_err()
        {
            info!(
                active = self.router.active(),
                "drain deadline reached: closing the remaining connections"
            );
        }
        self.kill.cancel();
        self.tracker.wait().await;
        self.workers.join().await;
        match handing.await {
            Ok((own, adopted)) => info!(own = ?own.flatten(), ?adopted,
                "rewritten connections left to the next daemon (sockets it took: own, adopted)"),
            Err(e) => warn!(error = %e, "handing the rewritten connections on failed"),
        }
        self.admin_stop.cancel();
        // It returns on `admin_stop`; an error is a panic in it, already reported.
        let _ = (&mut self.admin).await;
        info!("stopped");
    }
}

impl Drop for App {
    /// An `App` dropped without [`App::shutdown`] (a test that ends, an error path) closes
    /// everything at once: its worker threads would otherwise keep the listeners and
    /// connections open for the rest of the process.
    fn drop(&mut self) {
        self.stop.cancel();
        self.tracker.close();
        self.kill.cancel();
        self.admin_stop.cancel();
    }
}

/// How long a leaving daemon waits for the next one to take its rewritten connections
/// (its adopter looks every 500 ms).
pub const HAND_OVER_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs the daemon until SIGTERM or SIGINT, then drains.
/// The node IP this node registers (what other clusters dial) must be one the tunnel
/// serves: refused at start when it is an address of this host and the tunnel listens on
/// another one. An address that is not this host's (a NAT in front of the node) is
/// taken as given.
fn check_node_ip(config: &Config) -> anyhow::Result<()> {
    let (Some(node_ip), listen) = (config.node_ip, config.tunnel_addr.ip()) else {
        return Ok(());
    };
    if listen.is_unspecified() || listen == node_ip {
        return Ok(());
    }
    // Binding succeeds only on an address of this host.
    if std::net::TcpListener::bind((node_ip, 0)).is_ok() {
        anyhow::bail!(
            "--node-ip {node_ip} is what other clusters dial, but the tunnel listens on {listen} \
             (--tunnel-addr): give both the same address, or listen on every address \
             (0.0.0.0 or [::])"
        );
    }
    Ok(())
}

/// Turns on `net.ipv4.tcp_migrate_req` (see `Config::migrate_requests`), or says why
/// not: without it, a rolling update resets the connections still queued on the old
/// daemon's listeners when it closes them.
fn migrate_requests() {
    match crate::sys::enable_request_migration() {
        Ok(true) => info!(
            "net.ipv4.tcp_migrate_req turned on: a closing listener's queued connections \
             move to the next daemon's"
        ),
        Ok(false) => debug!("net.ipv4.tcp_migrate_req already on"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => warn!(
            "this kernel has no net.ipv4.tcp_migrate_req (Linux 5.14): a restart resets the \
             connections queued on the old daemon's listeners"
        ),
        Err(e) => warn!(
            error = %e,
            "net.ipv4.tcp_migrate_req could not be turned on (a read-only /proc/sys? set it \
             on the node): a restart resets the connections queued on the old daemon's \
             listeners"
        ),
    }
}

pub async fn run(config: Config) -> anyhow::Result<()> {
    match crate::sys::raise_nofile_limit() {
        Ok(n) => info!(open_files = n, "open file limit"),
        Err(e) => warn!(error = %e, "the open file limit could not be raised"),
    }
    let app = App::start(config).await?;
    wait_for_signal().await?;
    app.shutdown().await;
    Ok(())
}

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    tokio::select! {
        _ = term.recv() => info!("SIGTERM"),
        _ = int.recv() => info!("SIGINT"),
    }
    Ok(())
}
