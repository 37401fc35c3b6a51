//! End-to-end: the router in front of a real cluster (Gemma 3) gets 20
//! kinds of bad requests, 200 in all. Every answer is a 4xx in OpenAI's
//! error shape (`{"error": {"message", "type", ...}}`) with a message, and
//! the cluster serves a normal request normally afterwards.

use omni_tests::fixtures::{model, GEMMA};
use omni_tests::{http, start_router, Cluster, ClusterSpec};
use serde_json::{json, Value};

const KEY: &str = "sk-bad";

/// (what, path, content type, body).
fn bad_requests() -> Vec<(&'static str, &'static str, &'static str, Vec<u8>)> {
    let chat = |v: Value| v.to_string().into_bytes();
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let long = "word ".repeat(3000);
    let j = "application/json";
    vec![
        ("broken JSON", "/v1/chat/completions", j, b"{\"model\": \"gemma3-270m\", \"messages\": [".to_vec()),
        ("not JSON", "/v1/chat/completions", j, b"hello there".to_vec()),
        ("an array, not an object", "/v1/chat/completions", j, b"[1, 2, 3]".to_vec()),
        ("no messages", "/v1/chat/completions", j, chat(json!({"model": "gemma3-270m"}))),
        ("messages as a string", "/v1/chat/completions", j, chat(json!({"model": "gemma3-270m", "messages": "hi"}))),
        ("an unknown role", "/v1/chat/completions", j, chat(json!({"model": "gemma3-270m", "messages": [{"role": "wizard", "content": "hi"}]}))),
        ("content as a number", "/v1/chat/completions", j, chat(json!({"model": "gemma3-270m", "messages": [{"role": "user", "content": 42}]}))),
        ("temperature out of range", "/v1/chat/completions", j, chat(json!({"model": "gemma3-270m", "messages": msgs, "temperature": 7.5}))),
        ("temperature as a string", "/v1/chat/completions", j, chat(json!({"model": "gemma3-270m", "messages": msgs, "temperature": "hot"}))),
        ("negative max_tokens", "/v1/chat/completions", j, chat(json!({"model": "gemma3-270m", "messages": msgs, "max_tokens": -5}))),
        ("top_p above 1", "/v1/chat/completions", j, chat(json!({"model": "gemma3-270m", "messages": msgs, "top_p": 1.5}))),
        ("n = 0", "/v1/chat/completions", j, chat(json!({"model": "gemma3-270m", "messages": msgs, "n": 0}))),
        ("an unknown model", "/v1/chat/completions", j, chat(json!({"model": "no-such-model", "messages": msgs}))),
        ("invalid UTF-8", "/v1/chat/completions", j, b"{\"model\": \"gemma3-270m\", \"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\xc3\x28\"}]}".to_vec()),
        ("a body over the router's 4 MiB limit", "/v1/chat/completions", j, {
            let mut b = b"{\"model\": \"gemma3-270m\", \"messages\": [{\"role\": \"user\", \"content\": \"".to_vec();
            b.extend(std::iter::repeat_n(b'a', 5 << 20));
            b.extend(b"\"}]}");
            b
        }),
        ("a prompt over the context", "/v1/completions", j, chat(json!({"model": "gemma3-270m", "prompt": long, "max_tokens": 4}))),
        ("top_logprobs above 20", "/v1/chat/completions", j, chat(json!({"model": "gemma3-270m", "messages": msgs, "logprobs": true, "top_logprobs": 50}))),
        ("stop as a number", "/v1/chat/completions", j, chat(json!({"model": "gemma3-270m", "messages": msgs, "stop": 7}))),
        ("frequency_penalty out of range", "/v1/chat/completions", j, chat(json!({"model": "gemma3-270m", "messages": msgs, "frequency_penalty": 9}))),
        ("a prompt as an object", "/v1/completions", j, chat(json!({"model": "gemma3-270m", "prompt": {"text": "hi"}}))),
        ("logit_bias with a word for a key", "/v1/chat/completions", j, chat(json!({"model": "gemma3-270m", "messages": msgs, "logit_bias": {"hello": 5}}))),
        ("a text/plain body", "/v1/chat/completions", "text/plain", chat(json!({"model": "gemma3-270m", "messages": msgs}))),
        ("deterministic on a cluster without it", "/v1/chat/completions", j, chat(json!({"model": "gemma3-270m", "messages": msgs, "deterministic": true}))),
    ]
}

#[test]
fn two_hundred_bad_requests_get_openai_errors_and_the_cluster_serves_on() {
    let cluster = Cluster::start(&model(GEMMA), &ClusterSpec::new(2, "shm"));
    let dir = tempfile::tempdir().unwrap();
    let args: Vec<String> = vec![
        "--model".into(),
        format!("gemma3-270m={},gemma", cluster.addr),
        "--api-key".into(),
        KEY.into(),
    ];
    let (_router, addr) = start_router(dir.path(), &args);
    let kinds = bad_requests();
    assert!(kinds.len() >= 20, "{} kinds", kinds.len());
    let auth = format!("Bearer {KEY}");
    let mut sent = 0;
    while sent < 200 {
        for (what, path, ctype, body) in &kinds {
            if sent == 200 {
                break;
            }
            // Every tenth: without the API key as well.
            let headers: Vec<(&str, &str)> = if sent % 10 == 9 {
                vec![("Content-Type", ctype)]
            } else {
                vec![("Content-Type", ctype), ("Authorization", &auth)]
            };
            let (status, text) = http(&addr, "POST", path, &headers, body);
            sent += 1;
            assert!(
                (400..500).contains(&status),
                "{what}: status {status}, expected a 4xx: {text}"
            );
            let v: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{what}: the error is not JSON ({e}): {text}"));
            let err = &v["error"];
            assert!(
                err["message"].as_str().is_some_and(|m| !m.is_empty())
                    && err["type"].as_str().is_some(),
                "{what}: not OpenAI's error shape: {text}"
            );
        }
    }
    // Deterministic decoding on a cluster started without it: the field
    // and the flag that allows it are named.
    let (status, text) = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json"), ("Authorization", &auth)],
        json!({"model": "gemma3-270m", "messages": [{"role": "user", "content": "Hi"}], "deterministic": true})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(status, 400, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["param"], "deterministic", "{text}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--deterministic on"),
        "{text}"
    );
    // The cluster serves normally afterwards.
    let (status, text) = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        &[("Content-Type", "application/json"), ("Authorization", &auth)],
        json!({"model": "gemma3-270m", "messages": [{"role": "user", "content": "Name a river."}], "max_tokens": 8})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 8, "{text}");
}
