//! gpu-worker: runs one layer range of a model on one device.
//!
//! It listens for gRPC (Worker, Sink, grpc.health.v1), registers with the
//! coordinator and then does what it is told: `Load` a layer range (the GGUF
//! is memory-mapped), `Wire` its output to the next stage. From then on its stage
//! thread runs every frame that arrives and streams the output straight to
//! the next stage; the last stage samples and sends only tokens back.

mod metrics;
mod moves;

pub mod exec;
pub mod experts;
pub mod inventory;

use exec::{Exec, ExecStats, Phase};
use experts::RemoteExperts;
use omni_engine::model::ModelFile;
use omni_engine::stage::{HiddenDtype, LayerRange, Stage, StageConfig};
use omni_engine::KvConfig;
use omni_proto::coordinator::v1::WorkerKind;
use omni_proto::worker::v1::{
    worker_server, Endpoint, ExportStateRequest, FinishReply, FinishRequest, Inventory, LoadReply,
    LoadRequest, OpenInboxReply, OpenInboxRequest, PrepareReply, PrepareRequest, ResetReply,
    ResetRequest, StateChunk, StatusReply, StatusRequest, SwitchReply, Transport, WireReply,
    WireRequest,
};
use omni_runtime::registry::{listen, register, serve_while_coordinator_lives, Held, Identity};
use omni_runtime::WorkerError;
use omni_transport::{ExpertLink, Inbox, Outbox, TransportChoice};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::{Request, Response, Status};

/// Settings of one worker process (flags, or `OMNI_WORKER_*` variables).
#[derive(Clone, Debug, clap::Args)]
pub struct WorkerConfig {
    /// The coordinator's gRPC address (host:port).
    #[arg(long)]
    pub coordinator: String,
    /// Where this worker listens (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// The address others use to reach this worker, when it differs from
    /// the listening one (containers, 0.0.0.0).
    #[arg(long)]
    pub advertise: Option<String>,
    /// This worker's name in plans, logs and metrics (default: w-<pid>).
    #[arg(long)]
    pub id: Option<String>,
    /// The device: `cpu`, or `cuda:N` (GPU N in PCI bus order, as
    /// nvidia-smi numbers them; needs the NVIDIA driver and the CUDA backend
    /// library `scripts/build-cuda` puts beside the binaries).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Memory of the device not to offer the planner (e.g. 2GiB; a unit is
    /// needed: GB = 10^9 bytes, GiB = 2^30; 0 for none). Default: 1GiB on a
    /// GPU (its CUDA context and cuBLAS workspaces), none on the CPU.
    #[arg(long, value_parser = parse_size)]
    pub reserve: Option<u64>,
    /// Compute threads (default: every core this process may use).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Compute with this ggml CPU variant (x64, sse42, sandybridge, haswell,
    /// skylakex, icelake, zen4, alderlake, ...) instead of the best one this
    /// CPU runs: a way around a variant that misbehaves here.
    #[arg(long)]
    pub cpu_variant: Option<String>,
    /// Offer at most this much memory to the planner (e.g. 6GiB or 6GB: GB =
    /// 10^9 bytes, GiB = 2^30). It caps this worker alone: workers on one
    /// host computing on the same memory (its RAM, or one GPU) share one
    /// budget in the plan, the largest of their offers, not the sum.
    #[arg(long, value_parser = parse_size)]
    pub memory: Option<u64>,
    /// Where the shared-memory ring lives.
    #[arg(long, default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// Prometheus metrics (GET /metrics) listen address.
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// Give up if the coordinator cannot be reached for this long (seconds).
    #[arg(long, default_value_t = 60.0)]
    pub register_timeout: f64,
    /// How long this worker keeps its layers and KV cache once its
    /// coordinator is gone (seconds): a coordinator that comes back at the
    /// same address within it keeps them instead of loading again. 0: exit
    /// as soon as another coordinator answers.
    #[arg(long, default_value_t = omni_runtime::registry::DEFAULT_ORPHAN_GRACE)]
    pub orphan_grace: f64,
    /// Fail a step when an expert worker has not answered for this many
    /// seconds (one that dies is noticed at once).
    #[arg(long, default_value_t = 60.0)]
    pub expert_timeout: f64,
    /// How long (µs) a wait for an expert worker's answer over shared
    /// memory spins before the stage's thread sleeps. Default: 2000 where
    /// the thread has a core of its own (a GPU stage, or a process pinned
    /// to some of the machine's cores), else 50; a sleeping thread's
    /// wake-up costs tens of µs or more a call.
    #[arg(long)]
    pub expert_spin_us: Option<u64>,
    /// With --gpu-experts (set by the coordinator), re-read the routing
    /// statistics and move the most used experts here every this many steps.
    #[arg(long, default_value_t = 32)]
    pub expert_reselect_steps: u64,
    /// With routed experts on an expert worker, what this stage computes
    /// while the expert worker computes (the tokens are the same either
    /// way). `on`: the shared experts, and with two or more sequences in a
    /// step one half of them while the expert worker computes the other
    /// half's experts; `shared`: the shared experts only; `off`: nothing,
    /// the two take turns (but for an expert worker reached over gRPC,
    /// taken to be on another host: the shared experts still overlap its
    /// work). `auto`: `on` for a GPU stage, whose compute does
    /// not take the expert worker's cores, `off` for a CPU stage, where
    /// computing at once pays only if the two have cores of their own
    /// (`taskset`, NUMA nodes: then say `on`).
    #[arg(long, value_enum, default_value_t = Overlap::Auto)]
    pub expert_overlap: Overlap,
    /// On a GPU stage with routed experts on an expert worker: compute a
    /// step's routed experts on the GPU, streaming their weights from host
    /// memory (llama.cpp's op offload), for steps of this many tokens or
    /// more (prompts), and send smaller ones (decoding) to the expert
    /// worker. `auto`: from the step size where streaming a layer's experts
    /// (timed at load) costs less than the expert worker's calls (timed as
    /// they come); `off`: never. Never below ggml's own offload threshold
    /// (GGML_OP_OFFLOAD_MIN_BATCH, 32). See docs/moe.md.
    #[arg(long, default_value_t = omni_engine::LocalExperts::Auto)]
    pub stream_experts: omni_engine::LocalExperts,
    #[command(flatten)]
    pub telemetry: omni_telemetry::TelemetryArgs,
    #[command(flatten)]
    pub tls: omni_transport::tls::TlsArgs,
}

