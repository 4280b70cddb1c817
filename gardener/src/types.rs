//! What the extension reads from and writes to the seed, as serde types: the `Network` it
//! serves, the `Cluster` that carries the shoot, and the parts of the shoot (Gardener's
//! `core.gardener.cloud/v1beta1`) that decide how ferry is rendered.
//!
//! Only the fields the extension uses are declared; every other field is ignored, so a
//! newer Gardener that adds fields decodes the same way.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::core::{ApiResource, GroupVersionKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The `spec.type` this extension serves.
pub const NETWORK_TYPE: &str = "ferry";

/// The annotation gardenlet sets to ask for an operation.
pub const OPERATION_ANNOTATION: &str = "gardener.cloud/operation";

/// `extensions.gardener.cloud/v1alpha1` `Network` (namespaced, status subresource).
pub fn network_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("extensions.gardener.cloud", "v1alpha1", "Network"),
        "networks",
    )
}

/// `extensions.gardener.cloud/v1alpha1` `Cluster` (cluster-scoped, named after the
/// shoot's control-plane namespace).
pub fn cluster_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("extensions.gardener.cloud", "v1alpha1", "Cluster"),
        "clusters",
    )
}

/// `resources.gardener.cloud/v1alpha1` `ManagedResource` (namespaced).
pub fn managed_resource_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("resources.gardener.cloud", "v1alpha1", "ManagedResource"),
        "managedresources",
    )
}

/// An IP family as Gardener spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum IpFamily {
    IPv4,
    IPv6,
}

