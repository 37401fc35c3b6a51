//! A tiny HTTP listener for Prometheus: `GET /metrics` renders whatever the
//! process registered. Every omni service exposes one (workers and the
//! coordinator); it lives here because all of them already link this crate.

use std::sync::Arc;

pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// Binds `addr` and serves `/metrics` in the background; returns the bound address.
pub async fn serve(addr: &str, render: Render) -> std::io::Result<std::net::SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let r = render.clone();
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    r(),
                )
            }
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("metrics listener stopped: {e}");
        }
    });
    tracing::info!("metrics on http://{local}/metrics");
    Ok(local)
}
