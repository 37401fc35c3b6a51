//! [`ApiError`]: the one place where a failure becomes an HTTP status and OpenAI's
//! error body, including the coordinator's errors (read from their details).

use super::response::sse_data;
use super::INVALID_REQUEST;
use super::SERVER_ERROR;
use super::UNSUPPORTED;
use serde::Serialize;
use serde_json::Value;
use std::fmt::Display;

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
pub(super) struct ErrorBody<'a> {
    pub(super) error: ErrorObject<'a>,
}

#[derive(Serialize)]
pub(super) struct ErrorObject<'a> {
    pub(super) message: &'a str,
    #[serde(rename = "type")]
    pub(super) kind: &'a str,
    pub(super) param: Option<&'a str>,
    pub(super) code: Option<&'a str>,
}

/// The `Retry-After` of a 503: a recovery takes about a second when the
/// supervisor restarts a worker at once.
pub const UNAVAILABLE_RETRY_S: u64 = 2;

impl ApiError {
    pub(super) fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
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

    pub(super) fn error_body(&self) -> ErrorBody<'_> {
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
/// mistakes ("the prompt has 5000 tokens but the context is 4096 tokens"); the field at
/// fault and the reason come from the status's details (`omni_proto::errors`), never from
/// the message. A prompt field is "prompt"; [`ApiError::in_chat`] renames it to "messages".
pub fn from_status(s: &tonic::Status) -> ApiError {
    use omni_proto::errors::{self, Reason};
    use tonic::Code;
    let msg = s.message();
    let e = match s.code() {
        Code::InvalidArgument | Code::FailedPrecondition => ApiError::bad_request(msg),
        Code::Unavailable => ApiError::unavailable(msg),
        Code::DeadlineExceeded => ApiError::timeout(msg),
        code => return ApiError::internal(format!("the cluster failed ({code:?}): {msg}")),
    };
    let e = match errors::field(s) {
        Some(f) => e.with_param(openai_param(&f)),
        None => e,
    };
    match errors::reason(s) {
        Some(Reason::PromptTooLong) => e.with_code("context_length_exceeded"),
        _ => e,
    }
}

/// A request field as the coordinator names it (its path in `GenerateRequest`) and as
/// an OpenAI client wrote it: the sampling settings and the chat are top-level fields
/// there, a grammar is `response_format` or (for Lark) our `grammar` extension.
pub(super) fn openai_param(field: &str) -> String {
    let f = field
        .strip_prefix("sampling.")
        .or_else(|| field.strip_prefix("chat."))
        .unwrap_or(field);
    match f {
        "grammar.json_schema" | "grammar.json_object" => "response_format".into(),
        "grammar.lark" => "grammar".into(),
        "tool_choice_function" => "tool_choice".into(),
        _ if f.starts_with("tools_json") => f.replacen("tools_json", "tools", 1),
        _ => match f.strip_suffix(".arguments") {
            Some(call) if call.contains(".tool_calls[") => format!("{call}.function.arguments"),
            _ => f.to_string(),
        },
    }
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
