//! What the pod network of this node must look like, decided purely from the cluster's
//! Nodes: the routes to the other nodes' pod CIDRs, the CNI configuration, and the
//! masquerade rule for pod traffic that leaves the cluster.

use std::{collections::BTreeSet, fmt::Write as _, net::IpAddr};

use k8s_openapi::api::core::v1::Node;
use serde_json::json;

use crate::model::{Cidr, IpFamily};

/// What the pod network needs to know of one Node.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NodeLite {
    pub name: String,
    /// `spec.podCIDRs` (or the older `spec.podCIDR`), in the Node's order.
    pub pod_cidrs: Vec<Cidr>,
    /// `status.addresses` of type InternalIP, in the Node's order.
    pub internal_ips: Vec<IpAddr>,
}

/// A field of a Node that cannot be used, said once per sync.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeProblem {
    pub node: String,
    pub message: String,
}

impl NodeLite {
    /// The pod network's view of `node`; unparsable CIDRs and addresses are dropped and
    /// reported in the second value.
    pub fn from_node(node: &Node) -> (NodeLite, Vec<NodeProblem>) {
        let name = node.metadata.name.clone().unwrap_or_default();
        let mut problems = Vec::new();
        let spec = node.spec.as_ref();
        let mut raw: Vec<&str> = spec
            .and_then(|s| s.pod_cidrs.as_ref())
            .map(|v| v.iter().map(String::as_str).collect())
            .unwrap_or_default();
        if raw.is_empty()
            && let Some(one) = spec.and_then(|s| s.pod_cidr.as_deref())
        {
            raw.push(one);
        }
        let mut pod_cidrs = Vec::new();
        for text in raw {
            match text.parse::<Cidr>() {
                Ok(c) => pod_cidrs.push(c),
                Err(e) => problems.push(NodeProblem {
                    node: name.clone(),
                    message: format!("spec.podCIDRs: {text:?} is not a CIDR ({e})"),
                }),
            }
        }
        let mut internal_ips = Vec::new();
        for a in node
            .status
            .as_ref()
            .and_then(|s| s.addresses.as_ref())
            .into_iter()
            .flatten()
            .filter(|a| a.type_ == "InternalIP")
        {
            match a.address.parse::<IpAddr>() {
                Ok(ip) => internal_ips.push(ip),
                Err(_) => problems.push(NodeProblem {
                    node: name.clone(),
                    message: format!(
                        "status.addresses: InternalIP {:?} is not an IP address",
                        a.address
                    ),
                }),
            }
        }
        (
            NodeLite {
                name,
                pod_cidrs,
                internal_ips,
            },
            problems,
        )
    }

    fn internal_ip(&self, family: IpFamily) -> Option<IpAddr> {
        self.internal_ips
            .iter()
            .copied()
            .find(|ip| IpFamily::of(ip) == family)
    }
}

/// One route to another node's pod CIDR. Native routing: via that node's InternalIP of
/// the same family on a shared link. Overlay: via that node's VXLAN endpoint address
/// (the network address of the CIDR), `onlink` on ferry's VXLAN device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodRoute {
    pub dst: Cidr,
    pub via: IpAddr,
    pub overlay: bool,
}

impl std::fmt::Display for PodRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} via {}", self.dst, self.via)?;
        if self.overlay {
            write!(f, " dev {VXLAN_DEVICE} onlink")?;
        }
        Ok(())
    }
}

/// ferry's VXLAN device (`--overlay vxlan`), its VNI and UDP port (Linux's and
/// flannel's default port).
pub const VXLAN_DEVICE: &str = "ferry.vxlan";
pub const VXLAN_VNI: u32 = 1;
pub const VXLAN_PORT: u16 = 8472;

/// What VXLAN adds to a packet: outer IPv4 (20) or IPv6 (40), UDP (8), VXLAN (8) and
/// the inner Ethernet header (14).
pub fn vxlan_overhead(underlay: IpAddr) -> u32 {
    if underlay.is_ipv4() { 50 } else { 70 }
}

/// A node's VXLAN endpoint MAC, derived from its underlay address so that no node has to
/// publish it: locally administered unicast `0a:fe` and the address's last 4 bytes.
pub fn vtep_mac(underlay: IpAddr) -> [u8; 6] {
    let b = match underlay {
        IpAddr::V4(a) => a.octets(),
        IpAddr::V6(a) => {
            let o = a.octets();
            [o[12], o[13], o[14], o[15]]
        }
    };
    ferry_common::podnet::vtep_mac(b)
}

