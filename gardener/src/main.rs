//! `gardener-extension-ferry`: the Gardener networking extension for type `ferry`, run in
//! the seed by the chart in `deploy/gardener/`.

use clap::Parser;
use ferry_gardener::{controller, render};

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
    tokio::spawn(controller::heartbeat(
        client.clone(),
        args.heartbeat_namespace,
        args.extension_name,
        std::time::Duration::from_secs(args.heartbeat_period_seconds.max(1)),
    ));
    tokio::spawn(controller::health(
        client.clone(),
        std::time::Duration::from_secs(args.health_check_period_seconds.max(1)),
    ));
    controller::run(controller::Context {
        client,
        ferry_image: args.ferry_image,
    })
    .await;
    Ok(())
}
