//! Which endpoints are used and which Services are proxied at all: internalTrafficPolicy
//! Local, terminating fallback, the skip labels, and SCTP ports.

use std::time::Duration;

use ferry_tests::*;

const VIP: &str = "10.96.0.90";

/// A world with one Service `pol` (TCP 80 and UDP 53 -> 8080) over `eps`.
fn policy_world(
    test: &str,
    pods: usize,
    extra_spec: &str,
    eps: impl Fn(&World) -> Vec<Ep>,
) -> World {
    let mut w = World::new(test, pods, &[8080]);
    let eps = eps(&w);
    w.write_manifest(
        "pol.yaml",
        &docs(&[
            service(
                "pol",
                &[VIP],
                &[("http", 80, "TCP"), ("dns", 53, "UDP")],
                extra_spec,
            ),
            slice(
                "pol",
                "pol-1",
                "IPv4",
                &[("http", 8080, "TCP"), ("dns", 8080, "UDP")],
                &eps,
            ),
        ]),
    );
    w.start_agent(&[]);
    w
}

const LOCAL: &str = "  internalTrafficPolicy: Local\n";

#[test]
fn internal_local_without_local_endpoint_fails_with_ehostunreach() {
    let w = policy_world("itp-none", 2, LOCAL, |w| {
        w.pods.iter().map(|p| ep(p.v4).on("node2")).collect()
    });
    for o in w.probe("tcp", &format!("{VIP}:80"), 3) {
        assert!(!o.ok, "no local endpoint: connect must fail: {o:?}");
        assert_eq!(
            o.errno,
            Some(EHOSTUNREACH),
            "expected EHOSTUNREACH (113), saw {o:?}"
        );
        assert!(
            o.ms < 500,
            "the failure must be immediate, took {} ms",
            o.ms
        );
    }
    for o in w.probe("udp", &format!("{VIP}:53"), 2) {
        assert_eq!(
            o.errno,
            Some(EHOSTUNREACH),
            "UDP sendto without a local endpoint: expected EHOSTUNREACH (113), saw {o:?}"
        );
        assert!(
            o.ms < 500,
            "the failure must be immediate, took {} ms",
            o.ms
        );
    }
}

#[test]
fn internal_local_uses_only_local_endpoints() {
    let w = policy_world("itp-local", 3, LOCAL, |w| {
        vec![
            ep(w.pod("pod1").v4).on("node1"),
            ep(w.pod("pod2").v4).on("node2"),
            ep(w.pod("pod3").v4).on("node2"),
        ]
    });
    let outs = w.probe("tcp", &format!("{VIP}:80"), 40);
    assert!(
        outs.iter().all(|o| o.ok),
        "connects with a local endpoint must succeed: {outs:?}"
    );
    assert_eq!(
        backends(&outs),
        set(&["pod1"]),
        "internalTrafficPolicy Local: only the node1 endpoint pod1 may be used"
    );
    let udp = w.probe("udp", &format!("{VIP}:53"), 20);
    assert!(
        udp.iter().all(|o| o.ok),
        "UDP with a local endpoint must succeed: {udp:?}"
    );
    assert_eq!(
        backends(&udp),
        set(&["pod1"]),
        "UDP under the Local policy must reach pod1 only"
    );
}

#[test]
fn cluster_policy_uses_every_node() {
    // Control for the two tests above: same endpoints, default policy.
    let w = policy_world("itp-cluster", 3, "", |w| {
        vec![
            ep(w.pod("pod1").v4).on("node1"),
            ep(w.pod("pod2").v4).on("node2"),
            ep(w.pod("pod3").v4).on("node2"),
        ]
    });
    let outs = w.probe("tcp", &format!("{VIP}:80"), 60);
    assert!(
        outs.iter().all(|o| o.ok),
        "every connect must succeed: {outs:?}"
    );
    assert_eq!(
        backends(&outs),
        set(&["pod1", "pod2", "pod3"]),
        "Cluster policy spreads over every node's endpoints"
    );
}

#[test]
fn serving_terminating_endpoints_are_the_fallback() {
    let w = policy_world("term-serving", 2, "", |w| {
        w.pods.iter().map(|p| ep(p.v4).terminating(true)).collect()
    });
    let outs = w.probe("tcp", &format!("{VIP}:80"), 40);
    assert!(
        outs.iter().all(|o| o.ok),
        "only serving+terminating endpoints: traffic must still reach them: {outs:?}"
    );
    assert_eq!(
        backends(&outs),
        set(&["pod1", "pod2"]),
        "both terminating endpoints serve as the fallback"
    );
}

#[test]
fn ready_endpoints_win_over_terminating_ones() {
    let w = policy_world("term-mixed", 2, "", |w| {
        vec![ep(w.pod("pod1").v4), ep(w.pod("pod2").v4).terminating(true)]
    });
    let outs = w.probe("tcp", &format!("{VIP}:80"), 40);
    assert!(
        outs.iter().all(|o| o.ok),
        "every connect must succeed: {outs:?}"
    );
    assert_eq!(
        backends(&outs),
        set(&["pod1"]),
        "with a ready endpoint, the terminating pod2 must not be used"
    );
}

