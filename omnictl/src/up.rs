//! `omnictl up`: a local cluster — one coordinator and N CPU-backed workers
//! as child processes of this one. Every child's log lines are prefixed with
//! its name. It is also their supervisor: a worker that exits (a crash, an
//! OOM kill) is started again with the same flags, registers again and the
//! coordinator recovers; when the coordinator or the router exits, or on
//! Ctrl-C, all of them are stopped.

use anyhow::Context;
use clap::Args;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args, Debug, Clone)]
pub struct UpArgs {
    /// GGUF path, or a known model name (fetched if missing).
    #[arg(long, short)]
    pub model: String,
    /// Number of worker processes (pipeline stages).
    #[arg(long, default_value_t = 2)]
    pub stages: usize,
    /// auto (shared memory between local processes), shm or grpc.
    #[arg(long, default_value = "auto")]
    pub transport: String,
    /// Where the coordinator serves Inference.
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: String,
    /// Context length of one sequence.
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// Sequences resident at once.
    #[arg(long, default_value_t = 8)]
    pub seqs: usize,
    /// Each worker's device, in order: cpu, cuda:N or vulkan:N (e.g. cuda:0,cuda:1,cpu;
    /// the last one repeats for the workers past the list).
    #[arg(long, value_delimiter = ',', default_value = "cpu")]
    pub device: Vec<omni_engine::Device>,
    /// Compute threads per worker (default: every core; local stages take
    /// turns on them).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Memory each worker offers, e.g. 2GiB (default: what the machine has
    /// free). Local workers share the machine's memory: the planner counts
    /// it once, and this caps each worker alone.
    #[arg(long)]
    pub memory: Option<String>,
    /// Manual split by proportion (e.g. 3,1).
    #[arg(long)]
    pub split: Option<String>,
    /// Manual split by layer counts per stage (e.g. 12,12).
    #[arg(long)]
    pub counts: Option<String>,
    /// Refused with a pointer to --counts (--layers is a range elsewhere).
    #[arg(long, hide = true)]
    pub layers: Option<String>,
    /// Coordinator metrics listen address (GET /metrics).
    #[arg(long)]
    pub metrics: Option<String>,
    /// Also start the OpenAI router on this port (0: no router).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// A file holding the API key(s) the router requires, one per line
    /// (or the keys in OMNI_API_KEYS, comma-separated); none: open.
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// Refused: a key on the command line is visible to every user in `ps`.
    #[arg(long, hide = true)]
    pub api_key: Option<String>,
    /// A file holding the admin token (made, readable by you only, if it
    /// does not exist). Default: OMNI_ADMIN_TOKEN when set, else a new
    /// token in ~/.local/state/omni/admin-token-HOST_PORT, where
    /// `omnictl workers`, `top`, `plan` and `rebalance` find it.
    #[arg(long, env = "OMNI_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// Export every process's traces over OTLP/HTTP to this base URL (e.g.
    /// http://127.0.0.1:6006 for Arize Phoenix); also
    /// OTEL_EXPORTER_OTLP_ENDPOINT, which the processes inherit.
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
    /// Extra seconds the workers may take to register.
    #[arg(long, default_value_t = 60.0)]
    pub register_timeout: f64,
    /// Also start this many expert workers (omni-cpu-worker) for MoE
    /// models' routed experts, c0, c1, ...
    #[arg(long, default_value_t = 0)]
    pub cpu_workers: usize,
    /// Bind expert worker i to NUMA node i.
    #[arg(long)]
    pub numa: bool,
    /// Where routed experts run: auto, device or cpu (see omni-coordinator --help).
    #[arg(long)]
    pub experts: Option<String>,
    /// Keep the K most used experts of each offloaded layer on its device worker.
    #[arg(long)]
    pub gpu_experts: Option<u32>,
    /// Batch-invariant decoding: off, on (every request gets the same
    /// tokens whatever else runs) or request (requests that send
    /// `"deterministic": true`); see omni-coordinator --help.
    #[arg(long)]
    pub deterministic: Option<String>,
    /// Memory each expert worker offers, e.g. 64GiB (default: what the machine has free).
    #[arg(long)]
    pub cpu_memory: Option<String>,
    /// Where the coordinator's admin API listens (default 127.0.0.1:7071).
    #[arg(long)]
    pub admin_listen: Option<String>,
    /// The workers compute with this ggml CPU variant (haswell, zen4, ...)
    /// instead of the best one this CPU runs (also OMNI_CPU_VARIANT, which
    /// the workers inherit).
    #[arg(long)]
    pub cpu_variant: Option<String>,
}

