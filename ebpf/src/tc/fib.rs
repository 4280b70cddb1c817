//! Forwarding: a FIB lookup for the (translated) packet, then a redirect to the egress
//! device. A packet whose source became one of the node's addresses must not be handed
//! to the local stack (it would be dropped as a martian), so the program forwards it.
//!
//! The FIB lookup was a quarter of the ingress program's time per packet, so a resolved
//! route is reused for [`ROUTE_REUSE_NS`] by the next packets of the same path on the
//! same CPU ([`lookup_cached`]): a route or neighbour change then reaches the packets of
//! a busy flow after at most that long, as a packet already in flight would have.

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
        TC_ACT_REDIRECT, bpf_fib_lookup, bpf_redir_neigh,
    },
    helpers::{bpf_fib_lookup as fib_lookup_helper, bpf_redirect, bpf_redirect_neigh},
    macros::map,
    maps::PerCpuArray,
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

/// How long a resolved route is reused without a new lookup (read with the coarse clock,
/// so up to a tick more).
const ROUTE_REUSE_NS: u64 = 10_000_000;

/// [`lookup_cached`]'s slot for packets towards a backend.
pub(crate) const SLOT_TO_BACKEND: u32 = 0;
/// [`lookup_cached`]'s slot for replies towards a client.
pub(crate) const SLOT_TO_CLIENT: u32 = 1;

/// A resolved route as [`lookup`] found it, with what it was looked up for.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct CachedRoute {
    saddr: Addr,
    daddr: Addr,
    at_ns: u64,
    iif: u32,
    ifindex: u32,
    /// Packets up to this IP length fit (the route's MTU, or the length looked up: the
    /// kernel returns the MTU in the field that held it).
    max_len: u16,
    /// 0: empty; else the address family.
    family: u8,
    _pad: u8,
    smac: [u8; 6],
    dmac: [u8; 6],
}

/// One remembered route per CPU and direction (`SLOT_*`); not pinned.
#[map(name = "FERRY_TC_ROUTES")]
static ROUTES: PerCpuArray<CachedRoute> = PerCpuArray::with_max_entries(2, 0);

/// [`lookup`], answered from the route remembered in `slot` when it is for the same
/// addresses and ingress device, younger than [`ROUTE_REUSE_NS`] and the packet fits it.
/// Only resolved routes are remembered: every other answer takes the full lookup.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn lookup_cached(
    ctx: &TcContext,
    params: &mut bpf_fib_lookup,
    slot: u32,
    v6: bool,
    saddr: &Addr,
    daddr: &Addr,
    iif: u32,
    tot_len: u16,
    now: u64,
) -> Route {
    let Some(c) = ROUTES.get_ptr_mut(slot) else {
        return lookup(ctx, params, v6, saddr, daddr, iif, tot_len);
    };
    // SAFETY: per-CPU value, used by this program run only.
    let c = unsafe { &mut *c };
    let family = if v6 { AF_INET6 } else { AF_INET };
    if c.family == family
        && c.iif == iif
        && tot_len <= c.max_len
        && now.wrapping_sub(c.at_ns) <= ROUTE_REUSE_NS
        && c.daddr == *daddr
        && c.saddr == *saddr
    {
        params.family = family;
        params.ifindex = c.ifindex;
        copy_mac(&mut params.smac, &c.smac);
        copy_mac(&mut params.dmac, &c.dmac);
        return Route::Resolved;
    }
    let r = lookup(ctx, params, v6, saddr, daddr, iif, tot_len);
    if r == Route::Resolved {
        c.saddr = *saddr;
        c.daddr = *daddr;
        c.at_ns = now;
        c.iif = iif;
        c.ifindex = params.ifindex;
        // SAFETY: after a successful lookup the union holds the MTU, or still tot_len.
        let m = unsafe { params.__bindgen_anon_1.mtu_result };
        c.max_len = if m > tot_len { m } else { tot_len };
        c.family = family;
        copy_mac(&mut c.smac, &params.smac);
        copy_mac(&mut c.dmac, &params.dmac);
    } else {
        c.family = 0;
    }
    r
}

/// Byte by byte: an array copy compiles to a call of `memmove` (a byte loop).
#[inline(always)]
fn copy_mac(dst: &mut [u8; 6], src: &[u8; 6]) {
    let mut i = 0;
    while i < 6 {
        dst[i] = src[i];
        i += 1;
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
