//! Prometheus metrics, prefix `waypoint_`. Labels are small enums only: never an IP or a
//! client-supplied name.

use std::sync::Arc;

use prometheus_client::{
    collector::Collector,
    encoding::{text::encode, DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{
        counter::ConstCounter,
        family::Family,
        gauge::{ConstGauge, Gauge},
    },
    registry::Registry,
};

use waypoint_common::Stat;

use crate::dataplane::{adopt::Adopter, choice::Chosen, Dataplane};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DataplaneLabel {
    dataplane: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChosenLabel {
    dataplane: &'static str,
    reason: &'static str,
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
struct PathReasonLabel {
    path: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

/// The daemon's metrics: the router's own (registered by it through
/// [`Metrics::registry_mut`]) and the dataplane's, which a [`DataplaneCollector`] reads
/// from the dataplane at each scrape.
pub struct Metrics {
    registry: Registry,
}

impl Metrics {
    /// Registers the metrics for a daemon using `dataplane`, chosen as `chosen` says.
    pub fn new(dataplane: Arc<Dataplane>, chosen: &Chosen) -> Metrics {
        let mut registry = Registry::with_prefix("waypoint");
        let info = Family::<ChosenLabel, Gauge>::default();
        info.get_or_create(&ChosenLabel {
            dataplane: chosen.path,
            reason: chosen.reason.as_str(),
        })
        .set(1);
        registry.register(
            "dataplane",
            "The path connections take (ebpf-rewrite, ebpf, splice, copy) and why: asked \
             (--dataplane named it), probed (auto: the kernel took it), rewrite_refused \
             (auto: the kernel refused the rewrite program, or no CAP_NET_RAW for its \
             resets), ebpf_refused (auto: the kernel refused the eBPF dataplane); the log \
             and /readyz say how; sockmap_unfixed (auto: the kernel lacks the 2023 sockmap fixes the \
             SockHash redirect needs). Always 1",
            info,
        );
        registry.register_collector(Box::new(DataplaneCollector { dataplane }));
        registry.register_collector(Box::new(HeapCollector));
        Metrics { registry }
    }

    /// Registers the adopter's metrics (see `dataplane::adopt`).
    pub fn register_adopter(&mut self, adopter: Arc<Adopter>) {
        self.registry
            .register_collector(Box::new(AdoptCollector { adopter }));
    }

    /// Registers `waypoint_migration_program`, which the caller sets once the tunnel
    /// listeners are up (see `migrate.rs`).
    pub fn register_migration(&mut self) -> Gauge {
        let attached = Gauge::default();
        self.registry.register(
            "migration_program",
            "1 when the reuseport program that moves a closing listener's queued \
             connections to this daemon's tunnel listeners is attached to their group, 0 \
             when not (--migrate-requests=false, Linux before 5.14, no CAP_BPF)",
            attached.clone(),
        );
        attached
    }

    /// The registry, for subsystems to register their own metrics.
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// Renders the OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The allocator's own account of the daemon's heap, read at each scrape: what RSS
/// cannot tell apart (live state against memory freed and kept resident for reuse).
#[derive(Debug)]
struct HeapCollector;

impl Collector for HeapCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        use tikv_jemalloc_ctl::{epoch, stats};
        // jemalloc caches its statistics until the epoch advances. Where it answers
        // nothing (it always does when it is the allocator), there is nothing to say.
        if epoch::advance().is_err() {
            return Ok(());
        }
        for (name, help, read) in [
            (
                "heap_allocated_bytes",
                "Bytes the daemon's heap holds allocated (jemalloc's stats.allocated): its \
                 live state, connections' included",
                stats::allocated::read as fn() -> tikv_jemalloc_ctl::Result<usize>,
            ),
            (
                "heap_resident_bytes",
                "Bytes of the heap's pages resident in memory (jemalloc's stats.resident): \
                 the allocated bytes, freed ones kept for reuse, and the allocator's own",
                stats::resident::read,
            ),
        ] {
            if let Ok(n) = read() {
                single(&mut encoder, name, help, gauge(n as u64))?;
            }
        }
        Ok(())
    }
}

/// The adopter's counts, read at each scrape.
#[derive(Debug)]
struct AdoptCollector {
    adopter: Arc<Adopter>,
}

impl Collector for AdoptCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let c = self.adopter.counts();
        single(
            &mut encoder,
            "adopted_programs",
            "Rewrite programs of daemons that are gone, held by this one until their last              connection ends",
            gauge(c.programs),
        )?;
        single(
            &mut encoder,
            "adopted_connections",
            "Rewritten connections of daemons that are gone, held by this one",
            gauge(c.connections),
        )?;
        single(
            &mut encoder,
            "adoptions",
            "Rewritten connections adopted from daemons that were gone",
            counter(c.adopted),
        )?;
        single(
            &mut encoder,
            "adopted_resets",
            "Adopted connections reset at the idle timeout or the lifetime (counted from              their adoption)",
            counter(c.reset),
        )?;
        single(
            &mut encoder,
            "adoption_refusals",
            "Rewrite programs of gone daemons whose map's layout this daemon does not read:              removed, their connections end at their next packet",
            counter(c.refused),
        )
    }
}

/// The dataplane's totals, read at each scrape and encoded by name: each counter is the
/// dataplane's own running total (no copy of it to keep in step).
struct DataplaneCollector {
    dataplane: Arc<Dataplane>,
}

impl std::fmt::Debug for DataplaneCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataplaneCollector")
            .field("dataplane", &self.dataplane.kind())
            .finish()
    }
}

