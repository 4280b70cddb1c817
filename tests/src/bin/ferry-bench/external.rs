//! `ferry-bench datapath-external`: NodePort traffic from outside the node, through the
//! tc path, against the same traffic with no translation at all (routing only) and
//! against kube-proxy's iptables DNAT layout for the same Service, interleaved.
//!
//! Each variant has its own three namespaces' worth of path: client ns -> "node" ns
//! (a router; ferry's agent with `--devices ext,int`, or the iptables rules) -> the one
//! backend ns, so no variant's programs or rules see another's packets. iperf3 measures
//! single-stream TCP throughput and the rate of small UDP datagrams; the client runs on
//! CPU 0 (where the node's forwarding also runs, in the sender's softirq) and the
//! server on CPU 1.

use std::{
    fs,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use ferry_tests::{bin, cgroup2_mount, http_get, spawn_in};
use serde_json::{Value, json};

use crate::{
    cleanup::{Guard, Proc, Res, hold},
    layouts::{self, ServicePort},
    util::{median, sh, sh_in, spread},
};

pub(crate) const VARIANTS: [&str; 3] = ["routing", "ferry", "iptables"];
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 245, 0, 1);
const PORT: u16 = 5201;
const NODE_PORT: u16 = 30201;
const UDP_PAYLOAD: usize = 64;

#[derive(Clone, Debug)]
pub(crate) struct Args {
    pub(crate) rounds: usize,
    pub(crate) seconds: u64,
    pub(crate) out: PathBuf,
    pub(crate) quick: bool,
}

impl Args {
    pub(crate) fn new(quick: bool, out: PathBuf) -> Args {
        Args {
            rounds: if quick { 2 } else { 5 },
            seconds: if quick { 2 } else { 5 },
            out,
            quick,
        }
    }

    pub(crate) fn parse(&mut self, argv: &[String]) -> Result<(), String> {
        let mut it = argv.iter();
        while let Some(f) = it.next() {
            let mut value = || it.next().ok_or_else(|| format!("{f} needs a value"));
            match f.as_str() {
                "--rounds" => {
                    self.rounds = value()?.parse().map_err(|e| format!("--rounds: {e}"))?
                }
                "--seconds" => {
                    self.seconds = value()?.parse().map_err(|e| format!("--seconds: {e}"))?
                }
                other => return Err(format!("unknown flag {other}")),
            }
        }
        if self.rounds == 0 || self.seconds == 0 {
            return Err("--rounds and --seconds must be at least 1".into());
        }
        Ok(())
    }
}

fn node_ip(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(172, 31, k as u8, 2)
}

/// The NodePort Service, TCP and UDP on the same port (iperf3's control connection is
/// TCP, its UDP test datagrams go to the same port).
fn service() -> Vec<ServicePort> {
    ["tcp", "udp"]
        .iter()
        .map(|proto| ServicePort {
            svc: "iperf".into(),
            port_name: proto.to_string(),
            vip: Ipv4Addr::new(10, 96, 0, 10),
            port: PORT,
            proto,
            node_port: Some(NODE_PORT),
            endpoints: vec![(BACKEND, PORT)],
        })
        .collect()
}

struct World {
    clients: Vec<String>,
    nodes: Vec<String>,
    _iperf: Proc,
    _agent: Option<Proc>,
    _guards: Vec<Guard>,
}

