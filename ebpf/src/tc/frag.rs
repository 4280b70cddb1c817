//! Later IP fragments of translated datagrams.
//!
//! Only the first fragment of a datagram carries the ports, so only it can be matched
//! to a flow. When the program translates a first fragment it writes what it did (new
//! source and destination, forwarded or not) into `FERRY_TC_FRAGS` under the fragment's
//! (source, destination, identification, protocol); the later fragments of the datagram
//! find it there and get the same addresses (no L4 header to touch: the first fragment
//! carried the checksum), so the endpoint reassembles the datagram.
//!
//! A later fragment that arrives before its first fragment finds nothing and passes
//! untranslated (the node drops it when reassembly times out): the datagram is lost. The
//! kernel's conntrack reassembles before NAT and has no such case; on a LAN or one path
//! fragments arrive in order.

use aya_ebpf::{bindings::TC_ACT_SHOT, programs::TcContext};
use ferry_common::{Addr, addr_from_v4_be};

use super::{
    OK, fib,
    icmp_err::{Sum, load_v4, load_v6, store_csum},
    parse::{ETH_HLEN, ETH_P_IPV6, FragHdr, IP_OFFSET, NEXTHDR_FRAGMENT, Pkt, V6_FRAG_OFF},
};
use crate::maps::{FRAGS, FragKey, FragValue, SCRATCH};

/// `FragKey::dir`: seen by the ingress program.
pub(crate) const FRAG_DIR_INGRESS: u8 = 0;
/// `FragKey::dir`: seen by the egress program.
pub(crate) const FRAG_DIR_EGRESS: u8 = 1;

const SHOT: i32 = TC_ACT_SHOT as i32;

/// Records the translation of a first fragment (`pkt` as it arrived): its later
/// fragments get `saddr`/`daddr`, and are forwarded by the program when `forward`.
#[inline(never)]
pub(crate) fn remember(pkt: &Pkt, dir: u8, saddr: &Addr, daddr: &Addr, forward: bool) {
    let Some(s) = SCRATCH.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: per-CPU value, used by this program run only.
    let s = unsafe { &mut *s };
    s.fkey = FragKey {
        saddr: pkt.saddr,
        daddr: pkt.daddr,
        id: pkt.frag_id,
        proto: pkt.proto,
        dir,
        _pad: [0; 2],
    };
    s.fval = FragValue {
        saddr: *saddr,
        daddr: *daddr,
        forward: forward as u8,
        _pad: [0; 7],
    };
    let _ = FRAGS.insert(&s.fkey, &s.fval, 0);
}

/// A later fragment (no ports): translated as its first fragment was, else passed.
#[inline(never)]
pub(crate) fn follow(ctx: &TcContext, dir: u8) -> i32 {
    let Some(s) = SCRATCH.get_ptr_mut(0) else {
        return OK;
    };
    // SAFETY: per-CPU value, used by this program run only.
    let s = unsafe { &mut *s };
    // SAFETY: valid tc context.
    let v6 = u16::from_be(unsafe { (*ctx.skb.skb).protocol } as u16) == ETH_P_IPV6;
    let ttl_ok;
    if v6 {
        let Some(mut ip) = load_v6(ctx, ETH_HLEN) else {
            return OK;
        };
        let Ok(fh) = ctx.load::<FragHdr>(V6_FRAG_OFF as usize) else {
            return OK;
        };
        if ip.nexthdr != NEXTHDR_FRAGMENT || u16::from_be(fh.off_m) >> 3 == 0 {
            return OK;
        }
        s.fkey = FragKey {
            saddr: ip.saddr,
            daddr: ip.daddr,
            id: fh.id,
            proto: fh.nexthdr,
            dir,
            _pad: [0; 2],
        };
        // SAFETY: plain data read; the copy is taken at once.
        let Some(v) = (unsafe { FRAGS.get(&s.fkey) }).copied() else {
            return OK;
        };
        s.fval = v;
        ip.saddr = v.saddr;
        ip.daddr = v.daddr;
        ttl_ok = v.forward == 0 || ip.hop_limit > 1;
        if v.forward != 0 {
            ip.hop_limit = ip.hop_limit.wrapping_sub(1);
        }
        if !ttl_ok || store_csum(ctx, ETH_HLEN, &ip).is_err() {
            return SHOT;
        }
    } else {
        let Some(mut ip) = load_v4(ctx, ETH_HLEN) else {
            return OK;
        };
        if u16::from_be(ip.frag_off) & IP_OFFSET == 0 {
            return OK;
        }
        s.fkey = FragKey {
            saddr: addr_from_v4_be(ip.saddr),
            daddr: addr_from_v4_be(ip.daddr),
            id: ip.id as u32,
            proto: ip.proto,
            dir,
            _pad: [0; 2],
        };
        // SAFETY: plain data read; the copy is taken at once.
        let Some(v) = (unsafe { FRAGS.get(&s.fkey) }).copied() else {
            return OK;
        };
        s.fval = v;
        let mut d = Sum::new();
        d.word32(ip.saddr, v.saddr[3]);
        d.word32(ip.daddr, v.daddr[3]);
        ip.saddr = v.saddr[3];
        ip.daddr = v.daddr[3];
        ttl_ok = v.forward == 0 || ip.ttl > 1;
        if v.forward != 0 {
            // TTL and protocol are one 16-bit word of the header checksum.
            let old = u16::from_ne_bytes([ip.ttl, ip.proto]);
            ip.ttl = ip.ttl.wrapping_sub(1);
            d.word(old, u16::from_ne_bytes([ip.ttl, ip.proto]));
        }
        ip.csum = d.apply(ip.csum);
        if !ttl_ok || store_csum(ctx, ETH_HLEN, &ip).is_err() {
            return SHOT;
        }
    }
    if s.fval.forward == 0 {
        return OK;
    }
    fib::send(ctx, &mut s.fib, v6, &s.fval.saddr, &s.fval.daddr)
}
