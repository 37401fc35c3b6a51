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

use serde_json::{json, Value};

use crate::sampling::Grammar;

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

/// The grammar that makes the model call a tool from its first token
/// (`required`, or the named function), or, for the generic format, answer
/// in its JSON envelope whatever the choice; for `auto`, the grammar that
/// starts when the model opens a call. `token` says whether a marker is one
/// token of this vocabulary: its id, and whether it is a special token
/// (grammars name those by id: their text is not plain text).
pub fn call_grammar(
    format: ToolFormat,
    tools: &[Tool],
    choice: &ToolChoice,
    parallel: bool,
    token: &dyn Fn(&str) -> Option<(u32, bool)>,
) -> Option<Grammar> {
    let chosen: Vec<&Tool> = match choice {
        ToolChoice::None => return None,
        ToolChoice::Function(name) => tools.iter().filter(|t| &t.name == name).collect(),
        ToolChoice::Auto | ToolChoice::Required => tools.iter().collect(),
    };
    // Calls are written on one line with `, ` and `: ` between items, as the
    // templates show the models: free whitespace lets a base model spend
    // the answer on indentation.
    let ws = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
    let call = |args_key: &str| -> Value {
        let one: Vec<Value> = chosen
            .iter()
            .map(|t| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, args_key: t.parameters},
                    "required": ["name", args_key],
                    "additionalProperties": false
                })
            })
            .collect();
        json!({"anyOf": one})
    };
    let lit = |marker: &str| match token(marker) {
        Some((id, true)) => format!("<[{id}]>"),
        _ => serde_json::to_string(marker).expect("a string"),
    };
    let many = if parallel { "+" } else { "" };
    if *choice == ToolChoice::Auto && format != ToolFormat::Generic {
        // Free text until the model opens a call with the format's marker
        // (when it is one token: the grammar starts at the token after it);
        // from there the call must fit the tools.
        let (opener, rest) = match format {
            ToolFormat::Hermes => {
                let mut schema = call("arguments");
                schema["x-guidance"] = ws;
                let close = lit(HERMES_CLOSE);
                let more = if parallel {
                    format!(" (\"\\n\"? {} body)*", lit(HERMES_OPEN))
                } else {
                    String::new()
                };
                (
                    HERMES_OPEN,
                    format!("start: body{more} \"\\n\"?\nbody: \"\\n\" %json {schema} \"\\n\" {close}\n"),
                )
            }
            ToolFormat::Llama3 => {
                let mut schema = call("parameters");
                schema["x-guidance"] = ws;
                (PYTHON_TAG, format!("start: %json {schema}\n"))
            }
            ToolFormat::Mistral => {
                let mut schema =
                    json!({"type": "array", "items": call("arguments"), "minItems": 1});
                if !parallel {
                    schema["maxItems"] = json!(1);
                }
                schema["x-guidance"] = ws;
                (MISTRAL_CALLS, format!("start: %json {schema}\n"))
            }
            ToolFormat::DeepSeek => (
                DS_CALLS_BEGIN,
                format!(
                    "start: call{many} {}\ncall: {}\n",
                    lit(DS_CALLS_END),
                    deepseek_calls(&chosen, &ws, &lit)
                ),
            ),
            ToolFormat::Generic => unreachable!("answered below"),
        };
        let (trigger, _) = token(opener)?;
        return Some(Grammar::Triggered {
            token: trigger,
            grammar: Box::new(Grammar::Lark { grammar: rest }),
        });
    }
    let lark = match format {
        ToolFormat::Hermes => {
            let mut schema = call("arguments");
            schema["x-guidance"] = ws;
            format!(
                "start: call{many}\ncall: {} \"\\n\" %json {} \"\\n\" {} \"\\n\"?\n",
                lit(HERMES_OPEN),
                schema,
                lit(HERMES_CLOSE)
            )
        }
        ToolFormat::Llama3 => {
            let mut schema = call("parameters");
            schema["x-guidance"] = ws;
            format!("start: %json {schema}\n")
        }
        ToolFormat::Mistral => {
            let mut schema = json!({"type": "array", "items": call("arguments"), "minItems": 1});
            if !parallel {
                schema["maxItems"] = json!(1);
            }
            schema["x-guidance"] = ws;
            format!("start: {} %json {schema}\n", lit(MISTRAL_CALLS))
        }
        ToolFormat::DeepSeek => format!(
            "start: {} call{many} {}\ncall: {}\n",
            lit(DS_CALLS_BEGIN),
            lit(DS_CALLS_END),
            deepseek_calls(&chosen, &ws, &lit)
        ),
        ToolFormat::Generic => {
            let mut calls = json!({"type": "array", "items": call("arguments"), "minItems": 1});
            if !parallel {
                calls["maxItems"] = json!(1);
            }
            let call_env = json!({
                "type": "object", "properties": {"tool_calls": calls},
                "required": ["tool_calls"], "additionalProperties": false
            });
            let mut schema = if *choice == ToolChoice::Auto {
                let answer = json!({
                    "type": "object", "properties": {"response": {"type": "string"}},
                    "required": ["response"], "additionalProperties": false
                });
                json!({"anyOf": [call_env, answer]})
            } else {
                call_env
            };
            schema["x-guidance"] = ws;
            format!("start: %json {schema}\n")
        }
    };
    Some(Grammar::Lark { grammar: lark })
}

