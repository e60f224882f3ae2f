//! The registry's records: the protobuf schema (`proto/registry.proto`, compiled by
//! prost-build), the versioned key layout under [`ROOT`], and the conversion to and from
//! [`crate::model::Endpoint`]. docs/REGISTRY.md documents both for other writers.
//!
//! Reading is lenient by design: the root is shared by every cluster and by writers of
//! other versions, so a key of unknown shape or a value that does not decode is a reason
//! to skip one record ([`Skip`]), never to fail the whole registry.

use std::net::IpAddr;

use prost::Message as _;

use crate::model::{check_ports, Endpoint, ServicePort};

/// The generated protobuf types (package `aether.registry.v1`).
pub mod pb {
    #![allow(missing_docs, reason = "generated code; documented in the .proto")]
    include!(concat!(env!("OUT_DIR"), "/aether.registry.v1.rs"));
}

/// The root every record lives under. The `v1` is the layout's version: a layout that
/// old readers cannot parse goes under a new root, never under this one.
pub const ROOT: &str = "/aether/v1/regions/";

/// Key segment written for an empty region (a key segment cannot be empty).
pub const NO_REGION: &str = "_";

/// Why a record under the root was not taken into the store. Each is a metric label.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Skip {
    /// The key is under the root but not of a shape this reader knows (another writer's
    /// record kind, a newer layout, or garbage).
    #[error("key of unknown shape")]
    ForeignKey,
    /// The value is not a protobuf `ServiceEndpoint`.
    #[error("value is not a ServiceEndpoint: {0}")]
    MalformedValue(String),
    /// The value decodes but a field is unusable (e.g. an unparsable pod IP).
    #[error("invalid record: {0}")]
    InvalidRecord(String),
    /// The key names a different endpoint than the value holds.
    #[error("key does not match the record: {0}")]
    KeyMismatch(&'static str),
}

impl Skip {
    /// Metric label (`waypoint_registry_records_skipped_total{reason}`).
    pub fn reason(&self) -> &'static str {
        match self {
            Skip::ForeignKey => "foreign_key",
            Skip::MalformedValue(_) => "malformed_value",
            Skip::InvalidRecord(_) => "invalid_record",
            Skip::KeyMismatch(_) => "key_mismatch",
        }
    }
}

/// Errors building a key for an endpoint (writers only).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// A field that becomes a key segment is empty or contains '/'.
    #[error("{field} {value:?} cannot be a registry key segment: it must be non-empty and contain no '/'")]
    BadSegment {
        /// The endpoint field.
        field: &'static str,
        /// Its value.
        value: String,
    },
}

/// The parts of an endpoint key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyParts {
    /// Region segment ([`NO_REGION`] for an empty region).
    pub region: String,
    /// Cluster name.
    pub cluster: String,
    /// Node name.
    pub node: String,
    /// Namespace.
    pub namespace: String,
    /// Service.
    pub service: String,
    /// Pod name, or the pod IP when the pod has no name.
    pub pod: String,
}

fn segment(field: &'static str, value: &str) -> Result<(), KeyError> {
    if value.is_empty() || value.contains('/') {
        return Err(KeyError::BadSegment {
            field,
            value: value.to_owned(),
        });
    }
    Ok(())
}

fn region_segment(region: &str) -> &str {
    if region.is_empty() {
        NO_REGION
    } else {
        region
    }
}

fn pod_segment(ep: &Endpoint) -> String {
    if ep.pod_name.is_empty() {
        ep.pod_ip.to_string()
    } else {
        ep.pod_name.clone()
    }
}

/// The key prefix of one node's records (ends with '/'): what its lease covers.
pub fn node_prefix(region: &str, cluster: &str, node: &str) -> Result<String, KeyError> {
    let region = region_segment(region);
    segment("region", region)?;
    segment("cluster", cluster)?;
    segment("node", node)?;
    Ok(format!(
        "{ROOT}{region}/clusters/{cluster}/nodes/{node}/endpoints/"
    ))
}

