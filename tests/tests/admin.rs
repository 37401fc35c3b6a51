//! End-to-end: the coordinator's admin API (`omni.admin.v1`) and the
//! `omnictl` verbs on it, against a real cluster (two device workers and an
//! expert worker serving the tiny deepseek2).
//!
//! What an operator would notice: admin calls without the right token are
//! refused, and the admin API is not on the inference listener; `omnictl
//! workers` shows every worker with its memory, layers, KV cache, step time
//! and health; `omnictl plan --admin` shows the running plan, and a dry run
//! of another split shows its arithmetic without moving anything.

use omni_proto::admin::v1::{admin_client::AdminClient, ListWorkersRequest};
use omni_proto::coordinator::v1::{inference_client::InferenceClient, InfoRequest};
use omni_tests::fixtures::fixtures_dir;
use omni_tests::{Cluster, ClusterSpec};

const TOKEN: &str = "adm-7f3e";

/// One cluster test at a time: the CI machine has two cores.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn model() -> std::path::PathBuf {
    fixtures_dir().join("synthetic/tiny-deepseek2-mla-q8_0.gguf")
}

fn cluster(token: Option<&str>) -> Cluster {
    let mut spec = ClusterSpec::new(2, "shm");
    // Equal offers, so the split is 2,2 whatever else the machine runs (each
    // worker otherwise offers the host's free memory at its start, and
    // llama.cpp's proportional rule gives w0 3 of 4 layers when it saw a
    // byte more than w1).
    spec.worker_args = vec![vec!["--memory".into(), "4GiB".into()]; 2];
    spec.cpu_workers = 1;
    spec.coordinator_args = vec!["--experts".into(), "cpu".into()];
    if let Some(t) = token {
        spec.coordinator_args
            .extend(["--admin-token".into(), t.into()]);
    }
    Cluster::start(&model(), &spec)
}

/// `omnictl ARGS` with the admin address; (success, stdout, stderr).
fn omnictl(c: &Cluster, token: Option<&str>, args: &[&str]) -> (bool, String, String) {
    omni_tests::omnictl_admin(&c.admin_addr, token, args)
}

#[test]
fn admin_api_needs_its_token_and_lives_on_its_own_listener() {
    let _g = serial();
    let c = cluster(Some(TOKEN));
    // Refused, saying what to set (or where the wrong token came from).
    for (token, why) in [
        (
            None,
            "wants a token and none was found: set OMNI_ADMIN_TOKEN or pass --token-file",
        ),
        (
            Some("nope"),
            "refused the token from OMNI_ADMIN_TOKEN: wrong admin token",
        ),
    ] {
        let (ok, _, err) = omnictl(&c, token, &["workers"]);
        assert!(!ok, "refused without the right token");
        assert!(err.contains(why), "{err}");
    }
    // The admin service is not on the inference port, nor inference on the admin port.
    c.rt.block_on(async {
        let mut a = AdminClient::connect(format!("http://{}", c.addr))
            .await
            .unwrap();
        let e = a.list_workers(ListWorkersRequest {}).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");
        let mut i = InferenceClient::connect(format!("http://{}", c.admin_addr))
            .await
            .unwrap();
        let e = i.info(InfoRequest {}).await.unwrap_err();
        assert_ne!(e.code(), tonic::Code::Ok);
    });
    // A coordinator without a token refuses everything, even a guess.
    let open = cluster(None);
    let (ok, _, err) = omnictl(&open, Some(""), &["workers"]);
    assert!(!ok && err.contains("no admin token"), "{err}");
    let (ok, _, err) = omnictl(&open, Some("anything"), &["plan"]);
    assert!(!ok && err.contains("no admin token"), "{err}");
}

