//! Qwen3 (`qwen3`, dense): llama-style blocks with per-head RMS norms on Q
//! and K before NEOX rope, no biases in practice. Reference: llama.cpp
//! `src/models/qwen3.cpp`. Its attention is shared with `qwen3moe`.

#[cfg(feature = "ggml")]
use super::layers::{Activation, LayerCx};
use super::{opt, req, Hparams, TensorSpec};
use crate::error::EngineError;
#[cfg(feature = "ggml")]
use crate::ffi::ggml::Tensor;

/// llama.cpp asserts head size == value size == rotary dimensions for the
/// Qwen3 family; a file that breaks it is refused here instead.
pub(crate) fn check_head_dims(hp: &Hparams) -> Result<(), EngineError> {
    let arch = hp.arch.name();
    if hp.head_dim_v != hp.head_dim_k {
        return Err(EngineError::BadHparam {
            key: format!("{arch}.attention.value_length"),
            why: format!(
                "{} must equal the key length {} for {arch}",
                hp.head_dim_v, hp.head_dim_k
            ),
        });
    }
    if hp.rope.n_dims as u32 != hp.head_dim_k {
        return Err(EngineError::BadHparam {
            key: format!("{arch}.rope.dimension_count"),
            why: format!(
                "{} must equal the head size {} for {arch}",
                hp.rope.n_dims, hp.head_dim_k
            ),
        });
    }
    Ok(())
}

pub(crate) fn adjust_hparams(hp: &mut Hparams) -> Result<(), EngineError> {
    check_head_dims(hp)
}

/// The attention tensors of a Qwen3 block (llama.cpp's `create_tensor_qkv`
/// accepts optional Q/K/V biases for every architecture, so do we).
pub(crate) fn attention_tensors(hp: &Hparams) -> Vec<TensorSpec> {
    let (e, q, kv) = (hp.n_embd, hp.head_dim_k * hp.n_head, hp.n_embd_k_gqa());
    vec![
        req("attn_norm.weight", &[e]),
        req("attn_q.weight", &[e, q]),
        req("attn_k.weight", &[e, kv]),
        req("attn_v.weight", &[e, hp.n_embd_v_gqa()]),
        opt("attn_q.bias", &[q]),
        opt("attn_k.bias", &[kv]),
        opt("attn_v.bias", &[hp.n_embd_v_gqa()]),
        req("attn_output.weight", &[q, e]),
        req("attn_k_norm.weight", &[hp.head_dim_k]),
        req("attn_q_norm.weight", &[hp.head_dim_k]),
        req("ffn_norm.weight", &[e]),
    ]
}

pub(crate) fn layer_tensors(hp: &Hparams) -> Vec<TensorSpec> {
    let mut v = attention_tensors(hp);
    v.extend([
        req("ffn_gate.weight", &[hp.n_embd, hp.n_ff]),
        req("ffn_down.weight", &[hp.n_ff, hp.n_embd]),
        req("ffn_up.weight", &[hp.n_embd, hp.n_ff]),
    ]);
    v
}

/// Norm, Q/K/V, per-head Q and K norms, rope, attention and the output
/// projection, then the residual: returns `ffn_inp` (rows already reduced
/// to the wanted outputs on the model's last layer).
#[cfg(feature = "ggml")]
pub(crate) fn attention_block<'g>(cx: &mut LayerCx<'g, '_>, il: u32, x: Tensor<'g>) -> Tensor<'g> {
    let h = cx.rms_norm(x, cx.w(il, "attn_norm.weight"));
    let (q, k, v) = cx.qkv(il, h);
    let q = cx.rms_norm(q, cx.w(il, "attn_q_norm.weight"));
    let q = cx.rope(il, q);
    let k = cx.rms_norm(k, cx.w(il, "attn_k_norm.weight"));
    let k = cx.rope(il, k);
    let attn = cx.attention(il, q, k, v, cx.hp.attn_scale);
    let attn = cx.linear(attn, cx.w(il, "attn_output.weight"), None);
    let [attn, x] = cx.select_outputs([attn, x]);
    cx.g.add(attn, x)
}

#[cfg(feature = "ggml")]
pub(crate) fn build_layer<'g>(cx: &mut LayerCx<'g, '_>, il: u32, x: Tensor<'g>) -> Tensor<'g> {
    let ffn_inp = attention_block(cx, il, x);
    let h = cx.rms_norm(ffn_inp, cx.w(il, "ffn_norm.weight"));
    let h = cx.ffn_gated(il, h, Activation::Silu);
    cx.g.add(h, ffn_inp)
}
