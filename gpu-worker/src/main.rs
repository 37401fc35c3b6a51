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
    command: Option<omni_runtime::start::ServiceCommand>,
    /// A TOML file whose [worker] table gives settings (also OMNI_CONFIG); OMNI_WORKER_<SETTING> variables, then flags, override it.
    #[arg(long, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    #[command(flatten)]
    cfg: omni_gpu_worker::WorkerConfig,
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
