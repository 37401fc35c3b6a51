//! End-to-end (issue 41): a cluster across two hosts with mutual TLS on
//! every connection. Hosts are network namespaces joined by a veth link
//! limited to 1 Gbit/s (`omni_tests::hosts`), each process with a
//! `/dev/shm` of its own, so stage to stage goes over the TLS gRPC stream
//! as between machines. Gemma 3 270M: the coordinator and w0 on host A, w1
//! on host B, the router and this test in the root namespace.
//!
//! - The split gives the tokens of the model in one process (greedy).
//! - Peers without the cluster's credentials are refused, with the reason
//!   said on both sides: no TLS, no certificate, another cluster's
//!   certificate, a wrong CA.
//! - The A-B link cut silently mid-stream: the coordinator notices w1 gone
//!   (keepalive and health checks, no TCP reset), plans again over w0 and
//!   replays; the stream completes with the undisturbed text.

use omni_proto::coordinator::v1::{inference_client::InferenceClient, InfoRequest};
use omni_tests::fixtures::{model, GEMMA};
use omni_tests::hosts::Hosts;
use omni_tests::{
    collect, engine_tokens, greedy, ids, short_prompts, start_router, target_bin, Proc,
};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// `omnictl certs --out DIR --names NAMES`.
fn certs(dir: &Path, names: &str) {
    let out = Command::new(target_bin("omnictl"))
        .args(["certs", "--out"])
        .arg(dir)
        .args(["--names", names])
        .output()
        .expect("omnictl certs");
    assert!(
        out.status.success(),
        "omnictl certs failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The TLS flags of process `name` with the certificates in `dir`, trusting
/// the CA in `ca_dir`.
fn tls(ca_dir: &Path, dir: &Path, name: &str) -> Vec<String> {
    let p = |f: PathBuf| f.display().to_string();
    vec![
        "--tls-ca".into(),
        p(ca_dir.join("ca.pem")),
        "--tls-cert".into(),
        p(dir.join(format!("{name}.pem"))),
        "--tls-key".into(),
        p(dir.join(format!("{name}.key"))),
    ]
}

struct TwoHosts {
    hosts: Hosts,
    /// Whether the processes speak mutual TLS.
    tls: bool,
    /// The coordinator's address as host A's processes and host B's reach it.
    coord: String,
    /// The same from the root namespace.
    coord_from_root: String,
    coordinator: Proc,
    w0: Proc,
    w1: Proc,
    pki: PathBuf,
    dir: tempfile::TempDir,
    rt: tokio::runtime::Runtime,
    /// With latency: the proxies every A-B connection goes through.
    _proxies: Vec<omni_tests::hosts::DelayProxy>,
}

impl TwoHosts {
    /// The cluster on two hosts, mutual TLS between every process when
    /// `tls` (this test process joins it then, so a later cluster of this
    /// process must have TLS too).
    /// With `latency`, every connection between A and B goes through a
    /// [`DelayProxy`](omni_tests::hosts::DelayProxy) holding its bytes that
    /// long each way: w1 and the coordinator advertise the proxies in
    /// host B, so w0's hidden states (A to B), w1's output (B to A) and the
    /// coordinator's calls to w1 all wait.
    fn start(tls_on: bool, coordinator_args: &[&str], latency: Option<Duration>) -> TwoHosts {
        let dir = tempfile::tempdir().unwrap();
        // One CA for every cluster of this test process: it joins the first
        // with TLS, once (the install is process-wide), and the later ones
        // with the same certificate.
        static PKI: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
        let pki = PKI
            .get_or_init(|| {
                let d = tempfile::tempdir().unwrap();
                certs(d.path(), "coordinator,router,w0,w1,omnictl");
                d
            })
            .path()
            .to_path_buf();
        if tls_on {
            // This test process is a member of the cluster too (it asks the
            // coordinator directly), with omnictl's certificate.
            omni_transport::tls::install(&omni_transport::tls::TlsArgs {
                tls_ca: Some(pki.join("ca.pem")),
                tls_cert: Some(pki.join("omnictl.pem")),
                tls_key: Some(pki.join("omnictl.key")),
            })
            .expect("the test's TLS");
        }
        let tls = |name: &str| {
            if tls_on {
                tls(&pki, &pki, name)
            } else {
                Vec::new()
            }
        };
        let hosts = Hosts::make();
        hosts.limit("1gbit");
        let port = omni_tests::free_port();
        let coord = format!("{}:{port}", hosts.a_addr());
        let coord_from_root = format!("{}:{port}", hosts.a_from_root());
        // Ports in host B (its own port space): w1's, the proxy before it,
        // the proxy before the coordinator.
        let (w1_port, w1_proxy, coord_proxy) = (7101, 7102, 7103);
        let mut proxies = Vec::new();
        let (coord_advertised, w1_listen, w1_advertised) = match latency {
            Some(d) => {
                let b = hosts.b_addr();
                proxies.push(hosts.delay_proxy(
                    &hosts.b,
                    &format!("{b}:{w1_proxy}"),
                    &format!("{b}:{w1_port}"),
                    d,
                ));
                proxies.push(hosts.delay_proxy(&hosts.b, &format!("{b}:{coord_proxy}"), &coord, d));
                (
                    format!("{b}:{coord_proxy}"),
                    format!("{b}:{w1_port}"),
                    Some(format!("{b}:{w1_proxy}")),
                )
            }
            None => (coord.clone(), format!("{}:0", hosts.b_addr()), None),
        };

        let mut c = hosts.command(&hosts.a, &target_bin("omni-coordinator"));
        c.arg("--model")
            .arg(model(GEMMA))
            .args(["--listen", &format!("0.0.0.0:{port}")])
            .args(["--advertise", &coord_advertised])
            .args([
                "--workers",
                "2",
                "--transport",
                "auto",
                "--ctx",
                "1024",
                "--seqs",
                "4",
            ])
            // Each answer computed from its whole prompt, as the engine's
            // reference is (a cached prefix moves logits in their last bits).
            .args(["--health-interval", "0.5", "--prefix-cache", "off"])
            .args(["--rejoin-timeout", "2", "--recovery-timeout", "120"])
            .args(coordinator_args)
            .args(tls("coordinator"))
            .env("OMNI_LOG", "info");
        let coordinator = Proc::spawn("coordinator", c, dir.path());
        let worker = |host: &str, listen: String, advertise: Option<String>, id: &str| {
            let mut w = hosts.command(host, &target_bin("omni-gpu-worker"));
            w.args(["--coordinator", &coord])
                .args(["--listen", &listen])
                .args(
                    advertise
                        .map(|a| vec!["--advertise".to_string(), a])
                        .unwrap_or_default(),
                )
                .args(["--id", id, "--threads", "1", "--register-timeout", "60"])
                .args(tls(id))
                .env("GOMP_SPINCOUNT", "10000")
                .env("OMNI_LOG", "info");
            Proc::spawn(id, w, dir.path())
        };
        let w0 = worker(&hosts.a, format!("{}:0", hosts.a_addr()), None, "w0");
        let w1 = worker(&hosts.b, w1_listen, w1_advertised, "w1");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut two = TwoHosts {
            hosts,
            tls: tls_on,
            coord,
            coord_from_root,
            coordinator,
            w0,
            w1,
            pki,
            dir,
            rt,
            _proxies: proxies,
        };
        two.wait_ready();
        two
    }

    fn client(&self) -> Result<InferenceClient<tonic::transport::Channel>, String> {
        let ep = omni_transport::tls::endpoint(&self.coord_from_root).map_err(|e| e.to_string())?;
        let ch = self
            .rt
            .block_on(ep.connect_timeout(Duration::from_secs(2)).connect())
            .map_err(|e| omni_transport::tls::describe(&e))?;
        Ok(InferenceClient::new(ch))
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let ready = self.client().ok().and_then(|mut c| {
                self.rt
                    .block_on(c.info(InfoRequest {}))
                    .ok()
                    .map(|r| r.into_inner().ready)
            });
            if ready == Some(true) {
                return;
            }
            assert!(
                Instant::now() < deadline && matches!(self.coordinator.child.try_wait(), Ok(None)),
                "the two-host cluster did not serve within 120 s\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn logs(&self) -> String {
        [&self.coordinator, &self.w0, &self.w1]
            .iter()
            .map(|p| format!("--- {}\n{}", p.name, p.log_text()))
            .collect()
    }

    /// A stage worker `id` on host B started with `flags` (its TLS or none);
    /// what it printed before it exited.
    fn rogue(&self, id: &str, flags: &[String]) -> String {
        let mut w = self
            .hosts
            .command(&self.hosts.b, &target_bin("omni-gpu-worker"));
        w.args(["--coordinator", &self.coord])
            .args(["--listen", &format!("{}:0", self.hosts.b_addr())])
            .args(["--id", id, "--register-timeout", "3"])
            .args(flags)
            .env("OMNI_LOG", "info");
        let mut p = Proc::spawn(id, w, self.dir.path());
        let exited = p.wait_exit(Duration::from_secs(30));
        assert_eq!(
            exited,
            Some(false),
            "worker {id} was not refused:\n{}",
            p.log_text()
        );
        p.log_text()
    }

    /// A router in the root namespace in front of the coordinator, with
    /// the cluster's TLS; its HTTP address.
    fn router(&self) -> (Proc, String) {
        let mut args = vec!["--model".into(), format!("gemma={}", self.coord_from_root)];
        if self.tls {
            args.extend(tls(&self.pki, &self.pki, "router"));
        }
        start_router(self.dir.path(), &args)
    }

    /// Waits until the coordinator's log holds `text`.
    fn coordinator_says(&self, text: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.coordinator.log_text().contains(text) {
            assert!(
                Instant::now() < deadline,
                "the coordinator's log never said {text:?}\n{}",
                self.coordinator.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[test]
fn two_hosts_over_mutual_tls() {
    let two = TwoHosts::start(true, &[], None);
    // Between the hosts the automatic choice found no shared memory.
    assert!(
        two.w0.log_text().contains("over grpc"),
        "w0 does not send over gRPC:\n{}",
        two.w0.log_text()
    );

    // The split gives the tokens of the model in one process.
    let prompts = short_prompts("real_gemma3_270m.json", 3);
    let want = engine_tokens(&model(GEMMA), &prompts, 16);
    let mut c = two.client().unwrap();
    for (p, want) in prompts.iter().zip(&want) {
        let events = two
            .rt
            .block_on(collect(&mut c, greedy(p, 16)))
            .unwrap_or_else(|s| panic!("{s}\n{}", two.logs()));
        assert_eq!(&ids(&events), want, "tokens across two hosts over TLS");
    }

    // Peers without the cluster's credentials are refused, each side saying why.
    let plain = two.rogue("plain", &[]);
    assert!(plain.contains("requires mutual TLS"), "{plain}");
    two.coordinator_says(&format!(
        "refused a plaintext connection from {}",
        two.hosts.b_addr()
    ));

    let other = two.dir.path().join("other");
    certs(&other, "w1");
    let foreign = two.rogue("foreign", &tls(&two.pki, &other, "w1"));
    assert!(
        foreign.contains("it may not trust this process's certificate"),
        "{foreign}"
    );
    two.coordinator_says("its certificate is not signed by this cluster's CA");

    let wrong_ca = two.rogue("wrong-ca", &tls(&other, &two.pki, "w1"));
    assert!(
        wrong_ca.contains("not signed by this cluster's CA"),
        "{wrong_ca}"
    );
    two.coordinator_says("it refused this process's certificate");

    // TLS with no certificate at all (openssl as the client).
    Command::new("openssl")
        .args(["s_client", "-connect", &two.coord_from_root])
        .args(["-servername", omni_transport::tls::CLUSTER_NAME, "-CAfile"])
        .arg(two.pki.join("ca.pem"))
        .stdin(std::process::Stdio::null())
        .output()
        .expect("openssl");
    two.coordinator_says("it presented no certificate");

    // The router reaches the coordinator over TLS.
    let (_router, http) = two.router();
    let body = |max: usize| {
        format!(
            r#"{{"model": "gemma", "prompt": "The capital of France is", "max_tokens": {max}, "temperature": 0, "ignore_eos": true, "stream": true}}"#
        )
    };
    // Long enough that the cut below, made once the first tokens are
    // out, lands mid-stream however fast this machine decodes.
    const TOKENS: usize = 160;
    let calm = omni_tests::sse_completion(&http, &body(TOKENS))
        .unwrap_or_else(|e| panic!("{e}\n{}", two.logs()));
    assert!(!calm.text.is_empty());

    // The A-B link cut without a word mid-stream: no request is lost.
    let http2 = http.clone();
    let b = body(TOKENS);
    let (started, on_way) = std::sync::mpsc::channel();
    let stream = std::thread::spawn(move || {
        let mut chunks = 0;
        omni_tests::sse_completion_with(&http2, &b, || {
            chunks += 1;
            if chunks == 4 {
                let _ = started.send(());
            }
        })
    });
    on_way
        .recv_timeout(Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("no tokens before the cut ({e})\n{}", two.logs()));
    let cut_at = Instant::now();
    two.hosts.cut();
    let got = stream
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("the stream failed across the cut: {e}\n{}", two.logs()));
    println!(
        "link cut: the stream went on after {:.1} s (longest pause {:.1} s)",
        cut_at.elapsed().as_secs_f64(),
        got.max_gap().as_secs_f64()
    );
    assert_eq!(got.text, calm.text, "the text changed across the cut");
    // w0, on the coordinator's side of the cut, now runs every layer.
    let mut c = two.client().unwrap();
    let info = two
        .rt
        .block_on(c.info(InfoRequest {}))
        .unwrap()
        .into_inner();
    let stages: Vec<&str> = info.stages.iter().map(|s| s.worker_id.as_str()).collect();
    assert_eq!(stages, ["w0"], "{}", two.logs());
    assert!(two.coordinator.log_text().contains("recovered in"));
}

/// [`decode_once`]'s medians of three runs.
fn decode_rates(http: &str) -> (f64, f64) {
    let mut runs: Vec<(f64, f64)> = (0..3).map(|_| decode_once(http)).collect();
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (
        median(&mut runs.iter().map(|r| r.0).collect()),
        median(&mut runs.drain(..).map(|r| r.1).collect()),
    )
}

/// Decode through the router at `http`: one stream's tokens per second, and
/// eight streams' together.
fn decode_once(http: &str) -> (f64, f64) {
    const N: usize = 64;
    let body = format!(
        r#"{{"model": "gemma", "prompt": "Once upon a time", "max_tokens": {N}, "temperature": 0, "ignore_eos": true, "stream": true}}"#
    );
    let one = |body: &str| omni_tests::sse_completion(http, body).expect("a completion");
    one(&body);
    // Between the first token's chunk and the last's ([DONE] comes after).
    let s = one(&body);
    let t = s.times[s.times.len() - 2] - s.times[0];
    let single = (s.times.len() - 2) as f64 / t.as_secs_f64();
    let start = Instant::now();
    std::thread::scope(|sc| {
        let handles: Vec<_> = (0..8).map(|_| sc.spawn(|| one(&body))).collect();
        for h in handles {
            h.join().unwrap();
        }
    });
    let eight = (8 * N) as f64 / start.elapsed().as_secs_f64();
    (single, eight)
}

/// Decode over the link between two hosts beside shared memory on one, the
/// cost of TLS on that link, and of 1 ms of latency each way (a delay
/// proxy). A benchmark, not a test:
/// `cargo test --release --workspace --test hosts -- --ignored --nocapture`.
#[test]
#[ignore = "a benchmark (run with --ignored --nocapture)"]
fn bench_across_hosts() {
    // The same split everywhere (the planner's own follows each start's
    // timing of the workers, which varies here).
    let counts = ["--counts", "9,9"];
    let mut spec = omni_tests::ClusterSpec::new(2, "shm");
    spec.seqs = 4;
    spec.coordinator_args = ["--prefix-cache", "off", counts[0], counts[1]]
        .map(String::from)
        .to_vec();
    let shm = {
        let c = omni_tests::Cluster::start(&model(GEMMA), &spec);
        let dir = tempfile::tempdir().unwrap();
        let (_r, http) = start_router(dir.path(), &["--model".into(), format!("gemma={}", c.addr)]);
        decode_rates(&http)
    };
    let plain = {
        let two = TwoHosts::start(false, &counts, None);
        let (_r, http) = two.router();
        decode_rates(&http)
    };
    let tls = {
        let two = TwoHosts::start(true, &counts, None);
        let (_r, http) = two.router();
        decode_rates(&http)
    };
    let one_way = Duration::from_millis(1);
    let (late, hop) = {
        let two = TwoHosts::start(true, &counts, Some(one_way));
        let (_r, http) = two.router();
        let rates = decode_rates(&http);
        let info = two
            .rt
            .block_on(two.client().expect("a client").info(InfoRequest {}));
        (rates, info.expect("info").into_inner().hop_us_p50)
    };
    println!("Gemma 3 270M, 2 stages, through the router (tok/s):");
    println!("| path | 1 stream | 8 streams | 1 stream vs shm | 8 vs shm |");
    println!("|---|---|---|---|---|");
    for (name, (one, eight)) in [
        ("one host, shared memory", shm),
        ("two hosts, gRPC, 1 Gbit/s", plain),
        ("two hosts, gRPC + mutual TLS, 1 Gbit/s", tls),
        ("the same, 1 ms each way (delay proxy)", late),
    ] {
        println!(
            "| {name} | {one:.1} | {eight:.1} | {:.2}x | {:.2}x |",
            one / shm.0,
            eight / shm.1
        );
    }
    println!(
        "TLS on vs off over the link: 1 stream {:.3}x, 8 streams {:.3}x",
        tls.0 / plain.0,
        tls.1 / plain.1
    );
    println!(
        "{} ms each way vs none: 1 stream {:.3}x, 8 streams {:.3}x; the pipeline's per-hop latency with it: p50 {:.0} us",
        one_way.as_millis(),
        late.0 / tls.0,
        late.1 / tls.1,
        hop
    );
}
