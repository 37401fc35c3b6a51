//! The OpenAI API as the router speaks it: the request types and their validation, the
//! mapping to the coordinator's `GenerateRequest`, the response and stream-chunk types, and
//! [`ApiError`], the one place where a failure becomes an HTTP status plus OpenAI's error
//! body. Pure types and functions, no I/O: the HTTP server drives them.
//!
//! Accepted ranges (OpenAI's documented ones unless noted; a value outside gets a 400 that
//! names the field, the value and the range):
//! - `temperature` 0..=2 (absent: 1, as OpenAI), `top_p` 0..=1 (absent: 1; 0 is allowed by
//!   OpenAI's spec and means "only the most likely token"), `presence_penalty` and
//!   `frequency_penalty` -2..=2, `logit_bias` values -100..=100 with token-id keys,
//!   `top_logprobs` 0..=20 (needs `logprobs: true`), completions `logprobs` 0..=5, `stop` at
//!   most [`MAX_STOP`] strings (OpenAI allows 4; local servers any number, and harnesses
//!   such as HumanEval's send 5), `max_tokens` / `max_completion_tokens` at least 1.
//! - `n` 1..=[`MAX_N`]: our limit, lower than OpenAI's 128, because every choice is a
//!   sequence of its own in the cluster, which has few sequence slots.
//! - Extensions from llama.cpp and vLLM: `top_k` (0 or negative: off), `min_p` 0..=1,
//!   `repeat_penalty` > 0, `ignore_eos`.
//! - Structured output on both endpoints: `response_format` `text`, `json_object` and
//!   `json_schema` (strict or not), and llama.cpp's `json_schema` and `grammar` (in
//!   llguidance's Lark syntax, not GBNF: a GBNF grammar is refused saying so). At most one
//!   of the three; the coordinator compiles the schema or grammar and names what is wrong.
//!
//! - Tools: `tools`, `tool_choice`, `parallel_tool_calls`, assistant `tool_calls` and `tool`
//!   messages go to the coordinator, which renders them with the model's template and
//!   reads the calls out of the answer (`GenerateEvent.tool_calls`); here they become
//!   `message.tool_calls` or `delta.tool_calls` chunks and `finish_reason: "tool_calls"`.
//!
//! Refused with a 400 rather than silently ignored: OpenAI's deprecated `functions` and
//! `function_call` (send `tools`), image/audio/file content parts, and for completions
//! `echo`, `suffix` and `best_of`.
//! Unknown fields are ignored, as OpenAI-compatible servers do.

use std::collections::hash_map::RandomState;
use std::collections::BTreeMap;
use std::fmt::Display;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use omni_proto::coordinator::v1::generate_request::Prompt;
use omni_proto::coordinator::v1::{
    Chat, ChatMessage, Done, FinishReason, GenerateEvent, GenerateRequest, Token, TokenIds,
    ToolCall, ToolCallOut, ToolChoice,
};
use omni_proto::worker::v1::grammar::{JsonObject, Kind as GrammarKind};
use omni_proto::worker::v1::{Grammar, LogitBias, Sampling};
use serde::de::DeserializeOwned;
use serde::ser::SerializeMap;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::{Number, Value};

/// The most choices one request may ask for.
pub const MAX_N: u32 = 16;
/// The most stop strings one request may give: more than OpenAI's 4, as
/// llama-server and vLLM take (HumanEval harnesses send 5), bounded so a
/// request cannot make every decoded piece scan thousands of strings.
pub const MAX_STOP: usize = 16;
/// The most alternatives per token for chat `top_logprobs`.
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// The most alternatives per token for completions `logprobs`.
pub const MAX_COMPLETION_LOGPROBS: u32 = 5;
/// OpenAI's default `max_tokens` for `/v1/completions`.
pub const COMPLETION_DEFAULT_MAX_TOKENS: u32 = 16;
/// The last event of every stream.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

const INVALID_REQUEST: &str = "invalid_request_error";
const SERVER_ERROR: &str = "server_error";
const UNSUPPORTED: &str = "unsupported_parameter";
/// What OpenAI reports for a logprob of minus infinity (JSON has no infinity).
const LOGPROB_FLOOR: f32 = -9999.0;

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

/// A failure as the client sees it: an HTTP status and OpenAI's error body
/// `{"error":{"message","type","param","code"}}`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{status} {kind}: {message}")]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// The body's `type`: "invalid_request_error" for client mistakes.
    pub kind: &'static str,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for the `Retry-After` header (429 and 503).
    pub retry_after: Option<u64>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorObject<'a>,
}

#[derive(Serialize)]
struct ErrorObject<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

/// The `Retry-After` of a 503: a recovery takes about a second when the
/// supervisor restarts a worker at once.
pub const UNAVAILABLE_RETRY_S: u64 = 2;

impl ApiError {
    fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// 400 without a particular field (malformed JSON, say).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, INVALID_REQUEST, message)
    }

    /// 400 about the field `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::bad_request(message).with_param(param)
    }

    /// 400: "`param` is `value` but must be `allowed`".
    pub fn out_of_range(param: &str, value: impl Display, allowed: impl Display) -> Self {
        Self::invalid(param, format!("{param} is {value} but must be {allowed}"))
    }

    /// 400 for a feature the router does not offer yet.
    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::invalid(param, message).with_code(UNSUPPORTED)
    }

    /// 401 when the request has no bearer token. OpenAI sends these as
    /// "invalid_request_error" with code "invalid_api_key"; so do we.
    pub fn missing_api_key() -> Self {
        Self::new(
            401,
            INVALID_REQUEST,
            "no API key was given; send it as the header `Authorization: Bearer <key>`",
        )
        .with_code("invalid_api_key")
    }

    /// 401 when the bearer token is not one of the configured keys.
    pub fn invalid_api_key() -> Self {
        Self::new(
            401,
            INVALID_REQUEST,
            "the API key is not valid; use one of the keys configured for this router",
        )
        .with_code("invalid_api_key")
    }

    /// 404 for a model name (or alias) that no backend serves.
    pub fn model_not_found(model: &str, available: &[String]) -> Self {
        let list = if available.is_empty() {
            "none are configured".to_string()
        } else {
            format!("available: {}", available.join(", "))
        };
        Self::new(
            404,
            INVALID_REQUEST,
            format!("the model `{model}` does not exist ({list})"),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    /// 404 for a path the router does not serve.
    pub fn route_not_found(method: &str, path: &str) -> Self {
        Self::new(
            404,
            INVALID_REQUEST,
            format!("no route for {method} {path}; this router serves /v1/models, /v1/chat/completions and /v1/completions"),
        )
    }

    /// 405 for a served path asked with the wrong method (the `Allow` header lists the right
    /// ones).
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            405,
            INVALID_REQUEST,
            format!("{path} does not serve {method}; the `Allow` header lists the methods it does"),
        )
    }

    /// 413 for a body over the configured limit.
    pub fn body_too_large(limit_bytes: usize) -> Self {
        Self::new(
            413,
            INVALID_REQUEST,
            format!("the request body is larger than the limit of {limit_bytes} bytes"),
        )
    }

    /// 415 for a body that is not declared as JSON.
    pub fn unsupported_media_type(content_type: Option<&str>) -> Self {
        let got = content_type.map_or("no Content-Type".to_string(), |c| format!("`{c}`"));
        Self::new(
            415,
            INVALID_REQUEST,
            format!("the request has {got}; send the body as `Content-Type: application/json`"),
        )
    }

    /// 429 when `limit` requests are already in flight. The type is "requests" as in
    /// OpenAI's request-rate errors.
    pub fn rate_limited(limit: usize, retry_after_s: u64) -> Self {
        let mut e = Self::new(
            429,
            "requests",
            format!("{limit} requests are already in flight, the most this router accepts; retry in {retry_after_s} s"),
        )
        .with_code("rate_limit_exceeded");
        e.retry_after = Some(retry_after_s);
        e
    }

    /// 503: a backend cannot take requests now (not ready, recovering from a
    /// lost worker with its queue full, unreachable); clients may retry
    /// after [`UNAVAILABLE_RETRY_S`].
    pub fn unavailable(message: impl Into<String>) -> Self {
        let mut e = Self::new(503, SERVER_ERROR, message);
        e.retry_after = Some(UNAVAILABLE_RETRY_S);
        e
    }

    /// 504: the backend did not answer in time.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(504, SERVER_ERROR, message).with_code("timeout")
    }

    /// 500: a fault on our side.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, SERVER_ERROR, message)
    }

    /// For an error from a chat request: the coordinator's "prompt" is the client's
    /// `messages`.
    pub fn in_chat(mut self) -> Self {
        if self.param.as_deref() == Some("prompt") {
            self.param = Some("messages".into());
        }
        self
    }

    /// For an error from a completions request: the coordinator's `top_logprobs` is the
    /// client's `logprobs`.
    pub fn in_completions(mut self) -> Self {
        if self.param.as_deref() == Some("top_logprobs") {
            self.param = Some("logprobs".into());
        }
        self
    }

    /// OpenAI's error body.
    pub fn body(&self) -> Value {
        serde_json::to_value(self.error_body()).unwrap_or(Value::Null)
    }

    fn error_body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorObject {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        }
    }

    /// The SSE event that reports this error in the middle of a stream.
    pub fn sse(&self) -> String {
        sse_data(&self.error_body())
    }
}

