//! OpenAI's own OpenAPI spec, run by schemathesis against the router in front of a real
//! cluster serving Gemma 3.
//!
//! The spec is the part of OpenAI's official spec that the router serves,
//! `tests/openapi/openai.yaml`, written by `scripts/openai-spec`; its header names the source.
//! `tests/openapi/hooks.py` puts the served model into every request that names a model (or
//! nearly all would be 404s), streams every other request (generated ones almost never
//! stream), and adds the check `openai_error_shape`: every 4xx and 5xx carries OpenAI's error
//! body, validated against the spec's own `ErrorResponse`. `scripts/test` installs
//! schemathesis into `.venv` (or set OMNI_PYTHON to an interpreter whose bin directory has it).
//!
//! Streams (`text/event-stream`) are where the spec is loose, and the generated subset makes
//! two changes, listed in its header. Upstream gives chat's chunk schema as the stream's
//! `schema`, which schemathesis (as OpenAPI says) reads as the schema of each whole SSE event
//! `{"event", "data"}`, so every streamed 200 failed; the subset states it in OpenAPI 3.2's
//! form instead: each event's `data` is a JSON chunk, or `[DONE]`. And upstream documents
//! `/completions` as JSON only, so `content_type_conformance` flagged every streamed
//! completion: a limit of the spec, not a mismatch, since its own `stream` field says the
//! response is then server-sent events ending in `data: [DONE]`, as OpenAI's API sends. The
//! subset adds that stream, its chunks checked against the completion schema with
//! `finish_reason` and `usage` nullable, as in upstream's chat chunk.
//!
//! The checks, and why some of schemathesis' are left out:
//! - `not_a_server_error`: no 5xx, whatever the request.
//! - `response_schema_conformance`: every 200 body, and every event of a stream, matches the
//!   spec's schema.
//! - `content_type_conformance`: JSON, or `text/event-stream` when streamed.
//! - `ignored_auth`: a request without the key, or with a wrong one, is refused.
//! - `unsupported_method`, `allow_header_conformance`: any other method is a 405 with `Allow`.
//! - `response_headers_conformance`, `missing_required_header`: cheap, and pass.
//! - `openai_error_shape` (ours, above).
//! - Left out: `status_code_conformance`, because the spec documents only each 200 while the
//!   router answers client mistakes with clear 4xx (400, 401, 404, 405, 413, 415, 429) and
//!   503/504 when the cluster cannot serve; `openai_error_shape` checks those bodies instead.
//!   `positive_data_acceptance`, because the router refuses some valid requests on purpose,
//!   with a 400 that says why: the deprecated `functions`, schemas and grammars that do not compile,
//!   image and audio input, `n` above 16, several prompts in one request, a null prompt,
//!   `echo`, `suffix`, `best_of`, and conversations the model's chat template refuses.
//!   `negative_data_rejection`, because the router reads `null` as an absent field, an empty
//!   `tools` or `functions` as none, and ignores fields it does not use
//!   (router/src/openai/), where the spec would want a 400; wrong values in the fields it
//!   uses are 400s, tested in router/tests/openai_types.rs. The stateful checks
//!   (`use_after_free`, `ensure_resource_availability`, `object_level_authorization`): these
//!   operations create no resources.
//!
//! The run is bounded: a context of 256 tokens bounds every generation, `--max-examples` the
//! fuzzing phase's requests per operation, and a fixed seed makes the requests the same on
//! every run (OMNI_SCHEMATHESIS_SEED picks another, to explore).

use omni_tests::fixtures::{model, GEMMA};
use omni_tests::{start_router, venv_tool, Cluster, ClusterSpec};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const MODEL: &str = "gemma3-270m";
const KEY: &str = "sk-schemathesis";
/// Test cases per operation in the fuzzing phase (the coverage phase makes its own set).
const MAX_EXAMPLES: u32 = 50;
const SEED: &str = "20261122";
/// A whole generation of `n` = 16 choices at a context of 256 takes about 80 s here.
const REQUEST_TIMEOUT_S: u32 = 150;
/// schemathesis is stopped after this, and the test fails.
const DEADLINE: Duration = Duration::from_secs(600);

