//! Shared helpers for the engine's integration tests: where the fixtures
//! and the real model files are.
#![allow(dead_code)]

use std::path::PathBuf;

/// The machine's cores, for one test at a time: a test that computes a
/// real model on two threads holds this while it computes, so that a test
/// binary run with several test threads (scripts/test runs two) computes
/// one such test at a time. Two at once on 2 cores fight at every ggml
/// barrier, a thread waiting for one the other test preempted:
/// reference.rs took 189 s two at a time and 122 s one at a time (6 CPU
/// minutes against 3.6, on a 2-core Zen 5).
pub fn cores() -> std::sync::MutexGuard<'static, ()> {
    static CORES: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // A test that failed holding it poisons it; the next test still runs.
    CORES.lock().unwrap_or_else(|e| e.into_inner())
}

/// `../shared/fixtures` beside the checkout (or `OMNI_FIXTURES_DIR`).
pub fn fixtures_dir() -> PathBuf {
    if let Ok(d) = std::env::var("OMNI_FIXTURES_DIR") {
        return PathBuf::from(d);
    }
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    for cand in [
        manifest.join("../../shared/fixtures"),
        manifest.join("../shared/fixtures"),
    ] {
        if cand.join("README.md").exists() {
            return cand;
        }
    }
    panic!("fixtures not found: expected ../shared/fixtures beside the checkout, or set OMNI_FIXTURES_DIR")
}

pub fn models_dir() -> PathBuf {
    match std::env::var_os("OMNI_MODELS_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/omni/models")
        }
    }
}

/// A real model fetched by `omnictl fetch NAME`. Missing files are a test
/// failure with the command to run, never a silent skip.
pub fn model(file: &str) -> PathBuf {
    let p = models_dir().join(file);
    assert!(
        p.exists(),
        "{} is missing: run `cargo run --release -p omnictl -- fetch {}` first",
        p.display(),
        fetch_name(file)
    );
    p
}

fn fetch_name(file: &str) -> &'static str {
    if file.starts_with("gemma") {
        "gemma3-270m"
    } else {
        "qwen2.5-coder-0.5b"
    }
}

pub const GEMMA: &str = "gemma3-270m-q4_k_m.gguf";
pub const QWEN: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

pub fn json(name: &str) -> serde_json::Value {
    let p = fixtures_dir().join(name);
    serde_json::from_str(
        &std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
    )
    .unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

// The synthetic fixtures.

/// The fixtures' runtime: n_ctx = max(256, ...) = 256, the whole prompt in
/// one ubatch, 2 threads.
pub fn config() -> omni_engine::StageConfig {
    let mut cfg = omni_engine::StageConfig::default();
    cfg.kv.n_ctx = 256;
    cfg.kv.n_seq = 1;
    cfg.n_ubatch = 512;
    cfg.n_threads = 2;
    cfg
}

/// Gemma 3's whole model in one stage: 256 positions for each of `n_seq`
/// sequences, steps of up to 128 tokens.
pub fn gemma_stage(n_seq: usize, n_threads: usize) -> omni_engine::Stage {
    let mut cfg = omni_engine::StageConfig::default();
    cfg.kv.n_ctx = 256;
    cfg.kv.n_seq = n_seq;
    cfg.n_ubatch = 128;
    cfg.n_threads = n_threads;
    let m = omni_engine::ModelFile::open(model(GEMMA)).unwrap();
    let n = m.hparams.n_layer;
    omni_engine::Stage::load(m, omni_engine::LayerRange::whole(n), cfg).unwrap()
}

/// The logits a head stage returned.
pub fn logits_of(out: omni_engine::StageOutput) -> Vec<f32> {
    match out {
        omni_engine::StageOutput::Logits(l) => l.data,
        omni_engine::StageOutput::Hidden(_) => panic!("a whole model returns logits"),
    }
}

pub fn synthetic(file: &str) -> std::path::PathBuf {
    fixtures_dir().join("synthetic").join(file)
}

// GGUF writing, for tests that make their own files.

use omni_engine::gguf::Value;

pub use omni_engine::gguf::write::{put_str, put_value, value_type};

/// An F32 tensor: name, ggml dims, values.
pub type F32Tensor = (String, Vec<u64>, Vec<f32>);

/// The header of a GGUF v3 file with these keys and F32 tensors of these
/// dims (alignment 32), padded to where the data starts; and the data
/// section's length.
fn gguf_header(kvs: &[(String, Value)], tensors: &[(&str, &[u64])]) -> (Vec<u8>, usize) {
    gguf_header_typed(kvs, tensors, |_| (0, 1, 4))
}

/// As [`gguf_header`], each tensor stored as `ty(dims)` = (GGML type id,
/// elements per block, bytes per block).
fn gguf_header_typed(
    kvs: &[(String, Value)],
    tensors: &[(&str, &[u64])],
    ty: impl Fn(&[u64]) -> (u32, u64, u64),
) -> (Vec<u8>, usize) {
    let align = |n: usize| n.div_ceil(32) * 32;
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kvs.len() as u64).to_le_bytes());
    for (k, v) in kvs {
        put_str(&mut out, k.as_bytes());
        out.extend(value_type(v).to_le_bytes());
        put_value(&mut out, v);
    }
    let mut offset = 0;
    for (name, dims) in tensors {
        put_str(&mut out, name.as_bytes());
        out.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
        let (id, block, block_bytes) = ty(dims);
        out.extend(id.to_le_bytes());
        out.extend((offset as u64).to_le_bytes());
        let n: u64 = dims.iter().product();
        offset = align(offset + (n / block * block_bytes) as usize);
    }
    out.resize(align(out.len()), 0);
    (out, offset)
}

