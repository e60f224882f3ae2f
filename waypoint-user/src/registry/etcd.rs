//! The etcd registry: the [`Watcher`] mirrors every cluster's records under
//! [`record::ROOT`] into the [`Store`]; the [`Registrar`] keeps this node's own endpoints
//! registered under a per-node lease. Layout and semantics: docs/REGISTRY.md.
//!
//! Both survive etcd going away: the watcher keeps serving the last state it had (the
//! store is only ever replaced by a complete, consistent view), the registrar re-grants
//! and re-writes when it can reach etcd again. Retries back off with `backon`.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use backon::{BackoffBuilder as _, ExponentialBuilder};
use etcd_client::{
    Certificate, Client, ConnectOptions, DeleteOptions, EventType, GetOptions, Identity,
    PutOptions, TlsOptions, WatchOptions,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

pub use super::local::{LocalDocument, LocalEndpoint, LocalSet, NodeIdentity};

use crate::{
    model::Endpoint,
    registry::{metrics::Metrics, record},
    store::{Snapshot, Store},
};

/// Errors of the etcd registry.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A TLS file could not be read.
    #[error("reading {what} {path}: {source}")]
    ReadTls {
        /// Which file (CA, certificate, key).
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// `--etcd-cert` and `--etcd-key` go together.
    #[error("--etcd-cert and --etcd-key must be given together")]
    HalfIdentity,
    /// No endpoint URL.
    #[error("no etcd endpoint: use --registry etcd:http://HOST:2379[,http://HOST2:2379...]")]
    NoEndpoints,
    /// No endpoint completed a connection, TLS handshake and one request.
    #[error(
        "no etcd endpoint answered ({0}); check the URLs and, for https, --etcd-ca and \
         --etcd-cert/--etcd-key (etcd may require a client certificate)"
    )]
    Unreachable(String),
    /// An etcd request failed.
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// The watch stream ended without an error.
    #[error("etcd closed the watch stream")]
    WatchClosed,
    /// The keepalive stream ended or said the lease is gone.
    #[error("the node's lease {0:x} was lost (expired or revoked)")]
    LeaseLost(i64),
    /// A record could not be keyed.
    #[error(transparent)]
    Key(#[from] record::KeyError),
    /// The local endpoints file could not be read.
    #[error("reading local endpoints file {path}: {source}")]
    ReadLocal {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The local endpoints file is not valid.
    #[error("parsing local endpoints file {path}: {source}")]
    ParseLocal {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
    /// An endpoint of the local endpoints file has ports that do not hold together.
    #[error("local endpoints file {path}: {source}")]
    LocalPorts {
        /// The file.
        path: PathBuf,
        /// Which endpoint, and what is wrong.
        source: crate::model::BadPorts,
    },
    /// A key passed to a tool is outside the root.
    #[error("{0:?} is not under the registry root {root}", root = record::ROOT)]
    OutsideRoot(String),
}

/// TLS settings for etcd (use `https://` endpoint URLs with them).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct TlsArgs {
    /// etcd: PEM file of the CA that signed etcd's server certificate. Enables TLS.
    #[arg(long, env = "WAYPOINT_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,

    /// etcd: PEM client certificate (mutual TLS); needs --etcd-key.
    #[arg(long, env = "WAYPOINT_ETCD_CERT", requires = "etcd_key")]
    pub etcd_cert: Option<PathBuf>,

    /// etcd: PEM private key of --etcd-cert.
    #[arg(long, env = "WAYPOINT_ETCD_KEY", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
}

/// How to reach etcd: endpoint URLs and connect options, TLS material already read (so a
/// missing file fails at start, not at the first reconnect).
#[derive(Clone)]
pub struct Connector {
    endpoints: Vec<String>,
    tls: Option<TlsOptions>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("endpoints", &self.endpoints)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

/// The HTTP/2 keepalive that detects a silently dead connection (a partition gives no
/// RST): ping every 5s, give up after 5s more.
const KEEPALIVE: (Duration, Duration) = (Duration::from_secs(5), Duration::from_secs(5));
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound on unary requests (get, put, grant); the watch stream is not bounded by it.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|source| Error::ReadTls {
        what,
        path: path.to_owned(),
        source,
    })
}

