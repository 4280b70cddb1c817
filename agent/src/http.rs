//! `/healthz`, `/livez` (health address) and `/metrics`, `/proxyMode` (metrics address):
//! a deliberately small HTTP/1.1 responder, one request per connection.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::SocketAddr,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use ferry_common::metrics::COUNTER_NAMES;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};
use tracing::debug;

use crate::status::{Histogram, SharedStatus, Status};

#[derive(Clone, Copy)]
pub enum Endpoints {
    Health,
    Metrics,
}

pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

pub async fn serve(listener: TcpListener, which: Endpoints, status: SharedStatus) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let status = status.clone();
        tokio::spawn(async move {
            if let Err(e) = respond(stream, which, &status).await {
                debug!(error = %e, "http connection");
            }
        });
    }
}

async fn respond(
    mut stream: TcpStream,
    which: Endpoints,
    status: &SharedStatus,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16384 {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut chunk)).await??;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let request = String::from_utf8_lossy(&buf);
    let path = request.split_whitespace().nth(1).unwrap_or("/");
    let path = path.split('?').next().unwrap_or("/");
    if matches!(which, Endpoints::Metrics) && path == "/metrics" {
        // Read the kernel maps on scrape, off the async workers and without the lock.
        let stats = status.lock().expect("status lock").map_stats.clone();
        let snapshot = match stats {
            Some(st) => tokio::task::spawn_blocking(move || st.snapshot())
                .await
                .unwrap_or_default(),
            None => Default::default(),
        };
        status.lock().expect("status lock").scraped = snapshot;
    }
    let (code, content_type, body) = {
        let mut s = status.lock().expect("status lock");
        let r = route(which, path, &s, SystemTime::now());
        record(&mut s, which, path, r.0);
        r
    };
    let reason = match code {
        200 => "OK",
        404 => "Not Found",
        _ => "Service Unavailable",
    };
    let head = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}

/// RFC 3339 UTC with second precision, as Kubernetes writes times.
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    // Civil-from-days (Howard Hinnant's algorithm), to avoid a date crate for one field.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Counts `/healthz` and `/livez` answers by code (kube-proxy's `proxy_healthz_total`).
pub fn record(s: &mut Status, which: Endpoints, path: &str, code: u16) {
    let by_code = match (which, path) {
        (Endpoints::Health, "/healthz") => &mut s.healthz_total,
        (Endpoints::Health, "/livez") => &mut s.livez_total,
        _ => return,
    };
    *by_code.entry(code).or_default() += 1;
}

/// Pure routing, so the responses are unit-testable.
pub fn route(
    which: Endpoints,
    path: &str,
    s: &Status,
    now: SystemTime,
) -> (u16, &'static str, String) {
    match (which, path) {
        (Endpoints::Health, "/healthz" | "/livez") => {
            // /livez ignores node eligibility: a draining node is alive, just not a target.
            let eligible = !s.node_ineligible;
            let healthy = s.healthy(now) && (eligible || path == "/livez");
            let body = format!(
                "{{\"lastUpdated\": \"{}\",\"currentTime\": \"{}\", \"nodeEligible\": {eligible}}}",
                s.last_updated.map(rfc3339).unwrap_or_default(),
                rfc3339(now)
            );
            (if healthy { 200 } else { 503 }, "application/json", body)
        }
        (Endpoints::Metrics, "/metrics") => (200, "text/plain; version=0.0.4", metrics(s)),
        (Endpoints::Metrics, "/proxyMode") => (200, "text/plain", "ebpf".into()),
        _ => (404, "text/plain", "not found\n".into()),
    }
}

/// Writes Prometheus text exposition (version 0.0.4).
struct Exposition(String);

