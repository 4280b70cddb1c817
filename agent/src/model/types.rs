//! The model's output: a plain description of frontends and backend sets.

use std::{collections::BTreeMap, fmt, net::IpAddr, sync::Arc};

use super::cidr::Cidr;

/// What the model knows about the node it programs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// This node's name: endpoints with `nodeName` equal to it are local.
    pub name: String,
    /// The node's addresses (never loopback), both families: NodePorts are served on
    /// those that `nodeport_addresses` admits.
    pub addresses: Vec<IpAddr>,
    /// The Node's `topology.kubernetes.io/zone` label; `None` when unlabelled, which
    /// disables zone hints (KP-12).
    pub zone: Option<String>,
    /// `--nodeport-addresses` (KP-06).
    pub nodeport_addresses: NodePortAddresses,
    /// The node's primary address per family (kube-proxy's node IPs): `--nodeport-addresses
    /// primary`, and the source-range allowance (KP-07). Empty: the first of `addresses`
    /// per family.
    pub primary_ips: Vec<IpAddr>,
}

/// kube-proxy's `--nodeport-addresses`: which node addresses serve NodePorts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Every node address (kube-proxy's default when the option is unset).
    #[default]
    All,
    /// The node's primary address of each family.
    Primary,
    /// Addresses inside these CIDRs; a family no CIDR names keeps all its addresses.
    Cidrs(Vec<Cidr>),
}

impl NodePortAddresses {
    /// Parses the flag's list: `primary` alone, or CIDRs.
    pub fn parse(items: &[String]) -> Result<NodePortAddresses, String> {
        match items {
            [] => Ok(NodePortAddresses::All),
            [one] if one.trim() == "primary" => Ok(NodePortAddresses::Primary),
            _ => {
                let mut cidrs = Vec::new();
                for item in items {
                    if item.trim() == "primary" {
                        return Err("\"primary\" cannot be combined with CIDRs".into());
                    }
                    cidrs.push(item.parse::<Cidr>()?);
                }
                Ok(NodePortAddresses::Cidrs(cidrs))
            }
        }
    }
}

impl NodeInfo {
    /// The primary address of each family: `primary_ips`, else the first address.
    pub fn primary(&self) -> Vec<IpAddr> {
        let source = if self.primary_ips.is_empty() {
            &self.addresses
        } else {
            &self.primary_ips
        };
        let mut out: Vec<IpAddr> = Vec::new();
        for ip in source {
            if !out.iter().any(|o| IpFamily::of(o) == IpFamily::of(ip)) {
                out.push(*ip);
            }
        }
        out
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    pub fn of(addr: &IpAddr) -> IpFamily {
        if addr.is_ipv4() {
            IpFamily::V4
        } else {
            IpFamily::V6
        }
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        })
    }
}

/// kube-proxy's ServicePortName, plus the family: one per family of a dual-stack Service.
/// Displays as `namespace/name:port/TCP/IPv4` (`port` is the Service port's name, may be empty).
/// Ordered by namespace and name first: the engine finds a Service's ports as one range.
/// One shared allocation ([`PortIdentity`]): an id is copied into the engine's digests,
/// the frontend owners and the planner's tables, and a copy is a pointer (the fields
/// inline were 56 bytes per copy, 16 MiB at 100,000 ServicePorts).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortId(Arc<PortIdentity>);

/// The fields of a [`ServicePortId`]. The names are shared (`Arc<str>`) with the store's
/// objects and between ids.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortIdentity {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
    pub port_name: Arc<str>,
    pub protocol: Protocol,
    pub family: IpFamily,
}

impl ServicePortId {
    pub fn new(
        namespace: impl Into<Arc<str>>,
        name: impl Into<Arc<str>>,
        port_name: impl Into<Arc<str>>,
        protocol: Protocol,
        family: IpFamily,
    ) -> ServicePortId {
        ServicePortId(Arc::new(PortIdentity {
            namespace: namespace.into(),
            name: name.into(),
            port_name: port_name.into(),
            protocol,
            family,
        }))
    }
}

impl std::ops::Deref for ServicePortId {
    type Target = PortIdentity;

    fn deref(&self) -> &PortIdentity {
        &self.0
    }
}

