//! The layer planner: which contiguous layer range each worker runs, decided
//! from the model file alone (tensor sizes from its tensor table,
//! hyper-parameters from its metadata) and the memory each worker offers,
//! before anything is loaded.
//!
//! A stage needs its weights (exact, from the tensor table), its KV cache
//! (exact: F16 K and V for its layers at `n_ctx × n_seq` cells) and a compute
//! buffer for one step of `n_ubatch` tokens (an upper bound of what ggml's
//! graph allocator reserves; see [`ComputeEstimate`]). Its budget is
//! `free × (1 − headroom)`. A plan that does not fit is an error naming the
//! stage, the worker and the numbers; a manual split is checked with the
//! same arithmetic and never overridden.
//!
//! A mixture-of-experts model keeps most of its bytes in the routed experts
//! (`blk.N.ffn_{gate,up,down}_exps`). With expert workers (CPU processes,
//! one per NUMA node) a layer's routed experts can run there while its stage
//! keeps attention, router, `exp_probs_b` and shared experts. [`ExpertPolicy`]
//! decides which: by default experts leave the devices only when the model
//! does not fit them otherwise, and then as few layers' experts as possible
//! (see [`plan_with_experts`]).

mod cost;
mod error;
mod experts;
mod joint;
mod notes;
mod pool;
mod show;
mod spec;
mod split;

use omni_engine::model::ModelFile;
use omni_engine::range::LayerRange;

use cost::{budget, ratio, Costs};
use experts::assign_experts;
use notes::{expert_notes, notes};
use pool::Pools;
use split::{choose_split, join, validate};

pub use cost::{
    compute_estimate, expert_compute_estimate, is_gpu, work_per_token, ComputeEstimate,
};
pub use error::{ExpertNoFit, NoFit, PlanError, SharedNoFit};
pub use joint::{
    plan_jointly, split_cores, CoreUse, DeviceUse, JointDevice, JointError, JointModel, JointPlan,
    ModelThreads, ModelUse, NamedPlan,
};
pub use show::fmt_layers;
pub use spec::{
    ExpertPlan, ExpertPolicy, MemoryPool, Plan, PlanConfig, Split, StageBytes, StagePlan,
    WorkerSpec,
};
pub use split::{min_max_split, proportions_to_counts};

/// Byte sizes as people type them ("6GiB", "512MiB", "2G", "1.5GiB") and as
/// we print them ("41.2 GiB"). They live in the engine so that every binary,
/// workers included, parses memory flags the same way.
pub use omni_engine::units::{fmt_bytes, parse_size};

/// Plans `model` over `workers` (in pipeline order), every layer's experts
/// on its stage: [`plan_with_experts`] without expert workers.
pub fn plan(
    model: &ModelFile,
    workers: &[WorkerSpec],
    cfg: &PlanConfig,
) -> Result<Plan, PlanError> {
    plan_with_experts(model, workers, &[], cfg)
}

/// Plans `model` over `workers` (in pipeline order) and `expert_workers`
/// (which may run MoE layers' routed experts), as `cfg.experts` says:
///
/// - `Device`, or `Auto` without expert workers or without experts in the
///   model: every layer's experts stay on its stage;
/// - `Auto`: that plan if it fits; otherwise the ranges are balanced on
///   the bytes without routed experts (every MoE layer's counted as
///   offloaded; a manual split fixes the ranges instead), then each stage
///   takes its layers' experts back, in layer order, while it still fits
///   its budget; the rest are offloaded;
/// - `Cpu`: every MoE layer's experts are offloaded (it needs expert
///   workers and an MoE model).
///
/// Offloaded layers go, in layer order, to the expert workers, each filled
/// to its budget (`free × (1 − headroom)` less its compute buffer, see
/// [`expert_compute_estimate`]) before the next. A stage that does not fit
/// even without experts is [`PlanError::DoesNotFit`]; experts the expert
/// workers cannot hold are [`PlanError::ExpertsDoNotFit`].
pub fn plan_with_experts(
    model: &ModelFile,
    workers: &[WorkerSpec],
    expert_workers: &[WorkerSpec],
    cfg: &PlanConfig,
) -> Result<Plan, PlanError> {
    let hp = &model.hparams;
    validate(hp, workers, cfg)?;
    let has_experts = !model.expert_layers().is_empty();
    if cfg.experts == ExpertPolicy::Cpu {
        if expert_workers.is_empty() {
            return Err(PlanError::Config(
                "--experts cpu puts every MoE layer's routed experts on expert workers, but there are none (give them with --expert-devices, e.g. numa0:256GiB)".into(),
            ));
        }
        if !has_experts {
            return Err(PlanError::Config(format!(
                "--experts cpu: this {} model has no routed experts to put on expert workers; use --experts auto or device",
                hp.arch.name()
            )));
        }
    }
    let mode = match cfg.experts {
        ExpertPolicy::Device => Offload::None,
        ExpertPolicy::Auto if expert_workers.is_empty() || !has_experts => Offload::None,
        ExpertPolicy::Cpu => Offload::All,
        ExpertPolicy::Auto => match build(model, workers, expert_workers, cfg, Offload::None) {
            Err(PlanError::DoesNotFit(_) | PlanError::SharedDoesNotFit(_)) => Offload::PutBack,
            done => return done,
        },
    };
    build(model, workers, expert_workers, cfg, mode)
}

