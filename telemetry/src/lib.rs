//! Logs and traces for every omni service (the `main` they share is
//! `omni_runtime::service_main`).
//!
//! Logs go to stderr, filtered by `OMNI_LOG` (default `info`). Traces are
//! exported over OTLP/HTTP (protobuf) when an endpoint is configured
//! (`--otlp-endpoint`, or the standard `OTEL_EXPORTER_OTLP_ENDPOINT`), and
//! filtered by `OMNI_TRACE` (default `info`). A request carries its W3C
//! trace context from the router (the HTTP `traceparent` header) to the
//! coordinator (gRPC metadata) and on to every worker (in the pipeline
//! frame), so one trace shows the request everywhere it ran. `crash` says
//! how a process died (which signal), to its supervisor and the coordinator.

pub mod cpus;
pub mod crash;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use std::collections::HashMap;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The W3C trace-context header (HTTP) and metadata key (gRPC).
pub const TRACEPARENT: &str = "traceparent";

/// Where traces go.
#[derive(Clone, Debug, Default, clap::Args, serde::Serialize, serde::Deserialize)]
pub struct TelemetryArgs {
    /// Export traces over OTLP/HTTP to this base URL (e.g.
    /// http://127.0.0.1:4318 for a collector, http://127.0.0.1:6006 for
    /// Arize Phoenix); spans go to <URL>/v1/traces. Unset: no traces.
    #[arg(long = "otlp-endpoint", env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
}

impl TelemetryArgs {
    /// The full URL spans are posted to, if traces are on.
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (a full URL) wins, as the
    /// OpenTelemetry specification says.
    pub fn traces_url(&self) -> Option<String> {
        if let Some(u) = std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .ok()
            .filter(|u| !u.trim().is_empty())
        {
            return Some(u.trim().to_string());
        }
        let base = self.otlp_endpoint.as_deref()?.trim();
        if base.is_empty() {
            return None;
        }
        Some(if base.ends_with("/v1/traces") {
            base.to_string()
        } else {
            format!("{}/v1/traces", base.trim_end_matches('/'))
        })
    }
}

/// Flushes and stops the trace exporter when dropped.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            if let Err(e) = p.shutdown() {
                eprintln!("could not flush the last traces: {e}");
            }
        }
    }
}

/// Whether log lines carry ANSI colour: `OMNI_LOG_COLOR` (1 or 0) when
/// set (`omnictl up` sets it for its children from its own terminal),
/// else only when stderr is a terminal and `NO_COLOR` is not set. A log
/// file or a pipe gets no escape codes.
pub fn log_colour() -> bool {
    use std::io::IsTerminal;
    match std::env::var("OMNI_LOG_COLOR").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => std::env::var_os("NO_COLOR").is_none() && std::io::stderr().is_terminal(),
    }
}

/// Sets up logging and, when configured, trace export. `instance` names
/// this process among others of the same service (a worker's id).
pub fn init(
    service: &str,
    instance: Option<&str>,
    args: &TelemetryArgs,
) -> anyhow::Result<Telemetry> {
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(log_colour())
        .with_filter(filter("OMNI_LOG", "info"));
    let (traces, provider) = match args.traces_url() {
        None => (None, None),
        Some(url) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_endpoint(url.clone())
                .build()
                .map_err(|e| anyhow::anyhow!("cannot export traces to {url}: {e}"))?;
            let mut resource = Resource::builder().with_service_name(service.to_string());
            if let Some(i) = instance {
                resource = resource.with_attribute(opentelemetry::KeyValue::new(
                    "service.instance.id",
                    i.to_string(),
                ));
            }
            let provider = SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(resource.build())
                .build();
            let layer = tracing_opentelemetry::layer()
                .with_tracer(provider.tracer(service.to_string()))
                // The exporter's own HTTP client and the gRPC plumbing must
                // not trace themselves.
                .with_filter(filter(
                    "OMNI_TRACE",
                    "info,h2=off,hyper=off,hyper_util=off,reqwest=off,tonic=off,tower=off,opentelemetry=off",
                ));
            (Some(layer), Some(provider))
        }
    };
    tracing_subscriber::registry()
        .with(logs)
        .with(traces)
        .try_init()?;
    if let Some(url) = args.traces_url() {
        tracing::info!("exporting traces over OTLP/HTTP to {url}");
    }
    Ok(Telemetry { provider })
}

fn filter(var: &str, default: &str) -> EnvFilter {
    EnvFilter::try_from_env(var).unwrap_or_else(|_| EnvFilter::new(default))
}

/// A trace context received from another process.
#[derive(Clone, Debug)]
pub struct Remote(opentelemetry::Context);

impl Remote {
    /// Parses a W3C `traceparent` value; None when it is absent or invalid
    /// (a bad header from a client is ignored, not an error).
    pub fn parse(traceparent: &str) -> Option<Remote> {
        if traceparent.is_empty() {
            return None;
        }
        let carrier = HashMap::from([(TRACEPARENT.to_string(), traceparent.to_string())]);
        let cx = TraceContextPropagator::new().extract(&carrier);
        cx.span().span_context().is_valid().then_some(Remote(cx))
    }

    /// Makes `span` a child of this context.
    pub fn adopt(&self, span: &tracing::Span) {
        // Fails only when the span is disabled, which then records nothing.
        let _ = span.set_parent(self.0.clone());
    }
}

/// Makes `span` a child of `traceparent` when that is a valid one.
pub fn set_parent(span: &tracing::Span, traceparent: Option<&str>) {
    if let Some(r) = traceparent.and_then(Remote::parse) {
        r.adopt(span);
    }
}

/// The `traceparent` value that makes the receiver's spans children of
/// `span`; None when traces are off (or the span is disabled).
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove(TRACEPARENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_url_appends_the_signal_path_once() {
        let a = |e: &str| TelemetryArgs {
            otlp_endpoint: Some(e.to_string()),
        };
        assert_eq!(
            a("http://h:4318").traces_url().as_deref(),
            Some("http://h:4318/v1/traces")
        );
        assert_eq!(
            a("http://h:4318/").traces_url().as_deref(),
            Some("http://h:4318/v1/traces")
        );
        assert_eq!(
            a("http://h:6006/v1/traces").traces_url().as_deref(),
            Some("http://h:6006/v1/traces")
        );
        assert_eq!(a(" ").traces_url(), None);
        assert_eq!(TelemetryArgs::default().traces_url(), None);
    }

    #[test]
    fn traceparent_round_trips_and_bad_values_are_ignored() {
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        assert!(Remote::parse(tp).is_some());
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        ] {
            assert!(Remote::parse(bad).is_none(), "{bad}");
        }
        // Without a trace layer a span has no context to pass on.
        assert_eq!(traceparent(&tracing::info_span!("x")), None);
    }
}
