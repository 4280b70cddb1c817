//! Robustness: full maps never push out live Services, bad manifests never take down
//! good ones, and directory changes reach the kernel quickly.

use std::time::{Duration, Instant};

use ferry_tests::*;

const ALPHA_VIP: &str = "10.96.0.10";
const BETA_VIP: &str = "10.96.0.11";

/// A Service `name` at `vip`:80 with one EndpointSlice of `eps` on 8080.
fn svc(name: &str, vip: &str, eps: &[Ep]) -> String {
    docs(&[
        service(name, &[vip], &[("http", 80, "TCP")], ""),
        slice(
            name,
            &format!("{name}-1"),
            "IPv4",
            &[("http", 8080, "TCP")],
            eps,
        ),
    ])
}

/// Every connect to `vip`:80 succeeds and lands on exactly `pods`.
fn assert_serves(w: &World, vip: &str, pods: &[&str], when: &str) {
    let outs = w.probe("tcp", &format!("{vip}:80"), 10);
    assert!(
        outs.iter().all(|o| o.ok),
        "{when}: every connect to {vip}:80 must succeed: {outs:?}"
    );
    assert_eq!(
        backends(&outs),
        set(pods),
        "{when}: backends reached through {vip}:80"
    );
}

/// `vip`:80 is not translated: the node has no route for it.
fn assert_not_programmed(w: &World, vip: &str, when: &str) {
    for o in w.probe("tcp", &format!("{vip}:80"), 2) {
        assert_eq!(
            o.errno,
            Some(ENETUNREACH),
            "{when}: {vip}:80 must not be translated (expected ENETUNREACH): {o:?}"
        );
    }
    let list = w.list_json();
    let frontends: Vec<&str> = list["frontends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["frontend"].as_str().unwrap())
        .collect();
    assert!(
        !frontends.contains(&format!("{vip}:80").as_str()),
        "{when}: ferry list must not show {vip}:80; saw {frontends:?}"
    );
}

fn metric(w: &World, name: &str) -> f64 {
    let m = w.metrics();
    m.lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix(' '))
                .map(|v| v.trim().parse::<f64>().unwrap())
        })
        .unwrap_or_else(|| panic!("metric {name} missing from /metrics:\n{m}"))
}

fn assert_metric(w: &World, name: &str, expected: f64, when: &str) {
    let seen = metric(w, name);
    assert_eq!(
        seen, expected,
        "{when}: metric {name}: expected {expected}, saw {seen}"
    );
}

/// Waits until the agent log contains every one of `needles` on one line; returns it.
fn log_line(w: &World, what: &str, needles: &[&str]) -> String {
    eventually(what, Duration::from_secs(5), || {
        let log = w.agent_log();
        log.lines()
            .find(|l| needles.iter().all(|n| l.contains(n)))
            .map(String::from)
            .ok_or_else(|| format!("no log line with all of {needles:?}; log:\n{log}"))
    })
}

// --- full maps ----------------------------------------------------------------------

/// Each of these Services takes 2 service-map entries (frontend + 1 slot): 3 fit one.
const SMALL_MAP: [&str; 2] = ["--max-services", "3"];

