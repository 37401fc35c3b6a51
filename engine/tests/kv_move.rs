//! Moving layers and their KV cache between two stages while sequences are
//! live (`Stage::export_kv`, `Stage::rerange`, `KvCache::import`): two
//! stages decode two sequences, the boundary between them moves at step
//! boundaries (down by two layers, then up past where it started), and the
//! greedy tokens and every step's logits stay bit-identical to one unsplit
//! stage doing the same steps. Real Gemma 3 (sliding-window layers) and
//! Qwen2.5 files, and a synthetic DeepSeek2 MLA file (K only, no V). Then
//! the bad inputs: each is an error that names the problem, and a failed
//! move leaves the stage as it was.

mod common;

use std::sync::Arc;

use common::*;
use omni_engine::sampling::greedy;
use omni_engine::{
    Batch, EngineError, Hidden, KvLayers, LayerRange, Logits, ModelFile, Stage, StageConfig,
    StageOutput,
};

fn config() -> StageConfig {
    let mut cfg = StageConfig::default();
    cfg.kv.n_ctx = 256;
    cfg.kv.n_seq = 2;
    cfg.n_ubatch = 256;
    cfg.n_threads = 2;
    cfg
}

/// Stages in a chain, each handing its hidden state to the next.
struct Chain {
    stages: Vec<Stage>,
}

impl Chain {
    fn load(model: &Arc<ModelFile>, ranges: Vec<LayerRange>) -> Chain {
        Chain {
            stages: ranges
                .into_iter()
                .map(|r| Stage::load(model.clone(), r, config()).unwrap())
                .collect(),
        }
    }

    fn step(&mut self, b: &Batch) -> Logits {
        let mut h: Option<Hidden> = None;
        for s in &mut self.stages {
            match s.forward(b, h.as_ref()).unwrap() {
                // Through bytes, as between processes.
                StageOutput::Hidden(x) => {
                    let bytes = x.to_bytes(omni_engine::HiddenDtype::F32);
                    h = Some(Hidden::from_bytes(&bytes).unwrap());
                }
                StageOutput::Logits(l) => return l,
            }
        }
        panic!("the chain has no head")
    }

    fn remove_seq(&mut self, seq: u32, from: Option<i32>) {
        self.stages.iter_mut().for_each(|s| s.remove_seq(seq, from));
    }

    fn boundary(&self) -> u32 {
        self.stages[0].range().layers.end
    }

    /// Moves the boundary between the two stages to `to` at a step
    /// boundary: the giving side exports the layers' KV cache (through its
    /// byte form), the taking side reranges with it, then the giving side
    /// reranges without those layers.
    fn move_boundary(&mut self, to: u32) {
        let n = self.stages[1].range().layers.end;
        let from = self.boundary();
        let (a, b) = (
            LayerRange {
                embed: true,
                layers: 0..to,
                head: false,
            },
            LayerRange {
                embed: false,
                layers: to..n,
                head: true,
            },
        );
        let (giver, taker, moved) = if to < from {
            (0, 1, to..from)
        } else {
            (1, 0, from..to)
        };
        let kv = self.stages[giver].export_kv(moved.clone()).unwrap();
        assert_eq!(kv.layers.len(), moved.len());
        let kv = KvLayers::from_bytes(&kv.to_bytes()).unwrap();
        let (new_taker, new_giver) = if taker == 0 { (a, b) } else { (b, a) };
        self.stages[taker]
            .rerange(new_taker.clone(), Some(&kv))
            .unwrap();
        self.stages[giver].rerange(new_giver.clone(), None).unwrap();
        assert_eq!(self.stages[taker].range(), &new_taker);
        assert_eq!(self.stages[giver].range(), &new_giver);
        let used: Vec<usize> = self.stages.iter().map(|s| s.kv().used()).collect();
        assert!(
            self.stages[0].range().layers.is_empty() || used[0] == used[1],
            "both stages hold every cell: {used:?}"
        );
    }
}

