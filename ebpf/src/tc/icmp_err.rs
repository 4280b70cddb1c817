//! ICMP errors about translated flows, translated back like the flow itself, so that
//! path-MTU discovery, "port unreachable" and "time exceeded" reach the client.
//!
//! An error from the backend's side quotes the packet as ferry sent it on (client or
//! source-NAT address -> backend). Its flow is the conntrack reply entry of the quote
//! read backwards (backend -> client or source-NAT address). The error is rewritten as
//! netfilter's NAT rewrites related ICMP: the quote back to what the client sent (client
//! -> frontend: addresses, ports, the quote's IPv4 header checksum and its TCP/UDP
//! checksum when quoted), the outer header to frontend -> client, and the ICMP checksum
//! (ICMPv6: with its pseudo-header) by the sum of all changes.
//!
//! - Ingress: errors for source-NATed flows (addressed to a node address); the program
//!   forwards them to the client itself (FIB lookup and redirect).
//! - Egress: errors for flows of local endpoints without source NAT (from the endpoint,
//!   or from this node's forwarding towards it); they leave on their way already.
//!
//! Checksums are computed here (RFC 1624 incremental updates) and every store recomputes
//! the skb's `CHECKSUM_COMPLETE` sum, so the ICMP path never depends on checksum offload.

use aya_ebpf::{bindings::TC_ACT_SHOT, helpers::bpf_skb_load_bytes, programs::TcContext};
use ferry_common::{
    Addr, addr_from_v4_be,
    ct::{CT_DIR_REPLY, CT_F_SNAT},
    lb::{PROTO_TCP, PROTO_UDP},
};

use super::{
    OK, ct, fib,
    parse::{ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IP_MF, IP_OFFSET, Ipv4Hdr, Ipv6Hdr, NEXTHDR_FRAGMENT},
};
use crate::maps::{CT, SCRATCH, Scratch};

const SHOT: i32 = TC_ACT_SHOT as i32;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_ICMPV6: u8 = 58;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PKT_TOOBIG: u8 = 2;
const ICMPV6_TIME_EXCEED: u8 = 3;
/// `bpf_skb_store_bytes` flag: keep a `CHECKSUM_COMPLETE` skb's sum right.
const BPF_F_RECOMPUTE_CSUM: u64 = 1;

/// What [`classify`] found in a packet that is not a TCP/UDP flow packet.
pub(crate) enum Kind {
    /// ICMP or ICMPv6 (the type is checked later).
    IcmpError,
    /// A fragment without ports (IPv4 offset != 0, IPv6 fragment header).
    Fragment,
    Other,
}

/// One's complement sum of 16-bit word changes (`~old + new`, RFC 1624), words as they
/// are in memory (the sum does not depend on byte order as long as all words are read
/// the same way).
#[derive(Clone, Copy)]
pub(crate) struct Sum(u32);

impl Sum {
    #[inline(always)]
    pub(crate) fn new() -> Sum {
        Sum(0)
    }

    #[inline(always)]
    pub(crate) fn word(&mut self, old: u16, new: u16) {
        self.0 = fold(self.0 + (!old) as u32 + new as u32);
    }

    /// A 32-bit field (an IPv4 address as stored).
    #[inline(always)]
    pub(crate) fn word32(&mut self, old: u32, new: u32) {
        self.word(old as u16, new as u16);
        self.word((old >> 16) as u16, (new >> 16) as u16);
    }

    #[inline(always)]
    pub(crate) fn addr(&mut self, old: &Addr, new: &Addr) {
        self.word32(old[0], new[0]);
        self.word32(old[1], new[1]);
        self.word32(old[2], new[2]);
        self.word32(old[3], new[3]);
    }

    #[inline(always)]
    fn add(&mut self, other: Sum) {
        self.0 = fold(self.0 + other.0);
    }

    /// No change at all (a sum of `~x + x` folds to 0xffff, negative zero).
    #[inline(always)]
    pub(crate) fn is_zero(&self) -> bool {
        self.0 == 0 || self.0 == 0xffff
    }

    /// The sum as a checksum difference (`bpf_l3/l4_csum_replace` with size 0).
    #[inline(always)]
    pub(crate) fn value(&self) -> u32 {
        self.0
    }

    /// The checksum `csum` (as stored) after the changes summed here.
    #[inline(always)]
    pub(crate) fn apply(&self, csum: u16) -> u16 {
        !(fold((!csum) as u32 + self.0) as u16)
    }
}

