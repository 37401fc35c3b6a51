//! The layer planner on the real test models (gemma3 270M, qwen2.5-coder
//! 0.5B): splits a user would see, the errors they would read, and the
//! compute-buffer estimate checked against stages the engine really loads.

use std::sync::Arc;

use omni_coordinator::plan::{
    compute_estimate, fmt_bytes, parse_size, plan, Plan, PlanConfig, PlanError, Split, WorkerSpec,
};
use omni_engine::kv::KvConfig;
use omni_engine::model::ModelFile;
use omni_engine::stage::{LayerRange, Stage, StageConfig};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

#[path = "../../engine/tests/common/mod.rs"]
mod common;
use common::{fixtures_dir, GEMMA, QWEN};

/// A real model fetched by `omnictl fetch`; missing is a failure with the command to run.
fn model(file: &str) -> Arc<ModelFile> {
    ModelFile::open(common::model(file)).unwrap()
}

fn workers(free: &[u64]) -> Vec<WorkerSpec> {
    free.iter()
        .enumerate()
        .map(|(i, &f)| WorkerSpec {
            id: format!("w{i}"),
            device: "cpu".into(),
            free_bytes: f,
            total_bytes: f + GIB,
        })
        .collect()
}

fn cfg(split: Option<Split>) -> PlanConfig {
    PlanConfig {
        split,
        ..PlanConfig::default()
    }
}

fn counts(p: &Plan) -> Vec<u32> {
    p.stages
        .iter()
        .map(|s| s.range.layers.len() as u32)
        .collect()
}

/// The largest share of its budget any stage uses.
fn worst(p: &Plan) -> f64 {
    p.stages
        .iter()
        .map(|s| s.bytes.total as f64 / s.bytes.budget as f64)
        .fold(0.0, f64::max)
}

/// Everything a valid plan promises, whatever the split.
fn check_plan(m: &ModelFile, ws: &[WorkerSpec], c: &PlanConfig, p: &Plan) {
    let hp = &m.hparams;
    assert_eq!(p.stages.len(), ws.len());
    assert_eq!(p.n_layer, hp.n_layer);
    assert_eq!(p.arch, hp.arch.name());
    let mut next = 0;
    for (i, (s, w)) in p.stages.iter().zip(ws).enumerate() {
        assert_eq!(s.worker, w.id, "stages follow the workers' order");
        assert_eq!(s.range.layers.start, next, "stage {i} is contiguous: {p}");
        assert!(!s.range.layers.is_empty(), "stage {i} has no layer: {p}");
        next = s.range.layers.end;
        assert_eq!(s.range.embed, i == 0, "embedding on the first stage only");
        assert_eq!(
            s.range.head,
            i + 1 == ws.len(),
            "head on the last stage only"
        );
        let b = &s.bytes;
        assert_eq!(b.weights, m.range_weight_bytes(&s.range));
        let kv = KvConfig {
            n_ctx: c.n_ctx,
            n_seq: c.n_seq,
        };
        assert_eq!(b.kv, kv.bytes(hp, s.range.layers.len()));
        assert_eq!(b.compute, compute_estimate(hp, &s.range, c));
        assert_eq!(b.total, b.weights + b.kv + b.compute);
        assert_eq!(b.free, w.free_bytes);
        assert_eq!(
            b.budget,
            (w.free_bytes as f64 * (1.0 - c.headroom)).floor() as u64
        );
        assert!(b.total <= b.budget, "a returned plan fits: {p}");
    }
    assert_eq!(next, hp.n_layer, "every layer is placed once: {p}");

    // Weights add up to the file's tensor table exactly; with tied embeddings
    // and more than one stage, token_embd.weight is held by both ends.
    let file: u64 = m.gguf.tensors().iter().map(|t| t.size).sum();
    let twice = if hp.tied_embeddings && ws.len() > 1 {
        m.gguf.tensor("token_embd.weight").unwrap().size
    } else {
        0
    };
    let weights: u64 = p.stages.iter().map(|s| s.bytes.weights).sum();
    assert_eq!(weights, file + twice, "{p}");
}