#[test]
fn terminating_not_serving_only_is_refused() {
    let w = policy_world("term-dead", 2, "", |w| {
        w.pods.iter().map(|p| ep(p.v4).terminating(false)).collect()
    });
    for o in w.probe("tcp", &format!("{VIP}:80"), 3) {
        assert_eq!(
            o.errno,
            Some(ECONNREFUSED),
            "terminating, not serving endpoints only: expected ECONNREFUSED (111), saw {o:?}"
        );
        assert!(o.ms < 500, "refusal must be immediate, took {} ms", o.ms);
    }
}

/// With `label` on the Service it is not proxied; removing and re-adding it is live.
fn label_toggles_proxying(test: &str, label: (&str, &str)) {
    let mut w = World::new(test, 2, &[8080]);
    let eps: Vec<Ep> = w.pods.iter().map(|p| ep(p.v4)).collect();
    let plain = service("lbl", &[VIP], &[("http", 80, "TCP")], "");
    let sl = slice("lbl", "lbl-1", "IPv4", &[("http", 8080, "TCP")], &eps);
    let labelled = docs(&[with_labels(&plain, &[label]), sl.clone()]);
    let unlabelled = docs(&[plain, sl]);
    let target = format!("{VIP}:80");
    let untranslated = |w: &World| -> Result<(), String> {
        let o = &w.probe("tcp", &target, 1)[0];
        // Not translated: the VIP is unrouted in the node, so connect fails at once.
        if o.errno == Some(ENETUNREACH) {
            Ok(())
        } else {
            Err(format!("expected ENETUNREACH (not proxied), saw {o:?}"))
        }
    };
    let served = |w: &World| -> Result<(), String> {
        let outs = w.probe("tcp", &target, 5);
        if outs
            .iter()
            .all(|o| o.ok && o.backend().is_some_and(|b| b.starts_with("pod")))
        {
            Ok(())
        } else {
            Err(format!("expected replies from pods, saw {outs:?}"))
        }
    };

    w.write_manifest("lbl.yaml", &labelled);
    w.start_agent(&[]);
    untranslated(&w)
        .unwrap_or_else(|e| panic!("Service labelled {label:?} must not be proxied: {e}"));
    assert!(
        w.agent_log().contains("not proxied: Service default/lbl"),
        "the agent must log why it skips the Service:\n{}",
        w.agent_log()
    );

    w.write_manifest("lbl.yaml", &unlabelled);
    eventually(
        &format!("label {} removed: Service proxied", label.0),
        Duration::from_secs(5),
        || served(&w),
    );

    w.write_manifest("lbl.yaml", &labelled);
    eventually(
        &format!("label {} added back: Service no longer proxied", label.0),
        Duration::from_secs(5),
        || untranslated(&w),
    );
}

#[test]
fn service_proxy_name_label_skips_the_service_live() {
    label_toggles_proxying(
        "proxy-name",
        (
            "service.kubernetes.io/service-proxy-name",
            "some-other-proxy",
        ),
    );
}

#[test]
fn headless_label_skips_the_service_live() {
    label_toggles_proxying("headless-label", ("service.kubernetes.io/headless", ""));
}

#[test]
fn sctp_port_is_skipped_and_tcp_port_still_works() {
    let mut w = World::new("sctp", 2, &[8080]);
    let eps: Vec<Ep> = w.pods.iter().map(|p| ep(p.v4)).collect();
    w.write_manifest(
        "sctp.yaml",
        &docs(&[
            service(
                "mixed",
                &[VIP],
                &[("http", 80, "TCP"), ("sig", 9999, "SCTP")],
                "",
            ),
            slice(
                "mixed",
                "mixed-1",
                "IPv4",
                &[("http", 8080, "TCP"), ("sig", 9999, "SCTP")],
                &eps,
            ),
        ]),
    );
    w.start_agent(&[]);
    let outs = w.probe("tcp", &format!("{VIP}:80"), 30);
    assert!(
        outs.iter().all(|o| o.ok),
        "the TCP port of a Service with an SCTP port must work: {outs:?}"
    );
    assert_eq!(
        backends(&outs),
        set(&["pod1", "pod2"]),
        "TCP must spread over both pods"
    );

    let log = w.agent_log();
    assert!(
        log.lines()
            .any(|l| l.contains("not proxied: Service default/mixed")
                && l.contains("sctp")
                && l.contains("9999")),
        "expected an agent log line saying the SCTP port 9999 of default/mixed is not proxied:\n{log}"
    );
    eventually(
        "ferry_skipped_total{reason=\"sctp\"} is 1",
        Duration::from_secs(5),
        || {
            let m = w.metrics();
            let line = m
                .lines()
                .find(|l| l.starts_with("ferry_skipped_total{reason=\"sctp\"}"))
                .map(str::to_owned);
            match line {
                Some(l) if l.split_whitespace().nth(1) == Some("1") => Ok(()),
                other => Err(format!(
                    "expected `ferry_skipped_total{{reason=\"sctp\"}} 1`, saw {other:?}"
                )),
            }
        },
    );
    let frontends: Vec<String> = w.list_json()["frontends"]
        .as_array()
        .expect("frontends")
        .iter()
        .map(|f| format!("{} {}", f["frontend"], f["protocol"]))
        .collect();
    assert_eq!(
        frontends,
        vec!["\"10.96.0.90:80\" \"TCP\"".to_string()],
        "only the TCP port may be programmed"
    );
}

