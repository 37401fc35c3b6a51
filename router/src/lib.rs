//! router: the OpenAI-compatible HTTP API in front of omni's coordinators.
//! `openai` holds the API's types, validation and mapping; `server` the
//! axum routes. The router links no tensor code.

pub mod backends;
pub mod openai;
pub mod server;

use anyhow::Context;
use omni_proto::coordinator::v1::inference_client::InferenceClient;
use std::sync::Arc;
use std::time::Duration;

/// Settings of the router (flags, or `OMNI_ROUTER_*` variables).
#[derive(Clone, Debug, clap::Args)]
pub struct RouterConfig {
    /// Where the HTTP API listens.
    #[arg(long, env = "OMNI_ROUTER_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// A served model: NAME=COORDINATOR_ADDR[,ALIAS...] (repeatable), e.g.
    /// `gemma3-270m=127.0.0.1:7070,gemma,auto`.
    #[arg(
        long = "model",
        env = "OMNI_ROUTER_MODELS",
        value_delimiter = ';',
        required = true
    )]
    pub models: Vec<String>,
    /// An upstream OpenAI-compatible server: NAME=URL[#UPSTREAM_MODEL][,ALIAS...]
    /// (repeatable), e.g. `big=http://10.0.0.5:8080/v1#deepseek-r1,deepseek`.
    #[arg(
        long = "upstream",
        env = "OMNI_ROUTER_UPSTREAMS",
        value_delimiter = ';'
    )]
    pub upstreams: Vec<String>,
    /// Keys for upstreams: NAME=KEY (repeatable).
    #[arg(
        long = "upstream-key",
        env = "OMNI_UPSTREAM_KEYS",
        value_delimiter = ';'
    )]
    pub upstream_keys: Vec<String>,
    /// Rules for the model name `auto`, tried in order:
    /// `prompt_chars>2000=big;keyword:code=qwen;default=gemma`.
    #[arg(long, env = "OMNI_ROUTER_AUTO")]
    pub auto: Option<String>,
    /// API keys clients must send as `Authorization: Bearer KEY`
    /// (comma-separated); none means no authentication.
    #[arg(long = "api-key", env = "OMNI_API_KEYS", value_delimiter = ',')]
    pub api_keys: Vec<String>,
    /// Requests served at once; beyond it, 429 with Retry-After.
    #[arg(long, env = "OMNI_ROUTER_MAX_IN_FLIGHT", default_value_t = 64)]
    pub max_in_flight: usize,
    /// Largest request body in bytes; beyond it, 413.
    #[arg(long, env = "OMNI_ROUTER_BODY_LIMIT", default_value_t = 4 << 20)]
    pub body_limit: usize,
}

/// Parses `NAME=ADDR[,ALIAS...]` (also `NAME=URL[,ALIAS...]`).
fn parse_model(spec: &str) -> anyhow::Result<(String, String, Vec<String>)> {
    let (name, rest) = spec
        .split_once('=')
        .with_context(|| format!("--model '{spec}': expected NAME=COORDINATOR_ADDR[,ALIAS...]"))?;
    let mut parts = rest.split(',').map(str::trim).filter(|s| !s.is_empty());
    let addr = parts
        .next()
        .with_context(|| format!("--model '{spec}': no coordinator address"))?;
    Ok((
        name.trim().to_string(),
        addr.to_string(),
        parts.map(String::from).collect(),
    ))
}

/// Serves until the process is stopped.
pub async fn run(cfg: RouterConfig) -> anyhow::Result<()> {
    let mut backends = Vec::new();
    for spec in &cfg.models {
        let (name, addr, aliases) = parse_model(spec)?;
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .with_context(|| format!("bad coordinator address '{addr}'"))?
            .connect_timeout(Duration::from_secs(5))
            .connect_lazy();
        tracing::info!("model {name} (aliases: {aliases:?}) served by the coordinator at {addr}");
        backends.push(server::Backend {
            name,
            aliases,
            target: server::Target::Cluster(
                InferenceClient::new(ch).max_decoding_message_size(64 << 20),
            ),
        });
    }
    for spec in &cfg.upstreams {
        let (name, url, aliases) = parse_model(spec)?;
        let (base, model) = match url.split_once('#') {
            Some((b, m)) => (b.to_string(), m.to_string()),
            None => (url.clone(), name.clone()),
        };
        let key = cfg.upstream_keys.iter().find_map(|k| {
            k.split_once('=')
                .filter(|(n, _)| n.trim() == name)
                .map(|(_, v)| v.trim().to_string())
        });
        tracing::info!(
            "model {name} (aliases: {aliases:?}) passed to the upstream {base} as '{model}'"
        );
        backends.push(server::Backend {
            name,
            aliases,
            target: server::Target::Upstream {
                base: base.trim_end_matches('/').to_string(),
                model,
                key,
            },
        });
    }
    if backends.is_empty() {
        anyhow::bail!("no models: give --model NAME=COORDINATOR_ADDR or --upstream NAME=URL");
    }
    let auto = match &cfg.auto {
        Some(spec) => backends::parse_auto(spec).map_err(anyhow::Error::msg)?,
        None => Vec::new(),
    };
    for (_, m) in &auto {
        if !backends
            .iter()
            .any(|b| &b.name == m || b.aliases.contains(m))
        {
            anyhow::bail!("auto rule names model '{m}', which no --model or --upstream serves");
        }
    }
    let state = Arc::new(server::AppState::new(
        backends,
        auto,
        cfg.api_keys
            .iter()
            .filter(|k| !k.is_empty())
            .cloned()
            .collect(),
        cfg.max_in_flight.max(1),
        cfg.body_limit,
    ));
    let listener = tokio::net::TcpListener::bind(&cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    tracing::info!(
        "OpenAI API on http://{}/v1 ({} model(s), {} API key(s), at most {} requests at once)",
        listener.local_addr()?,
        state.backends.len(),
        state.api_keys.len(),
        state.max_in_flight
    );
    axum::serve(listener, server::app(state)).await?;
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
