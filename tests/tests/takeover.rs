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
    process::Command,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use ferry_tests::*;

// kube-proxy's rule generators of the benchmark (used here as they are).
#[allow(dead_code)]
#[path = "../src/bin/ferry-bench/layouts.rs"]
mod layouts;

#[path = "support/kube_proxy.rs"]
mod kube_proxy;

use kube_proxy::*;

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
    eprintln!(
        "takeover: {attempts} new connections from before the agent started until after the rules were gone, {} failed",
        failures.len()
    );
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
