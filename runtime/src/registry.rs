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

/// What a worker holds from an earlier coordinator, told in its
/// registration (see RegisterRequest.held).
#[derive(Clone, Debug, Default)]
pub struct Held {
    /// A stage worker's last Load, as it runs now.
    pub stage: Option<omni_proto::worker::v1::LoadRequest>,
    /// An expert worker's model and layers.
    pub experts: Option<(String, Vec<u32>)>,
}

/// Who a worker is, as it registers (again).
pub struct Identity<'a> {
    pub id: &'a str,
    pub advertise: &'a str,
    pub inventory: Inventory,
    pub kind: WorkerKind,
}

/// Registers with the coordinator at `coordinator`, retrying for `timeout`
/// seconds while it cannot be reached. Returns the coordinator's instance
/// (see [`serve_while_coordinator_lives`]).
pub async fn register(
    coordinator: &str,
    timeout: f64,
    who: &Identity<'_>,
    last_exit: Option<&str>,
    held: Held,
) -> anyhow::Result<String> {
    let deadline = Instant::now() + Duration::from_secs_f64(timeout);
    let url = format!("http://{coordinator}");
    let id = who.id;
    let mut last_err = String::new();
    let (held_expert_model, held_expert_layers) = held.experts.unwrap_or_default();
    while Instant::now() < deadline {
        let channel = match omni_transport::tls::endpoint(&url) {
            Ok(ep) => ep.connect_timeout(Duration::from_secs(5)).connect().await,
            Err(e) => anyhow::bail!("bad coordinator address {coordinator}: {e}"),
        };
        match channel.map(RegistryClient::new) {
            Ok(mut c) => {
                let req = RegisterRequest {
                    worker_id: id.to_string(),
                    grpc_addr: who.advertise.to_string(),
                    inventory: Some(who.inventory.clone()),
                    kind: who.kind as i32,
                    last_exit: last_exit.unwrap_or_default().to_string(),
                    held: held.stage.clone(),
                    held_expert_model: held_expert_model.clone(),
                    held_expert_layers: held_expert_layers.clone(),
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
                    // (A TLS 1.3 server refuses a client's certificate after
                    // the handshake: the call fails, its cause says why.)
                    Err(s) if s.code() != tonic::Code::Unavailable => {
                        let why = match std::error::Error::source(&s) {
                            Some(cause) => omni_transport::tls::describe(cause),
                            None => s.message().to_string(),
                        };
                        anyhow::bail!(
                            "the coordinator at {coordinator} refused worker {id}: {why} ({:?})",
                            s.code()
                        )
                    }
                    Err(s) => last_err = s.message().to_string(),
                }
            }
            Err(e) => last_err = omni_transport::tls::describe(&e),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!(
        "could not register with the coordinator at {coordinator} within {timeout:.0}s: {last_err}"
    )
}

/// `--orphan-grace`'s default (seconds): long enough for a supervisor to
/// start a coordinator again, or for an upgrade to replace it.
pub const DEFAULT_ORPHAN_GRACE: f64 = 300.0;

/// How often a worker asks whether its coordinator is the process it
/// registered with.
const COORDINATOR_CHECK: Duration = Duration::from_secs(2);

/// Runs a worker's gRPC `server` (spawned) until it ends, or until the
/// worker should exit (an error with the reason).
///
/// A worker outlives its coordinator (issue 42): when another coordinator
/// process answers at `coordinator` than `instance` (the one this worker
/// registered with), it registers with the new one, telling it what it
/// holds (`held()`), so that the new coordinator can keep its layers and KV
/// cache instead of loading them again. While no coordinator answers it
/// keeps its state for `grace` (`--orphan-grace`), then exits so that its
/// supervisor starts it afresh and its memory is free. A zero `grace` is
/// the old way: exit as soon as another coordinator answers, and wait for
/// one that does not answer for ever.
pub async fn serve_while_coordinator_lives(
    mut server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    coordinator: &str,
    instance: String,
    grace: Duration,
    who: &Identity<'_>,
    held: impl Fn() -> Held,
) -> anyhow::Result<()> {
    let mut instance = instance;
    let mut lost_since: Option<Instant> = None;
    loop {
        tokio::select! {
            r = &mut server => return Ok(r??),
            now = coordinator_instance(coordinator) => match now {
                Some(now) if instance.is_empty() || now == instance => {
                    if lost_since.take().is_some() {
                        tracing::info!("the coordinator at {coordinator} answers again");
                    }
                }
                Some(now) if grace.is_zero() => anyhow::bail!(
                    "the coordinator at {coordinator} restarted (it was {instance}, now {now}): \
                     this worker's state belongs to the old one; exiting so that it starts afresh \
                     and registers again (--orphan-grace 0)"
                ),
                Some(now) => {
                    tracing::warn!(
                        "the coordinator at {coordinator} restarted (it was {instance}, now {now}): \
                         registering with the new one, keeping what this worker holds"
                    );
                    // The new coordinator waits for its workers for its own
                    // --register-timeout; this worker tries for its grace.
                    instance = register(coordinator, grace.as_secs_f64(), who, None, held()).await?;
                    lost_since = None;
                }
                None if grace.is_zero() => {}
                None => {
                    let since = *lost_since.get_or_insert_with(|| {
                        tracing::warn!(
                            "the coordinator at {coordinator} does not answer; keeping this worker's \
                             state for {:.0}s (--orphan-grace) for it or its successor",
                            grace.as_secs_f64()
                        );
                        Instant::now()
                    });
                    if since.elapsed() > grace {
                        anyhow::bail!(
                            "no coordinator answered at {coordinator} for {:.0}s (--orphan-grace): \
                             exiting, so that this worker's memory is free and it starts afresh",
                            grace.as_secs_f64()
                        );
                    }
                }
            },
        }
    }
}

/// After [`COORDINATOR_CHECK`], the instance of the coordinator at
/// `coordinator`, or None when it does not answer.
async fn coordinator_instance(coordinator: &str) -> Option<String> {
    use omni_proto::coordinator::v1::{inference_client::InferenceClient, InfoRequest};
    tokio::time::sleep(COORDINATOR_CHECK).await;
    let url = format!("http://{coordinator}");
    // A fresh connection each time: a lazy channel's reconnect backoff
    // doubled the time to notice a restarted coordinator (4 s -> 8 s).
    let ask = async {
        let ch = omni_transport::tls::endpoint(&url)
            .ok()?
            .connect_timeout(COORDINATOR_CHECK)
            .connect()
            .await
            .ok()?;
        let info = InferenceClient::new(ch).info(InfoRequest {}).await.ok()?;
        Some(info.into_inner().instance)
    };
    tokio::time::timeout(COORDINATOR_CHECK * 2, ask)
        .await
        .ok()
        .flatten()
}
