//! The pod network (`ferry agent --pod-network`, issue 14) in a three-node cluster of
//! network namespaces (`Cluster::new_bare`): the nodes share a LAN and nothing routes
//! between their pod CIDRs but the agents, which read the Node objects (pod CIDRs,
//! InternalIPs) from the manifests directory. Pods are wired by the `ferry-cni` plugin
//! that each agent installed, with the configuration it wrote, invoked as a container
//! runtime does (`Cluster::add_cni_pod`).
//!
//! - The Kubernetes network model: every pod reaches every pod and every node, in both
//!   families, and the other side sees the pod's own address (no NAT).
//! - Services keep working over these pods: ClusterIP from a pod, another node's NodePort,
//!   a NodePort from outside the cluster.
//! - Routes follow the Nodes: a Node removed takes its routes with it, added back
//!   brings them back; routes of other owners stay.
//! - An agent restart keeps a pod-to-pod connection and changes no route.
//! - Pod traffic to the outside leaves with the node's address, and with
//!   `--masquerade=false` it does not.
//! - The VXLAN overlay carries the same mesh.
//! - Nodes from the Kubernetes API (the fake API server) drive the same.
//! - The fast path forwards pod-to-pod packets at tc: the nodes' forwarding path (an nft
//!   counter in its forward hook) sees none of them, and with the fast path off it sees
//!   them all.

use std::{
    collections::BTreeSet,
    net::IpAddr,
    process::{Child, Command},
    time::Duration,
};

use ferry_tests::*;

const SRV: u16 = 8080;
const NODES: usize = 3;
const VIP: &str = "10.96.7.10";
const VIP6: &str = "fd00:96::7:10";
const NODE_PORT: u16 = 30780;

/// Every pod's name: two per node.
fn pod_names() -> Vec<String> {
    (1..=NODES)
        .flat_map(|n| ["a", "b"].map(|s| format!("n{n}{s}")))
        .collect()
}

/// A cluster with the pod network running on every node and two CNI pods per node.
fn pod_network_cluster(test: &str) -> Cluster {
    pod_network_cluster_with(test, &[])
}

/// The same, every agent with `extra` flags too.
fn pod_network_cluster_with(test: &str, extra: &[&str]) -> Cluster {
    pod_network_cluster_each(test, |_| extra.to_vec())
}

