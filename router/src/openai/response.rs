//! Responses: ids, usage, logprobs, messages with tool calls, choices, models.

use super::error::ApiError;
use super::LOGPROB_FLOOR;
use omni_proto::coordinator::v1::Done;
use omni_proto::coordinator::v1::FinishReason;
use omni_proto::coordinator::v1::GenerateEvent;
use omni_proto::coordinator::v1::Token;
use omni_proto::coordinator::v1::ToolCallOut;
use serde::ser::SerializeMap;
use serde::Deserialize;
use serde::Serialize;
use serde::Serializer;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::SystemTime;
use std::time::UNIX_EPOCH;

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

pub(super) fn finite(logprob: f32) -> f32 {
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
    /// Always sent, as OpenAI does.
    #[serde(default)]
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens taken from the prefix cache.
    pub cached_tokens: u32,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails::default(),
        }
    }

    /// The usage of `n` choices of one prompt: the prompt counted once, as OpenAI does.
    pub fn of(outputs: &[Generated]) -> Self {
        let (prompt, cached) = outputs
            .iter()
            .find_map(|g| g.done.map(|d| (d.prompt_tokens, d.cached_tokens)))
            .unwrap_or((0, 0));
        let completion = outputs
            .iter()
            .map(|g| {
                g.done
                    .map_or(g.tokens.len() as u32, |d| d.completion_tokens)
            })
            .sum();
        Self {
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
            ..Self::new(prompt, completion)
        }
    }
}

/// llama-server's `timings`, with what omni measures: the prompt's tokens
/// computed (`prompt_n`) and taken from the prefix cache (`cache_n`), the
/// time to the first token (`prompt_ms`), tokens generated and their time,
/// and speculative decoding's drafts (`draft_n` sent, `draft_n_accepted`
/// taken; only when a draft was sent, as llama-server). Of `n` choices:
/// counts summed, times of the slowest.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Timings {
    pub prompt_n: u32,
    pub cache_n: u32,
    pub prompt_ms: f64,
    pub predicted_n: u32,
    pub predicted_ms: f64,
    pub predicted_per_second: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft_n: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft_n_accepted: Option<u32>,
}

impl Timings {
    pub fn of(outputs: &[Generated]) -> Self {
        let mut t = Timings::default();
        let (mut drafted, mut accepted) = (0, 0);
        for d in outputs.iter().filter_map(|g| g.done) {
            t.prompt_n = d.prompt_tokens.saturating_sub(d.cached_tokens);
            t.cache_n = d.cached_tokens;
            t.prompt_ms = t.prompt_ms.max(d.time_to_first_token_ms);
            t.predicted_n += d.completion_tokens;
            t.predicted_ms = t.predicted_ms.max(d.total_ms - d.time_to_first_token_ms);
            drafted += d.draft_n;
            accepted += d.draft_n_accepted;
        }
        if t.predicted_ms > 0.0 {
            t.predicted_per_second = t.predicted_n as f64 * 1e3 / t.predicted_ms;
        }
        if drafted > 0 {
            t.draft_n = Some(drafted);
            t.draft_n_accepted = Some(accepted);
        }
        t
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
    pub(super) fn whole(c: &ToolCallOut) -> ToolCallJson {
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
    pub(super) fn deltas(c: &ToolCallOut) -> Vec<ToolCallJson> {
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
    /// llama-server's extension.
    pub timings: Timings,
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
            timings: Timings::of(outputs),
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
    /// llama-server's extension.
    pub timings: Timings,
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
            timings: Timings::of(outputs),
            system_fingerprint: None,
        }
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
