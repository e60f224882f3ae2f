//! The running world: the topology built, a real etcd on the underlay, every pod's app,
//! a real `waypoint` daemon on every node; handles to act on it (clients, abuse, kills,
//! link cuts) and to observe it (metrics, views, logs). Dropping it tears everything
//! down, also when a test panics.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _};

use crate::{
    admin::{self, Metrics, View},
    client::{AbuseKind, AbuseReport, Report},
    netns,
    pki::Pki,
    process::Proc,
    topology::{self, Layout, Node, Pod, ETCD_IP, NAMESPACE, SERVICE_PORT, UNDERLAY},
};

/// How to run the world.
#[derive(Clone, Debug)]
pub struct Options {
    /// `--dataplane` of every daemon.
    pub dataplane: String,
    /// The `waypoint` binary.
    pub waypoint_bin: PathBuf,
    /// The `waypoint-e2e` binary (pod apps and clients).
    pub e2e_bin: PathBuf,
    /// Logs, PKI, endpoint files.
    pub run_dir: PathBuf,
    /// `--registry-lease-ttl`.
    pub lease_ttl: Duration,
    /// `--hello-timeout`.
    pub hello_timeout: Duration,
    /// `--drain-timeout`.
    pub drain_timeout: Duration,
    /// More arguments for every daemon (e.g. `--rewrite-splice`).
    pub daemon_extra: Vec<String>,
    /// IPv6 node IPs and pods ([`Layout::standard_v6`]) instead of IPv4.
    pub ipv6: bool,
}

impl Options {
    /// Defaults sized for a test run: short lease, hello and drain deadlines.
    pub fn new(dataplane: &str, waypoint_bin: PathBuf, e2e_bin: PathBuf) -> Options {
        Options {
            dataplane: dataplane.to_owned(),
            waypoint_bin,
            e2e_bin,
            run_dir: std::env::temp_dir().join("waypoint-e2e"),
            lease_ttl: Duration::from_secs(4),
            hello_timeout: Duration::from_secs(2),
            drain_timeout: Duration::from_secs(5),
            daemon_extra: Vec::new(),
            ipv6: false,
        }
    }
}

/// The workspace root (this crate is `tests/e2e`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .map(Path::to_owned)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The `waypoint` binary built with the same profile as `exe` (both land in
/// `target/<profile>/`; cargo offers no cross-crate `CARGO_BIN_EXE_`).
pub fn waypoint_next_to(exe: &Path) -> anyhow::Result<PathBuf> {
    let mut dir = exe.parent().context("the binary has no directory")?;
    // Test binaries live in target/<profile>/deps.
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir = dir.parent().context("deps has no parent")?;
    }
    Ok(dir.join("waypoint"))
}

/// Builds the `waypoint` binary for the profile of `target/<profile>/` that `bin` is in,
/// so that a test run never exercises a stale daemon. A no-op when it is up to date.
pub fn build_waypoint(bin: &Path) -> anyhow::Result<()> {
    let profile = bin
        .parent()
        .and_then(Path::file_name)
        .and_then(|n| n.to_str())
        .context("cannot tell the profile of the waypoint binary")?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut cmd = std::process::Command::new(cargo);
    cmd.current_dir(workspace_root())
        .args(["build", "-p", "waypoint-user", "--bin", "waypoint"]);
    match profile {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    let status = cmd.status().context("running cargo build for waypoint")?;
    if !status.success() {
        bail!("building the waypoint binary failed: {status}");
    }
    Ok(())
}

/// Fails unless running as root (network namespaces, eBPF).
pub fn require_root() -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("the two-cluster harness needs root (network namespaces, eBPF): run it as root or with sudo");
    }
    Ok(())
}

/// The running world.
pub struct World {
    /// Nodes and pods.
    pub layout: Layout,
    /// How it runs.
    pub opts: Options,
    /// The PKI.
    pub pki: Pki,
    etcd: Option<Proc>,
    pods: Vec<Proc>,
    daemons: BTreeMap<String, Proc>,
    seq: u32,
    keep: bool,
}