fn build(workdir: &Path, log: &Path) -> Result<World, String> {
    let pid = std::process::id();
    let mut guards = Vec::new();
    let backend_ns = format!("fb{pid}xb");
    sh(&format!("ip netns add {backend_ns}"))?;
    guards.push(hold(Res::Netns(backend_ns.clone())));
    sh_in(
        &backend_ns,
        &format!("ip link set lo up && ip addr add {BACKEND}/32 dev lo"),
    )?;
    let (mut clients, mut nodes) = (Vec::new(), Vec::new());
    for (k, v) in VARIANTS.iter().enumerate() {
        let (c, n) = (format!("fb{pid}x{v}c"), format!("fb{pid}x{v}n"));
        for ns in [&c, &n] {
            sh(&format!("ip netns add {ns}"))?;
            guards.push(hold(Res::Netns(ns.clone())));
        }
        sh(&format!(
            "ip -n {n} link set lo up && \
             ip -n {n} link add ext type veth peer name eth0 netns {c} && \
             ip -n {n} addr add {ip}/24 dev ext && ip -n {n} link set ext up && \
             ip -n {c} link set lo up && ip -n {c} addr add 172.31.{k}.1/24 dev eth0 && ip -n {c} link set eth0 up && \
             ip -n {c} route add default via {ip} && \
             ip -n {n} link add int type veth peer name n{k} netns {backend_ns} && \
             ip -n {n} addr add 172.32.{k}.1/24 dev int && ip -n {n} link set int up && \
             ip -n {backend_ns} addr add 172.32.{k}.2/24 dev n{k} && ip -n {backend_ns} link set n{k} up && \
             ip -n {backend_ns} route add 172.31.{k}.0/24 via 172.32.{k}.1 && \
             ip -n {n} route add {BACKEND}/32 via 172.32.{k}.2 && \
             ip netns exec {n} sysctl -qw net.ipv4.ip_forward=1",
            ip = node_ip(k)
        ))?;
        clients.push(c);
        nodes.push(n);
    }
    // Bound to the backend address, so that UDP replies leave from it (the backend ns
    // has other addresses, on the links to the nodes).
    let iperf = crate::util::iperf_server(&backend_ns, BACKEND, PORT);

    // kube-proxy's iptables layout in its node.
    let rules = workdir.join("external-iptables.rules");
    let _r = hold(Res::Dir(rules.clone()));
    fs::write(&rules, layouts::iptables_full(&service())).map_err(|e| e.to_string())?;
    sh(&format!(
        "ip netns exec {} iptables-legacy-restore --noflush < {}",
        nodes[2],
        rules.display()
    ))?;

    // ferry's agent in its node, tc programs on both devices: the backend-facing one
    // needs them too (the source-NAT address, and the replies to translate back).
    let name = format!("ferry-bench-{pid}-ext");
    let bpffs = PathBuf::from(format!("/sys/fs/bpf/{name}"));
    let cgroup = cgroup2_mount().join(&name);
    let manifests = workdir.join("external-manifests");
    guards.push(hold(Res::Dir(manifests.clone())));
    fs::create_dir_all(&manifests).map_err(|e| e.to_string())?;
    fs::create_dir_all(&cgroup).map_err(|e| e.to_string())?;
    guards.push(hold(Res::Cgroup(cgroup.clone())));
    guards.push(hold(Res::Pins(bpffs.clone())));
    let svc = service();
    let mut items = layouts::manifests(&[&svc[0], &svc[1]]);
    // The endpoint lives on another node: externalTrafficPolicy Cluster masquerades.
    items[1]["endpoints"][0]["nodeName"] = json!("other-node");
    fs::write(manifests.join("iperf.json"), layouts::list(items)).map_err(|e| e.to_string())?;
    let logf = fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let mut cmd = Command::new(bin("ferry"));
    cmd.arg("agent")
        .arg("--manifests")
        .arg(&manifests)
        .arg("--cgroup")
        .arg(&cgroup)
        .arg("--bpffs")
        .arg(&bpffs)
        .args(["--node-name", "bench-node", "--devices", "ext,int"])
        .args(["--node-ip", &node_ip(1).to_string()])
        .args([
            "--health-addr",
            "127.0.0.1:10256",
            "--metrics-addr",
            "127.0.0.1:10249",
        ])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(logf.try_clone().map_err(|e| e.to_string())?)
        .stderr(logf);
    let mut agent = Proc::new(spawn_in(&nodes[1], None, &mut cmd));
    let t0 = Instant::now();
    while !matches!(http_get(&nodes[1], 10256, "/healthz"), Ok((200, _))) {
        if let Ok(Some(st)) = agent.child.try_wait() {
            return Err(format!(
                "the agent exited ({st}); log {}:\n{}",
                log.display(),
                fs::read_to_string(log).unwrap_or_default()
            ));
        }
        if t0.elapsed() > Duration::from_secs(60) {
            return Err("the agent was not ready within 60 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(World {
        clients,
        nodes,
        _iperf: iperf,
        _agent: Some(agent),
        _guards: guards,
    })
}

fn target(k: usize) -> (Ipv4Addr, u16) {
    if k == 0 {
        (BACKEND, PORT)
    } else {
        (node_ip(k), NODE_PORT)
    }
}

/// A second of TCP and of UDP must get through before anything is timed (iperf3
/// itself: its server takes one client at a time, so no other probe may connect).
fn check(w: &World, k: usize, log: &Path) -> Result<(), String> {
    let (ip, port) = target(k);
    let r = iperf(w, k, false, 1).and_then(|_| iperf(w, k, true, 1));
    r.map(|_| ()).map_err(|why| {
        if VARIANTS[k] == "ferry" {
            format!(
                "ferry: the NodePort {ip}:{port} does not answer from outside the node ({why}).\n\
                 The tc path (ferry_tc_ingress/egress attached to --devices ext,int, docs/external-traffic.md) \
                 is not attached or does not forward yet; the agent's log is {}",
                log.display()
            )
        } else {
            format!("{}: {ip}:{port} does not answer: {why}", VARIANTS[k])
        }
    })
}

/// One iperf3 run: (Gbit/s for TCP | received datagrams/s for UDP).
fn iperf(w: &World, k: usize, udp: bool, secs: u64) -> Result<f64, String> {
    let (ip, port) = target(k);
    let mode = if udp {
        format!("-u -l {UDP_PAYLOAD} -b 0")
    } else {
        String::new()
    };
    let out = sh(&format!(
        "ip netns exec {} iperf3 -c {ip} -p {port} {mode} -t {secs} -O 1 -A 0 -J --connect-timeout 3000",
        w.clients[k]
    ))?;
    crate::util::iperf_rate(&out, udp, secs)
}

pub(crate) fn targets(r: &Value) -> Vec<(String, bool, String)> {
    let mut t = Vec::new();
    for (test, unit) in [
        ("tcp_gbps", "TCP throughput"),
        ("udp_pps", "UDP packet rate"),
    ] {
        let vs_routing = r[test]["ferry"]["vs_routing"]["median"]
            .as_f64()
            .unwrap_or(f64::NAN);
        let vs_ipt = r[test]["ferry_vs_iptables"]["median"]
            .as_f64()
            .unwrap_or(f64::NAN);
        t.push((
            format!("NodePort {unit}: ferry >= 0.9x routing only"),
            vs_routing >= 0.9,
            format!("{vs_routing:.3}x"),
        ));
        t.push((
            format!("NodePort {unit}: ferry ahead of iptables"),
            vs_ipt > 1.0,
            format!("{vs_ipt:.3}x"),
        ));
    }
    t
}

pub(crate) fn markdown(r: &Value) -> String {
    let med = |v: &Value| v["median"].as_f64().unwrap_or(f64::NAN);
    let rng = crate::report::ratio;
    let mut s = String::from(
        "| test | routing only | ferry (tc) | iptables | ferry / routing | iptables / routing | ferry / iptables |\n|---|---|---|---|---|---|---|\n",
    );
    for (test, label, fmt) in [
        ("tcp_gbps", "TCP, 1 stream, Gbit/s", 2usize),
        ("udp_pps", "UDP 64-byte datagrams received/s", 0),
    ] {
        let x = &r[test];
        s.push_str(&format!(
            "| {label} | {:.*} | {:.*} | {:.*} | {} | {} | {} |\n",
            fmt,
            med(&x["routing"]["value"]),
            fmt,
            med(&x["ferry"]["value"]),
            fmt,
            med(&x["iptables"]["value"]),
            rng(&x["ferry"]["vs_routing"]),
            rng(&x["iptables"]["vs_routing"]),
            rng(&x["ferry_vs_iptables"]),
        ));
    }
    s.push_str(&crate::report::targets_table(&targets(r)));
    s
}

pub(crate) fn run(args: &Args) -> Result<(Value, String), String> {
    crate::util::require_tool("iperf3", "iperf3")?;
    crate::util::require_tool("iptables-legacy-restore", "iptables")?;
    if !bin("ferry").exists() {
        return Err(format!(
            "{} missing: run `cargo xtask build` first",
            bin("ferry").display()
        ));
    }
    eprintln!("== datapath-external: NodePort {NODE_PORT} -> {BACKEND}:{PORT}");
    let workdir = std::env::temp_dir().join(format!("ferry-bench-ext-{}", std::process::id()));
    let _w = hold(Res::Dir(workdir.clone()));
    fs::create_dir_all(&workdir).map_err(|e| e.to_string())?;
    fs::create_dir_all(&args.out).map_err(|e| e.to_string())?;
    let log = args.out.join("external-agent.log");
    let t0 = Instant::now();
    let w = build(&workdir, &log)?;
    for k in 0..VARIANTS.len() {
        check(&w, k, &log)?;
    }
    let mut result = json!({"service": {"node_port": NODE_PORT, "backend": format!("{BACKEND}:{PORT}"), "udp_payload": UDP_PAYLOAD}});
    for (test, udp) in [("tcp_gbps", false), ("udp_pps", true)] {
        let mut vals: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
        for r in 0..args.rounds {
            for i in 0..VARIANTS.len() {
                let k = (i + r) % VARIANTS.len();
                let v = iperf(&w, k, udp, args.seconds)?;
                eprintln!("   round {} {test} {:<8} {v:.3}", r + 1, VARIANTS[k]);
                vals[k].push(v);
            }
        }
        let per_round = |a: usize, b: usize| -> Vec<f64> {
            vals[a].iter().zip(&vals[b]).map(|(x, y)| x / y).collect()
        };
        let mut per = serde_json::Map::new();
        for (k, v) in VARIANTS.iter().enumerate() {
            per.insert(
                v.to_string(),
                json!({"value": spread(&vals[k]), "vs_routing": spread(&per_round(k, 0))}),
            );
        }
        per.insert("ferry_vs_iptables".into(), spread(&per_round(1, 2)));
        eprintln!(
            "   {test}: routing {:.3}, ferry {:.3}, iptables {:.3} (medians)",
            median(&vals[0]),
            median(&vals[1]),
            median(&vals[2])
        );
        result[test] = Value::Object(per);
    }
    let _ = &w.nodes;
    drop(w);
    let doc = json!({
        "benchmark": "datapath-external",
        "machine": crate::util::machine(),
        "revision": crate::util::revision(),
        "mode": if args.quick { "quick" } else { "full" },
        "settings": {"rounds": args.rounds, "seconds": args.seconds, "iptables": "iptables-legacy-restore"},
        "elapsed_s": t0.elapsed().as_secs_f64(),
        "results": result,
    });
    let path = args.out.join("datapath-external.json");
    fs::write(
        &path,
        serde_json::to_string_pretty(&doc).unwrap_or_default(),
    )
    .map_err(|e| format!("{}: {e}", path.display()))?;
    let mut md = crate::report::header(&doc);
    md.push_str(&markdown(&doc["results"]));
    Ok((doc, md))
}
