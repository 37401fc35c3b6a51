//! End-to-end: each service binary's `healthcheck` subcommand, the check
//! the compose stack's containers run (exec form: no shell, no curl), on
//! real processes serving Gemma 3.
//!
//! What a container runtime would see: a coordinator still waiting for a
//! worker is not healthy (its Inference service is NOT_SERVING), one that
//! serves is; a worker is healthy while it answers and not once it is gone;
//! the router is healthy only while every cluster behind it is ready.
//! With `--live`, a process that answers is healthy, ready or not.

use omni_tests::fixtures::{model, GEMMA};
use omni_tests::{free_port, start_router, target_bin, Cluster, ClusterSpec, Proc};
use std::process::Command;
use std::time::{Duration, Instant};

/// Runs `bin healthcheck args...` with `env`; (exit code, stdout + stderr).
fn healthcheck(bin: &str, args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new(target_bin(bin))
        .arg("healthcheck")
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run healthcheck");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// Polls `bin healthcheck` until it exits `code` (60 s at most).
fn wait_for(bin: &str, args: &[&str], env: &[(&str, &str)], code: i32) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (c, out) = healthcheck(bin, args, env);
        if c == code {
            return out;
        }
        assert!(
            Instant::now() < deadline,
            "{bin} healthcheck {args:?} still exits {c}, not {code}: {out}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn healthchecks_say_what_serves() {
    let ports = [free_port(), free_port()];
    let listen = |i: usize| format!("127.0.0.1:{}", ports[i]);
    let mut spec = ClusterSpec::new(2, "grpc");
    spec.start_workers = Some(1);
    spec.worker_args = vec![vec!["--listen".into(), listen(0)]];
    spec.coordinator_args = vec!["--rejoin-timeout".into(), "600".into()];
    let mut c = Cluster::spawn(&model(GEMMA), &spec);
    let dir = tempfile::tempdir().unwrap();

    // w0 answers at once; the coordinator listens but waits for w1.
    wait_for("omni-gpu-worker", &["--addr", &listen(0)], &[], 0);
    let (code, out) = healthcheck("omni-coordinator", &["--addr", &c.addr], &[]);
    assert_eq!(
        code, 1,
        "a coordinator waiting for a worker is not healthy: {out}"
    );
    assert!(
        out.contains("omni.coordinator.v1.Inference") && out.contains("NOT_SERVING"),
        "{out}"
    );
    // ... but live: what Swarm waits for before it publishes the
    // coordinator's name, which w1 needs to find it (deploy/swarm.yml).
    let (code, out) = healthcheck("omni-coordinator", &["--addr", &c.addr, "--live"], &[]);
    assert_eq!(code, 0, "a waiting coordinator is live: {out}");

    let mut w1 = Command::new(target_bin("omni-gpu-worker"));
    w1.args(["--coordinator", &c.addr, "--id", "w1", "--threads", "1"])
        .args(["--listen", &listen(1)]);
    let mut w1 = Proc::spawn("w1", w1, dir.path());
    let out = wait_for("omni-coordinator", &["--addr", &c.addr], &[], 0);
    assert!(out.contains("Inference SERVING"), "{out}");
    // The address from the service's own variable, a wildcard probed on
    // loopback: how the compose file calls it.
    let wildcard = format!("0.0.0.0:{}", ports[1]);
    let (code, out) = healthcheck("omni-gpu-worker", &[], &[("OMNI_WORKER_LISTEN", &wildcard)]);
    assert_eq!(code, 0, "{out}");

    // ... or from the config file's table of the service.
    let file = dir.path().join("omni.toml");
    std::fs::write(&file, format!("[worker]\nlisten = \"{wildcard}\"\n")).unwrap();
    let (code, out) = healthcheck(
        "omni-gpu-worker",
        &["--config", file.to_str().unwrap()],
        &[],
    );
    assert_eq!(code, 0, "{out}");

    let model_flag = format!("gemma3-270m={}", c.addr);
    let (router, addr) = start_router(dir.path(), &["--model".into(), model_flag]);
    // The router's check finds its address in its own settings.
    let out = wait_for("omni-router", &[], &[("OMNI_ROUTER_LISTEN", &addr)], 0);
    assert!(out.contains("ready"), "{out}");

    // w1 dies: its check fails, the cluster recovers (it waits for w1), and
    // the router's check fails naming why.
    w1.kill9();
    let (code, out) = healthcheck("omni-gpu-worker", &["--addr", &listen(1)], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("cannot connect"), "{out}");
    let out = wait_for(
        "omni-router",
        &["--url", &format!("http://{addr}/ready")],
        &[],
        1,
    );
    assert!(
        out.contains("not ready") && out.contains("recovering"),
        "{out}"
    );
    let (code, out) = healthcheck("omni-router", &["--live"], &[("OMNI_ROUTER_LISTEN", &addr)]);
    assert_eq!(code, 0, "a router whose cluster recovers is live: {out}");

    // Bad arguments are a different exit code from "not healthy".
    let (code, out) = healthcheck("omni-gpu-worker", &[], &[]);
    assert_eq!(code, 2, "port 0 cannot be probed: {out}");
    assert!(out.contains("--addr"), "{out}");
    drop(router);
    c.coordinator.kill9();
}
