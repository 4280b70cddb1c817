//! What an attachment looks like (pure): the host veth's name, the gateway of each
//! family and the addresses the two veth ends carry.
//!
//! Addressing: point to point, no bridge. The pod's interface carries its address as a
//! /32 (/128), a link-scope route to the gateway and the default route via it. The node
//! is the gateway on every host veth:
//! - IPv4: the pod CIDR's first address (the node's own, never given to a pod), put as a
//!   /32 on each host veth, so the node answers ARP for it itself (no proxy ARP) and
//!   connections from the node to a pod leave from a routable address;
//! - IPv6: `fe80::1`, put (without DAD) on each host veth; link-local addresses are per
//!   link by design, so one address serves every pod.
//!
//! On the node, one /32 (/128) route per pod address points at the host veth.

use std::net::{IpAddr, Ipv6Addr};

use crate::{config::Attachment, ipam::Cidr};

/// Host veths are `fry` followed by 11 hex digits.
pub const HOST_VETH_PREFIX: &str = "fry";
/// The pods' IPv6 gateway, on every host veth.
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);

/// The host veth of an attachment: `fry` + 11 hex digits of a 64-bit FNV-1a hash of the
/// network name, container id and interface name. DEL and GC find it from the
/// attachment alone, without state.
pub fn host_veth_name(network: &str, a: &Attachment) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in [network, &a.container_id, &a.ifname] {
        for b in part.bytes().chain([0]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{HOST_VETH_PREFIX}{:011x}", h & ((1 << 44) - 1))
}

/// The gateway of pods with an address in `range`.
pub fn gateway(range: &Cidr) -> IpAddr {
    if range.is_v4() {
        range.node_address()
    } else {
        IpAddr::V6(GATEWAY_V6)
    }
}

/// The address the host veth carries for a gateway: a /32 for IPv4, `fe80::1/64`.
pub fn host_address(gateway: IpAddr) -> Cidr {
    match gateway {
        IpAddr::V4(_) => Cidr::host(gateway),
        IpAddr::V6(_) => Cidr {
            addr: gateway,
            prefix: 64,
        },
    }
}

/// The default route's destination of a family.
pub fn default_dst(v4: bool) -> Cidr {
    let addr = if v4 {
        IpAddr::from([0u8; 4])
    } else {
        IpAddr::from([0u8; 16])
    };
    Cidr { addr, prefix: 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn att(c: &str, i: &str) -> Attachment {
        Attachment {
            container_id: c.into(),
            ifname: i.into(),
        }
    }

    #[test]
    fn host_veth_names_are_stable_short_and_distinct() {
        let a = host_veth_name("ferry", &att("abc", "eth0"));
        assert_eq!(a, host_veth_name("ferry", &att("abc", "eth0")));
        assert_eq!(a.len(), 14);
        assert!(
            a.starts_with("fry") && a[3..].chars().all(|c| c.is_ascii_hexdigit()),
            "{a}"
        );
        assert_ne!(a, host_veth_name("ferry", &att("abc", "eth1")));
        assert_ne!(a, host_veth_name("other", &att("abc", "eth0")));
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(
            host_veth_name("n", &att("ab", "c")),
            host_veth_name("n", &att("a", "bc"))
        );
    }

    #[test]
    fn gateways_per_family() {
        let v4: Cidr = "10.244.1.0/24".parse().unwrap();
        let v6: Cidr = "fd00:10:244:1::/64".parse().unwrap();
        assert_eq!(gateway(&v4).to_string(), "10.244.1.1");
        assert_eq!(host_address(gateway(&v4)).to_string(), "10.244.1.1/32");
        assert_eq!(gateway(&v6).to_string(), "fe80::1");
        assert_eq!(host_address(gateway(&v6)).to_string(), "fe80::1/64");
        assert_eq!(default_dst(true).to_string(), "0.0.0.0/0");
        assert_eq!(default_dst(false).to_string(), "::/0");
    }
}
