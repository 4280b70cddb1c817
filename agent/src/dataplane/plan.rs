//! Pure planning: desired state -> map content -> ordered writes.
//!
//! Write order keeps the kernel consistent at every step (DESIGN.md §1): whole frontends
//! that go away first (their entries are the room a full map has for new ones), then
//! backends, membership, backend slots, then the frontend's slot 0 (which publishes the
//! new count) and only then the removal of slots, members and backends nobody uses.

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
        SVC_F_SOURCE_RANGES, SVC_F_TERMINATING_FALLBACK, ServiceKey, ServiceValue,
    },
};

use super::external::ExternalPlan;
use crate::btree::Chunked;
use crate::model::{
    EmptyAction, FrontendKind, FrontendState, Protocol, Scope, ServicePortId, ServicePortState,
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
        Capacity {
            services: 65536,
            backends: 65536,
        }
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
    #[error(
        "{service}: {count} endpoints is more than ferry serves per frontend ({max}); not programmed"
    )]
    TooManyEndpoints {
        service: ServicePortId,
        count: usize,
        max: u16,
    },
}

/// The map a [`PlanError::MapFull`] is about.
#[derive(Clone, Copy, Debug)]
pub(crate) enum MapKind {
    Services,
    Backends,
}

impl PlanError {
    /// `MapFull` when `needed` more entries do not fit beside the `used` ones.
    pub(crate) fn check_room(
        service: &ServicePortId,
        kind: MapKind,
        needed: u32,
        used: u32,
        cap: Capacity,
    ) -> Result<(), PlanError> {
        let (map, flag, capacity) = match kind {
            MapKind::Services => (ferry_common::lb::SERVICES_MAP, "max-services", cap.services),
            MapKind::Backends => (ferry_common::lb::BACKENDS_MAP, "max-backends", cap.backends),
        };
        if used.saturating_add(needed) <= capacity {
            return Ok(());
        }
        Err(PlanError::MapFull {
            service: service.clone(),
            map,
            flag,
            needed,
            free: capacity.saturating_sub(used),
            capacity,
        })
    }

    /// The ServicePort that was not (fully) programmed.
    pub fn service(&self) -> &ServicePortId {
        match self {
            PlanError::MapFull { service, .. } | PlanError::TooManyEndpoints { service, .. } => {
                service
            }
        }
    }
}

/// How many ServicePorts a summary line names before "and N more".
const SUMMARY_NAMES: usize = 5;

/// The ServicePorts that were not programmed, one line per cause (map and flag, or too
/// many endpoints) with the count and the first few names in order: a cluster far over
/// a bound gets a handful of lines, not one per Service.
pub fn summarize(errors: &[&PlanError]) -> Vec<String> {
    let mut groups: BTreeMap<(u8, &'static str, &'static str), Vec<&PlanError>> = BTreeMap::new();
    for e in errors {
        let key = match e {
            PlanError::MapFull { map, flag, .. } => (0, *map, *flag),
            PlanError::TooManyEndpoints { .. } => (1, "", ""),
        };
        groups.entry(key).or_default().push(e);
    }
    let mut out = Vec::new();
    for ((_, map, flag), mut group) in groups {
        group.sort_by(|a, b| a.service().cmp(b.service()));
        let n = group.len();
        let mut names: Vec<String> = group
            .iter()
            .take(SUMMARY_NAMES)
            .map(|e| match e {
                PlanError::MapFull { service, .. } => service.to_string(),
                PlanError::TooManyEndpoints { service, count, .. } => {
                    format!("{service} ({count} endpoints)")
                }
            })
            .collect();
        if n > SUMMARY_NAMES {
            names.push(format!("and {} more", n - SUMMARY_NAMES));
        }
        let (s, verb) = if n == 1 { ("", "does") } else { ("s", "do") };
        let line = match group[0] {
            PlanError::MapFull { capacity, .. } => {
                let free = group
                    .iter()
                    .filter_map(|e| match e {
                        PlanError::MapFull { free, .. } => Some(*free),
                        PlanError::TooManyEndpoints { .. } => None,
                    })
                    .min()
                    .unwrap_or(0);
                let needed: u64 = group
                    .iter()
                    .map(|e| match e {
                        PlanError::MapFull { needed, .. } => u64::from(*needed),
                        PlanError::TooManyEndpoints { .. } => 0,
                    })
                    .sum();
                format!(
                    "{n} ServicePort{s} {verb} not fit the {map} map ({needed} more entries needed, {free} free of {capacity}): {}; not programmed, every other ServicePort is; raise --{flag}",
                    names.join(", ")
                )
            }
            PlanError::TooManyEndpoints { max, .. } => format!(
                "{n} ServicePort{s} {} more endpoints than ferry serves per frontend ({max}): {}; not programmed",
                if n == 1 { "has" } else { "have" },
                names.join(", ")
            ),
        };
        out.push(line);
    }
    out
}

/// What the maps hold (or must hold), as plain ordered collections.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapContent {
    pub services: BTreeMap<ServiceKey, ServiceValue>,
    pub backends: BTreeMap<u32, Backend>,
    pub members: BTreeSet<MemberKey>,
}

/// Identity of a backend entry.
pub(crate) type BackendTuple = (Addr, u16, u8);

/// What one ServicePort placed in the maps, so an incremental update can remove or
/// replace exactly its entries. Only its frontends' slot-0 keys are kept: its slots are
/// `1..=count` of each (the count is in slot 0's value), and the backends it references
/// are those slots' backend ids, both read back from the content when needed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Owned {
    pub svc_id: u32,
    pub frontends: Box<[ServiceKey]>,
}

impl Owned {
    /// Every service-map key it owns in `content`: each frontend's slot 0, then its slots.
    pub fn keys<'a>(&'a self, content: &'a MapContent) -> impl Iterator<Item = ServiceKey> + 'a {
        self.frontends.iter().flat_map(|k0| {
            let count = content.services.get(k0).map_or(0, |v| v.count);
            (0..=count).map(move |slot| ServiceKey { slot, ..*k0 })
        })
    }

    /// The backend ids its slots reference in `content`, sorted, each once.
    pub fn backends(&self, content: &MapContent) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .keys(content)
            .filter(|k| k.slot != 0)
            .filter_map(|k| content.services.get(&k).map(|v| v.backend_id))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// Stable ids for backends and ServicePorts, kept across syncs and adopted from the
/// pinned maps on restart, so unchanged services are never rewritten.
#[derive(Clone, Debug, Default)]
pub struct Ids {
    /// A BTreeMap, compacted after a full plan: at 120,000 backends (30000x4) a hash table
    /// has just doubled to 262,144 buckets (6.5 MiB); full nodes take 3 MiB.
    pub(crate) backends: BackendIds,
    /// The ids of the last plan's ServicePorts, for [`desired_content`] (planning in full
    /// again, in tests). The agent plans in full only from an adopted `Ids`, where the
    /// frontends in the kernel give the ids and `Programmed` keeps them afterwards: it
    /// never fills this table (30,000 ids in 65,536 buckets were 4.3 MiB at the peak).
    pub(crate) services: HashMap<ServicePortId, u32>,
    next_backend: u32,
    next_service: u32,
    /// Service ids free for reuse (their counters were zeroed when they were released),
    /// so ids stay below the service capacity under churn (the per-Service counters are
    /// an array indexed by id).
    free_services: BTreeSet<u32>,
    /// Ids released by the plan being built: free only from the next one, after that
    /// plan's apply zeroed their counters (`Plan::released_services`).
    released_services: Vec<u32>,
}

impl Ids {
    /// Learns the ids already in the kernel: backends by tuple; service ids are claimed
    /// per frontend key while planning.
    pub fn adopt(current: &MapContent) -> Ids {
        let mut ids = Ids {
            next_backend: 1,
            next_service: 1,
            ..Default::default()
        };
        for (id, b) in &current.backends {
            ids.backends.insert((b.addr, b.port, b.proto), *id);
            ids.next_backend = ids.next_backend.max(id + 1);
        }
        // Only slot 0 carries the id (slots 1.. hold 0 there).
        let used: BTreeSet<u32> = current
            .services
            .iter()
            .filter(|(k, _)| k.slot == 0)
            .map(|(_, v)| v.svc_id)
            .collect();
        ids.next_service = used.last().map_or(1, |hi| hi + 1);
        // Gaps below the highest id are free: no frontend in the kernel uses them.
        ids.free_services = (1..ids.next_service)
            .filter(|id| !used.contains(id))
            .collect();
        ids
    }

