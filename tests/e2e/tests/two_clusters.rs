//! Two clusters end to end, once per dataplane and address family: the design record's
//! verification on network namespaces, with a real etcd, real daemons and real mTLS (see
//! the crate docs).
//! Needs root, and fails (never skips) without it.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::{
    net::SocketAddr,
    panic::AssertUnwindSafe,
    path::PathBuf,
    sync::Mutex,
    thread::sleep,
    time::{Duration, Instant},
};

use nix::sys::signal::Signal;
use waypoint_e2e::{
    admin::Metrics,
    client::{AbuseKind, Report},
    netns,
    pki::spiffe_id,
    topology::{NAMESPACE, PREFIX},
    world::{self, wait_for, Options, Transfer, World},
};

/// Every run uses the same namespace names and addresses: one world at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const SVC_A: &str = "svc-a.demo:9080";
const SVC_B: &str = "svc-b.demo:9080";
const SNI_B: &str = "9080.svc-b.demo.mesh.local";
const CLIENT: &str = "client-a1";
const MIB: u64 = 1 << 20;

/// A named scenario.
type Step = (&'static str, fn(&mut World));

fn options(dataplane: &str, extra: &[&str], ipv6: bool) -> Options {
    world::require_root().expect("this test needs root; CI runs it as root");
    let e2e = PathBuf::from(env!("CARGO_BIN_EXE_waypoint-e2e"));
    let waypoint = match std::env::var_os("WAYPOINT_BIN") {
        Some(p) => PathBuf::from(p),
        None => {
            let w = world::waypoint_next_to(&e2e).unwrap();
            world::build_waypoint(&w).unwrap();
            w
        }
    };
    let mut opts = Options::new(dataplane, waypoint, e2e);
    opts.daemon_extra = extra.iter().map(|s| (*s).to_owned()).collect();
    opts.ipv6 = ipv6;
    // Per run, so that a failed run's logs survive the next run.
    opts.run_dir =
        std::env::temp_dir().join(format!("waypoint-e2e-{}", label(dataplane, extra, ipv6)));
    opts
}

fn label(dataplane: &str, extra: &[&str], ipv6: bool) -> String {
    std::iter::once(dataplane)
        .chain(extra.iter().map(|a| a.trim_start_matches('-')))
        .chain(ipv6.then_some("ipv6"))
        .collect::<Vec<_>>()
        .join("-")
}

#[test]
fn two_clusters_ebpf() {
    run("ebpf", &[], false);
}

/// The same world with the daemon's default, `auto`: every connection rewritten by the
/// TC program (the CI host's kernel carries it): the client's packets arrive on a node's
/// uplink and leave towards the pod's bridge, and back.
#[test]
fn two_clusters_auto() {
    run("auto", &[], false);
}

#[test]
fn two_clusters_splice() {
    run("splice", &[], false);
}

/// The IPv6 world (IPv6 node IPs, IPv6-only pods; see `topology`), every scenario.
#[test]
fn two_clusters_ipv6_ebpf() {
    run("ebpf", &[], true);
}

/// With `--rewrite-splice`, every IPv6 connection is refused to the rewrite
/// (`refused_not_ipv4`) and carried by the SockHash.
#[test]
fn two_clusters_ipv6_ebpf_rewrite_splice() {
    run("ebpf", &["--rewrite-splice"], true);
}

#[test]
fn two_clusters_ipv6_splice() {
    run("splice", &[], true);
}

/// Whether the world's daemons run the rewrite splice: asked for by name, or `auto`'s
/// (on a kernel with the 2023 sockmap fixes, which the e2e's host has).
fn rewrites(w: &World) -> bool {
    w.opts.dataplane == "auto" || w.opts.daemon_extra.iter().any(|a| a == "--rewrite-splice")
}

/// The `result` of `waypoint_rewrite_connections_total` that every connection through a
/// waypoint gets with the rewrite splice: the rewrite takes IPv4 connections only.
fn rewritten(w: &World) -> &'static str {
    if w.opts.ipv6 {
        r#"waypoint_rewrite_connections_total{result="refused_not_ipv4"}"#
    } else {
        r#"waypoint_rewrite_connections_total{result="rewritten"}"#
    }
}

