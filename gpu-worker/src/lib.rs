//! gpu-worker: runs one layer range of a model on one device.
//!
//! It listens for gRPC (Worker, Sink, grpc.health.v1), registers with the
//! coordinator and then does what it is told: `Load` a layer range (the GGUF
//! is memory-mapped), `Wire` its output to the next stage. From then on its stage
//! thread runs every frame that arrives and streams the output straight to
//! the next stage; the last stage samples and sends only tokens back.

pub mod exec;
pub mod inventory;

use anyhow::Context;
use exec::{Exec, ExecStats};
use omni_engine::model::ModelFile;
use omni_engine::stage::{HiddenDtype, LayerRange, Stage, StageConfig};
use omni_engine::KvConfig;
use omni_proto::coordinator::v1::{registry_client::RegistryClient, RegisterRequest};
use omni_proto::worker::v1::{
    worker_server, Endpoint, Inventory, LoadReply, LoadRequest, StatusReply, StatusRequest,
    Transport, WireReply, WireRequest,
};
use omni_transport::{Inbox, Outbox, TransportChoice};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::{Request, Response, Status};

/// Settings of one worker process (flags, or `OMNI_WORKER_*` variables).
#[derive(Clone, Debug, clap::Args)]
pub struct WorkerConfig {
    /// The coordinator's gRPC address (host:port).
    #[arg(long, env = "OMNI_COORDINATOR")]
    pub coordinator: String,
    /// Where this worker listens (port 0 picks a free port).
    #[arg(long, env = "OMNI_WORKER_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: String,
    /// The address others use to reach this worker, when it differs from
    /// the listening one (containers, 0.0.0.0).
    #[arg(long, env = "OMNI_WORKER_ADVERTISE")]
    pub advertise: Option<String>,
    /// This worker's name in plans, logs and metrics (default: w-<pid>).
    #[arg(long, env = "OMNI_WORKER_ID")]
    pub id: Option<String>,
    /// The device: `cpu` (CUDA arrives in a later release).
    #[arg(long, env = "OMNI_WORKER_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Compute threads (default: every core this process may use).
    #[arg(long, env = "OMNI_WORKER_THREADS")]
    pub threads: Option<usize>,
    /// Offer at most this much memory to the planner (e.g. 6GiB).
    #[arg(long, env = "OMNI_WORKER_MEMORY", value_parser = parse_size)]
    pub memory: Option<u64>,
    /// Where the shared-memory ring lives.
    #[arg(long, env = "OMNI_SHM_DIR", default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// Prometheus metrics (GET /metrics) listen address.
    #[arg(long, env = "OMNI_WORKER_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
    /// Give up if the coordinator cannot be reached for this long (seconds).
    #[arg(long, env = "OMNI_REGISTER_TIMEOUT", default_value_t = 60.0)]
    pub register_timeout: f64,
    #[command(flatten)]
    pub telemetry: omni_telemetry::TelemetryArgs,
}

impl WorkerConfig {
    /// This worker's name: `--id`, or w-<pid>.
    pub fn worker_id(&self) -> String {
        self.id
            .clone()
            .unwrap_or_else(|| format!("w-{}", std::process::id()))
    }
}

fn parse_size(s: &str) -> Result<u64, String> {
    omni_engine::parse_size(s)
}

struct State {
    exec: Option<Exec>,
    range: Option<LayerRange>,
    kv_cells: u64,
}

struct Worker {
    id: String,
    cfg: WorkerConfig,
    advertise: String,
    inventory: Inventory,
    inbox: Mutex<Inbox>,
    outbox: Arc<Mutex<Option<Outbox>>>,
    stats: Arc<ExecStats>,
    state: Mutex<State>,
}

