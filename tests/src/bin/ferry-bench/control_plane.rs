//! `ferry-bench control-plane`: the agent's control plane against the in-process fake
//! API server, at scale (docs/benchmarks.md).
//!
//! ```text
//! ferry-bench control-plane [--quick] [--scale SxE]... [--runs N] [--changes N]
//!                           [--manifest-files N] [--out DIR] [--docs FILE | --no-docs]
//!                           [--log-level FILTER]
//! ```
//!
//! For each scale (default 10000x10, 30000x4 and 100000x4: S Services `svc-i`, one
//! EndpointSlice of E endpoints each) the fake API server is loaded once; then `--runs`
//! times a fresh bpffs directory, cgroup, veth pair (the agent's `--devices`) and agent
//! (host network namespace, `--node-ip 192.0.2.1`):
//!
//! - full sync: from spawning `ferry agent` to `/healthz` answering 200 (polled every
//!   5 ms), with the phases from the agent's own log timestamps;
//! - on the last run, `--changes` single EndpointSlice changes (one endpoint added to or
//!   removed from a different Service each time), each timed from `FakeApi::apply` to
//!   the new `count` in the frontend's slot 0 of the pinned service map (polled with
//!   ~25 µs sleeps);
//! - the agent's peak RSS (`VmHWM`) after the sync and at the end.
//!
//! Then the same objects through `--manifests` (unless `--manifest-files 0`): written
//! into N JSON files, the same full syncs, and single changes made by rewriting the one
//! file that holds the changed slice, timed from the write to the map (the agent's 100 ms
//! poll included).
//!
//! Prints the tables, writes them between the `bench:control-plane` markers of
//! docs/benchmarks.md (unless `--no-docs`), and writes `DIR/control-plane.json` (default
//! `target/bench`) and the agent logs next to it. Everything it creates (agents, pins,
//! cgroups, veth pairs, manifest files) is removed when it ends, also on failure and on
//! Ctrl-C.

use std::{
    fs,
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, ExitCode, Stdio},
    sync::Mutex,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use ferry_common::{
    LAYOUT_VERSION, addr_from_v4_be,
    lb::{PROTO_TCP, SCOPE_LOCAL_ORIGIN, SERVICES_MAP, ServiceKey, ServiceValue},
};
use ferry_tests::{
    bin, cgroup2_mount,
    fakeapi::{FakeApi, Kind, generate},
};
use serde_json::{Value, json};

use crate::util::{machine, median, min_max, percentile, revision};

const USAGE: &str = "usage: ferry-bench control-plane [--quick] [--scale SxE]... [--runs N] [--changes N] [--manifest-files N] [--out DIR] [--docs FILE | --no-docs] [--log-level FILTER]";

/// Targets from the issue, per scale: (services, full sync to /healthz, peak RSS KiB).
/// A scale takes the row of the smallest listed scale with at least its services
/// (the largest row beyond them), so custom scales are judged by the next bigger one.
const TARGETS: [(usize, Duration, u64); 3] = [
    (10_000, Duration::from_secs(2), 64 * 1024),
    (30_000, Duration::from_secs(3), 80 * 1024),
    (100_000, Duration::from_secs(8), 200 * 1024),
];
const TARGET_CHANGE_P50: Duration = Duration::from_millis(10);

/// Map capacity flags, at least: 10k x (1 + 10) = 110k service entries fit with room.
/// Larger scales get the next power of two above 1.25x their entries ([`capacity`]).
const MAX_SERVICES: u32 = 262_144;
const MAX_BACKENDS: u32 = 262_144;
const NODE_NAME: &str = "bench-node";
const NODE_IP: &str = "192.0.2.1";
/// How long one full sync may take before the run is declared failed.
const SYNC_TIMEOUT: Duration = Duration::from_secs(120);
/// How long one change may take to show before it is counted as lost.
const CHANGE_TIMEOUT: Duration = Duration::from_secs(10);
/// Quiet time between two changes, so each one is measured on an idle agent.
const CHANGE_GAP: Duration = Duration::from_millis(50);
/// Through the manifests source: how long one changed file may take to show.
const MANIFEST_CHANGE_TIMEOUT: Duration = Duration::from_secs(30);
/// The target for one changed manifest file, the poll included.
const TARGET_MANIFEST_CHANGE: Duration = Duration::from_millis(300);
/// Program-from-empty through the manifests, against the API source's.
const TARGET_MANIFEST_SYNC_RATIO: f64 = 2.0;

#[derive(Clone, Copy, Debug)]
struct Scale {
    services: usize,
    endpoints: usize,
}

impl Scale {
    fn label(&self) -> String {
        format!("{}x{}", self.services, self.endpoints)
    }

    /// (full sync to /healthz, peak RSS KiB) this scale is judged against.
    fn targets(&self) -> (Duration, u64) {
        let row = TARGETS
            .iter()
            .find(|t| t.0 >= self.services)
            .unwrap_or(&TARGETS[TARGETS.len() - 1]);
        (row.1, row.2)
    }

    /// (`--max-services`, `--max-backends`) for this scale: S x (1 + E) service-map
    /// entries and S x E backends, with room.
    fn capacity(&self) -> (u32, u32) {
        let room = |n: usize| ((n + n / 4).next_power_of_two() as u32).max(MAX_SERVICES);
        (
            room(self.services * (1 + self.endpoints)),
            room(self.services * self.endpoints).max(MAX_BACKENDS),
        )
    }
}

struct Args {
    scales: Vec<Scale>,
    runs: usize,
    changes: usize,
    out: PathBuf,
    log_level: String,
    /// Files the manifests scenario spreads each scale over; 0 skips it.
    manifest_files: usize,
    /// The file whose `control-plane` section gets the tables (`None`: `--no-docs`).
    docs: Option<PathBuf>,
    /// `--quick`: one run of 10000x10 with 20 changes (its rows say so).
    quick: bool,
}

fn parse_args(argv: &[String]) -> Result<Args, String> {
    let mut it = argv.iter().cloned();
    let mut a = Args {
        scales: Vec::new(),
        runs: 3,
        changes: 60,
        out: Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench"),
        log_level: "info".into(),
        manifest_files: 32,
        docs: Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/benchmarks.md")),
        quick: false,
    };
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--scale" => {
                let v = value()?;
                let (s, e) = v
                    .split_once('x')
                    .ok_or_else(|| format!("--scale {v}: expected SERVICESxENDPOINTS"))?;
                let n = |x: &str| x.parse::<usize>().map_err(|e| format!("--scale {v}: {e}"));
                a.scales.push(Scale {
                    services: n(s)?,
                    endpoints: n(e)?,
                });
            }
            "--runs" => a.runs = value()?.parse().map_err(|e| format!("--runs: {e}"))?,
            "--changes" => a.changes = value()?.parse().map_err(|e| format!("--changes: {e}"))?,
            "--out" => a.out = value()?.into(),
            "--log-level" => a.log_level = value()?,
            "--manifest-files" => {
                a.manifest_files = value()?
                    .parse()
                    .map_err(|e| format!("--manifest-files: {e}"))?
            }
            "--docs" => a.docs = Some(value()?.into()),
            "--no-docs" => a.docs = None,
            "--quick" => {
                a.quick = true;
                a.runs = 1;
                a.changes = 20;
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.scales.is_empty() && a.quick {
        a.scales = vec![Scale {
            services: 10_000,
            endpoints: 10,
        }];
    }
    if a.scales.is_empty() {
        a.scales = vec![
            Scale {
                services: 10_000,
                endpoints: 10,
            },
            Scale {
                services: 30_000,
                endpoints: 4,
            },
            Scale {
                services: 100_000,
                endpoints: 4,
            },
        ];
    }
    if a.runs == 0 {
        return Err("--runs must be at least 1".into());
    }
    Ok(a)
}

