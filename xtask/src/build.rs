//! Building the eBPF object and the binaries, and running tests and the demo.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::setup;

const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
const DEBIAN_CARGO: &str = "/usr/bin/cargo";
const DEBIAN_RUST_SRC: &str = "/usr/lib/rustlib/src/rust/library";
const BPF_RUSTFLAGS: &str =
    r#""--cfg=bpf_target_arch=\"x86_64\"","-Cdebuginfo=2","-Clink-arg=--btf","-Cpanic=abort""#;

/// The eBPF build's rustflags. The checkout's path is remapped to `/ferry` in the
/// object's debug info and BTF line info, so that the same commit gives the same object,
/// binary and image layer wherever it is checked out.
fn bpf_rustflags(root: &Path) -> String {
    let root = root.display().to_string();
    let remap = format!("--remap-path-prefix={root}=/ferry")
        .replace('\\', "\\\\")
        .replace('"', "\\\"");
    format!("build.rustflags=[{BPF_RUSTFLAGS},\"{remap}\"]")
}

pub(crate) fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .into()
}

/// Where `build-ebpf` leaves the object; `agent/build.rs` embeds it from here.
pub(crate) fn ebpf_object() -> PathBuf {
    workspace_root().join("target/bpf/ferry.bpf.o")
}

pub(crate) fn podnet_object() -> PathBuf {
    workspace_root().join("target/bpf/ferry-podnet.bpf.o")
}

enum Toolchain {
    /// Debian's rustc-web with its library source (TOOLCHAIN.md).
    Debian,
    /// A rustup nightly with the rust-src component.
    Nightly,
}

fn find_toolchain() -> Result<Toolchain> {
    if Path::new(DEBIAN_RUSTC).exists()
        && Path::new(DEBIAN_CARGO).exists()
        && Path::new(DEBIAN_RUST_SRC).join("core").exists()
    {
        return Ok(Toolchain::Debian);
    }
    let nightly_src = Command::new("rustup")
        .args(["run", "nightly", "rustc", "--print", "sysroot"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        .map(|sysroot| sysroot.join("lib/rustlib/src/rust/library/core").exists());
    if nightly_src == Some(true) {
        return Ok(Toolchain::Nightly);
    }
    bail!(
        "no Rust compiler that can build core for bpfel-unknown-none: install Debian's \
         (`apt-get install rustc-web cargo-web rust-web-src llvm-22-dev`, or `cargo xtask setup`) \
         or a nightly with sources (`rustup toolchain install nightly --component rust-src`)"
    )
}

pub(crate) fn ebpf() -> Result<()> {
    if !setup::bpf_linker_present() {
        bail!(
            "bpf-linker is missing: run `cargo xtask setup` or `{}`",
            setup::LINKER_INSTALL
        );
    }
    let root = workspace_root();
    let target_dir = root.join("target/ebpf");
    let mut cmd = match find_toolchain()? {
        Toolchain::Debian => {
            let mut c = Command::new(DEBIAN_CARGO);
            c.env("RUSTC", DEBIAN_RUSTC).env("RUSTC_BOOTSTRAP", "1");
            c
        }
        Toolchain::Nightly => {
            let mut c = Command::new("rustup");
            c.args(["run", "nightly", "cargo"]);
            c
        }
    };
    // bpf-linker installed by cargo lands in ~/.cargo/bin, which a root shell may lack.
    let mut path = env::var("PATH").unwrap_or_default();
    if let Some(home) = env::var_os("HOME") {
        path = format!("{}:{path}", Path::new(&home).join(".cargo/bin").display());
    }
    cmd.current_dir(&root)
        .env("PATH", path)
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .args(["build", "-p", "ferry-ebpf", "--bins", "--release"])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
        .arg("--target-dir")
        .arg(&target_dir)
        .arg("--config")
        .arg(bpf_rustflags(&root));
    run(&mut cmd, "building the eBPF object")?;
    // Service routing's object and the pod network's fast path, each loaded on its own.
    for (bin, dest) in [
        ("ferry-ebpf", ebpf_object()),
        ("ferry-podnet", podnet_object()),
    ] {
        let built = target_dir.join("bpfel-unknown-none/release").join(bin);
        std::fs::create_dir_all(dest.parent().unwrap())?;
        std::fs::copy(&built, &dest)
            .with_context(|| format!("copying {} to {}", built.display(), dest.display()))?;
        println!("build-ebpf: {}", dest.display());
    }
    Ok(())
}

pub(crate) fn all() -> Result<()> {
    ebpf()?;
    let mut cmd = cargo();
    cmd.args([
        "build",
        "--release",
        "-p",
        "ferry-agent",
        "-p",
        "ferry-tests",
        "-p",
        "ferry-cni",
        "-p",
        "ferry-gardener",
        "--bins",
    ]);
    run(&mut cmd, "building target/release/ferry")?;
    println!(
        "build: {}",
        workspace_root().join("target/release/ferry").display()
    );
    Ok(())
}

pub(crate) fn test(unit_only: bool, filter: Option<&str>) -> Result<()> {
    let mut unit = cargo();
    // Release, so the kernel tests below reuse the same build of every dependency.
    unit.args([
        "test",
        "--release",
        "--workspace",
        "--exclude",
        "ferry-tests",
        "--exclude",
        "ferry-ebpf",
    ]);
    run(&mut unit, "unit tests")?;
    if unit_only {
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc_geteuid() } != 0 {
        bail!(
            "kernel tests need root (BPF, network namespaces, cgroups): run `sudo cargo xtask test`, or `cargo xtask test --unit-only`"
        );
    }
    all()?;
    // The container test (tests/tests/container.rs) runs this image.
    crate::image::build_archive()?;
    let mut kernel = cargo();
    kernel.args([
        "test",
        "--release",
        "-p",
        "ferry-tests",
        "--",
        "--test-threads=1",
    ]);
    if let Some(f) = filter {
        kernel.arg(f);
    }
    kernel.env("FERRY_BIN", workspace_root().join("target/release/ferry"));
    run(&mut kernel, "kernel tests")
}

pub(crate) fn demo() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc_geteuid() } != 0 {
        bail!("the demo creates network namespaces and loads BPF programs: run it as root");
    }
    if !setup::bpf_linker_present() || find_toolchain().is_err() {
        setup::run()?;
    }
    all()?;
    let bin = workspace_root().join("target/release/ferry-demo");
    let mut cmd = Command::new(bin);
    cmd.env("FERRY_BIN", workspace_root().join("target/release/ferry"));
    run(&mut cmd, "the demo")
}

fn cargo() -> Command {
    let mut c = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(workspace_root());
    c
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("{what}: could not start {cmd:?}"))?;
    if !status.success() {
        bail!("{what} failed ({status}): {cmd:?}");
    }
    Ok(())
}

unsafe extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}
