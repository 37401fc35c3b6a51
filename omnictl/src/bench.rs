//! `omnictl bench`: prefill and decode speed, measured the way llama.cpp's
//! `llama-bench` measures them (pp: one batch of N tokens from an empty
//! cache; tg: N single-token steps from an empty cache), median of several
//! runs after a warm-up. With `--llama-bench PATH` it runs llama.cpp's tool
//! on the same file and threads in the same invocation and prints the ratio.

use std::process::Command;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use omni_engine::{fmt_bytes, Batch, Engine, StageConfig};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// GGUF path or known model name.
    #[arg(long, short)]
    pub model: String,
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Compute on `cpu` or `cuda:N` (llama-bench then offloads every layer).
    #[arg(long, default_value = "cpu")]
    pub device: omni_engine::Device,
    /// Prompt sizes to prefill.
    #[arg(long, value_delimiter = ',', default_value = "128,512")]
    pub pp: Vec<usize>,
    /// Tokens to decode one by one.
    #[arg(long, default_value_t = 64)]
    pub tg: usize,
    /// Timed runs per test (after one warm-up); the median is reported.
    #[arg(long, short, default_value_t = 5)]
    pub runs: usize,
    /// llama.cpp's `llama-bench` binary, to run beside us on the same file.
    #[arg(long)]
    pub llama_bench: Option<std::path::PathBuf>,
    /// Compute with this ggml CPU variant (haswell, zen4, ...) instead of
    /// the best one for this CPU.
    #[arg(long, env = "OMNI_CPU_VARIANT")]
    pub cpu_variant: Option<String>,
    #[arg(long)]
    pub json: bool,
}

struct Row {
    test: String,
    ours: f64,
    reference: Option<f64>,
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    let path = crate::resolve_model(&a.model)?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let max_pp = a.pp.iter().copied().max().unwrap_or(0);
    let cfg = StageConfig {
        n_threads: threads,
        n_ubatch: max_pp.max(1),
        kv: omni_engine::kv::KvConfig {
            n_ctx: (max_pp.max(a.tg) + 1).next_multiple_of(256),
            n_seq: 1,
        },
        device: a.device,
        ..StageConfig::default()
    };
    let cpu = omni_engine::cpu_backend(a.cpu_variant.as_deref())?;
    let gpu_free = || {
        a.device
            .is_gpu()
            .then(|| omni_engine::device::gpu_props(a.device).ok())
            .flatten()
            .map(|p| p.memory_free)
    };
    let free_before = gpu_free();
    let mut engine = Engine::load(&path, None, cfg.clone())?;
    let free_loaded = gpu_free();
    let hp = engine.model.hparams.clone();
    eprintln!(
        "omnictl bench: {} ({}), {} threads",
        path.display(),
        hp.arch.name(),
        threads
    );
    eprintln!("ggml CPU backend: {cpu}");
    let w = engine.stages()[0].weights();
    eprintln!(
        "weights: {} MB mapped, {} MB {}",
        w.mapped_bytes >> 20,
        w.repacked_bytes >> 20,
        if w.on_device {
            format!("in {}'s memory", a.device)
        } else {
            "repacked".into()
        }
    );
    report_compute(&engine, &cfg);

    // Deterministic pseudo-random tokens, as llama-bench uses random ids.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next_token = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % hp.n_vocab as u64) as u32
    };
    let mut rows = Vec::new();
    for &n in &a.pp {
        let mut times = Vec::new();
        for r in 0..=a.runs {
            let mut b = Batch::default();
            for p in 0..n {
                b.push(next_token(), p as i32, 0, p + 1 == n);
            }
            let t = Instant::now();
            engine.step(&b)?;
            let dt = t.elapsed().as_secs_f64();
            engine.remove_seq(0);
            if r > 0 {
                times.push(n as f64 / dt);
            }
        }
        rows.push(Row {
            test: format!("pp{n}"),
            ours: median(&mut times),
            reference: None,
        });
    }
    if a.tg > 0 {
        let mut times = Vec::new();
        let mut decode_time = 0.0;
        for r in 0..=a.runs {
            if r == 1 {
                engine.reset_step_times();
            }
            let t = Instant::now();
            for p in 0..a.tg {
                let mut b = Batch::default();
                b.push(next_token(), p as i32, 0, true);
                engine.step(&b)?;
            }
            let dt = t.elapsed().as_secs_f64();
            engine.remove_seq(0);
            if r > 0 {
                times.push(a.tg as f64 / dt);
                decode_time += dt;
            }
        }
        // Where a decoded token's time went: the host's phases around the
        // device's work (on a GPU a small model's decode is bound by them).
        let tokens = (a.tg * a.runs).max(1) as f64;
        eprintln!(
            "decode, per token: {:.0} µs in all",
            decode_time * 1e6 / tokens
        );
        for (i, s) in engine.stages().iter().enumerate() {
            eprintln!(
                "  stage {i} on {}: {}",
                s.device(),
                s.step_times().per_segment()
            );
        }
        rows.push(Row {
            test: format!("tg{}", a.tg),
            ours: median(&mut times),
            reference: None,
        });
    }
    if let (Some(before), Some(loaded), Some(after)) = (free_before, free_loaded, gpu_free()) {
        eprintln!(
            "{}: this process took {} of its memory loading and {} by the end of the runs; the stage counts {} of it (weights there, KV cache, compute buffer)",
            a.device,
            fmt_bytes(before.saturating_sub(loaded)),
            fmt_bytes(before.saturating_sub(after)),
            fmt_bytes(engine.stages()[0].device_bytes())
        );
    }
    if let Some(lb) = &a.llama_bench {
        let reference = llama_bench(lb, &path, threads, &a.pp, a.tg, a.runs, a.device)?;
        for row in &mut rows {
            row.reference = reference
                .iter()
                .find(|(t, _)| *t == row.test)
                .map(|(_, v)| *v);
        }
    }
    if a.json {
        let v: Vec<_> = rows
            .iter()
            .map(|r| serde_json::json!({"test": r.test, "omni_tok_s": r.ours, "llama_cpp_tok_s": r.reference, "ratio": r.reference.map(|x| r.ours / x)}))
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({"model": path, "threads": threads, "cpu_variant": cpu.variant, "cpu_features": cpu.features, "results": v})
            )?
        );
    } else {
        println!(
            "{:<8} {:>14} {:>16} {:>8}",
            "test", "omni tok/s", "llama.cpp tok/s", "ratio"
        );
        for r in &rows {
            match r.reference {
                Some(x) => println!(
                    "{:<8} {:>14.2} {:>16.2} {:>7.2}x",
                    r.test,
                    r.ours,
                    x,
                    r.ours / x
                ),
                None => println!("{:<8} {:>14.2} {:>16} {:>8}", r.test, r.ours, "-", "-"),
            }
        }
    }
    Ok(())
}

