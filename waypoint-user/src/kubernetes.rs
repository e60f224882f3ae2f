//! The Kubernetes source (`--kubernetes`): watches this node's Node object, the pods on
//! this node, every Service and every `discovery.k8s.io/v1` EndpointSlice, and publishes
//! the node's desired registration ([`LocalSet`]) for the etcd
//! [`Registrar`](crate::registry::etcd::Registrar) to sync.
//!
//! The rules live in [`desired`], a pure function of the four watched sets; this module
//! only keeps the sets current with kube-runtime reflectors. Watch failures never stop it:
//! a broken watch is resumed, `410 Gone` relists, an unreachable API server is retried
//! with backoff (kube-runtime's default: 0.8 s doubling to 30 s, with jitter); each is
//! logged and counted in `waypoint_kubernetes_watch_errors_total{resource}`, and the last
//! known state stays published meanwhile. A relist replaces a set atomically, so objects
//! deleted while the watch was broken leave it.

pub mod desired;
pub mod metrics;

use std::{fmt::Debug, hash::Hash, pin::Pin, time::Duration};

use futures::{stream::select_all, Stream, StreamExt as _};
use k8s_openapi::api::{
    core::v1::{Node, Pod, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    runtime::{
        reflector::{self, Store},
        watcher::{self, watcher},
        WatchStreamExt as _,
    },
    Api, Client,
};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

pub use metrics::{Metrics, Watched};

use crate::registry::local::{LocalSet, NodeIdentity};

/// Errors of the Kubernetes source.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No usable client configuration (the cause is the source: the error chain shows it).
    #[error("no Kubernetes API client configuration: check the in-cluster service account, or KUBECONFIG / ~/.kube/config")]
    Client(#[source] kube::Error),
}

/// Settings of the Kubernetes source.
#[derive(Clone, Debug)]
pub struct Config {
    /// Who the node is according to the flags: `node` names the Node object to watch
    /// (`--node-name`); `node_ip`, `region` and `zone` win over the Node's when set
    /// (see [`desired::identity`]).
    pub flags: NodeIdentity,
    /// After a change, how long to wait for more before recomputing: a rollout or a
    /// relist brings changes in bursts.
    pub settle: Duration,
}

impl Config {
    /// The settings for `flags`, with the default settle time (100 ms).
    pub fn new(flags: NodeIdentity) -> Config {
        Config {
            flags,
            settle: Duration::from_millis(100),
        }
    }
}

/// A client from the in-cluster service account or, outside a cluster, KUBECONFIG (or
/// `~/.kube/config`).
pub async fn client() -> Result<Client, Error> {
    Client::try_default().await.map_err(Error::Client)
}

/// What a watch stream said, reduced to what the loop needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    Apply,
    Delete,
    /// A (re)list started.
    Init,
    /// An object of a (re)list.
    InitApply,
    /// A (re)list completed: the reflector's store was replaced.
    InitDone,
}

impl<K> From<watcher::Event<K>> for Seen {
    fn from(ev: watcher::Event<K>) -> Seen {
        match ev {
            watcher::Event::Apply(_) => Seen::Apply,
            watcher::Event::Delete(_) => Seen::Delete,
            watcher::Event::Init => Seen::Init,
            watcher::Event::InitApply(_) => Seen::InitApply,
            watcher::Event::InitDone => Seen::InitDone,
        }
    }
}

type Events = Pin<Box<dyn Stream<Item = (Watched, Result<Seen, watcher::Error>)> + Send>>;

/// A reflector of `api` into a new store, with kube-runtime's default backoff after
/// errors. `managedFields` are dropped: they are most of an object's size and nothing
/// here reads them (the Service and EndpointSlice caches are cluster-wide).
fn reflect<K>(api: Api<K>, config: watcher::Config, what: Watched) -> (Store<K>, Events)
where
    K: kube::Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    let (store, writer) = reflector::store();
    let events = watcher(api, config)
        .default_backoff()
        .modify(|o: &mut K| o.meta_mut().managed_fields = None)
        .reflect(writer)
        .map(move |r| (what, r.map(Seen::from)));
    (store, Box::pin(events))
}

/// The four reflectors' stores.
struct Stores {
    nodes: Store<Node>,
    pods: Store<Pod>,
    services: Store<Service>,
    slices: Store<EndpointSlice>,
}

/// Watches the API server and publishes this node's desired registration.
pub struct Source {
    client: Client,
    config: Config,
    metrics: Metrics,
}

impl Source {
    /// A source reading through `client`.
    pub fn new(client: Client, config: Config, metrics: Metrics) -> Source {
        Source {
            client,
            config,
            metrics,
        }
    }

