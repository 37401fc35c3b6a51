//! Start-up, one step at a time: wait for the workers, describe them to the
//! planner, load every stage and expert worker (in parallel), wire the
//! pipeline. [`crate::run`] calls these in order, then serves.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use omni_planner as plan;
use omni_proto::coordinator::v1::{ExpertWorkerInfo, WorkerKind};
use omni_proto::worker::v1::{
    experts_client::ExpertsClient, Endpoint, LoadExpertsRequest, LoadReply, LoadRequest, Transport,
    WireRequest,
};
use plan::{Plan, PlanConfig, Split, WorkerSpec};
use tokio::sync::mpsc;

use std::sync::Arc;

use omni_engine::chat::ChatTemplate;
use omni_engine::model::ModelFile;
use omni_engine::tokenizer::Tokenizer;

use crate::scheduler::{Event, RecoveryNeeded, SchedulerConfig};
use crate::service;
use crate::{
    admin, channel, migrate, pipeline, recover, watch_worker, worker_client, CoordinatorConfig,
    Registered, Shared,
};
use omni_proto::coordinator::v1::{inference_server, registry_server};
use omni_transport::Inbox;

/// Waits until `--workers` stage workers and `--cpu-workers` expert workers
/// have registered, or `--register-timeout` passes (an error naming who
/// came). Workers past the count are told nothing and stay idle.
pub(crate) async fn wait_for_workers(
    cfg: &CoordinatorConfig,
    shared: &Shared,
    registrations: &mut mpsc::UnboundedReceiver<Registered>,
) -> anyhow::Result<(Vec<Registered>, Vec<Registered>)> {
    let deadline = Instant::now() + Duration::from_secs_f64(cfg.register_timeout);
    let mut workers: Vec<Registered> = Vec::new();
    let mut expert_workers: Vec<Registered> = Vec::new();
    while workers.len() < cfg.workers || expert_workers.len() < cfg.cpu_workers {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(Some(w)) = tokio::time::timeout(left, registrations.recv()).await else {
            anyhow::bail!("{}", too_few_registered(cfg, &workers, &expert_workers));
        };
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
    Ok((workers, expert_workers))
}

/// The admin token from --admin-token or --admin-token-file, warning when
/// it was given on the command line.
pub(crate) fn resolve_admin_token(cfg: &mut CoordinatorConfig) -> anyhow::Result<()> {
    omni_runtime::warn_secret_flags(
        "omni-coordinator",
        &[(
            "--admin-token",
            "OMNI_COORDINATOR_ADMIN_TOKEN or --admin-token-file",
        )],
    );
    cfg.admin_token = omni_runtime::value_or_secret_file(
        cfg.admin_token.take(),
        cfg.admin_token_file.as_deref(),
        "the admin token (--admin-token / --admin-token-file)",
    )
    .map_err(anyhow::Error::msg)?;
    Ok(())
}

fn too_few_registered(
    cfg: &CoordinatorConfig,
    workers: &[Registered],
    expert_workers: &[Registered],
) -> String {
    let names: Vec<String> = workers
        .iter()
        .chain(expert_workers)
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
    format!(
        "only {} of {} workers{experts} registered within {:.0}s{}",
        workers.len(),
        cfg.workers,
        cfg.register_timeout,
        if names.is_empty() {
            String::new()
        } else {
            format!(" (registered: {})", names.join(", "))
        }
    )
}

/// A registered worker as the planner sees it, `read_rate` its compute
/// site's measured figure.
pub(crate) fn worker_spec(w: &Registered, read_rate: u64) -> WorkerSpec {
    WorkerSpec {
        id: w.id.clone(),
        device: w.inventory.device.clone(),
        free_bytes: w.inventory.memory_free,
        total_bytes: w.inventory.memory_total,
        read_rate,
        pool: memory_pool(w),
    }
}

/// The memory a worker computes on, as the planner keys it: workers of one
/// host that compute on its RAM (stage and expert workers), or on one GPU,
/// share that memory, each offering what it has free, so the planner counts
/// it once. `None` for a worker that did not say which host it is on.
fn memory_pool(w: &Registered) -> Option<plan::MemoryPool> {
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
        // A GPU without an NVML record (Vulkan's): its own memory, keyed by
        // its name (a software device such as lavapipe computes in host RAM
        // but reports a heap of its own; the plan counts it apart).
        None if plan::is_gpu(&inv.device) => plan::MemoryPool {
            key: format!("{}/gpu/{}", inv.host_id, inv.device),
            name: format!("{host}'s {}", inv.device),
        },
        None => plan::MemoryPool {
            key: format!("{}/ram", inv.host_id),
            name: format!("{host}'s RAM"),
        },
    })
}

