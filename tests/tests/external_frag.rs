//! UDP datagrams larger than the MTU through a NodePort (issue 16): every IP fragment of
//! a request reaches the backend its first fragment went to, and every fragment of the
//! reply comes back translated, so both ends reassemble. IPv4 and IPv6, through node1
//! (endpoints on node2: source NAT, ferry forwards all fragments itself) and through
//! node2 (local endpoints: the request's fragments are rewritten on ingress, the reply's
//! on egress). Real clients: socat sends a 4000-byte datagram, ferry-testsrv answers with
//! its name and the same 4000 bytes (both sides fragment at the LAN's 1500-byte MTU).
//!
//! Before this change (the tc path of commit 9660fab, run with this file) only the first
//! fragment of each datagram was translated; the others went to node1's own stack and
//! socat got nothing back (ECONNREFUSED from node1's stack) for the very first datagram.

use std::net::IpAddr;

use ferry_tests::*;

const NP_UDP: u16 = 30053;
const SRV: u16 = 8080;
const SIZE: usize = 4000;

fn dual_doc(c: &Cluster, pods: &[&str]) -> String {
    let eps = |v6: bool| -> Vec<Ep> {
        pods.iter()
            .map(|p| {
                let p = c.pod(p);
                let node = &c.node(p.node).name;
                if v6 { ep(p.v6) } else { ep(p.v4) }.on(node)
            })
            .collect()
    };
    let ports = [("udp", SRV, "UDP")];
    docs(&[
        external_service(
            "frag",
            "NodePort",
            &["fd00:96::4:1", "10.96.4.1"],
            &[("udp", 53, "UDP", NP_UDP)],
            "  ipFamilyPolicy: PreferDualStack\n  ipFamilies: [IPv6, IPv4]\n",
            "",
        ),
        slice("frag", "frag-v6", "IPv6", &ports, &eps(true)),
        slice("frag", "frag-v4", "IPv4", &ports, &eps(false)),
    ])
}

/// One `SIZE`-byte datagram from client `i` to `to`:NP_UDP with socat; the reply.
fn big_datagram(c: &Cluster, i: usize, to: IpAddr, tag: char) -> String {
    let payload: String = std::iter::repeat_n(tag, SIZE).collect();
    let file = c.workdir.join(format!("payload-{i}-{tag}"));
    std::fs::write(&file, &payload).expect("payload file");
    let target = match to {
        IpAddr::V4(a) => format!("UDP4:{a}:{NP_UDP}"),
        IpAddr::V6(a) => format!("UDP6:[{a}]:{NP_UDP}"),
    };
    let out = c.run_ext(
        i,
        "sh",
        &[
            "-c",
            &format!("socat -t 2 -b 65536 STDIO {target} < {}", file.display()),
        ],
    );
    let reply = String::from_utf8_lossy(&out.stdout).into_owned();
    let (name, echo) = reply.split_once(' ').unwrap_or_default();
    assert!(
        name.starts_with("n2p") && echo == payload,
        "a {SIZE}-byte datagram to {to}:{NP_UDP} from client{i}: expected `n2pX <{SIZE} bytes>`, got {} bytes starting {:?} (socat: {})",
        reply.len(),
        &reply[..reply.len().min(40)],
        String::from_utf8_lossy(&out.stderr)
    );
    name.to_string()
}

#[test]
fn fragmented_udp_through_nodeport_both_families() {
    let mut c = Cluster::new("frag", &[0, 2], &[SRV]);
    c.write_manifest("frag.yaml", &dual_doc(&c, &["n2p1", "n2p2"]));
    c.start_agents(&[]);
    for v6 in [false, true] {
        for n in [1, 2] {
            let node: IpAddr = if v6 {
                c.node(n).v6.into()
            } else {
                c.node(n).v4.into()
            };
            // Several datagrams from both clients (different flows, different backends
            // by Maglev), each with its own payload byte.
            let mut seen = std::collections::BTreeSet::new();
            for (k, tag) in ['a', 'b', 'c'].into_iter().enumerate() {
                let i = 1 + k % 2;
                seen.insert(big_datagram(&c, i, node, tag));
            }
            eprintln!("via node{n} (v6 {v6}): backends {seen:?}");
        }
    }
    // Small datagrams still work as before.
    let outs = c.probe_ext(1, "udp", &hostport(c.node(1).v4, NP_UDP), 5);
    all_ok(&outs, "small UDP via node1");
}
