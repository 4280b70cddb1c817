//! `ferry explain ADDR:PORT/PROTO`: what a new connection to that address would do, and
//! why, read from the live pinned maps only (no agent needed).
//!
//! [`explain`] is a pure function over the map content, the affinity entries and the
//! per-service connection counts, so every answer is unit-tested without root. The few
//! system calls the command needs (clock, the caller's network namespace cookie) are in
//! [`sys`].
//!
//! Exit codes: 0 the address is a Service frontend (whatever its verdict),
//! [`EXIT_NOT_A_FRONTEND`] (3) it is not, 1 the maps cannot be read, 2 usage.

use std::{collections::BTreeMap, fmt::Write as _, net::IpAddr, str::FromStr};

use ferry_common::ct::FlowPorts;
use ferry_common::ext::{ClientAffinityKey, MAGLEV_TABLE_SIZE, flow_hash};
use ferry_common::lb::{
    AFFINITY_KIND_CLIENT, AFFINITY_KIND_SOCKET, AffinityKey, AffinityValue, BACKEND_F_LOCAL,
    BACKEND_F_TERMINATING, MemberKey, PROTO_TCP, PROTO_UDP, SCOPE_LOCAL_ORIGIN, SVC_F_AFFINITY,
    SVC_F_DROP, SVC_F_EXTERNAL, SVC_F_LOCAL_POLICY, SVC_F_NODEPORT, SVC_F_SOURCE_RANGES,
    SVC_F_TERMINATING_FALLBACK, ServiceKey, ServiceValue,
};
use serde::Serialize;

use crate::dataplane::{
    MapContent,
    external::ExternalContent,
    plan::{addr_of, flag_names, fmt_endpoint, ip_of, proto_name},
};

/// Exit code of `ferry explain` when the address is not a Service frontend.
pub const EXIT_NOT_A_FRONTEND: u8 = 3;

/// How long an unconnected UDP socket keeps its backend without traffic (the programs'
/// `UDP_STICKY_NS`).
const UDP_STICKY_S: u64 = 30;

/// `ADDR:PORT/PROTO` (`[v6]:PORT/PROTO`; PROTO is `tcp` or `udp`, default `tcp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Query {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: u8,
}

impl FromStr for Query {
    type Err = String;

    fn from_str(s: &str) -> Result<Query, String> {
        let (endpoint, proto) = match s.rsplit_once('/') {
            Some((e, p)) => (e, p),
            None => (s, "tcp"),
        };
        let proto = match proto.to_ascii_lowercase().as_str() {
            "tcp" => PROTO_TCP,
            "udp" => PROTO_UDP,
            "sctp" => return Err("SCTP is not proxied by ferry: nothing to explain".into()),
            other => return Err(format!("protocol {other:?}: use tcp or udp")),
        };
        let sa: std::net::SocketAddr = endpoint.parse().map_err(|_| {
            format!(
                "{endpoint:?}: expected ADDR:PORT (IPv6 as [ADDR]:PORT), e.g. 10.96.0.10:80/TCP"
            )
        })?;
        Ok(Query {
            addr: sa.ip(),
            port: sa.port(),
            proto,
        })
    }
}

impl std::fmt::Display for Query {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}",
            fmt_endpoint(&addr_of(&self.addr), self.port),
            proto_name(self.proto)
        )
    }
}

/// Who is asking (`--from`), as far as the CLI can tell.
#[derive(Clone, Debug, Default)]
pub struct Client {
    /// `--from IP`.
    pub from: Option<IpAddr>,
    /// `from` is an address of the network namespace `ferry explain` runs in.
    pub from_is_here: bool,
    /// The cookie of the network namespace `ferry explain` runs in (`SO_NETNS_COOKIE`).
    pub own_netns: Option<u64>,
    /// `--from-port`: the client's source port, for the tc path's Maglev pick.
    pub from_port: Option<u16>,
}

/// What the kernel holds, as the command read it.
pub struct Live<'a> {
    pub content: &'a MapContent,
    pub affinity: &'a [(AffinityKey, AffinityValue)],
    /// The tc path's ClientIP pins (client address, service id).
    pub tc_affinity: &'a [(ClientAffinityKey, AffinityValue)],
    /// Translated connects and datagrams per service id.
    pub connections: &'a BTreeMap<u32, u64>,
    /// `CLOCK_MONOTONIC` now, in ns (the clock of `bpf_ktime_get_ns`).
    pub now_ns: u64,
    /// The tc path's Maglev tables and source ranges.
    pub external: &'a ExternalContent,
    /// The tc path's port filter (`FERRY_FLOW_PORTS`); `None` without one (an object
    /// built before it, or no tc maps), when every port reaches the lookups.
    pub flow_ports: Option<&'a FlowPorts>,
}

