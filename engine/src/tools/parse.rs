//! Reading calls out of a model's output as it streams: text, and calls that parse.

use super::ToolFormat;
use super::DS_CALLS_BEGIN;
use super::DS_CALLS_END;
use super::DS_CALL_BEGIN;
use super::DS_CALL_END;
use super::DS_SEP;
use super::HERMES_CLOSE;
use super::HERMES_OPEN;
use super::MISTRAL_ARGS;
use super::MISTRAL_CALLS;
use super::PYTHON_TAG;
use serde_json::json;
use serde_json::Value;

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
pub(super) struct ArgScan {
    pub(super) depth: u32,
    pub(super) in_string: bool,
    pub(super) escape: bool,
    pub(super) done: bool,
}

impl ArgScan {
    /// Bytes of `s` that belong to the value (all of them unless it ends
    /// inside `s`).
    pub(super) fn feed(&mut self, s: &str) -> usize {
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
pub(super) enum Head {
    /// What is there fits; more is needed.
    Need,
    /// It does not look like that (read the call whole instead).
    No,
    Yes {
        name: String,
        used: usize,
    },
}

pub(super) fn hermes_head(s: &str) -> Head {
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
    pub(super) fn openers(&self) -> &'static [&'static str] {
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
    pub(super) fn whole_answer(&self) -> bool {
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

    pub(super) fn emit_text(&mut self, text: String, out: &mut Vec<Piece>) {
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
    pub(super) fn stream_call(&mut self, out: &mut Vec<Piece>) -> Option<bool> {
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
    pub(super) fn take_call(&mut self) -> Option<Vec<Piece>> {
        if self.whole || self.format != ToolFormat::Hermes && self.format != ToolFormat::DeepSeek {
            return None; // held to the end
        }
        let (pieces, used) = parse_held(self.format, &self.buf, false)?;
        self.buf.drain(..used);
        Some(pieces)
    }
}

/// The longest suffix of `s` that is a proper prefix of `marker`.
pub(super) fn partial_suffix(s: &str, marker: &str) -> usize {
    (1..marker.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && marker.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

/// Parses held output that starts with a call: the pieces and the bytes
/// used, or None when it is incomplete (and `at_end` is false) or does not
/// parse (the caller gives it out as text).
pub(super) fn parse_held(
    format: ToolFormat,
    held: &str,
    at_end: bool,
) -> Option<(Vec<Piece>, usize)> {
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
pub(super) fn bare_calls(text: &str) -> Option<Vec<ParsedCall>> {
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
pub(super) fn hermes_body(body: &str) -> Option<ParsedCall> {
    if let Some(rest) = body.strip_prefix("<function=") {
        return qwen_xml_call(rest);
    }
    let v: Value = serde_json::from_str(body).ok()?;
    call_from_json(&v, &["arguments", "parameters"])
}

/// `NAME>\n<parameter=P>\nVALUE\n</parameter>...</function>`.
pub(super) fn qwen_xml_call(rest: &str) -> Option<ParsedCall> {
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
pub(super) fn deepseek_call(part: &str) -> Option<ParsedCall> {
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
pub(super) fn mistral_calls(rest: &str) -> Option<Vec<ParsedCall>> {
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
pub(super) fn json_calls(text: &str) -> Option<Vec<ParsedCall>> {
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
pub(super) fn call_from_json(v: &Value, keys: &[&str]) -> Option<ParsedCall> {
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
