//! Services and EndpointSlices read from JSON text straight into their compact form
//! ([`ServiceLite`], [`SliceLite`]), with no `serde_json::Value` and no k8s-openapi
//! object in between: at 100,000 Services the API source spent seconds and most of its
//! allocations building both for every list item.
//!
//! This is a fast path, not a second reader with rules of its own: it reads only what
//! [`super::lenient`] keeps, typed as k8s-openapi types it, and fails on anything it
//! does not read the same way (a `null` inside a list, a duplicate field or label). The
//! caller then decodes the same text the lenient way, which decides (a compact object
//! or [`super::lenient::Unreadable`]). So both ways give the same result; the tests
//! below compare them.

use std::collections::BTreeSet;
use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};

use super::compact::{
    self, EndpointLite, IngressLite, Label, Name, PortLite, RareSpec, ServiceLite, ServicePortLite,
    SliceLite, SpecLite, TRIGGER_TIME,
};
use super::store::ObjectKey;

/// What a list item or watch object decodes to: its name, namespace and resourceVersion
/// (what the watcher reads), and the compact object (`None` when it has no name).
pub(super) type Decoded<L> = (ObjectMeta, Option<L>);

/// A Service from its JSON text; `None` when the lenient decoder must decide.
pub(super) fn service(text: &str) -> Option<Decoded<ServiceLite>> {
    let w: ServiceWire = serde_json::from_str(text).ok()?;
    let meta = w.metadata.unwrap_or_default();
    let object_meta = meta.object_meta();
    let key = ObjectKey::from_meta(&object_meta);
    let lite = key.map(|key| {
        ServiceLite::new(
            key.namespace,
            key.name,
            meta.labels.map(|l| l.0).unwrap_or_default(),
            w.spec.map(SpecWire::into_lite),
            w.status
                .and_then(|s| s.load_balancer)
                .and_then(|lb| lb.ingress)
                .unwrap_or_default()
                .into_iter()
                .map(|i| IngressLite {
                    ip: i.ip,
                    ip_mode: i.ip_mode.as_deref().map(compact::word),
                })
                .collect(),
        )
    });
    Some((object_meta, lite))
}

/// An EndpointSlice from its JSON text; `None` when the lenient decoder must decide.
pub(super) fn slice(text: &str) -> Option<Decoded<SliceLite>> {
    let w: SliceWire = serde_json::from_str(text).ok()?;
    let meta = w.metadata.unwrap_or_default();
    let object_meta = meta.object_meta();
    let lite = meta.name.map(|name| SliceLite {
        namespace: meta.namespace.map_or_else(|| "default".into(), Into::into),
        name: name.into(),
        labels: meta.labels.map(|l| l.0).unwrap_or_default(),
        trigger_time: meta.annotations.and_then(|a| a.0),
        address_type: compact::word(w.address_type.as_deref().unwrap_or_default()),
        ports: w
            .ports
            .unwrap_or_default()
            .into_iter()
            .map(|p| PortLite {
                name: p.name.map(|n| n.0),
                port: p.port,
                protocol: p.protocol.as_deref().map(compact::word),
            })
            .collect(),
        endpoints: w
            .endpoints
            .unwrap_or_default()
            .into_iter()
            .map(EndpointWire::into_lite)
            .collect(),
    });
    Some((object_meta, lite))
}

type Text = Box<str>;

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct MetaWire {
    name: Option<Text>,
    namespace: Option<Text>,
    resource_version: Option<String>,
    labels: Option<Labels>,
    annotations: Option<Annotations>,
}

impl MetaWire {
    fn object_meta(&self) -> ObjectMeta {
        ObjectMeta {
            name: self.name.as_deref().map(str::to_owned),
            namespace: self.namespace.as_deref().map(str::to_owned),
            resource_version: self.resource_version.clone(),
            ..ObjectMeta::default()
        }
    }
}

/// The kept labels; every value is checked to be a string (or null), as the typed
/// decoder does.
struct Labels(Box<[Label]>);

impl<'de> Deserialize<'de> for Labels {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Labels;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of strings")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Labels, A::Error> {
                let mut kept: Vec<Label> = Vec::new();
                let mut seen = BTreeSet::new();
                while let Some(key) = map.next_key::<String>()? {
                    let value: Option<String> = map.next_value()?;
                    if !seen.insert(key.clone()) {
                        return Err(de::Error::custom("duplicate label"));
                    }
                    if let Some(value) = value
                        && let Some(key) = compact::kept_key(&key)
                    {
                        kept.push((key, value.into()));
                    }
                }
                // The typed decoder keeps labels in a BTreeMap: key order.
                kept.sort();
                Ok(Labels(kept.into()))
            }
        }
        d.deserialize_map(V)
    }
}

