//! Traffic from outside the nodes (the tc path), IPv4: NodePort across nodes with source
//! NAT, externalTrafficPolicy Local, health check node ports, refusal without endpoints,
//! source ranges, externalIPs and LoadBalancer IPs, Maglev consistency, flows across an
//! agent restart, hairpin. Every test builds a [`Cluster`]: two node namespaces with
//! their pods and agents, and external clients on a shared LAN (see `cluster.rs`).

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use ferry_tests::*;

/// TCP port 80 -> nodePort 30080 and UDP port 53 -> nodePort 30053, both to 8080.
const NP_TCP: u16 = 30080;
const NP_UDP: u16 = 30053;
const SRV: u16 = 8080;

fn np_ports() -> [NodePortSpec<'static>; 2] {
    [("tcp", 80, "TCP", NP_TCP), ("udp", 53, "UDP", NP_UDP)]
}

fn target_ports() -> [Port<'static>; 2] {
    [("tcp", SRV, "TCP"), ("udp", SRV, "UDP")]
}

/// Endpoints: each named pod on its own node.
fn eps_v4(c: &Cluster, pods: &[&str]) -> Vec<Ep> {
    pods.iter()
        .map(|p| {
            let p = c.pod(p);
            ep(p.v4).on(&c.node(p.node).name)
        })
        .collect()
}

/// A Service (`svc_type`, `extra`, `status`) with the IPv4 slice over `pods`.
fn svc_doc(
    c: &Cluster,
    name: &str,
    svc_type: &str,
    cluster_ip: &str,
    extra: &str,
    status: &str,
    pods: &[&str],
) -> String {
    docs(&[
        external_service(name, svc_type, &[cluster_ip], &np_ports(), extra, status),
        slice(
            name,
            &format!("{name}-v4"),
            "IPv4",
            &target_ports(),
            &eps_v4(c, pods),
        ),
    ])
}

/// An error that is a timeout (the packets were dropped), not a refusal or reset.
fn timed_out(o: &Outcome) -> bool {
    !o.ok
        && (matches!(o.errno, None | Some(11) | Some(110)))
        && o.error
            .as_deref()
            .is_some_and(|e| e.contains("timed out") || e.contains("temporarily unavailable"))
}

// ---------------------------------------------------------------------------------------
// The harness itself, without ferry.

#[test]
fn harness_routes_pods_across_nodes_without_ferry() {
    let c = Cluster::new("ext-harness", &[1, 2], &[SRV]);
    let n2p1 = c.pod("n2p1");
    // External client -> pod on node 2, routed via node 2, no translation.
    for (mode, n) in [("tcp", 5), ("udp", 5)] {
        let outs = c.probe_ext(1, mode, &hostport(n2p1.v4, SRV), n);
        all_ok(&outs, &format!("client1 -> n2p1 {mode} (direct, no ferry)"));
        assert_eq!(backends(&outs), set(&["n2p1"]));
        assert_eq!(
            seen_set(&outs),
            BTreeSet::from([c.client(1).v4.to_string()]),
            "the pod sees the client's own address: {outs:?}"
        );
    }
    let outs = c.probe_ext(2, "tcp", &hostport(n2p1.v6, SRV), 3);
    all_ok(&outs, "client2 -> n2p1 over IPv6");
    assert_eq!(
        seen_set(&outs),
        BTreeSet::from([c.client(2).v6.to_string()])
    );
    // Pod on node 1 -> pod on node 2, both families.
    for addr in [hostport(n2p1.v4, SRV), hostport(n2p1.v6, SRV)] {
        let outs = c.probe_pod("n1p1", "tcp", &addr, 3);
        all_ok(&outs, &format!("n1p1 -> {addr}"));
        let p = c.pod("n1p1");
        let want = if addr.starts_with('[') {
            p.v6.to_string()
        } else {
            p.v4.to_string()
        };
        assert_eq!(
            seen_set(&outs),
            BTreeSet::from([want]),
            "pod to pod: {outs:?}"
        );
    }
    // Pods on one node reach each other through the node.
    let outs = c.probe_pod("n2p2", "udp", &hostport(n2p1.v4, SRV), 3);
    all_ok(&outs, "n2p2 -> n2p1");
}

// ---------------------------------------------------------------------------------------
// 1. NodePort, externalTrafficPolicy Cluster.

