//! State shared between the sync loop and the HTTP endpoints.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use crate::{
    dataplane::kernel::{MapSnapshot, MapStats},
    model::ServicePortId,
    source::ObjectKey,
};

/// Service id -> ServicePort, sorted by id. The id, not its formatted name: it shares the
/// store's strings (a name per ServicePort was 2.3 MiB at 30,000). A sorted list built at
/// its exact size: a map collected from the unsorted owners holds everything twice while
/// it is built, which was the agent's peak after its first sync.
#[derive(Debug, Default)]
pub struct ServiceNames(Vec<(u32, ServicePortId)>);

impl ServiceNames {
    pub fn new(mut names: Vec<(u32, ServicePortId)>) -> ServiceNames {
        names.sort_unstable_by_key(|(id, _)| *id);
        ServiceNames(names)
    }

    pub fn get(&self, id: u32) -> Option<&ServicePortId> {
        let at = self.0.binary_search_by_key(&id, |(k, _)| *k).ok()?;
        Some(&self.0[at].1)
    }

    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().map(|(id, _)| *id)
    }
}

/// What `/healthz`, `/livez` and `/metrics` report. Updated by the sync loop.
#[derive(Debug)]
pub struct Status {
    /// When the per-service names were last rebuilt (see `Syncer::refresh_counters`).
    pub service_names_refreshed: Option<std::time::Instant>,
    /// Set once the first full sync reached the maps.
    pub synced: bool,
    /// When the source last reported a change the dataplane has not applied yet.
    pub last_queued: Option<SystemTime>,
    /// When the maps were last brought up to date.
    pub last_updated: Option<SystemTime>,
    pub syncs_total: u64,
    pub last_sync_duration: Duration,
    pub sync_duration_sum: Duration,
    /// kube-proxy's `sync_proxy_rules_duration_seconds`.
    pub sync_duration: Histogram,
    /// kube-proxy's `network_programming_duration_seconds`.
    pub network_programming: Histogram,
    /// Which EndpointSlice trigger times were already observed.
    pub triggers: TriggerTracker,
    /// When the agent's first sync started: trigger times before it are not observed
    /// (kube-proxy ignores changes made before its tracker started).
    pub started_at: Option<SystemTime>,
    pub services_programmed: usize,
    pub frontends_programmed: usize,
    pub backends_programmed: usize,
    pub map_entries: BTreeMap<&'static str, (usize, u32)>,
    /// The `--max-*` bounds the planned maps grow up to.
    pub map_bounds: BTreeMap<&'static str, u32>,
    /// Map generations swapped in because the maps filled up, and how long the last took.
    pub map_growths_total: u64,
    pub map_growth_failures_total: u64,
    pub last_map_growth: Duration,
    pub map_write_failures_total: u64,
    pub plan_errors: usize,
    pub object_problems: usize,
    pub source_errors: usize,
    pub skipped_by_reason: BTreeMap<&'static str, u64>,
    /// Per-reason datapath counters read from BPF (`COUNTER_NAMES` order).
    pub datapath: Vec<u64>,
    pub service_changes_total: u64,
    pub endpoint_changes_total: u64,
    /// ServicePorts with internalTrafficPolicy Local, endpoints, and none on this node
    /// (kube-proxy's `sync_proxy_rules_no_local_endpoints_total{traffic_policy="internal"}`).
    pub no_local_endpoints_internal: usize,
    /// Service id -> ServicePort, for per-service metrics.
    pub service_names: ServiceNames,
    /// `syncs_total` when `service_names` was last rebuilt.
    pub service_names_at: Option<u64>,
    /// Handles on the maps that `/metrics` reads on scrape.
    pub map_stats: Option<Arc<MapStats>>,
    /// What the current scrape read from the kernel (set right before rendering).
    pub scraped: MapSnapshot,
    /// `/healthz` and `/livez` answers by HTTP code.
    pub healthz_total: BTreeMap<u16, u64>,
    pub livez_total: BTreeMap<u16, u64>,
    /// False while this node's Node object is being deleted or drained (kube-proxy's
    /// nodeEligible): `/healthz` answers 503, `/livez` is unaffected.
    pub node_ineligible: bool,
    /// The source currently reaches its objects (API server up); for logs and metrics.
    pub source_connected: bool,
    /// `--takeover-kube-proxy`: None until it ran, then whether it failed.
    pub takeover_failed: Option<bool>,
    pub takeover_chains_removed: u64,
    pub takeover_rules_removed: u64,
    /// `--pod-network`: routes to other nodes' pod CIDRs (None when it is off or has not
    /// run yet), and the problems of its last reconcile.
    pub podnet_routes: Option<u64>,
    pub podnet_errors: u64,
    /// `--pod-network-fast-path`: pod veths carrying the program, and packets forwarded
    /// from pods and to pods.
    pub podnet_fast_path: Option<(u64, u64, u64)>,
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

/// A Prometheus histogram: cumulative counts are computed when rendered.
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    /// Upper bounds, ascending; `+Inf` is implicit.
    pub bounds: Vec<f64>,
    /// Observations per bucket (not cumulative); one more than `bounds` for `+Inf`.
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn new(bounds: Vec<f64>) -> Histogram {
        let counts = vec![0; bounds.len() + 1];
        Histogram {
            bounds,
            counts,
            sum: 0.0,
            count: 0,
        }
    }

