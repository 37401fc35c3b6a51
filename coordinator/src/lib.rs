//! Coordinator: plans which layers live on which worker, drives batches
//! through the pipeline, and serves the inference gRPC service.
//!
//! Start-up, in order: open the model (refusing an unsupported architecture
//! before anything else), listen, wait for the configured number of workers
//! to register, plan (failing before any load if it does not fit), have every
//! worker load its range, wire the pipeline (coordinator → stage 0 → … →
//! last stage → coordinator), and only then report SERVING.

pub mod admin;
pub mod metrics;
pub mod migrate;
pub mod pipeline;
pub mod plan;
pub mod recover;
pub mod scheduler;
mod service;
mod tools;

use anyhow::Context;
use metrics::Metrics;
use omni_engine::chat::ChatTemplate;
use omni_engine::model::ModelFile;
use omni_engine::tokenizer::Tokenizer;
use omni_proto::coordinator::v1::{
    inference_server, registry_server, ExpertWorkerInfo, InfoReply, WorkerKind,
};
use omni_proto::worker::v1::{
    experts_client::ExpertsClient, worker_client::WorkerClient, Endpoint, Inventory,
    LoadExpertsRequest, LoadRequest, Transport, WireRequest,
};
use omni_transport::{Inbox, Outbox, TransportChoice};
use plan::{ExpertPolicy, PlanConfig, Split, WorkerSpec};
use scheduler::{Event, Scheduler, SchedulerConfig};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// A name for this coordinator process, different at every start (pid and
/// start time): workers compare it to notice a restarted coordinator.
fn instance_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{:x}-{nanos:x}", std::process::id())
}

/// The gRPC health service that is SERVING once the coordinator serves
/// Inference (its workers registered and loaded): what `healthcheck` asks.
pub const HEALTH_SERVICE: &str = inference_server::SERVICE_NAME;

