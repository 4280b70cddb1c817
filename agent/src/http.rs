//! `/healthz`, `/livez` (health address) and `/metrics`, `/proxyMode` (metrics address):
//! a deliberately small HTTP/1.1 responder, one request per connection.

use std::{
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

use crate::status::{SharedStatus, Status};

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
    let (code, content_type, body) = {
        let s = status.lock().expect("status lock");
        route(which, path, &s, SystemTime::now())
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

fn rfc3339(t: SystemTime) -> String {
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

fn metrics(s: &Status) -> String {
    let mut m = String::new();
    let mut gauge = |name: &str, help: &str, v: f64| {
        let _ = writeln!(m, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    };
    gauge(
        "ferry_services_programmed",
        "ServicePorts (per family) programmed in the maps.",
        s.services_programmed as f64,
    );
    gauge(
        "ferry_frontends_programmed",
        "Frontends (address, port, protocol) programmed.",
        s.frontends_programmed as f64,
    );
    gauge(
        "ferry_backends_programmed",
        "Distinct backends programmed.",
        s.backends_programmed as f64,
    );
    gauge(
        "ferry_object_problems",
        "Objects or fields skipped as invalid in the last sync.",
        s.object_problems as f64,
    );
    gauge(
        "ferry_plan_errors",
        "ServicePorts not programmed in the last sync (map full, too many endpoints).",
        s.plan_errors as f64,
    );
    gauge(
        "ferry_source_errors",
        "Manifest files that failed to parse in the last scan.",
        s.source_errors as f64,
    );
    gauge(
        "sync_proxy_rules_last_timestamp_seconds",
        "The last time the maps were successfully synced.",
        s.last_updated
            .map(|t| {
                t.duration_since(UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs_f64()
            })
            .unwrap_or(0.0),
    );
    let _ = writeln!(
        m,
        "# HELP sync_proxy_rules_duration_seconds Time to compute and write one sync.\n# TYPE sync_proxy_rules_duration_seconds summary\nsync_proxy_rules_duration_seconds_sum {}\nsync_proxy_rules_duration_seconds_count {}",
        s.sync_duration_sum.as_secs_f64(),
        s.syncs_total
    );
    let _ = writeln!(
        m,
        "# HELP ferry_map_write_failures_total Map writes that failed.\n# TYPE ferry_map_write_failures_total counter\nferry_map_write_failures_total {}",
        s.map_write_failures_total
    );
    let _ = writeln!(
        m,
        "# HELP sync_proxy_rules_service_changes_total Source changes seen.\n# TYPE sync_proxy_rules_service_changes_total counter\nsync_proxy_rules_service_changes_total {}",
        s.service_changes_total
    );
    let _ = writeln!(
        m,
        "# HELP ferry_skipped_total Objects or ports not proxied, by reason.\n# TYPE ferry_skipped_total gauge"
    );
    for (reason, n) in &s.skipped_by_reason {
        let _ = writeln!(m, "ferry_skipped_total{{reason=\"{reason}\"}} {n}");
    }
    let _ = writeln!(
        m,
        "# HELP ferry_map_entries Entries in use per map.\n# TYPE ferry_map_entries gauge"
    );
    for (map, (used, _)) in &s.map_entries {
        let _ = writeln!(m, "ferry_map_entries{{map=\"{map}\"}} {used}");
    }
    let _ = writeln!(
        m,
        "# HELP ferry_map_capacity Capacity per map.\n# TYPE ferry_map_capacity gauge"
    );
    for (map, (_, cap)) in &s.map_entries {
        let _ = writeln!(m, "ferry_map_capacity{{map=\"{map}\"}} {cap}");
    }
    let _ = writeln!(
        m,
        "# HELP ferry_datapath_events_total Socket-hook outcomes counted in BPF, by reason.\n# TYPE ferry_datapath_events_total counter"
    );
    for (name, v) in COUNTER_NAMES.iter().zip(&s.datapath) {
        let _ = writeln!(m, "ferry_datapath_events_total{{reason=\"{name}\"}} {v}");
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
