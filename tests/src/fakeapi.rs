//! An in-process fake Kubernetes API server for tests and benchmarks.
//!
//! It speaks plain HTTP/1.1 (no TLS, no auth) and serves real list/watch semantics for
//! Services, EndpointSlices and Nodes, good enough for `kube::runtime::watcher`:
//!
//! - one global, monotonically increasing resourceVersion across all kinds (as etcd);
//! - LIST with `labelSelector`, `fieldSelector`, `limit` + `continue` (pages are served
//!   from a snapshot taken by the first page, the list RV stays the snapshot RV; a
//!   continue token older than the last compaction answers HTTP 410 `Expired`);
//! - WATCH (`watch=true|1`) streaming newline-delimited JSON events with chunked
//!   transfer encoding, starting strictly after `resourceVersion` (`0` or unset: the
//!   current objects first, as ADDED), filtered by the selectors (an object that stops
//!   matching is sent as DELETED, one that starts matching as ADDED), periodic BOOKMARKs
//!   when `allowWatchBookmarks=true`, `sendInitialEvents=true` (streaming lists), and a
//!   graceful end after `timeoutSeconds`. A resourceVersion older than the retained
//!   history gets a watch ERROR event carrying a `Status` with code 410, reason `Expired`.
//!
//! Beyond the agent's three kinds it serves, generically, every resource in [`RESOURCES`]
//! (Secrets, Leases and the Gardener custom resources `networks`, `clusters`,
//! `managedresources`), for the Gardener extension's controller: the same list/watch,
//! plus POST, PUT, DELETE (finalizers delay it: `deletionTimestamp` first), JSON merge
//! patches, a simplified server-side apply, `/status` subresources, `metadata.generation`
//! and discovery; see `write` below for what exactly is served and simplified.
//!
//! The [`FakeApi`] handle is synchronous and thread-safe: the server runs on its own
//! tokio runtime thread, so it can be driven from plain `#[test]`s and from async code.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

/// The resource kinds the fake serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Service, Kind::EndpointSlice, Kind::Node];

    /// The object `kind` (`"Service"`).
    pub fn name(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
        }
    }

    pub fn api_version(self) -> &'static str {
        match self {
            Kind::Service | Kind::Node => "v1",
            Kind::EndpointSlice => "discovery.k8s.io/v1",
        }
    }

    /// The resource name in URLs (`"services"`).
    pub fn plural(self) -> &'static str {
        match self {
            Kind::Service => "services",
            Kind::EndpointSlice => "endpointslices",
            Kind::Node => "nodes",
        }
    }

    pub fn namespaced(self) -> bool {
        !matches!(self, Kind::Node)
    }

    /// Parses an object `kind` (`"Service"`) or a plural resource name (`"services"`).
    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s) || k.plural() == s)
    }

    fn idx(self) -> usize {
        self as usize
    }
}

/// A resource the fake serves, by group, version and plural. The first three entries of
/// [`RESOURCES`] are the [`Kind`]s (in [`Kind::idx`] order); the others are served
/// generically, as JSON objects the fake knows nothing about beyond this entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resource {
    /// `""` for the core group.
    pub group: &'static str,
    pub version: &'static str,
    pub plural: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    /// Has a `/status` subresource: writes to the object keep the stored `status`,
    /// writes to `/status` change nothing but `status`.
    pub status: bool,
    /// Keeps `metadata.generation` (as for custom resources): 1 on create, +1 on every
    /// write that changes anything outside `metadata` (and `status`, if a subresource).
    pub generation: bool,
}

impl Resource {
    /// `v1`, `extensions.gardener.cloud/v1alpha1`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    fn builtin(&self) -> bool {
        RESOURCES[..Kind::ALL.len()].contains(self)
    }
}

const fn resource(
    group: &'static str,
    version: &'static str,
    plural: &'static str,
    kind: &'static str,
    namespaced: bool,
    custom: bool,
) -> Resource {
    Resource {
        group,
        version,
        plural,
        kind,
        namespaced,
        status: custom,
        generation: custom,
    }
}

/// Everything the fake serves: the agent's [`Kind`]s, then what the Gardener extension
/// reads and writes (Secrets, Leases, and the Gardener custom resources).
pub const RESOURCES: [Resource; 8] = [
    resource("", "v1", "services", "Service", true, false),
    resource(
        "discovery.k8s.io",
        "v1",
        "endpointslices",
        "EndpointSlice",
        true,
        false,
    ),
    resource("", "v1", "nodes", "Node", false, false),
    resource("", "v1", "secrets", "Secret", true, false),
    resource("coordination.k8s.io", "v1", "leases", "Lease", true, false),
    resource(
        "extensions.gardener.cloud",
        "v1alpha1",
        "networks",
        "Network",
        true,
        true,
    ),
    Resource {
        status: false,
        ..resource(
            "extensions.gardener.cloud",
            "v1alpha1",
            "clusters",
            "Cluster",
            false,
            true,
        )
    },
    resource(
        "resources.gardener.cloud",
        "v1alpha1",
        "managedresources",
        "ManagedResource",
        true,
        true,
    ),
];

/// The index in [`RESOURCES`] of an object `kind` (and `apiVersion`, when given).
fn resource_of_kind(api_version: Option<&str>, kind: &str) -> Option<usize> {
    RESOURCES.iter().position(|r| {
        r.kind.eq_ignore_ascii_case(kind) && api_version.is_none_or(|v| v == r.api_version())
    })
}

/// The index in [`RESOURCES`] of `apiVersion` and `plural` (or kind).
fn resource_index(api_version: &str, plural: &str) -> Option<usize> {
    RESOURCES.iter().position(|r| {
        r.api_version() == api_version
            && (r.plural == plural || r.kind.eq_ignore_ascii_case(plural))
    })
}

/// What a write must change for `metadata.generation` to move: all but metadata (and
/// status when it is a subresource).
fn spec_of(v: &Value, def: &Resource) -> Value {
    let mut v = v.clone();
    if let Some(m) = v.as_object_mut() {
        m.remove("metadata");
        if def.status {
            m.remove("status");
        }
    }
    v
}

/// RFC 7386 JSON merge patch: objects merge key by key, `null` removes, everything else
/// (arrays included) replaces.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let t = target.as_object_mut().expect("an object");
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