impl World {
    /// Removes leftovers of an earlier run, builds everything and waits until every
    /// daemon is ready and sees both clusters.
    pub fn up(opts: Options) -> anyhow::Result<World> {
        require_root()?;
        for bin in [&opts.waypoint_bin, &opts.e2e_bin] {
            if !bin.is_file() {
                bail!(
                    "{} not found: build it first (cargo build --release)",
                    bin.display()
                );
            }
        }
        topology::teardown().context("removing an earlier run's namespaces")?;
        mount_pin_fs().context("mounting the daemons' bpffs")?;
        let _ = std::fs::remove_dir_all(&opts.run_dir);
        std::fs::create_dir_all(opts.run_dir.join("logs"))
            .with_context(|| format!("creating {}", opts.run_dir.display()))?;
        let layout = if opts.ipv6 {
            Layout::standard_v6()
        } else {
            Layout::standard()
        };
        let mut sas: Vec<&str> = layout
            .pods
            .iter()
            .map(|p| p.service_account.as_str())
            .collect();
        sas.sort_unstable();
        sas.dedup();
        let ids: Vec<(&str, &str)> = sas.iter().map(|sa| (NAMESPACE, *sa)).collect();
        let pki = Pki::generate(&opts.run_dir.join("pki"), &ids)?;
        let mut world = World {
            layout: layout.clone(),
            opts,
            pki,
            etcd: None,
            pods: Vec::new(),
            daemons: BTreeMap::new(),
            seq: 0,
            keep: false,
        };
        // From here on, a failure drops `world`, which tears down what was built.
        layout.build().context("building the topology")?;
        world.start_etcd()?;
        // A pod without a service (the source) runs no app.
        for p in layout.pods.iter().filter(|p| p.service.is_some()) {
            world.start_pod(p)?;
        }
        for n in &layout.nodes {
            world.write_local_endpoints(n)?;
            world.start_daemon(&n.name)?;
        }
        for p in &world.pods {
            wait_for(Duration::from_secs(10), || p.log().contains("listening"))
                .with_context(|| format!("pod {} did not start: {}", p.name(), p.log_tail(5)))?;
        }
        for n in &layout.nodes {
            world.wait_ready(&n.name, Duration::from_secs(20))?;
        }
        world.wait_converged(Duration::from_secs(10))?;
        Ok(world)
    }

    fn logs(&self) -> PathBuf {
        self.opts.run_dir.join("logs")
    }

    fn next_log(&mut self, stem: &str) -> PathBuf {
        self.seq += 1;
        self.logs().join(format!("{stem}.{:03}.log", self.seq))
    }

    /// The etcd URL every node uses.
    pub fn etcd_url() -> String {
        format!("http://{ETCD_IP}:2379")
    }

