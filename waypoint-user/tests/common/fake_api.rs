//! A fake Kubernetes API server for the tests: hyper on loopback, serving lists and
//! watches of Nodes, Pods, Services and EndpointSlices from objects the test builds
//! (k8s-openapi types, serialized with serde_json) and writes while the source runs.
//! Resource versions, watch history, compaction (410 Gone), bookmarks, field selectors
//! and paging behave as on a real API server: see [`cluster`], which holds the state;
//! this module is the HTTP side and the test's handle ([`FakeApi`]).
//!
//! Every request is logged with its query and answer ([`FakeApi::requests`]), so that a
//! test can check what the client asked for, e.g. which resourceVersion a watch resumed
//! from.

#[path = "fake_api/cluster.rs"]
mod cluster;

use std::{
    collections::HashMap,
    convert::Infallible,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use futures::StreamExt as _;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt as _, Full, StreamBody};
use hyper::{
    body::{Bytes, Frame, Incoming},
    server::conn::http1,
    service::service_fn,
    Method, Response, StatusCode,
};
use hyper_util::rt::TokioIo;
use k8s_openapi::{
    api::{
        core::v1::{Node, Pod, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
    ListableResource, Metadata,
};
use serde::Serialize;
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

pub use cluster::{Cluster, Params};
use cluster::{Kind, Opened, Refusal};

/// How long a test waits for the client to do something.
const WAIT: Duration = Duration::from_secs(20);
/// A watch's length when the client asks for no `timeoutSeconds` (the API server
/// picks 30 to 60 minutes): longer than any test.
const WATCH_TIMEOUT: Duration = Duration::from_secs(1800);

/// A request the fake answered.
#[derive(Clone, Debug)]
pub struct Request {
    pub watch: bool,
    pub params: Params,
    /// The HTTP status; 410 for a watch answered with the 410 `ERROR` event.
    pub code: u16,
}

impl Request {
    pub fn param(&self, name: &str) -> Option<&str> {
        self.params.get(name).map(String::as_str)
    }
}

/// What the handlers share with the test.
struct Inner {
    cluster: Cluster,
    /// Every request answered, by kind (plural), in order.
    log: HashMap<&'static str, Vec<Request>>,
    /// Lists still to fail with a 500, by kind.
    failures: HashMap<&'static str, usize>,
}

struct Shared {
    kinds: Vec<Kind>,
    inner: Mutex<Inner>,
    /// True during a [`Partition`]: requests wait. Only changed with `inner` locked, so
    /// that a request is either answered before the partition or after it.
    held: watch::Sender<bool>,
}

type Body = UnsyncBoxBody<Bytes, Infallible>;

fn json(code: u16, body: &Value) -> Response<Body> {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed_unsync())
        .unwrap()
}

fn refused(r: &Refusal) -> Response<Body> {
    json(r.code, &r.status())
}

/// A watch response: the lines sent on `rx`, until the sender goes or `timeout`.
fn stream(rx: mpsc::UnboundedReceiver<Bytes>, timeout: Duration) -> Response<Body> {
    let frames = futures::stream::unfold(rx, |mut rx| async move {
        let line = rx.recv().await?;
        Some((Ok::<_, Infallible>(Frame::data(line)), rx))
    })
    .take_until(tokio::time::sleep(timeout));
    Response::builder()
        .header("content-type", "application/json")
        .body(UnsyncBoxBody::new(StreamBody::new(frames)))
        .unwrap()
}

async fn handle(
    shared: Arc<Shared>,
    req: hyper::Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path();
    let Some(kind) = shared.kinds.iter().find(|k| k.path() == path).copied() else {
        let msg = format!("the fake API server serves no {path}");
        return Ok(refused(&Refusal::new(404, "NotFound", msg)));
    };
    if req.method() != Method::GET {
        let msg = format!(
            "the fake API server only lists and watches, not {}",
            req.method()
        );
        return Ok(refused(&Refusal::new(405, "MethodNotAllowed", msg)));
    }
    let query = req.uri().query().unwrap_or_default().as_bytes();
    let params: Params = form_urlencoded::parse(query).into_owned().collect();
    let watch = params.get("watch").is_some_and(|w| w == "true" || w == "1");
    let mut held = shared.held.subscribe();
    loop {
        {
            let mut inner = shared.inner.lock().unwrap();
            if !*held.borrow_and_update() {
                let (code, response) = answer(&mut inner, kind, watch, &params);
                let log = inner.log.entry(kind.plural).or_default();
                log.push(Request {
                    watch,
                    params,
                    code,
                });
                return Ok(response);
            }
        }
        let _ = held.wait_for(|h| !*h).await;
    }
}

fn answer(inner: &mut Inner, kind: Kind, watch: bool, params: &Params) -> (u16, Response<Body>) {
    if watch {
        let timeout = params
            .get("timeoutSeconds")
            .and_then(|t| t.parse().ok())
            .map_or(WATCH_TIMEOUT, Duration::from_secs);
        let (tx, rx) = mpsc::unbounded_channel();
        return match inner.cluster.watch(kind, params, tx) {
            Ok(Opened::Watching) => (200, stream(rx, timeout)),
            Ok(Opened::Expired) => (410, stream(rx, timeout)),
            Err(r) => (r.code, refused(&r)),
        };
    }
    let failures = inner.failures.entry(kind.plural).or_default();
    if *failures > 0 {
        *failures -= 1;
        let r = Refusal::new(
            500,
            "InternalError",
            "Internal error occurred: etcdserver: request timed out",
        );
        return (500, refused(&r));
    }
    match inner.cluster.list(kind, params) {
        Ok(list) => (200, json(200, &list)),
        Err(r) => (r.code, refused(&r)),
    }
}

/// The fake API server; it stops when dropped.
pub struct FakeApi {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

impl FakeApi {
    /// An API server with no objects on a loopback port.
    pub fn start() -> FakeApi {
        FakeApi::serve(std::net::TcpListener::bind("127.0.0.1:0").unwrap())
    }

    /// An API server with no objects on `listener`.
    pub fn serve(listener: std::net::TcpListener) -> FakeApi {
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            kinds: vec![
                Kind::of::<Node>(),
                Kind::of::<Pod>(),
                Kind::of::<Service>(),
                Kind::of::<EndpointSlice>(),
            ],
            inner: Mutex::new(Inner {
                cluster: Cluster::default(),
                log: HashMap::new(),
                failures: HashMap::new(),
            }),
            held: watch::Sender::new(false),
        });
        let stop = CancellationToken::new();
        listener.set_nonblocking(true).unwrap();
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let (sh, stopped) = (shared.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    _ = stopped.cancelled() => return,
                    a = listener.accept() => a.unwrap().0,
                };
                let (sh, stopped) = (sh.clone(), stopped.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(sh.clone(), req));
                    let conn = http1::Builder::new().serve_connection(TokioIo::new(stream), svc);
                    tokio::select! {
                        _ = stopped.cancelled() => {}
                        _ = conn => {}
                    }
                });
            }
        });
        FakeApi { addr, shared, stop }
    }

    /// Runs `f` on the state, locked.
    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        f(&mut self.shared.inner.lock().unwrap())
    }

    /// Creates or replaces `obj`; returns its new resourceVersion.
    pub fn apply<K: ListableResource + Serialize>(&self, obj: &K) -> u64 {
        self.with(|i| i.cluster.apply(obj))
    }

    /// Deletes `obj` (by namespace and name); returns the deletion's resourceVersion.
    pub fn delete<K: ListableResource + Metadata<Ty = ObjectMeta>>(&self, obj: &K) -> u64 {
        self.with(|i| i.cluster.delete(obj))
    }

    /// The resourceVersion of the last write.
    pub fn resource_version(&self) -> u64 {
        self.with(|i| i.cluster.resource_version())
    }

    /// Compacts the history (as etcd does every few minutes): a watch or a continue
    /// token from before now is answered 410 Gone.
    pub fn compact(&self) {
        self.with(|i| i.cluster.compact());
    }

    /// Sends a BOOKMARK at the current resourceVersion on every open watch that allows
    /// them (the API server does so about once a minute).
    pub fn bookmark(&self) {
        self.with(|i| i.cluster.bookmark());
    }

    /// Ends the open watches of `K` (as the API server does at a watch's timeout).
    pub fn end_watches<K: ListableResource>(&self) {
        self.with(|i| i.cluster.end_watches(Some(K::URL_PATH_SEGMENT)));
    }

    /// Cuts the clients off until the guard is dropped (a network partition, an API
    /// server restarting): ends every open watch and holds every request meanwhile.
    pub fn partition(&self) -> Partition<'_> {
        self.with(|i| {
            self.shared.held.send_replace(true);
            i.cluster.end_watches(None);
        });
        Partition(self)
    }

    /// Makes the next `n` lists of `K` fail with a 500.
    pub fn fail_lists<K: ListableResource>(&self, n: usize) {
        self.with(|i| i.failures.insert(K::URL_PATH_SEGMENT, n));
    }

    /// Runs `f` on the state right after the next first page of a paged list of `K` is
    /// served, before the client asks for the next page.
    pub fn after_first_page<K: ListableResource>(
        &self,
        f: impl FnOnce(&mut Cluster) + Send + 'static,
    ) {
        self.with(|i| i.cluster.after_first_page(K::URL_PATH_SEGMENT, Box::new(f)));
    }

    /// The requests for `K` answered so far, in order.
    pub fn requests<K: ListableResource>(&self) -> Vec<Request> {
        self.with(|i| i.log.get(K::URL_PATH_SEGMENT).cloned().unwrap_or_default())
    }

    /// The lists of `K` answered so far (every page counts).
    pub fn lists<K: ListableResource>(&self) -> Vec<Request> {
        self.requests::<K>()
            .into_iter()
            .filter(|r| !r.watch)
            .collect()
    }

    /// The watches of `K` answered so far.
    pub fn watches<K: ListableResource>(&self) -> Vec<Request> {
        self.requests::<K>()
            .into_iter()
            .filter(|r| r.watch)
            .collect()
    }

    /// Waits until every kind has an open watch.
    pub async fn until_watching(&self) {
        let start = std::time::Instant::now();
        let kinds = &self.shared.kinds;
        while !self.with(|i| kinds.iter().all(|k| i.cluster.watching(k.plural))) {
            assert!(
                start.elapsed() < WAIT,
                "the client never watched every kind"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn client(&self) -> kube::Client {
        client(self.addr)
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A client of the API server at `addr` (which need not be up).
pub fn client(addr: SocketAddr) -> kube::Client {
    let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    kube::Client::try_from(config).unwrap()
}

/// See [`FakeApi::partition`]; dropping it lets the held requests through.
pub struct Partition<'a>(&'a FakeApi);

impl Drop for Partition<'_> {
    fn drop(&mut self) {
        let _locked = self.0.shared.inner.lock();
        self.0.shared.held.send_replace(false);
    }
}

/// The fake against the kube client, on the points where it must behave as a real API
/// server for the watcher tests to mean anything.
#[cfg(test)]
mod tests {
    use futures::{StreamExt as _, TryStreamExt as _};
    use kube::{
        api::{ListParams, VersionMatch, WatchEvent, WatchParams},
        Api,
    };

    use super::*;
    use crate::k8s_objects::{pod, port, running, scheduled, service};

    fn reviews() -> Pod {
        pod(
            "bookinfo",
            "reviews-1",
            &[("app", "reviews")],
            "reviews",
            &[("http", 9080)],
        )
    }

    fn rv_of<K: Metadata<Ty = ObjectMeta>>(obj: &K) -> u64 {
        obj.metadata()
            .resource_version
            .as_deref()
            .unwrap()
            .parse()
            .unwrap()
    }

    /// The events of a watch until the fake ends it.
    async fn events(
        api: &FakeApi,
        pods: &Api<Pod>,
        wp: &WatchParams,
        from: u64,
    ) -> Vec<WatchEvent<Pod>> {
        let stream = pods.watch(wp, &from.to_string()).await.unwrap();
        api.end_watches::<Pod>();
        stream.try_collect().await.unwrap()
    }

    fn summary(events: &[WatchEvent<Pod>]) -> Vec<(&'static str, u64)> {
        events
            .iter()
            .map(|e| match e {
                WatchEvent::Added(p) => ("ADDED", rv_of(p)),
                WatchEvent::Modified(p) => ("MODIFIED", rv_of(p)),
                WatchEvent::Deleted(p) => ("DELETED", rv_of(p)),
                WatchEvent::Bookmark(b) => {
                    ("BOOKMARK", b.metadata.resource_version.parse().unwrap())
                }
                WatchEvent::Error(s) => panic!("error event {s:?}"),
            })
            .collect()
    }

    #[tokio::test]
    async fn every_write_moves_the_resource_version_and_watches_replay_from_it() {
        let api = FakeApi::start();
        let pods: Api<Pod> = Api::all(api.client());
        let created = api.apply(&reviews());
        let bound = api.apply(&scheduled(&reviews(), "node-a"));
        assert!(bound > created);

        let list = pods.list(&ListParams::default()).await.unwrap();
        assert_eq!(list.metadata.resource_version, Some(bound.to_string()));
        assert_eq!(
            rv_of(&list.items[0]),
            bound,
            "the object carries its last write's"
        );
        let uid = list.items[0].metadata.uid.clone();
        assert!(uid.is_some());

        let other = api.apply(&service("bookinfo", "reviews", &[], &[(80, port(9080))]));
        assert!(other > bound, "one counter for every kind");
        let up = api.apply(&running(&scheduled(&reviews(), "node-a"), "10.1.0.7", true));
        let gone = api.delete(&reviews());
        let list = pods.list(&ListParams::default()).await.unwrap();
        assert!(list.items.is_empty());
        assert_eq!(list.metadata.resource_version, Some(gone.to_string()));

        // From `created`: what came after it, the deletion at its own version.
        let seen = events(&api, &pods, &WatchParams::default(), created).await;
        assert_eq!(
            summary(&seen),
            [("MODIFIED", bound), ("MODIFIED", up), ("DELETED", gone)]
        );
        match &seen[2] {
            WatchEvent::Deleted(p) => assert_eq!(p.metadata.uid, uid, "same object throughout"),
            e => panic!("{e:?}"),
        }
    }

    #[tokio::test]
    async fn a_watch_from_before_the_compaction_is_gone() {
        let api = FakeApi::start();
        let pods: Api<Pod> = Api::all(api.client());
        let old = api.apply(&reviews());
        let now = api.apply(&scheduled(&reviews(), "node-a"));
        api.compact();

        let mut stream = pods
            .watch(&WatchParams::default(), &old.to_string())
            .await
            .unwrap()
            .boxed();
        match stream.try_next().await.unwrap() {
            Some(WatchEvent::Error(status)) => {
                assert_eq!(status.code, 410);
                assert_eq!(status.reason, "Expired");
            }
            e => panic!("expected the 410 ERROR event, got {e:?}"),
        }
        assert!(
            stream.try_next().await.unwrap().is_none(),
            "and the watch ends"
        );
        assert_eq!(api.watches::<Pod>()[0].code, 410);

        // From the compaction on, watches work, and bookmarks carry the current version.
        // Bookmarks are the default.
        let wp = WatchParams::default();
        let stream = pods.watch(&wp, &now.to_string()).await.unwrap();
        let deleted = api.delete(&reviews());
        api.bookmark();
        api.end_watches::<Pod>();
        let seen: Vec<_> = stream.try_collect().await.unwrap();
        assert_eq!(
            summary(&seen),
            [("DELETED", deleted), ("BOOKMARK", deleted)]
        );
        let plain = WatchParams::default().disable_bookmarks();
        assert!(
            events(&api, &pods, &plain, deleted).await.is_empty(),
            "no bookmark unasked"
        );
    }

    #[tokio::test]
    async fn field_selectors_filter_and_turn_writes_into_added_and_deleted() {
        let api = FakeApi::start();
        let pods: Api<Pod> = Api::all(api.client());
        let fields = "spec.nodeName=node-a,status.phase!=Succeeded";
        // Created unscheduled (before the watch: from version 0 it would be "any version").
        let from = api.apply(&reviews());
        let bound = api.apply(&scheduled(&reviews(), "node-a"));
        let elsewhere = pod("bookinfo", "reviews-2", &[], "reviews", &[]);
        api.apply(&scheduled(&elsewhere, "node-b"));
        let list = pods
            .list(&ListParams::default().fields(fields))
            .await
            .unwrap();
        let names: Vec<_> = list
            .items
            .iter()
            .map(|p| p.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(names, ["reviews-1"]);

        let mut done = scheduled(&reviews(), "node-a");
        done.status.as_mut().unwrap().phase = Some("Succeeded".into());
        let finished = api.apply(&done);
        api.delete(&reviews());
        let seen = events(&api, &pods, &WatchParams::default().fields(fields), from).await;
        // Bound: comes in; node-b's: never in; finished: leaves; deleted: out already.
        assert_eq!(summary(&seen), [("ADDED", bound), ("DELETED", finished)]);
    }

    #[tokio::test]
    async fn lists_page_from_one_snapshot_until_it_is_compacted() {
        let api = FakeApi::start();
        let services: Api<Service> = Api::all(api.client());
        for i in 0..5 {
            api.apply(&service(
                "bookinfo",
                &format!("svc-{i}"),
                &[],
                &[(80, port(80))],
            ));
        }
        let snapshot = api.resource_version();
        let first = services
            .list(&ListParams::default().limit(2))
            .await
            .unwrap();
        assert_eq!(first.items.len(), 2);
        assert_eq!(first.metadata.remaining_item_count, Some(3));
        let token = first.metadata.continue_.clone().unwrap();

        // Writes after the first page do not show in the next ones.
        api.delete(&service("bookinfo", "svc-3", &[], &[]));
        api.apply(&service("bookinfo", "svc-9", &[], &[(80, port(80))]));
        let second = services
            .list(&ListParams::default().limit(2).continue_token(&token))
            .await
            .unwrap();
        let names: Vec<_> = second
            .items
            .iter()
            .map(|s| s.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(names, ["svc-2", "svc-3"]);
        assert_eq!(second.metadata.resource_version, Some(snapshot.to_string()));
        let exact = ListParams::default()
            .at(&snapshot.to_string())
            .matching(VersionMatch::Exact);
        assert_eq!(services.list(&exact).await.unwrap().items.len(), 5);

        // Compacted: the snapshot is gone, as is an exact read of it.
        api.compact();
        let token = second.metadata.continue_.clone().unwrap();
        for lp in [ListParams::default().limit(2).continue_token(&token), exact] {
            match services.list(&lp).await {
                Err(kube::Error::Api(s)) => {
                    assert_eq!((s.code, s.reason.as_str()), (410, "Expired"))
                }
                r => panic!("expected 410 Expired, got {r:?}"),
            }
        }
        let now = services.list(&ListParams::default()).await.unwrap();
        assert_eq!(now.items.len(), 5, "svc-3 gone, svc-9 there");
    }
}
