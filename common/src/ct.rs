//! The tc path's connection tracker: one entry per direction of a translated flow.
//!
//! A flow from an external client to a frontend has two entries in [`CT_MAP`]:
//! - `CT_DIR_ORIGINAL`, keyed by the packet as the client sent it (client -> frontend):
//!   where to send it (backend) and, when source NAT applies, the source to write.
//! - `CT_DIR_REPLY`, keyed by the reply as the backend sends it (backend -> client, or
//!   backend -> SNAT address when source NAT applies): the frontend to write back as the
//!   source and, with source NAT, the client to write back as the destination.
//!
//! The map is pinned outside the versioned layout directory, like the socket state, so
//! that flows survive agent restarts and layout migrations.

use crate::Addr;

/// LRU hash [`CtKey`] -> [`CtEntry`].
pub const CT_MAP: &str = "FERRY_CT";

/// The packet as the client sent it (client -> frontend).
pub const CT_DIR_ORIGINAL: u8 = 0;
/// The packet as the backend sends its reply.
pub const CT_DIR_REPLY: u8 = 1;

/// Entry flag: the flow's source was rewritten to a node address ([`CtEntry::snat_addr`]).
pub const CT_F_SNAT: u8 = 1 << 0;
/// Entry flag: the backend runs on this node.
pub const CT_F_LOCAL_BACKEND: u8 = 1 << 1;

/// TCP flags seen on the flow ([`CtEntry::tcp_seen`]), for state-aware timeouts.
pub const CT_TCP_SEEN_SYN: u8 = 1 << 0;
/// A packet in the reply direction was seen (the handshake got an answer).
pub const CT_TCP_SEEN_REPLY: u8 = 1 << 1;
/// A FIN was seen in either direction.
pub const CT_TCP_SEEN_FIN: u8 = 1 << 2;
/// An RST was seen in either direction.
pub const CT_TCP_SEEN_RST: u8 = 1 << 3;

const SEC: u64 = 1_000_000_000;
/// TCP flow that has not been answered yet (SYN sent): as nf_conntrack's SYN_SENT, 2 min.
pub const CT_TIMEOUT_TCP_SYN_NS: u64 = 120 * SEC;
/// TCP flow that got a reply and is not closing. nf_conntrack keeps established flows
/// for 5 days; ferry keeps them 6 hours (an idle flow beyond that has to reconnect, as
/// with Cilium's default), which bounds the table's stale entries.
pub const CT_TIMEOUT_TCP_ESTABLISHED_NS: u64 = 6 * 3600 * SEC;
/// TCP flow after a FIN or RST: as nf_conntrack's TIME_WAIT / CLOSE, 10 s.
pub const CT_TIMEOUT_TCP_CLOSING_NS: u64 = 10 * SEC;
/// UDP flow: nf_conntrack uses 30 s (120 s once both directions were seen); ferry uses
/// 60 s for both.
pub const CT_TIMEOUT_UDP_NS: u64 = 60 * SEC;

/// First and last source port used for source NAT. Outside the default ephemeral range
/// (32768-60999) and the NodePort range (30000-32767), so a NATed flow never takes the
/// 4-tuple of a connection that a local socket makes.
pub const SNAT_PORT_MIN: u16 = 61000;
pub const SNAT_PORT_MAX: u16 = 65535;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtKey {
    /// Source address of the packet, network byte order (IPv4 mapped).
    pub saddr: Addr,
    /// Destination address of the packet, network byte order (IPv4 mapped).
    pub daddr: Addr,
    /// Source port, network byte order.
    pub sport: u16,
    /// Destination port, network byte order.
    pub dport: u16,
    /// IP protocol number.
    pub proto: u8,
    /// [`CT_DIR_ORIGINAL`] or [`CT_DIR_REPLY`].
    pub dir: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<CtKey>() == 40);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtEntry {
    /// `bpf_ktime_get_ns()` of the last packet in either direction (written on the
    /// original entry; the reply path refreshes the original entry too).
    pub last_seen_ns: u64,
    /// Original: the backend address to write as destination. Reply: the frontend
    /// address to write as source. Network byte order (IPv4 mapped).
    pub nat_addr: Addr,
    /// Original: the node address written as source (with [`CT_F_SNAT`]). Reply: the
    /// client address to write back as destination (with [`CT_F_SNAT`]). Network byte
    /// order (IPv4 mapped).
    pub snat_addr: Addr,
    /// The backend chosen for the flow (`FERRY_BACKENDS` id).
    pub backend_id: u32,
    /// The ServicePort's id (`ServiceValue::svc_id`).
    pub svc_id: u32,
    /// Original: backend port. Reply: frontend port. Network byte order.
    pub nat_port: u16,
    /// Original: SNAT source port. Reply: client port. Network byte order.
    pub snat_port: u16,
    /// `CT_F_*`.
    pub flags: u8,
    /// `CT_TCP_SEEN_*` (original entry).
    pub tcp_seen: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<CtEntry>() == 56);

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), explicit padding, every bit pattern is a valid value.
    unsafe impl aya::Pod for super::CtKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::CtEntry {}
}
