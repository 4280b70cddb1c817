//! A deterministic text form of [`DesiredState`], one line per frontend, for logs,
//! `ferry list` and tests (a failing test then reads like a behaviour diff).

use std::{fmt::Write as _, net::SocketAddr};

use super::types::{
    DesiredState, EmptyAction, Endpoint, FrontendKind, FrontendState, Scope, ServicePortState,
};

/// Renders frontends (in ServicePort then frontend order), then health checks, problems
/// and skips:
///
/// `default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080 [affinity=10800s]`
pub fn render(state: &DesiredState) -> String {
    let mut text = String::new();
    for service_port in state.services.values() {
        for frontend in &service_port.frontends {
            text.push_str(&frontend_line(service_port, frontend));
            text.push('\n');
        }
    }
    for ((namespace, name), check) in &state.health_checks {
        let _ = writeln!(
            text,
            "healthCheckNodePort: {namespace}/{name} port={} localEndpoints={}",
            check.port, check.local_endpoints
        );
    }
    for problem in &state.problems {
        // Writing to a String cannot fail.
        let _ = writeln!(text, "problem: {problem}");
    }
    for skip in &state.skips {
        let _ = writeln!(
            text,
            "skip: {} {} {}",
            skip.object, skip.reason, skip.detail
        );
    }
    text
}

fn frontend_line(service_port: &ServicePortState, frontend: &FrontendState) -> String {
    let set = &frontend.set;
    let mut line = format!(
        "{} {} {} {} ->",
        service_port.id,
        frontend.kind,
        SocketAddr::new(frontend.addr, frontend.port),
        scope(frontend.scope),
    );
    if set.endpoints.is_empty() {
        line.push_str(match set.empty_action {
            EmptyAction::Reject => " reject",
            EmptyAction::Drop => " drop",
        });
    }
    for endpoint in &set.endpoints {
        line.push(' ');
        line.push_str(&endpoint_text(endpoint));
    }
    if set.local_policy {
        line.push_str(" [local-policy]");
    }
    if set.topology {
        line.push_str(" [topology]");
    }
    if set.terminating_fallback {
        line.push_str(" [terminating-fallback]");
    }
    if let Some(timeout) = service_port.affinity_timeout_s {
        let _ = write!(line, " [affinity={timeout}s]");
    }
    let restricted =
        frontend.scope == Scope::ExternalOrigin && frontend.kind == FrontendKind::LoadBalancer;
    if let (true, Some(ranges)) = (restricted, &service_port.source_ranges) {
        let list: Vec<String> = ranges.iter().map(|c| c.to_string()).collect();
        let list = if list.is_empty() {
            "none".to_string()
        } else {
            list.join(",")
        };
        let _ = write!(line, " [source-ranges={list}]");
    }
    line
}

fn scope(scope: Scope) -> &'static str {
    match scope {
        Scope::LocalOrigin => "local-origin",
        Scope::ExternalOrigin => "external-origin",
    }
}

