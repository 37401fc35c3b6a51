//! The grammar that holds a model to a tool call: from its first token (`required`, a
//! named function, the generic JSON envelope) or once it opens one (`auto`).

use super::Tool;
use super::ToolChoice;
use super::ToolFormat;
use super::DS_CALLS_BEGIN;
use super::DS_CALLS_END;
use super::DS_CALL_BEGIN;
use super::DS_CALL_END;
use super::DS_SEP;
use super::HERMES_CLOSE;
use super::HERMES_OPEN;
use super::MISTRAL_CALLS;
use super::PYTHON_TAG;
use crate::sampling::Grammar;
use serde_json::json;
use serde_json::Value;

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
pub(super) fn deepseek_calls(chosen: &[&Tool], ws: &Value, lit: &dyn Fn(&str) -> String) -> String {
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
