//! The tc datapath for traffic from outside the node: NodePorts, externalIPs and
//! LoadBalancer IPs (docs/external-traffic.md).
//!
//! Ingress: replies to source-NATed flows, known flows, then new flows (frontend lookup,
//! Maglev, optional source NAT). Egress: replies of local endpoints get their frontend
//! back as source. One concern per module: `parse`, `ct`, `nat`, `fib`, `icmp` (errors
//! ferry sends), `icmp_err` (errors about translated flows), `frag` (later fragments).

mod ct;
mod fib;
mod frag;
mod icmp;
mod icmp_err;
mod nat;
mod parse;

use core::mem::MaybeUninit;

use aya_ebpf::{
    bindings::{BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT},
    helpers::bpf_ktime_get_coarse_ns,
    maps::lpm_trie::Key,
    programs::TcContext,
};
use aya_log_ebpf::warn;
use ferry_common::{
    Addr, addr_is_v4,
    ct::{
        CT_DIR_ORIGINAL, CT_DIR_REPLY, CT_F_LOCAL_BACKEND, CT_F_SNAT, CtEntry, SNAT_PORT_MAX,
        SNAT_PORT_MIN,
    },
    ext::{
        ClientAffinityKey, FAMILY_V4, FAMILY_V6, MAGLEV_TABLE_SIZE, SnatAddrKey, SourceRangeKey,
        flow_hash,
    },
    lb::{
        AffinityValue, BACKEND_F_LOCAL, Backend, MemberKey, PROTO_TCP, SCOPE_EXTERNAL_ORIGIN,
        SVC_F_AFFINITY, SVC_F_DROP, SVC_F_LOCAL_POLICY, SVC_F_SOURCE_RANGES, ServiceKey,
        ServiceValue,
    },
    metrics::{
        COUNT_AFFINITY_FULL, COUNT_BACKEND_MISSING, COUNT_CT_FULL, COUNT_DROP_NO_LOCAL,
        COUNT_EXT_AFFINITY_HIT, COUNT_EXT_ICMP_UNREACH, COUNT_EXT_XLATE, COUNT_FIB_FAIL,
        COUNT_SNAT_EXHAUSTED, COUNT_SOURCE_RANGE_DROP,
    },
};

use crate::lb::remembered;
use crate::maps::{
    BACKENDS, CT, MAGLEV, MEMBERS, SCRATCH, SERVICES, SNAT_ADDRS, SRC_RANGES, Scratch, TC_AFFINITY,
    count, count_service, flow_port,
};
use ct::{fresh, touch};
use fib::Route;
use frag::{FRAG_DIR_EGRESS, FRAG_DIR_INGRESS};
use nat::{To, translate};
use parse::{FRAG_FIRST, Pkt, parse};

const OK: i32 = TC_ACT_OK as i32;
const SHOT: i32 = TC_ACT_SHOT as i32;

/// Source-NAT ports tried for a new flow before it is dropped as exhausted.
const SNAT_TRIES: u32 = 32;
/// [`new_flow`]'s answer when the packet is to be translated and sent on.
const FORWARD: i32 = i32::MIN;
/// [`new_flow`]'s answer when the client is to get a port unreachable.
const REFUSE: i32 = i32::MIN + 1;

/// `Scratch::route`: no lookup done yet for this packet.
const ROUTE_NONE: u32 = 0;
/// `Scratch::fib` holds the route, neighbour resolved.
const ROUTE_RESOLVED: u32 = 1;
/// `Scratch::fib` holds the route, neighbour to be resolved by the kernel.
const ROUTE_UNRESOLVED: u32 = 2;

const SNAT_RANGE: u32 = (SNAT_PORT_MAX - SNAT_PORT_MIN) as u32 + 1;

