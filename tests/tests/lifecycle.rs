//! Agent lifecycle: restarts (SIGTERM, SIGKILL) keep traffic flowing and state adopted,
//! changes made while the agent was down are applied and pruned after restart, and
//! `ferry cleanup` leaves nothing behind.

use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader, Write},
    path::Path,
    process::{Child, ChildStdin, ChildStdout, Command},
};

use ferry_tests::*;

const WEB_VIP: &str = "10.96.0.10";
const API_VIP: &str = "10.96.0.11";

/// A `ferry-probe tcp-session` child: one established connection, one line at a time.
struct Session {
    /// The Service address dialled: what getpeername must keep reporting.
    addr: String,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Session {
    fn open(w: &World, addr: &str) -> Session {
        let mut child = w.session(addr);
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).expect("session first line");
        if line.trim() != "connected" {
            let mut err = String::new();
            let _ = std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err);
            panic!("tcp-session to {addr}: expected \"connected\", saw {line:?} (stderr: {err})");
        }
        Session {
            addr: addr.to_string(),
            child,
            stdin,
            stdout,
        }
    }

    /// Sends `text` over the established connection and returns the reply's outcome.
    fn send(&mut self, text: &str) -> Outcome {
        writeln!(self.stdin, "{text}").expect("write to tcp-session");
        self.stdin.flush().expect("flush tcp-session");
        let mut line = String::new();
        let n = self
            .stdout
            .read_line(&mut line)
            .expect("read from tcp-session");
        assert!(n > 0, "tcp-session exited instead of answering {text:?}");
        serde_json::from_str(line.trim())
            .unwrap_or_else(|e| panic!("bad tcp-session line {line:?}: {e}"))
    }

    /// Asserts the connection still answers from `backend`.
    fn expect_reply(&mut self, text: &str, backend: &str, when: &str) {
        let o = self.send(text);
        assert!(
            o.ok,
            "{when}: the established connection must keep working; expected a reply from {backend}, saw {o:?}"
        );
        assert_eq!(
            o.reply.as_deref(),
            Some(format!("{backend} {text}").as_str()),
            "{when}: expected the same backend to echo on the established connection"
        );
        assert_eq!(
            o.peer.as_deref(),
            Some(self.addr.as_str()),
            "{when}: getpeername on the established connection must still report the Service address"
        );
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn two_pod_web(test: &str) -> World {
    let mut w = World::new(test, 2, &[8080]);
    let eps: Vec<Ep> = w.pods.iter().map(|p| ep(p.v4)).collect();
    w.write_manifest(
        "web.yaml",
        &docs(&[
            service("web", &[WEB_VIP], &[("http", 80, "TCP")], ""),
            slice("web", "web-1", "IPv4", &[("http", 8080, "TCP")], &eps),
        ]),
    );
    w.start_agent(&[]);
    w
}

/// The `frontends` of `ferry list -o json` (counters left out: they move with traffic).
fn frontends(w: &World) -> serde_json::Value {
    w.list_json()["frontends"].clone()
}

/// (frontend, protocol, backend addresses) for every frontend in `ferry list -o json`.
fn frontend_summary(w: &World) -> BTreeSet<(String, String, Vec<String>)> {
    let fe = frontends(w);
    fe.as_array()
        .unwrap_or_else(|| panic!("ferry list: frontends is not an array: {fe}"))
        .iter()
        .map(|f| {
            let mut b: Vec<String> = f["backends"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b["address"].as_str().unwrap().to_string())
                .collect();
            b.sort();
            (
                f["frontend"].as_str().unwrap().to_string(),
                f["protocol"].as_str().unwrap().to_string(),
                b,
            )
        })
        .collect()
}

/// Programs attached to `cgroup` (`bpftool -j cgroup show`): (attach_type, name).
fn cgroup_programs(cgroup: &Path) -> Vec<(String, String)> {
    let out = Command::new("bpftool")
        .args(["-j", "cgroup", "show"])
        .arg(cgroup)
        .output()
        .expect("bpftool");
    assert!(
        out.status.success(),
        "bpftool cgroup show {} failed: {}",
        cgroup.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    if text.trim().is_empty() {
        return Vec::new();
    }
    let v: serde_json::Value =
        serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("bpftool json {text:?}: {e}"));
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|p| {
                    (
                        p["attach_type"].as_str().unwrap_or_default().to_string(),
                        p["name"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The socket-address hooks ferry attaches (one program each).
const SOCK_ADDR_HOOKS: [&str; 8] = [
    "cgroup_inet4_connect",
    "cgroup_inet6_connect",
    "cgroup_udp4_sendmsg",
    "cgroup_udp6_sendmsg",
    "cgroup_udp4_recvmsg",
    "cgroup_udp6_recvmsg",
    "cgroup_inet4_getpeername",
    "cgroup_inet6_getpeername",
];

fn assert_attached_once(w: &World, when: &str) {
    let progs = cgroup_programs(&w.cgroup);
    let mut types: Vec<&str> = progs.iter().map(|(t, _)| t.as_str()).collect();
    types.sort();
    let mut expected = SOCK_ADDR_HOOKS.to_vec();
    expected.sort();
    assert_eq!(
        types,
        expected,
        "{when}: expected each socket hook attached exactly once to {}; saw {progs:?}",
        w.cgroup.display()
    );
}

fn count(haystack: &str, needle: &str) -> usize {
    haystack.matches(needle).count()
}

/// Stops the agent with `signal`, proves the dataplane keeps working while it is down,
/// restarts it and proves nothing was lost and the pinned state was adopted.
fn restart_keeps_traffic_and_state(test: &str, signal: i32) {
    let mut w = two_pod_web(test);
    let vip = format!("{WEB_VIP}:80");
    let before = frontends(&w);
    assert_eq!(
        frontend_summary(&w),
        [(
            vip.clone(),
            "TCP".to_string(),
            vec!["10.1.1.2:8080".to_string(), "10.1.2.2:8080".to_string()]
        )]
        .into(),
        "ferry list before the restart"
    );
    assert_attached_once(&w, "first run");

    let mut session = Session::open(&w, &vip);
    let first = session.send("one");
    assert!(
        first.ok,
        "established connection before the restart: {first:?}"
    );
    let backend = first
        .backend()
        .expect("reply names the backend")
        .to_string();

    let status = w.stop_agent(signal);
    if signal == libc::SIGTERM {
        assert!(
            status.success(),
            "agent must exit 0 on SIGTERM, saw {status}"
        );
    }

    // Agent down: pins stay, the established connection and new connects keep working.
    for name in [
        "FERRY_META",
        "FERRY_SVC",
        "FERRY_BACKENDS",
        "FERRY_MEMBERS",
        "FERRY_AFFINITY",
        "FERRY_REVNAT",
        "FERRY_COUNTERS",
    ] {
        assert!(
            w.maps_dir().join(name).exists(),
            "agent down: {} must stay pinned",
            w.maps_dir().join(name).display()
        );
    }
    let pins: Vec<String> = std::fs::read_dir(w.bpffs.join("links"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let tc_pins = pins.iter().filter(|p| p.starts_with("tc_")).count();
    assert_eq!(
        pins.len() - tc_pins,
        8,
        "agent down: all 8 socket-hook links must stay pinned in {}: {pins:?}",
        w.bpffs.join("links").display()
    );
    assert!(
        tc_pins > 0 && tc_pins % 2 == 0,
        "agent down: the tc links (ingress and egress per node device) must stay pinned: {pins:?}"
    );
    assert_attached_once(&w, "agent down");
    session.expect_reply("two", &backend, "agent down");
    let outs = w.probe("tcp", &vip, 30);
    assert!(
        outs.iter().all(|o| o.ok),
        "agent down: every new connect to the ClusterIP must succeed: {outs:?}"
    );
    assert_eq!(
        backends(&outs),
        set(&["pod1", "pod2"]),
        "agent down: new connects must still spread over both pods"
    );
    assert_eq!(
        frontends(&w),
        before,
        "agent down: ferry list must show the same frontends and backends"
    );

    let log_before = w.agent_log().len();
    w.start_agent(&[]);
    let second_run = w.agent_log()[log_before..].to_string();
    assert!(
        second_run.contains("adopted pinned state from a previous agent"),
        "second run's log must say it adopted the pinned state; saw:\n{second_run}"
    );
    assert_eq!(
        count(&second_run, "swapped program behind pinned link"),
        8,
        "second run must swap all 8 programs behind their pinned links (BPF_LINK_UPDATE); log:\n{second_run}"
    );
    assert_eq!(
        count(&second_run, "swapped tc program behind pinned link"),
        tc_pins,
        "second run must swap the tc program behind every pinned tc link; log:\n{second_run}"
    );
    assert_attached_once(&w, "after restart");

    session.expect_reply("three", &backend, "after restart");
    assert_eq!(
        frontends(&w),
        before,
        "after restart: ferry list must show the same frontends, backends and ids as before"
    );
    let outs = w.probe("tcp", &vip, 30);
    assert!(
        outs.iter().all(|o| o.ok),
        "after restart: every connect must succeed: {outs:?}"
    );
    assert_eq!(
        backends(&outs),
        set(&["pod1", "pod2"]),
        "after restart: connects must spread over both pods"
    );
    let m = w.metrics();
    assert!(
        m.contains("ferry_services_programmed 1\n"),
        "after restart: metrics must count the adopted service; saw:\n{m}"
    );
}

#[test]
fn sigterm_restart_keeps_connections_and_state() {
    restart_keeps_traffic_and_state("sigterm", libc::SIGTERM);
}

#[test]
fn sigkill_restart_keeps_connections_and_state() {
    restart_keeps_traffic_and_state("sigkill", libc::SIGKILL);
}

#[test]
fn changes_while_down_are_applied_and_stale_entries_pruned() {
    let mut w = World::new("down-change", 2, &[8080]);
    let eps: Vec<Ep> = w.pods.iter().map(|p| ep(p.v4)).collect();
    let web = |eps: &[Ep]| {
        docs(&[
            service("web", &[WEB_VIP], &[("http", 80, "TCP")], ""),
            slice("web", "web-1", "IPv4", &[("http", 8080, "TCP")], eps),
        ])
    };
    w.write_manifest("web.yaml", &web(&eps));
    w.write_manifest(
        "api.yaml",
        &docs(&[
            service("api", &[API_VIP], &[("http", 80, "TCP")], ""),
            slice(
                "api",
                "api-1",
                "IPv4",
                &[("http", 8080, "TCP")],
                &[ep(w.pod("pod2").v4)],
            ),
        ]),
    );
    w.start_agent(&[]);
    let api = format!("{API_VIP}:80");
    let web_vip = format!("{WEB_VIP}:80");
    assert_eq!(
        backends(&w.probe("tcp", &api, 5)),
        set(&["pod2"]),
        "api before the restart"
    );

    w.stop_agent(libc::SIGTERM);
    // While down: api deleted, web shrinks to pod1.
    w.remove_manifest("api.yaml");
    w.write_manifest("web.yaml", &web(&[ep(w.pod("pod1").v4)]));
    let outs = w.probe("tcp", &api, 3);
    assert!(
        outs.iter().all(|o| o.ok),
        "agent down: the pinned api Service keeps answering until an agent prunes it: {outs:?}"
    );

    let log_before = w.agent_log().len();
    w.start_agent(&[]);
    let second_run = w.agent_log()[log_before..].to_string();
    assert!(
        second_run.contains("adopted pinned state"),
        "second run must adopt the pinned state; log:\n{second_run}"
    );

    // /healthz 200 means the first full sync is done: the changes must be in already.
    let seen = frontend_summary(&w);
    let expected: BTreeSet<_> = [(
        web_vip.clone(),
        "TCP".to_string(),
        vec!["10.1.1.2:8080".to_string()],
    )]
    .into();
    assert_eq!(
        seen, expected,
        "after restart: api must be pruned and web must only have pod1 in ferry list"
    );
    let list = w.list_json();
    let ids: BTreeSet<u64> = list["frontends"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|f| {
            f["backends"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b["id"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(
        ids.len(),
        1,
        "after restart: exactly one backend id must remain in use: {list}"
    );

    let outs = w.probe("tcp", &api, 3);
    for o in &outs {
        assert_eq!(
            o.errno,
            Some(ENETUNREACH),
            "after restart: the deleted api ClusterIP must no longer be translated (expected ENETUNREACH): {o:?}"
        );
    }
    let outs = w.probe("tcp", &web_vip, 20);
    assert!(
        outs.iter().all(|o| o.ok),
        "after restart: web must keep working: {outs:?}"
    );
    assert_eq!(
        backends(&outs),
        set(&["pod1"]),
        "after restart: web must only reach pod1 (pod2 pruned)"
    );
    let m = w.metrics();
    assert!(
        m.contains("ferry_backends_programmed 1\n"),
        "after restart: the stale backend must be deleted from the map; metrics:\n{m}"
    );
}

#[test]
fn cleanup_leaves_nothing_behind() {
    let mut w = two_pod_web("cleanup");
    let vip = format!("{WEB_VIP}:80");
    assert!(
        w.probe("tcp", &vip, 3).iter().all(|o| o.ok),
        "ClusterIP must work before cleanup"
    );
    assert_attached_once(&w, "before cleanup");
    w.stop_agent(libc::SIGTERM);

    let out = w.cleanup();
    assert!(
        out.contains("removed"),
        "ferry cleanup must say what it removed; saw {out:?}"
    );
    assert!(
        !w.bpffs.exists(),
        "after cleanup: {} must be gone, still holds {:?}",
        w.bpffs.display(),
        std::fs::read_dir(&w.bpffs).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
    );
    let progs = cgroup_programs(&w.cgroup);
    assert!(
        progs.is_empty(),
        "after cleanup: no programs may stay attached to {}; saw {progs:?}",
        w.cgroup.display()
    );
    for o in w.probe("tcp", &vip, 3) {
        assert_eq!(
            o.errno,
            Some(ENETUNREACH),
            "after cleanup: connects to the VIP must no longer be translated (expected ENETUNREACH): {o:?}"
        );
    }
    let out = Command::new(bin("ferry"))
        .arg("cleanup")
        .arg("--bpffs")
        .arg(&w.bpffs)
        .output()
        .expect("ferry cleanup");
    assert!(
        out.status.success(),
        "a second ferry cleanup must succeed (idempotent); exit {}, stderr {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("nothing to clean up"),
        "a second ferry cleanup must report nothing to do; saw {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
}
