//! Every map, declared once. Sizes here are defaults; the agent sets the real capacity
//! at load time from its flags (`EbpfLoader::map_max_entries`).

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, PerCpuHashMap},
};
use ferry_common::{
    Meta,
    lb::{AffinityKey, AffinityValue, Backend, MemberKey, ServiceKey, ServiceValue},
    metrics::{COUNTERS_LEN, SVC_CONNS_MAX_ENTRIES},
    sock::{RevNatKey, RevNatValue},
};

#[map(name = "FERRY_META")]
pub(crate) static META: Array<Meta> = Array::with_max_entries(1, 0);

#[map(name = "FERRY_SVC")]
pub(crate) static SERVICES: HashMap<ServiceKey, ServiceValue> = HashMap::with_max_entries(65536, 0);

#[map(name = "FERRY_BACKENDS")]
pub(crate) static BACKENDS: HashMap<u32, Backend> = HashMap::with_max_entries(65536, 0);

#[map(name = "FERRY_MEMBERS")]
pub(crate) static MEMBERS: HashMap<MemberKey, u8> = HashMap::with_max_entries(65536, 0);

#[map(name = "FERRY_AFFINITY")]
pub(crate) static AFFINITY: LruHashMap<AffinityKey, AffinityValue> =
    LruHashMap::with_max_entries(65536, 0);

#[map(name = "FERRY_REVNAT")]
pub(crate) static REVNAT: LruHashMap<RevNatKey, RevNatValue> =
    LruHashMap::with_max_entries(262144, 0);

#[map(name = "FERRY_COUNTERS")]
pub(crate) static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTERS_LEN, 0);

/// Adds one to a per-reason counter.
#[inline(always)]
pub(crate) fn count(reason: u32) {
    if let Some(ptr) = COUNTERS.get_ptr_mut(reason) {
        // SAFETY: per-CPU slot, this program is the only writer on this CPU right now.
        unsafe { *ptr += 1 };
    }
}

/// Translated connects and datagrams per service id (`SVC_CONNS_MAP`). Not preallocated:
/// memory follows the Services that get traffic, not the map size.
#[map(name = "FERRY_SVC_CONNS")]
pub(crate) static SVC_CONNS: PerCpuHashMap<u32, u64> =
    PerCpuHashMap::with_max_entries(SVC_CONNS_MAX_ENTRIES, BPF_F_NO_PREALLOC);

/// Adds one to a service's connection count: one lookup and an add; the first
/// connection of a Service on a CPU inserts its entry (the other CPUs' slots start at 0).
#[inline(always)]
pub(crate) fn count_service(svc_id: u32) {
    match SVC_CONNS.get_ptr_mut(svc_id) {
        // SAFETY: per-CPU value, this program is the only writer on this CPU right now.
        Some(ptr) => unsafe { *ptr += 1 },
        None => {
            // BPF_ANY: if another CPU created the entry meanwhile, this only sets this
            // CPU's slot, which was 0.
            let _ = SVC_CONNS.insert(svc_id, 1, 0);
        }
    }
}
