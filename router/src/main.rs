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
    /// Ask the running router's GET /ready (exit 0 on 200: every cluster
    /// backend serves): the container health check, which needs no shell
    /// and no curl. The address is the merged `listen` setting (0.0.0.0 as
    /// 127.0.0.1), unless --url names one.
    Healthcheck {
        #[command(flatten)]
        cfg: RouterConfig,
        /// The URL to ask instead, e.g. http://127.0.0.1:8080/ready.
        #[arg(long)]
        url: Option<String>,
        /// Seconds to wait for the answer.
        #[arg(long, default_value_t = 5.0)]
        timeout: f64,
    },
}

fn main() {
    omni_runtime::forget_empty_settings();
    omni_runtime::warn_secret_flags(
        "omni-router",
        &[("--api-key", "OMNI_API_KEYS or --api-keys-file")],
    );
    let cli = Cli::parse();
    let (cfg, print) = match cli.command {
        Some(Command::PrintConfig(cfg)) => (cfg, true),
        Some(Command::Healthcheck { cfg, url, timeout }) => {
            std::process::exit(healthcheck(cfg, url, timeout))
        }
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
    omni_runtime::service_main("omni-router", None, &telemetry, omni_router::run(settings))
}

/// GET /ready on the running router; the exit status of `healthcheck`.
fn healthcheck(cfg: RouterConfig, url: Option<String>, timeout: f64) -> i32 {
    let url = match url {
        Some(u) => u,
        None => {
            let addr = cfg
                .settings()
                .map_err(|e| e.to_string())
                .and_then(|s| omni_runtime::probe_addr(&s.listen));
            match addr {
                Ok(a) => format!("http://{a}/ready"),
                Err(e) => {
                    eprintln!("omni-router healthcheck: {e}");
                    return 2;
                }
            }
        }
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