/// One metric family: its descriptor, then each (labels, value).
fn family<L: EncodeLabelSet, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    members: impl IntoIterator<Item = (L, M)>,
) -> Result<(), std::fmt::Error> {
    let mut members = members.into_iter().peekable();
    let Some((_, first)) = members.peek() else {
        return Ok(());
    };
    let mut family = encoder.encode_descriptor(name, help, None, first.metric_type())?;
    for (labels, metric) in members {
        metric.encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// One metric without labels.
fn single<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    metric: M,
) -> Result<(), std::fmt::Error> {
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

fn counter(n: u64) -> ConstCounter<u64> {
    ConstCounter::new(n)
}

fn gauge(n: u64) -> ConstGauge<i64> {
    ConstGauge::new(i64::try_from(n).unwrap_or(i64::MAX))
}

impl Collector for DataplaneCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        family(
            &mut encoder,
            "dataplane_path",
            "Connections by the path they took, once it was final, and why not the faster \
             one: rewrite (qualified); redirect, the SockHash (rewrite_off, or the \
             rewrite's refusal: not_ipv4, options, busy, setup, local, leaving); copy (short: ended \
             before --move-after; fallback: could not enter the SockHash; dataplane: the \
             copy dataplane); splice (dataplane)",
            self.dataplane.paths().into_iter().map(|(t, n)| {
                let (path, reason) = t.labels();
                (PathReasonLabel { path, reason }, counter(n))
            }),
        )?;
        if let Dataplane::Ebpf(e) = &*self.dataplane {
            let stats = e.stats();
            // A lost signal is not a segment of its own: its segment is counted too.
            let lost = stats
                .iter()
                .find(|(stat, _)| *stat == Stat::SignalLost)
                .map_or(0, |&(_, n)| n);
            family(
                &mut encoder,
                "ebpf_segments",
                "Segments seen by the stream verdict, by what it did with them",
                stats
                    .iter()
                    .filter(|(stat, _)| *stat != Stat::SignalLost)
                    .map(|&(stat, n)| {
                        let action = stat.label();
                        (ActionLabel { action }, counter(n))
                    }),
            )?;
            family(
                &mut encoder,
                "ebpf_connections",
                "eBPF connections by path: moved = carried --move-after bytes in the \
                 userspace copy and went on to enter the SockHash; fallback = could not \
                 enter it (half-closed, maps full) and were copied to the end, moved ones \
                 included",
                [("moved", e.handovers()), ("fallback", e.fallbacks())]
                    .map(|(path, n)| (PathLabel { path }, counter(n))),
            )?;
            let (read, sweeps) = e.signals();
            family(
                &mut encoder,
                "ebpf_signals",
                "The verdict's signals that a quiet redirected socket has bytes for the daemon: \
                 read = taken from the ring buffer; lost = dropped by a full ring; sweeps = \
                 times every waiting connection was woken to look for itself after a loss",
                [("read", read), ("lost", lost), ("sweeps", sweeps)]
                    .map(|(signal, n)| (SignalLabel { signal }, counter(n))),
            )?;
            if let Some((counts, stats)) = e.rewrite_counts() {
                let refused = crate::dataplane::rewrite::Refusal::ALL
                    .iter()
                    .zip(counts.refused)
                    .map(|(reason, n)| (reason.metric_label(), n));
                family(
                    &mut encoder,
                    "rewrite_connections",
                    "Connections offered to the rewrite (--rewrite-splice): rewritten; \
                     refused_* = handed to the SockHash (not_ipv4, options, busy, setup, local, leaving); \
                     filled = rewritten, and the waypoint's socket carried bytes the client \
                     sent during the hand-over; stranded = a packet reached the waypoint's \
                     socket during the hand-over that it could not carry, both ends reset",
                    [
                        ("rewritten", counts.rewritten),
                        ("filled", counts.filled),
                        ("stranded", counts.stranded),
                    ]
                    .into_iter()
                    .chain(refused)
                    .map(|(result, n)| (ResultLabel { result }, counter(n))),
                )?;
                family(
                    &mut encoder,
                    "rewrite_packets",
                    "Packets of rewritten connections seen by the rewrite program, by what it \
                     did with them; looked_up counts every packet to or from a port of a \
                     rewritten connection, which the program looks up in its map (it lets \
                     every other packet of the node through on a check of its ports)",
                    stats.iter().map(|&(stat, n)| {
                        let action = stat.label();
                        (ActionLabel { action }, counter(n))
                    }),
                )?;
                single(
                    &mut encoder,
                    "rewrite_live",
                    "Connections rewritten whose map entries are in: open, or \
                     ended and lingering (up to 3 s, for a last ACK or a resent FIN)",
                    gauge(counts.live),
                )?;
                single(
                    &mut encoder,
                    "rewrite_lingers_cut",
                    "Ended connections whose 3 s linger was cut short because more than \
                     waypoint_rewrite_linger_limit lingered (each holds a local port to the \
                     pod and a descriptor)",
                    counter(counts.lingers_cut),
                )?;
                single(
                    &mut encoder,
                    "rewrite_linger_limit",
                    "How many ended connections may linger at once: a quarter of the \
                     ephemeral port range and of the open-file limit",
                    gauge(counts.linger_limit),
                )?;
                let links = e.rewrite_links().unwrap_or_default();
                single(
                    &mut encoder,
                    "rewrite_interfaces",
                    "Network interfaces the rewrite program is attached to (every one of \
                     the node's, including those added after start)",
                    gauge(links.attached),
                )?;
                single(
                    &mut encoder,
                    "rewrite_attach_failures",
                    "Interfaces added after start that the rewrite program could not be \
                     attached to (logged); a pod answering through one is not rewritten \
                     correctly",
                    counter(links.failed),
                )?;
                single(
                    &mut encoder,
                    "rewrite_unacknowledged",
                    "Rewritten connections whose waypoint socket to the pod still waits for \
                     the pod to acknowledge the hello; it goes into repair mode once the pod \
                     has, so that a killed daemon's socket closes without a FIN (most do at \
                     the hand-over)",
                    gauge(counts.unacknowledged),
                )?;
                single(
                    &mut encoder,
                    "rewrite_recorded",
                    "Connections rewritten whose sequence numbers came from the \
                     kernel's records of their handshakes; the rest were read with socket \
                     options (repair mode), which costs about 17 more system calls each",
                    counter(counts.recorded),
                )?;
            }
        }
        let p = self.dataplane.parking();
        single(
            &mut encoder,
            "connections_parked",
            "Idle connections parked outside tokio's reactor now (see --park-after)",
            gauge(p.parked as u64),
        )?;
        single(
            &mut encoder,
            "connection_parks",
            "Times an idle connection was parked",
            counter(p.parks),
        )?;
        single(
            &mut encoder,
            "connection_park_failures",
            "Times an idle connection could not be parked and stayed in tokio",
            counter(p.failures),
        )?;
        family(
            &mut encoder,
            "dataplane_backlog_wakeups",
            "Times the daemon woke the kernel's backlog of a socket in the SockHash that \
             held redirected bytes and sent none while the socket's send queue was empty. \
             Kernels without the 2023 sockmap fixes (before 6.4 and 6.1.32; 5.10.y) leave \
             such a backlog asleep",
            [(
                DataplaneLabel {
                    dataplane: self.dataplane.kind().as_str(),
                },
                counter(self.dataplane.backlog_wakeups()),
            )],
        )?;
        family(
            &mut encoder,
            "dataplane_stalls",
            "Connections counted as stalled (each once, and logged at warn): bytes held \
             inside the waypoint towards a side with an empty send queue, and no byte count \
             of either side moved for --stall-after. The eBPF dataplane's userspace copy \
             phase counts as ebpf",
            [(
                DataplaneLabel {
                    dataplane: self.dataplane.kind().as_str(),
                },
                counter(self.dataplane.stalls()),
            )],
        )
    }
}
