//! llama.cpp's own inference on a whole model (its `llama_decode`), used as
//! a reference: the vendored llama.cpp is built from the same source and
//! flags as our ggml, so our graphs must agree with it. Tests and
//! `omnictl` checks use it; the engine never computes with it.

use std::ffi::CString;
use std::path::Path;

use llama_cpp_sys_2 as sys;

/// Greedy-decodes `n_gen` tokens after `prompt` with llama.cpp (flash
/// attention on, F16 KV cache, `n_threads` threads) and returns, per step,
/// the chosen id and the full logits it was chosen from.
pub fn greedy(
    path: &Path,
    prompt: &[u32],
    n_gen: usize,
    n_threads: usize,
) -> Result<Vec<(u32, Vec<f32>)>, String> {
    // llama.cpp computes with the CPU backend this process loaded (it loads
    // none itself while one is registered).
    super::ggml::cpu()?;
    // A split model is loaded from its first part.
    let first = crate::gguf::split::first_part(path);
    let c_path =
        CString::new(first.as_os_str().as_encoded_bytes()).map_err(|_| "path has a NUL byte")?;
    let n_ctx = (prompt.len() + n_gen + 64).next_multiple_of(256) as u32;
    // SAFETY: llama.cpp's documented load / decode / free sequence; every
    // pointer is checked before use and freed on every path.
    unsafe {
        let model =
            sys::llama_model_load_from_file(c_path.as_ptr(), sys::llama_model_default_params());
        if model.is_null() {
            return Err(format!("llama.cpp could not load {}", path.display()));
        }
        let mut cp = sys::llama_context_default_params();
        cp.n_ctx = n_ctx;
        cp.n_batch = n_ctx.max(512);
        cp.n_ubatch = n_ctx.max(512);
        cp.n_threads = n_threads as i32;
        cp.n_threads_batch = n_threads as i32;
        cp.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_ENABLED;
        let ctx = sys::llama_init_from_model(model, cp);
        if ctx.is_null() {
            sys::llama_model_free(model);
            return Err("llama.cpp could not create a context".into());
        }
        let n_vocab = sys::llama_vocab_n_tokens(sys::llama_model_get_vocab(model)) as usize;
        let mut out = Vec::with_capacity(n_gen);
        let mut tokens: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
        let mut result = Ok(());
        for _ in 0..n_gen {
            let batch = sys::llama_batch_get_one(tokens.as_mut_ptr(), tokens.len() as i32);
            if sys::llama_decode(ctx, batch) != 0 {
                result = Err("llama_decode failed".to_string());
                break;
            }
            let logits =
                std::slice::from_raw_parts(sys::llama_get_logits_ith(ctx, -1), n_vocab).to_vec();
            let id = crate::sampling::greedy(&logits);
            out.push((id, logits));
            tokens = vec![id as i32];
        }
        sys::llama_free(ctx);
        sys::llama_model_free(model);
        result.map(|_| out)
    }
}