#[test]
fn nodeport_cluster_policy_crosses_nodes_with_snat() {
    let mut c = Cluster::new("ext-np", &[1, 2], &[SRV]);
    c.write_manifest(
        "np.yaml",
        &svc_doc(
            &c,
            "np",
            "NodePort",
            "10.96.1.10",
            "",
            "",
            &["n2p1", "n2p2"],
        ),
    );
    c.start_agents(&[]);
    let node1 = c.node(1).v4;
    let node2 = c.node(2).v4;
    let client = c.client(1).v4;
    let before = c.counter(1, "external_translated");

    // Via node 1: the endpoints are on node 2, so the source is node 1's address.
    let tcp = c.probe_ext(1, "tcp", &hostport(node1, NP_TCP), 30);
    all_ok(&tcp, &format!("TCP to node1 NodePort\n{}", c.diag(1)));
    assert_eq!(
        backends(&tcp),
        set(&["n2p1", "n2p2"]),
        "30 connects through node1's NodePort must spread over both node-2 endpoints"
    );
    for o in &tcp {
        assert_eq!(
            o.peer.as_deref(),
            Some(hostport(node1, NP_TCP).as_str()),
            "the client talks to the NodePort: {o:?}"
        );
    }
    assert_eq!(
        seen_set(&tcp),
        BTreeSet::from([node1.to_string()]),
        "eTP Cluster to another node's endpoint: the backend must see node1's address (SNAT)"
    );
    let udp = c.probe_ext(1, "udp", &hostport(node1, NP_UDP), 30);
    all_ok(&udp, &format!("UDP to node1 NodePort\n{}", c.diag(1)));
    assert_eq!(backends(&udp), set(&["n2p1", "n2p2"]), "UDP spread");
    for o in &udp {
        assert_eq!(
            o.from.as_deref(),
            Some(hostport(node1, NP_UDP).as_str()),
            "the UDP reply must come from the NodePort it was sent to: {o:?}"
        );
    }
    assert_eq!(
        seen_set(&udp),
        BTreeSet::from([node1.to_string()]),
        "UDP through node1 must be source-NATed to node1"
    );
    c.expect_counter(
        1,
        "external_translated",
        before + 60,
        "node1 counts the 60 new external flows",
    );

    // Via node 2: the endpoints are local, ferry does not masquerade (deliberate
    // difference from kube-proxy): the backend sees the client.
    let tcp = c.probe_ext(1, "tcp", &hostport(node2, NP_TCP), 30);
    all_ok(&tcp, &format!("TCP to node2 NodePort\n{}", c.diag(2)));
    assert_eq!(backends(&tcp), set(&["n2p1", "n2p2"]));
    assert_eq!(
        seen_set(&tcp),
        BTreeSet::from([client.to_string()]),
        "a local endpoint under eTP Cluster sees the real client address"
    );
}

// ---------------------------------------------------------------------------------------
// 2. externalTrafficPolicy Local.

#[test]
fn nodeport_local_policy_keeps_client_address_and_drops_without_local_endpoint() {
    let mut c = Cluster::new("ext-local", &[2, 1], &[SRV]);
    c.write_manifest(
        "loc.yaml",
        &svc_doc(
            &c,
            "loc",
            "NodePort",
            "10.96.1.20",
            "  externalTrafficPolicy: Local\n",
            "",
            &["n1p1", "n1p2"],
        ),
    );
    c.start_agents(&[]);
    let (node1, node2) = (c.node(1).v4, c.node(2).v4);

    // Node 1 has both endpoints: the real client address arrives.
    for (i, mode, port) in [(1, "tcp", NP_TCP), (2, "tcp", NP_TCP), (1, "udp", NP_UDP)] {
        let outs = c.probe_ext(i, mode, &hostport(node1, port), 30);
        all_ok(&outs, &format!("client{i} {mode} via node1\n{}", c.diag(1)));
        assert_eq!(backends(&outs), set(&["n1p1", "n1p2"]), "{mode} spread");
        assert_eq!(
            seen_set(&outs),
            BTreeSet::from([c.client(i).v4.to_string()]),
            "eTP Local: the backend must see client{i}'s own address over {mode}"
        );
    }

    // Node 2 has none: dropped (the client times out, never refused).
    let drops = c.counter(2, "dropped_no_local_endpoints");
    for (mode, port) in [("tcp", NP_TCP), ("udp-connected", NP_UDP)] {
        let outs = c.probe_ext(1, mode, &hostport(node2, port), 2);
        for o in &outs {
            assert!(
                timed_out(o),
                "eTP Local without a local endpoint: {mode} via node2 must be dropped (timeout), saw {o:?}\n{}",
                c.diag(2)
            );
        }
    }
    c.expect_counter(
        2,
        "dropped_no_local_endpoints",
        drops + 4,
        "node2 counts the dropped SYNs and datagrams",
    );

    // Pods and processes of node 2 still reach the endpoints through node2's NodePort
    // (socket hooks: local traffic is not subject to the external policy).
    let outs = c.probe_pod("n2p1", "tcp", &hostport(node2, NP_TCP), 20);
    all_ok(&outs, "pod n2p1 -> node2 NodePort");
    assert_eq!(
        backends(&outs),
        set(&["n1p1", "n1p2"]),
        "a pod on node2 reaches the endpoints of node1 through its own node's NodePort"
    );
    let outs = c.probe_node(2, "udp", &hostport(node2, NP_UDP), 20);
    all_ok(&outs, "node2 host -> node2 NodePort (UDP)");
    assert_eq!(backends(&outs), set(&["n1p1", "n1p2"]));
}

