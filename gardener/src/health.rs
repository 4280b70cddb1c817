//! The Network's health condition, from the ManagedResource's conditions, as Gardener's
//! health check library writes it (`extensions/pkg/controller/healthcheck`, with
//! `CheckManagedResource`): one condition of type `SystemComponentsHealthy` in
//! `status.conditions`, `True`/`False`/`Progressing` with the library's reasons.

use serde_json::{Value, json};

/// The condition's type: the shoot condition that ferry's DaemonSet belongs to.
pub const CONDITION_TYPE: &str = "SystemComponentsHealthy";
pub const REASON_SUCCESSFUL: &str = "HealthCheckSuccessful";
pub const REASON_UNSUCCESSFUL: &str = "HealthCheckUnsuccessful";
pub const REASON_PROGRESSING: &str = "HealthCheckProgressing";

/// What the ManagedResource says, as a condition's status, reason and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Health {
    pub status: &'static str,
    pub reason: &'static str,
    pub message: String,
}

fn condition<'a>(conditions: &'a [Value], type_: &str) -> Option<&'a Value> {
    conditions.iter().find(|c| c["type"] == type_)
}

fn conditions(object: &Value) -> &[Value] {
    object["status"]["conditions"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
}

/// Gardener's checks in its order: the MR is observed at its generation,
/// `ResourcesApplied` and `ResourcesHealthy` are `True` (else `False`), and
/// `ResourcesProgressing` is not `True` (else `Progressing`: a rollout under way).
pub fn of_managed_resource(mr: &Value) -> Health {
    let name = format!(
        "{}/{}",
        mr["metadata"]["namespace"].as_str().unwrap_or_default(),
        mr["metadata"]["name"].as_str().unwrap_or_default()
    );
    let unhealthy = |message: String| Health {
        status: "False",
        reason: REASON_UNSUCCESSFUL,
        message,
    };
    let generation = mr["metadata"]["generation"].as_i64().unwrap_or(0);
    let observed = mr["status"]["observedGeneration"].as_i64().unwrap_or(0);
    if observed != generation {
        return unhealthy(format!(
            "observed generation of managed resource {name} outdated ({observed}/{generation})"
        ));
    }
    let conditions = conditions(mr);
    for type_ in ["ResourcesApplied", "ResourcesHealthy"] {
        match condition(conditions, type_) {
            None => {
                return unhealthy(format!(
                    "condition {type_} for managed resource {name} has not been reported yet"
                ));
            }
            Some(c) if c["status"] != "True" => {
                return unhealthy(format!(
                    "condition {type_} of managed resource {name} is {}: {}",
                    c["status"].as_str().unwrap_or_default(),
                    c["message"].as_str().unwrap_or_default()
                ));
            }
            Some(_) => {}
        }
    }
    if let Some(c) = condition(conditions, "ResourcesProgressing")
        && c["status"] == "True"
    {
        return Health {
            status: "Progressing",
            reason: REASON_PROGRESSING,
            message: format!(
                "managed resource {name} is progressing: {}",
                c["message"].as_str().unwrap_or_default()
            ),
        };
    }
    Health {
        status: "True",
        reason: REASON_SUCCESSFUL,
        message: "All health checks successful".to_string(),
    }
}

/// The Network's `status.conditions` with the health condition set at `now`, or `None`
/// when it already says the same (nothing to write). `lastTransitionTime` moves when the
/// status changes, `lastUpdateTime` when anything does; other conditions are kept.
pub fn conditions_with(network: &Value, health: &Health, now: &str) -> Option<Vec<Value>> {
    let existing = conditions(network);
    let previous = condition(existing, CONDITION_TYPE);
    if let Some(p) = previous
        && p["status"] == health.status
        && p["reason"] == health.reason
        && p["message"] == health.message.as_str()
    {
        return None;
    }
    let transition = match previous {
        Some(p) if p["status"] == health.status => p["lastTransitionTime"].clone(),
        _ => json!(now),
    };
    let updated = json!({
        "type": CONDITION_TYPE,
        "status": health.status,
        "reason": health.reason,
        "message": health.message,
        "lastTransitionTime": transition,
        "lastUpdateTime": now,
    });
    let mut out: Vec<Value> = existing
        .iter()
        .filter(|c| c["type"] != CONDITION_TYPE)
        .cloned()
        .collect();
    out.push(updated);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mr(generation: i64, observed: i64, conditions: Value) -> Value {
        json!({
            "metadata": {"name": "mr", "namespace": "ns", "generation": generation},
            "status": {"observedGeneration": observed, "conditions": conditions},
        })
    }

    fn c(type_: &str, status: &str, message: &str) -> Value {
        json!({"type": type_, "status": status, "message": message})
    }

    #[test]
    fn gardener_checks_in_order() {
        let healthy = [
            c("ResourcesApplied", "True", ""),
            c("ResourcesHealthy", "True", ""),
            c("ResourcesProgressing", "False", ""),
        ];
        let h = of_managed_resource(&mr(2, 2, json!(healthy)));
        assert_eq!((h.status, h.reason), ("True", REASON_SUCCESSFUL));

        let h = of_managed_resource(&mr(3, 2, json!(healthy)));
        assert_eq!(h.status, "False");
        assert_eq!(
            h.message,
            "observed generation of managed resource ns/mr outdated (2/3)"
        );

        let h = of_managed_resource(&mr(1, 1, json!([c("ResourcesApplied", "True", "")])));
        assert_eq!(
            h.message,
            "condition ResourcesHealthy for managed resource ns/mr has not been reported yet"
        );

        let mut sick = healthy.clone();
        sick[1] = c(
            "ResourcesHealthy",
            "False",
            "DaemonSet kube-system/ferry is unhealthy",
        );
        let h = of_managed_resource(&mr(1, 1, json!(sick)));
        assert_eq!((h.status, h.reason), ("False", REASON_UNSUCCESSFUL));
        assert_eq!(
            h.message,
            "condition ResourcesHealthy of managed resource ns/mr is False: DaemonSet kube-system/ferry is unhealthy"
        );

        let mut rolling = healthy.clone();
        rolling[2] = c("ResourcesProgressing", "True", "rollout");
        let h = of_managed_resource(&mr(1, 1, json!(rolling)));
        assert_eq!((h.status, h.reason), ("Progressing", REASON_PROGRESSING));
    }

    #[test]
    fn condition_times_and_other_conditions() {
        let ok = Health {
            status: "True",
            reason: REASON_SUCCESSFUL,
            message: "All health checks successful".into(),
        };
        let other = json!({"type": "Other", "status": "True"});
        let network = json!({"status": {"conditions": [other]}});
        let first = conditions_with(&network, &ok, "t1").unwrap();
        assert_eq!(first[0], other);
        assert_eq!(first[1]["lastTransitionTime"], "t1");
        let network = json!({"status": {"conditions": first}});
        assert_eq!(conditions_with(&network, &ok, "t2"), None, "unchanged");

        let other_message = Health {
            message: "x".into(),
            ..ok.clone()
        };
        let second = conditions_with(&network, &other_message, "t2").unwrap();
        assert_eq!(second.len(), 2);
        assert_eq!(second[1]["lastTransitionTime"], "t1", "same status");
        assert_eq!(second[1]["lastUpdateTime"], "t2");

        let bad = Health {
            status: "False",
            reason: REASON_UNSUCCESSFUL,
            message: "y".into(),
        };
        let third = conditions_with(&network, &bad, "t3").unwrap();
        assert_eq!(third[1]["lastTransitionTime"], "t3");
    }
}