/// Server settings for [`FakeApi::start_with`].
#[derive(Clone, Debug)]
pub struct Options {
    /// Where to listen; `127.0.0.1:0` picks a free port.
    pub listen: SocketAddr,
    /// How many events (of all kinds) are kept for watches resuming from an older
    /// resourceVersion; older ones answer 410 Expired.
    pub history_limit: usize,
    /// How often watches that asked for bookmarks get one.
    pub bookmark_interval: Duration,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            history_limit: 100_000,
            bookmark_interval: Duration::from_secs(1),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Store

struct Obj {
    ns: String,
    name: String,
    labels: BTreeMap<String, String>,
    value: Value,
    /// `value` serialized, with its metadata.resourceVersion.
    json: Box<[u8]>,
}

impl Obj {
    fn new(ns: String, name: String, value: Value) -> Obj {
        let labels = value
            .pointer("/metadata/labels")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .map(|(k, v)| {
                        let v = v
                            .as_str()
                            .map(str::to_string)
                            .unwrap_or_else(|| v.to_string());
                        (k.clone(), v)
                    })
                    .collect()
            })
            .unwrap_or_default();
        let json = serde_json::to_vec(&value)
            .expect("a JSON value serializes")
            .into_boxed_slice();
        Obj {
            ns,
            name,
            labels,
            value,
            json,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum EvType {
    Added,
    Modified,
    Deleted,
}

struct Event {
    rv: u64,
    /// Index into [`RESOURCES`].
    res: usize,
    typ: EvType,
    /// The object before the change (for MODIFIED and DELETED).
    old: Option<Arc<Obj>>,
    /// The object after the change; for DELETED its last state with the deletion RV.
    new: Arc<Obj>,
}

struct Snapshot {
    rv: u64,
    items: Arc<Vec<Arc<Obj>>>,
}

type Key = (String, String);

struct Store {
    /// The current (last issued) resourceVersion.
    rv: u64,
    /// One map per entry of [`RESOURCES`].
    objects: Vec<BTreeMap<Key, Arc<Obj>>>,
    history: VecDeque<Event>,
    history_limit: usize,
    /// A watch from resourceVersion N < gone_below answers 410.
    gone_below: u64,
    /// The highest RV of an event dropped from the history: an open watch that has not
    /// seen it yet lost events and ends with 410.
    lost_up_to: u64,
    snapshots: HashMap<u64, Snapshot>,
    snapshot_order: VecDeque<u64>,
    next_snapshot: u64,
    uid_seq: u64,
}

const MAX_SNAPSHOTS: usize = 64;

impl Store {
    fn new(history_limit: usize) -> Store {
        Store {
            rv: 1,
            objects: vec![BTreeMap::new(); RESOURCES.len()],
            history: VecDeque::new(),
            history_limit: history_limit.max(1),
            gone_below: 0,
            lost_up_to: 0,
            snapshots: HashMap::new(),
            snapshot_order: VecDeque::new(),
            next_snapshot: 1,
            uid_seq: 0,
        }
    }

    fn push(&mut self, ev: Event) {
        self.history.push_back(ev);
        while self.history.len() > self.history_limit {
            let old = self.history.pop_front().expect("non-empty");
            self.lost_up_to = old.rv;
            self.gone_below = self.gone_below.max(old.rv);
        }
    }

    /// Creates or updates; returns the object's resourceVersion. An update that changes
    /// nothing is a no-op (no new RV, no event), as on a real apiserver.
    fn apply(&mut self, value: Value) -> Result<u64, String> {
        let kind_s = value
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let api_version = value.get("apiVersion").and_then(Value::as_str);
        let res = Kind::parse(kind_s)
            .map(Kind::idx)
            .or_else(|| resource_of_kind(api_version, kind_s))
            .ok_or_else(|| format!("unsupported kind {kind_s:?}"))?;
        self.upsert(res, value)
    }

    /// [`Store::apply`] for a known resource: creates or updates, keeping uid and
    /// creationTimestamp, bumping `metadata.generation` where the resource keeps one.
    fn upsert(&mut self, res: usize, mut value: Value) -> Result<u64, String> {
        let def = &RESOURCES[res];
        if value.get("apiVersion").is_none() {
            value["apiVersion"] = def.api_version().into();
        }
        if value.get("kind").is_none() {
            value["kind"] = def.kind.into();
        }
        let meta = value
            .get_mut("metadata")
            .and_then(Value::as_object_mut)
            .ok_or("object without metadata")?;
        let name = meta
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or("object without metadata.name")?
            .to_string();
        let ns = if def.namespaced {
            let ns = meta
                .get("namespace")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .unwrap_or("default")
                .to_string();
            meta.insert("namespace".into(), ns.clone().into());
            ns
        } else {
            meta.remove("namespace");
            String::new()
        };
        let key = (ns.clone(), name.clone());
        let existing = self.objects[res].get(&key).cloned();
        if def.generation {
            let generation = match &existing {
                None => 1,
                Some(old) => {
                    let g = old.value["metadata"]["generation"].as_i64().unwrap_or(1);
                    if spec_of(&old.value, def) != spec_of(&value, def) {
                        g + 1
                    } else {
                        g
                    }
                }
            };
            value["metadata"]["generation"] = generation.into();
        }
        let meta = value
            .get_mut("metadata")
            .and_then(Value::as_object_mut)
            .expect("checked above");
        match &existing {
            Some(old) => {
                for f in ["uid", "creationTimestamp"] {
                    match old.value["metadata"].get(f) {
                        Some(v) => meta.insert(f.into(), v.clone()),
                        None => meta.remove(f),
                    };
                }
                meta.insert(
                    "resourceVersion".into(),
                    old.value["metadata"]["resourceVersion"].clone(),
                );
                if value == old.value {
                    return Ok(self.rv_of(old));
                }
            }
            None => {
                if !meta.get("uid").is_some_and(Value::is_string) {
                    self.uid_seq += 1;
                    let uid = format!("fa4e0000-0000-4000-8000-{:012x}", self.uid_seq);
                    meta.insert("uid".into(), uid.into());
                }
                if !meta.get("creationTimestamp").is_some_and(Value::is_string) {
                    meta.insert(
                        "creationTimestamp".into(),
                        rfc3339(SystemTime::now()).into(),
                    );
                }
            }
        }
        self.rv += 1;
        let rv = self.rv;
        value["metadata"]["resourceVersion"] = rv.to_string().into();
        let obj = Arc::new(Obj::new(ns, name, value));
        self.objects[res].insert(key, obj.clone());
        let typ = if existing.is_some() {
            EvType::Modified
        } else {
            EvType::Added
        };
        self.push(Event {
            rv,
            res,
            typ,
            old: existing,
            new: obj,
        });
        Ok(rv)
    }

    fn rv_of(&self, o: &Obj) -> u64 {
        o.value["metadata"]["resourceVersion"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .unwrap_or(self.rv)
    }

    fn delete(&mut self, res: usize, ns: &str, name: &str) -> Option<u64> {
        let ns = if RESOURCES[res].namespaced { ns } else { "" };
        let old = self.objects[res].remove(&(ns.to_string(), name.to_string()))?;
        self.rv += 1;
        let rv = self.rv;
        let mut value = old.value.clone();
        value["metadata"]["resourceVersion"] = rv.to_string().into();
        let tomb = Arc::new(Obj::new(old.ns.clone(), old.name.clone(), value));
        self.push(Event {
            rv,
            res,
            typ: EvType::Deleted,
            old: Some(old),
            new: tomb,
        });
        Some(rv)
    }

    fn compact(&mut self) {
        if let Some(last) = self.history.back() {
            self.lost_up_to = last.rv;
        }
        self.history.clear();
        // Like etcd, other writes happen: every RV handed out so far is now too old.
        self.rv += 1;
        self.gone_below = self.rv;
        self.snapshots.clear();
        self.snapshot_order.clear();
    }

    fn matching(&self, res: usize, ns: Option<&str>, sel: &Selectors) -> Vec<Arc<Obj>> {
        let map = &self.objects[res];
        let iter: Box<dyn Iterator<Item = &Arc<Obj>>> = match ns {
            Some(ns) => Box::new(
                map.range((ns.to_string(), String::new())..)
                    .take_while(move |((n, _), _)| n == ns)
                    .map(|(_, o)| o),
            ),
            None => Box::new(map.values()),
        };
        iter.filter(|o| sel.matches(o)).cloned().collect()
    }

    fn add_snapshot(&mut self, rv: u64, items: Arc<Vec<Arc<Obj>>>) -> u64 {
        let id = self.next_snapshot;
        self.next_snapshot += 1;
        self.snapshots.insert(id, Snapshot { rv, items });
        self.snapshot_order.push_back(id);
        while self.snapshot_order.len() > MAX_SNAPSHOTS {
            if let Some(old) = self.snapshot_order.pop_front() {
                self.snapshots.remove(&old);
            }
        }
        id
    }
}

// ---------------------------------------------------------------------------------------
// Selectors

#[derive(Debug, Clone)]
enum LabelReq {
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

#[derive(Debug, Clone)]
struct FieldReq {
    path: String,
    value: String,
    negate: bool,
}

#[derive(Debug, Clone, Default)]
struct Selectors {
    labels: Vec<LabelReq>,
    fields: Vec<FieldReq>,
}

impl Selectors {
    fn parse(label: &str, field: &str) -> Result<Selectors, String> {
        Ok(Selectors {
            labels: parse_label_selector(label)?,
            fields: parse_field_selector(field)?,
        })
    }

    fn matches(&self, o: &Obj) -> bool {
        self.labels.iter().all(|r| match r {
            LabelReq::Exists(k) => o.labels.contains_key(k),
            LabelReq::NotExists(k) => !o.labels.contains_key(k),
            LabelReq::In(k, vs) => o.labels.get(k).is_some_and(|v| vs.contains(v)),
            LabelReq::NotIn(k, vs) => o.labels.get(k).is_none_or(|v| !vs.contains(v)),
        }) && self.fields.iter().all(|f| {
            let actual = match f.path.as_str() {
                "metadata.name" => o.name.clone(),
                "metadata.namespace" => o.ns.clone(),
                path => {
                    let ptr = format!("/{}", path.replace('.', "/"));
                    match o.value.pointer(&ptr) {
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Null) | None => String::new(),
                        Some(v) => v.to_string(),
                    }
                }
            };
            (actual == f.value) != f.negate
        })
    }
}

fn split_top_level(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out.into_iter()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

fn parse_label_selector(s: &str) -> Result<Vec<LabelReq>, String> {
    let bad = |t: &str| format!("unable to parse requirement: {t:?}");
    let mut reqs = Vec::new();
    for term in split_top_level(s) {
        let req = if let Some(k) = term.strip_prefix('!') {
            LabelReq::NotExists(k.trim().to_string())
        } else if let Some(open) = term.find('(') {
            let close = term
                .rfind(')')
                .filter(|&c| c > open)
                .ok_or_else(|| bad(term))?;
            let mut head = term[..open].split_whitespace();
            let (key, op) = (
                head.next().ok_or_else(|| bad(term))?,
                head.next().ok_or_else(|| bad(term))?,
            );
            let values = term[open + 1..close]
                .split(',')
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
                .collect();
            match op {
                "in" => LabelReq::In(key.to_string(), values),
                "notin" => LabelReq::NotIn(key.to_string(), values),
                _ => return Err(bad(term)),
            }
        } else if let Some((k, v)) = term.split_once("!=") {
            LabelReq::NotIn(k.trim().to_string(), vec![v.trim().to_string()])
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            LabelReq::In(k.trim().to_string(), vec![v.trim().to_string()])
        } else {
            LabelReq::Exists(term.to_string())
        };
        let key = match &req {
            LabelReq::Exists(k)
            | LabelReq::NotExists(k)
            | LabelReq::In(k, _)
            | LabelReq::NotIn(k, _) => k,
        };
        if key.is_empty() || key.contains(char::is_whitespace) {
            return Err(bad(term));
        }
        reqs.push(req);
    }
    Ok(reqs)
}

fn parse_field_selector(s: &str) -> Result<Vec<FieldReq>, String> {
    let mut reqs = Vec::new();
    for term in split_top_level(s) {
        let (path, value, negate) = if let Some((p, v)) = term.split_once("!=") {
            (p, v, true)
        } else if let Some((p, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            (p, v, false)
        } else {
            return Err(format!("invalid field selector: {term:?}"));
        };
        reqs.push(FieldReq {
            path: path.trim().to_string(),
            value: value.trim().to_string(),
            negate,
        });
    }
    Ok(reqs)
}

// ---------------------------------------------------------------------------------------
// Shared state and the handle

#[derive(Clone, Copy, Default, Debug)]
struct Ctl {
    head: u64,
    drop_gen: u64,
    stalled: bool,
}

struct Shared {
    store: Mutex<Store>,
    ctl: watch::Sender<Ctl>,
    unavailable: AtomicBool,
    list_delay_us: AtomicU64,
    bookmark_interval_us: AtomicU64,
    /// Per entry of [`RESOURCES`].
    lists: Vec<AtomicU64>,
    watches: Vec<AtomicU64>,
    open_watches: AtomicU64,
    requests: AtomicU64,
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn notify(&self, head: u64) {
        self.ctl.send_modify(|c| c.head = head);
    }
}

/// A running fake apiserver. Dropping it stops the server and closes every connection.
pub struct FakeApi {
    shared: Arc<Shared>,
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeApi {
    /// Starts a server on 127.0.0.1 with a free port and default [`Options`].
    pub fn start() -> FakeApi {
        FakeApi::start_with(Options::default()).expect("start the fake apiserver")
    }

    pub fn start_with(opts: Options) -> io::Result<FakeApi> {
        let listener = std::net::TcpListener::bind(opts.listen)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (ctl, _) = watch::channel(Ctl::default());
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new(opts.history_limit)),
            ctl,
            unavailable: AtomicBool::new(false),
            list_delay_us: AtomicU64::new(0),
            bookmark_interval_us: AtomicU64::new(duration_us(opts.bookmark_interval)),
            lists: RESOURCES.iter().map(|_| AtomicU64::new(0)).collect(),
            watches: RESOURCES.iter().map(|_| AtomicU64::new(0)).collect(),
            open_watches: AtomicU64::new(0),
            requests: AtomicU64::new(0),
        });
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("ferry-fakeapi")
            .enable_all()
            .build()?;
        let (tx, rx) = oneshot::channel::<()>();
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ferry-fakeapi".into())
            .spawn(move || {
                rt.block_on(async move {
                    let listener = TcpListener::from_std(listener).expect("register the listener");
                    tokio::select! {
                        _ = rx => {}
                        _ = accept_loop(listener, sh) => {}
                    }
                });
                rt.shutdown_background();
            })?;
        Ok(FakeApi {
            shared,
            addr,
            shutdown: Some(tx),
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Creates or updates an object (a `serde_json::Value`, a typed k8s-openapi object or
    /// anything serializing to one with `kind` and `metadata.name`). Sets
    /// metadata.resourceVersion, uid and creationTimestamp (kept on update; namespaced
    /// objects default to namespace `default`), notifies watchers at once and returns the
    /// object's resourceVersion. Applying an identical object is a no-op. Panics on an
    /// unsupported object; see [`FakeApi::try_apply`].
    pub fn apply(&self, obj: impl serde::Serialize) -> u64 {
        let value = serde_json::to_value(obj).expect("object serializes to JSON");
        self.try_apply(value)
            .unwrap_or_else(|e| panic!("fake apiserver apply: {e}"))
    }

    pub fn try_apply(&self, obj: Value) -> Result<u64, String> {
        let mut st = self.shared.store();
        let rv = st.apply(obj)?;
        self.shared.notify(st.rv);
        Ok(rv)
    }

    /// Applies many objects under one lock with one notification (fast bulk loading).
    /// Objects of kind `List` are expanded. Returns how many were applied.
    pub fn apply_all(&self, objs: impl IntoIterator<Item = Value>) -> Result<usize, String> {
        let mut st = self.shared.store();
        let mut n = 0;
        let mut res = Ok(());
        for o in objs.into_iter().flat_map(expand_list) {
            if let Err(e) = st.apply(o) {
                res = Err(e);
                break;
            }
            n += 1;
        }
        self.shared.notify(st.rv);
        res.map(|()| n)
    }

    /// Applies every document of a (multi-document) YAML string, e.g. from
    /// [`crate::manifests`]. Panics on invalid YAML or objects.
    pub fn apply_yaml(&self, yaml: &str) -> usize {
        let docs = parse_yaml(yaml).unwrap_or_else(|e| panic!("fake apiserver apply_yaml: {e}"));
        self.apply_all(docs)
            .unwrap_or_else(|e| panic!("fake apiserver apply_yaml: {e}"))
    }

    /// Applies every `*.yaml`, `*.yml` and `*.json` file of `dir` (sorted by name).
    pub fn load_dir(&self, dir: &Path) -> Result<usize, String> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.is_file()
                    && p.extension()
                        .and_then(|e| e.to_str())
                        .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"))
            })
            .collect();
        files.sort();
        let mut docs = Vec::new();
        for f in files {
            let text = std::fs::read_to_string(&f).map_err(|e| format!("{}: {e}", f.display()))?;
            let parsed = parse_yaml(&text).map_err(|e| format!("{}: {e}", f.display()))?;
            docs.extend(parsed.into_iter().filter(|d| {
                d.get("kind")
                    .and_then(Value::as_str)
                    .and_then(Kind::parse)
                    .is_some()
                    || d.get("kind").and_then(Value::as_str) == Some("List")
            }));
        }
        self.apply_all(docs)
    }

    /// Deletes an object (`ns` is ignored for Nodes); returns whether it existed.
    pub fn delete(&self, kind: Kind, ns: &str, name: &str) -> bool {
        let mut st = self.shared.store();
        let done = st.delete(kind.idx(), ns, name).is_some();
        if done {
            self.shared.notify(st.rv);
        }
        done
    }

    /// The stored object, with its metadata.
    pub fn get(&self, kind: Kind, ns: &str, name: &str) -> Option<Value> {
        let ns = if kind.namespaced() { ns } else { "" };
        let st = self.shared.store();
        st.objects[kind.idx()]
            .get(&(ns.to_string(), name.to_string()))
            .map(|o| o.value.clone())
    }

    /// All stored objects of a kind, ordered by namespace and name.
    pub fn list(&self, kind: Kind) -> Vec<Value> {
        let st = self.shared.store();
        st.objects[kind.idx()]
            .values()
            .map(|o| o.value.clone())
            .collect()
    }

    /// The stored object of any resource in [`RESOURCES`], by `apiVersion` and plural (or
    /// kind); `ns` is ignored for cluster-scoped ones. Panics on an unknown resource.
    pub fn get_object(
        &self,
        api_version: &str,
        plural: &str,
        ns: &str,
        name: &str,
    ) -> Option<Value> {
        let res = resource_index(api_version, plural)
            .unwrap_or_else(|| panic!("fake apiserver: no resource {api_version} {plural}"));
        let ns = if RESOURCES[res].namespaced { ns } else { "" };
        let st = self.shared.store();
        st.objects[res]
            .get(&(ns.to_string(), name.to_string()))
            .map(|o| o.value.clone())
    }

    /// All stored objects of a resource in [`RESOURCES`] in namespace `ns` (all
    /// namespaces when `None`), ordered by namespace and name.
    pub fn list_objects(&self, api_version: &str, plural: &str, ns: Option<&str>) -> Vec<Value> {
        let res = resource_index(api_version, plural)
            .unwrap_or_else(|| panic!("fake apiserver: no resource {api_version} {plural}"));
        let st = self.shared.store();
        st.objects[res]
            .values()
            .filter(|o| ns.is_none_or(|ns| o.ns == ns))
            .map(|o| o.value.clone())
            .collect()
    }

    /// The current (last issued) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.store().rv
    }

    /// Drops the event history and makes every resourceVersion handed out so far too old:
    /// a watch (re)started from one of them gets a 410 Expired ERROR event, a list
    /// continue token answers HTTP 410. Open watches that already sent every event go on.
    pub fn compact(&self) {
        let mut st = self.shared.store();
        st.compact();
        self.shared.notify(st.rv);
    }

    /// Sets how many events are retained (trimming at once if needed).
    pub fn set_history_limit(&self, limit: usize) {
        let mut st = self.shared.store();
        st.history_limit = limit.max(1);
        while st.history.len() > st.history_limit {
            let old = st.history.pop_front().expect("non-empty");
            st.lost_up_to = old.rv;
            st.gone_below = st.gone_below.max(old.rv);
        }
        self.shared.notify(st.rv);
    }

    /// Closes every open watch stream abruptly (no terminating chunk).
    pub fn drop_watches(&self) {
        self.shared.ctl.send_modify(|c| c.drop_gen += 1);
    }

    /// While stalled, open watches stay open but send nothing: no events, no bookmarks,
    /// no end at timeoutSeconds. Unstalling sends what accumulated.
    pub fn stall_watches(&self, stalled: bool) {
        self.shared.ctl.send_modify(|c| c.stalled = stalled);
    }

    /// Delays every list response (after taking its snapshot).
    pub fn set_list_delay(&self, delay: Duration) {
        self.shared
            .list_delay_us
            .store(duration_us(delay), Ordering::Relaxed);
    }

    pub fn set_bookmark_interval(&self, interval: Duration) {
        self.shared
            .bookmark_interval_us
            .store(duration_us(interval), Ordering::Relaxed);
        self.shared.ctl.send_modify(|_| {});
    }

    /// While true every request is answered 503 (`ServiceUnavailable` Status) and its
    /// connection closed; turning it on also closes every open watch abruptly.
    pub fn set_unavailable(&self, unavailable: bool) {
        self.shared.unavailable.store(unavailable, Ordering::SeqCst);
        if unavailable {
            self.drop_watches();
        }
    }

    /// Lists served for `kind` (continuation pages not counted).
    pub fn list_count(&self, kind: Kind) -> u64 {
        self.shared.lists[kind.idx()].load(Ordering::SeqCst)
    }

    /// Watches started for `kind`.
    pub fn watch_count(&self, kind: Kind) -> u64 {
        self.shared.watches[kind.idx()].load(Ordering::SeqCst)
    }

    /// Watch streams open right now (all kinds).
    pub fn open_watches(&self) -> u64 {
        self.shared.open_watches.load(Ordering::SeqCst)
    }

    /// HTTP requests received (all paths).
    pub fn request_count(&self) -> u64 {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// Writes a kubeconfig whose current context `ferry-fake` points at [`FakeApi::url`].
    pub fn write_kubeconfig(&self, path: &Path) -> io::Result<()> {
        std::fs::write(path, kubeconfig_yaml(&self.url()))
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A kubeconfig (cluster, user and context `ferry-fake`, namespace `default`) for `url`.
pub fn kubeconfig_yaml(url: &str) -> String {
    let cfg = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "ferry-fake", "cluster": {"server": url}}],
        "users": [{"name": "ferry-fake", "user": {}}],
        "contexts": [{"name": "ferry-fake", "context": {"cluster": "ferry-fake", "user": "ferry-fake", "namespace": "default"}}],
        "current-context": "ferry-fake",
        "preferences": {},
    });
    serde_yaml::to_string(&cfg).expect("kubeconfig serializes")
}

/// Every non-empty document of a multi-document YAML (or JSON) string.
pub fn parse_yaml(text: &str) -> Result<Vec<Value>, String> {
    use serde::Deserialize as _;
    let mut out = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let v = Value::deserialize(doc).map_err(|e| e.to_string())?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

fn expand_list(v: Value) -> Vec<Value> {
    if v.get("kind").and_then(Value::as_str) == Some("List") {
        match v.get("items") {
            Some(Value::Array(items)) => items.clone(),
            _ => Vec::new(),
        }
    } else {
        vec![v]
    }
}

/// `services` Services `svc-0..` in namespace `default`, each with a ClusterIP from
/// 10.96.0.0/12, port 80/TCP (`http`, targetPort 8080) and one EndpointSlice `svc-i-0`
/// of `endpoints_per_service` ready IPv4 endpoints (from 10.128.0.0/9, port 8080), each
/// with the `nodeName` of one of 100 nodes, as the EndpointSlice controller writes it.
/// Returned in apply order (each Service before its slice).
pub fn generate(services: usize, endpoints_per_service: usize) -> Vec<Value> {
    let ip = |n: u32| std::net::Ipv4Addr::from(n).to_string();
    let svc_base = u32::from(std::net::Ipv4Addr::new(10, 96, 0, 0));
    let ep_base = u32::from(std::net::Ipv4Addr::new(10, 128, 0, 0));
    let mut out = Vec::with_capacity(services * 2);
    for i in 0..services {
        let name = format!("svc-{i}");
        let cip = ip(svc_base + 10 + i as u32);
        out.push(json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "type": "ClusterIP",
                "clusterIP": cip,
                "clusterIPs": [cip],
                "ipFamilies": ["IPv4"],
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
            },
        }));
        let endpoints: Vec<Value> = (0..endpoints_per_service)
            .map(|j| {
                let n = ep_base + 1 + (i * endpoints_per_service + j) as u32;
                json!({
                    "addresses": [ip(n)],
                    "conditions": {"ready": true, "serving": true, "terminating": false},
                    "nodeName": format!("node-{}", n % 100),
                })
            })
            .collect();
        out.push(json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": format!("{name}-0"),
                "namespace": "default",
                "labels": {
                    "kubernetes.io/service-name": name,
                    "endpointslice.kubernetes.io/managed-by": "ferry-fakeapi",
                },
            },
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        }));
    }
    out
}

