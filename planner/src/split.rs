//! Which layers go where: manual splits checked, automatic ones balanced on work or memory.

use crate::cost::budget;
use crate::cost::is_gpu;
use crate::cost::ratio;
use crate::cost::Costs;
use crate::error::PlanError;
use crate::spec::PlanConfig;
use crate::spec::Split;
use crate::spec::WorkerSpec;
use crate::AutoSplit;
use crate::Offload;
use omni_engine::model::Hparams;
use omni_engine::model::ModelFile;
use omni_engine::range::LayerRange;

/// The layer counts per stage, how a manual split was given (`None` when
/// automatic) and how an automatic one was made, for stages that must fit
/// `budgets` (each worker's own, or its part of memory it shares).
pub(crate) fn choose_split(
    costs: &Costs<'_>,
    workers: &[WorkerSpec],
    cfg: &PlanConfig,
    mode: Offload,
    budgets: &[u64],
) -> Result<(Vec<u32>, Option<String>, AutoSplit), PlanError> {
    let n_layer = costs.model.hparams.n_layer;
    let one_kind = workers
        .iter()
        .all(|wk| is_gpu(&wk.device) == is_gpu(&workers[0].device));
    Ok(match &cfg.split {
        // Every expert with its layer, and workers whose speed is known
        // (measured) or alike (one kind: all CPUs or all GPUs): balanced by
        // the time each stage takes per token, within memory, so that the
        // slowest stage is as fast as it can be.
        None if (one_kind || costs.rate.is_some())
            && mode == Offload::None
            && workers.len() > 1 =>
        {
            match work_split(costs, budgets, n_layer) {
                Some(c) => (c, None, AutoSplit::Work),
                None => (auto_split(costs, budgets, n_layer), None, AutoSplit::Packed),
            }
        }
        None => {
            // Layers in proportion to each worker's budget (what a user of
            // llama.cpp's --tensor-split would pick by hand), unless that
            // does not fit: then the split that fills the workers most evenly.
            let shares: Vec<f64> = budgets.iter().map(|&b| b as f64).collect();
            let fits = |c: &[u32]| {
                let ranges = LayerRange::split(n_layer, c).expect("counts add up");
                ranges.iter().zip(workers).enumerate().all(|(i, (r, wk))| {
                    let b = costs.stage_bytes(i, r, wk, &costs.offloaded_in(r));
                    b.total <= budgets[i]
                })
            };
            match proportions_to_counts(&shares, workers, n_layer) {
                Ok(c) if fits(&c) => (c, None, AutoSplit::Proportional),
                _ => (auto_split(costs, budgets, n_layer), None, AutoSplit::Packed),
            }
        }
        Some(Split::Layers(c)) => {
            check_counts(c, workers, n_layer, "--counts")?;
            (
                c.clone(),
                Some(format!("the manual split --counts {}", join(c))),
                AutoSplit::Proportional,
            )
        }
        Some(Split::Proportions(p)) => {
            let c = proportions_to_counts(p, workers, n_layer)?;
            let shown: Vec<String> = p.iter().map(|x| format!("{x}")).collect();
            (
                c.clone(),
                Some(format!(
                    "the manual split {} (layers {})",
                    shown.join(","),
                    join(&c)
                )),
                AutoSplit::Proportional,
            )
        }
    })
}

