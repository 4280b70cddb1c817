//! The CNI plugin (`target/release/ferry-cni`) called exactly as a container runtime
//! calls it: `CNI_*` variables, the network configuration on stdin, a pod network
//! namespace made by the test. The plugin runs inside a "node" namespace the test made
//! too, so every host veth and route lands there and never in the machine's namespace.
//!
//! Each test's namespaces and data directory go when its `Net` is dropped, failed or not.

use std::{
    collections::BTreeSet,
    fs,
    io::{Read, Write},
    net::{IpAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use ferry_tests::{bin, eventually, sh, sh_quiet, spawn_in};
use serde_json::{Value, json};

const NODE_V4: &str = "192.168.77.10";
const NODE_V6: &str = "fd00:77::10";
const MTU: u64 = 1450;

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A node namespace, pod namespaces and a data directory, removed on drop.
struct Net {
    id: String,
    node: String,
    pods: Vec<String>,
    dir: PathBuf,
    conf: Value,
}

/// What one plugin run printed and returned.
#[derive(Debug)]
struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("plugin stdout is not JSON ({e}): {self:?}"))
    }

    /// The error result, asserting the run failed with `code`.
    fn error(&self, code: u64) -> Value {
        assert_ne!(
            self.code, 0,
            "expected error {code}, the plugin succeeded: {self:?}"
        );
        let e = self.json();
        assert_eq!(e["code"], code, "expected error code {code}: {self:?}");
        e
    }

    fn ok(&self, what: &str) {
        assert_eq!(self.code, 0, "{what} failed: {}\n{self:?}", self.stderr);
        assert!(
            self.stdout.trim().is_empty(),
            "{what} printed output: {self:?}"
        );
    }
}

