//! The consumer side of the split horizon as Envoy v3 configuration: for one service
//! port, the outbound `Cluster` a source node's Envoy dials it with, and the pod-inbound
//! `Listener` that accepts both SNIs the cluster sends.
//!
//! Derived from [`horizon::resolve`] (never a second implementation of the rules): every
//! target of the [`View`] becomes an endpoint, how it is dialed (directly or through a
//! waypoint, and the pod port its SNI names) becomes endpoint metadata, its priority an
//! Envoy priority. Pure and deterministic (inputs are sorted,
//! JSON objects are ordered maps) so golden snapshots are stable. The layout is explained
//! in docs/ARCHITECTURE.md ("Envoy configuration").

use std::{collections::BTreeMap, collections::BTreeSet, time::Duration};

use serde_json::{json, Value};

use crate::{
    horizon::{self, Query, Target, View, Viewer},
    model::Endpoint,
};

/// Endpoint metadata namespace the transport socket matcher reads (Envoy's default for
/// `EndpointMetadataInput.filter`, spelled out so the config says what it means).
pub const METADATA_FILTER: &str = "envoy.lb";
/// Endpoint metadata key of how an endpoint is dialed: `direct:<pod port>` or
/// `waypoint:<pod port>` (see [`socket_kind`]). Each value has its transport sockets.
pub const METADATA_KEY: &str = "socket";

const TYPE_ENDPOINT_METADATA_INPUT: &str = "type.googleapis.com/envoy.extensions.matching.common_inputs.transport_socket.v3.EndpointMetadataInput";
const TYPE_FILTER_STATE_INPUT: &str =
    "type.googleapis.com/envoy.extensions.matching.common_inputs.transport_socket.v3.FilterStateInput";
const TYPE_SOCKET_NAME_ACTION: &str = "type.googleapis.com/envoy.extensions.matching.common_inputs.transport_socket.v3.TransportSocketNameAction";
const TYPE_UPSTREAM_TLS: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext";
const TYPE_DOWNSTREAM_TLS: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext";
const TYPE_TLS_INSPECTOR: &str =
    "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector";
const TYPE_TCP_PROXY: &str =
    "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy";

/// A source pod the node's Envoy dials on behalf of: the value its connections carry in
/// filter state (e.g. its network namespace) and the identity whose certificate it
/// presents.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Source {
    /// The filter-state value that identifies the source (e.g. `/var/run/netns/cni-1f2e`).
    pub value: String,
    /// The source's namespace.
    pub namespace: String,
    /// The source's service account (its SPIFFE identity).
    pub service_account: String,
}

/// Errors of the `VALUE=NAMESPACE/SERVICE_ACCOUNT` syntax.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    /// Not of the form.
    #[error(
        "{0:?} is not VALUE=NAMESPACE/SERVICE_ACCOUNT (e.g. /var/run/netns/cni-1f2e=default/sleep)"
    )]
    Syntax(String),
}

impl std::str::FromStr for Source {
    type Err = SourceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || SourceError::Syntax(s.to_owned());
        // The value may itself contain '=' or '/', the identity never does: split from
        // the right.
        let (value, identity) = s.rsplit_once('=').ok_or_else(bad)?;
        let (namespace, service_account) = identity.split_once('/').ok_or_else(bad)?;
        if value.is_empty()
            || namespace.is_empty()
            || service_account.is_empty()
            || service_account.contains('/')
        {
            return Err(bad());
        }
        Ok(Source {
            value: value.to_owned(),
            namespace: namespace.to_owned(),
            service_account: service_account.to_owned(),
        })
    }
}

/// How the generated configuration refers to identities and certificates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// SPIFFE trust domain shared by the clusters: identities are
    /// `spiffe://<trust-domain>/ns/<ns>/sa/<sa>`, the CA bundle is the SDS secret
    /// `spiffe://<trust-domain>`.
    pub trust_domain: String,
    /// Name of the Envoy cluster that serves SDS (the SPIRE agent): certificates are SDS
    /// secrets named by SPIFFE ID, as the SPIRE agent serves them.
    pub sds_cluster: String,
    /// The filter-state key that identifies a connection's source (shared from the
    /// downstream connection to the upstream one).
    pub source_key: String,
    /// The sources to pick certificates for. At least one.
    pub sources: Vec<Source>,
    /// Connect timeout of the outbound cluster.
    pub connect_timeout: Duration,
}

