//! The fake API server's state, without IO: the objects as the API server serializes
//! them, one resourceVersion counter for every kind (etcd's revision), the history of
//! writes since the last compaction, and the open watches. [`super`] turns requests into
//! calls here and answers into HTTP responses.
//!
//! What it keeps of a real API server, because the watchers depend on it:
//! - every write moves the resourceVersion and stamps it on the object; a list carries
//!   the version it was read at, a deleted object's last event carries the deletion's;
//! - a watch from version N streams every write after N, then follows; a watch from
//!   before the compacted history gets one `ERROR` event (a `Status` 410 `Expired`) and
//!   ends, as the API server's watch cache answers it;
//! - field selectors filter lists and watches, and a write that makes an object match
//!   (or stop matching) reaches a watch as `ADDED` (or `DELETED`);
//! - lists page with `limit`/`continue` from one snapshot; a continue token whose
//!   snapshot was compacted is refused with a 410 `Expired`;
//! - `BOOKMARK` events, at the current version, to the watches that allow them.
//!
//! What it refuses rather than fakes (a 400 saying so): label selectors and streaming
//! lists (`sendInitialEvents`), which the Kubernetes source does not use.

use std::collections::{BTreeMap, VecDeque};

use hyper::body::Bytes;
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::ObjectMeta, ListableResource, Metadata};
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// A served resource type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kind {
    /// The URL path segment (`pods`); it also keys the kind's objects.
    pub plural: &'static str,
    group: &'static str,
    version: &'static str,
    api_version: &'static str,
    kind: &'static str,
    list_kind: &'static str,
}

impl Kind {
    pub fn of<K: ListableResource>() -> Kind {
        Kind {
            plural: K::URL_PATH_SEGMENT,
            group: K::GROUP,
            version: K::VERSION,
            api_version: K::API_VERSION,
            kind: K::KIND,
            list_kind: K::LIST_KIND,
        }
    }

    /// The cluster-wide collection path (`/api/v1/pods`, `/apis/discovery.k8s.io/v1/...`).
    pub fn path(&self) -> String {
        if self.group.is_empty() {
            format!("/api/{}/{}", self.version, self.plural)
        } else {
            format!("/apis/{}/{}/{}", self.group, self.version, self.plural)
        }
    }
}

/// An answer that is not a success, as a `metav1.Status`.
#[derive(Debug, thiserror::Error)]
#[error("{code} {reason}: {message}")]
pub struct Refusal {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
}

impl Refusal {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Refusal {
        Refusal {
            code,
            reason,
            message: message.into(),
        }
    }

    pub fn status(&self) -> Value {
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        })
    }

    fn unsupported(what: &str) -> Refusal {
        Refusal::new(
            400,
            "BadRequest",
            format!("{what} is not supported by the fake API server"),
        )
    }
}

/// A field selector: comma-separated `path=value`, `path==value` or `path!=value` terms
/// on the object's JSON (`spec.nodeName`, `metadata.name`); a missing field is "".
#[derive(Clone, Debug, Default)]
pub struct Fields(Vec<Term>);

#[derive(Clone, Debug)]
struct Term {
    /// Dot-separated (`spec.nodeName`).
    path: String,
    /// `=`/`==` rather than `!=`.
    equal: bool,
    value: String,
}

impl Fields {
    pub fn parse(s: &str) -> Result<Fields, Refusal> {
        let mut terms = Vec::new();
        for term in s.split(',').filter(|t| !t.is_empty()) {
            let (path, equal, value) = if let Some((p, v)) = term.split_once("!=") {
                (p, false, v)
            } else if let Some((p, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                (p, true, v)
            } else {
                return Err(Refusal::new(
                    400,
                    "BadRequest",
                    format!("invalid field selector term {term:?}"),
                ));
            };
            terms.push(Term {
                path: path.to_owned(),
                equal,
                value: value.to_owned(),
            });
        }
        Ok(Fields(terms))
    }

    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|t| {
            let got = obj
                .pointer(&format!("/{}", t.path.replace('.', "/")))
                .and_then(Value::as_str)
                .unwrap_or_default();
            (got == t.value) == t.equal
        })
    }
}

/// The API server's words for an expired continue token.
const CONTINUE_EXPIRED: &str = "The provided continue parameter is too old to display a \
    consistent list result. You can start a new list without the continue parameter.";

/// What a request asked for, from its query string.
pub type Params = BTreeMap<String, String>;

