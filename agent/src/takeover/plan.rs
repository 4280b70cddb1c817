//! The pure part of the takeover: which chains are kube-proxy's, what an
//! `iptables-save` dump holds, and the `iptables-restore --noflush` input that removes
//! exactly kube-proxy's chains and the jumps to them.
//!
//! Ownership follows kube-proxy's own cleanup (`CleanupLeftovers` of its iptables and
//! ipvs modes): per table, a fixed set of chains plus the per-Service chain prefixes.
//! The kubelet's chains (`KUBE-FIREWALL`, `KUBE-KUBELET-CANARY`, and `KUBE-MARK-DROP`,
//! which both made in older releases and kube-proxy's cleanup never deleted) stay.

/// kube-proxy's fixed chains in the nat table (iptables and ipvs modes).
const NAT_CHAINS: &[&str] = &[
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    "KUBE-PROXY-CANARY",
    // ipvs mode
    "KUBE-NODE-PORT",
    "KUBE-LOAD-BALANCER",
];

/// kube-proxy's per-Service chains in the nat table: `KUBE-SVC-` (cluster policy),
/// `KUBE-SVL-` (local policy), `KUBE-EXT-`, `KUBE-FW-` (load balancer firewall),
/// `KUBE-SEP-` (endpoint), `KUBE-XLB-` (local policy before 1.24).
const NAT_PREFIXES: &[&str] = &[
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-EXT-",
    "KUBE-FW-",
    "KUBE-SEP-",
    "KUBE-XLB-",
];

/// kube-proxy's chains in the filter table (iptables and ipvs modes).
const FILTER_CHAINS: &[&str] = &[
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-NODEPORTS",
    "KUBE-PROXY-FIREWALL",
    "KUBE-PROXY-CANARY",
    // ipvs mode
    "KUBE-NODE-PORT",
    "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER",
    "KUBE-IPVS-OUT-FILTER",
];

/// True when `chain` of iptables table `table` is kube-proxy's.
pub fn is_kube_proxy_chain(table: &str, chain: &str) -> bool {
    match table {
        "nat" => NAT_CHAINS.contains(&chain) || NAT_PREFIXES.iter().any(|p| chain.starts_with(p)),
        "filter" => FILTER_CHAINS.contains(&chain),
        "mangle" => chain == "KUBE-PROXY-CANARY",
        _ => false,
    }
}

/// A chain of a saved table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedChain {
    pub name: String,
    /// Built-in chains have a policy (`:INPUT ACCEPT [0:0]`), user chains `-`.
    pub builtin: bool,
}

/// A rule of a saved table, as saved (`-A CHAIN ...`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedRule {
    pub chain: String,
    pub line: String,
    /// The chain or target of `-j`/`--jump`/`-g`/`--goto`.
    pub target: Option<String>,
}

/// One table of an `iptables-save` dump.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedTable {
    pub name: String,
    pub chains: Vec<SavedChain>,
    pub rules: Vec<SavedRule>,
}

/// Splits a saved rule into words the way iptables-restore does: double quotes group,
/// a backslash escapes the next character inside them.
pub fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let (mut quoted, mut escaped, mut any) = (false, false, false);
    for c in line.chars() {
        if escaped {
            cur.push(c);
            escaped = false;
        } else if quoted && c == '\\' {
            escaped = true;
        } else if c == '"' {
            quoted = !quoted;
            any = true;
        } else if c.is_whitespace() && !quoted {
            if any || !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            any = false;
        } else {
            cur.push(c);
        }
    }
    if any || !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn target_of(words: &[String]) -> Option<String> {
    words
        .windows(2)
        .find(|w| matches!(w[0].as_str(), "-j" | "--jump" | "-g" | "--goto"))
        .map(|w| w[1].clone())
}