/// DeepSeek's call alternatives: `<begin>function<sep>NAME\n```json\n{...}\n```<end>`.
fn deepseek_calls(chosen: &[&Tool], ws: &Value, lit: &dyn Fn(&str) -> String) -> String {
    let calls: Vec<String> = chosen
        .iter()
        .map(|t| {
            let mut args = t.parameters.clone();
            if let Some(o) = args.as_object_mut() {
                o.insert("x-guidance".into(), ws.clone());
            }
            format!(
                "{} \"function\" {} {} \"\\n```json\\n\" %json {args} \"\\n```\" {}",
                lit(DS_CALL_BEGIN),
                lit(DS_SEP),
                serde_json::to_string(&t.name).expect("a string"),
                lit(DS_CALL_END)
            )
        })
        .collect();
    calls.join(" | ")
}

/// A tool call read from the model's output.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as JSON text (an object).
    pub arguments: String,
}

/// What the output turned out to be, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Text(String),
    /// A whole call, read once it was complete.
    Call(ParsedCall),
    /// A call streamed as it is written (see [`CallParser::streaming`]):
    /// its name, then its arguments' text in pieces, then its end.
    CallStart {
        name: String,
    },
    CallArgs(String),
    CallEnd,
}

/// Where a streamed call's arguments end: a JSON value scanned a byte at a
/// time (strings and escapes respected).
#[derive(Default)]
struct ArgScan {
    depth: u32,
    in_string: bool,
    escape: bool,
    done: bool,
}

impl ArgScan {
    /// Bytes of `s` that belong to the value (all of them unless it ends
    /// inside `s`).
    fn feed(&mut self, s: &str) -> usize {
        for (i, &c) in s.as_bytes().iter().enumerate() {
            if self.in_string {
                match (self.escape, c) {
                    (true, _) => self.escape = false,
                    (false, b'\\') => self.escape = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        self.done = true;
                        return i + 1;
                    }
                }
                _ => {}
            }
        }
        s.len()
    }
}

/// The start of a Hermes call body up to its arguments' value:
/// `{"name": "NAME", "arguments": `.
enum Head {
    /// What is there fits; more is needed.
    Need,
    /// It does not look like that (read the call whole instead).
    No,
    Yes {
        name: String,
        used: usize,
    },
}

fn hermes_head(s: &str) -> Head {
    let b = s.as_bytes();
    let mut i = 0;
    let ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    // Each literal in turn; running out of input part-way is `Need`.
    let lit = |i: &mut usize, l: &[u8]| -> Option<bool> {
        let n = l.len().min(b.len() - *i);
        if b[*i..*i + n] != l[..n] {
            return Some(false);
        }
        *i += n;
        (n == l.len()).then_some(true)
    };
    for step in [&b"{"[..], b"\"name\"", b":", b"\""] {
        ws(&mut i);
        match lit(&mut i, step) {
            Some(true) => {}
            Some(false) => return Head::No,
            None => return Head::Need,
        }
    }
    let Some(end) = s[i..].find('"') else {
        return Head::Need;
    };
    let name = &s[i..i + end];
    if name.contains('\\') || name.is_empty() {
        return Head::No;
    }
    i += end + 1;
    for step in [&b","[..], b"\"arguments\"", b":"] {
        ws(&mut i);
        match lit(&mut i, step) {
            Some(true) => {}
            Some(false) => return Head::No,
            None => return Head::Need,
        }
    }
    ws(&mut i);
    if i >= b.len() {
        return Head::Need;
    }
    Head::Yes {
        name: name.to_string(),
        used: i,
    }
}

