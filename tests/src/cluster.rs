//! A cluster in network namespaces: several "node" namespaces with their pods, one
//! shared L2 LAN, external clients on that LAN, and one ferry agent per node.
//!
//! Layout (`N` = node number from 1, `J` = pod number on its node from 1, `ID` = unique
//! per cluster, so leftovers of a crashed run never collide):
//!
//! ```text
//!  ID-lan: bridge br0 (no address), ports nN (-> node N's eth0) and cI (-> client I's eth0)
//!  ID-nN   node N "nodeN":  eth0 192.168.77.N/24, fd00:77::N/64
//!          pJ (veth to pod J) 10.201.N.1/32, fd00:201:N::1/128 (the pods' gateway)
//!          routes: 10.201.M.0/24 via 192.168.77.M, fd00:201:M::/64 via fd00:77::M (M != N)
//!          ip_forward and IPv6 forwarding on, rp_filter off
//!  ID-nNpJ pod "nNpJ":     eth0 10.201.N.(J+1)/32, fd00:201:N::(J+1)/128, default via the
//!          node; serves ferry-testsrv on the cluster's ports (TCP and UDP)
//!  ID-cI   client I:       eth0 192.168.77.(99+I)/24, fd00:77::(0x100+I-1)/64;
//!          routes to every pod CIDR via its node (pods are reachable directly, as
//!          in a flat routed network)
//! ```
//!
//! Node N's agent runs inside `ID-nN` with its own cgroup v2 child
//! (`<cgroup2>/ferry-test-ID-nN`), its own bpffs directory
//! (`/sys/fs/bpf/ferry-test-ID-nN`), `--devices eth0`, `--node-name nodeN`, `--node-ip`
//! its LAN addresses, `/healthz` on `127.0.0.1:10256` and `/metrics` on
//! `127.0.0.1:10249` of its namespace. All agents watch one manifests directory; the
//! EndpointSlices say where each endpoint runs (`nodeName`). Pod servers are in no
//! agent cgroup; clients that should go through a node's socket hooks are spawned in
//! that node's cgroup ([`Cluster::probe_pod`], [`Cluster::probe_node`]).
//!
//! Everything is removed on drop, also when the test panics.

use std::{
    collections::BTreeSet,
    fs,
    io::{BufRead, BufReader, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Output, Stdio},
    sync::{
        atomic::{AtomicU32, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use crate::world::{
    Outcome, bin, cgroup2_mount, eventually, http_get, require_kernel, sh, sh_quiet, spawn_in,
    start_testsrv,
};

static SEQ: AtomicU32 = AtomicU32::new(0);

/// Node `n`'s LAN address.
pub fn node_v4(n: usize) -> Ipv4Addr {
    Ipv4Addr::new(192, 168, 77, n as u8)
}
pub fn node_v6(n: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, n as u16)
}
/// External client `i`'s address (from 1): 192.168.77.100, .101, ...
pub fn client_v4(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(192, 168, 77, 99 + i as u8)
}
/// fd00:77::100, fd00:77::101, ...
pub fn client_v6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 0x100 + i as u16 - 1)
}
/// Pod `j` of node `n` (both from 1).
pub fn pod_v4(n: usize, j: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 201, n as u8, j as u8 + 1)
}
pub fn pod_v6(n: usize, j: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x201, n as u16, 0, 0, 0, 0, j as u16 + 1)
}

/// `ip:port` with brackets for IPv6.
pub fn hostport(ip: impl Into<IpAddr>, port: u16) -> String {
    std::net::SocketAddr::new(ip.into(), port).to_string()
}

pub struct Node {
    /// From 1.
    pub n: usize,
    /// `nodeN`, the `--node-name` and the EndpointSlices' `nodeName`.
    pub name: String,
    pub netns: String,
    pub v4: Ipv4Addr,
    pub v6: Ipv6Addr,
    /// The agent's cgroup: clients that should use this node's socket hooks go here.
    pub cgroup: PathBuf,
    pub bpffs: PathBuf,
    agent: Option<Child>,
    agent_log: PathBuf,
    agent_runs: u32,
}

