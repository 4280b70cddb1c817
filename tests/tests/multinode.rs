//! What the upstream `[sig-network] Services`, `Networking` and `Conntrack` e2e specs check
//! across nodes, in the two-node netns cluster (`cluster.rs`): pods and hostNetwork
//! clients of one node reaching another node's NodePort and the ClusterIP, externalIPs
//! assigned to no node, hostNetwork endpoints, terminating endpoints on another node,
//! internalTrafficPolicy Local, and a UDP flow from a fixed source port across backend
//! changes. Every test names the spec(s) it mirrors (numbers are those of the tables in
//! section 3 of the kube-proxy contract notes).
//!
//! Clients: `pod nNpJ` runs in the pod's namespace inside node N's agent cgroup (the
//! socket hooks of node N apply, as to any pod of that node); `host nodeN` runs in node
//! N's own namespace inside the same cgroup (a hostNetwork pod); `clientI` is an external
//! machine on the LAN (no socket hooks: the tc path of the node it dials).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Duration,
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

/// The endpoint of pod `name`, in family `v6`, on its node.
fn pod_ep(c: &Cluster, name: &str, v6: bool) -> Ep {
    let p = c.pod(name);
    let node = &c.node(p.node).name;
    if v6 {
        ep(p.v6).on(node)
    } else {
        ep(p.v4).on(node)
    }
}

/// A hostNetwork endpoint: node `n`'s own address.
fn host_ep(c: &Cluster, n: usize, v6: bool) -> Ep {
    let node = c.node(n);
    if v6 {
        ep(node.v6).on(&node.name)
    } else {
        ep(node.v4).on(&node.name)
    }
}

/// What `publishNotReadyAddresses: true` makes the EndpointSlice controller publish for
/// a terminating pod: ready (forced), serving, terminating.
fn published_terminating(e: Ep) -> Ep {
    Ep {
        ready: true,
        ..e.terminating(true)
    }
}

/// Service `name` of `svc_type` (ClusterIP, or NodePort with [`np_ports`]) with
/// `cluster_ips` (two: dual-stack, IPv4 first), `extra` under `spec:`, and one slice per
/// family of the ClusterIPs.
fn svc_docs(
    name: &str,
    svc_type: &str,
    cluster_ips: &[&str],
    extra: &str,
    v4: &[Ep],
    v6: &[Ep],
) -> String {
    let dual = cluster_ips.len() > 1;
    let mut extra = extra.to_string();
    if dual {
        let fams: Vec<&str> = cluster_ips
            .iter()
            .map(|ip| if ip.contains(':') { "IPv6" } else { "IPv4" })
            .collect();
        extra = format!(
            "  ipFamilyPolicy: PreferDualStack\n  ipFamilies: [{}]\n{extra}",
            fams.join(", ")
        );
    }
    let svc = if svc_type == "ClusterIP" {
        service(
            name,
            cluster_ips,
            &[("tcp", 80, "TCP"), ("udp", 53, "UDP")],
            &extra,
        )
    } else {
        external_service(name, svc_type, cluster_ips, &np_ports(), &extra, "")
    };
    let mut parts = vec![svc];
    if cluster_ips.iter().any(|ip| !ip.contains(':')) {
        parts.push(slice(
            name,
            &format!("{name}-v4"),
            "IPv4",
            &target_ports(),
            v4,
        ));
    }
    if cluster_ips.iter().any(|ip| ip.contains(':')) {
        parts.push(slice(
            name,
            &format!("{name}-v6"),
            "IPv6",
            &target_ports(),
            v6,
        ));
    }
    docs(&parts)
}

/// Who sends.
#[derive(Clone, Copy, Debug)]
enum Client<'a> {
    /// A pod, inside its node's agent cgroup.
    Pod(&'a str),
    /// A hostNetwork client: node N's namespace, inside its agent cgroup.
    Host(usize),
    /// External client I.
    Ext(usize),
}

impl Client<'_> {
    fn label(&self) -> String {
        match self {
            Client::Pod(p) => format!("pod {p}"),
            Client::Host(n) => format!("host node{n}"),
            Client::Ext(i) => format!("client{i}"),
        }
    }

    /// The client's own address in the family of `v6` (what a backend sees without NAT).
    fn addr(&self, c: &Cluster, v6: bool) -> IpAddr {
        match *self {
            Client::Pod(p) => {
                let p = c.pod(p);
                if v6 { p.v6.into() } else { p.v4.into() }
            }
            Client::Host(n) => {
                if v6 {
                    c.node(n).v6.into()
                } else {
                    c.node(n).v4.into()
                }
            }
            Client::Ext(i) => {
                if v6 {
                    c.client(i).v6.into()
                } else {
                    c.client(i).v4.into()
                }
            }
        }
    }
}

