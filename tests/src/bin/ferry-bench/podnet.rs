//! `ferry-bench pod-network`: pod-to-pod traffic across two nodes through ferry's pod
//! network (`ferry agent --pod-network`, pods wired by the `ferry-cni` plugin the agent
//! installed), with native routing and with the VXLAN overlay, against the same traffic
//! between the two nodes' own addresses (the baseline), interleaved in one run.
//!
//! Two clusters, each in its own namespaces, so that one overlay's routes and devices
//! never see the other's packets:
//!
//! ```text
//!  fpPIDC-lan  bridge br0, ports n1, n2 (C = r: native routing, v: VXLAN)
//!  fpPIDC-nN   node N: eth0 172.30.K.N/24 on the LAN; `ferry agent --pod-network`
//!              (pod CIDR 10.(246+K).N.0/24, --devices eth0, its own cgroup and bpffs dir)
//!  fpPIDC-pN   the pod on node N, wired by CNI ADD of the node's installed plugin
//! ```
//!
//! iperf3 measures single-stream TCP, two-stream TCP and 64-byte UDP datagrams at full
//! speed (received per second) from node 1 to node 2: node netns to node netns (the
//! baseline, in the native cluster) and pod to pod (each cluster). The client runs in the
//! node's agent cgroup (where pods live), on CPU 0 for the single-stream tests; the
//! servers on CPU 1.

use std::{
    fs,
    io::Write,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use ferry_tests::{bin, cgroup2_mount, http_get, spawn_in};
use serde_json::{Value, json};

use crate::{
    cleanup::{Guard, Proc, Res, hold},
    util::{median, sh, sh_in, spread},
};

/// The baseline first: node netns to node netns.
pub(crate) const VARIANTS: [&str; 3] = ["node", "native", "vxlan"];
const PORT: u16 = 5201;
const UDP_PAYLOAD: usize = 64;
const HEALTH_PORT: u16 = 10256;
const METRICS_PORT: u16 = 10249;
/// The issue's targets: pod / node for native routing and for VXLAN.
const TARGET_NATIVE: f64 = 0.95;
const TARGET_VXLAN: f64 = 0.85;

struct Test {
    key: &'static str,
    label: &'static str,
    udp: bool,
    streams: u32,
    /// Decimals in the report.
    digits: usize,
}

const TESTS: [Test; 3] = [
    Test {
        key: "tcp_gbps",
        label: "TCP, 1 stream, Gbit/s",
        udp: false,
        streams: 1,
        digits: 2,
    },
    Test {
        key: "tcp2_gbps",
        label: "TCP, 2 streams, Gbit/s",
        udp: false,
        streams: 2,
        digits: 2,
    },
    Test {
        key: "udp_pps",
        label: "UDP 64-byte datagrams received/s",
        udp: true,
        streams: 1,
        digits: 0,
    },
];

#[derive(Clone, Debug)]
pub(crate) struct Args {
    /// Rounds, seconds, output directory, quick mode: as datapath-external's.
    pub(crate) base: crate::external::Args,
    /// Measure the VXLAN overlay too (when the agent has it).
    pub(crate) vxlan: bool,
    /// `--kernel-path`: the agents run with `--pod-network-fast-path=false`, so pod
    /// traffic takes the kernel's forwarding path (the comparison for the fast path).
    pub(crate) kernel_path: bool,
    /// `--hold S`: once the paths work, print them and keep everything up for S seconds
    /// before measuring (to run a profiler or iperf3 by hand against them).
    pub(crate) hold: Option<u64>,
}

impl Args {
    pub(crate) fn new(quick: bool, out: PathBuf) -> Args {
        let mut base = crate::external::Args::new(quick, out);
        // Three rounds at least, so that the median is a middle one.
        base.rounds = base.rounds.max(3);
        if !quick {
            // On a shared VM the machine's speed drifts over tens of seconds: shorter
            // tests keep the three paths of a round closer in time, and more rounds
            // steady the median of the per-round ratios.
            base.rounds = 9;
            base.seconds = 3;
        }
        Args {
            base,
            vxlan: true,
            kernel_path: false,
            hold: None,
        }
    }

    /// `--rounds R`, `--seconds S`, `--no-vxlan`, `--kernel-path`, `--hold S`.
    pub(crate) fn parse(&mut self, argv: &[String]) -> Result<(), String> {
        let mut rest = Vec::new();
        let mut it = argv.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "--no-vxlan" => self.vxlan = false,
                "--kernel-path" => self.kernel_path = true,
                "--hold" => {
                    let v = it.next().ok_or("--hold needs a number of seconds")?;
                    self.hold = Some(v.parse().map_err(|e| format!("--hold {v}: {e}"))?);
                }
                _ => rest.push(a.clone()),
            }
        }
        self.base.parse(&rest)
    }
}