#[test]
fn automatic_splits_cover_every_layer_once_and_add_up() {
    for file in [GEMMA, QWEN] {
        let m = model(file);
        for free in [
            vec![4 * GIB],
            vec![4 * GIB, 4 * GIB],
            vec![4 * GIB, 4 * GIB, 4 * GIB],
            vec![6 * GIB, 2 * GIB],
            vec![2 * GIB, 6 * GIB],
        ] {
            let ws = workers(&free);
            let c = cfg(None);
            let p = plan(&m, &ws, &c).unwrap_or_else(|e| panic!("{file} {free:?}: {e}"));
            check_plan(&m, &ws, &c, &p);
            eprintln!("{file} {:?} -> {:?}", free, counts(&p));
        }
    }
}

#[test]
fn the_bigger_of_an_unequal_pair_gets_more_layers() {
    for file in [GEMMA, QWEN] {
        let m = model(file);
        let big_first = plan(&m, &workers(&[6 * GIB, 2 * GIB]), &cfg(None)).unwrap();
        let big_last = plan(&m, &workers(&[2 * GIB, 6 * GIB]), &cfg(None)).unwrap();
        let (a, b) = (counts(&big_first), counts(&big_last));
        assert!(a[0] > a[1], "{file}: 3:1 gave {a:?}\n{big_first}");
        assert!(b[1] > b[0], "{file}: 1:3 gave {b:?}\n{big_last}");
    }
}

/// With room to spare, the automatic split gives layers in proportion to the
/// workers' budgets; when that does not fit it falls back to the split that
/// fills the workers most evenly, which then fits.
#[test]
fn automatic_split_is_proportional_when_it_fits_else_packed() {
    for file in [GEMMA, QWEN] {
        let m = model(file);
        let n = m.hparams.n_layer;
        let equal = plan(&m, &workers(&[4 * GIB, 4 * GIB]), &cfg(None)).unwrap();
        assert_eq!(counts(&equal), vec![n / 2, n - n / 2], "{file}\n{equal}");
        let third = plan(&m, &workers(&[6 * GIB, 2 * GIB]), &cfg(None)).unwrap();
        assert_eq!(
            counts(&third),
            omni_coordinator::plan::proportions_to_counts(
                &[6.0, 2.0],
                &workers(&[6 * GIB, 2 * GIB]),
                n
            )
            .unwrap()
        );
        // Equal workers just big enough for the packed split but not for
        // the proportional one (the head's logits buffer makes its stage heavy).
        let huge = workers(&[64 * GIB, 64 * GIB]);
        let packed = omni_coordinator::plan::min_max_split(&m, &huge, &cfg(None));
        let total_of = |c: &[u32]| {
            let p = plan(&m, &huge, &cfg(Some(Split::Layers(c.to_vec())))).unwrap();
            p.stages.iter().map(|s| s.bytes.total).max().unwrap()
        };
        let (need_packed, need_prop) = (total_of(&packed), total_of(&counts(&equal)));
        assert!(
            need_packed < need_prop,
            "{file}: {packed:?} needs {need_packed}, {need_prop} proportional"
        );
        let free = ((need_packed + need_prop) / 2) as f64 / 0.9;
        let tight = plan(&m, &workers(&[free as u64, free as u64]), &cfg(None)).unwrap();
        assert_eq!(counts(&tight), packed, "{file}\n{tight}");
        assert!(tight.notes.iter().any(|n| n.contains("did not fit")));
    }
}

/// The fallback split is the best contiguous one: no manual split of the
/// same workers leaves every stage at a smaller share of its budget.
#[test]
fn packed_split_is_no_worse_than_any_other() {
    for file in [GEMMA, QWEN] {
        let m = model(file);
        let n = m.hparams.n_layer;
        for free in [vec![6 * GIB, 2 * GIB], vec![3 * GIB, 3 * GIB, 2 * GIB]] {
            let ws = workers(&free);
            let packed = omni_coordinator::plan::min_max_split(&m, &ws, &cfg(None));
            let auto = plan(&m, &ws, &cfg(Some(Split::Layers(packed)))).unwrap();
            let best = worst(&auto);
            let mut splits: Vec<Vec<u32>> = Vec::new();
            if free.len() == 2 {
                splits.extend((1..n).map(|a| vec![a, n - a]));
            } else {
                for a in 1..n - 1 {
                    splits.extend((1..n - a).map(|b| vec![a, b, n - a - b]));
                }
            }
            for s in splits {
                let c = cfg(Some(Split::Layers(s.clone())));
                let other = plan(&m, &ws, &c).unwrap();
                assert_eq!(counts(&other), s, "a manual split is honoured exactly");
                assert!(
                    best <= worst(&other) * (1.0 + 1e-9),
                    "{file} {free:?}: automatic {:?} uses {best:.4} of a budget, manual {s:?} only {:.4}",
                    counts(&auto),
                    worst(&other)
                );
            }
        }
    }
}

