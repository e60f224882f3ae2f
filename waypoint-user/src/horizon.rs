//! The split-horizon resolver: for a viewer (a source in cluster C on node N), what to
//! dial for each endpoint of a service port, with which SNI, and at which priority.
//!
//! Pure: endpoints in, a [`View`] out. The daemon's admin API and `waypoint resolve`
//! both print it; a source proxy's endpoint discovery is what it is meant for. The rules
//! and the priority numbering are documented in docs/REGISTRY.md.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
};

use serde::Serialize;

use crate::model::Endpoint;

/// When to send traffic through the destination node's waypoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Never: every endpoint is dialed at `pod_ip:<pod-port>` (a flat network, where
    /// pod IPs are routable across clusters).
    #[default]
    Off,
    /// Other clusters' endpoints through their node's waypoint; own cluster direct.
    CrossCluster,
    /// Every endpoint not on the viewer's own node through its node's waypoint.
    Always,
}

impl Mode {
    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::CrossCluster => "cross-cluster",
            Mode::Always => "always",
        }
    }
}

/// Who is looking, and how the mesh is set up.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Viewer {
    /// The viewer's cluster.
    pub cluster: String,
    /// The viewer's node.
    pub node: String,
    /// The viewer's region (empty: unknown).
    pub region: String,
    /// The viewer's zone (empty: unknown).
    pub zone: String,
    /// `--east-west-waypoint`.
    pub mode: Mode,
    /// The mesh domain of structured SNIs.
    pub mesh_domain: String,
    /// The port waypoints listen on at their node IP.
    pub tunnel_port: u16,
    /// The pods' inbound port.
    pub pod_port: u16,
}

/// A service port: `<svc>.<ns>:<port>`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Query {
    /// Service.
    pub service: String,
    /// Namespace.
    pub namespace: String,
    /// Port.
    pub port: u16,
}

/// Errors of the `<svc>.<ns>:<port>` and `<svc>.<ns>` syntax.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    /// Not of the form.
    #[error("{0:?} is not <service>.<namespace>:<port> (e.g. reviews.bookinfo:9080)")]
    Syntax(String),
    /// Not of the form `<service>.<namespace>`.
    #[error("{0:?} is not <service>.<namespace> (e.g. reviews.bookinfo)")]
    ServiceSyntax(String),
    /// A service or namespace that cannot exist: Kubernetes names both with DNS-1123
    /// labels.
    #[error(
        "{what} {name:?} is not a DNS-1123 label (lowercase letters, digits and '-', \
         starting and ending with a letter or digit, at most 63 characters)"
    )]
    Label {
        /// "service" or "namespace".
        what: &'static str,
        name: String,
    },
}

/// A service, `<service>.<namespace>`: two DNS-1123 labels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceName {
    /// Service.
    pub service: String,
    /// Namespace.
    pub namespace: String,
}

/// A DNS-1123 label: lowercase letters, digits and '-', starting and ending with a letter
/// or digit, at most 63 characters (what Kubernetes names services and namespaces with).
fn is_dns1123_label(label: &str) -> bool {
    crate::sni::is_dns_label(label) && !label.bytes().any(|b| b.is_ascii_uppercase())
}

impl std::str::FromStr for ServiceName {
    type Err = QueryError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (service, namespace) = s
            .split_once('.')
            .filter(|(_, n)| !n.contains('.'))
            .ok_or_else(|| QueryError::ServiceSyntax(s.to_owned()))?;
        for (what, name) in [("service", service), ("namespace", namespace)] {
            if !is_dns1123_label(name) {
                return Err(QueryError::Label {
                    what,
                    name: name.to_owned(),
                });
            }
        }
        Ok(ServiceName {
            service: service.to_owned(),
            namespace: namespace.to_owned(),
        })
    }
}

impl std::str::FromStr for Query {
    type Err = QueryError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || QueryError::Syntax(s.to_owned());
        let (name, port) = s.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().map_err(|_| bad())?;
        if port == 0 {
            return Err(bad());
        }
        let ServiceName { service, namespace } = name.parse().map_err(|e| match e {
            QueryError::ServiceSyntax(_) => bad(),
            e => e,
        })?;
        Ok(Query {
            service,
            namespace,
            port,
        })
    }
}

