//! Model description: architecture, hyper-parameters read from the GGUF,
//! and the tensors each architecture expects. One file per architecture
//! holds its hyper-parameter quirks, its tensor list and its layer graph.

mod deepseek2;
mod gemma3;
pub(crate) mod layers;
mod llama;
pub(crate) mod moe;
mod qwen2;
mod qwen3;
mod qwen3moe;

use std::path::Path;
use std::sync::Arc;

use crate::error::EngineError;
use crate::ffi::ggml::{RopeParams, ROPE_NEOX, ROPE_NORM};
use crate::gguf::{Gguf, Value};

/// Architectures this engine can run (the GGUF's `general.architecture`).
pub use crate::gguf::SUPPORTED_ARCHITECTURES;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Llama,
    Qwen2,
    Gemma3,
    Qwen3,
    Qwen3Moe,
    Deepseek2,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Deepseek2 => "deepseek2",
        }
    }

    fn from_name(name: &str) -> Option<Arch> {
        Some(match name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "gemma3" => Arch::Gemma3,
            "qwen3" => Arch::Qwen3,
            "qwen3moe" => Arch::Qwen3Moe,
            "deepseek2" => Arch::Deepseek2,
            _ => return None,
        })
    }

    /// The tensors of layer `il` this architecture reads, with their shapes.
    pub(crate) fn layer_tensors(self, hp: &Hparams, il: u32) -> Vec<TensorSpec> {
        match self {
            Arch::Llama => llama::layer_tensors(hp),
            Arch::Qwen2 => qwen2::layer_tensors(hp),
            Arch::Gemma3 => gemma3::layer_tensors(hp),
            Arch::Qwen3 => qwen3::layer_tensors(hp),
            Arch::Qwen3Moe => qwen3moe::layer_tensors(hp),
            Arch::Deepseek2 => deepseek2::layer_tensors(hp, il),
        }
    }

    pub(crate) fn build_layer<'g>(
        self,
        cx: &mut layers::LayerCx<'g, '_>,
        il: u32,
        x: crate::ffi::ggml::Tensor<'g>,
    ) -> crate::ffi::ggml::Tensor<'g> {
        match self {
            Arch::Llama => llama::build_layer(cx, il, x),
            Arch::Qwen2 => qwen2::build_layer(cx, il, x),
            Arch::Gemma3 => gemma3::build_layer(cx, il, x),
            Arch::Qwen3 => qwen3::build_layer(cx, il, x),
            Arch::Qwen3Moe => qwen3moe::build_layer(cx, il, x),
            Arch::Deepseek2 => deepseek2::build_layer(cx, il, x),
        }
    }
}

/// A block with routed experts, built up to them: the residual and the
/// normed input of the experts (`[n_embd, n_tokens]` each).
pub(crate) struct MoeInput<'g> {
    pub ffn_inp: crate::ffi::ggml::Tensor<'g>,
    pub cur: crate::ffi::ggml::Tensor<'g>,
}

impl Arch {
    /// The routed-expert weights of layer `il` (`ffn_*_exps`, read by
    /// `mul_mat_id`); empty for a layer without routed experts.
    pub(crate) fn expert_tensors(self, hp: &Hparams, il: u32) -> Vec<TensorSpec> {
        self.layer_tensors(hp, il)
            .into_iter()
            .filter(|s| s.op == WeightOp::MulMatId)
            .collect()
    }

    /// Whether layer `il` has shared experts (run next to the routed ones).
    pub(crate) fn has_shared_experts(self, hp: &Hparams, il: u32) -> bool {
        self == Arch::Deepseek2 && !self.expert_tensors(hp, il).is_empty()
    }

    /// Layer `il` (one with routed experts) up to its experts.
    pub(crate) fn build_moe_input<'g>(
        self,
        cx: &mut layers::LayerCx<'g, '_>,
        il: u32,
        x: crate::ffi::ggml::Tensor<'g>,
    ) -> MoeInput<'g> {
        match self {
            Arch::Qwen3Moe => qwen3moe::moe_input(cx, il, x),
            Arch::Deepseek2 => deepseek2::moe_input(cx, il, x),
            _ => unreachable!("{} has no routed experts", self.name()),
        }
    }

    /// The shared experts of layer `il` on its normed input `cur`.
    pub(crate) fn build_shared_experts<'g>(
        self,
        cx: &layers::LayerCx<'g, '_>,
        il: u32,
        cur: crate::ffi::ggml::Tensor<'g>,
    ) -> Option<crate::ffi::ggml::Tensor<'g>> {
        self.has_shared_experts(cx.hp, il)
            .then(|| deepseek2::shared_experts(cx, il, cur))
    }
}

