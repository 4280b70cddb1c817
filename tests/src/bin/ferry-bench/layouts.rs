//! The rules kube-proxy would program for the same Services, generated for the
//! comparison variants: its iptables layout (an `iptables-restore` input) and its
//! nftables layout (an `nft -f` input), following
//! shared/reference/kube-proxy-rule-layouts.md (sections 6.1 and 6.2), and the same
//! Services as manifests for ferry.
//!
//! Chain names have kube-proxy's shape (prefix + 16 or 8 base32 characters of a hash
//! of the name); the hash is not SHA-256, which only changes the letters.

use std::{
    fmt::Write as _,
    hash::{DefaultHasher, Hash, Hasher},
    net::Ipv4Addr,
};

use serde_json::{Value, json};

/// kube-proxy's masquerade mark (bit 14).
const MASQ: &str = "0x4000";
/// The cluster (pod) CIDR of the local-traffic detector.
pub(crate) const POD_CIDR: &str = "10.128.0.0/9";
/// The Service CIDR (`cluster-ips-check` drops unallocated addresses in it).
pub(crate) const SERVICE_CIDR: &str = "10.96.0.0/12";
/// kube-proxy drops the per-endpoint comments above this many endpoints.
const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

/// One Service port with its endpoints, as both generators and ferry's manifests see it.
#[derive(Clone, Debug)]
pub(crate) struct ServicePort {
    pub(crate) svc: String,
    pub(crate) port_name: String,
    pub(crate) vip: Ipv4Addr,
    pub(crate) port: u16,
    /// "tcp" or "udp".
    pub(crate) proto: &'static str,
    pub(crate) node_port: Option<u16>,
    pub(crate) endpoints: Vec<(Ipv4Addr, u16)>,
}

impl ServicePort {
    /// kube-proxy's service port name, `ns/name:port`.
    fn spn(&self) -> String {
        format!("default/{}:{}", self.svc, self.port_name)
    }
    fn svc_chain(&self) -> String {
        format!(
            "KUBE-SVC-{}",
            hash32(&format!("{}{}", self.spn(), self.proto), 16)
        )
    }
    fn ext_chain(&self) -> String {
        format!(
            "KUBE-EXT-{}",
            hash32(&format!("{}{}", self.spn(), self.proto), 16)
        )
    }
    fn sep_chain(&self, ep: (Ipv4Addr, u16)) -> String {
        format!(
            "KUBE-SEP-{}",
            hash32(
                &format!("{}{}{}:{}", self.spn(), self.proto, ep.0, ep.1),
                16
            )
        )
    }
    /// nftables: `service-<H8>-ns/name/proto/port`.
    fn nft_base(&self) -> String {
        format!("default/{}/{}/{}", self.svc, self.proto, self.port_name)
    }
    fn nft_service(&self) -> String {
        let b = self.nft_base();
        format!("service-{}-{b}", hash32(&b, 8))
    }
    fn nft_external(&self) -> String {
        let b = self.nft_base();
        format!("external-{}-{b}", hash32(&b, 8))
    }
    fn nft_endpoint(&self, ep: (Ipv4Addr, u16)) -> String {
        let b = format!("{}__{}/{}", self.nft_base(), ep.0, ep.1);
        format!("endpoint-{}-{b}", hash32(&b, 8))
    }
}

/// `n` base32 characters of a 128-bit hash of `s`.
fn hash32(s: &str, n: usize) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut bits: u128 = 0;
    for seed in 0..2u8 {
        let mut h = DefaultHasher::new();
        (seed, s).hash(&mut h);
        bits = (bits << 64) | h.finish() as u128;
    }
    (0..n)
        .map(|i| ALPHABET[((bits >> (5 * i)) & 31) as usize] as char)
        .collect()
}

fn total_endpoints(ports: &[ServicePort]) -> usize {
    ports.iter().map(|p| p.endpoints.len()).sum()
}

