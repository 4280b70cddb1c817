//! The image as a node runs it: `target/image/ferry-<version>.oci.tar` (`cargo xtask
//! image`) imported into a private containerd and run by runc with the DaemonSet's
//! capabilities, mounts, args and env (read from deploy/ferry.yaml), in a node network
//! namespace of the test's own. Real traffic from pods in the node's cgroup reaches a
//! ClusterIP and a NodePort; a container restart keeps an established TCP flow; the
//! health and metrics endpoints answer from the node's side; a connected UDP socket in a
//! pod whose backend left the Service is reset (the agent enters the pod's network
//! namespace, found in the DaemonSet's /run/netns mount). The node carried kube-proxy's
//! rules before the agent started: the agent's takeover, with the image's own iptables
//! and nft and the DaemonSet's capabilities, removes them and nothing else.
//!
//! The containerd daemon is the test's own: its root, state, sockets and config live in
//! a temporary directory, its CRI plugin is off, and it is stopped and the directory
//! removed on drop, also when the test fails. runc's state and the IO fifos go there
//! too (`--runc-root`, `--fifo-dir`). Only the shim's socket cannot be moved: containerd
//! 1.6 puts it under /run/containerd/s/ while a task runs; it is gone with the task, and
//! /run/containerd is removed again when this test created it.

use std::{
    fs,
    io::Read as _,
    path::{Path, PathBuf},
    process::{Child, Command, Output},
    time::{Duration, Instant},
};

use ferry_tests::*;
use serde::Deserialize;
use serde_yaml::Value;

// kube-proxy's rule generators of the benchmark, and the fixture built on them.
#[allow(dead_code)]
#[path = "support/kube_proxy.rs"]
mod kube_proxy;
#[allow(dead_code)]
#[path = "../src/bin/ferry-bench/layouts.rs"]
mod layouts;

const VERSION: &str = env!("CARGO_PKG_VERSION");
const VIP: &str = "10.96.0.10";
const NODE_PORT: u16 = 30080;
const CONTAINER: &str = "ferry-agent";
/// Where the test's manifests directory appears in the container.
const MANIFESTS_IN: &str = "/etc/ferry/manifests";

fn image_ref() -> String {
    format!("ghcr.io/ferry-proj/ferry:{VERSION}")
}

fn archive() -> PathBuf {
    archive_of("ferry")
}

/// `target/image/<binary>-<version>.oci.tar`, as `cargo xtask image` writes it.
fn archive_of(binary: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../target/image/{binary}-{VERSION}.oci.tar"));
    assert!(
        p.exists(),
        "{} is missing: run `cargo xtask image` (or `cargo xtask test`, which builds it)",
        p.display()
    );
    p
}

fn require_runtime() {
    for tool in ["containerd", "ctr", "runc", "containerd-shim-runc-v2"] {
        assert!(
            Command::new("bash")
                .args(["-c", &format!("command -v {tool}")])
                .output()
                .is_ok_and(|o| o.status.success()),
            "{tool} is not installed: run `cargo xtask setup` (Debian packages containerd and runc)"
        );
    }
}

/// The agent container as deploy/ferry.yaml describes it.
struct PodSpec {
    args: Vec<String>,
    caps: Vec<String>,
    /// (volume name, mountPath, readOnly)
    mounts: Vec<(String, String, bool)>,
    read_only_root: bool,
}

