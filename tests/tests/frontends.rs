//! Every frontend kind and both families: NodePort on node addresses (never loopback),
//! externalIPs, LoadBalancer ingress IPs (VIP mode only), IPv6 and dual-stack ClusterIPs,
//! named target ports and multi-port Services.

use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
};

use ferry_tests::*;

/// `count` TCP connects to `addr`: all must succeed, show `addr` as the peer, and reach
/// exactly `want`.
fn assert_reaches(w: &World, addr: &str, count: usize, want: &BTreeSet<String>) {
    // Random choice: 15 tries per backend make missing one less likely than 1e-7.
    let count = count.max(15 * want.len());
    let outs = w.probe("tcp", addr, count);
    assert!(
        outs.iter().all(|o| o.ok),
        "every connect to {addr} must succeed: {outs:?}"
    );
    for o in &outs {
        assert_eq!(
            o.peer.as_deref(),
            Some(addr),
            "getpeername must return the frontend {addr} that was dialled: {o:?}"
        );
    }
    let seen = backends(&outs);
    assert_eq!(
        &seen, want,
        "{count} connects to {addr}: expected backends {want:?}, saw {seen:?}"
    );
}

/// Frontend addresses currently programmed, from `ferry list -o json`.
fn programmed(w: &World) -> Vec<String> {
    let list = w.list_json();
    list["frontends"]
        .as_array()
        .expect("frontends array")
        .iter()
        .map(|f| {
            format!(
                "{}/{}",
                f["frontend"].as_str().unwrap_or("?"),
                f["protocol"].as_str().unwrap_or("?")
            )
        })
        .collect()
}

/// An extra test server inside a pod's namespace, killed when dropped.
struct ExtraServer(Child);

impl ExtraServer {
    fn start(pod: &Pod, name: &str, ports: &[u16]) -> ExtraServer {
        let mut cmd = Command::new(bin("ferry-testsrv"));
        cmd.arg(name)
            .args(ports.iter().map(|p| p.to_string()))
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = spawn_in(&pod.netns, None, &mut cmd);
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("testsrv ready line");
        assert_eq!(
            line.trim(),
            "ready",
            "extra test server {name} in {} did not start",
            pod.netns
        );
        ExtraServer(child)
    }
}

impl Drop for ExtraServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn v4_eps(w: &World) -> Vec<Ep> {
    w.pods.iter().map(|p| ep(p.v4)).collect()
}

fn v6_eps(w: &World) -> Vec<Ep> {
    w.pods.iter().map(|p| ep(p.v6)).collect()
}

/// A dual-stack NodePort Service: port 80 -> 8080, nodePort 30080, every pod in both slices.
fn nodeport_world(test: &str) -> World {
    let mut w = World::new(test, 3, &[8080]);
    let svc = with_port_fields(
        &service(
            "np",
            &["10.96.0.30", "fd00:96::30"],
            &[("http", 80, "TCP")],
            "  type: NodePort\n",
        ),
        80,
        "    nodePort: 30080\n",
    );
    w.write_manifest(
        "np.yaml",
        &docs(&[
            svc,
            slice("np", "np-v4", "IPv4", &[("http", 8080, "TCP")], &v4_eps(&w)),
            slice("np", "np-v6", "IPv6", &[("http", 8080, "TCP")], &v6_eps(&w)),
        ]),
    );
    w.start_agent(&[]);
    w
}

#[test]
fn nodeport_is_served_on_node_addresses_both_families() {
    let w = nodeport_world("np-node");
    let pods = all_pods(&w);
    assert_reaches(&w, &format!("{NODE_V4}:30080"), 40, &pods);
    assert_reaches(&w, &format!("[{NODE_V6}]:30080"), 40, &pods);
    // The ClusterIPs of the same Service work too.
    assert_reaches(&w, "10.96.0.30:80", 20, &pods);
    assert_reaches(&w, "[fd00:96::30]:80", 20, &pods);
}

