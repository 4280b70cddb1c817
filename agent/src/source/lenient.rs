//! Lenient decoding of watched objects: one object the API server accepted must never
//! fail a whole list or watch.
//!
//! k8s-openapi's structs are strict about fields ferry never reads (a
//! `status.conditions[].lastTransitionTime: null` fails the whole `Service`), and a
//! watch line that does not decode ends kube-rs' watch stream, which then backs off and
//! relists: one odd Service blinded ferry to every Service change. So a watched object
//! is decoded in two steps, by [`Lenient`]:
//!
//! 1. as plain JSON, which cannot fail for anything the API server sends;
//! 2. cut down to the fields ferry reads ([`Kept::SHAPE`], which also drops every
//!    `null`, the same as an absent field to Kubernetes), then decoded into the typed
//!    k8s-openapi object.
//!
//! When step 2 fails, the object is kept as [`Unreadable`]: its key and
//! resourceVersion (read from the raw JSON) with the field and the reason, so the
//! watcher carries on and the source can report that one object and skip it.
//!
//! Cutting objects down also keeps memory low: managed fields, annotations (but the
//! EndpointSlice trigger time), conditions and node images never reach a typed struct.

use std::borrow::Cow;
use std::fmt;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Deserializer};
use serde_json::Value;
use serde_json::value::RawValue;

use super::wire::{self, Decoded};
use super::{ServiceLite, SliceLite};

use super::compact::TRIGGER_TIME;

/// Which members of a JSON object are kept. Applies to each element of a list alike.
#[derive(Debug)]
pub enum Shape {
    /// The value as it is (nulls dropped).
    All,
    /// Only these members, each cut to its own shape.
    Fields(&'static [(&'static str, Shape)]),
}

use Shape::{All, Fields};

/// A watched kind and the part of it ferry reads.
pub trait Kept: kube::Resource<DynamicType = ()> + for<'de> Deserialize<'de> {
    const SHAPE: Shape;
}

/// What the metadata of Services and EndpointSlices keeps. `resourceVersion` is what
/// the watcher resumes from; only slices carry the trigger time.
const META: (&str, Shape) = (
    "metadata",
    Fields(&[
        ("name", All),
        ("namespace", All),
        ("resourceVersion", All),
        ("labels", All),
        ("annotations", Fields(&[(TRIGGER_TIME, All)])),
    ]),
);

impl Kept for Service {
    /// What [`super::ServiceLite::from_k8s`] reads.
    const SHAPE: Shape = Fields(&[
        META,
        (
            "spec",
            Fields(&[
                ("type", All),
                ("clusterIP", All),
                ("clusterIPs", All),
                (
                    "ports",
                    Fields(&[
                        ("name", All),
                        ("protocol", All),
                        ("port", All),
                        ("nodePort", All),
                    ]),
                ),
                ("externalIPs", All),
                ("internalTrafficPolicy", All),
                ("sessionAffinity", All),
                (
                    "sessionAffinityConfig",
                    Fields(&[("clientIP", Fields(&[("timeoutSeconds", All)]))]),
                ),
                ("externalTrafficPolicy", All),
                ("loadBalancerSourceRanges", All),
                ("healthCheckNodePort", All),
            ]),
        ),
        (
            "status",
            Fields(&[(
                "loadBalancer",
                Fields(&[("ingress", Fields(&[("ip", All), ("ipMode", All)]))]),
            )]),
        ),
    ]);
}

impl Kept for EndpointSlice {
    /// What [`super::SliceLite::from_k8s`] reads.
    const SHAPE: Shape = Fields(&[
        META,
        ("addressType", All),
        (
            "ports",
            Fields(&[("name", All), ("port", All), ("protocol", All)]),
        ),
        (
            "endpoints",
            Fields(&[
                ("addresses", All),
                (
                    "conditions",
                    Fields(&[("ready", All), ("serving", All), ("terminating", All)]),
                ),
                ("nodeName", All),
                (
                    "hints",
                    Fields(&[
                        ("forZones", Fields(&[("name", All)])),
                        ("forNodes", Fields(&[("name", All)])),
                    ]),
                ),
            ]),
        ),
    ]);
}

