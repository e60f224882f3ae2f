//! The registry's metrics and connection health: what `/metrics` exports and what the
//! `/readyz` body says about the registry.

use std::{
    sync::{atomic::AtomicU64, Arc, Mutex},
    time::Instant,
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Debug)]
struct Health {
    connected: bool,
    /// When the last successful exchange with etcd happened (or the watcher started).
    last_contact: Instant,
    /// The etcd revision the store reflects; 0 before the first list.
    revision: i64,
    last_error: Option<String>,
}

/// Metrics and health of the etcd registry. Cheap to clone (shared counters).
#[derive(Clone, Debug)]
pub struct Metrics {
    skipped: Family<ReasonLabel, Counter>,
    relists: Family<ReasonLabel, Counter>,
    connected: Gauge,
    stale: Gauge<f64, AtomicU64>,
    endpoints: Gauge,
    registered: Gauge,
    leases: Counter,
    health: Arc<Mutex<Health>>,
}

impl Metrics {
    /// Creates the metrics and registers them under `waypoint_registry_*`.
    pub fn new(registry: &mut Registry) -> Metrics {
        let m = Metrics::unregistered();
        let r = registry.sub_registry_with_prefix("registry");
        r.register(
            "records_skipped",
            "Records under the registry root that were not taken into the store, by reason",
            m.skipped.clone(),
        );
        r.register(
            "relists",
            "Full relists of the registry root after the initial one, by reason",
            m.relists.clone(),
        );
        r.register(
            "connected",
            "1 while the registry watch is established, 0 while etcd is unreachable",
            m.connected.clone(),
        );
        r.register(
            "stale_seconds",
            "Seconds since the store last heard from etcd while disconnected; 0 when connected",
            m.stale.clone(),
        );
        r.register(
            "endpoints",
            "Endpoints in the store, every cluster",
            m.endpoints.clone(),
        );
        r.register(
            "registered_endpoints",
            "Endpoints this node keeps registered under its lease",
            m.registered.clone(),
        );
        r.register(
            "lease_grants",
            "Leases this node was granted (more than one: etcd was lost or the lease expired)",
            m.leases.clone(),
        );
        m
    }

    /// Metrics that are not exported (tools and tests).
    pub fn unregistered() -> Metrics {
        Metrics {
            skipped: Family::default(),
            relists: Family::default(),
            connected: Gauge::default(),
            stale: Gauge::default(),
            endpoints: Gauge::default(),
            registered: Gauge::default(),
            leases: Counter::default(),
            health: Arc::new(Mutex::new(Health {
                connected: false,
                last_contact: Instant::now(),
                revision: 0,
                last_error: None,
            })),
        }
    }

    fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        // A panic while holding this lock leaves plain data behind: keep using it.
        self.health.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn skip(&self, reason: &'static str) {
        self.skipped.get_or_create(&ReasonLabel { reason }).inc();
    }

    pub(crate) fn relist(&self, reason: &'static str) {
        self.relists.get_or_create(&ReasonLabel { reason }).inc();
    }

    pub(crate) fn lease_granted(&self) {
        self.leases.inc();
    }

    pub(crate) fn set_registered(&self, n: usize) {
        self.registered.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub(crate) fn synced(&self, revision: i64, endpoints: usize) {
        let mut h = self.health();
        h.connected = true;
        h.last_contact = Instant::now();
        h.revision = revision;
        h.last_error = None;
        self.connected.set(1);
        self.stale.set(0.0);
        self.endpoints
            .set(i64::try_from(endpoints).unwrap_or(i64::MAX));
    }

    pub(crate) fn disconnected(&self, error: String) {
        let mut h = self.health();
        if h.connected {
            h.last_contact = Instant::now();
        }
        h.connected = false;
        h.last_error = Some(error);
        self.connected.set(0);
    }

    /// Records skipped so far for `reason` (see [`crate::registry::record::Skip::reason`]).
    pub fn skipped(&self, reason: &'static str) -> u64 {
        self.skipped.get_or_create(&ReasonLabel { reason }).get()
    }

    /// Relists so far for `reason` (`compacted`, `watch_canceled`, `reconnected`).
    pub fn relists(&self, reason: &'static str) -> u64 {
        self.relists.get_or_create(&ReasonLabel { reason }).get()
    }

    /// Leases granted so far.
    pub fn lease_grants(&self) -> u64 {
        self.leases.get()
    }

    /// Whether the watch is established.
    pub fn is_connected(&self) -> bool {
        self.health().connected
    }

    /// Updates the staleness gauge; called before each scrape.
    pub fn refresh(&self) {
        let h = self.health();
        let stale = if h.connected {
            0.0
        } else {
            h.last_contact.elapsed().as_secs_f64()
        };
        self.stale.set(stale);
    }

    /// One line for the `/readyz` body.
    pub fn detail(&self) -> String {
        let h = self.health();
        if h.connected {
            format!("registry: etcd connected, revision {}", h.revision)
        } else if h.revision == 0 {
            format!(
                "registry: etcd not reached yet ({})",
                h.last_error.as_deref().unwrap_or("connecting")
            )
        } else {
            format!(
                "registry: etcd unreachable for {:.0}s ({}); serving the last known state (revision {})",
                h.last_contact.elapsed().as_secs_f64(),
                h.last_error.as_deref().unwrap_or("unknown error"),
                h.revision
            )
        }
    }
}
