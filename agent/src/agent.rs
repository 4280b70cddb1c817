//! The agent's sync loop: source -> model -> plan -> maps, plus the HTTP endpoints.

use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use ferry_common::lb::{BACKENDS_MAP, SERVICES_MAP};
use tokio::{signal::unix::SignalKind, sync::watch};
use tracing::{error, info, warn};

use crate::{
    dataplane::{
        self, Capacity, Ids, KernelMaps, LoadOptions, MapContent,
        loader::LoaderError,
        plan::{desired_content, diff},
    },
    http::{self, Endpoints},
    model::{self, NodeInfo},
    node,
    source::{Objects, manifests::ManifestsSource},
    status::{SharedStatus, Status},
};

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub manifests: PathBuf,
    pub node_name: String,
    /// Fixed NodePort addresses; `None` follows the node's local addresses live.
    pub node_ips: Option<Vec<IpAddr>>,
    pub load: LoadOptions,
    pub health_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Loader(#[from] LoaderError),
    #[error("--manifests: {0}")]
    Manifests(String),
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
}

/// How often the node's addresses are re-read when they are not fixed by `--node-ip`.
const NODE_ADDR_POLL: Duration = Duration::from_secs(2);
const MANIFEST_POLL: Duration = Duration::from_millis(200);

struct Syncer {
    maps: KernelMaps,
    current: MapContent,
    ids: Ids,
    capacity: Capacity,
    node: NodeInfo,
    status: SharedStatus,
    seen_problems: BTreeSet<String>,
    /// The last apply had failed writes: retry on the next resync tick.
    needs_retry: bool,
}

/// How soon a sync whose writes failed is retried (kube-proxy resyncs periodically too).
const RETRY_PERIOD: Duration = Duration::from_secs(5);

impl Syncer {
    fn sync(&mut self, objects: &Objects) {
        let started = Instant::now();
        let desired = model::compute(&objects.services_vec(), &objects.slices_vec(), &self.node);
        self.report_model(&desired);
        let (content, plan_errors) =
            desired_content(&desired, &mut self.ids, &self.current, self.capacity);
        for e in &plan_errors {
            error!("{e}");
        }
        let plan = diff(&self.current, &content);
        let report = self.maps.apply(&plan);
        self.needs_retry = !report.failures.is_empty();
        self.current = if report.failures.is_empty() {
            content
        } else {
            self.maps.read().unwrap_or(content)
        };
        let elapsed = started.elapsed();
        let mut s = self.status.lock().expect("status lock");
        let first = !s.synced;
        s.synced = true;
        s.last_updated = Some(SystemTime::now());
        s.syncs_total += 1;
        s.last_sync_duration = elapsed;
        s.sync_duration_sum += elapsed;
        s.services_programmed = desired.services.len().saturating_sub(plan_errors.len());
        s.frontends_programmed = self.current.services.keys().filter(|k| k.slot == 0).count();
        s.backends_programmed = self.current.backends.len();
        s.map_entries.insert(
            SERVICES_MAP,
            (self.current.services.len(), self.capacity.services),
        );
        s.map_entries.insert(
            BACKENDS_MAP,
            (self.current.backends.len(), self.capacity.backends),
        );
        s.map_write_failures_total += report.failures.len() as u64;
        s.plan_errors = plan_errors.len();
        s.object_problems = desired.problems.len();
        s.skipped_by_reason.clear();
        for skip in &desired.skips {
            *s.skipped_by_reason.entry(skip.reason).or_default() += 1;
        }
        if first {
            info!(
                services = s.services_programmed,
                frontends = s.frontends_programmed,
                backends = s.backends_programmed,
                writes = report.writes,
                elapsed_ms = elapsed.as_millis() as u64,
                "ready: first full sync programmed {} services ({} frontends) and {} backends",
                s.services_programmed,
                s.frontends_programmed,
                s.backends_programmed
            );
        } else if !plan.is_empty() {
            info!(
                writes = report.writes,
                elapsed_us = elapsed.as_micros() as u64,
                "synced"
            );
        }
    }

