//! Reading and writing the pinned maps.

use std::path::Path;

use aya::{
    Ebpf,
    maps::{HashMap, Map, MapData, MapError, PerCpuArray},
};
use ferry_common::{
    lb::{BACKENDS_MAP, Backend, MEMBERS_MAP, MemberKey, SERVICES_MAP, ServiceKey, ServiceValue},
    metrics::{COUNTERS_LEN, COUNTERS_MAP},
};
use tracing::warn;

use super::plan::{MapContent, Plan, fmt_endpoint, proto_name};

pub struct KernelMaps {
    services: HashMap<MapData, ServiceKey, ServiceValue>,
    backends: HashMap<MapData, u32, Backend>,
    members: HashMap<MapData, MemberKey, u8>,
    counters: PerCpuArray<MapData, u64>,
}

/// What an apply did; failures name the frontend or backend at fault.
#[derive(Debug, Default)]
pub struct ApplyReport {
    pub writes: usize,
    pub failures: Vec<String>,
}

type Named<T> = Result<T, (&'static str, MapError)>;

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
        })
    }

    /// Opens the maps an agent pinned, without loading programs (`ferry list`).
    pub fn open_pinned(dir: &Path) -> Named<KernelMaps> {
        Ok(KernelMaps {
            services: open(dir, SERVICES_MAP, Map::HashMap)?,
            backends: open(dir, BACKENDS_MAP, Map::HashMap)?,
            members: open(dir, MEMBERS_MAP, Map::HashMap)?,
            counters: open(dir, COUNTERS_MAP, Map::PerCpuArray)?,
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
        Ok(c)
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

    /// Applies a plan in its order. A frontend whose slot or backend write failed keeps
    /// its previous slot 0, so the kernel never publishes a count it cannot serve.
    /// Whole frontends that go away are removed first: nothing new refers to them, and in
    /// a full map their entries are the room the new frontends are planned into.
    pub fn apply(&mut self, plan: &Plan) -> ApplyReport {
        let mut r = ApplyReport::default();
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
