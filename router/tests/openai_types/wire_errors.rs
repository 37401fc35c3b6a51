//! Errors on the wire

use super::*;

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
