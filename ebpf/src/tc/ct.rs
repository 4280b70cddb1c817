//! Conntrack (`FERRY_CT`): keys, freshness and the two entries of a flow.

use ferry_common::{
    Addr,
    ct::{
        CT_DIR_ORIGINAL, CT_DIR_REPLY, CT_F_SNAT, CT_TCP_SEEN_FIN, CT_TCP_SEEN_REPLY,
        CT_TCP_SEEN_RST, CT_TCP_SEEN_SYN, CT_TIMEOUT_TCP_CLOSING_NS, CT_TIMEOUT_TCP_ESTABLISHED_NS,
        CT_TIMEOUT_TCP_SYN_NS, CT_TIMEOUT_UDP_NS, CtEntry, CtKey,
    },
    lb::PROTO_TCP,
};

use super::parse::{Pkt, TCP_FIN, TCP_RST, TCP_SYN};
use crate::maps::CT;

/// `last_seen_ns` is written at most this often per flow (plus on every TCP state
/// change): a busy flow does not write one shared cache line on every packet, and
/// timeouts of seconds to hours do not need more precision.
const REFRESH_NS: u64 = 1_000_000_000;

#[inline(always)]
pub(crate) fn key(saddr: Addr, daddr: Addr, sport: u16, dport: u16, proto: u8, dir: u8) -> CtKey {
    CtKey {
        saddr,
        daddr,
        sport,
        dport,
        proto,
        dir,
        _pad: [0; 2],
    }
}

/// The key of a packet as it is on the wire, for direction `dir`.
#[inline(always)]
pub(crate) fn pkt_key(pkt: &Pkt, dir: u8) -> CtKey {
    key(pkt.saddr, pkt.daddr, pkt.sport, pkt.dport, pkt.proto, dir)
}

/// The reply key of a flow from its original key and entry: the backend answers the
/// client, or the source-NAT address when the flow is NATed.
#[inline(always)]
pub(crate) fn reply_key_of(orig: &CtKey, e: &CtEntry) -> CtKey {
    let (daddr, dport) = if e.flags & CT_F_SNAT != 0 {
        (e.snat_addr, e.snat_port)
    } else {
        (orig.saddr, orig.sport)
    };
    key(
        e.nat_addr,
        daddr,
        e.nat_port,
        dport,
        orig.proto,
        CT_DIR_REPLY,
    )
}

/// The original key of a flow from its reply entry: client -> frontend. The reply
/// entry always carries the client in `snat_addr`/`snat_port` (ferry writes it with and
/// without source NAT).
#[inline(always)]
pub(crate) fn orig_key_of(proto: u8, reply: &CtEntry) -> CtKey {
    key(
        reply.snat_addr,
        reply.nat_addr,
        reply.snat_port,
        reply.nat_port,
        proto,
        CT_DIR_ORIGINAL,
    )
}

#[inline(always)]
fn timeout_ns(proto: u8, tcp_seen: u8) -> u64 {
    if proto != PROTO_TCP {
        CT_TIMEOUT_UDP_NS
    } else if tcp_seen & (CT_TCP_SEEN_FIN | CT_TCP_SEEN_RST) != 0 {
        CT_TIMEOUT_TCP_CLOSING_NS
    } else if tcp_seen & CT_TCP_SEEN_REPLY != 0 {
        CT_TIMEOUT_TCP_ESTABLISHED_NS
    } else {
        CT_TIMEOUT_TCP_SYN_NS
    }
}

/// True while the flow of this original entry is alive.
///
/// Saturating: an entry a little ahead of `now` (written with the precise clock by the
/// programs of an older ferry, now reads the coarse one) is fresh.
#[inline(always)]
pub(crate) fn fresh(e: &CtEntry, proto: u8, now: u64) -> bool {
    now.saturating_sub(e.last_seen_ns) <= timeout_ns(proto, e.tcp_seen)
}

/// The `CT_TCP_SEEN_*` bits a packet adds.
#[inline(always)]
pub(crate) fn seen_bits(pkt: &Pkt, reply: bool) -> u8 {
    let f = pkt.tcp_flags;
    let mut seen = 0;
    if reply {
        seen |= CT_TCP_SEEN_REPLY;
    } else if f & TCP_SYN != 0 {
        seen |= CT_TCP_SEEN_SYN;
    }
    if f & TCP_FIN != 0 {
        seen |= CT_TCP_SEEN_FIN;
    }
    if f & TCP_RST != 0 {
        seen |= CT_TCP_SEEN_RST;
    }
    seen
}

/// Records a packet of the flow on its original entry: timestamp and TCP state.
#[inline(always)]
pub(crate) fn touch(e: &mut CtEntry, pkt: &Pkt, reply: bool, now: u64) {
    let mut seen = e.tcp_seen;
    if pkt.proto == PROTO_TCP {
        if !reply && pkt.is_syn() && seen & (CT_TCP_SEEN_FIN | CT_TCP_SEEN_RST) != 0 {
            // The client reuses the tuple of a closed connection: a new handshake.
            seen = 0;
        }
        seen |= seen_bits(pkt, reply);
    }
    if seen != e.tcp_seen || now.wrapping_sub(e.last_seen_ns) > REFRESH_NS {
        e.tcp_seen = seen;
        e.last_seen_ns = now;
    }
}

/// Forgets the reply entry of a flow whose original entry is about to be replaced
/// (expired, or a UDP flow moving to another backend), so that its source-NAT port is
/// free again.
#[inline(always)]
pub(crate) fn forget_reply(orig: &CtKey, e: &CtEntry) {
    let _ = CT.remove(&reply_key_of(orig, e));
}

/// True when the reply entry `r`, found under key `rkey` (a source-NAT port in use),
/// belongs to a flow that is gone: its original entry is missing, expired, or now uses
/// another backend or port. Such a port may be taken over.
#[inline(always)]
pub(crate) fn reply_is_stale(rkey: &CtKey, r: &CtEntry, now: u64) -> bool {
    let okey = orig_key_of(rkey.proto, r);
    // SAFETY: plain data read.
    match unsafe { CT.get(&okey) } {
        None => true,
        Some(o) => {
            !fresh(o, rkey.proto, now)
                || o.flags & CT_F_SNAT == 0
                || o.nat_addr != rkey.saddr
                || o.nat_port != rkey.sport
                || o.snat_addr != rkey.daddr
                || o.snat_port != rkey.dport
        }
    }
}