#[test]
fn too_little_memory_fails_naming_the_worker_and_the_numbers() {
    let m = model(QWEN);
    // Nowhere near enough in total.
    let ws = workers(&[300 * MIB, 300 * MIB]);
    let e = plan(&m, &ws, &cfg(None)).unwrap_err();
    let msg = e.to_string();
    let PlanError::DoesNotFit(nf) = &e else {
        panic!("expected DoesNotFit, got {e}")
    };
    assert!(nf.bytes.total > nf.bytes.budget);
    for want in [
        format!(
            "model needs {} on stage {}",
            fmt_bytes(nf.bytes.total),
            nf.stage
        ),
        format!("(worker {}, cpu)", nf.worker),
        "but it has 300.0 MiB free (1.3 GiB total, 10% headroom: 270.0 MiB usable)".to_string(),
        format!("weights {}", fmt_bytes(nf.bytes.weights)),
        format!("KV {}", fmt_bytes(nf.bytes.kv)),
        format!("compute {}", fmt_bytes(nf.bytes.compute)),
        "in all the model needs".to_string(),
        "the workers offer 540.0 MiB after headroom".to_string(),
    ] {
        assert!(msg.contains(&want), "missing '{want}' in: {msg}");
    }

    // Enough in total, but the small worker cannot hold even one layer and the head.
    let ws = workers(&[8 * GIB, 10 * MIB]);
    let e = plan(&m, &ws, &cfg(None)).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("on stage 1 (worker w1, cpu) but it has 10.0 MiB free"),
        "{msg}"
    );
    assert!(
        msg.contains("the best automatic split (layers 23,1)"),
        "{msg}"
    );
    assert!(!msg.contains("in all"), "the total fits: {msg}");
}

#[test]
fn manual_splits_are_honoured_exactly_or_refused() {
    let qwen = model(QWEN);
    let gemma = model(GEMMA);
    let two = workers(&[4 * GIB, 4 * GIB]);
    let three = workers(&[4 * GIB, 4 * GIB, 4 * GIB]);

    let c = cfg(Some(Split::Layers(vec![20, 4])));
    let p = plan(&qwen, &two, &c).unwrap();
    check_plan(&qwen, &two, &c, &p);
    assert_eq!(counts(&p), [20, 4]);

    // llama.cpp's tensor-split rule: stage i ends at ceil(c_i * n_layer).
    for (m, props, want) in [
        (&qwen, vec![3.0, 1.0], vec![18, 6]),
        (&gemma, vec![3.0, 1.0], vec![14, 4]),
        (&gemma, vec![1.0, 1.0, 1.0], vec![6, 6, 6]),
        (&qwen, vec![1.0, 2.0, 1.0], vec![6, 12, 6]),
        (&qwen, vec![0.3, 0.3, 0.4], vec![8, 7, 9]),
    ] {
        let ws = if want.len() == 2 { &two } else { &three };
        let c = cfg(Some(Split::Proportions(props.clone())));
        let p = plan(m, ws, &c).unwrap();
        check_plan(m, ws, &c, &p);
        assert_eq!(counts(&p), want, "--split {props:?}");
        assert!(p.notes.iter().any(|n| n.contains("tensor-split")));
    }

    let refuse = |m: &ModelFile, ws: &[WorkerSpec], split: Split, want: &[&str]| {
        let e = plan(m, ws, &cfg(Some(split.clone()))).unwrap_err();
        assert!(matches!(e, PlanError::Split(_)), "{split:?}: {e}");
        let msg = e.to_string();
        for w in want {
            assert!(msg.contains(w), "{split:?}: missing '{w}' in: {msg}");
        }
    };
    refuse(
        &qwen,
        &two,
        Split::Layers(vec![12, 11]),
        &["12,11", "23", "24"],
    );
    refuse(
        &qwen,
        &two,
        Split::Layers(vec![24, 0]),
        &["stage 1 (worker w1) no layers"],
    );
    refuse(
        &qwen,
        &two,
        Split::Layers(vec![8, 8, 8]),
        &["3 entries", "2 workers"],
    );
    refuse(
        &qwen,
        &two,
        Split::Proportions(vec![1.0]),
        &["1 entries", "2 workers"],
    );
    refuse(&qwen, &two, Split::Proportions(vec![1.0, -1.0]), &["-1"]);
    refuse(
        &qwen,
        &two,
        Split::Proportions(vec![0.0, 0.0]),
        &["no positive entry"],
    );
    refuse(
        &qwen,
        &two,
        Split::Proportions(vec![100.0, 1.0]),
        &["stage 1 (worker w1) no layers", "layers 24,0"],
    );

    // A manual split that does not fit is an error, never quietly rebalanced.
    let ws = workers(&[8 * GIB, 600 * MIB]);
    assert!(plan(&qwen, &ws, &cfg(None)).is_ok());
    let e = plan(&qwen, &ws, &cfg(Some(Split::Layers(vec![1, 23])))).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PlanError::DoesNotFit(_)), "{msg}");
    assert!(msg.contains("(worker w1, cpu)"), "{msg}");
    assert!(msg.contains("the manual split of layers 1,23"), "{msg}");
}