/// Whether this agent has `--overlay vxlan` (docs/pod-network.md).
fn vxlan_available() -> bool {
    Command::new(bin("ferry"))
        .args(["agent", "--help"])
        .output()
        .map(|o| {
            let h = String::from_utf8_lossy(&o.stdout);
            h.contains("--overlay") && h.contains("vxlan")
        })
        .unwrap_or(false)
}

/// Node `n` (1, 2) of cluster `k` (0 native, 1 VXLAN): its LAN address.
fn node_ip(k: usize, n: usize) -> Ipv4Addr {
    Ipv4Addr::new(172, 30, k as u8, n as u8)
}

fn pod_cidr(k: usize, n: usize) -> String {
    format!("10.{}.{n}.0/24", 246 + k)
}

/// Two nodes on one LAN with their agents, one CNI pod each, and the iperf3 servers on
/// node 2 and its pod. Fields drop in order: the processes before the namespaces,
/// cgroups, pins and directories they use.
struct Cluster {
    /// 0 native, 1 VXLAN: the addresses' third byte.
    k: usize,
    overlay: &'static str,
    nodes: [String; 2],
    cgroups: [PathBuf; 2],
    pods: [String; 2],
    pod_ips: [Ipv4Addr; 2],
    pod_mtu: u64,
    logs: [PathBuf; 2],
    _servers: Vec<Proc>,
    _agents: Vec<Proc>,
    _guards: Vec<Guard>,
}

impl Cluster {
    /// Where the variant's client runs and what it dials.
    fn path(&self, variant: &str) -> (&str, &Path, Ipv4Addr) {
        if variant == "node" {
            (&self.nodes[0], &self.cgroups[0], node_ip(self.k, 2))
        } else {
            (&self.pods[0], &self.cgroups[0], self.pod_ips[1])
        }
    }

    /// The agents' logs, the last lines of each, for error messages.
    fn log_tails(&self) -> String {
        log_tails(&self.logs)
    }
}

fn log_tails(logs: &[PathBuf]) -> String {
    let mut s = String::new();
    for l in logs {
        let text = fs::read_to_string(l).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        s.push_str(&format!("--- {} (last lines)\n", l.display()));
        for line in &lines[lines.len().saturating_sub(15)..] {
            s.push_str(line);
            s.push('\n');
        }
    }
    s
}

/// `ip netns add name`, removed with the guard it leaves in `guards`.
fn add_netns(guards: &mut Vec<Guard>, name: &str) -> Result<(), String> {
    sh(&format!(
        "ip netns add {name} && ip -n {name} link set lo up"
    ))?;
    guards.push(hold(Res::Netns(name.to_string())));
    Ok(())
}

/// The 1-minute load average, to see whether other work shared the machine.
fn loadavg() -> Value {
    fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(Value::Null, |l| json!(l))
}