    fn start_etcd(&mut self) -> anyhow::Result<()> {
        // tmpfs: etcd fsyncs every write, which is slow on a busy disk and not the point.
        let data = Path::new("/dev/shm").join("waypoint-e2e-etcd");
        let _ = std::fs::remove_dir_all(&data);
        let url = World::etcd_url();
        let peer = "http://127.0.0.1:2380".to_owned();
        let args: Vec<String> = [
            "--name",
            "wp",
            "--data-dir",
            &data.display().to_string(),
            "--listen-client-urls",
            &url,
            "--advertise-client-urls",
            &url,
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
            "--initial-cluster",
            &format!("wp={peer}"),
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let log = self.logs().join("etcd.log");
        self.etcd = Some(Proc::spawn(
            "etcd",
            UNDERLAY,
            Path::new("/usr/bin/etcd"),
            &args,
            &[],
            &log,
            None,
        )?);
        let health = SocketAddr::from((ETCD_IP, 2379));
        wait_for(Duration::from_secs(20), || {
            netns::in_netns(UNDERLAY, move || admin::get_ok(health, "/health"))
                .ok()
                .and_then(Result::ok)
                .is_some_and(|b| b.contains("true"))
        })
        .with_context(|| {
            format!(
                "etcd did not become healthy (Debian etcd-server at /usr/bin/etcd; deploy/setup.sh): {}",
                self.etcd.as_ref().map(|p| p.log_tail(5)).unwrap_or_default()
            )
        })
    }

    fn start_pod(&mut self, p: &Pod) -> anyhow::Result<()> {
        let files = self.pki.files(&p.service_account);
        let path = |p: &Path| p.display().to_string();
        let args = vec![
            "serve".to_owned(),
            "--listen".to_owned(),
            p.inbound().to_string(),
            "--pod".to_owned(),
            p.name.clone(),
            "--ca".to_owned(),
            path(&files.ca),
            "--cert".to_owned(),
            path(&files.cert),
            "--key".to_owned(),
            path(&files.key),
        ];
        let log = self.logs().join(format!("pod-{}.log", p.name));
        let proc = Proc::spawn(
            &format!("pod {}", p.name),
            &p.netns(),
            &self.opts.e2e_bin,
            &args,
            &[],
            &log,
            None,
        )?;
        self.pods.push(proc);
        Ok(())
    }

    fn local_endpoints(&self, n: &Node) -> PathBuf {
        self.opts.run_dir.join(format!("endpoints-{}.json", n.name))
    }

    /// This node's pods, as `--local-endpoints` reads them (the daemon adds cluster,
    /// node name and node IP from its flags).
    fn write_local_endpoints(&self, n: &Node) -> anyhow::Result<()> {
        let endpoints: Vec<serde_json::Value> = self
            .layout
            .pods_on(&n.name)
            .filter_map(|p| {
                let svc = p.service.as_ref()?;
                Some(serde_json::json!({
                    "service": svc,
                    "namespace": NAMESPACE,
                    "pod_ip": p.ip.to_string(),
                    "pod_name": p.name,
                    "service_account": p.service_account,
                    "ports": [SERVICE_PORT],
                    "exported": p.exported,
                }))
            })
            .collect();
        let path = self.local_endpoints(n);
        std::fs::write(
            &path,
            serde_json::to_vec_pretty(&serde_json::json!({ "endpoints": endpoints }))?,
        )
        .with_context(|| format!("writing {}", path.display()))
    }

    /// The node called `name`.
    pub fn node(&self, name: &str) -> anyhow::Result<Node> {
        self.layout
            .node(name)
            .cloned()
            .with_context(|| format!("no node {name}"))
    }

    /// The pod called `name`.
    pub fn pod(&self, name: &str) -> anyhow::Result<Pod> {
        self.layout
            .pod(name)
            .cloned()
            .with_context(|| format!("no pod {name}"))
    }

    /// The daemon's command line on node `n`.
    pub fn daemon_args(&self, n: &Node) -> Vec<String> {
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        vec![
            "run".into(),
            "--registry".into(),
            format!("etcd:{}", World::etcd_url()),
            "--cluster".into(),
            n.cluster.clone(),
            "--node-name".into(),
            n.name.clone(),
            "--node-ip".into(),
            n.ip.to_string(),
            "--tunnel-addr".into(),
            n.tunnel_addr().to_string(),
            "--admin-addr".into(),
            n.admin_addr().to_string(),
            "--local-endpoints".into(),
            self.local_endpoints(n).display().to_string(),
            "--east-west-waypoint".into(),
            "cross-cluster".into(),
            "--dataplane".into(),
            self.opts.dataplane.clone(),
            "--registry-lease-ttl".into(),
            ms(self.opts.lease_ttl),
            "--hello-timeout".into(),
            ms(self.opts.hello_timeout),
            "--drain-timeout".into(),
            ms(self.opts.drain_timeout),
            // The pods' links carry 1450-byte packets, the underlay 1500 (see topology).
            "--tunnel-mss".into(),
            "auto".into(),
            // Removed with the world: the rewrite programs a killed daemon leaves.
            "--pin-dir".into(),
            PIN_DIR.into(),
        ]
        .into_iter()
        .chain(self.opts.daemon_extra.iter().cloned())
        .collect()
    }

    /// Starts the daemon of node `name` (replacing, and so killing, a previous handle).
    pub fn start_daemon(&mut self, name: &str) -> anyhow::Result<()> {
        let n = self.node(name)?;
        let args = self.daemon_args(&n);
        let log = self.next_log(&format!("waypoint-{name}"));
        let proc = Proc::spawn(
            &format!("waypoint {name}"),
            &n.netns(),
            &self.opts.waypoint_bin,
            &args,
            &[("RUST_LOG", "info"), ("LOG_FORMAT", "plain")],
            &log,
            None,
        )?;
        self.daemons.insert(name.to_owned(), proc);
        Ok(())
    }

    /// Takes the handle of node `name`'s daemon (to signal it, wait for it).
    pub fn take_daemon(&mut self, name: &str) -> anyhow::Result<Proc> {
        self.daemons
            .remove(name)
            .with_context(|| format!("no daemon on {name}"))
    }

    /// Waits until node `name`'s daemon answers /readyz with 200.
    pub fn wait_ready(&mut self, name: &str, timeout: Duration) -> anyhow::Result<()> {
        let addr = self.node(name)?.admin_addr();
        let deadline = Instant::now() + timeout;
        loop {
            let ready = netns::in_netns(UNDERLAY, move || {
                admin::get(addr, "/readyz", Duration::from_millis(500))
            })?;
            if matches!(ready, Ok((200, _))) {
                return Ok(());
            }
            let proc = self
                .daemons
                .get_mut(name)
                .with_context(|| format!("no daemon on {name}"))?;
            if !proc.running() || Instant::now() >= deadline {
                bail!(
                    "waypoint on {name} not ready ({}): {}",
                    if proc.running() {
                        "timed out"
                    } else {
                        "exited"
                    },
                    proc.log_tail(10)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until every node's view holds every pod of both services.
    fn wait_converged(&self, timeout: Duration) -> anyhow::Result<()> {
        let svc_b = format!("svc-b.{NAMESPACE}:{SERVICE_PORT}");
        let svc_a = format!("svc-a.{NAMESPACE}:{SERVICE_PORT}");
        let want_b = self
            .layout
            .pods
            .iter()
            .filter(|p| p.service.as_deref() == Some("svc-b"))
            .count();
        let want_a = self
            .layout
            .pods
            .iter()
            .filter(|p| p.service.as_deref() == Some("svc-a"))
            .count();
        let mut last = String::new();
        let ok = wait_for(timeout, || {
            self.layout.nodes.iter().all(|n| {
                let b = self.view(&n.name, &svc_b).map(|v| v.endpoints.len());
                let a = self.view(&n.name, &svc_a).map(|v| v.endpoints.len());
                // Cluster b sees svc-a not at all (not exported): only its own pods count.
                let want_a_here = if n.cluster == "a" { want_a } else { 0 };
                match (b, a) {
                    (Ok(b), Ok(a)) if b == want_b && a == want_a_here => true,
                    other => {
                        last = format!("{}: {other:?}", n.name);
                        false
                    }
                }
            })
        });
        ok.with_context(|| format!("the registry did not converge: {last}"))
    }

    /// Node `name`'s admin metrics.
    pub fn metrics(&self, name: &str) -> anyhow::Result<Metrics> {
        let addr = self.node(name)?.admin_addr();
        let text = netns::in_netns(UNDERLAY, move || admin::get_ok(addr, "/metrics"))??;
        Ok(Metrics::parse(&text))
    }

    /// Every node's metrics (nodes that do not answer are left out).
    pub fn all_metrics(&self) -> BTreeMap<String, Metrics> {
        self.layout
            .nodes
            .iter()
            .filter_map(|n| Some((n.name.clone(), self.metrics(&n.name).ok()?)))
            .collect()
    }

    /// The split-horizon view of `service` from node `name`.
    pub fn view(&self, name: &str, service: &str) -> anyhow::Result<View> {
        let addr = self.node(name)?.admin_addr();
        let service = service.to_owned();
        Ok(netns::in_netns(UNDERLAY, move || {
            admin::resolve(addr, &service)
        })??)
    }

    fn identity_args(&self, sa: &str) -> Vec<String> {
        let f = self.pki.files(sa);
        vec![
            "--ca".into(),
            f.ca.display().to_string(),
            "--cert".into(),
            f.cert.display().to_string(),
            "--key".into(),
            f.key.display().to_string(),
        ]
    }

    /// Starts a client in pod `pod` (its node's daemon answers its resolve).
    pub fn spawn_client(&mut self, pod: &str, t: &Transfer) -> anyhow::Result<Proc> {
        let p = self.pod(pod)?;
        let admin = self.node(&p.node)?.admin_addr();
        let mut args = vec![
            "client".to_owned(),
            "--admin".into(),
            admin.to_string(),
            "--service".into(),
            t.service.clone(),
            "--bytes".into(),
            t.bytes.to_string(),
            "--timeout".into(),
            t.timeout.as_secs().max(1).to_string(),
        ];
        if let Some(via) = &t.via {
            args.extend(["--via".to_owned(), via.clone()]);
        }
        if let Some(rate) = t.rate {
            args.extend(["--rate".to_owned(), rate.to_string()]);
        }
        if let Some(messages) = t.messages {
            args.extend(["--messages".to_owned(), messages.to_string()]);
        }
        args.extend(self.identity_args(&p.service_account));
        let log = self.next_log(&format!("client-{pod}"));
        let out = log.with_extension("json");
        Proc::spawn(
            &format!("client in {pod}"),
            &p.netns(),
            &self.opts.e2e_bin,
            &args,
            &[],
            &log,
            Some(&out),
        )
    }

    /// Waits for a client started with [`World::spawn_client`] and returns its report.
    pub fn finish_client(mut proc: Proc, timeout: Duration) -> anyhow::Result<Report> {
        if proc.wait_timeout(timeout)?.is_none() {
            bail!("{} did not finish within {timeout:?}", proc.name());
        }
        let out = proc.stdout();
        serde_json::from_str(out.trim()).with_context(|| {
            format!(
                "{}: no report ({out:?}); log: {}",
                proc.name(),
                proc.log_tail(5)
            )
        })
    }

    /// Runs one client to the end.
    pub fn client(&mut self, pod: &str, t: &Transfer) -> anyhow::Result<Report> {
        let proc = self.spawn_client(pod, t)?;
        World::finish_client(proc, Duration::from_secs(150))
    }

    /// Starts one abusive connection from pod `pod` to `target`.
    pub fn spawn_abuse(
        &mut self,
        pod: &str,
        target: SocketAddr,
        kind: AbuseKind,
    ) -> anyhow::Result<Proc> {
        let p = self.pod(pod)?;
        let kind_name = serde_json::to_value(kind)?
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let mut args = vec![
            "abuse".to_owned(),
            "--target".into(),
            target.to_string(),
            "--kind".into(),
            kind_name.clone(),
        ];
        args.extend(self.identity_args(&p.service_account));
        let log = self.next_log(&format!("abuse-{kind_name}"));
        let out = log.with_extension("json");
        Proc::spawn(
            &format!("abuse {kind_name}"),
            &p.netns(),
            &self.opts.e2e_bin,
            &args,
            &[],
            &log,
            Some(&out),
        )
    }

    /// Waits for an abusive connection's report.
    pub fn finish_abuse(mut proc: Proc) -> anyhow::Result<AbuseReport> {
        if proc.wait_timeout(Duration::from_secs(30))?.is_none() {
            bail!("{} did not finish", proc.name());
        }
        let out = proc.stdout();
        serde_json::from_str(out.trim())
            .with_context(|| format!("{}: no report: {}", proc.name(), proc.log_tail(5)))
    }

    /// A plain TCP connect from pod `pod` to `addr`.
    pub fn dial(&self, pod: &str, addr: SocketAddr, timeout: Duration) -> anyhow::Result<()> {
        let ns = self.pod(pod)?.netns();
        netns::in_netns(&ns, move || {
            std::net::TcpStream::connect_timeout(&addr, timeout)
        })?
        .map(drop)
        .with_context(|| format!("connecting to {addr}"))
    }

    /// Cuts node `name` off the underlay (its link down on the bridge side).
    pub fn cut_link(&self, name: &str) -> anyhow::Result<()> {
        let n = self.node(name)?;
        netns::ip(&["-n", UNDERLAY, "link", "set", &n.uplink(), "down"])?;
        Ok(())
    }

    /// Impairs the path between node `peer` and node `node`, and pod `pod`'s link: on the
    /// underlay, each packet to or from `node` is dropped with probability `loss` (in
    /// thousandths) and each packet between `peer` and `node` also arrives twice with
    /// probability `dup`; in `pod`'s namespace, each packet in or out is dropped with
    /// probability `loss`. nftables (`numgen random`), which every kernel here has (netem
    /// is not built into every kernel). [`World::unimpair`] removes it all.
    pub fn impair(
        &self,
        node: &str,
        peer: &str,
        pod: &str,
        loss: u32,
        dup: u32,
    ) -> anyhow::Result<()> {
        let (n, p) = (self.node(node)?, self.node(peer)?);
        let (link, peer_link) = (n.uplink(), p.uplink());
        let underlay = format!(
            "table bridge wp_impair {{
  chain forward {{
    type filter hook forward priority 0; policy accept;
    iifname \"{link}\" numgen random mod 1000 < {loss} counter drop
    oifname \"{link}\" numgen random mod 1000 < {loss} counter drop
  }}
}}
table netdev wp_dup {{
  chain to_node {{
    type filter hook ingress device \"{peer_link}\" priority 0; policy accept;
    {family} daddr {node_ip} numgen random mod 1000 < {dup} counter dup to \"{link}\"
  }}
  chain to_peer {{
    type filter hook ingress device \"{link}\" priority 0; policy accept;
    {family} daddr {peer_ip} numgen random mod 1000 < {dup} counter dup to \"{peer_link}\"
  }}
}}
",
            node_ip = n.ip,
            peer_ip = p.ip,
            family = if n.ip.is_ipv6() { "ip6" } else { "ip" },
        );
        nft(UNDERLAY, &underlay)?;
        let pod_side = format!(
            "table inet wp_impair {{
  chain input {{
    type filter hook input priority 0; policy accept;
    numgen random mod 1000 < {loss} counter drop
  }}
  chain output {{
    type filter hook output priority 0; policy accept;
    numgen random mod 1000 < {loss} counter drop
  }}
}}
"
        );
        nft(&self.pod(pod)?.netns(), &pod_side)
    }

    /// What [`World::impair`] dropped and duplicated so far: the nft counters'
    /// packets, summed per kind (dropped on the underlay, duplicated, dropped at the
    /// pod).
    pub fn impaired(&self, pod: &str) -> anyhow::Result<(u64, u64, u64)> {
        let sum = |ns: &str, table: &str| -> anyhow::Result<u64> {
            let out = netns::exec(ns, "nft", &["list", "table", table])?;
            Ok(out
                .split("counter packets ")
                .skip(1)
                .filter_map(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
                .sum())
        };
        let pod_ns = self.pod(pod)?.netns();
        Ok((
            sum(UNDERLAY, "bridge wp_impair")?,
            sum(UNDERLAY, "netdev wp_dup")?,
            sum(&pod_ns, "inet wp_impair")?,
        ))
    }

    /// Removes what [`World::impair`] added.
    pub fn unimpair(&self, pod: &str) -> anyhow::Result<()> {
        netns::exec(UNDERLAY, "nft", &["delete", "table", "bridge", "wp_impair"])?;
        netns::exec(UNDERLAY, "nft", &["delete", "table", "netdev", "wp_dup"])?;
        netns::exec(
            &self.pod(pod)?.netns(),
            "nft",
            &["delete", "table", "inet", "wp_impair"],
        )?;
        Ok(())
    }

    /// Drops every packet to and from node `name` on the underlay (`dark`), or stops
    /// doing so: a link that goes dark and comes back, its carrier up all along.
    pub fn darken(&self, name: &str, dark: bool) -> anyhow::Result<()> {
        if !dark {
            netns::exec(UNDERLAY, "nft", &["delete", "table", "bridge", "wp_dark"])?;
            return Ok(());
        }
        let link = self.node(name)?.uplink();
        nft(
            UNDERLAY,
            &format!(
                "table bridge wp_dark {{
  chain forward {{
    type filter hook forward priority -10; policy accept;
    iifname \"{link}\" drop
    oifname \"{link}\" drop
  }}
}}
"
            ),
        )
    }