impl Kept for Node {
    /// The zone label, and what kube-proxy's nodeEligible reads (`engine::node_eligible`).
    const SHAPE: Shape = Fields(&[
        (
            "metadata",
            Fields(&[
                ("name", All),
                ("resourceVersion", All),
                ("labels", All),
                ("deletionTimestamp", All),
            ]),
        ),
        (
            "spec",
            Fields(&[(
                "taints",
                Fields(&[("key", All), ("value", All), ("effect", All)]),
            )]),
        ),
    ]);
}

/// Cuts `value` down to `shape` in place, dropping nulls (in objects and in lists).
pub fn keep(value: &mut Value, shape: &Shape) {
    match value {
        Value::Object(members) => {
            members.retain(|name, member| {
                !member.is_null()
                    && match shape {
                        All => true,
                        Fields(fields) => fields.iter().any(|(kept, _)| kept == name),
                    }
            });
            for (name, member) in members.iter_mut() {
                keep(member, member_shape(shape, name));
            }
        }
        Value::Array(items) => {
            items.retain(|item| !item.is_null());
            for item in items {
                keep(item, shape);
            }
        }
        _ => {}
    }
}

fn member_shape<'a>(shape: &'a Shape, name: &str) -> &'a Shape {
    match shape {
        All => &All,
        Fields(fields) => fields
            .iter()
            .find(|(kept, _)| *kept == name)
            .map_or(&All, |(_, s)| s),
    }
}

/// A watched object that could not be read: who it is and why.
#[derive(Clone, Debug)]
pub struct Unreadable {
    /// Name, namespace and resourceVersion, as far as they are strings.
    pub meta: ObjectMeta,
    /// Where decoding failed (`spec.ports`), `.` for the object itself.
    pub field: String,
    pub reason: String,
}

impl fmt::Display for Unreadable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

/// A watched object as ferry reads it, or why it cannot be. Decoding one never fails
/// (short of invalid JSON), so kube-rs' watcher never stops for a single object.
#[derive(Clone, Debug)]
pub struct Lenient<K>(pub Result<K, Box<Unreadable>>);

impl<K: Kept> Lenient<K> {
    pub fn from_value(mut value: Value) -> Lenient<K> {
        keep(&mut value, &K::SHAPE);
        match serde_path_to_error::deserialize::<_, K>(&value) {
            Ok(object) => Lenient(Ok(object)),
            Err(err) => Lenient(Err(Box::new(Unreadable {
                meta: raw_meta(&value),
                field: err.path().to_string(),
                reason: err.into_inner().to_string(),
            }))),
        }
    }
}

/// The key and resourceVersion of an object the typed model rejected.
fn raw_meta(value: &Value) -> ObjectMeta {
    let text = |field: &str| {
        value
            .pointer(&format!("/metadata/{field}"))
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    ObjectMeta {
        name: text("name"),
        namespace: text("namespace"),
        resource_version: text("resourceVersion"),
        ..ObjectMeta::default()
    }
}

impl<'de, K: Kept> Deserialize<'de> for Lenient<K> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Value::deserialize(deserializer).map(Lenient::from_value)
    }
}

/// The kind, group, version and plural of a wrapper: those of the object it wraps.
macro_rules! names_of {
    ($k:ident) => {
        fn kind(dt: &()) -> Cow<'_, str> {
            $k::kind(dt)
        }

        fn group(dt: &()) -> Cow<'_, str> {
            $k::group(dt)
        }

        fn version(dt: &()) -> Cow<'_, str> {
            $k::version(dt)
        }

        fn plural(dt: &()) -> Cow<'_, str> {
            $k::plural(dt)
        }
    };
}

impl<K: Kept> kube::Resource for Lenient<K> {
    type DynamicType = ();
    type Scope = K::Scope;

    names_of!(K);

