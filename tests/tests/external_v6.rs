//! Traffic from outside the nodes (the tc path) over IPv6: NodePort across nodes with
//! source NAT, ICMPv6 port unreachable without endpoints, externalTrafficPolicy Local
//! keeping the client address. The cluster layout is in `cluster.rs`.

use std::{collections::BTreeSet, net::IpAddr, time::Instant};

use ferry_tests::*;

const NP_TCP: u16 = 30080;
const NP_UDP: u16 = 30053;
const SRV: u16 = 8080;

/// A dual-stack Service (`svc_type`, `extra`) with IPv4 and IPv6 slices over `pods`.
fn dual_doc(c: &Cluster, name: &str, n: u8, extra: &str, pods: &[&str]) -> String {
    let v4 = format!("10.96.2.{n}");
    let v6 = format!("fd00:96::2:{n}");
    let eps = |v6: bool| -> Vec<Ep> {
        pods.iter()
            .map(|p| {
                let p = c.pod(p);
                let node = &c.node(p.node).name;
                if v6 {
                    ep(p.v6).on(node)
                } else {
                    ep(p.v4).on(node)
                }
            })
            .collect()
    };
    let ports = [("tcp", SRV, "TCP"), ("udp", SRV, "UDP")];
    docs(&[
        external_service(
            name,
            "NodePort",
            &[&v6, &v4],
            &[("tcp", 80, "TCP", NP_TCP), ("udp", 53, "UDP", NP_UDP)],
            &format!("  ipFamilyPolicy: PreferDualStack\n  ipFamilies: [IPv6, IPv4]\n{extra}"),
            "",
        ),
        slice(name, &format!("{name}-v6"), "IPv6", &ports, &eps(true)),
        slice(name, &format!("{name}-v4"), "IPv4", &ports, &eps(false)),
    ])
}

fn v6(ip: impl Into<IpAddr>) -> IpAddr {
    ip.into()
}

#[test]
fn nodeport_v6_crosses_nodes_with_snat() {
    let mut c = Cluster::new("ext6-np", &[1, 2], &[SRV]);
    c.write_manifest("np6.yaml", &dual_doc(&c, "np6", 10, "", &["n2p1", "n2p2"]));
    c.start_agents(&[]);
    let node1 = v6(c.node(1).v6);
    let tcp = c.probe_ext(1, "tcp", &hostport(node1, NP_TCP), 30);
    all_ok(&tcp, &format!("TCP to [node1]:NodePort\n{}", c.diag(1)));
    assert_eq!(
        backends(&tcp),
        set(&["n2p1", "n2p2"]),
        "spread over node2's pods"
    );
    for o in &tcp {
        assert_eq!(o.peer.as_deref(), Some(hostport(node1, NP_TCP).as_str()));
    }
    assert_eq!(
        seen_set(&tcp),
        BTreeSet::from([c.node(1).v6.to_string()]),
        "the backend on node2 must see node1's IPv6 address (SNAT)"
    );
    let udp = c.probe_ext(1, "udp", &hostport(node1, NP_UDP), 30);
    all_ok(&udp, &format!("UDP to [node1]:NodePort\n{}", c.diag(1)));
    assert_eq!(backends(&udp), set(&["n2p1", "n2p2"]));
    for o in &udp {
        assert_eq!(
            o.from.as_deref(),
            Some(hostport(node1, NP_UDP).as_str()),
            "the reply must come from the NodePort: {o:?}"
        );
    }
    assert_eq!(seen_set(&udp), BTreeSet::from([c.node(1).v6.to_string()]));
    // The IPv4 NodePort of the same dual-stack Service works too.
    let tcp4 = c.probe_ext(1, "tcp", &hostport(c.node(1).v4, NP_TCP), 10);
    all_ok(&tcp4, "the IPv4 side of the dual-stack NodePort");
}

#[test]
fn nodeport_v6_without_endpoints_is_refused_with_icmpv6() {
    let mut c = Cluster::new("ext6-refuse", &[1, 1], &[SRV]);
    c.write_manifest("none6.yaml", &dual_doc(&c, "none6", 40, "", &[]));
    c.start_agents(&[]);
    let node1 = v6(c.node(1).v6);
    let before = c.counter(1, "external_icmp_unreachable");
    let url = format!("http://{}/", hostport(node1, NP_TCP));
    for _ in 0..3 {
        let t = Instant::now();
        let out = c.run_ext(1, "curl", &["-sS", "-g", "--max-time", "3", &url]);
        let ms = t.elapsed().as_millis();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(7),
            "curl to an IPv6 NodePort without endpoints must be refused (exit 7): {err}"
        );
        // The client kernel drops an ICMPv6 error that arrives while connect() holds the
        // socket lock (DESIGN.md §2), so the refusal may land on the first SYN retry
        // (1 s); a client that timed out would take the whole 3 s.
        assert!(
            ms < 2500,
            "the refusal must come with the first SYN or its first retry, took {ms} ms"
        );
    }
    for o in c.probe_ext(1, "udp-connected", &hostport(node1, NP_UDP), 3) {
        assert_eq!(
            o.errno,
            Some(ECONNREFUSED),
            "UDP over IPv6 without endpoints: expected ECONNREFUSED (ICMPv6 port unreachable), saw {o:?}"
        );
        assert!(o.ms < 1000, "immediate: {o:?}");
    }
    c.expect_counter(
        1,
        "external_icmp_unreachable",
        before + 6,
        "node1 sent 6 ICMPv6 port unreachable",
    );
}

#[test]
fn nodeport_v6_local_policy_keeps_client_address() {
    let mut c = Cluster::new("ext6-local", &[2, 1], &[SRV]);
    c.write_manifest(
        "loc6.yaml",
        &dual_doc(
            &c,
            "loc6",
            20,
            "  externalTrafficPolicy: Local\n",
            &["n1p1", "n1p2"],
        ),
    );
    c.start_agents(&[]);
    for (mode, port) in [("tcp", NP_TCP), ("udp", NP_UDP)] {
        let outs = c.probe_ext(2, mode, &hostport(c.node(1).v6, port), 30);
        all_ok(&outs, &format!("{mode} via node1 over IPv6\n{}", c.diag(1)));
        assert_eq!(backends(&outs), set(&["n1p1", "n1p2"]));
        assert_eq!(
            seen_set(&outs),
            BTreeSet::from([c.client(2).v6.to_string()]),
            "eTP Local over IPv6: the backend must see the client's address"
        );
    }
    let drops = c.counter(2, "dropped_no_local_endpoints");
    for o in c.probe_ext(1, "tcp", &hostport(c.node(2).v6, NP_TCP), 2) {
        assert!(
            !o.ok && o.errno != Some(ECONNREFUSED),
            "node2 has no local endpoint: the SYN must be dropped, not refused: {o:?}"
        );
        assert!(o.ms >= 1500, "a drop shows as a timeout: {o:?}");
    }
    c.expect_counter(
        2,
        "dropped_no_local_endpoints",
        drops + 2,
        "node2 counts the drops",
    );
    let outs = c.probe_pod("n2p1", "tcp", &hostport(c.node(2).v6, NP_TCP), 20);
    all_ok(&outs, "a pod on node2 through its node's IPv6 NodePort");
    assert_eq!(backends(&outs), set(&["n1p1", "n1p2"]));
}
