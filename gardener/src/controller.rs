//! The I/O: a kube-rs controller over the seed's Networks, and the heartbeat Lease. Every
//! decision is made by the pure modules; this file reads objects, calls them, and writes
//! what they return.

use std::{sync::Arc, time::Duration};

use futures::StreamExt;
use k8s_openapi::{
    api::{coordination::v1::Lease, core::v1::Secret},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time},
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{DeleteParams, DynamicObject, Patch, PatchParams},
    runtime::{Controller, controller::Action, watcher},
};
use serde_json::{Value, json};
use tracing::{debug, info, warn};

use crate::{
    config,
    decide::{self, DecideError},
    health, managed, operation,
    render::{self, RenderError},
    status::{self, Outcome, Rendered},
    types::{
        Cluster, LastOperationType, Network, OPERATION_ANNOTATION, cluster_resource,
        managed_resource_resource, network_resource,
    },
};

/// The field manager of every server-side apply.
pub const MANAGER: &str = "gardener-extension-ferry";
/// The Lease gardenlet reads to see the extension is alive.
pub const HEARTBEAT_LEASE: &str = "gardener-extension-heartbeat";
/// How often it is renewed (Gardener's default), and its `leaseDurationSeconds`.
pub const HEARTBEAT_PERIOD: Duration = Duration::from_secs(30);
/// How long a delete waits for gardener-resource-manager to remove the ManagedResource.
pub const DELETE_WAIT: Duration = Duration::from_secs(120);
/// How often the health condition is read from the ManagedResource (the sync period of
/// Gardener's health check library).
pub const HEALTH_PERIOD: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error("Network {0}: {1}")]
    Decode(String, serde_json::Error),
    #[error(transparent)]
    Shoot(#[from] crate::types::ShootDecodeError),
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Decide(#[from] DecideError),
    #[error(transparent)]
    Render(#[from] RenderError),
    #[error("the ManagedResource {0} is still there after {1:?}")]
    StillThere(String, Duration),
}

impl Error {
    /// Will never work until the shoot or the Network changes.
    fn is_configuration(&self) -> bool {
        matches!(
            self,
            Error::Config(_) | Error::Decide(DecideError::Configuration(_))
        )
    }
}

pub struct Context {
    pub client: Client,
    pub ferry_image: String,
}

/// Runs the Network controller until the process ends.
pub async fn run(ctx: Context) {
    let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &network_resource());
    Controller::new_with(api, watcher::Config::default(), network_resource())
        .run(reconcile, error_policy, Arc::new(ctx))
        .for_each(|result| async move {
            match result {
                Ok((object, _)) => debug!(network = %object, "reconciled"),
                Err(e) => warn!("{e}"),
            }
        })
        .await;
}

fn error_policy(_: Arc<DynamicObject>, error: &Error, _: Arc<Context>) -> Action {
    warn!("{error}");
    Action::requeue(Duration::from_secs(operation::RETRY_AFTER.as_secs() as u64))
}

fn now() -> Time {
    Time(Timestamp::now())
}

async fn reconcile(object: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action, Error> {
    let name = object.metadata.name.clone().unwrap_or_default();
    let namespace = object.metadata.namespace.clone().unwrap_or_default();
    let network: Network = serde_json::to_value(&*object)
        .and_then(serde_json::from_value)
        .map_err(|e| Error::Decode(format!("{namespace}/{name}"), e))?;
    if !operation::is_ours(&network) {
        return Ok(Action::await_change());
    }
    let op = match operation::next_action(&network, Timestamp::now()) {
        operation::Action::Skip(reason) => {
            debug!(%namespace, %name, reason, "skipped");
            return Ok(Action::await_change());
        }
        operation::Action::Run(op) => op,
    };
    info!(%namespace, %name, ?op, "operation");
    let networks: Api<DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), &namespace, &network_resource());
    let annotation = network
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(OPERATION_ANNOTATION))
        .cloned();
    // gardenlet's reconcile request is taken off first; migrate and restore at the end.
    if annotation.as_deref() == Some("reconcile") {
        remove_operation_annotation(&networks, &name).await?;
    }
    // Gardener does not retry a shoot whose last operation failed, and neither do its
    // extensions (`IsFailed`); gardenlet asks again once it retries the shoot. A delete
    // still runs, so that a failed shoot can always go.
    if op != LastOperationType::Delete && shoot_failed(&ctx.client, &namespace).await? {
        info!(%namespace, %name, ?op, "skipped: the shoot's last operation failed");
        return Ok(Action::await_change());
    }
    let generation = network.metadata.generation;
    let write = |outcome: Outcome<'_>| status::patch(op, &outcome, generation, now());
    patch_status(&networks, &name, write(Outcome::Processing)).await?;

    let result = match op {
        LastOperationType::Delete => delete(&ctx.client, &namespace).await.map(|()| None),
        LastOperationType::Migrate => migrate(&ctx.client, &namespace).await.map(|()| None),
        _ => {
            set_finalizers(&networks, &network, true).await?;
            deploy(&ctx, &network, &namespace).await.map(Some)
        }
    };
    match result {
        Ok(rendered) => {
            patch_status(
                &networks,
                &name,
                write(Outcome::Succeeded(rendered.as_ref())),
            )
            .await?;
            match op {
                LastOperationType::Delete => set_finalizers(&networks, &network, false).await?,
                LastOperationType::Migrate => {
                    // Gardener removes all finalizers of a migrated object.
                    let clear = json!({"metadata": {"finalizers": null}});
                    networks
                        .patch(&name, &PatchParams::default(), &Patch::Merge(&clear))
                        .await?;
                }
                _ => {}
            }
            if matches!(annotation.as_deref(), Some("migrate" | "restore")) {
                remove_operation_annotation(&networks, &name).await?;
            }
            Ok(Action::await_change())
        }
        Err(e) => {
            warn!(%namespace, %name, ?op, "{e}");
            let configuration = e.is_configuration();
            let failed = Outcome::Failed {
                description: e.to_string(),
                configuration,
            };
            patch_status(&networks, &name, write(failed)).await?;
            Ok(if configuration {
                Action::await_change()
            } else {
                Action::requeue(Duration::from_secs(operation::RETRY_AFTER.as_secs() as u64))
            })
        }
    }
}

