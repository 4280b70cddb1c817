//! A small rtnetlink client over a raw `NETLINK_ROUTE` socket: just the link, address
//! and route messages the plugin needs, and the VXLAN device, neighbour and FDB entries
//! of the agent's overlay (`ferry agent --pod-network --overlay vxlan`).
//!
//! A netlink socket stays in the network namespace it was created in, so
//! [`Netlink::in_netns`] creates one on a short-lived thread that has joined the pod's
//! namespace (setns changes only the calling thread), and the rest of the plugin uses it
//! from the main thread.

use std::{
    ffi::c_void,
    fmt,
    fs::File,
    io,
    net::IpAddr,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::Path,
};

use crate::ipam::Cidr;

const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_REPLACE: u16 = 0x100;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_DUMP: u16 = 0x300;
/// In an error message: extended-ack attributes follow the capped request header.
const NLM_F_ACK_TLVS: u16 = 0x200;
const NLMSGERR_ATTR_MSG: u16 = 1;
const SOL_NETLINK: i32 = 270;
const NETLINK_CAP_ACK: i32 = 10;
const NETLINK_EXT_ACK: i32 = 11;

const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_GETLINK: u16 = 18;
const RTM_NEWADDR: u16 = 20;
const RTM_GETADDR: u16 = 22;
const RTM_NEWROUTE: u16 = 24;
const RTM_DELROUTE: u16 = 25;
const RTM_GETROUTE: u16 = 26;
const RTM_NEWNEIGH: u16 = 28;
const RTM_DELNEIGH: u16 = 29;
const RTM_GETNEIGH: u16 = 30;

const NDA_DST: u16 = 1;
const NDA_LLADDR: u16 = 2;
const NUD_PERMANENT: u16 = 0x80;
/// An FDB entry of the device itself (the VXLAN driver's table), not of a bridge.
const NTF_SELF: u8 = 0x02;
const AF_BRIDGE: u8 = 7;

const IFLA_VXLAN_ID: u16 = 1;
const IFLA_VXLAN_LOCAL: u16 = 4;
const IFLA_VXLAN_LEARNING: u16 = 7;
const IFLA_VXLAN_PORT: u16 = 15;
const IFLA_VXLAN_LOCAL6: u16 = 17;
/// Route flag: the gateway is on the link even without an address in its subnet.
const RTNH_F_ONLINK: u32 = 4;

const IFLA_ADDRESS: u16 = 1;
const IFLA_IFNAME: u16 = 3;
const IFLA_MTU: u16 = 4;
const IFLA_LINK: u16 = 5;
const IFLA_LINKINFO: u16 = 18;
const IFLA_NET_NS_FD: u16 = 28;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const VETH_INFO_PEER: u16 = 1;
const IFF_UP: u32 = 0x1;

const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_F_NODAD: u8 = 0x2;

const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RTA_TABLE: u16 = 15;
const RT_TABLE_MAIN: u8 = 254;
/// Routes the plugin makes are `proto static`.
pub const RTPROT_STATIC: u8 = 4;
const RTN_UNICAST: u8 = 1;
pub const RT_SCOPE_UNIVERSE: u8 = 0;
pub const RT_SCOPE_LINK: u8 = 253;

/// A failed netlink request: the errno and the kernel's extended-ack message, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NlError {
    pub errno: i32,
    pub ext: Option<String>,
}

impl fmt::Display for NlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", io::Error::from_raw_os_error(self.errno))?;
        if let Some(m) = &self.ext {
            write!(f, " ({m})")?;
        }
        Ok(())
    }
}

impl From<io::Error> for NlError {
    fn from(e: io::Error) -> NlError {
        NlError {
            errno: e.raw_os_error().unwrap_or(libc::EIO),
            ext: None,
        }
    }
}

type NlResult<T> = Result<T, NlError>;

/// A link as RTM_GETLINK reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: i32,
    pub name: String,
    pub up: bool,
    pub mtu: u32,
    pub mac: Vec<u8>,
    /// The peer's index (a veth's other end, possibly in another namespace).
    pub peer_index: Option<i32>,
}

/// A route of the main table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub dst: Cidr,
    pub gateway: Option<IpAddr>,
    pub oif: Option<i32>,
    pub scope: u8,
    /// Who made it (`RTPROT_*`): the agent marks its routes between nodes with its own
    /// number, so that it never touches routes it did not make.
    pub protocol: u8,
    /// The gateway is on the link whatever the link's addresses (`onlink`): the overlay
    /// routes via the other nodes' VXLAN endpoints.
    pub onlink: bool,
}

