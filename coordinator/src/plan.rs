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

use std::fmt;

use omni_engine::kv::KvConfig;
use omni_engine::model::{Hparams, ModelFile};
use omni_engine::stage::LayerRange;
use serde::{Deserialize, Serialize};

/// Byte sizes as people type them ("6GiB", "512MiB", "2G", "1.5GiB") and as
/// we print them ("41.2 GiB"). They live in the engine so that every binary,
/// workers included, parses memory flags the same way.
pub use omni_engine::units::{fmt_bytes, parse_size};

/// A worker as the planner sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerSpec {
    pub id: String,
    /// "cpu", "cuda:0", ...
    pub device: String,
    /// Memory the worker offers for its stage.
    pub free_bytes: u64,
    pub total_bytes: u64,
}

/// How a plan is sized.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanConfig {
    /// Context length of one sequence.
    pub n_ctx: usize,
    /// Sequences resident at once (KV cells = `n_ctx × n_seq`).
    pub n_seq: usize,
    /// Most tokens in one step (sizes the compute buffer).
    pub n_ubatch: usize,
    /// Fraction of each worker's free memory left unplanned.
    pub headroom: f64,
    /// A manual split; `None` balances automatically.
    pub split: Option<Split>,
}

impl Default for PlanConfig {
    /// The coordinator's defaults: 4096 tokens × 8 sequences, 512-token steps, 10% headroom.
    fn default() -> Self {
        PlanConfig {
            n_ctx: 4096,
            n_seq: 8,
            n_ubatch: 512,
            headroom: 0.10,
            split: None,
        }
    }
}

impl PlanConfig {
    fn kv(&self) -> KvConfig {
        KvConfig {
            n_ctx: self.n_ctx,
            n_seq: self.n_seq,
        }
    }
}

/// A manual split, one entry per worker in order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Relative shares of the layers, like llama.cpp's `--tensor-split 3,1`.
    /// With cumulative fractions `c_i = (p_0 + … + p_i) / Σp`, layer `il`
    /// goes to the first stage `i` with `c_i > il / n_layer` (llama.cpp's
    /// `upper_bound` rule), so stage `i` gets layers
    /// `ceil(c_{i-1}·n_layer) .. ceil(c_i·n_layer)`: 3,1 over 24 layers is 18,6.
    Proportions(Vec<f64>),
    /// Exact layer counts per stage, adding up to the model's layer count.
    Layers(Vec<u32>),
}

/// What one stage needs and what its worker offers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageBytes {
    /// Exact, from the GGUF tensor table.
    pub weights: u64,
    /// Exact: F16 K and V for this stage's layers.
    pub kv: u64,
    /// Upper bound of the compute buffer for one `n_ubatch` step.
    pub compute: u64,
    /// `weights + kv + compute`.
    pub total: u64,
    /// `free × (1 − headroom)`.
    pub budget: u64,
    pub free: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StagePlan {
    pub worker: String,
    pub device: String,
    pub range: LayerRange,
    pub bytes: StageBytes,
}

/// Which worker runs which layers, and the arithmetic behind it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The model file.
    pub model: String,
    pub arch: String,
    pub n_layer: u32,
    pub config: PlanConfig,
    /// In pipeline order: the first runs the embedding, the last the head.
    pub stages: Vec<StagePlan>,
    /// Where the numbers come from.
    pub notes: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("no workers to plan for")]
    NoWorkers,
    #[error("{0}")]
    Config(String),
    #[error("{workers} workers but the model has only {n_layer} layers: every worker needs at least one layer")]
    TooManyWorkers { workers: usize, n_layer: u32 },
    #[error("bad split: {0}")]
    Split(String),
    #[error("{0}")]
    DoesNotFit(Box<NoFit>),
}

/// The stage that does not fit, with every number needed to see why.
#[derive(Clone, Debug, PartialEq)]
pub struct NoFit {
    pub stage: usize,
    pub worker: String,
    pub device: String,
    pub range: LayerRange,
    pub bytes: StageBytes,
    pub total_bytes: u64,
    pub headroom: f64,
    /// "the best automatic split" or "the manual split 12,12".
    pub split: String,
    /// What all stages together need, and what all workers offer after headroom.
    pub all_need: u64,
    pub all_budget: u64,
}

