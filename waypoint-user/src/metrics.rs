//! Prometheus metrics, prefix `waypoint_`. Labels are small enums only: never an IP or a
//! client-supplied name.

use std::sync::{Arc, Mutex};

use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use waypoint_common::Stat;

use crate::dataplane::Dataplane;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DataplaneLabel {
    dataplane: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabel {
    action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SignalLabel {
    signal: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabel {
    path: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

/// The daemon's metrics.
pub struct Metrics {
    registry: Registry,
    dataplane: Arc<Dataplane>,
    ebpf_segments: Family<ActionLabel, Counter>,
    ebpf_connections: Family<PathLabel, Counter>,
    ebpf_signals: Family<SignalLabel, Counter>,
    rewrite_connections: Family<ResultLabel, Counter>,
    rewrite_packets: Family<ActionLabel, Counter>,
    rewrite_live: Gauge,
    rewrite_interfaces: Gauge,
    rewrite_attach_failures: Counter,
    rewrite_recorded: Counter,
    // Last totals read from the rewrite splice, as `ebpf_seen`.
    rewrite_seen: Mutex<Vec<u64>>,
    // Last totals read from the dataplane, to turn them into counter increments: the
    // verdict's statistics, then the connections moved and fallen back, then the signals.
    ebpf_seen: Mutex<Vec<u64>>,
    parked: Gauge,
    parks: Counter,
    park_failures: Counter,
    // Last parking totals read, as `ebpf_seen`.
    parks_seen: Mutex<Vec<u64>>,
    stalls: Family<DataplaneLabel, Counter>,
    // Last stall totals read, as `ebpf_seen`.
    stalls_seen: Mutex<crate::dataplane::Stalls>,
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
        let ebpf_connections = Family::<PathLabel, Counter>::default();
        let ebpf_signals = Family::<SignalLabel, Counter>::default();
        let rewrite_connections = Family::<ResultLabel, Counter>::default();
        let rewrite_packets = Family::<ActionLabel, Counter>::default();
        let rewrite_live = Gauge::default();
        let rewrite_interfaces = Gauge::default();
        let rewrite_attach_failures = Counter::default();
        let rewrite_recorded = Counter::default();
        if let Dataplane::Ebpf(e) = &*dataplane {
            if e.rewrite_counts().is_some() {
                registry.register(
                    "rewrite_connections",
                    "Connections offered to the rewrite splice (--rewrite-splice): spliced; \
                     refused_* = handed to the SockHash (not_ipv4, options, busy, setup, local); \
                     stranded = a packet reached the waypoint's socket during the hand-over, \
                     both ends reset",
                    rewrite_connections.clone(),
                );
                registry.register(
                    "rewrite_packets",
                    "Packets of spliced connections seen by the rewrite program, by what it \
                     did with them; looked_up counts every packet to or from a port of a \
                     spliced connection, which the program looks up in its map (it lets \
                     every other packet of the node through on a check of its ports)",
                    rewrite_packets.clone(),
                );
                registry.register(
                    "rewrite_live",
                    "Connections spliced by rewriting whose map entries are in: open, or \
                     ended and lingering (3 s, for a last ACK or a resent FIN)",
                    rewrite_live.clone(),
                );
                registry.register(
                    "rewrite_interfaces",
                    "Network interfaces the rewrite program is attached to (every one of \
                     the node's, including those added after start)",
                    rewrite_interfaces.clone(),
                );
                registry.register(
                    "rewrite_attach_failures",
                    "Interfaces added after start that the rewrite program could not be \
                     attached to (logged); a pod answering through one is not spliced \
                     correctly",
                    rewrite_attach_failures.clone(),
                );
                registry.register(
                    "rewrite_recorded",
                    "Connections spliced by rewriting whose sequence numbers came from the \
                     kernel's records of their handshakes; the rest were read with socket \
                     options (repair mode), which costs about 17 more system calls each",
                    rewrite_recorded.clone(),
                );
            }
            registry.register(
                "ebpf_segments",
                "Segments seen by the stream verdict, by what it did with them",
                ebpf_segments.clone(),
            );
            registry.register(
                "ebpf_connections",
                "eBPF connections by path: moved = carried --splice-after bytes in the \
                 userspace copy and went on to enter the SockHash; fallback = could not \
                 enter it (half-closed, maps full) and were copied to the end, moved ones \
                 included",
                ebpf_connections.clone(),
            );
            registry.register(
                "ebpf_signals",
                "The verdict's signals that a quiet spliced socket has bytes for the daemon: \
                 read = taken from the ring buffer; lost = dropped by a full ring; sweeps = \
                 times every waiting connection was woken to look for itself after a loss",
                ebpf_signals.clone(),
            );
        }
        let parked = Gauge::default();
        registry.register(
            "connections_parked",
            "Idle connections parked outside tokio's reactor now (see --park-after)",
            parked.clone(),
        );
        let parks = Counter::default();
        registry.register(
            "connection_parks",
            "Times an idle connection was parked",
            parks.clone(),
        );
        let park_failures = Counter::default();
        registry.register(
            "connection_park_failures",
            "Times an idle connection could not be parked and stayed in tokio",
            park_failures.clone(),
        );
        let stalls = Family::<DataplaneLabel, Counter>::default();
        // Every label from the start, so that a stall shows as an increase from 0.
        drop(stalls.get_or_create(&DataplaneLabel {
            dataplane: dataplane.kind().as_str(),
        }));
        registry.register(
            "dataplane_stalls",
            "Connections counted as stalled (each once, and logged at warn): bytes held \
             inside the waypoint towards a side with an empty send queue, and no byte count \
             of either side moved for --stall-after. The eBPF dataplane's userspace copy \
             phase counts as ebpf",
            stalls.clone(),
        );
        Metrics {
            registry,
            dataplane,
            ebpf_segments,
            ebpf_connections,
            ebpf_signals,
            ebpf_seen: Mutex::new(Vec::new()),
            rewrite_connections,
            rewrite_packets,
            rewrite_live,
            rewrite_interfaces,
            rewrite_attach_failures,
            rewrite_recorded,
            rewrite_seen: Mutex::new(Vec::new()),
            parked,
            parks,
            park_failures,
            parks_seen: Mutex::new(Vec::new()),
            stalls,
            stalls_seen: Mutex::new(crate::dataplane::Stalls::default()),
        }
    }

    /// The registry, for subsystems to register their own metrics.
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// Renders the OpenMetrics text exposition.
    pub fn render(&self) -> String {
        if let Dataplane::Ebpf(e) = &*self.dataplane {
            let mut seen = self.ebpf_seen.lock().unwrap_or_else(|p| p.into_inner());
            let stats = e.stats();
            let n = stats.len();
            let mut lost = 0;
            for (i, (stat, total)) in stats.into_iter().enumerate() {
                // A lost signal is not a segment of its own: its segment is counted too.
                if stat == Stat::SignalLost {
                    lost = total;
                    continue;
                }
                let counter = self.ebpf_segments.get_or_create(&ActionLabel {
                    action: stat.label(),
                });
                inc_to(&counter, &mut seen, i, total);
            }
            let connections = [("moved", e.handovers()), ("fallback", e.fallbacks())];
            for (j, (path, total)) in connections.into_iter().enumerate() {
                let counter = self.ebpf_connections.get_or_create(&PathLabel { path });
                inc_to(&counter, &mut seen, n + j, total);
            }
            let (read, sweeps) = e.signals();
            let signals = [("read", read), ("lost", lost), ("sweeps", sweeps)];
            for (j, (signal, total)) in signals.into_iter().enumerate() {
                let counter = self.ebpf_signals.get_or_create(&SignalLabel { signal });
                inc_to(&counter, &mut seen, n + 2 + j, total);
            }
            if let Some((counts, stats)) = e.rewrite_counts() {
                let mut seen = self.rewrite_seen.lock().unwrap_or_else(|p| p.into_inner());
                let mut results = vec![("spliced", counts.spliced), ("stranded", counts.stranded)];
                for (reason, total) in crate::dataplane::rewrite::Refusal::ALL
                    .iter()
                    .zip(counts.refused)
                {
                    results.push((reason.metric_label(), total));
                }
                let k = results.len();
                for (i, (result, total)) in results.into_iter().enumerate() {
                    let counter = self
                        .rewrite_connections
                        .get_or_create(&ResultLabel { result });
                    inc_to(&counter, &mut seen, i, total);
                }
                let stats_len = stats.len();
                for (j, (stat, total)) in stats.into_iter().enumerate() {
                    let counter = self.rewrite_packets.get_or_create(&ActionLabel {
                        action: stat.label(),
                    });
                    inc_to(&counter, &mut seen, k + j, total);
                }
                self.rewrite_live
                    .set(i64::try_from(counts.live).unwrap_or(i64::MAX));
                if let Some(links) = e.rewrite_links() {
                    self.rewrite_interfaces
                        .set(i64::try_from(links.attached).unwrap_or(i64::MAX));
                    let at = k + stats_len;
                    inc_to(&self.rewrite_attach_failures, &mut seen, at, links.failed);
                }
                let at = k + stats_len + 1;
                inc_to(&self.rewrite_recorded, &mut seen, at, counts.recorded);
            }
        }
        let p = crate::dataplane::parking();
        self.parked.set(i64::try_from(p.parked).unwrap_or(i64::MAX));
        {
            let mut seen = self.parks_seen.lock().unwrap_or_else(|p| p.into_inner());
            inc_to(&self.parks, &mut seen, 0, p.parks);
            inc_to(&self.park_failures, &mut seen, 1, p.failures);
        }
        {
            let now = crate::dataplane::stalls();
            let mut seen = self.stalls_seen.lock().unwrap_or_else(|p| p.into_inner());
            let before = seen.by_dataplane();
            for ((kind, total), (_, before)) in now.by_dataplane().into_iter().zip(before) {
                if total > before {
                    let dataplane = kind.as_str();
                    self.stalls
                        .get_or_create(&DataplaneLabel { dataplane })
                        .inc_by(total - before);
                }
            }
            *seen = now;
        }
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// Raises `counter` by what `total` grew since `seen[i]`.
fn inc_to(counter: &Counter, seen: &mut Vec<u64>, i: usize, total: u64) {
    if seen.len() <= i {
        seen.resize(i + 1, 0);
    }
    counter.inc_by(total.saturating_sub(seen[i]));
    seen[i] = total;
}