fn duration_us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

use ferry::http::rfc3339;

// ---------------------------------------------------------------------------------------
// HTTP

async fn accept_loop(listener: TcpListener, sh: Arc<Shared>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(serve_conn(sh.clone(), stream));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

struct Request {
    method: String,
    path: String,
    query: Vec<(String, String)>,
    close: bool,
    content_type: String,
    body: Vec<u8>,
}

impl Request {
    fn param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn flag(&self, name: &str) -> bool {
        matches!(self.param(name), Some("true" | "1"))
    }
}

enum Flow {
    KeepAlive,
    Close,
}

struct Conn {
    rd: OwnedReadHalf,
    wr: OwnedWriteHalf,
    buf: Vec<u8>,
}

const MAX_HEAD: usize = 64 * 1024;

impl Conn {
    /// The next request with its body; `None` at EOF or on garbage.
    async fn read_request(&mut self) -> Option<Request> {
        loop {
            if let Some(end) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&self.buf[..end]).into_owned();
                self.buf.drain(..end + 4);
                let mut lines = head.split("\r\n");
                let mut first = lines.next()?.split(' ');
                let (method, target, version) = (first.next()?, first.next()?, first.next()?);
                let mut close = version == "HTTP/1.0";
                let mut body_len = 0usize;
                let mut content_type = String::new();
                for line in lines {
                    let (k, v) = line.split_once(':')?;
                    let v = v.trim();
                    if k.eq_ignore_ascii_case("content-length") {
                        body_len = v.parse().ok()?;
                    } else if k.eq_ignore_ascii_case("content-type") {
                        content_type = v.to_ascii_lowercase();
                    } else if k.eq_ignore_ascii_case("connection") {
                        close = v.eq_ignore_ascii_case("close");
                    } else if k.eq_ignore_ascii_case("transfer-encoding") {
                        return None; // clients send bodies with a Content-Length
                    }
                }
                while self.buf.len() < body_len {
                    if self.rd.read_buf(&mut self.buf).await.ok()? == 0 {
                        return None;
                    }
                }
                let body = self.buf.drain(..body_len).collect();
                let (path, query) = target.split_once('?').unwrap_or((target, ""));
                let query = query
                    .split('&')
                    .filter(|p| !p.is_empty())
                    .map(|p| {
                        let (k, v) = p.split_once('=').unwrap_or((p, ""));
                        (percent_decode(k), percent_decode(v))
                    })
                    .collect();
                return Some(Request {
                    method: method.to_string(),
                    path: percent_decode(path),
                    query,
                    close,
                    content_type,
                    body,
                });
            }
            if self.buf.len() > MAX_HEAD {
                return None;
            }
            if self.rd.read_buf(&mut self.buf).await.ok()? == 0 {
                return None;
            }
        }
    }

    async fn respond(&mut self, code: u16, body: &[u8], close: bool) -> Flow {
        let head = format!(
            "HTTP/1.1 {code} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nCache-Control: no-cache, private\r\n{}\r\n",
            reason_phrase(code),
            body.len(),
            if close { "Connection: close\r\n" } else { "" }
        );
        let mut out = Vec::with_capacity(head.len() + body.len());
        out.extend_from_slice(head.as_bytes());
        out.extend_from_slice(body);
        if self.wr.write_all(&out).await.is_err() || close {
            let _ = self.wr.shutdown().await;
            return Flow::Close;
        }
        Flow::KeepAlive
    }

    async fn status(&mut self, code: u16, reason: &str, message: &str, close: bool) -> Flow {
        let body = status_json(code, reason, message).to_string();
        self.respond(code, body.as_bytes(), close).await
    }

    async fn chunk(&mut self, data: &[u8]) -> io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let mut out = Vec::with_capacity(data.len() + 16);
        let _ = write!(StrBuf(&mut out), "{:x}\r\n", data.len());
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
        self.wr.write_all(&out).await
    }

    async fn end_chunks(&mut self) -> io::Result<()> {
        self.wr.write_all(b"0\r\n\r\n").await
    }
}

