//! The Kubernetes manifests of deploy/kubernetes, read as typed k8s-openapi objects and
//! checked against what the daemon actually is: every environment variable they set is a
//! real `waypoint run` flag and parses; the probes hit the admin server's port and paths;
//! the etcd TLS files are where the Secret is mounted; the capabilities and RBAC are
//! exactly the intended ones.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::OsStr,
    path::{Path, PathBuf},
};

use clap::{Args as _, FromArgMatches as _};
use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, Container, Namespace, ServiceAccount},
        rbac::v1::{ClusterRole, ClusterRoleBinding},
    },
    apimachinery::pkg::util::intstr::IntOrString,
};
use serde::de::DeserializeOwned;
use waypoint::{config::Config, registry};

const NAMESPACE: &str = "waypoint-system";

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

fn read(file: &str) -> String {
    std::fs::read_to_string(dir().join(file)).unwrap()
}

/// Parses `file` as `T`, and checks that nothing in it was dropped on the way: a
/// misspelled or misplaced field would deserialize silently and be ignored by the API
/// server too.
fn load<T: DeserializeOwned + serde::Serialize>(file: &str) -> T {
    let text = read(file);
    let typed: T = serde_norway::from_str(&text)
        .unwrap_or_else(|e| panic!("{file}: not the kind expected: {e}"));
    let raw: serde_json::Value = serde_norway::from_str(&text).unwrap();
    let back = serde_json::to_value(&typed).unwrap();
    assert_eq!(back, raw, "{file}: fields that the API type does not know");
    typed
}

