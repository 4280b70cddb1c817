//! ferry's pod network fast path (`target/bpf/ferry-podnet.bpf.o`), an object of its own
//! so that the pod network can load it without Service routing's maps.
//!
//! Pod-to-pod packets normally cross the node's IP stack twice per node (forwarding,
//! netfilter, conntrack, a backlog queue per veth). These programs forward them at tc
//! instead, with the kernel's own FIB and neighbour tables deciding where they go:
//! - `ferry_podnet_from_pod`, tcx ingress of each pod's host veth: a packet to a pod CIDR
//!   (another node's: redirected to the egress device the route names; this node's:
//!   straight into the other pod's namespace);
//! - `ferry_podnet_to_pod`, tcx ingress of the node's uplink and VXLAN device, first in
//!   line: a packet to this node's pod CIDR goes straight into the pod's namespace
//!   (`bpf_redirect_peer`), skipping the backlog queue of the veth.
//!
//! Everything else, and what the FIB does not forward, is left to the stack
//! (`TCX_NEXT`), which stays the reference: the fast path only skips work whose outcome
//! is known.
// Entry points must stay `pub` so the loader finds them by name.
#![allow(unreachable_pub)]
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{
        BPF_F_NO_PREALLOC, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_REDIRECT,
        bpf_fib_lookup, bpf_redir_neigh,
    },
    helpers::{bpf_fib_lookup as fib_lookup_helper, bpf_redirect_neigh, bpf_redirect_peer},
    macros::{classifier, map},
    maps::{HashMap, LpmTrie, PerCpuArray, lpm_trie::Key},
    programs::TcContext,
};
use ferry_common::podnet::{
    DEST_LOCAL, DEST_REMOTE, PODNET_COUNTERS_LEN, PODNET_FROM_POD, PODNET_TO_POD,
};

/// `TCX_NEXT`: the next program on the hook decides, or the stack when there is none.
const NEXT: i32 = -1;
const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
/// Offsets in the IPv4 header.
const V4_TTL: usize = ETH_HLEN + 8;
const V4_CSUM: usize = ETH_HLEN + 10;
const V4_SADDR: usize = ETH_HLEN + 12;
/// Offsets in the IPv6 header.
const V6_HOPLIMIT: usize = ETH_HLEN + 7;
const V6_SADDR: usize = ETH_HLEN + 8;

/// IPv4 pod CIDRs: this node's ([`DEST_LOCAL`]) and the other nodes' ([`DEST_REMOTE`]).
#[map(name = "FERRY_PODNET_DEST4")]
static DEST4: LpmTrie<[u8; 4], u32> = LpmTrie::with_max_entries(4096, BPF_F_NO_PREALLOC);

/// IPv6 pod CIDRs, as [`DEST4`].
#[map(name = "FERRY_PODNET_DEST6")]
static DEST6: LpmTrie<[u8; 16], u32> = LpmTrie::with_max_entries(4096, BPF_F_NO_PREALLOC);

/// Host veths of this node's pods (ifindex), the only devices a packet is handed to with
/// `bpf_redirect_peer`: the helper drops what it cannot deliver.
#[map(name = "FERRY_PODNET_VETHS")]
static VETHS: HashMap<u32, u8> = HashMap::with_max_entries(4096, 0);

/// Packets forwarded, per program ([`PODNET_FROM_POD`], [`PODNET_TO_POD`]).
#[map(name = "FERRY_PODNET_COUNTERS")]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(PODNET_COUNTERS_LEN, 0);

#[classifier]
pub fn ferry_podnet_from_pod(ctx: TcContext) -> i32 {
    forward(&ctx, PODNET_FROM_POD)
}

#[classifier]
pub fn ferry_podnet_to_pod(ctx: TcContext) -> i32 {
    forward(&ctx, PODNET_TO_POD)
}