impl Connector {
    /// Builds a connector for `endpoints` (URLs, e.g. `http://10.0.0.1:2379`).
    pub fn new(endpoints: Vec<String>, tls: &TlsArgs) -> Result<Connector, Error> {
        if endpoints.is_empty() {
            return Err(Error::NoEndpoints);
        }
        let mut opts = None;
        if let Some(ca) = &tls.etcd_ca {
            opts = Some(TlsOptions::new().ca_certificate(Certificate::from_pem(read("CA", ca)?)));
        }
        match (&tls.etcd_cert, &tls.etcd_key) {
            (Some(cert), Some(key)) => {
                let id = Identity::from_pem(read("client certificate", cert)?, read("key", key)?);
                opts = Some(opts.unwrap_or_default().identity(id));
            }
            (None, None) => {}
            _ => return Err(Error::HalfIdentity),
        }
        Ok(Connector {
            endpoints,
            tls: opts,
        })
    }

    /// The endpoint URLs.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Opens a client on one endpoint that answers, trying them in turn from a random one
    /// (which spreads the nodes over the members). The client stays on that member: when
    /// it goes, the caller's session fails and the next `connect` picks another.
    ///
    /// Why not one client balanced over every endpoint: tonic connects lazily, and its
    /// balancer counts an endpoint whose connection failed as ready, sends it the next
    /// request and returns the error. A refused connection fails sooner than a live
    /// member's handshake completes, so with one member down the first request of every
    /// fresh client went to the dead one: the registrar never registered, and one-shot
    /// tools failed (tests/registry_etcd_tls.rs).
    pub async fn connect(&self) -> Result<Client, Error> {
        let first = rand::random_range(0..self.endpoints.len());
        let mut failures = Vec::new();
        for url in self
            .endpoints
            .iter()
            .cycle()
            .skip(first)
            .take(self.endpoints.len())
        {
            match self.connect_to(url).await {
                Ok(client) => return Ok(client),
                Err(cause) => {
                    debug!(url, cause, "registry: etcd endpoint did not answer");
                    failures.push(format!("{url}: {cause}"));
                }
            }
        }
        Err(Error::Unreachable(failures.join("; ")))
    }

    /// A client of `url` that has answered a request, or why not. The request is what
    /// makes the connection and the TLS handshake happen here (tonic connects lazily).
    /// The whole is bounded: tonic bounds neither the TLS handshake nor the wait for a
    /// connection, so a member that accepts and then says nothing (hung, or not etcd)
    /// would hold the caller for ever.
    async fn connect_to(&self, url: &str) -> Result<Client, String> {
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(CONNECT_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT)
            .with_keep_alive(KEEPALIVE.0, KEEPALIVE.1)
            .with_keep_alive_while_idle(true);
        if let Some(tls) = &self.tls {
            opts = opts.with_tls(tls.clone());
        }
        let probe = async {
            let mut client = Client::connect([url], Some(opts)).await?;
            // Status needs no key permission and no quorum: it asks only "are you there".
            client.status().await?;
            Ok::<_, etcd_client::Error>(client)
        };
        match tokio::time::timeout(REQUEST_TIMEOUT, probe).await {
            Ok(Ok(client)) => Ok(client),
            Ok(Err(e)) => Err(root_cause(&e)),
            Err(_) => Err(format!("no answer within {REQUEST_TIMEOUT:?}")),
        }
    }
}

/// The innermost cause of a connection failure: "Connection refused (os error 111)",
/// "invalid peer certificate: UnknownIssuer", "received fatal alert: BadCertificate".
/// etcd_client's own text wraps it in gRPC and transport debug output.
fn root_cause(e: &etcd_client::Error) -> String {
    let mut cause: &dyn std::error::Error = match e {
        etcd_client::Error::GRpcStatus(status) if std::error::Error::source(status).is_none() => {
            return status.message().to_owned()
        }
        etcd_client::Error::GRpcStatus(status) => status,
        etcd_client::Error::TransportError(transport) => transport,
        other => return other.to_string(),
    };
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

fn backoff() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
}

/// Sleeps `d` unless `stop` comes first; returns whether to go on.
async fn pause_for(d: Duration, stop: &CancellationToken) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

/// Every valid record under the root at one revision, plus the skipped ones counted.
#[derive(Debug, Default)]
pub struct Listing {
    /// Endpoints by key.
    pub endpoints: BTreeMap<String, Endpoint>,
    /// The etcd revision of the listing.
    pub revision: i64,
    /// Keys that were skipped, with why.
    pub skipped: Vec<(String, record::Skip)>,
}

