//! Validation errors

use super::*;

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
        // OpenAI's default `text` constrains nothing: a llama.cpp field
        // beside it is the constraint.
        (
            json!({"response_format": {"type": "text"}, "json_schema": schema}),
            Some(Kind::JsonSchema(schema.to_string())),
        ),
        (
            json!({"response_format": {"type": "text"}, "grammar": "start: \"a\""}),
            Some(Kind::Lark("start: \"a\"".into())),
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
