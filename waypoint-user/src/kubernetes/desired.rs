//! The desired registration of a node, computed from what the API server says: a pure
//! function of (node, pods, services, EndpointSlices), so that every rule is unit-tested
//! without an API server. The watchers in [`super`] only keep the inputs current.
//!
//! The rules (docs/REGISTRY.md, "Kubernetes source"):
//! - a pod is this node's when `spec.nodeName` is the node, it has an IP
//!   (`status.podIP`) and it is not finished (`Succeeded`/`Failed`);
//! - a Service selects it when the Service has a non-empty selector that the pod's labels
//!   match, in the pod's namespace (ExternalName services select nothing);
//! - the endpoint's ports are the Service's TCP target ports the pod serves: a number as
//!   is, a name through the pod's container ports, else through the Service's
//!   EndpointSlices (which carry the resolved number); a Service whose ports all fail to
//!   resolve on the pod is not served by it. A Service without ports gives "any port".
//!   Each Service port goes with its target port on this pod (`service_ports`): clients
//!   name the service port, the SNI and the pod's inbound the target port;
//! - readiness is the pod's `ready` condition in the Service's EndpointSlices (see
//!   [`ready_in_slices`] for why), false while the pod is not in them yet;
//! - exported when the Service carries [`EXPORT_ANNOTATION`] = `"true"`.

