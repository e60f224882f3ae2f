//! What the waypoint knows about a pod endpoint, independent of where it came from (the
//! etcd registry, a static file, Kubernetes).

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// One pod's endpoint of one service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    /// Service name (a DNS-1123 label).
    pub service: String,
    /// Namespace (a DNS-1123 label).
    pub namespace: String,
    /// Name of the cluster the pod runs in.
    pub cluster: String,
    /// Locality: region.
    #[serde(default)]
    pub region: String,
    /// Locality: zone.
    #[serde(default)]
    pub zone: String,
    /// The pod's IP: routable inside its own cluster only.
    pub pod_ip: IpAddr,
    /// The pod's name.
    #[serde(default)]
    pub pod_name: String,
    /// The node the pod runs on.
    pub node_name: String,
    /// The node's IP, routable across clusters. None when unknown.
    #[serde(default)]
    pub node_ip: Option<IpAddr>,
    /// The pod's service account (its SPIFFE identity is derived from it).
    #[serde(default)]
    pub service_account: String,
    /// Ports the service serves on this pod (demuxed by the pod's inbound on the SNI).
    /// Empty means "any".
    #[serde(default)]
    pub ports: Vec<u16>,
    /// Whether the pod is ready to serve.
    #[serde(default = "default_true")]
    pub ready: bool,
    /// Whether the service is exported to other clusters (reachable through waypoints).
    #[serde(default)]
    pub exported: bool,
}

fn default_true() -> bool {
    true
}

impl Endpoint {
    /// Whether this endpoint serves `port`.
    pub fn serves(&self, port: u16) -> bool {
        self.ports.is_empty() || self.ports.contains(&port)
    }
}