/// `--expert-overlap`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overlap {
    Auto,
    On,
    Shared,
    Off,
}

impl WorkerConfig {
    /// This worker's name: `--id`, or w-<pid>.
    pub fn worker_id(&self) -> String {
        self.id
            .clone()
            .unwrap_or_else(|| format!("w-{}", std::process::id()))
    }

    /// `--reserve`, or the device's default.
    pub fn reserve(&self) -> u64 {
        self.reserve
            .unwrap_or_else(|| inventory::default_reserve(&self.device))
    }
}

fn parse_size(s: &str) -> Result<u64, String> {
    omni_engine::parse_size(s)
}

struct State {
    exec: Option<Arc<Exec>>,
    range: Option<LayerRange>,
    kv_cells: u64,
    /// Bytes of one expert link's ring (sized from the loaded model).
    expert_ring: usize,
    /// The model and stage settings of the last Load (Prepare reuses them).
    loaded: Option<(Arc<ModelFile>, StageConfig)>,
    /// The standby stage a Prepare loaded, waiting for its Switch.
    prepared: Option<Stage>,
    /// The draft model loaded beside a prepared stage that takes the head
    /// from another worker.
    prepared_drafter: Option<omni_engine::speculative::draft::DraftModel>,
    /// The draft model the Load named (the worker with the head loads it).
    draft_model: String,
    /// A switch is pending (until Finish).
    move_pending: bool,
    /// Bytes of this worker's inbox ring, and how many rings it made.
    ring_bytes: usize,
    rings: u32,
    /// The Load the running stage answers, as it runs now (None once a
    /// move changed it: a new coordinator then loads it again).
    held: Option<LoadRequest>,
    /// `held` while a switch waits for its Finish (a rollback restores it).
    pending_held: Option<LoadRequest>,
    /// What the running stage's Load replied (a kept stage replies the same).
    held_reply: Option<LoadReply>,
    /// Loads done (a kept stage is not one).
    loads: u64,
}