/// Splits streamed output into text and tool calls. Text before a call's
/// opening marker goes out as soon as it cannot be the start of one; a call
/// is held until it is complete, then parsed (if it does not parse, its text
/// goes out as text).
pub struct CallParser {
    format: ToolFormat,
    /// Text not yet given out.
    buf: String,
    /// Inside a call (or, for the formats that answer in one document, the
    /// answer started like one): held until complete.
    holding: bool,
    /// Anything but whitespace has been given out.
    started: bool,
    /// What is held is the whole answer, which started like a call.
    whole: bool,
    /// Stream Hermes calls' arguments as they are written.
    stream: bool,
    /// The arguments of the call being streamed.
    args: Option<ArgScan>,
}

impl CallParser {
    pub fn new(format: ToolFormat) -> CallParser {
        CallParser {
            format,
            buf: String::new(),
            holding: false,
            started: false,
            whole: false,
            stream: false,
            args: None,
        }
    }

    /// A parser that gives out a Hermes call's name as soon as it is
    /// written and its arguments as they come ([`Piece::CallStart`],
    /// [`Piece::CallArgs`], [`Piece::CallEnd`]). Only for output a grammar
    /// holds to `{"name": ..., "arguments": ...}` from the call's first
    /// token (what is given out cannot be taken back).
    pub fn streaming(format: ToolFormat) -> CallParser {
        CallParser {
            stream: format == ToolFormat::Hermes,
            ..CallParser::new(format)
        }
    }

    /// The opening markers of this format.
    fn openers(&self) -> &'static [&'static str] {
        match self.format {
            ToolFormat::Hermes => &[HERMES_OPEN],
            ToolFormat::DeepSeek => &[DS_CALLS_BEGIN, DS_CALL_BEGIN],
            ToolFormat::Mistral => &[MISTRAL_CALLS],
            ToolFormat::Llama3 => &[PYTHON_TAG],
            ToolFormat::Generic => &[],
        }
    }

    /// Whether an answer that starts like a JSON document is held whole:
    /// the formats that answer in one document, and Hermes models, which
    /// (small ones especially) often leave out the `<tool_call>` tags and
    /// write the call's JSON alone, as llama.cpp's parser also accepts.
    fn whole_answer(&self) -> bool {
        matches!(
            self.format,
            ToolFormat::Llama3 | ToolFormat::Generic | ToolFormat::Hermes
        )
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.holding && self.stream && !self.whole {
                match self.stream_call(&mut out) {
                    Some(true) => {
                        self.holding = false;
                        continue;
                    }
                    Some(false) => break,
                    None => self.stream = false, // read it whole
                }
            }
            if self.holding {
                match self.take_call() {
                    Some(pieces) => {
                        out.extend(pieces);
                        self.holding = false;
                        continue;
                    }
                    None => break,
                }
            }
            if !self.started && self.whole_answer() {
                let t = self.buf.trim_start();
                if t.is_empty() {
                    break;
                }
                let fence = "```";
                let llama = self.format == ToolFormat::Llama3;
                if t.starts_with('{')
                    || llama && (t.starts_with(PYTHON_TAG) || PYTHON_TAG.starts_with(t))
                    || t.starts_with(fence)
                    || fence.starts_with(t)
                {
                    // Held to the end (`finish`).
                    self.holding = true;
                    self.whole = true;
                    break;
                }
                self.started = true;
            }
            // Give out text up to an opener, or up to where one could start.
            let found = self.openers().iter().filter_map(|o| self.buf.find(o)).min();
            match found {
                Some(at) => {
                    let text: String = self.buf.drain(..at).collect();
                    self.emit_text(text, &mut out);
                    self.holding = true;
                }
                None => {
                    let keep = self
                        .openers()
                        .iter()
                        .map(|o| partial_suffix(&self.buf, o))
                        .max()
                        .unwrap_or(0);
                    let cut = self.buf.len() - keep;
                    let text: String = self.buf.drain(..cut).collect();
                    self.emit_text(text, &mut out);
                    break;
                }
            }
        }
        out
    }

    /// The end of the output: what is held is parsed, or given out as text.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        if self.args.take().is_some() {
            // A streamed call cut off (or never closed): it ends here.
            self.holding = false;
            self.buf.clear();
            out.push(Piece::CallEnd);
        }
        if self.holding {
            self.holding = false;
            let held = std::mem::take(&mut self.buf);
            let parsed = if self.whole && self.format == ToolFormat::Hermes {
                bare_calls(&held).map(|c| (c.into_iter().map(Piece::Call).collect(), held.len()))
            } else {
                parse_held(self.format, &held, true)
            };
            match parsed {
                Some((pieces, _)) => out.extend(pieces),
                None => self.emit_text(held, &mut out),
            }
        }
        let rest = std::mem::take(&mut self.buf);
        self.emit_text(rest, &mut out);
        out
    }

    fn emit_text(&mut self, text: String, out: &mut Vec<Piece>) {
        if text.is_empty() {
            return;
        }
        if !text.trim().is_empty() {
            self.started = true;
        }
        match out.last_mut() {
            Some(Piece::Text(t)) => t.push_str(&text),
            _ => out.push(Piece::Text(text)),
        }
    }

    /// Streams the call at the start of the buffer: Some(true) when it
    /// ended, Some(false) when more is needed, None when it does not start
    /// as expected (nothing was given out).
    fn stream_call(&mut self, out: &mut Vec<Piece>) -> Option<bool> {
        if self.args.is_none() {
            let after = self.buf.strip_prefix(HERMES_OPEN)?;
            match hermes_head(after) {
                Head::Need => return Some(false),
                Head::No => return None,
                Head::Yes { name, used } => {
                    self.buf.drain(..HERMES_OPEN.len() + used);
                    out.push(Piece::CallStart { name });
                    self.args = Some(ArgScan::default());
                }
            }
        }
        let scan = self.args.as_mut().expect("set above");
        if !scan.done {
            let n = scan.feed(&self.buf);
            let frag: String = self.buf.drain(..n).collect();
            if !frag.is_empty() {
                out.push(Piece::CallArgs(frag));
            }
            if !scan.done {
                return Some(false);
            }
        }
        let Some(end) = self.buf.find(HERMES_CLOSE) else {
            return Some(false);
        };
        self.buf.drain(..end + HERMES_CLOSE.len());
        self.args = None;
        out.push(Piece::CallEnd);
        Some(true)
    }

    /// A complete call at the start of the buffer, taken out and parsed;
    /// None while it is incomplete.
    fn take_call(&mut self) -> Option<Vec<Piece>> {
        if self.whole || self.format != ToolFormat::Hermes && self.format != ToolFormat::DeepSeek {
            return None; // held to the end
        }
        let (pieces, used) = parse_held(self.format, &self.buf, false)?;
        self.buf.drain(..used);
        Some(pieces)
    }
}

