//! Which operation a Network asks for, and whether it asks now: Gardener's rules
//! (`ComputeOperationType`, the default watch predicate, `ShouldSkipOperation`) as pure
//! functions, so the controller acts on gardenlet's requests and not on its own status
//! writes.

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::types::{LastOperationState, LastOperationType, Network, OPERATION_ANNOTATION};

/// The finalizer this extension keeps on its Networks.
pub const FINALIZER: &str = "extensions.gardener.cloud/ferry";

/// A failed (retryable) or interrupted operation is taken up again after this long.
pub const RETRY_AFTER: SignedDuration = SignedDuration::from_secs(30);

/// What to do with a Network now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Run(LastOperationType),
    /// Nothing asked for; the reason is logged.
    Skip(&'static str),
}

fn annotation(network: &Network) -> Option<&str> {
    network
        .metadata
        .annotations
        .as_ref()?
        .get(OPERATION_ANNOTATION)
        .map(String::as_str)
}

/// Whether the Network is ours to serve: our type, class `shoot` or unset.
pub fn is_ours(network: &Network) -> bool {
    network.spec.type_ == crate::types::NETWORK_TYPE
        && matches!(
            network.spec.class.as_deref(),
            None | Some("") | Some("shoot")
        )
}

/// Gardener's `ComputeOperationType`.
pub fn operation_type(network: &Network) -> LastOperationType {
    use LastOperationType::*;
    let last = network.status.last_operation.as_ref();
    match annotation(network) {
        Some("migrate") => return Migrate,
        _ if network.metadata.deletion_timestamp.is_some() => return Delete,
        Some("restore") => return Restore,
        _ => {}
    }
    match last {
        None => Create,
        Some(op)
            if matches!(op.type_, Create | Migrate | Restore)
                && op.state != LastOperationState::Succeeded =>
        {
            op.type_
        }
        Some(_) => Reconcile,
    }
}

