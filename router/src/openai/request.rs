//! The request types, parsing a body (naming the field at fault) and the checks both
//! endpoints share ([`Common`]).

use super::error::ApiError;
use super::grammar::json_schema;
use super::grammar::lark;
use super::grammar::response_format;
use super::MAX_DRAFT;
use super::MAX_N;
use super::MAX_STOP;
use omni_proto::coordinator::v1::Speculative;
use omni_proto::worker::v1::Grammar;
use omni_proto::worker::v1::LogitBias;
use omni_proto::worker::v1::Sampling;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Number;
use serde_json::Value;
use std::collections::BTreeMap;

/// Parses a request body, naming the field at fault when the JSON has the wrong shape
/// ("temperature: invalid type: string \"hot\", expected f64").
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(
            "the request body is empty; send a JSON object",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let inner = e.inner();
        if !inner.is_data() {
            return ApiError::bad_request(format!("the request body is not valid JSON: {inner}"));
        }
        let path = e.path().to_string();
        let text = inner.to_string();
        // A missing field is reported at its parent; name the field itself.
        let missing = text
            .strip_prefix("missing field `")
            .and_then(|r| r.split('`').next());
        let param = match (missing, path.as_str()) {
            (Some(f), ".") => f.to_string(),
            (Some(f), p) => format!("{p}.{f}"),
            (None, p) => p.to_string(),
        };
        if param == "." {
            ApiError::bad_request(format!("the request body has the wrong shape: {text}"))
        } else {
            ApiError::invalid(param.clone(), format!("{param}: {text}"))
        }
    })?;
    de.end()
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    Ok(value)
}

// ---------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------

/// The value of a JSON number that is an integer in JSON Schema's sense (OpenAI's spec types
/// `n`, `max_tokens`, `seed`, token ids... as `integer`): no fractional part, so `5.0` is 5.
pub(super) fn integral(n: &Number) -> Option<i64> {
    const LIMIT: f64 = 9_223_372_036_854_775_808.0; // 2^63
    n.as_i64().or_else(|| {
        n.as_f64()
            .filter(|f| f.fract() == 0.0 && (-LIMIT..LIMIT).contains(f))
            .map(|f| f as i64)
    })
}