#[test]
fn more_workers_than_layers_is_an_error() {
    let m = model(GEMMA);
    let ws = workers(&[GIB; 19]);
    let e = plan(&m, &ws, &cfg(None)).unwrap_err();
    assert!(matches!(e, PlanError::TooManyWorkers { .. }));
    let msg = e.to_string();
    assert!(
        msg.contains("19 workers") && msg.contains("18 layers"),
        "{msg}"
    );
    // Exactly one layer each is fine.
    let ws = workers(&[GIB; 18]);
    let p = plan(&m, &ws, &cfg(None)).unwrap();
    assert!(counts(&p).iter().all(|&c| c == 1));
}

#[test]
fn bad_settings_are_refused_before_planning() {
    let m = model(QWEN);
    let ws = workers(&[4 * GIB]);
    let bad = |c: PlanConfig, want: &str| {
        let msg = plan(&m, &ws, &c).unwrap_err().to_string();
        assert!(msg.contains(want), "missing '{want}' in: {msg}");
    };
    bad(
        PlanConfig {
            n_ctx: 65536,
            ..cfg(None)
        },
        "trained context of 32768",
    );
    bad(
        PlanConfig {
            headroom: 1.0,
            ..cfg(None)
        },
        "headroom 1",
    );
    bad(
        PlanConfig {
            n_ubatch: 0,
            ..cfg(None)
        },
        "micro-batch (0)",
    );
    assert!(matches!(
        plan(&m, &[], &cfg(None)),
        Err(PlanError::NoWorkers)
    ));
}

#[test]
fn the_plan_prints_a_table_with_notes_and_round_trips_as_json() {
    let m = model(GEMMA);
    let ws = workers(&[6 * GIB, 2 * GIB]);
    let p = plan(&m, &ws, &cfg(None)).unwrap();
    let text = p.to_string();
    let n_tensors = m.gguf.tensors().len();
    for want in [
        "gemma3, 18 layers",
        "stage  worker  device",
        "w0",
        "w1",
        "embed + layers 0..",
        "+ head",
        "notes:",
        &format!("{n_tensors} tensors"),
        "KV cache: F16 K and V, 2 bytes x (256 + 256) per cell x 4096 ctx x 8 seqs = 32.0 MiB per layer",
        "logits of 512 tokens x 262144 vocab",
        "tied embeddings",
    ] {
        assert!(text.contains(want), "missing '{want}' in:\n{text}");
    }
    let json = serde_json::to_string(&p).unwrap();
    let back: Plan = serde_json::from_str(&json).unwrap();
    assert_eq!(back, p);
}

#[test]
fn sizes_parse_and_print() {
    assert_eq!(parse_size("6GiB").unwrap(), 6 * GIB);
    assert_eq!(parse_size("512MiB").unwrap(), 512 * MIB);
    assert_eq!(parse_size("2G").unwrap(), 2 * GIB);
    assert_eq!(parse_size("1.5GiB").unwrap(), 3 * GIB / 2);
    assert!(parse_size("six").unwrap_err().contains("'six'"));
    assert!(parse_size("6 parsecs").unwrap_err().contains("6 parsecs"));
    assert_eq!(fmt_bytes(3 * GIB / 2), "1.5 GiB");
    assert_eq!(fmt_bytes(300 * MIB), "300.0 MiB");
}

