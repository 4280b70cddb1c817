//! EndpointSlices -> merged endpoints per ServicePort, and kube-proxy's backend sets
//! (KP-03, KP-04, KP-11, KP-12).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use k8s_openapi::{
    api::discovery::v1::{Endpoint as SliceEndpoint, EndpointPort, EndpointSlice},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use super::types::{DesiredState, Endpoint, IpFamily, NodeInfo, Problem, Protocol, Skip};

/// Objects with this label belong to another proxy (KP-01).
pub(super) const LABEL_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Objects with this label are not proxied (KP-01).
pub(super) const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Ties a slice to its Service, in the slice's namespace.
const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";

/// One endpoint's conditions and topology hints, after merging every slice of its Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Candidate {
    pub(super) ready: bool,
    pub(super) serving: bool,
    pub(super) terminating: bool,
    pub(super) local: bool,
    /// `hints.forZones[].name`; empty when the endpoint has no zone hint.
    pub(super) zone_hints: BTreeSet<String>,
    /// `hints.forNodes[].name`; empty when the endpoint has no node hint.
    pub(super) node_hints: BTreeSet<String>,
}

/// Merged endpoints of one ServicePort, keyed (and so sorted) by (addr, port).
pub(super) type PortEndpoints = BTreeMap<(IpAddr, u16), Candidate>;

/// (slice port name, protocol) -> endpoints.
type ByPort = BTreeMap<(String, Protocol), PortEndpoints>;

/// Every usable slice, merged per (namespace, Service name, family).
#[derive(Debug, Default)]
pub(super) struct SliceIndex {
    by_service: BTreeMap<(String, String, IpFamily), ByPort>,
}

/// A slice port that survived validation.
struct SlicePort {
    key: (String, Protocol),
    port: u16,
}

impl SliceIndex {
    /// Reads every slice; bad or ignored ones end up in `out`'s problems and skips.
    pub(super) fn build(slices: &[EndpointSlice], node: &str, out: &mut DesiredState) -> Self {
        // Sorted so that "first copy wins" ties are deterministic.
        let mut sorted: Vec<&EndpointSlice> = slices.iter().collect();
        sorted.sort_by_key(|s| object_key(&s.metadata));
        let mut index = SliceIndex::default();
        for slice in sorted {
            index.add(slice, node, out);
        }
        index
    }

    /// The merged endpoints for one ServicePort (empty when no slice matches).
    pub(super) fn endpoints(
        &self,
        (namespace, name): (&str, &str),
        family: IpFamily,
        port_name: &str,
        protocol: Protocol,
    ) -> Option<&PortEndpoints> {
        let key = (namespace.to_owned(), name.to_owned(), family);
        self.by_service
            .get(&key)?
            .get(&(port_name.to_owned(), protocol))
    }

    /// The families some slice of this Service was published for.
    pub(super) fn families(&self, namespace: &str, name: &str) -> Vec<IpFamily> {
        [IpFamily::V4, IpFamily::V6]
            .into_iter()
            .filter(|f| {
                let key = (namespace.to_owned(), name.to_owned(), *f);
                self.by_service.contains_key(&key)
            })
            .collect()
    }

    fn add(&mut self, slice: &EndpointSlice, node: &str, out: &mut DesiredState) {
        let (namespace, name) = object_key(&slice.metadata);
        let object = format!("EndpointSlice {namespace}/{name}");
        if let Some(skip) = skip_by_label(&slice.metadata, &object) {
            out.skips.push(skip);
            return;
        }
        let Some(family) = slice_family(slice, &object, out) else {
            return;
        };
        let Some(service) = service_name(&slice.metadata, &object, out) else {
            return;
        };
        let ports = slice_ports(slice.ports.as_deref().unwrap_or_default(), &object, out);
        let endpoints = slice_endpoints(&slice.endpoints, family, node, &object, out);
        // The entry exists even without ports: it records that the family was published.
        let by_port = self
            .by_service
            .entry((namespace, service, family))
            .or_default();
        for port in ports {
            let merged = by_port.entry(port.key).or_default();
            for (addr, candidate) in &endpoints {
                merge(merged, (*addr, port.port), candidate.clone());
            }
        }
    }
}