// ---------------------------------------------------------------------------------------
// iptables

/// The jump rules kube-proxy inserts into the built-in chains (`iptables -I`).
fn iptables_jumps(table: &str) -> &'static [&'static str] {
    match table {
        "filter" => &[
            "-I INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL",
            "-I INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS",
            "-I INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES",
            "-I INPUT -j KUBE-FIREWALL",
            "-I FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL",
            "-I FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD",
            "-I FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
            "-I FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES",
            "-I OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL",
            "-I OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
            "-I OUTPUT -j KUBE-FIREWALL",
        ],
        _ => &[
            "-I PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
            "-I OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
            "-I POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING",
        ],
    }
}

/// The filter table (the same in every sync: no Service here lacks endpoints).
fn iptables_filter(out: &mut String, with_jumps: bool) {
    out.push_str("*filter\n");
    for c in [
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FORWARD",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-FIREWALL",
        "KUBE-FIREWALL",
    ] {
        let _ = writeln!(out, ":{c} - [0:0]");
    }
    out.push_str("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n");
    let _ = writeln!(
        out,
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark {MASQ}/{MASQ} -j ACCEPT"
    );
    out.push_str("-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n");
    out.push_str("-A KUBE-FIREWALL -m comment --comment \"block incoming localnet connections\" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP\n");
    if with_jumps {
        for j in iptables_jumps("filter") {
            let _ = writeln!(out, "{j}");
        }
    }
    out.push_str("COMMIT\n");
}

/// The nat lines kube-proxy rewrites on every sync: static chains, KUBE-SERVICES and
/// KUBE-NODEPORTS for every Service port.
fn iptables_nat_head(out: &mut String, ports: &[ServicePort]) {
    out.push_str("*nat\n");
    for c in [
        "KUBE-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-POSTROUTING",
        "KUBE-MARK-MASQ",
    ] {
        let _ = writeln!(out, ":{c} - [0:0]");
    }
    let _ = writeln!(
        out,
        "-A KUBE-POSTROUTING -m mark ! --mark {MASQ}/{MASQ} -j RETURN"
    );
    let _ = writeln!(out, "-A KUBE-POSTROUTING -j MARK --xor-mark {MASQ}");
    out.push_str("-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n");
    let _ = writeln!(out, "-A KUBE-MARK-MASQ -j MARK --or-mark {MASQ}");
    for p in ports {
        let _ = writeln!(
            out,
            "-A KUBE-SERVICES -m comment --comment \"{} cluster IP\" -m {proto} -p {proto} -d {}/32 --dport {} -j {}",
            p.spn(),
            p.vip,
            p.port,
            p.svc_chain(),
            proto = p.proto
        );
        if let Some(np) = p.node_port {
            let _ = writeln!(
                out,
                "-A KUBE-NODEPORTS -m comment --comment {} -m {proto} -p {proto} --dport {np} -j {}",
                p.spn(),
                p.ext_chain(),
                proto = p.proto
            );
        }
    }
    out.push_str("-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n");
}