fn run(dataplane: &str, extra: &[&str], ipv6: bool) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let opts = options(dataplane, extra, ipv6);
    let dataplane = label(dataplane, extra, ipv6);
    let dataplane = dataplane.as_str();
    let started = Instant::now();
    let mut w = World::up(opts).expect("bringing the two clusters up");
    eprintln!("[{dataplane}] world up in {:.1?}", started.elapsed());
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let steps: [Step; 7] = [
            ("1 cross-cluster through a waypoint", cross_cluster),
            ("  direct dial to a B pod IP fails", no_pod_route_across),
            ("2 intra-cluster stays direct", intra_cluster),
            ("4 abuse rejected while a transfer runs", abuse),
            ("6 lossy links", lossy_links),
            ("5 graceful restart of a B waypoint", graceful_restart),
            ("3 node death", node_death),
        ];
        for (name, step) in steps {
            let t = Instant::now();
            step(&mut w);
            eprintln!("[{dataplane}] scenario {name}: ok in {:.1?}", t.elapsed());
        }
    }));
    if let Err(panic) = outcome {
        eprintln!(
            "[{dataplane}] failed; logs in {}; daemon logs:\n{}",
            w.opts.run_dir.display(),
            w.diagnostics()
        );
        drop(w);
        std::panic::resume_unwind(panic);
    }
    drop(w);
    let left: Vec<String> = netns::list()
        .unwrap()
        .into_iter()
        .filter(|n| n.starts_with(PREFIX))
        .collect();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
    eprintln!(
        "[{dataplane}] all scenarios passed in {:.1?}",
        started.elapsed()
    );
}

fn metrics_all(w: &World) -> std::collections::BTreeMap<String, Metrics> {
    let m = w.all_metrics();
    assert_eq!(
        m.len(),
        w.layout.nodes.len(),
        "every daemon answers /metrics"
    );
    m
}

/// The cluster of pod `name`.
fn cluster_of_pod(w: &World, name: &str) -> String {
    let pod = w.pod(name).unwrap();
    w.node(&pod.node).unwrap().cluster
}

/// Checks a report of an A → svc-B exchange; returns the B node whose waypoint it went
/// through.
fn assert_cross(w: &World, r: &Report, bytes: u64) -> String {
    assert!(r.ok(), "A → svc-B failed: {r:?}");
    let t = r.target.as_ref().unwrap();
    assert!(
        t.waypoint,
        "the view says waypoint for another cluster: {t:?}"
    );
    assert_eq!(t.cluster, "b");
    let node = w.node(&t.node).unwrap();
    assert_eq!(node.cluster, "b");
    assert_eq!(
        t.address,
        node.tunnel_addr(),
        "dialed the B node's waypoint"
    );
    assert_eq!(r.sni_sent.as_deref(), Some(SNI_B));
    let g = r.greeting.as_ref().unwrap();
    assert_eq!(cluster_of_pod(w, &g.pod), "b", "landed on a B pod");
    assert!(
        g.pod.starts_with("svc-b-"),
        "landed on a svc-b pod: {}",
        g.pod
    );
    assert_eq!(
        g.peer_id,
        spiffe_id(NAMESPACE, "client"),
        "the B app sees the client's SPIFFE ID"
    );
    assert_eq!(
        g.sni.as_deref(),
        Some(SNI_B),
        "the SNI reaches the pod unchanged"
    );
    assert_eq!(
        r.server_id,
        spiffe_id(NAMESPACE, "svc-b"),
        "the client verified the B pod's SVID"
    );
    assert_eq!((r.sent, r.received), (bytes, bytes));
    assert_eq!(r.sent_sha256, r.received_sha256);
    t.node.clone()
}

