//! End-to-end: a request survives the crash of any worker. `omnictl up` is
//! the supervisor (it starts a worker that exits again); the coordinator
//! notices the loss, reloads the worker's layers (or experts), resets the
//! other stages, wires the pipeline again and replays every sequence from
//! its log into the same KV cells. What a user would notice: the streams
//! pause and then finish, with the tokens of a run without crashes.
//!
//! The model is the tiny synthetic deepseek2 (MLA, Q8_0) with every MoE
//! layer's routed experts on an expert worker, so the three kinds of
//! process can be killed: the first stage, the last stage and the
//! cpu-worker. It runs one micro-batch group per stream, one thread per
//! worker, and prompts shorter than one attention tile, so a stream's
//! tokens do not depend on how the other streams' steps interleave (its
//! near-ties are many: its weights are random).

use omni_proto::coordinator::v1::GenerateRequest;
use omni_tests::{greedy, same_tokens, start_streams, Supervised};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const N_GEN: usize = 160;

fn model() -> std::path::PathBuf {
    omni_tests::fixtures::fixtures_dir().join("synthetic/tiny-deepseek2-mla-q8_0.gguf")
}

fn requests() -> Vec<GenerateRequest> {
    [
        &[1u32, 17, 42, 99, 5][..],
        &[1, 3, 5, 7],
        &[1, 200, 33],
        &[1, 9, 8, 7, 6, 5, 4],
    ]
    .iter()
    .map(|p| greedy(p, N_GEN))
    .collect()
}

/// Two stages (layers 2,2) and one expert worker, 4 sequences.
fn cluster(env: &[(&str, &str)]) -> Supervised {
    let mut env = env.to_vec();
    env.extend([("OMNI_MICRO_BATCHES", "4"), ("OMNI_HEALTH_INTERVAL", "0.5")]);
    Supervised::start(
        &model(),
        &[
            "--stages",
            "2",
            "--cpu-workers",
            "1",
            "--experts",
            "cpu",
            "--layers",
            "2,2",
            "--ctx",
            "512",
            "--seqs",
            "4",
            "--threads",
            "1",
            "--transport",
            "shm",
        ],
        &env,
    )
}

/// Runs the 4 streams, doing `hurt` once they are a few tokens in; checks
/// every stream finished with `want`'s tokens and returns the longest
/// pause a stream saw.
fn run_through(
    c: &Supervised,
    want: &[Vec<u32>],
    what: &str,
    hurt: impl FnOnce(&Supervised),
) -> Duration {
    let streams = start_streams(&c.addr, requests());
    streams.wait_for(4 * 12);
    hurt(c);
    let at = streams.progress.load(Ordering::Relaxed);
    let results = streams.handle.join().unwrap();
    assert!(
        at < 4 * N_GEN,
        "{what} came after the streams had finished ({at} tokens)"
    );
    if results.iter().any(Result::is_err) {
        panic!("{what}: {results:?}\n{}", c.proc.log_text());
    }
    same_tokens(&results, want, what);
    Duration::from_micros(streams.max_gap_us.load(Ordering::Relaxed))
}

#[test]
fn streams_survive_kill_9_of_the_first_stage_the_last_stage_and_the_cpu_worker() {
    let c = cluster(&[]);
    let clean = start_streams(&c.addr, requests()).handle.join().unwrap();
    let want: Vec<Vec<u32>> = clean
        .into_iter()
        .map(|r| r.expect("the clean run"))
        .collect();
    let mut report = Vec::new();
    for victim in ["w0", "w1", "c0"] {
        let mut old = 0;
        let stall = run_through(&c, &want, &format!("kill -9 {victim}"), |c| {
            old = c.signal(victim, "-9");
        });
        // The supervisor started it again, and the cluster serves.
        c.wait_ready(Duration::from_secs(30));
        let new = c.pid_of(victim).expect("restarted");
        assert_ne!(new, old, "{victim} runs as a new process");
        report.push(format!("{victim}: {:.2} s", stall.as_secs_f64()));
    }
    let log = c.proc.log_text();
    assert_eq!(
        log.matches("starting it again").count(),
        3,
        "three restarts\n{log}"
    );
    assert!(
        !log.contains("the replay sampled token"),
        "a replay diverged\n{log}"
    );
    eprintln!(
        "kill -9 mid-stream, 4 streams, identical tokens; longest pause per kill: {}",
        report.join(", ")
    );
}

/// A stopped worker (SIGSTOP) answers nothing but does not exit, so no
/// supervisor restarts it: its health checks time out, it counts as lost,
/// and after `--rejoin-timeout` the other stage takes all the layers.
#[test]
fn a_stopped_worker_is_found_by_its_heartbeat_and_the_others_take_its_layers() {
    let c = cluster(&[("OMNI_REJOIN_TIMEOUT", "2")]);
    let want: Vec<Vec<u32>> = start_streams(&c.addr, requests())
        .handle
        .join()
        .unwrap()
        .into_iter()
        .map(|r| r.expect("the clean run"))
        .collect();
    let mut detected = None;
    let stall = run_through(&c, &want, "SIGSTOP w1", |c| {
        c.signal("w1", "-STOP");
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if c.info().is_ok_and(|i| i.state.starts_with("recovering")) {
                detected = Some(t.elapsed());
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let detected = detected.expect("the stop was noticed");
    c.signal("w1", "-CONT");
    // Health every 0.5 s, 1 s to answer, two misses: within about 3 s.
    assert!(
        detected < Duration::from_secs(5),
        "noticed after {detected:?}"
    );
    let info = c.info().unwrap();
    let stages: Vec<(String, String)> = info
        .stages
        .iter()
        .map(|s| (s.worker_id.clone(), s.range.clone()))
        .collect();
    assert_eq!(
        stages,
        [("w0".to_string(), "embed + layers 0..4 + head".to_string())]
    );
    eprintln!(
        "SIGSTOP w1: noticed after {:.2} s, longest pause {:.2} s (with a 2 s rejoin timeout), identical tokens; w0 now runs every layer",
        detected.as_secs_f64(),
        stall.as_secs_f64()
    );
}