    /// A service id no ServicePort holds: the lowest free one, else a new one.
    pub(crate) fn fresh_service(&mut self) -> u32 {
        self.free_services.pop_first().unwrap_or_else(|| {
            let id = self.next_service.max(1);
            self.next_service = id + 1;
            id
        })
    }

    /// Marks `id` unused from the next plan on (this one still deletes its frontends).
    pub(crate) fn release_service(&mut self, id: u32) {
        self.released_services.push(id);
    }

    /// Ids released while building this plan, for it to zero their counters; they are
    /// free for the plans after it.
    pub(crate) fn take_released(&mut self) -> Vec<u32> {
        let out = std::mem::take(&mut self.released_services);
        self.free_services.extend(out.iter().copied());
        out
    }

    pub(crate) fn backend(&mut self, t: BackendTuple) -> u32 {
        if let Some(id) = self.backends.get(&t) {
            return *id;
        }
        let id = self.next_backend.max(1);
        self.next_backend = id + 1;
        self.backends.insert(t, id);
        id
    }

    fn service(
        &mut self,
        sp: &ServicePortState,
        current: &MapContent,
        taken: &BTreeSet<u32>,
    ) -> u32 {
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
        match adopted {
            Some(id) => id,
            None => self.fresh_service(),
        }
    }

    /// Forgets backend ids that the desired content no longer uses.
    fn retain(&mut self, content: &MapContent) {
        self.backends.retain(|id| content.backends.contains_key(id));
    }
}

/// Backend ids by tuple. An IPv4 tuple (nearly every one) is packed into one word, so
/// its entry in the tree is 12 bytes instead of 24 (4.8 MiB less at 400,000 backends).
#[derive(Clone, Debug, Default)]
pub(crate) struct BackendIds {
    v4: BTreeMap<u64, u32>,
    other: BTreeMap<BackendTuple, u32>,
}

impl BackendIds {
    /// Address (32 bits), port (16) and protocol (8) of an IPv4 tuple.
    fn packed(t: &BackendTuple) -> Option<u64> {
        let (addr, port, proto) = t;
        addr_is_v4(addr)
            .then(|| (u64::from(addr[3]) << 24) | (u64::from(*port) << 8) | u64::from(*proto))
    }

    pub(crate) fn get(&self, t: &BackendTuple) -> Option<&u32> {
        match Self::packed(t) {
            Some(k) => self.v4.get(&k),
            None => self.other.get(t),
        }
    }

    pub(crate) fn contains_key(&self, t: &BackendTuple) -> bool {
        self.get(t).is_some()
    }

    pub(crate) fn insert(&mut self, t: BackendTuple, id: u32) -> Option<u32> {
        match Self::packed(&t) {
            Some(k) => self.v4.insert(k, id),
            None => self.other.insert(t, id),
        }
    }

    pub(crate) fn remove(&mut self, t: &BackendTuple) -> Option<u32> {
        match Self::packed(t) {
            Some(k) => self.v4.remove(&k),
            None => self.other.remove(t),
        }
    }

    /// Keeps the tuples whose id passes `keep`.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&u32) -> bool) {
        self.v4.retain(|_, id| keep(id));
        self.other.retain(|_, id| keep(id));
    }