/// What the two runs do, step by step.
enum Op {
    /// Prefill both sequences' prompts in one batch.
    Prefill,
    /// This many greedy steps for both sequences.
    Decode(usize),
    /// Drop sequence 1 from this many tokens before its end (a hole in the
    /// cell table that later steps fill), and decode it again from there.
    Truncate1(usize),
    /// Move the boundary (the reference ignores it).
    Move(u32),
}

/// Runs `ops` on one unsplit stage and on two stages split at `k`, and
/// checks every logit of every step bit for bit.
fn check_moves(model_path: &std::path::Path, prompts: [Vec<u32>; 2], k: u32, ops: &[Op]) {
    let model = ModelFile::open(model_path).unwrap();
    let n = model.hparams.n_layer;
    let mut whole = Chain::load(&model, vec![LayerRange::whole(n)]);
    let mut split = Chain::load(&model, LayerRange::split(n, &[k, n - k]).unwrap());
    // Each sequence's tokens so far, and its last logits (the same on both
    // sides, checked at every step).
    let mut toks: [Vec<u32>; 2] = prompts.clone();
    let mut last: [Vec<f32>; 2] = [Vec::new(), Vec::new()];
    let run = |b: &Batch, whole: &mut Chain, split: &mut Chain, last: &mut [Vec<f32>; 2]| {
        let (lw, ls) = (whole.step(b), split.step(b));
        assert_eq!(lw.rows, ls.rows);
        for (r, &bi) in lw.rows.iter().enumerate() {
            let (w, s) = (lw.row(r), ls.row(r));
            let differ = w.iter().zip(s).filter(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(
                differ.count(),
                0,
                "sequence {} at position {}: logits differ (boundary at {})",
                b.seq[bi],
                b.pos[bi],
                split.boundary()
            );
            last[b.seq[bi] as usize] = w.to_vec();
        }
    };
    let mut moves = 0;
    for op in ops {
        match *op {
            Op::Prefill => {
                let mut b = Batch::default();
                for (s, p) in prompts.iter().enumerate() {
                    for (i, &t) in p.iter().enumerate() {
                        b.push(t, i as i32, s as u32, i + 1 == p.len());
                    }
                }
                run(&b, &mut whole, &mut split, &mut last);
            }
            Op::Decode(steps) => {
                for _ in 0..steps {
                    let mut b = Batch::default();
                    for s in 0..2 {
                        let t = greedy(&last[s]);
                        b.push(t, toks[s].len() as i32, s as u32, true);
                        toks[s].push(t);
                    }
                    run(&b, &mut whole, &mut split, &mut last);
                }
            }
            Op::Truncate1(back) => {
                // Keep `keep` tokens; the last kept one is dropped too and
                // run again, for the logits the next step samples from.
                let keep = toks[1].len() - back;
                let t = toks[1][keep - 1];
                let from = Some(keep as i32 - 1);
                whole.remove_seq(1, from);
                split.remove_seq(1, from);
                toks[1].truncate(keep);
                let mut b = Batch::default();
                b.push(t, keep as i32 - 1, 1, true);
                run(&b, &mut whole, &mut split, &mut last);
            }
            Op::Move(to) => {
                split.move_boundary(to);
                moves += 1;
            }
        }
    }
    assert!(moves > 0);
    eprintln!(
        "{}: {} + {} tokens bit-identical through {moves} moves, boundary now at {}",
        model_path.display(),
        toks[0].len(),
        toks[1].len(),
        split.boundary()
    );
}

/// Prefill, decode, move `k -> k-2`, decode, punch a hole, move
/// `k-2 -> k+1`, decode.
fn standard_ops(k: u32) -> Vec<Op> {
    vec![
        Op::Prefill,
        Op::Decode(3),
        Op::Move(k - 2),
        Op::Decode(3),
        Op::Truncate1(3),
        Op::Move(k + 1),
        Op::Decode(4),
    ]
}

fn real_prompts(fixture: &str) -> [Vec<u32>; 2] {
    let fx = json(fixture);
    let p = fx["prompts"].as_array().unwrap();
    [ids(&p[0]["prompt_ids"]), ids(&p[1]["prompt_ids"])]
}

#[test]
fn gemma3_layers_move_between_stages_bit_identically() {
    let k = 9; // of 18, global and sliding-window layers on both sides
    check_moves(
        &model(GEMMA),
        real_prompts("real_gemma3_270m.json"),
        k,
        &standard_ops(k),
    );
}

#[test]
fn qwen2_layers_move_between_stages_bit_identically() {
    let k = 12; // of 24
    check_moves(
        &model(QWEN),
        real_prompts("real_qwen2_5_coder_0_5b.json"),
        k,
        &standard_ops(k),
    );
}

fn mla_prompts() -> [Vec<u32>; 2] {
    let input =
        ids(&json("synthetic/ref_tiny-deepseek2-mla-f32.json")["teacher_forced"]["input_ids"]);
    [input[..11].to_vec(), input[11..].to_vec()]
}

#[test]
fn deepseek2_mla_k_only_cache_moves_bit_identically() {
    let path = synthetic("tiny-deepseek2-mla-q8_0.gguf");
    let model = ModelFile::open(&path).unwrap();
    let n = model.hparams.n_layer;
    assert!(n >= 3, "the fixture has {n} layers");
    assert_eq!(
        model.hparams.n_embd_v_cache(),
        0,
        "absorbed MLA caches no V"
    );
    // Down to an embedding-only first stage, then up past the start.
    let k = 2;
    check_moves(&path, mla_prompts(), k, &standard_ops(k));
    // The export carries K only.
    let mut c = Chain::load(&model, LayerRange::split(n, &[k, n - k]).unwrap());
    let mut b = Batch::default();
    mla_prompts()[0]
        .iter()
        .enumerate()
        .for_each(|(i, &t)| b.push(t, i as i32, 0, true));
    c.step(&b);
    let kv = c.stages[1].export_kv(k..n).unwrap();
    assert_eq!(kv.cells.len(), b.len());
    assert!(kv.layers.iter().all(|l| !l.k.is_empty() && l.v.is_empty()));
}

fn err_text<T>(r: Result<T, EngineError>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

fn assert_mentions(msg: &str, want: &str) {
    assert!(msg.contains(want), "error {msg:?} should mention {want:?}");
}

#[test]
fn bad_kv_moves_are_errors_that_name_the_problem() {
    let model = ModelFile::open(model(GEMMA)).unwrap();
    let n = model.hparams.n_layer;
    let k = 9;
    let prompts = real_prompts("real_gemma3_270m.json");
    let ranges = LayerRange::split(n, &[k, n - k]).unwrap();
    let mut split = Chain::load(&model, ranges.clone());
    let mut whole = Chain::load(&model, vec![LayerRange::whole(n)]);
    let mut b = Batch::default();
    for (s, p) in prompts.iter().enumerate() {
        for (i, &t) in p.iter().enumerate() {
            b.push(t, i as i32, s as u32, i + 1 == p.len());
        }
    }
    let (mut ls, mut lw) = (split.step(&b), whole.step(&b));
    assert_eq!(ls, lw);

    // Export: only layers the stage holds.
    assert_mentions(
        &err_text(split.stages[0].export_kv(k - 1..k + 1)),
        &format!("cannot export the KV cache of layers {}-{}", k - 1, k),
    );

    let good = split.stages[1].export_kv(k..k + 2).unwrap();
    assert_eq!(good.cells.len(), b.len());
    assert_eq!(good.layers.len(), 2);
    assert!(good
        .layers
        .iter()
        .all(|l| !l.k.is_empty() && !l.v.is_empty()));

    // A layer outside the taking cache's range.
    assert_mentions(
        &err_text(split.stages[0].import_kv(&good)),
        &format!(
            "layer {k} is outside this cache's layers {}",
            omni_engine::fmt_layers(&(0..k))
        ),
    );

    // A cell table that is not this cache's: one sequence only.
    let mut other = Chain::load(&model, ranges.clone());
    let mut b0 = Batch::default();
    prompts[0]
        .iter()
        .enumerate()
        .for_each(|(i, &t)| b0.push(t, i as i32, 0, i + 1 == prompts[0].len()));
    other.step(&b0);
    let foreign = other.stages[1].export_kv(k..k + 2).unwrap();
    let mut into_b = split.stages[1].export_kv(k..k + 1).unwrap();
    into_b.cells = foreign.cells.clone();
    assert_mentions(
        &err_text(split.stages[1].import_kv(&into_b)),
        &format!(
            "cell tables differ at cell {}: this cache has sequence 1 position 0, the import a free cell",
            prompts[0].len()
        ),
    );

    // Wrong sizes.
    let mut short = good.clone();
    short.layers[1].k.truncate(10);
    assert_mentions(
        &err_text(split.stages[1].import_kv(&short)),
        &format!("layer {}'s K is 10 bytes", k + 1),
    );
    let mut no_v = good.clone();
    no_v.layers[0].v.clear();
    assert_mentions(
        &err_text(split.stages[1].import_kv(&no_v)),
        &format!("layer {k}'s V is 0 bytes"),
    );
    let mut twice = good.clone();
    twice.layers[1].layer = k;
    assert_mentions(
        &err_text(split.stages[1].import_kv(&twice)),
        &format!("layer {k} comes twice"),
    );

    // The byte form rejects garbage and truncation.
    assert_mentions(
        &err_text(KvLayers::from_bytes(b"nonsense, not a KV cache")),
        "not a serialized KV cache",
    );
    let bytes = good.to_bytes();
    assert_mentions(
        &err_text(KvLayers::from_bytes(&bytes[..bytes.len() - 1])),
        "truncated",
    );
    let mut longer = bytes.clone();
    longer.push(0);
    assert_mentions(
        &err_text(KvLayers::from_bytes(&longer)),
        "1 bytes left over",
    );
    assert_eq!(KvLayers::from_bytes(&bytes).unwrap(), good);

    // A move without the incoming layers fails before loading anything.
    let to = LayerRange {
        embed: false,
        layers: k - 2..n,
        head: true,
    };
    assert_mentions(
        &err_text(split.stages[1].rerange(to.clone(), None)),
        &format!(
            "the KV cache of layers {:?} is not in the incoming export",
            vec![k - 2, k - 1]
        ),
    );
    // One that fails after the new stage is loaded (an incoming layer of
    // the wrong size) rolls back too.
    let mut incoming = split.stages[0].export_kv(k - 2..k).unwrap();
    incoming.layers[0].v.pop();
    assert_mentions(
        &err_text(split.stages[1].rerange(to.clone(), Some(&incoming))),
        &format!("layer {}'s V is", k - 2),
    );
    // A foreign cell table is refused before loading.
    let mut foreign_in = incoming.clone();
    foreign_in.cells = foreign.cells.clone();
    assert_mentions(
        &err_text(split.stages[1].rerange(to, Some(&foreign_in))),
        "cell tables differ",
    );
    // Nothing above changed either stage: they still run their old ranges
    // and decode exactly as the unsplit stage does.
    assert_eq!(split.stages[0].range(), &ranges[0]);
    assert_eq!(split.stages[1].range(), &ranges[1]);
    for _ in 0..3 {
        let mut d = Batch::default();
        for (r, &bi) in lw.rows.iter().enumerate() {
            let s = b.seq[bi];
            let t = greedy(lw.row(r));
            d.push(t, b.pos[bi] + 1, s, true);
        }
        ls = split.step(&d);
        lw = whole.step(&d);
        assert_eq!(ls, lw, "a stage after failed moves decodes as before");
        b = d;
    }
}
