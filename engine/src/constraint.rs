//! Constrained decoding: at every step only tokens that keep the output a
//! prefix of a document the request's grammar accepts may be sampled.
//!
//! The grammar engine is `llguidance` (JSON schemas, `json_object`, Lark
//! grammars), over this model's vocabulary as llama.cpp renders it: every
//! token's bytes, and control tokens (empty as text) as their text behind
//! llguidance's 0xFF marker, as llama.cpp's own llguidance sampler does.
//! [`Grammars`] is built once per model (it walks the whole vocabulary);
//! a [`Constraint`] is one sequence's state, advanced token by token, so it
//! can be rebuilt exactly by feeding it the tokens generated so far.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, InferenceCapabilities, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::tokenizer::Tokenizer;

pub use crate::sampling::Grammar;
use crate::sampling::JSON_WHITESPACE;

/// Why a grammar cannot be used, or a constraint failed.
#[derive(Debug, thiserror::Error)]
pub enum ConstraintError {
    #[error("invalid {what}: {why}")]
    Invalid { what: &'static str, why: String },
    #[error("the grammar constraint failed: {0}")]
    Failed(String),
}

impl From<ConstraintError> for crate::EngineError {
    fn from(e: ConstraintError) -> Self {
        crate::EngineError::Constraint(e.to_string())
    }
}

impl Grammar {
    fn what(&self) -> &'static str {
        match self {
            Grammar::JsonObject => "json_object",
            Grammar::JsonSchema { .. } => "JSON schema",
            Grammar::Lark { .. } => "Lark grammar",
            Grammar::Triggered { grammar, .. } => grammar.what(),
        }
    }

    fn top_level(&self) -> Result<TopLevelGrammar, ConstraintError> {
        match self {
            Grammar::JsonObject => Ok(TopLevelGrammar::from_json_schema(bounded_whitespace(
                serde_json::json!({"type": "object"}),
            ))),
            Grammar::JsonSchema { schema } => {
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(ConstraintError::Invalid {
                        what: self.what(),
                        why: format!("a schema is a JSON object, not {schema}"),
                    });
                }
                Ok(TopLevelGrammar::from_json_schema(bounded_whitespace(
                    schema.clone(),
                )))
            }
            Grammar::Lark { grammar } => Ok(TopLevelGrammar::from_lark(grammar.clone())),
            Grammar::Triggered { grammar, .. } => grammar.top_level(),
        }
    }
}

/// Whitespace between two JSON tokens bounded ([`JSON_WHITESPACE`]) unless
/// the schema says otherwise in llguidance's own `x-guidance` options.
fn bounded_whitespace(schema: serde_json::Value) -> serde_json::Value {
    match schema {
        serde_json::Value::Object(mut o) if !o.contains_key("x-guidance") => {
            o.insert(
                "x-guidance".into(),
                serde_json::json!({ "whitespace_pattern": JSON_WHITESPACE }),
            );
            serde_json::Value::Object(o)
        }
        other => other,
    }
}

/// The model's vocabulary as the grammar engine sees it; built once per
/// model and shared by every request's [`Constraint`].
pub struct Grammars {
    factory: Arc<ParserFactory>,
    n_vocab: usize,
    eos: u32,
}

impl Grammars {
    pub fn new(tok: &Tokenizer) -> Result<Grammars, ConstraintError> {
        let n_vocab = tok.n_vocab();
        // The token that ends a constrained answer: EOS (else the first
        // end-of-generation token); the engine allows it once the document
        // is complete.
        let eos = tok
            .eos()
            .or_else(|| (0..n_vocab as u32).find(|&t| tok.is_eog(t)))
            .ok_or_else(|| ConstraintError::Failed("the vocabulary has no end token".into()))?;
        let words: Vec<Vec<u8>> = (0..n_vocab as u32)
            .map(|t| {
                let plain = tok.plain_piece(t);
                if !plain.is_empty() {
                    return plain;
                }
                let special = tok.piece(t);
                if special.is_empty() {
                    return Vec::new();
                }
                let mut marked = Vec::with_capacity(special.len() + 1);
                marked.push(0xFF);
                marked.extend(special);
                marked
            })
            .collect();
        let info = TokRxInfo::new(n_vocab as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new(&env, InferenceCapabilities::default(), &[])
            .map_err(|e| ConstraintError::Failed(e.to_string()))?;
        factory.quiet();
        Ok(Grammars {
            factory: Arc::new(factory),
            n_vocab,
            eos,
        })
    }

    /// The token that ends a constrained answer.
    pub fn end_token(&self) -> u32 {
        self.eos
    }

    /// A fresh constraint for one sequence; an invalid grammar or schema is
    /// an error that says what is wrong with it.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, ConstraintError> {
        let parser = self
            .factory
            .create_parser(grammar.top_level()?)
            .map_err(|e| ConstraintError::Invalid {
                what: grammar.what(),
                why: e.to_string(),
            })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError::Invalid {
                what: grammar.what(),
                why: e,
            });
        }
        let waiting = match grammar {
            Grammar::Triggered { token, .. } => Some(*token),
            _ => None,
        };
        Ok(Constraint {
            matcher,
            n_vocab: self.n_vocab,
            eos: self.eos,
            waiting,
        })
    }
}

/// One sequence's place in its grammar.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    n_vocab: usize,
    eos: u32,
    /// A triggered grammar's token, until it is generated: nothing is
    /// masked before (the matcher is compiled and waits).
    waiting: Option<u32>,
}

impl Constraint {
    /// Sets the logit of every token the grammar does not allow next to
    /// minus infinity. When the document is complete only the end token is
    /// allowed.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), ConstraintError> {
        if self.waiting.is_some() {
            return Ok(());
        }
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| ConstraintError::Failed(e.to_string()))?;
        for (t, l) in logits.iter_mut().enumerate().take(self.n_vocab) {
            if !allowed.is_allowed(t as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances past the sampled token. Once the document is complete only
    /// the end token is accepted (and changes nothing).
    pub fn accept(&mut self, t: u32) -> Result<(), ConstraintError> {
        if let Some(trigger) = self.waiting {
            if t == trigger {
                self.waiting = None;
            }
            return Ok(());
        }
        if self.matcher.is_stopped() {
            return if t == self.eos {
                Ok(())
            } else {
                Err(ConstraintError::Failed(format!(
                    "the document is complete: only the end token ({}) may follow, not {t}",
                    self.eos
                )))
            };
        }
        self.matcher
            .consume_token(t)
            .map_err(|e| ConstraintError::Failed(e.to_string()))
    }

    /// The token that ends the answer once the document is complete.
    pub fn end_token(&self) -> u32 {
        self.eos
    }

    /// The document is complete and nothing more may follow (the answer
    /// ends here).
    pub fn is_done(&self) -> bool {
        self.waiting.is_none() && self.matcher.is_stopped()
    }
}
