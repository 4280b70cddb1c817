//! Leader election on a `coordination.k8s.io/v1` Lease, as client-go's leaderelection
//! does it (kube-rs has none): a candidate creates the Lease or takes it over once its
//! holder has not renewed it for `leaseDurationSeconds` (measured on the candidate's own
//! clock, from when it last saw the Lease change, so clocks need not agree); the leader
//! renews it every retry period and stops leading when it could not renew within the
//! renew deadline, which is shorter than the duration, so it has stopped before anyone
//! else can take over. Every write carries the resourceVersion read: of two candidates,
//! one wins.

use std::{future::Future, time::Duration};

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{Api, Client, api::PostParams};
use tokio::time::Instant;
use tracing::{info, warn};

/// The Lease's default name in the extension's namespace.
pub const LEASE_NAME: &str = "gardener-extension-networking-ferry-leader-election";
/// controller-runtime's defaults: 15 s duration, 10 s renew deadline, 2 s retry.
pub const LEASE_DURATION: Duration = Duration::from_secs(15);

#[derive(Clone, Debug)]
pub struct Config {
    pub namespace: String,
    pub name: String,
    /// This replica's identity (its pod name).
    pub identity: String,
    pub lease_duration: Duration,
}

impl Config {
    /// How long the leader keeps leading without a successful renewal: 2/3 of the
    /// duration (controller-runtime's 10 s of 15 s).
    pub fn renew_deadline(&self) -> Duration {
        self.lease_duration * 2 / 3
    }

    /// How often a candidate tries and the leader renews: 2/15 of the duration
    /// (controller-runtime's 2 s of 15 s).
    pub fn retry_period(&self) -> Duration {
        self.lease_duration * 2 / 15
    }

    fn duration_seconds(&self) -> i32 {
        self.lease_duration.as_secs().clamp(1, i32::MAX as u64) as i32
    }
}

/// What a candidate does with the Lease it read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// There is none: create it, holding it.
    Create,
    /// It holds it: renew.
    Renew,
    /// Nobody holds it, or its holder let it expire: take it over.
    TakeOver,
    /// Someone else holds it.
    Wait,
}

/// `expired`: the Lease has not changed for its duration, on this candidate's clock.
pub fn step(lease: Option<&LeaseSpec>, me: &str, expired: bool) -> Step {
    let Some(spec) = lease else {
        return Step::Create;
    };
    match spec.holder_identity.as_deref() {
        Some(holder) if holder == me => Step::Renew,
        None | Some("") => Step::TakeOver,
        Some(_) if expired => Step::TakeOver,
        Some(_) => Step::Wait,
    }
}

/// The Lease's spec after `step` at `now`.
pub fn next_spec(
    current: Option<&LeaseSpec>,
    step: Step,
    config: &Config,
    now: Timestamp,
) -> LeaseSpec {
    let current = current.cloned().unwrap_or_default();
    let transitions = current.lease_transitions.unwrap_or(0);
    let (acquire_time, transitions) = match step {
        Step::Renew => (current.acquire_time.clone(), transitions),
        Step::Create => (Some(MicroTime(now)), 0),
        Step::TakeOver | Step::Wait => (Some(MicroTime(now)), transitions + 1),
    };
    LeaseSpec {
        holder_identity: Some(config.identity.clone()),
        lease_duration_seconds: Some(config.duration_seconds()),
        acquire_time,
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(transitions),
        ..current
    }
}

/// What a candidate remembers of the Lease: its record and when it last changed.
struct Observed {
    record: Option<(Option<String>, Option<MicroTime>)>,
    at: Instant,
}

