//! Address and port rewriting with incremental checksum updates.
//!
//! The kernel helpers keep the skb's checksum state right (CHECKSUM_PARTIAL packets from
//! local veths, CHECKSUM_COMPLETE from NICs): `bpf_l3_csum_replace` for the IPv4 header,
//! `bpf_l4_csum_replace` with `BPF_F_PSEUDO_HDR` for the TCP/UDP pseudo-header fields
//! and `BPF_F_MARK_MANGLED_0` for UDP (a zero IPv4 UDP checksum means "none" and stays
//! zero; a computed zero is written as 0xffff).

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    helpers::bpf_csum_diff,
    programs::TcContext,
};
use ferry_common::{Addr, lb::PROTO_UDP};

use super::{
    icmp_err::Sum,
    parse::{ETH_HLEN, Pkt},
};

/// `bpf_l4_csum_replace` flag (Linux 6.16+): the packet is IPv6, so a pseudo-header
/// change must not be folded into a CHECKSUM_COMPLETE skb's `csum` (the IPv6 header has
/// no checksum of its own to cancel it). Older kernels reject it; see [`l4_diff`].
const BPF_F_IPV6: u64 = 1 << 7;
const EINVAL: i64 = 22;

/// Offsets of the source and destination address in the IPv4 and IPv6 headers.
const V4_SADDR: u32 = ETH_HLEN + 12;
const V4_DADDR: u32 = ETH_HLEN + 16;
const V4_CSUM: u32 = ETH_HLEN + 10;
const V4_TTL: u32 = ETH_HLEN + 8;
const V6_HOP_LIMIT: u32 = ETH_HLEN + 7;
const V6_SADDR: u32 = ETH_HLEN + 8;
const V6_DADDR: u32 = ETH_HLEN + 24;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Src,
    Dst,
}

#[inline(always)]
fn l4_flags(pkt: &Pkt) -> u64 {
    if pkt.proto == PROTO_UDP {
        BPF_F_MARK_MANGLED_0 as u64
    } else {
        0
    }
}

/// Writes one address of the packet (the family is the packet's).
#[inline(always)]
pub(crate) fn set_addr(
    ctx: &TcContext,
    pkt: &Pkt,
    side: Side,
    old: &Addr,
    new: &Addr,
) -> Result<(), i64> {
    let csum_off = pkt.l4_csum_off() as usize;
    if !pkt.v6 {
        let off = if side == Side::Src {
            V4_SADDR
        } else {
            V4_DADDR
        } as usize;
        let (from, to) = (old[3], new[3]);
        ctx.store(off, &to, 0)?;
        ctx.l3_csum_replace(V4_CSUM as usize, from as u64, to as u64, 4)?;
        ctx.l4_csum_replace(
            csum_off,
            from as u64,
            to as u64,
            BPF_F_PSEUDO_HDR as u64 | l4_flags(pkt) | 4,
        )
    } else {
        let off = if side == Side::Src {
            V6_SADDR
        } else {
            V6_DADDR
        } as usize;
        ctx.store(off, new, 0)?;
        // SAFETY: both buffers are 16 readable bytes on the stack.
        let diff = unsafe {
            bpf_csum_diff(
                old.as_ptr() as *mut u32,
                16,
                new.as_ptr() as *mut u32,
                16,
                0,
            )
        };
        if diff < 0 {
            return Err(diff);
        }
        l4_diff(ctx, csum_off, diff as u64, l4_flags(pkt))
    }
}

/// Applies a pseudo-header checksum difference to an IPv6 TCP/UDP checksum.
#[inline(always)]
fn l4_diff(ctx: &TcContext, csum_off: usize, diff: u64, flags: u64) -> Result<(), i64> {
    let flags = flags | BPF_F_PSEUDO_HDR as u64;
    match ctx.l4_csum_replace(csum_off, 0, diff, flags | BPF_F_IPV6) {
        // A kernel without BPF_F_IPV6: the checksum field is still right; only a
        // CHECKSUM_COMPLETE skb's csum goes stale (the stack then verifies in software).
        Err(e) if e == -EINVAL => ctx.l4_csum_replace(csum_off, 0, diff, flags),
        r => r,
    }
}

