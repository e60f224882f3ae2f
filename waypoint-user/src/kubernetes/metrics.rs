//! The Kubernetes source's metrics (`waypoint_kubernetes_*`): what its watches see and
//! what it computes. Labels are the watched resource and the event kind: small enums.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

/// A watched resource, as a label value.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Watched {
    /// This node's Node object.
    Node,
    /// The pods on this node.
    Pod,
    /// Every Service.
    Service,
    /// Every `discovery.k8s.io/v1` EndpointSlice.
    EndpointSlice,
}

impl Watched {
    /// Every resource, in watch order.
    pub const ALL: [Watched; 4] = [
        Watched::Node,
        Watched::Pod,
        Watched::Service,
        Watched::EndpointSlice,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Watched::Node => "node",
            Watched::Pod => "pod",
            Watched::Service => "service",
            Watched::EndpointSlice => "endpointslice",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabel {
    resource: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabel {
    resource: &'static str,
    /// `apply`, `delete` (watch events), `list` (a complete (re)list).
    event: &'static str,
}

/// Metrics of the Kubernetes source. Cheap to clone (shared counters).
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    events: Family<EventLabel, Counter>,
    errors: Family<ResourceLabel, Counter>,
    relists: Family<ResourceLabel, Counter>,
    desired: Gauge,
    node_ip_known: Gauge,
    recomputes: Counter,
}

impl Metrics {
    /// Creates the metrics and registers them under `waypoint_kubernetes_*`.
    pub fn new(registry: &mut Registry) -> Metrics {
        let m = Metrics::unregistered();
        let r = registry.sub_registry_with_prefix("kubernetes");
        r.register(
            "watch_events",
            "Watch events received, by resource and event (apply, delete, list: a complete (re)list)",
            m.events.clone(),
        );
        r.register(
            "watch_errors",
            "Watch errors (list or watch failed, stream broken, 410 Gone, API server unreachable), by resource",
            m.errors.clone(),
        );
        r.register(
            "relists",
            "Lists after the first one (after 410 Gone or a broken watch), by resource",
            m.relists.clone(),
        );
        r.register(
            "endpoints_desired",
            "Endpoints of this node's pods the registration should hold, as last computed",
            m.desired.clone(),
        );
        r.register(
            "recomputes",
            "Times this node's desired endpoints were computed from the watched state",
            m.recomputes.clone(),
        );
        r.register(
            "node_ip_known",
            "1 when this node's IP is known (--node-ip or the Node's InternalIP), else 0",
            m.node_ip_known.clone(),
        );
        m
    }

    /// Metrics that are not exported (tests).
    pub fn unregistered() -> Metrics {
        Metrics::default()
    }

    pub(crate) fn event(&self, resource: Watched, event: &'static str) {
        self.events
            .get_or_create(&EventLabel {
                resource: resource.as_str(),
                event,
            })
            .inc();
    }

    pub(crate) fn error(&self, resource: Watched) {
        self.errors
            .get_or_create(&ResourceLabel {
                resource: resource.as_str(),
            })
            .inc();
    }

    pub(crate) fn relist(&self, resource: Watched) {
        self.relists
            .get_or_create(&ResourceLabel {
                resource: resource.as_str(),
            })
            .inc();
    }

    pub(crate) fn computed(&self, endpoints: usize, node_ip_known: bool) {
        self.desired
            .set(i64::try_from(endpoints).unwrap_or(i64::MAX));
        self.node_ip_known.set(i64::from(node_ip_known));
        self.recomputes.inc();
    }

    /// Watch events so far for `resource` and `event` (`apply`, `delete`, `list`).
    pub fn events(&self, resource: Watched, event: &'static str) -> u64 {
        self.events
            .get_or_create(&EventLabel {
                resource: resource.as_str(),
                event,
            })
            .get()
    }

    /// Watch errors so far for `resource`.
    pub fn errors(&self, resource: Watched) -> u64 {
        self.errors
            .get_or_create(&ResourceLabel {
                resource: resource.as_str(),
            })
            .get()
    }

    /// Relists so far for `resource`.
    pub fn relists(&self, resource: Watched) -> u64 {
        self.relists
            .get_or_create(&ResourceLabel {
                resource: resource.as_str(),
            })
            .get()
    }

    /// Times the desired endpoints were computed.
    pub fn recomputes(&self) -> u64 {
        self.recomputes.get()
    }

    /// The last computed number of desired endpoints.
    pub fn desired(&self) -> i64 {
        self.desired.get()
    }
}
