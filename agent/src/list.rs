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
                let id = c.services.get(&ServiceKey { slot, ..*k }).map(|s| s.backend_id).unwrap_or(0);
                match c.backends.get(&id) {
                    Some(b) => BackendView {
                        id,
                        address: fmt_endpoint(&b.addr, u16::from_be(b.port)),
                        state: if b.flags & ferry_common::lb::BACKEND_F_TERMINATING != 0 { "terminating" } else { "ok" },
                        local: b.flags & ferry_common::lb::BACKEND_F_LOCAL != 0,
                    },
                    None => BackendView { id, address: "-".into(), state: "missing", local: false },
                }
            })
            .collect();
        frontends.push(FrontendView {
            frontend: fmt_endpoint(&k.addr, u16::from_be(k.port)),
            protocol: proto_name(k.proto),
            scope: if k.scope == SCOPE_LOCAL_ORIGIN { "local-origin" } else { "external-origin" },
            service_id: v.svc_id,
            flags: flag_names(v.flags),
            affinity_timeout_s: (v.flags & ferry_common::lb::SVC_F_AFFINITY != 0).then_some(v.affinity_timeout_s),
            backends,
        });
    }
    let counters = COUNTER_NAMES.iter().copied().zip(counters.iter().copied()).collect();
    ListView { frontends, counters }
}

pub fn table(v: &ListView) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{:<28} {:<5} {:<16} {:>5}  {:<24} BACKENDS", "FRONTEND", "PROTO", "SCOPE", "ID", "FLAGS");
    for f in &v.frontends {
        let backends = if f.backends.is_empty() {
            "(none)".to_string()
        } else {
            f.backends
                .iter()
                .map(|b| if b.state == "ok" { b.address.clone() } else { format!("{}({})", b.address, b.state) })
                .collect::<Vec<_>>()
                .join(" ")
        };
        let flags = match f.affinity_timeout_s {
            Some(t) => format!("{} timeout={t}s", f.flags),
            None => f.flags.clone(),
        };
        let _ = writeln!(s, "{:<28} {:<5} {:<16} {:>5}  {:<24} {backends}", f.frontend, f.protocol, f.scope, f.service_id, flags);
    }
    let counters: Vec<String> = v.counters.iter().map(|(k, n)| format!("{k}={n}")).collect();
    let _ = writeln!(s, "\ncounters: {}", counters.join(" "));
    s
}