    /// Runs the watches in a task until `stop`. The receiver holds `None` until every
    /// watched set has been listed once, then each new desired registration.
    pub fn spawn(self, stop: CancellationToken) -> watch::Receiver<Option<LocalSet>> {
        let (tx, rx) = watch::channel(None);
        tokio::spawn(self.run(tx, stop));
        rx
    }

    async fn run(self, tx: watch::Sender<Option<LocalSet>>, stop: CancellationToken) {
        let node = &self.config.flags.node;
        let c = &self.client;
        let (nodes, node_events) = reflect(
            Api::<Node>::all(c.clone()),
            watcher::Config::default().fields(&format!("metadata.name={node}")),
            Watched::Node,
        );
        let (pods, pod_events) = reflect(
            Api::<Pod>::all(c.clone()),
            watcher::Config::default().fields(&format!("spec.nodeName={node}")),
            Watched::Pod,
        );
        let (services, service_events) = reflect(
            Api::<Service>::all(c.clone()),
            watcher::Config::default(),
            Watched::Service,
        );
        let (slices, slice_events) = reflect(
            Api::<EndpointSlice>::all(c.clone()),
            watcher::Config::default(),
            Watched::EndpointSlice,
        );
        let stores = Stores {
            nodes,
            pods,
            services,
            slices,
        };
        let mut events = select_all([node_events, pod_events, service_events, slice_events]);
        // Which sets have been listed completely at least once.
        let mut listed = [false; Watched::ALL.len()];
        // When to recompute: `settle` after the first change since the last time.
        let mut due: Option<tokio::time::Instant> = None;
        info!(
            node,
            "kubernetes: watching the node, its pods, services and endpointslices"
        );
        loop {
            let deadline = due.unwrap_or_else(tokio::time::Instant::now);
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep_until(deadline), if due.is_some() => {
                    due = None;
                    if listed.iter().all(|l| *l) {
                        self.publish(&tx, &stores);
                    }
                }
                item = events.next() => {
                    // The watcher streams never end: they retry for ever.
                    let Some((what, seen)) = item else { return };
                    if self.seen(what, seen, &mut listed) && due.is_none() {
                        due = Some(tokio::time::Instant::now() + self.config.settle);
                    }
                }
            }
        }
    }

    /// Accounts for one item of a watch stream; returns whether the stores changed.
    fn seen(
        &self,
        what: Watched,
        seen: Result<Seen, watcher::Error>,
        listed: &mut [bool; Watched::ALL.len()],
    ) -> bool {
        let resource = what.as_str();
        match seen {
            Ok(Seen::Apply) => self.metrics.event(what, "apply"),
            Ok(Seen::Delete) => self.metrics.event(what, "delete"),
            Ok(Seen::Init | Seen::InitApply) => return false,
            Ok(Seen::InitDone) => {
                self.metrics.event(what, "list");
                let first = !listed[what as usize];
                listed[what as usize] = true;
                if first {
                    debug!(resource, "kubernetes: listed");
                } else {
                    self.metrics.relist(what);
                    info!(resource, "kubernetes: relisted");
                }
            }
            Err(e) => {
                self.metrics.error(what);
                // The stream goes on by itself: resumed, relisted on 410 Gone, or retried
                // after a backoff.
                warn!(resource, error = %e, "kubernetes: watch error; retrying");
                return false;
            }
        }
        true
    }

    fn publish(&self, tx: &watch::Sender<Option<LocalSet>>, s: &Stores) {
        let flags = &self.config.flags;
        let nodes = s.nodes.state();
        let node = nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(flags.node.as_str()));
        let set = desired::local_set(
            flags,
            node,
            &s.pods.state(),
            &s.services.state(),
            &s.slices.state(),
        );
        self.metrics
            .computed(set.endpoints.len(), set.identity.node_ip.is_some());
        tx.send_if_modified(|current| {
            let old = current.as_ref();
            if old == Some(&set) {
                return false;
            }
            let before = old.map(|o| &o.identity);
            if before != Some(&set.identity) {
                if node.is_none() {
                    warn!(
                        node = flags.node,
                        "kubernetes: no Node of this name (check --node-name); node IP from --node-ip only"
                    );
                }
                info!(
                    node_ip = ?set.identity.node_ip,
                    region = set.identity.region,
                    zone = set.identity.zone,
                    "kubernetes: node identity"
                );
            }
            info!(
                endpoints = set.endpoints.len(),
                ready = set.endpoints.iter().filter(|e| e.ready).count(),
                "kubernetes: desired endpoints changed"
            );
            *current = Some(set);
            true
        });
    }
}
