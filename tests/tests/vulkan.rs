//! The device path, run on every machine: ggml's Vulkan backend
//! (`libggml-vulkan.so`, `scripts/build-vulkan`) on Mesa's software Vulkan
//! driver lavapipe, which runs ggml's shaders on the CPU. ggml-vulkan leaves
//! CPU-type devices out unless `GGML_VK_VISIBLE_DEVICES` lists them, so every
//! process here runs with `GGML_VK_VISIBLE_DEVICES=0`: lavapipe is
//! `vulkan:0`. Everything a GPU stage does is done on it, with no CPU
//! shortcut: weights and KV cells in device buffers the host reads only by
//! copies, hidden states copied in and out, ggml's scheduler splitting a
//! graph between the device and the CPU, routed experts leaving the device
//! for the expert worker and coming back, KV cells read off the device for
//! a live move and written back by a replay.
//!
//! What a user would notice: the answers are those of the CPU (the same
//! tokens, or a near tie: the fixtures' rule, the reference's logits of its
//! pick and ours within 0.25), through moves and crashes; a device that is
//! not there is named with those there are; the planner's compute estimate
//! is not below what ggml reserves on the device. Nothing about speed is
//! meaningful on lavapipe.

use std::path::{Path, PathBuf};
use std::process::Command;

use omni_proto::coordinator::v1::GenerateRequest;
use omni_tests::fixtures::{fixtures_dir, model, GEMMA, QWEN};
use omni_tests::{greedy, ids, start_streams, target_bin, Supervised};

/// ggml-vulkan's own variable: use Vulkan device 0 (lavapipe here) even
/// though it is a CPU.
const VISIBLE: (&str, &str) = ("GGML_VK_VISIBLE_DEVICES", "0");
const NEAR_TIE: f32 = 0.25;
const TOKEN: &str = "vulkan-5e2a";

fn synthetic(name: &str) -> PathBuf {
    fixtures_dir().join("synthetic").join(name)
}

/// The Vulkan backend must be there: scripts/test builds it (a machine
/// without it fails here, naming the script, rather than skip the device
/// path).
/// One test at a time: lavapipe computes on the CPU, and a device test
/// beside another would share its two cores (and its step timeouts).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn vulkan() {
    omni_tests::await_pending_build("vulkan");
    let lib = target_bin("omni-gpu-worker").with_file_name("libggml-vulkan.so");
    assert!(
        lib.exists(),
        "{} is missing: scripts/build-vulkan builds it (scripts/test runs it)",
        lib.display()
    );
    // Once, before any test of this binary goes on: no thread reads the
    // environment while it changes.
    static SET: std::sync::Once = std::sync::Once::new();
    SET.call_once(|| std::env::set_var(VISIBLE.0, VISIBLE.1));
}

/// Each step's greedy id and its logits, from omni's CPU stage in process:
/// what a device run is held to.
fn cpu_reference(path: &Path, prompt: &[u32], n_gen: usize) -> Vec<(u32, Vec<f32>)> {
    let mut e = omni_tests::cpu_engine(path);
    e.prompt_cuts = omni_engine::PromptCuts::Ubatch;
    let mut out = Vec::with_capacity(n_gen);
    let mut logits = e.prefill(0, prompt, 0).unwrap();
    for i in 0..n_gen {
        let t = omni_engine::sampling::greedy(&logits);
        let next = (i + 1 < n_gen).then(|| e.prefill(0, &[t], prompt.len() + i).unwrap());
        out.push((t, std::mem::replace(&mut logits, next.unwrap_or_default())));
    }
    out
}

/// `got` is the reference's tokens, or the same up to a step where the
/// reference's logits of its pick and of ours are within [`NEAR_TIE`].
fn near(got: &[u32], reference: &[(u32, Vec<f32>)], what: &str) {
    assert_eq!(got.len(), reference.len(), "{what}: {got:?}");
    match got.iter().zip(reference).position(|(a, (b, _))| a != b) {
        None => eprintln!("{what}: the CPU's tokens"),
        Some(i) => {
            let (want, logits) = &reference[i];
            let gap = logits[*want as usize] - logits[got[i] as usize];
            assert!(
                gap <= NEAR_TIE,
                "{what}: step {i} is {} where the CPU has {want} (gap {gap:.3}): {got:?}",
                got[i]
            );
            eprintln!("{what}: the CPU's tokens up to step {i}, then a near tie (gap {gap:.3})");
        }
    }
}

/// `omnictl up` with `args`, lavapipe visible, the test's admin token, one
/// thread per worker, shared memory, 2 sequences of 512 tokens.
fn up(path: &Path, args: &[&str]) -> Supervised {
    up_env(path, args, &[])
}

