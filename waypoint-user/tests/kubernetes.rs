//! The Kubernetes source against a fake API server (tests/common/fake_api.rs) holding
//! k8s-openapi objects that each test builds (tests/common/k8s_objects.rs) and writes
//! while the source runs. As on a real API server, every write moves the
//! resourceVersion, watches resume from the last version they saw, bookmarks move it, a
//! compacted history answers a watch or a list page with 410 Gone, and field selectors
//! filter. Two tests go on into a real etcd through the Registrar; one of them on through
//! a daemon watching it, the split-horizon view, the Envoy configuration and a routed
//! connection.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
#[path = "common/etcd.rs"]
#[allow(dead_code, reason = "the harness serves several test binaries")]
mod etcd_harness;
#[path = "common/fake_api.rs"]
mod fake_api;
#[path = "common/k8s_objects.rs"]
mod k8s_objects;

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use etcd_harness::{eventually, Etcd};
use fake_api::FakeApi;
use k8s_objects::{endpoint, exported, named, node, pod, port, running, scheduled, service, slice};
use k8s_openapi::api::{
    core::v1::{Node, Pod, Service},
    discovery::v1::{Endpoint, EndpointSlice},
};
use k8s_openapi::ListableResource;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use waypoint::{
    kubernetes::{self, Metrics, Source, Watched},
    registry::{
        etcd::{self as reg, Connector, LocalSet, LocalSource, NodeIdentity, Registrar, TlsArgs},
        metrics::Metrics as RegistryMetrics,
    },
};

const WAIT: Duration = Duration::from_secs(20);
const NS: &str = "bookinfo";
const NODE: &str = "node-a";
const REVIEWS_V1: &str = "reviews-v1-7d4c9f6b8d-k8v2p";
/// node-b's reviews pod: in the reviews slice, never this node's.
const REVIEWS_V1_B: &str = "reviews-v1-7d4c9f6b8d-zz9rt";
const REVIEWS_V2: &str = "reviews-v2-6c8b7a9d5e-p4w7z";
const RATINGS: &str = "ratings-v1-5d9ac8b7f4-xq2lm";

fn node_a(ip: &str) -> Node {
    node(NODE, ip, "eu-west-1", "eu-west-1a")
}

fn ratings_pod() -> Pod {
    let labels = [("app", "ratings"), ("version", "v1")];
    pod(NS, RATINGS, &labels, "bookinfo-ratings", &[("http", 8080)])
}

fn reviews_pod(name: &str) -> Pod {
    pod(
        NS,
        name,
        &[("app", "reviews")],
        "bookinfo-reviews",
        &[("http", 9080)],
    )
}

/// ratings: service port 80, target port 8080 by number; not exported.
fn ratings_service() -> Service {
    service(NS, "ratings", &[("app", "ratings")], &[(80, port(8080))])
}

/// reviews: service port 9080, target port by container port name; exported.
fn reviews_service() -> Service {
    exported(&service(
        NS,
        "reviews",
        &[("app", "reviews")],
        &[(9080, named("http"))],
    ))
}

fn ratings_slice(endpoints: Vec<Endpoint>) -> EndpointSlice {
    slice(NS, "ratings", "ratings-7lq4d", &[(None, 8080)], endpoints)
}

fn reviews_slice(endpoints: Vec<Endpoint>) -> EndpointSlice {
    slice(NS, "reviews", "reviews-x7k2c", &[(None, 9080)], endpoints)
}

/// An endpoint of pod `name` on this node.
fn here(name: &str, ip: &str, ready: bool) -> Endpoint {
    endpoint(NS, name, ip, NODE, ready)
}

fn reviews_b() -> Endpoint {
    endpoint(NS, REVIEWS_V1_B, "10.1.1.5", "node-b", true)
}

