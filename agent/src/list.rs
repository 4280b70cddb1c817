//! `ferry list`: what the kernel is doing now, read from the pinned maps.

use std::{collections::BTreeMap, fmt::Write as _};

use ferry_common::{
    lb::{SCOPE_LOCAL_ORIGIN, ServiceKey},
    metrics::COUNTER_NAMES,
};
use serde::Serialize;

use crate::dataplane::{
    MapContent,
    plan::{flag_names, fmt_endpoint, proto_name},
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

pub fn view(c: &MapContent, counters: &[u64]) -> ListView {
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
        plan::tests::{Planner, assert_text},
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
        let v = view(&content(), &counters);
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
            dropped_no_local_endpoints=3
            rejected_no_endpoints=2
            reverse_translated=6
            revnat_map_full=8
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
        let v = view(&c, &[]);
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
        let text = table(&view(&c, &[7, 0, 0, 1]));
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

    #[test]
    fn empty_maps() {
        let v = view(&MapContent::default(), &[]);
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
