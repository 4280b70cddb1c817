//! Service load-balancing maps: frontends, backends, per-service membership.
//!
//! Shape (after cilium's `lb.h`): a Service frontend is addressed by
//! (address, port, protocol, scope) and a `slot`. Slot 0 holds the count, the flags and
//! the service id; slots `1..=count` hold backend ids. Backends live in their own map,
//! keyed by a `u32` id, so that one backend shared by several frontends is stored once.

use crate::Addr;

/// Hash map [`ServiceKey`] -> [`ServiceValue`].
pub const SERVICES_MAP: &str = "FERRY_SVC";
/// Hash map `u32` backend id -> [`Backend`].
pub const BACKENDS_MAP: &str = "FERRY_BACKENDS";
/// Hash map [`MemberKey`] -> `u8` (1): which backends currently belong to a service id.
/// Affinity and per-socket stickiness entries are honoured only while their backend is
/// still a member, so a removed endpoint is never chosen from a stale entry.
pub const MEMBERS_MAP: &str = "FERRY_MEMBERS";
/// LRU hash [`AffinityKey`] -> [`AffinityValue`]: ClientIP affinity and UDP stickiness.
pub const AFFINITY_MAP: &str = "FERRY_AFFINITY";

pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;

/// Traffic that starts in a local socket (cgroup socket hooks). External frontends
/// reached from inside the node use the cluster endpoints here (kube-proxy's
/// short-circuit for pod- and host-originated traffic).
pub const SCOPE_LOCAL_ORIGIN: u8 = 0;
/// Traffic that arrives from outside the node (tc hooks): externalTrafficPolicy applies.
pub const SCOPE_EXTERNAL_ORIGIN: u8 = 1;

/// Slot 0 flag: ClientIP session affinity is on (timeout in `affinity_timeout_s`).
pub const SVC_F_AFFINITY: u16 = 1 << 0;
/// Slot 0 flag: count is 0 because no endpoint exists at all: refuse (ECONNREFUSED).
pub const SVC_F_REJECT: u16 = 1 << 1;
/// Slot 0 flag: count is 0 because a Local traffic policy found no local endpoint: drop.
pub const SVC_F_DROP: u16 = 1 << 2;
/// Slot 0 flag: the backends are serving-but-terminating endpoints (fallback set).
pub const SVC_F_TERMINATING_FALLBACK: u16 = 1 << 3;
/// Slot 0 flag: internalTrafficPolicy Local shaped this backend set.
pub const SVC_F_LOCAL_POLICY: u16 = 1 << 4;
/// Slot 0 flag: the frontend is a NodePort on a node address.
pub const SVC_F_NODEPORT: u16 = 1 << 5;
/// Slot 0 flag: the frontend is an externalIP or a LoadBalancer ingress IP.
pub const SVC_F_EXTERNAL: u16 = 1 << 6;
/// Slot 0 flag (external-origin LoadBalancer frontends): only clients inside the
/// ServicePort's `FERRY_SRC_RANGES` entries may connect; others are dropped.
pub const SVC_F_SOURCE_RANGES: u16 = 1 << 7;

/// Upper bound on backends per frontend; the eBPF side never reads past it.
pub const MAX_BACKENDS_PER_SERVICE: u16 = 4096;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    /// Frontend address, network byte order (IPv4 mapped, see [`crate::Addr`]).
    pub addr: Addr,
    /// Frontend port, network byte order.
    pub port: u16,
    /// 0 = the service entry; `1..=count` = backend slots. Host byte order.
    pub slot: u16,
    /// IP protocol number ([`PROTO_TCP`], [`PROTO_UDP`]).
    pub proto: u8,
    /// [`SCOPE_LOCAL_ORIGIN`] or [`SCOPE_EXTERNAL_ORIGIN`].
    pub scope: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<ServiceKey>() == 24);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceValue {
    /// Slots `1..=count`: the backend id. Slot 0: 0.
    pub backend_id: u32,
    /// Slot 0: number of backend slots. Host byte order.
    pub count: u16,
    /// Slot 0: `SVC_F_*` flags. Host byte order.
    pub flags: u16,
    /// Slot 0: ClientIP affinity timeout in seconds. Host byte order.
    pub affinity_timeout_s: u32,
    /// Slot 0: id of the ServicePort (namespace/name:port/protocol, per family). All
    /// frontends of one ServicePort share it, so affinity holds across them.
    pub svc_id: u32,
}
const _: () = assert!(core::mem::size_of::<ServiceValue>() == 16);