impl fmt::Debug for ServicePortId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for ServicePortId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}:{}/{}/{}",
            self.namespace, self.name, self.port_name, self.protocol, self.family
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FrontendKind {
    ClusterIp,
    ExternalIp,
    LoadBalancer,
    NodePort,
}

impl fmt::Display for FrontendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FrontendKind::ClusterIp => "clusterIP",
            FrontendKind::ExternalIp => "externalIP",
            FrontendKind::LoadBalancer => "loadBalancer",
            FrontendKind::NodePort => "nodePort",
        })
    }
}

/// Where the traffic starts. Socket hooks serve `LocalOrigin` (external frontends
/// short-circuit to the cluster set there, KP-09); the tc path serves `ExternalOrigin`,
/// where externalTrafficPolicy applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    LocalOrigin,
    ExternalOrigin,
}

/// One endpoint chosen for a backend set.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Endpoint {
    pub addr: IpAddr,
    pub port: u16,
    /// Serving but terminating (used only as the fallback set).
    pub terminating: bool,
    /// `nodeName` equals this node.
    pub local: bool,
}

/// What to do when a backend set is empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EmptyAction {
    /// No usable endpoint anywhere: refuse (ICMP unreachable / ECONNREFUSED).
    Reject,
    /// A Local traffic policy found no local endpoint: drop.
    Drop,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EndpointSet {
    /// Sorted by (addr, port); empty means `empty_action` applies.
    pub endpoints: Vec<Endpoint>,
    pub empty_action: EmptyAction,
    /// The endpoints are the serving+terminating fallback (no ready endpoint existed).
    pub terminating_fallback: bool,
    /// Shaped by a Local traffic policy (internal or external).
    pub local_policy: bool,
    /// Topology hints were honoured: only the ready endpoints hinted for this node
    /// (PreferSameNode) or this node's zone (PreferSameZone) are kept (KP-12). Never set
    /// on the local set or the terminating fallback, which ignore topology.
    pub topology: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FrontendState {
    pub addr: IpAddr,
    pub port: u16,
    pub kind: FrontendKind,
    pub scope: Scope,
    pub set: EndpointSet,
}

/// Everything one ServicePort (of one family) needs programmed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServicePortState {
    pub id: ServicePortId,
    /// ClientIP affinity timeout in seconds, when `sessionAffinity: ClientIP`.
    pub affinity_timeout_s: Option<u32>,
    /// Sorted by (scope, addr, port, kind).
    pub frontends: Vec<FrontendState>,
    /// `loadBalancerSourceRanges` of this family, plus the LB IPs themselves when a range
    /// holds the node's primary address (KP-07). They restrict the external-origin
    /// LoadBalancer frontends only. `None`: no restriction.
    pub source_ranges: Option<Vec<Cidr>>,
}

/// A Service that needs a healthCheckNodePort server (type LoadBalancer with
/// externalTrafficPolicy Local, KP-10).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    pub port: u16,
    /// Ready endpoints on this node (kube-proxy's `localEndpoints`: terminating ones do
    /// not count), distinct addresses of the Service's primary family.
    pub local_endpoints: usize,
}

/// A bad object or field: reported (logged, counted) and skipped; never fatal.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    /// `Service default/web` or `EndpointSlice default/web-abc12`.
    pub object: String,
    /// Field path, e.g. `spec.clusterIPs[1]` or `endpoints[2].addresses[0]`.
    pub field: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.object, self.field, self.message)
    }
}

/// An object (or one of its ports) deliberately not proxied, with the reason. Not an
/// error; logged once and counted per reason.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Skip {
    pub object: String,
    /// Stable, metric-friendly reason: `headless`, `external-name`, `service-proxy-name`,
    /// `headless-label`, `sctp`, `fqdn-slice`, `no-clusterip-for-family`.
    pub reason: &'static str,
    pub detail: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    pub services: BTreeMap<ServicePortId, ServicePortState>,
    /// (namespace, name) -> its healthCheckNodePort.
    pub health_checks: BTreeMap<(String, String), HealthCheck>,
    pub problems: Vec<Problem>,
    pub skips: Vec<Skip>,
}
