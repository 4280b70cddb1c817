//! A fake Kubernetes API server (plain HTTP list/watch of Services, EndpointSlices and
//! Nodes) for manual runs and benchmarks.
//!
//! `ferry-fakeapi --listen ADDR --kubeconfig PATH [--load DIR]
//!   [--generate-services N [--endpoints-per-service M]] [--history EVENTS]
//!   [--bookmark-interval-ms MS]`
//!
//! Serves the objects of every `*.yaml|*.yml|*.json` file in DIR (multi-document YAML)
//! and/or N generated Services `svc-i` with one EndpointSlice of M endpoints each, writes
//! a kubeconfig pointing at it, prints `ready URL` and serves until killed.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use ferry_tests::fakeapi::{FakeApi, Kind, Options, generate};

const USAGE: &str = "usage: ferry-fakeapi --listen ADDR --kubeconfig PATH [--load DIR] \
[--generate-services N] [--endpoints-per-service M] [--history EVENTS] [--bookmark-interval-ms MS]";

struct Args {
    opts: Options,
    kubeconfig: Option<PathBuf>,
    load: Vec<PathBuf>,
    services: usize,
    endpoints: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        opts: Options {
            listen: SocketAddr::from(([127, 0, 0, 1], 6443)),
            ..Options::default()
        },
        kubeconfig: None,
        load: Vec::new(),
        services: 0,
        endpoints: 10,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            return Err(String::new());
        }
        let (flag, inline) = match flag.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (flag, None),
        };
        let value = inline
            .or_else(|| it.next())
            .ok_or_else(|| format!("{flag} needs a value"))?;
        let num = |v: &str| v.parse::<usize>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--listen" => {
                a.opts.listen = value
                    .parse()
                    .map_err(|e| format!("--listen {value}: {e}"))?
            }
            "--kubeconfig" => a.kubeconfig = Some(value.into()),
            "--load" => a.load.push(value.into()),
            "--generate-services" => a.services = num(&value)?,
            "--endpoints-per-service" => a.endpoints = num(&value)?,
            "--history" => a.opts.history_limit = num(&value)?,
            "--bookmark-interval-ms" => {
                a.opts.bookmark_interval = Duration::from_millis(num(&value)? as u64)
            }
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("ferry-fakeapi: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let api = match FakeApi::start_with(args.opts.clone()) {
        Ok(api) => api,
        Err(e) => {
            eprintln!("ferry-fakeapi: listen on {}: {e}", args.opts.listen);
            return ExitCode::FAILURE;
        }
    };
    for dir in &args.load {
        if let Err(e) = api.load_dir(dir) {
            eprintln!("ferry-fakeapi: load {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
    }
    if args.services > 0 {
        let t = Instant::now();
        if let Err(e) = api.apply_all(generate(args.services, args.endpoints)) {
            eprintln!("ferry-fakeapi: generate: {e}");
            return ExitCode::FAILURE;
        }
        eprintln!(
            "ferry-fakeapi: generated {} services x {} endpoints in {:?}",
            args.services,
            args.endpoints,
            t.elapsed()
        );
    }
    if let Some(path) = &args.kubeconfig
        && let Err(e) = api.write_kubeconfig(path)
    {
        eprintln!("ferry-fakeapi: write {}: {e}", path.display());
        return ExitCode::FAILURE;
    }
    let counts: Vec<String> = Kind::ALL
        .iter()
        .map(|k| format!("{} {}", api.list(*k).len(), k.plural()))
        .collect();
    eprintln!(
        "ferry-fakeapi: serving {} at {}",
        counts.join(", "),
        api.url()
    );
    println!("ready {}", api.url());
    loop {
        std::thread::park();
    }
}