/// A tensor an architecture expects: its GGUF name suffix (after `blk.N.`),
/// its shape in ggml order (`ne[0]` innermost), whether it must exist, and
/// the op that reads it (which decides whether it may be repacked).
#[derive(Clone, Debug)]
pub(crate) struct TensorSpec {
    pub name: &'static str,
    pub shape: Vec<u64>,
    pub required: bool,
    pub op: WeightOp,
}

/// The op a weight feeds, as llama.cpp's tensor table records it: only
/// matmul weights may live in the CPU's repacked layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WeightOp {
    /// Norm weights, biases: read element-wise.
    Other,
    /// `mul_mat(w, x)` with a 2-D `w`.
    MulMat,
    /// `mul_mat_id(w, x, ids)` with a 3-D `w`, one matrix per expert.
    MulMatId,
}

pub(crate) fn req(name: &'static str, shape: &[u32]) -> TensorSpec {
    TensorSpec {
        name,
        shape: shape.iter().map(|&d| d as u64).collect(),
        required: true,
        op: if shape.len() == 2 && name.ends_with(".weight") {
            WeightOp::MulMat
        } else {
            WeightOp::Other
        },
    }
}

/// A required 3-D expert weight (`ffn_*_exps`), read by `mul_mat_id`.
pub(crate) fn req_exps(name: &'static str, shape: &[u32; 3]) -> TensorSpec {
    TensorSpec {
        op: WeightOp::MulMatId,
        ..req(name, shape)
    }
}

pub(crate) fn opt(name: &'static str, shape: &[u32]) -> TensorSpec {
    TensorSpec {
        required: false,
        ..req(name, shape)
    }
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

/// A GGUF model opened and validated: the file (memory-mapped), its
/// architecture and hyper-parameters. Shared by every stage that runs a part of it.
pub struct ModelFile {
    pub gguf: Gguf,
    pub hparams: Hparams,
    pub path: std::path::PathBuf,
}

impl std::fmt::Debug for ModelFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelFile")
            .field("path", &self.path)
            .field("hparams", &self.hparams)
            .finish()
    }
}

impl ModelFile {
    /// Opens and validates `path`: GGUF structure, supported architecture,
    /// required keys, and the shape of every tensor the architecture uses.
    /// Nothing is computed and no weight is read.
    pub fn open(path: impl AsRef<Path>) -> Result<Arc<ModelFile>, EngineError> {
        let path = path.as_ref();
        Self::from_gguf(Gguf::open(path)?, path)
    }

    /// [`ModelFile::open`]'s checks on a GGUF already parsed (e.g. from
    /// memory with [`Gguf::from_bytes`]); `path` is only what it is called.
    pub fn from_gguf(gguf: Gguf, path: &Path) -> Result<Arc<ModelFile>, EngineError> {
        let arch_name = gguf
            .check_architecture(SUPPORTED_ARCHITECTURES)?
            .to_string();
        let arch = Arch::from_name(&arch_name).expect("checked against SUPPORTED_ARCHITECTURES");
        let hparams = read_hparams(&gguf, arch)?;
        let model = ModelFile {
            gguf,
            hparams,
            path: path.to_path_buf(),
        };
        model.validate_tensors()?;
        Ok(Arc::new(model))
    }

    /// The chat template: the file's `tokenizer.chat_template`, or for a
    /// file without one (base models), the family's template (gemma3) or ChatML.
    pub fn chat_template(&self) -> Result<crate::chat::ChatTemplate, EngineError> {
        let g = &self.gguf;
        let token_text = |key: &str| -> Result<String, EngineError> {
            let Some(id) = g.opt_u32(key)? else {
                return Ok(String::new());
            };
            let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
            Ok(tokens
                .get(id as usize)
                .map(|s| s.to_string())
                .unwrap_or_default())
        };
        let (bos, eos) = (
            token_text("tokenizer.ggml.bos_token_id")?,
            token_text("tokenizer.ggml.eos_token_id")?,
        );
        let source = match (g.opt_str("tokenizer.chat_template")?, self.hparams.arch) {
            (Some(t), _) => t,
            (None, Arch::Gemma3) => include_str!("../../templates/gemma3.jinja"),
            (None, _) => return Ok(crate::chat::ChatTemplate::chatml()),
        };
        Ok(crate::chat::ChatTemplate::new(source, &bos, &eos)?)
    }

    /// Non-layer tensors by role.
    pub(crate) fn global_tensors(&self) -> Vec<TensorSpec> {
        let hp = &self.hparams;
        let mut v = vec![
            req("token_embd.weight", &[hp.n_embd, hp.n_vocab]),
            req("output_norm.weight", &[hp.n_embd]),
        ];
        if !hp.tied_embeddings {
            v.push(req("output.weight", &[hp.n_embd, hp.n_vocab]));
        }
        v
    }

