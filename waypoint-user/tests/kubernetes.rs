//! The Kubernetes source against a mocked API server: a small hyper server serving the
//! recorded list and watch responses of waypoint-user/testdata/kubernetes/ (Node, Pod,
//! Service, EndpointSlice lists; watch events as newline-delimited JSON, pushed by each
//! test when its scenario calls for them; a 410 Gone ERROR event; a 500). The kube client
//! is pointed at it with `kube::Config::new`. One test goes on into a real etcd through
//! the Registrar.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
#[path = "common/etcd.rs"]
#[allow(dead_code, reason = "the harness serves several test binaries")]
mod etcd_harness;

use std::{
    collections::HashMap,
    convert::Infallible,
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
    time::Duration,
};

use etcd_harness::{eventually, Etcd};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt as _, Full, StreamBody};
use hyper::{
    body::{Bytes, Frame, Incoming},
    server::conn::http1,
    service::service_fn,
    Request, Response, StatusCode,
};
use hyper_util::rt::TokioIo;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use waypoint::{
    kubernetes::{self, Metrics, Source, Watched},
    registry::{
        etcd::{self as reg, Connector, LocalSet, LocalSource, NodeIdentity, Registrar, TlsArgs},
        metrics::Metrics as RegistryMetrics,
    },
};

const WAIT: Duration = Duration::from_secs(20);
const REVIEWS_V1: &str = "reviews-v1-7d4c9f6b8d-k8v2p";
const REVIEWS_V2: &str = "reviews-v2-6c8b7a9d5e-p4w7z";
const RATINGS: &str = "ratings-v1-5d9ac8b7f4-xq2lm";

fn testdata(name: &str) -> String {
    let path = format!("{}/testdata/kubernetes/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// What the mock serves for one resource.
#[derive(Default)]
struct Resource {
    /// The list body.
    list: String,
    /// Lists still to fail with a 500.
    failures: usize,
    /// Lists served so far.
    lists: usize,
    /// The open watches' bodies.
    watches: Vec<mpsc::UnboundedSender<Bytes>>,
}

type Shared = Arc<Mutex<HashMap<&'static str, Resource>>>;

/// The mocked API server.
struct MockApi {
    addr: SocketAddr,
    state: Shared,
    stop: CancellationToken,
}

fn resource_of(path: &str) -> Option<&'static str> {
    match path {
        "/api/v1/nodes" => Some("nodes"),
        "/api/v1/pods" => Some("pods"),
        "/api/v1/services" => Some("services"),
        "/apis/discovery.k8s.io/v1/endpointslices" => Some("endpointslices"),
        _ => None,
    }
}

fn json(status: StatusCode, body: String) -> Response<UnsyncBoxBody<Bytes, Infallible>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)).boxed_unsync())
        .unwrap()
}

async fn handle(
    state: Shared,
    req: Request<Incoming>,
) -> Result<Response<UnsyncBoxBody<Bytes, Infallible>>, Infallible> {
    let query = req.uri().query().unwrap_or_default().to_owned();
    let Some(name) = resource_of(req.uri().path()) else {
        return Ok(json(StatusCode::NOT_FOUND, testdata("status-500.json")));
    };
    let mut state = state.lock().unwrap();
    let r = state.entry(name).or_default();
    if query.split('&').any(|kv| kv == "watch=true") {
        // A watch: a chunked body the test writes events into.
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        r.watches.push(tx);
        let frames = futures::stream::unfold(rx, |mut rx| async move {
            let chunk = rx.recv().await?;
            Some((Ok::<_, Infallible>(Frame::data(chunk)), rx))
        });
        return Ok(Response::builder()
            .header("content-type", "application/json")
            .body(UnsyncBoxBody::new(StreamBody::new(frames)))
            .unwrap());
    }
    r.lists += 1;
    if r.failures > 0 {
        r.failures -= 1;
        return Ok(json(
            StatusCode::INTERNAL_SERVER_ERROR,
            testdata("status-500.json"),
        ));
    }
    Ok(json(StatusCode::OK, r.list.clone()))
}

