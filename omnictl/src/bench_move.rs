//! `omnictl bench-move`: what a live move costs, beside what llama.cpp
//! users pay for a new placement today (a restart: every layer loaded
//! again, every request lost).
//!
//! Starts a local cluster, keeps one greedy stream decoding, and moves one
//! layer back and forth between the first two workers `--moves` times.
//! Reports the restart (start to ready), each move's total time, the part
//! spent loading the new ranges while serving went on, the pipeline's
//! pause at the switch, and the decode step time around it for scale.

use crate::admin::{move_client, AdminArgs};
use crate::bench::median;
use crate::bench_cluster::free_port;
use crate::up::{LocalCluster, UpArgs};
use clap::Args;
use omni_proto::admin::v1::RebalanceRequest;
use omni_proto::coordinator::v1::{
    generate_request::Prompt, inference_client::InferenceClient, GenerateRequest, TokenIds,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;

#[derive(Args, Debug)]
pub struct BenchMoveArgs {
    /// The model (a path, or a known name such as gemma3-270m).
    #[arg(long, short)]
    pub model: String,
    /// Workers (at least 2).
    #[arg(long, default_value_t = 3)]
    pub stages: usize,
    /// Moves of one layer (alternately forward and back).
    #[arg(long, default_value_t = 10)]
    pub moves: usize,
    /// Compute threads per worker.
    #[arg(long, short)]
    pub threads: Option<usize>,
    #[arg(long, default_value = "shm")]
    pub transport: String,
    /// Context length and sequences (the KV cache that moves with a layer).
    #[arg(long, default_value_t = 2048)]
    pub ctx: usize,
    #[arg(long, default_value_t = 4)]
    pub seqs: usize,
}

pub fn run(a: BenchMoveArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.stages >= 2, "a move needs at least 2 workers");
    let path = crate::resolve_model(&a.model)?;
    let threads = a.threads.unwrap_or(1);
    let listen = format!("127.0.0.1:{}", free_port()?);
    let admin = format!("127.0.0.1:{}", free_port()?);
    let token = format!("bench-{}", std::process::id());
    // The children read the token from their environment (never argv).
    std::env::set_var("OMNI_ADMIN_TOKEN", &token);
    let up = UpArgs {
        ctx: a.ctx,
        seqs: a.seqs,
        admin_listen: Some(admin.clone()),
        ..UpArgs::bench(&a.model, a.stages, &a.transport, &listen, threads)
    };
    let t = Instant::now();
    let mut cluster = LocalCluster::start(&up, &path, threads, true)?;
    let result = (|| {
        let info = cluster.wait_ready(&listen, Duration::from_secs(300))?;
        let restart = t.elapsed().as_secs_f64();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let tokenizer = omni_engine::Tokenizer::load(&path)?;
        let prompt = tokenizer.encode("The history of the city begins", true, false)?;
        // One stream decodes all along; token arrival times give the step.
        let stop = Arc::new(AtomicBool::new(false));
        let gaps = Arc::new(Mutex::new(Vec::<f64>::new()));
        let stream = rt.spawn(keep_decoding(
            listen.clone(),
            prompt,
            stop.clone(),
            gaps.clone(),
        ));
        let args = AdminArgs {
            admin: admin.clone(),
            token: Some(token.clone()),
            token_file: None,
        };
        // The boundary between the first two stages, from the plan.
        let first = info
            .stages
            .first()
            .map(|s| s.range.clone())
            .unwrap_or_default();
        // "embed + layers 0-8": the word after "layer(s)" is the range.
        let end: u32 = first
            .split_whitespace()
            .skip_while(|w| !w.starts_with("layer"))
            .nth(1)
            .and_then(|r| omni_engine::parse_layers(r).ok())
            .map(|r| r.end)
            .ok_or_else(|| anyhow::anyhow!("cannot read stage 0's range from '{first}'"))?;
        anyhow::ensure!(end >= 2, "stage 0 runs {end} layer(s); nothing to move");
        let ids: Vec<String> = info.stages.iter().map(|s| s.worker_id.clone()).collect();
        let mut rows = Vec::new();
        rt.block_on(async {
            let mut c = move_client(&args).await?;
            tokio::time::sleep(Duration::from_millis(500)).await;
            for i in 0..a.moves {
                // Forward: stage 0's last layer to stage 1; back again.
                let (layer, to) = if i % 2 == 0 {
                    (end - 1, &ids[1])
                } else {
                    (end - 1, &ids[0])
                };
                let r = c
                    .rebalance(RebalanceRequest {
                        layer_start: layer,
                        layer_end: layer + 1,
                        to: to.clone(),
                        ..Default::default()
                    })
                    .await
                    .map_err(crate::admin::refused)?
                    .into_inner();
                rows.push((
                    r.total_seconds,
                    r.prepare_seconds,
                    r.pause_seconds,
                    r.kv_bytes,
                ));
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            anyhow::Ok(())
        })?;
        stop.store(true, Ordering::Relaxed);
        let tokens = rt.block_on(stream)??;
        let mut gaps = gaps.lock().unwrap().clone();
        let longest = gaps.iter().copied().fold(0.0, f64::max);
        let step = median(&mut gaps);
        let col = |f: fn(&(f64, f64, f64, u64)) -> f64| {
            let mut v: Vec<f64> = rows.iter().map(f).collect();
            let max = v.iter().copied().fold(0.0, f64::max);
            (median(&mut v), max)
        };
        let (total, total_max) = col(|r| r.0);
        let (prep, prep_max) = col(|r| r.1);
        let (pause, pause_max) = col(|r| r.2);
        let kv = rows.first().map_or(0, |r| r.3);
        println!(
            "{} on {} workers ({} thread(s) each, {}), ctx {} x {} seqs; {} moves of one layer under a decoding stream ({tokens} tokens, none lost)",
            path.display(),
            a.stages,
            threads,
            a.transport,
            a.ctx,
            a.seqs,
            rows.len()
        );
        println!(
            "{:<44} {:>10} {:>10} {:>12}",
            "", "median", "max", "vs restart"
        );
        let line = |name: &str, med: f64, max: Option<f64>| {
            println!(
                "{:<44} {:>10} {:>10} {:>11.3}x",
                name,
                fmt_s(med),
                max.map_or("-".into(), fmt_s),
                med / restart
            );
        };
        line("restart: load every layer (llama.cpp's way)", restart, None);
        line("move one layer, in all", total, Some(total_max));
        line(
            "  loading it beside the old stage (serving)",
            prep,
            Some(prep_max),
        );
        line("  pipeline pause at the switch", pause, Some(pause_max));
        line("decode step of the running stream", step, Some(longest));
        println!(
            "KV cache handed over per move: {}",
            omni_engine::fmt_bytes(kv)
        );
        anyhow::Ok(())
    })();
    cluster.stop();
    result
}

/// Generates until `stop`, recording the time between tokens of a stream;
/// returns the tokens received (the stream must not fail across the moves).
async fn keep_decoding(
    addr: String,
    prompt: Vec<u32>,
    stop: Arc<AtomicBool>,
    gaps: Arc<Mutex<Vec<f64>>>,
) -> anyhow::Result<usize> {
    let mut c = InferenceClient::new(omni_transport::tls::endpoint(&addr)?.connect().await?);
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        let req = GenerateRequest {
            prompt: Some(Prompt::Ids(TokenIds {
                ids: prompt.clone(),
            })),
            max_tokens: Some(256),
            ignore_eos: true,
            ..Default::default()
        };
        let mut s = c.generate(req).await?.into_inner();
        let mut last: Option<Instant> = None;
        while let Some(ev) = s.next().await {
            let ev = ev.map_err(|e| anyhow::anyhow!("the stream failed: {}", e.message()))?;
            for _ in ev.tokens {
                n += 1;
                let now = Instant::now();
                // Gaps within one stream only (not across its prefill).
                if let Some(l) = last {
                    gaps.lock().unwrap().push((now - l).as_secs_f64());
                }
                last = Some(now);
            }
            if stop.load(Ordering::Relaxed) {
                break;
            }
        }
    }
    Ok(n)
}

fn fmt_s(s: f64) -> String {
    if s < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}
