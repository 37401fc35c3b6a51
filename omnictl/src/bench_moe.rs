//! `omnictl bench-moe`: the hybrid MoE case, side by side in one run:
//! decode and prefill of one local cluster with every layer in one stage,
//! of the same with the routed experts on an expert worker, and of
//! llama.cpp on the CPU; then where a decode token's time went with the
//! expert worker (the stage's own compute, the experts' compute, the calls
//! between processes) and the expert worker's weight bytes per second per
//! core. Made for `omnictl synth` files (an R1-shaped slice), and any MoE
//! model.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use tokio_stream::StreamExt;

use crate::bench::median;
use crate::bench_cluster::{decode_rate, free_port, generate_ids};
use crate::up::{LocalCluster, UpArgs};

#[derive(Args, Debug)]
pub struct BenchMoeArgs {
    /// A MoE GGUF (an `omnictl synth` file, or any MoE model).
    #[arg(long, short)]
    pub model: String,
    /// Compute threads of each process (and of llama.cpp).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Prompt tokens to prefill.
    #[arg(long, default_value_t = 512)]
    pub pp: usize,
    /// Tokens to decode per run.
    #[arg(long, default_value_t = 32)]
    pub tg: usize,
    /// Timed runs per test (after one warm-up); the median is reported.
    #[arg(long, short, default_value_t = 3)]
    pub runs: usize,
    /// llama.cpp's `llama-bench` (`scripts/llama-bench portable`): its pp and
    /// tg on the same file and threads, all on the CPU, and the ratios.
    #[arg(long)]
    pub llama_bench: Option<std::path::PathBuf>,
    /// Also measure two streams with the stage and the expert worker on
    /// cores of their own (the stage on the first of this process's CPUs,
    /// the expert worker on the second, one thread each), with
    /// `--expert-overlap` off, shared and on: the aggregate decode rate of
    /// each.
    #[arg(long)]
    pub overlap: bool,
    /// Also time, with the experts on the expert worker, one step of each
    /// of these token counts beside a one-token step: what verifying a
    /// speculative draft costs (a step of k tokens verifies k - 1 drafts;
    /// timed as a k-token prompt, so its logits are one row's, not k).
    #[arg(long, value_delimiter = ',')]
    pub verify: Vec<usize>,
    /// Measure everything (each configuration, then llama.cpp) this many
    /// times in turn and report medians, a ratio to llama.cpp being the
    /// median of each round's own: a shared machine's rates drift over
    /// minutes, so blocks measured minutes apart compare unfairly.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    #[arg(long)]
    pub json: bool,
}

/// One configuration's figures.
#[derive(Default, serde::Serialize)]
struct Row {
    config: &'static str,
    decode_tok_s: f64,
    prefill_tok_s: Option<f64>,
    /// Per decode token, ms (the expert worker's row only).
    breakdown: Option<Breakdown>,
    /// `--verify`: (tokens in the step, its time in ms), a one-token step
    /// first (the expert worker's row only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    steps: Vec<(usize, f64)>,
}

#[derive(Default, serde::Serialize, Clone, Copy)]
struct Breakdown {
    step_ms: f64,
    /// The stage's compute, less its waits for the expert worker.
    stage_ms: f64,
    /// What the expert worker said it computed.
    experts_ms: f64,
    /// Expert call round trips less the worker's compute: the calls' cost
    /// between processes (ring or gRPC, waking threads, copies).
    calls_ms: f64,
    /// The part of the round trips the stage sat waiting for.
    wait_ms: f64,
    calls_per_token: f64,
    /// Routed expert weights read per token, and per second per core.
    expert_bytes: f64,
    expert_gb_s_core: f64,
    /// One call's round trip, µs, in its parts (they add up to it).
    call: CallParts,
}

/// Where one expert call's round trip went, µs (the parts add up to it).
#[derive(Default, serde::Serialize, Clone, Copy)]
struct CallParts {
    /// The stage encoding and sending the request.
    send_us: f64,
    /// From the request sent, or the worker free if later, to the worker
    /// having it: the ring and a wake-up (shared memory).
    pickup_us: f64,
    /// The expert worker between the request in hand and its compute, and
    /// between the result and its encoded answer.
    handoff_us: f64,
    /// Building and allocating the call's graph.
    graph_us: f64,
    /// ggml computing the experts.
    math_us: f64,
    /// From the answer sent, or the stage waiting if later, to the stage
    /// having it (shared memory).
    delivery_us: f64,
    /// The rest: a frame waiting while the other end was busy (with two
    /// calls out, the other group's call or the stage's compute).
    queued_us: f64,
}

