//! The Kubernetes API source (`ferry::source::kube`) against the in-process fake API
//! server: a client from a kubeconfig, initial lists, changes, relists after the history
//! was compacted, outages, label selectors, the node field selector and stripping.
//! No root needed.

use std::path::PathBuf;
use std::time::Duration;

use ferry::source::SourceEvent;
use ferry::source::kube;
use ferry_tests::fakeapi::{FakeApi, Kind};
use serde_json::{Value, json};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

const WAIT: Duration = Duration::from_secs(20);
const TRIGGER: &str = "endpoints.kubernetes.io/last-change-trigger-time";

fn managed_fields() -> Value {
    json!([{"manager": "kubectl", "operation": "Apply", "apiVersion": "v1",
            "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {}}}])
}

fn service(name: &str, labels: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": labels,
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{\"big\":true}"},
            "managedFields": managed_fields(),
        },
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]},
    })
}

fn slice(name: &str, service: &str, extra_labels: &[(&str, &str)]) -> Value {
    let mut labels = serde_json::Map::new();
    labels.insert("kubernetes.io/service-name".into(), service.into());
    for (k, v) in extra_labels {
        labels.insert((*k).into(), (*v).into());
    }
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": labels,
            "annotations": {TRIGGER: "2024-01-01T00:00:00Z", "other": "x"},
            "managedFields": managed_fields(),
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.128.0.5"], "conditions": {"ready": true}}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    })
}

fn node(name: &str, zone: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"topology.kubernetes.io/zone": zone},
            "managedFields": managed_fields(),
        },
        "status": {"images": [{"names": ["registry.k8s.io/pause:3.10"], "sizeBytes": 1}]},
    })
}

/// A short rendering of an event, to compare sequences.
fn show(event: &SourceEvent) -> String {
    let names = |it: &mut dyn Iterator<Item = Option<String>>| {
        let mut v: Vec<String> = it.map(Option::unwrap_or_default).collect();
        v.sort();
        v.join(",")
    };
    match event {
        SourceEvent::ServicesReset(all) => format!(
            "ServicesReset[{}]",
            names(&mut all.iter().map(|s| Some(s.name.to_string())))
        ),
        SourceEvent::SlicesReset(all) => format!(
            "SlicesReset[{}]",
            names(&mut all.iter().map(|s| Some(s.name.to_string())))
        ),
        SourceEvent::ServiceApplied(s) => {
            format!("ServiceApplied {}", s.name)
        }
        SourceEvent::ServiceDeleted(key) => format!("ServiceDeleted {key}"),
        SourceEvent::SliceApplied(s) => {
            format!("SliceApplied {}", s.name)
        }
        SourceEvent::SliceDeleted(key) => format!("SliceDeleted {key}"),
        SourceEvent::Node(Some(n)) => {
            let zone = n
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("topology.kubernetes.io/zone"))
                .cloned()
                .unwrap_or_default();
            format!(
                "Node {} {zone}",
                n.metadata.name.clone().unwrap_or_default()
            )
        }
        SourceEvent::Node(None) => "Node -".to_owned(),
        SourceEvent::Synced => "Synced".to_owned(),
        SourceEvent::Connected(up) => format!("Connected({up})"),
        SourceEvent::Unreadable(n) => format!("Unreadable({n})"),
        SourceEvent::Batch(events) => format!("Batch of {}", events.len()),
    }
}

struct Source {
    rx: UnboundedReceiver<SourceEvent>,
    /// Every event received so far, rendered.
    seen: Vec<String>,
    _dir: TempDir,
}