/// The longest suffix of `s` that is a proper prefix of `marker`.
fn partial_suffix(s: &str, marker: &str) -> usize {
    (1..marker.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && marker.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

/// Parses held output that starts with a call: the pieces and the bytes
/// used, or None when it is incomplete (and `at_end` is false) or does not
/// parse (the caller gives it out as text).
fn parse_held(format: ToolFormat, held: &str, at_end: bool) -> Option<(Vec<Piece>, usize)> {
    match format {
        ToolFormat::Hermes => {
            let body_start = held.find(HERMES_OPEN)? + HERMES_OPEN.len();
            let (body, used) = match held[body_start..].find(HERMES_CLOSE) {
                Some(end) => (
                    &held[body_start..body_start + end],
                    body_start + end + HERMES_CLOSE.len(),
                ),
                None if at_end => (&held[body_start..], held.len()),
                None => return None,
            };
            let call = hermes_body(body.trim());
            match call {
                Some(c) => Some((vec![Piece::Call(c)], used)),
                None if at_end => None,
                None => Some((vec![Piece::Text(held[..used].to_string())], used)),
            }
        }
        ToolFormat::DeepSeek => {
            let end = match held.find(DS_CALLS_END) {
                Some(e) => e + DS_CALLS_END.len(),
                None if at_end => held.len(),
                None => return None,
            };
            let block = &held[..end];
            let mut calls = Vec::new();
            for part in block.split(DS_CALL_BEGIN).skip(1) {
                let part = part.split(DS_CALL_END).next()?;
                calls.push(Piece::Call(deepseek_call(part)?));
            }
            if calls.is_empty() {
                return if at_end {
                    None
                } else {
                    Some((vec![Piece::Text(block.to_string())], end))
                };
            }
            Some((calls, end))
        }
        ToolFormat::Mistral => {
            let rest = held.trim_start().strip_prefix(MISTRAL_CALLS)?;
            let calls = mistral_calls(rest)?;
            Some((calls.into_iter().map(Piece::Call).collect(), held.len()))
        }
        ToolFormat::Llama3 => {
            let t = held.trim();
            let t = t.strip_prefix(PYTHON_TAG).unwrap_or(t).trim();
            let calls = json_calls(t)?;
            Some((calls.into_iter().map(Piece::Call).collect(), held.len()))
        }
        ToolFormat::Generic => {
            let v: Value = serde_json::from_str(held.trim()).ok()?;
            if let Some(r) = v.get("response").and_then(Value::as_str) {
                return Some((vec![Piece::Text(r.to_string())], held.len()));
            }
            let list = match (v.get("tool_calls"), v.get("tool_call")) {
                (Some(Value::Array(l)), _) => l.clone(),
                (_, Some(one)) => vec![one.clone()],
                _ => return None,
            };
            let calls: Option<Vec<Piece>> = list
                .iter()
                .map(|c| call_from_json(c, &["arguments", "parameters"]).map(Piece::Call))
                .collect();
            Some((calls.filter(|c| !c.is_empty())?, held.len()))
        }
    }
}

/// A Hermes answer without tags: one call's JSON, an array of them, or
/// several on their own lines, optionally in a ```json fence.
fn bare_calls(text: &str) -> Option<Vec<ParsedCall>> {
    let t = text.trim();
    let t = match t.strip_prefix("```") {
        Some(rest) => {
            let rest = rest.strip_prefix("json").unwrap_or(rest);
            rest.trim_end().strip_suffix("```")?.trim()
        }
        None => t,
    };
    if let Some(calls) = json_calls(t) {
        return Some(calls);
    }
    let mut calls = Vec::new();
    for v in serde_json::Deserializer::from_str(t).into_iter::<Value>() {
        calls.push(call_from_json(&v.ok()?, &["arguments", "parameters"])?);
    }
    (!calls.is_empty()).then_some(calls)
}

/// `{"name": ..., "arguments": {...} or "..."}`, or Qwen3-Coder's XML form.
fn hermes_body(body: &str) -> Option<ParsedCall> {
    if let Some(rest) = body.strip_prefix("<function=") {
        return qwen_xml_call(rest);
    }
    let v: Value = serde_json::from_str(body).ok()?;
    call_from_json(&v, &["arguments", "parameters"])
}

/// `NAME>\n<parameter=P>\nVALUE\n</parameter>...</function>`.
fn qwen_xml_call(rest: &str) -> Option<ParsedCall> {
    let (name, mut rest) = rest.split_once('>')?;
    let mut args = serde_json::Map::new();
    while let Some(at) = rest.find("<parameter=") {
        let after = &rest[at + "<parameter=".len()..];
        let (key, after) = after.split_once('>')?;
        let (value, after) = after.split_once("</parameter>")?;
        let value = value.trim_matches('\n');
        let v = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_string()));
        args.insert(key.trim().to_string(), v);
        rest = after;
    }
    if !rest.contains("</function>") {
        return None;
    }
    Some(ParsedCall {
        name: name.trim().to_string(),
        arguments: Value::Object(args).to_string(),
    })
}

