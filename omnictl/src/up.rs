//! `omnictl up`: a local cluster — one coordinator and N CPU-backed workers
//! as child processes of this one. Every child's log lines are prefixed with
//! its name. It is also their supervisor: a worker that exits (a crash, an
//! OOM kill) is started again with the same flags, registers again and the
//! coordinator recovers; a coordinator or the router that exits is started
//! again too (a coordinator's workers keep their layers for it, the router
//! resumes its requests), so that each process can be restarted on a new
//! binary in turn; on Ctrl-C or SIGTERM all of them are stopped.

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
    /// GGUF path, or a known model name (fetched if missing). Repeat it as
    /// NAME=PATH[,KEY=VALUE...] to serve several models together, each with
    /// its own coordinator and workers, behind one router, planned together
    /// before anything loads (e.g. --model oracle=r1.gguf,device=cuda:0+cuda:1,cpu-workers=1
    /// --model executor=qwen2.5-coder-0.5b,threads=4,alias=coder). Settings:
    /// alias (repeatable), stages, device, threads, ctx, seqs, memory,
    /// cpu-workers, cpu-memory, experts, gpu-experts, split, counts (lists
    /// joined with '+'); the flags below are every model's defaults.
    #[arg(long, short)]
    pub model: Vec<String>,
    /// A settings file (default: ./omni.toml when there is one, or
    /// OMNI_CONFIG): its [up] table takes these flags' names as keys
    /// (`stages = 2`, `auto = [...]`), and its [[up.models]] tables the
    /// models (`name`, `model`, and the settings above: `device = ["cuda:0",
    /// "cpu"]`, `alias = ["coder"]`, `threads = 8`, ...), which --model
    /// replaces. OMNI_UP_<FLAG> variables come between the file and the flags.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Rules for the model name `auto` at the router, tried in order:
    /// prompt_chars>N=MODEL, keyword:WORD=MODEL, default=MODEL (repeatable,
    /// or ';'-separated), e.g. 'prompt_chars>2000=oracle;keyword:prove=oracle;default=executor'.
    #[arg(long, value_delimiter = ';')]
    pub auto: Vec<String>,
    /// The memory each worker offers, when the joint plan of several
    /// models set it (one entry per stage worker; none: --memory).
    #[arg(skip)]
    pub worker_memory: Vec<Option<String>>,
    /// Prefix of the children's names ("oracle." for several models).
    #[arg(skip)]
    pub prefix: String,
    /// The benchmarks' own settings per child (w0, c0, ...): the CPUs it
    /// may run on, and flags added to its command.
    #[arg(skip)]
    pub pin: std::collections::HashMap<String, Vec<usize>>,
    #[arg(skip)]
    pub extra_args: std::collections::HashMap<String, Vec<String>>,
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
    /// Compute threads per worker (default: every core, local stages taking
    /// turns on them; a GPU worker 4, for what its GPU does not compute).
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
    /// A draft model for speculative decoding (GGUF path or known name, with
    /// the model's vocabulary): the worker with the last stage loads it
    /// whole, and requests that turn speculation on (`speculative.n_max`,
    /// or OMNI_COORDINATOR_SPEC_TYPE=draft for all) draft with it. Per
    /// model: `draft=`.
    #[arg(long)]
    pub model_draft: Option<String>,
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
            model: vec![model.to_string()],
            config: None,
            auto: Vec::new(),
            worker_memory: Vec::new(),
            prefix: String::new(),
            pin: Default::default(),
            extra_args: Default::default(),
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
            model_draft: None,
            admin_listen: None,
            cpu_variant: None,
        }
    }
}

/// Compute threads of a local GPU worker unless `-t` gives them: its CPU
/// backend computes only what the GPU does not (the token embedding's rows,
/// ops the GPU's backend lacks), and every core's threads spinning there
/// beside an expert worker's made each expert call wait 15 times as long
/// (6.4 ms a step against 0.44 ms, on an H200 with 16 cores).
pub const GPU_WORKER_THREADS: usize = 4;

/// OpenMP spin count for local workers (see `LocalCluster::start`).
pub const WORKER_SPINCOUNT: &str = "10000";

/// A model the router serves: its name, its coordinator, its aliases.
struct Served {
    name: String,
    addr: String,
    aliases: Vec<String>,
}

