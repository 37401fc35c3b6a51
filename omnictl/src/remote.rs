//! Talking to a running coordinator: `generate --coordinator ADDR` and the
//! readiness probe `up` uses.

use crate::generate::GenerateArgs;
use anyhow::Context;
use omni_proto::coordinator::v1::{
    generate_request::Prompt, inference_client::InferenceClient, Chat, ChatMessage, FinishReason,
    GenerateRequest, InfoReply, InfoRequest, TokenIds,
};
use omni_proto::worker::v1::Sampling;
use std::io::Write;
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;

async fn client(
    addr: &str,
    timeout: Duration,
) -> anyhow::Result<InferenceClient<tonic::transport::Channel>> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(timeout)
        .connect()
        .await
        .with_context(|| format!("cannot reach the coordinator at {addr}"))?;
    Ok(InferenceClient::new(ch))
}

pub async fn info(addr: &str, timeout: Duration) -> anyhow::Result<InfoReply> {
    let mut c = client(addr, timeout).await?;
    let r = tokio::time::timeout(timeout, c.info(InfoRequest {}))
        .await
        .context("the coordinator did not answer")??;
    Ok(r.into_inner())
}

/// Every stage's Worker.Status, in pipeline order.
pub async fn statuses(
    info: &InfoReply,
) -> anyhow::Result<Vec<omni_proto::worker::v1::StatusReply>> {
    use omni_proto::worker::v1::{worker_client::WorkerClient, StatusRequest};
    let mut out = Vec::new();
    for s in &info.stages {
        let st = async {
            let mut w = WorkerClient::connect(format!("http://{}", s.worker_addr)).await?;
            anyhow::Ok(w.status(StatusRequest {}).await?.into_inner())
        };
        out.push(
            st.await
                .with_context(|| format!("cannot read worker {}'s status", s.worker_id))?,
        );
    }
    Ok(out)
}

/// Runs one request through the cluster and prints it like the
/// single-process `generate` does (text as it streams, or the JSON report).
pub fn generate(addr: &str, a: &GenerateArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(generate_async(addr, a))
}

/// The flags' grammar as the coordinator takes it.
fn wire_grammar(g: &omni_engine::sampling::Grammar) -> omni_proto::worker::v1::Grammar {
    use omni_engine::sampling::Grammar;
    use omni_proto::worker::v1::grammar::{JsonObject, Kind};
    let kind = match g {
        Grammar::JsonObject => Kind::JsonObject(JsonObject {}),
        Grammar::JsonSchema { schema } => Kind::JsonSchema(schema.to_string()),
        Grammar::Lark { grammar } => Kind::Lark(grammar.clone()),
        // (Tool calls' grammars are made by the coordinator.)
        Grammar::Triggered { grammar, .. } => return wire_grammar(grammar),
    };
    omni_proto::worker::v1::Grammar { kind: Some(kind) }
}

async fn generate_async(addr: &str, a: &GenerateArgs) -> anyhow::Result<()> {
    let mut c = client(addr, Duration::from_secs(10)).await?;
    let prompt = match (&a.prompt_ids, &a.prompt) {
        (Some(ids), _) => Prompt::Ids(TokenIds { ids: ids.clone() }),
        (None, Some(text)) if a.chat => {
            let mut messages = Vec::new();
            if let Some(s) = &a.system {
                messages.push(ChatMessage {
                    role: "system".into(),
                    content: s.clone(),
                    ..Default::default()
                });
            }
            messages.push(ChatMessage {
                role: "user".into(),
                content: text.clone(),
                ..Default::default()
            });
            Prompt::Chat(Chat {
                messages,
                ..Default::default()
            })
        }
        (None, Some(text)) => Prompt::Text(text.clone()),
        (None, None) => anyhow::bail!("give --prompt or --prompt-ids"),
    };
    let req = GenerateRequest {
        prompt: Some(prompt),
        max_tokens: a.max_tokens as u32,
        sampling: Some(Sampling {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            repeat_penalty: a.repeat_penalty,
            seed: a.seed,
            grammar: crate::generate::grammar(a)?.map(|g| wire_grammar(&g)),
            ..Default::default()
        }),
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
        logprobs: a.top_logprobs > 0,
        top_logprobs: a.top_logprobs as u32,
        request_id: String::new(),
    };
    let t0 = Instant::now();
    let mut stream = c
        .generate(req)
        .await
        .map_err(|s| anyhow::anyhow!("the coordinator refused the request: {}", s.message()))?
        .into_inner();
    let (mut prompt_ids, mut ids, mut text, mut steps) =
        (Vec::new(), Vec::new(), String::new(), Vec::new());
    let mut done = None;
    let mut stdout = std::io::stdout();
    while let Some(ev) = stream.next().await {
        let ev = ev.map_err(|s| anyhow::anyhow!("generation failed: {}", s.message()))?;
        if !ev.prompt_ids.is_empty() {
            prompt_ids = ev.prompt_ids;
        }
        for t in ev.tokens {
            ids.push(t.id);
            steps.push(serde_json::json!({
                "id": t.id,
                "logprob": t.logprob,
                "top": t.top.iter().map(|x| (x.token, x.logprob)).collect::<Vec<_>>(),
            }));
        }
        if !a.json {
            print!("{}", ev.text);
            stdout.flush().ok();
        }
        text.push_str(&ev.text);
        if ev.done.is_some() {
            done = ev.done;
        }
    }
    let done = done.context("the stream ended without a final event")?;
    let finish = match FinishReason::try_from(done.finish_reason) {
        Ok(FinishReason::Stop) => "stop",
        _ => "length",
    };
    let total_ms = t0.elapsed().as_secs_f64() * 1e3;
    let gen_ms = (done.total_ms - done.time_to_first_token_ms).max(1e-6);
    let gen_tok_s = (ids.len().saturating_sub(1)) as f64 / (gen_ms / 1e3);
    if a.json {
        let report = serde_json::json!({
            "coordinator": addr,
            "prompt_ids": prompt_ids,
            "generated_ids": ids,
            "text": text,
            "finish_reason": finish,
            "steps": if a.top_logprobs > 0 { serde_json::Value::Array(steps) } else { serde_json::Value::Null },
            "timings": {
                "prompt_tokens": done.prompt_tokens,
                "time_to_first_token_ms": done.time_to_first_token_ms,
                "gen_tokens": done.completion_tokens,
                "gen_ms": gen_ms,
                "gen_tok_s": gen_tok_s,
                "total_ms": total_ms,
            },
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!();
        eprintln!(
            "omnictl: prompt {} tokens, first token after {:.0} ms, generated {} tokens at {:.1} tok/s ({finish})",
            done.prompt_tokens, done.time_to_first_token_ms, done.completion_tokens, gen_tok_s
        );
    }
    Ok(())
}
