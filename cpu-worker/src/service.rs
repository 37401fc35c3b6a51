//! The expert worker's service: it registers with the coordinator as an
//! expert worker, loads the routed experts of the layers it is given
//! (`Experts.LoadExperts`, memory-mapped; pages land on the bound node) and
//! computes them for the stages that offloaded them, over shared memory
//! (`Experts.OpenShm`) or gRPC (`Experts.Compute`).
//!
//! One compute thread ([`crate::compute`]) owns the [`ExpertStage`] (and
//! through it ggml's threads, pinned with the process) and every session:
//! calls from several stages are computed one at a time, each with every
//! core of the node.

use crate::compute::{Computer, Session};
use crate::numa::Binding;
use omni_engine::{ExpertConfig, ExpertStage, ModelFile};
use omni_proto::coordinator::v1::WorkerKind;
use omni_proto::worker::v1::{
    experts_server, Frame, Inventory, LoadExpertsReply, LoadExpertsRequest, OpenShmReply,
    OpenShmRequest,
};
use omni_runtime::WorkerError;
use omni_transport::experts::{accept_shm, ring_bytes};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

/// Settings of one expert worker (flags, or `OMNI_CPU_WORKER_*` variables).
#[derive(Clone, Debug, clap::Args)]
pub struct CpuWorkerConfig {
    /// The coordinator's gRPC address (host:port).
    #[arg(long)]
    pub coordinator: String,
    /// The NUMA node whose cores and memory this worker uses. Without it
    /// (or on a machine with no NUMA nodes) it runs unbound.
    #[arg(long)]
    pub numa_node: Option<u32>,
    /// Where this worker listens (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// The address others use to reach this worker, when it differs.
    #[arg(long)]
    pub advertise: Option<String>,
    /// This worker's name in plans, logs and metrics (default: c-<pid>).
    #[arg(long)]
    pub id: Option<String>,
    /// Compute threads (default: every core of the node, or of the process).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Offer at most this much memory to the planner (e.g. 200GiB or 200GB:
    /// GB = 10^9 bytes, GiB = 2^30). It caps this worker alone: with stage
    /// workers on the CPU of the same host it shares the host's RAM in the
    /// plan (together they get the largest of their offers, not the sum).
    #[arg(long, value_parser = parse_size)]
    pub memory: Option<u64>,
    /// Where the shared-memory rings live.
    #[arg(long, default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// How long (µs) the compute thread spins for the next call before it
    /// sleeps. Default: 2000 when this worker is pinned to some of the
    /// machine's cores (`--numa-node` on a machine of several nodes,
    /// `taskset`, a container's cpuset), else 50; a sleeping thread's
    /// wake-up costs tens of µs or more a call.
    #[arg(long)]
    pub spin_us: Option<u64>,
    /// Prometheus metrics (GET /metrics) listen address.
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// Give up if the coordinator cannot be reached for this long (seconds).
    #[arg(long, default_value_t = 60.0)]
    pub register_timeout: f64,
    /// How long this worker keeps its experts once its coordinator is gone
    /// (seconds): a coordinator that comes back at the same address within
    /// it keeps them instead of loading again. 0: exit as soon as another
    /// coordinator answers.
    #[arg(long, default_value_t = omni_runtime::registry::DEFAULT_ORPHAN_GRACE)]
    pub orphan_grace: f64,
    /// Compute with this ggml CPU variant (x64, sse42, sandybridge, haswell,
    /// skylakex, icelake, zen4, alderlake, ...) instead of the best one this
    /// CPU runs: a way around a variant that misbehaves here.
    #[arg(long)]
    pub cpu_variant: Option<String>,
    #[command(flatten)]
    pub telemetry: omni_telemetry::TelemetryArgs,
    #[command(flatten)]
    pub tls: omni_transport::tls::TlsArgs,
}

impl CpuWorkerConfig {
    /// `--id`, or c-<pid>.
    pub fn worker_id(&self) -> String {
        self.id
            .clone()
            .unwrap_or_else(|| format!("c-{}", std::process::id()))
    }
}

fn parse_size(s: &str) -> Result<u64, String> {
    omni_engine::parse_size(s)
}

/// What the worker counts (metrics).
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub calls: AtomicU64,
    pub tokens: AtomicU64,
    pub compute_us: AtomicU64,
    pub errors: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
}

