//! The cgroup socket hooks: connect, sendmsg, recvmsg and getpeername, both families.
//!
//! ClusterIP traffic is translated once per connect (or per datagram for unconnected
//! UDP), so packets themselves are never rewritten. What a socket dialled is remembered
//! for getpeername/recvmsg: in a direct-mapped slot per socket cookie for TCP, in the
//! `FERRY_REVNAT` LRU for UDP.

use aya_ebpf::{
    EbpfContext,
    bindings::bpf_sock_addr,
    helpers::{bpf_get_socket_cookie, bpf_set_retval},
    programs::SockAddrContext,
};
use ferry_common::{
    Addr, addr_from_v4_be, addr_is_v4,
    lb::{PROTO_TCP, PROTO_UDP, SCOPE_LOCAL_ORIGIN},
    metrics::{COUNT_REVNAT, COUNT_REVNAT_FULL, COUNT_XLATE},
    sock::{RevNatKey, RevNatValue, SockRevNat, TCP_REVNAT_SLOTS},
};

use crate::{
    lb::{Verdict, select},
    maps::{REVNAT, TCP_REVNAT, count, count_service},
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

/// The context for a store. The verifier refuses a store through a context pointer that
/// had an offset added earlier, and LLVM likes to keep the address of `user_ip4` from the
/// read for the write: a volatile reload of the base makes it compute the field address
/// anew, inside the store instruction.
#[inline(always)]
fn raw_for_write(ctx: &SockAddrContext) -> &mut bpf_sock_addr {
    // SAFETY: as in `raw`; the reload reads the context's own pointer field.
    unsafe { &mut *core::ptr::read_volatile(&ctx.sock_addr) }
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
    let sa = raw_for_write(ctx);
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
    // SAFETY: valid for cgroup sock_addr programs (5.7+).
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let sticky = if per_datagram { Some(cookie) } else { None };
    match select(ctx, vip, vport, proto, SCOPE_LOCAL_ORIGIN, sticky) {
        Verdict::Pass => ALLOW,
        Verdict::Reject => refuse(ECONNREFUSED),
        // A socket hook cannot silently lose a connect: fail it at once with "no route"
        // instead of letting the client wait for a timeout.
        Verdict::Drop => refuse(EHOSTUNREACH),
        Verdict::Forward { addr, port, svc_id } => {
            if !write_addr(ctx, family, &addr, port) {
                return ALLOW;
            }
            let t = Translation {
                cookie,
                backend: addr,
                backend_port: port,
                vip,
                vport,
                svc_id,
            };
            let stored = match proto {
                PROTO_TCP => remember_tcp(&t),
                _ => remember_in_map(&t),
            };
            if !stored {
                count(COUNT_REVNAT_FULL);
            }
            count(COUNT_XLATE);
            count_service(svc_id);
            ALLOW
        }
    }
}

/// One translated connect or datagram: what the reverse hooks need to undo it.
struct Translation {
    cookie: u64,
    /// Backend address and port, network byte order.
    backend: Addr,
    backend_port: u16,
    /// The Service address and port the socket dialled, network byte order.
    vip: Addr,
    vport: u16,
    svc_id: u32,
}

/// A TCP connect keeps its Service address in the socket cookie's slot of
/// `FERRY_TCP_REVNAT`: one plain store into a preallocated array. The LRU insert this
/// replaced (per-CPU and global list locks, a free-node pop, periodic shrinking) cost
/// about two thirds of the connect hook; socket storage cost as much (two accounted
/// allocations per socket). A socket connected again (after a failed connect)
/// overwrites its slot.
#[inline(always)]
fn remember_tcp(t: &Translation) -> bool {
    let Some(slot) = TCP_REVNAT.get_ptr_mut(t.cookie as u32 & (TCP_REVNAT_SLOTS - 1)) else {
        return false;
    };
    // SAFETY: a slot of a preallocated array. A concurrent writer of the same slot is a
    // socket created TCP_REVNAT_SLOTS sockets later; the reader checks the cookie.
    unsafe {
        *slot = SockRevNat {
            cookie: t.cookie,
            backend: t.backend,
            vip: t.vip,
            backend_port: t.backend_port,
            vport: t.vport,
            svc_id: t.svc_id,
        }
    };
    true
}

/// UDP (connect and every unconnected datagram) keeps its reverse entries in the
/// `FERRY_REVNAT` LRU, keyed by socket cookie and backend: an unconnected socket can talk
/// to several Services at once, and connected UDP recovery finds sockets through it. An
/// entry that already says the same thing is not written again (an LRU update replaces
/// the element, which costs as much as a new insert).
#[inline(always)]
fn remember_in_map(t: &Translation) -> bool {
    let key = RevNatKey {
        cookie: t.cookie,
        addr: t.backend,
        port: t.backend_port,
        _pad: [0; 6],
    };
    let value = RevNatValue {
        addr: t.vip,
        port: t.vport,
        _pad: [0; 2],
        svc_id: t.svc_id,
    };
    // SAFETY: plain data read; the lookup also marks the entry recently used.
    if let Some(old) = unsafe { REVNAT.get(&key) } {
        if *old == value {
            return true;
        }
    }
    REVNAT.insert(&key, &value, 0).is_ok()
}

/// recvmsg4/6 and getpeername4/6: show the application the Service address it dialled.
/// `tcp_slots`: look in the TCP sockets' slots first (getpeername; recvmsg hooks run for
/// UDP only).
#[inline(always)]
pub(crate) fn reverse(ctx: &SockAddrContext, family: Family, tcp_slots: bool) -> i32 {
    let addr = read_addr(ctx, family);
    let port = raw(ctx).user_port as u16;
    // SAFETY: valid for cgroup sock_addr programs.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if tcp_slots {
        if let Some(e) = TCP_REVNAT.get(cookie as u32 & (TCP_REVNAT_SLOTS - 1)) {
            let e = *e;
            if e.cookie == cookie && e.backend == addr && e.backend_port == port {
                if write_addr(ctx, family, &e.vip, e.vport) {
                    count(COUNT_REVNAT);
                }
                return ALLOW;
            }
        }
    }
    // UDP, and TCP connections made before their agent used the TCP slots.
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