#[test]
fn kustomization_lists_every_file() {
    let k: serde_json::Value = serde_norway::from_str(&read("kustomization.yaml")).unwrap();
    assert_eq!(k["kind"], "Kustomization");
    let listed: BTreeSet<String> = k["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_owned())
        .collect();
    let present: BTreeSet<String> = std::fs::read_dir(dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    assert_eq!(listed, present);
    // Patch-free: the files are the rendered output.
    for key in [
        "patches",
        "patchesStrategicMerge",
        "patchesJson6902",
        "images",
        "configMapGenerator",
        "secretGenerator",
        "namePrefix",
        "nameSuffix",
        "namespace",
        "labels",
        "commonLabels",
    ] {
        assert!(k.get(key).is_none(), "kustomization.yaml has {key}");
    }
}

fn daemonset() -> DaemonSet {
    load("daemonset.yaml")
}

fn container(ds: &DaemonSet) -> Container {
    let spec = ds.spec.template.spec.as_ref().unwrap();
    assert_eq!(spec.containers.len(), 1);
    spec.containers[0].clone()
}

/// `waypoint run`'s flags.
fn run_command() -> clap::Command {
    Config::augment_args(clap::Command::new("run"))
}

/// Variables the manifests may set that `waypoint run` does not parse as flags: the
/// logging switch (read by telemetry).
const NOT_FLAGS: &[&str] = &["LOG_FORMAT"];

/// Parses the daemon's Config from environment-style pairs, as the container would.
fn config_from_env(vars: &BTreeMap<String, String>) -> Config {
    let cmd = run_command();
    let mut args = vec!["run".to_owned()];
    for (name, value) in vars {
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_env() == Some(OsStr::new(name)));
        let Some(arg) = arg else {
            assert!(
                NOT_FLAGS.contains(&name.as_str()),
                "{name} is not a `waypoint run` variable"
            );
            continue;
        };
        let long = arg.get_long().unwrap();
        if matches!(arg.get_action(), clap::ArgAction::SetTrue) {
            if value == "true" {
                args.push(format!("--{long}"));
            }
        } else {
            args.push(format!("--{long}={value}"));
        }
    }
    let matches = cmd
        .try_get_matches_from(&args)
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    Config::from_arg_matches(&matches).unwrap()
}

/// The container's environment with downward-API values filled in as kubelet would.
fn environment(c: &Container, cm: &ConfigMap) -> BTreeMap<String, String> {
    environment_on(c, cm, "192.0.2.10")
}

/// [`environment`] on a node whose IP (`status.hostIP`) is `node_ip`.
fn environment_on(c: &Container, cm: &ConfigMap, node_ip: &str) -> BTreeMap<String, String> {
    let mut vars = BTreeMap::new();
    for from in c.env_from.as_ref().unwrap() {
        let name = &from.config_map_ref.as_ref().unwrap().name;
        assert_eq!(name, cm.metadata.name.as_ref().unwrap());
        vars.extend(cm.data.clone().unwrap());
    }
    for e in c.env.as_ref().unwrap() {
        let value = match (&e.value, &e.value_from) {
            (Some(v), None) => v.replace("$(WAYPOINT_NODE_IP)", node_ip),
            (None, Some(from)) => match from.field_ref.as_ref().unwrap().field_path.as_str() {
                "spec.nodeName" => "node-1".to_owned(),
                "status.hostIP" => node_ip.to_owned(),
                other => panic!("unexpected field {other}"),
            },
            _ => panic!("{}: value and valueFrom", e.name),
        };
        vars.insert(e.name.clone(), value);
    }
    vars
}

#[test]
fn daemonset_runs_privileged_enough_and_no_more() {
    let ds = daemonset();
    assert_eq!(ds.metadata.namespace.as_deref(), Some(NAMESPACE));
    let spec = ds.spec.template.spec.clone().unwrap();
    assert_eq!(spec.host_network, Some(true));
    assert_eq!(spec.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"));
    assert_eq!(
        spec.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tolerations = spec.tolerations.unwrap();
    assert!(tolerations
        .iter()
        .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()));
    assert_eq!(spec.service_account_name.as_deref(), Some("waypoint"));

    let c = container(&ds);
    let sc = c.security_context.clone().unwrap();
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    let caps = sc.capabilities.unwrap();
    assert_eq!(caps.drop, Some(vec!["ALL".to_owned()]));
    let added: BTreeSet<String> = caps.add.unwrap().into_iter().collect();
    // Exactly what the daemon, configured as the manifests configure it, says it uses.
    let cm: ConfigMap = load("configmap.yaml");
    let config = config_from_env(&environment(&c, &cm));
    let needed: BTreeSet<String> = config
        .capabilities()
        .into_iter()
        .map(str::to_owned)
        .collect();
    assert_eq!(added, needed, "granted against needed");
    assert_eq!(
        added,
        BTreeSet::from([
            "BPF".to_owned(),
            "NET_ADMIN".to_owned(),
            "NET_RAW".to_owned(),
            "PERFMON".to_owned()
        ])
    );
    // The rewrite splice (auto's default) is what needs NET_RAW: an operator who turns
    // it off can drop it, and a named ebpf does not ask for it unless told to.
    let mut vars = environment(&c, &cm);
    vars.insert("WAYPOINT_REWRITE_SPLICE".into(), "false".into());
    assert!(!config_from_env(&vars).capabilities().contains("NET_RAW"));
    vars.insert("WAYPOINT_DATAPLANE".into(), "ebpf".into());
    vars.remove("WAYPOINT_REWRITE_SPLICE");
    assert!(!config_from_env(&vars).capabilities().contains("NET_RAW"));
    vars.insert("WAYPOINT_REWRITE_SPLICE".into(), "true".into());
    assert!(config_from_env(&vars).capabilities().contains("NET_RAW"));
    // No host ports: the surge pod of a rolling update must be schedulable.
    assert!(c.ports.is_none());

    // The one privileged part: the init container that writes the node's
    // tcp_migrate_req, with the daemon's own image and a subcommand it has.
    let init = spec.init_containers.clone().unwrap_or_default();
    assert_eq!(init.len(), 1, "one init container");
    let prepare = &init[0];
    assert_eq!(prepare.image, c.image);
    assert_eq!(prepare.args, Some(vec!["prepare-node".to_owned()]));
    assert_eq!(
        prepare.security_context.as_ref().and_then(|s| s.privileged),
        Some(true)
    );
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_waypoint"))
        .args(["prepare-node", "--help"])
        .output()
        .unwrap();
    assert!(help.status.success(), "waypoint prepare-node: {help:?}");
}

/// A rolling update surges: the new pod runs (and its adopter looks for programs every
/// 500 ms) before the old one gets SIGTERM, and no node is left without a waypoint. The
/// old one then has time to drain and to hand its rewritten connections over before
/// kubelet's SIGKILL; SIGTERM itself starts the hand-over, so no `preStop` is needed.
#[test]
fn updates_surge_and_leave_time_to_hand_over() {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let ds = daemonset();
    let strategy = ds.spec.update_strategy.clone().unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.unwrap();
    assert_eq!(rolling.max_surge, Some(IntOrString::Int(1)));
    assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(0)));
    let spec = ds.spec.template.spec.clone().unwrap();
    assert!(spec.containers[0].lifecycle.is_none(), "no preStop hook");
    let cm: ConfigMap = load("configmap.yaml");
    let config = config_from_env(&environment(&container(&ds), &cm));
    let grace = std::time::Duration::from_secs(
        u64::try_from(spec.termination_grace_period_seconds.unwrap()).unwrap(),
    );
    assert!(
        grace > config.drain_timeout + waypoint::app::HAND_OVER_WAIT,
        "grace {grace:?}, drain {:?}",
        config.drain_timeout
    );
}

