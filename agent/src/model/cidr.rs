//! A CIDR (`10.0.0.0/8`, `2001:db8::/32`), as `loadBalancerSourceRanges` and
//! `--nodeport-addresses` give them. Host bits are cleared on parse, as Go's
//! `net.ParseCIDR` does, so `10.0.0.1/8` means `10.0.0.0/8`.

use std::{fmt, net::IpAddr, str::FromStr};

use super::types::IpFamily;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cidr {
    /// The network address (host bits zero).
    pub addr: IpAddr,
    /// Prefix length: 0-32 for IPv4, 0-128 for IPv6.
    pub len: u8,
}

impl Cidr {
    /// `None` when `len` is longer than the family's address.
    pub fn new(addr: IpAddr, len: u8) -> Option<Cidr> {
        let max = Self::max_len(&addr);
        (len <= max).then(|| Cidr {
            addr: mask(addr, len),
            len,
        })
    }

    /// The single address `addr` (`/32` or `/128`).
    pub fn host(addr: IpAddr) -> Cidr {
        Cidr {
            addr,
            len: Self::max_len(&addr),
        }
    }

    pub fn family(&self) -> IpFamily {
        IpFamily::of(&self.addr)
    }

    pub fn contains(&self, ip: &IpAddr) -> bool {
        IpFamily::of(ip) == self.family() && mask(*ip, self.len) == self.addr
    }

    fn max_len(addr: &IpAddr) -> u8 {
        if addr.is_ipv4() { 32 } else { 128 }
    }
}

fn mask(addr: IpAddr, len: u8) -> IpAddr {
    match addr {
        IpAddr::V4(v4) => {
            let m = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            IpAddr::V4((u32::from(v4) & m).into())
        }
        IpAddr::V6(v6) => {
            let m = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            IpAddr::V6((u128::from(v6) & m).into())
        }
    }
}

impl FromStr for Cidr {
    type Err = String;

    /// `ADDR/LEN`, surrounding spaces ignored (kube-proxy trims them).
    fn from_str(s: &str) -> Result<Cidr, String> {
        let s = s.trim();
        let (addr, len) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not a CIDR (want ADDR/LEN, e.g. 10.0.0.0/8)"))?;
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?}: {addr:?} is not an IP address"))?;
        let len: u8 = len
            .parse()
            .map_err(|_| format!("{s:?}: {len:?} is not a prefix length"))?;
        Cidr::new(addr, len).ok_or_else(|| format!("{s:?}: prefix length {len} is too long"))
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::Cidr;

    fn ip(s: &str) -> std::net::IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn parse_masks_host_bits_and_contains() {
        let c: Cidr = " 10.1.2.3/16 ".parse().unwrap();
        assert_eq!(c.to_string(), "10.1.0.0/16");
        assert!(c.contains(&ip("10.1.255.1")));
        assert!(!c.contains(&ip("10.2.0.1")));
        assert!(!c.contains(&ip("::ffff:10.1.0.1")), "families never mix");
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(&ip("203.0.113.9")));
        let v6: Cidr = "2001:db8::1/32".parse().unwrap();
        assert_eq!(v6.to_string(), "2001:db8::/32");
        assert!(v6.contains(&ip("2001:db8:ffff::1")));
        assert_eq!(Cidr::host(ip("fd00::1")).to_string(), "fd00::1/128");
    }

    #[test]
    fn bad_cidrs_say_why() {
        for (bad, why) in [
            ("10.0.0.0", "not a CIDR"),
            ("10.0.0/8", "not an IP address"),
            ("10.0.0.0/33", "too long"),
            ("::/129", "too long"),
            ("10.0.0.0/x", "not a prefix length"),
        ] {
            let e = bad.parse::<Cidr>().unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
