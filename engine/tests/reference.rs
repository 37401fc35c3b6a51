//! The engine against llama.cpp's reference outputs (../shared/fixtures):
//! tokenizer ids, greedy tokens and top-5 logits of the real Gemma 3 and
//! Qwen2.5-Coder files, whole and split into chained layer ranges, and
//! eight sequences batched together; against the vendored llama.cpp's own
//! `llama_decode` on this machine; and all of it again with a lower ggml
//! CPU variant forced.
//!
//! Logits depend on the kernels the CPU runs. The fixtures were made with
//! ggml's AVX-512 kernels (AVX-512 with VBMI, VNNI and BF16, no AVX-VNNI:
//! the `zen4` variant's set), so they are checked at the README's
//! tolerances where this process computes with that set. With other
//! kernels the same llama.cpp moves the logits by up to 1.6 (measured on an
//! AVX2 Zen 3: haswell and piledriver variants, both models), and greedy
//! paths part where the reference's top-2 gap is small (at gaps up to 0.35
//! there); the portable check is then looser, and the exact one is the
//! comparison with the vendored llama.cpp computing with the same kernels.
//!
//! Each model test computes on both cores, so they take turns
//! ([`common::cores`]).

mod common;

use common::*;
use omni_engine::sampling::greedy;
use omni_engine::{Batch, Engine, PromptCuts, StageConfig};

fn config(n_seq: usize) -> StageConfig {
    let mut cfg = StageConfig::default();
    cfg.kv.n_ctx = 512;
    cfg.kv.n_seq = n_seq;
    cfg.n_threads = 2;
    cfg
}

/// What one prompt did, for reporting.
struct Outcome {
    id: String,
    matched_steps: usize,
    max_logit_diff: f32,
}

/// How closely a run must follow the fixture file.
struct Tolerance {
    /// Max |logit diff| for prompts under / over 100 tokens.
    short: f32,
    long: f32,
    /// Greedy ids must match exactly until the reference's own top-2 gap
    /// falls below this (None: exactly, except where the fixture marks a
    /// near tie: 1- and 2-thread llama.cpp differ there).
    tie_gap: Option<f32>,
}

/// The fixtures README's tolerances, for the fixtures' own kernels.
const FIXTURE_TOLERANCE: Tolerance = Tolerance {
    short: 0.3,
    long: 1.0,
    tie_gap: None,
};

/// Other kernels: the kernel change's own drift (up to 1.6 measured) and
/// the gaps it flips (up to 0.35 measured), with a margin.
const CROSS_KERNEL_TOLERANCE: Tolerance = Tolerance {
    short: 2.0,
    long: 2.0,
    tie_gap: Some(0.5),
};

/// The tolerance for this process's kernels, said once per check.
fn tolerance() -> &'static Tolerance {
    let cpu = omni_engine::cpu_backend(None).expect("a CPU backend");
    if fixture_kernels() {
        eprintln!("CPU backend: {cpu}: the fixtures' kernels, their README's tolerances");
        &FIXTURE_TOLERANCE
    } else {
        eprintln!("CPU backend: {cpu}: not the fixtures' kernels, cross-kernel tolerances");
        &CROSS_KERNEL_TOLERANCE
    }
}