pub struct ClusterPod {
    /// `nNpJ`: what ferry-testsrv answers with.
    pub name: String,
    /// The node it runs on (from 1).
    pub node: usize,
    pub netns: String,
    pub v4: Ipv4Addr,
    pub v6: Ipv6Addr,
    server: Option<Child>,
}

pub struct ExtClient {
    pub name: String,
    pub netns: String,
    pub v4: Ipv4Addr,
    pub v6: Ipv6Addr,
}

pub struct Cluster {
    pub id: String,
    pub lan_ns: String,
    pub nodes: Vec<Node>,
    pub pods: Vec<ClusterPod>,
    pub clients: Vec<ExtClient>,
    pub manifests: PathBuf,
    pub workdir: PathBuf,
    /// Servers run in node namespaces ([`Cluster::serve_on_node`]), killed on drop.
    node_servers: Vec<Child>,
}

const HEALTH_PORT: u16 = 10256;
const METRICS_PORT: u16 = 10249;

fn netns_sysctls(ns: &str, forward: bool) {
    let mut s = String::from(
        "net.ipv6.conf.all.accept_dad=0 net.ipv6.conf.default.accept_dad=0 \
         net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0",
    );
    if forward {
        s.push_str(" net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1");
    }
    sh(&format!("ip netns exec {ns} sysctl -q -w {s}"));
}

impl Cluster {
    /// `pods_per_node[k]` pods on node `k+1`, each serving `ports` (TCP and UDP), and
    /// two external clients. No agent runs yet: see [`Cluster::start_agents`].
    pub fn new(test: &str, pods_per_node: &[usize], ports: &[u16]) -> Cluster {
        Self::build(test, pods_per_node, ports, true)
    }

    /// `nodes` nodes on the LAN without pods and without routes to each other's pod
    /// CIDRs: for the pod network (`ferry agent --pod-network`), which routes them, and
    /// [`Cluster::add_cni_pod`], which wires pods through the CNI plugin. Clients have no
    /// route to any pod CIDR (they stand for the internet).
    pub fn new_bare(test: &str, nodes: usize) -> Cluster {
        Self::build(test, &vec![0; nodes], &[], false)
    }