/// The plan's notes on ops a GPU stage's backend cannot compute, which ggml
/// runs on the CPU beside it (from the stages' load replies, in stage order).
pub(crate) fn fallback_notes(plan: &Plan, replies: &[LoadReply]) -> Vec<String> {
    plan.stages
        .iter()
        .zip(replies)
        .filter(|(_, r)| !r.fallback_ops.is_empty())
        .map(|(st, r)| {
            format!(
                "fallback: {} ({}) runs {} on the CPU: its backend cannot compute them, so ggml's scheduler copies their inputs to the CPU and the results back each step",
                st.worker,
                st.device,
                r.fallback_ops.join(", ")
            )
        })
        .collect()
}

/// The id of this coordinator's first step: the clock's microseconds, so
/// that it is above every step id of a coordinator before this one at the
/// same address (whose frames a stage it kept must drop).
pub(crate) fn first_step() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_micros() as u64)
        .max(1)
}

/// When every stage worker holds a stage of this model with this
/// coordinator's settings, from an earlier coordinator, and together they
/// run the whole model in order: sorts `workers` in their stages' order and
/// returns each stage's layer count, for a plan of the same ranges (whose
/// Loads then keep the stages). None (and a note why) otherwise: the plan
/// is made as on a first start, and a worker whose stage it does not ask
/// for loads again.
pub(crate) fn held_pipeline(
    cfg: &CoordinatorConfig,
    workers: &mut [Registered],
) -> Option<Vec<u32>> {
    let held: Vec<&LoadRequest> = workers.iter().filter_map(|w| w.held.as_ref()).collect();
    if held.is_empty() {
        return None;
    }
    let settings = load_request(cfg);
    let same = |h: &LoadRequest| {
        LoadRequest {
            embed: false,
            layer_start: 0,
            layer_end: 0,
            head: false,
            stage: 0,
            offloaded: Vec::new(),
            stream_experts: false,
            fence: 0,
            ..h.clone()
        } == settings
    };
    let why = if held.len() < workers.len() {
        Some(format!(
            "{} of {} workers hold a stage",
            held.len(),
            workers.len()
        ))
    } else {
        held.iter().find(|h| !same(h)).map(|h| {
            format!(
                "a worker holds layers of {} with other settings (context, sequences, batch)",
                h.model_path
            )
        })
    };
    if let Some(why) = why {
        tracing::info!("workers hold stages of an earlier coordinator, but {why}: planning afresh");
        return None;
    }
    workers.sort_by_key(|w| w.held.as_ref().map_or(u32::MAX, |h| h.stage));
    let ranges: Vec<&LoadRequest> = workers.iter().filter_map(|w| w.held.as_ref()).collect();
    let whole = ranges
        .first()
        .is_some_and(|h| h.embed && h.layer_start == 0)
        && ranges.last().is_some_and(|h| h.head)
        && ranges
            .windows(2)
            .all(|p| p[0].layer_end == p[1].layer_start);
    if !whole {
        tracing::info!(
            "workers hold stages of an earlier coordinator that do not make one pipeline: planning afresh"
        );
        workers.sort_by(|a, b| a.id.cmp(&b.id));
        return None;
    }
    let counts: Vec<u32> = ranges.iter().map(|h| h.layer_end - h.layer_start).collect();
    tracing::info!(
        "every worker holds its stage from an earlier coordinator: planning the same ranges ({})",
        counts
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",")
    );
    Some(counts)
}

