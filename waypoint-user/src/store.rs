//! The endpoint store: the current set of endpoints, indexed by service, published as an
//! immutable snapshot that readers take without locking (a `watch` channel of `Arc`s).
//!
//! Sources (the etcd registry, a static file) replace the whole snapshot; the router only
//! reads. The store also says whether it has been synced once, for readiness.

use std::{collections::HashMap, sync::Arc};

use tokio::sync::watch;

use crate::model::Endpoint;

/// A service's identity: (namespace, name).
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServiceKey {
    /// Namespace.
    pub namespace: String,
    /// Service name.
    pub service: String,
}

/// An immutable view of every known endpoint.
#[derive(Debug, Default)]
pub struct Snapshot {
    services: HashMap<ServiceKey, Vec<Arc<Endpoint>>>,
    /// Whether a source has delivered its full state at least once.
    pub synced: bool,
}

impl Snapshot {
    /// Builds a snapshot from a flat list of endpoints.
    pub fn new(endpoints: impl IntoIterator<Item = Endpoint>, synced: bool) -> Snapshot {
        let mut services: HashMap<ServiceKey, Vec<Arc<Endpoint>>> = HashMap::new();
        for ep in endpoints {
            let key = ServiceKey {
                namespace: ep.namespace.clone(),
                service: ep.service.clone(),
            };
            services.entry(key).or_default().push(Arc::new(ep));
        }
        Snapshot { services, synced }
    }

    /// The endpoints of a service, every cluster, every state.
    pub fn endpoints(&self, namespace: &str, service: &str) -> &[Arc<Endpoint>] {
        // Building a key allocates; services are few and lookups are per connection, so
        // this is cheap next to the connect that follows.
        let key = ServiceKey {
            namespace: namespace.to_owned(),
            service: service.to_owned(),
        };
        self.services.get(&key).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Every endpoint, in no particular order.
    pub fn all(&self) -> impl Iterator<Item = &Arc<Endpoint>> {
        self.services.values().flatten()
    }

    /// Number of endpoints.
    pub fn len(&self) -> usize {
        self.services.values().map(Vec::len).sum()
    }

    /// Whether there is no endpoint.
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }
}

/// The writer side of the store.
#[derive(Clone, Debug)]
pub struct Store {
    tx: Arc<watch::Sender<Arc<Snapshot>>>,
}

impl Default for Store {
    fn default() -> Self {
        Store::new()
    }
}

impl Store {
    /// An empty, not yet synced store.
    pub fn new() -> Store {
        let (tx, _) = watch::channel(Arc::new(Snapshot::default()));
        Store { tx: Arc::new(tx) }
    }

    /// Replaces the whole content.
    pub fn replace(&self, snapshot: Snapshot) {
        self.tx.send_replace(Arc::new(snapshot));
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.tx.borrow().clone()
    }

    /// A receiver that is notified of every replacement.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.tx.subscribe()
    }

    /// Whether the store has been synced at least once.
    pub fn is_synced(&self) -> bool {
        self.tx.borrow().synced
    }
}
