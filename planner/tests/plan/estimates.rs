//! The compute-buffer estimates against stages the engine really loads, GPU embeddings, and DeepSeek-V3-shaped models.

use super::experts::{moe_cfg, offloaded, saved};
use super::*;

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
        deterministic: false,
        expert_overlap: false,
        shared_overlap: false,
        local_experts: Default::default(),
    };
    let actual = Stage::load(m.clone(), r.clone(), sc)
        .unwrap()
        .compute_bytes() as u64;
    (actual, compute_estimate(&m.hparams, r, &c, false))
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
pub(super) fn write_deepseek_v3_shaped(path: &std::path::Path, n_layer: u64, n_expert: u64) {
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