/// How an automatic split was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AutoSplit {
    /// Balanced by the work per token, within memory.
    Work,
    /// In proportion to the budgets.
    Proportional,
    /// Filling the workers most evenly (nothing else fit).
    Packed,
}

/// Which routed experts may leave their stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Offload {
    /// None.
    None,
    /// Every MoE layer's.
    All,
    /// Every MoE layer's, then back to each stage while it fits.
    PutBack,
}

/// Why a stage's experts went out (`Offload::PutBack`): its total with all
/// of them back, and with only the first of them back; when its worker
/// shares memory, that memory's name, who else is on it and what is left.
#[derive(Clone)]
pub(crate) struct Overflow {
    pub(crate) with_all: u64,
    pub(crate) with_first: u64,
    pub(crate) shared_left: Option<(String, String, u64)>,
}

pub(crate) fn build(
    model: &ModelFile,
    workers: &[WorkerSpec],
    expert_workers: &[WorkerSpec],
    cfg: &PlanConfig,
    mode: Offload,
) -> Result<Plan, PlanError> {
    let hp = &model.hparams;
    let n_layer = hp.n_layer;
    let costs = Costs::new(model, cfg, mode != Offload::None, workers);
    let pools = Pools::new(workers, expert_workers, cfg.headroom);
    let budgets: Vec<u64> = workers
        .iter()
        .map(|wk| budget(wk.free_bytes, cfg.headroom))
        .collect();
    let (mut counts, how, mut auto) = choose_split(&costs, workers, cfg, mode, &budgets)?;
    let mut moved = false;
    if cfg.split.is_none() {
        if let Some((c, a)) =
            resplit_for_shared(&costs, &pools, workers, cfg, mode, &budgets, &counts)?
        {
            (counts, auto, moved) = (c, a, true);
        }
    }

    let ranges = LayerRange::split(n_layer, &counts).expect("counts add up to n_layer");
    let mut stages: Vec<StagePlan> = ranges
        .into_iter()
        .zip(workers)
        .enumerate()
        .map(|(i, (range, wk))| {
            let offloaded = costs.offloaded_in(&range);
            StagePlan {
                worker: wk.id.clone(),
                device: wk.device.clone(),
                bytes: costs.stage_bytes(i, &range, wk, &offloaded),
                range,
                offloaded,
                stream_bytes: 0,
            }
        })
        .collect();

    let split_phrase = || {
        let mut split = how
            .clone()
            .unwrap_or_else(|| format!("the best automatic split (layers {})", join(&counts)));
        if mode != Offload::None {
            split.push_str(&format!(
                " with the routed experts of every MoE layer on the expert workers{}",
                if cfg.gpu_experts > 0 {
                    format!(" (but {} per layer)", cfg.gpu_experts)
                } else {
                    String::new()
                }
            ));
        }
        split
    };
    check_fit(&stages, workers, cfg, &pools, &budgets, split_phrase)?;
    let stage_totals: Vec<u64> = stages.iter().map(|s| s.bytes.total).collect();

    let mut shared_used = pools.stage_use(&stage_totals);
    let overflow = if mode == Offload::PutBack {
        put_back(&mut stages, &costs, &pools, &mut shared_used)
    } else {
        vec![None; stages.len()]
    };

    plan_streaming(&mut stages, &costs, &pools, &mut shared_used);

    let offloaded: Vec<u32> = stages
        .iter()
        .flat_map(|s| s.offloaded.iter().copied())
        .collect();
    let experts = assign_experts(&costs, expert_workers, &offloaded, &pools, &shared_used)?;

    let mut notes = notes(model, cfg, &costs, &stages, &counts, auto);
    if !pools.is_empty() {
        let stage_totals: Vec<u64> = stages.iter().map(|s| s.bytes.total).collect();
        let expert_totals: Vec<u64> = expert_workers
            .iter()
            .map(|w| {
                experts
                    .iter()
                    .find(|e| e.worker == w.id)
                    .map_or(0, |e| e.bytes.total)
            })
            .collect();
        notes.extend(pools.notes(&stage_totals, &expert_totals, cfg.headroom, moved));
    }
    notes.extend(expert_notes(
        model,
        cfg,
        &costs,
        mode,
        &stages,
        &overflow,
        expert_workers,
        &experts,
    ));
    Ok(Plan {
        model: model.path.display().to_string(),
        arch: hp.arch.name().to_string(),
        n_layer,
        config: cfg.clone(),
        stages,
        experts,
        notes,
    })
}

