//! Routed experts on expert workers.

use super::estimates::write_deepseek_v3_shaped;
use super::*;

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
pub(super) fn moe_cfg(experts: ExpertPolicy) -> PlanConfig {
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
pub(super) fn saved(m: &ModelFile, il: u32, c: &PlanConfig) -> u64 {
    m.expert_weight_bytes(il) - kept(m, il, c)
}

fn moe_in(m: &ModelFile, r: &LayerRange) -> Vec<u32> {
    r.layers
        .clone()
        .filter(|&il| m.expert_weight_bytes(il) > 0)
        .collect()
}

pub(super) fn offloaded(p: &Plan) -> Vec<u32> {
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
        + compute_estimate(&m.hparams, r, c, false)
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
        assert_eq!(
            b.compute,
            compute_estimate(hp, &s.range, c, is_gpu(&s.device))
        );
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

/// A GPU stage left with offloaded layers keeps room in its compute buffer
/// for the largest of their routed experts, streamed there for prompt
/// steps (`--stream-experts`), when its budget has it; a CPU stage never
/// does, and a GPU stage without room says so.
#[test]
fn gpu_stages_keep_room_to_stream_one_layers_experts_where_it_fits() {
    let m = synth("tiny-deepseek2-mla-f32.gguf");
    let c = moe_cfg(ExpertPolicy::Cpu);
    let cs = expert_workers(&[GIB]);
    let largest = m
        .expert_layers()
        .iter()
        .map(|&il| m.expert_weight_bytes(il))
        .max()
        .unwrap();
    let gpus = specs("g", |i| format!("cuda:{i}"), &[GIB, GIB]);
    let p = plan_with_experts(&m, &gpus, &cs, &c).unwrap();
    let cpu = plan_with_experts(&m, &workers(&[GIB, GIB]), &cs, &c).unwrap();
    for (s, on_cpu) in p.stages.iter().zip(&cpu.stages) {
        assert_eq!(on_cpu.stream_bytes, 0, "{cpu}");
        if s.offloaded.is_empty() {
            assert_eq!(s.stream_bytes, 0, "{p}");
            continue;
        }
        let want = s
            .offloaded
            .iter()
            .map(|&il| m.expert_weight_bytes(il))
            .max()
            .unwrap();
        assert!(want <= largest);
        assert_eq!(s.stream_bytes, want, "{p}");
        // Counted in the compute buffer: the CPU plan's stage plus the room.
        assert_eq!(
            s.bytes.compute,
            on_cpu.bytes.compute + want + gpu_copies(&m, s, &c)
        );
        assert_eq!(
            s.bytes.total,
            s.bytes.weights + s.bytes.kv + s.bytes.compute
        );
    }
    assert!(
        p.notes
            .iter()
            .any(|n| n.contains("prompt steps stream them to cuda:")),
        "{p}"
    );

    // A GPU with just enough for its stage without the room: no streaming.
    let tight: Vec<u64> = p
        .stages
        .iter()
        .map(|s| {
            let need = s.bytes.total - s.stream_bytes;
            (need as f64 / (1.0 - c.headroom)).ceil() as u64 + 1
        })
        .collect();
    let p = plan_with_experts(&m, &specs("g", |i| format!("cuda:{i}"), &tight), &cs, &c).unwrap();
    assert!(p.stages.iter().all(|s| s.stream_bytes == 0), "{p}");
    assert!(
        p.notes.iter().any(|n| n.contains("no room on cuda:")),
        "{p}"
    );
}

/// What a GPU stage's compute estimate holds beyond the CPU's (the copies
/// ggml's scheduler keeps in both memories).
fn gpu_copies(m: &ModelFile, s: &omni_planner::StagePlan, c: &PlanConfig) -> u64 {
    compute_estimate(&m.hparams, &s.range, c, true)
        - compute_estimate(&m.hparams, &s.range, c, false)
}
