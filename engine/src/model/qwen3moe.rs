//! Qwen3-MoE (`qwen3moe`): Qwen3 attention and, in every block, routed
//! experts instead of the dense FFN: softmax over the router logits, top-k,
//! the selected weights renormalised to sum to 1 (llama.cpp's qwen3moe
//! graph always does; no GGUF key says so), SiLU-gated experts.
//! Reference: llama.cpp `src/models/qwen3moe.cpp`.

#[cfg(feature = "ggml")]
use super::layers::{Activation, LayerCx};
#[cfg(feature = "ggml")]
use super::MoeInput;
use super::{req, req_exps, Hparams, TensorSpec};
use crate::error::EngineError;
#[cfg(feature = "ggml")]
use crate::ffi::ggml::Tensor;
use crate::gguf::Gguf;

pub(crate) fn adjust_hparams(g: &Gguf, hp: &mut Hparams) -> Result<(), EngineError> {
    super::qwen3::check_head_dims(hp)?;
    let mut moe = super::hparams::read_moe_hparams(g, hp.arch, hp.n_layer, hp.n_ff)?;
    moe.norm_weights = true;
    hp.moe = Some(moe);
    Ok(())
}

pub(crate) fn layer_tensors(hp: &Hparams) -> Vec<TensorSpec> {
    let moe = hp
        .moe
        .as_ref()
        .expect("qwen3moe hyper-parameters have experts");
    let (e, f, n) = (hp.n_embd, moe.n_ff_exp, moe.n_expert);
    let mut v = super::qwen3::attention_tensors(hp);
    v.extend([
        req("ffn_gate_inp.weight", &[e, n]),
        req_exps("ffn_gate_exps.weight", &[e, f, n]),
        req_exps("ffn_down_exps.weight", &[f, e, n]),
        req_exps("ffn_up_exps.weight", &[e, f, n]),
    ]);
    v
}

#[cfg(feature = "ggml")]
pub(crate) fn build_layer<'g>(cx: &mut LayerCx<'g, '_>, il: u32, x: Tensor<'g>) -> Tensor<'g> {
    let inp = moe_input(cx, il, x);
    let moe = cx.hp.moe.as_ref().expect("validated at open");
    let w = cx.moe_weights(il);
    let routed = cx.moe_ffn(inp.cur, &w, moe, Activation::Silu);
    super::layers::finish_moe(cx.g, routed, None, inp.ffn_inp)
}

/// The block up to its routed experts: attention, residual, FFN norm.
#[cfg(feature = "ggml")]
pub(crate) fn moe_input<'g>(cx: &mut LayerCx<'g, '_>, il: u32, x: Tensor<'g>) -> MoeInput<'g> {
    let ffn_inp = super::qwen3::attention_block(cx, il, x);
    let cur = cx.rms_norm(ffn_inp, cx.w(il, "ffn_norm.weight"));
    MoeInput { ffn_inp, cur }
}
