//! A "node" network namespace with pod namespaces behind veth pairs, one cgroup v2 child
//! for clients, one bpffs directory and one manifests directory, and the agent.

use std::{
    collections::BTreeSet,
    ffi::{CString, OsStr},
    fs,
    io::{BufRead, BufReader, Read},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpStream},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use serde::Deserialize;

/// One client attempt as printed by `ferry-probe`.
#[derive(Debug, Clone, Deserialize)]
pub struct Outcome {
    pub ok: bool,
    pub reply: Option<String>,
    pub peer: Option<String>,
    pub from: Option<String>,
    pub errno: Option<i32>,
    pub error: Option<String>,
    pub ms: u128,
}

impl Outcome {
    /// The backend's name: first word of the reply.
    pub fn backend(&self) -> Option<&str> {
        self.reply
            .as_deref()
            .and_then(|r| r.split_whitespace().next())
    }
}

/// The backends (first word of each reply) a set of attempts reached.
pub fn backends(outs: &[Outcome]) -> BTreeSet<String> {
    outs.iter()
        .filter_map(|o| o.backend().map(String::from))
        .collect()
}

/// A set of names, for comparing with [`backends`].
pub fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// Every pod of the world, by name.
pub fn all_pods(w: &World) -> BTreeSet<String> {
    w.pods.iter().map(|p| p.name.clone()).collect()
}

pub use ferry_common::LAYOUT_VERSION;

pub const ECONNREFUSED: i32 = 111;
pub const EHOSTUNREACH: i32 = 113;
pub const ENETUNREACH: i32 = 101;

/// The node's own address (on a veth whose peer stays in the node: no dummy driver here): NodePorts are served here.
pub const NODE_V4: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 10);
pub const NODE_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 0x10);

pub fn bin(name: &str) -> PathBuf {
    match name {
        "ferry" => std::env::var_os("FERRY_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/ferry")
            }),
        other => Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../target/release")
            .join(other),
    }
}

/// Runs a shell command; panics with its output when it fails.
pub fn sh(cmd: &str) -> String {
    let out = Command::new("bash")
        .args(["-c", cmd])
        .output()
        .expect("bash");
    assert!(
        out.status.success(),
        "command failed: {cmd}\nstdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a shell command, ignoring its output and status (teardown).
pub fn sh_quiet(cmd: &str) {
    let _ = Command::new("bash")
        .args(["-c", cmd])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Polls `f` until it returns Ok or the deadline passes; panics with the last error.
pub fn eventually<T>(what: &str, within: Duration, mut f: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + within;
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) if Instant::now() >= deadline => {
                panic!("{what}: not true within {within:?}; last: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Fails (never skips) when the machine cannot run kernel tests, saying why.
pub fn require_kernel() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "kernel tests need root (BPF, netns, cgroups): run `sudo cargo xtask test`"
    );
    assert!(
        Path::new("/sys/kernel/btf/vmlinux").exists() || Path::new("/proc/config.gz").exists(),
        "kernel without BTF or config: BPF tests cannot run"
    );
    assert!(
        bin("ferry").exists(),
        "{} missing: run `cargo xtask build` first",
        bin("ferry").display()
    );
    assert!(
        Command::new("ip").arg("-V").output().is_ok(),
        "iproute2 (`ip`) is missing: run `cargo xtask setup`"
    );
    if fs::read_to_string("/proc/mounts")
        .map(|m| !m.lines().any(|l| l.contains(" /sys/fs/bpf bpf ")))
        .unwrap_or(true)
    {
        sh("mount -t bpf bpf /sys/fs/bpf");
    }
    cgroup2_mount();
}

pub fn cgroup2_mount() -> PathBuf {
    let mounts = fs::read_to_string("/proc/self/mounts").expect("/proc/self/mounts");
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && f[2] == "cgroup2").then(|| PathBuf::from(f[1]))
        })
        .next()
        .expect("no cgroup2 filesystem mounted: socket hooks need cgroup v2")
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// Prepared setns/cgroup targets for `pre_exec` (allocation-free in the child).
struct Enter {
    netns: CString,
    procs: Option<CString>,
}

fn enter(netns: &str, cgroup: Option<&Path>) -> Enter {
    Enter {
        netns: CString::new(format!("/run/netns/{netns}")).unwrap(),
        procs: cgroup
            .map(|c| CString::new(c.join("cgroup.procs").as_os_str().as_encoded_bytes()).unwrap()),
    }
}

/// Spawns `cmd` inside network namespace `netns` (only the net namespace: bpffs and
/// cgroup mounts stay visible) and, when given, inside `cgroup`.
pub fn spawn_in(netns: &str, cgroup: Option<&Path>, cmd: &mut Command) -> Child {
    let e = enter(netns, cgroup);
    // SAFETY: the closure only calls async-signal-safe libc functions on buffers
    // prepared before fork.
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(e.netns.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
            if fd < 0 || libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::close(fd);
            if let Some(p) = &e.procs {
                let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(fd);
            }
            Ok(())
        });
    }
    cmd.spawn()
        .unwrap_or_else(|e| panic!("spawning {cmd:?} in {netns}: {e}"))
}