/// The name a model file is served under: its stem (a split model's prefix).
fn served_name(model: &std::path::Path) -> String {
    match omni_engine::gguf::split::prefix_of(model) {
        Some((prefix, _, _)) => prefix.file_name().map(|s| s.to_os_string()),
        None => model.file_stem().map(|s| s.to_os_string()),
    }
    .map_or("model".into(), |s| s.to_string_lossy().into_owned())
}

/// A coordinator and its workers, started as children of this process.
pub struct LocalCluster {
    pub children: Vec<(String, Child)>,
    /// How each child was started (a worker is started again the same way).
    commands: Vec<Command>,
    /// When each child was restarted lately.
    restarts: Vec<Vec<Instant>>,
    quiet: bool,
    /// Every child that exits is started again, coordinators and the
    /// router too (a coordinator's workers register with the new process,
    /// keeping their layers; the router resumes requests and a new one
    /// takes the port), instead of stopping everything: `omnictl up` sets
    /// it, so that each process can be restarted (upgraded) in turn;
    /// benchmarks do not.
    pub restart_all: bool,
}

/// A worker that exits more often than this within a minute is not
/// restarted again: something is wrong that a restart does not fix.
const MAX_RESTARTS_PER_MINUTE: usize = 5;

/// The command of the child `name` running `bin`: under `taskset` when a
/// benchmark pins it to some CPUs, with a benchmark's extra flags.
fn child_command(a: &UpArgs, name: &str, bin: &std::path::Path) -> Command {
    let mut cmd = match a.pin.get(name) {
        Some(cpus) => {
            let list: Vec<String> = cpus.iter().map(usize::to_string).collect();
            let mut t = Command::new("taskset");
            t.args(["-c", &list.join(",")]).arg(bin);
            t
        }
        None => Command::new(bin),
    };
    if let Some(extra) = a.extra_args.get(name) {
        cmd.args(extra);
    }
    cmd
}

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
            restart_all: false,
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
        if let Some(d) = &a.model_draft {
            c.arg("--model-draft").arg(crate::resolve_model(d)?);
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
        cluster.add(&format!("{}coordinator", a.prefix), c)?;
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
            let mut w = child_command(a, &name, &worker_bin);
            let child_name = format!("{}{name}", a.prefix);
            // ggml's OpenMP threads spin after each graph; with several
            // stages on one machine an idle stage's spinning steals cores
            // from the busy one (2 stages ran at 0.65x of one stage with
            // the default spin, 0.8-1.2x with this). A user's value wins.
            if std::env::var_os("GOMP_SPINCOUNT").is_none() {
                w.env("GOMP_SPINCOUNT", WORKER_SPINCOUNT);
            }
            let device = a.device.get(i).or(a.device.last());
            let worker_threads = match device {
                Some(d) if d.is_gpu() && a.threads.is_none() => threads.min(GPU_WORKER_THREADS),
                _ => threads,
            };
            w.args(["--coordinator", &a.listen])
                .args(["--id", &name])
                .args(["--threads", &worker_threads.to_string()])
                .args(["--register-timeout", &a.register_timeout.to_string()]);
            if let Some(m) = a
                .worker_memory
                .get(i)
                .cloned()
                .flatten()
                .or(a.memory.clone())
            {
                w.args(["--memory", &m]);
            }
            if let Some(d) = device {
                w.args(["--device", &d.to_string()]);
            }
            traced(&mut w);
            variant(&mut w);
            cluster.add(&child_name, w)?;
        }
        for i in 0..a.cpu_workers {
            let name = format!("c{i}");
            let mut w = child_command(a, &name, &sibling_binary("omni-cpu-worker")?);
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
            cluster.add(&format!("{}{name}", a.prefix), w)?;
        }
        // A cluster of its own (the benchmarks'): its router too. `run`
        // starts one router in front of every model instead.
        if a.port != 0 {
            let served = [Served {
                name: served_name(model),
                addr: a.listen.clone(),
                aliases: vec![a.model[0].clone(), "default".into()],
            }];
            cluster.add_router(a, &served)?;
        }
        Ok(cluster)
    }

    /// The OpenAI router in front of `served` (every model of the launch),
    /// on `a.port`, with `a.auto`'s rules.
    fn add_router(&mut self, a: &UpArgs, served: &[Served]) -> anyhow::Result<()> {
        let mut r = Command::new(sibling_binary("omni-router")?);
        r.args(["--listen", &format!("127.0.0.1:{}", a.port)]);
        for m in served {
            let mut v = format!("{}={}", m.name, m.addr);
            for alias in &m.aliases {
                v.push(',');
                v.push_str(alias);
            }
            r.args(["--model", &v]);
        }
        for rule in &a.auto {
            r.args(["--auto", rule]);
        }
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
        if let Some(e) = &a.otlp_endpoint {
            r.args(["--otlp-endpoint", e]);
        }
        self.add("router", r)
    }

    /// Takes `other`'s children in (another model's processes).
    fn join(&mut self, other: LocalCluster) {
        self.children.extend(other.children);
        self.commands.extend(other.commands);
        self.restarts.extend(other.restarts);
    }

    fn add(&mut self, name: &str, mut cmd: Command) -> anyhow::Result<()> {
        let child = spawn_logged(name, &mut cmd, self.quiet)?;
        self.children.push((name.to_string(), child));
        self.commands.push(cmd);
        self.restarts.push(Vec::new());
        Ok(())
    }

    /// Starts again every worker that exited, as its supervisor; fails
    /// when the router or a coordinator exited (unless `restart_all`), or
    /// a process keeps exiting.
    pub fn supervise(&mut self) -> anyhow::Result<()> {
        for i in 0..self.children.len() {
            let (name, child) = &mut self.children[i];
            let Ok(Some(status)) = child.try_wait() else {
                continue;
            };
            let name = name.clone();
            let how = omni_telemetry::crash::describe(&status);
            let service = name == "router" || name.ends_with("coordinator");
            if service && !self.restart_all {
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

/// One model of a launch: how it is served, and its own settings (the
/// command's flags with its `--model` settings applied; with several
/// models, ports of its own and no router: one router serves them all).
struct UpModel {
    /// The name the router serves it under.
    name: String,
    aliases: Vec<String>,
    args: UpArgs,
    path: PathBuf,
    /// Threads of its stage workers and of each of its expert workers.
    threads: usize,
}

/// The settings a model's `--model` value may carry.
const MODEL_SETTINGS: &[&str] = &[
    "alias",
    "stages",
    "device",
    "threads",
    "ctx",
    "seqs",
    "memory",
    "cpu-workers",
    "cpu-memory",
    "experts",
    "gpu-experts",
    "split",
    "counts",
    "listen",
    "admin-listen",
    "draft",
];

/// `host:port` with the port moved up by `by`.
fn port_plus(addr: &str, by: usize) -> anyhow::Result<String> {
    if by == 0 {
        return Ok(addr.to_string());
    }
    let (host, port) = addr
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h, p.parse::<usize>().ok()?)))
        .with_context(|| format!("{addr} is not HOST:PORT"))?;
    Ok(format!("{host}:{}", port + by))
}

