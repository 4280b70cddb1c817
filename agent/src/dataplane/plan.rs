//! Pure planning: desired state -> map content -> ordered writes.
//!
//! Write order keeps the kernel consistent at every step (DESIGN.md §1): backends, then
//! membership, then backend slots, then the frontend's slot 0 (which publishes the new
//! count) and only then the removal of slots, members and backends nobody uses.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ferry_common::{
    Addr, addr_from_v4_be, addr_is_v4,
    lb::{
        BACKEND_F_LOCAL, BACKEND_F_TERMINATING, Backend, MAX_BACKENDS_PER_SERVICE, MemberKey,
        PROTO_TCP, PROTO_UDP, SCOPE_EXTERNAL_ORIGIN, SCOPE_LOCAL_ORIGIN, SVC_F_AFFINITY,
        SVC_F_DROP, SVC_F_EXTERNAL, SVC_F_LOCAL_POLICY, SVC_F_NODEPORT, SVC_F_REJECT,
        SVC_F_TERMINATING_FALLBACK, ServiceKey, ServiceValue,
    },
};

use crate::model::{
    DesiredState, EmptyAction, FrontendKind, FrontendState, Protocol, Scope, ServicePortId,
    ServicePortState,
};

/// Map capacities (entries). The agent takes them from flags and sizes the maps with them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// Service map entries: one per frontend plus one per backend slot.
    pub services: u32,
    /// Distinct backends (address, port, protocol).
    pub backends: u32,
}

impl Default for Capacity {
    fn default() -> Self {
        Capacity { services: 65536, backends: 65536 }
    }
}

/// A ServicePort that could not be programmed. The others are unaffected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "{service}: does not fit the {map} map ({needed} more entries, {free} free of {capacity}); \
         it is not programmed, every other service is; raise --{flag}"
    )]
    MapFull {
        service: ServicePortId,
        map: &'static str,
        flag: &'static str,
        needed: u32,
        free: u32,
        capacity: u32,
    },
    #[error("{service}: {count} endpoints is more than ferry serves per frontend ({max}); not programmed")]
    TooManyEndpoints { service: ServicePortId, count: usize, max: u16 },
}

/// What the maps hold (or must hold), as plain ordered collections.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapContent {
    pub services: BTreeMap<ServiceKey, ServiceValue>,
    pub backends: BTreeMap<u32, Backend>,
    pub members: BTreeSet<MemberKey>,
}

/// Identity of a backend entry.
type BackendTuple = (Addr, u16, u8);

/// Stable ids for backends and ServicePorts, kept across syncs and adopted from the
/// pinned maps on restart, so unchanged services are never rewritten.
#[derive(Clone, Debug, Default)]
pub struct Ids {
    backends: HashMap<BackendTuple, u32>,
    services: HashMap<ServicePortId, u32>,
    next_backend: u32,
    next_service: u32,
}

impl Ids {
    /// Learns the ids already in the kernel: backends by tuple; service ids are claimed
    /// per frontend key while planning.
    pub fn adopt(current: &MapContent) -> Ids {
        let mut ids = Ids { next_backend: 1, next_service: 1, ..Default::default() };
        for (id, b) in &current.backends {
            ids.backends.insert((b.addr, b.port, b.proto), *id);
            ids.next_backend = ids.next_backend.max(id + 1);
        }
        for v in current.services.values() {
            ids.next_service = ids.next_service.max(v.svc_id + 1);
        }
        ids
    }

    fn backend(&mut self, t: BackendTuple) -> u32 {
        if let Some(id) = self.backends.get(&t) {
            return *id;
        }
        let id = self.next_backend.max(1);
        self.next_backend = id + 1;
        self.backends.insert(t, id);
        id
    }

    fn service(&mut self, sp: &ServicePortState, current: &MapContent, taken: &BTreeSet<u32>) -> u32 {
        if let Some(id) = self.services.get(&sp.id) {
            return *id;
        }
        // Adopt the id a previous agent gave this ServicePort's frontend.
        let adopted = sp
            .frontends
            .iter()
            .filter_map(|f| current.services.get(&slot0_key(f, sp.id.protocol)))
            .map(|v| v.svc_id)
            .find(|id| !taken.contains(id));
        let id = adopted.unwrap_or_else(|| {
            let id = self.next_service.max(1);
            self.next_service = id + 1;
            id
        });
        self.services.insert(sp.id.clone(), id);
        id
    }