impl fmt::Display for NoFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.bytes;
        write!(
            f,
            "model needs {} on stage {} (worker {}, {}) but it has {} free ({} total, {}% headroom: {} usable): weights {}, KV {}, compute {}; stage {} runs {} in {}",
            fmt_bytes(b.total),
            self.stage,
            self.worker,
            self.device,
            fmt_bytes(b.free),
            fmt_bytes(self.total_bytes),
            pct(self.headroom),
            fmt_bytes(b.budget),
            fmt_bytes(b.weights),
            fmt_bytes(b.kv),
            fmt_bytes(b.compute),
            self.stage,
            self.range,
            self.split,
        )?;
        if self.all_need > self.all_budget {
            write!(
                f,
                "; in all the model needs {} but the workers offer {} after headroom",
                fmt_bytes(self.all_need),
                fmt_bytes(self.all_budget)
            )?;
        }
        write!(
            f,
            "; lower the context, sequences or micro-batch, or add memory or workers"
        )
    }
}

/// "10" for 0.10, "12.5" for 0.125.
fn pct(x: f64) -> String {
    let p = x * 100.0;
    if (p - p.round()).abs() < 1e-9 {
        format!("{}", p.round())
    } else {
        format!("{p:.1}")
    }
}

/// An upper bound of the compute buffer that `Stage::load` reserves with
/// ggml's graph allocator, computed from the hyper-parameters alone.
///
/// The engine reserves for its worst step: `n = min(n_ubatch, n_ctx·n_seq)`
/// tokens attending over all `k = n_ctx·n_seq` cells. With 4-byte f32
/// activations (`e` = n_embd, `q` = n_head·head_dim_k, `o` = n_head·head_dim_v,
/// `kv` = n_head_kv·head_dim_k, `f` = n_ff, `V` = n_vocab), the sum of:
///
/// - inputs, live for the whole step: the token ids (4n) or the previous
///   stage's hidden state (4en); with layers, positions (4n), KV cell
///   indices (8n) and an F16 `[k, n]` mask (2kn) per mask kind the range
///   uses (gemma3's sliding-window layers have their own);
/// - the embedding: the looked-up rows (4en);
/// - the widest layer, counting every activation of a block as alive at
///   once (ggml frees and reuses them, so the real peak is lower):
///   attention `4n·(3e + 3q + 3kv + o)` (input, norm, projection output;
///   Q and K also normed and roped, V, the attention output),
///   feed-forward `4n·(4e + 3f)` (input, norm, gate, up, activation, down),
///   or for a mixture of experts (`x` experts, `u` used, `fx` wide)
///   `4n·(4e + 3x + u·(3fx + 2e))` (router logits, probabilities and
///   selection; each used expert's gate, up, activation, output and
///   weighted copy) when that is larger; the larger of attention and FFN;
/// - the head: the final norm (4en) and the logits of all n tokens (4Vn);
/// - 1 MiB for alignment and the small tensors ggml adds.
///
/// Phases are added, not maxed: the masks stay live under every layer but
/// the last, and adding covers the allocator's fragmentation. Measured
/// against real stages of gemma3 270M and qwen2.5 0.5B (tests/plan.rs) the
/// estimate is 1.00–1.26× the real buffer once that is 16 MiB or more; it is
/// loosest (up to 1.8×) for one-layer ranges, whose FFN reuses the freed
/// mask, and for tiny steps, where the 1 MiB dominates.
/// ggml's per-step CPU work buffer (a few MiB, allocated by the backend) is
/// not part of the compute buffer and is left to the headroom.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ComputeEstimate {
    /// Tokens in the reserved step.
    pub n_tokens: u64,
    /// KV cells the reserved step attends over.
    pub n_kv: u64,
    pub tokens_in: u64,
    pub hidden_in: u64,
    /// Positions and KV cell indices.
    pub layer_inputs: u64,
    /// One F16 mask.
    pub mask: u64,
    pub embed: u64,
    pub layer: u64,
    pub head: u64,
    pub slack: u64,
}