/// [`up`] with more environment variables.
fn up_env(path: &Path, args: &[&str], env: &[(&str, &str)]) -> Supervised {
    let mut args = args.to_vec();
    args.extend([
        "--ctx",
        "512",
        "--seqs",
        "2",
        "--threads",
        "1",
        "--transport",
        "shm",
    ]);
    let mut vars = vec![
        VISIBLE,
        ("OMNI_ADMIN_TOKEN", TOKEN),
        ("OMNI_COORDINATOR_HEALTH_INTERVAL", "0.5"),
        // lavapipe compiles each of ggml's pipelines the first time a step
        // uses it (Mesa 25: minutes for some, with a cold shader cache), so
        // a step may take longer than the coordinator's default 120 s
        // before it calls the stage lost; a dead stage is still noticed by
        // its health checks.
        ("OMNI_COORDINATOR_STEP_TIMEOUT", "900"),
        // Prompts whole (llama_decode's cuts, as `cpu_reference`): Mesa 25's
        // lavapipe took over 10 minutes to compile the pipelines of Gemma's
        // 2-token first step under llama-server's cuts, cold.
        ("OMNI_COORDINATOR_PROMPT_CUTS", "ubatch"),
    ];
    vars.extend(env);
    Supervised::start(path, &args, &vars)
}

fn admin(c: &Supervised, args: &[&str]) -> String {
    let (ok, out, err) = omni_tests::omnictl_admin(&c.admin_addr, Some(TOKEN), args);
    assert!(ok, "omnictl {args:?}: {err}\n{}", c.proc.log_text());
    out
}

/// One stream of `req`, with `during` done once it is `after` tokens in;
/// its tokens.
fn stream_through(
    c: &Supervised,
    req: GenerateRequest,
    after: usize,
    during: impl FnOnce(),
) -> Vec<u32> {
    let n = req.max_tokens.unwrap_or(0) as usize;
    let streams = start_streams(&c.addr, vec![req]);
    streams.wait_for(after);
    during();
    let at = streams.progress.load(std::sync::atomic::Ordering::Relaxed);
    let mut results = streams.handle.join().unwrap();
    assert!(
        at < n,
        "it came after the stream had finished ({at} tokens)"
    );
    results
        .remove(0)
        .unwrap_or_else(|e| panic!("the stream failed: {e}\n{}", c.proc.log_text()))
}

#[test]
fn an_unknown_vulkan_device_is_named_with_the_devices_there_are() {
    let _serial = serial();
    vulkan();
    let worker = |device: &str, visible: bool| {
        let mut cmd = Command::new(target_bin("omni-gpu-worker"));
        cmd.args([
            "--coordinator",
            &format!("127.0.0.1:{}", omni_tests::free_port()),
        ])
        .args(["--register-timeout", "5", "--device", device])
        .env("OMNI_LOG", "info");
        if !visible {
            cmd.env_remove(VISIBLE.0);
        }
        let out = cmd.output().expect("the worker runs");
        let log = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.code(), Some(1), "an error exit: {log}");
        assert!(
            !log.contains("panicked") && !log.contains("registered"),
            "{log}"
        );
        log
    };
    let log = worker("vulkan:7", true);
    assert!(
        log.contains("vulkan:7 does not exist") && log.contains("vulkan:0 (llvmpipe"),
        "{log}"
    );
    // Without the variable ggml-vulkan uses no CPU device: the error says
    // how to use one.
    let log = worker("vulkan:0", false);
    assert!(
        log.contains("sees no usable device") && log.contains("GGML_VK_VISIBLE_DEVICES=0"),
        "{log}"
    );
}

/// Every placement of `examples/gpu_check` on `vulkan:0`: 1 device stage,
/// 2 device stages, a CPU stage then a device stage, and for MoE files a
/// device stage with its routed experts on the CPU's expert stage (also with
/// two experts per layer kept on the device), each against llama.cpp's run
/// of the same placement on the same device and against omni's CPU stage.
///
/// One process per file and placement, so that a failure names its
/// placement.
fn gpu_check(files: &[PathBuf], prompts: usize, steps: usize, setups: &[&str]) {
    for file in files {
        for setup in setups {
            gpu_check_one(
                std::slice::from_ref(file),
                prompts,
                steps,
                &["CPU only", setup],
            );
        }
    }
}