/// Lists the whole root in one consistent read.
pub async fn list(client: &mut Client) -> Result<Listing, Error> {
    let resp = client
        .get(record::ROOT, Some(GetOptions::new().with_prefix()))
        .await?;
    let mut out = Listing {
        revision: resp.header().map(|h| h.revision()).unwrap_or_default(),
        ..Listing::default()
    };
    for kv in resp.kvs() {
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        match record::decode(kv.key(), kv.value()) {
            Ok(ep) => {
                out.endpoints.insert(key, ep);
            }
            Err(skip) => out.skipped.push((key, skip)),
        }
    }
    Ok(out)
}

/// Writes one record (tools; no lease: it stays until deleted). Returns its key.
pub async fn put(client: &mut Client, ep: &Endpoint) -> Result<String, Error> {
    let key = record::key(ep)?;
    client.put(key.clone(), record::encode(ep), None).await?;
    Ok(key)
}

/// Deletes one key, or every key under it when `prefix`; returns how many went. Only keys
/// under the root may be deleted: a typo must not wipe someone else's data.
pub async fn delete(client: &mut Client, key: &str, prefix: bool) -> Result<i64, Error> {
    if !key.starts_with(record::ROOT) {
        return Err(Error::OutsideRoot(key.to_owned()));
    }
    let opts = prefix.then(|| DeleteOptions::new().with_prefix());
    Ok(client.delete(key, opts).await?.deleted())
}

/// Control of a running watcher.
#[derive(Debug)]
pub struct WatcherHandle {
    pause: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl WatcherHandle {
    /// Pauses (`true`) or resumes (`false`) the watch. Paused, the watcher drops its watch
    /// and holds on to the revision it reached; resumed, it watches again from the next
    /// revision, as after a network blip. For tests (to fall behind a compaction) and
    /// debugging.
    pub fn set_paused(&self, paused: bool) {
        self.pause.send_replace(paused);
    }

    /// Stops the watcher now.
    pub fn abort(&self) {
        self.task.abort();
    }
}

/// Mirrors the registry root into a [`Store`].
#[derive(Debug)]
pub struct Watcher {
    connector: Connector,
    store: Store,
    metrics: Metrics,
}

/// Why a watch session ended without an error.
enum Next {
    /// Relist (compaction, cancellation): the watch cannot resume where it was.
    Relist(&'static str),
    /// Watch again from the revision reached (after a pause).
    Resume,
}

impl Watcher {
    /// A watcher that will feed `store`.
    pub fn new(connector: Connector, store: Store, metrics: Metrics) -> Watcher {
        Watcher {
            connector,
            store,
            metrics,
        }
    }

    /// Runs the watcher in a task until `stop`.
    pub fn spawn(self, stop: CancellationToken) -> WatcherHandle {
        let (pause, paused) = watch::channel(false);
        let task = tokio::spawn(self.run(paused, stop));
        WatcherHandle { pause, task }
    }

    async fn run(self, mut paused: watch::Receiver<bool>, stop: CancellationToken) {
        let mut cache = BTreeMap::new();
        let mut revision = 0;
        // Relist when Some: at start, after any error, after compaction.
        let mut relist: Option<&'static str> = Some("initial");
        let mut delays = backoff().build();
        loop {
            let session = self.session(&mut cache, &mut revision, relist, &mut paused);
            let result = tokio::select! {
                _ = stop.cancelled() => return,
                r = session => r,
            };
            match result {
                Ok(Next::Relist(reason)) => {
                    info!(reason, revision, "registry: relisting");
                    relist = Some(reason);
                    delays = backoff().build();
                }
                Ok(Next::Resume) => {
                    relist = None;
                    delays = backoff().build();
                }
                Err(e) => {
                    let delay = delays.next().unwrap_or(Duration::from_secs(5));
                    if self.metrics.is_connected() {
                        warn!(error = %e, "registry: lost etcd; serving the last known state");
                    } else {
                        debug!(error = %e, ?delay, "registry: etcd still unreachable");
                    }
                    self.metrics.disconnected(e.to_string());
                    // A broken watch may have missed anything: relist on reconnect, so a
                    // delete made meanwhile cannot survive in the cache.
                    relist = Some("reconnected");
                    if !pause_for(delay, &stop).await {
                        return;
                    }
                }
            }
        }
    }

    fn publish(&self, cache: &BTreeMap<String, Endpoint>, revision: i64) {
        self.store
            .replace(Snapshot::new(cache.values().cloned(), true));
        self.metrics.synced(revision, cache.len());
    }

