//! `omni-router`: the OpenAI-compatible HTTP API.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "omni-router",
    version,
    about = "omni router: the OpenAI API in front of omni coordinators"
)]
struct Cli {
    #[command(flatten)]
    cfg: omni_router::RouterConfig,
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
        r = omni_router::run(cli.cfg) => r,
        _ = omni_router::shutdown_signal() => Ok(()),
    };
    if let Err(e) = result {
        eprintln!("omni-router: error: {e:#}");
        std::process::exit(1);
    }
}