#[test]
fn bpffs_is_mounted() {
    let ds = daemonset();
    let spec = ds.spec.template.spec.clone().unwrap();
    let vol = spec
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| {
            v.host_path
                .as_ref()
                .is_some_and(|h| h.path == "/sys/fs/bpf")
        })
        .expect("a hostPath volume of /sys/fs/bpf");
    let mount = container(&ds)
        .volume_mounts
        .unwrap()
        .into_iter()
        .find(|m| m.name == vol.name)
        .expect("bpffs mounted");
    assert_eq!(mount.mount_path, "/sys/fs/bpf");
    // Writable: the daemon pins its rewrite program there (--pin-dir's default), so that
    // its rewritten connections outlive it.
    assert_ne!(mount.read_only, Some(true));
}

#[test]
fn environment_is_the_daemons_flags() {
    let ds = daemonset();
    let cm: ConfigMap = load("configmap.yaml");
    assert_eq!(cm.metadata.namespace.as_deref(), Some(NAMESPACE));
    let c = container(&ds);
    assert_eq!(c.args, Some(vec!["run".to_owned()]));
    // Downward API.
    let env = c.env.clone().unwrap();
    let field = |name: &str| {
        env.iter()
            .find(|e| e.name == name)
            .and_then(|e| e.value_from.as_ref())
            .and_then(|f| f.field_ref.as_ref())
            .map(|f| f.field_path.clone())
    };
    assert_eq!(
        field("WAYPOINT_NODE_NAME").as_deref(),
        Some("spec.nodeName")
    );
    assert_eq!(field("WAYPOINT_NODE_IP").as_deref(), Some("status.hostIP"));
    assert!(env
        .iter()
        .any(|e| e.name == "WAYPOINT_KUBERNETES" && e.value.as_deref() == Some("true")));
    // A variable that refers to another must come after it (kubelet expands in order).
    let pos = |n: &str| env.iter().position(|e| e.name == n).unwrap();
    assert!(pos("WAYPOINT_NODE_IP") < pos("WAYPOINT_ADMIN_ADDR"));
    assert!(pos("WAYPOINT_NODE_IP") < pos("WAYPOINT_TUNNEL_ADDR"));

    let vars = environment(&c, &cm);
    let config = config_from_env(&vars);
    assert_eq!(config.node_name, "node-1");
    assert_eq!(config.node_ip, Some("192.0.2.10".parse().unwrap()));
    assert_eq!(config.tunnel_addr, "192.0.2.10:15443".parse().unwrap());
    assert!(
        matches!(config.registry, Some(registry::Location::Etcd(ref urls)) if urls.iter().all(|u| u.starts_with("https://")))
    );

    // The same manifest on an IPv6 node: the listeners bind its address, on their ports.
    let config = config_from_env(&environment_on(&c, &cm, "2001:db8::10"));
    assert_eq!(config.node_ip, Some("2001:db8::10".parse().unwrap()));
    assert_eq!(config.tunnel_addr, "[2001:db8::10]:15443".parse().unwrap());
    assert_eq!(config.admin_addr, "[2001:db8::10]:15021".parse().unwrap());
}

