//! `omni-coordinator`: waits for its workers, plans, loads, then serves Inference.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "omni-coordinator",
    version,
    about = "omni coordinator: plans layers across workers and serves Inference over gRPC"
)]
struct Cli {
    #[command(flatten)]
    cfg: omni_coordinator::CoordinatorConfig,
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("OMNI_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = tokio::select! {
        r = omni_coordinator::run(cli.cfg) => r,
        _ = omni_coordinator::shutdown_signal() => Ok(()),
    };
    if let Err(e) = result {
        eprintln!("omni-coordinator: error: {e:#}");
        std::process::exit(1);
    }
}
