//! omni against llama-server, on this machine, for every architecture omni
//! runs: gemma3 and qwen2 (the real test models), llama and qwen3 (dense
//! files derived from the tiny qwen3moe fixture), qwen3moe and deepseek2 in
//! both GGUF layouts (the tiny synthetic fixtures).
//!
//! llama-server is built by `scripts/llama-bench portable server` from the
//! llama.cpp source omni links, computing with the very CPU variant
//! libraries omni loads; `scripts/test` builds it. It runs with its default
//! settings (only the model, the address and 2 threads given), and each
//! prompt is asked as a llama.cpp user would: `/completion` with the token
//! ids, greedy (`top_k` 1), `cache_prompt: false`, two log-probabilities
//! per step. omni must give the same greedy ids for 48 steps (or up to an
//! end-of-generation token, where both stop) and every step's chosen-token
//! log-probability within 0.01, in one process and
//! through a 2-stage cluster, except from a step where llama-server's own
//! top two are within 0.01 of each other (a near tie: reported, and the
//! prompt's comparison ends there). Prompts run from 8 tokens to past one
//! `n_ubatch` (512), so the cluster prefills one of them in chunks.
//!
//! omni runs with its defaults too, which cut prompts as llama-server does
//! (`--prompt-cuts llama-server`): every `n_ubatch` tokens, and for Gemma 3
//! also 4 tokens before the prompt's end (llama-server's context
//! checkpoints; docs/llama-cpp.md). Gemma 3 is also checked with
//! `--prompt-cuts ubatch` (llama_decode's cuts) against
//! `llama-server --swa-full`, which makes no checkpoints.

use omni_engine::{Engine, GenerateOptions, PromptCuts, StageConfig};
use omni_tests::fixtures::{self, GEMMA, QWEN};
use omni_tests::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const STEPS: usize = 48;
/// Most |log-probability| difference, and the reference's top-2 gap under
/// which a step is a near tie.
const TOL: f64 = 0.01;
const THREADS: usize = 2;

/// The llama-server binary `scripts/llama-bench portable server` builds.
fn llama_server_bin() -> PathBuf {
    omni_tests::await_pending_build("llama-server");
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/llama-bench/portable/bin/llama-server");
    assert!(
        p.exists(),
        "{} is missing: run `scripts/llama-bench portable server` (scripts/test does)",
        p.display()
    );
    p
}

/// A llama-server on a free port, with its default settings plus `extra`.
struct LlamaServer {
    proc: Proc,
    addr: String,
    _dir: tempfile::TempDir,
}

impl LlamaServer {
    fn start(model: &Path, extra: &[&str]) -> LlamaServer {
        let dir = tempfile::tempdir().unwrap();
        let addr = format!("127.0.0.1:{}", free_port());
        let (host, port) = addr.split_once(':').unwrap();
        let mut cmd = Command::new(llama_server_bin());
        // Its own libraries (RUNPATH $ORIGIN), not omni's: `cargo test`
        // puts target/release/deps on LD_LIBRARY_PATH, whose libggml.so.0
        // (llama-cpp-sys-2's) loads CPU variants from its build folder,
        // AMX one included; on a VM that reports AMX without enabling it
        // that variant dies of SIGILL (scripts/llama-bench leaves it out
        // of the tool's own folder for that reason).
        cmd.env_remove("LD_LIBRARY_PATH");
        cmd.arg("-m")
            .arg(model)
            .args(["--host", host, "--port", port])
            .args(["-t", &THREADS.to_string()])
            .args(extra);
        let mut proc = Proc::spawn("llama-server", cmd, dir.path());
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(Some(status)) = proc.child.try_wait() {
                panic!("llama-server exited ({status}):\n{}", proc.log_text());
            }
            if std::net::TcpStream::connect(&addr).is_ok()
                && http(&addr, "GET", "/health", &[], b"").0 == 200
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "llama-server not ready in 120 s:\n{}",
                proc.log_text()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        LlamaServer {
            proc,
            addr,
            _dir: dir,
        }
    }

