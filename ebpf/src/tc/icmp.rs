//! ICMP / ICMPv6 errors that ferry sends itself, built in place from the packet they are
//! about and sent back out of the device it came in on: port unreachable (the client
//! sees "connection refused") and fragmentation needed / packet too big (path-MTU
//! discovery through a NodePort whose backend side has a smaller MTU).

use aya_ebpf::{
    bindings::TC_ACT_SHOT,
    helpers::{
        bpf_csum_diff, bpf_redirect, bpf_skb_change_tail, bpf_skb_load_bytes, bpf_skb_store_bytes,
    },
    programs::TcContext,
};

use super::parse::{ETH_HLEN, Ipv4Hdr, Ipv6Hdr, Pkt};
use crate::maps::{ICMP_QUOTE_MAX, SCRATCH};

const IPPROTO_ICMP: u8 = 1;
const IPPROTO_ICMPV6: u8 = 58;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const ICMP_FRAG_NEEDED: u8 = 4;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;
const ICMPV6_PKT_TOOBIG: u8 = 2;
/// IPv4 TOS of ICMP errors (precedence "internetwork control"), as Linux sends them.
const IPTOS_PREC_INTERNETCONTROL: u8 = 0xc0;
const TTL: u8 = 64;
/// `bpf_csum_diff` sums at most this many bytes per call.
const CSUM_CHUNK: u32 = 512;

#[repr(C)]
#[derive(Clone, Copy)]
struct IcmpHdr {
    ty: u8,
    code: u8,
    csum: u16,
    /// Zero for "unreachable"; the next-hop MTU (network byte order, in the low 16 bits
    /// for IPv4) for "fragmentation needed" / "packet too big".
    rest: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Icmp4Err {
    ip: Ipv4Hdr,
    icmp: IcmpHdr,
}
const _: () = assert!(core::mem::size_of::<Icmp4Err>() == 28);

#[repr(C)]
#[derive(Clone, Copy)]
struct Icmp6Err {
    ip: Ipv6Hdr,
    icmp: IcmpHdr,
}
const _: () = assert!(core::mem::size_of::<Icmp6Err>() == 48);

/// IPv6 pseudo-header for the ICMPv6 checksum (RFC 8200 §8.1).
#[repr(C)]
struct Pseudo6 {
    saddr: [u32; 4],
    daddr: [u32; 4],
    len: u32,
    zero_nexthdr: [u8; 4],
}

/// Folds a 32-bit one's complement sum into the 16-bit checksum to store (as memory
/// bytes, so no byte swap either way).
#[inline(always)]
fn fold(sum: i64) -> u16 {
    let mut s = sum as u64 & 0xffff_ffff;
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    !(s as u16)
}

/// One's complement sum of `len` bytes at `ptr` (a multiple of 4, at most 512) on top of
/// `seed`.
#[inline(always)]
fn sum(ptr: *const u8, len: u32, seed: i64) -> i64 {
    // SAFETY: callers pass memory the verifier can see is readable for `len` bytes.
    unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, ptr as *mut u32, len, seed as u32) }
}

/// Replaces the packet with a port unreachable for its sender and redirects it out of
/// the ingress device. Returns the tc verdict (`TC_ACT_SHOT` if it could not be built).
#[inline(never)]
pub(crate) fn port_unreachable(ctx: &TcContext, pkt: &Pkt) -> i32 {
    send(ctx, pkt, 0)
}

/// Replaces the packet with a "fragmentation needed" (IPv4, DF set) / "packet too big"
/// (IPv6) carrying `mtu`, from the address the client sent to, as a router on the path
/// would, and redirects it out of the ingress device.
#[inline(never)]
pub(crate) fn too_big(ctx: &TcContext, pkt: &Pkt, mtu: u16) -> i32 {
    // The route's MTU can be 0 only if the lookup failed oddly; never advertise less
    // than the minimum of the family.
    let min = if pkt.v6 { 1280 } else { 576 };
    send(ctx, pkt, if mtu < min { min } else { mtu } as u32)
}

/// `mtu` 0: port unreachable; otherwise too big with that MTU.
#[inline(always)]
fn send(ctx: &TcContext, pkt: &Pkt, mtu: u32) -> i32 {
    match build(ctx, pkt, mtu) {
        Some(()) => {
            // SAFETY: valid tc context.
            let ifindex = unsafe { (*ctx.skb.skb).ifindex };
            // SAFETY: helper valid for tc programs.
            unsafe { bpf_redirect(ifindex, 0) as i32 }
        }
        None => TC_ACT_SHOT as i32,
    }
}

