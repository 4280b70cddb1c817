//! `gardener-extension-ferry`: the Gardener networking extension for type `ferry`, run in
//! the seed by the chart in `deploy/gardener/`.

use clap::Parser;
use std::time::Duration;

use ferry_gardener::{controller, leader, render};

#[derive(Parser)]
#[command(version, about = "Gardener networking extension for type ferry")]
struct Args {
    /// The ferry image rendered into the shoots' DaemonSet.
    #[arg(long, env = "FERRY_IMAGE", default_value_t = render::default_image())]
    ferry_image: String,
    /// Namespace of the heartbeat Lease: the one gardenlet installed the extension into.
    #[arg(long, env = "LEADER_ELECTION_NAMESPACE")]
    heartbeat_namespace: String,
    /// The extension's name, the heartbeat Lease's holder.
    #[arg(long, default_value = "networking-ferry")]
    extension_name: String,
    /// How often the heartbeat Lease is renewed, in seconds.
    #[arg(long, default_value_t = controller::HEARTBEAT_PERIOD.as_secs())]
    heartbeat_period_seconds: u64,
    /// How often the Networks' health condition is read from their ManagedResources, in
    /// seconds.
    #[arg(long, default_value_t = controller::HEALTH_PERIOD.as_secs())]
    health_check_period_seconds: u64,
    /// Run the controller only while holding the leader Lease (in the heartbeat's
    /// namespace), so that two replicas can run.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    leader_election: bool,
    /// The leader Lease's name.
    #[arg(long, default_value = leader::LEASE_NAME)]
    leader_election_id: String,
    /// The leader Lease's duration, in seconds: another replica takes over this long
    /// after the leader stopped renewing.
    #[arg(long, default_value_t = leader::LEASE_DURATION.as_secs())]
    leader_election_lease_duration_seconds: u64,
    /// This replica's identity in the leader Lease (the chart sets the pod's name).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    // KUBECONFIG when set, else the in-cluster service account.
    let client = kube::Client::try_default().await?;
    let period = |seconds: u64| Duration::from_secs(seconds.max(1));
    // Only the leader renews the heartbeat, checks health and reconciles.
    let work = async {
        tokio::join!(
            controller::heartbeat(
                client.clone(),
                args.heartbeat_namespace.clone(),
                args.extension_name.clone(),
                period(args.heartbeat_period_seconds),
            ),
            controller::health(client.clone(), period(args.health_check_period_seconds)),
            controller::run(controller::Context {
                client: client.clone(),
                ferry_image: args.ferry_image.clone(),
            }),
        );
    };
    if !args.leader_election {
        work.await;
        return Ok(());
    }
    let identity = match args.identity.clone() {
        Some(id) => id,
        None => std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| format!("gardener-extension-ferry-{}", std::process::id())),
    };
    let config = leader::Config {
        namespace: args.heartbeat_namespace.clone(),
        name: args.leader_election_id.clone(),
        identity,
        lease_duration: period(args.leader_election_lease_duration_seconds),
    };
    // Leadership lost: exit, and the restarted replica becomes a candidate again.
    leader::lead(client.clone(), config, work).await?;
    Ok(())
}
