//! What each stage costs: weights from the tensor table, KV cache, compute buffers, and
//! the weight bytes a decoded token reads (the work a split balances).

use crate::spec::Plan;
use crate::spec::PlanConfig;
use crate::spec::StageBytes;
use crate::spec::StagePlan;
use crate::spec::WorkerSpec;
use omni_engine::model::Hparams;
use omni_engine::model::ModelFile;
use omni_engine::range::LayerRange;

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
        let mut b = self.slack + self.inputs(embed, has_layers, masks);
        if has_layers {
            b += self.layer;
        }
        if head {
            b += self.head;
        }
        b
    }

    /// A step's inputs: the token ids and their embedding rows, or the
    /// hidden state; with layers, positions, cells and masks.
    fn inputs(&self, embed: bool, has_layers: bool, masks: u64) -> u64 {
        let mut b = if embed {
            self.tokens_in + self.embed
        } else {
            self.hidden_in
        };
        if has_layers {
            b += self.layer_inputs + masks * self.mask;
        }
        b
    }

    /// What a stage on a GPU holds beyond [`ComputeEstimate::bytes`]: ggml's
    /// scheduler gives the device and the CPU a compute buffer each, and a
    /// tensor that crosses between them is in both. A step's inputs (token
    /// ids or hidden state, positions and cells, masks) are written in host
    /// memory and copied to the device; the embedding's rows come from host
    /// memory; the head's input crosses where the head's weights stay on
    /// the host (too large for the device to address: lavapipe's limit for
    /// Gemma 3's tied head). Each buffer has its own alignment slack, and
    /// the device's kernels keep a few more intermediates than the CPU's
    /// (an eighth of a layer's activations covers ggml-vulkan's: Gemma 3 on
    /// lavapipe reserved 29.5 MiB on the device where the CPU's layer
    /// activations and the copies add up to 26.5).
    pub fn device_copies(&self, embed: bool, has_layers: bool, masks: u64, head: bool) -> u64 {
        let mut b = self.slack + self.inputs(embed, has_layers, masks);
        if has_layers {
            b += self.layer / 8;
        }
        if head {
            b += self.hidden_in;
        }
        b
    }

    /// The estimate for `range` of a model with these hyper-parameters, on
    /// a GPU (`gpu`: with [`ComputeEstimate::device_copies`]) or the CPU.
    pub fn for_range(&self, hp: &Hparams, range: &LayerRange, gpu: bool) -> u64 {
        let swa = range.layers.clone().filter(|&il| hp.is_swa(il)).count() as u64;
        let global = range.layers.len() as u64 - swa;
        let masks = u64::from(swa > 0) + u64::from(global > 0);
        self.bytes_on(
            gpu,
            range.embed,
            !range.layers.is_empty(),
            masks,
            range.head,
        )
    }

    /// [`ComputeEstimate::bytes`], with [`ComputeEstimate::device_copies`]
    /// on a GPU.
    pub fn bytes_on(
        &self,
        gpu: bool,
        embed: bool,
        has_layers: bool,
        masks: u64,
        head: bool,
    ) -> u64 {
        let copies = if gpu {
            self.device_copies(embed, has_layers, masks, head)
        } else {
            0
        };
        self.bytes(embed, has_layers, masks, head) + copies
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

/// The compute-buffer estimate for one range (see [`ComputeEstimate`]) on
/// the CPU, or on a GPU (`gpu`: the device's buffer and the host's).
pub fn compute_estimate(hp: &Hparams, range: &LayerRange, cfg: &PlanConfig, gpu: bool) -> u64 {
    ComputeEstimate::new(hp, cfg.n_ctx, cfg.n_seq, cfg.n_ubatch).for_range(hp, range, gpu)
}

/// Everything the cost of a stage depends on, precomputed once per plan so
/// that the search costs O(1) per candidate range.
pub(crate) struct Costs<'a> {
    pub(crate) model: &'a ModelFile,
    pub(crate) cfg: &'a PlanConfig,
    pub(crate) est: ComputeEstimate,
    /// Per layer: bytes of its routed experts (0 for a dense layer), and
    /// what its stage still holds of them when they are offloaded
    /// (`gpu_experts` of `n_expert`).
    pub(crate) expert: Vec<u64>,
    pub(crate) kept: Vec<u64>,
    /// Whether ranges are sized with every MoE layer's experts offloaded.
    pub(crate) offload_all: bool,
    /// `layer_prefix[j]`: bytes of the tensors of layers `0..j` (less the
    /// offloaded experts with `offload_all`).
    pub(crate) layer_prefix: Vec<u64>,
    /// `swa_prefix[j]`: sliding-window layers among `0..j`.
    pub(crate) swa_prefix: Vec<u32>,
    /// `work_prefix[j]`: weight bytes a decoded token reads in layers `0..j`
    /// (see [`layer_work`]).
    pub(crate) work_prefix: Vec<u64>,
    pub(crate) embed_bytes: u64,
    pub(crate) head_bytes: u64,
    /// Embedding and head on one stage.
    pub(crate) both_bytes: u64,
    pub(crate) kv_per_layer: u64,
    /// Per worker: a GPU (`cuda...`), whose stage keeps the token embedding
    /// in host memory (a row lookup per token, as llama.cpp does), so it
    /// does not count against the GPU's memory; a head tied to the
    /// embedding has its own copy on the GPU, which does.
    pub(crate) gpu: Vec<bool>,
    /// Per worker: its measured read rate (bytes/s), when every worker has one.
    pub(crate) rate: Option<Vec<f64>>,
}

