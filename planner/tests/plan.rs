//! The layer planner on the real test models (gemma3 270M, qwen2.5-coder
//! 0.5B) and the synthetic MoE files: splits a user would see, the errors
//! they would read, routed experts on expert workers, and the compute-buffer
//! estimates checked against stages the engine really loads.

use std::sync::Arc;

use omni_engine::kv::KvConfig;
use omni_engine::model::ModelFile;
use omni_engine::stage::{LayerRange, Stage, StageConfig};
use omni_planner::{
    compute_estimate, expert_compute_estimate, fmt_bytes, fmt_layers, parse_size, plan,
    plan_with_experts, work_per_token, ExpertPolicy, Plan, PlanConfig, PlanError, Split,
    WorkerSpec,
};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

#[path = "../../engine/tests/common/mod.rs"]
mod common;
use common::{fixtures_dir, GEMMA, QWEN};

/// A real model fetched by `omnictl fetch`; missing is a failure with the command to run.
fn model(file: &str) -> Arc<ModelFile> {
    ModelFile::open(common::model(file)).unwrap()
}

/// Workers `{prefix}0`, `{prefix}1`, ... offering `free` each, on `device(i)`.
fn specs(prefix: &str, device: impl Fn(usize) -> String, free: &[u64]) -> Vec<WorkerSpec> {
    free.iter()
        .enumerate()
        .map(|(i, &f)| WorkerSpec {
            id: format!("{prefix}{i}"),
            device: device(i),
            free_bytes: f,
            total_bytes: f + GIB,
            read_rate: 0,
            pool: None,
        })
        .collect()
}

