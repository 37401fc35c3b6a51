//! The OpenAI types as a client sees them: request bodies shaped like the ones the official
//! `openai` Python client sends, the errors they get, what reaches the coordinator, and the
//! JSON of responses and stream chunks.

use std::pin::pin;
use std::task::{Context, Poll, Waker};

use axum::response::IntoResponse;
use omni_proto::coordinator::v1::generate_request::Prompt;
use omni_proto::coordinator::v1::{
    ChatMessage, Done, FinishReason, GenerateEvent, GenerateRequest, Token, ToolCallOut, ToolChoice,
};
use omni_proto::worker::v1::grammar::{JsonObject, Kind};
use omni_proto::worker::v1::{LogitBias, TopLogprob};
use omni_router::openai::*;
use serde_json::{json, Value};

fn chat(body: Value) -> Result<GenerateRequest, ApiError> {
    let req: ChatCompletionRequest = parse_json(body.to_string().as_bytes())?;
    req.to_generate()
}

fn completion(body: Value) -> Result<GenerateRequest, ApiError> {
    let req: CompletionRequest = parse_json(body.to_string().as_bytes())?;
    req.to_generate()
}

/// A minimal valid chat body with `patch`'s fields merged in.
fn chat_with(patch: Value) -> Value {
    let mut body = json!({
        "model": "gemma",
        "messages": [{"role": "user", "content": "Hello!"}],
    });
    for (k, v) in patch.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn completion_with(patch: Value) -> Value {
    let mut body = json!({"model": "gemma", "prompt": "Say this is a test"});
    for (k, v) in patch.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn text_of(id: u32) -> String {
    ["Hel", "lo", " wor", "ld", "é", "!"]
        .get(id as usize)
        .map_or(format!("<{id}>"), |s| s.to_string())
}

fn token(id: u32, logprob: f32, top: &[(u32, f32)]) -> Token {
    Token {
        id,
        logprob: Some(logprob),
        top: top
            .iter()
            .map(|&(token, logprob)| TopLogprob {
                token,
                logprob,
                piece: String::new(),
            })
            .collect(),
        piece: String::new(),
    }
}

fn done(reason: FinishReason, prompt: u32, completion: u32) -> Done {
    Done {
        finish_reason: reason as i32,
        prompt_tokens: prompt,
        completion_tokens: completion,
        time_to_first_token_ms: 1.0,
        total_ms: 2.0,
    }
}

fn json_of<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap()
}

fn keys(v: &Value) -> Vec<&str> {
    let mut k: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    k.sort();
    k
}

// ---------------------------------------------------------------------------------------
// Requests the clients send
// ---------------------------------------------------------------------------------------

#[test]
fn streaming_chat_request_from_the_python_client() {
    // client.chat.completions.create(model=..., messages=[...], stream=True,
    //                                stream_options={"include_usage": True})
    let body = br#"{"messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Hello!"}],"model":"gemma","stream":true,"stream_options":{"include_usage":true}}"#;
    let req: ChatCompletionRequest = parse_json(body).unwrap();
    assert!(req.stream());
    assert!(req.include_usage());
    assert_eq!(req.n(), 1);
    assert!(!req.logprobs());
    let g = req.to_generate().unwrap();
    assert_eq!(
        g.prompt,
        Some(Prompt::Chat(omni_proto::coordinator::v1::Chat {
            messages: vec![
                ChatMessage {
                    role: "system".into(),
                    content: "You are a helpful assistant.".into(),
                    ..Default::default()
                },
                ChatMessage {
                    role: "user".into(),
                    content: "Hello!".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        }))
    );
    // No limit asked: 0, "until the context is full".
    assert_eq!(g.max_tokens, None);
    let s = g.sampling.unwrap();
    // OpenAI's defaults: temperature 1, top_p 1.
    assert_eq!(s.temperature, 1.0);
    assert_eq!(s.top_p, 1.0);
    assert_eq!(s.repeat_penalty, 1.0);
    assert_eq!((s.top_k, s.min_p, s.seed), (0, 0.0, None));
    assert!(s.logit_bias.is_empty());
    assert!(g.stop.is_empty());
    assert!(!g.logprobs);
    assert_eq!(g.top_logprobs, 0);
}

#[test]
fn include_usage_only_counts_when_streaming() {
    let req: ChatCompletionRequest = parse_json(
        chat_with(json!({"stream_options": {"include_usage": true}}))
            .to_string()
            .as_bytes(),
    )
    .unwrap();
    assert!(!req.include_usage());
}

#[test]
fn every_chat_field_reaches_the_generate_request() {
    let g = chat(chat_with(json!({
        "max_tokens": 50,
        "max_completion_tokens": 20,
        "stop": "END",
        "n": 3,
        "seed": 42,
        "temperature": 0.7,
        "top_p": 0.9,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {"50256": -100, "15": 5.5},
        "logprobs": true,
        "top_logprobs": 3,
        "user": "user-1234",
        "top_k": 40,
        "min_p": 0.05,
        "repeat_penalty": 1.1,
        "ignore_eos": true,
        // Sent by clients, meaningless here: ignored.
        "store": false,
        "metadata": {"k": "v"},
        "parallel_tool_calls": true,
        "service_tier": "auto",
    })))
    .unwrap();
    // max_completion_tokens wins over the deprecated max_tokens.
    assert_eq!(g.max_tokens, Some(20));
    assert_eq!(g.stop, vec!["END".to_string()]);
    assert!(g.logprobs);
    assert_eq!(g.top_logprobs, 3);
    assert!(g.ignore_eos);
    let s = g.sampling.unwrap();
    assert_eq!(s.temperature, 0.7);
    assert_eq!(s.top_p, 0.9);
    assert_eq!(s.presence_penalty, 0.5);
    assert_eq!(s.frequency_penalty, -0.5);
    assert_eq!(s.top_k, 40);
    assert_eq!(s.min_p, 0.05);
    assert_eq!(s.repeat_penalty, 1.1);
    assert_eq!(s.seed, Some(42));
    assert_eq!(
        s.logit_bias,
        vec![
            LogitBias {
                token: 15,
                bias: 5.5
            },
            LogitBias {
                token: 50256,
                bias: -100.0
            },
        ]
    );

    let g = chat(chat_with(json!({"max_tokens": 50, "stop": ["a", "", "b"]}))).unwrap();
    assert_eq!(g.max_tokens, Some(50));
    // An empty stop string would end every generation at once: dropped.
    assert_eq!(g.stop, vec!["a".to_string(), "b".to_string()]);

    // A HumanEval harness's five stop strings, as local servers take them.
    let humaneval = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"];
    let g = chat(chat_with(json!({"stop": humaneval}))).unwrap();
    assert_eq!(g.stop, humaneval);
}

#[test]
fn nulls_are_absent_fields() {
    // The Python client leaves out unset fields, but others send null.
    let g = chat(chat_with(json!({
        "temperature": null, "top_p": null, "stop": null, "max_tokens": null,
        "seed": null, "logit_bias": null, "tools": null, "response_format": null,
    })))
    .unwrap();
    let s = g.sampling.unwrap();
    assert_eq!((s.temperature, s.top_p, s.seed), (1.0, 1.0, None));
    assert_eq!(g.max_tokens, None);
}

#[test]
fn top_p_zero_keeps_only_the_best_token() {
    // The coordinator reads top_p == 0 as "unset" (1.0); OpenAI reads it as "only the top
    // token", so it goes out as the smallest positive value.
    let s = chat(chat_with(json!({"top_p": 0})))
        .unwrap()
        .sampling
        .unwrap();
    assert!(s.top_p > 0.0 && s.top_p < 1e-30);
    let s = chat(chat_with(json!({"temperature": 0})))
        .unwrap()
        .sampling
        .unwrap();
    assert_eq!(s.temperature, 0.0);
}

#[test]
fn negative_seed_and_top_k_are_accepted() {
    let s = chat(chat_with(json!({"seed": -1, "top_k": -1})))
        .unwrap()
        .sampling
        .unwrap();
    assert_eq!(s.seed, Some(u64::MAX));
    assert_eq!(s.top_k, 0);
}

#[test]
fn content_parts_become_text() {
    let g = chat(json!({
        "model": "gemma",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "name": "ann", "content": [
                {"type": "text", "text": "What is"},
                {"type": "text", "text": "2 + 2?"}
            ]},
            {"role": "assistant", "content": null},
            {"role": "user", "content": ""},
        ]
    }))
    .unwrap();
    let Some(Prompt::Chat(c)) = g.prompt else {
        panic!("not a chat prompt")
    };
    let got: Vec<(&str, &str)> = c
        .messages
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect();
    assert_eq!(
        got,
        vec![
            ("system", "Be brief."),
            ("user", "What is\n2 + 2?"),
            ("assistant", ""),
            ("user", ""),
        ]
    );
}

#[test]
fn image_parts_are_refused() {
    let e = chat(json!({
        "model": "gemma",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What's in this image?"},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
        ]}]
    }))
    .unwrap_err();
    assert_eq!(e.status, 400);
    assert!(
        e.message.starts_with("image input is not supported"),
        "{}",
        e.message
    );
    assert_eq!(e.param.as_deref(), Some("messages[0].content[1]"));

    let e = chat(json!({
        "model": "gemma",
        "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "...", "format": "wav"}}
        ]}]
    }))
    .unwrap_err();
    assert!(e.message.starts_with("audio input is not supported"));
}

