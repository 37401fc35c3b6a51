//! End-to-end: MoE models whose routed experts run on an expert worker
//! (`omni-cpu-worker`), with two device workers running everything else,
//! all real processes talking over shared memory or gRPC.
//!
//! What a user would notice: the tokens are llama.cpp's, wherever the
//! experts run; the plan says where they run and why; keeping hot experts
//! on the device changes where work happens, not the tokens; and an expert
//! worker that dies ends the request with an error that names it.

use omni_proto::coordinator::v1::GenerateRequest;
use omni_tests::fixtures::{fixtures_dir, json};
use omni_tests::{greedy, ids, Cluster, ClusterSpec};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

/// One cluster at a time: the CI machine has two cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const FILES: [&str; 9] = [
    "qwen3moe-f32",
    "qwen3moe-q8_0",
    "qwen3moe-q4_k_m",
    "deepseek2-mla-f32",
    "deepseek2-mla-q8_0",
    "deepseek2-mla-q4_k_m",
    "deepseek2-legacy-f32",
    "deepseek2-legacy-q8_0",
    "deepseek2-legacy-q4_k_m",
];

fn file(name: &str) -> PathBuf {
    fixtures_dir().join(format!("synthetic/tiny-{name}.gguf"))
}

/// (prompt, llama.cpp's greedy ids) of every generation in the fixture.
fn generations(name: &str) -> Vec<(Vec<u32>, Vec<u32>)> {
    let fx = json(&format!("synthetic/ref_tiny-{name}.json"));
    fx["generations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            let prompt = omni_tests::fixtures::ids(&g["prompt_ids"]);
            let want = omni_tests::fixtures::greedy_ids_here(
                &file(name),
                &prompt,
                omni_tests::fixtures::ids(&g["generated_ids"]),
            );
            (prompt, want)
        })
        .collect()
}

/// Teacher-forced, through the cluster: for every prefix of the fixture's
/// 24 input ids, the top-5 log-probabilities of the next token equal
/// llama.cpp's (log-softmax of its full-vocabulary logits) within twice the
/// README's logit tolerance (a logprob is a logit less the log-sum-exp of
/// the row; each can be off by the tolerance). Returns the largest difference.
fn check_teacher_forced(c: &Cluster, name: &str) -> f32 {
    let fx = json(&format!("synthetic/ref_tiny-{name}.json"));
    let input = omni_tests::fixtures::ids(&fx["teacher_forced"]["input_ids"]);
    let (shape, logits) = omni_tests::fixtures::read_npy_f32(
        &fixtures_dir().join(format!("synthetic/tf_logits_tiny-{name}.npy")),
    );
    let n_vocab = shape[1];
    let tol = 2.0 * omni_tests::fixtures::logit_tolerance(name);
    let mut worst = 0f32;
    for i in 1..=input.len() {
        let row = &logits[(i - 1) * n_vocab..i * n_vocab];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
        let mut req = greedy(&input[..i], 1);
        req.logprobs = true;
        req.top_logprobs = 5;
        let ev = c
            .generate(req)
            .unwrap_or_else(|e| panic!("{name}: {e}\n{}", c.logs()));
        let tok = ev.iter().flat_map(|e| &e.tokens).next().expect("one token");
        assert_eq!(tok.top.len(), 5, "{name}: five alternatives");
        for t in &tok.top {
            let want = row[t.token as usize] - lse;
            let d = (t.logprob - want).abs();
            worst = worst.max(d);
            assert!(
                d <= tol,
                "{name}: position {}: token {} logprob {} vs llama.cpp {want} (tolerance {tol})",
                i - 1,
                t.token,
                t.logprob
            );
        }
    }
    worst
}

/// Layers of the model with routed experts.
fn moe_layers(path: &std::path::Path) -> Vec<u32> {
    let m = omni_engine::ModelFile::open(path).unwrap();
    (0..m.hparams.n_layer)
        .filter(|il| {
            m.gguf
                .tensor(&format!("blk.{il}.ffn_up_exps.weight"))
                .is_some()
        })
        .collect()
}