    /// Forgets ids that the desired content no longer uses.
    fn retain(&mut self, content: &MapContent, live: &BTreeSet<ServicePortId>) {
        let used: BTreeSet<u32> = content.backends.keys().copied().collect();
        self.backends.retain(|_, id| used.contains(id));
        self.services.retain(|k, _| live.contains(k));
    }
}

pub fn addr_of(ip: &IpAddr) -> Addr {
    match ip {
        IpAddr::V4(v4) => addr_from_v4_be(u32::from_ne_bytes(v4.octets())),
        IpAddr::V6(v6) => {
            let o = v6.octets();
            let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            [w(0), w(4), w(8), w(12)]
        }
    }
}

pub fn ip_of(addr: &Addr) -> IpAddr {
    if addr_is_v4(addr) {
        IpAddr::V4(Ipv4Addr::from(addr[3].to_ne_bytes()))
    } else {
        let mut o = [0u8; 16];
        for (i, w) in addr.iter().enumerate() {
            o[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
        }
        IpAddr::V6(Ipv6Addr::from(o))
    }
}

pub fn proto_number(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => PROTO_TCP,
        Protocol::Udp => PROTO_UDP,
    }
}

pub fn proto_name(p: u8) -> &'static str {
    match p {
        PROTO_TCP => "TCP",
        PROTO_UDP => "UDP",
        _ => "?",
    }
}

fn slot0_key(f: &FrontendState, proto: Protocol) -> ServiceKey {
    ServiceKey {
        addr: addr_of(&f.addr),
        port: f.port.to_be(),
        slot: 0,
        proto: proto_number(proto),
        scope: match f.scope {
            Scope::LocalOrigin => SCOPE_LOCAL_ORIGIN,
            Scope::ExternalOrigin => SCOPE_EXTERNAL_ORIGIN,
        },
        _pad: [0; 2],
    }
}

fn frontend_flags(sp: &ServicePortState, f: &FrontendState) -> u16 {
    let mut flags = 0;
    if sp.affinity_timeout_s.is_some() {
        flags |= SVC_F_AFFINITY;
    }
    if f.set.endpoints.is_empty() {
        flags |= match f.set.empty_action {
            EmptyAction::Reject => SVC_F_REJECT,
            EmptyAction::Drop => SVC_F_DROP,
        };
    }
    if f.set.terminating_fallback {
        flags |= SVC_F_TERMINATING_FALLBACK;
    }
    if f.set.local_policy {
        flags |= SVC_F_LOCAL_POLICY;
    }
    match f.kind {
        FrontendKind::NodePort => flags |= SVC_F_NODEPORT,
        FrontendKind::ExternalIp | FrontendKind::LoadBalancer => flags |= SVC_F_EXTERNAL,
        FrontendKind::ClusterIp => {}
    }
    flags
}

/// Entries one ServicePort adds: (service map entries, new backend tuples).
fn footprint(sp: &ServicePortState) -> (u32, BTreeSet<BackendTuple>) {
    let proto = proto_number(sp.id.protocol);
    let mut entries = 0u32;
    let mut backends = BTreeSet::new();
    for f in &sp.frontends {
        entries += 1 + f.set.endpoints.len() as u32;
        for e in &f.set.endpoints {
            backends.insert((addr_of(&e.addr), e.port.to_be(), proto));
        }
    }
    (entries, backends)
}

