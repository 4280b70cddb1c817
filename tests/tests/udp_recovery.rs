//! Connected UDP sockets pinned to a removed backend recover within a second.
//!
//! A connected UDP socket is translated once, at `connect()`, so it stays connected to
//! its backend after that backend leaves the Service (the pod keeps running and keeps
//! answering). `ferry::dataplane::sockdiag` finds such sockets in every network namespace
//! and destroys them when their cookie is in the reverse-NAT map; a resolver-like client
//! then reconnects through the Service. These tests call it the way the agent will:
//! right after the removal is visible in the maps (`ferry list`).
//!
//! Sockets connected straight to the pod, sockets pinned to a remaining backend and TCP
//! connections are left alone.

use std::{
    io::{BufRead, BufReader, Write},
    net::{IpAddr, SocketAddr},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use ferry::dataplane::sockdiag::{self, DestroyReport};
use ferry_tests::*;
use serde::Deserialize;

const VIP: &str = "10.96.0.53";
const VIP6: &str = "fd00:96::53";
const PORT: u16 = 5353;
/// The requirement: answers from a remaining backend within this long after the removal.
const RECOVERY: Duration = Duration::from_secs(1);

/// One line of `ferry-probe udp-connected-loop` (every field shows in failure messages).
#[allow(dead_code)]
#[derive(Debug, Clone, Deserialize)]
struct Line {
    op: String,
    seq: u64,
    local: Option<String>,
    t_ms: u128,
    ok: bool,
    reply: Option<String>,
    peer: Option<String>,
    errno: Option<i32>,
    error: Option<String>,
}

impl Line {
    fn backend(&self) -> Option<&str> {
        self.reply
            .as_deref()
            .and_then(|r| r.split_whitespace().next())
    }
    fn is_query(&self) -> bool {
        self.op == "query"
    }
}

/// A resolver-like client: `ferry-probe udp-connected-loop`, in the world's cgroup.
struct UdpLoop {
    what: String,
    child: Child,
    rx: mpsc::Receiver<Result<(Instant, Line), String>>,
    /// Every line so far, with the time it arrived here.
    seen: Vec<(Instant, Line)>,
}

impl UdpLoop {
    fn start(w: &World, netns: &str, addr: &str, what: &str) -> UdpLoop {
        let mut cmd = Command::new(bin("ferry-probe"));
        cmd.args(["udp-connected-loop", addr, "60000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = spawn_in(netns, Some(&w.cgroup), &mut cmd);
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                let parsed = serde_json::from_str::<Line>(&l)
                    .map(|line| (Instant::now(), line))
                    .map_err(|e| format!("bad probe line {l:?}: {e}"));
                if tx.send(parsed).is_err() {
                    break;
                }
            }
        });
        UdpLoop {
            what: what.to_string(),
            child,
            rx,
            seen: Vec::new(),
        }
    }

    /// Collects lines until `pred` holds for a new one (returned) or `within` passes.
    fn wait_for(
        &mut self,
        within: Duration,
        mut pred: impl FnMut(&Line) -> bool,
    ) -> Option<(Instant, Line)> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(Ok((t, l))) => {
                    self.seen.push((t, l.clone()));
                    if pred(&l) {
                        return Some((t, l));
                    }
                }
                Ok(Err(e)) => panic!("{}: {e}", self.what),
                Err(mpsc::RecvTimeoutError::Timeout) => return None,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("{}: probe exited; lines: {:?}", self.what, self.lines())
                }
            }
        }
    }

    /// Collects lines for `d`.
    fn pump(&mut self, d: Duration) {
        self.wait_for(d, |_| false);
    }

    /// The backend of the first answered query.
    fn pinned_backend(&mut self) -> String {
        let (_, l) = self
            .wait_for(Duration::from_secs(5), |l| l.is_query() && l.ok)
            .unwrap_or_else(|| {
                panic!(
                    "{}: no answered query within 5 s; lines: {:?}",
                    self.what,
                    self.lines()
                )
            });
        l.backend().expect("reply has a backend").to_string()
    }

    /// The local address of the socket in use now.
    fn local(&self) -> Option<String> {
        self.seen
            .iter()
            .rev()
            .find(|(_, l)| l.op == "connect" && l.ok)
            .and_then(|(_, l)| l.local.clone())
    }

    fn since(&self, t: Instant) -> Vec<&Line> {
        self.seen
            .iter()
            .filter(|(at, _)| *at >= t)
            .map(|(_, l)| l)
            .collect()
    }

    fn lines(&self) -> Vec<&Line> {
        self.seen.iter().map(|(_, l)| l).collect()
    }
}