/// `omnictl up`'s place in the settings chain: the `[up]` table of the
/// config file, `OMNI_UP_<FLAG>` variables, then the flags.
pub const SERVICE: omni_runtime::config::Service = omni_runtime::config::Service {
    table: "up",
    env_prefix: "OMNI_UP_",
    not_settings: &[],
    structured: &["models"],
};

/// The config file's `[[up.models]]` tables as `--model` values
/// (`NAME=MODEL,KEY=VALUE...`, a list's items joined with `+`, `alias`
/// repeated), so that they go through the same checks as the flag.
pub fn file_models(
    structured: &toml::Table,
    file: &std::path::Path,
) -> anyhow::Result<Vec<String>> {
    let Some(models) = structured.get("models") else {
        return Ok(Vec::new());
    };
    let bad = |why: String| anyhow::anyhow!("{}: [[up.models]]: {why}", file.display());
    let models = models
        .as_array()
        .ok_or_else(|| bad("must be tables, as [[up.models]]".into()))?;
    let scalar = |v: &toml::Value| -> Option<String> {
        match v {
            toml::Value::String(s) => Some(s.clone()),
            toml::Value::Integer(i) => Some(i.to_string()),
            toml::Value::Float(f) => Some(f.to_string()),
            toml::Value::Boolean(b) => Some(b.to_string()),
            _ => None,
        }
    };
    let mut out = Vec::new();
    for (i, m) in models.iter().enumerate() {
        let t = m
            .as_table()
            .ok_or_else(|| bad(format!("entry {} is not a table", i + 1)))?;
        let get = |k: &str| t.get(k).and_then(toml::Value::as_str);
        let name = get("name").ok_or_else(|| bad(format!("entry {} has no name", i + 1)))?;
        let model = get("model").ok_or_else(|| {
            bad(format!(
                "model '{name}' has no model (a path or a known name)"
            ))
        })?;
        let mut spec = format!("{name}={model}");
        for (k, v) in t
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "name" | "model"))
        {
            let key = k.replace('_', "-");
            match v {
                toml::Value::Array(items) => {
                    let items = items
                        .iter()
                        .map(|x| scalar(x).ok_or_else(|| bad(format!("model '{name}': {k} holds a value that is not a string or number"))))
                        .collect::<anyhow::Result<Vec<_>>>()?;
                    if key == "alias" {
                        for a in items {
                            spec.push_str(&format!(",alias={a}"));
                        }
                    } else {
                        spec.push_str(&format!(",{key}={}", items.join("+")));
                    }
                }
                v => {
                    let v = scalar(v).ok_or_else(|| {
                        bad(format!(
                            "model '{name}': {k} is not a string, number or list"
                        ))
                    })?;
                    spec.push_str(&format!(",{key}={v}"));
                }
            }
        }
        out.push(spec);
    }
    Ok(out)
}

