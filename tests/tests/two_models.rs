//! Two models served together (issue 39), as a user runs them: one
//! `omnictl up` with an "executor" (Qwen2.5-Coder 0.5B) and an "oracle"
//! (Gemma 3 270M), each with its own coordinator and worker, behind one
//! router; planned together before anything loads.

use omni_tests::fixtures::{model, GEMMA, QWEN};
use omni_tests::{free_port, http_with_head, short_prompts, target_bin, Proc};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const N_GEN: usize = 8;

fn omnictl() -> Command {
    let mut c = Command::new(target_bin("omnictl"));
    c.env_remove("OMNI_ADMIN_TOKEN")
        .env_remove("OMNI_ADMIN_TOKEN_FILE")
        .env_remove("OMNI_API_KEYS");
    c
}

/// What one model answers alone: greedy text from the whole model in this
/// process.
fn alone(file: &Path, prompt: &[u32]) -> String {
    let mut e = omni_tests::cpu_engine(file);
    let opts = omni_engine::GenerateOptions {
        max_tokens: N_GEN,
        stop_at_eog: false,
        ..omni_engine::GenerateOptions::default()
    };
    e.generate(prompt, &opts, &mut |_| {}).unwrap().text
}

/// `POST /v1/completions` with token ids, greedy; (status, body).
fn complete(base: &str, model: &str, prompt: &Value) -> (u16, Value) {
    let body = json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": N_GEN,
        "temperature": 0,
        "ignore_eos": true,
    });
    let (status, head, text) = http_with_head(
        base,
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    );
    let mut v = serde_json::from_str(&text).unwrap_or_else(|_| json!({ "raw": text }));
    if status == 503 {
        // A model that is down says when to try again.
        assert!(
            head.to_ascii_lowercase().contains("retry-after:"),
            "503 without Retry-After: {head}"
        );
        v["retry_after"] = json!(true);
    }
    (status, v)
}

/// Waits until `up`'s log says every model serves (panics with the log).
fn wait_ready(up: &mut Proc, names: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let log = up.log_text();
        if names
            .iter()
            .all(|n| log.contains(&format!("omnictl: ready: '{n}'")))
        {
            return;
        }
        assert!(Instant::now() < deadline, "not ready:\n{log}");
        assert!(up.child.try_wait().unwrap().is_none(), "up exited:\n{log}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The pid of the worker `--id ID` that reports to the coordinator at `addr`.
fn worker_pid(addr: &str, id: &str) -> Option<i32> {
    let want = [format!("--coordinator\0{addr}\0"), format!("--id\0{id}\0")];
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let cmdline = String::from_utf8_lossy(&cmdline);
        want.iter().all(|w| cmdline.contains(w)).then_some(pid)
    })
}

