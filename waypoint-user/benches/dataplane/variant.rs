//! A variant under test (a dataplane, or none for direct TCP): its addresses, counters
//! and samples, and the eBPF dataplane's segment counters read around a measurement.

use std::{
    fmt::Write as _,
    net::SocketAddr,
    sync::{atomic::Ordering::Relaxed, Arc},
};

use waypoint::dataplane::Dataplane;

use crate::{
    bulk::BulkSample, client::wait_for, latency::PingSample, proxy::ProxyCounters, summary::pct,
};

pub(crate) struct Variant {
    pub(crate) name: &'static str,
    pub(crate) dp: Option<Arc<Dataplane>>,
    /// Where the bulk client and the ping-pong client connect.
    pub(crate) bulk_addr: SocketAddr,
    pub(crate) echo_addr: SocketAddr,
    pub(crate) counters: Arc<ProxyCounters>,
    pub(crate) bulk: [Vec<BulkSample>; 2],
    pub(crate) ping: Vec<PingSample>,
    /// Round trips after an idle pause (p50 µs per repetition).
    pub(crate) wake: Vec<f64>,
}

impl Variant {
    pub(crate) fn ebpf_stats(&self) -> Option<Vec<(&'static str, u64)>> {
        match self.dp.as_deref() {
            Some(Dataplane::Ebpf(e)) => {
                Some(e.stats().into_iter().map(|(s, n)| (s.label(), n)).collect())
            }
            _ => None,
        }
    }

    /// Waits until every proxied connection of this variant has finished.
    pub(crate) fn settle(&self) {
        let c = self.counters.clone();
        wait_for("proxied connections to finish", move || {
            c.active.load(Relaxed) == 0
        });
    }
}

pub(crate) fn stats_delta(
    before: &Option<Vec<(&'static str, u64)>>,
    after: &Option<Vec<(&'static str, u64)>>,
) -> Option<Vec<(&'static str, u64)>> {
    let (Some(b), Some(a)) = (before, after) else {
        return None;
    };
    Some(
        a.iter()
            .zip(b)
            .map(|((label, n), (_, m))| (*label, n - m))
            .collect(),
    )
}

pub(crate) fn stats_line(delta: &[(&'static str, u64)]) -> String {
    let total: u64 = delta.iter().map(|(_, n)| n).sum();
    let redirected = delta
        .iter()
        .find(|(l, _)| *l == "redirected")
        .map_or(0, |(_, n)| *n);
    let mut line = format!(
        "segments redirected {:.1}% of {total}:",
        pct(redirected, total)
    );
    for (label, n) in delta {
        let _ = write!(line, " {label}={n}");
    }
    line
}
