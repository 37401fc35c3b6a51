mod common;

use omni_engine::chat::*;

const QWEN: &str = include_str!("data/qwen2_5_coder_chat_template.jinja");
const GEMMA3: &str = include_str!("../templates/gemma3.jinja");

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage::text(role, content)
}

fn render(source: &str, messages: &[ChatMessage]) -> Result<String, ChatError> {
    ChatTemplate::new(source, "<s>", "</s>")?.render(messages, true)
}

#[test]
fn qwen_template_reproduces_reference_prompts() {
    let dir = common::fixtures_dir();
    let text = std::fs::read_to_string(dir.join("real_qwen2_5_coder_0_5b.json")).unwrap();
    let fixture: serde_json::Value = serde_json::from_str(&text).unwrap();
    let template = ChatTemplate::new(QWEN, "", "<|im_end|>").unwrap();
    let mut checked = 0;
    for prompt in fixture["prompts"].as_array().unwrap() {
        if prompt["kind"] != "chat_template" {
            continue;
        }
        let messages: Vec<ChatMessage> =
            serde_json::from_value(prompt["chat_messages"].clone()).unwrap();
        let rendered = template.render(&messages, true).unwrap();
        assert_eq!(
            rendered,
            prompt["text"].as_str().unwrap(),
            "prompt {}",
            prompt["id"]
        );
        checked += 1;
    }
    assert!(checked >= 3, "only {checked} chat prompts in the fixture");
}

#[test]
fn qwen_template_without_generation_prompt() {
    let template = ChatTemplate::new(QWEN, "", "<|im_end|>").unwrap();
    let out = template
        .render(&[msg("user", "hi"), msg("assistant", "hello")], false)
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    );
}

#[test]
fn gemma3_folds_system_prompt_into_first_user_turn() {
    let template = ChatTemplate::new(GEMMA3, "<bos>", "<eos>").unwrap();
    let messages = [
        msg("system", "You are a terse assistant."),
        msg("user", "Hi there!"),
        msg("assistant", "  Hello. How can I help?\n"),
        msg("user", "What is 2+2?"),
    ];
    // Produced by Python jinja2 3.1: ImmutableSandboxedEnvironment(trim_blocks=True,
    // lstrip_blocks=True).from_string(<tests/data/gemma3_chat_template.jinja>).render(
    //     messages=<the four above>, add_generation_prompt=True, bos_token="<bos>", eos_token="<eos>")
    let expected =
        "<bos><start_of_turn>user\nYou are a terse assistant.\n\nHi there!<end_of_turn>\n\
                    <start_of_turn>model\nHello. How can I help?<end_of_turn>\n\
                    <start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n";
    assert_eq!(template.render(&messages, true).unwrap(), expected);
    // Same tool, add_generation_prompt=False, messages=[the first user turn only].
    assert_eq!(
        template.render(&messages[1..2], false).unwrap(),
        "<bos><start_of_turn>user\nHi there!<end_of_turn>\n"
    );
}

#[test]
fn gemma3_rejects_non_alternating_roles() {
    let template = ChatTemplate::new(GEMMA3, "<bos>", "<eos>").unwrap();
    let err = template
        .render(&[msg("user", "a"), msg("user", "b")], true)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("Conversation roles must alternate user/assistant/user/assistant/..."),
        "{err}"
    );
}

#[test]
fn raise_exception_is_an_error_with_message_and_line() {
    let source = "{% if messages | length > 1 %}\n{{ raise_exception('only one message allowed') }}\n{% endif %}ok";
    assert_eq!(render(source, &[msg("user", "a")]).unwrap(), "ok");
    let err = render(source, &[msg("user", "a"), msg("user", "b")])
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("chat template error: "), "{err}");
    assert!(
        err.contains("only one message allowed") && err.contains("(line 2)"),
        "{err}"
    );
}

#[test]
fn invalid_template_is_an_error() {
    let err = ChatTemplate::new("{% for m in messages %}{{ m.content }}", "", "").unwrap_err();
    assert!(matches!(err, ChatError::Syntax(_)), "{err}");
    assert!(err.to_string().contains("line 1"), "{err}");
    assert!(ChatTemplate::new("{{ messages[0] ", "", "").is_err());
}

