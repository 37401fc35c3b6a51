//! The notes under a plan: where the numbers come from and what to change.

use crate::cost::expert_compute_estimate;
use crate::cost::is_gpu;
use crate::cost::ratio;
use crate::cost::stage_work_bytes;
use crate::cost::Costs;
use crate::show::fmt_layers;
use crate::show::layers_phrase;
use crate::show::pct;
use crate::spec::ExpertPlan;
use crate::spec::ExpertPolicy;
use crate::spec::PlanConfig;
use crate::spec::Split;
use crate::spec::StagePlan;
use crate::spec::WorkerSpec;
use crate::split::join;
use crate::AutoSplit;
use crate::Offload;
use crate::Overflow;
use omni_engine::model::ModelFile;
use omni_engine::units::fmt_bytes;

pub(crate) fn work_note(model: &ModelFile, costs: &Costs<'_>, stages: &[StagePlan]) -> String {
    let work = stage_work_bytes(model, costs.head_bytes, stages);
    let total: u64 = work.iter().sum::<u64>().max(1);
    let shares: Vec<String> = work
        .iter()
        .enumerate()
        .map(|(i, w)| format!("stage {i} {:.0}%", 100.0 * *w as f64 / total as f64))
        .collect();
    let mut note = format!(
        "work: a decoded token reads about {} of weights ({}; the head, {}, is the last stage's; the embedding is a row lookup); stages on the same cores take turns, so this is how a step's time divides; on devices of their own the busiest stage sets the pace",
        fmt_bytes(total),
        shares.join(", "),
        fmt_bytes(costs.head_bytes)
    );
    if let Some(rate) = &costs.rate {
        let times: Vec<String> = work
            .iter()
            .zip(rate)
            .enumerate()
            .map(|(i, (w, r))| {
                format!(
                    "stage {i} {:.2} ms at {:.1} GB/s",
                    *w as f64 / r * 1e3,
                    r / 1e9
                )
            })
            .collect();
        note.push_str(&format!(
            "; at the workers' read rates (each stage worker times a one-token quantized matrix-vector product on its device when it starts; workers taking turns on the same cores or GPU count once, at the best of their figures; a dry run takes them as NAME:SIZE@RATE), those reads take {}",
            times.join(", ")
        ));
    }
    note
}

