//! A request outlives its coordinator (issue 42; ARCHITECTURE.md, "The
//! router holds the requests"). The router keeps, per choice, what the
//! client already has: the prompt's ids and the seed from the first event,
//! and every token since. When the coordinator's stream breaks and the
//! coordinator that served it is gone (its address answers as another
//! process, or not at all), the router calls Generate again at the same
//! address with a `resume` of those tokens, retrying for `--resume-timeout`
//! while no coordinator serves there; the new coordinator computes the
//! prompt and those tokens again without sending them, and the client's
//! stream goes on where it paused. An error the coordinator itself sent
//! (the same process still answers) reaches the client as before.

use std::time::{Duration, Instant};

use omni_proto::coordinator::v1::{
    inference_client::InferenceClient, GenerateEvent, GenerateRequest, InfoRequest, Resume,
};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::Channel;

/// One choice's events, carried across coordinator restarts.
pub type Events =
    std::pin::Pin<Box<dyn Stream<Item = Result<GenerateEvent, tonic::Status>> + Send>>;

/// How long a retry waits between tries while no coordinator serves.
const RETRY: Duration = Duration::from_millis(200);

/// Starts `req` on the coordinator `client` reaches (an error here is the
/// call's own: the client gets it as an HTTP status) and returns its events,
/// resumed on the coordinator that answers there next if this one goes away
/// mid-request, for up to `timeout`.
pub async fn generate(
    client: &InferenceClient<Channel>,
    req: GenerateRequest,
    traceparent: Option<String>,
    timeout: Duration,
) -> Result<Events, tonic::Status> {
    let req = GenerateRequest {
        resumable: true,
        ..req
    };
    let mut c = client.clone();
    let first = c
        .generate(crate::server::traced(req.clone(), traceparent.as_deref()))
        .await?
        .into_inner();
    let client = client.clone();
    Ok(Box::pin(async_stream::stream! {
        let client = &client;
        let mut stream = first;
        let mut req = req;
        // What the client has: the prompt and seed from the first event,
        // every token since.
        let mut prompt_ids: Vec<u32> = Vec::new();
        let mut generated: Vec<u32> = Vec::new();
        let mut instance = String::new();
        loop {
            let broken = match stream.next().await {
                Some(Ok(ev)) => {
                    if !ev.instance.is_empty() {
                        instance = ev.instance.clone();
                        if prompt_ids.is_empty() {
                            prompt_ids = ev.prompt_ids.clone();
                        }
                        if let Some(seed) = ev.seed {
                            req.sampling.get_or_insert_with(Default::default).seed = Some(seed);
                        }
                    }
                    let empty = ev.tokens.is_empty()
                        && ev.text.is_empty()
                        && ev.tool_calls.is_empty()
                        && ev.done.is_none();
                    if empty {
                        // The admission event: nothing for the client.
                        continue;
                    }
                    generated.extend(ev.tokens.iter().map(|t| t.id));
                    let done = ev.done.is_some();
                    yield Ok(ev);
                    if done {
                        return;
                    }
                    continue;
                }
                Some(Err(s)) => s,
                None => tonic::Status::unavailable(
                    "the coordinator ended the stream before its last event",
                ),
            };
            if timeout.is_zero() || instance.is_empty() || !gone(client, &instance).await {
                yield Err(broken);
                return;
            }
            tracing::warn!(
                "the coordinator ({instance}) went away mid-request ({}); resuming after {} token(s)",
                broken.message(),
                generated.len()
            );
            req.resume = Some(Resume {
                prompt_ids: prompt_ids.clone(),
                generated: generated.clone(),
            });
            let paused = Instant::now();
            stream = loop {
                let mut c = client.clone();
                match c
                    .generate(crate::server::traced(req.clone(), traceparent.as_deref()))
                    .await
                {
                    Ok(s) => break s.into_inner(),
                    // Nobody serving yet, or the call went out on the old
                    // process's dying connection: try again.
                    Err(s) if retry(&s) && paused.elapsed() < timeout => {
                        tokio::time::sleep(RETRY).await;
                    }
                    Err(s) => {
                        yield Err(tonic::Status::unavailable(format!(
                            "the coordinator went away mid-request and none resumed it within {:.0}s (--resume-timeout): {}",
                            timeout.as_secs_f64(),
                            s.message()
                        )));
                        return;
                    }
                }
            };
            tracing::info!(
                "resumed on a new coordinator after a pause of {:.2}s",
                paused.elapsed().as_secs_f64()
            );
        }
    }))
}

/// Whether a failed call may succeed on the coordinator that comes next:
/// nothing serves at the address yet (or not yet ready), or the call was
/// cut with the connection it went out on. An error a coordinator sent
/// about the request itself is final.
fn retry(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown
    )
}

/// Whether the coordinator process `instance` is gone: its address answers
/// as another process, or not at all.
async fn gone(client: &InferenceClient<Channel>, instance: &str) -> bool {
    let mut c = client.clone();
    match tokio::time::timeout(Duration::from_secs(2), c.info(InfoRequest {})).await {
        Ok(Ok(info)) => info.into_inner().instance != instance,
        _ => true,
    }
}
