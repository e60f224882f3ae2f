//! The etcd registry against a real etcd serving clients over mutual TLS
//! (`--client-cert-auth`), and against a three-member cluster with one member down: what
//! the kind e2e covers, on loopback. Every test starts its own etcd (slots 10 and up;
//! tests/registry_etcd.rs has 0 to 9), so they run in parallel.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
// Only the etcd harness is needed (see tests/registry_etcd.rs).
#[path = "common/etcd.rs"]
#[allow(dead_code, reason = "the harness serves several test binaries")]
mod etcd_harness;
#[path = "common/records.rs"]
#[allow(dead_code, reason = "shared by the etcd test binaries")]
mod records;

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use etcd_harness::{eventually, Etcd, Security, CLUSTER_SIZE};
use tokio_util::sync::CancellationToken;
use waypoint::{
    model::Endpoint,
    registry::{
        etcd::{self as reg, Connector, LocalSource, Registrar, TlsArgs, Watcher},
        metrics::Metrics,
    },
    store::Store,
};

use records::{content, endpoint, has_pod, identity, local, WAIT};

/// A refused connection must say so well within this: no retry loop, no hang.
const REFUSED_WITHIN: Duration = Duration::from_secs(10);

/// The daemon's TLS flags for `etcd`: its CA and the client certificate.
fn mutual_tls(etcd: &Etcd) -> TlsArgs {
    let pki = etcd.pki();
    TlsArgs {
        etcd_ca: Some(pki.ca.clone()),
        etcd_cert: Some(pki.client_cert.clone()),
        etcd_key: Some(pki.client_key.clone()),
    }
}

/// A connector to every member of `etcd`, with the client certificate.
fn connector(etcd: &Etcd) -> Connector {
    Connector::new(etcd.urls(), &mutual_tls(etcd)).unwrap()
}

/// A registrar of `pods` for node `node` of cluster a, through `connector`.
fn registrar(connector: Connector, node: &str, pods: &[(&str, &str)]) -> (Registrar, Metrics) {
    let metrics = Metrics::unregistered();
    let r = Registrar::new(
        connector,
        identity("a", node, Some("192.168.10.1")),
        LocalSource::Fixed(pods.iter().map(|(p, ip)| local(p, ip)).collect()),
        Duration::from_secs(5),
        metrics.clone(),
    );
    (r, metrics)
}

/// A watcher feeding a fresh store.
fn watch(connector: Connector, stop: &CancellationToken) -> (Store, Metrics) {
    let store = Store::new();
    let metrics = Metrics::unregistered();
    Watcher::new(connector, store.clone(), metrics.clone()).spawn(stop.clone());
    (store, metrics)
}

/// etcd's content, read by the harness's own client (not the code under test).
async fn etcd_content(etcd: &Etcd) -> BTreeMap<String, Endpoint> {
    reg::list(&mut etcd.client().await).await.unwrap().endpoints
}

/// Waits until the store holds exactly what etcd holds, and something.
async fn converges(store: &Store, etcd: &Etcd) -> Duration {
    records::converges(store, || etcd_content(etcd), false).await
}

/// `reg::snapshot` through `connector`, which must fail, and soon: its error text.
async fn refused(connector: &Connector) -> String {
    let start = std::time::Instant::now();
    let result = tokio::time::timeout(REFUSED_WITHIN, reg::snapshot(connector))
        .await
        .unwrap_or_else(|_| panic!("no answer within {REFUSED_WITHIN:?}: the client hangs"));
    let err = result
        .expect_err("etcd must refuse this client")
        .to_string();
    eprintln!("refused after {:?}: {err}", start.elapsed());
    err
}

