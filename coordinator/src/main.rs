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

fn main() {
    let cli = Cli::parse();
    let telemetry = cli.cfg.telemetry.clone();
    omni_telemetry::service_main(
        "omni-coordinator",
        None,
        &telemetry,
        omni_coordinator::run(cli.cfg),
    )
}
