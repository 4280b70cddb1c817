//! `cargo xtask setup`: Debian packages and bpf-linker, installed only when missing.

use std::{path::Path, process::Command};

use anyhow::{Context, Result, bail};

/// Debian packages the build, the tests, the demo and the benchmarks use.
pub(crate) const PACKAGES: &[&str] = &[
    "rustc-web",
    "cargo-web",
    "rust-web-src",
    "llvm-22-dev",
    "bpftool",
    "iproute2",
    "curl",
    "socat",
    "procps",
    "util-linux",
    // Benchmarks (docs/benchmarks.md): the kube-proxy layouts, iperf3, the plots' font.
    "iptables",
    "nftables",
    "iperf3",
    "fonts-dejavu-core",
    // The image (`cargo xtask image`) and the container test that runs it.
    "ca-certificates",
    "containerd",
    "runc",
];

pub(crate) const LINKER_INSTALL: &str = "LLVM_SYS_221_PREFIX=/usr/lib/llvm-22 PATH=/usr/lib/llvm-22/bin:$PATH \
     cargo install bpf-linker --no-default-features --features llvm-22";

pub(crate) fn run() -> Result<()> {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .copied()
        .filter(|p| !dpkg_installed(p))
        .collect();
    if missing.is_empty() {
        println!("setup: Debian packages present");
    } else {
        println!("setup: installing {}", missing.join(" "));
        sh("apt-get update -qq")?;
        let cmd = format!(
            "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends {}",
            missing.join(" ")
        );
        sh(&cmd)?;
    }
    if bpf_linker_present() {
        println!("setup: bpf-linker present");
    } else {
        println!("setup: installing bpf-linker (about a minute)");
        sh(LINKER_INSTALL)?;
    }
    Ok(())
}

fn dpkg_installed(pkg: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

pub(crate) fn bpf_linker_present() -> bool {
    Command::new("bpf-linker")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
        || std::env::var_os("HOME")
            .is_some_and(|h| Path::new(&h).join(".cargo/bin/bpf-linker").exists())
}

fn sh(cmd: &str) -> Result<()> {
    let status = Command::new("bash")
        .args(["-c", cmd])
        .status()
        .with_context(|| format!("could not start `{cmd}`"))?;
    if !status.success() {
        bail!("`{cmd}` failed with {status}; run `cargo xtask setup` as root on Debian");
    }
    Ok(())
}