type Status = omni_proto::worker::v1::StatusReply;

impl CallParts {
    /// One call's parts, averaged over the calls between two readings of
    /// the stages' Status.
    fn between(before: &[Status], after: &[Status]) -> CallParts {
        let d = |f: fn(&Status) -> f64| {
            after.iter().map(f).sum::<f64>() - before.iter().map(f).sum::<f64>()
        };
        let each = |x: f64| 1e6 * x / d(|s| s.expert_calls as f64).max(1.0);
        let (pickup, delivery, graph) = (
            d(|s| s.expert_pickup_seconds),
            d(|s| s.expert_delivery_seconds),
            d(|s| s.expert_graph_seconds),
        );
        CallParts {
            send_us: each(d(|s| s.expert_send_seconds)),
            pickup_us: each(pickup),
            handoff_us: each(d(|s| s.expert_handoff_seconds)),
            graph_us: each(graph),
            math_us: each(d(|s| s.expert_compute_seconds) - graph),
            delivery_us: each(delivery),
            queued_us: each(d(|s| s.expert_transit_seconds) - pickup - delivery).max(0.0),
        }
    }

    /// Each part's median over several (rounds).
    fn median(all: &[CallParts]) -> CallParts {
        let m = |f: fn(&CallParts) -> f64| median(&mut all.iter().map(f).collect::<Vec<_>>());
        CallParts {
            send_us: m(|c| c.send_us),
            pickup_us: m(|c| c.pickup_us),
            handoff_us: m(|c| c.handoff_us),
            graph_us: m(|c| c.graph_us),
            math_us: m(|c| c.math_us),
            delivery_us: m(|c| c.delivery_us),
            queued_us: m(|c| c.queued_us),
        }
    }

    fn describe(&self) -> String {
        let mut s = format!(
            "an expert call, µs: the stage sends {:.0}, the request reaches the worker {:.0}, \
             the worker hands it on {:.0}, builds its graph {:.0}, computes {:.0}, the answer \
             reaches the stage {:.0}; the ring's latency both ways (a MoE layer's, besides the \
             worker's work): {:.0} µs",
            self.send_us,
            self.pickup_us,
            self.handoff_us,
            self.graph_us,
            self.math_us,
            self.delivery_us,
            self.pickup_us + self.delivery_us,
        );
        if self.queued_us >= 1.0 {
            s.push_str(&format!(
                "; {:.0} µs waiting while the other end was busy (the other group's call, the \
                 stage's compute)",
                self.queued_us
            ));
        }
        s
    }
}

pub fn run(a: BenchMoeArgs) -> anyhow::Result<()> {
    let path = crate::resolve_model(&a.model)?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let model = omni_engine::ModelFile::open(&path)?;
    let hp = model.hparams.clone();
    let moe = hp.moe.clone().with_context(|| {
        format!(
            "{} ({}) has no routed experts: bench-moe measures MoE models",
            path.display(),
            hp.arch.name()
        )
    })?;
    let expert_bytes = routed_bytes_per_token(&model, moe.n_expert_used as u64);
    let n_vocab = hp.n_vocab as u64;
    drop(model);
    eprintln!(
        "omnictl bench-moe: {} ({}, {} layers, {} experts, {} used), {threads} threads per process; \
         routed expert weights read per decode token: {}; Q4_K/Q6_K experts by {}",
        path.display(),
        hp.arch.name(),
        hp.n_layer,
        moe.n_expert,
        moe.n_expert_used,
        omni_engine::fmt_bytes(expert_bytes),
        if omni_engine::expert_kernel_on() {
            "omni's AVX-512 VNNI kernel (OMNI_EXPERT_KERNEL=ggml for ggml's)"
        } else {
            "ggml's mul_mat_id"
        }
    );

    anyhow::ensure!(a.rounds >= 1, "--rounds must be at least 1");
    let mut ids = Ids::new(n_vocab);
    let mut rounds = Vec::new();
    for r in 0..a.rounds {
        if a.rounds > 1 {
            eprintln!("round {} of {}", r + 1, a.rounds);
        }
        rounds.push(round(&a, &path, threads, expert_bytes, &mut ids)?);
    }
    let (rows, overlap, per_round) = combine(&a, rounds);
    report(&a, &path, threads, &rows, overlap, &per_round)
}