/// One launch, everything a user of two models notices: each model answers
/// under its name and its alias with the tokens it gives alone; `auto`
/// sends a request where the rules say and the answer names that model;
/// kill -9 of one model's worker, or of its coordinator, leaves the other
/// answering at once while the supervisor brings the first back.
#[test]
fn two_models_in_one_up_answer_under_their_names_route_auto_and_keep_a_crash_inside_one_model() {
    let (qwen, gemma) = (model(QWEN), model(GEMMA));
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let addr = |p: u16| format!("127.0.0.1:{p}");
    let (ex_addr, ex_admin, or_addr, or_admin) = (
        addr(free_port()),
        addr(free_port()),
        addr(free_port()),
        addr(free_port()),
    );
    let mut cmd = omnictl();
    cmd.arg("up")
        .arg("--model")
        .arg(format!(
            "executor={},alias=coder,listen={ex_addr},admin-listen={ex_admin}",
            qwen.display()
        ))
        .arg("--model")
        .arg(format!(
            "oracle={},alias=big,listen={or_addr},admin-listen={or_admin}",
            gemma.display()
        ))
        .args(["--stages", "1", "--ctx", "512", "--seqs", "2"])
        .args(["--port", &port.to_string()])
        .args([
            "--auto",
            "keyword:prove=oracle;prompt_chars>300=oracle;default=executor",
        ])
        .env("XDG_STATE_HOME", dir.path());
    let mut up = Proc::spawn("omnictl-up", cmd, dir.path());
    wait_ready(&mut up, &["executor", "oracle"]);
    let log = up.log_text();
    // The joint plan came first, with both models on the host's one memory.
    assert!(
        log.contains("2 models planned together (executor, oracle)"),
        "{log}"
    );
    let base = format!("127.0.0.1:{port}");

    // One admin view: `omnictl workers`, `plan` and `top` at the first
    // model's admin address show both models.
    for verb in ["workers", "plan"] {
        let out = omnictl()
            .args([verb, "--admin", &ex_admin, "--json"])
            .env("XDG_STATE_HOME", dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{verb}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let names: Vec<&str> = v["models"]
            .as_array()
            .unwrap_or_else(|| panic!("{verb}: {v}"))
            .iter()
            .filter_map(|m| m["name"].as_str())
            .collect();
        assert_eq!(names, ["executor", "oracle"], "{verb}: {v}");
    }
    let out = omnictl()
        .args(["top", "--once", "--interval", "0.2", "--admin", &ex_admin])
        .env("XDG_STATE_HOME", dir.path())
        .output()
        .unwrap();
    let top = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && top.contains("omni: 'executor' ")
            && top.contains("omni: 'oracle' "),
        "top: {top}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Each under its name and alias, as it answers alone.
    let cases = [
        ("executor", "coder", &qwen, "real_qwen2_5_coder_0_5b.json"),
        ("oracle", "big", &gemma, "real_gemma3_270m.json"),
    ];
    let mut wants = Vec::new();
    for (name, alias, file, fixture) in cases {
        let prompt = short_prompts(fixture, 1).remove(0);
        let want = alone(file, &prompt);
        for asked in [name, alias] {
            let (status, v) = complete(&base, asked, &json!(prompt));
            assert_eq!(status, 200, "{asked}: {v}");
            assert_eq!(
                v["choices"][0]["text"], want,
                "{asked} answered otherwise than {name} alone"
            );
        }
        wants.push((name, prompt, want));
    }

    // auto: by keyword, by length, else the default; the answer names it.
    let long = "Tell me about the sea. ".repeat(20);
    for (prompt, want) in [
        (
            "Please prove that there are infinitely many primes.",
            "oracle",
        ),
        (long.as_str(), "oracle"),
        ("Write hello world in Rust.", "executor"),
    ] {
        let (status, v) = complete(&base, "auto", &json!(prompt));
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["model"], want, "auto sent {prompt:?} elsewhere: {v}");
    }

    // kill -9 of the executor's worker: the oracle answers at once, the same.
    let pid = worker_pid(&ex_addr, "w0").expect("the executor's worker runs");
    assert!(Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    let (_, oracle_prompt, oracle_want) = &wants[1];
    let (status, v) = complete(&base, "oracle", &json!(oracle_prompt));
    assert_eq!(
        status, 200,
        "the oracle stopped with the executor's worker: {v}"
    );
    assert_eq!(&v["choices"][0]["text"], oracle_want);
    // The executor comes back (503 with Retry-After until then) and answers the same.
    let (_, ex_prompt, ex_want) = &wants[0];
    comes_back(&base, &up, "executor", ex_prompt, ex_want, "executor.w0");

    // kill -9 of the oracle's coordinator: the executor answers at once;
    // the supervisor starts the coordinator again, its worker registers
    // with the new one, and the oracle answers the same.
    let coordinator = coordinator_pid(&or_addr).expect("the oracle's coordinator runs");
    assert!(Command::new("kill")
        .args(["-9", &coordinator.to_string()])
        .status()
        .unwrap()
        .success());
    let (status, v) = complete(&base, "executor", &json!(ex_prompt));
    assert_eq!(
        status, 200,
        "the executor stopped with the oracle's coordinator: {v}"
    );
    assert_eq!(&v["choices"][0]["text"], ex_want);
    comes_back(
        &base,
        &up,
        "oracle",
        oracle_prompt,
        oracle_want,
        "oracle.coordinator",
    );
    let _ = Command::new("kill")
        .args(["-TERM", &up.child.id().to_string()])
        .status();
    up.wait_exit(Duration::from_secs(20));
}

/// After `killed` died of SIGKILL (as `up`'s log says), `model` answers
/// `prompt` with `want` again within 2 minutes, 503 until then.
fn comes_back(base: &str, up: &Proc, model: &str, prompt: &[u32], want: &str, killed: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (status, v) = complete(base, model, &json!(prompt));
        if status == 200 {
            assert_eq!(v["choices"][0]["text"], want);
            break;
        }
        assert_eq!(status, 503, "while {model} recovers: {v}");
        assert!(
            Instant::now() < deadline,
            "{model} did not come back:\n{}",
            up.log_text()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(
        up.log_text()
            .contains(&format!("omnictl: {killed} died of SIGKILL")),
        "{}",
        up.log_text()
    );
}

/// The pid of the coordinator that listens at `addr`.
fn coordinator_pid(addr: &str) -> Option<i32> {
    let want = format!("--listen\0{addr}\0");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let cmdline = String::from_utf8_lossy(&cmdline);
        (cmdline.contains("omni-coordinator") && cmdline.contains(&want)).then_some(pid)
    })
}