#[tokio::test]
async fn registrar_and_watcher_over_mutual_tls_converge() {
    let etcd = Etcd::start_tls(10).await;
    assert!(etcd.url().starts_with("https://"));
    let stop = CancellationToken::new();
    let (r, registrar_metrics) = registrar(
        connector(&etcd),
        "a-node-1",
        &[("reviews-a1", "10.1.0.1"), ("reviews-a2", "10.1.0.2")],
    );
    tokio::spawn(r.run(stop.clone()));
    let (store, metrics) = watch(connector(&etcd), &stop);
    eventually("the watcher sees the registrar's pods", WAIT, || {
        has_pod(&store, "reviews-a1") && has_pod(&store, "reviews-a2")
    })
    .await;
    // A write through the watch (not only the initial listing) arrives too.
    let mut client = etcd.client().await;
    reg::put(&mut client, &endpoint("b", "b1", "reviews-b1", "10.2.0.1"))
        .await
        .unwrap();
    let took = converges(&store, &etcd).await;
    eprintln!("mutual TLS: converged {took:?} after the put");
    assert_eq!(content(&store).len(), 3);
    assert!(metrics.is_connected(), "{}", metrics.detail());
    assert_eq!(registrar_metrics.lease_grants(), 1);
    // The registrar's lease is revoked over TLS too on a graceful stop (its TTL is 5s:
    // gone within 2s is the revoke, not the expiry).
    stop.cancel();
    let start = std::time::Instant::now();
    while etcd_content(&etcd).await.len() != 1 {
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "the lease was not revoked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(etcd_content(&etcd)
        .await
        .values()
        .all(|e| e.pod_name == "reviews-b1"));
}

#[tokio::test]
async fn a_client_without_a_certificate_is_refused() {
    let etcd = Etcd::start_tls(11).await;
    let ca_only = TlsArgs {
        etcd_ca: Some(etcd.pki().ca.clone()),
        ..TlsArgs::default()
    };
    let connector = Connector::new(etcd.urls(), &ca_only).unwrap();
    let err = refused(&connector).await;
    // The member, what to check, and the cause. Under TLS 1.3 the client learns of the
    // refusal only after its handshake, so the cause depends on who is faster: it reads
    // etcd's alert (BadCertificate) most times; sometimes it sees only the connection
    // closing, or its first request's write fails on the closed connection (EPIPE).
    assert!(err.contains(&etcd.url()), "unclear error: {err}");
    assert!(
        err.contains("--etcd-cert/--etcd-key (etcd may require a client certificate)"),
        "unclear error: {err}"
    );
    assert!(
        [
            ": received fatal alert: badcertificate)",
            ": connection closed)",
            "broken pipe)",
            "connection reset by peer",
        ]
        .iter()
        .any(|cause| err.to_lowercase().contains(cause)),
        "unclear error: {err}"
    );

    // The daemon's watcher says the same in its status (the /readyz body).
    let stop = CancellationToken::new();
    let (store, metrics) = watch(connector, &stop);
    eventually("the watcher reports the refusal", WAIT, || {
        metrics.detail().contains("--etcd-cert")
    })
    .await;
    assert!(!store.is_synced());
    eprintln!("{}", metrics.detail());
    stop.cancel();
}

#[tokio::test]
async fn a_server_certificate_from_another_ca_is_refused() {
    let etcd = Etcd::start_tls(12).await;
    let pki = etcd.pki();
    let wrong_ca = TlsArgs {
        etcd_ca: Some(pki.other_ca.clone()),
        ..mutual_tls(&etcd)
    };
    let err = refused(&Connector::new(etcd.urls(), &wrong_ca).unwrap()).await;
    assert!(
        err.contains("invalid peer certificate: UnknownIssuer"),
        "unclear error: {err}"
    );
    assert!(err.contains("--etcd-ca"), "unclear error: {err}");

    // No CA at all: no system roots are loaded, so nothing is trusted.
    let no_ca = TlsArgs {
        etcd_ca: None,
        ..mutual_tls(&etcd)
    };
    let err = refused(&Connector::new(etcd.urls(), &no_ca).unwrap()).await;
    assert!(
        err.contains("invalid peer certificate: UnknownIssuer"),
        "unclear error: {err}"
    );

    // A plain client on the TLS port.
    let plain = Connector::new(
        vec![etcd.url().replace("https://", "http://")],
        &TlsArgs::default(),
    )
    .unwrap();
    refused(&plain).await;
}