/// One round: each configuration's figures, llama.cpp's last, and the two
/// streams' rates with `--overlap`.
type Round = (Vec<Row>, Option<Overlaps>);

/// Measures one [`Round`].
fn round(
    a: &BenchMoeArgs,
    path: &std::path::Path,
    threads: usize,
    expert_bytes: u64,
    ids: &mut Ids,
) -> anyhow::Result<Round> {
    let mut rows = Vec::new();
    for (config, cpu_workers) in [("1 stage", 0usize), ("1 stage + expert worker, shm", 1)] {
        let listen = format!("127.0.0.1:{}", free_port()?);
        let up = UpArgs {
            cpu_workers,
            experts: (cpu_workers > 0).then(|| "cpu".into()),
            admin_listen: Some(format!("127.0.0.1:{}", free_port()?)),
            ctx: (a.pp + a.tg + 64).next_multiple_of(256).max(1024),
            ..UpArgs::bench(&a.model, 1, "shm", &listen, threads)
        };
        eprintln!("{config}: starting");
        let mut cluster = LocalCluster::start(&up, path, threads, true)?;
        let result = (|| {
            cluster.wait_ready(&listen, Duration::from_secs(600))?;
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let info = rt.block_on(crate::remote::info(&listen, Duration::from_secs(5)))?;
            let (mut decode, mut prefill) = (Vec::new(), Vec::new());
            let mut before = None;
            for i in 0..=a.runs {
                if i == 1 {
                    before = Some(rt.block_on(crate::remote::statuses(&info))?);
                }
                // A fresh prompt every time: the prefix cache must not
                // shorten the prefill, or start the decode warm.
                // One prompt token: every step of the run is a one-token
                // step, so the breakdown is a decode token's.
                let (r, _) = rt.block_on(decode_rate(&listen, &ids.take(1), a.tg, None))?;
                if i > 0 {
                    decode.push(r);
                }
            }
            let after = rt.block_on(crate::remote::statuses(&info))?;
            let breakdown = before
                .filter(|_| cpu_workers > 0)
                .map(|b| breakdown(&b, &after, expert_bytes, threads));
            for i in 0..=a.runs.min(3) {
                let t = rt.block_on(prefill_seconds(&listen, &ids.take(a.pp)))?;
                if i > 0 {
                    prefill.push(a.pp as f64 / t);
                }
            }
            let mut steps = Vec::new();
            if cpu_workers > 0 && !a.verify.is_empty() {
                for k in std::iter::once(1).chain(a.verify.iter().copied()) {
                    let mut ms = Vec::new();
                    for i in 0..=a.runs.max(3) {
                        let t = rt.block_on(prefill_seconds(&listen, &ids.take(k)))?;
                        if i > 0 {
                            ms.push(t * 1e3);
                        }
                    }
                    steps.push((k, median(&mut ms)));
                }
            }
            anyhow::Ok(Row {
                config,
                decode_tok_s: median(&mut decode),
                prefill_tok_s: Some(median(&mut prefill)),
                breakdown,
                steps,
            })
        })();
        cluster.stop();
        let row = result.with_context(|| format!("benchmark '{config}'"))?;
        eprintln!(
            "{config}: decode {:.2} tok/s, prefill {:.1} tok/s",
            row.decode_tok_s,
            row.prefill_tok_s.unwrap_or(0.0)
        );
        rows.push(row);
    }
    let overlap = if a.overlap {
        Some(overlap_rates(a, path, ids)?)
    } else {
        None
    };
    if let Some(bin) = &a.llama_bench {
        rows.push({
            let r = crate::bench::llama_bench(
                bin,
                path,
                threads,
                &[a.pp],
                a.tg,
                a.runs,
                omni_engine::Device::Cpu,
            )?;
            let get = |t: String| r.iter().find(|(n, _)| *n == t).map(|(_, v)| *v);
            Row {
                config: "llama.cpp (llama-bench, CPU)",
                decode_tok_s: get(format!("tg{}", a.tg)).unwrap_or(0.0),
                prefill_tok_s: get(format!("pp{}", a.pp)),
                breakdown: None,
                steps: Vec::new(),
            }
        });
    }
    Ok((rows, overlap))
}

