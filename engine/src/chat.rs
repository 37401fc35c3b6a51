//! Chat-template rendering: turns a conversation into the prompt text a model was trained on.
//!
//! Models ship a Jinja template (`tokenizer.chat_template` in GGUF). HuggingFace transformers
//! renders it with jinja2 (`trim_blocks`, `lstrip_blocks`, `raise_exception`, `strftime_now`,
//! a plain-JSON `tojson`); this module reproduces that with minijinja so that prompts match the
//! reference byte for byte. [`ChatTemplate::chatml`] is the fallback for models without a template.

use minijinja::value::{Enumerator, Kwargs, Object, Value, ValueKind};
use minijinja::{context, Environment, Error, ErrorKind, Output, State};
use serde::{Deserialize, Serialize};
use std::io;
use std::sync::Arc;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant's tool calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The tool's (or participant's) name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message of text alone.
    pub fn text(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..ChatMessage::default()
        }
    }
}

/// One tool call of an assistant message, as templates see it
/// (`{"id", "type": "function", "function": {"name", "arguments"}}` with the
/// arguments an object, as transformers passes them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: serde_json::Value,
}

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("chat template error: invalid template: {0}")]
    Syntax(String),
    #[error("chat template error: {0}")]
    Render(String),
}

const NAME: &str = "chat_template";

const CHATML: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// A compiled chat template plus the special-token strings it may reference.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source` with the settings transformers uses; a syntax error is an `Err`.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        // Templates are written against Python: `.strip()`, `.startswith()`, `.items()`, ...
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_owned())
            .map_err(|e| ChatError::Syntax(describe(&e)))?;
        Ok(Self {
            env,
            source: source.to_owned(),
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// The template's text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// ChatML (`<|im_start|>role\ncontent<|im_end|>\n`), for models that ship no template.
    pub fn chatml() -> Self {
        Self::new(CHATML, "", "<|im_end|>").expect("the built-in ChatML template compiles")
    }

    /// Renders the conversation with the variables transformers' `apply_chat_template` passes.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// The same with `tools`: OpenAI's array of `{"type": "function",
    /// "function": {...}}`, which is what transformers passes too.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let messages: Vec<Value> = messages.iter().cloned().map(Value::from_object).collect();
        let tools = tools.map_or(Value::from(()), Value::from_serialize);
        let ctx = context! {
            messages,
            add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
            tools,
            documents => (),
        };
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| ChatError::Render(describe(&e)))?;
        template
            .render(ctx)
            .map_err(|e| ChatError::Render(describe(&e)))
    }
}

/// "kind: detail (line N)", without minijinja's internal template name.
fn describe(err: &Error) -> String {
    let mut msg = match err.detail() {
        Some(detail) => format!("{}: {detail}", err.kind()),
        None => err.kind().to_string(),
    };
    if let Some(line) = err.line() {
        msg += &format!(" (line {line})");
    }
    msg
}

/// Messages are passed as objects rather than serialized maps: minijinja's own maps (without the
/// `preserve_order` feature) sort their keys, while Python dicts keep `role` before `content`,
/// which shows in `message | tojson` and `message.items()`.
impl Object for ChatMessage {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        match key.as_str()? {
            "role" => Some(Value::from(self.role.as_str())),
            "content" => Some(Value::from(self.content.as_str())),
            "tool_calls" if !self.tool_calls.is_empty() => Some(Value::from(
                self.tool_calls
                    .iter()
                    .map(|c| {
                        Value::from_serialize(serde_json::json!({
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                        }))
                    })
                    .collect::<Vec<_>>(),
            )),
            "tool_call_id" => self.tool_call_id.as_deref().map(Value::from),
            "name" => self.name.as_deref().map(Value::from),
            _ => None,
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        let mut keys = vec!["role", "content"];
        if !self.tool_calls.is_empty() {
            keys.push("tool_calls");
        }
        if self.tool_call_id.is_some() {
            keys.push("tool_call_id");
        }
        if self.name.is_some() {
            keys.push("name");
        }
        Enumerator::Values(keys.into_iter().map(Value::from).collect())
    }
}

