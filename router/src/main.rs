//! `omni-router`: the OpenAI-compatible HTTP API.

use clap::Parser;
use omni_router::RouterConfig;

#[derive(Parser)]
#[command(
    name = "omni-router",
    version,
    about = "omni router: the OpenAI API in front of omni coordinators",
    // `print-config` takes the flags itself: `omni-router print-config --config F`.
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    cfg: RouterConfig,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Print the merged settings (defaults, config file, environment,
    /// flags) as TOML, secrets masked, and exit.
    PrintConfig(RouterConfig),
}

fn main() {
    let cli = Cli::parse();
    let (cfg, print) = match cli.command {
        Some(Command::PrintConfig(cfg)) => (cfg, true),
        None => (cli.cfg, false),
    };
    let settings = cfg.settings().unwrap_or_else(|e| {
        eprintln!("omni-router: error: {e}");
        std::process::exit(2)
    });
    if print {
        println!("{}", settings.to_toml().trim_end());
        return;
    }
    let telemetry = omni_telemetry::TelemetryArgs {
        otlp_endpoint: settings.otlp_endpoint.clone(),
    };
    omni_telemetry::service_main("omni-router", None, &telemetry, omni_router::run(settings))
}