    /// kube-proxy's `sync_proxy_rules_duration_seconds`: ExponentialBuckets(0.001, 2, 15).
    pub fn sync_duration() -> Histogram {
        Histogram::new((0..15).map(|i| 0.001 * f64::from(1u32 << i)).collect())
    }

    /// kube-proxy's `network_programming_duration_seconds`: 0.25 s, 0.5 s, 1..59 s,
    /// 60..115 s by 5, 120..300 s by 30.
    pub fn network_programming() -> Histogram {
        let mut b = vec![0.25, 0.5];
        b.extend((1..=59).map(f64::from));
        b.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
        b.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
        Histogram::new(b)
    }

    pub fn observe(&mut self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    /// `(upper bound, cumulative count)` per bucket, `+Inf` last.
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut acc = 0;
        self.bounds
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(&self.counts)
            .map(|(b, c)| {
                acc += c;
                (b, acc)
            })
            .collect()
    }
}

impl Default for Status {
    fn default() -> Self {
        Status {
            service_names_refreshed: None,
            synced: false,
            last_queued: None,
            last_updated: None,
            syncs_total: 0,
            last_sync_duration: Duration::ZERO,
            sync_duration_sum: Duration::ZERO,
            sync_duration: Histogram::sync_duration(),
            network_programming: Histogram::network_programming(),
            triggers: TriggerTracker::default(),
            started_at: None,
            services_programmed: 0,
            frontends_programmed: 0,
            backends_programmed: 0,
            map_entries: BTreeMap::new(),
            map_bounds: BTreeMap::new(),
            map_growths_total: 0,
            map_growth_failures_total: 0,
            last_map_growth: Duration::ZERO,
            map_write_failures_total: 0,
            plan_errors: 0,
            object_problems: 0,
            source_errors: 0,
            skipped_by_reason: BTreeMap::new(),
            datapath: Vec::new(),
            service_changes_total: 0,
            endpoint_changes_total: 0,
            no_local_endpoints_internal: 0,
            service_names: ServiceNames::default(),
            service_names_at: None,
            map_stats: None,
            scraped: MapSnapshot::default(),
            healthz_total: BTreeMap::new(),
            livez_total: BTreeMap::new(),
            node_ineligible: false,
            // As the kube source's own state: nothing reported counts as connected, so
            // the first outage (`Connected(false)`) is seen as a change and logged.
            source_connected: true,
            takeover_failed: None,
            takeover_chains_removed: 0,
            takeover_rules_removed: 0,
            podnet_routes: None,
            podnet_errors: 0,
            podnet_fast_path: None,
        }
    }
}

/// One EndpointSlice's `endpoints.kubernetes.io/last-change-trigger-time`:
/// (owning Service, slice, raw annotation value).
pub type Trigger = (ObjectKey, ObjectKey, String);

/// Remembers the trigger time last observed per EndpointSlice, so each change is observed
/// once, when the sync that carried it reached the maps (kube-proxy's network
/// programming latency).
#[derive(Debug, Default)]
pub struct TriggerTracker {
    seen: HashMap<ObjectKey, BTreeMap<ObjectKey, String>>,
}

impl TriggerTracker {
    /// `synced` are the Services a successful sync covered, `current` their slices'
    /// trigger times now. Returns the latencies (`now` - trigger) of trigger values not
    /// observed before and not older than `since`; remembers them all.
    pub fn observe(
        &mut self,
        synced: &BTreeSet<ObjectKey>,
        current: Vec<Trigger>,
        since: SystemTime,
        now: SystemTime,
    ) -> Vec<f64> {
        let mut next: HashMap<ObjectKey, BTreeMap<ObjectKey, String>> = HashMap::new();
        for (svc, slice, value) in current {
            next.entry(svc).or_default().insert(slice, value);
        }
        let mut out = Vec::new();
        for svc in synced {
            let old = self.seen.remove(svc).unwrap_or_default();
            let Some(new) = next.remove(svc) else {
                continue;
            };
            for (slice, value) in &new {
                if old.get(slice) == Some(value) {
                    continue;
                }
                let Some(t) = parse_rfc3339(value) else {
                    continue;
                };
                if t < since {
                    continue;
                }
                out.push(now.duration_since(t).unwrap_or_default().as_secs_f64());
            }
            self.seen.insert(svc.clone(), new);
        }
        out
    }