/// "1-3,5" -> [1, 2, 3, 5].
fn parse_layers(s: &str) -> Vec<u32> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .flat_map(|p| match p.split_once('-') {
            Some((a, b)) => (a.parse().unwrap()..=b.parse().unwrap()).collect::<Vec<u32>>(),
            None => vec![p.parse().unwrap()],
        })
        .collect()
}

/// Two device workers and one expert worker bound to NUMA node 0 (a
/// machine without NUMA nodes runs it unbound).
fn expert_spec(transport: &'static str, coordinator_args: &[&str]) -> ClusterSpec {
    let mut spec = ClusterSpec::new(2, transport);
    spec.cpu_workers = 1;
    spec.cpu_worker_args = vec![vec!["--numa-node".into(), "0".into()]];
    spec.coordinator_args = coordinator_args.iter().map(|s| s.to_string()).collect();
    spec
}

/// Where the stages' expert calls went adds up: each round trip is its
/// sending, transit, the worker's hand-off and its compute (graph
/// included), to the µs each part is counted in; over shared memory each
/// way's latency is part of the transit, over gRPC (two clocks, maybe on
/// two hosts) neither is counted.
fn check_call_parts(st: &[omni_proto::worker::v1::StatusReply], transport: &str) {
    let sum = |f: fn(&omni_proto::worker::v1::StatusReply) -> f64| st.iter().map(f).sum::<f64>();
    let calls = sum(|s| s.expert_calls as f64);
    assert!(calls > 0.0, "{st:?}");
    let round_trip = sum(|s| s.expert_round_trip_seconds);
    let parts = sum(|s| s.expert_send_seconds)
        + sum(|s| s.expert_transit_seconds)
        + sum(|s| s.expert_handoff_seconds)
        + sum(|s| s.expert_compute_seconds);
    // Each part is whole µs of each call: at most a few µs a call apart.
    assert!(
        (round_trip - parts).abs() <= calls * 4e-6,
        "round trips {round_trip} s against their parts {parts} s over {calls} calls"
    );
    let (pickup, delivery, transit) = (
        sum(|s| s.expert_pickup_seconds),
        sum(|s| s.expert_delivery_seconds),
        sum(|s| s.expert_transit_seconds),
    );
    assert!(sum(|s| s.expert_graph_seconds) <= sum(|s| s.expert_compute_seconds));
    if transport == "shm" {
        assert!(pickup > 0.0 && delivery > 0.0, "{st:?}");
        assert!(pickup + delivery <= transit + calls * 2e-6, "{st:?}");
    } else {
        assert_eq!((pickup, delivery), (0.0, 0.0), "{st:?}");
        assert!(transit > 0.0, "{st:?}");
    }
}