#[test]
fn completions_request_with_logprobs() {
    // client.completions.create(model=..., prompt="Say this is a test", max_tokens=7,
    //                           temperature=0, logprobs=2)
    let body = br#"{"model":"gemma","prompt":"Say this is a test","max_tokens":7,"temperature":0,"logprobs":2}"#;
    let req: CompletionRequest = parse_json(body).unwrap();
    assert!(req.logprobs());
    let g = req.to_generate().unwrap();
    assert_eq!(g.prompt, Some(Prompt::Text("Say this is a test".into())));
    assert_eq!(g.max_tokens, Some(7));
    assert_eq!(g.sampling.as_ref().unwrap().temperature, 0.0);
    assert!(g.logprobs);
    assert_eq!(g.top_logprobs, 2);

    // logprobs: 0 asks for the sampled tokens' logprobs only.
    let g = completion(completion_with(json!({"logprobs": 0}))).unwrap();
    assert!(g.logprobs);
    assert_eq!(g.top_logprobs, 0);
    let g = completion(completion_with(json!({"logprobs": null}))).unwrap();
    assert!(!g.logprobs);
}

#[test]
fn completions_defaults_and_prompt_shapes() {
    let g = completion(completion_with(json!({}))).unwrap();
    assert_eq!(g.max_tokens, Some(COMPLETION_DEFAULT_MAX_TOKENS));
    assert_eq!(g.max_tokens, Some(16));
    assert_eq!(g.sampling.unwrap().temperature, 1.0);

    let prompt = |p: Value| completion(completion_with(json!({ "prompt": p }))).map(|g| g.prompt);
    assert_eq!(prompt(json!(["one"])), Ok(Some(Prompt::Text("one".into()))));
    let ids = |v: Vec<u32>| {
        Ok(Some(Prompt::Ids(omni_proto::coordinator::v1::TokenIds {
            ids: v,
        })))
    };
    assert_eq!(prompt(json!([2, 9259, 1])), ids(vec![2, 9259, 1]));
    assert_eq!(prompt(json!([[2, 9259]])), ids(vec![2, 9259]));

    let err = |p: Value| prompt(p).unwrap_err();
    let e = err(json!(["a", "b"]));
    assert_eq!((e.status, e.param.as_deref()), (400, Some("prompt")));
    assert!(e.message.contains("prompt has 2 prompts"), "{}", e.message);
    assert!(err(json!([[1], [2]]))
        .message
        .contains("prompt has 2 prompts"));
    let e = err(json!([5, -1]));
    assert_eq!(
        e.message,
        "prompt[1] is -1 but token ids must be integers from 0 to 4294967295"
    );
    assert!(err(json!([])).message.contains("empty array"));
    assert!(err(json!(7)).message.contains("prompt is a number"));
    let e = completion(json!({"model": "gemma"})).unwrap_err();
    assert_eq!((e.status, e.param.as_deref()), (400, Some("prompt")));
    assert!(e.message.contains("prompt is missing"));
}