/// Polls `f` every 20 ms until it gives `Ok`, for at most `within`.
fn poll(
    what: &str,
    within: Duration,
    mut f: impl FnMut() -> Result<bool, String>,
) -> Result<(), String> {
    let t0 = Instant::now();
    let mut last = String::new();
    loop {
        match f() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => last = e,
        }
        if t0.elapsed() > within {
            return Err(format!(
                "{what}: not within {} s (last: {last})",
                within.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn build(
    k: usize,
    overlay: &'static str,
    fast_path: bool,
    workdir: &Path,
    out: &Path,
) -> Result<Cluster, String> {
    let pid = std::process::id();
    let c = if overlay == "vxlan" { 'v' } else { 'r' };
    let id = format!("fp{pid}{c}");
    // Declared before the processes, so that on an error the processes go first.
    let mut guards = Vec::new();
    let mut agents: Vec<Proc> = Vec::new();
    let mut servers: Vec<Proc> = Vec::new();

    let dir = workdir.join(overlay);
    let manifests = dir.join("manifests");
    fs::create_dir_all(&manifests).map_err(|e| format!("{}: {e}", manifests.display()))?;
    let lan = format!("{id}-lan");
    add_netns(&mut guards, &lan)?;
    sh(&format!(
        "ip -n {lan} link add br0 type bridge mcast_snooping 0 && ip -n {lan} link set br0 up"
    ))?;
    let mut nodes = Vec::new();
    let mut docs = Vec::new();
    for n in 1..=2 {
        let ns = format!("{id}-n{n}");
        add_netns(&mut guards, &ns)?;
        sh(&format!(
            "ip -n {lan} link add n{n} type veth peer name eth0 netns {ns} && \
             ip -n {lan} link set n{n} master br0 up && ip -n {ns} link set eth0 up && \
             ip -n {ns} addr add {ip}/24 dev eth0 && \
             ip netns exec {ns} sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0",
            ip = node_ip(k, n)
        ))?;
        docs.push(format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: node{n}\nspec:\n  podCIDR: {cidr}\n  podCIDRs: [{cidr}]\nstatus:\n  addresses:\n  - {{type: InternalIP, address: {ip}}}\n  - {{type: Hostname, address: node{n}}}\n",
            cidr = pod_cidr(k, n),
            ip = node_ip(k, n)
        ));
        nodes.push(ns);
    }
    fs::write(manifests.join("nodes.yaml"), docs.join("---\n")).map_err(|e| e.to_string())?;

    // One agent per node, in the node's namespace, with its own cgroup, pins and CNI
    // directories.
    let mut cgroups = Vec::new();
    let mut logs = Vec::new();
    for n in 1..=2 {
        let name = format!("ferry-bench-{pid}-pn{c}{n}");
        let cgroup = cgroup2_mount().join(&name);
        let bpffs = PathBuf::from(format!("/sys/fs/bpf/{name}"));
        fs::create_dir_all(&cgroup).map_err(|e| format!("{}: {e}", cgroup.display()))?;
        guards.push(hold(Res::Cgroup(cgroup.clone())));
        fs::create_dir_all(&bpffs).map_err(|e| format!("{}: {e}", bpffs.display()))?;
        guards.push(hold(Res::Pins(bpffs.clone())));
        let cni = dir.join(format!("cni-n{n}"));
        let log = out.join(format!("pod-network-{overlay}-node{n}.log"));
        let logf = fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let mut cmd = Command::new(bin("ferry"));
        cmd.arg("agent")
            .arg("--manifests")
            .arg(&manifests)
            .arg("--cgroup")
            .arg(&cgroup)
            .arg("--bpffs")
            .arg(&bpffs)
            .args(["--node-name", &format!("node{n}"), "--devices", "eth0"])
            .args(["--node-ip", &node_ip(k, n).to_string()])
            .args(["--health-addr", &format!("127.0.0.1:{HEALTH_PORT}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{METRICS_PORT}")])
            .arg("--pod-network")
            .arg("--cni-conf-dir")
            .arg(cni.join("net.d"))
            .arg("--cni-bin-dir")
            .arg(cni.join("bin"))
            .arg("--cni-data-dir")
            .arg(cni.join("data"))
            .arg("--cni-plugin")
            .arg(bin("ferry-cni"))
            .args(["--overlay", overlay])
            .arg(format!("--pod-network-fast-path={fast_path}"))
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(logf.try_clone().map_err(|e| e.to_string())?)
            .stderr(logf);
        agents.push(Proc::new(spawn_in(&nodes[n - 1], None, &mut cmd)));
        cgroups.push(cgroup);
        logs.push(log);
    }

    // Ready: /healthz, the CNI configuration, and the route to the other node's pods.
    for n in 1..=2 {
        let ns = &nodes[n - 1];
        let conf = dir.join(format!("cni-n{n}/net.d/10-ferry.conflist"));
        let other = pod_cidr(k, 3 - n);
        let agent = &mut agents[n - 1];
        poll(
            &format!("{overlay}: node{n}'s agent ready with its pod network"),
            Duration::from_secs(60),
            || {
                if let Ok(Some(st)) = agent.child.try_wait() {
                    return Err(format!("the agent exited ({st})"));
                }
                match http_get(ns, HEALTH_PORT, "/healthz") {
                    Ok((200, _)) => {}
                    Ok((code, body)) => return Err(format!("/healthz {code} {body}")),
                    Err(e) => return Err(format!("/healthz: {e}")),
                }
                if !conf.exists() {
                    return Err(format!("no {}", conf.display()));
                }
                let routes = sh(&format!("ip -4 -n {ns} route show proto 245"))?;
                let dev = if overlay == "vxlan" {
                    "dev ferry.vxlan"
                } else {
                    "dev eth0"
                };
                Ok(routes
                    .lines()
                    .any(|l| l.starts_with(&format!("{other} ")) && l.contains(dev)))
            },
        )
        .map_err(|e| format!("{e}\n{}", log_tails(&logs)))?;
    }

    // One pod per node, wired by the installed plugin as a container runtime does.
    let mut pods = Vec::new();
    let mut pod_ips = Vec::new();
    for n in 1..=2 {
        let pod = format!("{id}-p{n}");
        add_netns(&mut guards, &pod)?;
        let ip = cni_add(&dir.join(format!("cni-n{n}")), &nodes[n - 1], &pod)?;
        pods.push(pod);
        pod_ips.push(ip);
    }
    let mtu = sh(&format!("ip -n {} -j link show eth0", pods[0]))?;
    let pod_mtu = serde_json::from_str::<Value>(&mtu).map_err(|e| e.to_string())?[0]["mtu"]
        .as_u64()
        .unwrap_or(0);

    // The servers: on node 2 (the baseline, bound to its LAN address) and in its pod.
    let mut targets = vec![(pods[1].clone(), pod_ips[1])];
    if k == 0 {
        targets.push((nodes[1].clone(), node_ip(k, 2)));
    }
    for (ns, ip) in &targets {
        servers.push(crate::util::iperf_server(ns, *ip, PORT));
        poll(
            &format!("iperf3 server in {ns}"),
            Duration::from_secs(10),
            || {
                Ok(!sh_in(ns, &format!("ss -Htln sport = :{PORT}"))?
                    .trim()
                    .is_empty())
            },
        )?;
    }
    let two = |v: Vec<String>| -> [String; 2] { [v[0].clone(), v[1].clone()] };
    Ok(Cluster {
        k,
        overlay,
        nodes: two(nodes),
        cgroups: [cgroups[0].clone(), cgroups[1].clone()],
        pods: two(pods),
        pod_ips: [pod_ips[0], pod_ips[1]],
        pod_mtu,
        logs: [logs[0].clone(), logs[1].clone()],
        _servers: servers,
        _agents: agents,
        _guards: guards,
    })
}

/// CNI ADD of pod namespace `pod` on the node in `node_ns`: the plugin object of the
/// conflist the agent wrote in `cni/net.d`, with `cniVersion` and `name`, on stdin; the
/// plugin from `cni/bin`. Returns the pod's IPv4 address from the result.
fn cni_add(cni: &Path, node_ns: &str, pod: &str) -> Result<Ipv4Addr, String> {
    let conf_path = cni.join("net.d/10-ferry.conflist");
    let list: Value = serde_json::from_str(
        &fs::read_to_string(&conf_path).map_err(|e| format!("{}: {e}", conf_path.display()))?,
    )
    .map_err(|e| format!("{}: {e}", conf_path.display()))?;
    let mut conf = list["plugins"][0].clone();
    conf["cniVersion"] = list["cniVersion"].clone();
    conf["name"] = list["name"].clone();
    let plugin = cni.join("bin").join(
        conf["type"]
            .as_str()
            .ok_or("the conflist's plugin has no type")?,
    );
    let mut child = Command::new("ip")
        .args(["netns", "exec", node_ns])
        .arg(&plugin)
        .env("CNI_COMMAND", "ADD")
        .env("CNI_CONTAINERID", pod)
        .env("CNI_NETNS", format!("/var/run/netns/{pod}"))
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", cni.join("bin"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{}: {e}", plugin.display()))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(conf.to_string().as_bytes())
            .map_err(|e| format!("{}: stdin: {e}", plugin.display()))?;
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "CNI ADD of {pod} in {node_ns} failed ({}): {stdout} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let result: Value =
        serde_json::from_str(&stdout).map_err(|e| format!("CNI result {stdout:?}: {e}"))?;
    result["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|ip| ip["address"].as_str()?.split('/').next()?.parse().ok())
        .next()
        .ok_or_else(|| format!("CNI result without an IPv4 address: {stdout}"))
}

/// One iperf3 run from `ns` (inside `cgroup`) to `ip`: Gbit/s for TCP, datagrams
/// received per second for UDP.
fn iperf(ns: &str, cgroup: &Path, ip: Ipv4Addr, t: &Test, secs: u64) -> Result<f64, String> {
    let mut cmd = Command::new("iperf3");
    cmd.args(["-c", &ip.to_string(), "-p", &PORT.to_string()])
        .args(["-t", &secs.to_string(), "-O", "1", "-J"])
        .args(["--connect-timeout", "3000"]);
    if t.streams > 1 {
        cmd.args(["-P", &t.streams.to_string()]);
    } else {
        cmd.args(["-A", "0"]);
    }
    if t.udp {
        cmd.args(["-u", "-l", &UDP_PAYLOAD.to_string(), "-b", "0"]);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = spawn_in(ns, Some(cgroup), &mut cmd)
        .wait_with_output()
        .map_err(|e| format!("iperf3 in {ns}: {e}"))?;
    crate::util::iperf_rate(&String::from_utf8_lossy(&out.stdout), t.udp, secs).map_err(|e| {
        format!(
            "iperf3 in {ns} to {ip}: {e} ({}; {})",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })
}

pub(crate) fn targets(r: &Value) -> Vec<(String, bool, String)> {
    let mut t = Vec::new();
    for (variant, label, target) in [
        ("native", "native routing", TARGET_NATIVE),
        ("vxlan", "VXLAN", TARGET_VXLAN),
    ] {
        for (test, what) in [
            ("tcp_gbps", "TCP throughput"),
            ("udp_pps", "UDP packet rate"),
        ] {
            let name = format!("pod network {what}, {label}: pod >= {target}x node");
            match r[test][variant]["vs_node"]["median"].as_f64() {
                Some(x) => t.push((name, x >= target, format!("{x:.3}x"))),
                None => t.push((name, false, "not measured".into())),
            }
        }
    }
    t
}

pub(crate) fn markdown(doc: &Value) -> String {
    let r = &doc["results"];
    let med = |v: &Value| v["median"].as_f64().unwrap_or(f64::NAN);
    let rng = |v: &Value| {
        if v.is_null() {
            "n/a".to_string()
        } else {
            crate::report::ratio(v)
        }
    };
    let mut s = String::from(
        "Medians over the rounds; ratios per round (neighbours in time), median [min-max].\n\n\
         | test | node to node | pod to pod, native | pod to pod, VXLAN | native / node | VXLAN / node |\n|---|---|---|---|---|---|\n",
    );
    for t in &TESTS {
        let x = &r[t.key];
        let val = |variant: &str| {
            let v = &x[variant]["value"];
            if v.is_null() {
                "n/a".to_string()
            } else {
                format!("{:.*}", t.digits, med(v))
            }
        };
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            t.label,
            val("node"),
            val("native"),
            val("vxlan"),
            rng(&x["native"]["vs_node"]),
            rng(&x["vxlan"]["vs_node"]),
        ));
    }
    let c = &doc["clusters"];
    let load = &doc["loadavg_1min"];
    s.push_str(&format!(
        "\nPod traffic took the {}.",
        doc["pod_path"].as_str().unwrap_or("fast path")
    ));
    s.push_str(&format!(
        "\nPod MTU: native {}, VXLAN {}. Load average (1 min) at the start {}, at the end {}: \
         above the benchmark's own 2 (the iperf3 client and server) means other work shared the machine.\n",
        c["native"]["pod_mtu"], c["vxlan"]["pod_mtu"], load["start"], load["end"]
    ));
    if r["vxlan_note"].is_string() {
        // VXLAN: the place for its rows when the agent has no overlay.
        s.push_str(&format!(
            "\n**VXLAN:** {}\n",
            r["vxlan_note"].as_str().unwrap_or("")
        ));
    }
    s.push_str(&crate::report::targets_table(&targets(r)));
    s
}

pub(crate) fn run(args: &Args) -> Result<(Value, String), String> {
    crate::util::require_tool("iperf3", "iperf3")?;
    for b in ["ferry", "ferry-cni"] {
        if !bin(b).exists() {
            return Err(format!(
                "{} missing: run `cargo xtask build` first",
                bin(b).display()
            ));
        }
    }
    let t0 = Instant::now();
    let load_before = loadavg();
    let mut variants: Vec<&str> = VARIANTS.to_vec();
    let mut vxlan_note = Value::Null;
    if !args.vxlan {
        variants.retain(|v| *v != "vxlan");
        vxlan_note = json!("left out (--no-vxlan).");
    } else if !vxlan_available() {
        // VXLAN: measured here once the agent has `--overlay vxlan`.
        variants.retain(|v| *v != "vxlan");
        let note = "the overlay is not available yet (this `ferry agent` has no `--overlay vxlan`): not measured.";
        eprintln!("== pod-network: VXLAN {note}");
        vxlan_note = json!(note);
    }
    eprintln!("== pod-network: {}", variants.join(", "));
    let workdir = std::env::temp_dir().join(format!("ferry-bench-podnet-{}", std::process::id()));
    let _w = hold(Res::Dir(workdir.clone()));
    fs::create_dir_all(&workdir).map_err(|e| format!("{}: {e}", workdir.display()))?;
    fs::create_dir_all(&args.base.out).map_err(|e| format!("{}: {e}", args.base.out.display()))?;

    let fast_path = !args.kernel_path;
    let native = build(0, "none", fast_path, &workdir, &args.base.out)?;
    let vxlan = if variants.contains(&"vxlan") {
        Some(build(1, "vxlan", fast_path, &workdir, &args.base.out)?)
    } else {
        None
    };
    let setup_s = t0.elapsed().as_secs_f64();
    eprintln!("   set up in {setup_s:.1} s");
    let path = |v: &str| -> (&Cluster, (&str, &Path, Ipv4Addr)) {
        let c = if v == "vxlan" {
            vxlan.as_ref().unwrap_or(&native)
        } else {
            &native
        };
        (c, c.path(v))
    };

    // A second of TCP and of UDP must get through each path before anything is timed.
    for v in &variants {
        let (c, (ns, cg, ip)) = path(v);
        for t in [&TESTS[0], &TESTS[2]] {
            iperf(ns, cg, ip, t, 1).map_err(|e| {
                format!(
                    "{v}: {} from {ns} to {ip} does not get through: {e}\n{}",
                    if t.udp { "UDP" } else { "TCP" },
                    c.log_tails()
                )
            })?;
        }
    }

    if let Some(secs) = args.hold {
        for v in &variants {
            let (_, (ns, cg, ip)) = path(v);
            eprintln!(
                "   {v}: client namespace {ns}, cgroup {}, server {ip}:{PORT} (iperf3 -s on CPU 1)",
                cg.display()
            );
        }
        eprintln!("   holding for {secs} s");
        std::thread::sleep(Duration::from_secs(secs));
    }

    let mut results = json!({});
    for t in &TESTS {
        let mut vals: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
        for r in 0..args.base.rounds {
            for i in 0..variants.len() {
                let k = (i + r) % variants.len();
                let (_, (ns, cg, ip)) = path(variants[k]);
                let v = iperf(ns, cg, ip, t, args.base.seconds)?;
                eprintln!("   round {} {} {:<7} {v:.3}", r + 1, t.key, variants[k]);
                vals[k].push(v);
            }
        }
        let mut per = serde_json::Map::new();
        for (k, v) in variants.iter().enumerate() {
            let ratios: Vec<f64> = vals[k].iter().zip(&vals[0]).map(|(x, y)| x / y).collect();
            per.insert(
                v.to_string(),
                json!({"value": spread(&vals[k]), "vs_node": spread(&ratios)}),
            );
        }
        eprintln!(
            "   {}: {}",
            t.key,
            variants
                .iter()
                .enumerate()
                .map(|(k, v)| format!("{v} {:.3}", median(&vals[k])))
                .collect::<Vec<_>>()
                .join(", ")
        );
        results[t.key] = Value::Object(per);
    }
    results["vxlan_note"] = vxlan_note;
    let cluster = |c: &Cluster| {
        json!({
            "overlay": c.overlay,
            "pod_ips": c.pod_ips.map(|i| i.to_string()),
            "pod_mtu": c.pod_mtu,
            "nodes": c.nodes,
        })
    };
    let clusters = json!({
        "native": cluster(&native),
        "vxlan": vxlan.as_ref().map(cluster),
    });
    drop(vxlan);
    drop(native);
    let doc = json!({
        "benchmark": "pod-network",
        "machine": crate::util::machine(),
        "revision": crate::util::revision(),
        "mode": if args.base.quick { "quick" } else { "full" },
        "pod_path": if fast_path { "fast path" } else { "kernel path (--pod-network-fast-path=false)" },
        "settings": {"rounds": args.base.rounds, "seconds": args.base.seconds, "udp_payload": UDP_PAYLOAD},
        "setup_s": setup_s,
        "elapsed_s": t0.elapsed().as_secs_f64(),
        "loadavg_1min": {"start": load_before, "end": loadavg()},
        "clusters": clusters,
        "results": results,
    });
    let file = args.base.out.join("pod-network.json");
    fs::write(
        &file,
        serde_json::to_string_pretty(&doc).unwrap_or_default(),
    )
    .map_err(|e| format!("{}: {e}", file.display()))?;
    let mut md = crate::report::header(&doc);
    md.push_str(&markdown(&doc));
    Ok((doc, md))
}
