//! `ferry-bench`: ferry's benchmarks (docs/benchmarks.md).
//!
//! ```text
//! ferry-bench control-plane      [--scale SxE]... [--runs N] [--changes N] [--out DIR] [--log-level F]
//! ferry-bench datapath-clusterip [--quick] [--out DIR] [--docs FILE|--no-docs] [--services N,N..]
//!                                [--rounds R] [--seconds S] [--workers W] [--changes C] [--no-profile]
//! ferry-bench datapath-external  [--quick] [--out DIR] [--docs FILE|--no-docs] [--rounds R] [--seconds S]
//! ferry-bench pod-network        [--quick] [--out DIR] [--docs FILE|--no-docs] [--rounds R] [--seconds S] [--no-vxlan] [--kernel-path]
//! ferry-bench all                [--quick] [--out DIR] [--docs FILE|--no-docs]
//! ```
//!
//! `all` runs the four and prints one table of every target. The datapath benchmarks
//! write `DIR/datapath-*.json`, PNG plots next to the docs file, and their generated
//! section of the docs file. Everything they create (namespaces, agents, pins, cgroups,
//! rules, processes) is removed when they end, also on failure and on Ctrl-C.
//!
//! `loadgen` and `serve` are the benchmark's own client and server processes.

mod cleanup;
mod clusterip;
mod control_plane;
mod external;
mod layouts;
mod load;
mod plot;
mod podnet;
mod report;
mod util;

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

use serde_json::Value;

const USAGE: &str = "usage: ferry-bench (all | control-plane | datapath-clusterip | datapath-external | pod-network) [--quick] [--out DIR] [--docs FILE | --no-docs] [flags]\n(see docs/benchmarks.md)";

/// Flags shared by the datapath benchmarks and `all`; the rest go to the benchmark.
struct Common {
    quick: bool,
    out: PathBuf,
    docs: Option<PathBuf>,
    rest: Vec<String>,
}

fn common(argv: &[String]) -> Result<Common, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut c = Common {
        quick: false,
        out: root.join("target/bench"),
        docs: Some(root.join("docs/benchmarks.md")),
        rest: Vec::new(),
    };
    let mut it = argv.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => c.quick = true,
            "--out" => c.out = it.next().ok_or("--out needs a value")?.into(),
            "--docs" => c.docs = Some(it.next().ok_or("--docs needs a value")?.into()),
            "--no-docs" => c.docs = None,
            _ => c.rest.push(a.clone()),
        }
    }
    Ok(c)
}

fn root_checks() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (namespaces, BPF, cgroups): run `sudo cargo xtask bench`".into());
    }
    ferry_tests::require_kernel();
    Ok(())
}

/// Where the plots go: next to the docs file (or into DIR without docs).
fn plot_dir(c: &Common) -> PathBuf {
    c.docs
        .as_ref()
        .and_then(|d| d.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| c.out.clone())
}

fn clusterip(c: &Common, extra: &[String]) -> Result<Vec<(String, bool, String)>, String> {
    let mut a = clusterip::Args::new(c.quick, c.out.clone());
    a.parse(extra)?;
    let (doc, md) = clusterip::run(&a, &plot_dir(c))?;
    println!("\n## datapath-clusterip\n\n{md}");
    if let Some(d) = &c.docs {
        report::update_docs(d, "datapath-clusterip", &md)?;
    }
    println!(
        "results: {}",
        c.out.join("datapath-clusterip.json").display()
    );
    Ok(clusterip::targets(
        doc["results"].as_array().map(Vec::as_slice).unwrap_or(&[]),
    ))
}

fn external(c: &Common, extra: &[String]) -> Result<Vec<(String, bool, String)>, String> {
    let mut a = external::Args::new(c.quick, c.out.clone());
    a.parse(extra)?;
    let (doc, md) = external::run(&a)?;
    println!("\n## datapath-external\n\n{md}");
    if let Some(d) = &c.docs {
        report::update_docs(d, "datapath-external", &md)?;
    }
    println!(
        "results: {}",
        c.out.join("datapath-external.json").display()
    );
    Ok(external::targets(&doc["results"]))
}

fn pod_network(c: &Common, extra: &[String]) -> Result<Vec<(String, bool, String)>, String> {
    let mut a = podnet::Args::new(c.quick, c.out.clone());
    a.parse(extra)?;
    let (doc, md) = podnet::run(&a)?;
    println!("\n## pod-network\n\n{md}");
    if let Some(d) = &c.docs {
        report::update_docs(d, "pod-network", &md)?;
    }
    println!("results: {}", c.out.join("pod-network.json").display());
    Ok(podnet::targets(&doc["results"]))
}