#[test]
fn completions_refuses_echo_suffix_and_best_of() {
    for (patch, param) in [
        (json!({"echo": true}), "echo"),
        (json!({"suffix": "and then"}), "suffix"),
        (json!({"best_of": 3}), "best_of"),
    ] {
        let e = completion(completion_with(patch)).unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.param.as_deref(), Some(param));
        assert!(e.message.contains("not supported"), "{}", e.message);
    }
    // The values that ask for nothing are fine.
    completion(completion_with(
        json!({"echo": false, "suffix": null, "best_of": 1}),
    ))
    .unwrap();
    completion(completion_with(json!({"n": 2, "best_of": 2}))).unwrap();
}

// ---------------------------------------------------------------------------------------
// Validation errors
// ---------------------------------------------------------------------------------------

#[test]
fn out_of_range_values_name_the_field_and_the_limit() {
    let cases = [
        (
            json!({"temperature": 3.5}),
            "temperature",
            "temperature is 3.5 but must be between 0 and 2",
        ),
        (
            json!({"temperature": -0.1}),
            "temperature",
            "temperature is -0.1 but must be between 0 and 2",
        ),
        (
            json!({"top_p": 1.5}),
            "top_p",
            "top_p is 1.5 but must be between 0 and 1",
        ),
        (
            json!({"presence_penalty": 2.5}),
            "presence_penalty",
            "presence_penalty is 2.5 but must be between -2 and 2",
        ),
        (
            json!({"frequency_penalty": -3}),
            "frequency_penalty",
            "frequency_penalty is -3 but must be between -2 and 2",
        ),
        (json!({"n": 0}), "n", "n is 0 but must be between 1 and 16"),
        (json!({"n": 17}), "n", "n is 17 but must be between 1 and 16"),
        (
            json!({"max_tokens": 0}),
            "max_tokens",
            "max_tokens is 0 but must be at least 1",
        ),
        (
            json!({"max_completion_tokens": -5}),
            "max_completion_tokens",
            "max_completion_tokens is -5 but must be at least 1",
        ),
        (
            json!({"logit_bias": {"5": 150}}),
            "logit_bias",
            "logit_bias for token 5 is 150 but must be between -100 and 100",
        ),
        (
            json!({"logit_bias": {"hello": 1}}),
            "logit_bias",
            "logit_bias has the key \"hello\" but its keys must be token ids (0 to 4294967295)",
        ),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
            "top_logprobs is 21 but must be between 0 and 20",
        ),
        (
            json!({"top_logprobs": 2}),
            "top_logprobs",
            "top_logprobs is 2 but logprobs is not true; set \"logprobs\": true to get log probabilities",
        ),
        (
            json!({"stop": (0..17).map(|i| i.to_string()).collect::<Vec<_>>()}),
            "stop",
            "stop has 17 strings but at most 16 are allowed",
        ),
        (
            json!({"stop": ["a", 5]}),
            "stop",
            "stop[1] is a number but must be a string",
        ),
        (
            json!({"stop": {"a": 1}}),
            "stop",
            "stop is an object but must be a string or an array of up to 16 strings",
        ),
        (
            json!({"min_p": 1.5}),
            "min_p",
            "min_p is 1.5 but must be between 0 and 1",
        ),
        (
            json!({"repeat_penalty": 0}),
            "repeat_penalty",
            "repeat_penalty is 0 but must be greater than 0 (1 is off)",
        ),
        (
            json!({"seed": 1.5}),
            "seed",
            "seed is 1.5 but must be an integer",
        ),
        (
            json!({"messages": []}),
            "messages",
            "messages is empty; a chat completion needs at least one message",
        ),
        (
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            "messages[0].role",
            "messages[0].role is \"wizard\" but must be one of system, developer, user, assistant, tool",
        ),
        (
            json!({"messages": [{"role": "system", "content": "x"}, {"role": "user"}]}),
            "messages[1].content",
            "messages[1].content is missing; give a string or an array of text parts",
        ),
        (
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
            "messages[0].content is a number but must be a string or an array of content parts",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            "messages[0].content[0].text",
            "messages[0].content[0] is a text part without a `text` string",
        ),
    ];
    for (patch, param, message) in cases {
        let e = chat(chat_with(patch.clone())).unwrap_err();
        assert_eq!(e.status, 400, "{patch}");
        assert_eq!(e.kind, "invalid_request_error", "{patch}");
        assert_eq!(e.param.as_deref(), Some(param), "{patch}");
        assert_eq!(e.message, message, "{patch}");
    }

    // Completions share the sampling checks, and have their own logprobs range.
    let e = completion(completion_with(json!({"temperature": 2.5}))).unwrap_err();
    assert_eq!(e.message, "temperature is 2.5 but must be between 0 and 2");
    let e = completion(completion_with(json!({"logprobs": 6}))).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("logprobs"));
    assert_eq!(e.message, "logprobs is 6 but must be between 0 and 5");
    let e = completion(completion_with(json!({"max_tokens": 0}))).unwrap_err();
    assert_eq!(e.message, "max_tokens is 0 but must be at least 1");
}

#[test]
fn edges_of_the_ranges_are_accepted() {
    chat(chat_with(json!({
        "temperature": 2, "top_p": 1, "presence_penalty": -2, "frequency_penalty": 2,
        "n": 16, "max_tokens": 1, "logit_bias": {"0": -100, "1": 100},
        "logprobs": true, "top_logprobs": 20, "stop": ["a", "b", "c", "d"], "min_p": 1,
    })))
    .unwrap();
    // top_logprobs 0 without logprobs asks for nothing.
    chat(chat_with(json!({"top_logprobs": 0}))).unwrap();
}

#[test]
fn tools_and_tool_results_reach_the_coordinator() {
    let weather_tool = json!([{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}
        }
    }]);
    let g = chat(chat_with(json!({
        "tools": weather_tool,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": false,
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "22C"}
        ]
    })))
    .unwrap();
    let Some(Prompt::Chat(c)) = g.prompt else {
        panic!("a chat")
    };
    assert_eq!(
        serde_json::from_str::<Value>(&c.tools_json).unwrap(),
        weather_tool
    );
    assert_eq!(c.tool_choice, ToolChoice::Function as i32);
    assert_eq!(c.tool_choice_function, "get_weather");
    assert_eq!(c.parallel_tool_calls, Some(false));
    assert_eq!(
        c.messages[1].tool_calls[0].arguments,
        "{\"city\": \"Oslo\"}"
    );
    assert_eq!(c.messages[2].tool_call_id, "c1");
    for (choice, want) in [
        (json!("required"), ToolChoice::Required),
        (json!("none"), ToolChoice::None),
        (json!("auto"), ToolChoice::Auto),
    ] {
        let g = chat(chat_with(
            json!({"tools": weather_tool, "tool_choice": choice}),
        ))
        .unwrap();
        let Some(Prompt::Chat(c)) = g.prompt else {
            panic!("a chat")
        };
        assert_eq!(c.tool_choice, want as i32);
    }
}

