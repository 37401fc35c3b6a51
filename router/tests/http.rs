//! The router's HTTP layer without a cluster: what `server::app` answers before a request
//! reaches any backend.

use std::sync::Arc;

use omni_router::server::{app, AppState, Backend, Target};
use serde_json::{json, Value};

/// The router on a free port, with one model (an upstream nobody listens on: these
/// requests never get that far) and the key `sk-test`.
async fn serve() -> String {
    let backend = Backend {
        name: "gemma".into(),
        aliases: Vec::new(),
        target: Target::Upstream {
            base: "http://127.0.0.1:9/v1".into(),
            model: "gemma".into(),
            key: None,
        },
    };
    let state = AppState::new(
        vec![backend],
        Vec::new(),
        vec!["sk-test".into()],
        4,
        1 << 20,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = app(Arc::new(state));
    tokio::spawn(async move { axum::serve(listener, router).await });
    format!("http://{addr}")
}

#[tokio::test]
async fn a_wrong_method_is_405_with_allow_and_openais_error_body() {
    let base = serve().await;
    let client = reqwest::Client::new();
    for (method, path, allow) in [
        ("POST", "/v1/models", "GET,HEAD"),
        ("DELETE", "/v1/models", "GET,HEAD"),
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions", "POST"),
    ] {
        let resp = client
            .request(method.parse().unwrap(), format!("{base}{path}"))
            .bearer_auth("sk-test")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 405, "{method} {path}");
        assert_eq!(resp.headers()["allow"], allow, "{method} {path}");
        assert_eq!(resp.headers()["content-type"], "application/json");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(
            body,
            json!({"error": {
                "message": format!("{path} does not serve {method}; the `Allow` header lists the methods it does"),
                "type": "invalid_request_error",
                "param": null,
                "code": null,
            }})
        );
    }
    // A path the router does not serve at all is still a 404.
    let resp = client
        .get(format!("{base}/v1/embeddings"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 404);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
}
