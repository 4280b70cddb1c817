//! Takeover from kube-proxy on a live node (issue 13): a node namespace carries
//! kube-proxy's iptables rules (legacy and nft backends, IPv4 and IPv6) and its nftables
//! tables, next to the kubelet's chains and rules of other owners. `ferry agent
//! --takeover-kube-proxy` starts while clients connect all the time and one connection
//! made through kube-proxy's DNAT stays open: no connect fails at any moment, the old
//! connection keeps working, and afterwards nothing of kube-proxy's remains while every
//! other rule is as it was. `ferry takeover` alone is idempotent.
//!
//! Everything lives in the world's namespaces, which go when the world is dropped.

use std::{
    io::{BufRead, BufReader, Write},
    net::Ipv4Addr,
    process::Command,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use ferry_tests::*;

// kube-proxy's rule generators of the benchmark (used here as they are).
#[allow(dead_code)]
#[path = "../src/bin/ferry-bench/layouts.rs"]
mod layouts;

use layouts::ServicePort;

const VIP: &str = "10.96.0.10";

/// The iptables backends and families, by their save/restore tool prefix.
const IPTABLES: [&str; 4] = [
    "iptables-legacy",
    "iptables-nft",
    "ip6tables-legacy",
    "ip6tables-nft",
];

/// kube-proxy's chains, restated here (independent of the agent's list).
const KP_CHAINS: &[&str] = &[
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-PROXY-FIREWALL",
    "KUBE-PROXY-CANARY",
];
const KP_PREFIXES: &[&str] = &[
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-SEP-",
    "KUBE-EXT-",
    "KUBE-FW-",
];

fn is_kube_proxy(word: &str) -> bool {
    // Words of a saved line: `:CHAIN` declarations, `"quoted"` comments.
    let w = word.trim_start_matches(':').trim_matches('"');
    KP_CHAINS.contains(&w) || KP_PREFIXES.iter().any(|p| w.starts_with(p))
}

fn ports(w: &World) -> Vec<ServicePort> {
    let eps: Vec<(Ipv4Addr, u16)> = w.pods.iter().map(|p| (p.v4, 8080)).collect();
    vec![
        ServicePort {
            svc: "web".into(),
            port_name: "http".into(),
            vip: VIP.parse().unwrap(),
            port: 80,
            proto: "tcp",
            node_port: None,
            endpoints: eps.clone(),
        },
        ServicePort {
            svc: "api".into(),
            port_name: "https".into(),
            vip: "10.96.0.11".parse().unwrap(),
            port: 443,
            proto: "tcp",
            node_port: Some(30443),
            endpoints: eps[..1].to_vec(),
        },
    ]
}

/// Rules of other owners in every iptables table: the kubelet's canaries, a drop mark as
/// older kubelets made it, an unrelated ACCEPT and an unrelated MASQUERADE.
const OTHERS_V4: &str = "*mangle
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
COMMIT
*filter
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
-A INPUT -p tcp -m tcp --dport 2222 -m comment --comment \"not kube-proxy\" -j ACCEPT
COMMIT
*nat
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-MARK-DROP - [0:0]
-A KUBE-MARK-DROP -j MARK --set-xmark 0x8000/0x8000
-A POSTROUTING -s 10.1.0.0/16 -d 203.0.113.0/24 -j MASQUERADE
COMMIT
";

/// A small IPv6 kube-proxy layout and the kubelet's IPv6 chains.
const LAYOUT_V6: &str = "*filter
:KUBE-FIREWALL - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
-A INPUT -j KUBE-FIREWALL
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL
-A INPUT -p tcp -m tcp --dport 2222 -j ACCEPT
COMMIT
*nat
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-V6AAAAAAAAAAAAAA - [0:0]
:KUBE-SEP-V6BBBBBBBBBBBBBB - [0:0]
-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SERVICES -d fd00:96::10/128 -p tcp -m comment --comment \"default/web6:http cluster IP\" -m tcp --dport 80 -j KUBE-SVC-V6AAAAAAAAAAAAAA
-A KUBE-SVC-V6AAAAAAAAAAAAAA -j KUBE-SEP-V6BBBBBBBBBBBBBB
-A KUBE-SEP-V6BBBBBBBBBBBBBB -p tcp -m tcp -j DNAT --to-destination [fd00:1:1::2]:8080
COMMIT
";

/// kube-proxy's IPv6 nftables table, and a table of another owner.
const NFT_EXTRA: &str = "add table ip6 kube-proxy { comment \"rules for kube-proxy\" ; }
add chain ip6 kube-proxy services
add chain ip6 kube-proxy nat-output { type nat hook output priority -100 ; }
add rule ip6 kube-proxy nat-output jump services
add table inet keepme
add chain inet keepme input { type filter hook input priority 10 ; }
add rule inet keepme input tcp dport 2222 accept
";

/// Loads kube-proxy's layouts and the other owners' rules into the node namespace.
fn load_kube_proxy(w: &World) {
    let ports = ports(w);
    let v4 = layouts::iptables_full(&ports);
    let files = [
        ("kp-v4.rules", v4.as_str()),
        ("others-v4.rules", OTHERS_V4),
        ("kp-v6.rules", LAYOUT_V6),
    ];
    for (name, text) in files {
        std::fs::write(w.workdir.join(name), text).unwrap();
    }
    let nft = layouts::nft_full(&ports, &[NODE_V4]) + NFT_EXTRA;
    std::fs::write(w.workdir.join("kp.nft"), nft).unwrap();
    let ns = &w.node_ns;
    let dir = w.workdir.display();
    for backend in ["legacy", "nft"] {
        sh(&format!(
            "ip netns exec {ns} iptables-{backend}-restore --noflush {dir}/kp-v4.rules && \
             ip netns exec {ns} iptables-{backend}-restore --noflush {dir}/others-v4.rules && \
             ip netns exec {ns} ip6tables-{backend}-restore --noflush {dir}/kp-v6.rules"
        ));
    }
    sh(&format!("ip netns exec {ns} nft -f {dir}/kp.nft"));
    // kube-proxy's DNAT happens after routing: the Service range needs a route.
    sh(&format!("ip -n {ns} route add 10.96.0.0/12 dev eth0"));
}

/// `*-save` of one backend in the node namespace, without comments and counters.
fn save(w: &World, tool: &str) -> Vec<String> {
    sh(&format!("ip netns exec {} {tool}-save", w.node_ns))
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            if l.starts_with(':') {
                l.split_whitespace().take(2).collect::<Vec<_>>().join(" ")
            } else {
                l.trim_end().to_string()
            }
        })
        .collect()
}