/// The key of an endpoint:
/// `/aether/v1/regions/<region>/clusters/<cluster>/nodes/<node>/endpoints/<ns>/<svc>/<pod>`.
pub fn key(ep: &Endpoint) -> Result<String, KeyError> {
    let prefix = node_prefix(&ep.region, &ep.cluster, &ep.node_name)?;
    segment("namespace", &ep.namespace)?;
    segment("service", &ep.service)?;
    let pod = pod_segment(ep);
    segment("pod", &pod)?;
    Ok(format!("{prefix}{}/{}/{pod}", ep.namespace, ep.service))
}

/// Parses an endpoint key; `None` when it is not one (wrong root or shape).
pub fn parse_key(key: &str) -> Option<KeyParts> {
    let rest = key.strip_prefix(ROOT)?;
    let parts: Vec<&str> = rest.split('/').collect();
    match parts.as_slice() {
        [region, "clusters", cluster, "nodes", node, "endpoints", namespace, service, pod]
            if parts.iter().all(|p| !p.is_empty()) =>
        {
            Some(KeyParts {
                region: (*region).to_owned(),
                cluster: (*cluster).to_owned(),
                node: (*node).to_owned(),
                namespace: (*namespace).to_owned(),
                service: (*service).to_owned(),
                pod: (*pod).to_owned(),
            })
        }
        _ => None,
    }
}

impl From<&Endpoint> for pb::ServiceEndpoint {
    fn from(ep: &Endpoint) -> Self {
        pb::ServiceEndpoint {
            service: ep.service.clone(),
            namespace: ep.namespace.clone(),
            cluster_name: ep.cluster.clone(),
            locality: Some(pb::Locality {
                region: ep.region.clone(),
                zone: ep.zone.clone(),
            }),
            pod_ip: ep.pod_ip.to_string(),
            ports: ep.ports.iter().map(|&p| u32::from(p)).collect(),
            service_ports: ep
                .service_ports
                .iter()
                .map(|p| pb::ServicePort {
                    port: u32::from(p.port),
                    target_port: u32::from(p.target_port),
                })
                .collect(),
            service_account: ep.service_account.clone(),
            ready: ep.ready,
            exported: ep.exported,
            kubernetes: Some(pb::KubernetesMetadata {
                pod_name: ep.pod_name.clone(),
                node_name: ep.node_name.clone(),
                node_ip: ep.node_ip.map(|ip| ip.to_string()).unwrap_or_default(),
            }),
        }
    }
}

impl TryFrom<pb::ServiceEndpoint> for Endpoint {
    type Error = Skip;

    fn try_from(r: pb::ServiceEndpoint) -> Result<Self, Skip> {
        let invalid = |what: String| Skip::InvalidRecord(what);
        if r.service.is_empty() || r.namespace.is_empty() || r.cluster_name.is_empty() {
            return Err(invalid(
                "service, namespace and cluster_name are required".to_owned(),
            ));
        }
        let pod_ip: IpAddr = r
            .pod_ip
            .parse()
            .map_err(|_| invalid(format!("pod_ip {:?} is not an IP address", r.pod_ip)))?;
        let k8s = r.kubernetes.unwrap_or_default();
        let node_ip =
            if k8s.node_ip.is_empty() {
                None
            } else {
                Some(k8s.node_ip.parse::<IpAddr>().map_err(|_| {
                    invalid(format!("node_ip {:?} is not an IP address", k8s.node_ip))
                })?)
            };
        let port = |p: u32| match u16::try_from(p) {
            Ok(p) if p != 0 => Ok(p),
            _ => Err(invalid(format!("port {p} is out of range"))),
        };
        let ports = r
            .ports
            .iter()
            .map(|&p| port(p))
            .collect::<Result<Vec<u16>, Skip>>()?;
        let service_ports = r
            .service_ports
            .iter()
            .map(|p| {
                Ok(ServicePort {
                    port: port(p.port)?,
                    target_port: port(p.target_port)?,
                })
            })
            .collect::<Result<Vec<ServicePort>, Skip>>()?;
        check_ports(&ports, &service_ports).map_err(|e| invalid(e.to_string()))?;
        let locality = r.locality.unwrap_or_default();
        Ok(Endpoint {
            service: r.service,
            namespace: r.namespace,
            cluster: r.cluster_name,
            region: locality.region,
            zone: locality.zone,
            pod_ip,
            pod_name: k8s.pod_name,
            node_name: k8s.node_name,
            node_ip,
            service_account: r.service_account,
            ports,
            service_ports,
            ready: r.ready,
            exported: r.exported,
        })
    }
}

