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
    /// The pod's ports that serve the service: its inbound demuxes on them (the SNI
    /// carries one), and a waypoint routes to them. Empty means "any".
    #[serde(default)]
    pub ports: Vec<u16>,
    /// The service's ports and the pod port each goes to (a Kubernetes Service's `port`
    /// and `targetPort`). Empty: each of `ports` is a service port of the same number.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service_ports: Vec<ServicePort>,
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

/// A service port and the pod port it goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServicePort {
    /// The port clients dial the service at (what `<svc>.<ns>:<port>` names).
    pub port: u16,
    /// The pod's port behind it (one of the endpoint's `ports`).
    pub target_port: u16,
}

impl Endpoint {
    /// Whether the pod port `port` of this endpoint serves the service.
    pub fn serves(&self, port: u16) -> bool {
        self.ports.is_empty() || self.ports.contains(&port)
    }

    /// The pod port behind the service port `port`; None if the service port does not
    /// reach this pod.
    pub fn target_port(&self, port: u16) -> Option<u16> {
        target_port(&self.ports, &self.service_ports, port)
    }
}

/// [`Endpoint::target_port`] over an endpoint's `ports` and `service_ports`.
pub fn target_port(ports: &[u16], service_ports: &[ServicePort], port: u16) -> Option<u16> {
    if service_ports.is_empty() {
        (ports.is_empty() || ports.contains(&port)).then_some(port)
    } else {
        service_ports
            .iter()
            .find(|p| p.port == port)
            .map(|p| p.target_port)
    }
}

/// Why an endpoint's ports do not hold together.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PortError {
    /// Port 0 is not a port.
    #[error("port 0 is not a port")]
    Zero,
    /// A service port goes to a pod port the endpoint does not list.
    #[error("service port {port} goes to pod port {target_port}, which is not among the pod's ports {ports:?}")]
    NotServed {
        /// The service port.
        port: u16,
        /// Its pod port.
        target_port: u16,
        /// The pod's ports.
        ports: Vec<u16>,
    },
    /// One service port named twice.
    #[error("service port {0} is listed twice")]
    Twice(u16),
}

/// An endpoint of a file whose ports do not hold together ([`check_each`]).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("endpoint {index} ({service}.{namespace}): {source}")]
pub struct BadPorts {
    /// Its position in the file, from 0.
    pub index: usize,
    /// Its service.
    pub service: String,
    /// Its namespace.
    pub namespace: String,
    /// What is wrong.
    pub source: PortError,
}

/// [`check_ports`] on each of a file's endpoints, given as (service, namespace, ports,
/// service ports): the first that fails.
pub fn check_each<'a>(
    endpoints: impl IntoIterator<Item = (&'a str, &'a str, &'a [u16], &'a [ServicePort])>,
) -> Result<(), BadPorts> {
    for (index, (service, namespace, ports, service_ports)) in endpoints.into_iter().enumerate() {
        check_ports(ports, service_ports).map_err(|source| BadPorts {
            index,
            service: service.to_owned(),
            namespace: namespace.to_owned(),
            source,
        })?;
    }
    Ok(())
}

/// Checks an endpoint's `ports` and `service_ports` (see [`Endpoint`]).
pub fn check_ports(ports: &[u16], service_ports: &[ServicePort]) -> Result<(), PortError> {
    if ports.contains(&0)
        || service_ports
            .iter()
            .any(|p| p.port == 0 || p.target_port == 0)
    {
        return Err(PortError::Zero);
    }
    let mut seen = std::collections::BTreeSet::new();
    for p in service_ports {
        if !seen.insert(p.port) {
            return Err(PortError::Twice(p.port));
        }
        if !ports.is_empty() && !ports.contains(&p.target_port) {
            return Err(PortError::NotServed {
                port: p.port,
                target_port: p.target_port,
                ports: ports.to_vec(),
            });
        }
    }
    Ok(())
}
