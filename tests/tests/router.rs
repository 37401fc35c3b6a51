//! End-to-end: the OpenAI router in front of a real cluster serving Gemma 3,
//! driven over real HTTP the way an OpenAI client does.

use omni_engine::{Engine, GenerateOptions, StageConfig};
use omni_tests::fixtures::{model, GEMMA};
use omni_tests::{http, start_router, Cluster, ClusterSpec, Proc};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

fn post(addr: &str, path: &str, body: &Value) -> (u16, String) {
    http(
        addr,
        "POST",
        path,
        &[
            ("Content-Type", "application/json"),
            ("Authorization", "Bearer sk-test"),
        ],
        body.to_string().as_bytes(),
    )
}

struct Served {
    router: Proc,
    _cluster: Cluster,
    _dir: tempfile::TempDir,
    addr: String,
}

/// One cluster at a time: the machine has two cores.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serve(extra: &[&str]) -> Served {
    let cluster = Cluster::start(&model(GEMMA), &ClusterSpec::new(2, "shm"));
    let dir = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = vec![
        "--model".into(),
        format!("gemma3-270m={},gemma", cluster.addr),
        "--api-key".into(),
        "sk-test".into(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let (router, addr) = start_router(dir.path(), &args);
    Served {
        router,
        _cluster: cluster,
        _dir: dir,
        addr,
    }
}

/// The single-process engine's greedy text for a raw prompt.
fn engine_text(prompt: &str, n: usize) -> String {
    let cfg = StageConfig {
        kv: omni_engine::KvConfig {
            n_ctx: 512,
            n_seq: 1,
        },
        n_threads: 2,
        ..StageConfig::default()
    };
    let mut e = Engine::load(model(GEMMA), None, cfg).unwrap();
    let ids = e.tokenize_prompt(prompt, false).unwrap();
    let opts = GenerateOptions {
        max_tokens: n,
        ..GenerateOptions::default()
    };
    e.generate(&ids, &opts, &mut |_| {}).unwrap().text
}

#[test]
fn openai_api_end_to_end() {
    let prompt = "The capital of France is";
    let want = engine_text(prompt, 12);
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = serve(&[]);
    let a = &s.addr;

    // Models, with aliases.
    let (st, body) = http(
        a,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer sk-test")],
        b"",
    );
    assert_eq!(st, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["gemma3-270m", "gemma", "auto"]);

    // Completions, greedy: the engine's text.
    let req = json!({"model": "gemma", "prompt": prompt, "max_tokens": 12, "temperature": 0});
    let (st, body) = post(a, "/v1/completions", &req);
    assert_eq!(st, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], want.as_str());
    assert_eq!(v["usage"]["completion_tokens"], 12);
    // `auto` (what the seeds' clients send) without rules: the served model.
    let req = json!({"model": "auto", "prompt": prompt, "max_tokens": 12, "temperature": 0});
    let (st, body) = post(a, "/v1/completions", &req);
    assert_eq!(st, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["text"], want.as_str());
    assert_eq!(v["model"], "gemma3-270m", "the model that answered");

    // The same, streamed with usage: the deltas add up to the same text,
    // every chunk has one id, usage comes last, then [DONE].
    let req = json!({"model": "gemma", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                     "stream": true, "stream_options": {"include_usage": true}});
    let (st, body) = post(a, "/v1/completions", &req);
    assert_eq!(st, 200, "{body}");
    let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    let id = chunks[0]["id"].clone();
    assert!(chunks.iter().all(|c| c["id"] == id));
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0).and_then(|x| x["text"].as_str()))
        .collect();
    assert_eq!(text, want);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"].as_array().unwrap().len(), 0);
    assert_eq!(last["usage"]["completion_tokens"], 12);
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c["usage"].is_null()));

    // Chat, with a stop string that must not leak, and n = 2 seeded choices.
    let req = json!({"model": "gemma3-270m", "messages": [{"role": "user", "content": "Count: 1, 2, 3,"}],
                     "max_tokens": 16, "temperature": 0, "stop": [","], "n": 2});
    let (st, body) = post(a, "/v1/chat/completions", &req);
    assert_eq!(st, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    for c in v["choices"].as_array().unwrap() {
        assert!(
            !c["message"]["content"].as_str().unwrap().contains(','),
            "{c}"
        );
        assert_eq!(c["message"]["role"], "assistant");
    }

    // Logprobs in chat.
    let req = json!({"model": "gemma", "messages": [{"role": "user", "content": "Hi"}],
                     "max_tokens": 3, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let (st, body) = post(a, "/v1/chat/completions", &req);
    assert_eq!(st, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);

    // Client mistakes are 4xx in the OpenAI error shape.
    let err = |st: u16, body: &str, want_status: u16, needle: &str| {
        assert_eq!(st, want_status, "{body}");
        let v: Value = serde_json::from_str(body).unwrap();
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{msg}");
    };
    let (st, body) = http(a, "GET", "/v1/models", &[], b"");
    err(st, &body, 401, "API key");
    let (st, body) = post(
        a,
        "/v1/chat/completions",
        &json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    );
    err(st, &body, 404, "nope");
    let (st, body) = post(
        a,
        "/v1/chat/completions",
        &json!({"model": "gemma", "messages": [{"role": "user", "content": "x"}], "temperature": 3.5}),
    );
    err(st, &body, 400, "temperature");
    let (st, body) = http(
        a,
        "POST",
        "/v1/chat/completions",
        &[
            ("Content-Type", "application/json"),
            ("Authorization", "Bearer sk-test"),
        ],
        b"{not json",
    );
    assert_eq!(st, 400, "{body}");
    let (st, body) = http(
        a,
        "POST",
        "/v1/chat/completions",
        &[
            ("Content-Type", "text/plain"),
            ("Authorization", "Bearer sk-test"),
        ],
        b"{}",
    );
    assert_eq!(st, 415, "{body}");
    let long = "word ".repeat(3000);
    let (st, body) = post(
        a,
        "/v1/completions",
        &json!({"model": "gemma", "prompt": long, "max_tokens": 4}),
    );
    err(st, &body, 400, "context");
    // Errors the coordinator finds reach the client with OpenAI's `param` and
    // `code`, read from the status's details (not from its wording).
    let error_of =
        |body: &str| -> Value { serde_json::from_str::<Value>(body).unwrap()["error"].clone() };
    let e = error_of(&body);
    assert_eq!(
        (&e["param"], &e["code"]),
        (&json!("prompt"), &json!("context_length_exceeded")),
        "{body}"
    );
    let chat = |extra: Value| {
        let mut req = json!({"model": "gemma", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        req.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        post(a, "/v1/chat/completions", &req)
    };
    for (extra, param) in [
        (
            json!({"messages": [{"role": "user", "content": long}]}),
            "messages",
        ),
        // The router cannot know the vocabulary: the coordinator checks ids.
        (json!({"logit_bias": {"999999": 5}}), "logit_bias"),
        // Well-formed for the router, refused when the coordinator compiles it.
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}),
            "response_format",
        ),
    ] {
        let (st, body) = chat(extra.clone());
        assert_eq!(st, 400, "{extra}: {body}");
        assert_eq!(error_of(&body)["param"], param, "{extra}: {body}");
    }

    // Health, readiness, metrics.
    assert_eq!(http(a, "GET", "/health", &[], b"").0, 200);
    assert_eq!(http(a, "GET", "/ready", &[], b"").0, 200);
    let (_, m) = http(a, "GET", "/metrics", &[], b"");
    assert!(m.contains("omni_router_requests_total"), "{m}");
    assert!(m.contains("omni_router_tokens_out_total"), "{m}");
    drop(s.router);
}

/// Past the in-flight bound the router answers 429 with Retry-After, while
/// the accepted request finishes.
#[test]
fn flooding_past_the_limit_gets_429_and_accepted_requests_finish() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = serve(&["--max-in-flight", "1"]);
    let a = s.addr.clone();
    let long = std::thread::spawn(move || {
        post(
            &a,
            "/v1/completions",
            &json!({"model": "gemma", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": true}),
        )
    });
    std::thread::sleep(Duration::from_millis(300));
    let mut rejected = 0;
    for _ in 0..5 {
        let (st, body) = http(
            &s.addr,
            "POST",
            "/v1/completions",
            &[
                ("Content-Type", "application/json"),
                ("Authorization", "Bearer sk-test"),
            ],
            json!({"model": "gemma", "prompt": "x", "max_tokens": 2})
                .to_string()
                .as_bytes(),
        );
        if st == 429 {
            rejected += 1;
            assert!(body.contains("rate_limit_exceeded"), "{body}");
        }
    }
    assert!(
        rejected >= 4,
        "expected 429s while the first request runs, got {rejected}"
    );
    let (st, body) = long.join().unwrap();
    assert_eq!(st, 200, "{body}");
}

/// A 10-turn chat through the router gives the same greedy answers with
/// the prefix cache and without it (`cache_prompt: false`), near ties
/// excepted, and `usage.prompt_tokens_details.cached_tokens` says what was
/// reused: nothing on the first turn or without the cache; from turn 2 on,
/// at least the whole blocks of the previous turn's prompt (the template
/// renders the history as a prefix), never the last prompt token, always
/// whole blocks of 16.
#[test]
fn a_ten_turn_chat_gives_the_same_tokens_with_and_without_the_prefix_cache() {
    const NEAR_TIE: f64 = 1.0;
    let questions = [
        "Name a colour.",
        "Why is the sky blue? One sentence.",
        "Count from one to five.",
        "What is the capital of Italy?",
        "Say something about cats.",
        "Which is larger, 7 or 12?",
        "Give me a word that rhymes with tree.",
        "What do bees make?",
        "Name a planet.",
        "Summarise our chat in one line.",
    ];
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = serve(&[]);
    let mut messages: Vec<Value> =
        vec![json!({"role": "system", "content": "You are a terse assistant. ".repeat(6)})];
    let mut prev_prompt = 0u64;
    for (turn, q) in questions.iter().enumerate() {
        messages.push(json!({"role": "user", "content": q}));
        let ask = |cache: Option<bool>| {
            let mut body = json!({"model": "gemma", "messages": messages, "max_tokens": 24,
                                  "temperature": 0, "logprobs": true, "top_logprobs": 2});
            if let Some(c) = cache {
                body["cache_prompt"] = json!(c);
            }
            let (st, text) = post(&s.addr, "/v1/chat/completions", &body);
            assert_eq!(st, 200, "turn {turn}: {text}");
            serde_json::from_str::<Value>(&text).unwrap()
        };
        let off = ask(Some(false));
        let on = ask(None);
        let cached = |v: &Value| {
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        };
        let prompt = on["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(cached(&off), 0, "turn {turn}: cache_prompt false");
        let c = cached(&on);
        assert!(
            c < prompt,
            "turn {turn}: {c} of {prompt} prompt tokens cached"
        );
        if turn == 0 {
            assert_eq!(c, 0, "nothing is cached before the first turn");
        } else {
            // The previous prompt is this one's beginning, all of it
            // computed (its answer too, unless the answers differ), but
            // for its last token ("\n" after "model"), which may merge
            // with what follows it now.
            assert!(
                c + 1 >= prev_prompt,
                "turn {turn}: {c} cached, the previous prompt had {prev_prompt}"
            );
        }
        eprintln!("turn {turn}: {prompt} prompt tokens, {c} cached");
        prev_prompt = prompt;
        let content = |v: &Value| {
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        };
        if content(&off) != content(&on) {
            let toks = |v: &Value| {
                v["choices"][0]["logprobs"]["content"]
                    .as_array()
                    .unwrap()
                    .clone()
            };
            let (a, b) = (toks(&off), toks(&on));
            let k = a
                .iter()
                .zip(&b)
                .position(|(x, y)| x["token"] != y["token"])
                .expect("different texts differ in a token");
            let top = a[k]["top_logprobs"].as_array().unwrap();
            let gap = top[0]["logprob"].as_f64().unwrap() - top[1]["logprob"].as_f64().unwrap();
            eprintln!("turn {turn}: differs at token {k}, top-2 gap {gap:.4}");
            assert!(
                gap < NEAR_TIE,
                "turn {turn}: differs at token {k}, not a near tie (gap {gap})"
            );
        }
        messages.push(json!({"role": "assistant", "content": content(&off)}));
    }
}

/// Streaming clients that disconnect mid-generation free their sequences:
/// soon after, every worker uses only the cells the prefix cache keeps.
#[test]
fn disconnecting_streaming_clients_frees_their_sequences() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = serve(&[]);
    let used = || s._cluster.kv_cells_used();
    // Three streaming clients read a little, then hang up.
    let mut clients = Vec::new();
    for _ in 0..3 {
        let body = json!({"model": "gemma", "prompt": "Once upon a time", "max_tokens": 500,
                          "temperature": 0, "ignore_eos": true, "stream": true})
        .to_string();
        let mut c = std::net::TcpStream::connect(&s.addr).unwrap();
        write!(
            c,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer sk-test\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut buf = [0u8; 4096];
        let mut seen = 0;
        while seen < 3 {
            let n = c.read(&mut buf).unwrap();
            assert!(n > 0, "the stream closed early");
            seen += String::from_utf8_lossy(&buf[..n]).matches("data: ").count();
        }
        clients.push(c);
    }
    let during = used();
    eprintln!("KV cells in use while the clients are connected: {during:?}");
    assert!(during.iter().all(|&u| u > 0), "{during:?}");
    drop(clients);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let st = s._cluster.statuses();
        let now: Vec<u64> = st.iter().map(|s| s.kv_cells_used).collect();
        if st.iter().all(|s| s.kv_cells_used == s.kv_cells_cached) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "KV cells still in use 15 s after the clients left: {now:?}\n{}",
            s.router.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn completions_count(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("omni_router_requests_total") && l.contains("/v1/completions"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// A model served by an upstream OpenAI-compatible server (here another
/// omni router) is passed through, streamed or not; `auto` picks a model by
/// its rules; an unreachable upstream is a 503 that names it.
#[test]
fn upstream_backends_and_auto_rules_from_a_config_file() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let upstream = serve(&[]);
    // The backends and rules come from a config file; the upstream's key
    // and the API key from flags, which merge with the file.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("omni.toml");
    std::fs::write(
        &config,
        format!(
            r#"[router]
auto = ["keyword:far away=remote", "default=local"]

[[router.models]]
name = "local"
coordinator = "{}"

[[router.models]]
name = "remote"
upstream = "http://{}/v1"
upstream_model = "gemma"

[[router.models]]
name = "dead"
upstream = "http://127.0.0.1:1/v1"

[[router.models]]
name = "gone"
coordinator = "127.0.0.1:1"
"#,
            upstream._cluster.addr, upstream.addr
        ),
    )
    .unwrap();
    let args: Vec<String> = [
        "--config".to_string(),
        config.display().to_string(),
        "--upstream-key".into(),
        "remote=sk-test".into(),
        "--api-key".into(),
        "sk-test".into(),
    ]
    .into();
    let (front, addr) = start_router(dir.path(), &args);
    let count = || completions_count(&http(&upstream.addr, "GET", "/metrics", &[], b"").1);

    let req = |model: &str, prompt: &str, stream: bool| json!({"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": stream});
    let (st, direct) = post(
        &upstream.addr,
        "/v1/completions",
        &req("gemma", "Hello there", false),
    );
    assert_eq!(st, 200, "{direct}");
    let before = count();
    let (st, via) = post(
        &addr,
        "/v1/completions",
        &req("remote", "Hello there", false),
    );
    assert_eq!(st, 200, "{via}\n{}", front.log_text());
    let text = |b: &str| serde_json::from_str::<Value>(b).unwrap()["choices"][0]["text"].clone();
    assert_eq!(text(&via), text(&direct));
    assert_eq!(count(), before + 1, "the upstream served it");

    let (st, streamed) = post(
        &addr,
        "/v1/completions",
        &req("remote", "Hello there", true),
    );
    assert_eq!(st, 200);
    assert!(streamed.trim_end().ends_with("data: [DONE]"), "{streamed}");

    // auto: the keyword sends it upstream, anything else stays local.
    let before = count();
    assert_eq!(
        post(
            &addr,
            "/v1/completions",
            &req("auto", "a land far away", false)
        )
        .0,
        200
    );
    assert_eq!(count(), before + 1);
    assert_eq!(
        post(&addr, "/v1/completions", &req("auto", "nearby", false)).0,
        200
    );
    assert_eq!(count(), before + 1);

    // Whatever is down is named: an upstream, or a coordinator.
    for model in ["dead", "gone"] {
        let (st, body) = post(&addr, "/v1/completions", &req(model, "x", false));
        assert_eq!(st, 503, "{body}");
        assert!(body.contains("127.0.0.1:1"), "{body}");
    }
}

/// The README's first example, as a user pastes it: the body of its first
/// curl, sent to the path it names on a cluster of the model it names,
/// answers with sense (greedy, so the same answer every time).
#[test]
fn the_readme_first_example_answers_with_sense() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("README.md");
    let curl = "curl -s http://127.0.0.1:8080";
    let at = readme.find(curl).expect("the README has a curl example");
    let cmd = &readme[at + curl.len()..];
    let path = cmd.split_whitespace().next().unwrap().to_string();
    let body = cmd
        .split_once("-d '")
        .and_then(|(_, b)| b.split_once('\''))
        .map(|(b, _)| b)
        .expect("a -d '...' body");
    let req: Value = serde_json::from_str(body).expect("the README's body is JSON");
    assert_eq!(req["temperature"], 0, "the first example is greedy: {req}");
    assert_eq!(
        req["model"], "gemma3-270m",
        "the model `up` serves in the README"
    );

    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = serve(&[]);
    let (st, out) = post(&s.addr, &path, &req);
    assert_eq!(st, 200, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let text = v["choices"][0]["text"]
        .as_str()
        .or_else(|| v["choices"][0]["message"]["content"].as_str())
        .unwrap_or_default()
        .to_string();
    eprintln!("README example {path}: {text:?}");
    // Sense: words, mostly different ones, about what was asked.
    let words: Vec<&str> = text.split_whitespace().collect();
    let distinct: std::collections::HashSet<&str> = words.iter().copied().collect();
    assert!(
        words.len() >= 5 && distinct.len() * 2 >= words.len(),
        "{text:?}"
    );
    assert!(
        text.contains("France") || text.contains("Paris"),
        "{text:?}"
    );

    // The router's port given where the coordinator's is meant is named.
    let out = std::process::Command::new(omni_tests::target_bin("omnictl"))
        .args(["generate", "--coordinator", &s.addr, "-p", "Hi", "-n", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("router"), "{err}");
}
