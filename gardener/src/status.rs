//! The Network's status as a JSON merge patch for the status subresource: what gardenlet
//! waits for (`lastOperation` Succeeded, no `lastError`, `observedGeneration`), the IP
//! families actually rendered (gardenlet's dual-stack migration watches them), and ferry's
//! provider status.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};

use crate::{
    config,
    decide::Decision,
    types::{LastError, LastOperation, LastOperationState, LastOperationType},
};

/// Gardener's code for an error that retrying will not fix.
pub const ERR_CONFIGURATION_PROBLEM: &str = "ERR_CONFIGURATION_PROBLEM";

/// How an operation went.
#[derive(Clone, Debug)]
pub enum Outcome<'a> {
    /// Started.
    Processing,
    /// Done; a reconcile (create, restore) reports what it rendered.
    Succeeded(Option<&'a Rendered>),
    /// Did not work; `configuration` errors are not retried (`ERR_CONFIGURATION_PROBLEM`).
    Failed {
        description: String,
        configuration: bool,
    },
}

/// What a successful reconcile rendered, for the status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    pub decision: Decision,
    pub overlay: bool,
}

/// The operation as "…ing" and "…ed".
fn words(op: LastOperationType) -> (&'static str, &'static str) {
    match op {
        LastOperationType::Create | LastOperationType::Reconcile => ("reconciling", "reconciled"),
        LastOperationType::Delete => ("deleting", "deleted"),
        LastOperationType::Migrate | LastOperationType::LiveMigrate => ("migrating", "migrated"),
        LastOperationType::Restore => ("restoring", "restored"),
    }
}