/// `ferry_tc_ingress`.
#[inline(always)]
pub(crate) fn ingress(ctx: &TcContext) -> i32 {
    // Not zeroed first: zeroing compiled to a call of `memset`, a byte loop that cost a
    // tenth of the program.
    let mut pkt = MaybeUninit::<Pkt>::uninit();
    // SAFETY: room for one `Pkt`.
    if !unsafe { parse(ctx, pkt.as_mut_ptr()) } {
        return not_a_flow(ctx, FRAG_DIR_INGRESS);
    }
    // SAFETY: `parse` wrote the whole packet when it said true.
    let pkt = unsafe { pkt.assume_init_ref() };
    // Only a frontend's or a local endpoint's port, or a source-NAT port, can be ours:
    // the node's own connections (ephemeral local ports) leave here.
    let snat_reply = is_snat_port(pkt.dport);
    if !snat_reply && !flow_port(pkt.dport) {
        return OK;
    }
    let Some(s) = SCRATCH.get_ptr_mut(0) else {
        return OK;
    };
    // SAFETY: per-CPU value, used by this program run only.
    let s = unsafe { &mut *s };
    let now = clock();

    // 1. A reply to a source-NATed flow (addressed to a node address and SNAT port):
    // only a port of the source-NAT range can be one, so other packets (every packet
    // towards a NodePort) skip the lookup.
    if snat_reply {
        s.rkey = ct::pkt_key(pkt, CT_DIR_REPLY);
        // SAFETY: plain data read; the copy is taken at once.
        if let Some(r) = unsafe { CT.get(&s.rkey) } {
            if r.flags & CT_F_SNAT != 0 {
                copy_entry(&mut s.reply, r);
                return reply_to_client(ctx, pkt, s, now);
            }
        }
    }

    // 2. A known flow.
    s.okey = ct::pkt_key(pkt, CT_DIR_ORIGINAL);
    if let Some(ptr) = CT.get_ptr_mut(&s.okey) {
        // SAFETY: pointer from a successful lookup, valid for this program run.
        let e = unsafe { &mut *ptr };
        if fresh(e, pkt.proto, now) && (pkt.proto == PROTO_TCP || is_member(e)) {
            touch(e, pkt, false, now);
            copy_entry(&mut s.entry, e);
            s.route = ROUTE_NONE;
            return forward(ctx, pkt, s, now);
        }
        // Expired, or a UDP flow whose backend left the set: free its reply entry (and
        // SNAT port) and select again as for a new flow.
        copy_entry(&mut s.entry, e);
        ct::forget_reply(&s.okey, &s.entry);
    }

    // 3. A new flow. Translated and sent on from here, so that the deepest call chain
    // (and its stack) stays short.
    s.route = ROUTE_NONE;
    match new_flow(ctx, pkt, s, now) {
        FORWARD => forward(ctx, pkt, s, now),
        REFUSE => icmp::port_unreachable(ctx, pkt),
        verdict => verdict,
    }
}

/// `ferry_tc_egress`: a local endpoint's reply leaves with the frontend as source.
#[inline(always)]
pub(crate) fn egress(ctx: &TcContext) -> i32 {
    if take_forwarded(ctx) {
        return OK;
    }
    let mut pkt = MaybeUninit::<Pkt>::uninit();
    // SAFETY: room for one `Pkt`.
    if unsafe { parse(ctx, pkt.as_mut_ptr()) } {
        // SAFETY: `parse` wrote the whole packet when it said true.
        let pkt = unsafe { pkt.assume_init_ref() };
        // Only a local endpoint's reply (from its port) can be ours.
        if !flow_port(pkt.sport) {
            return OK;
        }
        egress_flow(ctx, pkt)
    } else {
        not_a_flow(ctx, FRAG_DIR_EGRESS)
    }
}

/// `cb[0]`, `cb[1]` of a packet [`forward`] or [`reply_to_client`] translated and
/// redirected: its egress has nothing to do with it (its source is the SNAT address or
/// the frontend), so egress skips parse and lookup (a fifth of the forwarding cost).
/// The control block survives the redirect; the stack overwrites it wherever else the
/// packet goes (`IPCB` on receive), and 64 bits of other data match by accident
/// practically never.
const FORWARDED: [u32; 2] = [0x6665_7272, 0x7974_6321];

#[inline(always)]
fn mark_forwarded(ctx: &TcContext) {
    // SAFETY: valid tc context; tc programs may write the control block.
    unsafe {
        (*ctx.skb.skb).cb[0] = FORWARDED[0];
        (*ctx.skb.skb).cb[1] = FORWARDED[1];
    }
}