/// An automatic split made on each worker's own offer may put more on
/// workers that share memory than that memory holds: searches again with
/// each of them given a part of it (in proportion to what it held, then to
/// its own offer), which moves layers to workers with memory of their own.
/// `None`: `counts` is within every shared memory, or no search fixed it.
fn resplit_for_shared(
    costs: &Costs<'_>,
    pools: &Pools,
    workers: &[WorkerSpec],
    cfg: &PlanConfig,
    mode: Offload,
    budgets: &[u64],
    counts: &[u32],
) -> Result<Option<(Vec<u32>, AutoSplit)>, PlanError> {
    let totals = |counts: &[u32]| -> Vec<u64> {
        let ranges = LayerRange::split(costs.model.hparams.n_layer, counts).expect("counts add up");
        ranges
            .iter()
            .zip(workers)
            .enumerate()
            .map(|(i, (r, wk))| costs.stage_bytes(i, r, wk, &costs.offloaded_in(r)).total)
            .collect()
    };
    let held = totals(counts);
    if pools.overflow(&held).is_none() {
        return Ok(None);
    }
    for weights in [held.as_slice(), budgets] {
        let shares = pools.shares(budgets, weights);
        let (c, _, a) = choose_split(costs, workers, cfg, mode, &shares)?;
        let t = totals(&c);
        let own = t.iter().zip(budgets).all(|(t, b)| t <= b);
        if own && pools.overflow(&t).is_none() {
            return Ok(Some((c, a)));
        }
    }
    Ok(None)
}

/// The plan's stages within their budgets (the worst stage, by share of its
/// budget, is the one named), then within the memory they share.
fn check_fit(
    stages: &[StagePlan],
    workers: &[WorkerSpec],
    cfg: &PlanConfig,
    pools: &Pools,
    budgets: &[u64],
    split_phrase: impl Fn() -> String,
) -> Result<(), PlanError> {
    let worst = stages
        .iter()
        .enumerate()
        .max_by(|(_, a), (_, b)| {
            ratio(a.bytes.total, a.bytes.budget).total_cmp(&ratio(b.bytes.total, b.bytes.budget))
        })
        .map(|(i, _)| i)
        .expect("at least one stage");
    let ws = &stages[worst];
    if ws.bytes.total > ws.bytes.budget {
        return Err(PlanError::DoesNotFit(Box::new(NoFit {
            stage: worst,
            worker: ws.worker.clone(),
            device: ws.device.clone(),
            range: ws.range.clone(),
            bytes: ws.bytes.clone(),
            total_bytes: workers[worst].total_bytes,
            headroom: cfg.headroom,
            split: split_phrase(),
            all_need: stages.iter().map(|s| s.bytes.total).sum(),
            all_budget: pools.stage_offer(budgets),
            shared: pools.summary(),
        })));
    }
    // Then the memory workers share: their stages together within it.
    let stage_totals: Vec<u64> = stages.iter().map(|s| s.bytes.total).collect();
    if let Some((p, need)) = pools.overflow(&stage_totals) {
        let sh = &pools.shared[p];
        let on: Vec<&StagePlan> = sh.stages.iter().map(|&i| &stages[i]).collect();
        let sum = |f: fn(&StageBytes) -> u64| on.iter().map(|s| f(&s.bytes)).sum::<u64>();
        return Err(PlanError::SharedDoesNotFit(Box::new(SharedNoFit {
            memory: sh.name.clone(),
            workers: pool::and_list(&on.iter().map(|s| s.worker.as_str()).collect::<Vec<_>>()),
            stages: sh
                .stages
                .iter()
                .map(|&i| (i, stages[i].range.clone(), stages[i].bytes.total))
                .collect(),
            weights: sum(|b| b.weights),
            kv: sum(|b| b.kv),
            compute: sum(|b| b.compute),
            need,
            free: sh.free,
            budget: sh.budget,
            headroom: cfg.headroom,
            split: split_phrase(),
        })));
    }
    Ok(())
}