#[test]
fn probes_hit_the_admin_server() {
    let ds = daemonset();
    let cm: ConfigMap = load("configmap.yaml");
    let c = container(&ds);
    let config = config_from_env(&environment(&c, &cm));
    // kubelet probes a host-network pod at the node IP: the admin server must listen there.
    assert_eq!(config.admin_addr, "192.0.2.10:15021".parse().unwrap());
    let admin = include_str!("../src/admin.rs");
    for (probe, path) in [
        (c.readiness_probe.unwrap(), "/readyz"),
        (c.liveness_probe.unwrap(), "/healthz"),
    ] {
        let get = probe.http_get.unwrap();
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(
            get.port,
            IntOrString::Int(i32::from(config.admin_addr.port()))
        );
        assert!(
            get.host.is_none(),
            "the pod IP (the node IP) is where the admin server listens"
        );
        assert!(
            admin.contains(&format!("\"{path}\"")),
            "admin.rs does not serve {path}"
        );
    }
}

#[test]
fn etcd_tls_files_are_the_mounted_secret() {
    let ds = daemonset();
    let cm: ConfigMap = load("configmap.yaml");
    let c = container(&ds);
    let config = config_from_env(&environment(&c, &cm));
    let spec = ds.spec.template.spec.clone().unwrap();
    let vol = spec
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| v.secret.is_some())
        .unwrap();
    let secret = vol.secret.unwrap();
    assert_eq!(secret.secret_name.as_deref(), Some("waypoint-etcd-tls"));
    // 0400: YAML 1.1 (the API server) and 1.2 read a leading-zero number differently, so
    // the manifest spells it in decimal.
    assert_eq!(secret.default_mode, Some(0o400));
    let mount = c
        .volume_mounts
        .unwrap()
        .into_iter()
        .find(|m| m.name == vol.name)
        .unwrap();
    assert_eq!(mount.read_only, Some(true));
    let items: BTreeMap<String, String> = secret
        .items
        .unwrap()
        .into_iter()
        .map(|i| (i.key, i.path))
        .collect();
    let at = |key: &str| Path::new(&mount.mount_path).join(&items[key]);
    assert_eq!(config.etcd.etcd_ca, Some(at("ca.crt")));
    assert_eq!(config.etcd.etcd_cert, Some(at("tls.crt")));
    assert_eq!(config.etcd.etcd_key, Some(at("tls.key")));
}

#[test]
fn rbac_is_exactly_the_watch_list() {
    let role: ClusterRole = load("clusterrole.yaml");
    let mut got = BTreeSet::new();
    for rule in role.rules.unwrap() {
        assert!(rule.resource_names.is_none() && rule.non_resource_urls.is_none());
        for group in rule.api_groups.unwrap() {
            for resource in rule.resources.clone().unwrap() {
                for verb in &rule.verbs {
                    got.insert(format!("{group}/{resource}:{verb}"));
                }
            }
        }
    }
    let want: BTreeSet<String> = [
        "/nodes:get",
        "/nodes:list",
        "/nodes:watch",
        "/pods:list",
        "/pods:watch",
        "/services:list",
        "/services:watch",
        "discovery.k8s.io/endpointslices:list",
        "discovery.k8s.io/endpointslices:watch",
    ]
    .map(str::to_owned)
    .into();
    assert_eq!(got, want);

    let binding: ClusterRoleBinding = load("clusterrolebinding.yaml");
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(Some(binding.role_ref.name), role.metadata.name);
    let sa: ServiceAccount = load("serviceaccount.yaml");
    let subjects = binding.subjects.unwrap();
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(Some(subjects[0].name.clone()), sa.metadata.name);
    assert_eq!(subjects[0].namespace, sa.metadata.namespace);
    assert_eq!(
        daemonset().spec.template.spec.unwrap().service_account_name,
        sa.metadata.name
    );
}

#[test]
fn namespace_admits_the_daemonset() {
    let ns: Namespace = load("namespace.yaml");
    assert_eq!(ns.metadata.name.as_deref(), Some(NAMESPACE));
    let labels = ns.metadata.labels.unwrap();
    assert_eq!(
        labels
            .get("pod-security.kubernetes.io/enforce")
            .map(String::as_str),
        Some("privileged")
    );
}
