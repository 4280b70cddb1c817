//! The pod network of this node (`ferry agent --pod-network`), next to Service routing:
//! - the CNI configuration `10-ferry.conflist` in `--cni-conf-dir`, written once this
//!   node's Node has pod CIDRs (a runtime starts no pod before it is there), and the
//!   `ferry-cni` plugin installed into `--cni-bin-dir`, both atomically;
//! - one route per other node's pod CIDR via that node's InternalIP (native routing:
//!   the nodes share a link), removed when the node goes ([`routes`]); or, with
//!   `--overlay vxlan`, via the node's endpoint on ferry's VXLAN device ([`overlay`]);
//! - masquerading of pod traffic to anything outside the cluster's pod CIDRs, the node
//!   addresses and `--no-masquerade-cidrs` (one nft table per family, [`masq`]), unless
//!   `--masquerade=false`;
//! - IP forwarding on, for the families the node has pod CIDRs of;
//! - the fast path ([`fastpath`], `--pod-network-fast-path`): pod-to-pod packets
//!   forwarded at tc, past the node's forwarding path; new pods' veths get it when the
//!   kernel announces them ([`link_events`]), or at the latest within [`POD_SCAN`].
//!
//! It runs on its own: fed the cluster's Nodes (from the API or the manifests
//! directory), it reconciles on every change and every [`RESYNC`] (so that a route, file
//! or rule someone deleted comes back), on a blocking thread. Problems are logged when they
//! change, never per tick, and counted in /metrics.

pub mod fastpath;
pub mod install;
pub mod link_events;
pub mod masq;
pub mod overlay;
pub mod plan;
pub mod routes;

use std::{collections::BTreeMap, path::PathBuf, sync::Arc, time::Duration};

use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::{model::Cidr, node::ifindex as node_ifindex, status::SharedStatus};
use plan::{NodeLite, PodNetPlan};

/// How often the node's routes, files and rules are checked again without a change
/// (`--pod-network-resync`).
pub const RESYNC: Duration = Duration::from_secs(30);

/// How often the fast path looks for new pods' veths (a listing of the links) besides
/// each link notification ([`link_events`]); a pod's first packets take the kernel's path
/// until its veth is found.
pub const POD_SCAN: Duration = Duration::from_millis(500);

#[derive(Clone, Debug)]
pub struct PodNetConfig {
    pub node_name: String,
    pub cni_conf_dir: PathBuf,
    pub cni_bin_dir: PathBuf,
    /// The plugin's address store (`dataDir` in the configuration).
    pub cni_data_dir: PathBuf,
    /// The plugin binary to install (default: `ferry-cni` next to the agent).
    pub plugin: PathBuf,
    pub mtu: u32,
    /// `--overlay vxlan`: routes through ferry's VXLAN device instead of native routing.
    pub overlay: bool,
    pub masquerade: bool,
    /// Destinations that keep the pod's address besides the cluster's pod CIDRs and
    /// node addresses (e.g. the Service CIDR, networks routed to pods natively).
    pub no_masquerade: Vec<Cidr>,
    /// Without Service routing, the pod network is what /healthz reports: ready after
    /// each reconcile.
    pub report_ready: bool,
    /// How often everything is checked again without a change ([`RESYNC`]).
    pub resync: Duration,
    /// Forward pod-to-pod packets at tc ([`fastpath`]).
    pub fast_path: bool,
}

/// The cluster's Nodes as the pod network sees them, by name.
pub type Nodes = Arc<BTreeMap<String, NodeLite>>;

