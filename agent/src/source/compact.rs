//! EndpointSlices as ferry keeps them: only what kube-proxy reads, in about a tenth of
//! the memory of the API object. A k8s-openapi `Endpoint` is 352 bytes before any of
//! its strings; 10,000 slices of 10 endpoints held as API objects cost ~80 MiB, as
//! [`SliceLite`] ~10 MiB. Sources convert on arrival; the model gets an API object back
//! ([`SliceLite::to_k8s`]) only for the Services it recomputes.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::core::v1::Service,
    api::discovery::v1::{
        Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice, ForNode, ForZone,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use super::ObjectKey;

/// The labels and annotations the model reads; every other one is dropped.
const KEPT_LABELS: [&str; 3] = [
    "kubernetes.io/service-name",
    "service.kubernetes.io/service-proxy-name",
    "service.kubernetes.io/headless",
];
pub const TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

type Text = Box<str>;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceLite {
    pub namespace: Text,
    pub name: Text,
    pub labels: Box<[(Text, Text)]>,
    /// `endpoints.kubernetes.io/last-change-trigger-time`, for network programming latency.
    pub trigger_time: Option<Text>,
    pub address_type: Text,
    pub ports: Box<[PortLite]>,
    pub endpoints: Box<[EndpointLite]>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortLite {
    pub name: Option<Text>,
    pub port: Option<i32>,
    pub protocol: Option<Text>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointLite {
    /// `addresses[0]`: kube-proxy uses only the first address.
    pub address: Option<Text>,
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
    pub node_name: Option<Text>,
    pub zone_hints: Box<[Text]>,
    pub node_hints: Box<[Text]>,
}

fn text(s: &str) -> Text {
    s.into()
}

impl SliceLite {
    pub fn key(&self) -> ObjectKey {
        ObjectKey::new(self.namespace.to_string(), self.name.to_string())
    }

    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| &**k == key)
            .map(|(_, v)| &**v)
    }

    /// `None` when the slice has no name (never stored).
    pub fn from_k8s(s: &EndpointSlice) -> Option<SliceLite> {
        let meta = &s.metadata;
        let labels = meta
            .labels
            .iter()
            .flatten()
            .filter(|(k, _)| KEPT_LABELS.contains(&k.as_str()))
            .map(|(k, v)| (text(k), text(v)))
            .collect();
        let endpoints = s
            .endpoints
            .iter()
            .map(|e| {
                let c = e.conditions.as_ref();
                let hints = e.hints.as_ref();
                EndpointLite {
                    address: e.addresses.first().map(|a| text(a)),
                    ready: c.and_then(|c| c.ready),
                    serving: c.and_then(|c| c.serving),
                    terminating: c.and_then(|c| c.terminating),
                    node_name: e.node_name.as_deref().map(text),
                    zone_hints: hints
                        .and_then(|h| h.for_zones.as_ref())
                        .iter()
                        .flat_map(|z| z.iter())
                        .map(|z| text(&z.name))
                        .collect(),
                    node_hints: hints
                        .and_then(|h| h.for_nodes.as_ref())
                        .iter()
                        .flat_map(|n| n.iter())
                        .map(|n| text(&n.name))
                        .collect(),
                }
            })
            .collect();
        let ports = s
            .ports
            .iter()
            .flatten()
            .map(|p| PortLite {
                name: p.name.as_deref().map(text),
                port: p.port,
                protocol: p.protocol.as_deref().map(text),
            })
            .collect();
        Some(SliceLite {
            namespace: text(meta.namespace.as_deref().unwrap_or("default")),
            name: text(meta.name.as_deref()?),
            labels,
            trigger_time: meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(TRIGGER_TIME))
                .map(|t| text(t)),
            address_type: text(&s.address_type),
            ports,
            endpoints,
        })
    }

    /// The API object the model reads (with only the fields kept here).
    pub fn to_k8s(&self) -> EndpointSlice {
        let labels: BTreeMap<String, String> = self
            .labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        EndpointSlice {
            metadata: ObjectMeta {
                name: Some(self.name.to_string()),
                namespace: Some(self.namespace.to_string()),
                labels: (!labels.is_empty()).then_some(labels),
                annotations: self
                    .trigger_time
                    .as_ref()
                    .map(|t| [(TRIGGER_TIME.to_string(), t.to_string())].into()),
                ..Default::default()
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
        let hints =
            (!self.zone_hints.is_empty() || !self.node_hints.is_empty()).then(|| EndpointHints {
                for_zones: (!self.zone_hints.is_empty()).then(|| {
                    self.zone_hints
                        .iter()
                        .map(|z| ForZone {
                            name: z.to_string(),
                        })
                        .collect()
                }),
                for_nodes: (!self.node_hints.is_empty()).then(|| {
                    self.node_hints
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
            addresses: self.address.iter().map(|a| a.to_string()).collect(),
            conditions,
            node_name: self.node_name.as_ref().map(|n| n.to_string()),
            hints,
            ..Default::default()
        }
    }
}

/// A Service without what the model never reads: the selector (it can be large),
/// status conditions, managed fields, annotations and bookkeeping metadata.
pub fn compact_service(mut svc: Service) -> Service {
    let m = &mut svc.metadata;
    m.managed_fields = None;
    m.owner_references = None;
    m.finalizers = None;
    m.annotations = None;
    m.uid = None;
    m.resource_version = None;
    m.creation_timestamp = None;
    m.generation = None;
    if let Some(spec) = svc.spec.as_mut() {
        spec.selector = None;
    }
    if let Some(status) = svc.status.as_mut() {
        status.conditions = None;
    }
    svc
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
}
