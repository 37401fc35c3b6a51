//! End-to-end: the workers `omnictl up` starts on one machine compute on
//! the same RAM, so the coordinator's plan counts it once. Each worker's
//! `--memory` caps that worker; together they get the largest of their
//! offers, not the sum (issue 24: two workers each offering "what the
//! machine has free" once made the plan promise twice the machine).

use omni_planner::{fmt_bytes, plan, PlanConfig, WorkerSpec};
use omni_tests::fixtures::{model, GEMMA};
use std::time::{Duration, Instant};

/// `omnictl up` with 2 stages, each worker offering enough for its own
/// stage and together (were offers added) for both, but one machine's
/// offer not for both: the coordinator refuses before anything loads,
/// naming the memory the workers share. The offer is worked out from the
/// file with the same planner, so the test does not depend on this
/// machine's RAM (only that it has the few MiB free).
#[test]
fn omnictl_up_counts_the_machines_memory_once() {
    let model = model(GEMMA);
    let (ctx, seqs) = (512, 8);
    let cfg = PlanConfig {
        n_ctx: ctx,
        n_seq: seqs,
        ..PlanConfig::default()
    };
    let roomy = |id: &str| WorkerSpec {
        id: id.into(),
        device: "cpu".into(),
        free_bytes: 1 << 40,
        total_bytes: 1 << 40,
        read_rate: 0,
        pool: None,
    };
    let m = omni_engine::ModelFile::open(&model).unwrap();
    let need: Vec<u64> = plan(&m, &[roomy("w0"), roomy("w1")], &cfg)
        .unwrap()
        .stages
        .iter()
        .map(|s| s.bytes.total)
        .collect();
    let sum: u64 = need.iter().sum();
    // Room for 3/4 of both stages after headroom: either alone fits, both do not.
    let usable = sum * 3 / 4;
    assert!(need.iter().all(|&n| n + (1 << 20) < usable), "{need:?}");
    let offer = (usable as f64 / (1.0 - cfg.headroom)).ceil() as u64;

    let dir = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{}", omni_tests::free_port());
    let admin = format!("127.0.0.1:{}", omni_tests::free_port());
    let mut cmd = std::process::Command::new(omni_tests::target_bin("omnictl"));
    cmd.args(["up", "--stages", "2", "--threads", "1", "--port", "0"])
        .args(["--ctx", &ctx.to_string(), "--seqs", &seqs.to_string()])
        .args(["--memory", &format!("{offer}B")])
        .arg("--model")
        .arg(&model)
        .args(["--listen", &addr, "--admin-listen", &admin]);
    let mut up = omni_tests::Proc::spawn("omnictl-up", cmd, dir.path());
    let t = Instant::now();
    let ok = up.wait_exit(Duration::from_secs(60));
    let log = up.log_text();
    assert_eq!(ok, Some(false), "omnictl up should fail:\n{log}");
    for part in [
        "on w0 and w1 together".to_string(),
        "but they share host ".to_string(),
        "'s RAM, which has ".to_string(),
        format!("{} free", fmt_bytes(offer)),
        "counted once, not once per worker".to_string(),
    ] {
        assert!(log.contains(&part), "the refusal says '{part}':\n{log}");
    }
    assert!(
        !log.contains("loading embed") && !log.contains("loading layer"),
        "nothing may be loaded when the plan fails:\n{log}"
    );
    eprintln!(
        "refused after {:.1}s with each worker offering {}",
        t.elapsed().as_secs_f64(),
        fmt_bytes(offer)
    );
}
