//! End-to-end: real coordinator and worker processes on real sockets and
//! shared memory, serving the real test models.
//!
//! What a user would notice: the tokens a cluster returns equal the
//! single-process engine's (which matches llama.cpp's fixtures), whatever the
//! number of stages and the transport; concurrent requests get what they get
//! alone; and every failure — a plan that does not fit, an unsupported
//! model, a missing worker, a worker that dies — ends with a clear message
//! in bounded time.

use omni_proto::coordinator::v1::{generate_request::Prompt, GenerateRequest};
use omni_tests::fixtures::{fixtures_dir, json, model, GEMMA, QWEN};
use omni_tests::{greedy, ids, short_prompts, Cluster, ClusterSpec};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Cluster tests run one at a time: each starts several compute processes,
/// and the CI machine has two cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const N_GEN: usize = 16;

/// The single-process engine's greedy tokens for each prompt.
fn reference(model_file: &str, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    omni_tests::engine_tokens(&model(model_file), prompts, N_GEN)
}

fn check_cluster_matches_engine(model_file: &str, fixture: &str) {
    let prompts = short_prompts(fixture, 3);
    let want = reference(model_file, &prompts);
    let _g = serial();
    for transport in ["shm", "grpc"] {
        for stages in 1..=3 {
            // Without the prefix cache: a prompt that starts from another's
            // cached cells computes the rest in other steps than the engine
            // (and its cached rows were computed in the other prompt's
            // steps), which moves logits in their last bits and can flip a
            // near tie, as llama-server's cache_prompt does; the prefix
            // cache's own tests allow for that (`prefix_cache.rs`).
            let mut spec = ClusterSpec::new(stages, transport);
            spec.coordinator_args = vec!["--prefix-cache".into(), "off".into()];
            let cluster = Cluster::start(&model(model_file), &spec);
            let info = cluster.info().unwrap();
            assert_eq!(info.stages.len(), stages);
            // Local stages share the cores: they take turns, one group.
            assert_eq!(info.micro_batch_groups, 1);
            assert_eq!(
                info.pipeline_note
                    .contains("share the same CPUs: they take turns"),
                stages > 1,
                "{}",
                info.pipeline_note
            );
            for s in &info.stages {
                assert_eq!(
                    s.transport,
                    transport,
                    "stage {} should send over {transport}\n{}",
                    s.worker_id,
                    cluster.logs()
                );
            }
            for (p, w) in prompts.iter().zip(&want) {
                let ev = cluster
                    .generate(greedy(p, N_GEN))
                    .unwrap_or_else(|e| panic!("{e}\n{}", cluster.logs()));
                assert_eq!(
                    &ids(&ev),
                    w,
                    "{model_file}: {stages} stage(s) over {transport} differ from the engine"
                );
            }
            eprintln!("{model_file}: {stages} stage(s) over {transport}: tokens identical");
        }
    }
}

#[test]
fn gemma3_cluster_matches_engine_for_1_2_3_stages_and_both_transports() {
    check_cluster_matches_engine(GEMMA, "real_gemma3_270m.json");
}

#[test]
fn qwen2_cluster_matches_engine_for_1_2_3_stages_and_both_transports() {
    check_cluster_matches_engine(QWEN, "real_qwen2_5_coder_0_5b.json");
}