/// Errors of the generator.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// No source: the matcher would have nothing to select.
    #[error("no source given: pass --source VALUE=NAMESPACE/SERVICE_ACCOUNT for each source pod (its filter-state value and identity)")]
    NoSources,
    /// One filter-state value given two identities.
    #[error("source {value:?} is given two identities ({first} and {second})")]
    ConflictingSource {
        /// The value.
        value: String,
        /// One identity.
        first: String,
        /// The other.
        second: String,
    },
}

/// The generated configuration and the view it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    /// An `envoy.config.bootstrap.v3.Bootstrap` holding only `static_resources`: the
    /// outbound cluster, the pod-inbound clusters and the pod-inbound listener.
    pub bootstrap: Value,
    /// The split-horizon view the outbound cluster was derived from.
    pub view: View,
}

/// The outbound cluster's name for a service port.
pub fn outbound_cluster_name(q: &Query) -> String {
    format!("outbound|{}|{}.{}", q.port, q.service, q.namespace)
}

fn inbound_cluster_name(port: u16, q: &Query) -> String {
    format!("inbound|{port}|{}.{}", q.service, q.namespace)
}

fn spiffe_id(trust_domain: &str, namespace: &str, service_account: &str) -> String {
    format!("spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}")
}

/// Generates the configuration of `query` as `viewer` sees it over `endpoints`.
pub fn generate(
    config: &Config,
    viewer: &Viewer,
    query: &Query,
    endpoints: &[Endpoint],
) -> Result<Generated, Error> {
    let sources = sources(config)?;
    let view = horizon::resolve(viewer, query, endpoints);
    let of_service: Vec<&Endpoint> = endpoints
        .iter()
        .filter(|e| e.service == query.service && e.namespace == query.namespace)
        .collect();
    // The destination identities every endpoint's certificate is checked against. An
    // endpoint without a service account is taken to run as the service's name.
    let destination_ids: BTreeSet<String> = of_service
        .iter()
        .map(|e| {
            let sa = if e.service_account.is_empty() {
                &e.service
            } else {
                &e.service_account
            };
            spiffe_id(&config.trust_domain, &e.namespace, sa)
        })
        .chain(
            of_service
                .is_empty()
                .then(|| spiffe_id(&config.trust_domain, &query.namespace, &query.service)),
        )
        .collect();

    // The pod ports behind the queried service port: one in the common case; several
    // when a named target port has different numbers on different pods. Taken from all
    // the service's endpoints, not the view, so that the cluster's sockets stay the same
    // while endpoints come and go.
    let pod_ports: BTreeSet<u16> = of_service
        .iter()
        .filter_map(|e| e.target_port(query.port))
        .collect();
    let pod_ports = if pod_ports.is_empty() {
        BTreeSet::from([query.port])
    } else {
        pod_ports
    };
    // Every pod port of the service gets an inbound chain, the queried one's always.
    let ports: BTreeSet<u16> = of_service
        .iter()
        .flat_map(|e| e.ports.iter().copied())
        .chain(pod_ports.iter().copied())
        .collect();
    let mut clusters = vec![outbound_cluster(
        config,
        viewer,
        query,
        &view,
        &sources,
        &destination_ids,
        &pod_ports,
    )];
    clusters.extend(ports.iter().map(|p| inbound_cluster(config, *p, query)));
    let listener = inbound_listener(config, viewer, query, &ports, &destination_ids);
    let bootstrap = json!({
        "static_resources": {
            "clusters": clusters,
            "listeners": [listener],
        }
    });
    Ok(Generated { bootstrap, view })
}

/// Sources grouped by identity, each identity with its sorted filter-state values.
fn sources(config: &Config) -> Result<BTreeMap<(String, String), Vec<String>>, Error> {
    if config.sources.is_empty() {
        return Err(Error::NoSources);
    }
    let mut by_value: BTreeMap<&str, &Source> = BTreeMap::new();
    for s in &config.sources {
        if let Some(prev) = by_value.insert(&s.value, s) {
            if (&prev.namespace, &prev.service_account) != (&s.namespace, &s.service_account) {
                return Err(Error::ConflictingSource {
                    value: s.value.clone(),
                    first: format!("{}/{}", prev.namespace, prev.service_account),
                    second: format!("{}/{}", s.namespace, s.service_account),
                });
            }
        }
    }
    let mut out: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for s in by_value.values() {
        out.entry((s.namespace.clone(), s.service_account.clone()))
            .or_default()
            .push(s.value.clone());
    }
    Ok(out)
}