#[test]
fn nodeport_is_not_served_on_loopback() {
    let w = nodeport_world("np-lo");
    // Sanity: the NodePort is programmed and served on the node address.
    assert_reaches(&w, &format!("{NODE_V4}:30080"), 5, &all_pods(&w));
    let frontends = programmed(&w);
    for lo in ["127.0.0.1:30080/TCP", "[::1]:30080/TCP"] {
        assert!(
            !frontends.contains(&lo.to_string()),
            "{lo} must not be a frontend; programmed: {frontends:?}"
        );
    }
    for addr in ["127.0.0.1:30080", "[::1]:30080"] {
        for o in w.probe("tcp", addr, 3) {
            assert!(
                !o.ok,
                "{addr} must not reach a pod (NodePorts are not served on loopback): {o:?}"
            );
            // Nothing listens on the node's loopback: the kernel itself refuses.
            assert_eq!(
                o.errno,
                Some(ECONNREFUSED),
                "{addr}: expected the kernel's ECONNREFUSED, saw {o:?}"
            );
        }
    }
}

#[test]
fn external_ips_and_load_balancer_ingress() {
    let mut w = World::new("ext-lb", 3, &[8080]);
    let mut svc = service(
        "lb",
        &["10.96.0.40"],
        &[("http", 80, "TCP")],
        "  type: LoadBalancer\n  externalIPs: [\"203.0.113.40\"]\n",
    );
    svc.push_str(
        "status:\n  loadBalancer:\n    ingress:\n    - ip: 198.51.100.40\n      ipMode: VIP\n    - ip: 198.51.100.41\n    - ip: 198.51.100.42\n      ipMode: Proxy\n",
    );
    w.write_manifest(
        "lb.yaml",
        &docs(&[
            svc,
            slice("lb", "lb-1", "IPv4", &[("http", 8080, "TCP")], &v4_eps(&w)),
        ]),
    );
    w.start_agent(&[]);
    let pods = all_pods(&w);
    assert_reaches(&w, "10.96.0.40:80", 30, &pods);
    assert_reaches(&w, "203.0.113.40:80", 30, &pods);
    assert_reaches(&w, "198.51.100.40:80", 30, &pods);
    assert_reaches(&w, "198.51.100.41:80", 30, &pods);

    let frontends = programmed(&w);
    assert!(
        !frontends.iter().any(|f| f.starts_with("198.51.100.42:")),
        "an ipMode Proxy ingress IP must not be programmed; programmed: {frontends:?}"
    );
    for o in w.probe("tcp", "198.51.100.42:80", 2) {
        // Left alone, the address is simply unrouted in this node.
        assert_eq!(
            o.errno,
            Some(ENETUNREACH),
            "ipMode Proxy IP must not be translated: expected ENETUNREACH, saw {o:?}"
        );
    }
}

#[test]
fn ipv6_cluster_ip_reaches_ipv6_pods() {
    let mut w = World::new("v6", 3, &[8080]);
    w.write_manifest(
        "v6.yaml",
        &docs(&[
            service(
                "v6",
                &["fd00:96::50"],
                &[("http", 80, "TCP"), ("dns", 53, "UDP")],
                "  ipFamilies: [IPv6]\n",
            ),
            slice(
                "v6",
                "v6-1",
                "IPv6",
                &[("http", 8080, "TCP"), ("dns", 8080, "UDP")],
                &v6_eps(&w),
            ),
        ]),
    );
    w.start_agent(&[]);
    assert_reaches(&w, "[fd00:96::50]:80", 40, &all_pods(&w));
    let curl = w.client("curl", &["-s", "--max-time", "3", "http://[fd00:96::50]/"]);
    let body = String::from_utf8_lossy(&curl.stdout);
    assert!(
        body.starts_with("pod"),
        "curl to the IPv6 ClusterIP got {body:?} ({})",
        String::from_utf8_lossy(&curl.stderr)
    );

    let udp = w.probe("udp", "[fd00:96::50]:53", 10);
    for o in &udp {
        assert!(o.ok, "UDP over IPv6 must work: {o:?}");
        assert_eq!(
            o.from.as_deref(),
            Some("[fd00:96::50]:53"),
            "recvfrom must report the v6 VIP: {o:?}"
        );
    }
    let conn = w.probe("udp-connected", "[fd00:96::50]:53", 3);
    for o in &conn {
        assert!(o.ok, "connected UDP over IPv6 must work: {o:?}");
        assert_eq!(
            o.peer.as_deref(),
            Some("[fd00:96::50]:53"),
            "getpeername must return the v6 VIP: {o:?}"
        );
    }
}