fn probe(c: &Cluster, from: Client, mode: &str, addr: &str, count: usize) -> Vec<Outcome> {
    match from {
        Client::Pod(p) => c.probe_pod(p, mode, addr, count),
        Client::Host(n) => c.probe_node(n, mode, addr, count),
        Client::Ext(i) => c.probe_ext(i, mode, addr, count),
    }
}

/// `count` attempts of `mode` (tcp, udp) from `from` to `addr`: every one must get its
/// reply, the replies must come from exactly the backends `want`, and the client must
/// see `addr` as its peer (TCP getpeername, UDP reply source). `diag` names the node
/// whose counters and log explain a failure.
fn expect_reach(
    c: &Cluster,
    from: Client,
    mode: &str,
    addr: &str,
    count: usize,
    want: &[&str],
    diag: usize,
) -> Vec<Outcome> {
    let what = format!("{} -> {addr} ({mode})", from.label());
    let outs = probe(c, from, mode, addr, count);
    all_ok(
        &outs,
        &format!(
            "{what}: expected every attempt answered by {want:?}\n{}",
            c.diag(diag)
        ),
    );
    assert_eq!(
        backends(&outs),
        set(want),
        "{what}: {count} attempts must reach exactly {want:?}\n{}",
        c.diag(diag)
    );
    for o in &outs {
        let shown = if mode == "tcp" { &o.peer } else { &o.from };
        assert_eq!(
            shown.as_deref(),
            Some(addr),
            "{what}: the client must see the address it dialled as its peer: {o:?}"
        );
    }
    outs
}

/// Backend -> the client addresses it saw.
fn seen_by(outs: &[Outcome]) -> BTreeMap<String, BTreeSet<IpAddr>> {
    let mut m: BTreeMap<String, BTreeSet<IpAddr>> = BTreeMap::new();
    for o in outs {
        if let (Some(b), Some(a)) = (o.backend(), seen(o)) {
            m.entry(b.to_string()).or_default().insert(a);
        }
    }
    m
}

/// Every attempt must fail with ECONNREFUSED at once (REJECT semantics).
fn expect_refused(c: &Cluster, from: Client, mode: &str, addr: &str, count: usize, diag: usize) {
    for o in probe(c, from, mode, addr, count) {
        assert!(
            !o.ok && o.errno == Some(ECONNREFUSED),
            "{} -> {addr} ({mode}): expected an immediate refusal (ECONNREFUSED), saw {o:?}\n{}",
            from.label(),
            c.diag(diag)
        );
        assert!(
            o.ms < 1000,
            "{} -> {addr} ({mode}): the refusal must be immediate: {o:?}",
            from.label()
        );
    }
}

/// An error that is a timeout (the packets were dropped), not a refusal or reset.
fn timed_out(o: &Outcome) -> bool {
    !o.ok
        && (matches!(o.errno, None | Some(11) | Some(110)))
        && o.error
            .as_deref()
            .is_some_and(|e| e.contains("timed out") || e.contains("temporarily unavailable"))
}

/// internalTrafficPolicy Local without a local endpoint: the socket hooks fail the
/// connect / sendto at once with EHOSTUNREACH (ferry's equivalent of kube-proxy's DROP,
/// see `policy.rs`); no backend of another node may answer.
fn expect_no_local(c: &Cluster, from: Client, mode: &str, addr: &str, count: usize, diag: usize) {
    for o in probe(c, from, mode, addr, count) {
        assert!(
            !o.ok && o.reply.is_none(),
            "{} -> {addr} ({mode}): internalTrafficPolicy Local and no endpoint on the client's node: \
             the attempt must fail, saw {o:?}\n{}",
            from.label(),
            c.diag(diag)
        );
        assert_eq!(
            o.errno,
            Some(EHOSTUNREACH),
            "{} -> {addr} ({mode}): expected EHOSTUNREACH (no local endpoint), saw {o:?}",
            from.label()
        );
    }
}

/// Node `n` answers its pods from its LAN addresses, as with CNIs whose pod veths carry
/// no address: a hostNetwork UDP server bound to the wildcard address replies to a pod of
/// its node from the address the kernel selects for the pod's route, and the harness's
/// pod routes otherwise select the pods' gateway address (10.201.N.1), which is not the
/// endpoint address the client's socket expects the reply from (neither ferry's reverse
/// translation nor kube-proxy's conntrack would match it).
fn answer_pods_from_node_address(c: &Cluster, n: usize) {
    let node = c.node(n);
    for p in c.pods.iter().filter(|p| p.node == n) {
        // Pod `nNpJ` hangs off the node's `pJ`.
        let dev = format!("p{}", p.name.rsplit_once('p').unwrap().1);
        sh(&format!(
            "ip -n {ns} route replace {v4}/32 dev {dev} src {n4} && \
             ip -n {ns} -6 route replace {v6}/128 dev {dev} src {n6}",
            ns = node.netns,
            v4 = p.v4,
            v6 = p.v6,
            n4 = node.v4,
            n6 = node.v6,
        ));
    }
}

