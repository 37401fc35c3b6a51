//! Talking to a running coordinator: `generate --coordinator ADDR` and the
//! readiness probe `up` uses.

use crate::generate::GenerateArgs;
use anyhow::Context;
use omni_proto::coordinator::v1::{
    generate_request::Prompt, inference_client::InferenceClient, Chat, ChatMessage, FinishReason,
    GenerateRequest, InfoReply, InfoRequest, Speculative, TokenIds,
};
use omni_proto::worker::v1::Sampling;
use std::io::Write;
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;

/// An address as people write it, `host:port` or a URL
/// (`http://127.0.0.1:7070/`), as host:port.
pub fn host_port(addr: &str) -> String {
    let a = addr.trim();
    let a = a
        .strip_prefix("http://")
        .or_else(|| a.strip_prefix("https://"))
        .or_else(|| a.strip_prefix("grpc://"))
        .unwrap_or(a);
    a.split('/').next().unwrap_or(a).to_string()
}

async fn client(
    addr: &str,
    timeout: Duration,
) -> anyhow::Result<InferenceClient<tonic::transport::Channel>> {
    let addr = host_port(addr);
    let ch = omni_transport::tls::endpoint(&addr)?
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
        .context("the coordinator did not answer")?;
    match r {
        Ok(r) => Ok(r.into_inner()),
        Err(s) => Err(not_the_coordinator(addr, s).await),
    }
}

/// What listens at `addr`, when a call there failed in a way that says it
/// is not the service the user meant: the coordinator's Inference, its
/// admin API, or an HTTP server (the OpenAI router). None when unsure.
pub async fn what_is_at(addr: &str) -> Option<&'static str> {
    use omni_proto::admin::v1::{admin_client::AdminClient, ListWorkersRequest};
    let addr = host_port(addr);
    let t = Duration::from_secs(2);
    // An HTTP/1 server answers a plain request with a status line; gRPC
    // servers (HTTP/2 only) do not.
    let http = async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(&addr).await.ok()?;
        s.write_all(b"GET /health HTTP/1.1\r\nHost: omni\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut buf = [0u8; 8];
        s.read_exact(&mut buf).await.ok()?;
        buf.starts_with(b"HTTP/1.").then_some(())
    };
    if let Ok(Some(())) = tokio::time::timeout(t, http).await {
        return Some("an HTTP server (the OpenAI router's port?)");
    }
    let ch = omni_transport::tls::endpoint(&addr)
        .ok()?
        .connect_timeout(t)
        .timeout(t)
        .connect()
        .await
        .ok()?;
    let admin = AdminClient::new(ch.clone())
        .list_workers(ListWorkersRequest {})
        .await;
    // The admin API exists there if it answers anything but "unimplemented".
    if !matches!(&admin, Err(s) if s.code() == tonic::Code::Unimplemented) {
        return Some("the coordinator's admin API (its --admin-listen port)");
    }
    if InferenceClient::new(ch).info(InfoRequest {}).await.is_ok() {
        return Some("the coordinator's Inference port (its --listen)");
    }
    None
}

/// The error for a failed call to the coordinator's Inference at `addr`,
/// naming what is there instead when that is the cause.
pub async fn not_the_coordinator(addr: &str, s: tonic::Status) -> anyhow::Error {
    if matches!(
        s.code(),
        tonic::Code::Unimplemented | tonic::Code::Internal | tonic::Code::Unknown
    ) {
        if let Some(what) = what_is_at(addr).await {
            if !what.contains("Inference") {
                return anyhow::anyhow!(
                    "{} is {what}, not the coordinator's Inference address (its --listen, 127.0.0.1:7070 by default)",
                    host_port(addr)
                );
            }
        }
    }
    anyhow::anyhow!(
        "the coordinator at {} refused: {}",
        host_port(addr),
        s.message()
    )
}

/// Every stage's Worker.Status, in pipeline order.
pub async fn statuses(
    info: &InfoReply,
) -> anyhow::Result<Vec<omni_proto::worker::v1::StatusReply>> {
    use omni_proto::worker::v1::{worker_client::WorkerClient, StatusRequest};
    let mut out = Vec::new();
    for s in &info.stages {
        let st = async {
            let ch = omni_transport::tls::endpoint(&s.worker_addr)?
                .connect()
                .await?;
            let mut w = WorkerClient::new(ch);
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
        max_tokens: Some(a.max_tokens as u32),
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
        resume: None,
        resumable: false,
        cache_prompt: None,
        deterministic: a.deterministic,
        speculative: a.draft_max.map(|n| Speculative {
            n_max: Some(n),
            ..Default::default()
        }),
    };
    let t0 = Instant::now();
    let mut stream = match c.generate(req).await {
        Ok(r) => r.into_inner(),
        Err(s) => return Err(not_the_coordinator(addr, s).await),
    };
    let (mut prompt_ids, mut ids, mut text, mut steps) =
        (Vec::new(), Vec::new(), String::new(), Vec::new());
    let mut done = None;
    let mut stdout = std::io::stdout();
    while let Some(ev) = stream.next().await {
        let ev = match ev {
            Ok(ev) => ev,
            // Nothing came yet: perhaps not a coordinator at all.
            Err(s) if ids.is_empty() && prompt_ids.is_empty() => {
                return Err(not_the_coordinator(addr, s).await)
            }
            Err(s) => anyhow::bail!("generation failed: {}", s.message()),
        };
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
                "draft_n": done.draft_n,
                "draft_n_accepted": done.draft_n_accepted,
            },
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!();
        eprintln!(
            "omnictl: prompt {} tokens, first token after {:.0} ms, generated {} tokens at {:.1} tok/s ({finish})",
            done.prompt_tokens, done.time_to_first_token_ms, done.completion_tokens, gen_tok_s
        );
        if done.draft_n > 0 {
            eprintln!(
                "omnictl: drafts: {} of {} tokens taken",
                done.draft_n_accepted, done.draft_n
            );
        }
    }
    Ok(())
}
