//! `omnictl bench-cluster`: decode speed through real local clusters, side by
//! side in one run: llama.cpp (the vendored source, in this process), one
//! stage, and two stages over shared memory and over gRPC; plus the
//! per-hop latency of each transport as the coordinator measures it (step
//! round trip minus the stages' compute, divided by the hops).

use crate::bench::median;
use crate::up::{LocalCluster, UpArgs};
use anyhow::Context;
use clap::Args;
use omni_proto::coordinator::v1::{
    generate_request::Prompt, inference_client::InferenceClient, GenerateRequest, TokenIds,
};
use omni_transport::{Inbox, Outbox, TransportChoice};
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;

#[derive(Args, Debug)]
pub struct BenchClusterArgs {
    /// GGUF path or known model name.
    #[arg(long, short)]
    pub model: String,
    /// Compute threads of each worker (and of llama.cpp).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Where every stage worker computes: `cpu` or `cuda:N` (llama.cpp
    /// then offloads every layer to that GPU).
    #[arg(long, default_value = "cpu")]
    pub device: omni_engine::Device,
    /// Tokens to decode per run.
    #[arg(long, default_value_t = 64)]
    pub tg: usize,
    /// Timed runs per configuration (after one warm-up); the median is reported.
    #[arg(long, short, default_value_t = 3)]
    pub runs: usize,
    #[arg(long)]
    pub json: bool,
}

struct Row {
    name: &'static str,
    tok_s: f64,
    hop_p50: Option<f64>,
    hop_p99: Option<f64>,
    /// Pipeline frames and expert calls, bytes per token processed.
    pipeline_b_tok: Option<f64>,
    expert_b_tok: Option<f64>,
    /// Per step, summed over stages (mean, ms).
    expert_wait_ms: Option<f64>,
}

/// (pipeline bytes, expert bytes, tokens of stage 0) from every stage's Status.
async fn traffic(info: &omni_proto::coordinator::v1::InfoReply) -> anyhow::Result<(u64, u64, u64)> {
    let st = crate::remote::statuses(info).await?;
    let pipe = st.iter().map(|s| s.bytes_received).sum();
    let experts = st
        .iter()
        .map(|s| s.expert_bytes_sent + s.expert_bytes_received)
        .sum();
    Ok((pipe, experts, st.first().map_or(0, |s| s.tokens)))
}

