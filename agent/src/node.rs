//! This node's addresses, for NodePorts: every local address except loopback and IPv6
//! link-local, as kube-proxy accepts NodePorts on all local IPs by default.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Local addresses of the current network namespace, sorted and deduplicated.
pub fn local_addresses() -> std::io::Result<Vec<IpAddr>> {
    let mut out: Vec<IpAddr> = interface_addresses()?
        .into_iter()
        .map(|(_, ip)| ip)
        .collect();
    out.sort();
    out.dedup();
    Ok(out)
}

/// (device, address) for every address that can serve NodePorts, in the kernel's order
/// (a device's primary address first).
pub fn interface_addresses() -> std::io::Result<Vec<(String, IpAddr)>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` walks the list getifaddrs returned; entries stay valid until freed.
        let name = unsafe { std::ffi::CStr::from_ptr((*cur).ifa_name) }
            .to_string_lossy()
            .into_owned();
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
            out.push((name, ip));
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The interface index of `device`, `None` when there is no such device.
pub fn ifindex(device: &str) -> Option<u32> {
    let name = std::ffi::CString::new(device).ok()?;
    // SAFETY: a valid C string; if_nametoindex only reads it.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    (index != 0).then_some(index)
}

/// The tc devices when `--devices` is not given: those that carry a node address,
/// never loopback.
pub fn default_devices(addresses: &[(String, IpAddr)], node_ips: &[IpAddr]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (device, ip) in addresses {
        if device != "lo" && node_ips.contains(ip) && !out.contains(device) {
            out.push(device.clone());
        }
    }
    out
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
    fn default_devices_carry_node_addresses() {
        let addrs: Vec<(String, IpAddr)> = [
            ("lo", "10.9.9.9"),
            ("eth0", "192.168.1.10"),
            ("eth0", "fd00::10"),
            ("eth1", "10.1.0.2"),
            ("cni0", "10.244.0.1"),
        ]
        .iter()
        .map(|(d, ip)| (d.to_string(), ip.parse().unwrap()))
        .collect();
        let node_ips: Vec<IpAddr> = ["192.168.1.10", "fd00::10", "10.1.0.2", "10.9.9.9"]
            .iter()
            .map(|ip| ip.parse().unwrap())
            .collect();
        assert_eq!(default_devices(&addrs, &node_ips), ["eth0", "eth1"]);
    }

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
