//! The agent's sync loop: source events -> engine (model, per dirty Service) -> planner
//! (incremental) -> maps, plus the HTTP endpoints.
//!
//! Events are drained before each sync, so a burst of changes becomes one map update
//! per affected Service, and Services the burst did not touch are never rewritten.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use ferry_common::lb::{BACKENDS_MAP, SERVICES_MAP};
use tokio::{
    signal::unix::SignalKind,
    sync::{mpsc, watch},
};
use tracing::{error, info, warn};

use crate::{
    dataplane::{
        self, Capacity, KernelMaps, LoadOptions, Plan, PlanError, Programmed,
        external::{External, ExternalContent, ExternalPlan},
        growth,
        loader::{Loaded, LoaderError, Pending},
    },
    engine::{Dirty, Engine, States, node_eligible},
    healthcheck::{HealthCheckService, HealthChecks},
    http::{self, Endpoints},
    model::{NodeInfo, NodePortAddresses, ServicePortId, ServicePortState},
    node,
    source::{self, SourceEvent, manifests::ManifestsSource},
    status::{SharedStatus, Status},
};

#[derive(Clone, Debug)]
pub enum SourceConfig {
    /// A directory of manifests, rescanned every 100 ms.
    Manifests(PathBuf),
    /// The Kubernetes API: this kubeconfig, or in-cluster config when `None`.
    Kube { kubeconfig: Option<PathBuf> },
}

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub source: SourceConfig,
    pub node_name: String,
    /// Fixed NodePort addresses; `None` follows the node's local addresses live.
    pub node_ips: Option<Vec<IpAddr>>,
    /// `--nodeport-addresses`.
    pub nodeport_addresses: NodePortAddresses,
    pub load: LoadOptions,
    pub health_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    /// `--takeover-kube-proxy`: once the first sync is written, remove the rules a
    /// kube-proxy left on this node ([`crate::takeover`]).
    pub takeover_kube_proxy: bool,
    /// `--pod-network`: CNI configuration, routes between nodes, masquerade.
    pub pod_network: Option<crate::podnet::PodNetConfig>,
    /// `--service-routing=false`: no Service routing at all (kube-proxy stays in charge);
    /// only the pod network runs. Requires `pod_network`.
    pub service_routing: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Loader(#[from] LoaderError),
    #[error("{0}")]
    Source(String),
    #[error("{flag} {addr}: cannot listen: {source}")]
    Listen {
        flag: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("reading the pinned maps: {0}")]
    ReadMaps(#[from] aya::maps::MapError),
    #[error("detecting node addresses: {0}")]
    NodeAddresses(std::io::Error),
    #[error("loading the programs: the loading thread ended without a result")]
    LoadThread,
}

/// How often the node's addresses are re-read when they are not fixed by `--node-ip`.
const NODE_ADDR_POLL: Duration = Duration::from_secs(2);
const MANIFEST_POLL: Duration = Duration::from_millis(100);
/// How soon a sync whose writes failed is retried (kube-proxy resyncs periodically too).
const RETRY_PERIOD: Duration = Duration::from_secs(5);
/// A sync waits until the source has been quiet this long, so that a burst of changes
/// streamed by the API becomes one sync (kube-proxy bounds its sync rate likewise)...
const COALESCE_QUIET: Duration = Duration::from_millis(2);
/// ...but never longer than this after the first change.
const COALESCE_MAX: Duration = Duration::from_millis(100);

struct Syncer {
    maps: KernelMaps,
    engine: Engine,
    /// None until the first full sync (and again after a failed apply: the next sync
    /// re-reads the kernel and plans everything).
    programmed: Option<Programmed>,
    capacity: Capacity,
    status: SharedStatus,
    /// ServicePorts that did not fit, with their state; retried on every sync (space
    /// may have freed).
    plan_errors: BTreeMap<ServicePortId, (PlanError, ServicePortState)>,
    logged: std::collections::BTreeSet<String>,
    /// The plan-error summary last logged.
    logged_plan_errors: Vec<String>,
    needs_retry: bool,
    /// The tc path's Maglev tables and source ranges, next to `programmed`.
    external: External,
    /// UDP backends in the maps (id -> address), to know what a member delete removed.
    udp_backends: std::collections::HashMap<u32, (IpAddr, u16)>,
    bpffs: PathBuf,
    /// The loaded object: keeps the programs and the current map generation open.
    ebpf: aya::Ebpf,
    /// Attaching (and migrating from another layout) once the first sync is written.
    pending: Pending,
    migration_pending: bool,
    /// Forwards the current object's eBPF log records.
    bpf_logs: Option<tokio::task::JoinHandle<()>>,
    /// What a new map generation is loaded with (bounds included).
    load: LoadOptions,
    /// The smallest capacity ([`growth::floor`]).
    floor: u32,
    /// After a failed growth, not again before this.
    growth_blocked_until: Option<Instant>,
    /// The desired state the start computed and what it needs (the maps were sized
    /// from it), when no first plan was made from it: the first full plan uses it.
    start_states: Option<(States, Capacity)>,
    /// The first full plan, made while the programs loaded ([`FirstPlan`]).
    first_plan: Option<FirstPlan>,
    /// Planning time spent before this sync began (the first plan's), counted in its
    /// duration.
    carried: Duration,
    /// tc devices without a global address (source NAT through them cannot work), as
    /// last logged.
    snat_unaddressed: BTreeSet<String>,
}

/// At most this many growths per sync (each retries what did not fit, which may then
/// find the backend map too small).
const GROWTH_ROUNDS: usize = 4;
/// How long a failed growth waits before it is tried again.
const GROWTH_RETRY: Duration = Duration::from_secs(60);

impl Syncer {
    /// Connected UDP sockets pinned to a backend their Service just lost are destroyed,
    /// so the application reconnects through the Service (kube-proxy clears the matching
    /// UDP conntrack entries for the same reason). TCP is left alone.
    fn recover_udp(&mut self, plan: &Plan) {
        let mut lost: std::collections::HashSet<(u32, IpAddr, u16)> = Default::default();
        for m in &plan.member_deletes {
            if let Some((ip, port)) = self.udp_backends.get(&m.backend_id) {
                lost.insert((m.svc_id, *ip, *port));
            }
        }
        for id in &plan.backend_deletes {
            self.udp_backends.remove(id);
        }
        for (id, b) in plan
            .backend_upserts
            .iter()
            .filter(|(_, b)| b.proto == ferry_common::lb::PROTO_UDP)
        {
            self.udp_backends
                .insert(*id, (dataplane::plan::ip_of(&b.addr), u16::from_be(b.port)));
        }
        if lost.is_empty() {
            return;
        }
        let backends: Vec<(IpAddr, u16)> = lost.iter().map(|(_, ip, port)| (*ip, *port)).collect();
        let bpffs = self.bpffs.clone();
        // Blocking (walks every network namespace): off the async workers.
        tokio::task::spawn_blocking(move || {
            let revnat = match dataplane::sockdiag::RevNatMap::open(&bpffs) {
                Ok(r) => r,
                Err(e) => return warn!("connected UDP recovery: {e}"),
            };
            let via_lost_service = |cookie: u64, ip: IpAddr, port: u16| matches!(revnat.lookup(cookie, ip, port), Ok(Some(v)) if lost.contains(&(v.svc_id, ip.to_canonical(), port)));
            match dataplane::sockdiag::destroy_udp_sockets_to(&backends, &via_lost_service) {
                Ok(r) if !r.destroyed.is_empty() => {
                    info!(
                        destroyed = r.destroyed.len(),
                        namespaces = r.namespaces,
                        "reset connected UDP sockets whose backend left their Service"
                    )
                }
                Ok(_) => {}
                Err(e) => warn!("connected UDP recovery: {e}"),
            }
        });
    }

    /// Brings the maps up to date with the store, recomputing only `dirty` Services; grows
    /// the maps when they fill up and retries what did not fit. What still does not fit
    /// is reported once, after growing.
    fn sync(&mut self, dirty: &Dirty) {
        self.sync_once(dirty);
        for _ in 0..GROWTH_ROUNDS {
            let Some(p) = &self.programmed else { break };
            let used = Capacity {
                services: p.content.services.len() as u32,
                backends: p.content.backends.len() as u32,
            };
            let missing = growth::need_of(self.plan_errors.values().map(|(_, s)| s));
            let need = Capacity {
                services: used.services.saturating_add(missing.services),
                backends: used.backends.saturating_add(missing.backends),
            };
            let Some(to) = growth::target(self.capacity, need, self.floor, self.load.bound) else {
                break;
            };
            if !self.grow(to) {
                break;
            }
            if self.plan_errors.is_empty() {
                break;
            }
            self.sync_once(&Dirty::default());
        }
        self.log_plan_errors();
    }

    /// A new generation of the maps with capacity `to`, filled with what the current one
    /// holds, swapped in behind the programs' links. False when it failed (the current
    /// maps stay, and growing waits [`GROWTH_RETRY`]).
    fn grow(&mut self, to: Capacity) -> bool {
        if self
            .growth_blocked_until
            .is_some_and(|t| Instant::now() < t)
        {
            return false;
        }
        let from = self.capacity;
        // What is programmed is what the current maps hold (a failed apply resets it).
        let content = self.programmed.as_ref().map(|p| &p.content);
        match growth::grow(&self.load, &self.maps, content, to, !self.migration_pending) {
            Ok(g) => {
                // The old maps and programs close here (the links hold the new ones).
                self.maps = g.maps;
                self.ebpf = g.ebpf;
                self.capacity = g.capacity;
                self.external.set_capacity(g.capacity.services);
                if let Some(old) = self.bpf_logs.take() {
                    old.abort();
                }
                self.bpf_logs = g.logger.map(|l| tokio::spawn(forward_bpf_logs(l)));
                info!(
                    services_from = from.services,
                    services_to = to.services,
                    backends_from = from.backends,
                    backends_to = to.backends,
                    entries = g.entries,
                    elapsed_ms = g.elapsed.as_millis() as u64,
                    "maps grown: service map {} -> {} entries, backend map {} -> {}",
                    from.services,
                    to.services,
                    from.backends,
                    to.backends
                );
                let mut st = self.status.lock().expect("status lock");
                st.map_growths_total += 1;
                st.last_map_growth = g.elapsed;
                // Handles on the new maps are taken on the next refresh.
                st.map_stats = None;
                true
            }
            Err(e) => {
                error!(
                    "growing the maps (service map {} -> {}, backend map {} -> {}) failed: {e}; the current maps stay, retrying in {} s",
                    from.services,
                    to.services,
                    from.backends,
                    to.backends,
                    GROWTH_RETRY.as_secs()
                );
                self.growth_blocked_until = Some(Instant::now() + GROWTH_RETRY);
                self.status
                    .lock()
                    .expect("status lock")
                    .map_growth_failures_total += 1;
                false
            }
        }
    }

    fn sync_once(&mut self, dirty: &Dirty) {
        let started = Instant::now();
        let wall_started = SystemTime::now();
        // Operability: which Services this sync covers, for network programming latency.
        let full = dirty.all || self.programmed.is_none();
        // A full plan recomputes everything itself.
        let changes = if self.programmed.is_some() {
            self.engine.recompute(dirty)
        } else {
            Vec::new()
        };
        // The states planned, by id: what did not fit is kept from them.
        let (plan, errors, mut states) = match self.programmed.as_mut() {
            Some(p) => {
                // Everything that did not fit is tried again, also a ServicePort that is
                // programmed in an older state (a change that did not fit keeps what it
                // had, e.g. a frontend without the endpoints that came later). A newer
                // state replaces the one retried.
                let mut states: BTreeMap<ServicePortId, Option<ServicePortState>> =
                    std::mem::take(&mut self.plan_errors)
                        .into_iter()
                        .map(|(id, (_, state))| (id, Some(state)))
                        .collect();
                states.extend(changes);
                let batch: Vec<(ServicePortId, Option<&ServicePortState>)> = states
                    .iter()
                    .map(|(id, s)| (id.clone(), s.as_ref()))
                    .collect();
                let (mut plan, mut errors) = p.update(&batch, self.capacity);
                if self.maps.external.is_some() {
                    // The tc path's tables follow what the service planner just placed.
                    let failed = errors.iter().map(|e| e.service().clone()).collect();
                    let (ext, ext_errors) = self.external.update(&batch, &p.content, &failed);
                    plan.external = ext;
                    errors.extend(ext_errors);
                }
                drop(batch);
                (plan, errors, states)
            }
            None => match self.full_plan() {
                Ok((mut plan, errors, kept, fresh)) => {
                    if fresh {
                        let p = self.programmed.as_ref().expect("planned");
                        // Empty maps are filled from the content; the tc entries with them.
                        let external = std::mem::take(&mut plan.external);
                        let report = self.maps.fill(&p.content, &external);
                        self.status
                            .lock()
                            .expect("status lock")
                            .map_write_failures_total += report.failures.len() as u64;
                        if !report.failures.is_empty() {
                            self.needs_retry = true;
                            self.programmed = None;
                            return;
                        }
                    }
                    let states = kept.into_iter().map(|s| (s.id.clone(), Some(s))).collect();
                    (plan, errors, states)
                }
                Err(e) => {
                    error!("{e}");
                    self.needs_retry = true;
                    return;
                }
            },
        };
        for e in errors {
            // Every error is about a state this plan had (removals do not fail).
            if let Some(Some(state)) = states.remove(e.service()) {
                self.plan_errors.insert(e.service().clone(), (e, state));
            }
        }
        drop(states);
        let report = self.maps.apply(&plan);
        if full {
            // After a full plan the index starts over from what is programmed.
            self.udp_backends = self
                .programmed
                .iter()
                .flat_map(|p| udp_backends_of(&p.content))
                .collect();
        } else {
            self.recover_udp(&plan);
        }
        {
            // Operability: kube-proxy's network programming latency, observed once per
            // EndpointSlice trigger time when the sync that carried it reached the maps.
            let mut st = self.status.lock().expect("status lock");
            st.map_write_failures_total += report.failures.len() as u64;
            if report.failures.is_empty() {
                // A full sync observes the Services that have trigger times; the others'
                // old observations go with the retain below, as if observed empty.
                let synced = if full {
                    self.engine.store.services_with_triggers()
                } else {
                    dirty.services.clone()
                };
                let triggers = self.engine.store.trigger_times(&synced);
                let since = *st.started_at.get_or_insert(wall_started);
                for latency in st
                    .triggers
                    .observe(&synced, triggers, since, SystemTime::now())
                {
                    st.network_programming.observe(latency);
                }
                if full {
                    st.triggers.retain(|k| synced.contains(k));
                }
            }
        }
        self.needs_retry = !report.failures.is_empty();
        if self.needs_retry {
            // The kernel no longer matches the plan: re-read it and plan in full next time.
            self.programmed = None;
        }
        self.log_model();
        let elapsed = started.elapsed() + std::mem::take(&mut self.carried);
        self.publish(elapsed, &plan, report.writes);
    }

    /// Plans every ServicePort against what the kernel holds (first sync, recovery).
    /// Also returns the states still needed ([`dataplane::programmed::Full::kept`]); the
    /// last value says the maps were empty: the caller fills them from the content.
    #[allow(clippy::type_complexity)]
    fn full_plan(
        &mut self,
    ) -> Result<(Plan, Vec<PlanError>, Vec<ServicePortState>, bool), aya::maps::MapError> {
        let current = self.maps.read()?;
        let fresh = current == dataplane::MapContent::default();
        let start_states = self.start_states.take();
        // Planned while the programs loaded, for maps that are still empty and of the
        // size it assumed (otherwise it is dropped and the plan made here).
        if let Some(first) = self.first_plan.take()
            && fresh
            && first.capacity == self.capacity
            && self.maps.external.is_some()
            && self.maps.read_external()? == ExternalContent::default()
        {
            self.plan_errors.clear();
            self.carried = first.elapsed;
            let (external, ext_plan, ext_errors) = first.external;
            let (mut plan, mut errors) = (first.full.plan, first.full.errors);
            self.external = external;
            plan.external = ext_plan;
            errors.extend(ext_errors);
            self.programmed = Some(first.full.programmed);
            return Ok((plan, errors, first.full.kept, true));
        }
        // The maps are sized from what this desired state needs before anything is
        // planned (the new generation starts as a copy of `current`).
        let (states, need) = start_states.unwrap_or_else(|| {
            let states = self.engine.recompute_all();
            let need = growth::need_of(&states);
            (states, need)
        });
        self.plan_errors.clear();
        if let Some(to) = growth::target(self.capacity, need, self.floor, self.load.bound) {
            self.grow(to);
        }
        let full = Programmed::full(states, &current, self.capacity);
        let (mut plan, mut errors) = (full.plan, full.errors);
        if let Some(maps) = &self.maps.external {
            let current = maps.read()?;
            let (external, ext_plan, ext_errors) = External::full(
                &full.kept,
                &full.programmed.content,
                &current,
                self.capacity.services,
            );
            self.external = external;
            plan.external = ext_plan;
            errors.extend(ext_errors);
        }
        self.programmed = Some(full.programmed);
        Ok((plan, errors, full.kept, fresh))
    }

    /// The ServicePorts that are not programmed, summarized per cause, logged when the
    /// summary changes (not on every sync, and not one line per Service).
    fn log_plan_errors(&mut self) {
        let errors: Vec<&PlanError> = self.plan_errors.values().map(|(e, _)| e).collect();
        let lines = dataplane::plan::summarize(&errors);
        if lines != self.logged_plan_errors {
            for l in &lines {
                error!("{l}");
            }
            if lines.is_empty() {
                info!("every ServicePort is programmed again");
            }
            self.logged_plan_errors = lines;
        }
    }

    /// Logs each problem and skip once (not on every sync), so the log stays readable.
    fn log_model(&mut self) {
        let (problems, skips) = self.engine.report();
        let mut now_seen = std::collections::BTreeSet::new();
        for p in &problems {
            let line = p.to_string();
            if !self.logged.contains(&line) {
                error!(
                    "skipping invalid object: {line}; fix the object, the others are programmed"
                );
            }
            now_seen.insert(line);
        }
        for s in &skips {
            let line = format!("{} ({}): {}", s.object, s.reason, s.detail);
            if !self.logged.contains(&line) {
                info!("not proxied: {line}");
            }
            now_seen.insert(line);
        }
        self.logged = now_seen;
        let mut st = self.status.lock().expect("status lock");
        st.object_problems = problems.len();
        st.skipped_by_reason.clear();
        for s in &skips {
            *st.skipped_by_reason.entry(s.reason).or_default() += 1;
        }
    }

    fn publish(&mut self, elapsed: Duration, plan: &Plan, writes: usize) {
        let Some(p) = self.programmed.as_ref() else {
            return;
        };
        let mut s = self.status.lock().expect("status lock");
        let first = !s.synced;
        s.synced = true;
        s.last_updated = Some(SystemTime::now());
        s.syncs_total += 1;
        s.last_sync_duration = elapsed;
        s.sync_duration_sum += elapsed;
        s.sync_duration.observe(elapsed.as_secs_f64());
        s.services_programmed = p.programmed_ports();
        s.frontends_programmed = p.frontend_count();
        s.backends_programmed = p.content.backends.len();
        s.map_entries.insert(
            SERVICES_MAP,
            (p.content.services.len(), self.capacity.services),
        );
        s.map_entries.insert(
            BACKENDS_MAP,
            (p.content.backends.len(), self.capacity.backends),
        );
        s.plan_errors = self.plan_errors.len();
        s.node_ineligible = !node_eligible(self.engine.store.node());
        if first {
            info!(
                services = s.services_programmed,
                frontends = s.frontends_programmed,
                backends = s.backends_programmed,
                writes,
                elapsed_ms = elapsed.as_millis() as u64,
                "ready: first full sync programmed {} services ({} frontends) and {} backends",
                s.services_programmed,
                s.frontends_programmed,
                s.backends_programmed
            );
        } else if !plan.is_empty() {
            info!(writes, elapsed_us = elapsed.as_micros() as u64, "synced");
        }
    }

    /// Points `FERRY_SNAT_ADDRS` at each tc device's current address (addresses can
    /// change while the agent runs).
    fn sync_snat(&mut self, devices: &[String]) {
        let Some(ext) = self.maps.external.as_mut() else {
            return;
        };
        if devices.is_empty() {
            return;
        }
        let addrs = match node::interface_addresses() {
            Ok(a) => a,
            Err(e) => return warn!("source NAT addresses: reading interface addresses: {e}"),
        };
        let indexed: Vec<(String, u32)> = devices
            .iter()
            .filter_map(|d| node::ifindex(d).map(|i| (d.clone(), i)))
            .collect();
        let want = dataplane::snat::snat_addresses(&indexed, &addrs, &self.engine.node.addresses);
        let unaddressed: BTreeSet<String> = indexed
            .iter()
            .filter(|(_, i)| !want.iter().any(|(k, _)| k.ifindex == *i))
            .map(|(d, _)| d.clone())
            .collect();
        // Said when it changes, not at every poll.
        for device in unaddressed.difference(&self.snat_unaddressed) {
            warn!(
                device,
                "no global address on this tc device: flows that need source NAT through it are dropped"
            );
        }
        for device in self.snat_unaddressed.difference(&unaddressed) {
            info!(
                device,
                "this tc device has a global address again: source NAT through it works"
            );
        }
        self.snat_unaddressed = unaddressed;
        match ext.sync_snat(&want) {
            Ok(0) => {}
            Ok(writes) => info!(writes, "source NAT addresses updated"),
            Err(e) => warn!("writing source NAT addresses: {e}"),
        }
    }

    /// The healthCheckNodePort servers the desired state needs (KP-10).
    fn health_checks(&self) -> Vec<HealthCheckService> {
        self.engine
            .health_checks()
            .iter()
            .map(|(k, h)| HealthCheckService {
                namespace: k.namespace.to_string(),
                name: k.name.to_string(),
                port: h.port,
                local_endpoints: h.local_endpoints,
            })
            .collect()
    }

    fn refresh_counters(&mut self) {
        let counters = self.maps.counters();
        let mut st = self.status.lock().expect("status lock");
        st.datapath = counters;
        if st.map_stats.is_none() {
            // Handles of its own for /metrics, which reads map fill and per-service
            // connection counts on scrape.
            match self.maps.stats() {
                Ok(m) => st.map_stats = Some(Arc::new(m)),
                Err(e) => tracing::debug!(error = %e, "map handles for /metrics"),
            }
        }
        // What follows the programmed state is rebuilt once per second at most, and only
        // when a sync ran since: service id names, the no-local-endpoints gauge, and the
        // removal of connection counts of ids no longer programmed.
        let Some(p) = &self.programmed else { return };
        // These walk every programmed Service: at most every 10 s, so a busy cluster
        // does not stall the sync loop once a second.
        if st.service_names_at == Some(st.syncs_total)
            || st
                .service_names_refreshed
                .is_some_and(|t| t.elapsed() < Duration::from_secs(10))
        {
            return;
        }
        st.service_names_refreshed = Some(Instant::now());
        st.service_names_at = Some(st.syncs_total);
        // Dropped before it is rebuilt: never two of it at once.
        st.service_names = Default::default();
        let mut names = Vec::with_capacity(p.programmed_ports());
        names.extend(p.owners().map(|(id, o)| (o.svc_id, id.clone())));
        st.service_names = crate::status::ServiceNames::new(names);
        st.no_local_endpoints_internal = p
            .content
            .services
            .iter()
            .filter(|(k, v)| k.slot == 0 && v.flags & ferry_common::lb::SVC_F_DROP != 0)
            .map(|(_, v)| v.svc_id)
            .collect::<std::collections::BTreeSet<u32>>()
            .len();
        let live: std::collections::BTreeSet<u32> = st.service_names.ids().collect();
        drop(st);
        self.maps.prune_service_connections(&live);
    }
}

fn udp_backends_of(c: &dataplane::MapContent) -> Vec<(u32, (IpAddr, u16))> {
    c.backends
        .iter()
        .filter(|(_, b)| b.proto == ferry_common::lb::PROTO_UDP)
        .map(|(id, b)| (*id, (dataplane::plan::ip_of(&b.addr), u16::from_be(b.port))))
        .collect()
}

fn node_addresses(cfg: &AgentConfig) -> Result<Vec<IpAddr>, AgentError> {
    match &cfg.node_ips {
        Some(ips) => Ok(ips.clone()),
        None => node::local_addresses().map_err(AgentError::NodeAddresses),
    }
}

/// Drains the programs' log ring buffer whenever it has records.
async fn forward_bpf_logs(logger: dataplane::loader::BpfLogger) {
    // SAFETY: the logger owns its ring buffer fd for its whole life and always reports
    // the same fd; the AsyncFd owns the logger.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
    };
    let Ok(mut fd) = registered else {
        warn!("cannot watch the eBPF log buffer; eBPF log records will not be shown");
        return;
    };
    loop {
        let Ok(mut guard) = fd.readable_mut().await else {
            return;
        };
        guard.get_inner_mut().flush();
        guard.clear_ready();
    }
}