fn daemonset() -> PodSpec {
    daemonset_from(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/ferry.yaml"))
}

/// The agent container of the first DaemonSet in the YAML file `path`.
fn daemonset_from(path: &str) -> PodSpec {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let ds = serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).expect("deploy/ferry.yaml is valid YAML"))
        .find(|d| d["kind"].as_str() == Some("DaemonSet"))
        .unwrap_or_else(|| panic!("{path} has no DaemonSet"));
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    let list = |v: &Value| -> Vec<String> {
        v.as_sequence()
            .map(|s| s.iter().map(|x| x.as_str().unwrap().to_string()).collect())
            .unwrap_or_default()
    };
    let sc = &c["securityContext"];
    assert_eq!(
        list(&sc["capabilities"]["drop"]),
        ["ALL"],
        "the test mirrors `drop: [ALL]`"
    );
    // FERRY_CONTAINER_CAPS=BPF,NET_ADMIN,... replaces the DaemonSet's list: how to check
    // that a capability is needed (the agent must then fail, saying which call was denied).
    let caps = match std::env::var("FERRY_CONTAINER_CAPS") {
        Ok(v) => v
            .split(',')
            .filter(|c| !c.is_empty())
            .map(String::from)
            .collect(),
        Err(_) => list(&sc["capabilities"]["add"]),
    };
    PodSpec {
        args: list(&c["args"]),
        caps,
        mounts: c["volumeMounts"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["name"].as_str().unwrap().to_string(),
                    m["mountPath"].as_str().unwrap().to_string(),
                    m["readOnly"].as_bool().unwrap_or(false),
                )
            })
            .collect(),
        read_only_root: sc["readOnlyRootFilesystem"].as_bool().unwrap_or(false),
    }
}

/// Capability numbers (linux/capability.h) of the names the DaemonSet may use.
fn cap_bit(name: &str) -> u32 {
    match name {
        "NET_ADMIN" => 12,
        "NET_RAW" => 13,
        "SYS_PTRACE" => 19,
        "SYS_ADMIN" => 21,
        "SYS_RESOURCE" => 24,
        "PERFMON" => 38,
        "BPF" => 39,
        other => panic!("capability {other} is not known to this test: add its number"),
    }
}

/// containerd's default set for a container (what `drop: [ALL]` removes).
const DEFAULT_CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// A containerd daemon of the test's own.
struct Containerd {
    dir: PathBuf,
    /// /run/containerd did not exist before this daemon ran (remove it when empty).
    created_run_dir: bool,
    sock: PathBuf,
    ns: String,
    daemon: Option<Child>,
}

impl Containerd {
    fn start(name: &str) -> Containerd {
        let dir = std::env::temp_dir().join(format!("ferry-ctr-{name}"));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("containerd dir");
        let sock = dir.join("containerd.sock");
        let config = format!(
            r#"version = 2
root = "{d}/root"
state = "{d}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{s}"
[ttrpc]
  address = "{s}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
"#,
            d = dir.display(),
            s = sock.display()
        );
        fs::write(dir.join("config.toml"), config).expect("containerd config");
        let log = fs::File::create(dir.join("containerd.log")).expect("containerd log");
        let daemon = Command::new("containerd")
            .arg("--config")
            .arg(dir.join("config.toml"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting containerd: {e}"));
        let mut c = Containerd {
            created_run_dir: !Path::new("/run/containerd").exists(),
            ns: format!("ferry-{name}"),
            dir,
            sock,
            daemon: Some(daemon),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = c.daemon.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "the container runtime cannot run here: containerd exited with {status}:\n{}",
                    c.log()
                );
            }
            if c.sock.exists() && c.ctr(&["version"]).status.success() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "containerd did not answer on {} within 20s:\n{}",
                c.sock.display(),
                c.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        c
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }

    fn ctr(&self, args: &[&str]) -> Output {
        Command::new("ctr")
            .arg("--address")
            .arg(&self.sock)
            .args(["--namespace", &self.ns])
            .args(args)
            .output()
            .expect("ctr")
    }

    /// `ctr ARGS`; panics with its output and the agent log when it fails.
    fn ctr_ok(&self, args: &[&str]) -> String {
        let out = self.ctr(args);
        assert!(
            out.status.success(),
            "ctr {} failed: {}{}\ncontainerd log (tail):\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            tail(&self.log(), 30)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The host PID of a running task, or None.
    fn task_pid(&self, id: &str) -> Option<(u32, String)> {
        let out = self.ctr(&["tasks", "ls"]);
        String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 3 && f[0] == id).then(|| (f[1].parse().unwrap_or(0), f[2].to_string()))
        })
    }

