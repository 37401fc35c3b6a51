use super::grammar::*;
use super::parse::*;
use super::*;
use crate::sampling::Grammar;

/// Feeds `out` in pieces of `step` bytes (at char boundaries) and
/// collects what comes out, merging adjacent text.
fn parse(format: ToolFormat, out: &str, step: usize) -> Vec<Piece> {
    let mut p = CallParser::new(format);
    let mut got = Vec::new();
    let mut rest = out;
    while !rest.is_empty() {
        let mut n = step.min(rest.len());
        while !rest.is_char_boundary(n) {
            n += 1;
        }
        got.extend(p.push(&rest[..n]));
        rest = &rest[n..];
    }
    got.extend(p.finish());
    let mut merged: Vec<Piece> = Vec::new();
    for g in got {
        match (merged.last_mut(), g) {
            (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
            (_, g) => merged.push(g),
        }
    }
    merged
}

fn call(name: &str, args: Value) -> Piece {
    Piece::Call(ParsedCall {
        name: name.into(),
        arguments: args.to_string(),
    })
}

fn text(t: &str) -> Piece {
    Piece::Text(t.into())
}

#[test]
fn hermes_calls_with_text_around_them_in_any_chunking() {
    let out = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": \\\"CET\\\"}\"}\n</tool_call>";
    for step in [1, 2, 3, 7, 1000] {
        assert_eq!(
            parse(ToolFormat::Hermes, out, step),
            vec![
                text("Let me check.\n"),
                call("get_weather", json!({"city": "Paris"})),
                text("\n"),
                call("get_time", json!({"tz": "CET"})),
            ],
            "step {step}"
        );
    }
    // A call first, fed a byte at a time.
    let first = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
    assert_eq!(
        parse(ToolFormat::Hermes, first, 1),
        vec![call("f", json!({}))]
    );
    // Text that only looks like the start of a marker goes out.
    assert_eq!(
        parse(ToolFormat::Hermes, "a <b> <tool", 1),
        vec![text("a <b> <tool")]
    );
}

#[test]
fn hermes_calls_without_tags_as_small_models_write_them() {
    let bare = "{\"name\": \"get_time\", \"arguments\": {\"timezone\": \"Europe/Berlin\"}}";
    assert_eq!(
        parse(ToolFormat::Hermes, bare, 3),
        vec![call("get_time", json!({"timezone": "Europe/Berlin"}))]
    );
    let fenced = format!("```json\n{bare}\n{bare}\n```");
    assert_eq!(parse(ToolFormat::Hermes, &fenced, 5).len(), 2);
    // JSON that is not a call, or a call and then prose, is text.
    let echo = format!("{bare}\nThe weather is fine.");
    assert_eq!(parse(ToolFormat::Hermes, &echo, 4), vec![text(&echo)]);
    assert_eq!(
        parse(ToolFormat::Hermes, "{\"a\": 1}", 4),
        vec![text("{\"a\": 1}")]
    );
    // Prose first: a later brace is only text.
    assert_eq!(
        parse(ToolFormat::Hermes, "Here: {\"name\": \"f\"}", 4),
        vec![text("Here: {\"name\": \"f\"}")]
    );
}

#[test]
fn constrained_hermes_calls_stream_their_arguments() {
    let out = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa}ris\", \"n\": [1, {\"x\": \"\\\"\"}]}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
    for step in [1, 3, 1000] {
        let mut p = CallParser::streaming(ToolFormat::Hermes);
        let mut got = Vec::new();
        let mut rest = out;
        while !rest.is_empty() {
            let n = step.min(rest.len());
            got.extend(p.push(&rest[..n]));
            rest = &rest[n..];
        }
        got.extend(p.finish());
        // Name first, then argument pieces that add up to the JSON.
        let mut calls: Vec<(String, String)> = Vec::new();
        let mut open = false;
        for g in &got {
            match g {
                Piece::CallStart { name } => {
                    assert!(!open);
                    open = true;
                    calls.push((name.clone(), String::new()));
                }
                Piece::CallArgs(a) => calls.last_mut().unwrap().1.push_str(a),
                Piece::CallEnd => open = false,
                Piece::Text(t) => assert!(t.trim().is_empty(), "{t:?}"),
                Piece::Call(c) => panic!("read whole: {c:?}"),
            }
        }
        assert!(!open);
        assert_eq!(calls.len(), 2, "step {step}: {got:?}");
        assert_eq!(calls[0].0, "get_weather");
        let v: Value = serde_json::from_str(&calls[0].1).unwrap();
        assert_eq!(v, json!({"city": "Pa}ris", "n": [1, {"x": "\""}]}));
        assert_eq!((calls[1].0.as_str(), calls[1].1.as_str()), ("f", "{}"));
        if step == 1 {
            assert!(
                got.iter()
                    .filter(|g| matches!(g, Piece::CallArgs(_)))
                    .count()
                    > 10
            );
        }
    }
    // Something else inside the tags is read whole.
    let mut p = CallParser::streaming(ToolFormat::Hermes);
    let mut got = p.push("<tool_call>\n{\"arguments\": {}, \"name\": \"f\"}\n</tool_call>");
    got.extend(p.finish());
    assert_eq!(got, vec![call("f", json!({}))]);
}

