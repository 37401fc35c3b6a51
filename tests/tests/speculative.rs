//! End-to-end: speculative decoding (n-gram drafts verified by the last
//! stage) gives the tokens decoding without it gives, through a real
//! two-stage cluster of Qwen2.5-Coder 0.5B on a code-rewrite request,
//! where the answer repeats most of the prompt. The cluster runs
//! deterministic (`--deterministic on`): a step that verifies a draft of k
//! tokens computes each row as one token alone would, so greedy and seeded
//! sampled answers, log-probabilities, grammars, stop strings and `n`
//! streams come out bit for bit as without drafts. What a user notices
//! besides: `timings.draft_n` / `draft_n_accepted` in the response, the
//! coordinator's draft counters, and fewer steps for the same tokens.
//!
//! The speed (decode tok/s with and without drafts, beside llama-server's
//! n-gram speculation on the same prompts) is `omnictl bench-spec`'s job
//! (docs/benchmarks.md), not a test's.

use omni_proto::coordinator::v1::{
    generate_request::Prompt, Chat, ChatMessage, Done, GenerateEvent, GenerateRequest, Speculative,
};
use omni_proto::worker::v1::{grammar::Kind, Grammar, Sampling};
use omni_tests::fixtures::{model, GEMMA, QWEN};
use omni_tests::{http, start_router, start_streams, Cluster, ClusterSpec, Supervised};

const REWRITE: &str = "Here is a Python function:

def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    discount = 0
    if subtotal > 100:
        discount = subtotal * 0.05
    tax = (subtotal - discount) * tax_rate
    return round(subtotal - discount + tax, 2)

Raise the discount threshold from 100 to 250 and change nothing else. Reply with the whole function in a code block.";

fn chat(text: &str, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: Some(Prompt::Chat(Chat {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: text.into(),
                ..Default::default()
            }],
            ..Default::default()
        })),
        max_tokens: Some(max_tokens),
        logprobs: true,
        top_logprobs: 2,
        ..Default::default()
    }
}

/// `req` with drafts of at most `n_max` tokens (0: none).
fn drafting(req: &GenerateRequest, n_max: u32) -> GenerateRequest {
    GenerateRequest {
        speculative: Some(Speculative {
            n_max: Some(n_max),
            ..Default::default()
        }),
        ..req.clone()
    }
}

/// What a client sees of one answer.
#[derive(Debug, PartialEq)]
struct Answer {
    ids: Vec<u32>,
    text: String,
    /// Each token's log-probability and its top entries, bit for bit.
    logprobs: Vec<u32>,
    finish_reason: i32,
}

fn answer(events: &[GenerateEvent]) -> (Answer, Done) {
    let mut a = Answer {
        ids: Vec::new(),
        text: String::new(),
        logprobs: Vec::new(),
        finish_reason: 0,
    };
    let mut done = None;
    for ev in events {
        a.text.push_str(&ev.text);
        for t in &ev.tokens {
            a.ids.push(t.id);
            a.logprobs.extend(t.logprob.map(f32::to_bits));
            a.logprobs
                .extend(t.top.iter().flat_map(|x| [x.token, x.logprob.to_bits()]));
        }
        done = ev.done.or(done);
    }
    let done = done.expect("the last event says how the answer ended");
    a.finish_reason = done.finish_reason;
    (a, done)
}

const TOKEN: &str = "speculative-test-token";

fn cluster(metrics: &str) -> Cluster {
    cluster_with(metrics, &[])
}

fn cluster_with(metrics: &str, more: &[&str]) -> Cluster {
    let mut spec = ClusterSpec::new(2, "shm");
    spec.coordinator_args = vec![
        "--deterministic".into(),
        "on".into(),
        // Every draft as long as its match: deterministic mode computes
        // each row alone, so the tuned length (by what rows cost) would
        // send few drafts, and these tests are about what drafts do.
        "--draft-length".into(),
        "agreement".into(),
        "--metrics-listen".into(),
        metrics.into(),
        "--admin-token".into(),
        TOKEN.into(),
    ];
    spec.coordinator_args
        .extend(more.iter().map(|s| s.to_string()));
    Cluster::start(&model(QWEN), &spec)
}