/// Whether a worker's device is a GPU (`cuda:N` or `vulkan:N`, or `cuda`
/// or `vulkan` in a dry run).
pub fn is_gpu(device: &str) -> bool {
    ["cuda", "vulkan"].iter().any(|b| {
        device
            .strip_prefix(b)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(':'))
    })
}

impl<'a> Costs<'a> {
    pub(crate) fn new(
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
    pub(crate) fn host_embed(&self, i: usize, embed: bool, head: bool) -> u64 {
        let tied = self.model.hparams.tied_embeddings;
        if self.gpu.get(i).copied().unwrap_or(false) && embed && !(head && tied) {
            self.embed_bytes
        } else {
            0
        }
    }

    /// What offloading layer `il`'s routed experts takes off its stage.
    pub(crate) fn saved(&self, il: u32) -> u64 {
        self.expert[il as usize] - self.kept[il as usize]
    }

    /// What streaming the `offloaded` layers' routed experts to a GPU for a
    /// prompt step needs there: the largest layer's (`None` with none).
    pub(crate) fn stream_need(&self, offloaded: &[u32]) -> Option<u64> {
        offloaded.iter().map(|&il| self.expert[il as usize]).max()
    }

    /// The MoE layers of `range`, when ranges are sized with their experts offloaded.
    pub(crate) fn offloaded_in(&self, range: &LayerRange) -> Vec<u32> {
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
    pub(crate) fn parts(&self, i: usize, w: usize, a: u32, b: u32) -> (u64, u64, u64) {
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
        let gpu = self.gpu.get(i).copied().unwrap_or(false);
        let compute = self.est.bytes_on(gpu, embed, b > a, masks, head);
        (weights, self.kv_per_layer * u64::from(b - a), compute)
    }

    /// Weight bytes a decoded token reads on stage `i` of `w` running
    /// layers `a..b`: the layers and, on the last, the head.
    pub(crate) fn work(&self, i: usize, w: usize, a: u32, b: u32) -> u64 {
        let head = if i + 1 == w { self.head_bytes } else { 0 };
        self.work_prefix[b as usize] - self.work_prefix[a as usize] + head
    }

    /// What the split balances for stage `i` of `w` running `a..b`: the
    /// seconds its weight reads take per decoded token at its worker's
    /// measured rate, or the bytes themselves when a rate is unknown (then
    /// the workers count as equally fast).
    pub(crate) fn time(&self, i: usize, w: usize, a: u32, b: u32) -> f64 {
        let bytes = self.work(i, w, a, b) as f64;
        match &self.rate {
            Some(rate) => bytes / rate[i],
            None => bytes,
        }
    }

    pub(crate) fn total(&self, i: usize, w: usize, a: u32, b: u32) -> u64 {
        let (x, y, z) = self.parts(i, w, a, b);
        x + y + z
    }

    /// The exact bytes of a final range whose `offloaded` layers' routed
    /// experts run elsewhere (weights straight from the tensor table). The
    /// compute estimate stays that of the whole layers: an upper bound still.
    pub(crate) fn stage_bytes(
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
        let compute = self.est.for_range(hp, range, is_gpu(&worker.device));
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

pub(crate) fn budget(free: u64, headroom: f64) -> u64 {
    (free as f64 * (1.0 - headroom)).floor() as u64
}

/// `total / budget`, infinite when nothing is offered.
pub(crate) fn ratio(total: u64, budget: u64) -> f64 {
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

/// Weight bytes one token of a decode step reads in layer `il`: its
/// tensors, of a MoE layer's routed experts only the `n_expert_used` of
/// `n_expert` a token selects, and none when they are offloaded (an expert
/// worker reads them). Decoding is bound by reading weights, so this is the
/// layer's share of a step's time on equal devices.
pub(crate) fn layer_work(model: &ModelFile, il: u32, offloaded: bool) -> u64 {
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

pub(crate) fn stage_work_bytes(
    model: &ModelFile,
    head_bytes: u64,
    stages: &[StagePlan],
) -> Vec<u64> {
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