/// The packet carries [`FORWARDED`]; the mark is cleared.
#[inline(always)]
fn take_forwarded(ctx: &TcContext) -> bool {
    let skb = ctx.skb.skb;
    // SAFETY: valid tc context; tc programs may read and write the control block.
    unsafe {
        if (*skb).cb[0] != FORWARDED[0] || (*skb).cb[1] != FORWARDED[1] {
            return false;
        }
        (*skb).cb[0] = 0;
        (*skb).cb[1] = 0;
    }
    true
}

/// Egress of a TCP/UDP packet. A call of its own, so that the entry point's stack stays
/// small for the ICMP path.
#[inline(never)]
fn egress_flow(ctx: &TcContext, pkt: &Pkt) -> i32 {
    let pkt = *pkt;
    let rkey = ct::pkt_key(&pkt, CT_DIR_REPLY);
    // SAFETY: plain data read; the copy is taken at once.
    let r = match unsafe { CT.get(&rkey) } {
        Some(r) => *r,
        None => return OK,
    };
    if r.flags & CT_F_SNAT != 0 {
        return OK;
    }
    let now = clock();
    touch_original(&pkt, &r, now);
    let to = To {
        saddr: r.nat_addr,
        daddr: pkt.daddr,
        sport: r.nat_port,
        dport: pkt.dport,
        ttl: false,
    };
    if !translate(ctx, &pkt, &to) {
        return SHOT;
    }
    if pkt.frag == FRAG_FIRST {
        frag::remember(&pkt, FRAG_DIR_EGRESS, &r.nat_addr, &pkt.daddr, false);
    }
    OK
}

/// A packet [`parse`] does not take as a flow packet: an ICMP error about a translated
/// flow, a later fragment of a translated datagram, or something to pass. Only ICMP and
/// fragments get past the first header read.
#[inline(never)]
fn not_a_flow(ctx: &TcContext, dir: u8) -> i32 {
    match icmp_err::classify(ctx) {
        icmp_err::Kind::IcmpError => icmp_err::translate(ctx, dir == FRAG_DIR_INGRESS),
        icmp_err::Kind::Fragment => frag::follow(ctx, dir),
        icmp_err::Kind::Other => OK,
    }
}

/// The length the FIB lookup checks against the route's MTU: the packet's, or for a
/// GSO packet (segmented later) the length of one segment.
#[inline(always)]
fn wire_len(ctx: &TcContext, pkt: &Pkt) -> u16 {
    // SAFETY: valid tc context.
    let gso = unsafe { (*ctx.skb.skb).gso_size };
    let len = if gso != 0 {
        pkt.ip_hlen + pkt.l4_hlen + gso
    } else {
        pkt.ip_len
    };
    if len > 0xffff { 0xffff } else { len as u16 }
}

/// Refreshes a flow's original entry from a packet in the reply direction.
#[inline(always)]
fn touch_original(pkt: &Pkt, r: &CtEntry, now: u64) {
    let okey = ct::orig_key_of(pkt.proto, r);
    if let Some(ptr) = CT.get_ptr_mut(&okey) {
        // SAFETY: pointer from a successful lookup, valid for this program run.
        touch(unsafe { &mut *ptr }, pkt, true, now);
    }
}

/// A backend's reply to a source-NATed flow (`s.reply`): frontend as source, client as
/// destination, then forwarded (its source is a node address: it must not reach the
/// local stack).
#[inline(never)]
fn reply_to_client(ctx: &TcContext, pkt: &Pkt, s: &mut Scratch, now: u64) -> i32 {
    touch_original(pkt, &s.reply, now);
    // Too big for the client's side: the backend is told, as the reply arrived.
    let resolved = match route(ctx, pkt, s, true, now) {
        Ok(r) => r,
        Err(verdict) => return verdict,
    };
    let r = &s.reply;
    let to = To {
        saddr: r.nat_addr,
        daddr: r.snat_addr,
        sport: r.nat_port,
        dport: r.snat_port,
        ttl: true,
    };
    if !translate(ctx, pkt, &to) {
        return SHOT;
    }
    if pkt.frag == FRAG_FIRST {
        frag::remember(
            pkt,
            FRAG_DIR_INGRESS,
            &s.reply.nat_addr,
            &s.reply.snat_addr,
            true,
        );
    }
    match fib::redirect(ctx, &s.fib, resolved) {
        Some(v) => {
            mark_forwarded(ctx);
            v
        }
        None => {
            count(COUNT_FIB_FAIL);
            SHOT
        }
    }
}

