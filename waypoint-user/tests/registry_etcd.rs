//! The etcd registry against a real etcd (Debian `etcd-server`, /usr/bin/etcd): records,
//! the registrar's lease, the watcher's convergence through compaction and etcd restarts,
//! skipped records, the split-horizon view, the daemon and the CLI. Every test starts its
//! own etcd on its own ports, so they run in parallel.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
// Only the etcd harness is needed; included by path so that tests/common/mod.rs (shared
// by the other test binaries) stays as it is.
#[path = "common/daemon.rs"]
#[allow(dead_code, reason = "the daemon harness serves several test binaries")]
mod daemon_harness;
#[path = "common/etcd.rs"]
#[allow(dead_code, reason = "the harness serves several test binaries")]
mod etcd_harness;
#[path = "common/records.rs"]
#[allow(dead_code, reason = "shared by the etcd test binaries")]
mod records;

use std::{collections::BTreeMap, net::IpAddr, time::Duration};

use etcd_client::{CompactionOptions, GetOptions};
use etcd_harness::{eventually, Etcd};
use tokio_util::sync::CancellationToken;
use waypoint::{
    horizon::{self, Mode, Viewer},
    model::Endpoint,
    registry::{
        etcd::{self as reg, Connector, LocalSource, Registrar, TlsArgs, Watcher},
        metrics::Metrics,
        record,
    },
    store::Store,
};

use records::{content, endpoint, has_pod, identity, local, WAIT};

fn connector(etcd: &Etcd) -> Connector {
    Connector::new(vec![etcd.url()], &TlsArgs::default()).unwrap()
}

/// A watcher feeding a fresh store.
fn watch(etcd: &Etcd, stop: &CancellationToken) -> (Store, Metrics, reg::WatcherHandle) {
    let store = Store::new();
    let metrics = Metrics::unregistered();
    let handle = Watcher::new(connector(etcd), store.clone(), metrics.clone()).spawn(stop.clone());
    (store, metrics, handle)
}

/// etcd's content: every valid record under the root.
async fn etcd_content(etcd: &Etcd) -> BTreeMap<String, Endpoint> {
    reg::snapshot(&connector(etcd)).await.unwrap().endpoints
}

/// Waits until the store holds exactly what etcd holds.
async fn converges(store: &Store, etcd: &Etcd) -> Duration {
    records::converges(store, || etcd_content(etcd), true).await
}

#[tokio::test]
async fn node_ip_round_trips_and_other_clusters_see_the_record() {
    let etcd = Etcd::start(0).await;
    let stop = CancellationToken::new();
    // Cluster b registers a pod through its registrar; cluster a watches.
    let b = Registrar::new(
        connector(&etcd),
        identity("b", "b-node-1", Some("192.168.20.1")),
        LocalSource::Fixed(vec![local("reviews-b1", "10.2.0.1")]),
        Duration::from_secs(5),
        Metrics::unregistered(),
    );
    tokio::spawn(b.run(stop.clone()));
    let (a_store, _, _h) = watch(&etcd, &stop);
    eventually("a sees b's pod", WAIT, || has_pod(&a_store, "reviews-b1")).await;
    let snap = a_store.snapshot();
    let got = snap.all().find(|e| e.pod_name == "reviews-b1").unwrap();
    assert_eq!(got.node_ip, Some("192.168.20.1".parse::<IpAddr>().unwrap()));
    assert_eq!(got.cluster, "b");
    assert_eq!(got.node_name, "b-node-1");
    assert!(a_store.is_synced());

    // A record put by hand (IPv6 node IP, no lease) round-trips too, through a second
    // watcher standing for a third cluster.
    let mut v6 = endpoint("c", "c-node-1", "reviews-c1", "10.3.0.1");
    v6.node_ip = Some("fd00::31".parse().unwrap());
    let key = reg::put(&mut etcd.client().await, &v6).await.unwrap();
    assert_eq!(
        key,
        "/aether/v1/regions/eu/clusters/c/nodes/c-node-1/endpoints/bookinfo/reviews/reviews-c1"
    );
    let (c_store, _, _h2) = watch(&etcd, &stop);
    eventually("both pods everywhere", WAIT, || {
        has_pod(&a_store, "reviews-c1") && has_pod(&c_store, "reviews-b1")
    })
    .await;
    assert_eq!(content(&a_store)[&key], v6);
    assert_eq!(content(&c_store)[&key], v6);
    stop.cancel();
}

