//! Routed experts offloaded from their stages to an in-process
//! `ExpertStage`, on the synthetic MoE fixtures (qwen3moe, deepseek2 in both
//! layouts; F32, Q8_0, Q4_K_M): all MoE layers offloaded, only some, and
//! split into two stages each with its own expert stage. Each must give the
//! fixture's teacher-forced logits within tolerance, its greedy ids
//! exactly, and the same logits bit for bit as the stages that hold their
//! experts (same ggml nodes in the same order). Bad inputs are errors, and
//! the weight bytes move exactly.

mod common;

use std::sync::Arc;

use common::*;
use omni_engine::sampling::greedy;
use omni_engine::{
    Batch, EngineError, ExpertBatch, ExpertConfig, ExpertExec, ExpertStage, Hidden, LayerRange,
    ModelFile, Stage, StageOutput,
};

const FILES: [&str; 9] = [
    "tiny-qwen3moe-f32",
    "tiny-qwen3moe-q8_0",
    "tiny-qwen3moe-q4_k_m",
    "tiny-deepseek2-mla-f32",
    "tiny-deepseek2-mla-q8_0",
    "tiny-deepseek2-mla-q4_k_m",
    "tiny-deepseek2-legacy-f32",
    "tiny-deepseek2-legacy-q8_0",
    "tiny-deepseek2-legacy-q4_k_m",
];

fn expert_config() -> ExpertConfig {
    ExpertConfig {
        n_ubatch: 512,
        n_threads: 2,
        repack: true,
    }
}

fn open(name: &str) -> Arc<ModelFile> {
    ModelFile::open(fixtures_dir().join(format!("synthetic/{name}.gguf"))).unwrap()
}

/// Layers with routed experts (deepseek2's first block is dense).
fn moe_layers(m: &ModelFile) -> Vec<u32> {
    (0..m.hparams.n_layer)
        .filter(|&il| {
            m.gguf
                .tensor(&format!("blk.{il}.ffn_up_exps.weight"))
                .is_some()
        })
        .collect()
}

/// Bytes of the routed-expert tensors of `layers`.
fn expert_bytes(m: &ModelFile, layers: &[u32]) -> u64 {
    layers
        .iter()
        .flat_map(|il| ["gate", "up", "down"].map(|k| format!("blk.{il}.ffn_{k}_exps.weight")))
        .map(|n| m.gguf.tensor(&n).unwrap().size)
        .sum()
}

/// A chain of stages, each with the expert stage of its offloaded layers.
struct Chain {
    stages: Vec<(Stage, Option<ExpertStage>)>,
}

impl Chain {
    /// `split` layer counts; `offload` picks the offloaded layers.
    fn load(m: &Arc<ModelFile>, split: &[u32], offload: &dyn Fn(u32) -> bool) -> Chain {
        let moe = moe_layers(m);
        let stages = LayerRange::split(m.hparams.n_layer, split)
            .unwrap()
            .into_iter()
            .map(|r| {
                let off: Vec<u32> = moe
                    .iter()
                    .copied()
                    .filter(|&il| r.layers.contains(&il) && offload(il))
                    .collect();
                let stage = Stage::load_offloaded(m.clone(), r, config(), &off).unwrap();
                let experts = (!off.is_empty())
                    .then(|| ExpertStage::load(m.clone(), &off, expert_config()).unwrap());
                (stage, experts)
            })
            .collect();
        Chain { stages }
    }

    fn step(&mut self, b: &Batch) -> Vec<Vec<f32>> {
        let mut hidden: Option<Hidden> = None;
        for (stage, experts) in &mut self.stages {
            let out = match experts {
                Some(e) => stage.forward_with(b, hidden.as_ref(), e),
                None => stage.forward(b, hidden.as_ref()),
            }
            .unwrap();
            match out {
                StageOutput::Hidden(h) => hidden = Some(h),
                StageOutput::Logits(l) => {
                    return (0..l.rows.len()).map(|i| l.row(i).to_vec()).collect()
                }
            }
        }
        panic!("no head")
    }

