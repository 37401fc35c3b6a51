//! `omni-router`: the OpenAI-compatible HTTP API.

use clap::Parser;
use omni_router::config::{print_config, RouterConfig, SERVICE};

#[derive(Parser)]
#[command(
    name = "omni-router",
    version,
    about = "omni router: the OpenAI API in front of omni coordinators",
    args_conflicts_with_subcommands = true
)]
// Parsed by `omni_runtime::start`.
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// A TOML file whose [router] table gives settings (also OMNI_CONFIG, else ./omni.toml when there is one); OMNI_ROUTER_<SETTING> variables, then flags, override it.
    #[arg(long, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    #[command(flatten)]
    cfg: RouterConfig,
}

#[derive(clap::Subcommand)]
#[allow(dead_code)] // read by name in omni_runtime::start
enum Command {
    /// Print the settings this service would run with, as the TOML table of
    /// its config file: each with where it came from (default, file,
    /// variable, flag), secrets masked. Takes the service's flags.
    PrintConfig,
    /// Ask the running router's GET /ready (exit 0 on 200: every cluster
    /// backend serves): the container health check, which needs no shell
    /// and no curl.
    Healthcheck {
        #[command(flatten)]
        args: omni_runtime::start::HealthcheckArgs,
        /// The URL to ask instead, e.g. http://127.0.0.1:8080/ready.
        #[arg(long)]
        url: Option<String>,
    },
}

fn main() {
    omni_runtime::warn_secret_flags(
        "omni-router",
        &[("--api-key", "OMNI_ROUTER_API_KEY or --api-keys-file")],
    );
    let parsed =
        omni_runtime::start::start::<Cli, RouterConfig>("omni-router", SERVICE, healthcheck);
    // The router requires no setting, so there are settings to check even
    // for print-config.
    let Some(cfg) = &parsed.settings else {
        eprintln!("omni-router: error: the settings are incomplete");
        std::process::exit(2)
    };
    let settings = cfg.settings(&parsed.merged).unwrap_or_else(|e| {
        eprintln!("omni-router: error: {e}");
        std::process::exit(2)
    });
    if let Some(table) = &parsed.print {
        print!("{}", print_config(table, cfg, &settings));
        return;
    }
    let telemetry = omni_telemetry::TelemetryArgs {
        otlp_endpoint: settings.otlp_endpoint.clone(),
    };
    omni_runtime::service_main_graceful("omni-router", None, &telemetry, omni_router::run(settings))
}

/// GET /ready (with --live, /health) on the running router; the exit
/// status of `healthcheck`.
/// `listen` is the router's address (`--addr`, else its `listen` setting).
fn healthcheck(listen: &str, m: &clap::ArgMatches) -> i32 {
    let timeout = *m
        .get_one::<f64>("timeout")
        .expect("--timeout has a default");
    // --live: GET /health, which answers as soon as the router listens.
    let path = if m.get_flag("live") {
        "health"
    } else {
        "ready"
    };
    let url = match m.get_one::<String>("url") {
        Some(u) => u.clone(),
        None => match omni_runtime::probe_addr(listen) {
            Ok(a) => format!("http://{a}/{path}"),
            Err(e) => {
                eprintln!("omni-router healthcheck: {e}");
                return 2;
            }
        },
    };
    let Ok(wait) = std::time::Duration::try_from_secs_f64(timeout) else {
        eprintln!("omni-router healthcheck: --timeout {timeout} is not a number of seconds");
        return 2;
    };
    let ask = async {
        let r = reqwest::Client::builder()
            .timeout(wait)
            .build()
            .map_err(|e| e.to_string())?
            .get(&url)
            .send()
            .await
            .map_err(|e| format!("no answer: {e}"))?;
        let status = r.status();
        let body = r.text().await.unwrap_or_default();
        if status.is_success() {
            Ok(body)
        } else {
            Err(format!("{status}: {body}"))
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    match rt
        .map_err(|e| e.to_string())
        .and_then(|rt| rt.block_on(ask))
    {
        Ok(body) => {
            println!("omni-router {url}: {}", body.trim());
            0
        }
        Err(why) => {
            eprintln!("omni-router {url}: not ready: {why}");
            1
        }
    }
}