#[test]
fn full_map_new_service_is_reported_not_programmed() {
    let mut w = World::new("fullmap", 1, &[8080]);
    let pod1 = ep(w.pod("pod1").v4);
    w.write_manifest(
        "alpha.yaml",
        &svc("alpha", ALPHA_VIP, std::slice::from_ref(&pod1)),
    );
    w.write_manifest(
        "beta.yaml",
        &svc("beta", BETA_VIP, std::slice::from_ref(&pod1)),
    );
    w.start_agent(&SMALL_MAP);

    assert_serves(&w, ALPHA_VIP, &["pod1"], "alpha fits the map");
    assert_not_programmed(&w, BETA_VIP, "beta does not fit the map");
    let line = log_line(
        &w,
        "the agent names the Service that did not fit",
        &["default/beta", "raise --max-services"],
    );
    assert!(
        line.contains("ERROR"),
        "the map-full report must be an error: {line}"
    );
    assert_metric(&w, "ferry_plan_errors", 1.0, "one Service did not fit");
    assert_metric(&w, "ferry_services_programmed", 1.0, "one Service fits");

    // Freeing room (alpha deleted) programs beta at the next sync.
    w.remove_manifest("alpha.yaml");
    eventually(
        "beta programmed once alpha freed its entries",
        Duration::from_secs(3),
        || {
            let outs = w.probe("tcp", &format!("{BETA_VIP}:80"), 3);
            if outs.iter().all(|o| o.backend() == Some("pod1")) {
                Ok(())
            } else {
                Err(format!("{outs:?}"))
            }
        },
    );
    assert_not_programmed(&w, ALPHA_VIP, "alpha deleted");
    assert_metric(&w, "ferry_plan_errors", 0.0, "everything fits again");
    assert_metric(
        &w,
        "ferry_map_write_failures_total",
        0.0,
        "no map write may fail when the plan fits",
    );
}

/// A cluster far over the bound gets one line per cause, with the count and the first
/// names, not one line per Service; and the same summary is not logged again on every
/// sync.
#[test]
fn services_over_the_bound_are_reported_in_one_line() {
    let mut w = World::new("overbound", 1, &[8080]);
    let pod1 = ep(w.pod("pod1").v4);
    let all: Vec<String> = (0..40)
        .map(|i| {
            svc(
                &format!("s{i:02}"),
                &format!("10.96.1.{i}"),
                std::slice::from_ref(&pod1),
            )
        })
        .collect();
    w.write_manifest("many.yaml", &all.join("---\n"));
    w.start_agent(&SMALL_MAP);
    let line = log_line(
        &w,
        "one summary line for the 39 Services that do not fit",
        &[
            "39 ServicePorts do not fit the",
            "and 34 more",
            "raise --max-services",
        ],
    );
    assert!(line.contains("ERROR"), "{line}");
    assert_metric(&w, "ferry_plan_errors", 39.0, "39 do not fit");
    // A change elsewhere (another sync) does not repeat the same summary.
    w.write_manifest(
        "other.yaml",
        &svc("zz", "10.96.2.1", std::slice::from_ref(&pod1)),
    );
    log_line(
        &w,
        "the summary follows the 40th Service that does not fit",
        &["40 ServicePorts do not fit the"],
    );
    let log = w.agent_log();
    let lines = log.lines().filter(|l| l.contains("do not fit the")).count();
    assert_eq!(
        lines, 2,
        "one line per change of the summary, not per Service or sync:\n{log}"
    );
}

#[test]
fn programmed_service_is_never_pushed_out() {
    let mut w = World::new("pushout", 1, &[8080]);
    let pod1 = ep(w.pod("pod1").v4);
    w.write_manifest(
        "beta.yaml",
        &svc("beta", BETA_VIP, std::slice::from_ref(&pod1)),
    );
    w.start_agent(&SMALL_MAP);
    assert_serves(&w, BETA_VIP, &["pod1"], "beta alone");

    // alpha sorts before beta but arrives later: it must not take beta's place.
    w.write_manifest(
        "alpha.yaml",
        &svc("alpha", ALPHA_VIP, std::slice::from_ref(&pod1)),
    );
    log_line(
        &w,
        "the agent names alpha as not fitting",
        &["default/alpha", "raise --max-services"],
    );
    assert_serves(
        &w,
        BETA_VIP,
        &["pod1"],
        "after alpha arrived, beta (already programmed)",
    );
    assert_not_programmed(&w, ALPHA_VIP, "alpha arrived into a full map");
    assert_metric(&w, "ferry_plan_errors", 1.0, "alpha did not fit");

    // Nor across a restart, where both are read at once.
    w.stop_agent(libc::SIGTERM);
    let log_before = w.agent_log().len();
    w.start_agent(&SMALL_MAP);
    assert_serves(
        &w,
        BETA_VIP,
        &["pod1"],
        "after restart, beta (adopted from the pins)",
    );
    assert_not_programmed(&w, ALPHA_VIP, "after restart, alpha");
    let second_run = w.agent_log()[log_before..].to_string();
    assert!(
        second_run
            .lines()
            .any(|l| l.contains("default/alpha") && l.contains("raise --max-services")),
        "after restart the agent must report alpha again; log:\n{second_run}"
    );
    assert!(
        !second_run
            .lines()
            .any(|l| l.contains("default/beta") && l.contains("max-services")),
        "after restart beta must not be reported as not fitting; log:\n{second_run}"
    );
}