    /// The last lines of every daemon's log, for a failure message.
    pub fn diagnostics(&self) -> String {
        let mut out = String::new();
        for (name, p) in &self.daemons {
            out.push_str(&format!("--- waypoint {name}\n{}\n", p.log_tail(15)));
        }
        out
    }

    /// Leaves everything running when dropped (the demo's `--keep`).
    pub fn keep(mut self) {
        self.keep = true;
        for p in std::mem::take(&mut self.pods) {
            p.detach();
        }
        for (_, p) in std::mem::take(&mut self.daemons) {
            p.detach();
        }
        if let Some(e) = self.etcd.take() {
            e.detach();
        }
    }
}

/// Where the world's daemons pin their rewrite programs (`--pin-dir`): a bpffs of the
/// harness's own, since `ip netns exec` gives each daemon a /sys without the host's.
const PIN_FS: &str = "/run/waypoint-e2e-bpffs";
const PIN_DIR: &str = "/run/waypoint-e2e-bpffs/waypoint";

/// Mounts bpffs at [`PIN_FS`], unless one is there: a daemon started through `ip netns
/// exec` sees it (that remounts /sys only).
fn mount_pin_fs() -> anyhow::Result<()> {
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    if mounts.lines().any(|l| l.split(' ').nth(1) == Some(PIN_FS)) {
        return Ok(());
    }
    std::fs::create_dir_all(PIN_FS)?;
    let status = std::process::Command::new("mount")
        .args(["-t", "bpf", "bpf", PIN_FS])
        .status()?;
    if !status.success() {
        bail!("mount -t bpf bpf {PIN_FS}: {status}");
    }
    Ok(())
}