/// The loaded experts (the compute thread has them): what sessions need.
struct Loaded {
    ring: usize,
    layers: Vec<u32>,
    /// The request that loaded them and its reply (a new coordinator that
    /// asks for the same keeps them).
    request: LoadExpertsRequest,
    reply: LoadExpertsReply,
}

struct Worker {
    id: String,
    cfg: CpuWorkerConfig,
    threads: usize,
    binding: String,
    loaded: Mutex<Option<Loaded>>,
    computer: Computer,
    stats: Arc<Stats>,
    sessions: AtomicU64,
    stop: Arc<AtomicBool>,
}

/// `node 0 (CPUs 0-15)`, or why the worker is not bound.
pub fn describe(b: &Binding) -> String {
    match b {
        Binding::Bound {
            node,
            cpus,
            memory_refused,
        } => {
            let mut s = format!("node {node} ({} CPUs)", cpus.len());
            if let Some(why) = memory_refused {
                s.push_str(&format!("; memory not bound: {why}"));
            }
            s
        }
        Binding::Unbound { why } => format!("unbound ({why})"),
    }
}

/// Runs the worker until the process is stopped. `binding` is what the
/// caller did before any thread started.
pub async fn run(cfg: CpuWorkerConfig, binding: Binding) -> anyhow::Result<()> {
    omni_transport::tls::install(&cfg.tls)?;
    let id = cfg.worker_id();
    let bound_cpus = match &binding {
        Binding::Bound { cpus, .. } => Some(cpus.len()),
        Binding::Unbound { .. } => None,
    };
    let threads = cfg
        .threads
        .or(bound_cpus)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let cpu = omni_engine::cpu_backend(cfg.cpu_variant.as_deref())?;
    tracing::info!("ggml CPU backend: {cpu}");
    let last_exit =
        omni_telemetry::crash::arm("omni-cpu-worker", &id, &cfg.coordinator, &cpu.variant);
    let mut inventory = inventory(&binding, threads, cfg.memory)?;
    inventory.cpu_variant = cpu.variant.clone();
    inventory.cpu_features = cpu.features.clone();
    let binding = describe(&binding);
    let (listener, local) = omni_runtime::registry::listen(&cfg.listen, &cfg.coordinator).await?;
    let advertise = cfg.advertise.clone().unwrap_or_else(|| local.to_string());
    let spin = cfg.spin_us.map_or_else(
        || omni_transport::experts::spin_for(omni_telemetry::cpus::pinned()),
        std::time::Duration::from_micros,
    );
    tracing::info!(
        "expert worker {id} listening on {local}: {binding}, {threads} threads, {:.2} GiB offered; between calls it spins {} µs, then sleeps",
        inventory.memory_free as f64 / (1u64 << 30) as f64,
        spin.as_micros()
    );
    let stats = Arc::<Stats>::default();
    let stop = Arc::new(AtomicBool::new(false));
    let computer = Computer::start(
        &id,
        &cfg.shm_dir,
        &format!("omni-{id}-{}-doorbell", std::process::id()),
        spin,
        stats.clone(),
        stop.clone(),
    )?;
    let worker = Arc::new(Worker {
        id: id.clone(),
        cfg: cfg.clone(),
        threads,
        binding,
        loaded: Mutex::new(None),
        computer,
        stats,
        sessions: AtomicU64::new(0),
        stop,
    });
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<experts_server::ExpertsServer<Svc>>()
        .await;
    let server = omni_transport::tls::server()
        .add_service(health)
        .add_service(
            experts_server::ExpertsServer::new(Svc(worker.clone()))
                .max_decoding_message_size(256 << 20)
                .max_encoding_message_size(256 << 20),
        )
        .serve_with_incoming(omni_transport::tls::incoming(listener));
    let server = tokio::spawn(server);
    if let Some(addr) = &cfg.metrics_listen {
        let w = worker.clone();
        omni_runtime::metrics::serve(addr, Arc::new(move || w.render_metrics())).await?;
    }
    let who = omni_runtime::registry::Identity {
        id: &id,
        advertise: &advertise,
        inventory,
        kind: WorkerKind::Experts,
    };
    let instance = omni_runtime::registry::register(
        &cfg.coordinator,
        cfg.register_timeout,
        &who,
        last_exit.as_deref(),
        Default::default(),
    )
    .await?;
    let held = || omni_runtime::registry::Held {
        stage: None,
        experts: worker
            .loaded
            .lock()
            .unwrap()
            .as_ref()
            .map(|l| (l.request.model_path.clone(), l.layers.clone())),
    };
    let grace = std::time::Duration::from_secs_f64(cfg.orphan_grace.max(0.0));
    let r = omni_runtime::registry::serve_while_coordinator_lives(
        server,
        &cfg.coordinator,
        instance,
        grace,
        &who,
        held,
    )
    .await;
    worker.stop.store(true, Ordering::Relaxed);
    r?;
    tracing::info!("expert worker {id} stopped");
    Ok(())
}