/// `fmt::Write` into a byte buffer.
struct StrBuf<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for StrBuf<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

fn reason_phrase(code: u16) -> &'static str {
    match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        410 => "Gone",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

fn status_json(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = |c: u8| (c as char).to_digit(16);
                match (hex(b[i + 1]), hex(b[i + 2])) {
                    (Some(h), Some(l)) => {
                        out.push((h * 16 + l) as u8);
                        i += 2;
                    }
                    _ => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

enum Route {
    /// A resource (index into [`RESOURCES`]), all namespaces or one.
    Collection(usize, Option<String>),
    /// A resource, namespace (empty for cluster-scoped), name, and whether the path
    /// is the `/status` subresource.
    Object(usize, String, String, bool),
    Static(Value),
    NotFound,
}

fn route(path: &str, addr: &str) -> Route {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let res_of = |group: &[&str], plural: &str| -> Option<usize> {
        RESOURCES.iter().position(|r| {
            r.plural == plural
                && match group {
                    ["api", "v1"] => r.group.is_empty() && r.version == "v1",
                    ["apis", g, v] => r.group == *g && r.version == *v,
                    _ => false,
                }
        })
    };
    let (group, rest) = match segs.as_slice() {
        ["api", "v1", rest @ ..] => (&segs[..2], rest),
        ["apis", _, _, rest @ ..] => (&segs[..3], rest),
        _ => (&segs[..0], &segs[..0]),
    };
    let scoped = |plural: &str, namespaced: bool| {
        res_of(group, plural).filter(|&r| RESOURCES[r].namespaced == namespaced)
    };
    let with_status = |plural: &str, namespaced: bool| {
        scoped(plural, namespaced).filter(|&r| RESOURCES[r].status)
    };
    let found =
        match rest {
            [plural] => res_of(group, plural).map(|r| Route::Collection(r, None)),
            [plural, name] => scoped(plural, false)
                .map(|r| Route::Object(r, String::new(), name.to_string(), false)),
            [plural, name, "status"] => with_status(plural, false)
                .map(|r| Route::Object(r, String::new(), name.to_string(), true)),
            ["namespaces", ns, plural] => {
                scoped(plural, true).map(|r| Route::Collection(r, Some(ns.to_string())))
            }
            ["namespaces", ns, plural, name] => scoped(plural, true)
                .map(|r| Route::Object(r, ns.to_string(), name.to_string(), false)),
            ["namespaces", ns, plural, name, "status"] => with_status(plural, true)
                .map(|r| Route::Object(r, ns.to_string(), name.to_string(), true)),
            _ => None,
        };
    if let Some(r) = found {
        return r;
    }
    let resources = |group: &str, version: &str| {
        let mut res = Vec::new();
        for r in RESOURCES
            .iter()
            .filter(|r| r.group == group && r.version == version)
        {
            let verbs = if r.builtin() {
                json!(["get", "list", "watch"])
            } else {
                json!([
                    "create", "delete", "get", "list", "patch", "update", "watch"
                ])
            };
            res.push(json!({
                "name": r.plural,
                "singularName": r.kind.to_ascii_lowercase(),
                "namespaced": r.namespaced,
                "kind": r.kind,
                "verbs": verbs,
            }));
            if r.status {
                res.push(json!({
                    "name": format!("{}/status", r.plural),
                    "singularName": "",
                    "namespaced": r.namespaced,
                    "kind": r.kind,
                    "verbs": ["get", "patch", "update"],
                }));
            }
        }
        json!({"kind": "APIResourceList", "apiVersion": "v1",
               "groupVersion": RESOURCES.iter().find(|r| r.group == group).map_or_else(String::new, Resource::api_version),
               "resources": res})
    };
    let api_group = |name: &str| -> Option<Value> {
        let r = RESOURCES
            .iter()
            .find(|r| r.group == name && !name.is_empty())?;
        let gv = json!({"groupVersion": r.api_version(), "version": r.version});
        Some(json!({"name": name, "versions": [gv], "preferredVersion": gv}))
    };
    let v = match segs.as_slice() {
        ["version"] => json!({
            "major": "1", "minor": "33", "gitVersion": "v1.33.0-ferry-fakeapi",
            "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
            "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.24.0", "compiler": "gc",
            "platform": "linux/amd64",
        }),
        ["api"] => json!({
            "kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": addr}],
        }),
        ["apis"] => {
            let mut names: Vec<&str> = Vec::new();
            for r in RESOURCES.iter().filter(|r| !r.group.is_empty()) {
                if !names.contains(&r.group) {
                    names.push(r.group);
                }
            }
            let groups: Vec<Value> = names.into_iter().filter_map(api_group).collect();
            json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
        }
        ["apis", g] => match api_group(g) {
            Some(mut g) => {
                g["kind"] = "APIGroup".into();
                g["apiVersion"] = "v1".into();
                g
            }
            None => return Route::NotFound,
        },
        ["api", "v1"] => resources("", "v1"),
        ["apis", g, v] if RESOURCES.iter().any(|r| r.group == *g && r.version == *v) => {
            resources(g, v)
        }
        ["healthz" | "readyz" | "livez"] => Value::String("ok".into()),
        _ => return Route::NotFound,
    };
    Route::Static(v)
}

