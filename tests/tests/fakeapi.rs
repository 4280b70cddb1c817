//! The fake Kubernetes API server: raw HTTP list/watch semantics, failure injection, and
//! a real kube-rs watcher against it. No root needed.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use ferry_tests::fakeapi::{FakeApi, Kind, Options, generate};
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------
// A raw HTTP/1.1 client

fn connect(api: &FakeApi, path: &str) -> TcpStream {
    let mut s = TcpStream::connect(api.addr()).expect("connect to the fake apiserver");
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {}\r\nAccept: application/json\r\n\r\n",
        api.addr()
    )
    .unwrap();
    s
}

/// Reads the status line and headers; returns (status, headers lowercased, leftover bytes).
fn read_head(s: &mut TcpStream, within: Duration) -> (u16, String, Vec<u8>) {
    let deadline = Instant::now() + within;
    let mut buf = Vec::new();
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let status = head.split(' ').nth(1).unwrap().parse().unwrap();
            return (status, head, buf[end + 4..].to_vec());
        }
        assert!(Instant::now() < deadline, "no response head");
        let mut tmp = [0u8; 4096];
        match s.read(&mut tmp) {
            Ok(0) => panic!("connection closed before the response head"),
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// A plain GET (content-length bodies); returns status and the parsed body.
fn get(api: &FakeApi, path: &str) -> (u16, Value) {
    let (status, body) = get_bytes(api, path);
    (status, serde_json::from_slice(&body).expect("JSON body"))
}

fn get_bytes(api: &FakeApi, path: &str) -> (u16, Vec<u8>) {
    let mut s = connect(api, path);
    let (status, head, mut body) = read_head(&mut s, Duration::from_secs(10));
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .expect("content-length")
        .trim()
        .parse()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while body.len() < len {
        assert!(Instant::now() < deadline, "body too slow");
        let mut tmp = vec![0u8; 1 << 16];
        match s.read(&mut tmp) {
            Ok(0) => panic!("closed mid-body"),
            Ok(n) => body.extend_from_slice(&tmp[..n]),
            Err(_) => {}
        }
    }
    body.truncate(len);
    (status, body)
}

#[derive(Debug)]
enum Next {
    Event(Value),
    Timeout,
    /// The terminating zero-length chunk: the server ended the watch.
    End,
    /// EOF without the terminating chunk: the stream was cut.
    Cut,
}

struct Watch {
    s: TcpStream,
    raw: Vec<u8>,
    body: Vec<u8>,
    ended: bool,
}

impl Watch {
    fn open(api: &FakeApi, path: &str) -> Watch {
        let mut s = connect(api, path);
        let (status, head, raw) = read_head(&mut s, Duration::from_secs(10));
        assert_eq!(status, 200, "watch {path}: {head}");
        assert!(head.contains("transfer-encoding: chunked"), "{head}");
        Watch {
            s,
            raw,
            body: Vec::new(),
            ended: false,
        }
    }

    /// Moves complete chunks from `raw` to `body`.
    fn decode(&mut self) {
        while !self.ended {
            let Some(eol) = self.raw.windows(2).position(|w| w == b"\r\n") else {
                return;
            };
            let size =
                usize::from_str_radix(std::str::from_utf8(&self.raw[..eol]).unwrap().trim(), 16)
                    .unwrap();
            if self.raw.len() < eol + 2 + size + 2 {
                return;
            }
            if size == 0 {
                self.ended = true;
            }
            self.body
                .extend_from_slice(&self.raw[eol + 2..eol + 2 + size]);
            assert_eq!(&self.raw[eol + 2 + size..eol + 4 + size], b"\r\n");
            self.raw.drain(..eol + 4 + size);
        }
    }

    fn next(&mut self, within: Duration) -> Next {
        let deadline = Instant::now() + within;
        loop {
            self.decode();
            if let Some(nl) = self.body.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.body.drain(..=nl).collect();
                return Next::Event(serde_json::from_slice(&line).expect("a JSON event line"));
            }
            if self.ended {
                return Next::End;
            }
            if Instant::now() >= deadline {
                return Next::Timeout;
            }
            let mut tmp = vec![0u8; 1 << 16];
            match self.s.read(&mut tmp) {
                Ok(0) => return Next::Cut,
                Ok(n) => self.raw.extend_from_slice(&tmp[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(_) => return Next::Cut,
            }
        }
    }

    /// The next event that is not a BOOKMARK.
    fn event(&mut self) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.next(deadline.saturating_duration_since(Instant::now())) {
                Next::Event(e) if e["type"] == "BOOKMARK" => continue,
                Next::Event(e) => return e,
                other => panic!("expected an event, got {other:?}"),
            }
        }
    }

    /// Asserts that nothing but bookmarks arrives for `d`.
    fn quiet(&mut self, d: Duration) {
        let deadline = Instant::now() + d;
        while Instant::now() < deadline {
            match self.next(deadline.saturating_duration_since(Instant::now())) {
                Next::Event(e) if e["type"] == "BOOKMARK" => {}
                Next::Timeout => return,
                other => panic!("expected quiet, got {other:?}"),
            }
        }
    }
}