/// Greedy-decodes every fixture prompt and checks ids and top-5 logits.
fn check_reference(model_file: &str, fixture: &str, split: Option<&[u32]>) {
    let _cores = cores();
    let fx = json(fixture);
    let tolerance = tolerance();
    let mut engine = Engine::load(model(model_file), split, config(1)).expect("model loads");
    // The fixtures decode each prompt as one batch (llama_decode's cuts).
    engine.prompt_cuts = PromptCuts::Ubatch;
    let mut failures = Vec::new();
    let mut outcomes = Vec::new();
    for p in fx["prompts"].as_array().unwrap() {
        let id = p["id"].as_str().unwrap().to_string();
        let prompt = ids(&p["prompt_ids"]);
        let text = p["text"].as_str().unwrap();
        let ours = engine
            .tokenize_prompt(text, p["parse_special"].as_bool().unwrap())
            .unwrap();
        if ours != prompt {
            failures.push(format!(
                "{id}: tokenization differs: ours {ours:?} vs {prompt:?}"
            ));
        }
        let want = ids(&p["generated_ids"]);
        // Exact up to the 1-vs-2-thread divergence where llama.cpp itself is a near tie.
        let steps = p["steps"].as_array().unwrap();
        let mut exact_until = if p["near_tie"].as_bool().unwrap() {
            p["t1_t2_first_divergence"].as_u64().unwrap() as usize
        } else {
            want.len()
        };
        if let Some(gap) = tolerance.tie_gap {
            let ref_gap = |s: &serde_json::Value| {
                s["top5"][0][1].as_f64().unwrap() - s["top5"][1][1].as_f64().unwrap()
            };
            exact_until = exact_until.min(
                steps
                    .iter()
                    .position(|s| ref_gap(s) < gap as f64)
                    .unwrap_or(want.len()),
            );
        }
        let tol = if prompt.len() < 100 {
            tolerance.short
        } else {
            tolerance.long
        };

        engine.remove_seq(0);
        let mut logits = engine.prefill(0, &prompt, 0).unwrap();
        let mut out = Outcome {
            id: id.clone(),
            matched_steps: 0,
            max_logit_diff: 0.0,
        };
        for (i, step) in steps.iter().enumerate() {
            for pair in step["top5"].as_array().unwrap() {
                let (tid, want_logit) = (
                    pair[0].as_u64().unwrap() as usize,
                    pair[1].as_f64().unwrap() as f32,
                );
                let d = (logits[tid] - want_logit).abs();
                out.max_logit_diff = out.max_logit_diff.max(d);
                if d > tol {
                    failures.push(format!("{id} step {i}: logit of token {tid} is {} but llama.cpp has {want_logit} (tolerance {tol})", logits[tid]));
                }
            }
            let tok = greedy(&logits);
            if tok != want[i] {
                if i < exact_until {
                    failures.push(format!(
                        "{id} step {i}: greedy token {tok} but llama.cpp chose {}",
                        want[i]
                    ));
                }
                break;
            }
            out.matched_steps = i + 1;
            if i + 1 < steps.len() {
                let mut b = Batch::default();
                b.push(tok, (prompt.len() + i) as i32, 0, true);
                logits = engine.step(&b).unwrap().row(0).to_vec();
            }
        }
        outcomes.push(out);
    }
    for o in &outcomes {
        eprintln!(
            "{:32} split {:?}: {:2} steps equal, max |logit diff| {:.4}",
            o.id, split, o.matched_steps, o.max_logit_diff
        );
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn gemma3_matches_llama_cpp() {
    check_reference(GEMMA, "real_gemma3_270m.json", None);
}

#[test]
fn qwen2_matches_llama_cpp() {
    check_reference(QWEN, "real_qwen2_5_coder_0_5b.json", None);
}

#[test]
fn gemma3_split_in_three_matches_llama_cpp() {
    check_reference(GEMMA, "real_gemma3_270m.json", Some(&[5, 7, 6]));
}

#[test]
fn qwen2_split_in_two_matches_llama_cpp() {
    check_reference(QWEN, "real_qwen2_5_coder_0_5b.json", Some(&[9, 15]));
}

/// Our graphs against llama.cpp's own `llama_decode`, built from the same
/// vendored source and computing with the same CPU backend: identical greedy
/// ids and logits to 0.01 on every fixture prompt, whole (and split, given
/// a split).
fn check_against_vendored(model_file: &str, fixture: &str, split: Option<&[u32]>) {
    check_against_vendored_cut(model_file, fixture, split, PromptCuts::Ubatch);
}

/// [`check_against_vendored`] with our prompts cut as `cuts` says, and
/// llama.cpp's decoded in the same pieces.
fn check_against_vendored_cut(
    model_file: &str,
    fixture: &str,
    split: Option<&[u32]>,
    cuts: PromptCuts,
) {
    let _cores = cores();
    const STEPS: usize = 24;
    let fx = json(fixture);
    let path = model(model_file);
    let mut engines = vec![Engine::load(&path, None, config(1)).unwrap()];
    if let Some(split) = split {
        engines.push(Engine::load(&path, Some(split), config(1)).unwrap());
    }
    for e in &mut engines {
        e.prompt_cuts = cuts;
    }
    let n_ubatch = engines[0].n_ubatch();
    let model_cuts = cuts.for_model(&engines[0].model.hparams);
    let mut worst = 0.0f32;
    for p in fx["prompts"].as_array().unwrap() {
        let id = p["id"].as_str().unwrap();
        let prompt = ids(&p["prompt_ids"]);
        let pieces = model_cuts.pieces(prompt.len(), n_ubatch);
        let reference =
            omni_engine::llama_cpp_greedy_in_pieces(&path, &prompt, &pieces, STEPS, 2).unwrap();
        for engine in engines.iter_mut() {
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
                    "{id} step {i}: logits differ from llama.cpp's by {d} ({} stages)",
                    engine.stages().len()
                );
                let tok = greedy(&logits);
                assert_eq!(
                    tok,
                    *want,
                    "{id} step {i}: greedy token differs from llama.cpp's ({} stages)",
                    engine.stages().len()
                );
                let mut b = Batch::default();
                b.push(tok, (prompt.len() + i) as i32, 0, true);
                logits = engine.step(&b).unwrap().row(0).to_vec();
            }
        }
    }
    eprintln!("{model_file}: prompts cut as {cuts}: {STEPS} steps x all prompts equal to vendored llama.cpp, max |logit diff| {worst:.2e}");
}