impl Net {
    fn new(cidrs: &[&str]) -> Net {
        // SAFETY: geteuid has no preconditions.
        assert_eq!(
            unsafe { libc::geteuid() },
            0,
            "CNI tests need root (network namespaces)"
        );
        assert!(
            bin("ferry-cni").exists(),
            "{} missing: run `cargo build --release -p ferry-cni`",
            bin("ferry-cni").display()
        );
        let id = format!(
            "cni{}x{}",
            std::process::id() % 100000,
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let dir = std::env::temp_dir().join(format!("ferry-{id}"));
        let _ = fs::remove_dir_all(&dir);
        let net = Net {
            node: format!("{id}-node"),
            pods: Vec::new(),
            conf: json!({
                "cniVersion": "1.1.0",
                "name": "ferry-test",
                "type": "ferry-cni",
                "podCIDRs": cidrs,
                "mtu": MTU + 50,
                "overlayOverhead": 50,
                "dataDir": dir.to_str().unwrap(),
            }),
            dir,
            id,
        };
        sh(&format!("ip netns add {}", net.node));
        sh(&format!(
            "ip -n {0} link set lo up && ip -n {0} addr add {NODE_V4}/32 dev lo && \
             ip -n {0} addr add {NODE_V6}/128 dev lo && \
             ip netns exec {0} sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1",
            net.node
        ));
        net
    }

    /// A new pod namespace (with lo up, as the runtime's loopback plugin leaves it).
    fn pod(&mut self) -> String {
        let ns = format!("{}-p{}", self.id, self.pods.len() + 1);
        sh(&format!("ip netns add {ns} && ip -n {ns} link set lo up"));
        self.pods.push(ns.clone());
        ns
    }

    fn store(&self) -> PathBuf {
        self.dir.join("ferry-test")
    }

    /// The allocation files of the store: address → "containerID ifname".
    fn allocations(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = fs::read_dir(self.store())
            .map(|d| {
                d.filter_map(|e| {
                    let e = e.ok()?;
                    let name = e.file_name().to_string_lossy().into_owned();
                    name.parse::<IpAddr>().ok()?;
                    let text = fs::read_to_string(e.path()).ok()?;
                    Some((name, text.split_whitespace().collect::<Vec<_>>().join(" ")))
                })
                .collect()
            })
            .unwrap_or_default();
        out.sort();
        out
    }

    /// Runs the plugin in the node namespace as a runtime would.
    fn run(&self, command: &str, env: &[(&str, &str)], stdin: &str) -> Out {
        let mut cmd = Command::new(bin("ferry-cni"));
        cmd.env_clear()
            .env("CNI_COMMAND", command)
            .env("CNI_PATH", "/opt/cni/bin")
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = spawn_in(&self.node, None, &mut cmd);
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        let out = child.wait_with_output().expect("ferry-cni");
        Out {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// ADD, DEL or CHECK for `(cid, eth0)` in pod namespace `pod`, with `conf`.
    fn attach(&self, command: &str, cid: &str, pod: &str, conf: &Value) -> Out {
        let netns = format!("/run/netns/{pod}");
        self.run(
            command,
            &[
                ("CNI_CONTAINERID", cid),
                ("CNI_NETNS", &netns),
                ("CNI_IFNAME", "eth0"),
            ],
            &conf.to_string(),
        )
    }

    /// A successful ADD's result.
    fn add(&self, cid: &str, pod: &str) -> Value {
        let out = self.attach("ADD", cid, pod, &self.conf);
        assert_eq!(out.code, 0, "ADD {cid} in {pod} failed: {out:?}");
        out.json()
    }

    fn del(&self, cid: &str, pod: &str) -> Out {
        self.attach("DEL", cid, pod, &self.conf)
    }

    fn check(&self, cid: &str, pod: &str, prev: &Value) -> Out {
        let mut conf = self.conf.clone();
        conf["prevResult"] = prev.clone();
        self.attach("CHECK", cid, pod, &conf)
    }

    fn conf_with(&self, key: &str, value: Value) -> Value {
        let mut c = self.conf.clone();
        c[key] = value;
        c
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in &self.pods {
            sh_quiet(&format!("ip netns del {ns}"));
        }
        sh_quiet(&format!("ip netns del {}", self.node));
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The pod addresses of an ADD result.
fn ips(result: &Value) -> Vec<IpAddr> {
    result["ips"]
        .as_array()
        .unwrap_or_else(|| panic!("no ips in {result}"))
        .iter()
        .map(|i| {
            i["address"]
                .as_str()
                .unwrap()
                .split('/')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect()
}

/// Runs `f` on a thread that has joined network namespace `ns`; sockets it makes stay
/// there.
fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let f_ns = fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        // SAFETY: setns on this helper thread only; it ends with `f`.
        let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&f_ns), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .expect("namespace thread")
}

/// One TCP connection from namespace `from` to `to`:`port` (a listener in namespace
/// `to_ns`), a greeting back; returns the source address the server saw.
fn tcp(from: &str, to_ns: &str, to: IpAddr) -> Result<IpAddr, String> {
    let listener = in_ns(to_ns, move || TcpListener::bind((to, 0)))
        .map_err(|e| format!("listening on {to} in {to_ns}: {e}"))?;
    let port = listener.local_addr().unwrap().port();
    let mut client = in_ns(from, move || {
        TcpStream::connect_timeout(&(to, port).into(), Duration::from_secs(1))
    })
    .map_err(|e| format!("connecting from {from} to {to}:{port}: {e}"))?;
    // The handshake is done; the connection waits in the backlog.
    let (mut conn, peer) = listener.accept().map_err(|e| e.to_string())?;
    conn.write_all(b"hello").map_err(|e| e.to_string())?;
    drop(conn);
    client
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut got = String::new();
    client
        .read_to_string(&mut got)
        .map_err(|e| format!("reading the greeting: {e}"))?;
    if got != "hello" {
        return Err(format!("greeting {got:?}"));
    }
    Ok(peer.ip())
}

/// Connects until it works; asserts the server saw `source` when given (no NAT).
fn reaches(from: &str, to_ns: &str, to: IpAddr, source: Option<IpAddr>) {
    let seen = eventually(
        &format!("TCP {from} -> {to}"),
        Duration::from_secs(10),
        || tcp(from, to_ns, to),
    );
    if let Some(s) = source {
        assert_eq!(
            seen, s,
            "{from} -> {to}: the server saw {seen}, expected the pod's own {s}"
        );
    }
}

/// ADD two pods, check the result and the kernel's state, then real TCP: pod to node,
/// node to pod, pod to pod, both ways, with the pods' own source addresses.
fn pods_reach_the_node_and_each_other(cidrs: &[&str], expected: &[&[&str]]) {
    let mut net = Net::new(cidrs);
    let (p1, p2) = (net.pod(), net.pod());
    let r1 = net.add("c1", &p1);
    let r2 = net.add("c2", &p2);

    // The result as the specification shapes it.
    assert_eq!(r1["cniVersion"], "1.1.0");
    let ifs = r1["interfaces"].as_array().unwrap();
    assert_eq!(ifs.len(), 2, "interfaces: {r1}");
    let host = ifs[0]["name"].as_str().unwrap();
    assert!(
        host.starts_with("fry") && host.len() == 14,
        "host veth {host}"
    );
    assert!(
        ifs[0].get("sandbox").is_none(),
        "host veth has a sandbox: {r1}"
    );
    assert_eq!(ifs[1]["name"], "eth0");
    assert_eq!(ifs[1]["sandbox"], format!("/run/netns/{p1}"));
    for i in ifs {
        assert_eq!(i["mtu"], MTU, "{r1}");
        assert_eq!(i["mac"].as_str().unwrap().len(), 17, "{r1}");
    }
    for (r, want) in [(&r1, expected[0]), (&r2, expected[1])] {
        let got: Vec<String> = ips(r).iter().map(IpAddr::to_string).collect();
        assert_eq!(got, want, "addresses of {r}");
        for ip in r["ips"].as_array().unwrap() {
            assert_eq!(ip["interface"], 1, "{r}");
            let gw = if ip["address"].as_str().unwrap().contains(':') {
                "fe80::1".to_string()
            } else {
                let v4 = cidrs.iter().find(|c| !c.contains(':')).unwrap();
                v4.replace(".0/", ".1/")
                    .split('/')
                    .next()
                    .unwrap()
                    .to_string()
            };
            assert_eq!(ip["gateway"], gw, "{r}");
            let default = if gw.contains(':') {
                "::/0"
            } else {
                "0.0.0.0/0"
            };
            assert!(
                r["routes"]
                    .as_array()
                    .unwrap()
                    .contains(&json!({"dst": default, "gw": gw})),
                "no default route via {gw} in {r}"
            );
        }
    }

    // The kernel's state: addresses as host routes, the default route, the MTU.
    let pod_addrs = sh(&format!("ip -n {p1} -o addr show dev eth0"));
    for ip in ips(&r1) {
        let plen = if ip.is_ipv4() { 32 } else { 128 };
        assert!(
            pod_addrs.contains(&format!("{ip}/{plen}")),
            "{ip}/{plen} not on eth0: {pod_addrs}"
        );
    }
    assert!(sh(&format!("ip -n {p1} link show eth0")).contains(&format!("mtu {MTU}")));
    let node_routes = sh(&format!("ip -n {0} route; ip -n {0} -6 route", net.node));
    for ip in ips(&r1) {
        assert!(
            node_routes.contains(&format!("{ip} dev {host}")),
            "no route to {ip} via {host}: {node_routes}"
        );
    }

    // Traffic.
    let node = net.node.clone();
    for (a, b) in ips(&r1).into_iter().zip(ips(&r2)) {
        let node_ip: IpAddr = if a.is_ipv4() { NODE_V4 } else { NODE_V6 }.parse().unwrap();
        reaches(&p1, &node, node_ip, Some(a));
        reaches(&node, &p1, a, None);
        reaches(&p1, &p2, b, Some(a));
        reaches(&p2, &p1, a, Some(b));
    }
    net.del("c1", &p1).ok("DEL c1");
    net.del("c2", &p2).ok("DEL c2");
    assert!(
        net.allocations().is_empty(),
        "allocations left: {:?}",
        net.allocations()
    );
}

#[test]
fn ipv4_pods_reach_the_node_and_each_other() {
    pods_reach_the_node_and_each_other(&["10.251.0.0/24"], &[&["10.251.0.2"], &["10.251.0.3"]]);
}

#[test]
fn ipv6_pods_reach_the_node_and_each_other() {
    pods_reach_the_node_and_each_other(&["fd00:251::/64"], &[&["fd00:251::2"], &["fd00:251::3"]]);
}

#[test]
fn dual_stack_pods_get_one_address_per_family() {
    pods_reach_the_node_and_each_other(
        &["fd00:252::/64", "10.252.0.0/24"],
        &[
            &["10.252.0.2", "fd00:252::2"],
            &["10.252.0.3", "fd00:252::3"],
        ],
    );
}

#[test]
fn check_passes_then_names_what_was_tampered_with() {
    let mut net = Net::new(&["10.253.0.0/24", "fd00:253::/64"]);
    let p = net.pod();
    let r = net.add("c1", &p);
    net.check("c1", &p, &r).ok("CHECK right after ADD");

    let tampered = |cmd: &str, expect: &str| {
        sh(cmd);
        let e = net.check("c1", &p, &r).error(103);
        let details = e["details"].as_str().unwrap();
        assert!(
            details.contains(expect),
            "after `{cmd}`, CHECK says {details:?}, expected {expect:?}"
        );
    };
    tampered(
        &format!("ip -n {p} route del default"),
        "default route via 10.253.0.1 dev eth0 is missing",
    );
    sh(&format!(
        "ip -n {p} route add default via 10.253.0.1 dev eth0"
    ));
    net.check("c1", &p, &r).ok("CHECK after the route is back");
    tampered(
        &format!("ip -n {p} -6 route del default"),
        "default route via fe80::1 dev eth0 is missing",
    );
    sh(&format!(
        "ip -n {p} -6 route add default via fe80::1 dev eth0"
    ));
    tampered(
        &format!("ip -n {p} addr del fd00:253::2/128 dev eth0"),
        "address fd00:253::2/128 is missing on eth0",
    );
    // A prevResult that does not match the store.
    let mut wrong = r.clone();
    wrong["ips"][0]["address"] = json!("10.253.0.99/32");
    let e = net.check("c1", &p, &wrong).error(103);
    assert!(
        e["details"].as_str().unwrap().contains("10.253.0.99"),
        "{e}"
    );

    let host = r["interfaces"][0]["name"].as_str().unwrap();
    sh(&format!("ip -n {} link del {host}", net.node));
    let e = net.check("c1", &p, &r).error(103);
    assert!(
        e["details"].as_str().unwrap().contains("eth0 is missing"),
        "{e}"
    );
}

#[test]
fn del_is_idempotent_and_succeeds_for_what_is_gone() {
    let mut net = Net::new(&["10.254.0.0/24"]);
    let (p1, p2) = (net.pod(), net.pod());
    let r = net.add("c1", &p1);
    let host = r["interfaces"][0]["name"].as_str().unwrap().to_string();

    // A retried ADD for the same attachment keeps its address.
    let again = net.add("c1", &p1);
    assert_eq!(ips(&again), ips(&r), "a retried ADD got another address");
    assert_eq!(net.allocations().len(), 1, "{:?}", net.allocations());

    net.del("c1", &p1).ok("DEL");
    assert!(net.allocations().is_empty(), "{:?}", net.allocations());
    let links = sh(&format!("ip -n {} -o link; ip -n {p1} -o link", net.node));
    assert!(
        !links.contains(&host) && !links.contains("eth0"),
        "interfaces left after DEL: {links}"
    );
    net.del("c1", &p1).ok("second DEL");
    net.del("never-added", &p1)
        .ok("DEL of a container never added");

    // The pod's namespace is gone before DEL.
    net.add("c2", &p2);
    sh(&format!("ip netns del {p2}"));
    net.del("c2", &p2).ok("DEL with the netns gone");
    assert!(net.allocations().is_empty(), "{:?}", net.allocations());
    let env = [("CNI_CONTAINERID", "c2"), ("CNI_IFNAME", "eth0")];
    net.run("DEL", &env, &net.conf.to_string())
        .ok("DEL without CNI_NETNS");
}

#[test]
fn twenty_concurrent_adds_get_twenty_distinct_addresses() {
    let mut net = Net::new(&["10.250.0.0/24", "fd00:250::/64"]);
    let pods: Vec<String> = (0..20).map(|_| net.pod()).collect();
    let start = Instant::now();
    let results: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = pods
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let net = &net;
                s.spawn(move || net.add(&format!("c{i}"), p))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let all: Vec<IpAddr> = results.iter().flat_map(ips).collect();
    let distinct: BTreeSet<IpAddr> = all.iter().copied().collect();
    assert_eq!(all.len(), 40, "{all:?}");
    assert_eq!(distinct.len(), 40, "addresses given twice: {all:?}");
    assert_eq!(net.allocations().len(), 40, "{:?}", net.allocations());
    eprintln!("20 concurrent dual-stack ADDs: {:?}", start.elapsed());
}

#[test]
fn exhaustion_is_an_error_naming_the_cidr() {
    let mut net = Net::new(&["10.249.0.0/29"]);
    let pods: Vec<String> = (0..6).map(|_| net.pod()).collect();
    let got: Vec<String> = (0..5)
        .map(|i| ips(&net.add(&format!("c{i}"), &pods[i]))[0].to_string())
        .collect();
    assert_eq!(
        got,
        [
            "10.249.0.2",
            "10.249.0.3",
            "10.249.0.4",
            "10.249.0.5",
            "10.249.0.6"
        ]
    );
    let e = net.attach("ADD", "c5", &pods[5], &net.conf).error(100);
    assert!(e["msg"].as_str().unwrap().contains("10.249.0.0/29"), "{e}");
    let links = sh(&format!(
        "ip -n {} -o link; ip -n {} -o link",
        net.node, pods[5]
    ));
    assert_eq!(
        links.matches("fry").count(),
        5,
        "a failed ADD left interfaces: {links}"
    );
    let e = net.run("STATUS", &[], &net.conf.to_string()).error(50);
    assert!(
        e["details"].as_str().unwrap().contains("10.249.0.0/29"),
        "{e}"
    );

    net.del("c2", &pods[2]).ok("DEL");
    net.run("STATUS", &[], &net.conf.to_string())
        .ok("STATUS after a DEL");
    assert_eq!(ips(&net.add("c5", &pods[5]))[0].to_string(), "10.249.0.4");
}

#[test]
fn a_half_done_add_is_freed_by_gc_and_by_del() {
    let mut net = Net::new(&["10.248.0.0/24"]);
    let (p1, p2) = (net.pod(), net.pod());
    let live = net.add("live", &p1);
    let host = live["interfaces"][0]["name"].as_str().unwrap().to_string();
    // An ADD that died after persisting its allocation, before any interface: its file.
    fs::write(net.store().join("10.248.0.9"), "dead1\neth0\n").unwrap();
    fs::write(net.store().join("10.248.0.10"), "dead2\neth0\n").unwrap();
    // An ADD that died after making its veth pair.
    net.add("dead3", &p2);
    assert_eq!(net.allocations().len(), 4);

    let gc = net.conf_with(
        "cni.dev/valid-attachments",
        json!([{"containerID": "live", "ifname": "eth0"}]),
    );
    net.run("GC", &[], &gc.to_string()).ok("GC");
    assert_eq!(
        net.allocations(),
        [("10.248.0.2".to_string(), "live eth0".to_string())]
    );
    let links = sh(&format!("ip -n {} -o link", net.node));
    assert_eq!(links.matches("fry").count(), 1, "GC left veths: {links}");
    assert!(links.contains(&host), "GC removed the live veth: {links}");
    net.check("live", &p1, &live)
        .ok("CHECK of the live pod after GC");

    fs::write(net.store().join("10.248.0.11"), "dead4\neth0\n").unwrap();
    net.del("dead4", &p2).ok("DEL of a half-done ADD");
    assert_eq!(net.allocations().len(), 1, "{:?}", net.allocations());
}

#[test]
fn version_status_and_invalid_requests() {
    let mut net = Net::new(&["10.247.0.0/24"]);
    let p = net.pod();
    let v = net.run("VERSION", &[], r#"{"cniVersion": "1.0.0"}"#);
    assert_eq!(v.code, 0, "{v:?}");
    assert_eq!(
        v.json(),
        json!({"cniVersion": "1.0.0", "supportedVersions": ["1.0.0", "1.1.0"]})
    );
    net.run("STATUS", &[], &net.conf.to_string()).ok("STATUS");
    assert!(Path::new(&net.store()).join("lock").exists());

    let old = net.conf_with("cniVersion", json!("0.3.1"));
    let e = net.attach("ADD", "c1", &p, &old).error(1);
    assert!(e["details"].as_str().unwrap().contains("0.3.1"), "{e}");
    let e = net
        .run(
            "ADD",
            &[
                ("CNI_NETNS", &format!("/run/netns/{p}")),
                ("CNI_IFNAME", "eth0"),
            ],
            &net.conf.to_string(),
        )
        .error(4);
    assert!(
        e["msg"].as_str().unwrap().contains("CNI_CONTAINERID"),
        "{e}"
    );
    let e = net.attach("ADD", "c1", "no-such-netns", &net.conf).error(4);
    assert!(
        e["details"]
            .as_str()
            .unwrap()
            .contains("/run/netns/no-such-netns"),
        "{e}"
    );
    let e = net
        .attach(
            "ADD",
            "c1",
            &p,
            &net.conf_with("podCIDRs", json!(["10.0.0.0/31"])),
        )
        .error(7);
    assert!(
        e["details"].as_str().unwrap().contains("10.0.0.0/31"),
        "{e}"
    );
    net.run("ADD", &[], "not json").error(6);
    assert!(
        net.allocations().is_empty(),
        "failed ADDs allocated: {:?}",
        net.allocations()
    );
    // An interface of that name already in the pod: an error, and nothing left behind.
    sh(&format!(
        "ip -n {p} link add eth0 type veth peer name other"
    ));
    let e = net.attach("ADD", "c1", &p, &net.conf).error(102);
    assert!(
        e["details"]
            .as_str()
            .unwrap()
            .contains("eth0 already exists"),
        "{e}"
    );
    assert!(net.allocations().is_empty(), "{:?}", net.allocations());
}
