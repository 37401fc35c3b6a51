//! `POST /v1/chat/completions`: messages (text parts, tool calls, tool results) to the
//! coordinator's chat request.

use super::error::ApiError;
use super::grammar::is_empty_value;
use super::request::check_max_tokens;
use super::request::check_n;
use super::request::kind_of;
use super::request::ChatCompletionRequest;
use super::request::Common;
use super::MAX_TOP_LOGPROBS;
use omni_proto::coordinator::v1::generate_request::Prompt;
use omni_proto::coordinator::v1::Chat;
use omni_proto::coordinator::v1::ChatMessage;
use omni_proto::coordinator::v1::GenerateRequest;
use omni_proto::coordinator::v1::ToolCall;
use omni_proto::coordinator::v1::ToolChoice;
use serde_json::Value;

/// The text of a message's content: a string, or the text parts joined with newlines.
pub(super) fn content_text(
    content: Option<&Value>,
    at: &str,
    may_be_empty: bool,
) -> Result<String, ApiError> {
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
    pub(super) fn common(&self) -> Common<'_> {
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
            speculative_n_max: self.speculative_n_max,
            speculative_n_min: self.speculative_n_min,
            speculative_p_min: self.speculative_p_min,
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

    pub(super) fn refuse_unsupported(&self) -> Result<(), ApiError> {
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
    pub(super) fn tool_choice(&self) -> Result<(ToolChoice, String), ApiError> {
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

    pub(super) fn chat(&self) -> Result<Chat, ApiError> {
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
            cache_prompt: self.cache_prompt,
            deterministic: self.deterministic == Some(true),
            logprobs: self.logprobs(),
            top_logprobs,
            request_id: String::new(),
            resume: None,
            resumable: false,
            speculative: common.speculative()?,
        })
    }
}

/// An assistant message's `tool_calls`, as the coordinator takes them.
pub(super) fn tool_calls(v: Option<&Value>, at: &str) -> Result<Vec<ToolCall>, ApiError> {
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