/// Pieces of a state transfer on the wire (a KV export can be far larger
/// than one gRPC message may be).
const CHUNK: usize = 1 << 20;

struct Worker {
    id: String,
    cfg: WorkerConfig,
    advertise: String,
    inventory: Inventory,
    inbox: Mutex<Inbox>,
    outbox: Arc<Mutex<Option<Outbox>>>,
    experts: Arc<Mutex<Option<RemoteExperts>>>,
    stats: Arc<ExecStats>,
    state: Mutex<State>,
    /// When the worker started: the wall clock of the stage timeline.
    started: std::time::Instant,
}

/// Runs the worker until the process is stopped.
pub async fn run(cfg: WorkerConfig) -> anyhow::Result<()> {
    omni_transport::tls::install(&cfg.tls)?;
    let id = cfg.worker_id();
    let cpu = omni_engine::cpu_backend(cfg.cpu_variant.as_deref())?;
    tracing::info!("ggml CPU backend: {cpu}");
    let last_exit =
        omni_telemetry::crash::arm("omni-gpu-worker", &id, &cfg.coordinator, &cpu.variant);
    let mut inventory = inventory::read(&cfg.device, cfg.memory, cfg.reserve())?;
    inventory.cpu_variant = cpu.variant.clone();
    inventory.cpu_features = cpu.features.clone();
    let threads = cfg.threads.unwrap_or(inventory.cpu_cores as usize);
    let device: omni_engine::Device = inventory.device.parse().map_err(anyhow::Error::msg)?;
    // How fast this device reads weights, for the planner to balance time:
    // with a quarter of the free memory at most, and not fatal (a worker
    // without a figure still serves; the planner then counts workers of
    // one kind as equally fast).
    let t = std::time::Instant::now();
    match omni_engine::device::weight_read_rate(device, threads, inventory.memory_free / 4) {
        Ok(rate) => {
            inventory.weight_read_rate = rate;
            tracing::info!(
                "{device} reads quantized weights at {:.1} GB/s in a decode step ({threads} threads; timed in {:.2} s)",
                rate / 1e9,
                t.elapsed().as_secs_f64()
            );
        }
        Err(e) => tracing::warn!("could not time {device}'s weight reads ({e}); the planner will not know this worker's speed"),
    }
    for g in inventory::gpus() {
        tracing::info!("visible GPU: {g}");
    }
    if let Some(g) = &inventory.gpu {
        tracing::info!(
            "computing on {} {} (compute capability {}, PCI {}, PCIe gen {} x{} of gen {} x{}, \
             driver {}, CUDA {}, {}); {:.2} GiB kept back (--reserve)",
            inventory.device,
            inventory.device_name,
            g.compute_capability,
            g.pci_bus_id,
            g.pcie_gen,
            g.pcie_width,
            g.pcie_max_gen,
            g.pcie_max_width,
            g.driver_version,
            g.cuda_driver_version,
            g.uuid,
            inventory.reserved as f64 / GIB
        );
    }
    let (listener, local) = listen(&cfg.listen, &cfg.coordinator).await?;
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
        experts: Arc::new(Mutex::new(None)),
        stats: Arc::default(),
        started: std::time::Instant::now(),
        state: Mutex::new(State {
            exec: None,
            range: None,
            kv_cells: 0,
            expert_ring: 0,
            loaded: None,
            prepared: None,
            prepared_drafter: None,
            draft_model: String::new(),
            move_pending: false,
            ring_bytes: 0,
            rings: 0,
            held: None,
            pending_held: None,
            held_reply: None,
            loads: 0,
        }),
    });
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<worker_server::WorkerServer<Svc>>()
        .await;
    let server = omni_transport::tls::server()
        .add_service(health)
        .add_service(worker_server::WorkerServer::new(Svc(worker.clone())))
        .add_service(sink)
        .serve_with_incoming(omni_transport::tls::incoming(listener));
    let server = tokio::spawn(server);
    if let Some(addr) = &cfg.metrics_listen {
        let w = worker.clone();
        omni_runtime::metrics::serve(addr, Arc::new(move || w.render_metrics())).await?;
    }
    let who = Identity {
        id: &id,
        advertise: &advertise,
        inventory,
        kind: WorkerKind::Stage,
    };
    let instance = register(
        &cfg.coordinator,
        cfg.register_timeout,
        &who,
        last_exit.as_deref(),
        Held::default(),
    )
    .await?;
    let held = || Held {
        stage: worker.state.lock().unwrap().held.clone(),
        experts: None,
    };
    let grace = Duration::from_secs_f64(cfg.orphan_grace.max(0.0));
    serve_while_coordinator_lives(server, &cfg.coordinator, instance, grace, &who, held).await?;
    tracing::info!("worker {id} stopped");
    Ok(())
}