/// The other nodes' pod CIDRs for the fast path, each with its node's underlay address
/// when the fast path encapsulates to it itself: with the overlay over IPv4 (over IPv6
/// the packets go through `ferry.vxlan`).
pub fn fast_path_tunnels(plan: &PodNetPlan) -> Vec<(Cidr, Option<std::net::Ipv4Addr>)> {
    let v4_overlay = plan
        .vxlan
        .as_ref()
        .filter(|v| matches!(v.local, Some(IpAddr::V4(_))));
    plan.routes
        .iter()
        .map(|r| {
            let tunnel = v4_overlay.filter(|_| r.overlay).and_then(|v| {
                let mac = v.neighbours.iter().find(|(ip, _)| *ip == r.via)?.1;
                match v.fdb.iter().find(|(m, _)| *m == mac)?.1 {
                    IpAddr::V4(a) => Some(a),
                    IpAddr::V6(_) => None,
                }
            });
            (r.dst, tunnel)
        })
        .collect()
}

/// The fast path's overlay parameters: `ferry.vxlan`'s, when the overlay runs over IPv4.
pub fn fast_path_config(
    plan: &PodNetPlan,
    ifindex: impl Fn(&str) -> Option<u32>,
) -> ferry_common::podnet::PodnetConfig {
    let mut c = ferry_common::podnet::PodnetConfig::default();
    if let Some(v) = &plan.vxlan
        && let (Some(IpAddr::V4(local)), Some(index)) = (v.local, ifindex(VXLAN_DEVICE))
    {
        c.underlay_v4 = u32::from_ne_bytes(local.octets());
        c.vxlan_ifindex = index;
        c.vni = VXLAN_VNI;
        c.port = VXLAN_PORT;
        c.mac = v.mac;
    }
    c
}

/// This node's VXLAN device and the entries that reach the other nodes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VxlanPlan {
    /// The underlay address (this node's first InternalIP) and the device's MAC.
    pub local: Option<IpAddr>,
    pub mac: [u8; 6],
    /// The device's own addresses: the network address of each own pod CIDR.
    pub addresses: Vec<IpAddr>,
    /// Neighbour entries: another node's endpoint address -> its MAC.
    pub neighbours: BTreeSet<(IpAddr, [u8; 6])>,
    /// FDB entries: another node's MAC -> its underlay address.
    pub fdb: BTreeSet<([u8; 6], IpAddr)>,
}

/// The pod network of this node, as the Nodes describe it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodNetPlan {
    /// This node's pod CIDRs; empty until the node has them.
    pub own_cidrs: Vec<Cidr>,
    pub routes: BTreeSet<PodRoute>,
    /// Every pod CIDR of the cluster and every node address: traffic from a pod to
    /// these keeps its source address.
    pub no_masquerade: BTreeSet<Cidr>,
    pub problems: Vec<NodeProblem>,
    /// With `--overlay vxlan`.
    pub vxlan: Option<VxlanPlan>,
}

