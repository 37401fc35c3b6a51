//! Hyper-parameters: everything the graphs, the KV cache and the planner
//! need to know about a model, read from its GGUF keys and checked before
//! anything is built. No ggml here: the planner reads these without linking
//! llama.cpp.

use super::{deepseek2, gemma3, llama, qwen3, qwen3moe, Arch};
use crate::error::EngineError;
use crate::gguf::{Gguf, Value};

/// Rope modes (`GGML_ROPE_TYPE_*`).
pub const ROPE_NORM: i32 = 0;
pub const ROPE_NEOX: i32 = 2;

/// How many nodes one step's graph has room for (ggml's graphs are made
/// with this size in `ffi::ggml`); [`read_hparams`] refuses a file whose
/// step could need more.
pub const GRAPH_NODES: usize = 8192;

/// Rotary embedding parameters, as `ggml_rope_ext` takes them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    pub n_dims: i32,
    pub mode: i32,
    pub n_ctx_orig: i32,
    pub freq_base: f32,
    pub freq_scale: f32,
    pub ext_factor: f32,
    pub attn_factor: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

/// Sliding-window attention (gemma3's local layers).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SlidingWindow {
    pub window: u32,
    /// `is_swa[il]`: layer `il` attends only within the window.
    pub is_swa: Vec<bool>,
    pub rope_freq_base: f32,
    pub rope_freq_scale: f32,
}

/// How a mixture-of-experts FFN routes tokens (llama.cpp's `build_moe_ffn` options).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MoeHparams {
    /// Routed experts per layer (`{arch}.expert_count`).
    pub n_expert: u32,
    /// Experts each token uses (`{arch}.expert_used_count`).
    pub n_expert_used: u32,
    /// Hidden width of one expert (`{arch}.expert_feed_forward_length`).
    pub n_ff_exp: u32,
    pub gating: ExpertGating,
    /// Renormalise the selected experts' weights so they sum to 1.
    pub norm_weights: bool,
    /// Multiplier on the selected experts' weights (1: none).
    pub weights_scale: f32,
    /// Group-limited routing (DeepSeek V3): the experts form
    /// `n_expert_groups` equal groups, each scored by the sum of its two best
    /// selection scores, and only the `n_group_used` best groups' experts may
    /// be chosen. 0 or 1 groups: no limit.
    pub n_expert_groups: u32,
    pub n_group_used: u32,
}

/// The function that turns router logits into expert probabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ExpertGating {
    Softmax,
    Sigmoid,
}

/// Multi-head latent attention (DeepSeek V2/V3): queries through an optional
/// low-rank `q_a`/`q_b` pair, keys and values decompressed from one shared
/// `kv_lora_rank` latent plus a roped part common to all heads.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MlaHparams {
    /// Rank of the query compression (`attention.q_lora_rank`); 0: a plain `attn_q`.
    pub q_lora_rank: u32,
    /// Rank of the shared key/value latent (`attention.kv_lora_rank`).
    pub kv_lora_rank: u32,
    /// Per-head key width without rope, and the roped width (`rope.dimension_count`).
    pub n_embd_head_qk_nope: u32,
    pub n_embd_head_qk_rope: u32,
    /// Per-head value width once decompressed.
    pub n_embd_head_v: u32,
    /// The current layout (`attn_k_b`/`attn_v_b`, `*_mla` key lengths): the
    /// latent is cached and `attn_k_b` absorbed into the queries. Otherwise
    /// the legacy `attn_kv_b` layout, whose decompressed K and V are cached.
    pub absorbed: bool,
    /// Leading blocks with a dense FFN (`leading_dense_block_count`).
    pub n_layer_dense_lead: u32,
    /// Shared experts in every MoE block (`expert_shared_count`).
    pub n_expert_shared: u32,
}