const GIB: f64 = (1u64 << 30) as f64;

struct Svc(Arc<Worker>);

/// Runs `f` on a blocking thread (loads and stage-thread calls block).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::from(WorkerError::internal(e.to_string())))?
}

#[tonic::async_trait]
impl worker_server::Worker for Svc {
    async fn load(&self, req: Request<LoadRequest>) -> Result<Response<LoadReply>, Status> {
        let req = req.into_inner();
        let w = self.0.clone();
        blocking(move || w.load(req)).await.map(Response::new)
    }

    async fn wire(&self, req: Request<WireRequest>) -> Result<Response<WireReply>, Status> {
        let req = req.into_inner();
        let choice =
            TransportChoice::from(Transport::try_from(req.transport).unwrap_or(Transport::Auto));
        let outbox = match &req.next {
            Some(next) => {
                let o = Outbox::connect(next, choice).await.map_err(|e| {
                    Status::from(WorkerError::unavailable(format!(
                        "worker {}: {e}",
                        self.0.id
                    )))
                })?;
                tracing::info!("output goes to {} over {}", next.grpc_addr, o.kind());
                Some(o)
            }
            None => None,
        };
        let ring = self.0.state.lock().unwrap().expert_ring;
        let mut routes = Vec::new();
        let mut expert_transports = Vec::new();
        for r in req.experts {
            let link = ExpertLink::connect(
                &r.worker_id,
                &r.grpc_addr,
                choice,
                &self.0.cfg.shm_dir,
                &self.0.id,
                ring,
            )
            .await
            .map_err(|e| {
                Status::from(WorkerError::unavailable(format!(
                    "worker {}: {e}",
                    self.0.id
                )))
            })?;
            let spin = self.0.expert_spin();
            tracing::info!(
                "the experts of layers {:?} run on {} ({}) over {}{}",
                r.layers,
                r.worker_id,
                r.grpc_addr,
                link.kind(),
                if link.kind() == "shm" {
                    format!(" (a wait spins {} µs, then sleeps)", spin.as_micros())
                } else {
                    String::new()
                }
            );
            expert_transports.push(link.kind().to_string());
            let mut link = link;
            link.timing = self.0.stats.expert_calls.clone();
            link.set_spin(spin);
            routes.push(experts::Route {
                worker: r.worker_id,
                layers: r.layers,
                link,
            });
        }
        *self.0.experts.lock().unwrap() = (!routes.is_empty()).then(|| {
            RemoteExperts::new(routes, Duration::from_secs_f64(self.0.cfg.expert_timeout))
        });
        let mut current = self.0.outbox.lock().unwrap();
        if let Some(o) = outbox {
            *current = Some(o);
        }
        let transport = current.as_ref().map(|o| o.kind().to_string());
        Ok(Response::new(WireReply {
            transport: transport.unwrap_or_default(),
            expert_transports,
        }))
    }

    async fn prepare(
        &self,
        req: Request<PrepareRequest>,
    ) -> Result<Response<PrepareReply>, Status> {
        let req = req.into_inner();
        let w = self.0.clone();
        blocking(move || w.prepare(req)).await.map(Response::new)
    }

    type ExportStateStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<StateChunk, Status>> + Send>>;

