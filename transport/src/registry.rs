//! Joining a cluster, for every kind of worker: listen on an address that
//! is not the coordinator's own, and register with the coordinator,
//! retrying while it cannot be reached.

use anyhow::Context;
use omni_proto::coordinator::v1::{registry_client::RegistryClient, RegisterRequest, WorkerKind};
use omni_proto::worker::v1::Inventory;
use std::time::{Duration, Instant};

/// Binds `listen`, refusing an address that is the coordinator's own (a
/// port picked for the coordinator and taken by this worker's port 0
/// meanwhile: registering would reach this worker itself).
pub async fn listen(
    listen: &str,
    coordinator: &str,
) -> anyhow::Result<(tokio::net::TcpListener, std::net::SocketAddr)> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let local = listener.local_addr()?;
    if let Ok(addrs) = tokio::net::lookup_host(coordinator).await {
        if addrs.into_iter().any(|a| a == local) {
            anyhow::bail!(
                "the coordinator address {coordinator} is this worker's own listening address; is the coordinator running there?"
            );
        }
    }
    Ok((listener, local))
}

/// Registers with the coordinator at `coordinator`, retrying for `timeout`
/// seconds while it cannot be reached.
pub async fn register(
    coordinator: &str,
    timeout: f64,
    id: &str,
    advertise: &str,
    inventory: Inventory,
    kind: WorkerKind,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs_f64(timeout);
    let url = format!("http://{coordinator}");
    let mut last_err = String::new();
    while Instant::now() < deadline {
        match RegistryClient::connect(url.clone()).await {
            Ok(mut c) => {
                let req = RegisterRequest {
                    worker_id: id.to_string(),
                    grpc_addr: advertise.to_string(),
                    inventory: Some(inventory.clone()),
                    kind: kind as i32,
                };
                match c.register(req).await {
                    Ok(r) => {
                        tracing::info!(
                            "registered with the coordinator at {coordinator} (model {})",
                            r.into_inner().model_path
                        );
                        return Ok(());
                    }
                    // The coordinator answered and said no: retrying won't help.
                    Err(s) if s.code() != tonic::Code::Unavailable => {
                        anyhow::bail!(
                            "the coordinator at {coordinator} refused worker {id}: {} ({:?})",
                            s.message(),
                            s.code()
                        )
                    }
                    Err(s) => last_err = s.message().to_string(),
                }
            }
            Err(e) => last_err = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!(
        "could not register with the coordinator at {coordinator} within {timeout:.0}s: {last_err}"
    )
}