/// The lines of a dump that are not kube-proxy's (mention none of its chains).
fn others(dump: &[String]) -> Vec<String> {
    dump.iter()
        .filter(|l| !l.split_whitespace().any(is_kube_proxy))
        .cloned()
        .collect()
}

fn nft_tables(w: &World) -> String {
    sh(&format!("ip netns exec {} nft list tables", w.node_ns))
}

/// Everything of other owners before, per backend, and the nft tables.
struct Before {
    iptables: Vec<(String, Vec<String>)>,
    keepme: String,
}

fn before(w: &World) -> Before {
    let iptables: Vec<(String, Vec<String>)> = IPTABLES
        .iter()
        .map(|t| (t.to_string(), save(w, t)))
        .collect();
    for (tool, dump) in &iptables {
        assert!(
            dump.iter().any(|l| l.contains("KUBE-SERVICES")),
            "{tool}: kube-proxy's layout did not load: {dump:#?}"
        );
        assert!(
            dump.iter().any(|l| l.contains("KUBE-KUBELET-CANARY")),
            "{tool}: the kubelet's chains did not load"
        );
    }
    let tables = nft_tables(w);
    assert!(
        tables.contains("table ip kube-proxy") && tables.contains("table ip6 kube-proxy"),
        "kube-proxy's nftables tables did not load: {tables}"
    );
    Before {
        iptables,
        keepme: sh(&format!(
            "ip netns exec {} nft list table inet keepme",
            w.node_ns
        )),
    }
}

