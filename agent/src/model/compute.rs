//! Services + EndpointSlices + this node -> [`DesiredState`]: kube-proxy's decisions
//! (KP-01, KP-05..13, KP-16..18), made once, here.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
};

use k8s_openapi::api::{
    core::v1::{Service, ServicePort, ServiceSpec},
    discovery::v1::EndpointSlice,
};

use super::{
    cidr::Cidr,
    endpoints::{
        PortEndpoints, SliceIndex, cluster_set, local_set, object_key, parse_protocol,
        skip_by_label,
    },
    types::{
        DesiredState, EmptyAction, EndpointSet, FrontendKind, FrontendState, HealthCheck, IpFamily,
        NodeInfo, NodePortAddresses, Problem, Protocol, Scope, ServicePortId, ServicePortState,
        Skip,
    },
};

/// The API server's default `sessionAffinityConfig.clientIP.timeoutSeconds` (3 h).
const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10_800;
/// The API server's upper bound for that timeout (1 day).
const MAX_AFFINITY_TIMEOUT_S: u32 = 86_400;

/// Decides every frontend and backend set this node must program. Never fails: bad
/// objects become [`Problem`]s, deliberately ignored ones [`Skip`]s.
pub fn compute(services: &[Service], slices: &[EndpointSlice], node: &NodeInfo) -> DesiredState {
    let mut out = DesiredState::default();
    let index = SliceIndex::build(slices, &node.name, &mut out);
    let node_addrs = node_addresses(node);
    let mut claims = Claims::default();
    // (namespace, name) order decides who keeps a contested frontend.
    let mut sorted: Vec<&Service> = services.iter().collect();
    sorted.sort_by_key(|s| object_key(&s.metadata));
    let mut seen = BTreeSet::new();
    for service in sorted {
        let key = object_key(&service.metadata);
        let object = format!("Service {}/{}", key.0, key.1);
        if !seen.insert(key) {
            out.problems.push(problem(
                &object,
                "metadata.name",
                "defined twice; the first is kept",
            ));
            continue;
        }
        if let Some(parsed) = parse_service(service, object, &mut out) {
            let mut emitter = Emitter {
                index: &index,
                node,
                node_addrs: &node_addrs,
                claims: &mut claims,
            };
            emitter.service(&parsed, &mut out);
        }
    }
    out.problems.sort();
    out.problems.dedup();
    out.skips.sort();
    out.skips.dedup();
    out
}

/// NodePorts are served on the node's addresses, never on loopback, and only on those
/// `--nodeport-addresses` admits (KP-06).
fn node_addresses(node: &NodeInfo) -> Vec<IpAddr> {
    let primary = node.primary();
    let admitted = |a: &IpAddr| match &node.nodeport_addresses {
        NodePortAddresses::All => true,
        NodePortAddresses::Primary => primary.contains(a),
        // A family that no CIDR names is not filtered (kube-proxy's MatchAll per family).
        NodePortAddresses::Cidrs(cidrs) => {
            let family = IpFamily::of(a);
            let mut of_family = cidrs.iter().filter(|c| c.family() == family).peekable();
            of_family.peek().is_none() || of_family.any(|c| c.contains(a))
        }
    };
    let mut addrs: Vec<IpAddr> = node
        .addresses
        .iter()
        .copied()
        .filter(|a| !a.is_loopback() && !a.is_unspecified() && !a.is_multicast())
        .filter(admitted)
        .collect();
    addrs.sort();
    addrs.dedup();
    addrs
}

fn problem(object: &str, field: impl Into<String>, message: impl Into<String>) -> Problem {
    Problem {
        object: object.to_owned(),
        field: field.into(),
        message: message.into(),
    }
}

/// An IP taken from a Service, with the field it came from (for problems).
#[derive(Debug)]
struct SourcedIp {
    addr: IpAddr,
    field: String,
}

/// One validated `spec.ports[]` entry.
#[derive(Debug)]
struct ParsedPort {
    index: usize,
    name: String,
    protocol: Protocol,
    port: u16,
    node_port: Option<u16>,
}

/// A Service that passed validation: everything `Emitter` needs, already typed.
#[derive(Debug)]
struct ParsedService {
    namespace: String,
    name: String,
    object: String,
    /// At most one per family, in spec order.
    cluster_ips: Vec<SourcedIp>,
    ports: Vec<ParsedPort>,
    external_ips: Vec<SourcedIp>,
    lb_ips: Vec<SourcedIp>,
    internal_local: bool,
    /// externalTrafficPolicy Local on an externally reachable Service (KP-09).
    external_local: bool,
    /// Valid `loadBalancerSourceRanges`, every family; `None` when unset. Empty when
    /// every entry was invalid: the LB then admits nobody rather than everybody.
    source_ranges: Option<Vec<Cidr>>,
    /// `spec.healthCheckNodePort` of a LoadBalancer with externalTrafficPolicy Local.
    health_check_port: Option<u16>,
    affinity_timeout_s: Option<u32>,
}

/// Collects what validating one Service found. Any `fatal` problem drops the Service;
/// `notes` and `skips` are reported either way (skips only if the Service is kept).
struct Check {
    object: String,
    fatal: Vec<Problem>,
    notes: Vec<Problem>,
    skips: Vec<Skip>,
}

impl Check {
    fn bad(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.fatal.push(problem(&self.object, field, message));
    }

    fn note(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.notes.push(problem(&self.object, field, message));
    }

    fn skip(&mut self, reason: &'static str, detail: impl Into<String>) {
        let object = self.object.clone();
        self.skips.push(Skip {
            object,
            reason,
            detail: detail.into(),
        });
    }

    /// Moves the findings to `out`; true when the Service is to be kept.
    fn finish(self, out: &mut DesiredState) -> bool {
        let keep = self.fatal.is_empty();
        out.problems.extend(self.fatal);
        out.problems.extend(self.notes);
        if keep {
            out.skips.extend(self.skips);
        }
        keep
    }
}

/// Applies the skip rules, then validates; `None` when the Service is not proxied.
fn parse_service(
    service: &Service,
    object: String,
    out: &mut DesiredState,
) -> Option<ParsedService> {
    if let Some(skip) = skip_by_label(&service.metadata, &object) {
        out.skips.push(skip);
        return None;
    }
    let Some(spec) = &service.spec else {
        out.problems
            .push(problem(&object, "spec", "missing; Service ignored"));
        return None;
    };
    if let Some((reason, detail)) = skip_reason(spec) {
        out.skips.push(Skip {
            object,
            reason,
            detail,
        });
        return None;
    }
    let mut check = Check {
        object,
        fatal: vec![],
        notes: vec![],
        skips: vec![],
    };
    let parsed = validate(service, spec, &mut check);
    check.finish(out).then_some(parsed)
}

/// ExternalName and headless Services have nothing to proxy (KP-01).
fn skip_reason(spec: &ServiceSpec) -> Option<(&'static str, String)> {
    if spec.type_.as_deref() == Some("ExternalName") {
        return Some(("external-name", "type ExternalName".to_owned()));
    }
    let detail = match cluster_ip_list(spec).0.first().map(String::as_str) {
        None | Some("") => "no clusterIP",
        Some("None") => "clusterIP None",
        Some(_) => return None,
    };
    Some(("headless", detail.to_owned()))
}