pub(crate) fn notes(
    model: &ModelFile,
    cfg: &PlanConfig,
    costs: &Costs<'_>,
    stages: &[StagePlan],
    counts: &[u32],
    auto: AutoSplit,
) -> Vec<String> {
    let hp = &model.hparams;
    let tensors = model.gguf.tensors();
    let file_bytes: u64 = tensors.iter().map(|t| t.size).sum();
    let mut notes = vec![format!(
        "weights: exact sizes from the GGUF tensor table ({} tensors, {} in all); each stage holds its layers' tensors, the first also token_embd.weight, the last output_norm.weight and {}",
        tensors.len(),
        fmt_bytes(file_bytes),
        if hp.tied_embeddings {
            "the output projection, which is token_embd.weight again (tied embeddings: with more than one stage it is held twice)"
        } else {
            "output.weight"
        }
    )];
    if costs.gpu.first().copied().unwrap_or(false) {
        notes.push(format!(
            "weights: on a GPU the first stage keeps token_embd.weight ({}) in host memory for the row lookup, so it is not counted against the GPU{}",
            fmt_bytes(costs.embed_bytes),
            if hp.tied_embeddings {
                "; a GPU head has its own copy of it as the output projection"
            } else {
                ""
            }
        ));
    }
    let (kd, vd) = (hp.n_embd_k_gqa(), hp.n_embd_v_cache());
    notes.push(format!(
        "KV cache: F16 K and V, 2 bytes x ({kd} + {vd}) per cell x {} ctx x {} seqs = {} per layer",
        cfg.n_ctx,
        cfg.n_seq,
        fmt_bytes(costs.kv_per_layer)
    ));
    let e = &costs.est;
    notes.push(format!(
        "compute: upper bound of ggml's compute buffer for a step of {} tokens over {} KV cells: inputs (hidden state {}, masks {} each), embedding {}, widest layer {} (n_embd {}, n_ff {}, {} heads x {}, {} KV heads), head {} (logits of {} tokens x {} vocab), + 1 MiB",
        e.n_tokens,
        e.n_kv,
        fmt_bytes(e.hidden_in),
        fmt_bytes(e.mask),
        fmt_bytes(e.embed),
        fmt_bytes(e.layer),
        hp.n_embd,
        hp.n_ff,
        hp.n_head,
        hp.head_dim_k,
        hp.n_head_kv,
        fmt_bytes(e.head),
        e.n_tokens,
        hp.n_vocab,
    ));
    notes.push(format!(
        "budget: free x (1 - {}% headroom); the headroom also covers ggml's small per-step CPU work buffer",
        pct(cfg.headroom)
    ));
    let worst = stages
        .iter()
        .enumerate()
        .map(|(i, s)| (i, ratio(s.bytes.total, s.bytes.budget)))
        .max_by(|a, b| a.1.total_cmp(&b.1));
    let worst = worst.map_or(String::new(), |(i, r)| {
        format!("; fullest: stage {i} at {:.0}% of its budget", r * 100.0)
    });
    if stages.len() > 1 {
        notes.push(work_note(model, costs, stages));
    }
    notes.push(match &cfg.split {
        None if stages.len() == 1 => format!("split: one worker runs the whole model{worst}"),
        None if auto == AutoSplit::Work => format!(
            "split: automatic, layers {}: the slowest stage as fast as it can be, from the weight bytes each stage reads per decoded token (see work){}, with every stage within its budget (--split or --counts set it by hand){worst}",
            join(counts),
            if costs.rate.is_some() {
                " over the rate its worker reads weights at"
            } else {
                "; the workers' speeds are not known, so workers of one kind count as equally fast"
            }
        ),
        None if auto == AutoSplit::Packed => format!(
            "split: automatic, layers {}: layers in proportion to the budgets did not fit, so contiguous ranges minimising the largest total/budget, then evening out the rest{worst}",
            join(counts)
        ),
        None => format!(
            "split: automatic, layers {}: in proportion to each worker's budget (llama.cpp's --tensor-split rule with the budgets as shares){worst}",
            join(counts)
        ),
        Some(Split::Layers(_)) => format!("split: manual, layers {} as given{worst}", join(counts)),
        Some(Split::Proportions(p)) => format!(
            "split: manual proportions {} -> layers {} (llama.cpp's --tensor-split rule: layer i goes to the first stage whose cumulative share exceeds i/{}){worst}",
            p.iter().map(|x| format!("{x}")).collect::<Vec<_>>().join(","),
            join(counts),
            hp.n_layer
        ),
    });
    if let Some(n) = cpu_beside_gpus_note(stages) {
        notes.push(n);
    }
    notes
}

/// When the CPU is offered beside GPUs it gets layers like any device (every
/// worker runs at least one), and they run at the CPU's speed: say so, and
/// how to keep them on the GPUs.
pub(crate) fn cpu_beside_gpus_note(stages: &[StagePlan]) -> Option<String> {
    if !stages.iter().any(|s| is_gpu(&s.device)) {
        return None;
    }
    let on_cpu: Vec<String> = stages
        .iter()
        .filter(|s| !is_gpu(&s.device) && !s.range.layers.is_empty())
        .map(|s| format!("{} ({}) runs {}", s.worker, s.device, s.range))
        .collect();
    if on_cpu.is_empty() {
        return None;
    }
    Some(format!(
        "cpu: {} beside the GPUs: layers on the CPU run at its speed, and the slowest stage sets the pace; to keep them on the GPUs give the GPUs more memory (or need less: lower the context or sequences), leave the CPU out (of --devices for omnictl plan, of --device for omnictl up), or place layers by hand with --counts",
        on_cpu.join(", ")
    ))
}

