//! `ferry list`: what the kernel is doing now, read from the pinned maps.

use std::{collections::BTreeMap, fmt::Write as _};

use ferry_common::{
    lb::{SCOPE_LOCAL_ORIGIN, ServiceKey},
    metrics::COUNTER_NAMES,
};
use serde::Serialize;

use crate::dataplane::{
    MapContent,
    external::ExternalContent,
    plan::{flag_names, fmt_endpoint, ip_of, proto_name},
};

#[derive(Debug, Serialize)]
pub struct FrontendView {
    pub frontend: String,
    pub protocol: &'static str,
    pub scope: &'static str,
    pub service_id: u32,
    pub flags: String,
    pub affinity_timeout_s: Option<u32>,
    pub backends: Vec<BackendView>,
    /// External-origin frontends with backends: whether the tc path's Maglev table of
    /// the service id is present (without it, new flows are not translated).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub maglev: Option<bool>,
    /// External-origin LoadBalancer frontends flagged `source-ranges`: the CIDRs
    /// admitted (none listed: nobody from outside is).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_ranges: Option<Vec<String>>,
}

#[derive(Debug, Serialize)]
pub struct BackendView {
    pub id: u32,
    pub address: String,
    /// `ok`, `terminating`, or `missing` (a slot points at an id that is not in the map).
    pub state: &'static str,
    pub local: bool,
}

#[derive(Debug, Serialize)]
pub struct ListView {
    pub frontends: Vec<FrontendView>,
    pub counters: BTreeMap<&'static str, u64>,
}

pub fn view(c: &MapContent, ext: &ExternalContent, counters: &[u64]) -> ListView {
    let mut frontends = Vec::new();
    for (k, v) in c.services.iter().filter(|(k, _)| k.slot == 0) {
        let backends = (1..=v.count)
            .map(|slot| {
                let id = c
                    .services
                    .get(&ServiceKey { slot, ..*k })
                    .map(|s| s.backend_id)
                    .unwrap_or(0);
                match c.backends.get(&id) {
                    Some(b) => BackendView {
                        id,
                        address: fmt_endpoint(&b.addr, u16::from_be(b.port)),
                        state: if b.flags & ferry_common::lb::BACKEND_F_TERMINATING != 0 {
                            "terminating"
                        } else {
                            "ok"
                        },
                        local: b.flags & ferry_common::lb::BACKEND_F_LOCAL != 0,
                    },
                    None => BackendView {
                        id,
                        address: "-".into(),
                        state: "missing",
                        local: false,
                    },
                }
            })
            .collect();
        frontends.push(FrontendView {
            frontend: fmt_endpoint(&k.addr, u16::from_be(k.port)),
            protocol: proto_name(k.proto),
            scope: if k.scope == SCOPE_LOCAL_ORIGIN {
                "local-origin"
            } else {
                "external-origin"
            },
            service_id: v.svc_id,
            flags: flag_names(v.flags),
            affinity_timeout_s: (v.flags & ferry_common::lb::SVC_F_AFFINITY != 0)
                .then_some(v.affinity_timeout_s),
            backends,
            maglev: (k.scope != SCOPE_LOCAL_ORIGIN && v.count > 0)
                .then(|| ext.maglev.contains_key(&v.svc_id)),
            source_ranges: (v.flags & ferry_common::lb::SVC_F_SOURCE_RANGES != 0)
                .then(|| source_ranges(ext, v.svc_id)),
        });
    }
    let counters = COUNTER_NAMES
        .iter()
        .copied()
        .zip(counters.iter().copied())
        .collect();
    ListView {
        frontends,
        counters,
    }
}

/// The CIDRs admitted for a service id, as written (`203.0.113.0/24`).
pub fn source_ranges(ext: &ExternalContent, svc_id: u32) -> Vec<String> {
    ext.ranges
        .iter()
        .filter(|r| r.svc_id == svc_id)
        .map(|r| format!("{}/{}", ip_of(&r.addr), r.cidr_len()))
        .collect()
}

