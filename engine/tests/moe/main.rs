//! Mixture-of-experts models against llama.cpp: the tiny random qwen3moe
//! and deepseek2 (MLA and legacy layouts) files of
//! ../shared/fixtures/synthetic, each against its own reference
//! (teacher-forced logits at every position, greedy ids and top-5 logits of
//! two prompts), whole and split into 2 and 3 chained stages. There is no
//! qwen3 (dense) fixture: the dense graph is checked against the MoE graph
//! on files derived from the F32 fixture where the two must agree (one
//! expert, used by every token), and bad expert metadata and shapes must
//! be refused at open.

#[path = "../common/mod.rs"]
mod common;

use common::*;
use omni_engine::gguf::Value;
use omni_engine::sampling::greedy;
use omni_engine::{Batch, Engine, EngineError, ModelFile};

/// Teacher-forced logits (one batch of 24 tokens), then both greedy runs,
/// of `tiny-qwen3moe-{quant}.gguf` split as `split`, against its reference.
fn check_qwen3moe(quant: &str, split: Option<&[u32]>) {
    check_synthetic("qwen3moe", quant, split);
}

/// Teacher-forced logits (one batch of 24 tokens), then both greedy runs,
/// of `tiny-{model}-{quant}.gguf` split as `split`, against its reference.
/// Returns the teacher-forced logits and the greedy ids of both prompts.
fn check_synthetic(
    model: &str,
    quant: &str,
    split: Option<&[u32]>,
) -> (Vec<Vec<f32>>, Vec<Vec<u32>>) {
    let name = format!("tiny-{model}-{quant}");
    let fx = json(&format!("synthetic/ref_{name}.json"));
    let tol = logit_tolerance(quant);
    let mut engine =
        Engine::load(synthetic(&format!("{name}.gguf")), split, config()).expect("model loads");
    assert_eq!(engine.stages().len(), split.map_or(1, |s| s.len()));
    let mut failures = Vec::new();

    // Teacher forcing: every position's full logits in one batch.
    let tf = &fx["teacher_forced"];
    let input = ids(&tf["input_ids"]);
    let (shape, want) = read_npy_f32(&synthetic(&format!("tf_logits_{name}.npy")));
    assert_eq!(shape, [input.len(), 512]);
    let got = engine.logits_all(0, &input).unwrap();
    assert_eq!(got.len(), input.len());
    let tf_logits = got.clone();
    let mut greedy_ids = Vec::new();
    let mut tf_max = 0.0f32;
    let mut argmax_equal = 0;
    for (i, row) in got.iter().enumerate() {
        let want_row = &want[i * 512..(i + 1) * 512];
        let d = row
            .iter()
            .zip(want_row)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        tf_max = tf_max.max(d);
        if d > tol {
            failures.push(format!(
                "teacher-forced position {i}: max |logit diff| {d} > {tol}"
            ));
        }
        argmax_equal += usize::from(greedy(row) == greedy(want_row));
    }
    engine.remove_seq(0);

    // Greedy: exact ids for all 32 steps, top-5 logits within tolerance.
    // That holds on the fixtures' kernels. On others a quantized file's
    // logits drift, and a tiny random MoE turns a small drift into another
    // expert choice (a jump of about 2 logits at one step). There llama.cpp
    // built from the source we link, on this machine with the same kernels,
    // is the reference: the same ids and logits within 0.01 at every step;
    // the fixture's top-5 are still checked at the README's tolerance for
    // as long as that llama.cpp agrees with them.
    let here = !fixture_kernels() && quant != "f32";
    let path = synthetic(&format!("{name}.gguf"));
    let mut greedy_report = Vec::new();
    for (gi, gen) in fx["generations"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&gen["prompt_ids"]);
        let text = gen["text"].as_str().unwrap();
        let ours = engine.tokenize_prompt(text, false).unwrap();
        if ours != prompt {
            failures.push(format!("prompt {gi}: tokenization {ours:?} vs {prompt:?}"));
        }
        assert!(!gen["near_tie"].as_bool().unwrap());
        let want_ids = ids(&gen["generated_ids"]);
        let steps = gen["steps"].as_array().unwrap();
        engine.remove_seq(0);
        let mut logits = engine.prefill(0, &prompt, 0).unwrap();
        let (mut matched, mut top5_max) = (0, 0.0f32);
        let mut ours_ids = Vec::new();
        let local = if here {
            omni_engine::llama_cpp_greedy(&path, &prompt, steps.len(), 2).unwrap()
        } else {
            Vec::new()
        };
        // The step at which this machine's llama.cpp leaves the fixture.
        let mut drifted: Option<usize> = None;
        for (i, step) in steps.iter().enumerate() {
            let mut want_tok = want_ids[i];
            if let Some((tok, ref_logits)) = local.get(i) {
                let d = logits
                    .iter()
                    .zip(ref_logits)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                if d >= 0.01 {
                    failures.push(format!(
                        "prompt {gi} step {i}: logits differ from this machine's llama.cpp by {d}"
                    ));
                }
                let away = step["top5"].as_array().unwrap().iter().any(|pair| {
                    let tid = pair[0].as_u64().unwrap() as usize;
                    (ref_logits[tid] - pair[1].as_f64().unwrap() as f32).abs() > tol
                });
                if drifted.is_none() && (away || *tok != want_ids[i]) {
                    drifted = Some(i);
                }
                want_tok = *tok;
            }
            for pair in step["top5"].as_array().unwrap() {
                if drifted.is_some() {
                    break;
                }
                let (tid, v) = (
                    pair[0].as_u64().unwrap() as usize,
                    pair[1].as_f64().unwrap() as f32,
                );
                let d = (logits[tid] - v).abs();
                top5_max = top5_max.max(d);
                if d > tol {
                    failures.push(format!(
                        "prompt {gi} step {i}: logit of {tid} is {} but llama.cpp has {v}",
                        logits[tid]
                    ));
                }
            }
            let tok = greedy(&logits);
            if tok != want_tok {
                failures.push(format!(
                    "prompt {gi} step {i}: greedy token {tok} but llama.cpp chose {want_tok}"
                ));
                break;
            }
            matched = i + 1;
            ours_ids.push(tok);
            if i + 1 < steps.len() {
                let mut b = Batch::default();
                b.push(tok, (prompt.len() + i) as i32, 0, true);
                logits = engine.step(&b).unwrap().row(0).to_vec();
            }
        }
        greedy_ids.push(ours_ids);
        greedy_report.push(format!(
            "prompt {gi}: {matched}/{} ids equal, top-5 max |diff| {top5_max:.2e}{}",
            steps.len(),
            match (here, drifted) {
                (false, _) => String::new(),
                (true, None) => " (this machine's llama.cpp too)".into(),
                (true, Some(d)) =>
                    format!(" (to this machine's llama.cpp; it leaves the fixture at step {d})"),
            }
        ));
    }
    eprintln!(
        "{name} split {split:?}: teacher-forced max |logit diff| {tf_max:.2e} over {} positions (argmax equal {argmax_equal}/{}); {}",
        input.len(),
        input.len(),
        greedy_report.join("; ")
    );
    assert!(
        failures.is_empty(),
        "{name} split {split:?}: {} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
    (tf_logits, greedy_ids)
}

mod deepseek2;
mod derived;
mod qwen3moe;
