//! The OpenAI types as a client sees them: request bodies shaped like the ones the official
//! `openai` Python client sends, the errors they get, what reaches the coordinator, and the
//! JSON of responses and stream chunks.

use std::pin::pin;
use std::task::{Context, Poll, Waker};

use axum::response::IntoResponse;
use omni_proto::coordinator::v1::generate_request::Prompt;
use omni_proto::coordinator::v1::{
    ChatMessage, Done, FinishReason, GenerateEvent, GenerateRequest, Token, ToolCallOut, ToolChoice,
};
use omni_proto::worker::v1::grammar::{JsonObject, Kind};
use omni_proto::worker::v1::{LogitBias, TopLogprob};
use omni_router::openai::*;
use serde_json::{json, Value};

fn chat(body: Value) -> Result<GenerateRequest, ApiError> {
    let req: ChatCompletionRequest = parse_json(body.to_string().as_bytes())?;
    req.to_generate()
}

fn completion(body: Value) -> Result<GenerateRequest, ApiError> {
    let req: CompletionRequest = parse_json(body.to_string().as_bytes())?;
    req.to_generate()
}

/// A minimal valid chat body with `patch`'s fields merged in.
fn chat_with(patch: Value) -> Value {
    let mut body = json!({
        "model": "gemma",
        "messages": [{"role": "user", "content": "Hello!"}],
    });
    for (k, v) in patch.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn completion_with(patch: Value) -> Value {
    let mut body = json!({"model": "gemma", "prompt": "Say this is a test"});
    for (k, v) in patch.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn text_of(id: u32) -> String {
    ["Hel", "lo", " wor", "ld", "é", "!"]
        .get(id as usize)
        .map_or(format!("<{id}>"), |s| s.to_string())
}

fn token(id: u32, logprob: f32, top: &[(u32, f32)]) -> Token {
    Token {
        id,
        logprob: Some(logprob),
        top: top
            .iter()
            .map(|&(token, logprob)| TopLogprob {
                token,
                logprob,
                piece: String::new(),
            })
            .collect(),
        piece: String::new(),
    }
}

fn done(reason: FinishReason, prompt: u32, completion: u32) -> Done {
    Done {
        finish_reason: reason as i32,
        prompt_tokens: prompt,
        completion_tokens: completion,
        time_to_first_token_ms: 1.0,
        total_ms: 2.0,
        cached_tokens: 0,
        draft_n: 0,
        draft_n_accepted: 0,
    }
}

fn json_of<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap()
}

fn keys(v: &Value) -> Vec<&str> {
    let mut k: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    k.sort();
    k
}

mod requests;
mod responses;
mod validation;
mod wire_errors;
