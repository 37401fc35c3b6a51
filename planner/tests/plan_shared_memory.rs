//! Workers that compute on the same memory (several CPU workers, and expert
//! workers, on one host; two workers on one GPU) get one budget in the
//! planner, the largest of their offers, not the sum: each offers what that
//! memory has free. On the synthetic files, so that no download is needed;
//! every offer is worked out from the file with the same planner.

use std::sync::Arc;

use omni_engine::model::ModelFile;
use omni_planner::{
    fmt_bytes, plan, plan_with_experts, ExpertPolicy, MemoryPool, Plan, PlanConfig, PlanError,
    Split, WorkerSpec,
};

#[path = "../../engine/tests/common/mod.rs"]
mod common;
use common::fixtures_dir;

fn synth(name: &str) -> Arc<ModelFile> {
    ModelFile::open(fixtures_dir().join("synthetic").join(name)).unwrap()
}

/// A worker offering `free` on `device`, on `host`'s memory (None: its own).
fn worker(id: &str, device: &str, free: u64, host: Option<&str>) -> WorkerSpec {
    WorkerSpec {
        id: id.into(),
        device: device.into(),
        free_bytes: free,
        total_bytes: free,
        read_rate: 0,
        pool: host.map(|h| MemoryPool {
            key: format!("{h}-id/ram"),
            name: format!("host {h}'s RAM"),
        }),
    }
}

fn cfg() -> PlanConfig {
    PlanConfig {
        n_ctx: 256,
        n_seq: 4,
        n_ubatch: 64,
        ..PlanConfig::default()
    }
}

fn totals(p: &Plan) -> Vec<u64> {
    p.stages.iter().map(|s| s.bytes.total).collect()
}

/// What to offer so that a budget (after `headroom`) is `bytes`.
fn offer_for(bytes: u64, headroom: f64) -> u64 {
    (bytes as f64 / (1.0 - headroom)).ceil() as u64
}

fn usable(free: u64, headroom: f64) -> u64 {
    (free as f64 * (1.0 - headroom)).floor() as u64
}

/// Two workers on one host, each offering enough for its own stage but
/// not, together, for both: on one memory the plan is refused, naming the
/// shared memory and the numbers; on two hosts the same offers add up.
#[test]
fn two_workers_on_one_host_get_one_budget_not_two() {
    let m = synth("tiny-qwen3moe-f32.gguf");
    let c = cfg();
    let roomy = [
        worker("w0", "cpu", 1 << 40, None),
        worker("w1", "cpu", 1 << 40, None),
    ];
    let need = totals(&plan(&m, &roomy, &c).unwrap());
    let sum: u64 = need.iter().sum();
    let max = *need.iter().max().unwrap();
    // Room for either stage and for 3/4 of both.
    let budget = (sum * 3 / 4).max(max + (1 << 20));
    assert!(
        budget < sum,
        "the stages are too uneven for this test: {need:?}"
    );
    let offer = offer_for(budget, c.headroom);

    // Offers on two hosts add up: it fits.
    let apart = [
        worker("w0", "cpu", offer, Some("box1")),
        worker("w1", "cpu", offer, Some("box2")),
    ];
    let p = plan(&m, &apart, &c).unwrap();
    assert!(
        !p.notes.iter().any(|n| n.starts_with("memory:")),
        "nothing is shared: {p}"
    );
    assert_eq!(
        plan(
            &m,
            &[
                worker("w0", "cpu", offer, None),
                worker("w1", "cpu", offer, None)
            ],
            &c
        )
        .unwrap()
        .stages,
        p.stages,
        "workers on hosts of their own plan as workers without a host"
    );

    // The same offers on one host are one memory: refused, saying so.
    let together = [
        worker("w0", "cpu", offer, Some("box1")),
        worker("w1", "cpu", offer, Some("box1")),
    ];
    let e = plan(&m, &together, &c).unwrap_err();
    let msg = e.to_string();
    let PlanError::SharedDoesNotFit(nf) = &e else {
        panic!("expected SharedDoesNotFit, got {msg}")
    };
    assert_eq!(nf.workers, "w0 and w1");
    assert_eq!(nf.memory, "host box1's RAM");
    assert_eq!(nf.budget, usable(offer, c.headroom));
    assert!(nf.need > nf.budget, "{msg}");
    for part in [
        format!("model needs {} on w0 and w1 together", fmt_bytes(nf.need)),
        "but they share host box1's RAM".to_string(),
        format!("which has {} free", fmt_bytes(offer)),
        format!("{} usable", fmt_bytes(nf.budget)),
        "counted once, not once per worker".to_string(),
        "stage 0".to_string(),
        "stage 1".to_string(),
        "another host or GPU".to_string(),
    ] {
        assert!(msg.contains(&part), "the error says '{part}': {msg}");
    }
    eprintln!("{msg}");

    // A manual split is checked the same way and never moved.
    let manual = PlanConfig {
        split: Some(Split::Layers(
            p.stages
                .iter()
                .map(|s| s.range.layers.len() as u32)
                .collect(),
        )),
        ..c.clone()
    };
    let e = plan(&m, &together, &manual).unwrap_err().to_string();
    assert!(
        e.contains("share host box1's RAM") && e.contains("the manual split"),
        "{e}"
    );
}

