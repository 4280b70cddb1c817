//! Capacity without flags: the maps start small, are sized from what the first list
//! needs and grow live (a new generation filled, the programs swapped behind their
//! links, the old maps removed) while clients keep connecting, never beyond the
//! `--max-*` bounds.
//!
//! `FERRY_CAPACITY_FLOOR` lowers the smallest capacity (4096 otherwise) so that a few
//! thousand Services make the maps grow many times.

use std::{
    io::{BufRead, BufReader, Write},
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use ferry_tests::*;

/// ClusterIP of Service number `i` (10.96.0.1 upwards, 250 per /24).
fn vip(i: usize) -> String {
    format!("10.96.{}.{}", i / 250, i % 250 + 1)
}

/// Services `from..to`, each with one TCP port (80 -> 8080) on every pod: one frontend
/// plus one slot per pod in the service map.
fn services(w: &World, from: usize, to: usize) -> String {
    let eps: Vec<Ep> = w.pods.iter().map(|p| ep(p.v4)).collect();
    services_with(from, to, |_| eps.clone())
}

/// Services `from..to` (port 80 -> 8080), Service `i` with the endpoints `eps(i)`.
fn services_with(from: usize, to: usize, eps: impl Fn(usize) -> Vec<Ep>) -> String {
    let mut parts = Vec::new();
    for i in from..to {
        let name = format!("svc-{i:05}");
        parts.push(service(&name, &[&vip(i)], &[("http", 80, "TCP")], ""));
        parts.push(slice(
            &name,
            &format!("{name}-1"),
            "IPv4",
            &[("http", 8080, "TCP")],
            &eps(i),
        ));
    }
    docs(&parts)
}

fn gauge(metrics: &str, family: &str, label: &str) -> u64 {
    metric_value(metrics, &format!("{family}{label}"), "")
}

/// Waits until `/metrics` says `count` ServicePorts are programmed.
fn wait_programmed(w: &World, count: u64, within: Duration) {
    eventually(&format!("{count} ServicePorts programmed"), within, || {
        let m = w.metrics();
        let n = gauge(&m, "ferry_services_programmed", " ");
        if n == count {
            Ok(())
        } else {
            Err(format!(
                "{n} programmed, plan errors {}",
                gauge(&m, "ferry_plan_errors", " ")
            ))
        }
    });
}

/// Each Service in `ids` answers `tries` TCP connects to its VIP (the peer seen is the VIP
/// dialled), and together they reach every pod.
fn assert_served(w: &World, ids: impl IntoIterator<Item = usize>, tries: usize) {
    let mut reached = std::collections::BTreeSet::new();
    for i in ids {
        let addr = format!("{}:80", vip(i));
        let outs = w.probe("tcp", &addr, tries);
        assert!(
            outs.iter()
                .all(|o| o.ok && o.peer.as_deref() == Some(addr.as_str())),
            "svc-{i:05} ({addr}) must be served: {outs:?}"
        );
        reached.extend(backends(&outs));
    }
    assert_eq!(reached, all_pods(w), "the Services reach every pod");
}

#[test]
fn services_far_beyond_the_first_capacity_are_programmed_while_clients_connect() {
    let mut w = World::new("grow", 2, &[8080]);
    w.write_manifest("first.yaml", &services(&w, 0, 10));
    w.start_agent_env(&[], &[("FERRY_CAPACITY_FLOOR", "64")]);
    let m = w.metrics();
    assert_eq!(
        gauge(&m, "ferry_map_capacity", "{map=\"FERRY_SVC\"}"),
        64,
        "10 Services x 3 entries start at the floor:\n{m}"
    );
    let growths_before = gauge(&m, "ferry_map_growths_total", " ");

    // An established connection made before any growth.
    let mut session = w.session(&format!("{}:80", vip(0)));
    let mut out = BufReader::new(session.stdout.take().unwrap());
    let mut stdin = session.stdin.take().unwrap();
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "connected");

    // Clients keep connecting to the first Services through every growth: each connect
    // must reach a backend and see the VIP it dialled as its peer.
    let steps = [50, 200, 600, 1500, 3000];
    let stop = AtomicBool::new(false);
    let prober = w.prober();
    let (attempts, failures) = std::thread::scope(|s| {
        let probing = s.spawn(|| {
            let mut failures = Vec::new();
            let mut attempts = 0;
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let addr = format!("{}:80", vip(i % 10));
                for o in prober.probe("tcp", &addr, 5) {
                    attempts += 1;
                    if !o.ok || o.peer.as_deref() != Some(addr.as_str()) {
                        failures.push((addr.clone(), o));
                    }
                }
                i += 1;
            }
            (attempts, failures)
        });
        let mut from = 10;
        for (n, to) in steps.iter().enumerate() {
            w.write_manifest(&format!("step-{n}.yaml"), &services(&w, from, *to));
            wait_programmed(&w, *to as u64, Duration::from_secs(60));
            from = *to;
        }
        stop.store(true, Ordering::Relaxed);
        probing.join().unwrap()
    });
    let total = *steps.last().unwrap();
    println!(
        "{attempts} connects to the first Services while the maps grew, {} failed",
        failures.len()
    );
    assert!(
        attempts > 50,
        "the probe loop must have run through the growth, ran {attempts}"
    );
    assert!(
        failures.is_empty(),
        "{} of {attempts} connects failed while the maps grew: {failures:?}",
        failures.len()
    );

    // Every Service is programmed: a sample of the new ones, the last included.
    assert_served(&w, [10, 11, 63, 64, 500, 1234, 2047, 2998, total - 1], 6);

    // The connection made before the growth still works.
    writeln!(stdin, "after").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    let o: Outcome = serde_json::from_str(&line).unwrap();
    assert!(
        o.ok,
        "the established session must survive the growth: {o:?}"
    );
    assert_eq!(
        o.peer.as_deref(),
        Some(format!("{}:80", vip(0)).as_str()),
        "getpeername of a connection made before the growth: {o:?}"
    );
    let _ = session.kill();
    let _ = session.wait();

    // The metrics show the growth: 3000 x 3 entries need at least 16384.
    let m = w.metrics();
    let growths = gauge(&m, "ferry_map_growths_total", " ") - growths_before;
    let cap = gauge(&m, "ferry_map_capacity", "{map=\"FERRY_SVC\"}");
    let used = gauge(&m, "ferry_map_entries", "{map=\"FERRY_SVC\"}");
    assert!(
        growths >= 3,
        "several growths expected, saw {growths}:\n{m}"
    );
    assert_eq!(used, total as u64 * 3, "{m}");
    assert!(
        cap >= 16384 && used * 100 <= cap * 80,
        "capacity {cap} for {used} entries:\n{m}"
    );
    assert_eq!(
        gauge(&m, "ferry_plan_errors", " "),
        0,
        "nothing left out:\n{m}"
    );
    assert_eq!(gauge(&m, "ferry_map_growth_failures_total", " "), 0, "{m}");
    let log = w.agent_log();
    assert!(log.contains("maps grown"), "growth is logged:\n{log}");
    assert!(
        !log.contains("does not fit") && !log.contains("do not fit"),
        "growing must not report Services as left out on the way:\n{log}"
    );
    // Only the current generation is pinned.
    let pins: Vec<String> = std::fs::read_dir(&w.bpffs)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !pins.iter().any(|p| p.ends_with("_grow")),
        "no unfinished generation left: {pins:?}"
    );
}