#[tokio::test]
async fn golden_views_from_etcd_content() {
    let etcd = Etcd::start(1).await;
    let mut client = etcd.client().await;
    let mut eps = vec![
        endpoint("a", "a1", "r-a1", "10.1.0.1"),
        endpoint("a", "a2", "r-a2", "10.1.0.2"),
        endpoint("b", "b1", "r-b1", "10.2.0.1"),
    ];
    let mut far = endpoint("d", "d1", "r-d1", "10.4.0.1");
    far.region = "us".into();
    far.zone = "us-1".into();
    eps.push(far);
    let mut same_zone = endpoint("c", "c1", "r-c1", "10.3.0.1");
    same_zone.zone = "eu-a".into();
    eps.push(same_zone);
    let mut no_ip = endpoint("b", "b2", "r-b2", "10.2.0.2");
    no_ip.node_ip = None;
    eps.push(no_ip);
    let mut down = endpoint("b", "b1", "r-b3", "10.2.0.3");
    down.ready = false;
    eps.push(down);
    for e in &eps {
        reg::put(&mut client, e).await.unwrap();
    }
    let stop = CancellationToken::new();
    let (store, _, _h) = watch(&etcd, &stop);
    eventually("all records", WAIT, || store.snapshot().len() == eps.len()).await;

    let q: horizon::Query = "reviews.bookinfo:9080".parse().unwrap();
    let table = |mode| {
        let viewer = Viewer {
            cluster: "a".into(),
            node: "a1".into(),
            region: "eu".into(),
            zone: "eu-a".into(),
            mode,
            mesh_domain: "mesh.local".into(),
            tunnel_port: 15443,
            pod_port: 15008,
        };
        let snap = store.snapshot();
        horizon::resolve(&viewer, &q, snap.all().map(AsRef::as_ref)).table()
    };
    assert_eq!(
        table(Mode::Off),
        "\
PRIO  ADDRESS         SNI   VIA     CLUSTER  NODE  POD   LOCALITY
0     10.1.0.1:15008  9080  direct  a        a1    r-a1  eu/eu-a
0     10.1.0.2:15008  9080  direct  a        a2    r-a2  eu/eu-a
1     10.3.0.1:15008  9080  direct  c        c1    r-c1  eu/eu-a
2     10.2.0.1:15008  9080  direct  b        b1    r-b1  eu/eu-b
2     10.2.0.2:15008  9080  direct  b        b2    r-b2  eu/eu-b
3     10.4.0.1:15008  9080  direct  d        d1    r-d1  us/us-1
left out: not_ready=1
"
    );
    assert_eq!(
        table(Mode::CrossCluster),
        "\
PRIO  ADDRESS            SNI                               VIA       CLUSTER  NODE  POD   LOCALITY
0     10.1.0.1:15008     9080                              direct    a        a1    r-a1  eu/eu-a
0     10.1.0.2:15008     9080                              direct    a        a2    r-a2  eu/eu-a
1     192.168.3.1:15443  9080.reviews.bookinfo.mesh.local  waypoint  c        c1    r-c1  eu/eu-a
2     192.168.2.1:15443  9080.reviews.bookinfo.mesh.local  waypoint  b        b1    r-b1  eu/eu-b
3     192.168.4.1:15443  9080.reviews.bookinfo.mesh.local  waypoint  d        d1    r-d1  us/us-1
left out: no_node_ip=1 not_ready=1
"
    );
    assert_eq!(
        table(Mode::Always),
        "\
PRIO  ADDRESS            SNI                               VIA       CLUSTER  NODE  POD   LOCALITY
0     10.1.0.1:15008     9080                              direct    a        a1    r-a1  eu/eu-a
0     192.168.1.2:15443  9080.reviews.bookinfo.mesh.local  waypoint  a        a2    r-a2  eu/eu-a
1     192.168.3.1:15443  9080.reviews.bookinfo.mesh.local  waypoint  c        c1    r-c1  eu/eu-a
2     192.168.2.1:15443  9080.reviews.bookinfo.mesh.local  waypoint  b        b1    r-b1  eu/eu-b
3     192.168.4.1:15443  9080.reviews.bookinfo.mesh.local  waypoint  d        d1    r-d1  us/us-1
left out: no_node_ip=1 not_ready=1
"
    );
    stop.cancel();
}

