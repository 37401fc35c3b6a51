//! Everything that crosses into C lives here, behind safe types: ggml (graphs,
//! buffers, the CPU backend), which of ggml's per-CPU-level backends this
//! process loads (`cpu_variant`), and llama.cpp's vocabulary (tokenizer). The
//! rest of the engine is safe Rust. `llama_ref` runs llama.cpp itself, as a
//! reference.

pub mod cpu_variant;
pub mod device;
pub mod ggml;
pub mod llama_ref;
pub mod vocab;