/// An endpoint that accepts connections and never answers (a hung or overloaded member,
/// or not etcd at all): given up on in bounded time, alone; skipped, among others.
#[tokio::test]
async fn a_silent_endpoint_is_given_up_on() {
    let etcd = Etcd::start_tls(13).await;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_url = format!("https://{}", silent.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let alone = Connector::new(vec![silent_url.clone()], &mutual_tls(&etcd)).unwrap();
    let start = std::time::Instant::now();
    let err = refused(&alone).await;
    let bound = start.elapsed();
    assert!(err.contains(&silent_url), "unclear error: {err}");
    assert!(err.contains("no answer within"), "unclear error: {err}");

    // The endpoints are tried from a random one: go on until the silent one came first
    // (the snapshot then takes about `bound`), which must not make it fail.
    let both = Connector::new(vec![silent_url, etcd.url()], &mutual_tls(&etcd)).unwrap();
    let mut silent_first = false;
    for _ in 0..20 {
        let start = std::time::Instant::now();
        tokio::time::timeout(REFUSED_WITHIN, reg::snapshot(&both))
            .await
            .expect("no answer: the client hangs on the silent endpoint")
            .expect("the live member answers");
        if start.elapsed() >= bound / 2 {
            silent_first = true;
            break;
        }
    }
    assert!(
        silent_first,
        "the silent endpoint never came first in 20 tries"
    );
}

/// Kills member 0, the first URL, before anything connects.
#[tokio::test]
async fn one_of_three_members_down_before_connecting() {
    let mut etcd = Etcd::cluster(14, Security::MutualTls).await;
    etcd.kill_member(0).await;
    // A one-shot read (as `waypoint registry list` does) must not depend on which member
    // the client happens to try first.
    for _ in 0..10 {
        let listing = tokio::time::timeout(REFUSED_WITHIN, reg::snapshot(&connector(&etcd)))
            .await
            .expect("no answer: the client hangs on the dead member")
            .expect("a snapshot with two of three members up");
        assert!(listing.endpoints.is_empty());
    }
    let stop = CancellationToken::new();
    let (r, _) = registrar(connector(&etcd), "a-node-1", &[("reviews-a1", "10.1.0.1")]);
    tokio::spawn(r.run(stop.clone()));
    let (store, metrics) = watch(connector(&etcd), &stop);
    let took = eventually("registered and watched", WAIT, || {
        has_pod(&store, "reviews-a1")
    })
    .await;
    eprintln!("one member down: registered and watched in {took:?}");
    reg::put(
        &mut etcd.client().await,
        &endpoint("b", "b1", "reviews-b1", "10.2.0.1"),
    )
    .await
    .unwrap();
    converges(&store, &etcd).await;
    assert!(metrics.is_connected(), "{}", metrics.detail());
    stop.cancel();
}

/// Kills each member in turn while a watcher and a registrar run: whichever member holds
/// the watch stream (and the lease's keepalive stream) is killed at some point.
#[tokio::test]
async fn members_killed_one_at_a_time_while_watching() {
    let mut etcd = Etcd::cluster(15, Security::MutualTls).await;
    let stop = CancellationToken::new();
    let (r, _) = registrar(connector(&etcd), "a-node-1", &[("reviews-a1", "10.1.0.1")]);
    tokio::spawn(r.run(stop.clone()));
    let (store, metrics) = watch(connector(&etcd), &stop);
    eventually("registered", WAIT, || has_pod(&store, "reviews-a1")).await;
    for i in 0..CLUSTER_SIZE {
        etcd.kill_member(i).await;
        let pod = format!("reviews-b{i}");
        reg::put(
            &mut etcd.client().await,
            &endpoint("b", "b1", &pod, &format!("10.2.0.{}", i + 1)),
        )
        .await
        .unwrap();
        let took = eventually("the write made with a member down", WAIT, || {
            has_pod(&store, &pod)
        })
        .await;
        eprintln!("member {i} killed: a new write reached the store in {took:?}");
        converges(&store, &etcd).await;
        etcd.restart_member(i).await;
    }
    // The watch stream was on one of the killed members: the watcher reconnected (and
    // relisted) at least once, and the registrar's records are still there.
    assert!(metrics.relists("reconnected") >= 1);
    assert!(has_pod(&store, "reviews-a1"));
    assert_eq!(content(&store).len(), 1 + CLUSTER_SIZE);
    stop.cancel();
}

/// A child process killed if the test fails before it stops.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `waypoint` binary as deployed: `--registry` with every member of a TLS cluster
/// whose first member is down, the TLS files from the environment (as the DaemonSet sets
/// them), registering its pods; SIGTERM revokes them.
#[tokio::test]
async fn the_daemon_registers_over_mutual_tls_with_a_member_down() {
    let mut etcd = Etcd::cluster(16, Security::MutualTls).await;
    etcd.kill_member(0).await;
    let pki = etcd.pki().clone();
    let dir = std::env::temp_dir().join(format!("waypoint-tls-daemon-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let local: PathBuf = dir.join("local.json");
    std::fs::write(
        &local,
        r#"{"endpoints": [{"service": "reviews", "namespace": "bookinfo", "pod_ip": "10.1.0.7",
            "pod_name": "reviews-a7", "ports": [9080], "exported": true}]}"#,
    )
    .unwrap();
    let admin = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let mut daemon = KillOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_waypoint"))
            .arg("run")
            .args(["--tunnel-addr", "127.0.0.1:0", "--dataplane", "copy"])
            .args(["--admin-addr", &admin.to_string()])
            .args(["--cluster", "a", "--node-name", "a-node-7"])
            .args([
                "--node-ip",
                "192.168.10.7",
                "--region",
                "eu",
                "--zone",
                "eu-1",
            ])
            .args(["--registry", &etcd.location()])
            .arg("--local-endpoints")
            .arg(&local)
            .env("WAYPOINT_ETCD_CA", &pki.ca)
            .env("WAYPOINT_ETCD_CERT", &pki.client_cert)
            .env("WAYPOINT_ETCD_KEY", &pki.client_key)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .spawn()
            .unwrap(),
    );
    let start = std::time::Instant::now();
    let registered = loop {
        let content = etcd_content(&etcd).await;
        if content.values().any(|e| e.pod_name == "reviews-a7") {
            break content;
        }
        if let Some(status) = daemon.0.try_wait().unwrap() {
            panic!("the daemon exited: {status}");
        }
        assert!(start.elapsed() < WAIT, "the daemon never registered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("daemon: registered {:?} after start", start.elapsed());
    let ep = registered.values().next().unwrap();
    assert_eq!(ep.node_name, "a-node-7");
    assert_eq!(ep.node_ip, Some("192.168.10.7".parse().unwrap()));

    // Ready means synced from etcd, over TLS.
    let readyz = async {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        loop {
            if let Ok(mut s) = tokio::net::TcpStream::connect(admin).await {
                let _ = s.write_all(b"GET /readyz HTTP/1.0\r\n\r\n").await;
                let mut out = String::new();
                let _ = s.read_to_string(&mut out).await;
                if out.contains(" 200 ") {
                    return out;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let body = tokio::time::timeout(WAIT, readyz).await.expect("ready");
    assert!(body.contains("etcd connected"), "{body}");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(daemon.0.id()).unwrap()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = daemon.0.try_wait().unwrap() {
            break status;
        }
        assert!(start.elapsed() < WAIT, "the daemon did not stop on SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status}");
    assert!(
        etcd_content(&etcd).await.is_empty(),
        "the lease was not revoked on SIGTERM"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
