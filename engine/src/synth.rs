//! Model files with a real model's shapes and random weights, for
//! benchmarks (`omnictl synth`): speed does not depend on the weights'
//! values, so an R1-shaped file measures what R1 would. Any number of
//! layers and experts; the tensor types follow llama.cpp's Q4_K_M rules
//! (`llama-quant.cpp`): matrices Q4_K, `output.weight` Q6_K, `ffn_down*` and
//! `attn_v` Q6_K on the layers `use_more_bits` picks, matrices whose rows
//! are not whole 256-wide blocks Q8_0, norms and the router F32.
//!
//! The weights are random bytes with each block's scale set so a row's
//! dot product with a unit-RMS input is about 1: activations stay finite
//! through every layer (the tokens are meaningless). The data is written a
//! few MiB at a time, so a file of any size needs no more memory than that.

use std::path::Path;

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::gguf::write::{write_streaming, TensorSpec};
use crate::gguf::{GgmlType, GgufError, Value};

/// Multi-head latent attention's shapes (DeepSeek-V2/V3, GLM-4.7-Flash).
#[derive(Clone, Copy, Debug)]
pub struct Mla {
    /// `None`: Q is one matrix (`attn_q`), no low-rank `attn_q_a`/`attn_q_b`.
    pub q_lora: Option<u64>,
    pub kv_lora: u64,
    pub qk_nope: u64,
    pub qk_rope: u64,
    pub v_head: u64,
}

/// YaRN context extension, as the GGUF's `rope.scaling.*` keys say.
#[derive(Clone, Copy, Debug)]
pub struct Yarn {
    pub factor: f32,
    pub original_ctx: u64,
    pub beta_fast: f32,
    pub beta_slow: f32,
    pub log_multiplier: f32,
}

/// A model's shapes, from its Hugging Face `config.json` (cited in `source`).
#[derive(Clone, Debug)]
pub struct Shape {
    /// What `omnictl synth` calls it.
    pub name: &'static str,
    /// Where the numbers come from.
    pub source: &'static str,
    /// The GGUF architecture llama.cpp converts it to.
    pub arch: &'static str,
    pub hidden: u64,
    pub n_layer: u64,
    /// Leading layers with a dense FFN instead of experts.
    pub n_dense: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    /// Per-head K and V width (not MLA).
    pub head_dim: u64,
    pub mla: Option<Mla>,
    pub n_expert: u64,
    pub n_used: u64,
    /// Group-limited routing: groups, and how many a token may use (0: none).
    pub n_group: u64,
    pub n_group_used: u64,
    pub n_shared: u64,
    pub expert_ff: u64,
    pub dense_ff: u64,
    pub vocab: u64,
    /// llama.cpp's `expert_gating_func`: 1 softmax, 2 sigmoid.
    pub gating: u32,
    pub weights_scale: f32,
    pub weights_norm: bool,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub ctx: u64,
    pub yarn: Option<Yarn>,
    /// Tokenizer pre-processing (`tokenizer.ggml.pre`).
    pub pre: &'static str,
}

