//! End-to-end: moving layers between workers while the cluster serves
//! (`omnictl rebalance`, `drain`, `undrain` on the admin API), with real
//! processes serving Gemma 3 270M.
//!
//! What a user would notice: streams that run through the moves finish
//! without an error and with exactly the tokens they get without moves
//! (greedy, and a seeded sampled stream whose sampler moves with the head);
//! afterwards the cluster runs the split that was asked for, and the
//! workers that gave layers away hold less memory. A move that cannot fit
//! or makes no sense is refused up front, naming the problem, and nothing
//! changes.
//!
//! The clusters are deterministic (`--deterministic on`): the streams share
//! steps, and a stream's tokens depend neither on how the others were
//! batched with it nor on where the moves put its layers and cells, so
//! they are compared exactly with each stream alone.

use omni_proto::coordinator::v1::GenerateRequest;
use omni_proto::worker::v1::grammar::{JsonObject, Kind};
use omni_proto::worker::v1::Sampling;
use omni_tests::fixtures::{model, GEMMA};
use omni_tests::{greedy, ids, same_tokens, start_streams, target_bin, Cluster, ClusterSpec};
use serde_json::Value;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Duration;

const TOKEN: &str = "move-4c1d";
const N_GEN: usize = 64;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn prompts(n: usize) -> Vec<Vec<u32>> {
    omni_tests::short_prompts("real_gemma3_270m.json", n)
}

/// 3 deterministic workers over shared memory (layers 7,5,6).
fn cluster(worker_args: Vec<Vec<String>>) -> Cluster {
    let mut spec = ClusterSpec::new(3, "shm");
    spec.ctx = 512;
    spec.seqs = 4;
    spec.worker_args = worker_args;
    spec.coordinator_args = vec![
        "--admin-token".into(),
        TOKEN.into(),
        "--counts".into(),
        "7,5,6".into(),
        "--deterministic".into(),
        "on".into(),
    ];
    Cluster::start(&model(GEMMA), &spec)
}

/// `omnictl ARGS --admin ..` with the token: (success, stdout, stderr).
fn omnictl(c: &Cluster, args: &[&str]) -> (bool, String, String) {
    omni_tests::omnictl_admin(&c.admin_addr, Some(TOKEN), args)
}

/// A move that must succeed; its JSON reply.
fn move_ok(c: &Cluster, args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.push("--json");
    let (ok, out, err) = omnictl(c, &a);
    assert!(ok, "omnictl {args:?} failed: {err}\n{}", c.logs());
    let v: Value = serde_json::from_str(&out).unwrap();
    eprintln!(
        "omnictl {}: {} (prepared {:.3}s, paused {:.1} ms, {} KV bytes)",
        args.join(" "),
        v["moves"],
        v["prepare_seconds"].as_f64().unwrap(),
        v["pause_seconds"].as_f64().unwrap() * 1e3,
        v["kv_bytes"]
    );
    v
}

/// `omnictl workers --json`.
fn workers(c: &Cluster) -> Vec<Value> {
    let (ok, out, err) = omnictl(c, &["workers", "--json"]);
    assert!(ok, "{err}");
    serde_json::from_str::<Value>(&out)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

fn worker<'a>(ws: &'a [Value], id: &str) -> &'a Value {
    ws.iter().find(|w| w["id"] == id).unwrap()
}

