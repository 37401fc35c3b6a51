//! Streams: the SSE chunks of both endpoints.

use super::response::chat_logprobs;
use super::response::completion_logprobs;
use super::response::finish_reason;
use super::response::new_id;
use super::response::unix_now;
use super::response::ChatLogprobs;
use super::response::CompletionChoice;
use super::response::Timings;
use super::response::ToolCallJson;
use super::response::Usage;
use omni_proto::coordinator::v1::GenerateEvent;
use omni_proto::coordinator::v1::Token;
use serde::Serialize;

/// `usage` of a stream chunk: absent without `include_usage`; with it, null on every
/// chunk but the last, which has the usage and no choices.
pub(super) type ChunkUsage = Option<Option<Usage>>;

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
    /// llama-server's, on the usage chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
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

    pub(super) fn chunk(&self, choices: Vec<ChatChunkChoice>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: self.include_usage.then_some(None),
            timings: None,
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
    pub fn usage(&self, usage: Usage, timings: Timings) -> ChatCompletionChunk {
        let mut c = self.chunk(Vec::new());
        c.usage = Some(Some(usage));
        c.timings = Some(timings);
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
    /// llama-server's, on the usage chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
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

    pub(super) fn chunk(&self, choice: Option<CompletionChoice>) -> CompletionChunk {
        CompletionChunk {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices: choice.into_iter().collect(),
            usage: self.include_usage.then_some(None),
            timings: None,
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

    pub fn usage(&self, usage: Usage, timings: Timings) -> CompletionChunk {
        let mut c = self.chunk(None);
        c.usage = Some(Some(usage));
        c.timings = Some(timings);
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