/// The shapes `omnictl synth` knows.
pub fn shapes() -> Vec<Shape> {
    vec![
        Shape {
            name: "deepseek-r1",
            source: "https://huggingface.co/deepseek-ai/DeepSeek-R1/blob/main/config.json",
            arch: "deepseek2",
            hidden: 7168,
            n_layer: 61,
            n_dense: 3,
            n_head: 128,
            n_head_kv: 128,
            head_dim: 0,
            mla: Some(Mla {
                q_lora: Some(1536),
                kv_lora: 512,
                qk_nope: 128,
                qk_rope: 64,
                v_head: 128,
            }),
            n_expert: 256,
            n_used: 8,
            n_group: 8,
            n_group_used: 4,
            n_shared: 1,
            expert_ff: 2048,
            dense_ff: 18432,
            vocab: 129280,
            gating: 2,
            weights_scale: 2.5,
            weights_norm: true,
            rope_theta: 10000.0,
            rms_eps: 1e-6,
            ctx: 163840,
            yarn: Some(Yarn {
                factor: 40.0,
                original_ctx: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                // mscale_all_dim 1.0 → 0.1 × mscale_all_dim (convert_hf_to_gguf.py).
                log_multiplier: 0.1,
            }),
            pre: "deepseek-v3",
        },
        Shape {
            name: "qwen3-30b-a3b",
            source: "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json",
            arch: "qwen3moe",
            hidden: 2048,
            n_layer: 48,
            n_dense: 0,
            n_head: 32,
            n_head_kv: 4,
            head_dim: 128,
            mla: None,
            n_expert: 128,
            n_used: 8,
            n_group: 0,
            n_group_used: 0,
            n_shared: 0,
            expert_ff: 768,
            dense_ff: 6144,
            vocab: 151936,
            gating: 1,
            weights_scale: 1.0,
            weights_norm: true,
            rope_theta: 1_000_000.0,
            rms_eps: 1e-6,
            ctx: 40960,
            yarn: None,
            pre: "qwen2",
        },
        Shape {
            name: "glm-4.7-flash",
            // The config of the published weights, as transformers'
            // `Glm4MoeLiteConfig` and vLLM's test of it give it;
            // convert_hf_to_gguf.py writes it as deepseek2 (MLA), without
            // its one multi-token-prediction layer here.
            source: "https://huggingface.co/zai-org/GLM-4.7-Flash/blob/main/config.json",
            arch: "deepseek2",
            hidden: 2048,
            n_layer: 47,
            n_dense: 1,
            n_head: 20,
            n_head_kv: 20,
            head_dim: 0,
            mla: Some(Mla {
                q_lora: Some(768),
                kv_lora: 512,
                qk_nope: 192,
                qk_rope: 64,
                v_head: 256,
            }),
            n_expert: 64,
            n_used: 4,
            // n_group 1, topk_group 1: no group limit.
            n_group: 0,
            n_group_used: 0,
            n_shared: 1,
            expert_ff: 1536,
            dense_ff: 10240,
            vocab: 154880,
            // noaux_tc routing: sigmoid scores with a selection bias (the
            // GGUF has no gating key of its own; llama.cpp guesses it).
            gating: 2,
            weights_scale: 1.8,
            weights_norm: true,
            rope_theta: 1_000_000.0,
            rms_eps: 1e-5,
            ctx: 202752,
            yarn: None,
            pre: "glm4",
        },
    ]
}

/// A file's metadata and tensor table.
pub type Layout = (Vec<(String, Value)>, Vec<TensorSpec>);

/// What to write: a shape, and what to change of it.
#[derive(Clone, Debug)]
pub struct Synth {
    pub shape: Shape,
    /// Layers (the shape's leading dense ones first).
    pub layers: Option<u64>,
    /// Leading dense layers. Default: the model's count for the whole
    /// model; for fewer layers, the model's share of them (at least one if
    /// it has any, and at least one MoE layer).
    pub dense: Option<u64>,
    pub experts: Option<u64>,
    pub vocab: Option<u64>,
    pub seed: u64,
}