use std::{
    borrow::Borrow,
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use k8s_openapi::{
    api::{
        core::v1::{Node, Pod, Service, ServicePort},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::util::intstr::IntOrString,
};

use crate::{
    model::ServicePort as LocalServicePort,
    registry::local::{LocalEndpoint, LocalSet, NodeIdentity},
};

/// The Service annotation that exports a service to other clusters (the deploy manifests
/// use it too).
pub const EXPORT_ANNOTATION: &str = "waypoint.dev/export";
/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The well-known Node labels of the locality.
pub const REGION_LABEL: &str = "topology.kubernetes.io/region";
/// See [`REGION_LABEL`].
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// The service account of a pod that names none.
const DEFAULT_SERVICE_ACCOUNT: &str = "default";

/// Who the node is: the flags, completed by the Node object. `--node-ip` wins over the
/// Node's first `InternalIP`; a non-empty `--region`/`--zone` wins over the Node's
/// `topology.kubernetes.io/region|zone` labels. The node IP stays None only when neither
/// says (no flag, Node unknown or without a parsable InternalIP).
pub fn identity(flags: &NodeIdentity, node: Option<&Node>) -> NodeIdentity {
    let label = |key: &str| -> String {
        node.and_then(|n| n.metadata.labels.as_ref())
            .and_then(|l| l.get(key))
            .cloned()
            .unwrap_or_default()
    };
    let or_label = |flag: &str, key: &str| {
        if flag.is_empty() {
            label(key)
        } else {
            flag.to_owned()
        }
    };
    NodeIdentity {
        cluster: flags.cluster.clone(),
        node: flags.node.clone(),
        node_ip: flags.node_ip.or_else(|| node.and_then(internal_ip)),
        region: or_label(&flags.region, REGION_LABEL),
        zone: or_label(&flags.zone, ZONE_LABEL),
    }
}

/// The node's first parsable `InternalIP` address.
pub fn internal_ip(node: &Node) -> Option<IpAddr> {
    node.status
        .as_ref()?
        .addresses
        .as_ref()?
        .iter()
        .filter(|a| a.type_ == "InternalIP")
        .find_map(|a| a.address.parse().ok())
}

/// The node's whole desired registration: [`identity`] and [`local_endpoints`].
pub fn local_set<N, P, S, E>(
    flags: &NodeIdentity,
    node: Option<&N>,
    pods: &[P],
    services: &[S],
    slices: &[E],
) -> LocalSet
where
    N: Borrow<Node>,
    P: Borrow<Pod>,
    S: Borrow<Service>,
    E: Borrow<EndpointSlice>,
{
    LocalSet {
        identity: identity(flags, node.map(Borrow::borrow)),
        endpoints: local_endpoints(&flags.node, pods, services, slices),
    }
}

/// Every (service, pod) endpoint of the pods on `node`, sorted by namespace, service and
/// pod name.
pub fn local_endpoints<P, S, E>(
    node: &str,
    pods: &[P],
    services: &[S],
    slices: &[E],
) -> Vec<LocalEndpoint>
where
    P: Borrow<Pod>,
    S: Borrow<Service>,
    E: Borrow<EndpointSlice>,
{
    // Slices by (namespace, service): a cluster holds many more slices than one node
    // has pods.
    let mut by_service: BTreeMap<(&str, &str), Vec<&EndpointSlice>> = BTreeMap::new();
    for slice in slices {
        let slice = slice.borrow();
        let meta = &slice.metadata;
        let service = meta.labels.as_ref().and_then(|l| l.get(SERVICE_NAME_LABEL));
        if let (Some(ns), Some(service)) = (meta.namespace.as_deref(), service) {
            by_service.entry((ns, service)).or_default().push(slice);
        }
    }
    let mut out = Vec::new();
    for pod in pods {
        let pod = pod.borrow();
        let Some(local) = LocalPod::of(node, pod) else {
            continue;
        };
        for service in services {
            let service = service.borrow();
            if !selects(service, local.namespace, pod) {
                continue;
            }
            let name = service.metadata.name.as_deref().unwrap_or_default();
            let slices = by_service
                .get(&(local.namespace, name))
                .map(Vec::as_slice)
                .unwrap_or_default();
            let Some(service_ports) = target_ports(service, pod, local.name, slices) else {
                continue;
            };
            let ports: BTreeSet<u16> = service_ports.iter().map(|p| p.target_port).collect();
            out.push(LocalEndpoint {
                service: name.to_owned(),
                namespace: local.namespace.to_owned(),
                pod_ip: local.ip,
                pod_name: local.name.to_owned(),
                service_account: local.service_account.to_owned(),
                ports: ports.into_iter().collect(),
                service_ports,
                ready: ready_in_slices(local.namespace, local.name, slices),
                exported: exported(service),
            });
        }
    }
    out.sort_by(|a, b| {
        (&a.namespace, &a.service, &a.pod_name).cmp(&(&b.namespace, &b.service, &b.pod_name))
    });
    out
}

/// What matters of a pod that runs on the node.
struct LocalPod<'a> {
    namespace: &'a str,
    name: &'a str,
    ip: IpAddr,
    service_account: &'a str,
}

impl<'a> LocalPod<'a> {
    fn of(node: &str, pod: &'a Pod) -> Option<LocalPod<'a>> {
        let spec = pod.spec.as_ref()?;
        if spec.node_name.as_deref() != Some(node) {
            return None;
        }
        let status = pod.status.as_ref()?;
        // A finished pod may keep its IP in the status while the IP is handed to a new pod.
        if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
            return None;
        }
        let ip = status.pod_ip.as_deref()?.parse().ok()?;
        Some(LocalPod {
            namespace: pod.metadata.namespace.as_deref()?,
            name: pod.metadata.name.as_deref()?,
            ip,
            service_account: spec
                .service_account_name
                .as_deref()
                .filter(|s| !s.is_empty())
                .unwrap_or(DEFAULT_SERVICE_ACCOUNT),
        })
    }
}

/// Whether `service` selects `pod`: same namespace, and a non-empty selector (an empty
/// one selects nothing for a Service: its endpoints are managed by hand) that the pod's
/// labels match.
fn selects(service: &Service, namespace: &str, pod: &Pod) -> bool {
    if service.metadata.namespace.as_deref() != Some(namespace) {
        return false;
    }
    let Some(spec) = &service.spec else {
        return false;
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return false;
    }
    let Some(selector) = spec.selector.as_ref().filter(|s| !s.is_empty()) else {
        return false;
    };
    let labels = pod.metadata.labels.as_ref();
    selector
        .iter()
        .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
}

fn is_tcp(protocol: Option<&str>) -> bool {
    matches!(protocol, None | Some("TCP"))
}

/// The TCP ports of `service` that reach `pod`, each with its target port on the pod,
/// sorted; empty for "any port" (a Service without ports). None when the Service has
/// ports but the pod serves none of them over TCP (UDP-only services, named ports the pod
/// does not have): the waypoint cannot reach this pod for this service.
fn target_ports(
    service: &Service,
    pod: &Pod,
    pod_name: &str,
    slices: &[&EndpointSlice],
) -> Option<Vec<LocalServicePort>> {
    let ports = service
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_deref())
        .unwrap_or_default();
    if ports.is_empty() {
        return Some(Vec::new());
    }
    let resolved: BTreeSet<LocalServicePort> = ports
        .iter()
        .filter(|p| is_tcp(p.protocol.as_deref()))
        .filter_map(|p| {
            Some(LocalServicePort {
                port: u16::try_from(p.port).ok().filter(|&n| n != 0)?,
                target_port: target_port(p, pod, pod_name, slices)?,
            })
        })
        .collect();
    (!resolved.is_empty()).then(|| resolved.into_iter().collect())
}