/// `spec.clusterIPs`, falling back to `spec.clusterIP`, with the field name to report.
fn cluster_ip_list(spec: &ServiceSpec) -> (Vec<String>, &'static str) {
    match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => (ips.clone(), "spec.clusterIPs"),
        _ => (spec.cluster_ip.iter().cloned().collect(), "spec.clusterIP"),
    }
}

fn validate(service: &Service, spec: &ServiceSpec, check: &mut Check) -> ParsedService {
    let (namespace, name) = object_key(&service.metadata);
    check_type(spec, check);
    let external_local = external_local(spec, check);
    ParsedService {
        namespace,
        name,
        object: check.object.clone(),
        cluster_ips: cluster_ips(spec, check),
        ports: ports(spec.ports.as_deref().unwrap_or_default(), check),
        external_ips: external_ips(spec, check),
        lb_ips: lb_ips(service, check),
        internal_local: internal_local(spec, check),
        external_local,
        source_ranges: source_ranges(spec, check),
        health_check_port: health_check_port(spec, external_local, check),
        affinity_timeout_s: affinity(spec, check),
    }
}

fn check_type(spec: &ServiceSpec, check: &mut Check) {
    match spec.type_.as_deref() {
        None | Some("ClusterIP" | "NodePort" | "LoadBalancer") => {}
        Some(other) => check.bad("spec.type", format!("unknown type {other:?}")),
    }
}

/// One ClusterIP per family (KP-16); a second of the same family is malformed.
fn cluster_ips(spec: &ServiceSpec, check: &mut Check) -> Vec<SourcedIp> {
    let (list, base) = cluster_ip_list(spec);
    let mut ips: Vec<SourcedIp> = Vec::new();
    for (i, text) in list.iter().enumerate() {
        let field = if base == "spec.clusterIP" {
            base.to_owned()
        } else {
            format!("{base}[{i}]")
        };
        let Ok(addr) = text.parse::<IpAddr>() else {
            check.bad(field, format!("not an IP address: {text:?}"));
            continue;
        };
        let family = IpFamily::of(&addr);
        if ips.iter().any(|ip| IpFamily::of(&ip.addr) == family) {
            check.bad(field, format!("second {family} ClusterIP {addr}"));
            continue;
        }
        ips.push(SourcedIp { addr, field });
    }
    ips
}

fn ports(ports: &[ServicePort], check: &mut Check) -> Vec<ParsedPort> {
    if ports.is_empty() {
        check.bad("spec.ports", "no ports");
    }
    let mut parsed: Vec<ParsedPort> = Vec::new();
    for (index, port) in ports.iter().enumerate() {
        let Some(p) = parse_port(index, port, check) else {
            continue;
        };
        // Two entries with one name and protocol would be one ServicePortName.
        if parsed
            .iter()
            .any(|q| (&q.name, q.protocol) == (&p.name, p.protocol))
        {
            let message = format!("duplicate port name {:?} for {}", p.name, p.protocol);
            check.bad(format!("spec.ports[{index}].name"), message);
            continue;
        }
        parsed.push(p);
    }
    parsed
}

/// One `spec.ports[]` entry; `None` when skipped (SCTP) or malformed.
fn parse_port(index: usize, port: &ServicePort, check: &mut Check) -> Option<ParsedPort> {
    let field = |name: &str| format!("spec.ports[{index}].{name}");
    let name = port.name.clone().unwrap_or_default();
    let protocol = match parse_protocol(port.protocol.as_deref()) {
        Ok(Some(protocol)) => protocol,
        Ok(None) => {
            check.skip(
                "sctp",
                format!("spec.ports[{index}] {name:?} {}/SCTP", port.port),
            );
            return None;
        }
        Err(message) => {
            check.bad(field("protocol"), message);
            return None;
        }
    };
    let number = u16::try_from(port.port).ok().filter(|p| *p > 0);
    if number.is_none() {
        check.bad(
            field("port"),
            format!("port {} out of range 1-65535", port.port),
        );
    }
    let node_port = match port.node_port.map(u16::try_from) {
        None | Some(Ok(0)) => Some(None),
        Some(Ok(n)) => Some(Some(n)),
        Some(Err(_)) => {
            let message = format!(
                "nodePort {} out of range 0-65535",
                port.node_port.unwrap_or_default()
            );
            check.bad(field("nodePort"), message);
            None
        }
    };
    Some(ParsedPort {
        index,
        name,
        protocol,
        port: number?,
        node_port: node_port?,
    })
}

fn external_ips(spec: &ServiceSpec, check: &mut Check) -> Vec<SourcedIp> {
    let mut ips = Vec::new();
    for (i, text) in spec.external_ips.iter().flatten().enumerate() {
        let field = format!("spec.externalIPs[{i}]");
        match text.parse::<IpAddr>() {
            Ok(addr) => ips.push(SourcedIp { addr, field }),
            Err(_) => check.bad(field, format!("not an IP address: {text:?}")),
        }
    }
    ips
}

/// VIP-mode LB ingress IPs (KP-07). Status is written by a controller, not the user, so a
/// bad entry is reported and ignored without dropping the whole Service.
fn lb_ips(service: &Service, check: &mut Check) -> Vec<SourcedIp> {
    let status = service
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref());
    let mut ips = Vec::new();
    for (i, ingress) in status
        .and_then(|lb| lb.ingress.as_ref())
        .into_iter()
        .flatten()
        .enumerate()
    {
        let Some(text) = &ingress.ip else { continue }; // hostname-only: not ours
        match ingress.ip_mode.as_deref() {
            None | Some("VIP") => {}
            Some("Proxy") => continue, // traffic must go through the real LB
            Some(other) => {
                let field = format!("status.loadBalancer.ingress[{i}].ipMode");
                check.note(field, format!("unknown ipMode {other:?}; entry ignored"));
                continue;
            }
        }
        let field = format!("status.loadBalancer.ingress[{i}].ip");
        match text.parse::<IpAddr>() {
            Ok(addr) => ips.push(SourcedIp { addr, field }),
            Err(_) => check.note(field, format!("not an IP address: {text:?}; entry ignored")),
        }
    }
    ips
}

fn internal_local(spec: &ServiceSpec, check: &mut Check) -> bool {
    match spec.internal_traffic_policy.as_deref() {
        None | Some("Cluster") => false,
        Some("Local") => true,
        Some(other) => {
            let message = format!("unknown policy {other:?} (want Cluster or Local)");
            check.bad("spec.internalTrafficPolicy", message);
            false
        }
    }
}

/// externalTrafficPolicy Local, which counts only for Services reachable from outside
/// (kube-proxy's `ExternallyAccessible`: NodePort and LoadBalancer types, externalIPs).
fn external_local(spec: &ServiceSpec, check: &mut Check) -> bool {
    let local = match spec.external_traffic_policy.as_deref() {
        None | Some("Cluster") => false,
        Some("Local") => true,
        Some(other) => {
            let message = format!("unknown policy {other:?} (want Cluster or Local)");
            check.bad("spec.externalTrafficPolicy", message);
            false
        }
    };
    let reachable = matches!(spec.type_.as_deref(), Some("NodePort" | "LoadBalancer"))
        || spec
            .external_ips
            .as_ref()
            .is_some_and(|ips| !ips.is_empty());
    local && reachable
}