/// A fitting plan on shared memory says who shares it, what it holds and
/// that a worker's own offer still caps it alone.
#[test]
fn the_plan_says_who_shares_which_memory() {
    let m = synth("tiny-qwen3moe-f32.gguf");
    let c = cfg();
    let ws = [
        worker("w0", "cpu", 8 << 30, Some("box1")),
        worker("w1", "cpu", 1 << 30, Some("box1")),
    ];
    let p = plan(&m, &ws, &c).unwrap();
    let text = p.to_string();
    let note = p
        .notes
        .iter()
        .find(|n| n.starts_with("memory:"))
        .unwrap_or_else(|| panic!("a memory note: {text}"));
    let all: u64 = totals(&p).iter().sum();
    for part in [
        "memory: w0 and w1 share host box1's RAM, 8.0 GiB free".to_string(),
        format!(
            "({} usable after 10% headroom)",
            fmt_bytes(usable(8 << 30, 0.1))
        ),
        "counted once".to_string(),
        "a worker's own offer still caps it alone".to_string(),
        format!("the plan puts {} on it", fmt_bytes(all)),
    ] {
        assert!(note.contains(&part), "the note says '{part}': {note}");
    }
    assert!(text.contains(note.as_str()), "{text}");
    // w1's own 1 GiB still bounds w1: its stage's budget is its own.
    assert_eq!(p.stages[1].bytes.budget, usable(1 << 30, 0.1));
}

/// When the automatic split would overfill the memory two workers share,
/// layers move to a worker with memory of its own, and the plan says so.
#[test]
fn layers_move_off_shared_memory_to_a_worker_with_its_own() {
    let m = synth("tiny-qwen3moe-f32.gguf");
    let c = cfg();
    let n = m.hparams.n_layer;
    assert!(n >= 3, "needs a layer per worker");
    let big = 1u64 << 40;
    let roomy = [
        worker("w0", "cpu", big, None),
        worker("w1", "cpu", big, None),
        worker("w2", "cpu", big, None),
    ];
    let even = plan(&m, &roomy, &c).unwrap();
    let t = totals(&even);
    // Room on box1 for w0 and w1 as they are split now, less a little: the
    // even split no longer fits, the split with more on w2 does.
    let on_box1 = t[0] + t[1];
    let least = plan(
        &m,
        &roomy,
        &PlanConfig {
            split: Some(Split::Layers(vec![1, 1, n - 2])),
            ..c.clone()
        },
    )
    .unwrap();
    let least_box1 = least.stages[0].bytes.total + least.stages[1].bytes.total;
    assert!(
        least_box1 < on_box1,
        "moving layers to w2 must take bytes off box1: {even}"
    );
    let budget = (least_box1 + on_box1) / 2;
    let ws = [
        worker("w0", "cpu", offer_for(budget, c.headroom), Some("box1")),
        worker("w1", "cpu", offer_for(budget, c.headroom), Some("box1")),
        worker("w2", "cpu", big, Some("box2")),
    ];
    let p = plan(&m, &ws, &c).unwrap_or_else(|e| panic!("{e}"));
    let got = totals(&p);
    assert!(
        got[0] + got[1] <= usable(offer_for(budget, c.headroom), c.headroom),
        "w0 and w1 together within box1's budget: {p}"
    );
    assert!(
        p.stages[2].range.layers.len() > even.stages[2].range.layers.len(),
        "w2 took layers: {p}\nwas {even}"
    );
    assert!(
        p.notes
            .iter()
            .any(|n| n.contains("w0 and w1 share host box1's RAM")
                && n.contains("layers moved to other workers")),
        "{p}"
    );
}

/// In-all figures count shared memory once: "the workers offer N after
/// headroom" is not the sum of offers that are the same memory.
#[test]
fn the_workers_offer_counts_shared_memory_once() {
    let m = synth("tiny-qwen3moe-f32.gguf");
    let c = cfg();
    let n = m.hparams.n_layer;
    let roomy = [
        worker("w0", "cpu", 1 << 40, None),
        worker("w1", "cpu", 1 << 40, None),
    ];
    let lopsided = PlanConfig {
        split: Some(Split::Layers(vec![n - 1, 1])),
        ..c.clone()
    };
    let need = totals(&plan(&m, &roomy, &lopsided).unwrap());
    let sum: u64 = need.iter().sum();
    // Each offers a bit more than half of it all: stage 0 does not fit its
    // worker; in all, two offers would do, one does not.
    let offer = offer_for(sum / 2 + (sum / 8), c.headroom);
    assert!(need[0] > usable(offer, c.headroom), "{need:?}");
    let one_host = [
        worker("w0", "cpu", offer, Some("box1")),
        worker("w1", "cpu", offer, Some("box1")),
    ];
    let msg = plan(&m, &one_host, &lopsided).unwrap_err().to_string();
    assert!(
        msg.contains(&format!(
            "the workers offer {} after headroom (memory they share counted once: w0 and w1 share host box1's RAM)",
            fmt_bytes(usable(offer, c.headroom))
        )),
        "{msg}"
    );
    let two_hosts = [
        worker("w0", "cpu", offer, Some("box1")),
        worker("w1", "cpu", offer, Some("box2")),
    ];
    let msg = plan(&m, &two_hosts, &lopsided).unwrap_err().to_string();
    assert!(
        msg.contains("model needs") && !msg.contains("in all"),
        "apart, the two offers cover it all: {msg}"
    );
}