pub fn table(v: &ListView) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<28} {:<5} {:<16} {:>5}  {:<24} BACKENDS",
        "FRONTEND", "PROTO", "SCOPE", "ID", "FLAGS"
    );
    for f in &v.frontends {
        let backends = if f.backends.is_empty() {
            "(none)".to_string()
        } else {
            f.backends
                .iter()
                .map(|b| {
                    if b.state == "ok" {
                        b.address.clone()
                    } else {
                        format!("{}({})", b.address, b.state)
                    }
                })
                .collect::<Vec<_>>()
                .join(" ")
        };
        let flags = match f.affinity_timeout_s {
            Some(t) => format!("{} timeout={t}s", f.flags),
            None => f.flags.clone(),
        };
        let mut backends = backends;
        if f.maglev == Some(false) {
            backends.push_str(" [no maglev table]");
        }
        if let Some(ranges) = &f.source_ranges {
            let list = if ranges.is_empty() {
                "none".to_string()
            } else {
                ranges.join(",")
            };
            backends.push_str(&format!(" [source-ranges={list}]"));
        }
        let _ = writeln!(
            s,
            "{:<28} {:<5} {:<16} {:>5}  {:<24} {backends}",
            f.frontend, f.protocol, f.scope, f.service_id, flags
        );
    }
    let counters: Vec<String> = v.counters.iter().map(|(k, n)| format!("{k}={n}")).collect();
    let _ = writeln!(s, "\ncounters: {}", counters.join(" "));
    s
}

#[cfg(test)]
mod tests {
    use std::fmt::Write as _;

    use ferry_common::metrics::COUNTER_NAMES;

    use super::{ListView, table, view};
    use crate::dataplane::{
        MapContent,
        external::{
            ExternalContent,
            tests::{lb, tc_content},
        },
        plan::tests::{Planner, assert_text, desired},
    };