async fn serve_conn(sh: Arc<Shared>, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let local = stream
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let (rd, wr) = stream.into_split();
    let mut c = Conn {
        rd,
        wr,
        buf: Vec::with_capacity(4096),
    };
    while let Some(req) = c.read_request().await {
        sh.requests.fetch_add(1, Ordering::Relaxed);
        let flow = handle(&sh, &mut c, &req, &local).await;
        if matches!(flow, Flow::Close) || req.close {
            let _ = c.wr.shutdown().await;
            return;
        }
    }
}

async fn handle(sh: &Shared, c: &mut Conn, req: &Request, local: &str) -> Flow {
    if sh.unavailable.load(Ordering::SeqCst) {
        return c
            .status(
                503,
                "ServiceUnavailable",
                "the fake apiserver is unavailable",
                true,
            )
            .await;
    }
    let route = route(&req.path, local);
    if req.method != "GET" {
        let target = match route {
            Route::Collection(res, Some(ns)) if req.method == "POST" => {
                Some((res, ns, None, false))
            }
            Route::Collection(res, None) if req.method == "POST" && !RESOURCES[res].namespaced => {
                Some((res, String::new(), None, false))
            }
            Route::Object(res, ns, name, status)
                if matches!(req.method.as_str(), "PUT" | "PATCH" | "DELETE") =>
            {
                Some((res, ns, Some(name), status))
            }
            _ => None,
        };
        let Some((res, ns, name, status)) = target else {
            return c
                .status(
                    405,
                    "MethodNotAllowed",
                    "the fake apiserver does not serve this method here",
                    req.close,
                )
                .await;
        };
        let answer = {
            let mut st = sh.store();
            let answer = write(&mut st, req, res, &ns, name.as_deref(), status);
            sh.notify(st.rv);
            answer
        };
        return match answer {
            Ok((code, v)) => c.respond(code, v.to_string().as_bytes(), req.close).await,
            Err(e) => c.status(e.code, e.reason, &e.message, req.close).await,
        };
    }
    match route {
        Route::Static(Value::String(s)) => c.respond(200, s.as_bytes(), req.close).await,
        Route::Static(v) => c.respond(200, v.to_string().as_bytes(), req.close).await,
        Route::NotFound => {
            let msg = "the server could not find the requested resource";
            c.status(404, "NotFound", msg, req.close).await
        }
        Route::Object(res, ns, name, _status) => {
            let obj = {
                let st = sh.store();
                st.objects[res].get(&(ns, name.clone())).cloned()
            };
            match obj {
                Some(o) => c.respond(200, &o.json, req.close).await,
                None => {
                    let msg = format!("{} \"{name}\" not found", RESOURCES[res].plural);
                    c.status(404, "NotFound", &msg, req.close).await
                }
            }
        }
        Route::Collection(res, ns) => {
            let sel = match Selectors::parse(
                req.param("labelSelector").unwrap_or(""),
                req.param("fieldSelector").unwrap_or(""),
            ) {
                Ok(s) => s,
                Err(e) => return c.status(400, "BadRequest", &e, req.close).await,
            };
            if req.flag("watch") {
                serve_watch(sh, c, req, res, ns.as_deref(), &sel).await
            } else {
                serve_list(sh, c, req, res, ns.as_deref(), &sel).await
            }
        }
    }
}