/// Every model of the launch with its own settings and ports.
fn up_models(a: &UpArgs) -> anyhow::Result<Vec<UpModel>> {
    use crate::models::{parse_all, plus_list, split_of};
    let specs = parse_all(&a.model)?;
    let several = specs.len() > 1;
    let mut out = Vec::new();
    for (i, mut spec) in specs.into_iter().enumerate() {
        let mut m = a.clone();
        m.model = vec![spec.model.clone()];
        let label = spec.label();
        // One model is also served as what --model said and as "default".
        let mut aliases = if several {
            Vec::new()
        } else {
            vec![spec.model.clone(), "default".into()]
        };
        aliases.extend(spec.take_all("alias"));
        if let Some(v) = spec.take_parsed("stages", str::parse::<usize>)? {
            m.stages = v;
        }
        if let Some(v) = spec.take_parsed("device", |v| {
            plus_list(v, str::parse::<omni_engine::Device>)
        })? {
            m.device = v;
        }
        if let Some(v) = spec.take_parsed("threads", str::parse::<usize>)? {
            m.threads = Some(v);
        }
        if let Some(v) = spec.take_parsed("ctx", str::parse::<usize>)? {
            m.ctx = v;
        }
        if let Some(v) = spec.take_parsed("seqs", str::parse::<usize>)? {
            m.seqs = v;
        }
        if let Some(v) = spec.take_parsed("memory", |v| {
            omni_planner::parse_size(v).map(|_| v.to_string())
        })? {
            m.memory = Some(v);
        }
        if let Some(v) = spec.take_parsed("cpu-memory", |v| {
            omni_planner::parse_size(v).map(|_| v.to_string())
        })? {
            m.cpu_memory = Some(v);
        }
        if let Some(v) = spec.take("draft")? {
            m.model_draft = Some(v);
        }
        if let Some(v) = spec.take_parsed("cpu-workers", str::parse::<usize>)? {
            m.cpu_workers = v;
        }
        if let Some(v) = spec.take_parsed("experts", |v| {
            <omni_planner::ExpertPolicy as clap::ValueEnum>::from_str(v, false)
                .map(|_| v.to_string())
        })? {
            m.experts = Some(v);
        }
        if let Some(v) = spec.take_parsed("gpu-experts", str::parse::<u32>)? {
            m.gpu_experts = Some(v);
        }
        match split_of(&mut spec)? {
            Some(omni_planner::Split::Proportions(p)) => {
                m.split = Some(p.iter().map(f64::to_string).collect::<Vec<_>>().join(","));
                m.counts = None;
            }
            Some(omni_planner::Split::Layers(c)) => {
                m.counts = Some(c.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
                m.split = None;
            }
            None => {}
        }
        let listen = spec.take("listen")?;
        let admin_listen = spec.take("admin-listen")?;
        spec.finish(MODEL_SETTINGS)?;
        if m.stages == 0 {
            anyhow::bail!("model '{label}': stages must be at least 1");
        }
        if several {
            // Model i: the coordinator's ports moved up by 2i (7070/7071,
            // 7072/7073, ...) unless it names its own, its metrics by i;
            // one router for all.
            m.listen = match listen {
                Some(l) => l,
                None => port_plus(&a.listen, 2 * i)?,
            };
            m.admin_listen = Some(match admin_listen {
                Some(l) => l,
                None => port_plus(a.admin_listen.as_deref().unwrap_or("127.0.0.1:7071"), 2 * i)?,
            });
            m.metrics = a.metrics.as_deref().map(|x| port_plus(x, i)).transpose()?;
            m.prefix = format!("{label}.");
        } else if listen.is_some() || admin_listen.is_some() {
            anyhow::bail!("model '{label}': listen and admin-listen are per-model settings of several models; with one, give --listen and --admin-listen");
        }
        // The router is started apart, in front of every model.
        m.port = 0;
        out.push(UpModel {
            name: spec.name.clone().unwrap_or_default(),
            aliases,
            args: m,
            path: PathBuf::new(),
            threads: 0,
        });
    }
    // Threads: one model gets every core (its stages take turns on them);
    // several compute at the same time, so the cores are split among them
    // (each model's stages, and each expert worker, one share), less what
    // the models given threads take.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if !several {
        out[0].threads = a.threads.unwrap_or(cores);
        return Ok(out);
    }
    let given: usize = out
        .iter()
        .filter_map(|m| m.args.threads.map(|t| t * (1 + m.args.cpu_workers)))
        .sum();
    let groups: usize = out
        .iter()
        .filter(|m| m.args.threads.is_none())
        .map(|m| 1 + m.args.cpu_workers)
        .sum();
    let shares = omni_planner::split_cores(cores.saturating_sub(given).max(groups), groups);
    let mut next = 0;
    for m in &mut out {
        m.threads = match m.args.threads {
            Some(t) => t,
            None => {
                let t = shares[next..next + 1 + m.args.cpu_workers]
                    .iter()
                    .copied()
                    .min()
                    .unwrap_or(1);
                next += 1 + m.args.cpu_workers;
                t
            }
        };
    }
    Ok(out)
}