/// Declarations and rules of one Service port's own chains (SVC, EXT, SEP).
fn iptables_service_chains(decl: &mut String, rules: &mut String, p: &ServicePort, comments: bool) {
    let spn = p.spn();
    let svc = p.svc_chain();
    let _ = writeln!(decl, ":{svc} - [0:0]");
    if p.node_port.is_some() {
        let ext = p.ext_chain();
        let _ = writeln!(decl, ":{ext} - [0:0]");
        let _ = writeln!(
            rules,
            "-A {ext} -m comment --comment \"masquerade traffic for {spn} external destinations\" -j KUBE-MARK-MASQ"
        );
        let _ = writeln!(rules, "-A {ext} -j {svc}");
    }
    let _ = writeln!(
        rules,
        "-A {svc} -m comment --comment \"{spn} cluster IP\" -m {proto} -p {proto} -d {}/32 --dport {} ! -s {POD_CIDR} -j KUBE-MARK-MASQ",
        p.vip,
        p.port,
        proto = p.proto
    );
    let n = p.endpoints.len();
    for (i, ep) in p.endpoints.iter().enumerate() {
        let sep = p.sep_chain(*ep);
        let comment = if comments {
            format!("-m comment --comment \"{spn} -> {}:{}\" ", ep.0, ep.1)
        } else {
            String::new()
        };
        if i + 1 < n {
            let _ = writeln!(
                rules,
                "-A {svc} {comment}-m statistic --mode random --probability {:.10} -j {sep}",
                1.0 / (n - i) as f64
            );
        } else {
            let _ = writeln!(rules, "-A {svc} {comment}-j {sep}");
        }
        let _ = writeln!(decl, ":{sep} - [0:0]");
        let c = if comments {
            format!("-m comment --comment {spn} ")
        } else {
            String::new()
        };
        let _ = writeln!(rules, "-A {sep} {c}-s {}/32 -j KUBE-MARK-MASQ", ep.0);
        let _ = writeln!(
            rules,
            "-A {sep} {c}-m {proto} -p {proto} -j DNAT --to-destination {}:{}",
            ep.0,
            ep.1,
            proto = p.proto
        );
    }
}

/// A full sync (`iptables-restore --noflush`): both tables, every chain, and the jump
/// rules in the built-in chains.
pub(crate) fn iptables_full(ports: &[ServicePort]) -> String {
    let comments = total_endpoints(ports) <= LARGE_CLUSTER_ENDPOINTS;
    let mut out = String::with_capacity(ports.len() * 1200);
    iptables_filter(&mut out, true);
    let mut head = String::new();
    iptables_nat_head(&mut head, ports);
    let (mut decl, mut rules) = (String::new(), String::new());
    for p in ports {
        iptables_service_chains(&mut decl, &mut rules, p, comments);
    }
    // Declarations first (they flush), then the rules, as kube-proxy writes them.
    let (first, rest) = head.split_at(head.find('\n').unwrap_or(0) + 1);
    out.push_str(first);
    out.push_str(&decl);
    out.push_str(rest);
    out.push_str(&rules);
    for j in iptables_jumps("nat") {
        let _ = writeln!(out, "{j}");
    }
    out.push_str("COMMIT\n");
    out
}

/// kube-proxy's partial sync after one Service port's endpoints changed: the filter
/// table, KUBE-SERVICES / KUBE-NODEPORTS for every Service port, the changed Service's
/// chains, and `-X` for its endpoint chains that are gone.
pub(crate) fn iptables_partial(
    ports: &[ServicePort],
    old: &ServicePort,
    new: &ServicePort,
) -> String {
    let comments = total_endpoints(ports) <= LARGE_CLUSTER_ENDPOINTS;
    let mut out = String::new();
    iptables_filter(&mut out, false);
    let mut head = String::new();
    iptables_nat_head(&mut head, ports);
    let (mut decl, mut rules) = (String::new(), String::new());
    iptables_service_chains(&mut decl, &mut rules, new, comments);
    // A stale chain is declared (which empties it), then deleted.
    for ep in &old.endpoints {
        if !new.endpoints.contains(ep) {
            let _ = writeln!(decl, ":{} - [0:0]", old.sep_chain(*ep));
            let _ = writeln!(rules, "-X {}", old.sep_chain(*ep));
        }
    }
    let (first, rest) = head.split_at(head.find('\n').unwrap_or(0) + 1);
    out.push_str(first);
    out.push_str(&decl);
    out.push_str(rest);
    out.push_str(&rules);
    out.push_str("COMMIT\n");
    out
}

// ---------------------------------------------------------------------------------------
// nftables

const T: &str = "ip kube-proxy";

