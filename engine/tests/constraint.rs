//! Constrained decoding on the real Qwen2.5-Coder instruct model: what a
//! JSON schema, `json_object` or a Lark grammar allows is all that comes
//! out, the answer ends when the document is complete, a constraint fed the
//! same tokens again is where it was (a replay), and bad grammars are named.

mod common;

use omni_engine::chat::{ChatMessage, ChatTemplate};
use omni_engine::constraint::{Grammar, Grammars};
use omni_engine::generate::FinishReason;
use omni_engine::{Engine, GenerateOptions};
use serde_json::{json, Value};

const QWEN_TEMPLATE: &str = include_str!("data/qwen2_5_coder_chat_template.jinja");

fn engine() -> Engine {
    Engine::load(common::model(common::QWEN), None, common::config()).unwrap()
}

fn chat(e: &Engine, question: &str) -> Vec<u32> {
    let t = ChatTemplate::new(QWEN_TEMPLATE, "", "<|im_end|>").unwrap();
    let text = t
        .render(&[ChatMessage::text("user", question)], true)
        .unwrap();
    e.tokenizer.encode(&text, false, true).unwrap()
}

fn run(e: &mut Engine, prompt: &[u32], grammar: Grammar, n: usize) -> omni_engine::Generation {
    let opts = GenerateOptions {
        max_tokens: n,
        sampling: omni_engine::sampling::SamplingParams {
            grammar: Some(grammar),
            ..Default::default()
        },
        ..GenerateOptions::default()
    };
    e.generate(prompt, &opts, &mut |_| {}).unwrap()
}

#[test]
fn a_json_schema_is_all_that_comes_out_and_a_replay_is_exact() {
    let mut e = engine();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "city": {"enum": ["Paris", "Rome", "Oslo"]}
        },
        "required": ["name", "age", "city"],
        "additionalProperties": false
    });
    let prompt = chat(&e, "Describe a person who lives in Italy.");
    let g = run(
        &mut e,
        &prompt,
        Grammar::JsonSchema {
            schema: schema.clone(),
        },
        80,
    );
    let v: Value = serde_json::from_str(&g.text)
        .unwrap_or_else(|err| panic!("not JSON ({err}): {:?}", g.text));
    let o = v.as_object().unwrap();
    assert_eq!(o.len(), 3, "{v}");
    assert!(o["name"].as_str().unwrap().chars().count() <= 20, "{v}");
    assert!((0..=150).contains(&o["age"].as_i64().unwrap()), "{v}");
    assert!(
        ["Paris", "Rome", "Oslo"].contains(&o["city"].as_str().unwrap()),
        "{v}"
    );
    assert_eq!(
        g.finish_reason,
        FinishReason::Stop,
        "ended with the document: {v}"
    );
    // Unconstrained, the same model answers in prose: the constraint did it.
    let free = e
        .generate(&prompt, &GenerateOptions::default(), &mut |_| {})
        .unwrap();
    assert!(
        serde_json::from_str::<Value>(&free.text).is_err(),
        "{}",
        free.text
    );

    // A fresh constraint fed the same tokens is where the first one was: every
    // token is allowed again, and the document is complete at the end.
    let grammars = Grammars::new(&e.tokenizer).unwrap();
    let mut c = grammars.compile(&Grammar::JsonSchema { schema }).unwrap();
    for &t in &g.ids {
        let mut logits = vec![0.0f32; e.tokenizer.n_vocab()];
        c.mask(&mut logits).unwrap();
        assert!(
            logits[t as usize].is_finite(),
            "token {t} allowed on replay"
        );
        c.accept(t).unwrap();
    }
    assert!(c.is_done());
    // A token the grammar does not allow is refused.
    let mut c = grammars.compile(&Grammar::JsonObject).unwrap();
    let x = e.tokenizer.encode("x", false, false).unwrap()[0];
    assert!(c.accept(x).is_err(), "a JSON object cannot start with x");
}