/// What a viewer dials for one endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Target {
    /// Where to connect.
    pub address: SocketAddr,
    /// The SNI to send. It names the pod port behind the service port (`pod_port`),
    /// which the pod's inbound demuxes on.
    pub sni: String,
    /// The pod's port behind the queried service port.
    pub pod_port: u16,
    /// Whether `address` is a node's waypoint rather than the pod.
    pub waypoint: bool,
    /// 0 is tried first; see docs/REGISTRY.md.
    pub priority: u32,
    /// The endpoint's cluster.
    pub cluster: String,
    /// The endpoint's node.
    pub node: String,
    /// The pod's name.
    pub pod: String,
    /// The pod's IP.
    pub pod_ip: IpAddr,
    /// The endpoint's region.
    pub region: String,
    /// The endpoint's zone.
    pub zone: String,
}

/// Endpoints of the service port that are not in the view, by reason.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LeftOut {
    /// Not ready.
    pub not_ready: usize,
    /// Reachable only through another cluster or a waypoint, and not exported.
    pub not_exported: usize,
    /// Would go through a waypoint but the record has no node IP: never dialed at a pod
    /// IP the viewer cannot route to.
    pub no_node_ip: usize,
}

/// The split-horizon view of one service port.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct View {
    /// What was asked.
    pub query: Query,
    /// Who asked.
    pub viewer: Viewer,
    /// The targets, best priority first.
    pub endpoints: Vec<Target>,
    /// What was left out.
    pub left_out: LeftOut,
}

fn same(a: &str, b: &str) -> bool {
    !a.is_empty() && a == b
}

/// The priority of an endpoint for a viewer: 0 own cluster; other clusters 1 same zone,
/// 2 same region, 3 elsewhere. Unknown (empty) locality matches nothing.
pub fn priority(viewer: &Viewer, ep: &Endpoint) -> u32 {
    if ep.cluster == viewer.cluster {
        0
    } else if same(&ep.region, &viewer.region) && same(&ep.zone, &viewer.zone) {
        1
    } else if same(&ep.region, &viewer.region) {
        2
    } else {
        3
    }
}

/// Resolves `query` for `viewer` over `endpoints` (any set; the others are ignored).
pub fn resolve<'a>(
    viewer: &Viewer,
    query: &Query,
    endpoints: impl IntoIterator<Item = &'a Endpoint>,
) -> View {
    let mut left_out = LeftOut::default();
    let mut out = Vec::new();
    for ep in endpoints {
        if ep.service != query.service || ep.namespace != query.namespace {
            continue;
        }
        let Some(pod_port) = ep.target_port(query.port) else {
            continue;
        };
        if !ep.ready {
            left_out.not_ready += 1;
            continue;
        }
        let own_cluster = ep.cluster == viewer.cluster;
        let own_node = own_cluster && ep.node_name == viewer.node;
        let via_waypoint = match viewer.mode {
            Mode::Off => false,
            Mode::CrossCluster => !own_cluster,
            Mode::Always => !own_node,
        };
        // A waypoint forwards only exported services, and another cluster's service is
        // meant to be reachable only when exported, whichever way it is dialed.
        if (via_waypoint || !own_cluster) && !ep.exported {
            left_out.not_exported += 1;
            continue;
        }
        let (address, sni) = if via_waypoint {
            let Some(node_ip) = ep.node_ip else {
                left_out.no_node_ip += 1;
                continue;
            };
            (
                SocketAddr::new(node_ip, viewer.tunnel_port),
                format!(
                    "{pod_port}.{}.{}.{}",
                    ep.service, ep.namespace, viewer.mesh_domain
                ),
            )
        } else {
            (
                SocketAddr::new(ep.pod_ip, viewer.pod_port),
                pod_port.to_string(),
            )
        };
        out.push(Target {
            address,
            sni,
            pod_port,
            waypoint: via_waypoint,
            priority: priority(viewer, ep),
            cluster: ep.cluster.clone(),
            node: ep.node_name.clone(),
            pod: ep.pod_name.clone(),
            pod_ip: ep.pod_ip,
            region: ep.region.clone(),
            zone: ep.zone.clone(),
        });
    }
    out.sort_by(|a, b| {
        (a.priority, &a.cluster, &a.node, &a.pod, a.pod_ip)
            .cmp(&(b.priority, &b.cluster, &b.node, &b.pod, b.pod_ip))
    });
    View {
        query: query.clone(),
        viewer: viewer.clone(),
        endpoints: out,
        left_out,
    }
}

