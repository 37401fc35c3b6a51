//! End-to-end: a request survives the crash of any worker. `omnictl up` is
//! the supervisor (it starts a worker that exits again); the coordinator
//! notices the loss, reloads the worker's layers (or experts), resets the
//! other stages, wires the pipeline again and replays every sequence from
//! its log into the same KV cells. What a user would notice: the streams
//! pause and then finish, with the tokens of a run without crashes.
//!
//! The model is the tiny synthetic deepseek2 (MLA, Q8_0) with every MoE
//! layer's routed experts on an expert worker, so the three kinds of
//! process can be killed: the first stage, the last stage and the
//! cpu-worker. The clusters whose tokens are compared run deterministic
//! (`--deterministic on`): the streams share steps, and a replay computes
//! them in other steps than the first time, yet every token and every
//! log-probability comes out bit for bit as in a run without the crash.

use omni_proto::coordinator::v1::{GenerateRequest, Speculative};
use omni_tests::{
    greedy, http, http_with_head, same_tokens, start_router, start_streams, Supervised,
};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const N_GEN: usize = 160;

fn model() -> std::path::PathBuf {
    omni_tests::fixtures::fixtures_dir().join("synthetic/tiny-deepseek2-mla-q8_0.gguf")
}

fn requests() -> Vec<GenerateRequest> {
    [
        &[1u32, 17, 42, 99, 5][..],
        &[1, 3, 5, 7],
        &[1, 200, 33],
        &[1, 9, 8, 7, 6, 5, 4],
    ]
    .iter()
    .map(|p| GenerateRequest {
        logprobs: true,
        top_logprobs: 2,
        ..greedy(p, N_GEN)
    })
    .collect()
}

/// Two stages (layers 2,2) and one expert worker, 4 sequences,
/// deterministic.
fn cluster(env: &[(&str, &str)]) -> Supervised {
    supervised(
        &model(),
        &[
            "--stages",
            "2",
            "--cpu-workers",
            "1",
            "--experts",
            "cpu",
            "--counts",
            "2,2",
            "--deterministic",
            "on",
        ],
        env,
    )
}