impl Source {
    /// Connects through a kubeconfig written by the fake and starts `run` for node `n1`.
    async fn start(api: &FakeApi, test: &str) -> Source {
        let dir = TempDir::new(test);
        let kubeconfig = dir.0.join("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let client = kube::client(Some(&kubeconfig)).await.expect("client");
        let (tx, rx) = unbounded_channel();
        tokio::spawn(kube::run(client, "n1".to_owned(), tx));
        Source {
            rx,
            seen: Vec::new(),
            _dir: dir,
        }
    }

    async fn next(&mut self) -> SourceEvent {
        let event = tokio::time::timeout(WAIT, self.rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no event within {WAIT:?}; seen so far: {:#?}", self.seen))
            .expect("the source ended");
        self.seen.push(show(&event));
        event
    }

    /// Events until (and including) the first one `until` accepts.
    async fn until(&mut self, until: impl Fn(&SourceEvent) -> bool) -> Vec<SourceEvent> {
        let mut out = Vec::new();
        loop {
            let event = self.next().await;
            let done = until(&event);
            out.push(event);
            if done {
                return out;
            }
        }
    }

    /// Events until `show(event) == want`, rendered.
    async fn until_shown(&mut self, want: &str) -> Vec<String> {
        self.until(|e| show(e) == want)
            .await
            .iter()
            .map(show)
            .collect()
    }

    /// Waits until every event of `want` arrived (in any order, `Connected` ignored) and
    /// asserts nothing else did.
    async fn expect(&mut self, want: &[&str]) {
        let mut missing: Vec<&str> = want.to_vec();
        let mut extra = Vec::new();
        while !missing.is_empty() {
            let shown = show(&self.next().await);
            if let Some(i) = missing.iter().position(|w| *w == shown) {
                missing.remove(i);
            } else if !shown.starts_with("Connected") {
                extra.push(shown);
            }
        }
        assert!(
            extra.is_empty(),
            "unexpected {extra:?} while waiting for {want:?}"
        );
    }

    /// Whatever arrives within `quiet`, rendered.
    async fn drain(&mut self, quiet: Duration) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(Some(event)) = tokio::time::timeout(quiet, self.rx.recv()).await {
            self.seen.push(show(&event));
            out.push(show(&event));
        }
        out
    }
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(test: &str) -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("ferry-kube-source-{}-{test}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn seed(api: &FakeApi) {
    api.apply(service("web", json!({})));
    api.apply(service("gone", json!({})));
    api.apply(service(
        "elsewhere",
        json!({"service.kubernetes.io/service-proxy-name": "other"}),
    ));
    api.apply(service(
        "headless-label",
        json!({"service.kubernetes.io/headless": ""}),
    ));
    api.apply(slice("web-1", "web", &[]));
    api.apply(slice("gone-1", "gone", &[]));
    api.apply(slice(
        "web-headless",
        "web",
        &[("service.kubernetes.io/headless", "")],
    ));
    api.apply(slice(
        "web-elsewhere",
        "web",
        &[("service.kubernetes.io/service-proxy-name", "other")],
    ));
    api.apply(node("n1", "a"));
    api.apply(node("n2", "b"));
}

/// Sorted, so that the interleaving of the three watchers does not matter.
fn sorted(mut events: Vec<String>) -> Vec<String> {
    events.sort();
    events
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_changes_and_relists() {
    let api = FakeApi::start();
    seed(&api);
    let mut source = Source::start(&api, "lists").await;

    // The initial lists, then Synced (last).
    let initial = source.until(|e| matches!(e, SourceEvent::Synced)).await;
    let shown: Vec<String> = initial.iter().map(show).collect();
    assert_eq!(
        shown.last().map(String::as_str),
        Some("Synced"),
        "{shown:?}"
    );
    assert_eq!(
        sorted(shown),
        [
            "Node n1 a",
            "ServicesReset[gone,web]",
            "SlicesReset[gone-1,web-1]",
            "Synced",
        ]
    );

    // managedFields, other annotations and node images are stripped.
    for event in &initial {
        match event {
            SourceEvent::ServicesReset(all) => {
                // Services arrive compact (ServiceLite): managed fields and
                // annotations have no place in them; the spec the model reads stays.
                for s in all {
                    assert!(s.spec.is_some(), "the spec stays");
                    assert!(!s.spec.as_ref().unwrap().ports.is_empty(), "ports stay");
                }
            }
            SourceEvent::SlicesReset(all) => {
                for s in all {
                    // Slices arrive compact: only what kube-proxy reads, the trigger
                    // time among the annotations.
                    assert!(s.trigger_time.is_some(), "the trigger time stays: {s:?}");
                    assert_eq!(s.endpoints.len(), 1);
                }
            }
            SourceEvent::Node(Some(n)) => {
                assert_eq!(n.metadata.managed_fields, None);
                assert_eq!(n.status.as_ref().and_then(|s| s.images.clone()), None);
            }
            _ => {}
        }
    }

    // Changes arrive one by one; labelled objects and other nodes never do.
    api.apply(service("api", json!({})));
    source.expect(&["ServiceApplied api"]).await;
    api.apply(service(
        "api-elsewhere",
        json!({"service.kubernetes.io/service-proxy-name": "other"}),
    ));
    api.apply(service(
        "api-headless",
        json!({"service.kubernetes.io/headless": ""}),
    ));
    api.apply(node("n2", "c"));
    api.apply(slice("api-1", "api", &[]));
    source.expect(&["SliceApplied api-1"]).await;
    api.delete(Kind::Service, "default", "api");
    api.delete(Kind::EndpointSlice, "default", "api-1");
    source
        .expect(&["ServiceDeleted default/api", "SliceDeleted default/api-1"])
        .await;
    api.apply(node("n1", "z"));
    source.expect(&["Node n1 z"]).await;
    // A Service that starts carrying the label leaves the selection: a Delete.
    api.apply(service(
        "web",
        json!({"service.kubernetes.io/service-proxy-name": "other"}),
    ));
    source.expect(&["ServiceDeleted default/web"]).await;
    api.apply(service("web", json!({})));
    source.expect(&["ServiceApplied web"]).await;

    // Deleted while the watches hear nothing, then the history is compacted and the
    // watches dropped: the watchers resume from a resourceVersion that is gone (410),
    // relist, and the relist misses the deleted objects.
    api.stall_watches(true);
    api.delete(Kind::Service, "default", "gone");
    api.delete(Kind::EndpointSlice, "default", "gone-1");
    api.compact();
    api.drop_watches();
    api.stall_watches(false);
    // No Delete for the objects removed during the gap, no second Synced.
    source
        .expect(&["ServicesReset[web]", "SlicesReset[web-1]", "Node n1 z"])
        .await;

    // Nothing else (nothing about the labelled Services or n2) trickles in.
    let rest = source.drain(Duration::from_secs(2)).await;
    let rest: Vec<&String> = rest
        .iter()
        .filter(|e| !e.starts_with("Connected"))
        .collect();
    assert!(rest.is_empty(), "unexpected events {rest:?}");
    for event in &source.seen {
        assert!(
            !event.contains("elsewhere") && !event.contains("headless") && !event.contains("n2"),
            "{event} should have been filtered out; all events: {:#?}",
            source.seen
        );
    }
    assert_eq!(source.seen.iter().filter(|e| *e == "Synced").count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_is_reported_once_and_caught_up() {
    let api = FakeApi::start();
    seed(&api);
    let mut source = Source::start(&api, "outage").await;
    source.until(|e| matches!(e, SourceEvent::Synced)).await;

    // The API goes away: one Connected(false), however many watchers fail, however often.
    api.set_unavailable(true);
    assert_eq!(
        source.until_shown("Connected(false)").await,
        ["Connected(false)"]
    );
    api.delete(Kind::Service, "default", "gone");
    api.compact();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        source.drain(Duration::from_millis(100)).await,
        Vec::<String>::new()
    );

    // It comes back: Connected(true), and relists without the Service deleted meanwhile.
    api.set_unavailable(false);
    let back = source.until_shown("ServicesReset[web]").await;
    assert!(back.contains(&"Connected(true)".to_owned()), "{back:?}");
    assert!(
        !back
            .iter()
            .any(|e| e.contains("gone") && e.starts_with("Service")),
        "{back:?}"
    );
    assert_eq!(
        source
            .seen
            .iter()
            .filter(|e| e.starts_with("Connected"))
            .collect::<Vec<_>>(),
        ["Connected(false)", "Connected(true)"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_node_is_reported_as_none() {
    let api = FakeApi::start();
    api.apply(node("n2", "b"));
    let mut source = Source::start(&api, "nonode").await;
    let initial: Vec<String> = source
        .until(|e| matches!(e, SourceEvent::Synced))
        .await
        .iter()
        .map(show)
        .collect();
    assert_eq!(
        sorted(initial),
        ["Node -", "ServicesReset[]", "SlicesReset[]", "Synced"]
    );
    api.apply(node("n1", "a"));
    source.expect(&["Node n1 a"]).await;
    api.delete(Kind::Node, "", "n1");
    source.expect(&["Node -"]).await;
}

#[tokio::test]
async fn a_bad_kubeconfig_names_the_file() {
    let dir = TempDir::new("bad");
    let path = dir.0.join("kubeconfig");
    std::fs::write(&path, "not: [valid").unwrap();
    let err = kube::client(Some(&path)).await.err().expect("an error");
    assert!(
        err.to_string().starts_with(&path.display().to_string()),
        "{err}"
    );
}

/// Dropped watches resume from their resourceVersion: no error, no relist, no event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_watch_resumes_without_a_relist() {
    let api = FakeApi::start();
    seed(&api);
    let mut source = Source::start(&api, "dropped").await;
    source.until(|e| matches!(e, SourceEvent::Synced)).await;
    let lists = api.list_count(Kind::Service);

    api.drop_watches();
    assert_eq!(
        source.drain(Duration::from_secs(2)).await,
        Vec::<String>::new()
    );
    api.apply(service("api", json!({})));
    source.expect(&["ServiceApplied api"]).await;
    assert_eq!(
        api.list_count(Kind::Service),
        lists,
        "resumed, not relisted"
    );
}

/// After a short outage the watchers resume silently (nothing changed, no relist): the
/// recovery is still reported, by the probes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_recovery_is_reported() {
    let api = FakeApi::start();
    seed(&api);
    let mut source = Source::start(&api, "quiet").await;
    source.until(|e| matches!(e, SourceEvent::Synced)).await;

    api.set_unavailable(true);
    source.expect(&["Connected(false)"]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    api.set_unavailable(false);
    // Nothing but Connected(true): no Reset, no change.
    let back = source.until_shown("Connected(true)").await;
    assert_eq!(back, ["Connected(true)"]);
    assert_eq!(
        source.drain(Duration::from_secs(1)).await,
        Vec::<String>::new()
    );
}

/// Lists come in pages (500 objects each) and are reported whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_list_is_paged_and_reported_whole() {
    let api = FakeApi::start();
    api.apply_all(ferry_tests::fakeapi::generate(1_234, 2))
        .unwrap();
    let requests = api.request_count();
    let mut source = Source::start(&api, "large").await;
    let initial = source.until(|e| matches!(e, SourceEvent::Synced)).await;
    let mut counts = Vec::new();
    for event in &initial {
        match event {
            SourceEvent::ServicesReset(all) => counts.push(("services", all.len())),
            SourceEvent::SlicesReset(all) => counts.push(("slices", all.len())),
            _ => {}
        }
    }
    counts.sort();
    assert_eq!(counts, [("services", 1_234), ("slices", 1_234)]);
    // 3 pages for each of Services and slices, 1 for the Node.
    let requests = api.request_count() - requests;
    assert!(requests >= 7, "not paged: {requests} requests");
}

/// A Service as the API server accepts it but k8s-openapi's typed model rejects it:
/// `status.conditions[].lastTransitionTime: null` (upstream's "service status
/// lifecycle" e2e creates one), nulls in lists and fields, a null port error in the
/// load balancer status, fields no version knows yet.
fn odd_service(name: &str, port: u16, message: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "finalizers": null,
                     "labels": {"app": name}, "futureMeta": {"x": [null]}},
        "spec": {
            "clusterIP": "10.96.0.30", "clusterIPs": ["10.96.0.30", null],
            "ports": [{"name": "http", "port": port, "protocol": "TCP", "targetPort": null}],
            "externalIPs": null, "ipFamilies": [null], "futureSpec": true,
        },
        "status": {
            "conditions": [{"type": "StatusUpdate", "status": "True", "reason": "E2E",
                            "message": message, "lastTransitionTime": null}],
            "loadBalancer": {"ingress": [{"ip": "203.0.113.7", "ipMode": "VIP",
                "ports": [{"port": port, "protocol": "TCP", "error": null}]}, null]},
        },
    })
}

/// A Service ferry cannot read at all: `spec.ports` is not a list.
fn broken_service(name: &str, ports: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"clusterIP": "10.96.0.31", "ports": ports},
    })
}