#[test]
fn bad_tool_fields_and_deprecated_functions_are_400() {
    let cases = [
        (json!({"tools": {"a": 1}}), "tools", "must be an array"),
        (
            json!({"tool_choice": "always"}),
            "tool_choice",
            "\"always\"",
        ),
        (
            json!({"tool_choice": {"type": "function"}}),
            "tool_choice",
            "must be",
        ),
        (
            json!({"functions": [{"name": "f", "parameters": {}}]}),
            "functions",
            "deprecated",
        ),
        (
            json!({"function_call": {"name": "f"}}),
            "function_call",
            "deprecated",
        ),
        (
            json!({"messages": [{"role": "tool", "content": "22C"}]}),
            "messages[0].tool_call_id",
            "without `tool_call_id`",
        ),
        (
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"arguments": "{}"}}]}]}),
            "messages[0].tool_calls[0]",
            "no `name`",
        ),
    ];
    for (patch, param, says) in cases {
        let e = chat(chat_with(patch.clone())).unwrap_err();
        assert_eq!(
            (e.status, e.param.as_deref()),
            (400, Some(param)),
            "{patch}"
        );
        assert!(e.message.contains(says), "{patch}: {}", e.message);
    }
    // The coordinator's verdicts on tools name their fields (as it sends them).
    for (field, msg, param) in [
        (
            "chat.tool_choice_function",
            "tool_choice names the function \"x\", which is not among the tools (a)",
            "tool_choice",
        ),
        (
            "chat.tools_json[0].function",
            "tools[0].function has no `name`",
            "tools[0].function",
        ),
        (
            "chat.messages[1].tool_calls[0].arguments",
            "messages[1].tool_calls[0].function.arguments is not JSON: x",
            "messages[1].tool_calls[0].function.arguments",
        ),
    ] {
        let e = from_status(&omni_proto::errors::invalid(field, msg));
        assert_eq!(e.param.as_deref(), Some(param), "{msg}");
    }
}

/// The grammar a request's structured-output fields send to the coordinator.
fn grammar_of(r: &GenerateRequest) -> Option<Kind> {
    r.sampling.as_ref()?.grammar.as_ref()?.kind.clone()
}

#[test]
fn structured_output_reaches_the_coordinator_as_a_grammar() {
    let schema =
        json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
    let cases = [
        (json!({"response_format": {"type": "text"}}), None),
        (
            json!({"response_format": {"type": "json_object"}}),
            Some(Kind::JsonObject(JsonObject {})),
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": true, "schema": schema}}}),
            Some(Kind::JsonSchema(schema.to_string())),
        ),
        // OpenAI's schema is optional: any object then.
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}),
            Some(Kind::JsonObject(JsonObject {})),
        ),
        // llama.cpp's forms.
        (
            json!({"response_format": {"type": "json_object", "schema": schema}}),
            Some(Kind::JsonSchema(schema.to_string())),
        ),
        (
            json!({"json_schema": schema}),
            Some(Kind::JsonSchema(schema.to_string())),
        ),
        (
            json!({"grammar": "start: \"yes\" | \"no\""}),
            Some(Kind::Lark("start: \"yes\" | \"no\"".into())),
        ),
    ];
    for (patch, want) in cases {
        assert_eq!(
            grammar_of(&chat(chat_with(patch.clone())).unwrap()),
            want,
            "{patch}"
        );
        let r = completion(completion_with(patch.clone())).unwrap();
        assert_eq!(grammar_of(&r), want, "{patch}");
    }
}

#[test]
fn bad_structured_output_fields_are_400_and_say_what_to_send() {
    let cases = [
        (
            json!({"response_format": "json"}),
            "response_format",
            "response_format is a string but must be an object",
        ),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format.type",
            "response_format.type is \"yaml\" but must be one of text, json_object, json_schema",
        ),
        (
            json!({"response_format": {"type": "json_schema"}}),
            "response_format.json_schema",
            "needs a `json_schema` object",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}),
            "response_format.json_schema.schema",
            "is an array but a JSON schema is an object",
        ),
        (
            json!({"grammar": "root ::= \"yes\""}),
            "grammar",
            "grammar looks like GBNF",
        ),
        (json!({"grammar": 7}), "grammar", "must be a string"),
        (
            json!({"json_schema": {}, "grammar": "start: \"a\""}),
            "grammar",
            "json_schema and grammar both constrain the output",
        ),
    ];
    for (patch, param, says) in cases {
        for e in [
            chat(chat_with(patch.clone())).unwrap_err(),
            completion(completion_with(patch.clone())).unwrap_err(),
        ] {
            assert_eq!(
                (e.status, e.param.as_deref()),
                (400, Some(param)),
                "{patch}"
            );
            assert!(e.message.contains(says), "{patch}: {}", e.message);
        }
    }
    // The coordinator's verdict on the schema itself names the field.
    let e = omni_router::openai::from_status(&omni_proto::errors::invalid(
        "sampling.grammar.json_schema",
        "invalid JSON schema: unknown type \"integr\"",
    ));
    assert_eq!(e.param.as_deref(), Some("response_format"));
    let e = omni_router::openai::from_status(&omni_proto::errors::invalid(
        "sampling.grammar.lark",
        "invalid Lark grammar: expecting rule",
    ));
    assert_eq!(e.param.as_deref(), Some("grammar"));
}

