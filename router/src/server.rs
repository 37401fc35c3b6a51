//! The HTTP side: axum routes for the OpenAI API, authentication, the
//! in-flight bound, body limits, health, readiness and metrics. Each request
//! becomes `n` Generate calls on the model's coordinator; streaming responses
//! are SSE, and a client that goes away drops the gRPC streams, which
//! cancels the sequences in the cluster.

use crate::openai::{
    self, choice_request, from_status, parse_json, sse_data, ApiError, ChatCompletion,
    ChatCompletionRequest, ChatStream, Completion, CompletionRequest, CompletionStream, Generated,
    ModelList, Timings, Usage, SSE_DONE,
};
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use omni_proto::coordinator::v1::{
    inference_client::InferenceClient, GenerateEvent, GenerateRequest, InfoRequest, Token,
};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::Channel;
use tracing::Instrument;

pub use crate::backends::{Backend, Target};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabel {
    path: String,
    status: u16,
}

pub struct Metrics {
    requests: Family<StatusLabel, Counter<u64, AtomicU64>>,
    in_flight: Gauge<i64>,
    tokens_in: Counter<u64, AtomicU64>,
    tokens_out: Counter<u64, AtomicU64>,
    ttft: Histogram,
    registry: prometheus_client::registry::Registry,
}

impl Metrics {
    fn new() -> Metrics {
        let requests = Family::<StatusLabel, Counter<u64, AtomicU64>>::default();
        let in_flight = Gauge::<i64>::default();
        let (tokens_in, tokens_out) = (Counter::default(), Counter::default());
        let ttft = Histogram::new(exponential_buckets(1.0, 2.0, 16));
        let mut r = prometheus_client::registry::Registry::with_prefix("omni_router");
        r.register(
            "requests",
            "HTTP requests by path and status",
            requests.clone(),
        );
        r.register("in_flight", "Requests being served", in_flight.clone());
        r.register("tokens_in", "Prompt tokens", tokens_in.clone());
        r.register("tokens_out", "Generated tokens", tokens_out.clone());
        r.register(
            "time_to_first_token_ms",
            "Arrival to first token, milliseconds (as the coordinator measured it)",
            ttft.clone(),
        );
        Metrics {
            requests,
            in_flight,
            tokens_in,
            tokens_out,
            ttft,
            registry: r,
        }
    }

    fn count(&self, path: &str, status: StatusCode) {
        self.requests
            .get_or_create(&StatusLabel {
                path: path.to_string(),
                status: status.as_u16(),
            })
            .inc();
    }

    fn done(&self, outputs: &[Generated]) {
        let u = Usage::of(outputs);
        self.tokens_in.inc_by(u.prompt_tokens as u64);
        self.tokens_out.inc_by(u.completion_tokens as u64);
        for g in outputs {
            if let Some(d) = g.done {
                self.ttft.observe(d.time_to_first_token_ms);
            }
        }
    }
}

pub struct AppState {
    pub backends: Vec<Backend>,
    /// Rules for the model name `auto`.
    pub auto: Vec<(crate::backends::Rule, String)>,
    http: reqwest::Client,
    pub api_keys: Vec<String>,
    pub limit: Arc<Semaphore>,
    pub max_in_flight: usize,
    pub body_limit: usize,
    pub metrics: Metrics,
    /// When the router started (the models' `created`).
    pub started: u64,
    /// How long a request whose coordinator went away waits to be resumed
    /// (`--resume-timeout`; see `resume.rs`).
    pub resume_timeout: Duration,
}

impl AppState {
    pub fn new(
        backends: Vec<Backend>,
        auto: Vec<(crate::backends::Rule, String)>,
        api_keys: Vec<String>,
        max_in_flight: usize,
        body_limit: usize,
    ) -> AppState {
        AppState {
            backends,
            auto,
            http: reqwest::Client::new(),
            api_keys,
            limit: Arc::new(Semaphore::new(max_in_flight)),
            max_in_flight,
            body_limit,
            metrics: Metrics::new(),
            started: openai::unix_now(),
            resume_timeout: Duration::from_secs(120),
        }
    }

    /// The backend for `model`; `auto` goes by the rules on `prompt`.
    fn backend(&self, model: &str, prompt: &str) -> Result<&Backend, ApiError> {
        let model = if model == "auto" {
            crate::backends::pick(&self.auto, prompt).unwrap_or(model)
        } else {
            model
        };
        self.backends
            .iter()
            .find(|b| b.name == model || b.aliases.iter().any(|a| a == model))
            .ok_or_else(|| {
                let names: Vec<String> = self.backends.iter().map(|b| b.name.clone()).collect();
                ApiError::model_not_found(model, &names)
            })
    }
}