/// Settings of the coordinator (flags, or `OMNI_*` variables).
#[derive(Clone, Debug, clap::Args)]
pub struct CoordinatorConfig {
    /// The GGUF model every worker loads its range of.
    #[arg(long, env = "OMNI_MODEL")]
    pub model: PathBuf,
    /// Where Inference, Registry and the results sink listen.
    #[arg(
        long,
        env = "OMNI_COORDINATOR_LISTEN",
        default_value = "127.0.0.1:7070"
    )]
    pub listen: String,
    /// The address workers use to reach this coordinator, when it differs.
    #[arg(long, env = "OMNI_COORDINATOR_ADVERTISE")]
    pub advertise: Option<String>,
    /// How many workers to wait for before planning.
    #[arg(long, env = "OMNI_WORKERS", default_value_t = 1)]
    pub workers: usize,
    /// How many expert workers (omni-cpu-worker) to wait for as well.
    #[arg(long, env = "OMNI_CPU_WORKERS", default_value_t = 0)]
    pub cpu_workers: usize,
    /// Where MoE routed experts run: auto (with their layer while it fits,
    /// else on the expert workers, layer by layer), device, or cpu (every
    /// MoE layer's experts on the expert workers).
    #[arg(long, env = "OMNI_EXPERTS", value_enum, default_value_t = ExpertPolicy::Auto)]
    pub experts: ExpertPolicy,
    /// Keep the K most used experts of each offloaded layer on its device
    /// worker, chosen from the routing statistics gathered while serving.
    #[arg(long, env = "OMNI_GPU_EXPERTS", default_value_t = 0)]
    pub gpu_experts: u32,
    /// Give up if not every worker registered within this many seconds.
    #[arg(long, env = "OMNI_REGISTER_TIMEOUT", default_value_t = 120.0)]
    pub register_timeout: f64,
    /// Context length of one sequence.
    #[arg(long, env = "OMNI_CTX", default_value_t = 4096)]
    pub ctx: usize,
    /// Sequences resident at once (KV cache slots).
    #[arg(long, env = "OMNI_SEQS", default_value_t = 8)]
    pub seqs: usize,
    /// Micro-batch groups in flight (default: one per compute site, i.e.
    /// per stage, except that stages on the same cores or GPU take turns
    /// and count once; see `pipeline.rs`). Sequences
    /// are dealt into them, and each group has one step in the pipeline at
    /// a time; with as many groups as sequences, every sequence runs in
    /// steps of its own (its results then never depend on what else runs).
    #[arg(long, env = "OMNI_MICRO_BATCHES")]
    pub micro_batches: Option<usize>,
    /// Most tokens in one step.
    #[arg(long, env = "OMNI_UBATCH", default_value_t = 512)]
    pub ubatch: usize,
    /// Most prompt tokens in a step that also carries other sequences'
    /// decode tokens (0: up to `--ubatch`). A long prompt is then prefilled
    /// in chunks between decode steps, so the streams already generating
    /// are not held up for the whole prompt; with nothing decoding, prompts
    /// take whole `--ubatch` steps.
    #[arg(long, env = "OMNI_PREFILL_CHUNK", default_value_t = 256)]
    pub prefill_chunk: usize,
    /// Memory left unplanned on every worker (fraction).
    #[arg(long, env = "OMNI_HEADROOM", default_value_t = 0.10)]
    pub headroom: f64,
    /// Manual split by proportion, like llama.cpp's --tensor-split (e.g. 3,1).
    #[arg(
        long,
        env = "OMNI_SPLIT",
        value_delimiter = ',',
        conflicts_with = "counts"
    )]
    pub split: Option<Vec<f64>>,
    /// Manual split by layer counts per stage (e.g. 12,12).
    #[arg(long, env = "OMNI_COUNTS", value_delimiter = ',')]
    pub counts: Option<Vec<u32>>,
    /// auto (shared memory where both ends share a host), shm or grpc.
    #[arg(long, env = "OMNI_TRANSPORT", default_value = "auto")]
    pub transport: TransportChoice,
    /// Send hidden states as f16 (half the bytes; results change slightly).
    #[arg(long, env = "OMNI_F16_HIDDEN")]
    pub f16_hidden: bool,
    /// A step with no answer for this many seconds means the pipeline is
    /// stuck: the cluster recovers.
    #[arg(long, env = "OMNI_STEP_TIMEOUT", default_value_t = 120.0)]
    pub step_timeout: f64,
    /// How long a lost worker may take to come back (its supervisor
    /// restarts it) before the plan is made again over the others, when
    /// they can hold the model (seconds).
    #[arg(long, env = "OMNI_REJOIN_TIMEOUT", default_value_t = 30.0)]
    pub rejoin_timeout: f64,
    /// How long a recovery may take before the requests in flight are
    /// stopped with the reason; the cluster keeps waiting for its workers
    /// and serves again once they are back (seconds).
    #[arg(long, env = "OMNI_RECOVERY_TIMEOUT", default_value_t = 120.0)]
    pub recovery_timeout: f64,
    /// Most requests waiting for a slot (also while recovering); beyond
    /// it new requests are refused as unavailable (the router's 503).
    #[arg(long, env = "OMNI_MAX_QUEUE", default_value_t = 256)]
    pub max_queue: usize,
    /// How often each worker's health is checked (seconds).
    #[arg(long, env = "OMNI_HEALTH_INTERVAL", default_value_t = 1.0)]
    pub health_interval: f64,
    /// Where the results ring lives.
    #[arg(long, env = "OMNI_SHM_DIR", default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// Prometheus metrics (GET /metrics) listen address.
    #[arg(long, env = "OMNI_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
    /// Where the admin API (omni.admin.v1) listens: apart from Inference,
    /// so that it can stay off the network clients reach.
    #[arg(long, env = "OMNI_ADMIN_LISTEN", default_value = "127.0.0.1:7071")]
    pub admin_listen: String,
    /// The token admin calls must carry (`authorization: Bearer ...`);
    /// without one every admin call is refused. Give it as OMNI_ADMIN_TOKEN
    /// or --admin-token-file: a flag is visible to every user in `ps`.
    #[arg(long, env = "OMNI_ADMIN_TOKEN", hide_env_values = true, hide = true)]
    pub admin_token: Option<String>,
    /// A file holding the admin token (e.g. a compose secret at
    /// /run/secrets/admin_token), instead of --admin-token.
    #[arg(long, env = "OMNI_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    #[command(flatten)]
    pub telemetry: omni_telemetry::TelemetryArgs,
}

