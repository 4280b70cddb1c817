//! Upgrades across a change of the map layout: the new agent fills its own maps, swaps
//! the programs behind the pinned links, and removes the old maps, while traffic flows.
//!
//! Two builds with different layouts are rehearsed with `FERRY_LAYOUT_VERSION`, which
//! makes the same binary pin under another version (`<bpffs>/v<N>/`), so the whole
//! migration path runs for real.

use std::{
    io::{BufRead, BufReader, Write},
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use ferry_tests::*;

const VIP: &str = "10.96.0.10";

fn web(w: &World) -> String {
    let eps: Vec<Ep> = w.pods.iter().map(|p| ep(p.v4)).collect();
    docs(&[
        service(
            "web",
            &[VIP],
            &[("http", 80, "TCP"), ("dns", 53, "UDP")],
            "",
        ),
        slice(
            "web",
            "web-1",
            "IPv4",
            &[("http", 8080, "TCP"), ("dns", 8080, "UDP")],
            &eps,
        ),
    ])
}

#[test]
fn layout_change_migrates_without_a_gap() {
    let mut w = World::new("migrate", 2, &[8080]);
    w.write_manifest("web.yaml", &web(&w));
    w.start_agent_env(&[], &[("FERRY_LAYOUT_VERSION", "100")]);
    let old_dir = w.bpffs.join("v100");
    assert!(
        old_dir.join("FERRY_SVC").exists(),
        "layout 100 pins under {}",
        old_dir.display()
    );

    let mut session = w.session(&format!("{VIP}:80"));
    let mut out = BufReader::new(session.stdout.take().unwrap());
    let mut stdin = session.stdin.take().unwrap();
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "connected");

    // Traffic runs through the whole upgrade: every connect must work.
    let stop = AtomicBool::new(false);
    let prober = w.prober();
    let failures = std::thread::scope(|s| {
        let probing = s.spawn(|| {
            let mut failures = Vec::new();
            let mut attempts = 0;
            while !stop.load(Ordering::Relaxed) {
                for o in prober.probe("tcp", &format!("{VIP}:80"), 5) {
                    attempts += 1;
                    if !o.ok || o.peer.as_deref() != Some("10.96.0.10:80") {
                        failures.push(o);
                    }
                }
            }
            (attempts, failures)
        });
        w.stop_agent(libc::SIGTERM);
        std::thread::sleep(Duration::from_millis(100)); // traffic with no agent at all
        w.start_agent_env(&[], &[("FERRY_LAYOUT_VERSION", "101")]);
        eventually("old layout removed", Duration::from_secs(5), || {
            if old_dir.exists() {
                Err(format!("{} still there", old_dir.display()))
            } else {
                Ok(())
            }
        });
        std::thread::sleep(Duration::from_millis(200)); // traffic after the swap
        stop.store(true, Ordering::Relaxed);
        probing.join().unwrap()
    });
    let (attempts, failures) = failures;
    assert!(
        attempts > 20,
        "the probe loop must have run through the upgrade, ran {attempts}"
    );
    assert!(
        failures.is_empty(),
        "{} of {attempts} connects failed during the migration: {failures:?}",
        failures.len()
    );

    let log = w.agent_log();
    assert!(
        log.contains("migrating after the first full sync"),
        "the new agent must announce the migration:\n{log}"
    );
    assert!(
        log.contains("migrated: programs swapped, old maps removed"),
        "{log}"
    );
    assert!(w.bpffs.join("v101/FERRY_SVC").exists(), "new layout pinned");

    // The established connection survived, and still reports the VIP it dialled.
    writeln!(stdin, "after").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    let o: Outcome = serde_json::from_str(&line).unwrap();
    assert!(o.ok, "the established session must keep working: {o:?}");
    // Its Service address lives in the socket's storage map, which the new layout took
    // over as the same map object.
    assert_eq!(
        o.peer.as_deref(),
        Some("10.96.0.10:80"),
        "getpeername of a connection made before the migration: {o:?}"
    );
    let _ = session.kill();
    let _ = session.wait();

    // UDP: the reply source is still the VIP through the new programs and maps.
    let udp = &w.probe("udp", &format!("{VIP}:53"), 1)[0];
    assert_eq!(udp.from.as_deref(), Some("10.96.0.10:53"), "{udp:?}");
}

#[test]
fn a_mislabelled_layout_is_detected_not_misread() {
    let mut w = World::new("layoutmis", 1, &[8080]);
    w.write_manifest("web.yaml", &web(&w));
    w.start_agent_env(&[], &[("FERRY_LAYOUT_VERSION", "100")]);
    w.stop_agent(libc::SIGTERM);
    // Pins that say "v102" on the outside but hold layout 100.
    std::fs::rename(w.bpffs.join("v100"), w.bpffs.join("v102")).unwrap();
    let out = std::process::Command::new(bin("ferry"))
        .arg("agent")
        .arg("--manifests")
        .arg(&w.manifests)
        .arg("--cgroup")
        .arg(&w.cgroup)
        .arg("--bpffs")
        .arg(&w.bpffs)
        .args([
            "--health-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .env("FERRY_LAYOUT_VERSION", "102")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "must refuse to start: {stderr}");
    assert!(
        stderr.contains("layout version 100") && stderr.contains("102"),
        "the error names both versions: {stderr}"
    );
    // Traffic still flows through what was pinned.
    assert!(w.probe("tcp", &format!("{VIP}:80"), 3).iter().all(|o| o.ok));
}
