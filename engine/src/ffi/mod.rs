//! Everything that crosses into C lives here, behind safe types: ggml (graphs,
//! buffers, the CPU backend) and llama.cpp's vocabulary (tokenizer). The rest
//! of the engine is safe Rust. `llama_ref` runs llama.cpp itself, as a reference.

pub mod ggml;
pub mod llama_ref;
pub mod vocab;