fn sds(config: &Config, name: &str) -> Value {
    json!({
        "name": name,
        "sds_config": {
            "api_config_source": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": config.sds_cluster}}],
            },
            "resource_api_version": "V3",
        }
    })
}

/// The TLS settings both ends share: TLS 1.3, the certificate of `own_id` (None: no client
/// certificate), peers checked against the trust domain's bundle and `peer_sans`.
fn common_tls(config: &Config, own_id: Option<&str>, peer_sans: Value) -> Value {
    let mut ctx = json!({
        "tls_params": {"tls_minimum_protocol_version": "TLSv1_3"},
        "combined_validation_context": {
            "default_validation_context": {"match_typed_subject_alt_names": peer_sans},
            "validation_context_sds_secret_config":
                sds(config, &format!("spiffe://{}", config.trust_domain)),
        },
    });
    if let Some(id) = own_id {
        ctx["tls_certificate_sds_secret_configs"] = json!([sds(config, id)]);
    }
    ctx
}

fn upstream_tls(
    config: &Config,
    own_id: Option<&str>,
    sni: &str,
    destination_ids: &BTreeSet<String>,
) -> Value {
    let sans: Vec<Value> = destination_ids
        .iter()
        .map(|id| json!({"san_type": "URI", "matcher": {"exact": id}}))
        .collect();
    json!({
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": TYPE_UPSTREAM_TLS,
            "sni": sni,
            "common_tls_context": common_tls(config, own_id, Value::Array(sans)),
        }
    })
}

/// How an endpoint is dialed, as its metadata says ([`METADATA_KEY`]): through a
/// waypoint or directly, with the SNI naming `pod_port`.
pub fn socket_kind(waypoint: bool, pod_port: u16) -> String {
    let via = if waypoint { "waypoint" } else { "direct" };
    format!("{via}:{pod_port}")
}

fn socket_name(kind: &str, namespace: &str, service_account: &str) -> String {
    format!("{kind}/{namespace}/{service_account}")
}

/// Level two of the matcher: the source's filter-state value picks the socket carrying its
/// certificate, among the sockets of one kind ([`socket_kind`]).
fn source_matcher(
    config: &Config,
    sources: &BTreeMap<(String, String), Vec<String>>,
    kind: &str,
) -> Value {
    let mut map = serde_json::Map::new();
    for ((ns, sa), values) in sources {
        let name = socket_name(kind, ns, sa);
        for v in values {
            map.insert(
                v.clone(),
                json!({"action": {
                    "name": "envoy.matching.action.transport_socket.name",
                    "typed_config": {"@type": TYPE_SOCKET_NAME_ACTION, "name": name},
                }}),
            );
        }
    }
    json!({
        "matcher_tree": {
            "input": {
                "name": "envoy.matching.inputs.transport_socket_filter_state",
                "typed_config": {"@type": TYPE_FILTER_STATE_INPUT, "key": config.source_key},
            },
            "exact_match_map": {"map": map},
        }
    })
}