/// A worker that registered.
#[derive(Clone, Debug)]
pub struct Registered {
    pub id: String,
    pub addr: String,
    pub inventory: Inventory,
    pub kind: WorkerKind,
}

/// What the services share.
pub(crate) struct Shared {
    pub cfg: CoordinatorConfig,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    pub registrations: mpsc::UnboundedSender<Registered>,
    /// Accepting registrations until the plan is made.
    pub registering: Mutex<bool>,
    pub events: Mutex<Option<omni_transport::BellSender<Event>>>,
    pub info: Arc<Mutex<InfoReply>>,
    pub next_seq: std::sync::atomic::AtomicU64,
    pub metrics: Arc<Metrics>,
    pub admin: Arc<admin::AdminState>,
    pub recovery: Arc<recover::Recovery>,
    /// The vocabulary as the grammar engine sees it, built at the first
    /// constrained request (or the error that stopped it).
    pub grammars: std::sync::OnceLock<Result<omni_engine::constraint::Grammars, String>>,
}

impl Shared {
    /// Compiles a request's grammar: INVALID_ARGUMENT naming what is wrong
    /// with it ("invalid JSON schema: ...").
    pub fn check_grammar(&self, g: &omni_engine::sampling::Grammar) -> Result<(), tonic::Status> {
        let grammars = self
            .grammars
            .get_or_init(|| {
                omni_engine::constraint::Grammars::new(&self.tokenizer).map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| {
                tonic::Status::internal(format!("constrained decoding is unavailable: {e}"))
            })?;
        grammars
            .compile(g)
            .map(drop)
            .map_err(|e| tonic::Status::invalid_argument(e.to_string()))
    }
}

/// Runs the coordinator until it is stopped or its start-up fails.
pub async fn run(mut cfg: CoordinatorConfig) -> anyhow::Result<()> {
    if cfg.workers == 0 {
        anyhow::bail!("--workers must be at least 1");
    }
    omni_telemetry::warn_secret_flags(
        "omni-coordinator",
        &[("--admin-token", "OMNI_ADMIN_TOKEN or --admin-token-file")],
    );
    cfg.admin_token = omni_telemetry::value_or_secret_file(
        cfg.admin_token.take(),
        cfg.admin_token_file.as_deref(),
        "the admin token (--admin-token / --admin-token-file)",
    )
    .map_err(anyhow::Error::msg)?;
    let model = ModelFile::open(&cfg.model)
        .with_context(|| format!("cannot serve {}", cfg.model.display()))?;
    let tokenizer = Arc::new(Tokenizer::load(&cfg.model)?);
    let template = match model.chat_template() {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!("no usable chat template: {e}");
            None
        }
    };
    let n_ctx_train = model.hparams.n_ctx_train as usize;
    if cfg.ctx > n_ctx_train {
        anyhow::bail!(
            "--ctx {} exceeds the model's trained context of {n_ctx_train} tokens",
            cfg.ctx
        );
    }
    let listener = tokio::net::TcpListener::bind(&cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let local = listener.local_addr()?;
    let advertise = cfg.advertise.clone().unwrap_or_else(|| local.to_string());
    tracing::info!(
        "coordinator listening on {local}; model {} ({}, {} layers); waiting for {} worker(s){}",
        cfg.model.display(),
        model.hparams.arch.name(),
        model.hparams.n_layer,
        cfg.workers,
        if cfg.cpu_workers > 0 {
            format!(" and {} expert worker(s)", cfg.cpu_workers)
        } else {
            String::new()
        }
    );

    let mut inbox = Inbox::new();
    let name = format!("omni-coordinator-{}", std::process::id());
    if let Err(e) = inbox.add_ring(&cfg.shm_dir, &name, 4 << 20) {
        tracing::warn!("no shared-memory ring for results ({e}); results come over gRPC");
    }
    let host_id = omni_transport::host_id();
    let (reg_tx, mut reg_rx) = mpsc::unbounded_channel();
    let metrics = Arc::new(Metrics::new());
    let shared = Arc::new(Shared {
        cfg: cfg.clone(),
        tokenizer: tokenizer.clone(),
        template,
        registrations: reg_tx,
        registering: Mutex::new(true),
        events: Mutex::new(None),
        info: Arc::new(Mutex::new(InfoReply {
            model_path: cfg.model.display().to_string(),
            architecture: model.hparams.arch.name().to_string(),
            n_ctx: cfg.ctx as u32,
            n_vocab: tokenizer.n_vocab() as u32,
            n_seq: cfg.seqs as u32,
            state: "waiting for workers".into(),
            instance: instance_id(),
            ..Default::default()
        })),
        next_seq: 1.into(),
        metrics: metrics.clone(),
        admin: Arc::new(admin::AdminState::new(metrics.clone())),
        recovery: Arc::default(),
        grammars: Default::default(),
    });
    shared.admin.set_info(shared.info.clone());

    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_not_serving::<inference_server::InferenceServer<service::InferenceSvc>>()
        .await;
    let server = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(health)
        .add_service(registry_server::RegistryServer::new(service::RegistrySvc(
            shared.clone(),
        )))
        .add_service(inference_server::InferenceServer::new(
            service::InferenceSvc(shared.clone()),
        ))
        .add_service(inbox.sink_service())
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    let server = tokio::spawn(server);
    let admin_listener = tokio::net::TcpListener::bind(&cfg.admin_listen)
        .await
        .with_context(|| format!("cannot listen on {} (--admin-listen)", cfg.admin_listen))?;
    tracing::info!(
        "admin API on {}{}",
        admin_listener.local_addr()?,
        if cfg.admin_token.as_deref().is_some_and(|t| !t.is_empty()) {
            ""
        } else {
            " (refusing every call: no admin token)"
        }
    );
    let admin_server = tonic::transport::Server::builder()
        .add_service(
            omni_proto::admin::v1::admin_server::AdminServer::with_interceptor(
                admin::AdminSvc(shared.admin.clone()),
                admin::Auth::new(cfg.admin_token.clone()),
            ),
        )
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(
            admin_listener,
        ));
    tokio::spawn(async move {
        if let Err(e) = admin_server.await {
            tracing::error!("the admin API stopped: {e}");
        }
    });
    if let Some(addr) = &cfg.metrics_listen {
        let m = metrics.clone();
        omni_transport::metrics::serve(addr, Arc::new(move || m.render())).await?;
    }

