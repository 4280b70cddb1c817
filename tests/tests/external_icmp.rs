//! ICMP errors on the tc path (issue 16): path-MTU discovery through a NodePort, and a
//! backend's port unreachable reaching the client, IPv4 and IPv6, with and without
//! source NAT. The cluster layout is in `cluster.rs`: node1 and node2 on one LAN, the
//! endpoints on node2, so a flow through node1's NodePort is source-NATed to node1 and
//! a flow through node2's NodePort reaches a local endpoint with the client's address.
//!
//! Path MTU, three ways a client learns it (each checked in the client's route cache):
//! 1. a router behind ferry: node2's routes to its pods have MTU 1400; node2 sends its
//!    error to node1's source-NAT address, quoting the translated packet; ferry on node1
//!    translates it back and forwards it to the client.
//! 2. the endpoint's own node: through node2's NodePort (no source NAT), node2's kernel
//!    sends the error to the client quoting the packet to the pod; ferry's egress
//!    program translates it back to the NodePort.
//! 3. ferry's own forwarding: node1's route to node2's pods gets MTU 1300 (locked), the client
//!    sends larger segments; ferry answers with "fragmentation needed" / "packet too
//!    big" 1300 (what the kernel's forwarding would send).
//! 4. the same for replies: node1's route to a client gets MTU 1300 (locked); ferry
//!    answers the backend, which learns the path MTU towards node1's source-NAT address.
//!
//! Before this change (the tc path of commit 9660fab, run with this file): the first
//! large transfer (case 1) never completed, IPv4 and IPv6 ("no reply within 15s": node2's
//! error was swallowed by node1's own stack, TCP retransmitted full-size segments), and
//! the connected UDP probe through node1 timed out (EAGAIN after 2 s) instead of being
//! refused. After: every transfer completes within milliseconds and the client's route
//! cache shows the MTU of the hop that was too small.

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use ferry_tests::*;

const NP_TCP: u16 = 30080;
const NP_UDP_CLOSED: u16 = 30054;
const SRV: u16 = 8080;
/// A port no pod listens on: the pod's kernel answers with port unreachable.
const CLOSED: u16 = 9999;

/// A dual-stack NodePort Service: TCP 80 -> the pods' SRV, UDP 54 -> CLOSED.
fn dual_doc(c: &Cluster, pods: &[&str]) -> String {
    let eps = |v6: bool| -> Vec<Ep> {
        pods.iter()
            .map(|p| {
                let p = c.pod(p);
                let node = &c.node(p.node).name;
                if v6 { ep(p.v6) } else { ep(p.v4) }.on(node)
            })
            .collect()
    };
    let ports = [("tcp", SRV, "TCP"), ("udp", CLOSED, "UDP")];
    docs(&[
        external_service(
            "icmp",
            "NodePort",
            &["fd00:96::3:1", "10.96.3.1"],
            &[
                ("tcp", 80, "TCP", NP_TCP),
                ("udp", 54, "UDP", NP_UDP_CLOSED),
            ],
            "  ipFamilyPolicy: PreferDualStack\n  ipFamilies: [IPv6, IPv4]\n",
            "",
        ),
        slice("icmp", "icmp-v6", "IPv6", &ports, &eps(true)),
        slice("icmp", "icmp-v4", "IPv4", &ports, &eps(false)),
    ])
}

/// Node `n`'s address of the family.
fn node_addr(c: &Cluster, n: usize, v6: bool) -> IpAddr {
    if v6 {
        c.node(n).v6.into()
    } else {
        c.node(n).v4.into()
    }
}

/// Sends one 20 kB line over a new TCP session from client `i` to `addr` and waits for
/// its echo: the transfer completes only if the client learns the path MTU.
fn big_transfer(c: &Cluster, i: usize, addr: &str, what: &str, diag: usize) {
    let line = "x".repeat(20_000);
    let mut s = c.session_ext(i, addr, None);
    let t = Instant::now();
    let reply = s.ask(&line, Duration::from_secs(15)).unwrap_or_else(|e| {
        panic!(
            "{what}: the large transfer did not complete: {e}\n{}",
            c.diag(diag)
        )
    });
    let (name, echo) = reply.split_once(' ').unwrap_or_default();
    assert!(
        name.starts_with("n2p") && echo == line,
        "{what}: expected `n2pX <the 20000-byte line>`, got {} bytes starting {:?}",
        reply.len(),
        &reply[..reply.len().min(40)]
    );
    eprintln!("{what}: 20 kB echoed in {:?}", t.elapsed());
}

/// The path MTU the namespace `netns` has learned towards `to` (its route cache), if any.
fn learned_mtu(netns: &str, to: IpAddr) -> Option<u32> {
    let fam = if to.is_ipv6() { "-6" } else { "-4" };
    let out = sh(&format!("ip -n {netns} {fam} route get {to}"));
    let mut words = out.split_whitespace();
    while let Some(w) = words.next() {
        if w == "mtu" {
            return words.next().and_then(|v| v.parse().ok());
        }
    }
    None
}

fn expect_mtu(c: &Cluster, i: usize, to: IpAddr, want: u32, what: &str) {
    let got = learned_mtu(&c.client(i).netns, to);
    assert_eq!(
        got,
        Some(want),
        "{what}: client{i} must have learned path MTU {want} towards {to}; route cache says {got:?}"
    );
}