/// Backend slot flag (slots `1..`, never slot 0): the slot carries its IPv4 backend's
/// address in `affinity_timeout_s` and port in `count`, so a connect needs no
/// `FERRY_BACKENDS` lookup. Backend ids are per (address, port, protocol), so the copy
/// never goes stale. Programs that do not know the flag read `backend_id` as before.
pub const SLOT_F_V4_INLINE: u16 = 1 << 15;

impl ServiceValue {
    /// The value of a backend slot (slots `1..`) pointing at `backend` (id `backend_id`).
    pub fn backend_slot(backend_id: u32, backend: &Backend) -> ServiceValue {
        if !crate::addr_is_v4(&backend.addr) {
            return ServiceValue {
                backend_id,
                ..Default::default()
            };
        }
        ServiceValue {
            backend_id,
            count: backend.port,
            flags: SLOT_F_V4_INLINE,
            affinity_timeout_s: backend.addr[3],
            svc_id: 0,
        }
    }

    /// A backend slot's inline IPv4 backend: address and port, both network byte order.
    #[inline(always)]
    pub fn inline_v4(&self) -> Option<(u32, u16)> {
        if self.flags & SLOT_F_V4_INLINE != 0 {
            Some((self.affinity_timeout_s, self.count))
        } else {
            None
        }
    }
}

/// Backend flag: the endpoint is terminating (serving fallback).
pub const BACKEND_F_TERMINATING: u8 = 1 << 0;
/// Backend flag: the endpoint runs on this node.
pub const BACKEND_F_LOCAL: u8 = 1 << 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Backend {
    /// Endpoint address, network byte order (IPv4 mapped).
    pub addr: Addr,
    /// Endpoint port, network byte order.
    pub port: u16,
    /// IP protocol number.
    pub proto: u8,
    /// `BACKEND_F_*` flags.
    pub flags: u8,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<Backend>() == 24);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemberKey {
    pub svc_id: u32,
    pub backend_id: u32,
}
const _: () = assert!(core::mem::size_of::<MemberKey>() == 8);

/// Affinity entry kind: ClientIP session affinity, keyed by the client's network
/// namespace cookie (one per pod, one for the host).
pub const AFFINITY_KIND_CLIENT: u32 = 0;
/// Affinity entry kind: an unconnected UDP socket's current backend, keyed by the socket
/// cookie, so one socket's datagrams to a Service reach one backend as a conntrack flow
/// would.
pub const AFFINITY_KIND_SOCKET: u32 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey {
    /// Network namespace cookie or socket cookie, per `kind`.
    pub client: u64,
    pub svc_id: u32,
    /// `AFFINITY_KIND_*`.
    pub kind: u32,
}
const _: () = assert!(core::mem::size_of::<AffinityKey>() == 16);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AffinityValue {
    /// `bpf_ktime_get_ns()` of the last connection or datagram that used the entry.
    pub last_used_ns: u64,
    pub backend_id: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<AffinityValue>() == 16);

#[cfg(feature = "user")]
mod pod {
    // SAFETY (all four): repr(C), explicit padding, every bit pattern is a valid value.
    unsafe impl aya::Pod for super::ServiceKey {}
    unsafe impl aya::Pod for super::ServiceValue {}
    unsafe impl aya::Pod for super::Backend {}
    unsafe impl aya::Pod for super::MemberKey {}
    unsafe impl aya::Pod for super::AffinityKey {}
    unsafe impl aya::Pod for super::AffinityValue {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv4_backend_is_copied_into_its_slot() {
        let b = Backend {
            addr: crate::addr_from_v4_be(u32::from_be_bytes([10, 244, 0, 1])),
            port: 8080u16.to_be(),
            proto: PROTO_TCP,
            ..Default::default()
        };
        let v = ServiceValue::backend_slot(7, &b);
        assert_eq!(v.backend_id, 7);
        assert_eq!(v.svc_id, 0, "slots never carry a service id");
        let (ip, port) = v.inline_v4().expect("inline");
        assert_eq!(crate::addr_from_v4_be(ip), b.addr);
        assert_eq!(port, b.port);
    }

    #[test]
    fn an_ipv6_backend_and_an_old_slot_are_looked_up() {
        let b = Backend {
            addr: [u32::from_be(0xfd00_0000), 0, 0, u32::from_be(1)],
            port: 80u16.to_be(),
            ..Default::default()
        };
        assert_eq!(ServiceValue::backend_slot(3, &b).inline_v4(), None);
        let old = ServiceValue {
            backend_id: 3,
            ..Default::default()
        };
        assert_eq!(old.inline_v4(), None);
    }
}
