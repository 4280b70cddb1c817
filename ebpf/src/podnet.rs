//! ferry's pod network fast path (`target/bpf/ferry-podnet.bpf.o`), an object of its own
//! so that the pod network can load it without Service routing's maps.
//!
//! Pod-to-pod packets normally cross the node's IP stack twice per node (forwarding,
//! netfilter, conntrack, a backlog queue per veth). These programs forward them at tc
//! instead, with the kernel's own FIB and neighbour tables deciding where they go:
//! - `ferry_podnet_from_pod`, tcx ingress of each pod's host veth: a packet to a pod CIDR
//!   (another node's: redirected to the egress device the route names, or with the
//!   overlay over IPv4 encapsulated in VXLAN here and sent to the other node's underlay
//!   address; this node's: straight into the other pod's namespace);
//! - `ferry_podnet_to_pod`, tcx ingress of the node's uplink and VXLAN device, first in
//!   line: a packet to this node's pod CIDR (or a VXLAN packet carrying one, decapsulated
//!   here) goes straight into the pod's namespace (`bpf_redirect_peer`).
//!
//! Everything else, and what the FIB does not forward, is left to the stack
//! (`TCX_NEXT`), which stays the reference: the fast path only skips work whose outcome
//! is known, and its VXLAN packets are the ones `ferry.vxlan` sends and accepts.
// Entry points must stay `pub` so the loader finds them by name.
#![allow(unreachable_pub)]
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{
        BPF_F_ADJ_ROOM_DECAP_L3_IPV4, BPF_F_ADJ_ROOM_DECAP_L3_IPV6, BPF_F_ADJ_ROOM_ENCAP_L2_ETH,
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV4, BPF_F_ADJ_ROOM_ENCAP_L4_UDP, BPF_F_NO_PREALLOC,
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_REDIRECT,
        bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, bpf_fib_lookup, bpf_redir_neigh,
    },
    helpers::{
        bpf_fib_lookup as fib_lookup_helper, bpf_get_hash_recalc, bpf_redirect_neigh,
        bpf_redirect_peer,
    },
    macros::{classifier, map},
    maps::{Array, HashMap, LpmTrie, PerCpuArray, lpm_trie::Key},
    programs::TcContext,
};
use ferry_common::podnet::{
    DEST_LOCAL, DEST_REMOTE, PODNET_COUNTERS_LEN, PODNET_FROM_POD, PODNET_TO_POD, PodnetConfig,
    PodnetDest, vtep_mac,
};

/// `TCX_NEXT`: the next program on the hook decides, or the stack when there is none.
const NEXT: i32 = -1;
const ETH_HLEN: u32 = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const IPPROTO_UDP: u8 = 17;
/// Outer IPv4 (20), UDP (8), VXLAN (8) and the inner Ethernet header (14).
const VXLAN_ENCAP: u32 = 50;
/// Where the inner IP header starts in a VXLAN packet over IPv4.
const INNER_L3: u32 = ETH_HLEN + VXLAN_ENCAP;
/// VXLAN's "valid VNI" flag (first byte of its header).
const VXLAN_FLAG_VNI: u8 = 0x08;
/// UDP source ports of VXLAN packets come from the inner flow's hash, in the kernel's
/// default range for them, so that the underlay spreads flows.
const SPORT_MIN: u32 = 32768;
const SPORT_SPAN: u32 = 61000 - 32768;
const TUNNEL_TTL: u8 = 64;

/// IPv4 pod CIDRs: this node's ([`DEST_LOCAL`]) and the other nodes' ([`DEST_REMOTE`]).
#[map(name = "FERRY_PODNET_DEST4")]
static DEST4: LpmTrie<[u8; 4], PodnetDest> = LpmTrie::with_max_entries(4096, BPF_F_NO_PREALLOC);

/// IPv6 pod CIDRs, as [`DEST4`].
#[map(name = "FERRY_PODNET_DEST6")]
static DEST6: LpmTrie<[u8; 16], PodnetDest> = LpmTrie::with_max_entries(4096, BPF_F_NO_PREALLOC);

