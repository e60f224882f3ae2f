//! Golden snapshots of `waypoint envoy-config`, checked against Envoy's v3 API.
//!
//! Each case generates the configuration from testdata/envoy/endpoints.json and compares
//! it with testdata/envoy/<case>.json. After an intended change, rewrite the goldens with
//! `WAYPOINT_BLESS=1 cargo test -p waypoint-user --test envoy_config` and review the diff.
//!
//! Validity: every golden is decoded as an `envoy.config.bootstrap.v3.Bootstrap` by
//! prost-reflect over the descriptor set that the envoy-types crate ships (the protos its
//! Rust types are generated from), rejecting unknown fields, wrong enum names and
//! unknown `@type`s; typed `Any`s (TLS contexts, matcher inputs and actions, filters) are
//! resolved through the same pool. The result is then re-encoded and decoded into
//! envoy-types' generated `Bootstrap` for typed assertions. Not checked: Envoy's PGV
//! validation rules (min lengths and the like) and what only a running Envoy checks
//! (references between resources, extension availability in a given build).
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use envoy_types::pb::{
    envoy::{
        config::{
            bootstrap::v3::Bootstrap,
            cluster::v3::Cluster,
            core::v3::{address, socket_address},
        },
        extensions::{
            matching::common_inputs::transport_socket::v3::TransportSocketNameAction,
            transport_sockets::tls::v3::UpstreamTlsContext,
        },
    },
    google::protobuf::Any,
    xds::r#type::matcher::v3::{matcher, Matcher},
};
use prost::Message as _;
use prost_reflect::{DescriptorPool, DynamicMessage};
use waypoint::{
    envoy::{self, Source},
    horizon::{Mode, Query, Viewer},
    model::Endpoint,
};

fn testdata() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/envoy")
}

fn endpoints() -> Vec<Endpoint> {
    waypoint::registry::file::load(&testdata().join("endpoints.json"))
        .unwrap()
        .endpoints
}

fn viewer(mode: Mode) -> Viewer {
    Viewer {
        cluster: "a".into(),
        node: "a-1".into(),
        region: "eu".into(),
        zone: "eu-1".into(),
        mode,
        mesh_domain: "mesh.local".into(),
        tunnel_port: 15443,
        pod_port: 15008,
    }
}

fn config() -> envoy::Config {
    envoy::Config {
        trust_domain: "cluster.local".into(),
        sds_cluster: "spire_agent".into(),
        source_key: "envoy.network.namespace".into(),
        sources: vec![
            "/var/run/netns/cni-productpage-1=bookinfo/productpage"
                .parse::<Source>()
                .unwrap(),
            "/var/run/netns/cni-sleep-1=default/sleep".parse().unwrap(),
            "/var/run/netns/cni-productpage-2=bookinfo/productpage"
                .parse()
                .unwrap(),
        ],
        connect_timeout: Duration::from_secs(2),
    }
}

fn query(service: &str, port: u16) -> Query {
    Query {
        service: service.into(),
        namespace: "bookinfo".into(),
        port,
    }
}

/// A case: its golden's name, the service and its port asked for, the mode, and the pod
/// ports behind that service port.
struct Case {
    name: &'static str,
    service: &'static str,
    port: u16,
    mode: Mode,
    pod_ports: &'static [u16],
}

const CASES: &[Case] = &[
    Case {
        name: "local_only",
        service: "reviews",
        port: 9080,
        mode: Mode::CrossCluster,
        pod_ports: &[9080],
    },
    Case {
        name: "remote_only",
        service: "ratings",
        port: 9080,
        mode: Mode::CrossCluster,
        pod_ports: &[9080],
    },
    Case {
        name: "mixed_localities",
        service: "details",
        port: 9080,
        mode: Mode::CrossCluster,
        pod_ports: &[9080],
    },
    Case {
        name: "mode_always",
        service: "details",
        port: 9080,
        mode: Mode::Always,
        pod_ports: &[9080],
    },
    // Service port 80 goes to pod port 9080 in cluster a and to 8080 in cluster b (a
    // named target port with a different number there).
    Case {
        name: "service_port",
        service: "web",
        port: 80,
        mode: Mode::CrossCluster,
        pod_ports: &[8080, 9080],
    },
];

fn generate(service: &str, port: u16, mode: Mode) -> serde_json::Value {
    envoy::generate(
        &config(),
        &viewer(mode),
        &query(service, port),
        &endpoints(),
    )
    .unwrap()
    .bootstrap
}