    /// Full tree nodes ([`crate::btree::compact`]).
    pub(crate) fn compact(&mut self) {
        crate::btree::compact(&mut self.v4);
        crate::btree::compact(&mut self.other);
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

pub(crate) fn slot0_key(f: &FrontendState, proto: Protocol) -> ServiceKey {
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
    // Source ranges filter LoadBalancer IPs reached from outside only (KP-07).
    let restricted = f.scope == Scope::ExternalOrigin && f.kind == FrontendKind::LoadBalancer;
    if restricted && sp.source_ranges.is_some() {
        flags |= SVC_F_SOURCE_RANGES;
    }
    flags
}

/// Entries one ServicePort adds: (service map entries, new backend tuples).
pub(crate) fn footprint(sp: &ServicePortState) -> (u32, BTreeSet<BackendTuple>) {
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
#[cfg(test)]
pub fn desired_content(
    desired: &crate::model::DesiredState,
    ids: &mut Ids,
    current: &MapContent,
    cap: Capacity,
) -> (MapContent, Vec<PlanError>) {
    let states = desired.services.values().cloned();
    let (out, errors, owners, _) = desired_content_owned(states, ids, current, cap);
    ids.services = owners
        .iter()
        .map(|(id, o)| (id.clone(), o.svc_id))
        .collect();
    (out, errors)
}

/// The map content for `desired` (sorted by id), which entries each ServicePort owns,
/// and the states still needed after it: those with an external-origin frontend (the tc
/// planner's input) and those not placed (retried later). The others are dropped as they
/// are placed, so the whole desired state and the whole content never coexist.
pub fn desired_content_owned(
    desired: impl IntoIterator<Item = ServicePortState>,
    ids: &mut Ids,
    current: &MapContent,
    cap: Capacity,
) -> (
    MapContent,
    Vec<PlanError>,
    BTreeMap<ServicePortId, Owned>,
    Vec<ServicePortState>,
) {
    let mut owners = Chunked::default();
    let mut out = Bulk::default();
    let mut errors = Vec::new();
    let mut kept = Vec::new();
    // Ids held by known ServicePorts are never adopted by another one.
    let mut taken: BTreeSet<u32> = ids.services.values().copied().collect();
    let mut place_one = |sp: ServicePortState| {
        let placed = try_place(&sp, ids, current, cap, &mut taken, &mut out, &mut errors);
        let failed = placed.is_none();
        if let Some(owned) = placed {
            owners.push((sp.id.clone(), owned));
        }
        if failed
            || sp
                .frontends
                .iter()
                .any(|f| f.scope == Scope::ExternalOrigin)
        {
            kept.push(sp);
        }
    };
    // Live ServicePorts (a frontend in the kernel) go first; empty maps have none.
    let mut new = Vec::new();
    for sp in desired {
        let live = sp
            .frontends
            .iter()
            .any(|f| current.services.contains_key(&slot0_key(f, sp.id.protocol)));
        if live || current.services.is_empty() {
            place_one(sp);
        } else {
            new.push(sp);
        }
    }
    new.into_iter().for_each(place_one);
    let out = out.build();
    ids.retain(&out);
    ids.backends.compact();
    (out, errors, owners.build(), kept)
}

/// Places one ServicePort into `out` when it fits (else says why in `errors`).
fn try_place(
    sp: &ServicePortState,
    ids: &mut Ids,
    current: &MapContent,
    cap: Capacity,
    taken: &mut BTreeSet<u32>,
    out: &mut Bulk,
    errors: &mut Vec<PlanError>,
) -> Option<Owned> {
    if let Some(f) = sp
        .frontends
        .iter()
        .find(|f| f.set.endpoints.len() > MAX_BACKENDS_PER_SERVICE as usize)
    {
        errors.push(PlanError::TooManyEndpoints {
            service: sp.id.clone(),
            count: f.set.endpoints.len(),
            max: MAX_BACKENDS_PER_SERVICE,
        });
        return None;
    }
    let (entries, tuples) = footprint(sp);
    let used = out.services.len() as u32;
    if let Err(e) = PlanError::check_room(&sp.id, MapKind::Services, entries, used, cap) {
        errors.push(e);
        return None;
    }
    // A tuple is placed already when its id is in `out` (one id per tuple).
    let fresh = tuples
        .iter()
        .filter(|t| ids.backends.get(t).is_none_or(|id| !out.is_placed(*id)))
        .count() as u32;
    let used_b = out.backend_count() as u32;
    if let Err(e) = PlanError::check_room(&sp.id, MapKind::Backends, fresh, used_b, cap) {
        errors.push(e);
        return None;
    }
    let svc_id = ids.service(sp, current, taken);
    taken.insert(svc_id);
    Some(place(sp, svc_id, ids, out))
}

/// Where [`place`] writes entries.
pub(crate) trait Sink {
    fn service(&mut self, k: ServiceKey, v: ServiceValue);
    fn backend(&mut self, id: u32, b: Backend);
    fn member(&mut self, m: MemberKey);
}

impl Sink for MapContent {
    fn service(&mut self, k: ServiceKey, v: ServiceValue) {
        self.services.insert(k, v);
    }
    fn backend(&mut self, id: u32, b: Backend) {
        self.backends.insert(id, b);
    }
    fn member(&mut self, m: MemberKey) {
        self.members.insert(m);
    }
}

/// The full plan's content, built in sorted chunks: a BTreeMap filled entry by entry
/// (in key order, as ids are handed out, or at random) keeps its nodes about half full;
/// one built from sorted entries, or merged from two with `append`, has full ones. Each
/// chunk is sorted into a small map and merged into the whole (which frees the old nodes
/// as it goes), so no list ever holds the whole content: at 10000x10 the three maps take
/// ~8.5 MiB instead of ~15.5, and building them adds about a chunk.
#[derive(Default)]
struct Bulk {
    services: Chunked<BTreeMap<ServiceKey, ServiceValue>>,
    backends: Chunked<BTreeMap<u32, Backend>>,
    members: Chunked<BTreeSet<MemberKey>>,
    /// Backend ids in the current chunk of `backends` (a backend shared by ServicePorts
    /// is written once by each).
    chunk_backends: std::collections::HashSet<u32>,
}

impl Sink for Bulk {
    fn service(&mut self, k: ServiceKey, v: ServiceValue) {
        self.services.push((k, v));
    }
    fn backend(&mut self, id: u32, b: Backend) {
        if !self.backends.done.contains_key(&id) {
            self.chunk_backends.insert(id);
        }
        if self.backends.push((id, b)) {
            self.chunk_backends = Default::default();
        }
    }
    fn member(&mut self, m: MemberKey) {
        self.members.push(m);
    }
}

impl Bulk {
    fn is_placed(&self, id: u32) -> bool {
        self.backends.done.contains_key(&id) || self.chunk_backends.contains(&id)
    }

    /// Distinct backends placed so far.
    fn backend_count(&self) -> usize {
        self.backends.done.len() + self.chunk_backends.len()
    }

    fn build(self) -> MapContent {
        MapContent {
            services: self.services.build(),
            backends: self.backends.build(),
            members: self.members.build(),
        }
    }
}

/// Writes one ServicePort's entries into `out` and returns what it owns.
pub(crate) fn place(
    sp: &ServicePortState,
    svc_id: u32,
    ids: &mut Ids,
    out: &mut impl Sink,
) -> Owned {
    let mut frontends = Vec::with_capacity(sp.frontends.len());
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
            let backend = Backend {
                addr: tuple.0,
                port: tuple.1,
                proto,
                flags,
                _pad: 0,
            };
            out.backend(id, backend);
            out.member(MemberKey {
                svc_id,
                backend_id: id,
            });
            let key = ServiceKey {
                slot: i as u16 + 1,
                ..key0
            };
            out.service(key, ServiceValue::backend_slot(id, &backend));
        }
        frontends.push(key0);
        out.service(
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
    Owned {
        svc_id,
        frontends: frontends.into_boxed_slice(),
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
    /// Whole frontends to remove (applied first): slot 0 first, then its slots.
    pub frontend_deletes: Vec<ServiceKey>,
    pub member_deletes: Vec<MemberKey>,
    pub backend_deletes: Vec<u32>,
    /// The tc path's Maglev tables and source ranges, planned by
    /// [`super::external::External`]: written after the members, before any slot 0;
    /// removed after every slot 0, before the members.
    pub external: ExternalPlan,
    /// Service ids no longer used: their connection counters are zeroed (after the
    /// frontend deletes) so that a ServicePort given the id later starts from 0.
    pub released_services: Vec<u32>,
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
                .map(|f| {
                    f.slot_upserts.len() + f.slot0_value.is_some() as usize + f.slot_deletes.len()
                })
                .sum::<usize>()
            + self.frontend_deletes.len()
            + self.member_deletes.len()
            + self.backend_deletes.len()
            + self.external.len()
    }
}

fn frontend_of(k: &ServiceKey) -> ServiceKey {
    ServiceKey { slot: 0, ..*k }
}

fn writes_for<'a>(
    m: &'a mut BTreeMap<ServiceKey, FrontendWrites>,
    k: &ServiceKey,
) -> &'a mut FrontendWrites {
    let f = frontend_of(k);
    m.entry(f).or_insert_with(|| FrontendWrites {
        slot0: f,
        ..Default::default()
    })
}

pub fn diff(current: &MapContent, desired: &MapContent) -> Plan {
    let mut plan = Plan::default();
    for (id, b) in &desired.backends {
        if current.backends.get(id) != Some(b) {
            plan.backend_upserts.push((*id, *b));
        }
    }
    plan.member_upserts = desired
        .members
        .difference(&current.members)
        .copied()
        .collect();

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
    let desired_frontends: BTreeSet<ServiceKey> = desired
        .services
        .keys()
        .filter(|k| k.slot == 0)
        .copied()
        .collect();
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
    plan.member_deletes = current
        .members
        .difference(&desired.members)
        .copied()
        .collect();
    plan.backend_deletes = current
        .backends
        .keys()
        .filter(|id| !desired.backends.contains_key(id))
        .copied()
        .collect();
    plan
}

/// One line per map entry, for tests and `ferry list -o raw`.
pub fn render_content(c: &MapContent) -> String {
    let mut s = String::new();
    for (k, v) in &c.services {
        let scope = if k.scope == SCOPE_LOCAL_ORIGIN {
            "local"
        } else {
            "external"
        };
        let fe = fmt_endpoint(&k.addr, u16::from_be(k.port));
        if k.slot == 0 {
            let _ = writeln!(
                s,
                "svc {fe}/{} {scope} slot=0 id={} count={} flags={}{}",
                proto_name(k.proto),
                v.svc_id,
                v.count,
                flag_names(v.flags),
                if v.flags & SVC_F_AFFINITY != 0 {
                    format!(" timeout={}s", v.affinity_timeout_s)
                } else {
                    String::new()
                },
            );
        } else {
            let _ = writeln!(
                s,
                "svc {fe}/{} {scope} slot={} backend={}",
                proto_name(k.proto),
                k.slot,
                v.backend_id
            );
        }
    }
    for (id, b) in &c.backends {
        let _ = writeln!(
            s,
            "backend {id} {}/{}{}{}",
            fmt_endpoint(&b.addr, u16::from_be(b.port)),
            proto_name(b.proto),
            if b.flags & BACKEND_F_LOCAL != 0 {
                " local"
            } else {
                ""
            },
            if b.flags & BACKEND_F_TERMINATING != 0 {
                " terminating"
            } else {
                ""
            },
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
    const NAMES: [(u16, &str); 8] = [
        (SVC_F_AFFINITY, "affinity"),
        (SVC_F_REJECT, "reject"),
        (SVC_F_DROP, "drop"),
        (SVC_F_TERMINATING_FALLBACK, "terminating-fallback"),
        (SVC_F_LOCAL_POLICY, "local-policy"),
        (SVC_F_NODEPORT, "nodeport"),
        (SVC_F_EXTERNAL, "external"),
        (SVC_F_SOURCE_RANGES, "source-ranges"),
    ];
    let names: Vec<&str> = NAMES
        .iter()
        .filter(|(f, _)| flags & f != 0)
        .map(|(_, n)| *n)
        .collect();
    if names.is_empty() {
        "-".into()
    } else {
        names.join(",")
    }
}

/// Planner tests: Kubernetes YAML -> model -> map content / plan, compared as text.
#[cfg(test)]
pub(crate) mod tests {
    use std::fmt::Write as _;

    use ferry_common::lb::{BACKENDS_MAP, MAX_BACKENDS_PER_SERVICE, SERVICES_MAP};

    use super::*;
    use crate::model::{self, DesiredState, IpFamily, NodeInfo};

    pub(crate) use crate::model::testutil::dedent;

    /// `node-a`, serving NodePorts on 192.168.1.10.
    fn node() -> NodeInfo {
        NodeInfo {
            name: "node-a".into(),
            addresses: vec!["192.168.1.10".parse().unwrap()],
            zone: None,
            ..Default::default()
        }
    }

    /// Services and EndpointSlices from a multi-document YAML stream -> the model's output.
    /// The fixtures are meant to be valid: any model problem fails the test.
    pub(crate) fn desired(yaml: &str) -> DesiredState {
        let (services, slices) = crate::model::testutil::objects(yaml);
        let state = model::compute(&services, &slices, &node());
        assert!(
            state.problems.is_empty(),
            "fixture has problems: {:?}",
            state.problems
        );
        state
    }

    /// A ClusterIP Service `default/<name>` with port `http` 80 -> 8080 and, when
    /// `endpoints` is not empty, one EndpointSlice with them (all on node-b, ready).
    pub(crate) fn web(name: &str, cluster_ip: &str, endpoints: &[&str]) -> String {
        let mut s = format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\n\
             spec: {{clusterIP: {cluster_ip}, ports: [{{name: http, port: 80}}]}}\n"
        );
        if !endpoints.is_empty() {
            let _ = write!(
                s,
                "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
                 metadata: {{name: {name}-a, namespace: default, labels: {{kubernetes.io/service-name: {name}}}}}\n\
                 addressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints:\n"
            );
            for e in endpoints {
                let _ = writeln!(s, "- {{addresses: [{e}], nodeName: node-b}}");
            }
        }
        s
    }

    /// Joins YAML documents into one stream.
    pub(crate) fn docs(parts: &[String]) -> String {
        parts
            .iter()
            .map(|p| dedent(p))
            .collect::<Vec<_>>()
            .join("---\n")
    }

    /// One agent's planning state, as `agent.rs` keeps it; applying a plan is simulated.
    pub(crate) struct Planner {
        pub(crate) ids: Ids,
        pub(crate) current: MapContent,
        pub(crate) cap: Capacity,
    }

    impl Planner {
        pub(crate) fn new() -> Planner {
            Planner {
                ids: Ids::default(),
                current: MapContent::default(),
                cap: Capacity::default(),
            }
        }

        /// A fresh agent over maps a previous one left pinned.
        pub(crate) fn restart(current: MapContent, cap: Capacity) -> Planner {
            Planner {
                ids: Ids::adopt(&current),
                current,
                cap,
            }
        }

        /// Plans `yaml`, applies the plan write by write (checking the kernel stays
        /// consistent after every write) and checks it reaches the planned content.
        pub(crate) fn sync(&mut self, yaml: &str) -> (Plan, Vec<PlanError>) {
            let state = desired(yaml);
            let (content, errors) = desired_content(&state, &mut self.ids, &self.current, self.cap);
            let plan = diff(&self.current, &content);
            let applied = apply(&self.current, &plan);
            assert!(
                applied == content,
                "applying the plan does not reach the planned content:\n{}",
                render_plan(&plan)
            );
            self.current = content;
            (plan, errors)
        }

        pub(crate) fn text(&self) -> String {
            render_content(&self.current)
        }
    }

    /// What the datapath relies on at every step: slot 0's count slots exist, each
    /// pointing at a backend that exists.
    fn check_consistent(c: &MapContent, after: &str) {
        for (k, v) in c.services.iter().filter(|(k, _)| k.slot == 0) {
            for slot in 1..=v.count {
                let Some(s) = c.services.get(&ServiceKey { slot, ..*k }) else {
                    panic!(
                        "after {after}: {} slot {slot} of count {} is missing",
                        key_text(k),
                        v.count
                    );
                };
                assert!(
                    c.backends.contains_key(&s.backend_id),
                    "after {after}: {} slot {slot} points at absent backend {}",
                    key_text(k),
                    s.backend_id
                );
            }
        }
    }

    /// Applies `plan` to a copy of `current` in the kernel's order (mirrors `KernelMaps::apply`).
    pub(crate) fn apply(current: &MapContent, plan: &Plan) -> MapContent {
        let mut c = current.clone();
        let step = |c: &mut MapContent, what: String, f: &mut dyn FnMut(&mut MapContent)| {
            f(c);
            check_consistent(c, &what);
        };
        for k in &plan.frontend_deletes {
            step(&mut c, format!("delete {}", key_text(k)), &mut |c| {
                c.services.remove(k);
            });
        }
        for (id, b) in &plan.backend_upserts {
            step(&mut c, format!("backend upsert {id}"), &mut |c| {
                c.backends.insert(*id, *b);
            });
        }
        for m in &plan.member_upserts {
            step(&mut c, format!("member upsert {m:?}"), &mut |c| {
                c.members.insert(*m);
            });
        }
        for f in &plan.frontends {
            for (k, v) in &f.slot_upserts {
                step(&mut c, format!("upsert {}", key_text(k)), &mut |c| {
                    c.services.insert(*k, *v);
                });
            }
            if let Some(v) = f.slot0_value {
                step(&mut c, format!("upsert {}", key_text(&f.slot0)), &mut |c| {
                    c.services.insert(f.slot0, v);
                });
            }
            for k in &f.slot_deletes {
                step(&mut c, format!("delete {}", key_text(k)), &mut |c| {
                    c.services.remove(k);
                });
            }
        }
        for m in &plan.member_deletes {
            c.members.remove(m);
        }
        for id in &plan.backend_deletes {
            step(&mut c, format!("backend delete {id}"), &mut |c| {
                c.backends.remove(id);
            });
        }
        c
    }

    fn key_text(k: &ServiceKey) -> String {
        let scope = if k.scope == SCOPE_LOCAL_ORIGIN {
            "local"
        } else {
            "external"
        };
        format!(
            "svc {}/{} {scope} slot={}",
            fmt_endpoint(&k.addr, u16::from_be(k.port)),
            proto_name(k.proto),
            k.slot
        )
    }

    /// One line per write, in the order the kernel applies them: `+` upsert, `-` delete.
    pub(crate) fn render_plan(p: &Plan) -> String {
        let line = |c: MapContent| format!("+ {}", render_content(&c));
        let mut s = String::new();
        for k in &p.frontend_deletes {
            let _ = writeln!(s, "- {}", key_text(k));
        }
        for (id, b) in &p.backend_upserts {
            s += &line(MapContent {
                backends: [(*id, *b)].into(),
                ..Default::default()
            });
        }
        for m in &p.member_upserts {
            s += &line(MapContent {
                members: [*m].into(),
                ..Default::default()
            });
        }
        for f in &p.frontends {
            let writes = f
                .slot_upserts
                .iter()
                .copied()
                .chain(f.slot0_value.map(|v| (f.slot0, v)));
            for (k, v) in writes {
                s += &line(MapContent {
                    services: [(k, v)].into(),
                    ..Default::default()
                });
            }
            for k in &f.slot_deletes {
                let _ = writeln!(s, "- {}", key_text(k));
            }
        }
        for m in &p.member_deletes {
            let _ = writeln!(s, "- member svc={} backend={}", m.svc_id, m.backend_id);
        }
        for id in &p.backend_deletes {
            let _ = writeln!(s, "- backend {id}");
        }
        s
    }

    #[track_caller]
    pub(crate) fn assert_text(what: &str, actual: &str, expected: &str) {
        let expected = dedent(expected);
        assert!(
            actual == expected,
            "{what} differs\n--- expected\n{expected}--- actual\n{actual}"
        );
    }

    fn spid(name: &str) -> ServicePortId {
        ServicePortId::new("default", name, "http", Protocol::Tcp, IpFamily::V4)
    }

    /// Frontend keys, service ids and backend ids one Plan writes or deletes.
    fn touched(p: &Plan) -> (BTreeSet<ServiceKey>, BTreeSet<u32>, BTreeSet<u32>) {
        let mut frontends = BTreeSet::new();
        let mut svc_ids = BTreeSet::new();
        let mut backends: BTreeSet<u32> = p.backend_upserts.iter().map(|(id, _)| *id).collect();
        backends.extend(&p.backend_deletes);
        for m in p.member_upserts.iter().chain(&p.member_deletes) {
            svc_ids.insert(m.svc_id);
            backends.insert(m.backend_id);
        }
        for f in &p.frontends {
            frontends.insert(f.slot0);
            frontends.extend(f.slot_upserts.iter().map(|(k, _)| frontend_of(k)));
            frontends.extend(f.slot_deletes.iter().map(frontend_of));
            svc_ids.extend(f.slot0_value.map(|v| v.svc_id));
        }
        frontends.extend(p.frontend_deletes.iter().map(frontend_of));
        (frontends, svc_ids, backends)
    }

    #[test]
    fn cluster_ip_with_three_endpoints() {
        let mut p = Planner::new();
        let (plan, errors) = p.sync(&web(
            "web",
            "10.96.0.10",
            &["10.0.0.1", "10.0.0.2", "10.0.0.3"],
        ));
        assert_eq!(errors, vec![]);
        assert_eq!(plan.len(), 3 + 3 + 4);
        assert_text(
            "map content",
            &p.text(),
            "
            svc 10.96.0.10:80/TCP local slot=0 id=1 count=3 flags=-
            svc 10.96.0.10:80/TCP local slot=1 backend=1
            svc 10.96.0.10:80/TCP local slot=2 backend=2
            svc 10.96.0.10:80/TCP local slot=3 backend=3
            backend 1 10.0.0.1:8080/TCP
            backend 2 10.0.0.2:8080/TCP
            backend 3 10.0.0.3:8080/TCP
            member svc=1 backend=1
            member svc=1 backend=2
            member svc=1 backend=3
            ",
        );
    }

    /// ClientIP affinity sets the flag and the timeout (the API default when unset);
    /// local and terminating endpoints carry their backend flags.
    #[test]
    fn affinity_and_backend_flags() {
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
            metadata: {name: sticky-default, namespace: default}
            spec: {clusterIP: 10.96.0.12, sessionAffinity: ClientIP, ports: [{name: http, port: 80}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: fallback, namespace: default}
            spec: {clusterIP: 10.96.0.13, ports: [{name: http, port: 80}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: sticky-a, namespace: default, labels: {kubernetes.io/service-name: sticky}}
            addressType: IPv4
            ports: [{name: http, port: 8080}]
            endpoints: [{addresses: [10.0.0.1], nodeName: node-a}]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: fallback-a, namespace: default, labels: {kubernetes.io/service-name: fallback}}
            addressType: IPv4
            ports: [{name: http, port: 8080}]
            endpoints:
            - addresses: [10.0.0.9]
              nodeName: node-b
              conditions: {ready: false, serving: true, terminating: true}
            "#,
        );
        assert_eq!(errors, vec![]);
        assert_text(
            "map content",
            &p.text(),
            "
            svc 10.96.0.11:80/TCP local slot=0 id=2 count=1 flags=affinity timeout=600s
            svc 10.96.0.11:80/TCP local slot=1 backend=2
            svc 10.96.0.12:80/TCP local slot=0 id=3 count=0 flags=affinity,reject timeout=10800s
            svc 10.96.0.13:80/TCP local slot=0 id=1 count=1 flags=terminating-fallback
            svc 10.96.0.13:80/TCP local slot=1 backend=1
            backend 1 10.0.0.9:8080/TCP terminating
            backend 2 10.0.0.1:8080/TCP local
            member svc=1 backend=1
            member svc=2 backend=2
            ",
        );
    }

    /// No endpoint anywhere: reject; Local policy with endpoints only elsewhere: drop.
    #[test]
    fn empty_sets_reject_or_drop() {
        let mut p = Planner::new();
        let yaml = docs(&[
            web("nowhere", "10.96.0.20", &[]),
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: elsewhere, namespace: default}
            spec: {clusterIP: 10.96.0.21, internalTrafficPolicy: Local, ports: [{name: http, port: 80}]}
            "#
            .to_string(),
            web("elsewhere", "10.96.0.21", &["10.0.0.1"]).split_once("---\n").unwrap().1.to_string(),
        ]);
        let (_, errors) = p.sync(&yaml);
        assert_eq!(errors, vec![]);
        assert_text(
            "map content",
            &p.text(),
            "
            svc 10.96.0.20:80/TCP local slot=0 id=2 count=0 flags=reject
            svc 10.96.0.21:80/TCP local slot=0 id=1 count=0 flags=drop,local-policy
            ",
        );
    }

    /// Every frontend of one ServicePort shares its id and backends; NodePorts and
    /// externalIP / LoadBalancer frontends are flagged.
    #[test]
    fn node_port_and_external_frontends() {
        let mut p = Planner::new();
        let (_, errors) = p.sync(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec:
              type: LoadBalancer
              clusterIP: 10.96.0.10
              externalIPs: [203.0.113.1]
              ports: [{name: http, port: 80, nodePort: 30080}]
            status: {loadBalancer: {ingress: [{ip: 198.51.100.1}]}}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-a, namespace: default, labels: {kubernetes.io/service-name: web}}
            addressType: IPv4
            ports: [{name: http, port: 8080}]
            endpoints: [{addresses: [10.0.0.1], nodeName: node-b}, {addresses: [10.0.0.2], nodeName: node-b}]
            "#,
        );
        assert_eq!(errors, vec![]);
        assert_text(
            "map content",
            &p.text(),
            "
            svc 198.51.100.1:80/TCP local slot=0 id=1 count=2 flags=external
            svc 198.51.100.1:80/TCP external slot=0 id=1 count=2 flags=external
            svc 198.51.100.1:80/TCP local slot=1 backend=1
            svc 198.51.100.1:80/TCP external slot=1 backend=1
            svc 198.51.100.1:80/TCP local slot=2 backend=2
            svc 198.51.100.1:80/TCP external slot=2 backend=2
            svc 203.0.113.1:80/TCP local slot=0 id=1 count=2 flags=external
            svc 203.0.113.1:80/TCP external slot=0 id=1 count=2 flags=external
            svc 203.0.113.1:80/TCP local slot=1 backend=1
            svc 203.0.113.1:80/TCP external slot=1 backend=1
            svc 203.0.113.1:80/TCP local slot=2 backend=2
            svc 203.0.113.1:80/TCP external slot=2 backend=2
            svc 10.96.0.10:80/TCP local slot=0 id=1 count=2 flags=-
            svc 10.96.0.10:80/TCP local slot=1 backend=1
            svc 10.96.0.10:80/TCP local slot=2 backend=2
            svc 192.168.1.10:30080/TCP local slot=0 id=1 count=2 flags=nodeport
            svc 192.168.1.10:30080/TCP external slot=0 id=1 count=2 flags=nodeport
            svc 192.168.1.10:30080/TCP local slot=1 backend=1
            svc 192.168.1.10:30080/TCP external slot=1 backend=1
            svc 192.168.1.10:30080/TCP local slot=2 backend=2
            svc 192.168.1.10:30080/TCP external slot=2 backend=2
            backend 1 10.0.0.1:8080/TCP
            backend 2 10.0.0.2:8080/TCP
            member svc=1 backend=1
            member svc=1 backend=2
            ",
        );
    }