/// The checks (see the module docs for the ones left out).
const CHECKS: &[&str] = &[
    "not_a_server_error",
    "response_schema_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "missing_required_header",
    "ignored_auth",
    "unsupported_method",
    "allow_header_conformance",
    "openai_error_shape",
];

/// One cluster at a time: the machine has two cores.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `cmd` with its output in files under `dir`; stops it at `deadline`. The exit status
/// (None when it was stopped) and its output.
fn run_bounded(mut cmd: Command, dir: &Path, deadline: Duration) -> (Option<i32>, String) {
    let out = dir.join("schemathesis.out");
    let f = std::fs::File::create(&out).unwrap();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run schemathesis: {e}"));
    let end = Instant::now() + deadline;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s.code();
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    (status, std::fs::read_to_string(&out).unwrap_or_default())
}

#[test]
fn openai_openapi_spec_holds_for_the_router() {
    let bin = venv_tool("schemathesis");
    let openapi = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("openapi");
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut spec = ClusterSpec::new(2, "shm");
    spec.ctx = 256;
    let cluster = Cluster::start(&model(GEMMA), &spec);
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--model".to_string(),
        format!("{MODEL}={}", cluster.addr),
        "--api-key".into(),
        KEY.into(),
    ];
    let (router, addr) = start_router(dir.path(), &args);

    let seed = std::env::var("OMNI_SCHEMATHESIS_SEED").unwrap_or_else(|_| SEED.into());
    let report = dir.path().join("report.json");
    let mut cmd = Command::new(&bin);
    cmd.arg("run")
        .arg(openapi.join("openai.yaml"))
        .args(["--url", &format!("http://{addr}/v1")])
        .args(["--header", &format!("Authorization: Bearer {KEY}")])
        .args(["--checks", &CHECKS.join(",")])
        .args(["--max-examples", &MAX_EXAMPLES.to_string()])
        .args(["--request-timeout", &REQUEST_TIMEOUT_S.to_string()])
        .args(["--seed", &seed])
        // One request at a time: the cluster has two cores, and hypothesis on Python 3.11 can
        // crash building lambda descriptions in several threads at once.
        .args(["--workers", "1"])
        .arg("--continue-on-failure")
        .args(["--generation-database", "none"])
        .arg("--no-color")
        .args(["--report", "json", "--report-json-path"])
        .arg(&report)
        // No schemathesis.toml from a parent directory, no files left in the checkout.
        .current_dir(dir.path())
        .env("SCHEMATHESIS_HOOKS", "hooks")
        .env("PYTHONPATH", &openapi)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("OMNI_SCHEMATHESIS_MODEL", MODEL);
    let started = Instant::now();
    let (status, output) = run_bounded(cmd, dir.path(), DEADLINE);
    eprintln!("{output}");
    eprintln!("schemathesis took {:.0} s", started.elapsed().as_secs_f64());
    let logs = || {
        format!(
            "----- router -----\n{}\n{}",
            router.log_text(),
            cluster.logs()
        )
    };
    match status {
        Some(0) => {}
        Some(code) => panic!(
            "schemathesis failed (exit {code}; its report is above)\n{}",
            logs()
        ),
        None => panic!(
            "schemathesis was still running after {DEADLINE:?} and was stopped\n{}",
            logs()
        ),
    }

    // It cannot pass by testing nothing: every operation was tested, and each answered
    // generated requests with a 200 (so the cluster generated for chat and completions).
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", report.display()));
    let generated = json["test_cases"]["generated"].as_u64().unwrap_or(0);
    assert_eq!(json["operations"]["tested"], 3, "{json:#}");
    assert!(generated >= 500, "only {generated} test cases: {json:#}");
    for op in ["GET /models", "POST /chat/completions", "POST /completions"] {
        let accepted = json["valid_rates"][op]["fuzzing"]["accepted"]
            .as_u64()
            .unwrap_or(0);
        assert!(accepted > 0, "no 200 for {op} while fuzzing: {json:#}");
    }
}