    /// Forgets Services that no longer exist (after a full sync).
    pub fn retain(&mut self, live: impl Fn(&ObjectKey) -> bool) {
        self.seen.retain(|k, _| live(k));
    }
}

/// An RFC 3339 time (`2024-05-01T12:00:00Z`, fractions and offsets allowed).
pub fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    let ts: k8s_openapi::jiff::Timestamp = s.trim().parse().ok()?;
    Some(SystemTime::from(ts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_names_are_found_by_id() {
        let id = |name: &str| {
            ServicePortId::new(
                "default",
                name,
                "",
                crate::model::Protocol::Tcp,
                crate::model::IpFamily::V4,
            )
        };
        let names = ServiceNames::new(vec![(9, id("b")), (2, id("a")), (5, id("c"))]);
        assert_eq!(names.get(5), Some(&id("c")));
        assert_eq!(names.get(3), None);
        assert_eq!(names.ids().collect::<Vec<_>>(), [2, 5, 9]);
    }

    #[test]
    fn histogram_buckets_match_kube_proxy() {
        let h = Histogram::sync_duration();
        assert_eq!(h.bounds.len(), 15);
        assert_eq!(h.bounds[0], 0.001);
        assert_eq!(h.bounds[14], 16.384);
        let n = Histogram::network_programming();
        assert_eq!(n.bounds.len(), 2 + 59 + 12 + 7);
        assert_eq!(&n.bounds[..4], &[0.25, 0.5, 1.0, 2.0]);
        assert!(n.bounds.contains(&115.0) && n.bounds.contains(&300.0));
        assert!(n.bounds.windows(2).all(|w| w[0] < w[1]), "ascending");
    }

    #[test]
    fn histogram_counts_are_cumulative_with_inf() {
        let mut h = Histogram::new(vec![0.1, 1.0]);
        for v in [0.05, 0.1, 0.5, 7.0] {
            h.observe(v);
        }
        assert_eq!(h.cumulative(), vec![(0.1, 2), (1.0, 3), (f64::INFINITY, 4)]);
        assert_eq!(h.count, 4);
        assert!((h.sum - 7.65).abs() < 1e-9);
    }

    fn key(n: &str) -> ObjectKey {
        ObjectKey::new("default", n)
    }

    #[test]
    fn each_trigger_value_is_observed_once() {
        let start = parse_rfc3339("2024-05-01T12:00:00Z").unwrap();
        let now = start + Duration::from_secs(10);
        let mut t = TriggerTracker::default();
        let web: BTreeSet<ObjectKey> = [key("web")].into();
        let trig = |v: &str| vec![(key("web"), key("web-1"), v.to_string())];
        // Before the agent started: ignored, but remembered.
        assert!(
            t.observe(&web, trig("2024-05-01T11:00:00Z"), start, now)
                .is_empty()
        );
        assert!(
            t.observe(&web, trig("2024-05-01T11:00:00Z"), start, now)
                .is_empty()
        );
        assert_eq!(
            t.observe(&web, trig("2024-05-01T12:00:07Z"), start, now),
            vec![3.0]
        );
        assert!(
            t.observe(&web, trig("2024-05-01T12:00:07Z"), start, now)
                .is_empty(),
            "same value"
        );
        // Fractions and offsets parse; a Service not synced is not looked at.
        let v = "2024-05-01T14:00:08.5+02:00";
        assert!(t.observe(&BTreeSet::new(), trig(v), start, now).is_empty());
        assert_eq!(t.observe(&web, trig(v), start, now), vec![1.5]);
        // A garbage value is skipped.
        assert!(t.observe(&web, trig("yesterday"), start, now).is_empty());
        // A new slice of the Service is observed on its own.
        let two = vec![
            (key("web"), key("web-1"), "yesterday".to_string()),
            (key("web"), key("web-2"), "2024-05-01T12:00:09Z".to_string()),
        ];
        assert_eq!(t.observe(&web, two, start, now), vec![1.0]);
    }
}
