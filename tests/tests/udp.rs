//! UDP through the socket hooks: unconnected and connected sockets, reply source
//! rewriting, per-socket stickiness, and TCP/UDP on one port as separate ServicePorts.

use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader, Write},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    time::Duration,
};

use ferry_tests::*;

const VIP: &str = "10.96.0.53";

/// Three pods serving UDP (and TCP) on 5353 behind VIP:53/UDP.
fn dns_world(test: &str) -> World {
    let mut w = World::new(test, 3, &[5353]);
    let eps: Vec<Ep> = w.pods.iter().map(|p| ep(p.v4)).collect();
    w.write_manifest(
        "dns.yaml",
        &docs(&[
            service("dns", &[VIP], &[("dns", 53, "UDP")], ""),
            slice("dns", "dns-1", "IPv4", &[("dns", 5353, "UDP")], &eps),
        ]),
    );
    w.start_agent(&[]);
    w
}

#[test]
fn unconnected_udp_round_trip_and_reply_source_is_the_vip() {
    let w = dns_world("udp-unconn");
    let outs = w.probe("udp", &format!("{VIP}:53"), 45);
    for o in &outs {
        assert!(
            o.ok,
            "sendto/recvfrom through the ClusterIP must work: expected a reply, saw {o:?}"
        );
        assert!(
            o.reply.as_deref().is_some_and(|r| r.ends_with(" hi")),
            "reply must echo the datagram: expected \"podN hi\", saw {:?}",
            o.reply
        );
        assert_eq!(
            o.from.as_deref(),
            Some("10.96.0.53:53"),
            "recvfrom must report the VIP:port the client sent to, not the pod: {o:?}"
        );
    }
    // Each run of `udp` uses a fresh socket per datagram: they spread over the pods.
    assert_eq!(
        backends(&outs),
        all_pods(&w),
        "45 fresh sockets should reach all 3 pods"
    );
}

#[test]
fn connected_udp_works_and_getpeername_is_the_vip() {
    let w = dns_world("udp-conn");
    let outs = w.probe("udp-connected", &format!("{VIP}:53"), 10);
    for o in &outs {
        assert!(
            o.ok,
            "connect+send+recv through the ClusterIP must work: {o:?}"
        );
        assert!(
            o.backend().is_some_and(|b| b.starts_with("pod")),
            "expected a pod's reply, saw {o:?}"
        );
        assert_eq!(
            o.peer.as_deref(),
            Some("10.96.0.53:53"),
            "getpeername must return the VIP: {o:?}"
        );
        assert_eq!(
            o.from.as_deref(),
            Some("10.96.0.53:53"),
            "recvfrom on a connected socket must show the VIP: {o:?}"
        );
    }
}

#[test]
fn one_unconnected_socket_sticks_to_one_backend() {
    let w = dns_world("udp-sticky");
    let mut chosen = BTreeSet::new();
    // Several sockets: each one internally sticky; together they are not pinned to one pod.
    for round in 0..8 {
        let outs = w.probe("udp-multi", &format!("{VIP}:53"), 15);
        assert_eq!(
            outs.len(),
            15,
            "udp-multi must report 15 datagrams: {outs:?}"
        );
        assert!(
            outs.iter().all(|o| o.ok),
            "every datagram must be answered (round {round}): {outs:?}"
        );
        let seen = backends(&outs);
        assert_eq!(
            seen.len(),
            1,
            "15 datagrams from one socket must reach one pod (round {round}); saw {seen:?}"
        );
        for o in &outs {
            assert_eq!(
                o.from.as_deref(),
                Some("10.96.0.53:53"),
                "reply source must be the VIP: {o:?}"
            );
        }
        chosen.extend(seen);
        if chosen.len() > 1 {
            break;
        }
    }
    assert!(
        chosen.len() > 1,
        "8 separate sockets all stuck to {chosen:?}: stickiness must be per socket, not global"
    );
}