/// Scenario 1: A → svc-B through a B node's waypoint, 64 MiB each way; only that
/// waypoint's counters move.
fn cross_cluster(w: &mut World) {
    let view = w.view("a1", SVC_B).unwrap();
    assert_eq!(view.endpoints.len(), 2, "{view:?}");
    for t in &view.endpoints {
        assert!(t.waypoint && t.sni == SNI_B, "{t:?}");
        assert_eq!(t.address, w.node(&t.node).unwrap().tunnel_addr());
    }
    let before = metrics_all(w);
    let r = w.client(CLIENT, &Transfer::new(SVC_B, 64 * MIB)).unwrap();
    let via = assert_cross(w, &r, 64 * MIB);
    eprintln!(
        "    64 MiB each way via waypoint {via} to {} in {} ms",
        r.greeting.as_ref().unwrap().pod,
        r.elapsed_ms
    );
    // Bytes are counted when the connection closes on the waypoint: wait for it. With
    // the rewrite splice that is after the entries' 3 s linger, and the end is read from
    // its ring within 100 ms.
    let mut after = metrics_all(w);
    wait_for(Duration::from_secs(8), || {
        after = metrics_all(w);
        after[&via].bytes() - before[&via].bytes() >= (2 * 64 * MIB) as f64
    })
    .unwrap_or_else(|_| panic!("waypoint {via} counted the bytes: {:?}", after[&via]));
    assert_eq!(after[&via].opened(), before[&via].opened() + 1.0);
    if rewrites(w) {
        let result = rewritten(w);
        assert_eq!(
            after[&via].get(result),
            before[&via].get(result) + 1.0,
            "{result}: {:?}",
            after[&via]
        );
        // lo, eth0, cni0 and a veth per pod.
        let interfaces = after[&via].get("waypoint_rewrite_interfaces");
        assert!(
            interfaces >= 4.0,
            "the program on every interface: {interfaces}"
        );
        let failures = after[&via].get("waypoint_rewrite_attach_failures_total");
        assert_eq!(failures, 0.0);
    }
    for (node, m) in &after {
        if *node != via {
            assert!(!m.router_moved(&before[node]), "waypoint {node} moved");
        }
    }
}

/// A pod IP of the other cluster is not routable: a direct dial reaches no one.
fn no_pod_route_across(w: &mut World) {
    let w = &*w;
    // Both at once: each waits out its timeout (an ARP that nobody answers).
    std::thread::scope(|s| {
        let dials: Vec<_> = ["svc-b-b1", "svc-b-b2"]
            .into_iter()
            .map(|b_pod| {
                s.spawn(move || {
                    let addr = w.pod(b_pod).unwrap().inbound();
                    (b_pod, addr, w.dial(CLIENT, addr, Duration::from_secs(2)))
                })
            })
            .collect();
        for d in dials {
            let (b_pod, addr, r) = d.join().unwrap();
            assert!(
                r.is_err(),
                "an A pod reached B pod {b_pod} at {addr} directly"
            );
        }
    });
    // The same dial inside cluster a works: the failure above is the missing route.
    let a2 = w.pod("svc-a-a2").unwrap().inbound();
    w.dial(CLIENT, a2, Duration::from_secs(2)).unwrap();
}

/// Scenario 2: A → svc-A is dialed at pod_ip:15008; no waypoint counter moves.
fn intra_cluster(w: &mut World) {
    let view = w.view("a1", SVC_A).unwrap();
    assert_eq!(view.endpoints.len(), 2, "{view:?}");
    for t in &view.endpoints {
        assert!(!t.waypoint, "{t:?}");
        assert_eq!(t.address, SocketAddr::from((t.pod_ip, 15008)));
    }
    let before = metrics_all(w);
    for node in ["a1", "a2"] {
        let r = w
            .client(CLIENT, &Transfer::new(SVC_A, 4 * MIB).via(node))
            .unwrap();
        assert!(r.ok(), "A → svc-A on {node} failed: {r:?}");
        let t = r.target.as_ref().unwrap();
        assert_eq!(t.address, w.pod(&t.pod).unwrap().inbound());
        let g = r.greeting.as_ref().unwrap();
        assert_eq!(g.pod, t.pod);
        assert_eq!(g.peer_id, spiffe_id(NAMESPACE, "client"));
        assert_eq!(r.server_id, spiffe_id(NAMESPACE, "svc-a"));
    }
    sleep(Duration::from_millis(200));
    let after = metrics_all(w);
    for (node, m) in &after {
        assert!(!m.router_moved(&before[node]), "waypoint {node} moved");
    }
}

