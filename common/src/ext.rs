//! Maps that only the tc path (traffic from outside the node) reads: Maglev tables,
//! loadBalancerSourceRanges and the node addresses used for source NAT.

use crate::Addr;

/// Hash map `u32` service id -> [`MaglevTable`]: the external-origin backend set of a
/// ServicePort as a Maglev lookup table. Every external frontend of one ServicePort
/// (NodePorts, externalIPs, LB IPs) shares one externalTrafficPolicy, hence one set.
pub const MAGLEV_MAP: &str = "FERRY_MAGLEV";

/// Entries per Maglev table: a prime, at least ~100× the typical backend count, so that
/// a backend change moves few of the other backends' flows (Maglev paper, §3.4).
pub const MAGLEV_TABLE_SIZE: usize = 1021;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaglevTable {
    /// Backend ids (`FERRY_BACKENDS`), indexed by `flow_hash % MAGLEV_TABLE_SIZE`.
    pub backend_ids: [u32; MAGLEV_TABLE_SIZE],
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<MaglevTable>() == 4088);

/// LPM trie [`SourceRangeKey`] -> `u8` (1): the `loadBalancerSourceRanges` (plus the
/// node's own addresses, as kube-proxy allows them) of each ServicePort whose LB
/// frontends carry `SVC_F_SOURCE_RANGES`. The trie key's prefix length counts the 32
/// bits of `svc_id` plus the address bits: `32 + 96 + len` for an IPv4 CIDR (mapped),
/// `32 + len` for IPv6.
pub const SOURCE_RANGES_MAP: &str = "FERRY_SRC_RANGES";

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SourceRangeKey {
    /// Service id, big-endian (the trie compares bytes in order).
    pub svc_id_be: u32,
    /// Client address or CIDR base, network byte order (IPv4 mapped).
    pub addr: Addr,
}
const _: () = assert!(core::mem::size_of::<SourceRangeKey>() == 20);

/// Hash map [`SnatAddrKey`] -> [`crate::Addr`]: the node address written as the source
/// of a flow that leaves through device `ifindex` with source NAT (externalTrafficPolicy
/// Cluster to an endpoint on another node).
pub const SNAT_ADDRS_MAP: &str = "FERRY_SNAT_ADDRS";

pub const FAMILY_V4: u32 = 4;
pub const FAMILY_V6: u32 = 6;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SnatAddrKey {
    pub ifindex: u32,
    /// [`FAMILY_V4`] or [`FAMILY_V6`].
    pub family: u32,
}
const _: () = assert!(core::mem::size_of::<SnatAddrKey>() == 8);

/// LRU hash [`ClientAffinityKey`] -> [`crate::lb::AffinityValue`]: ClientIP session
/// affinity of traffic that arrives at tc, keyed by the client address the node sees.
/// The socket hooks key their affinity by network namespace (`FERRY_AFFINITY`); a
/// packet from outside the node has no namespace here, only its source address.
pub const TC_AFFINITY_MAP: &str = "FERRY_TC_AFFINITY";

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ClientAffinityKey {
    /// The client's address as the packet arrives (before any source NAT), network
    /// byte order (IPv4 mapped).
    pub client: Addr,
    /// The ServicePort's id (`ServiceValue::svc_id`): all its external frontends share
    /// one entry per client, as kube-proxy's per-endpoint source-address sets do.
    pub svc_id: u32,
}
const _: () = assert!(core::mem::size_of::<ClientAffinityKey>() == 20);

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), explicit padding, every bit pattern is a valid value.
    unsafe impl aya::Pod for super::MaglevTable {}
    // SAFETY: as above (no padding: five u32 words).
    unsafe impl aya::Pod for super::ClientAffinityKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::SourceRangeKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::SnatAddrKey {}
}

/// The flow hash that picks a Maglev entry: a function of the packet's 5-tuple only, so
/// that every node and every agent generation maps a flow to the same table entry.
/// Shared by the tc program and the agent (`ferry explain`). Addresses and ports as in
/// the maps (network byte order, IPv4 mapped).
#[inline(always)]
pub fn flow_hash(saddr: &Addr, daddr: &Addr, sport: u16, dport: u16, proto: u8) -> u32 {
    // A 32-bit mix in the style of murmur3's finaliser over each word: no table, no
    // loop the verifier has to bound beyond these fixed 10 rounds.
    let mut h: u32 = 0x9e37_79b9 ^ proto as u32;
    let mut i = 0;
    while i < 4 {
        h = mix(h, saddr[i]);
        h = mix(h, daddr[i]);
        i += 1;
    }
    h = mix(h, ((sport as u32) << 16) | dport as u32);
    fmix(h)
}

#[inline(always)]
const fn mix(h: u32, k: u32) -> u32 {
    let k = k
        .wrapping_mul(0xcc9e_2d51)
        .rotate_left(15)
        .wrapping_mul(0x1b87_3593);
    (h ^ k)
        .rotate_left(13)
        .wrapping_mul(5)
        .wrapping_add(0xe654_6b64)
}

#[inline(always)]
const fn fmix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}