/// Maps a coordinator error to what the client sees. The message is kept for client
/// mistakes ("the prompt has 5000 tokens but the context is 4096 tokens"). Prompt errors get
/// param "prompt"; [`ApiError::in_chat`] renames it to "messages".
pub fn from_status(s: &tonic::Status) -> ApiError {
    use tonic::Code;
    let msg = s.message();
    match s.code() {
        Code::InvalidArgument => {
            let e = ApiError::bad_request(msg);
            match status_param(msg) {
                Some(p) => e.with_param(p),
                None => e,
            }
        }
        Code::FailedPrecondition => ApiError::bad_request(msg),
        Code::Unavailable => ApiError::unavailable(msg),
        Code::DeadlineExceeded => ApiError::timeout(msg),
        code => ApiError::internal(format!("the cluster failed ({code:?}): {msg}")),
    }
}

/// The request field an INVALID_ARGUMENT message is about, from the coordinator's wording.
fn status_param(msg: &str) -> Option<String> {
    // omni_engine's SamplingError: "invalid sampling parameter {field} = {value}: ...".
    if let Some(rest) = msg.strip_prefix("invalid sampling parameter ") {
        return rest.split_whitespace().next().map(str::to_string);
    }
    if msg.starts_with("top_logprobs") {
        return Some("top_logprobs".into());
    }
    // The coordinator's tool checks name the field first.
    for field in ["tools", "tool_choice", "messages"] {
        if msg.starts_with(field) {
            let end = msg.find(|c: char| c.is_whitespace()).unwrap_or(msg.len());
            return Some(msg[..end].to_string());
        }
    }
    // omni_engine's ConstraintError::Invalid: "invalid {what}: {why}".
    if msg.starts_with("invalid Lark grammar") {
        return Some("grammar".into());
    }
    if msg.starts_with("invalid JSON schema") || msg.starts_with("invalid json_object") {
        return Some("response_format".into());
    }
    let about_prompt = ["prompt", "token id", "chat", "template", "tokeniz"];
    about_prompt
        .iter()
        .any(|w| msg.contains(w))
        .then(|| "prompt".to_string())
}

impl axum::response::IntoResponse for ApiError {
    fn into_response(self) -> axum::response::Response {
        use axum::http::{header, HeaderValue, StatusCode};
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, axum::Json(self.error_body())).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

/// Parses a request body, naming the field at fault when the JSON has the wrong shape
/// ("temperature: invalid type: string \"hot\", expected f64").
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(
            "the request body is empty; send a JSON object",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let inner = e.inner();
        if !inner.is_data() {
            return ApiError::bad_request(format!("the request body is not valid JSON: {inner}"));
        }
        let path = e.path().to_string();
        let text = inner.to_string();
        // A missing field is reported at its parent; name the field itself.
        let missing = text
            .strip_prefix("missing field `")
            .and_then(|r| r.split('`').next());
        let param = match (missing, path.as_str()) {
            (Some(f), ".") => f.to_string(),
            (Some(f), p) => format!("{p}.{f}"),
            (None, p) => p.to_string(),
        };
        if param == "." {
            ApiError::bad_request(format!("the request body has the wrong shape: {text}"))
        } else {
            ApiError::invalid(param.clone(), format!("{param}: {text}"))
        }
    })?;
    de.end()
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    Ok(value)
}

// ---------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------

/// The value of a JSON number that is an integer in JSON Schema's sense (OpenAI's spec types
/// `n`, `max_tokens`, `seed`, token ids... as `integer`): no fractional part, so `5.0` is 5.
fn integral(n: &Number) -> Option<i64> {
    const LIMIT: f64 = 9_223_372_036_854_775_808.0; // 2^63
    n.as_i64().or_else(|| {
        n.as_f64()
            .filter(|f| f.fract() == 0.0 && (-LIMIT..LIMIT).contains(f))
            .map(|f| f as i64)
    })
}

