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

use std::fmt;

use omni_engine::kv::KvConfig;
use omni_engine::model::{Hparams, ModelFile};
use omni_engine::stage::LayerRange;
use serde::{Deserialize, Serialize};

mod pool;
use pool::Pools;

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
    /// Bytes per second a stage on this worker reads weights at in a decode
    /// step, as the worker measured it at start; 0 when unknown. Workers
    /// that take turns on the same compute report one figure.
    #[serde(default)]
    pub read_rate: u64,
    /// The memory this worker computes on, when other workers may compute
    /// on it too (workers registered from one host): those with the same
    /// pool share one budget, the largest of their offers, not the sum;
    /// `free_bytes` still caps this worker alone. `None` (a device of
    /// `omnictl plan --devices`): its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<MemoryPool>,
}

/// A memory several workers may compute on: a host's RAM, or one GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryPool {
    /// Equal keys are the same memory (the host's id with "ram", or with the GPU's UUID).
    pub key: String,
    /// How the plan names it: "host box1's RAM", "host box1's cuda:0".
    pub name: String,
}

/// Where the routed experts of MoE layers (`ffn_{gate,up,down}_exps`) run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ExpertPolicy {
    /// With their layers when the whole model fits the devices; otherwise
    /// each stage keeps, layer by layer, as many as fit and the rest go to
    /// the expert workers.
    #[default]
    Auto,
    /// Always with their layers; expert workers are not used.
    Device,
    /// Every MoE layer's routed experts on the expert workers.
    Cpu,
}

impl ExpertPolicy {
    pub fn name(self) -> &'static str {
        match self {
            ExpertPolicy::Auto => "auto",
            ExpertPolicy::Device => "device",
            ExpertPolicy::Cpu => "cpu",
        }
    }
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
    /// Where routed experts run (with expert workers to run them on).
    #[serde(default)]
    pub experts: ExpertPolicy,
    /// Routed experts of each offloaded layer that its stage holds as well
    /// (`K × expert bytes / n_expert` more on the device; capped at the
    /// layer's expert count). The expert workers still hold every expert.
    #[serde(default)]
    pub gpu_experts: u32,
}

impl Default for PlanConfig {
    /// The coordinator's defaults: 4096 tokens × 8 sequences, 512-token
    /// steps, 10% headroom, experts offloaded only when needed, none kept twice.
    fn default() -> Self {
        PlanConfig {
            n_ctx: 4096,
            n_seq: 8,
            n_ubatch: 512,
            headroom: 0.10,
            split: None,
            experts: ExpertPolicy::Auto,
            gpu_experts: 0,
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

/// What one stage (or expert worker) needs and what its worker offers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageBytes {
    /// Exact, from the GGUF tensor table: the tensors the stage holds (its
    /// layers less the routed experts of its offloaded layers, plus
    /// `gpu_experts` of them per offloaded layer).
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
    /// Layers of this stage whose routed experts run on an expert worker, ascending.
    #[serde(default)]
    pub offloaded: Vec<u32>,
}

/// The routed experts one expert worker runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertPlan {
    pub worker: String,
    /// "numa0", "cpu", ...
    pub device: String,
    /// Layers whose routed experts it holds, ascending.
    pub layers: Vec<u32>,
    /// `weights`: those layers' routed-expert tensors; `kv`: 0; `compute`:
    /// [`expert_compute_estimate`].
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
    /// Expert workers that hold offloaded experts, in the order given.
    #[serde(default)]
    pub experts: Vec<ExpertPlan>,
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
    #[error("{0}")]
    SharedDoesNotFit(Box<SharedNoFit>),
    #[error("{0}")]
    ExpertsDoNotFit(Box<ExpertNoFit>),
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
    /// What all stages together need, and what all workers offer after
    /// headroom (memory that workers share counted once).
    pub all_need: u64,
    pub all_budget: u64,
    /// Workers that share memory, "w0 and w1 share host box1's RAM"; empty if none.
    pub shared: String,
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
            if !self.shared.is_empty() {
                write!(f, " (memory they share counted once: {})", self.shared)?;
            }
        }
        write!(
            f,
            "; lower the context, sequences or micro-batch, or add memory or workers"
        )
    }
}