/// The cluster every test starts from: node-a (192.168.10.7, eu-west-1/eu-west-1a) and
/// node-b; ratings running and ready on node-a, a reviews pod on node-b; the Services
/// kubernetes, ratings and reviews, and the slices of the last two.
fn bookinfo(api: &FakeApi) {
    api.apply(&node_a("192.168.10.7"));
    api.apply(&node("node-b", "192.168.10.9", "eu-west-1", "eu-west-1b"));
    api.apply(&running(&scheduled(&ratings_pod(), NODE), "10.1.0.4", true));
    let b = scheduled(&reviews_pod(REVIEWS_V1_B), "node-b");
    api.apply(&running(&b, "10.1.1.5", true));
    api.apply(&service("default", "kubernetes", &[], &[(443, port(6443))]));
    api.apply(&ratings_service());
    api.apply(&reviews_service());
    api.apply(&ratings_slice(vec![here(RATINGS, "10.1.0.4", true)]));
    api.apply(&reviews_slice(vec![reviews_b()]));
}

fn flags() -> NodeIdentity {
    NodeIdentity {
        cluster: "a".into(),
        node: NODE.into(),
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
    let rx = Source::new(fake_api::client(addr), config, metrics.clone()).spawn(stop.clone());
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

/// The resourceVersions the watches of `K` started from, in order.
fn watched_from<K: ListableResource>(api: &FakeApi) -> Vec<u64> {
    let from = |r: &fake_api::Request| r.param("resourceVersion").unwrap().parse().unwrap();
    api.watches::<K>().iter().map(from).collect()
}

/// How many watches of each kind were answered, in [`Watched::ALL`] order.
fn watch_counts(api: &FakeApi) -> [usize; 4] {
    [
        api.watches::<Node>().len(),
        api.watches::<Pod>().len(),
        api.watches::<Service>().len(),
        api.watches::<EndpointSlice>().len(),
    ]
}

/// How many lists (pages) of each kind were answered, in [`Watched::ALL`] order.
fn list_counts(api: &FakeApi) -> [usize; 4] {
    [
        api.lists::<Node>().len(),
        api.lists::<Pod>().len(),
        api.lists::<Service>().len(),
        api.lists::<EndpointSlice>().len(),
    ]
}

#[tokio::test]
async fn pod_lifecycle_add_ready_unready_delete() {
    let api = FakeApi::start();
    bookinfo(&api);
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
    assert_eq!(
        ratings.ports,
        vec![8080],
        "the target port, not the service port 80"
    );
    assert!(ratings.ready);
    assert!(!ratings.exported, "no waypoint.dev/export annotation");

    // Created by its ReplicaSet, unscheduled: not in this node's pod watch (its field
    // selector). Bound here, pending, no IP yet: seen, nothing to register.
    let computed = metrics.recomputes();
    let reviews = reviews_pod(REVIEWS_V1);
    api.apply(&reviews);
    let reviews = scheduled(&reviews, NODE);
    api.apply(&reviews);
    eventually("the bound pod's event", WAIT, || {
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
    api.apply(&running(&reviews, "10.1.0.7", true));
    api.apply(&reviews_slice(vec![
        here(REVIEWS_V1, "10.1.0.7", true),
        reviews_b(),
    ]));
    let set = until(&mut rx, "reviews ready", |s| {
        pods(s) == [(RATINGS, true), (REVIEWS_V1, true)]
    })
    .await;
    let reviews_ep = &set.endpoints[1];
    assert_eq!(reviews_ep.service, "reviews");
    assert_eq!(reviews_ep.pod_ip, "10.1.0.7".parse::<IpAddr>().unwrap());
    assert_eq!(reviews_ep.service_account, "bookinfo-reviews");
    assert_eq!(reviews_ep.ports, vec![9080], "targetPort \"http\" resolved");
    assert!(reviews_ep.exported);
    assert_eq!(set.identity.node_ip, ip("192.168.10.7"));
    assert_eq!(metrics.desired(), 2);
    assert_eq!(
        metrics.events(Watched::Pod, "apply"),
        2,
        "bound and running; the unscheduled pod was never this node's"
    );

    // Unready in the slice: still registered, ready=false (the split horizon counts it
    // as not_ready; the router skips it).
    api.apply(&running(&reviews, "10.1.0.7", false));
    api.apply(&reviews_slice(vec![
        here(REVIEWS_V1, "10.1.0.7", false),
        reviews_b(),
    ]));
    until(&mut rx, "reviews unready", |s| {
        pods(s) == [(RATINGS, true), (REVIEWS_V1, false)]
    })
    .await;

    // Deleted: gone.
    api.delete(&reviews);
    api.apply(&reviews_slice(vec![reviews_b()]));
    until(&mut rx, "reviews removed", |s| pods(s) == [(RATINGS, true)]).await;
    assert_eq!(metrics.events(Watched::Pod, "delete"), 1);
    for w in Watched::ALL {
        assert_eq!(metrics.errors(w), 0, "{w:?}");
        assert_eq!(metrics.relists(w), 0, "{w:?}");
    }
    assert_eq!(list_counts(&api), [1; 4], "listed once, then only watched");
    stop.cancel();
}

#[tokio::test]
async fn node_ip_change_and_flag_precedence() {
    let api = FakeApi::start();
    bookinfo(&api);
    let stop = CancellationToken::new();
    let (mut rx, metrics) = source(api.addr, flags(), &stop);
    until(&mut rx, "the initial set", |s| {
        s.identity.node_ip == ip("192.168.10.7")
    })
    .await;
    // node-b changing is not this node's business: its watch does not even see it.
    api.apply(&node("node-b", "192.168.10.99", "eu-west-1", "eu-west-1b"));
    api.apply(&node_a("192.168.10.8"));
    let set = until(&mut rx, "the new node IP", |s| {
        s.identity.node_ip == ip("192.168.10.8")
    })
    .await;
    assert_eq!(pods(&set), vec![(RATINGS, true)], "same endpoints");
    assert_eq!(
        metrics.events(Watched::Node, "apply"),
        1,
        "node-a's change only"
    );

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

    // A Node that does not exist (wrong --node-name): node IP unknown, and no pods (the
    // API server filters them by node name).
    let ghost = NodeIdentity {
        node: "node-zz".into(),
        ..flags()
    };
    let (mut rx, _) = source(api.addr, ghost, &stop);
    let set = until(&mut rx, "the ghost node's set", |_| true).await;
    assert_eq!(set.identity.node_ip, None, "unknown: empty, never made up");
    assert!(set.endpoints.is_empty());
    let selectors: Vec<_> = api
        .lists::<Pod>()
        .iter()
        .filter_map(|r| r.param("fieldSelector").map(str::to_owned))
        .collect();
    assert!(
        selectors.contains(&"spec.nodeName=node-zz".to_owned()),
        "{selectors:?}"
    );
    stop.cancel();
}

#[tokio::test]
async fn watch_restart_after_compaction_relists_and_converges() {
    let api = FakeApi::start();
    bookinfo(&api);
    let stop = CancellationToken::new();
    let (mut rx, metrics) = source(api.addr, flags(), &stop);
    until(&mut rx, "the initial set", |s| pods(s) == [(RATINGS, true)]).await;
    api.until_watching().await;
    assert_eq!(list_counts(&api), [1; 4]);

    // Cut off, while ratings is deleted and reviews-v2 comes up; then etcd compacts, so
    // the watches cannot resume: the API server answers each with a 410 Gone, and only
    // the relists can tell that ratings went (no watch ever carries its deletion).
    let cut = api.partition();
    let ratings = scheduled(&ratings_pod(), NODE);
    api.delete(&ratings);
    api.apply(&ratings_slice(vec![]));
    let v2 = scheduled(&reviews_pod(REVIEWS_V2), NODE);
    api.apply(&v2);
    api.apply(&running(&v2, "10.1.0.9", true));
    api.apply(&reviews_slice(vec![
        here(REVIEWS_V2, "10.1.0.9", true),
        reviews_b(),
    ]));
    api.compact();
    drop(cut);

    let set = until(&mut rx, "the relisted set", |s| {
        pods(s) == [(REVIEWS_V2, true)]
    })
    .await;
    assert_eq!(
        set.endpoints[0].pod_ip,
        "10.1.0.9".parse::<IpAddr>().unwrap()
    );
    assert_eq!(set.identity.node_ip, ip("192.168.10.7"));
    assert_eq!(
        metrics.events(Watched::Pod, "delete"),
        0,
        "the deletion was learnt from the relist"
    );
    // Every kind was behind the compaction: each one's resumed watch got the 410, was
    // counted as an error, and the kind relisted once.
    eventually("every kind relisted", WAIT, || {
        Watched::ALL.iter().all(|w| metrics.relists(*w) == 1)
    })
    .await;
    let gone = |r: &[fake_api::Request]| r.iter().filter(|r| r.code == 410).count();
    assert_eq!(gone(&api.watches::<Node>()), 1);
    assert_eq!(gone(&api.watches::<Pod>()), 1);
    assert_eq!(gone(&api.watches::<Service>()), 1);
    assert_eq!(gone(&api.watches::<EndpointSlice>()), 1);
    assert_eq!(list_counts(&api), [2; 4], "listed, then relisted once");
    for w in Watched::ALL {
        assert_eq!(metrics.errors(w), 1, "the 410 of {w:?}");
    }

    // After the relist the watches follow again, from the relist's version.
    api.apply(&running(&v2, "10.1.0.9", false));
    api.apply(&reviews_slice(vec![
        here(REVIEWS_V2, "10.1.0.9", false),
        reviews_b(),
    ]));
    until(&mut rx, "reviews-v2 unready", |s| {
        pods(s) == [(REVIEWS_V2, false)]
    })
    .await;
    stop.cancel();
}

#[tokio::test]
async fn an_ended_watch_resumes_from_its_last_resource_version() {
    let api = FakeApi::start();
    bookinfo(&api);
    let listed = api.resource_version();
    let stop = CancellationToken::new();
    let (mut rx, metrics) = source(api.addr, flags(), &stop);
    until(&mut rx, "the initial set", |s| pods(s) == [(RATINGS, true)]).await;
    api.until_watching().await;
    assert_eq!(watched_from::<Pod>(&api), [listed], "the list's version");

    let reviews = scheduled(&reviews_pod(REVIEWS_V1), NODE);
    let bound = api.apply(&reviews);
    eventually("the bound pod's event", WAIT, || {
        metrics.events(Watched::Pod, "apply") == 1
    })
    .await;

    // The API server ends the pod watch (its timeout): resumed from the last event.
    api.end_watches::<Pod>();
    eventually("the pod watch resumed", WAIT, || {
        api.watches::<Pod>().len() == 2
    })
    .await;
    assert_eq!(watched_from::<Pod>(&api), [listed, bound]);

    // Cut off while the pod runs and its slice says ready: every watch resumes from the
    // last version it saw, and the API server replays what it missed.
    let cut = api.partition();
    api.apply(&running(&reviews, "10.1.0.7", true));
    api.apply(&reviews_slice(vec![
        here(REVIEWS_V1, "10.1.0.7", true),
        reviews_b(),
    ]));
    drop(cut);
    until(&mut rx, "reviews after the resumed watches", |s| {
        pods(s) == [(RATINGS, true), (REVIEWS_V1, true)]
    })
    .await;
    eventually("every watch resumed", WAIT, || {
        watch_counts(&api) == [2, 3, 2, 2]
    })
    .await;
    assert_eq!(watched_from::<Pod>(&api), [listed, bound, bound]);
    assert_eq!(watched_from::<EndpointSlice>(&api), [listed, listed]);
    assert_eq!(watched_from::<Node>(&api), [listed, listed]);
    assert_eq!(list_counts(&api), [1; 4], "resumed, never relisted");
    for w in Watched::ALL {
        assert_eq!(metrics.relists(w), 0, "{w:?}");
    }
    stop.cancel();
}

#[tokio::test]
async fn bookmarks_move_the_resume_point_and_leave_the_state_alone() {
    let api = FakeApi::start();
    bookinfo(&api);
    let listed = api.resource_version();
    let stop = CancellationToken::new();
    let (mut rx, metrics) = source(api.addr, flags(), &stop);
    let initial = until(&mut rx, "the initial set", |s| pods(s) == [(RATINGS, true)]).await;
    api.until_watching().await;
    for w in api.watches::<Pod>() {
        assert_eq!(w.param("allowWatchBookmarks"), Some("true"), "{w:?}");
    }

    // The cluster moves on where this node's watches do not look (node-b's Node and
    // pod); a bookmark tells them how far.
    api.apply(&node("node-b", "192.168.10.9", "eu-west-1", "eu-west-1c"));
    let b = scheduled(&reviews_pod(REVIEWS_V1_B), "node-b");
    api.apply(&running(&b, "10.1.1.6", true));
    let computed = metrics.recomputes();
    api.bookmark();
    let marked = api.resource_version();
    assert!(marked > listed);

    // Compacted past the lists: the watches resume from the bookmark, not from the
    // lists' version, so nothing is gone and nothing relists.
    let cut = api.partition();
    api.compact();
    drop(cut);
    eventually("every watch resumed", WAIT, || watch_counts(&api) == [2; 4]).await;
    assert_eq!(watched_from::<Node>(&api), [listed, marked]);
    assert_eq!(watched_from::<Pod>(&api), [listed, marked]);
    assert_eq!(watched_from::<Service>(&api), [listed, marked]);
    assert_eq!(watched_from::<EndpointSlice>(&api), [listed, marked]);
    assert!(api.watches::<Pod>().iter().all(|w| w.code == 200));
    assert_eq!(list_counts(&api), [1; 4]);
    for w in Watched::ALL {
        assert_eq!(metrics.errors(w), 0, "{w:?}");
        assert_eq!(metrics.relists(w), 0, "{w:?}");
        assert_eq!(metrics.events(w, "apply"), 0, "{w:?}");
        assert_eq!(metrics.events(w, "delete"), 0, "{w:?}");
    }
    assert_eq!(metrics.recomputes(), computed, "a bookmark changes nothing");
    assert_eq!(rx.borrow().as_ref(), Some(&initial));

    // And the resumed watches deliver.
    api.apply(&node_a("192.168.10.8"));
    until(&mut rx, "the new node IP", |s| {
        s.identity.node_ip == ip("192.168.10.8")
    })
    .await;
    stop.cancel();
}

#[tokio::test]
async fn an_expired_list_continue_starts_the_list_again() {
    // More Services than a page (the watcher asks 500 at a time): their namespace sorts
    // before bookinfo, so bookinfo's come on the last page.
    let api = FakeApi::start();
    for i in 0..1000 {
        let name = format!("filler-{i:04}");
        api.apply(&service(
            "a-filler",
            &name,
            &[("app", "filler")],
            &[(80, port(8080))],
        ));
    }
    bookinfo(&api);
    // Between the first page and the next, ratings is exported and etcd compacts: the
    // continue token expires (410) and the watcher lists from the start.
    api.after_first_page::<Service>(|c| {
        c.apply(&exported(&ratings_service()));
        c.compact();
    });
    let stop = CancellationToken::new();
    let (mut rx, metrics) = source(api.addr, flags(), &stop);
    let set = until(&mut rx, "the first set", |_| true).await;
    assert_eq!(
        pods(&set),
        [(RATINGS, true)],
        "a Service of the last page selects it"
    );
    assert!(
        set.endpoints[0].exported,
        "nothing is published from the expired list"
    );
    assert_eq!(
        metrics.events(Watched::Service, "apply"),
        0,
        "the export came in with the second list"
    );
    let lists = api.lists::<Service>();
    let expired: Vec<_> = lists.iter().filter(|r| r.code == 410).collect();
    assert_eq!(expired.len(), 1, "{lists:#?}");
    assert!(expired[0].param("continue").is_some());
    assert_eq!(lists.len(), 5, "a page, the expired page, then three pages");
    assert!(lists.iter().all(|r| r.param("limit") == Some("500")));
    assert!(metrics.errors(Watched::Service) >= 1);
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
    // services retried with backoff, then everything converges. (The test's runtime
    // has one thread: nothing is served before the objects are in.)
    let api = FakeApi::serve(std::net::TcpListener::bind(addr).unwrap());
    bookinfo(&api);
    api.fail_lists::<Service>(2);
    let set = until(&mut rx, "the set after the outage", |s| {
        pods(s) == [(RATINGS, true)]
    })
    .await;
    assert_eq!(set.identity.node_ip, ip("192.168.10.7"));
    let codes: Vec<_> = api.lists::<Service>().iter().map(|r| r.code).collect();
    assert_eq!(codes, [500, 500, 200], "two 500s, then a good list");
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
    let api = FakeApi::start();
    bookinfo(&api);
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

    let reviews = running(&scheduled(&reviews_pod(REVIEWS_V1), NODE), "10.1.0.7", true);
    api.apply(&reviews);
    api.apply(&reviews_slice(vec![
        here(REVIEWS_V1, "10.1.0.7", true),
        reviews_b(),
    ]));
    etcd_until(
        &etcd,
        "ratings and reviews",
        &[(RATINGS, old, true, false), (REVIEWS_V1, old, true, true)],
    )
    .await;

    // The node's InternalIP changes: every record is rewritten with the new one.
    let new = ip("192.168.10.8");
    api.apply(&node_a("192.168.10.8"));
    etcd_until(
        &etcd,
        "the new node IP everywhere",
        &[(RATINGS, new, true, false), (REVIEWS_V1, new, true, true)],
    )
    .await;

    api.delete(&reviews);
    api.apply(&reviews_slice(vec![reviews_b()]));
    etcd_until(&etcd, "reviews deleted", &[(RATINGS, new, true, false)]).await;
    assert_eq!(registry_metrics.lease_grants(), 1);

    // Shutdown revokes the lease: the node's records go at once.
    stop.cancel();
    registering.await.unwrap();
    etcd_until(&etcd, "nothing after the revoke", &[]).await;
}

#[derive(clap::Parser)]
struct DaemonArgs {
    #[command(flatten)]
    config: waypoint::config::Config,
}

/// A Service whose port (80) differs from its named target port (`http`, 8080 on the
/// pod), end to end: the Kubernetes source registers the mapping into etcd; a daemon
/// watching etcd resolves `web.bookinfo:80` for another cluster to this node's waypoint
/// with the SNI of pod port 8080; the Envoy configuration dials it with that SNI; and a
/// ClientHello with it, sent to the daemon's tunnel, reaches the pod unchanged. The pod
/// port alone (8080) names no service port.
#[tokio::test]
async fn a_service_port_reaches_the_pod_port_behind_it_end_to_end() {
    use clap::Parser as _;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use waypoint::horizon::{self, Mode, Query, Viewer};

    let etcd = Etcd::start(8).await;
    let api = FakeApi::start();
    // The pod's inbound, on a loopback address of its own.
    let pod_inbound = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
    let pod_port = pod_inbound.local_addr().unwrap().port().to_string();
    api.apply(&node_a("127.0.0.1"));
    let web = pod(NS, "web-1", &[("app", "web")], "web", &[("http", 8080)]);
    api.apply(&running(&scheduled(&web, NODE), "127.0.0.2", true));
    api.apply(&exported(&service(
        NS,
        "web",
        &[("app", "web")],
        &[(80, named("http"))],
    )));
    api.apply(&slice(
        NS,
        "web",
        "web-5fz8q",
        &[(None, 8080)],
        vec![here("web-1", "127.0.0.2", true)],
    ));
    let stop = CancellationToken::new();
    let (rx, _) = source(api.addr, flags(), &stop);
    let registrar = Registrar::new(
        connector(&etcd),
        flags(),
        LocalSource::Watch(rx),
        Duration::from_secs(5),
        RegistryMetrics::unregistered(),
    );
    let registering = tokio::spawn(registrar.run(stop.clone()));

    let registry = etcd.location();
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
        NODE,
        "--registry",
        &registry,
        "--pod-port",
        &pod_port,
    ];
    let app = waypoint::app::App::start(DaemonArgs::try_parse_from(argv).unwrap().config)
        .await
        .unwrap();
    eventually("the pod's record in the daemon's store", WAIT, || {
        app.store.snapshot().all().any(|e| e.pod_name == "web-1")
    })
    .await;
    let endpoints: Vec<waypoint::model::Endpoint> =
        app.store.snapshot().all().map(|e| (**e).clone()).collect();
    let web_rec = &endpoints[0];
    assert_eq!(web_rec.ports, vec![8080]);
    assert_eq!(web_rec.target_port(80), Some(8080));

    // Cluster b's view of service port 80: this node's waypoint, SNI of pod port 8080.
    let viewer = Viewer {
        cluster: "b".into(),
        node: "b-1".into(),
        region: String::new(),
        zone: String::new(),
        mode: Mode::CrossCluster,
        mesh_domain: "mesh.local".into(),
        tunnel_port: app.tunnel_addr.port(),
        pod_port: 15008,
    };
    let query: Query = "web.bookinfo:80".parse().unwrap();
    let view = horizon::resolve(&viewer, &query, &endpoints);
    let sni = "8080.web.bookinfo.mesh.local";
    let dials: Vec<(String, &str)> = view
        .endpoints
        .iter()
        .map(|t| (t.address.to_string(), t.sni.as_str()))
        .collect();
    assert_eq!(dials, vec![(app.tunnel_addr.to_string(), sni)]);
    let by_pod_port: Query = "web.bookinfo:8080".parse().unwrap();
    assert!(horizon::resolve(&viewer, &by_pod_port, &endpoints)
        .endpoints
        .is_empty());

    // The source side's Envoy: the endpoint names the socket whose SNI is that.
    let config = waypoint::envoy::Config {
        trust_domain: "cluster.local".into(),
        sds_cluster: "spire_agent".into(),
        source_key: "envoy.network.namespace".into(),
        sources: vec!["/var/run/netns/cni-1=shop/client".parse().unwrap()],
        connect_timeout: Duration::from_secs(1),
    };
    let boot = waypoint::envoy::generate(&config, &viewer, &query, &endpoints)
        .unwrap()
        .bootstrap;
    let cluster = &boot["static_resources"]["clusters"][0];
    let lb = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0];
    assert_eq!(
        lb["metadata"]["filter_metadata"]["envoy.lb"]["socket"],
        "waypoint:8080"
    );
    let socket = cluster["transport_socket_matches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "waypoint:8080/shop/client")
        .unwrap();
    assert_eq!(socket["transport_socket"]["typed_config"]["sni"], sni);

    // The routed connection: the hello reaches the pod unchanged, the answer comes back.
    let hello = fake_hello(sni);
    let mut client = tokio::net::TcpStream::connect(app.tunnel_addr)
        .await
        .unwrap();
    client.write_all(&hello).await.unwrap();
    let (mut pod_side, _) = tokio::time::timeout(WAIT, pod_inbound.accept())
        .await
        .expect("the waypoint dialed the pod")
        .unwrap();
    let mut got = vec![0u8; hello.len()];
    pod_side.read_exact(&mut got).await.unwrap();
    assert_eq!(got, hello);
    pod_side.write_all(b"served").await.unwrap();
    let mut answer = [0u8; 6];
    client.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"served");
    drop((client, pod_side));

    app.shutdown().await;
    stop.cancel();
    registering.await.unwrap();
}

/// A minimal TLS 1.3-style ClientHello record carrying `sni` (what the router reads; the
/// rest of the handshake is the pod's).
fn fake_hello(sni: &str) -> Vec<u8> {
    let name = sni.as_bytes();
    let mut sni_ext = Vec::new();
    let list_len = u16::try_from(name.len() + 3).unwrap();
    sni_ext.extend_from_slice(&list_len.to_be_bytes());
    sni_ext.push(0);
    sni_ext.extend_from_slice(&u16::try_from(name.len()).unwrap().to_be_bytes());
    sni_ext.extend_from_slice(name);
    let mut exts = Vec::new();
    exts.extend_from_slice(&0u16.to_be_bytes());
    exts.extend_from_slice(&u16::try_from(sni_ext.len()).unwrap().to_be_bytes());
    exts.extend_from_slice(&sni_ext);
    let mut body = vec![0x03, 0x03];
    body.extend_from_slice(&[7u8; 32]); // random
    body.push(0); // session id
    body.extend_from_slice(&[0x00, 0x02, 0x13, 0x01]); // one cipher suite
    body.extend_from_slice(&[0x01, 0x00]); // null compression
    body.extend_from_slice(&u16::try_from(exts.len()).unwrap().to_be_bytes());
    body.extend_from_slice(&exts);
    let mut handshake = vec![0x01];
    handshake.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes()[1..]);
    handshake.extend_from_slice(&body);
    let mut record = vec![0x16, 0x03, 0x01];
    record.extend_from_slice(&u16::try_from(handshake.len()).unwrap().to_be_bytes());
    record.extend_from_slice(&handshake);
    record
}