    // 1. Workers.
    let deadline = Instant::now() + Duration::from_secs_f64(cfg.register_timeout);
    let mut workers: Vec<Registered> = Vec::new();
    let mut expert_workers: Vec<Registered> = Vec::new();
    while workers.len() < cfg.workers || expert_workers.len() < cfg.cpu_workers {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, reg_rx.recv()).await {
            Ok(Some(w)) => {
                let (list, want, what) = match w.kind {
                    WorkerKind::Stage => (&mut workers, cfg.workers, "worker"),
                    WorkerKind::Experts => (&mut expert_workers, cfg.cpu_workers, "expert worker"),
                };
                if list.len() >= want {
                    tracing::warn!(
                        "{what} {} at {} registered, but {want} {what}(s) are expected and here; it stays idle",
                        w.id,
                        w.addr
                    );
                    continue;
                }
                tracing::info!(
                    "{what} {} registered from {} ({}, {:.2} GiB free)",
                    w.id,
                    w.addr,
                    w.inventory.device,
                    w.inventory.memory_free as f64 / (1u64 << 30) as f64
                );
                list.push(w);
            }
            _ => {
                let names: Vec<String> = workers
                    .iter()
                    .chain(&expert_workers)
                    .map(|w| format!("{} at {}", w.id, w.addr))
                    .collect();
                let experts = if cfg.cpu_workers > 0 {
                    format!(
                        " and {} of {} expert workers",
                        expert_workers.len(),
                        cfg.cpu_workers
                    )
                } else {
                    String::new()
                };
                anyhow::bail!(
                    "only {} of {} workers{experts} registered within {:.0}s{}",
                    workers.len(),
                    cfg.workers,
                    cfg.register_timeout,
                    if names.is_empty() {
                        String::new()
                    } else {
                        format!(" (registered: {})", names.join(", "))
                    }
                );
            }
        }
    }
    shared.recovery.know(
        &workers
            .iter()
            .chain(&expert_workers)
            .cloned()
            .collect::<Vec<_>>(),
    );
    *shared.registering.lock().unwrap() = false;
    workers.sort_by(|a, b| a.id.cmp(&b.id));
    expert_workers.sort_by(|a, b| a.id.cmp(&b.id));

    // 2. Plan, before anything is loaded.
    let sites: Vec<pipeline::Site> = workers.iter().map(pipeline::Site::of).collect();
    let rates = pipeline::site_rates(
        &sites,
        &workers
            .iter()
            .map(|w| w.inventory.weight_read_rate)
            .collect::<Vec<_>>(),
    );
    let rate_of = |id: &str| {
        workers
            .iter()
            .position(|w| w.id == id)
            .map_or(0, |i| rates[i] as u64)
    };
    // Workers of one host that compute on its RAM (stage and expert
    // workers), or on one GPU, share that memory: each offers what it has
    // free, so the planner counts it once.
    let pool = |w: &Registered| -> Option<plan::MemoryPool> {
        let inv = &w.inventory;
        if inv.host_id.is_empty() {
            return None;
        }
        let host = if inv.hostname.is_empty() {
            "host".to_string()
        } else {
            format!("host {}", inv.hostname)
        };
        Some(match &inv.gpu {
            Some(g) => {
                let card = [&g.uuid, &g.pci_bus_id, &inv.device]
                    .into_iter()
                    .find(|s| !s.is_empty())
                    .cloned()
                    .unwrap_or_default();
                plan::MemoryPool {
                    key: format!("{}/gpu/{card}", inv.host_id),
                    name: format!("{host}'s {}", inv.device),
                }
            }
            None => plan::MemoryPool {
                key: format!("{}/ram", inv.host_id),
                name: format!("{host}'s RAM"),
            },
        })
    };
    let spec = |w: &Registered| WorkerSpec {
        id: w.id.clone(),
        device: w.inventory.device.clone(),
        free_bytes: w.inventory.memory_free,
        total_bytes: w.inventory.memory_total,
        read_rate: rate_of(&w.id),
        pool: pool(w),
    };
    let specs: Vec<WorkerSpec> = workers.iter().map(spec).collect();
    let expert_specs: Vec<WorkerSpec> = expert_workers.iter().map(spec).collect();
    let pcfg = PlanConfig {
        n_ctx: cfg.ctx,
        n_seq: cfg.seqs,
        n_ubatch: cfg.ubatch,
        headroom: cfg.headroom,
        split: match (&cfg.split, &cfg.counts) {
            (Some(p), _) => Some(Split::Proportions(p.clone())),
            (None, Some(l)) => Some(Split::Layers(l.clone())),
            (None, None) => None,
        },
        experts: cfg.experts,
        gpu_experts: cfg.gpu_experts,
    };
    let plan = plan::plan_with_experts(&model, &specs, &expert_specs, &pcfg)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    tracing::info!("plan:\n{plan}");
    shared.info.lock().unwrap().state = "loading".into();

    // 3. Load every stage (in parallel), then wire the pipeline.
    let mut loads = Vec::new();
    for (i, (st, w)) in plan.stages.iter().zip(&workers).enumerate() {
        let req = LoadRequest {
            model_path: cfg.model.display().to_string(),
            embed: st.range.embed,
            layer_start: st.range.layers.start,
            layer_end: st.range.layers.end,
            head: st.range.head,
            n_ctx: cfg.ctx as u32,
            n_seq: cfg.seqs as u32,
            n_ubatch: cfg.ubatch as u32,
            f16_hidden: cfg.f16_hidden,
            stage: i as u32,
            offloaded: st.offloaded.clone(),
            gpu_experts: cfg.gpu_experts,
        };
        let (id, addr) = (w.id.clone(), w.addr.clone());
        loads.push(tokio::spawn(async move {
            let mut c = worker_client(&addr).await?;
            let r = c.load(req).await.map_err(|s| {
                anyhow::anyhow!(
                    "worker {id} ({addr}) could not load its layers: {}",
                    s.message()
                )
            })?;
            anyhow::Ok(r.into_inner())
        }));
    }
    // The plan names only registered expert workers.
    let expert_worker = |id: &str| -> &Registered {
        expert_workers
            .iter()
            .find(|w| w.id == id)
            .expect("the plan names registered expert workers")
    };
    let mut expert_loads = Vec::new();
    for ep in &plan.experts {
        let w = expert_worker(&ep.worker);
        let req = LoadExpertsRequest {
            model_path: cfg.model.display().to_string(),
            layers: ep.layers.clone(),
            n_ubatch: cfg.ubatch as u32,
        };
        let (id, addr) = (w.id.clone(), w.addr.clone());
        expert_loads.push(tokio::spawn(async move {
            let ch = channel(&addr).await?;
            let r = ExpertsClient::new(ch)
                .load_experts(req)
                .await
                .map_err(|s| {
                    anyhow::anyhow!(
                        "expert worker {id} ({addr}) could not load its experts: {}",
                        s.message()
                    )
                })?;
            anyhow::Ok(r.into_inner())
        }));
    }
    let mut replies = Vec::new();
    for l in loads {
        replies.push(l.await??);
    }
    let mut expert_info = Vec::new();
    for (ep, l) in plan.experts.iter().zip(expert_loads) {
        let r = l.await??;
        let w = expert_worker(&ep.worker);
        tracing::info!(
            "expert worker {} holds the experts of layers {} ({} weights, {} compute; {})",
            w.id,
            plan::fmt_layers(&ep.layers),
            omni_engine::fmt_bytes(r.weight_bytes),
            omni_engine::fmt_bytes(r.compute_bytes),
            r.binding
        );
        expert_info.push(ExpertWorkerInfo {
            worker_id: w.id.clone(),
            worker_addr: w.addr.clone(),
            device: w.inventory.device.clone(),
            layers: plan::fmt_layers(&ep.layers),
            weight_bytes: r.weight_bytes,
            compute_bytes: r.compute_bytes,
            binding: r.binding,
        });
    }
    let inbox = Arc::new(Mutex::new(inbox));
    let results_ep = inbox.lock().unwrap().endpoint(&advertise, &host_id);
    let transport = Transport::from(cfg.transport);
    let mut live_workers = Vec::new();
    for (i, w) in workers.iter().enumerate() {
        let next: Endpoint = match replies.get(i + 1) {
            Some(r) => r.inbox.clone().unwrap_or_default(),
            None => results_ep.clone(),
        };
        let routes = migrate::routes_for(&plan.stages[i].offloaded, &plan, |id| {
            expert_worker(id).addr.clone()
        });
        let mut c = worker_client(&w.addr).await?;
        let r = c
            .wire(WireRequest {
                next: Some(next),
                transport: transport as i32,
                experts: routes.clone(),
            })
            .await
            .map_err(|s| {
                anyhow::anyhow!(
                    "worker {} could not connect to the next stage or its expert workers: {}",
                    w.id,
                    s.message()
                )
            })?
            .into_inner();
        let st = &plan.stages[i];
        let lr = &replies[i];
        tracing::info!(
            "stage {i}: worker {} runs {} ({} weights, {} KV, {} compute), output over {}",
            w.id,
            st.range,
            omni_engine::fmt_bytes(lr.weight_bytes),
            omni_engine::fmt_bytes(lr.kv_bytes),
            omni_engine::fmt_bytes(lr.compute_bytes),
            r.transport
        );
        for (route, how) in routes.iter().zip(&r.expert_transports) {
            tracing::info!(
                "stage {i}: the experts of layers {} run on {} over {how}",
                plan::fmt_layers(&route.layers),
                route.worker_id
            );
        }
        live_workers.push(migrate::LiveWorker {
            reg: w.clone(),
            spec: spec(w),
            stage_bytes: (lr.weight_bytes, lr.kv_bytes, lr.compute_bytes),
            transport: r.transport,
            expert_transports: r.expert_transports,
        });
    }
    let first = replies[0].inbox.clone().unwrap_or_default();
    let outbox = Outbox::connect(&first, cfg.transport)
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the first stage: {e}"))?;
    tracing::info!("steps go to stage 0 over {}", outbox.kind());

    // 4. Serve.
    let (n_groups, pipeline_note) = match cfg.micro_batches {
        Some(n) => (
            n.max(1),
            format!("{} micro-batch groups (--micro-batches)", n.max(1)),
        ),
        None => {
            let (n, why) = pipeline::default_groups(&sites);
            if let Some(why) = &why {
                tracing::info!("{why}");
            }
            (n, why.unwrap_or_default())
        }
    };
    // The scheduler thread waits on the results ring itself; events ring
    // the same doorbell.
    let frames = inbox.lock().unwrap().reader();
    let (ev_tx, ev_rx) = frames.bell().channel();
    *shared.events.lock().unwrap() = Some(ev_tx.clone());
    let (recover_tx, recover_rx) = mpsc::unbounded_channel();
    let sched = Scheduler::new(
        SchedulerConfig {
            n_ctx: cfg.ctx,
            n_seq: cfg.seqs,
            n_ubatch: cfg.ubatch,
            prefill_chunk: cfg.prefill_chunk,
            n_groups,
            step_timeout: Duration::from_secs_f64(cfg.step_timeout),
            max_queue: cfg.max_queue,
        },
        tokenizer,
        outbox,
        metrics,
        Some(recover_tx),
    );
    std::thread::Builder::new()
        .name("scheduler".into())
        .spawn(move || sched.run(ev_rx, frames))?;
    let live = migrate::Live::new(
        migrate::Setup {
            model: model.clone(),
            pcfg: pcfg.clone(),
            transport: cfg.transport,
            advertise: advertise.clone(),
            shm_dir: cfg.shm_dir.clone(),
            events: ev_tx.clone(),
            step_timeout: Duration::from_secs_f64(cfg.step_timeout),
            load: LoadRequest {
                model_path: cfg.model.display().to_string(),
                n_ctx: cfg.ctx as u32,
                n_seq: cfg.seqs as u32,
                n_ubatch: cfg.ubatch as u32,
                f16_hidden: cfg.f16_hidden,
                gpu_experts: cfg.gpu_experts,
                ..Default::default()
            },
        },
        live_workers,
        expert_info
            .iter()
            .map(|e| {
                let w = expert_worker(&e.worker_id);
                (w.clone(), spec(w), e.clone())
            })
            .collect(),
        plan.clone(),
        inbox.clone(),
    );
    let stages = live.stage_infos();
    shared.admin.set_live(live);
    tokio::spawn(recover::run(
        recover_rx,
        shared.admin.clone(),
        shared.recovery.clone(),
        shared.info.clone(),
        ev_tx.clone(),
        recover::Timeouts {
            rejoin: Duration::from_secs_f64(cfg.rejoin_timeout),
            give_up: Duration::from_secs_f64(cfg.recovery_timeout),
        },
    ));
    for w in workers.iter().chain(&expert_workers) {
        tokio::spawn(watch_worker(
            w.clone(),
            Duration::from_secs_f64(cfg.health_interval),
            ev_tx.clone(),
            shared.admin.clone(),
            shared.recovery.clone(),
        ));
    }
    {
        let mut info = shared.info.lock().unwrap();
        info.stages = stages;
        info.expert_workers = expert_info;
        info.plan = plan.to_string();
        info.micro_batch_groups = n_groups as u32;
        info.pipeline_note = pipeline_note;
        info.ready = true;
        info.state = "serving".into();
    }
    health_reporter
        .set_serving::<inference_server::InferenceServer<service::InferenceSvc>>()
        .await;
    tracing::info!("ready: serving Inference on {local}");
    server.await??;
    drop(inbox);
    tracing::info!("coordinator stopped");
    Ok(())
}

