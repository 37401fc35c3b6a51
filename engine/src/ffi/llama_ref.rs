//! llama.cpp's own inference on a whole model (its `llama_decode`), used as
//! a reference: the vendored llama.cpp is built from the same source and
//! flags as our ggml, so our graphs must agree with it. Tests and
//! `omnictl` checks use it; the engine never computes with it.

use std::ffi::CString;
use std::path::Path;

use llama_cpp_sys_2 as sys;

/// Where llama.cpp computes a reference run, when a GPU backend is loaded
/// (without one everything is on the CPU whatever this says).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// llama.cpp's `--n-gpu-layers`: -1 every layer and the output, 0 none
    /// (and no GPU at all, as `--device none`: with one beside it llama.cpp
    /// still hands it work), `k` the last `k - 1` layers and the output.
    pub n_gpu_layers: i32,
    /// `-ot exps=CPU`: the routed experts (`ffn_*_exps`) stay in CPU memory
    /// (in the CPU's repacked layout where it has one) and are computed there.
    pub experts_on_cpu: bool,
    /// Ops on weights in CPU memory may run on the GPU for large batches
    /// (llama.cpp's default); off, they run where their weights are, as
    /// omni's stages run them.
    pub op_offload: bool,
}

impl Default for Placement {
    /// llama.cpp's defaults: everything on the GPU.
    fn default() -> Self {
        Placement {
            n_gpu_layers: -1,
            experts_on_cpu: false,
            op_offload: true,
        }
    }
}

/// Greedy-decodes `n_gen` tokens after `prompt` with llama.cpp (flash
/// attention on, F16 KV cache, `n_threads` threads) and returns, per step,
/// the chosen id and the full logits it was chosen from.
pub fn greedy(
    path: &Path,
    prompt: &[u32],
    n_gen: usize,
    n_threads: usize,
) -> Result<Vec<(u32, Vec<f32>)>, String> {
    greedy_placed(path, prompt, n_gen, n_threads, Placement::default())
}

/// [`greedy`] with the layers and experts placed as `place` says.
pub fn greedy_placed(
    path: &Path,
    prompt: &[u32],
    n_gen: usize,
    n_threads: usize,
    place: Placement,
) -> Result<Vec<(u32, Vec<f32>)>, String> {
    greedy_in_pieces(path, prompt, &[prompt.len()], n_gen, n_threads, place)
}

/// [`greedy_placed`] with the prompt decoded in `pieces` (their lengths, in
/// order; they add up to the prompt's), one `llama_decode` each.
pub fn greedy_in_pieces(
    path: &Path,
    prompt: &[u32],
    pieces: &[usize],
    n_gen: usize,
    n_threads: usize,
    place: Placement,
) -> Result<Vec<(u32, Vec<f32>)>, String> {
    if pieces.iter().sum::<usize>() != prompt.len() || pieces.contains(&0) {
        return Err(format!(
            "pieces {pieces:?} do not cut a prompt of {} tokens",
            prompt.len()
        ));
    }
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
        let mut mp = sys::llama_model_default_params();
        mp.n_gpu_layers = place.n_gpu_layers;
        // The pattern llama.cpp's `-ot exps=CPU` takes; the list ends with nulls.
        let overrides = [
            sys::llama_model_tensor_buft_override {
                pattern: c"_exps".as_ptr(),
                buft: sys::ggml_backend_cpu_buffer_type(),
            },
            sys::llama_model_tensor_buft_override {
                pattern: std::ptr::null(),
                buft: std::ptr::null_mut(),
            },
        ];
        if place.experts_on_cpu {
            mp.tensor_buft_overrides = overrides.as_ptr();
        }
        // An empty (null-terminated) device list: the CPU alone.
        let mut no_devices: [sys::ggml_backend_dev_t; 1] = [std::ptr::null_mut()];
        if place.n_gpu_layers == 0 {
            mp.devices = no_devices.as_mut_ptr();
        }
        let model = sys::llama_model_load_from_file(c_path.as_ptr(), mp);
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
        cp.op_offload = place.op_offload;
        let ctx = sys::llama_init_from_model(model, cp);
        if ctx.is_null() {
            sys::llama_model_free(model);
            return Err("llama.cpp could not create a context".into());
        }
        let n_vocab = sys::llama_vocab_n_tokens(sys::llama_model_get_vocab(model)) as usize;
        let mut out = Vec::with_capacity(n_gen);
        let mut tokens: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
        let mut result = Ok(());
        // The prompt in its pieces, then one token a step.
        let mut lens = pieces.to_vec();
        for _ in 0..n_gen {
            let mut at = 0;
            for &n in &lens {
                let batch = sys::llama_batch_get_one(tokens[at..].as_mut_ptr(), n as i32);
                if sys::llama_decode(ctx, batch) != 0 {
                    result = Err("llama_decode failed".to_string());
                    break;
                }
                at += n;
            }
            if result.is_err() {
                break;
            }
            let logits =
                std::slice::from_raw_parts(sys::llama_get_logits_ith(ctx, -1), n_vocab).to_vec();
            let id = crate::sampling::greedy(&logits);
            out.push((id, logits));
            tokens = vec![id as i32];
            lens = vec![1];
        }
        sys::llama_free(ctx);
        sys::llama_model_free(model);
        result.map(|_| out)
    }
}