/// Host veths of this node's pods (ifindex), the only devices a packet is handed to with
/// `bpf_redirect_peer`: the helper drops what it cannot deliver.
#[map(name = "FERRY_PODNET_VETHS")]
static VETHS: HashMap<u32, u8> = HashMap::with_max_entries(4096, 0);

/// The overlay's parameters (one entry).
#[map(name = "FERRY_PODNET_CONFIG")]
static CONFIG: Array<PodnetConfig> = Array::with_max_entries(1, 0);

/// Packets forwarded, per program ([`PODNET_FROM_POD`], [`PODNET_TO_POD`]).
#[map(name = "FERRY_PODNET_COUNTERS")]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(PODNET_COUNTERS_LEN, 0);

#[classifier]
pub fn ferry_podnet_from_pod(ctx: TcContext) -> i32 {
    let rc = from_pod(&ctx);
    count(rc, PODNET_FROM_POD)
}

#[classifier]
pub fn ferry_podnet_to_pod(ctx: TcContext) -> i32 {
    let rc = match decap(&ctx) {
        Some(rc) => rc,
        None => to_pod(&ctx),
    };
    count(rc, PODNET_TO_POD)
}

/// The destination of the IP packet at `l3` (ethertype `proto`), with `fib` filled for a
/// lookup from it.
#[inline(always)]
fn destination(
    ctx: &TcContext,
    proto: u16,
    l3: u32,
    fib: &mut bpf_fib_lookup,
) -> Option<PodnetDest> {
    match proto {
        ETH_P_IP => {
            let addrs: [u8; 8] = ctx.load(l3 as usize + 12).ok()?;
            let daddr = [addrs[4], addrs[5], addrs[6], addrs[7]];
            let dest = DEST4.get(Key::new(32, daddr))?;
            fib.family = AF_INET;
            fib.__bindgen_anon_3.ipv4_src =
                u32::from_ne_bytes([addrs[0], addrs[1], addrs[2], addrs[3]]);
            fib.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(daddr);
            Some(*dest)
        }
        ETH_P_IPV6 => {
            let addrs: [u32; 8] = ctx.load(l3 as usize + 8).ok()?;
            let mut daddr = [0u8; 16];
            for (i, w) in addrs[4..].iter().enumerate() {
                daddr[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
            }
            let dest = DEST6.get(Key::new(128, daddr))?;
            fib.family = AF_INET6;
            let mut src = [0u32; 4];
            src.copy_from_slice(&addrs[..4]);
            let mut dst = [0u32; 4];
            dst.copy_from_slice(&addrs[4..]);
            fib.__bindgen_anon_3.ipv6_src = src;
            fib.__bindgen_anon_4.ipv6_dst = dst;
            Some(*dest)
        }
        _ => None,
    }
}

/// A forwarding lookup of `fib` from device `iif` (FWD_DISABLED when forwarding is off
/// there). tot_len 0: the kernel checks the skb's own length (GSO aware) against the
/// egress MTU; anything too big goes to the stack for its ICMP error. `Some(resolved)`
/// when the packet is to be forwarded out of another device.
#[inline(always)]
fn lookup(ctx: &TcContext, fib: &mut bpf_fib_lookup, iif: u32) -> Option<bool> {
    fib.ifindex = iif;
    // SAFETY: fib is a valid, writable bpf_fib_lookup of the size passed.
    let rc = unsafe {
        fib_lookup_helper(
            ctx.skb.skb as *mut _,
            fib,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    let resolved = rc == i64::from(BPF_FIB_LKUP_RET_SUCCESS);
    if !(resolved || rc == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH)) || fib.ifindex == iif {
        return None;
    }
    Some(resolved)
}

#[inline(always)]
fn from_pod(ctx: &TcContext) -> i32 {
    let Ok(proto) = ctx.load::<u16>(12) else {
        return NEXT;
    };
    let proto = u16::from_be(proto);
    // SAFETY: plain C struct, all-zero is a valid value.
    let mut fib: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    let Some(dest) = destination(ctx, proto, ETH_HLEN, &mut fib) else {
        return NEXT;
    };
    if dest.kind == DEST_LOCAL {
        return into_pod(ctx, &mut fib, ingress_ifindex(ctx), ETH_HLEN, 0);
    }
    if dest.kind != DEST_REMOTE {
        return NEXT;
    }
    if dest.tunnel_v4 != 0 {
        return encap(ctx, proto, fib.family, dest.tunnel_v4);
    }
    let Some(_) = lookup(ctx, &mut fib, ingress_ifindex(ctx)) else {
        return NEXT;
    };
    if decrement_ttl(ctx, fib.family, ETH_HLEN).is_none() {
        return NEXT;
    }
    to_next_hop(&fib)
}

#[inline(always)]
fn to_pod(ctx: &TcContext) -> i32 {
    let Ok(proto) = ctx.load::<u16>(12) else {
        return NEXT;
    };
    // SAFETY: plain C struct, all-zero is a valid value.
    let mut fib: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    match destination(ctx, u16::from_be(proto), ETH_HLEN, &mut fib) {
        Some(d) if d.kind == DEST_LOCAL => {
            into_pod(ctx, &mut fib, ingress_ifindex(ctx), ETH_HLEN, 0)
        }
        _ => NEXT,
    }
}

/// Into a pod of this node: its veth's peer, with the pod's MAC. A pod's MAC lives as
/// long as its veth, so the neighbour entry cannot be outdated; the first packet, before
/// it exists, takes the stack's path, which resolves it. `l3`: where the IP header is;
/// with `strip` bytes of VXLAN encapsulation before it, removed once the packet is known
/// to be deliverable.
#[inline(always)]
fn into_pod(ctx: &TcContext, fib: &mut bpf_fib_lookup, iif: u32, l3: u32, strip: u32) -> i32 {
    if lookup(ctx, fib, iif) != Some(true) {
        return NEXT;
    }
    // SAFETY: plain data read.
    if unsafe { VETHS.get(&fib.ifindex) }.is_none() {
        return NEXT;
    }
    if decrement_ttl(ctx, fib.family, l3).is_none() {
        return NEXT;
    }
    let v6 = fib.family == AF_INET6;
    if strip != 0 {
        let decap = if v6 {
            BPF_F_ADJ_ROOM_DECAP_L3_IPV6
        } else {
            BPF_F_ADJ_ROOM_DECAP_L3_IPV4
        };
        if ctx
            .adjust_room(-(strip as i32), BPF_ADJ_ROOM_MAC, u64::from(decap))
            .is_err()
        {
            return NEXT;
        }
    }
    let mut eth = [0u8; 14];
    eth[..6].copy_from_slice(&fib.dmac);
    eth[6..12].copy_from_slice(&fib.smac);
    let proto = if v6 { ETH_P_IPV6 } else { ETH_P_IP };
    eth[12..].copy_from_slice(&proto.to_be_bytes());
    if ctx.store(0, &eth, 0).is_err() {
        return NEXT;
    }
    // SAFETY: helper valid at tc ingress; returns TC_ACT_REDIRECT or TC_ACT_SHOT.
    unsafe { bpf_redirect_peer(fib.ifindex, 0) as i32 }
}

/// Out through the neighbour subsystem (`bpf_redirect_neigh`) to the next hop `fib`
/// found, which resolves it and keeps its entry fresh as forwarding would (a node
/// replaced under the same address gets its new MAC).
#[inline(always)]
fn to_next_hop(fib: &bpf_fib_lookup) -> i32 {
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
        ) as i32
    }
}

