//! `cargo xtask e2e-kind`: two kind clusters with the same pod subnet and Flannel, a
//! shared etcd container on Docker's `kind` network, the waypoint image built and loaded,
//! the DaemonSet of deploy/kubernetes applied, then a client in cluster A reaching an
//! exported service in cluster B through B's node waypoint.
//!
//! Opt-in (needs Docker, kind, kubectl): the preflight names what is missing and stops
//! before doing anything. The configurations it uses are checked statically by
//! xtask/tests/e2e_kind.rs, which CI runs without Docker.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};

/// The tools the run needs, and how to get each.
const TOOLS: &[(&str, &str)] = &[
    (
        "docker",
        "install Docker Engine (https://docs.docker.com/engine/install/) and start it",
    ),
    (
        "kind",
        "go install sigs.k8s.io/kind@latest, or a release binary from https://kind.sigs.k8s.io/docs/user/quick-start/#installation",
    ),
    (
        "kubectl",
        "a release binary from https://kubernetes.io/docs/tasks/tools/#kubectl",
    ),
    ("openssl", "apt-get install openssl"),
    ("curl", "apt-get install curl"),
];

const IMAGE: &str = "waypoint:0.1.0";
const ETCD_NAME: &str = "waypoint-e2e-etcd";
const ETCD_IMAGE: &str = "quay.io/coreos/etcd:v3.5.17";
const CLIENT_IMAGE: &str = "docker.io/curlimages/curl:8.11.1";
const CNI_PLUGINS_VERSION: &str = "v1.6.2";
const MESH_DOMAIN: &str = "mesh.local";
const SERVICE: &str = "echo";
const NAMESPACE: &str = "demo";
const PORT: u16 = 9080;

/// Looks `name` up on PATH without running anything (the preflight must be instant).
fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Why the run cannot start.
#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    /// Tools not on PATH, each with how to get it.
    #[error(
        "e2e-kind needs Docker, kind and kubectl (it creates two kind clusters); missing:\n{0}"
    )]
    Missing(String),
    /// The Docker CLI is there, the daemon is not.
    #[error("e2e-kind needs a running Docker daemon: `docker info` failed: {0}")]
    NoDaemon(String),
}

/// Fails with every missing tool and how to get it, before anything is started.
pub fn preflight() -> Result<(), PreflightError> {
    let missing: Vec<String> = TOOLS
        .iter()
        .filter(|(name, _)| on_path(name).is_none())
        .map(|(name, how)| format!("  - {name}: not found on PATH; {how}"))
        .collect();
    if !missing.is_empty() {
        return Err(PreflightError::Missing(missing.join("\n")));
    }
    // The docker CLI without a reachable daemon fails here rather than mid-run.
    let out = output_timeout(
        Command::new("docker").args(["info", "--format", "{{.ServerVersion}}"]),
        Duration::from_secs(10),
    )
    .map_err(|e| PreflightError::NoDaemon(format!("{e:#}")))?;
    if !out.status.success() {
        return Err(PreflightError::NoDaemon(
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        ));
    }
    Ok(())
}

fn output_timeout(cmd: &mut Command, limit: Duration) -> anyhow::Result<std::process::Output> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {cmd:?}"))?;
    let start = Instant::now();
    while child.try_wait()?.is_none() {
        if start.elapsed() > limit {
            // Best effort: the process may have exited in between.
            let _ = child.kill();
            bail!("{cmd:?} did not finish within {limit:?}");
        }
        thread::sleep(Duration::from_millis(50));
    }
    Ok(child.wait_with_output()?)
}