/// `deserialize_with` for an optional integer field: see [`integral`].
fn integer<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    match Option::<Number>::deserialize(d)? {
        None => Ok(None),
        Some(n) => integral(&n).map(Some).ok_or_else(|| {
            serde::de::Error::custom(format_args!(
                "invalid value: {n}, expected an integer from {} to {}",
                i64::MIN,
                i64::MAX
            ))
        }),
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// One message of a chat request. `content` is a string, an array of content parts, or
/// null (an assistant message); it stays JSON so validation can say which part is wrong.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageParam {
    pub role: String,
    pub content: Option<Value>,
    pub name: Option<String>,
    pub tool_calls: Option<Value>,
    pub function_call: Option<Value>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<ChatMessageParam>,
    #[serde(default, deserialize_with = "integer")]
    pub max_tokens: Option<i64>,
    #[serde(default, deserialize_with = "integer")]
    pub max_completion_tokens: Option<i64>,
    /// A string or an array of up to [`MAX_STOP`] strings.
    pub stop: Option<Value>,
    #[serde(default, deserialize_with = "integer")]
    pub n: Option<i64>,
    pub seed: Option<Number>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    /// Token id (as a string) to a bias in -100..=100.
    pub logit_bias: Option<BTreeMap<String, f64>>,
    pub logprobs: Option<bool>,
    #[serde(default, deserialize_with = "integer")]
    pub top_logprobs: Option<i64>,
    pub user: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    #[serde(default, deserialize_with = "integer")]
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repeat_penalty: Option<f64>,
    pub ignore_eos: Option<bool>,
    /// `[{"type": "function", "function": {"name", "description", "parameters"}}]`.
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    // OpenAI's deprecated forms of tools and tool_choice: refused, naming them.
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    /// `{"type": "text" | "json_object" | "json_schema", ...}`.
    pub response_format: Option<Value>,
    /// llama.cpp's extensions: a JSON schema, or a grammar (Lark syntax).
    pub json_schema: Option<Value>,
    pub grammar: Option<Value>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    /// A string, an array of one string, an array of token ids, or an array of one array of
    /// token ids.
    pub prompt: Option<Value>,
    /// Absent or null: [`COMPLETION_DEFAULT_MAX_TOKENS`], as OpenAI.
    #[serde(default, deserialize_with = "integer")]
    pub max_tokens: Option<i64>,
    pub stop: Option<Value>,
    #[serde(default, deserialize_with = "integer")]
    pub n: Option<i64>,
    pub seed: Option<Number>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// How many alternatives to report per token, 0..=5.
    #[serde(default, deserialize_with = "integer")]
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    #[serde(default, deserialize_with = "integer")]
    pub best_of: Option<i64>,
    pub user: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    #[serde(default, deserialize_with = "integer")]
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repeat_penalty: Option<f64>,
    pub ignore_eos: Option<bool>,
    /// As for chat (llama.cpp's server takes it on completions too).
    pub response_format: Option<Value>,
    /// llama.cpp's extensions: a JSON schema, or a grammar (Lark syntax).
    pub json_schema: Option<Value>,
    pub grammar: Option<Value>,
}

/// The fields both endpoints share, validated and converted in one place.
struct Common<'a> {
    n: Option<i64>,
    seed: Option<&'a Number>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    logit_bias: Option<&'a BTreeMap<String, f64>>,
    stop: Option<&'a Value>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    repeat_penalty: Option<f64>,
    response_format: Option<&'a Value>,
    json_schema: Option<&'a Value>,
    grammar: Option<&'a Value>,
}

fn check_between(param: &str, v: Option<f64>, lo: f64, hi: f64) -> Result<(), ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::out_of_range(
            param,
            x,
            format!("between {lo} and {hi}"),
        )),
        _ => Ok(()),
    }
}

fn check_n(n: Option<i64>) -> Result<u32, ApiError> {
    match n {
        None => Ok(1),
        Some(n) if (1..=MAX_N as i64).contains(&n) => Ok(n as u32),
        Some(n) => Err(ApiError::out_of_range(
            "n",
            n,
            format!("between 1 and {MAX_N}"),
        )),
    }
}