/// The route of a packet the program forwards itself (`reply`: a reply towards the
/// client, else a source-NATed packet towards its backend), looked up before the rewrite
/// with the packet's length. `Ok(resolved)`, or `Err(verdict)`: a packet too big for the
/// route is answered with fragmentation needed / packet too big quoting it as it arrived
/// (IPv4 without DF is dropped: the kernel would fragment it, ferry cannot).
#[inline(always)]
fn route(ctx: &TcContext, pkt: &Pkt, s: &mut Scratch, reply: bool, now: u64) -> Result<bool, i32> {
    let iif = ingress_ifindex(ctx);
    let (saddr, daddr, slot) = if reply {
        (&s.reply.nat_addr, &s.reply.snat_addr, fib::SLOT_TO_CLIENT)
    } else {
        (&s.entry.snat_addr, &s.entry.nat_addr, fib::SLOT_TO_BACKEND)
    };
    match fib::lookup_cached(
        ctx,
        &mut s.fib,
        slot,
        pkt.v6,
        saddr,
        daddr,
        iif,
        wire_len(ctx, pkt),
        now,
    ) {
        Route::Resolved => Ok(true),
        Route::Unresolved => Ok(false),
        Route::TooBig(mtu) if pkt.df => Err(icmp::too_big(ctx, pkt, mtu)),
        Route::TooBig(_) | Route::Fail => {
            count(COUNT_FIB_FAIL);
            Err(SHOT)
        }
    }
}

/// Translates a packet of a flow as its original entry (`s.entry`) says and sends it on.
/// `s.route` says whether `s.fib` already holds the route (new source-NATed flows).
#[inline(never)]
fn forward(ctx: &TcContext, pkt: &Pkt, s: &mut Scratch, now: u64) -> i32 {
    let snat = s.entry.flags & CT_F_SNAT != 0;
    if snat && s.route == ROUTE_NONE {
        // The route before the rewrite: a packet too big for it is answered with the
        // client's packet as it is (the quote must be what the client sent).
        s.route = match route(ctx, pkt, s, false, now) {
            Ok(true) => ROUTE_RESOLVED,
            Ok(false) => ROUTE_UNRESOLVED,
            Err(verdict) => return verdict,
        };
    }
    let e = &s.entry;
    let (saddr, sport) = if snat {
        (&e.snat_addr, e.snat_port)
    } else {
        (&pkt.saddr, pkt.sport)
    };
    // Forwarded here (source-NATed): the TTL goes down as the stack would have.
    let to = To {
        saddr: *saddr,
        daddr: e.nat_addr,
        sport,
        dport: e.nat_port,
        ttl: snat,
    };
    if !translate(ctx, pkt, &to) {
        return SHOT;
    }
    if pkt.frag == FRAG_FIRST {
        frag::remember(pkt, FRAG_DIR_INGRESS, saddr, &e.nat_addr, snat);
    }
    if !snat {
        // The client's own address is the source: the stack routes it to the endpoint
        // (a local pod, or the host itself).
        return OK;
    }
    match fib::redirect(ctx, &s.fib, s.route == ROUTE_RESOLVED) {
        Some(v) => {
            mark_forwarded(ctx);
            v
        }
        None => {
            count(COUNT_FIB_FAIL);
            SHOT
        }
    }
}

/// The clock of conntrack and affinity timestamps: the coarse monotonic clock (the last
/// tick), a fraction of `bpf_ktime_get_ns`'s cost per packet, and precise enough for
/// timeouts of seconds and a refresh once a second. Every tc timestamp is taken with it.
#[inline(always)]
fn clock() -> u64 {
    // SAFETY: helper without preconditions.
    unsafe { bpf_ktime_get_coarse_ns() }
}

