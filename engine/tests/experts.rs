//! Routed experts offloaded from their stages to an in-process
//! `ExpertStage`, on the synthetic MoE fixtures (qwen3moe, deepseek2 in both
//! layouts; F32, Q8_0, Q4_K_M): all MoE layers offloaded, only some, and
//! split into two stages each with its own expert stage. Each must give the
//! fixture's teacher-forced logits within tolerance, its greedy ids
//! exactly, and the same logits bit for bit as the stages that hold their
//! experts (same ggml nodes in the same order). Bad inputs are errors, and
//! the weight bytes move exactly.
//!
//! Some experts of the offloaded layers kept on the stage after all
//! (`set_device_experts`: the hot ones, a fixed pair, all of them): still
//! the fixture's greedy ids and logits within tolerance, and the executor
//! gets exactly the selections of the other experts (none at all when the
//! stage keeps every expert). The routing counts add up to the tokens each
//! block computed.

mod common;

use std::collections::BTreeMap;
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

/// An expert stage behind a counter of what reaches it. It also checks
/// that no expert the stage keeps (`device`) is ever sent, that every
/// token sent has work here, and that a token's ids are distinct (ggml's
/// repacked `mul_mat_id` computes wrong sums otherwise).
struct Counting {
    inner: ExpertStage,
    device: BTreeMap<u32, Vec<u32>>,
    submits: usize,
    /// Tokens sent.
    rows: usize,
    /// (token, expert) pairs sent with a weight (the rest are weight-0
    /// stand-ins that fill a token's row).
    pairs: usize,
    /// Bytes of the batches as f32 inputs, i32 ids and f32 weights.
    bytes: usize,
}

impl Counting {
    fn new(inner: ExpertStage) -> Counting {
        Counting {
            inner,
            device: BTreeMap::new(),
            submits: 0,
            rows: 0,
            pairs: 0,
            bytes: 0,
        }
    }
}

impl ExpertExec for Counting {
    fn submit(&mut self, b: ExpertBatch) -> Result<(), EngineError> {
        let width = b.ids.len() / b.n_tokens;
        let kept = self.device.get(&b.layer).map_or(&[][..], |v| &v[..]);
        for (row, w) in b.ids.chunks_exact(width).zip(b.weights.chunks_exact(width)) {
            assert!(
                !row.iter().any(|&id| kept.contains(&(id as u32))),
                "layer {}: experts kept on the stage were sent: {row:?} (kept {kept:?})",
                b.layer
            );
            let mut distinct = row.to_vec();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(distinct.len(), width, "layer {}: {row:?}", b.layer);
            let n = w.iter().filter(|&&w| w != 0.0).count();
            assert!(n > 0, "layer {}: a token with no work was sent", b.layer);
            self.pairs += n;
        }
        self.submits += 1;
        self.rows += b.n_tokens;
        self.bytes += 4 * (b.x.len() + b.ids.len() + b.weights.len());
        self.inner.submit(b)
    }
    fn wait(&mut self) -> Result<Vec<f32>, EngineError> {
        self.inner.wait()
    }
}

/// A chain of stages, each with the expert stage of its offloaded layers.
struct Chain {
    stages: Vec<(Stage, Option<Counting>)>,
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
                let experts = (!off.is_empty()).then(|| {
                    Counting::new(ExpertStage::load(m.clone(), &off, expert_config()).unwrap())
                });
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

    /// Keeps `experts(layer)` of every offloaded layer on its stage.
    fn keep(&mut self, experts: &ExpertsOf<'_>) {
        for (stage, exec) in &mut self.stages {
            let exec = exec.as_mut().unwrap();
            for il in stage.offloaded_layers().to_vec() {
                let set = experts(il);
                stage.set_device_experts(il, &set).unwrap();
                exec.device.insert(il, set);
            }
        }
    }

    /// (submits, rows, pairs, bytes) that reached the executors.
    fn sent(&self) -> (usize, usize, usize, usize) {
        self.stages
            .iter()
            .filter_map(|(_, e)| e.as_ref())
            .fold((0, 0, 0, 0), |(s, r, p, b), e| {
                (s + e.submits, r + e.rows, p + e.pairs, b + e.bytes)
            })
    }

    /// Every offloaded layer's routing counts.
    fn counts(&self) -> BTreeMap<u32, Vec<u64>> {
        self.stages
            .iter()
            .flat_map(|(s, _)| s.expert_counts().clone())
            .collect()
    }