/// The control-plane targets, read back from its JSON.
fn control_plane_targets(out: &Path) -> Vec<(String, bool, String)> {
    let Ok(text) = std::fs::read_to_string(out.join("control-plane.json")) else {
        return Vec::new();
    };
    let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let t = &v["targets"];
    let mut rows = Vec::new();
    for r in v["results"].as_array().into_iter().flatten() {
        let s = r["scale"].as_str().unwrap_or("?");
        let sync = r["full_sync"]["healthz_ms"]["median"]
            .as_f64()
            .unwrap_or(f64::NAN);
        let p50 = r["changes"]["all"]["p50_ms"].as_f64().unwrap_or(f64::NAN);
        let rss = r["peak_rss_kib"].as_f64().unwrap_or(f64::NAN);
        rows.push((
            format!("control plane {s}: full sync < {} ms", t["full_sync_ms"]),
            sync < t["full_sync_ms"].as_f64().unwrap_or(0.0),
            format!("{sync:.0} ms"),
        ));
        rows.push((
            format!("control plane {s}: change p50 < {} ms", t["change_p50_ms"]),
            p50 < t["change_p50_ms"].as_f64().unwrap_or(0.0),
            format!("{p50:.2} ms"),
        ));
        rows.push((
            format!(
                "control plane {s}: peak RSS < {} MiB",
                t["peak_rss_kib"].as_u64().unwrap_or(0) / 1024
            ),
            rss < t["peak_rss_kib"].as_f64().unwrap_or(0.0),
            format!("{:.1} MiB", rss / 1024.0),
        ));
    }
    rows
}

fn all(c: &Common) -> ExitCode {
    let mut rows = Vec::new();
    let mut failed = Vec::new();
    let mut cp: Vec<String> = vec!["--out".into(), c.out.display().to_string()];
    if c.quick {
        cp.extend(["--scale", "10000x10", "--runs", "1", "--changes", "20"].map(String::from));
    }
    eprintln!("==== control-plane");
    if control_plane::main(&cp) == ExitCode::SUCCESS {
        rows.extend(control_plane_targets(&c.out));
    } else {
        failed.push("control-plane");
    }
    eprintln!("==== datapath-clusterip");
    match clusterip(c, &[]) {
        Ok(r) => rows.extend(r),
        Err(e) => {
            eprintln!("ferry-bench datapath-clusterip: {e}");
            failed.push("datapath-clusterip");
        }
    }
    eprintln!("==== datapath-external");
    match external(c, &[]) {
        Ok(r) => rows.extend(r),
        Err(e) => {
            eprintln!("ferry-bench datapath-external: {e}");
            failed.push("datapath-external");
        }
    }
    eprintln!("==== pod-network");
    match pod_network(c, &[]) {
        Ok(r) => rows.extend(r),
        Err(e) => {
            eprintln!("ferry-bench pod-network: {e}");
            failed.push("pod-network");
        }
    }
    println!(
        "\n## All targets{}\n\n| target | result | |\n|---|---|---|",
        if c.quick { " (--quick)" } else { "" }
    );
    for (what, ok, val) in &rows {
        println!(
            "| {what} | {val} | {} |",
            if *ok { "met" } else { "MISSED" }
        );
    }
    for f in &failed {
        println!("| {f} | did not complete (see above) | FAILED |");
    }
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = argv.first().map(String::as_str) else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let rest = &argv[1..];
    match cmd {
        "loadgen" => return load::loadgen_main(rest),
        "serve" => return load::serve_main(rest),
        "-h" | "--help" => {
            eprintln!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => {}
    }
    if let Err(e) = root_checks() {
        eprintln!("ferry-bench: {e}");
        return ExitCode::from(2);
    }
    cleanup::install_signal_handler();
    if cmd == "control-plane" {
        return control_plane::main(rest);
    }
    let c = match common(rest) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ferry-bench: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = match cmd {
        "all" if c.rest.is_empty() => return all(&c),
        "datapath-clusterip" => clusterip(&c, &c.rest),
        "datapath-external" => external(&c, &c.rest),
        "pod-network" => pod_network(&c, &c.rest),
        _ => {
            eprintln!(
                "ferry-bench: unknown benchmark or flags: {}\n{USAGE}",
                argv.join(" ")
            );
            return ExitCode::from(2);
        }
    };
    cleanup::release_all();
    match result {
        Ok(rows) => {
            for (what, ok, val) in rows {
                println!("{} {what}: {val}", if ok { "met   " } else { "MISSED" });
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ferry-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