/// One DeepSeek call between its begin and end markers.
fn deepseek_call(part: &str) -> Option<ParsedCall> {
    let (head, args) = part.split_once(DS_SEP)?;
    let head = head.trim();
    // R1/V3: "function<sep>NAME\n```json\n{...}\n```"; V3.1: "NAME<sep>{...}".
    let (name, args) = if head == "function" || head.is_empty() {
        let (name, rest) = args.split_once('\n')?;
        let rest = rest.trim();
        let rest = rest
            .strip_prefix("```json")
            .or_else(|| rest.strip_prefix("```"))?;
        let rest = rest.trim_end().strip_suffix("```")?;
        (name.trim(), rest.trim())
    } else {
        (head, args.trim())
    };
    let v: Value = serde_json::from_str(args).ok()?;
    v.is_object().then(|| ParsedCall {
        name: name.to_string(),
        arguments: v.to_string(),
    })
}

/// After `[TOOL_CALLS]`: a JSON array of calls, or `NAME[ARGS]{...}` runs.
fn mistral_calls(rest: &str) -> Option<Vec<ParsedCall>> {
    let rest = rest.trim();
    if rest.starts_with('[') || rest.starts_with('{') {
        return json_calls(rest);
    }
    let mut calls = Vec::new();
    for part in rest.split(MISTRAL_CALLS) {
        let (name, args) = part.split_once(MISTRAL_ARGS)?;
        let v: Value = serde_json::from_str(args.trim()).ok()?;
        calls.push(ParsedCall {
            name: name.trim().to_string(),
            arguments: v.to_string(),
        });
    }
    (!calls.is_empty()).then_some(calls)
}