impl Synth {
    /// The shape with the changes applied, checked.
    pub fn resolved(&self) -> Result<Shape, String> {
        let mut s = self.shape.clone();
        if let Some(n) = self.layers {
            if n == 0 {
                return Err("--layers must be at least 1".into());
            }
            if n != s.n_layer && s.n_dense > 0 {
                let share = (n * s.n_dense + s.n_layer / 2) / s.n_layer;
                s.n_dense = share.max(1).min(n.saturating_sub(1));
            }
            s.n_layer = n;
        }
        if let Some(d) = self.dense {
            if d > s.n_layer {
                return Err(format!("--dense {d}: there are only {} layers", s.n_layer));
            }
            if d > 0 && s.arch != "deepseek2" {
                return Err(format!(
                    "--dense {d}: {} ({}) has no dense layers",
                    s.name, s.arch
                ));
            }
            s.n_dense = d;
        }
        if let Some(x) = self.experts {
            if x < s.n_used {
                return Err(format!(
                    "--experts {x}: {} uses {} experts per token, so it needs at least that many",
                    s.name, s.n_used
                ));
            }
            if s.n_group > 0 && x % s.n_group != 0 {
                return Err(format!(
                    "--experts {x}: {} routes within {} groups of experts, so the count must be a multiple of {}",
                    s.name, s.n_group, s.n_group
                ));
            }
            s.n_expert = x;
        }
        if let Some(v) = self.vocab {
            if v < MIN_VOCAB {
                return Err(format!(
                    "--vocab {v}: the vocabulary needs at least {MIN_VOCAB} tokens (2 special, 256 bytes, 1 merge)"
                ));
            }
            s.vocab = v;
        }
        Ok(s)
    }

    /// The file's metadata and tensor table.
    pub fn layout(&self) -> Result<Layout, String> {
        let s = self.resolved()?;
        Ok((metadata(&s), tensors(&s)))
    }