/// Everything the graphs need to know about a model, all of it read from the file.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Hparams {
    pub arch: Arch,
    pub n_layer: u32,
    pub n_embd: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim_k: u32,
    pub head_dim_v: u32,
    pub n_ff: u32,
    pub n_vocab: u32,
    pub n_ctx_train: u32,
    pub rms_eps: f32,
    #[serde(skip)]
    pub rope: RopeParams,
    pub rope_freq_base: f32,
    pub swa: Option<SlidingWindow>,
    /// Multiplier applied to attention scores (usually 1/sqrt(head_dim)).
    pub attn_scale: f32,
    /// Multiplier on token embeddings (gemma: sqrt(n_embd)).
    pub embed_scale: Option<f32>,
    pub final_logit_softcap: Option<f32>,
    /// Output projection is the token embedding (no `output.weight`).
    pub tied_embeddings: bool,
    /// Routed experts, for architectures whose FFN is a mixture of experts.
    pub moe: Option<MoeHparams>,
    /// Multi-head latent attention (deepseek2).
    pub mla: Option<MlaHparams>,
}

impl Hparams {
    pub fn n_embd_k_gqa(&self) -> u32 {
        self.head_dim_k * self.n_head_kv
    }
    pub fn n_embd_v_gqa(&self) -> u32 {
        self.head_dim_v * self.n_head_kv
    }
    /// Width of the V row the KV cache keeps per token and layer: 0 for
    /// absorbed MLA, whose values are the first `kv_lora_rank` elements of
    /// the cached K row (as llama.cpp, which allocates no V cache for it).
    pub fn n_embd_v_cache(&self) -> u32 {
        match &self.mla {
            Some(m) if m.absorbed => 0,
            _ => self.n_embd_v_gqa(),
        }
    }
    /// Bytes one token takes in one layer's KV cache (F16 K and V).
    pub fn kv_bytes_per_token_layer(&self) -> u64 {
        2 * u64::from(self.n_embd_k_gqa() + self.n_embd_v_cache())
    }
    /// The rope parameters of layer `il` (local layers may use another base).
    pub fn rope_for_layer(&self, il: u32) -> RopeParams {
        match &self.swa {
            Some(swa) if swa.is_swa[il as usize] => RopeParams {
                freq_base: swa.rope_freq_base,
                freq_scale: swa.rope_freq_scale,
                ..self.rope
            },
            _ => self.rope,
        }
    }
    pub fn is_swa(&self, il: u32) -> bool {
        self.swa.as_ref().is_some_and(|s| s.is_swa[il as usize])
    }
}

/// The most attention heads, and the widest head, a file may declare. Tensor
/// widths are products of them in u32 (`n_head * head_dim`, deepseek2's
/// `n_head * (nope + v)`), which these bounds keep from overflowing; today's
/// models have at most 128 heads of 576.
pub(crate) const MAX_HEADS: u32 = 1 << 12;
pub(crate) const MAX_HEAD_DIM: u32 = 1 << 16;

/// `v`, if it is at most `max`; else a `BadHparam` naming `key`.
pub(crate) fn at_most(key: String, v: u32, max: u32) -> Result<u32, EngineError> {
    if v > max {
        return Err(EngineError::BadHparam {
            key,
            why: format!("{v} is more than the {max} this engine accepts"),
        });
    }
    Ok(v)
}

pub(crate) fn key(arch: Arch, k: &str) -> String {
    format!("{}.{k}", arch.name())
}

/// A per-layer count that GGUF may store as a scalar or as one value per layer.
pub(crate) fn uniform_u32(g: &Gguf, k: &str, n_layer: u32) -> Result<Option<u32>, EngineError> {
    match g.get(k) {
        None => Ok(None),
        Some(Value::Array(items)) => {
            let vals: Vec<u64> = items.iter().filter_map(Value::as_u64).collect();
            if vals.len() != n_layer as usize || vals.len() != items.len() {
                return Err(EngineError::BadHparam {
                    key: k.to_string(),
                    why: format!("expected {n_layer} integers"),
                });
            }
            if vals.iter().any(|&v| v != vals[0]) {
                return Err(EngineError::BadHparam {
                    key: k.to_string(),
                    why: "different values per layer are not supported yet".into(),
                });
            }
            Ok(Some(vals[0] as u32))
        }
        Some(_) => Ok(Some(g.get_u32(k)?)),
    }
}

