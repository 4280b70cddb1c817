//! Shared by the benchmarks: the machine and revision measured, statistics, shell
//! commands, network namespaces.

use std::{
    fs,
    path::Path,
    process::{Command, Stdio},
};

use serde_json::{Value, json};

/// Runs `bash -c cmd`; its stdout, or an error naming the command and its stderr.
pub(crate) fn sh(cmd: &str) -> Result<String, String> {
    let out = Command::new("bash")
        .args(["-c", cmd])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`{cmd}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `sh` inside network namespace `ns`.
pub(crate) fn sh_in(ns: &str, cmd: &str) -> Result<String, String> {
    sh(&format!("ip netns exec {ns} bash -c '{cmd}'"))
}

/// Median, min and max of samples, as JSON.
pub(crate) fn spread(v: &[f64]) -> Value {
    let (lo, hi) = min_max(v);
    json!({"median": median(v), "min": lo, "max": hi, "samples": v})
}

/// Fails with the package to install when a tool is missing.
pub(crate) fn require_tool(tool: &str, package: &str) -> Result<(), String> {
    let found = std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .chain(["/usr/sbin", "/sbin"])
        .any(|d| Path::new(d).join(tool).exists());
    if found {
        Ok(())
    } else {
        Err(format!(
            "{tool} is missing (Debian package {package}): run `sudo cargo xtask setup`"
        ))
    }
}

pub(crate) fn machine() -> Value {
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let nproc = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem_kib = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .unwrap_or(0);
    json!({"kernel": kernel, "nproc": nproc, "cpu": model, "mem_total_kib": mem_kib})
}

/// Which code was measured: the commit and the uncommitted paths of the agent's crates
/// (read-only git queries; empty when git is missing).
/// Which code was measured: the commit and the uncommitted paths of the agent's crates
/// (read-only git queries; empty when git is missing).
pub(crate) fn revision() -> Value {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(&root)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    let dirty: Vec<String> = git(&["status", "--porcelain", "--", "agent", "common", "ebpf"])
        .lines()
        .map(|l| l.trim().to_string())
        .collect();
    json!({"commit": git(&["rev-parse", "--short", "HEAD"]), "uncommitted": dirty})
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    // Nearest rank.
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    if s.is_empty() {
        return f64::NAN;
    }
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

pub(crate) fn min_max(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
            (lo.min(*x), hi.max(*x))
        })
}

/// The rate in iperf3's `-J` output of a client run of `secs` seconds: Gbit/s received
/// for TCP, datagrams received per second for UDP (the sender's count less the lost
/// ones). An iperf3 error is an error.
pub(crate) fn iperf_rate(json: &str, udp: bool, secs: u64) -> Result<f64, String> {
    let v: Value = serde_json::from_str(json).map_err(|e| format!("iperf3 output: {e}"))?;
    if let Some(e) = v["error"].as_str() {
        return Err(format!("iperf3: {e}"));
    }
    let end = &v["end"];
    if udp {
        let s = if end["sum_received"].is_object() {
            &end["sum_received"]
        } else {
            &end["sum"]
        };
        let packets = s["packets"].as_f64().unwrap_or(0.0);
        let lost = s["lost_packets"].as_f64().unwrap_or(0.0);
        let secs = s["seconds"].as_f64().unwrap_or(secs as f64).max(0.001);
        Ok((packets - lost).max(0.0) / secs)
    } else {
        Ok(end["sum_received"]["bits_per_second"]
            .as_f64()
            .unwrap_or(0.0)
            / 1e9)
    }
}

/// `iperf3 -s` in `ns` on CPU 1, bound to `ip` (so that UDP replies leave from it),
/// killed when dropped.
pub(crate) fn iperf_server(ns: &str, ip: std::net::Ipv4Addr, port: u16) -> crate::cleanup::Proc {
    let mut cmd = Command::new("iperf3");
    cmd.args([
        "-s",
        "-p",
        &port.to_string(),
        "-A",
        "1",
        "-B",
        &ip.to_string(),
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    crate::cleanup::Proc::new(ferry_tests::spawn_in(ns, None, &mut cmd))
}
