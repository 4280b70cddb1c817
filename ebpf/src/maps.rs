//! Every map, declared once. Sizes here are defaults; the agent sets the real capacity
//! at load time from its flags (`EbpfLoader::map_max_entries`).

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
};
use ferry_common::{
    Meta,
    lb::{AffinityKey, AffinityValue, Backend, MemberKey, ServiceKey, ServiceValue},
    metrics::COUNTERS_LEN,
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