/// Computes the map content for `desired`. ServicePorts already programmed are placed
/// first, so a new Service that does not fit can never push out a live one.
pub fn desired_content(
    desired: &DesiredState,
    ids: &mut Ids,
    current: &MapContent,
    cap: Capacity,
) -> (MapContent, Vec<PlanError>) {
    let mut out = MapContent::default();
    let mut errors = Vec::new();
    let (live, new): (Vec<&ServicePortState>, Vec<&ServicePortState>) =
        desired.services.values().partition(|sp| {
            sp.frontends.iter().any(|f| current.services.contains_key(&slot0_key(f, sp.id.protocol)))
        });
    let mut taken = BTreeSet::new();
    let mut placed = BTreeSet::new();
    let mut backend_tuples: BTreeSet<BackendTuple> = BTreeSet::new();
    for sp in live.into_iter().chain(new) {
        if let Some(f) = sp.frontends.iter().find(|f| f.set.endpoints.len() > MAX_BACKENDS_PER_SERVICE as usize) {
            errors.push(PlanError::TooManyEndpoints {
                service: sp.id.clone(),
                count: f.set.endpoints.len(),
                max: MAX_BACKENDS_PER_SERVICE,
            });
            continue;
        }
        let (entries, tuples) = footprint(sp);
        let used = out.services.len() as u32;
        if used + entries > cap.services {
            errors.push(PlanError::MapFull {
                service: sp.id.clone(),
                map: ferry_common::lb::SERVICES_MAP,
                flag: "max-services",
                needed: entries,
                free: cap.services.saturating_sub(used),
                capacity: cap.services,
            });
            continue;
        }
        let fresh = tuples.difference(&backend_tuples).count() as u32;
        let used_b = backend_tuples.len() as u32;
        if used_b + fresh > cap.backends {
            errors.push(PlanError::MapFull {
                service: sp.id.clone(),
                map: ferry_common::lb::BACKENDS_MAP,
                flag: "max-backends",
                needed: fresh,
                free: cap.backends.saturating_sub(used_b),
                capacity: cap.backends,
            });
            continue;
        }
        backend_tuples.extend(tuples);
        let svc_id = ids.service(sp, current, &taken);
        taken.insert(svc_id);
        placed.insert(sp.id.clone());
        place(sp, svc_id, ids, &mut out);
    }
    ids.retain(&out, &placed);
    (out, errors)
}

fn place(sp: &ServicePortState, svc_id: u32, ids: &mut Ids, out: &mut MapContent) {
    let proto = proto_number(sp.id.protocol);
    for f in &sp.frontends {
        let key0 = slot0_key(f, sp.id.protocol);
        for (i, e) in f.set.endpoints.iter().enumerate() {
            let tuple = (addr_of(&e.addr), e.port.to_be(), proto);
            let id = ids.backend(tuple);
            let mut flags = 0;
            if e.terminating {
                flags |= BACKEND_F_TERMINATING;
            }
            if e.local {
                flags |= BACKEND_F_LOCAL;
            }
            out.backends.insert(id, Backend { addr: tuple.0, port: tuple.1, proto, flags, _pad: 0 });
            out.members.insert(MemberKey { svc_id, backend_id: id });
            let key = ServiceKey { slot: i as u16 + 1, ..key0 };
            out.services.insert(key, ServiceValue { backend_id: id, ..Default::default() });
        }
        out.services.insert(
            key0,
            ServiceValue {
                backend_id: 0,
                count: f.set.endpoints.len() as u16,
                flags: frontend_flags(sp, f),
                affinity_timeout_s: sp.affinity_timeout_s.unwrap_or(0),
                svc_id,
            },
        );
    }
}

/// The writes for one frontend, applied as a unit: its slots first, slot 0 last.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FrontendWrites {
    pub slot0: ServiceKey,
    /// Slots `1..` to insert or overwrite, then slot 0's new value (if it changed).
    pub slot_upserts: Vec<(ServiceKey, ServiceValue)>,
    pub slot0_value: Option<ServiceValue>,
    /// Slots beyond the new count, removed after slot 0 shrank.
    pub slot_deletes: Vec<ServiceKey>,
}

/// Ordered writes that take the kernel from `current` to `desired`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub backend_upserts: Vec<(u32, Backend)>,
    pub member_upserts: Vec<MemberKey>,
    pub frontends: Vec<FrontendWrites>,
    /// Whole frontends to remove: slot 0 first, then its slots.
    pub frontend_deletes: Vec<ServiceKey>,
    pub member_deletes: Vec<MemberKey>,
    pub backend_deletes: Vec<u32>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self == &Plan::default()
    }

    /// Number of map writes and deletes.
    pub fn len(&self) -> usize {
        self.backend_upserts.len()
            + self.member_upserts.len()
            + self
                .frontends
                .iter()
                .map(|f| f.slot_upserts.len() + f.slot0_value.is_some() as usize + f.slot_deletes.len())
                .sum::<usize>()
            + self.frontend_deletes.len()
            + self.member_deletes.len()
            + self.backend_deletes.len()
    }
}

fn frontend_of(k: &ServiceKey) -> ServiceKey {
    ServiceKey { slot: 0, ..*k }
}