/// Has every stage worker load its range (all at once); their replies in
/// stage order.
pub(crate) async fn load_stages(
    cfg: &CoordinatorConfig,
    plan: &Plan,
    workers: &[Registered],
    first_step: u64,
) -> anyhow::Result<Vec<LoadReply>> {
    let mut loads = Vec::new();
    for (i, (st, w)) in plan.stages.iter().zip(workers).enumerate() {
        let req = LoadRequest {
            embed: st.range.embed,
            layer_start: st.range.layers.start,
            layer_end: st.range.layers.end,
            head: st.range.head,
            stage: i as u32,
            offloaded: st.offloaded.clone(),
            stream_experts: st.stream_bytes > 0,
            fence: first_step,
            ..load_request(cfg)
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
            let r = r.into_inner();
            if r.kept {
                tracing::info!(
                    "worker {id} kept the stage it ran for an earlier coordinator (no load)"
                );
            }
            anyhow::Ok(r)
        }));
    }
    let mut replies = Vec::new();
    for l in loads {
        replies.push(l.await??);
    }
    Ok(replies)
}

/// Has every expert worker the plan names load its layers' experts (all at
/// once); what each holds, in the plan's order.
pub(crate) async fn load_experts(
    cfg: &CoordinatorConfig,
    plan: &Plan,
    expert_workers: &[Registered],
) -> anyhow::Result<Vec<ExpertWorkerInfo>> {
    let mut loads = Vec::new();
    for ep in &plan.experts {
        let w = expert_workers
            .iter()
            .find(|w| w.id == ep.worker)
            .context("the plan names an expert worker that did not register")?
            .clone();
        let req = LoadExpertsRequest {
            model_path: cfg.model.display().to_string(),
            layers: ep.layers.clone(),
            n_ubatch: cfg.ubatch as u32,
        };
        let layers = ep.layers.clone();
        loads.push(tokio::spawn(async move {
            let ch = channel(&w.addr).await?;
            let r = ExpertsClient::new(ch)
                .load_experts(req)
                .await
                .map_err(|s| {
                    anyhow::anyhow!(
                        "expert worker {} ({}) could not load its experts: {}",
                        w.id,
                        w.addr,
                        s.message()
                    )
                })?
                .into_inner();
            tracing::info!(
                "expert worker {} {} the experts of layers {} ({} weights, {} compute; {})",
                w.id,
                if r.kept { "kept (no load)" } else { "holds" },
                plan::fmt_layers(&layers),
                omni_engine::fmt_bytes(r.weight_bytes),
                omni_engine::fmt_bytes(r.compute_bytes),
                r.binding
            );
            anyhow::Ok(ExpertWorkerInfo {
                worker_id: w.id.clone(),
                worker_addr: w.addr.clone(),
                device: w.inventory.device.clone(),
                layers: plan::fmt_layers(&layers),
                weight_bytes: r.weight_bytes,
                compute_bytes: r.compute_bytes,
                binding: r.binding,
            })
        }));
    }
    let mut info = Vec::new();
    for l in loads {
        info.push(l.await??);
    }
    Ok(info)
}