impl std::fmt::Display for IpFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IpFamily::IPv4 => "IPv4",
            IpFamily::IPv6 => "IPv6",
        })
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Network {
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: NetworkSpec,
    #[serde(default)]
    pub status: NetworkStatus,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkSpec {
    #[serde(rename = "type")]
    pub type_: String,
    /// `garden`, `seed` or `shoot`; unset means `shoot`.
    #[serde(default)]
    pub class: Option<String>,
    /// ferry's `NetworkConfig`, undecoded (see `config.rs`).
    #[serde(default)]
    pub provider_config: Option<Value>,
    #[serde(default, rename = "podCIDR")]
    pub pod_cidr: String,
    #[serde(default, rename = "serviceCIDR")]
    pub service_cidr: String,
    /// Empty means `[IPv4]` (Gardener's default).
    #[serde(default)]
    pub ip_families: Vec<IpFamily>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkStatus {
    #[serde(default)]
    pub last_operation: Option<LastOperation>,
    #[serde(default)]
    pub last_error: Option<LastError>,
    #[serde(default)]
    pub observed_generation: Option<i64>,
    #[serde(default)]
    pub ip_families: Vec<IpFamily>,
    #[serde(default)]
    pub provider_status: Option<Value>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LastOperationType {
    Create,
    Reconcile,
    Delete,
    Migrate,
    Restore,
    LiveMigrate,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LastOperationState {
    Processing,
    Succeeded,
    /// Failed, will be retried.
    Error,
    /// Failed, will not be retried.
    Failed,
    Pending,
    Aborted,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LastOperation {
    pub description: String,
    pub last_update_time: Time,
    pub progress: i32,
    pub state: LastOperationState,
    #[serde(rename = "type")]
    pub type_: LastOperationType,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LastError {
    pub description: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub codes: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_update_time: Option<Time>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct Cluster {
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: ClusterSpec,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct ClusterSpec {
    /// The shoot as `core.gardener.cloud/v1beta1`, undecoded.
    #[serde(default)]
    pub shoot: Value,
}

/// A Cluster whose shoot does not decode.
#[derive(Debug, thiserror::Error)]
#[error("Cluster {cluster}: spec.shoot.{path}: {message}")]
pub struct ShootDecodeError {
    pub cluster: String,
    pub path: String,
    pub message: String,
}

impl Cluster {
    /// The shoot carried in `spec.shoot`.
    pub fn shoot(&self) -> Result<Shoot, ShootDecodeError> {
        serde_path_to_error::deserialize(&self.spec.shoot).map_err(|e| ShootDecodeError {
            cluster: self.metadata.name.clone().unwrap_or_default(),
            path: e.path().to_string(),
            message: e.inner().to_string(),
        })
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct Shoot {
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: ShootSpec,
    #[serde(default)]
    pub status: ShootStatus,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct ShootSpec {
    #[serde(default)]
    pub kubernetes: Kubernetes,
    #[serde(default)]
    pub networking: Option<ShootNetworking>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Kubernetes {
    #[serde(default)]
    pub version: String,
    #[serde(default)]
    pub kube_proxy: Option<KubeProxyConfig>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct KubeProxyConfig {
    #[serde(default)]
    pub enabled: Option<bool>,
    /// `IPTables`, `NFTables` or `IPVS`.
    #[serde(default)]
    pub mode: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShootNetworking {
    #[serde(default, rename = "type")]
    pub type_: Option<String>,
    #[serde(default)]
    pub pods: Option<String>,
    #[serde(default)]
    pub services: Option<String>,
    #[serde(default)]
    pub nodes: Option<String>,
    #[serde(default)]
    pub ip_families: Vec<IpFamily>,
    #[serde(default)]
    pub provider_config: Option<Value>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShootStatus {
    /// All pod, service and node ranges (two of each in dual-stack).
    #[serde(default)]
    pub networking: Option<NetworkingStatus>,
    #[serde(default)]
    pub advertised_addresses: Vec<AdvertisedAddress>,
    #[serde(default)]
    pub constraints: Vec<Condition>,
    #[serde(default)]
    pub last_operation: Option<ShootLastOperation>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct NetworkingStatus {
    #[serde(default)]
    pub pods: Vec<String>,
    #[serde(default)]
    pub services: Vec<String>,
    #[serde(default)]
    pub nodes: Vec<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct AdvertisedAddress {
    pub name: String,
    pub url: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    #[serde(default)]
    pub status: String,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct ShootLastOperation {
    #[serde(default, rename = "type")]
    pub type_: String,
    #[serde(default)]
    pub state: String,
}

/// An address and port to reach the shoot's API server from a node without ClusterIPs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiServerAddress {
    pub host: String,
    pub port: u16,
}

impl Shoot {
    /// Whether gardenlet runs kube-proxy in this shoot. Gardener's own helper
    /// (`KubeProxyEnabled`) asks for an explicit `true`; defaulting sets it for every shoot
    /// with workers, so a missing value is a workerless shoot, which has no kube-proxy.
    pub fn kube_proxy_enabled(&self) -> bool {
        self.spec
            .kubernetes
            .kube_proxy
            .as_ref()
            .and_then(|k| k.enabled)
            == Some(true)
    }

    /// The shoot's last operation failed: Gardener does not retry it, and neither do
    /// extensions.
    pub fn is_failed(&self) -> bool {
        self.status
            .last_operation
            .as_ref()
            .is_some_and(|op| op.state == "Failed")
    }

    /// The constraint gardenlet keeps while nodes move to dual-stack pod CIDRs exists and
    /// is not `True`: render the first family only until it is.
    pub fn dual_stack_nodes_pending(&self) -> bool {
        self.status
            .constraints
            .iter()
            .any(|c| c.type_ == "DualStackNodesMigrationReady" && c.status != "True")
    }

    /// The `external` advertised address (the API server's public domain), as host and
    /// port; the port is 443 unless the URL names one.
    pub fn external_api_server(&self) -> Option<ApiServerAddress> {
        let url = &self
            .status
            .advertised_addresses
            .iter()
            .find(|a| a.name == "external")?
            .url;
        parse_host_port(url)
    }
}

/// `https://host[:port][/path]` as host and port (443 by default). IPv6 literals keep
/// their brackets off.
fn parse_host_port(url: &str) -> Option<ApiServerAddress> {
    let rest = url.strip_prefix("https://").unwrap_or(url);
    let authority = rest.split('/').next()?;
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6.split_once(']')?;
        (host, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let port = match port {
        Some(p) => p.parse().ok()?,
        None => 443,
    };
    (!host.is_empty()).then(|| ApiServerAddress {
        host: host.to_string(),
        port,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cluster(shoot: Value) -> Cluster {
        serde_json::from_value(json!({
            "apiVersion": "extensions.gardener.cloud/v1alpha1",
            "kind": "Cluster",
            "metadata": {"name": "shoot--foo--bar"},
            "spec": {"cloudProfile": {}, "seed": {}, "shoot": shoot}
        }))
        .unwrap()
    }

    #[test]
    fn decodes_the_shoot_parts_the_extension_uses() {
        let c = cluster(json!({
            "apiVersion": "core.gardener.cloud/v1beta1",
            "kind": "Shoot",
            "metadata": {"name": "bar", "namespace": "garden-foo"},
            "spec": {
                "kubernetes": {"version": "1.33.2", "kubeProxy": {"enabled": false, "mode": "IPTables"}},
                "networking": {
                    "type": "ferry", "pods": "10.244.0.0/16", "services": "10.96.0.0/12",
                    "nodes": "10.250.0.0/16", "ipFamilies": ["IPv4", "IPv6"],
                    "providerConfig": {"kind": "NetworkConfig"}
                },
                "provider": {"type": "local", "workers": [{"name": "w"}]}
            },
            "status": {
                "networking": {
                    "pods": ["10.244.0.0/16", "fd00:10:244::/56"],
                    "services": ["10.96.0.0/12", "fd00:10:96::/112"],
                    "nodes": ["10.250.0.0/16", "fd00:10:250::/64"]
                },
                "advertisedAddresses": [
                    {"name": "internal", "url": "https://api.bar.foo.internal.example.com"},
                    {"name": "external", "url": "https://api.bar.foo.example.com"}
                ],
                "constraints": [{"type": "DualStackNodesMigrationReady", "status": "Progressing"}],
                "lastOperation": {"type": "Reconcile", "state": "Processing"}
            }
        }));
        let shoot = c.shoot().unwrap();
        assert_eq!(shoot.spec.kubernetes.version, "1.33.2");
        assert!(!shoot.kube_proxy_enabled());
        let net = shoot.spec.networking.as_ref().unwrap();
        assert_eq!(net.type_.as_deref(), Some("ferry"));
        assert_eq!(net.ip_families, [IpFamily::IPv4, IpFamily::IPv6]);
        assert_eq!(net.nodes.as_deref(), Some("10.250.0.0/16"));
        let status = shoot.status.networking.as_ref().unwrap();
        assert_eq!(status.pods, ["10.244.0.0/16", "fd00:10:244::/56"]);
        assert_eq!(status.services.len(), 2);
        assert!(shoot.dual_stack_nodes_pending());
        assert!(!shoot.is_failed());
        assert_eq!(
            shoot.external_api_server(),
            Some(ApiServerAddress {
                host: "api.bar.foo.example.com".into(),
                port: 443
            })
        );
    }

    #[test]
    fn kube_proxy_is_enabled_only_when_the_shoot_says_true() {
        for (kube_proxy, enabled) in [
            (json!({"enabled": true, "mode": "IPTables"}), true),
            (json!({"enabled": false}), false),
            (json!({"mode": "IPVS"}), false),
        ] {
            let c = cluster(json!({"spec": {"kubernetes": {"kubeProxy": kube_proxy}}}));
            assert_eq!(
                c.shoot().unwrap().kube_proxy_enabled(),
                enabled,
                "{kube_proxy}"
            );
        }
        let c = cluster(json!({"spec": {"kubernetes": {}}}));
        assert!(!c.shoot().unwrap().kube_proxy_enabled());
    }

    #[test]
    fn a_shoot_that_does_not_decode_names_the_cluster_and_the_field() {
        let c = cluster(json!({"spec": {"kubernetes": {"kubeProxy": {"enabled": "no"}}}}));
        let e = c.shoot().unwrap_err().to_string();
        assert!(
            e.starts_with("Cluster shoot--foo--bar: spec.shoot.spec.kubernetes.kubeProxy.enabled: invalid type"),
            "{e}"
        );
        let c = cluster(json!({"spec": {"networking": {"ipFamilies": ["IPv5"]}}}));
        let e = c.shoot().unwrap_err().to_string();
        assert!(
            e.contains("spec.shoot.spec.networking.ipFamilies[0]: unknown variant `IPv5`"),
            "{e}"
        );
    }

    #[test]
    fn advertised_address_host_and_port() {
        let p = |u| parse_host_port(u).map(|a| (a.host, a.port));
        assert_eq!(
            p("https://api.example.com"),
            Some(("api.example.com".into(), 443))
        );
        assert_eq!(
            p("https://api.example.com:8443/x"),
            Some(("api.example.com".into(), 8443))
        );
        assert_eq!(p("https://[fd00::1]:6443"), Some(("fd00::1".into(), 6443)));
        assert_eq!(p("https://[fd00::1]"), Some(("fd00::1".into(), 443)));
        assert_eq!(p("https://:443"), None);
        assert_eq!(p("https://api.example.com:http"), None);
    }

    #[test]
    fn decodes_a_network_and_its_status() {
        let n: Network = serde_json::from_value(json!({
            "metadata": {"name": "bar", "namespace": "shoot--foo--bar", "generation": 3},
            "spec": {
                "type": "ferry", "podCIDR": "10.244.0.0/16", "serviceCIDR": "10.96.0.0/12",
                "ipFamilies": ["IPv4"], "providerConfig": {"kind": "NetworkConfig"}, "extra": 1
            },
            "status": {
                "lastOperation": {"description": "x", "lastUpdateTime": "2026-01-02T03:04:05Z",
                                  "progress": 100, "state": "Succeeded", "type": "Reconcile"},
                "observedGeneration": 3, "ipFamilies": ["IPv4"]
            }
        }))
        .unwrap();
        assert_eq!(n.spec.type_, NETWORK_TYPE);
        assert_eq!(n.spec.pod_cidr, "10.244.0.0/16");
        assert_eq!(n.spec.class, None);
        let op = n.status.last_operation.unwrap();
        assert_eq!(op.state, LastOperationState::Succeeded);
        assert_eq!(op.type_, LastOperationType::Reconcile);
        assert_eq!(n.status.observed_generation, Some(3));
    }
}