    /// One connection: (re)list if asked, then watch until something breaks.
    async fn session(
        &self,
        cache: &mut BTreeMap<String, Endpoint>,
        revision: &mut i64,
        relist: Option<&'static str>,
        paused: &mut watch::Receiver<bool>,
    ) -> Result<Next, Error> {
        // While paused, hold the last state and do nothing.
        while *paused.borrow_and_update() {
            if paused.changed().await.is_err() {
                // The handle is gone: nobody can resume us, so do not stay paused.
                break;
            }
        }
        let mut pause_open = true;
        let mut client = self.connector.connect().await?;
        if let Some(reason) = relist {
            let listing = list(&mut client).await?;
            for (key, skip) in &listing.skipped {
                debug!(key, error = %skip, "registry: record skipped");
                self.metrics.skip(skip.reason());
            }
            if reason != "initial" {
                self.metrics.relist(reason);
            }
            // Replace, never merge: whatever was deleted while we were not looking is
            // absent from the listing and so leaves the store.
            *cache = listing.endpoints;
            *revision = listing.revision;
            self.publish(cache, *revision);
            info!(
                revision,
                endpoints = cache.len(),
                skipped = listing.skipped.len(),
                "registry: listed"
            );
        }
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(*revision + 1)
            .with_progress_notify();
        let mut stream = client.watch(record::ROOT, Some(opts)).await?;
        loop {
            let msg = tokio::select! {
                changed = paused.changed(), if pause_open => {
                    if changed.is_err() {
                        pause_open = false;
                    } else if *paused.borrow() {
                        debug!(revision, "registry: watch paused");
                        return Ok(Next::Resume);
                    }
                    continue;
                }
                m = stream.message() => m?,
            };
            let Some(resp) = msg else {
                return Err(Error::WatchClosed);
            };
            if resp.compact_revision() > 0 {
                warn!(
                    revision,
                    compacted = resp.compact_revision(),
                    "registry: watch fell behind a compaction"
                );
                return Ok(Next::Relist("compacted"));
            }
            if resp.canceled() {
                warn!(
                    reason = resp.cancel_reason(),
                    "registry: watch canceled by etcd"
                );
                return Ok(Next::Relist("watch_canceled"));
            }
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                let key = String::from_utf8_lossy(kv.key()).into_owned();
                match ev.event_type() {
                    EventType::Put => match record::decode(kv.key(), kv.value()) {
                        Ok(ep) => {
                            cache.insert(key, ep);
                        }
                        Err(skip) => {
                            debug!(key, error = %skip, "registry: record skipped");
                            self.metrics.skip(skip.reason());
                            // What etcd holds at this key is no endpoint any more.
                            cache.remove(&key);
                        }
                    },
                    EventType::Delete => {
                        cache.remove(&key);
                    }
                }
            }
            if let Some(h) = resp.header() {
                *revision = (*revision).max(h.revision());
            }
            self.publish(cache, *revision);
        }
    }
}

/// Reads a `--local-endpoints` file.
pub fn load_local(path: &Path) -> Result<LocalDocument, Error> {
    let text = std::fs::read(path).map_err(|source| Error::ReadLocal {
        path: path.to_owned(),
        source,
    })?;
    let doc: LocalDocument = serde_json::from_slice(&text).map_err(|source| Error::ParseLocal {
        path: path.to_owned(),
        source,
    })?;
    let each = doc.endpoints.iter().map(|e| {
        let (svc, ns) = (e.service.as_str(), e.namespace.as_str());
        (svc, ns, e.ports.as_slice(), e.service_ports.as_slice())
    });
    crate::model::check_each(each).map_err(|source| Error::LocalPorts {
        path: path.to_owned(),
        source,
    })?;
    Ok(doc)
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// Where the registrar's endpoints come from.
#[derive(Clone, Debug)]
pub enum LocalSource {
    /// A fixed set (tests, tools).
    Fixed(Vec<LocalEndpoint>),
    /// A `--local-endpoints` file, re-read when it changes.
    File(PathBuf),
    /// A live source (the Kubernetes watchers): every new value is synced to etcd.
    /// `None` means the source does not know yet, and nothing is written until it does:
    /// registering an empty set then would delete every record of a restarted node.
    Watch(watch::Receiver<Option<LocalSet>>),
}

/// Keeps this node's endpoints registered under its lease.
#[derive(Debug)]
pub struct Registrar {
    connector: Connector,
    identity: NodeIdentity,
    source: LocalSource,
    ttl: Duration,
    metrics: Metrics,
}

/// How often the local endpoints file is checked for changes.
const LOCAL_POLL: Duration = Duration::from_secs(1);
/// Bound on the lease revoke at shutdown: a dead etcd must not hold up the drain.
const REVOKE_TIMEOUT: Duration = Duration::from_secs(2);

impl Registrar {
    /// A registrar for `identity`'s endpoints from `source`, under a lease of `ttl`
    /// (whole seconds, at least 1: etcd's unit).
    pub fn new(
        connector: Connector,
        identity: NodeIdentity,
        source: LocalSource,
        ttl: Duration,
        metrics: Metrics,
    ) -> Registrar {
        Registrar {
            connector,
            identity,
            source,
            ttl,
            metrics,
        }
    }

    /// The records to hold. `live` is the current value of a [`LocalSource::Watch`].
    fn desired(&self, live: Option<&LocalSet>) -> Result<BTreeMap<String, Vec<u8>>, Error> {
        let (identity, locals) = match (&self.source, live) {
            (LocalSource::Fixed(v), _) => (&self.identity, v.clone()),
            (LocalSource::File(p), _) => (&self.identity, load_local(p)?.endpoints),
            (LocalSource::Watch(_), Some(set)) => (&set.identity, set.endpoints.clone()),
            (LocalSource::Watch(_), None) => (&self.identity, Vec::new()),
        };
        locals
            .iter()
            .map(|l| {
                let ep = identity.endpoint(l);
                Ok((record::key(&ep)?, record::encode(&ep)))
            })
            .collect()
    }

    /// Registers and keeps the registration alive until `stop`, then revokes the lease
    /// (the node's records vanish at once instead of at lease expiry). Errors are retried
    /// with backoff, forever: a registrar gives up only when told to stop.
    pub async fn run(self, stop: CancellationToken) {
        let mut delays = backoff().build();
        loop {
            let grants = self.metrics.lease_grants();
            match self.session(&stop).await {
                Ok(()) => return,
                Err(e) => {
                    // A session that got as far as a lease worked: start the backoff over.
                    if self.metrics.lease_grants() > grants {
                        delays = backoff().build();
                    }
                    let delay = delays.next().unwrap_or(Duration::from_secs(5));
                    warn!(error = %e, ?delay, "registrar: registration lost; retrying");
                    if !pause_for(delay, &stop).await {
                        return;
                    }
                }
            }
        }
    }

    async fn session(&self, stop: &CancellationToken) -> Result<(), Error> {
        // A clone of the source's receiver: each session starts from the latest value,
        // whatever the previous session had seen.
        let mut live = match &self.source {
            LocalSource::Watch(rx) => Some(rx.clone()),
            LocalSource::Fixed(_) | LocalSource::File(_) => None,
        };
        if let Some(rx) = live.as_mut() {
            // Write nothing before the source knows the node's pods (see `Watch`), and
            // take no lease before: it would expire unrenewed while we wait.
            let known = tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                r = rx.wait_for(Option::is_some) => r.is_ok(),
            };
            if !known {
                // The source stopped before it ever knew: nothing to register.
                live = None;
            }
        }
        let mut client = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            c = self.connector.connect() => c?,
        };
        let ttl = i64::try_from(self.ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let lease = client.lease_grant(ttl, None).await?.id();
        self.metrics.lease_granted();
        let (mut keeper, mut acks) = client.lease_keep_alive(lease).await?;
        let mut written = BTreeMap::new();
        let mut last_stamp = match &self.source {
            LocalSource::File(p) => stamp(p),
            LocalSource::Fixed(_) | LocalSource::Watch(_) => None,
        };
        let desired = match live.as_mut() {
            Some(rx) => self.desired(rx.borrow_and_update().as_ref())?,
            None => self.desired(None)?,
        };
        self.sync(&mut client, lease, &desired, &mut written)
            .await?;
        info!(
            lease = format!("{lease:x}"),
            ttl,
            endpoints = written.len(),
            "registrar: registered"
        );
        // Renew at a third of the TTL: two renewals may be lost before the lease expires.
        let mut renew = tokio::time::interval((self.ttl / 3).max(Duration::from_millis(300)));
        let mut poll = tokio::time::interval(LOCAL_POLL);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return self.revoke(&mut client, lease).await,
                _ = renew.tick() => keeper.keep_alive().await?,
                ack = acks.message() => match ack? {
                    Some(a) if a.ttl() > 0 => {}
                    _ => return Err(Error::LeaseLost(lease)),
                },
                _ = poll.tick(), if matches!(self.source, LocalSource::File(_)) => {
                    let LocalSource::File(path) = &self.source else { continue };
                    let now = stamp(path);
                    if now == last_stamp {
                        continue;
                    }
                    last_stamp = now;
                    match self.desired(None) {
                        Ok(desired) => {
                            self.sync(&mut client, lease, &desired, &mut written).await?;
                            info!(endpoints = written.len(), "registrar: local endpoints changed");
                        }
                        Err(e) => warn!(error = %e, "registrar: local endpoints not reloaded; keeping the registered ones"),
                    }
                }
                changed = changed(live.as_mut()), if live.is_some() => {
                    let Some(rx) = live.as_mut().filter(|_| changed.is_ok()) else {
                        // The source is gone (shutting down): keep what is registered.
                        live = None;
                        continue;
                    };
                    let desired = self.desired(rx.borrow_and_update().as_ref())?;
                    self.sync(&mut client, lease, &desired, &mut written).await?;
                    debug!(endpoints = written.len(), "registrar: local endpoints changed");
                }
            }
        }
    }

    /// Revokes the lease at shutdown (bounded: a dead etcd must not hold up the drain).
    async fn revoke(&self, client: &mut Client, lease: i64) -> Result<(), Error> {
        match tokio::time::timeout(REVOKE_TIMEOUT, client.lease_revoke(lease)).await {
            Ok(Ok(_)) => info!(lease = format!("{lease:x}"), "registrar: lease revoked"),
            Ok(Err(e)) => {
                warn!(error = %e, "registrar: revoking the lease failed; its records expire with it")
            }
            Err(_) => warn!("registrar: revoking the lease timed out; its records expire with it"),
        }
        self.metrics.set_registered(0);
        Ok(())
    }

    /// Makes etcd hold exactly `desired` among the keys this registrar wrote. A record
    /// written with the same value in this session is not written again: a live source
    /// changes often (one pod at a time) and each change would otherwise rewrite every
    /// record of the node.
    async fn sync(
        &self,
        client: &mut Client,
        lease: i64,
        desired: &BTreeMap<String, Vec<u8>>,
        written: &mut BTreeMap<String, Vec<u8>>,
    ) -> Result<(), Error> {
        for (key, value) in desired {
            if written.get(key) == Some(value) {
                continue;
            }
            client
                .put(
                    key.clone(),
                    value.clone(),
                    Some(PutOptions::new().with_lease(lease)),
                )
                .await?;
            written.insert(key.clone(), value.clone());
        }
        let gone: Vec<String> = written
            .keys()
            .filter(|k| !desired.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            client.delete(key.clone(), None).await?;
            written.remove(&key);
        }
        self.metrics.set_registered(written.len());
        Ok(())
    }
}