/// The Cluster's shoot has a `Failed` last operation. A missing Cluster or one that does
/// not decode is not failed: the operation itself then reports why it cannot go on.
async fn shoot_failed(client: &Client, namespace: &str) -> Result<bool, Error> {
    let clusters: Api<DynamicObject> = Api::all_with(client.clone(), &cluster_resource());
    let Some(cluster) = clusters.get_opt(namespace).await? else {
        return Ok(false);
    };
    let cluster: Option<Cluster> = serde_json::to_value(cluster)
        .and_then(serde_json::from_value)
        .ok();
    Ok(cluster
        .and_then(|c| c.shoot().ok())
        .is_some_and(|shoot| shoot.is_failed()))
}

/// Reads the Cluster, decides, renders, and applies the Secret and the ManagedResource.
async fn deploy(ctx: &Context, network: &Network, namespace: &str) -> Result<Rendered, Error> {
    let clusters: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &cluster_resource());
    let cluster: Cluster = serde_json::to_value(clusters.get(namespace).await?)
        .and_then(serde_json::from_value)
        .map_err(|e| Error::Decode(format!("Cluster {namespace}"), e))?;
    let shoot = cluster.shoot()?;
    let config = config::parse(network.spec.provider_config.as_ref())?;
    let decision = decide::decide(network, &shoot, &config)?;
    let manifests = render::render(&decision, &config, &ctx.ferry_image)?;

    let secret = managed::secret(namespace, &manifests);
    let secret_name = secret.metadata.name.clone().unwrap_or_default();
    let apply = PatchParams::apply(MANAGER).force();
    Api::<Secret>::namespaced(ctx.client.clone(), namespace)
        .patch(&secret_name, &apply, &Patch::Apply(&secret))
        .await?;
    let mr = managed::managed_resource(namespace, &secret_name, false);
    managed_resources(&ctx.client, namespace)
        .patch(managed::MANAGED_RESOURCE_NAME, &apply, &Patch::Apply(&mr))
        .await?;
    Ok(Rendered {
        decision,
        overlay: config.overlay,
    })
}

