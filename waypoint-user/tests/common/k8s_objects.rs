//! Kubernetes objects for the tests, as k8s-openapi types: the fields the Kubernetes
//! source reads, filled the way the API server and the controllers fill them (a pod is
//! created pending, then scheduled, then runs; an EndpointSlice carries the Service's
//! name label and targetRefs to its pods). The fake API server stamps resourceVersions
//! and uids.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::{
        core::v1::{
            Container, ContainerPort, Node, NodeAddress, NodeStatus, ObjectReference, Pod,
            PodCondition, PodIP, PodSpec, PodStatus, Service, ServicePort, ServiceSpec,
        },
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
};

// Literals rather than the product's constants: users write these names in their
// manifests, so a renamed constant must fail the tests.
const EXPORT_ANNOTATION: &str = "waypoint.dev/export";
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

fn labels(pairs: &[(&str, &str)]) -> Option<BTreeMap<String, String>> {
    Some(
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    )
}

fn meta(ns: &str, name: &str) -> ObjectMeta {
    ObjectMeta {
        namespace: (!ns.is_empty()).then(|| ns.to_owned()),
        name: Some(name.to_owned()),
        ..ObjectMeta::default()
    }
}

/// A Node with an `InternalIP` and the well-known region and zone labels.
pub fn node(name: &str, internal_ip: &str, region: &str, zone: &str) -> Node {
    Node {
        metadata: ObjectMeta {
            labels: labels(&[
                ("kubernetes.io/hostname", name),
                ("topology.kubernetes.io/region", region),
                ("topology.kubernetes.io/zone", zone),
            ]),
            ..meta("", name)
        },
        status: Some(NodeStatus {
            addresses: Some(vec![
                NodeAddress {
                    type_: "InternalIP".into(),
                    address: internal_ip.into(),
                },
                NodeAddress {
                    type_: "Hostname".into(),
                    address: name.into(),
                },
            ]),
            ..NodeStatus::default()
        }),
        ..Node::default()
    }
}

/// A pod as its ReplicaSet creates it: pending, not scheduled, without an IP; one
/// container serving the named TCP `ports`, running as service account `account`.
pub fn pod(
    ns: &str,
    name: &str,
    pod_labels: &[(&str, &str)],
    account: &str,
    ports: &[(&str, i32)],
) -> Pod {
    let ports = ports
        .iter()
        .map(|(name, n)| ContainerPort {
            name: Some((*name).to_owned()),
            container_port: *n,
            protocol: Some("TCP".into()),
            ..ContainerPort::default()
        })
        .collect();
    Pod {
        metadata: ObjectMeta {
            labels: labels(pod_labels),
            ..meta(ns, name)
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "app".into(),
                image: Some("registry.example/app:1".into()),
                ports: Some(ports),
                ..Container::default()
            }],
            service_account_name: Some(account.into()),
            ..PodSpec::default()
        }),
        status: Some(PodStatus {
            phase: Some("Pending".into()),
            ..PodStatus::default()
        }),
    }
}

/// `pod` bound to `node` (the scheduler's write), still pending.
pub fn scheduled(pod: &Pod, node: &str) -> Pod {
    let mut pod = pod.clone();
    if let Some(spec) = pod.spec.as_mut() {
        spec.node_name = Some(node.into());
    }
    pod
}

/// `pod` running with `ip` (the kubelet's write), its Ready condition `ready`.
pub fn running(pod: &Pod, ip: &str, ready: bool) -> Pod {
    let mut pod = pod.clone();
    pod.status = Some(PodStatus {
        phase: Some("Running".into()),
        pod_ip: Some(ip.into()),
        pod_ips: Some(vec![PodIP { ip: ip.into() }]),
        conditions: Some(vec![PodCondition {
            type_: "Ready".into(),
            status: if ready { "True" } else { "False" }.into(),
            ..PodCondition::default()
        }]),
        ..PodStatus::default()
    });
    pod
}

/// A target port by number.
pub fn port(n: i32) -> IntOrString {
    IntOrString::Int(n)
}

/// A target port by container port name.
pub fn named(name: &str) -> IntOrString {
    IntOrString::String(name.into())
}

/// A ClusterIP Service selecting `selector` with TCP `ports` (service port, target port).
/// A single port is unnamed; several are named `port-<service port>` (the API requires
/// names then), which is what the EndpointSlice's ports must repeat.
pub fn service(
    ns: &str,
    name: &str,
    selector: &[(&str, &str)],
    ports: &[(i32, IntOrString)],
) -> Service {
    let ports = ports
        .iter()
        .map(|(p, target)| ServicePort {
            name: (ports.len() > 1).then(|| format!("port-{p}")),
            port: *p,
            target_port: Some(target.clone()),
            protocol: Some("TCP".into()),
            ..ServicePort::default()
        })
        .collect();
    Service {
        metadata: meta(ns, name),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            selector: labels(selector),
            ports: Some(ports),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// `service` with the export annotation.
pub fn exported(service: &Service) -> Service {
    let mut service = service.clone();
    service
        .metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(EXPORT_ANNOTATION.into(), "true".into());
    service
}

/// An endpoint of a slice: pod `pod` of `ns` at `ip` on `node`, `ready` or not.
pub fn endpoint(ns: &str, pod: &str, ip: &str, node: &str, ready: bool) -> Endpoint {
    Endpoint {
        addresses: vec![ip.into()],
        conditions: Some(EndpointConditions {
            ready: Some(ready),
            serving: Some(ready),
            terminating: Some(false),
        }),
        node_name: Some(node.into()),
        target_ref: Some(ObjectReference {
            kind: Some("Pod".into()),
            namespace: Some(ns.into()),
            name: Some(pod.into()),
            ..ObjectReference::default()
        }),
        ..Endpoint::default()
    }
}

/// The EndpointSlice `name` of Service `service`, with the resolved TCP `ports` (the
/// Service port's name, None for an unnamed one; the number) and `endpoints`.
pub fn slice(
    ns: &str,
    service: &str,
    name: &str,
    ports: &[(Option<&str>, i32)],
    endpoints: Vec<Endpoint>,
) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            labels: labels(&[
                (SERVICE_NAME_LABEL, service),
                (
                    "endpointslice.kubernetes.io/managed-by",
                    "endpointslice-controller.k8s.io",
                ),
            ]),
            ..meta(ns, name)
        },
        address_type: "IPv4".into(),
        endpoints: Some(endpoints),
        ports: Some(
            ports
                .iter()
                .map(|(name, n)| EndpointPort {
                    name: name.map(str::to_owned),
                    port: Some(*n),
                    protocol: Some("TCP".into()),
                    ..EndpointPort::default()
                })
                .collect(),
        ),
    }
}