fn ev(e: &Value) -> (String, String) {
    (
        e["type"].as_str().unwrap().to_string(),
        e["object"]["metadata"]["name"]
            .as_str()
            .unwrap_or("")
            .to_string(),
    )
}

fn rv(v: &Value) -> u64 {
    v["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

fn svc(name: &str, ns: &str, labels: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]},
    })
}

fn node(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": {}})
}

const NO_PROXY_NAME: &str = "labelSelector=%21service.kubernetes.io%2Fservice-proxy-name";

// ---------------------------------------------------------------------------------------
// Raw HTTP semantics

#[test]
fn list_get_and_pagination() {
    let api = FakeApi::start();
    for i in 0..5 {
        api.apply(svc(&format!("s{i}"), "default", json!({})));
    }
    api.apply(svc("other", "kube-system", json!({})));
    let (status, list) = get(&api, "/api/v1/services");
    assert_eq!(status, 200);
    assert_eq!(list["kind"], "ServiceList");
    assert_eq!(list["apiVersion"], "v1");
    assert_eq!(rv(&list), api.resource_version());
    assert_eq!(names(&list), ["s0", "s1", "s2", "s3", "s4", "other"]);
    let first = &list["items"][0];
    assert!(rv(first) > 0 && rv(first) < rv(&list));
    assert!(
        first["metadata"]["uid"]
            .as_str()
            .is_some_and(|u| !u.is_empty())
    );
    assert!(
        first["metadata"]["creationTimestamp"]
            .as_str()
            .unwrap()
            .ends_with('Z')
    );
    assert_eq!(api.list_count(Kind::Service), 1);

    let (_, ns_list) = get(&api, "/api/v1/namespaces/kube-system/services");
    assert_eq!(names(&ns_list), ["other"]);
    let (status, one) = get(&api, "/api/v1/namespaces/default/services/s3");
    assert_eq!(
        (status, one["metadata"]["name"].as_str()),
        (200, Some("s3"))
    );
    let (status, missing) = get(&api, "/api/v1/namespaces/default/services/nope");
    assert_eq!(
        (status, missing["reason"].as_str()),
        (404, Some("NotFound"))
    );

    // Pages come from one snapshot: the list RV stays, later changes are not mixed in.
    let (_, p1) = get(&api, "/api/v1/services?limit=2");
    let snapshot_rv = rv(&p1);
    assert_eq!(names(&p1), ["s0", "s1"]);
    assert_eq!(p1["metadata"]["remainingItemCount"], 4);
    api.apply(svc("s9", "default", json!({})));
    assert!(api.delete(Kind::Service, "default", "s3"));
    let mut all = names(&p1);
    let mut token = p1["metadata"]["continue"].as_str().unwrap().to_string();
    let mut pages = 1;
    while !token.is_empty() {
        let (status, page) = get(&api, &format!("/api/v1/services?limit=2&continue={token}"));
        assert_eq!(status, 200, "{page}");
        assert_eq!(rv(&page), snapshot_rv);
        all.extend(names(&page));
        token = page["metadata"]["continue"]
            .as_str()
            .unwrap_or("")
            .to_string();
        pages += 1;
    }
    assert_eq!(pages, 3);
    assert_eq!(all, ["s0", "s1", "s2", "s3", "s4", "other"]);
    assert_eq!(
        api.list_count(Kind::Service),
        3,
        "continuation pages are not counted"
    );

    // A continue token from before a compaction is expired (HTTP 410).
    let (_, p1) = get(&api, "/api/v1/services?limit=2");
    let token = p1["metadata"]["continue"].as_str().unwrap().to_string();
    api.compact();
    let (status, err) = get(&api, &format!("/api/v1/services?limit=2&continue={token}"));
    assert_eq!(status, 410);
    assert_eq!(
        (
            err["kind"].as_str(),
            err["reason"].as_str(),
            err["code"].as_u64()
        ),
        (Some("Status"), Some("Expired"), Some(410))
    );

    // Discovery, version, unknown paths.
    assert_eq!(get(&api, "/version").1["major"], "1");
    assert_eq!(get(&api, "/api").1["versions"][0], "v1");
    assert_eq!(
        get(&api, "/apis").1["groups"][0]["name"],
        "discovery.k8s.io"
    );
    assert_eq!(get(&api, "/api/v1/pods").0, 404);

    // EndpointSlices are served under their group.
    api.apply_all(generate(3, 2)).unwrap();
    let (_, slices) = get(
        &api,
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
    );
    assert_eq!(slices["kind"], "EndpointSliceList");
    assert_eq!(names(&slices), ["svc-0-0", "svc-1-0", "svc-2-0"]);
    assert_eq!(slices["items"][2]["endpoints"].as_array().unwrap().len(), 2);
}