/// `None` when absent; the limit clamped to u32 (the coordinator clamps to the context).
fn check_max_tokens(param: &str, v: Option<i64>) -> Result<Option<u32>, ApiError> {
    match v {
        None => Ok(None),
        Some(m) if m < 1 => Err(ApiError::out_of_range(param, m, "at least 1")),
        Some(m) => Ok(Some(m.min(u32::MAX as i64) as u32)),
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl Common<'_> {
    fn validate(&self) -> Result<(), ApiError> {
        check_n(self.n)?;
        check_between("temperature", self.temperature, 0.0, 2.0)?;
        check_between("top_p", self.top_p, 0.0, 1.0)?;
        check_between("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        check_between("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        check_between("min_p", self.min_p, 0.0, 1.0)?;
        if let Some(r) = self.repeat_penalty {
            if r <= 0.0 {
                return Err(ApiError::out_of_range(
                    "repeat_penalty",
                    r,
                    "greater than 0 (1 is off)",
                ));
            }
        }
        self.seed()?;
        self.logit_bias()?;
        self.stop()?;
        self.grammar()?;
        Ok(())
    }

    /// What the output is constrained to: `response_format`, or llama.cpp's
    /// `json_schema` / `grammar` (one of them). The schema or grammar itself
    /// is compiled by the coordinator, which names what is wrong with it.
    fn grammar(&self) -> Result<Option<Grammar>, ApiError> {
        let given: Vec<&str> = [
            ("response_format", self.response_format),
            ("json_schema", self.json_schema),
            ("grammar", self.grammar),
        ]
        .into_iter()
        .filter(|(_, v)| v.is_some_and(|v| !v.is_null()))
        .map(|(name, _)| name)
        .collect();
        if given.len() > 1 {
            return Err(ApiError::invalid(
                given[1],
                format!(
                    "{} and {} both constrain the output; give one of them",
                    given[0], given[1]
                ),
            ));
        }
        let kind = match (self.response_format, self.json_schema, self.grammar) {
            (Some(rf), _, _) if !rf.is_null() => response_format(rf)?,
            (_, Some(schema), _) if !schema.is_null() => Some(json_schema(schema, "json_schema")?),
            (_, _, Some(g)) if !g.is_null() => Some(lark(g)?),
            _ => None,
        };
        Ok(kind.map(|k| Grammar { kind: Some(k) }))
    }

    fn seed(&self) -> Result<Option<u64>, ApiError> {
        let Some(n) = self.seed else { return Ok(None) };
        // OpenAI's seed is an int64; negative seeds keep their bits.
        n.as_u64()
            .or_else(|| integral(n).map(|i| i as u64))
            .map(Some)
            .ok_or_else(|| ApiError::out_of_range("seed", n, "an integer"))
    }

    fn logit_bias(&self) -> Result<Vec<LogitBias>, ApiError> {
        let Some(map) = self.logit_bias else {
            return Ok(Vec::new());
        };
        let mut out = Vec::with_capacity(map.len());
        for (key, &bias) in map {
            let token: u32 = key.trim().parse().map_err(|_| {
                ApiError::invalid(
                    "logit_bias",
                    format!(
                        "logit_bias has the key \"{key}\" but its keys must be token ids (0 to {})",
                        u32::MAX
                    ),
                )
            })?;
            if !(-100.0..=100.0).contains(&bias) {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!(
                        "logit_bias for token {token} is {bias} but must be between -100 and 100"
                    ),
                ));
            }
            out.push(LogitBias {
                token,
                bias: bias as f32,
            });
        }
        out.sort_by_key(|b| b.token);
        Ok(out)
    }

    /// Empty stop strings are dropped: they would end every generation at once.
    fn stop(&self) -> Result<Vec<String>, ApiError> {
        let list = match self.stop {
            None | Some(Value::Null) => return Ok(Vec::new()),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => {
                if items.len() > MAX_STOP {
                    return Err(ApiError::invalid(
                        "stop",
                        format!(
                            "stop has {} strings but at most {MAX_STOP} are allowed",
                            items.len()
                        ),
                    ));
                }
                items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| match v {
                        Value::String(s) => Ok(s.clone()),
                        other => Err(ApiError::invalid(
                            "stop",
                            format!("stop[{i}] is {} but must be a string", kind_of(other)),
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            Some(other) => {
                return Err(ApiError::invalid(
                    "stop",
                    format!(
                        "stop is {} but must be a string or an array of up to {MAX_STOP} strings",
                        kind_of(other)
                    ),
                ))
            }
        };
        Ok(list.into_iter().filter(|s| !s.is_empty()).collect())
    }

    /// The coordinator reads `top_p == 0` and `repeat_penalty == 0` as "unset", so those
    /// are always sent as positive numbers.
    fn sampling(&self) -> Result<Sampling, ApiError> {
        let top_p = match self.top_p {
            None => 1.0,
            // OpenAI allows 0: keep only the most likely token.
            Some(p) => (p as f32).max(f32::MIN_POSITIVE),
        };
        Ok(Sampling {
            temperature: self.temperature.unwrap_or(1.0) as f32,
            top_k: self.top_k.unwrap_or(0).clamp(0, u32::MAX as i64) as u32,
            top_p,
            min_p: self.min_p.unwrap_or(0.0) as f32,
            repeat_penalty: (self.repeat_penalty.unwrap_or(1.0) as f32).max(f32::MIN_POSITIVE),
            repeat_last_n: 0,
            presence_penalty: self.presence_penalty.unwrap_or(0.0) as f32,
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0) as f32,
            logit_bias: self.logit_bias()?,
            seed: self.seed()?,
            grammar: self.grammar()?,
        })
    }
}

/// OpenAI's `response_format`: `text`, `json_object` (llama.cpp also takes a
/// `schema` beside it) or `json_schema` with its `json_schema.schema` (strict
/// or not: the output always fits the schema).
fn response_format(rf: &Value) -> Result<Option<GrammarKind>, ApiError> {
    let param = "response_format";
    let Some(obj) = rf.as_object() else {
        return Err(ApiError::invalid(
            param,
            format!(
                "response_format is {} but must be an object such as {{\"type\": \"json_object\"}}",
                kind_of(rf)
            ),
        ));
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => match obj.get("schema") {
            Some(schema) if !schema.is_null() => json_schema(schema, "response_format.schema").map(Some),
            _ => Ok(Some(GrammarKind::JsonObject(JsonObject {}))),
        },
        Some("json_schema") => {
            let at = "response_format.json_schema";
            let Some(js) = obj.get("json_schema").and_then(Value::as_object) else {
                return Err(ApiError::invalid(
                    at,
                    "response_format type \"json_schema\" needs a `json_schema` object: {\"name\": ..., \"schema\": {...}}",
                ));
            };
            match js.get("schema") {
                Some(schema) if !schema.is_null() => {
                    json_schema(schema, "response_format.json_schema.schema").map(Some)
                }
                // OpenAI's schema is optional: any JSON object then.
                _ => Ok(Some(GrammarKind::JsonObject(JsonObject {}))),
            }
        }
        Some(other) => Err(ApiError::invalid(
            "response_format.type",
            format!("response_format.type is \"{other}\" but must be one of text, json_object, json_schema"),
        )),
        None => Err(ApiError::invalid(
            "response_format.type",
            "response_format has no `type`; use \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

fn json_schema(schema: &Value, param: &str) -> Result<GrammarKind, ApiError> {
    if !(schema.is_object() || schema.is_boolean()) {
        return Err(ApiError::invalid(
            param,
            format!(
                "{param} is {} but a JSON schema is an object",
                kind_of(schema)
            ),
        ));
    }
    Ok(GrammarKind::JsonSchema(schema.to_string()))
}

/// llama.cpp's `grammar` is GBNF; omni takes llguidance's Lark syntax, and
/// says so when it sees GBNF's `::=`.
fn lark(g: &Value) -> Result<GrammarKind, ApiError> {
    let Some(text) = g.as_str() else {
        return Err(ApiError::invalid(
            "grammar",
            format!(
                "grammar is {} but must be a string (a Lark grammar)",
                kind_of(g)
            ),
        ));
    };
    if text.contains("::=") {
        return Err(ApiError::invalid(
            "grammar",
            "grammar looks like GBNF (it has `::=`): omni takes grammars in llguidance's Lark syntax, e.g. `start: \"yes\" | \"no\"` for `root ::= \"yes\" | \"no\"`",
        ));
    }
    Ok(GrammarKind::Lark(text.to_string()))
}

/// A JSON value that asks for nothing: absent, null, or an empty array.
fn is_empty_value(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::Array(a)) => a.is_empty(),
        _ => false,
    }
}

/// The text of a message's content: a string, or the text parts joined with newlines.
fn content_text(content: Option<&Value>, at: &str, may_be_empty: bool) -> Result<String, ApiError> {
    let param = format!("{at}.content");
    match content {
        None | Some(Value::Null) if may_be_empty => Ok(String::new()),
        None | Some(Value::Null) => Err(ApiError::invalid(
            &param,
            format!("{param} is missing; give a string or an array of text parts"),
        )),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let at = format!("{param}[{j}]");
                let ty = part.get("type").and_then(Value::as_str);
                let text = match ty {
                    Some("text") => part.get("text").and_then(Value::as_str).ok_or_else(|| {
                        ApiError::invalid(
                            format!("{at}.text"),
                            format!("{at} is a text part without a `text` string"),
                        )
                    })?,
                    // An assistant's earlier refusal, replayed in the history.
                    Some("refusal") => part.get("refusal").and_then(Value::as_str).unwrap_or(""),
                    Some(t @ ("image_url" | "input_image" | "image")) => {
                        return Err(ApiError::unsupported(
                            &at,
                            format!("image input is not supported: {at} is an `{t}` part; send text only"),
                        ))
                    }
                    Some(t @ ("input_audio" | "audio")) => {
                        return Err(ApiError::unsupported(
                            &at,
                            format!("audio input is not supported: {at} is an `{t}` part; send text only"),
                        ))
                    }
                    Some("file") => {
                        return Err(ApiError::unsupported(
                            &at,
                            format!("file input is not supported: {at} is a `file` part; send text only"),
                        ))
                    }
                    Some(t) => {
                        return Err(ApiError::invalid(
                            format!("{at}.type"),
                            format!("{at}.type is \"{t}\" but only \"text\" parts are supported"),
                        ))
                    }
                    None => {
                        return Err(ApiError::invalid(
                            format!("{at}.type"),
                            format!("{at} has no `type`; a content part looks like {{\"type\": \"text\", \"text\": \"...\"}}"),
                        ))
                    }
                };
                texts.push(text);
            }
            Ok(texts.join("\n"))
        }
        Some(other) => Err(ApiError::invalid(
            &param,
            format!(
                "{param} is {} but must be a string or an array of content parts",
                kind_of(other)
            ),
        )),
    }
}

impl ChatCompletionRequest {
    fn common(&self) -> Common<'_> {
        Common {
            n: self.n,
            seed: self.seed.as_ref(),
            temperature: self.temperature,
            top_p: self.top_p,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: self.logit_bias.as_ref(),
            stop: self.stop.as_ref(),
            top_k: self.top_k,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            response_format: self.response_format.as_ref(),
            json_schema: self.json_schema.as_ref(),
            grammar: self.grammar.as_ref(),
        }
    }

    /// Choices wanted (1 when absent; valid after [`Self::validate`]).
    pub fn n(&self) -> u32 {
        check_n(self.n).unwrap_or(1)
    }

    pub fn stream(&self) -> bool {
        self.stream == Some(true)
    }

    /// Whether a stream ends with a usage chunk (only meaningful when streaming).
    pub fn include_usage(&self) -> bool {
        self.stream()
            && self
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false)
    }

    /// Whether the response carries `logprobs`.
    pub fn logprobs(&self) -> bool {
        self.logprobs == Some(true)
    }

    /// The messages' text, one per line: what `auto` rules look at.
    pub fn prompt_text(&self) -> String {
        self.messages
            .iter()
            .filter_map(|m| m.content.as_ref().and_then(|c| c.as_str()))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn refuse_unsupported(&self) -> Result<(), ApiError> {
        for (param, v) in [
            ("functions", &self.functions),
            ("function_call", &self.function_call),
        ] {
            if !is_empty_value(v) {
                return Err(ApiError::unsupported(
                    param,
                    format!("{param} is OpenAI's deprecated form of tools; send `tools` and `tool_choice` instead"),
                ));
            }
        }
        Ok(())
    }

    /// `tool_choice`: "auto", "none", "required" or `{"type": "function",
    /// "function": {"name": ...}}` (whether the name is among the tools is
    /// the coordinator's check).
    fn tool_choice(&self) -> Result<(ToolChoice, String), ApiError> {
        let bad = |what: String| {
            ApiError::invalid(
                "tool_choice",
                format!("tool_choice is {what} but must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
            )
        };
        match &self.tool_choice {
            None | Some(Value::Null) => Ok((ToolChoice::Auto, String::new())),
            Some(Value::String(s)) => match s.as_str() {
                "auto" => Ok((ToolChoice::Auto, String::new())),
                "none" => Ok((ToolChoice::None, String::new())),
                "required" => Ok((ToolChoice::Required, String::new())),
                other => Err(bad(format!("\"{other}\""))),
            },
            Some(v @ Value::Object(o)) => {
                let name = o
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .filter(|n| !n.is_empty())
                    .ok_or_else(|| bad(v.to_string()))?;
                Ok((ToolChoice::Function, name.to_string()))
            }
            Some(other) => Err(bad(kind_of(other).to_string())),
        }
    }

    fn chat(&self) -> Result<Chat, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "messages is empty; a chat completion needs at least one message",
            ));
        }
        let mut messages = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            let at = format!("messages[{i}]");
            let role = match m.role.as_str() {
                "system" | "user" | "assistant" | "tool" => m.role.as_str(),
                // OpenAI's newer name for system; chat templates know only "system".
                "developer" => "system",
                "function" => {
                    return Err(ApiError::unsupported(
                        format!("{at}.role"),
                        format!("{at}.role is \"function\", OpenAI's deprecated form of a tool result; send it as a \"tool\" message with its tool_call_id"),
                    ))
                }
                r => {
                    return Err(ApiError::invalid(
                        format!("{at}.role"),
                        format!("{at}.role is \"{r}\" but must be one of system, developer, user, assistant, tool"),
                    ))
                }
            };
            if !is_empty_value(&m.function_call) {
                return Err(ApiError::unsupported(
                    format!("{at}.function_call"),
                    format!("{at}.function_call is OpenAI's deprecated form of tool_calls; send `tool_calls`"),
                ));
            }
            let tool_calls = tool_calls(m.tool_calls.as_ref(), &at)?;
            let may_be_empty = role == "assistant" || role == "tool";
            let content = content_text(m.content.as_ref(), &at, may_be_empty)?;
            let tool_call_id = match (role, &m.tool_call_id) {
                ("tool", Some(id)) => id.clone(),
                ("tool", None) => {
                    return Err(ApiError::invalid(
                        format!("{at}.tool_call_id"),
                        format!("{at} is a tool result without `tool_call_id`; give the id of the call it answers"),
                    ))
                }
                _ => String::new(),
            };
            messages.push(ChatMessage {
                role: role.to_string(),
                content,
                tool_calls,
                tool_call_id,
                name: m.name.clone().unwrap_or_default(),
            });
        }
        let (tool_choice, tool_choice_function) = self.tool_choice()?;
        let tools_json = match &self.tools {
            Some(t @ Value::Array(a)) if !a.is_empty() => t.to_string(),
            None | Some(Value::Null) | Some(Value::Array(_)) => String::new(),
            Some(other) => {
                return Err(ApiError::invalid(
                    "tools",
                    format!("tools is {} but must be an array of {{\"type\": \"function\", \"function\": {{...}}}}", kind_of(other)),
                ))
            }
        };
        Ok(Chat {
            messages,
            tools_json,
            tool_choice: tool_choice as i32,
            tool_choice_function,
            parallel_tool_calls: self.parallel_tool_calls,
        })
    }

    /// Checks every field; the same checks [`Self::to_generate`] makes.
    pub fn validate(&self) -> Result<(), ApiError> {
        self.to_generate().map(|_| ())
    }

    /// The coordinator request for one choice (see [`choice_request`] for the others).
    pub fn to_generate(&self) -> Result<GenerateRequest, ApiError> {
        self.refuse_unsupported()?;
        let chat = self.chat()?;
        let common = self.common();
        common.validate()?;
        let max_tokens = check_max_tokens("max_tokens", self.max_tokens)?;
        let max_completion = check_max_tokens("max_completion_tokens", self.max_completion_tokens)?;
        let top_logprobs = match self.top_logprobs {
            None => 0,
            Some(k) if !(0..=MAX_TOP_LOGPROBS as i64).contains(&k) => {
                return Err(ApiError::out_of_range(
                    "top_logprobs",
                    k,
                    format!("between 0 and {MAX_TOP_LOGPROBS}"),
                ))
            }
            Some(k) if k > 0 && !self.logprobs() => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("top_logprobs is {k} but logprobs is not true; set \"logprobs\": true to get log probabilities"),
                ))
            }
            Some(k) => k as u32,
        };
        Ok(GenerateRequest {
            prompt: Some(Prompt::Chat(chat)),
            // Absent: 0, which the coordinator reads as "until the context is full".
            max_tokens: max_completion.or(max_tokens),
            sampling: Some(common.sampling()?),
            stop: common.stop()?,
            ignore_eos: self.ignore_eos == Some(true),
            logprobs: self.logprobs(),
            top_logprobs,
            request_id: String::new(),
        })
    }
}

