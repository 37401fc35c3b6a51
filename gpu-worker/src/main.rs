//! `omni-gpu-worker`: one process per device, running one layer range.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "omni-gpu-worker",
    version,
    about = "omni worker: runs one layer range of a model on one device"
)]
struct Cli {
    #[command(flatten)]
    cfg: omni_gpu_worker::WorkerConfig,
}

fn main() {
    let cli = Cli::parse();
    let telemetry = cli.cfg.telemetry.clone();
    let id = cli.cfg.worker_id();
    omni_telemetry::service_main(
        "omni-gpu-worker",
        Some(&id),
        &telemetry,
        omni_gpu_worker::run(cli.cfg),
    )
}