/// `loadBalancerSourceRanges` (KP-07). The API validates them; a bad one (manifests) is
/// reported and skipped, and the others still apply.
fn source_ranges(spec: &ServiceSpec, check: &mut Check) -> Option<Vec<Cidr>> {
    let list = spec.load_balancer_source_ranges.as_ref()?;
    if list.is_empty() {
        return None;
    }
    let mut ranges = Vec::new();
    for (i, text) in list.iter().enumerate() {
        match text.parse::<Cidr>() {
            Ok(c) => ranges.push(c),
            Err(e) => {
                let closed = if i + 1 == list.len() && ranges.is_empty() {
                    "; no valid range is left, so the LoadBalancer admits no client from outside"
                } else {
                    ""
                };
                check.note(
                    format!("spec.loadBalancerSourceRanges[{i}]"),
                    format!("{e}; entry ignored{closed}"),
                );
            }
        }
    }
    Some(ranges)
}

/// The healthCheckNodePort, for a LoadBalancer with externalTrafficPolicy Local (KP-10).
fn health_check_port(spec: &ServiceSpec, external_local: bool, check: &mut Check) -> Option<u16> {
    if !external_local || spec.type_.as_deref() != Some("LoadBalancer") {
        return None;
    }
    let port = spec.health_check_node_port?;
    let valid = u16::try_from(port).ok().filter(|p| *p > 0);
    if valid.is_none() && port != 0 {
        check.note(
            "spec.healthCheckNodePort",
            format!("{port} out of range 1-65535; no health check server"),
        );
    }
    valid
}

/// ClientIP affinity timeout (KP-13); unset timeout means the API default.
fn affinity(spec: &ServiceSpec, check: &mut Check) -> Option<u32> {
    match spec.session_affinity.as_deref() {
        None | Some("None") => return None,
        Some("ClientIP") => {}
        Some(other) => {
            let message = format!("unknown sessionAffinity {other:?} (want None or ClientIP)");
            check.bad("spec.sessionAffinity", message);
            return None;
        }
    }
    let config = spec
        .session_affinity_config
        .as_ref()
        .and_then(|c| c.client_ip.as_ref());
    let Some(seconds) = config.and_then(|c| c.timeout_seconds) else {
        return Some(DEFAULT_AFFINITY_TIMEOUT_S);
    };
    let valid = u32::try_from(seconds)
        .ok()
        .filter(|s| (1..=MAX_AFFINITY_TIMEOUT_S).contains(s));
    if valid.is_none() {
        let field = "spec.sessionAffinityConfig.clientIP.timeoutSeconds";
        check.bad(
            field,
            format!("{seconds} out of range 1-{MAX_AFFINITY_TIMEOUT_S}"),
        );
    }
    valid
}

/// Who owns each (addr, port, protocol): one frontend per DesiredState.
#[derive(Default)]
struct Claims {
    owners: BTreeMap<(IpAddr, u16, Protocol), (ServicePortId, FrontendKind)>,
}

/// A frontend before its claim is checked.
struct Candidate<'a> {
    addr: IpAddr,
    port: u16,
    kind: FrontendKind,
    field: &'a str,
    set: &'a EndpointSet,
}

/// Turns parsed Services into ServicePortStates, resolving frontend conflicts.
struct Emitter<'a> {
    index: &'a SliceIndex,
    /// For topology hints: this node's name and zone.
    node: &'a NodeInfo,
    node_addrs: &'a [IpAddr],
    claims: &'a mut Claims,
}

impl Emitter<'_> {
    fn service(&mut self, svc: &ParsedService, out: &mut DesiredState) {
        for cluster_ip in &svc.cluster_ips {
            for port in &svc.ports {
                self.service_port(svc, cluster_ip, port, out);
            }
        }
        if let (Some(port), Some(primary)) = (svc.health_check_port, svc.cluster_ips.first()) {
            let local_endpoints = self.local_ready(svc, IpFamily::of(&primary.addr));
            let key = (svc.namespace.clone(), svc.name.clone());
            let check = HealthCheck {
                port,
                local_endpoints,
            };
            out.health_checks.insert(key, check);
        }
        // kube-proxy skips a family the Service has no ClusterIP for (KP-01, KP-16).
        for family in self.index.families(&svc.namespace, &svc.name) {
            if !svc
                .cluster_ips
                .iter()
                .any(|ip| IpFamily::of(&ip.addr) == family)
            {
                let detail = format!("{family} EndpointSlices but no {family} ClusterIP");
                let skip = Skip {
                    object: svc.object.clone(),
                    reason: "no-clusterip-for-family",
                    detail,
                };
                out.skips.push(skip);
            }
        }
    }

    fn service_port(
        &mut self,
        svc: &ParsedService,
        cluster_ip: &SourcedIp,
        port: &ParsedPort,
        out: &mut DesiredState,
    ) {
        let family = IpFamily::of(&cluster_ip.addr);
        let id = ServicePortId::new(
            svc.namespace.as_str(),
            svc.name.as_str(),
            port.name.as_str(),
            port.protocol,
            family,
        );
        let empty = PortEndpoints::new();
        let key = (svc.namespace.as_str(), svc.name.as_str());
        let endpoints = self
            .index
            .endpoints(key, family, &port.name, port.protocol)
            .unwrap_or(&empty);
        let cluster = backend_set(endpoints, self.node, false);
        let internal = backend_set(endpoints, self.node, svc.internal_local);
        let external = backend_set(endpoints, self.node, svc.external_local);
        let node_port_field = format!("spec.ports[{}].nodePort", port.index);
        let mut frontends = Vec::new();
        for candidate in candidates(
            svc,
            cluster_ip,
            port,
            self.node_addrs,
            &node_port_field,
            &cluster,
            &internal,
        ) {
            let reachable_from_outside = candidate.kind != FrontendKind::ClusterIp;
            if let Some(frontend) = self.claim(&id, port.protocol, candidate, &svc.object, out) {
                // Traffic from outside the node (tc path) follows externalTrafficPolicy.
                if reachable_from_outside {
                    frontends.push(FrontendState {
                        scope: Scope::ExternalOrigin,
                        set: external.clone(),
                        ..frontend.clone()
                    });
                }
                frontends.push(frontend);
            }
        }
        frontends.sort_by_key(|f| (f.scope, f.addr, f.port, f.kind));
        let has_lb = frontends
            .iter()
            .any(|f| f.kind == FrontendKind::LoadBalancer);
        let source_ranges = if has_lb {
            self.source_ranges(svc, family)
        } else {
            None
        };
        if !frontends.is_empty() {
            let state = ServicePortState {
                id: id.clone(),
                affinity_timeout_s: svc.affinity_timeout_s,
                frontends,
                source_ranges,
            };
            out.services.insert(id, state);
        }
    }

    /// The ranges of `family`, or `None` (no restriction) when the Service lists ranges
    /// of the other family only, as kube-proxy's per-family proxier does. When a range
    /// holds the node's primary address, the LB IPs are allowed as sources too: a
    /// VIP-like LB routes the node's own requests back with the VIP as source (KP-07).
    fn source_ranges(&self, svc: &ParsedService, family: IpFamily) -> Option<Vec<Cidr>> {
        let all = svc.source_ranges.as_ref()?;
        if all.is_empty() {
            return Some(Vec::new());
        }
        let mut ranges: Vec<Cidr> = all
            .iter()
            .filter(|c| c.family() == family)
            .copied()
            .collect();
        if ranges.is_empty() {
            return None;
        }
        let primary = self.node.primary();
        if ranges.iter().any(|c| primary.iter().any(|p| c.contains(p))) {
            let vips = svc
                .lb_ips
                .iter()
                .filter(|ip| IpFamily::of(&ip.addr) == family);
            ranges.extend(vips.map(|ip| Cidr::host(ip.addr)));
        }
        ranges.sort();
        ranges.dedup();
        Some(ranges)
    }

    /// Distinct ready endpoints on this node over the Service's ports, in `family`.
    fn local_ready(&self, svc: &ParsedService, family: IpFamily) -> usize {
        let key = (svc.namespace.as_str(), svc.name.as_str());
        let mut addrs = BTreeSet::new();
        for port in &svc.ports {
            let endpoints = self.index.endpoints(key, family, &port.name, port.protocol);
            for (&(addr, _), c) in endpoints.into_iter().flatten() {
                if c.local && c.ready {
                    addrs.insert(addr);
                }
            }
        }
        addrs.len()
    }

    /// Keeps the frontend if its (addr, port, protocol) is free, else reports it.
    fn claim(
        &mut self,
        id: &ServicePortId,
        protocol: Protocol,
        c: Candidate<'_>,
        object: &str,
        out: &mut DesiredState,
    ) -> Option<FrontendState> {
        let key = (c.addr, c.port, protocol);
        if let Some((owner, kind)) = self.claims.owners.get(&key) {
            let addr = SocketAddr::new(c.addr, c.port);
            let message = format!(
                "{addr}/{protocol} is already the {kind} of {owner}; {} ignored",
                c.kind
            );
            out.problems.push(problem(object, c.field, message));
            return None;
        }
        self.claims.owners.insert(key, (id.clone(), c.kind));
        let set = c.set.clone();
        Some(FrontendState {
            addr: c.addr,
            port: c.port,
            kind: c.kind,
            scope: Scope::LocalOrigin,
            set,
        })
    }
}