/// A GGUF v3 file with these keys and F32 tensors (alignment 32).
pub fn write_gguf(path: &std::path::Path, kvs: &[(String, Value)], tensors: &[F32Tensor]) {
    let shapes: Vec<(&str, &[u64])> = tensors
        .iter()
        .map(|(n, d, _)| (n.as_str(), d.as_slice()))
        .collect();
    let (mut out, _) = gguf_header(kvs, &shapes);
    let align = |n: usize| n.div_ceil(32) * 32;
    let base = out.len();
    let mut offset = 0;
    for (_, _, data) in tensors {
        out.resize(base + offset, 0);
        data.iter().for_each(|x| out.extend(x.to_le_bytes()));
        offset = align(offset + data.len() * 4);
    }
    std::fs::write(path, out).unwrap();
}

/// A GGUF v3 file whose F32 tensors are all zero, written sparse: only the
/// header takes disk space, so a model of full-size shapes costs nothing
/// (for tests of sizes and buffers, which never read the weights).
pub fn write_sparse_gguf(
    path: &std::path::Path,
    kvs: &[(String, Value)],
    tensors: &[(&str, &[u64])],
) {
    write_sparse_gguf_typed(path, kvs, tensors, |_| (0, 1, 4))
}

/// As [`write_sparse_gguf`], each tensor of the type `ty(dims)` gives:
/// (GGML type id, elements per block, bytes per block), e.g. Q4_K's
/// `(12, 256, 144)`.
pub fn write_sparse_gguf_typed(
    path: &std::path::Path,
    kvs: &[(String, Value)],
    tensors: &[(&str, &[u64])],
    ty: impl Fn(&[u64]) -> (u32, u64, u64),
) {
    let (out, data_len) = gguf_header_typed(kvs, tensors, ty);
    let f = std::fs::File::create(path).unwrap();
    use std::io::Write;
    (&f).write_all(&out).unwrap();
    f.set_len((out.len() + data_len) as u64).unwrap();
}

