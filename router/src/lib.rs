//! router: the OpenAI-compatible HTTP API in front of omni's coordinators.
//! `openai` holds the API's types, validation and mapping; `server` the
//! axum routes. The router links no tensor code.

pub mod backends;
pub mod config;
pub mod openai;
pub mod resume;
pub mod server;

use anyhow::Context;
use omni_proto::coordinator::v1::inference_client::InferenceClient;
use std::sync::Arc;
use std::time::Duration;

pub use config::{RouterConfig, RouterSettings};

/// Serves until the process is stopped.
pub async fn run(cfg: RouterSettings) -> anyhow::Result<()> {
    omni_transport::tls::install(&cfg.tls)?;
    let mut backends = Vec::new();
    for m in &cfg.models {
        let (name, aliases) = (m.name.clone(), m.aliases.clone());
        let target = match (&m.coordinator, &m.upstream) {
            (Some(addr), _) => {
                let ch = omni_transport::tls::endpoint(addr)
                    .with_context(|| format!("model {name}: bad coordinator address '{addr}'"))?
                    .connect_timeout(Duration::from_secs(5))
                    .connect_lazy();
                tracing::info!(
                    "model {name} (aliases: {aliases:?}) served by the coordinator at {addr}"
                );
                server::Target::Cluster {
                    client: InferenceClient::new(ch).max_decoding_message_size(64 << 20),
                    addr: addr.clone(),
                }
            }
            (None, Some(base)) => {
                let model = m.upstream_model.clone().unwrap_or_else(|| name.clone());
                tracing::info!(
                    "model {name} (aliases: {aliases:?}) passed to the upstream {base} as '{model}'"
                );
                server::Target::Upstream {
                    base: base.trim_end_matches('/').to_string(),
                    model,
                    key: m.api_key.clone(),
                }
            }
            (None, None) => anyhow::bail!("model {name} has no coordinator and no upstream"),
        };
        backends.push(server::Backend {
            name,
            aliases,
            target,
        });
    }
    // `auto` is always served (clients such as the seeds' LangGraph router
    // send it): the auto rules, then the first model when none matches.
    use crate::backends::Rule;
    let mut auto = cfg.auto_rules()?;
    if !auto.iter().any(|(r, _)| *r == Rule::Default) {
        if let Some(first) = backends.first() {
            auto.push((Rule::Default, first.name.clone()));
        }
    }
    if let Some((_, fallback)) = auto.iter().find(|(r, _)| *r == Rule::Default) {
        tracing::info!(
            "model 'auto': {} rule(s), then {fallback}",
            auto.iter().take_while(|(r, _)| *r != Rule::Default).count()
        );
    }
    let mut state = server::AppState::new(
        backends,
        auto,
        cfg.api_keys
            .iter()
            .filter(|k| !k.is_empty())
            .cloned()
            .collect(),
        cfg.max_in_flight.max(1),
        cfg.body_limit,
    );
    state.resume_timeout = std::time::Duration::from_secs_f64(cfg.resume_timeout);
    let state = Arc::new(state);
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
    // SIGTERM (an upgrade, `docker stop`) or Ctrl-C: no new connections,
    // and the requests in flight finish before the process exits.
    let in_flight = state.clone();
    axum::serve(listener, server::app(state))
        .with_graceful_shutdown(async move {
            omni_runtime::shutdown_signal().await;
            tracing::info!(
                "stopping: no new connections; finishing the {} request(s) in flight",
                in_flight.max_in_flight - in_flight.limit.available_permits()
            );
        })
        .await?;
    tracing::info!("router stopped");
    Ok(())
}
