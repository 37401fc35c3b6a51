//! Requests the clients send

use super::*;

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
        "speculative.n_max": 12,
        "speculative.n_min": 2,
        // Sent by clients, meaningless here: ignored.
        "store": false,
        "speculative.p_min": 0.75,
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
    let sp = g.speculative.unwrap();
    assert_eq!((sp.n_max, sp.n_min), (Some(12), Some(2)));
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