/// One call object, or an array of them, or several separated by `;`.
fn json_calls(text: &str) -> Option<Vec<ParsedCall>> {
    let keys = ["arguments", "parameters"];
    if let Ok(v) = serde_json::from_str::<Value>(text) {
        return match v {
            Value::Array(list) => {
                let calls: Option<Vec<_>> = list.iter().map(|c| call_from_json(c, &keys)).collect();
                calls.filter(|c| !c.is_empty())
            }
            one => call_from_json(&one, &keys).map(|c| vec![c]),
        };
    }
    let calls: Option<Vec<_>> = text
        .split(';')
        .map(|p| {
            serde_json::from_str::<Value>(p.trim())
                .ok()
                .and_then(|v| call_from_json(&v, &keys))
        })
        .collect();
    calls.filter(|c| c.len() > 1)
}

/// `{"name": ..., KEY: {...}}` where KEY is one of `keys`; arguments given
/// as a JSON string are read as the object they hold.
fn call_from_json(v: &Value, keys: &[&str]) -> Option<ParsedCall> {
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?.to_string();
    let args = keys
        .iter()
        .find_map(|k| o.get(*k))
        .cloned()
        .unwrap_or(json!({}));
    let args = match args {
        Value::String(s) => serde_json::from_str::<Value>(&s).ok()?,
        other => other,
    };
    args.is_object().then(|| ParsedCall {
        name,
        arguments: args.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `out` in pieces of `step` bytes (at char boundaries) and
    /// collects what comes out, merging adjacent text.
    fn parse(format: ToolFormat, out: &str, step: usize) -> Vec<Piece> {
        let mut p = CallParser::new(format);
        let mut got = Vec::new();
        let mut rest = out;
        while !rest.is_empty() {
            let mut n = step.min(rest.len());
            while !rest.is_char_boundary(n) {
                n += 1;
            }
            got.extend(p.push(&rest[..n]));
            rest = &rest[n..];
        }
        got.extend(p.finish());
        let mut merged: Vec<Piece> = Vec::new();
        for g in got {
            match (merged.last_mut(), g) {
                (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                (_, g) => merged.push(g),
            }
        }
        merged
    }

    fn call(name: &str, args: Value) -> Piece {
        Piece::Call(ParsedCall {
            name: name.into(),
            arguments: args.to_string(),
        })
    }

    fn text(t: &str) -> Piece {
        Piece::Text(t.into())
    }

    #[test]
    fn hermes_calls_with_text_around_them_in_any_chunking() {
        let out = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": \\\"CET\\\"}\"}\n</tool_call>";
        for step in [1, 2, 3, 7, 1000] {
            assert_eq!(
                parse(ToolFormat::Hermes, out, step),
                vec![
                    text("Let me check.\n"),
                    call("get_weather", json!({"city": "Paris"})),
                    text("\n"),
                    call("get_time", json!({"tz": "CET"})),
                ],
                "step {step}"
            );
        }
        // A call first, fed a byte at a time.
        let first = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        assert_eq!(
            parse(ToolFormat::Hermes, first, 1),
            vec![call("f", json!({}))]
        );
        // Text that only looks like the start of a marker goes out.
        assert_eq!(
            parse(ToolFormat::Hermes, "a <b> <tool", 1),
            vec![text("a <b> <tool")]
        );
    }

    #[test]
    fn hermes_calls_without_tags_as_small_models_write_them() {
        let bare = "{\"name\": \"get_time\", \"arguments\": {\"timezone\": \"Europe/Berlin\"}}";
        assert_eq!(
            parse(ToolFormat::Hermes, bare, 3),
            vec![call("get_time", json!({"timezone": "Europe/Berlin"}))]
        );
        let fenced = format!("```json\n{bare}\n{bare}\n```");
        assert_eq!(parse(ToolFormat::Hermes, &fenced, 5).len(), 2);
        // JSON that is not a call, or a call and then prose, is text.
        let echo = format!("{bare}\nThe weather is fine.");
        assert_eq!(parse(ToolFormat::Hermes, &echo, 4), vec![text(&echo)]);
        assert_eq!(
            parse(ToolFormat::Hermes, "{\"a\": 1}", 4),
            vec![text("{\"a\": 1}")]
        );
        // Prose first: a later brace is only text.
        assert_eq!(
            parse(ToolFormat::Hermes, "Here: {\"name\": \"f\"}", 4),
            vec![text("Here: {\"name\": \"f\"}")]
        );
    }

    #[test]
    fn constrained_hermes_calls_stream_their_arguments() {
        let out = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa}ris\", \"n\": [1, {\"x\": \"\\\"\"}]}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        for step in [1, 3, 1000] {
            let mut p = CallParser::streaming(ToolFormat::Hermes);
            let mut got = Vec::new();
            let mut rest = out;
            while !rest.is_empty() {
                let n = step.min(rest.len());
                got.extend(p.push(&rest[..n]));
                rest = &rest[n..];
            }
            got.extend(p.finish());
            // Name first, then argument pieces that add up to the JSON.
            let mut calls: Vec<(String, String)> = Vec::new();
            let mut open = false;
            for g in &got {
                match g {
                    Piece::CallStart { name } => {
                        assert!(!open);
                        open = true;
                        calls.push((name.clone(), String::new()));
                    }
                    Piece::CallArgs(a) => calls.last_mut().unwrap().1.push_str(a),
                    Piece::CallEnd => open = false,
                    Piece::Text(t) => assert!(t.trim().is_empty(), "{t:?}"),
                    Piece::Call(c) => panic!("read whole: {c:?}"),
                }
            }
            assert!(!open);
            assert_eq!(calls.len(), 2, "step {step}: {got:?}");
            assert_eq!(calls[0].0, "get_weather");
            let v: Value = serde_json::from_str(&calls[0].1).unwrap();
            assert_eq!(v, json!({"city": "Pa}ris", "n": [1, {"x": "\""}]}));
            assert_eq!((calls[1].0.as_str(), calls[1].1.as_str()), ("f", "{}"));
            if step == 1 {
                assert!(
                    got.iter()
                        .filter(|g| matches!(g, Piece::CallArgs(_)))
                        .count()
                        > 10
                );
            }
        }
        // Something else inside the tags is read whole.
        let mut p = CallParser::streaming(ToolFormat::Hermes);
        let mut got = p.push("<tool_call>\n{\"arguments\": {}, \"name\": \"f\"}\n</tool_call>");
        got.extend(p.finish());
        assert_eq!(got, vec![call("f", json!({}))]);
    }

    #[test]
    fn qwen3_coder_xml_calls() {
        let out = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
        assert_eq!(
            parse(ToolFormat::Hermes, out, 5),
            vec![call("get_weather", json!({"city": "Paris", "days": 3}))]
        );
    }

    #[test]
    fn malformed_calls_come_back_as_text() {
        let bad = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": }\n</tool_call>";
        assert_eq!(parse(ToolFormat::Hermes, bad, 3), vec![text(bad)]);
        // Cut off by the token limit.
        let cut = "ok <tool_call>\n{\"name\": \"f\", \"argu";
        assert_eq!(parse(ToolFormat::Hermes, cut, 4), vec![text(cut)]);
        // An unclosed but complete call at the end still counts.
        let unclosed = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n";
        assert_eq!(
            parse(ToolFormat::Hermes, unclosed, 4),
            vec![call("f", json!({}))]
        );
        assert_eq!(
            parse(ToolFormat::Llama3, "{\"oops\": 1}", 2),
            vec![text("{\"oops\": 1}")]
        );
        let ds = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{bad\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert_eq!(parse(ToolFormat::DeepSeek, ds, 3), vec![text(ds)]);
        assert_eq!(
            parse(ToolFormat::Mistral, "[TOOL_CALLS] nope", 3),
            vec![text("[TOOL_CALLS] nope")]
        );
        assert_eq!(
            parse(ToolFormat::Generic, "{\"x\": 1}", 3),
            vec![text("{\"x\": 1}")]
        );
    }

    #[test]
    fn deepseek_r1_and_v3_1_calls() {
        let r1 = "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert_eq!(
            parse(ToolFormat::DeepSeek, r1, 4),
            vec![
                text("Sure."),
                call("get_weather", json!({"city": "Paris"})),
                call("get_time", json!({})),
            ]
        );
        let v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert_eq!(
            parse(ToolFormat::DeepSeek, v31, 1),
            vec![call("get_weather", json!({"city": "Oslo"}))]
        );
    }

    #[test]
    fn llama3_mistral_and_generic_answers() {
        assert_eq!(
            parse(
                ToolFormat::Llama3,
                " {\"name\": \"f\", \"parameters\": {\"a\": 1}}",
                3
            ),
            vec![call("f", json!({"a": 1}))]
        );
        assert_eq!(
            parse(
                ToolFormat::Llama3,
                "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}",
                2
            ),
            vec![call("f", json!({}))]
        );
        assert_eq!(
            parse(ToolFormat::Llama3, "Hello {there}", 2),
            vec![text("Hello {there}")]
        );
        assert_eq!(
            parse(
                ToolFormat::Mistral,
                "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"name\": \"g\", \"arguments\": {}}]",
                5
            ),
            vec![call("f", json!({"a": 1})), call("g", json!({}))]
        );
        assert_eq!(
            parse(ToolFormat::Mistral, "[TOOL_CALLS]f[ARGS]{\"a\": 1}", 3),
            vec![call("f", json!({"a": 1}))]
        );
        assert_eq!(
            parse(
                ToolFormat::Generic,
                "{\"tool_calls\": [{\"name\": \"f\", \"arguments\": {\"a\": 1}}]}",
                3
            ),
            vec![call("f", json!({"a": 1}))]
        );
        assert_eq!(
            parse(ToolFormat::Generic, "{\"response\": \"Hi!\"}", 3),
            vec![text("Hi!")]
        );
    }

    #[test]
    fn formats_are_told_apart_by_their_templates() {
        assert_eq!(
            ToolFormat::detect("{{ '<tool_call>\\n' }}"),
            ToolFormat::Hermes
        );
        assert_eq!(
            ToolFormat::detect("{{'<｜tool▁calls▁begin｜>'}}"),
            ToolFormat::DeepSeek
        );
        assert_eq!(ToolFormat::detect("[TOOL_CALLS]"), ToolFormat::Mistral);
        assert_eq!(
            ToolFormat::detect("<|start_header_id|>{% if tools %}"),
            ToolFormat::Llama3
        );
        assert_eq!(ToolFormat::detect("<start_of_turn>"), ToolFormat::Generic);
    }

    #[test]
    fn tools_are_read_and_bad_ones_named() {
        let ok = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
        assert_eq!(parse_tools(&ok).unwrap()[0].name, "f");
        for (bad, says) in [
            (json!({}), "must be an array"),
            (json!([{"type": "code_interpreter"}]), "tools[0].type"),
            (json!([{"type": "function"}]), "no `function`"),
            (json!([{"type": "function", "function": {}}]), "no `name`"),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]),
                "parameters",
            ),
            (
                json!([{"function": {"name": "f"}}, {"function": {"name": "f"}}]),
                "given twice",
            ),
        ] {
            let e = parse_tools(&bad).unwrap_err();
            assert!(e.message.contains(says), "{bad}: {e}");
            assert!(e.field.starts_with("tools"), "{bad}: {}", e.field);
        }
    }

    #[test]
    fn grammars_for_required_and_named_choices() {
        let tools = parse_tools(&json!([
            {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "b"}},
        ]))
        .unwrap();
        let none = |_: &str| None;
        // Auto: free until the opening marker, when it is one token.
        assert!(call_grammar(ToolFormat::Hermes, &tools, &ToolChoice::Auto, true, &none).is_none());
        let Some(Grammar::Triggered { token: 9, grammar }) =
            call_grammar(ToolFormat::Hermes, &tools, &ToolChoice::Auto, true, &|m| {
                (m == "<tool_call>").then_some((9, true))
            })
        else {
            panic!("a triggered grammar")
        };
        let Grammar::Lark { grammar } = *grammar else {
            panic!("lark")
        };
        assert!(
            grammar.starts_with("start: body (\"\\n\"? <[9]> body)*"),
            "{grammar}"
        );
        assert!(call_grammar(ToolFormat::Hermes, &tools, &ToolChoice::None, true, &none).is_none());
        let Some(Grammar::Lark { grammar }) = call_grammar(
            ToolFormat::Hermes,
            &tools,
            &ToolChoice::Function("b".into()),
            false,
            &|m| (m == "<tool_call>").then_some((7, true)),
        ) else {
            panic!("a grammar")
        };
        assert!(grammar.starts_with("start: call\n"), "{grammar}");
        assert!(
            grammar.contains("<[7]>") && grammar.contains("\"</tool_call>\""),
            "{grammar}"
        );
        assert!(grammar.contains("\"const\":\"b\"") && !grammar.contains("\"const\":\"a\""));
        // The generic format always answers in its envelope.
        assert!(
            call_grammar(ToolFormat::Generic, &tools, &ToolChoice::Auto, true, &none).is_some()
        );
    }
}