    async fn export_state(
        &self,
        req: Request<ExportStateRequest>,
    ) -> Result<Response<Self::ExportStateStream>, Status> {
        let req = req.into_inner();
        let exec = self.0.exec()?;
        let id = self.0.id.clone();
        let (kv, seqs) = blocking(move || {
            exec.export(req.layer_start..req.layer_end)
                .map_err(|e| Status::from(WorkerError::refused(format!("worker {id}: {e}"))))
        })
        .await?;
        let mut chunks = Vec::new();
        if let Some(kv) = kv {
            let bytes = kv.to_bytes();
            for (i, piece) in bytes.chunks(CHUNK).enumerate() {
                chunks.push(StateChunk {
                    kv: piece.to_vec(),
                    kv_start: i == 0,
                    ..Default::default()
                });
            }
        }
        chunks.push(StateChunk {
            seqs: serde_json::to_vec(&seqs)
                .map_err(|e| Status::from(WorkerError::internal(e.to_string())))?,
            ..Default::default()
        });
        Ok(Response::new(Box::pin(tokio_stream::iter(
            chunks.into_iter().map(Ok),
        ))))
    }

    async fn switch(
        &self,
        req: Request<tonic::Streaming<StateChunk>>,
    ) -> Result<Response<SwitchReply>, Status> {
        use tokio_stream::StreamExt;
        let t = Instant::now();
        let mut stream = req.into_inner();
        let mut header = None;
        let mut kv: Vec<Vec<u8>> = Vec::new();
        let mut seqs = Vec::new();
        while let Some(c) = stream.next().await {
            let c = c?;
            if let Some(h) = c.header {
                header = Some(h);
            }
            if c.kv_start {
                kv.push(Vec::new());
            }
            if !c.kv.is_empty() {
                kv.last_mut()
                    .ok_or_else(|| {
                        Status::from(WorkerError::bad_request("KV bytes before a KV start"))
                    })?
                    .extend_from_slice(&c.kv);
            }
            if !c.seqs.is_empty() {
                seqs.push(
                    serde_json::from_slice::<exec::SeqState>(&c.seqs).map_err(|e| {
                        Status::from(WorkerError::bad_request(format!("bad sequence state: {e}")))
                    })?,
                );
            }
        }
        let h = header
            .ok_or_else(|| Status::from(WorkerError::bad_request("Switch needs a header first")))?;
        let kv_bytes_in = kv.iter().map(|k| k.len() as u64).sum();
        let w = self.0.clone();
        blocking(move || w.switch(h, kv, seqs)).await?;
        Ok(Response::new(SwitchReply {
            switch_seconds: t.elapsed().as_secs_f64(),
            kv_bytes_in,
        }))
    }

    async fn finish(&self, req: Request<FinishRequest>) -> Result<Response<FinishReply>, Status> {
        let commit = req.into_inner().commit;
        let w = self.0.clone();
        blocking(move || w.finish(commit)).await.map(Response::new)
    }

    async fn open_inbox(
        &self,
        _: Request<OpenInboxRequest>,
    ) -> Result<Response<OpenInboxReply>, Status> {
        Ok(Response::new(OpenInboxReply {
            inbox: Some(self.0.new_ring()),
        }))
    }

    async fn reset(&self, req: Request<ResetRequest>) -> Result<Response<ResetReply>, Status> {
        let fence = req.into_inner().fence;
        let w = self.0.clone();
        blocking(move || w.reset(fence)).await.map(Response::new)
    }