/// Locates a sibling binary (the build puts all of omni's in one directory).
pub fn sibling_binary(name: &str) -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe().context("cannot locate omnictl itself")?;
    let dir = me.parent().context("omnictl has no parent directory")?;
    // `cargo test` runs omnictl from target/<profile>/deps; the binaries are one up.
    for d in [dir.to_path_buf(), dir.join("..")] {
        let p = d.join(name);
        if p.exists() {
            return Ok(p);
        }
    }
    anyhow::bail!(
        "cannot find {name} next to {} (build the workspace: cargo build --release)",
        me.display()
    )
}

impl UpArgs {
    /// A quiet local cluster for benchmarks: `stages` workers over
    /// `transport`, listening on `listen`, no router, defaults elsewhere.
    pub fn bench(
        model: &str,
        stages: usize,
        transport: &str,
        listen: &str,
        threads: usize,
    ) -> UpArgs {
        UpArgs {
            model: model.to_string(),
            stages,
            transport: transport.into(),
            listen: listen.to_string(),
            ctx: 1024,
            seqs: 1,
            threads: Some(threads),
            device: vec![omni_engine::Device::Cpu],
            memory: None,
            split: None,
            counts: None,
            layers: None,
            metrics: None,
            port: 0,
            api_key_file: None,
            api_key: None,
            admin_token_file: None,
            otlp_endpoint: None,
            register_timeout: 60.0,
            cpu_workers: 0,
            numa: false,
            experts: None,
            gpu_experts: None,
            deterministic: None,
            cpu_memory: None,
            admin_listen: None,
            cpu_variant: None,
        }
    }
}

/// OpenMP spin count for local workers (see `LocalCluster::start`).
pub const WORKER_SPINCOUNT: &str = "10000";

/// A coordinator and its workers, started as children of this process.
pub struct LocalCluster {
    pub children: Vec<(String, Child)>,
    /// How each child was started (a worker is started again the same way).
    commands: Vec<Command>,
    /// When each child was restarted lately.
    restarts: Vec<Vec<Instant>>,
    quiet: bool,
}

/// A worker that exits more often than this within a minute is not
/// restarted again: something is wrong that a restart does not fix.
const MAX_RESTARTS_PER_MINUTE: usize = 5;