#[inline(always)]
fn build(ctx: &TcContext, pkt: &Pkt, mtu: u32) -> Option<()> {
    let scratch = SCRATCH.get_ptr_mut(0)?;
    // SAFETY: per-CPU map value, used by this program run only.
    let quote = unsafe { (*scratch).quote.as_mut_ptr() };
    let skb = ctx.skb.skb;

    // What to quote: IPv4, the IP header and the first 8 bytes of its payload (RFC 792);
    // IPv6, as much as fits the minimum MTU (RFC 4443), trimmed to whole 32-bit words
    // so that the checksum helper can sum it.
    let avail = ctx.len().checked_sub(ETH_HLEN)?;
    let mut q = if pkt.v6 {
        let mut q = if pkt.ip_len < avail {
            pkt.ip_len
        } else {
            avail
        };
        if q > ICMP_QUOTE_MAX as u32 {
            q = ICMP_QUOTE_MAX as u32;
        }
        q & !3
    } else {
        pkt.ip_hlen + 8
    };
    if q > avail {
        return None;
    }
    q &= 0x7fc;
    if q < 28 || q > ICMP_QUOTE_MAX as u32 {
        return None;
    }
    // SAFETY: the scratch value holds ICMP_QUOTE_MAX bytes and q is within it.
    if unsafe { bpf_skb_load_bytes(skb as *const _, ETH_HLEN, quote as *mut _, q) } != 0 {
        return None;
    }

    // Checksum of the quote, in chunks the helper accepts.
    let c0 = if q > CSUM_CHUNK { CSUM_CHUNK } else { q };
    let mut quote_sum = sum(quote, c0, 0);
    let rest = q - c0;
    if rest > 0 {
        let c1 = if rest > CSUM_CHUNK { CSUM_CHUNK } else { rest };
        // SAFETY: in bounds: c0 + c1 <= q <= ICMP_QUOTE_MAX.
        quote_sum = sum(unsafe { quote.add(CSUM_CHUNK as usize) }, c1, quote_sum);
        let rest = rest - c1;
        if rest > 0 {
            let tail = (ICMP_QUOTE_MAX as u32) - 2 * CSUM_CHUNK;
            let c2 = if rest > tail { tail } else { rest } & 0x1fc;
            // SAFETY: as above.
            quote_sum = sum(unsafe { quote.add(2 * CSUM_CHUNK as usize) }, c2, quote_sum);
        }
    }
    if quote_sum < 0 {
        return None;
    }

    let hdr_len: u32;
    if pkt.v6 {
        let mut h = Icmp6Err {
            ip: Ipv6Hdr {
                ver_tc_flow: u32::to_be(6 << 28),
                payload_len: ((8 + q) as u16).to_be(),
                nexthdr: IPPROTO_ICMPV6,
                hop_limit: TTL,
                saddr: pkt.daddr,
                daddr: pkt.saddr,
            },
            icmp: if mtu == 0 {
                IcmpHdr {
                    ty: ICMPV6_DEST_UNREACH,
                    code: ICMPV6_PORT_UNREACH,
                    csum: 0,
                    rest: 0,
                }
            } else {
                IcmpHdr {
                    ty: ICMPV6_PKT_TOOBIG,
                    code: 0,
                    csum: 0,
                    rest: mtu.to_be(),
                }
            },
        };
        let pseudo = Pseudo6 {
            saddr: pkt.daddr,
            daddr: pkt.saddr,
            len: (8 + q).to_be(),
            zero_nexthdr: [0, 0, 0, IPPROTO_ICMPV6],
        };
        let s = sum(&pseudo as *const _ as *const u8, 40, quote_sum);
        let s = sum(&h.icmp as *const _ as *const u8, 8, s);
        if s < 0 {
            return None;
        }
        h.icmp.csum = fold(s);
        hdr_len = 48;
        resize_and_store(ctx, &h as *const _ as *const u8, hdr_len, quote, q)?;
    } else {
        let mut h = Icmp4Err {
            ip: Ipv4Hdr {
                ver_ihl: 0x45,
                tos: IPTOS_PREC_INTERNETCONTROL,
                tot_len: ((28 + q) as u16).to_be(),
                id: 0,
                frag_off: 0,
                ttl: TTL,
                proto: IPPROTO_ICMP,
                csum: 0,
                saddr: pkt.daddr[3],
                daddr: pkt.saddr[3],
            },
            icmp: IcmpHdr {
                ty: ICMP_DEST_UNREACH,
                code: if mtu == 0 {
                    ICMP_PORT_UNREACH
                } else {
                    ICMP_FRAG_NEEDED
                },
                csum: 0,
                rest: mtu.to_be(),
            },
        };
        let s = sum(&h.ip as *const _ as *const u8, 20, 0);
        let si = sum(&h.icmp as *const _ as *const u8, 8, quote_sum);
        if s < 0 || si < 0 {
            return None;
        }
        h.ip.csum = fold(s);
        h.icmp.csum = fold(si);
        hdr_len = 28;
        resize_and_store(ctx, &h as *const _ as *const u8, hdr_len, quote, q)?;
    }

    // Back to where it came from: swap the MAC addresses.
    let macs: [u8; 12] = ctx.load(0).ok()?;
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    ctx.store(0, &swapped, 0).ok()?;
    Some(())
}

/// Sets the packet to Ethernet + `hdr` + `quote` (the Ethernet header is kept).
#[inline(always)]
fn resize_and_store(
    ctx: &TcContext,
    hdr: *const u8,
    hdr_len: u32,
    quote: *const u8,
    q: u32,
) -> Option<()> {
    let skb = ctx.skb.skb;
    // SAFETY: helpers valid for tc programs; buffers readable for the lengths passed
    // (q was bounded by the caller to the scratch size).
    unsafe {
        if bpf_skb_change_tail(skb, ETH_HLEN + hdr_len + q, 0) != 0 {
            return None;
        }
        if bpf_skb_store_bytes(skb as *mut _, ETH_HLEN, hdr as *const _, hdr_len, 0) != 0 {
            return None;
        }
        if bpf_skb_store_bytes(skb as *mut _, ETH_HLEN + hdr_len, quote as *const _, q, 0) != 0 {
            return None;
        }
    }
    Some(())
}