/// Scenario 4: four kinds of abuse at B1's waypoint are each rejected and counted, while
/// a long transfer through it completes intact.
fn abuse(w: &mut World) {
    let target = w.node("b1").unwrap().tunnel_addr();
    let before = w.metrics("b1").unwrap();
    let long = w
        .spawn_client(
            CLIENT,
            &Transfer::new(SVC_B, 24 * MIB).via("b1").rate(6 * MIB),
        )
        .unwrap();
    sleep(Duration::from_millis(300));
    let kinds = [
        (AbuseKind::NotExported, "not_exported"),
        (AbuseKind::ForeignDomain, "foreign_domain"),
        (AbuseKind::Garbage, "not_tls"),
        (AbuseKind::Silent, "hello_timeout"),
    ];
    let procs: Vec<_> = kinds
        .iter()
        .map(|(k, _)| w.spawn_abuse(CLIENT, target, *k).unwrap())
        .collect();
    for p in procs {
        let r = World::finish_abuse(p).unwrap();
        assert!(!r.accepted, "abuse got through: {r:?}");
    }
    let r = World::finish_client(long, Duration::from_secs(60)).unwrap();
    assert_eq!(assert_cross(w, &r, 24 * MIB), "b1");
    assert!(
        r.elapsed_ms >= 3000,
        "the transfer overlapped the abuse: {} ms",
        r.elapsed_ms
    );
    let after = w.metrics("b1").unwrap();
    for (kind, reason) in kinds {
        assert_eq!(
            after.rejected(reason),
            before.rejected(reason) + 1.0,
            "{kind:?} counted as {reason}: {:?}",
            after.0
        );
    }
    assert_eq!(after.opened(), before.opened() + 1.0);
}

/// Bytes each way of a ping-pong of `messages` (see the client's message sizes).
fn ping_pong_bytes(messages: u32) -> u64 {
    (0..messages)
        .map(|i| [1u64, 333, 1448, 4000, 16 << 10][i as usize % 5])
        .sum()
}

/// Scenario 6: lossy links. 2 % of the packets to and from B1 dropped on the underlay
/// and 1 % of those between A1 and B1 duplicated, and 2 % of svc-b's packets on B1
/// dropped at the pod, both ways: bulk transfers (each ending in the client's
/// half-close), a ping-pong, and a paced transfer across 2 s of a dark link to B1 all
/// go through B1's waypoint intact. With the rewrite splice, each connection is
/// rewritten (retransmissions, duplicates and SACK blocks pass the program).
fn lossy_links(w: &mut World) {
    const POD: &str = "svc-b-b1";
    let before = w.metrics("b1").unwrap();
    w.impair("b1", "a1", POD, 20, 10).unwrap();
    let mut bulk_ms = Vec::new();
    for _ in 0..3 {
        let r = w
            .client(CLIENT, &Transfer::new(SVC_B, 8 * MIB).via("b1"))
            .unwrap();
        assert_eq!(assert_cross(w, &r, 8 * MIB), "b1");
        bulk_ms.push(r.elapsed_ms);
    }
    let messages = 300;
    let r = w
        .client(
            CLIENT,
            &Transfer::new(SVC_B, 0).via("b1").ping_pong(messages),
        )
        .unwrap();
    assert_eq!(assert_cross(w, &r, ping_pong_bytes(messages)), "b1");
    let ping_pong_ms = r.elapsed_ms;
    let dark = w
        .spawn_client(
            CLIENT,
            &Transfer::new(SVC_B, 16 * MIB)
                .via("b1")
                .rate(4 * MIB)
                .timeout(Duration::from_secs(60)),
        )
        .unwrap();
    // Darken only once B1 has routed the connection: a SYN lost to the 2 % drop is
    // resent after 1 s, and one more lost to the dark link would exhaust the
    // client's connect deadline before a byte moved.
    wait_for(Duration::from_secs(10), || {
        w.metrics("b1")
            .is_ok_and(|m| m.opened() >= before.opened() + 5.0)
    })
    .expect("B1 routed the paced connection");
    sleep(Duration::from_millis(500));
    w.darken("b1", true).unwrap();
    sleep(Duration::from_secs(2));
    w.darken("b1", false).unwrap();
    let r = World::finish_client(dark, Duration::from_secs(90)).unwrap();
    assert_eq!(assert_cross(w, &r, 16 * MIB), "b1");
    let (dropped, duplicated, dropped_at_pod) = w.impaired(POD).unwrap();
    w.unimpair(POD).unwrap();
    assert!(
        dropped > 0 && duplicated > 0 && dropped_at_pod > 0,
        "the links were impaired: {dropped} dropped, {duplicated} duplicated, \
         {dropped_at_pod} dropped at the pod"
    );
    eprintln!(
        "    {dropped} packets dropped on the underlay, {duplicated} duplicated, \
         {dropped_at_pod} dropped at the pod; 3 × 8 MiB in {bulk_ms:?} ms, {messages} \
         round trips in {ping_pong_ms} ms, 16 MiB across 2 s dark in {} ms",
        r.elapsed_ms
    );
    let after = w.metrics("b1").unwrap();
    assert_eq!(after.opened(), before.opened() + 5.0);
    if rewrites(w) {
        let results: Vec<(String, f64)> = after
            .0
            .iter()
            .filter(|(k, _)| k.starts_with("waypoint_rewrite_connections_total"))
            .map(|(k, v)| (k.clone(), v - before.get(k)))
            .filter(|(_, d)| *d != 0.0)
            .collect();
        eprintln!("    rewrite: {results:?}");
        let result = rewritten(w);
        assert_eq!(
            after.get(result),
            before.get(result) + 5.0,
            "every connection {result}: {results:?}"
        );
    }
}

