//! Reading and writing the tc path's maps: Maglev tables, source ranges, SNAT addresses,
//! the flow port filter, and the conntrack and ClientIP affinity maps' fill (for
//! `/metrics`).
//!
//! Each map is optional: an eBPF object built before the tc path has none of them, and
//! an agent without `--devices` must keep working with it.

use std::{collections::BTreeSet, path::Path};

use aya::{
    Ebpf,
    maps::{Array, HashMap, LpmTrie, Map, MapData, MapError, lpm_trie::Key},
};
use ferry_common::{
    Addr,
    ct::{CT_MAP, CtEntry, CtKey, FLOW_PORTS_MAP, FlowPorts},
    ext::{
        ClientAffinityKey, MAGLEV_MAP, MaglevTable, SNAT_ADDRS_MAP, SOURCE_RANGES_MAP, SnatAddrKey,
        SourceRangeKey, TC_AFFINITY_MAP,
    },
    lb::AffinityValue,
};

use super::external::{ExternalContent, ExternalPlan, SourceRange};

pub struct ExternalMaps {
    maglev: HashMap<MapData, u32, MaglevTable>,
    ranges: LpmTrie<MapData, SourceRangeKey, u8>,
    snat: HashMap<MapData, SnatAddrKey, Addr>,
    pub(crate) ct: Option<HashMap<MapData, CtKey, CtEntry>>,
    /// Client pins of ClientIP affinity at tc (written by the programs only).
    pub(crate) affinity: Option<HashMap<MapData, ClientAffinityKey, AffinityValue>>,
    /// The port filter (absent in objects built before it).
    flow_ports: Option<FlowPortsMap>,
}

/// `FERRY_FLOW_PORTS` and the agent's copy of its one value (the agent is its only
/// writer, so the copy is what the kernel holds).
struct FlowPortsMap {
    map: Array<MapData, FlowPorts>,
    value: Box<FlowPorts>,
}

impl FlowPortsMap {
    fn new(map: Array<MapData, FlowPorts>) -> Result<FlowPortsMap, MapError> {
        let value = Box::new(map.get(&0, 0)?);
        Ok(FlowPortsMap { map, value })
    }

    /// Sets the ports (network byte order); writes the map once when one was new.
    /// Returns how many were new.
    fn add(&mut self, ports: impl IntoIterator<Item = u16>) -> Result<usize, MapError> {
        let mut next = self.value.clone();
        let added = ports.into_iter().filter(|p| next.insert(*p)).count();
        if added > 0 {
            self.map.set(0, *next, 0)?;
            self.value = next;
        }
        Ok(added)
    }
}

impl ExternalMaps {
    /// The tc maps of a loaded object; `None` when it predates the tc path.
    pub fn from_ebpf(ebpf: &mut Ebpf) -> Option<ExternalMaps> {
        let mut take = |name: &str| ebpf.take_map(name);
        let maglev = HashMap::try_from(take(MAGLEV_MAP)?).ok()?;
        let ranges = LpmTrie::try_from(take(SOURCE_RANGES_MAP)?).ok()?;
        let snat = HashMap::try_from(take(SNAT_ADDRS_MAP)?).ok()?;
        let ct = take(CT_MAP).and_then(|m| HashMap::try_from(m).ok());
        let affinity = take(TC_AFFINITY_MAP).and_then(|m| HashMap::try_from(m).ok());
        let flow_ports = take(FLOW_PORTS_MAP)
            .and_then(|m| Array::try_from(m).ok())
            .and_then(|m| FlowPortsMap::new(m).ok());
        Some(ExternalMaps {
            maglev,
            ranges,
            snat,
            ct,
            affinity,
            flow_ports,
        })
    }

    /// The pinned tc maps (`ferry list`, `ferry explain`); `None` when not pinned.
    pub fn open_pinned(dir: &Path, ct_pin: &Path) -> Option<ExternalMaps> {
        let open = |name: &str| MapData::from_pin(dir.join(name)).ok();
        Some(ExternalMaps {
            maglev: HashMap::try_from(Map::HashMap(open(MAGLEV_MAP)?)).ok()?,
            ranges: LpmTrie::try_from(Map::LpmTrie(open(SOURCE_RANGES_MAP)?)).ok()?,
            snat: HashMap::try_from(Map::HashMap(open(SNAT_ADDRS_MAP)?)).ok()?,
            ct: MapData::from_pin(ct_pin)
                .ok()
                .and_then(|d| HashMap::try_from(Map::LruHashMap(d)).ok()),
            affinity: open(TC_AFFINITY_MAP)
                .and_then(|d| HashMap::try_from(Map::LruHashMap(d)).ok()),
            flow_ports: ct_pin
                .parent()
                .and_then(|root| MapData::from_pin(root.join(FLOW_PORTS_MAP)).ok())
                .and_then(|d| Array::try_from(Map::Array(d)).ok())
                .and_then(|m| FlowPortsMap::new(m).ok()),
        })
    }