/// The kind of dial an endpoint's metadata names (`direct:<port>`, `waypoint:<port>`).
fn kind_of(lb: &envoy_types::pb::envoy::config::endpoint::v3::LbEndpoint) -> String {
    let value = lb
        .metadata
        .as_ref()
        .and_then(|m| m.filter_metadata.get("envoy.lb"))
        .and_then(|s| s.fields.get("socket"))
        .and_then(|v| v.kind.clone());
    match value {
        Some(envoy_types::pb::google::protobuf::value::Kind::StringValue(k)) => k,
        other => panic!("endpoint without a socket kind: {other:?}"),
    }
}

fn pretty(v: &serde_json::Value) -> String {
    serde_json::to_string_pretty(v).unwrap() + "\n"
}

/// Compares with the golden, or rewrites it under WAYPOINT_BLESS=1.
fn check_golden(name: &str, got: &str) {
    let path = testdata().join(format!("{name}.json"));
    if std::env::var_os("WAYPOINT_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with WAYPOINT_BLESS=1 to create it",
            path.display()
        )
    });
    assert!(
        want == got,
        "{name}: generated config differs from {} (WAYPOINT_BLESS=1 rewrites it):\n{got}",
        path.display()
    );
}

#[test]
fn goldens() {
    for c in CASES {
        check_golden(c.name, &pretty(&generate(c.service, c.port, c.mode)));
    }
}

#[test]
fn deterministic_whatever_the_input_order() {
    let mut eps = endpoints();
    eps.reverse();
    let mut cfg = config();
    cfg.sources.reverse();
    let a = envoy::generate(
        &cfg,
        &viewer(Mode::CrossCluster),
        &query("details", 9080),
        &eps,
    )
    .unwrap()
    .bootstrap;
    assert_eq!(a, generate("details", 9080, Mode::CrossCluster));
}

/// The descriptor set inside the envoy-types crate (pinned as =0.7.7 in Cargo.toml), read
/// from cargo's registry sources.
fn envoy_pool() -> DescriptorPool {
    const CRATE_DIR: &str = "envoy-types-0.7.7";
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cargo"));
    let src = cargo_home.join("registry/src");
    let bin = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| {
            e.unwrap()
                .path()
                .join(CRATE_DIR)
                .join("src/generated/types.bin")
        })
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("no {CRATE_DIR} under {}", src.display()));
    DescriptorPool::decode(std::fs::read(&bin).unwrap().as_slice()).unwrap()
}

/// Decodes `json` as a Bootstrap over Envoy's descriptors, then into envoy-types' type.
fn decode(pool: &DescriptorPool, name: &str, json: &str) -> Bootstrap {
    let desc = pool
        .get_message_by_name("envoy.config.bootstrap.v3.Bootstrap")
        .unwrap();
    let mut de = serde_json::Deserializer::from_str(json);
    let dynamic = DynamicMessage::deserialize(desc, &mut de)
        .unwrap_or_else(|e| panic!("{name}: not a valid Envoy v3 Bootstrap: {e}"));
    de.end().unwrap();
    Bootstrap::decode(dynamic.encode_to_vec().as_slice()).unwrap()
}

/// The typed config of a transport socket (its only config form).
fn socket_config(
    m: &envoy_types::pb::envoy::config::cluster::v3::cluster::TransportSocketMatch,
) -> &Any {
    let envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(any) =
        m.transport_socket
            .as_ref()
            .unwrap()
            .config_type
            .as_ref()
            .unwrap();
    any
}

fn unpack<M: prost::Message + Default>(any: &Any) -> M {
    M::decode(any.value.as_slice()).unwrap()
}

/// The socket names the matcher's actions pick, walking the whole tree.
fn actions(m: &Matcher, out: &mut BTreeSet<String>) {
    let mut on_match = |om: &matcher::OnMatch| match &om.on_match {
        Some(matcher::on_match::OnMatch::Action(a)) => {
            let any = a.typed_config.as_ref().unwrap();
            assert!(any.type_url.ends_with("TransportSocketNameAction"));
            out.insert(unpack::<TransportSocketNameAction>(any).name);
        }
        Some(matcher::on_match::OnMatch::Matcher(inner)) => actions(inner, out),
        None => panic!("empty on_match"),
    };
    if let Some(nm) = &m.on_no_match {
        on_match(nm);
    }
    if let Some(matcher::MatcherType::MatcherTree(tree)) = &m.matcher_type {
        match &tree.tree_type {
            Some(matcher::matcher_tree::TreeType::ExactMatchMap(map)) => {
                for om in map.map.values() {
                    on_match(om);
                }
            }
            other => panic!("unexpected tree {other:?}"),
        }
    }
}