/// An object's place: kind (plural), namespace ("" for cluster-scoped kinds), name.
type Key = (&'static str, String, String);

/// One write: the object before and after (None: absent).
struct Change {
    rv: u64,
    key: Key,
    old: Option<Value>,
    new: Option<Value>,
}

/// An open watch: the HTTP side streams what is sent on `tx`, one event a line.
struct Watch {
    kind: Kind,
    fields: Fields,
    bookmarks: bool,
    tx: mpsc::UnboundedSender<Bytes>,
}

impl Watch {
    fn send(&self, event: &Value) {
        // A watch whose client went away is dropped at the next write.
        let _ = self.tx.send(Bytes::from(format!("{event}\n")));
    }
}

/// How a watch request was answered.
#[derive(Debug, PartialEq, Eq)]
pub enum Opened {
    /// Streaming.
    Watching,
    /// Answered with one 410 `ERROR` event: its version is older than the history.
    Expired,
}

/// Something to do right after a kind's first list page is served.
pub type PageHook = Box<dyn FnOnce(&mut Cluster) + Send>;

/// The fake API server's state.
#[derive(Default)]
pub struct Cluster {
    /// The resourceVersion of the last write (0 before any).
    rv: u64,
    objects: BTreeMap<Key, Value>,
    /// The writes after `compacted`, oldest first.
    history: VecDeque<Change>,
    /// Watches and continue tokens from before this version are answered 410.
    compacted: u64,
    watches: Vec<Watch>,
    after_first_page: Vec<(&'static str, PageHook)>,
}

fn key_of(kind: Kind, obj: &Value) -> Key {
    let meta = |f: &str| obj["metadata"][f].as_str().unwrap_or_default().to_owned();
    (kind.plural, meta("namespace"), meta("name"))
}

fn set_rv(obj: &mut Value, rv: u64) {
    obj["metadata"]["resourceVersion"] = json!(rv.to_string());
}

/// What a watch filtered by `fields` sees of `change`, if anything: an object that comes
/// into the selection is ADDED, one that leaves it is DELETED with its previous content
/// at the change's version (what the API server's watch cache sends).
fn event(fields: &Fields, change: &Change) -> Option<Value> {
    let was = change.old.as_ref().filter(|o| fields.matches(o));
    let now = change.new.as_ref().filter(|n| fields.matches(n));
    match (was, now) {
        (Some(_), Some(now)) => Some(json!({"type": "MODIFIED", "object": now})),
        (None, Some(now)) => Some(json!({"type": "ADDED", "object": now})),
        (Some(was), None) => {
            let mut was = was.clone();
            set_rv(&mut was, change.rv);
            Some(json!({"type": "DELETED", "object": was}))
        }
        (None, None) => None,
    }
}

fn number(s: &str, what: &str) -> Result<u64, Refusal> {
    s.parse()
        .map_err(|_| Refusal::new(400, "BadRequest", format!("invalid {what} {s:?}")))
}

fn fields_of(params: &Params) -> Result<Fields, Refusal> {
    if params.contains_key("labelSelector") {
        return Err(Refusal::unsupported("labelSelector"));
    }
    Fields::parse(params.get("fieldSelector").map_or("", String::as_str))
}

impl Cluster {
    /// The resourceVersion of the last write.
    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    /// Creates or replaces `obj` at the next resourceVersion, which it returns. The
    /// object keeps its uid across updates.
    pub fn apply<K: ListableResource + Serialize>(&mut self, obj: &K) -> u64 {
        // Serialized as the API server does, with `apiVersion` and `kind`.
        let obj = serde_json::to_value(obj).expect("k8s-openapi objects serialize");
        self.apply_value(Kind::of::<K>(), obj)
    }

    /// Deletes `obj` (found by namespace and name) at the next resourceVersion, which it
    /// returns.
    pub fn delete<K: ListableResource + Metadata<Ty = ObjectMeta>>(&mut self, obj: &K) -> u64 {
        let meta = obj.metadata();
        let (ns, name) = (meta.namespace.as_deref(), meta.name.as_deref());
        self.delete_key(
            Kind::of::<K>(),
            ns.unwrap_or_default(),
            name.unwrap_or_default(),
        )
        .unwrap_or_else(|| panic!("no {} {ns:?}/{name:?} to delete", K::KIND))
    }

    fn apply_value(&mut self, kind: Kind, mut obj: Value) -> u64 {
        let key = key_of(kind, &obj);
        self.rv += 1;
        let old = self.objects.get(&key).cloned();
        let uid = old
            .as_ref()
            .map(|o| o["metadata"]["uid"].clone())
            .unwrap_or_else(|| json!(format!("00000000-0000-4000-8000-{:012}", self.rv)));
        obj["metadata"]["uid"] = uid;
        set_rv(&mut obj, self.rv);
        self.objects.insert(key.clone(), obj.clone());
        self.record(Change {
            rv: self.rv,
            key,
            old,
            new: Some(obj),
        });
        self.rv
    }

    fn delete_key(&mut self, kind: Kind, namespace: &str, name: &str) -> Option<u64> {
        let key = (kind.plural, namespace.to_owned(), name.to_owned());
        let old = self.objects.remove(&key)?;
        self.rv += 1;
        self.record(Change {
            rv: self.rv,
            key,
            old: Some(old),
            new: None,
        });
        Some(self.rv)
    }

    fn record(&mut self, change: Change) {
        self.watches.retain(|w| !w.tx.is_closed());
        for w in self
            .watches
            .iter()
            .filter(|w| w.kind.plural == change.key.0)
        {
            if let Some(ev) = event(&w.fields, &change) {
                w.send(&ev);
            }
        }
        self.history.push_back(change);
    }

    /// Forgets the history: watches and continue tokens from before now get a 410.
    pub fn compact(&mut self) {
        self.history.clear();
        self.compacted = self.rv;
    }

    /// Sends a BOOKMARK at the current version to every open watch that allows them.
    pub fn bookmark(&mut self) {
        for w in self.watches.iter().filter(|w| w.bookmarks) {
            w.send(&json!({"type": "BOOKMARK", "object": {
                "kind": w.kind.kind, "apiVersion": w.kind.api_version,
                "metadata": {"resourceVersion": self.rv.to_string()},
            }}));
        }
    }

    /// Ends the open watches of `plural` (every kind's when None).
    pub fn end_watches(&mut self, plural: Option<&str>) {
        self.watches
            .retain(|w| plural.is_some_and(|p| p != w.kind.plural));
    }

    /// Whether a watch of `plural` is open.
    pub fn watching(&mut self, plural: &str) -> bool {
        self.watches.retain(|w| !w.tx.is_closed());
        self.watches.iter().any(|w| w.kind.plural == plural)
    }

    /// Runs `hook` right after the next first page of a paged list of `plural` is served.
    pub fn after_first_page(&mut self, plural: &'static str, hook: PageHook) {
        self.after_first_page.push((plural, hook));
    }

    /// The objects of `plural` as they were at version `rv` (not before `compacted`),
    /// by key: the current ones with the later writes undone.
    fn at(&self, plural: &str, rv: u64) -> BTreeMap<Key, Value> {
        let mut objects: BTreeMap<Key, Value> = self
            .objects
            .iter()
            .filter(|(k, _)| k.0 == plural)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for c in self.history.iter().rev().take_while(|c| c.rv > rv) {
            if c.key.0 != plural {
                continue;
            }
            match &c.old {
                Some(old) => objects.insert(c.key.clone(), old.clone()),
                None => objects.remove(&c.key),
            };
        }
        objects
    }

    /// Answers a list of `kind`.
    ///
    /// `resourceVersion` unset (the watcher's default) or "0" reads the current state;
    /// N reads the current state unless N is in the future (`NotOlderThan`, the default),
    /// or exactly the state at N (`Exact`). `limit` pages; `continue` reads the next page
    /// from the first page's snapshot.
    pub fn list(&mut self, kind: Kind, params: &Params) -> Result<Value, Refusal> {
        let fields = fields_of(params)?;
        let (snapshot, after) = match params.get("continue") {
            Some(token) => {
                let (rv, start) = token
                    .split_once(':')
                    .ok_or_else(|| Refusal::new(400, "BadRequest", "invalid continue token"))?;
                let rv = number(rv, "continue token")?;
                if rv < self.compacted {
                    return Err(Refusal::new(410, "Expired", CONTINUE_EXPIRED));
                }
                let (ns, name) = start.split_once('/').unwrap_or(("", start));
                (rv, Some((ns.to_owned(), name.to_owned())))
            }
            None => (self.read_version(params)?, None),
        };
        let mut items: Vec<Value> = self
            .at(kind.plural, snapshot)
            .into_iter()
            .filter(|(k, obj)| {
                fields.matches(obj)
                    && after
                        .as_ref()
                        .is_none_or(|(ns, name)| (&k.1, &k.2) > (ns, name))
            })
            .map(|(_, mut obj)| {
                // List items carry no type: the list's kind says it.
                if let Some(o) = obj.as_object_mut() {
                    o.remove("kind");
                    o.remove("apiVersion");
                }
                obj
            })
            .collect();
        let limit = match params.get("limit") {
            Some(l) => Some(number(l, "limit")? as usize).filter(|l| *l > 0),
            None => None,
        };
        let mut metadata = json!({"resourceVersion": snapshot.to_string()});
        if let Some(limit) = limit.filter(|l| items.len() > *l) {
            let remaining = items.len() - limit;
            items.truncate(limit);
            let last = &items[limit - 1]["metadata"];
            let start = format!(
                "{}/{}",
                last["namespace"].as_str().unwrap_or_default(),
                last["name"].as_str().unwrap_or_default()
            );
            metadata["continue"] = json!(format!("{snapshot}:{start}"));
            metadata["remainingItemCount"] = json!(remaining);
            if after.is_none() {
                if let Some(i) = self
                    .after_first_page
                    .iter()
                    .position(|h| h.0 == kind.plural)
                {
                    let (_, hook) = self.after_first_page.remove(i);
                    hook(self);
                }
            }
        }
        Ok(json!({
            "kind": kind.list_kind, "apiVersion": kind.api_version,
            "metadata": metadata, "items": items,
        }))
    }

    /// The version a list without a continue token reads at.
    fn read_version(&self, params: &Params) -> Result<u64, Refusal> {
        let rv = match params.get("resourceVersion").map(String::as_str) {
            None | Some("") | Some("0") => return Ok(self.rv),
            Some(rv) => number(rv, "resourceVersion")?,
        };
        if rv > self.rv {
            return Err(Refusal::new(
                504,
                "Timeout",
                format!("Too large resource version: {rv}, current: {}", self.rv),
            ));
        }
        match params.get("resourceVersionMatch").map(String::as_str) {
            None | Some("NotOlderThan") => Ok(self.rv),
            Some("Exact") if rv < self.compacted => Err(Refusal::new(
                410,
                "Expired",
                format!("too old resource version: {rv} ({})", self.compacted),
            )),
            Some("Exact") => Ok(rv),
            Some(other) => Err(Refusal::new(
                400,
                "BadRequest",
                format!("invalid resourceVersionMatch {other:?}"),
            )),
        }
    }

    /// Opens a watch of `kind` whose events go to `tx`.
    ///
    /// From version N: every write after N that the selector sees, then what follows.
    /// Unset or "0": `ADDED` for every current object first (the API's "any version").
    pub fn watch(
        &mut self,
        kind: Kind,
        params: &Params,
        tx: mpsc::UnboundedSender<Bytes>,
    ) -> Result<Opened, Refusal> {
        let fields = fields_of(params)?;
        if params.get("sendInitialEvents").is_some_and(|v| v == "true") {
            return Err(Refusal::unsupported("sendInitialEvents (streaming lists)"));
        }
        let watch = Watch {
            kind,
            fields,
            bookmarks: params
                .get("allowWatchBookmarks")
                .is_some_and(|v| v == "true"),
            tx,
        };
        match params.get("resourceVersion").map(String::as_str) {
            None | Some("") | Some("0") => {
                for obj in self.at(kind.plural, self.rv).into_values() {
                    if watch.fields.matches(&obj) {
                        watch.send(&json!({"type": "ADDED", "object": obj}));
                    }
                }
            }
            Some(rv) => {
                let rv = number(rv, "resourceVersion")?;
                if rv < self.compacted {
                    // The watch cache's answer: a 200 whose only event is the 410.
                    let gone = Refusal::new(
                        410,
                        "Expired",
                        format!("too old resource version: {rv} ({})", self.compacted),
                    );
                    watch.send(&json!({"type": "ERROR", "object": gone.status()}));
                    return Ok(Opened::Expired);
                }
                if rv > self.rv {
                    return Err(Refusal::new(
                        504,
                        "Timeout",
                        format!("Too large resource version: {rv}, current: {}", self.rv),
                    ));
                }
                for c in self
                    .history
                    .iter()
                    .filter(|c| c.rv > rv && c.key.0 == kind.plural)
                {
                    if let Some(ev) = event(&watch.fields, c) {
                        watch.send(&ev);
                    }
                }
            }
        }
        self.watches.push(watch);
        Ok(Opened::Watching)
    }
}
