//! The router's metrics. Labels are small fixed sets: never an IP, never a client's SNI.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabel {
    pub(crate) reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct EndLabel {
    pub(crate) end: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct WorkerLabel {
    pub(crate) worker: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DirectionLabel {
    pub(crate) direction: &'static str,
}

/// Counters and gauges of the tunnel listener.
#[derive(Clone, Debug)]
pub struct Metrics {
    pub(crate) accepted: Family<WorkerLabel, Counter>,
    pub(crate) opened: Counter,
    pub(crate) closed: Family<EndLabel, Counter>,
    pub(crate) rejected: Family<ReasonLabel, Counter>,
    pub(crate) bytes: Family<DirectionLabel, Counter>,
    pub(crate) active: Gauge,
    pub(crate) pending: Gauge,
    pub(crate) handshake: Histogram,
    pub(crate) upstream_retries: Counter,
}

impl Metrics {
    /// Creates the metrics and registers them.
    pub fn new(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            accepted: Family::default(),
            opened: Counter::default(),
            closed: Family::default(),
            rejected: Family::default(),
            bytes: Family::default(),
            active: Gauge::default(),
            pending: Gauge::default(),
            // 50 µs .. ~3.3 s: a hello read plus an upstream connect.
            handshake: Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
                50e-6, 2.0, 17,
            )),
            upstream_retries: Counter::default(),
        };
        registry.register(
            "connections_accepted",
            "Connections accepted on the tunnel port, by worker (the kernel spreads them \
             over the workers' listeners by a hash of the addresses)",
            m.accepted.clone(),
        );
        registry.register(
            "connections_opened",
            "Connections routed to a pod and handed to the dataplane",
            m.opened.clone(),
        );
        registry.register(
            "connections_closed",
            "Routed connections that ended, by how they ended",
            m.closed.clone(),
        );
        registry.register(
            "connections_rejected",
            "Connections refused before reaching a pod, by reason; accept_error counts failed accept attempts (out of descriptors: the connection waits in the backlog, tried again every 10 ms)",
            m.rejected.clone(),
        );
        registry.register(
            "bytes",
            "Bytes forwarded by routed connections (counted when a connection ends)",
            m.bytes.clone(),
        );
        registry.register(
            "active_connections",
            "Routed connections open now",
            m.active.clone(),
        );
        registry.register(
            "pending_handshakes",
            "Accepted connections still sending their ClientHello or being routed",
            m.pending.clone(),
        );
        registry.register(
            "handshake_duration_seconds",
            "From accept to the upstream connected (hello read, routing, connect)",
            m.handshake.clone(),
        );
        registry.register(
            "upstream_retries",
            "Upstream connect attempts after a failed one",
            m.upstream_retries.clone(),
        );
        m
    }

    pub(crate) fn reject(&self, reason: &'static str) {
        self.rejected.get_or_create(&ReasonLabel { reason }).inc();
    }
}