    /// Kills (SIGKILL) and deletes every task and container of the namespace.
    fn remove_all(&self) {
        let out = self.ctr(&["containers", "ls", "-q"]);
        for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let _ = self.ctr(&["tasks", "kill", "-s", "SIGKILL", id]);
            let deadline = Instant::now() + Duration::from_secs(5);
            while self.task_pid(id).is_some_and(|(_, s)| s != "STOPPED")
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = self.ctr(&["tasks", "delete", "-f", id]);
            let _ = self.ctr(&["containers", "delete", id]);
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- containerd log (tail) ---\n{}", tail(&self.log(), 40));
        }
        self.remove_all();
        if let Some(mut d) = self.daemon.take() {
            // SAFETY: signalling the daemon this test started.
            unsafe { libc::kill(d.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while d.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = d.kill();
            let _ = d.wait();
        }
        // Shims outlive containerd by design: end those that serve this daemon (by pid).
        for pid in processes_mentioning(&self.sock.to_string_lossy()) {
            // SAFETY: a shim this test's containerd started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        // Snapshot mounts left by a task that could not be deleted.
        if let Ok(mounts) = fs::read_to_string("/proc/self/mounts") {
            let mut mine: Vec<&str> = mounts
                .lines()
                .filter_map(|l| l.split_whitespace().nth(1))
                .filter(|m| Path::new(m).starts_with(&self.dir))
                .collect();
            mine.sort_by_key(|m| std::cmp::Reverse(m.len()));
            for m in mine {
                sh_quiet(&format!("umount -l '{m}'"));
            }
        }
        // runc puts each task in `<hierarchy>/<containerd namespace>/<id>` of every cgroup
        // hierarchy and removes only the task's own directory: the namespace's stays.
        for dir in namespace_cgroups(&self.ns) {
            remove_cgroup_tree(&dir);
        }
        let _ = fs::remove_dir_all(&self.dir);
        if self.created_run_dir {
            for d in ["s", "fifo", "runc", ""] {
                let _ = fs::remove_dir(Path::new("/run/containerd").join(d));
            }
        }
    }
}

/// `<mount>/<ns>` in every cgroup (v1 and v2) hierarchy where it exists.
fn namespace_cgroups(ns: &str) -> Vec<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, mnt, fstype) = (f.next()?, f.next()?, f.next()?);
            matches!(fstype, "cgroup" | "cgroup2").then(|| Path::new(mnt).join(ns))
        })
        .filter(|p| p.is_dir())
        .collect()
}

/// Removes a cgroup directory and the (empty) ones below it, deepest first.
fn remove_cgroup_tree(dir: &Path) {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup_tree(&e.path());
            }
        }
    }
    ferry_tests::remove_cgroup(dir);
}

/// Pids whose command line contains `needle`.
fn processes_mentioning(needle: &str) -> Vec<i32> {
    let Ok(rd) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != std::process::id() as i32)
        .filter(|pid| {
            let mut s = Vec::new();
            fs::File::open(format!("/proc/{pid}/cmdline"))
                .and_then(|mut f| f.read_to_end(&mut s))
                .is_ok()
                && String::from_utf8_lossy(&s).contains(needle)
        })
        .collect()
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Host directories the container sees, and its pins, removed on drop.
struct HostDirs {
    bpffs: PathBuf,
    /// The world's pod namespaces bind-mounted here, as a CNI pins them in /run/netns.
    netns_dir: PathBuf,
    netns_pins: Vec<PathBuf>,
    /// The pod network's host directories (the Gardener-rendered DaemonSet mounts them):
    /// CNI configuration, CNI plugins, ferry's state.
    cni: Option<(PathBuf, PathBuf, PathBuf)>,
}

impl HostDirs {
    fn pin_netns(&mut self, netns: &str) {
        let pin = self.netns_dir.join(netns);
        fs::write(&pin, b"").expect("netns pin file");
        self.netns_pins.push(pin.clone());
        sh(&format!(
            "mount --bind /run/netns/{netns} {}",
            pin.display()
        ));
    }
}

impl Drop for HostDirs {
    fn drop(&mut self) {
        for pin in &self.netns_pins {
            sh_quiet(&format!("umount -l {}", pin.display()));
            let _ = fs::remove_file(pin);
        }
        // The agent pins under <bpffs>/ferry (the DaemonSet's --bpffs=/sys/fs/bpf/ferry).
        sh_quiet(&format!(
            "{} cleanup --bpffs {}",
            bin("ferry").display(),
            self.bpffs.join("ferry").display()
        ));
        let _ = fs::remove_dir_all(&self.bpffs);
        let _ = fs::remove_dir(&self.netns_dir);
    }
}