/// Decides the routes and the masquerade exceptions for `own` among `nodes`.
///
/// A node without a pod CIDR of a family, or without an InternalIP of that family, gets
/// no route for it (reported: its pods are unreachable from here until it has one). Two
/// nodes claiming overlapping pod CIDRs are both reported and neither is routed for the
/// overlapping CIDR, since either route would steal the other's pods.
///
/// With `overlay`, every route goes through ferry's VXLAN device instead, and the
/// underlay family is that of this node's first InternalIP: another node needs an
/// InternalIP of that family (its pod CIDRs of both families ride on it).
pub fn plan(
    own: &str,
    nodes: &[NodeLite],
    extra_no_masquerade: &[Cidr],
    overlay: bool,
) -> PodNetPlan {
    let mut out = PodNetPlan::default();
    let underlay = nodes
        .iter()
        .find(|n| n.name == own)
        .and_then(|n| n.internal_ips.first().copied());
    if overlay {
        out.vxlan = Some(VxlanPlan {
            local: underlay,
            mac: underlay.map(vtep_mac).unwrap_or_default(),
            ..Default::default()
        });
        if underlay.is_none() && nodes.iter().any(|n| n.name == own) {
            out.problems.push(NodeProblem {
                node: own.to_string(),
                message: "no InternalIP in status.addresses: no VXLAN overlay".into(),
            });
        }
    }
    let mut claimed: Vec<(Cidr, &str)> = Vec::new();
    for n in nodes {
        for c in &n.pod_cidrs {
            claimed.push((*c, &n.name));
            out.no_masquerade.insert(*c);
        }
        for ip in &n.internal_ips {
            out.no_masquerade.insert(Cidr::host(*ip));
        }
    }
    out.no_masquerade
        .extend(extra_no_masquerade.iter().copied());
    let overlaps = |c: &Cidr, name: &str| -> Option<String> {
        claimed
            .iter()
            .find(|(o, other)| *other != name && (o.contains(&c.addr) || c.contains(&o.addr)))
            .map(|(o, other)| format!("{other} ({o})"))
    };
    for n in nodes {
        if n.name == own {
            out.own_cidrs = n.pod_cidrs.clone();
            if let Some(v) = out.vxlan.as_mut() {
                v.addresses = n.pod_cidrs.iter().map(|c| c.addr).collect();
            }
            continue;
        }
        for c in &n.pod_cidrs {
            if let Some(other) = overlaps(c, &n.name) {
                out.problems.push(NodeProblem {
                    node: n.name.clone(),
                    message: format!(
                        "pod CIDR {c} overlaps the pod CIDR of node {other}: not routed"
                    ),
                });
                continue;
            }
            if let Some(v) = out.vxlan.as_mut() {
                let Some(local) = underlay else { continue };
                match n.internal_ip(IpFamily::of(&local)) {
                    Some(remote) => {
                        let mac = vtep_mac(remote);
                        out.routes.insert(PodRoute {
                            dst: *c,
                            via: c.addr,
                            overlay: true,
                        });
                        v.neighbours.insert((c.addr, mac));
                        v.fdb.insert((mac, remote));
                    }
                    None => out.problems.push(NodeProblem {
                        node: n.name.clone(),
                        message: format!(
                            "no {} InternalIP (the overlay's underlay family): its pod CIDR {c} is not routed",
                            IpFamily::of(&local)
                        ),
                    }),
                }
                continue;
            }
            match n.internal_ip(c.family()) {
                Some(via) => {
                    out.routes.insert(PodRoute {
                        dst: *c,
                        via,
                        overlay: false,
                    });
                }
                None => out.problems.push(NodeProblem {
                    node: n.name.clone(),
                    message: format!(
                        "no {} InternalIP in status.addresses: its pod CIDR {c} is not routed",
                        c.family()
                    ),
                }),
            }
        }
    }
    out
}

/// The file name of ferry's CNI configuration in the CNI configuration directory.
pub const CONFLIST_NAME: &str = "10-ferry.conflist";
/// The network's name in the conflist and the plugin's `type` (its binary's name).
pub const NETWORK_NAME: &str = "ferry";
pub const PLUGIN_TYPE: &str = "ferry-cni";

/// ferry's CNI configuration list for a node with `pod_cidrs`. `None` without any:
/// the runtime must not start pods before the node has its CIDRs.
pub fn conflist(
    pod_cidrs: &[Cidr],
    mtu: u32,
    overlay_overhead: u32,
    data_dir: &std::path::Path,
) -> Option<String> {
    if pod_cidrs.is_empty() {
        return None;
    }
    let ranges: Vec<String> = pod_cidrs.iter().map(Cidr::to_string).collect();
    let doc = json!({
        "cniVersion": "1.0.0",
        "name": NETWORK_NAME,
        "plugins": [{
            "type": PLUGIN_TYPE,
            "podCIDRs": ranges,
            "mtu": mtu,
            "overlayOverhead": overlay_overhead,
            "dataDir": data_dir,
        }],
    });
    Some(serde_json::to_string_pretty(&doc).expect("conflist json") + "\n")
}

/// The nftables table that masquerades pod traffic leaving the cluster.
pub const MASQ_TABLE: &str = "ferry-podnet";