impl ComputeEstimate {
    pub fn new(hp: &Hparams, n_ctx: usize, n_seq: usize, n_ubatch: usize) -> ComputeEstimate {
        let k = (n_ctx * n_seq) as u64;
        let n = (n_ubatch as u64).min(k);
        let (e, f, v) = (hp.n_embd as u64, hp.n_ff as u64, hp.n_vocab as u64);
        let q = (hp.n_head * hp.head_dim_k) as u64;
        let o = (hp.n_head * hp.head_dim_v) as u64;
        let kv = hp.n_embd_k_gqa().max(hp.n_embd_v_gqa()) as u64;
        let attn = 3 * e + 3 * q + 3 * kv + o;
        let mut ffn = 4 * e + 3 * f;
        if let Some(m) = &hp.moe {
            let (x, used, fx) = (m.n_expert as u64, m.n_expert_used as u64, m.n_ff_exp as u64);
            // Router logits, probabilities and selection; per used expert
            // its gate, up and activation, its output and weighted copy.
            ffn = ffn.max(4 * e + 3 * x + used * (3 * fx + 2 * e));
        }
        ComputeEstimate {
            n_tokens: n,
            n_kv: k,
            tokens_in: 4 * n,
            hidden_in: 4 * e * n,
            layer_inputs: 12 * n,
            mask: 2 * k * n,
            embed: 4 * e * n,
            layer: 4 * n * attn.max(ffn),
            head: 4 * n * (e + v),
            slack: 1 << 20,
        }
    }

    /// Bytes for a stage with these parts: `masks` is how many mask kinds
    /// its layers use (0 without layers; 2 for a range with both global and
    /// sliding-window layers).
    pub fn bytes(&self, embed: bool, has_layers: bool, masks: u64, head: bool) -> u64 {
        let mut b = self.slack;
        b += if embed {
            self.tokens_in + self.embed
        } else {
            self.hidden_in
        };
        if has_layers {
            b += self.layer_inputs + masks * self.mask + self.layer;
        }
        if head {
            b += self.head;
        }
        b
    }

    /// The estimate for `range` of a model with these hyper-parameters.
    pub fn for_range(&self, hp: &Hparams, range: &LayerRange) -> u64 {
        let swa = range.layers.clone().filter(|&il| hp.is_swa(il)).count() as u64;
        let global = range.layers.len() as u64 - swa;
        let masks = u64::from(swa > 0) + u64::from(global > 0);
        self.bytes(range.embed, !range.layers.is_empty(), masks, range.head)
    }
}

/// The compute-buffer estimate for one range (see [`ComputeEstimate`]).
pub fn compute_estimate(hp: &Hparams, range: &LayerRange, cfg: &PlanConfig) -> u64 {
    ComputeEstimate::new(hp, cfg.n_ctx, cfg.n_seq, cfg.n_ubatch).for_range(hp, range)
}

/// Everything the cost of a stage depends on, precomputed once per plan so
/// that the search costs O(1) per candidate range.
struct Costs<'a> {
    model: &'a ModelFile,
    cfg: &'a PlanConfig,
    est: ComputeEstimate,
    /// `layer_prefix[j]`: bytes of the tensors of layers `0..j`.
    layer_prefix: Vec<u64>,
    /// `swa_prefix[j]`: sliding-window layers among `0..j`.
    swa_prefix: Vec<u32>,
    embed_bytes: u64,
    head_bytes: u64,
    /// Embedding and head on one stage.
    both_bytes: u64,
    kv_per_layer: u64,
}

