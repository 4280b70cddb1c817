//! The Kubernetes API source: Services, EndpointSlices and this Node through kube-rs
//! watchers, reported as [`SourceEvent`]s.
//!
//! - [`client`] connects with a kubeconfig (its current context) or, in a pod, with
//!   `KUBERNETES_SERVICE_HOST`/`KUBERNETES_SERVICE_PORT` and the service-account files.
//!   The API server address is used exactly as given: ferry must reach the API server
//!   before any ClusterIP works, so it is never rewritten to the `kubernetes` Service's
//!   ClusterIP or `kubernetes.default.svc` (KP-22).
//! - [`run`] watches Services and EndpointSlices with kube-proxy's informer selector
//!   (KP-01) and this node's Node by `metadata.name` (KP-22). Every (re)list is reported
//!   as a whole set (`*Reset`), so deletions missed while disconnected are caught.
//! - Objects are decoded leniently ([`super::lenient`]): only the fields ferry reads,
//!   nulls tolerated. One the typed model still cannot read (`spec.ports: "80"`) never
//!   fails the watch: it is reported by name, field and reason (a warning, and the
//!   `ferry_source_errors` gauge through [`SourceEvent::Unreadable`]) and skipped. A
//!   change that cannot be read keeps the object's last good state (nothing is sent);
//!   a deletion is applied by key either way; a (re)list leaves such an object out,
//!   so it is only removed when it is unreadable at a relist (and then reported). The
//!   Node is never reported missing because it cannot be read.
//!
//! Memory: lists are paginated (500 objects a page, a quorum read so that the API
//! server honours the limit), and every object is cut down to what ferry reads (no
//! `metadata.managedFields`, no annotations but the EndpointSlice trigger time, no
//! conditions or node images) before it is typed, buffered or sent.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::stream::{self, BoxStream, FuturesUnordered};
use futures::{FutureExt, StreamExt, future::BoxFuture};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::lenient::{Compact, Lean, Lenient, Unreadable};
use super::{ObjectKey, ServiceLite, SliceLite};
use kube::api::{Api, ListParams};
use kube::config::{Config, InClusterError, KubeConfigOptions, Kubeconfig};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc::UnboundedSender;

use super::SourceEvent;

/// kube-proxy's informer label selector, used for Services and EndpointSlices (KP-01):
/// objects another proxy owns, and headless ones, are never even listed.
pub const PROXIED_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// The only annotation kept: kube-proxy's `network_programming_duration_seconds`
/// measures from it.
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// The in-cluster environment variables (set by the kubelet in every pod).
pub const SERVICE_HOST_ENV: &str = "KUBERNETES_SERVICE_HOST";
pub const SERVICE_PORT_ENV: &str = "KUBERNETES_SERVICE_PORT";

/// The service-account files of an in-cluster config.
const SA_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
const SA_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";
const SA_CA: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";
const SA_NAMESPACE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// Objects per list page (client-go's default too).
const PAGE_SIZE: u32 = 500;
/// While a watcher is failing, how often it is probed to tell when the API is back.
const PROBE_INTERVAL: Duration = Duration::from_secs(5);
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause before a watcher is restarted from a fresh list (see [`watch`]).
const RESTART_DELAY: Duration = Duration::from_secs(1);

/// Why no client could be built; each message names the file or variable at fault.
#[derive(Debug, thiserror::Error)]
pub enum KubeSourceError {
    /// The kubeconfig could not be read or parsed.
    #[error("{}: cannot read kubeconfig: {source}", path.display())]
    KubeconfigRead {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },

    /// The kubeconfig was read but its current context is unusable.
    #[error("{}: cannot use the current context of the kubeconfig: {source}", path.display())]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },

    /// An in-cluster environment variable is missing.
    #[error(
        "{var} is not set: not running in a pod? give --kubeconfig PATH, or set {SERVICE_HOST_ENV} and {SERVICE_PORT_ENV} to the API server's real address (not the kubernetes ClusterIP)"
    )]
    EnvMissing { var: &'static str },

    /// An in-cluster environment variable has a value that cannot be used.
    #[error("{var}={value:?}: {reason}")]
    EnvInvalid {
        var: &'static str,
        value: String,
        reason: String,
    },

    /// A service-account file is missing or invalid.
    #[error(
        "{}: cannot use the service account: {reason}; is automountServiceAccountToken disabled?",
        path.display()
    )]
    ServiceAccount { path: PathBuf, reason: String },

    /// The client could not be built from an otherwise valid config.
    #[error("{url}: cannot build a Kubernetes client: {source}")]
    Client {
        url: String,
        #[source]
        source: kube::Error,
    },
}

/// A client for the API server of `kubeconfig` (its current context) or, without one, of
/// the pod this runs in.
///
/// The server address is taken exactly as given (the kubeconfig's `server`, or
/// `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`), never rewritten to the
/// `kubernetes` ClusterIP or to `kubernetes.default.svc`: ferry must reach the API
/// server before it programs any ClusterIP. In a kube-proxy-less cluster, set the two
/// variables in ferry's pod spec to the API server's real address.
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client, KubeSourceError> {
    let mut config = match kubeconfig {
        Some(path) => kubeconfig_config(path).await?,
        None => incluster_config()?,
    };
    // kube-rs retries 429/503/504 up to 15 times with delays doubling from 5 ms (minutes
    // in all), hiding an unavailable API server from the watchers; their own backoff
    // retries just as well, and the outage gets reported.
    config.default_retry = false;
    let url = config.cluster_url.to_string();
    tracing::info!(server = %url, "Kubernetes API server");
    Client::try_from(config).map_err(|source| KubeSourceError::Client { url, source })
}