#[inline(always)]
fn fold(x: u32) -> u32 {
    let x = (x & 0xffff) + (x >> 16);
    (x & 0xffff) + (x >> 16)
}

#[inline(always)]
pub(crate) fn load_v4(ctx: &TcContext, off: u32) -> Option<Ipv4Hdr> {
    let ip: Ipv4Hdr = ctx.load(off as usize).ok()?;
    (ip.ver_ihl >> 4 == 4 && ip.ver_ihl & 0x0f >= 5).then_some(ip)
}

#[inline(always)]
pub(crate) fn load_v6(ctx: &TcContext, off: u32) -> Option<Ipv6Hdr> {
    let ip: Ipv6Hdr = ctx.load(off as usize).ok()?;
    (u32::from_be(ip.ver_tc_flow) >> 28 == 6).then_some(ip)
}

/// Stores `v` at `off`, keeping a `CHECKSUM_COMPLETE` skb's sum right.
#[inline(always)]
pub(crate) fn store_csum<T>(ctx: &TcContext, off: u32, v: &T) -> Result<(), i64> {
    ctx.store(off as usize, v, BPF_F_RECOMPUTE_CSUM)
}

#[inline(always)]
fn is_v6(ctx: &TcContext) -> Option<bool> {
    // SAFETY: valid tc context.
    match u16::from_be(unsafe { (*ctx.skb.skb).protocol } as u16) {
        ETH_P_IP => Some(false),
        ETH_P_IPV6 => Some(true),
        _ => None,
    }
}

/// Sorts a packet that [`super::parse`] did not take: one small read (the callers'
/// stack is nearly all taken).
#[inline(always)]
pub(crate) fn classify(ctx: &TcContext) -> Kind {
    match is_v6(ctx) {
        Some(false) => {
            // frag_off, TTL and protocol.
            let Ok(w) = ctx.load::<[u16; 2]>(ETH_HLEN as usize + 6) else {
                return Kind::Other;
            };
            if u16::from_be(w[0]) & IP_OFFSET != 0 {
                Kind::Fragment
            } else if w[1].to_ne_bytes()[1] == IPPROTO_ICMP {
                Kind::IcmpError
            } else {
                Kind::Other
            }
        }
        Some(true) => match ctx.load::<u8>(ETH_HLEN as usize + 6) {
            Ok(NEXTHDR_FRAGMENT) => Kind::Fragment,
            Ok(IPPROTO_ICMPV6) => Kind::IcmpError,
            _ => Kind::Other,
        },
        None => Kind::Other,
    }
}

/// Loads a `T` at `off` into `dst` (scratch memory, not the stack).
#[inline(always)]
fn load_into<T>(ctx: &TcContext, off: u32, dst: *mut T) -> bool {
    // SAFETY: dst points to size_of::<T>() writable bytes of the scratch map value.
    unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb as *const _,
            off,
            dst as *mut _,
            core::mem::size_of::<T>() as u32,
        ) == 0
    }
}

enum Verdict {
    /// Not an error about a flow of this program: pass.
    Pass,
    Drop,
    /// Rewritten as `Scratch::reply` says.
    Done,
}

/// An ICMP / ICMPv6 packet: an error about a translated flow is translated back
/// (`ingress`: source-NATed flows, forwarded to the client; egress: flows of local
/// endpoints); anything else passes.
#[inline(never)]
pub(crate) fn translate(ctx: &TcContext, ingress: bool) -> i32 {
    let Some(s) = SCRATCH.get_ptr_mut(0) else {
        return OK;
    };
    // SAFETY: per-CPU value, used by this program run only.
    let s = unsafe { &mut *s };
    let Some(v6) = is_v6(ctx) else {
        return OK;
    };
    let verdict = if v6 {
        error_v6(ctx, ingress, s)
    } else {
        error_v4(ctx, ingress, s)
    };
    match verdict {
        Verdict::Pass => OK,
        Verdict::Drop => SHOT,
        Verdict::Done if !ingress => OK,
        Verdict::Done => fib::send(ctx, &mut s.fib, v6, &s.reply.nat_addr, &s.reply.snat_addr),
    }
}

/// Type, code and checksum of an ICMP / ICMPv6 header.
#[repr(C)]
#[derive(Clone, Copy)]
struct IcmpHead {
    ty: u8,
    code: u8,
    csum: u16,
}

