//! Services and EndpointSlices as ferry keeps them: only what kube-proxy reads, in a
//! fraction of the memory of the API objects. A k8s-openapi `Endpoint` is 352 bytes
//! before any of its strings; 10,000 slices of 10 endpoints held as API objects cost
//! ~80 MiB, as [`SliceLite`] ~10 MiB. A `Service` is 824 bytes before its strings, a
//! [`ServiceLite`] 112. Sources convert on arrival; the model gets API objects
//! back ([`SliceLite::to_k8s`], [`ServiceLite::to_k8s`]) only for the Services it
//! recomputes.

use std::{borrow::Cow, collections::BTreeMap, fmt, net::IpAddr};

use k8s_openapi::{
    api::core::v1::{
        ClientIPConfig, LoadBalancerIngress, LoadBalancerStatus, Service, ServicePort, ServiceSpec,
        ServiceStatus, SessionAffinityConfig,
    },
    api::discovery::v1::{
        Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice, ForNode, ForZone,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use super::ObjectKey;

/// The labels and annotations the model reads; every other one is dropped.
pub(super) const KEPT_LABELS: [&str; 3] = [
    "kubernetes.io/service-name",
    "service.kubernetes.io/service-proxy-name",
    "service.kubernetes.io/headless",
];
pub const TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

type Text = Box<str>;

/// A kept label: its key is one of [`KEPT_LABELS`], so it is never allocated; its value
/// shared (a slice's `kubernetes.io/service-name` is its Service's name, which the
/// store gives it).
pub type Label = (&'static str, Name);

/// The static key of a kept label, `None` for a label the model never reads.
pub(super) fn kept_key(key: &str) -> Option<&'static str> {
    KEPT_LABELS.iter().find(|k| **k == key).copied()
}

/// An object's namespace or name: shared with its [`ObjectKey`] in the store's tables.
pub type Name = std::sync::Arc<str>;

/// Distinct strings [`shared`] keeps per thread (a cluster has a few dozen port names
/// and at most a few thousand nodes).
const SHARED_MAX: usize = 8192;

/// `s` as a string shared with every other object that has it: port names and node
/// names repeat across 100,000s of objects. Taken while decoding: a string per object
/// that the store replaced by a shared one later (after the whole list) left a hole in
/// the heap per endpoint.
pub fn shared(s: &str) -> Name {
    thread_local! {
        static SHARED: std::cell::RefCell<std::collections::BTreeSet<Name>> =
            Default::default();
    }
    SHARED.with(|set| {
        let mut set = set.borrow_mut();
        if let Some(name) = set.get(s) {
            return name.clone();
        }
        if set.len() >= SHARED_MAX {
            // Only strings no object holds any more are dropped.
            set.retain(|n| std::sync::Arc::strong_count(n) > 1);
        }
        let name = Name::from(s);
        if set.len() < SHARED_MAX {
            set.insert(name.clone());
        }
        name
    })
}

/// A value most objects share (a type, protocol or policy name): the known ones are not
/// allocated per object.
pub type Word = Cow<'static, str>;

const WORDS: [&str; 15] = [
    "ClusterIP",
    "NodePort",
    "LoadBalancer",
    "ExternalName",
    "TCP",
    "UDP",
    "SCTP",
    "Cluster",
    "Local",
    "None",
    "ClientIP",
    "VIP",
    "Proxy",
    "IPv4",
    "IPv6",
];

pub(super) fn word(s: &str) -> Word {
    match WORDS.iter().find(|w| **w == s) {
        Some(w) => Cow::Borrowed(w),
        None => Cow::Owned(s.to_owned()),
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceLite {
    pub namespace: Name,
    pub name: Name,
    pub labels: Box<[Label]>,
    /// `endpoints.kubernetes.io/last-change-trigger-time`, for network programming latency.
    pub trigger_time: Option<Text>,
    pub address_type: Word,
    pub ports: Box<[PortLite]>,
    pub endpoints: Box<[EndpointLite]>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortLite {
    pub name: Option<Name>,
    pub port: Option<i32>,
    pub protocol: Option<Word>,
}

/// One endpoint in 48 bytes (an EndpointSlice's are most of the store: 100,000 at
/// 10000x10): the first address inline as an IP, what few endpoints have (an address
/// that is not a plain IP, topology hints) behind one pointer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointLite {
    /// `addresses[0]` when it is an IP written the way Rust writes it back (nearly always).
    ip: Option<IpAddr>,
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
    /// Shared by the store between the endpoints on one node.
    pub node_name: Option<Name>,
    rare: Option<Box<RareEndpoint>>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct RareEndpoint {
    /// `addresses[0]` when it is not a plain IP (kube-proxy uses only the first address);
    /// kept as text, so the model sees exactly what the API said.
    address: Option<Text>,
    zone_hints: Box<[Text]>,
    node_hints: Box<[Text]>,
}

impl EndpointLite {
    pub fn new(
        address: Option<&str>,
        (ready, serving, terminating): (Option<bool>, Option<bool>, Option<bool>),
        node_name: Option<Name>,
        zone_hints: Box<[Text]>,
        node_hints: Box<[Text]>,
    ) -> EndpointLite {
        let (ip, text_address) = match address.map(Address::new) {
            Some(Address::Ip(ip)) => (Some(ip), None),
            Some(Address::Text(t)) => (None, Some(t)),
            None => (None, None),
        };
        let rare = RareEndpoint {
            address: text_address,
            zone_hints,
            node_hints,
        };
        EndpointLite {
            ip,
            ready,
            serving,
            terminating,
            node_name,
            rare: (rare != RareEndpoint::default()).then(|| Box::new(rare)),
        }
    }

    /// `addresses[0]`, as the API wrote it.
    pub fn address(&self) -> Option<Address> {
        match (
            &self.ip,
            self.rare.as_ref().and_then(|r| r.address.as_ref()),
        ) {
            (Some(ip), _) => Some(Address::Ip(*ip)),
            (None, Some(t)) => Some(Address::Text(t.clone())),
            (None, None) => None,
        }
    }

    pub fn zone_hints(&self) -> &[Text] {
        self.rare.as_ref().map_or(&[], |r| &r.zone_hints)
    }

    pub fn node_hints(&self) -> &[Text] {
        self.rare.as_ref().map_or(&[], |r| &r.node_hints)
    }
}

fn text(s: &str) -> Text {
    s.into()
}

/// An endpoint address held inline when it is an IP written the way Rust writes it back
/// (nearly always), so 100,000 endpoints need no string each; anything else (invalid, or
/// another spelling) is kept as text, so the model sees exactly what the API said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    Ip(IpAddr),
    Text(Text),
}

impl Address {
    pub(super) fn new(s: &str) -> Address {
        match s.parse::<IpAddr>() {
            Ok(ip) if ip.to_string() == s => Address::Ip(ip),
            _ => Address::Text(text(s)),
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Ip(ip) => ip.fmt(f),
            Address::Text(t) => f.write_str(t),
        }
    }
}

impl SliceLite {
    pub fn key(&self) -> ObjectKey {
        ObjectKey::new(self.namespace.clone(), self.name.clone())
    }

    pub fn label(&self, key: &str) -> Option<&str> {
        self.label_value(key).map(|v| &**v)
    }

    /// A label's value as the shared string.
    pub fn label_value(&self, key: &str) -> Option<&Name> {
        self.labels.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// `None` when the slice has no name (never stored).
    pub fn from_k8s(s: &EndpointSlice) -> Option<SliceLite> {
        let meta = &s.metadata;
        let labels = kept_labels(meta);
        let endpoints = s
            .endpoints
            .iter()
            .map(|e| {
                let c = e.conditions.as_ref();
                let hints = e.hints.as_ref();
                EndpointLite::new(
                    e.addresses.first().map(String::as_str),
                    (
                        c.and_then(|c| c.ready),
                        c.and_then(|c| c.serving),
                        c.and_then(|c| c.terminating),
                    ),
                    e.node_name.as_deref().map(shared),
                    hints
                        .and_then(|h| h.for_zones.as_ref())
                        .into_iter()
                        .flatten()
                        .map(|z| text(&z.name))
                        .collect(),
                    hints
                        .and_then(|h| h.for_nodes.as_ref())
                        .into_iter()
                        .flatten()
                        .map(|n| text(&n.name))
                        .collect(),
                )
            })
            .collect();
        let ports = s
            .ports
            .iter()
            .flatten()
            .map(|p| PortLite {
                name: p.name.as_deref().map(shared),
                port: p.port,
                protocol: p.protocol.as_deref().map(word),
            })
            .collect();
        Some(SliceLite {
            namespace: meta.namespace.as_deref().unwrap_or("default").into(),
            name: meta.name.as_deref()?.into(),
            labels,
            trigger_time: meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(TRIGGER_TIME))
                .map(|t| text(t)),
            address_type: word(&s.address_type),
            ports,
            endpoints,
        })
    }

    /// The API object the model reads (with only the fields kept here).
    pub fn to_k8s(&self) -> EndpointSlice {
        EndpointSlice {
            metadata: ObjectMeta {
                annotations: self
                    .trigger_time
                    .as_ref()
                    .map(|t| [(TRIGGER_TIME.to_string(), t.to_string())].into()),
                ..meta(&self.namespace, &self.name, &self.labels)
            },
            address_type: self.address_type.to_string(),
            ports: (!self.ports.is_empty()).then(|| {
                self.ports
                    .iter()
                    .map(|p| EndpointPort {
                        name: p.name.as_ref().map(|n| n.to_string()),
                        port: p.port,
                        protocol: p.protocol.as_ref().map(|n| n.to_string()),
                        ..Default::default()
                    })
                    .collect()
            }),
            endpoints: self.endpoints.iter().map(EndpointLite::to_k8s).collect(),
        }
    }
}

impl EndpointLite {
    fn to_k8s(&self) -> Endpoint {
        let (zone_hints, node_hints) = (self.zone_hints(), self.node_hints());
        let hints = (!zone_hints.is_empty() || !node_hints.is_empty()).then(|| EndpointHints {
            for_zones: (!zone_hints.is_empty()).then(|| {
                zone_hints
                    .iter()
                    .map(|z| ForZone {
                        name: z.to_string(),
                    })
                    .collect()
            }),
            for_nodes: (!node_hints.is_empty()).then(|| {
                node_hints
                    .iter()
                    .map(|n| ForNode {
                        name: n.to_string(),
                    })
                    .collect()
            }),
        });
        let conditions =
            (self.ready.is_some() || self.serving.is_some() || self.terminating.is_some())
                .then_some(EndpointConditions {
                    ready: self.ready,
                    serving: self.serving,
                    terminating: self.terminating,
                });
        Endpoint {
            addresses: self.address().iter().map(|a| a.to_string()).collect(),
            conditions,
            node_name: self.node_name.as_ref().map(|n| n.to_string()),
            hints,
            ..Default::default()
        }
    }
}

/// The labels the model reads, of any object.
fn kept_labels(meta: &ObjectMeta) -> Box<[Label]> {
    meta.labels
        .iter()
        .flatten()
        .filter_map(|(k, v)| Some((kept_key(k)?, v.as_str().into())))
        .collect()
}

/// The metadata of an API object rebuilt from a compact one.
fn meta(namespace: &str, name: &str, labels: &[Label]) -> ObjectMeta {
    let labels: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    ObjectMeta {
        name: Some(name.to_string()),
        namespace: Some(namespace.to_string()),
        labels: (!labels.is_empty()).then_some(labels),
        ..Default::default()
    }
}

fn strings(list: &[Text]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// A Service as the model reads it: no selector, managed fields, annotations, status
/// conditions or bookkeeping metadata. 112 bytes (it was 256): what nearly every Service
/// has is inline, the fields most leave unset (labels ferry reads, a lone clusterIP,
/// externalIPs, traffic policies, affinity, source ranges, a health check port) behind
/// one pointer, as for endpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceLite {
    pub namespace: Name,
    pub name: Name,
    /// `None` when the Service has none (the model reports it).
    pub spec: Option<SpecLite>,
    /// `status.loadBalancer.ingress`, every entry (the model names them by index).
    pub ingress: Box<[IngressLite]>,
    /// `None` when every field in it is unset or empty.
    rare: Option<Box<RareService>>,
}

/// The spec fields nearly every Service sets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecLite {
    pub type_: Option<Word>,
    pub cluster_ips: Box<[Text]>,
    pub ports: Box<[ServicePortLite]>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct RareService {
    labels: Box<[Label]>,
    spec: RareSpec,
}

/// The spec fields most Services leave unset.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RareSpec {
    /// Only kept when `cluster_ips` is empty: the model reads it then alone.
    pub cluster_ip: Option<Text>,
    pub external_ips: Box<[Text]>,
    pub internal_traffic_policy: Option<Word>,
    pub session_affinity: Option<Word>,
    /// `sessionAffinityConfig.clientIP.timeoutSeconds`.
    pub affinity_timeout_s: Option<i32>,
    pub external_traffic_policy: Option<Word>,
    pub load_balancer_source_ranges: Box<[Text]>,
    pub health_check_node_port: Option<i32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePortLite {
    pub name: Option<Name>,
    pub protocol: Option<Word>,
    pub port: i32,
    pub node_port: Option<i32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IngressLite {
    pub ip: Option<Text>,
    pub ip_mode: Option<Word>,
}

impl ServiceLite {
    /// A Service from its parts: the spec as its inline and its rare fields.
    pub fn new(
        namespace: Name,
        name: Name,
        labels: Box<[Label]>,
        spec: Option<(SpecLite, RareSpec)>,
        ingress: Box<[IngressLite]>,
    ) -> ServiceLite {
        let (spec, rare_spec) = match spec {
            Some((spec, rare)) => (Some(spec), rare),
            None => (None, RareSpec::default()),
        };
        let rare = RareService {
            labels,
            spec: rare_spec,
        };
        ServiceLite {
            namespace,
            name,
            spec,
            ingress,
            rare: (rare != RareService::default()).then(|| Box::new(rare)),
        }
    }

    pub fn key(&self) -> ObjectKey {
        ObjectKey::new(self.namespace.clone(), self.name.clone())
    }

    /// The labels the model reads.
    pub fn labels(&self) -> &[Label] {
        self.rare.as_ref().map_or(&[], |r| &r.labels)
    }

    /// The spec fields most Services leave unset (all unset: no allocation).
    pub fn rare_spec(&self) -> Cow<'_, RareSpec> {
        match &self.rare {
            Some(r) => Cow::Borrowed(&r.spec),
            None => Cow::Owned(RareSpec::default()),
        }
    }

    /// `None` when the Service has no name (never stored). No namespace means `default`.
    pub fn from_k8s(svc: &Service) -> Option<ServiceLite> {
        let key = ObjectKey::from_meta(&svc.metadata)?;
        let ingress = svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref());
        Some(ServiceLite::new(
            key.namespace,
            key.name,
            kept_labels(&svc.metadata),
            svc.spec.as_ref().map(spec_from_k8s),
            ingress
                .into_iter()
                .flatten()
                .map(|i| IngressLite {
                    ip: i.ip.as_deref().map(text),
                    ip_mode: i.ip_mode.as_deref().map(word),
                })
                .collect(),
        ))
    }

    /// The API object the model reads (with only the fields kept here).
    pub fn to_k8s(&self) -> Service {
        let ingress: Vec<LoadBalancerIngress> = self
            .ingress
            .iter()
            .map(|i| LoadBalancerIngress {
                ip: i.ip.as_ref().map(|s| s.to_string()),
                ip_mode: i.ip_mode.as_ref().map(|s| s.to_string()),
                ..Default::default()
            })
            .collect();
        Service {
            metadata: meta(&self.namespace, &self.name, self.labels()),
            spec: self
                .spec
                .as_ref()
                .map(|spec| spec_to_k8s(spec, &self.rare_spec())),
            status: (!ingress.is_empty()).then(|| ServiceStatus {
                load_balancer: Some(LoadBalancerStatus {
                    ingress: Some(ingress),
                }),
                ..Default::default()
            }),
        }
    }
}

fn spec_from_k8s(spec: &ServiceSpec) -> (SpecLite, RareSpec) {
    let cluster_ips: Box<[Text]> = spec.cluster_ips.iter().flatten().map(|s| text(s)).collect();
    let texts = |list: &Option<Vec<String>>| list.iter().flatten().map(|s| text(s)).collect();
    let inline = SpecLite {
        type_: spec.type_.as_deref().map(word),
        ports: spec
            .ports
            .iter()
            .flatten()
            .map(|p| ServicePortLite {
                name: p.name.as_deref().map(shared),
                protocol: p.protocol.as_deref().map(word),
                port: p.port,
                node_port: p.node_port,
            })
            .collect(),
        cluster_ips,
    };
    let rare = RareSpec {
        cluster_ip: spec
            .cluster_ip
            .as_deref()
            .filter(|_| inline.cluster_ips.is_empty())
            .map(text),
        external_ips: texts(&spec.external_ips),
        internal_traffic_policy: spec.internal_traffic_policy.as_deref().map(word),
        session_affinity: spec.session_affinity.as_deref().map(word),
        affinity_timeout_s: spec
            .session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds),
        external_traffic_policy: spec.external_traffic_policy.as_deref().map(word),
        load_balancer_source_ranges: texts(&spec.load_balancer_source_ranges),
        health_check_node_port: spec.health_check_node_port,
    };
    (inline, rare)
}

/// The API spec the model reads, from the inline and the rare fields.
fn spec_to_k8s(spec: &SpecLite, r: &RareSpec) -> ServiceSpec {
    ServiceSpec {
        type_: spec.type_.as_ref().map(|s| s.to_string()),
        cluster_ip: r.cluster_ip.as_ref().map(|s| s.to_string()),
        cluster_ips: (!spec.cluster_ips.is_empty()).then(|| strings(&spec.cluster_ips)),
        ports: (!spec.ports.is_empty()).then(|| {
            spec.ports
                .iter()
                .map(|p| ServicePort {
                    name: p.name.as_ref().map(|s| s.to_string()),
                    protocol: p.protocol.as_ref().map(|s| s.to_string()),
                    port: p.port,
                    node_port: p.node_port,
                    ..Default::default()
                })
                .collect()
        }),
        external_ips: (!r.external_ips.is_empty()).then(|| strings(&r.external_ips)),
        internal_traffic_policy: r.internal_traffic_policy.as_ref().map(|s| s.to_string()),
        session_affinity: r.session_affinity.as_ref().map(|s| s.to_string()),
        session_affinity_config: r.affinity_timeout_s.map(|t| SessionAffinityConfig {
            client_ip: Some(ClientIPConfig {
                timeout_seconds: Some(t),
            }),
        }),
        external_traffic_policy: r.external_traffic_policy.as_ref().map(|s| s.to_string()),
        load_balancer_source_ranges: (!r.load_balancer_source_ranges.is_empty())
            .then(|| strings(&r.load_balancer_source_ranges)),
        health_check_node_port: r.health_check_node_port,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_what_the_model_reads_and_drops_the_rest() {
        let s: EndpointSlice = serde_yaml::from_str(
            r#"
            metadata:
              name: web-abc
              namespace: shop
              labels: {kubernetes.io/service-name: web, app: web, endpointslice.kubernetes.io/managed-by: x}
              annotations: {endpoints.kubernetes.io/last-change-trigger-time: "2024-05-01T12:00:00Z", other: y}
            addressType: IPv4
            ports: [{name: http, port: 8080, protocol: TCP, appProtocol: http}, {port: 9090}]
            endpoints:
            - addresses: [10.0.0.1, 10.0.0.9]
              conditions: {ready: true, serving: true, terminating: false}
              nodeName: node-a
              zone: z1
              targetRef: {kind: Pod, name: web-1, namespace: shop, uid: abc}
              hints: {forZones: [{name: z1}], forNodes: [{name: node-a}]}
            - addresses: [10.0.0.2]
            - addresses: []
              conditions: {}
            "#,
        )
        .unwrap();
        let lite = SliceLite::from_k8s(&s).unwrap();
        assert_eq!(lite.label("kubernetes.io/service-name"), Some("web"));
        assert_eq!(lite.labels.len(), 1, "unread labels are dropped");
        let back = lite.to_k8s();
        assert_eq!(back.metadata.name.as_deref(), Some("web-abc"));
        assert_eq!(back.metadata.annotations.as_ref().unwrap().len(), 1);
        let e0 = &back.endpoints[0];
        assert_eq!(
            e0.addresses,
            vec!["10.0.0.1".to_string()],
            "only addresses[0] is kept"
        );
        assert_eq!(e0.node_name.as_deref(), Some("node-a"));
        assert!(e0.target_ref.is_none() && e0.zone.is_none());
        assert_eq!(
            e0.hints.as_ref().unwrap().for_zones.as_ref().unwrap()[0].name,
            "z1"
        );
        assert!(
            back.endpoints[1].conditions.is_none(),
            "absent conditions stay absent (they default to ready)"
        );
        assert!(back.endpoints[2].addresses.is_empty());
        let ports = back.ports.clone().unwrap();
        assert_eq!(
            (
                ports[0].name.as_deref(),
                ports[0].port,
                ports[0].protocol.as_deref()
            ),
            (Some("http"), Some(8080), Some("TCP"))
        );
        assert_eq!(
            (ports[1].name.as_deref(), ports[1].port),
            (None, Some(9090)),
            "a nil name stays nil (kube-proxy skips it)"
        );
        assert_eq!(
            SliceLite::from_k8s(&back),
            Some(lite),
            "converting again changes nothing"
        );
    }

    #[test]
    fn endpoints_are_48_bytes_and_keep_odd_addresses_as_text() {
        // 100,000 of them at 10000x10: 80 bytes each was 3 MiB more.
        assert!(std::mem::size_of::<EndpointLite>() <= 48);
        let e =
            |a: &str| EndpointLite::new(Some(a), (None, None, None), None, [].into(), [].into());
        assert_eq!(e("10.0.0.1").address().unwrap().to_string(), "10.0.0.1");
        assert!(e("10.0.0.1").rare.is_none(), "a plain IP needs no side box");
        for odd in ["010.0.0.1", "not-an-ip", "::FFFF:1.2.3.4"] {
            let lite = e(odd);
            assert_eq!(lite.address().unwrap().to_string(), odd);
            assert!(lite.ip.is_none());
        }
        let none = EndpointLite::new(None, (Some(true), None, None), None, [].into(), [].into());
        assert!(none.address().is_none() && none.zone_hints().is_empty());
    }

    #[test]
    fn service_keeps_what_the_model_reads() {
        let s: Service = serde_yaml::from_str(
            r#"
            metadata:
              name: web
              labels: {service.kubernetes.io/service-proxy-name: other, app: web}
              annotations: {kubectl.kubernetes.io/last-applied-configuration: "{}"}
              managedFields: [{manager: kubectl}]
            spec:
              type: LoadBalancer
              clusterIP: 10.96.0.1
              clusterIPs: [10.96.0.1, fd00::1]
              selector: {app: web}
              ports: [{name: http, port: 80, protocol: TCP, nodePort: 30080, targetPort: 8080}, {port: 53, protocol: UDP}]
              externalIPs: [203.0.113.1]
              internalTrafficPolicy: Local
              sessionAffinity: ClientIP
              sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}
            status:
              loadBalancer: {ingress: [{hostname: lb.example}, {ip: 198.51.100.1, ipMode: Proxy}]}
            "#,
        )
        .unwrap();
        let lite = ServiceLite::from_k8s(&s).unwrap();
        assert_eq!(lite.key(), ObjectKey::new("default", "web"));
        assert_eq!(lite.labels().len(), 1, "unread labels are dropped");
        assert_eq!(
            lite.rare_spec().cluster_ip,
            None,
            "clusterIPs is what the model reads"
        );
        let spec = lite.spec.as_ref().unwrap();
        assert!(matches!(spec.type_, Some(Cow::Borrowed("LoadBalancer"))));
        let back = lite.to_k8s();
        assert!(back.metadata.annotations.is_none() && back.metadata.managed_fields.is_none());
        let bs = back.spec.as_ref().unwrap();
        assert!(bs.selector.is_none());
        assert_eq!(bs.cluster_ips.as_deref().unwrap(), ["10.96.0.1", "fd00::1"]);
        let ports = bs.ports.as_ref().unwrap();
        assert_eq!(
            (ports[0].name.as_deref(), ports[0].port, ports[0].node_port),
            (Some("http"), 80, Some(30080))
        );
        assert_eq!(ports[1].protocol.as_deref(), Some("UDP"));
        let timeout = bs
            .session_affinity_config
            .as_ref()
            .unwrap()
            .client_ip
            .as_ref();
        assert_eq!(timeout.unwrap().timeout_seconds, Some(60));
        let ingress = back.status.unwrap().load_balancer.unwrap().ingress.unwrap();
        assert_eq!(ingress.len(), 2, "entries keep their index");
        assert_eq!(ingress[1].ip_mode.as_deref(), Some("Proxy"));
        assert_eq!(
            ServiceLite::from_k8s(&lite.to_k8s()),
            Some(lite),
            "converting again changes nothing"
        );
    }

    #[test]
    fn a_plain_service_is_112_bytes_with_nothing_aside() {
        // 30,000 of them at 30000x4: 256 bytes each was 3.7 MiB more.
        assert!(std::mem::size_of::<ServiceLite>() <= 112);
        let s: Service = serde_yaml::from_str(
            "metadata: {name: web}\nspec: {type: ClusterIP, clusterIP: 10.96.0.1, clusterIPs: [10.96.0.1], ports: [{port: 80}]}",
        )
        .unwrap();
        let lite = ServiceLite::from_k8s(&s).unwrap();
        assert!(lite.rare.is_none(), "a plain Service needs no side box");
        assert_eq!(ServiceLite::from_k8s(&lite.to_k8s()), Some(lite));
        let labelled: Service = serde_yaml::from_str(
            "metadata: {name: web, labels: {service.kubernetes.io/headless: ''}}",
        )
        .unwrap();
        let lite = ServiceLite::from_k8s(&labelled).unwrap();
        let headless: Label = ("service.kubernetes.io/headless", "".into());
        assert_eq!(lite.labels(), [headless]);
        assert!(lite.spec.is_none());
        assert_eq!(ServiceLite::from_k8s(&lite.to_k8s()), Some(lite));
    }

    #[test]
    fn addresses_are_inline_only_when_they_read_back_the_same() {
        for a in [
            "10.0.0.1",
            "fd00::1",
            "FD00::1",
            "fd00:0::1",
            "10.0.0.300",
            "",
        ] {
            let addr = Address::new(a);
            assert_eq!(addr.to_string(), a);
            let inline = matches!(addr, Address::Ip(_));
            assert_eq!(inline, ["10.0.0.1", "fd00::1"].contains(&a), "{a}");
        }
    }

    #[test]
    fn a_service_without_name_is_not_kept() {
        assert_eq!(ServiceLite::from_k8s(&Service::default()), None);
    }
}