/// With several rounds, each round's own ratios: per configuration, its
/// decode and prefill to llama.cpp's (with `--llama-bench`), and the two
/// streams' `on` to `off` (with `--overlap`).
#[derive(Default)]
struct PerRound {
    vs_llama: Vec<(Vec<f64>, Vec<f64>)>,
    overlap: Vec<f64>,
}

/// The rounds as one set of rows (each figure the median of the rounds'),
/// the two streams' rates likewise, and each round's own ratios (the ones
/// reported, as their median).
fn combine(a: &BenchMoeArgs, mut rounds: Vec<Round>) -> (Vec<Row>, Option<Overlaps>, PerRound) {
    let overlap_ratios = rounds
        .iter()
        .filter_map(|r| r.1.map(|o| o.on / o.off))
        .collect();
    let vs_llama = a.llama_bench.is_some().then(|| {
        let n = rounds[0].0.len();
        (0..n)
            .map(|i| {
                // A round where llama.cpp gave no figure gives no ratio.
                let ratio = |x: f64, y: f64| (y > 0.0).then(|| x / y);
                let decode = rounds
                    .iter()
                    .filter_map(|(r, _)| ratio(r[i].decode_tok_s, r[n - 1].decode_tok_s))
                    .collect();
                let prefill = rounds
                    .iter()
                    .filter_map(|(r, _)| ratio(r[i].prefill_tok_s?, r[n - 1].prefill_tok_s?))
                    .collect();
                (decode, prefill)
            })
            .collect()
    });
    let per_round = PerRound {
        vs_llama: vs_llama.unwrap_or_default(),
        overlap: overlap_ratios,
    };
    if rounds.len() == 1 {
        let (rows, overlap) = rounds.remove(0);
        return (rows, overlap, per_round);
    }
    let med = |f: &dyn Fn(&Round) -> Option<f64>| {
        let mut v: Vec<f64> = rounds.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| median(&mut v))
    };
    let overlap = rounds[0].1.map(|_| Overlaps {
        off: med(&|r| Some(r.1?.off)).unwrap_or(0.0),
        shared: med(&|r| Some(r.1?.shared)).unwrap_or(0.0),
        on: med(&|r| Some(r.1?.on)).unwrap_or(0.0),
        calls: std::array::from_fn(|k| {
            let all: Vec<CallParts> = rounds.iter().filter_map(|r| Some(r.1?.calls[k])).collect();
            CallParts::median(&all)
        }),
    });
    let n = rounds[0].0.len();
    let rows = (0..n)
        .map(|i| {
            let breakdown = rounds[0].0[i].breakdown.map(|_| {
                let b = |f: fn(&Breakdown) -> f64| {
                    med(&|r: &Round| r.0[i].breakdown.as_ref().map(f)).unwrap_or(0.0)
                };
                Breakdown {
                    step_ms: b(|x| x.step_ms),
                    stage_ms: b(|x| x.stage_ms),
                    experts_ms: b(|x| x.experts_ms),
                    calls_ms: b(|x| x.calls_ms),
                    wait_ms: b(|x| x.wait_ms),
                    calls_per_token: b(|x| x.calls_per_token),
                    expert_bytes: b(|x| x.expert_bytes),
                    expert_gb_s_core: b(|x| x.expert_gb_s_core),
                    call: CallParts::median(
                        &rounds
                            .iter()
                            .filter_map(|r| r.0[i].breakdown.map(|b| b.call))
                            .collect::<Vec<_>>(),
                    ),
                }
            });
            let steps = rounds[0].0[i]
                .steps
                .iter()
                .enumerate()
                .map(|(j, &(k, _))| {
                    let ms = med(&|r: &Round| Some(r.0[i].steps.get(j)?.1));
                    (k, ms.unwrap_or(0.0))
                })
                .collect();
            Row {
                config: rounds[0].0[i].config,
                decode_tok_s: med(&|r| Some(r.0[i].decode_tok_s)).unwrap_or(0.0),
                prefill_tok_s: med(&|r| r.0[i].prefill_tok_s),
                breakdown,
                steps,
            }
        })
        .collect();
    (rows, overlap, per_round)
}