/// The placements of a dense model, and the two more of a MoE one.
const DENSE_SETUPS: [&str; 3] = ["1 GPU stage", "2 GPU stages", "CPU + GPU stages"];
const MOE_SETUPS: [&str; 5] = [
    "1 GPU stage",
    "2 GPU stages",
    "CPU + GPU stages",
    "GPU, experts on CPU",
    "GPU, experts on CPU, 2 kept on GPU",
];

fn gpu_check_one(files: &[PathBuf], prompts: usize, steps: usize, only: &[&str]) {
    vulkan();
    let mut cmd = Command::new(
        target_bin("omni-gpu-worker")
            .with_file_name("examples")
            .join("gpu_check"),
    );
    cmd.args(["--device", "vulkan:0", "--threads", "2"]).args([
        "--prompts",
        &prompts.to_string(),
        "--steps",
        &steps.to_string(),
    ]);
    for setup in only {
        cmd.args(["--only", setup]);
    }
    cmd.args(files);
    let out = cmd
        .output()
        .expect("examples/gpu_check runs (cargo build --release --all-targets)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(
        out.status.success(),
        "gpu_check --only {only:?} failed ({}):\n{text}",
        omni_telemetry::crash::describe(&out.status)
    );
    for setup in only {
        assert!(
            text.contains(&format!("| {setup} |")),
            "gpu_check ran no {setup:?}:\n{text}"
        );
    }
    assert!(
        text.contains("every generation matches llama.cpp's"),
        "{text}"
    );
    assert!(text.contains("vulkan:0 = llvmpipe"), "{text}");
}

#[test]
fn dense_models_on_vulkan_give_the_cpu_and_llama_cpp_answers() {
    let _serial = serial();
    // lavapipe decodes Gemma 3 at about a token a second (its dispatches'
    // overhead): one short prompt, 12 steps; every placement for Gemma 3,
    // the whole model on the device and a CPU stage before a device one
    // for Qwen2.5.
    gpu_check(&[model(GEMMA)], 1, 12, &DENSE_SETUPS);
    gpu_check(&[model(QWEN)], 1, 12, &["1 GPU stage", "CPU + GPU stages"]);
}

// Every placement of both synthetic MoE files, experts on the device, on
// the CPU (the expert worker's stage in process) and two kept on the device.
#[test]
fn moe_models_on_vulkan_with_experts_on_the_cpu_give_the_cpu_and_llama_cpp_answers() {
    let _serial = serial();
    gpu_check(
        &[
            synthetic("tiny-deepseek2-mla-q8_0.gguf"),
            synthetic("tiny-qwen3moe-q8_0.gguf"),
        ],
        2,
        16,
        &MOE_SETUPS,
    );
}

/// The planner's compute estimate against what ggml reserved on the
/// device for the same stage: logged side by side, and never low (a low
/// estimate lets a plan through that fails to load, or runs the device out
/// of memory).
#[test]
fn the_compute_estimate_covers_what_ggml_reserves_on_the_device() {
    let _serial = serial();
    vulkan();
    for (path, n_ubatch, n_seq) in [
        (model(GEMMA), 512, 4),
        (model(QWEN), 256, 2),
        (synthetic("tiny-deepseek2-mla-q8_0.gguf"), 512, 4),
        (synthetic("tiny-qwen3moe-q8_0.gguf"), 128, 1),
    ] {
        let file = omni_engine::ModelFile::open(&path).unwrap();
        let hp = file.hparams.clone();
        let n = hp.n_layer;
        let cfg = omni_engine::StageConfig {
            n_threads: 2,
            n_ubatch,
            kv: omni_engine::KvConfig { n_ctx: 1024, n_seq },
            device: omni_engine::Device::Vulkan(0),
            ..omni_engine::StageConfig::default()
        };
        for range in [
            omni_engine::stage::LayerRange::whole(n),
            omni_engine::stage::LayerRange {
                embed: false,
                layers: n / 2..n,
                head: true,
            },
        ] {
            let st = omni_engine::Stage::load(file.clone(), range.clone(), cfg.clone()).unwrap();
            estimate_covers(&path, &st, 0, "");
        }
        // A device stage whose routed experts are on an expert worker and
        // streamed to it for prompt steps: the plan adds one layer's
        // experts to the estimate (`StagePlan::stream_bytes`).
        let offloaded = file.expert_layers();
        if offloaded.is_empty() {
            continue;
        }
        let range = omni_engine::stage::LayerRange::whole(n);
        let streaming = omni_engine::StageConfig {
            local_experts: omni_engine::LocalExperts::From(1),
            ..cfg.clone()
        };
        let st =
            omni_engine::Stage::load_offloaded(file.clone(), range, streaming, &offloaded).unwrap();
        assert!(st.local_experts_from().is_some());
        let stream = offloaded
            .iter()
            .map(|&il| file.expert_weight_bytes(il))
            .max()
            .unwrap();
        estimate_covers(&path, &st, stream, ", experts streamed");
    }
}