fn outbound(b: &Bootstrap) -> &Cluster {
    b.static_resources
        .as_ref()
        .unwrap()
        .clusters
        .iter()
        .find(|c| c.name.starts_with("outbound|"))
        .unwrap()
}

#[test]
fn goldens_are_valid_envoy_v3() {
    let pool = envoy_pool();
    for case in CASES {
        let name = case.name;
        let json = std::fs::read_to_string(testdata().join(format!("{name}.json"))).unwrap();
        let b = decode(&pool, name, &json);
        let cluster = outbound(&b);

        // Every action names a socket that exists, and both sockets of each source.
        let matcher = cluster.transport_socket_matcher.as_ref().unwrap();
        let mut picked = BTreeSet::new();
        actions(matcher, &mut picked);
        let sockets: BTreeSet<String> = cluster
            .transport_socket_matches
            .iter()
            .map(|m| m.name.clone())
            .collect();
        assert_eq!(picked, sockets, "{name}");
        let want: BTreeSet<String> = case
            .pod_ports
            .iter()
            .flat_map(|p| {
                ["direct", "waypoint"].into_iter().flat_map(move |via| {
                    ["bookinfo/productpage", "default/sleep"].map(|id| format!("{via}:{p}/{id}"))
                })
            })
            .collect();
        assert_eq!(sockets, want, "{name}");
        // The sockets differ only in SNI, which names the pod port of their kind.
        for m in &cluster.transport_socket_matches {
            let mut tls: UpstreamTlsContext = unpack(socket_config(m));
            let (kind, _) = m.name.split_once('/').unwrap();
            let (via, port) = kind.split_once(':').unwrap();
            let want = if via == "waypoint" {
                // outbound|<port>|<svc>.<ns>
                let svc_ns = cluster.name.rsplit('|').next().unwrap();
                format!("{port}.{svc_ns}.mesh.local")
            } else {
                port.to_owned()
            };
            assert_eq!(tls.sni, want, "{name} {}", m.name);
            tls.sni.clear();
            let twin = if let Some(rest) = m.name.strip_prefix("waypoint:") {
                format!("direct:{rest}")
            } else {
                m.name.clone()
            };
            let twin = cluster
                .transport_socket_matches
                .iter()
                .find(|t| t.name == twin)
                .unwrap();
            let mut twin_tls: UpstreamTlsContext = unpack(socket_config(twin));
            twin_tls.sni.clear();
            assert_eq!(
                tls, twin_tls,
                "{name}: {} and its twin differ beyond SNI",
                m.name
            );
        }

        // Priorities are dense from 0; every endpoint names a kind of socket the cluster
        // has; waypoint endpoints carry the tunnel port, direct ones the pod port.
        let la = cluster.load_assignment.as_ref().unwrap();
        let prios: BTreeSet<u32> = la.endpoints.iter().map(|l| l.priority).collect();
        assert_eq!(
            prios,
            (0..u32::try_from(prios.len()).unwrap()).collect(),
            "{name}"
        );
        for lle in &la.endpoints {
            for lb in &lle.lb_endpoints {
                let kind = kind_of(lb);
                assert!(
                    sockets.iter().any(|s| s.starts_with(&format!("{kind}/"))),
                    "{name}: {kind} has no socket"
                );
                let waypoint = kind.starts_with("waypoint:");
                let Some(envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier::Endpoint(ep)) = &lb.host_identifier else {
                    panic!("no endpoint");
                };
                let Some(address::Address::SocketAddress(sa)) =
                    ep.address.as_ref().unwrap().address.as_ref()
                else {
                    panic!("no socket address");
                };
                let Some(socket_address::PortSpecifier::PortValue(port)) = sa.port_specifier else {
                    panic!("no port");
                };
                assert_eq!(port, if waypoint { 15443 } else { 15008 }, "{name}");
            }
        }

        // The pod-inbound chains accept both SNIs.
        let listener = &b.static_resources.as_ref().unwrap().listeners[0];
        for chain in &listener.filter_chains {
            let names = &chain.filter_chain_match.as_ref().unwrap().server_names;
            assert_eq!(names.len(), 2, "{name}");
            assert!(names[1].starts_with(&format!("{}.", names[0])), "{name}");
            assert!(names[1].ends_with(".bookinfo.mesh.local"), "{name}");
        }
    }
}

