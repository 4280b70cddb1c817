//! ferry's `providerConfig`: kind `NetworkConfig` of
//! `ferry.networking.extensions.gardener.cloud/v1alpha1`, decoded strictly (an unknown
//! field is an error, so a typo never passes silently) and validated. Every error names
//! the field by its path under `providerConfig`.

use serde::Deserialize;
use serde_json::Value;

pub const API_VERSION: &str = "ferry.networking.extensions.gardener.cloud/v1alpha1";
pub const KIND: &str = "NetworkConfig";

/// The smallest MTU IPv6 allows, and the common jumbo-frame size.
pub const MTU_RANGE: std::ops::RangeInclusive<u32> = 1280..=9000;
/// The agent's map capacity limit (`--max-services`, `--max-backends`).
pub const CAPACITY_RANGE: std::ops::RangeInclusive<u32> = 1..=(1 << 24);

/// The decoded providerConfig, with defaults applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkConfig {
    /// VXLAN between nodes (default off: routes to other nodes' pod CIDRs).
    pub overlay: bool,
    /// Source NAT of pod traffic that leaves the cluster (default on).
    pub masquerade: bool,
    /// ferry routes Services when kube-proxy is disabled (default on).
    pub service_routing: bool,
    pub max_services: Option<u32>,
    pub max_endpoints: Option<u32>,
    pub mtu: Option<u32>,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        NetworkConfig {
            overlay: false,
            masquerade: true,
            service_routing: true,
            max_services: None,
            max_endpoints: None,
            mtu: None,
        }
    }
}

/// A providerConfig that will never work: reported with `ERR_CONFIGURATION_PROBLEM`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("providerConfig{path}: {message}")]
pub struct ConfigError {
    /// `.field.sub`, or empty for the whole object.
    pub path: String,
    pub message: String,
}

