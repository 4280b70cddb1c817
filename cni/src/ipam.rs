//! Address arithmetic and the allocation algorithm (pure: the store in `store.rs` holds
//! the state and the lock).
//!
//! In a pod CIDR the network address, the first address (the node's own: the pods'
//! IPv4 gateway) and, for IPv4, the broadcast address are never handed out. The search
//! starts after the last address handed out, so a freed address is not reused at once.

use std::{collections::BTreeSet, fmt, net::IpAddr, str::FromStr};

/// A network in CIDR notation, host bits zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn is_v4(&self) -> bool {
        self.addr.is_ipv4()
    }

    fn bits(&self) -> u8 {
        if self.is_v4() { 32 } else { 128 }
    }

    /// The network address as an integer.
    fn base(&self) -> u128 {
        to_u128(self.addr)
    }

    /// The highest address of the network as an integer.
    fn top(&self) -> u128 {
        self.base() + ((1u128 << (self.bits() - self.prefix)) - 1)
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        ip.is_ipv4() == self.is_v4() && (self.base()..=self.top()).contains(&to_u128(ip))
    }

    /// The first address after the network address: the node's own address in the pod
    /// CIDR, never given to a pod.
    pub fn node_address(&self) -> IpAddr {
        from_u128(self.is_v4(), self.base() + 1)
    }

    /// The addresses pods may get: from network + 2 to the last address (IPv6) or the
    /// one before the broadcast address (IPv4).
    pub fn usable(&self) -> (u128, u128) {
        let top = if self.is_v4() {
            self.top() - 1
        } else {
            self.top()
        };
        (self.base() + 2, top)
    }

    /// A single address as a host network (/32 or /128).
    pub fn host(ip: IpAddr) -> Cidr {
        Cidr {
            addr: ip,
            prefix: if ip.is_ipv4() { 32 } else { 128 },
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl FromStr for Cidr {
    type Err = String;

    /// Parses `a.b.c.d/n` or `x::/n`; host bits must be zero.
    fn from_str(s: &str) -> Result<Cidr, String> {
        let (addr, prefix) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not in CIDR notation (address/prefix)"))?;
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?}: {addr:?} is not an IP address"))?;
        let prefix: u8 = prefix
            .parse()
            .map_err(|_| format!("{s:?}: {prefix:?} is not a prefix length"))?;
        let bits = if addr.is_ipv4() { 32 } else { 128 };
        if prefix == 0 || prefix > bits {
            return Err(format!("{s:?}: the prefix must be 1 to {bits} bits"));
        }
        let host_mask = (1u128 << (bits - prefix)) - 1;
        if to_u128(addr) & host_mask != 0 {
            return Err(format!("{s:?} has host bits set"));
        }
        Ok(Cidr { addr, prefix })
    }
}

pub fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u32::from(a) as u128,
        IpAddr::V6(a) => u128::from(a),
    }
}

pub fn from_u128(v4: bool, v: u128) -> IpAddr {
    if v4 {
        IpAddr::from((v as u32).to_be_bytes())
    } else {
        IpAddr::from(v.to_be_bytes())
    }
}

/// The next free address of `cidr` after `last` (wrapping around), skipping `used`;
/// `None` when every usable address is taken.
///
/// At most `used ∩ usable` + 1 candidates are looked at, so a /64 costs no more than a
/// /29.
pub fn next_free(cidr: &Cidr, used: &BTreeSet<IpAddr>, last: Option<IpAddr>) -> Option<IpAddr> {
    let (lo, hi) = cidr.usable();
    if hi < lo {
        return None;
    }
    let count = hi - lo + 1;
    let start = match last {
        Some(l) if cidr.contains(l) && (lo..hi).contains(&to_u128(l)) => to_u128(l) + 1,
        _ => lo,
    };
    let taken = used
        .iter()
        .filter(|ip| cidr.contains(**ip) && (lo..=hi).contains(&to_u128(**ip)))
        .count() as u128;
    (0..count.min(taken + 1))
        .map(|i| from_u128(cidr.is_v4(), lo + (start - lo + i) % count))
        .find(|ip| !used.contains(ip))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(s: &str) -> Cidr {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn set(ips: &[&str]) -> BTreeSet<IpAddr> {
        ips.iter().map(|s| ip(s)).collect()
    }

    #[test]
    fn parses_and_rejects_cidrs() {
        assert_eq!(cidr("10.244.1.0/24").to_string(), "10.244.1.0/24");
        assert_eq!(cidr("fd00:10:244:1::/64").to_string(), "fd00:10:244:1::/64");
        for bad in [
            "10.244.1.0",
            "10.244.1.1/24",
            "10.0.0.0/33",
            "x/8",
            "fd00::1/64",
        ] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn reserves_network_node_and_broadcast() {
        let c = cidr("10.0.0.0/29");
        assert_eq!(c.node_address(), ip("10.0.0.1"));
        let mut used = BTreeSet::new();
        let mut got = Vec::new();
        let mut last = None;
        while let Some(a) = next_free(&c, &used, last) {
            used.insert(a);
            last = Some(a);
            got.push(a.to_string());
        }
        assert_eq!(
            got,
            ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.6"]
        );
    }

    #[test]
    fn ipv6_hands_out_the_last_address_but_not_the_first_two() {
        let c = cidr("fd00::/126");
        assert_eq!(c.node_address(), ip("fd00::1"));
        assert_eq!(next_free(&c, &set(&[]), None), Some(ip("fd00::2")));
        assert_eq!(next_free(&c, &set(&["fd00::2"]), None), Some(ip("fd00::3")));
        assert_eq!(next_free(&c, &set(&["fd00::2", "fd00::3"]), None), None);
    }

    #[test]
    fn continues_after_the_cursor_and_wraps() {
        let c = cidr("10.0.0.0/24");
        // A freed address right before the cursor is not reused while others are free.
        assert_eq!(
            next_free(&c, &set(&["10.0.0.2"]), Some(ip("10.0.0.3"))),
            Some(ip("10.0.0.4"))
        );
        // At the end of the range the search wraps to the start.
        assert_eq!(
            next_free(&c, &set(&["10.0.0.2"]), Some(ip("10.0.0.254"))),
            Some(ip("10.0.0.3"))
        );
        // A cursor from another range is ignored.
        assert_eq!(
            next_free(&c, &set(&[]), Some(ip("10.9.0.7"))),
            Some(ip("10.0.0.2"))
        );
    }

    #[test]
    fn a_huge_range_is_searched_in_few_steps() {
        let c = cidr("fd00:10:244:1::/64");
        let used = set(&["fd00:10:244:1::2", "fd00:10:244:1::3"]);
        assert_eq!(next_free(&c, &used, None), Some(ip("fd00:10:244:1::4")));
        let last = ip("fd00:10:244:1:ffff:ffff:ffff:ffff");
        assert_eq!(
            next_free(&c, &used, Some(last)),
            Some(ip("fd00:10:244:1::4"))
        );
    }

    #[test]
    fn addresses_outside_the_range_do_not_count_as_taken() {
        let c = cidr("10.0.0.0/30");
        assert_eq!(
            next_free(&c, &set(&["10.0.0.1", "10.0.1.2"]), None),
            Some(ip("10.0.0.2"))
        );
        assert_eq!(next_free(&c, &set(&["10.0.0.2"]), None), None);
    }
}