    /// Writes the file; `progress` gets the bytes written and the total.
    pub fn write(&self, path: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<(), String> {
        let (kvs, tensors) = self.layout()?;
        let seed = self.seed;
        write_streaming(
            path,
            &kvs,
            &tensors,
            &mut |t, at, buf| fill(t, at, buf, seed),
            progress,
        )
        .map_err(|e: GgufError| e.to_string())
    }
}

/// BOS, EOS, the 256 byte tokens and the one merge's result.
const MIN_VOCAB: u64 = 259;

fn metadata(s: &Shape) -> Vec<(String, Value)> {
    let a = s.arch;
    let mut kv: Vec<(String, Value)> = Vec::new();
    let mut put = |k: &str, v: Value| kv.push((k.to_string(), v));
    put("general.architecture", Value::String(a.into()));
    put("general.type", Value::String("model".into()));
    put(
        "general.name",
        Value::String(format!("{} (omnictl synth: random weights)", s.name)),
    );
    put("general.file_type", Value::U32(15)); // LLAMA_FTYPE_MOSTLY_Q4_K_M
    put("general.quantization_version", Value::U32(2));
    let k = |key: &str| format!("{a}.{key}");
    let u = |v: u64| Value::U32(v as u32);
    put(&k("block_count"), u(s.n_layer));
    put(&k("context_length"), u(s.ctx));
    put(&k("embedding_length"), u(s.hidden));
    put(&k("feed_forward_length"), u(s.dense_ff));
    put(&k("attention.head_count"), u(s.n_head));
    put(&k("rope.freq_base"), Value::F32(s.rope_theta));
    put(
        &k("attention.layer_norm_rms_epsilon"),
        Value::F32(s.rms_eps),
    );
    put(&k("expert_count"), u(s.n_expert));
    put(&k("expert_used_count"), u(s.n_used));
    put(&k("expert_feed_forward_length"), u(s.expert_ff));
    put(&k("vocab_size"), u(s.vocab));
    match s.mla {
        Some(m) => {
            // The current layout: the latent cached, K and V per head from it.
            put(&k("attention.head_count_kv"), u(1));
            put(&k("attention.kv_lora_rank"), u(m.kv_lora));
            if let Some(q) = m.q_lora {
                put(&k("attention.q_lora_rank"), u(q));
            }
            put(&k("attention.key_length"), u(m.kv_lora + m.qk_rope));
            put(&k("attention.value_length"), u(m.kv_lora));
            put(&k("attention.key_length_mla"), u(m.qk_nope + m.qk_rope));
            put(&k("attention.value_length_mla"), u(m.v_head));
            put(&k("rope.dimension_count"), u(m.qk_rope));
        }
        None => {
            put(&k("attention.head_count_kv"), u(s.n_head_kv));
            put(&k("attention.key_length"), u(s.head_dim));
            put(&k("attention.value_length"), u(s.head_dim));
        }
    }
    if s.arch == "deepseek2" {
        put(&k("leading_dense_block_count"), u(s.n_dense));
        put(&k("expert_shared_count"), u(s.n_shared));
        put(&k("expert_weights_scale"), Value::F32(s.weights_scale));
        put(&k("expert_weights_norm"), Value::Bool(s.weights_norm));
        put(&k("expert_gating_func"), Value::U32(s.gating));
        if s.n_group > 0 {
            put(&k("expert_group_count"), u(s.n_group));
            put(&k("expert_group_used_count"), u(s.n_group_used));
        }
    }
    if let Some(y) = s.yarn {
        put(&k("rope.scaling.type"), Value::String("yarn".into()));
        put(&k("rope.scaling.factor"), Value::F32(y.factor));
        put(
            &k("rope.scaling.original_context_length"),
            u(y.original_ctx),
        );
        put(&k("rope.scaling.yarn_beta_fast"), Value::F32(y.beta_fast));
        put(&k("rope.scaling.yarn_beta_slow"), Value::F32(y.beta_slow));
        put(
            &k("rope.scaling.yarn_log_multiplier"),
            Value::F32(y.log_multiplier),
        );
    }
    // A byte-level BPE vocabulary of the model's size: BOS and EOS, GPT-2's
    // 256 byte tokens (so any text tokenizes), one merge, and fillers.
    let mut tokens: Vec<Value> = vec![
        Value::String("<｜begin▁of▁sentence｜>".into()),
        Value::String("<｜end▁of▁sentence｜>".into()),
    ];
    tokens.extend((0..=255u8).map(|b| Value::String(byte_char(b).to_string())));
    tokens.push(Value::String(format!("{}t", byte_char(b' '))));
    let filler = s.vocab.saturating_sub(tokens.len() as u64);
    tokens.extend((0..filler).map(|i| Value::String(format!("<synth{i}>"))));
    let types: Vec<Value> = (0..tokens.len())
        .map(|i| Value::I32(if i < 2 { 3 } else { 1 }))
        .collect();
    put("tokenizer.ggml.model", Value::String("gpt2".into()));
    put("tokenizer.ggml.pre", Value::String(s.pre.into()));
    put("tokenizer.ggml.tokens", Value::Array(tokens));
    put("tokenizer.ggml.token_type", Value::Array(types));
    put(
        "tokenizer.ggml.merges",
        Value::Array(vec![Value::String(format!("{} t", byte_char(b' ')))]),
    );
    put("tokenizer.ggml.bos_token_id", Value::U32(0));
    put("tokenizer.ggml.eos_token_id", Value::U32(1));
    put("tokenizer.ggml.add_bos_token", Value::Bool(true));
    kv
}

/// GPT-2's printable stand-in for a byte (`bytes_to_unicode`).
fn byte_char(b: u8) -> char {
    match b {
        b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff => char::from(b),
        _ => {
            // The others, in order, from U+0100.
            let rank = (0..b)
                .filter(|&c| !matches!(c, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff))
                .count() as u32;
            char::from_u32(0x100 + rank).unwrap_or('?')
        }
    }
}

/// llama.cpp's `use_more_bits`: the layers Q4_K_M gives 6-bit `ffn_down`
/// and `attn_v` (the first and last eighth, and every third between).
fn use_more_bits(i: u64, n: u64) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64) % 3 == 2
}