pub fn run(a: BenchClusterArgs) -> anyhow::Result<()> {
    let path = crate::resolve_model(&a.model)?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let tokenizer = omni_engine::Tokenizer::load(&path)?;
    let prompt = tokenizer.encode("The history of the city begins", true, false)?;
    let mut rows = Vec::new();
    // Structured output's cost (2 stages over shm): the same decode under a
    // JSON schema that cannot end within the run (an array of at least
    // `tg` objects), as tokens per second and the grammar's mask time.
    let schema = serde_json::json!({
        "type": "array", "minItems": a.tg,
        "items": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
            "required": ["city", "year"]
        }
    });
    let mut constrained: Option<(f64, f64, Vec<u32>)> = None;

    if a.device.is_gpu() {
        // Loaded in this process, the GPU backend is llama.cpp's too.
        omni_engine::device::gpu_props(a.device)?;
    }
    rows.push(llama_cpp_row(&path, &prompt, &a, threads)?);

    // MoE models also run with every routed expert on an expert worker.
    let moe = omni_engine::ModelFile::open(&path)?.hparams.moe.is_some();
    let mut configs = vec![
        ("1 stage", 1usize, "shm", 0usize),
        ("2 stages, shm", 2, "shm", 0),
        ("2 stages, grpc", 2, "grpc", 0),
    ];
    if moe {
        configs.push(("2 stages + experts, shm", 2, "shm", 1));
        configs.push(("2 stages + experts, grpc", 2, "grpc", 1));
    }
    for (name, stages, transport, cpu_workers) in configs {
        let listen = format!("127.0.0.1:{}", free_port()?);
        let up = UpArgs {
            cpu_workers,
            experts: (cpu_workers > 0).then(|| "cpu".into()),
            admin_listen: Some(format!("127.0.0.1:{}", free_port()?)),
            device: vec![a.device],
            // Unless -t was given: a GPU worker's own default (`omnictl up`'s).
            threads: a.threads,
            ..UpArgs::bench(&a.model, stages, transport, &listen, threads)
        };
        let mut cluster = LocalCluster::start(&up, &path, threads, true)?;
        let result = (|| {
            cluster.wait_ready(&listen, Duration::from_secs(120))?;
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let mut runs = Vec::new();
            let info = rt.block_on(crate::remote::info(&listen, Duration::from_secs(5)))?;
            let mut before = (0, 0, 0);
            for i in 0..=a.runs {
                if i == 1 {
                    before = rt.block_on(traffic(&info))?;
                }
                let (r, _) = rt.block_on(decode_rate(&listen, &prompt, a.tg, None))?;
                if i > 0 {
                    runs.push(r);
                }
            }
            let after = rt.block_on(traffic(&info))?;
            if name == "2 stages, shm" {
                // Interleaved with the same decode unconstrained, so drift
                // in the machine's speed hits both alike.
                let (mut with, mut without, mut ids) = (Vec::new(), Vec::new(), Vec::new());
                for i in 0..=a.runs {
                    let (plain, _) = rt.block_on(decode_rate(&listen, &prompt, a.tg, None))?;
                    let g = Some(schema.to_string());
                    let (r, got) = rt.block_on(decode_rate(&listen, &prompt, a.tg, g))?;
                    if i > 0 {
                        with.push(r);
                        without.push(plain);
                    }
                    ids = got;
                }
                constrained = Some((median(&mut with), median(&mut without), ids));
            }
            let tokens = (after.2 - before.2).max(1) as f64;
            let info = rt.block_on(crate::remote::info(&listen, Duration::from_secs(5)))?;
            anyhow::Ok(Row {
                name,
                tok_s: median(&mut runs),
                hop_p50: Some(info.hop_us_p50),
                hop_p99: Some(info.hop_us_p99),
                pipeline_b_tok: Some((after.0 - before.0) as f64 / tokens),
                expert_b_tok: Some((after.1 - before.1) as f64 / tokens),
                expert_wait_ms: (info.expert_wait_samples > 0).then_some(info.expert_wait_ms_mean),
            })
        })();
        cluster.stop();
        rows.push(result.with_context(|| format!("benchmark '{name}'"))?);
    }

    let hops = [
        ("ring", ring_hop(2000, 4096)?),
        ("shm", raw_hop(TransportChoice::Shm, 2000, 4096)?),
        ("grpc", raw_hop(TransportChoice::Grpc, 2000, 4096)?),
    ];

    let structured = match constrained {
        Some((tok_s, plain, ids)) => Some((tok_s, plain, mask_us(&tokenizer, &schema, &ids)?)),
        None => None,
    };
    report(
        &a,
        &path,
        threads,
        &rows,
        &hops,
        structured,
        tokenizer.n_vocab(),
    )
}

/// llama.cpp from the same vendored source: its decode rate, from the
/// difference of two runs so the prompt's prefill cancels out.
fn llama_cpp_row(
    path: &std::path::Path,
    prompt: &[u32],
    a: &BenchClusterArgs,
    threads: usize,
) -> anyhow::Result<Row> {
    Ok(Row {
        name: "llama.cpp (in process)",
        tok_s: llama_cpp_decode(path, prompt, a.tg, a.runs, threads)?,
        hop_p50: None,
        hop_p99: None,
        pipeline_b_tok: None,
        expert_b_tok: None,
        expert_wait_ms: None,
    })
}

/// llama.cpp from the same vendored source, in this process: its decode
/// rate, from the difference of two runs so the prompt's prefill cancels.
fn llama_cpp_decode(
    path: &std::path::Path,
    prompt: &[u32],
    tg: usize,
    runs: usize,
    threads: usize,
) -> anyhow::Result<f64> {
    let mut rates = Vec::new();
    for i in 0..=runs {
        let t = Instant::now();
        omni_engine::llama_cpp_greedy(path, prompt, 1, threads)?;
        let one = t.elapsed().as_secs_f64();
        let t = Instant::now();
        omni_engine::llama_cpp_greedy(path, prompt, tg + 1, threads)?;
        let all = t.elapsed().as_secs_f64();
        if i > 0 {
            rates.push(tg as f64 / (all - one).max(1e-9));
        }
    }
    Ok(median(&mut rates))
}