    /// Three Services: ClientIP affinity over a local and a remote endpoint, a
    /// terminating fallback, and one without endpoints (reject).
    fn content() -> MapContent {
        let mut p = Planner::new();
        let (_, errors) = p.sync(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: sticky, namespace: default}
            spec:
              clusterIP: 10.96.0.11
              sessionAffinity: ClientIP
              sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}
              ports: [{name: http, port: 80}]
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: fallback, namespace: default}
            spec: {clusterIP: 10.96.0.13, ports: [{name: dns, port: 53, protocol: UDP}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: nowhere, namespace: default}
            spec: {clusterIP: 10.96.0.14, ports: [{name: http, port: 80}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: sticky-a, namespace: default, labels: {kubernetes.io/service-name: sticky}}
            addressType: IPv4
            ports: [{name: http, port: 8080}]
            endpoints: [{addresses: [10.0.0.1], nodeName: node-a}, {addresses: [10.0.0.2], nodeName: node-b}]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: fallback-a, namespace: default, labels: {kubernetes.io/service-name: fallback}}
            addressType: IPv4
            ports: [{name: dns, port: 5353, protocol: UDP}]
            endpoints:
            - addresses: [10.0.0.9]
              nodeName: node-b
              conditions: {ready: false, serving: true, terminating: true}
            "#,
        );
        assert_eq!(errors, vec![]);
        p.current
    }

    /// The view as text: one line per frontend, its backends indented below.
    fn render(v: &ListView) -> String {
        let mut s = String::new();
        for f in &v.frontends {
            let timeout = f
                .affinity_timeout_s
                .map(|t| format!(" timeout={t}s"))
                .unwrap_or_default();
            let _ = writeln!(
                s,
                "{} {} {} id={} flags={}{timeout}",
                f.frontend, f.protocol, f.scope, f.service_id, f.flags
            );
            for b in &f.backends {
                let _ = writeln!(
                    s,
                    "  {} {} {}{}",
                    b.id,
                    b.address,
                    b.state,
                    if b.local { " local" } else { "" }
                );
            }
        }
        for (name, n) in &v.counters {
            let _ = writeln!(s, "{name}={n}");
        }
        s
    }

    #[test]
    fn view_shows_frontends_backends_and_flags() {
        let counters: Vec<u64> = (1..=COUNTER_NAMES.len() as u64).collect();
        let v = view(&content(), &ExternalContent::default(), &counters);
        assert_text(
            "view",
            &render(&v),
            "
            10.96.0.11:80 TCP local-origin id=3 flags=affinity timeout=600s
              2 10.0.0.1:8080 ok local
              3 10.0.0.2:8080 ok
            10.96.0.13:53 UDP local-origin id=1 flags=terminating-fallback
              1 10.0.0.9:5353 terminating
            10.96.0.14:80 TCP local-origin id=2 flags=reject
            affinity_hit=5
            affinity_map_full=7
            backend_missing=4
            conntrack_map_full=14
            dropped_no_local_endpoints=3
            external_affinity_hit=15
            external_icmp_unreachable=10
            external_translated=9
            fib_lookup_failed=13
            rejected_no_endpoints=2
            reverse_translated=6
            revnat_map_full=8
            snat_ports_exhausted=12
            source_range_dropped=11
            translated=1
            ",
        );
    }

    /// A slot pointing at a backend id the backend map does not hold is shown as
    /// `missing`, not skipped; a missing slot reads as backend 0.
    #[test]
    fn view_shows_missing_backends() {
        let mut c = content();
        c.backends.remove(&3);
        let slot2 = *c
            .services
            .keys()
            .find(|k| k.slot == 2)
            .expect("sticky's slot 2");
        let slot1 = ferry_common::lb::ServiceKey { slot: 1, ..slot2 };
        c.services.remove(&slot1);
        let v = view(&c, &ExternalContent::default(), &[]);
        assert_text(
            "view",
            &render(&v),
            "
            10.96.0.11:80 TCP local-origin id=3 flags=affinity timeout=600s
              0 - missing
              3 - missing
            10.96.0.13:53 UDP local-origin id=1 flags=terminating-fallback
              1 10.0.0.9:5353 terminating
            10.96.0.14:80 TCP local-origin id=2 flags=reject
            ",
        );
        let json = serde_json::to_value(&v.frontends[0].backends[1]).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"id": 3, "address": "-", "state": "missing", "local": false})
        );
    }

    #[test]
    fn table_has_one_row_per_frontend() {
        let mut c = content();
        c.backends.remove(&3);
        let text = table(&view(&c, &ExternalContent::default(), &[7, 0, 0, 1]));
        assert_text(
            "table",
            &text,
            "
            FRONTEND                     PROTO SCOPE               ID  FLAGS                    BACKENDS
            10.96.0.11:80                TCP   local-origin         3  affinity timeout=600s    10.0.0.1:8080 -(missing)
            10.96.0.13:53                UDP   local-origin         1  terminating-fallback     10.0.0.9:5353(terminating)
            10.96.0.14:80                TCP   local-origin         2  reject                   (none)

            counters: backend_missing=1 dropped_no_local_endpoints=0 rejected_no_endpoints=0 translated=7
            ",
        );
        let rows = text.lines().filter(|l| l.starts_with("10.")).count();
        assert_eq!(rows, c.services.keys().filter(|k| k.slot == 0).count());
    }

    /// An external-origin LoadBalancer frontend shows its Maglev table and source ranges.
    #[test]
    fn external_frontends_show_maglev_and_source_ranges() {
        let yaml = lb("Cluster", &["10.0.0.1"], &[], "203.0.113.0/24");
        let mut p = Planner::new();
        p.sync(&yaml);
        let mut ext = tc_content(&desired(&yaml), &p.current);
        let v = view(&p.current, &ext, &[]);
        let lb = v
            .frontends
            .iter()
            .find(|f| f.scope == "external-origin" && f.frontend == "198.51.100.1:80")
            .expect("external frontend");
        assert_eq!(lb.maglev, Some(true));
        assert_eq!(lb.source_ranges, Some(vec!["203.0.113.0/24".to_string()]));
        let local = v
            .frontends
            .iter()
            .find(|f| f.scope == "local-origin")
            .unwrap();
        assert_eq!((local.maglev, &local.source_ranges), (None, &None));
        let row = table(&v)
            .lines()
            .find(|l| l.contains("external-origin") && l.starts_with("198."))
            .unwrap()
            .to_string();
        assert!(
            row.ends_with("10.0.0.1:8080 [source-ranges=203.0.113.0/24]"),
            "{row}"
        );
        ext.maglev.clear();
        let row = table(&view(&p.current, &ext, &[]))
            .lines()
            .find(|l| l.contains("external-origin") && l.starts_with("198."))
            .unwrap()
            .to_string();
        assert!(row.contains("[no maglev table]"), "{row}");
    }

    #[test]
    fn empty_maps() {
        let v = view(&MapContent::default(), &ExternalContent::default(), &[]);
        assert!(v.frontends.is_empty());
        assert!(v.counters.is_empty());
        let text = table(&v);
        assert_eq!(
            text.lines().collect::<Vec<_>>(),
            [text.lines().next().unwrap(), "", "counters: "]
        );
        assert!(text.starts_with("FRONTEND "), "{text}");
    }
}
