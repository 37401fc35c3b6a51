//! The chat-template renderer on any conversation: the input is a JSON list of
//! `{"role", "content"}` messages (what the coordinator renders from a chat
//! request), rendered with real models' templates (Qwen2.5, Gemma 3, the ChatML
//! fallback) and with one that exercises omni's own filters and functions.
//! Rendering may fail (Gemma refuses roles out of turn); it must never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use omni_engine::chat::{ChatMessage, ChatTemplate};
use std::sync::LazyLock;

static TEMPLATES: LazyLock<Vec<ChatTemplate>> = LazyLock::new(|| {
    let compile = |source| ChatTemplate::new(source, "<bos>", "<eos>").expect("template compiles");
    vec![
        compile(include_str!(
            "../../engine/tests/data/qwen2_5_coder_chat_template.jinja"
        )),
        compile(include_str!("../../engine/templates/gemma3.jinja")),
        compile(include_str!("../templates/exercise.jinja")),
    ]
});

static CHATML: LazyLock<ChatTemplate> = LazyLock::new(ChatTemplate::chatml);

fuzz_target!(|data: &[u8]| {
    let Ok(messages) = serde_json::from_slice::<Vec<ChatMessage>>(data) else {
        return;
    };
    for template in TEMPLATES.iter() {
        for add_generation_prompt in [false, true] {
            let _ = template.render(&messages, add_generation_prompt);
        }
    }
    // ChatML has no conditions: it renders any conversation, every content verbatim.
    let text = CHATML
        .render(&messages, true)
        .expect("ChatML renders any conversation");
    for m in &messages {
        assert!(text.contains(&m.content), "ChatML dropped {:?}", m.content);
    }
});
