//! sessionAffinity ClientIP: stickiness per client (network namespace), expiry after
//! timeoutSeconds without a new connection, and live on/off.

use std::time::{Duration, Instant};

use ferry_tests::*;

const VIP: &str = "10.96.0.20";

fn affinity_spec(timeout: Option<u32>) -> String {
    let mut s = String::from("  sessionAffinity: ClientIP\n");
    if let Some(t) = timeout {
        s.push_str(&format!(
            "  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: {t}\n"
        ));
    }
    s
}

fn manifest(w: &World, extra_spec: &str) -> String {
    let eps: Vec<Ep> = w.pods.iter().map(|p| ep(p.v4)).collect();
    docs(&[
        service("sticky", &[VIP], &[("http", 80, "TCP")], extra_spec),
        slice("sticky", "sticky-1", "IPv4", &[("http", 8080, "TCP")], &eps),
    ])
}

fn world(test: &str, extra_spec: &str) -> World {
    let mut w = World::new(test, 3, &[8080]);
    let m = manifest(&w, extra_spec);
    w.write_manifest("sticky.yaml", &m);
    w.start_agent(&[]);
    w
}

/// `count` connections from `netns`; all must succeed; returns the single backend they
/// reached, failing if they were spread.
fn sticky_backend(w: &World, netns: &str, count: usize, what: &str) -> String {
    let outs = w.probe_from(netns, "tcp", &format!("{VIP}:80"), count);
    assert!(
        outs.iter().all(|o| o.ok),
        "{what}: every connect must succeed: {outs:?}"
    );
    let seen = backends(&outs);
    assert_eq!(
        seen.len(),
        1,
        "{what}: {count} connections with ClientIP affinity must reach one backend, saw {seen:?}"
    );
    seen.into_iter().next().unwrap()
}

/// Pods reach each other through the node namespace: let it route.
fn enable_forwarding(w: &World) {
    sh(&format!(
        "ip netns exec {0} sysctl -qw net.ipv4.ip_forward=1 && ip netns exec {0} sysctl -qw net.ipv6.conf.all.forwarding=1",
        w.node_ns
    ));
}

#[test]
fn client_ip_affinity_sticks_to_one_backend() {
    let w = world("aff-stick", &affinity_spec(None));
    let node_ns = w.node_ns.clone();
    let first = sticky_backend(&w, &node_ns, 20, "node client");
    // Later connections, in separate probe processes, keep the same backend.
    for round in 0..3 {
        let again = sticky_backend(&w, &node_ns, 10, "node client, later");
        assert_eq!(
            again, first,
            "round {round}: affinity must survive across processes of one client"
        );
    }
    // No timeoutSeconds: the API default is programmed.
    let list = w.list_json();
    let timeout = list["frontends"]
        .as_array()
        .and_then(|f| f.iter().find(|f| f["frontend"] == "10.96.0.20:80"))
        .map(|f| f["affinity_timeout_s"].clone());
    assert_eq!(
        timeout,
        Some(serde_json::json!(10800)),
        "unset timeoutSeconds must program the API default 10800 s; list: {list}"
    );
}

#[test]
fn affinity_expires_after_timeout_without_traffic() {
    let w = world("aff-expire", &affinity_spec(Some(2)));
    let node_ns = w.node_ns.clone();
    let first = sticky_backend(&w, &node_ns, 20, "before expiry");

    // Traffic more often than the timeout keeps the entry alive past 2 s in total.
    let kept_until = Instant::now() + Duration::from_millis(3500);
    while Instant::now() < kept_until {
        std::thread::sleep(Duration::from_millis(700));
        let b = sticky_backend(&w, &node_ns, 1, "within timeout");
        assert_eq!(
            b, first,
            "a connection every 0.7 s must keep the 2 s affinity: expected {first}, saw {b}"
        );
    }

    // Idle past the timeout: a fresh choice is made. With 3 backends a new random choice
    // equals the old one with p = 1/3, so loop until a different backend shows up.
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut previous = first.clone();
    let mut history = vec![first];
    loop {
        // The timeout itself is under test: idle for longer than it.
        std::thread::sleep(Duration::from_millis(2600));
        let now = sticky_backend(&w, &node_ns, 5, "after expiry");
        history.push(now.clone());
        if now != previous {
            break;
        }
        previous = now;
        assert!(
            Instant::now() < deadline,
            "after idling > timeoutSeconds (2 s) a new backend must eventually be chosen; every round saw the same: {history:?}"
        );
    }
}

#[test]
fn affinity_toggled_live() {
    let mut w = World::new("aff-toggle", 3, &[8080]);
    let on = manifest(&w, &affinity_spec(Some(600)));
    let off = manifest(&w, "");
    w.write_manifest("sticky.yaml", &on);
    w.start_agent(&[]);
    let node_ns = w.node_ns.clone();
    sticky_backend(&w, &node_ns, 20, "affinity on");

    w.write_manifest("sticky.yaml", &off);
    eventually(
        "affinity off: connections spread over all pods again",
        Duration::from_secs(5),
        || {
            let seen = backends(&w.probe("tcp", &format!("{VIP}:80"), 40));
            if seen == all_pods(&w) {
                Ok(())
            } else {
                Err(format!("expected {:?}, saw {seen:?}", all_pods(&w)))
            }
        },
    );

    w.write_manifest("sticky.yaml", &on);
    eventually(
        "affinity on again: connections stick",
        Duration::from_secs(5),
        || {
            let seen = backends(&w.probe("tcp", &format!("{VIP}:80"), 20));
            if seen.len() == 1 {
                Ok(())
            } else {
                Err(format!(
                    "expected one backend for 20 connections, saw {seen:?}"
                ))
            }
        },
    );
    sticky_backend(&w, &node_ns, 20, "affinity on again, later");
}