/// The quoted packet's flow: its reply entry into `s.reply` when the error is one for
/// this program (`ingress`: source-NATed flows only; egress: the others).
#[inline(always)]
fn find_flow(
    s: &mut Scratch,
    ingress: bool,
    saddr: Addr,
    daddr: Addr,
    ports: [u16; 2],
    proto: u8,
) -> bool {
    s.rkey = ct::key(daddr, saddr, ports[1], ports[0], proto, CT_DIR_REPLY);
    // SAFETY: plain data read; the copy is taken at once.
    let Some(r) = (unsafe { CT.get(&s.rkey) }) else {
        return false;
    };
    if (r.flags & CT_F_SNAT != 0) != ingress {
        return false;
    }
    s.reply = *r;
    true
}

/// Rewrites the quoted TCP/UDP header: ports, and the checksum when it is quoted (`sum`:
/// the pseudo-header's changes). Adds the changed words of the TCP/UDP header to `icmp`.
#[inline(always)]
fn quoted_l4(
    ctx: &TcContext,
    l4_off: u32,
    proto: u8,
    ports: [u16; 2],
    new_ports: [u16; 2],
    mut sum: Sum,
    icmp: &mut Sum,
) -> Result<(), i64> {
    // The ports are ICMP payload and part of the TCP/UDP sum; the pseudo-header is only
    // in the latter (the quoted addresses are counted by the caller).
    let mut p = Sum::new();
    p.word(ports[0], new_ports[0]);
    p.word(ports[1], new_ports[1]);
    icmp.add(p);
    sum.add(p);
    let csum_off = l4_off + if proto == PROTO_TCP { 16 } else { 6 };
    if let Ok(old) = ctx.load::<u16>(csum_off as usize) {
        // A zero UDP checksum (IPv4) means "none" and stays so.
        if proto != PROTO_UDP || old != 0 {
            let mut new = sum.apply(old);
            if proto == PROTO_UDP && new == 0 {
                new = 0xffff;
            }
            icmp.word(old, new);
            store_csum(ctx, csum_off, &new)?;
        }
    }
    store_csum(ctx, l4_off, &new_ports)
}

#[inline(always)]
fn error_v4(ctx: &TcContext, ingress: bool, s: &mut Scratch) -> Verdict {
    // The headers are edited in the scratch value's quote buffer (unused on this path):
    // the stack is nearly all taken by the callers.
    let base = s.quote.as_mut_ptr();
    let (ip, inner) = (base as *mut Ipv4Hdr, base.wrapping_add(64) as *mut Ipv4Hdr);
    if !load_into(ctx, ETH_HLEN, ip) {
        return Verdict::Pass;
    }
    // SAFETY: both point into the scratch value, 64 bytes apart, 4-byte aligned.
    let (ip, inner) = unsafe { (&mut *ip, &mut *inner) };
    if ip.ver_ihl >> 4 != 4 || ip.ver_ihl & 0x0f < 5 {
        return Verdict::Pass;
    }
    if ip.proto != IPPROTO_ICMP || u16::from_be(ip.frag_off) & (IP_OFFSET | IP_MF) != 0 {
        return Verdict::Pass;
    }
    let icmp_off = ETH_HLEN + (ip.ver_ihl & 0x0f) as u32 * 4;
    let Ok(mut icmp) = ctx.load::<IcmpHead>(icmp_off as usize) else {
        return Verdict::Pass;
    };
    if icmp.ty != ICMP_DEST_UNREACH && icmp.ty != ICMP_TIME_EXCEEDED {
        return Verdict::Pass;
    }
    let in_off = icmp_off + 8;
    if !load_into(ctx, in_off, inner as *mut Ipv4Hdr) || inner.ver_ihl & 0x0f < 5 {
        return Verdict::Pass;
    }
    let proto = inner.proto;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Verdict::Pass;
    }
    let l4_off = in_off + (inner.ver_ihl & 0x0f) as u32 * 4;
    let Ok(ports) = ctx.load::<[u16; 2]>(l4_off as usize) else {
        return Verdict::Pass;
    };
    let (isrc, idst) = (addr_from_v4_be(inner.saddr), addr_from_v4_be(inner.daddr));
    if !find_flow(s, ingress, isrc, idst, ports, proto) {
        return Verdict::Pass;
    }
    let r = &s.reply;
    // The quote becomes the client's packet: client -> frontend.
    let mut addrs = Sum::new();
    addrs.word32(inner.saddr, r.snat_addr[3]);
    addrs.word32(inner.daddr, r.nat_addr[3]);
    inner.saddr = r.snat_addr[3];
    inner.daddr = r.nat_addr[3];
    let old_csum = inner.csum;
    inner.csum = addrs.apply(old_csum);
    let mut icmp_sum = addrs;
    icmp_sum.word(old_csum, inner.csum);
    if quoted_l4(
        ctx,
        l4_off,
        proto,
        ports,
        [r.snat_port, r.nat_port],
        addrs,
        &mut icmp_sum,
    )
    .is_err()
    {
        return Verdict::Drop;
    }
    // The outer header: frontend -> client, as netfilter's NAT writes it.
    let mut outer = Sum::new();
    outer.word32(ip.saddr, r.nat_addr[3]);
    outer.word32(ip.daddr, r.snat_addr[3]);
    ip.saddr = r.nat_addr[3];
    ip.daddr = r.snat_addr[3];
    if ingress {
        if ip.ttl <= 1 {
            return Verdict::Drop;
        }
        // TTL and protocol are one 16-bit word of the header checksum.
        let old = u16::from_ne_bytes([ip.ttl, ip.proto]);
        ip.ttl -= 1;
        outer.word(old, u16::from_ne_bytes([ip.ttl, ip.proto]));
    }
    ip.csum = outer.apply(ip.csum);
    icmp.csum = icmp_sum.apply(icmp.csum);
    if store_csum(ctx, in_off, inner).is_err()
        || store_csum(ctx, icmp_off, &icmp).is_err()
        || store_csum(ctx, ETH_HLEN, ip).is_err()
    {
        return Verdict::Drop;
    }
    Verdict::Done
}