    /// The request: greedy, no prompt cache, 2 log-probabilities;
    /// it stops at an end-of-generation token, as omni does by default.
    fn greedy(&self, prompt: &[u32]) -> Vec<Step> {
        let body = serde_json::json!({
            "prompt": prompt,
            "n_predict": STEPS,
            "samplers": ["top_k"],
            "top_k": 1,
            "cache_prompt": false,
            "n_probs": 2,
            "post_sampling_probs": false,
            "return_tokens": true,
        });
        let (status, text) = http(
            &self.addr,
            "POST",
            "/completion",
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        );
        assert_eq!(
            status,
            200,
            "llama-server: {text}\n{}",
            self.proc.log_text()
        );
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let ids: Vec<u32> = fixtures::ids(&v["tokens"]);
        // llama-server leaves out of `completion_probabilities` a token
        // whose text ends in an incomplete UTF-8 character (it records a
        // token once the text is whole): they are matched to the ids in
        // order, and such a step has no log-probability.
        let mut probs = v["completion_probabilities"]
            .as_array()
            .unwrap_or_else(|| panic!("no completion_probabilities in {text}"))
            .iter()
            .peekable();
        ids.iter()
            .map(|&id| {
                let c = probs.next_if(|c| c["id"].as_u64() == Some(id as u64));
                let lp = |t: &serde_json::Value| t["logprob"].as_f64().unwrap();
                Step {
                    id,
                    logprob: c.map(lp),
                    gap: c.and_then(|c| {
                        let top = c["top_logprobs"].as_array()?;
                        Some(lp(top.first()?) - lp(top.get(1)?))
                    }),
                }
            })
            .collect()
    }
}

/// One generated token: its id, log-probability and (for the reference)
/// how far ahead of the runner-up it was.
#[derive(Clone, Debug)]
struct Step {
    id: u32,
    logprob: Option<f64>,
    gap: Option<f64>,
}

/// omni in this process, whole, prompts cut as `cuts` says (None: as
/// omni cuts them by default).
fn engine_greedy(model: &Path, prompts: &[Vec<u32>], cuts: Option<PromptCuts>) -> Vec<Vec<Step>> {
    let mut cfg = StageConfig::default();
    cfg.kv.n_ctx = 2048;
    cfg.kv.n_seq = 1;
    cfg.n_threads = THREADS;
    let mut engine = Engine::load(model, None, cfg).expect("model loads");
    if let Some(cuts) = cuts {
        engine.prompt_cuts = cuts;
    }
    let opts = GenerateOptions {
        max_tokens: STEPS,
        top_logprobs: 2,
        ..GenerateOptions::default()
    };
    prompts
        .iter()
        .map(|p| {
            let gen = engine.generate(p, &opts, &mut |_| {}).expect("generates");
            gen.steps
                .iter()
                .map(|s| Step {
                    id: s.id,
                    logprob: s.logprob.map(f64::from),
                    gap: None,
                })
                .collect()
        })
        .collect()
}

/// omni through a 2-stage cluster (shared memory), prompts cut as `cuts`
/// (None: the coordinator's default).
fn cluster_greedy(model: &Path, prompts: &[Vec<u32>], cuts: Option<PromptCuts>) -> Vec<Vec<Step>> {
    let mut spec = ClusterSpec::new(2, "shm");
    spec.threads = THREADS;
    spec.ctx = 2048;
    spec.seqs = 1;
    // No prefix cache: every prompt computed from its first token, as
    // llama-server's cache_prompt: false.
    spec.coordinator_args = ["--prefix-cache", "off"].map(String::from).to_vec();
    if let Some(cuts) = cuts {
        spec.coordinator_args
            .extend(["--prompt-cuts".into(), cuts.to_string()]);
    }
    let cluster = Cluster::start(model, &spec);
    let mut client = cluster.client().expect("the coordinator answers");
    prompts
        .iter()
        .map(|p| {
            let mut req = greedy(p, STEPS);
            req.ignore_eos = false;
            req.logprobs = true;
            req.top_logprobs = 2;
            let events = cluster
                .rt
                .block_on(collect(&mut client, req))
                .unwrap_or_else(|e| panic!("generate: {e}\n{}", cluster.logs()));
            events
                .iter()
                .flat_map(|e| &e.tokens)
                .map(|t| Step {
                    id: t.id,
                    logprob: t.logprob.map(f64::from),
                    gap: None,
                })
                .collect()
        })
        .collect()
}