#[test]
fn qwen3_coder_xml_calls() {
    let out = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    assert_eq!(
        parse(ToolFormat::Hermes, out, 5),
        vec![call("get_weather", json!({"city": "Paris", "days": 3}))]
    );
}

#[test]
fn malformed_calls_come_back_as_text() {
    let bad = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": }\n</tool_call>";
    assert_eq!(parse(ToolFormat::Hermes, bad, 3), vec![text(bad)]);
    // Cut off by the token limit.
    let cut = "ok <tool_call>\n{\"name\": \"f\", \"argu";
    assert_eq!(parse(ToolFormat::Hermes, cut, 4), vec![text(cut)]);
    // An unclosed but complete call at the end still counts.
    let unclosed = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n";
    assert_eq!(
        parse(ToolFormat::Hermes, unclosed, 4),
        vec![call("f", json!({}))]
    );
    assert_eq!(
        parse(ToolFormat::Llama3, "{\"oops\": 1}", 2),
        vec![text("{\"oops\": 1}")]
    );
    let ds = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{bad\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    assert_eq!(parse(ToolFormat::DeepSeek, ds, 3), vec![text(ds)]);
    assert_eq!(
        parse(ToolFormat::Mistral, "[TOOL_CALLS] nope", 3),
        vec![text("[TOOL_CALLS] nope")]
    );
    assert_eq!(
        parse(ToolFormat::Generic, "{\"x\": 1}", 3),
        vec![text("{\"x\": 1}")]
    );
}

#[test]
fn deepseek_r1_and_v3_1_calls() {
    let r1 = "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    assert_eq!(
        parse(ToolFormat::DeepSeek, r1, 4),
        vec![
            text("Sure."),
            call("get_weather", json!({"city": "Paris"})),
            call("get_time", json!({})),
        ]
    );
    let v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    assert_eq!(
        parse(ToolFormat::DeepSeek, v31, 1),
        vec![call("get_weather", json!({"city": "Oslo"}))]
    );
}

#[test]
fn llama3_mistral_and_generic_answers() {
    assert_eq!(
        parse(
            ToolFormat::Llama3,
            " {\"name\": \"f\", \"parameters\": {\"a\": 1}}",
            3
        ),
        vec![call("f", json!({"a": 1}))]
    );
    assert_eq!(
        parse(
            ToolFormat::Llama3,
            "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}",
            2
        ),
        vec![call("f", json!({}))]
    );
    assert_eq!(
        parse(ToolFormat::Llama3, "Hello {there}", 2),
        vec![text("Hello {there}")]
    );
    assert_eq!(
        parse(
            ToolFormat::Mistral,
            "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"name\": \"g\", \"arguments\": {}}]",
            5
        ),
        vec![call("f", json!({"a": 1})), call("g", json!({}))]
    );
    assert_eq!(
        parse(ToolFormat::Mistral, "[TOOL_CALLS]f[ARGS]{\"a\": 1}", 3),
        vec![call("f", json!({"a": 1}))]
    );
    assert_eq!(
        parse(
            ToolFormat::Generic,
            "{\"tool_calls\": [{\"name\": \"f\", \"arguments\": {\"a\": 1}}]}",
            3
        ),
        vec![call("f", json!({"a": 1}))]
    );
    assert_eq!(
        parse(ToolFormat::Generic, "{\"response\": \"Hi!\"}", 3),
        vec![text("Hi!")]
    );
}