    fn meta(&self) -> &ObjectMeta {
        match &self.0 {
            Ok(object) => object.meta(),
            Err(unreadable) => &unreadable.meta,
        }
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        match &mut self.0 {
            Ok(object) => object.meta_mut(),
            Err(unreadable) => &mut unreadable.meta,
        }
    }
}

/// A kind ferry keeps compact ([`super::compact`]), and how to read one from JSON text
/// straight into that form ([`super::wire`]).
pub trait Compact: Kept {
    type Lite;
    /// `None` when the lenient decoder must decide.
    fn fast(text: &str) -> Option<Decoded<Self::Lite>>;
    /// `None` when the object has no name (never stored).
    fn lite(&self) -> Option<Self::Lite>;
}

impl Compact for Service {
    type Lite = ServiceLite;
    fn fast(text: &str) -> Option<Decoded<ServiceLite>> {
        wire::service(text)
    }
    fn lite(&self) -> Option<ServiceLite> {
        ServiceLite::from_k8s(self)
    }
}

impl Compact for EndpointSlice {
    type Lite = SliceLite;
    fn fast(text: &str) -> Option<Decoded<SliceLite>> {
        wire::slice(text)
    }
    fn lite(&self) -> Option<SliceLite> {
        SliceLite::from_k8s(self)
    }
}

/// A watched Service or EndpointSlice already in its compact form, or why it cannot be
/// read: what [`Lenient`] gives, converted, without building a `Value` and a typed
/// object for each of them (the fast path of [`super::wire`]; only an object it does not
/// read the same way goes through [`Lenient`]). A list page then holds its text and the
/// compact objects only.
///
/// It needs serde_json's own deserializer (the object's text is taken as it is): kube-rs
/// decodes list pages and watch lines with it, and the API server writes a watch line's
/// `type` before its `object`, so the object is never buffered first.
pub struct Lean<K: Compact> {
    /// Name, namespace and resourceVersion: what the watcher and the source read.
    pub meta: ObjectMeta,
    /// The compact object (`None` without a name), or why it cannot be read.
    pub object: Result<Option<K::Lite>, Box<Unreadable>>,
}

impl<K: Compact> Lean<K> {
    pub fn from_text(text: &str) -> Result<Lean<K>, serde_json::Error> {
        if let Some((meta, object)) = K::fast(text) {
            return Ok(Lean {
                meta,
                object: Ok(object),
            });
        }
        let Lenient(read) = Lenient::<K>::from_value(serde_json::from_str(text)?);
        Ok(match read {
            Ok(k) => Lean {
                meta: ObjectMeta {
                    name: k.meta().name.clone(),
                    namespace: k.meta().namespace.clone(),
                    resource_version: k.meta().resource_version.clone(),
                    ..ObjectMeta::default()
                },
                object: Ok(k.lite()),
            },
            Err(e) => Lean {
                meta: e.meta.clone(),
                object: Err(e),
            },
        })
    }
}

impl<K: Compact> Clone for Lean<K>
where
    K::Lite: Clone,
{
    fn clone(&self) -> Self {
        Lean {
            meta: self.meta.clone(),
            object: self.object.clone(),
        }
    }
}

impl<K: Compact> fmt::Debug for Lean<K>
where
    K::Lite: fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lean")
            .field("meta", &self.meta)
            .field("object", &self.object)
            .finish()
    }
}

impl<'de, K: Compact> Deserialize<'de> for Lean<K> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = Box::<RawValue>::deserialize(deserializer)?;
        Lean::from_text(raw.get()).map_err(serde::de::Error::custom)
    }
}

impl<K: Compact> kube::Resource for Lean<K> {
    type DynamicType = ();
    type Scope = K::Scope;

    names_of!(K);