/// The planner's estimate for stage `st` (plus `extra`, what the plan adds
/// for it) against what ggml reserved for it: logged, and never low.
fn estimate_covers(path: &Path, st: &omni_engine::Stage, extra: u64, what: &str) {
    let cfg = st.config();
    let range = st.range();
    let (device, host) = st.compute_bytes_split();
    let plan = omni_planner::PlanConfig {
        n_ctx: cfg.kv.n_ctx,
        n_seq: cfg.kv.n_seq,
        n_ubatch: cfg.n_ubatch,
        ..Default::default()
    };
    let hp = &st.model().hparams;
    let estimate = omni_planner::compute_estimate(hp, range, &plan, true) + extra;
    eprintln!(
        "{} {range}{what} (ubatch {}, {} x {} cells): ggml reserved {} on vulkan:0 + {} host; the planner's estimate {} ({:.2}x); ops on the CPU: {:?}",
        path.file_name().unwrap().to_string_lossy(),
        cfg.n_ubatch,
        cfg.kv.n_seq,
        cfg.kv.n_ctx,
        omni_engine::fmt_bytes(device as u64),
        omni_engine::fmt_bytes(host as u64),
        omni_engine::fmt_bytes(estimate),
        estimate as f64 / (device + host).max(1) as f64,
        st.fallback_ops()
    );
    assert!(
        estimate >= (device + host) as u64,
        "{}{what}: the estimate {estimate} is below what ggml reserved ({device} + {host})",
        path.display()
    );
}

/// Gemma 3 on a device stage and a CPU stage: its answer is the CPU's;
/// layers move device -> CPU -> device in the middle of a stream, whose
/// tokens stay the CPU's; a prompt whose prefix is cached on the device
/// stage gets the CPU's answer; kill -9 of the device stage in the middle of
/// a stream: the supervisor starts it again, the coordinator reloads it on
/// the device and replays the stream into its cells, which finishes with
/// the CPU's tokens.
#[test]
fn a_device_stage_serves_moves_caches_and_survives_kill_9() {
    let _serial = serial();
    vulkan();
    let path = model(GEMMA);
    let prompt = &omni_tests::short_prompts("real_gemma3_270m.json", 1)[0];
    // lavapipe computes about a token a second: 24 tokens a stream.
    const N: usize = 24;
    let want = cpu_reference(&path, prompt, N);
    let c = up(
        &path,
        &[
            "--stages",
            "2",
            "--device",
            "vulkan:0,cpu",
            "--counts",
            "9,9",
        ],
    );
    let workers = admin(&c, &["workers", "--json"]);
    assert!(
        workers.contains("\"vulkan:0\"") && workers.contains("llvmpipe"),
        "omnictl workers names the device: {workers}"
    );
    // lavapipe cannot address Gemma 3's 262144-row embedding in one
    // buffer: its lookup runs on the CPU, and the plan says so.
    let plan = admin(&c, &["plan"]);
    assert!(
        plan.contains("fallback: w0 (vulkan:0) runs GET_ROWS on the CPU"),
        "{plan}"
    );
    near(
        &ids(&c.rt.block_on(collect(&c, greedy(prompt, N)))),
        &want,
        "served",
    );

    // Live moves: layers 7-8 to the CPU worker, then back, mid-stream.
    let got = stream_through(&c, greedy(prompt, N), 4, || {
        admin(&c, &["rebalance", "--layers", "7-8", "--to", "w1"]);
        admin(&c, &["rebalance", "--layers", "7-8", "--to", "w0"]);
    });
    near(&got, &want, "moves vulkan:0 -> cpu -> vulkan:0");

    // A cached prefix: the same prompt again hits the device stage's cache.
    let again = c.rt.block_on(collect(&c, greedy(prompt, N)));
    let cached = again
        .iter()
        .find_map(|e| e.done.as_ref())
        .map_or(0, |d| d.cached_tokens);
    assert!(cached > 0, "the prompt's prefix came from the cache");
    near(
        &ids(&again),
        &want,
        &format!("a prefix-cache hit ({cached} tokens)"),
    );

    // kill -9 of the device stage.
    let got = stream_through(&c, greedy(prompt, N), 6, || {
        c.signal("w0", "-9");
    });
    near(&got, &want, "kill -9 of the device stage");
    let log = c.proc.log_text();
    assert!(log.contains("starting it again"), "{log}");
}