    /// One endpoint behind two Services is one backend entry, a member of both.
    #[test]
    fn shared_backend_is_stored_once() {
        let mut p = Planner::new();
        let (_, errors) = p.sync(&docs(&[
            web("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"]),
            web("b", "10.96.0.2", &["10.0.0.2", "10.0.0.3"]),
        ]));
        assert_eq!(errors, vec![]);
        assert_text(
            "map content",
            &p.text(),
            "
            svc 10.96.0.1:80/TCP local slot=0 id=1 count=2 flags=-
            svc 10.96.0.1:80/TCP local slot=1 backend=1
            svc 10.96.0.1:80/TCP local slot=2 backend=2
            svc 10.96.0.2:80/TCP local slot=0 id=2 count=2 flags=-
            svc 10.96.0.2:80/TCP local slot=1 backend=2
            svc 10.96.0.2:80/TCP local slot=2 backend=3
            backend 1 10.0.0.1:8080/TCP
            backend 2 10.0.0.2:8080/TCP
            backend 3 10.0.0.3:8080/TCP
            member svc=1 backend=1
            member svc=1 backend=2
            member svc=2 backend=2
            member svc=2 backend=3
            ",
        );
    }

    /// The same input twice: the second plan writes nothing.
    #[test]
    fn unchanged_input_plans_nothing() {
        let yaml = docs(&[
            web("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"]),
            web("b", "10.96.0.2", &["10.0.0.2"]),
            web("c", "10.96.0.3", &[]),
        ]);
        let mut p = Planner::new();
        let (first, _) = p.sync(&yaml);
        assert!(!first.is_empty());
        let before = p.text();
        let (second, errors) = p.sync(&yaml);
        assert_eq!(errors, vec![]);
        assert!(
            second.is_empty(),
            "second plan is not empty:\n{}",
            render_plan(&second)
        );
        assert_eq!(second.len(), 0);
        assert_text("map content", &p.text(), &before);
    }

    /// New endpoints for one Service: only its entries are written; the other Service's
    /// frontend, id and backends are untouched.
    #[test]
    fn endpoint_change_touches_only_that_service() {
        let mut p = Planner::new();
        p.sync(&docs(&[
            web("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
            web("b", "10.96.0.2", &["10.0.0.7", "10.0.0.8"]),
        ]));
        let b_before: Vec<String> = p
            .text()
            .lines()
            .filter(|l| l.contains("10.96.0.2:"))
            .map(String::from)
            .collect();
        let (plan, _) = p.sync(&docs(&[
            web("a", "10.96.0.1", &["10.0.0.1", "10.0.0.3", "10.0.0.4"]),
            web("b", "10.96.0.2", &["10.0.0.7", "10.0.0.8"]),
        ]));
        assert_text(
            "plan",
            &render_plan(&plan),
            "
            + backend 6 10.0.0.4:8080/TCP
            + member svc=1 backend=6
            + svc 10.96.0.1:80/TCP local slot=2 backend=3
            + svc 10.96.0.1:80/TCP local slot=3 backend=6
            - member svc=1 backend=2
            - backend 2
            ",
        );
        let (frontends, svc_ids, backends) = touched(&plan);
        let b_frontend = p
            .current
            .services
            .keys()
            .find(|k| k.slot == 0 && fmt_endpoint(&k.addr, 0).starts_with("10.96.0.2:"));
        let b_frontend = *b_frontend.expect("b's frontend");
        let b_id = p.current.services[&b_frontend].svc_id;
        let b_backends: BTreeSet<u32> = p
            .current
            .members
            .iter()
            .filter(|m| m.svc_id == b_id)
            .map(|m| m.backend_id)
            .collect();
        assert!(
            !frontends.contains(&b_frontend),
            "plan touches b's frontend"
        );
        assert!(!svc_ids.contains(&b_id), "plan touches b's service id");
        assert!(
            backends.is_disjoint(&b_backends),
            "plan touches b's backends {b_backends:?}"
        );
        let b_after: Vec<String> = p
            .text()
            .lines()
            .filter(|l| l.contains("10.96.0.2:"))
            .map(String::from)
            .collect();
        assert_eq!(b_before, b_after);
    }

    /// A new Service: backends, then members, then its slots, then slot 0 (which
    /// publishes the count) last.
    #[test]
    fn order_new_service() {
        let mut p = Planner::new();
        let (plan, _) = p.sync(&docs(&[web("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"])]));
        assert_text(
            "plan",
            &render_plan(&plan),
            "
            + backend 1 10.0.0.1:8080/TCP
            + backend 2 10.0.0.2:8080/TCP
            + member svc=1 backend=1
            + member svc=1 backend=2
            + svc 10.96.0.1:80/TCP local slot=1 backend=1
            + svc 10.96.0.1:80/TCP local slot=2 backend=2
            + svc 10.96.0.1:80/TCP local slot=0 id=1 count=2 flags=-
            ",
        );
    }

    /// Growing: new slots before slot 0's larger count. Shrinking: slot 0's smaller
    /// count first, then the slots beyond it, then members and backends.
    #[test]
    fn order_grow_and_shrink() {
        let mut p = Planner::new();
        p.sync(&web("a", "10.96.0.1", &["10.0.0.1"]));
        let (grow, _) = p.sync(&web(
            "a",
            "10.96.0.1",
            &["10.0.0.1", "10.0.0.2", "10.0.0.3"],
        ));
        assert_text(
            "grow plan",
            &render_plan(&grow),
            "
            + backend 2 10.0.0.2:8080/TCP
            + backend 3 10.0.0.3:8080/TCP
            + member svc=1 backend=2
            + member svc=1 backend=3
            + svc 10.96.0.1:80/TCP local slot=2 backend=2
            + svc 10.96.0.1:80/TCP local slot=3 backend=3
            + svc 10.96.0.1:80/TCP local slot=0 id=1 count=3 flags=-
            ",
        );
        let (shrink, _) = p.sync(&web("a", "10.96.0.1", &["10.0.0.3"]));
        assert_text(
            "shrink plan",
            &render_plan(&shrink),
            "
            + svc 10.96.0.1:80/TCP local slot=1 backend=3
            + svc 10.96.0.1:80/TCP local slot=0 id=1 count=1 flags=-
            - svc 10.96.0.1:80/TCP local slot=2
            - svc 10.96.0.1:80/TCP local slot=3
            - member svc=1 backend=1
            - member svc=1 backend=2
            - backend 1
            - backend 2
            ",
        );
        let (empty, _) = p.sync(&web("a", "10.96.0.1", &[]));
        assert_text(
            "empty plan",
            &render_plan(&empty),
            "
            + svc 10.96.0.1:80/TCP local slot=0 id=1 count=0 flags=reject
            - svc 10.96.0.1:80/TCP local slot=1
            - member svc=1 backend=3
            - backend 3
            ",
        );
    }

    /// Removing a Service: its frontend goes first (slot 0, then its slots), making room
    /// for new frontends; members and the backends nobody else uses (a backend another
    /// Service shares stays) go last.
    #[test]
    fn order_removed_service() {
        let mut p = Planner::new();
        p.sync(&docs(&[
            web("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"]),
            web("b", "10.96.0.2", &["10.0.0.2"]),
        ]));
        let (plan, _) = p.sync(&docs(&[
            web("b", "10.96.0.2", &["10.0.0.2"]),
            web("c", "10.96.0.3", &["10.0.0.3"]),
        ]));
        assert_text(
            "plan",
            &render_plan(&plan),
            "
            - svc 10.96.0.1:80/TCP local slot=0
            - svc 10.96.0.1:80/TCP local slot=1
            - svc 10.96.0.1:80/TCP local slot=2
            + backend 3 10.0.0.3:8080/TCP
            + member svc=3 backend=3
            + svc 10.96.0.3:80/TCP local slot=1 backend=3
            + svc 10.96.0.3:80/TCP local slot=0 id=3 count=1 flags=-
            - member svc=1 backend=1
            - member svc=1 backend=2
            - backend 1
            ",
        );
    }

    /// A restarted agent adopts the ids in the pinned maps: the same desired state
    /// writes nothing, and a new Service gets ids nobody holds.
    #[test]
    fn restart_adopts_ids_and_writes_nothing() {
        let mut p = Planner::new();
        p.sync(&docs(&[
            web("a", "10.96.0.1", &["10.0.0.1"]),
            web("b", "10.96.0.2", &["10.0.0.2"]),
        ]));
        // Churn so that ids are no longer 1..n in name order.
        let yaml = docs(&[
            web("b", "10.96.0.2", &["10.0.0.2", "10.0.0.5"]),
            web("c", "10.96.0.3", &["10.0.0.3"]),
            web("d", "10.96.0.4", &[]),
        ]);
        p.sync(&yaml);
        let before = p.text();
        assert_text(
            "map content",
            &before,
            "
            svc 10.96.0.2:80/TCP local slot=0 id=2 count=2 flags=-
            svc 10.96.0.2:80/TCP local slot=1 backend=2
            svc 10.96.0.2:80/TCP local slot=2 backend=3
            svc 10.96.0.3:80/TCP local slot=0 id=3 count=1 flags=-
            svc 10.96.0.3:80/TCP local slot=1 backend=4
            svc 10.96.0.4:80/TCP local slot=0 id=4 count=0 flags=reject
            backend 2 10.0.0.2:8080/TCP
            backend 3 10.0.0.5:8080/TCP
            backend 4 10.0.0.3:8080/TCP
            member svc=2 backend=2
            member svc=2 backend=3
            member svc=3 backend=4
            ",
        );

        let mut restarted = Planner::restart(p.current.clone(), Capacity::default());
        let (plan, errors) = restarted.sync(&yaml);
        assert_eq!(errors, vec![]);
        assert!(plan.is_empty(), "restart writes:\n{}", render_plan(&plan));
        assert_text("map content", &restarted.text(), &before);

        // The new Service takes the lowest free service id (1, unused in the pins).
        let (plan, _) = restarted.sync(&docs(&[
            yaml.clone(),
            web("aa", "10.96.0.5", &["10.0.0.1", "10.0.0.2"]),
        ]));
        assert_text(
            "plan",
            &render_plan(&plan),
            "
            + backend 5 10.0.0.1:8080/TCP
            + member svc=1 backend=2
            + member svc=1 backend=5
            + svc 10.96.0.5:80/TCP local slot=1 backend=5
            + svc 10.96.0.5:80/TCP local slot=2 backend=2
            + svc 10.96.0.5:80/TCP local slot=0 id=1 count=2 flags=-
            ",
        );
    }

    /// A ServicePort that does not fit the service map is reported, with the flag to
    /// raise; the others are programmed.
    #[test]
    fn services_map_full() {
        let mut p = Planner::new();
        p.cap = Capacity {
            services: 6,
            backends: 100,
        };
        let (_, errors) = p.sync(&docs(&[
            web("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"]),
            web("b", "10.96.0.2", &["10.0.0.3", "10.0.0.4", "10.0.0.5"]),
            web("c", "10.96.0.3", &[]),
            web("d", "10.96.0.4", &["10.0.0.1", "10.0.0.6"]),
        ]));
        assert_eq!(
            errors,
            vec![
                PlanError::MapFull {
                    service: spid("b"),
                    map: SERVICES_MAP,
                    flag: "max-services",
                    needed: 4,
                    free: 3,
                    capacity: 6,
                },
                PlanError::MapFull {
                    service: spid("d"),
                    map: SERVICES_MAP,
                    flag: "max-services",
                    needed: 3,
                    free: 2,
                    capacity: 6,
                },
            ]
        );
        assert_eq!(
            errors[0].to_string(),
            "default/b:http/TCP/IPv4: does not fit the FERRY_SVC map (4 more entries, 3 free of 6); \
             it is not programmed, every other service is; raise --max-services"
        );
        assert_text(
            "map content",
            &p.text(),
            "
            svc 10.96.0.1:80/TCP local slot=0 id=1 count=2 flags=-
            svc 10.96.0.1:80/TCP local slot=1 backend=1
            svc 10.96.0.1:80/TCP local slot=2 backend=2
            svc 10.96.0.3:80/TCP local slot=0 id=2 count=0 flags=reject
            backend 1 10.0.0.1:8080/TCP
            backend 2 10.0.0.2:8080/TCP
            member svc=1 backend=1
            member svc=1 backend=2
            ",
        );
    }

    /// The backend map counts distinct backends: one already placed costs nothing.
    #[test]
    fn backends_map_full() {
        let mut p = Planner::new();
        p.cap = Capacity {
            services: 100,
            backends: 3,
        };
        let (_, errors) = p.sync(&docs(&[
            web("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"]),
            web("b", "10.96.0.2", &["10.0.0.1", "10.0.0.3", "10.0.0.4"]),
            web("c", "10.96.0.3", &["10.0.0.2", "10.0.0.5"]),
            web("d", "10.96.0.4", &["10.0.0.1", "10.0.0.2"]),
        ]));
        assert_eq!(
            errors,
            vec![PlanError::MapFull {
                service: spid("b"),
                map: BACKENDS_MAP,
                flag: "max-backends",
                needed: 2,
                free: 1,
                capacity: 3,
            }]
        );
        assert!(
            errors[0].to_string().ends_with("raise --max-backends"),
            "{}",
            errors[0]
        );
        assert_text(
            "map content",
            &p.text(),
            "
            svc 10.96.0.1:80/TCP local slot=0 id=1 count=2 flags=-
            svc 10.96.0.1:80/TCP local slot=1 backend=1
            svc 10.96.0.1:80/TCP local slot=2 backend=2
            svc 10.96.0.3:80/TCP local slot=0 id=2 count=2 flags=-
            svc 10.96.0.3:80/TCP local slot=1 backend=2
            svc 10.96.0.3:80/TCP local slot=2 backend=3
            svc 10.96.0.4:80/TCP local slot=0 id=3 count=2 flags=-
            svc 10.96.0.4:80/TCP local slot=1 backend=1
            svc 10.96.0.4:80/TCP local slot=2 backend=2
            backend 1 10.0.0.1:8080/TCP
            backend 2 10.0.0.2:8080/TCP
            backend 3 10.0.0.5:8080/TCP
            member svc=1 backend=1
            member svc=1 backend=2
            member svc=2 backend=2
            member svc=2 backend=3
            member svc=3 backend=1
            member svc=3 backend=2
            ",
        );
    }

    /// A programmed ServicePort keeps its place when a new one that sorts first
    /// arrives and only one fits, in a running agent and after a restart alike.
    #[test]
    fn programmed_service_is_placed_before_new_ones() {
        let zeta = web("zeta", "10.96.0.9", &["10.0.0.9"]);
        let both = docs(&[web("alpha", "10.96.0.1", &["10.0.0.1"]), zeta.clone()]);
        let cap = Capacity {
            services: 3,
            backends: 100,
        };
        let mut p = Planner::new();
        p.cap = cap;
        p.sync(&zeta);
        let before = p.text();
        let alpha_full = vec![PlanError::MapFull {
            service: spid("alpha"),
            map: SERVICES_MAP,
            flag: "max-services",
            needed: 2,
            free: 1,
            capacity: 3,
        }];

        let (plan, errors) = p.sync(&both);
        assert_eq!(errors, alpha_full);
        assert!(
            plan.is_empty(),
            "zeta is rewritten:\n{}",
            render_plan(&plan)
        );
        assert_text("map content", &p.text(), &before);

        let mut restarted = Planner::restart(p.current.clone(), cap);
        let (plan, errors) = restarted.sync(&both);
        assert_eq!(errors, alpha_full);
        assert!(
            plan.is_empty(),
            "zeta is rewritten after a restart:\n{}",
            render_plan(&plan)
        );
    }

    /// More endpoints than one frontend can hold: that ServicePort alone is refused.
    #[test]
    fn too_many_endpoints() {
        let count = MAX_BACKENDS_PER_SERVICE as usize + 1;
        let endpoints: Vec<String> = (0..count)
            .map(|i| format!("10.1.{}.{}", i / 250, i % 250 + 1))
            .collect();
        let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
        let mut p = Planner::new();
        let (_, errors) = p.sync(&docs(&[
            web("big", "10.96.0.1", &endpoints),
            web("small", "10.96.0.2", &["10.0.0.1"]),
        ]));
        assert_eq!(
            errors,
            vec![PlanError::TooManyEndpoints {
                service: spid("big"),
                count,
                max: MAX_BACKENDS_PER_SERVICE
            }]
        );
        assert_eq!(
            errors[0].to_string(),
            "default/big:http/TCP/IPv4: 4097 endpoints is more than ferry serves per frontend (4096); not programmed"
        );
        assert_text(
            "map content",
            &p.text(),
            "
            svc 10.96.0.2:80/TCP local slot=0 id=1 count=1 flags=-
            svc 10.96.0.2:80/TCP local slot=1 backend=1
            backend 1 10.0.0.1:8080/TCP
            member svc=1 backend=1
            ",
        );
        // Exactly the maximum fits.
        let (_, errors) = p.sync(&web("big", "10.96.0.1", &endpoints[..count - 1]));
        assert_eq!(errors, vec![]);
        assert_eq!(p.current.backends.len(), count - 1);
    }

    /// An externalIP that moves from a programmed Service to a new one (which sorts
    /// first) must not hand the new Service the old one's id while the old one keeps it.
    #[test]
    fn moved_frontend_does_not_share_service_id() {
        let service = |name: &str, cip: &str, eips: &str, ep: &str| {
            format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\n\
                 spec: {{clusterIP: {cip}, externalIPs: [{eips}], ports: [{{name: http, port: 80}}]}}\n\
                 ---\n{}",
                web(name, cip, &[ep]).split_once("---\n").unwrap().1
            )
        };
        let mut p = Planner::new();
        p.sync(&service("x", "10.96.0.2", "203.0.113.1", "10.0.0.2"));
        // 203.0.113.1 moves from x to the new Service a.
        let moved = docs(&[
            service("a", "10.96.0.1", "203.0.113.1", "10.0.0.1"),
            service("x", "10.96.0.2", "", "10.0.0.2"),
        ]);
        p.sync(&moved);
        let ids: BTreeMap<String, u32> = p
            .current
            .services
            .iter()
            .filter(|(k, _)| k.slot == 0)
            .map(|(k, v)| (fmt_endpoint(&k.addr, u16::from_be(k.port)), v.svc_id))
            .collect();
        assert_eq!(
            ids["203.0.113.1:80"], ids["10.96.0.1:80"],
            "a's frontends share a's id: {ids:?}"
        );
        assert_ne!(
            ids["10.96.0.2:80"], ids["10.96.0.1:80"],
            "x and a share a service id: {ids:?}"
        );
        let mut restarted = Planner::restart(p.current.clone(), p.cap);
        let (plan, _) = restarted.sync(&moved);
        assert!(plan.is_empty(), "restart writes:\n{}", render_plan(&plan));
    }

    /// Plan::len counts every write and delete.
    #[test]
    fn plan_len_counts_every_write() {
        let mut p = Planner::new();
        p.sync(&web("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"]));
        let (plan, _) = p.sync(&web("b", "10.96.0.2", &["10.0.0.3"]));
        assert_eq!(plan.len(), render_plan(&plan).lines().count());
        // b: backend, member, slot 1, slot 0; a: 3 slots, 2 members, 2 backends.
        assert_eq!(plan.len(), 4 + 7);
    }

    #[test]
    fn plan_errors_are_summarized_per_cause_with_the_first_names() {
        let id = |name: &str| {
            ServicePortId::new(
                "default",
                name,
                "http",
                crate::model::Protocol::Tcp,
                crate::model::IpFamily::V4,
            )
        };
        let full = |name: &str, free: u32| PlanError::MapFull {
            service: id(name),
            map: "FERRY_SVC",
            flag: "max-services",
            needed: 2,
            free,
            capacity: 16,
        };
        let mut errors: Vec<PlanError> = (0..8).map(|i| full(&format!("s{i}"), 1)).collect();
        errors.push(full("a0", 0));
        errors.push(PlanError::TooManyEndpoints {
            service: id("big"),
            count: 70000,
            max: 65535,
        });
        let refs: Vec<&PlanError> = errors.iter().collect();
        let lines = summarize(&refs);
        assert_eq!(
            lines,
            [
                "9 ServicePorts do not fit the FERRY_SVC map (18 more entries needed, 0 free of 16): default/a0:http/TCP/IPv4, default/s0:http/TCP/IPv4, default/s1:http/TCP/IPv4, default/s2:http/TCP/IPv4, default/s3:http/TCP/IPv4, and 4 more; not programmed, every other ServicePort is; raise --max-services",
                "1 ServicePort has more endpoints than ferry serves per frontend (65535): default/big:http/TCP/IPv4 (70000 endpoints); not programmed",
            ]
        );
        assert!(summarize(&[]).is_empty());
    }
}