#[test]
fn tojson_is_plain_python_json() {
    // Expected strings from Python: json.dumps(x, ensure_ascii=False, indent=..., separators=...)
    // as transformers' tojson filter does.
    let m = [msg("user", "<b>&'\"é\n")];
    assert_eq!(
        render(r#"{{ {"a": "<b>"} | tojson }}"#, &m).unwrap(),
        r#"{"a": "<b>"}"#
    );
    assert_eq!(
        render("{{ messages | tojson }}", &m).unwrap(),
        r#"[{"role": "user", "content": "<b>&'\"é\n"}]"#
    );
    assert_eq!(
        render(r#"{{ {"a": [1, 2, {}], "b": []} | tojson(indent=2) }}"#, &m).unwrap(),
        "{\n  \"a\": [\n    1,\n    2,\n    {}\n  ],\n  \"b\": []\n}"
    );
    assert_eq!(
        render(
            r#"{{ {"a": [1, 2]} | tojson(separators=(",", ":"), sort_keys=true) }}"#,
            &m
        )
        .unwrap(),
        r#"{"a":[1,2]}"#
    );
}

#[test]
fn python_methods_and_values_work() {
    let m = [msg("user", "  <think>x</think>answer  ")];
    let source = "{% for m in messages %}{% for k, v in m.items() %}{{ k }}={{ v.strip() }};{% endfor %}\
                  {{ m.content.strip().startswith('<think>') }}|{{ m.content.split('</think>')[-1].strip() }}|\
                  {{ m.get('missing', 'dflt') }}|{{ tools }}|{{ tools is none }}{% endfor %}";
    // Python jinja2 renders the same template to this.
    assert_eq!(
        render(source, &m).unwrap(),
        "role=user;content=<think>x</think>answer;True|answer|dflt|None|True"
    );
}

#[test]
fn special_tokens_are_variables() {
    assert_eq!(
        render(
            "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}",
            &[]
        )
        .unwrap(),
        "<s>|</s>|True"
    );
}

#[test]
fn strftime_now_gives_current_year() {
    let year = render("{{ strftime_now('%Y') }}", &[]).unwrap();
    assert_eq!(year.len(), 4, "{year}");
    assert!(year.parse::<u32>().unwrap() >= 2024, "{year}");
    let date = render("{{ strftime_now('%d %B %Y') }}", &[]).unwrap();
    assert!(date.ends_with(&year) && date.len() >= 12, "{date}");
}

#[test]
fn chatml_fallback_is_exact() {
    let template = ChatTemplate::chatml();
    let messages = [
        msg("system", "Be brief."),
        msg("user", "Hi"),
        msg("assistant", "Hello!"),
    ];
    assert_eq!(
        template.render(&messages, true).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        template.render(&messages[1..2], false).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n"
    );
}

/// Tools, an assistant's tool call and the tool's result through Qwen's own
/// template, as transformers renders them: the tools listed in the system
/// turn in the client's key order, the call as a `<tool_call>` block with
/// its arguments as an object, the result as a `<tool_response>`.
#[test]
fn qwen_template_renders_tools_calls_and_results() {
    let tools = serde_json::json!([{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        }
    }]);
    let call = ChatMessage {
        role: "assistant".into(),
        tool_calls: vec![ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: serde_json::json!({"city": "Oslo"}),
        }],
        ..ChatMessage::default()
    };
    let result = ChatMessage {
        tool_call_id: Some("call_1".into()),
        ..msg("tool", "22C")
    };
    let template = ChatTemplate::new(QWEN, "", "<|im_end|>").unwrap();
    let got = template
        .render_with_tools(
            &[msg("user", "Weather in Oslo?"), call, result],
            Some(&tools),
            true,
        )
        .unwrap();
    let want = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n\
{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get the weather\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n\
</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n\
<|im_start|>user\nWeather in Oslo?<|im_end|>\n\
<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call><|im_end|>\n\
<|im_start|>user\n<tool_response>\n22C\n</tool_response><|im_end|>\n\
<|im_start|>assistant\n";
    assert_eq!(got, want);
}