/// Runs the worker until the process is stopped.
pub async fn run(cfg: WorkerConfig) -> anyhow::Result<()> {
    let id = cfg.worker_id();
    let inventory = inventory::read(&cfg.device, cfg.memory)?;
    for g in inventory::gpus() {
        tracing::info!("visible GPU: {g}");
    }
    let listener = tokio::net::TcpListener::bind(&cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let local = listener.local_addr()?;
    // Registering would reach this worker's own server (a port picked for
    // the coordinator and taken by this worker's port 0 meanwhile).
    if let Ok(addrs) = tokio::net::lookup_host(&cfg.coordinator).await {
        if addrs.into_iter().any(|a| a == local) {
            anyhow::bail!(
                "the coordinator address {} is this worker's own listening address; is the coordinator running there?",
                cfg.coordinator
            );
        }
    }
    let advertise = cfg.advertise.clone().unwrap_or_else(|| local.to_string());
    tracing::info!(
        "worker {id} listening on {local} (device {}, {:.2} GiB free of {:.2}, {} cores, {} NUMA nodes)",
        inventory.device,
        inventory.memory_free as f64 / GIB,
        inventory.memory_total as f64 / GIB,
        inventory.cpu_cores,
        inventory.numa_nodes
    );
    let inbox = Inbox::new();
    let sink = inbox.sink_service();
    let worker = Arc::new(Worker {
        id: id.clone(),
        cfg: cfg.clone(),
        advertise: advertise.clone(),
        inventory: inventory.clone(),
        inbox: Mutex::new(inbox),
        outbox: Arc::new(Mutex::new(None)),
        stats: Arc::default(),
        state: Mutex::new(State {
            exec: None,
            range: None,
            kv_cells: 0,
        }),
    });
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<worker_server::WorkerServer<Svc>>()
        .await;
    let server = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(health)
        .add_service(worker_server::WorkerServer::new(Svc(worker.clone())))
        .add_service(sink)
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    let server = tokio::spawn(server);
    if let Some(addr) = &cfg.metrics_listen {
        let w = worker.clone();
        omni_transport::metrics::serve(addr, Arc::new(move || w.render_metrics())).await?;
    }
    register(&cfg, &id, &advertise, inventory).await?;
    server.await??;
    tracing::info!("worker {id} stopped");
    Ok(())
}

const GIB: f64 = (1u64 << 30) as f64;

/// Registers with the coordinator, retrying until `register_timeout`.
async fn register(
    cfg: &WorkerConfig,
    id: &str,
    advertise: &str,
    inventory: Inventory,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs_f64(cfg.register_timeout);
    let url = format!("http://{}", cfg.coordinator);
    let mut last_err = String::new();
    while Instant::now() < deadline {
        match RegistryClient::connect(url.clone()).await {
            Ok(mut c) => {
                let req = RegisterRequest {
                    worker_id: id.to_string(),
                    grpc_addr: advertise.to_string(),
                    inventory: Some(inventory.clone()),
                };
                match c.register(req).await {
                    Ok(r) => {
                        tracing::info!(
                            "registered with the coordinator at {} (model {})",
                            cfg.coordinator,
                            r.into_inner().model_path
                        );
                        return Ok(());
                    }
                    // The coordinator answered and said no: retrying won't help.
                    Err(s) if s.code() != tonic::Code::Unavailable => {
                        anyhow::bail!(
                            "the coordinator at {} refused worker {id}: {} ({:?})",
                            cfg.coordinator,
                            s.message(),
                            s.code()
                        )
                    }
                    Err(s) => last_err = s.message().to_string(),
                }
            }
            Err(e) => last_err = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!(
        "could not register with the coordinator at {} within {:.0}s: {last_err}",
        cfg.coordinator,
        cfg.register_timeout
    )
}

struct Svc(Arc<Worker>);

#[tonic::async_trait]
impl worker_server::Worker for Svc {
    async fn load(&self, req: Request<LoadRequest>) -> Result<Response<LoadReply>, Status> {
        let req = req.into_inner();
        let w = self.0.clone();
        tokio::task::spawn_blocking(move || w.load(req))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map(Response::new)
    }

    async fn wire(&self, req: Request<WireRequest>) -> Result<Response<WireReply>, Status> {
        let req = req.into_inner();
        let next = req
            .next
            .ok_or_else(|| Status::invalid_argument("Wire needs the next endpoint"))?;
        let choice = match Transport::try_from(req.transport).unwrap_or(Transport::Auto) {
            Transport::Auto => TransportChoice::Auto,
            Transport::Shm => TransportChoice::Shm,
            Transport::Grpc => TransportChoice::Grpc,
        };
        let outbox = Outbox::connect(&next, choice)
            .await
            .map_err(|e| Status::unavailable(format!("worker {}: {e}", self.0.id)))?;
        let kind = outbox.kind();
        tracing::info!("output goes to {} over {kind}", next.grpc_addr);
        *self.0.outbox.lock().unwrap() = Some(outbox);
        Ok(Response::new(WireReply {
            transport: kind.to_string(),
        }))
    }

    async fn status(&self, _: Request<StatusRequest>) -> Result<Response<StatusReply>, Status> {
        let w = &self.0;
        let st = w.state.lock().unwrap();
        Ok(Response::new(StatusReply {
            worker_id: w.id.clone(),
            loaded: st.exec.is_some(),
            range: st.range.as_ref().map(|r| r.to_string()).unwrap_or_default(),
            kv_cells_used: w.stats.kv_cells_used.load(Ordering::Relaxed),
            kv_cells_total: st.kv_cells,
            steps: w.stats.steps.load(Ordering::Relaxed),
            last_step_ms: w.stats.last_step_us.load(Ordering::Relaxed) as f64 / 1e3,
        }))
    }
}

impl Worker {
    /// The Prometheus text for this worker, read from its counters.
    fn render_metrics(&self) -> String {
        use prometheus_client::metrics::{counter::ConstCounter, gauge::ConstGauge};
        let mut r = prometheus_client::registry::Registry::with_prefix("omni_worker");
        let s = &self.stats;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        r.register(
            "steps",
            "Steps this stage ran",
            ConstCounter::new(get(&s.steps)),
        );
        r.register(
            "tokens",
            "Tokens this stage ran",
            ConstCounter::new(get(&s.tokens)),
        );
        r.register(
            "step_compute_seconds",
            "Compute time of all steps",
            ConstCounter::new(get(&s.total_step_us) as f64 / 1e6),
        );
        r.register(
            "last_step_ms",
            "Compute time of the last step",
            ConstGauge::new(get(&s.last_step_us) as f64 / 1e3),
        );
        r.register(
            "kv_cells_used",
            "KV cache cells in use",
            ConstGauge::new(get(&s.kv_cells_used) as i64),
        );
        r.register(
            "step_errors",
            "Steps that failed",
            ConstCounter::new(get(&s.errors)),
        );
        let inbox = self.inbox.lock().unwrap().stats.clone();
        r.register(
            "bytes_received",
            "Frame bytes received (both transports)",
            ConstCounter::new(get(&inbox.bytes_received)),
        );
        r.register(
            "frames_received",
            "Frames received",
            ConstCounter::new(get(&inbox.frames_received)),
        );
        if let Some(o) = self.outbox.lock().unwrap().as_ref() {
            let sub = r.sub_registry_with_label(("transport".into(), o.kind().into()));
            sub.register(
                "bytes_sent",
                "Frame bytes sent to the next stage",
                ConstCounter::new(get(&o.stats.bytes_sent)),
            );
            sub.register(
                "frames_sent",
                "Frames sent to the next stage",
                ConstCounter::new(get(&o.stats.frames_sent)),
            );
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).expect("writing to a String");
        out
    }

    fn load(&self, req: LoadRequest) -> Result<LoadReply, Status> {
        let t = Instant::now();
        let range = LayerRange {
            embed: req.embed,
            layers: req.layer_start..req.layer_end,
            head: req.head,
        };
        tracing::info!("loading {range} of {}", req.model_path);
        // Drop a previous stage first, so its memory is free for the new one.
        self.state.lock().unwrap().exec = None;
        let model = ModelFile::open(&req.model_path)
            .map_err(|e| Status::invalid_argument(format!("worker {}: {e}", self.id)))?;
        let cfg = StageConfig {
            kv: KvConfig {
                n_ctx: req.n_ctx as usize,
                n_seq: req.n_seq as usize,
            },
            n_ubatch: req.n_ubatch as usize,
            n_threads: self
                .cfg
                .threads
                .unwrap_or(self.inventory.cpu_cores as usize),
            repack: true,
        };
        let n_embd = model.hparams.n_embd as usize;
        let stage = Stage::load(model, range.clone(), cfg.clone())
            .map_err(|e| Status::failed_precondition(format!("worker {}: {e}", self.id)))?;
        let hp = &stage.model().hparams;
        let reply_bytes = (
            stage.weights().mapped_bytes + stage.weights().repacked_bytes,
            cfg.kv.bytes(hp, range.layers.len()),
            stage.compute_bytes() as u64,
        );
        // Room for a few full micro-batches of f32 hidden state in flight.
        let frame = 64 * 1024 + cfg.n_ubatch * n_embd * 4;
        let mut inbox = self.inbox.lock().unwrap();
        let name = format!("omni-{}-{}", self.id, std::process::id());
        if let Err(e) = inbox.add_ring(&self.cfg.shm_dir, &name, 4 * frame) {
            tracing::warn!("no shared-memory ring ({e}); receiving over gRPC only");
        }
        let inbox_ep: Endpoint = inbox.endpoint(&self.advertise, &self.inventory.host_id);
        let dtype = if req.f16_hidden {
            HiddenDtype::F16
        } else {
            HiddenDtype::F32
        };
        let exec = Exec::start(
            stage,
            req.stage,
            dtype,
            inbox.receiver().clone(),
            self.outbox.clone(),
            self.stats.clone(),
        );
        let mut st = self.state.lock().unwrap();
        st.exec = Some(exec);
        st.range = Some(range.clone());
        st.kv_cells = cfg.kv.n_cells() as u64;
        let secs = t.elapsed().as_secs_f64();
        tracing::info!("loaded {range} in {secs:.2}s");
        Ok(LoadReply {
            weight_bytes: reply_bytes.0,
            kv_bytes: reply_bytes.1,
            compute_bytes: reply_bytes.2,
            load_seconds: secs,
            inbox: Some(inbox_ep),
        })
    }
}