/// `(namespace, name)`; a missing namespace means `default`, as for `kubectl apply`.
pub(super) fn object_key(meta: &ObjectMeta) -> (String, String) {
    let namespace = meta.namespace.as_deref().filter(|n| !n.is_empty());
    (
        namespace.unwrap_or("default").to_owned(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// kube-proxy's informers never see objects with either label (KP-01).
pub(super) fn skip_by_label(meta: &ObjectMeta, object: &str) -> Option<Skip> {
    let labels = meta.labels.as_ref()?;
    [
        (LABEL_PROXY_NAME, "service-proxy-name"),
        (LABEL_HEADLESS, "headless-label"),
    ]
    .into_iter()
    .find_map(|(label, reason)| {
        let value = labels.get(label)?;
        Some(Skip {
            object: object.to_owned(),
            reason,
            detail: format!("label {label}={value:?}"),
        })
    })
}

/// TCP when unset; `Ok(None)` for SCTP, which ferry does not proxy (KP-17).
pub(super) fn parse_protocol(protocol: Option<&str>) -> Result<Option<Protocol>, String> {
    match protocol {
        None | Some("TCP") => Ok(Some(Protocol::Tcp)),
        Some("UDP") => Ok(Some(Protocol::Udp)),
        Some("SCTP") => Ok(None),
        Some(other) => Err(format!(
            "unknown protocol {other:?} (want TCP, UDP or SCTP)"
        )),
    }
}

fn problem(out: &mut DesiredState, object: &str, field: String, message: String) {
    out.problems.push(Problem {
        object: object.to_owned(),
        field,
        message,
    });
}

/// IPv4/IPv6 slices are used, FQDN ones skipped, anything else is a problem.
fn slice_family(slice: &EndpointSlice, object: &str, out: &mut DesiredState) -> Option<IpFamily> {
    match slice.address_type.as_str() {
        "IPv4" => Some(IpFamily::V4),
        "IPv6" => Some(IpFamily::V6),
        "FQDN" => {
            out.skips.push(Skip {
                object: object.to_owned(),
                reason: "fqdn-slice",
                detail: "addressType FQDN".to_owned(),
            });
            None
        }
        other => {
            let message = format!("unknown addressType {other:?}; slice ignored");
            problem(out, object, "addressType".to_owned(), message);
            None
        }
    }
}

/// The owning Service's name; without it the slice cannot be joined to anything.
fn service_name(meta: &ObjectMeta, object: &str, out: &mut DesiredState) -> Option<String> {
    let name = meta.labels.as_ref().and_then(|l| l.get(LABEL_SERVICE_NAME));
    match name {
        Some(name) if !name.is_empty() => Some(name.clone()),
        _ => {
            let message = format!("no {LABEL_SERVICE_NAME} label; slice ignored");
            problem(out, object, "metadata.labels".to_owned(), message);
            None
        }
    }
}

/// The slice's ports, with kube-proxy's skips (nil name, nil or zero port) applied.
fn slice_ports(ports: &[EndpointPort], object: &str, out: &mut DesiredState) -> Vec<SlicePort> {
    let mut kept = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        let Some(name) = &port.name else {
            // kube-proxy silently ignores these; say so, since the fix is one word.
            let message = "unset, so kube-proxy ignores this port; write `name: \"\"` \
                           for the Service's unnamed port"
                .to_owned();
            problem(out, object, format!("ports[{i}].name"), message);
            continue;
        };
        let number = match port.port {
            None | Some(0) => continue,
            Some(n) => match u16::try_from(n) {
                Ok(n) => n,
                Err(_) => {
                    let message = format!("port {n} out of range 1-65535");
                    problem(out, object, format!("ports[{i}].port"), message);
                    continue;
                }
            },
        };
        match parse_protocol(port.protocol.as_deref()) {
            Ok(Some(protocol)) => kept.push(SlicePort {
                key: (name.clone(), protocol),
                port: number,
            }),
            Ok(None) => {} // SCTP: the Service side reports the skip.
            Err(message) => problem(out, object, format!("ports[{i}].protocol"), message),
        }
    }
    kept
}

/// The slice's endpoints: only `addresses[0]`, which must be of the slice's family.
fn slice_endpoints(
    endpoints: &[SliceEndpoint],
    family: IpFamily,
    node: &str,
    object: &str,
    out: &mut DesiredState,
) -> Vec<(IpAddr, Candidate)> {
    let mut kept = Vec::new();
    for (j, endpoint) in endpoints.iter().enumerate() {
        let Some(first) = endpoint.addresses.first() else {
            continue; // kube-proxy skips endpoints with no address.
        };
        let field = format!("endpoints[{j}].addresses[0]");
        match first.parse::<IpAddr>() {
            Ok(addr) if IpFamily::of(&addr) == family => {
                kept.push((addr, candidate(endpoint, node)));
            }
            Ok(addr) => {
                let message = format!("{addr} is not an {family} address; endpoint ignored");
                problem(out, object, field, message);
            }
            Err(_) => {
                let message = format!("not an IP address: {first:?}; endpoint ignored");
                problem(out, object, field, message);
            }
        }
    }
    kept
}

/// kube-proxy's defaults: unset ready/serving mean true, unset terminating means false.
/// Hints are taken as written (KP-03); the names are compared, never validated.
fn candidate(endpoint: &SliceEndpoint, node: &str) -> Candidate {
    let conditions = endpoint.conditions.as_ref();
    let hints = endpoint.hints.as_ref();
    Candidate {
        ready: conditions.and_then(|c| c.ready).unwrap_or(true),
        serving: conditions.and_then(|c| c.serving).unwrap_or(true),
        terminating: conditions.and_then(|c| c.terminating).unwrap_or(false),
        local: endpoint.node_name.as_deref() == Some(node),
        zone_hints: hints
            .and_then(|h| h.for_zones.as_ref())
            .into_iter()
            .flatten()
            .map(|z| z.name.clone())
            .collect(),
        node_hints: hints
            .and_then(|h| h.for_nodes.as_ref())
            .into_iter()
            .flatten()
            .map(|n| n.name.clone())
            .collect(),
    }
}

/// One IP:port in several slices: the non-terminating copy wins, else the first one.
fn merge(merged: &mut PortEndpoints, key: (IpAddr, u16), new: Candidate) {
    let replace = merged
        .get(&key)
        .is_none_or(|old| old.terminating && !new.terminating);
    if replace {
        merged.insert(key, new);
    }
}

/// A chosen backend set: the endpoints, whether they are the terminating fallback, and
/// whether topology hints shaped them.
pub(super) struct Chosen {
    pub(super) endpoints: Vec<Endpoint>,
    pub(super) terminating_fallback: bool,
    pub(super) topology: bool,
}

/// The topology filter kube-proxy's `topologyModeFromHints` picks for the cluster set.
#[derive(Clone, Copy, Debug)]
enum Topology<'a> {
    /// PreferSameNode: keep endpoints whose node hints name this node.
    SameNode(&'a str),
    /// PreferSameZone (and PreferClose): keep endpoints whose zone hints name this zone.
    SameZone(&'a str),
}

impl Topology<'_> {
    fn admits(self, c: &Candidate) -> bool {
        match self {
            Topology::SameNode(node) => c.node_hints.contains(node),
            Topology::SameZone(zone) => c.zone_hints.contains(zone),
        }
    }
}

/// All or nothing, over the ready endpoints only (KP-12): node hints win when every ready
/// endpoint has one and one names this node; else zone hints, when the node has a zone,
/// every ready endpoint has one and one names that zone; else no filter. Either filter
/// therefore keeps at least one ready endpoint. Which Service field asked for the hints
/// (`trafficDistribution`, the topology-mode annotation) does not matter, as in kube-proxy.
fn topology<'a>(endpoints: &PortEndpoints, node: &'a NodeInfo) -> Option<Topology<'a>> {
    let ready: Vec<&Candidate> = endpoints.values().filter(|c| c.ready).collect();
    let usable = |hints: fn(&Candidate) -> &BTreeSet<String>, name: &str| {
        ready.iter().all(|c| !hints(c).is_empty()) && ready.iter().any(|c| hints(c).contains(name))
    };
    if usable(|c| &c.node_hints, &node.name) {
        return Some(Topology::SameNode(&node.name));
    }
    let zone = node.zone.as_deref()?;
    usable(|c| &c.zone_hints, zone).then_some(Topology::SameZone(zone))
}