/// Runs `req` without drafts and with them; both answers must be the
/// same, bit for bit. Returns the answer and the drafted run's `Done`.
fn same_with_drafts(c: &Cluster, req: &GenerateRequest, what: &str) -> (Answer, Done) {
    let run = |r: GenerateRequest| {
        let events = c
            .generate(r)
            .unwrap_or_else(|e| panic!("{what}: {e}\n{}", c.logs()));
        answer(&events)
    };
    let (plain, plain_done) = run(drafting(req, 0));
    assert_eq!(plain_done.draft_n, 0, "{what}: n_max 0 drafts nothing");
    let (drafted, done) = run(drafting(req, 16));
    assert_eq!(
        drafted, plain,
        "{what}: the answer with drafts differs from the one without\nwith:    {:?}\nwithout: {:?}",
        drafted.text, plain.text
    );
    assert!(done.draft_n_accepted <= done.draft_n, "{what}: {done:?}");
    (drafted, done)
}

#[test]
fn drafts_give_the_same_answers_bit_for_bit_and_say_how_many_were_taken() {
    let metrics = format!("127.0.0.1:{}", omni_tests::free_port());
    let c = cluster(&metrics);

    // Greedy: the rewrite repeats the prompt's function, so most drafts
    // are taken.
    let greedy = chat(REWRITE, 120);
    let (a, done) = same_with_drafts(&c, &greedy, "greedy rewrite");
    assert!(
        a.text.contains("def total_price(items, tax_rate):"),
        "the answer repeats the function: {:?}",
        a.text
    );
    assert!(
        done.draft_n_accepted * 2 > done.completion_tokens,
        "most of the rewrite came from taken drafts: {done:?}"
    );
    eprintln!(
        "greedy rewrite: {} tokens, {} drafted, {} taken",
        done.completion_tokens, done.draft_n, done.draft_n_accepted
    );

    // Sampled with a seed: the same draws, so the same answer.
    let sampled = GenerateRequest {
        sampling: Some(Sampling {
            temperature: 0.8,
            top_p: 0.95,
            top_k: 40,
            seed: Some(7),
            ..Default::default()
        }),
        ..chat(REWRITE, 80)
    };
    same_with_drafts(&c, &sampled, "seeded sampling");

    // Penalties look at the history, which drafts enter only when taken.
    let penalised = GenerateRequest {
        sampling: Some(Sampling {
            temperature: 0.0,
            repeat_penalty: 1.3,
            repeat_last_n: 64,
            frequency_penalty: 0.5,
            ..Default::default()
        }),
        ..chat(REWRITE, 60)
    };
    same_with_drafts(&c, &penalised, "penalties");

    // A grammar: each drafted row is masked by the grammar's state after
    // the drafts before it.
    let schema = r#"{"type":"object","properties":{"name":{"type":"string"},"threshold":{"type":"integer"},"body":{"type":"string"}},"required":["name","threshold","body"]}"#;
    let constrained = GenerateRequest {
        sampling: Some(Sampling {
            grammar: Some(Grammar {
                kind: Some(Kind::JsonSchema(schema.into())),
            }),
            ..Default::default()
        }),
        ..chat(
            &format!("{REWRITE}\nAnswer as JSON with the function's name, the new threshold and its body."),
            160,
        )
    };
    let (a, _) = same_with_drafts(&c, &constrained, "json schema");
    let v: serde_json::Value = serde_json::from_str(a.text.trim())
        .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", a.text));
    assert!(v["threshold"].is_i64(), "{v}");

    // A stop string cuts the answer inside a run of taken drafts.
    let stopped = GenerateRequest {
        stop: vec!["tax =".into()],
        ..chat(REWRITE, 120)
    };
    let (a, _) = same_with_drafts(&c, &stopped, "stop string");
    assert!(
        a.text.contains("discount") && !a.text.contains("tax ="),
        "{:?}",
        a.text
    );

    // max_tokens ends it exactly, drafts or not.
    let (a, _) = same_with_drafts(&c, &chat(REWRITE, 37), "max_tokens 37");
    assert_eq!(a.ids.len(), 37);

    // Several streams at once (as `n` makes them), drafting or not,
    // each with its answer alone.
    let alone: Vec<Vec<u32>> = [16, 0, 8]
        .iter()
        .map(|&n| answer(&c.generate(drafting(&greedy, n)).unwrap()).0.ids)
        .collect();
    let together = start_streams(
        &c.addr,
        [16, 0, 8].iter().map(|&n| drafting(&greedy, n)).collect(),
    );
    let got = together.handle.join().unwrap();
    omni_tests::same_tokens(&got, &alone, "three streams, two drafting");

    // The coordinator counts drafts.
    let (status, body) = http(&metrics, "GET", "/metrics", &[], b"");
    assert_eq!(status, 200);
    let value = |name: &str| omni_tests::metric_value(&body, name);
    let drafted = value("omni_coordinator_draft_tokens_total");
    let taken = value("omni_coordinator_draft_accepted_tokens_total");
    assert!(
        taken > 0 && taken <= drafted,
        "{taken} of {drafted}\n{body}"
    );
    // And `omnictl top` shows the acceptance rate.
    let (ok, out, err) = omni_tests::omnictl_admin(
        &c.admin_addr,
        Some(TOKEN),
        &["top", "--once", "--interval", "0.2"],
    );
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("% accepted ({taken} of {drafted} since start)")),
        "{out}"
    );
}