    fn clear(&mut self) {
        for (s, _) in &mut self.stages {
            s.remove_seq(0, None);
        }
    }

    /// Teacher-forced logits of `tokens` (one batch), then the greedy ids
    /// of each prompt (`n` steps), with every step's logits.
    fn run(&mut self, tokens: &[u32], prompts: &[Vec<u32>], n: usize) -> Run {
        self.clear();
        let mut b = Batch::default();
        for (i, &t) in tokens.iter().enumerate() {
            b.push(t, i as i32, 0, true);
        }
        let tf = self.step(&b);
        let mut ids = Vec::new();
        let mut steps = Vec::new();
        for p in prompts {
            self.clear();
            let mut b = Batch::default();
            for (i, &t) in p.iter().enumerate() {
                b.push(t, i as i32, 0, i + 1 == p.len());
            }
            let mut logits = self.step(&b).remove(0);
            let mut got = Vec::new();
            for i in 0..n {
                let t = greedy(&logits);
                got.push(t);
                steps.push(logits.clone());
                if i + 1 < n {
                    let mut b = Batch::default();
                    b.push(t, (p.len() + i) as i32, 0, true);
                    logits = self.step(&b).remove(0);
                }
            }
            ids.push(got);
        }
        Run { tf, ids, steps }
    }
}