/// Connects each stage to the next (the last to `results`, the
/// coordinator's inbox) and to the expert workers of its offloaded layers;
/// the cluster's workers as live moves will know them.
pub(crate) async fn wire(
    cfg: &CoordinatorConfig,
    plan: &Plan,
    workers: &[Registered],
    replies: &[LoadReply],
    results: &Endpoint,
    expert_addr: impl Fn(&str) -> String,
    spec: impl Fn(&Registered) -> WorkerSpec,
) -> anyhow::Result<Vec<migrate::LiveWorker>> {
    let transport = Transport::from(cfg.transport);
    let mut live_workers = Vec::new();
    for (i, w) in workers.iter().enumerate() {
        let next: Endpoint = match replies.get(i + 1) {
            Some(r) => r.inbox.clone().unwrap_or_default(),
            None => results.clone(),
        };
        let routes = migrate::routes_for(&plan.stages[i].offloaded, plan, &expert_addr);
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
            "stage {i}: worker {} runs {} ({} weights, {} KV, {} compute of the {} planned), output over {}",
            w.id,
            st.range,
            omni_engine::fmt_bytes(lr.weight_bytes),
            omni_engine::fmt_bytes(lr.kv_bytes),
            omni_engine::fmt_bytes(lr.compute_bytes),
            omni_engine::fmt_bytes(st.bytes.compute),
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
    Ok(live_workers)
}

/// Opens the model the coordinator serves, its tokenizer and chat template
/// (a model without a usable template serves completions only), and checks
/// `--ctx` against its trained context.
pub(crate) fn open_model(
    cfg: &CoordinatorConfig,
) -> anyhow::Result<(Arc<ModelFile>, Arc<Tokenizer>, Option<ChatTemplate>)> {
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
    let pool = cfg.ctx * cfg.seqs;
    if let Some(n) = cfg.prefix_cache_size.filter(|&n| n > pool) {
        anyhow::bail!(
            "--prefix-cache-size {n} exceeds the KV cache of {pool} cells (--ctx {} x --seqs {}); \
             the prefix cache lives in it",
            cfg.ctx,
            cfg.seqs
        );
    }
    match &cfg.model_draft {
        Some(d) => {
            let draft =
                ModelFile::open(d).with_context(|| format!("cannot draft with {}", d.display()))?;
            omni_engine::speculative::check_vocab(&model, &draft)?;
            tracing::info!(
                "draft model {} ({}, {} layers) drafts for requests that turn speculation on",
                d.display(),
                draft.hparams.arch.name(),
                draft.hparams.n_layer
            );
        }
        None if cfg.spec_type == crate::SpecType::Draft => {
            anyhow::bail!("--spec-type draft needs a draft model (--model-draft)")
        }
        None => {}
    }
    Ok((model, tokenizer, template))
}

/// Serves the admin API on `--admin-listen` (every call refused without an
/// admin token).
pub(crate) async fn serve_admin(
    cfg: &CoordinatorConfig,
    state: Arc<admin::AdminState>,
) -> anyhow::Result<()> {
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
    let admin_server = omni_transport::tls::server()
        .add_service(
            omni_proto::admin::v1::admin_server::AdminServer::with_interceptor(
                admin::AdminSvc(state),
                admin::Auth::new(cfg.admin_token.clone()),
            ),
        )
        .serve_with_incoming(omni_transport::tls::incoming(admin_listener));
    tokio::spawn(async move {
        if let Err(e) = admin_server.await {
            tracing::error!("the admin API stopped: {e}");
        }
    });
    Ok(())
}

/// How many micro-batch groups the scheduler keeps in flight, and why.
pub(crate) fn micro_batch_groups(
    cfg: &CoordinatorConfig,
    sites: &[pipeline::Site],
) -> (usize, String) {
    match cfg.micro_batches {
        Some(n) => (
            n.max(1),
            format!("{} micro-batch groups (--micro-batches)", n.max(1)),
        ),
        None => {
            let (n, why) = pipeline::default_groups(sites);
            if let Some(why) = &why {
                tracing::info!("{why}");
            }
            (n, why.unwrap_or_default())
        }
    }
}

/// Starts crash recovery and a health watch on every worker.
pub(crate) fn watch<'a>(
    cfg: &CoordinatorConfig,
    shared: &Shared,
    recover_rx: mpsc::UnboundedReceiver<RecoveryNeeded>,
    workers: impl Iterator<Item = &'a Registered>,
    events: omni_transport::BellSender<Event>,
) {
    tokio::spawn(recover::run(
        recover_rx,
        shared.admin.clone(),
        shared.recovery.clone(),
        shared.info.clone(),
        events.clone(),
        recover::Timeouts {
            rejoin: Duration::from_secs_f64(cfg.rejoin_timeout),
            give_up: Duration::from_secs_f64(cfg.recovery_timeout),
        },
    ));
    for w in workers {
        tokio::spawn(watch_worker(
            w.clone(),
            Duration::from_secs_f64(cfg.health_interval),
            events.clone(),
            shared.admin.clone(),
            shared.recovery.clone(),
        ));
    }
}

