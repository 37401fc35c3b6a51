//! End-to-end: the ggml CPU variant a worker computes with, and what a user
//! is told when a worker dies of a signal.
//!
//! - `omnictl up --cpu-variant V` makes every worker compute with V, and
//!   the admin API shows it; a variant that does not exist stops the
//!   cluster with an error that lists the ones that do.
//! - A worker killed by SIGILL (what an instruction this CPU lacks raises)
//!   is named with the signal by `omnictl up` and by the coordinator, and the
//!   stream goes on with the same tokens.
//! - A request that is running every time a worker dies is stopped after
//!   the recovery bound, and its error says it crashed a worker, how, and
//!   that it was running this request.

use omni_proto::coordinator::v1::GenerateRequest;
use omni_tests::fixtures::{self, lower_variant, GEMMA};
use omni_tests::{greedy, start_streams, target_bin, Proc, Supervised};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const TOKEN: &str = "cpu-test-token";

fn tiny() -> std::path::PathBuf {
    fixtures::fixtures_dir().join("synthetic/tiny-deepseek2-mla-q8_0.gguf")
}

/// `omnictl up` on 2 stages, one thread each, an admin token.
fn up(model: &std::path::Path, extra: &[&str]) -> Supervised {
    let mut args = vec![
        "--stages",
        "2",
        "--threads",
        "1",
        "--ctx",
        "512",
        "--seqs",
        "2",
    ];
    args.extend(extra);
    Supervised::start(
        model,
        &args,
        &[
            ("OMNI_ADMIN_TOKEN", TOKEN),
            ("OMNI_COORDINATOR_HEALTH_INTERVAL", "0.5"),
        ],
    )
}

/// `omnictl workers --json` of a running cluster.
fn workers(c: &Supervised) -> Vec<serde_json::Value> {
    let (ok, out, err) =
        omni_tests::omnictl_admin(&c.admin_addr, Some(TOKEN), &["workers", "--json"]);
    assert!(ok, "{err}");
    serde_json::from_str(&out).expect("JSON")
}

#[test]
fn workers_compute_with_the_cpu_variant_they_are_given_and_say_so() {
    let cpu = omni_engine::cpu_backend(None).expect("a CPU backend");
    let Some(lower) = lower_variant(cpu) else {
        panic!(
            "this CPU runs no variant below {} but x64/sse42: nothing to force",
            cpu.variant
        );
    };
    let c = up(&tiny(), &["--cpu-variant", &lower]);
    for w in workers(&c) {
        assert_eq!(w["cpu_variant"], lower.as_str(), "{w}");
        assert!(!w["cpu_features"].as_array().unwrap().is_empty(), "{w}");
    }
    let log = c.proc.log_text();
    assert_eq!(
        log.matches(&format!("ggml CPU backend: {lower}, forced"))
            .count(),
        2,
        "both workers log the forced variant\n{log}"
    );
    let streams = start_streams(&c.addr, vec![greedy(&[1, 17, 42], 32)]);
    let out = streams.handle.join().unwrap();
    assert_eq!(out[0].as_ref().expect("served").len(), 32);

    // A variant that does not exist: the workers refuse to start, and the
    // supervisor gives up with their reason in its log.
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(target_bin("omnictl"));
    cmd.arg("up")
        .arg("--model")
        .arg(tiny())
        .args(["--stages", "1", "--port", "0", "--cpu-variant", "pentium"])
        .args([
            "--listen",
            &format!("127.0.0.1:{}", omni_tests::free_port()),
        ])
        .args([
            "--admin-listen",
            &format!("127.0.0.1:{}", omni_tests::free_port()),
        ]);
    let mut p = Proc::spawn("bad-variant", cmd, dir.path());
    assert_eq!(
        p.wait_exit(Duration::from_secs(60)),
        Some(false),
        "omnictl up stops"
    );
    let log = p.log_text();
    assert!(
        log.contains("CPU variant 'pentium'")
            && log.contains("no such variant")
            && log.contains(&cpu.variant)
            && log.contains("within a minute"),
        "{log}"
    );
}