fn tensors(s: &Shape) -> Vec<TensorSpec> {
    let (e, n) = (s.hidden, s.n_layer);
    let mut out = Vec::new();
    let mut t = |name: String, dims: &[u64], six: bool| {
        let ggml_type = if dims.len() == 1 || name.ends_with("ffn_gate_inp.weight") {
            GgmlType::F32
        } else if !dims[0].is_multiple_of(256) {
            GgmlType::Q8_0
        } else if six {
            GgmlType::Q6_K
        } else {
            GgmlType::Q4_K
        };
        out.push(TensorSpec {
            name,
            dims: dims.to_vec(),
            ggml_type,
        });
    };
    t("token_embd.weight".into(), &[e, s.vocab], false);
    t("output_norm.weight".into(), &[e], false);
    t("output.weight".into(), &[e, s.vocab], true);
    for il in 0..n {
        let more = use_more_bits(il, n);
        let mut l = |name: &str, dims: &[u64], six: bool| t(format!("blk.{il}.{name}"), dims, six);
        l("attn_norm.weight", &[e], false);
        match s.mla {
            Some(m) => {
                let qk = m.qk_nope + m.qk_rope;
                match m.q_lora {
                    Some(q) => {
                        l("attn_q_a.weight", &[e, q], false);
                        l("attn_q_a_norm.weight", &[q], false);
                        l("attn_q_b.weight", &[q, s.n_head * qk], false);
                    }
                    None => l("attn_q.weight", &[e, s.n_head * qk], false),
                }
                l("attn_kv_a_mqa.weight", &[e, m.kv_lora + m.qk_rope], false);
                l("attn_kv_a_norm.weight", &[m.kv_lora], false);
                l("attn_k_b.weight", &[m.qk_nope, m.kv_lora, s.n_head], false);
                l("attn_v_b.weight", &[m.kv_lora, m.v_head, s.n_head], false);
                l("attn_output.weight", &[s.n_head * m.v_head, e], false);
            }
            None => {
                let (q, kv) = (s.n_head * s.head_dim, s.n_head_kv * s.head_dim);
                l("attn_q.weight", &[e, q], false);
                l("attn_k.weight", &[e, kv], false);
                l("attn_v.weight", &[e, kv], more);
                l("attn_output.weight", &[q, e], false);
                l("attn_q_norm.weight", &[s.head_dim], false);
                l("attn_k_norm.weight", &[s.head_dim], false);
            }
        }
        l("ffn_norm.weight", &[e], false);
        if il < s.n_dense {
            l("ffn_gate.weight", &[e, s.dense_ff], false);
            l("ffn_up.weight", &[e, s.dense_ff], false);
            l("ffn_down.weight", &[s.dense_ff, e], more);
            continue;
        }
        let (x, f) = (s.n_expert, s.expert_ff);
        l("ffn_gate_inp.weight", &[e, x], false);
        if s.gating == 2 {
            l("exp_probs_b.bias", &[x], false);
        }
        l("ffn_gate_exps.weight", &[e, f, x], false);
        l("ffn_up_exps.weight", &[e, f, x], false);
        l("ffn_down_exps.weight", &[f, e, x], more);
        if s.n_shared > 0 {
            let fs = f * s.n_shared;
            l("ffn_gate_shexp.weight", &[e, fs], false);
            l("ffn_up_shexp.weight", &[e, fs], false);
            l("ffn_down_shexp.weight", &[fs, e], more);
        }
    }
    out
}

