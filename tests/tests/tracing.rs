//! Traces: one trace per request, from the router through the coordinator
//! to every worker, exported over OTLP/HTTP. The collector here is a real
//! OTLP/HTTP receiver (the protobuf `ExportTraceServiceRequest` that
//! collectors and Arize Phoenix accept at /v1/traces), run by the test.

use axum::body::Bytes;
use omni_tests::fixtures::{model, GEMMA};
use omni_tests::{http, start_router, Cluster, ClusterSpec};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value::Value as AnyValue, KeyValue};
use prost::Message;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One received span, with what the assertions look at.
#[derive(Clone, Debug)]
struct Span {
    service: String,
    instance: String,
    trace: String,
    id: String,
    parent: String,
    name: String,
    attrs: HashMap<String, String>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn value(kv: &KeyValue) -> String {
    match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

/// An OTLP/HTTP trace receiver on a free port.
struct Collector {
    url: String,
    spans: Arc<Mutex<Vec<Span>>>,
    _thread: std::thread::JoinHandle<()>,
}

impl Collector {
    fn start() -> Collector {
        let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let store = spans.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let app = axum::Router::new().route(
                    "/v1/traces",
                    axum::routing::post(move |body: Bytes| {
                        let store = store.clone();
                        async move {
                            let req = ExportTraceServiceRequest::decode(body)
                                .expect("an OTLP/HTTP protobuf body");
                            store.lock().unwrap().extend(flatten(req));
                            "" // an empty ExportTraceServiceResponse
                        }
                    }),
                );
                let l = tokio::net::TcpListener::from_std(listener).unwrap();
                axum::serve(l, app).await.unwrap();
            });
        });
        Collector {
            url,
            spans,
            _thread: thread,
        }
    }

    fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits until `done` holds for the spans of `trace` (30 s at most).
    fn wait_for(&self, trace: &str, done: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let spans: Vec<Span> = self
                .spans()
                .into_iter()
                .filter(|s| s.trace == trace)
                .collect();
            if done(&spans) || Instant::now() > deadline {
                return spans;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn flatten(req: ExportTraceServiceRequest) -> Vec<Span> {
    let mut out = Vec::new();
    for rs in req.resource_spans {
        let res: HashMap<String, String> = rs
            .resource
            .map(|r| {
                r.attributes
                    .iter()
                    .map(|kv| (kv.key.clone(), value(kv)))
                    .collect()
            })
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                out.push(Span {
                    service: res.get("service.name").cloned().unwrap_or_default(),
                    instance: res.get("service.instance.id").cloned().unwrap_or_default(),
                    trace: hex(&s.trace_id),
                    id: hex(&s.span_id),
                    parent: hex(&s.parent_span_id),
                    name: s.name.clone(),
                    attrs: s
                        .attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), value(kv)))
                        .collect(),
                });
            }
        }
    }
    out
}

fn of<'a>(spans: &'a [Span], service: &str) -> Vec<&'a Span> {
    spans.iter().filter(|s| s.service == service).collect()
}

/// The shape every request's trace has: the router's span (a child of
/// `client_parent`, or a root), one coordinator span per choice under it,
/// and on each worker one span per step the request rode in, under the
/// coordinator's span. Returns the router span's status attribute.
fn check_trace(spans: &[Span], client_parent: &str, workers: &[&str], tokens: usize) {
    let dump = || format!("{spans:#?}");
    let mut counts: HashMap<String, usize> = HashMap::new();
    for s in spans {
        *counts
            .entry(format!("{} {}", s.service, s.instance))
            .or_default() += 1;
    }
    eprintln!(
        "trace {}: {tokens} tokens; spans per process: {counts:?}",
        spans[0].trace
    );
    let router = of(spans, "omni-router");
    assert_eq!(router.len(), 1, "one router span:\n{}", dump());
    let router = router[0];
    assert_eq!(
        router.parent,
        client_parent,
        "router span's parent:\n{}",
        dump()
    );
    assert_eq!(
        router
            .attrs
            .get("http.response.status_code")
            .map(String::as_str),
        Some("200")
    );
    let coord = of(spans, "omni-coordinator");
    assert_eq!(coord.len(), 1, "one coordinator span:\n{}", dump());
    let coord = coord[0];
    assert_eq!(
        coord.parent,
        router.id,
        "coordinator span under the router's:\n{}",
        dump()
    );
    assert_eq!(
        coord.attrs.get("completion_tokens").map(String::as_str),
        Some(tokens.to_string().as_str()),
        "{}",
        dump()
    );
    for w in workers {
        let steps: Vec<_> = of(spans, "omni-gpu-worker")
            .into_iter()
            .filter(|s| s.instance == *w)
            .collect();
        // One prompt step, then one step per generated token but the last.
        assert!(
            steps.len() >= tokens,
            "worker {w}: {} step spans for {tokens} tokens:\n{}",
            steps.len(),
            dump()
        );
        for s in steps {
            assert_eq!(
                s.parent,
                coord.id,
                "worker {w}'s span under the coordinator's:\n{}",
                dump()
            );
            // Where the stage's time around the step went: idle before its
            // input came, and the send after it.
            for a in ["idle_before_ms", "send_ms"] {
                let v: f64 = s
                    .attrs
                    .get(a)
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("worker {w}'s step span has no {a}:\n{}", dump()));
                assert!(v >= 0.0, "{a} = {v}");
            }
        }
    }
}