pub struct Pod {
    pub name: String,
    pub netns: String,
    pub v4: Ipv4Addr,
    pub v6: Ipv6Addr,
    server: Option<Child>,
}

pub struct World {
    pub name: String,
    pub node_ns: String,
    pub pods: Vec<Pod>,
    pub cgroup: PathBuf,
    pub bpffs: PathBuf,
    pub manifests: PathBuf,
    pub workdir: PathBuf,
    agent: Option<Child>,
    agent_log: PathBuf,
    agent_runs: u32,
}

impl World {
    /// A node namespace and `pods` pod namespaces, each pod serving `ports` (TCP+UDP).
    pub fn new(test: &str, pods: usize, ports: &[u16]) -> World {
        require_kernel();
        let id = format!(
            "{}{}",
            std::process::id() % 100000,
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let name = format!("fy{id}");
        let workdir = std::env::temp_dir().join(format!("ferry-test-{test}-{id}"));
        let _ = fs::remove_dir_all(&workdir);
        fs::create_dir_all(workdir.join("manifests")).expect("workdir");
        let cgroup = cgroup2_mount().join(format!("ferry-test-{name}"));
        let mut w = World {
            node_ns: format!("{name}-node"),
            pods: Vec::new(),
            cgroup: cgroup.clone(),
            bpffs: PathBuf::from(format!("/sys/fs/bpf/ferry-test-{name}")),
            manifests: workdir.join("manifests"),
            agent_log: workdir.join("agent.log"),
            workdir,
            name,
            agent: None,
            agent_runs: 0,
        };
        sh(&format!("ip netns add {}", w.node_ns));
        sh(&format!(
            "ip -n {0} link set lo up && ip -n {0} link add eth0 type veth peer name eth0peer && ip -n {0} link set eth0 up && ip -n {0} link set eth0peer up && ip -n {0} addr add {NODE_V4}/24 dev eth0 && ip -n {0} addr add {NODE_V6}/64 dev eth0 nodad",
            w.node_ns
        ));
        fs::create_dir_all(&cgroup)
            .unwrap_or_else(|e| panic!("creating cgroup {}: {e}", cgroup.display()));
        for i in 1..=pods {
            w.add_pod(i, ports);
        }
        w
    }

    fn add_pod(&mut self, i: usize, ports: &[u16]) {
        let name = format!("pod{i}");
        let netns = format!("{}-p{i}", self.name);
        let v4 = Ipv4Addr::new(10, 1, i as u8, 2);
        let v6: Ipv6Addr = format!("fd00:1:{i}::2").parse().unwrap();
        sh(&format!("ip netns add {netns}"));
        // Recorded at once, so that a failing setup or server start still removes the
        // namespace (Drop walks `pods`).
        self.pods.push(Pod {
            name: name.clone(),
            netns: netns.clone(),
            v4,
            v6,
            server: None,
        });
        sh(&format!(
            "ip -n {node} link add veth{i} type veth peer name eth0 netns {netns} && \
             ip -n {node} link set veth{i} up && ip -n {node} addr add 10.1.{i}.1/24 dev veth{i} && \
             ip -n {node} addr add fd00:1:{i}::1/64 dev veth{i} nodad && \
             ip -n {netns} link set lo up && ip -n {netns} link set eth0 up && \
             ip -n {netns} addr add {v4}/24 dev eth0 && ip -n {netns} addr add {v6}/64 dev eth0 nodad && \
             ip -n {netns} route add default via 10.1.{i}.1 && ip -n {netns} -6 route add default via fd00:1:{i}::1",
            node = self.node_ns
        ));
        let child = start_testsrv(&netns, &name, ports);
        self.pods.last_mut().expect("the pod pushed above").server = Some(child);
    }

    pub fn pod(&self, name: &str) -> &Pod {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod {name}"))
    }

    pub fn write_manifest(&self, file: &str, content: &str) {
        write_manifest(&self.manifests, file, content);
    }

    pub fn remove_manifest(&self, file: &str) {
        remove_manifest(&self.manifests, file);
    }

    /// Starts the agent in the node namespace and waits until `/healthz` answers 200.
    pub fn start_agent(&mut self, extra: &[&str]) {
        self.start_agent_env(extra, &[]);
    }

    /// [`World::start_agent`] with extra environment variables for the agent.
    pub fn start_agent_env(&mut self, extra: &[&str], env: &[(&str, &str)]) {
        let manifests = self.manifests.clone();
        self.launch_agent(
            [OsStr::new("--manifests"), manifests.as_os_str()],
            extra,
            env,
        );
    }

    /// Starts the agent with `source` flags in the node namespace; waits for `/healthz` 200.
    fn launch_agent(&mut self, source: [&OsStr; 2], extra: &[&str], env: &[(&str, &str)]) {
        assert!(self.agent.is_none(), "agent already running");
        self.agent_runs += 1;
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.agent_log)
            .expect("agent log");
        let mut cmd = Command::new(bin("ferry"));
        cmd.arg("agent")
            .args(source)
            .arg("--cgroup")
            .arg(&self.cgroup)
            .arg("--bpffs")
            .arg(&self.bpffs)
            .args([
                "--node-name",
                "node1",
                "--health-addr",
                "127.0.0.1:10256",
                "--metrics-addr",
                "127.0.0.1:10249",
            ])
            .args(extra)
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        self.agent = Some(spawn_in(&self.node_ns, None, &mut cmd));
        let ns = self.node_ns.clone();
        eventually("agent /healthz 200", Duration::from_secs(30), || {
            if let Some(status) = self.agent.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "agent exited with {status} before it was ready:\n{}",
                    self.agent_log()
                );
            }
            let (code, body) = http_get(&ns, 10256, "/healthz")?;
            if code == 200 {
                Ok(())
            } else {
                Err(format!("{code} {body}"))
            }
        });
    }

    /// Stops the agent with `signal` (SIGTERM, SIGKILL) and waits for it to exit.
    pub fn stop_agent(&mut self, signal: i32) -> std::process::ExitStatus {
        let mut child = self.agent.take().expect("agent not running");
        // SAFETY: sending a signal to our own child.
        unsafe { libc::kill(child.id() as i32, signal) };
        child.wait().expect("wait agent")
    }

    pub fn agent_log(&self) -> String {
        fs::read_to_string(&self.agent_log).unwrap_or_default()
    }

    /// Runs `ferry-probe MODE ADDR COUNT` from the node namespace, inside the cgroup.
    pub fn probe(&self, mode: &str, addr: &str, count: usize) -> Vec<Outcome> {
        self.probe_from(&self.node_ns.clone(), mode, addr, count)
    }

    /// The same from another namespace (a pod), still inside the cgroup.
    pub fn probe_from(&self, netns: &str, mode: &str, addr: &str, count: usize) -> Vec<Outcome> {
        Prober {
            netns: netns.to_string(),
            cgroup: self.cgroup.clone(),
        }
        .probe(mode, addr, count)
    }

    /// A probe handle that does not borrow the world (for a thread that keeps traffic
    /// running while the test restarts or upgrades the agent).
    pub fn prober(&self) -> Prober {
        Prober {
            netns: self.node_ns.clone(),
            cgroup: self.cgroup.clone(),
        }
    }

    /// Runs a real client (curl, socat, ...) in the node namespace inside the cgroup.
    pub fn client(&self, program: &str, args: &[&str]) -> std::process::Output {
        let mut cmd = Command::new(program);
        cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        spawn_in(&self.node_ns, Some(&self.cgroup), &mut cmd)
            .wait_with_output()
            .expect("client")
    }

    /// Starts `ferry-probe tcp-session ADDR` in the cgroup; returns the child with piped stdio.
    pub fn session(&self, addr: &str) -> Child {
        let mut cmd = Command::new(bin("ferry-probe"));
        cmd.args(["tcp-session", addr])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        spawn_in(&self.node_ns, Some(&self.cgroup), &mut cmd)
    }

    /// Where the agent pins its maps: `<bpffs>/v<layout>/` (links stay in `<bpffs>/links`).
    pub fn maps_dir(&self) -> PathBuf {
        let layout =
            std::env::var("FERRY_LAYOUT_VERSION").unwrap_or_else(|_| LAYOUT_VERSION.to_string());
        self.bpffs.join(format!("v{layout}"))
    }

    /// `ferry list -o json` for this world's pins.
    pub fn list_json(&self) -> serde_json::Value {
        let out = Command::new(bin("ferry"))
            .arg("list")
            .arg("--bpffs")
            .arg(&self.bpffs)
            .args(["-o", "json"])
            .output()
            .expect("ferry list");
        assert!(
            out.status.success(),
            "ferry list failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("ferry list json")
    }

    pub fn metrics(&self) -> String {
        http_get(&self.node_ns, 10249, "/metrics")
            .expect("metrics")
            .1
    }

    /// `ferry cleanup` for this world; returns its stdout.
    pub fn cleanup(&self) -> String {
        let out = Command::new(bin("ferry"))
            .arg("cleanup")
            .arg("--bpffs")
            .arg(&self.bpffs)
            .output()
            .expect("ferry cleanup");
        assert!(
            out.status.success(),
            "ferry cleanup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
        for p in &mut self.pods {
            if let Some(mut s) = p.server.take() {
                let _ = s.kill();
                let _ = s.wait();
            }
        }
        sh_quiet(&format!(
            "{} cleanup --bpffs {}",
            bin("ferry").display(),
            self.bpffs.display()
        ));
        remove_cgroup(&self.cgroup);
        for p in &self.pods {
            sh_quiet(&format!("ip netns del {}", p.netns));
        }
        sh_quiet(&format!("ip netns del {}", self.node_ns));
        if std::thread::panicking() {
            eprintln!(
                "--- agent log ({}) ---\n{}",
                self.agent_log.display(),
                self.agent_log()
            );
        }
        let _ = fs::remove_dir_all(&self.workdir);
    }
}

/// Runs `ferry-probe` in one namespace, inside the world's cgroup.
#[derive(Clone, Debug)]
pub struct Prober {
    netns: String,
    cgroup: PathBuf,
}

impl Prober {
    pub fn probe(&self, mode: &str, addr: &str, count: usize) -> Vec<Outcome> {
        let mut cmd = Command::new(bin("ferry-probe"));
        cmd.args([mode, addr, &count.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = spawn_in(&self.netns, Some(&self.cgroup), &mut cmd);
        let out = child.wait_with_output().expect("probe");
        assert!(
            out.status.success(),
            "ferry-probe {mode} {addr} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| {
                serde_json::from_str(l).unwrap_or_else(|e| panic!("bad probe line {l:?}: {e}"))
            })
            .collect()
    }
}

/// What a world made, by name and pid, so a signal handler can remove it when the
/// process is interrupted (Drop does not run on Ctrl-C).
#[derive(Clone, Debug)]
pub struct Teardown {
    pids: Vec<i32>,
    netns: Vec<String>,
    cgroup: PathBuf,
    bpffs: PathBuf,
    workdir: PathBuf,
}

impl Teardown {
    pub fn run(&self) {
        for pid in &self.pids {
            // SAFETY: signalling processes this world started.
            unsafe { libc::kill(*pid, libc::SIGKILL) };
        }
        sh_quiet(&format!(
            "{} cleanup --bpffs {}",
            bin("ferry").display(),
            self.bpffs.display()
        ));
        let _ = fs::remove_dir(&self.cgroup);
        for ns in &self.netns {
            sh_quiet(&format!("ip netns del {ns}"));
        }
        let _ = fs::remove_dir_all(&self.workdir);
    }
}

impl World {
    /// A snapshot of what to remove; take it after the agent started.
    pub fn teardown(&self) -> Teardown {
        let mut pids: Vec<i32> = self
            .pods
            .iter()
            .filter_map(|p| p.server.as_ref().map(|c| c.id() as i32))
            .collect();
        pids.extend(self.agent.as_ref().map(|a| a.id() as i32));
        let mut netns: Vec<String> = self.pods.iter().map(|p| p.netns.clone()).collect();
        netns.push(self.node_ns.clone());
        Teardown {
            pids,
            netns,
            cgroup: self.cgroup.clone(),
            bpffs: self.bpffs.clone(),
            workdir: self.workdir.clone(),
        }
    }
}

/// A plain HTTP GET from inside `netns` (on a helper thread that joins the namespace).
pub fn http_get(netns: &str, port: u16, path: &str) -> Result<(u16, String), String> {
    let ns = format!("/run/netns/{netns}");
    let path = path.to_string();
    std::thread::spawn(move || -> Result<(u16, String), String> {
        let f = fs::File::open(&ns).map_err(|e| format!("{ns}: {e}"))?;
        // SAFETY: setns on this helper thread only; it exits right after.
        if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&f), libc::CLONE_NEWNET) } != 0 {
            return Err(format!("setns {ns}: {}", std::io::Error::last_os_error()));
        }
        let mut s = TcpStream::connect_timeout(
            &(IpAddr::from([127, 0, 0, 1]), port).into(),
            Duration::from_secs(1),
        )
        .map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok();
        std::io::Write::write_all(&mut s, format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
            .map_err(|e| e.to_string())?;
        let mut resp = String::new();
        s.read_to_string(&mut resp).map_err(|e| e.to_string())?;
        let code = resp
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or("no status")?;
        let body = resp
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        Ok((code, body))
    })
    .join()
    .map_err(|_| "http thread panicked".to_string())?
}

