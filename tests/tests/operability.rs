//! Operability with the real agent: `/metrics` (kube-proxy's names plus ferry's per-map
//! fill and per-Service connection counts), network programming latency from the
//! EndpointSlice trigger time, and `ferry explain` on live pins.

use std::{
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use ferry_tests::*;

const WEB: &str = "10.96.0.10";
const EMPTY: &str = "10.96.0.11";
const OTHER: &str = "10.96.0.12";
const STICKY: &str = "10.96.0.13";
const LOCAL_ONLY: &str = "10.96.0.14";

/// web (pod1 on node1, pod2 on node2), empty (no endpoints), other (pod2), sticky
/// (ClientIP affinity, pod1), localonly (internalTrafficPolicy Local, pod2 on node2:
/// no endpoint on this node, node1).
fn world(test: &str) -> World {
    let mut w = World::new(test, 2, &[8080]);
    let (p1, p2) = (w.pod("pod1").v4, w.pod("pod2").v4);
    let http = [("http", 80, "TCP")];
    let target = [("http", 8080, "TCP")];
    w.write_manifest(
        "services.yaml",
        &docs(&[
            service("web", &[WEB], &http, ""),
            slice("web", "web-1", "IPv4", &target, &[ep(p1).on("node1"), ep(p2).on("node2")]),
            service("empty", &[EMPTY], &http, ""),
            slice("empty", "empty-1", "IPv4", &target, &[]),
            service("other", &[OTHER], &http, ""),
            slice("other", "other-1", "IPv4", &target, &[ep(p2).on("node2")]),
            service(
                "sticky",
                &[STICKY],
                &http,
                "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}\n",
            ),
            slice("sticky", "sticky-1", "IPv4", &target, &[ep(p1).on("node1")]),
            service("localonly", &[LOCAL_ONLY], &http, "  internalTrafficPolicy: Local\n"),
            slice("localonly", "localonly-1", "IPv4", &target, &[ep(p2).on("node2")]),
        ]),
    );
    w.start_agent(&[]);
    w
}

/// The value of the sample whose line starts with `series` (name and labels) and a space.
fn sample(m: &str, series: &str) -> Option<f64> {
    m.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .map(|v| v.trim().parse::<f64>().expect("sample value"))
    })
}

/// Waits until `/metrics` has `series` equal to `want`.
fn wait_sample(w: &World, series: &str, want: f64) -> String {
    eventually(
        &format!("{series} == {want}"),
        Duration::from_secs(15),
        || {
            let m = w.metrics();
            match sample(&m, series) {
                Some(v) if v == want => Ok(m),
                other => Err(format!("saw {other:?} in:\n{m}")),
            }
        },
    )
}

fn connections(svc: &str) -> String {
    format!("ferry_service_connections_total{{service=\"default/{svc}:http/TCP/IPv4\"}}")
}