#[test]
fn at_the_bound_the_overflow_is_reported_once_and_nothing_programmed_is_touched() {
    let mut w = World::new("growbound", 2, &[8080]);
    // 10 Services x 3 entries: the maps are created from the first list at the bound,
    // 64 entries (not 16), where 21 Services fit.
    w.write_manifest("first.yaml", &services(&w, 0, 10));
    w.start_agent_env(&["--max-services", "64"], &[("FERRY_CAPACITY_FLOOR", "16")]);
    let m = w.metrics();
    assert_eq!(
        gauge(&m, "ferry_map_capacity", "{map=\"FERRY_SVC\"}"),
        64,
        "{m}"
    );
    assert_eq!(
        gauge(&m, "ferry_map_capacity_bound", "{map=\"FERRY_SVC\"}"),
        64,
        "{m}"
    );

    w.write_manifest("more.yaml", &services(&w, 10, 40));
    eventually("19 Services reported", Duration::from_secs(20), || {
        let m = w.metrics();
        match gauge(&m, "ferry_plan_errors", " ") {
            19 => Ok(()),
            n => Err(format!("{n} plan errors")),
        }
    });
    wait_programmed(&w, 21, Duration::from_secs(5));
    // A further sync that changes nothing in the maps (a headless Service, not proxied)
    // retries the 19 and keeps the same report: it is not repeated.
    w.write_manifest(
        "headless.yaml",
        &service("headless", &["None"], &[("http", 80, "TCP")], ""),
    );
    eventually(
        "the headless Service synced",
        Duration::from_secs(10),
        || {
            if w.agent_log().contains("default/headless") {
                Ok(())
            } else {
                Err("not yet".into())
            }
        },
    );

    let log = w.agent_log();
    let reports: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("do not fit the FERRY_SVC map"))
        .collect();
    assert_eq!(
        reports.len(),
        1,
        "one report for the overflow, not one per Service or per sync:\n{log}"
    );
    let r = reports[0];
    assert!(
        r.contains("ERROR")
            && r.contains("19 ServicePorts")
            && r.contains("default/svc-00021")
            && r.contains("and 14 more")
            && r.contains("raise --max-services"),
        "count, first names and the bound's flag: {r}"
    );
    assert!(
        !log.contains("default/svc-00021:http/TCP/IPv4: does not fit"),
        "no line per Service:\n{log}"
    );

    // Nothing programmed was corrupted: the first 21 serve on both pods, the rest are
    // not programmed.
    assert_served(&w, 0..21, 4);
    let outs = w.probe("tcp", &format!("{}:80", vip(30)), 1);
    assert!(
        !outs[0].ok || outs[0].peer.as_deref() != Some(format!("{}:80", vip(30)).as_str()),
        "svc-00030 did not fit and must not be served: {outs:?}"
    );
    let m = w.metrics();
    assert_eq!(
        gauge(&m, "ferry_map_entries", "{map=\"FERRY_SVC\"}"),
        21 * 3,
        "{m}"
    );
    assert_eq!(
        gauge(&m, "ferry_map_growths_total", " "),
        0,
        "sized from the first list, at the bound: nothing to grow:\n{m}"
    );
}

