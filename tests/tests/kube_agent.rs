//! The real agent fed by the Kubernetes API (`ferry agent --kubeconfig`), with real
//! traffic: the in-process fake API server listens inside the world's node namespace
//! (see [`World::start_fake_api`]), the agent reaches it on 127.0.0.1 there, and clients
//! in the world's cgroup go through the programs.
//!
//! Covered: programming and live changes, the proxy-name label, bootstrap on the
//! kubeconfig's own address, an unavailable API server, 410 Gone relists, slow lists,
//! stalled watches, /healthz and node eligibility, topology hints from the Node's zone,
//! coalescing of bursts, and isolation between Services.

use std::{
    collections::BTreeSet,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use ferry_tests::fakeapi::{FakeApi, Kind};
use ferry_tests::*;
use serde_json::{Value, json};

const WEB_VIP: &str = "10.96.0.10";
const API_VIP: &str = "10.96.0.11";
const GONE_VIP: &str = "10.96.0.12";
const OTHER_VIP: &str = "10.96.0.20";
const KUBERNETES_VIP: &str = "10.96.0.1";
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
const PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
const WAIT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------
// The world and its API server

/// A world and the fake API server in its node namespace. `api` is declared first so
/// that it is dropped first: its threads hold the node namespace until then.
struct Cluster {
    api: FakeApi,
    w: World,
}

impl Cluster {
    fn new(test: &str, pods: usize, ports: &[u16]) -> Cluster {
        let w = World::new(test, pods, ports);
        let api = w.start_fake_api();
        Cluster { api, w }
    }

    /// Starts `ferry agent --kubeconfig` and waits for /healthz 200.
    fn start(&mut self) {
        let kubeconfig = self.w.write_kubeconfig(&self.api);
        self.w.start_agent_kube(&kubeconfig, &[]);
    }

    fn pod_ip(&self, name: &str) -> String {
        self.w.pod(name).v4.to_string()
    }

    /// The IPv4 addresses of `names`.
    fn ips(&self, names: &[&str]) -> Vec<String> {
        names.iter().map(|n| self.pod_ip(n)).collect()
    }
}

// ---------------------------------------------------------------------------------------
// Objects

/// A ClusterIP Service, port `http` 80 -> 8080/TCP.
fn service(name: &str, vip: &str, labels: Value) -> Value {
    service_ports(name, vip, labels, &[("http", 80, 8080)], json!({}))
}

/// A ClusterIP Service with ports (name, port, targetPort) and `extra` merged into spec.
fn service_ports(
    name: &str,
    vip: &str,
    labels: Value,
    ports: &[(&str, u16, u16)],
    extra: Value,
) -> Value {
    let ports: Vec<Value> = ports
        .iter()
        .map(|(n, p, t)| json!({"name": n, "port": p, "targetPort": t, "protocol": "TCP"}))
        .collect();
    let mut spec =
        json!({"type": "ClusterIP", "clusterIP": vip, "clusterIPs": [vip], "ports": ports});
    if let Value::Object(m) = extra {
        for (k, v) in m {
            spec[k] = v;
        }
    }
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "spec": spec,
    })
}

/// A ready endpoint.
fn endpoint(ip: &str) -> Value {
    json!({"addresses": [ip], "conditions": {"ready": true, "serving": true, "terminating": false}})
}

/// An endpoint in `zone`, hinted for `hint` (no hint when `None`).
fn zoned_endpoint(ip: &str, zone: &str, hint: Option<&str>) -> Value {
    let mut e = endpoint(ip);
    e["zone"] = zone.into();
    if let Some(h) = hint {
        e["hints"] = json!({"forZones": [{"name": h}]});
    }
    e
}

/// An EndpointSlice of `svc` with port `http` 8080/TCP.
fn slice(svc: &str, name: &str, endpoints: Vec<Value>) -> Value {
    slice_ports(svc, name, &[("http", 8080)], endpoints)
}

fn slice_ports(svc: &str, name: &str, ports: &[(&str, u16)], endpoints: Vec<Value>) -> Value {
    let ports: Vec<Value> = ports
        .iter()
        .map(|(n, p)| json!({"name": n, "port": p, "protocol": "TCP"}))
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": svc},
        },
        "addressType": "IPv4",
        "ports": ports,
        "endpoints": endpoints,
    })
}

fn ready(ips: &[String]) -> Vec<Value> {
    ips.iter().map(|ip| endpoint(ip)).collect()
}

/// The Node `node1` (the agent's --node-name), in `zone`, with extra metadata/spec.
fn node(zone: &str, extra_meta: Value, spec: Value) -> Value {
    let mut n = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "node1", "labels": {ZONE_LABEL: zone}},
        "spec": spec,
    });
    if let Value::Object(m) = extra_meta {
        for (k, v) in m {
            n["metadata"][k] = v;
        }
    }
    n
}

// ---------------------------------------------------------------------------------------
// Traffic and observation

fn addr(vip: &str) -> String {
    format!("{vip}:80")
}