#[inline(always)]
fn error_v6(ctx: &TcContext, ingress: bool, s: &mut Scratch) -> Verdict {
    let base = s.quote.as_mut_ptr();
    let (ip, inner) = (base as *mut Ipv6Hdr, base.wrapping_add(64) as *mut Ipv6Hdr);
    if !load_into(ctx, ETH_HLEN, ip) || !load_into(ctx, ETH_HLEN + 48, inner) {
        return Verdict::Pass;
    }
    // SAFETY: both point into the scratch value, 64 bytes apart, 4-byte aligned.
    let (ip, inner) = unsafe { (&mut *ip, &mut *inner) };
    if ip.nexthdr != IPPROTO_ICMPV6 || u32::from_be(inner.ver_tc_flow) >> 28 != 6 {
        return Verdict::Pass;
    }
    let icmp_off = ETH_HLEN + 40;
    let Ok(mut icmp) = ctx.load::<IcmpHead>(icmp_off as usize) else {
        return Verdict::Pass;
    };
    if icmp.ty != ICMPV6_DEST_UNREACH
        && icmp.ty != ICMPV6_PKT_TOOBIG
        && icmp.ty != ICMPV6_TIME_EXCEED
    {
        return Verdict::Pass;
    }
    let in_off = icmp_off + 8;
    let proto = inner.nexthdr;
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Verdict::Pass;
    }
    let l4_off = in_off + 40;
    let Ok(ports) = ctx.load::<[u16; 2]>(l4_off as usize) else {
        return Verdict::Pass;
    };
    if !find_flow(s, ingress, inner.saddr, inner.daddr, ports, proto) {
        return Verdict::Pass;
    }
    let r = &s.reply;
    let mut addrs = Sum::new();
    addrs.addr(&inner.saddr, &r.snat_addr);
    addrs.addr(&inner.daddr, &r.nat_addr);
    inner.saddr = r.snat_addr;
    inner.daddr = r.nat_addr;
    let mut icmp_sum = addrs;
    if quoted_l4(
        ctx,
        l4_off,
        proto,
        ports,
        [r.snat_port, r.nat_port],
        addrs,
        &mut icmp_sum,
    )
    .is_err()
    {
        return Verdict::Drop;
    }
    // The outer addresses are in the ICMPv6 pseudo-header.
    icmp_sum.addr(&ip.saddr, &r.nat_addr);
    icmp_sum.addr(&ip.daddr, &r.snat_addr);
    ip.saddr = r.nat_addr;
    ip.daddr = r.snat_addr;
    if ingress {
        if ip.hop_limit <= 1 {
            return Verdict::Drop;
        }
        ip.hop_limit -= 1;
    }
    icmp.csum = icmp_sum.apply(icmp.csum);
    if store_csum(ctx, in_off, inner).is_err()
        || store_csum(ctx, icmp_off, &icmp).is_err()
        || store_csum(ctx, ETH_HLEN, ip).is_err()
    {
        return Verdict::Drop;
    }
    Verdict::Done
}