/// The host's iptables lock file (hostPath type FileOrCreate).
fn xtables_lock() -> PathBuf {
    let p = PathBuf::from("/run/xtables.lock");
    if !p.exists() {
        fs::write(&p, b"").expect("creating /run/xtables.lock");
    }
    p
}

/// Runs the agent container in `w`'s node namespace, as the DaemonSet would.
fn run_agent(ctr: &Containerd, w: &World, spec: &PodSpec, dirs: &HostDirs, log: &Path) {
    let mut args: Vec<String> = vec![
        "run".into(),
        "-d".into(),
        "--log-uri".into(),
        format!("file://{}", log.display()),
        "--runc-root".into(),
        ctr.dir.join("runc").display().to_string(),
        "--fifo-dir".into(),
        ctr.dir.join("fifo").display().to_string(),
        "--with-ns".into(),
        format!("network:/var/run/netns/{}", w.node_ns),
        "--env".into(),
        "NODE_NAME=node1".into(),
        "--env".into(),
        "RUST_LOG=info".into(),
    ];
    if spec.read_only_root {
        args.push("--read-only".into());
    }
    for cap in &spec.caps {
        args.extend(["--cap-add".into(), format!("CAP_{cap}")]);
    }
    for cap in DEFAULT_CAPS {
        if !spec.caps.iter().any(|c| format!("CAP_{c}") == *cap) {
            args.extend(["--cap-drop".into(), cap.to_string()]);
        }
    }
    for (name, path, ro) in &spec.mounts {
        let src = match name.as_str() {
            "bpffs" => dirs.bpffs.clone(),
            "cgroup" => w.cgroup.clone(),
            "netns" => dirs.netns_dir.clone(),
            // The node's own iptables lock, as on a real node.
            "xtables-lock" => xtables_lock(),
            "cni-conf" | "cni-bin" | "ferry-state" => {
                let (conf, bin_dir, state) = dirs.cni.clone().unwrap_or_else(|| {
                    panic!("the DaemonSet mounts {name}: give the test its pod-network dirs")
                });
                match name.as_str() {
                    "cni-conf" => conf,
                    "cni-bin" => bin_dir,
                    _ => state,
                }
            }
            other => {
                panic!("deploy/ferry.yaml mounts volume {other}: teach this test its host side")
            }
        };
        args.extend([
            "--mount".into(),
            format!(
                "type=bind,src={},dst={path},options=rbind:{}",
                src.display(),
                if *ro { "ro" } else { "rw" }
            ),
        ]);
    }
    args.extend([
        "--mount".into(),
        format!(
            "type=bind,src={},dst={MANIFESTS_IN},options=rbind:ro",
            w.manifests.display()
        ),
    ]);
    args.extend([image_ref(), CONTAINER.into(), "/usr/local/bin/ferry".into()]);
    args.extend(spec.args.iter().cloned());
    args.extend(["--manifests".into(), MANIFESTS_IN.into()]);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    ctr.ctr_ok(&argv);
    let ns = w.node_ns.clone();
    eventually(
        "the agent in the container answers /healthz 200",
        Duration::from_secs(40),
        || {
            match ctr.task_pid(CONTAINER) {
                Some((_, s)) if s == "STOPPED" => panic!(
                    "the agent container stopped before it was ready; its log:\n{}",
                    fs::read_to_string(log).unwrap_or_default()
                ),
                None => return Err("no task".into()),
                _ => {}
            }
            match http_get(&ns, 10256, "/healthz")? {
                (200, _) => Ok(()),
                (code, body) => Err(format!("{code} {body}")),
            }
        },
    );
}