impl ConfigError {
    fn at(path: &str, message: impl Into<String>) -> Self {
        ConfigError {
            path: path.to_string(),
            message: message.into(),
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Raw {
    api_version: String,
    kind: String,
    #[serde(default)]
    overlay: Option<Switch>,
    #[serde(default)]
    masquerade: Option<Switch>,
    #[serde(default)]
    service_routing: Option<Switch>,
    #[serde(default)]
    max_services: Option<u32>,
    #[serde(default)]
    max_endpoints: Option<u32>,
    #[serde(default)]
    mtu: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Switch {
    enabled: bool,
}

/// Decodes and validates `spec.providerConfig`; none at all means the defaults.
pub fn parse(provider_config: Option<&Value>) -> Result<NetworkConfig, ConfigError> {
    let Some(value) = provider_config.filter(|v| !v.is_null()) else {
        return Ok(NetworkConfig::default());
    };
    let raw: Raw = serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." {
            String::new()
        } else {
            format!(".{path}")
        };
        ConfigError::at(&path, e.inner().to_string())
    })?;
    if raw.api_version != API_VERSION {
        return Err(ConfigError::at(
            ".apiVersion",
            format!("{:?} is not {API_VERSION:?}", raw.api_version),
        ));
    }
    if raw.kind != KIND {
        return Err(ConfigError::at(
            ".kind",
            format!("{:?} is not {KIND:?}", raw.kind),
        ));
    }
    let in_range = |path: &str, v: Option<u32>, range: &std::ops::RangeInclusive<u32>| match v {
        Some(n) if !range.contains(&n) => Err(ConfigError::at(
            path,
            format!("{n} is out of range {}..={}", range.start(), range.end()),
        )),
        _ => Ok(v),
    };
    let defaults = NetworkConfig::default();
    Ok(NetworkConfig {
        overlay: raw.overlay.map_or(defaults.overlay, |s| s.enabled),
        masquerade: raw.masquerade.map_or(defaults.masquerade, |s| s.enabled),
        service_routing: raw
            .service_routing
            .map_or(defaults.service_routing, |s| s.enabled),
        max_services: in_range(".maxServices", raw.max_services, &CAPACITY_RANGE)?,
        max_endpoints: in_range(".maxEndpoints", raw.max_endpoints, &CAPACITY_RANGE)?,
        mtu: in_range(".mtu", raw.mtu, &MTU_RANGE)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn with(fields: Value) -> Value {
        let mut v = json!({"apiVersion": API_VERSION, "kind": KIND});
        v.as_object_mut()
            .unwrap()
            .extend(fields.as_object().unwrap().clone());
        v
    }

    fn err(v: Value) -> String {
        parse(Some(&v)).unwrap_err().to_string()
    }

    #[test]
    fn no_provider_config_is_the_defaults() {
        let d = NetworkConfig::default();
        assert_eq!(parse(None), Ok(d.clone()));
        assert_eq!(parse(Some(&Value::Null)), Ok(d.clone()));
        assert_eq!(parse(Some(&with(json!({})))), Ok(d.clone()));
        assert!(!d.overlay && d.masquerade && d.service_routing);
    }

    #[test]
    fn every_field_decodes() {
        let c = parse(Some(&with(json!({
            "overlay": {"enabled": true},
            "masquerade": {"enabled": false},
            "serviceRouting": {"enabled": false},
            "maxServices": 1000,
            "maxEndpoints": 5000,
            "mtu": 1450
        }))))
        .unwrap();
        assert_eq!(
            c,
            NetworkConfig {
                overlay: true,
                masquerade: false,
                service_routing: false,
                max_services: Some(1000),
                max_endpoints: Some(5000),
                mtu: Some(1450),
            }
        );
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(
            err(with(json!({"mtu": 70000}))),
            "providerConfig.mtu: 70000 is out of range 1280..=9000"
        );
        assert_eq!(
            err(with(json!({"maxServices": 0}))),
            "providerConfig.maxServices: 0 is out of range 1..=16777216"
        );
        assert_eq!(
            err(with(json!({"maxEndpoints": 16777217}))),
            "providerConfig.maxEndpoints: 16777217 is out of range 1..=16777216"
        );
        let e = err(with(json!({"overlay": {"enabled": true, "mode": "vxlan"}})));
        assert!(
            e.starts_with("providerConfig.overlay.mode: unknown field `mode`"),
            "{e}"
        );
        let e = err(with(json!({"masquerade": {"enabled": "yes"}})));
        assert!(
            e.starts_with("providerConfig.masquerade.enabled: invalid type"),
            "{e}"
        );
        let e = err(with(json!({"overlay": {}})));
        assert!(
            e.starts_with("providerConfig.overlay: missing field `enabled`"),
            "{e}"
        );
        let e = err(with(json!({"ebpfDataplane": {"enabled": true}})));
        assert!(
            e.starts_with("providerConfig.ebpfDataplane: unknown field `ebpfDataplane`"),
            "{e}"
        );
        let e = err(with(json!({"mtu": -1})));
        assert!(
            e.starts_with("providerConfig.mtu: invalid value: integer `-1`"),
            "{e}"
        );
    }

    #[test]
    fn wrong_api_version_or_kind_is_an_error() {
        assert_eq!(
            err(
                json!({"apiVersion": "calico.networking.extensions.gardener.cloud/v1alpha1", "kind": KIND})
            ),
            "providerConfig.apiVersion: \"calico.networking.extensions.gardener.cloud/v1alpha1\" is not \
             \"ferry.networking.extensions.gardener.cloud/v1alpha1\""
        );
        assert_eq!(
            err(json!({"apiVersion": API_VERSION, "kind": "NetworkStatus"})),
            "providerConfig.kind: \"NetworkStatus\" is not \"NetworkConfig\""
        );
        let e = err(json!({"kind": KIND}));
        assert!(
            e.starts_with("providerConfig: missing field `apiVersion`"),
            "{e}"
        );
        let e = err(json!("overlay"));
        assert!(e.starts_with("providerConfig: invalid type: string"), "{e}");
    }
}