/// A port (network byte order) the source NAT hands out.
#[inline(always)]
fn is_snat_port(port_be: u16) -> bool {
    let port = u16::from_be(port_be);
    (SNAT_PORT_MIN..=SNAT_PORT_MAX).contains(&port)
}

/// Copies a conntrack entry out of the map. Written as a non-overlapping copy: a plain
/// assignment between two map values compiles to a call of `memmove`, a byte loop that
/// cost more than the rest of the known-flow path.
#[inline(always)]
fn copy_entry(dst: &mut CtEntry, src: &CtEntry) {
    // SAFETY: two distinct, aligned entries (a map value and the scratch space).
    unsafe { core::ptr::copy_nonoverlapping(src as *const CtEntry, dst as *mut CtEntry, 1) }
}

#[inline(always)]
fn ingress_ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: valid tc context.
    unsafe { (*ctx.skb.skb).ifindex }
}

/// The flow's backend still belongs to its ServicePort.
#[inline(always)]
fn is_member(e: &CtEntry) -> bool {
    let key = MemberKey {
        svc_id: e.svc_id,
        backend_id: e.backend_id,
    };
    // SAFETY: plain data read.
    unsafe { MEMBERS.get(&key) }.is_some()
}

/// The client is inside the ServicePort's loadBalancerSourceRanges.
#[inline(always)]
fn in_source_ranges(svc_id: u32, client: &Addr) -> bool {
    let key = Key::new(
        32 + 128,
        SourceRangeKey {
            svc_id_be: svc_id.to_be(),
            addr: *client,
        },
    );
    SRC_RANGES.get(&key).is_some()
}

/// A packet to no frontend that a local endpoint will answer exactly as it answers a
/// translated flow (the client reused its port: first towards a NodePort, now straight
/// to the endpoint, e.g. through a ClusterIP translated at its own socket). The replies
/// of both are the same packets; the newer flow wins, so the older flow's entries go
/// (egress would otherwise give the direct flow's replies the NodePort as source).
/// Checked for datagrams and SYNs only: other TCP segments cannot start a flow.
#[inline(always)]
fn forget_superseded_flow(pkt: &Pkt, s: &mut Scratch) {
    if pkt.proto == PROTO_TCP && !pkt.is_syn() {
        return;
    }
    s.rkey = ct::key(
        pkt.daddr,
        pkt.saddr,
        pkt.dport,
        pkt.sport,
        pkt.proto,
        CT_DIR_REPLY,
    );
    // SAFETY: plain data read; the copy is taken at once.
    let Some(r) = (unsafe { CT.get(&s.rkey) }) else {
        return;
    };
    if r.flags & CT_F_SNAT != 0 {
        return;
    }
    let okey = ct::orig_key_of(pkt.proto, r);
    let _ = CT.remove(&okey);
    let _ = CT.remove(&s.rkey);
}