#[test]
fn malformed_bodies_are_400_and_name_the_field() {
    let parse = |b: &str| parse_json::<ChatCompletionRequest>(b.as_bytes()).unwrap_err();

    let e = parse(r#"{"model": "gemma", "messages": ["#);
    assert_eq!((e.status, e.param.as_deref()), (400, None));
    assert!(
        e.message.starts_with("the request body is not valid JSON"),
        "{}",
        e.message
    );
    let e = parse("");
    assert_eq!(e.message, "the request body is empty; send a JSON object");
    let e = parse(r#"{"model": "gemma", "messages": []} trailing"#);
    assert!(e.message.starts_with("the request body is not valid JSON"));

    let e = parse(r#"{"model": "gemma", "messages": [], "temperature": "hot"}"#);
    assert_eq!(e.param.as_deref(), Some("temperature"));
    assert!(
        e.message
            .starts_with("temperature: invalid type: string \"hot\""),
        "{}",
        e.message
    );
    let e = parse(r#"{"messages": []}"#);
    assert_eq!(e.param.as_deref(), Some("model"));
    assert!(e.message.contains("missing field `model`"));
    let e = parse(r#"{"model": "gemma"}"#);
    assert_eq!(e.param.as_deref(), Some("messages"));
    let e = parse(r#"{"model": "gemma", "messages": [{"content": "hi"}]}"#);
    assert_eq!(e.param.as_deref(), Some("messages[0].role"));
    let e = parse(r#"{"model": "gemma", "messages": [], "n": 1.5}"#);
    assert_eq!(e.param.as_deref(), Some("n"));
    let e = parse("[1, 2]");
    assert_eq!(e.status, 400);
}

#[test]
fn integers_may_have_a_zero_fraction() {
    // OpenAI's spec types these as JSON Schema `integer`, which 8.0 is; schemathesis sends
    // such values, and so can any client that keeps numbers as floats.
    let body = chat_with(json!({
        "n": 2.0, "max_tokens": 8.0, "max_completion_tokens": 6.0, "seed": 7.0,
        "logprobs": true, "top_logprobs": 3.0, "top_k": 40.0,
    }));
    let req: ChatCompletionRequest = parse_json(body.to_string().as_bytes()).unwrap();
    assert_eq!(req.n(), 2);
    let g = req.to_generate().unwrap();
    assert_eq!((g.max_tokens, g.top_logprobs), (Some(6), 3));
    let s = g.sampling.unwrap();
    assert_eq!((s.seed, s.top_k), (Some(7), 40));
    let g = completion(completion_with(json!({
        "prompt": [2.0, 9259.0], "max_tokens": 4.0, "logprobs": 2.0, "best_of": 1.0,
    })))
    .unwrap();
    assert_eq!(
        g.prompt,
        Some(Prompt::Ids(omni_proto::coordinator::v1::TokenIds {
            ids: vec![2, 9259]
        }))
    );
    assert_eq!((g.max_tokens, g.top_logprobs), (Some(4), 2));

    // A fraction is still a 400 that names the field.
    let e = chat(chat_with(json!({"n": 1.5}))).unwrap_err();
    assert_eq!((e.status, e.param.as_deref()), (400, Some("n")));
    assert!(
        e.message
            .starts_with("n: invalid value: 1.5, expected an integer"),
        "{}",
        e.message
    );
    let e = chat(chat_with(json!({"max_tokens": 1e300}))).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("max_tokens"));
    let e = chat(chat_with(json!({"seed": 0.5}))).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("seed"));
    let e = completion(completion_with(json!({"prompt": [1, 2.5]}))).unwrap_err();
    assert_eq!(
        e.message,
        "prompt[1] is 2.5 but token ids must be integers from 0 to 4294967295"
    );
}

#[test]
fn each_choice_gets_its_own_seed() {
    let mut base = chat(chat_with(json!({"n": 3, "seed": 7}))).unwrap();
    base.request_id = "chatcmpl-x".into();
    let seeds: Vec<Option<u64>> = (0..3)
        .map(|i| choice_request(&base, i).sampling.unwrap().seed)
        .collect();
    assert_eq!(seeds, vec![Some(7), Some(8), Some(9)]);
    assert_eq!(choice_request(&base, 0).request_id, "chatcmpl-x");
    assert_eq!(choice_request(&base, 2).request_id, "chatcmpl-x-2");
    let unseeded = chat(chat_with(json!({"n": 2}))).unwrap();
    assert_eq!(choice_request(&unseeded, 1).sampling.unwrap().seed, None);
}

// ---------------------------------------------------------------------------------------
// Errors on the wire
// ---------------------------------------------------------------------------------------

#[test]
fn error_bodies_have_openais_shape() {
    let e = ApiError::out_of_range("temperature", 3.5, "between 0 and 2");
    assert_eq!(
        e.body(),
        json!({"error": {
            "message": "temperature is 3.5 but must be between 0 and 2",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": null,
        }})
    );

    let cases = [
        (ApiError::missing_api_key(), 401, Some("invalid_api_key")),
        (ApiError::invalid_api_key(), 401, Some("invalid_api_key")),
        (
            ApiError::model_not_found("gpt-9", &["gemma".into(), "auto".into()]),
            404,
            Some("model_not_found"),
        ),
        (
            ApiError::method_not_allowed("GET", "/v1/completions"),
            405,
            None,
        ),
        (ApiError::body_too_large(1 << 20), 413, None),
        (
            ApiError::unsupported_media_type(Some("text/plain")),
            415,
            None,
        ),
        (
            ApiError::rate_limited(64, 1),
            429,
            Some("rate_limit_exceeded"),
        ),
        (ApiError::unavailable("the cluster is loading"), 503, None),
        (ApiError::timeout("no answer in 30 s"), 504, Some("timeout")),
        (ApiError::internal("boom"), 500, None),
    ];
    for (e, status, code) in cases {
        assert_eq!(e.status, status, "{e}");
        assert_eq!(e.code, code, "{e}");
        let body = e.body();
        assert_eq!(keys(&body["error"]), ["code", "message", "param", "type"]);
        assert_eq!(body["error"]["code"], json!(code));
        let want_type = if status < 500 && status != 429 {
            "invalid_request_error"
        } else if status == 429 {
            "requests"
        } else {
            "server_error"
        };
        assert_eq!(body["error"]["type"], want_type, "{e}");
    }
    let e = ApiError::model_not_found("gpt-9", &["gemma".into(), "auto".into()]);
    assert_eq!(
        e.message,
        "the model `gpt-9` does not exist (available: gemma, auto)"
    );
    assert_eq!(e.param.as_deref(), Some("model"));
    assert!(ApiError::body_too_large(1048576)
        .message
        .contains("limit of 1048576 bytes"));
}

/// Polls a future that is ready at once (a response body already in memory).
fn ready<F: std::future::Future>(f: F) -> F::Output {
    let mut cx = Context::from_waker(Waker::noop());
    match pin!(f).poll(&mut cx) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("the body was not ready"),
    }
}

#[test]
fn errors_become_http_responses() {
    let resp = ApiError::rate_limited(64, 2).into_response();
    assert_eq!(resp.status().as_u16(), 429);
    assert_eq!(resp.headers()["retry-after"], "2");
    assert_eq!(resp.headers()["content-type"], "application/json");
    let bytes = ready(axum::body::to_bytes(resp.into_body(), usize::MAX)).unwrap();
    let body: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    assert_eq!(
        body["error"]["message"],
        "64 requests are already in flight, the most this router accepts; retry in 2 s"
    );

    let resp = ApiError::invalid("messages", "messages is empty").into_response();
    assert_eq!(resp.status().as_u16(), 400);
    assert!(resp.headers().get("retry-after").is_none());
}

#[test]
fn mid_stream_errors_are_sse_events() {
    let e = ApiError::unavailable("worker gpu-1 went away; the request was stopped");
    let event = e.sse();
    assert!(
        event.starts_with("data: {") && event.ends_with("}\n\n"),
        "{event}"
    );
    let body: Value = serde_json::from_str(&event["data: ".len()..]).unwrap();
    assert_eq!(body, e.body());
    assert_eq!(body["error"]["type"], "server_error");
}

#[test]
fn coordinator_statuses_map_to_http() {
    use omni_proto::errors::{invalid, status, Reason};
    use tonic::{Code, Status};
    // As the coordinator sends them: the field and the reason in the details.
    let e = from_status(&status(
        Code::InvalidArgument,
        Reason::PromptTooLong,
        Some("prompt"),
        "the prompt has 5000 tokens but the context is 4096 tokens",
    ));
    assert_eq!(e.status, 400);
    assert_eq!(e.code, Some("context_length_exceeded"));
    assert_eq!(e.kind, "invalid_request_error");
    assert_eq!(
        e.message,
        "the prompt has 5000 tokens but the context is 4096 tokens"
    );
    assert_eq!(e.param.as_deref(), Some("prompt"));
    assert_eq!(e.clone().in_chat().param.as_deref(), Some("messages"));
    assert_eq!(e.in_completions().param.as_deref(), Some("prompt"));

    let e = from_status(&invalid(
        "sampling.logit_bias",
        "invalid sampling parameter logit_bias = token 300000: allowed token ids < 262144",
    ));
    assert_eq!((e.status, e.param.as_deref()), (400, Some("logit_bias")));
    assert_eq!(e.in_chat().param.as_deref(), Some("logit_bias"));
    let e = from_status(&invalid(
        "top_logprobs",
        "top_logprobs is 25 but at most 20 are allowed",
    ));
    assert_eq!(e.clone().param.as_deref(), Some("top_logprobs"));
    assert_eq!(e.in_completions().param.as_deref(), Some("logprobs"));
    let e = from_status(&invalid(
        "prompt",
        "token id 999999 is outside the vocabulary of 262144 tokens",
    ));
    assert_eq!(e.param.as_deref(), Some("prompt"));
    // Chat fields: where the coordinator's request keeps them, where OpenAI's does.
    for (field, param) in [
        ("chat.tool_choice_function", "tool_choice"),
        ("chat.tools_json", "tools"),
        ("chat.messages", "messages"),
        (
            "chat.messages[2].tool_calls[0].arguments",
            "messages[2].tool_calls[0].function.arguments",
        ),
        ("sampling.temperature", "temperature"),
    ] {
        assert_eq!(
            from_status(&invalid(field, "x")).param.as_deref(),
            Some(param)
        );
    }
    // A message alone names no field, whatever it says.
    let e = from_status(&Status::invalid_argument("the prompt is wrong"));
    assert_eq!((e.status, e.param), (400, None));

    let e = from_status(&Status::failed_precondition(
        "this model has no usable chat template",
    ));
    assert_eq!(e.status, 400);
    assert_eq!(e.message, "this model has no usable chat template");

    let e = from_status(&Status::unavailable(
        "the cluster is not ready yet (loading)",
    ));
    assert_eq!((e.status, e.kind), (503, "server_error"));
    assert_eq!(e.message, "the cluster is not ready yet (loading)");
    assert_eq!(from_status(&Status::deadline_exceeded("slow")).status, 504);
    let e = from_status(&Status::internal("stage 1 failed: out of memory"));
    assert_eq!(e.status, 500);
    assert!(e.message.contains("stage 1 failed: out of memory"));
    assert_eq!(from_status(&Status::unknown("?")).status, 500);
    assert_eq!(from_status(&Status::resource_exhausted("?")).status, 500);
}

// ---------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------

/// Two choices: "Hello" (tokens 0, 1; cut by max_tokens) and " world" (2, 3; stopped).
fn two_choices() -> Vec<Generated> {
    let mut a = Generated::default();
    a.push(&GenerateEvent {
        prompt_ids: vec![2, 10, 11, 12, 13],
        tokens: vec![token(0, -0.5, &[(0, -0.5), (2, -1.5)])],
        text: "Hel".into(),
        done: None,
        ..Default::default()
    });
    a.push(&GenerateEvent {
        prompt_ids: vec![],
        tokens: vec![token(1, -0.25, &[(1, -0.25), (3, -2.0)])],
        text: "lo".into(),
        done: Some(done(FinishReason::Length, 5, 2)),
        ..Default::default()
    });
    let mut b = Generated::default();
    b.push(&GenerateEvent {
        prompt_ids: vec![2, 10, 11, 12, 13],
        tokens: vec![
            token(2, -1.0, &[(2, -1.0)]),
            token(3, f32::NEG_INFINITY, &[(3, f32::NEG_INFINITY)]),
        ],
        text: " world".into(),
        done: Some(done(FinishReason::Stop, 5, 2)),
        ..Default::default()
    });
    vec![a, b]
}

#[test]
fn chat_completion_json() {
    let outputs = two_choices();
    assert_eq!(outputs[0].text, "Hello");
    assert_eq!(outputs[0].tokens.len(), 2);
    let c = ChatCompletion::build(
        new_id("chatcmpl-"),
        1_700_000_000,
        "gemma",
        &outputs,
        true,
        text_of,
    );
    let v = json_of(&c);
    assert_eq!(
        keys(&v),
        ["choices", "created", "id", "model", "object", "usage"]
    );
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["created"], 1_700_000_000);
    assert_eq!(v["model"], "gemma");
    // The prompt is counted once for n choices.
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9})
    );
    let c0 = &v["choices"][0];
    assert_eq!(keys(c0), ["finish_reason", "index", "logprobs", "message"]);
    assert_eq!(c0["index"], 0);
    assert_eq!(
        c0["message"],
        json!({"role": "assistant", "content": "Hello", "refusal": null, "annotations": []})
    );
    assert_eq!(c0["finish_reason"], "length");
    assert_eq!(
        c0["logprobs"],
        json!({"content": [
            {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108], "top_logprobs": [
                {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
                {"token": " wor", "logprob": -1.5, "bytes": [32, 119, 111, 114]},
            ]},
            {"token": "lo", "logprob": -0.25, "bytes": [108, 111], "top_logprobs": [
                {"token": "lo", "logprob": -0.25, "bytes": [108, 111]},
                {"token": "ld", "logprob": -2.0, "bytes": [108, 100]},
            ]},
        ], "refusal": null})
    );
    let c1 = &v["choices"][1];
    assert_eq!(c1["index"], 1);
    assert_eq!(c1["message"]["content"], " world");
    assert_eq!(c1["finish_reason"], "stop");
    // JSON has no -infinity: OpenAI's floor instead.
    assert_eq!(c1["logprobs"]["content"][1]["logprob"], -9999.0);

    // Without logprobs asked, the key is there and null.
    let v = json_of(&ChatCompletion::build(
        "chatcmpl-1".into(),
        1,
        "gemma",
        &outputs[..1],
        false,
        text_of,
    ));
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7})
    );
}