#[test]
fn tcp_and_udp_on_one_port_are_independent_and_udp_removal_is_live() {
    // pod1 is the TCP backend (8080), pod2 the UDP backend (9090).
    let mut w = World::new("udp-tcp", 2, &[8080, 9090]);
    let tcp_ep = vec![ep(w.pod("pod1").v4)];
    let udp_ep = vec![ep(w.pod("pod2").v4)];
    let both = docs(&[
        service(
            "mixed",
            &[VIP],
            &[("tcp", 53, "TCP"), ("udp", 53, "UDP")],
            "",
        ),
        slice(
            "mixed",
            "mixed-tcp",
            "IPv4",
            &[("tcp", 8080, "TCP")],
            &tcp_ep,
        ),
        slice(
            "mixed",
            "mixed-udp",
            "IPv4",
            &[("udp", 9090, "UDP")],
            &udp_ep,
        ),
    ]);
    w.write_manifest("mixed.yaml", &both);
    w.start_agent(&[]);
    let target = format!("{VIP}:53");

    let tcp = w.probe("tcp", &target, 10);
    assert!(
        tcp.iter().all(|o| o.ok),
        "TCP to {target} must work: {tcp:?}"
    );
    assert_eq!(
        backends(&tcp),
        BTreeSet::from(["pod1".to_string()]),
        "TCP must reach only its own backend pod1"
    );
    let udp = w.probe("udp", &target, 10);
    assert!(
        udp.iter().all(|o| o.ok),
        "UDP to {target} must work: {udp:?}"
    );
    assert_eq!(
        backends(&udp),
        BTreeSet::from(["pod2".to_string()]),
        "UDP must reach only its own backend pod2"
    );

    // Drop the UDP port from the Service (the slice stays): UDP stops, TCP keeps working.
    w.write_manifest(
        "mixed.yaml",
        &docs(&[
            service("mixed", &[VIP], &[("tcp", 53, "TCP")], ""),
            slice(
                "mixed",
                "mixed-tcp",
                "IPv4",
                &[("tcp", 8080, "TCP")],
                &tcp_ep,
            ),
            slice(
                "mixed",
                "mixed-udp",
                "IPv4",
                &[("udp", 9090, "UDP")],
                &udp_ep,
            ),
        ]),
    );
    eventually(
        "UDP to the removed port is no longer translated",
        Duration::from_secs(5),
        || {
            let o = &w.probe("udp", &target, 1)[0];
            // The VIP is not routed in this node: an untranslated sendto fails at once.
            if !o.ok && o.errno == Some(ENETUNREACH) {
                Ok(())
            } else {
                Err(format!("expected ENETUNREACH, saw {o:?}"))
            }
        },
    );
    let tcp = w.probe("tcp", &target, 10);
    assert!(
        tcp.iter().all(|o| o.ok),
        "TCP must keep working after the UDP port is removed: {tcp:?}"
    );
    assert_eq!(
        backends(&tcp),
        BTreeSet::from(["pod1".to_string()]),
        "TCP must still reach pod1 only"
    );

    // And back: UDP returns without disturbing TCP.
    w.write_manifest("mixed.yaml", &both);
    eventually("UDP port is served again", Duration::from_secs(5), || {
        let o = &w.probe("udp", &target, 1)[0];
        if o.backend() == Some("pod2") {
            Ok(())
        } else {
            Err(format!("expected a reply from pod2, saw {o:?}"))
        }
    });
}

/// `ferry-probe udp-session ADDR`: one unconnected socket in the world's cgroup, one
/// datagram per `send`.
struct UdpSession {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl UdpSession {
    fn start(w: &World, addr: &str) -> UdpSession {
        let mut cmd = Command::new(bin("ferry-probe"));
        cmd.args(["udp-session", addr])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = spawn_in(&w.node_ns, Some(&w.cgroup), &mut cmd);
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).expect("udp-session ready line");
        assert_eq!(line.trim(), "ready", "udp-session did not start");
        UdpSession {
            child,
            stdin,
            stdout,
        }
    }

    fn send(&mut self, payload: &str) -> Outcome {
        writeln!(self.stdin, "{payload}").expect("write to udp-session");
        self.stdin.flush().ok();
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .expect("udp-session reply line");
        let o: Outcome = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("bad udp-session line {line:?}: {e}"));
        if o.ok {
            let reply = o.reply.as_deref().unwrap_or("");
            assert!(
                reply.ends_with(&format!(" {payload}")),
                "reply {reply:?} is not the answer to {payload:?} (stale datagram?)"
            );
        }
        o
    }
}

impl Drop for UdpSession {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn sticky_socket_moves_when_its_backend_is_removed() {
    let w = dns_world("udp-move");
    let target = format!("{VIP}:53");
    let mut s = UdpSession::start(&w, &target);
    let mut first = BTreeSet::new();
    for i in 0..10 {
        let o = s.send(&format!("a{i}"));
        assert!(o.ok, "datagram a{i} must be answered: {o:?}");
        first.extend(o.backend().map(String::from));
    }
    assert_eq!(
        first.len(),
        1,
        "one socket must stick to one pod, saw {first:?}"
    );
    let gone = first.into_iter().next().unwrap();

    // Remove the socket's backend from the Service; its pod keeps running, so a stale
    // stickiness entry would keep getting answers from it.
    let eps: Vec<Ep> = w
        .pods
        .iter()
        .filter(|p| p.name != gone)
        .map(|p| ep(p.v4))
        .collect();
    w.write_manifest(
        "dns.yaml",
        &docs(&[
            service("dns", &[VIP], &[("dns", 53, "UDP")], ""),
            slice("dns", "dns-1", "IPv4", &[("dns", 5353, "UDP")], &eps),
        ]),
    );
    let mut n = 0;
    let moved = eventually(
        &format!("the socket leaves removed backend {gone}"),
        Duration::from_secs(5),
        || {
            n += 1;
            let o = s.send(&format!("b{n}"));
            match o.backend() {
                Some(b) if o.ok && b != gone => Ok(b.to_string()),
                _ => Err(format!(
                    "expected a reply from a pod other than {gone}, saw {o:?}"
                )),
            }
        },
    );
    // And it sticks to its new backend.
    for i in 0..10 {
        let o = s.send(&format!("c{i}"));
        assert_eq!(
            o.backend(),
            Some(moved.as_str()),
            "after moving, the socket must stick to {moved}: {o:?}"
        );
        assert_eq!(
            o.from.as_deref(),
            Some("10.96.0.53:53"),
            "reply source must stay the VIP: {o:?}"
        );
    }
}