impl View {
    /// The view as an aligned text table (what `waypoint resolve` prints).
    pub fn table(&self) -> String {
        let header = [
            "PRIO", "ADDRESS", "SNI", "VIA", "CLUSTER", "NODE", "POD", "LOCALITY",
        ];
        let rows: Vec<[String; 8]> = self
            .endpoints
            .iter()
            .map(|t| {
                [
                    t.priority.to_string(),
                    t.address.to_string(),
                    t.sni.clone(),
                    if t.waypoint { "waypoint" } else { "direct" }.to_owned(),
                    t.cluster.clone(),
                    t.node.clone(),
                    if t.pod.is_empty() {
                        t.pod_ip.to_string()
                    } else {
                        t.pod.clone()
                    },
                    format!("{}/{}", t.region, t.zone),
                ]
            })
            .collect();
        let mut widths = header.map(str::len);
        for r in &rows {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.len());
            }
        }
        let mut s = String::new();
        let mut line = |cells: Vec<&str>| {
            let mut l = String::new();
            for (i, (c, w)) in cells.iter().zip(widths).enumerate() {
                if i + 1 == cells.len() {
                    l.push_str(c);
                } else {
                    // Writing to a String cannot fail.
                    let _ = write!(l, "{c:<w$}  ");
                }
            }
            s.push_str(l.trim_end());
            s.push('\n');
        };
        line(header.to_vec());
        for r in &rows {
            line(r.iter().map(String::as_str).collect());
        }
        let mut counts = BTreeMap::new();
        counts.insert("not_ready", self.left_out.not_ready);
        counts.insert("not_exported", self.left_out.not_exported);
        counts.insert("no_node_ip", self.left_out.no_node_ip);
        let left: Vec<String> = counts
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(k, n)| format!("{k}={n}"))
            .collect();
        if !left.is_empty() {
            let _ = writeln!(s, "left out: {}", left.join(" "));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
    use super::*;

    fn ep(cluster: &str, node: &str, pod: &str, ip: &str, region: &str, zone: &str) -> Endpoint {
        let node_ip = format!("192.168.{}.{}", cluster.len(), node.len());
        Endpoint {
            service: "reviews".into(),
            namespace: "bookinfo".into(),
            cluster: cluster.into(),
            region: region.into(),
            zone: zone.into(),
            pod_ip: ip.parse().unwrap(),
            pod_name: pod.into(),
            node_name: node.into(),
            node_ip: Some(node_ip.parse().unwrap()),
            service_account: "reviews".into(),
            ports: vec![9080],
            service_ports: Vec::new(),
            ready: true,
            exported: true,
        }
    }

    /// Cluster "a" (eu/eu-1) views; "b" shares the zone, "c" the region, "d" neither.
    fn fleet() -> Vec<Endpoint> {
        let mut v = vec![
            ep("a", "n1", "r-a1", "10.1.0.1", "eu", "eu-1"),
            ep("a", "n2", "r-a2", "10.1.0.2", "eu", "eu-2"),
            ep("b", "bb1", "r-b1", "10.2.0.1", "eu", "eu-1"),
            ep("c", "ccc1", "r-c1", "10.3.0.1", "eu", "eu-3"),
            ep("d", "dddd1", "r-d1", "10.4.0.1", "us", "us-1"),
        ];
        let mut no_ip = ep("d", "dddd2", "r-d2", "10.4.0.2", "us", "us-1");
        no_ip.node_ip = None;
        v.push(no_ip);
        let mut not_ready = ep("b", "bb2", "r-b2", "10.2.0.2", "eu", "eu-1");
        not_ready.ready = false;
        v.push(not_ready);
        let mut other_port = ep("b", "bb1", "r-b3", "10.2.0.3", "eu", "eu-1");
        other_port.ports = vec![8080];
        v.push(other_port);
        v
    }

    fn viewer(mode: Mode) -> Viewer {
        Viewer {
            cluster: "a".into(),
            node: "n1".into(),
            region: "eu".into(),
            zone: "eu-1".into(),
            mode,
            mesh_domain: "mesh.local".into(),
            tunnel_port: 15443,
            pod_port: 15008,
        }
    }

    /// The service port is what a client names; the SNI names the pod port behind it,
    /// which may differ from pod to pod (a named target port): the view dials each pod
    /// with its own, and a service port no pod maps leaves the pod out.
    #[test]
    fn the_sni_names_the_pod_port_behind_the_service_port() {
        let mapped = |ep: &mut Endpoint, target: u16| {
            ep.ports = vec![target];
            ep.service_ports = vec![crate::model::ServicePort {
                port: 80,
                target_port: target,
            }];
        };
        let mut own = ep("a", "n2", "r-a2", "10.1.0.2", "eu", "eu-2");
        mapped(&mut own, 9080);
        let mut remote = ep("b", "bb1", "r-b1", "10.2.0.1", "eu", "eu-1");
        mapped(&mut remote, 8080);
        let fleet = [own, remote];
        let q: Query = "reviews.bookinfo:80".parse().unwrap();
        let v = resolve(&viewer(Mode::CrossCluster), &q, &fleet);
        let got: Vec<(String, u16, String)> = v
            .endpoints
            .iter()
            .map(|t| (t.address.to_string(), t.pod_port, t.sni.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("10.1.0.2:15008".into(), 9080, "9080".into()),
                (
                    "192.168.1.3:15443".into(),
                    8080,
                    "8080.reviews.bookinfo.mesh.local".into()
                ),
            ]
        );
        for by_pod_port in ["reviews.bookinfo:9080", "reviews.bookinfo:8080"] {
            let q: Query = by_pod_port.parse().unwrap();
            let v = resolve(&viewer(Mode::CrossCluster), &q, &fleet);
            assert!(v.endpoints.is_empty(), "{by_pod_port} is no service port");
        }
    }

    fn table(mode: Mode) -> String {
        let q: Query = "reviews.bookinfo:9080".parse().unwrap();
        resolve(&viewer(mode), &q, &fleet()).table()
    }

    #[test]
    fn golden_off_is_flat() {
        assert_eq!(
            table(Mode::Off),
            "\
PRIO  ADDRESS         SNI   VIA     CLUSTER  NODE   POD   LOCALITY
0     10.1.0.1:15008  9080  direct  a        n1     r-a1  eu/eu-1
0     10.1.0.2:15008  9080  direct  a        n2     r-a2  eu/eu-2
1     10.2.0.1:15008  9080  direct  b        bb1    r-b1  eu/eu-1
2     10.3.0.1:15008  9080  direct  c        ccc1   r-c1  eu/eu-3
3     10.4.0.1:15008  9080  direct  d        dddd1  r-d1  us/us-1
3     10.4.0.2:15008  9080  direct  d        dddd2  r-d2  us/us-1
left out: not_ready=1
"
        );
    }

    #[test]
    fn golden_cross_cluster() {
        assert_eq!(
            table(Mode::CrossCluster),
            "\
PRIO  ADDRESS            SNI                               VIA       CLUSTER  NODE   POD   LOCALITY
0     10.1.0.1:15008     9080                              direct    a        n1     r-a1  eu/eu-1
0     10.1.0.2:15008     9080                              direct    a        n2     r-a2  eu/eu-2
1     192.168.1.3:15443  9080.reviews.bookinfo.mesh.local  waypoint  b        bb1    r-b1  eu/eu-1
2     192.168.1.4:15443  9080.reviews.bookinfo.mesh.local  waypoint  c        ccc1   r-c1  eu/eu-3
3     192.168.1.5:15443  9080.reviews.bookinfo.mesh.local  waypoint  d        dddd1  r-d1  us/us-1
left out: no_node_ip=1 not_ready=1
"
        );
    }

    #[test]
    fn golden_always() {
        assert_eq!(
            table(Mode::Always),
            "\
PRIO  ADDRESS            SNI                               VIA       CLUSTER  NODE   POD   LOCALITY
0     10.1.0.1:15008     9080                              direct    a        n1     r-a1  eu/eu-1
0     192.168.1.2:15443  9080.reviews.bookinfo.mesh.local  waypoint  a        n2     r-a2  eu/eu-2
1     192.168.1.3:15443  9080.reviews.bookinfo.mesh.local  waypoint  b        bb1    r-b1  eu/eu-1
2     192.168.1.4:15443  9080.reviews.bookinfo.mesh.local  waypoint  c        ccc1   r-c1  eu/eu-3
3     192.168.1.5:15443  9080.reviews.bookinfo.mesh.local  waypoint  d        dddd1  r-d1  us/us-1
left out: no_node_ip=1 not_ready=1
"
        );
    }

    #[test]
    fn not_exported_stays_in_its_cluster() {
        let mut eps = fleet();
        for e in &mut eps {
            e.exported = false;
        }
        let q: Query = "reviews.bookinfo:9080".parse().unwrap();
        let v = resolve(&viewer(Mode::CrossCluster), &q, &eps);
        assert!(v.endpoints.iter().all(|t| t.cluster == "a"));
        assert_eq!(v.endpoints.len(), 2);
        // b's ready pod, c, and both of d (the not-ready one counts as not ready).
        assert_eq!(v.left_out.not_exported, 4);
        // Through a waypoint even in-cluster needs the export.
        let v = resolve(&viewer(Mode::Always), &q, &eps);
        assert_eq!(v.endpoints.len(), 1);
        assert_eq!(v.endpoints[0].pod, "r-a1");
    }

    #[test]
    fn unknown_locality_matches_nothing() {
        let mut v = viewer(Mode::CrossCluster);
        v.region.clear();
        v.zone.clear();
        let mut e = ep("b", "x", "p", "10.0.0.1", "", "");
        assert_eq!(priority(&v, &e), 3);
        e.cluster = "a".into();
        assert_eq!(priority(&v, &e), 0);
    }

    #[test]
    fn queries() {
        assert_eq!(
            "reviews.bookinfo:9080".parse(),
            Ok(Query {
                service: "reviews".into(),
                namespace: "bookinfo".into(),
                port: 9080
            })
        );
        for bad in [
            "reviews:9080",
            "reviews.bookinfo",
            "a.b.c:1",
            ".b:1",
            "a.b:0",
            "a.b:x",
        ] {
            assert!(bad.parse::<Query>().is_err(), "{bad}");
        }
    }

    /// Names that cannot exist in Kubernetes are refused, naming the part at fault,
    /// rather than resolving to nothing.
    #[test]
    fn service_and_namespace_are_dns_1123_labels() {
        let label = |what, name: &str| {
            Err(QueryError::Label {
                what,
                name: name.into(),
            })
        };
        assert_eq!(
            "re views.bookinfo:9080".parse::<Query>(),
            label("service", "re views")
        );
        assert_eq!(
            "Reviews.bookinfo:9080".parse::<Query>(),
            label("service", "Reviews")
        );
        assert_eq!(
            "reviews.Bookinfo:9080".parse::<Query>(),
            label("namespace", "Bookinfo")
        );
        assert_eq!(
            "reviews.book_info:1".parse::<Query>(),
            label("namespace", "book_info")
        );
        assert_eq!(
            "-reviews.bookinfo:1".parse::<Query>(),
            label("service", "-reviews")
        );
        let long = "a".repeat(64);
        assert_eq!(
            format!("{long}.b:1").parse::<Query>(),
            label("service", &long)
        );
        let ok = "a".repeat(63);
        assert!(format!("{ok}.b-2:1").parse::<Query>().is_ok());
        assert_eq!(
            "reviews.bookinfo".parse(),
            Ok(ServiceName {
                service: "reviews".into(),
                namespace: "bookinfo".into()
            })
        );
        assert_eq!(
            "reviews".parse::<ServiceName>(),
            Err(QueryError::ServiceSyntax("reviews".into()))
        );
        assert_eq!(
            "Reviews.x".parse::<ServiceName>(),
            Err(QueryError::Label {
                what: "service",
                name: "Reviews".into()
            })
        );
    }

    #[test]
    fn json_shape() {
        let q: Query = "reviews.bookinfo:9080".parse().unwrap();
        let v = resolve(&viewer(Mode::CrossCluster), &q, &fleet());
        let j = serde_json::to_value(&v).unwrap();
        assert_eq!(j["viewer"]["mode"], "cross-cluster");
        assert_eq!(j["endpoints"][2]["address"], "192.168.1.3:15443");
        assert_eq!(j["endpoints"][2]["waypoint"], true);
        assert_eq!(j["endpoints"][2]["sni"], "9080.reviews.bookinfo.mesh.local");
        assert_eq!(j["left_out"]["no_node_ip"], 1);
    }
}
