//! Structured output: `response_format`, llama.cpp's `json_schema` and `grammar`.

use super::error::ApiError;
use super::request::kind_of;
use omni_proto::worker::v1::grammar::JsonObject;
use omni_proto::worker::v1::grammar::Kind as GrammarKind;
use serde_json::Value;

/// OpenAI's `response_format`: `text`, `json_object` (llama.cpp also takes a
/// `schema` beside it) or `json_schema` with its `json_schema.schema` (strict
/// or not: the output always fits the schema).
pub(super) fn response_format(rf: &Value) -> Result<Option<GrammarKind>, ApiError> {
    let param = "response_format";
    let Some(obj) = rf.as_object() else {
        return Err(ApiError::invalid(
            param,
            format!(
                "response_format is {} but must be an object such as {{\"type\": \"json_object\"}}",
                kind_of(rf)
            ),
        ));
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => match obj.get("schema") {
            Some(schema) if !schema.is_null() => json_schema(schema, "response_format.schema").map(Some),
            _ => Ok(Some(GrammarKind::JsonObject(JsonObject {}))),
        },
        Some("json_schema") => {
            let at = "response_format.json_schema";
            let Some(js) = obj.get("json_schema").and_then(Value::as_object) else {
                return Err(ApiError::invalid(
                    at,
                    "response_format type \"json_schema\" needs a `json_schema` object: {\"name\": ..., \"schema\": {...}}",
                ));
            };
            match js.get("schema") {
                Some(schema) if !schema.is_null() => {
                    json_schema(schema, "response_format.json_schema.schema").map(Some)
                }
                // OpenAI's schema is optional: any JSON object then.
                _ => Ok(Some(GrammarKind::JsonObject(JsonObject {}))),
            }
        }
        Some(other) => Err(ApiError::invalid(
            "response_format.type",
            format!("response_format.type is \"{other}\" but must be one of text, json_object, json_schema"),
        )),
        None => Err(ApiError::invalid(
            "response_format.type",
            "response_format has no `type`; use \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

pub(super) fn json_schema(schema: &Value, param: &str) -> Result<GrammarKind, ApiError> {
    if !(schema.is_object() || schema.is_boolean()) {
        return Err(ApiError::invalid(
            param,
            format!(
                "{param} is {} but a JSON schema is an object",
                kind_of(schema)
            ),
        ));
    }
    Ok(GrammarKind::JsonSchema(schema.to_string()))
}

/// llama.cpp's `grammar` is GBNF; omni takes llguidance's Lark syntax, and
/// says so when it sees GBNF's `::=`.
pub(super) fn lark(g: &Value) -> Result<GrammarKind, ApiError> {
    let Some(text) = g.as_str() else {
        return Err(ApiError::invalid(
            "grammar",
            format!(
                "grammar is {} but must be a string (a Lark grammar)",
                kind_of(g)
            ),
        ));
    };
    if text.contains("::=") {
        return Err(ApiError::invalid(
            "grammar",
            "grammar looks like GBNF (it has `::=`): omni takes grammars in llguidance's Lark syntax, e.g. `start: \"yes\" | \"no\"` for `root ::= \"yes\" | \"no\"`",
        ));
    }
    Ok(GrammarKind::Lark(text.to_string()))
}

/// A JSON value that asks for nothing: absent, null, or an empty array.
pub(super) fn is_empty_value(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::Array(a)) => a.is_empty(),
        _ => false,
    }
}