type Shared = Arc<AppState>;

pub fn app(state: Shared) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route(
            "/health",
            get(|| async { axum::Json(serde_json::json!({"status": "ok"})) }),
        )
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .method_not_allowed_fallback(|req: Request| async move {
            ApiError::method_not_allowed(req.method().as_str(), req.uri().path())
        })
        .fallback(|req: Request| async move {
            ApiError::route_not_found(req.method().as_str(), req.uri().path())
        })
        .with_state(state)
}

fn check_key(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    if state.api_keys.is_empty() {
        return Ok(());
    }
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        None => Err(ApiError::missing_api_key()),
        Some(k) if state.api_keys.iter().any(|a| a == k) => Ok(()),
        Some(_) => Err(ApiError::invalid_api_key()),
    }
}

async fn models(State(state): State<Shared>, headers: HeaderMap) -> Response {
    let r = check_key(&state, &headers).map(|_| {
        let auto = (!state.auto.is_empty()).then(|| "auto".to_string());
        let ids = state
            .backends
            .iter()
            .flat_map(|b| std::iter::once(b.name.clone()).chain(b.aliases.iter().cloned()))
            .chain(auto);
        axum::Json(ModelList::new(ids, state.started)).into_response()
    });
    finish(&state, "/v1/models", r)
}

async fn ready(State(state): State<Shared>) -> Response {
    let mut not_ready = Vec::new();
    for b in &state.backends {
        let Target::Cluster { client: c, .. } = &b.target else {
            continue;
        };
        let mut c = c.clone();
        match tokio::time::timeout(Duration::from_secs(2), c.info(InfoRequest {})).await {
            Ok(Ok(info)) if info.get_ref().ready => {}
            Ok(Ok(info)) => not_ready.push(format!("{}: {}", b.name, info.get_ref().state)),
            Ok(Err(s)) => not_ready.push(format!("{}: {}", b.name, s.message())),
            Err(_) => not_ready.push(format!("{}: no answer within 2 s", b.name)),
        }
    }
    if not_ready.is_empty() {
        axum::Json(serde_json::json!({"status": "ready"})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({"status": "not ready", "backends": not_ready})),
        )
            .into_response()
    }
}

async fn metrics(State(state): State<Shared>) -> Response {
    let busy = state.max_in_flight - state.limit.available_permits();
    state.metrics.in_flight.set(busy as i64);
    let mut s = String::new();
    prometheus_client::encoding::text::encode(&mut s, &state.metrics.registry)
        .expect("writing to a String");
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s,
    )
        .into_response()
}

fn finish(state: &AppState, path: &str, r: Result<Response, ApiError>) -> Response {
    let resp = r.unwrap_or_else(IntoResponse::into_response);
    state.metrics.count(path, resp.status());
    resp
}

/// The trace span of one API request: a child of the client's `traceparent`
/// when it sent one, and the parent of the coordinator's spans.
fn request_span(path: &str, headers: &HeaderMap) -> tracing::Span {
    let span = tracing::info_span!(
        "request",
        otel.name = %format!("POST {path}"),
        otel.kind = "server",
        http.route = path,
        model = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    let parent = headers
        .get(omni_telemetry::TRACEPARENT)
        .and_then(|v| v.to_str().ok());
    omni_telemetry::set_parent(&span, parent);
    span
}

fn record_status(span: &tracing::Span, status: StatusCode) {
    span.record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        span.record("otel.status_code", "error");
    }
}

/// Names the model and its coordinator in an UNAVAILABLE status (a
/// coordinator that is down, or not ready yet), which alone says little
/// ("tcp connect error").
fn unreachable(s: tonic::Status, model: &str, addr: &str) -> tonic::Status {
    if s.code() != tonic::Code::Unavailable {
        return s;
    }
    tonic::Status::unavailable(format!(
        "model '{model}': the coordinator at {addr} cannot serve: {}",
        s.message()
    ))
}

/// A Generate call carrying the request's trace context.
pub(crate) fn traced<T>(msg: T, traceparent: Option<&str>) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if let Some(v) = traceparent.and_then(|t| t.parse().ok()) {
        req.metadata_mut().insert(omni_telemetry::TRACEPARENT, v);
    }
    req
}