/// A GPU stage left with offloaded layers keeps room in its compute buffer
/// for the largest of those layers' routed experts, which a prompt step
/// streams from host memory to compute them on the device
/// (`--stream-experts`), where that fits its budget (and what is left of
/// memory it shares); otherwise it sends every step's experts to the expert
/// workers.
fn plan_streaming(
    stages: &mut [StagePlan],
    costs: &Costs<'_>,
    pools: &Pools,
    shared_used: &mut [u64],
) {
    for (i, s) in stages.iter_mut().enumerate() {
        if !is_gpu(&s.device) {
            continue;
        }
        let Some(need) = costs.stream_need(&s.offloaded) else {
            continue;
        };
        let pool = pools.of_stage(i);
        if need > stage_room(s, pool, pools, shared_used) {
            continue;
        }
        s.stream_bytes = need;
        s.bytes.compute += need;
        s.bytes.total += need;
        if let Some(p) = pool {
            shared_used[p] += need;
        }
    }
}

/// What stage `s` can still take: its own budget less its bytes, and no
/// more than is left of the memory it shares (`pool`), `used` so far.
fn stage_room(s: &StagePlan, pool: Option<usize>, pools: &Pools, used: &[u64]) -> u64 {
    let own = s.bytes.budget.saturating_sub(s.bytes.total);
    match pool {
        Some(p) => own.min(pools.shared[p].budget.saturating_sub(used[p])),
        None => own,
    }
}

/// Each stage takes its layers' experts back, in layer order, while it fits
/// (its own budget, and what is left of memory it shares); per stage, why
/// the rest stayed out.
fn put_back(
    stages: &mut [StagePlan],
    costs: &Costs<'_>,
    pools: &Pools,
    shared_used: &mut [u64],
) -> Vec<Option<Overflow>> {
    let mut overflow: Vec<Option<Overflow>> = vec![None; stages.len()];
    for (i, (s, o)) in stages.iter_mut().zip(&mut overflow).enumerate() {
        let pool = pools.of_stage(i);
        let room = |s: &StagePlan, used: &[u64]| stage_room(s, pool, pools, used);
        let mut back = 0;
        for &il in &s.offloaded {
            if costs.saved(il) > room(s, shared_used) {
                break;
            }
            s.bytes.weights += costs.saved(il);
            s.bytes.total += costs.saved(il);
            if let Some(p) = pool {
                shared_used[p] += costs.saved(il);
            }
            back += 1;
        }
        s.offloaded.drain(..back);
        if let Some(&first) = s.offloaded.first() {
            let out: u64 = s.offloaded.iter().map(|&il| costs.saved(il)).sum();
            *o = Some(Overflow {
                with_all: s.bytes.total + out,
                with_first: s.bytes.total + costs.saved(first),
                shared_left: pool.map(|p| {
                    (
                        pools.shared[p].name.clone(),
                        pools.others(p, &s.worker),
                        pools.shared[p].budget.saturating_sub(shared_used[p]),
                    )
                }),
            });
        }
    }
    overflow
}
