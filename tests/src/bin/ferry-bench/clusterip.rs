//! `ferry-bench datapath-clusterip`: short connections and UDP request/reply through one
//! ClusterIP, with N Services programmed, for four variants measured interleaved in the
//! same run (docs/benchmarks.md):
//!
//! - `direct`: the client dials a backend address; no translation at all (the floor);
//! - `ferry`: ferry's socket hooks (client in ferry's cgroup, agent fed N Services);
//! - `iptables`: kube-proxy's iptables layout for the same Services (legacy backend);
//! - `nftables`: kube-proxy's nftables layout.
//!
//! Each variant has its own client network namespace (so one variant's rules never
//! slow another), all routed to one server namespace that holds the four backend
//! addresses. The client (one thread, CPU 0) and the server (one thread, CPU 1) are
//! child processes of this benchmark (`load.rs`).

use std::{
    fs,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use ferry_common::{
    LAYOUT_VERSION, addr_from_v4_be,
    lb::{PROTO_TCP, SCOPE_LOCAL_ORIGIN, SERVICES_MAP, ServiceKey, ServiceValue},
};
use ferry_tests::{bin, cgroup2_mount, http_get, spawn_in};
use serde_json::{Value, json};

use crate::{
    cleanup::{Guard, Proc, Res, hold},
    layouts::{self, ServicePort},
    load::{self, Mode, Spec},
    util::{median, sh, sh_in, spread},
};

pub(crate) const VARIANTS: [&str; 4] = ["direct", "ferry", "iptables", "nftables"];
const ENDPOINTS: usize = 4;
const BACKEND_PORT: u16 = 8080;
const SERVICE_PORT: u16 = 80;
const REQUEST_BYTES: usize = 100;
const CLIENT_CPU: usize = 0;
const SERVER_CPU: usize = 1;
/// How long the agent may take to program N Services.
const SYNC_TIMEOUT: Duration = Duration::from_secs(600);
/// kube-proxy's iptables mode with the legacy (x_tables) backend, as in the published
/// kube-proxy scale figures; `--noflush` as kube-proxy restores.
const IPTABLES_RESTORE: &str = "iptables-legacy-restore --noflush";

/// The four backend addresses of the measured Service (on the server's loopback).
fn backend(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, 0, i as u8 + 1)
}

fn vip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 10)) + i as u32)
}

#[derive(Clone, Debug)]
pub(crate) struct Args {
    pub(crate) services: Vec<usize>,
    pub(crate) rounds: usize,
    pub(crate) tcp: Duration,
    pub(crate) udp: Duration,
    pub(crate) latency: Duration,
    pub(crate) warmup: Duration,
    pub(crate) workers: usize,
    pub(crate) changes: usize,
    pub(crate) out: PathBuf,
    pub(crate) quick: bool,
    pub(crate) profile: bool,
    /// The nftables variant runs only up to this many Services: `nft -f` of kube-proxy's
    /// layout grows faster than linearly (82 s at 10,000, 11 min at 30,000 here), so
    /// 100,000 would take hours.
    pub(crate) nft_max: usize,
}

impl Args {
    pub(crate) fn new(quick: bool, out: PathBuf) -> Args {
        let ms = |full: u64, q: u64| Duration::from_millis(if quick { q } else { full });
        Args {
            services: if quick {
                vec![100, 10_000]
            } else {
                vec![100, 1_000, 10_000, 30_000, 100_000]
            },
            rounds: if quick { 2 } else { 5 },
            tcp: ms(2000, 500),
            udp: ms(2000, 500),
            latency: ms(1000, 300),
            warmup: ms(300, 100),
            workers: 16,
            changes: if quick { 2 } else { 5 },
            out,
            quick,
            profile: true,
            nft_max: 30_000,
        }
    }

