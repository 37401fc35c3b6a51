//! Bad model files through the engine's front door (`ModelFile::open`,
//! `Engine::load`): each is a clear error naming the problem, never a panic,
//! and nothing is computed.

mod common;

use std::io::Write;

use omni_engine::{Engine, EngineError, ModelFile, StageConfig};

fn open_err(bytes: &[u8]) -> String {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(bytes).unwrap();
    f.flush().unwrap();
    let err = ModelFile::open(f.path()).unwrap_err();
    err.to_string()
}

#[test]
fn truncated_real_model_is_refused() {
    let full = std::fs::read(common::model(common::QWEN)).unwrap();
    // Cut inside the header, inside the tensor table, and inside the weights.
    for cut in [3, 100, 4_000_000, full.len() / 2, full.len() - 1] {
        let msg = open_err(&full[..cut]);
        assert!(
            msg.contains("truncated") || msg.contains("past the end") || msg.contains("cannot fit"),
            "cut at {cut}: {msg}"
        );
    }
}

#[test]
fn random_bytes_are_refused() {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for len in [0usize, 1, 4, 16, 1000, 100_000] {
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        let msg = open_err(&bytes);
        assert!(
            msg.contains("magic") || msg.contains("truncated"),
            "{len} random bytes: {msg}"
        );
    }
}

#[test]
fn deepseek3_2_is_refused_by_name_before_loading() {
    let path = common::fixtures_dir().join("synthetic/tiny-deepseek3_2-unsupported-f32.gguf");
    let err = Engine::load(&path, None, StageConfig::default())
        .err()
        .expect("must be refused");
    assert!(matches!(err, EngineError::Gguf(_)), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("'deepseek3_2' is not supported")
            && msg.contains("supported: llama, qwen2, gemma3, qwen3, qwen3moe, deepseek2"),
        "{msg}"
    );
}

#[test]
fn missing_file_names_the_path() {
    let msg = ModelFile::open("/nonexistent/model.gguf")
        .unwrap_err()
        .to_string();
    assert!(msg.contains("/nonexistent/model.gguf"), "{msg}");
}

#[test]
fn impossible_split_and_context_are_refused() {
    let path = common::model(common::GEMMA);
    let err = Engine::load(&path, Some(&[5, 5]), StageConfig::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("18 layers"), "{err}");
    let mut cfg = StageConfig::default();
    cfg.kv.n_ctx = 10_000_000;
    let err = Engine::load(&path, None, cfg).err().unwrap().to_string();
    assert!(
        err.contains("10000000") && err.contains("trained context"),
        "{err}"
    );
}

#[test]
fn out_of_vocabulary_token_and_full_context_are_errors() {
    let mut cfg = StageConfig::default();
    cfg.kv.n_ctx = 256;
    cfg.n_threads = 2;
    let mut e = Engine::load(common::model(common::GEMMA), None, cfg).unwrap();
    let err = e.prefill(0, &[2, 99_999_999], 0).unwrap_err().to_string();
    assert!(
        err.contains("99999999") && err.contains("vocabulary"),
        "{err}"
    );
    let err = e.prefill(0, &[2, 3], 255).unwrap_err().to_string();
    assert!(err.contains("context length of 256"), "{err}");
    // The engine still works afterwards.
    assert_eq!(
        e.prefill(0, &[2, 818, 5279], 0).unwrap().len(),
        e.model.hparams.n_vocab as usize
    );
}
