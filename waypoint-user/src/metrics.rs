//! Prometheus metrics, prefix `waypoint_`. Labels are small enums only: never an IP or a
//! client-supplied name.

use std::sync::{Arc, Mutex};

use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::dataplane::Dataplane;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DataplaneLabel {
    dataplane: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabel {
    action: &'static str,
}

/// The daemon's metrics.
pub struct Metrics {
    registry: Registry,
    dataplane: Arc<Dataplane>,
    ebpf_segments: Family<ActionLabel, Counter>,
    // Last values read from the kernel, to turn its totals into counter increments.
    ebpf_seen: Mutex<Vec<u64>>,
}

impl Metrics {
    /// Registers the metrics for a daemon using `dataplane`.
    pub fn new(dataplane: Arc<Dataplane>) -> Metrics {
        let mut registry = Registry::with_prefix("waypoint");
        let info = Family::<DataplaneLabel, Gauge>::default();
        info.get_or_create(&DataplaneLabel {
            dataplane: dataplane.kind().as_str(),
        })
        .set(1);
        registry.register(
            "dataplane",
            "The dataplane in use (value is always 1; see the label)",
            info,
        );
        let ebpf_segments = Family::<ActionLabel, Counter>::default();
        if matches!(*dataplane, Dataplane::Ebpf(_)) {
            registry.register(
                "ebpf_segments",
                "Segments seen by the stream verdict, by what it did with them",
                ebpf_segments.clone(),
            );
        }
        Metrics {
            registry,
            dataplane,
            ebpf_segments,
            ebpf_seen: Mutex::new(Vec::new()),
        }
    }

    /// The registry, for subsystems to register their own metrics.
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// Renders the OpenMetrics text exposition.
    pub fn render(&self) -> String {
        if let Dataplane::Ebpf(e) = &*self.dataplane {
            let stats = e.stats();
            let mut seen = self.ebpf_seen.lock().unwrap_or_else(|p| p.into_inner());
            seen.resize(stats.len(), 0);
            for (i, (stat, total)) in stats.into_iter().enumerate() {
                let delta = total.saturating_sub(seen[i]);
                seen[i] = total;
                self.ebpf_segments
                    .get_or_create(&ActionLabel {
                        action: stat.label(),
                    })
                    .inc_by(delta);
            }
        }
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