/// A permanent neighbour (IP -> MAC) or, on a VXLAN device, an FDB entry (MAC -> the
/// remote endpoint's underlay IP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Neighbour {
    pub ip: IpAddr,
    pub mac: [u8; 6],
}

pub struct Netlink {
    fd: OwnedFd,
    seq: u32,
}

impl Netlink {
    /// A socket in the calling thread's network namespace.
    pub fn open() -> io::Result<Netlink> {
        // SAFETY: plain socket(2) call; the result is checked before use.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        for opt in [NETLINK_EXT_ACK, NETLINK_CAP_ACK] {
            let one: i32 = 1;
            // SAFETY: setsockopt with a pointer to a live i32 and its size. Failure only
            // loses the kernel's error text, so it is ignored.
            unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    SOL_NETLINK,
                    opt,
                    (&one as *const i32).cast(),
                    size_of::<i32>() as u32,
                );
            }
        }
        Ok(Netlink { fd, seq: 0 })
    }

    /// A socket in the network namespace at `netns` (e.g. `/run/netns/pod`).
    pub fn in_netns(netns: &Path) -> io::Result<Netlink> {
        let ns = File::open(netns)?;
        std::thread::spawn(move || {
            // SAFETY: setns on this helper thread only; it ends right after.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Netlink::open()
        })
        .join()
        .map_err(|_| io::Error::other("netns thread panicked"))?
    }

    /// The link named `name`, or `None` when there is none.
    pub fn link(&mut self, name: &str) -> NlResult<Option<Link>> {
        let mut m = Msg::new(RTM_GETLINK, NLM_F_REQUEST | NLM_F_ACK);
        m.ifinfo(0, 0, 0);
        m.attr(IFLA_IFNAME, &cstr(name));
        match self.transact(m) {
            Ok(replies) => Ok(replies.iter().find_map(|r| parse_link(r))),
            Err(e) if e.errno == libc::ENODEV => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every link of the namespace.
    pub fn links(&mut self) -> NlResult<Vec<Link>> {
        let mut m = Msg::new(RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP);
        m.ifinfo(0, 0, 0);
        Ok(self.transact(m)?.iter().filter_map(|r| parse_link(r)).collect())
    }

    /// Deletes the link named `name`; `false` when there was none.
    pub fn delete_link(&mut self, name: &str) -> NlResult<bool> {
        let mut m = Msg::new(RTM_DELLINK, NLM_F_REQUEST | NLM_F_ACK);
        m.ifinfo(0, 0, 0);
        m.attr(IFLA_IFNAME, &cstr(name));
        match self.transact(m) {
            Ok(_) => Ok(true),
            Err(e) if e.errno == libc::ENODEV => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Creates a veth pair: `host` here, `peer` in the namespace of `peer_netns`, both
    /// with `mtu`.
    pub fn create_veth(
        &mut self,
        host: &str,
        peer: &str,
        peer_netns: &File,
        mtu: u32,
    ) -> NlResult<()> {
        let mut m = Msg::new(
            RTM_NEWLINK,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
        );
        m.ifinfo(0, 0, 0);
        m.attr(IFLA_IFNAME, &cstr(host));
        m.attr(IFLA_MTU, &mtu.to_ne_bytes());
        let info = m.begin(IFLA_LINKINFO);
        m.attr(IFLA_INFO_KIND, b"veth");
        let data = m.begin(IFLA_INFO_DATA);
        let p = m.begin(VETH_INFO_PEER);
        m.ifinfo(0, 0, 0);
        m.attr(IFLA_IFNAME, &cstr(peer));
        m.attr(IFLA_MTU, &mtu.to_ne_bytes());
        m.attr(
            IFLA_NET_NS_FD,
            &(peer_netns.as_raw_fd() as u32).to_ne_bytes(),
        );
        m.end(p);
        m.end(data);
        m.end(info);
        self.transact(m).map(drop)
    }

    pub fn set_up(&mut self, index: i32) -> NlResult<()> {
        let mut m = Msg::new(RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK);
        m.ifinfo(index, IFF_UP, IFF_UP);
        self.transact(m).map(drop)
    }

    /// Adds (or replaces) an address; IPv6 addresses skip duplicate address detection.
    pub fn add_address(&mut self, index: i32, addr: Cidr, scope: u8) -> NlResult<()> {
        let mut m = Msg::new(
            RTM_NEWADDR,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        );
        let flags = if addr.is_v4() { 0 } else { IFA_F_NODAD };
        m.ifaddr(family(addr.addr), addr.prefix, flags, scope, index);
        m.attr(IFA_LOCAL, &octets(addr.addr));
        m.attr(IFA_ADDRESS, &octets(addr.addr));
        self.transact(m).map(drop)
    }

    /// The addresses of link `index`.
    pub fn addresses(&mut self, index: i32) -> NlResult<Vec<Cidr>> {
        let mut m = Msg::new(RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP);
        m.ifaddr(libc::AF_UNSPEC as u8, 0, 0, 0, 0);
        let mut out = Vec::new();
        for r in self.transact(m)? {
            if r.len() < 8 || u32::from_ne_bytes(r[4..8].try_into().unwrap()) != index as u32 {
                continue;
            }
            let prefix = r[1];
            let attrs = attrs(&r[8..]);
            let find = |t| attrs.iter().find(|(k, _)| *k == t).and_then(|(_, v)| ip(v));
            if let Some(addr) = find(IFA_LOCAL).or_else(|| find(IFA_ADDRESS)) {
                out.push(Cidr { addr, prefix });
            }
        }
        Ok(out)
    }

    /// Adds (or replaces) a route of the main table.
    pub fn add_route(&mut self, r: &Route) -> NlResult<()> {
        let mut m = Msg::new(
            RTM_NEWROUTE,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        );
        route_body(&mut m, r);
        self.transact(m).map(drop)
    }

    /// Deletes a route of the main table; `false` when it was not there.
    pub fn delete_route(&mut self, r: &Route) -> NlResult<bool> {
        let mut m = Msg::new(RTM_DELROUTE, NLM_F_REQUEST | NLM_F_ACK);
        route_body(&mut m, r);
        match self.transact(m) {
            Ok(_) => Ok(true),
            Err(e) if e.errno == libc::ESRCH => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The routes of the main table, both families.
    pub fn routes(&mut self) -> NlResult<Vec<Route>> {
        let mut m = Msg::new(RTM_GETROUTE, NLM_F_REQUEST | NLM_F_DUMP);
        m.rtmsg(libc::AF_UNSPEC as u8, 0, 0, 0, 0, 0);
        let mut out = Vec::new();
        for r in self.transact(m)? {
            if r.len() < 12 {
                continue;
            }
            let (fam, dst_len, table, protocol, scope) = (r[0], r[1], r[4], r[5], r[6]);
            let flags = u32::from_ne_bytes(r[8..12].try_into().unwrap());
            let attrs = attrs(&r[12..]);
            let get = |t| attrs.iter().find(|(k, _)| *k == t).map(|(_, v)| *v);
            let table = get(RTA_TABLE)
                .and_then(|v| v.try_into().ok().map(u32::from_ne_bytes))
                .unwrap_or(table as u32);
            if table != RT_TABLE_MAIN as u32 {
                continue;
            }
            let v4 = fam == libc::AF_INET as u8;
            let addr = get(RTA_DST)
                .and_then(ip)
                .unwrap_or_else(|| crate::plan::default_dst(v4).addr);
            out.push(Route {
                dst: Cidr {
                    addr,
                    prefix: dst_len,
                },
                gateway: get(RTA_GATEWAY).and_then(ip),
                oif: get(RTA_OIF).and_then(|v| v.try_into().ok().map(i32::from_ne_bytes)),
                scope,
                protocol,
                onlink: flags & RTNH_F_ONLINK != 0,
            });
        }
        Ok(out)
    }

    /// Creates a VXLAN device without learning (entries come from [`Self::replace_fdb`]
    /// and [`Self::replace_neighbour`]): VNI `vni`, UDP `port`, underlay source `local`,
    /// with `mac` and `mtu`.
    pub fn create_vxlan(
        &mut self,
        name: &str,
        vni: u32,
        local: IpAddr,
        port: u16,
        mac: [u8; 6],
        mtu: u32,
    ) -> NlResult<()> {
        let mut m = Msg::new(
            RTM_NEWLINK,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
        );
        m.ifinfo(0, 0, 0);
        m.attr(IFLA_IFNAME, &cstr(name));
        m.attr(IFLA_ADDRESS, &mac);
        m.attr(IFLA_MTU, &mtu.to_ne_bytes());
        let info = m.begin(IFLA_LINKINFO);
        m.attr(IFLA_INFO_KIND, b"vxlan");
        let data = m.begin(IFLA_INFO_DATA);
        m.attr(IFLA_VXLAN_ID, &vni.to_ne_bytes());
        match local {
            IpAddr::V4(a) => m.attr(IFLA_VXLAN_LOCAL, &a.octets()),
            IpAddr::V6(a) => m.attr(IFLA_VXLAN_LOCAL6, &a.octets()),
        }
        m.attr(IFLA_VXLAN_PORT, &port.to_be_bytes());
        m.attr(IFLA_VXLAN_LEARNING, &[0]);
        m.end(data);
        m.end(info);
        self.transact(m).map(drop)
    }

    /// The permanent neighbours of link `index` (IPv4 and IPv6).
    pub fn neighbours(&mut self, index: i32) -> NlResult<Vec<Neighbour>> {
        self.neigh_dump(libc::AF_UNSPEC as u8, index)
    }

    /// The FDB entries with a remote endpoint of link `index` (a VXLAN device).
    pub fn fdb(&mut self, index: i32) -> NlResult<Vec<Neighbour>> {
        self.neigh_dump(AF_BRIDGE, index)
    }

    fn neigh_dump(&mut self, family: u8, index: i32) -> NlResult<Vec<Neighbour>> {
        let mut m = Msg::new(RTM_GETNEIGH, NLM_F_REQUEST | NLM_F_DUMP);
        m.ndmsg(family, 0, 0, 0);
        let mut out = Vec::new();
        for r in self.transact(m)? {
            if r.len() < 12 || i32::from_ne_bytes(r[4..8].try_into().unwrap()) != index {
                continue;
            }
            let attrs = attrs(&r[12..]);
            let get = |t| attrs.iter().find(|(k, _)| *k == t).map(|(_, v)| *v);
            let (Some(ip), Some(mac)) = (
                get(NDA_DST).and_then(ip),
                get(NDA_LLADDR).and_then(|v| <[u8; 6]>::try_from(v).ok()),
            ) else {
                continue;
            };
            out.push(Neighbour { ip, mac });
        }
        Ok(out)
    }

    /// Makes `n.ip` resolve to `n.mac` on link `index`, permanently.
    pub fn replace_neighbour(&mut self, index: i32, n: &Neighbour) -> NlResult<()> {
        let mut m = Msg::new(
            RTM_NEWNEIGH,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        );
        m.ndmsg(family(n.ip), index, NUD_PERMANENT, 0);
        m.attr(NDA_DST, &octets(n.ip));
        m.attr(NDA_LLADDR, &n.mac);
        self.transact(m).map(drop)
    }

    pub fn delete_neighbour(&mut self, index: i32, n: &Neighbour) -> NlResult<bool> {
        let mut m = Msg::new(RTM_DELNEIGH, NLM_F_REQUEST | NLM_F_ACK);
        m.ndmsg(family(n.ip), index, 0, 0);
        m.attr(NDA_DST, &octets(n.ip));
        match self.transact(m) {
            Ok(_) => Ok(true),
            Err(e) if e.errno == libc::ENOENT => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Sends frames for `n.mac` on VXLAN link `index` to the endpoint `n.ip`.
    pub fn replace_fdb(&mut self, index: i32, n: &Neighbour) -> NlResult<()> {
        let mut m = Msg::new(
            RTM_NEWNEIGH,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        );
        m.ndmsg(AF_BRIDGE, index, NUD_PERMANENT, NTF_SELF);
        m.attr(NDA_LLADDR, &n.mac);
        m.attr(NDA_DST, &octets(n.ip));
        self.transact(m).map(drop)
    }

    pub fn delete_fdb(&mut self, index: i32, n: &Neighbour) -> NlResult<bool> {
        let mut m = Msg::new(RTM_DELNEIGH, NLM_F_REQUEST | NLM_F_ACK);
        m.ndmsg(AF_BRIDGE, index, 0, NTF_SELF);
        m.attr(NDA_LLADDR, &n.mac);
        m.attr(NDA_DST, &octets(n.ip));
        match self.transact(m) {
            Ok(_) => Ok(true),
            Err(e) if e.errno == libc::ENOENT => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Sends one request and collects the replies until its ACK, error or DONE.
    fn transact(&mut self, mut m: Msg) -> NlResult<Vec<Vec<u8>>> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let buf = m.finish(seq);
        // SAFETY: sends a live buffer of its own length; the kernel is the peer (the
        // socket's default destination when no address is given is invalid, so a zeroed
        // sockaddr_nl is passed).
        let sent = unsafe {
            let mut sa: libc::sockaddr_nl = std::mem::zeroed();
            sa.nl_family = libc::AF_NETLINK as u16;
            libc::sendto(
                self.fd.as_raw_fd(),
                buf.as_ptr().cast::<c_void>(),
                buf.len(),
                0,
                (&sa as *const libc::sockaddr_nl).cast(),
                size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error().into());
        }
        let mut out = Vec::new();
        let mut rbuf = vec![0u8; 1 << 16];
        loop {
            // SAFETY: receives into a live buffer of its own length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    rbuf.as_mut_ptr().cast::<c_void>(),
                    rbuf.len(),
                    0,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e.into());
            }
            let mut rest = &rbuf[..n as usize];
            while rest.len() >= NLMSG_HDRLEN {
                let len = u32::from_ne_bytes(rest[0..4].try_into().unwrap()) as usize;
                if len < NLMSG_HDRLEN || len > rest.len() {
                    break;
                }
                let ty = u16::from_ne_bytes(rest[4..6].try_into().unwrap());
                let flags = u16::from_ne_bytes(rest[6..8].try_into().unwrap());
                let mseq = u32::from_ne_bytes(rest[8..12].try_into().unwrap());
                let payload = &rest[NLMSG_HDRLEN..len];
                rest = &rest[align(len).min(rest.len())..];
                if mseq != seq {
                    continue;
                }
                match ty {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR => {
                        let errno = i32::from_ne_bytes(payload[0..4].try_into().unwrap());
                        if errno == 0 {
                            return Ok(out);
                        }
                        let ext = (flags & NLM_F_ACK_TLVS != 0 && payload.len() > 4 + NLMSG_HDRLEN)
                            .then(|| attrs(&payload[4 + NLMSG_HDRLEN..]))
                            .and_then(|a| {
                                a.iter()
                                    .find(|(t, _)| *t == NLMSGERR_ATTR_MSG)
                                    .map(|(_, v)| {
                                        String::from_utf8_lossy(v)
                                            .trim_end_matches('\0')
                                            .to_string()
                                    })
                            });
                        return Err(NlError { errno: -errno, ext });
                    }
                    _ => out.push(payload.to_vec()),
                }
            }
        }
    }
}

fn route_body(m: &mut Msg, r: &Route) {
    m.rtmsg(
        family(r.dst.addr),
        r.dst.prefix,
        RT_TABLE_MAIN,
        r.protocol,
        r.scope,
        RTN_UNICAST,
    );
    if r.onlink {
        let at = m.buf.len() - 4;
        m.buf[at..].copy_from_slice(&RTNH_F_ONLINK.to_ne_bytes());
    }
    if r.dst.prefix > 0 {
        m.attr(RTA_DST, &octets(r.dst.addr));
    }
    if let Some(gw) = r.gateway {
        m.attr(RTA_GATEWAY, &octets(gw));
    }
    if let Some(oif) = r.oif {
        m.attr(RTA_OIF, &oif.to_ne_bytes());
    }
}

fn parse_link(r: &[u8]) -> Option<Link> {
    if r.len() < 16 {
        return None;
    }
    let index = i32::from_ne_bytes(r[4..8].try_into().unwrap());
    let flags = u32::from_ne_bytes(r[8..12].try_into().unwrap());
    let attrs = attrs(&r[16..]);
    let get = |t| attrs.iter().find(|(k, _)| *k == t).map(|(_, v)| *v);
    let u32_of = |v: &[u8]| v.try_into().ok().map(u32::from_ne_bytes);
    Some(Link {
        index,
        name: String::from_utf8_lossy(get(IFLA_IFNAME)?)
            .trim_end_matches('\0')
            .to_string(),
        up: flags & IFF_UP != 0,
        mtu: get(IFLA_MTU).and_then(u32_of).unwrap_or(0),
        mac: get(IFLA_ADDRESS).map(<[u8]>::to_vec).unwrap_or_default(),
        peer_index: get(IFLA_LINK).and_then(u32_of).map(|v| v as i32),
    })
}

fn family(ip: IpAddr) -> u8 {
    if ip.is_ipv4() {
        libc::AF_INET as u8
    } else {
        libc::AF_INET6 as u8
    }
}

fn octets(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

fn ip(v: &[u8]) -> Option<IpAddr> {
    match v.len() {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(v).ok()?)),
        16 => Some(IpAddr::from(<[u8; 16]>::try_from(v).ok()?)),
        _ => None,
    }
}

fn cstr(s: &str) -> Vec<u8> {
    s.bytes().chain([0]).collect()
}

fn align(n: usize) -> usize {
    (n + 3) & !3
}

/// The attributes of a message body: (type without the nested/byte-order flags, value).
fn attrs(mut b: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while b.len() >= 4 {
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let ty = u16::from_ne_bytes([b[2], b[3]]) & 0x3fff;
        if len < 4 || len > b.len() {
            break;
        }
        out.push((ty, &b[4..len]));
        b = &b[align(len).min(b.len())..];
    }
    out
}

/// A request being built: header, fixed body, attributes (nested ones patched on end).
struct Msg {
    buf: Vec<u8>,
}

impl Msg {
    fn new(ty: u16, flags: u16) -> Msg {
        let mut buf = vec![0u8; NLMSG_HDRLEN];
        buf[4..6].copy_from_slice(&ty.to_ne_bytes());
        buf[6..8].copy_from_slice(&flags.to_ne_bytes());
        Msg { buf }
    }

    /// `struct ifinfomsg` (AF_UNSPEC).
    fn ifinfo(&mut self, index: i32, flags: u32, change: u32) {
        self.buf.extend_from_slice(&[0, 0, 0, 0]);
        self.buf.extend_from_slice(&index.to_ne_bytes());
        self.buf.extend_from_slice(&flags.to_ne_bytes());
        self.buf.extend_from_slice(&change.to_ne_bytes());
    }

    /// `struct ifaddrmsg`.
    fn ifaddr(&mut self, family: u8, prefix: u8, flags: u8, scope: u8, index: i32) {
        self.buf.extend_from_slice(&[family, prefix, flags, scope]);
        self.buf.extend_from_slice(&(index as u32).to_ne_bytes());
    }

    /// `struct ndmsg`.
    fn ndmsg(&mut self, family: u8, index: i32, state: u16, flags: u8) {
        self.buf.extend_from_slice(&[family, 0, 0, 0]);
        self.buf.extend_from_slice(&index.to_ne_bytes());
        self.buf.extend_from_slice(&state.to_ne_bytes());
        self.buf.extend_from_slice(&[flags, 0]);
    }

    /// `struct rtmsg`.
    fn rtmsg(&mut self, family: u8, dst_len: u8, table: u8, proto: u8, scope: u8, kind: u8) {
        self.buf
            .extend_from_slice(&[family, dst_len, 0, 0, table, proto, scope, kind]);
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
    }

    fn attr(&mut self, ty: u16, data: &[u8]) {
        self.buf
            .extend_from_slice(&((4 + data.len()) as u16).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.buf.resize(align(self.buf.len()), 0);
    }

    /// Opens a nested attribute; returns where its header is.
    fn begin(&mut self, ty: u16) -> usize {
        let at = self.buf.len();
        self.attr(ty, &[]);
        at
    }

    fn end(&mut self, at: usize) {
        let len = (self.buf.len() - at) as u16;
        self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    }

    fn finish(&mut self, seq: u32) -> &[u8] {
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf[8..12].copy_from_slice(&seq.to_ne_bytes());
        &self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_attributes_are_sized_and_aligned() {
        let mut m = Msg::new(RTM_NEWLINK, NLM_F_REQUEST);
        m.ifinfo(0, 0, 0);
        let info = m.begin(IFLA_LINKINFO);
        m.attr(IFLA_INFO_KIND, b"veth");
        m.end(info);
        let b = m.finish(7).to_vec();
        assert_eq!(b.len(), 16 + 16 + 4 + 8);
        assert_eq!(
            u32::from_ne_bytes(b[0..4].try_into().unwrap()) as usize,
            b.len()
        );
        let top = attrs(&b[32..]);
        assert_eq!(top.len(), 1);
        assert_eq!(top[0].0, IFLA_LINKINFO);
        assert_eq!(attrs(top[0].1), vec![(IFLA_INFO_KIND, &b"veth"[..])]);
    }
}