fn writes_for<'a>(m: &'a mut BTreeMap<ServiceKey, FrontendWrites>, k: &ServiceKey) -> &'a mut FrontendWrites {
    let f = frontend_of(k);
    m.entry(f).or_insert_with(|| FrontendWrites { slot0: f, ..Default::default() })
}

pub fn diff(current: &MapContent, desired: &MapContent) -> Plan {
    let mut plan = Plan::default();
    for (id, b) in &desired.backends {
        if current.backends.get(id) != Some(b) {
            plan.backend_upserts.push((*id, *b));
        }
    }
    plan.member_upserts = desired.members.difference(&current.members).copied().collect();

    let mut per_frontend: BTreeMap<ServiceKey, FrontendWrites> = BTreeMap::new();
    for (k, v) in &desired.services {
        if current.services.get(k) == Some(v) {
            continue;
        }
        let w = writes_for(&mut per_frontend, k);
        if k.slot == 0 {
            w.slot0_value = Some(*v);
        } else {
            w.slot_upserts.push((*k, *v));
        }
    }
    let desired_frontends: BTreeSet<ServiceKey> =
        desired.services.keys().filter(|k| k.slot == 0).copied().collect();
    for k in current.services.keys() {
        if desired.services.contains_key(k) {
            continue;
        }
        if desired_frontends.contains(&frontend_of(k)) {
            writes_for(&mut per_frontend, k).slot_deletes.push(*k);
        } else {
            plan.frontend_deletes.push(*k);
        }
    }
    plan.frontends = per_frontend.into_values().collect();
    // Slot 0 (sorted first) must go before its slots when a frontend is removed.
    plan.frontend_deletes.sort();
    plan.member_deletes = current.members.difference(&desired.members).copied().collect();
    plan.backend_deletes =
        current.backends.keys().filter(|id| !desired.backends.contains_key(id)).copied().collect();
    plan
}

/// One line per map entry, for tests and `ferry list -o raw`.
pub fn render_content(c: &MapContent) -> String {
    let mut s = String::new();
    for (k, v) in &c.services {
        let scope = if k.scope == SCOPE_LOCAL_ORIGIN { "local" } else { "external" };
        let fe = fmt_endpoint(&k.addr, u16::from_be(k.port));
        if k.slot == 0 {
            let _ = writeln!(
                s,
                "svc {fe}/{} {scope} slot=0 id={} count={} flags={}{}",
                proto_name(k.proto),
                v.svc_id,
                v.count,
                flag_names(v.flags),
                if v.flags & SVC_F_AFFINITY != 0 { format!(" timeout={}s", v.affinity_timeout_s) } else { String::new() },
            );
        } else {
            let _ = writeln!(s, "svc {fe}/{} {scope} slot={} backend={}", proto_name(k.proto), k.slot, v.backend_id);
        }
    }
    for (id, b) in &c.backends {
        let _ = writeln!(
            s,
            "backend {id} {}/{}{}{}",
            fmt_endpoint(&b.addr, u16::from_be(b.port)),
            proto_name(b.proto),
            if b.flags & BACKEND_F_LOCAL != 0 { " local" } else { "" },
            if b.flags & BACKEND_F_TERMINATING != 0 { " terminating" } else { "" },
        );
    }
    for m in &c.members {
        let _ = writeln!(s, "member svc={} backend={}", m.svc_id, m.backend_id);
    }
    s
}

pub fn fmt_endpoint(addr: &Addr, port: u16) -> String {
    match ip_of(addr) {
        IpAddr::V4(v4) => format!("{v4}:{port}"),
        IpAddr::V6(v6) => format!("[{v6}]:{port}"),
    }
}

pub fn flag_names(flags: u16) -> String {
    const NAMES: [(u16, &str); 7] = [
        (SVC_F_AFFINITY, "affinity"),
        (SVC_F_REJECT, "reject"),
        (SVC_F_DROP, "drop"),
        (SVC_F_TERMINATING_FALLBACK, "terminating-fallback"),
        (SVC_F_LOCAL_POLICY, "local-policy"),
        (SVC_F_NODEPORT, "nodeport"),
        (SVC_F_EXTERNAL, "external"),
    ];
    let names: Vec<&str> = NAMES.iter().filter(|(f, _)| flags & f != 0).map(|(_, n)| *n).collect();
    if names.is_empty() { "-".into() } else { names.join(",") }
}