/// Every synthetic MoE model, split across two device workers with every
/// MoE layer's routed experts on the expert worker, over shared memory and
/// over gRPC: llama.cpp's greedy tokens for every fixture prompt and its
/// teacher-forced log-probabilities at every position, and the plan and
/// the wiring say where the experts run.
#[test]
fn experts_on_a_cpu_worker_give_llama_cpp_tokens_over_shm_and_grpc() {
    let _g = serial();
    for name in FILES {
        let path = file(name);
        let moe = moe_layers(&path);
        for transport in ["shm", "grpc"] {
            let c = Cluster::start(&path, &expert_spec(transport, &["--experts", "cpu"]));
            let info = c.info().unwrap();
            let offloaded: Vec<u32> = info
                .stages
                .iter()
                .flat_map(|s| parse_layers(&s.offloaded))
                .collect();
            assert_eq!(
                offloaded, moe,
                "{name}: every MoE layer's experts leave the stages"
            );
            assert_eq!(info.expert_workers.len(), 1);
            assert_eq!(info.expert_workers[0].worker_id, "c0");
            assert_eq!(parse_layers(&info.expert_workers[0].layers), moe);
            let binding = &info.expert_workers[0].binding;
            if std::path::Path::new("/sys/devices/system/node/node0").exists() {
                assert!(binding.starts_with("node 0 ("), "{binding}");
            } else {
                assert!(binding.starts_with("unbound ("), "{binding}");
            }
            for s in &info.stages {
                let want = usize::from(!s.offloaded.is_empty());
                assert_eq!(s.expert_transports.len(), want, "{name}: {s:?}");
                assert!(s.expert_transports.iter().all(|t| t == transport), "{s:?}");
            }
            assert!(
                info.plan.contains("c0"),
                "the plan names the expert worker:\n{}",
                info.plan
            );
            for (prompt, want) in generations(name) {
                let ev = c
                    .generate(greedy(&prompt, want.len()))
                    .unwrap_or_else(|e| panic!("{name}: {e}\n{}", c.logs()));
                assert_eq!(ids(&ev), want, "{name}, experts on c0 over {transport}");
            }
            let worst = check_teacher_forced(&c, name);
            let info = c.info().unwrap();
            assert!(info.expert_wait_samples > 0, "steps waited on c0");
            check_call_parts(&c.statuses(), transport);
            eprintln!(
                "{name}: experts on c0 over {transport}: llama.cpp's tokens, teacher-forced logprobs within {worst:.2e}; wait per step p50 {:.3} ms",
                info.expert_wait_ms_p50
            );
        }
    }
}

/// A request in flight when the expert worker is killed, and nobody
/// restarts it, ends within a bound with an error naming the expert worker
/// (recovery gives up after `--recovery-timeout`); the coordinator then
/// says why it cannot serve. (With a supervisor it recovers:
/// tests/tests/recovery.rs.)
#[test]
fn killing_the_cpu_worker_for_good_ends_the_stream_with_a_clear_error() {
    let _g = serial();
    let path = file("deepseek2-mla-f32");
    let (prompt, _) = generations("deepseek2-mla-f32").remove(0);
    for transport in ["shm", "grpc"] {
        let spec = expert_spec(transport, &["--experts", "cpu", "--recovery-timeout", "2"]);
        let mut c = Cluster::start(&path, &spec);
        let n = 1024 - prompt.len() - 1;
        let (msg, after) = c.kill_mid_stream(
            greedy(&prompt, n),
            |c| c.cpu_workers[0].kill9(),
            "c0",
            Duration::from_secs(60),
        );
        eprintln!(
            "expert worker killed ({transport}): the stream ended after {:.2}s with: {msg}",
            after.as_secs_f64()
        );
    }
}