#[test]
fn metrics_count_connections_rejects_and_map_fill() {
    let w = world("opsmetrics");
    // The kernel accepts the objects' BTF (and with it the programs' line info for
    // bpftool and verifier messages); aya warns when it does not and loads without it.
    let log = w.agent_log();
    assert!(!log.contains("BTF couldn't be loaded"), "{log}");
    let web = w.probe("tcp", &format!("{WEB}:80"), 7);
    assert!(
        web.iter().all(|o| o.ok),
        "every connect to web must succeed: {web:?}"
    );
    let other = w.probe("tcp", &format!("{OTHER}:80"), 3);
    assert!(other.iter().all(|o| o.ok), "{other:?}");
    let sticky = w.probe("tcp", &format!("{STICKY}:80"), 2);
    assert!(sticky.iter().all(|o| o.ok), "{sticky:?}");
    let refused = w.probe("tcp", &format!("{EMPTY}:80"), 4);
    assert!(
        refused.iter().all(|o| o.errno == Some(ECONNREFUSED)),
        "the endpoint-less Service must refuse: {refused:?}"
    );

    wait_sample(&w, &connections("web"), 7.0);
    wait_sample(&w, &connections("other"), 3.0);
    wait_sample(&w, &connections("sticky"), 2.0);
    let m = wait_sample(
        &w,
        "ferry_datapath_events_total{reason=\"rejected_no_endpoints\"}",
        4.0,
    );
    assert_eq!(
        sample(&m, "ferry_datapath_events_total{reason=\"translated\"}"),
        Some(12.0),
        "7 + 3 + 2 translated connects:\n{m}"
    );
    assert!(
        sample(&m, &connections("empty")).is_none(),
        "a refused Service translated nothing and has no count:\n{m}"
    );

    // Map fill: every hash map, with its capacity.
    let fill = |map: &str| {
        let entries = sample(&m, &format!("ferry_map_entries{{map=\"{map}\"}}"))
            .unwrap_or_else(|| panic!("no ferry_map_entries for {map}:\n{m}"));
        let cap = sample(&m, &format!("ferry_map_capacity{{map=\"{map}\"}}"))
            .unwrap_or_else(|| panic!("no ferry_map_capacity for {map}:\n{m}"));
        (entries, cap)
    };
    // 5 frontends; slots: web 2, other 1, sticky 1.
    // The planned maps start at the smallest capacity (docs/capacity.md).
    assert_eq!(fill("FERRY_SVC"), (9.0, 4096.0));
    assert_eq!(fill("FERRY_BACKENDS"), (2.0, 4096.0));
    assert_eq!(fill("FERRY_MEMBERS").0, 4.0, "web 2, other 1, sticky 1");
    assert_eq!(
        fill("FERRY_AFFINITY"),
        (1.0, 65536.0),
        "one client (the node) of sticky"
    );
    // TCP connects keep their reverse entry in a per-socket slot of FERRY_TCP_REVNAT (an
    // array, README), so the LRU, which is UDP's, holds none of these 12.
    assert_eq!(fill("FERRY_REVNAT"), (0.0, 262144.0), "TCP connects only");
    assert_eq!(
        fill("FERRY_SVC_CONNS").0,
        3.0,
        "web, other and sticky got traffic"
    );

    // kube-proxy's metrics, under its names.
    for family in [
        "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram",
        "# TYPE kubeproxy_network_programming_duration_seconds histogram",
        "# TYPE kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds gauge",
        "# TYPE kubeproxy_sync_proxy_rules_endpoint_changes_total counter",
        "# TYPE kubeproxy_sync_proxy_rules_service_changes_total counter",
        "# TYPE kubeproxy_proxy_livez_total counter",
    ] {
        assert!(m.lines().any(|l| l == family), "missing {family:?}:\n{m}");
    }
    let syncs = sample(&m, "kubeproxy_sync_proxy_rules_duration_seconds_count").unwrap_or(0.0);
    assert!(
        syncs >= 1.0,
        "at least the first sync is in the histogram:\n{m}"
    );
    assert_eq!(
        sample(
            &m,
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"+Inf\"}"
        ),
        Some(syncs),
        "+Inf bucket == count:\n{m}"
    );
    assert!(
        sample(&m, "kubeproxy_sync_proxy_rules_last_timestamp_seconds").unwrap_or(0.0) > 1.6e9,
        "{m}"
    );
    assert!(
        sample(&m, "kubeproxy_proxy_healthz_total{code=\"200\"}").unwrap_or(0.0) >= 1.0,
        "start_agent polled /healthz until 200:\n{m}"
    );
    assert_eq!(
        sample(
            &m,
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"}"
        ),
        Some(1.0),
        "localonly has endpoints, none on node1:\n{m}"
    );
    let (code, mode) = http_get(&w.node_ns, 10249, "/proxyMode").expect("GET /proxyMode");
    assert_eq!((code, mode.as_str()), (200, "ebpf"));
}