impl Drop for World {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        // Daemons first (they revoke leases on SIGTERM, but a kill is enough here: the
        // whole registry goes with etcd).
        self.daemons.clear();
        self.pods.clear();
        self.etcd = None;
        if let Err(e) = topology::teardown() {
            eprintln!("teardown failed: {e} (run `waypoint-e2e cleanup`)");
        }
        // Unpinned, the rewrite programs the killed daemons left go.
        let _ = std::fs::remove_dir_all(PIN_DIR);
        let _ = std::fs::remove_dir_all(Path::new("/dev/shm").join("waypoint-e2e-etcd"));
    }
}

/// Loads an nftables ruleset in namespace `ns`.
fn nft(ns: &str, ruleset: &str) -> anyhow::Result<()> {
    netns::run_with_input(
        "ip",
        &["netns", "exec", ns, "nft", "-f", "-"],
        Some(ruleset),
    )
    .with_context(|| format!("nft in {ns}:\n{ruleset}"))?;
    Ok(())
}

/// One client exchange.
#[derive(Clone, Debug)]
pub struct Transfer {
    /// `<svc>.<ns>:<port>`.
    pub service: String,
    /// The node whose endpoint to dial (default: the view's first).
    pub via: Option<String>,
    /// Bytes each way.
    pub bytes: u64,
    /// Pace, in bytes per second.
    pub rate: Option<u64>,
    /// Ping-pong this many messages instead of a bulk transfer.
    pub messages: Option<u32>,
    /// The client gives up after this long.
    pub timeout: Duration,
}

impl Transfer {
    /// `bytes` each way to `service`, as fast as possible, to the view's first endpoint.
    pub fn new(service: &str, bytes: u64) -> Transfer {
        Transfer {
            service: service.to_owned(),
            via: None,
            bytes,
            rate: None,
            messages: None,
            timeout: Duration::from_secs(120),
        }
    }

    /// Through node `node`'s endpoint.
    pub fn via(mut self, node: &str) -> Transfer {
        self.via = Some(node.to_owned());
        self
    }

    /// Paced at `rate` bytes per second.
    pub fn rate(mut self, rate: u64) -> Transfer {
        self.rate = Some(rate);
        self
    }

    /// `messages` round trips of 1 B to 16 KiB instead of a bulk transfer.
    pub fn ping_pong(mut self, messages: u32) -> Transfer {
        self.messages = Some(messages);
        self
    }

    /// Giving up after `timeout`.
    pub fn timeout(mut self, timeout: Duration) -> Transfer {
        self.timeout = timeout;
        self
    }
}

/// Polls `f` every 50 ms until it holds or `timeout` passes.
pub fn wait_for(timeout: Duration, mut f: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