/// Two streams' aggregate decode rate, the stage pinned to one core and
/// the expert worker to another, with `--expert-overlap` off (the two take
/// turns), shared (the stage computes its shared experts meanwhile), then on
/// (and the other half of the step's sequences).
fn overlap_rates(
    a: &BenchMoeArgs,
    path: &std::path::Path,
    ids: &mut Ids,
) -> anyhow::Result<Overlaps> {
    let cpus = omni_telemetry::cpus::allowed();
    anyhow::ensure!(
        cpus.len() >= 2,
        "--overlap gives the stage and the expert worker a core each: this process may run on {} CPU",
        cpus.len()
    );
    let (mut rates, mut calls) = (Vec::new(), Vec::new());
    for overlap in ["off", "shared", "on"] {
        let listen = format!("127.0.0.1:{}", free_port()?);
        let up = UpArgs {
            cpu_workers: 1,
            experts: Some("cpu".into()),
            seqs: 2,
            admin_listen: Some(format!("127.0.0.1:{}", free_port()?)),
            ctx: (a.tg + 64).next_multiple_of(256).max(1024),
            pin: [
                ("w0".to_string(), vec![cpus[0]]),
                ("c0".to_string(), vec![cpus[1]]),
            ]
            .into(),
            extra_args: [(
                "w0".to_string(),
                vec!["--expert-overlap".to_string(), overlap.to_string()],
            )]
            .into(),
            ..UpArgs::bench(&a.model, 1, "shm", &listen, 1)
        };
        eprintln!("2 streams, own cores, --expert-overlap {overlap}: starting");
        let mut cluster = LocalCluster::start(&up, path, 1, true)?;
        let result = (|| {
            cluster.wait_ready(&listen, Duration::from_secs(600))?;
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let info = rt.block_on(crate::remote::info(&listen, Duration::from_secs(5)))?;
            let (mut runs, mut before) = (Vec::new(), Vec::new());
            for i in 0..=a.runs {
                if i == 1 {
                    before = rt.block_on(crate::remote::statuses(&info))?;
                }
                let (p0, p1) = (ids.take(1), ids.take(1));
                let (r0, r1) = rt.block_on(async {
                    tokio::join!(
                        decode_rate(&listen, &p0, a.tg, None),
                        decode_rate(&listen, &p1, a.tg, None)
                    )
                });
                if i > 0 {
                    runs.push(r0?.0 + r1?.0);
                }
            }
            let st = rt.block_on(crate::remote::statuses(&info))?;
            let overlapped: u64 = st.iter().map(|s| s.overlapped_steps).sum();
            anyhow::ensure!(
                (overlap == "on") == (overlapped > 0),
                "--expert-overlap {overlap}, yet {overlapped} steps overlapped"
            );
            anyhow::Ok((median(&mut runs), CallParts::between(&before, &st)))
        })();
        cluster.stop();
        let (r, call) =
            result.with_context(|| format!("two streams, --expert-overlap {overlap}"))?;
        eprintln!("2 streams, own cores, --expert-overlap {overlap}: {r:.2} tok/s in all");
        rates.push(r);
        calls.push(call);
    }
    Ok(Overlaps {
        off: rates[0],
        shared: rates[1],
        on: rates[2],
        calls: [calls[0], calls[1], calls[2]],
    })
}

/// Two streams' aggregate decode rates (`--overlap`), tok/s, and an expert
/// call's parts in each (off, shared, on).
#[derive(Clone, Copy)]
struct Overlaps {
    off: f64,
    shared: f64,
    on: f64,
    calls: [CallParts; 3],
}

/// Random token ids, as llama-bench uses: a new run never repeats a prompt.
struct Ids {
    state: u64,
    n_vocab: u64,
}