/// A failed write, answered as a `Status`.
#[derive(Debug)]
struct ApiError {
    code: u16,
    reason: &'static str,
    message: String,
}

fn api_error(code: u16, reason: &'static str, message: impl Into<String>) -> ApiError {
    ApiError {
        code,
        reason,
        message: message.into(),
    }
}

/// The writes a controller makes, on the object at `ns`/`name` of resource `res` (or a
/// POST to its collection when `name` is `None`):
///
/// - POST creates (409 `AlreadyExists` if present); PUT replaces (404 if absent);
/// - PATCH with `application/merge-patch+json` (and `strategic-merge-patch+json`, treated
///   as a plain merge patch) merges into the stored object (404 if absent);
/// - PATCH with `application/apply-patch+yaml` (server-side apply) is simplified to a
///   merge patch of the applied fields that creates the object when absent: there are no
///   field managers, so a field a manager stops applying is kept, not removed, and there
///   are no conflicts (as if every apply were `force=true`);
/// - a `metadata.resourceVersion` in a PUT body or a patch is a precondition (409
///   `Conflict` when stale);
/// - on a resource with a status subresource, writes to the object keep the stored
///   status (a create drops it) and writes to `/status` change only the status;
/// - DELETE removes the object, unless it has finalizers: then it gets a
///   `deletionTimestamp` and stays until a write removes the last finalizer.
///
/// JSON patch (`application/json-patch+json`) is not served (415).
fn write(
    st: &mut Store,
    req: &Request,
    res: usize,
    ns: &str,
    name: Option<&str>,
    to_status: bool,
) -> Result<(u16, Value), ApiError> {
    let def = &RESOURCES[res];
    let current = name.and_then(|n| {
        st.objects[res]
            .get(&(ns.to_string(), n.to_string()))
            .map(|o| o.value.clone())
    });
    let not_found = || {
        let n = name.unwrap_or_default();
        api_error(
            404,
            "NotFound",
            format!("{}.{} \"{n}\" not found", def.plural, def.group),
        )
    };
    let body = || -> Result<Value, ApiError> {
        let parsed = serde_json::from_slice::<Value>(&req.body).or_else(|e| {
            if req.content_type.starts_with("application/apply-patch+yaml") {
                serde_yaml::from_slice::<Value>(&req.body).map_err(|e| e.to_string())
            } else {
                Err(e.to_string())
            }
        });
        parsed.map_err(|e| api_error(400, "BadRequest", format!("the request body: {e}")))
    };
    let precondition = |given: &Value| -> Result<(), ApiError> {
        let given = given
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str);
        let stored = current
            .as_ref()
            .and_then(|c| c.pointer("/metadata/resourceVersion"))
            .and_then(Value::as_str);
        match given {
            Some(g) if !g.is_empty() && Some(g) != stored => Err(api_error(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on {}.{} \"{}\": the object has been modified; please apply your changes to the latest version and try again",
                    def.plural,
                    def.group,
                    name.unwrap_or_default()
                ),
            )),
            _ => Ok(()),
        }
    };
    let (code, mut next) = match req.method.as_str() {
        "POST" => {
            let mut v = body()?;
            let n = v
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            if n.is_empty() {
                return Err(api_error(422, "Invalid", "metadata.name: Required value"));
            }
            if st.objects[res].contains_key(&(ns.to_string(), n.clone())) {
                return Err(api_error(
                    409,
                    "AlreadyExists",
                    format!("{}.{} \"{n}\" already exists", def.plural, def.group),
                ));
            }
            if def.status
                && let Some(m) = v.as_object_mut()
            {
                m.remove("status");
            }
            if let Some(m) = v.get_mut("metadata").and_then(Value::as_object_mut) {
                m.remove("resourceVersion");
                m.remove("deletionTimestamp");
            }
            (201, v)
        }
        "PUT" => {
            let v = body()?;
            if current.is_none() {
                return Err(not_found());
            }
            precondition(&v)?;
            (200, v)
        }
        "PATCH" => {
            let ct = req.content_type.as_str();
            let apply = ct.starts_with("application/apply-patch+yaml");
            if !(apply
                || ct.starts_with("application/merge-patch+json")
                || ct.starts_with("application/strategic-merge-patch+json"))
            {
                return Err(api_error(
                    415,
                    "UnsupportedMediaType",
                    format!("the fake apiserver does not serve patches of type {ct:?}"),
                ));
            }
            let patch = body()?;
            precondition(&patch)?;
            let mut v = match (&current, apply && !to_status) {
                (Some(c), _) => c.clone(),
                (None, true) => {
                    json!({"apiVersion": def.api_version(), "kind": def.kind, "metadata": {}})
                }
                (None, false) => return Err(not_found()),
            };
            merge_patch(&mut v, &patch);
            (if current.is_some() { 200 } else { 201 }, v)
        }
        "DELETE" => {
            let Some(v) = current.clone() else {
                return Err(not_found());
            };
            let finalizers = v
                .pointer("/metadata/finalizers")
                .and_then(Value::as_array)
                .is_some_and(|f| !f.is_empty());
            if !finalizers {
                let (n, last) = (name.unwrap_or_default(), v.clone());
                st.delete(res, ns, n);
                return Ok((200, last));
            }
            (200, v)
        }
        _ => return Err(api_error(405, "MethodNotAllowed", "unsupported method")),
    };
    if !next.get("metadata").is_some_and(Value::is_object) {
        next["metadata"] = json!({});
    }
    let n = match name {
        Some(n) => n.to_string(),
        None => next["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    };
    next["metadata"]["name"] = n.clone().into();
    if def.namespaced {
        next["metadata"]["namespace"] = ns.into();
    }
    if let Some(cur) = &current {
        // The status subresource, and what only the server sets.
        if def.status {
            let (from, to) = if to_status {
                (&next, cur.clone())
            } else {
                (cur, next.clone())
            };
            let mut merged = to;
            match from.get("status") {
                Some(s) => merged["status"] = s.clone(),
                None => {
                    if let Some(m) = merged.as_object_mut() {
                        m.remove("status");
                    }
                }
            }
            next = merged;
        }
        for f in [
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
        ] {
            let meta = next["metadata"].as_object_mut().expect("an object");
            match cur["metadata"].get(f) {
                Some(v) => meta.insert(f.into(), v.clone()),
                None => meta.remove(f),
            };
        }
        if req.method == "DELETE" {
            next["metadata"]["deletionTimestamp"] = next_deletion(cur);
            next["metadata"]["deletionGracePeriodSeconds"] = 0.into();
        }
    }
    let deleting = next
        .pointer("/metadata/deletionTimestamp")
        .is_some_and(|t| !t.is_null());
    let finalizers = next
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_some_and(|f| !f.is_empty());
    if deleting && !finalizers {
        st.delete(res, ns, &n);
        return Ok((200, next));
    }
    st.upsert(res, next)
        .map_err(|e| api_error(422, "Invalid", e))?;
    let stored = st.objects[res]
        .get(&(
            if def.namespaced {
                ns.to_string()
            } else {
                String::new()
            },
            n,
        ))
        .map(|o| o.value.clone())
        .unwrap_or_default();
    Ok((code, stored))
}

/// The deletionTimestamp a DELETE leaves: the first one stays.
fn next_deletion(cur: &Value) -> Value {
    cur.pointer("/metadata/deletionTimestamp")
        .cloned()
        .unwrap_or_else(|| rfc3339(SystemTime::now()).into())
}

async fn serve_list(
    sh: &Shared,
    c: &mut Conn,
    req: &Request,
    res: usize,
    ns: Option<&str>,
    sel: &Selectors,
) -> Flow {
    let limit = req
        .param("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|&l| l > 0);
    // (snapshot rv, items, offset, snapshot id if paginated)
    let (rv, items, offset, id) = match req.param("continue").filter(|t| !t.is_empty()) {
        Some(token) => {
            let snap = parse_continue(token).and_then(|(rv, id, off)| {
                let st = sh.store();
                st.snapshots
                    .get(&id)
                    .filter(|s| s.rv == rv && rv >= st.gone_below)
                    .map(|s| (s.rv, s.items.clone(), off, Some(id)))
            });
            match snap {
                Some(s) => s,
                None => {
                    let msg = "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.";
                    return c.status(410, "Expired", msg, req.close).await;
                }
            }
        }
        None => {
            sh.lists[res].fetch_add(1, Ordering::SeqCst);
            let mut st = sh.store();
            let items = Arc::new(st.matching(res, ns, sel));
            let rv = st.rv;
            let id = match limit {
                Some(l) if items.len() > l => Some(st.add_snapshot(rv, items.clone())),
                _ => None,
            };
            (rv, items, 0, id)
        }
    };
    let delay = sh.list_delay_us.load(Ordering::Relaxed);
    if delay > 0 {
        tokio::time::sleep(Duration::from_micros(delay)).await;
    }
    let offset = offset.min(items.len());
    let end = limit.map_or(items.len(), |l| (offset + l).min(items.len()));
    let page = &items[offset..end];
    let mut body = Vec::with_capacity(page.iter().map(|o| o.json.len() + 1).sum::<usize>() + 256);
    {
        let mut w = StrBuf(&mut body);
        let _ = write!(
            w,
            "{{\"kind\":\"{}List\",\"apiVersion\":\"{}\",\"metadata\":{{\"resourceVersion\":\"{rv}\"",
            RESOURCES[res].kind,
            RESOURCES[res].api_version()
        );
        if let (Some(id), true) = (id, end < items.len()) {
            let _ = write!(
                w,
                ",\"continue\":\"{rv}.{id}.{end}\",\"remainingItemCount\":{}",
                items.len() - end
            );
        }
        let _ = write!(w, "}},\"items\":[");
    }
    for (i, o) in page.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(&o.json);
    }
    body.extend_from_slice(b"]}");
    c.respond(200, &body, req.close).await
}

fn parse_continue(token: &str) -> Option<(u64, u64, usize)> {
    let mut it = token.split('.');
    let t = (
        it.next()?.parse().ok()?,
        it.next()?.parse().ok()?,
        it.next()?.parse().ok()?,
    );
    it.next().is_none().then_some(t)
}

fn push_event(out: &mut Vec<u8>, typ: &str, obj: &[u8]) {
    out.extend_from_slice(b"{\"type\":\"");
    out.extend_from_slice(typ.as_bytes());
    out.extend_from_slice(b"\",\"object\":");
    out.extend_from_slice(obj);
    out.extend_from_slice(b"}\n");
}

fn push_bookmark(out: &mut Vec<u8>, res: usize, rv: u64, initial_end: bool) {
    let annotations = if initial_end {
        ",\"annotations\":{\"k8s.io/initial-events-end\":\"true\"}"
    } else {
        ""
    };
    let obj = format!(
        "{{\"kind\":\"{}\",\"apiVersion\":\"{}\",\"metadata\":{{\"resourceVersion\":\"{rv}\"{annotations}}}}}",
        RESOURCES[res].kind,
        RESOURCES[res].api_version()
    );
    push_event(out, "BOOKMARK", obj.as_bytes());
}

fn expired_event(rv: u64, oldest: u64) -> Vec<u8> {
    let msg = format!("too old resource version: {rv} ({oldest})");
    let obj = status_json(410, "Expired", &msg).to_string();
    let mut out = Vec::new();
    push_event(&mut out, "ERROR", obj.as_bytes());
    out
}

/// Appends the events after `cursor` that this watch sees, advancing the cursor past
/// every retained event. `Err(())` when events it had not seen were dropped.
fn scan(
    st: &Store,
    cursor: &mut u64,
    res: usize,
    ns: Option<&str>,
    sel: &Selectors,
    out: &mut Vec<u8>,
) -> Result<(), ()> {
    if *cursor < st.lost_up_to {
        return Err(());
    }
    let start = st.history.partition_point(|e| e.rv <= *cursor);
    for e in st.history.range(start..) {
        *cursor = e.rv;
        if e.res != res || ns.is_some_and(|ns| ns != e.new.ns) {
            continue;
        }
        let old = e.old.as_ref().is_some_and(|o| sel.matches(o));
        let new = sel.matches(&e.new);
        let typ = match e.typ {
            EvType::Deleted => old.then_some("DELETED"),
            EvType::Added => new.then_some("ADDED"),
            EvType::Modified => match (old, new) {
                (true, true) => Some("MODIFIED"),
                (true, false) => Some("DELETED"),
                (false, true) => Some("ADDED"),
                (false, false) => None,
            },
        };
        if let Some(t) = typ {
            push_event(out, t, &e.new.json);
        }
    }
    Ok(())
}

struct OpenWatch<'a>(&'a AtomicU64);

