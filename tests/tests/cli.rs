//! The command line: configuration errors exit 2 with a message that says what to fix,
//! `ferry list` output, and the agent's HTTP endpoints.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use ferry_tests::*;

/// A scratch directory (and optionally a cgroup) removed on drop.
struct Scratch {
    dir: PathBuf,
    cgroup: Option<PathBuf>,
}

impl Scratch {
    fn new(test: &str) -> Scratch {
        require_kernel();
        let dir =
            std::env::temp_dir().join(format!("ferry-test-cli-{test}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("manifests")).expect("scratch dir");
        Scratch { dir, cgroup: None }
    }

    fn manifests(&self) -> PathBuf {
        self.dir.join("manifests")
    }

    /// A bpffs path no agent uses; asserted to stay absent.
    fn bpffs(&self) -> PathBuf {
        PathBuf::from(format!(
            "/sys/fs/bpf/ferry-test-cli-{}",
            self.dir.file_name().unwrap().to_string_lossy()
        ))
    }

    fn cgroup(&mut self) -> PathBuf {
        let cg = cgroup2_mount().join(format!(
            "ferry-test-cli-{}",
            self.dir.file_name().unwrap().to_string_lossy()
        ));
        fs::create_dir_all(&cg).expect("cgroup");
        self.cgroup = Some(cg.clone());
        cg
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let bpffs = self.bpffs();
        if bpffs.exists() {
            let _ = Command::new(bin("ferry"))
                .arg("cleanup")
                .arg("--bpffs")
                .arg(&bpffs)
                .output();
        }
        if let Some(cg) = &self.cgroup {
            let _ = fs::remove_dir(cg);
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Runs `ferry ARGS` (no in-cluster environment); kills it if it runs past 10 s.
fn ferry(args: &[&Path]) -> Output {
    let mut cmd = Command::new(bin("ferry"));
    cmd.args(args)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn ferry");
    let started = Instant::now();
    while child.try_wait().expect("wait ferry").is_none() {
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "ferry {args:?} still running after 10 s; expected it to exit at once\nstderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("ferry output")
}

fn p(s: &str) -> &Path {
    Path::new(s)
}

/// Asserts exit code `code` and that stderr contains every one of `needles`.
fn assert_exit(out: &Output, code: i32, needles: &[&str], what: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(code),
        "{what}: expected exit code {code}, saw {}; stderr:\n{stderr}",
        out.status
    );
    for n in needles {
        assert!(
            stderr.contains(n),
            "{what}: stderr must mention {n:?}; saw:\n{stderr}"
        );
    }
}

/// The common agent flags that keep a misconfigured agent harmless if it did start.
fn agent_args<'a>(bpffs: &'a Path, extra: &[&'a Path]) -> Vec<&'a Path> {
    let mut a: Vec<&Path> = vec![
        p("agent"),
        p("--bpffs"),
        bpffs,
        p("--health-addr"),
        p("127.0.0.1:0"),
        p("--metrics-addr"),
        p("127.0.0.1:0"),
    ];
    a.extend_from_slice(extra);
    a
}

#[test]
fn agent_without_source_exits_2() {
    let mut s = Scratch::new("nosource");
    let cg = s.cgroup();
    let bpffs = s.bpffs();
    let out = ferry(&agent_args(&bpffs, &[p("--cgroup"), &cg]));
    assert_exit(
        &out,
        2,
        &["no source", "--manifests"],
        "ferry agent without --manifests",
    );
    assert!(
        !bpffs.exists(),
        "a configuration error must not create {}",
        bpffs.display()
    );
}

#[test]
fn agent_with_missing_manifests_dir_exits_2() {
    let mut s = Scratch::new("nodir");
    let cg = s.cgroup();
    let bpffs = s.bpffs();
    let missing = s.dir.join("does-not-exist");
    let out = ferry(&agent_args(
        &bpffs,
        &[p("--manifests"), &missing, p("--cgroup"), &cg],
    ));
    assert_exit(
        &out,
        2,
        &[
            &missing.display().to_string(),
            "does not exist",
            "--manifests",
        ],
        "ferry agent --manifests <missing dir>",
    );
    assert!(
        !bpffs.exists(),
        "a configuration error must not create {}",
        bpffs.display()
    );
}

#[test]
fn agent_with_bad_kubeconfig_exits_2() {
    let mut s = Scratch::new("kubeconfig");
    let cg = s.cgroup();
    let bpffs = s.bpffs();
    let kubeconfig = s.dir.join("kubeconfig");
    let out = ferry(&agent_args(
        &bpffs,
        &[p("--kubeconfig"), &kubeconfig, p("--cgroup"), &cg],
    ));
    assert_exit(
        &out,
        2,
        &["--kubeconfig", "no such file"],
        "ferry agent --kubeconfig MISSING",
    );
    // A kubeconfig without any context cannot reach an API server.
    fs::write(&kubeconfig, "apiVersion: v1\nkind: Config\n").unwrap();
    let out = ferry(&agent_args(
        &bpffs,
        &[p("--kubeconfig"), &kubeconfig, p("--cgroup"), &cg],
    ));
    assert_exit(
        &out,
        2,
        &[kubeconfig.to_str().unwrap()],
        "ferry agent --kubeconfig EMPTY",
    );
    let manifests = s.manifests();
    let out = ferry(&agent_args(
        &bpffs,
        &[
            p("--kubeconfig"),
            &kubeconfig,
            p("--manifests"),
            &manifests,
            p("--cgroup"),
            &cg,
        ],
    ));
    assert_exit(
        &out,
        2,
        &["exactly one", "--manifests", "--kubeconfig"],
        "ferry agent --kubeconfig --manifests",
    );
    assert!(
        !bpffs.exists(),
        "a configuration error must not create {}",
        bpffs.display()
    );
}

#[test]
fn agent_with_non_cgroup_dir_exits_2() {
    let s = Scratch::new("nocgroup");
    let bpffs = s.bpffs();
    let manifests = s.manifests();
    let not_cgroup = s.dir.clone();
    let out = ferry(&agent_args(
        &bpffs,
        &[p("--manifests"), &manifests, p("--cgroup"), &not_cgroup],
    ));
    assert_exit(
        &out,
        2,
        &[
            "--cgroup",
            &not_cgroup.display().to_string(),
            "not a cgroup v2 directory",
        ],
        "ferry agent --cgroup <plain dir>",
    );
    let missing = s.dir.join("nope");
    let out = ferry(&agent_args(
        &bpffs,
        &[p("--manifests"), &manifests, p("--cgroup"), &missing],
    ));
    assert_exit(
        &out,
        2,
        &["--cgroup", &missing.display().to_string()],
        "ferry agent --cgroup <missing dir>",
    );
    assert!(
        !bpffs.exists(),
        "a configuration error must not create {}",
        bpffs.display()
    );
}

#[test]
fn agent_with_bpffs_outside_a_bpf_filesystem_exits_2() {
    let mut s = Scratch::new("notbpffs");
    let cg = s.cgroup();
    let manifests = s.manifests();
    let pins = s.dir.join("pins");
    let out = ferry(&agent_args(
        &pins,
        &[p("--manifests"), &manifests, p("--cgroup"), &cg],
    ));
    assert_exit(
        &out,
        2,
        &["--bpffs", "not on a bpf filesystem"],
        "ferry agent --bpffs <dir on tmpfs/ext4>",
    );
    let out = Command::new("bpftool")
        .args(["-j", "cgroup", "show"])
        .arg(&cg)
        .output()
        .expect("bpftool");
    let attached = String::from_utf8_lossy(&out.stdout);
    assert!(
        attached.trim().is_empty() || attached.trim() == "[]",
        "nothing may be attached after a configuration error: {attached}"
    );
}

#[test]
fn list_without_pins_fails_naming_bpffs() {
    let s = Scratch::new("listnopins");
    // A directory that does not exist...
    let missing = s.bpffs();
    let out = ferry(&[p("list"), p("--bpffs"), &missing]);
    assert!(
        !out.status.success(),
        "ferry list on {} (no pins) must fail, exited {}",
        missing.display(),
        out.status
    );
    assert_exit(
        &out,
        out.status.code().unwrap_or(-1),
        &["--bpffs", &missing.display().to_string()],
        "ferry list --bpffs <missing>",
    );
    // ...and an empty one on the bpf filesystem.
    fs::create_dir_all(&missing).expect("empty bpffs dir");
    let out = ferry(&[p("list"), p("--bpffs"), &missing, p("-o"), p("json")]);
    let _ = fs::remove_dir(&missing);
    assert!(
        !out.status.success(),
        "ferry list on an empty bpffs dir must fail, exited {}",
        out.status
    );
    assert_exit(
        &out,
        out.status.code().unwrap_or(-1),
        &["--bpffs", "is an agent running"],
        "ferry list --bpffs <empty dir>",
    );
    assert!(
        out.stdout.is_empty(),
        "a failed ferry list must print nothing on stdout: {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn list_table_shows_frontends_and_backends() {
    let mut w = World::new("listtable", 2, &[8080]);
    let eps: Vec<Ep> = w.pods.iter().map(|p| ep(p.v4)).collect();
    w.write_manifest(
        "web.yaml",
        &docs(&[
            service("web", &["10.96.0.10"], &[("http", 80, "TCP")], ""),
            slice("web", "web-1", "IPv4", &[("http", 8080, "TCP")], &eps),
            service("empty", &["10.96.0.11"], &[("dns", 53, "UDP")], ""),
            slice("empty", "empty-1", "IPv4", &[("dns", 53, "UDP")], &[]),
        ]),
    );
    w.start_agent(&[]);
    let out = Command::new(bin("ferry"))
        .arg("list")
        .arg("--bpffs")
        .arg(&w.bpffs)
        .args(["-o", "table"])
        .output()
        .expect("ferry list");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "ferry list -o table failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines
            .first()
            .is_some_and(|h| h.starts_with("FRONTEND") && h.contains("BACKENDS")),
        "table must start with a header; saw:\n{table}"
    );
    let web = lines
        .iter()
        .find(|l| l.starts_with("10.96.0.10:80 "))
        .unwrap_or_else(|| panic!("no row for 10.96.0.10:80 in:\n{table}"));
    for want in ["TCP", "local-origin", "10.1.1.2:8080", "10.1.2.2:8080"] {
        assert!(
            web.contains(want),
            "row of 10.96.0.10:80 must show {want:?}; saw {web:?}"
        );
    }
    let empty = lines
        .iter()
        .find(|l| l.starts_with("10.96.0.11:53 "))
        .unwrap_or_else(|| panic!("no row for 10.96.0.11:53 in:\n{table}"));
    for want in ["UDP", "reject", "(none)"] {
        assert!(
            empty.contains(want),
            "row of the endpoint-less 10.96.0.11:53 must show {want:?}; saw {empty:?}"
        );
    }
    assert!(
        table.contains("\ncounters: "),
        "table must end with the datapath counters; saw:\n{table}"
    );
}

#[test]
fn health_metrics_and_proxy_mode_endpoints() {
    let mut w = World::new("http", 1, &[8080]);
    w.write_manifest(
        "web.yaml",
        &docs(&[
            service("web", &["10.96.0.10"], &[("http", 80, "TCP")], ""),
            slice(
                "web",
                "web-1",
                "IPv4",
                &[("http", 8080, "TCP")],
                &[ep(w.pod("pod1").v4)],
            ),
        ]),
    );
    w.start_agent(&[]);
    for path in ["/healthz", "/livez"] {
        let (code, body) =
            http_get(&w.node_ns, 10256, path).unwrap_or_else(|e| panic!("GET {path}: {e}"));
        assert_eq!(
            code, 200,
            "GET {path} after ready: expected 200, saw {code}: {body}"
        );
        let v: serde_json::Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("GET {path}: body is not JSON ({e}): {body}"));
        let last = v["lastUpdated"].as_str().unwrap_or_default();
        assert!(
            last.len() == 20 && last.starts_with("20") && last.ends_with('Z'),
            "GET {path}: lastUpdated must be an RFC 3339 UTC time after the first sync; saw {last:?} in {body}"
        );
    }
    let m = w.metrics();
    assert!(
        m.contains("\nferry_services_programmed 1\n"),
        "/metrics must report ferry_services_programmed 1; saw:\n{m}"
    );
    assert!(
        m.contains("# TYPE ferry_services_programmed gauge"),
        "/metrics must type ferry_services_programmed; saw:\n{m}"
    );
    assert!(
        m.contains("sync_proxy_rules_last_timestamp_seconds "),
        "/metrics must have the kube-proxy sync timestamp; saw:\n{m}"
    );
    let (code, mode) = http_get(&w.node_ns, 10249, "/proxyMode").expect("GET /proxyMode");
    assert_eq!((code, mode.trim()), (200, "ebpf"), "GET /proxyMode");
    let (code, _) = http_get(&w.node_ns, 10249, "/nope").expect("GET /nope");
    assert_eq!(code, 404, "an unknown path must be 404");
}
