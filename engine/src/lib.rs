//! omni's engine: the model math, with no networking and no async.
//!
//! - [`gguf`]: our own strict GGUF reader (memory-mapped, zero-copy tensor views).
//! - [`model`]: architectures (one file each), hyper-parameters from the file.
//! - [`stage`]: a layer range as the unit of execution, the hidden state between ranges.
//! - [`kv`]: the per-stage KV cache shared by many sequences.
//! - [`tokenizer`], [`chat`], [`sampling`]: text in, tokens, text out.
//! - [`generate`]: an in-process chain of stages for one-shot generation and tests.
//! - `ffi` (private): the only `unsafe` code, the door to ggml and llama.cpp's vocab.

pub mod chat;
pub mod error;
mod ffi;
pub mod generate;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod sampling;
pub mod stage;
pub mod tokenizer;

pub use error::EngineError;
pub use generate::{Engine, GenerateOptions, Generation};
pub use model::{Arch, Hparams, ModelFile, SUPPORTED_ARCHITECTURES};
pub use stage::{Batch, Hidden, HiddenDtype, LayerRange, Logits, Stage, StageConfig, StageOutput};
pub use tokenizer::{StreamDecoder, Tokenizer};

/// The CPU features the linked ggml uses on this machine (for `omnictl bench`).
pub fn cpu_features() -> Vec<&'static str> {
    ffi::ggml::cpu_features()
}