/// The planner's settings from the coordinator's.
pub(crate) fn plan_config(cfg: &CoordinatorConfig) -> PlanConfig {
    PlanConfig {
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
    }
}

/// Each stage worker's weight read rate as the planner should count it: its
/// compute site's figure (workers that take turns on one site share it).
pub(crate) fn read_rates(workers: &[Registered], sites: &[pipeline::Site]) -> HashMap<String, u64> {
    let rates = pipeline::site_rates(
        sites,
        &workers
            .iter()
            .map(|w| w.inventory.weight_read_rate)
            .collect::<Vec<_>>(),
    );
    workers
        .iter()
        .zip(&rates)
        .map(|(w, r)| (w.id.clone(), *r as u64))
        .collect()
}

pub(crate) fn scheduler_config(
    cfg: &CoordinatorConfig,
    n_groups: usize,
    hp: &omni_engine::Hparams,
    first_step: u64,
) -> SchedulerConfig {
    SchedulerConfig {
        first_step,
        n_ctx: cfg.ctx,
        n_seq: cfg.seqs,
        n_ubatch: cfg.ubatch,
        prefill_chunk: cfg.prefill_chunk,
        prompt_cuts: cfg.prompt_cuts.for_model(hp),
        n_groups,
        step_timeout: Duration::from_secs_f64(cfg.step_timeout),
        max_queue: cfg.max_queue,
        prefix_cache: (cfg.prefix_cache == crate::Switch::On)
            .then(|| cfg.prefix_cache_size.unwrap_or(cfg.ctx * cfg.seqs)),
        spec_recent: cfg.spec_recent_tokens,
        spec_tuned: cfg.draft_length == crate::DraftLength::Tuned,
    }
}

/// What live moves need to know of this coordinator.
pub(crate) fn live_setup(
    cfg: &CoordinatorConfig,
    model: Arc<ModelFile>,
    pcfg: PlanConfig,
    advertise: String,
    events: omni_transport::BellSender<Event>,
) -> migrate::Setup {
    migrate::Setup {
        model,
        pcfg,
        transport: cfg.transport,
        advertise,
        shm_dir: cfg.shm_dir.clone(),
        events,
        step_timeout: Duration::from_secs_f64(cfg.step_timeout),
        load: load_request(cfg),
    }
}

/// What every stage's load asks, whatever its range.
fn load_request(cfg: &CoordinatorConfig) -> LoadRequest {
    LoadRequest {
        model_path: cfg.model.display().to_string(),
        n_ctx: cfg.ctx as u32,
        n_seq: cfg.seqs as u32,
        n_ubatch: cfg.ubatch as u32,
        f16_hidden: cfg.f16_hidden,
        gpu_experts: cfg.gpu_experts,
        deterministic: cfg.deterministic != crate::Determinism::Off,
        draft_model_path: cfg
            .model_draft
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        ..Default::default()
    }
}

/// Says where the coordinator listens and what it waits for.
pub(crate) fn log_listening(
    cfg: &CoordinatorConfig,
    model: &ModelFile,
    local: std::net::SocketAddr,
) {
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
}

/// Serves Registry, Inference (NOT_SERVING until the cluster is up), the
/// results sink and gRPC health on `listener`; the health reporter and the
/// server's task.
pub(crate) async fn serve_inference(
    listener: tokio::net::TcpListener,
    shared: &Arc<Shared>,
    inbox: &Inbox,
) -> (
    tonic_health::server::HealthReporter,
    tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
) {
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_not_serving::<inference_server::InferenceServer<service::InferenceSvc>>()
        .await;
    let server = omni_transport::tls::server()
        .add_service(health)
        .add_service(registry_server::RegistryServer::new(service::RegistrySvc(
            shared.clone(),
        )))
        .add_service(inference_server::InferenceServer::new(
            service::InferenceSvc(shared.clone()),
        ))
        .add_service(inbox.sink_service())
        .serve_with_incoming(omni_transport::tls::incoming(listener));
    (health_reporter, tokio::spawn(server))
}