/// The per-Service counts are an array indexed by service id and ids are reused: a
/// Service created after another was deleted takes its id and must start from 0.
#[test]
fn a_reused_service_id_starts_counting_from_zero() {
    let mut w = World::new("opsreuse", 1, &[8080]);
    let p1 = w.pod("pod1").v4;
    let (old, new) = ("10.96.0.20", "10.96.0.21");
    let http = [("http", 80, "TCP")];
    let target = [("http", 8080, "TCP")];
    let one = |name: &str, vip: &str| {
        docs(&[
            service(name, &[vip], &http, ""),
            slice(name, &format!("{name}-1"), "IPv4", &target, &[ep(p1)]),
        ])
    };
    w.write_manifest("old.yaml", &one("old", old));
    w.start_agent(&[]);
    let outs = w.probe("tcp", &format!("{old}:80"), 5);
    assert!(outs.iter().all(|o| o.ok), "{outs:?}");
    wait_sample(&w, &connections("old"), 5.0);

    // Delete it and wait until its frontend is gone from the maps (its id released)...
    w.remove_manifest("old.yaml");
    eventually("old's frontend removed", Duration::from_secs(15), || {
        let list = w.list_json().to_string();
        if list.contains(old) {
            Err(list)
        } else {
            Ok(())
        }
    });
    // ...then a new Service, planned after that release, takes the freed id.
    w.write_manifest("new.yaml", &one("new", new));
    eventually("new Service programmed", Duration::from_secs(15), || {
        let list = w.list_json().to_string();
        if list.contains(new) {
            Ok(())
        } else {
            Err(list)
        }
    });
    let outs = w.probe("tcp", &format!("{new}:80"), 2);
    assert!(outs.iter().all(|o| o.ok), "{outs:?}");
    let m = wait_sample(&w, &connections("new"), 2.0);
    assert!(
        sample(&m, &connections("old")).is_none(),
        "a deleted Service has no count:\n{m}"
    );
}

#[test]
fn network_programming_latency_from_the_trigger_time() {
    let mut w = World::new("opsnpl", 2, &[8080]);
    let (p1, p2) = (w.pod("pod1").v4, w.pod("pod2").v4);
    let target = [("http", 8080, "TCP")];
    w.write_manifest(
        "web.yaml",
        &docs(&[
            service("web", &[WEB], &[("http", 80, "TCP")], ""),
            slice("web", "web-1", "IPv4", &target, &[ep(p1)]),
        ]),
    );
    w.start_agent(&[]);
    let count = "kubeproxy_network_programming_duration_seconds_count";
    let m = w.metrics();
    assert_eq!(sample(&m, count), Some(0.0), "no annotated slice yet:\n{m}");
    let changes_before = sample(&m, "kubeproxy_sync_proxy_rules_endpoint_changes_total").unwrap();

    // The endpoints controller's annotation, written the moment the slice changes.
    let trigger = k8s_openapi::jiff::Timestamp::now().to_string();
    let annotated = |eps: &[Ep]| {
        slice("web", "web-1", "IPv4", &target, eps).replacen(
            "  labels:\n",
            &format!(
                "  annotations:\n    endpoints.kubernetes.io/last-change-trigger-time: \"{trigger}\"\n  labels:\n"
            ),
            1,
        )
    };
    w.write_manifest(
        "web.yaml",
        &docs(&[
            service("web", &[WEB], &[("http", 80, "TCP")], ""),
            annotated(&[ep(p1), ep(p2)]),
        ]),
    );
    let m = wait_sample(&w, count, 1.0);
    let sum = sample(&m, "kubeproxy_network_programming_duration_seconds_sum").unwrap();
    assert!(
        (0.0..10.0).contains(&sum),
        "write to maps took {sum}s?\n{m}"
    );
    assert!(
        sample(&m, "kubeproxy_sync_proxy_rules_endpoint_changes_total").unwrap() > changes_before,
        "the slice change is counted:\n{m}"
    );

    // The same trigger value again (another change of the same slice): observed once.
    w.write_manifest(
        "web.yaml",
        &docs(&[
            service("web", &[WEB], &[("http", 80, "TCP")], ""),
            annotated(&[ep(p2)]),
        ]),
    );
    eventually("web has only pod2", Duration::from_secs(10), || {
        let outs = w.probe("tcp", &format!("{WEB}:80"), 6);
        if backends(&outs) == set(&["pod2"]) {
            Ok(())
        } else {
            Err(format!("{outs:?}"))
        }
    });
    let m = w.metrics();
    assert_eq!(
        sample(&m, count),
        Some(1.0),
        "one trigger value, one observation:\n{m}"
    );
}