fn v4(a: std::net::Ipv4Addr) -> IpAddr {
    a.into()
}
fn v6(a: std::net::Ipv6Addr) -> IpAddr {
    a.into()
}

// ---------------------------------------------------------------------------------------
// 1. NodePort and ClusterIP from pods and hostNetwork clients of another node.

/// Services #11 "should be able to create a functioning NodePort service" and Networking
/// "Granular Checks: Services should function for pod-Service: http", "… pod-Service:
/// udp", "… node-Service: http", "… node-Service: udp": a pod of node 1 and a hostNetwork
/// client of node 1 reach node 2's NodePort and the ClusterIP, TCP and UDP, IPv4 and IPv6
/// (dual-stack Service), with endpoints on both nodes. The backends see the pod's own
/// address through the ClusterIP (Services #5); through node 2's NodePort the node-2
/// endpoint sees the client and the node-1 endpoint sees node 2 (source NAT).
#[test]
fn pods_and_hosts_reach_another_nodes_nodeport_and_the_cluster_ip() {
    let mut c = Cluster::new("mn-np", &[2, 1], &[SRV]);
    let eps = ["n1p2", "n2p1"];
    let v4_eps: Vec<Ep> = eps.iter().map(|p| pod_ep(&c, p, false)).collect();
    let v6_eps: Vec<Ep> = eps.iter().map(|p| pod_ep(&c, p, true)).collect();
    c.write_manifest(
        "np.yaml",
        &svc_docs(
            "np",
            "NodePort",
            &["10.96.3.10", "fd00:96::3:10"],
            "",
            &v4_eps,
            &v6_eps,
        ),
    );
    c.start_agents(&[]);
    for is_v6 in [false, true] {
        let (node2, cip): (IpAddr, IpAddr) = if is_v6 {
            (v6(c.node(2).v6), "fd00:96::3:10".parse().unwrap())
        } else {
            (v4(c.node(2).v4), "10.96.3.10".parse().unwrap())
        };
        for from in [Client::Pod("n1p1"), Client::Host(1)] {
            let me = from.addr(&c, is_v6);
            // Node 2's NodePort (the tc path of node 2).
            for (mode, port) in [("tcp", NP_TCP), ("udp", NP_UDP)] {
                let outs = expect_reach(
                    &c,
                    from,
                    mode,
                    &hostport(node2, port),
                    20,
                    &["n1p2", "n2p1"],
                    2,
                );
                let seen = seen_by(&outs);
                assert_eq!(
                    seen.get("n2p1"),
                    Some(&BTreeSet::from([me])),
                    "{} -> node2's NodePort ({mode}): the endpoint on node2 must see the client's own address {me}: {outs:?}",
                    from.label()
                );
                assert_eq!(
                    seen.get("n1p2"),
                    Some(&BTreeSet::from([node2])),
                    "{} -> node2's NodePort ({mode}): the endpoint on node1 must see node2's address {node2} (eTP Cluster SNAT): {outs:?}",
                    from.label()
                );
            }
            // The ClusterIP (node 1's socket hooks).
            for (mode, port) in [("tcp", 80), ("udp", 53)] {
                let outs = expect_reach(
                    &c,
                    from,
                    mode,
                    &hostport(cip, port),
                    20,
                    &["n1p2", "n2p1"],
                    1,
                );
                if let Client::Pod(_) = from {
                    assert_eq!(
                        seen_set(&outs),
                        BTreeSet::from([me.to_string()]),
                        "pod -> ClusterIP ({mode}): the backends must see the pod's own address (no SNAT)"
                    );
                }
            }
        }
    }
}

