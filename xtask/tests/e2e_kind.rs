//! What CI can check of `cargo xtask e2e-kind` without Docker: the kind and Flannel
//! configurations agree with each other and with the design (two clusters, one pod
//! subnet, kind's CNI off), and the runner stops at once, saying what is missing, when
//! Docker, kind or kubectl are absent.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;

fn kind_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kind")
}

fn yaml(file: &str) -> Value {
    let text = std::fs::read_to_string(kind_dir().join(file)).unwrap();
    serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"))
}

fn yaml_docs(file: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(kind_dir().join(file)).unwrap();
    serde_norway::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap_or_else(|e| panic!("{file}: {e}")))
        .collect()
}

fn clusters() -> [Value; 2] {
    [yaml("cluster-a.yaml"), yaml("cluster-b.yaml")]
}

#[test]
fn two_kind_clusters_share_the_pod_subnet_without_kinds_cni() {
    let [a, b] = clusters();
    for c in [&a, &b] {
        assert_eq!(c["kind"], "Cluster");
        assert_eq!(c["apiVersion"], "kind.x-k8s.io/v1alpha4");
        assert_eq!(c["networking"]["disableDefaultCNI"], true);
        assert!(c["networking"]["podSubnet"].is_string());
        // At least one worker besides the control plane.
        assert!(c["nodes"].as_array().unwrap().len() >= 2);
    }
    assert_ne!(a["name"], b["name"]);
    assert!(a["name"].is_string() && b["name"].is_string());
    // The point of the exercise: pod IPs of the two clusters collide.
    assert_eq!(a["networking"]["podSubnet"], b["networking"]["podSubnet"]);
}

#[test]
fn flannel_network_is_the_pod_subnet() {
    let [a, _] = clusters();
    let docs = yaml_docs("flannel.yaml");
    let cm = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "kube-flannel-cfg")
        .expect("the kube-flannel-cfg ConfigMap");
    let net: Value = serde_json::from_str(cm["data"]["net-conf.json"].as_str().unwrap()).unwrap();
    assert_eq!(net["Network"], a["networking"]["podSubnet"]);
    assert_eq!(net["Backend"]["Type"], "vxlan");
    let cni: Value = serde_json::from_str(cm["data"]["cni-conf.json"].as_str().unwrap()).unwrap();
    assert_eq!(cni["plugins"][0]["type"], "flannel");
    let ds = docs
        .iter()
        .find(|d| d["kind"] == "DaemonSet")
        .expect("the flannel DaemonSet");
    assert_eq!(ds["metadata"]["namespace"], cm["metadata"]["namespace"]);
    let args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap();
    assert!(args.iter().any(|a| a == "--kube-subnet-mgr"));
}

#[test]
fn echo_service_is_exported() {
    let docs = yaml_docs("echo.yaml");
    let svc = docs.iter().find(|d| d["kind"] == "Service").unwrap();
    assert_eq!(
        svc["metadata"]["annotations"]["waypoint.dev/export"],
        "true"
    );
    let deploy = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let ports = &deploy["spec"]["template"]["spec"]["containers"][0]["ports"];
    assert!(ports
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["containerPort"] == 15008));
}

#[test]
fn runner_fails_fast_without_docker() {
    let empty =
        std::env::temp_dir().join(format!("xtask-e2e-kind-empty-path-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .arg("e2e-kind")
        .env("PATH", &empty)
        .output()
        .unwrap();
    let took = start.elapsed();
    let _ = std::fs::remove_dir(&empty);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(took < Duration::from_secs(1), "took {took:?}");
    for needle in [
        "e2e-kind needs Docker, kind and kubectl",
        "docker: not found on PATH",
        "https://docs.docker.com/engine/install/",
        "kind: not found on PATH",
        "kubectl: not found on PATH",
    ] {
        assert!(stderr.contains(needle), "missing {needle:?} in:\n{stderr}");
    }
}
