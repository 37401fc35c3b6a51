//! `POST /v1/completions`: a prompt (text, token ids) to the coordinator's request.

use super::error::ApiError;
use super::request::check_max_tokens;
use super::request::check_n;
use super::request::integral;
use super::request::kind_of;
use super::request::Common;
use super::request::CompletionRequest;
use super::COMPLETION_DEFAULT_MAX_TOKENS;
use super::MAX_COMPLETION_LOGPROBS;
use omni_proto::coordinator::v1::generate_request::Prompt;
use omni_proto::coordinator::v1::GenerateRequest;
use omni_proto::coordinator::v1::TokenIds;
use serde_json::Value;

/// A token id in a completions prompt.
pub(super) fn prompt_id(v: &Value, at: &str) -> Result<u32, ApiError> {
    v.as_number()
        .and_then(integral)
        .and_then(|id| u32::try_from(id).ok())
        .ok_or_else(|| {
            ApiError::invalid(
                "prompt",
                format!(
                    "{at} is {v} but token ids must be integers from 0 to {}",
                    u32::MAX
                ),
            )
        })
}

pub(super) fn prompt_ids(items: &[Value], at: &str) -> Result<Prompt, ApiError> {
    let ids = items
        .iter()
        .enumerate()
        .map(|(i, v)| prompt_id(v, &format!("{at}[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Prompt::Ids(TokenIds { ids }))
}

impl CompletionRequest {
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

    pub fn n(&self) -> u32 {
        check_n(self.n).unwrap_or(1)
    }

    pub fn stream(&self) -> bool {
        self.stream == Some(true)
    }

    pub fn include_usage(&self) -> bool {
        self.stream()
            && self
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false)
    }

    /// Whether the response carries `logprobs` (`logprobs: 0` asks for the sampled
    /// tokens' logprobs without alternatives).
    pub fn logprobs(&self) -> bool {
        self.logprobs.is_some()
    }

    /// The prompt when it is one text: what `auto` rules look at.
    pub fn prompt_text(&self) -> String {
        self.prompt
            .as_ref()
            .and_then(|p| p.as_str())
            .unwrap_or_default()
            .to_string()
    }

    pub(super) fn prompt(&self) -> Result<Prompt, ApiError> {
        let many = |n: usize| {
            ApiError::invalid(
                "prompt",
                format!("prompt has {n} prompts but this router takes one prompt per request; send them as separate requests"),
            )
        };
        match &self.prompt {
            None | Some(Value::Null) => Err(ApiError::invalid(
                "prompt",
                "prompt is missing; give a string or an array of token ids",
            )),
            Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
            Some(Value::Array(items)) => match items.first() {
                None => Err(ApiError::invalid(
                    "prompt",
                    "prompt is an empty array; give a string or an array of token ids",
                )),
                Some(Value::String(_)) => {
                    if items.len() > 1 {
                        return Err(many(items.len()));
                    }
                    Ok(Prompt::Text(
                        items[0].as_str().unwrap_or_default().to_string(),
                    ))
                }
                Some(Value::Array(inner)) => {
                    if items.len() > 1 {
                        return Err(many(items.len()));
                    }
                    prompt_ids(inner, "prompt[0]")
                }
                Some(_) => prompt_ids(items, "prompt"),
            },
            Some(other) => Err(ApiError::invalid(
                "prompt",
                format!(
                    "prompt is {} but must be a string or an array of token ids",
                    kind_of(other)
                ),
            )),
        }
    }

    pub(super) fn refuse_unsupported(&self) -> Result<(), ApiError> {
        if self.echo == Some(true) {
            return Err(ApiError::unsupported(
                "echo",
                "echo is not supported; send the request with \"echo\": false",
            ));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::unsupported(
                "suffix",
                "suffix (insertion) is not supported; send the request without `suffix`",
            ));
        }
        if let Some(b) = self.best_of {
            if b != 1 && b != self.n.unwrap_or(1) {
                return Err(ApiError::unsupported(
                    "best_of",
                    format!("best_of is {b}: picking the best of several completions is not supported; leave best_of out and use n to get several completions"),
                ));
            }
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<(), ApiError> {
        self.to_generate().map(|_| ())
    }

    /// The coordinator request for one choice (see [`choice_request`] for the others).
    pub fn to_generate(&self) -> Result<GenerateRequest, ApiError> {
        self.refuse_unsupported()?;
        let prompt = self.prompt()?;
        let common = self.common();
        common.validate()?;
        let max_tokens = check_max_tokens("max_tokens", self.max_tokens)?
            .unwrap_or(COMPLETION_DEFAULT_MAX_TOKENS);
        let top_logprobs = match self.logprobs {
            None => 0,
            Some(k) if (0..=MAX_COMPLETION_LOGPROBS as i64).contains(&k) => k as u32,
            Some(k) => {
                return Err(ApiError::out_of_range(
                    "logprobs",
                    k,
                    format!("between 0 and {MAX_COMPLETION_LOGPROBS}"),
                ))
            }
        };
        Ok(GenerateRequest {
            prompt: Some(prompt),
            max_tokens: Some(max_tokens),
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

/// The request for choice `index` of `n`: with a seed, each choice gets its own (seed +
/// index), or all `n` choices would be the same text.
pub fn choice_request(base: &GenerateRequest, index: u32) -> GenerateRequest {
    let mut r = base.clone();
    if let Some(s) = r.sampling.as_mut() {
        s.seed = s.seed.map(|seed| seed.wrapping_add(index as u64));
    }
    if !r.request_id.is_empty() && index > 0 {
        r.request_id = format!("{}-{index}", r.request_id);
    }
    r
}
