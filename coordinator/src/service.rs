//! The coordinator's gRPC services: Registry (workers announce themselves)
//! and Inference (clients run requests). Request validation lives here, so a
//! bad request is refused with INVALID_ARGUMENT before it reaches the
//! scheduler.

use crate::error::Error;
use crate::scheduler::{Event, NewSeq};
use crate::{Registered, Shared};
use omni_engine::sampling::{Grammar, SamplingParams};
use omni_proto::coordinator::v1::{
    generate_request::Prompt, inference_server, registry_server, GenerateEvent, GenerateRequest,
    InfoReply, InfoRequest, RegisterReply, RegisterRequest, WorkerKind,
};
use omni_proto::worker::v1::Sampling;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status};

pub struct RegistrySvc(pub Arc<Shared>);

#[tonic::async_trait]
impl registry_server::Registry for RegistrySvc {
    async fn register(
        &self,
        req: Request<RegisterRequest>,
    ) -> Result<Response<RegisterReply>, Status> {
        let r = req.into_inner();
        if r.worker_id.is_empty() || r.grpc_addr.is_empty() {
            return Err(Error::invalid(
                if r.worker_id.is_empty() {
                    "worker_id"
                } else {
                    "grpc_addr"
                },
                "a registration needs worker_id and grpc_addr",
            )
            .into());
        }
        let kind = WorkerKind::try_from(r.kind).map_err(|_| {
            Error::invalid(
                "kind",
                format!(
                    "worker {} registered as kind {}, which this coordinator does not know",
                    r.worker_id, r.kind
                ),
            )
        })?;
        let inventory = r
            .inventory
            .ok_or_else(|| Error::invalid("inventory", "a registration needs the inventory"))?;
        let last_exit = r.last_exit;
        let w = Registered {
            id: r.worker_id,
            addr: r.grpc_addr,
            inventory,
            kind,
            held: r.held,
            held_experts: (!r.held_expert_model.is_empty())
                .then_some((r.held_expert_model, r.held_expert_layers)),
        };
        if !*self.0.registering.lock().unwrap() {
            // After the plan: only a worker of the plan coming back (it
            // restarted, so whatever it held is gone).
            let (id, addr) = (w.id.clone(), w.addr.clone());
            self.0.recovery.rejoin(w).map_err(|why| {
                Error::Unsupported(format!(
                    "{why}; registered after the plan was made, and this coordinator expects {} worker(s) and {} expert worker(s)",
                    self.0.cfg.workers, self.0.cfg.cpu_workers
                ))
            })?;
            // A drained worker runs nothing: the pipeline is not hurt; an
            // undrain reaches it at its new address (and loads it first,
            // as it restarted with nothing loaded).
            let drained = self.0.admin.is_drained(&id);
            if drained {
                let (admin, id, addr) = (self.0.admin.clone(), id.clone(), addr.clone());
                tokio::spawn(async move {
                    if let Some(live) = admin.live_lock().await.as_mut() {
                        live.set_addr(&id, &addr);
                    }
                });
            }
            if let Some(ev) = self.0.events.lock().unwrap().as_ref().filter(|_| !drained) {
                // The supervisor's or the dead process's own word on how
                // it ended ("died of SIGILL ..."), when there is one.
                let (why, death) = if last_exit.is_empty() {
                    ("it restarted (it registered again)".to_string(), None)
                } else {
                    (format!("it {last_exit}, and restarted"), Some(last_exit))
                };
                let _ = ev.send(Event::WorkerLost {
                    worker: format!("{id} ({addr})"),
                    why,
                    death,
                });
            }
            return Ok(Response::new(RegisterReply {
                model_path: self.0.cfg.model.display().to_string(),
                instance: self.0.info.lock().unwrap().instance.clone(),
            }));
        }
        self.0
            .registrations
            .send(w)
            .map_err(|_| Error::NotReady("the coordinator is shutting down".into()))?;
        Ok(Response::new(RegisterReply {
            model_path: self.0.cfg.model.display().to_string(),
            instance: self.0.info.lock().unwrap().instance.clone(),
        }))
    }
}

