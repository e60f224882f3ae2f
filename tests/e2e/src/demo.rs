//! The demo a new user runs first: builds the two clusters, prints them, shows the split
//! horizon from cluster a and one request crossing into cluster b (both SPIFFE IDs, the
//! path, the dataplane, the bytes), then cleans up, or with `--keep` leaves it running
//! and says how to explore it.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use anyhow::Context as _;

use crate::{
    admin::{Metrics, View},
    topology::{Layout, ETCD_IP, NAMESPACE, POD_CIDR, SERVICE_PORT, UNDERLAY},
    world::{self, wait_for, Options, Transfer, World},
};

/// `waypoint-e2e demo`.
#[derive(Clone, Debug, clap::Args)]
pub struct DemoArgs {
    /// Leave everything running, to explore with `waypoint resolve` and the metrics.
    #[arg(long)]
    pub keep: bool,
    /// The waypoints' dataplane (`auto`: the daemon's default).
    #[arg(long, default_value = "auto", value_parser = ["ebpf", "splice", "copy", "auto"])]
    pub dataplane: String,
    /// The `waypoint` binary (default: next to this one).
    #[arg(long)]
    pub waypoint_bin: Option<PathBuf>,
    /// Bytes the request sends (and gets echoed), in MiB.
    #[arg(long, default_value_t = 16)]
    pub mib: u64,
}

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / f64::from(1u32 << 20))
}

fn print_topology(layout: &Layout, dataplane: &str) {
    println!(
        "  underlay   192.168.77.0/24, bridge br0 in netns {UNDERLAY}; etcd http://{ETCD_IP}:2379"
    );
    for cluster in ["a", "b"] {
        let note = if cluster == "b" {
            " (the same: pod IPs never route between the clusters)"
        } else {
            ""
        };
        println!("  cluster {cluster}  pod CIDR {POD_CIDR}{note}");
        for n in layout.cluster(cluster) {
            let pods: Vec<String> = layout
                .pods_on(&n.name)
                .map(|p| {
                    let tag = match (&p.service, p.exported) {
                        (None, _) => " (source)",
                        (Some(_), false) if cluster == "b" => " (not exported)",
                        _ => "",
                    };
                    format!("{} {}{tag}", p.name, p.ip)
                })
                .collect();
            println!("    node {}  {}  pods: {}", n.name, n.ip, pods.join(", "));
        }
    }
    println!("  every node runs `waypoint run --dataplane {dataplane} --east-west-waypoint cross-cluster`");
    println!(
        "  on <node_ip>:15443 (admin :15021); waypoints hold no TLS keys, only pods have SVIDs"
    );
}

fn print_view(view: &View) {
    println!("    {:<21} {:<28} {:<12} POD", "DIAL", "SNI", "VIA");
    for t in &view.endpoints {
        let via = if t.waypoint {
            format!("waypoint {}", t.node)
        } else {
            "direct".to_owned()
        };
        println!(
            "    {:<21} {:<28} {:<12} {} ({})",
            t.address.to_string(),
            t.sni,
            via,
            t.pod,
            t.pod_ip
        );
    }
}