/// Runs a command, echoing it; fails on a non-zero exit.
fn run(cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("+ {cmd:?}");
    let status = cmd.status().with_context(|| format!("spawning {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// Runs a command and returns its trimmed stdout; fails on a non-zero exit.
fn capture(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("spawning {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Runs a command, feeding `input` on stdin.
fn run_with_input(cmd: &mut Command, input: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    eprintln!("+ {cmd:?} <<input");
    let mut child = cmd
        .stdin(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {cmd:?}"))?;
    child
        .stdin
        .take()
        .context("stdin not piped")?
        .write_all(input.as_bytes())?;
    let status = child.wait()?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// Retries `f` every two seconds until it returns Some or `limit` passes.
fn poll<T>(
    what: &str,
    limit: Duration,
    mut f: impl FnMut() -> anyhow::Result<Option<T>>,
) -> anyhow::Result<T> {
    let start = Instant::now();
    let mut last = String::new();
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = format!(" (last error: {e:#})"),
        }
        if start.elapsed() > limit {
            bail!("timed out after {limit:?} waiting for {what}{last}");
        }
        thread::sleep(Duration::from_secs(2));
    }
}

/// A kind cluster of the run.
struct Cluster {
    name: String,
    config: PathBuf,
}

impl Cluster {
    fn context(&self) -> String {
        format!("kind-{}", self.name)
    }

    fn kubectl(&self) -> Command {
        let mut c = Command::new("kubectl");
        c.args(["--context", &self.context()]);
        c
    }

    fn nodes(&self) -> anyhow::Result<Vec<String>> {
        Ok(
            capture(Command::new("kind").args(["get", "nodes", "--name", &self.name]))?
                .lines()
                .map(str::to_owned)
                .collect(),
        )
    }

    fn node_ip(&self, node: &str) -> anyhow::Result<String> {
        capture(self.kubectl().args([
            "get",
            "node",
            node,
            "-o",
            "jsonpath={.status.addresses[?(@.type==\"InternalIP\")].address}",
        ]))
    }
}

/// The `name:` of a kind config.
fn cluster_name(config: &Path) -> anyhow::Result<String> {
    let text =
        std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    let doc: serde_json::Value =
        serde_norway::from_str(&text).with_context(|| format!("parsing {}", config.display()))?;
    doc["name"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("{} has no name", config.display()))
}

/// The whole run. `keep` leaves the clusters and etcd running.
pub fn e2e(root: &Path, keep: bool) -> anyhow::Result<()> {
    preflight()?; // Already passed when called from main; cheap, and keeps e2e self-contained.
    let kind_dir = root.join("deploy/kind");
    let work = root.join("target/e2e-kind");
    std::fs::create_dir_all(&work)?;
    let clusters = ["cluster-a.yaml", "cluster-b.yaml"]
        .iter()
        .map(|f| {
            let config = kind_dir.join(f);
            Ok(Cluster {
                name: cluster_name(&config)?,
                config,
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let result = scenario(root, &work, &clusters);
    if keep {
        eprintln!(
            "--keep: clusters {} and container {ETCD_NAME} left running",
            clusters
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    } else {
        teardown(&clusters);
    }
    result
}

fn teardown(clusters: &[Cluster]) {
    for c in clusters {
        let _ = run(Command::new("kind").args(["delete", "cluster", "--name", &c.name]));
    }
    let _ = run(Command::new("docker").args(["rm", "-f", ETCD_NAME]));
}

fn scenario(root: &Path, work: &Path, clusters: &[Cluster]) -> anyhow::Result<()> {
    let existing = capture(Command::new("kind").args(["get", "clusters"]))?;
    for c in clusters {
        if existing.lines().any(|l| l == c.name) {
            run(Command::new("kind").args(["delete", "cluster", "--name", &c.name]))?;
        }
        run(Command::new("kind")
            .args(["create", "cluster", "--config"])
            .arg(&c.config))?;
    }
    let plugins = cni_plugins(work)?;
    for c in clusters {
        for node in c.nodes()? {
            // Flannel delegates to bridge/host-local/portmap; kind's image ships only
            // the plugins its own CNI uses.
            run(Command::new("docker")
                .arg("cp")
                .arg(&plugins)
                .arg(format!("{node}:/tmp/cni-plugins.tgz")))?;
            run(Command::new("docker").args([
                "exec",
                &node,
                "tar",
                "-xzf",
                "/tmp/cni-plugins.tgz",
                "-C",
                "/opt/cni/bin",
                "./bridge",
                "./host-local",
                "./portmap",
                "./loopback",
            ]))?;
        }
        run(c
            .kubectl()
            .arg("apply")
            .arg("-f")
            .arg(root.join("deploy/kind/flannel.yaml")))?;
    }
    for c in clusters {
        run(c.kubectl().args([
            "wait",
            "--for=condition=Ready",
            "nodes",
            "--all",
            "--timeout=300s",
        ]))?;
    }

    let pki = work.join("pki");
    make_pki(&pki)?;
    start_etcd(&pki)?;

    run(Command::new("docker").current_dir(root).args([
        "build",
        "-f",
        "deploy/Dockerfile",
        "-t",
        IMAGE,
        ".",
    ]))?;
    for c in clusters {
        run(Command::new("kind").args(["load", "docker-image", IMAGE, "--name", &c.name]))?;
        deploy_waypoint(root, &pki, c)?;
    }
    verify(root, &pki, &clusters[0], &clusters[1])
}

fn cni_plugins(work: &Path) -> anyhow::Result<PathBuf> {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => bail!("no CNI plugin build for {other}"),
    };
    let file = work.join(format!(
        "cni-plugins-linux-{arch}-{CNI_PLUGINS_VERSION}.tgz"
    ));
    if !file.exists() {
        let url = format!(
            "https://github.com/containernetworking/plugins/releases/download/{CNI_PLUGINS_VERSION}/cni-plugins-linux-{arch}-{CNI_PLUGINS_VERSION}.tgz"
        );
        run(Command::new("curl")
            .args(["-fsSL", "-o"])
            .arg(&file)
            .arg(&url))?;
    }
    Ok(file)
}

/// A CA, etcd's server certificate, the waypoints' etcd client certificate and the echo
/// server's certificate.
fn make_pki(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let openssl = |args: &[&str]| run(Command::new("openssl").current_dir(dir).args(args));
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=waypoint-e2e-ca",
    ])?;
    for (name, cn, san) in [
        (
            "etcd",
            ETCD_NAME,
            format!("DNS:{ETCD_NAME},DNS:localhost,IP:127.0.0.1"),
        ),
        ("client", "waypoint", "DNS:waypoint".to_owned()),
        (
            "echo",
            "echo",
            format!("DNS:*.{SERVICE}.{NAMESPACE}.{MESH_DOMAIN},DNS:{PORT}"),
        ),
    ] {
        openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={cn}"),
        ])?;
        std::fs::write(
            dir.join(format!("{name}.ext")),
            format!("subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n"),
        )?;
        openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            &format!("{name}.crt"),
            "-extfile",
            &format!("{name}.ext"),
        ])?;
    }
    Ok(())
}

fn start_etcd(pki: &Path) -> anyhow::Result<()> {
    let _ = capture(Command::new("docker").args(["rm", "-f", ETCD_NAME]));
    run(Command::new("docker")
        .args(["run", "-d", "--name", ETCD_NAME, "--network", "kind", "-v"])
        .arg(format!("{}:/pki:ro", pki.display()))
        .args([
            ETCD_IMAGE,
            "/usr/local/bin/etcd",
            "--name=e2e",
            "--data-dir=/etcd-data",
            "--listen-client-urls=https://0.0.0.0:2379",
        ])
        .arg(format!("--advertise-client-urls=https://{ETCD_NAME}:2379"))
        .args([
            "--cert-file=/pki/etcd.crt",
            "--key-file=/pki/etcd.key",
            "--trusted-ca-file=/pki/ca.crt",
            "--client-cert-auth",
        ]))?;
    poll("etcd to answer", Duration::from_secs(60), || {
        let ok = Command::new("docker")
            .args([
                "exec",
                ETCD_NAME,
                "/usr/local/bin/etcdctl",
                "--endpoints=https://127.0.0.1:2379",
                "--cacert=/pki/ca.crt",
                "--cert=/pki/client.crt",
                "--key=/pki/client.key",
                "endpoint",
                "health",
            ])
            .output()?
            .status
            .success();
        Ok(ok.then_some(()))
    })
}

fn deploy_waypoint(root: &Path, pki: &Path, c: &Cluster) -> anyhow::Result<()> {
    run(c
        .kubectl()
        .arg("apply")
        .arg("-f")
        .arg(root.join("deploy/kubernetes/namespace.yaml")))?;
    let secret = capture(
        c.kubectl()
            .args([
                "-n",
                "waypoint-system",
                "create",
                "secret",
                "generic",
                "waypoint-etcd-tls",
                "--dry-run=client",
                "-o",
                "yaml",
            ])
            .arg(format!(
                "--from-file=ca.crt={}",
                pki.join("ca.crt").display()
            ))
            .arg(format!(
                "--from-file=tls.crt={}",
                pki.join("client.crt").display()
            ))
            .arg(format!(
                "--from-file=tls.key={}",
                pki.join("client.key").display()
            )),
    )?;
    run_with_input(c.kubectl().args(["apply", "-f", "-"]), &secret)?;
    run(c
        .kubectl()
        .arg("apply")
        .arg("-k")
        .arg(root.join("deploy/kubernetes")))?;
    // The base's ConfigMap names a placeholder cluster and registry: this run's values.
    let config = capture(c.kubectl().args([
        "-n",
        "waypoint-system",
        "create",
        "configmap",
        "waypoint-config",
        "--dry-run=client",
        "-o",
        "yaml",
        &format!("--from-literal=WAYPOINT_CLUSTER={}", c.name),
        &format!("--from-literal=WAYPOINT_REGISTRY=etcd:https://{ETCD_NAME}:2379"),
        &format!("--from-literal=WAYPOINT_MESH_DOMAIN={MESH_DOMAIN}"),
        "--from-literal=WAYPOINT_EAST_WEST_WAYPOINT=cross-cluster",
        "--from-literal=WAYPOINT_DATAPLANE=auto",
        "--from-literal=LOG_FORMAT=plain",
    ]))?;
    run_with_input(c.kubectl().args(["apply", "-f", "-"]), &config)?;
    run(c.kubectl().args([
        "-n",
        "waypoint-system",
        "rollout",
        "restart",
        "daemonset/waypoint",
    ]))?;
    run(c.kubectl().args([
        "-n",
        "waypoint-system",
        "rollout",
        "status",
        "daemonset/waypoint",
        "--timeout=300s",
    ]))
}

/// `curl` on a kind node (its image has curl; the waypoint image has no shell).
fn node_get(node: &str, url: &str) -> anyhow::Result<String> {
    capture(Command::new("docker").args(["exec", node, "curl", "-fsS", "--max-time", "5", url]))
}

fn opened(metrics: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("waypoint_connections_opened_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

fn verify(root: &Path, pki: &Path, a: &Cluster, b: &Cluster) -> anyhow::Result<()> {
    run(b
        .kubectl()
        .arg("apply")
        .arg("-f")
        .arg(root.join("deploy/kind/echo.yaml")))?;
    let secret = capture(
        b.kubectl()
            .args([
                "-n",
                NAMESPACE,
                "create",
                "secret",
                "tls",
                "echo-tls",
                "--dry-run=client",
                "-o",
                "yaml",
            ])
            .arg(format!("--cert={}", pki.join("echo.crt").display()))
            .arg(format!("--key={}", pki.join("echo.key").display())),
    )?;
    run_with_input(b.kubectl().args(["apply", "-f", "-"]), &secret)?;
    run(b.kubectl().args([
        "-n",
        NAMESPACE,
        "rollout",
        "status",
        "deployment/echo",
        "--timeout=300s",
    ]))?;
    let b_node = capture(b.kubectl().args([
        "-n",
        NAMESPACE,
        "get",
        "pods",
        "-l",
        "app=echo",
        "-o",
        "jsonpath={.items[0].spec.nodeName}",
    ]))?;
    let b_ip = b.node_ip(&b_node)?;
    let a_node = a
        .nodes()?
        .into_iter()
        .next()
        .context("cluster A has no node")?;
    let a_ip = a.node_ip(&a_node)?;

    // What a source in A dials for the service, from A's waypoint (which mirrors the
    // shared registry): B's node IP with the structured SNI.
    let resolve = format!(
        "http://{a_ip}:15021/v1/resolve?service={SERVICE}.{NAMESPACE}:{PORT}&mode=cross-cluster"
    );
    let (address, sni) = poll(
        "cluster B's echo endpoint in cluster A's view",
        Duration::from_secs(180),
        || {
            let view: serde_json::Value = serde_json::from_str(&node_get(&a_node, &resolve)?)?;
            let target = view["endpoints"].as_array().and_then(|eps| {
                eps.iter().find(|e| {
                    e["waypoint"] == true && e["cluster"].as_str() == Some(b.name.as_str())
                })
            });
            Ok(target.and_then(|t| {
                Some((
                    t["address"].as_str()?.to_owned(),
                    t["sni"].as_str()?.to_owned(),
                ))
            }))
        },
    )?;
    let expected_sni = format!("{PORT}.{SERVICE}.{NAMESPACE}.{MESH_DOMAIN}");
    if sni != expected_sni || !address.starts_with(&format!("{b_ip}:")) {
        bail!("cluster A resolves {address} with SNI {sni}; expected {b_ip}:15443 with {expected_sni}");
    }
    let metrics_url = format!("http://{b_ip}:15021/metrics");
    let before = opened(&node_get(&b_node, &metrics_url)?);

    // The client: a pod of cluster A (pod IPs of B are unroutable from it, and collide
    // with A's), dialing B's node waypoint with the structured SNI.
    let (host, port) = address.rsplit_once(':').context("address without a port")?;
    let body = capture(client_pod(a).args([
        "--",
        "curl",
        "-sS",
        "-k",
        "--max-time",
        "10",
        "--resolve",
        &format!("{sni}:{port}:{host}"),
        &format!("https://{sni}:{port}/"),
    ]))?;
    if !body.contains(&format!("via {expected_sni}")) {
        bail!("unexpected answer from cluster B through the waypoint: {body:?}");
    }
    let after = opened(&node_get(&b_node, &metrics_url)?);
    if after < before + 1.0 {
        bail!("the answer came, but waypoint_connections_opened_total on {b_node} went from {before} to {after}");
    }
    eprintln!(
        "e2e-kind: OK: a pod of {} reached {SERVICE}.{NAMESPACE} in {} through {b_node}'s waypoint \
         ({address}, SNI {sni}); waypoint_connections_opened_total {before} -> {after}",
        a.name, b.name
    );
    Ok(())
}

/// `kubectl run` of a one-shot client pod in cluster `a`.
fn client_pod(a: &Cluster) -> Command {
    let mut c = a.kubectl();
    c.args([
        "run",
        "e2e-client",
        "--rm",
        "-i",
        "--restart=Never",
        "--quiet",
        &format!("--image={CLIENT_IMAGE}"),
        "--command",
    ]);
    c
}
