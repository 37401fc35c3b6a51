//! deepseek2: the current MLA layout and the legacy attn_kv_b layout of the same weights.

use super::derived::open_err;
use super::qwen3moe::two_sequences_batched_follow_their_references;
use super::*;

#[test]
fn deepseek2_mla_f32_matches_llama_cpp() {
    check_synthetic("deepseek2-mla", "f32", None);
}

#[test]
fn deepseek2_mla_q8_0_matches_llama_cpp() {
    check_synthetic("deepseek2-mla", "q8_0", None);
}

#[test]
fn deepseek2_mla_q4_k_m_matches_llama_cpp() {
    check_synthetic("deepseek2-mla", "q4_k_m", None);
}

#[test]
fn deepseek2_legacy_f32_matches_llama_cpp() {
    check_synthetic("deepseek2-legacy", "f32", None);
}

#[test]
fn deepseek2_legacy_q8_0_matches_llama_cpp() {
    check_synthetic("deepseek2-legacy", "q8_0", None);
}

#[test]
fn deepseek2_legacy_q4_k_m_matches_llama_cpp() {
    check_synthetic("deepseek2-legacy", "q4_k_m", None);
}

/// Splits put the dense block and the MoE blocks, and the latent KV cache,
/// on different stages.
#[test]
fn deepseek2_split_in_two_and_three_matches_llama_cpp() {
    for layout in ["deepseek2-mla", "deepseek2-legacy"] {
        check_synthetic(layout, "f32", Some(&[1, 3]));
        check_synthetic(layout, "f32", Some(&[2, 1, 1]));
        check_synthetic(layout, "q8_0", Some(&[2, 2]));
        check_synthetic(layout, "q8_0", Some(&[1, 1, 2]));
        check_synthetic(layout, "q4_k_m", Some(&[3, 1]));
        check_synthetic(layout, "q4_k_m", Some(&[1, 2, 1]));
    }
}

#[test]
fn deepseek2_two_sequences_batched_follow_their_references() {
    two_sequences_batched_follow_their_references("deepseek2-mla");
    two_sequences_batched_follow_their_references("deepseek2-legacy");
}