pub struct InferenceSvc(pub Arc<Shared>);

/// The response stream of one request. tonic drops it when the client goes
/// away (or after the last event); dropping it cancels the sequence, which
/// frees its KV cache on every stage (a finished one is simply forgotten).
pub struct CancelOnDrop {
    inner: UnboundedReceiverStream<Result<GenerateEvent, Status>>,
    id: u64,
    events: omni_transport::BellSender<Event>,
    /// A chat with tools: its calls are read out of the text.
    calls: Option<crate::tools::ToolCalls>,
}

impl tokio_stream::Stream for CancelOnDrop {
    type Item = Result<GenerateEvent, Status>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_next(cx);
        match (polled, self.calls.as_mut()) {
            (std::task::Poll::Ready(Some(Ok(ev))), Some(calls)) => {
                std::task::Poll::Ready(Some(Ok(calls.map(ev))))
            }
            (polled, _) => polled,
        }
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let _ = self.events.send(Event::Cancel(self.id));
    }
}

type EventStream = CancelOnDrop;

#[tonic::async_trait]
impl inference_server::Inference for InferenceSvc {
    type GenerateStream = EventStream;

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let arrived = Instant::now();
        let shared = &self.0;
        let events = shared.events.lock().unwrap().clone().ok_or_else(|| {
            Error::NotReady(format!(
                "the cluster is not ready yet ({})",
                shared.info.lock().unwrap().state
            ))
        })?;
        let parent = req
            .metadata()
            .get(omni_telemetry::TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let r = req.into_inner();
        let (mut prompt, chat) = self.prompt_ids(&r)?;
        // A resumed request goes on from the prompt the first coordinator
        // tokenized (a template or tokenizer that changed in an upgrade
        // must not shift the tokens under it).
        let resumed = match r.resume.clone() {
            Some(res) => {
                if !res.prompt_ids.is_empty() {
                    prompt = res.prompt_ids;
                }
                res.generated
            }
            None => Vec::new(),
        };
        let n_ctx = shared.cfg.ctx;
        let max_tokens = match r.max_tokens {
            None => n_ctx.saturating_sub(prompt.len()),
            Some(0) => {
                return Err(Error::invalid(
                    "max_tokens",
                    "max_tokens is 0 but must be at least 1 (leave it out to generate until the context is full)",
                )
                .into())
            }
            Some(n) => n as usize,
        };
        if prompt.is_empty() {
            return Err(Error::invalid("prompt", "the prompt is empty").into());
        }
        if prompt.len() >= n_ctx {
            return Err(Error::PromptTooLong(format!(
                "the prompt has {} tokens but the context is {n_ctx} tokens",
                prompt.len()
            ))
            .into());
        }
        let max_tokens = max_tokens.min(n_ctx - prompt.len());
        let n_vocab = shared.tokenizer.n_vocab();
        for (field, ids) in [("prompt", &prompt), ("resume.generated", &resumed)] {
            if let Some(&bad) = ids.iter().find(|&&t| t as usize >= n_vocab) {
                return Err(Error::invalid(
                    field,
                    format!("token id {bad} is outside the vocabulary of {n_vocab} tokens"),
                )
                .into());
            }
        }
        let mut params = sampling_params(r.sampling.as_ref())?;
        // The seed is chosen here when the request gave none, and told in
        // the first event: a router that resumes the request elsewhere
        // sends it back, so the random stream goes on as it was.
        let seed = *params
            .seed
            .get_or_insert_with(omni_engine::sampling::fresh_seed);
        let (tool_grammar, calls) = chat.map_or((None, None), |c| (c.grammar, c.calls));
        match (tool_grammar, &params.grammar) {
            (Some(g), None) => params.grammar = Some(g),
            // `auto` beside a response format: the format constrains the
            // answer, and a call is still read from it if it makes one.
            (Some(Grammar::Triggered { .. }), Some(_)) | (None, _) => {}
            (Some(_), Some(_)) => {
                return Err(Error::invalid(
                    "chat.tool_choice",
                    "invalid grammar: tool_choice forces a tool call and response_format constrains the answer; give one of them",
                )
                .into())
            }
        }
        params.validate(n_vocab).map_err(|e| {
            let omni_engine::sampling::SamplingError::InvalidParam { field, .. } = &e;
            Error::invalid(format!("sampling.{field}"), e.to_string())
        })?;
        if let Some(g) = params.grammar.clone() {
            // Compiled here once so that a bad schema or grammar is refused
            // by name before the request takes a slot; the last stage
            // compiles its own copy. The first one walks the vocabulary.
            let shared = shared.clone();
            tokio::task::spawn_blocking(move || shared.check_grammar(&g))
                .await
                .map_err(|e| Error::Internal(format!("the grammar check failed: {e}")))??;
        }
        if r.top_logprobs > 20 {
            return Err(Error::invalid(
                "top_logprobs",
                format!(
                    "top_logprobs is {} but at most 20 are allowed",
                    r.top_logprobs
                ),
            )
            .into());
        }
        let deterministic = match shared.cfg.deterministic {
            crate::Determinism::On => true,
            crate::Determinism::Request => r.deterministic,
            crate::Determinism::Off if r.deterministic => {
                return Err(Error::invalid(
                    "deterministic",
                    "this cluster computes with the fastest kernels, whose results depend on the batch: deterministic decoding needs the coordinator started with --deterministic on (every request) or --deterministic request",
                )
                .into())
            }
            crate::Determinism::Off => false,
        };
        // The coordinator's speculative settings, as far as the request
        // does not give its own (n_max 0 turns it off).
        let mut spec = shared.cfg.speculative();
        if let Some(sp) = &r.speculative {
            spec.n_max = sp.n_max.map_or(spec.n_max, |n| n as usize);
            spec.n_min = sp.n_min.map_or(spec.n_min, |n| n as usize);
            spec.p_min = sp.p_min.unwrap_or(spec.p_min);
        }
        let id = shared.next_seq.fetch_add(1, Ordering::Relaxed);
        let request_id = if r.request_id.is_empty() {
            format!("req-{id}")
        } else {
            r.request_id.clone()
        };
        tracing::info!(
            seq = id,
            request = %request_id,
            prompt_tokens = prompt.len(),
            max_tokens,
            "request"
        );
        // The request's span lives as long as its sequence (the scheduler
        // drops it at the end); every stage's spans are its children.
        let span = tracing::info_span!(
            "generate",
            otel.name = "coordinator generate",
            otel.kind = "server",
            request = %request_id,
            prompt_tokens = prompt.len(),
            max_tokens,
            completion_tokens = tracing::field::Empty,
            finish_reason = tracing::field::Empty,
            ttft_ms = tracing::field::Empty,
            cached_tokens = tracing::field::Empty,
            error = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        );
        omni_telemetry::set_parent(&span, parent.as_deref());
        let traceparent = omni_telemetry::traceparent(&span).or(parent);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        // Admitted: for a client that resumes requests, the first event
        // says who serves it and with which seed, before it waits for a slot
        // (a request still queued when this coordinator goes away is
        // resumed too).
        if r.resumable {
            let _ = tx.send(Ok(GenerateEvent {
                prompt_ids: prompt.clone(),
                instance: shared.info.lock().unwrap().instance.clone(),
                seed: Some(seed),
                ..Default::default()
            }));
        }
        let mut calls = calls;
        if let Some(c) = calls.as_mut().filter(|_| !resumed.is_empty()) {
            // The tool-call parser reads the answer's text so far, which the
            // client has: only what follows is sent.
            c.map(GenerateEvent {
                text: resumed_text(&shared.tokenizer, &r.stop, &resumed),
                ..Default::default()
            });
        }
        let stream = CancelOnDrop {
            inner: UnboundedReceiverStream::new(rx),
            id,
            events: events.clone(),
            calls,
        };
        if resumed.len() >= max_tokens || prompt.len() + resumed.len() >= n_ctx {
            // It had every token it may have when its coordinator went away
            // (only the last event was lost).
            let _ = tx.send(Ok(GenerateEvent {
                done: Some(omni_proto::coordinator::v1::Done {
                    finish_reason: omni_proto::coordinator::v1::FinishReason::Length as i32,
                    prompt_tokens: prompt.len() as u32,
                    completion_tokens: resumed.len() as u32,
                    ..Default::default()
                }),
                ..Default::default()
            }));
            return Ok(Response::new(stream));
        }
        if !resumed.is_empty() {
            tracing::info!(
                seq = id,
                request = %request_id,
                generated = resumed.len(),
                "resuming a request of an earlier coordinator"
            );
        }
        events
            .send(Event::New(Box::new(NewSeq {
                id,
                request_id,
                prompt,
                max_tokens,
                params,
                stop: r.stop.clone(),
                ignore_eos: r.ignore_eos,
                logprobs: r.logprobs,
                top_logprobs: r.top_logprobs,
                events: tx,
                arrived,
                span,
                traceparent,
                cache_prompt: r.cache_prompt.unwrap_or(true),
                deterministic,
                resumed,
                spec,
            })))
            .map_err(|_| Error::NotReady("the scheduler has stopped".into()))?;
        Ok(Response::new(stream))
    }