/// What the plan did with the routed experts, and why.
#[allow(clippy::too_many_arguments)]
pub(crate) fn expert_notes(
    model: &ModelFile,
    cfg: &PlanConfig,
    costs: &Costs<'_>,
    mode: Offload,
    stages: &[StagePlan],
    overflow: &[Option<Overflow>],
    expert_workers: &[WorkerSpec],
    experts: &[ExpertPlan],
) -> Vec<String> {
    let hp = &model.hparams;
    let moe: Vec<u32> = (0..hp.n_layer)
        .filter(|&il| costs.expert[il as usize] > 0)
        .collect();
    let unused: Vec<&str> = expert_workers
        .iter()
        .filter(|w| !experts.iter().any(|e| e.worker == w.id))
        .map(|w| w.id.as_str())
        .collect();
    let unused = if unused.is_empty() {
        String::new()
    } else {
        format!("; expert workers unused: {}", unused.join(", "))
    };
    let mut notes = Vec::new();
    let Some(m) = hp.moe.as_ref().filter(|_| !moe.is_empty()) else {
        if !expert_workers.is_empty() {
            notes.push(format!("experts: the model has no routed experts{unused}"));
        }
        return notes;
    };
    let sizes = moe.iter().map(|&il| costs.expert[il as usize]);
    let (lo, hi) = (
        sizes.clone().min().unwrap_or(0),
        sizes.clone().max().unwrap_or(0),
    );
    notes.push(format!(
        "experts: {} {} {} routed experts each ({} used per token), {} per layer, {} in all (ffn_gate_exps, ffn_up_exps, ffn_down_exps, exact from the tensor table)",
        layers_phrase(&moe),
        if moe.len() == 1 { "has" } else { "have" },
        m.n_expert,
        m.n_expert_used,
        if lo == hi {
            fmt_bytes(lo)
        } else {
            format!("{} to {}", fmt_bytes(lo), fmt_bytes(hi))
        },
        fmt_bytes(sizes.sum()),
    ));
    notes.push(match (mode, cfg.experts) {
        (Offload::None, ExpertPolicy::Device) => format!(
            "experts: --experts device: every MoE layer keeps its routed experts on its stage{unused}"
        ),
        (Offload::None, _) if expert_workers.is_empty() => {
            "experts: every MoE layer keeps its routed experts on its stage (no expert workers)"
                .into()
        }
        (Offload::None, _) => format!(
            "experts: the whole model fits the devices, so every MoE layer keeps its routed experts on its stage{unused}"
        ),
        (Offload::All, _) => format!(
            "experts: --experts cpu: the routed experts of every MoE layer run on the expert workers; {}, and each stage keeps its layers' attention, router, exp_probs_b and shared experts",
            if cfg.split.is_some() {
                "the manual split fixes the ranges"
            } else {
                "the ranges are balanced on the bytes without them"
            }
        ),
        (Offload::PutBack, _) => format!(
            "experts: with their routed experts the layers do not fit the devices, so {}, then each stage takes its layers' experts back, in layer order, while it fits its budget; the rest run on the expert workers",
            if cfg.split.is_some() {
                "each stage of the manual split starts from its layers without them"
            } else {
                "the ranges are balanced on the bytes without them"
            }
        ),
    });
    if mode == Offload::None {
        return notes;
    }
    let k = cfg.gpu_experts.min(m.n_expert);
    if k > 0 && !experts.is_empty() {
        notes.push(format!(
            "experts: each stage also holds {k} of the {} routed experts of each of its offloaded layers{} (counted in its weights; the expert workers hold all of them)",
            m.n_expert,
            if cfg.gpu_experts > m.n_expert {
                format!(" (--gpu-experts {} capped at the expert count)", cfg.gpu_experts)
            } else {
                String::new()
            }
        ));
    }
    for (i, (s, o)) in stages.iter().zip(overflow).enumerate() {
        notes.extend(stage_expert_note(i, s, o.as_ref(), costs, experts));
    }
    if !experts.is_empty() {
        let n = cfg.n_ubatch;
        notes.push(format!(
            "expert compute: upper bound of an expert worker's compute buffer for a step of {n} tokens: input {n} x {} floats, ids and weights {n} x {}, per used expert and token 3 x {} floats (gate, up, activation) and 2 x {} (output, weighted), + 1 MiB = {}",
            hp.n_embd,
            m.n_expert_used,
            m.n_ff_exp,
            hp.n_embd,
            fmt_bytes(expert_compute_estimate(hp, n)),
        ));
        notes.push(format!(
            "expert workers: the offloaded layers in layer order, each worker filled to its budget (free x (1 - {}% headroom) less its compute buffer) before the next{unused}",
            pct(cfg.headroom)
        ));
    }
    notes
}