#[test]
fn apply_is_idempotent_and_keeps_identity() {
    let api = FakeApi::start();
    let rv1 = api.apply(svc("a", "default", json!({"x": "1"})));
    let uid = api.get(Kind::Service, "default", "a").unwrap()["metadata"]["uid"].clone();
    assert_eq!(
        api.apply(svc("a", "default", json!({"x": "1"}))),
        rv1,
        "no-op apply"
    );
    let rv2 = api.apply(svc("a", "default", json!({"x": "2"})));
    assert!(rv2 > rv1);
    let stored = api.get(Kind::Service, "default", "a").unwrap();
    assert_eq!(stored["metadata"]["uid"], uid);
    assert_eq!(stored["metadata"]["labels"]["x"], "2");
    // Namespace defaults; Nodes are cluster-scoped; RVs are global across kinds.
    let rv3 = api.apply(json!({"kind": "Service", "metadata": {"name": "b"}}));
    assert!(api.get(Kind::Service, "default", "b").is_some());
    let rv4 = api.apply(node("n1"));
    assert!(rv4 > rv3 && rv3 > rv2);
    assert_eq!(
        api.apply_yaml(&ferry_tests::manifests::service(
            "c",
            &["10.96.0.30"],
            &[("", 80, "TCP")],
            ""
        )),
        1
    );
    assert_eq!(
        api.get(Kind::Service, "default", "c").unwrap()["spec"]["clusterIP"],
        "10.96.0.30"
    );
    assert!(
        api.try_apply(json!({"kind": "Pod", "metadata": {"name": "p"}}))
            .is_err()
    );
    assert!(!api.delete(Kind::Service, "default", "zzz"));
}

#[test]
fn watch_from_resource_version() {
    let api = FakeApi::start();
    api.apply(svc("a", "default", json!({})));
    let (_, list) = get(&api, "/api/v1/services");
    let list_rv = rv(&list);
    // Events strictly after N, including ones from before the watch opened.
    api.apply(svc("b", "default", json!({})));
    let mut w = Watch::open(
        &api,
        &format!("/api/v1/services?watch=1&resourceVersion={list_rv}"),
    );
    assert_eq!(ev(&w.event()), ("ADDED".into(), "b".into()));
    assert_eq!(api.watch_count(Kind::Service), 1);

    let t = Instant::now();
    api.apply(svc("a", "default", json!({"changed": "yes"})));
    let e = w.event();
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "apply must notify at once"
    );
    assert_eq!(ev(&e), ("MODIFIED".into(), "a".into()));
    assert_eq!(e["object"]["metadata"]["labels"]["changed"], "yes");
    assert_eq!(rv(&e["object"]), api.resource_version());

    // Other kinds and namespaces do not show up; deletions carry the deletion RV.
    api.apply(node("n1"));
    api.apply(svc("c", "elsewhere", json!({})));
    assert!(api.delete(Kind::Service, "default", "b"));
    let e = w.event();
    assert_eq!(ev(&e), ("ADDED".into(), "c".into()));
    let e = w.event();
    assert_eq!(ev(&e), ("DELETED".into(), "b".into()));
    assert_eq!(rv(&e["object"]), api.resource_version());

    // A namespaced watch with resourceVersion=0 starts with the current objects.
    let mut w0 = Watch::open(
        &api,
        "/api/v1/namespaces/default/services?watch=true&resourceVersion=0",
    );
    assert_eq!(ev(&w0.event()), ("ADDED".into(), "a".into()));
    w0.quiet(Duration::from_millis(200));
    api.apply(svc("c", "elsewhere", json!({"x": "y"})));
    api.apply(svc("d", "default", json!({})));
    assert_eq!(ev(&w0.event()), ("ADDED".into(), "d".into()));
    assert_eq!(ev(&w.event()), ("MODIFIED".into(), "c".into()));
    assert_eq!(api.open_watches(), 2);
}

