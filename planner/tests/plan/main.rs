//! The layer planner on the real test models (gemma3 270M, qwen2.5-coder
//! 0.5B) and the synthetic MoE files: splits a user would see, the errors
//! they would read, routed experts on expert workers, and the compute-buffer
//! estimates checked against stages the engine really loads.

use std::sync::Arc;

use omni_engine::kv::KvConfig;
use omni_engine::model::ModelFile;
use omni_engine::stage::{LayerRange, Stage, StageConfig};
use omni_planner::{
    compute_estimate, expert_compute_estimate, fmt_bytes, fmt_layers, is_gpu, parse_size, plan,
    plan_with_experts, work_per_token, ExpertPolicy, Plan, PlanConfig, PlanError, Split,
    WorkerSpec,
};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

#[path = "../../../engine/tests/common/mod.rs"]
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
        assert_eq!(
            b.compute,
            compute_estimate(hp, &s.range, c, is_gpu(&s.device))
        );
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

mod dense;
mod estimates;
mod experts;
