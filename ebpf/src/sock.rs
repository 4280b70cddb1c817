//! The cgroup socket hooks: connect, sendmsg, recvmsg and getpeername, both families.
//!
//! ClusterIP traffic is translated once per connect (or per datagram for unconnected
//! UDP), so packets themselves are never rewritten.

use aya_ebpf::{
    EbpfContext,
    bindings::bpf_sock_addr,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval},
    programs::SockAddrContext,
};
use ferry_common::{
    Addr, addr_from_v4_be, addr_is_v4,
    lb::{PROTO_TCP, PROTO_UDP, SCOPE_LOCAL_ORIGIN},
    metrics::{COUNT_REVNAT, COUNT_REVNAT_FULL, COUNT_XLATE},
    sock::{RevNatKey, RevNatValue},
};

use crate::{
    lb::{Client, Verdict, select},
    maps::{REVNAT, count, count_service},
};

const SOCK_STREAM: u32 = 1;
const SOCK_DGRAM: u32 = 2;
const ECONNREFUSED: i32 = 111;
const EHOSTUNREACH: i32 = 113;

/// Allow the syscall (with whatever the program wrote into the context).
pub(crate) const ALLOW: i32 = 1;
/// Refuse the syscall; the error is what `bpf_set_retval` set (EPERM otherwise).
pub(crate) const DENY: i32 = 0;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    V4,
    V6,
}

#[inline(always)]
fn raw(ctx: &SockAddrContext) -> &mut bpf_sock_addr {
    // SAFETY: the kernel hands every sock_addr program a valid context for its run.
    unsafe { &mut *ctx.sock_addr }
}

#[inline(always)]
fn read_addr(ctx: &SockAddrContext, family: Family) -> Addr {
    let sa = raw(ctx);
    match family {
        Family::V4 => addr_from_v4_be(sa.user_ip4),
        // Word by word: the verifier allows only 4-byte access to user_ip6.
        Family::V6 => [
            sa.user_ip6[0],
            sa.user_ip6[1],
            sa.user_ip6[2],
            sa.user_ip6[3],
        ],
    }
}

/// Writes a backend address into the context. An IPv6 backend cannot be reached from an
/// IPv4 socket: returns false and leaves the context untouched.
#[inline(always)]
fn write_addr(ctx: &SockAddrContext, family: Family, addr: &Addr, port_be: u16) -> bool {
    let sa = raw(ctx);
    match family {
        Family::V4 => {
            if !addr_is_v4(addr) {
                return false;
            }
            sa.user_ip4 = addr[3];
        }
        Family::V6 => {
            sa.user_ip6[0] = addr[0];
            sa.user_ip6[1] = addr[1];
            sa.user_ip6[2] = addr[2];
            sa.user_ip6[3] = addr[3];
        }
    }
    sa.user_port = port_be as u32;
    true
}

#[inline(always)]
fn proto_of(ctx: &SockAddrContext) -> Option<u8> {
    match raw(ctx).type_ {
        SOCK_STREAM => Some(PROTO_TCP),
        SOCK_DGRAM => Some(PROTO_UDP),
        _ => None,
    }
}

#[inline(always)]
fn refuse(errno: i32) -> i32 {
    // SAFETY: allowed for connect and sendmsg hooks (kernel 5.18+); sets the syscall error.
    unsafe { bpf_set_retval(-errno) };
    DENY
}

/// connect4/6 and sendmsg4/6: translate a Service address to a backend.
#[inline(always)]
pub(crate) fn translate(ctx: &SockAddrContext, family: Family, per_datagram: bool) -> i32 {
    let Some(proto) = proto_of(ctx) else {
        return ALLOW;
    };
    if per_datagram && proto != PROTO_UDP {
        return ALLOW;
    }
    let vip = read_addr(ctx, family);
    let vport = raw(ctx).user_port as u16;
    // SAFETY: both helpers are valid for cgroup sock_addr programs (5.7+).
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let client = Client {
        netns,
        sticky_socket: if per_datagram { Some(cookie) } else { None },
    };
    match select(ctx, vip, vport, proto, SCOPE_LOCAL_ORIGIN, &client) {
        Verdict::Pass => ALLOW,
        Verdict::Reject => refuse(ECONNREFUSED),
        // A socket hook cannot silently lose a connect: fail it at once with "no route"
        // instead of letting the client wait for a timeout.
        Verdict::Drop => refuse(EHOSTUNREACH),
        Verdict::Forward { backend, svc_id } => {
            if !write_addr(ctx, family, &backend.addr, backend.port) {
                return ALLOW;
            }
            let key = RevNatKey {
                cookie,
                addr: backend.addr,
                port: backend.port,
                _pad: [0; 6],
            };
            let value = RevNatValue {
                addr: vip,
                port: vport,
                _pad: [0; 2],
                svc_id,
            };
            if REVNAT.insert(&key, &value, 0).is_err() {
                count(COUNT_REVNAT_FULL);
            }
            count(COUNT_XLATE);
            count_service(svc_id);
            ALLOW
        }
    }
}

/// recvmsg4/6 and getpeername4/6: show the application the Service address it dialled.
#[inline(always)]
pub(crate) fn reverse(ctx: &SockAddrContext, family: Family) -> i32 {
    let addr = read_addr(ctx, family);
    let port = raw(ctx).user_port as u16;
    // SAFETY: valid for cgroup sock_addr programs.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let key = RevNatKey {
        cookie,
        addr,
        port,
        _pad: [0; 6],
    };
    // SAFETY: plain data read.
    if let Some(v) = unsafe { REVNAT.get(&key) } {
        let (vaddr, vport) = (v.addr, v.port);
        if write_addr(ctx, family, &vaddr, vport) {
            count(COUNT_REVNAT);
        }
    }
    ALLOW
}