impl<'a> Costs<'a> {
    fn new(model: &'a ModelFile, cfg: &'a PlanConfig) -> Costs<'a> {
        let hp = &model.hparams;
        let n = hp.n_layer;
        let range = |embed, layers, head| LayerRange {
            embed,
            layers,
            head,
        };
        let mut layer_prefix = vec![0u64; n as usize + 1];
        let mut swa_prefix = vec![0u32; n as usize + 1];
        for il in 0..n {
            let i = il as usize;
            layer_prefix[i + 1] =
                layer_prefix[i] + model.range_weight_bytes(&range(false, il..il + 1, false));
            swa_prefix[i + 1] = swa_prefix[i] + u32::from(hp.is_swa(il));
        }
        Costs {
            model,
            cfg,
            est: ComputeEstimate::new(hp, cfg.n_ctx, cfg.n_seq, cfg.n_ubatch),
            layer_prefix,
            swa_prefix,
            embed_bytes: model.range_weight_bytes(&range(true, 0..0, false)),
            // The head alone: output norm and projection (the token embedding
            // again when they are tied, since this stage does not embed).
            head_bytes: model.range_weight_bytes(&range(false, n..n, true)),
            both_bytes: model.range_weight_bytes(&range(true, n..n, true)),
            kv_per_layer: cfg.kv().bytes(hp, 1),
        }
    }

    /// (weights, kv, compute) of `a..b` on stage `i` of `w`.
    fn parts(&self, i: usize, w: usize, a: u32, b: u32) -> (u64, u64, u64) {
        let (embed, head) = (i == 0, i + 1 == w);
        let (au, bu) = (a as usize, b as usize);
        let mut weights = self.layer_prefix[bu] - self.layer_prefix[au];
        // A single stage with tied embeddings holds token_embd.weight once.
        if embed && head {
            weights += self.both_bytes;
        } else {
            weights += if embed { self.embed_bytes } else { 0 };
            weights += if head { self.head_bytes } else { 0 };
        }
        let swa = u64::from(self.swa_prefix[bu] - self.swa_prefix[au]);
        let global = u64::from(b - a) - swa;
        let masks = u64::from(swa > 0) + u64::from(global > 0);
        let compute = self.est.bytes(embed, b > a, masks, head);
        (weights, self.kv_per_layer * u64::from(b - a), compute)
    }

    fn total(&self, i: usize, w: usize, a: u32, b: u32) -> u64 {
        let (x, y, z) = self.parts(i, w, a, b);
        x + y + z
    }

    /// The exact bytes of a final range (weights straight from the tensor table).
    fn stage_bytes(&self, range: &LayerRange, worker: &WorkerSpec) -> StageBytes {
        let hp = &self.model.hparams;
        let weights = self.model.range_weight_bytes(range);
        let kv = self.cfg.kv().bytes(hp, range.layers.len());
        let compute = self.est.for_range(hp, range);
        StageBytes {
            weights,
            kv,
            compute,
            total: weights + kv + compute,
            budget: budget(worker.free_bytes, self.cfg.headroom),
            free: worker.free_bytes,
        }
    }
}

fn budget(free: u64, headroom: f64) -> u64 {
    (free as f64 * (1.0 - headroom)).floor() as u64
}

/// `total / budget`, infinite when nothing is offered.
fn ratio(total: u64, budget: u64) -> f64 {
    if budget == 0 {
        if total == 0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        total as f64 / budget as f64
    }
}

/// Plans `model` over `workers` (in pipeline order).
pub fn plan(
    model: &ModelFile,
    workers: &[WorkerSpec],
    cfg: &PlanConfig,
) -> Result<Plan, PlanError> {
    let hp = &model.hparams;
    let n_layer = hp.n_layer;
    validate(hp, workers, cfg)?;
    let costs = Costs::new(model, cfg);
    let budgets: Vec<u64> = workers
        .iter()
        .map(|wk| budget(wk.free_bytes, cfg.headroom))
        .collect();

    let mut packed = false;
    let (counts, how) = match &cfg.split {
        None => {
            // Layers in proportion to each worker's budget (what a user of
            // llama.cpp's --tensor-split would pick by hand), unless that
            // does not fit: then the split that fills the workers most evenly.
            let shares: Vec<f64> = budgets.iter().map(|&b| b as f64).collect();
            let fits = |c: &[u32]| {
                let ranges = LayerRange::split(n_layer, c).expect("counts add up");
                ranges.iter().zip(workers).all(|(r, wk)| {
                    let b = costs.stage_bytes(r, wk);
                    b.total <= b.budget
                })
            };
            match proportions_to_counts(&shares, workers, n_layer) {
                Ok(c) if fits(&c) => (c, None),
                _ => {
                    packed = true;
                    (auto_split(&costs, &budgets, n_layer), None)
                }
            }
        }
        Some(Split::Layers(c)) => {
            check_counts(c, workers, n_layer, "--layers")?;
            (
                c.clone(),
                Some(format!("the manual split of layers {}", join(c))),
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
            )
        }
    };

    let ranges = LayerRange::split(n_layer, &counts).expect("counts add up to n_layer");
    let stages: Vec<StagePlan> = ranges
        .into_iter()
        .zip(workers)
        .map(|(range, wk)| StagePlan {
            worker: wk.id.clone(),
            device: wk.device.clone(),
            bytes: costs.stage_bytes(&range, wk),
            range,
        })
        .collect();

    // Fit check: the worst stage (by share of its budget) is the one named.
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
            split: how
                .unwrap_or_else(|| format!("the best automatic split (layers {})", join(&counts))),
            all_need: stages.iter().map(|s| s.bytes.total).sum(),
            all_budget: budgets.iter().sum(),
        })));
    }

    let notes = notes(model, cfg, &costs, &stages, &counts, packed);
    Ok(Plan {
        model: model.path.display().to_string(),
        arch: hp.arch.name().to_string(),
        n_layer,
        config: cfg.clone(),
        stages,
        notes,
    })
}