/// Stages that each fit their worker's own offer but not, together, the
/// memory those workers share (one host's RAM, one GPU).
#[derive(Clone, Debug, PartialEq)]
pub struct SharedNoFit {
    /// "host box1's RAM".
    pub memory: String,
    /// "w0 and w1".
    pub workers: String,
    /// The stages on it: index, range and total bytes.
    pub stages: Vec<(usize, LayerRange, u64)>,
    /// What those stages need together, in parts and in all.
    pub weights: u64,
    pub kv: u64,
    pub compute: u64,
    pub need: u64,
    /// The largest offer among the workers on it, and that after headroom.
    pub free: u64,
    pub budget: u64,
    pub headroom: f64,
    /// "the best automatic split (layers 12,12)" or "the manual split 12,12".
    pub split: String,
}

impl fmt::Display for SharedNoFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stages: Vec<String> = self
            .stages
            .iter()
            .map(|(i, r, b)| format!("stage {i} {} for {r}", fmt_bytes(*b)))
            .collect();
        write!(
            f,
            "model needs {} on {} together ({}; weights {}, KV {}, compute {}) in {}, but they share {}, which has {} free ({}% headroom: {} usable): each worker offers what that memory has free, so it is counted once, not once per worker; lower the context, sequences or micro-batch, or add workers with memory of their own (another host or GPU)",
            fmt_bytes(self.need),
            self.workers,
            stages.join(", "),
            fmt_bytes(self.weights),
            fmt_bytes(self.kv),
            fmt_bytes(self.compute),
            self.split,
            self.memory,
            fmt_bytes(self.free),
            pct(self.headroom),
            fmt_bytes(self.budget),
        )
    }
}

/// Offloaded experts that no expert worker has room for.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertNoFit {
    /// The first layer whose experts found no room, and their bytes.
    pub layer: u32,
    pub layer_bytes: u64,
    /// Every offloaded layer left without an expert worker.
    pub left: Vec<u32>,
    /// The last expert worker, what it holds (`layers`, `bytes.weights`) and offers.
    pub worker: String,
    pub device: String,
    pub layers: Vec<u32>,
    pub bytes: StageBytes,
    pub total_bytes: u64,
    pub headroom: f64,
    /// All offloaded experts, and what all expert workers offer for experts
    /// (budget less compute buffer; of memory shared with stages, what
    /// they leave).
    pub all_need: u64,
    pub all_budget: u64,
    /// "c0 shares host box1's RAM with w0 and w1, whose stages hold 1.2 GiB
    /// of it", when the last expert worker shares memory; empty if not.
    pub shared: String,
}

impl fmt::Display for ExpertNoFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.bytes;
        write!(
            f,
            "the routed experts of layer {} need {} but no expert worker has room for them: the last, {} ({}), has {} free ({} total, {}% headroom: {} usable, {} of it for its compute buffer) and holds ",
            self.layer,
            fmt_bytes(self.layer_bytes),
            self.worker,
            self.device,
            fmt_bytes(b.free),
            fmt_bytes(self.total_bytes),
            pct(self.headroom),
            fmt_bytes(b.budget),
            fmt_bytes(b.compute),
        )?;
        if self.layers.is_empty() {
            write!(f, "no experts")?;
        } else {
            write!(
                f,
                "{} of experts ({})",
                fmt_bytes(b.weights),
                layers_phrase(&self.layers)
            )?;
        }
        write!(
            f,
            "; the experts of {} are left without an expert worker; in all the offloaded experts need {} but the expert workers offer {} after headroom and compute buffers; add memory or expert workers, lower the micro-batch, or give the devices room to keep more experts",
            layers_phrase(&self.left),
            fmt_bytes(self.all_need),
            fmt_bytes(self.all_budget),
        )?;
        if !self.shared.is_empty() {
            write!(f, " ({})", self.shared)?;
        }
        Ok(())
    }
}

/// Layers as people read them: "3-5,7"; "none" for none.
pub fn fmt_layers(layers: &[u32]) -> String {
    if layers.is_empty() {
        return "none".into();
    }
    let mut runs: Vec<String> = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        runs.push(if j == i {
            layers[i].to_string()
        } else {
            format!("{}-{}", layers[i], layers[j])
        });
        i = j + 1;
    }
    runs.join(",")
}