/// Every local-origin frontend one ServicePort of one family asks for, in claim order:
/// ClusterIP, externalIPs, LB IPs, NodePorts. Only the ClusterIP honours
/// internalTrafficPolicy; local-origin traffic to external destinations short-circuits to
/// the cluster set (KP-09).
fn candidates<'a>(
    svc: &'a ParsedService,
    cluster_ip: &'a SourcedIp,
    port: &ParsedPort,
    node_addrs: &[IpAddr],
    node_port_field: &'a str,
    cluster: &'a EndpointSet,
    internal: &'a EndpointSet,
) -> Vec<Candidate<'a>> {
    let family = IpFamily::of(&cluster_ip.addr);
    let same_family = |ip: &&SourcedIp| IpFamily::of(&ip.addr) == family;
    let external = |kind| {
        move |ip: &'a SourcedIp| Candidate {
            addr: ip.addr,
            port: port.port,
            kind,
            field: &ip.field,
            set: cluster,
        }
    };
    let mut all = vec![Candidate {
        addr: cluster_ip.addr,
        port: port.port,
        kind: FrontendKind::ClusterIp,
        field: &cluster_ip.field,
        set: internal,
    }];
    all.extend(
        svc.external_ips
            .iter()
            .filter(same_family)
            .map(external(FrontendKind::ExternalIp)),
    );
    all.extend(
        svc.lb_ips
            .iter()
            .filter(same_family)
            .map(external(FrontendKind::LoadBalancer)),
    );
    if let Some(node_port) = port.node_port {
        let node_ips = node_addrs.iter().filter(|a| IpFamily::of(a) == family);
        all.extend(node_ips.map(|&addr| Candidate {
            addr,
            port: node_port,
            kind: FrontendKind::NodePort,
            field: node_port_field,
            set: cluster,
        }));
    }
    all
}

/// The cluster set, topology-filtered (reject when empty), or with a Local policy the
/// local set, which ignores topology and drops when empty only if endpoints exist
/// elsewhere (KP-05, KP-11, KP-12).
fn backend_set(endpoints: &PortEndpoints, node: &NodeInfo, local_policy: bool) -> EndpointSet {
    let cluster = cluster_set(endpoints, node);
    if !local_policy {
        return EndpointSet {
            endpoints: cluster.endpoints,
            empty_action: EmptyAction::Reject,
            terminating_fallback: cluster.terminating_fallback,
            local_policy: false,
            topology: cluster.topology,
        };
    }
    let local = local_set(endpoints);
    // kube-proxy's hasAnyEndpoints: the topology filter never empties the cluster set.
    let has_any = !cluster.endpoints.is_empty();
    EndpointSet {
        endpoints: local.endpoints,
        empty_action: if has_any {
            EmptyAction::Drop
        } else {
            EmptyAction::Reject
        },
        terminating_fallback: local.terminating_fallback,
        local_policy: true,
        topology: false,
    }
}

/// Helpers shared by the model's tests: YAML in, rendered text compared.
#[cfg(test)]
pub(crate) mod testutil {
    use std::net::IpAddr;

    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
    use serde::Deserialize;

    use super::super::{NodeInfo, render};

    /// `node-a` with one address per family, plus loopbacks that must be ignored; no zone.
    pub(in crate::model) fn node() -> NodeInfo {
        let addresses = ["192.168.1.10", "127.0.0.1", "fd00:1::10", "::1"];
        NodeInfo {
            name: "node-a".to_owned(),
            addresses: addresses
                .iter()
                .map(|a| a.parse::<IpAddr>().unwrap())
                .collect(),
            zone: None,
            ..Default::default()
        }
    }

    /// [`node`] labelled `topology.kubernetes.io/zone: zone-a`.
    pub(in crate::model) fn zoned_node() -> NodeInfo {
        NodeInfo {
            zone: Some("zone-a".to_owned()),
            ..node()
        }
    }