/// `deserialize_with` for an optional integer field: see [`integral`].
pub(super) fn integer<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    match Option::<Number>::deserialize(d)? {
        None => Ok(None),
        Some(n) => integral(&n).map(Some).ok_or_else(|| {
            serde::de::Error::custom(format_args!(
                "invalid value: {n}, expected an integer from {} to {}",
                i64::MIN,
                i64::MAX
            ))
        }),
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// One message of a chat request. `content` is a string, an array of content parts, or
/// null (an assistant message); it stays JSON so validation can say which part is wrong.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageParam {
    pub role: String,
    pub content: Option<Value>,
    pub name: Option<String>,
    pub tool_calls: Option<Value>,
    pub function_call: Option<Value>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<ChatMessageParam>,
    #[serde(default, deserialize_with = "integer")]
    pub max_tokens: Option<i64>,
    #[serde(default, deserialize_with = "integer")]
    pub max_completion_tokens: Option<i64>,
    /// A string or an array of up to [`MAX_STOP`] strings.
    pub stop: Option<Value>,
    #[serde(default, deserialize_with = "integer")]
    pub n: Option<i64>,
    pub seed: Option<Number>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    /// Token id (as a string) to a bias in -100..=100.
    pub logit_bias: Option<BTreeMap<String, f64>>,
    pub logprobs: Option<bool>,
    #[serde(default, deserialize_with = "integer")]
    pub top_logprobs: Option<i64>,
    pub user: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    #[serde(default, deserialize_with = "integer")]
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repeat_penalty: Option<f64>,
    pub ignore_eos: Option<bool>,
    /// llama-server's: false keeps this prompt out of the prefix cache
    /// (it neither starts from cached blocks nor leaves any).
    pub cache_prompt: Option<bool>,
    /// Ours: true asks for batch-invariant decoding (the same tokens
    /// whatever else runs), on a cluster started with `--deterministic`.
    pub deterministic: Option<bool>,
    /// llama-server's speculative decoding settings: most draft tokens a
    /// step verifies (0: none) and the shortest draft worth verifying.
    #[serde(rename = "speculative.n_max", default, deserialize_with = "integer")]
    pub speculative_n_max: Option<i64>,
    #[serde(rename = "speculative.n_min", default, deserialize_with = "integer")]
    pub speculative_n_min: Option<i64>,
    /// With a draft model: its guesses stop at one it gives less probability.
    #[serde(rename = "speculative.p_min")]
    pub speculative_p_min: Option<f64>,
    /// `[{"type": "function", "function": {"name", "description", "parameters"}}]`.
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    // OpenAI's deprecated forms of tools and tool_choice: refused, naming them.
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    /// `{"type": "text" | "json_object" | "json_schema", ...}`.
    pub response_format: Option<Value>,
    /// llama.cpp's extensions: a JSON schema, or a grammar (Lark syntax).
    pub json_schema: Option<Value>,
    pub grammar: Option<Value>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    /// A string, an array of one string, an array of token ids, or an array of one array of
    /// token ids.
    pub prompt: Option<Value>,
    /// Absent or null: [`COMPLETION_DEFAULT_MAX_TOKENS`], as OpenAI.
    #[serde(default, deserialize_with = "integer")]
    pub max_tokens: Option<i64>,
    pub stop: Option<Value>,
    #[serde(default, deserialize_with = "integer")]
    pub n: Option<i64>,
    pub seed: Option<Number>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// How many alternatives to report per token, 0..=5.
    #[serde(default, deserialize_with = "integer")]
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    #[serde(default, deserialize_with = "integer")]
    pub best_of: Option<i64>,
    pub user: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    #[serde(default, deserialize_with = "integer")]
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repeat_penalty: Option<f64>,
    pub ignore_eos: Option<bool>,
    /// llama-server's: false keeps this prompt out of the prefix cache
    /// (it neither starts from cached blocks nor leaves any).
    pub cache_prompt: Option<bool>,
    /// Ours: true asks for batch-invariant decoding (the same tokens
    /// whatever else runs), on a cluster started with `--deterministic`.
    pub deterministic: Option<bool>,
    /// llama-server's speculative decoding settings: most draft tokens a
    /// step verifies (0: none) and the shortest draft worth verifying.
    #[serde(rename = "speculative.n_max", default, deserialize_with = "integer")]
    pub speculative_n_max: Option<i64>,
    #[serde(rename = "speculative.n_min", default, deserialize_with = "integer")]
    pub speculative_n_min: Option<i64>,
    /// With a draft model: its guesses stop at one it gives less probability.
    #[serde(rename = "speculative.p_min")]
    pub speculative_p_min: Option<f64>,
    /// As for chat (llama.cpp's server takes it on completions too).
    pub response_format: Option<Value>,
    /// llama.cpp's extensions: a JSON schema, or a grammar (Lark syntax).
    pub json_schema: Option<Value>,
    pub grammar: Option<Value>,
}

/// The fields both endpoints share, validated and converted in one place.
pub(super) struct Common<'a> {
    pub(super) n: Option<i64>,
    pub(super) seed: Option<&'a Number>,
    pub(super) temperature: Option<f64>,
    pub(super) top_p: Option<f64>,
    pub(super) presence_penalty: Option<f64>,
    pub(super) frequency_penalty: Option<f64>,
    pub(super) logit_bias: Option<&'a BTreeMap<String, f64>>,
    pub(super) stop: Option<&'a Value>,
    pub(super) top_k: Option<i64>,
    pub(super) min_p: Option<f64>,
    pub(super) repeat_penalty: Option<f64>,
    pub(super) response_format: Option<&'a Value>,
    pub(super) json_schema: Option<&'a Value>,
    pub(super) grammar: Option<&'a Value>,
    pub(super) speculative_n_max: Option<i64>,
    pub(super) speculative_n_min: Option<i64>,
    pub(super) speculative_p_min: Option<f64>,
}