/// The start loads the programs once, after the first list, with maps sized from what
/// it holds: more Services than the default capacity (4096 service-map entries) are all
/// programmed with no growth (which would load and verify every program a second time).
#[test]
fn the_first_list_sizes_the_maps_without_a_growth() {
    let mut w = World::new("firstsize", 2, &[8080]);
    // 2000 Services x (1 frontend + 2 backend slots) = 6000 entries; 1.5 x 6000 rounds
    // up to 16384.
    let total = 2000;
    w.write_manifest("all.yaml", &services(&w, 0, total));
    w.start_agent(&[]);
    // /healthz is 200 only once the first full sync is in the maps.
    let m = w.metrics();
    assert_eq!(
        gauge(&m, "ferry_services_programmed", " "),
        total as u64,
        "every Service programmed by the first sync:\n{m}"
    );
    assert_eq!(gauge(&m, "ferry_plan_errors", " "), 0, "{m}");
    let cap = gauge(&m, "ferry_map_capacity", "{map=\"FERRY_SVC\"}");
    let used = gauge(&m, "ferry_map_entries", "{map=\"FERRY_SVC\"}");
    assert_eq!(used, total as u64 * 3, "{m}");
    assert_eq!(
        cap, 16384,
        "sized from the list, not the 4096 default:\n{m}"
    );
    assert_eq!(
        gauge(&m, "ferry_map_growths_total", " "),
        0,
        "no growth on the way to ready:\n{m}"
    );
    let log = w.agent_log();
    assert!(!log.contains("maps grown"), "no growth logged:\n{log}");
    assert_eq!(
        log.matches("programs loaded").count(),
        1,
        "the programs are loaded once:\n{log}"
    );

    // Real traffic through the loaded programs, to Services at both ends of the list.
    assert_served(&w, [0, 1, 1365, 1366, 1999], 6);
}

/// What growing costs at scale (run by hand, `--ignored --nocapture`): Services with 4
/// endpoints each (distinct addresses) added through the manifests source in steps up to
/// 30,000; prints each growth (entries copied, time) and the agent's peak RSS.
#[test]
#[ignore]
fn growth_cost_up_to_30k_services() {
    let mut w = World::new("growcost", 1, &[8080]);
    // Four distinct endpoint addresses per Service (nothing needs to answer).
    let services4 = |from, to| {
        services_with(from, to, |i| {
            (0..4)
                .map(|k| {
                    let n = 4 * i + k;
                    ep(format!(
                        "10.{}.{}.{}",
                        64 + n / 65536,
                        n / 256 % 256,
                        n % 256
                    ))
                })
                .collect()
        })
    };
    w.write_manifest("step-0.yaml", &services4(0, 1000));
    w.start_agent(&[]);
    wait_programmed(&w, 1000, Duration::from_secs(60));
    let mut from = 1000;
    for (n, to) in [2000, 4000, 8000, 16000, 30000].into_iter().enumerate() {
        let t = std::time::Instant::now();
        w.write_manifest(&format!("step-{}.yaml", n + 1), &services4(from, to));
        wait_programmed(&w, to as u64, Duration::from_secs(300));
        let m = w.metrics();
        println!(
            "{from} -> {to} Services: programmed after {:.2} s (file written to metric), FERRY_SVC capacity {}, FERRY_BACKENDS capacity {}",
            t.elapsed().as_secs_f64(),
            gauge(&m, "ferry_map_capacity", "{map=\"FERRY_SVC\"}"),
            gauge(&m, "ferry_map_capacity", "{map=\"FERRY_BACKENDS\"}"),
        );
        from = to;
    }
    for l in w.agent_log().lines().filter(|l| l.contains("maps grown")) {
        println!("{l}");
    }
    // The agent is the only process whose command line names this world's bpffs.
    let bpffs = w.bpffs.to_string_lossy().into_owned();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(&bpffs) && cmdline.contains(" agent ") {
            let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
            for l in status
                .lines()
                .filter(|l| l.starts_with("VmHWM") || l.starts_with("VmRSS"))
            {
                println!("agent {l}");
            }
        }
    }
}