#[test]
fn watch_timeout_ends_gracefully() {
    let api = FakeApi::start();
    let t = Instant::now();
    let mut w = Watch::open(&api, "/api/v1/services?watch=true&timeoutSeconds=1");
    assert!(matches!(w.next(Duration::from_secs(5)), Next::End));
    assert!(t.elapsed() >= Duration::from_millis(900));
}

#[test]
fn label_selectors_in_list_and_watch() {
    let api = FakeApi::start();
    api.apply(svc("plain", "default", json!({"app": "web"})));
    api.apply(svc(
        "proxied",
        "default",
        json!({"service.kubernetes.io/service-proxy-name": "other", "app": "db"}),
    ));
    api.apply(svc(
        "headless",
        "default",
        json!({"service.kubernetes.io/headless": "", "app": "web"}),
    ));

    let q = |sel: &str| names(&get(&api, &format!("/api/v1/services?{sel}")).1);
    assert_eq!(q(NO_PROXY_NAME), ["headless", "plain"]);
    assert_eq!(q("labelSelector=app%3Dweb"), ["headless", "plain"]);
    assert_eq!(q("labelSelector=app!%3Dweb"), ["proxied"]);
    assert_eq!(
        q("labelSelector=service.kubernetes.io%2Fservice-proxy-name"),
        ["proxied"]
    );
    assert_eq!(
        q(
            "labelSelector=%21service.kubernetes.io%2Fservice-proxy-name%2C%21service.kubernetes.io%2Fheadless"
        ),
        ["plain"]
    );
    assert_eq!(
        q("labelSelector=app+in+%28db%2Cweb%29%2Capp+notin+%28web%29"),
        ["proxied"]
    );
    assert_eq!(get(&api, "/api/v1/services?labelSelector=%3Dx").0, 400);

    // Objects entering or leaving the selection are ADDED / DELETED for the watch.
    let (_, list) = get(&api, &format!("/api/v1/services?{NO_PROXY_NAME}"));
    let mut w = Watch::open(
        &api,
        &format!(
            "/api/v1/services?watch=true&resourceVersion={}&{NO_PROXY_NAME}",
            rv(&list)
        ),
    );
    api.apply(svc(
        "plain",
        "default",
        json!({"service.kubernetes.io/service-proxy-name": "other"}),
    ));
    assert_eq!(ev(&w.event()), ("DELETED".into(), "plain".into()));
    api.apply(svc("proxied", "default", json!({"app": "db"})));
    assert_eq!(ev(&w.event()), ("ADDED".into(), "proxied".into()));
    api.apply(svc("proxied", "default", json!({"app": "db2"})));
    assert_eq!(ev(&w.event()), ("MODIFIED".into(), "proxied".into()));
    api.apply(svc(
        "plain",
        "default",
        json!({"service.kubernetes.io/service-proxy-name": "again"}),
    ));
    assert!(api.delete(Kind::Service, "default", "plain"));
    api.apply(svc(
        "new-proxied",
        "default",
        json!({"service.kubernetes.io/service-proxy-name": "x"}),
    ));
    api.apply(svc("new", "default", json!({})));
    assert_eq!(
        ev(&w.event()),
        ("ADDED".into(), "new".into()),
        "non-matching changes are not sent"
    );
}

#[test]
fn field_selector_on_nodes() {
    let api = FakeApi::start();
    for n in ["node-a", "node-b", "node-c"] {
        api.apply(node(n));
    }
    let (_, list) = get(&api, "/api/v1/nodes?fieldSelector=metadata.name%3Dnode-b");
    assert_eq!(list["kind"], "NodeList");
    assert_eq!(names(&list), ["node-b"]);
    let (_, list) = get(&api, "/api/v1/nodes?fieldSelector=metadata.name!%3Dnode-b");
    assert_eq!(names(&list), ["node-a", "node-c"]);
    let (status, one) = get(&api, "/api/v1/nodes/node-c");
    assert_eq!((status, one["kind"].as_str()), (200, Some("Node")));
    assert!(one["metadata"].get("namespace").is_none());
    assert_eq!(get(&api, "/api/v1/nodes/node-z").0, 404);

    let mut w = Watch::open(
        &api,
        "/api/v1/nodes?watch=true&fieldSelector=metadata.name%3Dnode-b",
    );
    assert_eq!(ev(&w.event()), ("ADDED".into(), "node-b".into()));
    api.apply(json!({"kind": "Node", "metadata": {"name": "node-a", "labels": {"x": "1"}}}));
    api.apply(json!({"kind": "Node", "metadata": {"name": "node-b", "labels": {"x": "1"}}}));
    assert_eq!(ev(&w.event()), ("MODIFIED".into(), "node-b".into()));
    assert!(api.delete(Kind::Node, "", "node-b"));
    assert_eq!(ev(&w.event()), ("DELETED".into(), "node-b".into()));
}

