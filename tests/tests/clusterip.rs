//! ClusterIP through the socket hooks: spread, live endpoint changes, refusal, ports.

use std::time::Duration;

use ferry_tests::*;

const VIP: &str = "10.96.0.10";

fn web_world(test: &str) -> World {
    let mut w = World::new(test, 3, &[8080]);
    let eps: Vec<Ep> = w.pods.iter().map(|p| ep(p.v4)).collect();
    w.write_manifest(
        "web.yaml",
        &docs(&[
            service("web", &[VIP], &[("http", 80, "TCP")], ""),
            slice("web", "web-1", "IPv4", &[("http", 8080, "TCP")], &eps),
        ]),
    );
    w.start_agent(&[]);
    w
}

#[test]
fn clusterip_spreads_over_all_backends() {
    let w = web_world("spread");
    let outs = w.probe("tcp", &format!("{VIP}:80"), 60);
    assert!(
        outs.iter().all(|o| o.ok),
        "every connect must succeed: {outs:?}"
    );
    let seen = backends(&outs);
    assert_eq!(
        seen,
        ["pod1", "pod2", "pod3"].map(String::from).into(),
        "60 connects should reach all 3 pods"
    );
    // A real HTTP client through the same VIP.
    let out = w.client(
        "curl",
        &["-s", "--max-time", "3", &format!("http://{VIP}/")],
    );
    let body = String::from_utf8_lossy(&out.stdout);
    assert!(
        body.starts_with("pod"),
        "curl through the ClusterIP got {body:?} ({})",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn getpeername_shows_the_service_address() {
    let w = web_world("peer");
    let outs = w.probe("tcp", &format!("{VIP}:80"), 5);
    for o in &outs {
        assert_eq!(
            o.peer.as_deref(),
            Some("10.96.0.10:80"),
            "getpeername must return the VIP: {o:?}"
        );
    }
}

#[test]
fn live_endpoint_removal_takes_effect() {
    let w = web_world("live");
    let eps = vec![ep(w.pod("pod1").v4), ep(w.pod("pod2").v4)];
    w.write_manifest(
        "web.yaml",
        &docs(&[
            service("web", &[VIP], &[("http", 80, "TCP")], ""),
            slice("web", "web-1", "IPv4", &[("http", 8080, "TCP")], &eps),
        ]),
    );
    eventually("pod3 no longer chosen", Duration::from_secs(2), || {
        let seen = backends(&w.probe("tcp", &format!("{VIP}:80"), 30));
        if seen == ["pod1", "pod2"].map(String::from).into() {
            Ok(())
        } else {
            Err(format!("{seen:?}"))
        }
    });
}

#[test]
fn no_endpoints_is_refused_at_once() {
    let mut w = World::new("refuse", 1, &[8080]);
    w.write_manifest(
        "empty.yaml",
        &docs(&[
            service(
                "empty",
                &[VIP],
                &[("http", 80, "TCP"), ("dns", 53, "UDP")],
                "",
            ),
            slice(
                "empty",
                "empty-1",
                "IPv4",
                &[("http", 8080, "TCP"), ("dns", 53, "UDP")],
                &[],
            ),
        ]),
    );
    w.start_agent(&[]);
    for o in w.probe("tcp", &format!("{VIP}:80"), 3) {
        assert_eq!(
            o.errno,
            Some(ECONNREFUSED),
            "connect must be refused: {o:?}"
        );
        assert!(o.ms < 500, "refusal must be immediate, took {} ms", o.ms);
    }
    let udp = w.probe("udp", &format!("{VIP}:53"), 1);
    assert_eq!(
        udp[0].errno,
        Some(ECONNREFUSED),
        "UDP sendto must be refused too: {udp:?}"
    );
    // A port the ClusterIP does not define is not translated (no route in this node).
    let other = w.probe("tcp", &format!("{VIP}:81"), 1);
    assert_eq!(
        other[0].errno,
        Some(ENETUNREACH),
        "undefined port must be left alone: {other:?}"
    );
}