pub(crate) fn read_hparams(g: &Gguf, arch: Arch) -> Result<Hparams, EngineError> {
    let k = |s: &str| key(arch, s);
    let n_layer = g.get_u32(&k("block_count"))?;
    let n_embd = g.get_u32(&k("embedding_length"))?;
    let n_head = uniform_u32(g, &k("attention.head_count"), n_layer)?.ok_or_else(|| {
        EngineError::Gguf(crate::gguf::GgufError::MissingKey {
            key: k("attention.head_count"),
        })
    })?;
    let n_head_kv = uniform_u32(g, &k("attention.head_count_kv"), n_layer)?.unwrap_or(n_head);
    // MoE files need no dense FFN width (llama.cpp reads it as optional).
    let n_ff = match uniform_u32(g, &k("feed_forward_length"), n_layer)? {
        Some(n) => n,
        None if matches!(arch, Arch::Qwen3Moe | Arch::Deepseek2) => 0,
        None => {
            return Err(EngineError::Gguf(crate::gguf::GgufError::MissingKey {
                key: k("feed_forward_length"),
            }))
        }
    };
    let positive = |key: String, v: u32| {
        if v == 0 {
            Err(EngineError::BadHparam {
                key,
                why: "must be positive".into(),
            })
        } else {
            Ok(v)
        }
    };
    positive(k("block_count"), n_layer)?;
    positive(k("embedding_length"), n_embd)?;
    positive(k("attention.head_count"), n_head)?;
    positive(k("attention.head_count_kv"), n_head_kv)?;
    if n_head % n_head_kv != 0 {
        return Err(EngineError::BadHparam {
            key: k("attention.head_count_kv"),
            why: format!("{n_head} query heads are not a multiple of {n_head_kv} KV heads"),
        });
    }
    let head_dim_k = g
        .opt_u32(&k("attention.key_length"))?
        .unwrap_or(n_embd / n_head);
    let head_dim_v = g
        .opt_u32(&k("attention.value_length"))?
        .unwrap_or(n_embd / n_head);
    positive(k("attention.key_length"), head_dim_k)?;
    positive(k("attention.value_length"), head_dim_v)?;
    for (name, v, max) in [
        ("attention.head_count", n_head, MAX_HEADS),
        ("attention.head_count_kv", n_head_kv, MAX_HEADS),
        ("attention.key_length", head_dim_k, MAX_HEAD_DIM),
        ("attention.value_length", head_dim_v, MAX_HEAD_DIM),
    ] {
        at_most(k(name), v, max)?;
    }
    let n_ctx_train = g.get_u32(&k("context_length"))?;
    let rms_eps = g.get_f32(&k("attention.layer_norm_rms_epsilon"))?;
    let n_rot = g.opt_u32(&k("rope.dimension_count"))?.unwrap_or(head_dim_k);
    let rope_freq_base = g.opt_f32(&k("rope.freq_base"))?.unwrap_or(10000.0);
    let rope = read_rope(g, arch, n_rot, rope_freq_base, n_ctx_train)?;
    let embd = g
        .tensor("token_embd.weight")
        .ok_or(EngineError::MissingTensor {
            name: "token_embd.weight".into(),
            arch: arch.name(),
        })?;
    let n_vocab = embd.dims.get(1).copied().unwrap_or(0) as u32;
    positive("token_embd.weight (vocabulary size)".into(), n_vocab)?;
    let mut hp = Hparams {
        arch,
        n_layer,
        n_embd,
        n_head,
        n_head_kv,
        head_dim_k,
        head_dim_v,
        n_ff,
        n_vocab,
        n_ctx_train,
        rms_eps,
        rope,
        rope_freq_base,
        swa: None,
        attn_scale: 1.0 / (head_dim_k as f32).sqrt(),
        embed_scale: None,
        final_logit_softcap: None,
        tied_embeddings: g.tensor("output.weight").is_none(),
        moe: None,
        mla: None,
    };
    match arch {
        Arch::Llama => llama::adjust_hparams(g, &mut hp)?,
        Arch::Qwen2 => {}
        Arch::Gemma3 => gemma3::adjust_hparams(g, &mut hp)?,
        Arch::Qwen3 => qwen3::adjust_hparams(&mut hp)?,
        Arch::Qwen3Moe => qwen3moe::adjust_hparams(g, &mut hp)?,
        Arch::Deepseek2 => deepseek2::adjust_hparams(g, &mut hp)?,
    }
    if n_rot > head_dim_k || n_rot % 2 != 0 {
        return Err(EngineError::BadHparam {
            key: k("rope.dimension_count"),
            why: format!("{n_rot} must be even and at most the head size {head_dim_k}"),
        });
    }
    let nodes = graph_nodes_bound(&hp);
    if nodes > GRAPH_NODES {
        return Err(EngineError::BadHparam {
            key: k(if hp.moe.is_some() {
                "expert_used_count"
            } else {
                "block_count"
            }),
            why: format!(
                "one step of {n_layer} layers could need {nodes} graph nodes, more than the {} a ggml graph holds here",
                GRAPH_NODES
            ),
        });
    }
    Ok(hp)
}

