//! Reverse translation for socket hooks: which VIP a socket dialled.

use crate::Addr;

/// LRU hash [`RevNatKey`] -> [`RevNatValue`]. Written by connect/sendmsg, read by
/// recvmsg (reply source) and getpeername.
pub const SOCK_REVNAT_MAP: &str = "FERRY_REVNAT";

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

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), explicit padding, every bit pattern is a valid value.
    unsafe impl aya::Pod for super::RevNatKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::RevNatValue {}
}
