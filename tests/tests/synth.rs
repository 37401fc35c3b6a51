//! `omnictl synth`: files with real models' shapes and random weights, for
//! benchmarks. What a user would notice: the file has the named model's
//! shapes (as the engine reads them back), llama.cpp loads and runs it,
//! omni gives llama.cpp's tokens on it in one process and with the routed
//! experts on an expert worker, the same seed writes the same bytes, and a
//! request that cannot be met says why.

use omni_tests::{greedy, ids, target_bin, Cluster, ClusterSpec};
use std::path::{Path, PathBuf};
use std::process::Command;

fn synth(shape: &str, out: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(target_bin("omnictl"))
        .args(["synth", shape, "--out"])
        .arg(out)
        .args(extra)
        .output()
        .expect("omnictl runs")
}

/// A small slice of `shape`: 2 layers (R1's first dense, then one MoE),
/// 16 experts, a 2,048-token vocabulary; every width the model's.
fn slice(dir: &Path, shape: &str) -> PathBuf {
    let out = dir.join(format!("{shape}.gguf"));
    let o = synth(
        shape,
        &out,
        &["--layers", "2", "--experts", "16", "--vocab", "2048"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        out.display().to_string()
    );
    out
}

/// Greedy ids of omni (one CPU stage) and llama.cpp agree, or differ only
/// where llama.cpp's two candidates were within the fixtures' tie gap.
fn same_as_llama_cpp(path: &Path, prompt: &[u32], n: usize) -> Vec<u32> {
    let reference = omni_engine::llama_cpp_greedy(path, prompt, n, 2).unwrap();
    let ours = omni_tests::engine_tokens(path, &[prompt.to_vec()], n).remove(0);
    if let Some(i) = ours.iter().zip(&reference).position(|(a, (b, _))| a != b) {
        let (want, logits) = &reference[i];
        let gap = logits[*want as usize] - logits[ours[i] as usize];
        assert!(
            gap <= 0.25,
            "{}: step {i}: omni chose {} where llama.cpp chose {want} (logit gap {gap})",
            path.display(),
            ours[i]
        );
    }
    // A random model's logits are not all equal: the tokens are real choices.
    let (_, logits) = &reference[0];
    let (lo, hi) = logits
        .iter()
        .fold((f32::MAX, f32::MIN), |(l, h), &x| (l.min(x), h.max(x)));
    assert!(
        hi - lo > 0.1 && hi.is_finite() && lo.is_finite(),
        "{lo}..{hi}"
    );
    ours
}

#[test]
fn the_list_names_each_shape_and_its_source() {
    let o = Command::new(target_bin("omnictl"))
        .args(["synth", "--list"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{text}");
    for (name, source) in [
        ("deepseek-r1", "huggingface.co/deepseek-ai/DeepSeek-R1"),
        ("qwen3-30b-a3b", "huggingface.co/Qwen/Qwen3-30B-A3B"),
        ("glm-4.7-flash", "huggingface.co/zai-org/GLM-4.7-Flash"),
    ] {
        let line = text
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(line.contains(source), "{line}");
    }
}

#[test]
fn an_r1_slice_has_r1s_shapes_and_runs_as_llama_cpp_runs_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = slice(dir.path(), "deepseek-r1");
    let m = omni_engine::ModelFile::open(&path).unwrap();
    let hp = &m.hparams;
    assert_eq!(hp.arch.name(), "deepseek2");
    assert_eq!(
        (hp.n_embd, hp.n_head, hp.n_layer, hp.n_vocab),
        (7168, 128, 2, 2048)
    );
    assert_eq!(hp.mla.as_ref().unwrap().n_layer_dense_lead, 1);
    let moe = hp.moe.as_ref().unwrap();
    assert_eq!(
        (moe.n_expert, moe.n_expert_used, moe.n_ff_exp),
        (16, 8, 2048)
    );
    assert_eq!((moe.n_expert_groups, moe.n_group_used), (8, 4));
    assert_eq!(moe.weights_scale, 2.5);
    // Q4_K_M's types: 4-bit experts, a 6-bit head, 8-bit where a row is
    // not whole 256-wide blocks (MLA's per-head K absorption).
    let ty = |n: &str| m.gguf.tensor(n).unwrap().ggml_type.name();
    assert_eq!(ty("blk.1.ffn_gate_exps.weight"), "q4_K");
    assert_eq!(ty("output.weight"), "q6_K");
    assert_eq!(ty("blk.0.attn_k_b.weight"), "q8_0");
    assert_eq!(ty("blk.1.ffn_gate_inp.weight"), "f32");
    assert_eq!(
        m.gguf.tensor("blk.0.ffn_gate.weight").unwrap().dims,
        vec![7168, 18432]
    );
    let prompt: Vec<u32> = (300..316).collect();
    let alone = same_as_llama_cpp(&path, &prompt, 6);

    // The same tokens with the routed experts on an expert worker.
    let mut spec = ClusterSpec::new(1, "shm");
    spec.threads = 2;
    spec.cpu_workers = 1;
    spec.coordinator_args = vec!["--experts".into(), "cpu".into()];
    let c = Cluster::start(&path, &spec);
    let info = c.info().unwrap();
    assert_eq!(info.stages[0].offloaded, "1", "{info:?}");
    let got = ids(&c.generate(greedy(&prompt, 6)).unwrap());
    assert_eq!(got, alone, "the expert worker changes no token");
}

#[test]
fn a_qwen3_moe_slice_runs_as_llama_cpp_runs_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = slice(dir.path(), "qwen3-30b-a3b");
    let m = omni_engine::ModelFile::open(&path).unwrap();
    let hp = &m.hparams;
    assert_eq!(hp.arch.name(), "qwen3moe");
    assert_eq!((hp.n_embd, hp.n_head, hp.n_head_kv), (2048, 32, 4));
    let moe = hp.moe.as_ref().unwrap();
    assert_eq!(
        (moe.n_expert, moe.n_expert_used, moe.n_ff_exp),
        (16, 8, 768)
    );
    same_as_llama_cpp(&path, &(300..316).collect::<Vec<u32>>(), 6);
}

#[test]
fn a_glm_4_7_flash_slice_runs_as_llama_cpp_runs_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = slice(dir.path(), "glm-4.7-flash");
    let m = omni_engine::ModelFile::open(&path).unwrap();
    let hp = &m.hparams;
    assert_eq!(hp.arch.name(), "deepseek2");
    assert_eq!((hp.n_embd, hp.n_head), (2048, 20));
    let moe = hp.moe.as_ref().unwrap();
    assert_eq!(
        (moe.n_expert, moe.n_expert_used, moe.n_ff_exp),
        (16, 4, 1536)
    );
    assert_eq!(moe.weights_scale, 1.8);
    same_as_llama_cpp(&path, &(300..316).collect::<Vec<u32>>(), 6);
}