/// `buf` filled with `t`'s data from byte `at`: the same bytes however the
/// data is cut into pieces (the generator is seeked to `at`).
fn fill(t: &TensorSpec, at: u64, buf: &mut [u8], seed: u64) {
    let mut h = seed ^ 0x9e37_79b9_7f4a_7c15;
    for b in t.name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(h);
    rng.set_word_pos(u128::from(at / 4));
    rng.fill_bytes(buf);
    let ne0 = t.dims[0] as f32;
    // Unit-RMS input, row dot product about 1: weights of RMS 1/sqrt(ne0).
    let rms = 1.0 / ne0.sqrt();
    match t.ggml_type {
        GgmlType::F32 => {
            let name = t.name.as_str();
            for w in buf.chunks_exact_mut(4) {
                let v = if name.contains("norm") {
                    1.0
                } else if name.ends_with(".bias") {
                    0.0
                } else {
                    // Uniform in ±sqrt(3)·rms.
                    let r = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                    ((r >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 2.0 * 1.732 * rms
                };
                w.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::Q4_K => {
            // d·sc·q − dmin·m, sc and m 6-bit, q 4-bit: sc·q has RMS about
            // 220 about its mean 236, which dmin·m (mean 31.5·dmin) cancels.
            let d = rms / 220.0;
            for b in buf.chunks_exact_mut(144) {
                b[0..2].copy_from_slice(&f16_bits(d).to_le_bytes());
                b[2..4].copy_from_slice(&f16_bits(d * 7.5).to_le_bytes());
            }
        }
        GgmlType::Q6_K => {
            // d·sc·(q − 32), sc a random i8 (RMS 74), q 6-bit (RMS 18.5).
            let d = rms / (74.0 * 18.5);
            for b in buf.chunks_exact_mut(210) {
                b[208..210].copy_from_slice(&f16_bits(d).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            // d·q, q a random i8 (RMS 74).
            let d = rms / 74.0;
            for b in buf.chunks_exact_mut(34) {
                b[0..2].copy_from_slice(&f16_bits(d).to_le_bytes());
            }
        }
        // `tensors` makes no other type.
        _ => {}
    }
}

/// An IEEE half's bits for a small positive float (subnormals included;
/// rounded toward zero, which is all a random weight's scale needs).
fn f16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let exp = ((b >> 23) & 0xff) as i32 - 127;
    if exp >= 16 {
        return 0x7bff;
    }
    if exp >= -14 {
        (((exp + 15) as u16) << 10) | ((b & 0x7f_ffff) >> 13) as u16
    } else {
        (x * (1u32 << 24) as f32) as u16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_and_bytes() {
        assert_eq!(f16_bits(1.0), 0x3c00);
        assert_eq!(f16_bits(0.5), 0x3800);
        // 2^-24 is the smallest subnormal half.
        assert_eq!(f16_bits(2f32.powi(-24)), 1);
        assert_eq!(f16_bits(2f32.powi(-15)), 0x0200);
        assert_eq!(byte_char(b'A'), 'A');
        assert_eq!(byte_char(b' '), 'Ġ');
        assert_eq!(byte_char(b'\n'), 'Ċ');
        let all: std::collections::HashSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn q4_k_m_picks_six_bits_as_llama_cpp_does() {
        // 61 layers: the first 7, the last 8, and every third between.
        let six: Vec<u64> = (0..61).filter(|&i| use_more_bits(i, 61)).collect();
        assert_eq!(&six[..8], &[0, 1, 2, 3, 4, 5, 6, 9]);
        assert!(six.contains(&53) && six.contains(&60) && !six.contains(&52));
    }

    #[test]
    fn r1_has_r1s_size() {
        let shape = shapes()
            .into_iter()
            .find(|s| s.name == "deepseek-r1")
            .unwrap();
        let s = Synth {
            shape,
            layers: None,
            dense: None,
            experts: None,
            vocab: None,
            seed: 0,
        };
        let (_, t) = s.layout().unwrap();
        let bytes: u64 = t.iter().map(|t| t.size().unwrap()).sum();
        // The published Q4_K_M is 404 GB (377 GiB); ours differs a little
        // in which tensors get more bits.
        assert!(
            bytes > 370_000_000_000 && bytes < 420_000_000_000,
            "{bytes}"
        );
        let params: u64 = t.iter().map(|t| t.dims.iter().product::<u64>()).sum();
        assert!(
            params > 670_000_000_000 && params < 675_000_000_000,
            "{params}"
        );
    }
}
