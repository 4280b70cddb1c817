//! The load generator and the echo server of the ClusterIP benchmark. Each runs as a
//! child process of its own (`ferry-bench loadgen`, `ferry-bench serve`), so that it
//! can be put into a network namespace, a cgroup and onto one CPU.
//!
//! Both are single-threaded (a current-thread tokio runtime) and pinned: the client is
//! CPU-bound with a fixed number of connections in flight, so its rate is set by the
//! per-connection work of the path under test.

use std::{
    net::SocketAddr,
    process::{Command, ExitCode, Stdio},
    time::{Duration, Instant},
};

use serde_json::{Value, json};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpSocket, TcpStream, UdpSocket},
};

use crate::util::percentile;

/// One connection or datagram may take this long before it counts as an error.
const OP_TIMEOUT: Duration = Duration::from_millis(500);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// connect, request, reply, close (the server closes first, so the client never
    /// holds TIME_WAIT ports).
    Tcp,
    /// request/reply datagrams on one unconnected socket per worker.
    Udp,
}

#[derive(Clone, Debug)]
pub(crate) struct Spec {
    pub(crate) mode: Mode,
    pub(crate) addr: SocketAddr,
    pub(crate) workers: usize,
    pub(crate) warmup: Duration,
    pub(crate) duration: Duration,
    pub(crate) cpu: usize,
    pub(crate) size: usize,
}

impl Spec {
    pub(crate) fn args(&self) -> Vec<String> {
        vec![
            "loadgen".into(),
            "--mode".into(),
            if self.mode == Mode::Tcp { "tcp" } else { "udp" }.into(),
            "--addr".into(),
            self.addr.to_string(),
            "--workers".into(),
            self.workers.to_string(),
            "--warmup-ms".into(),
            self.warmup.as_millis().to_string(),
            "--duration-ms".into(),
            self.duration.as_millis().to_string(),
            "--cpu".into(),
            self.cpu.to_string(),
            "--size".into(),
            self.size.to_string(),
        ]
    }
}

/// What one load run measured.
#[derive(Clone, Debug, Default)]
pub(crate) struct Outcome {
    /// Completed operations per second in the measured window.
    pub(crate) rate: f64,
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    pub(crate) errors: u64,
    pub(crate) ops: u64,
}

impl Outcome {
    pub(crate) fn from_json(v: &Value) -> Result<Outcome, String> {
        let f = |k: &str| {
            v[k].as_f64()
                .ok_or_else(|| format!("loadgen output lacks {k}: {v}"))
        };
        Ok(Outcome {
            rate: f("rate")?,
            p50_us: f("p50_us").unwrap_or(f64::NAN),
            p99_us: f("p99_us").unwrap_or(f64::NAN),
            errors: v["errors"].as_u64().unwrap_or(0),
            ops: v["ops"].as_u64().unwrap_or(0),
        })
    }
}

/// Pins the calling process (and the threads it creates later) to one CPU.
pub(crate) fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET writes inside it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn flags(argv: &[String]) -> Result<std::collections::HashMap<String, String>, String> {
    let mut m = std::collections::HashMap::new();
    let mut it = argv.iter();
    while let Some(f) = it.next() {
        let v = it.next().ok_or_else(|| format!("{f} needs a value"))?;
        m.insert(f.trim_start_matches("--").to_string(), v.clone());
    }
    Ok(m)
}

fn get<T: std::str::FromStr>(
    m: &std::collections::HashMap<String, String>,
    k: &str,
) -> Result<T, String> {
    m.get(k)
        .ok_or_else(|| format!("--{k} missing"))?
        .parse()
        .map_err(|_| format!("--{k}: bad value"))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// `ferry-bench loadgen --mode tcp|udp --addr A --workers W --warmup-ms M --duration-ms D
/// --cpu C --size B`: prints one JSON line with the rate and latency percentiles.
pub(crate) fn loadgen_main(argv: &[String]) -> ExitCode {
    let spec = match (|| -> Result<Spec, String> {
        let m = flags(argv)?;
        Ok(Spec {
            mode: match m.get("mode").map(String::as_str) {
                Some("tcp") => Mode::Tcp,
                Some("udp") => Mode::Udp,
                other => return Err(format!("--mode {other:?}: tcp or udp")),
            },
            addr: get(&m, "addr")?,
            workers: get(&m, "workers")?,
            warmup: Duration::from_millis(get(&m, "warmup-ms")?),
            duration: Duration::from_millis(get(&m, "duration-ms")?),
            cpu: get(&m, "cpu")?,
            size: get(&m, "size")?,
        })
    })() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ferry-bench loadgen: {e}");
            return ExitCode::from(2);
        }
    };
    pin_to(spec.cpu);
    let result = runtime().block_on(generate(spec.clone()));
    let mut lat: Vec<f64> = result.iter().flat_map(|w| w.0.iter().copied()).collect();
    lat.sort_by(|a, b| a.total_cmp(b));
    let errors: u64 = result.iter().map(|w| w.1).sum();
    let secs = spec.duration.as_secs_f64();
    println!(
        "{}",
        json!({
            "ops": lat.len(),
            "errors": errors,
            "secs": secs,
            "rate": lat.len() as f64 / secs,
            "p50_us": percentile(&lat, 50.0),
            "p99_us": percentile(&lat, 99.0),
        })
    );
    ExitCode::SUCCESS
}

