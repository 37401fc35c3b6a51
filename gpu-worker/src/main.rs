//! `omni-gpu-worker`: one process per device, running one layer range.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "omni-gpu-worker",
    version,
    about = "omni worker: runs one layer range of a model on one device",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
// Parsed by `omni_runtime::start`: the service's required flags are
// only required when no subcommand is given.
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// A TOML file whose [worker] table gives settings (also OMNI_CONFIG); OMNI_WORKER_<SETTING> variables, then flags, override it.
    #[arg(long, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    #[command(flatten)]
    cfg: omni_gpu_worker::WorkerConfig,
}

#[derive(clap::Subcommand)]
#[allow(dead_code)] // read by name in omni_runtime::start
enum Command {
    /// Probe a running worker's gRPC health (exit 0 when SERVING): the
    /// container health check, which needs no shell and no curl.
    Healthcheck(omni_runtime::start::HealthcheckArgs),
    /// Print the settings this service would run with, as the TOML table of
    /// its config file: each with where it came from (default, file,
    /// variable, flag), secrets masked. Takes the service's flags.
    PrintConfig,
}

fn main() {
    let cfg: omni_gpu_worker::WorkerConfig = omni_runtime::start::settings_or_healthcheck::<Cli, _>(
        "omni-gpu-worker",
        "",
        omni_runtime::config::Service {
            table: "worker",
            env_prefix: "OMNI_WORKER_",
            not_settings: &[omni_telemetry::crash::LAST_EXIT_ENV],
            structured: &[],
        },
    );
    let telemetry = cfg.telemetry.clone();
    let id = cfg.worker_id();
    omni_runtime::service_main(
        "omni-gpu-worker",
        Some(&id),
        &telemetry,
        omni_gpu_worker::run(cfg),
    )
}
