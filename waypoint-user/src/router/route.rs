//! Which pods a routed connection may go to, and which one it tries first.
//!
//! Routing cannot be steered by the client beyond naming an exported service: the address
//! dialed is always a registered, ready pod of that service in this node's own cluster, at
//! the configured pod port. Nothing from the SNI but the service, namespace and port (the
//! latter only to check the pod serves it) is used.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex},
};

use rand::Rng as _;

use crate::{model::Endpoint, sni::Target, store::Snapshot};

/// Where a waypoint may send connections for its own cluster's services.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Scope {
    /// Only pods on this node.
    Node,
    /// Pods on this node first; other nodes of this cluster when none is ready here, or
    /// when every one here failed to connect.
    Cluster,
}

/// Why no pod can take a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoRoute {
    /// No endpoint of that service in this cluster.
    #[error("unknown service")]
    UnknownService,
    /// The service exists here but is not exported.
    #[error("service not exported")]
    NotExported,
    /// The service is exported but no ready pod in scope serves that port.
    #[error("no ready endpoint")]
    NoEndpoint,
}

impl NoRoute {
    /// Metric label.
    pub fn reason(self) -> &'static str {
        match self {
            NoRoute::UnknownService => "unknown_service",
            NoRoute::NotExported => "not_exported",
            NoRoute::NoEndpoint => "no_endpoint",
        }
    }
}

/// The routing policy of one waypoint.
#[derive(Clone, Debug)]
pub struct Policy {
    /// This node's cluster.
    pub cluster: String,
    /// This node's name.
    pub node: String,
    /// Node only, or node first then cluster.
    pub scope: Scope,
    /// Route to services that are not marked exported (labs only).
    pub export_all: bool,
}

impl Policy {
    /// The pods a connection for `target` may go to, in tiers: this node's ready pods,
    /// then (when the scope allows) the cluster's others.
    pub fn candidates(&self, snap: &Snapshot, target: &Target) -> Result<Candidates, NoRoute> {
        let ours: Vec<&Arc<Endpoint>> = snap
            .endpoints(&target.namespace, &target.service)
            .iter()
            .filter(|e| e.cluster == self.cluster)
            .collect();
        if ours.is_empty() {
            return Err(NoRoute::UnknownService);
        }
        if !self.export_all && !ours.iter().any(|e| e.exported) {
            return Err(NoRoute::NotExported);
        }
        let usable: Vec<&Arc<Endpoint>> = ours
            .into_iter()
            .filter(|e| (self.export_all || e.exported) && e.ready && e.serves(target.port))
            .collect();
        let (local, elsewhere): (Vec<Arc<Endpoint>>, Vec<Arc<Endpoint>>) = usable
            .into_iter()
            .cloned()
            .partition(|e| e.node_name == self.node);
        let mut tiers = vec![local];
        if self.scope == Scope::Cluster {
            tiers.push(elsewhere);
        }
        tiers.retain(|t| !t.is_empty());
        if tiers.is_empty() {
            return Err(NoRoute::NoEndpoint);
        }
        Ok(Candidates { tiers })
    }
}

/// The pods a connection may go to, best tier first: this node's, then the rest of the
/// cluster's ([`Scope::Cluster`]). A tier is tried only once every pod of the tiers
/// before it was tried and failed.
#[derive(Debug, PartialEq)]
pub struct Candidates {
    /// Never empty, none of them empty when built.
    tiers: Vec<Vec<Arc<Endpoint>>>,
}

impl Candidates {
    /// Leases the next pod to try, from the best tier that still has one untried.
    pub fn pick(&mut self, balancer: &Balancer) -> Option<(Arc<Endpoint>, Lease)> {
        let tier = self.tiers.iter_mut().find(|t| !t.is_empty())?;
        balancer.pick(tier)
    }

    /// The tiers left, best first (tests and diagnostics).
    pub fn tiers(&self) -> &[Vec<Arc<Endpoint>>] {
        &self.tiers
    }
}

/// Active connection counts per pod, for balancing.
#[derive(Debug, Default)]
pub struct Balancer {
    active: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// Holds one active connection to a pod; releases it on drop. Owns a handle on the
/// counts, so that a connection's task can hold it without borrowing the router.
#[derive(Debug)]
pub struct Lease {
    balancer: Balancer,
    ip: IpAddr,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut active = self.balancer.lock();
        if let Some(n) = active.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                active.remove(&self.ip);
            }
        }
    }
}

impl Balancer {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, usize>> {
        // Counts stay consistent under a panic elsewhere: every update is one statement.
        self.active.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the better of two random candidates (fewer active connections) out of
    /// `candidates` and leases it. Power of two choices: nearly as even as least
    /// connections, without herding every new connection onto the same idle pod.
    pub fn pick(&self, candidates: &mut Vec<Arc<Endpoint>>) -> Option<(Arc<Endpoint>, Lease)> {
        let n = candidates.len();
        let idx = match n {
            0 => return None,
            1 => 0,
            _ => {
                let mut rng = rand::rng();
                let a = rng.random_range(0..n);
                let mut b = rng.random_range(0..n - 1);
                if b >= a {
                    b += 1;
                }
                let active = self.lock();
                let load = |i: usize| active.get(&candidates[i].pod_ip).copied().unwrap_or(0);
                if load(b) < load(a) {
                    b
                } else {
                    a
                }
            }
        };
        let ep = candidates.swap_remove(idx);
        *self.lock().entry(ep.pod_ip).or_default() += 1;
        let lease = Lease {
            balancer: Balancer {
                active: self.active.clone(),
            },
            ip: ep.pod_ip,
        };
        Some((ep, lease))
    }