impl Drop for OpenWatch<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn serve_watch(
    sh: &Shared,
    c: &mut Conn,
    req: &Request,
    res: usize,
    ns: Option<&str>,
    sel: &Selectors,
) -> Flow {
    sh.watches[res].fetch_add(1, Ordering::SeqCst);
    let bookmarks = req.flag("allowWatchBookmarks");
    let send_initial = req.flag("sendInitialEvents");
    let timeout = req
        .param("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .filter(|&t| t > 0)
        .map(Duration::from_secs);
    let deadline = timeout.map(|t| Instant::now() + t);
    let from = req
        .param("resourceVersion")
        .filter(|rv| !rv.is_empty() && *rv != "0");
    let from = match from.map(str::parse::<u64>) {
        Some(Err(_)) => {
            return c
                .status(400, "BadRequest", "invalid resourceVersion", req.close)
                .await;
        }
        Some(Ok(rv)) => Some(rv),
        None => None,
    };

    let mut ctl_rx = sh.ctl.subscribe();
    let drop_gen = ctl_rx.borrow_and_update().drop_gen;
    let mut out = Vec::new();
    let mut cursor;
    let mut expired = None;
    {
        let st = sh.store();
        match from {
            Some(rv) if !send_initial => {
                cursor = rv;
                if rv < st.gone_below {
                    expired = Some(expired_event(rv, st.gone_below));
                }
            }
            _ => {
                for o in st.matching(res, ns, sel) {
                    push_event(&mut out, "ADDED", &o.json);
                }
                cursor = st.rv;
                if send_initial && bookmarks {
                    push_bookmark(&mut out, res, cursor, true);
                }
            }
        }
    }

    let head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nCache-Control: no-cache, private\r\nTransfer-Encoding: chunked\r\n\r\n";
    if c.wr.write_all(head.as_bytes()).await.is_err() {
        return Flow::Close;
    }
    if let Some(err) = expired {
        if c.chunk(&err).await.is_err() || c.end_chunks().await.is_err() {
            return Flow::Close;
        }
        return Flow::KeepAlive;
    }
    sh.open_watches.fetch_add(1, Ordering::SeqCst);
    let _open = OpenWatch(&sh.open_watches);
    let interval =
        || Duration::from_micros(sh.bookmark_interval_us.load(Ordering::Relaxed).max(1000));
    let mut next_bookmark = Instant::now() + interval();
    let mut tmp = [0u8; 1024];
    loop {
        let ctl = *ctl_rx.borrow_and_update();
        if ctl.drop_gen != drop_gen {
            return Flow::Close;
        }
        if !ctl.stalled {
            let gone = {
                let st = sh.store();
                let r = scan(&st, &mut cursor, res, ns, sel, &mut out);
                r.err().map(|()| expired_event(cursor, st.gone_below))
            };
            if let Some(err) = gone {
                out.extend_from_slice(&err);
                let ok = c.chunk(&out).await.is_ok() && c.end_chunks().await.is_ok();
                return if ok { Flow::KeepAlive } else { Flow::Close };
            }
            let now = Instant::now();
            if bookmarks && now >= next_bookmark {
                push_bookmark(&mut out, res, cursor, false);
                next_bookmark = now + interval();
            }
            if c.chunk(&out).await.is_err() {
                return Flow::Close;
            }
            out.clear();
            if deadline.is_some_and(|d| now >= d) {
                return match c.end_chunks().await {
                    Ok(()) => Flow::KeepAlive,
                    Err(_) => Flow::Close,
                };
            }
        }
        let far = Instant::now() + Duration::from_secs(86_400);
        let wake = match (bookmarks, deadline) {
            (true, Some(d)) => next_bookmark.min(d),
            (true, None) => next_bookmark,
            (false, Some(d)) => d,
            (false, None) => far,
        };
        tokio::select! {
            r = ctl_rx.changed() => if r.is_err() { return Flow::Close },
            _ = tokio::time::sleep_until(wake), if !ctl.stalled => {}
            r = c.rd.read(&mut tmp) => match r {
                Ok(0) | Err(_) => return Flow::Close,
                Ok(n) => c.buf.extend_from_slice(&tmp[..n]),
            },
        }
    }
}

#[cfg(test)]
mod unit {
    use super::*;

    fn req(method: &str, content_type: &str, body: Value) -> Request {
        Request {
            method: method.into(),
            path: String::new(),
            query: Vec::new(),
            close: false,
            content_type: content_type.into(),
            body: serde_json::to_vec(&body).unwrap(),
        }
    }

    const MERGE: &str = "application/merge-patch+json";
    const APPLY: &str = "application/apply-patch+yaml";

    #[test]
    fn generic_writes() {
        let networks = resource_index("extensions.gardener.cloud/v1alpha1", "networks").unwrap();
        let mut st = Store::new(100);
        let w = |st: &mut Store, method, ct, name: Option<&str>, status, body| {
            write(st, &req(method, ct, body), networks, "ns", name, status)
        };
        // Create drops the status (a subresource) and starts at generation 1.
        let n = json!({"apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "Network",
                       "metadata": {"name": "a", "finalizers": ["f"]},
                       "spec": {"type": "ferry"}, "status": {"x": 1}});
        let (code, v) = w(&mut st, "POST", "application/json", None, false, n.clone()).unwrap();
        assert_eq!((code, &v["metadata"]["generation"]), (201, &json!(1)));
        assert!(v.get("status").is_none());
        assert_eq!(
            w(&mut st, "POST", "application/json", None, false, n)
                .err()
                .unwrap()
                .code,
            409
        );
        // /status changes only the status; the object keeps it.
        let patch = json!({"status": {"x": 2}, "spec": {"type": "other"}});
        let (_, v) = w(&mut st, "PATCH", MERGE, Some("a"), true, patch).unwrap();
        assert_eq!(
            (&v["status"]["x"], &v["spec"]["type"]),
            (&json!(2), &json!("ferry"))
        );
        let patch = json!({"status": null, "spec": {"type": "calico"}});
        let (_, v) = w(&mut st, "PATCH", MERGE, Some("a"), false, patch).unwrap();
        assert_eq!(v["status"]["x"], 2);
        assert_eq!(v["metadata"]["generation"], 2, "a spec change");
        let (_, v) = w(
            &mut st,
            "PATCH",
            MERGE,
            Some("a"),
            false,
            json!({"metadata": {"labels": {"l": "1"}}}),
        )
        .unwrap();
        assert_eq!(v["metadata"]["generation"], 2, "metadata only");
        // A stale resourceVersion is a conflict.
        let stale = json!({"metadata": {"resourceVersion": "1", "finalizers": []}});
        assert_eq!(
            w(&mut st, "PATCH", MERGE, Some("a"), false, stale)
                .err()
                .unwrap()
                .code,
            409
        );
        // Finalizers hold a delete; dropping the last one completes it.
        let (_, v) = w(
            &mut st,
            "DELETE",
            "application/json",
            Some("a"),
            false,
            json!({}),
        )
        .unwrap();
        assert!(v["metadata"]["deletionTimestamp"].is_string());
        assert!(st.objects[networks].contains_key(&("ns".into(), "a".into())));
        w(
            &mut st,
            "PATCH",
            MERGE,
            Some("a"),
            false,
            json!({"metadata": {"finalizers": null}}),
        )
        .unwrap();
        assert!(st.objects[networks].is_empty());
        // Apply creates; a merge patch of an absent object is 404.
        assert_eq!(
            w(&mut st, "PATCH", MERGE, Some("b"), false, json!({}))
                .err()
                .unwrap()
                .code,
            404
        );
        let (code, v) = w(
            &mut st,
            "PATCH",
            APPLY,
            Some("b"),
            false,
            json!({"spec": {"type": "ferry"}}),
        )
        .unwrap();
        assert_eq!(
            (code, &v["metadata"]["name"], &v["kind"]),
            (201, &json!("b"), &json!("Network"))
        );
        let code = w(
            &mut st,
            "PATCH",
            "application/json-patch+json",
            Some("b"),
            false,
            json!([]),
        );
        assert_eq!(code.err().unwrap().code, 415);
    }

    #[test]
    fn label_selectors() {
        let r = parse_label_selector("!a, b ,c=d,e!=f,g in (x, y),h notin (z)").unwrap();
        assert_eq!(r.len(), 6);
        assert!(parse_label_selector("=x").is_err());
        assert_eq!(
            percent_decode("%21service.kubernetes.io%2Fx+y"),
            "!service.kubernetes.io/x y"
        );
    }
}
