//! `ferry`: agent, list, explain, cleanup, takeover (DESIGN.md §4). Exit codes: 0 ok, 1 runtime
//! failure, 2 usage or configuration error; `explain` exits 3 when the address is not a
//! Service frontend.

use std::{net::IpAddr, path::PathBuf, process::ExitCode};

use anyhow::{Context, Result, anyhow};
use clap::{Parser, Subcommand, ValueEnum};
use ferry::{
    agent::{self, AgentConfig, SourceConfig},
    dataplane::{self, Capacity, KernelMaps, LoadOptions, loader::MAX_CAPACITY},
    explain, list, node,
    source::manifests,
    takeover,
};
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(name = "ferry", version, about = "eBPF kube-proxy replacement")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the dataplane in the foreground.
    Agent(Box<AgentArgs>),
    /// Show what the kernel is doing now, from the pinned maps.
    List {
        #[arg(long, default_value = "/sys/fs/bpf/ferry")]
        bpffs: PathBuf,
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Output,
    },
    /// Explain what a new connection to a Service address would do, and why, from the
    /// pinned maps (no agent needed). Exit code 0: a Service frontend (whatever its
    /// verdict); 3: not a Service frontend.
    Explain {
        /// The frontend as ADDR:PORT/PROTO (PROTO tcp or udp, default tcp; IPv6 as
        /// [ADDR]:PORT/PROTO).
        target: String,
        /// The client's address. Affinity is keyed by network namespace, not IP: run
        /// explain inside the client's namespace to see its own entry. For a frontend
        /// reached from outside the node: the source-range verdict.
        #[arg(long)]
        from: Option<IpAddr>,
        /// The client's source port (with --from): which backend the tc path's Maglev
        /// table picks for that flow.
        #[arg(long, requires = "from")]
        from_port: Option<u16>,
        #[arg(long, default_value = "/sys/fs/bpf/ferry")]
        bpffs: PathBuf,
        #[arg(short = 'o', long = "output", value_enum, default_value = "text")]
        output: ExplainOutput,
    },
    /// Remove the rules a kube-proxy left on this node, and only kube-proxy's: its
    /// iptables chains and the jumps to them (iptables-legacy and iptables-nft, IPv4 and
    /// IPv6; tables nat, filter, mangle; one atomic restore per table) and its nftables
    /// tables `ip kube-proxy` and `ip6 kube-proxy`. The kubelet's chains (KUBE-FIREWALL,
    /// KUBE-KUBELET-CANARY, KUBE-MARK-DROP) and all other rules stay. Idempotent. Run it
    /// once ferry serves the Services (or use `agent --takeover-kube-proxy`).
    Takeover {
        /// Print what would be removed, change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Detach everything and remove the pins. Idempotent.
    Cleanup {
        #[arg(long, default_value = "/sys/fs/bpf/ferry")]
        bpffs: PathBuf,
        /// Accepted for symmetry with `agent`; links are found through the pins.
        #[arg(long)]
        cgroup: Option<PathBuf>,
        /// Devices whose tc programs to detach; every device's pinned tc links are
        /// removed either way.
        #[arg(long, value_delimiter = ',')]
        devices: Vec<String>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Clone, Copy, ValueEnum)]
enum ExplainOutput {
    Text,
    Json,
}