async fn kubeconfig_config(path: &Path) -> Result<Config, KubeSourceError> {
    let kubeconfig =
        Kubeconfig::read_from(path).map_err(|source| KubeSourceError::KubeconfigRead {
            path: path.to_owned(),
            source,
        })?;
    // No `apply_debug_overrides` or environment: the file alone decides.
    Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|source| KubeSourceError::Kubeconfig {
            path: path.to_owned(),
            source,
        })
}

/// The in-cluster config. kube-rs' `Config::incluster_env` (checked in kube-client 5.0:
/// `incluster_config::try_kube_from_env`) builds the URL from the two variables only;
/// `kubernetes.default.svc` is used solely by `Config::incluster_dns`, which ferry never
/// calls. The URL is still computed here and enforced, so that a future kube-rs cannot
/// silently route the agent through a ClusterIP it has not programmed yet.
fn incluster_config() -> Result<Config, KubeSourceError> {
    let url = incluster_url(
        std::env::var(SERVICE_HOST_ENV).ok(),
        std::env::var(SERVICE_PORT_ENV).ok(),
    )?;
    // kube-rs reads the token when the client is built, with an error that names no
    // file; check it here.
    std::fs::metadata(SA_TOKEN).map_err(|err| KubeSourceError::ServiceAccount {
        path: SA_TOKEN.into(),
        reason: err.to_string(),
    })?;
    let mut config = Config::incluster_env().map_err(incluster_error)?;
    if config.cluster_url != url.cluster_url {
        tracing::warn!(
            kube_rs = %config.cluster_url,
            env = %url.cluster_url,
            "kube-rs chose another API server address than {SERVICE_HOST_ENV}/{SERVICE_PORT_ENV}; using the variables"
        );
        config.cluster_url = url.cluster_url;
    }
    Ok(config)
}

/// A config holding only `https://HOST:PORT` from the in-cluster variables, as
/// client-go builds it (IPv6 bracketed, `:443` omitted).
fn incluster_url(host: Option<String>, port: Option<String>) -> Result<Config, KubeSourceError> {
    let host = host
        .filter(|h| !h.is_empty())
        .ok_or(KubeSourceError::EnvMissing {
            var: SERVICE_HOST_ENV,
        })?;
    let port = port
        .filter(|p| !p.is_empty())
        .ok_or(KubeSourceError::EnvMissing {
            var: SERVICE_PORT_ENV,
        })?;
    let port_num: u16 = port
        .trim()
        .parse()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| KubeSourceError::EnvInvalid {
            var: SERVICE_PORT_ENV,
            value: port.clone(),
            reason: "not a port number (1-65535)".to_owned(),
        })?;
    let authority = match host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V6(ip)) => format!("[{ip}]"),
        Ok(std::net::IpAddr::V4(ip)) => ip.to_string(),
        Err(_) => host.clone(),
    };
    let url = if port_num == 443 {
        format!("https://{authority}")
    } else {
        format!("https://{authority}:{port_num}")
    };
    let url = url.parse().map_err(|err| KubeSourceError::EnvInvalid {
        var: SERVICE_HOST_ENV,
        value: host,
        reason: format!("not a host name or IP address: {err}"),
    })?;
    Ok(Config::new(url))
}

fn incluster_error(err: InClusterError) -> KubeSourceError {
    let (path, reason) = match err {
        InClusterError::ReadDefaultNamespace(e) => (SA_NAMESPACE, e.to_string()),
        InClusterError::ReadCertificateBundle(e) => (SA_CA, e.to_string()),
        InClusterError::ParseCertificates(e) => (SA_CA, e.to_string()),
        // The variables were checked above; they changed under us.
        other => (SA_DIR, other.to_string()),
    };
    KubeSourceError::ServiceAccount {
        path: path.into(),
        reason,
    }
}

