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

/// Array of one [`FlowPorts`]: the ports a tc-path flow can have on this node's side.
/// Pinned beside [`CT_MAP`] and outliving layouts and restarts like it.
pub const FLOW_PORTS_MAP: &str = "FERRY_FLOW_PORTS";

/// Words of [`FlowPorts`]: one bit per 16-bit port.
pub const FLOW_PORTS_WORDS: usize = 65536 / 64;

/// Every port a translated flow of the tc path can use on this node's side: the ports of
/// external frontends (NodePorts, externalIP and LoadBalancer ports) and of local
/// endpoints. A packet arriving for no such port (ingress destination port outside the
/// source-NAT range) or leaving from none (egress source port) is no flow of the tc
/// path: the programs pass it without a conntrack or frontend lookup. Most packets of a
/// node are such (its own clients' and pods' connections, whose local ports are
/// ephemeral). Bits are only ever set, never cleared: a flow keeps working after its
/// frontend is gone, and a stale bit costs nothing but the full lookup.
///
/// Indexed by the port as it sits in the packet (network byte order read as a `u16`),
/// so that the programs need no byte swap.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowPorts {
    pub bits: [u64; FLOW_PORTS_WORDS],
}
const _: () = assert!(core::mem::size_of::<FlowPorts>() == 8192);

impl Default for FlowPorts {
    fn default() -> Self {
        FlowPorts {
            bits: [0; FLOW_PORTS_WORDS],
        }
    }
}

impl FlowPorts {
    /// Whether `port_be` (network byte order) is set.
    #[inline(always)]
    pub fn has(&self, port_be: u16) -> bool {
        let i = port_be as usize;
        self.bits[(i >> 6) & (FLOW_PORTS_WORDS - 1)] & (1 << (i & 63)) != 0
    }

    /// Sets `port_be` (network byte order); true when it was not set before.
    pub fn insert(&mut self, port_be: u16) -> bool {
        let i = port_be as usize;
        let word = &mut self.bits[i >> 6];
        let bit = 1u64 << (i & 63);
        let new = *word & bit == 0;
        *word |= bit;
        new
    }

    /// The port (network byte order) a conntrack entry's key has on this node's side: the
    /// frontend's (destination of an original key) or the endpoint's (source of a reply
    /// key).
    pub fn port_of(key: &CtKey) -> u16 {
        if key.dir == CT_DIR_ORIGINAL {
            key.dport
        } else {
            key.sport
        }
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), explicit padding, every bit pattern is a valid value.
    unsafe impl aya::Pod for super::CtKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::CtEntry {}
    // SAFETY: as above (an array of words).
    unsafe impl aya::Pod for super::FlowPorts {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow_ports_hold_the_ports_set_and_no_other() {
        let mut p = FlowPorts::default();
        for port in [0u16, 63, 64, 30080, 65535] {
            assert!(!p.has(port.to_be()));
            assert!(p.insert(port.to_be()), "{port} was new");
            assert!(!p.insert(port.to_be()), "{port} again is not new");
            assert!(p.has(port.to_be()));
        }
        let set = (0..=u16::MAX).filter(|port| p.has(*port)).count();
        assert_eq!(set, 5);
    }

    #[test]
    fn a_conntrack_key_names_the_node_side_port() {
        let mut k = CtKey {
            sport: 40000u16.to_be(),
            dport: 30080u16.to_be(),
            dir: CT_DIR_ORIGINAL,
            ..Default::default()
        };
        assert_eq!(FlowPorts::port_of(&k), 30080u16.to_be());
        k = CtKey {
            sport: 8080u16.to_be(),
            dport: 40000u16.to_be(),
            dir: CT_DIR_REPLY,
            ..Default::default()
        };
        assert_eq!(FlowPorts::port_of(&k), 8080u16.to_be());
    }
}