#[test]
fn gemma3_matches_vendored_llama_cpp() {
    check_against_vendored(GEMMA, "real_gemma3_270m.json", Some(&[5, 7, 6]));
}

/// Gemma 3 has sliding-window layers: cut as llama-server cuts its
/// prompts (4 tokens before the end), against llama.cpp decoding the same
/// pieces. The cut moves the logits by up to 0.2 from the whole prompt's
/// (see `prompt_cuts.rs`), so this checks that we cut where we say.
#[test]
fn gemma3_cut_as_llama_server_matches_vendored_llama_cpp() {
    check_against_vendored_cut(
        GEMMA,
        "real_gemma3_270m.json",
        Some(&[5, 7, 6]),
        PromptCuts::LlamaServer,
    );
}

#[test]
fn qwen2_matches_vendored_llama_cpp() {
    // Whole only: the split is checked against the fixtures
    // (qwen2_split_in_two_matches_llama_cpp); it would add a minute.
    check_against_vendored(QWEN, "real_qwen2_5_coder_0_5b.json", None);
}

/// The fixture checks again (whole models), in a process that computes with
/// a lower ggml CPU variant than this machine's choice (forced with
/// OMNI_CPU_VARIANT): haswell where the choice is above it. (The vendored
/// comparison is left to the chosen variant: it would double this file's
/// time, and ggml_build.rs checks every variant's matmuls.)
#[test]
fn a_lower_cpu_variant_matches_llama_cpp_too() {
    let _cores = cores();
    let cpu = omni_engine::cpu_backend(None).expect("a CPU backend");
    let lower = lower_variant(cpu).unwrap_or_else(|| {
        panic!(
            "this CPU runs no variant below {} but x64/sse42: nothing to force",
            cpu.variant
        )
    });
    let (ok, text) = common::run_with_variant(
        &lower,
        &["gemma3_matches_llama_cpp", "qwen2_matches_llama_cpp"],
    );
    assert!(ok, "with {lower}:\n{text}");
    assert!(
        text.contains(&format!("CPU backend: {lower}, forced"))
            && text.contains("test result: ok. 2 passed"),
        "{text}"
    );
    eprintln!(
        "forced {lower} (this machine chooses {}): both fixture checks pass",
        cpu.variant
    );
}

