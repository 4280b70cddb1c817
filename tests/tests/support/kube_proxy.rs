//! kube-proxy's rules on a node, as a fixture: its iptables layouts (legacy and nft
//! backends, IPv4 and IPv6) and nftables tables next to the kubelet's chains and rules of
//! other owners, and the check that a takeover removed kube-proxy's and nothing else.
//! Included with `#[path]` by the test files that need it, next to their `layouts`
//! module (the benchmark's kube-proxy rule generators).

use std::net::Ipv4Addr;

use ferry_tests::*;

use super::layouts::{self, ServicePort};

pub(crate) const VIP: &str = "10.96.0.10";

/// The iptables backends and families, by their save/restore tool prefix.
pub(crate) const IPTABLES: [&str; 4] = [
    "iptables-legacy",
    "iptables-nft",
    "ip6tables-legacy",
    "ip6tables-nft",
];

/// kube-proxy's chains, restated here (independent of the agent's list).
const KP_CHAINS: &[&str] = &[
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-PROXY-FIREWALL",
    "KUBE-PROXY-CANARY",
];
const KP_PREFIXES: &[&str] = &[
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-SEP-",
    "KUBE-EXT-",
    "KUBE-FW-",
];

fn is_kube_proxy(word: &str) -> bool {
    // Words of a saved line: `:CHAIN` declarations, `"quoted"` comments.
    let w = word.trim_start_matches(':').trim_matches('"');
    KP_CHAINS.contains(&w) || KP_PREFIXES.iter().any(|p| w.starts_with(p))
}

pub(crate) fn ports(w: &World) -> Vec<ServicePort> {
    let eps: Vec<(Ipv4Addr, u16)> = w.pods.iter().map(|p| (p.v4, 8080)).collect();
    vec![
        ServicePort {
            svc: "web".into(),
            port_name: "http".into(),
            vip: VIP.parse().unwrap(),
            port: 80,
            proto: "tcp",
            node_port: None,
            endpoints: eps.clone(),
        },
        ServicePort {
            svc: "api".into(),
            port_name: "https".into(),
            vip: "10.96.0.11".parse().unwrap(),
            port: 443,
            proto: "tcp",
            node_port: Some(30443),
            endpoints: eps[..1].to_vec(),
        },
    ]
}

/// Rules of other owners in every iptables table: the kubelet's canaries, a drop mark as
/// older kubelets made it, an unrelated ACCEPT and an unrelated MASQUERADE.
const OTHERS_V4: &str = "*mangle
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
COMMIT
*filter
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
-A INPUT -p tcp -m tcp --dport 2222 -m comment --comment \"not kube-proxy\" -j ACCEPT
COMMIT
*nat
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-MARK-DROP - [0:0]
-A KUBE-MARK-DROP -j MARK --set-xmark 0x8000/0x8000
-A POSTROUTING -s 10.1.0.0/16 -d 203.0.113.0/24 -j MASQUERADE
COMMIT
";

/// A small IPv6 kube-proxy layout and the kubelet's IPv6 chains.
const LAYOUT_V6: &str = "*filter
:KUBE-FIREWALL - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
-A INPUT -j KUBE-FIREWALL
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL
-A INPUT -p tcp -m tcp --dport 2222 -j ACCEPT
COMMIT
*nat
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-V6AAAAAAAAAAAAAA - [0:0]
:KUBE-SEP-V6BBBBBBBBBBBBBB - [0:0]
-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SERVICES -d fd00:96::10/128 -p tcp -m comment --comment \"default/web6:http cluster IP\" -m tcp --dport 80 -j KUBE-SVC-V6AAAAAAAAAAAAAA
-A KUBE-SVC-V6AAAAAAAAAAAAAA -j KUBE-SEP-V6BBBBBBBBBBBBBB
-A KUBE-SEP-V6BBBBBBBBBBBBBB -p tcp -m tcp -j DNAT --to-destination [fd00:1:1::2]:8080
COMMIT
";

/// kube-proxy's IPv6 nftables table, and a table of another owner.
const NFT_EXTRA: &str = "add table ip6 kube-proxy { comment \"rules for kube-proxy\" ; }
add chain ip6 kube-proxy services
add chain ip6 kube-proxy nat-output { type nat hook output priority -100 ; }
add rule ip6 kube-proxy nat-output jump services
add table inet keepme
add chain inet keepme input { type filter hook input priority 10 ; }
add rule inet keepme input tcp dport 2222 accept
";