/// The same F32 weights in both layouts: the compact latent cache and the
/// decompressed K/V cache round to F16 different tensors, so the logits
/// differ a little (the fixtures README: at most ~0.018 in llama.cpp), and
/// the greedy ids must be the same.
#[test]
fn deepseek2_layouts_agree() {
    let (mla_tf, mla_ids) = check_synthetic("deepseek2-mla", "f32", None);
    let (legacy_tf, legacy_ids) = check_synthetic("deepseek2-legacy", "f32", None);
    let d = mla_tf
        .iter()
        .flatten()
        .zip(legacy_tf.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!("deepseek2 MLA vs legacy layout (F32): teacher-forced max |logit diff| {d:.2e}");
    assert!(d <= 0.02, "the two layouts' logits differ by {d}");
    assert_eq!(mla_ids, legacy_ids, "the two layouts' greedy ids differ");
}

/// The compact cache holds kv_lora_rank + rope F16 values per token and
/// layer (one latent row, no V); the legacy layout holds every head's K and V.
#[test]
fn deepseek2_mla_kv_cache_is_the_compact_latent() {
    let mla = ModelFile::open(synthetic("tiny-deepseek2-mla-f32.gguf")).unwrap();
    let legacy = ModelFile::open(synthetic("tiny-deepseek2-legacy-f32.gguf")).unwrap();
    let m = mla.hparams.mla.as_ref().expect("MLA");
    assert!(m.absorbed);
    assert_eq!(
        (
            m.q_lora_rank,
            m.kv_lora_rank,
            m.n_embd_head_qk_nope,
            m.n_embd_head_qk_rope
        ),
        (96, 64, 32, 16)
    );
    assert_eq!(
        (m.n_embd_head_v, m.n_layer_dense_lead, m.n_expert_shared),
        (32, 1, 1)
    );
    assert!(!legacy.hparams.mla.as_ref().unwrap().absorbed);
    let moe = mla.hparams.moe.as_ref().unwrap();
    assert_eq!(
        (
            moe.n_expert,
            moe.n_expert_used,
            moe.n_expert_groups,
            moe.n_group_used
        ),
        (16, 4, 4, 2)
    );
    assert_eq!(moe.gating, omni_engine::model::ExpertGating::Sigmoid);
    assert!(moe.norm_weights && moe.weights_scale == 2.5);
    // Both layouts share the kq scale: mscale^2 / sqrt(48) with mscale = 1 + 0.1 ln 40.
    let want = (1.0 + 0.1 * 40f32.ln()).powi(2) / 48f32.sqrt();
    for hp in [&mla.hparams, &legacy.hparams] {
        assert!(
            (hp.attn_scale - want).abs() < 1e-6,
            "{} vs {want}",
            hp.attn_scale
        );
    }

    let per_token =
        |hp: &omni_engine::Hparams| hp.kv_bytes_per_token_layer() * u64::from(hp.n_layer);
    assert_eq!(mla.hparams.kv_bytes_per_token_layer(), 2 * (64 + 16));
    assert_eq!(
        legacy.hparams.kv_bytes_per_token_layer(),
        2 * (4 * 48 + 4 * 32)
    );
    let (a, b) = (per_token(&mla.hparams), per_token(&legacy.hparams));
    eprintln!("deepseek2 KV bytes per token (4 layers, F16): MLA {a}, legacy {b}");
    assert!(a < b);
    let kv = config().kv;
    assert_eq!(kv.bytes(&mla.hparams, 4), a * 256);
    // What the caches really allocate, split over two stages.
    for (m, want) in [(&mla, a), (&legacy, b)] {
        let e = Engine::load(m.path.clone(), Some(&[1, 3]), config()).unwrap();
        let got: u64 = e.stages().iter().map(|s| s.kv().allocated_bytes()).sum();
        assert_eq!(got, want * 256, "{}", m.path.display());
    }
}

/// A minimal deepseek2 file without q_lora (a plain `attn_q`, as
/// DeepSeek-V2-Lite): it opens, runs and its logits are finite.
#[test]
fn deepseek2_without_q_lora_runs_on_attn_q() {
    let dir = tempfile::tempdir().unwrap();
    let (mut kvs, tensors) = f32_fixture_of("tiny-deepseek2-mla-f32.gguf");
    kvs.retain(|(k, _)| k != "deepseek2.attention.q_lora_rank");
    let mut t: Vec<F32Tensor> = tensors
        .into_iter()
        .filter(|x| !x.0.contains("attn_q_a") && !x.0.contains("attn_q_b"))
        .collect();
    for il in 0..4 {
        let (rows, cols) = (256usize, 4 * 48usize);
        let data = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) / 8.0)
            .collect();
        t.push((
            format!("blk.{il}.attn_q.weight"),
            vec![rows as u64, cols as u64],
            data,
        ));
    }
    let p = dir.path().join("no-q-lora.gguf");
    write_gguf(&p, &kvs, &t);
    let m = ModelFile::open(&p).unwrap();
    assert_eq!(m.hparams.mla.as_ref().unwrap().q_lora_rank, 0);
    let mut e = Engine::load(&p, None, config()).unwrap();
    let logits = e.logits_all(0, &[0, 5, 9, 300]).unwrap();
    assert!(logits.iter().flatten().all(|v| v.is_finite()));
}