impl LocalCluster {
    /// Starts the processes (it does not wait for readiness). With `quiet`
    /// their output is discarded, otherwise forwarded with name prefixes.
    pub fn start(
        a: &UpArgs,
        model: &std::path::Path,
        threads: usize,
        quiet: bool,
    ) -> anyhow::Result<LocalCluster> {
        let coordinator_bin = sibling_binary("omni-coordinator")?;
        let worker_bin = sibling_binary("omni-gpu-worker")?;
        let mut cluster = LocalCluster {
            children: Vec::new(),
            commands: Vec::new(),
            restarts: Vec::new(),
            quiet,
        };
        let mut c = Command::new(&coordinator_bin);
        c.arg("--model")
            .arg(model)
            .args(["--listen", &a.listen])
            .args(["--workers", &a.stages.to_string()])
            .args(["--cpu-workers", &a.cpu_workers.to_string()])
            .args(["--ctx", &a.ctx.to_string()])
            .args(["--seqs", &a.seqs.to_string()])
            .args(["--transport", &a.transport])
            .args(["--register-timeout", &a.register_timeout.to_string()]);
        if let Some(s) = &a.split {
            c.args(["--split", s]);
        }
        if let Some(l) = &a.counts {
            c.args(["--counts", l]);
        }
        if let Some(f) = &a.admin_token_file {
            c.arg("--admin-token-file").arg(f);
        }
        if let Some(m) = &a.metrics {
            c.args(["--metrics-listen", m]);
        }
        if let Some(e) = &a.experts {
            c.args(["--experts", e]);
        }
        // The admin token, when set (OMNI_ADMIN_TOKEN, which omnictl's admin
        // verbs read too), reaches the coordinator through its environment
        // (OMNI_COORDINATOR_ADMIN_TOKEN), never a command line others can read.
        if let Some(t) = std::env::var("OMNI_ADMIN_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())
        {
            c.env("OMNI_COORDINATOR_ADMIN_TOKEN", t);
        }
        if let Some(l) = &a.admin_listen {
            c.args(["--admin-listen", l]);
        }
        if let Some(k) = a.gpu_experts {
            c.args(["--gpu-experts", &k.to_string()]);
        }
        if let Some(d) = &a.deterministic {
            c.args(["--deterministic", d]);
        }
        let traced = |cmd: &mut Command| {
            if let Some(e) = &a.otlp_endpoint {
                cmd.args(["--otlp-endpoint", e]);
            }
        };
        let variant = |cmd: &mut Command| {
            if let Some(v) = &a.cpu_variant {
                cmd.args(["--cpu-variant", v]);
            }
        };
        traced(&mut c);
        cluster.add("coordinator", c)?;
        // Workers start once the coordinator holds its port: until then a
        // worker's own port 0 could be given that very port.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while std::net::TcpStream::connect(&a.listen).is_err()
            && std::time::Instant::now() < deadline
            && matches!(cluster.children[0].1.try_wait(), Ok(None))
        {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        for i in 0..a.stages {
            let name = format!("w{i}");
            let mut w = Command::new(&worker_bin);
            // ggml's OpenMP threads spin after each graph; with several
            // stages on one machine an idle stage's spinning steals cores
            // from the busy one (2 stages ran at 0.65x of one stage with
            // the default spin, 0.8-1.2x with this). A user's value wins.
            if std::env::var_os("GOMP_SPINCOUNT").is_none() {
                w.env("GOMP_SPINCOUNT", WORKER_SPINCOUNT);
            }
            w.args(["--coordinator", &a.listen])
                .args(["--id", &name])
                .args(["--threads", &threads.to_string()])
                .args(["--register-timeout", &a.register_timeout.to_string()]);
            if let Some(m) = &a.memory {
                w.args(["--memory", m]);
            }
            if let Some(d) = a.device.get(i).or(a.device.last()) {
                w.args(["--device", &d.to_string()]);
            }
            traced(&mut w);
            variant(&mut w);
            cluster.add(&name, w)?;
        }
        for i in 0..a.cpu_workers {
            let name = format!("c{i}");
            let mut w = Command::new(sibling_binary("omni-cpu-worker")?);
            if std::env::var_os("GOMP_SPINCOUNT").is_none() {
                w.env("GOMP_SPINCOUNT", WORKER_SPINCOUNT);
            }
            w.args(["--coordinator", &a.listen])
                .args(["--id", &name])
                .args(["--register-timeout", &a.register_timeout.to_string()]);
            if a.numa {
                w.args(["--numa-node", &i.to_string()]);
            } else {
                w.args(["--threads", &threads.to_string()]);
            }
            if let Some(m) = &a.cpu_memory {
                w.args(["--memory", m]);
            }
            traced(&mut w);
            variant(&mut w);
            cluster.add(&name, w)?;
        }
        if a.port != 0 {
            // A split model is named by its prefix, not by one part.
            let name = match omni_engine::gguf::split::prefix_of(model) {
                Some((prefix, _, _)) => prefix.file_name().map(|s| s.to_os_string()),
                None => model.file_stem().map(|s| s.to_os_string()),
            }
            .map_or("model".into(), |s| s.to_string_lossy().into_owned());
            let mut r = Command::new(sibling_binary("omni-router")?);
            r.args(["--listen", &format!("127.0.0.1:{}", a.port)])
                .args([
                    "--model",
                    &format!("{name}={},{},default", a.listen, a.model),
                ]);
            // Keys reach the router as a file or through its environment
            // (OMNI_API_KEYS here, the router's OMNI_ROUTER_API_KEY), never
            // its command line.
            if let Some(f) = &a.api_key_file {
                r.arg("--api-keys-file").arg(f);
            }
            if let Some(k) = std::env::var("OMNI_API_KEYS")
                .ok()
                .filter(|k| !k.is_empty())
            {
                r.env("OMNI_ROUTER_API_KEY", k);
            }
            traced(&mut r);
            cluster.add("router", r)?;
        }
        Ok(cluster)
    }

    fn add(&mut self, name: &str, mut cmd: Command) -> anyhow::Result<()> {
        let child = spawn_logged(name, &mut cmd, self.quiet)?;
        self.children.push((name.to_string(), child));
        self.commands.push(cmd);
        self.restarts.push(Vec::new());
        Ok(())
    }

    /// Starts again every worker that exited, as its supervisor; fails
    /// when the coordinator or the router exited, or a worker keeps
    /// exiting.
    pub fn supervise(&mut self) -> anyhow::Result<()> {
        for i in 0..self.children.len() {
            let (name, child) = &mut self.children[i];
            let Ok(Some(status)) = child.try_wait() else {
                continue;
            };
            let name = name.clone();
            let how = omni_telemetry::crash::describe(&status);
            if name == "coordinator" || name == "router" {
                anyhow::bail!("{name} {how}; stopping the cluster (its log is above)");
            }
            let recent = &mut self.restarts[i];
            recent.retain(|t| t.elapsed() < Duration::from_secs(60));
            if recent.len() >= MAX_RESTARTS_PER_MINUTE {
                anyhow::bail!(
                    "{name} ended {} times within a minute, the last time it {how}; stopping the cluster (its log is above)",
                    recent.len() + 1
                );
            }
            recent.push(Instant::now());
            eprintln!("omnictl: {name} {how}; starting it again");
            // The new process tells the coordinator how the last one ended.
            self.commands[i].env(omni_telemetry::crash::LAST_EXIT_ENV, &how);
            let child = spawn_logged(&name, &mut self.commands[i], self.quiet)?;
            self.children[i].1 = child;
        }
        Ok(())
    }

    /// The first child that has exited, with its status.
    pub fn exited(&mut self) -> Option<(String, std::process::ExitStatus)> {
        self.children
            .iter_mut()
            .find_map(|(n, c)| c.try_wait().ok().flatten().map(|s| (n.clone(), s)))
    }

    /// Waits until the coordinator serves; fails if a child exits first.
    pub fn wait_ready(
        &mut self,
        addr: &str,
        timeout: Duration,
    ) -> anyhow::Result<omni_proto::coordinator::v1::InfoReply> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((name, status)) = self.exited() {
                anyhow::bail!(
                    "{name} {} before the cluster was ready",
                    omni_telemetry::crash::describe(&status)
                );
            }
            if let Ok(info) = rt.block_on(crate::remote::info(addr, Duration::from_secs(1))) {
                if info.ready {
                    return Ok(info);
                }
            }
            if Instant::now() > deadline {
                anyhow::bail!("the cluster was not ready within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn stop(mut self) {
        stop_all(&mut self.children);
    }
}

pub fn run(mut a: UpArgs) -> anyhow::Result<()> {
    if a.stages == 0 {
        anyhow::bail!("--stages must be at least 1");
    }
    if let Some(l) = &a.layers {
        anyhow::bail!("{}", crate::counts_not_layers(l));
    }
    if a.api_key.is_some() {
        anyhow::bail!(
            "--api-key would show the key to every user of this machine (ps); put it in a file and pass --api-key-file FILE, or set OMNI_API_KEYS"
        );
    }
    // Fail first on the real cause: a port in use is found here, in
    // milliseconds, not after the workers' retries.
    check_ports(&a)?;
    let token_note = admin_token(&mut a)?;
    let model = crate::resolve_model(&a.model)?;
    // Every worker gets every core: local stages share the CPUs, so the
    // coordinator has them take turns (one micro-batch group, see the
    // coordinator's pipeline.rs) and each step runs on all of them.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = a.threads.unwrap_or(cores);
    let warning = a
        .threads
        .and_then(|t| threads_warning(a.stages, a.cpu_workers, t, cores));
    if let Some(warning) = warning {
        eprintln!("omnictl: warning: {warning}");
    }

    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        ctrlc_handler(move || stop.store(true, Ordering::SeqCst))?;
    }
    let mut cluster = LocalCluster::start(&a, &model, threads, false)?;
    eprintln!(
        "omnictl: started a coordinator on {} and {} worker(s) with {threads} thread(s) each{}; Ctrl-C stops them",
        a.listen,
        a.stages,
        if a.cpu_workers > 0 {
            format!(" and {} expert worker(s)", a.cpu_workers)
        } else {
            String::new()
        }
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut announced = false;
    let result = loop {
        if stop.load(Ordering::SeqCst) {
            eprintln!("omnictl: stopping the cluster");
            break Ok(());
        }
        if let Err(e) = cluster.supervise() {
            break Err(e);
        }
        if !announced {
            if let Ok(info) = rt.block_on(crate::remote::info(&a.listen, Duration::from_secs(1))) {
                if info.ready {
                    announced = true;
                    eprintln!(
                        "omnictl: ready: {} on {} stage(s), Inference at {}",
                        info.model_path,
                        info.stages.len(),
                        a.listen
                    );
                    for s in &info.stages {
                        eprintln!(
                            "omnictl:   {} ({}): {}, output over {}",
                            s.worker_id, s.device, s.range, s.transport
                        );
                    }
                    if !info.pipeline_note.is_empty() {
                        eprintln!("omnictl:   {}", info.pipeline_note);
                    }
                    eprintln!(
                        "omnictl: try: omnictl generate --coordinator {} --prompt \"The capital of France is\" -n 32",
                        a.listen
                    );
                    if a.port != 0 {
                        eprintln!(
                            "omnictl: OpenAI API at http://127.0.0.1:{}/v1 (model \"{}\")",
                            a.port, a.model
                        );
                    }
                    eprintln!("omnictl: {token_note}");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    cluster.stop();
    result
}

/// Every address `up` will listen on, with the flag that sets it.
fn listen_addresses(a: &UpArgs) -> Vec<(&'static str, String)> {
    let mut out = vec![
        ("--listen", a.listen.clone()),
        (
            "--admin-listen",
            a.admin_listen
                .clone()
                .unwrap_or_else(|| "127.0.0.1:7071".into()),
        ),
    ];
    if let Some(m) = &a.metrics {
        out.push(("--metrics", m.clone()));
    }
    if a.port != 0 {
        out.push(("--port", format!("127.0.0.1:{}", a.port)));
    }
    out
}

/// Binds every address `up` will listen on (and lets go at once), so that
/// one in use is reported before anything starts, naming its flag.
pub fn check_ports(a: &UpArgs) -> anyhow::Result<()> {
    let addrs = listen_addresses(a);
    for (i, (flag, addr)) in addrs.iter().enumerate() {
        if let Some((other, _)) = addrs[..i].iter().find(|(_, x)| x == addr) {
            anyhow::bail!("{other} and {flag} both name {addr}: give each its own port");
        }
        if let Err(e) = std::net::TcpListener::bind(addr.as_str()) {
            anyhow::bail!(
                "{flag} {addr}: cannot listen there: {e} (another omni cluster? stop it, or pick another address with {flag})"
            );
        }
    }
    Ok(())
}

/// Makes sure the coordinator gets an admin token: OMNI_ADMIN_TOKEN when
/// set; else the file of --admin-token-file, made with a new token if it
/// is not there; else a new token in the file `omnictl` looks in for this
/// admin address. Returns the line that tells the user where it is.
fn admin_token(a: &mut UpArgs) -> anyhow::Result<String> {
    let addr = a
        .admin_listen
        .clone()
        .unwrap_or_else(|| "127.0.0.1:7071".into());
    if std::env::var("OMNI_ADMIN_TOKEN").is_ok_and(|t| !t.is_empty()) {
        a.admin_token_file = None;
        return Ok(format!(
            "admin API at {addr}, its token from OMNI_ADMIN_TOKEN"
        ));
    }
    let path = match &a.admin_token_file {
        Some(p) if p.exists() => {
            return Ok(format!(
                "admin API at {addr}, its token in {} (give omnictl --token-file)",
                p.display()
            ))
        }
        Some(p) => p.clone(),
        None => crate::admin::token_path(&addr),
    };
    write_new_token(&path)?;
    a.admin_token_file = Some(path.clone());
    let find = if path == crate::admin::token_path(&addr) {
        "omnictl workers, top, plan and rebalance find it there"
    } else {
        "give omnictl --token-file"
    };
    Ok(format!(
        "admin API at {addr}, a new token in {} (readable by you only; {find})",
        path.display()
    ))
}

/// A random token (256 bits, hex) in a file only its owner can read.
fn write_new_token(path: &std::path::Path) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let mut raw = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut raw))
        .context("cannot read /dev/urandom for the admin token")?;
    let token: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("cannot make {}", dir.display()))?;
    }
    // A new file each time: an old one may have other permissions.
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot write the admin token to {}", path.display()))?;
    writeln!(f, "{token}")?;
    Ok(())
}

/// A warning when the threads asked for are more than the cores: a step
/// of a local stage runs on all its threads (stages take turns), and
/// expert workers compute at the same time as the stages.
fn threads_warning(
    stages: usize,
    cpu_workers: usize,
    threads: usize,
    cores: usize,
) -> Option<String> {
    let at_once = threads * (1 + cpu_workers);
    (at_once > cores).then(|| {
        let who = if cpu_workers > 0 {
            format!("a stage and {cpu_workers} expert worker(s) computing at once")
        } else {
            format!("each of the {stages} stage(s) (they take turns)")
        };
        format!(
            "{stages} stage(s) x {threads} thread(s): {who} would run {at_once} threads on this machine's {cores} cores, and threads that wait for a core slow every step; give --threads {} or leave it out",
            (cores / (1 + cpu_workers)).max(1)
        )
    })
}

/// SIGTERM to every child, then SIGKILL to whatever is left after 5 s.
fn stop_all(children: &mut [(String, Child)]) {
    for (_, c) in children.iter_mut() {
        if c.try_wait().ok().flatten().is_none() {
            let pid = nix::unistd::Pid::from_raw(c.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for (name, c) in children.iter_mut() {
        loop {
            match c.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() > deadline => {
                    eprintln!("omnictl: {name} did not stop; killing it");
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

/// Starts `cmd` with its stdout and stderr forwarded line by line, each line
/// prefixed with `[name]`.
fn spawn_logged(name: &str, cmd: &mut Command, quiet: bool) -> anyhow::Result<Child> {
    // A group of its own: Ctrl-C reaches omnictl only, which then stops
    // the children in order instead of racing them.
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
    // Colour in the children's logs only when this process's own output
    // goes to a terminal: a redirected `up` writes no escape codes.
    if std::env::var_os("OMNI_LOG_COLOR").is_none() {
        let colour = !quiet && omni_telemetry::log_colour();
        cmd.env("OMNI_LOG_COLOR", if colour { "1" } else { "0" });
    }
    if quiet {
        cmd.stdout(Stdio::null()).stderr(Stdio::null());
        return cmd
            .spawn()
            .with_context(|| format!("cannot start {name} ({:?})", cmd.get_program()));
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {name} ({:?})", cmd.get_program()))?;
    let out = child.stdout.take().expect("piped");
    let err = child.stderr.take().expect("piped");
    for (stream, is_err) in [
        (Box::new(out) as Box<dyn std::io::Read + Send>, false),
        (Box::new(err), true),
    ] {
        let prefix = format!("[{name}] ");
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if is_err {
                    eprintln!("{prefix}{line}");
                } else {
                    println!("{prefix}{line}");
                }
            }
        });
    }
    Ok(child)
}

/// Ctrl-C and SIGTERM set the flag; the main loop stops the children.
fn ctrlc_handler(f: impl Fn() + Send + 'static) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::spawn(move || {
        rt.block_on(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("installing a SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        });
        f();
    });
    Ok(())
}