/// Auth, the in-flight bound, content type and body size: everything before
/// the body is parsed.
async fn admit(state: &AppState, req: Request) -> Result<(Bytes, OwnedSemaphorePermit), ApiError> {
    check_key(state, req.headers())?;
    let permit = state
        .limit
        .clone()
        .try_acquire_owned()
        .map_err(|_| ApiError::rate_limited(state.max_in_flight, 1))?;
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let is_json = ct
        .as_deref()
        .is_some_and(|c| c.split(';').next().unwrap_or("").trim() == "application/json");
    if !is_json {
        return Err(ApiError::unsupported_media_type(ct.as_deref()));
    }
    let body = axum::body::to_bytes(req.into_body(), state.body_limit)
        .await
        .map_err(|_| ApiError::body_too_large(state.body_limit))?;
    Ok((body, permit))
}

/// Runs the `n` choices of a request to their ends, concurrently.
async fn generate_all(
    client: &InferenceClient<Channel>,
    base: &GenerateRequest,
    n: u32,
    traceparent: Option<&str>,
    resume_timeout: Duration,
) -> Result<Vec<Generated>, tonic::Status> {
    let calls: Vec<_> = (0..n)
        .map(|i| {
            let client = client.clone();
            let req = choice_request(base, i);
            let tp = traceparent.map(str::to_string);
            tokio::spawn(async move {
                let mut stream = crate::resume::generate(&client, req, tp, resume_timeout).await?;
                let mut g = Generated::default();
                while let Some(ev) = stream.next().await {
                    g.push(&ev?);
                }
                Ok::<_, tonic::Status>(g)
            })
        })
        .collect();
    let mut outputs = Vec::with_capacity(calls.len());
    for c in calls {
        outputs.push(
            c.await
                .map_err(|e| tonic::Status::internal(e.to_string()))??,
        );
    }
    Ok(outputs)
}

/// Texts of the given tokens and of their alternatives (the coordinator
/// sends them; the router has no tokenizer).
fn token_texts<'a>(tokens: impl IntoIterator<Item = &'a Token>) -> HashMap<u32, String> {
    let mut m = HashMap::new();
    for t in tokens {
        m.insert(t.id, t.piece.clone());
        for a in &t.top {
            m.insert(a.token, a.piece.clone());
        }
    }
    m
}

fn text_of(texts: &HashMap<u32, String>) -> impl Fn(u32) -> String + '_ {
    |t| texts.get(&t).cloned().unwrap_or_default()
}

/// All choices' events merged into one stream: (choice index, event).
async fn open_streams(
    client: &InferenceClient<Channel>,
    base: &GenerateRequest,
    n: u32,
    traceparent: Option<&str>,
    resume_timeout: Duration,
) -> Result<impl Stream<Item = (u32, Result<GenerateEvent, tonic::Status>)>, tonic::Status> {
    let mut merged = tokio_stream::StreamMap::new();
    for i in 0..n {
        let s = crate::resume::generate(
            client,
            choice_request(base, i),
            traceparent.map(str::to_string),
            resume_timeout,
        )
        .await?;
        merged.insert(i, s);
    }
    Ok(merged)
}

/// What differs between the chat and the completions endpoints; the
/// request flow in [`serve_request`] is the same for both.
trait Api: serde::de::DeserializeOwned + Send + 'static {
    const PATH: &'static str;
    type Stream: Send + 'static;
    fn model(&self) -> &str;
    fn model_mut(&mut self) -> &mut String;
    /// The text `auto` rules look at.
    fn prompt_text(&self) -> String;
    fn generate_request(&self) -> Result<GenerateRequest, ApiError>;
    fn choices(&self) -> u32;
    fn streamed(&self) -> bool;
    /// Names the right request field in errors from the coordinator.
    fn error(s: &tonic::Status) -> ApiError;
    fn body(&self, outputs: &[Generated], texts: &HashMap<u32, String>) -> serde_json::Value;
    fn open_stream(&self) -> Self::Stream;
    /// Chunks sent before any token (the chat role deltas).
    fn opening(st: &Self::Stream, n: u32) -> Vec<String>;
    fn chunks(st: &mut Self::Stream, i: u32, ev: &GenerateEvent) -> Vec<String>;
    /// The chunk after every choice finished, when the client asked for
    /// usage: it carries llama-server's `timings` too.
    fn usage(st: &Self::Stream, u: Usage, t: Timings) -> Option<String>;
}