pub(super) fn check_between(param: &str, v: Option<f64>, lo: f64, hi: f64) -> Result<(), ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::out_of_range(
            param,
            x,
            format!("between {lo} and {hi}"),
        )),
        _ => Ok(()),
    }
}

pub(super) fn check_n(n: Option<i64>) -> Result<u32, ApiError> {
    match n {
        None => Ok(1),
        Some(n) if (1..=MAX_N as i64).contains(&n) => Ok(n as u32),
        Some(n) => Err(ApiError::out_of_range(
            "n",
            n,
            format!("between 1 and {MAX_N}"),
        )),
    }
}

/// `None` when absent; the limit clamped to u32 (the coordinator clamps to the context).
pub(super) fn check_max_tokens(param: &str, v: Option<i64>) -> Result<Option<u32>, ApiError> {
    match v {
        None => Ok(None),
        Some(m) if m < 1 => Err(ApiError::out_of_range(param, m, "at least 1")),
        Some(m) => Ok(Some(m.min(u32::MAX as i64) as u32)),
    }
}

pub(super) fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl Common<'_> {
    pub(super) fn validate(&self) -> Result<(), ApiError> {
        check_n(self.n)?;
        check_between("temperature", self.temperature, 0.0, 2.0)?;
        check_between("top_p", self.top_p, 0.0, 1.0)?;
        check_between("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        check_between("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        check_between("min_p", self.min_p, 0.0, 1.0)?;
        if let Some(r) = self.repeat_penalty {
            if r <= 0.0 {
                return Err(ApiError::out_of_range(
                    "repeat_penalty",
                    r,
                    "greater than 0 (1 is off)",
                ));
            }
        }
        self.seed()?;
        self.logit_bias()?;
        self.stop()?;
        self.grammar()?;
        Ok(())
    }

    /// What the output is constrained to: `response_format`, or llama.cpp's
    /// `json_schema` / `grammar` (one of them). The schema or grammar itself
    /// is compiled by the coordinator, which names what is wrong with it.
    pub(super) fn grammar(&self) -> Result<Option<Grammar>, ApiError> {
        let fields = [
            ("response_format", constraining(self.response_format)),
            ("json_schema", constraining(self.json_schema)),
            ("grammar", constraining(self.grammar)),
        ];
        let given: Vec<&str> = fields
            .iter()
            .filter(|(_, v)| v.is_some())
            .map(|(name, _)| *name)
            .collect();
        if given.len() > 1 {
            return Err(ApiError::invalid(
                given[1],
                format!(
                    "{} and {} both constrain the output; give one of them",
                    given[0], given[1]
                ),
            ));
        }
        let kind = match fields.map(|(_, v)| v) {
            [Some(rf), _, _] => response_format(rf)?,
            [_, Some(schema), _] => Some(json_schema(schema, "json_schema")?),
            [_, _, Some(g)] => Some(lark(g)?),
            // A `response_format` of `{"type": "text"}` (or null) is still
            // checked: a bad one is named.
            _ => match self.response_format.filter(|v| !v.is_null()) {
                Some(rf) => response_format(rf)?,
                None => None,
            },
        };
        Ok(kind.map(|k| Grammar { kind: Some(k) }))
    }

    pub(super) fn seed(&self) -> Result<Option<u64>, ApiError> {
        let Some(n) = self.seed else { return Ok(None) };
        // OpenAI's seed is an int64; negative seeds keep their bits.
        n.as_u64()
            .or_else(|| integral(n).map(|i| i as u64))
            .map(Some)
            .ok_or_else(|| ApiError::out_of_range("seed", n, "an integer"))
    }

    pub(super) fn logit_bias(&self) -> Result<Vec<LogitBias>, ApiError> {
        let Some(map) = self.logit_bias else {
            return Ok(Vec::new());
        };
        let mut out = Vec::with_capacity(map.len());
        for (key, &bias) in map {
            let token: u32 = key.trim().parse().map_err(|_| {
                ApiError::invalid(
                    "logit_bias",
                    format!(
                        "logit_bias has the key \"{key}\" but its keys must be token ids (0 to {})",
                        u32::MAX
                    ),
                )
            })?;
            if !(-100.0..=100.0).contains(&bias) {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!(
                        "logit_bias for token {token} is {bias} but must be between -100 and 100"
                    ),
                ));
            }
            out.push(LogitBias {
                token,
                bias: bias as f32,
            });
        }
        out.sort_by_key(|b| b.token);
        Ok(out)
    }

    /// Empty stop strings are dropped: they would end every generation at once.
    /// `speculative.n_max`, `n_min` and `p_min`, if given.
    pub(super) fn speculative(&self) -> Result<Option<Speculative>, ApiError> {
        if self.speculative_n_max.is_none()
            && self.speculative_n_min.is_none()
            && self.speculative_p_min.is_none()
        {
            return Ok(None);
        }
        check_between("speculative.p_min", self.speculative_p_min, 0.0, 1.0)?;
        let check = |param: &str, v: Option<i64>| match v {
            Some(k) if !(0..=MAX_DRAFT as i64).contains(&k) => Err(ApiError::out_of_range(
                param,
                k,
                format!("between 0 and {MAX_DRAFT}"),
            )),
            _ => Ok(v.map(|k| k as u32)),
        };
        Ok(Some(Speculative {
            n_max: check("speculative.n_max", self.speculative_n_max)?,
            n_min: check("speculative.n_min", self.speculative_n_min)?,
            p_min: self.speculative_p_min.map(|p| p as f32),
        }))
    }

    pub(super) fn stop(&self) -> Result<Vec<String>, ApiError> {
        let list = match self.stop {
            None | Some(Value::Null) => return Ok(Vec::new()),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => {
                if items.len() > MAX_STOP {
                    return Err(ApiError::invalid(
                        "stop",
                        format!(
                            "stop has {} strings but at most {MAX_STOP} are allowed",
                            items.len()
                        ),
                    ));
                }
                items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| match v {
                        Value::String(s) => Ok(s.clone()),
                        other => Err(ApiError::invalid(
                            "stop",
                            format!("stop[{i}] is {} but must be a string", kind_of(other)),
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            Some(other) => {
                return Err(ApiError::invalid(
                    "stop",
                    format!(
                        "stop is {} but must be a string or an array of up to {MAX_STOP} strings",
                        kind_of(other)
                    ),
                ))
            }
        };
        Ok(list.into_iter().filter(|s| !s.is_empty()).collect())
    }

    /// The coordinator reads `top_p == 0` and `repeat_penalty == 0` as "unset", so those
    /// are always sent as positive numbers.
    pub(super) fn sampling(&self) -> Result<Sampling, ApiError> {
        let top_p = match self.top_p {
            None => 1.0,
            // OpenAI allows 0: keep only the most likely token.
            Some(p) => (p as f32).max(f32::MIN_POSITIVE),
        };
        Ok(Sampling {
            temperature: self.temperature.unwrap_or(1.0) as f32,
            top_k: self.top_k.unwrap_or(0).clamp(0, u32::MAX as i64) as u32,
            top_p,
            min_p: self.min_p.unwrap_or(0.0) as f32,
            repeat_penalty: (self.repeat_penalty.unwrap_or(1.0) as f32).max(f32::MIN_POSITIVE),
            repeat_last_n: 0,
            presence_penalty: self.presence_penalty.unwrap_or(0.0) as f32,
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0) as f32,
            logit_bias: self.logit_bias()?,
            seed: self.seed()?,
            grammar: self.grammar()?,
        })
    }
}

/// A structured-output field that constrains the output: given, not null,
/// and not `{"type": "text"}` (OpenAI's default, which constrains nothing,
/// so it stands beside llama.cpp's fields).
fn constraining(v: Option<&Value>) -> Option<&Value> {
    v.filter(|v| !v.is_null() && v.get("type").and_then(Value::as_str) != Some("text"))
}