fn target_port(
    port: &ServicePort,
    pod: &Pod,
    pod_name: &str,
    slices: &[&EndpointSlice],
) -> Option<u16> {
    match &port.target_port {
        None => u16::try_from(port.port).ok().filter(|&n| n != 0),
        Some(IntOrString::Int(n)) => u16::try_from(*n).ok().filter(|&n| n != 0),
        Some(IntOrString::String(name)) => {
            container_port(pod, name).or_else(|| slice_port(slices, port.name.as_deref(), pod_name))
        }
    }
}

/// The number of the container port `name` (TCP) of `pod`.
fn container_port(pod: &Pod, name: &str) -> Option<u16> {
    pod.spec
        .as_ref()?
        .containers
        .iter()
        .flat_map(|c| c.ports.as_deref().unwrap_or_default())
        .find(|p| p.name.as_deref() == Some(name) && is_tcp(p.protocol.as_deref()))
        .and_then(|p| u16::try_from(p.container_port).ok())
}

/// The number the endpoints controller resolved for the Service port `service_port` (the
/// slice port carries the Service port's name) in a slice that holds the pod: slices are
/// grouped by resolved port numbers, so the pod's own slice is the one to ask.
fn slice_port(slices: &[&EndpointSlice], service_port: Option<&str>, pod: &str) -> Option<u16> {
    slices
        .iter()
        .filter(|s| {
            s.endpoints
                .iter()
                .flatten()
                .any(|e| e.target_ref.as_ref().and_then(|r| r.name.as_deref()) == Some(pod))
        })
        .flat_map(|s| s.ports.iter().flatten())
        .find(|p| {
            p.name.as_deref().unwrap_or_default() == service_port.unwrap_or_default()
                && is_tcp(p.protocol.as_deref())
        })
        .and_then(|p| p.port)
        .and_then(|n| u16::try_from(n).ok())
}

/// Whether the pod is ready in the Service's EndpointSlices.
///
/// Why the slice's `ready` condition and not the pod's `Ready` condition: the slice is
/// what the cluster itself routes Service traffic by (kube-proxy and every mesh read it).
/// The endpoints controller already turns a terminating pod not-ready (its `Ready`
/// condition stays true until the containers stop) and applies
/// `publishNotReadyAddresses`. Using it, cross-cluster traffic through the waypoint stops
/// going to a pod exactly when in-cluster traffic does. A pod not yet in any slice is not
/// ready: the cluster does not route to it yet either.
fn ready_in_slices(namespace: &str, pod: &str, slices: &[&EndpointSlice]) -> bool {
    slices
        .iter()
        .flat_map(|s| s.endpoints.iter().flatten())
        .filter(|e| {
            e.target_ref.as_ref().is_some_and(|r| {
                r.kind.as_deref() == Some("Pod")
                    && r.name.as_deref() == Some(pod)
                    && r.namespace.as_deref().is_none_or(|ns| ns == namespace)
            })
        })
        // The API: "a nil value should be interpreted as ready".
        .any(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true))
}