// --- bad manifests ------------------------------------------------------------------

#[test]
fn invalid_yaml_file_is_reported_and_good_file_works() {
    let mut w = World::new("badyaml", 1, &[8080]);
    w.write_manifest("good.yaml", &svc("web", ALPHA_VIP, &[ep(w.pod("pod1").v4)]));
    // Line 4 is broken (a second `:` in a plain scalar).
    w.write_manifest(
        "bad.yaml",
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: bad name: here\n  namespace: default\n",
    );
    w.start_agent(&[]);

    assert_serves(
        &w,
        ALPHA_VIP,
        &["pod1"],
        "the good file next to a broken one",
    );
    let bad = w.manifests.join("bad.yaml");
    let line = log_line(
        &w,
        "the broken file is reported with its line",
        &[&format!("{}:4", bad.display()), "invalid YAML"],
    );
    assert!(
        line.contains("ERROR"),
        "a broken manifest must be logged as an error: {line}"
    );
    assert_metric(
        &w,
        "ferry_source_errors",
        1.0,
        "one manifest file fails to parse",
    );
}

#[test]
fn broken_edit_keeps_last_good_state_and_fix_applies() {
    let mut w = World::new("badedit", 2, &[8080]);
    let to_pod1 = svc("web", ALPHA_VIP, &[ep(w.pod("pod1").v4)]);
    let to_pod2 = svc("web", ALPHA_VIP, &[ep(w.pod("pod2").v4)]);
    w.write_manifest("web.yaml", &to_pod1);
    w.start_agent(&[]);
    assert_serves(&w, ALPHA_VIP, &["pod1"], "before the edit");

    // The edit moves web to pod2 but breaks the slice's `kind` line.
    let broken_line = to_pod2
        .lines()
        .position(|l| l == "kind: EndpointSlice")
        .expect("slice kind line")
        + 1;
    let broken = to_pod2.replace("kind: EndpointSlice", "kind: EndpointSlice: oops");
    w.write_manifest("web.yaml", &broken);
    let at = format!("{}:{broken_line}", w.manifests.join("web.yaml").display());
    log_line(
        &w,
        "the broken edit is reported with its line",
        &[&at, "invalid YAML", "previous objects stay programmed"],
    );
    // The scan that reported the error did not apply anything: the last good state stays.
    assert_serves(
        &w,
        ALPHA_VIP,
        &["pod1"],
        "after a broken edit (last good state)",
    );
    assert_metric(
        &w,
        "ferry_source_errors",
        1.0,
        "the edited file fails to parse",
    );

    w.write_manifest("web.yaml", &to_pod2);
    eventually(
        "the fixed file is applied (web -> pod2)",
        Duration::from_secs(3),
        || {
            let seen = backends(&w.probe("tcp", &format!("{ALPHA_VIP}:80"), 5));
            if seen == set(&["pod2"]) {
                Ok(())
            } else {
                Err(format!("{seen:?}"))
            }
        },
    );
    log_line(
        &w,
        "the agent says the problem is fixed",
        &["all problems are fixed"],
    );
    assert_metric(&w, "ferry_source_errors", 0.0, "the file was fixed");
}