/// A set that does not fit together is refused before anything loads, and
/// the refusal names both models, the device and the numbers; the dry run
/// shows each model's share of the device; omni.toml's [[up.models]] give
/// the same launch.
#[test]
fn a_joint_plan_that_does_not_fit_is_refused_naming_both_models() {
    let (qwen, gemma) = (model(QWEN), model(GEMMA));
    let models = [
        format!("executor={},ctx=512,seqs=2", qwen.display()),
        format!("oracle={},ctx=512,seqs=2", gemma.display()),
    ];
    let plan = |device: &str, json: bool| {
        let mut c = omnictl();
        c.arg("plan");
        for m in &models {
            c.args(["--model", m]);
        }
        c.args(["--devices", device]);
        if json {
            c.arg("--json");
        }
        c.output().unwrap()
    };
    // Roomy: both fit, each model's use on the one device, the rest left.
    let out = plan("cpu:64GiB", true);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p: Value = serde_json::from_slice(&out.stdout).unwrap();
    let dev = &p["devices"][0];
    let uses = dev["uses"].as_array().unwrap();
    assert_eq!(uses.len(), 2, "{dev}");
    let total = |i: usize| uses[i]["total"].as_u64().unwrap();
    let (ex, or) = (total(0), total(1));
    assert_eq!(
        (uses[0]["model"].as_str(), uses[1]["model"].as_str()),
        (Some("executor"), Some("oracle"))
    );
    assert_eq!(
        dev["left"].as_u64().unwrap(),
        dev["budget"].as_u64().unwrap() - ex - or
    );

    // Room for the executor and half the oracle: refused, naming both.
    let size = ((ex + or / 2) as f64 / 0.9) as u64;
    let out = plan(&format!("cpu:{}MiB", size >> 20), false);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("model 'oracle' does not fit beside 'executor'")
            && err.contains("'executor' takes"),
        "{err}"
    );

    // `up` refuses the same before starting anything: the oracle's worker
    // may offer too little for it beside the executor.
    let state = tempfile::tempdir().unwrap();
    let mut c = omnictl();
    c.arg("up")
        .args(["--model", &models[0]])
        .args([
            "--model",
            &format!("{},memory={}MiB", models[1], (or / 2) >> 20),
        ])
        .args(["--stages", "1", "--port", "0"])
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--admin-listen", &format!("127.0.0.1:{}", free_port())])
        .env("XDG_STATE_HOME", state.path());
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("nothing was started")
            && err.contains("model 'oracle' does not fit beside 'executor'"),
        "{err}"
    );
    assert!(!err.contains("coordinator]"), "something started: {err}");

    // The same launch from omni.toml's [up] and [[up.models]] tables is
    // refused the same; a misspelt setting there is named with its model.
    let file = state.path().join("omni.toml");
    let toml = |oracle_memory_key: &str| {
        format!(
            "[up]\nstages = 1\nport = 0\nlisten = \"127.0.0.1:{}\"\nadmin_listen = \"127.0.0.1:{}\"\n\n\
             [[up.models]]\nname = \"executor\"\nmodel = \"{}\"\nctx = 512\nseqs = 2\nalias = [\"coder\"]\n\n\
             [[up.models]]\nname = \"oracle\"\nmodel = \"{}\"\nctx = 512\nseqs = 2\n{oracle_memory_key} = \"{}MiB\"\n",
            free_port(),
            free_port(),
            qwen.display(),
            gemma.display(),
            (or / 2) >> 20
        )
    };
    for (key, want) in [
        ("memory", "model 'oracle' does not fit beside 'executor'"),
        ("memroy", "model 'oracle': unknown setting 'memroy'"),
    ] {
        std::fs::write(&file, toml(key)).unwrap();
        let out = omnictl()
            .arg("up")
            .arg("--config")
            .arg(&file)
            .env("XDG_STATE_HOME", state.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{key}: {err}");
        assert!(!err.contains("coordinator]"), "something started: {err}");
    }
}