/// One try: reads the Lease and creates, renews or takes it over. `Ok(true)` when this
/// candidate holds it afterwards.
async fn try_acquire_or_renew(
    leases: &Api<Lease>,
    config: &Config,
    observed: &mut Observed,
) -> Result<bool, kube::Error> {
    let current = leases.get_opt(&config.name).await?;
    let spec = current.as_ref().and_then(|l| l.spec.as_ref());
    let record = spec.map(|s| (s.holder_identity.clone(), s.renew_time.clone()));
    if record != observed.record {
        observed.record = record;
        observed.at = Instant::now();
    }
    let expired = observed.at.elapsed() >= config.lease_duration;
    let step = step(spec, &config.identity, expired);
    if step == Step::Wait {
        return Ok(false);
    }
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(config.name.clone()),
            namespace: Some(config.namespace.clone()),
            resource_version: current
                .as_ref()
                .and_then(|l| l.metadata.resource_version.clone()),
            ..ObjectMeta::default()
        },
        spec: Some(next_spec(spec, step, config, Timestamp::now())),
    };
    let written = match step {
        Step::Create => leases.create(&PostParams::default(), &lease).await,
        _ => {
            leases
                .replace(&config.name, &PostParams::default(), &lease)
                .await
        }
    };
    match written {
        Ok(_) => {
            if step != Step::Renew {
                info!(identity = %config.identity, lease = %config.name, "became the leader");
            }
            Ok(true)
        }
        // Another candidate wrote first.
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Waits until this candidate leads, then runs `work` while renewing the Lease. Returns
/// when `work` ends (`Ok`) or when leadership is lost (`Err`): the caller must then stop,
/// as `work` no longer runs.
pub async fn lead<F: Future<Output = ()>>(
    client: Client,
    config: Config,
    work: F,
) -> Result<(), LeadershipLost> {
    let leases: Api<Lease> = Api::namespaced(client, &config.namespace);
    let mut observed = Observed {
        record: None,
        at: Instant::now(),
    };
    let retry = config.retry_period().max(Duration::from_millis(10));
    loop {
        match try_acquire_or_renew(&leases, &config, &mut observed).await {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => warn!(lease = %config.name, "leader election: {e}"),
        }
        tokio::time::sleep(retry).await;
    }
    let renew = async {
        let mut renewed = Instant::now();
        loop {
            tokio::time::sleep(retry).await;
            match try_acquire_or_renew(&leases, &config, &mut observed).await {
                Ok(true) => renewed = Instant::now(),
                Ok(false) => return,
                Err(e) => warn!(lease = %config.name, "renewing the leader Lease: {e}"),
            }
            if renewed.elapsed() >= config.renew_deadline() {
                return;
            }
        }
    };
    tokio::select! {
        () = work => Ok(()),
        () = renew => {
            warn!(identity = %config.identity, lease = %config.name, "leadership lost");
            Err(LeadershipLost)
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("lost the leader election")]
pub struct LeadershipLost;

#[cfg(test)]
mod tests {
    use super::*;

    fn config(identity: &str) -> Config {
        Config {
            namespace: "ns".into(),
            name: LEASE_NAME.into(),
            identity: identity.into(),
            lease_duration: LEASE_DURATION,
        }
    }

    #[test]
    fn periods_follow_the_duration() {
        let c = config("a");
        assert_eq!(c.renew_deadline(), Duration::from_secs(10));
        assert_eq!(c.retry_period(), Duration::from_secs(2));
    }

    #[test]
    fn steps() {
        let held = |holder: &str| LeaseSpec {
            holder_identity: Some(holder.into()),
            ..LeaseSpec::default()
        };
        assert_eq!(step(None, "a", false), Step::Create);
        assert_eq!(step(Some(&held("a")), "a", true), Step::Renew);
        assert_eq!(step(Some(&held("b")), "a", false), Step::Wait);
        assert_eq!(step(Some(&held("b")), "a", true), Step::TakeOver);
        assert_eq!(step(Some(&held("")), "a", false), Step::TakeOver);
        assert_eq!(
            step(Some(&LeaseSpec::default()), "a", false),
            Step::TakeOver
        );
    }

    #[test]
    fn renewals_keep_the_acquire_time_takeovers_count() {
        let t0: Timestamp = "2026-01-02T03:04:05Z".parse().unwrap();
        let t1: Timestamp = "2026-01-02T03:04:07Z".parse().unwrap();
        let a = config("a");
        let created = next_spec(None, Step::Create, &a, t0);
        assert_eq!(created.holder_identity.as_deref(), Some("a"));
        assert_eq!(created.lease_duration_seconds, Some(15));
        assert_eq!(created.lease_transitions, Some(0));
        assert_eq!(created.acquire_time, Some(MicroTime(t0)));
        let renewed = next_spec(Some(&created), Step::Renew, &a, t1);
        assert_eq!(renewed.acquire_time, Some(MicroTime(t0)));
        assert_eq!(renewed.renew_time, Some(MicroTime(t1)));
        assert_eq!(renewed.lease_transitions, Some(0));
        let taken = next_spec(Some(&renewed), Step::TakeOver, &config("b"), t1);
        assert_eq!(taken.holder_identity.as_deref(), Some("b"));
        assert_eq!(taken.acquire_time, Some(MicroTime(t1)));
        assert_eq!(taken.lease_transitions, Some(1));
    }
}