/// A tc device without a global address (source NAT through it cannot work) is reported
/// when that starts and when it ends, not at every address poll (every 2 s).
#[test]
fn a_device_without_an_address_is_reported_once() {
    let mut w = World::new("opsnoaddr", 1, &[8080]);
    let ns = w.node_ns.clone();
    // A veth pair: this kernel has no dummy devices.
    sh(&format!(
        "ip -n {ns} link add fdummy0 type veth peer name fdummy1 && \
         ip -n {ns} link set fdummy0 up && ip -n {ns} link set fdummy1 up"
    ));
    w.start_agent(&["--devices", "fdummy0"]);
    const MISSING: &str = "no global address on this tc device";
    const BACK: &str = "has a global address again";
    let count = |what: &str| {
        w.agent_log()
            .lines()
            .filter(|l| l.contains(what) && l.contains("fdummy0"))
            .count()
    };
    let reached = |what: &str, n: usize| match count(what) {
        c if c >= n => Ok(()),
        c => Err(format!("{c} lines saying {what:?}")),
    };
    eventually(
        "the missing address is reported",
        Duration::from_secs(10),
        || reached(MISSING, 1),
    );
    // Nothing changes for more than two polls: nothing more is said.
    let window = Instant::now();
    while window.elapsed() < Duration::from_secs(5) {
        assert_eq!(
            count(MISSING),
            1,
            "reported again while nothing changed:\n{}",
            w.agent_log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    sh(&format!("ip -n {ns} addr add 198.51.100.7/24 dev fdummy0"));
    eventually(
        "the new address is noticed",
        Duration::from_secs(10),
        || reached(BACK, 1),
    );
    sh(&format!("ip -n {ns} addr del 198.51.100.7/24 dev fdummy0"));
    eventually(
        "the address is missed again",
        Duration::from_secs(10),
        || reached(MISSING, 2),
    );
    assert_eq!(count(MISSING), 2, "{}", w.agent_log());
    assert_eq!(count(BACK), 1, "{}", w.agent_log());
}

/// Runs `ferry ARGS` in the node namespace (where the affinity entry of the node's
/// clients lives).
fn ferry_in(w: &World, args: &[&str]) -> Output {
    let mut cmd = Command::new(bin("ferry"));
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    spawn_in(&w.node_ns, None, &mut cmd)
        .wait_with_output()
        .expect("ferry")
}

fn explain(w: &World, target: &str, extra: &[&str]) -> (Option<i32>, String) {
    let bpffs = w.bpffs.to_string_lossy().into_owned();
    let mut args = vec!["explain", target, "--bpffs", &bpffs];
    args.extend_from_slice(extra);
    let out = ferry_in(w, &args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.stderr.is_empty() || out.status.code() == Some(2),
        "ferry explain {target} wrote to stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), stdout)
}

#[test]
fn explain_frontends_from_live_maps() {
    let w = world("opsexplain");

    let (code, text) = explain(&w, &format!("{WEB}:80/TCP"), &[]);
    assert_eq!(code, Some(0), "a ClusterIP is a frontend:\n{text}");
    for want in [
        "10.96.0.10:80/TCP: ClusterIP frontend",
        "verdict:   translated",
        "one of 2 backends",
        "policy:    Cluster",
        "10.1.1.2:8080",
        "10.1.2.2:8080",
        "affinity:  none",
    ] {
        assert!(
            text.contains(want),
            "explain web must say {want:?}:\n{text}"
        );
    }
    let pod1_line = text.lines().find(|l| l.contains("10.1.1.2:8080")).unwrap();
    assert!(
        pod1_line.contains("local"),
        "pod1 runs on node1: {pod1_line}"
    );
    let (code, json) = explain(&w, &format!("{WEB}:80/tcp"), &["-o", "json"]);
    assert_eq!(code, Some(0));
    let v: serde_json::Value = serde_json::from_str(&json).expect("explain -o json");
    let addrs: Vec<&str> = v["frontends"][0]["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["address"].as_str().unwrap())
        .collect();
    assert_eq!(addrs, ["10.1.1.2:8080", "10.1.2.2:8080"], "{json}");

    let (code, text) = explain(&w, &format!("{EMPTY}:80/TCP"), &[]);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("verdict:   refused (ECONNREFUSED)") && text.contains("backends:  (none)"),
        "a Service without endpoints is refused:\n{text}"
    );

    let (code, text) = explain(&w, &format!("{LOCAL_ONLY}:80/TCP"), &[]);
    assert_eq!(code, Some(0), "{text}");
    for want in [
        "verdict:   dropped (EHOSTUNREACH)",
        "internalTrafficPolicy Local: local endpoints only",
        "no endpoint on this node",
    ] {
        assert!(
            text.contains(want),
            "iTP Local without a local endpoint must say {want:?}:\n{text}"
        );
    }

    let (code, text) = explain(&w, "10.96.0.99:80/TCP", &[]);
    assert_eq!(code, Some(3), "not a frontend exits 3:\n{text}");
    assert!(
        text.contains("not a Service frontend: traffic is not translated"),
        "{text}"
    );
    let (code, text) = explain(&w, &format!("{EMPTY}:81/UDP"), &[]);
    assert_eq!(code, Some(3), "{text}");
    assert!(
        text.contains("10.96.0.11 is a frontend on other ports: 80/TCP"),
        "{text}"
    );

    // Affinity: the node's connection is remembered under the node namespace's cookie;
    // explain run in that namespace with --from one of its addresses finds it.
    let outs = w.probe("tcp", &format!("{STICKY}:80"), 2);
    assert!(outs.iter().all(|o| o.ok), "{outs:?}");
    let node_ip = NODE_V4.to_string();
    let (code, text) = explain(&w, &format!("{STICKY}:80/TCP"), &["--from", &node_ip]);
    assert_eq!(code, Some(0), "{text}");
    for want in [
        "affinity:  ClientIP, timeout 600s, keyed by client network namespace cookie",
        "(this namespace)",
        &format!("--from {node_ip} is an address of this network namespace"),
        "its next connection goes to 10.1.1.2:8080",
        "translated so far: 2 connection(s)",
    ] {
        assert!(
            text.contains(want),
            "explain sticky --from must say {want:?}:\n{text}"
        );
    }
    // An address of no namespace explain runs in: the keying is explained instead.
    let (_, text) = explain(&w, &format!("{STICKY}:80/TCP"), &["--from", "10.1.1.2"]);
    assert!(
        text.contains("not by IP") && text.contains("ip netns exec"),
        "{text}"
    );

    let (code, _) = explain(&w, "not-an-address", &[]);
    assert_eq!(code, Some(2), "a malformed target is a usage error");

    // `ferry list` still works next to it.
    let list = w.list_json();
    assert_eq!(
        list["frontends"].as_array().map(Vec::len),
        Some(5),
        "{list}"
    );
}