/// The Kubernetes API source in a world: a fake API server the agent can reach, and the
/// agent started with `--kubeconfig` instead of `--manifests`.
///
/// The agent runs in the node network namespace, so a fake API server listening on the
/// test process's 127.0.0.1 is out of its reach. [`World::start_fake_api`] therefore
/// creates the server's listening socket *inside* the node namespace: a helper thread
/// `setns()`s into it and calls [`crate::fakeapi::FakeApi::start_with`] there. A socket
/// stays in the namespace it was created in (and so do the connections it accepts),
/// while the returned handle, used from any thread, only touches the in-process store.
/// The server's threads keep a reference on the namespace until the handle is dropped:
/// drop it before the world (declare it after the world, or first in a struct), so that
/// `ip netns del` really frees the namespace.
impl World {
    /// A fake API server on `0.0.0.0:<free port>` of the node namespace: the agent reaches
    /// it on `127.0.0.1:<port>` (see [`World::write_kubeconfig`]), clients and Service
    /// endpoints on [`NODE_V4`]`:<port>`.
    pub fn start_fake_api(&self) -> crate::fakeapi::FakeApi {
        self.start_fake_api_with(crate::fakeapi::Options {
            listen: std::net::SocketAddr::from(([0, 0, 0, 0], 0)),
            ..Default::default()
        })
    }