/// Text prompts are tokenized by the coordinator exactly as llama.cpp does:
/// the qwen fixture's greedy ids come back for its prompt text.
#[test]
fn text_prompt_gives_llama_cpp_tokens() {
    let fx = json("real_qwen2_5_coder_0_5b.json");
    let p = &fx["prompts"][0];
    let text = p["text"].as_str().unwrap().to_string();
    let want: Vec<u32> = omni_tests::fixtures::greedy_ids_here(
        &model(QWEN),
        &omni_tests::fixtures::ids(&p["prompt_ids"]),
        omni_tests::fixtures::ids(&p["generated_ids"]),
    );
    let _g = serial();
    let cluster = Cluster::start(&model(QWEN), &ClusterSpec::new(2, "shm"));
    let ev = cluster
        .generate(GenerateRequest {
            prompt: Some(Prompt::Text(text)),
            max_tokens: Some(N_GEN as u32),
            ignore_eos: true,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(
        ev[0].prompt_ids,
        omni_tests::fixtures::ids(&p["prompt_ids"])
    );
    assert_eq!(ids(&ev), want[..N_GEN]);
    let done = ev.last().unwrap().done.unwrap();
    assert_eq!(done.completion_tokens as usize, N_GEN);
}

/// Eight requests at once, through two stages of a deterministic cluster
/// (`--deterministic on`), each get exactly what they get alone: the same
/// tokens, and every log-probability bit for bit. Which sequences share a
/// step depends on timing, and so do the steps' shapes, the prefill chunks
/// and where each sequence's KV cells lie; none of it may show.
///
/// (Without the mode, batched steps take other ggml kernels than
/// one-token steps: measured top-2 logit drift between batched and solo
/// runs of the same tokens up to 1.29 on Gemma 3, so tokens flip at near
/// ties; the router and prefix-cache tests allow for that.)
#[test]
fn eight_concurrent_requests_match_solo_bit_for_bit() {
    let prompts = short_prompts("real_gemma3_270m.json", 8);
    assert_eq!(prompts.len(), 8);
    let _g = serial();
    let mut spec = ClusterSpec::new(2, "shm");
    spec.threads = 2;
    spec.coordinator_args = vec!["--deterministic".into(), "on".into()];
    let cluster = Cluster::start(&model(GEMMA), &spec);
    let with_top2 = |p: &Vec<u32>| GenerateRequest {
        top_logprobs: 2,
        logprobs: true,
        // Each alone computes its whole prompt; together, some start from
        // cells the others left (that must not show either).
        cache_prompt: Some(false),
        ..greedy(p, N_GEN)
    };
    let solo: Vec<_> = prompts
        .iter()
        .map(|p| cluster.generate(with_top2(p)).unwrap())
        .collect();
    let t = Instant::now();
    let reqs: Vec<_> = prompts
        .iter()
        .map(|p| GenerateRequest {
            cache_prompt: None,
            ..with_top2(p)
        })
        .collect();
    let streams = omni_tests::start_streams(&cluster.addr, reqs);
    let together = streams.handle.join().unwrap();
    let bits = streams.logprobs.lock().unwrap().clone();
    eprintln!(
        "8 concurrent requests took {:.2}s",
        t.elapsed().as_secs_f64()
    );
    for (i, evs) in solo.iter().enumerate() {
        let want_ids = ids(evs);
        let want_bits: Vec<u32> = evs
            .iter()
            .flat_map(|e| e.tokens.clone())
            .flat_map(|t| {
                let mut v: Vec<u32> = t.logprob.map(f32::to_bits).into_iter().collect();
                v.extend(t.top.iter().flat_map(|x| [x.token, x.logprob.to_bits()]));
                v
            })
            .collect();
        let got = together[i]
            .as_ref()
            .unwrap_or_else(|e| panic!("request {i}: {e}\n{}", cluster.logs()));
        assert_eq!(got, &want_ids, "request {i}: tokens differ from alone");
        assert_eq!(got.len(), N_GEN);
        assert!(
            bits[i] == want_bits,
            "request {i}: the same tokens, but log-probabilities differ from alone"
        );
    }
}

/// `--deterministic request`: a request that asks for it gets, beside three
/// that do not (in the same steps, so those steps run the invariant
/// kernels), exactly what it gets alone; the others are served as usual.
#[test]
fn a_deterministic_request_beside_others_equals_itself_alone() {
    let prompts = short_prompts("real_qwen2_5_coder_0_5b.json", 4);
    let _g = serial();
    let mut spec = ClusterSpec::new(2, "shm");
    spec.threads = 2;
    let metrics = format!("127.0.0.1:{}", omni_tests::free_port());
    spec.coordinator_args = vec![
        "--deterministic".into(),
        "request".into(),
        "--metrics-listen".into(),
        metrics.clone(),
    ];
    let cluster = Cluster::start(&model(QWEN), &spec);
    let det = GenerateRequest {
        top_logprobs: 2,
        logprobs: true,
        deterministic: true,
        ..greedy(&prompts[0], N_GEN)
    };
    let alone = omni_tests::start_streams(&cluster.addr, vec![det.clone()]);
    let want = alone.handle.join().unwrap().remove(0).unwrap();
    let want_bits = alone.logprobs.lock().unwrap()[0].clone();
    let mut reqs = vec![det];
    // The others go on after it: their last steps carry no deterministic
    // request.
    reqs.extend(prompts[1..].iter().map(|p| greedy(p, 2 * N_GEN)));
    let streams = omni_tests::start_streams(&cluster.addr, reqs);
    let got = streams.handle.join().unwrap();
    for (i, r) in got.iter().enumerate() {
        let r = r
            .as_ref()
            .unwrap_or_else(|e| panic!("request {i}: {e}\n{}", cluster.logs()));
        assert_eq!(
            r.len(),
            if i == 0 { N_GEN } else { 2 * N_GEN },
            "request {i}"
        );
    }
    assert_eq!(got[0].as_ref().unwrap(), &want, "tokens differ from alone");
    assert!(
        streams.logprobs.lock().unwrap()[0] == want_bits,
        "log-probabilities differ from alone"
    );
    // Only the steps that carried it ran invariant: the others' last ones
    // did not.
    let (status, body) = omni_tests::http(&metrics, "GET", "/metrics", &[], b"");
    assert_eq!(status, 200);
    let value = |name: &str| omni_tests::metric_value(&body, name);
    let (all, invariant) = (
        value("omni_coordinator_steps_total"),
        value("omni_coordinator_invariant_steps_total"),
    );
    assert!(
        invariant >= 2 * N_GEN as u64 && invariant < all,
        "{invariant} of {all} steps ran invariant"
    );
}

/// Every failure below must end within this long.
const BOUND: Duration = Duration::from_secs(60);

#[test]
fn plan_that_does_not_fit_fails_before_loading_naming_the_worker() {
    let _g = serial();
    let mut spec = ClusterSpec::new(2, "auto");
    spec.worker_args = vec![
        vec!["--memory".into(), "4GiB".into()],
        vec!["--memory".into(), "20MiB".into()],
    ];
    let mut c = Cluster::spawn(&model(QWEN), &spec);
    let ok = c.coordinator.wait_exit(BOUND);
    assert_eq!(ok, Some(false), "the coordinator should fail\n{}", c.logs());
    let log = c.coordinator.log_text();
    assert!(log.contains("w1"), "the error names the worker:\n{log}");
    assert!(
        log.contains("free"),
        "the error gives the bytes free:\n{log}"
    );
    assert!(
        !c.workers.iter().any(|w| w.log_text().contains("loading")),
        "nothing may be loaded when the plan fails\n{}",
        c.logs()
    );
}

#[test]
fn unsupported_architecture_is_refused_by_name() {
    let _g = serial();
    let path = fixtures_dir().join("synthetic/tiny-deepseek3_2-unsupported-f32.gguf");
    let mut c = Cluster::spawn(&path, &ClusterSpec::new(1, "auto"));
    assert_eq!(c.coordinator.wait_exit(BOUND), Some(false));
    let log = c.coordinator.log_text();
    assert!(
        log.contains("deepseek3_2") && log.contains("not supported"),
        "{log}"
    );
}

#[test]
fn worker_that_never_registers_is_reported() {
    let _g = serial();
    let mut spec = ClusterSpec::new(2, "auto");
    spec.start_workers = Some(1);
    spec.coordinator_args = vec!["--register-timeout".into(), "3".into()];
    let mut c = Cluster::spawn(&model(GEMMA), &spec);
    assert_eq!(c.coordinator.wait_exit(BOUND), Some(false), "{}", c.logs());
    let log = c.coordinator.log_text();
    assert!(
        log.contains("only 1 of 2 workers registered within 3s"),
        "{log}"
    );
}

#[test]
fn worker_dying_mid_request_ends_the_stream_with_a_clear_error_when_it_cannot_recover() {
    let _g = serial();
    // Nobody restarts w1 here, and w0 alone cannot hold the model (w0
    // offers 900 MiB; the model needs 928 MiB on one): after the rejoin
    // timeout the planner refuses, and at the recovery deadline the request
    // ends, saying why (recovery itself is tests/tests/recovery.rs). w1
    // offers more: on one host the two share its RAM, the larger offer,
    // which must hold both stages.
    let mut spec = ClusterSpec::new(2, "shm");
    spec.coordinator_args = ["--recovery-timeout", "4", "--rejoin-timeout", "1"]
        .map(String::from)
        .to_vec();
    spec.worker_args = vec![
        vec!["--memory".into(), "900MiB".into()],
        vec!["--memory".into(), "4GiB".into()],
    ];
    let mut c = Cluster::start(&model(GEMMA), &spec);
    let prompt = short_prompts("real_gemma3_270m.json", 1).remove(0);
    let (msg, after) =
        c.kill_mid_stream(greedy(&prompt, 900), |c| c.workers[1].kill9(), "w1", BOUND);
    assert!(
        msg.contains("could not recover within 4s") && msg.contains("cannot take its layers"),
        "{msg}"
    );
    eprintln!(
        "worker killed: stream ended after {:.2}s with: {msg}",
        after.as_secs_f64()
    );
}

/// A client that goes away mid-stream frees its sequence's KV cache on every
/// worker (each worker's Status shows the cells in use).
#[test]
fn cancelling_a_request_frees_its_kv_cache_on_every_worker() {
    let _g = serial();
    // Without the prefix cache every cell is free again (with it, the
    // cache's stay: `prefix_cache.rs`).
    let mut spec = ClusterSpec::new(2, "shm");
    spec.coordinator_args = vec!["--prefix-cache".into(), "off".into()];
    let c = Cluster::start(&model(GEMMA), &spec);
    let used = || c.kv_cells_used();
    let prompt = short_prompts("real_gemma3_270m.json", 1).remove(0);
    let mut client = c.client().unwrap();
    c.rt.block_on(async {
        use tokio_stream::StreamExt;
        let mut stream = client
            .generate(greedy(&prompt, 900))
            .await
            .unwrap()
            .into_inner();
        for _ in 0..4 {
            stream.next().await.unwrap().unwrap();
        }
        // Dropping the stream is what a disconnecting client does.
    });
    let during = used();
    eprintln!("KV cells in use right after the client left: {during:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = used();
        if now.iter().all(|&u| u == 0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "KV cells still in use 10 s after the client left: {now:?}\n{}",
            c.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // And the cluster still serves.
    let ev = c.generate(greedy(&prompt, 4)).unwrap();
    assert_eq!(ids(&ev).len(), 4);
}

/// `omnictl up` starts a coordinator and its workers, prefixes their logs,
/// serves requests, and Ctrl-C stops every process and cleans shared memory.
#[test]
fn omnictl_up_serves_and_stops_cleanly_on_ctrl_c() {
    let _g = serial();
    let rings = || -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.filter_map(Result::ok)
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with("omni-"))
                    .collect()
            })
            .unwrap_or_default()
    };
    let before = rings();
    let dir = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{}", omni_tests::free_port());
    let port = omni_tests::free_port();
    let mut cmd = std::process::Command::new(omni_tests::target_bin("omnictl"));
    cmd.args(["up", "--stages", "2", "--threads", "1", "--ctx", "512"])
        .arg("--model")
        .arg(model(GEMMA))
        .args(["--listen", &addr])
        .args(["--port", &port.to_string()]);
    let mut up = omni_tests::Proc::spawn("omnictl-up", cmd, dir.path());
    let deadline = Instant::now() + Duration::from_secs(120);
    while !up.log_text().contains("omnictl: ready") {
        assert!(Instant::now() < deadline, "not ready:\n{}", up.log_text());
        assert!(
            up.child.try_wait().unwrap().is_none(),
            "exited:\n{}",
            up.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let prompt = short_prompts("real_gemma3_270m.json", 1).remove(0);
    let ids_arg: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let out = std::process::Command::new(omni_tests::target_bin("omnictl"))
        .args([
            "generate",
            "--coordinator",
            &addr,
            "--json",
            "-n",
            "8",
            "--ignore-eos",
        ])
        .args(["--prompt-ids", &ids_arg.join(",")])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let got: Vec<u32> = omni_tests::fixtures::ids(&report["generated_ids"]);
    assert_eq!(got, reference(GEMMA, &[prompt]).remove(0)[..8]);

    // The OpenAI endpoint is up too.
    let models = http_get(&format!("127.0.0.1:{port}"), "/v1/models");
    assert!(models.contains("\"object\":\"list\""), "{models}");

    let log = up.log_text();
    for name in ["[coordinator]", "[w0]", "[w1]", "[router]"] {
        assert!(log.contains(name), "log lines carry {name}:\n{log}");
    }
    let pid = up.child.id().to_string();
    std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap();
    assert_eq!(
        up.wait_exit(Duration::from_secs(20)),
        Some(true),
        "omnictl up should stop cleanly on Ctrl-C:\n{}",
        up.log_text()
    );
    // Every child is gone: nothing listens on the coordinator's port, and
    // the shared-memory rings were removed.
    assert!(std::net::TcpStream::connect(&addr).is_err());
    let leftover: Vec<_> = rings()
        .into_iter()
        .filter(|r| !before.contains(r))
        .collect();
    assert!(
        leftover.is_empty(),
        "shared memory left behind: {leftover:?}"
    );
}

fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// Prometheus endpoints on the coordinator and on every worker report what
/// a request did: tokens out, queue depth, per-stage step time, and the bytes
/// each worker sent over its transport.
#[test]
fn metrics_show_tokens_step_times_and_bytes_per_transport() {
    let _g = serial();
    let (cm, w0m, w1m) = (
        format!("127.0.0.1:{}", omni_tests::free_port()),
        format!("127.0.0.1:{}", omni_tests::free_port()),
        format!("127.0.0.1:{}", omni_tests::free_port()),
    );
    let mut spec = ClusterSpec::new(2, "shm");
    spec.coordinator_args = vec!["--metrics-listen".into(), cm.clone()];
    spec.worker_args = vec![
        vec!["--metrics-listen".into(), w0m.clone()],
        vec!["--metrics-listen".into(), w1m.clone()],
    ];
    let c = Cluster::start(&model(GEMMA), &spec);
    let prompt = short_prompts("real_gemma3_270m.json", 1).remove(0);
    c.generate(greedy(&prompt, 8)).unwrap();
    let coord = http_get(&cm, "/metrics");
    assert!(
        coord.contains("omni_coordinator_tokens_out_total 8"),
        "{coord}"
    );
    assert!(coord.contains("omni_coordinator_queue_depth"), "{coord}");
    assert!(
        coord.contains("omni_coordinator_stage_step_ms_count{stage=\"1\"}"),
        "{coord}"
    );
    let w0 = http_get(&w0m, "/metrics");
    assert!(
        w0.contains("omni_worker_bytes_sent_total{transport=\"shm\"}"),
        "{w0}"
    );
    assert!(w0.contains("omni_worker_steps_total"), "{w0}");
    let w1 = http_get(&w1m, "/metrics");
    assert!(w1.contains("omni_worker_frames_received_total"), "{w1}");
}

/// A prompt longer than the micro-batch is prefilled in chunks across
/// steps, and the tokens are still the engine's.
#[test]
fn long_prompt_is_prefilled_in_chunks() {
    let p: Vec<u32> = json("real_qwen2_5_coder_0_5b.json")["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| omni_tests::fixtures::ids(&p["prompt_ids"]))
        .find(|p| p.len() > 40 && p.len() < 100)
        .expect("a prompt of 40 to 100 tokens");
    let want = reference(QWEN, std::slice::from_ref(&p)).remove(0);
    let _g = serial();
    let mut spec = ClusterSpec::new(2, "shm");
    spec.coordinator_args = vec!["--ubatch".into(), "16".into()];
    let c = Cluster::start(&model(QWEN), &spec);
    let ev = c.generate(greedy(&p, N_GEN)).unwrap();
    assert_eq!(ids(&ev), want, "{} prompt tokens in chunks of 16", p.len());
}

/// A long prompt that arrives while another stream generates is prefilled
/// in `--prefill-chunk` pieces between that stream's decode steps, not in
/// steps of a whole micro-batch that would hold the stream up; both
/// requests get all their tokens.
#[test]
fn a_long_prompt_is_prefilled_between_a_running_streams_decode_steps() {
    use tokio_stream::StreamExt;
    const CHUNK: usize = 16;
    let short = short_prompts("real_gemma3_270m.json", 1).remove(0);
    // About 150 tokens of real text: the fixture's prompts one after another.
    let long: Vec<u32> = short_prompts("real_gemma3_270m.json", 20)
        .concat()
        .into_iter()
        .take(150)
        .collect();
    assert!(long.len() > 6 * CHUNK, "{} tokens", long.len());
    let _g = serial();
    let cm = format!("127.0.0.1:{}", omni_tests::free_port());
    let mut spec = ClusterSpec::new(2, "shm");
    spec.coordinator_args = vec![
        "--prefill-chunk".into(),
        CHUNK.to_string(),
        "--metrics-listen".into(),
        cm.clone(),
    ];
    let c = Cluster::start(&model(GEMMA), &spec);
    let (mut a, mut b) = (c.client().unwrap(), c.client().unwrap());
    let (running, arriving) = c.rt.block_on(async {
        let mut stream = a.generate(greedy(&short, 64)).await.unwrap().into_inner();
        let first = stream.next().await.unwrap().unwrap();
        // The first stream decodes now; the long prompt comes in.
        let late = tokio::spawn(async move { omni_tests::collect(&mut b, greedy(&long, 4)).await });
        let mut n = first.tokens.len();
        while let Some(ev) = stream.next().await {
            n += ev.unwrap().tokens.len();
        }
        (n, late.await.unwrap().unwrap())
    });
    assert_eq!(running, 64, "{}", c.logs());
    let late: usize = arriving.iter().map(|e| e.tokens.len()).sum();
    assert_eq!(late, 4, "{}", c.logs());
    let m = http_get(&cm, "/metrics");
    let metric = |name: &str| -> f64 {
        m.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{m}"))
    };
    let mixed = metric("omni_coordinator_mixed_step_prompt_tokens_count");
    let within = metric(&format!(
        "omni_coordinator_mixed_step_prompt_tokens_bucket{{le=\"{CHUNK}.0\"}}"
    ));
    assert!(
        mixed >= 6.0,
        "the long prompt rode along with decode steps in {mixed} steps\n{m}"
    );
    assert_eq!(
        within, mixed,
        "every step that decoded carried at most {CHUNK} prompt tokens\n{m}"
    );
}

/// The synthetic mixture-of-experts models (qwen3moe, and deepseek2 in both
/// GGUF layouts), split across two workers over each transport, give
/// llama.cpp's greedy tokens from their own fixture (every prompt, all 32
/// steps).
#[test]
fn moe_models_split_across_workers_give_llama_cpp_tokens() {
    let _g = serial();
    let names = ["qwen3moe", "deepseek2-mla", "deepseek2-legacy"]
        .iter()
        .flat_map(|m| ["f32", "q8_0", "q4_k_m"].map(|q| format!("{m}-{q}")));
    for name in names {
        let file = fixtures_dir().join(format!("synthetic/tiny-{name}.gguf"));
        let fx = json(&format!("synthetic/ref_tiny-{name}.json"));
        for transport in ["shm", "grpc"] {
            let cluster = Cluster::start(&file, &ClusterSpec::new(2, transport));
            for g in fx["generations"].as_array().unwrap() {
                let prompt = omni_tests::fixtures::ids(&g["prompt_ids"]);
                let want = omni_tests::fixtures::greedy_ids_here(
                    &file,
                    &prompt,
                    omni_tests::fixtures::ids(&g["generated_ids"]),
                );
                let ev = cluster
                    .generate(greedy(&prompt, want.len()))
                    .unwrap_or_else(|e| panic!("{e}\n{}", cluster.logs()));
                assert_eq!(ids(&ev), want, "{name}, 2 stages over {transport}");
            }
            eprintln!("{name}: 2 stages over {transport}: llama.cpp's tokens");
        }
    }
}

/// Stages with cores of their own (workers pinned to disjoint CPUs, as on
/// two hosts or two NUMA nodes) overlap: one micro-batch group per stage,
/// and concurrent requests still get the engine's tokens (the cluster test
/// tolerance: batched and solo rows may differ at near ties, so compared
/// against each request alone through the same cluster).
#[test]
fn stages_on_their_own_cores_overlap() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let allowed = omni_telemetry::cpus::allowed();
    if cpus < 2 || allowed.len() < 2 {
        eprintln!("skipped: needs two CPUs (this machine has {cpus})");
        return;
    }
    let _g = serial();
    let prompts = short_prompts("real_gemma3_270m.json", 2);
    let spec = ClusterSpec {
        worker_cpus: vec![allowed[0].to_string(), allowed[1].to_string()],
        ..ClusterSpec::new(2, "shm")
    };
    let cluster = Cluster::start(&model(GEMMA), &spec);
    let info = cluster.info().unwrap();
    assert_eq!(info.micro_batch_groups, 2, "{}", cluster.logs());
    assert_eq!(info.pipeline_note, "");
    let want = reference(GEMMA, &prompts);
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| ids(&cluster.generate(greedy(p, N_GEN)).unwrap()))
        .collect();
    assert_eq!(alone, want, "each request alone gets the engine's tokens");
    let streams = omni_tests::start_streams(
        &cluster.addr,
        prompts.iter().map(|p| greedy(p, N_GEN)).collect(),
    );
    omni_tests::same_tokens(
        &streams.handle.join().unwrap(),
        &alone,
        "two groups in flight",
    );
}

/// `omnictl bench-serve` (a benchmark: no speed is asserted here) runs
/// omni behind the router and accounts for each stage's time: computing,
/// sending on and waiting for input cover the wall time between two
/// readings, and every stage computed something.
#[test]
fn bench_serve_accounts_for_each_stages_time() {
    let _g = serial();
    let out = std::process::Command::new(omni_tests::target_bin("omnictl"))
        .args(["bench-serve", "--model"])
        .arg(model(GEMMA))
        .args([
            "--stages",
            "2",
            "--streams",
            "2",
            "--tokens",
            "8",
            "--rounds",
            "1",
        ])
        .args(["--no-chat", "--json", "-t", "1"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let row = &v["rows"][0];
    assert_eq!(row["config"], "omni 2 stages", "{v}");
    assert!(row["one_stream_tok_s"].as_f64().unwrap() > 0.0, "{v}");
    assert!(row["streams_tok_s"].as_f64().unwrap() > 0.0, "{v}");
    let stages = row["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 2, "{v}");
    for (s, worker) in stages.iter().zip(["w0", "w1"]) {
        assert_eq!(s["worker"], worker);
        let part = |k: &str| s[k].as_f64().unwrap();
        let all = part("compute") + part("send") + part("input_wait");
        assert!(part("compute") > 0.0, "{s}");
        assert!(
            (0.8..=1.05).contains(&all),
            "the timeline covers the wall time: {s}"
        );
    }
}