/// Waits for the next value of a live source; pending for ever without one.
async fn changed(
    rx: Option<&mut watch::Receiver<Option<LocalSet>>>,
) -> Result<(), watch::error::RecvError> {
    match rx {
        Some(rx) => rx.changed().await,
        None => std::future::pending().await,
    }
}

/// The endpoints of a registry location at one point in time (for `waypoint resolve`).
pub async fn snapshot(connector: &Connector) -> Result<Listing, Error> {
    let mut client = connector.connect().await?;
    list(&mut client).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    /// A `--local-endpoints` file whose service port goes to a pod port the endpoint does
    /// not list is refused at start, naming the file, the endpoint and the ports.
    #[test]
    fn a_local_endpoint_whose_ports_do_not_hold_together_is_refused() {
        let path = std::env::temp_dir().join(format!("waypoint-local-{}.json", std::process::id()));
        std::fs::write(
            &path,
            r#"{"endpoints": [
                {"service": "web", "namespace": "shop", "pod_ip": "10.1.0.7", "ports": [9080],
                 "service_ports": [{"port": 80, "target_port": 9080}]},
                {"service": "api", "namespace": "shop", "pod_ip": "10.1.0.8", "ports": [9080],
                 "service_ports": [{"port": 80, "target_port": 8080}]}
            ]}"#,
        )
        .unwrap();
        let err = load_local(&path).unwrap_err().to_string();
        std::fs::remove_file(&path).unwrap();
        assert!(
            err.contains("endpoint 1 (api.shop): service port 80 goes to pod port 8080"),
            "{err}"
        );
        assert!(err.contains(&path.display().to_string()), "{err}");
    }
}