impl MockApi {
    /// Serves the recorded lists (nodes.json, pods.json, services.json,
    /// endpointslices.json) on `listener`.
    fn serve(listener: std::net::TcpListener) -> MockApi {
        let addr = listener.local_addr().unwrap();
        let state: Shared = Arc::default();
        {
            let mut s = state.lock().unwrap();
            for (name, file) in [
                ("nodes", "nodes.json"),
                ("pods", "pods.json"),
                ("services", "services.json"),
                ("endpointslices", "endpointslices.json"),
            ] {
                s.entry(name).or_default().list = testdata(file);
            }
        }
        let stop = CancellationToken::new();
        listener.set_nonblocking(true).unwrap();
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let (st, stopped) = (state.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    _ = stopped.cancelled() => return,
                    a = listener.accept() => a.unwrap().0,
                };
                let st = st.clone();
                let stopped = stopped.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(st.clone(), req));
                    let conn = http1::Builder::new().serve_connection(TokioIo::new(stream), svc);
                    tokio::select! {
                        _ = stopped.cancelled() => {}
                        _ = conn => {}
                    }
                });
            }
        });
        MockApi { addr, state, stop }
    }

    fn start() -> MockApi {
        MockApi::serve(std::net::TcpListener::bind("127.0.0.1:0").unwrap())
    }

    fn client(addr: SocketAddr) -> kube::Client {
        let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
        kube::Client::try_from(config).unwrap()
    }

    /// Replaces what lists of `resource` return from now on.
    fn set_list(&self, resource: &'static str, file: &str) {
        self.state.lock().unwrap().entry(resource).or_default().list = testdata(file);
    }

    /// Makes the next `n` lists of `resource` fail with a 500.
    fn fail_lists(&self, resource: &'static str, n: usize) {
        self.state
            .lock()
            .unwrap()
            .entry(resource)
            .or_default()
            .failures = n;
    }

    fn lists(&self, resource: &'static str) -> usize {
        self.state
            .lock()
            .unwrap()
            .entry(resource)
            .or_default()
            .lists
    }

    /// Sends every line of `file` on the open watches of `resource`, waiting for the
    /// watcher to have (re)opened one first.
    async fn push(&self, resource: &'static str, file: &str) {
        let text = testdata(file);
        let start = std::time::Instant::now();
        loop {
            {
                let mut s = self.state.lock().unwrap();
                let r = s.entry(resource).or_default();
                r.watches.retain(|w| !w.is_closed());
                if !r.watches.is_empty() {
                    for w in &r.watches {
                        for line in text.lines() {
                            let _ = w.send(Bytes::from(format!("{line}\n")));
                        }
                    }
                    return;
                }
            }
            assert!(start.elapsed() < WAIT, "no watch of {resource} was opened");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Ends the open watches of `resource` (as an API server does at its timeout or when
    /// a connection breaks).
    fn close_watches(&self, resource: &'static str) {
        self.state
            .lock()
            .unwrap()
            .entry(resource)
            .or_default()
            .watches
            .clear();
    }
}

impl Drop for MockApi {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn flags() -> NodeIdentity {
    NodeIdentity {
        cluster: "a".into(),
        node: "node-a".into(),
        node_ip: None,
        region: String::new(),
        zone: String::new(),
    }
}

/// A source reading from the API at `addr`, settling fast for tests.
fn source(
    addr: SocketAddr,
    flags: NodeIdentity,
    stop: &CancellationToken,
) -> (watch::Receiver<Option<LocalSet>>, Metrics) {
    let metrics = Metrics::unregistered();
    let mut config = kubernetes::Config::new(flags);
    config.settle = Duration::from_millis(20);
    let rx = Source::new(MockApi::client(addr), config, metrics.clone()).spawn(stop.clone());
    (rx, metrics)
}

/// Waits until the published set satisfies `cond`; returns it.
async fn until(
    rx: &mut watch::Receiver<Option<LocalSet>>,
    what: &str,
    cond: impl Fn(&LocalSet) -> bool,
) -> LocalSet {
    let got = tokio::time::timeout(WAIT, rx.wait_for(|s| s.as_ref().is_some_and(&cond)))
        .await
        .map(|r| r.expect("the source stopped").clone());
    match got {
        Ok(set) => set.expect("wait_for saw a set"),
        Err(_) => panic!(
            "timed out waiting for {what}; last set: {:#?}",
            *rx.borrow()
        ),
    }
}

fn pods(set: &LocalSet) -> Vec<(&str, bool)> {
    set.endpoints
        .iter()
        .map(|e| (e.pod_name.as_str(), e.ready))
        .collect()
}

fn ip(s: &str) -> Option<IpAddr> {
    Some(s.parse().unwrap())
}

#[tokio::test]
async fn pod_lifecycle_add_ready_unready_delete() {
    let api = MockApi::start();
    let stop = CancellationToken::new();
    let (mut rx, metrics) = source(api.addr, flags(), &stop);

    // The initial lists: the ratings pod, ready, of a service without the annotation:
    // registered, not exported (the cluster's own sources may still dial it directly; the
    // split horizon and the router leave it out for everyone else). node-b's reviews pod
    // in the slice is not this node's.
    let set = until(&mut rx, "the initial set", |s| !s.endpoints.is_empty()).await;
    assert_eq!(
        set.identity.node_ip,
        ip("192.168.10.7"),
        "the Node's InternalIP"
    );
    assert_eq!(set.identity.region, "eu-west-1", "the Node's region label");
    assert_eq!(set.identity.zone, "eu-west-1a", "the Node's zone label");
    assert_eq!(set.identity.cluster, "a");
    assert_eq!(set.endpoints.len(), 1, "{set:#?}");
    let ratings = &set.endpoints[0];
    assert_eq!(ratings.pod_name, RATINGS);
    assert_eq!(ratings.service, "ratings");
    assert_eq!(ratings.pod_ip, "10.1.0.4".parse::<IpAddr>().unwrap());
    assert_eq!(ratings.service_account, "bookinfo-ratings");
    assert_eq!(ratings.ports, vec![9080]);
    assert!(ratings.ready);
    assert!(!ratings.exported, "no waypoint.dev/export annotation");

    // Added, pending, no IP yet: nothing to register.
    let computed = metrics.recomputes();
    api.push("pods", "pod-added-pending.ndjson").await;
    eventually("the pending pod's event", WAIT, || {
        metrics.events(Watched::Pod, "apply") >= 1
    })
    .await;
    // The desired set was computed again with the pending pod in the state.
    eventually("a recompute after the pending pod", WAIT, || {
        metrics.recomputes() > computed
    })
    .await;
    assert_eq!(pods(rx.borrow().as_ref().unwrap()), vec![(RATINGS, true)]);

    // Running with an IP and ready in the slice: registered, ready, exported, the named
    // target port resolved through the container port.
    api.push("pods", "pod-running-ready.ndjson").await;
    api.push("endpointslices", "slice-reviews-ready.ndjson")
        .await;
    let set = until(&mut rx, "reviews ready", |s| {
        pods(s) == [(RATINGS, true), (REVIEWS_V1, true)]
    })
    .await;
    let reviews = &set.endpoints[1];
    assert_eq!(reviews.service, "reviews");
    assert_eq!(reviews.pod_ip, "10.1.0.7".parse::<IpAddr>().unwrap());
    assert_eq!(reviews.service_account, "bookinfo-reviews");
    assert_eq!(reviews.ports, vec![9080], "targetPort \"http\" resolved");
    assert!(reviews.exported);
    assert_eq!(set.identity.node_ip, ip("192.168.10.7"));
    assert_eq!(metrics.desired(), 2);

    // Unready in the slice: still registered, ready=false (the split horizon counts it
    // as not_ready; the router skips it).
    api.push("pods", "pod-unready.ndjson").await;
    api.push("endpointslices", "slice-reviews-unready.ndjson")
        .await;
    until(&mut rx, "reviews unready", |s| {
        pods(s) == [(RATINGS, true), (REVIEWS_V1, false)]
    })
    .await;

    // Deleted: gone.
    api.push("pods", "pod-deleted.ndjson").await;
    api.push("endpointslices", "slice-reviews-removed.ndjson")
        .await;
    until(&mut rx, "reviews removed", |s| pods(s) == [(RATINGS, true)]).await;
    assert!(metrics.events(Watched::Pod, "delete") >= 1);
    assert_eq!(metrics.errors(Watched::Pod), 0);
    stop.cancel();
}

#[tokio::test]
async fn node_ip_change_and_flag_precedence() {
    let api = MockApi::start();
    let stop = CancellationToken::new();
    let (mut rx, _) = source(api.addr, flags(), &stop);
    until(&mut rx, "the initial set", |s| {
        s.identity.node_ip == ip("192.168.10.7")
    })
    .await;
    api.push("nodes", "node-ip-changed.ndjson").await;
    let set = until(&mut rx, "the new node IP", |s| {
        s.identity.node_ip == ip("192.168.10.8")
    })
    .await;
    assert_eq!(pods(&set), vec![(RATINGS, true)], "same endpoints");

    // --node-ip, --region and --zone win over the Node.
    let pinned = NodeIdentity {
        node_ip: ip("10.200.0.1"),
        region: "flag-region".into(),
        zone: "flag-zone".into(),
        ..flags()
    };
    let (mut rx, _) = source(api.addr, pinned, &stop);
    let set = until(&mut rx, "the pinned identity", |_| true).await;
    assert_eq!(set.identity.node_ip, ip("10.200.0.1"));
    assert_eq!(set.identity.region, "flag-region");
    assert_eq!(set.identity.zone, "flag-zone");

    // A Node that does not exist (wrong --node-name): node IP unknown, pods still
    // listed (none on that node name in a real API server; the mock ignores the field
    // selector, and the pure function drops them).
    let ghost = NodeIdentity {
        node: "node-zz".into(),
        ..flags()
    };
    let (mut rx, _) = source(api.addr, ghost, &stop);
    let set = until(&mut rx, "the ghost node's set", |_| true).await;
    assert_eq!(set.identity.node_ip, None, "unknown: empty, never made up");
    assert!(set.endpoints.is_empty());
    stop.cancel();
}

#[tokio::test]
async fn gone_relists_and_converges() {
    let api = MockApi::start();
    let stop = CancellationToken::new();
    let (mut rx, metrics) = source(api.addr, flags(), &stop);
    until(&mut rx, "the initial set", |s| pods(s) == [(RATINGS, true)]).await;
    assert_eq!(api.lists("pods"), 1);

    // While the watches were behind, ratings went away and reviews-v2 came up: the API
    // server answers the stale watches with 410 Gone, the relists bring the truth.
    api.set_list("pods", "pods-relisted.json");
    api.set_list("endpointslices", "endpointslices-relisted.json");
    api.push("pods", "watch-gone.ndjson").await;
    api.push("endpointslices", "watch-gone.ndjson").await;
    let set = until(&mut rx, "the relisted set", |s| {
        pods(s) == [(REVIEWS_V2, true)]
    })
    .await;
    assert_eq!(
        set.endpoints[0].pod_ip,
        "10.1.0.9".parse::<IpAddr>().unwrap()
    );
    assert_eq!(set.identity.node_ip, ip("192.168.10.7"));
    assert!(api.lists("pods") >= 2, "pods were relisted");
    assert!(metrics.errors(Watched::Pod) >= 1, "the 410 is counted");
    assert!(metrics.errors(Watched::EndpointSlice) >= 1);
    eventually("relists counted", WAIT, || {
        metrics.relists(Watched::Pod) >= 1 && metrics.relists(Watched::EndpointSlice) >= 1
    })
    .await;

    // A watch that just ends (API server timeout, connection closed) is resumed from its
    // resource version, without a relist, and keeps delivering.
    let lists = api.lists("pods");
    api.close_watches("pods");
    api.push("pods", "pod-running-ready.ndjson").await;
    api.push("endpointslices", "slice-reviews-ready.ndjson")
        .await;
    until(&mut rx, "reviews-v1 after the resumed watch", |s| {
        pods(s).contains(&(REVIEWS_V1, true))
    })
    .await;
    assert_eq!(api.lists("pods"), lists, "resumed, not relisted");
    stop.cancel();
}

#[tokio::test]
async fn api_errors_back_off_and_converge() {
    // The API server is down at start: nothing is published (the registrar writes
    // nothing) until it is up and every set is listed.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let stop = CancellationToken::new();
    let (mut rx, metrics) = source(addr, flags(), &stop);
    eventually("connection errors counted", WAIT, || {
        Watched::ALL.iter().all(|w| metrics.errors(*w) >= 1)
    })
    .await;
    assert!(rx.borrow().is_none(), "nothing published before the lists");

    // Up, but the services list fails with a 500 twice: the others are listed, the
    // services retried with backoff, then everything converges.
    let api = MockApi::serve(std::net::TcpListener::bind(addr).unwrap());
    api.fail_lists("services", 2);
    let set = until(&mut rx, "the set after the outage", |s| {
        pods(s) == [(RATINGS, true)]
    })
    .await;
    assert_eq!(set.identity.node_ip, ip("192.168.10.7"));
    assert!(api.lists("services") >= 3, "two 500s, then a good list");
    assert!(metrics.errors(Watched::Service) >= 3, "refused, 500, 500");
    stop.cancel();
}

fn connector(etcd: &Etcd) -> Connector {
    Connector::new(vec![etcd.url()], &TlsArgs::default()).unwrap()
}

/// The records etcd holds, by pod name: (node IP, ready, exported).
async fn records(etcd: &Etcd) -> Vec<(String, Option<IpAddr>, bool, bool)> {
    let listing = reg::snapshot(&connector(etcd)).await.unwrap();
    let mut out: Vec<_> = listing
        .endpoints
        .into_values()
        .map(|e| (e.pod_name, e.node_ip, e.ready, e.exported))
        .collect();
    out.sort();
    out
}

async fn etcd_until(etcd: &Etcd, what: &str, want: &[(&str, Option<IpAddr>, bool, bool)]) {
    let start = std::time::Instant::now();
    loop {
        let got = records(etcd).await;
        let same = got.len() == want.len()
            && got
                .iter()
                .zip(want)
                .all(|(g, w)| (g.0.as_str(), g.1, g.2, g.3) == *w);
        if same {
            return;
        }
        assert!(start.elapsed() < WAIT, "etcd never held {what}: {got:#?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn registers_into_etcd_with_the_node_ip() {
    let etcd = Etcd::start(7).await;
    let api = MockApi::start();
    let stop = CancellationToken::new();
    let (rx, _) = source(api.addr, flags(), &stop);
    let registry_metrics = RegistryMetrics::unregistered();
    let registrar = Registrar::new(
        connector(&etcd),
        // Ignored for a live source: each set carries the identity.
        flags(),
        LocalSource::Watch(rx),
        Duration::from_secs(5),
        registry_metrics.clone(),
    );
    let registering = tokio::spawn(registrar.run(stop.clone()));

    let old = ip("192.168.10.7");
    etcd_until(&etcd, "ratings", &[(RATINGS, old, true, false)]).await;
    let listing = reg::snapshot(&connector(&etcd)).await.unwrap();
    let (key, rec) = listing.endpoints.iter().next().unwrap();
    assert_eq!(
        key,
        "/aether/v1/regions/eu-west-1/clusters/a/nodes/node-a/endpoints/bookinfo/ratings/ratings-v1-5d9ac8b7f4-xq2lm"
    );
    assert_eq!(rec.zone, "eu-west-1a");

    api.push("pods", "pod-running-ready.ndjson").await;
    api.push("endpointslices", "slice-reviews-ready.ndjson")
        .await;
    etcd_until(
        &etcd,
        "ratings and reviews",
        &[(RATINGS, old, true, false), (REVIEWS_V1, old, true, true)],
    )
    .await;

    // The node's InternalIP changes: every record is rewritten with the new one.
    let new = ip("192.168.10.8");
    api.push("nodes", "node-ip-changed.ndjson").await;
    etcd_until(
        &etcd,
        "the new node IP everywhere",
        &[(RATINGS, new, true, false), (REVIEWS_V1, new, true, true)],
    )
    .await;

    api.push("pods", "pod-deleted.ndjson").await;
    api.push("endpointslices", "slice-reviews-removed.ndjson")
        .await;
    etcd_until(&etcd, "reviews deleted", &[(RATINGS, new, true, false)]).await;
    assert_eq!(registry_metrics.lease_grants(), 1);

    // Shutdown revokes the lease: the node's records go at once.
    stop.cancel();
    registering.await.unwrap();
    etcd_until(&etcd, "nothing after the revoke", &[]).await;
}