/// The results beside llama.cpp's, as a table or JSON.
fn report(
    a: &BenchClusterArgs,
    path: &std::path::Path,
    threads: usize,
    rows: &[Row],
    hops: &[(&str, (f64, f64))],
    structured: Option<(f64, f64, (f64, f64))>,
    n_vocab: usize,
) -> anyhow::Result<()> {
    let reference = rows[0].tok_s;
    let one_stage = rows[1].tok_s;
    if a.json {
        let v: Vec<_> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "config": r.name, "decode_tok_s": r.tok_s,
                    "vs_llama_cpp": r.tok_s / reference, "vs_one_stage": r.tok_s / one_stage,
                    "hop_us_p50": r.hop_p50, "hop_us_p99": r.hop_p99,
                    "pipeline_bytes_per_token": r.pipeline_b_tok,
                    "expert_bytes_per_token": r.expert_b_tok,
                    "expert_wait_ms_per_step": r.expert_wait_ms,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "model": path, "device": a.device, "threads_per_process": threads, "tg": a.tg, "runs": a.runs, "rows": v,
                "json_schema": structured.map(|(tok_s, plain, mask)| serde_json::json!({
                    "config": "2 stages, shm", "decode_tok_s": tok_s, "unconstrained_tok_s": plain,
                    "vs_unconstrained": tok_s / plain, "mask_us_p50": mask.0, "mask_us_p99": mask.1,
                })),
                "hop_4k": hops.iter().map(|(t, (p50, p99))| serde_json::json!({"transport": t, "p50_us": p50, "p99_us": p99})).collect::<Vec<_>>(),
            }))?
        );
        return Ok(());
    }
    println!(
        "model {} | on {} | {threads} thread(s) per process | decode {} tokens, median of {}",
        path.display(),
        a.device,
        a.tg,
        a.runs
    );
    println!(
        "{:<26} {:>9} {:>9} {:>10} {:>11} {:>11} {:>10} {:>10} {:>12}",
        "config",
        "tok/s",
        "vs llama",
        "vs 1 stage",
        "hop p50 µs",
        "hop p99 µs",
        "pipe B/tok",
        "exp B/tok",
        "exp wait/step"
    );
    for r in rows {
        let opt = |h: Option<f64>, p: usize| h.map_or("-".to_string(), |v| format!("{v:.p$}"));
        println!(
            "{:<26} {:>9.1} {:>8.2}x {:>9.2}x {:>11} {:>11} {:>10} {:>10} {:>12}",
            r.name,
            r.tok_s,
            r.tok_s / reference,
            r.tok_s / one_stage,
            opt(r.hop_p50, 1),
            opt(r.hop_p99, 1),
            opt(r.pipeline_b_tok, 0),
            opt(r.expert_b_tok, 0),
            r.expert_wait_ms
                .map_or("-".to_string(), |v| format!("{v:.3} ms"))
        );
    }
    if let Some((tok_s, plain, (p50, p99))) = structured {
        println!(
            "2 stages, shm, json_schema: {tok_s:.1} tok/s against {plain:.1} unconstrained in turn \
             ({:.2}x); mask p50 {p50:.0} µs, p99 {p99:.0} µs per token ({} tokens in the vocabulary)",
            tok_s / plain,
            n_vocab
        );
    }
    println!(
        "one hop alone (4 KiB frame, one per ms, Outbox::send to InboxReader::recv on another thread; \
         ring: the shared-memory ring by itself, the floor a hop over shm can reach):"
    );
    let floor = hops[0].1 .0;
    for (t, (p50, p99)) in hops {
        println!(
            "  {t:<5} p50 {p50:.1} µs ({:.2}x the ring alone), p99 {p99:.1} µs",
            p50 / floor
        );
    }
    Ok(())
}

