//! Tool calling on the coordinator: a chat request's tools and earlier calls
//! go into the prompt through the model's own template, `tool_choice`
//! required or named becomes a grammar on the answer, and the answer's calls
//! are read out of its text as it streams (`GenerateEvent.tool_calls`).
//! The model's tool-call syntax is found from its template
//! (`omni_engine::tools::ToolFormat`).

use crate::error::Error;
use omni_engine::chat::{ChatMessage, ChatTemplate, ToolCall};
use omni_engine::sampling::Grammar;
use omni_engine::tokenizer::Tokenizer;
use omni_engine::tools::{self, CallParser, Piece, ToolChoice, ToolFormat};
use omni_proto::coordinator::v1::{
    Chat, FinishReason, GenerateEvent, ToolCallOut, ToolChoice as WireChoice,
};
use serde_json::Value;

/// A chat request rendered: the prompt text, and when tools are in play the
/// grammar that forces a call (if any) and the parser for the answer.
pub struct RenderedChat {
    pub text: String,
    pub grammar: Option<Grammar>,
    pub calls: Option<ToolCalls>,
}

/// Renders `chat` with its tools; every mistake is INVALID_ARGUMENT naming
/// the field.
pub fn render(
    chat: &Chat,
    template: &ChatTemplate,
    tok: &Tokenizer,
) -> Result<RenderedChat, Error> {
    let tools_json: Option<Value> =
        if chat.tools_json.trim().is_empty() {
            None
        } else {
            Some(serde_json::from_str(&chat.tools_json).map_err(|e| {
                Error::invalid("chat.tools_json", format!("tools is not JSON: {e}"))
            })?)
        };
    let tools = match &tools_json {
        Some(v) => tools::parse_tools(v).map_err(|e| {
            Error::invalid(e.field.replacen("tools", "chat.tools_json", 1), e.message)
        })?,
        None => Vec::new(),
    };
    let choice = match WireChoice::try_from(chat.tool_choice).unwrap_or(WireChoice::Auto) {
        WireChoice::Auto => ToolChoice::Auto,
        WireChoice::None => ToolChoice::None,
        WireChoice::Required => ToolChoice::Required,
        WireChoice::Function => ToolChoice::Function(chat.tool_choice_function.clone()),
    };
    let names = || {
        tools
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match &choice {
        ToolChoice::Required if tools.is_empty() => {
            return Err(Error::invalid(
                "chat.tool_choice",
                "tool_choice is \"required\" but the request has no tools",
            ))
        }
        ToolChoice::Function(name) if !tools.iter().any(|t| &t.name == name) => {
            return Err(Error::invalid(
                "chat.tool_choice_function",
                if tools.is_empty() {
                    format!(
                        "tool_choice names the function \"{name}\" but the request has no tools"
                    )
                } else {
                    format!(
                    "tool_choice names the function \"{name}\", which is not among the tools ({})",
                    names()
                )
                },
            ))
        }
        _ => {}
    }
    let format = ToolFormat::detect(template.source());
    let active = !tools.is_empty() && choice != ToolChoice::None;
    let mut msgs = messages(chat)?;
    let text = if active && !format.template_renders_tools() {
        generic_history(&mut msgs, &tools);
        template.render(&msgs, true)
    } else if active {
        template.render_with_tools(&msgs, tools_json.as_ref(), true)
    } else {
        if !format.template_renders_tools() {
            generic_history(&mut msgs, &[]);
        }
        template.render(&msgs, true)
    }
    .map_err(|e| Error::invalid("chat.messages", e.to_string()))?;
    if !active {
        return Ok(RenderedChat {
            text,
            grammar: None,
            calls: None,
        });
    }
    let parallel = chat.parallel_tool_calls.unwrap_or(true);
    // A call held to its shape from the first token streams its arguments
    // as they are written; otherwise each call goes out once it is whole.
    let forced = matches!(choice, ToolChoice::Required | ToolChoice::Function(_));
    let token = |marker: &str| -> Option<(u32, bool)> {
        let ids = tok.encode(marker, false, true).ok()?;
        (ids.len() == 1).then(|| (ids[0], tok.plain_piece(ids[0]).is_empty()))
    };
    Ok(RenderedChat {
        text,
        grammar: tools::call_grammar(format, &tools, &choice, parallel, &token),
        calls: Some(ToolCalls::new(format, parallel, forced)),
    })
}

/// The wire's messages as the template takes them; earlier calls'
/// arguments are parsed (templates print them as objects).
fn messages(chat: &Chat) -> Result<Vec<ChatMessage>, Error> {
    chat.messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let tool_calls = m
                .tool_calls
                .iter()
                .enumerate()
                .map(|(j, c)| {
                    let arguments = if c.arguments.trim().is_empty() {
                        Value::Object(Default::default())
                    } else {
                        serde_json::from_str(&c.arguments).map_err(|e| {
                            Error::invalid(
                                format!("chat.messages[{i}].tool_calls[{j}].arguments"),
                                format!("messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}"),
                            )
                        })?
                    };
                    Ok(ToolCall {
                        id: c.id.clone(),
                        name: c.name.clone(),
                        arguments,
                    })
                })
                .collect::<Result<Vec<_>, Error>>()?;
            Ok(ChatMessage {
                role: m.role.clone(),
                content: m.content.clone(),
                tool_calls,
                tool_call_id: (!m.tool_call_id.is_empty()).then(|| m.tool_call_id.clone()),
                name: (!m.name.is_empty()).then(|| m.name.clone()),
            })
        })
        .collect()
}