/// A schema the model would rather not follow (a tool call it was never
/// offered) still ends: whitespace between JSON tokens is bounded, where
/// llguidance's default let this answer fill 80 tokens with blank lines.
#[test]
fn an_unwelcome_schema_still_ends_with_the_document() {
    let mut e = engine();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]}
                },
                "required": ["city", "unit"],
                "additionalProperties": false
            }
        },
        "required": ["name", "arguments"],
        "additionalProperties": false
    });
    let prompt = chat(&e, "What is the weather in Paris?");
    let g = run(&mut e, &prompt, Grammar::JsonSchema { schema }, 80);
    assert_eq!(g.finish_reason, FinishReason::Stop, "{:?}", g.text);
    let v: Value = serde_json::from_str(&g.text).unwrap();
    assert_eq!(v["name"], "get_weather");
    assert!(!v["arguments"]["city"].as_str().unwrap().is_empty(), "{v}");
    assert!(["celsius", "fahrenheit"].contains(&v["arguments"]["unit"].as_str().unwrap()));
}

#[test]
fn json_object_and_lark_grammars_constrain_greedy_answers() {
    let mut e = engine();
    let prompt = chat(&e, "Give me some data about the moon.");
    let g = run(&mut e, &prompt, Grammar::JsonObject, 60);
    // Cut at 60 tokens or complete: a prefix of a JSON object either way.
    assert!(g.text.trim_start().starts_with('{'), "{:?}", g.text);
    if g.finish_reason == FinishReason::Stop {
        assert!(serde_json::from_str::<Value>(&g.text).unwrap().is_object());
    }

    let prompt = chat(&e, "Is the sky green? Answer in one word.");
    let lark = Grammar::Lark {
        grammar: r#"start: ("yes" | "no") "."?"#.into(),
    };
    let g = run(&mut e, &prompt, lark, 8);
    assert!(
        ["yes", "no", "yes.", "no."].contains(&g.text.as_str()),
        "{:?}",
        g.text
    );
    assert_eq!(g.finish_reason, FinishReason::Stop);
}

#[test]
fn bad_grammars_are_named() {
    let e = engine();
    let grammars = Grammars::new(&e.tokenizer).unwrap();
    for (g, says) in [
        (
            Grammar::JsonSchema {
                schema: json!({"type": 5}),
            },
            "JSON schema",
        ),
        (
            Grammar::JsonSchema {
                schema: json!("a string"),
            },
            "JSON schema",
        ),
        (
            Grammar::Lark {
                grammar: "start: (".into(),
            },
            "Lark grammar",
        ),
    ] {
        let err = grammars.compile(&g).err().expect("refused").to_string();
        assert!(
            err.contains("invalid") && err.contains(says),
            "{g:?}: {err}"
        );
    }
}

/// A triggered grammar (how `tool_choice: auto` constrains a call once the
/// model opens one) masks nothing until its token is generated, then all
/// that follows fits the grammar.
#[test]
fn a_triggered_grammar_starts_at_its_token() {
    let mut e = engine();
    let prompt = chat(&e, "Is the sky green? Answer in one word.");
    let free = e
        .generate(&prompt, &GenerateOptions::default(), &mut |_| {})
        .unwrap();
    let first = free.ids[0];
    let lark = Grammar::Lark {
        grammar: r#"start: " maybe" " not""#.into(),
    };
    let g = run(
        &mut e,
        &prompt,
        Grammar::Triggered {
            token: first,
            grammar: Box::new(lark.clone()),
        },
        8,
    );
    // The first token is the free answer's; the rest is the grammar's.
    assert_eq!(g.ids[0], first);
    let rest = e.tokenizer.decode(&g.ids[1..]);
    assert!(rest.starts_with(" maybe not"), "{rest:?}");
    assert_eq!(g.finish_reason, FinishReason::Stop);
    // A trigger that never comes constrains nothing.
    let never = Grammar::Triggered {
        token: e.tokenizer.n_vocab() as u32 - 1,
        grammar: Box::new(lark),
    };
    let g = run(&mut e, &prompt, never, free.ids.len());
    assert_eq!(g.ids, free.ids);
}