/// Watches Services, EndpointSlices and the Node `node_name` until `tx` is closed.
///
/// Errors never end it: each watcher retries with exponential backoff (0.8 s to 30 s)
/// and relists by itself after 410 Gone. Each error is logged, the first of an outage
/// is reported as `Connected(false)`, and `Connected(true)` follows once every watcher
/// works again (an event, or a successful probe list while it is quiet).
pub async fn run(client: Client, node_name: String, tx: UnboundedSender<SourceEvent>) {
    let proxied = || {
        watcher::Config::default()
            .labels(PROXIED_SELECTOR)
            .page_size(PAGE_SIZE)
    };
    let this_node = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
    let services: Api<Lean<Service>> = Api::all(client.clone());
    let slices: Api<Lean<EndpointSlice>> = Api::all(client.clone());
    let nodes: Api<Lenient<Node>> = Api::all(client);

    let mut updates = stream::select_all([
        watch(services.clone(), proxied())
            .map(|r| (Kind::Service, r.map(Update::Service)))
            .boxed(),
        watch(slices.clone(), proxied())
            .map(|r| (Kind::Slice, r.map(Update::Slice)))
            .boxed(),
        watch(nodes.clone(), this_node.clone())
            .map(|r| (Kind::Node, r.map(Update::Node)))
            .boxed(),
    ]);
    let probe_params = |config: &watcher::Config| {
        let mut params = ListParams::default().limit(1);
        params.label_selector = config.label_selector.clone();
        params.field_selector = config.field_selector.clone();
        params
    };
    let probe_for = |kind: Kind| -> BoxFuture<'static, (Kind, bool)> {
        match kind {
            Kind::Service => probe(kind, services.clone(), probe_params(&proxied())).boxed(),
            Kind::Slice => probe(kind, slices.clone(), probe_params(&proxied())).boxed(),
            Kind::Node => probe(kind, nodes.clone(), probe_params(&this_node)).boxed(),
        }
    };

    let mut mapper = Mapper::new(node_name);
    let mut probes = FuturesUnordered::new();
    let mut probing = [false; 3];
    let mut tick = tokio::time::interval(PROBE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let send = |events: Vec<SourceEvent>| events.into_iter().all(|e| tx.send(e).is_ok());

    loop {
        tokio::select! {
            () = tx.closed() => return,
            item = updates.next() => {
                // The watcher streams never end.
                let Some((kind, result)) = item else { return };
                let events = match result {
                    Ok(update) => mapper.update(update),
                    Err(err) => {
                        log_error(kind, &err);
                        if is_gone(&err) {
                            // An expected relist, not an outage.
                            Vec::new()
                        } else {
                            mapper.failed(kind).into_iter().collect()
                        }
                    }
                };
                if !send(events) {
                    return;
                }
            }
            _ = tick.tick(), if mapper.any_failing() => {
                for kind in Kind::ALL {
                    if mapper.is_failing(kind) && !probing[kind as usize] {
                        probing[kind as usize] = true;
                        probes.push(probe_for(kind));
                    }
                }
            }
            Some((kind, ok)) = probes.next(), if !probes.is_empty() => {
                probing[kind as usize] = false;
                if ok && !send(mapper.recovered(kind).into_iter().collect()) {
                    return;
                }
            }
        }
    }
}

/// A watcher with backoff that never ends.
///
/// kube-runtime relists after a 410 Gone *event* (what the API server sends for a
/// too-old resourceVersion), but keeps re-watching the same resourceVersion when the
/// watch *request* itself is answered 410; this restarts such a watcher from a list.
fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
) -> BoxStream<'static, Result<watcher::Event<K>, watcher::Error>>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let start = move || {
        watcher(api.clone(), config.clone())
            .default_backoff()
            .boxed()
    };
    let inner = start();
    stream::unfold((inner, start), |(mut inner, start)| async move {
        let item = inner.next().await?;
        if let Err(watcher::Error::WatchStartFailed(kube::Error::Api(status))) = &item
            && status.code == 410
        {
            tokio::time::sleep(RESTART_DELAY).await;
            inner = start();
        }
        Some((item, (inner, start)))
    })
    .boxed()
}

/// Whether the API answers a small list of `kind` (with the watcher's selectors).
async fn probe<K>(kind: Kind, api: Api<K>, params: ListParams) -> (Kind, bool)
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let ok = matches!(
        tokio::time::timeout(PROBE_TIMEOUT, api.list(&params)).await,
        Ok(Ok(_))
    );
    (kind, ok)
}

fn is_gone(err: &watcher::Error) -> bool {
    match err {
        watcher::Error::WatchError(status) => status.code == 410,
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => status.code == 410,
        _ => false,
    }
}

fn is_forbidden(err: &watcher::Error) -> bool {
    match err {
        watcher::Error::WatchError(status) => status.code == 403,
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => status.code == 403,
        _ => false,
    }
}

fn log_error(kind: Kind, err: &watcher::Error) {
    let kind = kind.name();
    if is_gone(err) {
        tracing::info!(kind, error = %err, "watch expired (410 Gone); relisting");
    } else if is_forbidden(err) {
        tracing::warn!(
            kind,
            error = %err,
            "watch forbidden; ferry's ServiceAccount needs list and watch on services, endpointslices.discovery.k8s.io and nodes; retrying with backoff"
        );
    } else {
        tracing::warn!(kind, error = %err, "watch failed; retrying with backoff");
    }
}

/// The three watched kinds; the discriminant indexes per-kind state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Service = 0,
    Slice = 1,
    Node = 2,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Service, Kind::Slice, Kind::Node];

    fn name(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::Slice => "EndpointSlice",
            Kind::Node => "Node",
        }
    }
}

/// One successful watcher event, of any kind. Moved once, straight into the [`Mapper`]:
/// the size of its variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Update {
    Service(watcher::Event<Lean<Service>>),
    Slice(watcher::Event<Lean<EndpointSlice>>),
    Node(watcher::Event<Lenient<Node>>),
}

impl Update {
    fn kind(&self) -> Kind {
        match self {
            Update::Service(_) => Kind::Service,
            Update::Slice(_) => Kind::Slice,
            Update::Node(_) => Kind::Node,
        }
    }
}

/// Turns watcher events into [`SourceEvent`]s: buffers (re)lists, converts objects,
/// skips and counts unreadable ones, tracks the first sync and the connection state.
/// Pure: no I/O.
#[derive(Debug)]
struct Mapper {
    node_name: String,
    /// Converted as each object arrives: a relist never holds the API objects.
    services: Vec<ServiceLite>,
    slices: Vec<SliceLite>,
    nodes: Vec<Node>,
    /// Which kinds finished their first list.
    listed: [bool; 3],
    synced: bool,
    /// Which kinds reported an error and have not worked since.
    failing: [bool; 3],
    /// What was last reported (nothing reported counts as connected).
    connected: bool,
    /// Per kind, the objects whose last version could not be read.
    unreadable: [BTreeSet<ObjectKey>; 3],
    /// The count last sent as [`SourceEvent::Unreadable`].
    unreadable_sent: usize,
}