fn pmtu(family_v6: bool) {
    let tag = if family_v6 {
        "icmp6-pmtu"
    } else {
        "icmp4-pmtu"
    };
    let mut c = Cluster::new(tag, &[0, 2], &[SRV]);
    c.write_manifest("icmp.yaml", &dual_doc(&c, &["n2p1", "n2p2"]));
    c.start_agents(&[]);
    let (n1, n2) = (c.node(1).netns.clone(), c.node(2).netns.clone());
    let node1 = node_addr(&c, 1, family_v6);
    let node2 = node_addr(&c, 2, family_v6);
    let fam = if family_v6 { "-6" } else { "-4" };

    // 1. A router behind ferry: node2's routes to its pods have MTU 1400.
    for name in ["n2p1", "n2p2"] {
        let p = c.pod(name);
        let addr = if family_v6 {
            format!("{}/128", p.v6)
        } else {
            format!("{}/32", p.v4)
        };
        let dev = &name[2..];
        sh(&format!(
            "ip -n {n2} {fam} route replace {addr} dev {dev} mtu 1400"
        ));
    }
    big_transfer(
        &c,
        2,
        &hostport(node1, NP_TCP),
        "client2 via node1 (node2's error to node1's SNAT address, translated)",
        1,
    );
    expect_mtu(
        &c,
        2,
        node1,
        1400,
        "node2's error translated by node1's ingress",
    );

    // 2. Through node2's NodePort: the endpoint is local, no source NAT; node2's own
    // forwarding sends the error, node2's egress program translates it.
    big_transfer(
        &c,
        1,
        &hostport(node2, NP_TCP),
        "client1 via node2 (local endpoint, error from node2's forwarding)",
        2,
    );
    expect_mtu(&c, 1, node2, 1400, "node2's own error translated on egress");

    // 3. ferry forwards to node2 itself; its route there now has MTU 1300.
    let (pods, via) = if family_v6 {
        ("fd00:201:2::/64", c.node(2).v6.to_string())
    } else {
        ("10.201.2.0/24", c.node(2).v4.to_string())
    };
    // `lock`: bpf_fib_lookup reports a route's MTU only when it is locked (or learned).
    sh(&format!(
        "ip -n {n1} {fam} route replace {pods} via {via} mtu lock 1300"
    ));
    big_transfer(
        &c,
        1,
        &hostport(node1, NP_TCP),
        "client1 via node1 (ferry's own route MTU 1300)",
        1,
    );
    expect_mtu(&c, 1, node1, 1300, "ferry's own too-big error");

    // 4. The reply direction: node1's route to client2 gets MTU 1300 (locked). client2
    // advertised an MSS for 1400, so the backend's reply segments are too big for it;
    // ferry answers the backend (quoting the reply as it arrived, to node1's source-NAT
    // address), the backend lowers its segments, the echo completes. (Before, ferry's
    // reply path ignored the route's MTU: the echo completed at the device MTU and the
    // backend learned nothing; the route cache check below failed.)
    let client2 = if family_v6 {
        c.client(2).v6.to_string()
    } else {
        c.client(2).v4.to_string()
    };
    sh(&format!(
        "ip -n {n1} {fam} route replace {client2} dev eth0 mtu lock 1300"
    ));
    big_transfer(
        &c,
        2,
        &hostport(node1, NP_TCP),
        "client2 via node1 (replies too big for node1's route to client2)",
        1,
    );
    let learned: Vec<Option<u32>> = ["n2p1", "n2p2"]
        .iter()
        .map(|p| learned_mtu(&c.pod(p).netns, node1))
        .collect();
    assert!(
        learned.contains(&Some(1300)),
        "the backend must have learned path MTU 1300 towards node1 from ferry's error; n2p1, n2p2 route caches: {learned:?}"
    );
}

#[test]
fn path_mtu_discovery_through_nodeport_v4() {
    pmtu(false);
}

#[test]
fn path_mtu_discovery_through_nodeport_v6() {
    pmtu(true);
}

/// A UDP datagram to a port the backend does not serve: the backend's port unreachable
/// reaches the client as ECONNREFUSED on its connected socket, through node1 (source
/// NAT, ingress translation) and node2 (local endpoint, egress translation).
#[test]
fn backend_port_unreachable_refuses_the_client() {
    let mut c = Cluster::new("icmp-refuse", &[0, 1], &[SRV]);
    c.write_manifest("icmp.yaml", &dual_doc(&c, &["n2p1"]));
    c.start_agents(&[]);
    for v6 in [false, true] {
        for n in [1, 2] {
            let addr = hostport(node_addr(&c, n, v6), NP_UDP_CLOSED);
            let outs = c.probe_ext(1, "udp-connected", &addr, 3);
            for o in &outs {
                assert_eq!(
                    o.errno,
                    Some(ECONNREFUSED),
                    "connected UDP to {addr} (backend n2p1 has no socket on {CLOSED}) must be refused, saw {o:?}\n{}",
                    c.diag(n)
                );
                assert!(
                    o.ms < 1500,
                    "the refusal must come at once, not after a timeout: {o:?}"
                );
            }
        }
    }
    // The TCP port of the same Service still works through both nodes.
    for v6 in [false, true] {
        for n in [1, 2] {
            let outs = c.probe_ext(1, "tcp", &hostport(node_addr(&c, n, v6), NP_TCP), 3);
            all_ok(&outs, &format!("TCP via node{n}"));
        }
    }
}