/// SIGTERM (as the kubelet stops a pod), then delete the task and the container.
fn stop_agent(ctr: &Containerd, log: &Path) {
    ctr.ctr_ok(&["tasks", "kill", "-s", "SIGTERM", CONTAINER]);
    eventually(
        "the agent container exits on SIGTERM",
        Duration::from_secs(20),
        || match ctr.task_pid(CONTAINER) {
            Some((_, s)) if s == "STOPPED" => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    let out = ctr.ctr_ok(&["tasks", "delete", CONTAINER]);
    ctr.ctr_ok(&["containers", "delete", CONTAINER]);
    let agent_log = fs::read_to_string(log).unwrap_or_default();
    assert!(
        !agent_log.contains("panicked"),
        "the agent panicked ({out}):\n{agent_log}"
    );
}

fn eff_caps(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).expect("task status");
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .expect("CapEff")
        .trim();
    u64::from_str_radix(hex, 16).expect("CapEff hex")
}

fn enable_forwarding(w: &World) {
    sh(&format!(
        "ip netns exec {0} sysctl -qw net.ipv4.ip_forward=1",
        w.node_ns
    ));
}

/// The ClusterIP `web` (80/TCP, 53/UDP) and the NodePort `np`, both over `pods`.
fn write_services(w: &World, pods: &[&str]) {
    let eps: Vec<Ep> = pods.iter().map(|p| ep(w.pod(p).v4)).collect();
    let np = service(
        "np",
        &["10.96.0.30"],
        &[("http", 80, "TCP")],
        "  type: NodePort\n",
    )
    .replace(
        "    port: 80\n",
        &format!("    port: 80\n    nodePort: {NODE_PORT}\n"),
    );
    w.write_manifest(
        "services.yaml",
        &docs(&[
            service(
                "web",
                &[VIP],
                &[("http", 80, "TCP"), ("dns", 53, "UDP")],
                "",
            ),
            slice(
                "web",
                "web-1",
                "IPv4",
                &[("http", 8080, "TCP"), ("dns", 8080, "UDP")],
                &eps,
            ),
            np,
            slice("np", "np-1", "IPv4", &[("http", 8080, "TCP")], &eps),
        ]),
    );
}

fn assert_reaches_all(w: &World, from: &str, addr: &str) {
    let outs = w.probe_from(from, "tcp", addr, 40);
    all_ok(
        &outs,
        &format!("{from} -> {addr} through the agent in the container"),
    );
    assert_eq!(
        backends(&outs),
        all_pods(w),
        "{from} -> {addr}: 40 connects should reach every pod"
    );
}

#[test]
fn image_runs_as_the_daemonset_would() {
    require_kernel();
    require_runtime();
    let archive = archive();
    let spec = daemonset();

    let w = World::new("container", 3, &[8080]);
    enable_forwarding(&w);
    write_services(&w, &["pod1", "pod2", "pod3"]);
    let mut dirs = HostDirs {
        bpffs: w.bpffs.clone(),
        netns_dir: w.workdir.join("netns"),
        netns_pins: Vec::new(),
        cni: None,
    };
    fs::create_dir_all(&dirs.bpffs).expect("bpffs dir");
    fs::create_dir_all(&dirs.netns_dir).expect("netns dir");
    for p in &w.pods {
        dirs.pin_netns(&p.netns);
    }
    let log = w.workdir.join("agent-container.log");
    // Declared last: dropped first (tasks gone before the world's namespaces).
    let ctr = Containerd::start(&w.name);

    let out = ctr.ctr_ok(&["images", "import", &archive.to_string_lossy()]);
    let images = ctr.ctr_ok(&["images", "ls", "-q"]);
    assert!(
        images.lines().any(|l| l == image_ref()),
        "`ctr images import` must name the image {} (from the archive's annotations); it made:\n{images}\n{out}",
        image_ref()
    );

    // The node ran kube-proxy before: its rules are there when the agent starts.
    kube_proxy::load_kube_proxy(&w);
    let kube_proxy_before = kube_proxy::before(&w);

    run_agent(&ctr, &w, &spec, &dirs, &log);
    let (pid, _) = ctr.task_pid(CONTAINER).expect("agent task");
    let want = spec.caps.iter().fold(0u64, |m, c| m | 1 << cap_bit(c));
    assert_eq!(
        eff_caps(pid),
        want,
        "the agent must run with exactly the DaemonSet's capabilities {:?}",
        spec.caps
    );

    // Pods (namespaces in the node's cgroup) reach a ClusterIP and a NodePort.
    let pod = w.pod("pod1").netns.clone();
    assert_reaches_all(&w, &pod, &format!("{VIP}:80"));
    assert_reaches_all(&w, &pod, &format!("{NODE_V4}:{NODE_PORT}"));

    // Health and metrics from the node's side (the container shares its namespace).
    for path in ["/healthz", "/livez"] {
        let (code, body) = http_get(&w.node_ns, 10256, path).expect(path);
        assert_eq!(code, 200, "{path}: {body}");
    }
    let (code, metrics) = http_get(&w.node_ns, 10249, "/metrics").expect("/metrics");
    assert_eq!(code, 200, "/metrics: {metrics}");
    assert!(
        metric_value(&metrics, "ferry_services_programmed", "") >= 2,
        "/metrics should count the 2 Services:\n{metrics}"
    );

    // The takeover ran in the container, with the image's tools.
    eventually(
        "the agent in the container removed kube-proxy's rules",
        Duration::from_secs(30),
        || {
            let l = fs::read_to_string(&log).unwrap_or_default();
            if l.contains("kube-proxy takeover FAILED") {
                panic!("the takeover failed in the container:\n{l}");
            }
            if l.contains("kube-proxy takeover done") {
                Ok(())
            } else {
                Err(tail(&l, 5))
            }
        },
    );
    kube_proxy::assert_only_kube_proxy_removed(&w, &kube_proxy_before);
    let (_, metrics) = http_get(&w.node_ns, 10249, "/metrics").expect("/metrics");
    assert!(
        metrics.contains("ferry_kube_proxy_takeover_failed 0"),
        "/metrics should show the takeover done:\n{metrics}"
    );

    // An established flow survives the container's restart.
    let mut session = Session::start(&pod, Some(&w.cgroup), &format!("{VIP}:80"), None);
    let first = session
        .ask("before", Duration::from_secs(3))
        .expect("session before the restart");
    let backend = first.split_whitespace().next().unwrap().to_string();
    stop_agent(&ctr, &log);
    assert!(
        http_get(&w.node_ns, 10256, "/healthz").is_err(),
        "nothing should answer /healthz while the container is gone"
    );
    let during = session
        .ask("during", Duration::from_secs(3))
        .expect("the session while no agent runs");
    assert_eq!(during, format!("{backend} during"));
    assert_reaches_all(&w, &pod, &format!("{VIP}:80"));

    run_agent(&ctr, &w, &spec, &dirs, &log);
    let after = session
        .ask("after", Duration::from_secs(3))
        .expect("the session after the restart");
    assert_eq!(
        after,
        format!("{backend} after"),
        "the same backend on the same connection"
    );
    assert_reaches_all(&w, &pod, &format!("{VIP}:80"));
    assert_reaches_all(&w, &pod, &format!("{NODE_V4}:{NODE_PORT}"));
    drop(session);

    // Connected UDP in a pod: when its backend leaves the Service, the agent (in its
    // container) enters the pod's namespace and resets the socket.
    let mut udp = UdpClient::start(&pod, &w.cgroup, &format!("{VIP}:53"));
    let first = udp
        .ask("q1", Duration::from_secs(3))
        .expect("connected UDP through the ClusterIP");
    let gone = first.split_whitespace().next().unwrap().to_string();
    let rest: Vec<&str> = ["pod1", "pod2", "pod3"]
        .into_iter()
        .filter(|p| *p != gone)
        .collect();
    write_services(&w, &rest);
    eventually(
        "the agent resets the pod's connected UDP socket",
        Duration::from_secs(5),
        || {
            let l = fs::read_to_string(&log).unwrap_or_default();
            if l.contains("reset connected UDP sockets") {
                Ok(())
            } else {
                Err(tail(&l, 5))
            }
        },
    );
    match udp.ask("q2", Duration::from_secs(2)) {
        Ok(r) if r.starts_with(&format!("{gone} ")) => {
            panic!("the UDP socket still reaches {gone}, which left the Service: {r}")
        }
        _ => {}
    }
    drop(udp);
    stop_agent(&ctr, &log);
}

/// `socat STDIO UDP4:addr` (a connected UDP socket) in `netns` and `cgroup`, line by line.
struct UdpClient {
    child: Child,
    stdin: Option<std::process::ChildStdin>,
    rx: std::sync::mpsc::Receiver<String>,
}

impl UdpClient {
    fn start(netns: &str, cgroup: &Path, addr: &str) -> UdpClient {
        let mut cmd = Command::new("socat");
        cmd.args(["-T", "60", "STDIO", &format!("UDP4:{addr}")])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null());
        let mut child = spawn_in(netns, Some(cgroup), &mut cmd);
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        UdpClient {
            stdin: child.stdin.take(),
            child,
            rx,
        }
    }

    fn ask(&mut self, line: &str, within: Duration) -> Result<String, String> {
        use std::io::Write as _;
        while self.rx.try_recv().is_ok() {}
        let stdin = self.stdin.as_mut().ok_or("closed")?;
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .and_then(|_| stdin.flush())
            .map_err(|e| format!("write: {e}"))?;
        self.rx.recv_timeout(within).map_err(|e| format!("{e}"))
    }
}