/// The base objects of a full sync.
fn nft_base(out: &mut String, node_ips: &[Ipv4Addr]) {
    let _ = writeln!(
        out,
        "add table {T} {{ comment \"rules for kube-proxy\" ; }}"
    );
    for c in [
        "mark-for-masquerade",
        "masquerading",
        "services",
        "service-endpoints-check",
        "nodeport-endpoints-check",
        "firewall-check",
        "cluster-ips-check",
        "reject-chain",
    ] {
        let _ = writeln!(out, "add chain {T} {c}");
    }
    let _ = writeln!(
        out,
        "add rule {T} mark-for-masquerade mark set mark or {MASQ}"
    );
    let _ = writeln!(out, "add rule {T} masquerading mark and {MASQ} == 0 return");
    let _ = writeln!(out, "add rule {T} masquerading mark set mark xor {MASQ}");
    let _ = writeln!(out, "add rule {T} masquerading masquerade fully-random");
    let _ = writeln!(out, "add rule {T} reject-chain reject");
    let _ = writeln!(
        out,
        "add set {T} cluster-ips {{ type ipv4_addr ; comment \"Active ClusterIPs\" ; }}"
    );
    let _ = writeln!(
        out,
        "add set {T} nodeport-ips {{ type ipv4_addr ; comment \"IPs that accept NodePort traffic\" ; }}"
    );
    let key3 = "type ipv4_addr . inet_proto . inet_service : verdict";
    for m in ["service-ips", "firewall-ips", "no-endpoint-services"] {
        let _ = writeln!(out, "add map {T} {m} {{ {key3} ; }}");
    }
    for m in ["service-nodeports", "no-endpoint-nodeports"] {
        let _ = writeln!(
            out,
            "add map {T} {m} {{ type inet_proto . inet_service : verdict ; }}"
        );
    }
    let base: [(&str, &str, &str, i32, &[&str]); 8] = [
        (
            "nat-prerouting",
            "nat",
            "prerouting",
            -100,
            &["jump services"],
        ),
        ("nat-output", "nat", "output", -100, &["jump services"]),
        (
            "nat-postrouting",
            "nat",
            "postrouting",
            100,
            &["jump masquerading"],
        ),
        (
            "filter-prerouting-pre-dnat",
            "filter",
            "prerouting",
            -110,
            &["ct state new jump firewall-check"],
        ),
        (
            "filter-output-pre-dnat",
            "filter",
            "output",
            -110,
            &["ct state new jump firewall-check"],
        ),
        (
            "filter-forward",
            "filter",
            "forward",
            0,
            &[
                "ct state new jump service-endpoints-check",
                "ct state new jump cluster-ips-check",
            ],
        ),
        (
            "filter-input",
            "filter",
            "input",
            0,
            &[
                "ct state new jump nodeport-endpoints-check",
                "ct state new jump service-endpoints-check",
            ],
        ),
        (
            "filter-output",
            "filter",
            "output",
            0,
            &[
                "ct state new jump service-endpoints-check",
                "ct state new jump cluster-ips-check",
            ],
        ),
    ];
    for (name, ty, hook, prio, rules) in base {
        let _ = writeln!(
            out,
            "add chain {T} {name} {{ type {ty} hook {hook} priority {prio} ; }}"
        );
        for r in rules {
            let _ = writeln!(out, "add rule {T} {name} {r}");
        }
    }
    let _ = writeln!(
        out,
        "add rule {T} services ip daddr . meta l4proto . th dport vmap @service-ips"
    );
    let _ = writeln!(
        out,
        "add rule {T} services ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports"
    );
    let _ = writeln!(
        out,
        "add rule {T} service-endpoints-check ip daddr . meta l4proto . th dport vmap @no-endpoint-services"
    );
    let _ = writeln!(
        out,
        "add rule {T} nodeport-endpoints-check ip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports"
    );
    let _ = writeln!(
        out,
        "add rule {T} firewall-check ip daddr . meta l4proto . th dport vmap @firewall-ips"
    );
    let _ = writeln!(
        out,
        "add rule {T} cluster-ips-check ip daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\""
    );
    let _ = writeln!(
        out,
        "add rule {T} cluster-ips-check ip daddr {{ {SERVICE_CIDR} }} drop comment \"Drop traffic to unallocated ClusterIPs\""
    );
    if !node_ips.is_empty() {
        let ips: Vec<String> = node_ips.iter().map(Ipv4Addr::to_string).collect();
        let _ = writeln!(out, "add element {T} nodeport-ips {{ {} }}", ips.join(", "));
    }
}