/// A packet without conntrack entry (`s.okey` is its original key): frontend lookup,
/// refusal or backend selection, conntrack entries. Returns a tc verdict, or
/// [`FORWARD`]: translate and send on as `s.entry` says, or [`REFUSE`]: answer with a
/// port unreachable.
#[inline(never)]
fn new_flow(ctx: &TcContext, pkt: &Pkt, s: &mut Scratch, now: u64) -> i32 {
    let skey = ServiceKey {
        addr: pkt.daddr,
        port: pkt.dport,
        slot: 0,
        proto: pkt.proto,
        scope: SCOPE_EXTERNAL_ORIGIN,
        _pad: [0; 2],
    };
    // SAFETY: plain data read; the copy is taken at once.
    let svc = match unsafe { SERVICES.get(&skey) } {
        Some(v) => *v,
        None => {
            forget_superseded_flow(pkt, s);
            return OK;
        }
    };
    // Source ranges first: a client outside them learns nothing, not even "refused".
    if svc.flags & SVC_F_SOURCE_RANGES != 0 && !in_source_ranges(svc.svc_id, &pkt.saddr) {
        count(COUNT_SOURCE_RANGE_DROP);
        return SHOT;
    }
    if svc.count == 0 {
        if svc.flags & SVC_F_DROP != 0 {
            count(COUNT_DROP_NO_LOCAL);
            return SHOT;
        }
        // Refuse connection attempts and datagrams; other TCP segments of a flow we do
        // not know are dropped (the client is told on its next SYN).
        if pkt.proto == PROTO_TCP && !pkt.is_syn() {
            return SHOT;
        }
        count(COUNT_EXT_ICMP_UNREACH);
        return REFUSE;
    }

    let hash = flow_hash(&pkt.saddr, &pkt.daddr, pkt.sport, pkt.dport, pkt.proto);
    // ClientIP affinity: the client's pinned backend, else Maglev's choice, pinned.
    let affinity = svc.flags & SVC_F_AFFINITY != 0;
    let pinned = if affinity {
        s.akey = ClientAffinityKey {
            client: pkt.saddr,
            svc_id: svc.svc_id,
        };
        pinned_backend(s, &svc, now)
    } else {
        None
    };
    let (backend_id, backend) = match pinned {
        Some(b) => {
            count(COUNT_EXT_AFFINITY_HIT);
            b
        }
        None => {
            let Some((backend_id, backend)) = maglev_backend(&svc, hash) else {
                return OK;
            };
            if affinity {
                s.aval = AffinityValue {
                    last_used_ns: now,
                    backend_id,
                    _pad: 0,
                };
                if TC_AFFINITY.insert(&s.akey, &s.aval, 0).is_err() {
                    count(COUNT_AFFINITY_FULL);
                }
            }
            (backend_id, backend)
        }
    };
    if addr_is_v4(&backend.addr) == pkt.v6 {
        count(COUNT_BACKEND_MISSING);
        warn!(
            ctx,
            "ferry tc: service id {} backend {} is of the other family", svc.svc_id, backend_id
        );
        return OK;
    }

    let local = backend.flags & BACKEND_F_LOCAL != 0;
    let snat = svc.flags & SVC_F_LOCAL_POLICY == 0 && !local;
    let flags = if local { CT_F_LOCAL_BACKEND } else { 0 };
    s.entry = CtEntry {
        last_seen_ns: now,
        nat_addr: backend.addr,
        snat_addr: [0; 4],
        backend_id,
        svc_id: svc.svc_id,
        nat_port: backend.port,
        snat_port: 0,
        flags,
        tcp_seen: ct::seen_bits(pkt, false),
        _pad: [0; 2],
    };
    // The reply entry always names the client (snat_addr/snat_port) and the frontend.
    s.reply = CtEntry {
        last_seen_ns: now,
        nat_addr: pkt.daddr,
        snat_addr: pkt.saddr,
        backend_id,
        svc_id: svc.svc_id,
        nat_port: pkt.dport,
        snat_port: pkt.sport,
        flags,
        tcp_seen: 0,
        _pad: [0; 2],
    };
    s.rkey = ct::key(
        backend.addr,
        pkt.saddr,
        backend.port,
        pkt.sport,
        pkt.proto,
        CT_DIR_REPLY,
    );

    if snat {
        // Where does the backend live? The egress device decides the SNAT address.
        let iif = ingress_ifindex(ctx);
        let route = fib::lookup(ctx, &mut s.fib, pkt.v6, &pkt.saddr, &backend.addr, iif, 0);
        if route == Route::Fail {
            count(COUNT_FIB_FAIL);
            return SHOT;
        }
        let akey = SnatAddrKey {
            ifindex: s.fib.ifindex,
            family: if pkt.v6 { FAMILY_V6 } else { FAMILY_V4 },
        };
        // SAFETY: plain data read; the copy is taken at once.
        let Some(snat_addr) = (unsafe { SNAT_ADDRS.get(&akey) }).copied() else {
            count(COUNT_FIB_FAIL);
            warn!(
                ctx,
                "ferry tc: no source-NAT address for device {}", akey.ifindex
            );
            return SHOT;
        };
        s.reply.flags = flags | CT_F_SNAT;
        s.entry.flags = flags | CT_F_SNAT;
        s.entry.snat_addr = snat_addr;
        s.rkey.daddr = snat_addr;
        let Some(port) = alloc_port(s, hash, now) else {
            count(COUNT_SNAT_EXHAUSTED);
            return SHOT;
        };
        s.entry.snat_port = port;
        // Too big for the device (the lookup still found it): `forward` looks again
        // with the packet's length and answers with the MTU.
        s.route = match route {
            Route::Resolved => ROUTE_RESOLVED,
            Route::Unresolved => ROUTE_UNRESOLVED,
            _ => ROUTE_NONE,
        };
    } else if CT.insert(&s.rkey, &s.reply, 0).is_err() {
        count(COUNT_CT_FULL);
        return SHOT;
    }
    if CT.insert(&s.okey, &s.entry, 0).is_err() {
        let _ = CT.remove(&s.rkey);
        count(COUNT_CT_FULL);
        return SHOT;
    }
    count(COUNT_EXT_XLATE);
    count_service(svc.svc_id);
    FORWARD
}