#[test]
fn clients_in_different_namespaces_have_independent_affinity() {
    let w = world("aff-clients", &affinity_spec(Some(2)));
    enable_forwarding(&w);
    let node_ns = w.node_ns.clone();
    let pod_ns = w.pod("pod1").netns.clone();
    // Each client is sticky on its own. If both shared one entry, whoever connects second
    // would always get the first one's backend; with independent entries they differ in
    // 2 of 3 rounds. Rounds are separated by more than the 2 s timeout, so each round
    // makes fresh choices.
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut rounds = Vec::new();
    loop {
        let node_choice = sticky_backend(&w, &node_ns, 10, "node namespace client");
        let pod_choice = sticky_backend(&w, &pod_ns, 10, "pod1 namespace client");
        rounds.push((node_choice.clone(), pod_choice.clone()));
        if node_choice != pod_choice {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node and pod1 clients always got the same backend ({rounds:?}): affinity must be keyed per client namespace"
        );
        std::thread::sleep(Duration::from_millis(2600));
    }
    // Both are still sticky afterwards, each to its own choice.
    let (node_choice, pod_choice) = rounds.last().cloned().unwrap();
    assert_eq!(
        sticky_backend(&w, &node_ns, 10, "node client again"),
        node_choice,
        "node client must keep its backend"
    );
    assert_eq!(
        sticky_backend(&w, &pod_ns, 10, "pod1 client again"),
        pod_choice,
        "pod1 client must keep its backend"
    );
}

#[test]
fn affinity_moves_when_the_chosen_backend_is_removed() {
    let mut w = World::new("aff-remove", 3, &[8080]);
    let on = affinity_spec(Some(600));
    let m = manifest(&w, &on);
    w.write_manifest("sticky.yaml", &m);
    w.start_agent(&[]);
    let node_ns = w.node_ns.clone();
    let gone = sticky_backend(&w, &node_ns, 10, "before removal");

    let eps: Vec<Ep> = w
        .pods
        .iter()
        .filter(|p| p.name != gone)
        .map(|p| ep(p.v4))
        .collect();
    w.write_manifest(
        "sticky.yaml",
        &docs(&[
            service("sticky", &[VIP], &[("http", 80, "TCP")], &on),
            slice("sticky", "sticky-1", "IPv4", &[("http", 8080, "TCP")], &eps),
        ]),
    );
    // Its pod still runs: a stale affinity entry would keep reaching it.
    let moved = eventually(
        &format!("affinity leaves removed backend {gone}"),
        Duration::from_secs(5),
        || {
            let outs = w.probe("tcp", &format!("{VIP}:80"), 10);
            let seen = backends(&outs);
            match seen.iter().next() {
                Some(b) if seen.len() == 1 && *b != gone && outs.iter().all(|o| o.ok) => {
                    Ok(b.clone())
                }
                _ => Err(format!(
                    "expected one backend other than {gone}, saw {seen:?}"
                )),
            }
        },
    );
    // Re-adding the old backend does not move the client back: the new entry holds.
    let m = manifest(&w, &on);
    w.write_manifest("sticky.yaml", &m);
    eventually(
        "backend list is whole again",
        Duration::from_secs(5),
        || {
            let list = w.list_json();
            let n = list["frontends"][0]["backends"]
                .as_array()
                .map(Vec::len)
                .unwrap_or(0);
            if n == 3 {
                Ok(())
            } else {
                Err(format!("expected 3 backends, list: {list}"))
            }
        },
    );
    assert_eq!(
        sticky_backend(&w, &node_ns, 20, "after re-adding"),
        moved,
        "the client must stay on {moved}"
    );
}

#[test]
fn udp_from_one_client_shares_its_affinity() {
    let mut w = World::new("aff-udp", 3, &[8080]);
    let eps: Vec<Ep> = w.pods.iter().map(|p| ep(p.v4)).collect();
    w.write_manifest(
        "sticky.yaml",
        &docs(&[
            service(
                "sticky",
                &[VIP],
                &[("dns", 53, "UDP")],
                &affinity_spec(None),
            ),
            slice("sticky", "sticky-1", "IPv4", &[("dns", 8080, "UDP")], &eps),
        ]),
    );
    w.start_agent(&[]);
    // `udp` uses a fresh socket per datagram: per-socket stickiness alone would spread them.
    let outs = w.probe("udp", &format!("{VIP}:53"), 20);
    assert!(
        outs.iter().all(|o| o.ok),
        "every datagram must be answered: {outs:?}"
    );
    let seen = backends(&outs);
    assert_eq!(
        seen.len(),
        1,
        "20 UDP sockets of one client with ClientIP affinity must reach one backend, saw {seen:?}"
    );
    for o in &outs {
        assert_eq!(
            o.from.as_deref(),
            Some("10.96.0.20:53"),
            "reply source must be the VIP: {o:?}"
        );
    }
}
