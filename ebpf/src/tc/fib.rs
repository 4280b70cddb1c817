//! Forwarding: a FIB lookup for the (translated) packet, then a redirect to the egress
//! device. A packet whose source became one of the node's addresses must not be handed
//! to the local stack (it would be dropped as a martian), so the program forwards it.

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
        TC_ACT_REDIRECT, bpf_fib_lookup, bpf_redir_neigh,
    },
    helpers::{bpf_fib_lookup as fib_lookup_helper, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};
use ferry_common::{Addr, metrics::COUNT_FIB_FAIL};

use crate::maps::count;

const SHOT: i32 = aya_ebpf::bindings::TC_ACT_SHOT as i32;

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// What a [`lookup`] found.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// A route, neighbour known (`smac`/`dmac` valid); `params.ifindex` is the egress
    /// device.
    Resolved,
    /// A route, neighbour to be resolved by the kernel; `params.ifindex` as above.
    Unresolved,
    /// The packet is larger than the route's MTU (given). With `tot_len` 0 (the skb's
    /// length checked against the device MTU) `params` still holds the route.
    TooBig(u16),
    /// No route (or forwarding is off).
    Fail,
}

/// Looks up the route of a packet from `saddr` to `daddr` as if forwarded from device
/// `iif` (the device the packet arrived on), into `params`. `tot_len` is the IP length
/// to check against the route's MTU (route and path MTU included), or 0 to check the
/// skb against the egress device's MTU (neighbour resolved only).
#[inline(always)]
pub(crate) fn lookup(
    ctx: &TcContext,
    params: &mut bpf_fib_lookup,
    v6: bool,
    saddr: &Addr,
    daddr: &Addr,
    iif: u32,
    tot_len: u16,
) -> Route {
    // SAFETY: plain C struct, all-zero is a valid value.
    *params = unsafe { core::mem::zeroed() };
    params.ifindex = iif;
    if v6 {
        params.family = AF_INET6;
        params.__bindgen_anon_3.ipv6_src = *saddr;
        params.__bindgen_anon_4.ipv6_dst = *daddr;
    } else {
        params.family = AF_INET;
        params.__bindgen_anon_3.ipv4_src = saddr[3];
        params.__bindgen_anon_4.ipv4_dst = daddr[3];
    }
    params.__bindgen_anon_1.tot_len = tot_len;
    // Flags 0: a forwarding lookup from `iif`.
    // SAFETY: params is a valid, writable bpf_fib_lookup of the size passed.
    let rc = unsafe {
        fib_lookup_helper(
            ctx.skb.skb as *mut _,
            params,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    match rc as u32 {
        BPF_FIB_LKUP_RET_SUCCESS => Route::Resolved,
        BPF_FIB_LKUP_RET_NO_NEIGH => Route::Unresolved,
        // SAFETY: the helper wrote the MTU into the union.
        BPF_FIB_LKUP_RET_FRAG_NEEDED => {
            Route::TooBig(unsafe { params.__bindgen_anon_1.mtu_result })
        }
        _ => Route::Fail,
    }
}

/// Sends the packet out of the device a [`lookup`] found. Returns the tc verdict, or
/// `None` when the redirect could not be set up.
#[inline(always)]
pub(crate) fn redirect(ctx: &TcContext, params: &bpf_fib_lookup, resolved: bool) -> Option<i32> {
    if resolved {
        set_macs(ctx, params).ok()?;
        // SAFETY: helper valid for tc programs; returns TC_ACT_REDIRECT or TC_ACT_SHOT.
        let rc = unsafe { bpf_redirect(params.ifindex, 0) };
        return (rc == TC_ACT_REDIRECT as i64).then_some(rc as i32);
    }
    // The neighbour is not resolved yet: let the kernel resolve the next hop the lookup
    // found (gateway or the destination itself) and queue the packet meanwhile.
    // SAFETY: plain C struct, all-zero is a valid value.
    let mut nh: bpf_redir_neigh = unsafe { core::mem::zeroed() };
    // SAFETY: the lookup wrote the next hop into the destination field it was given.
    unsafe {
        if params.family == AF_INET6 {
            nh.nh_family = AF_INET6 as u32;
            nh.__bindgen_anon_1.ipv6_nh = params.__bindgen_anon_4.ipv6_dst;
        } else {
            nh.nh_family = AF_INET as u32;
            nh.__bindgen_anon_1.ipv4_nh = params.__bindgen_anon_4.ipv4_dst;
        }
    }
    // SAFETY: nh is a valid bpf_redir_neigh of the size passed.
    let rc = unsafe {
        bpf_redirect_neigh(
            params.ifindex,
            &mut nh,
            core::mem::size_of::<bpf_redir_neigh>() as i32,
            0,
        )
    };
    (rc == TC_ACT_REDIRECT as i64).then_some(rc as i32)
}

/// Writes the next hop's and the egress device's MAC into the Ethernet header: directly
/// when the header is in the linear part (it always is at tc), else with a store.
#[inline(always)]
fn set_macs(ctx: &TcContext, params: &bpf_fib_lookup) -> Result<(), i64> {
    let data = ctx.data();
    if data + 12 <= ctx.data_end() {
        let eth = data as *mut u8;
        let (d, m) = (params.dmac, params.smac);
        // Byte by byte: an array copy compiles to a call of `memmove` (a byte loop).
        // SAFETY: 12 bytes checked against data_end; the verifier's prologue has made a
        // cloned skb's header private.
        unsafe {
            let mut i = 0;
            while i < 6 {
                eth.add(i).write(d[i]);
                eth.add(6 + i).write(m[i]);
                i += 1;
            }
        }
        return Ok(());
    }
    let mut macs = [0u8; 12];
    macs[..6].copy_from_slice(&params.dmac);
    macs[6..].copy_from_slice(&params.smac);
    ctx.store(0, &macs, 0)
}

/// Forwards the packet (now `saddr` -> `daddr`) as if it came in on its ingress device:
/// [`lookup`] (the device's MTU only) and [`redirect`]. No route, too big or no redirect:
/// `TC_ACT_SHOT`, counted as `fib_lookup_failed`.
#[inline(always)]
pub(crate) fn send(
    ctx: &TcContext,
    params: &mut bpf_fib_lookup,
    v6: bool,
    saddr: &Addr,
    daddr: &Addr,
) -> i32 {
    // SAFETY: valid tc context.
    let iif = unsafe { (*ctx.skb.skb).ifindex };
    let resolved = match lookup(ctx, params, v6, saddr, daddr, iif, 0) {
        Route::Resolved => true,
        Route::Unresolved => false,
        Route::TooBig(_) | Route::Fail => {
            count(COUNT_FIB_FAIL);
            return SHOT;
        }
    };
    // A match, not a closure: a closure would be a call frame of its own.
    match redirect(ctx, params, resolved) {
        Some(v) => v,
        None => {
            count(COUNT_FIB_FAIL);
            SHOT
        }
    }
}
