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
// Parsed by `settings_or_healthcheck`: the service's required flags are
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
#[allow(dead_code)] // read by name in settings_or_healthcheck
enum Command {
    /// Probe a running worker's gRPC health (exit 0 when SERVING): the
    /// container health check, which needs no shell and no curl.
    Healthcheck {
        /// The worker's address [default: its --listen / OMNI_WORKER_LISTEN,
        /// 0.0.0.0 as 127.0.0.1].
        #[arg(long, env = "OMNI_WORKER_LISTEN", default_value = "127.0.0.1:0")]
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
    let cfg: omni_gpu_worker::WorkerConfig = omni_runtime::health::settings_or_healthcheck::<Cli, _>(
        "omni-gpu-worker",
        "",
        omni_runtime::config::Service {
            table: "worker",
            env_prefix: "OMNI_WORKER_",
            not_settings: &[omni_telemetry::crash::LAST_EXIT_ENV],
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