/// Starts the manifests source: the first scan is sent before this returns, so a broken
/// directory is reported before the first sync. After that, only what changed is sent
/// (one event per changed Service or EndpointSlice).
fn start_manifests(
    dir: PathBuf,
    tx: mpsc::UnboundedSender<SourceEvent>,
    status: SharedStatus,
    nodes_tx: Option<watch::Sender<crate::podnet::Nodes>>,
) {
    let mut source = ManifestsSource::new(dir);
    let first = source.rescan();
    // The first view goes out whole, below; the changes start from it.
    drop(source.take_update());
    status.lock().expect("status lock").source_errors =
        source::manifests::failing_files(&first.errors);
    let _ = tx.send(SourceEvent::ServicesReset(
        source.services().cloned().collect(),
    ));
    let _ = tx.send(SourceEvent::SlicesReset(source.slices().cloned().collect()));
    let _ = tx.send(SourceEvent::Synced);
    // The first view is always sent, empty or not: the pod network waits for it.
    if let Some(ntx) = &nodes_tx {
        let only_nodes = source::Objects {
            nodes: source.nodes().clone(),
            ..Default::default()
        };
        ntx.send_replace(Arc::new(crate::podnet::nodes_of(&only_nodes)));
    }
    let send_nodes = move |nodes| {
        if let Some(ntx) = &nodes_tx {
            let only_nodes = source::Objects {
                nodes,
                ..Default::default()
            };
            let nodes = crate::podnet::nodes_of(&only_nodes);
            ntx.send_if_modified(|cur| {
                let changed = **cur != nodes;
                if changed {
                    *cur = Arc::new(nodes);
                }
                changed
            });
        }
    };
    let (utx, mut urx) = mpsc::unbounded_channel();
    tokio::spawn(source::manifests::watch_with(
        source,
        MANIFEST_POLL,
        utx,
        move |scan| {
            status.lock().expect("status lock").source_errors =
                source::manifests::failing_files(&scan.errors);
        },
    ));
    tokio::spawn(async move {
        while let Some(update) = urx.recv().await {
            // One message: the main loop must not sync between a Service and its slices.
            if !update.events.is_empty() {
                let _ = tx.send(SourceEvent::Batch(update.events));
            }
            if let Some(nodes) = update.nodes {
                send_nodes(nodes);
            }
        }
    });
}

