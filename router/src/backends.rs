//! Where a model name goes: a coordinator of this cluster (gRPC), or an
//! upstream OpenAI-compatible server (for example an existing llama-server)
//! whose responses are passed through. `auto` picks a model by rules.

use omni_proto::coordinator::v1::inference_client::InferenceClient;
use tonic::transport::Channel;

#[derive(Clone)]
pub enum Target {
    Cluster {
        client: InferenceClient<Channel>,
        /// The coordinator's address, for error messages.
        addr: String,
    },
    /// `base` ends in `/v1`; `model` is the upstream's name for the model.
    Upstream {
        base: String,
        model: String,
        key: Option<String>,
    },
}

/// One served model: its name, aliases and what serves it.
#[derive(Clone)]
pub struct Backend {
    pub name: String,
    pub aliases: Vec<String>,
    pub target: Target,
}

/// One `auto` rule: a condition on the request's prompt text and the model
/// it sends matching requests to.
#[derive(Clone, Debug, PartialEq)]
pub enum Rule {
    /// The prompt text is longer than this many characters.
    PromptChars(usize),
    /// The prompt text contains this word (case-insensitive).
    Keyword(String),
    Default,
}

/// Parses `prompt_chars>2000=deepseek;keyword:code=qwen;default=gemma`.
pub fn parse_auto(spec: &str) -> Result<Vec<(Rule, String)>, String> {
    let mut rules = Vec::new();
    for part in spec.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let (cond, model) = part
            .rsplit_once('=')
            .ok_or_else(|| format!("auto rule '{part}': expected CONDITION=MODEL"))?;
        let rule = if let Some(n) = cond.strip_prefix("prompt_chars>") {
            Rule::PromptChars(
                n.trim()
                    .parse()
                    .map_err(|_| format!("auto rule '{part}': '{n}' is not a number"))?,
            )
        } else if let Some(w) = cond.strip_prefix("keyword:") {
            Rule::Keyword(w.trim().to_lowercase())
        } else if cond.trim() == "default" {
            Rule::Default
        } else {
            return Err(format!(
                "auto rule '{part}': conditions are prompt_chars>N, keyword:WORD or default"
            ));
        };
        rules.push((rule, model.trim().to_string()));
    }
    Ok(rules)
}

/// The model the first matching rule names, if any.
pub fn pick<'a>(rules: &'a [(Rule, String)], prompt: &str) -> Option<&'a str> {
    let lower = prompt.to_lowercase();
    rules
        .iter()
        .find(|(r, _)| match r {
            Rule::PromptChars(n) => prompt.chars().count() > *n,
            Rule::Keyword(w) => lower.contains(w.as_str()),
            Rule::Default => true,
        })
        .map(|(_, m)| m.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_pick_in_order() {
        let r = parse_auto("prompt_chars>20=big; keyword:code=coder; default=small").unwrap();
        assert_eq!(pick(&r, "write some CODE"), Some("coder"));
        assert_eq!(
            pick(
                &r,
                "a prompt that is longer than twenty characters, about code"
            ),
            Some("big")
        );
        assert_eq!(pick(&r, "hi"), Some("small"));
        assert!(parse_auto("sometimes=x")
            .unwrap_err()
            .contains("conditions are"));
        assert!(parse_auto("prompt_chars>many=x")
            .unwrap_err()
            .contains("not a number"));
    }
}
