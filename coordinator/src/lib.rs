//! Coordinator: plans which layers live on which worker, drives batches
//! through the pipeline, and serves the inference gRPC service.
//!
//! Start-up, in order: open the model (refusing an unsupported architecture
//! before anything else), listen, wait for the configured number of workers
//! to register, plan (failing before any load if it does not fit), have every
//! worker load its range, wire the pipeline (coordinator → stage 0 → … →
//! last stage → coordinator), and only then report SERVING.

pub mod admin;
mod error;
pub mod metrics;
pub mod migrate;
pub mod pipeline;
pub mod recover;
pub mod scheduler;
mod service;
mod start;
mod tools;

use anyhow::Context;
use metrics::Metrics;
use omni_engine::chat::ChatTemplate;
use omni_engine::model::ModelFile;
use omni_engine::tokenizer::Tokenizer;
use omni_planner as plan;
use omni_proto::coordinator::v1::{inference_server, InfoReply, WorkerKind};
use omni_proto::worker::v1::{worker_client::WorkerClient, Inventory};
use omni_transport::{Inbox, Outbox, TransportChoice};
use plan::{ExpertPolicy, WorkerSpec};

/// A feature on or off (`--prefix-cache off`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    On,
    Off,
}

/// Batch-invariant decoding (`--deterministic`): a request's tokens and
/// logits do not depend on what else runs beside it, on how its prompt is
/// chunked, or on a live move or a crash replay (same machine, same
/// threads). It costs speed (ggml's reference matmul kernels; measured in
/// docs/benchmarks.md), so it is not the default.
/// How the coordinator drafts tokens for speculative decoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecType {
    None,
    Ngram,
    /// The draft model (`--model-draft`).
    Draft,
}

/// How long a prompt-lookup draft is (`--draft-length`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DraftLength {
    Tuned,
    Agreement,
}