    async fn status(&self, _: Request<StatusRequest>) -> Result<Response<StatusReply>, Status> {
        let w = &self.0;
        let link_stats = |f: fn(&omni_transport::LinkStats) -> &std::sync::atomic::AtomicU64| {
            w.experts.lock().unwrap().as_ref().map_or(0, |x| {
                x.routes()
                    .iter()
                    .map(|r| f(&r.link.stats).load(Ordering::Relaxed))
                    .sum()
            })
        };
        let calls = &w.stats.expert_calls;
        let seconds = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as f64 / 1e6;
        let memory = inventory::memory_now(&w.cfg.device, w.cfg.memory, w.cfg.reserve());
        let st = w.state.lock().unwrap();
        let used = w.stats.held_bytes.load(Ordering::Relaxed)
            + st.prepared.as_ref().map_or(0, Stage::held_bytes);
        // Offered a cap, a worker has what it holds less than the cap free.
        let free = |(total, free): (u64, u64)| match w.cfg.memory {
            Some(_) => free.min(total.saturating_sub(used)),
            None => free,
        };
        Ok(Response::new(StatusReply {
            worker_id: w.id.clone(),
            loaded: st.exec.is_some(),
            range: st.range.as_ref().map(|r| r.to_string()).unwrap_or_default(),
            kv_cells_used: w.stats.kv_cells_used.load(Ordering::Relaxed),
            kv_cells_cached: w.stats.kv_cells_cached.load(Ordering::Relaxed),
            kv_cached_bytes: w.stats.kv_cached_bytes.load(Ordering::Relaxed),
            kv_cells_total: st.kv_cells,
            loads: st.loads,
            steps: w.stats.steps.load(Ordering::Relaxed),
            last_step_ms: w.stats.last_step_us.load(Ordering::Relaxed) as f64 / 1e3,
            experts: w.stats.experts.lock().unwrap().clone(),
            bytes_received: w
                .inbox
                .lock()
                .unwrap()
                .stats
                .bytes_received
                .load(Ordering::Relaxed),
            expert_bytes_sent: link_stats(|s| &s.bytes_sent),
            expert_bytes_received: link_stats(|s| &s.bytes_received),
            expert_calls: link_stats(|s| &s.frames_sent),
            tokens: w.stats.tokens.load(Ordering::Relaxed),
            memory_total: memory.map_or(0, |m| m.0),
            memory_free: memory.map_or(0, free),
            memory_used: used,
            cpu_variant: w.inventory.cpu_variant.clone(),
            cpu_features: w.inventory.cpu_features.clone(),
            uptime_seconds: w.started.elapsed().as_secs_f64(),
            compute_seconds: w.stats.timeline.seconds(Phase::Computing),
            send_seconds: w.stats.timeline.seconds(Phase::Sending),
            input_wait_seconds: w.stats.timeline.seconds(Phase::Waiting),
            expert_round_trip_seconds: seconds(&calls.round_trip_us),
            expert_compute_seconds: seconds(&calls.compute_us),
            expert_send_seconds: seconds(&calls.send_us),
            expert_transit_seconds: seconds(&calls.transit_us),
            expert_pickup_seconds: seconds(&calls.pickup_us),
            expert_delivery_seconds: seconds(&calls.delivery_us),
            expert_handoff_seconds: seconds(&calls.handoff_us),
            expert_graph_seconds: seconds(&calls.graph_us),
            expert_wait_seconds: seconds(&w.stats.expert_wait_us),
            overlapped_steps: w.stats.overlapped_steps.load(Ordering::Relaxed),
            streamed_expert_steps: w.stats.streamed_expert_steps.load(Ordering::Relaxed),
        }))
    }
}

impl Worker {
    /// `--expert-spin-us`, or its default for this worker's device.
    fn expert_spin(&self) -> Duration {
        self.cfg.expert_spin_us.map_or_else(
            || {
                let gpu = self
                    .inventory
                    .device
                    .parse::<omni_engine::Device>()
                    .is_ok_and(|d| d.is_gpu());
                omni_transport::experts::spin_for(gpu || omni_telemetry::cpus::pinned())
            },
            Duration::from_micros,
        )
    }

    fn exec(&self) -> Result<Arc<Exec>, Status> {
        self.state.lock().unwrap().exec.clone().ok_or_else(|| {
            Status::from(WorkerError::refused(format!(
                "worker {} has loaded nothing",
                self.id
            )))
        })
    }