/// The memory `device` has free now (a GPU as ggml reports it).
fn device_free(device: &str) -> anyhow::Result<u64> {
    let d: omni_engine::Device = device.parse().map_err(|e: String| anyhow::anyhow!(e))?;
    if d.gpu().is_none() {
        let mut sys = sysinfo::System::new();
        sys.refresh_memory();
        return Ok(sys.available_memory());
    }
    let p = omni_engine::device::gpu_props(d)
        .with_context(|| format!("cannot read {device}'s memory"))?;
    Ok(p.memory_free)
}

/// Plans every model together before anything starts (refusing a set that
/// does not fit, naming the model, the device and the numbers), prints the
/// plan, and caps each model's workers at its share of each device (what
/// it takes, and an equal part of what is left), so that each
/// coordinator's own plan, made on what its workers offer, stays inside it.
fn plan_together(models: &mut [UpModel]) -> anyhow::Result<()> {
    use crate::models::{worker, PlannedModel};
    let stage_device = |a: &UpArgs, i: usize| -> String {
        a.device
            .get(i)
            .or(a.device.last())
            .map_or("cpu".into(), |d| d.to_string())
    };
    let mut names: Vec<String> = Vec::new();
    let mut planned = Vec::new();
    for m in models.iter() {
        let a = &m.args;
        let cap = a
            .memory
            .as_deref()
            .map(omni_planner::parse_size)
            .transpose()
            .map_err(anyhow::Error::msg)?;
        let cpu_cap = a
            .cpu_memory
            .as_deref()
            .map(omni_planner::parse_size)
            .transpose()
            .map_err(anyhow::Error::msg)?;
        let workers: Vec<_> = (0..a.stages)
            .map(|i| worker(format!("w{i}"), &stage_device(a, i), cap))
            .collect();
        let experts: Vec<_> = (0..a.cpu_workers)
            .map(|i| worker(format!("c{i}"), "cpu", cpu_cap))
            .collect();
        for w in workers.iter().chain(&experts) {
            if !names.contains(&w.device) {
                names.push(w.device.clone());
            }
        }
        let file = omni_engine::ModelFile::open(&m.path)
            .with_context(|| format!("model '{}': cannot read {}", m.name, m.path.display()))?;
        let experts_policy = match &a.experts {
            Some(e) => <omni_planner::ExpertPolicy as clap::ValueEnum>::from_str(e, false)
                .map_err(anyhow::Error::msg)?,
            None => Default::default(),
        };
        let split = match (&a.split, &a.counts) {
            (Some(p), _) => Some(omni_planner::Split::Proportions(
                p.split(',')
                    .map(|x| x.trim().parse::<f64>())
                    .collect::<Result<_, _>>()?,
            )),
            (None, Some(c)) => Some(omni_planner::Split::Layers(
                c.split(',')
                    .map(|x| x.trim().parse::<u32>())
                    .collect::<Result<_, _>>()?,
            )),
            (None, None) => None,
        };
        planned.push(PlannedModel {
            name: m.name.clone(),
            file,
            workers,
            expert_workers: experts,
            cfg: omni_planner::PlanConfig {
                n_ctx: a.ctx,
                n_seq: a.seqs,
                split,
                experts: experts_policy,
                gpu_experts: a.gpu_experts.unwrap_or(0),
                ..Default::default()
            },
            threads: m.threads,
            expert_threads: m.threads,
        });
    }
    let devices = names
        .iter()
        .map(|n| {
            Ok(omni_planner::JointDevice {
                name: n.clone(),
                free: device_free(n)?,
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let headroom = omni_planner::PlanConfig::default().headroom;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let plan = crate::models::plan_models(&planned, &devices, headroom, cores)
        .context("the models do not fit this machine together; nothing was started")?;
    eprint!("{plan}");
    // Each model's share of each device, as the memory its workers offer.
    for m in models.iter_mut() {
        let share = |device: &str| -> Option<String> {
            let d = plan.devices.iter().find(|d| d.name == device)?;
            let mine = d.uses.iter().find(|u| u.model == m.name)?.total;
            let bytes = mine + d.left / d.uses.len() as u64;
            let offer = (bytes as f64 / (1.0 - headroom)) as u64;
            Some(format!("{}MiB", offer >> 20))
        };
        let a = &m.args;
        let mem: Vec<Option<String>> = (0..a.stages).map(|i| share(&stage_device(a, i))).collect();
        let cpu = share("cpu");
        // A user's own --memory, when smaller, still wins: the plan used it.
        let smaller = |given: &Option<String>, planned: Option<String>| match (given, planned) {
            (Some(g), Some(p)) => {
                let (gb, pb) = (
                    omni_planner::parse_size(g).unwrap_or(u64::MAX),
                    omni_planner::parse_size(&p).unwrap_or(u64::MAX),
                );
                Some(if gb < pb { g.clone() } else { p })
            }
            (g, p) => p.or_else(|| g.clone()),
        };
        let mem = mem.into_iter().map(|p| smaller(&a.memory, p)).collect();
        let cpu = if a.cpu_workers > 0 {
            smaller(&a.cpu_memory, cpu)
        } else {
            a.cpu_memory.clone()
        };
        m.args.worker_memory = mem;
        m.args.cpu_memory = cpu;
    }
    Ok(())
}

pub fn run(a: UpArgs) -> anyhow::Result<()> {
    if let Some(l) = &a.layers {
        anyhow::bail!("{}", crate::counts_not_layers(l));
    }
    if a.api_key.is_some() {
        anyhow::bail!(
            "--api-key would show the key to every user of this machine (ps); put it in a file and pass --api-key-file FILE, or set OMNI_API_KEYS"
        );
    }
    if a.model.is_empty() {
        anyhow::bail!(
            "no model: give --model PATH_OR_NAME (or NAME=PATH, repeated, for several), or [[up.models]] tables in omni.toml's [up]"
        );
    }
    let mut models = up_models(&a)?;
    let several = models.len() > 1;
    // Fail first on the real cause: a port in use is found here, in
    // milliseconds, not after the workers' retries.
    check_ports(&listen_addresses(&models, a.port))?;
    let mut token_notes = Vec::new();
    for m in &mut models {
        token_notes.push(admin_token(&mut m.args)?);
        m.path = crate::resolve_model(&m.args.model[0])?;
        if m.name.is_empty() {
            m.name = served_name(&m.path);
        }
        if let Some(warning) = m.args.threads.and_then(|t| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            threads_warning(m.args.stages, m.args.cpu_workers, t, cores)
        }) {
            eprintln!("omnictl: warning: {warning}");
        }
    }
    // A launch of several models is recorded where `omnictl workers` and
    // `plan` look for the first model's admin address, so that they show
    // every model; a launch of one removes an old record.
    let first_admin = models[0]
        .args
        .admin_listen
        .clone()
        .unwrap_or_else(|| "127.0.0.1:7071".into());
    let launch = crate::admin::launch_path(&first_admin);
    let _ = std::fs::remove_file(&launch);
    if several {
        plan_together(&mut models)?;
        let lines: String = models
            .iter()
            .map(|m| {
                let admin = m.args.admin_listen.as_deref().unwrap_or_default();
                format!("{} {admin}\n", m.name)
            })
            .collect();
        if let Some(dir) = launch.parent() {
            use std::os::unix::fs::DirBuilderExt;
            let _ = std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir);
        }
        std::fs::write(&launch, lines)
            .with_context(|| format!("cannot record the launch in {}", launch.display()))?;
    }

    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        ctrlc_handler(move || stop.store(true, Ordering::SeqCst))?;
    }
    let mut cluster: Option<LocalCluster> = None;
    for m in &models {
        let c = LocalCluster::start(&m.args, &m.path, m.threads, false)?;
        match &mut cluster {
            Some(all) => all.join(c),
            None => cluster = Some(c),
        }
        let a = &m.args;
        eprintln!(
            "omnictl: started {}a coordinator on {} and {} worker(s) with {} thread(s) each{}",
            if several {
                format!("'{}': ", m.name)
            } else {
                String::new()
            },
            a.listen,
            a.stages,
            m.threads,
            if a.cpu_workers > 0 {
                format!(" and {} expert worker(s)", a.cpu_workers)
            } else {
                String::new()
            }
        );
    }
    let mut cluster = cluster.expect("at least one model");
    // A coordinator or router that exits is started again: its workers
    // keep their layers for a coordinator, the router resumes its requests
    // (issue 42), so each process can be restarted on a new binary in turn.
    cluster.restart_all = true;
    if a.port != 0 {
        let served: Vec<Served> = models
            .iter()
            .map(|m| Served {
                name: m.name.clone(),
                addr: m.args.listen.clone(),
                aliases: m.aliases.clone(),
            })
            .collect();
        cluster.add_router(&a, &served)?;
    }
    eprintln!("omnictl: Ctrl-C stops them");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut announced = vec![false; models.len()];
    let result = loop {
        if stop.load(Ordering::SeqCst) {
            eprintln!("omnictl: stopping the cluster");
            break Ok(());
        }
        if let Err(e) = cluster.supervise() {
            break Err(e);
        }
        for (k, m) in models.iter().enumerate() {
            if announced[k] {
                continue;
            }
            let Ok(info) = rt.block_on(crate::remote::info(&m.args.listen, Duration::from_secs(1)))
            else {
                continue;
            };
            if !info.ready {
                continue;
            }
            announced[k] = true;
            let who = if several {
                format!("'{}' ", m.name)
            } else {
                String::new()
            };
            eprintln!(
                "omnictl: ready: {who}{} on {} stage(s), Inference at {}",
                info.model_path,
                info.stages.len(),
                m.args.listen
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
                m.args.listen
            );
            if a.port != 0 {
                let mut names = vec![format!("\"{}\"", m.name)];
                names.extend(m.aliases.iter().map(|x| format!("\"{x}\"")));
                eprintln!(
                    "omnictl: OpenAI API at http://127.0.0.1:{}/v1 (model {})",
                    a.port,
                    names.join(" or ")
                );
            }
            eprintln!("omnictl: {}", token_notes[k]);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    cluster.stop();
    if several {
        let _ = std::fs::remove_file(&launch);
    }
    result
}

/// Every address `up` will listen on, with the flag that sets it (and the
/// model, when there are several).
fn listen_addresses(models: &[UpModel], port: u16) -> Vec<(String, String)> {
    let several = models.len() > 1;
    let mut out = Vec::new();
    for m in models {
        let a = &m.args;
        let of = |flag: &str| {
            if several {
                format!("{flag} (model '{}')", m.args.prefix.trim_end_matches('.'))
            } else {
                flag.to_string()
            }
        };
        out.push((of("--listen"), a.listen.clone()));
        out.push((
            of("--admin-listen"),
            a.admin_listen
                .clone()
                .unwrap_or_else(|| "127.0.0.1:7071".into()),
        ));
        if let Some(x) = &a.metrics {
            out.push((of("--metrics"), x.clone()));
        }
    }
    if port != 0 {
        out.push(("--port".into(), format!("127.0.0.1:{port}")));
    }
    out
}

/// Binds every address `up` will listen on (and lets go at once), so that
/// one in use is reported before anything starts, naming its flag.
fn check_ports(addrs: &[(String, String)]) -> anyhow::Result<()> {
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
