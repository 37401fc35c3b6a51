//! Llama family (`llama`): RMSNorm, rotary (normal mode) attention with
//! grouped KV heads, SwiGLU FFN. Reference: llama.cpp `src/models/llama.cpp`.
//! Dense models only: a `llama` file with experts (Mixtral) is refused.

use super::{opt, Hparams, TensorSpec};
use crate::error::EngineError;
use crate::gguf::Gguf;

pub(crate) fn adjust_hparams(g: &Gguf, _hp: &mut Hparams) -> Result<(), EngineError> {
    if g.opt_u32("llama.expert_count")?.unwrap_or(0) > 0 {
        return Err(EngineError::BadHparam {
            key: "llama.expert_count".into(),
            why: "mixture-of-experts llama files (Mixtral) are not supported yet".into(),
        });
    }
    if g.tensor("rope_freqs.weight").is_some() {
        return Err(EngineError::BadHparam {
            key: "rope_freqs.weight".into(),
            why: "llama3-style rope frequency factors are not supported yet".into(),
        });
    }
    Ok(())
}

pub(crate) fn layer_tensors(hp: &Hparams) -> Vec<TensorSpec> {
    // The qwen2 tensor set (its biases are optional, and absent in most llama files).
    let mut v = super::qwen2::layer_tensors(hp);
    v.push(opt("attn_output.bias", &[hp.n_embd]));
    v
}

/// The block is qwen2's: the two differ only in rope mode and optional biases,
/// both of which come from the hyper-parameters and the tensor table.
#[cfg(feature = "ggml")]
pub(crate) use super::qwen2::build_layer;