/// Encapsulates the pod's packet (ethertype `proto`, `family`) in VXLAN over IPv4 to the
/// other node's underlay address `tunnel`, as `ferry.vxlan` would (same VNI, port, MACs),
/// and sends it to the underlay's next hop. The GSO flags let the kernel segment a large
/// TCP packet into VXLAN packets later.
#[inline(always)]
fn encap(ctx: &TcContext, proto: u16, family: u8, tunnel: u32) -> i32 {
    let Some(cfg) = CONFIG.get(0) else {
        return NEXT;
    };
    if cfg.underlay_v4 == 0 {
        return NEXT;
    }
    let cfg = *cfg;
    // SAFETY: plain C struct, all-zero is a valid value.
    let mut fib: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    fib.family = AF_INET;
    fib.__bindgen_anon_3.ipv4_src = cfg.underlay_v4;
    fib.__bindgen_anon_4.ipv4_dst = tunnel;
    if lookup(ctx, &mut fib, ingress_ifindex(ctx)).is_none() {
        return NEXT;
    }
    if decrement_ttl(ctx, family, ETH_HLEN).is_none() {
        return NEXT;
    }
    // SAFETY: the context's skb pointer is valid for this program run.
    let hash = unsafe { bpf_get_hash_recalc(ctx.skb.skb) };
    let inner_len = ctx.len() - ETH_HLEN;
    // BPF_F_ADJ_ROOM_ENCAP_L2(len) puts the inner L2 length in the flags' top byte.
    let flags = u64::from(
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV4 | BPF_F_ADJ_ROOM_ENCAP_L4_UDP | BPF_F_ADJ_ROOM_ENCAP_L2_ETH,
    ) | (u64::from(ETH_HLEN) << 56);
    if ctx
        .adjust_room(VXLAN_ENCAP as i32, BPF_ADJ_ROOM_MAC, flags)
        .is_err()
    {
        return NEXT;
    }
    let mut h = [0u8; VXLAN_ENCAP as usize];
    let tot_len = (inner_len + VXLAN_ENCAP) as u16;
    // Outer IPv4: no options, no DF (as the VXLAN device's default), TTL 64, UDP.
    h[0] = 0x45;
    h[2..4].copy_from_slice(&tot_len.to_be_bytes());
    h[8] = TUNNEL_TTL;
    h[9] = IPPROTO_UDP;
    h[12..16].copy_from_slice(&cfg.underlay_v4.to_ne_bytes());
    h[16..20].copy_from_slice(&tunnel.to_ne_bytes());
    let csum = ipv4_csum(&h);
    h[10..12].copy_from_slice(&csum.to_be_bytes());
    // UDP, checksum 0 (allowed over IPv4; ferry.vxlan sends none either).
    let sport = (SPORT_MIN + hash % SPORT_SPAN) as u16;
    h[20..22].copy_from_slice(&sport.to_be_bytes());
    h[22..24].copy_from_slice(&cfg.port.to_be_bytes());
    h[24..26].copy_from_slice(&(tot_len - 20).to_be_bytes());
    // VXLAN: the VNI flag, the 24-bit VNI.
    h[28] = VXLAN_FLAG_VNI;
    h[32..35].copy_from_slice(&cfg.vni.to_be_bytes()[1..]);
    // Inner Ethernet: to the other node's ferry.vxlan, from ours.
    h[36..42].copy_from_slice(&vtep_mac(tunnel.to_ne_bytes()));
    h[42..48].copy_from_slice(&cfg.mac);
    h[48..50].copy_from_slice(&proto.to_be_bytes());
    if ctx.store(ETH_HLEN as usize, &h, 0).is_err()
        || ctx.store(12, &ETH_P_IP.to_be_bytes(), 0).is_err()
    {
        // The packet is half built: it must not go anywhere.
        return aya_ebpf::bindings::TC_ACT_SHOT as i32;
    }
    to_next_hop(&fib)
}