/// The synthetic deepseek2 (MLA) on one device stage whose routed experts
/// run on an expert worker, then with two experts per layer kept on the
/// device (`--gpu-experts 2`), then with the prompt's step computing them
/// on the device, streamed from host memory (`--stream-experts`, ggml's
/// offload threshold lowered to the prompt's size) while decoding steps
/// call the expert worker: the CPU's answers; and a constrained answer
/// (JSON) from Qwen with the head on the device.
#[test]
fn experts_leave_the_device_for_the_expert_worker_and_a_device_head_constrains() {
    let _serial = serial();
    vulkan();
    let path = synthetic("tiny-deepseek2-mla-q8_0.gguf");
    let prompt = [1u32, 17, 42, 99, 5, 23, 8, 61, 7, 300, 12, 40];
    const N: usize = 24;
    let want = cpu_reference(&path, &prompt, N);
    let off = [("OMNI_WORKER_STREAM_EXPERTS", "off")];
    let streamed = [
        ("OMNI_WORKER_STREAM_EXPERTS", "8"),
        ("GGML_OP_OFFLOAD_MIN_BATCH", "8"),
    ];
    for (extra, env) in [
        (&[][..], &off[..]),
        (&["--gpu-experts", "2"][..], &off[..]),
        (&[][..], &streamed[..]),
    ] {
        let mut args = vec![
            "--stages",
            "1",
            "--device",
            "vulkan:0",
            "--cpu-workers",
            "1",
            "--experts",
            "cpu",
        ];
        args.extend(extra);
        let c = up_env(&path, &args, env);
        let plan = admin(&c, &["plan"]);
        eprintln!("{plan}");
        assert!(plan.contains("vulkan:0"), "{plan}");
        let got = ids(&c.rt.block_on(collect(&c, greedy(&prompt, N))));
        near(
            &got,
            &want,
            &format!("experts on the expert worker {extra:?} {env:?}"),
        );
        // The prompt's step streamed the experts to the device or called
        // the expert worker, as set; decoding always called it.
        let st = c.statuses();
        let streamed_steps: u64 = st.iter().map(|s| s.streamed_expert_steps).sum();
        let calls: f64 = st.iter().map(|s| s.expert_round_trip_seconds).sum();
        let want_streamed = u64::from(env == &streamed[..]);
        assert_eq!(
            streamed_steps,
            want_streamed,
            "{env:?}\n{}",
            c.proc.log_text()
        );
        assert!(calls > 0.0, "decoding calls the expert worker: {st:?}");
    }

    // A JSON answer, constrained on the device stage that holds the head.
    use omni_proto::coordinator::v1::generate_request::Prompt;
    use omni_proto::coordinator::v1::{Chat, ChatMessage};
    use omni_proto::worker::v1::{grammar::Kind, Grammar, Sampling};
    let qwen = model(QWEN);
    let c = up(&qwen, &["--stages", "2", "--device", "cpu,vulkan:0"]);
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["city", "year"],
        "additionalProperties": false
    });
    let req = GenerateRequest {
        prompt: Some(Prompt::Chat(Chat {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: "Which city hosted the 1900 Olympics, and when? Answer as JSON.".into(),
                ..Default::default()
            }],
            ..Default::default()
        })),
        max_tokens: Some(60),
        sampling: Some(Sampling {
            grammar: Some(Grammar {
                kind: Some(Kind::JsonSchema(schema.to_string())),
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let got = ids(&c.rt.block_on(collect(&c, req)));
    let tok = omni_engine::tokenizer::Tokenizer::load(&qwen).unwrap();
    let text = tok.decode(&got);
    let text = text
        .trim_end_matches("<|im_end|>")
        .trim_end_matches("<|endoftext|>");
    let v: serde_json::Value = serde_json::from_str(text)
        .unwrap_or_else(|e| panic!("the answer is not JSON ({e}): {text:?}"));
    assert!(v["city"].is_string() && v["year"].is_i64(), "{v}");
    eprintln!("constrained on vulkan:0: {v}");
}

/// A Generate stream of `c` read to its end.
async fn collect(
    c: &Supervised,
    req: GenerateRequest,
) -> Vec<omni_proto::coordinator::v1::GenerateEvent> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", c.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = omni_proto::coordinator::v1::inference_client::InferenceClient::new(ch);
    // lavapipe compiles a pipeline the first time a step uses it: with a
    // cold shader cache a first step can take minutes (see `up_env`).
    omni_tests::collect_within(&mut client, req, 1200)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", c.proc.log_text()))
}