// ---------------------------------------------------------------------------------------
// 3. healthCheckNodePort.

const HC_PORT: u16 = 32001;

/// `curl -i` to `http://node:HC_PORT/` from client 1: (curl exit code, status, weight
/// header, localEndpoints).
fn health_check(c: &Cluster, node: usize) -> (i32, u16, Option<String>, Option<u64>) {
    let url = format!("http://{}/", hostport(c.node(node).v4, HC_PORT));
    let out = c.run_ext(1, "curl", &["-s", "-i", "--max-time", "2", &url]);
    let code = out.status.code().unwrap_or(-1);
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "");
    let status = text
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let weight = text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("X-Load-Balancing-Endpoint-Weight")
            .then(|| v.trim().to_string())
    });
    let local = text
        .split_once("\n\n")
        .and_then(|(_, body)| serde_json::from_str::<serde_json::Value>(body.trim()).ok())
        .and_then(|v| v["localEndpoints"].as_u64());
    (code, status, weight, local)
}

fn expect_health(c: &Cluster, node: usize, want_status: u16, want_local: u64, when: &str) {
    eventually(
        &format!("{when}: node{node} health check {want_status} with localEndpoints {want_local}"),
        Duration::from_secs(10),
        || {
            let (code, status, weight, local) = health_check(c, node);
            if status != want_status || local != Some(want_local) {
                return Err(format!(
                    "curl exit {code}, status {status}, weight {weight:?}, localEndpoints {local:?}"
                ));
            }
            if want_status == 200 && weight.as_deref() != Some(&want_local.to_string()) {
                return Err(format!(
                    "X-Load-Balancing-Endpoint-Weight must be {want_local}, saw {weight:?}"
                ));
            }
            Ok(())
        },
    );
}

fn expect_health_closed(c: &Cluster, node: usize, when: &str) {
    eventually(
        &format!("{when}: node{node} health check port closed"),
        Duration::from_secs(10),
        || match health_check(c, node) {
            (7, ..) => Ok(()),
            other => Err(format!(
                "expected curl exit 7 (connection refused), saw {other:?}"
            )),
        },
    );
}

#[test]
fn health_check_node_port_follows_local_endpoints() {
    let mut c = Cluster::new("ext-hc", &[2, 2], &[SRV]);
    let local = format!("  externalTrafficPolicy: Local\n  healthCheckNodePort: {HC_PORT}\n");
    let status = lb_status(&[("192.168.200.30", "VIP")]);
    let doc = |c: &Cluster, extra: &str, pods: &[&str]| {
        svc_doc(c, "hc", "LoadBalancer", "10.96.1.30", extra, &status, pods)
    };
    c.write_manifest("hc.yaml", &doc(&c, local.as_str(), &["n1p1"]));
    c.start_agents(&[]);
    expect_health(&c, 1, 200, 1, "one endpoint on node1");
    expect_health(&c, 2, 503, 0, "no endpoint on node2");

    // The endpoints move to node 2.
    c.write_manifest("hc.yaml", &doc(&c, local.as_str(), &["n2p1", "n2p2"]));
    expect_health(&c, 1, 503, 0, "endpoints moved to node2");
    expect_health(&c, 2, 200, 2, "endpoints moved to node2");

    // One on each node.
    c.write_manifest("hc.yaml", &doc(&c, local.as_str(), &["n1p2", "n2p2"]));
    expect_health(&c, 1, 200, 1, "one endpoint per node");
    expect_health(&c, 2, 200, 1, "one endpoint per node");

    // eTP Cluster: no health check node port any more.
    c.write_manifest("hc.yaml", &doc(&c, "", &["n1p2", "n2p2"]));
    expect_health_closed(&c, 1, "eTP Cluster");
    expect_health_closed(&c, 2, "eTP Cluster");

    // Back to Local, then the Service is deleted.
    c.write_manifest("hc.yaml", &doc(&c, local.as_str(), &["n1p2"]));
    expect_health(&c, 1, 200, 1, "back to Local");
    expect_health(&c, 2, 503, 0, "back to Local");
    c.remove_manifest("hc.yaml");
    expect_health_closed(&c, 1, "Service deleted");
    expect_health_closed(&c, 2, "Service deleted");
}