impl CoordinatorConfig {
    /// The speculative settings of a request that gives none. With a draft
    /// model, a request that turns speculation on uses it unless the
    /// cluster's kind is `ngram`.
    pub fn speculative(&self) -> omni_engine::speculative::SpecParams {
        use omni_engine::speculative::{DraftSource, SpecParams};
        SpecParams {
            n_max: match self.spec_type {
                SpecType::None => 0,
                SpecType::Ngram | SpecType::Draft => self.draft_max,
            },
            n_min: self.draft_min,
            ngram: self.spec_ngram_size,
            source: match (self.spec_type, &self.model_draft) {
                (SpecType::Ngram, _) | (_, None) => DraftSource::Lookup,
                (_, Some(_)) => DraftSource::Model,
            },
            p_min: self.draft_p_min,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Determinism {
    /// The fastest kernels; a request that asks for determinism is refused.
    Off,
    /// Every step is batch-invariant.
    On,
    /// The steps that carry a request asking for it (`deterministic: true`)
    /// are; the others run the fast kernels (the workers keep their dense
    /// weights unrepacked, so that both can run).
    Request,
}
use scheduler::{Event, Scheduler};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
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

/// Settings of the coordinator: flags, `OMNI_COORDINATOR_*` variables, or the
/// `[coordinator]` table of the config file (`omni_runtime::config`).
#[derive(Clone, Debug, clap::Args)]
pub struct CoordinatorConfig {
    /// The GGUF model every worker loads its range of.
    #[arg(long)]
    pub model: PathBuf,
    /// Where Inference, Registry and the results sink listen.
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: String,
    /// The address workers use to reach this coordinator, when it differs.
    #[arg(long)]
    pub advertise: Option<String>,
    /// How many workers to wait for before planning.
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// How many expert workers (omni-cpu-worker) to wait for as well.
    #[arg(long, default_value_t = 0)]
    pub cpu_workers: usize,
    /// Where MoE routed experts run: auto (with their layer while it fits,
    /// else on the expert workers, layer by layer), device, or cpu (every
    /// MoE layer's experts on the expert workers).
    #[arg(long, value_enum, default_value_t = ExpertPolicy::Auto)]
    pub experts: ExpertPolicy,
    /// Keep the K most used experts of each offloaded layer on its device
    /// worker, chosen from the routing statistics gathered while serving.
    #[arg(long, default_value_t = 0)]
    pub gpu_experts: u32,
    /// Give up if not every worker registered within this many seconds.
    #[arg(long, default_value_t = 120.0)]
    pub register_timeout: f64,
    /// Context length of one sequence.
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// Sequences resident at once (KV cache slots).
    #[arg(long, default_value_t = 8)]
    pub seqs: usize,
    /// Micro-batch groups in flight (default: one per compute site, i.e.
    /// per stage, except that stages on the same cores or GPU take turns
    /// and count once; see `pipeline.rs`). Sequences
    /// are dealt into them, and each group has one step in the pipeline at
    /// a time; with as many groups as sequences, every sequence runs in
    /// steps of its own (its results then never depend on what else runs).
    #[arg(long)]
    pub micro_batches: Option<usize>,
    /// Most tokens in one step.
    #[arg(long, default_value_t = 512)]
    pub ubatch: usize,
    /// Most prompt tokens in a step that also carries other sequences'
    /// decode tokens (0: up to `--ubatch`). A long prompt is then prefilled
    /// in chunks between decode steps, so the streams already generating
    /// are not held up for the whole prompt; with nothing decoding, prompts
    /// take whole `--ubatch` steps.
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// Where a prompt is cut into steps, which moves logits a little:
    /// `llama-server` (every --ubatch tokens, and for models with
    /// sliding-window layers also 4 and 4 + --ubatch tokens before the end,
    /// as llama-server does by default) or `ubatch` (every --ubatch tokens
    /// only, as llama.cpp's llama_decode and `llama-server --swa-full`).
    /// See docs/llama-cpp.md.
    #[arg(long, default_value_t = omni_engine::PromptCuts::default())]
    pub prompt_cuts: omni_engine::PromptCuts,
    /// The prefix cache: a prompt starts from the KV cells of an earlier
    /// prompt with the same beginning and computes only the rest; finished
    /// prompts and answers stay cached until their cells are needed. It
    /// lives in the KV cache the plan sized.
    #[arg(long, value_enum, default_value_t = Switch::On)]
    pub prefix_cache: Switch,
    /// Most KV cells (tokens) the prefix cache keeps that no running
    /// request uses (default: the whole KV cache, --ctx x --seqs).
    #[arg(long)]
    pub prefix_cache_size: Option<usize>,
    /// Batch-invariant decoding: off, on (every request gets the same
    /// tokens whatever else runs), or request (the requests that ask for
    /// it with `deterministic: true`). CPU workers only.
    #[arg(long, value_enum, default_value_t = Determinism::Off)]
    pub deterministic: Determinism,
    /// Speculative decoding for requests that do not say
    /// (`speculative.n_max` in a request overrides it): none, or ngram
    /// (prompt lookup: the tokens that followed the sequence's last
    /// n-gram earlier in its prompt or output are verified in one step;
    /// the same tokens come out, faster where the output repeats its
    /// input, as in code edits).
    #[arg(long, value_enum, default_value_t = SpecType::None)]
    pub spec_type: SpecType,
    /// Most draft tokens one step verifies (llama-server's --draft-max).
    /// Prompt lookup sends fewer where this cluster's measured step costs
    /// and acceptance say a shorter draft brings more tokens per second.
    #[arg(long, default_value_t = 64)]
    pub draft_max: usize,
    /// A shorter draft is not verified (llama-server's --draft-min).
    #[arg(long, default_value_t = 0)]
    pub draft_min: usize,
    /// The fewest tokens a prompt-lookup match must agree on before it
    /// drafts (its draft is as long as the agreement, up to --draft-max).
    #[arg(long, default_value_t = omni_engine::speculative::DEFAULT_NGRAM)]
    pub spec_ngram_size: usize,
    /// Prompt lookup also looks in the model's recently ended sequences
    /// (prompts and answers), up to this many tokens (0: only in the
    /// sequence itself): a request that repeats or revises an earlier
    /// answer drafts it. Changes no token; a client who can time its own
    /// requests may tell whether text appeared recently (as with the
    /// prefix cache).
    #[arg(long, default_value_t = 65536)]
    pub spec_recent_tokens: usize,
    /// How long a prompt-lookup draft is: tuned (as long as the match
    /// agrees on at first, then by the rule, among a few thresholds and
    /// lengths or no drafts, that would have been fastest over this
    /// cluster's recently ended answers at its measured step costs) or
    /// agreement (as many tokens as the match agrees on, up to
    /// --draft-max, whatever they cost).
    #[arg(long, value_enum, default_value_t = DraftLength::Tuned)]
    pub draft_length: DraftLength,
    /// A draft model for speculative decoding (llama-server's -md): a
    /// small GGUF with the model's vocabulary, loaded whole by the worker
    /// that runs the last stage. Requests that turn speculation on
    /// (`--spec-type draft`, or `speculative.n_max`) draft with it.
    #[arg(long)]
    pub model_draft: Option<PathBuf>,
    /// A draft model's guesses stop at one it gives less probability
    /// (llama-server's --draft-p-min).
    #[arg(long, default_value_t = omni_engine::speculative::DEFAULT_P_MIN)]
    pub draft_p_min: f32,
    /// Memory left unplanned on every worker (fraction).
    #[arg(long, default_value_t = 0.10)]
    pub headroom: f64,
    /// Manual split by proportion, like llama.cpp's --tensor-split (e.g. 3,1).
    #[arg(long, value_delimiter = ',', conflicts_with = "counts")]
    pub split: Option<Vec<f64>>,
    /// Manual split by layer counts per stage (e.g. 12,12).
    #[arg(long, value_delimiter = ',')]
    pub counts: Option<Vec<u32>>,
    /// auto (shared memory where both ends share a host), shm or grpc.
    #[arg(long, default_value = "auto")]
    pub transport: TransportChoice,
    /// Send hidden states as f16 (half the bytes; results change slightly).
    #[arg(long)]
    pub f16_hidden: bool,
    /// A step with no answer for this many seconds means the pipeline is
    /// stuck: the cluster recovers.
    #[arg(long, default_value_t = 120.0)]
    pub step_timeout: f64,
    /// How long a lost worker may take to come back (its supervisor
    /// restarts it) before the plan is made again over the others, when
    /// they can hold the model (seconds).
    #[arg(long, default_value_t = 30.0)]
    pub rejoin_timeout: f64,
    /// How long a recovery may take before the requests in flight are
    /// stopped with the reason; the cluster keeps waiting for its workers
    /// and serves again once they are back (seconds).
    #[arg(long, default_value_t = 120.0)]
    pub recovery_timeout: f64,
    /// Most requests waiting for a slot (also while recovering); beyond
    /// it new requests are refused as unavailable (the router's 503).
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// How often each worker's health is checked (seconds).
    #[arg(long, default_value_t = 1.0)]
    pub health_interval: f64,
    /// Where the results ring lives.
    #[arg(long, default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// Prometheus metrics (GET /metrics) listen address.
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// Where the admin API (omni.admin.v1) listens: apart from Inference,
    /// so that it can stay off the network clients reach.
    #[arg(long, default_value = "127.0.0.1:7071")]
    pub admin_listen: String,
    /// The token admin calls must carry (`authorization: Bearer ...`);
    /// without one every admin call is refused. Give it as OMNI_COORDINATOR_ADMIN_TOKEN
    /// or --admin-token-file: a flag is visible to every user in `ps`.
    #[arg(long, hide = true)]
    pub admin_token: Option<String>,
    /// A file holding the admin token (e.g. a compose secret at
    /// /run/secrets/admin_token), instead of --admin-token.
    #[arg(long)]
    pub admin_token_file: Option<PathBuf>,
    #[command(flatten)]
    pub telemetry: omni_telemetry::TelemetryArgs,
    #[command(flatten)]
    pub tls: omni_transport::tls::TlsArgs,
}

/// A worker that registered.
#[derive(Clone, Debug)]
pub struct Registered {
    pub id: String,
    pub addr: String,
    pub inventory: Inventory,
    pub kind: WorkerKind,
    /// What it still holds from a coordinator before this one (its Load,
    /// or its experts' model and layers).
    pub held: Option<omni_proto::worker::v1::LoadRequest>,
    pub held_experts: Option<(String, Vec<u32>)>,
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
    fn new(
        cfg: &CoordinatorConfig,
        model: &ModelFile,
        tokenizer: Arc<Tokenizer>,
        template: Option<ChatTemplate>,
        registrations: mpsc::UnboundedSender<Registered>,
        metrics: Arc<Metrics>,
    ) -> Shared {
        let info = Arc::new(Mutex::new(InfoReply {
            model_path: cfg.model.display().to_string(),
            architecture: model.hparams.arch.name().to_string(),
            n_ctx: cfg.ctx as u32,
            n_vocab: tokenizer.n_vocab() as u32,
            n_seq: cfg.seqs as u32,
            state: "waiting for workers".into(),
            instance: instance_id(),
            ..Default::default()
        }));
        let admin = Arc::new(admin::AdminState::new(metrics.clone()));
        admin.set_info(info.clone());
        Shared {
            cfg: cfg.clone(),
            tokenizer,
            template,
            registrations,
            registering: Mutex::new(true),
            events: Mutex::new(None),
            info,
            next_seq: 1.into(),
            metrics,
            admin,
            recovery: Arc::default(),
            grammars: Default::default(),
        }
    }

    /// Compiles a request's grammar: an error naming the request field it
    /// came from and what is wrong with it ("invalid JSON schema: ...").
    pub fn check_grammar(&self, g: &omni_engine::sampling::Grammar) -> Result<(), error::Error> {
        let grammars = self
            .grammars
            .get_or_init(|| {
                omni_engine::constraint::Grammars::new(&self.tokenizer).map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| {
                error::Error::Internal(format!("constrained decoding is unavailable: {e}"))
            })?;
        grammars
            .compile(g)
            .map(drop)
            .map_err(|e| error::Error::invalid(grammar_field(g), e.to_string()))
    }
}

/// Where a grammar came from in the request: the tools' schemas for a tool
/// call's grammar, else the grammar's kind.
fn grammar_field(g: &omni_engine::sampling::Grammar) -> &'static str {
    use omni_engine::sampling::Grammar;
    match g {
        Grammar::JsonObject => "sampling.grammar.json_object",
        Grammar::JsonSchema { .. } => "sampling.grammar.json_schema",
        Grammar::Lark { .. } => "sampling.grammar.lark",
        Grammar::Triggered { .. } => "chat.tools_json",
    }
}

/// Runs the coordinator until it is stopped or its start-up fails.
pub async fn run(mut cfg: CoordinatorConfig) -> anyhow::Result<()> {
    if cfg.workers == 0 {
        anyhow::bail!("--workers must be at least 1");
    }
    omni_transport::tls::install(&cfg.tls)?;
    start::resolve_admin_token(&mut cfg)?;
    let (model, tokenizer, template) = start::open_model(&cfg)?;
    let listener = tokio::net::TcpListener::bind(&cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    let local = listener.local_addr()?;
    let advertise = cfg.advertise.clone().unwrap_or_else(|| local.to_string());
    start::log_listening(&cfg, &model, local);

    let mut inbox = Inbox::new();
    let name = format!("omni-coordinator-{}", std::process::id());
    if let Err(e) = inbox.add_ring(&cfg.shm_dir, &name, 4 << 20) {
        tracing::warn!("no shared-memory ring for results ({e}); results come over gRPC");
    }
    let host_id = omni_transport::host_id();
    let (reg_tx, mut reg_rx) = mpsc::unbounded_channel();
    let metrics = Arc::new(Metrics::new());
    let shared = Arc::new(Shared::new(
        &cfg,
        &model,
        tokenizer.clone(),
        template,
        reg_tx,
        metrics.clone(),
    ));

    let (health_reporter, server) = start::serve_inference(listener, &shared, &inbox).await;
    start::serve_admin(&cfg, shared.admin.clone()).await?;
    if let Some(addr) = &cfg.metrics_listen {
        let m = metrics.clone();
        omni_runtime::metrics::serve(addr, Arc::new(move || m.render())).await?;
    }

    // 1. Workers.
    let (mut workers, expert_workers) = start::wait_for_workers(&cfg, &shared, &mut reg_rx).await?;
    // Workers that outlived a coordinator before this one keep their
    // stages when the plan asks for what they hold: the same ranges, in
    // the order they ran.
    let held_counts = start::held_pipeline(&cfg, &mut workers);

    // 2. Plan, before anything is loaded.
    let sites: Vec<pipeline::Site> = workers.iter().map(pipeline::Site::of).collect();
    let read_rates = start::read_rates(&workers, &sites);
    let spec = |w: &Registered| start::worker_spec(w, read_rates.get(&w.id).copied().unwrap_or(0));
    let specs: Vec<WorkerSpec> = workers.iter().map(spec).collect();
    let expert_specs: Vec<WorkerSpec> = expert_workers.iter().map(spec).collect();
    let mut pcfg = start::plan_config(&cfg);
    if let Some(counts) = held_counts {
        pcfg.split = Some(plan::Split::Layers(counts));
    }
    let plan = plan::plan_with_experts(&model, &specs, &expert_specs, &pcfg)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    tracing::info!("plan:\n{plan}");
    shared.info.lock().unwrap().state = "loading".into();

    // 3. Load every stage (in parallel), then wire the pipeline. Steps are
    // numbered from the clock's microseconds, so that a kept stage can tell
    // the frames of a coordinator before this one (smaller ids) and drop
    // them.
    let first_step = start::first_step();
    let (replies, expert_info) = tokio::try_join!(
        start::load_stages(&cfg, &plan, &workers, first_step),
        start::load_experts(&cfg, &plan, &expert_workers),
    )?;
    let mut plan = plan;
    for note in start::fallback_notes(&plan, &replies) {
        tracing::warn!("{note}");
        plan.notes.push(note);
    }
    // The plan names only registered expert workers.
    let expert_worker = |id: &str| -> &Registered {
        expert_workers
            .iter()
            .find(|w| w.id == id)
            .expect("the plan names registered expert workers")
    };
    let inbox = Arc::new(Mutex::new(inbox));
    let results_ep = inbox.lock().unwrap().endpoint(&advertise, &host_id);
    let live_workers = start::wire(
        &cfg,
        &plan,
        &workers,
        &replies,
        &results_ep,
        |id| expert_worker(id).addr.clone(),
        spec,
    )
    .await?;
    let first = replies[0].inbox.clone().unwrap_or_default();
    let outbox = Outbox::connect(&first, cfg.transport)
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the first stage: {e}"))?;
    tracing::info!("steps go to stage 0 over {}", outbox.kind());

    // 4. Serve.
    let (n_groups, pipeline_note) = start::micro_batch_groups(&cfg, &sites);
    // The scheduler thread waits on the results ring itself; events ring
    // the same doorbell.
    let frames = inbox.lock().unwrap().reader();
    let (ev_tx, ev_rx) = frames.bell().channel();
    *shared.events.lock().unwrap() = Some(ev_tx.clone());
    let (recover_tx, recover_rx) = mpsc::unbounded_channel();
    let sched = Scheduler::new(
        start::scheduler_config(&cfg, n_groups, &model.hparams, first_step),
        tokenizer,
        outbox,
        metrics,
        Some(recover_tx),
    );
    std::thread::Builder::new()
        .name("scheduler".into())
        .spawn(move || sched.run(ev_rx, frames))?;
    let live = migrate::Live::new(
        start::live_setup(
            &cfg,
            model.clone(),
            pcfg.clone(),
            advertise.clone(),
            ev_tx.clone(),
        ),
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
    start::watch(
        &cfg,
        &shared,
        recover_rx,
        workers.iter().chain(&expert_workers),
        ev_tx.clone(),
    );
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
    omni_transport::tls::endpoint(addr)?
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
        omni_transport::tls::endpoint(addr)
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
