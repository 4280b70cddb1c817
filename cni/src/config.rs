//! The request as a runtime passes it: `CNI_*` environment variables and the network
//! configuration on stdin, parsed and validated (pure).

use std::{collections::BTreeSet, net::IpAddr, path::PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::{
    error::{self, Error, Result},
    ipam::Cidr,
};

/// The specification versions this plugin speaks (results have the 1.0 shape).
pub const SUPPORTED_VERSIONS: &[&str] = &["1.0.0", "1.1.0"];
/// The version of error results when the input names none this plugin speaks.
pub const DEFAULT_VERSION: &str = "1.1.0";
pub const DEFAULT_DATA_DIR: &str = "/var/lib/ferry/cni";
pub const DEFAULT_MTU: u32 = 1500;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Version,
    Status,
    Gc,
}

/// One attachment: `(CNI_CONTAINERID, CNI_IFNAME)`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
pub struct Attachment {
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
}

/// The `CNI_*` variables of one invocation.
#[derive(Debug, Clone)]
pub struct Env {
    pub command: Command,
    pub container_id: Option<String>,
    pub netns: Option<String>,
    pub ifname: Option<String>,
}

impl Env {
    /// Reads the variables through `var` (the process environment in `main`).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Env> {
        let command = match var("CNI_COMMAND").as_deref() {
            Some("ADD") => Command::Add,
            Some("DEL") => Command::Del,
            Some("CHECK") => Command::Check,
            Some("VERSION") => Command::Version,
            Some("STATUS") => Command::Status,
            Some("GC") => Command::Gc,
            Some(other) => {
                return Err(Error::env(
                    "CNI_COMMAND",
                    format!(
                        "CNI_COMMAND={other:?}: expected ADD, DEL, CHECK, VERSION, STATUS or GC"
                    ),
                ));
            }
            None => return Err(Error::env("CNI_COMMAND", "CNI_COMMAND is not set")),
        };
        let non_empty = |k: &str| var(k).filter(|v| !v.is_empty());
        Ok(Env {
            command,
            container_id: non_empty("CNI_CONTAINERID"),
            netns: non_empty("CNI_NETNS"),
            ifname: non_empty("CNI_IFNAME"),
        })
    }

    /// The attachment this invocation is about, validated as the specification asks.
    pub fn attachment(&self) -> Result<Attachment> {
        let container_id = self
            .container_id
            .clone()
            .ok_or_else(|| Error::env("CNI_CONTAINERID", "CNI_CONTAINERID is not set"))?;
        if !valid_identifier(&container_id) {
            return Err(Error::env(
                "CNI_CONTAINERID",
                format!(
                    "CNI_CONTAINERID={container_id:?}: must start with a letter or digit, then letters, digits, '_', '.' or '-'"
                ),
            ));
        }
        let ifname = self
            .ifname
            .clone()
            .ok_or_else(|| Error::env("CNI_IFNAME", "CNI_IFNAME is not set"))?;
        if ifname.len() > 15
            || ifname == "."
            || ifname == ".."
            || ifname
                .chars()
                .any(|c| c == '/' || c == ':' || c.is_whitespace())
        {
            return Err(Error::env(
                "CNI_IFNAME",
                format!(
                    "CNI_IFNAME={ifname:?} is not a valid interface name (1 to 15 characters, no '/', ':' or spaces)"
                ),
            ));
        }
        Ok(Attachment {
            container_id,
            ifname,
        })
    }

    /// `CNI_NETNS`, required by ADD and CHECK.
    pub fn netns(&self) -> Result<String> {
        self.netns
            .clone()
            .ok_or_else(|| Error::env("CNI_NETNS", "CNI_NETNS is not set"))
    }
}

/// Letters and digits first, then letters, digits, `_`, `.` and `-` (container ids and
/// network names).
fn valid_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
}

/// The plugin configuration, validated.
#[derive(Debug, Clone)]
pub struct NetConf {
    pub cni_version: String,
    pub name: String,
    /// At most one IPv4 and one IPv6 pod CIDR, IPv4 first.
    pub ranges: Vec<Cidr>,
    /// The MTU of both veth ends: `mtu` minus `overlayOverhead`.
    pub mtu: u32,
    pub data_dir: PathBuf,
    pub prev_result: Option<Value>,
    pub valid_attachments: BTreeSet<Attachment>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    name: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    #[serde(rename = "podCIDRs", alias = "ranges", default)]
    pod_cidrs: Vec<String>,
    mtu: Option<u32>,
    overlay_overhead: Option<u32>,
    data_dir: Option<PathBuf>,
    prev_result: Option<Value>,
    #[serde(rename = "cni.dev/valid-attachments")]
    valid_attachments: Option<Vec<Attachment>>,
}