/// Scenario 5: SIGTERM a B waypoint: a connection that ends within the drain deadline
/// completes; one that outlives it is closed at the deadline, unless it is rewritten: the
/// daemon then leaves it in the kernel (no next daemon runs here to take it), it runs to
/// its end with no daemon at all, and the daemon exits without waiting for the deadline.
/// The daemon started again serves new connections once ready.
fn graceful_restart(w: &mut World) {
    let drain = w.opts.drain_timeout;
    let left = rewrites(w) && !w.opts.ipv6;
    let short = w
        .spawn_client(
            CLIENT,
            &Transfer::new(SVC_B, 8 * MIB).via("b2").rate(4 * MIB),
        )
        .unwrap();
    let long = w
        .spawn_client(
            CLIENT,
            &Transfer::new(SVC_B, 64 * MIB).via("b2").rate(4 * MIB),
        )
        .unwrap();
    sleep(Duration::from_millis(500));
    let mut old = w.take_daemon("b2").unwrap();
    let t0 = Instant::now();
    old.signal(Signal::SIGTERM).unwrap();
    // Not ready at once (the admin server stays up during the drain).
    let admin = w.node("b2").unwrap().admin_addr();
    wait_for(Duration::from_secs(1), || {
        netns::in_netns("wp-underlay", move || {
            waypoint_e2e::admin::get(admin, "/readyz", Duration::from_millis(300))
        })
        .ok()
        .and_then(Result::ok)
        .is_some_and(|(status, _)| status == 503)
    })
    .expect("not ready while draining");

    let r = World::finish_client(short, Duration::from_secs(30)).unwrap();
    assert_eq!(assert_cross(w, &r, 8 * MIB), "b2", "drained to completion");

    let status = old
        .wait_timeout(drain + Duration::from_secs(10))
        .unwrap()
        .unwrap_or_else(|| {
            panic!(
                "still running {drain:?} after SIGTERM: {}",
                old.log_tail(10)
            )
        });
    let exited = t0.elapsed();
    assert!(status.success(), "drained daemon exit: {status}");
    if left {
        // Nothing to drain; it waits up to 5 s for a next daemon to take its sockets.
        assert!(
            exited <= Duration::from_secs(8),
            "exited {exited:?} after SIGTERM, with every connection rewritten"
        );
        let r = World::finish_client(long, Duration::from_secs(40)).unwrap();
        assert_eq!(
            assert_cross(w, &r, 64 * MIB),
            "b2",
            "the left connection ran to its end"
        );
        eprintln!("    left: both transfers intact, the long one with no daemon, exit {exited:.1?} after SIGTERM");
    } else {
        assert!(
            exited >= drain - Duration::from_millis(500)
                && exited <= drain + Duration::from_secs(3),
            "exited {exited:?} after SIGTERM, drain deadline {drain:?}"
        );
        let r = World::finish_client(long, Duration::from_secs(30)).unwrap();
        assert!(
            !r.ok(),
            "a connection outliving the drain deadline is closed: {r:?}"
        );
        assert!(
            r.elapsed_ms < 10_000,
            "cut at the deadline, not run to the end"
        );
        eprintln!(
            "    drained: short transfer intact, long one cut, exit {exited:.1?} after SIGTERM"
        );
    }

    let t1 = Instant::now();
    w.start_daemon("b2").unwrap();
    w.wait_ready("b2", Duration::from_secs(20)).unwrap();
    // Its lease was revoked on the way out: wait until cluster a sees b2's pods again.
    wait_for(Duration::from_secs(10), || {
        w.view("a1", SVC_B)
            .is_ok_and(|v| v.endpoints.iter().any(|t| t.node == "b2"))
    })
    .expect("b2 back in cluster a's view");
    let r = w
        .client(CLIENT, &Transfer::new(SVC_B, 8 * MIB).via("b2"))
        .unwrap();
    assert_eq!(assert_cross(w, &r, 8 * MIB), "b2");
    assert_eq!(
        w.metrics("b2").unwrap().opened(),
        1.0,
        "served by the new daemon"
    );
    eprintln!("    restarted b2 serving in {:.1?}", t1.elapsed());
}