    /// Active connections to `ip` (for tests and diagnostics).
    pub fn active(&self, ip: IpAddr) -> usize {
        self.lock().get(&ip).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    fn ep(svc: &str, cluster: &str, node: &str, ip: &str, ready: bool, exported: bool) -> Endpoint {
        Endpoint {
            service: svc.into(),
            namespace: "ns".into(),
            cluster: cluster.into(),
            region: String::new(),
            zone: String::new(),
            pod_ip: ip.parse().unwrap(),
            pod_name: String::new(),
            node_name: node.into(),
            node_ip: None,
            service_account: "sa".into(),
            ports: vec![8080],
            service_ports: Vec::new(),
            ready,
            exported,
        }
    }

    fn target(svc: &str, port: u16) -> Target {
        Target {
            port,
            service: svc.into(),
            namespace: "ns".into(),
        }
    }

    fn policy(scope: Scope, export_all: bool) -> Policy {
        Policy {
            cluster: "a".into(),
            node: "n1".into(),
            scope,
            export_all,
        }
    }

    fn ips(v: &[Arc<Endpoint>]) -> Vec<String> {
        let mut v: Vec<String> = v.iter().map(|e| e.pod_ip.to_string()).collect();
        v.sort();
        v
    }

    fn tiers(c: &Candidates) -> Vec<Vec<String>> {
        c.tiers().iter().map(|t| ips(t)).collect()
    }

    #[test]
    fn prefers_this_node_then_cluster_never_other_clusters() {
        let snap = Snapshot::new(
            [
                ep("web", "a", "n1", "10.0.0.1", true, true),
                ep("web", "a", "n2", "10.0.0.2", true, true),
                ep("web", "b", "n1", "10.0.0.3", true, true),
            ],
            true,
        );
        let p = policy(Scope::Cluster, false);
        assert_eq!(
            tiers(&p.candidates(&snap, &target("web", 8080)).unwrap()),
            [vec!["10.0.0.1"], vec!["10.0.0.2"]]
        );
        assert_eq!(
            tiers(
                &policy(Scope::Node, false)
                    .candidates(&snap, &target("web", 8080))
                    .unwrap()
            ),
            [vec!["10.0.0.1"]]
        );

        let snap = Snapshot::new(
            [
                ep("web", "a", "n1", "10.0.0.1", false, true),
                ep("web", "a", "n2", "10.0.0.2", true, true),
                ep("web", "b", "n1", "10.0.0.3", true, true),
            ],
            true,
        );
        assert_eq!(
            tiers(&p.candidates(&snap, &target("web", 8080)).unwrap()),
            [vec!["10.0.0.2"]]
        );
        let node_only = policy(Scope::Node, false);
        assert_eq!(
            node_only.candidates(&snap, &target("web", 8080)),
            Err(NoRoute::NoEndpoint)
        );
    }

    #[test]
    fn rejections() {
        let snap = Snapshot::new(
            [
                ep("web", "a", "n1", "10.0.0.1", true, true),
                ep("internal", "a", "n1", "10.0.0.5", true, false),
                ep("remote", "b", "n1", "10.0.0.6", true, true),
            ],
            true,
        );
        let p = policy(Scope::Cluster, false);
        assert_eq!(
            p.candidates(&snap, &target("nope", 8080)),
            Err(NoRoute::UnknownService)
        );
        // Another cluster's service is never reachable through this waypoint.
        assert_eq!(
            p.candidates(&snap, &target("remote", 8080)),
            Err(NoRoute::UnknownService)
        );
        assert_eq!(
            p.candidates(&snap, &target("internal", 8080)),
            Err(NoRoute::NotExported)
        );
        assert_eq!(
            p.candidates(&snap, &target("web", 9090)),
            Err(NoRoute::NoEndpoint)
        );
        let lab = policy(Scope::Cluster, true);
        assert_eq!(
            tiers(&lab.candidates(&snap, &target("internal", 8080)).unwrap()),
            [vec!["10.0.0.5"]]
        );
    }

    /// Every pod of this node is picked before any of the cluster's others.
    #[test]
    fn the_next_tier_comes_after_every_pod_of_this_one() {
        let snap = Snapshot::new(
            [
                ep("web", "a", "n1", "10.0.0.1", true, true),
                ep("web", "a", "n1", "10.0.0.2", true, true),
                ep("web", "a", "n2", "10.0.0.3", true, true),
                ep("web", "a", "n3", "10.0.0.4", true, true),
            ],
            true,
        );
        let b = Balancer::default();
        let mut c = policy(Scope::Cluster, false)
            .candidates(&snap, &target("web", 8080))
            .unwrap();
        let mut order = Vec::new();
        while let Some((ep, _lease)) = c.pick(&b) {
            order.push(ep);
        }
        assert_eq!(order.len(), 4);
        let (here, elsewhere) = order.split_at(2);
        assert_eq!(ips(here), ["10.0.0.1", "10.0.0.2"]);
        assert_eq!(ips(elsewhere), ["10.0.0.3", "10.0.0.4"]);
    }

    #[test]
    fn balancer_spreads_and_releases() {
        let b = Balancer::default();
        let all: Vec<Arc<Endpoint>> = (1..=4)
            .map(|i| Arc::new(ep("web", "a", "n1", &format!("10.0.0.{i}"), true, true)))
            .collect();
        let mut leases = Vec::new();
        for _ in 0..400 {
            let mut c = all.clone();
            let (_, lease) = b.pick(&mut c).unwrap();
            leases.push(lease);
        }
        for e in &all {
            let n = b.active(e.pod_ip);
            assert!(
                (60..=140).contains(&n),
                "power of two choices keeps loads close: {n}"
            );
        }
        drop(leases);
        for e in &all {
            assert_eq!(b.active(e.pod_ip), 0);
        }
        let mut empty = Vec::new();
        assert!(b.pick(&mut empty).is_none());
    }
}
