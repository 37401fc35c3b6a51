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
//!   `repeat_penalty` > 0, `ignore_eos`, `cache_prompt` (false: this prompt neither starts
//!   from the prefix cache nor leaves blocks in it). Ours: `deterministic` (true: the same
//!   tokens whatever else runs; see the coordinator's `--deterministic`).
//! - llama-server's `speculative.n_max` (0..=[`MAX_DRAFT`]; 0 turns speculative decoding
//!   off for the request), `speculative.n_min` and `speculative.p_min` (0..=1, a draft
//!   model's confidence floor); responses carry llama-server's
//!   `timings.draft_n` and `timings.draft_n_accepted` (docs/speculative.md).
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

mod chat;
mod completion;
mod error;
mod grammar;
mod request;
mod response;
mod stream;

pub use completion::choice_request;
pub use error::{from_status, ApiError, UNAVAILABLE_RETRY_S};
pub use request::{
    parse_json, ChatCompletionRequest, ChatMessageParam, CompletionRequest, StreamOptions,
};
pub use response::{
    chat_logprobs, completion_logprobs, finish_reason, new_id, sse_data, unix_now,
    AssistantMessage, ChatChoice, ChatCompletion, ChatLogprobs, ChatTokenLogprob, ChatTopLogprob,
    Completion, CompletionChoice, CompletionLogprobs, FunctionJson, Generated, ModelCard,
    ModelList, Timings, ToolCallJson, TopLogprobMap, Usage,
};
pub use stream::{
    ChatChunkChoice, ChatCompletionChunk, ChatDelta, ChatStream, CompletionChunk, CompletionStream,
};

/// The most choices one request may ask for.
pub const MAX_N: u32 = 16;
/// The most stop strings one request may give: more than OpenAI's 4, as
/// llama-server and vLLM take (HumanEval harnesses send 5), bounded so a
/// request cannot make every decoded piece scan thousands of strings.
pub const MAX_STOP: usize = 16;

/// Most draft tokens a request may ask a step to verify
/// (`speculative.n_max`); a step's token budget bounds it further.
pub const MAX_DRAFT: u32 = 256;
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
