//! Qwen2 / Qwen2.5 (`qwen2`): llama-style blocks with Q/K/V biases and
//! NEOX rope. Reference: llama.cpp `src/models/qwen2.cpp`.

#[cfg(feature = "ggml")]
use super::layers::{Activation, LayerCx};
use super::{opt, req, Hparams, TensorSpec};
#[cfg(feature = "ggml")]
use crate::ffi::ggml::Tensor;

pub(crate) fn layer_tensors(hp: &Hparams) -> Vec<TensorSpec> {
    let (e, q, kv) = (hp.n_embd, hp.head_dim_k * hp.n_head, hp.n_embd_k_gqa());
    vec![
        req("attn_norm.weight", &[e]),
        req("attn_q.weight", &[e, q]),
        req("attn_k.weight", &[e, kv]),
        req("attn_v.weight", &[e, hp.n_embd_v_gqa()]),
        opt("attn_q.bias", &[q]),
        opt("attn_k.bias", &[kv]),
        opt("attn_v.bias", &[hp.n_embd_v_gqa()]),
        req("attn_output.weight", &[hp.head_dim_v * hp.n_head, e]),
        req("ffn_norm.weight", &[e]),
        req("ffn_gate.weight", &[e, hp.n_ff]),
        req("ffn_up.weight", &[e, hp.n_ff]),
        req("ffn_down.weight", &[hp.n_ff, e]),
    ]
}

#[cfg(feature = "ggml")]
pub(crate) fn build_layer<'g>(cx: &mut LayerCx<'g, '_>, il: u32, x: Tensor<'g>) -> Tensor<'g> {
    let h = cx.rms_norm(x, cx.w(il, "attn_norm.weight"));
    let (q, k, v) = cx.qkv(il, h);
    let q = cx.rope(il, q);
    let k = cx.rope(il, k);
    let attn = cx.attention(il, q, k, v, cx.hp.attn_scale);
    let attn = cx.linear(
        attn,
        cx.w(il, "attn_output.weight"),
        cx.w_opt(il, "attn_output.bias"),
    );
    let [attn, x] = cx.select_outputs([attn, x]);
    let ffn_inp = cx.g.add(attn, x);
    let h = cx.rms_norm(ffn_inp, cx.w(il, "ffn_norm.weight"));
    let h = cx.ffn_gated(il, h, Activation::Silu);
    cx.g.add(h, ffn_inp)
}