fn join(c: &[u32]) -> String {
    c.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

fn validate(hp: &Hparams, workers: &[WorkerSpec], cfg: &PlanConfig) -> Result<(), PlanError> {
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

fn check_counts(
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
    let costs = Costs::new(model, cfg);
    let budgets: Vec<u64> = workers
        .iter()
        .map(|wk| budget(wk.free_bytes, cfg.headroom))
        .collect();
    auto_split(&costs, &budgets, model.hparams.n_layer)
}

fn auto_split(costs: &Costs<'_>, budgets: &[u64], n_layer: u32) -> Vec<u32> {
    let w = budgets.len();
    let n = n_layer as usize;
    let r = |i: usize, a: usize, b: usize| ratio(costs.total(i, w, a as u32, b as u32), budgets[i]);
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
        return counts;
    }
    // Allow for rounding in the ratios: the second pass must find the first's split.
    let (_, balanced) = search(&|prev, x| prev + x * x, worst * (1.0 + 1e-12));
    balanced
}

fn notes(
    model: &ModelFile,
    cfg: &PlanConfig,
    costs: &Costs<'_>,
    stages: &[StagePlan],
    counts: &[u32],
    packed: bool,
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
    notes.push(match &cfg.split {
        None if stages.len() == 1 => format!("split: one worker runs the whole model{worst}"),
        None if packed => format!(
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
    notes
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(
            f,
            "{} ({}, {} layers): context {} x {} sequences, micro-batch {}, headroom {}%",
            self.model,
            self.arch,
            self.n_layer,
            c.n_ctx,
            c.n_seq,
            c.n_ubatch,
            pct(c.headroom)
        )?;
        let header = [
            "stage", "worker", "device", "layers", "weights", "KV", "compute", "total", "budget",
            "free", "use",
        ];
        let rows: Vec<[String; 11]> = self
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let b = &s.bytes;
                [
                    i.to_string(),
                    s.worker.clone(),
                    s.device.clone(),
                    s.range.to_string(),
                    fmt_bytes(b.weights),
                    fmt_bytes(b.kv),
                    fmt_bytes(b.compute),
                    fmt_bytes(b.total),
                    fmt_bytes(b.budget),
                    fmt_bytes(b.free),
                    format!("{:.0}%", ratio(b.total, b.budget) * 100.0),
                ]
            })
            .collect();
        let mut width = header.map(str::len);
        for r in &rows {
            for (w, cell) in width.iter_mut().zip(r) {
                *w = (*w).max(cell.len());
            }
        }
        // Text columns left-aligned, numbers right-aligned.
        let line = |f: &mut fmt::Formatter<'_>, cells: &[&str]| -> fmt::Result {
            let mut s = String::new();
            for (k, (cell, w)) in cells.iter().zip(width).enumerate() {
                if k > 0 {
                    s.push_str("  ");
                }
                if (1..=3).contains(&k) {
                    s.push_str(&format!("{cell:<w$}"));
                } else {
                    s.push_str(&format!("{cell:>w$}"));
                }
            }
            writeln!(f, "{}", s.trim_end())
        };
        line(f, &header)?;
        for r in &rows {
            line(f, &r.each_ref().map(String::as_str))?;
        }
        if !self.notes.is_empty() {
            writeln!(f, "notes:")?;
            for n in &self.notes {
                writeln!(f, "  - {n}")?;
            }
        }
        Ok(())
    }
}
