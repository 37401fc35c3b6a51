//! Gemma 3 (`gemma3`): pre- and post-norms around attention and FFN,
//! per-head Q/K RMS norms, GELU-tanh gated FFN, embeddings scaled by
//! sqrt(n_embd), and sliding-window (local) layers with their own rope base.
//! Reference: llama.cpp `src/models/gemma3.cpp`.

#[cfg(feature = "ggml")]
use super::layers::{Activation, LayerCx};
use super::{req, Hparams, SlidingWindow, TensorSpec};
use crate::error::EngineError;
#[cfg(feature = "ggml")]
use crate::ffi::ggml::Tensor;
use crate::gguf::{Gguf, Value};

pub(crate) fn adjust_hparams(g: &Gguf, hp: &mut Hparams) -> Result<(), EngineError> {
    hp.embed_scale = Some((hp.n_embd as f32).sqrt());
    // Gemma scales queries by 1/sqrt(query_pre_attn_scalar) = 1/sqrt(head_dim),
    // except the 27B (62 layers), which uses n_embd / n_head.
    hp.attn_scale = if hp.n_layer == 62 {
        1.0 / ((hp.n_embd / hp.n_head) as f32).sqrt()
    } else {
        1.0 / (hp.head_dim_k as f32).sqrt()
    };
    hp.final_logit_softcap = g
        .opt_f32("gemma3.final_logit_softcapping")?
        .filter(|&c| c != 0.0);
    let window = g.opt_u32("gemma3.attention.sliding_window")?.unwrap_or(0);
    if window > 0 {
        let is_swa = match g.get("gemma3.attention.sliding_window_pattern") {
            Some(Value::Array(items)) => {
                let flags: Vec<bool> = items
                    .iter()
                    .filter_map(|v| {
                        if let Value::Bool(b) = v {
                            Some(*b)
                        } else {
                            None
                        }
                    })
                    .collect();
                if flags.len() != hp.n_layer as usize {
                    return Err(EngineError::BadHparam {
                        key: "gemma3.attention.sliding_window_pattern".into(),
                        why: format!("expected {} booleans, found {}", hp.n_layer, items.len()),
                    });
                }
                flags
            }
            _ => {
                // Every 6th layer is global (llama.cpp's default pattern for gemma3).
                let n = g
                    .opt_u32("gemma3.attention.sliding_window_pattern")?
                    .unwrap_or(6);
                (0..hp.n_layer).map(|il| n == 0 || il % n < n - 1).collect()
            }
        };
        hp.swa = Some(SlidingWindow {
            window,
            is_swa,
            rope_freq_base: g.opt_f32("gemma3.rope.freq_base_swa")?.unwrap_or(10000.0),
            rope_freq_scale: 1.0,
        });
    }
    Ok(())
}

pub(crate) fn layer_tensors(hp: &Hparams) -> Vec<TensorSpec> {
    let (e, q) = (hp.n_embd, hp.head_dim_k * hp.n_head);
    vec![
        req("attn_norm.weight", &[e]),
        req("attn_q.weight", &[e, q]),
        req("attn_k.weight", &[e, hp.n_embd_k_gqa()]),
        req("attn_v.weight", &[e, hp.n_embd_v_gqa()]),
        req("attn_q_norm.weight", &[hp.head_dim_k]),
        req("attn_k_norm.weight", &[hp.head_dim_k]),
        req("attn_output.weight", &[q, e]),
        req("post_attention_norm.weight", &[e]),
        req("ffn_norm.weight", &[e]),
        req("ffn_gate.weight", &[e, hp.n_ff]),
        req("ffn_up.weight", &[e, hp.n_ff]),
        req("ffn_down.weight", &[hp.n_ff, e]),
        req("post_ffw_norm.weight", &[e]),
    ]
}

#[cfg(feature = "ggml")]
pub(crate) fn build_layer<'g>(cx: &mut LayerCx<'g, '_>, il: u32, x: Tensor<'g>) -> Tensor<'g> {
    let h = cx.rms_norm(x, cx.w(il, "attn_norm.weight"));
    let (q, k, v) = cx.qkv(il, h);
    let q = cx.rms_norm(q, cx.w(il, "attn_q_norm.weight"));
    let q = cx.rope(il, q);
    let k = cx.rms_norm(k, cx.w(il, "attn_k_norm.weight"));
    let k = cx.rope(il, k);
    let q = cx.g.scale(q, cx.hp.attn_scale);
    let attn = cx.attention(il, q, k, v, 1.0);
    let attn = cx.linear(attn, cx.w(il, "attn_output.weight"), None);
    let [attn, x] = cx.select_outputs([attn, x]);
    let attn = cx.rms_norm(attn, cx.w(il, "post_attention_norm.weight"));
    let sa_out = cx.g.add(attn, x);
    let h = cx.rms_norm(sa_out, cx.w(il, "ffn_norm.weight"));
    let h = cx.ffn_gated(il, h, Activation::GeluTanh);
    let h = cx.rms_norm(h, cx.w(il, "post_ffw_norm.weight"));
    cx.g.add(h, sa_out)
}