    /// Strips the common indentation of an indented raw string, and blank edges.
    pub(crate) fn dedent(text: &str) -> String {
        let lines: Vec<&str> = text.lines().skip_while(|l| l.trim().is_empty()).collect();
        let indent = lines
            .iter()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.len() - l.trim_start().len())
            .min()
            .unwrap_or(0);
        let mut out: Vec<&str> = lines
            .iter()
            .map(|l| l.get(indent..).unwrap_or("").trim_end())
            .collect();
        while out.last().is_some_and(|l| l.is_empty()) {
            out.pop();
        }
        out.iter().map(|l| format!("{l}\n")).collect()
    }

    /// Parses a multi-document YAML stream of Services and EndpointSlices.
    pub(crate) fn objects(yaml: &str) -> (Vec<Service>, Vec<EndpointSlice>) {
        let (mut services, mut slices) = (vec![], vec![]);
        for doc in serde_yaml::Deserializer::from_str(&dedent(yaml)) {
            let value = serde_yaml::Value::deserialize(doc).expect("valid YAML");
            match value.get("kind").and_then(|k| k.as_str()) {
                Some("Service") => services.push(serde_yaml::from_value(value).expect("a Service")),
                Some("EndpointSlice") => {
                    slices.push(serde_yaml::from_value(value).expect("a slice"))
                }
                None => {} // an empty document
                other => panic!("unexpected kind {other:?}"),
            }
        }
        (services, slices)
    }

    /// Runs the model on `yaml` and compares the rendering with `expected`, as text.
    pub(in crate::model) fn assert_model(yaml: &str, node: &NodeInfo, expected: &str) {
        let (services, slices) = objects(yaml);
        let actual = render(&super::compute(&services, &slices, node));
        let expected = dedent(expected);
        assert!(
            actual == expected,
            "model output differs\n--- expected\n{expected}--- actual\n{actual}"
        );
        assert_compact_same(&services, &slices, node, &actual);
    }

    /// The agent stores objects compact and rebuilds them for the model: the model must
    /// decide the same from them (checked when every object has a name, so is stored).
    fn assert_compact_same(
        services: &[Service],
        slices: &[EndpointSlice],
        node: &NodeInfo,
        full: &str,
    ) {
        use crate::source::{ServiceLite, SliceLite};
        let services: Option<Vec<Service>> = services
            .iter()
            .map(|s| ServiceLite::from_k8s(s).map(|l| l.to_k8s()))
            .collect();
        let slices: Option<Vec<EndpointSlice>> = slices
            .iter()
            .map(|s| SliceLite::from_k8s(s).map(|l| l.to_k8s()))
            .collect();
        if let (Some(services), Some(slices)) = (services, slices) {
            let compact = render(&super::compute(&services, &slices, node));
            assert!(
                compact == full,
                "compact objects change the model\n--- from the API objects\n{full}--- from the compact ones\n{compact}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::{assert_model, dedent, node, zoned_node};
    use crate::model::NodeInfo;

    const WEB_SLICE: &str = r#"
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-a, namespace: default, labels: {kubernetes.io/service-name: web}}
            addressType: IPv4
            ports: [{name: http, port: 8080}]
            endpoints:
            - addresses: [10.0.0.1]
              nodeName: node-a
            - addresses: [10.0.0.2]
              nodeName: node-b
    "#;

    fn with_web_slice(services: &str) -> String {
        format!(
            "{}\n---\n{}",
            super::testutil::dedent(services),
            super::testutil::dedent(WEB_SLICE)
        )
    }

    #[test]
    fn cluster_ip_with_affinity_default() {
        let yaml = with_web_slice(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec:
              clusterIP: 10.96.0.10
              ports: [{name: http, port: 80, targetPort: 8080}]
              sessionAffinity: ClientIP
            "#,
        );
        assert_model(
            &yaml,
            &node(),
            "
            default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080 [affinity=10800s]
            ",
        );
    }

    #[test]
    fn affinity_explicit_timeout_and_none() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: a, namespace: default}
            spec:
              clusterIP: 10.96.0.1
              ports: [{port: 80}]
              sessionAffinity: ClientIP
              sessionAffinityConfig: {clientIP: {timeoutSeconds: 125}}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: b, namespace: default}
            spec:
              clusterIP: 10.96.0.2
              ports: [{port: 80}]
              sessionAffinity: None
              sessionAffinityConfig: {clientIP: {timeoutSeconds: 125}}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: c, namespace: default}
            spec:
              clusterIP: 10.96.0.3
              ports: [{port: 80}]
              sessionAffinity: ClientIP
              sessionAffinityConfig: {clientIP: {}}
            "#,
            &node(),
            "
            default/a:/TCP/IPv4 clusterIP 10.96.0.1:80 local-origin -> reject [affinity=125s]
            default/b:/TCP/IPv4 clusterIP 10.96.0.2:80 local-origin -> reject
            default/c:/TCP/IPv4 clusterIP 10.96.0.3:80 local-origin -> reject [affinity=10800s]
            ",
        );
    }

    /// ExternalName, headless (None, empty, missing) and both labels are skipped.
    #[test]
    fn service_skip_rules() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: ext, namespace: default}
            spec: {type: ExternalName, externalName: example.com, ports: [{port: 80}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: hl-none, namespace: default}
            spec: {clusterIP: None, ports: [{port: 80}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: hl-empty, namespace: default}
            spec: {clusterIP: "", ports: [{port: 80}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: hl-missing, namespace: default}
            spec: {ports: [{port: 80}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: hl-list, namespace: default}
            spec: {clusterIPs: [None], ports: [{port: 80}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: proxied-elsewhere, namespace: default, labels: {service.kubernetes.io/service-proxy-name: other}}
            spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: hl-label, namespace: default, labels: {service.kubernetes.io/headless: ""}}
            spec: {clusterIP: 10.96.0.2, ports: [{port: 80}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec: {clusterIP: 10.96.0.3, ports: [{port: 80}]}
            "#,
            &node(),
            r#"
            default/web:/TCP/IPv4 clusterIP 10.96.0.3:80 local-origin -> reject
            skip: Service default/ext external-name type ExternalName
            skip: Service default/hl-empty headless no clusterIP
            skip: Service default/hl-label headless-label label service.kubernetes.io/headless=""
            skip: Service default/hl-list headless clusterIP None
            skip: Service default/hl-missing headless no clusterIP
            skip: Service default/hl-none headless clusterIP None
            skip: Service default/proxied-elsewhere service-proxy-name label service.kubernetes.io/service-proxy-name="other"
            "#,
        );
    }

    /// Ports join by name; unnamed Service ports join `name: ""`; each port is its own
    /// ServicePort with its own endpoints.
    #[test]
    fn named_and_multiple_ports() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: multi, namespace: default}
            spec:
              clusterIP: 10.96.0.20
              ports: [{name: svc1, port: 80}, {name: svc2, port: 81}, {name: svc3, port: 82}]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: multi-a, namespace: default, labels: {kubernetes.io/service-name: multi}}
            addressType: IPv4
            ports: [{name: svc1, port: 100}, {name: svc2, port: 101}]
            endpoints: [{addresses: [10.0.0.1]}]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: multi-b, namespace: default, labels: {kubernetes.io/service-name: multi}}
            addressType: IPv4
            ports: [{name: svc1, port: 100}, {name: "", port: 102}]
            endpoints: [{addresses: [10.0.0.2]}]
            "#,
            &node(),
            "
            default/multi:svc1/TCP/IPv4 clusterIP 10.96.0.20:80 local-origin -> 10.0.0.1:100 10.0.0.2:100
            default/multi:svc2/TCP/IPv4 clusterIP 10.96.0.20:81 local-origin -> 10.0.0.1:101
            default/multi:svc3/TCP/IPv4 clusterIP 10.96.0.20:82 local-origin -> reject
            ",
        );
    }

    /// TCP and UDP on one port number are two ServicePorts, joined by protocol too.
    #[test]
    fn tcp_and_udp_on_same_port() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: dns, namespace: kube-system}
            spec:
              clusterIP: 10.96.0.10
              ports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: dns-a, namespace: kube-system, labels: {kubernetes.io/service-name: dns}}
            addressType: IPv4
            ports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53}, {name: dns, port: 5353}]
            endpoints: [{addresses: [10.0.0.5]}]
            "#,
            &node(),
            "
            kube-system/dns:dns/UDP/IPv4 clusterIP 10.96.0.10:53 local-origin -> 10.0.0.5:53
            kube-system/dns:dns-tcp/TCP/IPv4 clusterIP 10.96.0.10:53 local-origin -> 10.0.0.5:53
            ",
        );
    }

    /// SCTP ports are skipped, never an error; the Service's other ports still work.
    #[test]
    fn sctp_port_is_skipped() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: mixed, namespace: default}
            spec:
              clusterIP: 10.96.0.30
              ports: [{name: sig, port: 9000, protocol: SCTP}, {name: web, port: 80}]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: mixed-a, namespace: default, labels: {kubernetes.io/service-name: mixed}}
            addressType: IPv4
            ports: [{name: sig, port: 9000, protocol: SCTP}, {name: web, port: 8080}]
            endpoints: [{addresses: [10.0.0.1]}]
            "#,
            &node(),
            r#"
            default/mixed:web/TCP/IPv4 clusterIP 10.96.0.30:80 local-origin -> 10.0.0.1:8080
            skip: Service default/mixed sctp spec.ports[0] "sig" 9000/SCTP
            "#,
        );
    }

    /// Each family uses its own ClusterIP, slices, externalIPs, LB IPs and node addresses.
    #[test]
    fn dual_stack() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: ds, namespace: default}
            spec:
              type: LoadBalancer
              clusterIP: 10.96.0.40
              clusterIPs: [10.96.0.40, "fd00:96::40"]
              externalIPs: ["2001:db8::cb00:71fa", 203.0.113.250]
              ports: [{name: http, port: 80, nodePort: 30080}]
            status:
              loadBalancer:
                ingress: [{ip: "2001:db8::1"}, {ip: 198.51.100.1}]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: ds-v4, namespace: default, labels: {kubernetes.io/service-name: ds}}
            addressType: IPv4
            ports: [{name: http, port: 8080}]
            endpoints: [{addresses: [10.0.0.1]}]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: ds-v6, namespace: default, labels: {kubernetes.io/service-name: ds}}
            addressType: IPv6
            ports: [{name: http, port: 8080}]
            endpoints: [{addresses: ["fd00:10::1"]}]
            "#,
            &node(),
            "
            default/ds:http/TCP/IPv4 clusterIP 10.96.0.40:80 local-origin -> 10.0.0.1:8080
            default/ds:http/TCP/IPv4 nodePort 192.168.1.10:30080 local-origin -> 10.0.0.1:8080
            default/ds:http/TCP/IPv4 loadBalancer 198.51.100.1:80 local-origin -> 10.0.0.1:8080
            default/ds:http/TCP/IPv4 externalIP 203.0.113.250:80 local-origin -> 10.0.0.1:8080
            default/ds:http/TCP/IPv4 nodePort 192.168.1.10:30080 external-origin -> 10.0.0.1:8080
            default/ds:http/TCP/IPv4 loadBalancer 198.51.100.1:80 external-origin -> 10.0.0.1:8080
            default/ds:http/TCP/IPv4 externalIP 203.0.113.250:80 external-origin -> 10.0.0.1:8080
            default/ds:http/TCP/IPv6 loadBalancer [2001:db8::1]:80 local-origin -> [fd00:10::1]:8080
            default/ds:http/TCP/IPv6 externalIP [2001:db8::cb00:71fa]:80 local-origin -> [fd00:10::1]:8080
            default/ds:http/TCP/IPv6 nodePort [fd00:1::10]:30080 local-origin -> [fd00:10::1]:8080
            default/ds:http/TCP/IPv6 clusterIP [fd00:96::40]:80 local-origin -> [fd00:10::1]:8080
            default/ds:http/TCP/IPv6 loadBalancer [2001:db8::1]:80 external-origin -> [fd00:10::1]:8080
            default/ds:http/TCP/IPv6 externalIP [2001:db8::cb00:71fa]:80 external-origin -> [fd00:10::1]:8080
            default/ds:http/TCP/IPv6 nodePort [fd00:1::10]:30080 external-origin -> [fd00:10::1]:8080
            ",
        );
    }

    /// A single-stack Service ignores slices of the other family, with a skip.
    #[test]
    fn slices_of_family_without_cluster_ip_are_skipped() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: v4, namespace: default}
            spec: {clusterIP: 10.96.0.41, ports: [{port: 80}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: v4-v6, namespace: default, labels: {kubernetes.io/service-name: v4}}
            addressType: IPv6
            ports: [{name: "", port: 8080}]
            endpoints: [{addresses: ["fd00:10::1"]}]
            "#,
            &node(),
            "
            default/v4:/TCP/IPv4 clusterIP 10.96.0.41:80 local-origin -> reject
            skip: Service default/v4 no-clusterip-for-family IPv6 EndpointSlices but no IPv6 ClusterIP
            ",
        );
    }

    /// LB ingress: ip with ipMode unset or VIP is used; Proxy and hostname-only are not.
    #[test]
    fn load_balancer_ingress_ip_modes() {
        let yaml = with_web_slice(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec:
              type: LoadBalancer
              clusterIP: 10.96.0.10
              ports: [{name: http, port: 80}]
            status:
              loadBalancer:
                ingress:
                - {ip: 198.51.100.1}
                - {ip: 198.51.100.2, ipMode: VIP}
                - {ip: 198.51.100.3, ipMode: Proxy}
                - {hostname: lb.example.com}
                - {ip: 198.51.100.5, ipMode: Tunnel}
                - {ip: 198.51.100.300}
            "#,
        );
        assert_model(
            &yaml,
            &node(),
            r#"
            default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
            default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
            default/web:http/TCP/IPv4 loadBalancer 198.51.100.2:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
            default/web:http/TCP/IPv4 loadBalancer 198.51.100.1:80 external-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
            default/web:http/TCP/IPv4 loadBalancer 198.51.100.2:80 external-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
            problem: Service default/web: status.loadBalancer.ingress[4].ipMode: unknown ipMode "Tunnel"; entry ignored
            problem: Service default/web: status.loadBalancer.ingress[5].ip: not an IP address: "198.51.100.300"; entry ignored
            "#,
        );
    }

    /// externalIPs get frontends of their family; no endpoints means reject there too.
    #[test]
    fn external_ips() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: ext, namespace: default}
            spec:
              clusterIP: 10.96.0.50
              externalIPs: [203.0.113.250, "2001:db8::cb00:71fa"]
              ports: [{port: 80}]
            "#,
            &node(),
            "
            default/ext:/TCP/IPv4 clusterIP 10.96.0.50:80 local-origin -> reject
            default/ext:/TCP/IPv4 externalIP 203.0.113.250:80 local-origin -> reject
            default/ext:/TCP/IPv4 externalIP 203.0.113.250:80 external-origin -> reject
            ",
        );
    }

    /// A NodePort is served on every non-loopback node address of the family.
    #[test]
    fn node_port_per_node_address() {
        let node = NodeInfo {
            name: "node-a".to_owned(),
            addresses: [
                "10.1.0.2",
                "127.0.0.1",
                "192.168.1.10",
                "10.1.0.2",
                "fd00:1::10",
            ]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect(),
            zone: None,
            ..Default::default()
        };
        let yaml = with_web_slice(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec:
              type: NodePort
              clusterIP: 10.96.0.10
              ports: [{name: http, port: 80, nodePort: 30080}, {name: other, port: 81, nodePort: 0}]
            "#,
        );
        assert_model(
            &yaml,
            &node,
            "
            default/web:http/TCP/IPv4 nodePort 10.1.0.2:30080 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
            default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
            default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
            default/web:http/TCP/IPv4 nodePort 10.1.0.2:30080 external-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
            default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 external-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
            default/web:other/TCP/IPv4 clusterIP 10.96.0.10:81 local-origin -> reject
            ",
        );
    }

    /// iTP Local: the ClusterIP gets local endpoints only; external frontends from
    /// local sockets still get the cluster set.
    #[test]
    fn internal_traffic_policy_local() {
        let yaml = with_web_slice(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec:
              type: NodePort
              clusterIP: 10.96.0.10
              externalIPs: [203.0.113.1]
              internalTrafficPolicy: Local
              ports: [{name: http, port: 80, nodePort: 30080}]
            "#,
        );
        assert_model(
            &yaml,
            &node(),
            "
            default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080(local) [local-policy]
            default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
            default/web:http/TCP/IPv4 externalIP 203.0.113.1:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
            default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 external-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
            default/web:http/TCP/IPv4 externalIP 203.0.113.1:80 external-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080
            ",
        );
    }

    /// iTP Local with no local endpoint: drop if endpoints exist elsewhere, else reject;
    /// a local terminating endpoint is the fallback, independently of the cluster set.
    #[test]
    fn internal_traffic_policy_local_fallbacks() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: elsewhere, namespace: default}
            spec: {clusterIP: 10.96.0.1, internalTrafficPolicy: Local, ports: [{port: 80}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: nowhere, namespace: default}
            spec: {clusterIP: 10.96.0.2, internalTrafficPolicy: Local, ports: [{port: 80}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: terminating, namespace: default}
            spec:
              clusterIP: 10.96.0.3
              externalIPs: [203.0.113.3]
              internalTrafficPolicy: Local
              ports: [{port: 80}]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: elsewhere-a, namespace: default, labels: {kubernetes.io/service-name: elsewhere}}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints: [{addresses: [10.0.0.2], nodeName: node-b}]
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: nowhere-a, namespace: default, labels: {kubernetes.io/service-name: nowhere}}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints:
            - addresses: [10.0.0.4]
              nodeName: node-a
              conditions: {ready: false, serving: false, terminating: true}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: terminating-a, namespace: default, labels: {kubernetes.io/service-name: terminating}}
            addressType: IPv4
            ports: [{name: "", port: 8080}]
            endpoints:
            - addresses: [10.0.0.3]
              nodeName: node-a
              conditions: {ready: false, serving: true, terminating: true}
            - addresses: [10.0.0.5]
              nodeName: node-b
            "#,
            &node(),
            "
            default/elsewhere:/TCP/IPv4 clusterIP 10.96.0.1:80 local-origin -> drop [local-policy]
            default/nowhere:/TCP/IPv4 clusterIP 10.96.0.2:80 local-origin -> reject [local-policy]
            default/terminating:/TCP/IPv4 clusterIP 10.96.0.3:80 local-origin -> 10.0.0.3:8080(local,terminating) [local-policy] [terminating-fallback]
            default/terminating:/TCP/IPv4 externalIP 203.0.113.3:80 local-origin -> 10.0.0.5:8080
            default/terminating:/TCP/IPv4 externalIP 203.0.113.3:80 external-origin -> 10.0.0.5:8080
            ",
        );
    }

    /// Malformed Services are reported and skipped; the others in the call still work.
    #[test]
    fn malformed_services_are_problems() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: bad-cip, namespace: default}
            spec: {clusterIPs: [10.96.0.1, "10.96.0.300"], ports: [{port: 80}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: bad-eip, namespace: default}
            spec: {clusterIP: 10.96.0.2, externalIPs: [nope], ports: [{port: 80}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: bad-port, namespace: default}
            spec: {clusterIP: 10.96.0.3, ports: [{port: 80}, {name: b, port: 70000}, {name: c, port: 0}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: bad-np, namespace: default}
            spec: {clusterIP: 10.96.0.4, ports: [{port: 80, nodePort: -1}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: no-spec, namespace: default}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: bad-misc, namespace: default}
            spec:
              clusterIPs: [10.96.0.5, 10.96.0.6]
              type: Weird
              internalTrafficPolicy: Nearby
              sessionAffinity: ClientIP
              sessionAffinityConfig: {clientIP: {timeoutSeconds: 0}}
              ports: [{name: a, port: 80, protocol: ICMP}, {name: b, port: 81}, {name: b, port: 82}]
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: no-ports, namespace: default}
            spec: {clusterIP: 10.96.0.7}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: ok, namespace: default}
            spec: {clusterIP: 10.96.0.8, ports: [{port: 80}]}
            "#,
            &node(),
            r#"
            default/ok:/TCP/IPv4 clusterIP 10.96.0.8:80 local-origin -> reject
            problem: Service default/bad-cip: spec.clusterIPs[1]: not an IP address: "10.96.0.300"
            problem: Service default/bad-eip: spec.externalIPs[0]: not an IP address: "nope"
            problem: Service default/bad-misc: spec.clusterIPs[1]: second IPv4 ClusterIP 10.96.0.6
            problem: Service default/bad-misc: spec.internalTrafficPolicy: unknown policy "Nearby" (want Cluster or Local)
            problem: Service default/bad-misc: spec.ports[0].protocol: unknown protocol "ICMP" (want TCP, UDP or SCTP)
            problem: Service default/bad-misc: spec.ports[2].name: duplicate port name "b" for TCP
            problem: Service default/bad-misc: spec.sessionAffinityConfig.clientIP.timeoutSeconds: 0 out of range 1-86400
            problem: Service default/bad-misc: spec.type: unknown type "Weird"
            problem: Service default/bad-np: spec.ports[0].nodePort: nodePort -1 out of range 0-65535
            problem: Service default/bad-port: spec.ports[1].port: port 70000 out of range 1-65535
            problem: Service default/bad-port: spec.ports[2].port: port 0 out of range 1-65535
            problem: Service default/no-ports: spec.ports: no ports
            problem: Service default/no-spec: spec: missing; Service ignored
            "#,
        );
    }

    /// Two Services claiming one externalIP:port: the first by (namespace, name) keeps it.
    #[test]
    fn duplicate_frontend_first_service_wins() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: zeta, namespace: default}
            spec: {clusterIP: 10.96.0.2, externalIPs: [203.0.113.9], ports: [{port: 80}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: alpha, namespace: default}
            spec: {clusterIP: 10.96.0.1, externalIPs: [203.0.113.9], ports: [{port: 80}, {name: udp, port: 80, protocol: UDP}]}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: alpha, namespace: default}
            spec: {clusterIP: 10.96.0.3, ports: [{port: 80}]}
            "#,
            &node(),
            "
            default/alpha:/TCP/IPv4 clusterIP 10.96.0.1:80 local-origin -> reject
            default/alpha:/TCP/IPv4 externalIP 203.0.113.9:80 local-origin -> reject
            default/alpha:/TCP/IPv4 externalIP 203.0.113.9:80 external-origin -> reject
            default/alpha:udp/UDP/IPv4 clusterIP 10.96.0.1:80 local-origin -> reject
            default/alpha:udp/UDP/IPv4 externalIP 203.0.113.9:80 local-origin -> reject
            default/alpha:udp/UDP/IPv4 externalIP 203.0.113.9:80 external-origin -> reject
            default/zeta:/TCP/IPv4 clusterIP 10.96.0.2:80 local-origin -> reject
            problem: Service default/alpha: metadata.name: defined twice; the first is kept
            problem: Service default/zeta: spec.externalIPs[0]: 203.0.113.9:80/TCP is already the externalIP of default/alpha:/TCP/IPv4; externalIP ignored
            ",
        );
    }

    /// A Service whose every frontend is taken produces no ServicePort at all.
    #[test]
    fn duplicate_cluster_ip_and_same_service_overlap() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: a, namespace: default}
            spec:
              type: LoadBalancer
              clusterIP: 10.96.0.1
              externalIPs: [198.51.100.1]
              ports: [{port: 80}]
            status: {loadBalancer: {ingress: [{ip: 198.51.100.1}]}}
            ---
            apiVersion: v1
            kind: Service
            metadata: {name: b, namespace: default}
            spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}
            "#,
            &node(),
            "
            default/a:/TCP/IPv4 clusterIP 10.96.0.1:80 local-origin -> reject
            default/a:/TCP/IPv4 externalIP 198.51.100.1:80 local-origin -> reject
            default/a:/TCP/IPv4 externalIP 198.51.100.1:80 external-origin -> reject
            problem: Service default/a: status.loadBalancer.ingress[0].ip: 198.51.100.1:80/TCP is already the externalIP of default/a:/TCP/IPv4; loadBalancer ignored
            problem: Service default/b: spec.clusterIP: 10.96.0.1:80/TCP is already the clusterIP of default/a:/TCP/IPv4; clusterIP ignored
            ",
        );
    }

    /// Missing namespaces mean `default`, for Services and slices alike.
    #[test]
    fn missing_namespace_is_default() {
        assert_model(
            r#"
            apiVersion: v1
            kind: Service
            metadata: {name: web}
            spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80}]}
            ---
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {name: web-a, labels: {kubernetes.io/service-name: web}}
            addressType: IPv4
            ports: [{name: http, port: 8080}]
            endpoints: [{addresses: [10.0.0.1]}]
            "#,
            &node(),
            "
            default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080
            ",
        );
    }

    /// No objects, no output; and the model never panics on an empty node.
    #[test]
    fn empty_input() {
        let state = super::compute(&[], &[], &NodeInfo::default());
        assert_eq!(state, crate::model::DesiredState::default());
    }

    /// Service `web` with the extra `spec` lines, plus slice `web-a` with `hints` as the
    /// EndpointSlice controller writes them: endpoints on node-a and node-b in zone-a,
    /// node-c in zone-b.
    fn topology_web(spec: &[&str], hints: [&str; 3]) -> String {
        let mut service = dedent(
            "
            apiVersion: v1
            kind: Service
            metadata: {name: web, namespace: default}
            spec:
              clusterIP: 10.96.0.10
              ports: [{name: http, port: 80}]
            ",
        );
        for line in spec {
            service.push_str(&format!("  {line}\n"));
        }
        let slice = format!(
            "
            apiVersion: discovery.k8s.io/v1
            kind: EndpointSlice
            metadata: {{name: web-a, namespace: default, labels: {{kubernetes.io/service-name: web}}}}
            addressType: IPv4
            ports: [{{name: http, port: 8080}}]
            endpoints:
            - {{addresses: [10.0.0.1], nodeName: node-a, zone: zone-a, hints: {}}}
            - {{addresses: [10.0.0.2], nodeName: node-b, zone: zone-a, hints: {}}}
            - {{addresses: [10.0.0.3], nodeName: node-c, zone: zone-b, hints: {}}}
            ",
            hints[0], hints[1], hints[2]
        );
        format!("{service}---\n{}", dedent(&slice))
    }

    /// The zone hints the controller writes for PreferClose and PreferSameZone: each
    /// endpoint's own zone.
    const OWN_ZONE: [&str; 3] = [
        "{forZones: [{name: zone-a}]}",
        "{forZones: [{name: zone-a}]}",
        "{forZones: [{name: zone-b}]}",
    ];

    /// `node-d`, in zone-a, without an endpoint of its own.
    fn node_d() -> NodeInfo {
        NodeInfo {
            name: "node-d".to_owned(),
            ..zoned_node()
        }
    }

    /// trafficDistribution PreferClose: same-zone endpoints on a zoned node, all of them
    /// on a node without zone.
    #[test]
    fn traffic_distribution_prefer_close() {
        let yaml = topology_web(&["trafficDistribution: PreferClose"], OWN_ZONE);
        assert_model(
            &yaml,
            &zoned_node(),
            "
            default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080 [topology]
            ",
        );
        assert_model(
            &yaml,
            &node(),
            "
            default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080(local) 10.0.0.2:8080 10.0.0.3:8080
            ",
        );
    }

    /// trafficDistribution PreferSameZone: the same hints, the same result.
    #[test]
    fn traffic_distribution_prefer_same_zone() {
        let yaml = topology_web(&["trafficDistribution: PreferSameZone"], OWN_ZONE);
        assert_model(
            &yaml,
            &node_d(),
            "
            default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080 10.0.0.2:8080 [topology]
            ",
        );
    }

    /// trafficDistribution PreferSameNode: node hints plus zone hints. The node's own
    /// endpoint when it has one, else same-zone endpoints.
    #[test]
    fn traffic_distribution_prefer_same_node() {
        let yaml = topology_web(
            &["trafficDistribution: PreferSameNode"],
            [
                "{forNodes: [{name: node-a}], forZones: [{name: zone-a}]}",
                "{forNodes: [{name: node-b}], forZones: [{name: zone-a}]}",
                "{forNodes: [{name: node-c}], forZones: [{name: zone-b}]}",
            ],
        );
        assert_model(
            &yaml,
            &zoned_node(),
            "
            default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080(local) [topology]
            ",
        );
        assert_model(
            &yaml,
            &node_d(),
            "
            default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080 10.0.0.2:8080 [topology]
            ",
        );
    }

    /// The topology-mode annotation (Auto): the controller may hint an endpoint for
    /// another zone than its own; the hints, not the endpoints' zones, decide.
    #[test]
    fn topology_mode_annotation_hints_are_honoured() {
        let yaml = topology_web(
            &[],
            [
                "{forZones: [{name: zone-a}]}",
                "{forZones: [{name: zone-b}]}",
                "{forZones: [{name: zone-b}]}",
            ],
        )
        .replace(
            "metadata: {name: web, namespace: default}",
            "metadata: {name: web, namespace: default, annotations: {service.kubernetes.io/topology-mode: Auto}}",
        );
        assert_model(
            &yaml,
            &zoned_node(),
            "
            default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080(local) [topology]
            ",
        );
    }

    /// iTP Local: the ClusterIP's local set ignores hints (node-a's endpoint is hinted for
    /// zone-b), while external frontends reached from local sockets use the cluster set,
    /// topology-filtered as kube-proxy's cluster chain would be.
    #[test]
    fn internal_traffic_policy_local_ignores_topology() {
        let yaml = topology_web(
            &[
                "type: NodePort",
                "externalIPs: [203.0.113.1]",
                "internalTrafficPolicy: Local",
                "trafficDistribution: PreferClose",
            ],
            [
                "{forZones: [{name: zone-b}]}",
                "{forZones: [{name: zone-a}]}",
                "{forZones: [{name: zone-b}]}",
            ],
        )
        .replace(
            "{name: http, port: 80}",
            "{name: http, port: 80, nodePort: 30080}",
        );
        assert_model(
            &yaml,
            &zoned_node(),
            "
            default/web:http/TCP/IPv4 clusterIP 10.96.0.10:80 local-origin -> 10.0.0.1:8080(local) [local-policy]
            default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 local-origin -> 10.0.0.2:8080 [topology]
            default/web:http/TCP/IPv4 externalIP 203.0.113.1:80 local-origin -> 10.0.0.2:8080 [topology]
            default/web:http/TCP/IPv4 nodePort 192.168.1.10:30080 external-origin -> 10.0.0.2:8080 [topology]
            default/web:http/TCP/IPv4 externalIP 203.0.113.1:80 external-origin -> 10.0.0.2:8080 [topology]
            ",
        );
    }
}
