//! Tool calling: which syntax a model writes its tool calls in, the grammar
//! that makes it write one (`tool_choice` required or a named function), and
//! a streaming parser that splits its output into text and calls.
//!
//! The formats (as llama.cpp's `common/chat.cpp` and the models' own chat
//! templates define them):
//! - [`ToolFormat::Hermes`]: Qwen2.5, Qwen3, Hermes: `<tool_call>\n{"name":
//!   ..., "arguments": {...}}\n</tool_call>`, one block per call (Qwen3-Coder's
//!   `<function=NAME><parameter=P>V</parameter></function>` inside the block is
//!   read too).
//! - [`ToolFormat::DeepSeek`]: DeepSeek V3/R1: `<｜tool▁calls▁begin｜>` then
//!   per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>`
//!   (V3.1 drops the type and the fence: `NAME<｜tool▁sep｜>{...}`).
//! - [`ToolFormat::Llama3`]: Llama 3.x: the whole answer is `{"name": ...,
//!   "parameters": {...}}`, optionally after `<|python_tag|>`.
//! - [`ToolFormat::Mistral`]: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`,
//!   or the newer `[TOOL_CALLS]NAME[ARGS]{...}`.
//! - [`ToolFormat::Generic`]: for templates that know no tools (as llama.cpp
//!   does): the tools are described in a system message and the answer is
//!   JSON, `{"tool_calls": [{"name": ..., "arguments": {...}}]}` or
//!   `{"response": "..."}`.
//!
//! A call that does not parse is returned as text, never an error.

mod grammar;
mod parse;
#[cfg(test)]
mod tests;

pub use grammar::call_grammar;
pub use parse::{CallParser, ParsedCall, Piece};
use serde_json::{json, Value};

/// How a model writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    DeepSeek,
    Llama3,
    Mistral,
    Generic,
}

const HERMES_OPEN: &str = "<tool_call>";

const HERMES_CLOSE: &str = "</tool_call>";

const DS_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";

const DS_CALLS_END: &str = "<｜tool▁calls▁end｜>";

const DS_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";

const DS_CALL_END: &str = "<｜tool▁call▁end｜>";

const DS_SEP: &str = "<｜tool▁sep｜>";

const PYTHON_TAG: &str = "<|python_tag|>";

const MISTRAL_CALLS: &str = "[TOOL_CALLS]";

const MISTRAL_ARGS: &str = "[ARGS]";

impl ToolFormat {
    /// The format a chat template writes (and so the model was trained
    /// on), from the markers in its source.
    pub fn detect(template_source: &str) -> ToolFormat {
        let has = |s: &str| template_source.contains(s);
        if has(HERMES_OPEN) {
            ToolFormat::Hermes
        } else if has("tool▁calls▁begin") || has("tool▁call▁begin") {
            ToolFormat::DeepSeek
        } else if has(MISTRAL_CALLS) {
            ToolFormat::Mistral
        } else if has("<|start_header_id|>") && has("tools") {
            ToolFormat::Llama3
        } else {
            ToolFormat::Generic
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::DeepSeek => "deepseek",
            ToolFormat::Llama3 => "llama3",
            ToolFormat::Mistral => "mistral",
            ToolFormat::Generic => "generic",
        }
    }

    /// Whether the template renders `tools` itself; the generic format
    /// describes them in a system message instead.
    pub fn template_renders_tools(self) -> bool {
        self != ToolFormat::Generic
    }
}

/// One function the model may call (OpenAI's `tools[i].function`).
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: String,
    /// A JSON schema of the arguments (an object schema).
    pub parameters: Value,
}

/// OpenAI's `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model answers or calls tools as it sees fit.
    Auto,
    /// No tool calls: the tools are left out of the prompt.
    None,
    /// At least one call, from the first token.
    Required,
    /// A call of this function, from the first token.
    Function(String),
}

/// A `tools` array that cannot be used: the JSON path of the entry at fault
/// (`tools[1].function.name`) and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ToolsError {
    pub field: String,
    pub message: String,
}

fn tools_error(field: String, message: String) -> ToolsError {
    ToolsError { field, message }
}

/// Reads OpenAI's `tools` array (`[{"type": "function", "function": {"name",
/// "description", "parameters"}}]`); the error says which entry is wrong.
pub fn parse_tools(tools: &Value) -> Result<Vec<Tool>, ToolsError> {
    let list = tools.as_array().ok_or_else(|| {
        tools_error(
            "tools".into(),
            "tools must be an array of {\"type\": \"function\", \"function\": {...}}".into(),
        )
    })?;
    let mut out: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let ty = t.get("type").and_then(Value::as_str).unwrap_or("function");
        if ty != "function" {
            return Err(tools_error(
                format!("tools[{i}].type"),
                format!("tools[{i}].type is \"{ty}\" but only \"function\" tools are supported"),
            ));
        }
        let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| {
            tools_error(
                format!("tools[{i}]"),
                format!("tools[{i}] has no `function` object"),
            )
        })?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                tools_error(
                    format!("tools[{i}].function"),
                    format!("tools[{i}].function has no `name`"),
                )
            })?;
        if out.iter().any(|o| o.name == name) {
            return Err(tools_error(
                format!("tools[{i}].function.name"),
                format!("tools[{i}].function.name \"{name}\" is given twice"),
            ));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p) if p.is_object() => p.clone(),
            Some(_) => {
                return Err(tools_error(
                    format!("tools[{i}].function.parameters"),
                    format!("tools[{i}].function.parameters must be a JSON schema object"),
                ))
            }
        };
        out.push(Tool {
            name: name.to_string(),
            description: f
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            parameters,
        });
    }
    Ok(out)
}

/// The system message that describes the tools to a model whose template
/// knows none ([`ToolFormat::Generic`]).
pub fn generic_system_prompt(tools: &[Tool]) -> String {
    let list: Vec<Value> = tools
        .iter()
        .map(|t| json!({"name": t.name, "description": t.description, "parameters": t.parameters}))
        .collect();
    format!(
        "You can call these tools:\n{}\n\nAnswer in JSON only: either {{\"tool_calls\": [{{\"name\": <tool name>, \"arguments\": <arguments>}}]}} to call tools, or {{\"response\": <your answer>}} to answer directly.",
        serde_json::to_string_pretty(&list).unwrap_or_default()
    )
}