/// A pod that reuses its source port, first towards node 2's NodePort (translated by
/// node 2's tc; the endpoint is local to node 2, so no source NAT), then towards the
/// ClusterIP (translated at the pod's socket, straight to the same endpoint), then the
/// NodePort again. At node 2 both flows have the same reply packets; each new flow must
/// get its replies from the address it dialled (CI once saw a ClusterIP reply come back
/// from the NodePort when two random ports collided). UDP in both families, then TCP.
#[test]
fn a_source_port_reused_from_a_nodeport_to_the_cluster_ip_gets_replies_from_what_it_dialled() {
    let mut c = Cluster::new("mn-reuse", &[1, 1], &[SRV]);
    let v4_eps = vec![pod_ep(&c, "n2p1", false)];
    let v6_eps = vec![pod_ep(&c, "n2p1", true)];
    c.write_manifest(
        "np.yaml",
        &svc_docs(
            "np",
            "NodePort",
            &["10.96.3.20", "fd00:96::3:20"],
            "",
            &v4_eps,
            &v6_eps,
        ),
    );
    c.start_agents(&[]);
    let client = c.pod("n1p1");
    let (ns, cg) = (client.netns.clone(), c.node(1).cgroup.clone());
    for (is_v6, sport) in [(false, "12346"), (true, "12347")] {
        let (node2, cip): (IpAddr, IpAddr) = if is_v6 {
            (v6(c.node(2).v6), "fd00:96::3:20".parse().unwrap())
        } else {
            (v4(c.node(2).v4), "10.96.3.20".parse().unwrap())
        };
        let me = if is_v6 {
            format!("[{}]:{sport}", client.v6)
        } else {
            format!("{}:{sport}", client.v4)
        };
        for target in [
            hostport(node2, NP_UDP),
            hostport(cip, 53),
            hostport(node2, NP_UDP),
        ] {
            // A connected socket: a reply from any other source never reaches it.
            let outs = Cluster::probe_in(
                &ns,
                Some(&cg),
                &["udp-ports", &target, sport, "1"],
                "whoami",
            );
            assert!(
                outs.len() == 1
                    && outs[0].ok
                    && outs[0].from.as_deref() == Some(me.as_str())
                    && outs[0].reply.as_deref() == Some(format!("n2p1 {me}").as_str()),
                "UDP {me} -> {target}: n2p1 must answer the datagram from the address dialled, \
                 seeing the pod's own address: {outs:?}\n{}",
                c.diag(2)
            );
        }
    }
    let node2 = v4(c.node(2).v4);
    for (target, sport) in [
        (hostport(node2, NP_TCP), 12348),
        (hostport(v4("10.96.3.20".parse().unwrap()), 80), 12348),
    ] {
        let mut session = Session::start(&ns, Some(&cg), &target, Some(sport));
        let reply = session.ask("whoami", Duration::from_secs(5));
        assert!(
            reply.as_deref().is_ok_and(|r| r.starts_with("n2p1 ")),
            "TCP from port {sport} -> {target}: n2p1 must answer: {reply:?}\n{}",
            c.diag(2)
        );
    }
}

// ---------------------------------------------------------------------------------------
// 2. externalIPs assigned to no node.

/// Services #12 "should be possible to connect to a service via ExternalIP when the
/// external IP is not assigned to a node": the externalIPs 203.0.113.250 and
/// 2001:db8::cb00:71fa (upstream's addresses; no node has them, no route leads to them)
/// reach the only endpoint, on node 2, from a pod and a hostNetwork client of node 1.
#[test]
fn external_ip_not_assigned_to_a_node_is_reachable_from_pods_and_hosts() {
    let mut c = Cluster::new("mn-eip", &[1, 1], &[SRV]);
    let (eip4, eip6) = ("203.0.113.250", "2001:db8::cb00:71fa");
    let v4_eps = [pod_ep(&c, "n2p1", false)];
    let v6_eps = [pod_ep(&c, "n2p1", true)];
    c.write_manifest(
        "eip.yaml",
        &svc_docs(
            "eip",
            "ClusterIP",
            &["10.96.3.20", "fd00:96::3:20"],
            &format!("  externalIPs: [\"{eip4}\", \"{eip6}\"]\n"),
            &v4_eps,
            &v6_eps,
        ),
    );
    c.start_agents(&[]);
    for eip in [eip4, eip6] {
        let eip: IpAddr = eip.parse().unwrap();
        for from in [Client::Pod("n1p1"), Client::Host(1)] {
            expect_reach(&c, from, "tcp", &hostport(eip, 80), 10, &["n2p1"], 1);
            expect_reach(&c, from, "udp", &hostport(eip, 53), 10, &["n2p1"], 1);
        }
    }
}

// ---------------------------------------------------------------------------------------
// 3. hostNetwork endpoints.