/// A VXLAN packet from another node to one of this node's pods, arriving on the uplink:
/// decapsulated and delivered into the pod. `None` for anything else (including VXLAN
/// packets the fast path does not handle, which `ferry.vxlan` receives as before).
#[inline(always)]
fn decap(ctx: &TcContext) -> Option<i32> {
    let cfg = *CONFIG.get(0)?;
    if cfg.underlay_v4 == 0 {
        return None;
    }
    let proto: u16 = ctx.load(12).ok()?;
    if u16::from_be(proto) != ETH_P_IP {
        return None;
    }
    // SAFETY: the context's skb pointer is valid for this program run.
    if unsafe { (*ctx.skb.skb).gso_size } != 0 {
        // Aggregated by GRO: the device's own receive path splits it correctly.
        return None;
    }
    let outer: [u8; 20] = ctx.load(ETH_HLEN as usize).ok()?;
    let fragment = (outer[6] & 0x3f) != 0 || outer[7] != 0;
    if outer[0] != 0x45
        || outer[9] != IPPROTO_UDP
        || fragment
        || outer[16..20] != cfg.underlay_v4.to_ne_bytes()
    {
        return None;
    }
    let udp_vxlan: [u8; 16] = ctx.load(ETH_HLEN as usize + 20).ok()?;
    if u16::from_be_bytes([udp_vxlan[2], udp_vxlan[3]]) != cfg.port
        || udp_vxlan[8] & VXLAN_FLAG_VNI == 0
        || udp_vxlan[12..15] != cfg.vni.to_be_bytes()[1..]
    {
        return None;
    }
    let inner_proto: u16 = ctx.load(INNER_L3 as usize - 2).ok()?;
    // SAFETY: plain C struct, all-zero is a valid value.
    let mut fib: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    match destination(ctx, u16::from_be(inner_proto), INNER_L3, &mut fib) {
        Some(d) if d.kind == DEST_LOCAL => {}
        _ => return None,
    }
    // Looked up as if it came out of ferry.vxlan, as the kernel's path would.
    let rc = into_pod(ctx, &mut fib, cfg.vxlan_ifindex, INNER_L3, VXLAN_ENCAP);
    (rc != NEXT).then_some(rc)
}