fn outbound_cluster(
    config: &Config,
    viewer: &Viewer,
    query: &Query,
    view: &View,
    sources: &BTreeMap<(String, String), Vec<String>>,
    destination_ids: &BTreeSet<String>,
    pod_ports: &BTreeSet<u16>,
) -> Value {
    let name = outbound_cluster_name(query);
    // Each kind of dial has its SNI: the pod port alone directly, with the service
    // and the mesh domain through a waypoint.
    let kinds: Vec<(String, String)> = pod_ports
        .iter()
        .flat_map(|&port| {
            [
                (socket_kind(false, port), port.to_string()),
                (
                    socket_kind(true, port),
                    format!(
                        "{port}.{}.{}.{}",
                        query.service, query.namespace, viewer.mesh_domain
                    ),
                ),
            ]
        })
        .collect();
    // An identity's sockets differ only in SNI; the socket set does not depend on the
    // current endpoints, so the cluster stays the same while endpoints come and go (as
    // it would under EDS).
    let mut matches = Vec::new();
    for (ns, sa) in sources.keys() {
        let id = spiffe_id(&config.trust_domain, ns, sa);
        for (kind, sni) in &kinds {
            matches.push(json!({
                "name": socket_name(kind, ns, sa),
                "transport_socket": upstream_tls(config, Some(&id), sni, destination_ids),
            }));
        }
    }
    let by_kind: serde_json::Map<String, Value> = kinds
        .iter()
        .map(|(kind, _)| {
            (
                kind.clone(),
                json!({"matcher": source_matcher(config, sources, kind)}),
            )
        })
        .collect();
    // Every endpoint names its kind; the fallback is never taken but must exist.
    let default_port = pod_ports.first().copied().unwrap_or(query.port);
    let (default_kind, default_sni) = (socket_kind(false, default_port), default_port.to_string());
    json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": duration(config.connect_timeout),
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": load_assignment(&name, view),
        "transport_socket_matches": matches,
        "transport_socket_matcher": {
            "matcher_tree": {
                "input": {
                    "name": "envoy.matching.inputs.endpoint_metadata",
                    "typed_config": {
                        "@type": TYPE_ENDPOINT_METADATA_INPUT,
                        "filter": METADATA_FILTER,
                        "path": [{"key": METADATA_KEY}],
                    },
                },
                "exact_match_map": {"map": by_kind},
            },
            "on_no_match": {"matcher": source_matcher(config, sources, &default_kind)},
        },
        // Used when no source matches (a pod this config does not know): TLS without a
        // client certificate, which the destination's inbound rejects. Failing closed
        // beats Envoy's default of a plaintext socket.
        "transport_socket": upstream_tls(config, None, &default_sni, destination_ids),
    })
}

/// The `ClusterLoadAssignment`: one `LocalityLbEndpoints` per (priority, locality).
/// Horizon priorities (0 own cluster, 1 same zone, 2 same region, 3 elsewhere) are
/// renumbered densely because Envoy wants priorities without gaps. Pods behind the same
/// waypoint with the same pod port become one endpoint weighted by their count: the node
/// re-balances among them, and the weight keeps the per-pod share.
fn load_assignment(cluster_name: &str, view: &View) -> Value {
    let tiers: BTreeSet<u32> = view.endpoints.iter().map(|t| t.priority).collect();
    let dense: BTreeMap<u32, usize> = tiers.iter().enumerate().map(|(i, p)| (*p, i)).collect();
    type Group<'a> = BTreeMap<(std::net::SocketAddr, u16), Vec<&'a Target>>;
    let mut groups: BTreeMap<(usize, &str, &str), Group<'_>> = BTreeMap::new();
    for t in &view.endpoints {
        let prio = dense.get(&t.priority).copied().unwrap_or_default();
        groups
            .entry((prio, t.region.as_str(), t.zone.as_str()))
            .or_default()
            .entry((t.address, t.pod_port))
            .or_default()
            .push(t);
    }
    let endpoints: Vec<Value> = groups
        .iter()
        .map(|((prio, region, zone), by_addr)| {
            let lb: Vec<Value> = by_addr
                .iter()
                .map(|((addr, _), targets)| lb_endpoint(*addr, targets))
                .collect();
            let mut locality = serde_json::Map::new();
            if !region.is_empty() {
                locality.insert("region".into(), json!(region));
            }
            if !zone.is_empty() {
                locality.insert("zone".into(), json!(zone));
            }
            json!({"locality": locality, "priority": prio, "lb_endpoints": lb})
        })
        .collect();
    json!({"cluster_name": cluster_name, "endpoints": endpoints})
}

fn lb_endpoint(addr: std::net::SocketAddr, targets: &[&Target]) -> Value {
    let Some(first) = targets.first() else {
        return Value::Null;
    };
    // For stats and logs: the node for a waypoint, the pod for a direct dial.
    let hostname = if first.waypoint {
        first.node.clone()
    } else if first.pod.is_empty() {
        first.pod_ip.to_string()
    } else {
        first.pod.clone()
    };
    let mut ep = json!({
        "endpoint": {
            "address": {"socket_address": {
                "address": addr.ip().to_string(),
                "port_value": addr.port(),
            }},
            "hostname": hostname,
        },
    });
    let kind = socket_kind(first.waypoint, first.pod_port);
    ep["metadata"] = json!({"filter_metadata": {METADATA_FILTER: {METADATA_KEY: kind}}});
    if first.waypoint {
        ep["load_balancing_weight"] = json!(targets.len());
    }
    ep
}