/// `--gpu-experts 4`: after a few steps each stage keeps the 4 most used
/// experts of every offloaded layer (from the statistics it gathered), the
/// expert worker gets less work, and no token changes.
#[test]
fn gpu_experts_move_the_most_used_experts_to_the_stages_without_changing_tokens() {
    let _g = serial();
    for name in [
        "qwen3moe-f32",
        "deepseek2-mla-q8_0",
        "deepseek2-legacy-q4_k_m",
    ] {
        let path = file(name);
        let mut spec = expert_spec("shm", &["--experts", "cpu", "--gpu-experts", "4"]);
        spec.worker_args = vec![vec!["--expert-reselect-steps".into(), "4".into()]; 2];
        let c = Cluster::start(&path, &spec);
        let gens = generations(name);
        // First pass: the stages gather statistics and move experts as they go.
        for (prompt, want) in &gens {
            let ev = c
                .generate(greedy(prompt, want.len()))
                .unwrap_or_else(|e| panic!("{name}: {e}\n{}", c.logs()));
            assert_eq!(&ids(&ev), want, "{name}, first pass");
        }
        let st = c.statuses();
        let mut layers = 0;
        for s in &st {
            for u in &s.experts {
                layers += 1;
                assert_eq!(
                    u.on_device.len(),
                    4,
                    "{name}: layer {} keeps 4: {u:?}",
                    u.layer
                );
                // They are among the most used: none left out is used more
                // than the least used kept one by more than what came after
                // the last choice (statistics keep growing; 4 steps here).
                let least_kept = u
                    .on_device
                    .iter()
                    .map(|&e| u.counts[e as usize])
                    .min()
                    .unwrap();
                let most_left = (0..u.counts.len() as u32)
                    .filter(|e| !u.on_device.contains(e))
                    .map(|e| u.counts[e as usize])
                    .max()
                    .unwrap();
                assert!(
                    most_left <= least_kept + 4 * 24 * 8,
                    "{name}: layer {}: kept {:?} with counts {:?}",
                    u.layer,
                    u.on_device,
                    u.counts
                );
            }
        }
        assert_eq!(
            layers,
            moe_layers(&path).len(),
            "{name}: every offloaded layer reported"
        );
        // `omnictl plan --coordinator` shows them with the statistics.
        let out = std::process::Command::new(omni_tests::target_bin("omnictl"))
            .args(["plan", "--coordinator", &c.addr])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let u = &st[0].experts[0];
        assert!(
            text.contains("offloaded layers now") && text.contains(&format!("{:?}", u.on_device)),
            "{name}: omnictl plan shows layer {}'s device experts {:?}:\n{text}",
            u.layer,
            u.on_device
        );
        let sent_before: u64 = st.iter().map(|s| s.expert_bytes_sent).sum();
        let tokens_before: u64 = st[0].tokens;
        // Second pass: device experts from the first step on; same tokens.
        // The same work as the first (no prompt from the prefix cache), so
        // that the bytes per token compare.
        for (prompt, want) in &gens {
            let req = GenerateRequest {
                cache_prompt: Some(false),
                ..greedy(prompt, want.len())
            };
            let ev = c.generate(req).unwrap();
            assert_eq!(&ids(&ev), want, "{name}, second pass with device experts");
        }
        let st = c.statuses();
        let per_token_second = (st.iter().map(|s| s.expert_bytes_sent).sum::<u64>() - sent_before)
            as f64
            / (st[0].tokens - tokens_before) as f64;
        let per_token_first = sent_before as f64 / tokens_before as f64;
        eprintln!(
            "{name}: --gpu-experts 4: llama.cpp's tokens; bytes to c0 per token {per_token_first:.0} -> {per_token_second:.0}"
        );
        assert!(
            per_token_second <= per_token_first,
            "{name}: no more work reaches the expert worker ({per_token_first:.0} -> {per_token_second:.0} B/token)"
        );
    }
}