/// An assistant message's `tool_calls`, as the coordinator takes them.
fn tool_calls(v: Option<&Value>, at: &str) -> Result<Vec<ToolCall>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(l)) => l,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("{at}.tool_calls"),
                format!("{at}.tool_calls is {} but must be an array", kind_of(other)),
            ))
        }
    };
    list.iter()
        .enumerate()
        .map(|(j, c)| {
            let param = format!("{at}.tool_calls[{j}]");
            let f = c
                .get("function")
                .ok_or_else(|| ApiError::invalid(&param, format!("{param} has no `function`")))?;
            let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
                ApiError::invalid(&param, format!("{param}.function has no `name`"))
            })?;
            // A string of JSON, as OpenAI sends it (an object is taken too).
            let arguments = match f.get("arguments") {
                None | Some(Value::Null) => "{}".to_string(),
                Some(Value::String(s)) => s.clone(),
                Some(o @ Value::Object(_)) => o.to_string(),
                Some(other) => {
                    return Err(ApiError::invalid(
                        &param,
                        format!(
                            "{param}.function.arguments is {} but must be a string of JSON",
                            kind_of(other)
                        ),
                    ))
                }
            };
            Ok(ToolCall {
                id: c
                    .get("id")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
                name: name.to_string(),
                arguments,
            })
        })
        .collect()
}

