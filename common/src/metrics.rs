//! Per-reason counters written by the eBPF programs (per-CPU array, summed by the agent).

/// Per-CPU array `u64`, indexed by `COUNT_*`.
pub const COUNTERS_MAP: &str = "FERRY_COUNTERS";

/// Per-CPU array of `u64` indexed by service id (`ServiceValue::svc_id`): connects and
/// unconnected datagrams translated for that ServicePort. The agent keeps ids below the
/// array size (it recycles freed ids) and zeroes a slot before an id is reused.
pub const SVC_CONNS_MAP: &str = "FERRY_SVC_CONNS";
/// Default size of [`SVC_CONNS_MAP`]; the agent sizes it like the service map.
pub const SVC_CONNS_MAX_ENTRIES: u32 = 131072;

/// A connect or datagram was translated to a backend.
pub const COUNT_XLATE: u32 = 0;
/// Refused: the Service has no usable endpoint.
pub const COUNT_REJECT_NO_ENDPOINTS: u32 = 1;
/// Dropped: a Local traffic policy found no local endpoint.
pub const COUNT_DROP_NO_LOCAL: u32 = 2;
/// A backend slot or backend entry was missing (a write was in flight); not translated.
pub const COUNT_BACKEND_MISSING: u32 = 3;
/// ClientIP affinity reused a backend.
pub const COUNT_AFFINITY_HIT: u32 = 4;
/// A reply source or peer name was translated back to the Service address.
pub const COUNT_REVNAT: u32 = 5;
/// Affinity or stickiness entry could not be stored (map full).
pub const COUNT_AFFINITY_FULL: u32 = 6;
/// Reverse-NAT entry could not be stored (map full).
pub const COUNT_REVNAT_FULL: u32 = 7;

/// tc path: a new external flow was translated (one per conntrack entry created).
pub const COUNT_EXT_XLATE: u32 = 8;
/// tc path: an ICMP / ICMPv6 port unreachable was sent (no endpoint at all).
pub const COUNT_EXT_ICMP_UNREACH: u32 = 9;
/// tc path: dropped, the client is outside the LoadBalancer's source ranges.
pub const COUNT_SOURCE_RANGE_DROP: u32 = 10;
/// tc path: no free source-NAT port for a new flow: dropped.
pub const COUNT_SNAT_EXHAUSTED: u32 = 11;
/// tc path: the FIB lookup for a translated packet failed: dropped (NATed) or passed.
pub const COUNT_FIB_FAIL: u32 = 12;
/// tc path: a conntrack entry could not be stored: the packet was dropped.
pub const COUNT_CT_FULL: u32 = 13;
/// tc path: ClientIP affinity sent a new flow to the client's pinned backend.
pub const COUNT_EXT_AFFINITY_HIT: u32 = 14;

pub const COUNTERS_LEN: u32 = 15;

/// Names for the metrics endpoint and `ferry list`, indexed by `COUNT_*`.
pub const COUNTER_NAMES: [&str; COUNTERS_LEN as usize] = [
    "translated",
    "rejected_no_endpoints",
    "dropped_no_local_endpoints",
    "backend_missing",
    "affinity_hit",
    "reverse_translated",
    "affinity_map_full",
    "revnat_map_full",
    "external_translated",
    "external_icmp_unreachable",
    "source_range_dropped",
    "snat_ports_exhausted",
    "fib_lookup_failed",
    "conntrack_map_full",
    "external_affinity_hit",
];
