//! Which node address the tc path masquerades to, per device and family
//! (`FERRY_SNAT_ADDRS`): the device's first global address of the family, preferring a
//! node address (`--node-ip` or the detected ones), so that replies come back to an
//! address the rest of the cluster routes to this node.

use std::net::IpAddr;

use ferry_common::{
    Addr,
    ext::{FAMILY_V4, FAMILY_V6, SnatAddrKey},
};

use super::plan::addr_of;
use crate::node::usable_for_nodeport;

/// `devices`: (name, ifindex); `addresses`: (device, address) in the kernel's order.
pub fn snat_addresses(
    devices: &[(String, u32)],
    addresses: &[(String, IpAddr)],
    node_ips: &[IpAddr],
) -> Vec<(SnatAddrKey, Addr)> {
    let mut out = Vec::new();
    for (device, ifindex) in devices {
        for (family, v4) in [(FAMILY_V4, true), (FAMILY_V6, false)] {
            let candidates: Vec<&IpAddr> = addresses
                .iter()
                .filter(|(d, ip)| d == device && ip.is_ipv4() == v4 && usable_for_nodeport(ip))
                .map(|(_, ip)| ip)
                .collect();
            let chosen = candidates
                .iter()
                .find(|ip| node_ips.contains(ip))
                .or(candidates.first());
            if let Some(ip) = chosen {
                let key = SnatAddrKey {
                    ifindex: *ifindex,
                    family,
                };
                out.push((key, addr_of(ip)));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::plan::ip_of;

    #[test]
    fn first_global_address_per_family_preferring_node_ips() {
        let addrs: Vec<(String, IpAddr)> = [
            ("eth0", "10.0.0.5"),
            ("eth0", "192.168.1.10"),
            ("eth0", "fe80::1"),
            ("eth0", "fd00::10"),
            ("eth1", "10.1.0.2"),
        ]
        .iter()
        .map(|(d, ip)| (d.to_string(), ip.parse().unwrap()))
        .collect();
        let node_ips: Vec<IpAddr> = vec!["192.168.1.10".parse().unwrap()];
        let devices = vec![
            ("eth0".to_string(), 2),
            ("eth1".to_string(), 3),
            ("eth2".to_string(), 4),
        ];
        let got: Vec<(u32, u32, String)> = snat_addresses(&devices, &addrs, &node_ips)
            .iter()
            .map(|(k, a)| (k.ifindex, k.family, ip_of(a).to_string()))
            .collect();
        assert_eq!(
            got,
            vec![
                (2, FAMILY_V4, "192.168.1.10".to_string()),
                (2, FAMILY_V6, "fd00::10".to_string()),
                (3, FAMILY_V4, "10.1.0.2".to_string()),
            ]
        );
    }
}