#[derive(Debug, Serialize)]
pub struct Explanation {
    pub query: String,
    /// True when the address is a Service frontend (exit code 0).
    pub found: bool,
    pub summary: String,
    /// One per scope the frontend is programmed in.
    pub frontends: Vec<FrontendExplanation>,
    /// When not found: the frontends on the same address (other ports or protocols).
    pub same_address: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct FrontendExplanation {
    pub frontend: String,
    /// `ClusterIP`, `NodePort` or `externalIP/LoadBalancer` (from the frontend's flags).
    pub kind: &'static str,
    pub scope: &'static str,
    pub service_id: u32,
    pub flags: String,
    /// `translated`, `refused`, `dropped`, or `untranslated` (an external frontend whose
    /// port the tc path's port filter lacks: its packets pass untouched).
    pub verdict: &'static str,
    /// The error a local socket's connect() or sendmsg() gets, if any.
    pub errno: Option<&'static str>,
    pub why: String,
    pub policy: String,
    pub endpoints: String,
    pub topology: String,
    pub backends: Vec<BackendExplanation>,
    pub affinity: AffinityExplanation,
    /// Connects and datagrams translated for this ServicePort so far (all its frontends).
    pub connections_total: Option<u64>,
    pub warnings: Vec<String>,
    /// External-origin frontends: what the tc path does for a client outside the node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tc: Option<TcExplanation>,
}

#[derive(Debug, Serialize)]
pub struct TcExplanation {
    /// `admitted`, `dropped` (outside the LoadBalancer's source ranges), or `unknown`
    /// (no `--from`); `None` when the frontend has no source ranges.
    pub source_range: Option<&'static str>,
    pub source_ranges: Vec<String>,
    /// How the client's address reaches the backend.
    pub source_nat: String,
    /// `--from` and `--from-port`: the backend the Maglev table picks for that flow.
    pub maglev_pick: Option<String>,
    /// `--from`: the backend the client is pinned to by ClientIP affinity, when the pin
    /// would be used (it then wins over the Maglev pick).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity_pin: Option<String>,
    pub maglev_table: bool,
    /// The frontend's port is in the tc path's port filter (`FERRY_FLOW_PORTS`); `None`
    /// without a filter.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port_in_filter: Option<bool>,
}

#[derive(Debug, Serialize)]
pub struct BackendExplanation {
    pub id: u32,
    pub address: String,
    /// `ok`, `terminating`, or `missing` (a slot points at an id the map does not hold).
    pub state: &'static str,
    pub local: bool,
}

#[derive(Debug, Serialize)]
pub struct AffinityExplanation {
    /// `None` or `ClientIP`.
    pub mode: &'static str,
    pub timeout_s: Option<u32>,
    /// What an entry is keyed by.
    pub keyed_by: Option<&'static str>,
    /// Live and expired ClientIP entries of this ServicePort.
    pub entries: Vec<AffinityEntry>,
    /// Unconnected UDP sockets currently pinned to a backend of this ServicePort.
    pub udp_sticky_sockets: usize,
    /// What `--from` can and cannot say.
    pub client: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct AffinityEntry {
    /// Socket hooks: the client's network namespace.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_netns_cookie: Option<u64>,
    /// tc path: the client's address as the node sees it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_address: Option<String>,
    pub backend: String,
    pub age_s: u64,
    /// A new connection from that client would reuse the backend.
    pub used: bool,
    /// Why not, when it would not.
    pub why_not: Option<String>,
    /// The entry belongs to the network namespace `ferry explain` runs in.
    pub this_namespace: bool,
}

/// Explains what a new connection to `q` would do.
pub fn explain(live: &Live<'_>, q: &Query, client: &Client) -> Explanation {
    let addr = addr_of(&q.addr);
    let port = q.port.to_be();
    let frontends: Vec<FrontendExplanation> = live
        .content
        .services
        .iter()
        .filter(|(k, _)| k.slot == 0 && k.addr == addr && k.port == port && k.proto == q.proto)
        .map(|(k, v)| frontend(live, k, v, client))
        .collect();
    let query = q.to_string();
    if frontends.is_empty() {
        let same_address = live
            .content
            .services
            .keys()
            .filter(|k| k.slot == 0 && k.addr == addr)
            .map(|k| format!("{}/{}", u16::from_be(k.port), proto_name(k.proto)))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        return Explanation {
            summary: format!("{query}: not a Service frontend: traffic is not translated"),
            query,
            found: false,
            frontends,
            same_address,
        };
    }
    let summary = frontends
        .iter()
        .map(|f| format!("{query} ({}): {}", f.scope, f.verdict))
        .collect::<Vec<_>>()
        .join("; ");
    Explanation {
        query,
        found: true,
        summary,
        frontends,
        same_address: Vec::new(),
    }
}

fn frontend(
    live: &Live<'_>,
    k: &ServiceKey,
    v: &ServiceValue,
    client: &Client,
) -> FrontendExplanation {
    let c = live.content;
    let backends: Vec<BackendExplanation> = (1..=v.count)
        .map(|slot| {
            let id = c
                .services
                .get(&ServiceKey { slot, ..*k })
                .map(|s| s.backend_id)
                .unwrap_or(0);
            match c.backends.get(&id) {
                Some(b) => BackendExplanation {
                    id,
                    address: fmt_endpoint(&b.addr, u16::from_be(b.port)),
                    state: if b.flags & BACKEND_F_TERMINATING != 0 {
                        "terminating"
                    } else {
                        "ok"
                    },
                    local: b.flags & BACKEND_F_LOCAL != 0,
                },
                None => BackendExplanation {
                    id,
                    address: "-".into(),
                    state: "missing",
                    local: false,
                },
            }
        })
        .collect();
    let local_policy = v.flags & SVC_F_LOCAL_POLICY != 0;
    let fallback = v.flags & SVC_F_TERMINATING_FALLBACK != 0;
    let external = k.scope != SCOPE_LOCAL_ORIGIN;
    let affinity = affinity(live, k, v, client);
    let tc = external.then(|| tc_path(live, k, v, client, &affinity));
    let (verdict, errno, why) = if external {
        external_verdict(v, tc.as_ref().expect("external"), backends.len())
    } else if v.count == 0 && v.flags & SVC_F_DROP != 0 {
        (
            "dropped",
            Some("EHOSTUNREACH"),
            "internalTrafficPolicy Local and no endpoint on this node (there are endpoints elsewhere): \
             a local socket's connect() or sendmsg() fails at once with EHOSTUNREACH \
             (kube-proxy drops the packets and the client waits for a timeout)"
                .to_string(),
        )
    } else if v.count == 0 {
        (
            "refused",
            Some("ECONNREFUSED"),
            "the Service has no usable endpoint: connect() and sendmsg() fail at once with \
             ECONNREFUSED, as kube-proxy's REJECT"
                .to_string(),
        )
    } else {
        let n = backends.len();
        let how = if v.flags & SVC_F_AFFINITY != 0 {
            "the client's remembered backend if it has a live one, else one at random"
        } else if k.proto == PROTO_UDP {
            "one at random (an unconnected UDP socket then keeps it while it sends)"
        } else {
            "one at random"
        };
        (
            "translated",
            None,
            format!(
                "a new connection goes to one of {n} backend{}: {how}; the address is rewritten \
                 once, at connect() (or per datagram for unconnected UDP)",
                if n == 1 { "" } else { "s" }
            ),
        )
    };
    let mut warnings = Vec::new();
    let missing = backends.iter().filter(|b| b.state == "missing").count();
    if missing > 0 {
        warnings.push(format!(
            "{missing} slot(s) point at a backend the map does not hold: a connection that picks one \
             is not translated (counted as backend_missing); the agent repairs this on its next sync"
        ));
    }
    let policy = if local_policy && external {
        "externalTrafficPolicy Local: local endpoints only, the client address is kept".to_string()
    } else if local_policy {
        "internalTrafficPolicy Local: local endpoints only".to_string()
    } else {
        "Cluster: endpoints on every node".to_string()
    };
    let endpoints = if fallback {
        "terminating fallback: no endpoint is ready, so serving-but-terminating endpoints are used"
            .to_string()
    } else if v.count == 0 {
        "none".to_string()
    } else {
        "ready endpoints".to_string()
    };
    FrontendExplanation {
        frontend: format!(
            "{}/{}",
            fmt_endpoint(&k.addr, u16::from_be(k.port)),
            proto_name(k.proto)
        ),
        kind: if v.flags & SVC_F_NODEPORT != 0 {
            "NodePort"
        } else if v.flags & SVC_F_EXTERNAL != 0 {
            "externalIP/LoadBalancer"
        } else {
            "ClusterIP"
        },
        scope: if k.scope == SCOPE_LOCAL_ORIGIN {
            "local-origin"
        } else {
            "external-origin"
        },
        service_id: v.svc_id,
        flags: flag_names(v.flags),
        verdict,
        errno,
        why,
        policy,
        endpoints,
        topology: "not recorded in the maps: when the agent applied topology hints, the backends \
                   below are already the filtered set"
            .into(),
        affinity,
        backends,
        connections_total: live.connections.get(&v.svc_id).copied(),
        warnings,
        tc,
    }
}

/// What the tc path does with a new flow from outside the node (docs/external-traffic.md).
fn tc_path(
    live: &Live<'_>,
    k: &ServiceKey,
    v: &ServiceValue,
    client: &Client,
    affinity: &AffinityExplanation,
) -> TcExplanation {
    let c = live.content;
    let ranges = crate::list::source_ranges(live.external, v.svc_id);
    let source_range = (v.flags & SVC_F_SOURCE_RANGES != 0).then(|| match client.from {
        None => "unknown",
        Some(ip) => {
            let inside = live
                .external
                .ranges
                .iter()
                .filter(|r| r.svc_id == v.svc_id)
                .any(|r| {
                    let cidr = crate::model::Cidr::new(ip_of(&r.addr), r.cidr_len() as u8);
                    cidr.is_some_and(|c| c.contains(&ip))
                });
            if inside { "admitted" } else { "dropped" }
        }
    });
    let table = live.external.maglev.get(&v.svc_id);
    let maglev_pick = match (client.from, client.from_port, table) {
        (Some(ip), Some(port), Some(t)) if v.count > 0 => {
            let h = flow_hash(&addr_of(&ip), &k.addr, port.to_be(), k.port, k.proto);
            let id = t.backend_ids[(h % MAGLEV_TABLE_SIZE as u32) as usize];
            Some(match c.backends.get(&id) {
                Some(b) => format!(
                    "{} (backend {id}{})",
                    fmt_endpoint(&b.addr, u16::from_be(b.port)),
                    if b.flags & BACKEND_F_LOCAL != 0 {
                        ", local"
                    } else {
                        ""
                    }
                ),
                None => format!("backend {id}, which the backend map does not hold"),
            })
        }
        _ => None,
    };
    let source_nat = if v.flags & SVC_F_LOCAL_POLICY != 0 {
        "none: externalTrafficPolicy Local, the backend sees the client's address".to_string()
    } else {
        "to this node's address on the way out when the backend is on another node (so its \
         reply comes back here); none when the backend is local"
            .to_string()
    };
    TcExplanation {
        source_range,
        source_ranges: ranges,
        source_nat,
        maglev_pick,
        maglev_table: table.is_some(),
        port_in_filter: live.flow_ports.map(|f| f.has(k.port)),
        affinity_pin: client.from.and_then(|ip| {
            let ip = ip.to_string();
            affinity
                .entries
                .iter()
                .find(|e| e.used && e.client_address.as_deref() == Some(ip.as_str()))
                .map(|e| e.backend.clone())
        }),
    }
}

fn external_verdict(
    v: &ServiceValue,
    tc: &TcExplanation,
    n: usize,
) -> (&'static str, Option<&'static str>, String) {
    if tc.port_in_filter == Some(false) {
        return (
            "untranslated",
            None,
            "the frontend's port is not in the tc path's port filter (FERRY_FLOW_PORTS): the tc \
             programs pass its packets untouched. The agent sets a port before it writes the \
             frontend, so this is a bug: restarting the agent writes the filter again; please \
             report it"
                .into(),
        );
    }
    if tc.source_range == Some("dropped") {
        return (
            "dropped",
            None,
            "the client is outside the LoadBalancer's loadBalancerSourceRanges: its packets are dropped".into(),
        );
    }
    if v.count == 0 && v.flags & SVC_F_DROP != 0 {
        return (
            "dropped",
            None,
            "externalTrafficPolicy Local and no endpoint on this node (there are endpoints elsewhere): \
             packets are dropped, as kube-proxy does, so the load balancer's health check moves traffic away"
                .into(),
        );
    }
    if v.count == 0 {
        return (
            "refused",
            None,
            "the Service has no usable endpoint: every SYN and datagram gets an ICMP port unreachable \
             (the client sees connection refused), as kube-proxy's REJECT"
                .into(),
        );
    }
    let how = match (&tc.affinity_pin, &tc.maglev_pick) {
        (Some(pin), _) => format!("this client is pinned to {pin} by ClientIP affinity"),
        (None, Some(pick)) => format!("this flow goes to {pick}"),
        (None, None) => "give --from and --from-port to see which".into(),
    };
    (
        "translated",
        None,
        format!(
            "a new flow from outside goes to one of {n} backend{} chosen by the Maglev table from its \
             5-tuple ({how}); conntrack keeps it there",
            if n == 1 { "" } else { "s" }
        ),
    )
}

/// Would the programs reuse this entry's backend for this frontend? Mirrors
/// `remembered_backend` in `ebpf/src/lb.rs`.
fn entry_fits(
    c: &MapContent,
    v: &ServiceValue,
    e: &AffinityValue,
    age_ns: u64,
) -> Result<(), String> {
    if age_ns > u64::from(v.affinity_timeout_s) * 1_000_000_000 {
        return Err(format!("expired (timeout {}s)", v.affinity_timeout_s));
    }
    if !c.members.contains(&MemberKey {
        svc_id: v.svc_id,
        backend_id: e.backend_id,
    }) {
        return Err("the backend is no longer an endpoint of this Service".into());
    }
    let Some(b) = c.backends.get(&e.backend_id) else {
        return Err("the backend is not in the backend map".into());
    };
    if v.flags & SVC_F_LOCAL_POLICY != 0 && b.flags & BACKEND_F_LOCAL == 0 {
        return Err("the backend is not local and this frontend takes local endpoints only".into());
    }
    if b.flags & BACKEND_F_TERMINATING != 0 && v.flags & SVC_F_TERMINATING_FALLBACK == 0 {
        return Err("the backend is terminating and ready endpoints exist".into());
    }
    Ok(())
}

/// One affinity entry as `ferry explain` shows it: its backend, age, and whether the
/// programs would use it for frontend `v`.
fn affinity_entry(live: &Live<'_>, v: &ServiceValue, av: &AffinityValue) -> AffinityEntry {
    let c = live.content;
    let age_ns = live.now_ns.saturating_sub(av.last_used_ns);
    let fits = if v.count == 0 {
        Err("the frontend has no backends".to_string())
    } else {
        entry_fits(c, v, av, age_ns)
    };
    AffinityEntry {
        client_netns_cookie: None,
        client_address: None,
        backend: c
            .backends
            .get(&av.backend_id)
            .map(|b| fmt_endpoint(&b.addr, u16::from_be(b.port)))
            .unwrap_or_else(|| format!("backend {} (gone)", av.backend_id)),
        age_s: age_ns / 1_000_000_000,
        used: fits.is_ok(),
        why_not: fits.err(),
        this_namespace: false,
    }
}

/// ClientIP affinity of an external-origin frontend: the tc path's pins, keyed by the
/// client's address.
fn tc_affinity(live: &Live<'_>, v: &ServiceValue, client: &Client) -> AffinityExplanation {
    let on = v.flags & SVC_F_AFFINITY != 0;
    let mut entries: Vec<AffinityEntry> = live
        .tc_affinity
        .iter()
        .filter(|(ak, _)| on && ak.svc_id == v.svc_id)
        .map(|(ak, av)| AffinityEntry {
            client_address: Some(ip_of(&ak.client).to_string()),
            ..affinity_entry(live, v, av)
        })
        .collect();
    entries.sort_by(|a, b| (a.age_s, &a.client_address).cmp(&(b.age_s, &b.client_address)));
    let client_note = client.from.map(|ip| {
        if !on {
            return format!(
                "--from {ip}: this Service has no session affinity: every new flow from outside is \
                 placed by the Maglev table"
            );
        }
        let ip_text = ip.to_string();
        match entries
            .iter()
            .find(|e| e.client_address.as_deref() == Some(ip_text.as_str()))
        {
            Some(e) if e.used => format!(
                "--from {ip} is pinned to {} (entry {}s old): its next new flow goes there",
                e.backend, e.age_s
            ),
            Some(e) => format!(
                "--from {ip}: its pin points at {} but is not used ({}); its next new flow is \
                 placed by the Maglev table and pinned again",
                e.backend,
                e.why_not.as_deref().unwrap_or("-")
            ),
            None => format!(
                "--from {ip} has no pin: its next new flow is placed by the Maglev table and the \
                 client is then pinned to that backend"
            ),
        }
    });
    AffinityExplanation {
        mode: if on { "ClientIP" } else { "None" },
        timeout_s: on.then_some(v.affinity_timeout_s),
        keyed_by: on.then_some(
            "client address as this node sees it (before source NAT), per ServicePort (tc path)",
        ),
        entries,
        udp_sticky_sockets: 0,
        client: client_note,
    }
}

fn affinity(
    live: &Live<'_>,
    k: &ServiceKey,
    v: &ServiceValue,
    client: &Client,
) -> AffinityExplanation {
    if k.scope != SCOPE_LOCAL_ORIGIN {
        return tc_affinity(live, v, client);
    }
    let on = v.flags & SVC_F_AFFINITY != 0;
    let mut entries: Vec<AffinityEntry> = live
        .affinity
        .iter()
        .filter(|(ak, _)| on && ak.kind == AFFINITY_KIND_CLIENT && ak.svc_id == v.svc_id)
        .map(|(ak, av)| AffinityEntry {
            client_netns_cookie: Some(ak.client),
            this_namespace: client.own_netns == Some(ak.client),
            ..affinity_entry(live, v, av)
        })
        .collect();
    entries.sort_by_key(|e| (e.age_s, e.client_netns_cookie));
    let udp_sticky_sockets = if k.proto == PROTO_UDP && !on {
        live.affinity
            .iter()
            .filter(|(ak, av)| {
                ak.kind == AFFINITY_KIND_SOCKET
                    && ak.svc_id == v.svc_id
                    && live.now_ns.saturating_sub(av.last_used_ns) <= UDP_STICKY_S * 1_000_000_000
            })
            .count()
    } else {
        0
    };
    let client_note = client.from.map(|ip| {
        if !on {
            return format!(
                "--from {ip}: this Service has no session affinity, so the client does not matter: \
                 every new connection picks a backend again"
            );
        }
        let own = client.own_netns.filter(|_| client.from_is_here);
        match own {
            Some(cookie) => match entries
                .iter()
                .find(|e| e.client_netns_cookie == Some(cookie))
            {
                Some(e) if e.used => format!(
                    "--from {ip} is an address of this network namespace (cookie {cookie}): its next \
                     connection goes to {} (entry {}s old)",
                    e.backend, e.age_s
                ),
                Some(e) => format!(
                    "--from {ip} is an address of this network namespace (cookie {cookie}): its entry \
                     points at {} but is not used ({}); the next connection picks at random",
                    e.backend,
                    e.why_not.as_deref().unwrap_or("-")
                ),
                None => format!(
                    "--from {ip} is an address of this network namespace (cookie {cookie}): no entry \
                     yet; its next connection picks at random and is then remembered"
                ),
            },
            None => format!(
                "--from {ip}: ferry keys ClientIP affinity by the client's network namespace cookie \
                 (one per pod, one for the host), not by IP, and the maps record no IP for a cookie, \
                 so the entries above are every client of this Service. To see one client's entry, \
                 run ferry explain inside its network namespace (`ip netns exec NS ferry explain ...` \
                 or `nsenter -n -t PID ferry explain ...`) with --from one of its addresses"
            ),
        }
    });
    AffinityExplanation {
        mode: if on { "ClientIP" } else { "None" },
        timeout_s: on.then_some(v.affinity_timeout_s),
        keyed_by: on.then_some(
            "client network namespace cookie (one per pod, one for the host), not client IP",
        ),
        entries,
        udp_sticky_sockets,
        client: client_note,
    }
}

/// The explanation as text, for people.
pub fn text(e: &Explanation) -> String {
    let mut s = String::new();
    if !e.found {
        let _ = writeln!(s, "{}", e.summary);
        if !e.same_address.is_empty() {
            let _ = writeln!(
                s,
                "  {} is a frontend on other ports: {}",
                e.query.rsplit_once(':').map(|(a, _)| a).unwrap_or(&e.query),
                e.same_address.join(", ")
            );
        }
        return s;
    }
    for f in &e.frontends {
        let _ = writeln!(
            s,
            "{}: {} frontend, service id {} ({})",
            f.frontend, f.kind, f.service_id, f.scope
        );
        let _ = writeln!(
            s,
            "  verdict:   {}{}",
            f.verdict,
            f.errno.map(|e| format!(" ({e})")).unwrap_or_default()
        );
        let _ = writeln!(s, "  why:       {}", f.why);
        let _ = writeln!(s, "  policy:    {}", f.policy);
        let _ = writeln!(s, "  endpoints: {}", f.endpoints);
        let _ = writeln!(s, "  topology:  {}", f.topology);
        let _ = writeln!(
            s,
            "  flags:     {}",
            if f.flags.is_empty() { "-" } else { &f.flags }
        );
        if f.backends.is_empty() {
            let _ = writeln!(s, "  backends:  (none)");
        } else {
            let _ = writeln!(s, "  backends:");
            for b in &f.backends {
                let mut tags = vec![b.state];
                if b.local {
                    tags.push("local");
                }
                let _ = writeln!(s, "    {:<28} {}", b.address, tags.join(", "));
            }
        }
        let a = &f.affinity;
        match a.timeout_s {
            Some(t) => {
                let _ = writeln!(
                    s,
                    "  affinity:  ClientIP, timeout {t}s, keyed by {}",
                    a.keyed_by.unwrap_or("-")
                );
                if a.entries.is_empty() {
                    let _ = writeln!(s, "    no entries: no client connected within the timeout");
                }
                for en in &a.entries {
                    let state = match &en.why_not {
                        None => "used".to_string(),
                        Some(w) => format!("not used: {w}"),
                    };
                    let who = match (&en.client_address, en.client_netns_cookie) {
                        (Some(a), _) => format!("client {a:<27}"),
                        (None, cookie) => {
                            format!("client netns cookie {:<12}", cookie.unwrap_or(0))
                        }
                    };
                    let _ = writeln!(
                        s,
                        "    {who} -> {:<24} {:>6}s ago  {state}{}",
                        en.backend,
                        en.age_s,
                        if en.this_namespace {
                            "  (this namespace)"
                        } else {
                            ""
                        }
                    );
                }
            }
            None => {
                let _ = writeln!(s, "  affinity:  none: each connection picks again");
            }
        }
        if a.udp_sticky_sockets > 0 {
            let _ = writeln!(
                s,
                "  udp:       {} unconnected socket(s) keep their backend while they send ({UDP_STICKY_S}s idle)",
                a.udp_sticky_sockets
            );
        }
        if let Some(note) = &a.client {
            let _ = writeln!(s, "  client:    {note}");
        }
        if let Some(n) = f.connections_total {
            let _ = writeln!(
                s,
                "  translated so far: {n} connection(s)/datagram(s) for this ServicePort"
            );
        }
        if let Some(tc) = &f.tc {
            if let Some(verdict) = tc.source_range {
                let list = if tc.source_ranges.is_empty() {
                    "none".to_string()
                } else {
                    tc.source_ranges.join(", ")
                };
                let _ = writeln!(s, "  source ranges: {list}: client {verdict}");
            }
            let _ = writeln!(s, "  source NAT: {}", tc.source_nat);
            if !tc.maglev_table && !f.backends.is_empty() {
                let _ = writeln!(
                    s,
                    "  maglev:    no table for service id {}: new flows are not translated until the agent writes it",
                    f.service_id
                );
            }
        }
        for w in &f.warnings {
            let _ = writeln!(s, "  warning:   {w}");
        }
    }
    s
}

/// The system calls the command needs; not unit-tested (they need a real kernel).
pub mod sys {
    use std::net::{IpAddr, SocketAddr, UdpSocket};

