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
    command: Option<Command>,
    /// A TOML file whose [coordinator] table gives settings (also OMNI_CONFIG); OMNI_COORDINATOR_<SETTING> variables, then flags, override it.
    #[arg(long, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    #[command(flatten)]
    cfg: omni_coordinator::CoordinatorConfig,
}

#[derive(clap::Subcommand)]
#[allow(dead_code)] // read by name in omni_runtime::start
enum Command {
    /// Probe a running coordinator (exit 0 when its Inference service is
    /// SERVING: workers registered, the model loaded): the container health
    /// check, which needs no shell and no curl.
    Healthcheck(omni_runtime::start::HealthcheckArgs),
    /// Print the settings this service would run with, as the TOML table of
    /// its config file: each with where it came from (default, file,
    /// variable, flag), secrets masked. Takes the service's flags.
    PrintConfig,
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
