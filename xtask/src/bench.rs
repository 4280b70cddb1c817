//! `cargo xtask bench [name] [--quick] [-- flags]`: builds everything, then runs
//! `target/release/ferry-bench` (docs/benchmarks.md). Without a name it runs all four
//! benchmarks and prints one table of every target.

use std::process::Command;

use anyhow::{Result, bail};

use crate::build::{self, workspace_root};

/// The benchmarks `ferry-bench` knows; `all` runs the other four.
pub(crate) const BENCHMARKS: [&str; 5] = [
    "all",
    "control-plane",
    "datapath-clusterip",
    "datapath-external",
    "pod-network",
];

pub(crate) fn run(name: Option<&str>, quick: bool, extra: &[String]) -> Result<()> {
    let name = name.unwrap_or("all");
    if !BENCHMARKS.contains(&name) {
        bail!("no benchmark {name:?}; known: {}", BENCHMARKS.join(", "));
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { geteuid() } != 0 {
        bail!(
            "the {name} benchmark loads BPF programs and creates namespaces and cgroups: run `sudo cargo xtask bench {name}`"
        );
    }
    build::all()?;
    let root = workspace_root();
    let mut cmd = Command::new(root.join("target/release/ferry-bench"));
    cmd.arg(name)
        .args(["--out".as_ref(), root.join("target/bench").as_os_str()])
        .args(extra)
        .env("FERRY_BIN", root.join("target/release/ferry"));
    if quick && !extra.iter().any(|a| a == "--quick") {
        if name == "control-plane" {
            cmd.args(["--scale", "10000x10", "--runs", "1", "--changes", "20"]);
        } else {
            cmd.arg("--quick");
        }
    }
    let status = cmd
        .status()
        .map_err(|e| anyhow::anyhow!("the {name} benchmark: could not start {cmd:?}: {e}"))?;
    if !status.success() {
        bail!("the {name} benchmark failed ({status}): {cmd:?}");
    }
    Ok(())
}

unsafe extern "C" {
    fn geteuid() -> u32;
}
