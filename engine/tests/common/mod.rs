//! Shared helpers for the engine's integration tests: where the fixtures
//! and the real model files are.
#![allow(dead_code)]

use std::path::PathBuf;

/// `../shared/fixtures` beside the checkout (or `OMNI_FIXTURES_DIR`).
pub fn fixtures_dir() -> PathBuf {
    if let Ok(d) = std::env::var("OMNI_FIXTURES_DIR") {
        return PathBuf::from(d);
    }
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    for cand in [
        manifest.join("../../shared/fixtures"),
        manifest.join("../shared/fixtures"),
    ] {
        if cand.join("README.md").exists() {
            return cand;
        }
    }
    panic!("fixtures not found: expected ../shared/fixtures beside the checkout, or set OMNI_FIXTURES_DIR")
}

pub fn models_dir() -> PathBuf {
    match std::env::var_os("OMNI_MODELS_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/omni/models")
        }
    }
}

/// A real model fetched by `omnictl fetch NAME`. Missing files are a test
/// failure with the command to run, never a silent skip.
pub fn model(file: &str) -> PathBuf {
    let p = models_dir().join(file);
    assert!(
        p.exists(),
        "{} is missing: run `cargo run --release -p omnictl -- fetch {}` first",
        p.display(),
        fetch_name(file)
    );
    p
}

fn fetch_name(file: &str) -> &'static str {
    if file.starts_with("gemma") {
        "gemma3-270m"
    } else {
        "qwen2.5-coder-0.5b"
    }
}

pub const GEMMA: &str = "gemma3-270m-q4_k_m.gguf";
pub const QWEN: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

pub fn json(name: &str) -> serde_json::Value {
    let p = fixtures_dir().join(name);
    serde_json::from_str(
        &std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
    )
    .unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}
