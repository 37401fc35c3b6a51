//! End-to-end (issue 42): no single crash loses a request, the
//! coordinator's included. `omnictl up` with its router, 2 stages on Gemma
//! 3 270M, batch-invariant decoding; 8 streamed and 4 non-streamed
//! completions (greedy and seeded sampling) run once undisturbed, then
//! again with the coordinator killed (-9) mid-answer: `up` starts it again,
//! the workers register with it keeping their layers (no worker loads
//! again), the router resumes every request on it, and each answer is the
//! undisturbed one, bit for bit. The longest pause a stream saw is printed.

use omni_tests::fixtures::{model, GEMMA};
use omni_tests::{http, short_prompts, Supervised};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const N_STREAMED: usize = 8;
const N_WHOLE: usize = 4;
const MAX_TOKENS: usize = 40;

/// Request `i`'s body: a fixture prompt (as token ids), every third one
/// sampled with a seed, the rest greedy.
fn body(prompts: &[Vec<u32>], i: usize, stream: bool) -> String {
    let p = &prompts[i % prompts.len()];
    let sampling = if i.is_multiple_of(3) {
        format!(r#""temperature": 0.8, "seed": {}"#, 40 + i)
    } else {
        r#""temperature": 0"#.to_string()
    };
    let usage = if stream {
        r#", "stream_options": {"include_usage": true}"#
    } else {
        ""
    };
    format!(
        r#"{{"model": "default", "prompt": {p:?}, "max_tokens": {MAX_TOKENS}, "ignore_eos": true, {sampling}, "stream": {stream}{usage}}}"#
    )
}

/// What a client got: the text, the completion tokens, and (streamed) the
/// longest wait between two chunks.
#[derive(Debug)]
struct Answer {
    text: String,
    tokens: u64,
    max_gap: Duration,
}

/// A streamed completion; `chunks` counts the chunks as they arrive.
fn streamed(addr: &str, body: &str, chunks: &AtomicUsize) -> Result<Answer, String> {
    let s = omni_tests::sse_completion_with(addr, body, || {
        chunks.fetch_add(1, Ordering::Relaxed);
    })?;
    Ok(Answer {
        max_gap: s.max_gap(),
        text: s.text,
        tokens: s.tokens,
    })
}

/// A whole (non-streamed) completion.
fn whole(addr: &str, body: &str) -> Result<Answer, String> {
    let (status, resp) = http(
        addr,
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        body.as_bytes(),
    );
    if status != 200 {
        return Err(format!("HTTP {status}: {resp}"));
    }
    let v: serde_json::Value = serde_json::from_str(&resp).map_err(|e| format!("{e}: {resp}"))?;
    Ok(Answer {
        text: v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        tokens: v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
        max_gap: Duration::ZERO,
    })
}

/// Runs every request at once; `during` runs while they are under way, given
/// the count of chunks the streamed ones have received so far.
fn run_all(
    addr: &str,
    prompts: &[Vec<u32>],
    during: impl FnOnce(&AtomicUsize),
) -> Vec<Result<Answer, String>> {
    let chunks = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..N_STREAMED + N_WHOLE)
        .map(|i| {
            let addr = addr.to_string();
            let streamed_one = i < N_STREAMED;
            let b = body(prompts, i, streamed_one);
            let chunks = chunks.clone();
            std::thread::spawn(move || {
                if streamed_one {
                    streamed(&addr, &b, &chunks)
                } else {
                    whole(&addr, &b)
                }
            })
        })
        .collect();
    during(&chunks);
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn every_request_outlives_a_killed_coordinator_and_no_worker_loads_again() {
    let gemma = model(GEMMA);
    let up = Supervised::serving(
        &gemma,
        &[
            "--stages",
            "2",
            "--transport",
            "shm",
            "--seqs",
            "12",
            "--ctx",
            "512",
            "--threads",
            "1",
            "--deterministic",
            "on",
        ],
        &[],
    );
    let router = up.router.clone().unwrap();
    let prompts = short_prompts("real_gemma3_270m.json", 12);
    let loads = |up: &Supervised| -> Vec<u64> { up.statuses().iter().map(|s| s.loads).collect() };
    assert_eq!(loads(&up), vec![1, 1], "each worker loaded its stage once");

    let undisturbed = run_all(&router, &prompts, |_| {});
    let undisturbed: Vec<Answer> = undisturbed
        .into_iter()
        .enumerate()
        .map(|(i, a)| {
            a.unwrap_or_else(|e| {
                panic!(
                    "request {i} failed undisturbed: {e}\n{}",
                    up.proc.log_text()
                )
            })
        })
        .collect();

    let before = up.info().expect("info").instance;
    let crashed = run_all(&router, &prompts, |chunks| {
        // Mid-answer: every request admitted and the streamed ones two tokens
        // in on average (counted where the client reads them, so the router
        // holds tokens to resume with: a worker's token count alone also
        // counts the first run's and prompt tokens).
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let info = up.info().expect("info");
            if info.active_sequences as usize == N_STREAMED + N_WHOLE
                && chunks.load(Ordering::Relaxed) >= 2 * N_STREAMED
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the requests did not start\n{}",
                up.proc.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let pid = up
            .child_pid("omni-coordinator")
            .unwrap_or_else(|| panic!("no coordinator process\n{}", up.proc.log_text()));
        assert!(std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success()));
    });
    let log = up.proc.log_text();
    let mut longest = Duration::ZERO;
    for (i, (got, want)) in crashed.iter().zip(&undisturbed).enumerate() {
        let got = got.as_ref().unwrap_or_else(|e| {
            panic!("request {i} was lost to the coordinator's crash: {e}\n{log}")
        });
        assert_eq!(
            got.text, want.text,
            "request {i}'s answer changed across the crash\n{log}"
        );
        assert_eq!(
            got.tokens, MAX_TOKENS as u64,
            "request {i}'s usage counts every token"
        );
        longest = longest.max(got.max_gap);
    }
    let after = up.info().expect("info").instance;
    assert_ne!(before, after, "a new coordinator process serves\n{log}");
    assert!(
        log.contains("resuming a request of an earlier coordinator"),
        "{log}"
    );
    assert_eq!(
        loads(&up),
        vec![1, 1],
        "the workers kept their stages for the new coordinator (no load)\n{log}"
    );
    // Where the pause went, from the launch's log.
    for line in log.lines().filter(|l| {
        [
            "starting it again",
            "registering with the new one",
            "every worker holds",
            "kept",
            "ready: serving",
            "resumed on a new coordinator",
        ]
        .iter()
        .any(|k| l.contains(k))
    }) {
        println!("{line}");
    }
    println!(
        "coordinator kill -9 amid {N_STREAMED} streamed and {N_WHOLE} whole requests: all complete, \
         the same answers; longest pause a stream saw: {:.2} s",
        longest.as_secs_f64()
    );
}
