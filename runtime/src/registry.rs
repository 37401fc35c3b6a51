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
/// seconds while it cannot be reached. Returns the coordinator's instance
/// (see [`serve_while_coordinator_lives`]).
pub async fn register(
    coordinator: &str,
    timeout: f64,
    id: &str,
    advertise: &str,
    inventory: Inventory,
    kind: WorkerKind,
    last_exit: Option<&str>,
) -> anyhow::Result<String> {
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
                    last_exit: last_exit.unwrap_or_default().to_string(),
                };
                match c.register(req).await {
                    Ok(r) => {
                        let r = r.into_inner();
                        tracing::info!(
                            "registered with the coordinator at {coordinator} (model {})",
                            r.model_path
                        );
                        return Ok(r.instance);
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

/// How often a worker asks whether its coordinator is the process it
/// registered with.
const COORDINATOR_CHECK: Duration = Duration::from_secs(2);

/// Runs a worker's gRPC `server` (spawned) until it ends, or until the
/// coordinator at `coordinator` is another process than `instance` (the
/// one this worker registered with): then an error with the reason. A
/// restarted coordinator knows nothing of this worker, and the worker holds
/// state for the old one: it should exit so that its supervisor (compose's
/// restart policy) starts it afresh and it registers with the new one.
pub async fn serve_while_coordinator_lives(
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    coordinator: &str,
    instance: &str,
) -> anyhow::Result<()> {
    tokio::select! {
        r = server => Ok(r??),
        why = coordinator_restarted(coordinator, instance) => Err(anyhow::anyhow!(why)),
    }
}

/// Returns, with the reason, once the coordinator at `coordinator` answers
/// Info as another instance than `instance`. While it does not answer, it
/// keeps asking: it may come back.
async fn coordinator_restarted(coordinator: &str, instance: &str) -> String {
    use omni_proto::coordinator::v1::{inference_client::InferenceClient, InfoRequest};
    let url = format!("http://{coordinator}");
    loop {
        tokio::time::sleep(COORDINATOR_CHECK).await;
        // A fresh connection each time: a lazy channel's reconnect backoff
        // doubled the time to notice a restarted coordinator (4 s -> 8 s).
        let ask = async {
            let ch = tonic::transport::Endpoint::from_shared(url.clone())
                .ok()?
                .connect_timeout(COORDINATOR_CHECK)
                .connect()
                .await
                .ok()?;
            let info = InferenceClient::new(ch).info(InfoRequest {}).await.ok()?;
            Some(info.into_inner().instance)
        };
        match tokio::time::timeout(COORDINATOR_CHECK * 2, ask).await {
            Ok(Some(now)) if !instance.is_empty() && now != instance => {
                return format!(
                    "the coordinator at {coordinator} restarted (it was {instance}, now {now}): \
                     this worker's state belongs to the old one; exiting so that it starts afresh \
                     and registers again"
                );
            }
            _ => {}
        }
    }
}
