//! The model for traffic from outside the node: externalTrafficPolicy (KP-09),
//! loadBalancerSourceRanges (KP-07), healthCheckNodePort (KP-10) and
//! `--nodeport-addresses` (KP-06).

use super::{
    NodeInfo, NodePortAddresses,
    compute::testutil::{assert_model, dedent, node},
};

/// Service `web` (ClusterIP, NodePort 30080, LB ingress 198.51.100.1) with `spec` lines
/// added to its spec, and one slice holding `endpoints` (a YAML list).
fn web(spec: &str, endpoints: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: default}}\n\
         spec:\n  clusterIP: 10.96.0.10\n  ports: [{{name: http, port: 80, nodePort: 30080}}]\n  {spec}\n\
         status:\n  loadBalancer: {{ingress: [{{ip: 198.51.100.1}}]}}\n\
         ---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: web-a, namespace: default, labels: {{kubernetes.io/service-name: web}}}}\n\
         addressType: IPv4\nports: [{{name: http, port: 8080}}]\nendpoints: {endpoints}\n"
    )
}

const BOTH: &str =
    "[{addresses: [10.0.0.1], nodeName: node-a}, {addresses: [10.0.0.2], nodeName: node-b}]";

/// eTP Cluster: every external frontend gets an external-origin twin with the cluster set.
#[test]
fn external_traffic_policy_cluster() {
    assert_model(
        &web(
            "type: LoadBalancer\n  externalIPs: [203.0.113.1]",
            BOTH,
        ),
        &node(),
        "
        default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 externalIP 203.0.113.1:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 external-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 external-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 externalIP 203.0.113.1:80 external-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        ",
    );
}

/// eTP Local: external-origin frontends take local endpoints only; local-origin ones keep
/// the cluster set (the short-circuit); the health check counts ready local endpoints.
#[test]
fn external_traffic_policy_local() {
    assert_model(
        &web(
            "type: LoadBalancer\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000",
            BOTH,
        ),
        &node(),
        "
        default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 external-origin -> 10.0.0.1:8080(local) [local-policy]
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 external-origin -> 10.0.0.1:8080(local) [local-policy]
        healthCheckNodePort: default/web port=32000 localEndpoints=1
        ",
    );
}

/// eTP Local without a local endpoint: drop when endpoints exist elsewhere, reject when
/// there are none at all; the local terminating fallback is used before either, but the
/// health check does not count it.
#[test]
fn external_traffic_policy_local_fallbacks() {
    let spec = "type: NodePort\n  externalTrafficPolicy: Local";
    assert_model(
        &web(spec, "[{addresses: [10.0.0.2], nodeName: node-b}]"),
        &node(),
        "
        default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.2:8080
        default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 local-origin -> 10.0.0.2:8080
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 local-origin -> 10.0.0.2:8080
        default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 external-origin -> drop [local-policy]
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 external-origin -> drop [local-policy]
        ",
    );
    assert_model(
        &web(spec, "[]"),
        &node(),
        "
        default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> reject
        default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 local-origin -> reject
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 local-origin -> reject
        default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 external-origin -> reject [local-policy]
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 external-origin -> reject [local-policy]
        ",
    );
    let terminating = "[{addresses: [10.0.0.1], nodeName: node-a, conditions: {ready: false, serving: true, terminating: true}}, {addresses: [10.0.0.2], nodeName: node-b}]";
    assert_model(
        &web(
            "type: LoadBalancer\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000",
            terminating,
        ),
        &node(),
        "
        default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.2:8080
        default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 local-origin -> 10.0.0.2:8080
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 local-origin -> 10.0.0.2:8080
        default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 external-origin -> 10.0.0.1:8080(local,terminating) [local-policy] [terminating-fallback]
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 external-origin -> 10.0.0.1:8080(local,terminating) [local-policy] [terminating-fallback]
        healthCheckNodePort: default/web port=32000 localEndpoints=0
        ",
    );
}

/// eTP Local counts only for externally reachable Services (kube-proxy's
/// ExternallyAccessible); a ClusterIP Service with externalIPs is one. No health check
/// without type LoadBalancer; an unknown policy is a problem.
#[test]
fn external_traffic_policy_scope_and_validation() {
    let yaml = format!(
        "{}---\n{}",
        web(
            "externalTrafficPolicy: Local\n  externalIPs: [203.0.113.1]\n  healthCheckNodePort: 32000",
            BOTH
        )
        .replace("nodePort: 30080", "nodePort: 0"),
        dedent(
            "
            apiVersion: v1
            kind: Service
            metadata: {name: bad, namespace: default}
            spec: {clusterIP: 10.96.0.11, externalTrafficPolicy: Sometimes, ports: [{port: 80}]}
            "
        )
    );
    assert_model(
        &yaml,
        &node(),
        "
        default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 externalIP 203.0.113.1:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 external-origin -> 10.0.0.1:8080(local) [local-policy]
        default/web:http/TCP/IPv4 externalIP 203.0.113.1:80 external-origin -> 10.0.0.1:8080(local) [local-policy]
        problem: Service default/bad: spec.externalTrafficPolicy: unknown policy \"Sometimes\" (want Cluster or Local)
        ",
    );
}