    async fn info(&self, _: Request<InfoRequest>) -> Result<Response<InfoReply>, Status> {
        let mut info = self.0.info.lock().unwrap().clone();
        let (p50, p99, n) = self.0.metrics.hop_percentiles();
        info.hop_us_p50 = p50;
        info.hop_us_p99 = p99;
        info.hop_samples = n as u64;
        let (p50, mean, n) = self.0.metrics.expert_wait();
        info.expert_wait_ms_p50 = p50;
        info.expert_wait_ms_mean = mean;
        info.expert_wait_samples = n as u64;
        info.queue_depth = self.0.metrics.queue_depth.get().max(0) as u32;
        info.active_sequences = self.0.metrics.active_sequences.get().max(0) as u32;
        Ok(Response::new(info))
    }
}

impl InferenceSvc {
    /// The prompt's tokens and, for a chat with tools, what they ask of
    /// the answer (see [`crate::tools`]).
    fn prompt_ids(
        &self,
        r: &GenerateRequest,
    ) -> Result<(Vec<u32>, Option<crate::tools::RenderedChat>), Error> {
        let shared = &self.0;
        let encode = |t: &str, special: bool| {
            shared
                .tokenizer
                .encode(t, true, special)
                .map_err(|e| Error::invalid("prompt", e.to_string()))
        };
        match &r.prompt {
            None => Err(Error::invalid(
                "prompt",
                "a request needs a prompt: text, ids or chat",
            )),
            Some(Prompt::Ids(ids)) => Ok((ids.ids.clone(), None)),
            Some(Prompt::Text(t)) => Ok((encode(t, false)?, None)),
            Some(Prompt::Chat(c)) => {
                let template = shared.template.as_ref().ok_or_else(|| {
                    Error::Unsupported("this model has no usable chat template".into())
                })?;
                if c.messages.is_empty() {
                    return Err(Error::invalid("chat.messages", "chat messages are empty"));
                }
                let chat = crate::tools::render(c, template, &shared.tokenizer)?;
                Ok((encode(&chat.text, true)?, Some(chat)))
            }
        }
    }
}

/// The text a resumed request's tokens made (as the scheduler streamed it:
/// stop strings held back), for the tool-call parser to read again.
fn resumed_text(
    tokenizer: &omni_engine::tokenizer::Tokenizer,
    stop: &[String],
    resumed: &[u32],
) -> String {
    let mut decoder = omni_engine::tokenizer::StreamDecoder::default();
    let mut stops = omni_engine::sampling::StopMatcher::new(stop.to_vec());
    resumed
        .iter()
        .map(|&t| crate::scheduler::push_text(tokenizer, &mut decoder, &mut stops, t).text)
        .collect()
}

/// The request's sampling settings; absent means greedy. A grammar that is
/// not one is refused naming its field.
fn sampling_params(s: Option<&Sampling>) -> Result<SamplingParams, Error> {
    omni_proto::sampling::params(s)
        .map_err(|e| Error::invalid(format!("sampling.{}", e.field), e.message))
}