// ---------------------------------------------------------------------------------------
// 4. No endpoints: refused at once.

#[test]
fn nodeport_without_endpoints_is_refused_with_icmp() {
    let mut c = Cluster::new("ext-refuse", &[1, 1], &[SRV]);
    c.write_manifest(
        "none.yaml",
        &svc_doc(&c, "none", "NodePort", "10.96.1.40", "", "", &[]),
    );
    c.start_agents(&[]);
    let node1 = c.node(1).v4;
    let before = c.counter(1, "external_icmp_unreachable");

    let url = format!("http://{}/", hostport(node1, NP_TCP));
    for _ in 0..3 {
        let t = Instant::now();
        let out = c.run_ext(1, "curl", &["-sS", "--max-time", "3", &url]);
        let ms = t.elapsed().as_millis();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(7),
            "curl to a NodePort without endpoints must fail to connect (exit 7), saw {:?}: {err}",
            out.status
        );
        assert!(
            err.contains("refused") || err.contains("Couldn't connect"),
            "curl must report a refusal: {err}"
        );
        assert!(ms < 1000, "the refusal must be immediate, took {ms} ms");
    }
    for o in c.probe_ext(1, "udp-connected", &hostport(node1, NP_UDP), 3) {
        assert_eq!(
            o.errno,
            Some(ECONNREFUSED),
            "UDP to a NodePort without endpoints: expected ECONNREFUSED from ICMP port unreachable, saw {o:?}"
        );
        assert!(o.ms < 1000, "the refusal must be immediate: {o:?}");
    }
    // The node itself has no socket on those ports either: the counter proves that the
    // refusal came from ferry.
    c.expect_counter(
        1,
        "external_icmp_unreachable",
        before + 6,
        "node1 answered 3 SYNs and 3 datagrams with ICMP port unreachable",
    );
}

// ---------------------------------------------------------------------------------------
// 5. loadBalancerSourceRanges.

#[test]
fn load_balancer_source_ranges_filter_the_vip_only() {
    let mut c = Cluster::new("ext-ranges", &[1, 1], &[SRV]);
    let vip = "192.168.200.50";
    let extra = format!("  loadBalancerSourceRanges: [\"{}/32\"]\n", c.client(1).v4);
    c.write_manifest(
        "lbr.yaml",
        &svc_doc(
            &c,
            "lbr",
            "LoadBalancer",
            "10.96.1.50",
            &extra,
            &lb_status(&[(vip, "VIP")]),
            &["n1p1", "n2p1"],
        ),
    );
    c.route_to_node(vip.parse().unwrap(), 1);
    c.start_agents(&[]);

    let inside = c.probe_ext(1, "tcp", &format!("{vip}:80"), 20);
    all_ok(
        &inside,
        &format!("client1 (inside the range) -> VIP\n{}", c.diag(1)),
    );
    assert_eq!(backends(&inside), set(&["n1p1", "n2p1"]));
    let inside = c.probe_ext(1, "udp", &format!("{vip}:53"), 10);
    all_ok(&inside, "client1 (inside the range) -> VIP over UDP");

    let drops = c.counter(1, "source_range_dropped");
    for (mode, port) in [("tcp", 80), ("udp-connected", 53)] {
        for o in c.probe_ext(2, mode, &format!("{vip}:{port}"), 2) {
            assert!(
                timed_out(&o),
                "client2 is outside loadBalancerSourceRanges: {mode} to the VIP must be dropped, saw {o:?}"
            );
        }
    }
    c.expect_counter(
        1,
        "source_range_dropped",
        drops + 4,
        "node1 counts the source-range drops",
    );
    // The NodePort of the same Service is not filtered.
    let outs = c.probe_ext(2, "tcp", &hostport(c.node(1).v4, NP_TCP), 20);
    all_ok(&outs, "client2 -> node1 NodePort of the same Service");
    assert_eq!(backends(&outs), set(&["n1p1", "n2p1"]));
}

// ---------------------------------------------------------------------------------------
// 6. externalIPs and LoadBalancer ingress IPs.