    /// The teacher-forced logits of `tokens` in one batch.
    fn teacher_forced(&mut self, tokens: &[u32]) -> Vec<Vec<f32>> {
        self.clear();
        let mut b = Batch::default();
        for (i, &t) in tokens.iter().enumerate() {
            b.push(t, i as i32, 0, true);
        }
        self.step(&b)
    }

    fn clear(&mut self) {
        for (s, _) in &mut self.stages {
            s.remove_seq(0, None);
        }
    }

    /// Teacher-forced logits of `tokens` (one batch), then the greedy ids
    /// of each prompt (`n` steps), with every step's logits.
    fn run(&mut self, tokens: &[u32], prompts: &[Vec<u32>], n: usize) -> Run {
        let tf = self.teacher_forced(tokens);
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

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// A synthetic file's reference: the teacher-forced tokens and logits,
/// the greedy prompts and ids, and the logit tolerance (fixtures README).
struct Fixture {
    tokens: Vec<u32>,
    want_tf: Vec<f32>,
    prompts: Vec<Vec<u32>>,
    want_ids: Vec<Vec<u32>>,
    n_gen: usize,
    tol: f32,
}

fn fixture(name: &str) -> Fixture {
    let fx = json(&format!("synthetic/ref_{name}.json"));
    let gens = fx["generations"].as_array().unwrap();
    let path = synthetic(&format!("{name}.gguf"));
    let want_ids: Vec<Vec<u32>> = gens
        .iter()
        .map(|g| greedy_ids_here(&path, &ids(&g["prompt_ids"]), ids(&g["generated_ids"])))
        .collect();
    Fixture {
        tokens: ids(&fx["teacher_forced"]["input_ids"]),
        want_tf: read_npy_f32(&fixtures_dir().join(format!("synthetic/tf_logits_{name}.npy"))).1,
        prompts: gens.iter().map(|g| ids(&g["prompt_ids"])).collect(),
        n_gen: want_ids[0].len(),
        want_ids,
        tol: logit_tolerance(name),
    }
}

/// Max |diff| of teacher-forced logits against the fixture's.
fn tf_vs_fixture(got: &[Vec<f32>], fx: &Fixture) -> f32 {
    assert_eq!(got.len() * got[0].len(), fx.want_tf.len());
    got.iter()
        .flatten()
        .zip(&fx.want_tf)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max)
}

/// Every fixture, offloaded three ways, against the fixture and against
/// the same stages holding their experts.
fn check(name: &str) {
    let m = open(name);
    let Fixture {
        tokens,
        want_tf,
        prompts,
        want_ids,
        n_gen,
        tol,
    } = fixture(name);
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

    // Through the executor interface: wait without submit, a third submit
    // while two wait (an overlapped step's two groups), answers in order.
    assert!(ex.wait().unwrap_err().to_string().contains("without"));
    let b = ExpertBatch {
        layer: 3,
        n_tokens: 2,
        x: x.clone(),
        ids: ids.clone(),
        weights: w.clone(),
        invariant: false,
    };
    ex.submit(b.clone()).unwrap();
    ex.submit(ExpertBatch {
        n_tokens: 1,
        x: x[..e].to_vec(),
        ids: ids[..ids.len() / 2].to_vec(),
        weights: w[..w.len() / 2].to_vec(),
        ..b.clone()
    })
    .unwrap();
    let third = ex.submit(b.clone()).unwrap_err().to_string();
    assert!(third.contains("2 batches not yet waited for"), "{third}");
    assert_eq!(ex.wait().unwrap().len(), 2 * e);
    assert_eq!(ex.wait().unwrap().len(), e);
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

/// Which experts of a layer to keep on the stage.
type ExpertsOf<'a> = dyn Fn(u32) -> Vec<u32> + 'a;

/// Every fixture with all MoE layers offloaded, then with some of their
/// experts kept on the stage: the hot ones of a first run, a fixed pair,
/// all of them.
fn check_device_experts(name: &str) {
    let m = open(name);
    let fx = fixture(name);
    let (n_layer, moe_p) = (m.hparams.n_layer, m.hparams.moe.clone().unwrap());
    let (n_expert, n_used) = (moe_p.n_expert, moe_p.n_expert_used as usize);
    let moe = moe_layers(&m);

    // All remote: the routing counts are the tokens each block computed
    // times n_used (the last layer computes only the rows whose logits
    // are wanted), and the executor gets every one of those selections.
    let mut base_chain = Chain::load(&m, &[n_layer], &|_| true);
    let base = base_chain.run(&fx.tokens, &fx.prompts, fx.n_gen);
    let counts = base_chain.counts();
    assert_eq!(counts.keys().copied().collect::<Vec<_>>(), moe, "{name}");
    let mut computed = 0;
    for (&il, c) in &counts {
        assert_eq!(c.len(), n_expert as usize);
        let per_prompt = |p: &Vec<u32>| if il + 1 == n_layer { 1 } else { p.len() };
        let tokens = fx.tokens.len()
            + fx.prompts
                .iter()
                .map(|p| per_prompt(p) + fx.n_gen - 1)
                .sum::<usize>();
        assert_eq!(
            c.iter().sum::<u64>(),
            (tokens * n_used) as u64,
            "{name} layer {il}: {c:?}"
        );
        computed += tokens;
    }
    let (b_submits, b_rows, b_pairs, b_bytes) = base_chain.sent();
    assert_eq!((b_rows, b_pairs), (computed, computed * n_used), "{name}");

    // hot_experts: the k best counts, ties to the lower id, ascending.
    let stage = &base_chain.stages[0].0;
    for (&il, c) in &counts {
        for k in [0, 1, n_used, n_expert as usize, n_expert as usize + 3] {
            let hot = stage.hot_experts(il, k);
            assert_eq!(hot.len(), k.min(n_expert as usize), "{name} {il} {k}");
            assert!(hot.windows(2).all(|w| w[0] < w[1]), "{hot:?}");
            for out in (0..n_expert).filter(|e| !hot.contains(e)) {
                for &h in &hot {
                    let (ch, co) = (c[h as usize], c[out as usize]);
                    assert!(
                        ch > co || (ch == co && h < out),
                        "{name} layer {il} k={k}: {h} ({ch}) is hot but {out} ({co}) is not"
                    );
                }
            }
        }
    }
    assert!(stage.hot_experts(n_layer, 4).is_empty());
    let hot: BTreeMap<u32, Vec<u32>> = moe
        .iter()
        .map(|&il| (il, stage.hot_experts(il, n_used)))
        .collect();

    let cases: [(&str, &ExpertsOf<'_>); 3] = [
        ("hot", &|il| hot[&il].clone()),
        ("[0, 3]", &|_| vec![3, 0]),
        ("all", &|_| (0..n_expert).rev().collect()),
    ];
    for (what, set) in cases {
        let mut chain = Chain::load(&m, &[n_layer], &|_| true);
        chain.keep(set);
        let st = &chain.stages[0].0;
        let mut want_bytes = 0;
        for &il in &moe {
            let mut s = set(il);
            s.sort_unstable();
            assert_eq!(st.device_experts(il), &s[..], "{name} {what}");
            // Whole expert slices of the three tensors.
            want_bytes += expert_bytes(&m, &[il]) / n_expert as u64 * s.len() as u64;
        }
        assert_eq!(st.device_expert_bytes(), want_bytes, "{name} {what}");

        let got = chain.run(&fx.tokens, &fx.prompts, fx.n_gen);
        let (submits, rows, pairs, bytes) = chain.sent();
        let counts = chain.counts();
        // The executor got exactly the selections of experts not kept here.
        let elsewhere: u64 = counts
            .iter()
            .map(|(&il, c)| {
                let kept = set(il);
                (0..n_expert)
                    .filter(|e| !kept.contains(e))
                    .map(|e| c[e as usize])
                    .sum::<u64>()
            })
            .sum();
        let d_fixture = tf_vs_fixture(&got.tf, &fx);
        let (d_tf, d_steps) = (
            max_diff(&got.tf, &base.tf),
            max_diff(&got.steps, &base.steps),
        );
        eprintln!(
            "{name} device experts {what}: sent {submits} batches, {rows} rows, {pairs} (token, expert) pairs, {bytes} bytes (all remote: {b_submits}, {b_rows}, {b_pairs}, {b_bytes}); {want_bytes} weight bytes kept; vs fixture teacher-forced {d_fixture:.2e}; vs all remote: teacher-forced {d_tf:.2e}, greedy steps {d_steps:.2e}; greedy ids {}",
            if got.ids == fx.want_ids { "equal" } else { "DIFFER" }
        );
        assert_eq!(pairs as u64, elsewhere, "{name} {what}");
        assert!(
            d_fixture <= fx.tol,
            "{name} {what}: {d_fixture} > {}",
            fx.tol
        );
        assert!(
            d_tf <= fx.tol && d_steps <= fx.tol,
            "{name} {what}: {d_tf} {d_steps}"
        );
        assert_eq!(got.ids, fx.want_ids, "{name} {what}: greedy ids");
        if what == "all" {
            assert_eq!(
                (submits, rows, pairs),
                (0, 0, 0),
                "{name}: nothing is elsewhere"
            );
            assert_eq!(bytes, 0);
        } else {
            // Fewer selections always; fewer tokens only where some
            // token's experts are all kept (likely with K = 4 hot ones of
            // 16, not with 2 fixed ones).
            assert!(
                pairs < b_pairs && rows <= b_rows && submits <= b_submits && bytes < b_bytes,
                "{name} {what}: sent {rows} rows, {pairs} pairs, {bytes} bytes"
            );
        }

        // Given back, the stage sends everything again, as before.
        for il in moe.clone() {
            chain.stages[0].0.set_device_experts(il, &[]).unwrap();
            chain.stages[0].1.as_mut().unwrap().device.clear();
            assert!(chain.stages[0].0.device_experts(il).is_empty());
        }
        assert_eq!(chain.stages[0].0.device_expert_bytes(), 0);
        assert_eq!(chain.teacher_forced(&fx.tokens), base.tf, "{name} {what}");
    }
}

#[test]
fn qwen3moe_device_experts_match() {
    for f in &FILES[..3] {
        check_device_experts(f);
    }
}

#[test]
fn deepseek2_mla_device_experts_match() {
    for f in &FILES[3..6] {
        check_device_experts(f);
    }
}

#[test]
fn deepseek2_legacy_device_experts_match() {
    for f in &FILES[6..] {
        check_device_experts(f);
    }
}

#[test]
fn bad_device_experts_are_errors() {
    let m = open("tiny-deepseek2-mla-q4_k_m");
    let r = LayerRange::split(4, &[2, 2]).unwrap();
    let mut st = Stage::load_offloaded(m.clone(), r[0].clone(), config(), &[1]).unwrap();
    let err = |r: Result<(), EngineError>| r.unwrap_err().to_string();
    // Layer 0 is dense, layer 3 is on another stage, layer 9 is not in the model.
    for il in [0, 3, 9] {
        let msg = err(st.set_device_experts(il, &[1]));
        assert!(
            msg.contains(&format!("layer {il}'s routed experts are not offloaded"))
                && msg.contains("[1]"),
            "{msg}"
        );
    }
    let msg = err(st.set_device_experts(1, &[2, 16]));
    assert!(
        msg.contains("expert id 16") && msg.contains("16 experts"),
        "{msg}"
    );
    let msg = err(st.set_device_experts(1, &[3, 1, 3]));
    assert!(msg.contains("expert 3 is listed twice"), "{msg}");
    assert!(st.device_experts(1).is_empty());
    assert_eq!(st.device_expert_bytes(), 0);
    // A bad list leaves the good one in place.
    st.set_device_experts(1, &[7, 2]).unwrap();
    let bytes = st.device_expert_bytes();
    assert_eq!(bytes, expert_bytes(&m, &[1]) / 8);
    err(st.set_device_experts(1, &[2, 2]));
    assert_eq!(st.device_experts(1), &[2, 7]);
    assert_eq!(st.device_expert_bytes(), bytes);
    // And a step still runs with it.
    let mut ex = Counting::new(ExpertStage::load(m.clone(), &[1], expert_config()).unwrap());
    ex.device.insert(1, vec![2, 7]);
    let mut b = Batch::default();
    b.push(5, 0, 0, true);
    st.forward_with(&b, None, &mut ex).unwrap();
    assert_eq!(st.expert_counts()[&1].iter().sum::<u64>(), 4);
}

/// A batch cut down by a stage that keeps some experts has fewer ids per
/// token (the same number for each); the sum is that of the full row with
/// the missing experts at weight 0, bit for bit.
#[test]
fn expert_batches_may_be_narrower() {
    let m = open("tiny-deepseek2-mla-q4_k_m");
    let e = m.hparams.n_embd as usize;
    let mut ex = ExpertStage::load(m.clone(), &[1], expert_config()).unwrap();
    let x: Vec<f32> = (0..3 * e)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 60.0)
        .collect();
    let full_ids = [3, 7, 1, 12, 0, 5, 9, 2, 15, 14, 4, 6];
    let full_w = [0.4, 0.3, 0.0, 0.0, 0.6, 0.2, 0.0, 0.0, 0.5, 0.1, 0.0, 0.0];
    let narrow_ids = [3, 7, 0, 5, 15, 14];
    let narrow_w = [0.4, 0.3, 0.6, 0.2, 0.5, 0.1];
    let full = ex.run(1, &x, &full_ids, &full_w).unwrap();
    let narrow = ex.run(1, &x, &narrow_ids, &narrow_w).unwrap();
    assert_eq!(narrow, full);
    let err = |r: Result<Vec<f32>, EngineError>| r.unwrap_err().to_string();
    // Uneven, or wider than n_used.
    let msg = err(ex.run(1, &x, &narrow_ids[..5], &narrow_w[..5]));
    assert!(msg.contains("12 ids and weights, got 5 ids"), "{msg}");
    let msg = err(ex.run(1, &x, &[1; 15], &[0.1; 15]));
    assert!(msg.contains("got 15 ids and 15 weights"), "{msg}");
}

/// A step that wants no logits (a prompt chunk alone in its step, or a
/// prefix replayed after a recovery) runs on a head stage, offloaded
/// experts or not, and returns no rows; the next step's logits are those of
/// the same tokens fed with logits wanted. (Such a step used to build a
/// graph whose last layer kept no rows, and a worker died of SIGFPE.)
#[test]
fn a_step_that_wants_no_logits_returns_none_and_changes_nothing() {
    for name in ["tiny-deepseek2-mla-q8_0", "tiny-qwen3moe-q8_0"] {
        let m = open(name);
        for offload in [false, true] {
            let mut quiet = Chain::load(&m, &[2, 2], &|_| offload);
            let mut loud = Chain::load(&m, &[2, 2], &|_| offload);
            let prompt = [1u32, 17, 42, 99, 5, 8];
            let mut b = Batch::default();
            for (i, &t) in prompt.iter().enumerate() {
                b.push(t, i as i32, 0, false);
            }
            assert!(quiet.step(&b).is_empty(), "{name}: rows without logits");
            b.logits = vec![true; prompt.len()];
            loud.step(&b);
            let mut next = Batch::default();
            next.push(7, prompt.len() as i32, 0, true);
            let (a, c) = (quiet.step(&next), loud.step(&next));
            assert_eq!(a, c, "{name} (offloaded {offload}): the next step differs");
        }
    }
}

/// An expert stage keeps each call shape's graph and computes it again for
/// the next call of that shape: calls that come round the layers and sizes
/// (as a decode step's do, and an overlapped step's two groups) give, bit
/// for bit, what a stage computing each call first of all gives.
#[test]
fn kept_graphs_compute_what_fresh_ones_do() {
    let m = open("tiny-deepseek2-mla-q4_k_m");
    let e = m.hparams.n_embd as usize;
    let moe = m.hparams.moe.as_ref().unwrap();
    let (n_used, n_expert) = (moe.n_expert_used as usize, moe.n_expert as usize);
    let layers = moe_layers(&m);
    let mut kept = ExpertStage::load(m.clone(), &layers, expert_config()).unwrap();
    // (layer, tokens, experts per token), round and round.
    let calls: Vec<(u32, usize, usize)> = (0..24)
        .map(|i| {
            let k = [n_used, n_used, n_used / 2][i / 8 % 3];
            (layers[i % layers.len()], 1 + i % 3, k)
        })
        .collect();
    for (i, &(layer, n, k)) in calls.iter().enumerate() {
        let x: Vec<f32> = (0..n * e)
            .map(|j| (((i * 31 + j * 17) % 97) as f32 - 48.0) / 50.0)
            .collect();
        // Distinct ids within each token, as the stage sends them.
        let ids: Vec<i32> = (0..n)
            .flat_map(|t| (0..k).map(move |u| ((t + i + u * 3) % n_expert) as i32))
            .collect();
        let w: Vec<f32> = (0..n * k).map(|j| 0.1 + (j % 5) as f32 * 0.05).collect();
        let got = kept.run(layer, &x, &ids, &w).unwrap();
        let mut fresh = ExpertStage::load(m.clone(), &layers, expert_config()).unwrap();
        let want = fresh.run(layer, &x, &ids, &w).unwrap();
        assert!(
            got == want,
            "call {i} (layer {layer}, {n} tokens, {k} experts each) differs from a fresh graph's"
        );
    }
}