/// Rotary embedding settings: the rope mode of the architecture, the
/// frequency base and scaling (linear or YaRN, with the attention-factor
/// correction llama.cpp applies), from the `rope.*` keys.
fn read_rope(
    g: &Gguf,
    arch: Arch,
    n_rot: u32,
    rope_freq_base: f32,
    n_ctx_train: u32,
) -> Result<RopeParams, EngineError> {
    let k = |s: &str| key(arch, s);
    let scaling = g
        .opt_str(&k("rope.scaling.type"))?
        .unwrap_or("linear")
        .to_string();
    let factor = match g.opt_f32(&k("rope.scaling.factor"))? {
        Some(f) => Some(f),
        None => g.opt_f32(&k("rope.scale_linear"))?,
    };
    let mut freq_scale = match factor {
        Some(f) if f != 0.0 => 1.0 / f,
        _ => 1.0,
    };
    let n_ctx_orig = g
        .opt_u32(&k("rope.scaling.original_context_length"))?
        .unwrap_or(n_ctx_train);
    let (mut ext_factor, mut attn_factor) = (0.0f32, 1.0f32);
    match scaling.as_str() {
        "none" => freq_scale = 1.0,
        "linear" => {}
        "yarn" => {
            // The same attention-factor correction llama.cpp applies (llama-context.cpp).
            ext_factor = 1.0;
            let factor = 1.0 / freq_scale;
            let mscale = |scale: f32, m: f32| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let log_mul = g
                .opt_f32(&k("rope.scaling.yarn_log_multiplier"))?
                .unwrap_or(0.0);
            attn_factor = if log_mul != 0.0 {
                mscale(factor, 1.0) / mscale(factor, log_mul)
            } else {
                mscale(factor, 1.0)
            };
            attn_factor *= 1.0 / (1.0 + 0.1 * factor.ln());
        }
        other => {
            return Err(EngineError::BadHparam {
                key: k("rope.scaling.type"),
                why: format!("rope scaling '{other}' is not supported"),
            })
        }
    }
    let mode = match arch {
        Arch::Llama | Arch::Deepseek2 => ROPE_NORM,
        Arch::Qwen2 | Arch::Gemma3 | Arch::Qwen3 | Arch::Qwen3Moe => ROPE_NEOX,
    };
    Ok(RopeParams {
        n_dims: n_rot as i32,
        mode,
        n_ctx_orig: n_ctx_orig as i32,
        freq_base: rope_freq_base,
        freq_scale,
        ext_factor,
        attn_factor,
        beta_fast: g
            .opt_f32(&k("rope.scaling.yarn_beta_fast"))?
            .unwrap_or(32.0),
        beta_slow: g.opt_f32(&k("rope.scaling.yarn_beta_slow"))?.unwrap_or(1.0),
    })
}