/// Encodes an endpoint as the protobuf value stored under its key.
pub fn encode(ep: &Endpoint) -> Vec<u8> {
    pb::ServiceEndpoint::from(ep).encode_to_vec()
}

/// Decodes the record at `key`, checking that the key names the endpoint the value holds
/// (a record copied to the wrong key would otherwise shadow or outlive the real one).
pub fn decode(key: &[u8], value: &[u8]) -> Result<Endpoint, Skip> {
    let key = std::str::from_utf8(key).map_err(|_| Skip::ForeignKey)?;
    let parts = parse_key(key).ok_or(Skip::ForeignKey)?;
    let record =
        pb::ServiceEndpoint::decode(value).map_err(|e| Skip::MalformedValue(e.to_string()))?;
    let ep = Endpoint::try_from(record)?;
    let checks = [
        ("region", parts.region == region_segment(&ep.region)),
        ("cluster", parts.cluster == ep.cluster),
        ("node", parts.node == ep.node_name),
        ("namespace", parts.namespace == ep.namespace),
        ("service", parts.service == ep.service),
        ("pod", parts.pod == pod_segment(&ep)),
    ];
    if let Some((field, _)) = checks.iter().find(|(_, ok)| !ok) {
        return Err(Skip::KeyMismatch(field));
    }
    Ok(ep)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
    use super::*;

    fn ep() -> Endpoint {
        Endpoint {
            service: "reviews".into(),
            namespace: "bookinfo".into(),
            cluster: "b".into(),
            region: "eu-west".into(),
            zone: "eu-west-1a".into(),
            pod_ip: "10.2.0.7".parse().unwrap(),
            pod_name: "reviews-7f9".into(),
            node_name: "b-node-1".into(),
            node_ip: Some("192.168.10.2".parse().unwrap()),
            service_account: "reviews".into(),
            ports: vec![8080, 9080],
            service_ports: vec![
                ServicePort {
                    port: 80,
                    target_port: 8080,
                },
                ServicePort {
                    port: 9080,
                    target_port: 9080,
                },
            ],
            ready: true,
            exported: true,
        }
    }

    #[test]
    fn key_layout() {
        assert_eq!(
            key(&ep()).unwrap(),
            "/aether/v1/regions/eu-west/clusters/b/nodes/b-node-1/endpoints/bookinfo/reviews/reviews-7f9"
        );
        let mut e = ep();
        e.region.clear();
        e.pod_name.clear();
        assert_eq!(
            key(&e).unwrap(),
            "/aether/v1/regions/_/clusters/b/nodes/b-node-1/endpoints/bookinfo/reviews/10.2.0.7"
        );
        e.node_name = "a/b".into();
        assert!(key(&e).is_err());
        e.node_name.clear();
        assert!(key(&e).is_err());
    }

    #[test]
    fn round_trip_keeps_node_ip() {
        let e = ep();
        let k = key(&e).unwrap();
        assert_eq!(decode(k.as_bytes(), &encode(&e)).unwrap(), e);
        let mut v6 = ep();
        v6.node_ip = Some("fd00::2".parse().unwrap());
        v6.pod_ip = "fd10::7".parse().unwrap();
        let k = key(&v6).unwrap();
        assert_eq!(decode(k.as_bytes(), &encode(&v6)).unwrap(), v6);
        let mut none = ep();
        none.node_ip = None;
        assert_eq!(decode(k.as_bytes(), &encode(&none)).unwrap().node_ip, None);
    }

    /// Field 11 carries the service ports; a record without it (an older writer) means
    /// each pod port is a service port of the same number; a service port whose pod port
    /// the record does not list is an invalid record, not a port that routes nowhere.
    #[test]
    fn service_ports_round_trip_and_must_name_a_pod_port() {
        let e = ep();
        let k = key(&e).unwrap();
        let decoded = decode(k.as_bytes(), &encode(&e)).unwrap();
        assert_eq!(decoded.service_ports, e.service_ports);
        assert_eq!(decoded.target_port(80), Some(8080));
        assert_eq!(decoded.target_port(8080), None, "8080 is a pod port only");
        let mut old = pb::ServiceEndpoint::from(&e);
        old.service_ports.clear();
        let old = decode(k.as_bytes(), &old.encode_to_vec()).unwrap();
        assert_eq!(
            (old.target_port(8080), old.target_port(80)),
            (Some(8080), None)
        );
        let mut bad = pb::ServiceEndpoint::from(&e);
        bad.service_ports[0].target_port = 7070;
        let err = decode(k.as_bytes(), &bad.encode_to_vec()).unwrap_err();
        assert_eq!(err.reason(), "invalid_record");
        assert!(err.to_string().contains("pod port 7070"), "{err}");
        bad.service_ports[0].target_port = 70_000;
        assert_eq!(
            decode(k.as_bytes(), &bad.encode_to_vec())
                .unwrap_err()
                .reason(),
            "invalid_record"
        );
    }

    #[test]
    fn node_ip_is_field_5_of_kubernetes_metadata() {
        let m = pb::KubernetesMetadata {
            node_ip: "1.2.3.4".into(),
            ..Default::default()
        };
        // Tag (5 << 3) | wire type 2 (length-delimited) = 0x2a, length 7.
        assert_eq!(m.encode_to_vec(), b"\x2a\x071.2.3.4");
    }

    #[test]
    fn unknown_fields_from_a_newer_writer_are_ignored() {
        let e = ep();
        let mut bytes = encode(&e);
        // A field 99 (varint 7) and a field 100 (string "future") the reader does not know.
        bytes.extend_from_slice(&[0x98, 0x06, 0x07]);
        bytes.extend_from_slice(&[0xa2, 0x06, 0x06]);
        bytes.extend_from_slice(b"future");
        // And field 4 inside KubernetesMetadata, as an old writer would still send it.
        let mut k8s = pb::KubernetesMetadata::default().encode_to_vec();
        k8s.extend_from_slice(&[0x22, 0x03]);
        k8s.extend_from_slice(b"old");
        bytes.push(0x52); // field 10, length-delimited: a second KubernetesMetadata merges
        bytes.push(u8::try_from(k8s.len()).unwrap());
        bytes.extend_from_slice(&k8s);
        let k = key(&e).unwrap();
        assert_eq!(decode(k.as_bytes(), &bytes).unwrap(), e);
    }

    #[test]
    fn skips() {
        let e = ep();
        let k = key(&e).unwrap();
        let v = encode(&e);
        assert_eq!(
            decode(b"/aether/v1/regions/eu-west/gateways/x", &v),
            Err(Skip::ForeignKey)
        );
        assert_eq!(
            decode(format!("{k}/extra").as_bytes(), &v),
            Err(Skip::ForeignKey)
        );
        assert_eq!(decode(b"/elsewhere", &v), Err(Skip::ForeignKey));
        assert_eq!(
            decode(k.as_bytes(), b"\xff\xff\xff").unwrap_err().reason(),
            "malformed_value"
        );
        let mut bad = pb::ServiceEndpoint::from(&e);
        bad.pod_ip = "not-an-ip".into();
        assert_eq!(
            decode(k.as_bytes(), &bad.encode_to_vec())
                .unwrap_err()
                .reason(),
            "invalid_record"
        );
        let mut other = e.clone();
        other.cluster = "a".into();
        assert_eq!(
            decode(k.as_bytes(), &encode(&other)),
            Err(Skip::KeyMismatch("cluster"))
        );
    }
}