    fn validate_tensors(&self) -> Result<(), EngineError> {
        let hp = &self.hparams;
        let check = |name: &str, spec: &TensorSpec| -> Result<(), EngineError> {
            match self.gguf.tensor(name) {
                None if spec.required => Err(EngineError::MissingTensor {
                    name: name.to_string(),
                    arch: hp.arch.name(),
                }),
                None => Ok(()),
                Some(t) if t.dims != spec.shape => Err(EngineError::TensorShape {
                    name: name.to_string(),
                    expected: spec.shape.clone(),
                    found: t.dims.clone(),
                }),
                Some(_) => Ok(()),
            }
        };
        for spec in self.global_tensors() {
            check(spec.name, &spec)?;
        }
        for il in 0..hp.n_layer {
            for spec in &hp.arch.layer_tensors(hp, il) {
                check(&format!("blk.{il}.{}", spec.name), spec)?;
            }
        }
        Ok(())
    }

    /// Bytes of the weights a range needs, from the file's tensor table.
    pub fn range_weight_bytes(&self, range: &crate::stage::LayerRange) -> u64 {
        let mut total: u64 = self
            .gguf
            .tensors()
            .iter()
            .filter(|t| t.layer().is_some_and(|l| range.layers.contains(&l)))
            .map(|t| t.size)
            .sum();
        let global = |n: &str| self.gguf.tensor(n).map_or(0, |t| t.size);
        if range.embed {
            total += global("token_embd.weight");
        }
        if range.head {
            total += global("output_norm.weight");
            total += if self.hparams.tied_embeddings && !range.embed {
                global("token_embd.weight")
            } else {
                global("output.weight")
            };
        }
        total
    }

    /// Bytes of layer `il`'s routed-expert tensors (`ffn_{gate,up,down}_exps`,
    /// the `mul_mat_id` weights an expert worker can hold instead of the
    /// layer's stage), from the tensor table; 0 for a dense layer or a layer
    /// past the last.
    pub fn expert_weight_bytes(&self, il: u32) -> u64 {
        let hp = &self.hparams;
        if il >= hp.n_layer {
            return 0;
        }
        hp.arch
            .expert_tensors(hp, il)
            .iter()
            .filter_map(|s| self.gguf.tensor(&format!("blk.{il}.{}", s.name)))
            .map(|t| t.size)
            .sum()
    }