#[tokio::test]
async fn lease_expiry_removes_a_dead_registrar_and_revoke_is_immediate() {
    let etcd = Etcd::start(2).await;
    let stop = CancellationToken::new();
    let ttl = Duration::from_secs(2);
    let (store, _, _h) = watch(&etcd, &stop);

    // Killed: the task is aborted, nothing revokes; the lease must expire.
    let dead = Registrar::new(
        connector(&etcd),
        identity("b", "b-dead", Some("192.168.20.9")),
        LocalSource::Fixed(vec![
            local("dead-1", "10.2.0.9"),
            local("dead-2", "10.2.0.10"),
        ]),
        ttl,
        Metrics::unregistered(),
    );
    let task = tokio::spawn(dead.run(CancellationToken::new()));
    eventually("registered", WAIT, || {
        has_pod(&store, "dead-1") && has_pod(&store, "dead-2")
    })
    .await;
    task.abort();
    let _ = task.await;
    let took = eventually(
        "the dead node's endpoints vanish",
        ttl + Duration::from_secs(3),
        || !has_pod(&store, "dead-1") && !has_pod(&store, "dead-2"),
    )
    .await;
    eprintln!("lease expiry: endpoints vanished {took:?} after the registrar died (TTL {ttl:?})");
    assert!(
        took >= Duration::from_millis(500),
        "vanished too early ({took:?}): not by lease expiry"
    );

    // Stopped gracefully: the lease is revoked and the records go at once.
    let graceful_stop = CancellationToken::new();
    let graceful = Registrar::new(
        connector(&etcd),
        identity("b", "b-graceful", Some("192.168.20.8")),
        LocalSource::Fixed(vec![local("graceful-1", "10.2.0.8")]),
        Duration::from_secs(30),
        Metrics::unregistered(),
    );
    let task = tokio::spawn(graceful.run(graceful_stop.clone()));
    eventually("registered", WAIT, || has_pod(&store, "graceful-1")).await;
    graceful_stop.cancel();
    task.await.unwrap();
    let took = eventually("revoked endpoints vanish", Duration::from_secs(2), || {
        !has_pod(&store, "graceful-1")
    })
    .await;
    eprintln!("revoke: endpoints vanished {took:?} after a graceful stop (TTL 30s)");
    stop.cancel();
}

#[tokio::test]
async fn registrar_reregisters_after_its_lease_is_lost() {
    let etcd = Etcd::start(3).await;
    let stop = CancellationToken::new();
    let (store, _, _h) = watch(&etcd, &stop);
    let metrics = Metrics::unregistered();
    let r = Registrar::new(
        connector(&etcd),
        identity("a", "a1", Some("192.168.10.1")),
        LocalSource::Fixed(vec![local("mine", "10.1.0.1")]),
        Duration::from_secs(5),
        metrics.clone(),
    );
    tokio::spawn(r.run(stop.clone()));
    eventually("registered", WAIT, || has_pod(&store, "mine")).await;
    // Someone revokes the node's lease (as an expiry during a long partition would).
    let mut client = etcd.client().await;
    for l in client.leases().await.unwrap().leases() {
        client.lease_revoke(l.id()).await.unwrap();
    }
    eventually("registered again under a new lease", WAIT, || {
        metrics.lease_grants() >= 2 && has_pod(&store, "mine")
    })
    .await;
    stop.cancel();
}

