//! Connected UDP sockets pinned to a removed backend recover within a second.
//!
//! A connected UDP socket is translated once, at `connect()`, so it stays connected to
//! its backend after that backend leaves the Service (the pod keeps running and keeps
//! answering). After a sync that removed UDP backends, the agent calls
//! `ferry::dataplane::sockdiag`, which finds such sockets in every network namespace and
//! destroys those whose cookie is in the reverse-NAT map; a resolver-like client
//! (`ferry-probe udp-connected-loop`) then reconnects through the Service.
//!
//! The first two tests go through the agent end to end and time the recovery from the
//! EndpointSlice change; the third calls the API directly. Sockets connected straight
//! to the pod, sockets pinned to a remaining backend and TCP connections are left alone.

use std::{
    io::{BufRead, BufReader, Write},
    net::SocketAddr,
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

/// A Service on VIP:53 (UDP and TCP) in front of `pods`' port 5353; `skip` is left out.
fn dns_manifest(w: &World, skip: &str) -> String {
    let eps: Vec<Ep> = w
        .pods
        .iter()
        .filter(|p| p.name != skip)
        .map(|p| ep(p.v4))
        .collect();
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
            &eps,
        ),
    ])
}

/// A dual-stack Service on VIP / VIP6 port 53 (UDP) in front of `pods`' port 5353.
fn dual_manifest(w: &World, skip: &str) -> String {
    let pods: Vec<&Pod> = w.pods.iter().filter(|p| p.name != skip).collect();
    let v4: Vec<Ep> = pods.iter().map(|p| ep(p.v4)).collect();
    let v6: Vec<Ep> = pods.iter().map(|p| ep(p.v6)).collect();
    docs(&[
        service("dns", &[VIP, VIP6], &[("dns", 53, "UDP")], ""),
        slice("dns", "dns-v4", "IPv4", &[("dns", PORT, "UDP")], &v4),
        slice("dns", "dns-v6", "IPv6", &[("dns", PORT, "UDP")], &v6),
    ])
}

/// Starts clients to `addr` until one is pinned to `pod`.
fn loop_pinned_to(w: &World, addr: &str, pod: &str, what: &str) -> UdpLoop {
    for i in 0..30 {
        let mut l = UdpLoop::start(w, &w.node_ns, addr, &format!("{what} #{i}"));
        if l.pinned_backend() == pod {
            return l;
        }
    }
    panic!("30 connected sockets to {addr} never reached {pod}")
}