/// A token id in a completions prompt.
fn prompt_id(v: &Value, at: &str) -> Result<u32, ApiError> {
    v.as_number()
        .and_then(integral)
        .and_then(|id| u32::try_from(id).ok())
        .ok_or_else(|| {
            ApiError::invalid(
                "prompt",
                format!(
                    "{at} is {v} but token ids must be integers from 0 to {}",
                    u32::MAX
                ),
            )
        })
}

fn prompt_ids(items: &[Value], at: &str) -> Result<Prompt, ApiError> {
    let ids = items
        .iter()
        .enumerate()
        .map(|(i, v)| prompt_id(v, &format!("{at}[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Prompt::Ids(TokenIds { ids }))
}

impl CompletionRequest {
    fn common(&self) -> Common<'_> {
        Common {
            n: self.n,
            seed: self.seed.as_ref(),
            temperature: self.temperature,
            top_p: self.top_p,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: self.logit_bias.as_ref(),
            stop: self.stop.as_ref(),
            top_k: self.top_k,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            response_format: self.response_format.as_ref(),
            json_schema: self.json_schema.as_ref(),
            grammar: self.grammar.as_ref(),
        }
    }

    pub fn n(&self) -> u32 {
        check_n(self.n).unwrap_or(1)
    }

    pub fn stream(&self) -> bool {
        self.stream == Some(true)
    }

    pub fn include_usage(&self) -> bool {
        self.stream()
            && self
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false)
    }

    /// Whether the response carries `logprobs` (`logprobs: 0` asks for the sampled
    /// tokens' logprobs without alternatives).
    pub fn logprobs(&self) -> bool {
        self.logprobs.is_some()
    }

    /// The prompt when it is one text: what `auto` rules look at.
    pub fn prompt_text(&self) -> String {
        self.prompt
            .as_ref()
            .and_then(|p| p.as_str())
            .unwrap_or_default()
            .to_string()
    }

    fn prompt(&self) -> Result<Prompt, ApiError> {
        let many = |n: usize| {
            ApiError::invalid(
                "prompt",
                format!("prompt has {n} prompts but this router takes one prompt per request; send them as separate requests"),
            )
        };
        match &self.prompt {
            None | Some(Value::Null) => Err(ApiError::invalid(
                "prompt",
                "prompt is missing; give a string or an array of token ids",
            )),
            Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
            Some(Value::Array(items)) => match items.first() {
                None => Err(ApiError::invalid(
                    "prompt",
                    "prompt is an empty array; give a string or an array of token ids",
                )),
                Some(Value::String(_)) => {
                    if items.len() > 1 {
                        return Err(many(items.len()));
                    }
                    Ok(Prompt::Text(
                        items[0].as_str().unwrap_or_default().to_string(),
                    ))
                }
                Some(Value::Array(inner)) => {
                    if items.len() > 1 {
                        return Err(many(items.len()));
                    }
                    prompt_ids(inner, "prompt[0]")
                }
                Some(_) => prompt_ids(items, "prompt"),
            },
            Some(other) => Err(ApiError::invalid(
                "prompt",
                format!(
                    "prompt is {} but must be a string or an array of token ids",
                    kind_of(other)
                ),
            )),
        }
    }

    fn refuse_unsupported(&self) -> Result<(), ApiError> {
        if self.echo == Some(true) {
            return Err(ApiError::unsupported(
                "echo",
                "echo is not supported; send the request with \"echo\": false",
            ));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::unsupported(
                "suffix",
                "suffix (insertion) is not supported; send the request without `suffix`",
            ));
        }
        if let Some(b) = self.best_of {
            if b != 1 && b != self.n.unwrap_or(1) {
                return Err(ApiError::unsupported(
                    "best_of",
                    format!("best_of is {b}: picking the best of several completions is not supported; leave best_of out and use n to get several completions"),
                ));
            }
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<(), ApiError> {
        self.to_generate().map(|_| ())
    }

    /// The coordinator request for one choice (see [`choice_request`] for the others).
    pub fn to_generate(&self) -> Result<GenerateRequest, ApiError> {
        self.refuse_unsupported()?;
        let prompt = self.prompt()?;
        let common = self.common();
        common.validate()?;
        let max_tokens = check_max_tokens("max_tokens", self.max_tokens)?
            .unwrap_or(COMPLETION_DEFAULT_MAX_TOKENS);
        let top_logprobs = match self.logprobs {
            None => 0,
            Some(k) if (0..=MAX_COMPLETION_LOGPROBS as i64).contains(&k) => k as u32,
            Some(k) => {
                return Err(ApiError::out_of_range(
                    "logprobs",
                    k,
                    format!("between 0 and {MAX_COMPLETION_LOGPROBS}"),
                ))
            }
        };
        Ok(GenerateRequest {
            prompt: Some(prompt),
            max_tokens: Some(max_tokens),
            sampling: Some(common.sampling()?),
            stop: common.stop()?,
            ignore_eos: self.ignore_eos == Some(true),
            logprobs: self.logprobs(),
            top_logprobs,
            request_id: String::new(),
        })
    }
}

/// The request for choice `index` of `n`: with a seed, each choice gets its own (seed +
/// index), or all `n` choices would be the same text.
pub fn choice_request(base: &GenerateRequest, index: u32) -> GenerateRequest {
    let mut r = base.clone();
    if let Some(s) = r.sampling.as_mut() {
        s.seed = s.seed.map(|seed| seed.wrapping_add(index as u64));
    }
    if !r.request_id.is_empty() && index > 0 {
        r.request_id = format!("{}-{index}", r.request_id);
    }
    r
}

// ---------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------

/// A fresh response id: `prefix` ("chatcmpl-" or "cmpl-") and 24 hex digits.
pub fn new_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(n);
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("{prefix}{:016x}{:08x}", h.finish(), n as u32)
}

/// Seconds since the Unix epoch, for `created`.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `data: {json}\n\n`, one server-sent event.
pub fn sse_data<T: Serialize + ?Sized>(value: &T) -> String {
    match serde_json::to_string(value) {
        Ok(json) => format!("data: {json}\n\n"),
        Err(e) => ApiError::internal(format!("could not encode a stream event: {e}")).sse(),
    }
}

/// OpenAI's `finish_reason` for the coordinator's.
pub fn finish_reason(reason: i32) -> &'static str {
    match FinishReason::try_from(reason) {
        Ok(FinishReason::Length) => "length",
        Ok(FinishReason::ToolCalls) => "tool_calls",
        _ => "stop",
    }
}