/// `--service-routing=false`: only the pod network, fed by the same source; no BPF at
/// all. /healthz answers 200 once the pod network's first reconcile is done.
async fn run_pod_network_only(
    cfg: AgentConfig,
    client: Option<kube::Client>,
    status: SharedStatus,
) -> Result<(), AgentError> {
    let mut pn = cfg
        .pod_network
        .clone()
        .ok_or_else(|| AgentError::Source("--service-routing=false needs --pod-network".into()))?;
    pn.report_ready = true;
    info!("Service routing is off (--service-routing=false): running the pod network only");
    let (ntx, nrx) = watch::channel(crate::podnet::Nodes::default());
    tokio::spawn(crate::podnet::run(pn, nrx, status.clone()));
    match (&cfg.source, client) {
        (SourceConfig::Manifests(dir), _) => {
            // The Service events have no reader here; only the Nodes are used.
            let (tx, _) = mpsc::unbounded_channel();
            start_manifests(dir.clone(), tx, status.clone(), Some(ntx));
        }
        (SourceConfig::Kube { .. }, Some(client)) => {
            tokio::spawn(source::kube::watch_nodes(client, ntx));
        }
        (SourceConfig::Kube { .. }, None) => unreachable!("client built by run"),
    }
    let mut sigterm =
        tokio::signal::unix::signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => info!("SIGINT: exiting"),
        _ = sigterm.recv() => info!("SIGTERM: exiting"),
    }
    Ok(())
}