fn inbound_cluster(config: &Config, port: u16, query: &Query) -> Value {
    let name = inbound_cluster_name(port, query);
    json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": duration(config.connect_timeout),
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{
            "endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}},
        }]}]},
    })
}

/// The pod-inbound listener on the pod port: one chain per served port, matching the bare
/// `<port>` a direct dial sends and the exact `<port>.<svc>.<ns>.<mesh-domain>` a dial
/// through a waypoint sends (the waypoint forwards the ClientHello unchanged).
fn inbound_listener(
    config: &Config,
    viewer: &Viewer,
    query: &Query,
    ports: &BTreeSet<u16>,
    destination_ids: &BTreeSet<String>,
) -> Value {
    let own = spiffe_id(&config.trust_domain, &query.namespace, &query.service);
    // The listener presents the service's identity: the one its own pods run as, or the
    // first (sorted) when records disagree.
    let own = destination_ids.iter().next().cloned().unwrap_or(own);
    let trust_prefix = format!("spiffe://{}/", config.trust_domain);
    let chains: Vec<Value> = ports
        .iter()
        .map(|port| {
            let structured = format!(
                "{port}.{}.{}.{}",
                query.service, query.namespace, viewer.mesh_domain
            );
            let cluster = inbound_cluster_name(*port, query);
            json!({
                "name": format!("inbound|{port}"),
                "filter_chain_match": {"server_names": [port.to_string(), structured]},
                "transport_socket": {
                    "name": "envoy.transport_sockets.tls",
                    "typed_config": {
                        "@type": TYPE_DOWNSTREAM_TLS,
                        "require_client_certificate": true,
                        "common_tls_context": common_tls(
                            config,
                            Some(&own),
                            json!([{"san_type": "URI", "matcher": {"prefix": trust_prefix}}]),
                        ),
                    },
                },
                "filters": [{
                    "name": "envoy.filters.network.tcp_proxy",
                    "typed_config": {
                        "@type": TYPE_TCP_PROXY,
                        "stat_prefix": cluster,
                        "cluster": cluster,
                    },
                }],
            })
        })
        .collect();
    json!({
        "name": format!("inbound|{}|{}.{}", viewer.pod_port, query.service, query.namespace),
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": viewer.pod_port}},
        "listener_filters": [{
            "name": "envoy.filters.listener.tls_inspector",
            "typed_config": {"@type": TYPE_TLS_INSPECTOR},
        }],
        "filter_chains": chains,
    })
}

/// A protobuf JSON duration (`"1.500s"`).
fn duration(d: Duration) -> String {
    let ms = d.subsec_millis();
    if ms == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}.{ms:03}s", d.as_secs())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
    use super::*;

    #[test]
    fn sources_parse() {
        let s: Source = "/var/run/netns/cni-1=default/sleep".parse().unwrap();
        assert_eq!(s.value, "/var/run/netns/cni-1");
        assert_eq!(s.namespace, "default");
        assert_eq!(s.service_account, "sleep");
        let s: Source = "a=b=ns/sa".parse().unwrap();
        assert_eq!(s.value, "a=b");
        for bad in ["x", "=ns/sa", "v=ns", "v=/sa", "v=ns/", "v=ns/sa/x"] {
            assert!(bad.parse::<Source>().is_err(), "{bad}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(duration(Duration::from_secs(1)), "1s");
        assert_eq!(duration(Duration::from_millis(1500)), "1.500s");
        assert_eq!(duration(Duration::from_millis(20)), "0.020s");
    }

    fn config(sources: Vec<Source>) -> Config {
        Config {
            trust_domain: "td".into(),
            sds_cluster: "spire_agent".into(),
            source_key: "envoy.network.namespace".into(),
            sources,
            connect_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn source_conflicts_and_absence() {
        assert_eq!(sources(&config(vec![])), Err(Error::NoSources));
        let a: Source = "v=ns/a".parse().unwrap();
        let b: Source = "v=ns/b".parse().unwrap();
        assert!(matches!(
            sources(&config(vec![a.clone(), b])),
            Err(Error::ConflictingSource { .. })
        ));
        // The same pair twice is fine.
        let got = sources(&config(vec![a.clone(), a])).unwrap();
        assert_eq!(got.len(), 1);
    }
}