/// Through the router, as an OpenAI or llama-server client asks:
/// `speculative.n_max` per request, llama-server's `timings` in the answer,
/// and a bad value refused by name.
#[test]
fn the_router_takes_llama_servers_speculative_fields_and_reports_timings() {
    let metrics = format!("127.0.0.1:{}", omni_tests::free_port());
    let c = cluster(&metrics);
    let dir = tempfile::tempdir().unwrap();
    let args = vec!["--model".to_string(), format!("qwen={}", c.addr)];
    let (_router, addr) = start_router(dir.path(), &args);
    let ask = |n_max: i64| {
        let body = serde_json::json!({
            "model": "qwen",
            "messages": [{"role": "user", "content": REWRITE}],
            "max_tokens": 60,
            "temperature": 0,
            "speculative.n_max": n_max,
        });
        http(
            &addr,
            "POST",
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            body.to_string().as_bytes(),
        )
    };
    let (status, body) = ask(16);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let t = &v["timings"];
    assert!(
        t["draft_n"].as_u64().unwrap_or(0) > 0 && t["draft_n_accepted"].as_u64().unwrap_or(0) > 0,
        "{v}"
    );
    assert_eq!(t["predicted_n"], v["usage"]["completion_tokens"], "{v}");
    let (status, body) = ask(0);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(v["timings"].get("draft_n").is_none(), "no drafts: {v}");
    let (status, body) = ask(100_000);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("speculative.n_max"), "{body}");
}

/// kill -9 of the last stage, which verifies the drafts, while a drafting
/// stream is mid-answer: `omnictl up` starts it again, the coordinator
/// replays the stream's steps (verifying its taken drafts again) and the
/// answer ends as the one without drafts and without the crash, every
/// token and log-probability the same and none sent twice.
#[test]
fn a_drafting_stream_survives_kill_9_of_the_verifying_stage_with_the_same_answer() {
    let c = Supervised::start(
        &model(QWEN),
        &[
            "--stages",
            "2",
            "--threads",
            "1",
            "--deterministic",
            "on",
            "--ctx",
            "1024",
            "--seqs",
            "2",
            "--transport",
            "shm",
        ],
        // Drafts from the prompt only (not from the answer without drafts
        // just given), so that the crash lands mid-answer.
        &[
            ("OMNI_COORDINATOR_HEALTH_INTERVAL", "0.5"),
            ("OMNI_COORDINATOR_SPEC_RECENT_TOKENS", "0"),
            ("OMNI_COORDINATOR_DRAFT_LENGTH", "agreement"),
        ],
    );
    let req = chat(REWRITE, 90);
    let run = |r: GenerateRequest, hurt: bool| {
        let s = start_streams(&c.addr, vec![r]);
        if hurt {
            s.wait_for(30);
            c.signal("w1", "-9");
            let at = s.progress.load(std::sync::atomic::Ordering::Relaxed);
            assert!(
                at < 90,
                "the kill came after the answer ended ({at} tokens)"
            );
        }
        let ids = s.handle.join().unwrap().remove(0);
        let ids = ids.unwrap_or_else(|e| panic!("{e}\n{}", c.proc.log_text()));
        let bits = s.logprobs.lock().unwrap()[0].clone();
        (ids, bits)
    };
    let (want, want_bits) = run(drafting(&req, 0), false);
    let (got, got_bits) = run(drafting(&req, 16), true);
    assert_eq!(got, want, "the answer after the crash differs");
    assert!(got_bits == want_bits, "the log-probabilities differ");
    let log = c.proc.log_text();
    assert!(
        log.contains("starting it again") && log.contains("recovered; replaying"),
        "w1 was restarted and the stream replayed\n{log}"
    );
    assert!(
        !log.contains("the replay sampled token"),
        "a replay diverged\n{log}"
    );
}

