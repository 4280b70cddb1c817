//! Who routes Services, which IP families are rendered, and how the agent reaches the API
//! server: pure decisions from the Network, the shoot and ferry's providerConfig.
//!
//! Gardener's contract (`docs/extensions/resources/network.md`, "Supporting
//! kube-proxy-less Service Routing"): the extension checks whether kube-proxy or it routes
//! Services, and raises an error when it should but cannot.

use crate::{
    config::NetworkConfig,
    types::{ApiServerAddress, IpFamily, NETWORK_TYPE, Network, Shoot},
};

/// Who routes Services in the shoot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServiceRouting {
    /// kube-proxy is disabled: ferry routes Services and removes kube-proxy's leftover rules.
    Ferry,
    /// kube-proxy runs: ferry wires pods only.
    KubeProxy,
}

impl ServiceRouting {
    /// As reported in the provider status.
    pub fn as_str(self) -> &'static str {
        match self {
            ServiceRouting::Ferry => "ferry",
            ServiceRouting::KubeProxy => "kube-proxy",
        }
    }
}

/// What to render and report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub service_routing: ServiceRouting,
    /// The families rendered, and so reported in `status.ipFamilies`: the spec's, except
    /// during a migration to dual-stack while the nodes have not all got their second pod
    /// CIDR (then the first family only).
    pub ip_families: Vec<IpFamily>,
    /// Where the agent reaches the API server without ClusterIPs (the shoot's `external`
    /// advertised address); `None` only when kube-proxy runs and the shoot has none yet.
    pub api_server: Option<ApiServerAddress>,
}

/// Why a Network cannot be reconciled.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecideError {
    /// Will never work until the shoot or the Network changes (`ERR_CONFIGURATION_PROBLEM`).
    #[error("{0}")]
    Configuration(String),
    /// May work later, when gardenlet has written more of the shoot.
    #[error("{0}")]
    NotYet(String),
}

/// Decides how ferry is rendered for `network` in `shoot` with `config`.
pub fn decide(
    network: &Network,
    shoot: &Shoot,
    config: &NetworkConfig,
) -> Result<Decision, DecideError> {
    use DecideError::{Configuration, NotYet};
    if network.spec.type_ != NETWORK_TYPE {
        return Err(Configuration(format!(
            "spec.type: {:?} is not {NETWORK_TYPE:?}",
            network.spec.type_
        )));
    }
    let spec_families = spec_families(network)?;

    let service_routing = if shoot.kube_proxy_enabled() {
        ServiceRouting::KubeProxy
    } else if config.service_routing {
        ServiceRouting::Ferry
    } else {
        return Err(Configuration(
            "kube-proxy is disabled (shoot spec.kubernetes.kubeProxy.enabled) and ferry's \
             Service routing is off (providerConfig.serviceRouting.enabled: false): nothing would \
             route Services; enable one of them"
                .to_string(),
        ));
    };

    let ip_families = if spec_families.len() > 1 && shoot.dual_stack_nodes_pending() {
        spec_families[..1].to_vec()
    } else {
        spec_families
    };

    let api_server = shoot.external_api_server();
    if api_server.is_none() && service_routing == ServiceRouting::Ferry {
        return Err(NotYet(
            "the shoot has no `external` advertised address yet (status.advertisedAddresses): \
             without kube-proxy, ferry's agent needs it to reach the API server"
                .to_string(),
        ));
    }

    Ok(Decision {
        service_routing,
        ip_families,
        api_server,
    })
}

