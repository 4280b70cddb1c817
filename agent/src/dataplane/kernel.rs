//! Reading and writing the pinned maps.

use std::{
    collections::{BTreeMap, BTreeSet},
    os::fd::AsFd,
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use aya::{
    Ebpf, Pod,
    maps::{HashMap, IterableMap, Map, MapData, MapError, PerCpuArray, PerCpuValues},
};
use ferry_common::{
    ct::{CT_MAP, CtEntry, CtKey},
    ext::{ClientAffinityKey, TC_AFFINITY_MAP},
    lb::{
        AFFINITY_MAP, AffinityKey, AffinityValue, BACKEND_F_LOCAL, BACKENDS_MAP, Backend,
        MEMBERS_MAP, MemberKey, SCOPE_EXTERNAL_ORIGIN, SERVICES_MAP, ServiceKey, ServiceValue,
    },
    metrics::{COUNTERS_LEN, COUNTERS_MAP, SVC_CONNS_MAP},
    sock::{RevNatKey, RevNatValue, SOCK_REVNAT_MAP},
};
use tracing::warn;

use super::{
    ext_maps::ExternalMaps,
    external::ExternalPlan,
    plan::{MapContent, Plan, fmt_endpoint, proto_name},
};

pub struct KernelMaps {
    services: HashMap<MapData, ServiceKey, ServiceValue>,
    backends: HashMap<MapData, u32, Backend>,
    members: HashMap<MapData, MemberKey, u8>,
    counters: PerCpuArray<MapData, u64>,
    /// Maps the programs write and the agent only reads (metrics, `ferry explain`).
    observed: Observed,
    /// The tc path's maps; `None` with an object built before the tc path.
    pub external: Option<ExternalMaps>,
}

/// Each is optional: pins left by an older release may lack one, and everything read
/// from them is best effort (an operator view, never an input to planning).
#[derive(Default)]
struct Observed {
    affinity: Option<HashMap<MapData, AffinityKey, AffinityValue>>,
    revnat: Option<HashMap<MapData, RevNatKey, RevNatValue>>,
    svc_conns: Option<PerCpuArray<MapData, u64>>,
    /// One above the highest service id written: reads of `svc_conns` stop there instead
    /// of walking the whole array (0: not known, as in `ferry list`; walk it all).
    svc_ids_end: Arc<AtomicU32>,
}

/// What an apply did; failures name the frontend or backend at fault.
#[derive(Debug, Default)]
pub struct ApplyReport {
    pub writes: usize,
    pub failures: Vec<String>,
}

type Named<T> = Result<T, (&'static str, MapError)>;

/// Entries per `BPF_MAP_UPDATE_BATCH` call when filling a map.
const FILL_BATCH: usize = 8192;

/// Writes `entries` into `map` in batches of [`FILL_BATCH`], one `bpf()` call each
/// instead of one per entry (at 100,000 Services the first fill is over a million
/// entries). Where a batch stops at an entry, the rest of it is written one by one, so
/// each failure is reported with its entry (`name`) as before.
fn fill_map<K: Pod, V: Pod>(
    map: &mut HashMap<MapData, K, V>,
    entries: impl Iterator<Item = (K, V)>,
    r: &mut ApplyReport,
    name: impl Fn(&K, &V) -> String,
) {
    let mut keys = Vec::with_capacity(FILL_BATCH);
    let mut values = Vec::with_capacity(FILL_BATCH);
    let mut entries = entries.peekable();
    while entries.peek().is_some() {
        keys.clear();
        values.clear();
        for (k, v) in entries.by_ref().take(FILL_BATCH) {
            keys.push(k);
            values.push(v);
        }
        let (done, result) = super::bpf_sys::update_batch(map.map().fd().as_fd(), &keys, &values);
        r.writes += done;
        if result.is_ok() && done == keys.len() {
            continue;
        }
        for (k, v) in keys[done..].iter().zip(&values[done..]) {
            match map.insert(k, v, 0) {
                Ok(()) => r.writes += 1,
                Err(e) => r.failures.push(format!("{}: {e}", name(k, v))),
            }
        }
    }
}

fn take<T: TryFrom<Map, Error = MapError>>(ebpf: &mut Ebpf, name: &'static str) -> Named<T> {
    let map = ebpf
        .take_map(name)
        .ok_or((name, MapError::InvalidName { name: name.into() }))?;
    T::try_from(map).map_err(|e| (name, e))
}

fn open<T: TryFrom<Map, Error = MapError>>(
    dir: &Path,
    name: &'static str,
    wrap: fn(MapData) -> Map,
) -> Named<T> {
    let data = MapData::from_pin(dir.join(name)).map_err(|e| (name, e))?;
    T::try_from(wrap(data)).map_err(|e| (name, e))
}

impl KernelMaps {
    pub fn from_ebpf(ebpf: &mut Ebpf) -> Named<KernelMaps> {
        Ok(KernelMaps {
            services: take(ebpf, SERVICES_MAP)?,
            backends: take(ebpf, BACKENDS_MAP)?,
            members: take(ebpf, MEMBERS_MAP)?,
            counters: take(ebpf, COUNTERS_MAP)?,
            observed: Observed {
                affinity: take(ebpf, AFFINITY_MAP).ok(),
                revnat: take(ebpf, SOCK_REVNAT_MAP).ok(),
                svc_conns: take(ebpf, SVC_CONNS_MAP).ok(),
                svc_ids_end: Default::default(),
            },
            external: ExternalMaps::from_ebpf(ebpf),
        })
    }

    /// Opens the maps an agent pinned, without loading programs (`ferry list`).
    pub fn open_pinned(dir: &Path) -> Named<KernelMaps> {
        Ok(KernelMaps {
            services: open(dir, SERVICES_MAP, Map::HashMap)?,
            backends: open(dir, BACKENDS_MAP, Map::HashMap)?,
            members: open(dir, MEMBERS_MAP, Map::HashMap)?,
            counters: open(dir, COUNTERS_MAP, Map::PerCpuArray)?,
            observed: Observed {
                affinity: open(dir, AFFINITY_MAP, Map::LruHashMap).ok(),
                revnat: open(dir, SOCK_REVNAT_MAP, Map::LruHashMap).ok(),
                svc_conns: open(dir, SVC_CONNS_MAP, Map::PerCpuArray).ok(),
                svc_ids_end: Default::default(),
            },
            // Conntrack is pinned beside the layout directories (it outlives them).
            external: ExternalMaps::open_pinned(
                dir,
                &dir.parent().unwrap_or(dir).join(ferry_common::ct::CT_MAP),
            ),
        })
    }

    /// The whole content of the service, backend and membership maps.
    pub fn read(&self) -> Result<MapContent, MapError> {
        let mut c = MapContent::default();
        for kv in self.services.iter() {
            let (k, v) = kv?;
            c.services.insert(k, v);
        }
        for kv in self.backends.iter() {
            let (k, v) = kv?;
            c.backends.insert(k, v);
        }
        for k in self.members.keys() {
            c.members.insert(k?);
        }
        self.note_service_ids(c.services.values().map(|v| v.svc_id));
        Ok(c)
    }

    /// The tc path's tables and ranges (empty when the tc maps are not there).
    pub fn read_external(&self) -> Result<super::external::ExternalContent, MapError> {
        match &self.external {
            Some(ext) => ext.read(),
            None => Ok(Default::default()),
        }
    }

    /// Counters summed over CPUs, indexed by `COUNT_*`.
    pub fn counters(&self) -> Vec<u64> {
        (0..COUNTERS_LEN)
            .map(|i| {
                self.counters
                    .get(&i, 0)
                    .map(|v| v.iter().sum())
                    .unwrap_or(0)
            })
            .collect()
    }

    /// Writes `content` into maps that hold nothing yet (a fresh install): the same order
    /// as a plan (backends, members, slots, then each frontend's slot 0), without building
    /// one, which for 10,000 Services would copy every entry once more.
    pub fn fill(&mut self, content: &MapContent, external: &ExternalPlan) -> ApplyReport {
        let mut r = ApplyReport::default();
        self.note_service_ids(content.services.values().map(|v| v.svc_id));
        fill_map(
            &mut self.backends,
            content.backends.iter().map(|(id, b)| (*id, *b)),
            &mut r,
            |id, _| format!("backend {id}"),
        );
        fill_map(
            &mut self.members,
            content.members.iter().map(|m| (*m, 1u8)),
            &mut r,
            |m, _| format!("member svc={} backend={}", m.svc_id, m.backend_id),
        );
        if let Some(ext) = &mut self.external {
            ext.upsert(external, &mut r.failures);
            r.writes += external.len();
        }
        let ports_ok = self.add_flow_ports(
            content.services.keys().filter(|k| k.slot == 0).copied(),
            content.backends.values(),
            &mut r,
        );
        for pass_slot0 in [false, true] {
            fill_map(
                &mut self.services,
                content
                    .services
                    .iter()
                    .filter(|(k, _)| (k.slot == 0) == pass_slot0)
                    .filter(|(k, _)| ports_ok || !pass_slot0 || k.scope != SCOPE_EXTERNAL_ORIGIN)
                    .map(|(k, v)| (*k, *v)),
                &mut r,
                |k, _| {
                    format!(
                        "{}/{} slot {}",
                        fmt_endpoint(&k.addr, u16::from_be(k.port)),
                        proto_name(k.proto),
                        k.slot
                    )
                },
            );
        }
        for f in &r.failures {
            warn!("map write failed: {f}");
        }
        r
    }

    /// Applies a plan in its order. A frontend whose slot or backend write failed keeps
    /// its previous slot 0, so the kernel never publishes a count it cannot serve.
    /// Whole frontends that go away are removed first: nothing new refers to them, and in
    /// a full map their entries are the room the new frontends are planned into.
    pub fn apply(&mut self, plan: &Plan) -> ApplyReport {
        let mut r = ApplyReport::default();
        self.note_service_ids(
            plan.frontends
                .iter()
                .filter_map(|f| f.slot0_value.map(|v| v.svc_id)),
        );
        for k in &plan.frontend_deletes {
            self.delete_service(k, &mut r);
        }
        let mut failed_backends = Vec::new();
        for (id, b) in &plan.backend_upserts {
            match self.backends.insert(id, b, 0) {
                Ok(()) => r.writes += 1,
                Err(e) => {
                    failed_backends.push(*id);
                    r.failures.push(format!(
                        "backend {} {}/{}: {e}",
                        id,
                        fmt_endpoint(&b.addr, u16::from_be(b.port)),
                        proto_name(b.proto)
                    ));
                }
            }
        }
        for m in &plan.member_upserts {
            match self.members.insert(m, 1, 0) {
                Ok(()) => r.writes += 1,
                Err(e) => r.failures.push(format!(
                    "member svc={} backend={}: {e}",
                    m.svc_id, m.backend_id
                )),
            }
        }
        let ports_ok = self.add_flow_ports(
            plan.frontends.iter().map(|f| f.slot0),
            plan.backend_upserts.iter().map(|(_, b)| b),
            &mut r,
        );
        // The tc path's tables and ranges, before any slot 0 that uses them.
        let failed_tables = match &mut self.external {
            Some(ext) => {
                r.writes += plan.external.maglev_upserts.len() + plan.external.range_upserts.len();
                ext.upsert(&plan.external, &mut r.failures)
            }
            None => Default::default(),
        };
        for f in &plan.frontends {
            let name = || {
                format!(
                    "frontend {}/{}",
                    fmt_endpoint(&f.slot0.addr, u16::from_be(f.slot0.port)),
                    proto_name(f.slot0.proto)
                )
            };
            if let Some(id) = f
                .slot_upserts
                .iter()
                .map(|(_, v)| v.backend_id)
                .find(|id| failed_backends.contains(id))
            {
                r.failures.push(format!(
                    "{}: backend {id} could not be written; frontend left as it was",
                    name()
                ));
                continue;
            }
            let mut ok = true;
            for (k, v) in &f.slot_upserts {
                if let Err(e) = self.services.insert(k, v, 0) {
                    r.failures.push(format!(
                        "{} slot {}: {e}; frontend left as it was",
                        name(),
                        k.slot
                    ));
                    ok = false;
                    break;
                }
                r.writes += 1;
            }
            if !ok {
                continue;
            }
            let external = f.slot0.scope == SCOPE_EXTERNAL_ORIGIN;
            if external && !ports_ok && f.slot0_value.is_some() {
                r.failures.push(format!(
                    "{}: the flow port filter could not be written; frontend left as it was",
                    name()
                ));
                continue;
            }
            if let Some(v) = f
                .slot0_value
                .filter(|v| external && failed_tables.contains(&v.svc_id))
            {
                r.failures.push(format!(
                    "{}: the tc entries of service id {} could not be written; frontend left as it was",
                    name(),
                    v.svc_id
                ));
                continue;
            }
            if let Some(v) = &f.slot0_value {
                if let Err(e) = self.services.insert(f.slot0, v, 0) {
                    r.failures.push(format!("{}: {e}", name()));
                    continue;
                }
                r.writes += 1;
            }
            for k in &f.slot_deletes {
                self.delete_service(k, &mut r);
            }
        }
        // After the frontends that used them are gone; before any plan reuses them.
        self.zero_service_connections(&plan.released_services);
        if let Some(ext) = &mut self.external {
            r.writes += plan.external.range_deletes.len() + plan.external.maglev_deletes.len();
            ext.delete(&plan.external, &mut r.failures);
        }
        for m in &plan.member_deletes {
            match self.members.remove(m) {
                Ok(()) | Err(MapError::KeyNotFound) => r.writes += 1,
                Err(e) => r.failures.push(format!(
                    "member svc={} backend={}: {e}",
                    m.svc_id, m.backend_id
                )),
            }
        }
        for id in &plan.backend_deletes {
            match self.backends.remove(id) {
                Ok(()) | Err(MapError::KeyNotFound) => r.writes += 1,
                Err(e) => r.failures.push(format!("backend {id}: {e}")),
            }
        }
        for f in &r.failures {
            warn!("map write failed: {f}");
        }
        r
    }

    /// Puts the ports of external frontends (slot-0 keys of any scope may be passed) and
    /// of local backends into the tc path's port filter, before the entries that use
    /// them. False when the filter could not be written: external frontends must not be
    /// published then (the programs would pass their packets untranslated).
    fn add_flow_ports<'a>(
        &mut self,
        frontends: impl Iterator<Item = ServiceKey>,
        backends: impl Iterator<Item = &'a Backend>,
        r: &mut ApplyReport,
    ) -> bool {
        let Some(ext) = &mut self.external else {
            return true;
        };
        let ports = frontends
            .filter(|k| k.scope == SCOPE_EXTERNAL_ORIGIN)
            .map(|k| k.port)
            .chain(
                backends
                    .filter(|b| b.flags & BACKEND_F_LOCAL != 0)
                    .map(|b| b.port),
            );
        match ext.add_flow_ports(ports) {
            Ok(n) => {
                r.writes += (n > 0) as usize;
                true
            }
            Err(e) => {
                r.failures.push(format!("flow port filter: {e}"));
                false
            }
        }
    }

    fn delete_service(&mut self, k: &ServiceKey, r: &mut ApplyReport) {
        match self.services.remove(k) {
            Ok(()) | Err(MapError::KeyNotFound) => r.writes += 1,
            Err(e) => r.failures.push(format!(
                "removing {}/{} slot {}: {e}",
                fmt_endpoint(&k.addr, u16::from_be(k.port)),
                proto_name(k.proto),
                k.slot
            )),
        }
    }
}

/// The maximum number of entries of a map (0 when the kernel does not say).
fn max_entries(map: &MapData) -> u32 {
    map.info().map(|i| i.max_entries()).unwrap_or(0)
}

/// Keys of a hash map, at most `cap` of them: an LRU map changing under the walk can make
/// the kernel restart it, and the cap keeps that from running away.
fn count_keys<K: Pod>(keys: impl Iterator<Item = Result<K, MapError>>, cap: u32) -> usize {
    keys.take(cap as usize).filter(Result::is_ok).count()
}

/// A second handle on a map (its own fd), for a reader on another thread.
fn dup(map: &MapData) -> std::io::Result<MapData> {
    let fd = map.fd().as_fd().try_clone_to_owned()?;
    MapData::from_fd(fd).map_err(std::io::Error::other)
}

/// Operator views of the maps the programs write (`/metrics`, `ferry explain`).
impl KernelMaps {
    /// Live affinity and UDP stickiness entries (empty when the map is not pinned).
    pub fn affinity_entries(&self) -> Vec<(AffinityKey, AffinityValue)> {
        let Some(m) = &self.observed.affinity else {
            return Vec::new();
        };
        let cap = max_entries(m.map()) as usize;
        m.iter().take(cap).filter_map(Result::ok).collect()
    }

    /// The tc path's ClientIP pins (empty without the tc maps).
    pub fn tc_affinity_entries(&self) -> Vec<(ClientAffinityKey, AffinityValue)> {
        self.external
            .as_ref()
            .map(|e| e.affinity_entries())
            .unwrap_or_default()
    }

    /// Translated connects and datagrams per service id, summed over CPUs (ids with none
    /// are left out).
    pub fn service_connections(&self) -> BTreeMap<u32, u64> {
        self.observed
            .svc_conns
            .as_ref()
            .map(|m| service_connections(m, &self.observed.svc_ids_end))
            .unwrap_or_default()
    }

    /// Copies the per-ServicePort connection counts into another generation's maps (see
    /// `growth`). Returns how many were copied.
    pub fn carry_service_connections(&self, to: &mut KernelMaps) -> usize {
        let (Some(from), Some(to_map)) = (&self.observed.svc_conns, &mut to.observed.svc_conns)
        else {
            return 0;
        };
        let end = self.observed.svc_ids_end.load(Ordering::Relaxed);
        to.observed.svc_ids_end.fetch_max(end, Ordering::Relaxed);
        let mut n = 0;
        for id in 0..ids_end(from, &self.observed.svc_ids_end).min(to_map.len()) {
            if let Ok(v) = from.get(&id, 0)
                && v.iter().any(|c| *c != 0)
                && to_map.set(id, v, 0).is_ok()
            {
                n += 1;
            }
        }
        n
    }

    /// Zeroes the connection counts of service ids no longer programmed, so an id reused
    /// later (or after a restart) starts from zero. Returns how many were zeroed.
    pub fn prune_service_connections(&mut self, live: &BTreeSet<u32>) -> usize {
        let Some(m) = &self.observed.svc_conns else {
            return 0;
        };
        let stale: Vec<u32> = service_connections(m, &self.observed.svc_ids_end)
            .into_keys()
            .filter(|id| !live.contains(id))
            .collect();
        self.zero_service_connections(&stale)
    }

    /// Sets the given ids' connection counts to 0 on every CPU.
    fn zero_service_connections(&mut self, ids: &[u32]) -> usize {
        let Some(m) = &mut self.observed.svc_conns else {
            return 0;
        };
        let Ok(cpus) = aya::util::nr_cpus() else {
            return 0;
        };
        ids.iter()
            .filter(|id| {
                PerCpuValues::try_from(vec![0u64; cpus])
                    .is_ok_and(|zero| m.set(**id, zero, 0).is_ok())
            })
            .count()
    }

    /// Notes the ids a write gives frontends, so reads cover them.
    fn note_service_ids(&self, ids: impl Iterator<Item = u32>) {
        if let Some(hi) = ids.max() {
            self.observed
                .svc_ids_end
                .fetch_max(hi.saturating_add(1), Ordering::Relaxed);
        }
    }

    /// Independent handles for `/metrics`, which reads them on scrape, off the sync loop.
    pub fn stats(&self) -> std::io::Result<MapStats> {
        let mut fill: Vec<(&'static str, FillFn)> = Vec::new();
        let members: HashMap<MapData, MemberKey, u8> =
            HashMap::try_from(Map::HashMap(dup(self.members.map())?))
                .map_err(std::io::Error::other)?;
        fill.push((MEMBERS_MAP, hash_fill(members)));
        if let Some(a) = &self.observed.affinity {
            let a: HashMap<MapData, AffinityKey, AffinityValue> =
                HashMap::try_from(Map::LruHashMap(dup(a.map())?)).map_err(std::io::Error::other)?;
            fill.push((AFFINITY_MAP, hash_fill(a)));
        }
        if let Some(r) = &self.observed.revnat {
            let r: HashMap<MapData, RevNatKey, RevNatValue> =
                HashMap::try_from(Map::LruHashMap(dup(r.map())?)).map_err(std::io::Error::other)?;
            fill.push((SOCK_REVNAT_MAP, hash_fill(r)));
        }
        if let Some(ct) = self.external.as_ref().and_then(|e| e.ct.as_ref()) {
            let ct: HashMap<MapData, CtKey, CtEntry> =
                HashMap::try_from(Map::LruHashMap(dup(ct.map())?))
                    .map_err(std::io::Error::other)?;
            fill.push((CT_MAP, hash_fill(ct)));
        }
        if let Some(a) = self.external.as_ref().and_then(|e| e.affinity.as_ref()) {
            let a: HashMap<MapData, ClientAffinityKey, AffinityValue> =
                HashMap::try_from(Map::LruHashMap(dup(a.map())?)).map_err(std::io::Error::other)?;
            fill.push((TC_AFFINITY_MAP, hash_fill(a)));
        }
        let svc_conns = match &self.observed.svc_conns {
            Some(c) => {
                let c: PerCpuArray<MapData, u64> =
                    PerCpuArray::try_from(Map::PerCpuArray(dup(c.map())?))
                        .map_err(std::io::Error::other)?;
                let counted: PerCpuArray<MapData, u64> =
                    PerCpuArray::try_from(Map::PerCpuArray(dup(c.map())?))
                        .map_err(std::io::Error::other)?;
                let end = self.observed.svc_ids_end.clone();
                // Entries of an array are its ids with traffic.
                fill.push((
                    SVC_CONNS_MAP,
                    Box::new(move || {
                        let n = service_connections(&counted, &end).len();
                        (n, counted.len())
                    }),
                ));
                Some((c, self.observed.svc_ids_end.clone()))
            }
            None => None,
        };
        Ok(MapStats {
            fill,
            svc_conns,
            cache: Mutex::new(None),
        })
    }
}

/// How far reads of the counter array go: the ids written so far, or all of it.
fn ids_end(m: &PerCpuArray<MapData, u64>, end: &AtomicU32) -> u32 {
    match end.load(Ordering::Relaxed) {
        0 => m.len(),
        n => n.min(m.len()),
    }
}

fn service_connections(m: &PerCpuArray<MapData, u64>, end: &AtomicU32) -> BTreeMap<u32, u64> {
    (0..ids_end(m, end))
        .filter_map(|id| Some((id, m.get(&id, 0).ok()?.iter().sum::<u64>())))
        .filter(|(_, n)| *n != 0)
        .collect()
}

/// Counts one map's entries; returns (entries, kernel max_entries).
type FillFn = Box<dyn Fn() -> (usize, u32) + Send + Sync>;

fn hash_fill<K: Pod + Send + Sync + 'static, V: Pod + Send + Sync + 'static>(
    map: HashMap<MapData, K, V>,
) -> FillFn {
    Box::new(move || {
        let cap = max_entries(map.map());
        (count_keys(map.keys(), cap), cap)
    })
}

/// How often map entries are counted at most (walking an LRU map of 262144 entries is a
/// syscall per key); scrapes in between see the last count.
pub const FILL_PERIOD: Duration = Duration::from_secs(10);

/// One map's fill.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapFill {
    pub map: &'static str,
    pub entries: usize,
    pub capacity: u32,
}

/// What one scrape reads from the kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapSnapshot {
    /// Maps the planner does not track (members, affinity, reverse NAT, connection counts).
    pub fill: Vec<MapFill>,
    /// Translated connects and datagrams per service id.
    pub service_connections: BTreeMap<u32, u64>,
}