/// For a template that knows no tools: the tools described in the system
/// message, earlier calls written as the JSON the model answers with, and
/// tool results as user messages.
fn generic_history(msgs: &mut Vec<ChatMessage>, tools: &[tools::Tool]) {
    for m in msgs.iter_mut() {
        if !m.tool_calls.is_empty() {
            let calls: Vec<Value> = m
                .tool_calls
                .drain(..)
                .map(|c| serde_json::json!({"name": c.name, "arguments": c.arguments}))
                .collect();
            m.content = serde_json::json!({ "tool_calls": calls }).to_string();
        }
        if m.role == "tool" {
            let id = m.tool_call_id.take().unwrap_or_default();
            m.role = "user".into();
            m.content = format!("Result of tool call {id}:\n{}", m.content);
        }
    }
    if tools.is_empty() {
        return;
    }
    let prompt = tools::generic_system_prompt(tools);
    match msgs.first_mut() {
        Some(m) if m.role == "system" => m.content = format!("{}\n\n{prompt}", m.content),
        _ => msgs.insert(0, ChatMessage::text("system", &prompt)),
    }
}

/// One answer's tool calls as they are read from its text.
pub struct ToolCalls {
    parser: CallParser,
    parallel: bool,
    /// Calls given out (and ended).
    count: u32,
    /// The call being streamed is past the first, without parallel calls.
    skipping: bool,
}

impl ToolCalls {
    fn new(format: ToolFormat, parallel: bool, streaming: bool) -> ToolCalls {
        ToolCalls {
            parser: if streaming {
                CallParser::streaming(format)
            } else {
                CallParser::new(format)
            },
            parallel,
            count: 0,
            skipping: false,
        }
    }

    /// Moves the event's calls out of its text into `tool_calls`; the last
    /// event's finish reason says `tool_calls` when the answer made any.
    pub fn map(&mut self, mut ev: GenerateEvent) -> GenerateEvent {
        let mut pieces = self.parser.push(&ev.text);
        if ev.done.is_some() {
            pieces.extend(self.parser.finish());
        }
        ev.text.clear();
        for p in pieces {
            match p {
                Piece::Text(t) => ev.text.push_str(&t),
                // Without parallel calls, the first call is the answer.
                Piece::Call(_) if !self.parallel && self.count > 0 => {}
                Piece::Call(c) => {
                    ev.tool_calls.push(ToolCallOut {
                        index: self.count,
                        id: call_id(),
                        name: c.name,
                        arguments: c.arguments,
                    });
                    self.count += 1;
                }
                Piece::CallStart { .. } if !self.parallel && self.count > 0 => self.skipping = true,
                Piece::CallStart { name } => ev.tool_calls.push(ToolCallOut {
                    index: self.count,
                    id: call_id(),
                    name,
                    arguments: String::new(),
                }),
                Piece::CallArgs(_) if self.skipping => {}
                Piece::CallArgs(arguments) => ev.tool_calls.push(ToolCallOut {
                    index: self.count,
                    arguments,
                    ..ToolCallOut::default()
                }),
                Piece::CallEnd if self.skipping => self.skipping = false,
                Piece::CallEnd => self.count += 1,
            }
        }
        if let Some(done) = ev.done.as_mut() {
            if self.count > 0 && done.finish_reason == FinishReason::Stop as i32 {
                done.finish_reason = FinishReason::ToolCalls as i32;
            }
        }
        ev
    }
}

/// "call_" and 24 hex digits, as OpenAI's ids look.
fn call_id() -> String {
    let (a, b) = (
        omni_engine::sampling::fresh_seed(),
        omni_engine::sampling::fresh_seed(),
    );
    format!("call_{a:016x}{:08x}", b as u32)
}
