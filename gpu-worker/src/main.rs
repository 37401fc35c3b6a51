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
        r = omni_gpu_worker::run(cli.cfg) => r,
        _ = omni_gpu_worker::shutdown_signal() => Ok(()),
    };
    if let Err(e) = result {
        eprintln!("omni-gpu-worker: error: {e:#}");
        std::process::exit(1);
    }
}