// ---------------------------------------------------------------------------------------
// What to remove on Ctrl-C (Drop does not run when a signal ends the process).

struct Active {
    id: u64,
    agent: Option<i32>,
    bpffs: PathBuf,
    cgroup: PathBuf,
    device: String,
}

static ACTIVE: Mutex<Vec<Active>> = Mutex::new(Vec::new());
/// The scratch directory (kubeconfigs), removed at the end, on panic and on Ctrl-C.
static WORKDIR: Mutex<Option<PathBuf>> = Mutex::new(None);

struct WorkDir(PathBuf);

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn teardown(agent: Option<i32>, bpffs: &Path, cgroup: &Path, device: &str) {
    if let Some(pid) = agent {
        // SAFETY: signalling the agent this benchmark started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let _ = Command::new(bin("ferry"))
        .arg("cleanup")
        .arg("--bpffs")
        .arg(bpffs)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    let _ = fs::remove_dir(bpffs);
    let _ = Command::new("ip")
        .args(["link", "del", device])
        .stderr(Stdio::null())
        .status();
    for _ in 0..100 {
        if fs::remove_dir(cgroup).is_ok() || !cgroup.exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Ctrl-C: removes the agents, pins, cgroups and scratch directory of running runs
/// (called from the benchmark's one signal thread, `cleanup::install_signal_handler`).
pub(crate) fn on_signal() {
    let active = ACTIVE.lock().unwrap_or_else(|e| e.into_inner());
    for a in active.iter() {
        teardown(a.agent, &a.bpffs, &a.cgroup, &a.device);
    }
    if let Some(w) = WORKDIR.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
        let _ = fs::remove_dir_all(w);
    }
}

// ---------------------------------------------------------------------------------------
// One agent run: bpffs directory, cgroup, agent process.

/// Where the agent reads the cluster from.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// The fake API server, through this kubeconfig.
    Kube(&'a Path),
    /// A directory of manifests (`--manifests`).
    Manifests(&'a Path),
}

struct Env {
    id: u64,
    bpffs: PathBuf,
    cgroup: PathBuf,
    /// A veth device of the benchmark's own for the agent's `--devices`.
    device: String,
    log: PathBuf,
    agent: Option<Child>,
    health: u16,
}

impl Env {
    fn new(tag: &str, log: PathBuf) -> Result<Env, String> {
        static SEQ: Mutex<u64> = Mutex::new(0);
        let id = {
            let mut s = SEQ.lock().unwrap();
            *s += 1;
            *s
        };
        let name = format!("ferry-bench-{}-{tag}", std::process::id());
        let bpffs = PathBuf::from(format!("/sys/fs/bpf/{name}"));
        let cgroup = cgroup2_mount().join(&name);
        let _ = fs::remove_dir(&cgroup);
        fs::create_dir_all(&cgroup)
            .map_err(|e| format!("creating cgroup {}: {e}", cgroup.display()))?;
        // The agent runs in this network namespace: its tc hooks go on a veth pair of
        // the benchmark's own (this kernel has no dummy devices), never on the
        // machine's interfaces. Deleting one end removes both.
        let device = format!("fbcp{}x{id}", std::process::id() % 100_000);
        let peer = format!("fbcq{}x{id}", std::process::id() % 100_000);
        ACTIVE.lock().unwrap().push(Active {
            id,
            agent: None,
            bpffs: bpffs.clone(),
            cgroup: cgroup.clone(),
            device: device.clone(),
        });
        let ok = Command::new("ip")
            .args([
                "link", "add", &device, "type", "veth", "peer", "name", &peer,
            ])
            .status()
            .is_ok_and(|s| s.success())
            && Command::new("ip")
                .args(["link", "set", &device, "up"])
                .status()
                .is_ok_and(|s| s.success());
        if !ok {
            teardown(None, &bpffs, &cgroup, &device);
            return Err(format!("creating the veth pair {device}/{peer} failed"));
        }
        Ok(Env {
            id,
            bpffs,
            cgroup,
            device,
            log,
            agent: None,
            health: 0,
        })
    }

    /// Spawns the agent; returns when it is spawned (not ready).
    fn spawn_agent(
        &mut self,
        source: Source<'_>,
        capacity: (u32, u32),
        log_level: &str,
    ) -> Result<(), String> {
        self.health = free_port()?;
        let metrics = free_port()?;
        let log =
            fs::File::create(&self.log).map_err(|e| format!("{}: {e}", self.log.display()))?;
        // FERRY_BENCH_WRAPPER (e.g. "perf record -g -o /tmp/agent.perf --" or
        // "heaptrack -o /tmp/agent") runs the agent under a profiler; its numbers are
        // then the profiler's business, not results.
        let wrapper = std::env::var("FERRY_BENCH_WRAPPER").unwrap_or_default();
        let mut words = wrapper.split_whitespace();
        let mut cmd = match words.next() {
            Some(w) => {
                let mut c = Command::new(w);
                c.args(words).arg(bin("ferry"));
                c
            }
            None => Command::new(bin("ferry")),
        };
        cmd.arg("agent");
        match source {
            Source::Kube(kubeconfig) => cmd.arg("--kubeconfig").arg(kubeconfig),
            Source::Manifests(dir) => cmd.arg("--manifests").arg(dir),
        };
        cmd.arg("--cgroup")
            .arg(&self.cgroup)
            .arg("--bpffs")
            .arg(&self.bpffs)
            .args(["--node-name", NODE_NAME, "--node-ip", NODE_IP])
            .arg("--devices")
            .arg(&self.device)
            .arg("--health-addr")
            .arg(format!("127.0.0.1:{}", self.health))
            .arg("--metrics-addr")
            .arg(format!("127.0.0.1:{metrics}"))
            .arg("--max-services")
            .arg(capacity.0.to_string())
            .arg("--max-backends")
            .arg(capacity.1.to_string())
            .env("RUST_LOG", log_level)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        let child = cmd
            .spawn()
            .map_err(|e| format!("spawning {}: {e}", bin("ferry").display()))?;
        let pid = child.id() as i32;
        if let Some(a) = ACTIVE.lock().unwrap().iter_mut().find(|a| a.id == self.id) {
            a.agent = Some(pid);
        }
        self.agent = Some(child);
        Ok(())
    }

    /// The agent's pid (below a FERRY_BENCH_WRAPPER, the first descendant named ferry).
    fn pid(&self) -> i32 {
        let top = self.agent.as_ref().map(|c| c.id() as i32).unwrap_or(0);
        let mut queue = vec![top];
        while let Some(p) = queue.pop() {
            if fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "ferry") {
                return p;
            }
            if let Ok(tasks) = fs::read_dir(format!("/proc/{p}/task")) {
                for t in tasks.flatten() {
                    let kids = fs::read_to_string(t.path().join("children")).unwrap_or_default();
                    queue.extend(
                        kids.split_whitespace()
                            .filter_map(|k| k.parse::<i32>().ok()),
                    );
                }
            }
        }
        top
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.agent
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn stop_agent(&mut self) {
        let real = self.pid();
        if let Some(mut c) = self.agent.take() {
            let top = c.id() as i32;
            // SAFETY: signalling the agent this benchmark started.
            unsafe { libc::kill(real, libc::SIGTERM) };
            let mut wait = Duration::from_secs(10);
            if real != top {
                // Under a wrapper: the agent may have SIGTERM blocked (perf's workload
                // has), so make sure it ends, then let the wrapper write its data.
                let deadline = Instant::now() + Duration::from_secs(5);
                while alive(real) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                if alive(real) {
                    // SAFETY: as above.
                    unsafe { libc::kill(real, libc::SIGKILL) };
                }
                wait = Duration::from_secs(120);
            }
            let deadline = Instant::now() + wait;
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(a) = ACTIVE.lock().unwrap().iter_mut().find(|a| a.id == self.id) {
            a.agent = None;
        }
    }

    fn services_map(&self) -> Result<BpfHashMap<MapData, ServiceKey, ServiceValue>, String> {
        let layout = std::env::var("FERRY_LAYOUT_VERSION")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(LAYOUT_VERSION);
        let path = self.bpffs.join(format!("v{layout}")).join(SERVICES_MAP);
        let data = MapData::from_pin(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        BpfHashMap::try_from(Map::HashMap(data)).map_err(|e| format!("{}: {e}", path.display()))
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let real = self.pid();
        if let Some(mut c) = self.agent.take() {
            // SAFETY: the agent this benchmark started (below a wrapper, if any).
            unsafe { libc::kill(real, libc::SIGKILL) };
            let _ = c.kill();
            let _ = c.wait();
        }
        teardown(None, &self.bpffs, &self.cgroup, &self.device);
        ACTIVE
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|a| a.id != self.id);
    }
}

/// True while `pid` exists and is not a zombie.
fn alive(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rfind(')')
                .and_then(|i| s.get(i + 2..i + 3))
                .map(|st| st != "Z")
        })
        .unwrap_or(false)
}

fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("finding a free port: {e}"))?;
    l.local_addr().map(|a| a.port()).map_err(|e| e.to_string())
}