/// `omnictl up` with 4 sequences of 512 tokens, one thread per worker
/// unless `args` say otherwise, shared memory, health every 0.5 s.
fn supervised(model: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Supervised {
    let mut env = env.to_vec();
    env.push(("OMNI_COORDINATOR_HEALTH_INTERVAL", "0.5"));
    let mut args = args.to_vec();
    args.extend(["--ctx", "512", "--seqs", "4", "--transport", "shm"]);
    if !args.contains(&"--threads") {
        args.extend(["--threads", "1"]);
    }
    Supervised::start(model, &args, &env)
}

/// What the streams get without a crash: their tokens, and their
/// log-probabilities bit for bit.
struct Clean {
    ids: Vec<Vec<u32>>,
    logprobs: Vec<Vec<u32>>,
}

fn clean_run(c: &Supervised, reqs: Vec<GenerateRequest>) -> Clean {
    let streams = start_streams(&c.addr, reqs);
    let ids = streams
        .handle
        .join()
        .unwrap()
        .into_iter()
        .map(|r| r.expect("the clean run"))
        .collect();
    let logprobs = streams.logprobs.lock().unwrap().clone();
    Clean { ids, logprobs }
}

/// Runs the 4 streams, doing `hurt` once they are a few tokens in; checks
/// every stream finished with `want`'s tokens and log-probabilities and
/// returns the longest pause a stream saw.
fn run_through(
    c: &Supervised,
    reqs: Vec<GenerateRequest>,
    want: &Clean,
    what: &str,
    hurt: impl FnOnce(&Supervised),
) -> Duration {
    let total: usize = reqs
        .iter()
        .map(|r| r.max_tokens.unwrap_or(0) as usize)
        .sum();
    let streams = start_streams(&c.addr, reqs);
    streams.wait_for(total / 8);
    hurt(c);
    let at = streams.progress.load(Ordering::Relaxed);
    let results = streams.handle.join().unwrap();
    assert!(
        at < total,
        "{what} came after the streams had finished ({at} tokens)"
    );
    if results.iter().any(Result::is_err) {
        panic!("{what}: {results:?}\n{}", c.proc.log_text());
    }
    same_tokens(&results, &want.ids, what);
    let bits = streams.logprobs.lock().unwrap().clone();
    for (i, (got, want)) in bits.iter().zip(&want.logprobs).enumerate() {
        assert!(
            got == want,
            "{what}: stream {i} has the same tokens but other log-probabilities"
        );
    }
    Duration::from_micros(streams.max_gap_us.load(Ordering::Relaxed))
}

#[test]
fn streams_survive_kill_9_of_the_first_stage_the_last_stage_and_the_cpu_worker() {
    let c = cluster(&[]);
    let want = clean_run(&c, requests());
    let mut report = Vec::new();
    for victim in ["w0", "w1", "c0"] {
        let mut old = 0;
        let stall = run_through(&c, requests(), &want, &format!("kill -9 {victim}"), |c| {
            old = c.signal(victim, "-9");
        });
        // The supervisor started it again, and the cluster serves.
        c.wait_ready(Duration::from_secs(30));
        let new = c.pid_of(victim).expect("restarted");
        assert_ne!(new, old, "{victim} runs as a new process");
        report.push(format!("{victim}: {:.2} s", stall.as_secs_f64()));
    }
    let log = c.proc.log_text();
    assert_eq!(
        log.matches("starting it again").count(),
        3,
        "three restarts\n{log}"
    );
    assert!(
        !log.contains("the replay sampled token"),
        "a replay diverged\n{log}"
    );
    eprintln!(
        "kill -9 mid-stream, 4 streams, identical tokens; longest pause per kill: {}",
        report.join(", ")
    );
}

/// Speculative decoding through a crash: the streams verify n-gram drafts
/// (the tiny model's greedy answers repeat, so drafts are taken) when the
/// last stage, which verifies them, is killed. The replay verifies each
/// logged step's taken drafts again (the sampler draws as before) and
/// sends none of them twice: every stream ends with the tokens and
/// log-probabilities of the run without drafts and without the crash.
#[test]
fn drafting_streams_survive_kill_9_of_the_last_stage_with_the_tokens_of_a_run_without_drafts() {
    // Drafts as long as their matches (deterministic rows cost what a
    // step does, so tuned lengths would send few).
    let c = cluster(&[
        ("OMNI_ADMIN_TOKEN", "recovery-test"),
        ("OMNI_COORDINATOR_DRAFT_LENGTH", "agreement"),
    ]);
    let want = clean_run(&c, requests());
    let drafting = || -> Vec<GenerateRequest> {
        requests()
            .into_iter()
            .map(|r| GenerateRequest {
                speculative: Some(Speculative {
                    n_max: Some(8),
                    ..Default::default()
                }),
                ..r
            })
            .collect()
    };
    // Without a crash first: the same tokens, and drafts were taken.
    let calm = clean_run(&c, drafting());
    assert_eq!(calm.ids, want.ids, "drafts changed the tokens");
    assert!(
        calm.logprobs == want.logprobs,
        "drafts changed the log-probabilities"
    );
    let (ok, top, err) =
        omni_tests::omnictl_admin(&c.admin_addr, Some("recovery-test"), &["top", "--once"]);
    assert!(ok && top.contains("% accepted ("), "{top}{err}");
    eprintln!("{}", top.lines().next().unwrap_or_default());
    run_through(&c, drafting(), &want, "kill -9 w1 while drafting", |c| {
        c.signal("w1", "-9");
    });
    let log = c.proc.log_text();
    assert!(
        !log.contains("the replay sampled token"),
        "a replay diverged\n{log}"
    );
}

/// Two streams that start from one cached prefix (their cells shared on
/// every stage) survive kill -9 of the last stage: the recovery drops the
/// prefix cache, says so, and each stream computes its prefix again in
/// cells of its own before its log is replayed. Both finish with the
/// tokens of a run without the crash, bit for bit: a deterministic
/// cluster computes a prefix the same in a replay step of another shape.
#[test]
fn streams_sharing_a_cached_prefix_survive_kill_9_and_the_cache_is_dropped() {
    let c = cluster(&[]);
    let system: Vec<u32> = (0..40).map(|i| 1 + (i * 13) % 300).collect();
    let with = |tail: &[u32], n: usize| {
        let mut p = system.clone();
        p.extend_from_slice(tail);
        greedy(&p, n)
    };
    let reqs = vec![with(&[3, 4], N_GEN), with(&[5, 6, 2], N_GEN)];
    let want = clean_run(&c, reqs.clone());
    // The first request leaves the system prompt's two blocks cached.
    let first = start_streams(&c.addr, vec![with(&[7, 8, 9], 4)]);
    assert!(first.handle.join().unwrap()[0].is_ok());
    run_through(&c, reqs, &want, "kill -9 w1 under a shared prefix", |c| {
        c.signal("w1", "-9");
    });
    let log = c.proc.log_text();
    assert!(
        log.contains("recovery dropped the prefix cache (")
            && log.contains("cached prefixes of 2 sequences are computed again"),
        "the log says the cache was dropped\n{log}"
    );
    c.wait_ready(Duration::from_secs(30));
    // And it serves again.
    let again = start_streams(&c.addr, vec![with(&[1], 2)]);
    assert_eq!(again.handle.join().unwrap()[0].as_ref().unwrap().len(), 2);
}

/// The same on a real model: Gemma 3 270M on three deterministic stages
/// of 2 threads each, the middle one killed when the streams hold more
/// than 512 KV cells (where ggml's own attention would split each decode
/// row over the threads): every token and log-probability as without the
/// crash.
#[test]
fn gemma_streams_survive_kill_9_of_a_middle_stage_bit_for_bit() {
    let c = supervised(
        &omni_tests::fixtures::model(omni_tests::fixtures::GEMMA),
        &[
            "--stages",
            "3",
            "--counts",
            "7,5,6",
            "--threads",
            "2",
            "--deterministic",
            "on",
        ],
        &[],
    );
    const N: usize = 192;
    let reqs: Vec<GenerateRequest> = omni_tests::short_prompts("real_gemma3_270m.json", 4)
        .iter()
        .map(|p| GenerateRequest {
            logprobs: true,
            top_logprobs: 2,
            ..greedy(p, N)
        })
        .collect();
    let want = clean_run(&c, reqs.clone());
    let cells = |c: &Supervised| {
        let st = c.statuses();
        st.iter().map(|s| s.kv_cells_used).max().unwrap_or(0)
    };
    let mut at_kill = 0;
    let stall = run_through(&c, reqs, &want, "kill -9 w1", |c| {
        // Past 512 cells in use before the kill.
        let t = Instant::now();
        while cells(c) <= 512 {
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "the streams never held 512 cells"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        at_kill = cells(c);
        c.signal("w1", "-9");
    });
    eprintln!(
        "Gemma 3, kill -9 of the middle stage at {at_kill} KV cells: identical tokens and log-probabilities, longest pause {:.2} s",
        stall.as_secs_f64()
    );
}

/// A stopped worker (SIGSTOP) answers nothing but does not exit, so no
/// supervisor restarts it: its health checks time out, it counts as lost,
/// and after `--rejoin-timeout` the other stage takes all the layers.
#[test]
fn a_stopped_worker_is_found_by_its_heartbeat_and_the_others_take_its_layers() {
    let c = cluster(&[("OMNI_COORDINATOR_REJOIN_TIMEOUT", "2")]);
    let want = clean_run(&c, requests());
    let mut detected = None;
    let stall = run_through(&c, requests(), &want, "SIGSTOP w1", |c| {
        c.signal("w1", "-STOP");
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if c.info().is_ok_and(|i| i.state.starts_with("recovering")) {
                detected = Some(t.elapsed());
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let detected = detected.expect("the stop was noticed");
    c.signal("w1", "-CONT");
    // Health every 0.5 s, 1 s to answer, two misses: within about 3 s.
    assert!(
        detected < Duration::from_secs(5),
        "noticed after {detected:?}"
    );
    let info = c.info().unwrap();
    let stages: Vec<(String, String)> = info
        .stages
        .iter()
        .map(|s| (s.worker_id.clone(), s.range.clone()))
        .collect();
    assert_eq!(
        stages,
        [("w0".to_string(), "embed + layers 0-3 + head".to_string())]
    );
    eprintln!(
        "SIGSTOP w1: noticed after {:.2} s, longest pause {:.2} s (with a 2 s rejoin timeout), identical tokens; w0 now runs every layer",
        detected.as_secs_f64(),
        stall.as_secs_f64()
    );
}

/// While the cluster recovers (here: a stopped worker it waits for),
/// `/ready` says not ready and why; requests wait up to `--max-queue`, the
/// next are refused with 503 and `Retry-After`; once the worker answers
/// again the waiting requests are served, and `/ready` is ready.
#[test]
fn while_recovering_requests_queue_to_a_bound_then_get_503_and_ready_says_not_ready() {
    let c = cluster(&[
        ("OMNI_COORDINATOR_MAX_QUEUE", "2"),
        ("OMNI_COORDINATOR_REJOIN_TIMEOUT", "600"),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let (_router, api) = start_router(dir.path(), &["--model".into(), format!("tiny={}", c.addr)]);
    let body = serde_json::json!({"model": "tiny", "prompt": [1, 17, 42], "max_tokens": 8, "temperature": 0}).to_string();
    let complete = |api: &str| {
        http(
            api,
            "POST",
            "/v1/completions",
            &[("Content-Type", "application/json")],
            body.as_bytes(),
        )
    };
    let (status, before) = complete(&api);
    assert_eq!(status, 200, "{before}");

    c.signal("w1", "-STOP");
    let t = Instant::now();
    let ready = loop {
        let (status, body) = http(&api, "GET", "/ready", &[], b"");
        if status != 200 {
            break body;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "/ready stayed ready");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(ready.contains("recovering"), "{ready}");
    // Two wait in the queue (their answers come after the recovery) ...
    let waiting: Vec<_> = (0..2)
        .map(|_| {
            let (api, body) = (api.clone(), body.clone());
            std::thread::spawn(move || {
                http(
                    &api,
                    "POST",
                    "/v1/completions",
                    &[("Content-Type", "application/json")],
                    body.as_bytes(),
                )
            })
        })
        .collect();
    let t = Instant::now();
    while c.info().unwrap().queue_depth < 2 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the requests did not queue"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // ... and the third is turned away, with when to come back.
    let (status, head, refused) = http_with_head(
        &api,
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        body.as_bytes(),
    );
    assert_eq!(status, 503, "{refused}");
    assert!(
        head.to_ascii_lowercase().contains("retry-after: 2"),
        "{head}"
    );
    let v: serde_json::Value = serde_json::from_str(&refused).unwrap();
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("recovering") && msg.contains("w1"), "{msg}");

    c.signal("w1", "-CONT");
    for w in waiting {
        let (status, answer) = w.join().unwrap();
        assert_eq!(status, 200, "{answer}");
        let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
        let b: serde_json::Value = serde_json::from_str(&before).unwrap();
        assert_eq!(v["choices"][0]["text"], b["choices"][0]["text"]);
    }
    let (status, ready) = http(&api, "GET", "/ready", &[], b"");
    assert_eq!(status, 200, "{ready}");
}

/// A constrained answer comes back exactly in a crash replay: the
/// instruction-tuned Qwen model on two stages answers a chat with JSON that
/// must fit a schema, and the last stage (which holds the grammar's state
/// with the sampler) is killed mid-answer. The answers are the clean run's
/// tokens, and they parse and fit the schema.
#[test]
fn a_constrained_answer_survives_kill_9_of_the_stage_that_holds_its_grammar() {
    use omni_proto::coordinator::v1::generate_request::Prompt;
    use omni_proto::coordinator::v1::{Chat, ChatMessage};
    use omni_proto::worker::v1::{grammar::Kind, Grammar, Sampling};
    let qwen = omni_tests::fixtures::model(omni_tests::fixtures::QWEN);
    let c = supervised(&qwen, &["--stages", "2", "--deterministic", "on"], &[]);
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"cities": {
            "type": "array", "minItems": 3, "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
                "required": ["name", "country"],
                "additionalProperties": false
            }
        }},
        "required": ["cities"],
        "additionalProperties": false
    });
    let ask = |what: &str| GenerateRequest {
        prompt: Some(Prompt::Chat(Chat {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: format!("Name three {what} cities and their countries, as JSON."),
                ..Default::default()
            }],
            ..Default::default()
        })),
        max_tokens: Some(200),
        sampling: Some(Sampling {
            grammar: Some(Grammar {
                kind: Some(Kind::JsonSchema(schema.to_string())),
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let reqs = vec![ask("European"), ask("Asian")];
    let want = clean_run(&c, reqs.clone());
    let tok = omni_engine::tokenizer::Tokenizer::load(&qwen).unwrap();
    for ids in &want.ids {
        let text = tok.decode(ids);
        let text = text
            .trim_end_matches("<|im_end|>")
            .trim_end_matches("<|endoftext|>");
        let v: serde_json::Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("the answer is not JSON ({e}): {text:?}"));
        let cities = v["cities"].as_array().expect("cities");
        assert_eq!(cities.len(), 3, "{v}");
        eprintln!("{} tokens: {v}", ids.len());
        assert!(cities
            .iter()
            .all(|c| c["name"].is_string() && c["country"].is_string()));
    }
    let total: usize = want.ids.iter().map(Vec::len).sum();
    let streams = start_streams(&c.addr, reqs);
    streams.wait_for(total / 4);
    c.signal("w1", "-9");
    let at = streams.progress.load(Ordering::Relaxed);
    let results = streams.handle.join().unwrap();
    assert!(at < total, "the kill came after the answers ({at} tokens)");
    same_tokens(&results, &want.ids, "kill -9 of the last stage");
    eprintln!("killed the last stage at {at} of {total} tokens: the same answers");
    let log = c.proc.log_text();
    assert!(log.contains("starting it again"), "{log}");
    assert!(
        !log.contains("the replay sampled token"),
        "a replay diverged\n{log}"
    );
}