/// Parses an `iptables-save` dump (any number of tables; comments ignored).
pub fn parse_save(text: &str) -> Vec<SavedTable> {
    let mut tables = Vec::new();
    let mut cur: Option<SavedTable> = None;
    for line in text.lines() {
        let line = line.trim_end();
        if let Some(name) = line.strip_prefix('*') {
            if let Some(t) = cur.take() {
                tables.push(t);
            }
            cur = Some(SavedTable {
                name: name.trim().to_string(),
                ..Default::default()
            });
        } else if line == "COMMIT" {
            if let Some(t) = cur.take() {
                tables.push(t);
            }
        } else if let Some(t) = cur.as_mut() {
            if let Some(decl) = line.strip_prefix(':') {
                let mut f = decl.split_whitespace();
                if let Some(name) = f.next() {
                    t.chains.push(SavedChain {
                        name: name.to_string(),
                        builtin: f.next().is_some_and(|p| p != "-"),
                    });
                }
            } else if line.starts_with("-A ") {
                let w = words(line);
                if let Some(chain) = w.get(1) {
                    t.rules.push(SavedRule {
                        chain: chain.clone(),
                        line: line.to_string(),
                        target: target_of(&w),
                    });
                }
            }
        }
    }
    if let Some(t) = cur {
        tables.push(t);
    }
    tables
}

/// What to remove from one table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TablePlan {
    pub table: String,
    /// kube-proxy's chains present in the table, in the dump's order: flushed, deleted.
    pub chains: Vec<String>,
    /// kube-proxy's chains that another owner's chain jumps to (and those they jump
    /// to): left whole, since removing them would change that owner's rules.
    pub kept: Vec<String>,
    /// The rules inside those chains (they go with the flush).
    pub chain_rules: usize,
    /// Rules of built-in chains that jump to a chain above, as saved; each is deleted by
    /// its spec.
    pub jumps: Vec<String>,
}

impl TablePlan {
    /// Nothing to remove (kept chains are reported, not changed).
    pub fn is_empty(&self) -> bool {
        self.chains.is_empty() && self.jumps.is_empty()
    }

    pub fn rules_removed(&self) -> usize {
        self.chain_rules + self.jumps.len()
    }

    /// The `iptables-restore --noflush` input: declaring a chain flushes it, then the
    /// jumps are deleted by their saved spec, then the chains are deleted; one COMMIT,
    /// so the table changes at once or not at all.
    pub fn restore_input(&self) -> String {
        let mut out = format!("*{}\n", self.table);
        for c in &self.chains {
            out.push_str(&format!(":{c} - [0:0]\n"));
        }
        for j in &self.jumps {
            // Saved as `-A CHAIN spec`; the same spec deletes it.
            out.push_str("-D ");
            out.push_str(j.strip_prefix("-A ").unwrap_or(j));
            out.push('\n');
        }
        for c in &self.chains {
            out.push_str(&format!("-X {c}\n"));
        }
        out.push_str("COMMIT\n");
        out
    }
}

/// What to remove from `table`: kube-proxy's chains and the jumps to them from built-in
/// chains. A kube-proxy chain that a chain of another owner jumps to stays whole, with
/// every kube-proxy chain it reaches (deleting it would mean editing that owner's rules).
pub fn plan_table(table: &SavedTable) -> TablePlan {
    use std::collections::BTreeSet;
    let builtin: BTreeSet<&str> = table
        .chains
        .iter()
        .filter(|c| c.builtin)
        .map(|c| c.name.as_str())
        .collect();
    let kube_proxy: BTreeSet<&str> = table
        .chains
        .iter()
        .filter(|c| !c.builtin && is_kube_proxy_chain(&table.name, &c.name))
        .map(|c| c.name.as_str())
        .collect();
    // Kept: reached from another owner's chain, then everything a kept chain reaches.
    let mut kept: BTreeSet<&str> = table
        .rules
        .iter()
        .filter(|r| !builtin.contains(r.chain.as_str()) && !kube_proxy.contains(r.chain.as_str()))
        .filter_map(|r| r.target.as_deref())
        .filter(|t| kube_proxy.contains(t))
        .collect();
    loop {
        let more: Vec<&str> = table
            .rules
            .iter()
            .filter(|r| kept.contains(r.chain.as_str()))
            .filter_map(|r| r.target.as_deref())
            .filter(|t| kube_proxy.contains(t) && !kept.contains(t))
            .collect();
        if more.is_empty() {
            break;
        }
        kept.extend(more);
    }
    let in_order = |keep: bool| -> Vec<String> {
        table
            .chains
            .iter()
            .map(|c| c.name.as_str())
            .filter(|c| kube_proxy.contains(c) && kept.contains(c) == keep)
            .map(str::to_string)
            .collect()
    };
    let chains = in_order(false);
    let ours = |c: &str| chains.iter().any(|k| k == c);
    let chain_rules = table.rules.iter().filter(|r| ours(&r.chain)).count();
    let jumps = table
        .rules
        .iter()
        .filter(|r| builtin.contains(r.chain.as_str()) && r.target.as_deref().is_some_and(ours))
        .map(|r| r.line.clone())
        .collect();
    TablePlan {
        table: table.name.clone(),
        kept: in_order(true),
        chains,
        chain_rules,
        jumps,
    }
}