#[test]
fn formats_are_told_apart_by_their_templates() {
    assert_eq!(
        ToolFormat::detect("{{ '<tool_call>\\n' }}"),
        ToolFormat::Hermes
    );
    assert_eq!(
        ToolFormat::detect("{{'<｜tool▁calls▁begin｜>'}}"),
        ToolFormat::DeepSeek
    );
    assert_eq!(ToolFormat::detect("[TOOL_CALLS]"), ToolFormat::Mistral);
    assert_eq!(
        ToolFormat::detect("<|start_header_id|>{% if tools %}"),
        ToolFormat::Llama3
    );
    assert_eq!(ToolFormat::detect("<start_of_turn>"), ToolFormat::Generic);
}

#[test]
fn tools_are_read_and_bad_ones_named() {
    let ok =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    assert_eq!(parse_tools(&ok).unwrap()[0].name, "f");
    for (bad, says) in [
        (json!({}), "must be an array"),
        (json!([{"type": "code_interpreter"}]), "tools[0].type"),
        (json!([{"type": "function"}]), "no `function`"),
        (json!([{"type": "function", "function": {}}]), "no `name`"),
        (
            json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]),
            "parameters",
        ),
        (
            json!([{"function": {"name": "f"}}, {"function": {"name": "f"}}]),
            "given twice",
        ),
    ] {
        let e = parse_tools(&bad).unwrap_err();
        assert!(e.message.contains(says), "{bad}: {e}");
        assert!(e.field.starts_with("tools"), "{bad}: {}", e.field);
    }
}

#[test]
fn grammars_for_required_and_named_choices() {
    let tools = parse_tools(&json!([
        {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "b"}},
    ]))
    .unwrap();
    let none = |_: &str| None;
    // Auto: free until the opening marker, when it is one token.
    assert!(call_grammar(ToolFormat::Hermes, &tools, &ToolChoice::Auto, true, &none).is_none());
    let Some(Grammar::Triggered { token: 9, grammar }) =
        call_grammar(ToolFormat::Hermes, &tools, &ToolChoice::Auto, true, &|m| {
            (m == "<tool_call>").then_some((9, true))
        })
    else {
        panic!("a triggered grammar")
    };
    let Grammar::Lark { grammar } = *grammar else {
        panic!("lark")
    };
    assert!(
        grammar.starts_with("start: body (\"\\n\"? <[9]> body)*"),
        "{grammar}"
    );
    assert!(call_grammar(ToolFormat::Hermes, &tools, &ToolChoice::None, true, &none).is_none());
    let Some(Grammar::Lark { grammar }) = call_grammar(
        ToolFormat::Hermes,
        &tools,
        &ToolChoice::Function("b".into()),
        false,
        &|m| (m == "<tool_call>").then_some((7, true)),
    ) else {
        panic!("a grammar")
    };
    assert!(grammar.starts_with("start: call\n"), "{grammar}");
    assert!(
        grammar.contains("<[7]>") && grammar.contains("\"</tool_call>\""),
        "{grammar}"
    );
    assert!(grammar.contains("\"const\":\"b\"") && !grammar.contains("\"const\":\"a\""));
    // The generic format always answers in its envelope.
    assert!(call_grammar(ToolFormat::Generic, &tools, &ToolChoice::Auto, true, &none).is_some());
}