/// A watcher event with its object read: deletions need only the key.
enum Change<L> {
    Init,
    InitApply(L),
    InitDone,
    Apply(L),
    Delete(ObjectKey),
}

/// What one watcher event means, before it becomes a [`SourceEvent`].
enum Step<K> {
    Reset(Vec<K>),
    Applied(K),
    Deleted(ObjectKey),
}

impl Mapper {
    fn new(node_name: String) -> Self {
        Self {
            node_name,
            services: Vec::new(),
            slices: Vec::new(),
            nodes: Vec::new(),
            listed: [false; 3],
            synced: false,
            failing: [false; 3],
            connected: true,
            unreadable: Default::default(),
            unreadable_sent: 0,
        }
    }

    fn any_failing(&self) -> bool {
        self.failing.contains(&true)
    }

    fn is_failing(&self, kind: Kind) -> bool {
        self.failing[kind as usize]
    }

    /// A watcher failed: `Connected(false)` when this starts an outage.
    fn failed(&mut self, kind: Kind) -> Option<SourceEvent> {
        self.failing[kind as usize] = true;
        if self.connected {
            self.connected = false;
            return Some(SourceEvent::Connected(false));
        }
        None
    }

    /// A watcher works (again): `Connected(true)` when this ends an outage.
    fn recovered(&mut self, kind: Kind) -> Option<SourceEvent> {
        self.failing[kind as usize] = false;
        if !self.connected && !self.any_failing() {
            self.connected = true;
            return Some(SourceEvent::Connected(true));
        }
        None
    }

    fn update(&mut self, update: Update) -> Vec<SourceEvent> {
        let kind = update.kind();
        let mut out: Vec<SourceEvent> = self.recovered(kind).into_iter().collect();
        // Mid-list counts would only flap: the count is sent between lists.
        let (listing, listed) = match &update {
            Update::Service(e) => list_state(e),
            Update::Slice(e) => list_state(e),
            Update::Node(e) => list_state(e),
        };
        match update {
            Update::Service(event) => {
                let change = self.read(kind, event);
                match change.and_then(|c| step(&mut self.services, c)) {
                    Some(Step::Reset(all)) => {
                        tracing::info!(count = all.len(), "listed Services");
                        out.push(SourceEvent::ServicesReset(all));
                    }
                    Some(Step::Applied(s)) => out.push(SourceEvent::ServiceApplied(s)),
                    Some(Step::Deleted(key)) => out.push(SourceEvent::ServiceDeleted(key)),
                    None => {}
                }
            }
            Update::Slice(event) => {
                let change = self.read(kind, event);
                match change.and_then(|c| step(&mut self.slices, c)) {
                    Some(Step::Reset(all)) => {
                        tracing::info!(count = all.len(), "listed EndpointSlices");
                        out.push(SourceEvent::SlicesReset(all));
                    }
                    Some(Step::Applied(s)) => out.push(SourceEvent::SliceApplied(s)),
                    Some(Step::Deleted(key)) => out.push(SourceEvent::SliceDeleted(key)),
                    None => {}
                }
            }
            Update::Node(event) => {
                // The field selector already picks the node; never trust another one.
                let ours = |n: &Lenient<Node>| n.meta().name.as_deref() == Some(&self.node_name);
                let event = match event {
                    watcher::Event::InitApply(n)
                    | watcher::Event::Apply(n)
                    | watcher::Event::Delete(n)
                        if !ours(&n) =>
                    {
                        tracing::debug!(node = ?n.meta().name, "ignoring another node");
                        None
                    }
                    event => Some(event),
                };
                let change = event.and_then(|e| self.read(kind, e));
                match change.and_then(|c| step(&mut self.nodes, c)) {
                    Some(Step::Reset(all)) => {
                        let node = all.into_iter().next();
                        if node.is_none() && !self.unreadable[kind as usize].is_empty() {
                            // Listed but unreadable: the last good Node stays.
                        } else {
                            if node.is_none() {
                                tracing::warn!(node = %self.node_name, "no Node object with this name (yet)");
                            }
                            out.push(SourceEvent::Node(node.map(Box::new)));
                        }
                    }
                    Some(Step::Applied(n)) => out.push(SourceEvent::Node(Some(Box::new(n)))),
                    Some(Step::Deleted(_)) => out.push(SourceEvent::Node(None)),
                    None => {}
                }
            }
        }
        if listed {
            self.listed[kind as usize] = true;
            if !self.synced && !self.listed.contains(&false) {
                self.synced = true;
                out.push(SourceEvent::Synced);
            }
        }
        let unreadable = self.unreadable.iter().map(BTreeSet::len).sum();
        if !listing && unreadable != self.unreadable_sent {
            self.unreadable_sent = unreadable;
            out.push(SourceEvent::Unreadable(unreadable));
        }
        out
    }