/// Runs until SIGTERM or SIGINT. Programs and maps stay pinned when it returns.
pub async fn run(cfg: AgentConfig) -> Result<(), AgentError> {
    let status: SharedStatus = Arc::new(Mutex::new(Status::default()));
    let health = http::bind(cfg.health_addr)
        .await
        .map_err(|source| AgentError::Listen {
            flag: "--health-addr",
            addr: cfg.health_addr,
            source,
        })?;
    let metrics = http::bind(cfg.metrics_addr)
        .await
        .map_err(|source| AgentError::Listen {
            flag: "--metrics-addr",
            addr: cfg.metrics_addr,
            source,
        })?;
    tokio::spawn(http::serve(health, Endpoints::Health, status.clone()));
    tokio::spawn(http::serve(metrics, Endpoints::Metrics, status.clone()));

    // The API client is built first (a bad kubeconfig is a configuration error before
    // anything touches the kernel); its address is used as given, never a ClusterIP this
    // agent has yet to program (bootstrap).
    let client = match &cfg.source {
        SourceConfig::Kube { kubeconfig } => Some(
            source::kube::client(kubeconfig.as_deref())
                .await
                .map_err(|e| AgentError::Source(e.to_string()))?,
        ),
        SourceConfig::Manifests(_) => None,
    };
    if !cfg.service_routing {
        return run_pod_network_only(cfg, client, status).await;
    }
    // Configuration errors surface now, not after the first list.
    dataplane::loader::preflight(&cfg.load)?;
    // aya's loader reads the kernel's BTF when it is made: now, beside the first list's
    // requests, not beside the first full plan (the agent's peak).
    std::thread::Builder::new()
        .name("prepare-load".into())
        .spawn(dataplane::loader::prepare)
        .map_err(|e| {
            warn!("cannot start a thread to prepare the loader ({e}); it is made at the load")
        })
        .ok();
    status.lock().expect("status lock").map_bounds = [
        (SERVICES_MAP, cfg.load.bound.services),
        (BACKENDS_MAP, cfg.load.bound.backends),
    ]
    .into();
    // The source starts first and the programs are loaded once its first list is in
    // the store, with maps sized from what it holds: no growth (which loads and verifies
    // every program again) on the way to ready.
    let (tx, mut rx) = mpsc::unbounded_channel();
    let nodes_tx = cfg.pod_network.clone().map(|pn| {
        let (ntx, nrx) = watch::channel(crate::podnet::Nodes::default());
        tokio::spawn(crate::podnet::run(pn, nrx, status.clone()));
        ntx
    });
    match (&cfg.source, client) {
        (SourceConfig::Manifests(dir), _) => {
            start_manifests(dir.clone(), tx, status.clone(), nodes_tx)
        }
        (SourceConfig::Kube { .. }, Some(client)) => {
            if let Some(ntx) = nodes_tx {
                tokio::spawn(source::kube::watch_nodes(client.clone(), ntx));
            }
            tokio::spawn(source::kube::run(client, cfg.node_name.clone(), tx));
        }
        (SourceConfig::Kube { .. }, None) => unreachable!("client built above"),
    }
    let node = NodeInfo {
        name: cfg.node_name.clone(),
        addresses: node_addresses(&cfg)?,
        zone: None,
        nodeport_addresses: cfg.nodeport_addresses.clone(),
        // --node-ip lists the primary address of each family first.
        primary_ips: cfg.node_ips.clone().unwrap_or_default(),
    };
    info!(node = %node.name, addresses = ?node.addresses, "node");
    let mut engine = Engine::new(node);
    let mut sigterm =
        tokio::signal::unix::signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut synced_source = false;
    let mut dirty = Dirty::default();
    let listing = Instant::now();
    let floor = growth::floor();
    let initial = growth::initial(floor, cfg.load.bound);
    // Maps this layout pinned (an agent ran here before) keep their size, so nothing waits
    // for the list: the programs load while the source lists, and the first sync grows
    // the maps if the list needs more.
    let early = layout_pinned(&cfg.load.bpffs).then(|| {
        info!("this layout's maps are pinned: loading the programs while the source lists");
        let mut load = cfg.load.clone();
        load.capacity = initial;
        LoadTask::spawn(load)
    });
    while !synced_source {
        tokio::select! {
            event = rx.recv() => {
                let Some(event) = event else {
                    warn!("the source stopped before its first list");
                    LoadTask::abandon(early).await;
                    return Ok(());
                };
                handle_event(event, &mut engine, &status, &mut dirty, &mut synced_source);
            }
            _ = tokio::signal::ctrl_c() => {
                info!("SIGINT: exiting before the first list");
                LoadTask::abandon(early).await;
                return Ok(());
            }
            _ = sigterm.recv() => {
                info!("SIGTERM: exiting before the first list");
                LoadTask::abandon(early).await;
                return Ok(());
            }
        }
    }
    // What only the start ran (API client, decoder, argument parsing) leaves the RSS
    // before the first recompute and plan, the agent's peak.
    crate::residency::page_out_own_code();
    // The whole store is recomputed once; the first full plan uses this desired state.
    let states = engine.recompute_all();
    let need = growth::need_of(&states);
    let mut load = cfg.load.clone();
    load.capacity = growth::target(initial, need, floor, cfg.load.bound).unwrap_or(initial);
    let doing = match &early {
        Some(_) => "the programs are loading with the pinned maps' sizes".to_owned(),
        None => format!(
            "loading the programs with service map {} and backend map {} entries",
            load.capacity.services, load.capacity.backends
        ),
    };
    info!(
        services = engine.store.service_count(),
        slices = engine.store.slice_count(),
        need_services = need.services,
        need_backends = need.backends,
        elapsed_ms = listing.elapsed().as_millis() as u64,
        "first list in: {doing}"
    );
    let (task, first_plan, start_states) = match early {
        Some(task) => (task, None, Some((states, need))),
        None => {
            let task = LoadTask::spawn(load.clone());
            // Nothing of this layout is pinned: the maps are created empty at this size,
            // which is all the first full plan needs, so it is made meanwhile.
            let first = FirstPlan::compute(states, load.capacity);
            info!(
                elapsed_ms = first.elapsed.as_millis() as u64,
                "first full plan made while the programs load"
            );
            (task, Some(first), None)
        }
    };
    let waiting = Instant::now();
    let (loaded, took) = task.finish().await?;
    info!(
        elapsed_ms = took.as_millis() as u64,
        waited_ms = waiting.elapsed().as_millis() as u64,
        "programs loaded"
    );
    if loaded.adopted {
        info!("adopted pinned state from a previous agent; writing only the difference");
    }
    let mut ebpf = loaded.ebpf; // keeps program and map fds open while the agent runs
    let pending = loaded.pending;
    // Same layout (or none pinned): attach now, the maps are shared with whatever ran
    // before. Another layout pinned: its programs keep serving until ours have maps
    // filled with the full desired state, then each link swaps atomically.
    let migration_pending = !pending.migrate_from.is_empty();
    if migration_pending {
        let from: Vec<u32> = pending.migrate_from.iter().map(|(v, _)| *v).collect();
        info!(from = ?from, to = dataplane::loader::layout_version(), "another map layout is pinned: migrating after the first full sync");
    } else {
        dataplane::attach(&mut ebpf, &pending)?;
    }
    let bpf_logs = loaded.logger.map(|l| tokio::spawn(forward_bpf_logs(l)));
    let mut syncer = Syncer {
        maps: loaded.maps,
        engine,
        programmed: None,
        capacity: loaded.capacity,
        status: status.clone(),
        plan_errors: BTreeMap::new(),
        logged: Default::default(),
        logged_plan_errors: Vec::new(),
        needs_retry: false,
        udp_backends: Default::default(),
        external: External::default(),
        bpffs: cfg.load.bpffs.clone(),
        ebpf,
        pending,
        migration_pending,
        bpf_logs,
        load: cfg.load.clone(),
        floor,
        growth_blocked_until: None,
        start_states,
        first_plan,
        carried: Duration::ZERO,
        snat_unaddressed: BTreeSet::new(),
    };
    // What the recompute above covered needs no second look.
    dirty = Dirty::default();

    let devices = cfg.load.devices.clone();
    syncer.sync_snat(&devices);
    // kube-proxy's serviceProxyHealthy: syncs are fresh (not node eligibility).
    let health_status = status.clone();
    let mut health_checks = HealthChecks::new(Arc::new(move || {
        health_status
            .lock()
            .expect("status lock")
            .healthy(SystemTime::now())
    }));
    let mut health_wanted: Option<Vec<HealthCheckService>> = None;
    let mut node_tick = tokio::time::interval(NODE_ADDR_POLL);
    let mut counter_tick = tokio::time::interval(Duration::from_secs(1));
    let mut retry_tick = tokio::time::interval(RETRY_PERIOD);
    let mut takeover_pending = cfg.takeover_kube_proxy;
    // The first full sync, from the list already in the store.
    status.lock().expect("status lock").last_queued = Some(SystemTime::now());
    syncer.sync(&Dirty::default());
    if syncer.migration_pending && syncer.programmed.is_some() {
        dataplane::attach(&mut syncer.ebpf, &syncer.pending)?;
        syncer.migration_pending = false;
    }
    // Likewise what only the first load, plan and fill ran.
    crate::residency::page_out_own_code();
    sync_health_checks(
        &mut health_checks,
        &mut health_wanted,
        syncer.health_checks(),
    )
    .await;
    loop {
        tokio::select! {
            event = rx.recv() => {
                let Some(event) = event else { warn!("the source stopped"); break };
                // Coalesce: everything already queued joins this sync, and so does what
                // follows within COALESCE_QUIET (a burst is streamed event by event, not
                // queued at once), for at most COALESCE_MAX.
                // A lone change is synced at once; only once a second event shows a burst
                // in progress does the loop wait for the source to go quiet.
                let until = tokio::time::Instant::now() + COALESCE_MAX;
                let mut next = Some(event);
                let mut batched = 0usize;
                while let Some(ev) = next {
                    handle_event(ev, &mut syncer.engine, &syncer.status, &mut dirty, &mut synced_source);
                    batched += 1;
                    next = match rx.try_recv() {
                        Ok(ev) => Some(ev),
                        Err(mpsc::error::TryRecvError::Empty)
                            if batched > 1 && synced_source && tokio::time::Instant::now() < until =>
                        {
                            tokio::time::timeout(COALESCE_QUIET, rx.recv()).await.ok().flatten()
                        }
                        Err(_) => None,
                    };
                }
                if synced_source && (!dirty.is_empty() || syncer.programmed.is_none()) {
                    status.lock().expect("status lock").last_queued = Some(SystemTime::now());
                    syncer.sync(&std::mem::take(&mut dirty));
                    if syncer.migration_pending && syncer.programmed.is_some() {
                        dataplane::attach(&mut syncer.ebpf, &syncer.pending)?;
                        syncer.migration_pending = false;
                    }
                    sync_health_checks(&mut health_checks, &mut health_wanted, syncer.health_checks()).await;
                }
            }
            _ = node_tick.tick() => {
                match node_addresses(&cfg) {
                    Ok(addrs) if cfg.node_ips.is_none() && addrs != syncer.engine.node.addresses => {
                        info!(addresses = ?addrs, "node addresses changed");
                        syncer.engine.node.addresses = addrs;
                        dirty.all = true;
                        if synced_source {
                            syncer.sync(&std::mem::take(&mut dirty));
                            sync_health_checks(&mut health_checks, &mut health_wanted, syncer.health_checks()).await;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => warn!("{e}"),
                }
                syncer.sync_snat(&devices);
            }
            _ = counter_tick.tick() => syncer.refresh_counters(),
            _ = retry_tick.tick(), if (syncer.needs_retry || health_wanted.is_none()) && synced_source => {
                if syncer.needs_retry {
                    warn!("retrying after failed map writes: re-reading the maps and planning in full");
                    syncer.sync(&Dirty { all: true, ..Default::default() });
                }
                sync_health_checks(&mut health_checks, &mut health_wanted, syncer.health_checks()).await;
            }
            _ = tokio::signal::ctrl_c() => { info!("SIGINT: exiting, programs and maps stay pinned"); break; }
            _ = sigterm.recv() => { info!("SIGTERM: exiting, programs and maps stay pinned"); break; }
        }
        // Ready (the first full sync is in the maps and the programs attached): new
        // connections are ferry's, so kube-proxy's leftovers can go.
        if takeover_pending
            && !syncer.migration_pending
            && status.lock().expect("status lock").synced
        {
            takeover_pending = false;
            // A detached thread, not spawn_blocking: the runtime waits for its blocking
            // tasks when it is dropped, and this one sleeps for minutes between its
            // looks, which would hold SIGTERM's exit that long.
            let status = status.clone();
            if let Err(e) = std::thread::Builder::new()
                .name("takeover".into())
                .spawn(move || takeover_kube_proxy(&status))
            {
                error!("kube-proxy takeover FAILED: cannot start its thread: {e}");
            }
        }
    }
    Ok(())
}

/// Whether this layout's maps are pinned (an agent ran here before): they keep their
/// size, so the programs can load before the first list is in.
fn layout_pinned(bpffs: &std::path::Path) -> bool {
    let version = dataplane::loader::layout_version();
    dataplane::loader::maps_dir(bpffs, version)
        .join(SERVICES_MAP)
        .exists()
}

/// The programs loading on a thread of their own: creating the maps and verifying the
/// programs is kernel time the second CPU spends while this one lists or plans.
struct LoadTask {
    rx: tokio::sync::oneshot::Receiver<(Result<Loaded, LoaderError>, Duration)>,
}

impl LoadTask {
    fn spawn(opts: LoadOptions) -> LoadTask {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let inline = opts.clone();
        let work = move || {
            let started = Instant::now();
            let result = dataplane::load(&opts);
            let _ = tx.send((result, started.elapsed()));
        };
        if let Err(e) = std::thread::Builder::new().name("load".into()).spawn(work) {
            warn!("cannot start a thread to load the programs ({e}); loading them here");
            let (tx, rx) = tokio::sync::oneshot::channel();
            let started = Instant::now();
            let result = tokio::task::block_in_place(|| dataplane::load(&inline));
            let _ = tx.send((result, started.elapsed()));
            return LoadTask { rx };
        }
        LoadTask { rx }
    }

    /// The loaded programs, and how long loading them took.
    async fn finish(self) -> Result<(Loaded, Duration), AgentError> {
        let (result, took) = self.rx.await.map_err(|_| AgentError::LoadThread)?;
        Ok((result?, took))
    }

    /// Waits for a load nobody will use: the agent never exits while it is creating pins
    /// (half of a layout would greet the next agent).
    async fn abandon(task: Option<LoadTask>) {
        if let Some(task) = task {
            let _ = task.rx.await;
        }
    }
}

/// The first full plan, made while another thread loads the programs. Planning needs
/// the maps' size and content, not the maps: where nothing of this layout is pinned they
/// are created empty at the size the start chose. Used only if that is what the load
/// produced ([`Syncer::full_plan`] checks).
struct FirstPlan {
    capacity: Capacity,
    full: dataplane::programmed::Full,
    external: (External, ExternalPlan, Vec<PlanError>),
    elapsed: Duration,
}

impl FirstPlan {
    /// Plans `states`, the start's whole desired state (consumed as it is placed).
    fn compute(states: States, capacity: Capacity) -> FirstPlan {
        let started = Instant::now();
        let empty = dataplane::MapContent::default();
        let full = Programmed::full(states, &empty, capacity);
        let external = External::full(
            &full.kept,
            &full.programmed.content,
            &ExternalContent::default(),
            capacity.services,
        );
        FirstPlan {
            capacity,
            full,
            external,
            elapsed: started.elapsed(),
        }
    }
}

/// When `--takeover-kube-proxy` looks again after the first removal: Gardener deletes
/// kube-proxy while ferry starts, and a kube-proxy still running writes its rules back.
const TAKEOVER_RECHECKS: [Duration; 3] = [
    Duration::from_secs(30),
    Duration::from_secs(90),
    Duration::from_secs(300),
];

/// `--takeover-kube-proxy`: removes kube-proxy's rules once ready, then looks again a few
/// times. A failure is logged loudly and shown in /metrics, and the agent goes on (its
/// programs already serve). Blocking: runs on its own thread.
fn takeover_kube_proxy(status: &SharedStatus) {
    let (mut chains, mut rules) = (0u64, 0u64);
    for (i, wait) in std::iter::once(Duration::ZERO)
        .chain(TAKEOVER_RECHECKS)
        .enumerate()
    {
        std::thread::sleep(wait);
        let (report, result) = match crate::takeover::run(false) {
            Ok(r) => (r, Ok(())),
            Err((r, e)) => (r, Err(e)),
        };
        if i > 0 && report.is_empty() && result.is_ok() {
            continue;
        }
        if i > 0 {
            warn!(
                "kube-proxy's rules are back (is kube-proxy still running?): removing them again"
            );
        }
        for line in report.summary().lines() {
            if !line.starts_with("error: ") {
                info!("kube-proxy takeover: {line}");
            }
        }
        chains += report.chains_removed() as u64;
        rules += report.rules_removed() as u64;
        {
            let mut s = status.lock().expect("status lock");
            s.takeover_failed = Some(result.is_err());
            s.takeover_chains_removed = chains;
            s.takeover_rules_removed = rules;
        }
        match result {
            Ok(()) => info!(
                chains = report.chains_removed(),
                rules = report.rules_removed(),
                "kube-proxy takeover done"
            ),
            Err(e) => error!(
                "kube-proxy takeover FAILED, kube-proxy's rules may still be on this node (remove them with `ferry takeover`): {e}"
            ),
        }
    }
}

/// Opens, updates and closes the healthCheckNodePort servers after a sync. Only when the
/// list changed, or the last attempt left a port unserved (it is retried).
async fn sync_health_checks(
    servers: &mut HealthChecks,
    last: &mut Option<Vec<HealthCheckService>>,
    wanted: Vec<HealthCheckService>,
) {
    if last.as_ref() == Some(&wanted) {
        return;
    }
    let errors = servers.sync(wanted.clone()).await;
    for e in &errors {
        error!("{e:#}");
    }
    // A failed port is retried on the next sync.
    *last = errors.is_empty().then_some(wanted);
}

fn handle_event(
    ev: SourceEvent,
    engine: &mut Engine,
    status: &SharedStatus,
    dirty: &mut Dirty,
    synced: &mut bool,
) {
    if let SourceEvent::Batch(events) = ev {
        for ev in events {
            handle_event(ev, engine, status, dirty, synced);
        }
        return;
    }
    match &ev {
        SourceEvent::Synced => *synced = true,
        SourceEvent::Connected(up) => {
            let mut s = status.lock().expect("status lock");
            if s.source_connected != *up {
                if *up {
                    info!("source connected: watching for changes");
                } else {
                    warn!(
                        "source lost its connection: the programmed state stays in the kernel until it is back"
                    );
                }
            }
            s.source_connected = *up;
        }
        SourceEvent::ServicesReset(_)
        | SourceEvent::ServiceApplied(_)
        | SourceEvent::ServiceDeleted(_) => {
            status.lock().expect("status lock").service_changes_total += 1;
        }
        SourceEvent::SlicesReset(_)
        | SourceEvent::SliceApplied(_)
        | SourceEvent::SliceDeleted(_) => {
            status.lock().expect("status lock").endpoint_changes_total += 1;
        }
        SourceEvent::Node(_) | SourceEvent::Batch(_) => {}
        SourceEvent::Unreadable(count) => {
            status.lock().expect("status lock").source_errors = *count;
        }
    }
    let node_event = matches!(ev, SourceEvent::Node(_));
    engine.store.apply(ev, dirty);
    if node_event {
        // nodeEligible (taint, deletionTimestamp) changes without a zone change dirty no
        // Service, so no sync follows to publish it: /healthz must see it now.
        status.lock().expect("status lock").node_ineligible = !node_eligible(engine.store.node());
    }
}