/// What this worker offers: the bound node's memory (or the machine's),
/// capped by `--memory`, and its cores.
fn inventory(binding: &Binding, threads: usize, cap: Option<u64>) -> anyhow::Result<Inventory> {
    let mut sys = sysinfo::System::new();
    sys.refresh_memory();
    let (mut total, mut free) = (sys.total_memory(), sys.available_memory());
    let device = match binding {
        Binding::Bound { node, .. } => {
            // The node's own memory bounds what a bound process can get.
            if let Some(t) = crate::numa::nodes()?
                .into_iter()
                .find(|n| n.id == *node)
                .and_then(|n| n.mem_total)
            {
                total = total.min(t);
                free = free.min(t);
            }
            format!("numa:{node}")
        }
        Binding::Unbound { .. } => "cpu".to_string(),
    };
    if let Some(cap) = cap {
        total = total.min(cap);
        free = free.min(cap);
    }
    Ok(Inventory {
        device,
        device_name: "routed experts".into(),
        memory_total: total,
        memory_free: free,
        numa_nodes: crate::numa::nodes().map_or(0, |n| n.len()) as u32,
        cpu_cores: threads as u32,
        hostname: sysinfo::System::host_name().unwrap_or_default(),
        host_id: omni_transport::host_id(),
        nvml: false,
        ..Default::default()
    })
}

impl Worker {
    fn load(&self, req: LoadExpertsRequest) -> Result<LoadExpertsReply, Status> {
        let t = Instant::now();
        let fail = |e: &dyn std::fmt::Display| {
            Status::from(WorkerError::refused(format!(
                "expert worker {}: {e}",
                self.id
            )))
        };
        if let Some(l) = self.loaded.lock().unwrap().as_ref() {
            if l.request == req {
                // This worker outlived its coordinator and the new one asks
                // for what it holds: nothing to load.
                tracing::info!(
                    "kept the experts of layers {:?} for the new coordinator (no load)",
                    l.layers
                );
                return Ok(LoadExpertsReply {
                    kept: true,
                    ..l.reply.clone()
                });
            }
        }
        // Free the previous experts first, so their memory is there for the new ones.
        *self.loaded.lock().unwrap() = None;
        self.computer.set_experts(None);
        let model = ModelFile::open(&req.model_path).map_err(|e| fail(&e))?;
        let hp = &model.hparams;
        let n_embd = hp.n_embd as usize;
        let n_used = hp.moe.as_ref().map_or(1, |m| m.n_expert_used as usize);
        let n_ubatch = req.n_ubatch.max(1) as usize;
        tracing::info!(
            "loading the experts of layers {:?} of {}",
            req.layers,
            req.model_path
        );
        let stage = ExpertStage::load(
            model,
            &req.layers,
            ExpertConfig {
                n_ubatch,
                n_threads: self.threads,
                repack: true,
            },
        )
        .map_err(|e| fail(&e))?;
        let reply = LoadExpertsReply {
            weight_bytes: stage.weight_bytes(),
            compute_bytes: stage.compute_bytes() as u64,
            load_seconds: t.elapsed().as_secs_f64(),
            binding: self.binding.clone(),
            kept: false,
        };
        let layers = stage.layers().to_vec();
        self.computer.set_experts(Some(stage));
        *self.loaded.lock().unwrap() = Some(Loaded {
            ring: ring_bytes(n_ubatch, n_embd, n_used),
            layers: layers.clone(),
            request: req.clone(),
            reply: reply.clone(),
        });
        tracing::info!(
            "loaded the experts of layers {layers:?} ({}) in {:.2}s",
            omni_engine::fmt_bytes(reply.weight_bytes),
            reply.load_seconds
        );
        Ok(reply)
    }