/// The backend `s.akey`'s client is pinned to, with its id, if the pin is fresh and the
/// backend still fits the frontend (refreshing the pin: the timeout counts from the
/// client's last new flow, as kube-proxy's `recent`/affinity sets do).
#[inline(always)]
fn pinned_backend(s: &mut Scratch, svc: &ServiceValue, now: u64) -> Option<(u32, Backend)> {
    let ptr = TC_AFFINITY.get_ptr_mut(&s.akey)?;
    // SAFETY: pointer from a successful lookup; LRU entries stay valid for this program run.
    let value = unsafe { &mut *ptr };
    let timeout_ns = svc.affinity_timeout_s as u64 * 1_000_000_000;
    let backend = remembered(value, svc.svc_id, svc.flags, now, timeout_ns)?;
    Some((value.backend_id, backend))
}

/// Maglev's backend for a flow hash: the entry depends on the packet only, so every
/// node and agent generation picks the same one.
#[inline(always)]
fn maglev_backend(svc: &ServiceValue, hash: u32) -> Option<(u32, Backend)> {
    // SAFETY: plain data read.
    // Misses are counted, not logged: aya-log's closures would be call frames of their
    // own below `new_flow`, and that chain is at the 512-byte stack limit.
    let Some(table) = (unsafe { MAGLEV.get(&svc.svc_id) }) else {
        count(COUNT_BACKEND_MISSING);
        return None;
    };
    // The compiler turns `%` into a multiply the verifier cannot bound: hide the value's
    // range from the compiler so that the bounds check stays in for the verifier.
    // SAFETY: reads a local.
    let slot = unsafe { core::ptr::read_volatile(&(hash % MAGLEV_TABLE_SIZE as u32)) } as usize;
    let &backend_id = table.backend_ids.get(slot)?;
    // SAFETY: plain data read; the copy is taken at once.
    match unsafe { BACKENDS.get(&backend_id) } {
        Some(b) => Some((backend_id, *b)),
        None => {
            count(COUNT_BACKEND_MISSING);
            None
        }
    }
}

/// Reserves a source-NAT port by inserting the flow's reply entry (`s.reply`) under it
/// (`s.rkey`, everything but the port filled in). Tries a bounded number of ports from
/// a start that depends on the flow; a port whose flow is gone is taken over. Returns
/// the port (network byte order).
#[inline(always)]
fn alloc_port(s: &mut Scratch, hash: u32, now: u64) -> Option<u16> {
    let start = (hash ^ (hash >> 16)).wrapping_mul(0x9e37_79b1) >> 8;
    let mut i = 0;
    while i < SNAT_TRIES {
        let port = SNAT_PORT_MIN + ((start.wrapping_add(i)) % SNAT_RANGE) as u16;
        s.rkey.dport = port.to_be();
        if CT.insert(&s.rkey, &s.reply, BPF_NOEXIST as u64).is_ok() {
            return Some(s.rkey.dport);
        }
        // SAFETY: plain data read.
        if let Some(old) = unsafe { CT.get(&s.rkey) } {
            if ct::reply_is_stale(&s.rkey, old, now) {
                let _ = CT.remove(&s.rkey);
                if CT.insert(&s.rkey, &s.reply, BPF_NOEXIST as u64).is_ok() {
                    return Some(s.rkey.dport);
                }
            }
        }
        i += 1;
    }
    None
}