/// Only the trigger time; every other annotation is skipped unread, as the lenient
/// decoder drops them before typing.
struct Annotations(Option<Text>);

impl<'de> Deserialize<'de> for Annotations {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Annotations;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Annotations, A::Error> {
                let mut trigger: Option<Option<Text>> = None;
                while let Some(key) = map.next_key::<String>()? {
                    if key == TRIGGER_TIME {
                        if trigger.is_some() {
                            return Err(de::Error::custom("duplicate annotation"));
                        }
                        trigger = Some(map.next_value()?);
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(Annotations(trigger.flatten()))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(Deserialize)]
struct ServiceWire {
    metadata: Option<MetaWire>,
    spec: Option<SpecWire>,
    status: Option<StatusWire>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SpecWire {
    #[serde(rename = "type")]
    type_: Option<String>,
    #[serde(rename = "clusterIP")]
    cluster_ip: Option<Text>,
    #[serde(rename = "clusterIPs")]
    cluster_ips: Option<Vec<Text>>,
    ports: Option<Vec<ServicePortWire>>,
    #[serde(rename = "externalIPs")]
    external_ips: Option<Vec<Text>>,
    internal_traffic_policy: Option<String>,
    session_affinity: Option<String>,
    session_affinity_config: Option<AffinityConfigWire>,
    external_traffic_policy: Option<String>,
    load_balancer_source_ranges: Option<Vec<Text>>,
    health_check_node_port: Option<i32>,
}

impl SpecWire {
    fn into_lite(self) -> (SpecLite, RareSpec) {
        let cluster_ips: Box<[Text]> = self.cluster_ips.unwrap_or_default().into();
        let rare = RareSpec {
            cluster_ip: self.cluster_ip.filter(|_| cluster_ips.is_empty()),
            external_ips: self.external_ips.unwrap_or_default().into(),
            internal_traffic_policy: self.internal_traffic_policy.as_deref().map(compact::word),
            session_affinity: self.session_affinity.as_deref().map(compact::word),
            affinity_timeout_s: self
                .session_affinity_config
                .and_then(|c| c.client_ip)
                .and_then(|c| c.timeout_seconds),
            external_traffic_policy: self.external_traffic_policy.as_deref().map(compact::word),
            load_balancer_source_ranges: self
                .load_balancer_source_ranges
                .unwrap_or_default()
                .into(),
            health_check_node_port: self.health_check_node_port,
        };
        let inline = SpecLite {
            type_: self.type_.as_deref().map(compact::word),
            cluster_ips,
            ports: self
                .ports
                .unwrap_or_default()
                .into_iter()
                .map(|p| ServicePortLite {
                    name: p.name.map(|n| n.0),
                    protocol: p.protocol.as_deref().map(compact::word),
                    port: p.port.unwrap_or_default(),
                    node_port: p.node_port,
                })
                .collect(),
        };
        (inline, rare)
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ServicePortWire {
    name: Option<SharedName>,
    protocol: Option<String>,
    port: Option<i32>,
    node_port: Option<i32>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AffinityConfigWire {
    #[serde(rename = "clientIP")]
    client_ip: Option<ClientIpWire>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ClientIpWire {
    timeout_seconds: Option<i32>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct StatusWire {
    load_balancer: Option<LoadBalancerWire>,
}

#[derive(Deserialize)]
struct LoadBalancerWire {
    ingress: Option<Vec<IngressWire>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct IngressWire {
    ip: Option<Text>,
    ip_mode: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SliceWire {
    metadata: Option<MetaWire>,
    address_type: Option<String>,
    ports: Option<Vec<SlicePortWire>>,
    endpoints: Option<Vec<EndpointWire>>,
}

#[derive(Deserialize)]
struct SlicePortWire {
    name: Option<SharedName>,
    port: Option<i32>,
    protocol: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct EndpointWire {
    addresses: Option<Vec<String>>,
    conditions: Option<ConditionsWire>,
    node_name: Option<SharedName>,
    hints: Option<HintsWire>,
}

/// A string many objects repeat (a port or node name), decoded as one shared copy
/// ([`compact::shared`]) without a string of its own first.
struct SharedName(Name);

impl<'de> Deserialize<'de> for SharedName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = SharedName;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<SharedName, E> {
                Ok(SharedName(compact::shared(s)))
            }
        }
        d.deserialize_str(V)
    }
}

impl EndpointWire {
    fn into_lite(self) -> EndpointLite {
        let c = self.conditions;
        let hints = self.hints;
        let (zones, nodes) = hints.map_or((None, None), |h| (h.for_zones, h.for_nodes));
        let names = |list: Option<Vec<NameWire>>| -> Box<[Text]> {
            list.unwrap_or_default()
                .into_iter()
                .map(|n| n.name.unwrap_or_default())
                .collect()
        };
        EndpointLite::new(
            self.addresses
                .as_deref()
                .and_then(<[String]>::first)
                .map(String::as_str),
            (
                c.as_ref().and_then(|c| c.ready),
                c.as_ref().and_then(|c| c.serving),
                c.as_ref().and_then(|c| c.terminating),
            ),
            self.node_name.map(|n| n.0),
            names(zones),
            names(nodes),
        )
    }
}

#[derive(Deserialize)]
struct ConditionsWire {
    ready: Option<bool>,
    serving: Option<bool>,
    terminating: Option<bool>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct HintsWire {
    for_zones: Option<Vec<NameWire>>,
    for_nodes: Option<Vec<NameWire>>,
}

#[derive(Deserialize)]
struct NameWire {
    name: Option<Text>,
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
    use serde_json::{Value, json};

    use super::super::lenient::Lenient;
    use super::*;

    /// What the lenient decoder makes of the same text.
    fn lenient_service(v: &Value) -> Result<Option<ServiceLite>, String> {
        let l: Lenient<Service> = serde_json::from_value(v.clone()).unwrap();
        l.0.map(|s| ServiceLite::from_k8s(&s))
            .map_err(|e| e.to_string())
    }

    fn lenient_slice(v: &Value) -> Result<Option<SliceLite>, String> {
        let l: Lenient<EndpointSlice> = serde_json::from_value(v.clone()).unwrap();
        l.0.map(|s| SliceLite::from_k8s(&s))
            .map_err(|e| e.to_string())
    }

    /// The fast path either agrees with the lenient decoder or leaves it to it.
    fn same_service(v: Value, fast_expected: bool) {
        let text = v.to_string();
        let fast = service(&text);
        assert_eq!(fast.is_some(), fast_expected, "fast path taken? {text}");
        if let Some((meta, lite)) = fast {
            assert_eq!(Ok(lite), lenient_service(&v), "{text}");
            assert_eq!(
                meta.resource_version,
                v.pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            );
        }
    }

    fn same_slice(v: Value, fast_expected: bool) {
        let text = v.to_string();
        let fast = slice(&text);
        assert_eq!(fast.is_some(), fast_expected, "fast path taken? {text}");
        if let Some((_, lite)) = fast {
            assert_eq!(Ok(lite), lenient_slice(&v), "{text}");
        }
    }

    #[test]
    fn services_read_as_the_lenient_decoder_reads_them() {
        same_service(
            json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "web", "namespace": "shop", "resourceVersion": "42",
                    "labels": {"app": "web", "service.kubernetes.io/service-proxy-name": "x", "odd": null},
                    "annotations": {"kubectl.kubernetes.io/last-applied-configuration": {"not": "a string"},
                                    TRIGGER_TIME: "2024-01-01T00:00:00Z"},
                    "managedFields": [{"manager": "kubectl", "time": null}], "uid": "u"},
                "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.1", "clusterIPs": ["10.96.0.1", "fd00::1"],
                    "selector": {"app": "web"}, "someFutureField": [1, null],
                    "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080, "targetPort": "http"},
                              {"port": 53, "protocol": "UDP", "appProtocol": null}],
                    "externalIPs": ["203.0.113.1"], "internalTrafficPolicy": "Local",
                    "sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
                    "externalTrafficPolicy": "Local", "loadBalancerSourceRanges": ["10.0.0.0/8"],
                    "healthCheckNodePort": 31000, "ipFamilies": ["IPv4"]},
                "status": {"conditions": [{"lastTransitionTime": null}],
                    "loadBalancer": {"ingress": [{"ip": "198.51.100.1", "ipMode": "Proxy", "ports": null},
                                                 {"hostname": "lb.example"}]}},
            }),
            true,
        );
        // Nothing but a name; defaults; a missing port number; a clusterIP alone.
        same_service(json!({"metadata": {"name": "a"}}), true);
        same_service(
            json!({"metadata": {"name": "a", "namespace": ""}, "spec": {}}),
            true,
        );
        same_service(
            json!({"metadata": {"name": "a"}, "spec": {"clusterIP": "None", "ports": [{"name": "x"}]}}),
            true,
        );
        same_service(
            json!({"metadata": {"name": "a"}, "spec": null, "status": null}),
            true,
        );
        // No name: nothing to store, either way.
        same_service(json!({"metadata": {"namespace": "x"}, "spec": {}}), true);
        same_service(json!({"metadata": {"name": ""}}), true);
        same_service(json!({}), true);
    }

    #[test]
    fn what_only_the_lenient_decoder_reads_is_left_to_it() {
        for odd in [
            // nulls inside lists are dropped by the lenient decoder
            json!({"metadata": {"name": "a"}, "spec": {"ports": [null, {"port": 80}]}}),
            json!({"metadata": {"name": "a"}, "spec": {"clusterIPs": ["10.96.0.1", null]}}),
            // unreadable: the lenient decoder reports where
            json!({"metadata": {"name": "a"}, "spec": {"ports": "80"}}),
            json!({"metadata": {"name": "a"}, "spec": {"ports": [{"port": "http"}]}}),
            json!({"metadata": {"name": "a", "labels": {"app": 1}}}),
            json!({"metadata": {"name": "a", "annotations": {TRIGGER_TIME: 5}}}),
            json!({"metadata": {"name": 5}}),
            json!("nonsense"),
        ] {
            same_service(odd, false);
        }
        // Duplicate members are not valid JSON objects to the lenient decoder's map.
        let text = r#"{"metadata":{"name":"a","labels":{"kubernetes.io/service-name":"x","kubernetes.io/service-name":"y"}}}"#;
        assert!(service(text).is_none());
        let text = r#"{"metadata":{"name":"a"},"metadata":{"name":"b"}}"#;
        assert!(service(text).is_none());
    }

    #[test]
    fn slices_read_as_the_lenient_decoder_reads_them() {
        same_slice(
            json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "web-abc", "namespace": "shop", "resourceVersion": "7",
                    "labels": {"kubernetes.io/service-name": "web", "endpointslice.kubernetes.io/managed-by": "x"},
                    "annotations": {TRIGGER_TIME: "2024-05-01T12:00:00Z", "other": "y"},
                    "ownerReferences": [{"kind": "Service"}]},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"}, {"port": 9090}, {}],
                "endpoints": [
                    {"addresses": ["10.0.0.1", "10.0.0.9"], "conditions": {"ready": true, "serving": true, "terminating": false},
                     "nodeName": "node-a", "zone": "z1", "targetRef": {"kind": "Pod", "name": "web-1"},
                     "hints": {"forZones": [{"name": "z1"}, {}], "forNodes": [{"name": "node-a"}]}},
                    {"addresses": ["fd00::1"], "conditions": {"ready": null}},
                    {"addresses": ["FD00::2"]},
                    {"addresses": [], "conditions": {}},
                    {},
                ],
            }),
            true,
        );
        same_slice(json!({"metadata": {"name": "s"}}), true);
        same_slice(
            json!({"metadata": {"name": "", "namespace": ""}, "endpoints": null}),
            true,
        );
        same_slice(json!({"metadata": {"namespace": "x"}}), true);
        for odd in [
            json!({"metadata": {"name": "s"}, "endpoints": [null]}),
            json!({"metadata": {"name": "s"}, "endpoints": [{"addresses": [null, "10.0.0.1"]}]}),
            json!({"metadata": {"name": "s"}, "endpoints": {}}),
            json!({"metadata": {"name": "s"}, "ports": [{"port": 1.5}]}),
            json!({"metadata": {"name": "s"}, "endpoints": [{"conditions": {"ready": "yes"}}]}),
        ] {
            same_slice(odd, false);
        }
    }

    #[test]
    fn port_and_node_names_are_shared_as_decoded() {
        let text = |name: &str| {
            json!({"metadata": {"name": name}, "ports": [{"name": "http", "port": 80}],
                   "endpoints": [{"addresses": ["10.0.0.1"], "nodeName": "node-a"}]})
            .to_string()
        };
        let (_, a) = slice(&text("a")).unwrap();
        let (_, b) = slice(&text("b")).unwrap();
        let (a, b) = (a.unwrap(), b.unwrap());
        let port = |s: &SliceLite| s.ports[0].name.clone().unwrap();
        let node = |s: &SliceLite| s.endpoints[0].node_name.clone().unwrap();
        assert_eq!(&*port(&a), "http");
        assert!(std::sync::Arc::ptr_eq(&port(&a), &port(&b)));
        assert!(std::sync::Arc::ptr_eq(&node(&a), &node(&b)));
        let svc = |name: &str| {
            let text = json!({"metadata": {"name": name}, "spec": {"ports": [{"name": "http", "port": 80}]}});
            let (_, s) = service(&text.to_string()).unwrap();
            s.unwrap().spec.unwrap().ports[0].name.clone().unwrap()
        };
        assert!(std::sync::Arc::ptr_eq(&svc("x"), &port(&a)));
    }
}