/// `n` TCP attempts to `target`; Ok(backends) when every attempt was answered.
fn answered(w: &World, target: &str, n: usize) -> Result<BTreeSet<String>, String> {
    let outs = w.probe("tcp", target, n);
    match outs.iter().find(|o| !o.ok) {
        Some(bad) => Err(format!("an attempt to {target} failed: {bad:?}")),
        None => Ok(backends(&outs)),
    }
}

/// Waits until `target` is served by exactly `want` (every attempt answered).
fn wait_backends(w: &World, target: &str, want: &[&str]) {
    let want = set(want);
    eventually(&format!("{target} served by {want:?}"), WAIT, || {
        let seen = answered(w, target, 24)?;
        if seen == want {
            Ok(())
        } else {
            Err(format!("expected backends {want:?}, seen {seen:?}"))
        }
    });
}

/// Asserts, without waiting, that `target` is served by exactly `want` (30 attempts).
fn assert_backends(w: &World, target: &str, want: &[&str], when: &str) {
    let want = set(want);
    let seen = answered(w, target, 30).unwrap_or_else(|e| panic!("{when}: {e}"));
    assert_eq!(
        seen, want,
        "{when}: expected {target} served by {want:?}, seen {seen:?}"
    );
}

/// One attempt to `target` fails with ENETUNREACH: the address is not translated (no
/// frontend) and, as a ClusterIP, has no route in the node namespace.
fn untranslated(w: &World, target: &str) -> Result<(), String> {
    let o = &w.probe("tcp", target, 1)[0];
    if !o.ok && o.errno == Some(ENETUNREACH) {
        Ok(())
    } else {
        Err(format!("expected ENETUNREACH (not translated), saw {o:?}"))
    }
}

fn wait_untranslated(w: &World, vip: &str) {
    eventually(&format!("{vip} no longer translated"), WAIT, || {
        untranslated(w, &addr(vip))?;
        if has_frontend(w, vip) {
            return Err(format!("ferry list still has a frontend for {vip}"));
        }
        Ok(())
    });
}

/// Whether `ferry list` has a frontend on `vip`.
fn has_frontend(w: &World, vip: &str) -> bool {
    frontends_of(w, vip).next().is_some()
}

fn frontends_of(w: &World, vip: &str) -> std::vec::IntoIter<Value> {
    let prefix = format!("{vip}:");
    let all = w.list_json()["frontends"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    all.into_iter()
        .filter(|f| {
            f["frontend"]
                .as_str()
                .is_some_and(|s| s.starts_with(&prefix))
        })
        .collect::<Vec<_>>()
        .into_iter()
}

/// (frontend, service id, [(backend id, address)]) of every frontend on `vip`.
type Ids = Vec<(String, u64, Vec<(u64, String)>)>;

fn ids_of(w: &World, vip: &str) -> Ids {
    let mut out: Ids = frontends_of(w, vip)
        .map(|f| {
            let backends = f["backends"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| {
                    (
                        b["id"].as_u64().unwrap(),
                        b["address"].as_str().unwrap().to_string(),
                    )
                })
                .collect();
            (
                f["frontend"].as_str().unwrap().to_string(),
                f["service_id"].as_u64().unwrap(),
                backends,
            )
        })
        .collect();
    out.sort();
    out
}

/// The backend addresses (sorted) of the frontend `vip:80`.
fn listed_backends(w: &World, vip: &str) -> Vec<String> {
    let mut b: Vec<String> = frontends_of(w, vip)
        .filter(|f| f["frontend"].as_str() == Some(addr(vip).as_str()))
        .flat_map(|f| f["backends"].as_array().cloned().unwrap_or_default())
        .map(|b| b["address"].as_str().unwrap().to_string())
        .collect();
    b.sort();
    b
}

fn healthz(w: &World, path: &str) -> (u16, Value) {
    let (code, body) =
        http_get(&w.node_ns, 10256, path).unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let v = serde_json::from_str(&body)
        .unwrap_or_else(|e| panic!("{path} body is not JSON ({e}): {body:?}"));
    (code, v)
}

/// The value of the sample whose line starts with `series` and a space.
fn sample(m: &str, series: &str) -> f64 {
    m.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {series} in /metrics:\n{m}"))
        .trim()
        .parse()
        .expect("sample value")
}

const SYNCS: &str = "kubeproxy_sync_proxy_rules_duration_seconds_count";
const ENDPOINT_CHANGES: &str = "kubeproxy_sync_proxy_rules_endpoint_changes_total";

/// The `writes=N` of every "synced" line of the agent log.
fn synced_writes(w: &World) -> Vec<u64> {
    w.agent_log()
        .lines()
        .filter(|l| l.contains(" synced "))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|f| f.strip_prefix("writes="))
                .and_then(|n| n.parse().ok())
        })
        .collect()
}

/// Traffic to one address on a thread, until stopped: proves nothing was interrupted.
struct Traffic {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Vec<(Duration, Outcome)>>>,
    started: Instant,
    target: String,
}