#[test]
fn dual_stack_each_family_reaches_its_own_endpoints() {
    let mut w = World::new("dual", 3, &[8080]);
    // IPv4 slice: pod1, pod2. IPv6 slice: pod3 only.
    let v4 = vec![ep(w.pod("pod1").v4), ep(w.pod("pod2").v4)];
    let v6 = vec![ep(w.pod("pod3").v6)];
    w.write_manifest(
        "dual.yaml",
        &docs(&[
            service(
                "dual",
                &["10.96.0.60", "fd00:96::60"],
                &[("http", 80, "TCP")],
                "  ipFamilies: [IPv4, IPv6]\n",
            ),
            slice("dual", "dual-v4", "IPv4", &[("http", 8080, "TCP")], &v4),
            slice("dual", "dual-v6", "IPv6", &[("http", 8080, "TCP")], &v6),
        ]),
    );
    w.start_agent(&[]);
    assert_reaches(&w, "10.96.0.60:80", 40, &set(&["pod1", "pod2"]));
    assert_reaches(&w, "[fd00:96::60]:80", 20, &set(&["pod3"]));
    // An IPv6 socket dialling the IPv4 ClusterIP as a v4-mapped address is IPv4 traffic.
    assert_reaches(&w, "[::ffff:10.96.0.60]:80", 20, &set(&["pod1", "pod2"]));
}

#[test]
fn named_target_port_resolves_through_the_slice() {
    let mut w = World::new("named", 2, &[8080]);
    let svc = with_port_fields(
        &service("named", &["10.96.0.70"], &[("http", 80, "TCP")], ""),
        80,
        "    targetPort: http\n",
    );
    w.write_manifest(
        "named.yaml",
        &docs(&[
            svc,
            slice(
                "named",
                "named-1",
                "IPv4",
                &[("http", 8080, "TCP")],
                &v4_eps(&w),
            ),
        ]),
    );
    w.start_agent(&[]);
    assert_reaches(&w, "10.96.0.70:80", 30, &all_pods(&w));
    let curl = w.client("curl", &["-s", "--max-time", "3", "http://10.96.0.70/"]);
    let body = String::from_utf8_lossy(&curl.stdout);
    assert!(
        body.starts_with("pod"),
        "curl through a named targetPort got {body:?} ({})",
        String::from_utf8_lossy(&curl.stderr)
    );
}

#[test]
fn multiple_ports_each_reach_their_own_target_port() {
    let mut w = World::new("multiport", 2, &[8080]);
    // A second server on 9090 in each pod answers with a different name, so the reply
    // tells which target port was reached.
    let _admin: Vec<ExtraServer> = w
        .pods
        .iter()
        .map(|p| ExtraServer::start(p, &format!("{}-admin", p.name), &[9090]))
        .collect();
    w.write_manifest(
        "multi.yaml",
        &docs(&[
            service(
                "multi",
                &["10.96.0.80"],
                &[
                    ("http", 80, "TCP"),
                    ("admin", 81, "TCP"),
                    ("dns", 53, "UDP"),
                ],
                "",
            ),
            slice(
                "multi",
                "multi-1",
                "IPv4",
                &[
                    ("http", 8080, "TCP"),
                    ("admin", 9090, "TCP"),
                    ("dns", 9090, "UDP"),
                ],
                &v4_eps(&w),
            ),
        ]),
    );
    w.start_agent(&[]);
    assert_reaches(&w, "10.96.0.80:80", 30, &set(&["pod1", "pod2"]));
    assert_reaches(&w, "10.96.0.80:81", 30, &set(&["pod1-admin", "pod2-admin"]));
    let udp = w.probe("udp", "10.96.0.80:53", 20);
    assert!(
        udp.iter().all(|o| o.ok),
        "UDP port of the multi-port Service must work: {udp:?}"
    );
    assert_eq!(
        backends(&udp),
        set(&["pod1-admin", "pod2-admin"]),
        "UDP 53 must reach the 9090 servers"
    );
    // A port the Service does not define is left alone.
    let other = w.probe("tcp", "10.96.0.80:82", 1);
    assert_eq!(
        other[0].errno,
        Some(ENETUNREACH),
        "undefined port 82 must not be translated: {other:?}"
    );
}