/// Each serving stage's (worker, layer count), in pipeline order, from the plan.
fn split_of(plan: &Value) -> Vec<(String, u64)> {
    plan["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let r = &s["range"]["layers"];
            (
                s["worker"].as_str().unwrap().to_string(),
                r["end"].as_u64().unwrap() - r["start"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn seeded(prompt: &[u32]) -> GenerateRequest {
    GenerateRequest {
        sampling: Some(Sampling {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            seed: Some(1234),
            repeat_penalty: 1.1,
            repeat_last_n: 64,
            ..Default::default()
        }),
        ..greedy(prompt, N_GEN)
    }
}

#[test]
fn layers_move_forward_and_back_under_four_streams_without_changing_a_token() {
    let _g = serial();
    let c = cluster(Vec::new());
    let reqs: Vec<GenerateRequest> = prompts(4).iter().map(|p| greedy(p, N_GEN)).collect();
    assert_eq!(reqs.len(), 4);
    // The run without moves.
    let alone: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| ids(&c.generate(r.clone()).unwrap()))
        .collect();

    let start = split_of(&serde_json::from_str(&plan_json(&c)).unwrap());
    assert_eq!(start.len(), 3);
    let before = workers(&c);
    let streams = start_streams(&c.addr, reqs);
    streams.wait_for(8);
    // Forward (w0's last two layers to w1), forward again (w1's last two to
    // w2), back (w2's first three to w1), back again (w1's first four to w0).
    let (a, b) = (start[0].1 as u32, (start[0].1 + start[1].1) as u32);
    let moves = [
        (format!("{}-{}", a - 2, a - 1), "w1"),
        (format!("{}-{}", b - 2, b - 1), "w2"),
        (format!("{}-{}", b - 2, b), "w1"),
        (format!("{}-{}", a - 2, a + 1), "w0"),
    ];
    let mut used = worker_memory(&before);
    let mut replies = Vec::new();
    for (layers, to) in &moves {
        let v = move_ok(&c, &["rebalance", "--layers", layers, "--to", to]);
        assert_eq!(v["unchanged"], false);
        assert!(
            v["kv_bytes"].as_u64().unwrap() > 0,
            "KV cache was handed over"
        );
        // Whoever only gave layers away holds less memory now.
        let now = worker_memory(&workers(&c));
        for m in v["moves"].as_array().unwrap() {
            let m = m.as_str().unwrap();
            let id = m.split(':').next().unwrap();
            if *to != id {
                assert!(
                    now[id] < used[id],
                    "{id} gave layers away ({m}) but holds {} bytes, {} before",
                    now[id],
                    used[id]
                );
            }
        }
        used = now;
        replies.push(v);
    }
    let at_last_move = streams.progress.load(Ordering::Relaxed);
    let results = streams.handle.join().unwrap();
    assert!(
        at_last_move < 4 * N_GEN,
        "the moves ended after the streams ({at_last_move} tokens)"
    );
    same_tokens(&results, &alone, "the moves");
    // The plan is what was asked: w0 back to its start, w1 one layer fewer...
    let want = vec![
        ("w0".to_string(), start[0].1 + 2),
        ("w1".to_string(), start[1].1 - 1),
        ("w2".to_string(), start[2].1 - 1),
    ];
    let last_plan = &replies.last().unwrap()["plan"];
    assert_eq!(split_of(last_plan), want);
    assert_eq!(
        split_of(&serde_json::from_str(&plan_json(&c)).unwrap()),
        want
    );
    let ws = workers(&c);
    let mut first = 0;
    for (id, n) in &want {
        let w = worker(&ws, id);
        assert_eq!(w["layer_start"].as_u64().unwrap(), first, "{w}");
        assert_eq!(w["layer_end"].as_u64().unwrap(), first + n, "{w}");
        first += n;
    }
    // And it serves new requests the same way.
    let again = ids(&c.generate(greedy(&prompts(1)[0], N_GEN)).unwrap());
    assert_eq!(again, alone[0]);
    // A new split by counts: the same call moves every boundary at once.
    let v = move_ok(&c, &["rebalance", "--counts", "6,6,6"]);
    assert_eq!(
        split_of(&v["plan"]),
        vec![("w0".into(), 6), ("w1".into(), 6), ("w2".into(), 6)]
    );
    let v = move_ok(&c, &["rebalance", "--counts", "6,6,6"]);
    assert_eq!(v["unchanged"], true);
}

#[test]
fn draining_a_worker_under_load_keeps_every_stream_and_undrain_brings_it_back() {
    let _g = serial();
    let c = cluster(Vec::new());
    let ps = prompts(4);
    // First a stream sampled with a seed beside three greedy ones: the
    // head moves to w1 and back, and with it the sampler (random stream,
    // penalty history); each stream gets what it gets alone.
    let sampled = seeded(&ps[3]);
    let mixed: Vec<GenerateRequest> = ps[..3]
        .iter()
        .map(|p| greedy(p, N_GEN))
        .chain([sampled])
        .collect();
    let want: Vec<Vec<u32>> = mixed
        .iter()
        .map(|r| ids(&c.generate(r.clone()).unwrap()))
        .collect();
    let stream = start_streams(&c.addr, mixed);
    stream.wait_for(8);
    move_ok(&c, &["drain", "w2"]);
    move_ok(&c, &["undrain", "w2"]);
    let at_move = stream.progress.load(Ordering::Relaxed);
    same_tokens(&stream.handle.join().unwrap(), &want, "the head's moves");
    assert!(at_move < 4 * N_GEN, "the moves ended after the streams");
    // The same with a grammar (any JSON object): its state moves with the
    // head too, fed the sequence's history again where it lands.
    let mut constrained = seeded(&ps[2]);
    if let Some(s) = constrained.sampling.as_mut() {
        s.grammar = Some(omni_proto::worker::v1::Grammar {
            kind: Some(Kind::JsonObject(JsonObject {})),
        });
    }
    let want = ids(&c.generate(constrained.clone()).unwrap());
    let tok = omni_engine::tokenizer::Tokenizer::load(&model(GEMMA)).unwrap();
    let text = tok.decode(&want);
    assert!(text.trim_start().starts_with('{'), "not JSON: {text:?}");
    let stream = start_streams(&c.addr, vec![constrained]);
    stream.wait_for(8);
    move_ok(&c, &["drain", "w2"]);
    move_ok(&c, &["undrain", "w2"]);
    let at_move = stream.progress.load(Ordering::Relaxed);
    same_tokens(&stream.handle.join().unwrap(), &[want], "the head's moves");
    assert!(
        at_move < N_GEN,
        "the moves ended after the constrained stream"
    );

    // Then four greedy streams.
    let reqs: Vec<GenerateRequest> = ps.iter().map(|p| greedy(p, N_GEN)).collect();
    let alone: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| ids(&c.generate(r.clone()).unwrap()))
        .collect();
    let before = worker_memory(&workers(&c));

    let streams = start_streams(&c.addr, reqs.clone());
    streams.wait_for(8);
    let v = move_ok(&c, &["drain", "w2"]);
    let plan = split_of(&v["plan"]);
    assert_eq!(
        plan.iter().map(|s| s.0.as_str()).collect::<Vec<_>>(),
        ["w0", "w1"]
    );
    let ws = workers(&c);
    assert_eq!(worker(&ws, "w2")["drained"], true);
    assert_eq!(worker(&ws, "w2")["health"], "drained");
    let freed = worker_memory(&ws);
    assert!(
        freed["w2"] < before["w2"] / 10,
        "the drained w2 still holds {} of its {} bytes",
        freed["w2"],
        before["w2"]
    );
    let at_drain = streams.progress.load(Ordering::Relaxed);
    let results = streams.handle.join().unwrap();
    assert!(at_drain < 4 * N_GEN, "the drain ended after the streams");
    same_tokens(&results, &alone, "the drain");
    let info = c.info().unwrap();
    assert_eq!(info.stages.len(), 2, "{:?}", info.stages);

    // Draining the first worker as well moves the embedding to w1.
    let streams = start_streams(&c.addr, reqs.clone());
    streams.wait_for(8);
    let v = move_ok(&c, &["drain", "w0"]);
    assert_eq!(split_of(&v["plan"]), vec![("w1".to_string(), 18)]);
    let (ok, _, err) = omnictl(&c, &["drain", "w1"]);
    assert!(!ok && err.contains("only serving worker"), "{err}");
    // Back to three, under load again.
    let v = move_ok(&c, &["undrain", "w2"]);
    assert_eq!(split_of(&v["plan"]).len(), 2);
    let v = move_ok(&c, &["undrain", "w0"]);
    assert_eq!(
        split_of(&v["plan"])
            .iter()
            .map(|s| s.0.as_str())
            .collect::<Vec<_>>(),
        ["w0", "w1", "w2"]
    );
    let results = streams.handle.join().unwrap();
    same_tokens(&results, &alone, "drains");
    let ws = workers(&c);
    assert!(ws.iter().all(|w| w["health"] == "serving"), "{ws:?}");
    let (ok, _, err) = omnictl(&c, &["undrain", "w0"]);
    assert!(!ok && err.contains("not drained"), "{err}");
    // A drained worker can be stopped: the cluster serves on without it.
    move_ok(&c, &["drain", "w1"]);
    let mut c = c;
    c.workers[1].kill9();
    std::thread::sleep(Duration::from_secs(3));
    let again = ids(&c.generate(reqs[0].clone()).unwrap());
    assert_eq!(again, alone[0]);
    let ws = workers(&c);
    let h = worker(&ws, "w1")["health"].as_str().unwrap().to_string();
    assert!(h.starts_with("lost (drained)"), "{h}");
    let (ok, _, err) = omnictl(&c, &["undrain", "w1"]);
    assert!(!ok && err.contains("nothing changed"), "{err}");
    assert_eq!(ids(&c.generate(reqs[1].clone()).unwrap()), alone[1]);
}

#[test]
fn moves_that_cannot_work_are_refused_up_front_and_nothing_changes() {
    let _g = serial();
    // w1 is offered 120 MiB: room for its 5 layers (about 50 MiB with the
    // compute buffer) and for 8 (about 70), not for both at once, nor for 16.
    let c = cluster(vec![
        Vec::new(),
        vec!["--memory".into(), "120MiB".into()],
        Vec::new(),
    ]);
    let plan = plan_json(&c);
    let s = split_of(&serde_json::from_str(&plan).unwrap());
    let a = s[0].1;
    let bad = |args: &[&str], why: &str| {
        let (ok, _, err) = omnictl(&c, args);
        assert!(!ok, "omnictl {args:?} should be refused");
        assert!(err.contains(why), "omnictl {args:?}: {err}");
    };
    bad(
        &[
            "rebalance",
            "--layers",
            &format!("0-{}", a - 2),
            "--to",
            "w1",
        ],
        "not next to w1",
    );
    bad(
        &[
            "rebalance",
            "--layers",
            &format!("{}-{}", a - 3, a - 1),
            "--to",
            "w1",
        ],
        "holds its old and its new stage at once",
    );
    bad(&["rebalance", "--counts", "1,16,1"], "w1");
    bad(&["rebalance", "--counts", "9,9"], "refused");
    bad(&["drain", "w9"], "no stage worker 'w9'");
    let (ok, _, err) = Command::new(target_bin("omnictl"))
        .args(["drain", "w1", "--admin", &c.admin_addr])
        .env("OMNI_ADMIN_TOKEN", "wrong")
        .output()
        .map(|o| {
            (
                o.status.success(),
                (),
                String::from_utf8_lossy(&o.stderr).into_owned(),
            )
        })
        .unwrap();
    assert!(
        !ok && err.contains("wrong admin token") && err.contains("OMNI_ADMIN_TOKEN"),
        "{err}"
    );
    // Nothing moved, and it serves.
    assert_eq!(plan_json(&c), plan);
    let p = &prompts(1)[0];
    assert_eq!(ids(&c.generate(greedy(p, 8)).unwrap()).len(), 8);
}

fn plan_json(c: &Cluster) -> String {
    let (ok, out, err) = omnictl(c, &["plan", "--json"]);
    assert!(ok, "{err}");
    out
}

/// Each stage worker's `memory_used` by id.
fn worker_memory(ws: &[Value]) -> std::collections::HashMap<String, u64> {
    ws.iter()
        .filter(|w| w["kind"] == "stage")
        .map(|w| {
            (
                w["id"].as_str().unwrap().to_string(),
                w["memory_used"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn moe_layers_move_with_their_routes_to_the_expert_worker() {
    let _g = serial();
    let mut spec = ClusterSpec::new(2, "shm");
    spec.cpu_workers = 1;
    spec.coordinator_args = [
        "--admin-token",
        TOKEN,
        "--experts",
        "cpu",
        "--counts",
        "2,2",
        "--deterministic",
        "on",
    ]
    .map(String::from)
    .to_vec();
    let model = omni_tests::fixtures::fixtures_dir().join("synthetic/tiny-deepseek2-mla-q8_0.gguf");
    let c = Cluster::start(&model, &spec);
    // Layer 0 is dense, 1-3 are MoE with their routed experts on c0:
    // w0 runs 0-1 (sends layer 1's experts to c0), w1 runs 2-3 (the split
    // is given: the automatic one follows the memory each worker found free).
    let offloaded = |c: &Cluster| -> Vec<String> {
        c.info()
            .unwrap()
            .stages
            .iter()
            .map(|s| s.offloaded.clone())
            .collect()
    };
    assert_eq!(offloaded(&c), ["1", "2-3"]);
    const N: usize = 800;
    // Three streams (this random-weight model is full of near ties: only a
    // deterministic cluster gives them their tokens alone).
    let reqs = vec![
        greedy(&[1, 17, 42, 99, 5], N),
        greedy(&[1, 3, 5, 7], N),
        greedy(&[1, 200, 33], N),
    ];
    let alone: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| ids(&c.generate(r.clone()).unwrap()))
        .collect();
    let streams = start_streams(&c.addr, reqs);
    streams.wait_for(4);
    // Layer 1 to w1, which now calls c0 for it; then layers 1-2 to w0
    // (written 1..3, the half-open form, read as the same range).
    move_ok(&c, &["rebalance", "--layers", "1", "--to", "w1"]);
    assert_eq!(offloaded(&c), ["", "1-3"]);
    move_ok(&c, &["rebalance", "--layers", "1..3", "--to", "w0"]);
    assert_eq!(offloaded(&c), ["1-2", "3"]);
    let at_last_move = streams.progress.load(Ordering::Relaxed);
    let results = streams.handle.join().unwrap();
    assert!(at_last_move < 3 * N, "the moves ended after the streams");
    same_tokens(&results, &alone, "the moves");
    let info = c.info().unwrap();
    assert!(
        info.stages.iter().all(|s| s.expert_transports == ["shm"]),
        "{:?}",
        info.stages
    );
}
