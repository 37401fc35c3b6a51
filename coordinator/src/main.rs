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
// Parsed by `settings_or_healthcheck`: the service's required flags are
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
#[allow(dead_code)] // read by name in settings_or_healthcheck
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
    /// Print the settings this service would run with, as the TOML table of
    /// its config file: each with where it came from (default, file,
    /// variable, flag), secrets masked. Takes the service's flags.
    PrintConfig,
}

fn main() {
    let cfg: omni_coordinator::CoordinatorConfig =
        omni_runtime::health::settings_or_healthcheck::<Cli, _>(
            "omni-coordinator",
            omni_coordinator::HEALTH_SERVICE,
            omni_runtime::config::Service {
                table: "coordinator",
                env_prefix: "OMNI_COORDINATOR_",
                not_settings: &[],
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