/// A little-endian float32 C-order `.npy` (numpy's format, versions 1-3).
pub fn read_npy_f32(path: &std::path::Path) -> (Vec<usize>, Vec<f32>) {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(
        &b[..6],
        b"\x93NUMPY",
        "{}: not an .npy file",
        path.display()
    );
    let (hlen, start) = match b[6] {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        _ => (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12),
    };
    let header = std::str::from_utf8(&b[start..start + hlen]).unwrap();
    assert!(
        header.contains("'descr': '<f4'") && header.contains("'fortran_order': False"),
        "{header}"
    );
    let dims = header.split("'shape': (").nth(1).unwrap();
    let dims = &dims[..dims.find(')').unwrap()];
    let shape: Vec<usize> = dims
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    let data: Vec<f32> = b[start + hlen..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(data.len(), shape.iter().product::<usize>());
    (shape, data)
}

/// The fixtures README's logit tolerance for a synthetic file (`...-f32`,
/// `...-q8_0`, `...-q4_k_m`, or just the quantization).
pub fn logit_tolerance(name: &str) -> f32 {
    if name.ends_with("f32") {
        0.05
    } else {
        0.25
    }
}

// ggml's CPU variants.

/// The ggml features whose kernels the fixtures' llama.cpp builds ran: the
/// real models' (their README: AVX-512 with VBMI, VNNI and BF16, no AVX-VNNI,
/// no AMX; the `zen4` variant's set) and, as far as their README says
/// (Sapphire Rapids, native flags without AMX), the synthetic ones'.
pub const FIXTURE_KERNELS: [&str; 9] = [
    "AVX",
    "AVX2",
    "FMA",
    "F16C",
    "BMI2",
    "AVX512",
    "AVX512_VBMI",
    "AVX512_VNNI",
    "AVX512_BF16",
];

/// Does this process compute with the fixtures' kernels (the x86 SIMD
/// features ggml reports, compared as sets)?
pub fn fixture_kernels() -> bool {
    // The x86 SIMD features ggml reports that the fixtures' build left out.
    const OTHER_SIMD: [&str; 2] = ["AVX_VNNI", "AMX_INT8"];
    let cpu = omni_engine::cpu_backend(None).expect("a CPU backend");
    let mut ours: Vec<&str> = cpu
        .features
        .iter()
        .map(String::as_str)
        .filter(|f| FIXTURE_KERNELS.contains(f) || OTHER_SIMD.contains(f))
        .collect();
    ours.sort_unstable();
    let mut want = FIXTURE_KERNELS.to_vec();
    want.sort_unstable();
    ours == want
}

/// The variant to force when a test checks a lower one than this machine's
/// choice: haswell (AVX2, no AVX-512) where the choice is above it, else
/// the best one below the choice, leaving out x64 and sse42 (no AVX: they
/// run the real models several times slower). None on a machine where
/// nothing lower is left.
pub fn lower_variant(cpu: &omni_engine::CpuBackendInfo) -> Option<String> {
    let score = |name: &str| {
        cpu.candidates
            .iter()
            .find(|c| c.name == name)
            .map_or(0, |c| c.score)
    };
    let mine = score(&cpu.variant);
    if score("haswell") > 0 && score("haswell") < mine {
        return Some("haswell".into());
    }
    cpu.candidates
        .iter()
        .filter(|c| c.score > 0 && c.score < mine && c.name != "x64" && c.name != "sse42")
        .max_by_key(|c| c.score)
        .map(|c| c.name.clone())
}

/// Runs the named tests of this test binary again in a child process that
/// computes with `variant` (forced through `OMNI_CPU_VARIANT`), one at a
/// time; returns whether they passed and what they printed.
pub fn run_with_variant(variant: &str, tests: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .arg("--exact")
        .args(tests)
        .args(["--test-threads", "1", "--nocapture"])
        .env("OMNI_CPU_VARIANT", variant)
        .output()
        .expect("the test binary runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The greedy ids a fixture's generation gives on this machine: the
/// fixture's own on its kernels; on others, where a quantized tiny MoE can
/// pick another expert and a real model break a near tie (llama.cpp itself
/// does, there), those of the vendored llama.cpp run here, which
/// `moe.rs` and `reference.rs` hold the engine to step by step.
pub fn greedy_ids_here(path: &std::path::Path, prompt: &[u32], fixture_ids: Vec<u32>) -> Vec<u32> {
    if fixture_kernels() {
        return fixture_ids;
    }
    omni_engine::llama_cpp_greedy(path, prompt, fixture_ids.len(), 2)
        .expect("the vendored llama.cpp runs the file")
        .into_iter()
        .map(|(t, _)| t)
        .collect()
}

// Files derived from the F32 fixtures.

/// The keys and tensors of an all-F32 fixture.
pub fn f32_fixture_of(file: &str) -> (Vec<(String, Value)>, Vec<F32Tensor>) {
    f32_file(&synthetic(file))
}

/// The keys and tensors of an all-F32 file.
pub fn f32_file(path: &std::path::Path) -> (Vec<(String, Value)>, Vec<F32Tensor>) {
    let g = omni_engine::gguf::Gguf::open(path).unwrap();
    let kvs = g.metadata().to_vec();
    let tensors = g
        .tensors()
        .iter()
        .map(|t| {
            let data = g
                .tensor_data(t)
                .unwrap()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (t.name.clone(), t.dims.clone(), data)
        })
        .collect();
    (kvs, tensors)
}

pub fn set_key(kvs: &mut Vec<(String, Value)>, key: &str, v: Value) {
    match kvs.iter_mut().find(|(k, _)| k == key) {
        Some(kv) => kv.1 = v,
        None => kvs.push((key.to_string(), v)),
    }
}

/// Expert 0 of a `[.., .., n_expert]` expert tensor, as a 2-D matrix.
fn expert0(t: &F32Tensor) -> (Vec<u64>, Vec<f32>) {
    let n = (t.1[0] * t.1[1]) as usize;
    (vec![t.1[0], t.1[1]], t.2[..n].to_vec())
}

/// The fixture cut down to its expert 0 (`expert_count = expert_used_count
/// = 1`, router of one row), as a `qwen3moe` file and as a dense `qwen3`
/// file whose FFN is that expert. With one expert the router's softmax is 1
/// and the renormalised weight is exactly 1, so both must give the same
/// logits: the dense graph checked against the MoE graph that the fixtures
/// check against llama.cpp.
pub fn one_expert_files(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let (kvs, tensors) = f32_fixture_of("tiny-qwen3moe-f32.gguf");
    let mut moe_kvs = kvs.clone();
    set_key(&mut moe_kvs, "qwen3moe.expert_count", Value::U32(1));
    set_key(&mut moe_kvs, "qwen3moe.expert_used_count", Value::U32(1));
    let mut moe_t = Vec::new();
    let mut dense_t = Vec::new();
    for t in &tensors {
        let (name, dims, data) = t;
        if name.ends_with("ffn_gate_inp.weight") {
            moe_t.push((
                name.clone(),
                vec![dims[0], 1],
                data[..dims[0] as usize].to_vec(),
            ));
        } else if name.contains("_exps.") {
            let (d, x) = expert0(t);
            moe_t.push((name.clone(), vec![d[0], d[1], 1], x.clone()));
            dense_t.push((name.replace("_exps", ""), d, x));
        } else {
            moe_t.push(t.clone());
            dense_t.push(t.clone());
        }
    }
    let dense_kvs: Vec<(String, Value)> = kvs
        .iter()
        .filter(|(k, _)| !k.contains("expert"))
        .map(|(k, v)| match (k.as_str(), k.strip_prefix("qwen3moe.")) {
            ("general.architecture", _) => (k.clone(), Value::String("qwen3".into())),
            ("qwen3moe.feed_forward_length", _) => {
                ("qwen3.feed_forward_length".into(), Value::U32(128))
            }
            (_, Some(rest)) => (format!("qwen3.{rest}"), v.clone()),
            _ => (k.clone(), v.clone()),
        })
        .collect();
    let (moe, dense) = (dir.join("one-expert-qwen3moe.gguf"), dir.join("qwen3.gguf"));
    write_gguf(&moe, &moe_kvs, &moe_t);
    write_gguf(&dense, &dense_kvs, &dense_t);
    (moe, dense)
}

/// The dense `qwen3` file of [`one_expert_files`] as a `llama` file: the
/// same weights without the per-head Q/K norms (llama has none), so a
/// llama graph on random weights that llama.cpp loads too.
pub fn llama_file(dir: &std::path::Path) -> std::path::PathBuf {
    let (_, dense) = one_expert_files(dir);
    let (kvs, tensors) = f32_file(&dense);
    let kvs: Vec<(String, Value)> = kvs
        .into_iter()
        .map(|(k, v)| match (k.as_str(), k.strip_prefix("qwen3.")) {
            ("general.architecture", _) => (k, Value::String("llama".into())),
            (_, Some(rest)) => (format!("llama.{rest}"), v),
            _ => (k, v),
        })
        .collect();
    let tensors: Vec<F32Tensor> = tensors
        .into_iter()
        .filter(|(name, _, _)| {
            !name.ends_with("attn_q_norm.weight") && !name.ends_with("attn_k_norm.weight")
        })
        .collect();
    let path = dir.join("llama.gguf");
    write_gguf(&path, &kvs, &tensors);
    path
}