    /// The layers with routed experts, ascending (empty for a dense model).
    pub fn expert_layers(&self) -> Vec<u32> {
        let hp = &self.hparams;
        (0..hp.n_layer)
            .filter(|&il| !hp.arch.expert_tensors(hp, il).is_empty())
            .collect()
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

fn key(arch: Arch, k: &str) -> String {
    format!("{}.{k}", arch.name())
}

/// A per-layer count that GGUF may store as a scalar or as one value per layer.
fn uniform_u32(g: &Gguf, k: &str, n_layer: u32) -> Result<Option<u32>, EngineError> {
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

fn read_hparams(g: &Gguf, arch: Arch) -> Result<Hparams, EngineError> {
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
    let rope = RopeParams {
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
    };
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
    if nodes > crate::ffi::ggml::GRAPH_NODES {
        return Err(EngineError::BadHparam {
            key: k(if hp.moe.is_some() {
                "expert_used_count"
            } else {
                "block_count"
            }),
            why: format!(
                "one step of {n_layer} layers could need {nodes} graph nodes, more than the {} a ggml graph holds here",
                crate::ffi::ggml::GRAPH_NODES
            ),
        });
    }
    Ok(hp)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stage::LayerRange;

    /// A synthetic fixture from `../shared/fixtures` beside the checkout (or `OMNI_FIXTURES_DIR`).
    fn synthetic(file: &str) -> Arc<ModelFile> {
        let manifest = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let dir = match std::env::var_os("OMNI_FIXTURES_DIR") {
            Some(d) => std::path::PathBuf::from(d),
            None => [
                manifest.join("../../shared/fixtures"),
                manifest.join("../shared/fixtures"),
            ]
            .into_iter()
            .find(|d| d.join("README.md").exists())
            .expect("fixtures: ../shared/fixtures beside the checkout, or OMNI_FIXTURES_DIR"),
        };
        ModelFile::open(dir.join("synthetic").join(file)).unwrap()
    }

    /// A model parsed from memory is the model opened from its file, and is
    /// refused for the same reasons.
    #[test]
    fn from_gguf_in_memory_matches_open() {
        let opened = synthetic("tiny-qwen3moe-q4_k_m.gguf");
        let bytes = std::fs::read(&opened.path).unwrap();
        let g = Gguf::from_bytes(bytes.clone()).unwrap();
        let m = ModelFile::from_gguf(g, Path::new("in memory")).unwrap();
        assert_eq!(m.hparams, opened.hparams);
        assert_eq!(m.path, Path::new("in memory"));

        // Renamed so that the architecture is one nobody runs.
        let at = bytes.windows(8).position(|w| w == b"qwen3moe").unwrap();
        let mut other = bytes;
        other[at..at + 8].copy_from_slice(b"qwen9moe");
        let err = ModelFile::from_gguf(Gguf::from_bytes(other).unwrap(), Path::new("x"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("'qwen9moe' is not supported"), "{err}");
    }

    /// The error opening `file` with the u32 metadata values `patches` put in.
    fn open_patched(file: &str, patches: &[(&str, u32)]) -> String {
        let mut bytes = std::fs::read(&synthetic(file).path).unwrap();
        for (key, v) in patches {
            // The key's length, the key, the type (4: u32), then the value.
            let mut entry = (key.len() as u64).to_le_bytes().to_vec();
            entry.extend(key.as_bytes());
            entry.extend(4u32.to_le_bytes());
            let at = bytes.windows(entry.len()).position(|w| w == entry);
            let at = at.unwrap_or_else(|| panic!("{file} has no u32 {key}")) + entry.len();
            bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        let g = Gguf::from_bytes(bytes).unwrap();
        ModelFile::from_gguf(g, Path::new(file))
            .unwrap_err()
            .to_string()
    }

    /// Head counts and sizes whose products overflow a u32 are refused by
    /// name (they overflowed computing the tensor shapes; found by fuzzing).
    #[test]
    fn huge_head_sizes_are_refused() {
        let refused = |file: &str, patches: &[(&str, u32)], want: &str| {
            let err = open_patched(file, patches);
            assert!(err.contains(want), "{file} {patches:?}: {err}");
        };
        let (moe, mla, legacy) = (
            "tiny-qwen3moe-q4_k_m.gguf",
            "tiny-deepseek2-mla-q4_k_m.gguf",
            "tiny-deepseek2-legacy-q4_k_m.gguf",
        );
        refused(
            moe,
            &[
                ("qwen3moe.attention.key_length", 1 << 31),
                ("qwen3moe.attention.value_length", 1 << 31),
            ],
            "'qwen3moe.attention.key_length': 2147483648 is more than the 65536",
        );
        refused(
            moe,
            &[
                ("qwen3moe.attention.head_count", 1 << 30),
                ("qwen3moe.attention.head_count_kv", 1 << 30),
            ],
            "'qwen3moe.attention.head_count': 1073741824 is more than the 4096",
        );
        refused(
            mla,
            &[("deepseek2.attention.kv_lora_rank", u32::MAX)],
            "'deepseek2.attention.kv_lora_rank': 4294967295 is more than the 65536",
        );
        refused(
            legacy,
            &[("deepseek2.expert_shared_count", 1 << 30)],
            "'deepseek2.expert_shared_count': 1073741824 shared experts of width 128 overflow",
        );
    }

    /// Expert bytes are exactly the three `ffn_*_exps` tensors of each MoE
    /// layer; dense layers (deepseek2's leading one) and layers past the
    /// last have none.
    #[test]
    fn expert_bytes_are_the_exps_tensors_of_moe_layers() {
        for (file, want_layers) in [
            ("tiny-qwen3moe-f32.gguf", vec![0, 1, 2, 3]),
            ("tiny-qwen3moe-q4_k_m.gguf", vec![0, 1, 2, 3]),
            ("tiny-deepseek2-mla-f32.gguf", vec![1, 2, 3]),
            ("tiny-deepseek2-legacy-q8_0.gguf", vec![1, 2, 3]),
        ] {
            let m = synthetic(file);
            assert_eq!(m.expert_layers(), want_layers, "{file}");
            let n_expert = u64::from(m.hparams.moe.as_ref().unwrap().n_expert);
            for il in 0..m.hparams.n_layer {
                let exps: u64 = ["gate", "up", "down"]
                    .iter()
                    .filter_map(|p| m.gguf.tensor(&format!("blk.{il}.ffn_{p}_exps.weight")))
                    .map(|t| t.size)
                    .sum();
                let got = m.expert_weight_bytes(il);
                assert_eq!(got, exps, "{file} layer {il}");
                assert_eq!(got > 0, want_layers.contains(&il), "{file} layer {il}");
                assert_eq!(got % n_expert, 0, "{file}: every expert the same size");
                let layer = m.range_weight_bytes(&LayerRange {
                    embed: false,
                    layers: il..il + 1,
                    head: false,
                });
                assert!(
                    got < layer,
                    "{file} layer {il}: the layer holds more than its experts"
                );
            }
            assert_eq!(m.expert_weight_bytes(m.hparams.n_layer), 0);
        }
    }
}