/// Scenario 3: B1 loses its link and its daemon dies (SIGKILL). Within the lease
/// TTL plus 2 s its endpoints leave cluster a's view; every new A → svc-B connection then goes
/// through B2; an established one through B2 survives, one through B1 does not.
fn node_death(w: &mut World) {
    let ttl = w.opts.lease_ttl;
    let through_b2 = w
        .spawn_client(
            CLIENT,
            &Transfer::new(SVC_B, 16 * MIB).via("b2").rate(4 * MIB),
        )
        .unwrap();
    let through_b1 = w
        .spawn_client(
            CLIENT,
            &Transfer::new(SVC_B, 16 * MIB)
                .via("b1")
                .rate(4 * MIB)
                .timeout(Duration::from_secs(8)),
        )
        .unwrap();
    sleep(Duration::from_millis(500));
    let mut dead = w.take_daemon("b1").unwrap();
    // Link first: like a node losing power, nothing (no FIN, no lease revoke) leaves it.
    w.cut_link("b1").unwrap();
    dead.signal(Signal::SIGKILL).unwrap();
    let t0 = Instant::now();
    let deadline = t0 + ttl + Duration::from_secs(2);
    for viewer in ["a1", "a2"] {
        wait_for(deadline.saturating_duration_since(Instant::now()), || {
            w.view(viewer, SVC_B)
                .is_ok_and(|v| v.endpoints.iter().all(|t| t.node != "b1"))
        })
        .unwrap_or_else(|_| {
            panic!(
                "b1's endpoints still in {viewer}'s view after {:?}",
                t0.elapsed()
            )
        });
    }
    let gone = t0.elapsed();
    assert!(gone <= ttl + Duration::from_secs(2), "{gone:?}");
    let view = w.view("a1", SVC_B).unwrap();
    assert_eq!(view.endpoints.len(), 1, "{view:?}");
    eprintln!(
        "    b1's endpoints left cluster a's view {gone:.1?} after its death (lease TTL {ttl:?})"
    );
    for _ in 0..5 {
        let r = w.client(CLIENT, &Transfer::new(SVC_B, MIB)).unwrap();
        assert_eq!(assert_cross(w, &r, MIB), "b2");
    }
    let r = World::finish_client(through_b2, Duration::from_secs(30)).unwrap();
    assert_eq!(
        assert_cross(w, &r, 16 * MIB),
        "b2",
        "through the healthy node"
    );
    let r = World::finish_client(through_b1, Duration::from_secs(30)).unwrap();
    assert!(
        !r.ok(),
        "a connection through the dead node cannot finish: {r:?}"
    );
    dead.wait_timeout(Duration::from_secs(5)).unwrap();
}