/// Whether the Network asks for an operation now, and which.
pub fn next_action(network: &Network, now: Timestamp) -> Action {
    let annotation = annotation(network);
    if annotation == Some("wait-for-state") {
        return Action::Skip("gardenlet is restoring the state (wait-for-state)");
    }
    let op = operation_type(network);
    let last = network.status.last_operation.as_ref();
    if last.is_some_and(|l| {
        l.type_ == LastOperationType::Migrate && l.state == LastOperationState::Succeeded
    }) && !matches!(op, LastOperationType::Migrate | LastOperationType::Restore)
    {
        return Action::Skip("migrated away from this seed");
    }
    if op == LastOperationType::Delete {
        let ours = network
            .metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.iter().any(|f| f == FINALIZER));
        return if ours {
            Action::Run(op)
        } else {
            Action::Skip("deleted, and our finalizer is already gone")
        };
    }
    let asked = matches!(annotation, Some("reconcile" | "migrate" | "restore"));
    let changed = network.metadata.generation.is_some()
        && network.status.observed_generation != network.metadata.generation;
    let retry_due = last.is_some_and(|l| {
        matches!(
            l.state,
            LastOperationState::Error | LastOperationState::Processing
        ) && l.last_update_time.0 + RETRY_AFTER <= now
    });
    if asked || last.is_none() || changed || retry_due {
        Action::Run(op)
    } else {
        Action::Skip("no operation asked for")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    const NOW: &str = "2026-01-02T03:04:05Z";

    fn network(annotation: Option<&str>, status: Value) -> Network {
        let mut meta = json!({"name": "bar", "namespace": "shoot--foo--bar", "generation": 2,
                              "finalizers": [FINALIZER]});
        if let Some(a) = annotation {
            meta["annotations"] = json!({OPERATION_ANNOTATION: a});
        }
        serde_json::from_value(json!({
            "metadata": meta,
            "spec": {"type": "ferry", "podCIDR": "10.244.0.0/16", "serviceCIDR": "10.96.0.0/12"},
            "status": status
        }))
        .unwrap()
    }

    fn last(type_: &str, state: &str, at: &str) -> Value {
        json!({"lastOperation": {"type": type_, "state": state, "progress": 100, "description": "",
                                 "lastUpdateTime": at}, "observedGeneration": 2})
    }

    fn act(n: &Network) -> Action {
        next_action(n, NOW.parse().unwrap())
    }

    use Action::{Run, Skip};
    use LastOperationType::*;

    #[test]
    fn new_network_is_created() {
        assert_eq!(act(&network(None, json!({}))), Run(Create));
        assert_eq!(act(&network(Some("reconcile"), json!({}))), Run(Create));
    }

    #[test]
    fn reconcile_only_when_asked_or_changed() {
        let done = last("Reconcile", "Succeeded", "2026-01-02T03:00:00Z");
        assert_eq!(
            act(&network(None, done.clone())),
            Skip("no operation asked for")
        );
        assert_eq!(
            act(&network(Some("reconcile"), done.clone())),
            Run(Reconcile)
        );
        let mut older = done.clone();
        older["observedGeneration"] = json!(1);
        assert_eq!(act(&network(None, older)), Run(Reconcile));
    }

    #[test]
    fn errors_are_retried_after_a_while_not_on_our_own_status_write() {
        let just_now = last("Reconcile", "Error", "2026-01-02T03:04:00Z");
        assert_eq!(
            act(&network(None, just_now)),
            Skip("no operation asked for")
        );
        let a_while_ago = last("Reconcile", "Error", "2026-01-02T03:03:35Z");
        assert_eq!(act(&network(None, a_while_ago)), Run(Reconcile));
        // Failed (a configuration problem) waits for a change or gardenlet.
        let failed = last("Reconcile", "Failed", "2026-01-02T02:00:00Z");
        assert_eq!(act(&network(None, failed)), Skip("no operation asked for"));
        // An interrupted create is a create again.
        let create = last("Create", "Processing", "2026-01-02T02:00:00Z");
        assert_eq!(act(&network(None, create)), Run(Create));
    }

    #[test]
    fn migrate_restore_wait_for_state() {
        let done = last("Reconcile", "Succeeded", "2026-01-02T03:00:00Z");
        assert_eq!(act(&network(Some("migrate"), done.clone())), Run(Migrate));
        assert_eq!(act(&network(Some("restore"), done.clone())), Run(Restore));
        assert_eq!(
            act(&network(Some("wait-for-state"), done)),
            Skip("gardenlet is restoring the state (wait-for-state)")
        );
        let migrated = last("Migrate", "Succeeded", "2026-01-02T03:00:00Z");
        assert_eq!(
            act(&network(Some("reconcile"), migrated.clone())),
            Skip("migrated away from this seed")
        );
        assert_eq!(act(&network(Some("restore"), migrated)), Run(Restore));
    }

    #[test]
    fn delete_needs_our_finalizer() {
        let mut n = network(None, last("Reconcile", "Succeeded", "2026-01-02T03:00:00Z"));
        n.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            NOW.parse().unwrap(),
        ));
        assert_eq!(act(&n), Run(Delete));
        n.metadata.finalizers = Some(vec!["other".into()]);
        assert_eq!(act(&n), Skip("deleted, and our finalizer is already gone"));
        // migrate wins over delete, as in Gardener.
        n.metadata.annotations =
            Some([(OPERATION_ANNOTATION.to_string(), "migrate".to_string())].into());
        assert_eq!(operation_type(&n), Migrate);
    }

    #[test]
    fn ours_is_type_ferry_and_class_shoot_or_unset() {
        let mut n = network(None, json!({}));
        assert!(is_ours(&n));
        n.spec.class = Some("shoot".into());
        assert!(is_ours(&n));
        n.spec.class = Some("seed".into());
        assert!(!is_ours(&n));
        n.spec.class = None;
        n.spec.type_ = "calico".into();
        assert!(!is_ours(&n));
    }
}
