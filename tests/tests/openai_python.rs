//! The router driven by the official `openai` Python package (see
//! tests/python/test_openai_client.py), against a real cluster serving
//! Gemma 3. `scripts/test` installs the package into `.venv` beside the
//! checkout (or set OMNI_PYTHON to an interpreter that has openai and pytest).

use omni_tests::fixtures::{model, GEMMA};
use omni_tests::{free_port, target_bin, Cluster, ClusterSpec, Proc};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("OMNI_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(
        venv.exists(),
        "{} is missing: run ./scripts/test (it creates the venv with openai and pytest), or set OMNI_PYTHON",
        venv.display()
    );
    venv
}

#[test]
fn official_openai_client_against_a_real_cluster() {
    let py = python();
    let cluster = Cluster::start(&model(GEMMA), &ClusterSpec::new(2, "shm"));
    let addr = format!("127.0.0.1:{}", free_port());
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(target_bin("omni-router"));
    cmd.args(["--listen", &addr])
        .args(["--model", &format!("gemma3-270m={}", cluster.addr)])
        .args(["--api-key", "sk-python"]);
    let router = Proc::spawn("router", cmd, dir.path());
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(
            Instant::now() < deadline,
            "router not up:\n{}",
            router.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let tests = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python");
    let out = Command::new(&py)
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