    /// Lets the tc programs look at packets of these ports (network byte order): the
    /// ports of external frontends and local endpoints, set before the entries that use
    /// them are written. Returns how many were new (0 without the filter).
    pub fn add_flow_ports(
        &mut self,
        ports: impl IntoIterator<Item = u16>,
    ) -> Result<usize, MapError> {
        match &mut self.flow_ports {
            Some(f) => f.add(ports),
            None => Ok(0),
        }
    }

    /// The port filter as the agent last wrote it (or as pinned, for `ferry explain`);
    /// `None` without one.
    pub fn flow_ports(&self) -> Option<&FlowPorts> {
        self.flow_ports.as_ref().map(|f| &*f.value)
    }

    /// Sets the node-side port of every tracked flow (a new filter, flows of an earlier
    /// agent). Returns (flow entries read, ports new).
    pub fn seed_flow_ports(&mut self) -> Result<(usize, usize), MapError> {
        let Some(ct) = &self.ct else {
            return Ok((0, 0));
        };
        // Capped: a key deleted under the walk makes the kernel start it over.
        let ports: Vec<u16> = ct
            .keys()
            .take(1 << 24)
            .filter_map(Result::ok)
            .map(|k| FlowPorts::port_of(&k))
            .collect();
        let flows = ports.len();
        Ok((flows, self.add_flow_ports(ports)?))
    }

    pub fn read(&self) -> Result<ExternalContent, MapError> {
        let mut c = ExternalContent::default();
        for kv in self.maglev.iter() {
            let (id, table) = kv?;
            c.maglev.insert(id, Box::new(table));
        }
        for k in self.ranges.keys() {
            let k = k?;
            c.ranges
                .insert(SourceRange::from_lpm(k.prefix_len(), &k.data()));
        }
        Ok(c)
    }

    /// Upserts, in plan order. Returns the service ids whose table could not be written:
    /// their frontends' slot 0 must not be written either.
    pub fn upsert(&mut self, plan: &ExternalPlan, failures: &mut Vec<String>) -> BTreeSet<u32> {
        let mut failed = BTreeSet::new();
        for (id, table) in &plan.maglev_upserts {
            if let Err(e) = self.maglev.insert(id, **table, 0) {
                failures.push(format!("maglev table of service id {id}: {e}"));
                failed.insert(*id);
            }
        }
        for r in &plan.range_upserts {
            let (len, key) = r.lpm();
            if let Err(e) = self.ranges.insert(&Key::new(len, key), 1, 0) {
                failures.push(format!("source range of service id {}: {e}", r.svc_id));
                failed.insert(r.svc_id);
            }
        }
        failed
    }

    pub fn delete(&mut self, plan: &ExternalPlan, failures: &mut Vec<String>) {
        for r in &plan.range_deletes {
            let (len, key) = r.lpm();
            match self.ranges.remove(&Key::new(len, key)) {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(e) => failures.push(format!("source range of service id {}: {e}", r.svc_id)),
            }
        }
        for id in &plan.maglev_deletes {
            match self.maglev.remove(id) {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(e) => failures.push(format!("maglev table of service id {id}: {e}")),
            }
        }
    }

    /// Makes `FERRY_SNAT_ADDRS` hold exactly `want`; returns the writes done.
    pub fn sync_snat(&mut self, want: &[(SnatAddrKey, Addr)]) -> Result<usize, MapError> {
        let mut writes = 0;
        let current: Vec<(SnatAddrKey, Addr)> = self.snat.iter().collect::<Result<_, _>>()?;
        for (k, v) in want {
            if !current.contains(&(*k, *v)) {
                self.snat.insert(k, v, 0)?;
                writes += 1;
            }
        }
        for (k, _) in current
            .iter()
            .filter(|(k, _)| !want.iter().any(|(w, _)| w == k))
        {
            match self.snat.remove(k) {
                Ok(()) | Err(MapError::KeyNotFound) => writes += 1,
                Err(e) => return Err(e),
            }
        }
        Ok(writes)
    }

    /// The tc path's client pins (`ferry explain`); empty when the map is absent.
    pub fn affinity_entries(&self) -> Vec<(ClientAffinityKey, AffinityValue)> {
        self.affinity
            .as_ref()
            .map(|m| m.iter().filter_map(Result::ok).collect())
            .unwrap_or_default()
    }

    pub fn snat_entries(&self) -> Vec<(SnatAddrKey, Addr)> {
        self.snat.iter().filter_map(Result::ok).collect()
    }
}