#[test]
fn bad_deepseek2_metadata_and_shapes_are_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let (kvs, tensors) = f32_fixture_of("tiny-deepseek2-mla-f32.gguf");
    let with = |key: &str, v: Value| {
        let mut k = kvs.clone();
        set_key(&mut k, key, v);
        k
    };
    let without = |key: &str| -> Vec<(String, Value)> {
        kvs.iter().filter(|(k, _)| k != key).cloned().collect()
    };
    let cases: Vec<(Vec<(String, Value)>, &str)> = vec![
        (
            without("deepseek2.attention.key_length_mla"),
            "deepseek2.attention.key_length_mla",
        ),
        (
            without("deepseek2.attention.kv_lora_rank"),
            "deepseek2.attention.kv_lora_rank",
        ),
        (
            with("deepseek2.attention.kv_lora_rank", Value::U32(0)),
            "deepseek2.attention.kv_lora_rank",
        ),
        (
            with("deepseek2.attention.head_count_kv", Value::U32(4)),
            "deepseek2.attention.head_count_kv",
        ),
        (
            with("deepseek2.attention.key_length", Value::U32(48)),
            "deepseek2.attention.key_length",
        ),
        (
            with("deepseek2.attention.value_length", Value::U32(32)),
            "deepseek2.attention.value_length",
        ),
        (
            with("deepseek2.rope.dimension_count", Value::U32(48)),
            "deepseek2.rope.dimension_count",
        ),
        (
            with("deepseek2.expert_group_count", Value::U32(3)),
            "deepseek2.expert_group_count",
        ),
        (
            with("deepseek2.expert_group_count", Value::U32(16)),
            "deepseek2.expert_group_count",
        ),
        (
            with("deepseek2.expert_group_used_count", Value::U32(4)),
            "deepseek2.expert_group_used_count",
        ),
        (
            with("deepseek2.expert_group_used_count", Value::U32(0)),
            "deepseek2.expert_group_used_count",
        ),
        (
            with("deepseek2.expert_gating_func", Value::U32(4)),
            "deepseek2.expert_gating_func",
        ),
        (
            with("deepseek2.leading_dense_block_count", Value::U32(5)),
            "deepseek2.leading_dense_block_count",
        ),
        (
            without("deepseek2.expert_shared_count"),
            "deepseek2.expert_shared_count",
        ),
        (
            with("deepseek2.expert_shared_count", Value::U32(0)),
            "deepseek2.expert_shared_count",
        ),
        (
            with("deepseek2.nextn_predict_layers", Value::U32(1)),
            "deepseek2.nextn_predict_layers",
        ),
        (
            with("deepseek2.attention.temperature_scale", Value::F32(0.5)),
            "deepseek2.attention.temperature_scale",
        ),
    ];
    for (k, want) in &cases {
        let msg = open_err(dir.path(), k, &tensors).to_string();
        assert!(msg.contains(want), "{want}: {msg}");
    }
    // The latent split with the wrong width: a shape error naming the tensor.
    let reshaped = |name: &str, dims: Vec<u64>| {
        let mut t = tensors.clone();
        let x = t.iter_mut().find(|x| x.0 == name).unwrap();
        x.1 = dims;
        t
    };
    let msg = open_err(
        dir.path(),
        &kvs,
        &reshaped("blk.2.attn_k_b.weight", vec![64, 32, 4]),
    )
    .to_string();
    assert!(
        msg.contains("blk.2.attn_k_b.weight") && msg.contains("[32, 64, 4]"),
        "{msg}"
    );
    let msg = open_err(
        dir.path(),
        &kvs,
        &reshaped("blk.1.attn_kv_a_mqa.weight", vec![256, 64]),
    )
    .to_string();
    assert!(
        msg.contains("blk.1.attn_kv_a_mqa.weight") && msg.contains("[256, 80]"),
        "{msg}"
    );
    let msg = open_err(
        dir.path(),
        &kvs,
        &reshaped("blk.3.ffn_up_shexp.weight", vec![256, 64]),
    )
    .to_string();
    assert!(
        msg.contains("blk.3.ffn_up_shexp.weight") && msg.contains("[256, 128]"),
        "{msg}"
    );
    // Missing tensors: the value half of the split, and the dense block's FFN.
    for name in [
        "blk.0.attn_v_b.weight",
        "blk.0.ffn_up.weight",
        "blk.1.ffn_down_shexp.weight",
    ] {
        let t: Vec<F32Tensor> = tensors.iter().filter(|x| x.0 != name).cloned().collect();
        let msg = open_err(dir.path(), &kvs, &t).to_string();
        assert!(msg.contains(name), "{name}: {msg}");
    }
    // The legacy layout's attn_kv_b, and a legacy file without it.
    let (lkvs, ltensors) = f32_fixture_of("tiny-deepseek2-legacy-f32.gguf");
    let mut t = ltensors.clone();
    t.iter_mut()
        .find(|x| x.0 == "blk.0.attn_kv_b.weight")
        .unwrap()
        .1 = vec![64, 128];
    let msg = open_err(dir.path(), &lkvs, &t).to_string();
    assert!(
        msg.contains("blk.0.attn_kv_b.weight") && msg.contains("[64, 256]"),
        "{msg}"
    );
    let t: Vec<F32Tensor> = ltensors
        .iter()
        .filter(|x| x.0 != "blk.2.attn_kv_b.weight")
        .cloned()
        .collect();
    let msg = open_err(dir.path(), &lkvs, &t).to_string();
    assert!(msg.contains("blk.2.attn_kv_b.weight"), "{msg}");
    // A legacy file must decompress for every head.
    let mut k = lkvs.clone();
    set_key(&mut k, "deepseek2.attention.head_count_kv", Value::U32(1));
    let msg = open_err(dir.path(), &k, &ltensors).to_string();
    assert!(
        msg.contains("deepseek2.attention.head_count_kv") && msg.contains("legacy"),
        "{msg}"
    );
}