fn description(op: LastOperationType, outcome: &Outcome<'_>) -> String {
    let (ing, ed) = words(op);
    match outcome {
        Outcome::Processing => format!("{}{} the Network", ing[..1].to_uppercase(), &ing[1..]),
        Outcome::Succeeded(Some(r)) => format!(
            "Network {ed}: ferry wires pods ({}), Services are routed by {}",
            r.decision
                .ip_families
                .iter()
                .map(|f| f.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            r.decision.service_routing.as_str()
        ),
        Outcome::Succeeded(None) => format!("Network {ed}"),
        Outcome::Failed { description, .. } => format!("Error {ing} the Network: {description}"),
    }
}

/// The merge patch `{"status": {...}}` for `outcome` of `op` on a Network at `generation`.
pub fn patch(
    op: LastOperationType,
    outcome: &Outcome<'_>,
    generation: Option<i64>,
    now: Time,
) -> Value {
    let (state, progress) = match outcome {
        Outcome::Processing => (LastOperationState::Processing, 1),
        Outcome::Succeeded(_) => (LastOperationState::Succeeded, 100),
        Outcome::Failed {
            configuration: true,
            ..
        } => (LastOperationState::Failed, 50),
        Outcome::Failed {
            configuration: false,
            ..
        } => (LastOperationState::Error, 50),
    };
    let last_operation = LastOperation {
        description: description(op, outcome),
        last_update_time: now.clone(),
        progress,
        state,
        type_: op,
    };
    let mut status = json!({"lastOperation": last_operation});
    match outcome {
        Outcome::Processing => {}
        Outcome::Succeeded(rendered) => {
            status["lastError"] = Value::Null;
            status["observedGeneration"] = json!(generation);
            if let Some(r) = rendered {
                status["ipFamilies"] = json!(r.decision.ip_families);
                status["providerStatus"] = json!({
                    "apiVersion": config::API_VERSION,
                    "kind": "NetworkStatus",
                    "serviceRouting": r.decision.service_routing.as_str(),
                    "overlay": r.overlay,
                });
            }
        }
        Outcome::Failed {
            description,
            configuration,
        } => {
            status["observedGeneration"] = json!(generation);
            status["lastError"] = json!(LastError {
                description: description.clone(),
                codes: if *configuration {
                    vec![ERR_CONFIGURATION_PROBLEM.to_string()]
                } else {
                    Vec::new()
                },
                last_update_time: Some(now),
            });
        }
    }
    json!({ "status": status })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        decide::ServiceRouting,
        types::{ApiServerAddress, IpFamily},
    };

    fn now() -> Time {
        Time("2026-01-02T03:04:05.678Z".parse().unwrap())
    }

    fn rendered(families: Vec<IpFamily>, routing: ServiceRouting) -> Rendered {
        Rendered {
            decision: Decision {
                service_routing: routing,
                ip_families: families,
                api_server: Some(ApiServerAddress {
                    host: "api".into(),
                    port: 443,
                }),
            },
            overlay: true,
        }
    }

    #[test]
    fn processing_touches_only_last_operation() {
        let p = patch(
            LastOperationType::Reconcile,
            &Outcome::Processing,
            Some(4),
            now(),
        );
        assert_eq!(
            p,
            json!({"status": {"lastOperation": {
                "description": "Reconciling the Network", "lastUpdateTime": "2026-01-02T03:04:05Z",
                "progress": 1, "state": "Processing", "type": "Reconcile"}}})
        );
        let p = patch(
            LastOperationType::Delete,
            &Outcome::Processing,
            Some(4),
            now(),
        );
        assert_eq!(
            p["status"]["lastOperation"]["description"],
            "Deleting the Network"
        );
        let p = patch(
            LastOperationType::Migrate,
            &Outcome::Processing,
            Some(4),
            now(),
        );
        assert_eq!(
            p["status"]["lastOperation"]["description"],
            "Migrating the Network"
        );
    }

    #[test]
    fn success_reports_families_routing_and_clears_the_error() {
        let r = rendered(vec![IpFamily::IPv4, IpFamily::IPv6], ServiceRouting::Ferry);
        let p = patch(
            LastOperationType::Create,
            &Outcome::Succeeded(Some(&r)),
            Some(4),
            now(),
        );
        assert_eq!(
            p,
            json!({"status": {
                "lastOperation": {
                    "description": "Network reconciled: ferry wires pods (IPv4, IPv6), Services are routed by ferry",
                    "lastUpdateTime": "2026-01-02T03:04:05Z", "progress": 100,
                    "state": "Succeeded", "type": "Create"},
                "lastError": null,
                "observedGeneration": 4,
                "ipFamilies": ["IPv4", "IPv6"],
                "providerStatus": {
                    "apiVersion": "ferry.networking.extensions.gardener.cloud/v1alpha1",
                    "kind": "NetworkStatus", "serviceRouting": "ferry", "overlay": true}
            }})
        );
        let r = rendered(vec![IpFamily::IPv4], ServiceRouting::KubeProxy);
        let p = patch(
            LastOperationType::Reconcile,
            &Outcome::Succeeded(Some(&r)),
            Some(4),
            now(),
        );
        assert_eq!(
            p["status"]["providerStatus"]["serviceRouting"],
            "kube-proxy"
        );
        assert_eq!(p["status"]["ipFamilies"], json!(["IPv4"]));
    }

    #[test]
    fn delete_success_reports_no_families() {
        let p = patch(
            LastOperationType::Delete,
            &Outcome::Succeeded(None),
            Some(4),
            now(),
        );
        let s = p["status"].as_object().unwrap();
        assert_eq!(s["lastOperation"]["description"], "Network deleted");
        assert!(!s.contains_key("ipFamilies") && !s.contains_key("providerStatus"));
    }

    #[test]
    fn errors_carry_codes_and_the_state_says_whether_it_is_retried() {
        let failed = Outcome::Failed {
            description: "providerConfig.mtu: 70000 is out of range 1280..=9000".into(),
            configuration: true,
        };
        let p = patch(LastOperationType::Reconcile, &failed, Some(5), now());
        assert_eq!(
            p,
            json!({"status": {
                "lastOperation": {
                    "description": "Error reconciling the Network: providerConfig.mtu: 70000 is out of range 1280..=9000",
                    "lastUpdateTime": "2026-01-02T03:04:05Z", "progress": 50,
                    "state": "Failed", "type": "Reconcile"},
                "lastError": {
                    "description": "providerConfig.mtu: 70000 is out of range 1280..=9000",
                    "codes": ["ERR_CONFIGURATION_PROBLEM"],
                    "lastUpdateTime": "2026-01-02T03:04:05Z"},
                "observedGeneration": 5
            }})
        );
        let retry = Outcome::Failed {
            description: "connection refused".into(),
            configuration: false,
        };
        let p = patch(LastOperationType::Delete, &retry, Some(5), now());
        assert_eq!(p["status"]["lastOperation"]["state"], "Error");
        assert_eq!(
            p["status"]["lastOperation"]["description"],
            "Error deleting the Network: connection refused"
        );
        assert_eq!(
            p["status"]["lastError"],
            json!({"description": "connection refused", "lastUpdateTime": "2026-01-02T03:04:05Z"})
        );
    }
}