#[test]
fn bookmarks_arrive_periodically() {
    let api = FakeApi::start_with(Options {
        bookmark_interval: Duration::from_millis(100),
        ..Options::default()
    })
    .unwrap();
    api.apply(svc("a", "default", json!({})));
    let head = api.resource_version();
    let mut w = Watch::open(
        &api,
        &format!("/api/v1/services?watch=true&allowWatchBookmarks=true&resourceVersion={head}"),
    );
    // Events of other kinds move the bookmark RV forward.
    api.apply(node("n1"));
    let mut marks = Vec::new();
    let t = Instant::now();
    while marks.len() < 3 {
        match w.next(Duration::from_secs(5)) {
            Next::Event(e) => {
                assert_eq!(e["type"], "BOOKMARK", "{e}");
                assert_eq!(e["object"]["kind"], "Service");
                assert_eq!(
                    e["object"]["metadata"].as_object().unwrap().len(),
                    1,
                    "only the RV: {e}"
                );
                marks.push(rv(&e["object"]));
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(t.elapsed() < Duration::from_secs(2));
    assert_eq!(*marks.last().unwrap(), api.resource_version());

    // Without allowWatchBookmarks there are none.
    let mut quiet = Watch::open(
        &api,
        &format!("/api/v1/services?watch=true&resourceVersion={head}"),
    );
    assert!(matches!(
        quiet.next(Duration::from_millis(400)),
        Next::Timeout
    ));

    // Streaming lists: initial objects, then the initial-events-end bookmark.
    let mut s = Watch::open(
        &api,
        "/api/v1/services?watch=true&sendInitialEvents=true&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan&resourceVersion=0",
    );
    assert_eq!(ev(&s.event_or_bookmark()), ("ADDED".into(), "a".into()));
    let end = s.event_or_bookmark();
    assert_eq!(end["type"], "BOOKMARK");
    assert_eq!(
        end["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );
}

impl Watch {
    fn event_or_bookmark(&mut self) -> Value {
        match self.next(Duration::from_secs(5)) {
            Next::Event(e) => e,
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn expired_after_compact_and_history_limit() {
    let api = FakeApi::start();
    api.apply(svc("a", "default", json!({})));
    let old = api.resource_version();
    api.apply(svc("b", "default", json!({})));
    // An open watch that has seen everything survives a compaction.
    let mut live = Watch::open(
        &api,
        &format!("/api/v1/services?watch=true&resourceVersion={old}"),
    );
    assert_eq!(ev(&live.event()), ("ADDED".into(), "b".into()));
    api.compact();
    let mut w = Watch::open(
        &api,
        &format!("/api/v1/services?watch=true&resourceVersion={old}"),
    );
    let e = w.event();
    assert_eq!(e["type"], "ERROR");
    assert_eq!(e["object"]["kind"], "Status");
    assert_eq!(e["object"]["code"], 410);
    assert_eq!(e["object"]["reason"], "Expired");
    assert!(matches!(w.next(Duration::from_secs(5)), Next::End));
    // The current RV (from a fresh list) is fine.
    let (_, list) = get(&api, "/api/v1/services");
    let mut fresh = Watch::open(
        &api,
        &format!("/api/v1/services?watch=true&resourceVersion={}", rv(&list)),
    );
    api.apply(svc("c", "default", json!({})));
    assert_eq!(ev(&fresh.event()), ("ADDED".into(), "c".into()));
    assert_eq!(ev(&live.event()), ("ADDED".into(), "c".into()));

    // A bounded history: resuming from before the retained window is expired, too.
    let small = FakeApi::start_with(Options {
        history_limit: 3,
        ..Options::default()
    })
    .unwrap();
    let start = small.resource_version();
    for i in 0..5 {
        small.apply(svc(&format!("s{i}"), "default", json!({})));
    }
    let mut w = Watch::open(
        &small,
        &format!("/api/v1/services?watch=true&resourceVersion={start}"),
    );
    assert_eq!(w.event()["object"]["code"], 410);
    let mut w = Watch::open(
        &small,
        &format!("/api/v1/services?watch=true&resourceVersion={}", start + 2),
    );
    assert_eq!(ev(&w.event()), ("ADDED".into(), "s2".into()));
}

#[test]
fn drop_watches_cuts_streams() {
    let api = FakeApi::start();
    let mut a = Watch::open(&api, "/api/v1/services?watch=true");
    let mut b = Watch::open(
        &api,
        "/apis/discovery.k8s.io/v1/endpointslices?watch=true&allowWatchBookmarks=true",
    );
    let t = Instant::now();
    while api.open_watches() < 2 {
        assert!(t.elapsed() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(5));
    }
    api.drop_watches();
    assert!(matches!(a.next(Duration::from_secs(5)), Next::Cut));
    assert!(matches!(b.next(Duration::from_secs(5)), Next::Cut));
    let t = Instant::now();
    while api.open_watches() > 0 {
        assert!(t.elapsed() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(5));
    }
    // New watches work afterwards.
    let mut c = Watch::open(&api, "/api/v1/services?watch=true");
    api.apply(svc("x", "default", json!({})));
    assert_eq!(ev(&c.event()), ("ADDED".into(), "x".into()));
}

#[test]
fn stalled_watches_send_nothing() {
    let api = FakeApi::start_with(Options {
        bookmark_interval: Duration::from_millis(50),
        ..Options::default()
    })
    .unwrap();
    let head = api.resource_version();
    let mut w = Watch::open(
        &api,
        &format!("/api/v1/services?watch=true&allowWatchBookmarks=true&resourceVersion={head}"),
    );
    assert_eq!(w.event_or_bookmark()["type"], "BOOKMARK");
    api.stall_watches(true);
    // Drain whatever was in flight before the stall.
    while let Next::Event(_) = w.next(Duration::from_millis(150)) {}
    api.apply(svc("late", "default", json!({})));
    assert!(
        matches!(w.next(Duration::from_millis(500)), Next::Timeout),
        "stalled: no events, no bookmarks"
    );
    api.stall_watches(false);
    assert_eq!(ev(&w.event()), ("ADDED".into(), "late".into()));
}

#[test]
fn unavailable_and_slow_lists() {
    let api = FakeApi::start();
    api.apply(svc("a", "default", json!({})));
    let mut w = Watch::open(&api, "/api/v1/services?watch=true");
    assert_eq!(ev(&w.event()), ("ADDED".into(), "a".into()));
    api.set_unavailable(true);
    assert!(matches!(w.next(Duration::from_secs(5)), Next::Cut));
    let (status, body) = get(&api, "/api/v1/services");
    assert_eq!(
        (status, body["reason"].as_str(), body["code"].as_u64()),
        (503, Some("ServiceUnavailable"), Some(503))
    );
    let mut s = connect(&api, "/api/v1/services?watch=true");
    assert_eq!(read_head(&mut s, Duration::from_secs(5)).0, 503);
    api.set_unavailable(false);
    assert_eq!(get(&api, "/api/v1/services").0, 200);

    api.set_list_delay(Duration::from_millis(300));
    let t = Instant::now();
    assert_eq!(names(&get(&api, "/api/v1/services").1), ["a"]);
    assert!(t.elapsed() >= Duration::from_millis(300));
    api.set_list_delay(Duration::ZERO);
}

#[test]
fn large_lists_are_fast() {
    let api = FakeApi::start();
    let t = Instant::now();
    api.apply_all(generate(10_000, 10)).unwrap();
    eprintln!("apply 10000 services + 10000 slices: {:?}", t.elapsed());
    let svc_ip =
        api.get(Kind::Service, "default", "svc-9999").unwrap()["spec"]["clusterIP"].clone();
    assert_eq!(svc_ip, "10.96.39.25");

    let t = Instant::now();
    let (status, services) = get_bytes(&api, "/api/v1/services");
    let ts = t.elapsed();
    let t = Instant::now();
    let (_, slices) = get_bytes(&api, "/apis/discovery.k8s.io/v1/endpointslices");
    let te = t.elapsed();
    eprintln!(
        "list 10000 services: {ts:?} ({} KiB), 10000 endpointslices: {te:?} ({} KiB)",
        services.len() / 1024,
        slices.len() / 1024
    );
    assert_eq!(status, 200);
    assert!(
        ts + te < Duration::from_secs(1),
        "lists too slow: {ts:?} + {te:?}"
    );
    let services: Value = serde_json::from_slice(&services).unwrap();
    let slices: Value = serde_json::from_slice(&slices).unwrap();
    assert_eq!(services["items"].as_array().unwrap().len(), 10_000);
    assert_eq!(slices["items"].as_array().unwrap().len(), 10_000);
    assert_eq!(
        slices["items"][0]["endpoints"].as_array().unwrap().len(),
        10
    );

    // An apply reaches a watcher at once even with a big store.
    let mut w = Watch::open(
        &api,
        &format!(
            "/api/v1/services?watch=true&resourceVersion={}",
            api.resource_version()
        ),
    );
    let t = Instant::now();
    api.apply(svc("svc-5", "default", json!({"touched": "1"})));
    assert_eq!(ev(&w.event()), ("MODIFIED".into(), "svc-5".into()));
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn binary_serves_loaded_and_generated_objects() {
    let dir = std::env::temp_dir().join(format!("ferry-fakeapi-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let manifests = ferry_tests::manifests::docs(&[
        ferry_tests::manifests::service("web", &["10.96.1.1"], &[("http", 80, "TCP")], ""),
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: n1\n".to_string(),
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ignored\n".to_string(),
    ]);
    std::fs::write(dir.join("objects.yaml"), manifests).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ferry-fakeapi"))
        .args(["--listen", "127.0.0.1:0", "--kubeconfig"])
        .arg(&kubeconfig)
        .arg("--load")
        .arg(&dir)
        .args(["--generate-services", "5", "--endpoints-per-service", "3"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let url = line
        .trim()
        .strip_prefix("ready ")
        .unwrap_or_else(|| panic!("{line:?}"))
        .to_string();
    let config = std::fs::read_to_string(&kubeconfig).unwrap();
    assert!(config.contains(&url), "{config}");
    // Talk to it with a std client.
    let addr = url.strip_prefix("http://").unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET /api/v1/services HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let body: Value = serde_json::from_str(resp.split_once("\r\n\r\n").unwrap().1).unwrap();
    let got: BTreeSet<String> = names(&body).into_iter().collect();
    let want: BTreeSet<String> = ["web", "svc-0", "svc-1", "svc-2", "svc-3", "svc-4"]
        .map(String::from)
        .into();
    assert_eq!(got, want);
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------
// A real kube-rs watcher

mod kube_client {
    use super::*;
    use futures::{StreamExt, stream::BoxStream};
    use k8s_openapi::api::core::v1::Service;
    use kube::runtime::watcher::{self, Event};
    use kube::{Api, Client, config::KubeConfigOptions, config::Kubeconfig};
    use std::collections::BTreeMap;

    async fn client(api: &FakeApi) -> Client {
        let path = std::env::temp_dir().join(format!(
            "ferry-fakeapi-kubeconfig-{}-{}",
            std::process::id(),
            api.addr().port()
        ));
        api.write_kubeconfig(&path).unwrap();
        let kc = Kubeconfig::read_from(&path).expect("the written kubeconfig parses");
        let _ = std::fs::remove_file(&path);
        assert_eq!(kc.current_context.as_deref(), Some("ferry-fake"));
        let mut config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .expect("a usable kubeconfig");
        assert_eq!(
            config.cluster_url.to_string().trim_end_matches('/'),
            api.url()
        );
        assert_eq!(config.default_namespace, "default");
        // A proxy from the environment must not get between the test and 127.0.0.1.
        config.proxy_url = None;
        Client::try_from(config).expect("a client")
    }

    fn service(name: &str, labels: &[(&str, &str)]) -> Service {
        let mut s = Service::default();
        s.metadata.name = Some(name.into());
        s.metadata.namespace = Some("default".into());
        s.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        s.spec = Some(k8s_openapi::api::core::v1::ServiceSpec {
            cluster_ip: Some("10.96.0.50".into()),
            ..Default::default()
        });
        s
    }

    type Stream = BoxStream<'static, watcher::Result<Event<Service>>>;

    fn name(s: &Service) -> String {
        s.metadata.name.clone().unwrap()
    }

    /// The next event (errors are expected around disconnects and are counted).
    async fn next(stream: &mut Stream, errors: &mut usize) -> Event<Service> {
        loop {
            match tokio::time::timeout(Duration::from_secs(15), stream.next()).await {
                Ok(Some(Ok(e))) => return e,
                Ok(Some(Err(_))) => *errors += 1,
                Ok(None) => panic!("watcher stream ended"),
                Err(_) => panic!("no watcher event within 15s"),
            }
        }
    }

    /// Consumes Init, InitApply..., InitDone; returns the listed names.
    async fn init(stream: &mut Stream, errors: &mut usize) -> BTreeSet<String> {
        loop {
            if let Event::Init = next(stream, errors).await {
                break;
            }
        }
        let mut seen = BTreeSet::new();
        loop {
            match next(stream, errors).await {
                Event::InitApply(s) => {
                    seen.insert(name(&s));
                }
                Event::InitDone => return seen,
                other => panic!("unexpected during init: {other:?}"),
            }
        }
    }

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn kube_watcher_list_watch_and_relist() {
        let api = FakeApi::start();
        api.apply(service("a", &[]));
        api.apply(service("b", &[("app", "b")]));
        api.apply(service(
            "skipped",
            &[("service.kubernetes.io/service-proxy-name", "other")],
        ));
        rt().block_on(async {
            let client = client(&api).await;
            let cfg =
                watcher::Config::default().labels("!service.kubernetes.io/service-proxy-name");
            let mut stream: Stream = watcher::watcher(Api::<Service>::all(client), cfg).boxed();
            let mut errors = 0;

            assert_eq!(init(&mut stream, &mut errors).await, set(&["a", "b"]));
            assert_eq!(api.list_count(Kind::Service), 1);

            api.apply(service("c", &[]));
            match next(&mut stream, &mut errors).await {
                Event::Apply(s) => assert_eq!(name(&s), "c"),
                other => panic!("{other:?}"),
            }
            api.apply(service("a", &[("changed", "yes")]));
            match next(&mut stream, &mut errors).await {
                Event::Apply(s) => assert_eq!(s.metadata.labels.unwrap()["changed"], "yes"),
                other => panic!("{other:?}"),
            }
            // Leaving the selection is a Delete, as is a deletion.
            api.apply(service(
                "a",
                &[("service.kubernetes.io/service-proxy-name", "other")],
            ));
            match next(&mut stream, &mut errors).await {
                Event::Delete(s) => assert_eq!(name(&s), "a"),
                other => panic!("{other:?}"),
            }
            assert!(api.delete(Kind::Service, "default", "b"));
            match next(&mut stream, &mut errors).await {
                Event::Delete(s) => assert_eq!(name(&s), "b"),
                other => panic!("{other:?}"),
            }
            assert_eq!(errors, 0);
            assert_eq!(api.watch_count(Kind::Service), 1);

            // History gone and the stream cut: the reconnect gets 410 and the watcher relists.
            let lists = api.list_count(Kind::Service);
            api.compact();
            api.drop_watches();
            assert_eq!(init(&mut stream, &mut errors).await, set(&["c"]));
            assert!(
                api.list_count(Kind::Service) > lists,
                "the watcher relisted"
            );
            assert!(errors >= 1, "the 410 surfaced as a watcher error");

            // And it watches again from the new list.
            api.apply(service("d", &[]));
            match next(&mut stream, &mut errors).await {
                Event::Apply(s) => assert_eq!(name(&s), "d"),
                other => panic!("{other:?}"),
            }
            let expected: BTreeSet<String> = api
                .list(Kind::Service)
                .iter()
                .filter(|o| {
                    o["metadata"]["labels"]
                        .get("service.kubernetes.io/service-proxy-name")
                        .is_none()
                })
                .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
                .collect();
            assert_eq!(expected, set(&["c", "d"]));
        });
    }

    #[test]
    fn kube_watcher_pages_and_streaming_lists() {
        let api = FakeApi::start();
        for i in 0..7 {
            api.apply(service(&format!("p{i}"), &[]));
        }
        let want: BTreeSet<String> = (0..7).map(|i| format!("p{i}")).collect();
        rt().block_on(async {
            let client = client(&api).await;
            let mut errors = 0;
            let mut paged: Stream = watcher::watcher(
                Api::<Service>::namespaced(client.clone(), "default"),
                watcher::Config::default().page_size(3),
            )
            .boxed();
            assert_eq!(init(&mut paged, &mut errors).await, want);
            assert_eq!(api.list_count(Kind::Service), 1, "one list of three pages");

            let mut streaming: Stream = watcher::watcher(
                Api::<Service>::all(client),
                watcher::Config::default().streaming_lists(),
            )
            .boxed();
            assert_eq!(init(&mut streaming, &mut errors).await, want);
            assert_eq!(
                api.list_count(Kind::Service),
                1,
                "streaming lists do not list"
            );
            assert_eq!(errors, 0);

            api.apply(service("p0", &[("v", "2")]));
            for s in [&mut paged, &mut streaming] {
                match next(s, &mut errors).await {
                    Event::Apply(s) => assert_eq!(name(&s), "p0"),
                    other => panic!("{other:?}"),
                }
            }
            // A stall then a cut: both resume without losing the change made meanwhile.
            api.stall_watches(true);
            api.apply(service("p1", &[("v", "2")]));
            api.drop_watches();
            api.stall_watches(false);
            let mut per_stream = Vec::new();
            for s in [&mut paged, &mut streaming] {
                let mut got = BTreeMap::new();
                while !got.contains_key("p1") {
                    match next(s, &mut errors).await {
                        Event::Apply(o) | Event::InitApply(o) => {
                            got.insert(
                                name(&o),
                                o.metadata.labels.unwrap_or_default().get("v").cloned(),
                            );
                        }
                        _ => {}
                    }
                }
                per_stream.push(got["p1"].clone());
            }
            assert_eq!(per_stream, [Some("2".to_string()), Some("2".to_string())]);
        });
    }
}