#[test]
fn external_ips_and_load_balancer_vips_are_served_proxy_mode_is_not() {
    let mut c = Cluster::new("ext-vips", &[1, 2], &[SRV]);
    let (eip, lb_vip, lb_default, lb_proxy) = (
        "192.168.201.10",
        "192.168.200.60",
        "192.168.200.61",
        "192.168.200.62",
    );
    c.write_manifest(
        "vips.yaml",
        &svc_doc(
            &c,
            "vips",
            "LoadBalancer",
            "10.96.1.60",
            &format!("  externalIPs: [\"{eip}\"]\n"),
            &lb_status(&[(lb_vip, "VIP"), (lb_default, ""), (lb_proxy, "Proxy")]),
            &["n2p1", "n2p2"],
        ),
    );
    for ip in [eip, lb_vip, lb_default, lb_proxy] {
        c.route_to_node(ip.parse().unwrap(), 1);
    }
    c.start_agents(&[]);
    let node1 = c.node(1).v4.to_string();
    for ip in [eip, lb_vip, lb_default] {
        let tcp = c.probe_ext(1, "tcp", &format!("{ip}:80"), 30);
        all_ok(&tcp, &format!("TCP to {ip} via node1\n{}", c.diag(1)));
        assert_eq!(backends(&tcp), set(&["n2p1", "n2p2"]), "{ip}: spread");
        assert_eq!(
            seen_set(&tcp),
            BTreeSet::from([node1.clone()]),
            "{ip}: endpoints on node2 see node1's address"
        );
        let udp = c.probe_ext(1, "udp", &format!("{ip}:53"), 20);
        all_ok(&udp, &format!("UDP to {ip} via node1"));
        for o in &udp {
            assert_eq!(
                o.from.as_deref(),
                Some(format!("{ip}:53").as_str()),
                "the reply must come from {ip}:53"
            );
        }
    }
    for o in c.probe_ext(1, "tcp", &format!("{lb_proxy}:80"), 2) {
        assert!(
            !o.ok,
            "an ipMode Proxy ingress IP must not be served by the node: {o:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// 7. Maglev: backend selection survives the loss of conntrack.

/// Backend per source port, from `ferry-probe udp-ports`.
fn by_port(outs: &[Outcome]) -> BTreeMap<String, String> {
    outs.iter()
        .map(|o| {
            (
                o.from.clone().unwrap_or_default(),
                o.backend().unwrap_or("none").to_string(),
            )
        })
        .collect()
}

#[test]
fn maglev_keeps_flows_on_their_backend_without_conntrack() {
    let mut c = Cluster::new("ext-maglev", &[3, 2], &[SRV]);
    let node1 = c.node(1).v4;
    // UDP: endpoints on both nodes (the node-2 ones are source-NATed).
    let udp_doc =
        |c: &Cluster, pods: &[&str]| svc_doc(c, "mgu", "NodePort", "10.96.1.70", "", "", pods);
    // TCP: endpoints on node 1 (no source NAT: a re-selected flow keeps its 4-tuple).
    let tcp_doc = |c: &Cluster, pods: &[&str]| {
        docs(&[
            external_service(
                "mgt",
                "NodePort",
                &["10.96.1.71"],
                &[("tcp", 80, "TCP", 30180)],
                "",
                "",
            ),
            slice(
                "mgt",
                "mgt-v4",
                "IPv4",
                &[("tcp", SRV, "TCP")],
                &eps_v4(c, pods),
            ),
        ])
    };
    c.write_manifest("mgu.yaml", &udp_doc(&c, &["n1p1", "n2p1"]));
    c.write_manifest("mgt.yaml", &tcp_doc(&c, &["n1p1", "n1p2"]));
    c.start_agents(&[]);

    const PORTS: u16 = 60;
    const FIRST: &str = "41000";
    let udp_addr = hostport(node1, NP_UDP);
    let udp_run = |c: &Cluster| {
        let outs = Cluster::probe_in(
            &c.client(1).netns,
            None,
            &["udp-ports", &udp_addr, FIRST, &PORTS.to_string()],
            "whoami",
        );
        all_ok(
            &outs,
            &format!("UDP from fixed source ports\n{}", c.diag(1)),
        );
        by_port(&outs)
    };
    let before = udp_run(&c);
    assert_eq!(
        before.values().cloned().collect::<BTreeSet<_>>(),
        set(&["n1p1", "n2p1"]),
        "60 source ports must spread over both endpoints"
    );
    assert_eq!(
        udp_run(&c),
        before,
        "the same 5-tuples must land on the same backends"
    );

    // TCP sessions from fixed source ports.
    let tcp_addr = hostport(node1, 30180);
    let mut sessions: Vec<(Session, String)> = Vec::new();
    for k in 0..12u16 {
        let mut s = c.session_ext(1, &tcp_addr, Some(42000 + k));
        let r = s
            .ask("whoami", Duration::from_secs(3))
            .unwrap_or_else(|e| panic!("{e}\n{}", c.diag(1)));
        let b = r.split_whitespace().next().unwrap_or("").to_string();
        sessions.push((s, b));
    }
    let tcp_backends: BTreeSet<String> = sessions.iter().map(|(_, b)| b.clone()).collect();
    assert_eq!(tcp_backends, set(&["n1p1", "n1p2"]), "12 sessions spread");

    // A new backend in each Service; wait until node 1 uses it for new flows.
    c.write_manifest("mgu.yaml", &udp_doc(&c, &["n1p1", "n2p1", "n2p2"]));
    c.write_manifest("mgt.yaml", &tcp_doc(&c, &["n1p1", "n1p2", "n1p3"]));
    eventually("new backends in use", Duration::from_secs(10), || {
        let u = backends(&c.probe_ext(2, "udp", &udp_addr, 20));
        let t = backends(&c.probe_ext(2, "tcp", &tcp_addr, 20));
        if u.contains("n2p2") && t.contains("n1p3") {
            Ok(())
        } else {
            Err(format!("udp {u:?}, tcp {t:?}"))
        }
    });
    // With conntrack, no flow moves.
    assert_eq!(
        udp_run(&c),
        before,
        "with their conntrack entries, UDP flows keep their backend when one is added"
    );

    let flushed = c.flush_ct(1);
    assert!(flushed > 0, "node1's conntrack map must have had entries");
    assert_eq!(
        c.ct_len(1),
        0,
        "node1's conntrack must be empty after the flush"
    );

    // Without conntrack: Maglev moves about a third of the flows, to the new backend.
    let after = udp_run(&c);
    let moved: Vec<(&String, &String, &String)> = before
        .iter()
        .filter_map(|(p, b)| {
            let a = &after[p];
            (a != b).then_some((p, b, a))
        })
        .collect();
    let to_old = moved
        .iter()
        .filter(|(_, _, a)| a.as_str() != "n2p2")
        .count();
    assert!(
        moved.len() <= (PORTS as usize) / 2,
        "2 -> 3 backends moves about 1/3 of the flows with Maglev; {} of {PORTS} moved: {moved:?}",
        moved.len()
    );
    assert!(
        to_old <= 3,
        "flows that moved must go to the new backend, {to_old} went to an old one: {moved:?}"
    );
    assert!(
        !moved.is_empty(),
        "some flows must move to the new backend n2p2"
    );

    // TCP: a session whose flow still hashes to its backend goes on; one that now hashes
    // to the new backend is reset by it, never answered by another backend.
    let mut kept = 0;
    for (s, b) in &mut sessions {
        if let Ok(r) = s.ask("whoami", Duration::from_secs(3)) {
            let now = r.split_whitespace().next().unwrap_or("");
            assert_eq!(
                now,
                b.as_str(),
                "{}: an established TCP flow must never be answered by another backend",
                s.what
            );
            kept += 1;
        }
    }
    assert!(
        kept >= 6,
        "about 2/3 of 12 TCP sessions keep their backend through Maglev after the conntrack flush; {kept} did\n{}",
        c.diag(1)
    );
}

// ---------------------------------------------------------------------------------------
// 8. Agent restart.

/// One session from client 1 to `addr` (a NodePort of a Service over n1p1 and n2p1) per
/// backend: source ports from `first_port` on until both backends are covered (the
/// source port decides the backend).
fn sessions_to_both_backends(
    c: &Cluster,
    addr: &str,
    first_port: u16,
) -> BTreeMap<String, Session> {
    let mut sessions: BTreeMap<String, Session> = BTreeMap::new();
    for k in 0..40u16 {
        if sessions.len() == 2 {
            break;
        }
        let mut s = c.session_ext(1, addr, Some(first_port + k));
        let r = s
            .ask("whoami", Duration::from_secs(3))
            .unwrap_or_else(|e| panic!("{e}"));
        let b = r.split_whitespace().next().unwrap_or("").to_string();
        sessions.entry(b).or_insert(s);
    }
    assert_eq!(
        sessions.keys().cloned().collect::<BTreeSet<_>>(),
        set(&["n1p1", "n2p1"]),
        "sessions to both backends"
    );
    sessions
}

/// Every session still reaches the backend it started with.
fn check_sessions(sessions: &mut BTreeMap<String, Session>, when: &str) {
    for (b, s) in sessions.iter_mut() {
        let r = s
            .ask("whoami", Duration::from_secs(3))
            .unwrap_or_else(|e| panic!("{when}: {e}"));
        assert!(
            r.starts_with(&format!("{b} ")),
            "{when}: the session must still reach {b}: {r}"
        );
    }
}

#[test]
fn flows_survive_an_agent_restart() {
    let mut c = Cluster::new("ext-restart", &[1, 1], &[SRV]);
    c.write_manifest(
        "rs.yaml",
        &svc_doc(
            &c,
            "rs",
            "NodePort",
            "10.96.1.80",
            "",
            "",
            &["n1p1", "n2p1"],
        ),
    );
    c.start_agents(&[]);
    let addr = hostport(c.node(1).v4, NP_TCP);
    let mut sessions = sessions_to_both_backends(&c, &addr, 43000);
    check_sessions(&mut sessions, "before the restart");

    let status = c.stop_agent(1, libc::SIGKILL);
    assert!(!status.success(), "SIGKILL: {status:?}");
    check_sessions(&mut sessions, "agent killed");
    let outs = c.probe_ext(2, "tcp", &addr, 20);
    all_ok(&outs, "new connections while node1 has no agent");
    assert_eq!(backends(&outs), set(&["n1p1", "n2p1"]));
    let outs = c.probe_ext(2, "udp", &hostport(c.node(1).v4, NP_UDP), 10);
    all_ok(&outs, "new UDP flows while node1 has no agent");

    c.start_agent(1, &[]);
    check_sessions(&mut sessions, "after the new agent started");
    let outs = c.probe_ext(2, "tcp", &addr, 20);
    all_ok(&outs, "new connections after the restart");
    assert_eq!(backends(&outs), set(&["n1p1", "n2p1"]));
}

/// An agent that finds no flow port filter pinned (an upgrade from a build without it)
/// while conntrack holds flows of a frontend that is gone (the Service was deleted while
/// no agent ran) seeds the filter from those flows: their packets would otherwise pass
/// the tc programs untranslated.
#[test]
fn a_new_port_filter_keeps_the_ports_of_tracked_flows() {
    let mut c = Cluster::new("ext-seed", &[1, 1], &[SRV]);
    c.write_manifest(
        "sd.yaml",
        &svc_doc(
            &c,
            "sd",
            "NodePort",
            "10.96.1.81",
            "",
            "",
            &["n1p1", "n2p1"],
        ),
    );
    c.start_agents(&[]);
    let addr = hostport(c.node(1).v4, NP_TCP);
    // A local backend (its replies leave through egress) and a source-NATed one.
    let mut sessions = sessions_to_both_backends(&c, &addr, 44000);
    // `ferry explain` reads the pinned filter: the NodePort's port is in it.
    let bpffs = c.node(1).bpffs.to_string_lossy().into_owned();
    let ferry = bin("ferry").to_string_lossy().into_owned();
    let out = run_in(
        &c.node(1).netns,
        None,
        &ferry,
        &["explain", &addr, "--bpffs", &bpffs, "-o", "json"],
    );
    let json = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ferry explain {addr}: {json}");
    assert!(
        json.contains("\"port_in_filter\": true") && !json.contains("untranslated"),
        "the NodePort's port is in the filter: {json}"
    );

    let status = c.stop_agent(1, libc::SIGKILL);
    assert!(!status.success(), "SIGKILL: {status:?}");
    c.remove_manifest("sd.yaml");
    let pin = c.node(1).bpffs.join(ferry_common::ct::FLOW_PORTS_MAP);
    std::fs::remove_file(&pin).unwrap_or_else(|e| panic!("{}: {e}", pin.display()));
    c.start_agent(1, &[]);
    let log = c.agent_log(1);
    assert!(
        log.contains("flow port filter seeded from the tracked flows"),
        "the new agent seeds its filter:\n{log}"
    );
    check_sessions(&mut sessions, "after the restart with a new filter");
    // The frontend is gone: a new connection is not translated (nothing listens there).
    let outs = c.probe_ext(2, "tcp", &addr, 5);
    assert!(
        outs.iter().all(|o| !o.ok),
        "no new connection through the deleted NodePort: {outs:?}"
    );
}

// ---------------------------------------------------------------------------------------
// 9. Hairpin.

#[test]
fn a_pod_reaches_itself_through_its_service() {
    let mut c = Cluster::new("ext-hairpin", &[2, 1], &[SRV]);
    c.write_manifest(
        "hp.yaml",
        &svc_doc(&c, "hp", "NodePort", "10.96.1.90", "", "", &["n1p1"]),
    );
    c.start_agents(&[]);
    let me = c.pod("n1p1").v4.to_string();
    for (mode, addr) in [
        ("tcp", "10.96.1.90:80".to_string()),
        ("udp", "10.96.1.90:53".to_string()),
        ("tcp", hostport(c.node(1).v4, NP_TCP)),
        ("udp", hostport(c.node(1).v4, NP_UDP)),
    ] {
        let outs = c.probe_pod("n1p1", mode, &addr, 5);
        all_ok(&outs, &format!("n1p1 -> {addr} ({mode}), its own Service"));
        assert_eq!(backends(&outs), set(&["n1p1"]), "{addr}: the pod itself");
        assert_eq!(
            seen_set(&outs),
            BTreeSet::from([me.clone()]),
            "{addr}: the pod sees its own address"
        );
    }
    // Through the other node's NodePort: out to node2 and back, source-NATed by node2.
    for (mode, port) in [("tcp", NP_TCP), ("udp", NP_UDP)] {
        let addr = hostport(c.node(2).v4, port);
        let outs = c.probe_pod("n1p1", mode, &addr, 5);
        all_ok(
            &outs,
            &format!("n1p1 -> node2 NodePort {addr} ({mode})\n{}", c.diag(2)),
        );
        assert_eq!(backends(&outs), set(&["n1p1"]));
        assert_eq!(
            seen_set(&outs),
            BTreeSet::from([c.node(2).v4.to_string()]),
            "back through node2: node2's address"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Route reuse (ebpf/src/tc/fib.rs): a resolved route is reused for 10 ms per CPU.

#[test]
fn a_source_natted_flow_follows_a_neighbour_change() {
    let mut c = Cluster::new("ext-nb", &[1, 1], &[SRV]);
    c.write_manifest(
        "np.yaml",
        &svc_doc(&c, "np", "NodePort", "10.96.1.12", "", "", &["n2p1"]),
    );
    c.start_agents(&[]);
    // The route is remembered per CPU: the probes (children of this thread) send from
    // CPU 0 only, so that every packet of the flow meets the route remembered there.
    pin_to_cpu0();
    let target = hostport(c.node(1).v4, NP_UDP);
    let client_ns = c.client(1).netns.clone();
    // One flow: every datagram from the same source port, so that after the first the
    // packets take the known-flow path and its reused route.
    const SPORT: &str = "23456";
    let send = || -> Outcome {
        let outs = Cluster::probe_in(
            &client_ns,
            None,
            &["udp-ports", &target, SPORT, "1"],
            "whoami",
        );
        assert_eq!(outs.len(), 1, "one datagram per probe: {outs:?}");
        outs.into_iter().next().unwrap()
    };
    let answered = |o: &Outcome| o.ok && o.backend() == Some("n2p1");
    let answered_within = |what: &str, secs: u64| {
        eventually(what, Duration::from_secs(secs), || {
            let o = send();
            if answered(&o) {
                Ok(())
            } else {
                Err(format!("{o:?}\n{}", c.diag(1)))
            }
        })
    };
    answered_within("the flow to node1's NodePort is answered by n2p1", 10);
    // The first datagram was a new flow; these take the known-flow path, which
    // remembers the route.
    for _ in 0..3 {
        let o = send();
        assert!(answered(&o), "the flow keeps working: {o:?}\n{}", c.diag(1));
    }
    let flows = c.counter(1, "external_translated");

    // Node 2's MAC changes and node 1's neighbour table learns it: a route remembered
    // with the old MAC would send every later packet of the flow to nobody.
    let mac = "02:77:00:00:00:02";
    sh(&format!(
        "ip -n {n2} link set eth0 address {mac} && \
         ip -n {n1} neigh replace {ip} lladdr {mac} dev eth0 nud reachable",
        n1 = c.node(1).netns,
        n2 = c.node(2).netns,
        ip = c.node(2).v4,
    ));
    let t0 = Instant::now();
    answered_within("the flow reaches n2p1 at node 2's new MAC", 5);
    eprintln!("answered again after {:?}", t0.elapsed());
    assert_eq!(
        c.counter(1, "external_translated"),
        flows,
        "the datagrams after the change belong to the same flow (known-flow path)"
    );
}

/// Pins the calling thread (and so the processes it spawns) to CPU 0.
fn pin_to_cpu0() {
    // SAFETY: a zeroed cpu_set_t is the empty set; the calls only write into it and set
    // the calling thread's affinity.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0,
            "sched_setaffinity"
        );
    }
}
