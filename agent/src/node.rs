//! This node's addresses, for NodePorts: every local address except loopback and IPv6
//! link-local, as kube-proxy accepts NodePorts on all local IPs by default.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Local addresses of the current network namespace, sorted and deduplicated.
pub fn local_addresses() -> std::io::Result<Vec<IpAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` walks the list getifaddrs returned; entries stay valid until freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_addr is non-null and points at a sockaddr of the family it states.
        let ip = unsafe {
            match (*ifa.ifa_addr).sa_family as i32 {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
                }
                _ => continue,
            }
        };
        if usable_for_nodeport(&ip) {
            out.push(ip);
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out.sort();
    out.dedup();
    Ok(out)
}

/// NodePorts are never served on loopback (kube-proxy's nftables and IPv6 behaviour) or
/// on IPv6 link-local addresses (not routable without a zone).
pub fn usable_for_nodeport(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => !v4.is_loopback() && !v4.is_unspecified(),
        IpAddr::V6(v6) => {
            !v6.is_loopback() && !v6.is_unspecified() && (v6.segments()[0] & 0xffc0) != 0xfe80
        }
    }
}

/// The hostname, the default node name when neither `--node-name` nor `NODE_NAME` is set.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into our buffer.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "localhost".into();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_link_local_are_not_nodeport_addresses() {
        for bad in ["127.0.0.1", "127.5.0.1", "::1", "fe80::1", "0.0.0.0"] {
            assert!(
                !usable_for_nodeport(&bad.parse().unwrap()),
                "{bad} must not serve NodePorts"
            );
        }
        for good in ["10.0.0.1", "192.168.1.5", "fd00::1", "2001:db8::5"] {
            assert!(
                usable_for_nodeport(&good.parse().unwrap()),
                "{good} must serve NodePorts"
            );
        }
    }
}