fn finite(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        LOGPROB_FLOOR
    }
}

/// One choice's output, gathered from the coordinator's events.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Generated {
    pub text: String,
    pub tokens: Vec<Token>,
    pub done: Option<Done>,
    pub tool_calls: Vec<ToolCallOut>,
}

impl Generated {
    pub fn push(&mut self, ev: &GenerateEvent) {
        self.text.push_str(&ev.text);
        for c in &ev.tool_calls {
            // A call's later pieces carry more of its arguments.
            match self.tool_calls.iter_mut().find(|t| t.index == c.index) {
                Some(t) if c.name.is_empty() => t.arguments.push_str(&c.arguments),
                _ => self.tool_calls.push(c.clone()),
            }
        }
        self.tokens.extend(ev.tokens.iter().cloned());
        if ev.done.is_some() {
            self.done = ev.done;
        }
    }

    pub fn finish_reason(&self) -> &'static str {
        finish_reason(self.done.map_or(0, |d| d.finish_reason))
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }

    /// The usage of `n` choices of one prompt: the prompt counted once, as OpenAI does.
    pub fn of(outputs: &[Generated]) -> Self {
        let prompt = outputs
            .iter()
            .find_map(|g| g.done.map(|d| d.prompt_tokens))
            .unwrap_or(0);
        let completion = outputs
            .iter()
            .map(|g| {
                g.done
                    .map_or(g.tokens.len() as u32, |d| d.completion_tokens)
            })
            .sum();
        Self::new(prompt, completion)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// A chat choice's `logprobs`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    pub refusal: Option<String>,
}

/// Chat logprobs of `tokens`; `token_text` gives a token's text (the router has no
/// tokenizer of its own).
pub fn chat_logprobs(tokens: &[Token], token_text: impl Fn(u32) -> String) -> ChatLogprobs {
    let content = tokens
        .iter()
        .map(|t| {
            let text = token_text(t.id);
            ChatTokenLogprob {
                bytes: text.as_bytes().to_vec(),
                token: text,
                logprob: finite(t.logprob.unwrap_or(0.0)),
                top_logprobs: t
                    .top
                    .iter()
                    .map(|a| {
                        let text = token_text(a.token);
                        ChatTopLogprob {
                            bytes: text.as_bytes().to_vec(),
                            token: text,
                            logprob: finite(a.logprob),
                        }
                    })
                    .collect(),
            }
        })
        .collect();
    ChatLogprobs {
        content,
        refusal: None,
    }
}

/// A completions `top_logprobs` entry: token text to logprob, in rank order. Serialized as
/// a JSON object; a text that two tokens share keeps the better-ranked one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopLogprobMap(pub Vec<(String, f32)>);

impl Serialize for TopLogprobMap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// A completions choice's `logprobs` (the legacy format).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<TopLogprobMap>,
    /// Character offset of each token in the choice's text.
    pub text_offset: Vec<u32>,
}

/// Completions logprobs of `tokens`, whose text starts at character `offset` of the
/// choice's text; `offset` is advanced past them (streams call this chunk by chunk).
pub fn completion_logprobs(
    tokens: &[Token],
    token_text: impl Fn(u32) -> String,
    offset: &mut usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for t in tokens {
        let text = token_text(t.id);
        out.text_offset.push(*offset as u32);
        *offset += text.chars().count();
        out.tokens.push(text);
        out.token_logprobs.push(finite(t.logprob.unwrap_or(0.0)));
        let mut top: Vec<(String, f32)> = Vec::with_capacity(t.top.len());
        for a in &t.top {
            let text = token_text(a.token);
            if !top.iter().any(|(k, _)| *k == text) {
                top.push((text, finite(a.logprob)));
            }
        }
        out.top_logprobs.push(TopLogprobMap(top));
    }
    out
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    /// Null when the answer is tool calls alone, as OpenAI sends it.
    pub content: Option<String>,
    pub refusal: Option<String>,
    /// URL citations and the like; omni produces none, but clients and
    /// validators expect the field.
    pub annotations: Vec<serde_json::Value>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallJson>,
}

/// A tool call as OpenAI sends it (in a message, or as a stream delta: the
/// first delta of a call has its id and name, later ones argument text).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallJson {
    /// Only in stream deltas.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionJson,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionJson {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

impl ToolCallJson {
    fn whole(c: &ToolCallOut) -> ToolCallJson {
        ToolCallJson {
            index: None,
            id: Some(c.id.clone()),
            kind: Some("function"),
            function: FunctionJson {
                name: Some(c.name.clone()),
                arguments: c.arguments.clone(),
            },
        }
    }

    /// The stream deltas of a call or a piece of one: id and name first
    /// (a call's first piece), then its arguments' text.
    fn deltas(c: &ToolCallOut) -> Vec<ToolCallJson> {
        let mut out = Vec::new();
        if !c.name.is_empty() {
            let mut first = ToolCallJson::whole(c);
            first.index = Some(c.index);
            first.function.arguments = String::new();
            out.push(first);
        }
        if !c.arguments.is_empty() {
            out.push(ToolCallJson {
                index: Some(c.index),
                id: None,
                kind: None,
                function: FunctionJson {
                    name: None,
                    arguments: c.arguments.clone(),
                },
            });
        }
        out
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
}

/// The body of a non-streaming chat completion.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<String>,
}

impl ChatCompletion {
    /// One choice per output, in order; `logprobs` says whether the request asked for them.
    pub fn build(
        id: String,
        created: u64,
        model: &str,
        outputs: &[Generated],
        logprobs: bool,
        token_text: impl Fn(u32) -> String,
    ) -> Self {
        let choices = outputs
            .iter()
            .enumerate()
            .map(|(i, g)| ChatChoice {
                index: i as u32,
                message: AssistantMessage {
                    role: "assistant",
                    content: (g.tool_calls.is_empty() || !g.text.trim().is_empty())
                        .then(|| g.text.clone()),
                    refusal: None,
                    annotations: Vec::new(),
                    tool_calls: g.tool_calls.iter().map(ToolCallJson::whole).collect(),
                },
                logprobs: logprobs.then(|| chat_logprobs(&g.tokens, &token_text)),
                finish_reason: g.finish_reason(),
            })
            .collect();
        Self {
            id,
            object: "chat.completion",
            created,
            model: model.to_string(),
            choices,
            usage: Usage::of(outputs),
            system_fingerprint: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    /// Null in stream chunks until the choice ends.
    pub finish_reason: Option<&'static str>,
}

/// The body of a non-streaming completion.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Usage,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<String>,
}

impl Completion {
    pub fn build(
        id: String,
        created: u64,
        model: &str,
        outputs: &[Generated],
        logprobs: bool,
        token_text: impl Fn(u32) -> String,
    ) -> Self {
        let choices = outputs
            .iter()
            .enumerate()
            .map(|(i, g)| CompletionChoice {
                index: i as u32,
                text: g.text.clone(),
                logprobs: logprobs.then(|| completion_logprobs(&g.tokens, &token_text, &mut 0)),
                finish_reason: Some(g.finish_reason()),
            })
            .collect();
        Self {
            id,
            object: "text_completion",
            created,
            model: model.to_string(),
            choices,
            usage: Usage::of(outputs),
            system_fingerprint: None,
        }
    }
}

/// `usage` of a stream chunk: absent without `include_usage`; with it, null on every
/// chunk but the last, which has the usage and no choices.
type ChunkUsage = Option<Option<Usage>>;

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallJson>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// One event of a streaming chat completion.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: ChunkUsage,
}