/// The tables in `nft list tables` output, as (family, name).
pub fn parse_nft_tables(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            match (f.next(), f.next(), f.next()) {
                (Some("table"), Some(family), Some(name)) => {
                    Some((family.to_string(), name.to_string()))
                }
                _ => None,
            }
        })
        .collect()
}

/// The chains of an `nft list table` listing and the number of rules in them.
pub fn nft_chains_and_rules(listing: &str) -> (Vec<String>, usize) {
    let mut chains = Vec::new();
    let mut rules = 0;
    let mut in_chain = false;
    for l in listing.lines().map(str::trim) {
        if let Some(rest) = l.strip_prefix("chain ") {
            chains.push(rest.trim_end_matches('{').trim().to_string());
            in_chain = true;
        } else if l == "}"
            || l.starts_with("set ")
            || l.starts_with("map ")
            || l.starts_with("flowtable ")
        {
            in_chain = false;
        } else if in_chain
            && !l.is_empty()
            && !l.starts_with("type ")
            && !l.starts_with("policy ")
            && !l.starts_with("comment ")
        {
            rules += 1;
        }
    }
    (chains, rules)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node that ran kube-proxy (iptables mode) next to the kubelet's chains, a CNI's
    /// chain and an unrelated rule, as `iptables-save` prints it.
    const DUMP: &str = r#"# Generated by iptables-save v1.8.9 on Fri Nov 27 23:41:40 2026
*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
COMMIT
# Completed on Fri Nov 27 23:41:40 2026
*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
:CNI-FORWARD - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A INPUT -j KUBE-FIREWALL
-A INPUT -p tcp -m tcp --dport 22 -m comment --comment "ssh -j KUBE-SERVICES" -j ACCEPT
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A FORWARD -j CNI-FORWARD
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -j KUBE-FIREWALL
-A CNI-FORWARD -s 10.128.0.0/9 -j ACCEPT
-A CNI-FORWARD -j KUBE-FORWARD
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-SERVICES -d 10.96.0.20/32 -p tcp -m comment --comment "default/empty:http has no endpoints" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-MARK-DROP - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SEP-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-BBBBBBBBBBBBBBBB - [0:0]
:KUBE-EXT-BBBBBBBBBBBBBBBB - [0:0]
:KUBE-SVL-CCCCCCCCCCCCCCCC - [0:0]
:KUBE-FW-CCCCCCCCCCCCCCCC - [0:0]
:CNI-HOSTPORT-DNAT - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -s 10.128.0.0/9 ! -d 10.128.0.0/9 -j MASQUERADE
-A KUBE-MARK-DROP -j MARK --set-xmark 0x8000/0x8000
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-SEP-AAAAAAAAAAAAAAAA -s 10.1.1.2/32 -m comment --comment default/web:http -j KUBE-MARK-MASQ
-A KUBE-SEP-AAAAAAAAAAAAAAAA -p tcp -m comment --comment default/web:http -m tcp -j DNAT --to-destination 10.1.1.2:8080
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-BBBBBBBBBBBBBBBB
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-NODEPORTS -p tcp -m comment --comment default/web:http -m tcp --dport 30080 -j KUBE-EXT-BBBBBBBBBBBBBBBB
-A KUBE-EXT-BBBBBBBBBBBBBBBB -j KUBE-SVC-BBBBBBBBBBBBBBBB
-A KUBE-SVC-BBBBBBBBBBBBBBBB -m comment --comment "default/web:http -> 10.1.1.2:8080" -j KUBE-SEP-AAAAAAAAAAAAAAAA
-A CNI-HOSTPORT-DNAT -p tcp -m tcp --dport 8443 -j DNAT --to-destination 10.1.3.2:443
COMMIT
"#;

    fn plan(name: &str) -> TablePlan {
        let t = parse_save(DUMP)
            .into_iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no table {name} in the dump"));
        plan_table(&t)
    }

    #[test]
    fn words_follow_iptables_quoting() {
        assert_eq!(
            words(r#"-A X -m comment --comment "a \"q\" b" -j ACCEPT"#),
            [
                "-A",
                "X",
                "-m",
                "comment",
                "--comment",
                r#"a "q" b"#,
                "-j",
                "ACCEPT"
            ]
        );
        assert_eq!(words(r#"-A X --comment "" -j Y"#)[3], "");
    }

    #[test]
    fn ownership_follows_kube_proxy() {
        for (table, chain) in [
            ("nat", "KUBE-SERVICES"),
            ("nat", "KUBE-SVC-ABC"),
            ("nat", "KUBE-SVL-ABC"),
            ("nat", "KUBE-SEP-ABC"),
            ("nat", "KUBE-EXT-ABC"),
            ("nat", "KUBE-FW-ABC"),
            ("nat", "KUBE-XLB-ABC"),
            ("nat", "KUBE-MARK-MASQ"),
            ("nat", "KUBE-POSTROUTING"),
            ("nat", "KUBE-LOAD-BALANCER"),
            ("filter", "KUBE-PROXY-FIREWALL"),
            ("filter", "KUBE-EXTERNAL-SERVICES"),
            ("mangle", "KUBE-PROXY-CANARY"),
        ] {
            assert!(
                is_kube_proxy_chain(table, chain),
                "{table} {chain} is kube-proxy's"
            );
        }
        for (table, chain) in [
            ("filter", "KUBE-FIREWALL"),
            ("nat", "KUBE-FIREWALL"),
            ("filter", "KUBE-KUBELET-CANARY"),
            ("nat", "KUBE-KUBELET-CANARY"),
            ("mangle", "KUBE-KUBELET-CANARY"),
            ("nat", "KUBE-MARK-DROP"),
            ("filter", "KUBE-SVC-ABC"),
            ("raw", "KUBE-SERVICES"),
            ("nat", "CNI-HOSTPORT-DNAT"),
        ] {
            assert!(
                !is_kube_proxy_chain(table, chain),
                "{table} {chain} is not kube-proxy's"
            );
        }
    }

    #[test]
    fn nat_removes_exactly_kube_proxys() {
        let p = plan("nat");
        assert_eq!(
            p.restore_input(),
            "*nat
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SEP-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-BBBBBBBBBBBBBBBB - [0:0]
:KUBE-EXT-BBBBBBBBBBBBBBBB - [0:0]
:KUBE-SVL-CCCCCCCCCCCCCCCC - [0:0]
:KUBE-FW-CCCCCCCCCCCCCCCC - [0:0]
-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-D OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-D POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING
-X KUBE-MARK-MASQ
-X KUBE-NODEPORTS
-X KUBE-POSTROUTING
-X KUBE-PROXY-CANARY
-X KUBE-SEP-AAAAAAAAAAAAAAAA
-X KUBE-SERVICES
-X KUBE-SVC-BBBBBBBBBBBBBBBB
-X KUBE-EXT-BBBBBBBBBBBBBBBB
-X KUBE-SVL-CCCCCCCCCCCCCCCC
-X KUBE-FW-CCCCCCCCCCCCCCCC
COMMIT
"
        );
        // KUBE-MARK-MASQ 1, KUBE-POSTROUTING 3, SEP 2, SERVICES 2, NODEPORTS 1, EXT 1, SVC 1.
        assert_eq!(p.chain_rules, 11);
        assert_eq!(p.rules_removed(), 14);
    }

    #[test]
    fn filter_keeps_the_kubelets_and_others_rules() {
        let p = plan("filter");
        assert_eq!(
            p.chains,
            [
                "KUBE-EXTERNAL-SERVICES",
                "KUBE-NODEPORTS",
                "KUBE-PROXY-CANARY",
                "KUBE-PROXY-FIREWALL",
                "KUBE-SERVICES"
            ]
        );
        // Another owner's chain jumps to KUBE-FORWARD (CNI-FORWARD): it stays whole, and
        // so does the jump to it from FORWARD.
        assert_eq!(p.kept, ["KUBE-FORWARD"]);
        // The jumps from INPUT, FORWARD, OUTPUT; not the ssh rule whose comment only
        // mentions one.
        assert_eq!(
            p.jumps,
            [
                "-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL",
                "-A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS",
                "-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES",
                "-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
                "-A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
            ]
        );
        let input = p.restore_input();
        for kept in [
            "KUBE-FIREWALL",
            "KUBE-KUBELET-CANARY",
            "CNI-FORWARD",
            "KUBE-FORWARD",
        ] {
            assert!(
                !input.contains(&format!(":{kept} ")) && !input.contains(&format!("-X {kept}\n")),
                "{kept} must stay:\n{input}"
            );
        }
        assert!(
            !input.contains("--dport 22"),
            "the ssh rule stays:\n{input}"
        );
        assert!(
            !input.contains("-j KUBE-FORWARD"),
            "the kept chain's jumps stay:\n{input}"
        );
        assert_eq!(p.chain_rules, 1);
    }

    #[test]
    fn a_chain_another_owner_uses_stays_with_what_it_reaches() {
        let dump = "*nat
:POSTROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:CNI-HOSTPORT-SETMARK - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-A - [0:0]
:KUBE-SEP-B - [0:0]
-A OUTPUT -j KUBE-SERVICES
-A CNI-HOSTPORT-SETMARK -j KUBE-SVC-A
-A KUBE-SERVICES -d 10.96.0.1/32 -j KUBE-SVC-A
-A KUBE-SVC-A -j KUBE-SEP-B
-A KUBE-SEP-B -j KUBE-MARK-MASQ
COMMIT
";
        let p = plan_table(&parse_save(dump)[0]);
        assert_eq!(p.kept, ["KUBE-MARK-MASQ", "KUBE-SVC-A", "KUBE-SEP-B"]);
        assert_eq!(p.chains, ["KUBE-SERVICES"]);
        assert_eq!(p.jumps, ["-A OUTPUT -j KUBE-SERVICES"]);
        assert_eq!(p.chain_rules, 1);
    }

    #[test]
    fn mangle_loses_only_the_canary() {
        let p = plan("mangle");
        assert_eq!(p.chains, ["KUBE-PROXY-CANARY"]);
        assert!(p.jumps.is_empty());
    }

    #[test]
    fn a_clean_node_needs_nothing() {
        let clean = "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\n-A INPUT -j KUBE-FIREWALL\n-A INPUT -j ACCEPT\nCOMMIT\n*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-MARK-DROP - [0:0]\nCOMMIT\n";
        for t in parse_save(clean) {
            assert!(
                plan_table(&t).is_empty(),
                "{}: {:?}",
                t.name,
                plan_table(&t)
            );
        }
    }

    #[test]
    fn nft_listing() {
        assert_eq!(
            parse_nft_tables("table ip filter\ntable ip kube-proxy\ntable ip6 kube-proxy\n"),
            [
                ("ip".to_string(), "filter".to_string()),
                ("ip".into(), "kube-proxy".into()),
                ("ip6".into(), "kube-proxy".into())
            ]
        );
        let listing = "table ip kube-proxy {
	comment \"rules for kube-proxy\"
	set cluster-ips {
		type ipv4_addr
		comment \"Active ClusterIPs\"
	}
	map service-ips {
		type ipv4_addr . inet_proto . inet_service : verdict
		elements = { 10.96.0.10 . tcp . 80 : goto service-X }
	}
	chain nat-output {
		type nat hook output priority dstnat; policy accept;
		jump services
	}
	chain services {
		ip daddr . meta l4proto . th dport vmap @service-ips
		fib daddr type local ip daddr != 127.0.0.0/8 jump nodeports
	}
}
";
        let (chains, rules) = nft_chains_and_rules(listing);
        assert_eq!(chains, ["nat-output", "services"]);
        assert_eq!(rules, 3);
    }
}