/// Prints the stage's compute buffer as ggml allocated it beside the
/// planner's estimate of it.
fn report_compute(engine: &Engine, cfg: &StageConfig) {
    let st = &engine.stages()[0];
    let hp = &engine.model.hparams;
    let plan = omni_planner::PlanConfig {
        n_ctx: cfg.kv.n_ctx,
        n_seq: cfg.kv.n_seq,
        n_ubatch: cfg.n_ubatch,
        ..Default::default()
    };
    let estimate = omni_planner::compute_estimate(hp, st.range(), &plan, st.device().is_gpu());
    let (device, host) = st.compute_bytes_split();
    let real = (device + host) as u64;
    let on = st.device();
    eprintln!(
        "compute buffer for a {}-token step over {} KV cells: {} allocated ({}); the planner's estimate {} ({:.2}x)",
        cfg.n_ubatch,
        cfg.kv.n_ctx * cfg.kv.n_seq,
        fmt_bytes(real),
        if on.is_gpu() {
            format!("{} on {on}, {} pinned host", fmt_bytes(device as u64), fmt_bytes(host as u64))
        } else {
            "on the CPU".into()
        },
        fmt_bytes(estimate),
        estimate as f64 / real.max(1) as f64
    );
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

/// Runs llama.cpp's `llama-bench` with the same tests (flash attention on,
/// as our graphs use it) and returns `(test, avg tok/s)`.
pub(crate) fn llama_bench(
    bin: &std::path::Path,
    model: &std::path::Path,
    threads: usize,
    pp: &[usize],
    tg: usize,
    runs: usize,
    device: omni_engine::Device,
) -> anyhow::Result<Vec<(String, f64)>> {
    let pp: Vec<String> = pp.iter().map(|n| n.to_string()).collect();
    let out = Command::new(bin)
        .arg("-m")
        .arg(model)
        .args([
            "-t",
            &threads.to_string(),
            "-p",
            &pp.join(","),
            "-n",
            &tg.to_string(),
            "-r",
            &runs.to_string(),
            "-fa",
            "1",
            "-o",
            "json",
        ])
        .args(match device {
            // llama.cpp's GPU builds offload nothing unless told.
            omni_engine::Device::Cuda(i) | omni_engine::Device::Vulkan(i) => vec![
                "-ngl".to_string(),
                "999".to_string(),
                "-mg".to_string(),
                i.to_string(),
                "-sm".to_string(),
                "none".to_string(),
            ],
            // No device at all: with a GPU backend beside it, llama.cpp
            // would otherwise compute a prompt's large matmuls there
            // (op offload) even with no layer offloaded.
            omni_engine::Device::Cpu => ["-ngl", "0", "-dev", "none", "-nopo", "1"]
                .map(String::from)
                .to_vec(),
        })
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "llama-bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("parsing llama-bench JSON")?;
    let mut res = Vec::new();
    for t in v.as_array().into_iter().flatten() {
        let (np, ng) = (
            t["n_prompt"].as_u64().unwrap_or(0),
            t["n_gen"].as_u64().unwrap_or(0),
        );
        let name = if ng > 0 {
            format!("tg{ng}")
        } else {
            format!("pp{np}")
        };
        res.push((name, t["avg_ts"].as_f64().unwrap_or(0.0)));
    }
    Ok(res)
}
