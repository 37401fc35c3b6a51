//! omni's engine: the model math, with no networking and no async.
//!
//! - [`gguf`]: our own strict GGUF reader (memory-mapped, zero-copy tensor views).
//! - [`model`]: architectures (one file each), hyper-parameters from the file.
//! - [`range`]: a layer range, the part of a model one stage runs.
//! - [`stage`]: a layer range as the unit of execution, the hidden state between ranges.
//! - [`experts`]: routed experts apart from their layers ([`ExpertStage`], [`ExpertExec`]).
//! - [`kv`]: the per-stage KV cache shared by many sequences.
//! - [`tokenizer`], [`chat`], [`sampling`]: text in, tokens, text out.
//! - [`generate`]: an in-process chain of stages for one-shot generation and tests.
//! - `ffi` (private): the only `unsafe` code, the door to ggml and llama.cpp's vocab.

pub mod chat;
pub mod device;
pub mod error;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod notation;
pub mod prompt_cuts;
pub mod range;
pub mod sampling;
pub mod speculative;
pub mod synth;
pub mod tools;
pub mod units;

// The rest links ggml (the `ggml` feature, on by default): without it the crate is only
// the modules above (the file, its hyper-parameters and tensors, ranges, KV sizing,
// text), which the planner and the fuzz targets build without building llama.cpp.
#[cfg(feature = "ggml")]
pub mod constraint;
#[cfg(feature = "ggml")]
pub mod experts;
#[cfg(feature = "ggml")]
mod ffi;
#[cfg(feature = "ggml")]
pub mod generate;
#[cfg(feature = "ggml")]
pub mod stage;
#[cfg(feature = "ggml")]
pub mod tokenizer;

pub use device::{Device, GpuBackend};
pub use error::EngineError;
#[cfg(feature = "ggml")]
pub use experts::{ExpertBatch, ExpertConfig, ExpertExec, ExpertStage};
#[cfg(feature = "ggml")]
pub use ffi::device::GpuProps;
#[cfg(feature = "ggml")]
pub use generate::{Engine, GenerateOptions, Generation};
pub use kv::{KvConfig, KvLayer, KvLayers};
pub use model::{Arch, Hparams, ModelFile, SUPPORTED_ARCHITECTURES};
pub use notation::{count, fmt_layers, parse_layers};
pub use prompt_cuts::PromptCuts;
pub use range::LayerRange;
#[cfg(feature = "ggml")]
pub use stage::{
    Batch, Hidden, HiddenDtype, LocalExperts, Logits, Stage, StageConfig, StageOutput,
};
#[cfg(feature = "ggml")]
pub use tokenizer::{StreamDecoder, Tokenizer};
pub use units::{fmt_bytes, parse_rate, parse_size};

#[cfg(feature = "ggml")]
pub use ffi::cpu_variant::{Candidate as CpuVariant, CpuBackendInfo};

/// Whether this process computes Q4_K and Q6_K routed experts on the CPU
/// with omni's own kernel (AVX-512 VNNI; the weights used as the file maps
/// them) rather than ggml's `mul_mat_id` on repacked weights. The same
/// bits either way; off where the CPU lacks the instructions or
/// `OMNI_EXPERT_KERNEL=ggml`.
#[cfg(feature = "ggml")]
pub fn expert_kernel_on() -> bool {
    ffi::ggml::expert_kernel_available()
}

/// Loads (once per process) and describes the CPU backend. `request` forces
/// a variant (a service's `--cpu-variant`; else `OMNI_CPU_VARIANT`; else the
/// best this CPU runs, never one with AMX). Call it at start, before
/// anything computes, to fail early with the reason.
#[cfg(feature = "ggml")]
pub fn cpu_backend(request: Option<&str>) -> Result<&'static CpuBackendInfo, EngineError> {
    ffi::cpu_variant::load(request).map_err(EngineError::CpuBackend)
}

/// llama.cpp's own greedy decoding of a whole model (same vendored source
/// and build flags as our ggml), as a reference for tests and checks:
/// per step, the chosen id and the logits.
#[cfg(feature = "ggml")]
pub fn llama_cpp_greedy(
    path: &std::path::Path,
    prompt: &[u32],
    n_gen: usize,
    n_threads: usize,
) -> Result<Vec<(u32, Vec<f32>)>, EngineError> {
    ffi::llama_ref::greedy(path, prompt, n_gen, n_threads).map_err(EngineError::Ggml)
}

/// [`llama_cpp_greedy`] with llama.cpp's layers and experts placed as
/// `place` says (a GPU's share, `-ot exps=CPU`), to compare a split with
/// llama.cpp's own run of the same split.
#[cfg(feature = "ggml")]
pub fn llama_cpp_greedy_placed(
    path: &std::path::Path,
    prompt: &[u32],
    n_gen: usize,
    n_threads: usize,
    place: LlamaPlacement,
) -> Result<Vec<(u32, Vec<f32>)>, EngineError> {
    ffi::llama_ref::greedy_placed(path, prompt, n_gen, n_threads, place).map_err(EngineError::Ggml)
}

/// [`llama_cpp_greedy`] with the prompt decoded in `pieces` (lengths, one
/// `llama_decode` each; see [`PromptCuts::pieces`]).
#[cfg(feature = "ggml")]
pub fn llama_cpp_greedy_in_pieces(
    path: &std::path::Path,
    prompt: &[u32],
    pieces: &[usize],
    n_gen: usize,
    n_threads: usize,
) -> Result<Vec<(u32, Vec<f32>)>, EngineError> {
    let place = LlamaPlacement::default();
    ffi::llama_ref::greedy_in_pieces(path, prompt, pieces, n_gen, n_threads, place)
        .map_err(EngineError::Ggml)
}

#[cfg(feature = "ggml")]
pub use ffi::llama_ref::Placement as LlamaPlacement;

/// Type ids for [`ggml_matmul_check`].
pub use gguf::GgmlType;

/// A real matmul through our ggml build against a plain Rust reference:
/// returns `(ggml, reference)` outputs of `W x` with `W` stored as `ty`.
#[cfg(feature = "ggml")]
pub fn ggml_matmul_check(
    ty: GgmlType,
    w: &[f32],
    x: &[f32],
    rows: usize,
    k: usize,
    repack: bool,
) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
    ffi::ggml::matmul_check(ty.id(), w, x, rows, k, repack).map_err(EngineError::CpuBackend)
}