#[test]
fn malformed_service_is_reported_others_in_same_file_work() {
    let mut w = World::new("badsvc", 1, &[8080]);
    let pod1 = ep(w.pod("pod1").v4);
    w.write_manifest(
        "both.yaml",
        &docs(&[
            service("broken", &["10.96.0.999"], &[("http", 80, "TCP")], ""),
            slice(
                "broken",
                "broken-1",
                "IPv4",
                &[("http", 8080, "TCP")],
                std::slice::from_ref(&pod1),
            ),
            service("good", &[BETA_VIP], &[("http", 80, "TCP")], ""),
            slice(
                "good",
                "good-1",
                "IPv4",
                &[("http", 8080, "TCP")],
                std::slice::from_ref(&pod1),
            ),
        ]),
    );
    w.start_agent(&[]);
    assert_serves(
        &w,
        BETA_VIP,
        &["pod1"],
        "the good Service in the same file as a malformed one",
    );
    let line = log_line(
        &w,
        "the malformed Service is reported",
        &["Service default/broken", "spec.clusterIP", "10.96.0.999"],
    );
    assert!(
        line.contains("ERROR"),
        "a malformed Service must be logged as an error: {line}"
    );
    assert_metric(&w, "ferry_object_problems", 1.0, "one malformed Service");
    assert_metric(
        &w,
        "ferry_services_programmed",
        1.0,
        "only the good Service is programmed",
    );
    let list = w.list_json();
    let fes: Vec<&str> = list["frontends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["frontend"].as_str().unwrap())
        .collect();
    assert_eq!(
        fes,
        [format!("{BETA_VIP}:80")],
        "ferry list must show only the good Service"
    );
}

#[test]
fn directory_change_applies_within_one_second() {
    let mut w = World::new("fast", 2, &[8080]);
    let pod1 = ep(w.pod("pod1").v4);
    let pod2 = ep(w.pod("pod2").v4);
    w.write_manifest(
        "web.yaml",
        &svc("web", ALPHA_VIP, std::slice::from_ref(&pod1)),
    );
    w.start_agent(&[]);
    assert_serves(&w, ALPHA_VIP, &["pod1"], "start");
    let within = Duration::from_secs(1);

    // An endpoint change.
    let t = Instant::now();
    w.write_manifest(
        "web.yaml",
        &svc("web", ALPHA_VIP, std::slice::from_ref(&pod2)),
    );
    eventually("endpoint change (web -> pod2) applied", within, || {
        let outs = w.probe("tcp", &format!("{ALPHA_VIP}:80"), 3);
        if backends(&outs) == set(&["pod2"]) {
            Ok(())
        } else {
            Err(format!("{outs:?}"))
        }
    });
    eprintln!("endpoint change applied after {:?}", t.elapsed());

    // A new file with a new Service.
    let t = Instant::now();
    w.write_manifest(
        "api.yaml",
        &svc("api", BETA_VIP, std::slice::from_ref(&pod1)),
    );
    eventually("new Service (api) applied", within, || {
        let outs = w.probe("tcp", &format!("{BETA_VIP}:80"), 1);
        if outs[0].backend() == Some("pod1") {
            Ok(())
        } else {
            Err(format!("{outs:?}"))
        }
    });
    eprintln!("new Service applied after {:?}", t.elapsed());

    // A removed file.
    let t = Instant::now();
    w.remove_manifest("api.yaml");
    eventually("removed Service (api) no longer translated", within, || {
        let outs = w.probe("tcp", &format!("{BETA_VIP}:80"), 1);
        if outs[0].errno == Some(ENETUNREACH) {
            Ok(())
        } else {
            Err(format!("{outs:?}"))
        }
    });
    eprintln!("removal applied after {:?}", t.elapsed());
    assert_serves(
        &w,
        ALPHA_VIP,
        &["pod2"],
        "web untouched by api's coming and going",
    );
}