/// The same, node `n`'s agent with `extra(n)` flags too.
fn pod_network_cluster_each<'a>(test: &str, extra: impl Fn(usize) -> Vec<&'a str>) -> Cluster {
    let mut c = Cluster::new_bare(test, NODES);
    let nodes: Vec<String> = (1..=NODES).map(|n| c.node_manifest(n)).collect();
    c.write_manifest("nodes.yaml", &docs(&nodes));
    for n in 1..=NODES {
        let mut args = c.pod_network_args(n);
        args.extend(extra(n).iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        c.start_agent(n, &args);
    }
    for n in 1..=NODES {
        wait_conflist(&c, n);
        for s in ["a", "b"] {
            c.add_cni_pod(n, &format!("n{n}{s}"), &[SRV]);
        }
    }
    for n in 1..=NODES {
        wait_routes(&c, n, NODES - 1);
    }
    c
}

/// Waits for node `n`'s agent to write its CNI configuration.
fn wait_conflist(c: &Cluster, n: usize) {
    let conf = c.cni_dirs(n).0.join("10-ferry.conflist");
    eventually(
        &format!("node{n}'s agent writes its CNI configuration"),
        Duration::from_secs(10),
        || {
            if conf.exists() {
                Ok(())
            } else {
                Err(c.agent_log(n))
            }
        },
    );
}

/// ferry's routes on node `n` (`ip route show proto 245`), both families.
fn ferry_routes(c: &Cluster, n: usize) -> BTreeSet<String> {
    let ns = &c.node(n).netns;
    let mut out = BTreeSet::new();
    for fam in ["-4", "-6"] {
        for l in sh(&format!("ip {fam} -n {ns} route show proto 245")).lines() {
            out.insert(l.trim().to_string());
        }
    }
    out
}

/// The routes node `n` must have with `others` other nodes present, the first ones.
fn expected_routes(c: &Cluster, n: usize, others: &[usize]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for &m in others.iter().filter(|&&m| m != n) {
        let (v4, v6) = Cluster::cni_pod_cidrs(m);
        let node = c.node(m);
        out.insert(format!("{v4} via {} dev eth0", node.v4));
        out.insert(format!(
            "{v6} via {} dev eth0 metric 1024 pref medium",
            node.v6
        ));
    }
    out
}

fn wait_routes(c: &Cluster, n: usize, count: usize) {
    eventually(
        &format!("node{n} has {count} routes per family to other nodes' pods"),
        Duration::from_secs(10),
        || {
            let r = ferry_routes(c, n);
            if r.len() == 2 * count {
                Ok(())
            } else {
                Err(format!("{r:?}\n{}", c.agent_log(n)))
            }
        },
    );
}

/// One `whoami` over TCP from pod `from` (outside any agent cgroup) to `addr`.
fn whoami(c: &Cluster, from: &str, addr: &str) -> Outcome {
    let p = c.pod(from);
    Cluster::probe_in(&p.netns, None, &["tcp", addr, "1"], "whoami")
        .pop()
        .expect("one outcome")
}

/// Pod to pod, every pair, both families: the server sees the client pod's address.
/// Returns how many connections were checked.
fn assert_pod_mesh(c: &Cluster) -> usize {
    let names = pod_names();
    let mut checked = 0;
    for from in &names {
        for to in names.iter().filter(|t| *t != from) {
            for v6 in [false, true] {
                let (src, dst): (IpAddr, IpAddr) = if v6 {
                    (c.pod(from).v6.into(), c.pod(to).v6.into())
                } else {
                    (c.pod(from).v4.into(), c.pod(to).v4.into())
                };
                let o = whoami(c, from, &hostport(dst, SRV));
                assert!(
                    o.ok && o.backend() == Some(to.as_str()),
                    "{from} -> {to} ({dst}): {o:?}"
                );
                assert_eq!(seen(&o), Some(src), "{from} -> {to}: NAT on the way: {o:?}");
                checked += 1;
            }
        }
    }
    checked
}

#[test]
fn every_pod_reaches_every_pod_and_node_with_its_own_address_and_services_work() {
    let mut c = pod_network_cluster("podnet-model");
    for n in 1..=NODES {
        let all: Vec<usize> = (1..=NODES).collect();
        assert_eq!(
            ferry_routes(&c, n),
            expected_routes(&c, n, &all),
            "node{n}'s routes"
        );
        let metrics = c.metrics(n);
        assert_eq!(
            metric_value(&metrics, "ferry_pod_network_routes", ""),
            2 * (NODES as u64 - 1),
            "node{n} /metrics:\n{metrics}"
        );
    }
    // The plugin the agent installed is the one it was given.
    let installed = std::fs::read(c.cni_dirs(1).1.join("ferry-cni")).unwrap();
    assert_eq!(installed, std::fs::read(bin("ferry-cni")).unwrap());

    let checked = assert_pod_mesh(&c);
    eprintln!("pod to pod: {checked} connections, each with the pod's own address");
    let names = pod_names();

    // Pod to node: every node's address, from a pod of every node.
    for n in 1..=NODES {
        c.serve_on_node(n, &format!("host{n}"), &[SRV]);
    }
    for from in ["n1a", "n2b", "n3a"] {
        for n in 1..=NODES {
            for v6 in [false, true] {
                let (src, dst): (IpAddr, IpAddr) = if v6 {
                    (c.pod(from).v6.into(), c.node(n).v6.into())
                } else {
                    (c.pod(from).v4.into(), c.node(n).v4.into())
                };
                let o = whoami(&c, from, &hostport(dst, SRV));
                assert!(
                    o.ok && o.backend() == Some(format!("host{n}").as_str()),
                    "{from} -> node{n} ({dst}): {o:?}"
                );
                assert_eq!(seen(&o), Some(src), "{from} -> node{n}: NAT on the way");
            }
        }
    }

    // Services over these pods: a dual-stack NodePort Service with every pod behind it.
    let eps4: Vec<Ep> = names
        .iter()
        .map(|p| ep(c.pod(p).v4).on(&c.node(c.pod(p).node).name))
        .collect();
    let eps6: Vec<Ep> = names
        .iter()
        .map(|p| ep(c.pod(p).v6).on(&c.node(c.pod(p).node).name))
        .collect();
    let ports = [("http", 80, "TCP", NODE_PORT)];
    c.write_manifest(
        "web.yaml",
        &docs(&[
            external_service("web", "NodePort", &[VIP, VIP6], &ports, "", ""),
            slice("web", "web-v4", "IPv4", &[("http", SRV, "TCP")], &eps4),
            slice("web", "web-v6", "IPv6", &[("http", SRV, "TCP")], &eps6),
        ]),
    );
    let want: BTreeSet<String> = names.iter().cloned().collect();
    for addr in [
        hostport(VIP.parse::<IpAddr>().unwrap(), 80),
        hostport(VIP6.parse::<IpAddr>().unwrap(), 80),
        hostport(c.node(2).v4, NODE_PORT),
        hostport(c.node(3).v6, NODE_PORT),
    ] {
        let got = eventually(
            &format!("pod n1a reaches every pod through {addr}"),
            Duration::from_secs(10),
            || {
                let outs = c.probe_pod("n1a", "tcp", &addr, 60);
                let seen: BTreeSet<String> = outs
                    .iter()
                    .filter(|o| o.ok)
                    .filter_map(|o| o.backend().map(String::from))
                    .collect();
                if outs.iter().all(|o| o.ok) && seen == want {
                    Ok(seen)
                } else {
                    Err(format!("{seen:?} {outs:?}"))
                }
            },
        );
        assert_eq!(got, want);
    }
    // An external client (no route to any pod CIDR) through node 1's NodePort: the tc
    // path forwards to pods on every node over the pod network's routes.
    for addr in [
        hostport(c.node(1).v4, NODE_PORT),
        hostport(c.node(1).v6, NODE_PORT),
    ] {
        let outs = c.probe_ext(1, "tcp", &addr, 60);
        all_ok(&outs, &format!("client1 -> {addr}"));
        let seen: BTreeSet<String> = outs
            .iter()
            .filter_map(|o| o.backend().map(String::from))
            .collect();
        assert_eq!(seen, want, "client1 -> {addr} reaches every pod");
    }
}

#[test]
fn routes_follow_the_nodes_and_leave_other_routes_alone() {
    let c = pod_network_cluster("podnet-nodes");
    // Another owner's route on node 1 (a CIDR no Node claims): must stay.
    let n1 = c.node(1).netns.clone();
    sh(&format!(
        "ip -n {n1} route add 10.99.0.0/16 via {}",
        c.node(2).v4
    ));
    let before = whoami(&c, "n1a", &hostport(c.pod("n3a").v4, SRV));
    assert!(before.ok, "n1a -> n3a before: {before:?}");

    // node3 leaves: its routes go on node 1 and 2, and its pods are out of reach.
    let nodes: Vec<String> = (1..=2).map(|n| c.node_manifest(n)).collect();
    c.write_manifest("nodes.yaml", &docs(&nodes));
    for n in 1..=2 {
        wait_routes(&c, n, 1);
        assert_eq!(ferry_routes(&c, n), expected_routes(&c, n, &[1, 2]));
    }
    let gone = whoami(&c, "n1a", &hostport(c.pod("n3a").v4, SRV));
    assert!(!gone.ok, "n1a reached n3a with node3 gone: {gone:?}");
    assert!(
        c.agent_log(1).contains("route removed (its node is gone)"),
        "{}",
        c.agent_log(1)
    );

    // node3 is back: so are the routes, and the pods are reachable again.
    let nodes: Vec<String> = (1..=NODES).map(|n| c.node_manifest(n)).collect();
    c.write_manifest("nodes.yaml", &docs(&nodes));
    wait_routes(&c, 1, 2);
    let back = whoami(&c, "n1a", &hostport(c.pod("n3a").v4, SRV));
    assert!(back.ok, "n1a -> n3a after node3 came back: {back:?}");
    let other = sh(&format!("ip -n {n1} route show 10.99.0.0/16"));
    assert!(
        other.contains(&format!("via {}", c.node(2).v4)),
        "another owner's route was touched: {other:?}"
    );
}

/// Waits for node `n`'s restarted agent to finish a reconcile: its metrics show the
/// routes to the two other nodes (both families).
fn wait_restarted(c: &Cluster, n: usize) {
    wait_metric(
        c,
        n,
        "its restarted pod network reconciled",
        "ferry_pod_network_routes",
        4,
    );
}

/// Waits until node `n`'s `/metrics` shows `want` for the unlabelled `metric`.
fn wait_metric(c: &Cluster, n: usize, what: &str, metric: &str, want: u64) {
    eventually(&format!("node{n}: {what}"), Duration::from_secs(10), || {
        let m = c.metrics(n);
        if metric_value(&m, metric, "") == want {
            Ok(())
        } else {
            Err(format!("{m}\n{}", c.agent_log(n)))
        }
    });
}

#[test]
fn an_agent_restart_keeps_pod_flows_and_changes_no_route() {
    let mut c = pod_network_cluster("podnet-restart");
    let to = hostport(c.pod("n2a").v4, SRV);
    let mut session = Session::start(&c.pod("n1a").netns.clone(), None, &to, None);
    assert_eq!(
        session.ask("one", Duration::from_secs(3)).unwrap(),
        "n2a one"
    );
    let routes: Vec<BTreeSet<String>> = (1..=NODES).map(|n| ferry_routes(&c, n)).collect();
    let added = |c: &Cluster, n: usize| c.agent_log(n).matches("route to a node's pods").count();
    let added_before: Vec<usize> = (1..=NODES).map(|n| added(&c, n)).collect();
    for n in [1, 2] {
        c.stop_agent(n, libc::SIGTERM);
    }
    // No agent on either end: the kernel keeps routing.
    assert_eq!(
        session.ask("two", Duration::from_secs(3)).unwrap(),
        "n2a two"
    );
    for n in [1, 2] {
        let args = c.pod_network_args(n);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        c.start_agent(n, &args);
    }
    // Give the restarted agents a full reconcile: their metrics show the routes.
    for n in [1, 2] {
        wait_restarted(&c, n);
    }
    assert_eq!(
        session.ask("three", Duration::from_secs(3)).unwrap(),
        "n2a three"
    );
    for n in 1..=NODES {
        assert_eq!(
            ferry_routes(&c, n),
            routes[n - 1],
            "node{n}'s routes changed"
        );
        assert_eq!(
            added(&c, n),
            added_before[n - 1],
            "node{n}'s restarted agent re-added routes:\n{}",
            c.agent_log(n)
        );
    }
}

/// Packets node `n`'s forwarding path saw to or from `pods` (nft counters in the forward
/// hook of a table of the test's own, created on first use).
fn forwarded_packets(c: &Cluster, n: usize, pods: &[&str]) -> u64 {
    let ns = &c.node(n).netns;
    if !sh(&format!("ip netns exec {ns} nft list tables")).contains("inet probe") {
        let mut rules = String::from(
            "table inet probe {\n chain forwarded {\n  type filter hook forward priority -300;\n",
        );
        for p in pods {
            let pod = c.pod(p);
            for (fam, ip) in [("ip", pod.v4.to_string()), ("ip6", pod.v6.to_string())] {
                rules.push_str(&format!(
                    "  {fam} daddr {ip} counter\n  {fam} saddr {ip} counter\n"
                ));
            }
        }
        rules.push_str(" }\n}\n");
        sh(&format!("ip netns exec {ns} nft -f - <<'EOF'\n{rules}EOF"));
    }
    let out = sh(&format!("ip netns exec {ns} nft list table inet probe"));
    out.split("packets ")
        .skip(1)
        .filter_map(|t| t.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// Pod-to-pod connections between `pairs`, both families; each must reach its pod with
/// the client's own address. Returns how many.
fn connect_pairs(c: &Cluster, pairs: &[(&str, &str)], rounds: usize) -> usize {
    let mut done = 0;
    for _ in 0..rounds {
        for (from, to) in pairs {
            for v6 in [false, true] {
                let (src, dst): (IpAddr, IpAddr) = if v6 {
                    (c.pod(from).v6.into(), c.pod(to).v6.into())
                } else {
                    (c.pod(from).v4.into(), c.pod(to).v4.into())
                };
                let o = whoami(c, from, &hostport(dst, SRV));
                assert!(
                    o.ok && o.backend() == Some(*to),
                    "{from} -> {to} ({dst}): {o:?}"
                );
                assert_eq!(seen(&o), Some(src), "{from} -> {to}: NAT on the way: {o:?}");
                done += 1;
            }
        }
    }
    done
}

/// Waits until node `n`'s fast path carries both of its pods' veths: until the agent
/// attaches to a new veth (on the kernel's link notification, or at the latest at its
/// half-second scan), its packets take the kernel's path.
fn wait_fast_path_pods(c: &Cluster, n: usize) {
    wait_metric(
        c,
        n,
        "its fast path holds both pods' veths",
        "ferry_pod_network_fast_path_pods",
        2,
    );
}

fn fast_path_counter(c: &Cluster, n: usize, which: &str) -> u64 {
    metric_value(
        &c.metrics(n),
        &format!("ferry_pod_network_fast_path_{which}_packets_total"),
        "",
    )
}

#[test]
fn the_fast_path_forwards_pod_traffic_past_the_nodes_forwarding_path() {
    let mut c = pod_network_cluster("podnet-fast");
    for n in 1..=NODES {
        wait_fast_path_pods(&c, n);
    }
    // Across nodes (n1a <-> n2a) and within one (n1a -> n1b).
    let pairs = [("n1a", "n2a"), ("n2a", "n1a"), ("n1a", "n1b")];
    let probed = ["n1a", "n1b", "n2a"];
    // The first packets to a pod whose neighbour entry does not exist yet take the
    // stack's path, which resolves it: one round first.
    connect_pairs(&c, &pairs, 1);
    let fwd_before = [
        forwarded_packets(&c, 1, &probed),
        forwarded_packets(&c, 2, &probed),
    ];
    let from_before = [
        fast_path_counter(&c, 1, "from_pod"),
        fast_path_counter(&c, 2, "from_pod"),
    ];
    let to_before = [
        fast_path_counter(&c, 1, "to_pod"),
        fast_path_counter(&c, 2, "to_pod"),
    ];
    let conns = connect_pairs(&c, &pairs, 3);
    for n in [1, 2] {
        let fwd = forwarded_packets(&c, n, &probed) - fwd_before[n - 1];
        assert_eq!(
            fwd, 0,
            "node{n}'s forwarding path saw {fwd} pod packets with the fast path on"
        );
        // The metrics are refreshed every half second (the fast path's scan).
        let (mut from, mut to) = (0, 0);
        eventually(
            &format!("node{n}'s fast path counts the connections' packets"),
            Duration::from_secs(5),
            || {
                from = fast_path_counter(&c, n, "from_pod") - from_before[n - 1];
                to = fast_path_counter(&c, n, "to_pod") - to_before[n - 1];
                // Every connection is at least a SYN, its answer and the data each way.
                if from >= conns as u64 && to >= conns as u64 / 3 {
                    Ok(())
                } else {
                    Err(format!(
                        "{from} packets from pods, {to} to pods for {conns} connections"
                    ))
                }
            },
        );
        eprintln!("node{n}: fast path {from} from pods, {to} to pods, forwarding path 0");
    }

    // Without the fast path (and with its programs gone) the same traffic takes the
    // kernel's forwarding path, which the probe sees.
    for n in [1, 2] {
        c.stop_agent(n, libc::SIGTERM);
        let mut args = c.pod_network_args(n);
        args.push("--pod-network-fast-path=false".into());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        c.start_agent(n, &args);
    }
    for n in [1, 2] {
        wait_restarted(&c, n);
        assert!(
            !c.metrics(n).contains("ferry_pod_network_fast_path"),
            "node{n} reports a fast path it should not have"
        );
    }
    let fwd_before = [
        forwarded_packets(&c, 1, &probed),
        forwarded_packets(&c, 2, &probed),
    ];
    let conns = connect_pairs(&c, &pairs, 1);
    for n in [1, 2] {
        let fwd = forwarded_packets(&c, n, &probed) - fwd_before[n - 1];
        assert!(
            fwd >= conns as u64,
            "node{n}'s forwarding path saw only {fwd} pod packets for {conns} connections without the fast path"
        );
    }
}

/// `ferry-testsrv` in client 1's namespace (the internet: no route to any pod CIDR).
struct Internet(Child);

impl Internet {
    fn start(c: &Cluster) -> Internet {
        Internet(start_testsrv(&c.client(1).netns, "internet", &[SRV]))
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn pod_traffic_to_the_outside_is_masqueraded_unless_turned_off() {
    let mut c = pod_network_cluster("podnet-masq");
    let _internet = Internet::start(&c);
    for (pod, v6) in [("n1a", false), ("n1b", true), ("n2a", false)] {
        let node = c.node(c.pod(pod).node);
        let (dst, want): (IpAddr, IpAddr) = if v6 {
            (c.client(1).v6.into(), node.v6.into())
        } else {
            (c.client(1).v4.into(), node.v4.into())
        };
        let o = whoami(&c, pod, &hostport(dst, SRV));
        assert!(o.ok, "{pod} -> the internet {dst}: {o:?}");
        assert_eq!(
            seen(&o),
            Some(want),
            "{pod}'s traffic to the internet must leave with its node's address"
        );
    }
    let tables = sh(&format!(
        "ip netns exec {} nft list tables",
        c.node(1).netns
    ));
    assert!(tables.contains("table ip ferry-podnet"), "{tables}");

    // Off: the internet sees the pod's address, has no route back, the connect fails.
    c.stop_agent(1, libc::SIGTERM);
    let mut args = c.pod_network_args(1);
    args.push("--masquerade=false".into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    c.start_agent(1, &args);
    eventually(
        "node1's masquerade tables are gone",
        Duration::from_secs(10),
        || {
            let t = sh(&format!(
                "ip netns exec {} nft list tables",
                c.node(1).netns
            ));
            if t.contains("ferry-podnet") {
                Err(t)
            } else {
                Ok(())
            }
        },
    );
    let o = whoami(&c, "n1a", &hostport(c.client(1).v4, SRV));
    assert!(
        !o.ok,
        "without masquerade the internet cannot answer a pod: {o:?}"
    );
    // Other nodes are unaffected.
    let o = whoami(&c, "n2a", &hostport(c.client(1).v4, SRV));
    assert!(o.ok && seen(&o) == Some(c.node(2).v4.into()), "{o:?}");
}

/// Packets node `n`'s VXLAN device sent.
/// Packets node `n`'s `ferry.vxlan` sent (`dir` "tx") or received ("rx").
fn vxlan_packets(c: &Cluster, n: usize, dir: &str) -> u64 {
    let out = sh(&format!(
        "ip -n {} -s -j link show ferry.vxlan",
        c.node(n).netns
    ));
    let v: serde_json::Value = serde_json::from_str(&out).expect("ip -j");
    v[0]["stats64"][dir]["packets"]
        .as_u64()
        .unwrap_or_else(|| panic!("no {dir} packets in {out}"))
}

#[test]
fn the_vxlan_overlay_carries_pods_of_every_node_and_follows_the_nodes() {
    // Nodes 1 and 2 encapsulate and decapsulate in their fast path, node 3 (fast path
    // off) through its VXLAN device only: they must understand each other.
    let c = pod_network_cluster_each("podnet-vxlan", |n| {
        let mut extra = vec!["--overlay=vxlan"];
        if n == 3 {
            extra.push("--pod-network-fast-path=false");
        }
        extra
    });
    for n in 1..=NODES {
        let mut want = BTreeSet::new();
        for m in (1..=NODES).filter(|&m| m != n) {
            let (v4, v6) = Cluster::cni_pod_cidrs(m);
            let (gw4, gw6) = (v4.trim_end_matches("/24"), v6.trim_end_matches("/64"));
            want.insert(format!("{v4} via {gw4} dev ferry.vxlan onlink"));
            want.insert(format!(
                "{v6} via {gw6} dev ferry.vxlan metric 1024 onlink pref medium"
            ));
        }
        assert_eq!(ferry_routes(&c, n), want, "node{n}'s overlay routes");
        // The pods' MTU leaves room for VXLAN over IPv4 (50 bytes).
        let mtu = sh(&format!(
            "ip -n {} -j link show eth0",
            c.pod(&format!("n{n}a")).netns
        ));
        assert!(mtu.contains("\"mtu\":1450"), "pod MTU: {mtu}");
    }
    for n in [1, 2] {
        wait_fast_path_pods(&c, n);
    }
    let before: Vec<(u64, u64)> = (1..=NODES)
        .map(|n| (vxlan_packets(&c, n, "tx"), vxlan_packets(&c, n, "rx")))
        .collect();
    let checked = assert_pod_mesh(&c);
    eprintln!("vxlan: {checked} pod-to-pod connections, each with the pod's own address");
    // Each node's 2 pods open 2 × 4 × 2 connections to other nodes' pods: at least their
    // SYNs and the replies to the others' SYNs left the node encapsulated, 32 or more.
    // Node 3 sent them through its device, and received the other nodes' through it,
    // encapsulated by their fast path.
    let (tx, rx) = (
        vxlan_packets(&c, 3, "tx") - before[2].0,
        vxlan_packets(&c, 3, "rx") - before[2].1,
    );
    assert!(
        tx >= 32 && rx >= 32,
        "node3's VXLAN device sent {tx} and received {rx} packets"
    );
    // Nodes 1 and 2 encapsulated (from pods) and decapsulated (to pods) in the fast path.
    for n in [1, 2] {
        eventually(
            &format!("node{n}'s fast path carried the overlay traffic"),
            Duration::from_secs(5),
            || {
                let (from, to) = (
                    fast_path_counter(&c, n, "from_pod"),
                    fast_path_counter(&c, n, "to_pod"),
                );
                if from > 0 && to > 0 {
                    eprintln!("node{n}: fast path {from} packets from pods, {to} to pods");
                    Ok(())
                } else {
                    Err(format!("{from} packets from pods, {to} to pods"))
                }
            },
        );
    }

    // node3 leaves: its FDB and neighbour entries and routes go on node 1.
    let fdb = |c: &Cluster| {
        sh(&format!(
            "bridge -n {} fdb show dev ferry.vxlan",
            c.node(1).netns
        ))
    };
    assert!(
        fdb(&c).contains(&format!("dst {}", c.node(3).v4)),
        "{}",
        fdb(&c)
    );
    let nodes: Vec<String> = (1..=2).map(|n| c.node_manifest(n)).collect();
    c.write_manifest("nodes.yaml", &docs(&nodes));
    wait_routes(&c, 1, 1);
    eventually(
        "node3's FDB entry is gone from node1",
        Duration::from_secs(10),
        || {
            let f = fdb(&c);
            if f.contains(&format!("dst {}", c.node(3).v4)) {
                Err(f)
            } else {
                Ok(())
            }
        },
    );
    let neigh = sh(&format!(
        "ip -n {} neigh show dev ferry.vxlan",
        c.node(1).netns
    ));
    assert!(
        !neigh.contains("10.202.3.0"),
        "node3's neighbour entry is left: {neigh}"
    );
    let o = whoami(&c, "n1a", &hostport(c.pod("n2a").v4, SRV));
    assert!(o.ok, "n1a -> n2a with node3 gone: {o:?}");
}

#[test]
fn the_vxlan_overlay_reaches_a_node_behind_a_router() {
    // Node 3 moves to its own subnet: the LAN namespace routes between 192.168.77.0/24
    // and 172.31.3.0/24, so nodes 1 and 2 reach it only through a router, where no route
    // to a pod CIDR exists (native routing could not work: its InternalIP is not on
    // their link).
    let mut c = Cluster::new_bare("podnet-routed", NODES);
    let lan = c.lan_ns.clone();
    let router = "192.168.77.254";
    sh(&format!(
        "ip -n {lan} addr add {router}/24 dev br0 && ip -n {lan} addr add 172.31.3.254/24 dev br0 && ip netns exec {lan} sysctl -qw net.ipv4.ip_forward=1"
    ));
    let n3 = c.node(3).netns.clone();
    sh(&format!(
        "ip -n {n3} addr del {}/24 dev eth0 && ip -n {n3} addr add 172.31.3.3/24 dev eth0 && ip -n {n3} route add default via 172.31.3.254",
        c.node(3).v4
    ));
    for n in [1, 2] {
        sh(&format!(
            "ip -n {} route add 172.31.3.0/24 via {router}",
            c.node(n).netns
        ));
    }
    sh(&format!(
        "ip netns exec {lan} nft -f - <<'EOF'\ntable ip probe {{\n chain routed {{\n  type filter hook forward priority 0;\n  udp dport 8472 counter\n }}\n}}\nEOF"
    ));
    let (v4, v6) = Cluster::cni_pod_cidrs(3);
    let node3 = format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: node3\nspec:\n  podCIDRs: [{v4}, \"{v6}\"]\nstatus:\n  addresses:\n  - {{type: InternalIP, address: 172.31.3.3}}\n"
    );
    let nodes = [c.node_manifest(1), c.node_manifest(2), node3];
    c.write_manifest("nodes.yaml", &docs(&nodes));
    for n in 1..=NODES {
        let mut args = c.pod_network_args(n);
        args.push("--overlay=vxlan".into());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        c.start_agent(n, &args);
    }
    for n in 1..=NODES {
        wait_conflist(&c, n);
        c.add_cni_pod(n, &format!("n{n}a"), &[SRV]);
        wait_routes(&c, n, NODES - 1);
    }
    let pairs = [
        ("n1a", "n3a"),
        ("n3a", "n1a"),
        ("n2a", "n3a"),
        ("n3a", "n2a"),
        ("n1a", "n2a"),
    ];
    let conns = connect_pairs(&c, &pairs, 1);
    let routed: u64 = sh(&format!("ip netns exec {lan} nft list table ip probe"))
        .split("packets ")
        .skip(1)
        .filter_map(|t| t.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    // To and from node 3, at least a SYN and its answer per connection crossed the
    // router encapsulated.
    assert!(
        routed >= 8 * 2,
        "the router forwarded {routed} VXLAN packets for {conns} connections"
    );
    eprintln!("routed underlay: {conns} connections, {routed} VXLAN packets through the router");
}

/// A Node for the fake API server: `pod_cidrs`, InternalIPs `ips`, and `ready` as its
/// Ready condition (a heartbeat changes only that).
fn api_node(name: &str, pod_cidrs: &[&str], ips: &[String], ready: &str) -> serde_json::Value {
    let addresses: Vec<serde_json::Value> = ips
        .iter()
        .map(|ip| serde_json::json!({"type": "InternalIP", "address": ip}))
        .collect();
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "spec": {"podCIDR": pod_cidrs[0], "podCIDRs": pod_cidrs},
        "status": {
            "addresses": addresses,
            "conditions": [{"type": "Ready", "status": ready, "reason": "KubeletReady"}],
        },
    })
}

#[test]
fn nodes_from_the_api_drive_the_cni_configuration_and_routes() {
    use ferry_tests::fakeapi::Kind;
    let mut w = World::new("podnet-api", 1, &[SRV]);
    let api = w.start_fake_api();
    let own = [NODE_V4.to_string(), NODE_V6.to_string()];
    // node2 and node3 are on the node's own link (its eth0 subnets).
    let ip2 = ["192.168.50.20".to_string(), "fd00:50::20".to_string()];
    let ip3 = ["192.168.50.30".to_string()];
    api.apply(api_node(
        "node1",
        &["10.203.1.0/24", "fd00:203:1::/64"],
        &own,
        "True",
    ));
    api.apply(api_node(
        "node2",
        &["10.203.2.0/24", "fd00:203:2::/64"],
        &ip2,
        "True",
    ));
    let conf = w.workdir.join("net.d");
    let args = [
        "--pod-network".to_string(),
        format!("--cni-conf-dir={}", conf.display()),
        format!("--cni-bin-dir={}", w.workdir.join("cni-bin").display()),
        format!("--cni-data-dir={}", w.workdir.join("cni-data").display()),
        format!("--cni-plugin={}", bin("ferry-cni").display()),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let kubeconfig = w.write_kubeconfig(&api);
    w.start_agent_kube(&kubeconfig, &args);
    let routes = |w: &World| {
        let mut out = BTreeSet::new();
        for fam in ["-4", "-6"] {
            for l in sh(&format!("ip {fam} -n {} route show proto 245", w.node_ns)).lines() {
                out.insert(l.trim().to_string());
            }
        }
        out
    };
    let want2: BTreeSet<String> = [
        "10.203.2.0/24 via 192.168.50.20 dev eth0".to_string(),
        "fd00:203:2::/64 via fd00:50::20 dev eth0 metric 1024 pref medium".to_string(),
    ]
    .into();
    eventually(
        "the routes to node2's pods",
        Duration::from_secs(10),
        || {
            let r = routes(&w);
            if r == want2 {
                Ok(())
            } else {
                Err(format!("{r:?}\n{}", w.agent_log()))
            }
        },
    );
    let text = std::fs::read_to_string(conf.join("10-ferry.conflist")).expect("conflist");
    let list: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        list["plugins"][0]["podCIDRs"],
        serde_json::json!(["10.203.1.0/24", "fd00:203:1::/64"]),
        "{text}"
    );

    // A heartbeat (only the Ready condition changes), then a new node: one route more,
    // and node2's routes were not touched again.
    api.apply(api_node(
        "node2",
        &["10.203.2.0/24", "fd00:203:2::/64"],
        &ip2,
        "Unknown",
    ));
    api.apply(api_node("node3", &["10.203.3.0/24"], &ip3, "True"));
    let mut want3 = want2.clone();
    want3.insert("10.203.3.0/24 via 192.168.50.30 dev eth0".to_string());
    eventually("the route to node3's pods", Duration::from_secs(10), || {
        let r = routes(&w);
        if r == want3 {
            Ok(())
        } else {
            Err(format!("{r:?}"))
        }
    });
    assert_eq!(
        w.agent_log().matches("route to a node's pods").count(),
        3,
        "each route is added once:\n{}",
        w.agent_log()
    );

    // node2 is deleted: its routes go, node3's stays.
    assert!(api.delete(Kind::Node, "", "node2"));
    let only3: BTreeSet<String> = ["10.203.3.0/24 via 192.168.50.30 dev eth0".to_string()].into();
    eventually(
        "node2's routes are removed",
        Duration::from_secs(10),
        || {
            let r = routes(&w);
            if r == only3 {
                Ok(())
            } else {
                Err(format!("{r:?}"))
            }
        },
    );
    drop(api);
}

#[test]
fn with_service_routing_off_only_the_pod_network_runs() {
    let mut c = pod_network_cluster_with("podnet-only", &["--service-routing=false"]);
    assert_pod_mesh(&c);
    // No BPF program or map: the agent pinned nothing.
    for n in 1..=NODES {
        let pins: Vec<_> = std::fs::read_dir(&c.node(n).bpffs)
            .map(|d| d.map(|e| e.unwrap().file_name()).collect())
            .unwrap_or_default();
        assert!(
            pins.is_empty(),
            "node{n} pinned {pins:?} without Service routing"
        );
    }
    // A Service is left to kube-proxy: its ClusterIP is not translated here.
    let eps: Vec<Ep> = ["n2a", "n3a"].iter().map(|p| ep(c.pod(p).v4)).collect();
    c.write_manifest(
        "web.yaml",
        &docs(&[
            service("web", &[VIP], &[("http", 80, "TCP")], ""),
            slice("web", "web-v4", "IPv4", &[("http", SRV, "TCP")], &eps),
        ]),
    );
    let vip = hostport(VIP.parse::<IpAddr>().unwrap(), 80);
    let outs = c.probe_pod("n1a", "tcp", &vip, 3);
    assert!(
        outs.iter().all(|o| !o.ok),
        "{vip} was served without Service routing: {outs:?}"
    );
    assert!(c.agent_log(1).contains("running the pod network only"));
    // Taking over from the kube-proxy that routes Services is refused.
    c.stop_agent(1, libc::SIGTERM);
    let out = Command::new(bin("ferry"))
        .args([
            "agent",
            "--service-routing=false",
            "--pod-network",
            "--takeover-kube-proxy",
            "--manifests",
        ])
        .arg(&c.manifests)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("--takeover-kube-proxy with --service-routing=false"),
        "{out:?}"
    );
}

#[test]
fn what_someone_removes_comes_back_at_the_next_resync() {
    let c = pod_network_cluster_with("podnet-heal", &["--pod-network-resync=1"]);
    let ns = c.node(1).netns.clone();
    let (conf_dir, bin_dir, _) = c.cni_dirs(1);
    let routes = ferry_routes(&c, 1);
    std::fs::remove_file(conf_dir.join("10-ferry.conflist")).unwrap();
    std::fs::remove_file(bin_dir.join("ferry-cni")).unwrap();
    sh(&format!("ip -n {ns} route del 10.202.2.0/24"));
    sh(&format!(
        "ip netns exec {ns} nft delete table ip ferry-podnet"
    ));
    sh(&format!(
        "ip netns exec {ns} sysctl -qw net.ipv4.ip_forward=0"
    ));
    eventually(
        "node1's pod network is whole again",
        Duration::from_secs(10),
        || {
            let mut missing = Vec::new();
            if !conf_dir.join("10-ferry.conflist").exists() {
                missing.push("conflist".to_string());
            }
            if !bin_dir.join("ferry-cni").exists() {
                missing.push("plugin".to_string());
            }
            if ferry_routes(&c, 1) != routes {
                missing.push(format!("routes {:?}", ferry_routes(&c, 1)));
            }
            if !sh(&format!("ip netns exec {ns} nft list tables")).contains("ferry-podnet") {
                missing.push("nft table".to_string());
            }
            if sh(&format!("ip netns exec {ns} sysctl -n net.ipv4.ip_forward")).trim() != "1" {
                missing.push("ip_forward".to_string());
            }
            if missing.is_empty() {
                Ok(())
            } else {
                Err(missing.join(", "))
            }
        },
    );
    let o = whoami(&c, "n1a", &hostport(c.pod("n2a").v4, SRV));
    assert!(o.ok, "n1a -> n2a after the repair: {o:?}");
}
