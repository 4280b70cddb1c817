//! State shared between the sync loop and the HTTP endpoints.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

/// What `/healthz`, `/livez` and `/metrics` report. Updated by the sync loop.
#[derive(Debug, Default)]
pub struct Status {
    /// Set once the first full sync reached the maps.
    pub synced: bool,
    /// When the source last reported a change the dataplane has not applied yet.
    pub last_queued: Option<SystemTime>,
    /// When the maps were last brought up to date.
    pub last_updated: Option<SystemTime>,
    pub syncs_total: u64,
    pub last_sync_duration: Duration,
    pub sync_duration_sum: Duration,
    pub services_programmed: usize,
    pub frontends_programmed: usize,
    pub backends_programmed: usize,
    pub map_entries: BTreeMap<&'static str, (usize, u32)>,
    pub map_write_failures_total: u64,
    pub plan_errors: usize,
    pub object_problems: usize,
    pub source_errors: usize,
    pub skipped_by_reason: BTreeMap<&'static str, u64>,
    /// Per-reason datapath counters read from BPF (`COUNTER_NAMES` order).
    pub datapath: Vec<u64>,
    pub service_changes_total: u64,
    pub endpoint_changes_total: u64,
    /// False while this node's Node object is being deleted or drained (kube-proxy's
    /// nodeEligible): `/healthz` answers 503, `/livez` is unaffected.
    pub node_ineligible: bool,
    /// The source currently reaches its objects (API server up); for logs and metrics.
    pub source_connected: bool,
}

pub type SharedStatus = Arc<Mutex<Status>>;

/// kube-proxy's default healthTimeout: an update queued for longer without being applied
/// makes the proxy unhealthy.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(60);

impl Status {
    pub fn healthy(&self, now: SystemTime) -> bool {
        if !self.synced {
            return false;
        }
        match (self.last_queued, self.last_updated) {
            (Some(q), Some(u)) if q > u => {
                now.duration_since(q).unwrap_or_default() < HEALTH_TIMEOUT
            }
            _ => true,
        }
    }
}
