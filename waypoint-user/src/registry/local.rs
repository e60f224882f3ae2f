//! This node as the registry sees it: who it is ([`NodeIdentity`], stamped on every record
//! it registers) and its pods ([`LocalEndpoint`], [`LocalSet`]), whichever source lists
//! them (`--local-endpoints`, the Kubernetes watchers) and whichever backend registers
//! them.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::model::{Endpoint, ServicePort};

/// One of this node's pods, as listed in `--local-endpoints`. The cluster, node, node IP
/// and locality come from the daemon's own flags.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalEndpoint {
    /// Service name.
    pub service: String,
    /// Namespace.
    pub namespace: String,
    /// The pod's IP.
    pub pod_ip: IpAddr,
    /// The pod's name (the key uses the pod IP when empty).
    #[serde(default)]
    pub pod_name: String,
    /// The pod's service account.
    #[serde(default)]
    pub service_account: String,
    /// The pod's ports that serve the service; empty means any.
    #[serde(default)]
    pub ports: Vec<u16>,
    /// The service's ports and the pod port each goes to; empty: each of `ports` is a
    /// service port of the same number.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service_ports: Vec<ServicePort>,
    /// Whether the pod is ready.
    #[serde(default = "yes")]
    pub ready: bool,
    /// Whether the service is exported.
    #[serde(default)]
    pub exported: bool,
}

fn yes() -> bool {
    true
}

/// The `--local-endpoints` document.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalDocument {
    /// This node's pods.
    pub endpoints: Vec<LocalEndpoint>,
}

/// Who this node is: stamped on every record it registers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeIdentity {
    /// Cluster.
    pub cluster: String,
    /// Node name.
    pub node: String,
    /// Node IP (None: other clusters cannot reach these pods through the waypoint).
    pub node_ip: Option<IpAddr>,
    /// Region.
    pub region: String,
    /// Zone.
    pub zone: String,
}

impl NodeIdentity {
    /// The full endpoint of a local pod.
    pub fn endpoint(&self, l: &LocalEndpoint) -> Endpoint {
        Endpoint {
            service: l.service.clone(),
            namespace: l.namespace.clone(),
            cluster: self.cluster.clone(),
            region: self.region.clone(),
            zone: self.zone.clone(),
            pod_ip: l.pod_ip,
            pod_name: l.pod_name.clone(),
            node_name: self.node.clone(),
            node_ip: self.node_ip,
            service_account: l.service_account.clone(),
            ports: l.ports.clone(),
            service_ports: l.service_ports.clone(),
            ready: l.ready,
            exported: l.exported,
        }
    }
}

/// A node's desired registration as a live source computes it: who the node is now
/// (its IP and locality may change) and its endpoints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalSet {
    /// Stamped on every record, instead of the registrar's own identity.
    pub identity: NodeIdentity,
    /// This node's pods.
    pub endpoints: Vec<LocalEndpoint>,
}
