//! The operator tools against a file registry, run as an operator runs them: the
//! `waypoint` binary, its output and its exit code.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::process::{Command, Output};

fn waypoint(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_waypoint"))
        .args(args)
        .output()
        .expect("the waypoint binary runs")
}

/// A file registry with two pods of reviews.bookinfo in two clusters.
fn registry(dir: &std::path::Path) -> String {
    let path = dir.join("endpoints.json");
    std::fs::write(
        &path,
        r#"{"endpoints":[
  {"service":"reviews","namespace":"bookinfo","cluster":"a","pod_ip":"10.1.0.5","node_name":"a1","node_ip":"192.168.10.5","ports":[9080],"exported":true,"ready":true},
  {"service":"reviews","namespace":"bookinfo","cluster":"b","pod_ip":"10.2.0.5","node_name":"b1","node_ip":"192.168.20.5","ports":[9080],"exported":true,"ready":true}
]}"#,
    )
    .unwrap();
    format!("file:{}", path.display())
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("waypoint-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A service or namespace that is no DNS-1123 label cannot exist: `resolve` and
/// `envoy-config` refuse it with a message naming it and exit 2, as for a bad port,
/// rather than printing an empty view.
#[test]
fn names_that_cannot_exist_are_refused() {
    let dir = tempdir("names");
    let registry = registry(&dir);
    for target in [
        "re views.bookinfo:9080",
        "Reviews.bookinfo:9080",
        "reviews.book_info:9080",
    ] {
        let out = waypoint(&["resolve", target, "--registry", &registry, "--cluster", "a"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{target}: {stderr}");
        assert!(stderr.contains("DNS-1123"), "{target}: {stderr}");
        assert!(out.stdout.is_empty(), "{target}: printed a view");
    }
    let out = waypoint(&[
        "envoy-config",
        "--service",
        "Reviews.bookinfo",
        "--port",
        "9080",
        "--registry",
        &registry,
        "--cluster",
        "a",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("DNS-1123"));

    // The same names in lowercase resolve.
    let out = waypoint(&[
        "resolve",
        "reviews.bookinfo:9080",
        "--registry",
        &registry,
        "--cluster",
        "a",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("10.1.0.5:15008"));
    std::fs::remove_dir_all(dir).unwrap();
}

/// `registry list` reads a file registry too, with the keys etcd would give its records;
/// `put` and `delete` still need etcd, and say so.
#[test]
fn registry_list_reads_a_file_registry() {
    let dir = tempdir("list");
    let registry = registry(&dir);
    let out = waypoint(&[
        "registry",
        "list",
        "--registry",
        &registry,
        "--output",
        "json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 2);
    for entry in listed {
        let key = entry["key"].as_str().unwrap();
        assert!(key.starts_with("/aether/v1/regions/"), "{key}");
    }
    let out = waypoint(&[
        "registry",
        "delete",
        "--registry",
        &registry,
        "/aether/v1/regions/x",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("need etcd:URL"));
    std::fs::remove_dir_all(dir).unwrap();
}

/// A node IP that is this host's but not the address the tunnel listens on would be
/// registered for other clusters to dial and served by nobody: `run` refuses to start,
/// naming both.
#[test]
fn a_node_ip_the_tunnel_does_not_serve_is_refused() {
    let out = waypoint(&[
        "run",
        "--node-ip",
        "127.0.0.1",
        "--tunnel-addr",
        "127.0.0.2:0",
        "--admin-addr",
        "127.0.0.1:0",
        "--dataplane",
        "copy",
    ]);
    assert!(!out.status.success(), "started anyway");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--node-ip 127.0.0.1") && err.contains("127.0.0.2"),
        "{err}"
    );
}

/// `resolve` takes the service port; the SNI of each target names the pod port behind it
/// on that pod. The pod port alone is no service port, and a file whose service port
/// goes to a pod port the record does not list is refused with the reason.
#[test]
fn resolve_takes_the_service_port_and_dials_the_pod_port() {
    let dir = tempdir("service-port");
    let path = dir.join("endpoints.json");
    let record = |cluster: &str, ip: &str, target: u16| {
        format!(
            r#"{{"service":"web","namespace":"shop","cluster":"{cluster}","pod_ip":"{ip}","node_name":"{cluster}1","node_ip":"192.168.0.{}","ports":[{target}],"service_ports":[{{"port":80,"target_port":{target}}}],"exported":true}}"#,
            cluster.len()
        )
    };
    std::fs::write(
        &path,
        format!(
            r#"{{"endpoints":[{},{}]}}"#,
            record("a", "10.1.0.5", 9080),
            record("bb", "10.2.0.5", 8080)
        ),
    )
    .unwrap();
    let registry = format!("file:{}", path.display());
    let resolve = |target: &str| {
        waypoint(&[
            "resolve",
            target,
            "--registry",
            &registry,
            "--cluster",
            "a",
            "--mode",
            "cross-cluster",
        ])
    };
    let out = resolve("web.shop:80");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("10.1.0.5:15008     9080 "), "{stdout}");
    assert!(
        stdout.contains("192.168.0.2:15443  8080.web.shop.mesh.local "),
        "{stdout}"
    );
    let out = resolve("web.shop:9080");
    assert!(out.status.success());
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("10.1.0.5"),
        "9080 is a pod port, not a service port"
    );

    std::fs::write(
        &path,
        r#"{"endpoints":[{"service":"web","namespace":"shop","cluster":"a","pod_ip":"10.1.0.5","node_name":"a1","ports":[9080],"service_ports":[{"port":80,"target_port":7070}]}]}"#,
    )
    .unwrap();
    let out = resolve("web.shop:80");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("service port 80 goes to pod port 7070"),
        "{stderr}"
    );
}

/// `prepare-node` turns tcp_migrate_req on in its network namespace, and says so; run
/// again it finds it on. A namespace of the test's own, whose setting starts off (the
/// kernel's default), so that the host's stays as it is. Needs root; never skipped.
#[test]
fn prepare_node_turns_request_migration_on() {
    assert!(nix::unistd::geteuid().is_root(), "needs root (ip netns)");
    let ns = format!("wp-cli-{}", std::process::id());
    let ip = |args: &[&str]| {
        let out = Command::new("ip").args(args).output().expect("ip runs");
        assert!(out.status.success(), "ip {args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    ip(&["netns", "add", &ns]);
    struct Delete(String);
    impl Drop for Delete {
        fn drop(&mut self) {
            let _ = Command::new("ip")
                .args(["netns", "delete", &self.0])
                .status();
        }
    }
    let _delete = Delete(ns.clone());
    let setting = || {
        ip(&[
            "netns",
            "exec",
            &ns,
            "cat",
            "/proc/sys/net/ipv4/tcp_migrate_req",
        ])
    };
    assert_eq!(setting().trim(), "0", "a new namespace starts with it off");
    let bin = env!("CARGO_BIN_EXE_waypoint");
    let first = ip(&["netns", "exec", &ns, bin, "prepare-node"]);
    assert_eq!(first.trim(), "net.ipv4.tcp_migrate_req: turned on");
    assert_eq!(setting().trim(), "1");
    let again = ip(&["netns", "exec", &ns, bin, "prepare-node"]);
    assert_eq!(again.trim(), "net.ipv4.tcp_migrate_req: already on");

    // A read-only /proc/sys (an unprivileged container's), with the setting off: a
    // clear error and a failed exit, so that the init container's failure shows.
    let off = Command::new("ip")
        .args(["netns", "exec", &ns, "sh", "-c"])
        .arg("echo 0 > /proc/sys/net/ipv4/tcp_migrate_req")
        .status()
        .unwrap();
    assert!(off.success());
    let read_only = Command::new("ip")
        .args(["netns", "exec", &ns, "unshare", "--mount", "sh", "-c"])
        .arg(format!(
            "mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && \
             exec {bin} prepare-node"
        ))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&read_only.stderr);
    assert!(!read_only.status.success(), "{read_only:?}");
    assert!(
        stderr.contains("turning on net.ipv4.tcp_migrate_req") && stderr.contains("privileged"),
        "{stderr}"
    );
    assert_eq!(setting().trim(), "0", "left as it was");
}
