//! The engine's error type: every failure names the thing, the value and the limit.

use crate::gguf::GgufError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("model file is missing tensor '{name}', which {arch} requires")]
    MissingTensor { name: String, arch: &'static str },
    #[error(
        "tensor '{name}' has shape {found:?} but the model's hyper-parameters need {expected:?}"
    )]
    TensorShape {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    #[error("bad model metadata '{key}': {why}")]
    BadHparam { key: String, why: String },
    #[error("{0}")]
    Config(String),
    #[error("could not allocate {what} ({bytes} bytes)")]
    OutOfMemory { what: String, bytes: u64 },
    #[error("KV cache is full: the step needs {needed} cells but only {free} of {cells} are free")]
    KvFull {
        needed: usize,
        free: usize,
        cells: usize,
    },
    #[error("position {pos} is past the context length of {n_ctx} tokens")]
    ContextFull { pos: usize, n_ctx: usize },
    #[error("routed experts: {0}")]
    Experts(String),
    #[error("bad hidden state: {0}")]
    BadHidden(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// An invalid grammar or schema, or a constraint that failed.
    #[error("{0}")]
    Constraint(String),
    #[error(transparent)]
    Chat(#[from] crate::chat::ChatError),
    #[error(transparent)]
    Sampling(#[from] crate::sampling::SamplingError),
    #[error("ggml: {0}")]
    Ggml(String),
    /// No CPU backend could be loaded (libraries missing, a forced variant
    /// this CPU cannot run).
    #[error("CPU backend: {0}")]
    CpuBackend(String),
    /// A GPU was asked for and cannot be used (no CUDA backend in the build,
    /// no driver, no such GPU).
    #[error("GPU: {0}")]
    Gpu(String),
}