/// Handles on the maps for `/metrics`, with their own fds (see [`KernelMaps::stats`]).
pub struct MapStats {
    fill: Vec<(&'static str, FillFn)>,
    svc_conns: Option<(PerCpuArray<MapData, u64>, Arc<AtomicU32>)>,
    cache: Mutex<Option<(Instant, Vec<MapFill>)>>,
}

impl std::fmt::Debug for MapStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.fill.iter().map(|(n, _)| *n).collect();
        f.debug_struct("MapStats").field("maps", &names).finish()
    }
}

impl MapStats {
    /// Connection counts now; map fill counted at most every [`FILL_PERIOD`].
    pub fn snapshot(&self) -> MapSnapshot {
        let mut cache = self.cache.lock().expect("map stats lock");
        let fresh = cache
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() < FILL_PERIOD);
        if !fresh {
            let fill = self
                .fill
                .iter()
                .map(|(map, f)| {
                    let (entries, capacity) = f();
                    MapFill {
                        map,
                        entries,
                        capacity,
                    }
                })
                .collect();
            *cache = Some((Instant::now(), fill));
        }
        MapSnapshot {
            fill: cache.as_ref().map(|(_, f)| f.clone()).unwrap_or_default(),
            service_connections: self
                .svc_conns
                .as_ref()
                .map(|(m, end)| service_connections(m, end))
                .unwrap_or_default(),
        }
    }
}