/// Where stage `i`'s routed experts run and, for those offloaded, why;
/// `None` for a stage without MoE layers.
fn stage_expert_note(
    i: usize,
    s: &StagePlan,
    o: Option<&Overflow>,
    costs: &Costs<'_>,
    experts: &[ExpertPlan],
) -> Option<String> {
    let own: Vec<u32> = s
        .range
        .layers
        .clone()
        .filter(|&il| costs.expert[il as usize] > 0)
        .collect();
    if own.is_empty() {
        return None;
    }
    let kept: Vec<u32> = own
        .iter()
        .copied()
        .filter(|il| !s.offloaded.contains(il))
        .collect();
    let head = format!("experts: stage {i} ({})", s.worker);
    if s.offloaded.is_empty() {
        return Some(format!(
            "{head}: keeps the routed experts of {}",
            layers_phrase(&kept)
        ));
    }
    let dest: Vec<(&str, Vec<u32>)> = experts
        .iter()
        .map(|e| {
            let l = e
                .layers
                .iter()
                .copied()
                .filter(|il| s.offloaded.contains(il))
                .collect::<Vec<u32>>();
            (e.worker.as_str(), l)
        })
        .filter(|(_, l)| !l.is_empty())
        .collect();
    let dest = match dest.as_slice() {
        [(w, _)] => w.to_string(),
        many => many
            .iter()
            .map(|(w, l)| format!("{w} ({})", fmt_layers(l)))
            .collect::<Vec<_>>()
            .join(", "),
    };
    let mut n = format!(
        "{head}: experts of {} go to {dest}",
        layers_phrase(&s.offloaded)
    );
    match o {
        Some(o) => {
            n.push_str(&format!(
                ": with them stage {i} would need {}",
                fmt_bytes(o.with_all)
            ));
            if s.offloaded.len() > 1 {
                n.push_str(&format!(
                    " (with layer {}'s alone {})",
                    s.offloaded[0],
                    fmt_bytes(o.with_first)
                ));
            }
            n.push_str(&format!(", it has {} usable", fmt_bytes(s.bytes.budget)));
            if let Some((memory, others, left)) = &o.shared_left {
                n.push_str(&format!(
                    " and shares {memory} with {others}, of which {} is left",
                    fmt_bytes(*left)
                ));
            }
        }
        None => n.push_str(" (--experts cpu)"),
    }
    if !kept.is_empty() {
        n.push_str(&format!("; it keeps those of {}", layers_phrase(&kept)));
    }
    if crate::is_gpu(&s.device) {
        if s.stream_bytes > 0 {
            n.push_str(&format!(
                "; prompt steps stream them to {} instead, a layer at a time (--stream-experts; {} of its compute buffer)",
                s.device,
                fmt_bytes(s.stream_bytes)
            ));
        } else {
            n.push_str(&format!(
                "; no room on {} to stream a layer's experts ({}) for prompt steps",
                s.device,
                fmt_bytes(costs.stream_need(&s.offloaded).unwrap_or(0))
            ));
        }
    }
    Some(n)
}