impl Exposition {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], v: f64) {
        self.0.push_str(name);
        if !labels.is_empty() {
            let pairs: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", escape_label(v)))
                .collect();
            let _ = write!(self.0, "{{{}}}", pairs.join(","));
        }
        let _ = writeln!(self.0, " {}", number(v));
    }

    fn gauge(&mut self, name: &str, help: &str, v: f64) {
        self.family(name, "gauge", help);
        self.sample(name, &[], v);
    }

    fn counter(&mut self, name: &str, help: &str, v: f64) {
        self.family(name, "counter", help);
        self.sample(name, &[], v);
    }

    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.family(name, "histogram", help);
        let bucket = format!("{name}_bucket");
        for (le, n) in h.cumulative() {
            self.sample(&bucket, &[("le", &number(le))], n as f64);
        }
        self.sample(&format!("{name}_sum"), &[], h.sum);
        self.sample(&format!("{name}_count"), &[], h.count as f64);
    }
}

/// A label value with `\`, `"` and newlines escaped.
pub fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// A sample value or bucket bound as Prometheus writes it (`+Inf`, shortest decimal).
fn number(v: f64) -> String {
    if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else if v.is_nan() {
        "NaN".into()
    } else {
        format!("{v}")
    }
}

fn unix_seconds(t: Option<SystemTime>) -> f64 {
    t.map(|t| {
        t.duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64()
    })
    .unwrap_or(0.0)
}