    fn render_metrics(&self) -> String {
        use prometheus_client::metrics::{counter::ConstCounter, gauge::ConstGauge};
        let mut r = prometheus_client::registry::Registry::with_prefix("omni_cpu_worker");
        let s = &self.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        r.register(
            "calls",
            "Expert calls computed",
            ConstCounter::new(get(&s.calls)),
        );
        r.register(
            "tokens",
            "Tokens whose experts were computed",
            ConstCounter::new(get(&s.tokens)),
        );
        r.register(
            "compute_seconds",
            "Time spent computing experts",
            ConstCounter::new(get(&s.compute_us) as f64 / 1e6),
        );
        r.register(
            "call_errors",
            "Calls answered with an error",
            ConstCounter::new(get(&s.errors)),
        );
        r.register(
            "bytes_received",
            "Request bytes received",
            ConstCounter::new(get(&s.bytes_in)),
        );
        r.register(
            "bytes_sent",
            "Reply bytes sent",
            ConstCounter::new(get(&s.bytes_out)),
        );
        r.register(
            "sessions",
            "Sessions opened by stages",
            ConstCounter::new(self.sessions.load(Ordering::Relaxed)),
        );
        let n_layers = self
            .loaded
            .lock()
            .unwrap()
            .as_ref()
            .map_or(0, |l| l.layers.len());
        r.register(
            "layers",
            "Layers whose experts are loaded",
            ConstGauge::new(n_layers as i64),
        );
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).expect("writing to a String");
        out
    }
}

struct Svc(Arc<Worker>);

type ReplyStream =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<Frame, Status>> + Send>>;

#[tonic::async_trait]
impl experts_server::Experts for Svc {
    async fn load_experts(
        &self,
        req: Request<LoadExpertsRequest>,
    ) -> Result<Response<LoadExpertsReply>, Status> {
        let w = self.0.clone();
        let req = req.into_inner();
        tokio::task::spawn_blocking(move || w.load(req))
            .await
            .map_err(|e| Status::from(WorkerError::internal(e.to_string())))?
            .map(Response::new)
    }

    async fn open_shm(
        &self,
        req: Request<OpenShmRequest>,
    ) -> Result<Response<OpenShmReply>, Status> {
        let req = req.into_inner();
        let w = self.0.clone();
        let reply = req.reply.ok_or_else(|| {
            Status::from(WorkerError::bad_request(
                "OpenShm needs the caller's reply ring",
            ))
        })?;
        let ring = w
            .loaded
            .lock()
            .unwrap()
            .as_ref()
            .map(|l| l.ring)
            .ok_or_else(|| {
                Status::from(WorkerError::refused(format!(
                    "expert worker {} has no experts loaded",
                    w.id
                )))
            })?;
        let doorbell = w.computer.doorbell().map_err(|why| {
            Status::from(WorkerError::refused(format!(
                "expert worker {} serves no shared-memory session: {why}",
                w.id
            )))
        })?;
        let n = w.sessions.fetch_add(1, Ordering::Relaxed);
        let name = format!("omni-{}-{}-session-{n}", w.id, std::process::id());
        let (rx, tx, ep) = accept_shm(&reply, &w.cfg.shm_dir, &name, ring)
            .map_err(|e| Status::from(WorkerError::refused(e.to_string())))?;
        tracing::info!(
            "{} computes experts here over shared memory ({name})",
            req.client
        );
        w.computer.add_session(Session {
            client: req.client,
            name,
            rx,
            tx,
        });
        Ok(Response::new(OpenShmReply {
            requests: Some(ep),
            doorbell: Some(doorbell),
        }))
    }

    type ComputeStream = ReplyStream;

    async fn compute(
        &self,
        req: Request<Streaming<Frame>>,
    ) -> Result<Response<Self::ComputeStream>, Status> {
        let w = self.0.clone();
        w.sessions.fetch_add(1, Ordering::Relaxed);
        let mut calls = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame, Status>>(4);
        tokio::spawn(async move {
            while let Some(frame) = calls.next().await {
                let Ok(frame) = frame else { break };
                let (done_tx, done_rx) = tokio::sync::oneshot::channel();
                w.computer.call(
                    frame,
                    Box::new(move |f| {
                        let _ = done_tx.send(f);
                    }),
                );
                let Ok(out) = done_rx.await else { break };
                if tx.send(Ok(out)).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}