/// Runs the workers; each returns (latencies in µs of the operations that started in
/// the measured window, errors in that window).
async fn generate(spec: Spec) -> Vec<(Vec<f64>, u64)> {
    let start = Instant::now() + spec.warmup;
    let end = start + spec.duration;
    let mut tasks = Vec::new();
    for _ in 0..spec.workers {
        let s = spec.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(1 << 16);
            let mut errors = 0;
            let udp = match s.mode {
                Mode::Udp => Some(UdpSocket::bind("0.0.0.0:0").await.expect("udp bind")),
                Mode::Tcp => None,
            };
            let req = vec![b'q'; s.size];
            let mut buf = vec![0u8; s.size + 64];
            loop {
                let t0 = Instant::now();
                if t0 >= end {
                    break;
                }
                let op = async {
                    match &udp {
                        Some(u) => udp_op(u, s.addr, &req, &mut buf).await,
                        None => tcp_op(s.addr, &req, &mut buf).await,
                    }
                };
                let ok = matches!(tokio::time::timeout(OP_TIMEOUT, op).await, Ok(Ok(())));
                if t0 >= start {
                    if ok {
                        lat.push(t0.elapsed().as_nanos() as f64 / 1000.0);
                    } else {
                        errors += 1;
                    }
                }
                if !ok && errors > 1000 {
                    break;
                }
            }
            (lat, errors)
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        if let Ok(r) = t.await {
            out.push(r);
        }
    }
    out
}

async fn tcp_op(addr: SocketAddr, req: &[u8], buf: &mut [u8]) -> std::io::Result<()> {
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    s.write_all(req).await?;
    s.read_exact(&mut buf[..req.len()]).await?;
    // Wait for the server's FIN: the client then closes second and keeps no TIME_WAIT.
    while s.read(buf).await? > 0 {}
    Ok(())
}

async fn udp_op(
    u: &UdpSocket,
    addr: SocketAddr,
    req: &[u8],
    buf: &mut [u8],
) -> std::io::Result<()> {
    u.send_to(req, addr).await?;
    u.recv_from(buf).await?;
    Ok(())
}

/// `ferry-bench serve --port P --cpu C --size B [--udp ADDR,..]`: answers each TCP
/// connection's request of B bytes with B bytes and closes it; echoes every UDP
/// datagram sent to one of the ADDRs. Prints "ready".
pub(crate) fn serve_main(argv: &[String]) -> ExitCode {
    let m = match flags(argv) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("ferry-bench serve: {e}");
            return ExitCode::from(2);
        }
    };
    let (port, cpu, size): (u16, usize, usize) =
        match (get(&m, "port"), get(&m, "cpu"), get(&m, "size")) {
            (Ok(p), Ok(c), Ok(s)) => (p, c, s),
            _ => {
                eprintln!("ferry-bench serve: --port, --cpu and --size are required");
                return ExitCode::from(2);
            }
        };
    let udp_addrs: Vec<std::net::Ipv4Addr> = m
        .get("udp")
        .map(|v| v.split(',').filter_map(|a| a.parse().ok()).collect())
        .unwrap_or_else(|| vec![std::net::Ipv4Addr::UNSPECIFIED]);
    pin_to(cpu);
    runtime().block_on(async move {
        let sock = TcpSocket::new_v4().expect("socket");
        sock.set_reuseaddr(true).expect("reuseaddr");
        sock.bind(SocketAddr::from(([0, 0, 0, 0], port)))
            .expect("tcp bind");
        let listener = sock.listen(4096).expect("listen");
        // One UDP socket per address: a reply must leave from the address the request
        // went to, or conntrack (the iptables and nftables variants) cannot match it.
        for addr in &udp_addrs {
            let udp = UdpSocket::bind((*addr, port)).await.expect("udp bind");
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                loop {
                    if let Ok((n, from)) = udp.recv_from(&mut buf).await {
                        let _ = udp.send_to(&buf[..n], from).await;
                    }
                }
            });
        }
        println!("ready");
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; size];
                if s.read_exact(&mut buf).await.is_ok() {
                    let _ = s.write_all(&buf).await;
                }
            });
        }
    })
}

/// Runs one load in `netns` (and `cgroup`, for ferry's socket hooks); parses its line.
pub(crate) fn run(
    netns: &str,
    cgroup: Option<&std::path::Path>,
    spec: &Spec,
) -> Result<Outcome, String> {
    let mut cmd = Command::new(std::env::current_exe().map_err(|e| e.to_string())?);
    cmd.args(spec.args())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = crate::cleanup::Proc::new(ferry_tests::spawn_in(netns, cgroup, &mut cmd));
    let out = wait_output(child, spec.warmup + spec.duration + Duration::from_secs(30))?;
    let line = String::from_utf8_lossy(&out);
    let v: Value = serde_json::from_str(line.trim())
        .map_err(|e| format!("loadgen in {netns} printed {line:?}: {e}"))?;
    Outcome::from_json(&v)
}

/// Waits (at most `within`) for a child and returns its stdout; fails with its stderr.
fn wait_output(mut p: crate::cleanup::Proc, within: Duration) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let deadline = Instant::now() + within;
    loop {
        match p.child.try_wait() {
            Ok(Some(st)) => {
                let mut out = Vec::new();
                let mut err = String::new();
                if let Some(o) = p.child.stdout.as_mut() {
                    let _ = o.read_to_end(&mut out);
                }
                if let Some(e) = p.child.stderr.as_mut() {
                    let _ = e.read_to_string(&mut err);
                }
                if !st.success() {
                    return Err(format!("loadgen failed ({st}): {err}"));
                }
                return Ok(out);
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => return Err(format!("loadgen did not finish within {within:?}")),
        }
    }
}