fn workers(free: &[u64]) -> Vec<WorkerSpec> {
    specs("w", |_| "cpu".into(), free)
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

/// The automatic split makes the slowest stage as fast as it can be: the
/// largest per-token work (weight bytes read) is the least of every split
/// that fits, whatever the budgets, as long as the workers are of one kind.
#[test]
fn the_automatic_split_makes_the_slowest_stage_as_fast_as_it_can_be() {
    for file in [GEMMA, QWEN] {
        let m = model(file);
        let n = m.hparams.n_layer;
        let slowest = |p: &Plan| *work_per_token(&m, p).iter().max().unwrap();
        for free in [
            vec![4 * GIB, 4 * GIB],
            vec![6 * GIB, 2 * GIB],
            vec![2 * GIB, 6 * GIB],
            vec![4 * GIB, 4 * GIB, 4 * GIB],
            // Tight: the first worker cannot hold its best share.
            vec![800 * MIB, 4 * GIB],
        ] {
            let ws = workers(&free);
            let auto = plan(&m, &ws, &cfg(None)).unwrap_or_else(|e| panic!("{file} {free:?}: {e}"));
            check_plan(&m, &ws, &cfg(None), &auto);
            let mut best = u64::MAX;
            let mut each = |c: Vec<u32>| {
                if let Ok(p) = plan(&m, &ws, &cfg(Some(Split::Layers(c)))) {
                    best = best.min(slowest(&p));
                }
            };
            for a in 1..n {
                if ws.len() == 2 {
                    each(vec![a, n - a]);
                } else {
                    for b in 1..n - a {
                        each(vec![a, b, n - a - b]);
                    }
                }
            }
            assert_eq!(slowest(&auto), best, "{file} {free:?}\n{auto}");
            assert!(auto
                .notes
                .iter()
                .any(|n| n.contains("the slowest stage as fast as it can be")));
        }
        // Gemma's tied head outweighs all its layers: the last stage gets one.
        if file == GEMMA {
            let p = plan(&m, &workers(&[4 * GIB, 4 * GIB]), &cfg(None)).unwrap();
            assert_eq!(counts(&p), [n - 1, 1], "{p}");
        }
    }
}

/// With the rate each worker measured for its weight reads, the automatic
/// split makes the slowest stage's time per token (its weight reads over
/// its worker's rate) the least of every split that fits: a worker three
/// times as fast gets more layers, a GPU beside a CPU takes all the layers
/// it has room for, and the notes give each stage's time.
#[test]
fn measured_read_rates_balance_time_across_unequal_workers() {
    let rated = |devices: &[&str], free: &[u64], rates: &[u64]| -> Vec<WorkerSpec> {
        let mut ws = specs("w", |i| devices[i].to_string(), free);
        for (w, &r) in ws.iter_mut().zip(rates) {
            w.read_rate = r;
        }
        ws
    };
    const GB: u64 = 1_000_000_000;
    for file in [GEMMA, QWEN] {
        let m = model(file);
        let n = m.hparams.n_layer;
        for (devices, free, rates) in [
            (["cpu", "cpu"], [4 * GIB, 4 * GIB], [10 * GB, 30 * GB]),
            (["cpu", "cpu"], [4 * GIB, 4 * GIB], [30 * GB, 10 * GB]),
            (["cuda:0", "cpu"], [4 * GIB, 4 * GIB], [900 * GB, 40 * GB]),
            (["cpu", "cuda:0"], [4 * GIB, 4 * GIB], [40 * GB, 900 * GB]),
            // The fast GPU is small: it takes what fits, the CPU the rest.
            (["cuda:0", "cpu"], [400 * MIB, 4 * GIB], [900 * GB, 40 * GB]),
        ] {
            let ws = rated(&devices, &free, &rates);
            let time = |p: &Plan| {
                work_per_token(&m, p)
                    .iter()
                    .zip(&rates)
                    .map(|(&w, &r)| w as f64 / r as f64)
                    .fold(0.0, f64::max)
            };
            let what = format!("{file} {devices:?} {free:?} {rates:?}");
            let auto = plan(&m, &ws, &cfg(None)).unwrap_or_else(|e| panic!("{what}: {e}"));
            if !devices.iter().any(|d| d.starts_with("cuda")) {
                // (A GPU stage's bytes are checked in gpu_stages_count_the_embedding_where_it_lives.)
                check_plan(&m, &ws, &cfg(None), &auto);
            }
            let mut best = f64::INFINITY;
            for a in 1..n {
                if let Ok(p) = plan(&m, &ws, &cfg(Some(Split::Layers(vec![a, n - a])))) {
                    best = best.min(time(&p));
                }
            }
            assert_eq!(time(&auto), best, "{what}\n{auto}");
            assert!(
                auto.notes
                    .iter()
                    .any(|n| n.contains("over the rate its worker reads weights at")),
                "{what}: {:?}",
                auto.notes
            );
            assert!(
                auto.notes
                    .iter()
                    .any(|n| n.contains("stage 1 ") && n.contains("GB/s")),
                "{what}: {:?}",
                auto.notes
            );
        }
        // The faster of two CPU workers gets more layers than it does when
        // their speeds are unknown (and count as equal).
        let equal = plan(&m, &workers(&[4 * GIB, 4 * GIB]), &cfg(None)).unwrap();
        let fast_first = rated(&["cpu", "cpu"], &[4 * GIB, 4 * GIB], &[30 * GB, 10 * GB]);
        let p = plan(&m, &fast_first, &cfg(None)).unwrap();
        assert!(counts(&p)[0] >= counts(&equal)[0], "{file}\n{p}\n{equal}");
        let fast_last = rated(&["cpu", "cpu"], &[4 * GIB, 4 * GIB], &[10 * GB, 30 * GB]);
        let p = plan(&m, &fast_last, &cfg(None)).unwrap();
        assert!(counts(&p)[1] > counts(&equal)[1], "{file}\n{p}\n{equal}");
        // A roomy GPU twenty times the CPU's speed leaves the CPU one layer.
        let gpu = rated(
            &["cuda:0", "cpu"],
            &[4 * GIB, 4 * GIB],
            &[900 * GB, 40 * GB],
        );
        let p = plan(&m, &gpu, &cfg(None)).unwrap();
        assert!(counts(&p)[0] >= n - 2, "{file}\n{p}");
        // One worker without a figure: the rates are not used.
        let mut partial = gpu.clone();
        partial[1].read_rate = 0;
        let p = plan(&m, &partial, &cfg(None)).unwrap();
        assert!(p.notes.iter().all(|n| !n.contains("GB/s")), "{file}\n{p}");
    }
}

/// Devices of different kinds (a GPU and a CPU, whose speeds the planner
/// does not know): with room to spare, the automatic split gives layers in
/// proportion to the workers' budgets; when that does not fit it falls back
/// to the split that fills the workers most evenly, which then fits.
#[test]
fn automatic_split_over_mixed_devices_is_proportional_when_it_fits_else_packed() {
    let workers = |free: &[u64]| {
        specs(
            "w",
            |i| {
                if i == 0 {
                    "cuda:0".into()
                } else {
                    "cpu".into()
                }
            },
            free,
        )
    };
    for file in [GEMMA, QWEN] {
        let m = model(file);
        let n = m.hparams.n_layer;
        let equal = plan(&m, &workers(&[4 * GIB, 4 * GIB]), &cfg(None)).unwrap();
        assert_eq!(counts(&equal), vec![n / 2, n - n / 2], "{file}\n{equal}");
        let third = plan(&m, &workers(&[6 * GIB, 2 * GIB]), &cfg(None)).unwrap();
        assert_eq!(
            counts(&third),
            omni_planner::proportions_to_counts(&[6.0, 2.0], &workers(&[6 * GIB, 2 * GIB]), n)
                .unwrap()
        );
        // Equal workers just big enough for the packed split but not for
        // the proportional one (the head's logits buffer makes its stage heavy).
        let huge = workers(&[64 * GIB, 64 * GIB]);
        let packed = omni_planner::min_max_split(&m, &huge, &cfg(None));
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
            let packed = omni_planner::min_max_split(&m, &ws, &cfg(None));
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
    assert!(msg.contains("the manual split --counts 1,23"), "{msg}");
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
        "embed + layers 0-",
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
        device: Default::default(),
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

/// A stage on a GPU keeps the token embedding in host memory (a row lookup
/// per token), so the embedding does not count against the GPU's memory;
/// a head tied to the embedding has its own copy on the GPU, which does.
/// CPU stages hold the file's bytes as before.
#[test]
fn gpu_stages_count_the_embedding_where_it_lives() {
    for file in [GEMMA, QWEN] {
        let m = model(file);
        let hp = &m.hparams;
        let embd = m.gguf.tensor("token_embd.weight").unwrap().size;
        let weights = |ws: &[WorkerSpec]| -> Vec<(LayerRange, u64)> {
            let p = plan(&m, ws, &cfg(None)).unwrap();
            p.stages
                .iter()
                .map(|s| (s.range.clone(), s.bytes.weights))
                .collect()
        };
        let gpus = specs("w", |i| format!("cuda:{i}"), &[4 * GIB, 4 * GIB]);
        let [(r0, w0), (r1, w1)] = &weights(&gpus)[..] else {
            panic!("two stages")
        };
        assert_eq!(
            *w0,
            m.range_weight_bytes(r0) - embd,
            "{file}: cuda:0 embeds"
        );
        // The head: its output matrix (or the tied embedding's copy) is on the GPU.
        assert_eq!(*w1, m.range_weight_bytes(r1), "{file}: cuda:1 has the head");
        // A CPU first stage holds the embedding; a GPU last stage the head.
        let mixed = specs(
            "w",
            |i| if i == 0 { "cpu" } else { "cuda:0" }.into(),
            &[4 * GIB, 4 * GIB],
        );
        let [(r0, w0), (r1, w1)] = &weights(&mixed)[..] else {
            panic!("two stages")
        };
        assert_eq!(
            *w0,
            m.range_weight_bytes(r0),
            "{file}: cpu embeds from the map"
        );
        assert_eq!(*w1, m.range_weight_bytes(r1));
        // One GPU stage: the embedding in host memory, and with a tied
        // head its copy on the GPU; untied, only the output matrix.
        let one = specs("w", |_| "cuda:0".into(), &[4 * GIB]);
        let [(r, w)] = &weights(&one)[..] else {
            panic!("one stage")
        };
        let whole = m.range_weight_bytes(r);
        let expect = if hp.tied_embeddings {
            whole
        } else {
            whole - embd
        };
        assert_eq!(*w, expect, "{file}: one GPU stage");
    }
}

/// A sparse DeepSeek-V3-shaped file (hidden 7168, 128 heads, MLA with
/// q_lora 1536 / kv_lora 512 / rope 64, experts 2048 wide with 8 used, a
/// shared expert; the first layer dense, `n_layer - 1` MoE layers of
/// `n_expert` experts, the tiny vocabulary): every tensor F32 zeros that
/// take no disk space.
fn write_deepseek_v3_shaped(path: &std::path::Path, n_layer: u64, n_expert: u64) {
    write_deepseek_shaped(path, n_layer, n_expert, 512, false)
}

/// The same shapes at any size, with `q4_k` every matrix whose rows are
/// whole Q4_K blocks in Q4_K (the rest F32), as a Q4_K_M file mostly is.
fn write_deepseek_shaped(
    path: &std::path::Path,
    n_layer: u64,
    n_expert: u64,
    vocab: u64,
    q4_k: bool,
) {
    use omni_engine::gguf::{Gguf, Value};
    let tiny = Gguf::open(fixtures_dir().join("synthetic/tiny-deepseek2-mla-f32.gguf")).unwrap();
    let mut kvs = tiny.metadata().to_vec();
    let (e, h, ql, kl, rope, nope, v, fx, ff, x, vocab) = (
        7168u64, 128u64, 1536u64, 512u64, 64u64, 128u64, 128u64, 2048u64, 18432u64, n_expert, vocab,
    );
    // DeepSeek-V3/R1: the first 3 layers dense (the small files: 1).
    let n_dense = if n_layer > 3 { 3 } else { 1 };
    for (k, val) in [
        ("block_count", n_layer),
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
        ("leading_dense_block_count", n_dense),
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
    for il in 0..n_layer {
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
        if il < n_dense {
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
    let shapes: Vec<(&str, &[u64])> = tensors
        .iter()
        .map(|(n, d)| (n.as_str(), d.as_slice()))
        .collect();
    common::write_sparse_gguf_typed(path, &kvs, &shapes, |d| {
        if q4_k && d.len() >= 2 && d[0] % 256 == 0 {
            (12, 256, 144)
        } else {
            (0, 1, 4)
        }
    });
}

/// The plan the user of the seeds wants, as a dry run on a DeepSeek-R1-shaped
/// file (61 layers, 3 dense, 256 experts of 2048 with 8 used, vocabulary
/// 129280, matrices Q4_K: ~377 GB, sparse): two GPUs of 96 and 32 GiB run
/// attention, the dense layers and the shared experts, and an expert worker
/// with 384 GiB the routed experts that do not fit the GPUs.
#[test]
fn an_r1_shaped_model_plans_over_two_gpus_and_a_numa_node() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("deepseek-r1-shaped.gguf");
    write_deepseek_shaped(&path, 61, 256, 129280, true);
    let m = ModelFile::open(&path).unwrap();
    let size = m.gguf.file_size();
    assert!(size > 350_000_000_000 && size < 400_000_000_000, "{size}");
    let mut gpus = specs("w", |i| format!("cuda:{i}"), &[96 * GIB, 32 * GIB]);
    gpus[1].total_bytes = 32 * GIB;
    let numa = specs("c", |_| "numa0".into(), &[384 * GIB]);
    let c = moe_cfg(ExpertPolicy::Auto);
    let p = plan_with_experts(&m, &gpus, &numa, &c).unwrap();
    eprintln!("{p}");
    assert_eq!(p.stages.len(), 2);
    assert_eq!(p.experts.len(), 1);
    let off = offloaded(&p);
    assert!(!off.is_empty(), "the experts cannot all fit 128 GiB: {p}");
    assert_eq!(p.experts[0].layers, off, "{p}");
    for s in &p.stages {
        assert!(s.bytes.total <= s.bytes.budget, "{p}");
    }
    assert!(p.experts[0].bytes.total <= p.experts[0].bytes.budget, "{p}");
    // The first GPU holds the dense layers, and not the token embedding.
    assert!(p.stages[0].range.layers.contains(&2), "{p}");
    let embd = m.gguf.tensor("token_embd.weight").unwrap().size;
    let s0 = &p.stages[0];
    let saved_here: u64 = s0.offloaded.iter().map(|&il| saved(&m, il, &c)).sum();
    assert_eq!(
        s0.bytes.weights,
        m.range_weight_bytes(&s0.range) - embd - saved_here,
        "{p}"
    );
}

/// The compute estimate also bounds a DeepSeek-V3-shaped stage (hidden
/// 7168, 128 heads, MLA with q_lora 1536 / kv_lora 512 / rope 64, experts
/// 2048 wide with 8 used, a shared expert; one dense and one MoE layer, 16
/// experts and the tiny vocabulary to keep the file small). The weights are
/// a sparse file of zeros: reserving the compute buffer never reads them.
#[test]
fn compute_estimate_bounds_a_deepseek_v3_shaped_stage() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("deepseek-v3-shaped.gguf");
    write_deepseek_v3_shaped(&path, 2, 16);
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

// Routed experts on expert workers.

const SYNTHETIC: [&str; 3] = [
    "tiny-qwen3moe-f32.gguf",
    "tiny-deepseek2-mla-f32.gguf",
    "tiny-deepseek2-legacy-f32.gguf",
];

fn synth(file: &str) -> Arc<ModelFile> {
    ModelFile::open(common::synthetic(file)).unwrap()
}

fn expert_workers(free: &[u64]) -> Vec<WorkerSpec> {
    specs("c", |i| format!("numa{i}"), free)
}

/// A small context, so that the routed experts dominate the tiny models' stages.
fn moe_cfg(experts: ExpertPolicy) -> PlanConfig {
    PlanConfig {
        n_ctx: 256,
        n_seq: 1,
        n_ubatch: 64,
        experts,
        ..cfg(None)
    }
}

fn budget_of(free: u64, c: &PlanConfig) -> u64 {
    (free as f64 * (1.0 - c.headroom)).floor() as u64
}

/// What a stage still holds of layer `il`'s experts once they are offloaded.
fn kept(m: &ModelFile, il: u32, c: &PlanConfig) -> u64 {
    let n = u64::from(m.hparams.moe.as_ref().unwrap().n_expert);
    m.expert_weight_bytes(il) * u64::from(c.gpu_experts).min(n) / n
}

/// What offloading layer `il`'s experts takes off its stage.
fn saved(m: &ModelFile, il: u32, c: &PlanConfig) -> u64 {
    m.expert_weight_bytes(il) - kept(m, il, c)
}

fn moe_in(m: &ModelFile, r: &LayerRange) -> Vec<u32> {
    r.layers
        .clone()
        .filter(|&il| m.expert_weight_bytes(il) > 0)
        .collect()
}

fn offloaded(p: &Plan) -> Vec<u32> {
    p.stages
        .iter()
        .flat_map(|s| s.offloaded.iter().copied())
        .collect()
}

/// What a stage of `r` needs with the routed experts of every MoE layer offloaded.
fn without_experts(m: &ModelFile, r: &LayerRange, c: &PlanConfig) -> u64 {
    let kv = KvConfig {
        n_ctx: c.n_ctx,
        n_seq: c.n_seq,
    };
    m.range_weight_bytes(r) - moe_in(m, r).iter().map(|&il| saved(m, il, c)).sum::<u64>()
        + kv.bytes(&m.hparams, r.layers.len())
        + compute_estimate(&m.hparams, r, c)
}

/// Everything a plan with expert workers promises. With `put_back`, every
/// stage that offloads would overflow by taking back one more layer's experts.
fn check_expert_plan(
    m: &ModelFile,
    ws: &[WorkerSpec],
    cs: &[WorkerSpec],
    c: &PlanConfig,
    p: &Plan,
    put_back: bool,
) {
    let hp = &m.hparams;
    assert_eq!(p.stages.len(), ws.len());
    let mut next = 0;
    for (i, (s, w)) in p.stages.iter().zip(ws).enumerate() {
        assert_eq!(s.worker, w.id);
        assert_eq!(s.range.layers.start, next, "stage {i} is contiguous: {p}");
        next = s.range.layers.end;
        let moe = moe_in(m, &s.range);
        assert!(
            s.offloaded.iter().all(|il| moe.contains(il)),
            "stage {i} offloads only its own MoE layers: {p}"
        );
        assert!(s.offloaded.windows(2).all(|w| w[0] < w[1]));
        let b = &s.bytes;
        let out: u64 = s.offloaded.iter().map(|&il| saved(m, il, c)).sum();
        assert_eq!(b.weights, m.range_weight_bytes(&s.range) - out, "stage {i}");
        let kv = KvConfig {
            n_ctx: c.n_ctx,
            n_seq: c.n_seq,
        };
        assert_eq!(b.kv, kv.bytes(hp, s.range.layers.len()));
        assert_eq!(b.compute, compute_estimate(hp, &s.range, c));
        assert_eq!(b.total, b.weights + b.kv + b.compute);
        assert_eq!(b.budget, budget_of(w.free_bytes, c));
        assert!(b.total <= b.budget, "stage {i} fits: {p}");
        if put_back {
            if let Some(&first) = s.offloaded.first() {
                assert!(
                    b.total + saved(m, first, c) > b.budget,
                    "stage {i} could take layer {first}'s experts back: {p}"
                );
            }
        }
    }
    assert_eq!(next, hp.n_layer, "every layer is placed once: {p}");

    // Every offloaded layer on one expert worker, in layer order, each
    // worker filled before the next.
    let held: Vec<u32> = p.experts.iter().flat_map(|e| e.layers.clone()).collect();
    assert_eq!(held, offloaded(p), "{p}");
    let compute = expert_compute_estimate(hp, c.n_ubatch);
    let mut last_worker = None;
    for (j, e) in p.experts.iter().enumerate() {
        let k = cs.iter().position(|w| w.id == e.worker).unwrap();
        assert!(last_worker < Some(k), "expert workers in order: {p}");
        last_worker = Some(k);
        let w = &cs[k];
        assert_eq!(e.device, w.device);
        assert!(!e.layers.is_empty());
        let b = &e.bytes;
        let weights: u64 = e.layers.iter().map(|&il| m.expert_weight_bytes(il)).sum();
        assert_eq!(b.weights, weights);
        assert_eq!(b.kv, 0);
        assert_eq!(b.compute, compute);
        assert_eq!(b.total, b.weights + b.compute);
        assert_eq!(b.budget, budget_of(w.free_bytes, c));
        assert_eq!(b.free, w.free_bytes);
        assert!(b.total <= b.budget, "expert worker {} fits: {p}", e.worker);
        if let Some(n) = p.experts.get(j + 1) {
            assert!(
                b.total + m.expert_weight_bytes(n.layers[0]) > b.budget,
                "{} had room for layer {}: {p}",
                e.worker,
                n.layers[0]
            );
        }
    }
}

#[test]
fn layer_lists_print_compactly() {
    assert_eq!(fmt_layers(&[3, 4, 5, 7]), "3-5,7");
    assert_eq!(fmt_layers(&[1]), "1");
    assert_eq!(fmt_layers(&[1, 3]), "1,3");
    assert_eq!(fmt_layers(&[0, 1, 5, 6, 7, 9, 10]), "0-1,5-7,9-10");
    assert_eq!(fmt_layers(&[]), "none");
}

/// When the whole model fits the devices, `auto` is the device-only plan:
/// no expert leaves its stage and the expert workers stay idle (a note says so).
#[test]
fn auto_keeps_experts_on_the_devices_when_they_fit() {
    for file in SYNTHETIC {
        let m = synth(file);
        let ws = workers(&[GIB, GIB]);
        let cs = expert_workers(&[GIB]);
        let c = moe_cfg(ExpertPolicy::Auto);
        let device_only = plan(&m, &ws, &c).unwrap();
        let p = plan_with_experts(&m, &ws, &cs, &c).unwrap();
        check_plan(&m, &ws, &c, &p);
        assert_eq!(p.stages, device_only.stages, "{file}");
        assert!(p.experts.is_empty(), "{file}: {p}");
        assert!(offloaded(&p).is_empty());
        assert!(
            p.notes
                .iter()
                .any(|n| n.contains("the whole model fits the devices")
                    && n.contains("expert workers unused: c0")),
            "{file}: {p}"
        );
        // `device` never offloads, whatever the expert workers offer.
        let d = PlanConfig {
            experts: ExpertPolicy::Device,
            ..c.clone()
        };
        let p = plan_with_experts(&m, &ws, &cs, &d).unwrap();
        assert_eq!(p.stages, device_only.stages);
        assert!(p.experts.is_empty());
    }
}

/// When the layers with their experts do not fit, `auto` balances the ranges
/// on the bytes without experts, then gives each stage its layers' experts
/// back in layer order while they fit: the offloaded sets are exactly what
/// that arithmetic gives, every stage fits, and none could take one more
/// layer's experts back. A manual split keeps its ranges the same way.
#[test]
fn auto_offloads_the_fewest_layers_that_fit() {
    for file in SYNTHETIC {
        let m = synth(file);
        let n = m.hparams.n_layer;
        let c = moe_cfg(ExpertPolicy::Auto);
        let x = m
            .expert_layers()
            .iter()
            .map(|&il| m.expert_weight_bytes(il))
            .max()
            .unwrap();
        let mut partial = 0;
        for split in [None, Some(vec![1, n - 1])] {
            let counts_want = split.clone().unwrap_or(vec![n / 2, n - n / 2]);
            let ranges = LayerRange::split(n, &counts_want).unwrap();
            let c = PlanConfig {
                split: split.clone().map(Split::Layers),
                ..c.clone()
            };
            let base: Vec<u64> = ranges.iter().map(|r| without_experts(&m, r, &c)).collect();
            let base_max = *base.iter().max().unwrap();
            // Room on the fuller stage for none, one or two layers' experts.
            for extra in [x / 2, 3 * x / 2, 5 * x / 2] {
                let free = ((base_max + extra) as f64 / 0.9).ceil() as u64;
                let ws = workers(&[free, free]);
                let cs = expert_workers(&[GIB]);
                let p = plan_with_experts(&m, &ws, &cs, &c)
                    .unwrap_or_else(|e| panic!("{file} {split:?} +{extra}: {e}"));
                if let Ok(d) = plan(&m, &ws, &c) {
                    assert_eq!(p.stages, d.stages, "{file}: the device-only plan fits");
                    assert!(p.experts.is_empty());
                    continue;
                }
                assert_eq!(counts(&p), counts_want, "{file} {split:?} +{extra}: {p}");
                let budget = budget_of(free, &c);
                for (i, (s, r)) in p.stages.iter().zip(&ranges).enumerate() {
                    let mut total = base[i];
                    let mut want = Vec::new();
                    for il in moe_in(&m, r) {
                        if want.is_empty() && total + saved(&m, il, &c) <= budget {
                            total += saved(&m, il, &c);
                        } else {
                            want.push(il);
                        }
                    }
                    assert_eq!(
                        s.offloaded, want,
                        "{file} {split:?} +{extra} stage {i}: {p}"
                    );
                    assert_eq!(s.bytes.total, total);
                    if !want.is_empty() && want.len() < moe_in(&m, r).len() {
                        partial += 1;
                    }
                }
                assert!(!offloaded(&p).is_empty(), "{file}: {p}");
                check_expert_plan(&m, &ws, &cs, &c, &p, true);
                assert_eq!(p.experts.len(), 1);
                assert_eq!(p.experts[0].worker, "c0");
                eprintln!("{file} {split:?} +{extra}:\n{p}");
            }
        }
        assert!(
            partial > 0,
            "{file}: some stage kept some experts and offloaded others"
        );
    }
}

/// `cpu` puts every MoE layer's experts on the expert workers, even when
/// the devices could hold them.
#[test]
fn cpu_offloads_every_moe_layer() {
    for file in SYNTHETIC {
        let m = synth(file);
        let ws = workers(&[GIB, GIB]);
        let cs = expert_workers(&[GIB, GIB]);
        let c = moe_cfg(ExpertPolicy::Cpu);
        let p = plan_with_experts(&m, &ws, &cs, &c).unwrap();
        check_expert_plan(&m, &ws, &cs, &c, &p, false);
        assert_eq!(offloaded(&p), m.expert_layers(), "{file}: {p}");
        assert_eq!(p.experts.len(), 1, "c0 holds them all: {p}");
        assert_eq!(p.experts[0].layers, m.expert_layers());
        assert!(p.notes.iter().any(|n| n.contains("--experts cpu")), "{p}");
        assert!(
            p.notes
                .iter()
                .any(|n| n.contains("expert workers unused: c1")),
            "{p}"
        );
    }
}

/// `--gpu-experts K` keeps K of each offloaded layer's n experts on its
/// stage too: K/n of those layers' expert bytes more on the device, capped
/// at n (the whole layer), and the expert workers unchanged.
#[test]
fn gpu_experts_add_k_of_n_experts_per_offloaded_layer() {
    for file in SYNTHETIC {
        let m = synth(file);
        let n_expert = m.hparams.moe.as_ref().unwrap().n_expert;
        let ws = workers(&[GIB, GIB]);
        let cs = expert_workers(&[GIB]);
        let c0 = moe_cfg(ExpertPolicy::Cpu);
        let p0 = plan_with_experts(&m, &ws, &cs, &c0).unwrap();
        for k in [1, 4, n_expert, n_expert + 5] {
            let c = PlanConfig {
                gpu_experts: k,
                ..c0.clone()
            };
            let p = plan_with_experts(&m, &ws, &cs, &c).unwrap();
            check_expert_plan(&m, &ws, &cs, &c, &p, false);
            assert_eq!(p.experts, p0.experts, "the expert workers hold them all");
            for (s, s0) in p.stages.iter().zip(&p0.stages) {
                assert_eq!(s.offloaded, s0.offloaded);
                let more: u64 = s
                    .offloaded
                    .iter()
                    .map(|&il| {
                        m.expert_weight_bytes(il) * u64::from(k.min(n_expert)) / u64::from(n_expert)
                    })
                    .sum();
                assert!(more > 0 || s.offloaded.is_empty());
                assert_eq!(s.bytes.weights, s0.bytes.weights + more, "{file} K={k}");
                if k >= n_expert {
                    assert_eq!(s.bytes.weights, m.range_weight_bytes(&s.range));
                }
            }
            assert!(p.notes.iter().any(|n| n.contains(&format!(
                "also holds {} of the {n_expert} routed experts",
                k.min(n_expert)
            ))));
        }
    }
}

/// Expert workers are filled in order, each to its budget less its compute
/// buffer; experts that fit none is an error naming the last worker and
/// the numbers.
#[test]
fn expert_workers_fill_in_order_or_the_plan_fails_with_the_numbers() {
    let m = synth("tiny-deepseek2-mla-f32.gguf");
    let c = moe_cfg(ExpertPolicy::Cpu);
    let ws = workers(&[GIB]);
    let compute = expert_compute_estimate(&m.hparams, c.n_ubatch);
    let layers = m.expert_layers();
    let x = m.expert_weight_bytes(layers[0]);
    // Room for one layer and a half: c0 takes layer 1, c1 the rest.
    let one = ((compute + 3 * x / 2) as f64 / 0.9).ceil() as u64;
    let cs = expert_workers(&[one, GIB]);
    let p = plan_with_experts(&m, &ws, &cs, &c).unwrap();
    check_expert_plan(&m, &ws, &cs, &c, &p, false);
    assert_eq!(p.experts[0].layers, &layers[..1]);
    assert_eq!(p.experts[1].layers, &layers[1..]);
    let text = p.to_string();
    assert!(
        text.contains(&format!(
            "stage 0 (w0): experts of layers {} go to c0 ({}), c1 ({})",
            fmt_layers(&layers),
            layers[0],
            fmt_layers(&layers[1..])
        )),
        "{text}"
    );

    // Too little for all of them: the error names c1, what it holds and offers.
    let cs = expert_workers(&[one, one]);
    let e = plan_with_experts(&m, &ws, &cs, &c).unwrap_err();
    let PlanError::ExpertsDoNotFit(nf) = &e else {
        panic!("expected ExpertsDoNotFit, got {e}")
    };
    assert_eq!(nf.worker, "c1");
    assert_eq!(nf.layer, layers[2]);
    assert_eq!(nf.left, &layers[2..]);
    let msg = e.to_string();
    for want in [
        format!(
            "the routed experts of layer {} need {}",
            layers[2],
            fmt_bytes(x)
        ),
        format!(
            "the last, c1 (numa1), has {} free ({} total, 10% headroom: {} usable, {} of it for its compute buffer)",
            fmt_bytes(one),
            fmt_bytes(one + GIB),
            fmt_bytes(budget_of(one, &c)),
            fmt_bytes(compute)
        ),
        format!("holds {} of experts (layer {})", fmt_bytes(x), layers[1]),
        format!(
            "the experts of layer {} are left without an expert worker",
            layers[2]
        ),
        format!(
            "in all the offloaded experts need {} but the expert workers offer {}",
            fmt_bytes(layers.iter().map(|&il| m.expert_weight_bytes(il)).sum()),
            fmt_bytes(2 * (budget_of(one, &c) - compute))
        ),
    ] {
        assert!(msg.contains(&want), "missing '{want}' in: {msg}");
    }

    // An expert worker smaller than its compute buffer holds nothing.
    let cs = expert_workers(&[compute / 2]);
    let msg = plan_with_experts(&m, &ws, &cs, &c).unwrap_err().to_string();
    assert!(msg.contains("holds no experts"), "{msg}");
    assert!(
        msg.contains(&format!("layers {}", fmt_layers(&layers))),
        "{msg}"
    );
}

/// A device that cannot hold its layers even without their routed experts
/// fails as any stage that does not fit, saying the experts were already off.
#[test]
fn a_stage_too_small_even_without_experts_fails_with_the_numbers() {
    let m = synth("tiny-qwen3moe-f32.gguf");
    let n = m.hparams.n_layer;
    let ranges = LayerRange::split(n, &[n / 2, n - n / 2]).unwrap();
    let c = moe_cfg(ExpertPolicy::Auto);
    let need = without_experts(&m, &ranges[1], &c);
    let ws = workers(&[GIB, need / 2]);
    let cs = expert_workers(&[GIB]);
    for policy in [ExpertPolicy::Auto, ExpertPolicy::Cpu] {
        let c = PlanConfig {
            experts: policy,
            ..c.clone()
        };
        let e = plan_with_experts(&m, &ws, &cs, &c).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, PlanError::DoesNotFit(_)), "{msg}");
        assert!(msg.contains("(worker w1, cpu)"), "{msg}");
        assert!(
            msg.contains("with the routed experts of every MoE layer on the expert workers"),
            "{msg}"
        );
    }
}

/// A tiny dense qwen3 file (the qwen3moe fixture's attention with a dense FFN).
fn write_dense_qwen3(path: &std::path::Path) {
    use omni_engine::gguf::{Gguf, Value};
    let tiny = omni_engine::gguf::Gguf::open(common::synthetic("tiny-qwen3moe-f32.gguf")).unwrap();
    let kvs: Vec<(String, Value)> = tiny
        .metadata()
        .iter()
        .filter(|(k, _)| !k.contains("expert"))
        .map(|(k, v)| match k.as_str() {
            "general.architecture" => (k.clone(), Value::String("qwen3".into())),
            _ => (k.replacen("qwen3moe.", "qwen3.", 1), v.clone()),
        })
        .collect();
    let ff = m_u64(&tiny, "qwen3moe.feed_forward_length");
    let e = m_u64(&tiny, "qwen3moe.embedding_length");
    let mut tensors: Vec<(String, Vec<u64>)> = Vec::new();
    for t in tiny.tensors() {
        if t.name.contains("_exps") || t.name.contains("ffn_gate_inp") {
            continue;
        }
        tensors.push((t.name.clone(), t.dims.clone()));
        if let Some(blk) = t.name.strip_suffix("ffn_norm.weight") {
            tensors.push((format!("{blk}ffn_gate.weight"), vec![e, ff]));
            tensors.push((format!("{blk}ffn_up.weight"), vec![e, ff]));
            tensors.push((format!("{blk}ffn_down.weight"), vec![ff, e]));
        }
    }
    fn m_u64(g: &Gguf, k: &str) -> u64 {
        u64::from(g.get_u32(k).unwrap())
    }
    let shapes: Vec<(&str, &[u64])> = tensors
        .iter()
        .map(|(n, d)| (n.as_str(), d.as_slice()))
        .collect();
    common::write_sparse_gguf(path, &kvs, &shapes);
}

#[test]
fn the_expert_policy_is_checked_against_workers_and_model() {
    let moe = synth("tiny-qwen3moe-f32.gguf");
    let ws = workers(&[GIB]);
    let cs = expert_workers(&[GIB]);
    let e = plan_with_experts(&moe, &ws, &[], &moe_cfg(ExpertPolicy::Cpu)).unwrap_err();
    assert!(matches!(e, PlanError::Config(_)), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("--experts cpu") && msg.contains("expert workers") && msg.contains("none"),
        "{msg}"
    );

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-qwen3-dense.gguf");
    write_dense_qwen3(&path);
    let dense = ModelFile::open(&path).unwrap();
    assert!(dense.expert_layers().is_empty());
    let e = plan_with_experts(&dense, &ws, &cs, &moe_cfg(ExpertPolicy::Cpu)).unwrap_err();
    assert!(matches!(e, PlanError::Config(_)), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("qwen3 model has no routed experts"), "{msg}");
    // `auto` on a dense model is the device-only plan, with a note.
    let c = moe_cfg(ExpertPolicy::Auto);
    let p = plan_with_experts(&dense, &ws, &cs, &c).unwrap();
    assert_eq!(p.stages, plan(&dense, &ws, &c).unwrap().stages);
    assert!(p.experts.is_empty());
    assert!(
        p.notes
            .iter()
            .any(|n| n.contains("no routed experts") && n.contains("unused: c0")),
        "{p}"
    );
}

/// The table marks each stage's offloaded layers, lists the expert workers,
/// and the notes say why; the JSON round-trips, and a plan written before
/// experts existed still reads.
#[test]
fn a_plan_with_offloaded_experts_prints_why_and_round_trips() {
    let m = synth("tiny-qwen3moe-f32.gguf");
    let n = m.hparams.n_layer;
    let c = moe_cfg(ExpertPolicy::Auto);
    let ranges = LayerRange::split(n, &[n / 2, n - n / 2]).unwrap();
    let base: Vec<u64> = ranges.iter().map(|r| without_experts(&m, r, &c)).collect();
    let x = m.expert_weight_bytes(0);
    let free = ((*base.iter().max().unwrap() + 3 * x / 2) as f64 / 0.9).ceil() as u64;
    let ws = workers(&[free, free]);
    let cs = expert_workers(&[GIB]);
    let p = plan_with_experts(&m, &ws, &cs, &c).unwrap();
    check_expert_plan(&m, &ws, &cs, &c, &p, true);
    let text = p.to_string();
    for want in [
        "experts out",
        "expert workers:",
        "c0      numa0",
        "10% headroom) less its compute buffer",
        "expert compute: upper bound of an expert worker's compute buffer for a step of 64 tokens",
    ] {
        assert!(text.contains(want), "missing '{want}' in:\n{text}");
    }
    for (i, s) in p.stages.iter().enumerate() {
        assert!(!s.offloaded.is_empty(), "{text}");
        let out: u64 = s.offloaded.iter().map(|&il| saved(&m, il, &c)).sum();
        let want = format!(
            "experts: stage {i} ({}): experts of layer{} {} go to c0: with them stage {i} would need {}, it has {} usable",
            s.worker,
            if s.offloaded.len() == 1 { "" } else { "s" },
            fmt_layers(&s.offloaded),
            fmt_bytes(s.bytes.total + out),
            fmt_bytes(s.bytes.budget)
        );
        assert!(text.contains(&want), "missing '{want}' in:\n{text}");
    }
    let json = serde_json::to_string(&p).unwrap();
    let back: Plan = serde_json::from_str(&json).unwrap();
    assert_eq!(back, p);

    let dense = plan(&m, &workers(&[GIB]), &c).unwrap();
    let mut old = serde_json::to_value(&dense).unwrap();
    old.as_object_mut().unwrap().remove("experts");
    let cfg = old["config"].as_object_mut().unwrap();
    cfg.remove("experts");
    cfg.remove("gpu_experts");
    for s in old["stages"].as_array_mut().unwrap() {
        s.as_object_mut().unwrap().remove("offloaded");
    }
    let back: Plan = serde_json::from_value(old).unwrap();
    assert_eq!(back, dense);
}

/// The expert-worker compute estimate bounds what `ExpertStage::load`
/// really reserves, and not by much: actual <= estimate <= 2 x actual + 16
/// MiB; and the expert weights it maps are exactly `expert_weight_bytes`.
#[test]
fn expert_compute_estimate_bounds_the_real_expert_buffer() {
    use omni_engine::{ExpertConfig, ExpertStage};
    let dir = tempfile::tempdir().unwrap();
    let v3 = dir.path().join("deepseek-v3-shaped.gguf");
    write_deepseek_v3_shaped(&v3, 2, 16);
    let mut paths: Vec<std::path::PathBuf> =
        SYNTHETIC.iter().map(|f| common::synthetic(f)).collect();
    paths.push(common::synthetic("tiny-qwen3moe-q4_k_m.gguf"));
    paths.push(v3);
    for path in paths {
        let m = ModelFile::open(&path).unwrap();
        let layers = m.expert_layers();
        for n_ubatch in [1, 64, 512] {
            let cfg = ExpertConfig {
                n_ubatch,
                n_threads: 1,
                repack: false,
            };
            let st = ExpertStage::load(m.clone(), &layers, cfg).unwrap();
            let actual = st.compute_bytes() as u64;
            let est = expert_compute_estimate(&m.hparams, n_ubatch);
            eprintln!(
                "{} ubatch {n_ubatch}: actual {actual}, estimate {est} ({:.3}x)",
                path.display(),
                est as f64 / actual as f64
            );
            assert!(
                actual <= est && est <= 2 * actual + 16 * MIB,
                "{} ubatch {n_ubatch}: actual {actual}, estimate {est}",
                path.display()
            );
            let bytes: u64 = layers.iter().map(|&il| m.expert_weight_bytes(il)).sum();
            assert_eq!(st.weight_bytes(), bytes);
        }
    }
}

/// DeepSeek-V3 shapes (16 layers, 64 experts of 2048: 11 GiB of F32
/// experts per MoE layer) on two 24 GiB devices and a 512 GiB expert
/// worker: the devices alone cannot hold it, so most layers' experts go to
/// c0, each stage keeps what it can, and everything fits.
#[test]
fn a_deepseek_v3_shaped_model_offloads_most_experts_and_fits() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("deepseek-v3-shaped.gguf");
    write_deepseek_v3_shaped(&path, 16, 64);
    let m = ModelFile::open(&path).unwrap();
    let ws = workers(&[24 * GIB, 24 * GIB]);
    let cs = expert_workers(&[512 * GIB]);
    let c = PlanConfig {
        n_ctx: 4096,
        n_seq: 1,
        ..cfg(None)
    };
    let e = plan(&m, &ws, &c).unwrap_err();
    assert!(matches!(e, PlanError::DoesNotFit(_)), "{e}");
    let p = plan_with_experts(&m, &ws, &cs, &c).unwrap();
    eprintln!("{p}");
    check_expert_plan(&m, &ws, &cs, &c, &p, true);
    let moe = m.expert_layers();
    let out = offloaded(&p);
    assert!(
        2 * out.len() > moe.len(),
        "most of the {} MoE layers' experts offloaded, not {}: {p}",
        moe.len(),
        out.len()
    );
    assert!(out.len() < moe.len(), "the devices keep some experts: {p}");
    assert_eq!(p.experts.len(), 1);
    assert_eq!(p.experts[0].layers, out);
}

/// The plan says how a decode step's work divides between the stages: the
/// weight bytes each reads per token, from the tensor table. Gemma's output
/// head is its 262,144-row embedding again (tied), so the last stage does
/// most of the work whatever the split; the first only looks rows up.
#[test]
fn the_plan_says_how_a_steps_work_divides() {
    let m = model(GEMMA);
    let p = plan(&m, &workers(&[8 * GIB, 8 * GIB]), &cfg(None)).unwrap();
    let split = p.stages[1].range.layers.start;
    let size = |keep: &dyn Fn(&str) -> bool| -> u64 {
        m.gguf
            .tensors()
            .iter()
            .filter(|t| keep(&t.name))
            .map(|t| t.size)
            .sum()
    };
    let layer = |name: &str| {
        name.strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<u32>().ok())
    };
    let first = size(&|n| layer(n).is_some_and(|l| l < split));
    let last = size(&|n| {
        layer(n).is_some_and(|l| l >= split)
            || n == "token_embd.weight"
            || n == "output_norm.weight"
    });
    let total = (first + last) as f64;
    let note = p.notes.iter().find(|n| n.starts_with("work: ")).unwrap();
    let want = format!(
        "about {} of weights (stage 0 {:.0}%, stage 1 {:.0}%",
        fmt_bytes(first + last),
        100.0 * first as f64 / total,
        100.0 * last as f64 / total
    );
    assert!(note.contains(&want), "{note}\nwanted: {want}");
    assert!(last > first, "the tied head dominates: {note}");
    // One stage: nothing to divide.
    let one = plan(&m, &workers(&[8 * GIB]), &cfg(None)).unwrap();
    assert!(!one.notes.iter().any(|n| n.starts_with("work: ")));
}
