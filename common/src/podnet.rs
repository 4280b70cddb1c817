//! The pod network fast path's maps (`ferry-podnet.bpf.o`): pod CIDR tries, the pods'
//! host veths and per-program counters.

/// `FERRY_PODNET_DEST4/6` value: a pod CIDR of this node.
pub const DEST_LOCAL: u32 = 1;
/// `FERRY_PODNET_DEST4/6` value: a pod CIDR of another node.
pub const DEST_REMOTE: u32 = 2;

/// `FERRY_PODNET_COUNTERS` slot: packets `ferry_podnet_from_pod` forwarded.
pub const PODNET_FROM_POD: u32 = 0;
/// `FERRY_PODNET_COUNTERS` slot: packets `ferry_podnet_to_pod` forwarded.
pub const PODNET_TO_POD: u32 = 1;
pub const PODNET_COUNTERS_LEN: u32 = 2;

/// `FERRY_PODNET_DEST4/6` value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodnetDest {
    /// [`DEST_LOCAL`] or [`DEST_REMOTE`].
    pub kind: u32,
    /// With the overlay: the other node's IPv4 underlay address (network order, as its
    /// octets in memory), which the fast path encapsulates to itself; 0 without.
    pub tunnel_v4: u32,
}
const _: () = assert!(core::mem::size_of::<PodnetDest>() == 8);

/// `FERRY_PODNET_CONFIG[0]`: what the fast path needs to speak VXLAN like `ferry.vxlan`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodnetConfig {
    /// This node's IPv4 underlay address (as [`PodnetDest::tunnel_v4`]); 0: no overlay,
    /// or one over IPv6, which the fast path leaves to the device.
    pub underlay_v4: u32,
    /// `ferry.vxlan`'s ifindex (decapsulated packets are looked up as arriving there).
    pub vxlan_ifindex: u32,
    /// The VNI.
    pub vni: u32,
    /// The UDP port, host order.
    pub port: u16,
    /// `ferry.vxlan`'s MAC (the inner source MAC).
    pub mac: [u8; 6],
}
const _: () = assert!(core::mem::size_of::<PodnetConfig>() == 20);

/// The MAC of another node's `ferry.vxlan`: `0a:fe` and its underlay address's last four
/// bytes (the agent gives every VXLAN device this MAC).
pub const fn vtep_mac(last4: [u8; 4]) -> [u8; 6] {
    [0x0a, 0xfe, last4[0], last4[1], last4[2], last4[3]]
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), no padding (two u32), every bit pattern is a valid value.
    unsafe impl aya::Pod for super::PodnetDest {}
    // SAFETY: repr(C), no padding (u32 x3, u16, [u8; 6]), every bit pattern is valid.
    unsafe impl aya::Pod for super::PodnetConfig {}
}