#[test]
fn completion_json_with_legacy_logprobs() {
    let c = Completion::build(
        new_id("cmpl-"),
        1_700_000_000,
        "gemma",
        &two_choices(),
        true,
        text_of,
    );
    let v = json_of(&c);
    assert_eq!(
        keys(&v),
        ["choices", "created", "id", "model", "object", "usage"]
    );
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    let c0 = &v["choices"][0];
    assert_eq!(keys(c0), ["finish_reason", "index", "logprobs", "text"]);
    assert_eq!(c0["text"], "Hello");
    assert_eq!(c0["finish_reason"], "length");
    assert_eq!(
        c0["logprobs"],
        json!({
            "tokens": ["Hel", "lo"],
            "token_logprobs": [-0.5, -0.25],
            "top_logprobs": [{"Hel": -0.5, " wor": -1.5}, {"lo": -0.25, "ld": -2.0}],
            "text_offset": [0, 3],
        })
    );
    assert_eq!(v["choices"][1]["logprobs"]["text_offset"], json!([0, 4]));

    let v = json_of(&Completion::build(
        "cmpl-1".into(),
        1,
        "gemma",
        &two_choices(),
        false,
        text_of,
    ));
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
}

#[test]
fn chat_stream_chunks_with_usage() {
    let s = ChatStream::new("gemma", true, false);
    assert!(s.id.starts_with("chatcmpl-"));
    let mut chunks = vec![s.role(0)];
    chunks.extend(s.event(
        0,
        &GenerateEvent {
            prompt_ids: vec![2, 3],
            tokens: vec![token(0, -0.5, &[])],
            text: "Hel".into(),
            done: None,
            ..Default::default()
        },
        text_of,
    ));
    // Tokens held back (a possible stop string) and no text: no chunk.
    assert!(s
        .event(
            0,
            &GenerateEvent {
                prompt_ids: vec![],
                tokens: vec![token(1, -0.5, &[])],
                text: String::new(),
                done: None,
                ..Default::default()
            },
            text_of,
        )
        .is_empty());
    chunks.extend(s.event(
        0,
        &GenerateEvent {
            prompt_ids: vec![],
            tokens: vec![token(1, -0.5, &[])],
            text: "lo".into(),
            done: Some(done(FinishReason::Stop, 2, 2)),
            ..Default::default()
        },
        text_of,
    ));
    chunks.push(s.usage(Usage::new(2, 2)));
    let v: Vec<Value> = chunks.iter().map(json_of).collect();
    assert_eq!(v.len(), 5);
    for c in &v {
        assert_eq!(c["id"], s.id.as_str());
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], "gemma");
        assert_eq!(c["created"], s.created);
        assert_eq!(
            keys(c),
            ["choices", "created", "id", "model", "object", "usage"]
        );
    }
    assert_eq!(
        v[0]["choices"],
        json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}])
    );
    assert_eq!(v[0]["usage"], Value::Null);
    assert_eq!(
        v[1]["choices"],
        json!([{"index": 0, "delta": {"content": "Hel"}, "logprobs": null, "finish_reason": null}])
    );
    assert_eq!(v[2]["choices"][0]["delta"], json!({"content": "lo"}));
    assert_eq!(
        v[3]["choices"],
        json!([{"index": 0, "delta": {}, "logprobs": null, "finish_reason": "stop"}])
    );
    assert_eq!(v[3]["usage"], Value::Null);
    assert_eq!(v[4]["choices"], json!([]));
    assert_eq!(
        v[4]["usage"],
        json!({"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4})
    );

    let sse = sse_data(&chunks[1]);
    assert!(sse.starts_with("data: {\"id\":\"chatcmpl-"), "{sse}");
    assert!(sse.ends_with("}\n\n"));
    assert!(!sse[..sse.len() - 2].contains('\n'));
    assert_eq!(serde_json::from_str::<Value>(&sse[6..]).unwrap(), v[1]);
    assert_eq!(SSE_DONE, "data: [DONE]\n\n");
}

#[test]
fn chat_stream_without_usage_has_no_usage_key() {
    let s = ChatStream::new("gemma", false, true);
    let chunks = s.event(
        1,
        &GenerateEvent {
            prompt_ids: vec![],
            tokens: vec![token(4, -0.1, &[(4, -0.1)])],
            text: "é".into(),
            done: Some(done(FinishReason::Length, 3, 1)),
            ..Default::default()
        },
        text_of,
    );
    assert_eq!(chunks.len(), 2);
    let v: Vec<Value> = chunks.iter().map(json_of).collect();
    for c in &v {
        assert!(c.get("usage").is_none(), "{c}");
    }
    assert_eq!(v[0]["choices"][0]["index"], 1);
    assert_eq!(
        v[0]["choices"][0]["logprobs"],
        json!({"content": [{"token": "é", "logprob": -0.1_f32, "bytes": [195, 169],
            "top_logprobs": [{"token": "é", "logprob": -0.1_f32, "bytes": [195, 169]}]}],
            "refusal": null})
    );
    assert_eq!(v[1]["choices"][0]["finish_reason"], "length");
}

#[test]
fn completion_stream_chunks() {
    let mut s = CompletionStream::new("gemma", true, true);
    assert!(s.id.starts_with("cmpl-"));
    let mut chunks = s.event(
        0,
        &GenerateEvent {
            prompt_ids: vec![1],
            tokens: vec![token(0, -0.5, &[(0, -0.5)]), token(1, -0.7, &[])],
            text: "Hello".into(),
            done: None,
            ..Default::default()
        },
        text_of,
    );
    chunks.extend(s.event(
        0,
        &GenerateEvent {
            prompt_ids: vec![],
            tokens: vec![token(2, -0.3, &[])],
            text: " wor".into(),
            done: Some(done(FinishReason::Length, 1, 3)),
            ..Default::default()
        },
        text_of,
    ));
    chunks.push(s.usage(Usage::new(1, 3)));
    let v: Vec<Value> = chunks.iter().map(json_of).collect();
    assert_eq!(v.len(), 4);
    for c in &v {
        assert_eq!(c["id"], s.id.as_str());
        assert_eq!(c["object"], "text_completion");
    }
    assert_eq!(v[0]["usage"], Value::Null);
    assert_eq!(
        v[0]["choices"],
        json!([{"index": 0, "text": "Hello", "finish_reason": null, "logprobs": {
            "tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -0.7_f32],
            "top_logprobs": [{"Hel": -0.5}, {}], "text_offset": [0, 3]}}])
    );
    // Offsets carry on from the previous chunk.
    assert_eq!(v[1]["choices"][0]["logprobs"]["text_offset"], json!([5]));
    assert_eq!(
        v[2]["choices"],
        json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}])
    );
    assert_eq!(v[3]["choices"], json!([]));
    assert_eq!(v[3]["usage"]["total_tokens"], 4);

    let mut plain = CompletionStream::new("gemma", false, false);
    let c = json_of(&plain.text(0, "hi", &[], text_of));
    assert!(c.get("usage").is_none());
    assert_eq!(c["choices"][0]["logprobs"], Value::Null);
}