/// jinja2 prints Python's `str()`: `True`, `False`, `None` where minijinja prints `true`, ...
fn python_formatter(out: &mut Output, state: &State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Bool => Ok(out.write_str(if value.is_true() { "True" } else { "False" })?),
        ValueKind::None => Ok(out.write_str("None")?),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `tojson` is `json.dumps(x, ensure_ascii=False, indent=..., separators=...)`:
/// unlike minijinja's built-in it does not HTML-escape `<>&'`, and it puts a space after `,` and
/// `:` (after `:` only, once indenting). `sort_keys`/`ensure_ascii` are accepted and ignored.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    // Python accepts an indent string or a number of spaces; None means one line.
    let indent = indent.filter(|v| !v.is_none()).map(|v| match v.as_str() {
        Some(s) => s.to_owned(),
        None => " ".repeat(v.as_i64().unwrap_or(0).max(0) as usize),
    });
    let (item_sep, key_sep) = match kwargs.get::<Option<Vec<String>>>("separators")?.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "separators must be (item, key)",
            ))
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    kwargs.get::<Option<Value>>("sort_keys")?;
    kwargs.get::<Option<Value>>("ensure_ascii")?;
    kwargs.assert_all_used()?;

    let mut out = Vec::new();
    let formatter = PyJson {
        indent: indent.as_deref(),
        item_sep: &item_sep,
        key_sep: &key_sep,
        depth: 0,
        has_value: false,
    };
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    value.serialize(&mut ser).map_err(|e| {
        Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON").with_source(e)
    })?;
    let json = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(json))
}

/// serde_json formatter laid out the way Python's `json.dumps` is.
struct PyJson<'a> {
    indent: Option<&'a str>,
    item_sep: &'a str,
    key_sep: &'a str,
    depth: usize,
    has_value: bool,
}

impl PyJson<'_> {
    fn newline<W: ?Sized + io::Write>(&self, w: &mut W) -> io::Result<()> {
        if let Some(indent) = self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.depth {
                w.write_all(indent.as_bytes())?;
            }
        }
        Ok(())
    }

    fn open<W: ?Sized + io::Write>(&mut self, w: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        w.write_all(bracket)
    }

    fn close<W: ?Sized + io::Write>(&mut self, w: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth -= 1;
        // Python writes empty containers as `[]` / `{}` even when indenting.
        if self.has_value {
            self.newline(w)?;
        }
        w.write_all(bracket)
    }

    fn item<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(self.item_sep.as_bytes())?;
        }
        self.newline(w)
    }
}

impl serde_json::ser::Formatter for PyJson<'_> {
    fn begin_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.item(w, first)
    }
    fn end_array_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.item(w, first)
    }
    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(self.key_sep.as_bytes())
    }
    fn end_object_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

/// Python's `datetime.now().strftime(fmt)` in UTC, for templates that print today's date.
fn strftime_now(format: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format_utc(format, now.as_secs() as i64)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// strftime for %Y %y %m %d %B %b %A %a %H %M %S %j %%; other directives are copied as they are.
fn format_utc(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let weekday = WEEKDAYS[(days + 3).rem_euclid(7) as usize]; // 1970-01-01 was a Thursday
    let month_name = MONTHS[month as usize - 1];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year.rem_euclid(100)),
            Some('m') => out += &format!("{month:02}"),
            Some('d') => out += &format!("{day:02}"),
            Some('j') => out += &format!("{day_of_year:03}"),
            Some('B') => out += month_name,
            Some('b') => out += &month_name[..3],
            Some('A') => out += weekday,
            Some('a') => out += &weekday[..3],
            Some('H') => out += &format!("{:02}", secs / 3600),
            Some('M') => out += &format!("{:02}", secs / 60 % 60),
            Some('S') => out += &format!("{:02}", secs % 60),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 -> (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// (year, month, day) -> days since 1970-01-01; the inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::format_utc;

    #[test]
    fn formats_known_instants() {
        // 2024-02-29T13:05:09Z (a leap day, Thursday), checked with Python's datetime.
        let t = 1_709_211_909;
        assert_eq!(format_utc("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(
            format_utc("%A %a %B %b %j %y %% %Q", t),
            "Thursday Thu February Feb 060 24 % %Q"
        );
        assert_eq!(format_utc("%d %b %Y", 0), "01 Jan 1970");
        assert_eq!(format_utc("%Y-%m-%d %A", -1), "1969-12-31 Wednesday");
        assert_eq!(format_utc("%Y-%m-%d %j", 951_782_400), "2000-02-29 060");
    }
}
