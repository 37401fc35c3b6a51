//! `omni-coordinator`: waits for its workers, plans, loads, then serves Inference.

use clap::{CommandFactory, FromArgMatches, Parser};

#[derive(Parser)]
#[command(
    name = "omni-coordinator",
    version,
    about = "omni coordinator: plans layers across workers and serves Inference over gRPC",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
// Parsed in two steps (see `main`): the service's required flags are only
// required when no subcommand is given.
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    cfg: omni_coordinator::CoordinatorConfig,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Probe a running coordinator (exit 0 when its Inference service is
    /// SERVING: workers registered, the model loaded): the container health
    /// check, which needs no shell and no curl.
    Healthcheck {
        /// The coordinator's address [default: its --listen /
        /// OMNI_COORDINATOR_LISTEN, 0.0.0.0 as 127.0.0.1].
        #[arg(
            long,
            env = "OMNI_COORDINATOR_LISTEN",
            default_value = "127.0.0.1:7070"
        )]
        addr: String,
        /// Seconds to wait for the answer.
        #[arg(long, default_value_t = 3.0)]
        timeout: f64,
    },
}

fn main() {
    omni_telemetry::forget_empty_settings();
    let matches = Cli::command().get_matches();
    if matches.subcommand().is_some() {
        let Command::Healthcheck { addr, timeout } =
            Command::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        std::process::exit(omni_transport::health::healthcheck_main(
            "omni-coordinator",
            &addr,
            omni_coordinator::HEALTH_SERVICE,
            timeout,
        ));
    }
    let cfg = omni_coordinator::CoordinatorConfig::from_arg_matches(&matches)
        .unwrap_or_else(|e| e.format(&mut Cli::command()).exit());
    let telemetry = cfg.telemetry.clone();
    omni_telemetry::service_main(
        "omni-coordinator",
        None,
        &telemetry,
        omni_coordinator::run(cfg),
    )
}
