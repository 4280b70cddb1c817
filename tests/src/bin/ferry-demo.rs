//! `cargo xtask demo`: ferry at work in a small world of network namespaces.
//!
//! A "node" namespace with three "pods" serving HTTP and UDP, Services and
//! EndpointSlices written to a manifests directory, the real agent, and real clients.
//! Everything is removed at the end, also on Ctrl-C.

use std::{collections::BTreeMap, time::Duration};

use ferry_tests::*;

const WEB: &str = "10.96.0.10";
const DNS: &str = "10.96.0.53";
const EMPTY: &str = "10.96.0.99";

fn main() {
    // Ctrl-C: block SIGINT/SIGTERM everywhere and wait for them on one thread, which
    // tears the world down and exits; Drop cannot run when a signal kills the process.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: plain sigset manipulation on our own stack value.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    let teardown: std::sync::Arc<std::sync::Mutex<Option<Teardown>>> = Default::default();
    let t = teardown.clone();
    std::thread::spawn(move || {
        let mut sig = 0;
        // SAFETY: waits on the signals blocked above.
        unsafe { libc::sigwait(&set, &mut sig) };
        println!("\ninterrupted: removing the demo world");
        if let Some(t) = t.lock().unwrap().as_ref() {
            t.run();
        }
        std::process::exit(130);
    });

    println!(
        "ferry demo: one node, three pods (HTTP :8080, UDP :5353), Services in a manifests directory\n"
    );
    let mut w = World::new("demo", 3, &[8080, 5353]);
    let eps: Vec<Ep> = w.pods.iter().map(|p| ep(p.v4)).collect();
    let web = |eps: &[Ep]| {
        docs(&[
            service("web", &[WEB], &[("http", 80, "TCP")], ""),
            slice("web", "web-1", "IPv4", &[("http", 8080, "TCP")], eps),
        ])
    };
    w.write_manifest("web.yaml", &web(&eps));
    w.write_manifest(
        "dns.yaml",
        &docs(&[
            service("dns", &[DNS], &[("dns", 53, "UDP")], ""),
            slice("dns", "dns-1", "IPv4", &[("dns", 5353, "UDP")], &eps),
        ]),
    );
    w.write_manifest(
        "empty.yaml",
        &docs(&[
            service("empty", &[EMPTY], &[("http", 80, "TCP")], ""),
            slice("empty", "empty-1", "IPv4", &[("http", 8080, "TCP")], &[]),
        ]),
    );
    w.start_agent(&[]);
    *teardown.lock().unwrap() = Some(w.teardown());
    let log = w.agent_log();
    let ready = log
        .lines()
        .find_map(|l| l.split_once("ready: "))
        .map(|(_, r)| r.split(" services=").next().unwrap_or(r));
    println!("agent ready: {}", ready.unwrap_or("(see the agent log)"));

    let spread = |w: &World| -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for _ in 0..30 {
            let out = w.client(
                "curl",
                &["-s", "--max-time", "2", &format!("http://{WEB}/")],
            );
            let body = String::from_utf8_lossy(&out.stdout).trim().to_string();
            *counts
                .entry(if body.is_empty() {
                    "failed".into()
                } else {
                    body
                })
                .or_default() += 1;
        }
        counts
    };
    println!(
        "\n1. 30 x curl http://{WEB}/ (ClusterIP web:80 -> pods :8080): {:?}",
        spread(&w)
    );

    w.write_manifest("web.yaml", &web(&eps[..2]));
    let took = std::time::Instant::now();
    eventually("pod3 removed", Duration::from_secs(3), || {
        let seen: Vec<_> = w
            .probe("tcp", &format!("{WEB}:80"), 20)
            .iter()
            .filter_map(|o| o.backend().map(String::from))
            .collect();
        if seen.iter().any(|b| b == "pod3") {
            Err(format!("{seen:?}"))
        } else {
            Ok(())
        }
    });
    println!(
        "2. pod3 removed from the EndpointSlice: in effect after {} ms; 30 x curl: {:?}",
        took.elapsed().as_millis(),
        spread(&w)
    );

    let refused = &w.probe("tcp", &format!("{EMPTY}:80"), 1)[0];
    println!(
        "3. connect to {EMPTY}:80 (Service without endpoints): {} after {} ms",
        refused.error.as_deref().unwrap_or("connected?!"),
        refused.ms
    );

    let udp = &w.probe("udp", &format!("{DNS}:53"), 1)[0];
    println!(
        "4. UDP datagram to {DNS}:53: reply {:?} from {} (the application sees the Service address)",
        udp.reply.as_deref().unwrap_or("none"),
        udp.from.as_deref().unwrap_or("nowhere")
    );

    let list = std::process::Command::new(bin("ferry"))
        .arg("list")
        .arg("--bpffs")
        .arg(&w.bpffs)
        .output()
        .expect("ferry list");
    println!(
        "\n`ferry list` now:\n{}",
        String::from_utf8_lossy(&list.stdout)
    );
    drop(w);
    println!("demo world removed (namespaces, cgroup, pins)");
}
