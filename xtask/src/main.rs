//! `cargo xtask <command>`: the developer commands. Every failure says which command
//! failed and what to run to fix it.

mod bench;
mod build;
mod image;
mod setup;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "ferry developer commands")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what a fresh Debian machine lacks (packages, bpf-linker). Idempotent.
    Setup,
    /// Build the eBPF object into target/bpf/ferry.bpf.o.
    BuildEbpf,
    /// Build the eBPF object, then target/release/ferry and the test helpers.
    Build,
    /// Build, then the container image as an OCI archive in
    /// target/image/ferry-<version>.oci.tar (no Docker needed).
    Image {
        /// Package the target/release/ferry already built, without building it first.
        #[arg(long)]
        no_build: bool,
    },
    /// Run every test CI runs: unit tests, then kernel tests as root (one at a time).
    Test {
        /// Only the unit tests (no root, no BPF toolchain needed).
        #[arg(long)]
        unit_only: bool,
        /// Extra filter passed to the kernel test binary.
        filter: Option<String>,
    },
    /// Show ferry at work in a small world of network namespaces (root).
    Demo,
    /// Build everything, then run the benchmarks (root): all of them, or one of
    /// `control-plane`, `datapath-clusterip`, `datapath-external`, `pod-network`.
    Bench {
        /// Which benchmark (default: all four, with one table of every target).
        name: Option<String>,
        /// Fewer scales and shorter runs, for development (not for published figures).
        #[arg(long)]
        quick: bool,
        /// Extra arguments for `ferry-bench` (e.g. `--scale 10000x10 --runs 5`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Setup => setup::run(),
        Cmd::BuildEbpf => build::ebpf(),
        Cmd::Build => build::all(),
        Cmd::Image { no_build } => image::run(no_build),
        Cmd::Test { unit_only, filter } => build::test(unit_only, filter.as_deref()),
        Cmd::Demo => build::demo(),
        Cmd::Bench { name, quick, args } => bench::run(name.as_deref(), quick, &args),
    }
}