impl Api for ChatCompletionRequest {
    const PATH: &'static str = "/chat/completions";
    type Stream = ChatStream;
    fn model(&self) -> &str {
        &self.model
    }
    fn model_mut(&mut self) -> &mut String {
        &mut self.model
    }
    fn prompt_text(&self) -> String {
        self.prompt_text()
    }
    fn generate_request(&self) -> Result<GenerateRequest, ApiError> {
        self.to_generate()
    }
    fn choices(&self) -> u32 {
        self.n()
    }
    fn streamed(&self) -> bool {
        self.stream()
    }
    fn error(s: &tonic::Status) -> ApiError {
        from_status(s).in_chat()
    }
    fn body(&self, outputs: &[Generated], texts: &HashMap<u32, String>) -> serde_json::Value {
        let (id, now) = (openai::new_id("chatcmpl-"), openai::unix_now());
        let b = ChatCompletion::build(
            id,
            now,
            &self.model,
            outputs,
            self.logprobs(),
            text_of(texts),
        );
        serde_json::to_value(b).expect("serializable")
    }
    fn open_stream(&self) -> ChatStream {
        ChatStream::new(&self.model, self.include_usage(), self.logprobs())
    }
    fn opening(st: &ChatStream, n: u32) -> Vec<String> {
        (0..n).map(|i| sse_data(&st.role(i))).collect()
    }
    fn chunks(st: &mut ChatStream, i: u32, ev: &GenerateEvent) -> Vec<String> {
        let texts = token_texts(&ev.tokens);
        st.event(i, ev, text_of(&texts))
            .iter()
            .map(sse_data)
            .collect()
    }
    fn usage(st: &ChatStream, u: Usage, t: Timings) -> Option<String> {
        st.include_usage.then(|| sse_data(&st.usage(u, t)))
    }
}

impl Api for CompletionRequest {
    const PATH: &'static str = "/completions";
    type Stream = CompletionStream;
    fn model(&self) -> &str {
        &self.model
    }
    fn model_mut(&mut self) -> &mut String {
        &mut self.model
    }
    fn prompt_text(&self) -> String {
        self.prompt_text()
    }
    fn generate_request(&self) -> Result<GenerateRequest, ApiError> {
        self.to_generate()
    }
    fn choices(&self) -> u32 {
        self.n()
    }
    fn streamed(&self) -> bool {
        self.stream()
    }
    fn error(s: &tonic::Status) -> ApiError {
        from_status(s).in_completions()
    }
    fn body(&self, outputs: &[Generated], texts: &HashMap<u32, String>) -> serde_json::Value {
        let (id, now) = (openai::new_id("cmpl-"), openai::unix_now());
        let b = Completion::build(
            id,
            now,
            &self.model,
            outputs,
            self.logprobs(),
            text_of(texts),
        );
        serde_json::to_value(b).expect("serializable")
    }
    fn open_stream(&self) -> CompletionStream {
        CompletionStream::new(&self.model, self.include_usage(), self.logprobs())
    }
    fn opening(_: &CompletionStream, _: u32) -> Vec<String> {
        Vec::new()
    }
    fn chunks(st: &mut CompletionStream, i: u32, ev: &GenerateEvent) -> Vec<String> {
        let texts = token_texts(&ev.tokens);
        st.event(i, ev, text_of(&texts))
            .iter()
            .map(sse_data)
            .collect()
    }
    fn usage(st: &CompletionStream, u: Usage, t: Timings) -> Option<String> {
        st.include_usage.then(|| sse_data(&st.usage(u, t)))
    }
}

async fn chat(State(state): State<Shared>, req: Request) -> Response {
    serve::<ChatCompletionRequest>(&state, "/v1/chat/completions", req).await
}

async fn completions(State(state): State<Shared>, req: Request) -> Response {
    serve::<CompletionRequest>(&state, "/v1/completions", req).await
}

/// An API request inside its trace span (a streamed answer holds the span
/// until its last event).
async fn serve<R: Api>(state: &Shared, path: &str, req: Request) -> Response {
    let span = request_span(path, req.headers());
    let r = serve_request::<R>(state, req, &span)
        .instrument(span.clone())
        .await;
    let resp = finish(state, path, r);
    record_status(&span, resp.status());
    resp
}