/// One-way latency of the real link code, from `Outbox::send` to the
/// consuming thread's `InboxReader::recv`, paced at one frame per millisecond so the
/// receiver is idle between frames as a pipeline stage is.
fn raw_hop(choice: TransportChoice, frames: usize, payload: usize) -> anyhow::Result<(f64, f64)> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut inbox = Inbox::new();
    let name = format!("omni-bench-{}", std::process::id());
    if choice == TransportChoice::Shm {
        inbox.add_ring(std::path::Path::new("/dev/shm"), &name, 1 << 20)?;
    }
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?.to_string();
    let sink = inbox.sink_service();
    rt.spawn(async move {
        omni_transport::tls::server()
            .add_service(sink)
            .serve_with_incoming(omni_transport::tls::incoming(listener))
            .await
    });
    let ep = inbox.endpoint(&addr, &omni_transport::host_id());
    let mut out = rt.block_on(Outbox::connect(&ep, choice))?;
    let base = Instant::now();
    let rx = inbox.reader();
    let reader = std::thread::spawn(move || {
        let mut lat = Vec::with_capacity(frames);
        while lat.len() < frames {
            let Some(f) = rx.recv(Duration::from_secs(5)) else {
                break;
            };
            let now = base.elapsed().as_nanos() as u64;
            let sent = u64::from_le_bytes(f.meta[..8].try_into().unwrap_or([0; 8]));
            lat.push(now.saturating_sub(sent) as f64 / 1e3);
        }
        lat
    });
    for _ in 0..frames {
        std::thread::sleep(Duration::from_millis(1));
        let ts = base.elapsed().as_nanos() as u64;
        out.send(omni_transport::Frame {
            meta: ts.to_le_bytes().to_vec(),
            payload: vec![0u8; payload],
        })?;
    }
    let lat = reader
        .join()
        .map_err(|_| anyhow::anyhow!("hop reader panicked"))?;
    percentiles(lat, frames)
}

/// The same measurement on a bare ring (`RingSender::send` to
/// `RingReceiver::recv`): what a hop costs without the inbox around it.
fn ring_hop(frames: usize, payload: usize) -> anyhow::Result<(f64, f64)> {
    use omni_transport::shm::{RingReceiver, RingSender};
    let name = format!("omni-bench-ring-{}", std::process::id());
    let dir = std::path::Path::new("/dev/shm");
    let mut rx = RingReceiver::create(dir, &name, 1 << 20)?;
    let mut tx = RingSender::open(rx.path(), rx.token())?;
    let base = Instant::now();
    let reader = std::thread::spawn(move || {
        let mut lat = Vec::with_capacity(frames);
        while lat.len() < frames {
            let Ok(Some((meta, _))) = rx.recv(Duration::from_secs(5)) else {
                break;
            };
            let now = base.elapsed().as_nanos() as u64;
            let sent = u64::from_le_bytes(meta[..8].try_into().unwrap_or([0; 8]));
            lat.push(now.saturating_sub(sent) as f64 / 1e3);
        }
        lat
    });
    for _ in 0..frames {
        std::thread::sleep(Duration::from_millis(1));
        let ts = base.elapsed().as_nanos() as u64;
        tx.send(
            &ts.to_le_bytes(),
            &vec![0u8; payload],
            Duration::from_secs(5),
        )?;
    }
    let lat = reader
        .join()
        .map_err(|_| anyhow::anyhow!("ring reader panicked"))?;
    percentiles(lat, frames)
}

/// p50 and p99 of `lat`, which must hold all `frames` samples.
fn percentiles(mut lat: Vec<f64>, frames: usize) -> anyhow::Result<(f64, f64)> {
    anyhow::ensure!(
        lat.len() == frames,
        "only {} of {frames} frames arrived",
        lat.len()
    );
    lat.sort_by(f64::total_cmp);
    let at = |q: f64| lat[((lat.len() - 1) as f64 * q).round() as usize];
    Ok((at(0.5), at(0.99)))
}

/// The grammar's mask time per token (p50, p99, µs) along `ids`, the
/// tokens a constrained run generated: what the last stage adds per token.
fn mask_us(
    tok: &omni_engine::Tokenizer,
    schema: &serde_json::Value,
    ids: &[u32],
) -> anyhow::Result<(f64, f64)> {
    use omni_engine::constraint::Grammars;
    use omni_engine::sampling::Grammar;
    let grammars = Grammars::new(tok)?;
    let mut c = grammars.compile(&Grammar::JsonSchema {
        schema: schema.clone(),
    })?;
    let mut logits = vec![0f32; tok.n_vocab()];
    let mut us = Vec::with_capacity(ids.len());
    for &t in ids {
        let at = Instant::now();
        c.mask(&mut logits)?;
        us.push(at.elapsed().as_secs_f64() * 1e6);
        c.accept(t)?;
    }
    anyhow::ensure!(!us.is_empty(), "the constrained run generated nothing");
    us.sort_by(f64::total_cmp);
    let at = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize];
    Ok((at(0.5), at(0.99)))
}