fn managed_resources(client: &Client, namespace: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), namespace, &managed_resource_resource())
}

/// Deletes the ManagedResource's Secrets, then the ManagedResource, and waits (bounded)
/// until gardener-resource-manager has removed it, and with it the shoot objects.
async fn delete(client: &Client, namespace: &str) -> Result<(), Error> {
    let mrs = managed_resources(client, namespace);
    let name = managed::MANAGED_RESOURCE_NAME;
    let Some(mr) = mrs.get_opt(name).await? else {
        return Ok(());
    };
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    for secret in managed::secret_refs(&serde_json::to_value(&mr).unwrap_or(Value::Null)) {
        ignore_not_found(secrets.delete(&secret, &DeleteParams::default()).await)?;
    }
    ignore_not_found(mrs.delete(name, &DeleteParams::default()).await)?;
    let deadline = tokio::time::Instant::now() + DELETE_WAIT;
    while mrs.get_opt(name).await?.is_some() {
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::StillThere(
                format!("{namespace}/{name}"),
                DELETE_WAIT,
            ));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Ok(())
}

/// Keeps the shoot's objects (`keepObjects`), then removes the seed's side.
async fn migrate(client: &Client, namespace: &str) -> Result<(), Error> {
    let keep = json!({"spec": {"keepObjects": true}});
    let patched = managed_resources(client, namespace)
        .patch(
            managed::MANAGED_RESOURCE_NAME,
            &PatchParams::default(),
            &Patch::Merge(&keep),
        )
        .await;
    ignore_not_found(patched.map(|_| ()))?;
    delete(client, namespace).await
}

fn ignore_not_found<T>(result: Result<T, kube::Error>) -> Result<(), kube::Error> {
    match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

async fn patch_status(
    networks: &Api<DynamicObject>,
    name: &str,
    patch: Value,
) -> Result<(), Error> {
    networks
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

async fn remove_operation_annotation(
    networks: &Api<DynamicObject>,
    name: &str,
) -> Result<(), Error> {
    let patch = json!({"metadata": {"annotations": {OPERATION_ANNOTATION: null}}});
    networks
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// Adds or removes our finalizer. The Network is read again first (the annotation and
/// status writes before this one moved its resourceVersion), and the patch is guarded by
/// the resourceVersion read, so another writer's finalizers are never lost.
async fn set_finalizers(
    networks: &Api<DynamicObject>,
    network: &Network,
    ours: bool,
) -> Result<(), Error> {
    let name = network.metadata.name.as_deref().unwrap_or_default();
    let Some(current) = networks.get_opt(name).await? else {
        return Ok(());
    };
    let mut finalizers = current.metadata.finalizers.clone().unwrap_or_default();
    let has = finalizers.iter().any(|f| f == operation::FINALIZER);
    if has == ours {
        return Ok(());
    }
    if ours {
        finalizers.push(operation::FINALIZER.to_string());
    } else {
        finalizers.retain(|f| f != operation::FINALIZER);
    }
    let patch = json!({"metadata": {
        "finalizers": finalizers,
        "resourceVersion": current.metadata.resource_version,
    }});
    networks
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// Writes every Network's health condition from its ManagedResource's conditions, every
/// `period` ([`HEALTH_PERIOD`] in the seed), until the process ends. A Network that is
/// being deleted, was migrated away, or has no ManagedResource is left alone.
pub async fn health(client: Client, period: Duration) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = check_health(&client).await {
            warn!("health check: {e}");
        }
    }
}

async fn check_health(client: &Client) -> Result<(), Error> {
    let all: Api<DynamicObject> = Api::all_with(client.clone(), &network_resource());
    for object in all.list(&Default::default()).await? {
        let Ok(value) = serde_json::to_value(&object) else {
            continue;
        };
        let Ok(network) = serde_json::from_value::<Network>(value.clone()) else {
            continue;
        };
        let migrated = network.status.last_operation.as_ref().is_some_and(|l| {
            l.type_ == LastOperationType::Migrate
                && l.state == crate::types::LastOperationState::Succeeded
        });
        if !operation::is_ours(&network)
            || network.metadata.deletion_timestamp.is_some()
            || migrated
        {
            continue;
        }
        let namespace = network.metadata.namespace.clone().unwrap_or_default();
        let name = network.metadata.name.clone().unwrap_or_default();
        let Some(mr) = managed_resources(client, &namespace)
            .get_opt(managed::MANAGED_RESOURCE_NAME)
            .await?
        else {
            continue;
        };
        let mr = serde_json::to_value(&mr).unwrap_or(Value::Null);
        let health = health::of_managed_resource(&mr);
        let now = serde_json::to_value(now()).unwrap_or(Value::Null);
        let now = now.as_str().unwrap_or_default();
        if let Some(conditions) = health::conditions_with(&value, &health, now) {
            debug!(%namespace, %name, status = health.status, "health condition");
            let networks: Api<DynamicObject> =
                Api::namespaced_with(client.clone(), &namespace, &network_resource());
            let patch = json!({"status": {"conditions": conditions}});
            let written = networks
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await;
            ignore_not_found(written)?;
        }
    }
    Ok(())
}

/// The heartbeat Lease as applied at `now`, renewed every `period`.
pub fn heartbeat_lease(namespace: &str, holder: &str, period: Duration, now: Timestamp) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(HEARTBEAT_LEASE.to_string()),
            namespace: Some(namespace.to_string()),
            ..ObjectMeta::default()
        },
        spec: Some(k8s_openapi::api::coordination::v1::LeaseSpec {
            holder_identity: Some(holder.to_string()),
            lease_duration_seconds: Some(period.as_secs().clamp(1, i32::MAX as u64) as i32),
            renew_time: Some(MicroTime(now)),
            ..Default::default()
        }),
    }
}