    fn build(test: &str, pods_per_node: &[usize], ports: &[u16], pod_routes: bool) -> Cluster {
        require_kernel();
        let id = format!(
            "fc{}{}",
            std::process::id() % 100000,
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let workdir = std::env::temp_dir().join(format!("ferry-cluster-{test}-{id}"));
        let _ = fs::remove_dir_all(&workdir);
        fs::create_dir_all(workdir.join("manifests")).expect("workdir");
        let mut c = Cluster {
            lan_ns: format!("{id}-lan"),
            nodes: Vec::new(),
            pods: Vec::new(),
            clients: Vec::new(),
            manifests: workdir.join("manifests"),
            workdir,
            id,
            node_servers: Vec::new(),
        };
        // From here on, a panic drops `c`, which removes what was made so far.
        sh(&format!("ip netns add {}", c.lan_ns));
        netns_sysctls(&c.lan_ns, false);
        sh(&format!(
            "ip -n {0} link set lo up && ip -n {0} link add br0 type bridge mcast_snooping 0 && ip -n {0} link set br0 up",
            c.lan_ns
        ));
        let cgroot = cgroup2_mount();
        for (k, &pods) in pods_per_node.iter().enumerate() {
            let n = k + 1;
            let netns = format!("{}-n{n}", c.id);
            let node = Node {
                n,
                name: format!("node{n}"),
                v4: node_v4(n),
                v6: node_v6(n),
                cgroup: cgroot.join(format!("ferry-test-{}-n{n}", c.id)),
                bpffs: PathBuf::from(format!("/sys/fs/bpf/ferry-test-{}-n{n}", c.id)),
                agent: None,
                agent_log: c.workdir.join(format!("agent-node{n}.log")),
                agent_runs: 0,
                netns: netns.clone(),
            };
            sh(&format!("ip netns add {netns}"));
            c.nodes.push(node);
            netns_sysctls(&netns, true);
            c.plug(&netns, &format!("n{n}"), node_v4(n), node_v6(n));
            fs::create_dir_all(&c.nodes[k].cgroup)
                .unwrap_or_else(|e| panic!("creating cgroup {}: {e}", c.nodes[k].cgroup.display()));
            for j in 1..=pods {
                c.add_pod(n, j, ports);
            }
        }
        for i in 1..=2 {
            let netns = format!("{}-c{i}", c.id);
            sh(&format!("ip netns add {netns}"));
            c.clients.push(ExtClient {
                name: format!("client{i}"),
                netns: netns.clone(),
                v4: client_v4(i),
                v6: client_v6(i),
            });
            netns_sysctls(&netns, false);
            c.plug(&netns, &format!("c{i}"), client_v4(i), client_v6(i));
        }
        if !pod_routes {
            return c;
        }
        // Pod CIDRs: every node and client routes the other nodes' pods via their node.
        let cidrs: Vec<(usize, String)> = (1..=c.nodes.len())
            .map(|m| {
                (
                    m,
                    format!(
                        "ip route add 10.201.{m}.0/24 via {} && ip -6 route add fd00:201:{m}::/64 via {}",
                        node_v4(m),
                        node_v6(m)
                    ),
                )
            })
            .collect();
        let mut spaces: Vec<(usize, String)> =
            c.nodes.iter().map(|n| (n.n, n.netns.clone())).collect();
        spaces.extend(c.clients.iter().map(|cl| (0, cl.netns.clone())));
        for (own, ns) in spaces {
            for (m, cmd) in &cidrs {
                if *m != own {
                    sh(&format!("ip netns exec {ns} bash -c '{cmd}'"));
                }
            }
        }
        c
    }

    /// `eth0` in `netns`, its peer `port` on the LAN bridge, with the two addresses.
    fn plug(&self, netns: &str, port: &str, v4: Ipv4Addr, v6: Ipv6Addr) {
        sh(&format!(
            "ip -n {lan} link add {port} type veth peer name eth0 netns {netns} && \
             ip -n {lan} link set {port} master br0 up && \
             ip -n {netns} link set lo up && ip -n {netns} link set eth0 up && \
             ip -n {netns} addr add {v4}/24 dev eth0 && ip -n {netns} addr add {v6}/64 dev eth0 nodad",
            lan = self.lan_ns
        ));
    }

    fn add_pod(&mut self, n: usize, j: usize, ports: &[u16]) {
        let name = format!("n{n}p{j}");
        let netns = format!("{}-{name}", self.id);
        let node_ns = self.nodes[n - 1].netns.clone();
        let (v4, v6) = (pod_v4(n, j), pod_v6(n, j));
        sh(&format!("ip netns add {netns}"));
        // Register before configuring, so that a failure below still removes it.
        self.pods.push(ClusterPod {
            name: name.clone(),
            node: n,
            netns: netns.clone(),
            v4,
            v6,
            server: None,
        });
        netns_sysctls(&netns, false);
        sh(&format!(
            "ip -n {node_ns} link add p{j} type veth peer name eth0 netns {netns} && \
             ip -n {node_ns} link set p{j} up && \
             ip -n {node_ns} addr add 10.201.{n}.1/32 dev p{j} && \
             ip -n {node_ns} addr add fd00:201:{n}::1/128 dev p{j} nodad && \
             ip -n {node_ns} route add {v4}/32 dev p{j} && \
             ip -n {node_ns} -6 route add {v6}/128 dev p{j} && \
             ip -n {netns} link set lo up && ip -n {netns} link set eth0 up && \
             ip -n {netns} addr add {v4}/32 dev eth0 && ip -n {netns} addr add {v6}/128 dev eth0 nodad && \
             ip -n {netns} route add 10.201.{n}.1/32 dev eth0 && \
             ip -n {netns} route add default via 10.201.{n}.1 dev eth0 && \
             ip -n {netns} -6 route add fd00:201:{n}::1/128 dev eth0 && \
             ip -n {netns} -6 route add default via fd00:201:{n}::1 dev eth0"
        ));
        self.pods.last_mut().unwrap().server = Some(start_testsrv(&netns, &name, ports));
    }

    /// Node `n`'s pod CIDRs under the pod network: 10.202.N.0/24 and fd00:202:N::/64.
    pub fn cni_pod_cidrs(n: usize) -> (String, String) {
        (format!("10.202.{n}.0/24"), format!("fd00:202:{n}::/64"))
    }

    /// The Node object of node `n` for the pod network (pod CIDRs, InternalIPs).
    pub fn node_manifest(&self, n: usize) -> String {
        let (v4, v6) = Self::cni_pod_cidrs(n);
        let node = self.node(n);
        format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {}\nspec:\n  podCIDR: {v4}\n  podCIDRs: [{v4}, \"{v6}\"]\nstatus:\n  addresses:\n  - {{type: InternalIP, address: {}}}\n  - {{type: InternalIP, address: \"{}\"}}\n  - {{type: Hostname, address: {}}}\n",
            node.name, node.v4, node.v6, node.name
        )
    }

    /// Node `n`'s CNI directories: (configuration, plugins, address store).
    pub fn cni_dirs(&self, n: usize) -> (PathBuf, PathBuf, PathBuf) {
        let d = self.workdir.join(format!("cni-n{n}"));
        (d.join("net.d"), d.join("bin"), d.join("data"))
    }

    /// The agent flags that run node `n`'s pod network in its CNI directories.
    pub fn pod_network_args(&self, n: usize) -> Vec<String> {
        let (conf, bin_dir, data) = self.cni_dirs(n);
        vec![
            "--pod-network".into(),
            format!("--cni-conf-dir={}", conf.display()),
            format!("--cni-bin-dir={}", bin_dir.display()),
            format!("--cni-data-dir={}", data.display()),
            format!("--cni-plugin={}", bin("ferry-cni").display()),
        ]
    }

    /// A pod on node `n` wired as a container runtime would: its network namespace,
    /// then the plugin named by the agent's CNI configuration, run from the node's CNI
    /// bin directory with the CNI_* environment and that configuration on stdin. It
    /// serves `ports` like the other pods. Its addresses are the plugin's result.
    pub fn add_cni_pod(&mut self, n: usize, name: &str, ports: &[u16]) -> &ClusterPod {
        let netns = format!("{}-{name}", self.id);
        let node_ns = self.nodes[n - 1].netns.clone();
        let (conf_dir, bin_dir, _) = self.cni_dirs(n);
        let list: serde_json::Value = serde_json::from_str(
            &fs::read_to_string(conf_dir.join("10-ferry.conflist"))
                .unwrap_or_else(|e| panic!("node{n} has no CNI configuration yet: {e}")),
        )
        .expect("conflist is JSON");
        let mut conf = list["plugins"][0].clone();
        conf["cniVersion"] = list["cniVersion"].clone();
        conf["name"] = list["name"].clone();
        let plugin = bin_dir.join(conf["type"].as_str().expect("plugin type"));
        sh(&format!("ip netns add {netns}"));
        // Register before configuring, so that a failure below still removes it.
        self.pods.push(ClusterPod {
            name: name.to_string(),
            node: n,
            netns: netns.clone(),
            v4: Ipv4Addr::UNSPECIFIED,
            v6: Ipv6Addr::UNSPECIFIED,
            server: None,
        });
        sh(&format!("ip -n {netns} link set lo up"));
        let mut child = Command::new("ip")
            .args(["netns", "exec", &node_ns])
            .arg(&plugin)
            .env("CNI_COMMAND", "ADD")
            .env("CNI_CONTAINERID", format!("{}-{name}", self.id))
            .env("CNI_NETNS", format!("/var/run/netns/{netns}"))
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", &bin_dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("running {}: {e}", plugin.display()));
        child
            .stdin
            .take()
            .unwrap()
            .write_all(conf.to_string().as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let result = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "CNI ADD of {name} on node{n} failed: {result} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let result: serde_json::Value = serde_json::from_str(&result).expect("CNI result");
        for ip in result["ips"].as_array().expect("result ips") {
            let addr = ip["address"].as_str().unwrap();
            let host = addr.split('/').next().unwrap();
            let pod = self.pods.last_mut().unwrap();
            match host.parse::<IpAddr>().unwrap() {
                IpAddr::V4(a) => pod.v4 = a,
                IpAddr::V6(a) => pod.v6 = a,
            }
        }
        self.pods.last_mut().unwrap().server = Some(start_testsrv(&netns, name, ports));
        self.pods.last().unwrap()
    }

    /// Runs `ferry-testsrv NAME PORT...` in node `n`'s own namespace, outside any agent
    /// cgroup: a hostNetwork endpoint, answering on the node's addresses with `name`.
    /// Stopped when the cluster is dropped.
    pub fn serve_on_node(&mut self, n: usize, name: &str, ports: &[u16]) {
        let netns = self.node(n).netns.clone();
        let mut cmd = Command::new(bin("ferry-testsrv"));
        cmd.arg(name)
            .args(ports.iter().map(|p| p.to_string()))
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = spawn_in(&netns, None, &mut cmd);
        let stdout = child.stdout.take().unwrap();
        // Register before waiting, so that a failure below still stops it.
        self.node_servers.push(child);
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("testsrv ready line");
        assert_eq!(
            line.trim(),
            "ready",
            "test server {name} in node{n}'s namespace {netns} did not start"
        );
    }

    /// Node `n` (from 1).
    pub fn node(&self, n: usize) -> &Node {
        &self.nodes[n - 1]
    }

    pub fn pod(&self, name: &str) -> &ClusterPod {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod {name}"))
    }

    /// External client `i` (from 1).
    pub fn client(&self, i: usize) -> &ExtClient {
        &self.clients[i - 1]
    }

    pub fn write_manifest(&self, file: &str, content: &str) {
        crate::world::write_manifest(&self.manifests, file, content);
    }

    pub fn remove_manifest(&self, file: &str) {
        crate::world::remove_manifest(&self.manifests, file);
    }

    /// Starts every node's agent (with `extra` flags) and waits until each is ready.
    pub fn start_agents(&mut self, extra: &[&str]) {
        for n in 1..=self.nodes.len() {
            self.start_agent(n, extra);
        }
    }

    /// Starts node `n`'s agent and waits until its `/healthz` answers 200.
    pub fn start_agent(&mut self, n: usize, extra: &[&str]) {
        let manifests = self.manifests.clone();
        let node = &mut self.nodes[n - 1];
        assert!(node.agent.is_none(), "{}: agent already running", node.name);
        node.agent_runs += 1;
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.agent_log)
            .expect("agent log");
        let mut cmd = Command::new(bin("ferry"));
        cmd.arg("agent")
            .arg("--manifests")
            .arg(&manifests)
            .arg("--cgroup")
            .arg(&node.cgroup)
            .arg("--bpffs")
            .arg(&node.bpffs)
            .args(["--node-name", node.name.as_str(), "--devices", "eth0"])
            .arg("--node-ip")
            .arg(format!("{},{}", node.v4, node.v6))
            .arg("--health-addr")
            .arg(format!("127.0.0.1:{HEALTH_PORT}"))
            .arg("--metrics-addr")
            .arg(format!("127.0.0.1:{METRICS_PORT}"))
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        node.agent = Some(spawn_in(&node.netns, None, &mut cmd));
        let ns = node.netns.clone();
        let what = format!("{} agent /healthz 200", node.name);
        eventually(&what, Duration::from_secs(30), || {
            let node = &mut self.nodes[n - 1];
            if let Some(status) = node.agent.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "{} agent exited with {status} before it was ready:\n{}",
                    node.name,
                    fs::read_to_string(&node.agent_log).unwrap_or_default()
                );
            }
            let (code, body) = http_get(&ns, HEALTH_PORT, "/healthz")?;
            if code == 200 {
                Ok(())
            } else {
                Err(format!("{code} {body}"))
            }
        });
    }

    /// Stops node `n`'s agent with `signal` and waits for it to exit.
    pub fn stop_agent(&mut self, n: usize, signal: i32) -> std::process::ExitStatus {
        let node = &mut self.nodes[n - 1];
        let mut child = node.agent.take().expect("agent not running");
        // SAFETY: signalling our own child.
        unsafe { libc::kill(child.id() as i32, signal) };
        child.wait().expect("wait agent")
    }

    pub fn agent_log(&self, n: usize) -> String {
        fs::read_to_string(&self.node(n).agent_log).unwrap_or_default()
    }

    /// Node `n`'s `/metrics`.
    pub fn metrics(&self, n: usize) -> String {
        http_get(&self.node(n).netns, METRICS_PORT, "/metrics")
            .unwrap_or_else(|e| panic!("node{n} /metrics: {e}"))
            .1
    }

    /// `ferry_datapath_events_total{reason="<reason>"}` of node `n` (0 when absent).
    pub fn counter(&self, n: usize, reason: &str) -> u64 {
        metric_value(
            &self.metrics(n),
            "ferry_datapath_events_total",
            &format!("reason=\"{reason}\""),
        )
    }

    /// Waits until node `n`'s counter `reason` reaches `at_least` (the agent reads the
    /// BPF counters once per second); panics with every counter and `what` otherwise.
    pub fn expect_counter(&self, n: usize, reason: &str, at_least: u64, what: &str) {
        eventually(
            &format!("{what}: node{n} counter {reason} >= {at_least}"),
            Duration::from_secs(5),
            || {
                let v = self.counter(n, reason);
                if v >= at_least {
                    Ok(())
                } else {
                    Err(format!("{v}; all counters:\n{}", self.counters(n)))
                }
            },
        );
    }

    /// Every datapath counter of node `n`, for failure messages.
    pub fn counters(&self, n: usize) -> String {
        self.metrics(n)
            .lines()
            .filter(|l| l.starts_with("ferry_datapath_events_total"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Runs `ferry-probe MODE ADDR COUNT` (payload `payload`) in `netns`, inside
    /// `cgroup` when given.
    pub fn probe_in(
        netns: &str,
        cgroup: Option<&Path>,
        args: &[&str],
        payload: &str,
    ) -> Vec<Outcome> {
        let mut cmd = Command::new(bin("ferry-probe"));
        cmd.args(args)
            .env("FERRY_PROBE_PAYLOAD", payload)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let out = spawn_in(netns, cgroup, &mut cmd)
            .wait_with_output()
            .expect("probe");
        assert!(
            out.status.success(),
            "ferry-probe {args:?} in {netns} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| {
                serde_json::from_str(l).unwrap_or_else(|e| panic!("bad probe line {l:?}: {e}"))
            })
            .collect()
    }

    /// `count` `whoami` attempts (`mode` tcp, udp, udp-connected) from external client
    /// `i`: each reply is `<backend> <address the backend saw>`.
    pub fn probe_ext(&self, i: usize, mode: &str, addr: &str, count: usize) -> Vec<Outcome> {
        Self::probe_in(
            &self.client(i).netns,
            None,
            &[mode, addr, &count.to_string()],
            "whoami",
        )
    }

    /// The same from pod `pod`, inside its node's agent cgroup (socket hooks apply).
    pub fn probe_pod(&self, pod: &str, mode: &str, addr: &str, count: usize) -> Vec<Outcome> {
        let p = self.pod(pod);
        Self::probe_in(
            &p.netns,
            Some(&self.node(p.node).cgroup),
            &[mode, addr, &count.to_string()],
            "whoami",
        )
    }

    /// The same from node `n`'s own namespace, inside its agent cgroup.
    pub fn probe_node(&self, n: usize, mode: &str, addr: &str, count: usize) -> Vec<Outcome> {
        let node = self.node(n);
        Self::probe_in(
            &node.netns,
            Some(&node.cgroup),
            &[mode, addr, &count.to_string()],
            "whoami",
        )
    }

    /// Runs a real client (curl, socat, ...) from external client `i`.
    pub fn run_ext(&self, i: usize, program: &str, args: &[&str]) -> Output {
        run_in(&self.client(i).netns, None, program, args)
    }

    /// Routes `addr` (a LoadBalancer or external IP) to node `n` from every client.
    pub fn route_to_node(&self, addr: IpAddr, n: usize) {
        for c in &self.clients {
            let cmd = match addr {
                IpAddr::V4(a) => {
                    format!("ip -n {} route replace {a}/32 via {}", c.netns, node_v4(n))
                }
                IpAddr::V6(a) => format!(
                    "ip -n {} -6 route replace {a}/128 via {}",
                    c.netns,
                    node_v6(n)
                ),
            };
            sh(&cmd);
        }
    }

    /// Node `n`'s pinned conntrack map (`FERRY_CT` anywhere under its bpffs directory).
    pub fn ct_pin(&self, n: usize) -> Option<PathBuf> {
        find_file(&self.node(n).bpffs, ferry_common::ct::CT_MAP, 3)
    }

    /// Removes every entry of node `n`'s conntrack map; returns how many were removed.
    pub fn flush_ct(&self, n: usize) -> usize {
        use aya::maps::{HashMap, Map, MapData};
        use ferry_common::ct::{CtEntry, CtKey};
        let pin = self.ct_pin(n).unwrap_or_else(|| {
            panic!(
                "node{n}: no {} pinned under {}",
                ferry_common::ct::CT_MAP,
                self.node(n).bpffs.display()
            )
        });
        let data = MapData::from_pin(&pin).unwrap_or_else(|e| panic!("{}: {e}", pin.display()));
        let map = Map::from_map_data(data).unwrap_or_else(|e| panic!("{}: {e}", pin.display()));
        let mut ct: HashMap<MapData, CtKey, CtEntry> =
            HashMap::try_from(map).unwrap_or_else(|e| panic!("{}: {e}", pin.display()));
        let keys: Vec<CtKey> = ct.keys().filter_map(Result::ok).collect();
        let mut removed = 0;
        for k in &keys {
            if ct.remove(k).is_ok() {
                removed += 1;
            }
        }
        removed
    }

    /// Entries in node `n`'s conntrack map (0 when it is not pinned).
    pub fn ct_len(&self, n: usize) -> usize {
        use aya::maps::{HashMap, Map, MapData};
        use ferry_common::ct::{CtEntry, CtKey};
        let Some(pin) = self.ct_pin(n) else { return 0 };
        let Ok(map) = MapData::from_pin(&pin).and_then(Map::from_map_data) else {
            return 0;
        };
        let Ok(ct) = HashMap::<MapData, CtKey, CtEntry>::try_from(map) else {
            return 0;
        };
        ct.keys().count()
    }

    /// A line-oriented TCP session (socat) from external client `i` to `addr`, from
    /// source port `sport` when given.
    pub fn session_ext(&self, i: usize, addr: &str, sport: Option<u16>) -> Session {
        Session::start(&self.client(i).netns, None, addr, sport)
    }

    /// A `/metrics`-free summary of node `n` for failure messages: counters and the
    /// tail of its agent log.
    pub fn diag(&self, n: usize) -> String {
        let log = self.agent_log(n);
        let tail: Vec<&str> = log.lines().rev().take(15).collect();
        let counters = http_get(&self.node(n).netns, METRICS_PORT, "/metrics")
            .map(|(_, m)| {
                m.lines()
                    .filter(|l| l.starts_with("ferry_datapath_events_total"))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_else(|e| format!("(no metrics: {e})"));
        format!(
            "--- node{n} counters ---\n{counters}\n--- node{n} agent log (last lines) ---\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut a) = node.agent.take() {
                let _ = a.kill();
                let _ = a.wait();
            }
        }
        for p in &mut self.pods {
            if let Some(mut s) = p.server.take() {
                let _ = s.kill();
                let _ = s.wait();
            }
        }
        for mut s in self.node_servers.drain(..) {
            let _ = s.kill();
            let _ = s.wait();
        }
        for node in &self.nodes {
            sh_quiet(&format!(
                "{} cleanup --bpffs {}",
                bin("ferry").display(),
                node.bpffs.display()
            ));
            let _ = fs::remove_dir_all(&node.bpffs);
            crate::world::remove_cgroup(&node.cgroup);
        }
        for p in &self.pods {
            sh_quiet(&format!("ip netns del {}", p.netns));
        }
        for c in &self.clients {
            sh_quiet(&format!("ip netns del {}", c.netns));
        }
        for node in &self.nodes {
            sh_quiet(&format!("ip netns del {}", node.netns));
        }
        sh_quiet(&format!("ip netns del {}", self.lan_ns));
        if std::thread::panicking() {
            for node in &self.nodes {
                eprintln!(
                    "--- {} agent log ({}) ---\n{}",
                    node.name,
                    node.agent_log.display(),
                    fs::read_to_string(&node.agent_log).unwrap_or_default()
                );
            }
        }
        let _ = fs::remove_dir_all(&self.workdir);
    }
}

/// Runs `program args` in `netns` (inside `cgroup` when given) and collects its output.
pub fn run_in(netns: &str, cgroup: Option<&Path>, program: &str, args: &[&str]) -> Output {
    let mut cmd = Command::new(program);
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    spawn_in(netns, cgroup, &mut cmd)
        .wait_with_output()
        .unwrap_or_else(|e| panic!("{program} in {netns}: {e}"))
}

/// The value of the sample of `family` whose labels contain `label` (0 when absent).
pub fn metric_value(metrics: &str, family: &str, label: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(family) && l.contains(label))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .map(|v| v as u64)
        .sum()
}

fn find_file(dir: &Path, name: &str, depth: u32) -> Option<PathBuf> {
    let entries = fs::read_dir(dir).ok()?;
    let mut subdirs = Vec::new();
    for e in entries.flatten() {
        let p = e.path();
        if e.file_name() == name {
            return Some(p);
        }
        if p.is_dir() {
            subdirs.push(p);
        }
    }
    if depth == 0 {
        return None;
    }
    subdirs.sort();
    subdirs.iter().find_map(|d| find_file(d, name, depth - 1))
}

/// A long-lived TCP connection driven line by line (socat), killed on drop.
pub struct Session {
    child: Child,
    stdin: Option<ChildStdin>,
    rx: mpsc::Receiver<String>,
    pub what: String,
}

impl Session {
    /// Connects from `netns` to `addr` (`ip:port`, brackets for IPv6), from source port
    /// `sport` when given.
    pub fn start(netns: &str, cgroup: Option<&Path>, addr: &str, sport: Option<u16>) -> Session {
        let sa: std::net::SocketAddr = addr.parse().expect("session address ip:port");
        let mut target = format!(
            "{}:{}:{}",
            if sa.is_ipv4() { "TCP4" } else { "TCP6" },
            if sa.is_ipv4() {
                sa.ip().to_string()
            } else {
                format!("[{}]", sa.ip())
            },
            sa.port()
        );
        if let Some(p) = sport {
            target.push_str(&format!(",sourceport={p},reuseaddr"));
        }
        let mut cmd = Command::new("socat");
        cmd.args(["-T", "600", "STDIO", &target])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = spawn_in(netns, cgroup, &mut cmd);
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Session {
            stdin: child.stdin.take(),
            child,
            rx,
            what: format!("TCP session {netns} -> {addr}"),
        }
    }

    /// Sends `line` and waits up to `within` for one reply line.
    pub fn ask(&mut self, line: &str, within: Duration) -> Result<String, String> {
        // Drop replies that arrived late for an earlier question.
        while self.rx.try_recv().is_ok() {}
        let stdin = self.stdin.as_mut().ok_or("session closed")?;
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .and_then(|_| stdin.flush())
            .map_err(|e| format!("{}: write: {e}", self.what))?;
        let deadline = Instant::now() + within;
        match self
            .rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Ok(l) => Ok(l),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                Err(format!("{}: no reply within {within:?}", self.what))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = self.child.try_wait().ok().flatten();
                Err(format!(
                    "{}: connection closed (socat exit {status:?})",
                    self.what
                ))
            }
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The address the backend saw (second word of a `ferry-testsrv` `whoami` reply).
pub fn seen(o: &Outcome) -> Option<IpAddr> {
    let who = o.reply.as_deref()?.split_whitespace().nth(1)?;
    who.parse::<std::net::SocketAddr>().ok().map(|a| a.ip())
}

/// Every client address the backends saw (`none` for an attempt without reply).
pub fn seen_set(outs: &[Outcome]) -> BTreeSet<String> {
    outs.iter()
        .map(|o| seen(o).map_or("none".into(), |a| a.to_string()))
        .collect()
}

/// Asserts that every attempt got its reply.
pub fn all_ok(outs: &[Outcome], what: &str) {
    let bad: Vec<&Outcome> = outs.iter().filter(|o| !o.ok).collect();
    assert!(
        bad.is_empty(),
        "{what}: {} of {} attempts failed: {bad:?}",
        bad.len(),
        outs.len()
    );
}