struct Run {
    tf: Vec<Vec<f32>>,
    ids: Vec<Vec<u32>>,
    steps: Vec<Vec<f32>>,
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A little-endian float32 C-order `.npy` (as engine/tests/moe.rs reads them).
fn read_npy_f32(path: &std::path::Path) -> Vec<f32> {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..6], b"\x93NUMPY");
    let (hlen, start) = match b[6] {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        _ => (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12),
    };
    let header = std::str::from_utf8(&b[start..start + hlen]).unwrap();
    assert!(header.contains("'descr': '<f4'") && header.contains("'fortran_order': False"));
    b[start + hlen..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Every fixture, offloaded three ways, against the fixture and against
/// the same stages holding their experts.
fn check(name: &str) {
    let m = open(name);
    let fx = json(&format!("synthetic/ref_{name}.json"));
    let tol = if name.ends_with("f32") { 0.05 } else { 0.25 };
    let tokens = ids(&fx["teacher_forced"]["input_ids"]);
    let want_tf = read_npy_f32(&fixtures_dir().join(format!("synthetic/tf_logits_{name}.npy")));
    let gens = fx["generations"].as_array().unwrap();
    let prompts: Vec<Vec<u32>> = gens.iter().map(|g| ids(&g["prompt_ids"])).collect();
    let want_ids: Vec<Vec<u32>> = gens.iter().map(|g| ids(&g["generated_ids"])).collect();
    let n_gen = want_ids[0].len();
    let n_layer = m.hparams.n_layer;
    let moe = moe_layers(&m);
    let some = [moe[0], *moe.last().unwrap()];

    let reference = Chain::load(&m, &[n_layer], &|_| false).run(&tokens, &prompts, n_gen);
    let reference_split = Chain::load(&m, &[2, 2], &|_| false).run(&tokens, &prompts, n_gen);
    let cases: [(&str, Chain, &Run); 3] = [
        (
            "all offloaded",
            Chain::load(&m, &[n_layer], &|_| true),
            &reference,
        ),
        (
            "some offloaded",
            Chain::load(&m, &[n_layer], &|il| some.contains(&il)),
            &reference,
        ),
        (
            "split 2+2, all offloaded",
            Chain::load(&m, &[2, 2], &|_| true),
            &reference_split,
        ),
    ];
    for (what, mut chain, base) in cases {
        let got = chain.run(&tokens, &prompts, n_gen);
        assert_eq!(got.tf.len(), tokens.len());
        assert_eq!(got.tf.len() * got.tf[0].len(), want_tf.len());
        assert_eq!(got.steps.len(), prompts.len() * n_gen);
        let tf_fixture = got
            .tf
            .iter()
            .flatten()
            .zip(&want_tf)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let d_tf = max_diff(&got.tf, &base.tf);
        let d_steps = max_diff(&got.steps, &base.steps);
        eprintln!(
            "{name} {what}: vs fixture teacher-forced max |diff| {tf_fixture:.2e}; vs experts in the stage: teacher-forced {d_tf:.2e}, greedy steps {d_steps:.2e}; greedy ids {}",
            if got.ids == want_ids { "equal" } else { "DIFFER" }
        );
        assert!(tf_fixture <= tol, "{name} {what}: {tf_fixture} > {tol}");
        assert_eq!(got.ids, want_ids, "{name} {what}: greedy ids");
        assert_eq!(
            d_tf, 0.0,
            "{name} {what}: not bit-identical (teacher-forced)"
        );
        assert_eq!(d_steps, 0.0, "{name} {what}: not bit-identical (greedy)");
    }
}

#[test]
fn qwen3moe_offloaded_experts_match() {
    for f in &FILES[..3] {
        check(f);
    }
}

#[test]
fn deepseek2_mla_offloaded_experts_match() {
    for f in &FILES[3..6] {
        check(f);
    }
}

#[test]
fn deepseek2_legacy_offloaded_experts_match() {
    for f in &FILES[6..] {
        check(f);
    }
}

/// The offloaded stage is lighter by exactly the expert tensors, which the
/// expert stage holds, repacked as the stage would have repacked them.
#[test]
fn weight_bytes_move_to_the_expert_stage() {
    for name in FILES {
        let m = open(name);
        let n_layer = m.hparams.n_layer;
        let moe = moe_layers(&m);
        let full = Stage::load(m.clone(), LayerRange::whole(n_layer), config()).unwrap();
        let bytes = |s: &Stage| s.weights().mapped_bytes + s.weights().repacked_bytes;
        for off in [moe.clone(), vec![moe[1]]] {
            let st = Stage::load_offloaded(m.clone(), LayerRange::whole(n_layer), config(), &off)
                .unwrap();
            assert_eq!(st.offloaded_layers(), &off[..]);
            assert_eq!(
                bytes(&st) + expert_bytes(&m, &off),
                bytes(&full),
                "{name} {off:?}"
            );
            let ex = ExpertStage::load(m.clone(), &off, expert_config()).unwrap();
            assert_eq!(ex.weight_bytes(), expert_bytes(&m, &off), "{name}");
            assert!(ex.compute_bytes() > 0);
            for il in &off {
                for k in ["gate", "up", "down"] {
                    let t = format!("blk.{il}.ffn_{k}_exps.weight");
                    assert_eq!(st.weights().is_repacked(&t), None, "{t}");
                    assert_eq!(
                        ex.weights().is_repacked(&t),
                        full.weights().is_repacked(&t),
                        "{name} {t}"
                    );
                }
                // The router and its bias stay on the stage.
                let r = format!("blk.{il}.ffn_gate_inp.weight");
                assert!(st.weights().is_repacked(&r).is_some(), "{r}");
            }
        }
    }
}

#[test]
fn bad_expert_inputs_are_errors() {
    let m = open("tiny-deepseek2-mla-q4_k_m");
    let e = m.hparams.n_embd as usize;
    let n_used = m.hparams.moe.as_ref().unwrap().n_expert_used as usize;
    let cfg = ExpertConfig {
        n_ubatch: 8,
        ..expert_config()
    };
    let mut ex = ExpertStage::load(m.clone(), &[2, 3], cfg).unwrap();
    let x = vec![0.5f32; 2 * e];
    let ids = vec![0i32, 1, 2, 3, 4, 5, 6, 7];
    let w = vec![0.25f32; 2 * n_used];
    assert_eq!(ex.run(2, &x, &ids, &w).unwrap().len(), 2 * e);
    let err = |r: Result<Vec<f32>, EngineError>| r.unwrap_err().to_string();
    let msg = err(ex.run(1, &x, &ids, &w));
    assert!(msg.contains("layer 1") && msg.contains("[2, 3]"), "{msg}");
    let mut bad_ids = ids.clone();
    bad_ids[5] = 16;
    let msg = err(ex.run(2, &x, &bad_ids, &w));
    assert!(
        msg.contains("expert id 16") && msg.contains("16 experts"),
        "{msg}"
    );
    bad_ids[5] = -1;
    assert!(err(ex.run(2, &x, &bad_ids, &w)).contains("expert id -1"));
    let msg = err(ex.run(2, &x[..e + 1], &ids, &w));
    assert!(msg.contains(&format!("{e}-wide")), "{msg}");
    let msg = err(ex.run(2, &x, &ids[..7], &w));
    assert!(msg.contains("8 ids and weights, got 7 ids"), "{msg}");
    let msg = err(ex.run(2, &x, &ids, &w[..4]));
    assert!(msg.contains("got 8 ids and 4 weights"), "{msg}");
    let big = vec![0.5f32; 9 * e];
    let msg = err(ex.run(2, &big, &[0; 36], &[0.25; 36]));
    assert!(
        msg.contains("9 tokens exceed") && msg.contains("n_ubatch 8"),
        "{msg}"
    );
    assert!(err(ex.run(2, &[], &[], &[])).contains("0 values"));

    // Through the executor interface: wait without submit, double submit.
    assert!(ex.wait().unwrap_err().to_string().contains("without"));
    let b = ExpertBatch {
        layer: 3,
        n_tokens: 2,
        x: x.clone(),
        ids: ids.clone(),
        weights: w.clone(),
    };
    ex.submit(b.clone()).unwrap();
    assert!(ex.submit(b.clone()).is_err());
    assert_eq!(ex.wait().unwrap().len(), 2 * e);
    ex.submit(ExpertBatch { n_tokens: 3, ..b }).unwrap_err();

    // Layers without experts, or outside the model or the stage.
    let msg = ExpertStage::load(m.clone(), &[0], expert_config())
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("layer 0") && msg.contains("no routed experts"),
        "{msg}"
    );
    assert!(ExpertStage::load(m.clone(), &[4], expert_config()).is_err());
    let r = LayerRange::split(4, &[2, 2]).unwrap();
    let msg = Stage::load_offloaded(m.clone(), r[0].clone(), config(), &[3])
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("layer 3"), "{msg}");
    assert!(Stage::load_offloaded(m.clone(), r[0].clone(), config(), &[0]).is_err());

    // A stage with offloaded experts needs an executor, and one that
    // returns the right number of values.
    let mut st = Stage::load_offloaded(m.clone(), r[0].clone(), config(), &[1]).unwrap();
    let mut b = Batch::default();
    b.push(5, 0, 0, true);
    let msg = st.forward(&b, None).unwrap_err().to_string();
    assert!(msg.contains("forward_with"), "{msg}");
    struct Short;
    impl ExpertExec for Short {
        fn submit(&mut self, _: ExpertBatch) -> Result<(), EngineError> {
            Ok(())
        }
        fn wait(&mut self) -> Result<Vec<f32>, EngineError> {
            Ok(vec![0.0; 3])
        }
    }
    let msg = st
        .forward_with(&b, None, &mut Short)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("returned 3 values"), "{msg}");
    // After the failed steps, the stage still runs one with a good executor.
    let mut ex = ExpertStage::load(m.clone(), &[1], expert_config()).unwrap();
    st.forward_with(&b, None, &mut ex).unwrap();
}