impl Traffic {
    fn start(w: &World, target: &str) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let prober = w.prober();
        let (s, t) = (stop.clone(), target.to_string());
        let started = Instant::now();
        let handle = std::thread::spawn(move || {
            let mut seen = Vec::new();
            while !s.load(Ordering::Relaxed) {
                for o in prober.probe("tcp", &t, 5) {
                    seen.push((started.elapsed(), o));
                }
            }
            seen
        });
        Traffic {
            stop,
            handle: Some(handle),
            started,
            target: target.to_string(),
        }
    }

    /// Stops; asserts every attempt was answered by one of `allowed`; returns how many.
    fn stop_and_check(mut self, allowed: &[&str]) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        let seen = self.handle.take().unwrap().join().expect("traffic thread");
        let allowed = set(allowed);
        let bad: Vec<&(Duration, Outcome)> = seen
            .iter()
            .filter(|(_, o)| !o.ok || !o.backend().is_some_and(|b| allowed.contains(b)))
            .collect();
        assert!(
            bad.is_empty(),
            "traffic to {} was interrupted: {} of {} attempts over {:?} failed or reached something else than {allowed:?}; first: {:?}",
            self.target,
            bad.len(),
            seen.len(),
            self.started.elapsed(),
            &bad[..bad.len().min(5)]
        );
        assert!(!seen.is_empty(), "no traffic was sent to {}", self.target);
        seen.len()
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// For `d`: /healthz answers 200 (polled), `gone_vip` still answers, and `web` is still
/// served by all three pods: the kernel keeps the last programmed state.
fn hold_state(c: &Cluster, d: Duration, gone_vip: &str, when: &str) {
    let until = Instant::now() + d;
    let mut checks = 0;
    while Instant::now() < until {
        let (code, body) = healthz(&c.w, "/healthz");
        assert_eq!(
            code, 200,
            "{when}: /healthz must stay 200 (nothing is queued), saw {code} {body}"
        );
        checks += 1;
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(checks > 1);
    answered(&c.w, &addr(gone_vip), 3)
        .unwrap_or_else(|e| panic!("{when}: the programmed Service must keep answering: {e}"));
    assert_backends(&c.w, &addr(WEB_VIP), &["pod1", "pod2", "pod3"], when);
}

/// web (all three pods) and gone (pod1), both programmed.
fn outage_world(test: &str) -> Cluster {
    let mut c = Cluster::new(test, 3, &[8080]);
    let all = c.ips(&["pod1", "pod2", "pod3"]);
    c.api.apply(node("zone-a", json!({}), json!({})));
    c.api.apply(service("web", WEB_VIP, json!({})));
    c.api.apply(slice("web", "web-1", ready(&all)));
    c.api.apply(service("gone", GONE_VIP, json!({})));
    c.api
        .apply(slice("gone", "gone-1", ready(&c.ips(&["pod1"]))));
    c.start();
    wait_backends(&c.w, &addr(WEB_VIP), &["pod1", "pod2", "pod3"]);
    wait_backends(&c.w, &addr(GONE_VIP), &["pod1"]);
    c
}

/// The changes the outage tests make behind the agent's back: `gone` deleted and web's
/// slice losing pod3.
fn change_behind_the_agent(c: &Cluster) {
    assert!(c.api.delete(Kind::Service, "default", "gone"));
    c.api
        .apply(slice("web", "web-1", ready(&c.ips(&["pod1", "pod2"]))));
}

/// Waits until the changes of [`change_behind_the_agent`] are in the kernel; returns how
/// long that took.
fn converged(c: &Cluster, since: Instant) -> Duration {
    wait_untranslated(&c.w, GONE_VIP);
    wait_backends(&c.w, &addr(WEB_VIP), &["pod1", "pod2"]);
    since.elapsed()
}

// ---------------------------------------------------------------------------------------
// Tests

/// Services and EndpointSlices from the API are programmed and followed live; a Service
/// another proxy owns is never translated.
#[test]
fn services_from_the_api_are_programmed_and_followed() {
    let mut c = Cluster::new("kube-prog", 3, &[8080]);
    let all = c.ips(&["pod1", "pod2", "pod3"]);
    c.api.apply(node("zone-a", json!({}), json!({})));
    c.api.apply(service("web", WEB_VIP, json!({})));
    c.api.apply(slice("web", "web-1", ready(&all)));
    c.api.apply(service(
        "other",
        OTHER_VIP,
        json!({PROXY_NAME_LABEL: "other-proxy"}),
    ));
    c.api.apply(slice("other", "other-1", ready(&all)));
    c.start();

    wait_backends(&c.w, &addr(WEB_VIP), &["pod1", "pod2", "pod3"]);
    untranslated(&c.w, &addr(OTHER_VIP))
        .unwrap_or_else(|e| panic!("a Service with {PROXY_NAME_LABEL} must not be proxied: {e}"));
    assert!(
        !has_frontend(&c.w, OTHER_VIP),
        "ferry list has a frontend for {OTHER_VIP} (service-proxy-name)"
    );

    // A slice change applies live.
    c.api
        .apply(slice("web", "web-1", ready(&c.ips(&["pod1", "pod2"]))));
    wait_backends(&c.w, &addr(WEB_VIP), &["pod1", "pod2"]);

    // A new Service applies live; when it starts carrying the label it is unprogrammed.
    c.api.apply(service("api", API_VIP, json!({})));
    c.api.apply(slice("api", "api-1", ready(&c.ips(&["pod3"]))));
    wait_backends(&c.w, &addr(API_VIP), &["pod3"]);
    c.api.apply(service(
        "api",
        API_VIP,
        json!({PROXY_NAME_LABEL: "other-proxy"}),
    ));
    wait_untranslated(&c.w, API_VIP);

    // A deleted Service stops answering; the others are untouched.
    assert!(c.api.delete(Kind::Service, "default", "web"));
    wait_untranslated(&c.w, WEB_VIP);
    untranslated(&c.w, &addr(OTHER_VIP)).unwrap();
    let (code, body) = healthz(&c.w, "/healthz");
    assert_eq!(code, 200, "/healthz after the changes: {body}");
}

/// Bootstrap: the agent talks to the API server at the kubeconfig's address as given
/// (127.0.0.1 of the node), becomes ready with no ClusterIP at all, and the `kubernetes`
/// Service (ClusterIP -> the API server's real address) then works through ferry.
#[test]
fn bootstrap_uses_the_kubeconfig_address_and_serves_the_kubernetes_service() {
    let mut c = Cluster::new("kube-boot", 1, &[8080]);
    let port = c.api.addr().port();
    let t = Instant::now();
    c.start();
    eprintln!("bootstrap: ready after {:?} with an empty API", t.elapsed());
    let fe = c.w.list_json()["frontends"].clone();
    assert_eq!(
        fe,
        json!([]),
        "no Service exists: nothing may be programmed, saw {fe}"
    );
    let log = c.w.agent_log();
    let want = format!("server=http://127.0.0.1:{port}/");
    assert!(
        log.contains(&want),
        "the agent must use the kubeconfig's address as given ({want}); log:\n{log}"
    );
    assert!(
        c.api.list_count(Kind::Service) >= 1,
        "the agent never listed Services"
    );

    // The kubernetes Service: ClusterIP 10.96.0.1:443 -> the API server's real address.
    c.api.apply(service_ports(
        "kubernetes",
        KUBERNETES_VIP,
        json!({}),
        &[("https", 443, port)],
        json!({}),
    ));
    c.api.apply(slice_ports(
        "kubernetes",
        "kubernetes",
        &[("https", port)],
        vec![endpoint(&NODE_V4.to_string())],
    ));
    let url = format!("http://{KUBERNETES_VIP}:443/version");
    let body = eventually("the kubernetes Service answers through ferry", WAIT, || {
        let out = c.w.client(
            "curl",
            &[
                "-sS",
                "--max-time",
                "2",
                "-w",
                "\n%{remote_ip}:%{remote_port}",
                &url,
            ],
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() && text.contains("gitVersion") {
            Ok(text)
        } else {
            Err(format!(
                "curl {url}: {} {text} {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    });
    assert!(
        body.trim_end().ends_with(&format!("{KUBERNETES_VIP}:443")),
        "the client must see the Service address as its peer: {body}"
    );
    // The agent's own connection is unaffected: still healthy, still at 127.0.0.1.
    let (code, h) = healthz(&c.w, "/healthz");
    assert_eq!(code, 200, "{h}");
}

/// The API server goes away: the kernel keeps the last state, traffic flows, /healthz
/// stays 200. Changes made meanwhile converge once it is back.
#[test]
fn an_unavailable_api_server_keeps_traffic_and_converges_when_back() {
    let c = outage_world("kube-outage");
    let traffic = Traffic::start(&c.w, &addr(WEB_VIP));

    c.api.set_unavailable(true);
    eventually("the agent notices the outage", WAIT, || {
        if c.w.agent_log().contains("source lost its connection") {
            Ok(())
        } else {
            Err("no \"source lost its connection\" in the agent log".to_string())
        }
    });
    // The fake's store is writable while it refuses every request.
    change_behind_the_agent(&c);
    hold_state(
        &c,
        Duration::from_secs(3),
        GONE_VIP,
        "while the API server is unavailable",
    );

    c.api.set_unavailable(false);
    let back = Instant::now();
    let took = converged(&c, back);
    eprintln!("outage: converged {took:?} after the API server came back");
    let n = traffic.stop_and_check(&["pod1", "pod2", "pod3"]);
    eprintln!("outage: {n} connections, none failed");
    let (code, body) = healthz(&c.w, "/healthz");
    assert_eq!(code, 200, "{body}");
    // The recovery is reported once every watcher works again (a quiet one through a
    // probe list, every 5 s).
    eventually("the recovery is logged", WAIT, || {
        if c.w.agent_log().contains("source connected") {
            Ok(())
        } else {
            Err("no \"source connected\" in the agent log".to_string())
        }
    });
    eprintln!(
        "outage: recovery logged {:?} after the API server came back",
        back.elapsed()
    );
}

/// 410 Gone: the history is compacted while the watches missed changes; the agent
/// relists and converges, and traffic is never interrupted.
#[test]
fn an_expired_watch_relists_and_converges() {
    let c = outage_world("kube-gone");
    let traffic = Traffic::start(&c.w, &addr(WEB_VIP));
    let lists = (
        c.api.list_count(Kind::Service),
        c.api.list_count(Kind::EndpointSlice),
    );

    c.api.stall_watches(true);
    change_behind_the_agent(&c);
    c.api.compact();
    c.api.drop_watches();
    c.api.stall_watches(false);
    let t = Instant::now();
    let took = converged(&c, t);
    eprintln!("410 Gone: converged in {took:?}");
    let now = (
        c.api.list_count(Kind::Service),
        c.api.list_count(Kind::EndpointSlice),
    );
    assert!(
        now.0 > lists.0 && now.1 > lists.1,
        "the agent must relist Services and EndpointSlices after 410: lists before {lists:?}, after {now:?}"
    );
    let n = traffic.stop_and_check(&["pod1", "pod2", "pod3"]);
    eprintln!("410 Gone: {n} connections, none failed");
    let (code, body) = healthz(&c.w, "/healthz");
    assert_eq!(code, 200, "{body}");
}

/// Relists that take 3 s each: traffic keeps flowing and /healthz stays 200 meanwhile.
#[test]
fn slow_relists_keep_traffic_flowing() {
    let c = outage_world("kube-slow");
    let traffic = Traffic::start(&c.w, &addr(WEB_VIP));
    let lists = c.api.list_count(Kind::Service);

    c.api.set_list_delay(Duration::from_secs(3));
    c.api.stall_watches(true);
    change_behind_the_agent(&c);
    c.api.compact();
    c.api.drop_watches();
    c.api.stall_watches(false);
    let t = Instant::now();
    eventually("a relist started", WAIT, || {
        if c.api.list_count(Kind::Service) > lists {
            Ok(())
        } else {
            Err("no new Service list".into())
        }
    });
    // While the relist is slow, the old state serves.
    hold_state(
        &c,
        Duration::from_millis(1500),
        GONE_VIP,
        "during a slow relist",
    );
    let took = converged(&c, t);
    eprintln!("slow lists (3 s each): converged in {took:?}");
    assert!(
        took >= Duration::from_secs(3),
        "converged in {took:?}, before the 3 s list could have answered"
    );
    c.api.set_list_delay(Duration::ZERO);
    let n = traffic.stop_and_check(&["pod1", "pod2", "pod3"]);
    eprintln!("slow lists: {n} connections, none failed");
}

/// Watch streams that stay open but deliver nothing: the state stays, and what piled up
/// applies once they move again.
#[test]
fn stalled_watches_keep_state_and_catch_up() {
    let c = outage_world("kube-stall");
    let traffic = Traffic::start(&c.w, &addr(WEB_VIP));
    let lists = c.api.list_count(Kind::Service);

    c.api.stall_watches(true);
    change_behind_the_agent(&c);
    hold_state(
        &c,
        Duration::from_secs(3),
        GONE_VIP,
        "while the watches are stalled",
    );
    c.api.stall_watches(false);
    let t = Instant::now();
    let took = converged(&c, t);
    eprintln!("stalled watches: converged {took:?} after they moved again");
    assert_eq!(
        c.api.list_count(Kind::Service),
        lists,
        "a stalled watch that resumes needs no relist"
    );
    traffic.stop_and_check(&["pod1", "pod2", "pod3"]);
}

/// /healthz has kube-proxy's body, and answers 503 (nodeEligible false) while the Node
/// is tainted ToBeDeletedByClusterAutoscaler or being deleted; /livez stays 200.
#[test]
fn healthz_follows_node_eligibility() {
    let mut c = Cluster::new("kube-health", 1, &[8080]);
    c.api.apply(node("zone-a", json!({}), json!({})));
    c.api.apply(service("web", WEB_VIP, json!({})));
    c.api.apply(slice("web", "web-1", ready(&c.ips(&["pod1"]))));
    c.start();
    wait_backends(&c.w, &addr(WEB_VIP), &["pod1"]);

    let (code, body) = healthz(&c.w, "/healthz");
    assert_eq!(code, 200, "{body}");
    for field in ["lastUpdated", "currentTime"] {
        let v = body[field].as_str().unwrap_or_default();
        assert!(
            v.len() == 20 && v.ends_with('Z'),
            "/healthz {field} must be an RFC 3339 time, saw {body}"
        );
    }
    assert_eq!(body["nodeEligible"], json!(true), "{body}");

    let expect = |want_healthz: u16, eligible: bool, what: &str| {
        eventually(what, WAIT, || {
            let (code, body) = healthz(&c.w, "/healthz");
            if code != want_healthz || body["nodeEligible"] != json!(eligible) {
                return Err(format!(
                    "expected /healthz {want_healthz} nodeEligible {eligible}, saw {code} {body}"
                ));
            }
            let (live, lbody) = healthz(&c.w, "/livez");
            if live != 200 {
                return Err(format!("/livez must stay 200, saw {live} {lbody}"));
            }
            Ok(())
        });
    };

    let taint = json!({"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "value": "1700000000", "effect": "NoSchedule"}]});
    c.api.apply(node("zone-a", json!({}), taint));
    expect(
        503,
        false,
        "a node tainted ToBeDeletedByClusterAutoscaler is not eligible",
    );
    // A draining node still proxies its own clients.
    answered(&c.w, &addr(WEB_VIP), 3).unwrap();

    c.api.apply(node("zone-a", json!({}), json!({})));
    expect(200, true, "the taint removed: eligible again");

    c.api.apply(node(
        "zone-a",
        json!({"deletionTimestamp": "2025-01-01T00:00:00Z", "finalizers": ["example.com/hold"]}),
        json!({}),
    ));
    expect(503, false, "a node being deleted is not eligible");
}

/// Topology hints from the Node's zone label: all endpoints hinted and one for this zone
/// -> only the hinted one; one hint missing -> every endpoint (all or nothing); the zone
/// label followed live.
#[test]
fn topology_hints_follow_the_node_zone() {
    let mut c = Cluster::new("kube-topo", 3, &[8080]);
    let [p1, p2, p3] = [c.pod_ip("pod1"), c.pod_ip("pod2"), c.pod_ip("pod3")];
    let hinted = |p3_hint: Option<&str>| {
        slice(
            "web",
            "web-1",
            vec![
                zoned_endpoint(&p1, "zone-a", Some("zone-a")),
                zoned_endpoint(&p2, "zone-b", Some("zone-b")),
                zoned_endpoint(&p3, "zone-b", p3_hint),
            ],
        )
    };
    c.api.apply(node("zone-a", json!({}), json!({})));
    c.api.apply(service_ports(
        "web",
        WEB_VIP,
        json!({}),
        &[("http", 80, 8080)],
        json!({"trafficDistribution": "PreferClose"}),
    ));
    c.api.apply(hinted(Some("zone-b")));
    c.start();

    wait_backends(&c.w, &addr(WEB_VIP), &["pod1"]);
    assert_backends(
        &c.w,
        &addr(WEB_VIP),
        &["pod1"],
        "every endpoint hinted, pod1 for zone-a",
    );

    c.api.apply(hinted(None));
    wait_backends(&c.w, &addr(WEB_VIP), &["pod1", "pod2", "pod3"]);

    // Hints back, and the node moves to zone-b: its hinted endpoints, live.
    c.api.apply(hinted(Some("zone-b")));
    wait_backends(&c.w, &addr(WEB_VIP), &["pod1"]);
    c.api.apply(node("zone-b", json!({}), json!({})));
    wait_backends(&c.w, &addr(WEB_VIP), &["pod2", "pod3"]);
}

/// A burst of 200 changes to one slice becomes a few syncs, ending in the final state.
#[test]
fn a_burst_of_changes_is_coalesced() {
    let mut c = Cluster::new("kube-burst", 3, &[8080]);
    let subsets = [
        c.ips(&["pod1", "pod2"]),
        c.ips(&["pod2", "pod3"]),
        c.ips(&["pod1", "pod3"]),
    ];
    c.api.apply(node("zone-a", json!({}), json!({})));
    c.api.apply(service("web", WEB_VIP, json!({})));
    c.api.apply(slice(
        "web",
        "web-1",
        ready(&c.ips(&["pod1", "pod2", "pod3"])),
    ));
    c.start();
    wait_backends(&c.w, &addr(WEB_VIP), &["pod1", "pod2", "pod3"]);
    let before = c.w.metrics();
    let (syncs0, changes0) = (sample(&before, SYNCS), sample(&before, ENDPOINT_CHANGES));

    const BURST: usize = 200;
    let t = Instant::now();
    for i in 0..BURST {
        c.api.apply(slice("web", "web-1", ready(&subsets[i % 3])));
    }
    let applied = t.elapsed();
    // The last change: subsets[199 % 3] = pod2, pod3.
    let mut want = subsets[(BURST - 1) % 3]
        .iter()
        .map(|ip| format!("{ip}:8080"))
        .collect::<Vec<_>>();
    want.sort();
    eventually("the burst's final state is programmed", WAIT, || {
        let seen = listed_backends(&c.w, WEB_VIP);
        if seen == want {
            Ok(())
        } else {
            Err(format!(
                "expected backends {want:?}, ferry list shows {seen:?}"
            ))
        }
    });
    let took = t.elapsed();
    wait_backends(&c.w, &addr(WEB_VIP), &["pod2", "pod3"]);
    // Let the counters settle (the last events may still be syncing): the count is stable.
    let after = eventually("the sync counter settles", WAIT, || {
        let a = c.w.metrics();
        std::thread::sleep(Duration::from_millis(300));
        let b = c.w.metrics();
        if sample(&a, SYNCS) == sample(&b, SYNCS) {
            Ok(b)
        } else {
            Err("still syncing".into())
        }
    });
    let syncs = sample(&after, SYNCS) - syncs0;
    let changes = sample(&after, ENDPOINT_CHANGES) - changes0;
    eprintln!(
        "burst: {BURST} slice changes applied in {applied:?}, programmed after {took:?}: {changes} endpoint change events, {syncs} syncs"
    );
    assert!(
        changes >= 1.0,
        "the agent saw no endpoint change ({changes})"
    );
    assert!(
        syncs < (BURST / 4) as f64,
        "a burst of {BURST} changes must coalesce into far fewer syncs: saw {syncs} syncs for {changes} change events"
    );
}

/// A change to Service A never rewrites Service B: B's service and backend ids are the
/// same, and the sync writes only what A's one-endpoint change needs.
#[test]
fn a_change_to_one_service_leaves_the_others_alone() {
    let mut c = Cluster::new("kube-isolation", 3, &[8080, 9090]);
    let all = c.ips(&["pod1", "pod2", "pod3"]);
    c.api.apply(node("zone-a", json!({}), json!({})));
    c.api.apply(service("web", WEB_VIP, json!({})));
    c.api
        .apply(slice("web", "web-1", ready(&c.ips(&["pod1", "pod2"]))));
    c.api.apply(service_ports(
        "api",
        API_VIP,
        json!({}),
        &[("http", 80, 8080), ("grpc", 81, 9090)],
        json!({}),
    ));
    c.api.apply(slice_ports(
        "api",
        "api-1",
        &[("http", 8080), ("grpc", 9090)],
        ready(&all),
    ));
    c.start();
    wait_backends(&c.w, &addr(WEB_VIP), &["pod1", "pod2"]);
    wait_backends(&c.w, &addr(API_VIP), &["pod1", "pod2", "pod3"]);
    let b_before = ids_of(&c.w, API_VIP);
    assert_eq!(b_before.len(), 2, "api has two frontends: {b_before:?}");

    for (step, (pods, want)) in [
        (&["pod1", "pod2", "pod3"][..], &["pod1", "pod2", "pod3"][..]),
        (&["pod2", "pod3"][..], &["pod2", "pod3"][..]),
    ]
    .into_iter()
    .enumerate()
    {
        let logged = synced_writes(&c.w).len();
        c.api.apply(slice("web", "web-1", ready(&c.ips(pods))));
        wait_backends(&c.w, &addr(WEB_VIP), want);
        // The line is logged right after the writes that the traffic already saw.
        let writes: Vec<u64> = eventually("the sync is logged", WAIT, || {
            let all = synced_writes(&c.w);
            if all.len() > logged {
                Ok(all[logged..].to_vec())
            } else {
                Err("no new \"synced\" line".into())
            }
        });
        eprintln!(
            "isolation step {step}: \"synced\" lines after a one-endpoint change of web: writes={writes:?}"
        );
        assert_eq!(
            writes.len(),
            1,
            "one change, one sync with writes; saw {writes:?}"
        );
        assert!(
            writes[0] <= 6,
            "a one-endpoint change of web (1 frontend) must write a handful of entries, not rewrite api (2 frontends x 3 backends): writes={}",
            writes[0]
        );
        let b_now = ids_of(&c.w, API_VIP);
        assert_eq!(
            b_now, b_before,
            "api's service and backend ids must not change when web changes"
        );
    }
    wait_backends(&c.w, &addr(API_VIP), &["pod1", "pod2", "pod3"]);
    wait_backends(&c.w, &format!("{API_VIP}:81"), &["pod1", "pod2", "pod3"]);
}

/// `service` with what k8s-openapi's typed model rejects outside the fields ferry reads:
/// `status.conditions[].lastTransitionTime: null` (upstream's "service status
/// lifecycle" e2e creates one), a null port error in the load balancer status, nulls in
/// lists, fields no version knows yet. `message` makes each version differ.
fn odd_service(name: &str, vip: &str, message: &str) -> Value {
    let mut s = service(name, vip, json!({}));
    s["spec"]["ipFamilies"] = json!([null]);
    s["spec"]["futureField"] = json!({"x": null});
    s["status"] = json!({
        "conditions": [{"type": "StatusUpdate", "status": "True", "reason": "E2E",
                        "message": message, "lastTransitionTime": null}],
        "loadBalancer": {"ingress": [{"ip": "203.0.113.7",
            "ports": [{"port": 80, "protocol": "TCP", "error": null}]}]},
    });
    s
}

/// A Service ferry cannot read at all: `spec.ports` is not a list.
fn broken_service(name: &str, vip: &str, ports: &str) -> Value {
    let mut s = service(name, vip, json!({}));
    s["spec"]["ports"] = ports.into();
    s
}

/// Whether the odd Service has been changed since it was created.
fn churn_started(api: &FakeApi) -> bool {
    api.get(Kind::Service, "default", "odd")
        .is_some_and(|s| s["status"]["conditions"][0]["message"] != "0")
}

/// Waits until `ferry_source_errors` is `want`.
fn wait_source_errors(w: &World, want: f64) {
    eventually(&format!("ferry_source_errors {want}"), WAIT, || {
        let seen = sample(&w.metrics(), "ferry_source_errors");
        if seen == want {
            Ok(())
        } else {
            Err(format!("ferry_source_errors is {seen}"))
        }
    });
}

/// With an odd Service (the typed model rejects fields ferry never reads) and an
/// unreadable one both being modified over and over, traffic to the others never stops,
/// a change to another Service is applied at once, nothing is relisted, and the
/// unreadable one is reported by name and counted in `ferry_source_errors`.
#[test]
fn odd_services_never_interrupt_the_watch() {
    const ODD_VIP: &str = "10.96.0.13";
    const BROKEN_VIP: &str = "10.96.0.14";
    let mut c = Cluster::new("kube-odd", 3, &[8080]);
    let all = c.ips(&["pod1", "pod2", "pod3"]);
    c.api.apply(node("zone-a", json!({}), json!({})));
    c.api.apply(service("web", WEB_VIP, json!({})));
    c.api.apply(slice("web", "web-1", ready(&all)));
    c.api.apply(odd_service("odd", ODD_VIP, "0"));
    c.api.apply(slice("odd", "odd-1", ready(&c.ips(&["pod1"]))));
    c.api.apply(broken_service("broken", BROKEN_VIP, "80"));
    c.api.apply(slice("broken", "broken-1", ready(&all)));
    c.start();
    wait_backends(&c.w, &addr(WEB_VIP), &["pod1", "pod2", "pod3"]);
    wait_backends(&c.w, &addr(ODD_VIP), &["pod1"]);
    assert!(
        !has_frontend(&c.w, BROKEN_VIP),
        "the unreadable Service is skipped"
    );
    let lists = Kind::ALL.map(|k| c.api.list_count(k));
    let watches_failed = |c: &Cluster| c.w.agent_log().matches("watch failed").count();
    let failed_before = watches_failed(&c);

    let traffic = Traffic::start(&c.w, &addr(WEB_VIP));
    // Both are modified over and over (as a status controller would) while other
    // changes are made and checked.
    let stop = AtomicBool::new(false);
    let changes = AtomicU32::new(0);
    let (applied, churned) = std::thread::scope(|scope| {
        let churn = scope.spawn(|| {
            let mut i = 0u32;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                changes.store(i, Ordering::Relaxed);
                c.api.apply(odd_service("odd", ODD_VIP, &i.to_string()));
                c.api
                    .apply(broken_service("broken", BROKEN_VIP, &format!("80-{i}")));
                std::thread::sleep(Duration::from_millis(10));
            }
            i
        });
        // Let the churn get going before the change that must get through it.
        eventually("the churn started", WAIT, || {
            churn_started(&c.api)
                .then_some(())
                .ok_or_else(|| "no odd Service change yet".to_string())
        });
        let since = Instant::now();
        c.api.apply(service("api", API_VIP, json!({})));
        c.api.apply(slice("api", "api-1", ready(&c.ips(&["pod3"]))));
        wait_backends(&c.w, &addr(API_VIP), &["pod3"]);
        c.api
            .apply(slice("odd", "odd-1", ready(&c.ips(&["pod1", "pod2"]))));
        wait_backends(&c.w, &addr(ODD_VIP), &["pod1", "pod2"]);
        let applied = since.elapsed();
        // Web keeps its backends through a longer churn too.
        eventually("100 changes of each", WAIT, || {
            assert_backends(
                &c.w,
                &addr(WEB_VIP),
                &["pod1", "pod2", "pod3"],
                "during the churn",
            );
            let n = changes.load(Ordering::Relaxed);
            if n >= 100 {
                Ok(())
            } else {
                Err(format!("{n} changes so far"))
            }
        });
        stop.store(true, Ordering::Relaxed);
        (applied, churn.join().expect("churn thread"))
    });
    let attempts = traffic.stop_and_check(&["pod1", "pod2", "pod3"]);
    eprintln!(
        "odd Services: {churned} changes of each; other changes applied in {applied:?}; {attempts} attempts to web all answered"
    );

    assert_eq!(
        Kind::ALL.map(|k| c.api.list_count(k)),
        lists,
        "watched on, not relisted"
    );
    assert_eq!(
        watches_failed(&c),
        failed_before,
        "no watch failed:\n{}",
        c.w.agent_log()
    );
    let log = c.w.agent_log();
    assert!(
        log.lines().any(|l| l.contains("cannot read the object")
            && l.contains("default/broken")
            && l.contains("spec.ports")),
        "the unreadable Service is reported by name and field:\n{log}"
    );
    wait_source_errors(&c.w, 1.0);
    // Fixed, it is programmed like any other.
    c.api.apply(service("broken", BROKEN_VIP, json!({})));
    wait_backends(&c.w, &addr(BROKEN_VIP), &["pod1", "pod2", "pod3"]);
    wait_source_errors(&c.w, 0.0);
}