impl Drop for UdpClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The DaemonSet the Gardener extension renders for a shoot without kube-proxy
/// (gardener/testdata/ipv4-kube-proxy-disabled.yaml, which ferry-gardener's golden test
/// keeps equal to its output from deploy/ferry.yaml) runs under containerd too, with its
/// pod network: the agent in the container installs the CNI plugin from the image into
/// the host's CNI bin directory, writes the configuration once its Node has pod CIDRs,
/// routes another node's pod CIDR, sets the masquerade table, and a pod wired by the
/// installed plugin reaches the node and a ClusterIP.
#[test]
fn the_gardener_rendered_daemonset_runs_the_pod_network() {
    require_kernel();
    require_runtime();
    let archive = archive();
    let spec = daemonset_from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../gardener/testdata/ipv4-kube-proxy-disabled.yaml"
    ));
    assert!(
        spec.args.iter().any(|a| a == "--pod-network"),
        "{:?}",
        spec.args
    );

    let w = World::new("container-podnet", 1, &[8080]);
    enable_forwarding(&w);
    write_services(&w, &["pod1"]);
    let node = |name: &str, cidr: &str, ip: &str| {
        format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\nspec:\n  podCIDRs: [{cidr}]\nstatus:\n  addresses:\n  - {{type: InternalIP, address: {ip}}}\n"
        )
    };
    w.write_manifest(
        "nodes.yaml",
        &docs(&[
            node("node1", "10.204.1.0/24", &NODE_V4.to_string()),
            node("node2", "10.204.2.0/24", "192.168.50.20"),
        ]),
    );
    let cni_root = w.workdir.join("host-cni");
    let cni = (
        cni_root.join("etc-cni-net.d"),
        cni_root.join("opt-cni-bin"),
        cni_root.join("var-lib-ferry"),
    );
    for d in [&cni.0, &cni.1, &cni.2] {
        fs::create_dir_all(d).unwrap();
    }
    let dirs = HostDirs {
        bpffs: w.bpffs.clone(),
        netns_dir: w.workdir.join("netns"),
        netns_pins: Vec::new(),
        cni: Some(cni.clone()),
    };
    fs::create_dir_all(&dirs.bpffs).expect("bpffs dir");
    fs::create_dir_all(&dirs.netns_dir).expect("netns dir");
    let log = w.workdir.join("agent-container.log");
    let ctr = Containerd::start(&w.name);
    ctr.ctr_ok(&["images", "import", &archive.to_string_lossy()]);
    run_agent(&ctr, &w, &spec, &dirs, &log);

    // The plugin from the image, installed on the host; the configuration for node1.
    let conf = cni.0.join("10-ferry.conflist");
    eventually(
        "the CNI configuration on the host",
        Duration::from_secs(10),
        || {
            if conf.exists() {
                Ok(())
            } else {
                Err(tail(&fs::read_to_string(&log).unwrap_or_default(), 10))
            }
        },
    );
    let list: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&conf).unwrap()).unwrap();
    assert_eq!(
        list["plugins"][0]["podCIDRs"],
        serde_json::json!(["10.204.1.0/24"])
    );
    assert_eq!(list["plugins"][0]["dataDir"], "/var/lib/ferry/cni");
    let plugin = cni.1.join("ferry-cni");
    assert_eq!(
        fs::read(&plugin).expect("ferry-cni installed on the host"),
        fs::read(bin("ferry-cni")).unwrap(),
        "the image's plugin is the one built"
    );
    // The route to node2's pods and the masquerade table, made from inside the container.
    eventually("the route to node2's pods", Duration::from_secs(10), || {
        let r = sh(&format!("ip -n {} route show proto 245", w.node_ns));
        if r.contains("10.204.2.0/24 via 192.168.50.20 dev eth0") {
            Ok(())
        } else {
            Err(r)
        }
    });
    eventually("the masquerade table", Duration::from_secs(10), || {
        let tables = sh(&format!("ip netns exec {} nft list tables", w.node_ns));
        if tables.contains("table ip ferry-podnet") {
            Ok(())
        } else {
            Err(tables)
        }
    });

    // A pod wired by the installed plugin (its store in the host's /var/lib/ferry is the
    // one the configuration names: run here with the host path).
    let pod_ns = format!("{}-cnipod", w.name);
    sh(&format!("ip netns add {pod_ns}"));
    struct DelNs(String);
    impl Drop for DelNs {
        fn drop(&mut self) {
            sh_quiet(&format!("ip netns del {}", self.0));
        }
    }
    let _pod_guard = DelNs(pod_ns.clone());
    let mut conf_obj = list["plugins"][0].clone();
    conf_obj["cniVersion"] = list["cniVersion"].clone();
    conf_obj["name"] = list["name"].clone();
    conf_obj["dataDir"] = serde_json::json!(cni.2.join("cni"));
    let mut child = Command::new("ip")
        .args(["netns", "exec", &w.node_ns])
        .arg(&plugin)
        .env("CNI_COMMAND", "ADD")
        .env("CNI_CONTAINERID", "cnipod")
        .env("CNI_NETNS", format!("/var/run/netns/{pod_ns}"))
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", &cni.1)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(
        &mut child.stdin.take().unwrap(),
        conf_obj.to_string().as_bytes(),
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "CNI ADD: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_reaches_all(&w, &pod_ns, &format!("{VIP}:80"));
    stop_agent(&ctr, &log);
}