/// An EndpointSlice the typed model rejects in fields ferry never reads.
fn odd_slice(name: &str, service: &str, ip: &str) -> Value {
    let mut s = slice(name, service, &[]);
    s["endpoints"] = json!([{"addresses": [ip, null], "conditions": {"ready": true, "serving": null},
                             "deprecatedTopology": {"x": null}, "zone": null}, null]);
    s
}

/// A Node the typed model rejects: a null quantity and a null transition time.
fn odd_node(name: &str, zone: &str) -> Value {
    let mut n = node(name, zone);
    n["status"]["capacity"] = json!({"cpu": null});
    n["status"]["conditions"] =
        json!([{"type": "Ready", "status": "True", "lastTransitionTime": null}]);
    n
}

/// One object the API server accepts never interrupts the watch for all: objects the
/// typed model rejects outside what ferry reads are listed and their changes delivered
/// one by one; one ferry cannot read is reported, counted and skipped while the others
/// in the same list and watch are delivered; nothing relists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_objects_never_interrupt_the_watch() {
    use k8s_openapi::api::core::v1::{Node, Service};
    use k8s_openapi::api::discovery::v1::EndpointSlice;

    // The fixtures really are what used to fail the watch.
    assert!(serde_json::from_value::<Service>(odd_service("odd", 80, "m")).is_err());
    assert!(
        serde_json::from_value::<EndpointSlice>(odd_slice("odd-1", "odd", "10.128.0.9")).is_err()
    );
    assert!(serde_json::from_value::<Node>(odd_node("n1", "a")).is_err());

    let api = FakeApi::start();
    seed(&api);
    api.apply(odd_service("odd", 80, "first"));
    api.apply(broken_service("broken", "80"));
    api.apply(odd_slice("odd-1", "odd", "10.128.0.9"));
    api.apply(odd_node("n1", "a"));
    let mut source = Source::start(&api, "odd").await;
    source
        .expect(&[
            "ServicesReset[gone,odd,web]",
            "SlicesReset[gone-1,odd-1,web-1]",
            "Node n1 a",
            "Unreadable(1)",
            "Synced",
        ])
        .await;
    let lists = Kind::ALL.map(|k| api.list_count(k));

    // A change of the odd Service arrives with what ferry reads.
    api.apply(odd_service("odd", 8080, "second"));
    let events = source
        .until(|e| matches!(e, SourceEvent::ServiceApplied(_)))
        .await;
    let Some(SourceEvent::ServiceApplied(odd)) = events.last() else {
        unreachable!()
    };
    assert_eq!(&*odd.name, "odd");
    let spec = odd.spec.as_ref().expect("spec");
    assert_eq!(spec.ports[0].port, 8080);
    let cluster_ips: Vec<&str> = spec.cluster_ips.iter().map(|ip| &**ip).collect();
    assert_eq!(cluster_ips, ["10.96.0.30"], "the null is dropped");
    assert_eq!(odd.ingress[0].ip.as_deref(), Some("203.0.113.7"));

    // The broken one changes (still broken): nothing; the next change of another
    // Service arrives right behind it.
    api.apply(broken_service("broken", "81"));
    api.apply(service("api", json!({})));
    source.expect(&["ServiceApplied api"]).await;

    // A good Service turns unreadable: its last good state stays (no Delete), it is
    // counted; fixed, it arrives again.
    api.apply(broken_service("web", "80"));
    api.apply(odd_slice("odd-1", "odd", "10.128.0.10"));
    source
        .expect(&["Unreadable(2)", "SliceApplied odd-1"])
        .await;
    api.apply(service("web", json!({})));
    source
        .expect(&["ServiceApplied web", "Unreadable(1)"])
        .await;

    // Deleting an unreadable object needs only its key.
    api.delete(Kind::Service, "default", "broken");
    source
        .expect(&["ServiceDeleted default/broken", "Unreadable(0)"])
        .await;
    api.apply(odd_node("n1", "b"));
    source.expect(&["Node n1 b"]).await;

    assert_eq!(
        Kind::ALL.map(|k| api.list_count(k)),
        lists,
        "watched on, not relisted"
    );
    let rest = source.drain(Duration::from_millis(500)).await;
    assert!(rest.is_empty(), "unexpected events {rest:?}");
    for event in &source.seen {
        let broken_delivered = event.starts_with("ServiceApplied broken")
            || (event.contains("Reset") && event.contains("broken"));
        assert!(
            !event.starts_with("Connected") && !broken_delivered,
            "{event}: no outage, no broken Service delivered; all events: {:#?}",
            source.seen
        );
    }
    assert_eq!(
        source.seen.iter().filter(|e| e.contains("Reset")).count(),
        2,
        "one list of each kind: {:#?}",
        source.seen
    );
}
