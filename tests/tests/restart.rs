//! End-to-end: a coordinator that restarts. It keeps nothing, so its
//! workers must notice it is another process at the same address, exit
//! with the reason, and, restarted by their supervisor (compose's restart
//! policy), register with the new one, which then serves.

use omni_tests::fixtures::{model, GEMMA};
use omni_tests::{greedy, ids, short_prompts, Cluster, ClusterSpec};
use std::time::Duration;

#[test]
fn workers_leave_a_restarted_coordinator_and_serve_the_new_one() {
    let spec = ClusterSpec::new(2, "shm");
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