#[derive(clap::Args)]
struct AgentArgs {
    /// Directory of Service and EndpointSlice manifests (watched).
    #[arg(long)]
    manifests: Option<PathBuf>,
    /// Watch the Kubernetes API through this kubeconfig (in-cluster config is used when
    /// neither source flag is given and KUBERNETES_SERVICE_HOST is set).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// This node's name (endpoints with this nodeName are local).
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// cgroup v2 directory for the socket hooks (default: the cgroup2 mount).
    #[arg(long)]
    cgroup: Option<PathBuf>,
    /// bpffs directory where maps and links are pinned.
    #[arg(long, default_value = "/sys/fs/bpf/ferry")]
    bpffs: PathBuf,
    /// Devices for the tc programs, which serve NodePorts, externalIPs and LoadBalancer
    /// IPs to traffic from outside the node (default: the devices that carry the node
    /// addresses, never lo).
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// The node's addresses, primary of each family first (default: every local address
    /// except loopback, followed live).
    #[arg(long, value_delimiter = ',')]
    node_ip: Vec<IpAddr>,
    /// Which node addresses serve NodePorts: CIDRs (a family without one keeps all its
    /// addresses) or `primary` (kube-proxy's --nodeport-addresses; default: all).
    #[arg(long, value_delimiter = ',')]
    nodeport_addresses: Vec<String>,
    #[arg(long, default_value = "0.0.0.0:10256")]
    health_addr: std::net::SocketAddr,
    #[arg(long, default_value = "127.0.0.1:10249")]
    metrics_addr: std::net::SocketAddr,
    /// Upper bound of the service map: one entry per frontend plus one per backend slot.
    /// The maps are sized from what the first sync needs and grow live (without a gap in
    /// service) when they are 80 % full, never beyond this bound; ServicePorts that still
    /// do not fit are reported (log, `ferry_plan_errors`). The default fits about 200,000
    /// Services with 4 endpoints.
    #[arg(long, default_value_t = 1 << 20, value_parser = clap::value_parser!(u32).range(1..=MAX_CAPACITY as i64))]
    max_services: u32,
    /// Upper bound of the backend map (distinct address, port, protocol); grows like the
    /// service map.
    #[arg(long, default_value_t = 1 << 20, value_parser = clap::value_parser!(u32).range(1..=MAX_CAPACITY as i64))]
    max_backends: u32,
    /// Session-affinity and UDP stickiness entries (LRU); also the size of the tc path's
    /// ClientIP affinity map (one entry per external client and ServicePort).
    #[arg(long, default_value_t = 65536, value_parser = clap::value_parser!(u32).range(1..))]
    max_affinity: u32,
    /// UDP sockets' reverse-translation entries (LRU; TCP uses fixed per-socket slots).
    #[arg(long, default_value_t = 262144, value_parser = clap::value_parser!(u32).range(1..))]
    max_revnat: u32,
    /// tc conntrack entries (LRU; two per flow from outside the node).
    #[arg(long, default_value_t = 262144, value_parser = clap::value_parser!(u32).range(2..))]
    max_conntrack: u32,
    /// Replace a kube-proxy on a live node: once the first sync is written (ferry serves
    /// new connections), remove kube-proxy's iptables chains (legacy and nft backends,
    /// IPv4 and IPv6) and its `kube-proxy` nftables tables, as `ferry takeover` does.
    /// Established connections keep their NAT; the kubelet's and others' rules stay. A
    /// failure is logged and shown in /metrics (`ferry_kube_proxy_takeover_failed`),
    /// and the agent keeps running. It looks again 30 s, 2 min and 7 min later, in case
    /// kube-proxy was still running and wrote its rules back.
    #[arg(long)]
    takeover_kube_proxy: bool,
    /// Run the pod network too: write the CNI configuration once this node's Node has
    /// spec.podCIDRs, install the ferry-cni plugin, route to every other node's pod CIDRs
    /// via its InternalIP, and masquerade pod traffic leaving the cluster
    /// (docs/pod-network.md). Nodes come from the same source as Services.
    #[arg(long)]
    pod_network: bool,
    /// Route Services (the default). `false` with --pod-network runs the pod network only
    /// and leaves Services to a kube-proxy: no BPF program is loaded.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    service_routing: bool,
    /// Where the container runtime reads CNI configurations (--pod-network).
    #[arg(long, default_value = "/etc/cni/net.d")]
    cni_conf_dir: PathBuf,
    /// Where the container runtime finds CNI plugins (--pod-network).
    #[arg(long, default_value = "/opt/cni/bin")]
    cni_bin_dir: PathBuf,
    /// The plugin's address store, written into the CNI configuration (--pod-network).
    #[arg(long, default_value = "/var/lib/ferry/cni")]
    cni_data_dir: PathBuf,
    /// The ferry-cni binary to install (default: the one next to this executable).
    #[arg(long)]
    cni_plugin: Option<PathBuf>,
    /// How pods reach other nodes' pods (--pod-network): `none` routes natively via the
    /// nodes' InternalIPs (the nodes share a link); `vxlan` encapsulates in ferry's VXLAN
    /// device (nodes in different L2 segments), and pods get the MTU minus its overhead.
    #[arg(long, value_enum, default_value = "none")]
    overlay: OverlayArg,
    /// MTU of the node's network; pods get it (--pod-network).
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u32).range(1280..=65535))]
    mtu: u32,
    /// Masquerade pod traffic to destinations outside the cluster (--pod-network). Turn
    /// off where the infrastructure routes pod CIDRs natively.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    masquerade: bool,
    /// Destinations that keep the pod's source address besides the cluster's pod CIDRs
    /// and node addresses (e.g. the Service CIDR or peered networks).
    #[arg(long, value_delimiter = ',')]
    no_masquerade_cidrs: Vec<String>,
    /// Seconds between two checks of the pod network's routes, files and rules when
    /// nothing changed (what someone removed comes back then).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pod_network_resync: u64,
    /// Forward pod-to-pod packets at tc (eBPF on the pods' host veths and the uplinks)
    /// instead of through the node's forwarding path (--pod-network).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pod_network_fast_path: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum OverlayArg {
    None,
    Vxlan,
}