/// A request that repeats an earlier answer (an agent rewriting the same
/// function again) drafts it from the recent sequences: the same tokens,
/// and nearly every token of the second answer comes from a taken draft,
/// where the first had to find its own way through the edited line.
#[test]
fn an_answer_given_before_is_drafted_from_the_recent_sequences() {
    let metrics = format!("127.0.0.1:{}", omni_tests::free_port());
    let c = cluster(&metrics);
    let req = drafting(&chat(REWRITE, 100), 16);
    let (first, first_done) = answer(&c.generate(req.clone()).unwrap());
    let (again, again_done) = answer(&c.generate(req).unwrap());
    assert_eq!(again, first, "the same request, the same answer");
    eprintln!("first: {first_done:?}\nagain: {again_done:?}");
    assert!(
        again_done.draft_n_accepted > first_done.draft_n_accepted
            && again_done.draft_n_accepted + 10 >= again_done.completion_tokens,
        "the second answer is drafted from the first: {first_done:?} then {again_done:?}"
    );
}

/// With the default draft length (`tuned`), the coordinator replays each
/// ended answer under its candidate rules and may change how long drafts
/// are between requests: whatever it picks, the answers are the ones
/// without drafts, and a rewrite still drafts (on every machine measured,
/// drafting a rewrite pays; docs/benchmarks.md).
#[test]
fn tuned_draft_lengths_keep_the_tokens_and_keep_drafting_rewrites() {
    let mut spec = ClusterSpec::new(2, "shm");
    spec.coordinator_args = ["--deterministic", "on", "--spec-recent-tokens", "0"]
        .map(String::from)
        .to_vec();
    let c = Cluster::start(&model(QWEN), &spec);
    let asks = [
        "Raise the discount threshold from 100 to 250 and change nothing else.",
        "Rename the parameter items to cart and change nothing else.",
        "Round to 3 decimal places instead of 2 and change nothing else.",
    ];
    for ask in asks {
        let text = REWRITE.replace(
            "Raise the discount threshold from 100 to 250 and change nothing else.",
            ask,
        );
        let (_, done) = same_with_drafts(&c, &chat(&text, 100), ask);
        eprintln!("{ask}: {done:?}");
        assert!(
            done.draft_n_accepted * 3 > done.completion_tokens,
            "{ask}: a third of the rewrite or more came from taken drafts: {done:?}\n{}",
            c.logs()
        );
    }
}