/// One Service port's chains (service, external, endpoints), created and filled.
fn nft_service_chains(out: &mut String, p: &ServicePort, flush: bool) {
    let svc = p.nft_service();
    let _ = writeln!(out, "add chain {T} {svc}");
    if flush {
        let _ = writeln!(out, "flush chain {T} {svc}");
    }
    let _ = writeln!(
        out,
        "add rule {T} {svc} ip daddr {} ip saddr != {POD_CIDR} jump mark-for-masquerade",
        p.vip
    );
    let arms: Vec<String> = p
        .endpoints
        .iter()
        .enumerate()
        .map(|(i, ep)| format!("{i} : goto {}", p.nft_endpoint(*ep)))
        .collect();
    for ep in &p.endpoints {
        let c = p.nft_endpoint(*ep);
        let _ = writeln!(out, "add chain {T} {c}");
        if flush {
            let _ = writeln!(out, "flush chain {T} {c}");
        }
        let _ = writeln!(
            out,
            "add rule {T} {c} ip saddr {} jump mark-for-masquerade",
            ep.0
        );
        let _ = writeln!(
            out,
            "add rule {T} {c} meta l4proto {} dnat to {}:{}",
            p.proto, ep.0, ep.1
        );
    }
    let _ = writeln!(
        out,
        "add rule {T} {svc} numgen random mod {} vmap {{ {} }}",
        p.endpoints.len(),
        arms.join(" , ")
    );
    if p.node_port.is_some() {
        let ext = p.nft_external();
        let _ = writeln!(out, "add chain {T} {ext}");
        let _ = writeln!(out, "add rule {T} {ext} jump mark-for-masquerade");
        let _ = writeln!(out, "add rule {T} {ext} goto {svc}");
    }
}