/// A usage or configuration error: exit code 2.
#[derive(Debug)]
struct UsageError(String);
impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for UsageError {}

fn usage(msg: impl Into<String>) -> anyhow::Error {
    anyhow!(UsageError(msg.into()))
}

fn main() -> ExitCode {
    // One malloc arena: the agent does not contend on allocation, and with an arena per
    // thread memory freed by one thread (the kernel BTF parsed while loading) is not
    // reused by another (the first list), which adds up at the peak.
    // Blocks of 128 KiB and more (list pages, the decoder's buffers, tables being grown)
    // are mapped apart and returned when freed. glibc raises this threshold to the size
    // of each large block freed, after which such blocks come from the heap and leave
    // holes there that stay resident: 3.6 MiB of the peak at 30000x4.
    // SAFETY: mallopt only tunes glibc's allocator; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Agent(args) => run_agent(*args),
        Cmd::List { bpffs, output } => run_list(&bpffs, output),
        Cmd::Cleanup { bpffs, devices, .. } => run_cleanup(&bpffs, &devices),
        Cmd::Takeover { dry_run } => run_takeover(dry_run),
        Cmd::Explain {
            target,
            from,
            from_port,
            bpffs,
            output,
        } => match run_explain(&target, from, from_port, &bpffs, output) {
            Ok(code) => return code,
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry: error: {e:#}");
            if e.downcast_ref::<UsageError>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

/// The cgroup v2 mount, from /proc/self/mounts.
fn default_cgroup() -> Result<PathBuf> {
    let mounts =
        std::fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() > 2 && f[2] == "cgroup2").then(|| PathBuf::from(f[1]))
        })
        .next()
        .ok_or_else(|| {
            usage("--cgroup: no cgroup2 filesystem is mounted; mount one or pass --cgroup DIR")
        })
}