/// Cluster set: ready endpoints passing the topology filter, else serving+terminating
/// ones regardless of hints (KP-04, KP-12).
pub(super) fn cluster_set(endpoints: &PortEndpoints, node: &NodeInfo) -> Chosen {
    choose(endpoints, |_| true, topology(endpoints, node))
}

/// Local set: local ready endpoints, else local serving+terminating ones; topology
/// hints are ignored (KP-11).
pub(super) fn local_set(endpoints: &PortEndpoints) -> Chosen {
    choose(endpoints, |c| c.local, None)
}

/// Ready ones (that `topology` admits) first; only when none is, serving+terminating
/// ones, whatever their hints. Terminating and not serving is never used.
fn choose(
    endpoints: &PortEndpoints,
    keep: impl Fn(&Candidate) -> bool,
    topology: Option<Topology<'_>>,
) -> Chosen {
    let pick = |want: &dyn Fn(&Candidate) -> bool| -> Vec<Endpoint> {
        endpoints
            .iter()
            .filter(|(_, c)| keep(c) && want(c))
            .map(|(&(addr, port), c)| Endpoint {
                addr,
                port,
                terminating: c.terminating,
                local: c.local,
            })
            .collect()
    };
    let ready = pick(&|c| c.ready && topology.is_none_or(|t| t.admits(c)));
    if !ready.is_empty() {
        return Chosen {
            endpoints: ready,
            terminating_fallback: false,
            topology: topology.is_some(),
        };
    }
    let fallback = pick(&|c| c.serving && c.terminating);
    let terminating_fallback = !fallback.is_empty();
    Chosen {
        endpoints: fallback,
        terminating_fallback,
        topology: false,
    }
}