/// A full sync (`nft -f`): base objects, every Service port's chains, then the set and
/// map elements (in batches of 1,000 per command).
pub(crate) fn nft_full(ports: &[ServicePort], node_ips: &[Ipv4Addr]) -> String {
    let mut out = String::with_capacity(ports.len() * 1500);
    nft_base(&mut out, node_ips);
    for p in ports {
        nft_service_chains(&mut out, p, false);
    }
    for chunk in ports.chunks(1000) {
        let ips: Vec<String> = chunk.iter().map(|p| p.vip.to_string()).collect();
        let _ = writeln!(out, "add element {T} cluster-ips {{ {} }}", ips.join(", "));
        let elems: Vec<String> = chunk
            .iter()
            .map(|p| {
                format!(
                    "{} . {} . {} : goto {}",
                    p.vip,
                    p.proto,
                    p.port,
                    p.nft_service()
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "add element {T} service-ips {{ {} }}",
            elems.join(", ")
        );
        let nps: Vec<String> = chunk
            .iter()
            .filter_map(|p| {
                p.node_port
                    .map(|np| format!("{} . {np} : goto {}", p.proto, p.nft_external()))
            })
            .collect();
        if !nps.is_empty() {
            let _ = writeln!(
                out,
                "add element {T} service-nodeports {{ {} }}",
                nps.join(", ")
            );
        }
    }
    out
}

/// kube-proxy's partial sync after one Service port's endpoints changed: its chains
/// are re-created (add + flush + rules); endpoint chains that are gone are flushed
/// (kube-proxy deletes them a second later).
pub(crate) fn nft_partial(old: &ServicePort, new: &ServicePort) -> String {
    let mut out = String::new();
    nft_service_chains(&mut out, new, true);
    for ep in &old.endpoints {
        if !new.endpoints.contains(ep) {
            let _ = writeln!(out, "flush chain {T} {}", old.nft_endpoint(*ep));
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// ferry: the same Services as manifests

/// The Service and EndpointSlice objects of the Service ports of one Service (ports
/// share the Service name), for a `kind: List` manifest.
pub(crate) fn manifests(ports: &[&ServicePort]) -> Vec<Value> {
    let p0 = ports[0];
    let svc_type = if p0.node_port.is_some() {
        "NodePort"
    } else {
        "ClusterIP"
    };
    let spec_ports: Vec<Value> = ports
        .iter()
        .map(|p| {
            let mut v = json!({
                "name": p.port_name,
                "port": p.port,
                "protocol": p.proto.to_uppercase(),
                "targetPort": p.endpoints.first().map(|e| e.1).unwrap_or(p.port),
            });
            if let Some(np) = p.node_port {
                v["nodePort"] = json!(np);
            }
            v
        })
        .collect();
    let slice_ports: Vec<Value> = ports
        .iter()
        .map(|p| {
            json!({
                "name": p.port_name,
                "port": p.endpoints.first().map(|e| e.1).unwrap_or(p.port),
                "protocol": p.proto.to_uppercase(),
            })
        })
        .collect();
    let eps: Vec<Value> = p0
        .endpoints
        .iter()
        .map(|(ip, _)| {
            json!({
                "addresses": [ip.to_string()],
                "conditions": {"ready": true, "serving": true, "terminating": false},
            })
        })
        .collect();
    vec![
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": p0.svc, "namespace": "default"},
            "spec": {
                "type": svc_type,
                "clusterIP": p0.vip.to_string(),
                "clusterIPs": [p0.vip.to_string()],
                "ports": spec_ports,
            },
        }),
        json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": format!("{}-0", p0.svc),
                "namespace": "default",
                "labels": {"kubernetes.io/service-name": p0.svc},
            },
            "addressType": "IPv4",
            "ports": slice_ports,
            "endpoints": eps,
        }),
    ]
}

/// A `kind: List` document.
pub(crate) fn list(items: Vec<Value>) -> String {
    json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sp(i: u8, eps: usize) -> ServicePort {
        ServicePort {
            svc: format!("svc-{i}"),
            port_name: "http".into(),
            vip: Ipv4Addr::new(10, 96, 0, i),
            port: 80,
            proto: "tcp",
            node_port: None,
            endpoints: (0..eps)
                .map(|e| (Ipv4Addr::new(10, 200, i, e as u8 + 1), 8080))
                .collect(),
        }
    }

    #[test]
    fn iptables_probabilities_and_comments() {
        let ports = vec![sp(1, 4)];
        let r = iptables_full(&ports);
        assert!(r.contains("--probability 0.2500000000"));
        assert!(r.contains("--probability 0.3333333333"));
        assert!(r.contains("--probability 0.5000000000"));
        assert_eq!(r.matches("-j DNAT").count(), 4);
        assert!(r.contains("-> 10.200.1.1:8080"));
        // Above 1,000 endpoints the per-endpoint comments go.
        let big: Vec<ServicePort> = (0..251).map(|i| sp(i as u8, 4)).collect();
        assert!(!iptables_full(&big).contains(" -> "));
    }

    #[test]
    fn nft_layout_has_one_chain_per_endpoint() {
        let r = nft_full(&[sp(1, 4)], &[]);
        assert_eq!(r.matches("add chain ip kube-proxy endpoint-").count(), 4);
        assert!(r.contains("numgen random mod 4 vmap"));
        assert!(r.contains("10.96.0.1 . tcp . 80 : goto service-"));
    }
}