#[test]
fn internal_local_applies_to_clients_with_affinity() {
    // A client sticks to pod2 (node2) under ClientIP affinity; then the Service switches
    // to internalTrafficPolicy Local with a node1 endpoint. The remembered remote
    // backend must not be used any more: the ClusterIP's Local set has only pod1, even
    // though pod2 is still a backend of the same ServicePort's externalIP frontend.
    let mut w = World::new("itp-affinity", 2, &[8080]);
    let affinity = "  sessionAffinity: ClientIP\n  externalIPs: [\"203.0.113.90\"]\n";
    let write = |w: &World, extra: &str, eps: Vec<Ep>| {
        w.write_manifest(
            "pol.yaml",
            &docs(&[
                service("pol", &[VIP], &[("http", 80, "TCP")], extra),
                slice("pol", "pol-1", "IPv4", &[("http", 8080, "TCP")], &eps),
            ]),
        );
    };
    write(&w, affinity, vec![ep(w.pod("pod2").v4).on("node2")]);
    w.start_agent(&[]);
    let outs = w.probe("tcp", &format!("{VIP}:80"), 5);
    assert_eq!(
        backends(&outs),
        set(&["pod2"]),
        "setup: the client must stick to pod2: {outs:?}"
    );

    write(
        &w,
        &format!("{affinity}{LOCAL}"),
        vec![
            ep(w.pod("pod1").v4).on("node1"),
            ep(w.pod("pod2").v4).on("node2"),
        ],
    );
    eventually("Local policy programmed", Duration::from_secs(5), || {
        let list = w.list_json();
        let vip = list["frontends"]
            .as_array()
            .and_then(|f| f.iter().find(|f| f["frontend"] == "10.96.0.90:80").cloned());
        let flags = vip
            .as_ref()
            .and_then(|f| f["flags"].as_str())
            .unwrap_or("")
            .to_string();
        if flags.contains("local-policy") {
            Ok(())
        } else {
            Err(format!("flags {flags:?}; list {list}"))
        }
    });
    let outs = w.probe("tcp", &format!("{VIP}:80"), 20);
    assert!(outs.iter().all(|o| o.ok), "connects must succeed: {outs:?}");
    assert_eq!(
        backends(&outs),
        set(&["pod1"]),
        "internalTrafficPolicy Local: only the local pod1 may be used, also for a client whose affinity remembered remote pod2"
    );
    // The externalIP frontend keeps the cluster-wide set; the client's affinity now
    // points at pod1, which is in that set too.
    let outs = w.probe("tcp", "203.0.113.90:80", 10);
    assert!(
        outs.iter().all(|o| o.ok),
        "externalIP connects must succeed: {outs:?}"
    );
    assert_eq!(
        backends(&outs).len(),
        1,
        "externalIP connects must stick to one backend: {outs:?}"
    );
}

#[test]
fn terminating_backend_remembered_elsewhere_is_not_used_when_ready_ones_exist() {
    // Local policy: the ClusterIP's set is the local terminating fallback (pod1); the
    // externalIP of the same ServicePort uses the cluster set, the ready pod2. Affinity
    // learnt through the ClusterIP must not drag externalIP traffic to terminating pod1.
    let mut w = World::new("term-affinity", 2, &[8080]);
    w.write_manifest(
        "pol.yaml",
        &docs(&[
            service(
                "pol",
                &[VIP],
                &[("http", 80, "TCP")],
                &format!("  sessionAffinity: ClientIP\n  externalIPs: [\"203.0.113.91\"]\n{LOCAL}"),
            ),
            slice(
                "pol",
                "pol-1",
                "IPv4",
                &[("http", 8080, "TCP")],
                &[
                    ep(w.pod("pod1").v4).on("node1").terminating(true),
                    ep(w.pod("pod2").v4).on("node2"),
                ],
            ),
        ]),
    );
    w.start_agent(&[]);
    let outs = w.probe("tcp", &format!("{VIP}:80"), 5);
    assert_eq!(
        backends(&outs),
        set(&["pod1"]),
        "ClusterIP (Local): only the local terminating pod1 serves as fallback: {outs:?}"
    );
    let outs = w.probe("tcp", "203.0.113.91:80", 10);
    assert!(
        outs.iter().all(|o| o.ok),
        "externalIP connects must succeed: {outs:?}"
    );
    assert_eq!(
        backends(&outs),
        set(&["pod2"]),
        "externalIP (cluster set): the ready pod2 must be used, not the terminating pod1 remembered through the ClusterIP"
    );
}