    fn meta(&self) -> &ObjectMeta {
        &self.meta
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.meta
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn service(spec: Value, status: Value) -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": "web", "namespace": "shop", "resourceVersion": "42",
                "labels": {"app": "web", "odd": null},
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"},
                "managedFields": [{"manager": "kubectl", "time": null}],
                "finalizers": null,
            },
            "spec": spec,
            "status": status,
        })
    }

    fn decode<K: Kept>(value: Value) -> Result<K, Box<Unreadable>> {
        // Through the deserializer, as kube-rs does with each list item and watch line.
        serde_json::from_value::<Lenient<K>>(value)
            .expect("lenient decoding never fails")
            .0
    }

    #[test]
    fn what_the_typed_model_rejects_elsewhere_is_ignored() {
        let strict = service(
            json!({"clusterIP": "10.96.0.10", "ports": [{"port": 80, "protocol": "TCP", "targetPort": null}],
                   "selector": null, "someFutureField": {"x": [1, null]}}),
            json!({
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": null,
                                "reason": "x", "message": "y"}],
                "loadBalancer": {"ingress": [
                    {"ip": "198.51.100.1", "ipMode": "VIP", "ports": [{"port": 80, "protocol": "TCP", "error": null}, null]},
                    null,
                    {"hostname": "lb.example", "ports": null},
                ]},
            }),
        );
        assert!(
            serde_json::from_value::<Service>(strict.clone()).is_err(),
            "k8s-openapi rejects it (the reason for this module)"
        );
        let svc: Service = decode(strict).expect("readable");
        assert_eq!(svc.metadata.resource_version.as_deref(), Some("42"));
        assert_eq!(svc.metadata.managed_fields, None);
        assert!(
            svc.metadata
                .annotations
                .as_ref()
                .is_none_or(|a| a.is_empty())
        );
        assert_eq!(
            svc.metadata.labels.as_ref().unwrap().len(),
            1,
            "null label dropped"
        );
        let spec = svc.spec.as_ref().unwrap();
        assert_eq!(spec.ports.as_ref().unwrap()[0].port, 80);
        assert_eq!(spec.selector, None);
        let status = svc.status.as_ref().unwrap();
        assert_eq!(status.conditions, None);
        let ingress = status
            .load_balancer
            .as_ref()
            .unwrap()
            .ingress
            .as_ref()
            .unwrap();
        assert_eq!(ingress.len(), 2, "the null entry is dropped");
        assert_eq!(ingress[0].ip.as_deref(), Some("198.51.100.1"));
        assert_eq!(ingress[0].ports, None);
        assert_eq!(ingress[1].hostname, None, "hostname is never read");
    }

    #[test]
    fn an_unreadable_object_names_itself_and_the_field() {
        let bad = service(json!({"ports": "80"}), Value::Null);
        let err = decode::<Service>(bad).unwrap_err();
        assert_eq!(err.meta.name.as_deref(), Some("web"));
        assert_eq!(err.meta.namespace.as_deref(), Some("shop"));
        assert_eq!(err.meta.resource_version.as_deref(), Some("42"));
        assert_eq!(err.field, "spec.ports");
        assert!(err.reason.contains("invalid type"), "{err}");

        let bad = service(
            json!({"ports": [{"port": 80}, {"port": "http"}]}),
            Value::Null,
        );
        let err = decode::<Service>(bad).unwrap_err();
        assert_eq!(err.field, "spec.ports[1].port", "{err}");

        // Not even an object: still a value the watcher can hand over.
        let err = decode::<Service>(json!("nonsense")).unwrap_err();
        assert_eq!((err.meta.name, err.field.as_str()), (None, "."));
    }

    #[test]
    fn slices_keep_what_they_need() {
        let slice: EndpointSlice = decode(json!({
            "metadata": {"name": "web-1", "resourceVersion": "7",
                         "annotations": {TRIGGER_TIME: "2024-01-01T00:00:00Z", "other": "x"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1", null], "conditions": {"ready": null, "serving": true},
                           "targetRef": {"kind": 5}, "deprecatedTopology": null}, null],
            "ports": null,
        }))
        .expect("readable");
        let annotations = slice.metadata.annotations.unwrap();
        assert_eq!(annotations.keys().collect::<Vec<_>>(), [TRIGGER_TIME]);
        assert_eq!(slice.endpoints.len(), 1);
        let e = &slice.endpoints[0];
        assert_eq!(e.addresses, ["10.0.0.1"]);
        assert_eq!(e.conditions.as_ref().unwrap().ready, None);
        assert_eq!(e.target_ref, None);
        assert_eq!(slice.ports, None);
    }

    #[test]
    fn nodes_keep_labels_and_taints_only() {
        let node: Node = decode(json!({
            "metadata": {"name": "n1", "resourceVersion": "3", "labels": {"topology.kubernetes.io/zone": "a"}},
            "spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule", "timeAdded": null}]},
            "status": {"images": [{"names": ["x"], "sizeBytes": 1}],
                       "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": null}]},
        }))
        .expect("readable");
        assert_eq!(node.status, None);
        let taints = node.spec.unwrap().taints.unwrap();
        assert_eq!(taints[0].key, "ToBeDeletedByClusterAutoscaler");
    }

    #[test]
    fn a_watch_line_with_an_unreadable_object_still_decodes() {
        // kube-rs decodes each watch line as a WatchEvent (adjacently tagged: the object
        // may come before its type and is then buffered).
        let line = r#"{"object":{"metadata":{"name":"a","resourceVersion":"9"},"spec":{"ports":"x"}},"type":"MODIFIED"}"#;
        let event: kube::core::WatchEvent<Lenient<Service>> = serde_json::from_str(line).unwrap();
        let kube::core::WatchEvent::Modified(Lenient(Err(err))) = event else {
            panic!("expected an unreadable Modified");
        };
        assert_eq!(err.field, "spec.ports");
        let list = r#"{"metadata":{"resourceVersion":"9"},"items":[
            {"metadata":{"name":"a"},"spec":{"ports":"x"}},
            {"metadata":{"name":"b"},"status":{"conditions":[{"lastTransitionTime":null}]}}]}"#;
        let list: kube::core::ObjectList<Lenient<Service>> = serde_json::from_str(list).unwrap();
        assert!(list.items[0].0.is_err() && list.items[1].0.is_ok());
    }

    #[test]
    fn lean_objects_decode_from_list_pages_and_watch_lines() {
        let list = r#"{"metadata":{"resourceVersion":"9"},"items":[
            {"metadata":{"name":"a","resourceVersion":"3"},"spec":{"ports":"x"}},
            {"metadata":{"name":"b","resourceVersion":"4"},"spec":{"ports":[null,{"port":80}]}},
            {"metadata":{"name":"c","resourceVersion":"5"},"spec":{"ports":[{"port":81}]}}]}"#;
        let list: kube::core::ObjectList<Lean<Service>> = serde_json::from_str(list).unwrap();
        let err = list.items[0].object.as_ref().unwrap_err();
        assert_eq!(
            (
                err.field.as_str(),
                list.items[0].meta.resource_version.as_deref()
            ),
            ("spec.ports", Some("3"))
        );
        // Read the lenient way (a null in a list), and the fast way.
        for (item, port) in list.items[1..].iter().zip([80, 81]) {
            let svc = item.object.as_ref().unwrap().as_ref().unwrap();
            assert_eq!(svc.spec.as_ref().unwrap().ports[0].port, port);
            assert!(item.meta.resource_version.is_some());
        }
        let line = r#"{"type":"MODIFIED","object":{"metadata":{"name":"s","resourceVersion":"9"},"addressType":"IPv4","endpoints":[{"addresses":["10.0.0.1"]}]}}"#;
        let event: kube::core::WatchEvent<Lean<EndpointSlice>> =
            serde_json::from_str(line).unwrap();
        let kube::core::WatchEvent::Modified(Lean {
            meta,
            object: Ok(Some(slice)),
        }) = event
        else {
            panic!("expected a readable Modified");
        };
        assert_eq!(
            (meta.resource_version.as_deref(), slice.endpoints.len()),
            (Some("9"), 1)
        );
    }
}