#[tokio::test]
async fn compaction_while_the_watcher_is_behind_converges() {
    let etcd = Etcd::start(4).await;
    let mut client = etcd.client().await;
    for i in 1..=5 {
        reg::put(
            &mut client,
            &endpoint("b", "b1", &format!("p{i}"), &format!("10.2.0.{i}")),
        )
        .await
        .unwrap();
    }
    let stop = CancellationToken::new();
    let (store, metrics, handle) = watch(&etcd, &stop);
    eventually("initial state", WAIT, || store.snapshot().len() == 5).await;

    handle.set_paused(true);
    // Behind the watcher's back: deletes, updates, adds, then compact everything.
    for i in 1..=3 {
        let e = endpoint("b", "b1", &format!("p{i}"), &format!("10.2.0.{i}"));
        reg::delete(&mut client, &record::key(&e).unwrap(), false)
            .await
            .unwrap();
    }
    let mut changed = endpoint("b", "b1", "p4", "10.2.0.4");
    changed.ready = false;
    reg::put(&mut client, &changed).await.unwrap();
    for i in 6..=8 {
        reg::put(
            &mut client,
            &endpoint("c", "c1", &format!("q{i}"), &format!("10.3.0.{i}")),
        )
        .await
        .unwrap();
    }
    let rev = client
        .get(
            record::ROOT,
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    client
        .compact(rev, Some(CompactionOptions::new().with_physical()))
        .await
        .unwrap();
    // Still the old state while paused: nothing was applied behind our back.
    assert!(has_pod(&store, "p1"));

    handle.set_paused(false);
    let took = converges(&store, &etcd).await;
    eprintln!("compaction: converged {took:?} after resuming");
    assert_eq!(metrics.relists("compacted"), 1);
    let snap = content(&store);
    assert_eq!(snap.len(), 5);
    assert!(!snap
        .values()
        .any(|e| ["p1", "p2", "p3"].contains(&e.pod_name.as_str())));
    assert!(!snap.values().find(|e| e.pod_name == "p4").unwrap().ready);
    stop.cancel();
}

#[tokio::test]
async fn etcd_killed_and_restarted_with_changes_meanwhile_converges() {
    let mut etcd = Etcd::start(5).await;
    let stop = CancellationToken::new();
    let (store, metrics, _h) = watch(&etcd, &stop);
    let registrar_metrics = Metrics::unregistered();
    let r = Registrar::new(
        connector(&etcd),
        identity("a", "a1", Some("192.168.10.1")),
        LocalSource::Fixed(vec![local("registered", "10.1.0.1")]),
        Duration::from_secs(3),
        registrar_metrics.clone(),
    );
    tokio::spawn(r.run(stop.clone()));
    let mut client = etcd.client().await;
    for i in 1..=4 {
        reg::put(
            &mut client,
            &endpoint("b", "b1", &format!("p{i}"), &format!("10.2.0.{i}")),
        )
        .await
        .unwrap();
    }
    eventually("initial state", WAIT, || store.snapshot().len() == 5).await;
    eventually("connected", WAIT, || metrics.is_connected()).await;

    etcd.kill();
    eventually("the watcher notices", WAIT, || !metrics.is_connected()).await;
    // The last known state is still served, and still counts as synced.
    assert_eq!(store.snapshot().len(), 5);
    assert!(store.is_synced());
    assert!(
        metrics.detail().contains("unreachable"),
        "{}",
        metrics.detail()
    );

    etcd.restart().await;
    // Another client changes things right away, racing the watcher's reconnect.
    let mut client = etcd.client().await;
    for i in 1..=2 {
        let e = endpoint("b", "b1", &format!("p{i}"), &format!("10.2.0.{i}"));
        reg::delete(&mut client, &record::key(&e).unwrap(), false)
            .await
            .unwrap();
    }
    reg::put(&mut client, &endpoint("c", "c1", "late", "10.3.0.9"))
        .await
        .unwrap();

    let took = converges(&store, &etcd).await;
    eprintln!("restart: converged {took:?} after etcd came back");
    eventually("connected again", WAIT, || metrics.is_connected()).await;
    assert!(metrics.relists("reconnected") >= 1);
    assert!(has_pod(&store, "registered") && has_pod(&store, "late"));
    assert!(!has_pod(&store, "p1") && !has_pod(&store, "p2"));
    stop.cancel();
}

#[tokio::test]
async fn malformed_and_foreign_records_are_skipped_and_counted() {
    let etcd = Etcd::start(6).await;
    let mut client = etcd.client().await;
    let good = endpoint("b", "b1", "good", "10.2.0.1");
    reg::put(&mut client, &good).await.unwrap();
    let bad_key = "/aether/v1/regions/eu/clusters/b/nodes/b1/endpoints/bookinfo/reviews/garbage";
    client
        .put(bad_key, b"\xff\xff\xff\xff".to_vec(), None)
        .await
        .unwrap();
    client
        .put(
            "/aether/v1/regions/eu/clusters/b/gateways/gw-1",
            b"{}".to_vec(),
            None,
        )
        .await
        .unwrap();
    // A valid record under another endpoint's key.
    let mut moved = endpoint("b", "b1", "moved", "10.2.0.2");
    let wrong_key = record::key(&moved)
        .unwrap()
        .replace("/clusters/b/", "/clusters/z/");
    client
        .put(wrong_key, record::encode(&moved), None)
        .await
        .unwrap();
    // Outside the root: not ours, not even looked at.
    client
        .put("/aether/v2/regions/eu/whatever", b"x".to_vec(), None)
        .await
        .unwrap();

    let stop = CancellationToken::new();
    let (store, metrics, _h) = watch(&etcd, &stop);
    eventually("synced", WAIT, || store.is_synced()).await;
    assert_eq!(store.snapshot().len(), 1);
    assert!(has_pod(&store, "good"));
    assert_eq!(metrics.skipped("malformed_value"), 1);
    assert_eq!(metrics.skipped("foreign_key"), 1);
    assert_eq!(metrics.skipped("key_mismatch"), 1);

    // Through the watch too; and a good record turned bad leaves the store.
    client
        .put("/aether/v1/regions/eu/junk", b"x".to_vec(), None)
        .await
        .unwrap();
    client
        .put(record::key(&good).unwrap(), b"\x0a".to_vec(), None)
        .await
        .unwrap();
    moved.cluster = "b".into();
    reg::put(&mut client, &moved).await.unwrap();
    eventually("watch applied", WAIT, || {
        has_pod(&store, "moved") && !has_pod(&store, "good")
    })
    .await;
    assert_eq!(metrics.skipped("foreign_key"), 2);
    assert_eq!(metrics.skipped("malformed_value"), 2);
    assert!(metrics.is_connected());
    stop.cancel();
}

#[derive(clap::Parser)]
struct Args {
    #[command(flatten)]
    config: waypoint::config::Config,
}

#[tokio::test]
async fn daemon_registers_its_pods_serves_the_view_and_revokes_on_shutdown() {
    use clap::Parser as _;
    let etcd = Etcd::start(7).await;
    let dir = std::env::temp_dir().join(format!("waypoint-local-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("local.json");
    std::fs::write(
        &file,
        r#"{"endpoints": [{"service": "reviews", "namespace": "bookinfo", "pod_ip": "10.1.0.7",
            "pod_name": "reviews-a7", "ports": [9080], "exported": true}]}"#,
    )
    .unwrap();
    let registry = etcd.location();
    let local = file.display().to_string();
    let argv = [
        "waypoint",
        "--tunnel-addr",
        "127.0.0.1:0",
        "--admin-addr",
        "127.0.0.1:0",
        "--dataplane",
        "copy",
        "--cluster",
        "a",
        "--node-name",
        "a-node-1",
        "--node-ip",
        "192.168.10.7",
        "--region",
        "eu",
        "--zone",
        "eu-1",
        "--registry",
        &registry,
        "--local-endpoints",
        &local,
        "--registry-lease-ttl",
        "5s",
        "--tunnel-port",
        "15443",
    ];
    let config = Args::try_parse_from(argv).unwrap().config;
    let app = waypoint::app::App::start(config).await.unwrap();
    eventually("ready", WAIT, || app.ready.is_ready()).await;
    eventually("own pod in the store", WAIT, || {
        has_pod(&app.store, "reviews-a7")
    })
    .await;
    let (code, body) = daemon_harness::get(app.admin_addr, "/readyz").await;
    assert_eq!(code, 200);
    assert!(body.contains("etcd connected"), "{body}");

    // Cluster b's view of a's pod: through a's node waypoint.
    let (code, body) = daemon_harness::get(
        app.admin_addr,
        "/v1/resolve?service=reviews.bookinfo%3A9080&cluster=b&node=b1&mode=cross-cluster",
    )
    .await;
    assert_eq!(code, 200, "{body}");
    let view: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(view["endpoints"][0]["address"], "192.168.10.7:15443");
    assert_eq!(
        view["endpoints"][0]["sni"],
        "9080.reviews.bookinfo.mesh.local"
    );
    assert_eq!(view["endpoints"][0]["waypoint"], true);
    // And its own: direct.
    let (_, body) =
        daemon_harness::get(app.admin_addr, "/v1/resolve?service=reviews.bookinfo:9080").await;
    let view: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(view["endpoints"][0]["address"], "10.1.0.7:15008");
    assert_eq!(view["endpoints"][0]["sni"], "9080");
    assert_eq!(
        daemon_harness::get(app.admin_addr, "/v1/resolve?service=nope")
            .await
            .0,
        400
    );

    // The file changes: the registrar follows.
    std::fs::write(
        &file,
        r#"{"endpoints": [{"service": "reviews", "namespace": "bookinfo", "pod_ip": "10.1.0.8",
            "pod_name": "reviews-a8", "ports": [9080], "exported": true}]}"#,
    )
    .unwrap();
    eventually("local endpoints reloaded", WAIT, || {
        has_pod(&app.store, "reviews-a8") && !has_pod(&app.store, "reviews-a7")
    })
    .await;

    app.shutdown().await;
    assert!(
        etcd_content(&etcd).await.is_empty(),
        "the lease was not revoked on shutdown"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn cli_put_list_resolve_delete() {
    let etcd = Etcd::start(8).await;
    let registry = etcd.location();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_waypoint"))
            .args(args)
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let key = run(&[
        "registry",
        "put",
        "--registry",
        &registry,
        "--service",
        "reviews",
        "--namespace",
        "bookinfo",
        "--cluster",
        "b",
        "--pod-ip",
        "10.2.0.5",
        "--pod-name",
        "reviews-b5",
        "--node",
        "b1",
        "--node-ip",
        "192.168.20.5",
        "--region",
        "eu",
        "--port",
        "9080",
        "--exported",
    ]);
    assert_eq!(
        key.trim(),
        "/aether/v1/regions/eu/clusters/b/nodes/b1/endpoints/bookinfo/reviews/reviews-b5"
    );
    run(&[
        "registry",
        "put",
        "--registry",
        &registry,
        "--json",
        r#"{"service":"reviews","namespace":"bookinfo","cluster":"a","pod_ip":"10.1.0.5","node_name":"a1","ports":[9080]}"#,
    ]);
    let list = run(&[
        "registry",
        "list",
        "--registry",
        &registry,
        "--output",
        "json",
    ]);
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(list.as_array().unwrap().len(), 2);

    let view = run(&[
        "resolve",
        "reviews.bookinfo:9080",
        "--registry",
        &registry,
        "--cluster",
        "a",
        "--node",
        "a1",
        "--east-west-waypoint",
        "cross-cluster",
    ]);
    assert_eq!(
        view,
        "\
PRIO  ADDRESS             SNI                               VIA       CLUSTER  NODE  POD         LOCALITY
0     10.1.0.5:15008      9080                              direct    a        a1    10.1.0.5    /
3     192.168.20.5:15443  9080.reviews.bookinfo.mesh.local  waypoint  b        b1    reviews-b5  eu/
"
    );
    let json = run(&[
        "resolve",
        "reviews.bookinfo:9080",
        "--registry",
        &registry,
        "--cluster",
        "a",
        "-o",
        "json",
    ]);
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(json["endpoints"][1]["address"], "10.2.0.5:15008");

    let deleted = run(&["registry", "delete", "--registry", &registry, key.trim()]);
    assert_eq!(deleted.trim(), "deleted 1");
    let deleted = run(&[
        "registry",
        "delete",
        "--registry",
        &registry,
        "--prefix",
        "/aether/v1/regions/",
    ]);
    assert_eq!(deleted.trim(), "deleted 1");
    assert!(etcd_content(&etcd).await.is_empty());
}
