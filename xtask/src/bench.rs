//! `cargo xtask bench <name>`: builds everything, then runs `target/release/ferry-bench`
//! (docs/benchmarks.md).

use std::process::Command;

use anyhow::{Result, bail};

use crate::build::{self, workspace_root};

/// The benchmarks `ferry-bench` knows.
pub(crate) const BENCHMARKS: [&str; 1] = ["control-plane"];

pub(crate) fn run(name: &str, extra: &[String]) -> Result<()> {
    if !BENCHMARKS.contains(&name) {
        bail!("no benchmark {name:?}; known: {}", BENCHMARKS.join(", "));
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { geteuid() } != 0 {
        bail!(
            "the {name} benchmark loads BPF programs and creates cgroups: run `sudo cargo xtask bench {name}`"
        );
    }
    build::all()?;
    let root = workspace_root();
    let mut cmd = Command::new(root.join("target/release/ferry-bench"));
    cmd.arg(name)
        .args(["--out".as_ref(), root.join("target/bench").as_os_str()])
        .args(extra)
        .env("FERRY_BIN", root.join("target/release/ferry"));
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