fn run_agent(a: AgentArgs) -> Result<()> {
    let in_cluster = std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    let source = match (&a.manifests, &a.kubeconfig) {
        (Some(_), Some(_)) => {
            return Err(usage("give exactly one of --manifests and --kubeconfig"));
        }
        (Some(dir), None) => {
            manifests::check_dir(dir).map_err(|e| usage(e.to_string()))?;
            SourceConfig::Manifests(dir.clone())
        }
        (None, Some(path)) => {
            if !path.is_file() {
                return Err(usage(format!(
                    "--kubeconfig {}: no such file",
                    path.display()
                )));
            }
            SourceConfig::Kube {
                kubeconfig: Some(path.clone()),
            }
        }
        (None, None) if in_cluster => SourceConfig::Kube { kubeconfig: None },
        (None, None) => {
            return Err(usage(
                "no source: give --manifests DIR or --kubeconfig PATH (or run in-cluster, with KUBERNETES_SERVICE_HOST set)",
            ));
        }
    };
    let cgroup = match a.cgroup {
        Some(c) => c,
        None => default_cgroup()?,
    };
    if !cgroup.join("cgroup.procs").exists() {
        return Err(usage(format!(
            "--cgroup {}: not a cgroup v2 directory (no cgroup.procs)",
            cgroup.display()
        )));
    }
    let nodeport_addresses = ferry::model::NodePortAddresses::parse(&a.nodeport_addresses)
        .map_err(|e| usage(format!("--nodeport-addresses: {e}")))?;
    let node_ips = if a.node_ip.is_empty() {
        None
    } else {
        Some(a.node_ip.clone())
    };
    if let Some(bad) = node_ips
        .iter()
        .flatten()
        .find(|ip| !node::usable_for_nodeport(ip))
    {
        return Err(usage(format!(
            "--node-ip {bad}: loopback, link-local and unspecified addresses never serve NodePorts"
        )));
    }
    let devices = tc_devices(&a.devices, node_ips.as_deref())?;
    tracing::info!(devices = ?devices, "tc devices");
    let node_name = a.node_name.unwrap_or_else(node::hostname);
    if !a.service_routing && !a.pod_network {
        return Err(usage(
            "--service-routing=false: with neither Service routing nor --pod-network the agent has nothing to do",
        ));
    }
    if !a.service_routing && a.takeover_kube_proxy {
        return Err(usage(
            "--takeover-kube-proxy with --service-routing=false would remove the rules of the kube-proxy that routes Services",
        ));
    }
    let pod_network = if a.pod_network {
        let mut no_masquerade = Vec::new();
        for text in &a.no_masquerade_cidrs {
            no_masquerade.push(text.parse().map_err(|e| {
                usage(format!(
                    "--no-masquerade-cidrs: {text:?} is not a CIDR ({e})"
                ))
            })?);
        }
        let plugin = a
            .cni_plugin
            .clone()
            .unwrap_or_else(ferry::podnet::install::default_plugin);
        if !plugin.is_file() {
            return Err(usage(format!(
                "--pod-network: the CNI plugin {} does not exist (build it with `cargo xtask build`, or give --cni-plugin)",
                plugin.display()
            )));
        }
        Some(ferry::podnet::PodNetConfig {
            node_name: node_name.clone(),
            cni_conf_dir: a.cni_conf_dir.clone(),
            cni_bin_dir: a.cni_bin_dir.clone(),
            cni_data_dir: a.cni_data_dir.clone(),
            plugin,
            mtu: a.mtu,
            overlay: matches!(a.overlay, OverlayArg::Vxlan),
            masquerade: a.masquerade,
            no_masquerade,
            report_ready: false,
            resync: std::time::Duration::from_secs(a.pod_network_resync),
            fast_path: a.pod_network_fast_path,
        })
    } else {
        None
    };
    let bound = Capacity {
        services: a.max_services,
        backends: a.max_backends,
    };
    let cfg = AgentConfig {
        source,
        node_name,
        node_ips,
        nodeport_addresses,
        load: LoadOptions {
            bpffs: a.bpffs,
            cgroup,
            capacity: dataplane::growth::initial(dataplane::growth::floor(), bound),
            bound,
            affinity_entries: a.max_affinity,
            revnat_entries: a.max_revnat,
            devices,
            conntrack_entries: a.max_conntrack,
        },
        health_addr: a.health_addr,
        metrics_addr: a.metrics_addr,
        takeover_kube_proxy: a.takeover_kube_proxy,
        pod_network,
        service_routing: a.service_routing,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(agent::run(cfg)).map_err(|e| match e {
        agent::AgentError::Listen { .. } | agent::AgentError::Source(_) => usage(e.to_string()),
        agent::AgentError::Loader(dataplane::loader::LoaderError::Cgroup { .. })
        | agent::AgentError::Loader(dataplane::loader::LoaderError::Bpffs { .. }) => {
            usage(e.to_string())
        }
        other => anyhow!(other),
    })
}

/// `--devices` as given (each must exist), or the devices that carry the node addresses.
fn tc_devices(given: &[String], node_ips: Option<&[IpAddr]>) -> Result<Vec<String>> {
    if !given.is_empty() {
        if let Some(missing) = given.iter().find(|d| node::ifindex(d).is_none()) {
            return Err(usage(format!("--devices {missing}: no such device")));
        }
        return Ok(given.to_vec());
    }
    let addrs = node::interface_addresses().context("reading interface addresses")?;
    let node_ips: Vec<IpAddr> = match node_ips {
        Some(ips) => ips.to_vec(),
        None => addrs.iter().map(|(_, ip)| *ip).collect(),
    };
    Ok(node::default_devices(&addrs, &node_ips))
}

/// The pinned maps of this build's layout, with an error that says what is pinned instead.
fn open_maps(bpffs: &std::path::Path) -> Result<KernelMaps> {
    let version = dataplane::loader::layout_version();
    let dir = dataplane::loader::maps_dir(bpffs, version);
    KernelMaps::open_pinned(&dir).map_err(|(map, e)| {
        let others = dataplane::loader::other_layouts(bpffs, version);
        if let Some((v, _)) = others.first() {
            anyhow!(
                "--bpffs {}: the pinned maps use layout v{v}, this ferry reads v{version}; run the matching ferry, or start this agent once to migrate",
                bpffs.display()
            )
        } else {
            anyhow!(
                "--bpffs {}: cannot open pinned map {map} ({e}); is an agent running with this --bpffs?",
                bpffs.display()
            )
        }
    })
}

fn run_list(bpffs: &std::path::Path, output: Output) -> Result<()> {
    let maps = open_maps(bpffs)?;
    let content = maps.read().context("reading the pinned maps")?;
    let external = maps.read_external().context("reading the pinned tc maps")?;
    let view = list::view(&content, &external, &maps.counters());
    match output {
        Output::Table => print!("{}", list::table(&view)),
        Output::Json => println!("{}", serde_json::to_string_pretty(&view)?),
    }
    Ok(())
}

/// `ferry explain`: reads the live maps, the logic is `explain::explain`.
fn run_explain(
    target: &str,
    from: Option<IpAddr>,
    from_port: Option<u16>,
    bpffs: &std::path::Path,
    output: ExplainOutput,
) -> Result<ExitCode> {
    let query: explain::Query = target
        .parse()
        .map_err(|e: String| usage(format!("explain {target}: {e}")))?;
    let maps = open_maps(bpffs)?;
    let content = maps.read().context("reading the pinned maps")?;
    let affinity = maps.affinity_entries();
    let tc_affinity = maps.tc_affinity_entries();
    let connections = maps.service_connections();
    let external = maps.read_external().context("reading the pinned tc maps")?;
    let live = explain::Live {
        content: &content,
        affinity: &affinity,
        tc_affinity: &tc_affinity,
        connections: &connections,
        now_ns: explain::sys::monotonic_ns(),
        external: &external,
        flow_ports: maps.external.as_ref().and_then(|e| e.flow_ports()),
    };
    let client = explain::Client {
        from,
        from_is_here: from.is_some_and(explain::sys::is_local_address),
        own_netns: explain::sys::own_netns_cookie(),
        from_port,
    };
    let e = explain::explain(&live, &query, &client);
    match output {
        ExplainOutput::Text => print!("{}", explain::text(&e)),
        ExplainOutput::Json => println!("{}", serde_json::to_string_pretty(&e)?),
    }
    Ok(if e.found {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(explain::EXIT_NOT_A_FRONTEND)
    })
}

fn run_cleanup(bpffs: &std::path::Path, devices: &[String]) -> Result<()> {
    let removed =
        dataplane::cleanup(bpffs).with_context(|| format!("cleaning up {}", bpffs.display()))?;
    if !devices.is_empty() {
        // The pins are the attachments: removing them detached every device's programs.
        println!("tc programs detached from {}", devices.join(", "));
    }
    if removed.is_empty() {
        println!("nothing to clean up in {}", bpffs.display());
    } else {
        println!(
            "removed {} pins from {} (programs detached)",
            removed.len(),
            bpffs.display()
        );
    }
    Ok(())
}

/// `ferry takeover`: the logic is `takeover::run`; a summary line per backend and table.
fn run_takeover(dry_run: bool) -> Result<()> {
    match takeover::run(dry_run) {
        Ok(report) => {
            print!("{}", report.summary());
            Ok(())
        }
        Err((_, e @ takeover::TakeoverError::NoTools)) => Err(usage(e.to_string())),
        Err((report, e)) => {
            // What was done is printed; the errors end the summary and the exit code is 1.
            print!("{}", report.summary());
            Err(anyhow!(e))
        }
    }
}