#[test]
fn the_same_seed_writes_the_same_file_and_bad_requests_say_why() {
    let dir = tempfile::tempdir().unwrap();
    let small = ["--layers", "1", "--experts", "8", "--vocab", "512"];
    let digest = |p: &Path| std::fs::read(p).unwrap();
    let (a, b, c) = (
        dir.path().join("a.gguf"),
        dir.path().join("b.gguf"),
        dir.path().join("c.gguf"),
    );
    for (out, seed) in [(&a, "7"), (&b, "7"), (&c, "8")] {
        let o = synth(
            "qwen3-30b-a3b",
            out,
            &[&small[..], &["--seed", seed]].concat(),
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    assert_eq!(digest(&a), digest(&b));
    assert_ne!(digest(&a), digest(&c));

    for (shape, extra, says) in [
        ("deepseek-r1", &["--experts", "12"][..], "multiple of 8"),
        ("deepseek-r1", &["--experts", "4"][..], "at least"),
        ("deepseek-r1", &["--layers", "0"][..], "at least 1"),
        (
            "deepseek-r1",
            &["--layers", "2", "--dense", "3"][..],
            "only 2 layers",
        ),
        (
            "qwen3-30b-a3b",
            &["--dense", "1"][..],
            "has no dense layers",
        ),
        ("qwen3-30b-a3b", &["--vocab", "100"][..], "at least 259"),
        (
            "llama-9000",
            &[][..],
            "no shape named 'llama-9000' (known: deepseek-r1",
        ),
    ] {
        let out = dir.path().join("bad.gguf");
        let o = synth(shape, &out, extra);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains(says),
            "{shape} {extra:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
        assert!(!out.exists());
    }
    // Where the whole of R1 (about 380 GiB) does not fit the disk, it is
    // refused before anything is written.
    let df = Command::new("df")
        .args(["-B1", "--output=avail"])
        .arg(dir.path())
        .output()
        .unwrap();
    let free: u64 = String::from_utf8_lossy(&df.stdout)
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .unwrap();
    if free < 350 << 30 {
        let out = dir.path().join("r1.gguf");
        let o = synth("deepseek-r1", &out, &[]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains("free; ask for fewer --layers"),
            "{err}"
        );
        assert!(!out.exists() && !dir.path().join("r1.gguf.partial").exists());
    }
}

/// `omnictl bench-moe` on a small slice, in two rounds: every row (each
/// figure the rounds' median) and the breakdown of a decode step with the
/// experts on an expert worker; a dense model is refused with the reason.
#[test]
fn bench_moe_prints_each_configuration_and_where_a_step_went() {
    let dir = tempfile::tempdir().unwrap();
    let path = slice(dir.path(), "qwen3-30b-a3b");
    let o = Command::new(target_bin("omnictl"))
        .args(["bench-moe", "--model"])
        .arg(&path)
        .args([
            "-t", "1", "--pp", "16", "--tg", "4", "--runs", "1", "--rounds", "2", "--json",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["rounds"], 2, "{v}");
    assert!(
        err.contains("round 1 of 2") && err.contains("round 2 of 2"),
        "{err}"
    );
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{v}");
    for r in rows {
        assert!(r["decode_tok_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["prefill_tok_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    let b = &rows[1]["breakdown"];
    assert_eq!(
        b["calls_per_token"].as_f64(),
        Some(2.0),
        "two MoE layers: {b}"
    );
    assert!(b["experts_ms"].as_f64().unwrap() > 0.0, "{b}");
    assert!(
        b["step_ms"].as_f64().unwrap() >= b["experts_ms"].as_f64().unwrap() * 0.5,
        "{b}"
    );

    let o = Command::new(target_bin("omnictl"))
        .args(["bench-moe", "--model"])
        .arg(omni_tests::fixtures::model(omni_tests::fixtures::GEMMA))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("has no routed experts"),
        "{err}"
    );
}