/// Writes the source or destination port (network byte order).
#[inline(always)]
pub(crate) fn set_port(
    ctx: &TcContext,
    pkt: &Pkt,
    side: Side,
    old: u16,
    new: u16,
) -> Result<(), i64> {
    if old == new {
        return Ok(());
    }
    let off = (pkt.l4_off() + if side == Side::Src { 0 } else { 2 }) as usize;
    ctx.store(off, &new, 0)?;
    ctx.l4_csum_replace(
        pkt.l4_csum_off() as usize,
        old as u64,
        new as u64,
        l4_flags(pkt) | 2,
    )
}

/// Rewrites the destination (DNAT) and, when given, the source (SNAT) of the packet.
/// Returns the packet as it now is.
#[inline(always)]
pub(crate) fn rewrite(
    ctx: &TcContext,
    pkt: &Pkt,
    saddr: &Addr,
    sport: u16,
    daddr: &Addr,
    dport: u16,
) -> Result<(), i64> {
    if *daddr != pkt.daddr {
        set_addr(ctx, pkt, Side::Dst, &pkt.daddr, daddr)?;
    }
    set_port(ctx, pkt, Side::Dst, pkt.dport, dport)?;
    if *saddr != pkt.saddr {
        set_addr(ctx, pkt, Side::Src, &pkt.saddr, saddr)?;
    }
    set_port(ctx, pkt, Side::Src, pkt.sport, sport)
}

/// What [`translate`] makes of a packet: addresses and ports as the maps store them.
#[derive(Clone, Copy)]
pub(crate) struct To {
    pub(crate) saddr: Addr,
    pub(crate) daddr: Addr,
    pub(crate) sport: u16,
    pub(crate) dport: u16,
    /// Decrement the TTL / hop limit (the program forwards the packet itself).
    pub(crate) ttl: bool,
}

/// Rewrites the packet's destination and source as [`rewrite`] does and, when `to.ttl`,
/// decrements its TTL as [`dec_ttl`] does (false when it has run out, before anything
/// is written). Headers in the skb's linear part (always, for packets the stack built or
/// a NIC received; not for IP options or IPv6 fragment headers) are written directly
/// with one IPv4 header checksum update computed here and at most two
/// `bpf_l4_csum_replace` calls; otherwise each field takes a store and its checksum
/// helpers (they were about a third of the ingress program's time per packet).
#[inline(always)]
pub(crate) fn translate(ctx: &TcContext, pkt: &Pkt, to: &To) -> bool {
    if to.ttl && pkt.ttl <= 1 {
        return false;
    }
    match direct(ctx, pkt, to) {
        DIRECT_OK => return true,
        DIRECT_FAILED => return false,
        _ => {}
    }
    rewrite(ctx, pkt, &to.saddr, to.sport, &to.daddr, to.dport).is_ok()
        && (!to.ttl || dec_ttl(ctx, pkt).is_ok())
}

const DIRECT_OK: i32 = 0;
const DIRECT_FAILED: i32 = 1;
const DIRECT_NOT_LINEAR: i32 = 2;

