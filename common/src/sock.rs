//! Reverse translation for socket hooks: which VIP a socket dialled.

use crate::Addr;

/// LRU hash [`RevNatKey`] -> [`RevNatValue`]. Written by UDP connect and sendmsg, read by
/// recvmsg (reply source) and getpeername. TCP connects use [`TCP_REVNAT_MAP`]; this
/// map still answers for TCP connections made before that (an agent upgrade).
pub const SOCK_REVNAT_MAP: &str = "FERRY_REVNAT";

/// Array `u32` slot -> [`SockRevNat`] ([`TCP_REVNAT_SLOTS`] entries): the Service each
/// TCP socket's connect was translated from, read by getpeername. A socket's slot is its
/// cookie modulo the size (direct-mapped): writing it is a plain store, with no lock, no
/// allocation and nothing to free. A slot is reused by the socket created
/// [`TCP_REVNAT_SLOTS`] sockets later (cookies are consecutive), which is when the LRU
/// this replaced would have evicted the entry of a socket that never called getpeername.
/// The entry carries the cookie, so a reused slot never answers for another socket.
pub const TCP_REVNAT_MAP: &str = "FERRY_TCP_REVNAT";
/// Size of [`TCP_REVNAT_MAP`], a power of two (the slot is `cookie & (size - 1)`).
pub const TCP_REVNAT_SLOTS: u32 = 1 << 18;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RevNatKey {
    /// Socket cookie (`bpf_get_socket_cookie`).
    pub cookie: u64,
    /// Backend address the socket was sent to, network byte order (IPv4 mapped).
    pub addr: Addr,
    /// Backend port, network byte order.
    pub port: u16,
    pub _pad: [u8; 6],
}
const _: () = assert!(core::mem::size_of::<RevNatKey>() == 32);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RevNatValue {
    /// The Service address the application dialled, network byte order (IPv4 mapped).
    pub addr: Addr,
    /// The Service port, network byte order.
    pub port: u16,
    pub _pad: [u8; 2],
    pub svc_id: u32,
}
const _: () = assert!(core::mem::size_of::<RevNatValue>() == 24);

/// A TCP socket's translation ([`TCP_REVNAT_MAP`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRevNat {
    /// Socket cookie of the socket this slot speaks for (0: empty).
    pub cookie: u64,
    /// Backend address the socket was connected to, network byte order (IPv4 mapped):
    /// getpeername translates back only while the peer is still this backend.
    pub backend: Addr,
    /// The Service address the application dialled, network byte order (IPv4 mapped).
    pub vip: Addr,
    /// Backend port, network byte order.
    pub backend_port: u16,
    /// The Service port, network byte order.
    pub vport: u16,
    pub svc_id: u32,
}
const _: () = assert!(core::mem::size_of::<SockRevNat>() == 48);

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), explicit padding, every bit pattern is a valid value.
    unsafe impl aya::Pod for super::RevNatKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::RevNatValue {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::SockRevNat {}
}