/// The compute buffer `Stage::load` really reserves for `r`, and the
/// planner's estimate of it.
fn actual_and_estimate(
    m: &Arc<ModelFile>,
    r: &LayerRange,
    n_ctx: usize,
    n_seq: usize,
    n_ubatch: usize,
) -> (u64, u64) {
    let c = PlanConfig {
        n_ctx,
        n_seq,
        n_ubatch,
        ..cfg(None)
    };
    let sc = StageConfig {
        kv: KvConfig { n_ctx, n_seq },
        n_ubatch,
        n_threads: 1,
        repack: false,
    };
    let actual = Stage::load(m.clone(), r.clone(), sc)
        .unwrap()
        .compute_bytes() as u64;
    (actual, compute_estimate(&m.hparams, r, &c))
}

/// The compute estimate bounds what `Stage::load` really reserves, and not
/// by much: actual <= estimate <= 2 x actual + 16 MiB, for the first range
/// (embedding alone and with layers), middle ranges, the head with and
/// without layers, and the whole model, at several step and cache sizes.
#[test]
fn compute_estimate_bounds_the_real_compute_buffer() {
    let synthetic = |m: &str| fixtures_dir().join(format!("synthetic/tiny-{m}-f32.gguf"));
    for path in [
        common::model(GEMMA),
        common::model(QWEN),
        synthetic("qwen3moe"),
        synthetic("deepseek2-mla"),
        synthetic("deepseek2-legacy"),
    ] {
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let m = ModelFile::open(&path).unwrap();
        let hp = &m.hparams;
        let n = hp.n_layer;
        let ranges = [
            LayerRange {
                embed: true,
                layers: 0..0,
                head: false,
            },
            LayerRange {
                embed: true,
                layers: 0..3,
                head: false,
            },
            LayerRange {
                embed: false,
                layers: n / 2..n / 2 + 1,
                head: false,
            },
            LayerRange {
                embed: false,
                layers: 1..n - 1,
                head: false,
            },
            LayerRange {
                embed: false,
                layers: n - 3..n,
                head: true,
            },
            LayerRange {
                embed: false,
                layers: n..n,
                head: true,
            },
            LayerRange::whole(n),
        ];
        let mut lo = f64::INFINITY;
        let mut hi: f64 = 0.0;
        for (n_ctx, n_seq, n_ubatch) in [(256, 1, 512), (512, 4, 512), (1024, 2, 64), (128, 3, 1)] {
            for r in &ranges {
                let (actual, est) = actual_and_estimate(&m, r, n_ctx, n_seq, n_ubatch);
                let ratio = est as f64 / actual as f64;
                eprintln!("{file} ctx {n_ctx} x {n_seq} ubatch {n_ubatch} {r}: actual {actual}, estimate {est} ({ratio:.3}x)");
                assert!(
                    actual <= est && est <= 2 * actual + 16 * MIB,
                    "{file} ctx {n_ctx} x {n_seq} ubatch {n_ubatch} {r}: actual {actual}, estimate {est}"
                );
                if actual >= 16 * MIB {
                    lo = lo.min(ratio);
                    hi = hi.max(ratio);
                }
            }
        }
        if hi > 0.0 {
            eprintln!(
                "{file}: estimate / actual for buffers of 16 MiB and more: {lo:.3} .. {hi:.3}"
            );
        }
    }
}

#[test]
fn an_unsupported_architecture_is_refused_at_open() {
    let p = fixtures_dir().join("synthetic/tiny-deepseek3_2-unsupported-f32.gguf");
    let e = ModelFile::open(&p).unwrap_err().to_string();
    assert!(
        e.contains("deepseek3_2") && e.contains("not supported"),
        "{e}"
    );
}