/// Renews the heartbeat Lease every `period` ([`HEARTBEAT_PERIOD`] in the seed) until
/// the process ends.
pub async fn heartbeat(client: Client, namespace: String, holder: String, period: Duration) {
    let leases: Api<Lease> = Api::namespaced(client, &namespace);
    let apply = PatchParams::apply(MANAGER).force();
    let mut tick = tokio::time::interval(period);
    loop {
        tick.tick().await;
        let lease = heartbeat_lease(&namespace, &holder, period, Timestamp::now());
        match leases
            .patch(HEARTBEAT_LEASE, &apply, &Patch::Apply(&lease))
            .await
        {
            Ok(_) => debug!(%namespace, "heartbeat renewed"),
            Err(e) => warn!(%namespace, "heartbeat Lease {HEARTBEAT_LEASE}: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeat_lease_shape() {
        let lease = heartbeat_lease(
            "extension-networking-ferry-abc",
            "networking-ferry",
            HEARTBEAT_PERIOD,
            "2026-01-02T03:04:05.123456Z".parse().unwrap(),
        );
        let v = serde_json::to_value(&lease).unwrap();
        assert_eq!(v["metadata"]["name"], "gardener-extension-heartbeat");
        assert_eq!(v["metadata"]["namespace"], "extension-networking-ferry-abc");
        assert_eq!(
            v["spec"],
            json!({"holderIdentity": "networking-ferry", "leaseDurationSeconds": 30,
                   "renewTime": "2026-01-02T03:04:05.123456Z"})
        );
    }

    #[test]
    fn configuration_errors_are_the_non_retryable_ones() {
        let cfg = config::parse(Some(&json!({"kind": "x"}))).unwrap_err();
        assert!(Error::Config(cfg).is_configuration());
        assert!(Error::Decide(DecideError::Configuration("x".into())).is_configuration());
        assert!(!Error::Decide(DecideError::NotYet("x".into())).is_configuration());
        assert!(!Error::StillThere("x".into(), DELETE_WAIT).is_configuration());
    }
}