/// An expert worker on the host of a CPU stage shares its RAM: it gets
/// what the stage leaves, and when that is too little the error says so.
#[test]
fn an_expert_worker_gets_what_the_stages_on_its_host_leave() {
    let m = synth("tiny-deepseek2-mla-f32.gguf");
    let c = PlanConfig {
        experts: ExpertPolicy::Cpu,
        ..cfg()
    };
    let big = 1u64 << 40;
    let roomy = plan_with_experts(
        &m,
        &[worker("w0", "cpu", big, None)],
        &[worker("c0", "cpu", big, None)],
        &c,
    )
    .unwrap();
    let stage = roomy.stages[0].bytes.total;
    let experts = roomy.experts[0].bytes.total;
    // Room for either, not for both.
    let offer = offer_for(stage.max(experts) + (stage.min(experts) / 2), c.headroom);
    let apart = plan_with_experts(
        &m,
        &[worker("w0", "cpu", offer, Some("box1"))],
        &[worker("c0", "cpu", offer, Some("box2"))],
        &c,
    )
    .unwrap();
    assert_eq!(apart.experts[0].layers, roomy.experts[0].layers);

    let e = plan_with_experts(
        &m,
        &[worker("w0", "cpu", offer, Some("box1"))],
        &[worker("c0", "cpu", offer, Some("box1"))],
        &c,
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PlanError::ExpertsDoNotFit(_)), "{msg}");
    assert!(
        msg.contains(&format!(
            "c0 shares host box1's RAM with w0: they use {} of its {} usable, which leaves {} to c0",
            fmt_bytes(stage),
            fmt_bytes(usable(offer, c.headroom)),
            fmt_bytes(usable(offer, c.headroom) - stage),
        )),
        "{msg}"
    );
}

/// Offered the CPU beside GPUs, the planner gives it layers; the plan says
/// they run at the CPU's speed and how to keep them on the GPUs.
#[test]
fn layers_on_the_cpu_beside_gpus_say_how_to_keep_them_on_the_gpus() {
    let m = synth("tiny-qwen3moe-f32.gguf");
    let c = cfg();
    let ws = [
        worker("w0", "cuda:0", 1 << 30, None),
        worker("w1", "cpu", 64 << 30, None),
    ];
    let p = plan(&m, &ws, &c).unwrap();
    let note = p
        .notes
        .iter()
        .find(|n| n.starts_with("cpu:"))
        .unwrap_or_else(|| panic!("a note on the CPU's layers: {p}"));
    for part in [
        format!("w1 (cpu) runs {}", p.stages[1].range),
        "beside the GPUs".to_string(),
        "run at its speed".to_string(),
        "to keep them on the GPUs".to_string(),
        "leave the CPU out".to_string(),
        "--counts".to_string(),
    ] {
        assert!(note.contains(&part), "the note says '{part}': {note}");
    }
    // GPUs alone, or CPUs alone: nothing to say.
    for devices in [["cuda:0", "cuda:1"], ["cpu", "cpu"]] {
        let ws = [
            worker("w0", devices[0], 8 << 30, None),
            worker("w1", devices[1], 8 << 30, None),
        ];
        let p = plan(&m, &ws, &c).unwrap();
        assert!(!p.notes.iter().any(|n| n.starts_with("cpu:")), "{p}");
    }
}

/// Worker specs written before the pool existed still read.
#[test]
fn worker_specs_without_a_pool_still_read() {
    let old = r#"{"id":"w0","device":"cpu","free_bytes":1024,"total_bytes":2048}"#;
    let w: WorkerSpec = serde_json::from_str(old).unwrap();
    assert_eq!(w.pool, None);
    assert_eq!(w.read_rate, 0);
    let json = serde_json::to_string(&w).unwrap();
    assert!(!json.contains("pool"), "{json}");
    let pooled = worker("w1", "cpu", 1024, Some("box1"));
    let back: WorkerSpec = serde_json::from_str(&serde_json::to_string(&pooled).unwrap()).unwrap();
    assert_eq!(back, pooled);
}