    /// Logs each problem and skip once (not on every sync), so the log stays readable.
    fn report_model(&mut self, desired: &model::DesiredState) {
        let mut now_seen = BTreeSet::new();
        for p in &desired.problems {
            let line = p.to_string();
            if !self.seen_problems.contains(&line) {
                error!(
                    "skipping invalid object: {line}; fix the object, the others are programmed"
                );
            }
            now_seen.insert(line);
        }
        for s in &desired.skips {
            let line = format!("{} ({}): {}", s.object, s.reason, s.detail);
            if !self.seen_problems.contains(&line) {
                info!("not proxied: {line}");
            }
            now_seen.insert(line);
        }
        self.seen_problems = now_seen;
    }

    fn refresh_counters(&self) {
        let counters = self.maps.counters();
        self.status.lock().expect("status lock").datapath = counters;
    }
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

    let loaded = dataplane::load_and_attach(&cfg.load)?;
    let current = loaded.maps.read()?;
    if loaded.adopted {
        info!(
            frontends = current.services.keys().filter(|k| k.slot == 0).count(),
            backends = current.backends.len(),
            "adopted pinned state from a previous agent; writing only the difference"
        );
    }
    let _ebpf = loaded.ebpf; // keeps program and map fds open while the agent runs
    if let Some(logger) = loaded.logger {
        tokio::spawn(forward_bpf_logs(logger));
    }
    let capacity = loaded.capacity;
    let mut syncer = Syncer {
        ids: Ids::adopt(&current),
        maps: loaded.maps,
        current,
        capacity,
        node: NodeInfo {
            name: cfg.node_name.clone(),
            addresses: node_addresses(&cfg)?,
        },
        status: status.clone(),
        seen_problems: BTreeSet::new(),
        needs_retry: false,
    };
    info!(node = %syncer.node.name, addresses = ?syncer.node.addresses, "node");

    let mut source = ManifestsSource::new(cfg.manifests.clone());
    // The watcher logs this scan's errors on its first tick; logging them here too
    // would print each one twice.
    let first = source.rescan();
    status.lock().expect("status lock").source_errors =
        crate::source::manifests::failing_files(&first.errors);
    let mut objects = Arc::new(source.objects());
    syncer.sync(&objects);

    let (tx, mut rx) = watch::channel(objects.clone());
    let scan_status = status.clone();
    tokio::spawn(crate::source::manifests::watch_with(
        source,
        MANIFEST_POLL,
        tx,
        move |scan| {
            scan_status.lock().expect("status lock").source_errors =
                crate::source::manifests::failing_files(&scan.errors);
        },
    ));

    let mut sigterm =
        tokio::signal::unix::signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut node_tick = tokio::time::interval(NODE_ADDR_POLL);
    let mut counter_tick = tokio::time::interval(Duration::from_secs(1));
    let mut retry_tick = tokio::time::interval(RETRY_PERIOD);
    loop {
        tokio::select! {
            changed = rx.changed() => {
                if changed.is_err() {
                    warn!("manifests watcher stopped");
                    break;
                }
                objects = rx.borrow_and_update().clone();
                {
                    let mut s = status.lock().expect("status lock");
                    s.last_queued = Some(SystemTime::now());
                    s.service_changes_total += 1;
                }
                syncer.sync(&objects);
            }
            _ = node_tick.tick(), if cfg.node_ips.is_none() => {
                match node_addresses(&cfg) {
                    Ok(addrs) if addrs != syncer.node.addresses => {
                        info!(addresses = ?addrs, "node addresses changed");
                        syncer.node.addresses = addrs;
                        syncer.sync(&objects);
                    }
                    Ok(_) => {}
                    Err(e) => warn!("{e}"),
                }
            }
            _ = counter_tick.tick() => syncer.refresh_counters(),
            _ = retry_tick.tick(), if syncer.needs_retry => {
                warn!("retrying the map writes that failed");
                syncer.current = match syncer.maps.read() {
                    Ok(c) => c,
                    Err(e) => { error!("reading the pinned maps: {e}"); continue; }
                };
                syncer.sync(&objects);
            }
            _ = tokio::signal::ctrl_c() => { info!("SIGINT: exiting, programs and maps stay pinned"); break; }
            _ = sigterm.recv() => { info!("SIGTERM: exiting, programs and maps stay pinned"); break; }
        }
    }
    Ok(())
}