#[test]
fn one_trace_from_the_router_through_the_coordinator_to_every_worker() {
    let collector = Collector::start();
    // Every process this test starts inherits these: export to the
    // collector, in batches sent every 100 ms.
    std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", &collector.url);
    std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "100");
    let cluster = Cluster::start(&model(GEMMA), &ClusterSpec::new(2, "shm"));
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--model".to_string(),
        format!("gemma3-270m={}", cluster.addr),
    ];
    let (router, addr) = start_router(dir.path(), &args);
    let logs = || format!("{}\n{}", router.log_text(), cluster.logs());

    // A client that traces its own work sends a traceparent: the request
    // continues that trace.
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace}-{parent}-01");
    let body = json!({"model": "gemma3-270m", "max_tokens": 6,
        "messages": [{"role": "user", "content": "Name three colours."}]});
    let (st, text) = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("Content-Type", "application/json"),
            ("traceparent", &traceparent),
        ],
        body.to_string().as_bytes(),
    );
    assert_eq!(st, 200, "{text}\n{}", logs());
    let v: Value = serde_json::from_str(&text).unwrap();
    let tokens = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    let spans = collector.wait_for(trace, complete_for(tokens));
    check_trace(&spans, parent, &["w0", "w1"], tokens);

    // Without one, a streamed request gets a trace of its own, rooted at
    // the router; the router's span ends with the stream.
    let before: Vec<String> = collector.spans().iter().map(|s| s.trace.clone()).collect();
    let body = json!({"model": "gemma3-270m", "max_tokens": 5, "stream": true,
        "stream_options": {"include_usage": true}, "prompt": "The capital of France is"});
    let (st, text) = http(
        &addr,
        "POST",
        "/v1/completions",
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    );
    assert_eq!(st, 200, "{text}\n{}", logs());
    assert!(text.contains("data: [DONE]"), "{text}");
    let usage: Value = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|c| c["usage"].is_object())
        .expect("a usage chunk");
    let tokens = usage["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    let deadline = Instant::now() + Duration::from_secs(30);
    let new_trace = loop {
        let found = collector
            .spans()
            .into_iter()
            .find(|s| s.service == "omni-router" && !before.contains(&s.trace));
        if let Some(s) = found {
            break s.trace;
        }
        assert!(
            Instant::now() < deadline,
            "no trace for the streamed request\n{}",
            logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_ne!(new_trace, trace);
    let spans = collector.wait_for(&new_trace, complete_for(tokens));
    check_trace(&spans, "", &["w0", "w1"], tokens);
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    for n in [
        "POST /v1/completions",
        "coordinator generate",
        "stage 0 step",
        "stage 1 step",
    ] {
        assert!(names.contains(&n), "no span named {n:?} in {names:?}");
    }
}

fn complete_for(tokens: usize) -> impl Fn(&[Span]) -> bool {
    move |s: &[Span]| {
        let per_worker = |w: &str| s.iter().filter(|x| x.instance == w).count();
        !of(s, "omni-router").is_empty()
            && !of(s, "omni-coordinator").is_empty()
            && per_worker("w0") >= tokens
            && per_worker("w1") >= tokens
    }
}