    /// Applies `--services N,N,..`, `--rounds`, `--seconds`, `--workers`, `--changes`,
    /// `--no-profile`, `--nft-max N`.
    pub(crate) fn parse(&mut self, argv: &[String]) -> Result<(), String> {
        let mut it = argv.iter();
        while let Some(f) = it.next() {
            let mut value = || it.next().ok_or_else(|| format!("{f} needs a value"));
            match f.as_str() {
                "--services" => {
                    self.services = value()?
                        .split(',')
                        .map(|s| s.trim().replace('_', "").parse::<usize>())
                        .collect::<Result<_, _>>()
                        .map_err(|e| format!("--services: {e}"))?;
                    if self.services.contains(&0) {
                        return Err("--services: at least 1".into());
                    }
                }
                "--rounds" => {
                    self.rounds = value()?.parse().map_err(|e| format!("--rounds: {e}"))?
                }
                "--seconds" => {
                    let s: f64 = value()?.parse().map_err(|e| format!("--seconds: {e}"))?;
                    self.tcp = Duration::from_secs_f64(s);
                    self.udp = Duration::from_secs_f64(s);
                    self.latency = Duration::from_secs_f64(s / 2.0);
                }
                "--workers" => {
                    self.workers = value()?.parse().map_err(|e| format!("--workers: {e}"))?
                }
                "--changes" => {
                    self.changes = value()?.parse().map_err(|e| format!("--changes: {e}"))?
                }
                "--no-profile" => self.profile = false,
                "--nft-max" => {
                    self.nft_max = value()?.parse().map_err(|e| format!("--nft-max: {e}"))?
                }
                other => return Err(format!("unknown flag {other}")),
            }
        }
        if self.rounds == 0 {
            return Err("--rounds must be at least 1".into());
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// The Services

/// N Service ports: N-1 decoys (one TCP port each, endpoints that never answer), then
/// the measured Service with a UDP and a TCP port, so that its TCP rule is the last one
/// kube-proxy's KUBE-SERVICES chain holds.
fn services(n: usize) -> Vec<ServicePort> {
    let mut v: Vec<ServicePort> = (0..n - 1)
        .map(|i| ServicePort {
            svc: format!("svc-{i}"),
            port_name: "http".into(),
            vip: vip(i),
            port: SERVICE_PORT,
            proto: "tcp",
            node_port: None,
            endpoints: (0..ENDPOINTS)
                .map(|e| {
                    let a = u32::from(Ipv4Addr::new(10, 128, 0, 0)) + (i * ENDPOINTS + e) as u32;
                    (Ipv4Addr::from(a), BACKEND_PORT)
                })
                .collect(),
        })
        .collect();
    let eps: Vec<(Ipv4Addr, u16)> = (0..ENDPOINTS).map(|e| (backend(e), BACKEND_PORT)).collect();
    for proto in ["udp", "tcp"] {
        v.push(ServicePort {
            svc: "svc-measured".into(),
            port_name: proto.into(),
            vip: vip(n - 1),
            port: SERVICE_PORT,
            proto,
            node_port: None,
            endpoints: eps.clone(),
        });
    }
    v
}

/// The index of the Service whose endpoints the change measurements edit.
fn changed_index(n: usize) -> Option<usize> {
    (n >= 2).then_some((n - 1) / 2)
}

/// Writes ferry's manifests: 1,000 Services a file; the changed Service and the
/// measured one in files of their own, so that a change re-reads one small file.
fn write_manifests(
    dir: &Path,
    ports: &[ServicePort],
    changed: Option<usize>,
) -> Result<(), String> {
    fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let w = |name: &str, items: Vec<Value>| {
        fs::write(dir.join(name), layouts::list(items)).map_err(|e| format!("{name}: {e}"))
    };
    let decoys = &ports[..ports.len() - 2];
    for (c, chunk) in decoys.chunks(1000).enumerate() {
        let items = chunk
            .iter()
            .enumerate()
            .filter(|(i, _)| Some(c * 1000 + i) != changed)
            .flat_map(|(_, p)| layouts::manifests(&[p]))
            .collect();
        w(&format!("services-{c:04}.json"), items)?;
    }
    if let Some(k) = changed {
        w("changed.json", layouts::manifests(&[&ports[k]]))?;
    }
    let m = &ports[ports.len() - 2..];
    w("measured.json", layouts::manifests(&[&m[0], &m[1]]))
}

// ---------------------------------------------------------------------------------------
// Namespaces

/// The server namespace and one client namespace per variant.
struct Topology {
    clients: Vec<String>,
    _server: Proc,
    _guards: Vec<Guard>,
}

impl Topology {
    fn new(tag: &str) -> Result<Topology, String> {
        let pid = std::process::id();
        let server_ns = format!("fb{pid}{tag}s");
        let mut guards = Vec::new();
        sh(&format!("ip netns add {server_ns}"))?;
        guards.push(hold(Res::Netns(server_ns.clone())));
        sh_in(&server_ns, "ip link set lo up")?;
        for e in 0..ENDPOINTS {
            sh_in(&server_ns, &format!("ip addr add {}/32 dev lo", backend(e)))?;
        }
        let mut clients = Vec::new();
        for (k, v) in VARIANTS.iter().enumerate() {
            let ns = format!("fb{pid}{tag}{v}");
            sh(&format!("ip netns add {ns}"))?;
            guards.push(hold(Res::Netns(ns.clone())));
            sh(&format!(
                "ip -n {server_ns} link add v{k} type veth peer name eth0 netns {ns} && \
                 ip -n {server_ns} addr add 172.30.{k}.2/24 dev v{k} && ip -n {server_ns} link set v{k} up && \
                 ip -n {ns} link set lo up && ip -n {ns} addr add 172.30.{k}.1/24 dev eth0 && \
                 ip -n {ns} link set eth0 up && ip -n {ns} route add default via 172.30.{k}.2"
            ))?;
            // Short connections in a tight loop: the whole port range, and conntrack
            // entries of closed connections that do not fill the table (the per-packet
            // work is unchanged; these sysctls are per namespace).
            sh_in(
                &ns,
                "sysctl -qw net.ipv4.ip_local_port_range=\"1024 65535\"; \
                 sysctl -qw net.netfilter.nf_conntrack_tcp_timeout_time_wait=1 2>/dev/null; \
                 sysctl -qw net.netfilter.nf_conntrack_tcp_timeout_close=1 2>/dev/null; true",
            )?;
            clients.push(ns);
        }
        let mut cmd = Command::new(std::env::current_exe().map_err(|e| e.to_string())?);
        cmd.args([
            "serve",
            "--port",
            &BACKEND_PORT.to_string(),
            "--cpu",
            &SERVER_CPU.to_string(),
            "--size",
            &REQUEST_BYTES.to_string(),
            "--udp",
            &(0..ENDPOINTS)
                .map(|e| backend(e).to_string())
                .collect::<Vec<_>>()
                .join(","),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        let mut server = Proc::new(spawn_in(&server_ns, None, &mut cmd));
        let mut line = String::new();
        if let Some(o) = server.child.stdout.take() {
            use std::io::BufRead;
            let _ = std::io::BufReader::new(o).read_line(&mut line);
        }
        if line.trim() != "ready" {
            return Err("the echo server did not start".into());
        }
        Ok(Topology {
            clients,
            _server: server,
            _guards: guards,
        })
    }

    fn client(&self, variant: &str) -> &str {
        let k = VARIANTS.iter().position(|v| *v == variant).unwrap_or(0);
        &self.clients[k]
    }
}

// ---------------------------------------------------------------------------------------
// ferry

struct Ferry {
    ns: String,
    cgroup: PathBuf,
    bpffs: PathBuf,
    manifests: PathBuf,
    log: PathBuf,
    agent: Option<Proc>,
    _guards: Vec<Guard>,
}

impl Ferry {
    fn new(ns: &str, tag: &str, workdir: &Path, log: PathBuf) -> Result<Ferry, String> {
        let name = format!("ferry-bench-{}-{tag}", std::process::id());
        let bpffs = PathBuf::from(format!("/sys/fs/bpf/{name}"));
        let cgroup = cgroup2_mount().join(&name);
        let manifests = workdir.join(format!("manifests-{tag}"));
        // Guards drop in reverse: pins, then the cgroup, then the manifests.
        let mut guards = vec![hold(Res::Dir(manifests.clone()))];
        fs::create_dir_all(&cgroup).map_err(|e| format!("{}: {e}", cgroup.display()))?;
        guards.push(hold(Res::Cgroup(cgroup.clone())));
        guards.push(hold(Res::Pins(bpffs.clone())));
        Ok(Ferry {
            ns: ns.into(),
            cgroup,
            bpffs,
            manifests,
            log,
            agent: None,
            _guards: guards,
        })
    }

    /// Starts the agent on the manifests; returns the time to /healthz 200.
    fn start(&mut self, entries: usize, backends: usize) -> Result<Duration, String> {
        let cap = |n: usize| ((n + n / 4 + 64).next_power_of_two().max(65536)) as u32;
        let log =
            fs::File::create(&self.log).map_err(|e| format!("{}: {e}", self.log.display()))?;
        let mut cmd = Command::new(bin("ferry"));
        cmd.arg("agent")
            .arg("--manifests")
            .arg(&self.manifests)
            .arg("--cgroup")
            .arg(&self.cgroup)
            .arg("--bpffs")
            .arg(&self.bpffs)
            .args(["--node-name", "bench-node", "--node-ip", "172.30.1.1"])
            .args([
                "--health-addr",
                "127.0.0.1:10256",
                "--metrics-addr",
                "127.0.0.1:10249",
            ])
            .arg("--max-services")
            .arg(cap(entries).to_string())
            .arg("--max-backends")
            .arg(cap(backends).to_string())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        let t0 = Instant::now();
        self.agent = Some(Proc::new(spawn_in(&self.ns, None, &mut cmd)));
        loop {
            if let Some(st) = self
                .agent
                .as_mut()
                .and_then(|p| p.child.try_wait().ok().flatten())
            {
                return Err(format!(
                    "the agent exited ({st}) before /healthz answered 200; log {}:\n{}",
                    self.log.display(),
                    fs::read_to_string(&self.log).unwrap_or_default()
                ));
            }
            if matches!(http_get(&self.ns, 10256, "/healthz"), Ok((200, _))) {
                return Ok(t0.elapsed());
            }
            if t0.elapsed() > SYNC_TIMEOUT {
                return Err(format!("the agent was not ready within {SYNC_TIMEOUT:?}"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn services_map(&self) -> Result<BpfHashMap<MapData, ServiceKey, ServiceValue>, String> {
        let path = self
            .bpffs
            .join(format!("v{LAYOUT_VERSION}"))
            .join(SERVICES_MAP);
        let data = MapData::from_pin(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        BpfHashMap::try_from(Map::HashMap(data)).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// ferry's programs on the client's path: those attached to its cgroup and the tc
    /// programs on the client namespace's devices (every packet of the client's
    /// connections passes them): (id, attach type, or `tc <device> <direction>` from the
    /// link pin's name).
    fn programs(&self) -> Result<Vec<(u64, String)>, String> {
        let out = sh(&format!("bpftool -j cgroup show {}", self.cgroup.display()))?;
        let v: Value =
            serde_json::from_str(&out).map_err(|e| format!("bpftool cgroup show: {e}"))?;
        let mut progs: Vec<(u64, String)> = v
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|p| {
                        Some((p["id"].as_u64()?, p["attach_type"].as_str()?.to_string()))
                    })
                    .collect()
            })
            .unwrap_or_default();
        // tcx links (bpftool's `net show` does not list them): through their pins.
        let links = self.bpffs.join("links");
        let mut pins: Vec<PathBuf> = fs::read_dir(&links)
            .map_err(|e| format!("{}: {e}", links.display()))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("tc_"))
            })
            .collect();
        pins.sort();
        for pin in pins {
            let out = sh(&format!("bpftool -j link show pinned {}", pin.display()))?;
            let v: Value =
                serde_json::from_str(&out).map_err(|e| format!("bpftool link show: {e}"))?;
            if let Some(id) = v["prog_id"].as_u64() {
                let name = pin.file_name().unwrap_or_default().to_string_lossy();
                progs.push((id, name.replace('_', " ")));
            }
        }
        Ok(progs)
    }
}

fn slot0_key(ip: Ipv4Addr) -> ServiceKey {
    ServiceKey {
        addr: addr_from_v4_be(u32::from(ip).to_be()),
        port: SERVICE_PORT.to_be(),
        slot: 0,
        proto: PROTO_TCP,
        scope: SCOPE_LOCAL_ORIGIN,
        _pad: [0; 2],
    }
}

// ---------------------------------------------------------------------------------------
// One N

/// Times `tool < input` in namespace `ns`: milliseconds, or the error with the input
/// line it names.
fn timed(ns: &str, tool: &str, input: &Path) -> Result<f64, String> {
    let t = Instant::now();
    sh(&format!("ip netns exec {ns} {tool} < {}", input.display())).map_err(|e| {
        let line = e
            .split("line ")
            .nth(1)
            .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse::<usize>().ok())
            .and_then(|n| {
                fs::read_to_string(input)
                    .ok()?
                    .lines()
                    .nth(n - 1)
                    .map(String::from)
            });
        match line {
            Some(l) => format!("{e}\n   that line: {l}"),
            None => e,
        }
    })?;
    Ok(t.elapsed().as_secs_f64() * 1000.0)
}

fn target_of(variant: &str, n: usize) -> SocketAddr {
    match variant {
        "direct" => SocketAddr::from((backend(0), BACKEND_PORT)),
        _ => SocketAddr::from((vip(n - 1), SERVICE_PORT)),
    }
}

/// One measurement of one variant.
fn measure(
    topo: &Topology,
    ferry: &Ferry,
    variant: &str,
    n: usize,
    mode: Mode,
    workers: usize,
    dur: Duration,
    warmup: Duration,
) -> Result<load::Outcome, String> {
    let spec = Spec {
        mode,
        addr: target_of(variant, n),
        workers,
        warmup,
        duration: dur,
        cpu: CLIENT_CPU,
        size: REQUEST_BYTES,
    };
    let cgroup = (variant == "ferry").then_some(ferry.cgroup.as_path());
    load::run(topo.client(variant), cgroup, &spec)
}

/// Programs N Services for every variant; returns the programming times in ms.
fn program(
    topo: &Topology,
    ferry: &mut Ferry,
    ports: &[ServicePort],
    n: usize,
    workdir: &Path,
    nft_on: bool,
) -> Result<Value, String> {
    let ipt_file = workdir.join(format!("iptables-{n}.rules"));
    let nft_file = workdir.join(format!("nft-{n}.nft"));
    let _files = (
        hold(Res::Dir(ipt_file.clone())),
        hold(Res::Dir(nft_file.clone())),
    );
    let t = Instant::now();
    write_manifests(&ferry.manifests, ports, changed_index(n))?;
    let ipt = layouts::iptables_full(ports);
    fs::write(&ipt_file, &ipt).map_err(|e| e.to_string())?;
    let nft = if nft_on {
        layouts::nft_full(ports, &[])
    } else {
        String::new()
    };
    fs::write(&nft_file, &nft).map_err(|e| e.to_string())?;
    eprintln!(
        "   generated {} iptables lines, {} nft lines in {:.1} s",
        ipt.lines().count(),
        nft.lines().count(),
        t.elapsed().as_secs_f64()
    );
    let entries = ports.len() * (1 + ENDPOINTS);
    let ferry_ms = ferry.start(entries, n * ENDPOINTS + 16)?.as_secs_f64() * 1000.0;
    let ipt_ms = timed(topo.client("iptables"), IPTABLES_RESTORE, &ipt_file)?;
    let nft_ms = if nft_on {
        timed(topo.client("nftables"), "nft -f -", &nft_file)?
    } else {
        eprintln!("   nftables: not run above --nft-max Services");
        f64::NAN
    };
    eprintln!(
        "   programmed: ferry {ferry_ms:.0} ms (agent start to /healthz), iptables-restore {ipt_ms:.0} ms, nft -f {nft_ms:.0} ms"
    );
    Ok(
        json!({"ferry_ms": ferry_ms, "iptables_ms": ipt_ms, "nftables_ms": nft_ms,
              "iptables_lines": ipt.lines().count(), "nft_lines": nft.lines().count()}),
    )
}

/// Times `changes` single-Service endpoint changes per variant (add a fifth endpoint,
/// then remove it again, alternately).
fn change_times(
    topo: &Topology,
    ferry: &Ferry,
    ports: &[ServicePort],
    n: usize,
    changes: usize,
    workdir: &Path,
    nft_on: bool,
) -> Result<Value, String> {
    let Some(k) = changed_index(n) else {
        return Ok(Value::Null);
    };
    let map = ferry.services_map()?;
    let base = ports[k].clone();
    let mut bigger = base.clone();
    bigger
        .endpoints
        .push((Ipv4Addr::new(10, 127, 255, 1), BACKEND_PORT));
    let (mut f, mut i, mut t) = (Vec::new(), Vec::new(), Vec::new());
    let file = workdir.join("change.in");
    let _g = hold(Res::Dir(file.clone()));
    for c in 0..changes * 2 {
        let (old, new) = if c % 2 == 0 {
            (&base, &bigger)
        } else {
            (&bigger, &base)
        };
        // ferry: rewrite the Service's manifest; the agent polls the directory every
        // 200 ms, so up to 200 ms of this is the poll.
        let t0 = Instant::now();
        fs::write(
            ferry.manifests.join("changed.json"),
            layouts::list(layouts::manifests(&[new])),
        )
        .map_err(|e| e.to_string())?;
        let want = new.endpoints.len() as u16;
        loop {
            if map
                .get(&slot0_key(new.vip), 0)
                .is_ok_and(|v| v.count == want)
            {
                break;
            }
            if t0.elapsed() > Duration::from_secs(30) {
                return Err("ferry: an endpoint change did not reach the maps within 30 s".into());
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        f.push(t0.elapsed().as_secs_f64() * 1000.0);
        // iptables: kube-proxy's partial restore.
        let mut all = ports.to_vec();
        all[k] = new.clone();
        fs::write(&file, layouts::iptables_partial(&all, old, new)).map_err(|e| e.to_string())?;
        i.push(timed(topo.client("iptables"), IPTABLES_RESTORE, &file)?);
        if nft_on {
            fs::write(&file, layouts::nft_partial(old, new)).map_err(|e| e.to_string())?;
            t.push(timed(topo.client("nftables"), "nft -f -", &file)?);
        }
        // The manifests source ignores files changed within its mtime granularity
        // unless their content differs; keep changes apart.
        std::thread::sleep(Duration::from_millis(250));
    }
    eprintln!(
        "   one Service's endpoints changed: ferry {:.1} ms (file to map), iptables-restore {:.1} ms, nft -f {:.1} ms (medians)",
        median(&f),
        median(&i),
        median(&t)
    );
    Ok(json!({"ferry_ms": spread(&f), "iptables_ms": spread(&i), "nftables_ms": spread(&t)}))
}

/// ferry's programs under load with `kernel.bpf_stats_enabled`: ns per run and runs
/// per operation, for the TCP and UDP loads.
fn profile(topo: &Topology, ferry: &Ferry, n: usize, args: &Args) -> Result<Value, String> {
    let progs = ferry.programs()?;
    let stats_file = PathBuf::from("/proc/sys/kernel/bpf_stats_enabled");
    let old = fs::read_to_string(&stats_file).map_err(|e| e.to_string())?;
    let _restore = hold(Res::Sysctl(stats_file.clone(), old.trim().to_string()));
    fs::write(&stats_file, "1").map_err(|e| format!("enabling bpf stats: {e}"))?;
    let read = || -> Vec<(u64, u64)> {
        progs
            .iter()
            .map(|(id, _)| {
                let v: Value = sh(&format!("bpftool -j prog show id {id}"))
                    .ok()
                    .and_then(|s| serde_json::from_str(&s).ok())
                    .unwrap_or(Value::Null);
                (
                    v["run_time_ns"].as_u64().unwrap_or(0),
                    v["run_cnt"].as_u64().unwrap_or(0),
                )
            })
            .collect()
    };
    let mut out = json!({});
    for (name, mode) in [("tcp", Mode::Tcp), ("udp", Mode::Udp)] {
        let before = read();
        let o = measure(
            topo,
            ferry,
            "ferry",
            n,
            mode,
            args.workers,
            args.tcp,
            args.warmup,
        )?;
        let after = read();
        // Operations in the warm-up are counted too: runs per op use the whole load.
        let total_ops = o.rate * (args.tcp + args.warmup).as_secs_f64();
        let mut per = serde_json::Map::new();
        for (((_, attach), b), a) in progs.iter().zip(&before).zip(&after) {
            let (ns, cnt) = (a.0 - b.0, a.1 - b.1);
            if cnt == 0 {
                continue;
            }
            per.insert(
                attach.clone(),
                json!({"ns_per_run": ns as f64 / cnt as f64, "runs": cnt, "runs_per_op": cnt as f64 / total_ops.max(1.0)}),
            );
        }
        eprintln!("   bpf profile ({name}): {}", Value::Object(per.clone()));
        out[name] = json!({"rate_with_stats": o.rate, "programs": per});
    }
    Ok(out)
}

/// Everything for one N.
fn run_n(args: &Args, n: usize, workdir: &Path) -> Result<Value, String> {
    eprintln!("== datapath-clusterip: {n} Services x {ENDPOINTS} endpoints");
    let ports = services(n);
    let topo = Topology::new(&format!("n{n}"))?;
    let log = args
        .out
        .join("clusterip-logs")
        .join(format!("agent-{n}.log"));
    let mut ferry = Ferry::new(topo.client("ferry"), &format!("cip{n}"), workdir, log)?;
    let nft_on = n <= args.nft_max;
    let runs = |v: &str| nft_on || v != "nftables";
    let programming = program(&topo, &mut ferry, &ports, n, workdir, nft_on)?;

    // Every variant must answer before anything is timed.
    for v in VARIANTS.into_iter().filter(|v| runs(v)) {
        for mode in [Mode::Tcp, Mode::Udp] {
            let o = measure(
                &topo,
                &ferry,
                v,
                n,
                mode,
                1,
                Duration::from_millis(200),
                Duration::ZERO,
            )?;
            if o.ops == 0 || o.errors > 0 {
                if let Ok(s) = std::env::var("FERRY_BENCH_HOLD_S") {
                    eprintln!("   holding the namespaces {s} s for a look (FERRY_BENCH_HOLD_S)");
                    std::thread::sleep(Duration::from_secs(s.parse().unwrap_or(60)));
                }
                return Err(format!(
                    "{v}: {mode:?} to {} does not answer ({} ok, {} errors) in {}",
                    target_of(v, n),
                    o.ops,
                    o.errors,
                    topo.client(v)
                ));
            }
        }
    }

    // Rounds: each round runs every variant once per test, in an order rotated by one
    // each round, so slow drift of the machine falls on every variant alike.
    let tests: [(&str, Mode, usize, Duration); 3] = [
        ("tcp", Mode::Tcp, args.workers, args.tcp),
        ("tcp_latency", Mode::Tcp, 1, args.latency),
        ("udp", Mode::Udp, args.workers, args.udp),
    ];
    let mut samples: Vec<Vec<Vec<load::Outcome>>> =
        vec![vec![Vec::new(); VARIANTS.len()]; tests.len()];
    for r in 0..args.rounds {
        for (t, (name, mode, workers, dur)) in tests.iter().enumerate() {
            for k in 0..VARIANTS.len() {
                let vi = (k + r) % VARIANTS.len();
                if !runs(VARIANTS[vi]) {
                    continue;
                }
                let o = measure(
                    &topo,
                    &ferry,
                    VARIANTS[vi],
                    n,
                    *mode,
                    *workers,
                    *dur,
                    args.warmup,
                )?;
                eprintln!(
                    "   round {} {name:<11} {:<8} {:>9.0}/s  p50 {:>6.1} us  p99 {:>6.1} us{}",
                    r + 1,
                    VARIANTS[vi],
                    o.rate,
                    o.p50_us,
                    o.p99_us,
                    if o.errors > 0 {
                        format!("  ({} errors)", o.errors)
                    } else {
                        String::new()
                    }
                );
                samples[t][vi].push(o);
            }
        }
    }

    let mut result = json!({"services": n, "endpoints": ENDPOINTS, "programming": programming});
    for (t, (name, ..)) in tests.iter().enumerate() {
        let mut per = serde_json::Map::new();
        for (vi, v) in VARIANTS.iter().enumerate() {
            let s = &samples[t][vi];
            let rates: Vec<f64> = s.iter().map(|o| o.rate).collect();
            let p50: Vec<f64> = s.iter().map(|o| o.p50_us).collect();
            let p99: Vec<f64> = s.iter().map(|o| o.p99_us).collect();
            // The ratio to the floor, per round (neighbours in time), then its spread.
            let ratio: Vec<f64> = s
                .iter()
                .zip(&samples[t][0])
                .map(|(o, d)| o.rate / d.rate)
                .collect();
            per.insert(
                v.to_string(),
                json!({
                    "rate": spread(&rates),
                    "p50_us": spread(&p50),
                    "p99_us": spread(&p99),
                    "errors": s.iter().map(|o| o.errors).sum::<u64>(),
                    "vs_direct": spread(&ratio),
                }),
            );
        }
        // ferry against the other translating variants, per round.
        let vs = |other: usize| -> Value {
            let r: Vec<f64> = samples[t][1]
                .iter()
                .zip(&samples[t][other])
                .map(|(f, o)| f.rate / o.rate)
                .collect();
            spread(&r)
        };
        per.insert("ferry_vs_iptables".into(), vs(2));
        per.insert("ferry_vs_nftables".into(), vs(3));
        result[*name] = Value::Object(per);
    }
    result["change"] = change_times(&topo, &ferry, &ports, n, args.changes, workdir, nft_on)?;
    if args.profile {
        result["bpf_profile"] = profile(&topo, &ferry, n, args)?;
    }
    drop(ferry);
    drop(topo);
    Ok(result)
}

// ---------------------------------------------------------------------------------------
// Report

/// Targets from the issue, checked against the median per-round ratios.
pub(crate) fn targets(results: &[Value]) -> Vec<(String, bool, String)> {
    let mut t = Vec::new();
    for r in results {
        let n = r["services"].as_u64().unwrap_or(0);
        let ratio = |k: &str| r["tcp"][k]["median"].as_f64().unwrap_or(f64::NAN);
        let floor = r["tcp"]["ferry"]["vs_direct"]["median"]
            .as_f64()
            .unwrap_or(f64::NAN);
        t.push((
            format!("N={n}: ferry >= 0.98x floor (TCP conn/s)"),
            floor >= 0.98,
            format!("{floor:.3}x"),
        ));
        let nft = ratio("ferry_vs_nftables");
        if n >= 1000 && !nft.is_nan() {
            let v = nft;
            t.push((
                format!("N={n}: ferry >= 1.2x nftables"),
                v >= 1.2,
                format!("{v:.2}x"),
            ));
        }
        if n == 30_000 {
            let v = ratio("ferry_vs_iptables");
            t.push((
                format!("N={n}: ferry >= 5x iptables"),
                v >= 5.0,
                format!("{v:.2}x"),
            ));
        }
    }
    t
}

fn med(v: &Value) -> f64 {
    v["median"].as_f64().unwrap_or(f64::NAN)
}

fn range(v: &Value) -> String {
    if med(v).is_nan() {
        return "not run".into();
    }
    format!(
        "{:.2} [{:.2}-{:.2}]",
        med(v),
        v["min"].as_f64().unwrap_or(f64::NAN),
        v["max"].as_f64().unwrap_or(f64::NAN)
    )
}

/// The Markdown tables (printed, and put into docs/benchmarks.md).
pub(crate) fn markdown(results: &[Value]) -> String {
    let mut s = String::new();
    s.push_str("TCP short connections (16 in flight), connections/s and ratio to the floor, median [min-max] over the rounds:\n\n");
    s.push_str("| Services | direct conn/s | ferry | iptables | nftables | ferry / iptables | ferry / nftables |\n|---|---|---|---|---|---|---|\n");
    for r in results {
        let t = &r["tcp"];
        s.push_str(&format!(
            "| {} | {:.0} | {} | {} | {} | {} | {} |\n",
            r["services"],
            med(&t["direct"]["rate"]),
            range(&t["ferry"]["vs_direct"]),
            range(&t["iptables"]["vs_direct"]),
            range(&t["nftables"]["vs_direct"]),
            range(&t["ferry_vs_iptables"]),
            range(&t["ferry_vs_nftables"]),
        ));
    }
    s.push_str("\nRequest latency (connect to reply), µs, p50 / p99: under load (16 in flight) and alone (1 in flight):\n\n");
    s.push_str("| Services | direct | ferry | iptables | nftables | direct alone | ferry alone | iptables alone | nftables alone |\n|---|---|---|---|---|---|---|---|---|\n");
    for r in results {
        let c = |t: &str, v: &str| {
            if med(&r[t][v]["p50_us"]).is_nan() {
                return "not run".to_string();
            }
            format!(
                "{:.0} / {:.0}",
                med(&r[t][v]["p50_us"]),
                med(&r[t][v]["p99_us"])
            )
        };
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r["services"],
            c("tcp", "direct"),
            c("tcp", "ferry"),
            c("tcp", "iptables"),
            c("tcp", "nftables"),
            c("tcp_latency", "direct"),
            c("tcp_latency", "ferry"),
            c("tcp_latency", "iptables"),
            c("tcp_latency", "nftables"),
        ));
    }
    s.push_str(
        "\nUDP request/reply (16 unconnected sockets), requests/s and ratio to the floor:\n\n",
    );
    s.push_str(
        "| Services | direct req/s | ferry | iptables | nftables |\n|---|---|---|---|---|\n",
    );
    for r in results {
        let t = &r["udp"];
        s.push_str(&format!(
            "| {} | {:.0} | {} | {} | {} |\n",
            r["services"],
            med(&t["direct"]["rate"]),
            range(&t["ferry"]["vs_direct"]),
            range(&t["iptables"]["vs_direct"]),
            range(&t["nftables"]["vs_direct"]),
        ));
    }
    s.push_str("\nProgramming N Services, and changing one Service's endpoints with N present (ms; change: median [min-max]):\n\n");
    s.push_str("| Services | ferry: agent start to /healthz | iptables-restore | nft -f | change: ferry (file to map, incl. 200 ms poll) | change: iptables-restore | change: nft -f |\n|---|---|---|---|---|---|---|\n");
    for r in results {
        let p = &r["programming"];
        let c = &r["change"];
        let ch = |k: &str| {
            if c.is_null() {
                "-".to_string()
            } else if med(&c[k]).is_nan() {
                "not run".to_string()
            } else {
                format!(
                    "{:.1} [{:.1}-{:.1}]",
                    med(&c[k]),
                    c[k]["min"].as_f64().unwrap_or(f64::NAN),
                    c[k]["max"].as_f64().unwrap_or(f64::NAN)
                )
            }
        };
        s.push_str(&format!(
            "| {} | {:.0} | {:.0} | {} | {} | {} | {} |\n",
            r["services"],
            p["ferry_ms"].as_f64().unwrap_or(f64::NAN),
            p["iptables_ms"].as_f64().unwrap_or(f64::NAN),
            p["nftables_ms"]
                .as_f64()
                .map_or("not run".to_string(), |v| format!("{v:.0}")),
            ch("ferry_ms"),
            ch("iptables_ms"),
            ch("nftables_ms"),
        ));
    }
    if results.iter().any(|r| !r["bpf_profile"].is_null()) {
        s.push_str("\nferry's programs under the load (`kernel.bpf_stats_enabled=1`): ns per run, runs per request, ns per request (the cgroup hooks and the tc programs on the client's device):\n\n");
        s.push_str(
            "| Services | load | program | ns/run | runs/request | ns/request |\n|---|---|---|---|---|---|\n",
        );
        for r in results {
            for load in ["tcp", "udp"] {
                if let Some(p) = r["bpf_profile"][load]["programs"].as_object() {
                    let mut total = 0.0;
                    for (prog, v) in p {
                        let ns = v["ns_per_run"].as_f64().unwrap_or(f64::NAN);
                        let runs = v["runs_per_op"].as_f64().unwrap_or(f64::NAN);
                        total += ns * runs;
                        s.push_str(&format!(
                            "| {} | {load} | {prog} | {ns:.0} | {runs:.2} | {:.0} |\n",
                            r["services"],
                            ns * runs
                        ));
                    }
                    s.push_str(&format!(
                        "| {} | {load} | all | | | {total:.0} |\n",
                        r["services"]
                    ));
                }
            }
        }
    }
    s.push_str("\nTargets:\n\n| target | result | |\n|---|---|---|\n");
    for (what, ok, val) in targets(results) {
        s.push_str(&format!(
            "| {what} | {val} | {} |\n",
            if ok { "met" } else { "**missed**" }
        ));
    }
    s
}

/// The plots of each figure against the number of Services.
fn plots(results: &[Value], dir: &Path) -> Vec<PathBuf> {
    let xs: Vec<f64> = results
        .iter()
        .map(|r| r["services"].as_f64().unwrap_or(0.0))
        .collect();
    let series = |f: &dyn Fn(&Value, &str) -> f64| -> Vec<(String, Vec<f64>)> {
        VARIANTS
            .iter()
            .map(|v| (v.to_string(), results.iter().map(|r| f(r, v)).collect()))
            .collect()
    };
    let mut out = Vec::new();
    let figs: [(&str, &str, &str, Box<dyn Fn(&Value, &str) -> f64>, bool); 4] = [
        (
            "bench-clusterip-tcp.png",
            "TCP short connections through one ClusterIP",
            "connections/s",
            Box::new(|r, v| med(&r["tcp"][v]["rate"])),
            false,
        ),
        (
            "bench-clusterip-latency.png",
            "Request latency p99, one connection at a time",
            "p99 latency (us)",
            Box::new(|r, v| med(&r["tcp_latency"][v]["p99_us"])),
            true,
        ),
        (
            "bench-clusterip-udp.png",
            "UDP request/reply through one ClusterIP",
            "requests/s",
            Box::new(|r, v| med(&r["udp"][v]["rate"])),
            false,
        ),
        (
            "bench-clusterip-programming.png",
            "Time to program N Services",
            "ms",
            Box::new(|r, v| {
                let key = match v {
                    "ferry" => "ferry_ms",
                    "iptables" => "iptables_ms",
                    "nftables" => "nftables_ms",
                    _ => "",
                };
                r["programming"][key].as_f64().unwrap_or(f64::NAN)
            }),
            true,
        ),
    ];
    for (file, title, y, f, log_y) in figs {
        let path = dir.join(file);
        let s: Vec<(String, Vec<f64>)> = series(&*f)
            .into_iter()
            .filter(|(_, v)| v.iter().any(|x| x.is_finite()))
            .collect();
        match crate::plot::lines(&path, title, "Services (log scale)", y, &xs, &s, log_y) {
            Ok(()) => out.push(path),
            Err(e) => eprintln!("ferry-bench: plot {}: {e}", path.display()),
        }
    }
    out
}

/// Runs every N; writes JSON, plots, and the docs section; returns the Markdown.
pub(crate) fn run(args: &Args, docs_dir: &Path) -> Result<(Value, String), String> {
    crate::util::require_tool("iptables-legacy-restore", "iptables")?;
    crate::util::require_tool("nft", "nftables")?;
    crate::util::require_tool("bpftool", "bpftool")?;
    if !bin("ferry").exists() {
        return Err(format!(
            "{} missing: run `cargo xtask build` first",
            bin("ferry").display()
        ));
    }
    let workdir = std::env::temp_dir().join(format!("ferry-bench-cip-{}", std::process::id()));
    let _w = hold(Res::Dir(workdir.clone()));
    fs::create_dir_all(&workdir).map_err(|e| e.to_string())?;
    fs::create_dir_all(args.out.join("clusterip-logs")).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let mut results = Vec::new();
    for &n in &args.services {
        results.push(run_n(args, n, &workdir)?);
    }
    let doc = json!({
        "benchmark": "datapath-clusterip",
        "machine": crate::util::machine(),
        "revision": crate::util::revision(),
        "mode": if args.quick { "quick" } else { "full" },
        "settings": {
            "services": args.services, "rounds": args.rounds, "workers": args.workers,
            "tcp_s": args.tcp.as_secs_f64(), "udp_s": args.udp.as_secs_f64(),
            "latency_s": args.latency.as_secs_f64(), "warmup_s": args.warmup.as_secs_f64(),
            "request_bytes": REQUEST_BYTES, "endpoints": ENDPOINTS, "changes": args.changes,
            "iptables": "iptables-legacy-restore",
        },
        "elapsed_s": t0.elapsed().as_secs_f64(),
        "results": results,
    });
    let path = args.out.join("datapath-clusterip.json");
    fs::write(
        &path,
        serde_json::to_string_pretty(&doc).unwrap_or_default(),
    )
    .map_err(|e| format!("{}: {e}", path.display()))?;
    let plots = plots(&results, docs_dir);
    let mut md = crate::report::header(&doc);
    md.push_str(&markdown(&results));
    if !plots.is_empty() {
        md.push('\n');
        for p in &plots {
            let f = p.file_name().and_then(|f| f.to_str()).unwrap_or("");
            md.push_str(&format!("![{f}]({f})\n"));
        }
    }
    Ok((doc, md))
}
