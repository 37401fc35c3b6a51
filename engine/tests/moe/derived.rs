//! Files derived from the F32 fixture, written with a small GGUF writer.

use super::*;

/// The F32 qwen3moe fixture's keys and tensors.
fn f32_fixture() -> (Vec<(String, Value)>, Vec<F32Tensor>) {
    f32_fixture_of("tiny-qwen3moe-f32.gguf")
}

#[test]
fn qwen3_dense_equals_qwen3moe_with_one_expert() {
    let dir = tempfile::tempdir().unwrap();
    let (moe, dense) = one_expert_files(dir.path());
    let m = ModelFile::open(&dense).unwrap();
    assert_eq!(m.hparams.arch, omni_engine::Arch::Qwen3);
    assert_eq!((m.hparams.n_ff, m.hparams.moe.is_none()), (128, true));

    let input = ids(&json("synthetic/ref_tiny-qwen3moe-f32.json")["teacher_forced"]["input_ids"]);
    let run = |path: &std::path::Path| {
        Engine::load(path, None, config())
            .unwrap()
            .logits_all(0, &input)
            .unwrap()
    };
    let (want, got) = (run(&moe), run(&dense));
    assert_eq!((got.len(), want.len()), (input.len(), input.len()));
    let d = got
        .iter()
        .flatten()
        .zip(want.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!("qwen3 dense vs qwen3moe with one expert: max |logit diff| {d:.2e}");
    // Same weights, same ops, one weighting by exactly 1.0; but F32
    // `mul_mat` and `mul_mat_id` run different CPU kernels (tiled sgemm
    // against row dot products), so the sums round differently: measured
    // 2e-3 over the 4 layers (logits have std ~3).
    assert!(d < 0.01, "dense and one-expert MoE differ by {d}");
}

/// The dense qwen3 file against llama.cpp's own `llama_decode` (the
/// vendored source, built with the same flags): greedy ids and every
/// step's full logits, whole and split in 2 and 3.
#[test]
fn qwen3_dense_matches_vendored_llama_cpp() {
    const STEPS: usize = 16;
    let dir = tempfile::tempdir().unwrap();
    let (_, dense) = one_expert_files(dir.path());
    let fx = json("synthetic/ref_tiny-qwen3moe-f32.json");
    let mut worst = 0.0f32;
    for split in [None, Some(&[2u32, 2][..]), Some(&[1, 2, 1][..])] {
        let mut engine = Engine::load(&dense, split, config()).unwrap();
        for gen in fx["generations"].as_array().unwrap() {
            let prompt = ids(&gen["prompt_ids"]);
            let reference = omni_engine::llama_cpp_greedy(&dense, &prompt, STEPS, 2).unwrap();
            engine.remove_seq(0);
            let mut logits = engine.prefill(0, &prompt, 0).unwrap();
            for (i, (want, ref_logits)) in reference.iter().enumerate() {
                let d = logits
                    .iter()
                    .zip(ref_logits)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                worst = worst.max(d);
                assert!(
                    d < 0.01,
                    "split {split:?} step {i}: logits differ from llama.cpp's by {d}"
                );
                let tok = greedy(&logits);
                assert_eq!(
                    tok, *want,
                    "split {split:?} step {i}: greedy token differs from llama.cpp's"
                );
                let mut b = Batch::default();
                b.push(tok, (prompt.len() + i) as i32, 0, true);
                logits = engine.step(&b).unwrap().row(0).to_vec();
            }
        }
    }
    eprintln!("qwen3 dense: {STEPS} steps x 2 prompts x 3 splits equal to vendored llama.cpp, max |logit diff| {worst:.2e}");
}

pub(super) fn open_err(
    dir: &std::path::Path,
    kvs: &[(String, Value)],
    tensors: &[F32Tensor],
) -> EngineError {
    let p = dir.join("bad.gguf");
    write_gguf(&p, kvs, tensors);
    ModelFile::open(&p).expect_err("must be refused")
}

#[test]
fn bad_expert_metadata_and_shapes_are_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let (kvs, tensors) = f32_fixture();
    let with = |key: &str, v: Value| {
        let mut k = kvs.clone();
        set_key(&mut k, key, v);
        k
    };
    let cases: Vec<(Vec<(String, Value)>, &str)> = vec![
        (
            with("qwen3moe.expert_used_count", Value::U32(17)),
            "qwen3moe.expert_used_count",
        ),
        (
            with("qwen3moe.expert_used_count", Value::U32(0)),
            "qwen3moe.expert_used_count",
        ),
        (
            with("qwen3moe.expert_count", Value::U32(0)),
            "qwen3moe.expert_count",
        ),
        (
            with("qwen3moe.expert_count", Value::U32(5000)),
            "qwen3moe.expert_count",
        ),
        (
            // Groups without the count of groups to use (llama.cpp asserts).
            with("qwen3moe.expert_group_count", Value::U32(4)),
            "qwen3moe.expert_group_used_count",
        ),
        (
            with("qwen3moe.rope.dimension_count", Value::U32(16)),
            "qwen3moe.rope.dimension_count",
        ),
        (
            // More experts per token than one step's graph can hold.
            {
                let mut k = with("qwen3moe.expert_count", Value::U32(1024));
                set_key(&mut k, "qwen3moe.expert_used_count", Value::U32(1024));
                k
            },
            "graph nodes",
        ),
        (
            kvs.iter()
                .filter(|(k, _)| k != "qwen3moe.expert_count")
                .cloned()
                .collect(),
            "qwen3moe.expert_count",
        ),
    ];
    for (k, want) in &cases {
        let msg = open_err(dir.path(), k, &tensors).to_string();
        assert!(msg.contains(want), "{want}: {msg}");
    }
    // 8 experts in the metadata but 16 in the tensors: a shape error naming the tensor.
    let msg = open_err(
        dir.path(),
        &with("qwen3moe.expert_count", Value::U32(8)),
        &tensors,
    )
    .to_string();
    assert!(
        msg.contains("blk.0.ffn_gate_inp.weight") && msg.contains("[256, 8]"),
        "{msg}"
    );
    // An expert tensor with the wrong width.
    let mut t = tensors.clone();
    let down = t
        .iter_mut()
        .find(|x| x.0 == "blk.2.ffn_down_exps.weight")
        .unwrap();
    down.1 = vec![64, 256, 32];
    let msg = open_err(dir.path(), &kvs, &t).to_string();
    assert!(
        msg.contains("blk.2.ffn_down_exps.weight") && msg.contains("[128, 256, 16]"),
        "{msg}"
    );
    // A missing expert tensor.
    let t: Vec<F32Tensor> = tensors
        .iter()
        .filter(|x| x.0 != "blk.3.ffn_up_exps.weight")
        .cloned()
        .collect();
    let msg = open_err(dir.path(), &kvs, &t).to_string();
    assert!(msg.contains("blk.3.ffn_up_exps.weight"), "{msg}");
}
