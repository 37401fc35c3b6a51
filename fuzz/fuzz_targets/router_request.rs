//! The router's request parsing on any POST body: the bytes are read as a
//! `/v1/chat/completions` and as a `/v1/completions` body, validated and mapped
//! to the coordinator's `GenerateRequest`, as `server.rs` does before it sends
//! anything. A bad body must become a 400 with OpenAI's error body, never a
//! panic; a good one must map to a request within the documented limits.
#![no_main]

use libfuzzer_sys::fuzz_target;
use omni_proto::coordinator::v1::generate_request::Prompt;
use omni_proto::coordinator::v1::GenerateRequest;
use omni_router::backends::{parse_auto, pick};
use omni_router::openai::{
    choice_request, parse_json, ApiError, ChatCompletionRequest, CompletionRequest, MAX_N,
    MAX_STOP, MAX_TOP_LOGPROBS,
};
use std::sync::LazyLock;

static RULES: LazyLock<Vec<(omni_router::backends::Rule, String)>> = LazyLock::new(|| {
    parse_auto("prompt_chars>200=big; keyword:code=coder; default=small").expect("valid rules")
});

/// What the server asks of both request types.
trait Request: serde::de::DeserializeOwned {
    fn to_generate(&self) -> Result<GenerateRequest, ApiError>;
    fn validate(&self) -> Result<(), ApiError>;
    fn n(&self) -> u32;
    fn flags(&self) -> (bool, bool, bool);
    fn prompt_text(&self) -> String;
}

/// Both types have these as inherent methods of the same names.
macro_rules! request {
    ($($t:ty),*) => {$(
        impl Request for $t {
            fn to_generate(&self) -> Result<GenerateRequest, ApiError> {
                self.to_generate()
            }
            fn validate(&self) -> Result<(), ApiError> {
                self.validate()
            }
            fn n(&self) -> u32 {
                self.n()
            }
            fn flags(&self) -> (bool, bool, bool) {
                (self.stream(), self.include_usage(), self.logprobs())
            }
            fn prompt_text(&self) -> String {
                self.prompt_text()
            }
        }
    )*};
}
request!(ChatCompletionRequest, CompletionRequest);

/// A refused request is a 400 that names what is wrong, in OpenAI's error body.
fn refused(e: ApiError) {
    assert_eq!(e.status, 400, "{e}");
    assert!(!e.message.is_empty());
    let body = e.body();
    assert_eq!(body["error"]["message"].as_str(), Some(e.message.as_str()));
    let _ = e.sse();
    let resp = axum::response::IntoResponse::into_response(e);
    assert_eq!(resp.status().as_u16(), 400);
}

fn check<R: Request>(body: &[u8]) {
    let r: R = match parse_json(body) {
        Ok(r) => r,
        Err(e) => return refused(e),
    };
    let _ = pick(&RULES, &r.prompt_text());
    let _ = r.flags();
    let generate = r.to_generate();
    assert_eq!(r.validate().is_ok(), generate.is_ok());
    let g = match generate {
        Ok(g) => g,
        Err(e) => return refused(e),
    };
    let n = r.n();
    assert!((1..=MAX_N).contains(&n), "n = {n}");
    assert!(g.prompt.is_some());
    if let Some(Prompt::Chat(chat)) = &g.prompt {
        assert!(!chat.messages.is_empty());
    }
    assert!(g.stop.len() <= MAX_STOP && g.stop.iter().all(|s| !s.is_empty()));
    assert!(g.top_logprobs <= MAX_TOP_LOGPROBS);
    let s = g.sampling.as_ref().expect("sampling settings");
    // The coordinator reads 0 as "unset" for these two.
    assert!(s.top_p > 0.0 && s.repeat_penalty > 0.0, "{s:?}");
    assert!(s.logit_bias.windows(2).all(|w| w[0].token <= w[1].token));
    assert!(s
        .logit_bias
        .iter()
        .all(|b| (-100.0..=100.0).contains(&b.bias)));
    for i in 0..n {
        let c = choice_request(&g, i);
        let seed = c.sampling.as_ref().and_then(|s| s.seed);
        assert_eq!(seed, s.seed.map(|seed| seed.wrapping_add(u64::from(i))));
    }
}

fuzz_target!(|data: &[u8]| {
    check::<ChatCompletionRequest>(data);
    check::<CompletionRequest>(data);
});
