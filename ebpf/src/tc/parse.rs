//! Header parsing: Ethernet, IPv4 (any IHL) or IPv6 (no extension headers but a fragment
//! header), TCP or UDP. A first fragment is a flow packet with [`Pkt::frag`] set; later
//! fragments (no ports), ICMP and everything else are not: `frag` and `icmp_err` look at
//! those when [`parse`] says `None`.

use aya_ebpf::programs::TcContext;
use ferry_common::{
    Addr, addr_from_v4_be,
    lb::{PROTO_TCP, PROTO_UDP},
};

/// Ethernet header length; the IP header starts here.
pub(crate) const ETH_HLEN: u32 = 14;
pub(crate) const ETH_P_IP: u16 = 0x0800;
pub(crate) const ETH_P_IPV6: u16 = 0x86dd;
/// Fragment offset bits of the IPv4 `frag_off` field (host order).
pub(crate) const IP_OFFSET: u16 = 0x1fff;
/// More Fragments bit of the IPv4 `frag_off` field (host order).
pub(crate) const IP_MF: u16 = 0x2000;
/// Don't Fragment bit of the IPv4 `frag_off` field (host order).
pub(crate) const IP_DF: u16 = 0x4000;
/// IPv6 next header: fragment header.
pub(crate) const NEXTHDR_FRAGMENT: u8 = 44;
/// Offset of the IPv6 fragment header (no other extension header before it).
pub(crate) const V6_FRAG_OFF: u32 = ETH_HLEN + 40;

/// [`Pkt::frag`]: not a fragment.
pub(crate) const FRAG_NONE: u8 = 0;
/// [`Pkt::frag`]: the first fragment of a datagram (it carries the ports).
pub(crate) const FRAG_FIRST: u8 = 1;

pub(crate) const TCP_FIN: u8 = 0x01;
pub(crate) const TCP_SYN: u8 = 0x02;
pub(crate) const TCP_RST: u8 = 0x04;
pub(crate) const TCP_ACK: u8 = 0x10;

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Ipv4Hdr {
    pub(crate) ver_ihl: u8,
    pub(crate) tos: u8,
    pub(crate) tot_len: u16,
    pub(crate) id: u16,
    pub(crate) frag_off: u16,
    pub(crate) ttl: u8,
    pub(crate) proto: u8,
    pub(crate) csum: u16,
    pub(crate) saddr: u32,
    pub(crate) daddr: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Ipv6Hdr {
    pub(crate) ver_tc_flow: u32,
    pub(crate) payload_len: u16,
    pub(crate) nexthdr: u8,
    pub(crate) hop_limit: u8,
    pub(crate) saddr: Addr,
    pub(crate) daddr: Addr,
}

/// IPv6 fragment header (RFC 8200 §4.5).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct FragHdr {
    pub(crate) nexthdr: u8,
    pub(crate) _reserved: u8,
    /// Offset (13 bits, in 8-byte units) and M flag (bit 0), network byte order.
    pub(crate) off_m: u16,
    /// Identification, network byte order.
    pub(crate) id: u32,
}

/// The first 14 bytes of a TCP header (through the flags); a UDP header is 8.
#[repr(C)]
#[derive(Clone, Copy)]
struct L4Head {
    sport: u16,
    dport: u16,
    _seq_or_len_csum: u32,
    _ack: u32,
    doff: u8,
    flags: u8,
}

/// One parsed TCP or UDP packet. Addresses and ports as the maps store them (network
/// byte order, IPv4 mapped).
#[derive(Clone, Copy)]
pub(crate) struct Pkt {
    pub(crate) v6: bool,
    pub(crate) proto: u8,
    /// TCP flags (0 for UDP).
    pub(crate) tcp_flags: u8,
    /// IPv4 header length (IHL * 4), or 40 (48 with a fragment header).
    pub(crate) ip_hlen: u32,
    /// TCP header length (data offset * 4), 8 for UDP.
    pub(crate) l4_hlen: u32,
    /// IPv4: Don't Fragment is set. IPv6: always (routers never fragment).
    pub(crate) df: bool,
    /// `FRAG_NONE` or `FRAG_FIRST`.
    pub(crate) frag: u8,
    /// IPv4 identification or IPv6 fragment identification, as on the wire (fragments).
    pub(crate) frag_id: u32,
    /// IP packet length (header included), from the IP header.
    pub(crate) ip_len: u32,
    /// IPv4 TTL or IPv6 hop limit.
    pub(crate) ttl: u8,
    pub(crate) saddr: Addr,
    pub(crate) daddr: Addr,
    pub(crate) sport: u16,
    pub(crate) dport: u16,
}

impl Pkt {
    /// Offset of the TCP or UDP header.
    #[inline(always)]
    pub(crate) fn l4_off(&self) -> u32 {
        ETH_HLEN + self.ip_hlen
    }

    /// Offset of the TCP or UDP checksum.
    #[inline(always)]
    pub(crate) fn l4_csum_off(&self) -> u32 {
        self.l4_off() + if self.proto == PROTO_TCP { 16 } else { 6 }
    }

    /// A TCP SYN that opens a connection (no ACK).
    #[inline(always)]
    pub(crate) fn is_syn(&self) -> bool {
        self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }
}

