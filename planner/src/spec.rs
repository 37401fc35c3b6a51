//! What the planner is given and what it gives back: workers, settings, the plan.

use omni_engine::kv::KvConfig;
use omni_engine::range::LayerRange;
use serde::Deserialize;
use serde::Serialize;

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
    pub(crate) fn kv(&self) -> KvConfig {
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
    /// On a GPU stage with offloaded layers: device memory kept for one
    /// layer's routed experts streamed from host memory for a prompt step
    /// (`omni-gpu-worker --stream-experts`), counted in `bytes.compute`;
    /// 0 when the stage does not stream (no room, the CPU, nothing offloaded).
    #[serde(default)]
    pub stream_bytes: u64,
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
