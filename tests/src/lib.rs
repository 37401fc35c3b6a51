//! The harness for omni's end-to-end tests (in `tests/tests/`): it starts the
//! real binaries from the build directory on free ports, waits for them with
//! deadlines, talks to them over gRPC, and prints their logs when a test fails.

use omni_proto::coordinator::v1::{
    inference_client::InferenceClient, GenerateEvent, GenerateRequest, InfoReply, InfoRequest,
};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;

/// Fixture and model locations, shared with the engine's tests.
#[path = "../../engine/tests/common/mod.rs"]
pub mod fixtures;
pub mod hosts;

/// A binary of this workspace, from the same build as the running test.
pub fn target_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/<test>-<hash> -> target/<profile>/<name>
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} is missing: build the workspace first (cargo build --release --workspace)",
        p.display()
    );
    p
}

/// Waits while scripts/test still builds `name` beside the tests (it builds
/// llama-server and ggml's Vulkan backend in the cores' idle time): such a
/// build holds a file `name` in the folder `OMNI_PENDING_BUILDS` names while
/// it runs, and leaves its log there as `name.failed` if it fails, which
/// fails the test with that log. Outside scripts/test (no such folder) it
/// returns at once, and the caller's check of the artifact says what to run.
pub fn await_pending_build(name: &str) {
    let Some(dir) = std::env::var_os("OMNI_PENDING_BUILDS") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let start = Instant::now();
    let mut said = false;
    while dir.join(name).exists() {
        if !said {
            eprintln!("waiting for scripts/test's build of {name}, which runs beside the tests");
            said = true;
        }
        assert!(
            start.elapsed() < Duration::from_secs(3600),
            "scripts/test's build of {name} has not finished in an hour"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    if said {
        eprintln!(
            "{name} built after {:.0} s of waiting",
            start.elapsed().as_secs_f64()
        );
    }
    if let Ok(log) = std::fs::read_to_string(dir.join(format!("{name}.failed"))) {
        panic!("scripts/test's build of {name} failed:\n{log}");
    }
}

/// A port nobody listens on right now.
/// `omnictl ARGS --admin ADDR` with `OMNI_ADMIN_TOKEN` set to the token
/// (or unset): (succeeded, stdout, stderr).
pub fn omnictl_admin(
    admin_addr: &str,
    token: Option<&str>,
    args: &[&str],
) -> (bool, String, String) {
    let mut cmd = Command::new(target_bin("omnictl"));
    cmd.args(args)
        .args(["--admin", admin_addr])
        .env_remove("OMNI_ADMIN_TOKEN")
        .env_remove("OMNI_ADMIN_TOKEN_FILE");
    if let Some(t) = token {
        cmd.env("OMNI_ADMIN_TOKEN", t);
    }
    let out = cmd.output().expect("omnictl runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A port nothing listens on now, never the same one twice in a test
/// binary: ports asked for together (a router's and a coordinator's) are
/// bound only later, and the kernel may offer a freed port again at once.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("binding port 0")
            .port();
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// One child process with its output in a log file.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command, dir: &Path) -> Proc {
        let log = dir.join(format!("{name}.log"));
        let f = std::fs::File::create(&log).expect("log file");
        cmd.stdout(f.try_clone().unwrap())
            .stderr(f)
            .stdin(Stdio::null());
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Proc {
            name: name.to_string(),
            child,
            log,
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for the process to exit, at most `timeout`; returns whether it
    /// exited successfully, or None if it is still running.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<bool> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s.success());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    /// SIGTERM first, so the process removes its shared-memory ring; SIGKILL
    /// if it is still there after two seconds.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
            if self.wait_exit(Duration::from_secs(2)).is_none() {
                let _ = self.child.kill();
            }
        }
        let _ = self.child.wait();
    }
}

/// How to start a cluster.
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    pub stages: usize,
    pub transport: &'static str,
    pub threads: usize,
    pub ctx: usize,
    pub seqs: usize,
    /// Extra coordinator flags.
    pub coordinator_args: Vec<String>,
    /// Extra flags per worker (index = stage).
    pub worker_args: Vec<Vec<String>>,
    /// Workers actually started (defaults to `stages`).
    pub start_workers: Option<usize>,
    /// Expert workers (`omni-cpu-worker`), named c0, c1, ...
    pub cpu_workers: usize,
    /// Extra flags per expert worker.
    pub cpu_worker_args: Vec<Vec<String>>,
    /// CPUs each stage worker may run on (`taskset -c`; index = stage;
    /// empty: all).
    pub worker_cpus: Vec<String>,
}

impl ClusterSpec {
    pub fn new(stages: usize, transport: &'static str) -> ClusterSpec {
        ClusterSpec {
            stages,
            transport,
            threads: 1,
            ctx: 1024,
            seqs: 8,
            coordinator_args: Vec::new(),
            worker_args: Vec::new(),
            start_workers: None,
            cpu_workers: 0,
            cpu_worker_args: Vec::new(),
            worker_cpus: Vec::new(),
        }
    }
}

/// The coordinator of a [`Cluster`] started from `spec`.
fn coordinator_cmd(model: &Path, spec: &ClusterSpec, addr: &str, admin_addr: &str) -> Command {
    let mut c = Command::new(target_bin("omni-coordinator"));
    c.arg("--model")
        .arg(model)
        .args(["--listen", addr])
        .args(["--admin-listen", admin_addr])
        .args(["--workers", &spec.stages.to_string()])
        .args(["--cpu-workers", &spec.cpu_workers.to_string()])
        .args(["--transport", spec.transport])
        .args(["--ctx", &spec.ctx.to_string()])
        .args(["--seqs", &spec.seqs.to_string()])
        .args(["--health-interval", "0.5"])
        .args(&spec.coordinator_args)
        .env("OMNI_LOG", "info");
    c
}

/// Stage worker `i` of a [`Cluster`] started from `spec`.
fn worker_cmd(spec: &ClusterSpec, addr: &str, i: usize) -> Command {
    let mut w = match spec.worker_cpus.get(i).filter(|c| !c.is_empty()) {
        Some(cpus) => {
            let mut t = Command::new("taskset");
            t.args(["-c", cpus]).arg(target_bin("omni-gpu-worker"));
            t
        }
        None => Command::new(target_bin("omni-gpu-worker")),
    };
    w.args(["--coordinator", addr])
        .args(["--id", &format!("w{i}")])
        .args(["--threads", &spec.threads.to_string()])
        .args(["--register-timeout", "30"])
        .args(spec.worker_args.get(i).cloned().unwrap_or_default())
        // As `omnictl up` does: idle stages must not spin on the cores.
        .env("GOMP_SPINCOUNT", "10000")
        .env("OMNI_LOG", "info");
    w
}

/// A coordinator and its workers, all real processes.
pub struct Cluster {
    pub addr: String,
    /// The coordinator's admin API (`--admin-listen`).
    pub admin_addr: String,
    pub coordinator: Proc,
    pub workers: Vec<Proc>,
    pub cpu_workers: Vec<Proc>,
    pub rt: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// Starts the processes; does not wait for readiness.
    pub fn spawn(model: &Path, spec: &ClusterSpec) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let addr = format!("127.0.0.1:{}", free_port());
        let admin_addr = format!("127.0.0.1:{}", free_port());
        let c = coordinator_cmd(model, spec, &addr, &admin_addr);
        let mut coordinator = Proc::spawn("coordinator", c, dir.path());
        // Workers start once the coordinator holds its port: until then a
        // worker's own port 0 could be given the very port picked for it.
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::net::TcpStream::connect(&addr).is_err()
            && Instant::now() < deadline
            && matches!(coordinator.child.try_wait(), Ok(None))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut workers = Vec::new();
        for i in 0..spec.start_workers.unwrap_or(spec.stages) {
            let w = worker_cmd(spec, &addr, i);
            workers.push(Proc::spawn(&format!("w{i}"), w, dir.path()));
        }
        let mut cpu_workers = Vec::new();
        for i in 0..spec.cpu_workers {
            let mut w = Command::new(target_bin("omni-cpu-worker"));
            w.args(["--coordinator", &addr])
                .args(["--id", &format!("c{i}")])
                .args(["--threads", &spec.threads.to_string()])
                .args(["--register-timeout", "30"])
                .args(spec.cpu_worker_args.get(i).cloned().unwrap_or_default())
                .env("GOMP_SPINCOUNT", "10000")
                .env("OMNI_LOG", "info");
            cpu_workers.push(Proc::spawn(&format!("c{i}"), w, dir.path()));
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        Cluster {
            addr,
            admin_addr,
            coordinator,
            workers,
            cpu_workers,
            rt,
            _dir: dir,
        }
    }

    /// Starts another coordinator process in place of the current one (at
    /// the same addresses, with the same flags); the old one must be gone.
    pub fn restart_coordinator(&mut self, model: &Path, spec: &ClusterSpec) {
        let c = coordinator_cmd(model, spec, &self.addr, &self.admin_addr);
        self.coordinator = Proc::spawn("coordinator-2", c, self._dir.path());
    }

    /// Starts stage worker `i` again (as its supervisor would), after it
    /// exited.
    pub fn restart_worker(&mut self, spec: &ClusterSpec, i: usize) {
        let w = worker_cmd(spec, &self.addr, i);
        self.workers[i] = Proc::spawn(&format!("w{i}-2"), w, self._dir.path());
    }

    /// Starts a cluster and waits until it serves (panics with the logs
    /// after 120 s).
    pub fn start(model: &Path, spec: &ClusterSpec) -> Cluster {
        let mut c = Cluster::spawn(model, spec);
        c.wait_ready();
        c
    }

    /// Waits until the coordinator serves (panics with the logs after 120 s
    /// or if it exits).
    pub fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(info) = self.info() {
                if info.ready {
                    return;
                }
            }
            if let Ok(Some(s)) = self.coordinator.child.try_wait() {
                panic!(
                    "the coordinator exited ({s}) before serving\n{}",
                    self.logs()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the cluster was not ready within 120 s\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn client(&self) -> Result<InferenceClient<tonic::transport::Channel>, String> {
        let addr = format!("http://{}", self.addr);
        self.rt.block_on(async {
            let ch = tonic::transport::Endpoint::from_shared(addr)
                .map_err(|e| e.to_string())?
                .connect_timeout(Duration::from_secs(2))
                .connect()
                .await
                .map_err(|e| e.to_string())?;
            Ok(InferenceClient::new(ch))
        })
    }

    pub fn info(&self) -> Result<InfoReply, String> {
        let mut c = self.client()?;
        self.rt.block_on(async {
            c.info(InfoRequest {})
                .await
                .map(|r| r.into_inner())
                .map_err(|s| s.message().to_string())
        })
    }

    /// Runs one request to the end; the events, or the error status.
    pub fn generate(&self, req: GenerateRequest) -> Result<Vec<GenerateEvent>, tonic::Status> {
        let mut c = self.client().map_err(tonic::Status::unavailable)?;
        self.rt.block_on(collect(&mut c, req))
    }

    /// Every stage's Worker.Status, in stage order.
    pub fn statuses(&self) -> Vec<omni_proto::worker::v1::StatusReply> {
        stage_statuses(&self.rt, &self.info().expect("coordinator info"))
    }

    /// KV cache cells in use on each worker, in stage order.
    pub fn kv_cells_used(&self) -> Vec<u64> {
        self.statuses().iter().map(|s| s.kv_cells_used).collect()
    }

    /// Every process's log, for failure messages.
    pub fn logs(&self) -> String {
        let mut s = String::new();
        for p in std::iter::once(&self.coordinator)
            .chain(&self.workers)
            .chain(&self.cpu_workers)
        {
            s.push_str(&format!("----- {} -----\n{}\n", p.name, p.log_text()));
        }
        s
    }
}

impl Cluster {
    /// Starts `req`, waits for its first tokens, runs `kill` (which stops
    /// the process named `who`) and checks what a user would see: the
    /// stream ends within `bound` with an error naming `who`, and the
    /// coordinator then refuses new requests naming it too. Returns the
    /// error message and how long after `kill` the stream ended.
    pub fn kill_mid_stream(
        &mut self,
        req: GenerateRequest,
        kill: impl FnOnce(&mut Cluster),
        who: &str,
        bound: Duration,
    ) -> (String, Duration) {
        let mut retry = req.clone();
        retry.max_tokens = Some(4);
        let mut client = self.client().expect("coordinator reachable");
        let mut stream = self.rt.block_on(async {
            let mut stream = client.generate(req).await.unwrap().into_inner();
            let first = stream.next().await.unwrap().unwrap();
            assert!(!first.tokens.is_empty(), "the first event carries tokens");
            stream
        });
        kill(self);
        let t = Instant::now();
        let end = self.rt.block_on(async {
            tokio::time::timeout(bound, async {
                while let Some(ev) = stream.next().await {
                    if let Err(s) = ev {
                        return Some(s);
                    }
                }
                None
            })
            .await
        });
        let after = t.elapsed();
        let status = match end {
            Ok(Some(s)) => s,
            Ok(None) => panic!("the stream ended without an error\n{}", self.logs()),
            Err(_) => panic!("the stream did not end within {bound:?}\n{}", self.logs()),
        };
        let msg = status.message().to_string();
        assert!(msg.contains(who), "the error names {who}: {msg}");
        let err = self.generate(retry).unwrap_err();
        assert!(err.message().contains(who), "{}", err.message());
        (msg, after)
    }
}

/// The first `n` of a fixture's short prompts (under 100 tokens: the long
/// prose passage adds minutes on two cores and nothing the short ones
/// don't test).
pub fn short_prompts(fixture: &str, n: usize) -> Vec<Vec<u32>> {
    fixtures::json(fixture)["prompts"]
        .as_array()
        .expect("the fixture has prompts")
        .iter()
        .map(|p| fixtures::ids(&p["prompt_ids"]))
        .filter(|p| p.len() < 100)
        .take(n)
        .collect()
}

/// A greedy request for `prompt` that runs `max_tokens` steps (end-of-text
/// tokens do not stop it, as in llama.cpp's references).
pub fn greedy(prompt: &[u32], max_tokens: usize) -> GenerateRequest {
    use omni_proto::coordinator::v1::{generate_request::Prompt, TokenIds};
    GenerateRequest {
        prompt: Some(Prompt::Ids(TokenIds {
            ids: prompt.to_vec(),
        })),
        max_tokens: Some(max_tokens as u32),
        ignore_eos: true,
        ..Default::default()
    }
}

/// Reads a Generate stream to its end (with a 5-minute deadline).
pub async fn collect(
    c: &mut InferenceClient<tonic::transport::Channel>,
    req: GenerateRequest,
) -> Result<Vec<GenerateEvent>, tonic::Status> {
    collect_within(c, req, 300).await
}

/// [`collect`] with a deadline of `secs` seconds.
pub async fn collect_within(
    c: &mut InferenceClient<tonic::transport::Channel>,
    req: GenerateRequest,
    secs: u64,
) -> Result<Vec<GenerateEvent>, tonic::Status> {
    let run = async {
        let mut stream = c.generate(req).await?.into_inner();
        let mut out = Vec::new();
        while let Some(ev) = stream.next().await {
            out.push(ev?);
        }
        Ok(out)
    };
    tokio::time::timeout(Duration::from_secs(secs), run)
        .await
        .map_err(|_| {
            tonic::Status::deadline_exceeded(format!("no end of stream within {secs} s"))
        })?
}

/// The generated ids of a finished stream.
pub fn ids(events: &[GenerateEvent]) -> Vec<u32> {
    events
        .iter()
        .flat_map(|e| e.tokens.iter().map(|t| t.id))
        .collect()
}

/// Starts `omni-router` on a free port with `args`, logging into `dir`, and
/// waits until it accepts connections; returns it and its address.
pub fn start_router(dir: &Path, args: &[String]) -> (Proc, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut cmd = Command::new(target_bin("omni-router"));
    cmd.args(["--listen", &addr]).args(args);
    let router = Proc::spawn("router", cmd, dir);
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(
            Instant::now() < deadline,
            "router not up:\n{}",
            router.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (router, addr)
}

/// A streamed completion as a client saw it: its text, its usage's
/// completion tokens (with `stream_options.include_usage`), and when each
/// chunk came.
#[derive(Debug)]
pub struct Sse {
    pub text: String,
    pub tokens: u64,
    pub times: Vec<Instant>,
}

impl Sse {
    /// The longest wait between two chunks.
    pub fn max_gap(&self) -> Duration {
        self.times
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or_default()
    }
}

/// Errors of a request that never reached the router (nothing listened,
/// or the connection was dropped before an answer): what an OpenAI SDK
/// retries by itself.
pub const NOT_CONNECTED: &str = "not connected: ";

/// POSTs `body` to the router's `/v1/completions` and reads the SSE answer
/// chunk by chunk as it comes; an error names what went wrong (an HTTP
/// status, an error chunk, a stream cut short).
pub fn sse_completion(addr: &str, body: &str) -> Result<Sse, String> {
    sse_completion_with(addr, body, || {})
}

/// [`sse_completion`], calling `on_chunk` as each chunk arrives (a test
/// that acts mid-answer waits on it).
pub fn sse_completion_with(
    addr: &str,
    body: &str,
    mut on_chunk: impl FnMut(),
) -> Result<Sse, String> {
    use std::io::BufRead;
    let mut s = std::net::TcpStream::connect(addr).map_err(|e| format!("{NOT_CONNECTED}{e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(180))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| format!("{NOT_CONNECTED}{e}"))?;
    let mut lines = std::io::BufReader::new(s).lines();
    let status = match lines.next() {
        None => {
            return Err(format!(
                "{NOT_CONNECTED}the connection closed before an answer"
            ))
        }
        Some(Err(e)) => return Err(format!("{NOT_CONNECTED}{e}")),
        Some(Ok(l)) => l,
    };
    if !status.contains(" 200 ") {
        let rest: Vec<String> = lines.map_while(Result::ok).collect();
        return Err(format!("{status}: {}", rest.join("\n")));
    }
    let mut out = Sse {
        text: String::new(),
        tokens: 0,
        times: Vec::new(),
    };
    for line in lines {
        let line = line.map_err(|e| e.to_string())?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        out.times.push(Instant::now());
        on_chunk();
        if data == "[DONE]" {
            return Ok(out);
        }
        let v: serde_json::Value =
            serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
        if let Some(e) = v.get("error") {
            return Err(format!("the stream carried an error: {e}"));
        }
        if let Some(t) = v["choices"][0]["text"].as_str() {
            out.text.push_str(t);
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            out.tokens = n;
        }
    }
    Err(format!(
        "the stream ended without [DONE] after {:?}",
        out.text
    ))
}

/// A counter or gauge's value in a Prometheus text exposition (0 when it
/// is not there).
pub fn metric_value(body: &str, name: &str) -> u64 {
    body.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0, |v| v.parse::<f64>().unwrap() as u64)
}

/// One HTTP/1.1 request; the status and the body (chunked bodies decoded).
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String) {
    let (status, _, body) = http_with_head(addr, method, path, headers, body);
    (status, body)
}

/// [`http`], with the response head (status line and headers) too.
pub fn http_with_head(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    // A server may answer (413, say) and close before the whole body is
    // sent: the answer is still there to read.
    let sent = s.write_all(body);
    let mut raw = Vec::new();
    let read = s.read_to_end(&mut raw);
    if raw.is_empty() {
        sent.unwrap();
        read.unwrap();
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    (status, head.to_string(), body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// A program from the Python environment the tests use: beside OMNI_PYTHON
/// when set, else in `.venv/bin` of the checkout (`scripts/test` creates it
/// with openai, pytest, llm-comply and schemathesis).
pub fn venv_tool(name: &str) -> PathBuf {
    let bin = match std::env::var_os("OMNI_PYTHON") {
        Some(p) if name == "python" => PathBuf::from(p),
        Some(p) => PathBuf::from(p).with_file_name(name),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../.venv/bin")
            .join(name),
    };
    assert!(
        bin.exists(),
        "{} is missing: run ./scripts/test (it creates .venv with what the tests use), or set OMNI_PYTHON",
        bin.display()
    );
    bin
}

/// Streams running on their own thread; `progress` counts tokens received,
/// `max_gap_us` is the longest wait between two events of any stream.
pub struct Streams {
    pub progress: Arc<AtomicUsize>,
    pub max_gap_us: Arc<AtomicU64>,
    pub handle: std::thread::JoinHandle<Vec<Result<Vec<u32>, String>>>,
    /// Each stream's log-probabilities as sent, bit for bit (the token's,
    /// then each top entry's id and value), once it has ended: for the
    /// tests of batch-invariant decoding, which compare them exactly.
    pub logprobs: Arc<std::sync::Mutex<Vec<Vec<u32>>>>,
}

/// Runs `reqs` at once against the coordinator at `addr`.
pub fn start_streams(addr: &str, reqs: Vec<GenerateRequest>) -> Streams {
    let progress = Arc::new(AtomicUsize::new(0));
    let max_gap_us = Arc::new(AtomicU64::new(0));
    let logprobs = Arc::new(std::sync::Mutex::new(vec![Vec::new(); reqs.len()]));
    let (p, gap, lp) = (progress.clone(), max_gap_us.clone(), logprobs.clone());
    let addr = format!("http://{addr}");
    let handle = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut tasks = Vec::new();
            for (i, req) in reqs.into_iter().enumerate() {
                let (addr, p, gap, lp) = (addr.clone(), p.clone(), gap.clone(), lp.clone());
                tasks.push(tokio::spawn(async move {
                    let mut c = InferenceClient::connect(addr)
                        .await
                        .map_err(|e| e.to_string())?;
                    let mut s = c
                        .generate(req)
                        .await
                        .map_err(|e| e.message().to_string())?
                        .into_inner();
                    let mut out = Vec::new();
                    let mut bits = Vec::new();
                    let mut last = None;
                    while let Some(ev) = s.next().await {
                        let ev = ev.map_err(|e| e.message().to_string())?;
                        if let Some(t) = last.replace(Instant::now()) {
                            let us = t.elapsed().as_micros() as u64;
                            gap.fetch_max(us, Ordering::Relaxed);
                        }
                        p.fetch_add(ev.tokens.len(), Ordering::Relaxed);
                        out.extend(ev.tokens.iter().map(|t| t.id));
                        for t in &ev.tokens {
                            bits.extend(t.logprob.map(f32::to_bits));
                            bits.extend(t.top.iter().flat_map(|x| [x.token, x.logprob.to_bits()]));
                        }
                    }
                    lp.lock().unwrap()[i] = bits;
                    Ok(out)
                }));
            }
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        })
    });
    Streams {
        progress,
        max_gap_us,
        handle,
        logprobs,
    }
}

impl Streams {
    /// Waits until the streams received `tokens` tokens in all.
    pub fn wait_for(&self, tokens: usize) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.progress.load(Ordering::Relaxed) < tokens {
            assert!(Instant::now() < deadline, "the streams made no progress");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The Worker.Status of each stage `info` names, in stage order.
fn stage_statuses(
    rt: &tokio::runtime::Runtime,
    info: &InfoReply,
) -> Vec<omni_proto::worker::v1::StatusReply> {
    use omni_proto::worker::v1::{worker_client::WorkerClient, StatusRequest};
    rt.block_on(async {
        let mut out = Vec::new();
        for s in &info.stages {
            let mut w = WorkerClient::connect(format!("http://{}", s.worker_addr))
                .await
                .expect("worker reachable");
            let st = w.status(StatusRequest {}).await.expect("worker status");
            out.push(st.into_inner());
        }
        out
    })
}

/// Every stream finished without an error and with the tokens it got alone.
pub fn same_tokens(results: &[Result<Vec<u32>, String>], alone: &[Vec<u32>], across: &str) {
    assert_eq!(results.len(), alone.len());
    for (i, (r, want)) in results.iter().zip(alone).enumerate() {
        let got = r
            .as_ref()
            .unwrap_or_else(|e| panic!("stream {i} failed: {e}"));
        assert_eq!(got, want, "stream {i}'s tokens changed across {across}");
    }
}

/// `omnictl up`, the local launcher and supervisor, with its output in a
/// log file; no router.
pub struct Supervised {
    pub proc: Proc,
    pub addr: String,
    pub admin_addr: String,
    /// The router's address, when one was asked for ([`Supervised::serving`]).
    pub router: Option<String>,
    pub rt: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
}

impl Supervised {
    /// Starts `omnictl up --model MODEL ARGS` (with `env` set for it and its
    /// children) and waits until the cluster serves.
    pub fn start(model: &Path, args: &[&str], env: &[(&str, &str)]) -> Supervised {
        Supervised::launch(model, args, env, None)
    }

    /// [`Supervised::start`] with the router on a free port (the OpenAI
    /// API at `router`), as a user runs it.
    pub fn serving(model: &Path, args: &[&str], env: &[(&str, &str)]) -> Supervised {
        let s = Supervised::launch(model, args, env, Some(free_port()));
        let addr = s.router.clone().expect("a router");
        let deadline = Instant::now() + Duration::from_secs(60);
        while http(&addr, "GET", "/ready", &[], b"").0 != 200 {
            assert!(
                Instant::now() < deadline,
                "the router did not get ready\n{}",
                s.proc.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        s
    }

    fn launch(model: &Path, args: &[&str], env: &[(&str, &str)], port: Option<u16>) -> Supervised {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = port.unwrap_or(0).to_string();
        let addr = format!("127.0.0.1:{}", free_port());
        let admin_addr = format!("127.0.0.1:{}", free_port());
        let mut cmd = Command::new(target_bin("omnictl"));
        cmd.arg("up")
            .arg("--model")
            .arg(model)
            .args([
                "--listen",
                &addr,
                "--admin-listen",
                &admin_addr,
                "--port",
                &port,
            ])
            .args(args)
            .env("OMNI_LOG", "info")
            // The admin token `up` makes goes to this test's folder, not
            // the user's ~/.local/state.
            .env("XDG_STATE_HOME", dir.path())
            .env_remove("OMNI_ADMIN_TOKEN")
            .env_remove("OMNI_ADMIN_TOKEN_FILE");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let s = Supervised {
            proc: Proc::spawn("omnictl-up", cmd, dir.path()),
            addr,
            admin_addr,
            router: (port != "0").then(|| format!("127.0.0.1:{port}")),
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime"),
            _dir: dir,
        };
        s.wait_ready(Duration::from_secs(120));
        s
    }

    pub fn info(&self) -> Result<InfoReply, String> {
        let addr = format!("http://{}", self.addr);
        self.rt.block_on(async {
            let ch = tonic::transport::Endpoint::from_shared(addr)
                .map_err(|e| e.to_string())?
                .connect_timeout(Duration::from_secs(2))
                .timeout(Duration::from_secs(5))
                .connect()
                .await
                .map_err(|e| e.to_string())?;
            InferenceClient::new(ch)
                .info(InfoRequest {})
                .await
                .map(|r| r.into_inner())
                .map_err(|s| s.message().to_string())
        })
    }

    /// Every stage's Worker.Status, in stage order.
    pub fn statuses(&self) -> Vec<omni_proto::worker::v1::StatusReply> {
        stage_statuses(&self.rt, &self.info().expect("coordinator info"))
    }

    /// The folder `up` keeps its admin token in (its XDG_STATE_HOME).
    pub fn state_dir(&self) -> &Path {
        self._dir.path()
    }

    /// Waits until the coordinator says it serves (panics with the log).
    pub fn wait_ready(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if self.info().is_ok_and(|i| i.ready) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not serve within {timeout:?}\n{}",
                self.proc.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The pid of the child started with `--id ID` (a worker), if running.
    pub fn pid_of(&self, id: &str) -> Option<i32> {
        self.child_pid(&format!("--id\0{id}\0"))
    }

    /// The pid of the child whose command line holds `want` (its words
    /// joined by NULs), if running.
    pub fn child_pid(&self, want: &str) -> Option<i32> {
        let parent = self.proc.child.id().to_string();
        std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            // pid (comm) state ppid ...: comm may hold spaces, so after ')'.
            let ppid = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            (ppid == parent && String::from_utf8_lossy(&cmdline).contains(want)).then_some(pid)
        })
    }

    /// Sends `signal` (e.g. "-9", "-STOP") to worker `id`; returns its pid.
    pub fn signal(&self, id: &str, signal: &str) -> i32 {
        let pid = self
            .pid_of(id)
            .unwrap_or_else(|| panic!("no process {id}\n{}", self.proc.log_text()));
        let ok = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {signal} {pid}");
        pid
    }
}

impl Drop for Supervised {
    /// SIGTERM: `omnictl up` stops its children (up to 5 s each) before it
    /// exits; only then the harness's own clean-up.
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.proc.child.id().to_string()])
            .status();
        self.proc.wait_exit(Duration::from_secs(15));
    }
}

/// The whole model in one CPU stage in this process: 1024 cells of one
/// sequence, 2 threads.
pub fn cpu_engine(model: &Path) -> omni_engine::Engine {
    let cfg = omni_engine::StageConfig {
        kv: omni_engine::KvConfig {
            n_ctx: 1024,
            n_seq: 1,
        },
        n_threads: 2,
        ..omni_engine::StageConfig::default()
    };
    omni_engine::Engine::load(model, None, cfg).unwrap()
}

/// The single-process engine's greedy tokens (`n_gen` each, not stopping
/// at end of generation) for each prompt: what a cluster must return.
pub fn engine_tokens(model: &Path, prompts: &[Vec<u32>], n_gen: usize) -> Vec<Vec<u32>> {
    let mut e = cpu_engine(model);
    let opts = omni_engine::GenerateOptions {
        max_tokens: n_gen,
        stop_at_eog: false,
        ..omni_engine::GenerateOptions::default()
    };
    prompts
        .iter()
        .map(|p| e.generate(p, &opts, &mut |_| {}).unwrap().ids)
        .collect()
}
