//! Every map, declared once. Sizes here are defaults; the agent sets the real capacity
//! at load time from its flags (`EbpfLoader::map_max_entries`).

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, bpf_fib_lookup},
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
};
use ferry_common::{
    Addr, Meta,
    ct::{CtEntry, CtKey, FlowPorts},
    ext::{ClientAffinityKey, MaglevTable, SnatAddrKey, SourceRangeKey},
    lb::{AffinityKey, AffinityValue, Backend, MemberKey, ServiceKey, ServiceValue},
    metrics::{COUNTERS_LEN, SVC_CONNS_MAX_ENTRIES},
    sock::{RevNatKey, RevNatValue, SockRevNat, TCP_REVNAT_SLOTS},
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

/// TCP sockets' Service address (`TCP_REVNAT_MAP`), one direct-mapped slot per socket
/// cookie: connect writes it with a plain store (no lock, no allocation).
#[map(name = "FERRY_TCP_REVNAT")]
pub(crate) static TCP_REVNAT: Array<SockRevNat> = Array::with_max_entries(TCP_REVNAT_SLOTS, 0);

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

/// Translated connects and datagrams per service id (`SVC_CONNS_MAP`): a per-CPU array
/// indexed by the id, so counting is an index, not a hash and a bucket walk.
#[map(name = "FERRY_SVC_CONNS")]
pub(crate) static SVC_CONNS: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(SVC_CONNS_MAX_ENTRIES, 0);

/// Adds one to a service's connection count. An id beyond the array (never planned so,
/// see the agent's id recycling) is not counted; the connect goes on.
#[inline(always)]
pub(crate) fn count_service(svc_id: u32) {
    if let Some(ptr) = SVC_CONNS.get_ptr_mut(svc_id) {
        // SAFETY: per-CPU slot, this program is the only writer on this CPU right now.
        unsafe { *ptr += 1 };
    }
}

/// The tc path's conntrack (`CT_MAP`): two entries per flow, LRU so that a full table
/// evicts the oldest flows instead of refusing new ones.
#[map(name = "FERRY_CT")]
pub(crate) static CT: LruHashMap<CtKey, CtEntry> = LruHashMap::with_max_entries(262144, 0);

/// The ports a tc-path flow can have on this node's side (`FLOW_PORTS_MAP`): a packet
/// for none of them is passed without a lookup. Written by the agent only.
#[map(name = "FERRY_FLOW_PORTS")]
pub(crate) static FLOW_PORTS: Array<FlowPorts> = Array::with_max_entries(1, 0);

/// Whether `port_be` may belong to a tc-path flow. Without the map's value (it always
/// has one), every port may.
#[inline(always)]
pub(crate) fn flow_port(port_be: u16) -> bool {
    match FLOW_PORTS.get(0) {
        Some(p) => p.has(port_be),
        None => true,
    }
}

/// ClientIP affinity of the tc path (`TC_AFFINITY_MAP`): client address and ServicePort
/// to the backend it is pinned to. LRU: a full table forgets the least recently used
/// clients instead of refusing new ones.
#[map(name = "FERRY_TC_AFFINITY")]
pub(crate) static TC_AFFINITY: LruHashMap<ClientAffinityKey, AffinityValue> =
    LruHashMap::with_max_entries(65536, 0);

/// Maglev tables per service id (`MAGLEV_MAP`). Values are 4 KiB: not preallocated, so
/// memory follows the ServicePorts that have external frontends.
#[map(name = "FERRY_MAGLEV")]
pub(crate) static MAGLEV: HashMap<u32, MaglevTable> =
    HashMap::with_max_entries(16384, BPF_F_NO_PREALLOC);

/// loadBalancerSourceRanges per service id (`SOURCE_RANGES_MAP`); the LPM trie type
/// always carries `BPF_F_NO_PREALLOC`.
#[map(name = "FERRY_SRC_RANGES")]
pub(crate) static SRC_RANGES: LpmTrie<SourceRangeKey, u8> = LpmTrie::with_max_entries(16384, 0);

/// Node address per (device, family) for source NAT (`SNAT_ADDRS_MAP`).
#[map(name = "FERRY_SNAT_ADDRS")]
pub(crate) static SNAT_ADDRS: HashMap<SnatAddrKey, Addr> = HashMap::with_max_entries(256, 0);

/// Bytes of the invoking packet an ICMPv6 error quotes at most: the error then fits the
/// IPv6 minimum MTU (1280 - 40 IPv6 header - 8 ICMPv6 header, RFC 4443 §2.4 (c)).
pub(crate) const ICMP_QUOTE_MAX: usize = 1232;

/// Per-CPU working space of the tc programs: what does not fit their 512-byte stack (the
/// packet an ICMP error quotes, conntrack keys and entries, FIB parameters). A tc program
/// runs to completion on its CPU (softirq or BH-disabled transmit), so one value per CPU
/// is never shared. Not pinned: nothing in it outlives one program run.
#[repr(C)]
pub(crate) struct Scratch {
    pub(crate) okey: CtKey,
    pub(crate) rkey: CtKey,
    pub(crate) entry: CtEntry,
    pub(crate) reply: CtEntry,
    /// ClientIP affinity lookup key and the entry a new pin writes (tc path).
    pub(crate) akey: ClientAffinityKey,
    pub(crate) aval: AffinityValue,
    pub(crate) fib: bpf_fib_lookup,
    /// What `fib` holds for the packet in flight: `ROUTE_*` (tc module).
    pub(crate) route: u32,
    pub(crate) quote: [u8; ICMP_QUOTE_MAX],
    /// Fragment tracking (tc `frag` module).
    pub(crate) fkey: FragKey,
    pub(crate) fval: FragValue,
}

#[map(name = "FERRY_TC_SCRATCH")]
pub(crate) static SCRATCH: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(1, 0);

/// A datagram's fragments as they arrive (tc path, `frag` module): source, destination,
/// IP identification (IPv6: fragment identification), protocol and the program that saw
/// it, so that an egress entry never serves ingress.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct FragKey {
    /// Network byte order (IPv4 mapped).
    pub(crate) saddr: Addr,
    /// Network byte order (IPv4 mapped).
    pub(crate) daddr: Addr,
    /// As on the wire (IPv4: 16 bits in the low half of the memory order).
    pub(crate) id: u32,
    pub(crate) proto: u8,
    /// `FRAG_DIR_*` (tc `frag` module).
    pub(crate) dir: u8,
    pub(crate) _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<FragKey>() == 40);

/// What the first fragment of a datagram was translated to; its later fragments get the
/// same addresses (they carry no ports).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct FragValue {
    /// Network byte order (IPv4 mapped).
    pub(crate) saddr: Addr,
    /// Network byte order (IPv4 mapped).
    pub(crate) daddr: Addr,
    /// 1 when the program forwards the datagram itself (FIB lookup and redirect).
    pub(crate) forward: u8,
    pub(crate) _pad: [u8; 7],
}
const _: () = assert!(core::mem::size_of::<FragValue>() == 40);

/// Translations of fragmented datagrams, written by a first fragment and read by the
/// later ones. Small and LRU: an entry is needed for the few milliseconds in which a
/// datagram's fragments pass. Not pinned: a restart only loses datagrams in flight.
#[map(name = "FERRY_TC_FRAGS")]
pub(crate) static FRAGS: LruHashMap<FragKey, FragValue> = LruHashMap::with_max_entries(8192, 0);