/// Source ranges restrict the external-origin LB frontend only, per family; a bad CIDR
/// is a problem and the rest still applies; a range holding the node's primary address
/// admits the LB IP itself as a source.
#[test]
fn load_balancer_source_ranges() {
    let spec = "type: LoadBalancer\n  loadBalancerSourceRanges: [\" 203.0.113.0/24\", 10.0.0.0/33, \"2001:db8::/32\"]\n  externalIPs: [192.0.2.1]";
    assert_model(
        &web(spec, BOTH),
        &node(),
        "
        default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 externalIP 192.0.2.1:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 externalIP 192.0.2.1:80 external-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 external-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 external-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080 [source-ranges=203.0.113.0/24]
        problem: Service default/web: spec.loadBalancerSourceRanges[1]: \"10.0.0.0/33\": prefix length 33 is too long; entry ignored
        ",
    );
    let from_node = "type: LoadBalancer\n  loadBalancerSourceRanges: [192.168.0.0/16]";
    assert_model(
        &web(from_node, "[]"),
        &node(),
        "
        default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> reject
        default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 local-origin -> reject
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 local-origin -> reject
        default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 external-origin -> reject
        default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 external-origin -> reject [source-ranges=192.168.0.0/16,198.51.100.1/32]
        ",
    );
    // Only IPv6 ranges: the IPv4 LB is not restricted (kube-proxy's per-family proxier);
    // only invalid ranges: the LB admits nobody.
    let other_family = "type: LoadBalancer\n  loadBalancerSourceRanges: [\"2001:db8::/32\"]";
    let invalid = "type: LoadBalancer\n  loadBalancerSourceRanges: [nonsense]";
    let lb_line = |yaml: &str| {
        let (services, slices) = super::compute::testutil::objects(yaml);
        let text = super::render(&super::compute(&services, &slices, &node()));
        text.lines()
            .filter(|l| {
                l.contains("loadBalancer 198.51.100.1:80 external-origin")
                    || l.starts_with("problem")
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(
        lb_line(&web(other_family, "[]")),
        "default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 external-origin -> reject"
    );
    assert_eq!(
        lb_line(&web(invalid, "[]")),
        "default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 external-origin -> reject [source-ranges=none]\n\
         problem: Service default/web: spec.loadBalancerSourceRanges[0]: \"nonsense\" is not a CIDR (want ADDR/LEN, e.g. 10.0.0.0/8); \
         entry ignored; no valid range is left, so the LoadBalancer admits no client from outside"
    );
}

fn nodeport_lines(node: &NodeInfo) -> String {
    let yaml = web("type: NodePort", "[]");
    let (services, slices) = super::compute::testutil::objects(&yaml);
    let mut state = super::compute(&services, &slices, node);
    state.services.values_mut().for_each(|sp| {
        sp.frontends
            .retain(|f| f.kind == super::FrontendKind::NodePort);
    });
    super::render(&state)
}

/// `--nodeport-addresses`: CIDRs filter their family (the other keeps every address),
/// `primary` keeps the primary address of each family; both scopes alike.
#[test]
fn nodeport_addresses() {
    let addresses = ["192.168.1.10", "10.1.0.2", "fd00:1::10", "fd00:2::10"];
    let base = NodeInfo {
        name: "node-a".into(),
        addresses: addresses.iter().map(|a| a.parse().unwrap()).collect(),
        ..Default::default()
    };
    let cidrs = NodeInfo {
        nodeport_addresses: NodePortAddresses::parse(&["10.0.0.0/8".into()]).unwrap(),
        ..base.clone()
    };
    assert_eq!(
        nodeport_lines(&cidrs),
        dedent(
            "
            default/web:http/TCP/IPv4 nodePort 10.1.0.2:30080 local-origin -> reject
            default/web:http/TCP/IPv4 nodePort 10.1.0.2:30080 external-origin -> reject
            "
        )
    );
    let primary = NodeInfo {
        nodeport_addresses: NodePortAddresses::parse(&["primary".into()]).unwrap(),
        primary_ips: vec!["10.1.0.2".parse().unwrap()],
        ..base
    };
    assert_eq!(
        nodeport_lines(&primary),
        dedent(
            "
            default/web:http/TCP/IPv4 nodePort 10.1.0.2:30080 local-origin -> reject
            default/web:http/TCP/IPv4 nodePort 10.1.0.2:30080 external-origin -> reject
            "
        )
    );
    assert!(NodePortAddresses::parse(&["primary".into(), "10.0.0.0/8".into()]).is_err());
    assert!(NodePortAddresses::parse(&["10.0.0.1".into()]).is_err());
}