/// Nothing of kube-proxy's is left, and every other rule is as it was.
fn assert_only_kube_proxy_removed(w: &World, b: &Before) {
    for (tool, dump) in &b.iptables {
        let now = save(w, tool);
        let left: Vec<&String> = now
            .iter()
            .filter(|l| l.split_whitespace().any(is_kube_proxy))
            .collect();
        assert!(left.is_empty(), "{tool}: kube-proxy rules left: {left:#?}");
        assert_eq!(
            others(dump),
            now,
            "{tool}: the rules of other owners changed (expected left, seen right)"
        );
        for kept in ["KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "--dport 2222"] {
            assert!(
                now.iter().any(|l| l.contains(kept)),
                "{tool}: {kept} was removed: {now:#?}"
            );
        }
    }
    let tables = nft_tables(w);
    assert!(
        !tables.contains("kube-proxy"),
        "kube-proxy's nftables tables are left: {tables}"
    );
    let keepme = sh(&format!(
        "ip netns exec {} nft list table inet keepme",
        w.node_ns
    ));
    assert_eq!(keepme, b.keepme, "another owner's nftables table changed");
}

fn ferry_takeover(w: &World, args: &[&str]) -> (i32, String, String) {
    let out = Command::new("ip")
        .args(["netns", "exec", &w.node_ns])
        .arg(bin("ferry"))
        .arg("takeover")
        .args(args)
        .output()
        .expect("ferry takeover");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn agent_takes_over_from_kube_proxy_without_dropping_connections() {
    let mut w = World::new("takeover", 2, &[8080]);
    let ports = ports(&w);
    let items: Vec<serde_json::Value> = ports
        .iter()
        .flat_map(|p| layouts::manifests(&[p]))
        .collect();
    w.write_manifest("services.json", &layouts::list(items));
    load_kube_proxy(&w);
    let b = before(&w);
    let addr = format!("{VIP}:80");

    // kube-proxy's DNAT serves the Service before ferry runs.
    let first = w.probe("tcp", &addr, 4);
    assert!(
        first
            .iter()
            .all(|o| o.ok && o.peer.as_deref() == Some(addr.as_str())),
        "kube-proxy's rules do not serve {addr} before ferry: {first:?}"
    );

    // One connection made through kube-proxy's DNAT, kept open through the switch.
    let mut session = w.session(&addr);
    let mut out = BufReader::new(session.stdout.take().unwrap());
    let mut stdin = session.stdin.take().unwrap();
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "connected", "tcp-session through kube-proxy");
    let mut send = |text: &str| -> String {
        writeln!(stdin, "{text}").unwrap();
        stdin.flush().unwrap();
        let mut l = String::new();
        out.read_line(&mut l).unwrap();
        l
    };
    let reply = send("before");
    let before_reply: Outcome = serde_json::from_str(reply.trim())
        .unwrap_or_else(|e| panic!("bad tcp-session line {reply:?}: {e}"));
    assert!(before_reply.ok, "session before the switch: {reply}");
    let backend = before_reply.backend().unwrap().to_string();

    // New connections all the time, from before the agent starts until after the rules
    // are gone.
    let stop = AtomicBool::new(false);
    let prober = w.prober();
    let (attempts, failures) = std::thread::scope(|s| {
        let probing = s.spawn(|| {
            let mut failures = Vec::new();
            let mut attempts = 0;
            while !stop.load(Ordering::Relaxed) {
                for o in prober.probe("tcp", &addr, 5) {
                    attempts += 1;
                    if !o.ok || o.peer.as_deref() != Some(addr.as_str()) {
                        failures.push(o);
                    }
                }
            }
            (attempts, failures)
        });
        std::thread::sleep(Duration::from_millis(300));
        w.start_agent(&["--takeover-kube-proxy"]);
        eventually("takeover done", Duration::from_secs(30), || {
            let log = w.agent_log();
            if log.contains("kube-proxy takeover FAILED") {
                panic!("takeover failed:\n{log}");
            }
            if log.contains("kube-proxy takeover done") {
                Ok(())
            } else {
                Err("not yet".to_string())
            }
        });
        // Traffic once the rules are gone is ferry's alone.
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        probing.join().unwrap()
    });
    assert!(attempts > 20, "only {attempts} connects during the switch");
    assert!(
        failures.is_empty(),
        "{} of {attempts} new connections failed during the takeover: {failures:?}\n{}",
        failures.len(),
        w.agent_log()
    );

    assert_only_kube_proxy_removed(&w, &b);

    // The connection kube-proxy's DNAT set up still works, to the same backend.
    let reply = send("after");
    let after: Outcome = serde_json::from_str(reply.trim())
        .unwrap_or_else(|e| panic!("bad tcp-session line {reply:?}: {e}"));
    assert!(
        after.ok && after.backend() == Some(backend.as_str()),
        "the connection made through kube-proxy broke after the takeover: {reply} (was on {backend})"
    );
    drop(send);
    let _ = session.kill();
    let _ = session.wait();

    // New connections are ferry's now: they still work without any kube-proxy rule.
    let later = w.probe("tcp", &addr, 6);
    assert!(
        later
            .iter()
            .all(|o| o.ok && o.peer.as_deref() == Some(addr.as_str())),
        "{addr} after the takeover: {later:?}"
    );
    let metrics = w.metrics();
    assert!(
        metrics.contains("ferry_kube_proxy_takeover_failed 0"),
        "metrics do not show a successful takeover:\n{metrics}"
    );
    let log = w.agent_log();
    for backend in IPTABLES {
        assert!(
            log.contains(&format!("kube-proxy takeover: {backend} nat: removed")),
            "no summary line for {backend} nat in the log:\n{log}"
        );
    }
}