#[test]
fn a_worker_that_dies_of_sigill_is_named_and_its_stream_goes_on() {
    let c = up(&tiny(), &[]);
    let req = greedy(&[1, 17, 42, 99, 5], 400);
    // The clean run leaves nothing in the prefix cache, so the second run's
    // cells are laid out as its were: this model's attention (absorbed
    // MLA, no flash attention) sums in an order that follows the layout.
    let clean_req = GenerateRequest {
        cache_prompt: Some(false),
        ..req.clone()
    };
    let clean = start_streams(&c.addr, vec![clean_req])
        .handle
        .join()
        .unwrap();
    let want = clean[0].as_ref().expect("the clean run").clone();

    let streams = start_streams(&c.addr, vec![req]);
    streams.wait_for(40);
    c.signal("w1", "-ILL");
    let got = streams.handle.join().unwrap();
    let log = c.proc.log_text();
    let got = got[0]
        .as_ref()
        .unwrap_or_else(|e| panic!("the stream failed: {e}\n{log}"));
    assert_eq!(got, &want, "the stream's tokens changed across the crash");
    // The supervisor's word, the worker's own last words, and the
    // coordinator's reason for the recovery, each naming the signal (and
    // the record the dying process left names its CPU variant).
    let cpu = omni_engine::cpu_backend(None).unwrap();
    for line in [
        "omnictl: w1 died of SIGILL (illegal instruction); starting it again".to_string(),
        format!(
            "omni-gpu-worker w1: died of SIGILL (illegal instruction) with ggml CPU variant {}",
            cpu.variant
        ),
        format!(
            "is gone: it died of SIGILL (illegal instruction) with ggml CPU variant {}, and restarted",
            cpu.variant
        ),
    ] {
        assert!(log.contains(&line), "no {line:?} in\n{log}");
    }
}

#[test]
fn a_request_that_keeps_crashing_a_worker_is_stopped_with_that_reason() {
    // A real model decodes slowly enough to kill the last stage while this
    // request's step is in flight, each time after its replay.
    let c = up(&fixtures::model(GEMMA), &[]);
    let streams = start_streams(&c.addr, vec![greedy(&[2, 818, 5279, 529, 7001], 400)]);
    let mut kills = 0;
    let mut seen = 0;
    let deadline = Instant::now() + Duration::from_secs(180);
    while kills < 4 && !streams.handle.is_finished() {
        // New tokens: the worker is back and the request runs on it again.
        if streams.progress.load(Ordering::Relaxed) >= seen + 3 {
            c.signal("w1", "-ILL");
            kills += 1;
            // w1 samples: no token comes after it died.
            seen = streams.progress.load(Ordering::Relaxed);
        }
        assert!(Instant::now() < deadline, "{}", c.proc.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let result = streams.handle.join().unwrap();
    let log = c.proc.log_text();
    let err = match &result[0] {
        Ok(t) => panic!(
            "the request finished ({} tokens) after {kills} crashes\n{log}",
            t.len()
        ),
        Err(e) => e.clone(),
    };
    assert_eq!(kills, 4, "{log}");
    for part in [
        "the request was stopped because it crashed a worker 4 times",
        "w1 (",
        "died of SIGILL (illegal instruction)",
        "running this request",
    ] {
        assert!(err.contains(part), "no {part:?} in the error: {err}\n{log}");
    }
    assert_eq!(log.matches("starting it again").count(), 4, "{log}");
    // The cluster serves on.
    c.wait_ready(Duration::from_secs(30));
    let after = start_streams(&c.addr, vec![greedy(&[2, 818], 8)])
        .handle
        .join()
        .unwrap();
    assert_eq!(after[0].as_ref().expect("served after").len(), 8);
}