/// The IPv4 header checksum of `h`'s first 20 bytes (its checksum field zero).
#[inline(always)]
fn ipv4_csum(h: &[u8; VXLAN_ENCAP as usize]) -> u16 {
    let mut sum: u32 = 0;
    let mut i = 0;
    while i < 20 {
        sum += u32::from(u16::from_be_bytes([h[i], h[i + 1]]));
        i += 2;
    }
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

#[inline(always)]
fn ingress_ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: the context's skb pointer is valid for this program run.
    unsafe { (*ctx.skb.skb).ifindex }
}

/// Decrements the TTL / hop limit of the IP header at `l3` as forwarding does. `None`
/// when it would reach zero (the stack sends "time exceeded") or the packet cannot be
/// written.
#[inline(always)]
fn decrement_ttl(ctx: &TcContext, family: u8, l3: u32) -> Option<()> {
    let l3 = l3 as usize;
    if family == AF_INET6 {
        let hop: u8 = ctx.load(l3 + 7).ok()?;
        if hop <= 1 {
            return None;
        }
        return ctx.store(l3 + 7, &(hop - 1), 0).ok();
    }
    // TTL and protocol share one 16-bit word of the checksum.
    let old: [u8; 2] = ctx.load(l3 + 8).ok()?;
    if old[0] <= 1 {
        return None;
    }
    let new = [old[0] - 1, old[1]];
    ctx.l3_csum_replace(
        l3 + 10,
        u64::from(u16::from_ne_bytes(old)),
        u64::from(u16::from_ne_bytes(new)),
        2,
    )
    .ok()?;
    ctx.store(l3 + 8, &new[0], 0).ok()
}

/// Counts a redirect of `program`; returns the verdict unchanged.
#[inline(always)]
fn count(rc: i32, program: u32) -> i32 {
    if rc == TC_ACT_REDIRECT as i32 {
        if let Some(c) = COUNTERS.get_ptr_mut(program) {
            // SAFETY: per-CPU slot, written by this CPU only.
            unsafe { *c += 1 };
        }
    }
    rc
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