/// The Gardener extension controller's image (`cargo xtask image` writes it next to
/// ferry's, named as deploy/gardener/values.yaml says) imports under the name the chart
/// uses and its binary runs in it: all its libraries are there.
#[test]
fn the_controller_image_runs_its_binary() {
    require_runtime();
    let archive = archive_of("gardener-extension-ferry");
    let values = fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/gardener/values.yaml"
    ))
    .unwrap();
    let values: Value = serde_yaml::from_str(&values).unwrap();
    let name = format!(
        "{}:{}",
        values["image"]["repository"].as_str().unwrap(),
        values["image"]["tag"].as_str().unwrap()
    );
    let scratch = std::env::temp_dir().join(format!("ferry-ctl-image-{}", std::process::id()));
    fs::create_dir_all(&scratch).unwrap();
    struct Rm(PathBuf);
    impl Drop for Rm {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }
    let _rm = Rm(scratch.clone());
    let ctr = Containerd::start("ctl-image");
    ctr.ctr_ok(&["images", "import", &archive.to_string_lossy()]);
    let images = ctr.ctr_ok(&["images", "ls", "-q"]);
    assert!(
        images.lines().any(|l| l == name),
        "{name} not imported: {images}"
    );
    let out = ctr.ctr(&[
        "run",
        "--rm",
        "--runc-root",
        &ctr.dir.join("runc").display().to_string(),
        "--fifo-dir",
        &ctr.dir.join("fifo").display().to_string(),
        &name,
        "ctl-help",
        "/usr/local/bin/gardener-extension-ferry",
        "--help",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("--leader-election"),
        "gardener-extension-ferry --help in its image: {:?}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