#[test]
fn workers_and_plan_show_the_cluster_and_a_dry_run_moves_nothing() {
    let _g = serial();
    let c = cluster(Some(TOKEN));
    let prompt: Vec<u32> = (1..20).collect();
    c.generate(omni_tests::greedy(&prompt, 8)).unwrap();
    let info = c.info().unwrap();

    let (ok, out, err) = omnictl(&c, Some(TOKEN), &["workers", "--json"]);
    assert!(ok, "{err}");
    let ws: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let ids: Vec<&str> = ws.iter().map(|w| w["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["w0", "w1", "c0"]);
    for (w, s) in ws.iter().zip(&info.stages) {
        assert_eq!(w["kind"], "stage");
        assert_eq!(w["layers"], s.range.as_str(), "the planned range");
        assert_eq!(w["health"], "serving");
        assert!(w["memory_total"].as_u64().unwrap() >= w["memory_free"].as_u64().unwrap());
        assert_eq!(
            w["memory_planned"].as_u64().unwrap(),
            s.weight_bytes + s.kv_bytes + s.compute_bytes
        );
        assert!(w["kv_cells_total"].as_u64().unwrap() > 0);
        assert!(
            w["steps"].as_u64().unwrap() > 0,
            "the request ran through it: {w}"
        );
        assert!(w["last_step_ms"].as_f64().unwrap() > 0.0);
    }
    // Every worker says which ggml CPU variant it computes with: the one
    // this machine's best choice is (the test process makes the same one).
    let cpu = omni_engine::cpu_backend(None).expect("a CPU backend");
    for w in &ws {
        assert_eq!(w["cpu_variant"], cpu.variant.as_str(), "{w}");
        let features: Vec<&str> = w["cpu_features"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap())
            .collect();
        assert_eq!(features, cpu.features, "{w}");
    }
    let c0 = &ws[2];
    assert_eq!(c0["kind"], "experts");
    assert_eq!(c0["layers"], info.expert_workers[0].layers.as_str());
    assert_eq!(
        c0["memory_planned"].as_u64().unwrap(),
        info.expert_workers[0].weight_bytes + info.expert_workers[0].compute_bytes
    );

    let (ok, table, err) = omnictl(&c, Some(TOKEN), &["workers"]);
    assert!(ok, "{err}");
    for w in ["w0", "w1", "c0"] {
        assert!(
            table.lines().any(|l| l.starts_with(w)
                && l.ends_with("serving")
                && l.split_whitespace().any(|c| c == cpu.variant)),
            "{table}"
        );
    }

    // `omnictl top --once`: one frame of the live view, layers as bars.
    let (ok, top, err) = omnictl(&c, Some(TOKEN), &["top", "--once", "--interval", "0.2"]);
    assert!(ok, "{err}");
    assert!(
        top.starts_with("omni: ") && top.contains("| 4 layers |"),
        "{top}"
    );
    let bar = |id: &str| {
        top.lines()
            .find(|l| l.starts_with(id))
            .and_then(|l| l.split_whitespace().find(|w| w.contains('█')))
            .unwrap_or_else(|| panic!("{id} has a layer bar:\n{top}"))
            .to_string()
    };
    // embed + layers 0-1 | layers 2-3 + head | the experts of 1-3.
    assert_eq!(bar("w0"), "██··", "{top}");
    assert_eq!(bar("w1"), "··██", "{top}");
    assert_eq!(bar("c0"), "·███", "{top}");
    // Each stage's busy fraction over the interval (the expert worker has
    // no stage timeline).
    let busy = |id: &str| {
        top.lines()
            .find(|l| l.starts_with(id))
            .is_some_and(|l| l.split_whitespace().any(|c| c.ends_with('%')))
    };
    assert!(busy("w0") && busy("w1") && !busy("c0"), "{top}");

    let (ok, plan, err) = omnictl(&c, Some(TOKEN), &["plan"]);
    assert!(ok, "{err}");
    assert_eq!(
        plan, info.plan,
        "the running plan, as the coordinator made it"
    );
    // The stage workers timed their weight reads when they started (the
    // expert worker does not); the plan gives each stage's time at those rates.
    for w in &ws[..2] {
        assert!(w["weight_read_rate"].as_f64().unwrap() > 1e8, "{w}");
    }
    assert_eq!(ws[2]["weight_read_rate"].as_f64(), Some(0.0), "{}", ws[2]);
    assert!(
        plan.contains("at the workers' read rates")
            && plan.contains("stage 1 ")
            && plan.contains("GB/s"),
        "{plan}"
    );
    assert!(
        table.lines().filter(|l| l.contains("GB/s")).count() == 2,
        "{table}"
    );

    // A dry run of another split: its own arithmetic, nothing moves.
    let (ok, dry, err) = omnictl(&c, Some(TOKEN), &["plan", "--counts", "1,3", "--json"]);
    assert!(ok, "{err}");
    let p: serde_json::Value = serde_json::from_str(&dry).unwrap();
    let ranges: Vec<(u64, u64)> = p["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let l = &s["range"]["layers"];
            (l["start"].as_u64().unwrap(), l["end"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(ranges, [(0, 1), (1, 4)], "{dry}");
    let (ok, _, err) = omnictl(&c, Some(TOKEN), &["plan", "--counts", "4,0"]);
    assert!(
        !ok && err.contains("--counts 4,0") && err.contains("no layers"),
        "an impossible split is refused: {err}"
    );
    let (ok, again, _) = omnictl(&c, Some(TOKEN), &["plan"]);
    assert!(ok);
    assert_eq!(again, info.plan, "the dry runs moved nothing");

    // A lost worker shows as lost.
    let mut c = c;
    c.workers[1].kill9();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let (ok, out, _) = omnictl(&c, Some(TOKEN), &["workers", "--json"]);
        assert!(ok);
        let ws: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
        let h = ws[1]["health"].as_str().unwrap().to_string();
        if h != "serving" {
            assert!(h.starts_with("lost") || h.starts_with("no answer"), "{h}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "w1 still 'serving'");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}