/// Whether the Service opts in to export ([`EXPORT_ANNOTATION`] = `"true"`).
pub fn exported(service: &Service) -> bool {
    service
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(EXPORT_ANNOTATION))
        .is_some_and(|v| v == "true")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use serde_json::json;

    use super::*;

    const NODE: &str = "node-a";

    fn pod(name: &str, node: &str, ip: Option<&str>, labels: serde_json::Value) -> Pod {
        let mut status = json!({"phase": "Running"});
        if let Some(ip) = ip {
            status["podIP"] = json!(ip);
        }
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "bookinfo", "labels": labels},
            "spec": {
                "nodeName": node,
                "serviceAccountName": "reviews",
                "containers": [{"name": "app", "image": "reviews:1", "ports": [
                    {"name": "http", "containerPort": 9080},
                    {"name": "metrics", "containerPort": 15090},
                    {"name": "dns", "containerPort": 53, "protocol": "UDP"}
                ]}]
            },
            "status": status
        }))
        .unwrap()
    }

    fn service(name: &str, selector: serde_json::Value, ports: serde_json::Value) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "bookinfo",
                         "annotations": {EXPORT_ANNOTATION: "true"}},
            "spec": {"selector": selector, "ports": ports}
        }))
        .unwrap()
    }

    fn slice(
        service: &str,
        ports: serde_json::Value,
        pods: &[(&str, Option<bool>)],
    ) -> EndpointSlice {
        let endpoints: Vec<_> = pods
            .iter()
            .map(|(p, ready)| {
                let mut e = json!({
                    "addresses": ["10.1.0.7"],
                    "nodeName": NODE,
                    "targetRef": {"kind": "Pod", "namespace": "bookinfo", "name": p}
                });
                if let Some(r) = ready {
                    e["conditions"] = json!({"ready": r});
                }
                e
            })
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": format!("{service}-abcde"), "namespace": "bookinfo",
                         "labels": {SERVICE_NAME_LABEL: service}},
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": ports
        }))
        .unwrap()
    }

    fn reviews_pod() -> Pod {
        pod(
            "reviews-1",
            NODE,
            Some("10.1.0.7"),
            json!({"app": "reviews", "version": "v1"}),
        )
    }

    fn compute(pods: &[Pod], services: &[Service], slices: &[EndpointSlice]) -> Vec<LocalEndpoint> {
        local_endpoints(NODE, pods, services, slices)
    }

    #[test]
    fn selected_ready_pod_becomes_an_endpoint() {
        let svc = service(
            "reviews",
            json!({"app": "reviews"}),
            json!([{"port": 80, "targetPort": 9080}]),
        );
        let sl = slice(
            "reviews",
            json!([{"port": 9080}]),
            &[("reviews-1", Some(true))],
        );
        let eps = compute(&[reviews_pod()], &[svc], &[sl]);
        assert_eq!(
            eps,
            vec![LocalEndpoint {
                service: "reviews".into(),
                namespace: "bookinfo".into(),
                pod_ip: "10.1.0.7".parse().unwrap(),
                pod_name: "reviews-1".into(),
                service_account: "reviews".into(),
                ports: vec![9080],
                service_ports: vec![LocalServicePort {
                    port: 80,
                    target_port: 9080,
                }],
                ready: true,
                exported: true,
            }]
        );
    }

    #[test]
    fn named_ports_resolve_through_containers_then_slices() {
        // `http` is a container port; `admin` is not, but the slice of the pod resolved
        // it to 8081 (e.g. from an init container or a port the spec no longer shows);
        // `missing` resolves nowhere and is left out; UDP ports are never registered.
        let svc = service(
            "reviews",
            json!({"app": "reviews"}),
            json!([
                {"name": "web", "port": 80, "targetPort": "http"},
                {"name": "admin", "port": 81, "targetPort": "admin"},
                {"name": "missing", "port": 82, "targetPort": "nope"},
                {"name": "dns", "port": 53, "targetPort": "dns", "protocol": "UDP"},
                {"name": "plain", "port": 9000}
            ]),
        );
        let sl = slice(
            "reviews",
            json!([{"name": "web", "port": 9080}, {"name": "admin", "port": 8081}]),
            &[("reviews-1", Some(true))],
        );
        let eps = compute(&[reviews_pod()], &[svc], &[sl]);
        assert_eq!(eps.len(), 1);
        assert_eq!(eps[0].ports, vec![8081, 9000, 9080]);
        let pairs: Vec<(u16, u16)> = eps[0]
            .service_ports
            .iter()
            .map(|p| (p.port, p.target_port))
            .collect();
        assert_eq!(pairs, vec![(80, 9080), (81, 8081), (9000, 9000)]);
    }

    /// The same named target port may have a different number on each pod: each pod's
    /// record maps the service port to its own.
    #[test]
    fn a_named_target_port_maps_to_each_pods_own_number() {
        let svc = service(
            "reviews",
            json!({"app": "reviews"}),
            json!([{"name": "web", "port": 80, "targetPort": "http"}]),
        );
        let mut other = reviews_pod();
        other.metadata.name = Some("reviews-2".into());
        other.status.as_mut().unwrap().pod_ip = Some("10.1.0.8".into());
        let spec = other.spec.as_mut().unwrap();
        spec.containers[0].ports.as_mut().unwrap()[0].container_port = 8080;
        let eps = compute(&[reviews_pod(), other], &[svc], &[]);
        let got: Vec<(&str, Vec<u16>, u16)> = eps
            .iter()
            .map(|e| {
                (
                    e.pod_name.as_str(),
                    e.ports.clone(),
                    e.service_ports[0].target_port,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("reviews-1", vec![9080], 9080),
                ("reviews-2", vec![8080], 8080)
            ]
        );
        assert!(eps.iter().all(|e| e.service_ports[0].port == 80));
    }

    #[test]
    fn a_service_the_pod_serves_no_tcp_port_of_is_skipped() {
        let udp = service(
            "dns",
            json!({"app": "reviews"}),
            json!([{"port": 53, "protocol": "UDP"}]),
        );
        let named = service(
            "other",
            json!({"app": "reviews"}),
            json!([{"port": 1, "targetPort": "nope"}]),
        );
        let headless = service("headless", json!({"app": "reviews"}), json!([]));
        let eps = compute(&[reviews_pod()], &[udp, named, headless], &[]);
        // A Service without ports: any port.
        assert_eq!(eps.len(), 1);
        assert_eq!(eps[0].service, "headless");
        assert!(eps[0].ports.is_empty());
    }

    #[test]
    fn multiple_services_select_one_pod() {
        let a = service(
            "reviews",
            json!({"app": "reviews"}),
            json!([{"port": 9080}]),
        );
        let b = service(
            "reviews-v1",
            json!({"app": "reviews", "version": "v1"}),
            json!([{"port": 9080}]),
        );
        let c = service(
            "reviews-v2",
            json!({"app": "reviews", "version": "v2"}),
            json!([{"port": 9080}]),
        );
        let mut d = service("no-selector", json!({}), json!([{"port": 9080}]));
        d.spec.as_mut().unwrap().selector = None;
        let sa = slice(
            "reviews",
            json!([{"port": 9080}]),
            &[("reviews-1", Some(true))],
        );
        let sb = slice(
            "reviews-v1",
            json!([{"port": 9080}]),
            &[("reviews-1", Some(false))],
        );
        let eps = compute(&[reviews_pod()], &[c, b, a, d], &[sa, sb]);
        let got: Vec<_> = eps.iter().map(|e| (e.service.as_str(), e.ready)).collect();
        assert_eq!(got, vec![("reviews", true), ("reviews-v1", false)]);
    }

    #[test]
    fn pods_without_ip_elsewhere_or_finished_are_skipped() {
        let svc = service(
            "reviews",
            json!({"app": "reviews"}),
            json!([{"port": 9080}]),
        );
        let pending = pod("reviews-2", NODE, None, json!({"app": "reviews"}));
        let elsewhere = pod(
            "reviews-3",
            "node-b",
            Some("10.1.1.3"),
            json!({"app": "reviews"}),
        );
        let mut done = pod(
            "reviews-4",
            NODE,
            Some("10.1.0.9"),
            json!({"app": "reviews"}),
        );
        done.status.as_mut().unwrap().phase = Some("Succeeded".into());
        let mut other_ns = reviews_pod();
        other_ns.metadata.namespace = Some("other".into());
        let eps = compute(&[pending, elsewhere, done, other_ns], &[svc], &[]);
        assert!(eps.is_empty(), "{eps:?}");
    }

    #[test]
    fn readiness_comes_from_the_slices() {
        let svc = service(
            "reviews",
            json!({"app": "reviews"}),
            json!([{"port": 9080}]),
        );
        let ready = |slices: &[EndpointSlice]| {
            compute(&[reviews_pod()], std::slice::from_ref(&svc), slices)[0].ready
        };
        // Not in any slice yet: the cluster does not route to it either.
        assert!(!ready(&[]));
        assert!(ready(&[slice(
            "reviews",
            json!([{"port": 9080}]),
            &[("reviews-1", Some(true))]
        )]));
        assert!(!ready(&[slice(
            "reviews",
            json!([{"port": 9080}]),
            &[("reviews-1", Some(false))]
        )]));
        // The API says an unknown condition means ready.
        assert!(ready(&[slice(
            "reviews",
            json!([{"port": 9080}]),
            &[("reviews-1", None)]
        )]));
        // Another service's slice does not count.
        assert!(!ready(&[slice(
            "ratings",
            json!([{"port": 9080}]),
            &[("reviews-1", Some(true))]
        )]));
    }

    #[test]
    fn export_needs_the_annotation_set_to_true() {
        let mut svc = service(
            "reviews",
            json!({"app": "reviews"}),
            json!([{"port": 9080}]),
        );
        assert!(exported(&svc));
        let annotations = svc.metadata.annotations.as_mut().unwrap();
        annotations.insert(EXPORT_ANNOTATION.into(), "yes".into());
        assert!(!exported(&svc));
        svc.metadata.annotations = None;
        assert!(!exported(&svc));
        let eps = compute(&[reviews_pod()], &[svc], &[]);
        assert!(!eps[0].exported, "registered, but not exported");
    }

    #[test]
    fn default_service_account() {
        let svc = service(
            "reviews",
            json!({"app": "reviews"}),
            json!([{"port": 9080}]),
        );
        let mut p = reviews_pod();
        p.spec.as_mut().unwrap().service_account_name = None;
        assert_eq!(compute(&[p], &[svc], &[])[0].service_account, "default");
    }

    fn node(addresses: serde_json::Value, labels: serde_json::Value) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": NODE, "labels": labels},
            "status": {"addresses": addresses}
        }))
        .unwrap()
    }

    #[test]
    fn identity_precedence() {
        let flags = NodeIdentity {
            cluster: "a".into(),
            node: NODE.into(),
            node_ip: None,
            region: String::new(),
            zone: String::new(),
        };
        let n = node(
            json!([
                {"type": "Hostname", "address": NODE},
                {"type": "ExternalIP", "address": "203.0.113.7"},
                {"type": "InternalIP", "address": "192.168.10.7"},
                {"type": "InternalIP", "address": "fd00::7"}
            ]),
            json!({REGION_LABEL: "eu-west", ZONE_LABEL: "eu-west-1a"}),
        );
        let id = identity(&flags, Some(&n));
        assert_eq!(id.node_ip, Some("192.168.10.7".parse().unwrap()));
        assert_eq!(
            (id.region.as_str(), id.zone.as_str()),
            ("eu-west", "eu-west-1a")
        );
        // Flags win.
        let pinned = NodeIdentity {
            node_ip: Some("10.9.9.9".parse().unwrap()),
            region: "r".into(),
            ..flags.clone()
        };
        let id = identity(&pinned, Some(&n));
        assert_eq!(id.node_ip, pinned.node_ip);
        assert_eq!((id.region.as_str(), id.zone.as_str()), ("r", "eu-west-1a"));
        // Unknown: no Node, or a Node without an InternalIP.
        assert_eq!(identity(&flags, None).node_ip, None);
        let bare = node(json!([{"type": "Hostname", "address": NODE}]), json!({}));
        assert_eq!(identity(&flags, Some(&bare)).node_ip, None);
    }
}