/// `GET path` on 127.0.0.1:port; the status code.
fn http_status(port: u16, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(500),
    )
    .ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .ok()?;
    let mut head = [0u8; 16];
    let mut n = 0;
    while n < 12 {
        match s.read(&mut head[n..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    std::str::from_utf8(&head[..n])
        .ok()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

// ---------------------------------------------------------------------------------------
// /proc

/// A `kB` field of /proc/PID/status.
fn proc_status_kib(pid: i32, field: &str) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

/// (user, system) CPU seconds of a process or thread stat file.
fn cpu_seconds(stat_path: &str) -> Option<(f64, f64)> {
    let s = fs::read_to_string(stat_path).ok()?;
    // Fields after the command (which may hold spaces) start after the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state): utime is field 14, stime field 15.
    let ut: f64 = f.get(11)?.parse().ok()?;
    let st: f64 = f.get(12)?.parse().ok()?;
    let hz = clock_ticks();
    Some((ut / hz, st / hz))
}

/// CPU seconds of this process' fake-API threads (its runtime threads are named).
fn fakeapi_cpu_seconds() -> f64 {
    let Ok(tasks) = fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    tasks
        .flatten()
        .filter(|t| {
            fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.trim().starts_with("ferry-fakeapi"))
        })
        .filter_map(|t| cpu_seconds(&t.path().join("stat").to_string_lossy()))
        .map(|(u, s)| u + s)
        .sum()
}

// ---------------------------------------------------------------------------------------
// The agent's log

/// `2026-03-28T10:11:12.123456Z` -> microseconds since the epoch.
fn parse_ts(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[10] != b'T' {
        return None;
    }
    let n = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, m, d) = (n(0..4)?, n(5..7)?, n(8..10)?);
    let (hh, mm, ss) = (n(11..13)?, n(14..16)?, n(17..19)?);
    let mut micros = 0i64;
    if b.get(19) == Some(&b'.') {
        let frac: String = s[20..].chars().take_while(char::is_ascii_digit).collect();
        let digits = frac.len().min(6);
        micros = frac[..digits].parse::<i64>().ok()? * 10i64.pow(6 - digits as u32);
    }
    // Days from civil (Howard Hinnant).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 86_400 + hh * 3600 + mm * 60 + ss) * 1_000_000) + micros)
}

fn field_u64(line: &str, name: &str) -> Option<u64> {
    let pat = format!("{name}=");
    let i = line.find(&pat)? + pat.len();
    line[i..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .ok()
}

/// Milliseconds from `t0_us` (wall clock at spawn) to the first log line containing
/// `needle`.
fn phase_ms(log: &str, t0_us: i64, needle: &str) -> Option<f64> {
    log.lines()
        .find(|l| l.contains(needle))
        .and_then(|l| parse_ts(l.split_whitespace().next()?))
        .map(|t| (t - t0_us) as f64 / 1000.0)
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------
// The fake API server's side

fn node_object() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE_NAME, "labels": {"kubernetes.io/hostname": NODE_NAME}},
        "status": {"addresses": [{"type": "InternalIP", "address": NODE_IP}]},
    })
}

/// Times a full paginated list (500 a page, the agent's selector) straight from the fake
/// API server: (milliseconds, bytes, pages).
fn time_list(addr: SocketAddr, path: &str) -> Result<(f64, usize, usize), String> {
    let selector =
        "%21service.kubernetes.io%2Fservice-proxy-name%2C%21service.kubernetes.io%2Fheadless";
    let t = Instant::now();
    let mut token = String::new();
    let (mut bytes, mut pages) = (0, 0);
    loop {
        let mut url = format!("{path}?labelSelector={selector}&limit=500");
        if !token.is_empty() {
            url.push_str(&format!("&continue={token}"));
        }
        let mut s = TcpStream::connect(addr).map_err(|e| format!("{addr}: {e}"))?;
        s.write_all(
            format!("GET {url} HTTP/1.1\r\nHost: {addr}\r\nAccept: application/json\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .map_err(|e| e.to_string())?;
        let mut resp = Vec::new();
        s.read_to_end(&mut resp).map_err(|e| e.to_string())?;
        let split = resp
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or("no HTTP header end")?;
        let head = String::from_utf8_lossy(&resp[..split]);
        if !head.starts_with("HTTP/1.1 200") {
            return Err(format!("GET {url}: {}", head.lines().next().unwrap_or("")));
        }
        let body = &resp[split + 4..];
        bytes += body.len();
        pages += 1;
        // The list metadata comes first; no need to parse the items to page on.
        let head = String::from_utf8_lossy(&body[..body.len().min(512)]);
        token = head
            .split_once("\"continue\":\"")
            .and_then(|(_, rest)| rest.split_once('"'))
            .map(|(t, _)| t.to_string())
            .unwrap_or_default();
        if token.is_empty() {
            break;
        }
    }
    Ok((t.elapsed().as_secs_f64() * 1000.0, bytes, pages))
}

// ---------------------------------------------------------------------------------------
// The benchmark

fn cluster_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 0)) + 10 + i as u32)
}

fn slot0_key(ip: Ipv4Addr) -> ServiceKey {
    ServiceKey {
        addr: addr_from_v4_be(u32::from(ip).to_be()),
        port: 80u16.to_be(),
        slot: 0,
        proto: PROTO_TCP,
        scope: SCOPE_LOCAL_ORIGIN,
        _pad: [0; 2],
    }
}