/// Devices too small for every layer with its experts: the coordinator's
/// plan keeps experts with their layers while they fit and sends the rest
/// to the expert worker, layer by layer, saying why; the tokens are
/// llama.cpp's. The memory offered is worked out from the file with the
/// same planner, so that one MoE layer's experts too many do not fit.
#[test]
fn experts_that_do_not_fit_go_to_the_cpu_worker_layer_by_layer() {
    use omni_planner::{plan_with_experts, ExpertPolicy, PlanConfig, WorkerSpec};
    let _g = serial();
    for name in ["deepseek2-mla-f32", "qwen3moe-q8_0"] {
        let path = file(name);
        let model = omni_engine::ModelFile::open(&path).unwrap();
        let cfg = PlanConfig {
            n_ctx: 256,
            n_seq: 1,
            n_ubatch: 64,
            experts: ExpertPolicy::Auto,
            ..PlanConfig::default()
        };
        let spec = |id: &str, bytes: u64| WorkerSpec {
            id: id.into(),
            device: "cpu".into(),
            free_bytes: bytes,
            total_bytes: bytes,
            read_rate: 0,
            pool: None,
        };
        let roomy = [spec("w0", 1 << 40), spec("w1", 1 << 40)];
        let whole = plan_with_experts(&model, &roomy, &[], &cfg).unwrap();
        let need = whole.stages.iter().map(|s| s.bytes.total).max().unwrap();
        let one_layer = model.expert_weight_bytes(moe_layers(&path)[0]);
        // Half a layer's experts short of what the fuller stage needs, before headroom.
        let offer = ((need - one_layer / 2) as f64 / (1.0 - cfg.headroom)) as u64;
        let tight = [spec("w0", offer), spec("w1", offer)];
        let expected = plan_with_experts(&model, &tight, &[spec("c0", 1 << 30)], &cfg).unwrap();
        let want_offloaded: Vec<Vec<u32>> = expected
            .stages
            .iter()
            .map(|s| s.offloaded.clone())
            .collect();
        let n_off: usize = want_offloaded.iter().map(Vec::len).sum();
        assert!(
            n_off > 0 && n_off < moe_layers(&path).len(),
            "{name}: the test wants some experts kept and some offloaded: {want_offloaded:?}"
        );

        let mut cs = expert_spec("shm", &["--ubatch", "64"]);
        cs.ctx = 256;
        cs.seqs = 1;
        cs.worker_args = vec![vec!["--memory".into(), format!("{offer}B")]; 2];
        cs.cpu_worker_args[0].extend(["--memory".into(), "1GiB".into()]);
        let c = Cluster::start(&path, &cs);
        let info = c.info().unwrap();
        let got: Vec<Vec<u32>> = info
            .stages
            .iter()
            .map(|s| parse_layers(&s.offloaded))
            .collect();
        assert_eq!(
            got, want_offloaded,
            "{name}: the plan the coordinator made\n{}",
            info.plan
        );
        assert!(
            info.plan.contains("go to c0: with them stage"),
            "{name}: the plan says why:\n{}",
            info.plan
        );
        for (prompt, want) in generations(name) {
            let ev = c
                .generate(greedy(&prompt, want.len()))
                .unwrap_or_else(|e| panic!("{name}: {e}\n{}", c.logs()));
            assert_eq!(ids(&ev), want, "{name}, experts partly on c0");
        }
        eprintln!("{name}: offered {offer} B per device: offloaded {got:?}; llama.cpp's tokens");
    }
}

/// `--expert-overlap on`: a step of several sequences runs as two
/// micro-batch groups, the stage computing one group's layers while the
/// expert worker computes the other's experts. What a user notices: every
/// stream gets the tokens it gets alone (in one process, every expert in
/// the stage), and the worker counts the steps that overlapped; with
/// `shared` (the stage computes only its shared experts meanwhile) and
/// `off` (the stage computes them before handing the routed ones over),
/// none do, and the tokens are the same.
#[test]
fn overlapped_steps_give_every_stream_its_tokens_alone() {
    let _g = serial();
    for name in ["deepseek2-mla-q8_0", "qwen3moe-q8_0"] {
        let path = file(name);
        // Three streams: decode steps of 3 rows, cut 1 + 2.
        let prompts: Vec<Vec<u32>> = generations(name)
            .into_iter()
            .map(|(p, _)| p)
            .cycle()
            .take(3)
            .enumerate()
            .map(|(i, mut p)| {
                p.truncate(p.len() - i);
                p
            })
            .collect();
        let alone = omni_tests::engine_tokens(&path, &prompts, 16);
        for overlap in ["on", "shared", "off"] {
            let mut spec = expert_spec("shm", &["--experts", "cpu"]);
            spec.stages = 1;
            spec.worker_args = vec![vec!["--expert-overlap".into(), overlap.into()]];
            let c = Cluster::start(&path, &spec);
            let reqs = prompts.iter().map(|p| greedy(p, 16)).collect();
            let results = omni_tests::start_streams(&c.addr, reqs)
                .handle
                .join()
                .unwrap();
            omni_tests::same_tokens(
                &results,
                &alone,
                &format!("{name}, --expert-overlap {overlap}"),
            );
            let overlapped = c.statuses()[0].overlapped_steps;
            match overlap {
                "on" => assert!(overlapped > 0, "{name}: no step overlapped"),
                _ => assert_eq!(overlapped, 0, "{name}"),
            }
        }
    }
}