#[test]
fn takeover_command_is_exact_and_idempotent() {
    let w = World::new("takeover-cli", 1, &[8080]);
    load_kube_proxy(&w);
    let b = before(&w);

    // --dry-run says what would go and changes nothing.
    let (code, stdout, stderr) = ferry_takeover(&w, &["--dry-run"]);
    assert_eq!(code, 0, "ferry takeover --dry-run: {stdout}{stderr}");
    for backend in IPTABLES {
        assert!(
            stdout.contains(&format!("{backend} nat: would remove")),
            "dry run does not name {backend} nat:\n{stdout}"
        );
    }
    assert!(
        stdout.contains("nft ip kube-proxy: would remove")
            && stdout.contains("nft ip6 kube-proxy: would remove"),
        "dry run does not name the nftables tables:\n{stdout}"
    );
    for (tool, dump) in &b.iptables {
        assert_eq!(&save(&w, tool), dump, "{tool}: --dry-run changed the rules");
    }
    assert!(nft_tables(&w).contains("table ip kube-proxy"));

    let (code, stdout, stderr) = ferry_takeover(&w, &[]);
    assert_eq!(code, 0, "ferry takeover: {stdout}{stderr}");
    assert!(
        stdout.contains("iptables-nft filter: removed"),
        "summary:\n{stdout}"
    );
    assert_only_kube_proxy_removed(&w, &b);

    // A second run finds nothing and changes nothing.
    let (code, stdout, stderr) = ferry_takeover(&w, &[]);
    assert_eq!(code, 0, "second ferry takeover: {stdout}{stderr}");
    assert!(
        stdout.contains("no kube-proxy rules found"),
        "second run removed something:\n{stdout}"
    );
    assert_only_kube_proxy_removed(&w, &b);
}