#[inline(always)]
fn forward(ctx: &TcContext, program: u32) -> i32 {
    let Ok(proto) = ctx.load::<u16>(12) else {
        return NEXT;
    };
    // SAFETY: plain C struct, all-zero is a valid value.
    let mut fib: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    let dest = match u16::from_be(proto) {
        ETH_P_IP => {
            let Ok(addrs) = ctx.load::<[u8; 8]>(V4_SADDR) else {
                return NEXT;
            };
            let mut daddr = [0u8; 4];
            daddr.copy_from_slice(&addrs[4..]);
            let Some(dest) = DEST4.get(Key::new(32, daddr)) else {
                return NEXT;
            };
            fib.family = AF_INET;
            fib.__bindgen_anon_3.ipv4_src =
                u32::from_ne_bytes([addrs[0], addrs[1], addrs[2], addrs[3]]);
            fib.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(daddr);
            *dest
        }
        ETH_P_IPV6 => {
            let Ok(addrs) = ctx.load::<[u32; 8]>(V6_SADDR) else {
                return NEXT;
            };
            let mut daddr = [0u8; 16];
            for (i, w) in addrs[4..].iter().enumerate() {
                daddr[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
            }
            let Some(dest) = DEST6.get(Key::new(128, daddr)) else {
                return NEXT;
            };
            fib.family = AF_INET6;
            let mut src = [0u32; 4];
            src.copy_from_slice(&addrs[..4]);
            let mut dst = [0u32; 4];
            dst.copy_from_slice(&addrs[4..]);
            fib.__bindgen_anon_3.ipv6_src = src;
            fib.__bindgen_anon_4.ipv6_dst = dst;
            *dest
        }
        _ => return NEXT,
    };
    // Packets from the uplink only to this node's pods; from a pod, to any pod.
    if dest != DEST_LOCAL && (program == PODNET_TO_POD || dest != DEST_REMOTE) {
        return NEXT;
    }
    // SAFETY: the context's skb pointer is valid for this program run.
    fib.ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // Flags 0: a forwarding lookup from the ingress device (FWD_DISABLED when forwarding
    // is off there). tot_len 0: the kernel checks the skb's own length (GSO aware)
    // against the egress MTU; anything too big goes to the stack for its ICMP error.
    // SAFETY: fib is a valid, writable bpf_fib_lookup of the size passed.
    let rc = unsafe {
        fib_lookup_helper(
            ctx.skb.skb as *mut _,
            &mut fib,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    let resolved = rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS);
    // Local or unreachable destinations, forwarding off: the stack's business.
    if !(resolved || rc == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH)) || fib.ifindex == fib_iif(ctx) {
        return NEXT;
    }
    let rc = if dest == DEST_LOCAL {
        // Into a pod of this node: its veth's peer, with the pod's MAC. A pod's MAC lives
        // as long as its veth, so the neighbour entry cannot be outdated; the first
        // packet, before it exists, takes the stack's path, which resolves it.
        // SAFETY: plain data read.
        if !resolved || unsafe { VETHS.get(&fib.ifindex) }.is_none() {
            return NEXT;
        }
        if decrement_ttl(ctx, fib.family).is_none() {
            return NEXT;
        }
        let mut macs = [0u8; 12];
        macs[..6].copy_from_slice(&fib.dmac);
        macs[6..].copy_from_slice(&fib.smac);
        if ctx.store(0, &macs, 0).is_err() {
            return NEXT;
        }
        // SAFETY: helper valid at tc ingress; returns TC_ACT_REDIRECT or TC_ACT_SHOT.
        unsafe { bpf_redirect_peer(fib.ifindex, 0) }
    } else {
        // To another node: through the neighbour subsystem (bpf_redirect_neigh), which
        // resolves the next hop and keeps its entry fresh as forwarding would (a node
        // replaced under the same address gets its new MAC).
        if decrement_ttl(ctx, fib.family).is_none() {
            return NEXT;
        }
        // SAFETY: plain C struct, all-zero is a valid value.
        let mut nh: bpf_redir_neigh = unsafe { core::mem::zeroed() };
        // SAFETY: the lookup wrote the next hop into the destination field.
        unsafe {
            if fib.family == AF_INET6 {
                nh.nh_family = u32::from(AF_INET6);
                nh.__bindgen_anon_1.ipv6_nh = fib.__bindgen_anon_4.ipv6_dst;
            } else {
                nh.nh_family = u32::from(AF_INET);
                nh.__bindgen_anon_1.ipv4_nh = fib.__bindgen_anon_4.ipv4_dst;
            }
        }
        // SAFETY: nh is a valid bpf_redir_neigh of the size passed.
        unsafe {
            bpf_redirect_neigh(
                fib.ifindex,
                &mut nh,
                core::mem::size_of::<bpf_redir_neigh>() as i32,
                0,
            )
        }
    };
    if rc == i64::from(TC_ACT_REDIRECT) {
        count(program);
    }
    rc as i32
}

#[inline(always)]
fn fib_iif(ctx: &TcContext) -> u32 {
    // SAFETY: the context's skb pointer is valid for this program run.
    unsafe { (*ctx.skb.skb).ifindex }
}

/// Decrements the TTL / hop limit as forwarding does. `None` when it would reach zero
/// (the stack sends "time exceeded") or the packet cannot be written.
#[inline(always)]
fn decrement_ttl(ctx: &TcContext, family: u8) -> Option<()> {
    if family == AF_INET6 {
        let hop: u8 = ctx.load(V6_HOPLIMIT).ok()?;
        if hop <= 1 {
            return None;
        }
        return ctx.store(V6_HOPLIMIT, &(hop - 1), 0).ok();
    }
    // TTL and protocol share one 16-bit word of the checksum.
    let old: [u8; 2] = ctx.load(V4_TTL).ok()?;
    if old[0] <= 1 {
        return None;
    }
    let new = [old[0] - 1, old[1]];
    ctx.l3_csum_replace(
        V4_CSUM,
        u64::from(u16::from_ne_bytes(old)),
        u64::from(u16::from_ne_bytes(new)),
        2,
    )
    .ok()?;
    ctx.store(V4_TTL, &new[0], 0).ok()
}

#[inline(always)]
fn count(program: u32) {
    if let Some(c) = COUNTERS.get_ptr_mut(program) {
        // SAFETY: per-CPU slot, written by this CPU only.
        unsafe { *c += 1 };
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

/// The license the kernel checks before it allows GPL-only helpers.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