    /// `CLOCK_MONOTONIC` in ns: the clock `bpf_ktime_get_ns` reads.
    pub fn monotonic_ns() -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes into the timespec we own.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }

    /// The cookie of the network namespace this process runs in (Linux 5.14+), the key
    /// ClientIP affinity entries use.
    pub fn own_netns_cookie() -> Option<u64> {
        const SO_NETNS_COOKIE: libc::c_int = 71;
        let sock = UdpSocket::bind("127.0.0.1:0").ok()?;
        let mut cookie: u64 = 0;
        let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `cookie`, which we own.
        let rc = unsafe {
            libc::getsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&sock),
                libc::SOL_SOCKET,
                SO_NETNS_COOKIE,
                (&mut cookie as *mut u64).cast(),
                &mut len,
            )
        };
        (rc == 0).then_some(cookie)
    }

    /// True when `ip` is an address of this network namespace (a socket can bind it).
    pub fn is_local_address(ip: IpAddr) -> bool {
        !ip.is_unspecified() && UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use ferry_common::lb::{
        AFFINITY_KIND_CLIENT, AFFINITY_KIND_SOCKET, AffinityKey, AffinityValue,
    };

    use super::*;
    use crate::dataplane::plan::tests::{Planner, assert_text};

    const S: u64 = 1_000_000_000;

    /// sticky (ClientIP 600 s, one local and one remote endpoint), fallback (UDP,
    /// terminating only), nowhere (no endpoints), localonly (iTP Local, endpoint
    /// elsewhere), nodeport (a NodePort on the node's address).
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
            apiVersion: v1
            kind: Service
            metadata: {name: localonly, namespace: default}
            spec: {clusterIP: 10.96.0.15, internalTrafficPolicy: Local, ports: [{name: http, port: 80}]}
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
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: localonly-a, namespace: default, labels: {kubernetes.io/service-name: localonly}}
            addressType: IPv4
            ports: [{name: http, port: 8080}]
            endpoints: [{addresses: [10.0.0.5], nodeName: node-b}]
            "#,
        );
        assert_eq!(errors, vec![]);
        p.current
    }

    fn svc_id(c: &MapContent, vip: &str) -> u32 {
        let addr = addr_of(&vip.parse().unwrap());
        c.services
            .iter()
            .find(|(k, _)| k.slot == 0 && k.addr == addr)
            .unwrap()
            .1
            .svc_id
    }

    fn backend_id(c: &MapContent, ip: &str) -> u32 {
        let addr = addr_of(&ip.parse().unwrap());
        *c.backends.iter().find(|(_, b)| b.addr == addr).unwrap().0
    }

    fn run(
        c: &MapContent,
        affinity: &[(AffinityKey, AffinityValue)],
        q: &str,
        client: &Client,
    ) -> Explanation {
        let conns: BTreeMap<u32, u64> = [(svc_id(c, "10.96.0.11"), 42)].into();
        let live = Live {
            content: c,
            affinity,
            tc_affinity: &[],
            connections: &conns,
            now_ns: 10_000 * S,
            external: &ExternalContent::default(),
            flow_ports: None,
        };
        explain(&live, &q.parse().unwrap(), client)
    }

    #[test]
    fn parses_queries() {
        let q: Query = "10.96.0.10:80/TCP".parse().unwrap();
        assert_eq!(
            (q.addr.to_string(), q.port, q.proto),
            ("10.96.0.10".into(), 80, PROTO_TCP)
        );
        let q: Query = "[fd00::10]:53/udp".parse().unwrap();
        assert_eq!(
            (q.addr.to_string(), q.port, q.proto),
            ("fd00::10".into(), 53, PROTO_UDP)
        );
        assert_eq!(
            "10.96.0.10:80".parse::<Query>().unwrap().proto,
            PROTO_TCP,
            "TCP by default"
        );
        assert_eq!(
            "10.96.0.10:80/udp".parse::<Query>().unwrap().to_string(),
            "10.96.0.10:80/UDP"
        );
        assert!(
            "10.96.0.10:80/sctp"
                .parse::<Query>()
                .unwrap_err()
                .contains("SCTP")
        );
        assert!(
            "10.96.0.10/tcp"
                .parse::<Query>()
                .unwrap_err()
                .contains("ADDR:PORT")
        );
        assert!(
            "10.96.0.10:80/icmp"
                .parse::<Query>()
                .unwrap_err()
                .contains("tcp or udp")
        );
    }

    #[test]
    fn clusterip_with_affinity_lists_backends_and_entries() {
        let c = content();
        let id = svc_id(&c, "10.96.0.11");
        let local = backend_id(&c, "10.0.0.1");
        let remote = backend_id(&c, "10.0.0.2");
        let entry = |client, backend_id, age_s: u64| {
            (
                AffinityKey {
                    client,
                    svc_id: id,
                    kind: AFFINITY_KIND_CLIENT,
                },
                AffinityValue {
                    last_used_ns: 10_000 * S - age_s * S,
                    backend_id,
                    _pad: 0,
                },
            )
        };
        let affinity = [
            entry(4001, local, 5),
            entry(4002, remote, 700),
            entry(4003, 999, 1),
            // Another Service's entry and a UDP socket entry are not listed.
            (
                AffinityKey {
                    client: 4004,
                    svc_id: id + 100,
                    kind: AFFINITY_KIND_CLIENT,
                },
                AffinityValue::default(),
            ),
            (
                AffinityKey {
                    client: 4005,
                    svc_id: id,
                    kind: AFFINITY_KIND_SOCKET,
                },
                AffinityValue::default(),
            ),
        ];
        let e = run(
            &c,
            &affinity,
            "10.96.0.11:80/TCP",
            &Client {
                own_netns: Some(4001),
                from_port: None,
                ..Default::default()
            },
        );
        assert!(e.found);
        assert_text(
            "explain",
            &text(&e),
            "
            10.96.0.11:80/TCP: ClusterIP frontend, service id 4 (local-origin)
              verdict:   translated
              why:       a new connection goes to one of 2 backends: the client's remembered backend if it has a live one, else one at random; the address is rewritten once, at connect() (or per datagram for unconnected UDP)
              policy:    Cluster: endpoints on every node
              endpoints: ready endpoints
              topology:  not recorded in the maps: when the agent applied topology hints, the backends below are already the filtered set
              flags:     affinity
              backends:
                10.0.0.1:8080                ok, local
                10.0.0.2:8080                ok
              affinity:  ClientIP, timeout 600s, keyed by client network namespace cookie (one per pod, one for the host), not client IP
                client netns cookie 4003         -> backend 999 (gone)            1s ago  not used: the backend is no longer an endpoint of this Service
                client netns cookie 4001         -> 10.0.0.1:8080                 5s ago  used  (this namespace)
                client netns cookie 4002         -> 10.0.0.2:8080               700s ago  not used: expired (timeout 600s)
              translated so far: 42 connection(s)/datagram(s) for this ServicePort
            ",
        );
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["frontends"][0]["verdict"], "translated");
        assert_eq!(
            json["frontends"][0]["affinity"]["entries"][1]["client_netns_cookie"],
            4001
        );
        assert_eq!(json["frontends"][0]["backends"][0]["local"], true);
    }

    #[test]
    fn from_explains_the_netns_keying() {
        let c = content();
        let id = svc_id(&c, "10.96.0.11");
        let affinity = [(
            AffinityKey {
                client: 4001,
                svc_id: id,
                kind: AFFINITY_KIND_CLIENT,
            },
            AffinityValue {
                last_used_ns: 9_990 * S,
                backend_id: backend_id(&c, "10.0.0.2"),
                _pad: 0,
            },
        )];
        let from = Some("10.1.1.2".parse().unwrap());
        let elsewhere = Client {
            from,
            from_is_here: false,
            own_netns: Some(1),
            from_port: None,
        };
        let note = |e: &Explanation| e.frontends[0].affinity.client.clone().unwrap();
        let e = run(&c, &affinity, "10.96.0.11:80/TCP", &elsewhere);
        assert!(
            note(&e).contains("not by IP") && note(&e).contains("ip netns exec"),
            "{}",
            note(&e)
        );
        let here = Client {
            from,
            from_is_here: true,
            own_netns: Some(4001),
            from_port: None,
        };
        assert_eq!(
            note(&run(&c, &affinity, "10.96.0.11:80/TCP", &here)),
            "--from 10.1.1.2 is an address of this network namespace (cookie 4001): its next connection goes to 10.0.0.2:8080 (entry 10s old)"
        );
        let fresh = Client {
            from,
            from_is_here: true,
            own_netns: Some(7),
            from_port: None,
        };
        assert!(note(&run(&c, &affinity, "10.96.0.11:80/TCP", &fresh)).contains("no entry yet"));
        let plain = run(&c, &affinity, "10.96.0.14:80/TCP", &elsewhere);
        assert!(
            note(&plain).contains("no session affinity"),
            "{}",
            note(&plain)
        );
    }

    #[test]
    fn refused_dropped_and_fallback() {
        let c = content();
        let e = run(&c, &[], "10.96.0.14:80/TCP", &Client::default());
        let f = &e.frontends[0];
        assert_eq!(
            (f.verdict, f.errno, f.backends.len()),
            ("refused", Some("ECONNREFUSED"), 0)
        );
        assert!(text(&e).contains("  backends:  (none)\n"), "{}", text(&e));

        let e = run(&c, &[], "10.96.0.15:80/TCP", &Client::default());
        let f = &e.frontends[0];
        assert_eq!((f.verdict, f.errno), ("dropped", Some("EHOSTUNREACH")));
        assert_eq!(
            f.policy,
            "internalTrafficPolicy Local: local endpoints only"
        );
        assert!(f.why.contains("no endpoint on this node"), "{}", f.why);

        let id = svc_id(&c, "10.96.0.13");
        let sticky = [
            (
                AffinityKey {
                    client: 1,
                    svc_id: id,
                    kind: AFFINITY_KIND_SOCKET,
                },
                AffinityValue {
                    last_used_ns: 9_995 * S,
                    backend_id: 1,
                    _pad: 0,
                },
            ),
            (
                AffinityKey {
                    client: 2,
                    svc_id: id,
                    kind: AFFINITY_KIND_SOCKET,
                },
                AffinityValue {
                    last_used_ns: 9_900 * S,
                    backend_id: 1,
                    _pad: 0,
                },
            ),
        ];
        let e = run(&c, &sticky, "10.96.0.13:53/udp", &Client::default());
        let f = &e.frontends[0];
        assert_eq!(f.verdict, "translated");
        assert!(
            f.endpoints.starts_with("terminating fallback"),
            "{}",
            f.endpoints
        );
        assert_eq!(f.backends[0].state, "terminating");
        assert_eq!(
            f.affinity.udp_sticky_sockets, 1,
            "the idle socket's entry has expired"
        );
        assert!(
            text(&e).contains("1 unconnected socket(s) keep their backend"),
            "{}",
            text(&e)
        );
        assert_eq!(f.connections_total, None, "no traffic counted yet");
    }

    #[test]
    fn not_a_frontend() {
        let c = content();
        let e = run(&c, &[], "10.96.0.99:80/TCP", &Client::default());
        assert!(!e.found);
        assert_eq!(
            text(&e),
            "10.96.0.99:80/TCP: not a Service frontend: traffic is not translated\n"
        );
        // Right address, wrong port or protocol: the frontends there are named.
        let e = run(&c, &[], "10.96.0.13:53/TCP", &Client::default());
        assert!(!e.found);
        assert_text(
            "explain",
            &text(&e),
            "
            10.96.0.13:53/TCP: not a Service frontend: traffic is not translated
              10.96.0.13 is a frontend on other ports: 53/UDP
            ",
        );
    }

    #[test]
    fn missing_backends_are_a_warning() {
        let mut c = content();
        c.backends.remove(&backend_id(&c, "10.0.0.2"));
        let e = run(&c, &[], "10.96.0.11:80/TCP", &Client::default());
        let f = &e.frontends[0];
        assert_eq!(
            f.backends.iter().filter(|b| b.state == "missing").count(),
            1
        );
        assert!(
            f.warnings[0].contains("backend_missing"),
            "{:?}",
            f.warnings
        );
    }

    /// ClientIP affinity of an external-origin frontend: the tc pins keyed by client
    /// address, which one `--from` uses (it wins over the Maglev pick), and the rules
    /// that make a pin unused (expired, backend gone).
    #[test]
    fn external_frontend_explains_tc_affinity_pins() {
        use crate::dataplane::{
            external::tests::{lb, tc_content},
            plan::tests::desired,
        };
        let yaml = lb("Cluster", &["10.0.0.1", "10.0.0.2"], &[], "").replace(
            "  type: LoadBalancer\n",
            "  type: LoadBalancer\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n",
        );
        let mut p = Planner::new();
        p.sync(&yaml);
        let ext = tc_content(&desired(&yaml), &p.current);
        let (key, value) = p
            .current
            .services
            .iter()
            .find(|(k, v)| {
                k.scope != SCOPE_LOCAL_ORIGIN && k.slot == 0 && v.flags & SVC_F_NODEPORT == 0
            })
            .map(|(k, v)| (*k, *v))
            .expect("external LB frontend");
        assert_ne!(
            value.flags & SVC_F_AFFINITY,
            0,
            "affinity flag on the tc frontend"
        );
        let b2 = backend_id(&p.current, "10.0.0.2");
        let pin = |client: &str, age_s: u64, backend_id: u32| {
            (
                ClientAffinityKey {
                    client: addr_of(&client.parse().unwrap()),
                    svc_id: value.svc_id,
                },
                AffinityValue {
                    last_used_ns: 1000 * S - age_s * S,
                    backend_id,
                    _pad: 0,
                },
            )
        };
        let pins = [
            pin("203.0.113.7", 5, b2),
            pin("203.0.113.8", 61, b2),
            pin("203.0.113.9", 1, 999),
        ];
        let conns = BTreeMap::new();
        let live = Live {
            content: &p.current,
            affinity: &[],
            tc_affinity: &pins,
            connections: &conns,
            now_ns: 1000 * S,
            external: &ext,
            flow_ports: None,
        };
        let q = Query {
            addr: ip_of(&key.addr),
            port: u16::from_be(key.port),
            proto: PROTO_TCP,
        };
        let ask = |from: &str| {
            let client = Client {
                from: Some(from.parse().unwrap()),
                from_port: Some(40000),
                ..Default::default()
            };
            explain(&live, &q, &client)
        };
        let e = ask("203.0.113.7");
        let f = e
            .frontends
            .iter()
            .find(|f| f.scope == "external-origin")
            .unwrap();
        let a = &f.affinity;
        assert_eq!((a.mode, a.timeout_s), ("ClientIP", Some(60)));
        let states: Vec<(Option<&str>, bool)> = a
            .entries
            .iter()
            .map(|e| (e.client_address.as_deref(), e.used))
            .collect();
        assert_eq!(
            states,
            [
                (Some("203.0.113.9"), false),
                (Some("203.0.113.7"), true),
                (Some("203.0.113.8"), false),
            ]
        );
        assert!(a.entries[2].why_not.as_deref().unwrap().contains("expired"));
        assert!(
            a.entries[0]
                .why_not
                .as_deref()
                .unwrap()
                .contains("no longer")
        );
        let tc = f.tc.as_ref().unwrap();
        assert_eq!(tc.affinity_pin.as_deref(), Some("10.0.0.2:8080"));
        assert!(f.why.contains("pinned to 10.0.0.2:8080"), "{}", f.why);
        assert!(text(&e).contains("client 203.0.113.7"), "{}", text(&e));
        // An expired pin: the Maglev pick decides, and the note says why.
        let e = ask("203.0.113.8");
        let f = e
            .frontends
            .iter()
            .find(|f| f.scope == "external-origin")
            .unwrap();
        assert_eq!(f.tc.as_ref().unwrap().affinity_pin, None);
        assert!(f.why.contains("this flow goes to"), "{}", f.why);
        assert!(f.affinity.client.as_deref().unwrap().contains("not used"));
        // The socket hooks' entries are not shown for the tc frontend and vice versa.
        let local = e
            .frontends
            .iter()
            .find(|f| f.scope == "local-origin")
            .unwrap();
        assert!(local.affinity.entries.is_empty());
    }

    /// An external-origin LoadBalancer frontend: the source-range verdict for `--from`,
    /// source NAT by policy, and the Maglev pick for `--from-port` (the same as
    /// `flow_hash` over the table, as the tc program computes it).
    #[test]
    fn external_frontend_explains_the_tc_path() {
        use crate::dataplane::{
            external::tests::{lb, tc_content},
            plan::tests::desired,
        };
        let yaml = lb("Cluster", &["10.0.0.1", "10.0.0.2"], &[], "203.0.113.0/24");
        let mut p = Planner::new();
        p.sync(&yaml);
        let ext = tc_content(&desired(&yaml), &p.current);
        let conns = BTreeMap::new();
        // The filter as the agent writes it: the external frontends' ports.
        let mut ports = FlowPorts::default();
        for k in p.current.services.keys() {
            if k.slot == 0 && k.scope != SCOPE_LOCAL_ORIGIN {
                ports.insert(k.port);
            }
        }
        let mut live = Live {
            content: &p.current,
            affinity: &[],
            tc_affinity: &[],
            connections: &conns,
            now_ns: 0,
            external: &ext,
            flow_ports: Some(&ports),
        };
        let q: Query = "198.51.100.1:80/tcp".parse().unwrap();
        let ask = |from: &str, port: u16| {
            let client = Client {
                from: Some(from.parse().unwrap()),
                from_port: Some(port),
                ..Default::default()
            };
            explain(&live, &q, &client)
        };
        let e = ask("203.0.113.7", 40000);
        let f = e
            .frontends
            .iter()
            .find(|f| f.scope == "external-origin")
            .unwrap();
        assert_eq!(f.verdict, "translated");
        let tc = f.tc.as_ref().unwrap();
        assert_eq!(tc.source_range, Some("admitted"));
        assert!(tc.source_nat.contains("another node"), "{}", tc.source_nat);
        // The pick is the table entry of the flow's hash.
        let svc = f.service_id;
        let h = flow_hash(
            &addr_of(&"203.0.113.7".parse().unwrap()),
            &addr_of(&"198.51.100.1".parse().unwrap()),
            40000u16.to_be(),
            80u16.to_be(),
            PROTO_TCP,
        );
        let id = ext.maglev[&svc].backend_ids[(h % MAGLEV_TABLE_SIZE as u32) as usize];
        let want = fmt_endpoint(&p.current.backends[&id].addr, 8080);
        let pick = tc.maglev_pick.as_deref().unwrap();
        assert!(pick.starts_with(&want), "{pick} vs {want}");
        assert!(f.why.contains(pick), "{}", f.why);
        // Outside the ranges: dropped; the local-origin frontend is not filtered.
        let e = ask("192.0.2.1", 40000);
        let verdicts: Vec<(&str, &str)> =
            e.frontends.iter().map(|f| (f.scope, f.verdict)).collect();
        assert_eq!(
            verdicts,
            [
                ("local-origin", "translated"),
                ("external-origin", "dropped")
            ]
        );
        assert!(
            text(&e).contains("source ranges: 203.0.113.0/24: client dropped"),
            "{}",
            text(&e)
        );
        assert_eq!(f.tc.as_ref().unwrap().port_in_filter, Some(true));

        // A filter without the port (a bug): the external frontend is shown untranslated.
        let empty = FlowPorts::default();
        live.flow_ports = Some(&empty);
        let client = Client {
            from: Some("203.0.113.7".parse().unwrap()),
            from_port: Some(40000),
            ..Default::default()
        };
        let e = explain(&live, &q, &client);
        let verdicts: Vec<(&str, &str)> =
            e.frontends.iter().map(|f| (f.scope, f.verdict)).collect();
        assert_eq!(
            verdicts,
            [
                ("local-origin", "translated"),
                ("external-origin", "untranslated")
            ]
        );
        assert!(text(&e).contains("FERRY_FLOW_PORTS"), "{}", text(&e));
    }
}