/// The whole path: the EndpointSlice loses a backend, the agent syncs and destroys the
/// sockets pinned to it, the client reconnects to the pod that remains.
#[test]
fn connected_udp_client_leaves_a_removed_backend_within_a_second() {
    let mut w = World::new("udp-recover", 2, &[PORT]);
    w.write_manifest("dns.yaml", &dns_manifest(&w, ""));
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
    let mut other = loop_pinned_to(&w, &target, &stay, "client via the Service");
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
    // Everything so far is history.
    client.pump(Duration::from_millis(100));

    // Remove `gone` from the EndpointSlice; its pod keeps running and answering.
    let removed = Instant::now();
    w.write_manifest("dns.yaml", &dns_manifest(&w, &gone));
    let in_maps = wait_removed(&w, &[&target], &[format!("{gone_ip}:{PORT}")]);
    eprintln!(
        "removal visible in `ferry list` {:?} after the EndpointSlice changed",
        in_maps - removed
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
}

/// The same for an IPv6 Service and for an IPv6 socket that dials the IPv4 ClusterIP
/// v4-mapped (the kernel connects it to `::ffff:<pod>`).
#[test]
fn ipv6_and_v4_mapped_connected_clients_recover() {
    let mut w = World::new("udp-recover6", 2, &[PORT]);
    w.write_manifest("dns.yaml", &dual_manifest(&w, ""));
    w.start_agent(&[]);
    let node = w.node_ns.clone();
    let target6 = format!("[{VIP6}]:53");
    let target_mapped = format!("[::ffff:{VIP}]:53");

    let mut v6 = UdpLoop::start(&w, &node, &target6, "IPv6 client");
    let gone = v6.pinned_backend();
    let mut mapped = loop_pinned_to(&w, &target_mapped, &gone, "v4-mapped client");
    assert!(
        mapped.local().unwrap().starts_with("[::ffff:"),
        "the mapped client must be an IPv6 socket: {:?}",
        mapped.local()
    );
    let pod = w.pod(&gone);
    let (gone4, gone6) = (pod.v4, pod.v6);
    v6.pump(Duration::from_millis(100));
    mapped.pump(Duration::from_millis(100));

    let removed = Instant::now();
    w.write_manifest("dns.yaml", &dual_manifest(&w, &gone));
    wait_removed(
        &w,
        &[&format!("{VIP}:53"), &target6],
        &[format!("{gone4}:{PORT}"), format!("[{gone6}]:{PORT}")],
    );
    assert_recovers(&mut v6, removed, &gone);
    assert_recovers(&mut mapped, removed, &gone);
}

/// The API on its own (what the agent calls): with one pod, nothing is removed and the
/// agent leaves every socket alone; a direct call destroys exactly the sockets connected
/// through the Service, in every family, and they reconnect.
#[test]
fn destroy_hits_only_sockets_connected_through_a_service() {
    let mut w = World::new("udp-sockdiag", 1, &[PORT]);
    w.write_manifest("dns.yaml", &dual_manifest(&w, ""));
    w.start_agent(&[]);
    let node = w.node_ns.clone();
    let pod = w.pod("pod1");
    let (ip4, ip6) = (pod.v4, pod.v6);

    let mut via: Vec<UdpLoop> = [
        (format!("{VIP}:53"), "IPv4 via the Service"),
        (format!("[{VIP6}]:53"), "IPv6 via the Service"),
        (format!("[::ffff:{VIP}]:53"), "v4-mapped via the Service"),
    ]
    .iter()
    .map(|(a, what)| UdpLoop::start(&w, &node, a, what))
    .collect();
    let mut direct: Vec<UdpLoop> = [
        (format!("{ip4}:{PORT}"), "IPv4 to the pod"),
        (format!("[{ip6}]:{PORT}"), "IPv6 to the pod"),
        (format!("[::ffff:{ip4}]:{PORT}"), "v4-mapped to the pod"),
    ]
    .iter()
    .map(|(a, what)| UdpLoop::start(&w, &node, a, what))
    .collect();
    for l in via.iter_mut().chain(direct.iter_mut()) {
        assert_eq!(l.pinned_backend(), "pod1", "{}", l.what);
    }
    let via_locals: Vec<String> = via.iter().map(|l| l.local().unwrap()).collect();
    let direct_locals: Vec<String> = direct.iter().map(|l| l.local().unwrap()).collect();

    let t = Instant::now();
    let report = sockdiag::destroy_udp_sockets_through_services(
        &w.bpffs,
        &[(ip4.into(), PORT), (ip6.into(), PORT)],
    )
    .expect("destroying UDP sockets");
    eprintln!("destroy took {:?}: {report:?}", t.elapsed());
    assert!(report.failures.is_empty(), "failures: {report:?}");
    for (l, local) in via.iter().zip(&via_locals) {
        assert!(
            destroyed_local(&report, local),
            "{} ({local}) must be destroyed: {report:?}",
            l.what
        );
    }
    for (l, local) in direct.iter().zip(&direct_locals) {
        assert!(
            !destroyed_local(&report, local),
            "{} ({local}) must be left alone: {report:?}",
            l.what
        );
    }
    assert_eq!(
        report.destroyed.len(),
        via.len(),
        "only the sockets via the Service: {report:?}"
    );
    assert_eq!(
        report.direct,
        direct.len(),
        "the sockets to the pod IP are seen and skipped: {report:?}"
    );
    let peers: Vec<SocketAddr> = report.destroyed.iter().map(|d| d.peer).collect();
    assert!(
        peers.contains(&SocketAddr::new(ip4.into(), PORT))
            && peers.contains(&SocketAddr::new(ip6.into(), PORT)),
        "peers are the backends: {peers:?}"
    );

    for (l, old) in via.iter_mut().zip(&via_locals) {
        // The next query fails once, the client reconnects through the Service.
        let (_, err) = l
            .wait_for(Duration::from_secs(2), |x| !x.ok)
            .unwrap_or_else(|| panic!("{}: no failed query after the destroy", l.what));
        assert!(
            matches!(
                err.errno,
                Some(libc::EDESTADDRREQ) | Some(libc::ECONNABORTED)
            ),
            "{}: a destroyed connected socket fails with EDESTADDRREQ or ECONNABORTED: {err:?}",
            l.what
        );
        l.wait_for(Duration::from_secs(2), |x| x.is_query() && x.ok)
            .unwrap_or_else(|| panic!("{}: no answer after reconnecting", l.what));
        assert_ne!(
            l.local().as_ref(),
            Some(old),
            "{}: must be on a new socket",
            l.what
        );
    }
    std::thread::sleep(Duration::from_millis(600));
    for (l, local) in direct.iter_mut().zip(&direct_locals) {
        l.pump(Duration::from_millis(20));
        assert_untouched(l, t, "pod1", local);
    }
}