impl Ids {
    fn new(n_vocab: u64) -> Ids {
        Ids {
            state: 0x9E37_79B9_7F4A_7C15,
            n_vocab,
        }
    }
    fn take(&mut self, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| {
                self.state ^= self.state << 13;
                self.state ^= self.state >> 7;
                self.state ^= self.state << 17;
                // Past the few special tokens at the start of a vocabulary.
                (16 + self.state % (self.n_vocab - 16).max(1)) as u32
            })
            .collect()
    }
}

/// Bytes of routed expert weights one token reads: `n_used` experts' gate,
/// up and down matrices in every MoE layer.
fn routed_bytes_per_token(m: &omni_engine::ModelFile, n_used: u64) -> u64 {
    m.gguf
        .tensors()
        .iter()
        .filter(|t| {
            ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
                .iter()
                .any(|n| t.name.contains(n))
        })
        .map(|t| t.size / t.dims.last().copied().unwrap_or(1).max(1) * n_used)
        .sum()
}

/// Seconds to prefill `prompt` and sample one token, through the cluster.
async fn prefill_seconds(addr: &str, prompt: &[u32]) -> anyhow::Result<f64> {
    let t = Instant::now();
    let mut stream = generate_ids(addr, prompt, 1, None).await?;
    while let Some(ev) = stream.next().await {
        ev.map_err(|s| anyhow::anyhow!("{}", s.message()))?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Where the decode steps between two readings of the stage's Status went.
fn breakdown(
    before: &[omni_proto::worker::v1::StatusReply],
    after: &[omni_proto::worker::v1::StatusReply],
    expert_bytes: u64,
    threads: usize,
) -> Breakdown {
    let d = |f: fn(&omni_proto::worker::v1::StatusReply) -> f64| {
        after.iter().map(f).sum::<f64>() - before.iter().map(f).sum::<f64>()
    };
    // Every step of the decode runs is one token.
    let steps = (after.first().map_or(0, |s| s.steps) - before.first().map_or(0, |s| s.steps))
        .max(1) as f64;
    let per = |x: f64| 1e3 * x / steps;
    let wait = d(|s| s.expert_wait_seconds);
    let compute = d(|s| s.expert_compute_seconds);
    let experts_ms = per(compute);
    let call = CallParts::between(before, after);
    Breakdown {
        call,
        step_ms: per(d(|s| s.compute_seconds)),
        stage_ms: per(d(|s| s.compute_seconds) - wait),
        experts_ms,
        calls_ms: per(d(|s| s.expert_round_trip_seconds) - compute),
        wait_ms: per(wait),
        calls_per_token: d(|s| s.expert_calls as f64) / steps,
        expert_bytes: expert_bytes as f64,
        expert_gb_s_core: expert_bytes as f64 / (experts_ms / 1e3).max(1e-9) / 1e9 / threads as f64,
    }
}

fn report(
    a: &BenchMoeArgs,
    path: &std::path::Path,
    threads: usize,
    rows: &[Row],
    overlap: Option<Overlaps>,
    per_round: &PerRound,
) -> anyhow::Result<()> {
    // A row's ratios to llama.cpp: the median of each round's.
    let ratios = |i: usize| -> (Option<f64>, Option<f64>) {
        let m = |v: &[f64]| (!v.is_empty()).then(|| median(&mut v.to_vec()));
        per_round
            .vs_llama
            .get(i)
            .map_or((None, None), |(d, p)| (m(d), m(p)))
    };
    // Each round's own figures are worth printing only with several.
    let several = (a.rounds > 1).then_some(per_round);
    if a.json {
        let v: Vec<_> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let mut j = serde_json::to_value(r).unwrap_or_default();
                let (decode, prefill) = ratios(i);
                if let Some(d) = decode {
                    j["decode_vs_llama_cpp"] = d.into();
                }
                if let Some(p) = prefill {
                    j["prefill_vs_llama_cpp"] = p.into();
                }
                if let Some((d, p)) = several.and_then(|p| p.vs_llama.get(i)) {
                    j["decode_vs_llama_cpp_per_round"] = d.clone().into();
                    j["prefill_vs_llama_cpp_per_round"] = p.clone().into();
                }
                j
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "model": path, "threads_per_process": threads, "pp": a.pp, "tg": a.tg,
                "runs": a.runs, "rounds": a.rounds, "rows": v,
                "two_streams_own_cores": overlap.map(|o| serde_json::json!({
                    "overlap_off_tok_s": o.off, "overlap_shared_tok_s": o.shared,
                    "overlap_on_tok_s": o.on, "ratio": o.on / o.off,
                    "ratio_per_round": several.map(|p| p.overlap.clone()),
                    "expert_call_off": o.calls[0], "expert_call_shared": o.calls[1],
                    "expert_call_on": o.calls[2],
                })),
            }))?
        );
        return Ok(());
    }
    println!(
        "model {} | {threads} thread(s) per process | pp{} and tg{}, median of {}{}",
        path.display(),
        a.pp,
        a.tg,
        a.runs,
        if a.rounds > 1 {
            format!(
                " in each of {} rounds; figures are the rounds' medians, ratios the median of \
                 each round's",
                a.rounds
            )
        } else {
            String::new()
        }
    );
    println!(
        "{:<32} {:>10} {:>9} {:>11} {:>9}",
        "config", "decode t/s", "vs llama", "prefill t/s", "vs llama"
    );
    let x = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.2}x"));
    for (i, r) in rows.iter().enumerate() {
        let (decode, prefill) = ratios(i);
        println!(
            "{:<32} {:>10.2} {:>9} {:>11} {:>9}",
            r.config,
            r.decode_tok_s,
            x(decode),
            r.prefill_tok_s.map_or("-".into(), |p| format!("{p:.1}")),
            x(prefill)
        );
    }
    let list = |v: &[f64]| {
        v.iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(p) = several {
        for (r, (decode, prefill)) in rows
            .iter()
            .zip(&p.vs_llama)
            .take(rows.len().saturating_sub(1))
        {
            println!(
                "{}: each round's ratio to llama.cpp: decode {}; prefill {}",
                r.config,
                list(decode),
                list(prefill)
            );
        }
    }
    for r in rows {
        let Some(b) = r.breakdown else { continue };
        println!(
            "{}: a decode step {:.2} ms = stage {:.2} ms + waiting for experts {:.2} ms; \
             the expert worker computed {:.2} ms, the {:.0} calls cost {:.3} ms between processes \
             ({:.1}% of the step, {:.0} µs a call); routed expert weights {} a token, \
             {:.2} GB/s per core on the expert worker",
            r.config,
            b.step_ms,
            b.stage_ms,
            b.wait_ms,
            b.experts_ms,
            b.calls_per_token,
            b.calls_ms,
            100.0 * b.calls_ms / b.step_ms.max(1e-9),
            1e3 * b.calls_ms / b.calls_per_token.max(1.0),
            omni_engine::fmt_bytes(b.expert_bytes as u64),
            b.expert_gb_s_core
        );
        println!("{}: {}", r.config, b.call.describe());
    }
    for r in rows.iter().filter(|r| !r.steps.is_empty()) {
        let one = r.steps[0].1.max(1e-9);
        let each: Vec<String> = r
            .steps
            .iter()
            .map(|&(k, ms)| format!("{k} tokens {ms:.1} ms ({:.2}x)", ms / one))
            .collect();
        println!(
            "{}: one step of k tokens (verifying k - 1 drafts) beside one of 1 token: {}",
            r.config,
            each.join(", ")
        );
    }
    if let Some(Overlaps {
        off,
        shared,
        on,
        calls,
    }) = overlap
    {
        println!(
            "two streams, the stage and the expert worker on a core each: {on:.2} tok/s in all with \
             --expert-overlap on, {shared:.2} shared ({:.2}x), {off:.2} off ({:.2}x)",
            shared / off,
            on / off
        );
        if let Some(p) = several.filter(|p| !p.overlap.is_empty()) {
            let m = median(&mut p.overlap.clone());
            println!(
                "two streams: each round's on / off: {} (median {m:.2}x)",
                list(&p.overlap)
            );
        }
        for (mode, c) in ["off", "shared", "on"].iter().zip(calls) {
            println!("two streams, --expert-overlap {mode}: {}", c.describe());
        }
    }
    Ok(())
}