/// Compares `ours` with the reference for one prompt: the failures, and
/// the largest difference and the near tie (if any) for the report.
fn compare(reference: &[Step], ours: &[Step]) -> (Vec<String>, f64, Option<usize>) {
    let mut failures = Vec::new();
    let mut worst = 0.0f64;
    for (i, (r, o)) in reference.iter().zip(ours).enumerate() {
        if r.gap.is_some_and(|g| g < TOL) {
            return (failures, worst, Some(i));
        }
        if r.id != o.id {
            failures.push(format!(
                "step {i}: token {} but llama-server chose {} (its top-2 gap {:.3})",
                o.id,
                r.id,
                r.gap.unwrap_or(f64::NAN)
            ));
            return (failures, worst, None);
        }
        let (Some(want), Some(got)) = (r.logprob, o.logprob) else {
            continue;
        };
        let d = (want - got).abs();
        worst = worst.max(d);
        if d > TOL {
            failures.push(format!(
                "step {i}: token {}'s log-probability {got:.4}, llama-server's {want:.4} (differ by {d:.4})",
                o.id
            ));
        }
    }
    if reference.len() != ours.len() {
        failures.push(format!(
            "{} tokens, llama-server {} (both stop at {STEPS} or an end-of-generation token)",
            ours.len(),
            reference.len()
        ));
    }
    (failures, worst, None)
}

/// Checks `model` on `prompts`: llama-server with `server_args` as the
/// reference, omni with `cuts` in one process and, with `cluster`, through
/// a 2-stage cluster.
fn check(
    name: &str,
    model: &Path,
    prompts: &[Vec<u32>],
    server_args: &[&str],
    cuts: Option<PromptCuts>,
    cluster: bool,
) {
    let cuts_name = cuts.map_or("omni's default".to_string(), |c| {
        format!("--prompt-cuts {c}")
    });
    let server = LlamaServer::start(model, server_args);
    let reference: Vec<Vec<Step>> = prompts.iter().map(|p| server.greedy(p)).collect();
    drop(server);
    let mut runs = vec![("1 process", engine_greedy(model, prompts, cuts))];
    if cluster {
        runs.push(("2 stages", cluster_greedy(model, prompts, cuts)));
    }
    let mut failures = Vec::new();
    for (how, ours) in &runs {
        for (i, (r, o)) in reference.iter().zip(ours).enumerate() {
            let (f, worst, tie) = compare(r, o);
            let tie = tie.map_or(String::new(), |s| {
                format!(", near tie at step {s} (compared up to it)")
            });
            eprintln!(
                "{name} {how} ({cuts_name}, llama-server {server_args:?}): prompt {i} ({} tokens): max |logprob diff| {worst:.4}{tie}",
                prompts[i].len()
            );
            failures.extend(
                f.into_iter()
                    .map(|f| format!("{how}, prompt {i} ({} tokens): {f}", prompts[i].len())),
            );
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: omni differs from llama-server {server_args:?}:\n{}",
        failures.join("\n")
    );
}

/// Prompts of 8 to 400 tokens, and one past n_ubatch (600), for a model
/// of `n_vocab` tokens: random ids (a fixed seed), after `bos` if given.
fn random_prompts(n_vocab: u32, bos: Option<u32>) -> Vec<Vec<u32>> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    [8, 40, 150, 400, 600]
        .iter()
        .map(|&n| {
            let mut p: Vec<u32> = bos.into_iter().collect();
            while p.len() < n {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                p.push(3 + (x % (n_vocab as u64 - 3)) as u32);
            }
            p
        })
        .collect()
}