/// Runs the demo.
pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let waypoint = match args.waypoint_bin {
        Some(p) => p,
        None => world::waypoint_next_to(&exe)?,
    };
    let opts = Options::new(&args.dataplane, waypoint.clone(), exe.clone());
    println!(
        "waypoint demo: two clusters on network namespaces, dataplane {}\n",
        args.dataplane
    );
    let mut w = World::up(opts)?;
    print_topology(&w.layout, &args.dataplane);

    let svc_b = format!("svc-b.{NAMESPACE}:{SERVICE_PORT}");
    let svc_a = format!("svc-a.{NAMESPACE}:{SERVICE_PORT}");
    let a1 = w.node("a1")?;
    println!(
        "\nSplit horizon from cluster a (GET http://{}/v1/resolve on node a1):",
        a1.admin_addr()
    );
    println!("  {svc_b}: another cluster, through its nodes' waypoints");
    print_view(&w.view("a1", &svc_b)?);
    println!("  {svc_a}: own cluster, direct to the pods");
    print_view(&w.view("a1", &svc_a)?);

    let before: BTreeMap<String, Metrics> = w.all_metrics();
    let bytes = args.mib << 20;
    let r = w.client("client-a1", &Transfer::new(&svc_b, bytes))?;
    let client = w.pod("client-a1")?;
    println!(
        "\nOne request: client-a1 → {svc_b}, {} each way, echoed back",
        mib(bytes as f64)
    );
    if let Some(e) = &r.error {
        anyhow::bail!("the request failed: {e}\n{}", w.diagnostics());
    }
    let (Some(t), Some(g)) = (&r.target, &r.greeting) else {
        anyhow::bail!("the client reported no target or greeting: {r:?}");
    };
    // Bytes are counted when the waypoint closes the connection.
    let mut after = w.all_metrics();
    let _ = wait_for(Duration::from_secs(3), || {
        after = w.all_metrics();
        after
            .get(&t.node)
            .zip(before.get(&t.node))
            .is_some_and(|(a, b)| a.bytes() > b.bytes())
    });
    let dataplane = after
        .get(&t.node)
        .and_then(|m| {
            m.0.keys()
                .find_map(|k| k.strip_prefix("waypoint_dataplane{dataplane=\""))
                .and_then(|k| k.split('"').next())
                .map(str::to_owned)
        })
        .unwrap_or_else(|| args.dataplane.clone());
    let pod = w.pod(&g.pod)?;
    println!(
        "  path     client-a1 {} → node a1 (masquerade) → waypoint {} {} [{dataplane}] → {} {}",
        client.ip,
        t.node,
        t.address,
        pod.name,
        pod.inbound()
    );
    println!(
        "  sni      {} (read from the cleartext ClientHello, never decrypted)",
        r.sni_sent.as_deref().unwrap_or("-")
    );
    println!("  client   {}  (as the {} pod saw it)", g.peer_id, pod.name);
    println!(
        "  server   {}  (verified by the client: mTLS end to end)",
        r.server_id
    );
    println!(
        "  bytes    {} sent, {} echoed, SHA-256 {}, {:.2} s",
        mib(r.sent as f64),
        mib(r.received as f64),
        if r.sent_sha256 == r.received_sha256 {
            "match"
        } else {
            "MISMATCH"
        },
        r.elapsed_ms as f64 / 1000.0
    );
    let mut quiet = Vec::new();
    let mut moved = Vec::new();
    for (node, m) in &after {
        let Some(b) = before.get(node) else { continue };
        if m.router_moved(b) {
            moved.push(format!(
                "waypoint {node}: +{} connection, +{} forwarded (TLS records)",
                m.opened() - b.opened(),
                mib(m.bytes() - b.bytes())
            ));
        } else {
            quiet.push(node.clone());
        }
    }
    println!(
        "  counters {}; {}: unchanged",
        moved.join("; "),
        quiet.join(", ")
    );

    if args.keep {
        let etcd = World::etcd_url();
        let logs = w.opts.run_dir.join("logs");
        let pki = w.opts.run_dir.join("pki");
        let admin = |n: &str| w.node(n).map(|n| n.admin_addr().to_string());
        println!("\nLeft running. To explore:");
        println!(
            "  ip netns exec wp-a1 {} resolve {svc_b} --registry etcd:{etcd} --cluster a --east-west-waypoint cross-cluster",
            waypoint.display()
        );
        println!(
            "  ip netns exec wp-a1 curl -s 'http://{}/v1/resolve?service={svc_b}'",
            admin("a1")?
        );
        println!(
            "  ip netns exec wp-underlay curl -s http://{}/metrics | grep ^waypoint_connections",
            admin("b1")?
        );
        println!(
            "  ip netns exec wp-client-a1 {} client --admin {} --service {svc_b} --bytes 64MiB --ca {p}/ca.pem --cert {p}/client.pem --key {p}/client.key",
            exe.display(),
            admin("a1")?,
            p = pki.display()
        );
        println!("  logs: {}", logs.display());
        println!("Clean up: {} cleanup", exe.display());
        w.keep();
    } else {
        drop(w);
        println!(
            "\nCleaned up (namespaces, links and processes removed; --keep leaves them running)."
        );
    }
    Ok(())
}