struct Sync {
    /// Spawn to /healthz 200.
    healthz_ms: f64,
    json: Value,
}

/// Starts the agent and waits for /healthz 200, sampling its RSS meanwhile.
fn full_sync(env: &mut Env, source: Source<'_>, args: &Args, scale: Scale) -> Result<Sync, String> {
    let fake_cpu0 = fakeapi_cpu_seconds();
    let t0_wall = now_us();
    let t0 = Instant::now();
    env.spawn_agent(source, scale.capacity(), &args.log_level)?;
    let mut rss_samples: Vec<(f64, u64)> = Vec::new();
    let healthz = loop {
        let pid = env.pid();
        if let Some(st) = env.exited() {
            return Err(format!(
                "the agent exited ({st}) before /healthz answered 200; its log:\n{}",
                env.log_text()
            ));
        }
        if let Some(kib) = proc_status_kib(pid, "VmRSS") {
            rss_samples.push((t0.elapsed().as_secs_f64() * 1000.0, kib));
        }
        if http_status(env.health, "/healthz") == Some(200) {
            break t0.elapsed();
        }
        if t0.elapsed() > SYNC_TIMEOUT {
            return Err(format!(
                "/healthz not 200 within {SYNC_TIMEOUT:?}; the agent's log:\n{}",
                env.log_text()
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let healthz_ms = healthz.as_secs_f64() * 1000.0;
    let pid = env.pid();
    // The real agent (below a wrapper, if any), for the Ctrl-C teardown.
    if let Some(a) = ACTIVE.lock().unwrap().iter_mut().find(|a| a.id == env.id) {
        a.agent = Some(pid);
    }
    let cpu = cpu_seconds(&format!("/proc/{pid}/stat")).unwrap_or((0.0, 0.0));
    let fake_cpu = fakeapi_cpu_seconds() - fake_cpu0;
    let hwm = proc_status_kib(pid, "VmHWM").unwrap_or(0);
    let rss = proc_status_kib(pid, "VmRSS").unwrap_or(0);
    // The log line may trail the health answer by a moment.
    let mut log = env.log_text();
    for _ in 0..100 {
        if log.contains("ready: first full sync") {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        log = env.log_text();
    }
    let ready_line = log.lines().find(|l| l.contains("ready: first full sync"));
    let sync_elapsed_ms = ready_line.and_then(|l| field_u64(l, "elapsed_ms"));
    let phases = json!({
        "api_client_ms": phase_ms(&log, t0_wall, "Kubernetes API server"),
        "listed_services_ms": phase_ms(&log, t0_wall, "listed Services"),
        "listed_slices_ms": phase_ms(&log, t0_wall, "listed EndpointSlices"),
        "programs_loaded_ms": phase_ms(&log, t0_wall, "attached program="),
        "attached_ms": phase_ms(&log, t0_wall, " node node="),
        "ready_logged_ms": phase_ms(&log, t0_wall, "ready: first full sync"),
    });
    // Every entry must be there: S frontends + S x E slots.
    let entries = env.services_map()?.keys().filter(Result::is_ok).count();
    let expected = scale.services * (1 + scale.endpoints);
    if entries != expected {
        return Err(format!(
            "the service map holds {entries} entries after the sync, expected {expected}; log:\n{log}"
        ));
    }
    // RSS at each phase boundary (last sample before it).
    let rss_at = |ms: Option<f64>| {
        ms.and_then(|ms| {
            rss_samples
                .iter()
                .take_while(|(t, _)| *t <= ms)
                .last()
                .map(|(_, k)| *k)
        })
    };
    let rss_phases = json!({
        "at_listed_services_kib": rss_at(phases["listed_services_ms"].as_f64()),
        "at_listed_slices_kib": rss_at(phases["listed_slices_ms"].as_f64()),
        "max_sampled_kib": rss_samples.iter().map(|(_, k)| *k).max(),
        // (ms since spawn, KiB), about every 25 ms.
        "series": rss_samples
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 5 == 0 || *i + 1 == rss_samples.len())
            .map(|(_, (t, k))| json!([(t * 10.0).round() / 10.0, k]))
            .collect::<Vec<_>>(),
    });
    Ok(Sync {
        healthz_ms,
        json: json!({
            "healthz_ms": healthz_ms,
            "agent_sync_elapsed_ms": sync_elapsed_ms,
            "phases": phases,
            "agent_cpu_user_s": cpu.0,
            "agent_cpu_sys_s": cpu.1,
            "fakeapi_cpu_s": fake_cpu,
            "vm_hwm_kib": hwm,
            "vm_rss_kib": rss,
            "rss": rss_phases,
            "service_map_entries": entries,
        }),
    })
}

struct Changes {
    /// Milliseconds, in change order.
    latencies_ms: Vec<f64>,
    adds_ms: Vec<f64>,
    removes_ms: Vec<f64>,
    /// From the apply to the change arriving on a watch of our own (the API server's
    /// share: store, watch stream, loopback).
    delivery_ms: Vec<f64>,
    lost: usize,
}

/// Change `i` to a slice: even ones add an endpoint, odd ones remove one (or add, on an
/// empty slice). Returns (added, the new endpoint count).
fn edit_endpoints(slice: &mut Value, i: usize) -> Result<(bool, u16), String> {
    let eps = slice["endpoints"]
        .as_array_mut()
        .ok_or("slice without endpoints")?;
    let add = i.is_multiple_of(2) || eps.is_empty();
    if add {
        let ip = Ipv4Addr::new(10, 200, (i / 250) as u8, (i % 250) as u8 + 1);
        eps.push(json!({
            "addresses": [ip.to_string()],
            "conditions": {"ready": true, "serving": true, "terminating": false},
        }));
    } else {
        eps.pop();
    }
    Ok((add, eps.len() as u16))
}

/// `n` single-endpoint changes, each on another Service: even ones add an endpoint, odd
/// ones remove one.
fn changes(env: &Env, api: &FakeApi, scale: Scale, n: usize) -> Result<Changes, String> {
    let map = env.services_map()?;
    let probe = WatchProbe::start(api)?;
    // Timer slack down to 1 µs so the ~20 µs polling sleeps stay short.
    // SAFETY: prctl on this thread only.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000u64, 0u64, 0u64, 0u64) };
    let mut out = Changes {
        latencies_ms: Vec::new(),
        adds_ms: Vec::new(),
        removes_ms: Vec::new(),
        delivery_ms: Vec::new(),
        lost: 0,
    };
    for i in 0..n {
        // A different Service each time (7919 is prime, so distinct for i < services).
        let k = (i * 7919 + 13) % scale.services;
        let key = slot0_key(cluster_ip(k));
        let before = map
            .get(&key, 0)
            .map_err(|e| format!("svc-{k} ({}) not in the map: {e}", cluster_ip(k)))?;
        let name = format!("svc-{k}-0");
        let mut slice = api
            .get(Kind::EndpointSlice, "default", &name)
            .ok_or_else(|| format!("EndpointSlice {name} missing"))?;
        let (add, want) = edit_endpoints(&mut slice, i)?;
        if want == before.count {
            return Err(format!("svc-{k}: change would not alter the count"));
        }
        let t = Instant::now();
        api.apply(slice);
        let seen = loop {
            match map.get(&key, 0) {
                Ok(v) if v.count == want => break Some(t.elapsed()),
                _ => {}
            }
            if t.elapsed() > CHANGE_TIMEOUT {
                break None;
            }
            std::thread::sleep(Duration::from_micros(20));
        };
        match seen {
            Some(d) => {
                let ms = d.as_secs_f64() * 1000.0;
                out.latencies_ms.push(ms);
                if let Some(at) = probe.arrival(&name, Duration::from_millis(500)) {
                    out.delivery_ms
                        .push(at.saturating_duration_since(t).as_secs_f64() * 1000.0);
                }
                if add {
                    out.adds_ms.push(ms);
                } else {
                    out.removes_ms.push(ms);
                }
            }
            None => out.lost += 1,
        }
        std::thread::sleep(CHANGE_GAP);
    }
    Ok(out)
}

/// A watch on EndpointSlices of our own, next to the agent's: when each slice's change
/// arrives from the API server.
struct WatchProbe {
    seen: std::sync::Arc<Mutex<std::collections::HashMap<String, Instant>>>,
    stream: TcpStream,
}

impl WatchProbe {
    fn start(api: &FakeApi) -> Result<WatchProbe, String> {
        let addr = api.addr();
        let rv = api.resource_version();
        let mut s = TcpStream::connect(addr).map_err(|e| format!("watch probe: {e}"))?;
        s.set_nodelay(true).ok();
        s.write_all(
            format!(
                "GET /apis/discovery.k8s.io/v1/endpointslices?watch=1&resourceVersion={rv} HTTP/1.1\r\nHost: {addr}\r\n\r\n"
            )
            .as_bytes(),
        )
        .map_err(|e| format!("watch probe: {e}"))?;
        let seen: std::sync::Arc<Mutex<std::collections::HashMap<String, Instant>>> =
            Default::default();
        let (mut rd, map) = (s.try_clone().map_err(|e| e.to_string())?, seen.clone());
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 65536];
            loop {
                let n = match rd.read(&mut chunk) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                let at = Instant::now();
                buf.extend_from_slice(&chunk[..n]);
                // Events are whole JSON lines; chunk-size lines in between are skipped.
                while let Some(i) = buf.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=i).collect();
                    if !line.starts_with(b"{") {
                        continue;
                    }
                    if let Ok(ev) = serde_json::from_slice::<Value>(&line)
                        && let Some(name) = ev["object"]["metadata"]["name"].as_str()
                    {
                        map.lock().unwrap().insert(name.to_string(), at);
                    }
                }
            }
        });
        Ok(WatchProbe { seen, stream: s })
    }

    /// When the last change of slice `name` arrived (waiting up to `within`); forgets it.
    fn arrival(&self, name: &str, within: Duration) -> Option<Instant> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(at) = self.seen.lock().unwrap().remove(name) {
                return Some(at);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for WatchProbe {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

fn dist(v: &[f64]) -> Value {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    json!({
        "n": s.len(),
        "min_ms": s.first(),
        "p50_ms": percentile(&s, 50.0),
        "p90_ms": percentile(&s, 90.0),
        "p99_ms": percentile(&s, 99.0),
        "max_ms": s.last(),
        "mean_ms": if s.is_empty() { f64::NAN } else { s.iter().sum::<f64>() / s.len() as f64 },
    })
}

fn run_scale(args: &Args, scale: Scale, workdir: &Path) -> Result<Value, String> {
    let label = scale.label();
    eprintln!(
        "== {label}: {} Services x {} endpoints",
        scale.services, scale.endpoints
    );
    let api = FakeApi::start();
    let t = Instant::now();
    let mut objs = generate(scale.services, scale.endpoints);
    objs.push(node_object());
    api.apply_all(objs)?;
    let load_ms = t.elapsed().as_secs_f64() * 1000.0;
    let kubeconfig = workdir.join(format!("kubeconfig-{label}"));
    api.write_kubeconfig(&kubeconfig)
        .map_err(|e| format!("{}: {e}", kubeconfig.display()))?;

    // The fake API server alone: how long serving the two lists takes.
    let mut svc_list = Vec::new();
    let mut slice_list = Vec::new();
    let (mut svc_bytes, mut slice_bytes, mut svc_pages, mut slice_pages) = (0, 0, 0, 0);
    for _ in 0..3 {
        let (ms, b, p) = time_list(api.addr(), "/api/v1/services")?;
        svc_list.push(ms);
        (svc_bytes, svc_pages) = (b, p);
        let (ms, b, p) = time_list(api.addr(), "/apis/discovery.k8s.io/v1/endpointslices")?;
        slice_list.push(ms);
        (slice_bytes, slice_pages) = (b, p);
    }
    eprintln!(
        "   fake API: loaded in {load_ms:.0} ms; lists {:.0} ms (services, {svc_pages} pages, {} KiB) + {:.0} ms (slices, {slice_pages} pages, {} KiB)",
        median(&svc_list),
        svc_bytes / 1024,
        median(&slice_list),
        slice_bytes / 1024
    );

    let mut runs = Vec::new();
    let mut healthz = Vec::new();
    let mut agent_sync = Vec::new();
    let mut hwm_after_sync = Vec::new();
    let mut change_result = None;
    let mut final_hwm = 0;
    for r in 0..args.runs {
        let log = args
            .out
            .join("control-plane-logs")
            .join(format!("{label}-run{}.log", r + 1));
        let mut env = Env::new(&format!("{label}-{}", r + 1), log)?;
        let s = full_sync(&mut env, Source::Kube(&kubeconfig), args, scale)?;
        eprintln!(
            "   run {}: /healthz 200 after {:.0} ms (agent sync {} ms), VmHWM {} MiB",
            r + 1,
            s.healthz_ms,
            s.json["agent_sync_elapsed_ms"],
            s.json["vm_hwm_kib"].as_u64().unwrap_or(0) / 1024
        );
        healthz.push(s.healthz_ms);
        if let Some(ms) = s.json["agent_sync_elapsed_ms"].as_f64() {
            agent_sync.push(ms);
        }
        hwm_after_sync.push(s.json["vm_hwm_kib"].as_u64().unwrap_or(0) as f64);
        let mut run = s.json;
        if r + 1 == args.runs && args.changes > 0 {
            // Let the post-sync housekeeping (first counters tick) pass.
            std::thread::sleep(Duration::from_millis(1500));
            let log_before = env.log_text().lines().count();
            let c = changes(&env, &api, scale, args.changes)?;
            std::thread::sleep(Duration::from_millis(100));
            let log = env.log_text();
            // The agent's own duration of each of those syncs ("synced ... elapsed_us").
            let sync_us: Vec<f64> = log
                .lines()
                .skip(log_before)
                .filter(|l| l.contains(" synced "))
                .filter_map(|l| field_u64(l, "elapsed_us"))
                .map(|us| us as f64 / 1000.0)
                .collect();
            final_hwm = proc_status_kib(env.pid(), "VmHWM").unwrap_or(0);
            let mut sorted = c.latencies_ms.clone();
            sorted.sort_by(|a, b| a.total_cmp(b));
            eprintln!(
                "   {} changes: p50 {:.2} ms, p90 {:.2} ms, max {:.2} ms ({} lost); agent sync p50 {:.2} ms; API watch delivery p50 {:.2} ms",
                c.latencies_ms.len(),
                percentile(&sorted, 50.0),
                percentile(&sorted, 90.0),
                sorted.last().copied().unwrap_or(f64::NAN),
                c.lost,
                median(&sync_us),
                median(&c.delivery_ms)
            );
            change_result = Some(json!({
                "all": dist(&c.latencies_ms),
                "adds": dist(&c.adds_ms),
                "removes": dist(&c.removes_ms),
                "lost": c.lost,
                "samples_ms": c.latencies_ms,
                "agent_sync_ms": dist(&sync_us),
                "watch_delivery_ms": dist(&c.delivery_ms),
                "vm_hwm_kib_after": final_hwm,
            }));
            run["vm_hwm_kib_end"] = json!(final_hwm);
        } else {
            final_hwm = final_hwm.max(run["vm_hwm_kib"].as_u64().unwrap_or(0));
        }
        env.stop_agent();
        runs.push(run);
        drop(env);
    }
    let (lo, hi) = min_max(&healthz);
    let peak_hwm = hwm_after_sync
        .iter()
        .copied()
        .fold(final_hwm as f64, f64::max) as u64;
    drop(api);
    let manifests = if args.manifest_files > 0 {
        Some(run_manifests(args, scale, workdir)?)
    } else {
        None
    };
    Ok(json!({
        "scale": label,
        "services": scale.services,
        "endpoints_per_service": scale.endpoints,
        "fakeapi": {
            "load_ms": load_ms,
            "list_services_ms": median(&svc_list),
            "list_services_bytes": svc_bytes,
            "list_services_pages": svc_pages,
            "list_slices_ms": median(&slice_list),
            "list_slices_bytes": slice_bytes,
            "list_slices_pages": slice_pages,
        },
        "full_sync": {
            "healthz_ms": {"median": median(&healthz), "min": lo, "max": hi, "runs": healthz},
            "agent_sync_elapsed_ms": {"median": median(&agent_sync), "runs": agent_sync},
        },
        "changes": change_result,
        "peak_rss_kib": peak_hwm,
        "runs": runs,
        "manifests": manifests,
    }))
}

// ---------------------------------------------------------------------------------------
// The manifests source at the same scale

/// The scale's objects spread over `files` JSON files (`kind: List`, Services in order,
/// each followed by its slice), kept in memory so that one file can be rewritten.
struct ManifestFiles {
    dir: PathBuf,
    items: Vec<Vec<Value>>,
    /// Service i -> (file, index of its EndpointSlice in that file's items).
    slice_at: Vec<(usize, usize)>,
}

impl ManifestFiles {
    fn write_all(dir: &Path, scale: Scale, files: usize) -> Result<ManifestFiles, String> {
        let _ = fs::remove_dir_all(dir);
        fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let files = files.clamp(1, scale.services.max(1));
        let mut m = ManifestFiles {
            dir: dir.to_path_buf(),
            items: vec![Vec::new(); files],
            slice_at: Vec::with_capacity(scale.services),
        };
        // generate() yields each Service followed by its one slice.
        for (n, obj) in generate(scale.services, scale.endpoints)
            .into_iter()
            .enumerate()
        {
            let i = n / 2;
            let f = i * files / scale.services;
            if n % 2 == 1 {
                m.slice_at.push((f, m.items[f].len()));
            }
            m.items[f].push(obj);
        }
        for f in 0..files {
            m.write(f)?;
        }
        Ok(m)
    }

    fn name(f: usize) -> String {
        format!("services-{f:04}.json")
    }

    /// Rewrites file `f` atomically (a hidden temporary file, then a rename), as
    /// `kubectl`-driven tooling or a ConfigMap volume would.
    fn write(&self, f: usize) -> Result<(), String> {
        let doc = json!({"apiVersion": "v1", "kind": "List", "items": self.items[f]});
        let tmp = self.dir.join(format!(".{}.tmp", Self::name(f)));
        let path = self.dir.join(Self::name(f));
        fs::write(&tmp, serde_json::to_vec(&doc).map_err(|e| e.to_string())?)
            .map_err(|e| format!("{}: {e}", tmp.display()))?;
        fs::rename(&tmp, &path).map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// Like [`changes`], through the manifests: each change rewrites the one file that holds
/// the Service's slice, timed from the write to the new count in the map (the agent's
/// 100 ms poll included). The gaps between changes vary, so the changes land at every
/// phase of the poll.
fn manifest_changes(
    env: &Env,
    files: &mut ManifestFiles,
    scale: Scale,
    n: usize,
) -> Result<Changes, String> {
    let map = env.services_map()?;
    // SAFETY: prctl on this thread only.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000u64, 0u64, 0u64, 0u64) };
    let mut out = Changes {
        latencies_ms: Vec::new(),
        adds_ms: Vec::new(),
        removes_ms: Vec::new(),
        delivery_ms: Vec::new(),
        lost: 0,
    };
    for i in 0..n {
        let k = (i * 7919 + 13) % scale.services;
        let key = slot0_key(cluster_ip(k));
        let before = map
            .get(&key, 0)
            .map_err(|e| format!("svc-{k} ({}) not in the map: {e}", cluster_ip(k)))?;
        let (f, at) = files.slice_at[k];
        let (add, want) = edit_endpoints(&mut files.items[f][at], i)?;
        if want == before.count {
            return Err(format!("svc-{k}: change would not alter the count"));
        }
        let t = Instant::now();
        files.write(f)?;
        let seen = loop {
            match map.get(&key, 0) {
                Ok(v) if v.count == want => break Some(t.elapsed()),
                _ => {}
            }
            if t.elapsed() > MANIFEST_CHANGE_TIMEOUT {
                break None;
            }
            std::thread::sleep(Duration::from_micros(50));
        };
        match seen {
            Some(d) => {
                let ms = d.as_secs_f64() * 1000.0;
                out.latencies_ms.push(ms);
                if add {
                    out.adds_ms.push(ms);
                } else {
                    out.removes_ms.push(ms);
                }
            }
            None => {
                out.lost += 1;
                // Wait for it anyway (bounded), so the next change starts on an idle agent.
                let t = Instant::now();
                while t.elapsed() < MANIFEST_CHANGE_TIMEOUT
                    && map.get(&key, 0).map(|v| v.count).ok() != Some(want)
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        // 50 ms plus a spread over one poll interval (a fixed gap would always land at
        // the same phase of the agent's poll).
        let spread = (i as u64 * 7_919 + 31) % 211;
        std::thread::sleep(CHANGE_GAP + Duration::from_millis(spread));
    }
    Ok(out)
}

/// The manifests scenario of one scale: `--runs` syncs from an empty node, then, on the
/// last run, `--changes` single-file changes.
fn run_manifests(args: &Args, scale: Scale, workdir: &Path) -> Result<Value, String> {
    let label = scale.label();
    eprintln!(
        "   manifests: {} files in {}",
        args.manifest_files,
        workdir.display()
    );
    let dir = workdir.join(format!("manifests-{label}"));
    let t = Instant::now();
    let mut files = ManifestFiles::write_all(&dir, scale, args.manifest_files)?;
    let write_ms = t.elapsed().as_secs_f64() * 1000.0;
    let bytes: u64 = fs::read_dir(&dir)
        .map_err(|e| e.to_string())?
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();
    let mut healthz = Vec::new();
    let mut agent_sync = Vec::new();
    let mut peak = 0u64;
    let mut change_result = None;
    let mut runs = Vec::new();
    for r in 0..args.runs {
        let log = args
            .out
            .join("control-plane-logs")
            .join(format!("{label}-manifests-run{}.log", r + 1));
        let mut env = Env::new(&format!("{label}-m{}", r + 1), log)?;
        let s = full_sync(&mut env, Source::Manifests(&dir), args, scale)?;
        eprintln!(
            "   manifests run {}: /healthz 200 after {:.0} ms (agent sync {} ms), VmHWM {} MiB",
            r + 1,
            s.healthz_ms,
            s.json["agent_sync_elapsed_ms"],
            s.json["vm_hwm_kib"].as_u64().unwrap_or(0) / 1024
        );
        healthz.push(s.healthz_ms);
        if let Some(ms) = s.json["agent_sync_elapsed_ms"].as_f64() {
            agent_sync.push(ms);
        }
        peak = peak.max(s.json["vm_hwm_kib"].as_u64().unwrap_or(0));
        let mut run = s.json;
        if r + 1 == args.runs && args.changes > 0 {
            // The source re-reads files younger than its mtime granularity (2 s) on
            // every poll; measure on settled files, as in steady operation.
            std::thread::sleep(Duration::from_millis(2500));
            let log_before = env.log_text().lines().count();
            let c = manifest_changes(&env, &mut files, scale, args.changes)?;
            std::thread::sleep(Duration::from_millis(100));
            let log = env.log_text();
            let sync_us: Vec<f64> = log
                .lines()
                .skip(log_before)
                .filter(|l| l.contains(" synced "))
                .filter_map(|l| field_u64(l, "elapsed_us"))
                .map(|us| us as f64 / 1000.0)
                .collect();
            let hwm = proc_status_kib(env.pid(), "VmHWM").unwrap_or(0);
            peak = peak.max(hwm);
            let mut sorted = c.latencies_ms.clone();
            sorted.sort_by(|a, b| a.total_cmp(b));
            eprintln!(
                "   manifests: {} changes: p50 {:.1} ms, p95 {:.1} ms, max {:.1} ms ({} lost); agent sync p50 {:.2} ms",
                c.latencies_ms.len(),
                percentile(&sorted, 50.0),
                percentile(&sorted, 95.0),
                sorted.last().copied().unwrap_or(f64::NAN),
                c.lost,
                median(&sync_us),
            );
            let mut all = dist(&c.latencies_ms);
            all["p95_ms"] = json!(percentile(&sorted, 95.0));
            change_result = Some(json!({
                "all": all,
                "lost": c.lost,
                "samples_ms": c.latencies_ms,
                "agent_sync_ms": dist(&sync_us),
                "vm_hwm_kib_after": hwm,
            }));
        }
        env.stop_agent();
        runs.push(run.take());
        drop(env);
    }
    let _ = fs::remove_dir_all(&dir);
    let (lo, hi) = min_max(&healthz);
    Ok(json!({
        "files": args.manifest_files,
        "bytes": bytes,
        "write_ms": write_ms,
        "full_sync": {
            "healthz_ms": {"median": median(&healthz), "min": lo, "max": hi, "runs": healthz},
            "agent_sync_elapsed_ms": {"median": median(&agent_sync), "runs": agent_sync},
        },
        "changes": change_result,
        "peak_rss_kib": peak,
        "runs": runs,
    }))
}

fn fmt_ms(v: &Value) -> String {
    match v.as_f64() {
        Some(x) if x.is_finite() => {
            if x < 10.0 {
                format!("{x:.2}")
            } else {
                format!("{x:.0}")
            }
        }
        _ => "-".into(),
    }
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}

fn report(machine: &Value, results: &[Value], scales: &[Scale], quick: bool) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "machine: Linux {}, {} CPUs ({}), {} MiB RAM\n\n",
        machine["kernel"].as_str().unwrap_or("?"),
        machine["nproc"],
        machine["cpu"].as_str().unwrap_or("?"),
        machine["mem_total_kib"].as_u64().unwrap_or(0) / 1024
    ));
    if quick {
        s.push_str("Quick mode (`--quick`): one run, 20 changes; indicative only.\n\n");
    }
    s.push_str(
        "| scale | full sync to /healthz, median [min-max] ms | agent's own sync ms | change p50 / p90 / max ms | agent peak RSS MiB |\n\
         |---|---|---|---|---|\n",
    );
    for r in results {
        let fs = &r["full_sync"]["healthz_ms"];
        let c = &r["changes"]["all"];
        s.push_str(&format!(
            "| {} | {} [{}-{}] | {} | {} / {} / {} | {:.1} |\n",
            r["scale"].as_str().unwrap_or("?"),
            fmt_ms(&fs["median"]),
            fmt_ms(&fs["min"]),
            fmt_ms(&fs["max"]),
            fmt_ms(&r["full_sync"]["agent_sync_elapsed_ms"]["median"]),
            fmt_ms(&c["p50_ms"]),
            fmt_ms(&c["p90_ms"]),
            fmt_ms(&c["max_ms"]),
            r["peak_rss_kib"].as_u64().unwrap_or(0) as f64 / 1024.0
        ));
    }
    s.push_str(&format!(
        "\ntargets: change p50 < {} ms; full sync and peak RSS per scale: {}\n",
        TARGET_CHANGE_P50.as_millis(),
        TARGETS
            .iter()
            .map(|t| format!(
                "{} services < {} ms, < {} MiB",
                t.0,
                t.1.as_millis(),
                t.2 / 1024
            ))
            .collect::<Vec<_>>()
            .join("; ")
    ));
    for (r, scale) in results.iter().zip(scales) {
        let (target_sync, target_rss) = scale.targets();
        let target_sync_ms = target_sync.as_secs_f64() * 1000.0;
        let sync = r["full_sync"]["healthz_ms"]["median"]
            .as_f64()
            .unwrap_or(f64::INFINITY);
        let p50 = r["changes"]["all"]["p50_ms"]
            .as_f64()
            .unwrap_or(f64::INFINITY);
        let rss = r["peak_rss_kib"].as_u64().unwrap_or(u64::MAX);
        s.push_str(&format!(
            "{}: full sync {} ({:.0} ms, x{:.2} of target); change p50 {} ({:.2} ms); peak RSS {} ({:.1} MiB, x{:.2} of target)\n",
            r["scale"].as_str().unwrap_or("?"),
            verdict(sync < target_sync_ms),
            sync,
            sync / target_sync_ms,
            verdict(p50 < TARGET_CHANGE_P50.as_secs_f64() * 1000.0),
            p50,
            verdict(rss < target_rss),
            rss as f64 / 1024.0,
            rss as f64 / target_rss as f64
        ));
    }
    let manifests: Vec<&Value> = results
        .iter()
        .filter(|r| r["manifests"].is_object())
        .collect();
    if !manifests.is_empty() {
        s.push_str(
            "\nThe same objects through the manifests source (`--manifests DIR`, JSON `kind: List` files, polled every 100 ms):\n\n\
             | scale | files | full sync to /healthz, median [min-max] ms | vs the API source | one changed file to the map p50 / p95 / max ms (lost) | agent sync per change p50 ms | agent peak RSS MiB |\n\
             |---|---|---|---|---|---|---|\n",
        );
        for r in &manifests {
            let m = &r["manifests"];
            let fs = &m["full_sync"]["healthz_ms"];
            let c = &m["changes"]["all"];
            s.push_str(&format!(
                "| {} | {} ({:.1} MiB) | {} [{}-{}] | {:.2}x | {} / {} / {} ({}) | {} | {:.1} |\n",
                r["scale"].as_str().unwrap_or("?"),
                m["files"],
                m["bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
                fmt_ms(&fs["median"]),
                fmt_ms(&fs["min"]),
                fmt_ms(&fs["max"]),
                manifest_sync_ratio(r),
                fmt_ms(&c["p50_ms"]),
                fmt_ms(&c["p95_ms"]),
                fmt_ms(&c["max_ms"]),
                m["changes"]["lost"],
                fmt_ms(&m["changes"]["agent_sync_ms"]["p50_ms"]),
                m["peak_rss_kib"].as_u64().unwrap_or(0) as f64 / 1024.0
            ));
        }
        s.push_str(&format!(
            "\ntargets: one changed file in the map within {} ms (p95, the poll included); program-from-empty within {TARGET_MANIFEST_SYNC_RATIO}x the API source's\n",
            TARGET_MANIFEST_CHANGE.as_millis()
        ));
        for r in &manifests {
            let p95 = r["manifests"]["changes"]["all"]["p95_ms"]
                .as_f64()
                .unwrap_or(f64::INFINITY);
            let lost = r["manifests"]["changes"]["lost"].as_u64().unwrap_or(0);
            let ratio = manifest_sync_ratio(r);
            s.push_str(&format!(
                "{} manifests: one changed file {} ({:.0} ms p95, {lost} lost); full sync {} ({ratio:.2}x the API source)\n",
                r["scale"].as_str().unwrap_or("?"),
                verdict(p95 < TARGET_MANIFEST_CHANGE.as_secs_f64() * 1000.0 && lost == 0),
                p95,
                verdict(ratio <= TARGET_MANIFEST_SYNC_RATIO),
            ));
        }
    }
    s
}

/// Program-from-empty through the manifests over the API source's (medians).
fn manifest_sync_ratio(r: &Value) -> f64 {
    let m = r["manifests"]["full_sync"]["healthz_ms"]["median"]
        .as_f64()
        .unwrap_or(f64::NAN);
    m / r["full_sync"]["healthz_ms"]["median"]
        .as_f64()
        .unwrap_or(f64::NAN)
}

pub(crate) fn main(argv: &[String]) -> ExitCode {
    let args = match parse_args(argv) {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("ferry-bench: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!(
            "ferry-bench: needs root (BPF maps, cgroups): run `sudo cargo xtask bench control-plane`"
        );
        return ExitCode::from(2);
    }
    if !bin("ferry").exists() {
        eprintln!(
            "ferry-bench: {} missing: run `cargo xtask build` first",
            bin("ferry").display()
        );
        return ExitCode::from(2);
    }
    let t0 = Instant::now();
    let workdir = std::env::temp_dir().join(format!("ferry-bench-{}", std::process::id()));
    *WORKDIR.lock().unwrap() = Some(workdir.clone());
    let scratch = WorkDir(workdir.clone());
    let result = (|| -> Result<(Value, Vec<Value>), String> {
        fs::create_dir_all(args.out.join("control-plane-logs"))
            .map_err(|e| format!("{}: {e}", args.out.display()))?;
        fs::create_dir_all(&workdir).map_err(|e| format!("{}: {e}", workdir.display()))?;
        let machine = machine();
        let mut results = Vec::new();
        for scale in &args.scales {
            results.push(run_scale(&args, *scale, &workdir)?);
        }
        Ok((machine, results))
    })();
    drop(scratch);
    match result {
        Ok((machine, results)) => {
            let table = report(&machine, &results, &args.scales, args.quick);
            println!("{table}");
            let doc = json!({
                "benchmark": "control-plane",
                "mode": if args.quick { "quick" } else { "full" },
                "elapsed_s": t0.elapsed().as_secs_f64(),
                "machine": machine,
                "revision": revision(),
                "targets": {
                    "change_p50_ms": TARGET_CHANGE_P50.as_millis() as u64,
                    "per_scale": args.scales.iter().map(|s| {
                        let (sync, rss) = s.targets();
                        json!({
                            "scale": s.label(),
                            "full_sync_ms": sync.as_millis() as u64,
                            "peak_rss_kib": rss,
                        })
                    }).collect::<Vec<_>>(),
                },
                "settings": {
                    "runs": args.runs,
                    "changes": args.changes,
                    "max_services": args.scales.iter().map(|s| s.capacity().0).collect::<Vec<_>>(),
                    "max_backends": args.scales.iter().map(|s| s.capacity().1).collect::<Vec<_>>(),
                    "manifest_files": args.manifest_files,
                    "agent_log_level": args.log_level,
                },
                "results": results,
            });
            if let Some(docs) = &args.docs {
                let flags = argv.join(" ");
                let body = format!(
                    "{}Flags: `{}`.\n\n{table}",
                    crate::report::header(&doc),
                    if flags.is_empty() {
                        "(defaults)"
                    } else {
                        flags.as_str()
                    }
                );
                if let Err(e) = crate::report::update_docs(docs, "control-plane", &body) {
                    eprintln!("ferry-bench: {e}");
                }
            }
            let path = args.out.join("control-plane.json");
            match fs::write(
                &path,
                serde_json::to_string_pretty(&doc).unwrap_or_default(),
            ) {
                Ok(()) => {
                    println!("results: {}", path.display());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("ferry-bench: writing {}: {e}", path.display());
                    ExitCode::FAILURE
                }
            }
        }
        Err(e) => {
            eprintln!("ferry-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scale(services: usize, endpoints: usize) -> Scale {
        Scale {
            services,
            endpoints,
        }
    }

    #[test]
    fn each_issue_scale_has_its_own_targets() {
        assert_eq!(
            scale(10_000, 10).targets(),
            (Duration::from_secs(2), 64 * 1024)
        );
        assert_eq!(
            scale(30_000, 4).targets(),
            (Duration::from_secs(3), 80 * 1024)
        );
        assert_eq!(
            scale(100_000, 4).targets(),
            (Duration::from_secs(8), 200 * 1024)
        );
    }

    #[test]
    fn other_scales_take_the_next_bigger_row() {
        assert_eq!(scale(500, 2).targets().0, Duration::from_secs(2));
        assert_eq!(scale(20_000, 4).targets().0, Duration::from_secs(3));
        assert_eq!(scale(300_000, 1).targets().0, Duration::from_secs(8));
    }

    #[test]
    fn report_judges_each_scale_by_its_target() {
        let row = |label: &str, healthz: f64, rss_mib: u64| {
            json!({
                "scale": label,
                "full_sync": {"healthz_ms": {"median": healthz}},
                "changes": {"all": {"p50_ms": 1.0}},
                "peak_rss_kib": rss_mib * 1024,
            })
        };
        // 2.5 s and 70 MiB miss at 10k but meet the 30k targets.
        let results = [row("10000x10", 2500.0, 70), row("30000x4", 2500.0, 70)];
        let text = report(
            &json!({}),
            &results,
            &[scale(10_000, 10), scale(30_000, 4)],
            false,
        );
        let line = |p: &str| text.lines().find(|l| l.starts_with(p)).unwrap().to_string();
        let (small, big) = (line("10000x10: "), line("30000x4: "));
        assert!(small.contains("full sync MISSED"), "{small}");
        assert!(small.contains("peak RSS MISSED"), "{small}");
        assert!(big.contains("full sync met"), "{big}");
        assert!(big.contains("peak RSS met"), "{big}");
    }
}