    /// The event with its object read and converted; `None` when there is nothing to
    /// pass on: an object without a name, or one that cannot be read (reported here;
    /// see the module docs for what happens to it).
    fn read<W: Watched>(&mut self, kind: Kind, event: watcher::Event<W>) -> Option<Change<W::Out>> {
        let unreadable = &mut self.unreadable[kind as usize];
        let (object, initial) = match event {
            watcher::Event::Init => {
                // A (re)list reports every unreadable object again.
                unreadable.clear();
                return Some(Change::Init);
            }
            watcher::Event::InitDone => return Some(Change::InitDone),
            watcher::Event::Delete(object) => {
                let key = ObjectKey::from_meta(object.meta())?;
                unreadable.remove(&key);
                return Some(Change::Delete(key));
            }
            watcher::Event::InitApply(object) => (object, true),
            watcher::Event::Apply(object) => (object, false),
        };
        let key = ObjectKey::from_meta(object.meta());
        match object.read() {
            Ok(lite) => {
                if let Some(key) = key {
                    unreadable.remove(&key);
                }
                let lite = lite?;
                Some(if initial {
                    Change::InitApply(lite)
                } else {
                    Change::Apply(lite)
                })
            }
            Err(err) => {
                report(kind, &err, initial, unreadable);
                None
            }
        }
    }
}

/// A watched object as the watcher yields it: Services and slices already compact
/// ([`Lean`]), the Node as a typed object ([`Lenient`]).
trait Watched: Resource<DynamicType = ()> {
    type Out;
    /// The object (`None` without a name), or why it cannot be read.
    fn read(self) -> Result<Option<Self::Out>, Box<Unreadable>>;
}

impl<K: Compact> Watched for Lean<K> {
    type Out = K::Lite;
    fn read(self) -> Result<Option<K::Lite>, Box<Unreadable>> {
        self.object
    }
}

impl Watched for Lenient<Node> {
    type Out = Node;
    fn read(self) -> Result<Option<Node>, Box<Unreadable>> {
        self.0.map(Some)
    }
}

/// Whether `event` is part of a list, and whether it ends one.
fn list_state<K>(event: &watcher::Event<K>) -> (bool, bool) {
    match event {
        watcher::Event::Init | watcher::Event::InitApply(_) => (true, false),
        watcher::Event::InitDone => (false, true),
        watcher::Event::Apply(_) | watcher::Event::Delete(_) => (false, false),
    }
}

/// Logs an object that cannot be read: a warning when it turns unreadable, at debug
/// level while it stays so (a status that keeps changing would flood the log).
fn report(kind: Kind, err: &Unreadable, initial: bool, unreadable: &mut BTreeSet<ObjectKey>) {
    let kind = kind.name();
    let Some(key) = ObjectKey::from_meta(&err.meta) else {
        tracing::warn!(kind, field = %err.field, reason = %err.reason, "skipping an object without a name that cannot be read");
        return;
    };
    let keeps = if initial {
        "left out of the list"
    } else {
        "its last good state stays"
    };
    if unreadable.insert(key.clone()) {
        tracing::warn!(kind, object = %key, field = %err.field, reason = %err.reason, "cannot read the object; skipping it ({keeps})");
    } else {
        tracing::debug!(kind, object = %key, field = %err.field, reason = %err.reason, "the object still cannot be read");
    }
}

/// Buffers a (re)list until it is complete; passes changes through.
fn step<K>(buffer: &mut Vec<K>, change: Change<K>) -> Option<Step<K>> {
    match change {
        Change::Init => {
            // A list that failed half-way is started over: drop its partial objects.
            *buffer = Vec::new();
            None
        }
        Change::InitApply(obj) => {
            buffer.push(obj);
            None
        }
        Change::InitDone => Some(Step::Reset(std::mem::take(buffer))),
        Change::Apply(obj) => Some(Step::Applied(obj)),
        Change::Delete(key) => Some(Step::Deleted(key)),
    }
}