/// [`translate`] through direct packet access: `DIRECT_OK`, `DIRECT_FAILED`, or
/// `DIRECT_NOT_LINEAR` when the IP header is not the plain one (IPv4 without options,
/// IPv6 without extension headers) or the headers up to the ports are not in the linear
/// part. A call of its own: inlined, its registers spill into the callers' frames, which
/// the ICMP error path (`icmp::too_big`) adds to.
#[inline(never)]
fn direct(ctx: &TcContext, pkt: &Pkt, to: &To) -> i32 {
    let (hlen, v6_diff) = if pkt.v6 {
        // The IPv6 address sums take the helper: summed here they spill a frame's worth
        // of registers.
        // SAFETY: four 16-byte buffers on the stack.
        let d = unsafe {
            bpf_csum_diff(
                pkt.saddr.as_ptr() as *mut u32,
                16,
                to.saddr.as_ptr() as *mut u32,
                16,
                0,
            )
        };
        // SAFETY: as above.
        let d = unsafe {
            bpf_csum_diff(
                pkt.daddr.as_ptr() as *mut u32,
                16,
                to.daddr.as_ptr() as *mut u32,
                16,
                d as u32,
            )
        };
        if d < 0 {
            return DIRECT_FAILED;
        }
        (40, d as u32)
    } else {
        (20, 0)
    };
    let data = ctx.data();
    let end = ctx.data_end();
    let ip = (data + ETH_HLEN as usize) as *mut u8;
    // Address changes go into the pseudo-header part of the L4 checksum, port changes
    // into the rest: a CHECKSUM_PARTIAL skb's field holds only the former.
    let mut pseudo = Sum::new();
    // Each family checks its own constant length: the verifier then knows every write
    // below is inside the packet.
    if pkt.v6 {
        if pkt.ip_hlen != hlen || data + (ETH_HLEN + 40 + 4) as usize > end {
            return DIRECT_NOT_LINEAR;
        }
        // SAFETY: the IPv6 header and the 4 port bytes after it are inside the packet
        // (checked above); the verifier's prologue has made a cloned skb's header private.
        unsafe {
            if to.ttl {
                ip.add(7).write(pkt.ttl - 1);
            }
            core::ptr::write_unaligned(ip.add(8) as *mut Addr, to.saddr);
            core::ptr::write_unaligned(ip.add(24) as *mut Addr, to.daddr);
            core::ptr::write_unaligned(ip.add(40) as *mut [u16; 2], [to.sport, to.dport]);
        }
    } else {
        if pkt.ip_hlen != hlen || data + (ETH_HLEN + 20 + 4) as usize > end {
            return DIRECT_NOT_LINEAR;
        }
        pseudo.word32(pkt.saddr[3], to.saddr[3]);
        pseudo.word32(pkt.daddr[3], to.daddr[3]);
        let mut hdr = pseudo;
        // SAFETY: the IPv4 header (no options) and the 4 port bytes after it are inside
        // the packet (checked above); the prologue has made a cloned skb's header private.
        unsafe {
            if to.ttl {
                // TTL and protocol are one 16-bit word of the header checksum.
                let old = core::ptr::read_unaligned(ip.add(8) as *const u16);
                ip.add(8).write(pkt.ttl - 1);
                hdr.word(old, core::ptr::read_unaligned(ip.add(8) as *const u16));
            }
            core::ptr::write_unaligned(ip.add(12) as *mut u32, to.saddr[3]);
            core::ptr::write_unaligned(ip.add(16) as *mut u32, to.daddr[3]);
            let csum = ip.add(10) as *mut u16;
            core::ptr::write_unaligned(csum, hdr.apply(core::ptr::read_unaligned(csum)));
            core::ptr::write_unaligned(ip.add(20) as *mut [u16; 2], [to.sport, to.dport]);
        }
    }
    let mut ports = Sum::new();
    ports.word(pkt.sport, to.sport);
    ports.word(pkt.dport, to.dport);
    // The checksum helpers last: they may move the packet data.
    let csum_off = pkt.l4_csum_off() as usize;
    let flags = l4_flags(pkt);
    let r = if pkt.v6 {
        l4_diff(ctx, csum_off, v6_diff as u64, flags)
    } else if !pseudo.is_zero() {
        ctx.l4_csum_replace(
            csum_off,
            0,
            pseudo.value() as u64,
            flags | BPF_F_PSEUDO_HDR as u64,
        )
    } else {
        Ok(())
    };
    if r.is_err()
        || (!ports.is_zero()
            && ctx
                .l4_csum_replace(csum_off, 0, ports.value() as u64, flags)
                .is_err())
    {
        return DIRECT_FAILED;
    }
    DIRECT_OK
}

/// Decrements the TTL / hop limit of a packet the program forwards itself (the stack
/// would have), so that a routing loop still ends. `Err` when it has run out: the packet
/// is to be dropped.
#[inline(always)]
pub(crate) fn dec_ttl(ctx: &TcContext, pkt: &Pkt) -> Result<(), i64> {
    if pkt.ttl <= 1 {
        return Err(0);
    }
    let ttl = pkt.ttl - 1;
    if pkt.v6 {
        return ctx.store(V6_HOP_LIMIT as usize, &ttl, 0);
    }
    // The checksum covers TTL and protocol as one 16-bit word.
    let old = u16::from_be_bytes([pkt.ttl, pkt.proto]).to_be();
    let new = u16::from_be_bytes([ttl, pkt.proto]).to_be();
    ctx.store(V4_TTL as usize, &ttl, 0)?;
    ctx.l3_csum_replace(V4_CSUM as usize, old as u64, new as u64, 2)
}