/// One chat or completions request: admit, parse, route (an upstream gets
/// the body as is), then run its `n` choices on the cluster, streamed or not.
async fn serve_request<R: Api>(
    state: &Shared,
    req: Request,
    span: &tracing::Span,
) -> Result<Response, ApiError> {
    let (body, permit) = admit(state, req).await?;
    let mut r: R = parse_json(&body)?;
    span.record("model", r.model());
    let backend = state.backend(r.model(), &r.prompt_text())?.clone();
    if r.model() == "auto" {
        // Answers name the model that served them, as OpenAI's do.
        *r.model_mut() = backend.name.clone();
    }
    let traceparent = omni_telemetry::traceparent(span);
    let (client, addr) = match &backend.target {
        Target::Cluster { client, addr } => (client.clone(), addr.clone()),
        Target::Upstream { base, model, key } => {
            let url = format!("{base}{}", R::PATH);
            let up = Upstream {
                url: &url,
                model,
                key,
                traceparent: traceparent.as_deref(),
            };
            return proxy(state, &body, up, permit).await;
        }
    };
    let gen = r.generate_request()?;
    let n = r.choices();
    let tp = traceparent.as_deref();
    if r.streamed() {
        let merged = open_streams(&client, &gen, n, tp, state.resume_timeout)
            .await
            .map_err(|s| R::error(&unreachable(s, &backend.name, &addr)))?;
        let held = (permit, span.clone());
        let events = stream_events::<R>(r.open_stream(), merged, n, state.clone(), held);
        return Ok(sse(events));
    }
    let outputs = generate_all(&client, &gen, n, tp, state.resume_timeout)
        .await
        .map_err(|s| R::error(&unreachable(s, &backend.name, &addr)))?;
    drop(permit);
    state.metrics.done(&outputs);
    let texts = token_texts(outputs.iter().flat_map(|g| &g.tokens));
    Ok(axum::Json(r.body(&outputs, &texts)).into_response())
}

fn sse(stream: impl Stream<Item = String> + Send + 'static) -> Response {
    let body = Body::from_stream(stream.map(Ok::<_, std::convert::Infallible>));
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .expect("a valid response")
}

/// The SSE body. The permit (and the request's trace span) are held until
/// the stream ends or the client goes away (dropping this stream drops the
/// gRPC streams, which cancels the sequences in the cluster).
fn stream_events<R: Api>(
    mut st: R::Stream,
    mut merged: impl Stream<Item = (u32, Result<GenerateEvent, tonic::Status>)> + Unpin + Send + 'static,
    n: u32,
    state: Shared,
    held: (OwnedSemaphorePermit, tracing::Span),
) -> impl Stream<Item = String> + Send + 'static {
    async_stream::stream! {
        let _held = held;
        for c in R::opening(&st, n) {
            yield c;
        }
        let mut outputs = vec![Generated::default(); n as usize];
        let mut ended = 0;
        while let Some((i, ev)) = merged.next().await {
            match ev {
                Ok(ev) => {
                    outputs[i as usize].push(&ev);
                    for c in R::chunks(&mut st, i, &ev) {
                        yield c;
                    }
                    if ev.done.is_some() {
                        ended += 1;
                    }
                }
                Err(s) => {
                    yield R::error(&s).sse();
                    return;
                }
            }
        }
        if ended < n {
            yield ApiError::unavailable("the cluster ended the stream early").sse();
            return;
        }
        state.metrics.done(&outputs);
        if let Some(u) = R::usage(&st, Usage::of(&outputs), Timings::of(&outputs)) {
            yield u;
        }
        yield SSE_DONE.to_string();
    }
}

/// Where [`proxy`] sends a request.
struct Upstream<'a> {
    url: &'a str,
    model: &'a str,
    key: &'a Option<String>,
    traceparent: Option<&'a str>,
}

/// Passes the request to an upstream OpenAI-compatible server (with its
/// model name) and its answer, streamed or not, back unchanged.
async fn proxy(
    state: &Shared,
    body: &[u8],
    up: Upstream<'_>,
    permit: OwnedSemaphorePermit,
) -> Result<Response, ApiError> {
    let url = up.url;
    let mut v: serde_json::Value = parse_json(body)?;
    v["model"] = serde_json::Value::String(up.model.to_string());
    let mut req = state.http.post(url).json(&v);
    if let Some(k) = up.key {
        req = req.bearer_auth(k);
    }
    if let Some(t) = up.traceparent {
        req = req.header(omni_telemetry::TRACEPARENT, t);
    }
    let resp = req
        .send()
        .await
        .map_err(|e| ApiError::unavailable(format!("upstream {url} is not reachable: {e}")))?;
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let ct = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .to_string();
    let stream = resp.bytes_stream().map(move |chunk| {
        let _held = &permit;
        chunk.map_err(std::io::Error::other)
    });
    Ok(Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, ct)
        .body(Body::from_stream(stream))
        .expect("a valid response"))
}