async fn channel(addr: &str) -> anyhow::Result<tonic::transport::Channel> {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .with_context(|| format!("cannot reach worker at {addr}"))
}

async fn worker_client(addr: &str) -> anyhow::Result<WorkerClient<tonic::transport::Channel>> {
    Ok(WorkerClient::new(channel(addr).await?))
}

/// Checks a worker's gRPC health every `interval`, at the address it has
/// now (a restarted worker may register from another); two failures in a
/// row report it lost, once, until it answers again. A stopped (SIGSTOP)
/// worker is lost this way too: its health check gets no answer.
async fn watch_worker(
    w: Registered,
    interval: Duration,
    events: omni_transport::BellSender<Event>,
    admin: Arc<admin::AdminState>,
    recovery: Arc<recover::Recovery>,
) {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let timeout = interval.max(Duration::from_millis(500)) * 2;
    let connect = |addr: &str| {
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .ok()
            .map(|ep| HealthClient::new(ep.connect_timeout(timeout).connect_lazy()))
    };
    let mut addr = w.addr.clone();
    let Some(mut client) = connect(&addr) else {
        return;
    };
    let mut misses = 0;
    let mut lost = false;
    loop {
        tokio::time::sleep(interval).await;
        if let Some(now) = recovery.addr(&w.id).filter(|a| *a != addr) {
            let Some(c) = connect(&now) else {
                return;
            };
            addr = now;
            client = c;
        }
        let check = client.check(HealthCheckRequest {
            service: String::new(),
        });
        let why = match tokio::time::timeout(timeout, check).await {
            Ok(Ok(_)) => {
                misses = 0;
                if std::mem::take(&mut lost) {
                    tracing::info!("worker {} at {addr} answers again", w.id);
                    admin.clear_health(&w.id);
                }
                continue;
            }
            Ok(Err(s)) => s.message().to_string(),
            Err(_) => format!("no health answer within {:.1}s", timeout.as_secs_f64()),
        };
        misses += 1;
        if misses < 2 || lost {
            continue;
        }
        lost = true;
        if admin.is_drained(&w.id) {
            // Out of the pipeline: serving goes on without it (a
            // drained worker is one an operator may stop).
            tracing::warn!("drained worker {} is gone: {why}", w.id);
            admin.set_health(&w.id, format!("lost (drained): {why}"));
            continue;
        }
        admin.set_health(&w.id, format!("lost: {why}"));
        let _ = events.send(Event::WorkerLost {
            worker: format!("{} ({addr})", w.id),
            why,
            death: None,
        });
    }
}