    /// [`World::start_fake_api`] with explicit options; `opts.listen` is an address of
    /// the node namespace.
    pub fn start_fake_api_with(&self, opts: crate::fakeapi::Options) -> crate::fakeapi::FakeApi {
        let ns = format!("/run/netns/{}", self.node_ns);
        std::thread::spawn(move || {
            let f = fs::File::open(&ns).unwrap_or_else(|e| panic!("{ns}: {e}"));
            let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
            // SAFETY: setns on this helper thread only; it exits once the server started
            // (the server's own threads are spawned from here and stay in the namespace).
            if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } != 0 {
                panic!("setns {ns}: {}", std::io::Error::last_os_error());
            }
            crate::fakeapi::FakeApi::start_with(opts)
                .unwrap_or_else(|e| panic!("starting the fake API server in {ns}: {e}"))
        })
        .join()
        .expect("fake API server thread")
    }

    /// Writes `<workdir>/kubeconfig` pointing at `http://127.0.0.1:<port of api>`, the
    /// address as seen from the node namespace, and returns its path.
    pub fn write_kubeconfig(&self, api: &crate::fakeapi::FakeApi) -> PathBuf {
        let path = self.workdir.join("kubeconfig");
        let url = format!("http://127.0.0.1:{}", api.addr().port());
        fs::write(&path, crate::fakeapi::kubeconfig_yaml(&url)).expect("write kubeconfig");
        path
    }

    /// [`World::start_agent`] with `--kubeconfig PATH` instead of `--manifests`; waits
    /// until `/healthz` answers 200 (the first full sync of the API's objects).
    pub fn start_agent_kube(&mut self, kubeconfig: &Path, extra: &[&str]) {
        self.launch_agent(
            [OsStr::new("--kubeconfig"), kubeconfig.as_os_str()],
            extra,
            &[],
        );
    }
}

