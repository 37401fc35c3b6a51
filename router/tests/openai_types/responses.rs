//! Responses

use super::*;

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
        done: Some(Done {
            cached_tokens: 3,
            ..done(FinishReason::Length, 5, 2)
        }),
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
        done: Some(Done {
            cached_tokens: 3,
            ..done(FinishReason::Stop, 5, 2)
        }),
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
        ["choices", "created", "id", "model", "object", "timings", "usage"]
    );
    // llama-server's timings: no draft fields without drafts.
    assert_eq!(
        v["timings"],
        json!({"prompt_n": 2, "cache_n": 3, "prompt_ms": 1.0, "predicted_n": 4, "predicted_ms": 1.0, "predicted_per_second": 4000.0})
    );
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["created"], 1_700_000_000);
    assert_eq!(v["model"], "gemma");
    // The prompt (and its tokens from the prefix cache) is counted once
    // for n choices.
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 3}})
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
        json!({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 3}})
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
        ["choices", "created", "id", "model", "object", "timings", "usage"]
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
    let timings = Timings {
        predicted_n: 2,
        draft_n: Some(3),
        draft_n_accepted: Some(1),
        ..Default::default()
    };
    chunks.push(s.usage(Usage::new(2, 2), timings));
    let v: Vec<Value> = chunks.iter().map(json_of).collect();
    assert_eq!(v.len(), 5);
    for (i, c) in v.iter().enumerate() {
        assert_eq!(c["id"], s.id.as_str());
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], "gemma");
        assert_eq!(c["created"], s.created);
        // The usage chunk carries llama-server's timings too.
        let mut want = vec!["choices", "created", "id", "model", "object", "usage"];
        if i == 4 {
            want.insert(5, "timings");
        }
        assert_eq!(keys(c), want);
    }
    assert_eq!(v[4]["timings"]["draft_n"], 3);
    assert_eq!(v[4]["timings"]["draft_n_accepted"], 1);
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
        json!({"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4, "prompt_tokens_details": {"cached_tokens": 0}})
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
    chunks.push(s.usage(Usage::new(1, 3), Timings::default()));
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