/// An upper bound of the nodes in one step's graph of the whole model, so
/// that no file can overflow ggml's fixed-size graph (which aborts).
/// Measured: 33-39 nodes per dense layer (qwen2, gemma3, qwen3), and
/// 41 + 2 per used expert per MoE layer (the expert sum is a view and an
/// add per expert). deepseek2's latent attention, group-limited routing and
/// shared experts add up to 32 more per layer (measured: 287 nodes for the
/// MLA layout and 303 for the legacy one, 1 dense + 3 MoE layers, 4 used).
fn graph_nodes_bound(hp: &Hparams) -> usize {
    let moe = hp
        .moe
        .as_ref()
        .map_or(0, |m| 24 + 2 * m.n_expert_used as usize);
    let mla = if hp.mla.is_some() { 32 } else { 0 };
    32 + hp.n_layer as usize * (48 + moe + mla)
}

/// llama.cpp's `LLAMA_MAX_EXPERTS`: it refuses files with more.
const MAX_EXPERTS: u32 = 1024;

/// The expert keys every MoE architecture shares. Routing options that
/// differ per architecture (gating, normalisation, scale) start at the
/// plain defaults (softmax, no renormalisation, no scale) for the
/// architecture to adjust.
pub(crate) fn read_moe_hparams(
    g: &Gguf,
    arch: Arch,
    n_layer: u32,
    n_ff: u32,
) -> Result<MoeHparams, EngineError> {
    let k = |s: &str| key(arch, s);
    let bad = |key: String, why: String| EngineError::BadHparam { key, why };
    let n_expert = g.opt_u32(&k("expert_count"))?.unwrap_or(0);
    if n_expert == 0 || n_expert > MAX_EXPERTS {
        return Err(bad(
            k("expert_count"),
            format!(
                "{n_expert} experts; a {} file needs 1 to {MAX_EXPERTS}",
                arch.name()
            ),
        ));
    }
    let n_expert_used = uniform_u32(g, &k("expert_used_count"), n_layer)?.unwrap_or(0);
    if n_expert_used == 0 || n_expert_used > n_expert {
        return Err(bad(
            k("expert_used_count"),
            format!(
                "{n_expert_used} experts per token, but it must be 1 to the {n_expert} experts"
            ),
        ));
    }
    // As llama.cpp: without the key, the dense width shared by the used experts.
    let n_ff_exp = match uniform_u32(g, &k("expert_feed_forward_length"), n_layer)? {
        Some(n) => n,
        None => n_ff / n_expert_used,
    };
    if n_ff_exp == 0 {
        return Err(bad(
            k("expert_feed_forward_length"),
            "an expert's hidden width must be positive".into(),
        ));
    }
    // llama.cpp reads the groups for every architecture and asserts these.
    let n_expert_groups = g.opt_u32(&k("expert_group_count"))?.unwrap_or(0);
    let n_group_used = g.opt_u32(&k("expert_group_used_count"))?.unwrap_or(0);
    if n_expert_groups >= n_expert {
        return Err(bad(
            k("expert_group_count"),
            format!("{n_expert_groups} groups for {n_expert} experts: group-limited routing needs fewer groups than experts"),
        ));
    }
    if n_expert_groups > 1 {
        // Each group is scored by its two best experts (ggml asserts the top-2 fits).
        if n_expert % n_expert_groups != 0 || n_expert / n_expert_groups < 2 {
            return Err(bad(
                k("expert_group_count"),
                format!("group-limited routing needs {n_expert} experts split into groups of at least 2, not {n_expert_groups} groups"),
            ));
        }
        if n_group_used == 0 || n_group_used >= n_expert_groups {
            return Err(bad(
                k("expert_group_used_count"),
                format!("{n_group_used} groups used: group-limited routing over {n_expert_groups} groups needs 1 to {}", n_expert_groups - 1),
            ));
        }
    }
    Ok(MoeHparams {
        n_expert,
        n_expert_used,
        n_ff_exp,
        gating: ExpertGating::Softmax,
        norm_weights: false,
        weights_scale: 1.0,
        n_expert_groups,
        n_group_used,
    })
}