/// Removes a test's cgroup: processes a failed test left in it (clients) are killed
/// first, since rmdir needs it empty; their exit is waited for with a deadline.
pub fn remove_cgroup(cgroup: &Path) {
    if let Ok(procs) = fs::read_to_string(cgroup.join("cgroup.procs")) {
        for pid in procs
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            // SAFETY: signalling a process the test put in its own cgroup.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    for _ in 0..100 {
        if fs::remove_dir(cgroup).is_ok() || !cgroup.exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes a manifest file atomically (an agent never reads half a file).
pub fn write_manifest(dir: &Path, file: &str, content: &str) {
    let tmp = dir.join(format!(".{file}.tmp"));
    fs::write(&tmp, content).expect("write manifest");
    fs::rename(&tmp, dir.join(file)).expect("rename manifest");
}

pub fn remove_manifest(dir: &Path, file: &str) {
    fs::remove_file(dir.join(file)).expect("remove manifest");
}

/// `ferry-testsrv NAME PORT...` in `netns` (in no agent cgroup), once it says it is
/// ready; killed here if it does not.
pub fn start_testsrv(netns: &str, name: &str, ports: &[u16]) -> Child {
    let mut cmd = Command::new(bin("ferry-testsrv"));
    cmd.arg(name)
        .args(ports.iter().map(|p| p.to_string()))
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = spawn_in(netns, None, &mut cmd);
    let mut line = String::new();
    let read = BufReader::new(child.stdout.take().unwrap()).read_line(&mut line);
    if read.is_err() || line.trim() != "ready" {
        let _ = child.kill();
        let _ = child.wait();
        panic!("test server {name} in {netns} did not start: {read:?} {line:?}");
    }
    child
}
