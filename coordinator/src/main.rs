//! `omni-coordinator`: waits for its workers, plans, loads, then serves Inference.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "omni-coordinator",
    version,
    about = "omni coordinator: plans layers across workers and serves Inference over gRPC",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
// Parsed by `omni_runtime::start`: the service's required flags are
// only required when no subcommand is given.
struct Cli {
    #[command(subcommand)]
    command: Option<omni_runtime::start::ServiceCommand>,
    /// A TOML file whose [coordinator] table gives settings (also OMNI_CONFIG); OMNI_COORDINATOR_<SETTING> variables, then flags, override it.
    #[arg(long, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    #[command(flatten)]
    cfg: omni_coordinator::CoordinatorConfig,
}

fn main() {
    let cfg: omni_coordinator::CoordinatorConfig =
        omni_runtime::start::settings_or_healthcheck::<Cli, _>(
            "omni-coordinator",
            omni_coordinator::HEALTH_SERVICE,
            omni_runtime::config::Service {
                table: "coordinator",
                env_prefix: "OMNI_COORDINATOR_",
                not_settings: &[],
                structured: &[],
            },
        );
    let telemetry = cfg.telemetry.clone();
    omni_runtime::service_main(
        "omni-coordinator",
        None,
        &telemetry,
        omni_coordinator::run(cfg),
    )
}
