//! The snapshot of Kubernetes objects a source hands to the model.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// The namespace of an object whose `metadata.namespace` is unset, as in Kubernetes.
pub const DEFAULT_NAMESPACE: &str = "default";

/// Identifies a namespaced object of a given kind; displays as `namespace/name`.
/// The names are shared (`Arc<str>`): a key is copied into several tables (the store,
/// each Service's slices, dirty sets, the synced set), and a copy allocates nothing.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl ObjectKey {
    pub fn new(namespace: impl Into<Arc<str>>, name: impl Into<Arc<str>>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// The key of an object's metadata, `None` when it has no name.
    /// A missing (or empty) namespace means [`DEFAULT_NAMESPACE`].
    pub fn from_meta(meta: &ObjectMeta) -> Option<Self> {
        let name = meta.name.as_deref().filter(|n| !n.is_empty())?;
        let namespace = meta
            .namespace
            .as_deref()
            .filter(|ns| !ns.is_empty())
            .unwrap_or(DEFAULT_NAMESPACE);
        Some(Self::new(namespace, name))
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Every Service and EndpointSlice a source currently knows, keyed by namespace/name.
///
/// Objects stored here always have `metadata.namespace` set (defaulted when absent),
/// so consumers never need to repeat the defaulting.
#[derive(Clone, Default, Debug, PartialEq)]
pub struct Objects {
    pub services: BTreeMap<ObjectKey, Service>,
    pub slices: BTreeMap<ObjectKey, EndpointSlice>,
    /// Nodes by name (cluster-scoped), for the pod network.
    pub nodes: BTreeMap<String, Node>,
}

impl Objects {
    /// The Services, in key order.
    pub fn services_vec(&self) -> Vec<Service> {
        self.services.values().cloned().collect()
    }

    /// The EndpointSlices, in key order.
    pub fn slices_vec(&self) -> Vec<EndpointSlice> {
        self.slices.values().cloned().collect()
    }

    pub fn is_empty(&self) -> bool {
        self.services.is_empty() && self.slices.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(namespace: Option<&str>, name: Option<&str>) -> ObjectMeta {
        ObjectMeta {
            namespace: namespace.map(str::to_owned),
            name: name.map(str::to_owned),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn key_defaults_namespace_and_displays() {
        let key = ObjectKey::from_meta(&meta(None, Some("web"))).unwrap();
        assert_eq!(key, ObjectKey::new("default", "web"));
        assert_eq!(key.to_string(), "default/web");
        let key = ObjectKey::from_meta(&meta(Some("prod"), Some("db"))).unwrap();
        assert_eq!(key.to_string(), "prod/db");
    }

    #[test]
    fn key_needs_a_name() {
        assert_eq!(ObjectKey::from_meta(&meta(Some("prod"), None)), None);
        assert_eq!(ObjectKey::from_meta(&meta(Some("prod"), Some(""))), None);
    }

    #[test]
    fn keys_order_by_namespace_then_name() {
        let mut keys = [
            ObjectKey::new("b", "a"),
            ObjectKey::new("a", "z"),
            ObjectKey::new("a", "b"),
        ];
        keys.sort();
        let shown: Vec<String> = keys.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["a/b", "a/z", "b/a"]);
    }
}