#[cfg(test)]
mod tests {
    use super::super::compute::testutil::{assert_model, dedent, node, zoned_node};

    /// Service `web` (ClusterIP 10.96.0.10:80) and slice `web-a` holding `endpoints`, a
    /// YAML list.
    fn web(endpoints: &str) -> String {
        let head = r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-a, namespace: default, labels: {kubernetes.io/service-name: web}}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints:
        "#;
        format!("{}{}", dedent(head), dedent(endpoints))
    }

    /// Conditions default as kube-proxy's: unset ready/serving are true.
    #[test]
    fn conditions_default_to_ready() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-a, namespace: default, labels: {kubernetes.io/service-name: web}}
            addressType: IPv4
            ports: [{name: http, port: 8080}]
            endpoints:
            - addresses: [10.0.0.2]
            - addresses: [10.0.0.1]
              conditions: {}
            - addresses: [10.0.0.3]
              conditions: {ready: false}
            "#,
            &node(),
            "
            default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080 10.0.0.2:8080
            ",
        );
    }

    /// Only ready endpoints while one exists; terminating ones are the fallback only.
    #[test]
    fn ready_endpoints_beat_terminating_ones() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-a, namespace: default, labels: {kubernetes.io/service-name: web}}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints:
            - addresses: [10.0.0.1]
              conditions: {ready: true, serving: true, terminating: false}
            - addresses: [10.0.0.2]
              conditions: {ready: false, serving: true, terminating: true}
            "#,
            &node(),
            "
            default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080
            ",
        );
    }

    /// No ready endpoint: serving+terminating ones are used, never terminating+unserving.
    #[test]
    fn terminating_fallback_excludes_unserving() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-a, namespace: default, labels: {kubernetes.io/service-name: web}}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints:
            - addresses: [10.0.0.3]
              conditions: {ready: false, serving: true, terminating: true}
            - addresses: [10.0.0.4]
              conditions: {ready: false, serving: false, terminating: true}
            - addresses: [10.0.0.5]
              conditions: {ready: false, serving: true, terminating: false}
            "#,
            &node(),
            "
            default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.3:8080(terminating) [terminating-fallback]
            ",
        );
    }

    /// Only terminating+unready endpoints: nothing usable, so reject (KP-04 e2e).
    #[test]
    fn terminating_and_unserving_only_rejects() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-a, namespace: default, labels: {kubernetes.io/service-name: web}}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints:
            - addresses: [10.0.0.4]
              conditions: {ready: false, serving: false, terminating: true}
            "#,
            &node(),
            "
            default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> reject
            ",
        );
    }

    /// Endpoints of one Service spread over slices are merged; the same IP:port in two
    /// slices is kept once, the non-terminating copy winning whatever the slice order.
    #[test]
    fn slices_merge_and_dedupe_prefers_non_terminating() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-a, namespace: default, labels: {kubernetes.io/service-name: web}}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints:
            - addresses: [10.0.0.1]
              conditions: {ready: false, serving: true, terminating: true}
            - addresses: [10.0.0.2]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-b, namespace: default, labels: {kubernetes.io/service-name: web}}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints:
            - addresses: [10.0.0.1]
            - addresses: [10.0.0.2]
              conditions: {ready: false, serving: true, terminating: true}
            - addresses: [10.0.0.3]
            "#,
            &node(),
            "
            default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080 10.0.0.2:8080 10.0.0.3:8080
            ",
        );
    }

    /// Slices of another namespace, or of another Service, do not join.
    #[test]
    fn slices_join_by_service_label_in_same_namespace() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-a, namespace: other, labels: {kubernetes.io/service-name: web}}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints: [{addresses: [10.0.0.1]}]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-b, namespace: default, labels: {kubernetes.io/service-name: api}}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints: [{addresses: [10.0.0.2]}]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-c, namespace: default}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints: [{addresses: [10.0.0.3]}]
            "#,
            &node(),
            "
            default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> reject
            problem: EndpointSlice default/web-c: metadata.labels: no kubernetes.io/service-name label; slice ignored
            ",
        );
    }

    /// Slice ports: nil name skipped with a hint, nil/zero port skipped silently, only
    /// addresses[0] used, endpoints without addresses skipped.
    #[test]
    fn slice_port_and_address_skips() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-a, namespace: default, labels: {kubernetes.io/service-name: web}}
            addressType: IPv4
            ports: [{port: 7070}, {name: "", port: 0}, {name: ""}, {name: "", port: 8080}]
            endpoints:
            - addresses: []
            - addresses: [10.0.0.1, 10.0.0.9]
            "#,
            &node(),
            r#"
            default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080
            problem: EndpointSlice default/web-a: ports[0].name: unset, so kube-proxy ignores this port; write `name: ""` for the Service's unnamed port
            "#,
        );
    }

    /// A bad address skips that endpoint only; the rest of the slice still counts.
    #[test]
    fn malformed_endpoint_address_is_a_problem() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-a, namespace: default, labels: {kubernetes.io/service-name: web}}
            addressType: IPv4
            ports: [{name: "", port: 8080}, {name: x, port: 70000}, {name: y, port: 1, protocol: ICMP}]
            endpoints:
            - addresses: [10.0.0.1]
            - addresses: [fd00::1]
            - addresses: [not-an-ip]
            "#,
            &node(),
            r#"
            default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080
            problem: EndpointSlice default/web-a: endpoints[1].addresses[0]: fd00::1 is not an IPv4 address; endpoint ignored
            problem: EndpointSlice default/web-a: endpoints[2].addresses[0]: not an IP address: "not-an-ip"; endpoint ignored
            problem: EndpointSlice default/web-a: ports[1].port: port 70000 out of range 1-65535
            problem: EndpointSlice default/web-a: ports[2].protocol: unknown protocol "ICMP" (want TCP, UDP or SCTP)
            "#,
        );
    }

    /// Slices carrying either label, or of addressType FQDN, are skipped.
    #[test]
    fn slice_skip_rules() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata:
              name: web-a
              namespace: default
              labels: {kubernetes.io/service-name: web, service.kubernetes.io/headless: ""}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints: [{addresses: [10.0.0.1]}]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata:
              name: web-b
              namespace: default
              labels: {kubernetes.io/service-name: web, service.kubernetes.io/service-proxy-name: other}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints: [{addresses: [10.0.0.2]}]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-c, namespace: default, labels: {kubernetes.io/service-name: web}}
            addressType: FQDN
            ports: [{name: "", port: 8080}]
            endpoints: [{addresses: [example.com]}]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-d, namespace: default, labels: {kubernetes.io/service-name: web}}
            addressType: IPv5
            endpoints: []
            "#,
            &node(),
            r#"
            default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> reject
            problem: EndpointSlice default/web-d: addressType: unknown addressType "IPv5"; slice ignored
            skip: EndpointSlice default/web-a headless-label label service.kubernetes.io/headless=""
            skip: EndpointSlice default/web-b service-proxy-name label service.kubernetes.io/service-proxy-name="other"
            skip: EndpointSlice default/web-c fqdn-slice addressType FQDN
            "#,
        );
    }

    /// Every ready endpoint has zone hints and one names this node's zone: only the
    /// endpoints hinted for that zone are kept (an endpoint may be hinted for several).
    #[test]
    fn zone_hints_keep_same_zone_endpoints() {
        assert_model(
            &web(
                "
                - addresses: [10.0.0.1]
                  nodeName: node-b
                  hints: {forZones: [{name: zone-a}]}
                - addresses: [10.0.0.2]
                  nodeName: node-c
                  hints: {forZones: [{name: zone-b}]}
                - addresses: [10.0.0.3]
                  nodeName: node-d
                  hints: {forZones: [{name: zone-b}, {name: zone-a}]}
                ",
            ),
            &zoned_node(),
            "
            default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080 10.0.0.3:8080 [topology]
            ",
        );
    }

    /// One ready endpoint without a zone hint (`hints: {}` or none at all) disables
    /// filtering: all or nothing.
    #[test]
    fn one_missing_zone_hint_disables_filtering() {
        for missing in ["hints: {}", "hints: {forZones: []}", "zone: zone-b"] {
            let endpoints = format!(
                "
                - addresses: [10.0.0.1]
                  hints: {{forZones: [{{name: zone-a}}]}}
                - addresses: [10.0.0.2]
                  {missing}
                "
            );
            assert_model(
                &web(&endpoints),
                &zoned_node(),
                "
                default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080 10.0.0.2:8080
                ",
            );
        }
    }

    /// Hints that all name other zones: no endpoint for this zone, so no filtering.
    #[test]
    fn hints_for_other_zones_only_do_not_filter() {
        assert_model(
            &web(
                "
                - addresses: [10.0.0.1]
                  hints: {forZones: [{name: zone-b}]}
                - addresses: [10.0.0.2]
                  hints: {forZones: [{name: zone-c}]}
                ",
            ),
            &zoned_node(),
            "
            default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080 10.0.0.2:8080
            ",
        );
    }

    /// A node without a `topology.kubernetes.io/zone` label ignores zone hints.
    #[test]
    fn node_without_zone_ignores_zone_hints() {
        assert_model(
            &web(
                "
                - addresses: [10.0.0.1]
                  hints: {forZones: [{name: zone-a}]}
                - addresses: [10.0.0.2]
                  hints: {forZones: [{name: zone-b}]}
                ",
            ),
            &node(),
            "
            default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080 10.0.0.2:8080
            ",
        );
    }

    /// Node hints, all present and one naming this node, beat zone hints; they apply
    /// whether or not the node has a zone.
    #[test]
    fn node_hints_beat_zone_hints() {
        let yaml = web("
            - addresses: [10.0.0.1]
              nodeName: node-a
              hints: {forNodes: [{name: node-a}], forZones: [{name: zone-a}]}
            - addresses: [10.0.0.2]
              nodeName: node-b
              hints: {forNodes: [{name: node-b}], forZones: [{name: zone-a}]}
            - addresses: [10.0.0.3]
              nodeName: node-c
              hints: {forNodes: [{name: node-c}], forZones: [{name: zone-b}]}
            ");
        for node in [zoned_node(), node()] {
            assert_model(
                &yaml,
                &node,
                "
                default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080(local) [topology]
                ",
            );
        }
    }

    /// Node hints that cannot apply (one missing, or none naming this node) fall back to
    /// zone hints.
    #[test]
    fn unusable_node_hints_fall_back_to_zone_hints() {
        for (first, second) in [("node-a", None), ("node-b", Some("node-c"))] {
            let second = second.map_or(String::new(), |n| format!("forNodes: [{{name: {n}}}], "));
            let endpoints = format!(
                "
                - addresses: [10.0.0.1]
                  hints: {{forNodes: [{{name: {first}}}], forZones: [{{name: zone-b}}]}}
                - addresses: [10.0.0.2]
                  hints: {{{second}forZones: [{{name: zone-a}}]}}
                "
            );
            assert_model(
                &web(&endpoints),
                &zoned_node(),
                "
                default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.2:8080 [topology]
                ",
            );
        }
    }

    /// Only ready endpoints count: an unready one without hints does not disable the
    /// filter, and unready or terminating ones hinted for this zone are not used.
    #[test]
    fn hints_are_judged_among_ready_endpoints() {
        assert_model(
            &web("
                - addresses: [10.0.0.1]
                  hints: {forZones: [{name: zone-a}]}
                - addresses: [10.0.0.2]
                  hints: {forZones: [{name: zone-b}]}
                - addresses: [10.0.0.3]
                  conditions: {ready: false}
                - addresses: [10.0.0.4]
                  conditions: {ready: false, serving: true, terminating: true}
                  hints: {forZones: [{name: zone-a}]}
                "),
            &zoned_node(),
            "
            default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080 [topology]
            ",
        );
    }

    /// No ready endpoint: the serving+terminating fallback ignores hints.
    #[test]
    fn terminating_fallback_ignores_hints() {
        assert_model(
            &web(
                "
                - addresses: [10.0.0.1]
                  conditions: {ready: false, serving: true, terminating: true}
                  hints: {forNodes: [{name: node-a}], forZones: [{name: zone-a}]}
                - addresses: [10.0.0.2]
                  conditions: {ready: false, serving: true, terminating: true}
                  hints: {forNodes: [{name: node-b}], forZones: [{name: zone-b}]}
                ",
            ),
            &zoned_node(),
            "
            default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080(terminating) 10.0.0.2:8080(terminating) [terminating-fallback]
            ",
        );
    }

    /// The same IP:port in two slices: the hints of the copy that wins the merge count.
    #[test]
    fn merged_endpoint_keeps_winning_copy_hints() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-a, namespace: default, labels: {kubernetes.io/service-name: web}}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints:
            - addresses: [10.0.0.1]
              conditions: {ready: false, serving: true, terminating: true}
            - addresses: [10.0.0.2]
              hints: {forZones: [{name: zone-b}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-b, namespace: default, labels: {kubernetes.io/service-name: web}}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints:
            - addresses: [10.0.0.1]
              hints: {forZones: [{name: zone-a}]}
            "#,
            &zoned_node(),
            "
            default/web:/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080 [topology]
            ",
        );
    }
}
