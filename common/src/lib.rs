//! The map ABI shared by ferry's eBPF programs and its agent.
//!
//! Rules (DESIGN.md §3): every type is `#[repr(C)]`, `Copy`, with explicit padding and a
//! size assert; no `bool`, `Option` or enums inside map types; addresses and ports are in
//! network byte order wherever a field says so. Changing any type here changes the pinned
//! layout: bump [`LAYOUT_VERSION`].
#![no_std]

pub mod ct;
pub mod ext;
pub mod lb;
pub mod metrics;
pub mod podnet;
pub mod sock;

/// Version of the pinned map layout. Maps are pinned in `<bpffs>/v<N>/` with the version
/// also stored in [`META_MAP`]; an agent that finds another version pinned migrates
/// (fills its own maps, swaps the programs behind the pinned links, removes the old
/// maps) instead of misreading them. Layout 1 pinned maps directly in `<bpffs>`; layout 3 added the tc path's maps and counters; layout 4 the tc path's ClientIP affinity map; layout 5 made
/// the per-Service connection counters an array indexed by service id.
pub const LAYOUT_VERSION: u32 = 5;

/// Array map (1 entry, [`Meta`]) that records which layout the pins were written with.
pub const META_MAP: &str = "FERRY_META";

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    pub layout_version: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<Meta>() == 8);

#[cfg(feature = "user")]
// SAFETY: repr(C), no padding holes (explicit _pad), every bit pattern valid.
unsafe impl aya::Pod for Meta {}

/// An address as stored in every map: 16 bytes in network byte order. IPv4 addresses are
/// stored IPv4-mapped (`::ffff:a.b.c.d`), so one key type serves both families and an
/// IPv6 socket that dials `::ffff:10.96.0.10` finds the IPv4 Service.
pub type Addr = [u32; 4];

/// The third word of an IPv4-mapped address, `0x0000ffff` in network byte order.
pub const V4_MAPPED_WORD: u32 = u32::from_be(0x0000_ffff);

/// Builds the map form of an IPv4 address given in network byte order (as the kernel
/// hands it to socket hooks in `user_ip4`).
#[inline(always)]
pub const fn addr_from_v4_be(ip_be: u32) -> Addr {
    [0, 0, V4_MAPPED_WORD, ip_be]
}

/// True when the map address holds an IPv4 address.
#[inline(always)]
pub const fn addr_is_v4(addr: &Addr) -> bool {
    addr[0] == 0 && addr[1] == 0 && addr[2] == V4_MAPPED_WORD
}