/// Networking "Granular Checks: Services should function for service endpoints using
/// hostNetwork": the endpoints are the nodes' own addresses (servers in the node
/// namespaces, `host1` and `host2`). Pod -> ClusterIP, host -> ClusterIP, a pod of node
/// 1 -> node 2's NodePort and an external client -> node 1's NodePort reach the
/// hostNetwork endpoints of both nodes, TCP and UDP, IPv4 and IPv6.
#[test]
fn host_network_endpoints_serve_every_kind_of_client() {
    let mut c = Cluster::new("mn-hostnet", &[1, 1], &[SRV]);
    c.serve_on_node(1, "host1", &[SRV]);
    c.serve_on_node(2, "host2", &[SRV]);
    answer_pods_from_node_address(&c, 1);
    answer_pods_from_node_address(&c, 2);
    let v4_eps = [host_ep(&c, 1, false), host_ep(&c, 2, false)];
    let v6_eps = [host_ep(&c, 1, true), host_ep(&c, 2, true)];
    c.write_manifest(
        "hn.yaml",
        &svc_docs(
            "hn",
            "NodePort",
            &["10.96.3.30", "fd00:96::3:30"],
            "",
            &v4_eps,
            &v6_eps,
        ),
    );
    c.start_agents(&[]);
    let both = ["host1", "host2"];
    for is_v6 in [false, true] {
        let ip = |a: std::net::Ipv4Addr, b: std::net::Ipv6Addr| -> IpAddr {
            if is_v6 { b.into() } else { a.into() }
        };
        let cip: IpAddr = if is_v6 {
            "fd00:96::3:30".parse().unwrap()
        } else {
            "10.96.3.30".parse().unwrap()
        };
        let node1 = ip(c.node(1).v4, c.node(1).v6);
        let node2 = ip(c.node(2).v4, c.node(2).v6);
        for (mode, cport, nport) in [("tcp", 80, NP_TCP), ("udp", 53, NP_UDP)] {
            expect_reach(
                &c,
                Client::Pod("n1p1"),
                mode,
                &hostport(cip, cport),
                20,
                &both,
                1,
            );
            expect_reach(
                &c,
                Client::Host(1),
                mode,
                &hostport(cip, cport),
                20,
                &both,
                1,
            );
            expect_reach(
                &c,
                Client::Pod("n1p1"),
                mode,
                &hostport(node2, nport),
                20,
                &both,
                2,
            );
            let outs = expect_reach(
                &c,
                Client::Ext(1),
                mode,
                &hostport(node1, nport),
                20,
                &both,
                1,
            );
            let seen = seen_by(&outs);
            let client = Client::Ext(1).addr(&c, is_v6);
            assert_eq!(
                seen.get("host1"),
                Some(&BTreeSet::from([client])),
                "client1 -> node1's NodePort ({mode}): node1's own hostNetwork endpoint must see the client {client}: {outs:?}"
            );
            assert_eq!(
                seen.get("host2"),
                Some(&BTreeSet::from([node1])),
                "client1 -> node1's NodePort ({mode}): node2's hostNetwork endpoint must see node1's address {node1} (SNAT): {outs:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// 4. Terminating endpoints on another node.

/// Services #22 "should be able to connect to terminating and unready endpoints if
/// PublishNotReadyAddresses is true" (and #21 "should create endpoints for unready
/// pods"): the only endpoint, on node 2, is published ready (publishNotReadyAddresses),
/// serving and terminating. A pod of node 1 reaches it through the ClusterIP and through
/// both nodes' NodePorts; an external client through both nodes' NodePorts.
#[test]
fn published_not_ready_terminating_endpoint_on_another_node_is_reachable() {
    let mut c = Cluster::new("mn-pna", &[1, 1], &[SRV]);
    let eps = [published_terminating(pod_ep(&c, "n2p1", false))];
    c.write_manifest(
        "pna.yaml",
        &svc_docs(
            "pna",
            "NodePort",
            &["10.96.3.40"],
            "  publishNotReadyAddresses: true\n",
            &eps,
            &[],
        ),
    );
    c.start_agents(&[]);
    let (node1, node2) = (v4(c.node(1).v4), v4(c.node(2).v4));
    for (mode, cport, nport) in [("tcp", 80, NP_TCP), ("udp", 53, NP_UDP)] {
        expect_reach(
            &c,
            Client::Pod("n1p1"),
            mode,
            &format!("10.96.3.40:{cport}"),
            5,
            &["n2p1"],
            1,
        );
        for (n, node) in [(1, node1), (2, node2)] {
            let addr = hostport(node, nport);
            expect_reach(&c, Client::Pod("n1p1"), mode, &addr, 5, &["n2p1"], n);
            expect_reach(&c, Client::Ext(1), mode, &addr, 5, &["n2p1"], n);
        }
    }
}

/// Services #23 "should not be able to connect to terminating and unready endpoints if
/// PublishNotReadyAddresses is false": the only endpoint, on node 2, first ready (and
/// reached), then terminating and not serving. The ClusterIP (from a pod of node 1) and
/// both nodes' NodePorts (from an external client) then refuse the connection.
#[test]
fn terminating_not_serving_endpoint_on_another_node_is_refused_everywhere() {
    let mut c = Cluster::new("mn-term-dead", &[1, 1], &[SRV]);
    let doc = |e: Ep| svc_docs("td", "NodePort", &["10.96.3.50"], "", &[e], &[]);
    c.write_manifest("td.yaml", &doc(pod_ep(&c, "n2p1", false)));
    c.start_agents(&[]);
    let cip = "10.96.3.50:80".to_string();
    let np1 = hostport(c.node(1).v4, NP_TCP);
    let np2 = hostport(c.node(2).v4, NP_TCP);
    // Ready: every path works (the Service is right).
    expect_reach(&c, Client::Pod("n1p1"), "tcp", &cip, 3, &["n2p1"], 1);
    expect_reach(&c, Client::Ext(1), "tcp", &np1, 3, &["n2p1"], 1);
    expect_reach(&c, Client::Ext(1), "tcp", &np2, 3, &["n2p1"], 2);

    c.write_manifest(
        "td.yaml",
        &doc(pod_ep(&c, "n2p1", false).terminating(false)),
    );
    for (from, addr, n) in [
        (Client::Pod("n1p1"), &cip, 1),
        (Client::Ext(1), &np1, 1),
        (Client::Ext(1), &np2, 2),
    ] {
        eventually(
            &format!(
                "{} -> {addr}: refused once the only endpoint is terminating and not serving",
                from.label()
            ),
            Duration::from_secs(10),
            || {
                let o = &probe(&c, from, "tcp", addr, 1)[0];
                if !o.ok && o.errno == Some(ECONNREFUSED) {
                    Ok(())
                } else {
                    Err(format!("{o:?}\n{}", c.diag(n)))
                }
            },
        );
        expect_refused(&c, from, "tcp", addr, 3, n);
    }
}

/// Services #40 "should fallback to terminating endpoints when there are no ready
/// endpoints with externallTrafficPolicy=Cluster": the only endpoint, on node 2, is
/// serving and terminating (not ready). It is reached through node 1's NodePort (source
/// NAT to node 1) and node 2's NodePort, from an external client and from pods of the
/// other node, TCP and UDP.
#[test]
fn nodeport_cluster_policy_falls_back_to_a_terminating_endpoint_on_another_node() {
    let mut c = Cluster::new("mn-term-etpc", &[1, 2], &[SRV]);
    let eps = [pod_ep(&c, "n2p1", false).terminating(true)];
    c.write_manifest(
        "tc.yaml",
        &svc_docs("tc", "NodePort", &["10.96.3.60"], "", &eps, &[]),
    );
    c.start_agents(&[]);
    let (node1, node2) = (v4(c.node(1).v4), v4(c.node(2).v4));
    for (mode, port) in [("tcp", NP_TCP), ("udp", NP_UDP)] {
        let outs = expect_reach(
            &c,
            Client::Ext(1),
            mode,
            &hostport(node1, port),
            5,
            &["n2p1"],
            1,
        );
        assert_eq!(
            seen_set(&outs),
            BTreeSet::from([node1.to_string()]),
            "client1 -> node1's NodePort ({mode}): the endpoint on node2 must see node1's address (SNAT)"
        );
        expect_reach(
            &c,
            Client::Ext(1),
            mode,
            &hostport(node2, port),
            5,
            &["n2p1"],
            2,
        );
        // Pods of each node through the other node's NodePort (tc of that node).
        expect_reach(
            &c,
            Client::Pod("n1p1"),
            mode,
            &hostport(node2, port),
            5,
            &["n2p1"],
            2,
        );
        expect_reach(
            &c,
            Client::Pod("n2p2"),
            mode,
            &hostport(node1, port),
            5,
            &["n2p1"],
            1,
        );
    }
}

/// Services #41 "should fallback to local terminating endpoints when there are no ready
/// endpoints with externalTrafficPolicy=Local": the only endpoint, n1p1 on node 1, is
/// serving and terminating. A pod of node 1 -> node 2's NodePort fails (node 2 has no
/// local endpoint: dropped, the client times out); a pod of node 1 -> node 1's NodePort
/// works (pod traffic to its own node's NodePort is not subject to the external policy);
/// a pod of node 2 -> node 1's NodePort works and keeps its address (eTP Local, local
/// terminating fallback); so does an external client.
#[test]
fn nodeport_local_policy_falls_back_to_a_local_terminating_endpoint() {
    let mut c = Cluster::new("mn-term-etpl", &[2, 1], &[SRV]);
    let eps = [pod_ep(&c, "n1p1", false).terminating(true)];
    c.write_manifest(
        "tl.yaml",
        &svc_docs(
            "tl",
            "NodePort",
            &["10.96.3.70"],
            "  externalTrafficPolicy: Local\n",
            &eps,
            &[],
        ),
    );
    c.start_agents(&[]);
    let (node1, node2) = (v4(c.node(1).v4), v4(c.node(2).v4));

    let drops = c.counter(2, "dropped_no_local_endpoints");
    for (mode, port, count) in [("tcp", NP_TCP, 2), ("udp-connected", NP_UDP, 1)] {
        for o in probe(&c, Client::Pod("n1p2"), mode, &hostport(node2, port), count) {
            assert!(
                timed_out(&o),
                "pod n1p2 -> node2's NodePort ({mode}): eTP Local and no endpoint on node2: must be dropped (timeout), saw {o:?}\n{}",
                c.diag(2)
            );
        }
    }
    c.expect_counter(
        2,
        "dropped_no_local_endpoints",
        drops + 3,
        "node2 drops the 2 SYNs and the datagram of pod n1p2",
    );

    // Each client reaches node 1's NodePort and the endpoint sees the client's address:
    // n1p2 through its own node's socket hooks, the others through node 1's tc with eTP
    // Local (no source NAT).
    let clients = [
        (Client::Pod("n1p2"), c.pod("n1p2").v4, "pod n1p2"),
        (Client::Pod("n2p1"), c.pod("n2p1").v4, "pod n2p1"),
        (Client::Ext(1), c.client(1).v4, "client1"),
    ];
    for (mode, port) in [("tcp", NP_TCP), ("udp", NP_UDP)] {
        for (from, addr, name) in clients {
            let outs = expect_reach(&c, from, mode, &hostport(node1, port), 5, &["n1p1"], 1);
            assert_eq!(
                seen_set(&outs),
                BTreeSet::from([addr.to_string()]),
                "{name} -> node1's NodePort ({mode}): the endpoint sees the client's address"
            );
        }
    }
}

/// Services #39 "should fallback to local terminating endpoints when there are no ready
/// endpoints with internalTrafficPolicy=Local": the only endpoint, n1p1 on node 1, is
/// serving and terminating. Pods and hostNetwork clients of node 1 reach it through the
/// ClusterIP; those of node 2 fail.
#[test]
fn internal_local_policy_falls_back_to_a_local_terminating_endpoint() {
    let mut c = Cluster::new("mn-term-itpl", &[2, 1], &[SRV]);
    let eps = [pod_ep(&c, "n1p1", false).terminating(true)];
    c.write_manifest(
        "il.yaml",
        &svc_docs(
            "il",
            "ClusterIP",
            &["10.96.3.80"],
            "  internalTrafficPolicy: Local\n",
            &eps,
            &[],
        ),
    );
    c.start_agents(&[]);
    for (mode, port) in [("tcp", 80), ("udp", 53)] {
        let addr = format!("10.96.3.80:{port}");
        expect_reach(&c, Client::Pod("n1p2"), mode, &addr, 5, &["n1p1"], 1);
        expect_reach(&c, Client::Host(1), mode, &addr, 5, &["n1p1"], 1);
        expect_no_local(&c, Client::Pod("n2p1"), mode, &addr, 2, 2);
        expect_no_local(&c, Client::Host(2), mode, &addr, 2, 2);
    }
}

/// Services #34 "should respect internalTrafficPolicy=Local Pod to Pod", #35 "… Pod
/// (hostNetwork: true) to Pod" and #36 "… Pod and Node, to Pod (hostNetwork: true)":
/// one Service whose only endpoint is a pod of node 1, one whose only endpoint is a
/// hostNetwork server of node 1. Pods and hostNetwork clients of node 1 reach it, TCP and
/// UDP; those of node 2 fail.
#[test]
fn internal_local_policy_serves_only_clients_of_the_endpoints_node() {
    let mut c = Cluster::new("mn-itpl", &[2, 1], &[SRV]);
    c.serve_on_node(1, "host1", &[SRV]);
    answer_pods_from_node_address(&c, 1);
    let itp = "  internalTrafficPolicy: Local\n";
    let pod_eps = [pod_ep(&c, "n1p1", false)];
    let host_eps = [host_ep(&c, 1, false)];
    c.write_manifest(
        "itp.yaml",
        &docs(&[
            svc_docs("itp-pod", "ClusterIP", &["10.96.3.90"], itp, &pod_eps, &[]),
            svc_docs(
                "itp-host",
                "ClusterIP",
                &["10.96.3.91"],
                itp,
                &host_eps,
                &[],
            ),
        ]),
    );
    c.start_agents(&[]);
    for (vip, backend) in [("10.96.3.90", "n1p1"), ("10.96.3.91", "host1")] {
        for (mode, port) in [("tcp", 80), ("udp", 53)] {
            let addr = format!("{vip}:{port}");
            expect_reach(&c, Client::Pod("n1p2"), mode, &addr, 5, &[backend], 1);
            expect_reach(&c, Client::Host(1), mode, &addr, 5, &[backend], 1);
            expect_no_local(&c, Client::Pod("n2p1"), mode, &addr, 2, 2);
            expect_no_local(&c, Client::Host(2), mode, &addr, 2, 2);
        }
    }
}

// ---------------------------------------------------------------------------------------
// 5. A UDP flow from a fixed source port while the server pod cycles.

/// Conntrack "should be able to preserve UDP traffic when server pod cycles for a
/// NodePort service": pod n1p1 sends UDP from the fixed source port 12345 to node 2's
/// NodePort before the Service has any endpoint (refused). Then an endpoint on node 2
/// appears: the same 5-tuple must reach it within the deadline. It goes away (the flow
/// fails again) and another endpoint on node 2 appears: the same 5-tuple must reach the
/// new one. Last, the endpoint is replaced by one on node 1 (source NAT by node 2): the
/// same 5-tuple must follow. Every phase polls with a deadline (upstream allows a
/// minute; ferry must do it in 15 s).
#[test]
fn udp_flow_from_a_fixed_port_follows_the_server_pod_as_it_cycles() {
    let mut c = Cluster::new("mn-ct-udp", &[2, 2], &[SRV]);
    const SPORT: &str = "12345";
    let doc = |c: &Cluster, pods: &[&str]| {
        let eps: Vec<Ep> = pods.iter().map(|p| pod_ep(c, p, false)).collect();
        svc_docs("ct", "NodePort", &["10.96.3.100"], "", &eps, &[])
    };
    c.write_manifest("ct.yaml", &doc(&c, &[]));
    c.start_agents(&[]);
    let node2 = v4(c.node(2).v4);
    let target = hostport(node2, NP_UDP);
    let client = c.pod("n1p1");
    let (client_ns, client_cg) = (client.netns.clone(), c.node(1).cgroup.clone());
    let me = format!("{}:{SPORT}", client.v4);
    let send = |c: &Cluster| -> Outcome {
        let outs = Cluster::probe_in(
            &client_ns,
            Some(&client_cg),
            &["udp-ports", &target, SPORT, "1"],
            "whoami",
        );
        assert_eq!(outs.len(), 1, "one datagram per probe: {outs:?}");
        let o = outs.into_iter().next().unwrap();
        assert!(
            !o.ok
                || o.from
                    .as_deref()
                    .is_some_and(|f| f.ends_with(&format!(":{SPORT}"))),
            "the probe must send from the fixed source port {SPORT}: {o:?}\n{}",
            c.diag(2)
        );
        o
    };
    // Full `NAME addr:port` reply: the backend and the exact source it saw.
    let reaches = |c: &Cluster, backend: &str, seen: &str, phase: &str| {
        eventually(
            &format!("{phase}: UDP from {me} to {target} answered by {backend}, seeing {seen}"),
            Duration::from_secs(15),
            || {
                let o = send(c);
                match o.reply.as_deref() {
                    Some(r) if r == format!("{backend} {seen}") => Ok(()),
                    _ => Err(format!("{o:?}\n{}", c.diag(2))),
                }
            },
        );
    };

    let o = send(&c);
    assert!(
        !o.ok && o.errno == Some(ECONNREFUSED),
        "no endpoint yet: the datagram to node2's NodePort must be refused, saw {o:?}\n{}",
        c.diag(2)
    );

    // Backend 1 on node 2 (local to node 2: no source NAT, the source port is kept).
    c.write_manifest("ct.yaml", &doc(&c, &["n2p1"]));
    reaches(&c, "n2p1", &me, "first server pod n2p1 appears");

    // Backend 1 goes away: the flow must stop reaching it.
    c.write_manifest("ct.yaml", &doc(&c, &[]));
    eventually(
        "n2p1 deleted: the datagrams of the flow are no longer answered",
        Duration::from_secs(15),
        || {
            let o = send(&c);
            if o.ok {
                Err(format!("still answered: {o:?}\n{}", c.diag(2)))
            } else {
                Ok(())
            }
        },
    );

    // Backend 2 on node 2.
    c.write_manifest("ct.yaml", &doc(&c, &["n2p2"]));
    reaches(&c, "n2p2", &me, "second server pod n2p2 appears");

    // Replaced at once by a server pod on node 1: node 2 must source-NAT the same flow.
    c.write_manifest("ct.yaml", &doc(&c, &["n1p2"]));
    eventually(
        &format!(
            "server pod moved to node1: UDP from {me} to {target} answered by n1p2 via node2's SNAT"
        ),
        Duration::from_secs(15),
        || {
            let o = send(&c);
            let who = o.reply.as_deref().and_then(|r| r.split_whitespace().nth(1));
            match (o.backend(), seen(&o)) {
                (Some("n1p2"), Some(a)) if a == node2 => Ok(()),
                _ => Err(format!("{o:?} (seen {who:?})\n{}", c.diag(2))),
            }
        },
    );
}