    fn load(&self, req: LoadRequest) -> Result<LoadReply, Status> {
        if let Some(kept) = self.keep(&req)? {
            return Ok(kept);
        }
        let t = Instant::now();
        let range = LayerRange {
            embed: req.embed,
            layers: req.layer_start..req.layer_end,
            head: req.head,
        };
        tracing::info!("loading {range} of {}", req.model_path);
        // Drop a previous stage first, so its memory is free for the new one.
        {
            let mut st = self.state.lock().unwrap();
            st.exec = None;
            st.held = None;
            st.held_reply = None;
        }
        let model = ModelFile::open(&req.model_path).map_err(|e| {
            Status::from(WorkerError::bad_request(format!("worker {}: {e}", self.id)))
        })?;
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
            device: self
                .inventory
                .device
                .parse()
                .map_err(|e| Status::from(WorkerError::internal(e)))?,
            repack: true,
            deterministic: req.deterministic,
            expert_overlap: false,
            shared_overlap: false,
            // Only where the plan kept room on the device for it.
            local_experts: if req.stream_experts {
                self.cfg.stream_experts
            } else {
                omni_engine::LocalExperts::Off
            },
        };
        let cfg = StageConfig {
            expert_overlap: match self.cfg.expert_overlap {
                Overlap::On => true,
                Overlap::Shared | Overlap::Off => false,
                Overlap::Auto => cfg.device.is_gpu(),
            },
            shared_overlap: match self.cfg.expert_overlap {
                Overlap::On | Overlap::Shared => true,
                Overlap::Off => false,
                Overlap::Auto => cfg.device.is_gpu(),
            },
            ..cfg
        };
        let n_embd = model.hparams.n_embd as usize;
        let n_used = model
            .hparams
            .moe
            .as_ref()
            .map_or(1, |m| m.n_expert_used as usize);
        let model_arc = model.clone();
        // A GPU's free memory before and after, beside what the stage
        // counts: CUDA's context and cuBLAS's workspace are outside it.
        let free = || {
            cfg.device
                .is_gpu()
                .then(|| inventory::memory_now(&self.inventory.device, None, 0))
                .flatten()
                .map(|(_, free)| free)
        };
        let free_before = free();
        let stage = Stage::load_offloaded(model, range.clone(), cfg.clone(), &req.offloaded)
            .map_err(|e| Status::from(WorkerError::refused(format!("worker {}: {e}", self.id))))?;
        if !req.offloaded.is_empty() {
            tracing::info!(
                "the routed experts of layers {:?} are left to expert workers",
                req.offloaded
            );
            if cfg.device.is_gpu() {
                match (cfg.local_experts, stage.local_experts_from()) {
                    (omni_engine::LocalExperts::Off, _) => {}
                    (_, Some(n)) => tracing::info!(
                        "steps of {n} tokens or more compute them on {}, streamed from host memory (--stream-experts)",
                        cfg.device
                    ),
                    (_, None) => tracing::info!(
                        "prompt steps will compute them on {}, streamed from host memory, once the expert workers' calls are timed and streaming is cheaper (--stream-experts auto)",
                        cfg.device
                    ),
                }
            }
        }
        let hp = &stage.model().hparams;
        let reply_bytes = (
            stage.weights().mapped_bytes + stage.weights().repacked_bytes,
            cfg.kv.bytes(hp, range.layers.len()),
            stage.compute_bytes() as u64,
        );
        let device_bytes = stage.device_bytes();
        let fallback_ops = stage.fallback_ops();
        let on_host = &stage.weights().kept_on_host;
        if !on_host.is_empty() {
            tracing::warn!(
                "{} cannot read {} where they are used: kept in host memory, their ops run on the CPU",
                cfg.device,
                on_host.join(", ")
            );
        }
        if !fallback_ops.is_empty() {
            tracing::warn!(
                "{}'s backend cannot compute {}: ggml runs them on the CPU",
                cfg.device,
                fallback_ops.join(", ")
            );
        }
        // The draft model beside the head (speculative decoding).
        let drafter = if req.head {
            self.load_drafter(&req.draft_model_path, stage.model(), &cfg)?
        } else {
            None
        };
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
            exec::Links {
                inbox: inbox.reader(),
                outbox: self.outbox.clone(),
                experts: self.experts.clone(),
            },
            exec::DeviceExperts {
                k: req.gpu_experts as usize,
                every: self.cfg.expert_reselect_steps,
            },
            drafter,
            self.stats.clone(),
        );
        let mut st = self.state.lock().unwrap();
        st.exec = Some(Arc::new(exec));
        st.draft_model = req.draft_model_path.clone();
        st.held = Some(LoadRequest { fence: 0, ..req });
        st.loads += 1;
        st.loaded = Some((model_arc, cfg.clone()));
        st.ring_bytes = 4 * frame;
        st.prepared = None;
        st.move_pending = false;
        st.range = Some(range.clone());
        st.kv_cells = cfg.kv.n_cells() as u64;
        st.expert_ring = omni_transport::experts::ring_bytes(cfg.n_ubatch, n_embd, n_used);
        let secs = t.elapsed().as_secs_f64();
        tracing::info!("loaded {range} in {secs:.2}s");
        if let (Some(before), Some(after)) = (free_before, free()) {
            tracing::info!(
                "{}: its free memory fell by {} in the load; the stage counts {} there (weights, KV cache, compute buffer)",
                self.inventory.device,
                omni_engine::fmt_bytes(before.saturating_sub(after)),
                omni_engine::fmt_bytes(device_bytes),
            );
        }
        let reply = LoadReply {
            weight_bytes: reply_bytes.0,
            kv_bytes: reply_bytes.1,
            compute_bytes: reply_bytes.2,
            load_seconds: secs,
            inbox: Some(inbox_ep),
            fallback_ops,
            kept: false,
        };
        st.held_reply = Some(reply.clone());
        Ok(reply)
    }

    /// The draft model at `path` (empty: none), for the stage of `model`
    /// loaded with `cfg`.
    fn load_drafter(
        &self,
        path: &str,
        model: &ModelFile,
        cfg: &StageConfig,
    ) -> Result<Option<omni_engine::speculative::draft::DraftModel>, Status> {
        if path.is_empty() {
            return Ok(None);
        }
        let t = Instant::now();
        let d = omni_engine::speculative::draft::DraftModel::load(
            std::path::Path::new(path),
            model,
            cfg.clone(),
        )
        .map_err(|e| {
            Status::from(WorkerError::refused(format!(
                "worker {}: draft model {path}: {e}",
                self.id
            )))
        })?;
        tracing::info!(
            "loaded draft model {path} ({}) in {:.2}s",
            omni_engine::fmt_bytes(d.held_bytes()),
            t.elapsed().as_secs_f64()
        );
        Ok(Some(d))
    }

    /// A Load of exactly the stage this worker runs (but for the fence):
    /// the worker outlived its coordinator and the new one asks for what it
    /// holds. The stage is kept: its sequences are forgotten (the new
    /// coordinator replays what it resumes), frames of steps before the
    /// fence are dropped, and a new inbox ring takes the new coordinator's
    /// frames (a ring has one sender in its life). None: load as asked.
    fn keep(&self, req: &LoadRequest) -> Result<Option<LoadReply>, Status> {
        let (exec, reply) = {
            let st = self.state.lock().unwrap();
            let want = LoadRequest {
                fence: 0,
                ..req.clone()
            };
            match (&st.exec, &st.held, &st.held_reply) {
                (Some(e), Some(h), Some(r)) if *h == want && !st.move_pending => {
                    (e.clone(), r.clone())
                }
                (Some(_), Some(h), _) => {
                    tracing::info!(
                        "loading again: this worker runs {}..{} of {}, and the coordinator asks for {}..{} of {} with other settings",
                        h.layer_start, h.layer_end, h.model_path, req.layer_start, req.layer_end, req.model_path
                    );
                    return Ok(None);
                }
                _ => return Ok(None),
            }
        };
        let t = Instant::now();
        let range = exec
            .reset(req.fence)
            .map_err(|e| Status::from(WorkerError::internal(format!("worker {}: {e}", self.id))))?;
        let inbox = self.new_ring();
        tracing::info!(
            "kept {} for the new coordinator (no load: sequences forgotten, steps before {} dropped) in {:.1} ms",
            range.map_or_else(|| "no layers".to_string(), |r| r.to_string()),
            req.fence,
            t.elapsed().as_secs_f64() * 1e3
        );
        Ok(Some(LoadReply {
            inbox: Some(inbox),
            load_seconds: t.elapsed().as_secs_f64(),
            kept: true,
            ..reply
        }))
    }

    /// A new shared-memory ring in the inbox for a new sender; the inbox's
    /// endpoint.
    fn new_ring(&self) -> Endpoint {
        let (n, bytes) = {
            let mut st = self.state.lock().unwrap();
            st.rings += 1;
            (st.rings, st.ring_bytes)
        };
        let mut inbox = self.inbox.lock().unwrap();
        if bytes > 0 {
            let name = format!("omni-{}-{}-{n}", self.id, std::process::id());
            if let Err(e) = inbox.add_ring(&self.cfg.shm_dir, &name, bytes) {
                tracing::warn!("no new shared-memory ring ({e}); receiving over gRPC only");
            }
        }
        inbox.endpoint(&self.advertise, &self.inventory.host_id)
    }
}
