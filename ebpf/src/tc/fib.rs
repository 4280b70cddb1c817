//! Forwarding: a FIB lookup for the (translated) packet, then a redirect to the egress
//! device. A packet whose source became one of the node's addresses must not be handed
//! to the local stack (it would be dropped as a martian), so the program forwards it.

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_REDIRECT, bpf_fib_lookup,
        bpf_redir_neigh,
    },
    helpers::{bpf_fib_lookup as fib_lookup_helper, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};
use ferry_common::Addr;

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// Looks up the route of a packet from `saddr` to `daddr` as if forwarded from device
/// `iif` (the device the packet arrived on), into `params`. `Some(resolved)`: a route;
/// `resolved` says whether the neighbour is known (`smac`/`dmac` valid) or the kernel
/// has to resolve it. `params.ifindex` is then the egress device.
#[inline(always)]
pub(crate) fn lookup(
    ctx: &TcContext,
    params: &mut bpf_fib_lookup,
    v6: bool,
    saddr: &Addr,
    daddr: &Addr,
    iif: u32,
) -> Option<bool> {
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
    // Flags 0: a forwarding lookup from `iif`. tot_len 0: the kernel checks the skb's
    // own length against the egress MTU.
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
        BPF_FIB_LKUP_RET_SUCCESS => Some(true),
        BPF_FIB_LKUP_RET_NO_NEIGH => Some(false),
        _ => None,
    }
}

/// Sends the packet out of the device a [`lookup`] found. Returns the tc verdict, or
/// `None` when the redirect could not be set up.
#[inline(always)]
pub(crate) fn redirect(ctx: &TcContext, params: &bpf_fib_lookup, resolved: bool) -> Option<i32> {
    if resolved {
        let mut macs = [0u8; 12];
        macs[..6].copy_from_slice(&params.dmac);
        macs[6..].copy_from_slice(&params.smac);
        ctx.store(0, &macs, 0).ok()?;
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
