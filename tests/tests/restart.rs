//! End-to-end: a coordinator that restarts at the same address. Its
//! workers outlive it (issue 42): they notice another process answers,
//! register with it telling what they hold, and it keeps their stages
//! instead of loading them again. With `--orphan-grace 0` they exit
//! instead, as before, and their supervisor starts them afresh.

use omni_tests::fixtures::{model, GEMMA};
use omni_tests::{greedy, ids, short_prompts, Cluster, ClusterSpec};
use std::time::Duration;

#[test]
fn workers_keep_their_stages_for_a_restarted_coordinator() {
    let spec = ClusterSpec::new(2, "shm");
    let gemma = model(GEMMA);
    let mut c = Cluster::start(&gemma, &spec);
    let prompt = &short_prompts("real_gemma3_270m.json", 1)[0];
    let before = ids(&c.generate(greedy(prompt, 12)).expect("generate"));
    let loads = |c: &Cluster| -> Vec<u64> { c.statuses().iter().map(|s| s.loads).collect() };
    assert_eq!(loads(&c), vec![1, 1]);

    c.coordinator.kill9();
    c.restart_coordinator(&gemma, &spec);
    c.wait_ready();
    for (i, w) in c.workers.iter_mut().enumerate() {
        assert!(
            matches!(w.child.try_wait(), Ok(None)),
            "w{i} stays up\n{}",
            w.log_text()
        );
        let log = w.log_text();
        assert!(log.contains("registering with the new one"), "{log}");
        assert!(log.contains("kept"), "{log}");
    }
    assert_eq!(
        loads(&c),
        vec![1, 1],
        "no worker loaded again\n{}",
        c.logs()
    );
    let after = ids(&c
        .generate(greedy(prompt, 12))
        .expect("generate after the restart"));
    assert_eq!(before, after, "the new coordinator serves the same model");
}

#[test]
fn with_no_grace_workers_leave_a_restarted_coordinator_and_serve_the_new_one() {
    let mut spec = ClusterSpec::new(2, "shm");
    spec.worker_args = vec![vec!["--orphan-grace".into(), "0".into()]; 2];
    let gemma = model(GEMMA);
    let mut c = Cluster::start(&gemma, &spec);
    let prompt = &short_prompts("real_gemma3_270m.json", 1)[0];
    let before = ids(&c.generate(greedy(prompt, 12)).expect("generate"));

    c.coordinator.kill9();
    c.restart_coordinator(&gemma, &spec);
    for i in 0..2 {
        let exited = c.workers[i].wait_exit(Duration::from_secs(30));
        assert_eq!(
            exited,
            Some(false),
            "w{i} should exit with an error once the coordinator restarted\n{}",
            c.logs()
        );
        let log = c.workers[i].log_text();
        assert!(
            log.contains("the coordinator at") && log.contains("restarted"),
            "{log}"
        );
    }
    for i in 0..2 {
        c.restart_worker(&spec, i);
    }
    c.wait_ready();
    let after = ids(&c
        .generate(greedy(prompt, 12))
        .expect("generate after the restart"));
    assert_eq!(before, after, "the new coordinator serves the same model");
}