#[test]
fn priorities_and_weights_of_the_mixed_case() {
    let b = decode(
        &envoy_pool(),
        "mixed",
        &pretty(&generate("details", 9080, Mode::CrossCluster)),
    );
    let la = outbound(&b).load_assignment.clone().unwrap();
    // Tier 0: own cluster a (direct, both localities); 1: b (same zone); 2: c (same
    // region); 3: d (elsewhere). e is not exported; d-2 has no node IP.
    // (priority, region/zone, [(address, weight)])
    type Tier = (u32, String, Vec<(String, u32)>);
    let summary: Vec<Tier> = la
        .endpoints
        .iter()
        .map(|l| {
            let loc = l.locality.clone().unwrap_or_default();
            (
                l.priority,
                format!("{}/{}", loc.region, loc.zone),
                l.lb_endpoints
                    .iter()
                    .map(|lb| {
                        let Some(envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier::Endpoint(ep)) = &lb.host_identifier else { panic!() };
                        let Some(address::Address::SocketAddress(sa)) = ep.address.as_ref().unwrap().address.as_ref() else { panic!() };
                        (sa.address.clone(), lb.load_balancing_weight.as_ref().map_or(1, |w| w.value))
                    })
                    .collect(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            (0, "eu/eu-1".into(), vec![("10.244.1.9".into(), 1)]),
            (0, "eu/eu-2".into(), vec![("10.244.2.9".into(), 1)]),
            // Two pods behind b-1's waypoint: one endpoint of weight 2.
            (
                1,
                "eu/eu-1".into(),
                vec![("172.18.0.5".into(), 2), ("172.18.0.6".into(), 1)]
            ),
            (2, "eu/eu-3".into(), vec![("172.18.0.8".into(), 1)]),
            (3, "us/us-1".into(), vec![("172.18.0.11".into(), 1)]),
        ]
    );
}

#[test]
fn cli_prints_the_same_config() {
    let out = Command::new(env!("CARGO_BIN_EXE_waypoint"))
        .args([
            "envoy-config",
            "--service",
            "details.bookinfo",
            "--port",
            "9080",
        ])
        .arg(format!(
            "--registry=file:{}",
            testdata().join("endpoints.json").display()
        ))
        .args([
            "--cluster",
            "a",
            "--node-name",
            "a-1",
            "--region",
            "eu",
            "--zone",
            "eu-1",
            "--mode",
            "cross-cluster",
            "--source",
            "/var/run/netns/cni-productpage-1=bookinfo/productpage",
            "--source",
            "/var/run/netns/cni-sleep-1=default/sleep",
            "--source",
            "/var/run/netns/cni-productpage-2=bookinfo/productpage",
        ])
        .env_clear()
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let golden = std::fs::read_to_string(testdata().join("mixed_localities.json")).unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), golden);
    assert_eq!(
        String::from_utf8(out.stderr).unwrap(),
        "left out: not_ready=0 not_exported=1 no_node_ip=1\n"
    );
}

#[test]
fn cli_requires_a_source() {
    let out = Command::new(env!("CARGO_BIN_EXE_waypoint"))
        .args([
            "envoy-config",
            "--service",
            "details.bookinfo",
            "--port",
            "9080",
        ])
        .arg(format!(
            "--registry=file:{}",
            testdata().join("endpoints.json").display()
        ))
        .env_clear()
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--source"));
}

/// Service port 80 reaches pod port 9080 on cluster a's pod and 8080 on cluster b's: each
/// endpoint is dialed with the SNI of its own pod port, and the pods' inbound has a
/// chain for each, none for the service port.
#[test]
fn each_endpoint_is_dialed_at_its_own_target_port() {
    let b = decode(
        &envoy_pool(),
        "service_port",
        &pretty(&generate("web", 80, Mode::CrossCluster)),
    );
    let cluster = outbound(&b);
    assert_eq!(cluster.name, "outbound|80|web.bookinfo");
    let mut dials = Vec::new();
    for lle in &cluster.load_assignment.as_ref().unwrap().endpoints {
        for lb in &lle.lb_endpoints {
            let Some(
                envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier::Endpoint(
                    ep,
                ),
            ) = &lb.host_identifier
            else {
                panic!()
            };
            let Some(address::Address::SocketAddress(sa)) =
                ep.address.as_ref().unwrap().address.as_ref()
            else {
                panic!()
            };
            dials.push((sa.address.clone(), kind_of(lb)));
        }
    }
    assert_eq!(
        dials,
        vec![
            ("10.244.2.20".to_owned(), "direct:9080".to_owned()),
            ("172.18.0.5".to_owned(), "waypoint:8080".to_owned()),
        ]
    );
    let listener = &b.static_resources.as_ref().unwrap().listeners[0];
    let chains: Vec<String> = listener
        .filter_chains
        .iter()
        .map(|c| c.filter_chain_match.as_ref().unwrap().server_names[0].clone())
        .collect();
    assert_eq!(chains, vec!["8080", "9080", "9443"]);
}