/// The `cniVersion` of the input, checked against [`SUPPORTED_VERSIONS`].
pub fn version_of(input: &Value) -> Result<String> {
    let v = input
        .get("cniVersion")
        .and_then(Value::as_str)
        .ok_or_else(|| Error::config("cniVersion is missing or not a string"))?;
    if !SUPPORTED_VERSIONS.contains(&v) {
        return Err(Error::new(
            error::INCOMPATIBLE_VERSION,
            "incompatible CNI version",
            format!(
                "cniVersion {v:?} is not supported; this plugin supports {SUPPORTED_VERSIONS:?}"
            ),
        ));
    }
    Ok(v.to_string())
}

impl NetConf {
    /// Validates the configuration of ADD, DEL, CHECK, STATUS and GC.
    pub fn parse(input: &Value) -> Result<NetConf> {
        let cni_version = version_of(input)?;
        let raw: Raw = serde_json::from_value(input.clone()).map_err(|e| {
            Error::new(
                error::DECODE_FAILURE,
                "cannot decode the network configuration",
                e.to_string(),
            )
        })?;
        let name = raw.name.ok_or_else(|| Error::config("name is missing"))?;
        if !valid_identifier(&name) {
            return Err(Error::config(format!(
                "name {name:?}: must start with a letter or digit, then letters, digits, '_', '.' or '-'"
            )));
        }
        if raw.kind.is_none() {
            return Err(Error::config("type is missing"));
        }
        let mut ranges = Vec::new();
        for s in &raw.pod_cidrs {
            let c: Cidr = s
                .parse()
                .map_err(|e| Error::config(format!("podCIDRs: {e}")))?;
            let (family, longest) = if c.is_v4() {
                ("IPv4", 30)
            } else {
                ("IPv6", 126)
            };
            if c.prefix > longest {
                return Err(Error::config(format!(
                    "podCIDRs: {c} is too small: an {family} pod CIDR needs a prefix of /{longest} or shorter"
                )));
            }
            if ranges.iter().any(|r: &Cidr| r.is_v4() == c.is_v4()) {
                return Err(Error::config(format!(
                    "podCIDRs: more than one {family} CIDR ({c}); give one per family"
                )));
            }
            ranges.push(c);
        }
        if ranges.is_empty() {
            return Err(Error::config(
                "podCIDRs (or ranges) is missing or empty: give the node's pod CIDRs",
            ));
        }
        ranges.sort_by_key(|c| !c.is_v4());
        let mtu = raw.mtu.unwrap_or(DEFAULT_MTU);
        let overhead = raw.overlay_overhead.unwrap_or(0);
        let effective = mtu.saturating_sub(overhead);
        let min = if ranges.iter().any(|c| !c.is_v4()) {
            1280
        } else {
            576
        };
        if !(min..=65535).contains(&effective) {
            return Err(Error::config(format!(
                "mtu {mtu} minus overlayOverhead {overhead} is {effective}: must be {min} to 65535"
            )));
        }
        let valid_attachments = raw
            .valid_attachments
            .unwrap_or_default()
            .into_iter()
            .collect();
        Ok(NetConf {
            cni_version,
            name,
            ranges,
            mtu: effective,
            data_dir: raw
                .data_dir
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR)),
            prev_result: raw.prev_result,
            valid_attachments,
        })
    }

    /// The addresses `prevResult` lists for the interface named `ifname` inside the
    /// container (for CHECK).
    pub fn prev_addresses(&self, ifname: &str) -> Result<Vec<IpAddr>> {
        let prev = self
            .prev_result
            .as_ref()
            .ok_or_else(|| Error::config("CHECK needs prevResult (the result of ADD)"))?;
        let interfaces = prev.get("interfaces").and_then(Value::as_array);
        let ours = |i: u64| {
            interfaces.and_then(|l| l.get(i as usize)).is_some_and(|f| {
                f.get("name").and_then(Value::as_str) == Some(ifname)
                    && f.get("sandbox")
                        .and_then(Value::as_str)
                        .is_some_and(|s| !s.is_empty())
            })
        };
        let mut out = Vec::new();
        for ip in prev
            .get("ips")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if !ip
                .get("interface")
                .and_then(Value::as_u64)
                .is_some_and(ours)
            {
                continue;
            }
            let addr = ip
                .get("address")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let a = addr
                .split('/')
                .next()
                .and_then(|a| a.parse().ok())
                .ok_or_else(|| Error::config(format!("prevResult: bad address {addr:?}")))?;
            out.push(a);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    fn conf(extra: Value) -> Result<NetConf> {
        let mut c = json!({"cniVersion": "1.1.0", "name": "ferry", "type": "ferry-cni"});
        c.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        NetConf::parse(&c)
    }

    #[test]
    fn env_names_the_variable_at_fault() {
        let e = Env::from_vars(vars(&[])).unwrap_err();
        assert_eq!((e.code, e.details.as_str()), (4, "CNI_COMMAND is not set"));
        let e = Env::from_vars(vars(&[("CNI_COMMAND", "ATTACH")])).unwrap_err();
        assert!(e.details.contains("CNI_COMMAND=\"ATTACH\""), "{e}");
        let env = Env::from_vars(vars(&[("CNI_COMMAND", "ADD"), ("CNI_IFNAME", "eth0")])).unwrap();
        let e = env.attachment().unwrap_err();
        assert!(e.msg.contains("CNI_CONTAINERID"), "{e}");
        let env = Env::from_vars(vars(&[
            ("CNI_COMMAND", "DEL"),
            ("CNI_CONTAINERID", "-bad"),
            ("CNI_IFNAME", "eth0"),
        ]))
        .unwrap();
        assert_eq!(env.attachment().unwrap_err().code, 4);
        let env = Env::from_vars(vars(&[
            ("CNI_COMMAND", "DEL"),
            ("CNI_CONTAINERID", "abc_1.2-3"),
            ("CNI_IFNAME", "a-very-long-interface"),
        ]))
        .unwrap();
        assert!(env.attachment().unwrap_err().msg.contains("CNI_IFNAME"));
        assert_eq!(env.netns().unwrap_err().details, "CNI_NETNS is not set");
    }

    #[test]
    fn parses_a_dual_stack_config() {
        let c = conf(json!({
            "podCIDRs": ["fd00:10:244:1::/64", "10.244.1.0/24"],
            "mtu": 1500, "overlayOverhead": 50, "dataDir": "/tmp/x"
        }))
        .unwrap();
        assert_eq!(
            c.ranges.iter().map(|r| r.to_string()).collect::<Vec<_>>(),
            ["10.244.1.0/24", "fd00:10:244:1::/64"]
        );
        assert_eq!(c.mtu, 1450);
        assert_eq!(c.data_dir, PathBuf::from("/tmp/x"));
        let c = conf(json!({"ranges": ["10.244.1.0/24"]})).unwrap();
        assert_eq!(
            (c.mtu, c.data_dir.to_str().unwrap()),
            (1500, DEFAULT_DATA_DIR)
        );
    }

    #[test]
    fn rejects_bad_configs_with_their_codes() {
        let cases = [
            (
                json!({"cniVersion": "0.4.0", "podCIDRs": ["10.0.0.0/24"]}),
                1,
                "0.4.0",
            ),
            (json!({"podCIDRs": []}), 7, "podCIDRs"),
            (json!({"podCIDRs": ["10.0.0.0/31"]}), 7, "too small"),
            (
                json!({"podCIDRs": ["10.0.0.0/24", "10.1.0.0/24"]}),
                7,
                "more than one IPv4",
            ),
            (
                json!({"podCIDRs": ["fd00::/64"], "mtu": 1300, "overlayOverhead": 50}),
                7,
                "1250",
            ),
            (json!({"podCIDRs": ["10.0.0.1/24"]}), 7, "host bits"),
            (json!({"podCIDRs": "10.0.0.0/24"}), 6, "sequence"),
            (
                json!({"podCIDRs": ["10.0.0.0/24"], "name": "a/b"}),
                7,
                "name",
            ),
        ];
        for (extra, code, text) in cases {
            let e = conf(extra.clone()).unwrap_err();
            assert_eq!(e.code, code, "{extra}: {e}");
            assert!(
                e.to_string().contains(text),
                "{extra}: {e} does not mention {text}"
            );
        }
    }

    #[test]
    fn reads_valid_attachments_and_prev_result() {
        let c = conf(json!({
            "podCIDRs": ["10.0.0.0/24"],
            "cni.dev/valid-attachments": [{"containerID": "c1", "ifname": "eth0"}],
            "prevResult": {
                "cniVersion": "1.1.0",
                "interfaces": [{"name": "fry0"}, {"name": "eth0", "sandbox": "/run/netns/p"}],
                "ips": [
                    {"address": "10.0.0.2/32", "interface": 1},
                    {"address": "192.168.0.9/32", "interface": 0}
                ]
            }
        }))
        .unwrap();
        assert!(c.valid_attachments.contains(&Attachment {
            container_id: "c1".into(),
            ifname: "eth0".into()
        }));
        assert_eq!(
            c.prev_addresses("eth0").unwrap(),
            vec!["10.0.0.2".parse::<IpAddr>().unwrap()]
        );
        assert!(c.prev_addresses("eth1").unwrap().is_empty());
    }
}