/// Parses the packet into `out`; `false` when the tc path has nothing to do with it.
///
/// A call of its own: its header copies then stay out of the entry points' stack frame,
/// which every deeper call (`new_flow`, the ICMP path) adds to; inlined, the ingress
/// chain through `new_flow` sat exactly at the verifier's 512-byte limit. It writes
/// through a pointer instead of returning `Option<Pkt>`: a call's signature goes into the
/// object's BTF, and rustc describes that `Option` as a union with a member at a non-zero
/// offset, which the kernel rejects (the whole BTF, and with it the programs' line info).
///
/// # Safety
/// `out` points to memory for one `Pkt` (it may be uninitialised); it is written whole
/// when the answer is true.
#[inline(never)]
pub(crate) unsafe fn parse(ctx: &TcContext, out: *mut Pkt) -> bool {
    match parse_packet(ctx) {
        Some(pkt) => {
            // SAFETY: the caller's stack slot for one `Pkt`.
            unsafe { out.write(pkt) };
            true
        }
        None => false,
    }
}

/// A header at packet offset `off`: read in place when the skb's linear part holds it
/// (always, for packets a stack built or a NIC received), else copied out with
/// `bpf_skb_load_bytes` (with its `memcpy`, the copies were a sixth of the ingress
/// program). A plain load: the header structs' fields are at their natural offsets, and
/// BPF loads from packet memory need no alignment on the JITs ferry runs on (x86-64,
/// arm64; the verifier checks alignment only in its strict mode); an unaligned read
/// would compile to one load per byte.
#[inline(always)]
fn read<T: Copy>(ctx: &TcContext, off: usize) -> Option<T> {
    let data = ctx.data();
    if data + off + core::mem::size_of::<T>() <= ctx.data_end() {
        // SAFETY: inside the packet's linear part (checked above).
        return Some(unsafe { core::ptr::read((data + off) as *const T) });
    }
    ctx.load(off).ok()
}

#[inline(always)]
fn parse_packet(ctx: &TcContext) -> Option<Pkt> {
    // SAFETY: the kernel hands every tc program a valid skb for its run.
    let protocol = u16::from_be(unsafe { (*ctx.skb.skb).protocol } as u16);
    let mut pkt = match protocol {
        ETH_P_IP => {
            let ip: Ipv4Hdr = read(ctx, ETH_HLEN as usize)?;
            let ihl = (ip.ver_ihl & 0x0f) as u32;
            let frag_off = u16::from_be(ip.frag_off);
            // A later fragment has no ports: `frag` follows it.
            if ip.ver_ihl >> 4 != 4 || ihl < 5 || frag_off & IP_OFFSET != 0 {
                return None;
            }
            Pkt {
                v6: false,
                proto: ip.proto,
                tcp_flags: 0,
                ip_hlen: ihl * 4,
                l4_hlen: 8,
                df: frag_off & IP_DF != 0,
                frag: if frag_off & IP_MF != 0 {
                    FRAG_FIRST
                } else {
                    FRAG_NONE
                },
                frag_id: ip.id as u32,
                ip_len: u16::from_be(ip.tot_len) as u32,
                ttl: ip.ttl,
                saddr: addr_from_v4_be(ip.saddr),
                daddr: addr_from_v4_be(ip.daddr),
                sport: 0,
                dport: 0,
            }
        }
        ETH_P_IPV6 => {
            let ip: Ipv6Hdr = read(ctx, ETH_HLEN as usize)?;
            if u32::from_be(ip.ver_tc_flow) >> 28 != 6 {
                return None;
            }
            // Other extension headers are not parsed: such packets pass.
            let mut pkt = Pkt {
                v6: true,
                proto: ip.nexthdr,
                tcp_flags: 0,
                ip_hlen: 40,
                l4_hlen: 8,
                df: true,
                frag: FRAG_NONE,
                frag_id: 0,
                ip_len: 40 + u16::from_be(ip.payload_len) as u32,
                ttl: ip.hop_limit,
                saddr: ip.saddr,
                daddr: ip.daddr,
                sport: 0,
                dport: 0,
            };
            if pkt.proto == NEXTHDR_FRAGMENT {
                let fh: FragHdr = read(ctx, V6_FRAG_OFF as usize)?;
                let off_m = u16::from_be(fh.off_m);
                if off_m >> 3 != 0 {
                    return None;
                }
                pkt.proto = fh.nexthdr;
                pkt.ip_hlen = 48;
                pkt.frag = if off_m & 1 != 0 {
                    FRAG_FIRST
                } else {
                    FRAG_NONE
                };
                pkt.frag_id = fh.id;
            }
            pkt
        }
        _ => return None,
    };
    match pkt.proto {
        PROTO_TCP => {
            let l4: L4Head = read(ctx, pkt.l4_off() as usize)?;
            pkt.sport = l4.sport;
            pkt.dport = l4.dport;
            pkt.tcp_flags = l4.flags;
            pkt.l4_hlen = ((l4.doff >> 4) as u32) * 4;
        }
        PROTO_UDP => {
            let ports: [u16; 2] = read(ctx, pkt.l4_off() as usize)?;
            pkt.sport = ports[0];
            pkt.dport = ports[1];
        }
        _ => return None,
    }
    Some(pkt)
}