/// An nft script that replaces ferry's masquerade tables in one transaction: for each
/// family with a pod CIDR on this node, traffic from those pods to anything outside
/// `no_masquerade` leaves with the node's address. `None` (no pod CIDR yet, or
/// masquerading off) removes the tables.
pub fn masquerade_script(plan: Option<&PodNetPlan>) -> String {
    let mut s = String::new();
    for (family, table_family) in [(IpFamily::V4, "ip"), (IpFamily::V6, "ip6")] {
        // `add` then `delete` so that the delete never fails on a missing table.
        let _ = writeln!(s, "add table {table_family} {MASQ_TABLE}");
        let _ = writeln!(s, "delete table {table_family} {MASQ_TABLE}");
        let Some(plan) = plan else { continue };
        let own: Vec<String> = plan
            .own_cidrs
            .iter()
            .filter(|c| c.family() == family)
            .map(Cidr::to_string)
            .collect();
        if own.is_empty() {
            continue;
        }
        let keep: Vec<String> = plan
            .no_masquerade
            .iter()
            .filter(|c| c.family() == family)
            .map(Cidr::to_string)
            .collect();
        let (addr_type, match_word) = match family {
            IpFamily::V4 => ("ipv4_addr", "ip"),
            IpFamily::V6 => ("ipv6_addr", "ip6"),
        };
        let _ = writeln!(s, "table {table_family} {MASQ_TABLE} {{");
        let _ = writeln!(s, "  set cluster {{");
        let _ = writeln!(s, "    type {addr_type}; flags interval; auto-merge;");
        if !keep.is_empty() {
            let _ = writeln!(s, "    elements = {{ {} }}", keep.join(", "));
        }
        let _ = writeln!(s, "  }}");
        let _ = writeln!(s, "  chain postrouting {{");
        let _ = writeln!(
            s,
            "    type nat hook postrouting priority srcnat; policy accept;"
        );
        let _ = writeln!(
            s,
            "    {match_word} saddr {{ {} }} {match_word} daddr != @cluster masquerade",
            own.join(", ")
        );
        let _ = writeln!(s, "  }}");
        let _ = writeln!(s, "}}");
    }
    s
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{NodeAddress, NodeSpec, NodeStatus};

    use super::*;

    fn node(name: &str, cidrs: &[&str], ips: &[&str]) -> NodeLite {
        NodeLite {
            name: name.into(),
            pod_cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
            internal_ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
        }
    }

    fn k8s_node(
        name: &str,
        cidrs: Option<Vec<&str>>,
        cidr: Option<&str>,
        addrs: &[(&str, &str)],
    ) -> Node {
        Node {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                pod_cidrs: cidrs.map(|v| v.into_iter().map(String::from).collect()),
                pod_cidr: cidr.map(String::from),
                ..Default::default()
            }),
            status: Some(NodeStatus {
                addresses: Some(
                    addrs
                        .iter()
                        .map(|(t, a)| NodeAddress {
                            type_: t.to_string(),
                            address: a.to_string(),
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn node_fields_are_read_and_bad_ones_reported() {
        let n = k8s_node(
            "a",
            Some(vec!["10.244.1.0/24", "fd00:244:1::/64", "bogus"]),
            Some("10.9.9.0/24"),
            &[
                ("Hostname", "a"),
                ("InternalIP", "192.168.1.1"),
                ("ExternalIP", "203.0.113.1"),
                ("InternalIP", "fd00::1"),
                ("InternalIP", "nope"),
            ],
        );
        let (lite, problems) = NodeLite::from_node(&n);
        assert_eq!(
            lite,
            node(
                "a",
                &["10.244.1.0/24", "fd00:244:1::/64"],
                &["192.168.1.1", "fd00::1"]
            )
        );
        let msgs: Vec<&str> = problems.iter().map(|p| p.message.as_str()).collect();
        assert_eq!(msgs.len(), 2, "{msgs:?}");
        assert!(msgs[0].contains("\"bogus\""), "{msgs:?}");
        assert!(msgs[1].contains("\"nope\""), "{msgs:?}");
        // spec.podCIDR alone (older clusters).
        let (lite, _) = NodeLite::from_node(&k8s_node("b", None, Some("10.244.2.0/24"), &[]));
        assert_eq!(lite.pod_cidrs, ["10.244.2.0/24".parse::<Cidr>().unwrap()]);
    }

    #[test]
    fn routes_go_to_every_other_node_per_family() {
        let nodes = [
            node(
                "n1",
                &["10.244.1.0/24", "fd00:244:1::/64"],
                &["192.168.0.1", "fd00::1"],
            ),
            node(
                "n2",
                &["10.244.2.0/24", "fd00:244:2::/64"],
                &["192.168.0.2", "fd00::2"],
            ),
            node("n3", &["10.244.3.0/24"], &["192.168.0.3"]),
        ];
        let p = plan("n1", &nodes, &[], false);
        assert_eq!(p.own_cidrs, nodes[0].pod_cidrs);
        let routes: Vec<String> = p.routes.iter().map(ToString::to_string).collect();
        assert_eq!(
            routes,
            [
                "10.244.2.0/24 via 192.168.0.2",
                "10.244.3.0/24 via 192.168.0.3",
                "fd00:244:2::/64 via fd00::2",
            ]
        );
        assert!(p.problems.is_empty(), "{:?}", p.problems);
        let keep: Vec<String> = p.no_masquerade.iter().map(ToString::to_string).collect();
        assert!(
            keep.contains(&"10.244.3.0/24".to_string())
                && keep.contains(&"192.168.0.3/32".to_string()),
            "{keep:?}"
        );
    }

    #[test]
    fn a_node_without_an_address_of_the_family_or_with_an_overlap_is_reported() {
        let nodes = [
            node("n1", &["10.244.1.0/24"], &["192.168.0.1"]),
            node("n2", &["fd00:244:2::/64"], &["192.168.0.2"]),
            node("n3", &["10.244.0.0/16"], &["192.168.0.3"]),
        ];
        let p = plan("n1", &nodes, &[], false);
        assert!(p.routes.is_empty(), "{:?}", p.routes);
        let msgs: Vec<String> = p
            .problems
            .iter()
            .map(|x| format!("{}: {}", x.node, x.message))
            .collect();
        assert_eq!(msgs.len(), 2, "{msgs:?}");
        assert!(msgs[0].starts_with("n2: no IPv6 InternalIP"), "{msgs:?}");
        assert!(
            msgs[1].starts_with("n3: pod CIDR 10.244.0.0/16 overlaps the pod CIDR of node n1"),
            "{msgs:?}"
        );
    }

    #[test]
    fn conflist_waits_for_the_pod_cidrs() {
        let dir = std::path::Path::new("/var/lib/ferry/cni");
        assert_eq!(conflist(&[], 1500, 0, dir), None);
        let text = conflist(
            &[
                "10.244.1.0/24".parse().unwrap(),
                "fd00:244:1::/64".parse().unwrap(),
            ],
            1450,
            0,
            dir,
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["name"], "ferry");
        assert_eq!(v["plugins"][0]["type"], "ferry-cni");
        assert_eq!(
            v["plugins"][0]["podCIDRs"],
            json!(["10.244.1.0/24", "fd00:244:1::/64"])
        );
        assert_eq!(v["plugins"][0]["mtu"], 1450);
        assert_eq!(v["plugins"][0]["dataDir"], "/var/lib/ferry/cni");
    }

    #[test]
    fn masquerade_covers_own_pods_per_family_and_keeps_the_cluster() {
        let nodes = [
            node("n1", &["10.244.1.0/24"], &["192.168.0.1"]),
            node("n2", &["10.244.2.0/24"], &["192.168.0.2"]),
        ];
        let p = plan("n1", &nodes, &["10.96.0.0/12".parse().unwrap()], false);
        let s = masquerade_script(Some(&p));
        assert!(
            s.starts_with(
                "add table ip ferry-podnet\ndelete table ip ferry-podnet\ntable ip ferry-podnet {"
            ),
            "{s}"
        );
        assert!(s.contains("elements = { 10.96.0.0/12, 10.244.1.0/24, 10.244.2.0/24, 192.168.0.1/32, 192.168.0.2/32 }"), "{s}");
        assert!(
            s.contains("ip saddr { 10.244.1.0/24 } ip daddr != @cluster masquerade"),
            "{s}"
        );
        // No IPv6 pod CIDR here: the ip6 table is only removed.
        assert!(
            s.ends_with("add table ip6 ferry-podnet\ndelete table ip6 ferry-podnet\n"),
            "{s}"
        );
        assert_eq!(
            masquerade_script(None),
            "add table ip ferry-podnet\ndelete table ip ferry-podnet\nadd table ip6 ferry-podnet\ndelete table ip6 ferry-podnet\n"
        );
    }

    #[test]
    fn the_fast_path_encapsulates_to_each_nodes_ipv4_underlay_only_with_the_overlay() {
        let nodes = [
            node(
                "n1",
                &["10.244.1.0/24", "fd00:244:1::/64"],
                &["192.168.0.1"],
            ),
            node(
                "n2",
                &["10.244.2.0/24", "fd00:244:2::/64"],
                &["192.168.0.2"],
            ),
            node("n3", &["10.244.3.0/24"], &["192.168.0.3"]),
        ];
        let tunnels = |overlay: bool| -> Vec<String> {
            fast_path_tunnels(&plan("n1", &nodes, &[], overlay))
                .iter()
                .map(|(c, t)| format!("{c} {t:?}"))
                .collect()
        };
        // Both families of a node ride on its IPv4 underlay address.
        assert_eq!(
            tunnels(true),
            [
                "10.244.2.0/24 Some(192.168.0.2)",
                "10.244.3.0/24 Some(192.168.0.3)",
                "fd00:244:2::/64 Some(192.168.0.2)",
            ]
        );
        // Native routing (n2's IPv6 CIDR has no IPv6 InternalIP to go through).
        assert_eq!(tunnels(false), ["10.244.2.0/24 None", "10.244.3.0/24 None"]);
        let ifindex = |name: &str| (name == VXLAN_DEVICE).then_some(7);
        let c = fast_path_config(&plan("n1", &nodes, &[], true), ifindex);
        assert_eq!(c.underlay_v4, u32::from_ne_bytes([192, 168, 0, 1]));
        assert_eq!((c.vxlan_ifindex, c.vni, c.port), (7, VXLAN_VNI, VXLAN_PORT));
        assert_eq!(c.mac, [0x0a, 0xfe, 192, 168, 0, 1]);
        // No overlay, or no device yet: nothing to encapsulate with.
        let none = ferry_common::podnet::PodnetConfig::default();
        assert_eq!(
            fast_path_config(&plan("n1", &nodes, &[], false), ifindex),
            none
        );
        assert_eq!(
            fast_path_config(&plan("n1", &nodes, &[], true), |_| None),
            none
        );
        // An IPv6 underlay is left to ferry.vxlan.
        let v6 = [
            node("n1", &["10.244.1.0/24"], &["fd00::1"]),
            node("n2", &["10.244.2.0/24"], &["fd00::2"]),
        ];
        let p = plan("n1", &v6, &[], true);
        assert_eq!(fast_path_tunnels(&p)[0].1, None);
        assert_eq!(fast_path_config(&p, ifindex), none);
    }

    #[test]
    fn the_overlay_routes_every_family_through_the_underlay_family() {
        let nodes = [
            node(
                "n1",
                &["10.244.1.0/24", "fd00:244:1::/64"],
                &["192.168.0.1", "fd00::1"],
            ),
            node(
                "n2",
                &["10.244.2.0/24", "fd00:244:2::/64"],
                &["192.168.0.2"],
            ),
            node("n3", &["10.244.3.0/24"], &["fd00::3"]),
        ];
        let p = plan("n1", &nodes, &[], true);
        let routes: Vec<String> = p.routes.iter().map(ToString::to_string).collect();
        assert_eq!(
            routes,
            [
                "10.244.2.0/24 via 10.244.2.0 dev ferry.vxlan onlink",
                "fd00:244:2::/64 via fd00:244:2:: dev ferry.vxlan onlink",
            ]
        );
        let v = p.vxlan.as_ref().unwrap();
        assert_eq!(v.local, Some("192.168.0.1".parse().unwrap()));
        assert_eq!(v.mac, [0x0a, 0xfe, 192, 168, 0, 1]);
        let own: Vec<String> = v.addresses.iter().map(ToString::to_string).collect();
        assert_eq!(own, ["10.244.1.0", "fd00:244:1::"]);
        let mac2 = [0x0a, 0xfe, 192, 168, 0, 2];
        assert_eq!(
            v.fdb.iter().copied().collect::<Vec<_>>(),
            [(mac2, "192.168.0.2".parse().unwrap())]
        );
        assert_eq!(v.neighbours.len(), 2);
        assert!(
            v.neighbours
                .contains(&("fd00:244:2::".parse().unwrap(), mac2))
        );
        // n3 has no IPv4 InternalIP, the underlay family: reported, not routed.
        assert_eq!(p.problems.len(), 1, "{:?}", p.problems);
        assert!(
            p.problems[0]
                .message
                .contains("no IPv4 InternalIP (the overlay's underlay family)")
        );
        assert_eq!(vxlan_overhead("192.168.0.1".parse().unwrap()), 50);
        assert_eq!(vxlan_overhead("fd00::1".parse().unwrap()), 70);
    }
}