/// "layer 3", "layers 3-5,7".
fn layers_phrase(layers: &[u32]) -> String {
    match layers {
        [one] => format!("layer {one}"),
        _ => format!("layers {}", fmt_layers(layers)),
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

/// An upper bound of the compute buffer an expert worker's `ExpertStage`
/// reserves: one step of `n = n_ubatch` tokens through one layer's routed
/// experts (it reserves for its widest layer; every layer's experts have
/// the same shapes). With 4-byte f32 activations (`e` = n_embd, `u` experts
/// used per token, `fx` = n_ff_exp), the sum of:
///
/// - inputs: the block's normed input (4en), the selected ids (i32) and
///   their weights (f32), 8nu;
/// - per used expert and token: gate, up and the activation (3·fx), the
///   down projection's output and its weighted copy (2·e), all counted as
///   alive at once: `4n·u·(3fx + 2e)` (ggml frees gate and up after the
///   activation, and the sum of the experts reuses freed blocks);
/// - 1 MiB for alignment and the small tensors ggml adds.
///
/// So `4n·(e + u·(3fx + 2e)) + 8nu + 1 MiB`; 0 for a model without
/// experts. The weights are the mapped expert tensors, counted apart.
/// Measured against real `ExpertStage`s (tests/plan.rs) it is 1.5× the
/// buffer of a DeepSeek-V3-shaped layer at 64 and 512 tokens, and looser
/// for the tiny synthetic files and one-token steps, where the 1 MiB dominates.
pub fn expert_compute_estimate(hp: &Hparams, n_ubatch: usize) -> u64 {
    let Some(m) = &hp.moe else {
        return 0;
    };
    let n = n_ubatch as u64;
    let (e, u, fx) = (
        u64::from(hp.n_embd),
        u64::from(m.n_expert_used),
        u64::from(m.n_ff_exp),
    );
    4 * n * (e + u * (3 * fx + 2 * e)) + 8 * n * u + (1 << 20)
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
    /// Per layer: bytes of its routed experts (0 for a dense layer), and
    /// what its stage still holds of them when they are offloaded
    /// (`gpu_experts` of `n_expert`).
    expert: Vec<u64>,
    kept: Vec<u64>,
    /// Whether ranges are sized with every MoE layer's experts offloaded.
    offload_all: bool,
    /// `layer_prefix[j]`: bytes of the tensors of layers `0..j` (less the
    /// offloaded experts with `offload_all`).
    layer_prefix: Vec<u64>,
    /// `swa_prefix[j]`: sliding-window layers among `0..j`.
    swa_prefix: Vec<u32>,
    /// `work_prefix[j]`: weight bytes a decoded token reads in layers `0..j`
    /// (see [`layer_work`]).
    work_prefix: Vec<u64>,
    embed_bytes: u64,
    head_bytes: u64,
    /// Embedding and head on one stage.
    both_bytes: u64,
    kv_per_layer: u64,
    /// Per worker: a GPU (`cuda...`), whose stage keeps the token embedding
    /// in host memory (a row lookup per token, as llama.cpp does), so it
    /// does not count against the GPU's memory; a head tied to the
    /// embedding has its own copy on the GPU, which does.
    gpu: Vec<bool>,
    /// Per worker: its measured read rate (bytes/s), when every worker has one.
    rate: Option<Vec<f64>>,
}

/// Whether a worker's device is a GPU (`cuda:N`, or `cuda` in a dry run).
pub fn is_gpu(device: &str) -> bool {
    device == "cuda" || device.starts_with("cuda:")
}

impl<'a> Costs<'a> {
    fn new(
        model: &'a ModelFile,
        cfg: &'a PlanConfig,
        offload_all: bool,
        workers: &[WorkerSpec],
    ) -> Costs<'a> {
        let hp = &model.hparams;
        let n = hp.n_layer;
        let range = |embed, layers, head| LayerRange {
            embed,
            layers,
            head,
        };
        let n_expert = hp.moe.as_ref().map_or(0, |m| u64::from(m.n_expert));
        let k = u64::from(cfg.gpu_experts).min(n_expert);
        let expert: Vec<u64> = (0..n).map(|il| model.expert_weight_bytes(il)).collect();
        // Every expert of a layer has the same shape, so K of them are K/n_expert of the bytes.
        let kept: Vec<u64> = expert
            .iter()
            .map(|&b| (b * k).checked_div(n_expert).unwrap_or(0))
            .collect();
        let mut layer_prefix = vec![0u64; n as usize + 1];
        let mut swa_prefix = vec![0u32; n as usize + 1];
        let mut work_prefix = vec![0u64; n as usize + 1];
        for il in 0..n {
            let i = il as usize;
            work_prefix[i + 1] = work_prefix[i] + layer_work(model, il, offload_all);
            let mut bytes = model.range_weight_bytes(&range(false, il..il + 1, false));
            if offload_all {
                bytes -= expert[i] - kept[i];
            }
            layer_prefix[i + 1] = layer_prefix[i] + bytes;
            swa_prefix[i + 1] = swa_prefix[i] + u32::from(hp.is_swa(il));
        }
        Costs {
            model,
            cfg,
            est: ComputeEstimate::new(hp, cfg.n_ctx, cfg.n_seq, cfg.n_ubatch),
            expert,
            kept,
            offload_all,
            layer_prefix,
            swa_prefix,
            work_prefix,
            embed_bytes: model.range_weight_bytes(&range(true, 0..0, false)),
            // The head alone: output norm and projection (the token embedding
            // again when they are tied, since this stage does not embed).
            head_bytes: model.range_weight_bytes(&range(false, n..n, true)),
            both_bytes: model.range_weight_bytes(&range(true, n..n, true)),
            kv_per_layer: cfg.kv().bytes(hp, 1),
            gpu: workers.iter().map(|w| is_gpu(&w.device)).collect(),
            rate: workers
                .iter()
                .all(|w| w.read_rate > 0)
                .then(|| workers.iter().map(|w| w.read_rate as f64).collect()),
        }
    }

    /// The token embedding's bytes a stage holds in host memory rather
    /// than its device's: all of them on a GPU that embeds, unless its head
    /// is tied to the embedding (then the GPU has the copy the head reads).
    fn host_embed(&self, i: usize, embed: bool, head: bool) -> u64 {
        let tied = self.model.hparams.tied_embeddings;
        if self.gpu.get(i).copied().unwrap_or(false) && embed && !(head && tied) {
            self.embed_bytes
        } else {
            0
        }
    }

    /// What offloading layer `il`'s routed experts takes off its stage.
    fn saved(&self, il: u32) -> u64 {
        self.expert[il as usize] - self.kept[il as usize]
    }

    /// The MoE layers of `range`, when ranges are sized with their experts offloaded.
    fn offloaded_in(&self, range: &LayerRange) -> Vec<u32> {
        if !self.offload_all {
            return Vec::new();
        }
        range
            .layers
            .clone()
            .filter(|&il| self.expert[il as usize] > 0)
            .collect()
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
        weights -= self.host_embed(i, embed, head);
        let swa = u64::from(self.swa_prefix[bu] - self.swa_prefix[au]);
        let global = u64::from(b - a) - swa;
        let masks = u64::from(swa > 0) + u64::from(global > 0);
        let compute = self.est.bytes(embed, b > a, masks, head);
        (weights, self.kv_per_layer * u64::from(b - a), compute)
    }

    /// Weight bytes a decoded token reads on stage `i` of `w` running
    /// layers `a..b`: the layers and, on the last, the head.
    fn work(&self, i: usize, w: usize, a: u32, b: u32) -> u64 {
        let head = if i + 1 == w { self.head_bytes } else { 0 };
        self.work_prefix[b as usize] - self.work_prefix[a as usize] + head
    }

    /// What the split balances for stage `i` of `w` running `a..b`: the
    /// seconds its weight reads take per decoded token at its worker's
    /// measured rate, or the bytes themselves when a rate is unknown (then
    /// the workers count as equally fast).
    fn time(&self, i: usize, w: usize, a: u32, b: u32) -> f64 {
        let bytes = self.work(i, w, a, b) as f64;
        match &self.rate {
            Some(rate) => bytes / rate[i],
            None => bytes,
        }
    }

    fn total(&self, i: usize, w: usize, a: u32, b: u32) -> u64 {
        let (x, y, z) = self.parts(i, w, a, b);
        x + y + z
    }

    /// The exact bytes of a final range whose `offloaded` layers' routed
    /// experts run elsewhere (weights straight from the tensor table). The
    /// compute estimate stays that of the whole layers: an upper bound still.
    fn stage_bytes(
        &self,
        i: usize,
        range: &LayerRange,
        worker: &WorkerSpec,
        offloaded: &[u32],
    ) -> StageBytes {
        let hp = &self.model.hparams;
        let weights = self.model.range_weight_bytes(range)
            - offloaded.iter().map(|&il| self.saved(il)).sum::<u64>()
            - self.host_embed(i, range.embed, range.head);
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
enum AutoSplit {
    /// Balanced by the work per token, within memory.
    Work,
    /// In proportion to the budgets.
    Proportional,
    /// Filling the workers most evenly (nothing else fit).
    Packed,
}

/// Which routed experts may leave their stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Offload {
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
struct Overflow {
    with_all: u64,
    with_first: u64,
    shared_left: Option<(String, String, u64)>,
}

fn build(
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
    let totals = |counts: &[u32]| -> Vec<u64> {
        let ranges = LayerRange::split(n_layer, counts).expect("counts add up");
        ranges
            .iter()
            .zip(workers)
            .enumerate()
            .map(|(i, (r, wk))| costs.stage_bytes(i, r, wk, &costs.offloaded_in(r)).total)
            .collect()
    };

    let (mut counts, how, mut auto) = choose_split(&costs, workers, cfg, mode, &budgets)?;
    // An automatic split made on each worker's own offer may put more on
    // workers that share memory than that memory holds: search again with
    // each of them given a part of it (in proportion to what it held, then
    // to its own offer), which moves layers to workers with memory of their own.
    let mut moved = false;
    if cfg.split.is_none() && pools.overflow(&totals(&counts)).is_some() {
        let held = totals(&counts);
        for weights in [&held, &budgets] {
            let shares = pools.shares(&budgets, weights);
            let (c, _, a) = choose_split(&costs, workers, cfg, mode, &shares)?;
            let t = totals(&c);
            let own = t.iter().zip(&budgets).all(|(t, b)| t <= b);
            if own && pools.overflow(&t).is_none() {
                (counts, auto, moved) = (c, a, true);
                break;
            }
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
            split: split_phrase(),
            all_need: stages.iter().map(|s| s.bytes.total).sum(),
            all_budget: pools.stage_offer(&budgets),
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

    // Each stage takes its layers' experts back, in layer order, while it
    // fits (its own budget, and what is left of memory it shares).
    let mut overflow: Vec<Option<Overflow>> = vec![None; stages.len()];
    let mut shared_used = pools.stage_use(&stage_totals);
    if mode == Offload::PutBack {
        for (i, (s, o)) in stages.iter_mut().zip(&mut overflow).enumerate() {
            let pool = pools.of_stage(i);
            let room = |s: &StagePlan, used: &[u64]| {
                let own = s.bytes.budget.saturating_sub(s.bytes.total);
                match pool {
                    Some(p) => own.min(pools.shared[p].budget.saturating_sub(used[p])),
                    None => own,
                }
            };
            let mut back = 0;
            for &il in &s.offloaded {
                if costs.saved(il) > room(s, &shared_used) {
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
    }

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

/// The layer counts per stage, how a manual split was given (`None` when
/// automatic) and how an automatic one was made, for stages that must fit
/// `budgets` (each worker's own, or its part of memory it shares).
fn choose_split(
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

/// Offloaded layers, in order, to the expert workers, each filled before
/// the next. One that shares memory with stages or other expert workers
/// gets at most what they left of it (`shared_used`: what the stages put
/// on each shared memory).
fn assign_experts(
    costs: &Costs<'_>,
    expert_workers: &[WorkerSpec],
    layers: &[u32],
    pools: &Pools,
    shared_used: &[u64],
) -> Result<Vec<ExpertPlan>, PlanError> {
    if layers.is_empty() {
        return Ok(Vec::new());
    }
    let cfg = costs.cfg;
    let compute = expert_compute_estimate(&costs.model.hparams, cfg.n_ubatch);
    let mut used = shared_used.to_vec();
    let mut plans = Vec::new();
    let mut next = 0;
    let mut last = None;
    let mut offered = 0u64;
    for (k, wk) in expert_workers.iter().enumerate() {
        let pool = pools.of_expert(k);
        let own = budget(wk.free_bytes, cfg.headroom);
        // What the others on its memory use before it.
        let others = pool.map_or(0, |p| used[p]);
        let budget = match pool {
            Some(p) => own.min(pools.shared[p].budget.saturating_sub(others)),
            None => own,
        };
        offered += budget.saturating_sub(compute);
        let (mut held, mut weights) = (Vec::new(), 0u64);
        while let Some(&il) = layers.get(next) {
            let b = costs.expert[il as usize];
            if compute + weights + b > budget {
                break;
            }
            held.push(il);
            weights += b;
            next += 1;
        }
        let bytes = StageBytes {
            weights,
            kv: 0,
            compute,
            total: weights + compute,
            budget,
            free: wk.free_bytes,
        };
        if !held.is_empty() {
            if let Some(p) = pool {
                used[p] += bytes.total;
            }
            plans.push(ExpertPlan {
                worker: wk.id.clone(),
                device: wk.device.clone(),
                layers: held.clone(),
                bytes: bytes.clone(),
            });
        }
        last = Some((k, wk, held, bytes, others));
        if next == layers.len() {
            return Ok(plans);
        }
    }
    let (k, wk, held, bytes, others) = last.expect("offloading needs expert workers");
    let shared = pools.of_expert(k).map_or(String::new(), |p| {
        format!(
            "{} shares {} with {}: they use {} of its {} usable, which leaves {} to {}",
            wk.id,
            pools.shared[p].name,
            pools.others(p, &wk.id),
            fmt_bytes(others),
            fmt_bytes(pools.shared[p].budget),
            fmt_bytes(bytes.budget),
            wk.id,
        )
    });
    let layer = layers[next];
    Err(PlanError::ExpertsDoNotFit(Box::new(ExpertNoFit {
        layer,
        layer_bytes: costs.expert[layer as usize],
        left: layers[next..].to_vec(),
        worker: wk.id.clone(),
        device: wk.device.clone(),
        layers: held,
        bytes,
        total_bytes: wk.total_bytes,
        headroom: cfg.headroom,
        all_need: layers.iter().map(|&il| costs.expert[il as usize]).sum(),
        all_budget: offered,
        shared,
    })))
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
    let costs = Costs::new(model, cfg, false, workers);
    let budgets: Vec<u64> = workers
        .iter()
        .map(|wk| budget(wk.free_bytes, cfg.headroom))
        .collect();
    auto_split(&costs, &budgets, model.hparams.n_layer)
}

fn auto_split(costs: &Costs<'_>, budgets: &[u64], n_layer: u32) -> Vec<u32> {
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
fn work_split(costs: &Costs<'_>, budgets: &[u64], n_layer: u32) -> Option<Vec<u32>> {
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
fn min_max_counts(w: usize, n: usize, r: &dyn Fn(usize, usize, usize) -> f64) -> (f64, Vec<u32>) {
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

/// Weight bytes one token of a decode step reads in layer `il`: its
/// tensors, of a MoE layer's routed experts only the `n_expert_used` of
/// `n_expert` a token selects, and none when they are offloaded (an expert
/// worker reads them). Decoding is bound by reading weights, so this is the
/// layer's share of a step's time on equal devices.
fn layer_work(model: &ModelFile, il: u32, offloaded: bool) -> u64 {
    let all = model.range_weight_bytes(&LayerRange {
        embed: false,
        layers: il..il + 1,
        head: false,
    });
    let experts = model.expert_weight_bytes(il);
    let selected = match model.hparams.moe.as_ref() {
        Some(m) if !offloaded && m.n_expert > 0 => {
            experts * u64::from(m.n_expert_used) / u64::from(m.n_expert)
        }
        _ => 0,
    };
    all - experts + selected
}

/// Each stage's weight reads per decoded token in `plan`: its layers' (see
/// [`layer_work`]) and, on the last stage, the output head's; the embedding
/// is a row lookup. The automatic split makes the largest of these as small
/// as memory allows.
pub fn work_per_token(model: &ModelFile, plan: &Plan) -> Vec<u64> {
    let head = model.range_weight_bytes(&LayerRange {
        embed: false,
        layers: model.hparams.n_layer..model.hparams.n_layer,
        head: true,
    });
    stage_work_bytes(model, head, &plan.stages)
}

fn stage_work_bytes(model: &ModelFile, head_bytes: u64, stages: &[StagePlan]) -> Vec<u64> {
    stages
        .iter()
        .map(|s| {
            let layers: u64 = (s.range.layers.clone())
                .map(|il| layer_work(model, il, s.offloaded.contains(&il)))
                .sum();
            layers + if s.range.head { head_bytes } else { 0 }
        })
        .collect()
}

fn work_note(model: &ModelFile, costs: &Costs<'_>, stages: &[StagePlan]) -> String {
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

fn notes(
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
fn cpu_beside_gpus_note(stages: &[StagePlan]) -> Option<String> {
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
fn expert_notes(
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
        let own: Vec<u32> = s
            .range
            .layers
            .clone()
            .filter(|&il| costs.expert[il as usize] > 0)
            .collect();
        if own.is_empty() {
            continue;
        }
        let kept: Vec<u32> = own
            .iter()
            .copied()
            .filter(|il| !s.offloaded.contains(il))
            .collect();
        let head = format!("experts: stage {i} ({})", s.worker);
        if s.offloaded.is_empty() {
            notes.push(format!(
                "{head}: keeps the routed experts of {}",
                layers_phrase(&kept)
            ));
            continue;
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
        notes.push(n);
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

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(
            f,
            "{} ({}, {} layers): context {} x {}, micro-batch {}, headroom {}%",
            self.model,
            self.arch,
            self.n_layer,
            c.n_ctx,
            omni_engine::count(c.n_seq as u64, "sequence"),
            c.n_ubatch,
            pct(c.headroom)
        )?;
        let offloading = self.stages.iter().any(|s| !s.offloaded.is_empty());
        let mut header = vec!["stage", "worker", "device", "layers"];
        if offloading {
            header.push("experts out");
        }
        header.extend(["weights", "KV", "compute", "total", "budget", "free", "use"]);
        let rows: Vec<Vec<String>> = self
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut r = vec![
                    i.to_string(),
                    s.worker.clone(),
                    s.device.clone(),
                    s.range.to_string(),
                ];
                if offloading {
                    r.push(if s.offloaded.is_empty() {
                        "-".into()
                    } else {
                        fmt_layers(&s.offloaded)
                    });
                }
                r.extend(byte_cells(&s.bytes, true));
                r
            })
            .collect();
        let text = if offloading { 1..=4 } else { 1..=3 };
        table(f, &header, &rows, text)?;
        if !self.experts.is_empty() {
            writeln!(f, "expert workers:")?;
            let header = [
                "worker", "device", "layers", "weights", "compute", "total", "budget", "free",
                "use",
            ];
            let rows: Vec<Vec<String>> = self
                .experts
                .iter()
                .map(|e| {
                    let mut r = vec![e.worker.clone(), e.device.clone(), fmt_layers(&e.layers)];
                    r.extend(byte_cells(&e.bytes, false));
                    r
                })
                .collect();
            table(f, &header, &rows, 0..=2)?;
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

/// weights, [KV,] compute, total, budget, free, use.
fn byte_cells(b: &StageBytes, kv: bool) -> Vec<String> {
    let mut r = vec![fmt_bytes(b.weights)];
    if kv {
        r.push(fmt_bytes(b.kv));
    }
    r.extend([
        fmt_bytes(b.compute),
        fmt_bytes(b.total),
        fmt_bytes(b.budget),
        fmt_bytes(b.free),
        format!("{:.0}%", ratio(b.total, b.budget) * 100.0),
    ]);
    r
}

/// Columns in `text` left-aligned, the numbers right-aligned.
fn table(
    f: &mut fmt::Formatter<'_>,
    header: &[&str],
    rows: &[Vec<String>],
    text: std::ops::RangeInclusive<usize>,
) -> fmt::Result {
    let mut width: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, cell) in width.iter_mut().zip(r) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |f: &mut fmt::Formatter<'_>, cells: &mut dyn Iterator<Item = &str>| {
        let mut s = String::new();
        for (k, (cell, &w)) in cells.zip(&width).enumerate() {
            if k > 0 {
                s.push_str("  ");
            }
            if text.contains(&k) {
                s.push_str(&format!("{cell:<w$}"));
            } else {
                s.push_str(&format!("{cell:>w$}"));
            }
        }
        writeln!(f, "{}", s.trim_end())
    };
    line(f, &mut header.iter().copied())?;
    for r in rows {
        line(f, &mut r.iter().map(String::as_str))?;
    }
    Ok(())
}
