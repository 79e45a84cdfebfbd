//! Logs and traces, set up the same way by both binaries.
//!
//! - Logs: `tracing` to stderr, text or JSON (`--log-format`), filtered by `RUST_LOG`.
//! - Traces: exported over OTLP/gRPC only when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//!   `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; the SDK reads the standard variables
//!   (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`/`_ARG`; the default
//!   sampler is parent-based, always on). Spans go through a batch processor on its own thread:
//!   a slow or dead collector drops spans, never delays a request. Unset, no exporter exists
//!   and a span costs what an unexported `tracing` span costs.
//! - Context crosses process boundaries as W3C `traceparent`: [`context_from_headers`] reads it
//!   from an HTTP request or gRPC call, [`inject`] writes a span's context into
//!   an outgoing gRPC call, so one trace shows a request across router and worker.

use opentelemetry::{
    Context, global,
    propagation::{Extractor, Injector},
    trace::{TraceContextExt, TracerProvider as _},
};
use opentelemetry_sdk::{Resource, propagation::TraceContextPropagator, trace::SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{EnvFilter, Layer, layer::SubscriberExt, util::SubscriberInitExt};

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, with the request span's fields (its `trace_id` among them).
    Json,
}

/// Handle to the trace pipeline; [`Telemetry::shutdown`] flushes it.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

/// Whether the environment asks for trace export.
pub fn export_configured() -> bool {
    ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .iter()
        .any(|k| std::env::var(k).is_ok_and(|v| !v.trim().is_empty()))
}

/// Install the global subscriber: logs, and trace export when configured. Call once, inside
/// the tokio runtime (the OTLP exporter's channel lives on it).
pub fn init(default_service_name: &str, format: LogFormat) -> Telemetry {
    use std::io::IsTerminal;
    global::set_text_map_propagator(TraceContextPropagator::new());
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = match format {
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .boxed(),
    };
    let mut error = None;
    let provider = if export_configured() {
        match opentelemetry_otlp::SpanExporter::builder().with_tonic().build() {
            Ok(exporter) => {
                let mut resource = Resource::builder();
                if std::env::var("OTEL_SERVICE_NAME").is_err() {
                    resource = resource.with_service_name(default_service_name.to_string());
                }
                Some(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build())
            }
            Err(e) => {
                error = Some(e.to_string());
                None
            }
        }
    } else {
        None
    };
    let otel = provider.as_ref().map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("bellows")));
    tracing_subscriber::registry().with(filter).with(fmt).with(otel).init();
    match (&provider, error) {
        (Some(_), _) => tracing::info!("exporting traces over OTLP"),
        (None, Some(e)) => tracing::error!("trace export disabled: the OTLP exporter failed to start: {e}"),
        (None, None) => {}
    }
    Telemetry { provider }
}

impl Telemetry {
    /// Flush and stop the exporter. Blocks: call it off the async runtime (`spawn_blocking`).
    pub fn shutdown(self) {
        if let Some(p) = self.provider {
            let _ = p.force_flush();
            let _ = p.shutdown();
        }
    }
}

/// The trace context a caller sent (`traceparent`), if any.
pub fn context_from_headers(headers: &tonic::codegen::http::HeaderMap) -> Context {
    global::get_text_map_propagator(|p| p.extract(&HeaderCarrier(headers)))
}

/// Continue an HTTP caller's trace in `span`: the span becomes a child of the caller's span.
pub fn continue_trace(span: &tracing::Span, headers: &tonic::codegen::http::HeaderMap) {
    set_parent(span, context_from_headers(headers));
}

/// Continue a gRPC caller's trace in `span`.
pub fn continue_grpc_trace(span: &tracing::Span, metadata: &tonic::metadata::MetadataMap) {
    set_parent(span, global::get_text_map_propagator(|p| p.extract(&MetadataExtractor(metadata))));
}

/// Continue a trace carried as a map (a Session frame's `trace_context`).
pub fn continue_trace_from_map(span: &tracing::Span, carrier: &std::collections::HashMap<String, String>) {
    set_parent(span, global::get_text_map_propagator(|p| p.extract(carrier)));
}

fn set_parent(span: &tracing::Span, cx: Context) {
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// Add an event with integer attributes to `span` (exported only; not a log line).
pub fn span_event(span: &tracing::Span, name: &'static str, attributes: &[(&'static str, i64)]) {
    span.add_event(name, attributes.iter().map(|&(k, v)| opentelemetry::KeyValue::new(k, v)).collect());
}

/// Set an attribute on `span` that was not declared as a field when it was created.
pub fn set_attribute(span: &tracing::Span, key: &'static str, value: impl Into<opentelemetry::Value>) {
    span.set_attribute(key, value);
}

/// Write `span`'s trace context into an outgoing gRPC call's metadata.
pub fn inject(span: &tracing::Span, metadata: &mut tonic::metadata::MetadataMap) {
    let cx = span.context();
    global::get_text_map_propagator(|p| p.inject_context(&cx, &mut MetadataInjector(metadata)));
}

/// `span`'s trace context as a map (for a Session frame); empty when not traced.
pub fn inject_map(span: &tracing::Span) -> std::collections::HashMap<String, String> {
    let cx = span.context();
    let mut carrier = std::collections::HashMap::new();
    global::get_text_map_propagator(|p| p.inject_context(&cx, &mut carrier));
    carrier
}

/// The trace id of `span` as 32 hex digits, for log lines; `None` when not traced.
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

struct HeaderCarrier<'a>(&'a tonic::codegen::http::HeaderMap);

impl Extractor for HeaderCarrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}