#[test]
fn ids_are_unique() {
    let a = new_id("chatcmpl-");
    let b = new_id("chatcmpl-");
    assert_ne!(a, b);
    assert_eq!(a.len(), "chatcmpl-".len() + 24);
    assert!(unix_now() > 1_700_000_000);
}

#[test]
fn finish_reasons() {
    assert_eq!(finish_reason(FinishReason::Stop as i32), "stop");
    assert_eq!(finish_reason(FinishReason::Length as i32), "length");
    assert_eq!(finish_reason(FinishReason::Unspecified as i32), "stop");
}

#[test]
fn models_list_json() {
    let list = ModelList::new(["gemma", "auto"], 1_700_000_000);
    assert_eq!(
        json_of(&list),
        json!({"object": "list", "data": [
            {"id": "gemma", "object": "model", "created": 1_700_000_000, "owned_by": "omni"},
            {"id": "auto", "object": "model", "created": 1_700_000_000, "owned_by": "omni"},
        ]})
    );
}

/// An answer of tool calls as OpenAI sends it: `content` null, the calls
/// with ids and their arguments as a string, `finish_reason: "tool_calls"`;
/// streamed, each call as two deltas (index, id, type and name, then the
/// arguments).
#[test]
fn tool_calls_in_responses_and_stream_deltas() {
    let call = ToolCallOut {
        index: 0,
        id: "call_abc".into(),
        name: "get_weather".into(),
        arguments: "{\"city\":\"Oslo\"}".into(),
    };
    let ev = GenerateEvent {
        tokens: vec![token(0, -0.1, &[])],
        tool_calls: vec![call.clone()],
        done: Some(done(FinishReason::ToolCalls, 5, 12)),
        ..Default::default()
    };
    let mut g = Generated::default();
    g.push(&ev);
    let body = json_of(&ChatCompletion::build(
        "id".into(),
        1,
        "qwen",
        &[g],
        false,
        text_of,
    ));
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], Value::Null);
    assert_eq!(
        choice["message"]["tool_calls"],
        json!([{"id": "call_abc", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}])
    );

    let s = ChatStream::new("qwen", false, false);
    let chunks: Vec<Value> = s.event(0, &ev, text_of).iter().map(json_of).collect();
    assert_eq!(chunks.len(), 3, "{chunks:?}");
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"tool_calls": [{"index": 0, "id": "call_abc", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]})
    );
    assert_eq!(
        chunks[1]["choices"][0]["delta"],
        json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":\"Oslo\"}"}}]})
    );
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], "tool_calls");

    // A call streamed in pieces: the name first, then argument text.
    let pieces = [
        ToolCallOut {
            arguments: String::new(),
            ..call.clone()
        },
        ToolCallOut {
            arguments: "{\"city\":".into(),
            ..ToolCallOut::default()
        },
        ToolCallOut {
            arguments: "\"Oslo\"}".into(),
            ..ToolCallOut::default()
        },
    ];
    let mut g = Generated::default();
    let mut deltas = Vec::new();
    for p in pieces {
        let ev = GenerateEvent {
            tool_calls: vec![p],
            ..Default::default()
        };
        g.push(&ev);
        deltas.extend(s.event(0, &ev, text_of).iter().map(json_of));
    }
    assert_eq!(g.tool_calls.len(), 1);
    assert_eq!(g.tool_calls[0].arguments, "{\"city\":\"Oslo\"}");
    assert_eq!(deltas.len(), 3);
    assert_eq!(
        deltas[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    assert_eq!(
        deltas[2]["choices"][0]["delta"],
        json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]})
    );
}