/// Every Node of the cluster, for the pod network (`--pod-network`): the complete set is
/// sent after each initial list and whenever a Node's pod CIDRs or InternalIPs change
/// (status heartbeats and other fields change nothing, and send nothing). Runs until
/// the receiver is gone; errors are retried with the watcher's backoff.
pub async fn watch_nodes(client: Client, tx: tokio::sync::watch::Sender<crate::podnet::Nodes>) {
    use std::collections::BTreeMap;

    use crate::podnet::plan::NodeLite;

    let api: Api<Node> = Api::all(client);
    let mut stream = watch(api, watcher::Config::default());
    let mut nodes: BTreeMap<String, NodeLite> = BTreeMap::new();
    let mut listing: Option<BTreeMap<String, NodeLite>> = None;
    let lite = |n: &Node| {
        let (lite, problems) = NodeLite::from_node(n);
        for p in problems {
            tracing::warn!("pod network: node {}: {}", p.node, p.message);
        }
        lite
    };
    while let Some(item) = stream.next().await {
        let changed = match item {
            Err(err) => {
                tracing::warn!("pod network: watching Nodes: {err}");
                false
            }
            Ok(watcher::Event::Init) => {
                listing = Some(BTreeMap::new());
                false
            }
            Ok(watcher::Event::InitApply(n)) => {
                let l = lite(&n);
                listing.get_or_insert_default().insert(l.name.clone(), l);
                false
            }
            Ok(watcher::Event::InitDone) => {
                let fresh = listing.take().unwrap_or_default();
                let changed = fresh != nodes;
                nodes = fresh;
                changed || tx.borrow().is_empty()
            }
            Ok(watcher::Event::Apply(n)) => {
                let l = lite(&n);
                nodes.insert(l.name.clone(), l.clone()) != Some(l)
            }
            Ok(watcher::Event::Delete(n)) => n
                .metadata
                .name
                .as_ref()
                .is_some_and(|name| nodes.remove(name).is_some()),
        };
        if changed && tx.send(std::sync::Arc::new(nodes.clone())).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};
    use watcher::Event;

    fn meta(name: &str) -> Value {
        json!({
            "name": name,
            "namespace": "default",
            "resourceVersion": "1",
            "managedFields": [{"manager": "kubectl", "time": null}],
            "annotations": {
                "kubectl.kubernetes.io/last-applied-configuration": "{...}",
                TRIGGER_TIME_ANNOTATION: "2024-01-01T00:00:00Z",
            },
        })
    }

    fn lean<K: Compact>(v: Value) -> Lean<K> {
        Lean::from_text(&v.to_string()).unwrap()
    }

    fn svc(name: &str) -> Lean<Service> {
        lean(json!({
            "metadata": meta(name),
            "spec": {"ports": [{"port": 80}]},
            "status": {"conditions": [{"type": "x", "lastTransitionTime": null}]},
        }))
    }

    /// A Service the typed model rejects in a field ferry reads.
    fn bad_svc(name: &str) -> Lean<Service> {
        lean(json!({"metadata": meta(name), "spec": {"ports": "80"}}))
    }

    fn slice(name: &str) -> Lean<EndpointSlice> {
        lean(json!({"metadata": meta(name), "addressType": "IPv4", "endpoints": []}))
    }

    fn bad_slice(name: &str) -> Lean<EndpointSlice> {
        lean(json!({"metadata": meta(name), "addressType": "IPv4", "endpoints": {}}))
    }

    fn node(name: &str) -> Lenient<Node> {
        let mut meta = meta(name);
        meta["namespace"] = Value::Null;
        Lenient::from_value(json!({
            "metadata": meta,
            "status": {"images": [{"names": ["registry.k8s.io/pause:3.10"], "sizeBytes": 1}]},
        }))
    }

    fn bad_node(name: &str) -> Lenient<Node> {
        Lenient::from_value(json!({"metadata": {"name": name}, "spec": {"taints": [{"key": 1}]}}))
    }

    /// A short, comparable rendering of an event.
    fn show(event: &SourceEvent) -> String {
        let name = |m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
            m.name.clone().unwrap_or_default()
        };
        match event {
            SourceEvent::ServicesReset(all) => format!(
                "ServicesReset[{}]",
                all.iter()
                    .map(|s| s.name.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            SourceEvent::SlicesReset(all) => format!(
                "SlicesReset[{}]",
                all.iter()
                    .map(|s| s.name.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            SourceEvent::ServiceApplied(s) => format!("ServiceApplied {}", s.name),
            SourceEvent::ServiceDeleted(key) => format!("ServiceDeleted {key}"),
            SourceEvent::SliceApplied(s) => format!("SliceApplied {}", s.name),
            SourceEvent::SliceDeleted(key) => format!("SliceDeleted {key}"),
            SourceEvent::Node(Some(n)) => format!("Node {}", name(&n.metadata)),
            SourceEvent::Node(None) => "Node -".to_owned(),
            SourceEvent::Synced => "Synced".to_owned(),
            SourceEvent::Connected(up) => format!("Connected({up})"),
            SourceEvent::Unreadable(n) => format!("Unreadable({n})"),
            SourceEvent::Batch(events) => format!("Batch of {}", events.len()),
        }
    }

    fn node_update(event: Event<Lenient<Node>>) -> Update {
        Update::Node(event)
    }

    fn feed(mapper: &mut Mapper, updates: Vec<Update>) -> Vec<String> {
        updates
            .into_iter()
            .flat_map(|u| mapper.update(u))
            .map(|e| show(&e))
            .collect()
    }

    fn initial_sync(mapper: &mut Mapper) -> Vec<String> {
        feed(
            mapper,
            vec![
                Update::Service(Event::Init),
                Update::Service(Event::InitApply(svc("a"))),
                Update::Slice(Event::Init),
                Update::Service(Event::InitApply(svc("b"))),
                Update::Slice(Event::InitApply(slice("a-1"))),
                Update::Service(Event::InitDone),
                node_update(Event::Init),
                node_update(Event::InitApply(node("n1"))),
                Update::Slice(Event::InitDone),
                node_update(Event::InitDone),
            ],
        )
    }

    #[test]
    fn lists_become_resets_then_one_synced() {
        let mut mapper = Mapper::new("n1".to_owned());
        assert_eq!(
            initial_sync(&mut mapper),
            [
                "ServicesReset[a,b]",
                "SlicesReset[a-1]",
                "Node n1",
                "Synced"
            ]
        );
        // A later relist is a Reset again, without a second Synced.
        let events = feed(
            &mut mapper,
            vec![
                Update::Service(Event::Init),
                Update::Service(Event::InitApply(svc("b"))),
                Update::Service(Event::InitDone),
            ],
        );
        assert_eq!(events, ["ServicesReset[b]"]);
    }

    #[test]
    fn synced_waits_for_every_kind() {
        let mut mapper = Mapper::new("n1".to_owned());
        let events = feed(
            &mut mapper,
            vec![
                Update::Service(Event::Init),
                Update::Service(Event::InitDone),
                Update::Slice(Event::Init),
                Update::Slice(Event::InitDone),
                // A second relist of Services does not count for the Node.
                Update::Service(Event::Init),
                Update::Service(Event::InitDone),
            ],
        );
        assert_eq!(
            events,
            ["ServicesReset[]", "SlicesReset[]", "ServicesReset[]"]
        );
        let events = feed(
            &mut mapper,
            vec![node_update(Event::Init), node_update(Event::InitDone)],
        );
        assert_eq!(events, ["Node -", "Synced"]);
    }

    #[test]
    fn a_restarted_list_drops_its_partial_objects() {
        let mut mapper = Mapper::new("n1".to_owned());
        let events = feed(
            &mut mapper,
            vec![
                Update::Service(Event::Init),
                Update::Service(Event::InitApply(svc("stale"))),
                // The list failed half-way; the watcher starts over.
                Update::Service(Event::Init),
                Update::Service(Event::InitApply(svc("fresh"))),
                Update::Service(Event::InitDone),
            ],
        );
        assert_eq!(events, ["ServicesReset[fresh]"]);
    }

    #[test]
    fn changes_pass_through() {
        let mut mapper = Mapper::new("n1".to_owned());
        initial_sync(&mut mapper);
        let events = feed(
            &mut mapper,
            vec![
                Update::Service(Event::Apply(svc("c"))),
                Update::Service(Event::Delete(svc("a"))),
                Update::Slice(Event::Apply(slice("c-1"))),
                Update::Slice(Event::Delete(slice("a-1"))),
                node_update(Event::Apply(node("n1"))),
                node_update(Event::Delete(node("n1"))),
            ],
        );
        assert_eq!(
            events,
            [
                "ServiceApplied c",
                "ServiceDeleted default/a",
                "SliceApplied c-1",
                "SliceDeleted default/a-1",
                "Node n1",
                "Node -",
            ]
        );
    }

    #[test]
    fn other_nodes_are_ignored() {
        let mut mapper = Mapper::new("n1".to_owned());
        let events = feed(
            &mut mapper,
            vec![
                node_update(Event::Init),
                node_update(Event::InitApply(node("n2"))),
                node_update(Event::InitApply(node("n1"))),
                node_update(Event::InitDone),
                node_update(Event::Apply(node("n2"))),
                node_update(Event::Delete(node("n2"))),
            ],
        );
        assert_eq!(events, ["Node n1"]);
    }

    #[test]
    fn objects_are_stripped() {
        let mut mapper = Mapper::new("n1".to_owned());
        let mut events = Vec::new();
        for update in [
            Update::Service(Event::Apply(svc("a"))),
            Update::Slice(Event::Init),
            Update::Slice(Event::InitApply(slice("a-1"))),
            Update::Slice(Event::InitDone),
            node_update(Event::Apply(node("n1"))),
        ] {
            events.extend(mapper.update(update));
        }
        let [
            SourceEvent::ServiceApplied(s),
            SourceEvent::SlicesReset(slices),
            SourceEvent::Node(Some(n)),
        ] = &events[..]
        else {
            panic!("unexpected events {events:?}");
        };
        // Slices keep only the trigger time; Services keep no annotation (kube-proxy
        // reads none).
        assert_eq!(
            slices[0].trigger_time.as_deref(),
            Some("2024-01-01T00:00:00Z")
        );
        assert_eq!(n.metadata.managed_fields, None);
        assert_eq!(n.metadata.annotations, None);
        assert_eq!(n.status, None, "no images");
        // What the model reads stays.
        assert_eq!(&*s.name, "a");
        assert_eq!(s.spec.as_ref().unwrap().ports[0].port, 80);
        assert_eq!(&*slices[0].address_type, "IPv4");
    }

    #[test]
    fn an_unreadable_change_is_skipped_and_counted() {
        let mut mapper = Mapper::new("n1".to_owned());
        initial_sync(&mut mapper);
        let events = feed(
            &mut mapper,
            vec![
                // The last good state of a stays: nothing is sent for it.
                Update::Service(Event::Apply(bad_svc("a"))),
                Update::Service(Event::Apply(svc("c"))),
                // Still unreadable: counted once.
                Update::Service(Event::Apply(bad_svc("a"))),
                Update::Slice(Event::Apply(bad_slice("a-1"))),
                node_update(Event::Apply(bad_node("n1"))),
                // Readable again.
                Update::Service(Event::Apply(svc("a"))),
                // A deletion needs only the key.
                Update::Slice(Event::Delete(bad_slice("a-1"))),
                node_update(Event::Apply(node("n1"))),
            ],
        );
        assert_eq!(
            events,
            [
                "Unreadable(1)",
                "ServiceApplied c",
                "Unreadable(2)",
                "Unreadable(3)",
                "ServiceApplied a",
                "Unreadable(2)",
                "SliceDeleted default/a-1",
                "Unreadable(1)",
                "Node n1",
                "Unreadable(0)",
            ]
        );
    }

    #[test]
    fn a_list_leaves_unreadable_objects_out() {
        let mut mapper = Mapper::new("n1".to_owned());
        initial_sync(&mut mapper);
        let events = feed(
            &mut mapper,
            vec![
                Update::Service(Event::Init),
                Update::Service(Event::InitApply(svc("a"))),
                Update::Service(Event::InitApply(bad_svc("b"))),
                Update::Service(Event::InitApply(svc("c"))),
                Update::Service(Event::InitDone),
                // The Node is never reported missing because it cannot be read.
                node_update(Event::Init),
                node_update(Event::InitApply(bad_node("n1"))),
                node_update(Event::InitDone),
                // A relist that reads b again stops counting it.
                Update::Service(Event::Init),
                Update::Service(Event::InitApply(svc("b"))),
                Update::Service(Event::InitDone),
            ],
        );
        assert_eq!(
            events,
            [
                "ServicesReset[a,c]",
                "Unreadable(1)",
                "Unreadable(2)",
                "ServicesReset[b]",
                "Unreadable(1)",
            ]
        );
    }

    #[test]
    fn connected_is_reported_once_per_outage() {
        let mut mapper = Mapper::new("n1".to_owned());
        initial_sync(&mut mapper);
        let mut events: Vec<String> = Vec::new();
        events.extend(mapper.failed(Kind::Service).iter().map(show));
        events.extend(mapper.failed(Kind::Service).iter().map(show));
        events.extend(mapper.failed(Kind::Slice).iter().map(show));
        // Services work again, slices do not: still disconnected.
        events.extend(feed(
            &mut mapper,
            vec![Update::Service(Event::Apply(svc("x")))],
        ));
        assert!(mapper.any_failing());
        // A quiet slice watcher recovers through a probe.
        events.extend(mapper.recovered(Kind::Slice).iter().map(show));
        events.extend(feed(
            &mut mapper,
            vec![Update::Service(Event::Apply(svc("y")))],
        ));
        assert_eq!(
            events,
            [
                "Connected(false)",
                "ServiceApplied x",
                "Connected(true)",
                "ServiceApplied y",
            ]
        );
        assert!(!mapper.any_failing());
    }

    #[test]
    fn an_outage_before_the_first_list_recovers_with_it() {
        let mut mapper = Mapper::new("n1".to_owned());
        let mut events: Vec<String> = mapper.failed(Kind::Node).iter().map(show).collect();
        events.extend(feed(
            &mut mapper,
            vec![node_update(Event::Init), node_update(Event::InitDone)],
        ));
        assert_eq!(events, ["Connected(false)", "Connected(true)", "Node -"]);
    }

    #[test]
    fn gone_is_not_an_outage() {
        let gone = kube::core::Status {
            code: 410,
            ..kube::core::Status::default()
        };
        assert!(is_gone(&watcher::Error::WatchError(Box::new(gone.clone()))));
        assert!(is_gone(&watcher::Error::WatchStartFailed(
            kube::Error::Api(Box::new(gone))
        )));
        let forbidden = kube::core::Status {
            code: 403,
            ..kube::core::Status::default()
        };
        let err = watcher::Error::InitialListFailed(kube::Error::Api(Box::new(forbidden)));
        assert!(!is_gone(&err));
        assert!(is_forbidden(&err));
        assert!(!is_gone(&watcher::Error::NoResourceVersion));
    }

    #[test]
    fn incluster_url_is_exactly_the_environment() {
        let url = |h: &str, p: &str| {
            incluster_url(Some(h.to_owned()), Some(p.to_owned())).map(|c| c.cluster_url.to_string())
        };
        assert_eq!(url("10.0.0.1", "6443").unwrap(), "https://10.0.0.1:6443/");
        assert_eq!(url("10.0.0.1", "443").unwrap(), "https://10.0.0.1/");
        assert_eq!(url("fd00::1", "6443").unwrap(), "https://[fd00::1]:6443/");
        assert_eq!(
            url("api.example.com", "6443").unwrap(),
            "https://api.example.com:6443/"
        );
    }

    #[test]
    fn incluster_errors_name_the_variable() {
        let err = incluster_url(None, Some("443".to_owned())).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("KUBERNETES_SERVICE_HOST is not set"),
            "{err}"
        );
        let err = incluster_url(Some("10.0.0.1".to_owned()), None).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("KUBERNETES_SERVICE_PORT is not set"),
            "{err}"
        );
        let err = incluster_url(Some("10.0.0.1".to_owned()), Some("https".to_owned())).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("KUBERNETES_SERVICE_PORT=\"https\""),
            "{err}"
        );
        let err = incluster_url(Some("bad host".to_owned()), Some("443".to_owned())).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("KUBERNETES_SERVICE_HOST=\"bad host\""),
            "{err}"
        );
    }

    #[tokio::test]
    async fn kubeconfig_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing");
        let err = client(Some(&missing)).await.err().unwrap();
        assert!(
            err.to_string().starts_with(&missing.display().to_string()),
            "{err}"
        );

        let no_context = dir.path().join("kubeconfig");
        std::fs::write(&no_context, "apiVersion: v1\nkind: Config\nclusters: []\n").unwrap();
        let err = client(Some(&no_context)).await.err().unwrap();
        assert!(
            err.to_string()
                .starts_with(&no_context.display().to_string()),
            "{err}"
        );
    }

    /// The server address comes from the kubeconfig as written, and an https client can
    /// be built (a rustls crypto provider is compiled in).
    #[tokio::test]
    async fn kubeconfig_server_is_used_as_given() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
             clusters: [{name: k, cluster: {server: 'https://192.0.2.10:6443', insecure-skip-tls-verify: true}}]\n\
             users: [{name: u, user: {token: t}}]\n\
             contexts: [{name: c, context: {cluster: k, user: u}}]\n",
        )
        .unwrap();
        let config = kubeconfig_config(&path).await.unwrap();
        assert_eq!(config.cluster_url.to_string(), "https://192.0.2.10:6443/");
        client(Some(&path)).await.unwrap();
    }
}