/// Decode tokens per second of one greedy request (constrained to the JSON
/// `schema` if given): from the first token to the last, so the prefill is
/// not counted. Also the tokens.
pub(crate) async fn decode_rate(
    addr: &str,
    prompt: &[u32],
    tg: usize,
    schema: Option<String>,
) -> anyhow::Result<(f64, Vec<u32>)> {
    let sampling = schema.map(|s| omni_proto::worker::v1::Sampling {
        grammar: Some(omni_proto::worker::v1::Grammar {
            kind: Some(omni_proto::worker::v1::grammar::Kind::JsonSchema(s)),
        }),
        ..Default::default()
    });
    let mut stream = generate_ids(addr, prompt, tg + 1, sampling).await?;
    let (mut arrivals, mut ids) = (Vec::new(), Vec::new());
    while let Some(ev) = stream.next().await {
        let ev = ev.map_err(|s| anyhow::anyhow!("{}", s.message()))?;
        if !ev.tokens.is_empty() {
            arrivals.push((Instant::now(), ev.tokens.len()));
            ids.extend(ev.tokens.iter().map(|t| t.id));
        }
    }
    Ok((rate_of(&arrivals)?, ids))
}

/// A greedy request for `max_tokens` after the token ids `prompt`, not
/// stopping at end of generation, through the cluster at `addr`: its stream.
pub(crate) async fn generate_ids(
    addr: &str,
    prompt: &[u32],
    max_tokens: usize,
    sampling: Option<omni_proto::worker::v1::Sampling>,
) -> anyhow::Result<tonic::Streaming<omni_proto::coordinator::v1::GenerateEvent>> {
    let ch = omni_transport::tls::endpoint(addr)?.connect().await?;
    let req = GenerateRequest {
        prompt: Some(Prompt::Ids(TokenIds {
            ids: prompt.to_vec(),
        })),
        max_tokens: Some(max_tokens as u32),
        ignore_eos: true,
        sampling,
        ..Default::default()
    };
    Ok(InferenceClient::new(ch).generate(req).await?.into_inner())
}

/// Decode tokens per second from when each message of a stream came and
/// how many tokens it held: the tokens after the first message over the
/// time since it. Tokens that came together (a fast model outrunning the
/// stream) share one arrival time, so the first message's are not counted.
fn rate_of(arrivals: &[(Instant, usize)]) -> anyhow::Result<f64> {
    let (Some(&(first, in_first)), Some(&(last, _))) = (arrivals.first(), arrivals.last()) else {
        anyhow::bail!("no tokens");
    };
    let after: usize = arrivals[1..].iter().map(|&(_, n)| n).sum();
    anyhow::ensure!(
        after > 0,
        "all {in_first} tokens came in one message: nothing to time a decode by (ask for more with --tg)"
    );
    Ok(after as f64 / (last - first).as_secs_f64().max(1e-9))
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

#[cfg(test)]
mod tests {
    use super::rate_of;
    use std::time::{Duration, Instant};

    #[test]
    fn the_decode_rate_leaves_out_the_tokens_of_the_first_message() {
        let t = Instant::now();
        let s = Duration::from_secs(1);
        // Five tokens at once, then three a second apart: 3 tokens in 3 s
        // (counting the first message's would say 7 in 3 s).
        let arrivals = [(t, 5), (t + s, 1), (t + 2 * s, 1), (t + 3 * s, 1)];
        assert!((rate_of(&arrivals).unwrap() - 1.0).abs() < 1e-9);
        let e = rate_of(&[(t, 8)]).unwrap_err().to_string();
        assert!(e.contains("all 8 tokens came in one message"), "{e}");
        assert!(rate_of(&[]).is_err());
    }
}