/// Builds the chunks of one chat stream, all with the same id. The order: [`Self::role`]
/// for each choice, then [`Self::event`] for each coordinator event, then [`Self::usage`]
/// when `include_usage`, then [`SSE_DONE`].
#[derive(Debug, Clone, PartialEq)]
pub struct ChatStream {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub include_usage: bool,
    pub logprobs: bool,
}

impl ChatStream {
    pub fn new(model: &str, include_usage: bool, logprobs: bool) -> Self {
        Self {
            id: new_id("chatcmpl-"),
            created: unix_now(),
            model: model.to_string(),
            include_usage,
            logprobs,
        }
    }

    fn chunk(&self, choices: Vec<ChatChunkChoice>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: self.include_usage.then_some(None),
        }
    }

    /// The first chunk of a choice: `{"role": "assistant", "content": ""}`.
    pub fn role(&self, index: u32) -> ChatCompletionChunk {
        self.chunk(vec![ChatChunkChoice {
            index,
            delta: ChatDelta {
                role: Some("assistant"),
                content: Some(String::new()),
                ..ChatDelta::default()
            },
            logprobs: None,
            finish_reason: None,
        }])
    }

    pub fn content(
        &self,
        index: u32,
        text: &str,
        logprobs: Option<ChatLogprobs>,
    ) -> ChatCompletionChunk {
        self.chunk(vec![ChatChunkChoice {
            index,
            delta: ChatDelta {
                role: None,
                content: Some(text.to_string()),
                ..ChatDelta::default()
            },
            logprobs,
            finish_reason: None,
        }])
    }

    /// The last chunk of a choice: an empty delta and the finish reason.
    pub fn finish(&self, index: u32, finish_reason: &'static str) -> ChatCompletionChunk {
        self.chunk(vec![ChatChunkChoice {
            index,
            delta: ChatDelta::default(),
            logprobs: None,
            finish_reason: Some(finish_reason),
        }])
    }

    /// The chunk after every choice finished, when `include_usage`.
    pub fn usage(&self, usage: Usage) -> ChatCompletionChunk {
        let mut c = self.chunk(Vec::new());
        c.usage = Some(Some(usage));
        c
    }

    /// The chunks for one coordinator event of choice `index`: its text (with logprobs
    /// when asked), then the finish chunk if the event is the last.
    pub fn event(
        &self,
        index: u32,
        ev: &GenerateEvent,
        token_text: impl Fn(u32) -> String,
    ) -> Vec<ChatCompletionChunk> {
        let mut out = Vec::new();
        let logprobs =
            (self.logprobs && !ev.tokens.is_empty()).then(|| chat_logprobs(&ev.tokens, token_text));
        if !ev.text.is_empty() || logprobs.is_some() {
            out.push(self.content(index, &ev.text, logprobs));
        }
        for call in &ev.tool_calls {
            for d in ToolCallJson::deltas(call) {
                out.push(self.chunk(vec![ChatChunkChoice {
                    index,
                    delta: ChatDelta {
                        tool_calls: vec![d],
                        ..ChatDelta::default()
                    },
                    logprobs: None,
                    finish_reason: None,
                }]));
            }
        }
        if let Some(done) = &ev.done {
            out.push(self.finish(index, finish_reason(done.finish_reason)));
        }
        out
    }
}

/// One event of a streaming completion (the same shape as [`Completion`], usage aside).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: ChunkUsage,
}

/// Builds the chunks of one completions stream; keeps each choice's text offset for
/// `logprobs.text_offset`. The order: [`Self::event`] for each coordinator event, then
/// [`Self::usage`] when `include_usage`, then [`SSE_DONE`].
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionStream {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub include_usage: bool,
    pub logprobs: bool,
    offsets: Vec<usize>,
}

impl CompletionStream {
    pub fn new(model: &str, include_usage: bool, logprobs: bool) -> Self {
        Self {
            id: new_id("cmpl-"),
            created: unix_now(),
            model: model.to_string(),
            include_usage,
            logprobs,
            offsets: Vec::new(),
        }
    }

    fn chunk(&self, choice: Option<CompletionChoice>) -> CompletionChunk {
        CompletionChunk {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices: choice.into_iter().collect(),
            usage: self.include_usage.then_some(None),
        }
    }

    /// A text chunk of choice `index`, with the logprobs of `tokens` when asked.
    pub fn text(
        &mut self,
        index: u32,
        text: &str,
        tokens: &[Token],
        token_text: impl Fn(u32) -> String,
    ) -> CompletionChunk {
        let logprobs = self.logprobs.then(|| {
            let i = index as usize;
            if self.offsets.len() <= i {
                self.offsets.resize(i + 1, 0);
            }
            completion_logprobs(tokens, token_text, &mut self.offsets[i])
        });
        self.chunk(Some(CompletionChoice {
            index,
            text: text.to_string(),
            logprobs,
            finish_reason: None,
        }))
    }

    pub fn finish(&self, index: u32, finish_reason: &'static str) -> CompletionChunk {
        self.chunk(Some(CompletionChoice {
            index,
            text: String::new(),
            logprobs: None,
            finish_reason: Some(finish_reason),
        }))
    }

    pub fn usage(&self, usage: Usage) -> CompletionChunk {
        let mut c = self.chunk(None);
        c.usage = Some(Some(usage));
        c
    }

    pub fn event(
        &mut self,
        index: u32,
        ev: &GenerateEvent,
        token_text: impl Fn(u32) -> String,
    ) -> Vec<CompletionChunk> {
        let mut out = Vec::new();
        if !ev.text.is_empty() || (self.logprobs && !ev.tokens.is_empty()) {
            out.push(self.text(index, &ev.text, &ev.tokens, token_text));
        }
        if let Some(done) = &ev.done {
            out.push(self.finish(index, finish_reason(done.finish_reason)));
        }
        out
    }
}

// ---------------------------------------------------------------------------------------
// Models
// ---------------------------------------------------------------------------------------

/// One entry of `GET /v1/models` (and the body of `GET /v1/models/{id}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
}

impl ModelCard {
    pub fn new(id: impl Into<String>, created: u64) -> Self {
        Self {
            id: id.into(),
            object: "model".into(),
            created,
            owned_by: "omni".into(),
        }
    }
}

/// The body of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

impl ModelList {
    pub fn new<S: Into<String>>(ids: impl IntoIterator<Item = S>, created: u64) -> Self {
        Self {
            object: "list".into(),
            data: ids
                .into_iter()
                .map(|id| ModelCard::new(id, created))
                .collect(),
        }
    }
}