/// `10.0.0.1:8080`, `[fd00::1]:8080`, with `(local,terminating)` flags when set.
fn endpoint_text(endpoint: &Endpoint) -> String {
    let addr = SocketAddr::new(endpoint.addr, endpoint.port);
    let flags: Vec<&str> = [
        (endpoint.local, "local"),
        (endpoint.terminating, "terminating"),
    ]
    .into_iter()
    .filter_map(|(on, flag)| on.then_some(flag))
    .collect();
    if flags.is_empty() {
        addr.to_string()
    } else {
        format!("{addr}({})", flags.join(","))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::{super::compute::testutil::dedent, render};
    use crate::model::{
        DesiredState, EmptyAction, Endpoint, EndpointSet, FrontendKind, FrontendState, HealthCheck,
        IpFamily, Problem, Protocol, Scope, ServicePortId, ServicePortState, Skip,
    };

    fn id(name: &str, port_name: &str, family: IpFamily) -> ServicePortId {
        ServicePortId::new("default", name, port_name, Protocol::Tcp, family)
    }

    fn frontend(addr: &str, port: u16, kind: FrontendKind, set: EndpointSet) -> FrontendState {
        FrontendState {
            addr: addr.parse().unwrap(),
            port,
            kind,
            scope: Scope::LocalOrigin,
            set,
        }
    }

    fn set(endpoints: Vec<Endpoint>, empty_action: EmptyAction) -> EndpointSet {
        EndpointSet {
            endpoints,
            empty_action,
            terminating_fallback: false,
            local_policy: false,
            topology: false,
        }
    }

    fn endpoint(addr: &str, port: u16, terminating: bool, local: bool) -> Endpoint {
        Endpoint {
            addr: addr.parse().unwrap(),
            port,
            terminating,
            local,
        }
    }

    /// Every element of a line, built by hand so render is tested apart from compute.
    #[test]
    fn renders_every_part() {
        let web = id("web", "http", IpFamily::V4);
        let ready = vec![
            endpoint("10.0.0.1", 8080, false, false),
            endpoint("10.0.0.2", 8080, false, true),
        ];
        let mut same_zone = set(
            vec![endpoint("10.0.0.2", 8080, false, true)],
            EmptyAction::Reject,
        );
        same_zone.topology = true;
        let mut fallback = set(
            vec![endpoint("10.0.0.3", 8080, true, false)],
            EmptyAction::Reject,
        );
        fallback.terminating_fallback = true;
        let mut dropped = set(vec![], EmptyAction::Drop);
        dropped.local_policy = true;
        let v6 = id("v6", "", IpFamily::V6);
        let services = BTreeMap::from([
            (
                web.clone(),
                ServicePortState {
                    id: web,
                    source_ranges: None,
                    affinity_timeout_s: Some(10800),
                    frontends: vec![
                        frontend(
                            "10.96.0.10",
                            80,
                            FrontendKind::ClusterIp,
                            set(ready, EmptyAction::Reject),
                        ),
                        frontend("203.0.113.1", 80, FrontendKind::ExternalIp, same_zone),
                        FrontendState {
                            scope: Scope::ExternalOrigin,
                            ..frontend("192.168.1.10", 30080, FrontendKind::NodePort, fallback)
                        },
                    ],
                },
            ),
            (
                v6.clone(),
                ServicePortState {
                    id: v6,
                    source_ranges: Some(vec!["2001:db8::/32".parse().unwrap()]),
                    affinity_timeout_s: None,
                    frontends: vec![
                        frontend("fd00::10", 80, FrontendKind::ClusterIp, dropped),
                        frontend(
                            "2001:db8::1",
                            80,
                            FrontendKind::LoadBalancer,
                            set(vec![], EmptyAction::Reject),
                        ),
                        FrontendState {
                            scope: Scope::ExternalOrigin,
                            ..frontend(
                                "2001:db8::1",
                                80,
                                FrontendKind::LoadBalancer,
                                set(vec![], EmptyAction::Reject),
                            )
                        },
                    ],
                },
            ),
        ]);
        let state = DesiredState {
            services,
            health_checks: [(
                ("default".to_owned(), "web".to_owned()),
                HealthCheck {
                    port: 32000,
                    local_endpoints: 1,
                },
            )]
            .into(),
            problems: vec![Problem {
                object: "Service default/x".to_owned(),
                field: "spec.ports[1].port".to_owned(),
                message: "port 0 out of range 1-65535".to_owned(),
            }],
            skips: vec![Skip {
                object: "Service default/y".to_owned(),
                reason: "headless",
                detail: "clusterIP None".to_owned(),
            }],
        };
        let expected = dedent(
            "
            default/v6:/TCP/IPv6 clusterIP [fd00::10]:80 local-origin -> drop [local-policy]
            default/v6:/TCP/IPv6 loadBalancer [2001:db8::1]:80 local-origin -> reject
            default/v6:/TCP/IPv6 loadBalancer [2001:db8::1]:80 external-origin -> reject [source-ranges=2001:db8::/32]
            default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080 10.0.0.2:8080(local) [affinity=10800s]
            default/web:http/TCP/IPv4 externalIP 203.0.113.1:80 local-origin -> 10.0.0.2:8080(local) [topology] [affinity=10800s]
            default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 external-origin -> 10.0.0.3:8080(terminating) [terminating-fallback] [affinity=10800s]
            healthCheckNodePort: default/web port=32000 localEndpoints=1
            problem: Service default/x: spec.ports[1].port: port 0 out of range 1-65535
            skip: Service default/y headless clusterIP None
            ",
        );
        assert_eq!(render(&state), expected);
    }

    #[test]
    fn empty_state_renders_nothing() {
        assert_eq!(render(&DesiredState::default()), "");
    }
}
