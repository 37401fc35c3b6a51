//! The router driven by the official `openai` Python package (see
//! tests/python/test_openai_client.py), against a real cluster serving
//! Gemma 3, and with LangChain for structured output (tests/python/qwen)
//! against the instruction-tuned Qwen model. `scripts/test` installs the
//! packages into `.venv` beside the checkout (or set OMNI_PYTHON to an
//! interpreter that has openai, pytest, jsonschema and langchain-openai).

use omni_tests::fixtures::{model, GEMMA, QWEN};
use omni_tests::{start_router, venv_tool, Cluster, ClusterSpec, Proc};
use std::path::PathBuf;
use std::process::Command;

/// One cluster at a time: the machine has two cores.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A two-stage cluster serving `file` with a router in front (key
/// `sk-python`), under the model name `name`.
fn serve(file: &str, name: &str, ctx: usize) -> (Cluster, Proc, String, tempfile::TempDir) {
    let mut spec = ClusterSpec::new(2, "shm");
    spec.ctx = ctx;
    let cluster = Cluster::start(&model(file), &spec);
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--model".to_string(),
        format!("{name}={}", cluster.addr),
        "--api-key".into(),
        "sk-python".into(),
    ];
    let (router, addr) = start_router(dir.path(), &args);
    (cluster, router, addr, dir)
}

#[test]
fn official_openai_client_against_a_real_cluster() {
    let py = venv_tool("python");
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (cluster, router, addr, _dir) = serve(GEMMA, "gemma3-270m", 1024);
    pytest(&py, "test_openai_client.py", &cluster, &router, &addr);
}

/// Structured output and tool calling (tests/python/qwen): the official
/// client and LangChain against the instruction-tuned Qwen model on two
/// stages.
#[test]
fn structured_output_and_tools_with_the_official_client_and_langchain() {
    let py = venv_tool("python");
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (cluster, router, addr, _dir) = serve(QWEN, "qwen2.5-coder-0.5b", 2048);
    pytest(&py, "qwen", &cluster, &router, &addr);
}

/// Runs pytest on `what` (under tests/python) against the router at `addr`.
fn pytest(py: &std::path::Path, what: &str, cluster: &Cluster, router: &Proc, addr: &str) {
    let tests = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(what);
    let out = Command::new(py)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(&tests)
        .env("OMNI_BASE_URL", format!("http://{addr}/v1"))
        .env("OMNI_API_KEY", "sk-python")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", py.display()));
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{report}");
    assert!(
        out.status.success(),
        "the openai client tests failed:\n{report}\n----- router -----\n{}\n{}",
        router.log_text(),
        cluster.logs()
    );
}

/// `llm-comply --format openai-chat` passes every check, Tool Calling
/// included, except image input, which this release refuses on purpose
/// with a clear 400. Its requests set no max_tokens and expect the model to
/// stop by itself, so this runs the instruction-tuned Qwen model (the Gemma
/// file here is a base model that rarely stops before the context is full).
#[test]
fn llm_comply_openai_chat_passes_every_check_but_images() {
    let comply = venv_tool("llm-comply");
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (cluster, router, addr, _dir) = serve(QWEN, "qwen2.5-coder-0.5b", 2048);
    let out = Command::new(&comply)
        .args([
            "--format",
            "openai-chat",
            "-k",
            "sk-python",
            "-m",
            "qwen2.5-coder-0.5b",
        ])
        .args(["-u", &format!("http://{addr}/v1")])
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap();
    let report =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    eprintln!("{report}");
    let mut checks = 0;
    for line in report.lines() {
        let l = line.trim();
        // Passed: ✅ (llm-comply 0.4) or ✓ (0.5); failed: ❌, ⚠ or ✗.
        if l.starts_with(['\u{2705}', '\u{2713}']) {
            checks += 1;
        }
        if l.starts_with(['\u{274c}', '\u{26a0}', '\u{2717}']) {
            assert!(
                l.contains("Image Input"),
                "llm-comply check failed: {l}\n{report}\n{}\n{}",
                router.log_text(),
                cluster.logs()
            );
        }
    }
    assert!(
        checks >= 5,
        "expected the passing checks to be listed:\n{report}"
    );
    assert!(
        report
            .lines()
            .any(|l| l.trim().starts_with(['\u{2705}', '\u{2713}']) && l.contains("Tool Calling")),
        "the Tool Calling check did not pass:\n{report}"
    );
}