pub(crate) fn join(c: &[u32]) -> String {
    c.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

pub(crate) fn validate(
    hp: &Hparams,
    workers: &[WorkerSpec],
    cfg: &PlanConfig,
) -> Result<(), PlanError> {
    if workers.is_empty() {
        return Err(PlanError::NoWorkers);
    }
    let bad = |s: String| Err(PlanError::Config(s));
    if cfg.n_ctx == 0 || cfg.n_seq == 0 || cfg.n_ubatch == 0 {
        return bad(format!(
            "context ({}), sequences ({}) and micro-batch ({}) must all be at least 1",
            cfg.n_ctx, cfg.n_seq, cfg.n_ubatch
        ));
    }
    if cfg.n_ctx > hp.n_ctx_train as usize {
        return bad(format!(
            "context {} exceeds the model's trained context of {} tokens",
            cfg.n_ctx, hp.n_ctx_train
        ));
    }
    if !(0.0..1.0).contains(&cfg.headroom) {
        return bad(format!(
            "headroom {} is not a fraction in [0, 1) (0.10 keeps 10% of each worker's free memory unplanned)",
            cfg.headroom
        ));
    }
    if workers.len() > hp.n_layer as usize {
        return Err(PlanError::TooManyWorkers {
            workers: workers.len(),
            n_layer: hp.n_layer,
        });
    }
    Ok(())
}

pub(crate) fn check_counts(
    counts: &[u32],
    workers: &[WorkerSpec],
    n_layer: u32,
    what: &str,
) -> Result<(), PlanError> {
    if counts.len() != workers.len() {
        return Err(PlanError::Split(format!(
            "{what} has {} entries ({}) but there are {} workers",
            counts.len(),
            join(counts),
            workers.len()
        )));
    }
    if let Some(i) = counts.iter().position(|&c| c == 0) {
        return Err(PlanError::Split(format!(
            "{what} {} gives stage {i} (worker {}) no layers; every worker needs at least one",
            join(counts),
            workers[i].id
        )));
    }
    let sum: u64 = counts.iter().map(|&c| u64::from(c)).sum();
    if sum != u64::from(n_layer) {
        return Err(PlanError::Split(format!(
            "{what} {} adds up to {sum} layers but the model has {n_layer}",
            join(counts)
        )));
    }
    Ok(())
}

/// llama.cpp's `--tensor-split` rule (see [`Split::Proportions`]).
pub fn proportions_to_counts(
    p: &[f64],
    workers: &[WorkerSpec],
    n_layer: u32,
) -> Result<Vec<u32>, PlanError> {
    let shown = || {
        p.iter()
            .map(|x| format!("{x}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    if p.len() != workers.len() {
        return Err(PlanError::Split(format!(
            "--split has {} entries ({}) but there are {} workers",
            p.len(),
            shown(),
            workers.len()
        )));
    }
    if let Some(x) = p.iter().find(|x| !x.is_finite() || **x < 0.0) {
        return Err(PlanError::Split(format!(
            "--split {}: {x} is not a non-negative number",
            shown()
        )));
    }
    let sum: f64 = p.iter().sum();
    if sum <= 0.0 {
        return Err(PlanError::Split(format!(
            "--split {} has no positive entry",
            shown()
        )));
    }
    let mut cum = Vec::with_capacity(p.len());
    let mut acc = 0.0;
    for x in p {
        acc += x;
        cum.push(acc / sum);
    }
    let mut counts = vec![0u32; p.len()];
    for il in 0..n_layer {
        let at = f64::from(il) / f64::from(n_layer);
        let i = cum.partition_point(|&c| c <= at).min(p.len() - 1);
        counts[i] += 1;
    }
    check_counts(&counts, workers, n_layer, &format!("--split {}", shown())).map_err(
        |e| match e {
            PlanError::Split(s) => PlanError::Split(format!(
                "{s} (llama.cpp's rule maps it to layers {})",
                join(&counts)
            )),
            e => e,
        },
    )?;
    Ok(counts)
}

/// The fallback automatic split, for tests and `omnictl plan`: contiguous
/// layer counts that minimise the largest `total / budget`, then,
/// among those, the sum of squares of `total / budget` (so stages other than
/// the bottleneck are balanced too). Exact dynamic programming, O(w·n²).
pub fn min_max_split(model: &ModelFile, workers: &[WorkerSpec], cfg: &PlanConfig) -> Vec<u32> {
    let costs = Costs::new(model, cfg, false, workers);
    let budgets: Vec<u64> = workers
        .iter()
        .map(|wk| budget(wk.free_bytes, cfg.headroom))
        .collect();
    auto_split(&costs, &budgets, model.hparams.n_layer)
}

pub(crate) fn auto_split(costs: &Costs<'_>, budgets: &[u64], n_layer: u32) -> Vec<u32> {
    let w = budgets.len();
    let r = |i: usize, a: usize, b: usize| ratio(costs.total(i, w, a as u32, b as u32), budgets[i]);
    min_max_counts(w, n_layer as usize, &r).1
}

/// The split that makes the slowest stage as fast as it can be: contiguous
/// counts minimising the largest [`Costs::time`] among the splits where
/// every stage fits its budget (then, among those, the sum of squares of
/// the times, so the other stages are even too). None when no split fits.
///
/// Stages that take turns on one host's cores or one GPU add up rather than
/// overlap; the search still treats each stage as its own (a contiguous
/// search cannot group them), which is exact when the turn-takers are all
/// the stages (any split then takes the same time, and this one evens
/// them) or none of them.
pub(crate) fn work_split(costs: &Costs<'_>, budgets: &[u64], n_layer: u32) -> Option<Vec<u32>> {
    let w = budgets.len();
    let r = |i: usize, a: usize, b: usize| {
        let (a, b) = (a as u32, b as u32);
        if costs.total(i, w, a, b) <= budgets[i] {
            costs.time(i, w, a, b)
        } else {
            f64::INFINITY
        }
    };
    let (worst, counts) = min_max_counts(w, n_layer as usize, &r);
    worst.is_finite().then_some(counts)
}

/// Contiguous counts of `n` layers over `w` stages (at least one each) that
/// minimise the largest `r(stage, a, b)` of stage ranges `a..b`, then the sum
/// of their squares within that; the largest comes back with them.
/// Exact dynamic programming, O(w·n²).
pub(crate) fn min_max_counts(
    w: usize,
    n: usize,
    r: &dyn Fn(usize, usize, usize) -> f64,
) -> (f64, Vec<u32>) {
    // Stage i covers ..j; stages 0..=i cover 0..j with at least one layer each.
    let search = |score: &dyn Fn(f64, f64) -> f64, limit: f64| -> (f64, Vec<u32>) {
        let mut best = vec![vec![f64::INFINITY; n + 1]; w];
        let mut from = vec![vec![usize::MAX; n + 1]; w];
        for j in 1..=n {
            let x = r(0, 0, j);
            if x <= limit {
                best[0][j] = score(0.0, x);
                from[0][j] = 0;
            }
        }
        for i in 1..w {
            for j in (i + 1)..=n {
                for a in i..j {
                    let prev = best[i - 1][a];
                    if from[i - 1][a] == usize::MAX {
                        continue;
                    }
                    let x = r(i, a, j);
                    if x > limit {
                        continue;
                    }
                    let s = score(prev, x);
                    if from[i][j] == usize::MAX || s < best[i][j] {
                        best[i][j] = s;
                        from[i][j] = a;
                    }
                }
            }
        }
        let mut counts = vec![0u32; w];
        let mut j = n;
        for i in (0..w).rev() {
            let a = from[i][j];
            counts[i] = (j - a) as u32;
            j = a;
        }
        (best[w - 1][n], counts)
    };
    let (worst, counts) = search(&|prev, x| prev.max(x), f64::INFINITY);
    if !worst.is_finite() {
        return (worst, counts);
    }
    // Allow for rounding in the ratios: the second pass must find the first's split.
    let (_, balanced) = search(&|prev, x| prev + x * x, worst * (1.0 + 1e-12));
    (worst, balanced)
}