/// Loads kube-proxy's layouts and the other owners' rules into the node namespace.
pub(crate) fn load_kube_proxy(w: &World) {
    let ports = ports(w);
    let v4 = layouts::iptables_full(&ports);
    let files = [
        ("kp-v4.rules", v4.as_str()),
        ("others-v4.rules", OTHERS_V4),
        ("kp-v6.rules", LAYOUT_V6),
    ];
    for (name, text) in files {
        std::fs::write(w.workdir.join(name), text).unwrap();
    }
    let nft = layouts::nft_full(&ports, &[NODE_V4]) + NFT_EXTRA;
    std::fs::write(w.workdir.join("kp.nft"), nft).unwrap();
    let ns = &w.node_ns;
    let dir = w.workdir.display();
    for backend in ["legacy", "nft"] {
        sh(&format!(
            "ip netns exec {ns} iptables-{backend}-restore --noflush {dir}/kp-v4.rules && \
             ip netns exec {ns} iptables-{backend}-restore --noflush {dir}/others-v4.rules && \
             ip netns exec {ns} ip6tables-{backend}-restore --noflush {dir}/kp-v6.rules"
        ));
    }
    sh(&format!("ip netns exec {ns} nft -f {dir}/kp.nft"));
    // kube-proxy's DNAT happens after routing: the Service range needs a route.
    sh(&format!("ip -n {ns} route add 10.96.0.0/12 dev eth0"));
}

/// `*-save` of one backend in the node namespace, without comments and counters.
pub(crate) fn save(w: &World, tool: &str) -> Vec<String> {
    sh(&format!("ip netns exec {} {tool}-save", w.node_ns))
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            if l.starts_with(':') {
                l.split_whitespace().take(2).collect::<Vec<_>>().join(" ")
            } else {
                l.trim_end().to_string()
            }
        })
        .collect()
}

/// The lines of a dump that are not kube-proxy's (mention none of its chains).
pub(crate) fn others(dump: &[String]) -> Vec<String> {
    dump.iter()
        .filter(|l| !l.split_whitespace().any(is_kube_proxy))
        .cloned()
        .collect()
}

pub(crate) fn nft_tables(w: &World) -> String {
    sh(&format!("ip netns exec {} nft list tables", w.node_ns))
}

/// Everything of other owners before, per backend, and the nft tables.
pub(crate) struct Before {
    pub(crate) iptables: Vec<(String, Vec<String>)>,
    keepme: String,
}

pub(crate) fn before(w: &World) -> Before {
    let iptables: Vec<(String, Vec<String>)> = IPTABLES
        .iter()
        .map(|t| (t.to_string(), save(w, t)))
        .collect();
    for (tool, dump) in &iptables {
        assert!(
            dump.iter().any(|l| l.contains("KUBE-SERVICES")),
            "{tool}: kube-proxy's layout did not load: {dump:#?}"
        );
        assert!(
            dump.iter().any(|l| l.contains("KUBE-KUBELET-CANARY")),
            "{tool}: the kubelet's chains did not load"
        );
    }
    let tables = nft_tables(w);
    assert!(
        tables.contains("table ip kube-proxy") && tables.contains("table ip6 kube-proxy"),
        "kube-proxy's nftables tables did not load: {tables}"
    );
    Before {
        iptables,
        keepme: sh(&format!(
            "ip netns exec {} nft list table inet keepme",
            w.node_ns
        )),
    }
}

/// Nothing of kube-proxy's is left, and every other rule is as it was.
pub(crate) fn assert_only_kube_proxy_removed(w: &World, b: &Before) {
    for (tool, dump) in &b.iptables {
        let now = save(w, tool);
        let left: Vec<&String> = now
            .iter()
            .filter(|l| l.split_whitespace().any(is_kube_proxy))
            .collect();
        assert!(left.is_empty(), "{tool}: kube-proxy rules left: {left:#?}");
        assert_eq!(
            others(dump),
            now,
            "{tool}: the rules of other owners changed (expected left, seen right)"
        );
        for kept in ["KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "--dport 2222"] {
            assert!(
                now.iter().any(|l| l.contains(kept)),
                "{tool}: {kept} was removed: {now:#?}"
            );
        }
    }
    let tables = nft_tables(w);
    assert!(
        !tables.contains("kube-proxy"),
        "kube-proxy's nftables tables are left: {tables}"
    );
    let keepme = sh(&format!(
        "ip netns exec {} nft list table inet keepme",
        w.node_ns
    ));
    assert_eq!(keepme, b.keepme, "another owner's nftables table changed");
}