#[cfg(test)]
mod bulk_tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;
    use crate::model::{DesiredState, Endpoint, EndpointSet, IpFamily};

    /// `n` ClusterIP ServicePorts of 10 endpoints; neighbours share 5 backends, and every
    /// 7th endpoint is terminating in one Service and not in the next (the same backend
    /// written with other flags: the last write wins, as with `insert`).
    fn many(n: u32) -> DesiredState {
        let mut d = DesiredState::default();
        for i in 0..n {
            let id = ServicePortId::new(
                "default",
                format!("svc-{i}"),
                "http",
                Protocol::Tcp,
                IpFamily::V4,
            );
            let endpoints = (0..10)
                .map(|j| Endpoint {
                    addr: IpAddr::V4(Ipv4Addr::from(0x0a80_0000 + i * 5 + j)),
                    port: 8080,
                    terminating: (i * 5 + j) % 7 == 0 && i % 2 == 0,
                    local: false,
                })
                .collect();
            let frontend = FrontendState {
                addr: IpAddr::V4(Ipv4Addr::from(0x0a60_0000 + i)),
                port: 80,
                kind: FrontendKind::ClusterIp,
                scope: Scope::LocalOrigin,
                set: EndpointSet {
                    endpoints,
                    empty_action: EmptyAction::Reject,
                    terminating_fallback: false,
                    local_policy: false,
                    topology: false,
                },
            };
            let sp = ServicePortState {
                id: id.clone(),
                affinity_timeout_s: None,
                frontends: vec![frontend],
                source_ranges: None,
            };
            d.services.insert(id, sp);
        }
        d
    }

    #[test]
    fn backend_ids_tell_every_tuple_apart_in_both_families() {
        let v4 = |ip: [u8; 4], port: u16, proto: u8| {
            (
                addr_of(&IpAddr::V4(Ipv4Addr::from(ip))),
                port.to_be(),
                proto,
            )
        };
        let v6 = (addr_of(&"fd00::1".parse().unwrap()), 80u16.to_be(), 6);
        let tuples = [
            v4([10, 0, 0, 1], 80, 6),
            v4([10, 0, 0, 1], 80, 17),
            v4([10, 0, 0, 1], 81, 6),
            v4([10, 0, 0, 2], 80, 6),
            v4([255, 255, 255, 255], 65535, 255),
            v6,
        ];
        let mut ids = BackendIds::default();
        for (n, t) in tuples.iter().enumerate() {
            assert_eq!(ids.insert(*t, n as u32), None, "{t:?} is new");
        }
        for (n, t) in tuples.iter().enumerate() {
            assert_eq!(ids.get(t), Some(&(n as u32)));
        }
        ids.retain(|id| id % 2 == 1);
        ids.compact();
        for (n, t) in tuples.iter().enumerate() {
            assert_eq!(ids.contains_key(t), n % 2 == 1, "{t:?}");
        }
        assert_eq!(ids.remove(&v6), Some(5));
        assert!(!ids.contains_key(&v6));
    }

    #[test]
    fn a_full_plan_over_many_chunks_equals_entry_by_entry_placement() {
        // 3000 x 11 service entries: two chunks and a part.
        let d = many(3000);
        let cap = Capacity {
            services: 1 << 20,
            backends: 1 << 20,
        };
        let (content, errors, owners, kept) = desired_content_owned(
            d.services.values().cloned(),
            &mut Ids::adopt(&MapContent::default()),
            &MapContent::default(),
            cap,
        );
        assert!(errors.is_empty());
        assert!(kept.is_empty(), "placed, and no external-origin frontend");
        let mut ids = Ids::adopt(&MapContent::default());
        let mut expected = MapContent::default();
        for (n, sp) in d.services.values().enumerate() {
            let owned = place(sp, n as u32 + 1, &mut ids, &mut expected);
            assert_eq!(owners[&sp.id], owned);
        }
        assert_eq!(content.services.len(), 3000 * 11);
        assert_eq!(content.backends.len(), 3000 * 5 + 5);
        assert_eq!(content, expected);
    }

    #[test]
    fn capacity_counts_distinct_backends_across_chunks() {
        let d = many(3000);
        // Room for all but 1 backend. Placed in name order, svc-998 (the last but one)
        // is the first to bring 5 new ones and does not fit; svc-999 then brings the 5
        // it would have shared with svc-998 and does not fit either.
        let cap = Capacity {
            services: 1 << 20,
            backends: 3000 * 5 + 4,
        };
        let (content, errors, _, kept) = desired_content_owned(
            d.services.values().cloned(),
            &mut Ids::adopt(&MapContent::default()),
            &MapContent::default(),
            cap,
        );
        let refused: Vec<(String, u32)> = errors
            .iter()
            .map(|e| match e {
                PlanError::MapFull { service, free, .. } => (service.name.to_string(), *free),
                PlanError::TooManyEndpoints { .. } => unreachable!(),
            })
            .collect();
        assert_eq!(refused, [("svc-998".into(), 4), ("svc-999".into(), 4)]);
        let kept: Vec<&str> = kept.iter().map(|s| &*s.id.name).collect();
        assert_eq!(
            kept,
            ["svc-998", "svc-999"],
            "the states not placed come back"
        );
        assert_eq!(content.backends.len(), 3000 * 5);
    }
}