/// `spec.ipFamilies`, `[IPv4]` when empty; one or two distinct families.
fn spec_families(network: &Network) -> Result<Vec<IpFamily>, DecideError> {
    let families = &network.spec.ip_families;
    match families.as_slice() {
        [] => Ok(vec![IpFamily::IPv4]),
        [_] => Ok(families.clone()),
        [a, b] if a != b => Ok(families.clone()),
        _ => Err(DecideError::Configuration(format!(
            "spec.ipFamilies: {families:?} is not one family or two distinct ones"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Cluster;
    use serde_json::{Value, json};

    fn network(families: Value) -> Network {
        serde_json::from_value(json!({
            "metadata": {"name": "bar", "namespace": "shoot--foo--bar"},
            "spec": {"type": "ferry", "podCIDR": "10.244.0.0/16", "serviceCIDR": "10.96.0.0/12",
                     "ipFamilies": families}
        }))
        .unwrap()
    }

    fn shoot(kube_proxy: bool, status: Value) -> Shoot {
        let c: Cluster = serde_json::from_value(json!({
            "metadata": {"name": "shoot--foo--bar"},
            "spec": {"shoot": {
                "spec": {"kubernetes": {"kubeProxy": {"enabled": kube_proxy, "mode": "IPTables"}}},
                "status": status
            }}
        }))
        .unwrap();
        c.shoot().unwrap()
    }

    fn external() -> Value {
        json!({"advertisedAddresses": [{"name": "external", "url": "https://api.bar.foo.example.com"}]})
    }

    fn api() -> Option<ApiServerAddress> {
        Some(ApiServerAddress {
            host: "api.bar.foo.example.com".into(),
            port: 443,
        })
    }

    #[test]
    fn kube_proxy_disabled_ferry_routes_services() {
        let d = decide(
            &network(json!(["IPv4"])),
            &shoot(false, external()),
            &NetworkConfig::default(),
        );
        assert_eq!(
            d,
            Ok(Decision {
                service_routing: ServiceRouting::Ferry,
                ip_families: vec![IpFamily::IPv4],
                api_server: api(),
            })
        );
    }

    #[test]
    fn kube_proxy_enabled_ferry_wires_pods_only() {
        let d = decide(
            &network(json!([])),
            &shoot(true, json!({})),
            &NetworkConfig::default(),
        )
        .unwrap();
        assert_eq!(d.service_routing, ServiceRouting::KubeProxy);
        assert_eq!(d.ip_families, [IpFamily::IPv4]);
        assert_eq!(d.api_server, None);
        // Service routing switched off is fine while kube-proxy runs.
        let off = NetworkConfig {
            service_routing: false,
            ..NetworkConfig::default()
        };
        let d = decide(&network(json!([])), &shoot(true, external()), &off).unwrap();
        assert_eq!(d.service_routing, ServiceRouting::KubeProxy);
        assert_eq!(d.api_server, api());
    }

    #[test]
    fn nobody_routing_services_is_a_configuration_problem() {
        let off = NetworkConfig {
            service_routing: false,
            ..NetworkConfig::default()
        };
        let e = decide(&network(json!(["IPv4"])), &shoot(false, external()), &off).unwrap_err();
        let DecideError::Configuration(m) = e else {
            panic!("expected a configuration problem, got {e:?}")
        };
        assert!(m.contains("nothing would route Services"), "{m}");
    }

    #[test]
    fn without_kube_proxy_the_api_server_address_must_be_known() {
        let e = decide(
            &network(json!(["IPv4"])),
            &shoot(false, json!({})),
            &NetworkConfig::default(),
        );
        assert!(
            matches!(e, Err(DecideError::NotYet(ref m)) if m.contains("`external` advertised address")),
            "{e:?}"
        );
    }

    #[test]
    fn ip_families_single_dual_and_migration() {
        let cfg = NetworkConfig::default();
        let families = |spec: Value, status: Value| {
            decide(&network(spec), &shoot(false, status), &cfg).map(|d| d.ip_families)
        };
        let with_constraint = |s: &str| {
            let mut st = external();
            st["constraints"] = json!([{"type": "DualStackNodesMigrationReady", "status": s}]);
            st
        };
        use IpFamily::{IPv4, IPv6};
        assert_eq!(families(json!(["IPv6"]), external()), Ok(vec![IPv6]));
        assert_eq!(
            families(json!(["IPv4", "IPv6"]), external()),
            Ok(vec![IPv4, IPv6])
        );
        assert_eq!(
            families(json!(["IPv6", "IPv4"]), external()),
            Ok(vec![IPv6, IPv4])
        );
        // Migration [IPv4] -> [IPv4, IPv6]: single-stack until every node has both pod
        // CIDRs (gardenlet sets the constraint True), then dual-stack, which gardenlet
        // sees in status.ipFamilies and removes the constraint.
        assert_eq!(
            families(json!(["IPv4", "IPv6"]), with_constraint("Progressing")),
            Ok(vec![IPv4])
        );
        assert_eq!(
            families(json!(["IPv4", "IPv6"]), with_constraint("True")),
            Ok(vec![IPv4, IPv6])
        );
        // And back to [IPv4].
        assert_eq!(
            families(json!(["IPv4"]), with_constraint("Progressing")),
            Ok(vec![IPv4])
        );
        let e = families(json!(["IPv4", "IPv4"]), external()).unwrap_err();
        assert_eq!(
            e,
            DecideError::Configuration(
                "spec.ipFamilies: [IPv4, IPv4] is not one family or two distinct ones".into()
            )
        );
    }

    #[test]
    fn another_type_is_refused() {
        let mut n = network(json!([]));
        n.spec.type_ = "calico".into();
        let e = decide(&n, &shoot(true, json!({})), &NetworkConfig::default()).unwrap_err();
        assert_eq!(
            e,
            DecideError::Configuration("spec.type: \"calico\" is not \"ferry\"".into())
        );
    }
}