/// Runs until `nodes` has no sender left.
pub async fn run(cfg: PodNetConfig, mut nodes: watch::Receiver<Nodes>, status: SharedStatus) {
    let mut state = State::default();
    // Nothing before the source's first view of the Nodes: an empty set would remove
    // every route a previous agent left, and they would come back a moment later.
    if nodes.changed().await.is_err() {
        return;
    }
    let mut tick = tokio::time::interval(cfg.resync.max(Duration::from_millis(100)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut scan = tokio::time::interval(POD_SCAN);
    scan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut links = cfg.fast_path.then(open_link_events).flatten();
    loop {
        tokio::select! {
            changed = nodes.changed() => if changed.is_err() { return },
            _ = tick.tick() => {}
            _ = scan.tick() => {
                state.scan_pods();
                publish_fast_path(&state, &status);
                continue;
            }
            event = link_event(&mut links) => {
                if let Err(e) = event {
                    warn!("pod network: link notifications failed ({e}); new pods' veths are found by the scan every {POD_SCAN:?}");
                    links = None;
                }
                state.scan_pods();
                publish_fast_path(&state, &status);
                continue;
            }
        }
        let current = nodes.borrow_and_update().clone();
        let cfg2 = cfg.clone();
        let moved = std::mem::take(&mut state);
        let done = tokio::task::spawn_blocking(move || {
            let mut state = moved;
            state.reconcile(&cfg2, &current);
            state
        })
        .await;
        match done {
            Ok(s) => state = s,
            Err(e) => {
                error!("pod network: reconcile panicked: {e}");
                continue;
            }
        }
        publish_fast_path(&state, &status);
        let mut s = status.lock().expect("status lock");
        s.podnet_routes = Some(state.routes as u64);
        s.podnet_errors = state.reported.len() as u64;
        if cfg.report_ready {
            s.synced = true;
            s.last_updated = Some(std::time::SystemTime::now());
        }
    }
}

fn open_link_events() -> Option<link_events::LinkEvents> {
    link_events::LinkEvents::open()
        .map_err(|e| {
            warn!("pod network: no link notifications ({e}); new pods' veths are found by the scan every {POD_SCAN:?}");
        })
        .ok()
}

/// The next link notification; never, without the subscription.
async fn link_event(links: &mut Option<link_events::LinkEvents>) -> std::io::Result<()> {
    match links {
        Some(l) => l.changed().await,
        None => std::future::pending().await,
    }
}

fn publish_fast_path(state: &State, status: &SharedStatus) {
    let Some(fast) = &state.fast else { return };
    let c = fast.counters();
    status.lock().expect("status lock").podnet_fast_path =
        Some((fast.pods() as u64, c.from_pod, c.to_pod));
}

/// What the last reconcile did and reported, to log only changes. Nothing here saves
/// work: every reconcile checks the files, sysctls, routes and rules again, so that what
/// someone removed comes back.
#[derive(Default)]
struct State {
    masq_script: Option<String>,
    routes: usize,
    /// The problems logged (node problems and failed steps), to log each only once.
    reported: std::collections::BTreeSet<String>,
    /// The fast path, once loaded.
    fast: Option<fastpath::FastPath>,
    /// The fast path's problems with pods' veths, logged once each.
    scan_reported: std::collections::BTreeSet<String>,
}

impl State {
    fn reconcile(&mut self, cfg: &PodNetConfig, nodes: &BTreeMap<String, NodeLite>) {
        let list: Vec<NodeLite> = nodes.values().cloned().collect();
        let plan = plan::plan(&cfg.node_name, &list, &cfg.no_masquerade, cfg.overlay);
        let mut problems: Vec<String> = plan
            .problems
            .iter()
            .map(|p| format!("node {}: {}", p.node, p.message))
            .collect();
        if !nodes.contains_key(&cfg.node_name) {
            problems.push(format!(
                "no Node named {} (yet): no CNI configuration until it has pod CIDRs",
                cfg.node_name
            ));
        } else if plan.own_cidrs.is_empty() {
            problems.push(format!(
                "Node {} has no spec.podCIDRs (yet): no CNI configuration until it has",
                cfg.node_name
            ));
        }
        self.install_plugin(cfg, &mut problems);
        self.forwarding(&plan, &mut problems);
        self.write_conflist(cfg, &plan, &mut problems);
        match ferry_cni::netlink::Netlink::open() {
            Ok(mut nl) => {
                let vxlan = match &plan.vxlan {
                    Some(v) => overlay::reconcile(&mut nl, v, cfg.mtu, &mut problems),
                    None => {
                        overlay::remove(&mut nl, &mut problems);
                        None
                    }
                };
                let r = routes::reconcile(&mut nl, &plan.routes, vxlan);
                for w in &r.added {
                    info!(route = %w, "pod network: route to a node's pods");
                }
                for d in &r.removed {
                    info!(dst = %d, "pod network: route removed (its node is gone)");
                }
                problems.extend(r.errors);
            }
            Err(e) => problems.push(format!("netlink socket: {e}")),
        }
        self.routes = plan.routes.len();
        // Applied every time (one nft transaction: the table is replaced whole, and NAT
        // already decided for existing connections stays in conntrack), so that a table
        // someone removed comes back; logged only when it changes.
        let script = plan::masquerade_script(cfg.masquerade.then_some(&plan));
        match masq::apply(&script) {
            Ok(()) => {
                if self.masq_script.as_deref() != Some(script.as_str()) {
                    info!(
                        masquerade = cfg.masquerade && !plan.own_cidrs.is_empty(),
                        "pod network: masquerade rules set"
                    );
                    self.masq_script = Some(script);
                }
            }
            Err(e) => problems.push(format!("masquerade: {e}")),
        }
        // Last: loading the programs takes a moment, and nothing above waits for it.
        if cfg.fast_path {
            self.fast_path(cfg, nodes, &plan, &mut problems);
        }
        let now: std::collections::BTreeSet<String> = problems.into_iter().collect();
        for p in now.difference(&self.reported) {
            warn!("pod network: {p}");
        }
        if !self.reported.is_empty() && now.is_empty() {
            info!("pod network: every problem reported before is gone");
        }
        self.reported = now;
    }

    /// Loads the fast path once, then keeps its pod CIDRs and uplinks in line with the
    /// plan. Pod veths are the scan's ([`Self::scan_pods`]).
    fn fast_path(
        &mut self,
        cfg: &PodNetConfig,
        nodes: &BTreeMap<String, NodeLite>,
        plan: &PodNetPlan,
        problems: &mut Vec<String>,
    ) {
        if self.fast.is_none() {
            match fastpath::FastPath::load() {
                Ok(f) => {
                    info!("pod network: fast path loaded");
                    self.fast = Some(f);
                }
                Err(e) => {
                    problems.push(format!(
                        "fast path not loaded (pod traffic takes the kernel's path): {e}"
                    ));
                    return;
                }
            }
        }
        let Some(fast) = self.fast.as_mut() else {
            return;
        };
        fast.set_destinations(&plan.own_cidrs, &plan::fast_path_tunnels(plan), problems);
        fast.set_config(plan::fast_path_config(plan, node_ifindex), problems);
        let own_ips = nodes
            .get(&cfg.node_name)
            .map(|n| n.internal_ips.clone())
            .unwrap_or_default();
        let vxlan = plan.vxlan.as_ref().map(|_| plan::VXLAN_DEVICE);
        fast.set_uplinks(&fastpath::uplinks(&own_ips, vxlan), problems);
        problems.extend(fast.scan_pods());
    }

    /// Attaches the fast path to new pods' veths; problems are logged once each.
    fn scan_pods(&mut self) {
        let Some(fast) = self.fast.as_mut() else {
            return;
        };
        let now: std::collections::BTreeSet<String> = fast.scan_pods().into_iter().collect();
        for p in now.difference(&self.scan_reported) {
            warn!("pod network: {p}");
        }
        self.scan_reported = now;
    }

    fn install_plugin(&mut self, cfg: &PodNetConfig, problems: &mut Vec<String>) {
        let result = std::fs::read(&cfg.plugin)
            .map_err(|e| format!("reading the CNI plugin {}: {e}", cfg.plugin.display()))
            .and_then(|bin| {
                install::write_atomic(&cfg.cni_bin_dir, plan::PLUGIN_TYPE, &bin, 0o755).map_err(
                    |e| {
                        format!(
                            "installing the CNI plugin into {}: {e}",
                            cfg.cni_bin_dir.display()
                        )
                    },
                )
            });
        match result {
            Ok(changed) => {
                if changed {
                    info!(dir = %cfg.cni_bin_dir.display(), "pod network: CNI plugin installed");
                }
            }
            Err(e) => problems.push(e),
        }
    }

    fn write_conflist(
        &mut self,
        cfg: &PodNetConfig,
        plan: &PodNetPlan,
        problems: &mut Vec<String>,
    ) {
        // Without pod CIDRs the last configuration stays: the node's CIDRs never change
        // while it exists, and a runtime without configuration starts no pod at all.
        let overhead = plan
            .vxlan
            .as_ref()
            .and_then(|v| v.local)
            .map_or(0, plan::vxlan_overhead);
        let Some(text) = plan::conflist(&plan.own_cidrs, cfg.mtu, overhead, &cfg.cni_data_dir)
        else {
            return;
        };
        match install::write_atomic(
            &cfg.cni_conf_dir,
            plan::CONFLIST_NAME,
            text.as_bytes(),
            0o644,
        ) {
            Ok(changed) => {
                if changed {
                    info!(
                        file = %cfg.cni_conf_dir.join(plan::CONFLIST_NAME).display(),
                        cidrs = ?plan.own_cidrs.iter().map(ToString::to_string).collect::<Vec<_>>(),
                        "pod network: CNI configuration written"
                    );
                }
            }
            Err(e) => problems.push(format!(
                "writing {}: {e}",
                cfg.cni_conf_dir.join(plan::CONFLIST_NAME).display()
            )),
        }
    }

    /// Forwarding for the families of the node's pod CIDRs (the node routes its pods'
    /// traffic). In a container /proc/sys may be read-only: then it must be set on the
    /// node, and the warning says so.
    fn forwarding(&mut self, plan: &PodNetPlan, problems: &mut Vec<String>) {
        use crate::model::IpFamily;
        for (family, path) in [
            (IpFamily::V4, "/proc/sys/net/ipv4/ip_forward"),
            (IpFamily::V6, "/proc/sys/net/ipv6/conf/all/forwarding"),
        ] {
            if !plan.own_cidrs.iter().any(|c| c.family() == family) {
                continue;
            }
            let on = std::fs::read_to_string(path).is_ok_and(|v| v.trim() == "1");
            if !on && std::fs::write(path, "1").is_err() {
                problems.push(format!(
                    "{path} is not 1 and cannot be set here: enable {family} forwarding on the node"
                ));
            }
        }
    }
}

/// The Nodes of a manifests snapshot.
pub fn nodes_of(objects: &crate::source::Objects) -> BTreeMap<String, NodeLite> {
    let mut out = BTreeMap::new();
    for node in objects.nodes.values() {
        let (lite, problems) = NodeLite::from_node(node);
        for p in problems {
            warn!("pod network: node {}: {}", p.node, p.message);
        }
        out.insert(lite.name.clone(), lite);
    }
    out
}
