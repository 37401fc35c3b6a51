//! The one conversion between the wire's `Sampling` and the engine's
//! `SamplingParams` (feature `engine`): the coordinator reads a client's
//! settings with it and sends each sequence's validated settings on to the
//! stage that samples, which reads them back the same way.
//!
//! On the wire 0 means "the default" for the settings whose default is not
//! 0 (`top_p` 1, `repeat_penalty` 1, `repeat_last_n` 64); the engine never
//! holds 0 for them once validated, so engine → wire → engine is exact.

use omni_engine::sampling::{Grammar, SamplingParams};

use crate::worker::v1::{grammar::Kind, Grammar as WireGrammar, LogitBias, Sampling, Triggered};

/// A grammar on the wire that is not one: the field at fault (its path in
/// `Sampling`) and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct WireError {
    pub field: &'static str,
    pub message: String,
}

/// The engine's settings from the wire's; absent means greedy.
pub fn params(s: Option<&Sampling>) -> Result<SamplingParams, WireError> {
    let Some(s) = s else {
        return Ok(SamplingParams::default());
    };
    let d = SamplingParams::default();
    let or = |v: f32, default: f32| if v == 0.0 { default } else { v };
    Ok(SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: or(s.top_p, d.top_p),
        min_p: s.min_p,
        repeat_penalty: or(s.repeat_penalty, d.repeat_penalty),
        repeat_last_n: match s.repeat_last_n {
            0 => d.repeat_last_n,
            n => n as usize,
        },
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        logit_bias: s.logit_bias.iter().map(|b| (b.token, b.bias)).collect(),
        seed: s.seed,
        grammar: s.grammar.as_ref().map(grammar).transpose()?,
    })
}

/// The wire's settings from the engine's.
pub fn sampling(p: &SamplingParams) -> Sampling {
    Sampling {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        min_p: p.min_p,
        repeat_penalty: p.repeat_penalty,
        repeat_last_n: p.repeat_last_n.min(u32::MAX as usize) as u32,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        logit_bias: p
            .logit_bias
            .iter()
            .map(|&(token, bias)| LogitBias { token, bias })
            .collect(),
        seed: p.seed,
        grammar: p.grammar.as_ref().map(wire_grammar),
    }
}

fn grammar(g: &WireGrammar) -> Result<Grammar, WireError> {
    match &g.kind {
        None => Err(WireError {
            field: "grammar",
            message: "invalid grammar: it names no kind (json_object, json_schema or lark)".into(),
        }),
        Some(Kind::JsonObject(_)) => Ok(Grammar::JsonObject),
        Some(Kind::JsonSchema(text)) => serde_json::from_str(text)
            .map(|schema| Grammar::JsonSchema { schema })
            .map_err(|e| WireError {
                field: "grammar.json_schema",
                message: format!("invalid JSON schema: it is not JSON: {e}"),
            }),
        Some(Kind::Lark(grammar)) => Ok(Grammar::Lark {
            grammar: grammar.clone(),
        }),
        Some(Kind::Triggered(t)) => Ok(Grammar::Triggered {
            token: t.token,
            grammar: Box::new(match &t.grammar {
                Some(inner) => grammar(inner)?,
                None => {
                    return Err(WireError {
                        field: "grammar.triggered.grammar",
                        message: "invalid grammar: a triggered grammar has none to start".into(),
                    })
                }
            }),
        }),
    }
}

fn wire_grammar(g: &Grammar) -> WireGrammar {
    let kind = match g {
        Grammar::JsonObject => Kind::JsonObject(Default::default()),
        Grammar::JsonSchema { schema } => Kind::JsonSchema(schema.to_string()),
        Grammar::Lark { grammar } => Kind::Lark(grammar.clone()),
        Grammar::Triggered { token, grammar } => Kind::Triggered(Box::new(Triggered {
            token: *token,
            grammar: Some(Box::new(wire_grammar(grammar))),
        })),
    };
    WireGrammar { kind: Some(kind) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_to_wire_to_engine_is_exact() {
        let cases = [
            SamplingParams::default(),
            SamplingParams {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.05,
                repeat_penalty: 1.1,
                repeat_last_n: 32,
                presence_penalty: 0.5,
                frequency_penalty: -0.25,
                logit_bias: vec![(7, -100.0), (3, 2.5)],
                seed: Some(99),
                grammar: Some(Grammar::Triggered {
                    token: 151657,
                    grammar: Box::new(Grammar::Lark {
                        grammar: "start: \"x\"".into(),
                    }),
                }),
            },
            SamplingParams {
                grammar: Some(Grammar::JsonSchema {
                    schema: serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}}),
                }),
                ..Default::default()
            },
            SamplingParams {
                grammar: Some(Grammar::JsonObject),
                seed: Some(0),
                ..Default::default()
            },
        ];
        for p in cases {
            assert_eq!(params(Some(&sampling(&p))).unwrap(), p);
        }
    }

    #[test]
    fn a_wire_grammar_that_is_not_one_names_its_field() {
        let bad = Sampling {
            grammar: Some(WireGrammar {
                kind: Some(Kind::JsonSchema("{not json".into())),
            }),
            ..Default::default()
        };
        let e = params(Some(&bad)).unwrap_err();
        assert_eq!(e.field, "grammar.json_schema");
        assert!(e.message.starts_with("invalid JSON schema"), "{e}");
        let none = Sampling {
            grammar: Some(WireGrammar { kind: None }),
            ..Default::default()
        };
        assert_eq!(params(Some(&none)).unwrap_err().field, "grammar");
    }
}
