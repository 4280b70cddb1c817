//! The JSON results of ADD and VERSION and the error result (pure).

use std::net::IpAddr;

use serde_json::{Value, json};

use crate::{config::SUPPORTED_VERSIONS, error::Error, ipam::Cidr, plan::default_dst};

/// An interface as the result lists it.
#[derive(Debug, Clone)]
pub struct Interface {
    pub name: String,
    pub mac: String,
    pub mtu: u32,
    /// `CNI_NETNS` for the pod's interface, `None` on the host.
    pub sandbox: Option<String>,
}

/// One pod address and its gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodAddress {
    pub ip: IpAddr,
    pub gateway: IpAddr,
}

/// The ADD result: the host veth and the pod's interface, one /32 (/128) per family with
/// its gateway, and the routes made in the pod. A `prevResult` (ferry in a chain after
/// another interface plugin) is kept, with ours appended.
pub fn add_result(
    version: &str,
    prev: Option<&Value>,
    host: &Interface,
    pod: &Interface,
    addrs: &[PodAddress],
) -> Value {
    let mut out = prev.cloned().unwrap_or_else(|| json!({}));
    let obj = out.as_object_mut().expect("prevResult is an object");
    obj.insert("cniVersion".into(), json!(version));
    let list = |obj: &mut serde_json::Map<String, Value>, key: &str| -> Vec<Value> {
        obj.get(key)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let mut interfaces = list(obj, "interfaces");
    let pod_index = interfaces.len() + 1;
    for i in [host, pod] {
        let mut v = json!({"name": i.name, "mac": i.mac, "mtu": i.mtu});
        if let Some(s) = &i.sandbox {
            v["sandbox"] = json!(s);
        }
        interfaces.push(v);
    }
    let mut ips = list(obj, "ips");
    let mut routes = list(obj, "routes");
    for a in addrs {
        ips.push(json!({
            "address": Cidr::host(a.ip).to_string(),
            "gateway": a.gateway.to_string(),
            "interface": pod_index,
        }));
        routes.push(json!({"dst": Cidr::host(a.gateway).to_string(), "scope": 253}));
        routes.push(
            json!({"dst": default_dst(a.ip.is_ipv4()).to_string(), "gw": a.gateway.to_string()}),
        );
    }
    obj.insert("interfaces".into(), json!(interfaces));
    obj.insert("ips".into(), json!(ips));
    obj.insert("routes".into(), json!(routes));
    obj.entry("dns").or_insert_with(|| json!({}));
    out
}

/// The VERSION result.
pub fn version_result(version: &str) -> Value {
    json!({"cniVersion": version, "supportedVersions": SUPPORTED_VERSIONS})
}

/// The error result.
pub fn error_result(version: &str, e: &Error) -> Value {
    json!({"cniVersion": version, "code": e.code, "msg": e.msg, "details": e.details})
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn mac_string(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ifaces() -> (Interface, Interface) {
        (
            Interface {
                name: "fry0123456789a".into(),
                mac: mac_string(&[2, 0, 0, 0, 0, 1]),
                mtu: 1450,
                sandbox: None,
            },
            Interface {
                name: "eth0".into(),
                mac: "02:00:00:00:00:02".into(),
                mtu: 1450,
                sandbox: Some("/run/netns/p".into()),
            },
        )
    }

    #[test]
    fn dual_stack_result_has_the_spec_shape() {
        let (h, p) = ifaces();
        let addrs = [
            PodAddress {
                ip: "10.244.1.2".parse().unwrap(),
                gateway: "10.244.1.1".parse().unwrap(),
            },
            PodAddress {
                ip: "fd00::2".parse().unwrap(),
                gateway: "fe80::1".parse().unwrap(),
            },
        ];
        let r = add_result("1.1.0", None, &h, &p, &addrs);
        assert_eq!(
            r,
            json!({
                "cniVersion": "1.1.0",
                "interfaces": [
                    {"name": "fry0123456789a", "mac": "02:00:00:00:00:01", "mtu": 1450},
                    {"name": "eth0", "mac": "02:00:00:00:00:02", "mtu": 1450, "sandbox": "/run/netns/p"}
                ],
                "ips": [
                    {"address": "10.244.1.2/32", "gateway": "10.244.1.1", "interface": 1},
                    {"address": "fd00::2/128", "gateway": "fe80::1", "interface": 1}
                ],
                "routes": [
                    {"dst": "10.244.1.1/32", "scope": 253},
                    {"dst": "0.0.0.0/0", "gw": "10.244.1.1"},
                    {"dst": "fe80::1/128", "scope": 253},
                    {"dst": "::/0", "gw": "fe80::1"}
                ],
                "dns": {}
            })
        );
    }

    #[test]
    fn a_prev_result_is_kept_and_indices_shift() {
        let (h, p) = ifaces();
        let prev = json!({"cniVersion": "1.0.0", "interfaces": [{"name": "lo"}], "ips": [], "dns": {"nameservers": ["10.96.0.10"]}});
        let addrs = [PodAddress {
            ip: "10.0.0.2".parse().unwrap(),
            gateway: "10.0.0.1".parse().unwrap(),
        }];
        let r = add_result("1.0.0", Some(&prev), &h, &p, &addrs);
        assert_eq!(r["interfaces"].as_array().unwrap().len(), 3);
        assert_eq!(r["ips"][0]["interface"], 2);
        assert_eq!(r["dns"]["nameservers"][0], "10.96.0.10");
        assert_eq!(r["cniVersion"], "1.0.0");
    }

    #[test]
    fn version_and_error_results() {
        assert_eq!(
            version_result("1.0.0"),
            json!({"cniVersion": "1.0.0", "supportedVersions": ["1.0.0", "1.1.0"]})
        );
        let e = Error::new(100, "no free address", "10.0.0.0/29 is exhausted");
        assert_eq!(
            error_result("1.1.0", &e),
            json!({"cniVersion": "1.1.0", "code": 100, "msg": "no free address", "details": "10.0.0.0/29 is exhausted"})
        );
    }
}