/// The compute estimate also bounds a DeepSeek-V3-shaped stage (hidden
/// 7168, 128 heads, MLA with q_lora 1536 / kv_lora 512 / rope 64, experts
/// 2048 wide with 8 used, a shared expert; one dense and one MoE layer, 16
/// experts and the tiny vocabulary to keep the file small). The weights are
/// a sparse file of zeros: reserving the compute buffer never reads them.
#[test]
fn compute_estimate_bounds_a_deepseek_v3_shaped_stage() {
    use omni_engine::gguf::{Gguf, Value};
    let tiny = Gguf::open(fixtures_dir().join("synthetic/tiny-deepseek2-mla-f32.gguf")).unwrap();
    let mut kvs = tiny.metadata().to_vec();
    let (e, h, ql, kl, rope, nope, v, fx, ff, x, vocab) = (
        7168u64, 128u64, 1536u64, 512u64, 64u64, 128u64, 128u64, 2048u64, 18432u64, 16u64, 512u64,
    );
    for (k, val) in [
        ("block_count", 2),
        ("embedding_length", e),
        ("feed_forward_length", ff),
        ("attention.head_count", h),
        ("attention.q_lora_rank", ql),
        ("attention.kv_lora_rank", kl),
        ("attention.key_length", kl + rope),
        ("attention.value_length", kl),
        ("attention.key_length_mla", nope + rope),
        ("attention.value_length_mla", v),
        ("rope.dimension_count", rope),
        ("expert_count", x),
        ("expert_used_count", 8),
        ("expert_feed_forward_length", fx),
    ] {
        let key = format!("deepseek2.{k}");
        let kv = kvs.iter_mut().find(|(n, _)| *n == key).unwrap();
        kv.1 = Value::U32(val as u32);
    }
    let mut tensors: Vec<(String, Vec<u64>)> = vec![
        ("token_embd.weight".into(), vec![e, vocab]),
        ("output_norm.weight".into(), vec![e]),
        ("output.weight".into(), vec![e, vocab]),
    ];
    for il in 0..2 {
        let mut t = |n: &str, d: &[u64]| tensors.push((format!("blk.{il}.{n}"), d.to_vec()));
        t("attn_norm.weight", &[e]);
        t("attn_q_a.weight", &[e, ql]);
        t("attn_q_a_norm.weight", &[ql]);
        t("attn_q_b.weight", &[ql, h * (nope + rope)]);
        t("attn_kv_a_mqa.weight", &[e, kl + rope]);
        t("attn_kv_a_norm.weight", &[kl]);
        t("attn_k_b.weight", &[nope, kl, h]);
        t("attn_v_b.weight", &[kl, v, h]);
        t("attn_output.weight", &[h * v, e]);
        t("ffn_norm.weight", &[e]);
        if il == 0 {
            t("ffn_gate.weight", &[e, ff]);
            t("ffn_up.weight", &[e, ff]);
            t("ffn_down.weight", &[ff, e]);
        } else {
            t("ffn_gate_inp.weight", &[e, x]);
            t("exp_probs_b.bias", &[x]);
            t("ffn_gate_exps.weight", &[e, fx, x]);
            t("ffn_up_exps.weight", &[e, fx, x]);
            t("ffn_down_exps.weight", &[fx, e, x]);
            t("ffn_gate_shexp.weight", &[e, fx]);
            t("ffn_up_shexp.weight", &[e, fx]);
            t("ffn_down_shexp.weight", &[fx, e]);
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("deepseek-v3-shaped.gguf");
    let shapes: Vec<(&str, &[u64])> = tensors
        .iter()
        .map(|(n, d)| (n.as_str(), d.as_slice()))
        .collect();
    common::write_sparse_gguf(&path, &kvs, &shapes);
    let m = ModelFile::open(&path).unwrap();
    let ranges = [
        LayerRange {
            embed: true,
            layers: 0..1,
            head: false,
        },
        LayerRange {
            embed: false,
            layers: 1..2,
            head: false,
        },
        LayerRange {
            embed: false,
            layers: 1..2,
            head: true,
        },
        LayerRange::whole(2),
    ];
    for (n_ctx, n_seq, n_ubatch) in [(4096, 1, 512), (2048, 4, 256), (4096, 2, 64)] {
        for r in &ranges {
            let (actual, est) = actual_and_estimate(&m, r, n_ctx, n_seq, n_ubatch);
            eprintln!(
                "deepseek-v3-shaped ctx {n_ctx} x {n_seq} ubatch {n_ubatch} {r}: actual {actual}, estimate {est} ({:.3}x)",
                est as f64 / actual as f64
            );
            assert!(
                actual <= est && est <= 2 * actual + 16 * MIB,
                "ctx {n_ctx} x {n_seq} ubatch {n_ubatch} {r}: actual {actual}, estimate {est}"
            );
        }
    }
}