fn metrics(s: &Status) -> String {
    let mut m = Exposition(String::new());
    m.gauge(
        "ferry_services_programmed",
        "ServicePorts (per family) programmed in the maps.",
        s.services_programmed as f64,
    );
    m.gauge(
        "ferry_frontends_programmed",
        "Frontends (address, port, protocol) programmed.",
        s.frontends_programmed as f64,
    );
    m.gauge(
        "ferry_backends_programmed",
        "Distinct backends programmed.",
        s.backends_programmed as f64,
    );
    m.gauge(
        "ferry_object_problems",
        "Objects or fields skipped as invalid in the last sync.",
        s.object_problems as f64,
    );
    m.gauge(
        "ferry_plan_errors",
        "ServicePorts not programmed in the last sync (map full, too many endpoints).",
        s.plan_errors as f64,
    );
    m.gauge(
        "ferry_source_errors",
        "Manifest files that failed to parse in the last scan, or watched API objects that cannot be read now.",
        s.source_errors as f64,
    );
    if let Some(failed) = s.takeover_failed {
        m.gauge(
            "ferry_kube_proxy_takeover_failed",
            "1 when --takeover-kube-proxy failed to remove kube-proxy's rules (see the log).",
            if failed { 1.0 } else { 0.0 },
        );
        m.gauge(
            "ferry_kube_proxy_takeover_chains_removed",
            "kube-proxy chains removed by --takeover-kube-proxy.",
            s.takeover_chains_removed as f64,
        );
        m.gauge(
            "ferry_kube_proxy_takeover_rules_removed",
            "kube-proxy rules removed by --takeover-kube-proxy.",
            s.takeover_rules_removed as f64,
        );
    }
    if let Some(routes) = s.podnet_routes {
        m.gauge(
            "ferry_pod_network_routes",
            "Routes to other nodes' pod CIDRs the pod network wants (--pod-network).",
            routes as f64,
        );
        m.gauge(
            "ferry_pod_network_problems",
            "Problems of the pod network's last reconcile (each is in the log).",
            s.podnet_errors as f64,
        );
    }
    if let Some((pods, from_pod, to_pod)) = s.podnet_fast_path {
        m.gauge(
            "ferry_pod_network_fast_path_pods",
            "Pod veths whose traffic the pod network's fast path forwards at tc.",
            pods as f64,
        );
        m.counter(
            "ferry_pod_network_fast_path_from_pod_packets_total",
            "Packets from pods the fast path sent on to a pod CIDR.",
            from_pod as f64,
        );
        m.counter(
            "ferry_pod_network_fast_path_to_pod_packets_total",
            "Packets from other nodes the fast path delivered into a pod's namespace.",
            to_pod as f64,
        );
    }
    m.counter(
        "ferry_map_write_failures_total",
        "Map writes that failed.",
        s.map_write_failures_total as f64,
    );

    // kube-proxy's own metrics, under its names (subsystem `kubeproxy`).
    m.histogram(
        "kubeproxy_sync_proxy_rules_duration_seconds",
        "SyncProxyRules latency in seconds",
        &s.sync_duration,
    );
    m.histogram(
        "kubeproxy_network_programming_duration_seconds",
        "In Cluster Network Programming Latency in seconds",
        &s.network_programming,
    );
    m.gauge(
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "The last time proxy rules were successfully synced",
        unix_seconds(s.last_updated),
    );
    m.gauge(
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        "The last time a sync of proxy rules was queued",
        unix_seconds(s.last_queued),
    );
    m.counter(
        "kubeproxy_sync_proxy_rules_endpoint_changes_total",
        "Cumulative proxy rules Endpoint changes",
        s.endpoint_changes_total as f64,
    );
    m.counter(
        "kubeproxy_sync_proxy_rules_service_changes_total",
        "Cumulative proxy rules Service changes",
        s.service_changes_total as f64,
    );
    m.family(
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
        "gauge",
        "Number of services with a Local traffic policy and no endpoints",
    );
    m.sample(
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
        &[("traffic_policy", "internal")],
        s.no_local_endpoints_internal as f64,
    );
    for (name, help, by_code) in [
        (
            "kubeproxy_proxy_healthz_total",
            "Cumulative proxy healthz HTTP status",
            &s.healthz_total,
        ),
        (
            "kubeproxy_proxy_livez_total",
            "Cumulative proxy livez HTTP status",
            &s.livez_total,
        ),
    ] {
        m.family(name, "counter", help);
        for (code, n) in by_code {
            m.sample(name, &[("code", &code.to_string())], *n as f64);
        }
    }

    m.family(
        "ferry_skipped_total",
        "gauge",
        "Objects or ports not proxied, by reason.",
    );
    for (reason, n) in &s.skipped_by_reason {
        m.sample("ferry_skipped_total", &[("reason", reason)], *n as f64);
    }
    // Planned maps from the planner (capacity = the --max-* flag); the maps the programs
    // fill (members, affinity, reverse NAT, connection counts) counted in the kernel
    // (capacity = the map's size). Arrays (meta, counters) are fixed and left out.
    let mut fill: BTreeMap<&str, (usize, u32)> = s.map_entries.clone();
    for f in &s.scraped.fill {
        fill.insert(f.map, (f.entries, f.capacity));
    }
    m.family(
        "ferry_map_entries",
        "gauge",
        "Entries in use per map (LRU and program-written maps counted at most every 10 s).",
    );
    for (map, (used, _)) in &fill {
        m.sample("ferry_map_entries", &[("map", map)], *used as f64);
    }
    m.family(
        "ferry_map_capacity",
        "gauge",
        "Capacity per map: the planning capacity for the service and backend maps (grown live up to --max-services, --max-backends), the map size otherwise.",
    );
    for (map, (_, cap)) in &fill {
        m.sample("ferry_map_capacity", &[("map", map)], *cap as f64);
    }
    m.family(
        "ferry_map_capacity_bound",
        "gauge",
        "Upper bound of the planned maps' capacity (--max-services, --max-backends).",
    );
    for (map, bound) in &s.map_bounds {
        m.sample("ferry_map_capacity_bound", &[("map", map)], *bound as f64);
    }
    m.family(
        "ferry_map_growths_total",
        "counter",
        "Map generations swapped in because the planned maps filled up.",
    );
    m.sample("ferry_map_growths_total", &[], s.map_growths_total as f64);
    m.family(
        "ferry_map_growth_failures_total",
        "counter",
        "Attempts to grow the maps that failed (the current maps stayed).",
    );
    m.sample(
        "ferry_map_growth_failures_total",
        &[],
        s.map_growth_failures_total as f64,
    );
    m.family(
        "ferry_map_last_growth_seconds",
        "gauge",
        "How long the last growth took: load, fill, program swap.",
    );
    m.sample(
        "ferry_map_last_growth_seconds",
        &[],
        s.last_map_growth.as_secs_f64(),
    );
    m.family(
        "ferry_datapath_events_total",
        "counter",
        "Socket-hook outcomes counted in BPF, by reason.",
    );
    for (name, v) in COUNTER_NAMES.iter().zip(&s.datapath) {
        m.sample(
            "ferry_datapath_events_total",
            &[("reason", name)],
            *v as f64,
        );
    }
    m.family(
        "ferry_service_connections_total",
        "counter",
        "Connects and unconnected UDP datagrams translated to a backend, per ServicePort.",
    );
    for (id, n) in &s.scraped.service_connections {
        if let Some(name) = s.service_names.get(*id) {
            m.sample(
                "ferry_service_connections_total",
                &[("service", &name.to_string())],
                *n as f64,
            );
        }
    }
    m.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_709_251_199);
        assert_eq!(rfc3339(t), "2024-02-29T23:59:59Z", "leap day");
    }

    #[test]
    fn healthz_is_503_before_first_sync_and_200_after() {
        let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let mut s = Status::default();
        let (code, _, body) = route(Endpoints::Health, "/healthz", &s, now);
        assert_eq!(code, 503, "not synced yet: {body}");
        s.synced = true;
        s.last_updated = Some(now);
        let (code, _, body) = route(Endpoints::Health, "/healthz", &s, now);
        assert_eq!(code, 200);
        assert!(
            body.contains("\"lastUpdated\": \"2023-11-14T22:13:20Z\""),
            "{body}"
        );
        assert!(body.contains("nodeEligible"), "{body}");
    }

    #[test]
    fn stale_queued_update_makes_healthz_fail() {
        let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let s = Status {
            synced: true,
            last_updated: Some(now - Duration::from_secs(300)),
            last_queued: Some(now - Duration::from_secs(120)),
            ..Default::default()
        };
        assert_eq!(route(Endpoints::Health, "/livez", &s, now).0, 503);
    }

    #[test]
    fn proxy_mode_and_metrics() {
        let s = Status {
            datapath: vec![3, 1, 0, 0, 0, 0, 0, 0],
            ..Default::default()
        };
        let now = SystemTime::now();
        assert_eq!(route(Endpoints::Metrics, "/proxyMode", &s, now).2, "ebpf");
        let body = route(Endpoints::Metrics, "/metrics", &s, now).2;
        assert!(
            body.contains("ferry_datapath_events_total{reason=\"rejected_no_endpoints\"} 1"),
            "{body}"
        );
        assert_eq!(route(Endpoints::Metrics, "/nope", &s, now).0, 404);
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label(r#"a\b"c"#), r#"a\\b\"c"#);
        assert_eq!(escape_label("two\nlines"), r"two\nlines");
        assert_eq!(escape_label("ns/web:http/TCP/IPv4"), "ns/web:http/TCP/IPv4");
        let mut m = Exposition(String::new());
        m.sample(
            "x_total",
            &[("service", r#"we"ird\"#), ("code", "200")],
            3.0,
        );
        assert_eq!(m.0, "x_total{service=\"we\\\"ird\\\\\",code=\"200\"} 3\n");
        m.0.clear();
        m.family("y", "gauge", "help with \\ and\nnewline");
        assert_eq!(
            m.0,
            "# HELP y help with \\\\ and\\nnewline\n# TYPE y gauge\n"
        );
    }

    #[test]
    fn histogram_renders_cumulative_buckets_sum_and_count() {
        let mut s = Status::default();
        for d in [0.0005, 0.003, 0.003, 20.0] {
            s.sync_duration.observe(d);
        }
        let body = metrics(&s);
        let name = "kubeproxy_sync_proxy_rules_duration_seconds";
        assert!(
            body.contains(&format!("# TYPE {name} histogram\n")),
            "{body}"
        );
        let buckets: Vec<&str> = body
            .lines()
            .filter(|l| l.starts_with(&format!("{name}_bucket")))
            .collect();
        assert_eq!(buckets.len(), 16, "15 bounds and +Inf: {buckets:?}");
        assert_eq!(buckets[0], format!("{name}_bucket{{le=\"0.001\"}} 1"));
        assert_eq!(buckets[1], format!("{name}_bucket{{le=\"0.002\"}} 1"));
        assert_eq!(buckets[2], format!("{name}_bucket{{le=\"0.004\"}} 3"));
        assert_eq!(buckets[14], format!("{name}_bucket{{le=\"16.384\"}} 3"));
        assert_eq!(buckets[15], format!("{name}_bucket{{le=\"+Inf\"}} 4"));
        assert!(body.contains(&format!("\n{name}_sum 20.0065\n")), "{body}");
        assert!(body.contains(&format!("\n{name}_count 4\n")), "{body}");
        let np = "kubeproxy_network_programming_duration_seconds";
        assert!(
            body.contains(&format!("{np}_bucket{{le=\"0.25\"}} 0\n")),
            "{body}"
        );
        assert!(
            body.contains(&format!("{np}_bucket{{le=\"300\"}} 0\n")),
            "{body}"
        );
        assert!(body.contains(&format!("{np}_count 0\n")), "{body}");
    }

    #[test]
    fn kube_proxy_names_and_ferry_extras() {
        let mut s = Status {
            synced: true,
            last_updated: Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000)),
            last_queued: Some(UNIX_EPOCH + Duration::from_millis(1_699_999_999_500)),
            service_changes_total: 4,
            endpoint_changes_total: 9,
            no_local_endpoints_internal: 2,
            ..Default::default()
        };
        let web = crate::model::ServicePortId::new(
            "default",
            "web",
            "http",
            crate::model::Protocol::Tcp,
            crate::model::IpFamily::V4,
        );
        s.service_names = crate::status::ServiceNames::new(vec![(7, web)]);
        s.scraped.service_connections.insert(7, 12);
        s.scraped.service_connections.insert(99, 5); // no longer programmed: left out
        s.scraped.fill.push(crate::dataplane::kernel::MapFill {
            map: "FERRY_AFFINITY",
            entries: 3,
            capacity: 65536,
        });
        s.map_entries.insert("FERRY_SVC", (4, 65536));
        let now = UNIX_EPOCH + Duration::from_secs(1_700_000_001);
        for path in ["/healthz", "/healthz", "/livez"] {
            let code = route(Endpoints::Health, path, &s, now).0;
            record(&mut s, Endpoints::Health, path, code);
        }
        s.synced = false;
        let code = route(Endpoints::Health, "/healthz", &s, now).0;
        record(&mut s, Endpoints::Health, "/healthz", code);
        record(&mut s, Endpoints::Metrics, "/metrics", 200);
        let body = metrics(&s);
        for line in [
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds 1700000000",
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds 1699999999.5",
            "kubeproxy_sync_proxy_rules_service_changes_total 4",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 9",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"} 2",
            "kubeproxy_proxy_healthz_total{code=\"200\"} 2",
            "kubeproxy_proxy_healthz_total{code=\"503\"} 1",
            "kubeproxy_proxy_livez_total{code=\"200\"} 1",
            "ferry_service_connections_total{service=\"default/web:http/TCP/IPv4\"} 12",
            "ferry_map_entries{map=\"FERRY_AFFINITY\"} 3",
            "ferry_map_capacity{map=\"FERRY_AFFINITY\"} 65536",
            "ferry_map_entries{map=\"FERRY_SVC\"} 4",
            "# TYPE kubeproxy_proxy_healthz_total counter",
            "# TYPE ferry_service_connections_total counter",
        ] {
            assert!(
                body.lines().any(|l| l == line),
                "missing {line:?} in:\n{body}"
            );
        }
        assert!(
            !body.contains("} 5\n"),
            "unknown service ids are left out: {body}"
        );
        // Every sample follows the declaration of its family, declared once.
        let mut declared = std::collections::BTreeSet::new();
        for l in body.lines() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                let family = rest.split(' ').next().unwrap().to_string();
                assert!(declared.insert(family), "declared twice: {l}");
            } else if !l.starts_with('#') {
                let name = l.split(['{', ' ']).next().unwrap();
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|suf| name.strip_suffix(suf).filter(|f| declared.contains(*f)))
                    .unwrap_or(name);
                assert!(declared.contains(family), "sample before its family: {l}");
            }
        }
    }
}