/// Speculation with a draft model (`--model-draft`, llama-server's -md):
/// the worker with the last stage loads it whole, guesses after every
/// sample, and the target verifies: the same answers bit for bit (greedy,
/// seeded sampling, a grammar), drafts taken even where the answer repeats
/// nothing of its prompt (where prompt lookup has nothing to offer), and
/// `p_min` per request. The draft model here is the target itself (the
/// only model with Qwen's vocabulary in reach): it shows the mechanics,
/// not the speed.
#[test]
fn a_draft_model_drafts_where_lookup_cannot_and_changes_no_token() {
    let metrics = format!("127.0.0.1:{}", omni_tests::free_port());
    let qwen = model(QWEN);
    let c = cluster_with(
        &metrics,
        &[
            "--model-draft",
            qwen.to_str().unwrap(),
            "--spec-recent-tokens",
            "0",
        ],
    );
    let (_, done) = same_with_drafts(&c, &chat(REWRITE, 80), "draft model, rewrite");
    assert!(done.draft_n_accepted > 0, "{done:?}");
    // A poem repeats nothing of its prompt: prompt lookup drafts little,
    // the draft model (which is the target) most of it.
    let poem = chat("Write a short poem about a lighthouse keeper.", 60);
    let (_, done) = same_with_drafts(&c, &poem, "draft model, poem");
    eprintln!("poem: {done:?}");
    assert!(
        done.draft_n_accepted * 2 > done.completion_tokens,
        "a draft model that is the target guesses most of it: {done:?}"
    );
    let seeded = GenerateRequest {
        sampling: Some(Sampling {
            temperature: 0.9,
            seed: Some(11),
            ..Default::default()
        }),
        ..poem.clone()
    };
    same_with_drafts(&c, &seeded, "draft model, seeded sampling");
    // p_min 1.0: no guess is that sure, so nothing is drafted.
    let sure = GenerateRequest {
        speculative: Some(Speculative {
            n_max: Some(16),
            p_min: Some(1.0),
            ..Default::default()
        }),
        ..poem
    };
    let (_, done) = answer(&c.generate(sure).unwrap());
    assert_eq!(done.draft_n, 0, "{done:?}");
}

/// A draft model whose token ids mean other things (Gemma's vocabulary
/// beside Qwen's) is refused when the coordinator starts, naming both
/// files and the difference, before any worker loads anything.
#[test]
fn a_draft_model_with_another_vocabulary_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(omni_tests::target_bin("omni-coordinator"));
    cmd.arg("--model")
        .arg(model(QWEN))
        .arg("--model-draft")
        .arg(model(GEMMA))
        .args([
            "--listen",
            &format!("127.0.0.1:{}", omni_tests::free_port()),
        ]);
    let mut p = omni_tests::Proc::spawn("coordinator", cmd, dir.path());
    let ok = p.wait_exit(std::time::Duration::from_secs(60));
    let log = p.log_text();
    assert_eq!(ok, Some(false), "the coordinator refuses to start\n{log}");
    assert!(
        log.contains("cannot draft for") && log.contains(GEMMA) && log.contains(QWEN),
        "{log}"
    );
}

/// The draft model goes where the last stage goes: draining the worker
/// that runs the head (w2) hands the head to another worker, which loads
/// the draft model beside its new stage, and undraining brings both back.
/// A poem (little for prompt lookup) keeps being drafted, with the same
/// answer, before, between and after the moves.
#[test]
fn the_draft_model_follows_the_last_stage_through_a_drain_and_back() {
    let qwen = model(QWEN);
    let mut spec = ClusterSpec::new(3, "shm");
    spec.coordinator_args = [
        "--deterministic",
        "on",
        "--draft-length",
        "agreement",
        "--spec-recent-tokens",
        "0",
        "--admin-token",
        TOKEN,
        "--model-draft",
        qwen.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec();
    let c = Cluster::start(&qwen, &spec);
    let poem = drafting(
        &chat("Write a short poem about a lighthouse keeper.", 40),
        16,
    );
    let run = |what: &str| {
        let (a, done) = answer(&c.generate(poem.clone()).unwrap());
        assert!(
            done.draft_n_accepted > 0,
            "{what}: the last stage's worker drafts with the draft model: {done:?}\n{}",
            c.logs()
        );
        a
    };
    let before = run("before the moves");
    for verb in ["drain", "undrain"] {
        let (ok, out, err) = omni_tests::omnictl_admin(&c.admin_addr, Some(TOKEN), &[verb, "w2"]);
        assert!(ok, "omnictl {verb} w2: {out}{err}\n{}", c.logs());
        assert_eq!(run(&format!("after {verb} w2")), before, "after {verb} w2");
    }
    assert!(
        c.logs().matches("loaded draft model").count() >= 3,
        "w2, then the worker that took the head, then w2 again loaded it\n{}",
        c.logs()
    );
}