/// Four of the fixture's prompts of 8 tokens or more (the shortest, the
/// longest, two between), and all of them joined and cut to 600 tokens
/// (one BOS at the start where they have one).
fn fixture_prompts(fixture: &str) -> Vec<Vec<u32>> {
    let all: Vec<Vec<u32>> = fixtures::json(fixture)["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| fixtures::ids(&p["prompt_ids"]))
        .collect();
    let mut by_len: Vec<&Vec<u32>> = all.iter().filter(|p| p.len() >= 8).collect();
    by_len.sort_by_key(|p| p.len());
    let n = by_len.len();
    let mut picks = vec![0, n / 3, 2 * n / 3, n - 1];
    picks.dedup();
    let mut prompts: Vec<Vec<u32>> = picks.iter().map(|&i| by_len[i].clone()).collect();
    let bos = all[0][0];
    let has_bos = all.iter().all(|p| p[0] == bos);
    let mut long: Vec<u32> = if has_bos { vec![bos] } else { Vec::new() };
    for p in all.iter().cycle() {
        long.extend(&p[usize::from(has_bos)..]);
        if long.len() >= 600 {
            break;
        }
    }
    long.truncate(600);
    prompts.push(long);
    prompts
}

/// Both with their defaults: omni cuts a Gemma prompt 4 tokens before
/// its end as llama-server does.
#[test]
fn gemma3_matches_llama_server() {
    let p = fixtures::model(GEMMA);
    check(
        "gemma3",
        &p,
        &fixture_prompts("real_gemma3_270m.json"),
        &[],
        None,
        true,
    );
}

/// Prompts cut only every n_ubatch (as llama_decode) against llama-server
/// without its context checkpoints.
#[test]
fn gemma3_cut_as_llama_decode_matches_llama_server_with_a_full_sliding_window_cache() {
    let p = fixtures::model(GEMMA);
    check(
        "gemma3",
        &p,
        &fixture_prompts("real_gemma3_270m.json"),
        &["--swa-full"],
        Some(PromptCuts::Ubatch),
        false,
    );
}

#[test]
fn qwen2_matches_llama_server() {
    let p = fixtures::model(QWEN);
    check(
        "qwen2",
        &p,
        &fixture_prompts("real_qwen2_5_coder_0_5b.json"),
        &[],
        None,
        true,
    );
}

#[test]
fn llama_and_qwen3_match_llama_server() {
    let dir = tempfile::tempdir().unwrap();
    let (_, qwen3) = fixtures::one_expert_files(dir.path());
    let llama = fixtures::llama_file(dir.path());
    // No BOS: the qwen3moe fixture's tokenizer adds none.
    let prompts = random_prompts(512, None);
    check("llama", &llama, &prompts, &[], None, true);
    check("qwen3", &qwen3, &prompts, &[], None, true);
}

#[test]
fn qwen3moe_matches_llama_server() {
    let p = fixtures::synthetic("tiny-qwen3moe-q4_k_m.gguf");
    check("qwen3moe", &p, &random_prompts(512, None), &[], None, true);
}

#[test]
fn deepseek2_both_layouts_match_llama_server() {
    // BOS is id 0 in the deepseek2 fixtures.
    let prompts = random_prompts(512, Some(0));
    for layout in ["mla", "legacy"] {
        let p = fixtures::synthetic(&format!("tiny-deepseek2-{layout}-q4_k_m.gguf"));
        check(
            &format!("deepseek2 {layout}"),
            &p,
            &prompts,
            &[],
            None,
            true,
        );
    }
}