fn check_tokenizer(model_file: &str, fixture: &str) {
    let fx = json(fixture);
    let engine = Engine::load(model(model_file), None, config(1)).unwrap();
    let mut bad = Vec::new();
    for case in fx["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        for (parse_special, key) in [(true, "ids_parse_special"), (false, "ids_no_parse_special")] {
            let ours = engine.tokenizer.encode(text, false, parse_special).unwrap();
            if ours != ids(&case[key]) {
                bad.push(format!(
                    "case {} ({text:?}, parse_special={parse_special}): {ours:?} vs {:?}",
                    case["index"],
                    ids(&case[key])
                ));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "{} tokenizer mismatches:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn gemma3_tokenizer_matches_llama_cpp() {
    check_tokenizer(GEMMA, "tokenizer_gemma3_270m.json");
}

#[test]
fn qwen2_tokenizer_matches_llama_cpp() {
    check_tokenizer(QWEN, "tokenizer_qwen2_5_coder_0_5b.json");
}

/// Eight sequences in the same steps give each sequence's solo tokens; a
/// difference is allowed only where the solo run was a near tie (top-2
/// logits within 0.1), and the test shows it.
/// Batched steps use other matmul kernels (many-row gemm instead of one-row
/// gemv) and another flash-attention path (one query row accumulates V in
/// FP16, many rows take the tiled FP32 path), so their rounding differs: the
/// test prints the top-2 logit drift (measured up to 1.29 for Gemma 3 with
/// the fixtures' AVX-512 kernels, 1.71 with AVX2's).
/// With the fixtures' kernels measured differences flipped ties of up to
/// 0.133, so this bound is 0.15.
const NEAR_TIE: f32 = 0.15;
/// With other kernels (AVX2 here) the batched path drifts further: a flip
/// at a solo gap of 0.28 was measured; the cross-kernel bound.
const NEAR_TIE_OTHER_KERNELS: f32 = 0.5;

fn check_batched(model_file: &str, fixture: &str) {
    let _cores = cores();
    const N: usize = 8;
    const STEPS: usize = 24;
    let fx = json(fixture);
    let prompts: Vec<Vec<u32>> = fx["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .take(N)
        .map(|p| ids(&p["prompt_ids"]))
        .collect();
    let mut engine = Engine::load(model(model_file), None, config(N)).unwrap();
    // Solo prompts whole, as the batched steps below take them (a cut's
    // own drift is not batching's).
    engine.prompt_cuts = PromptCuts::Ubatch;
    let near_tie = if fixture_kernels() {
        NEAR_TIE
    } else {
        NEAR_TIE_OTHER_KERNELS
    };

    // Solo runs, remembering the top-2 gap at every step.
    let mut solo = Vec::new();
    for prompt in &prompts {
        engine.remove_seq(0);
        let mut logits = engine.prefill(0, prompt, 0).unwrap();
        let (mut toks, mut gaps, mut tops) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..STEPS {
            let top = omni_engine::sampling::top_k_logits(&logits, 2);
            tops.push(top.clone());
            gaps.push(top[0].1 - top[1].1);
            let t = greedy(&logits);
            toks.push(t);
            let mut b = Batch::default();
            b.push(t, (prompt.len() + i) as i32, 0, true);
            logits = engine.step(&b).unwrap().row(0).to_vec();
        }
        solo.push((toks, gaps, tops));
    }
    engine.remove_seq(0);

    // All eight together: prompts packed into shared steps (as many tokens
    // per step as n_ubatch allows), then one decode step for all eight.
    let mut pending: Vec<(usize, usize)> = (0..N).map(|s| (s, 0)).collect();
    let mut last = vec![Vec::new(); N];
    while !pending.is_empty() {
        let mut b = Batch::default();
        for (s, done) in pending.iter_mut() {
            let room = engine.n_ubatch() - b.len();
            let take = room.min(prompts[*s].len() - *done);
            for k in 0..take {
                let p = *done + k;
                b.push(
                    prompts[*s][p],
                    p as i32,
                    *s as u32,
                    p + 1 == prompts[*s].len(),
                );
            }
            *done += take;
        }
        let l = engine.step(&b).unwrap();
        for (row, &bi) in l.rows.iter().enumerate() {
            last[b.seq[bi] as usize] = l.row(row).to_vec();
        }
        pending.retain(|(s, done)| *done < prompts[*s].len());
    }
    let mut batched: Vec<Vec<u32>> = vec![Vec::new(); N];
    let mut drift = [0f32; N];
    for i in 0..STEPS {
        let mut b = Batch::default();
        for s in 0..N {
            // Logit drift against the solo run while the two agree so far.
            if batched[s] == solo[s].0[..i] {
                for &(id, v) in &solo[s].2[i] {
                    drift[s] = drift[s].max((last[s][id as usize] - v).abs());
                }
            }
            let t = greedy(&last[s]);
            batched[s].push(t);
            b.push(t, (prompts[s].len() + i) as i32, s as u32, true);
        }
        let l = engine.step(&b).unwrap();
        for (s, row) in last.iter_mut().enumerate() {
            *row = l.row(s).to_vec();
        }
    }
    for s in 0..N {
        let (toks, gaps, _) = &solo[s];
        eprintln!(
            "sequence {s}: max top-2 logit drift batched vs solo {:.4}",
            drift[s]
        );
        match toks.iter().zip(&batched[s]).position(|(a, b)| a != b) {
            None => eprintln!("sequence {s}: {STEPS} tokens identical batched and solo"),
            Some(i) => {
                eprintln!(
                    "sequence {s}: differs at step {i}; solo top-2 gap there {:.4}",
                    gaps[i]
                );
                assert!(gaps[i] < near_tie, "sequence {s} differs at step {i} batched vs solo, and it is not a near tie (top-2 gap {})", gaps[i]);
            }
        }
    }
}

#[test]
fn gemma3_eight_sequences_batched_match_solo() {
    check_batched(GEMMA, "real_gemma3_270m.json");
}

#[test]
fn qwen2_eight_sequences_batched_match_solo() {
    check_batched(QWEN, "real_qwen2_5_coder_0_5b.json");
}