impl Drop for UdpLoop {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ferry-probe tcp-session`: one established TCP connection.
struct TcpSession {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl TcpSession {
    fn start(w: &World, addr: &str) -> TcpSession {
        let mut child = w.session(addr);
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).expect("tcp-session line");
        assert_eq!(
            line.trim(),
            "connected",
            "tcp-session to {addr} did not connect"
        );
        TcpSession {
            child,
            stdin,
            stdout,
        }
    }

    fn ask(&mut self, payload: &str) -> Outcome {
        writeln!(self.stdin, "{payload}").expect("write to tcp-session");
        self.stdin.flush().ok();
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("tcp-session reply");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad tcp-session line {line:?}: {e}"))
    }
}

impl Drop for TcpSession {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Socket addresses compared as the kernel sees them (`::ffff:a.b.c.d` is `a.b.c.d`).
fn canon(a: &str) -> SocketAddr {
    let a: SocketAddr = a.parse().unwrap_or_else(|e| panic!("address {a:?}: {e}"));
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

fn destroyed_local(r: &DestroyReport, local: &str) -> bool {
    r.destroyed.iter().any(|d| d.local == canon(local))
}

/// Backends of the local-origin UDP frontend `frontend` as `ferry list` shows them.
fn udp_backends(w: &World, frontend: &str) -> Vec<String> {
    let v = w.list_json();
    v["frontends"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| {
            f["frontend"] == frontend && f["protocol"] == "UDP" && f["scope"] == "local-origin"
        })
        .flat_map(|f| f["backends"].as_array().cloned().unwrap_or_default())
        .filter_map(|b| b["address"].as_str().map(String::from))
        .collect()
}

/// Waits until none of `gone` is a backend of any of `frontends` in the maps; returns
/// the moment it saw that (what the agent would see after its sync).
fn wait_removed(w: &World, frontends: &[&str], gone: &[String]) -> Instant {
    eventually(
        "the removal is in the maps",
        Duration::from_secs(10),
        || {
            for f in frontends {
                let b = udp_backends(w, f);
                if b.is_empty() {
                    return Err(format!("frontend {f} not listed"));
                }
                if let Some(g) = gone.iter().find(|g| b.contains(g)) {
                    return Err(format!("{f} still has backend {g}: {b:?}"));
                }
            }
            Ok(Instant::now())
        },
    )
}

/// Asserts `l` reaches a backend other than `gone` within [`RECOVERY`] of `removed`,
/// after one failed query, and keeps answering from it; returns the new backend.
fn assert_recovers(l: &mut UdpLoop, removed: Instant, gone: &str) -> String {
    let (at, line) = l
        .wait_for(RECOVERY + Duration::from_secs(4), |x| {
            x.is_query() && x.ok && x.backend().is_some_and(|b| b != gone)
        })
        .unwrap_or_else(|| {
            panic!(
                "{}: never answered by a pod other than {gone} after the removal; lines since: {:#?}",
                l.what,
                l.since(removed)
            )
        });
    let took = at - removed;
    let errors: Vec<&Line> = l.since(removed).into_iter().filter(|x| !x.ok).collect();
    eprintln!(
        "{}: answered by {} {took:?} after the removal; errors on the way: {:?}",
        l.what,
        line.backend().unwrap(),
        errors
            .iter()
            .map(|e| (e.op.as_str(), e.errno, e.error.as_deref()))
            .collect::<Vec<_>>()
    );
    assert!(
        took <= RECOVERY,
        "{}: a remaining backend answered only {took:?} after the removal (limit {RECOVERY:?}); lines: {:#?}",
        l.what,
        l.since(removed)
    );
    assert!(
        !errors.is_empty() && errors.len() <= 2,
        "{}: recovery should cost exactly the one failed query that notices the abort \
         (at most one more); errors: {errors:#?}",
        l.what
    );
    let moved = line.backend().unwrap().to_string();
    // It stays on its new backend, without further errors.
    let t = Instant::now();
    l.pump(Duration::from_millis(500));
    let after = l.since(t);
    assert!(
        after.iter().filter(|x| x.is_query()).count() >= 5,
        "{}: the client stopped querying: {after:#?}",
        l.what
    );
    for x in after {
        assert!(
            x.ok && (!x.is_query() || x.backend() == Some(moved.as_str())),
            "{}: after recovering to {moved} every query must be answered by it: {x:?}",
            l.what
        );
    }
    moved
}

/// Asserts `l` answered every query since `t`, from `pod`, on one socket.
fn assert_untouched(l: &UdpLoop, t: Instant, pod: &str, local: &str) {
    let lines = l.since(t);
    assert!(
        lines.iter().filter(|x| x.is_query()).count() >= 10,
        "{}: too few queries since the removal: {lines:#?}",
        l.what
    );
    for x in &lines {
        assert!(
            x.is_query() && x.ok && x.backend() == Some(pod),
            "{}: must keep its socket and its answers from {pod}: {x:?}\nall: {lines:#?}",
            l.what
        );
        assert_eq!(
            x.local.as_deref(),
            Some(local),
            "{}: the socket was replaced: {x:?}",
            l.what
        );
    }
}

fn pod_name_of(w: &World, ip: IpAddr) -> String {
    w.pods
        .iter()
        .find(|p| IpAddr::V4(p.v4) == ip || IpAddr::V6(p.v6) == ip)
        .map(|p| p.name.clone())
        .unwrap()
}

#[test]
fn connected_udp_client_leaves_a_removed_backend_within_a_second() {
    let mut w = World::new("udp-recover", 2, &[PORT]);
    let eps = |w: &World, skip: &str| -> Vec<Ep> {
        w.pods
            .iter()
            .filter(|p| p.name != skip)
            .map(|p| ep(p.v4))
            .collect()
    };
    let manifest = |eps: &[Ep]| {
        docs(&[
            service(
                "dns",
                &[VIP],
                &[("dns", 53, "UDP"), ("dns-tcp", 53, "TCP")],
                "",
            ),
            slice(
                "dns",
                "dns-1",
                "IPv4",
                &[("dns", PORT, "UDP"), ("dns-tcp", PORT, "TCP")],
                eps,
            ),
        ])
    };
    w.write_manifest("dns.yaml", &manifest(&eps(&w, "")));
    w.start_agent(&[]);
    let target = format!("{VIP}:53");
    let node = w.node_ns.clone();

    // The client under test, pinned (by its connect) to `gone`.
    let mut client = UdpLoop::start(&w, &node, &target, "client via the Service");
    let gone = client.pinned_backend();
    let stay = all_pods(&w).into_iter().find(|p| *p != gone).unwrap();
    let gone_ip = w.pod(&gone).v4;
    let client_local = client.local().expect("client socket");

    // A client pinned to the other pod: it must not notice anything.
    let mut other = None;
    for i in 0..30 {
        let mut l = UdpLoop::start(&w, &node, &target, &format!("client via the Service #{i}"));
        if l.pinned_backend() == stay {
            other = Some(l);
            break;
        }
    }
    let mut other = other.unwrap_or_else(|| panic!("30 connected sockets never reached {stay}"));
    let other_local = other.local().unwrap();

    // A socket connected straight to the pod that is about to be removed.
    let mut direct = UdpLoop::start(
        &w,
        &node,
        &format!("{gone_ip}:{PORT}"),
        "client connected to the pod IP",
    );
    assert_eq!(direct.pinned_backend(), gone);
    let direct_local = direct.local().unwrap();

    // An established TCP connection through the Service to `gone`.
    let mut tcp = None;
    for i in 0..30 {
        let mut s = TcpSession::start(&w, &target);
        let o = s.ask(&format!("t{i}"));
        assert!(o.ok, "TCP through the Service must work: {o:?}");
        if o.backend() == Some(gone.as_str()) {
            tcp = Some(s);
            break;
        }
    }
    let mut tcp = tcp.unwrap_or_else(|| panic!("30 TCP connections never reached {gone}"));

    // Remove `gone` from the EndpointSlice; its pod keeps running and answering.
    w.write_manifest("dns.yaml", &manifest(&eps(&w, &gone)));
    let removed = wait_removed(&w, &[&target], &[format!("{gone_ip}:{PORT}")]);
    // Until something acts, the connected client is still answered by the removed pod.
    let report =
        sockdiag::destroy_udp_sockets_through_services(&w.bpffs, &[(gone_ip.into(), PORT)])
            .expect("destroying UDP sockets");
    eprintln!(
        "destroy took {:?} after the removal: {report:?}",
        removed.elapsed()
    );
    assert!(
        report.failures.is_empty(),
        "destroy reported failures: {report:?}"
    );
    assert!(
        destroyed_local(&report, &client_local),
        "the client's socket {client_local} -> {gone_ip}:{PORT} must be destroyed: {report:?}"
    );
    assert!(
        !destroyed_local(&report, &direct_local),
        "the socket connected straight to the pod must be left alone: {report:?}"
    );
    assert!(
        !destroyed_local(&report, &other_local),
        "a socket on a remaining backend must be left alone: {report:?}"
    );
    assert!(
        report.direct >= 1,
        "the socket connected to the pod IP must be seen and skipped: {report:?}"
    );

    let moved = assert_recovers(&mut client, removed, &gone);
    assert_eq!(moved, stay);
    assert_ne!(
        client.local().as_deref(),
        Some(client_local.as_str()),
        "the client must be on a new socket"
    );

    direct.pump(Duration::from_millis(800));
    assert_untouched(&direct, removed, &gone, &direct_local);
    other.pump(Duration::from_millis(100));
    assert_untouched(&other, removed, &stay, &other_local);

    for i in 0..3 {
        let o = tcp.ask(&format!("after{i}"));
        assert!(
            o.ok && o.backend() == Some(gone.as_str()),
            "the established TCP connection to the removed backend {gone} must keep working: {o:?}"
        );
    }

    // Running it again finds nothing left to do.
    let again = sockdiag::destroy_udp_sockets_through_services(&w.bpffs, &[(gone_ip.into(), PORT)])
        .expect("second destroy");
    assert!(
        again.destroyed.is_empty(),
        "nothing is left to destroy: {again:?}"
    );
}

#[test]
fn ipv6_and_v4_mapped_connected_clients_recover() {
    let mut w = World::new("udp-recover6", 2, &[PORT]);
    let manifest = |w: &World, skip: &str| {
        let pods: Vec<&Pod> = w.pods.iter().filter(|p| p.name != skip).collect();
        let v4: Vec<Ep> = pods.iter().map(|p| ep(p.v4)).collect();
        let v6: Vec<Ep> = pods.iter().map(|p| ep(p.v6)).collect();
        docs(&[
            service("dns", &[VIP, VIP6], &[("dns", 53, "UDP")], ""),
            slice("dns", "dns-v4", "IPv4", &[("dns", PORT, "UDP")], &v4),
            slice("dns", "dns-v6", "IPv6", &[("dns", PORT, "UDP")], &v6),
        ])
    };
    w.write_manifest("dns.yaml", &manifest(&w, ""));
    w.start_agent(&[]);
    let node = w.node_ns.clone();
    let target6 = format!("[{VIP6}]:53");
    let target_mapped = format!("[::ffff:{VIP}]:53");

    let mut v6 = UdpLoop::start(&w, &node, &target6, "IPv6 client");
    let gone = v6.pinned_backend();
    // An IPv6 socket that dials the IPv4 ClusterIP v4-mapped, pinned to the same pod.
    let mut mapped = None;
    for i in 0..30 {
        let mut l = UdpLoop::start(&w, &node, &target_mapped, &format!("v4-mapped client #{i}"));
        if l.pinned_backend() == gone {
            mapped = Some(l);
            break;
        }
    }
    let mut mapped = mapped.unwrap_or_else(|| panic!("30 v4-mapped sockets never reached {gone}"));
    let (v6_local, mapped_local) = (v6.local().unwrap(), mapped.local().unwrap());
    assert!(
        mapped_local.starts_with("[::ffff:"),
        "the mapped client must be an IPv6 socket: {mapped_local}"
    );
    let pod = w.pod(&gone);
    let (gone4, gone6) = (IpAddr::V4(pod.v4), IpAddr::V6(pod.v6));
    assert_eq!(pod_name_of(&w, gone6), gone);

    w.write_manifest("dns.yaml", &manifest(&w, &gone));
    let removed = wait_removed(
        &w,
        &[&format!("{VIP}:53"), &target6],
        &[format!("{gone4}:{PORT}"), format!("[{gone6}]:{PORT}")],
    );
    // The v4 backend given v4-mapped: the same as IpAddr::V4 to the API.
    let gone4_mapped = IpAddr::V6(pod.v4.to_ipv6_mapped());
    let report = sockdiag::destroy_udp_sockets_through_services(
        &w.bpffs,
        &[(gone4_mapped, PORT), (gone6, PORT)],
    )
    .expect("destroying UDP sockets");
    eprintln!("destroy: {report:?}");
    assert!(report.failures.is_empty(), "failures: {report:?}");
    assert!(
        destroyed_local(&report, &v6_local) && destroyed_local(&report, &mapped_local),
        "both the IPv6 socket {v6_local} and the v4-mapped socket {mapped_local} must be destroyed: {report:?}"
    );
    assert_recovers(&mut v6, removed, &gone);
    assert_recovers(&mut mapped, removed, &gone);
}
