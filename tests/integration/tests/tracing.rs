//! One trace per request across router and workers, received by a real OTLP/gRPC receiver
//! (opentelemetry-proto's trace service) running in the test.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use bellows_integration::{Router, Worker, eventually, sim};
use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
        trace_service_server::{TraceService, TraceServiceServer},
    },
    common::v1::{AnyValue, any_value::Value as AnyKind},
    trace::v1::Span,
};
use serde_json::json;

/// A received span with its service name.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    span: Span,
}

#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Vec<Received>>>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut all = self.0.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .map(|a| text(a.value.as_ref()))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    all.push(Received { service: service.clone(), span });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn text(v: Option<&AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(AnyKind::StringValue(s)) => s.clone(),
        Some(AnyKind::IntValue(i)) => i.to_string(),
        Some(AnyKind::BoolValue(b)) => b.to_string(),
        Some(AnyKind::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn attr(span: &Span, key: &str) -> Option<String> {
    span.attributes.iter().find(|a| a.key == key).map(|a| text(a.value.as_ref()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn one_trace_spans_router_and_workers_and_shows_a_retry_as_sibling_attempts() {
    let receiver = Receiver::default();
    // Port 0: the kernel picks a free port, so no other test can take it first.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = TraceServiceServer::new(receiver.clone());
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(tonic::transport::Server::builder().add_service(server).serve_with_incoming(incoming));
    let endpoint = format!("http://127.0.0.1:{port}");
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()), ("OTEL_BSP_SCHEDULE_DELAY", "100")];

    // `a` fails any prompt with token 999 before its first token; `b` serves it.
    let a = Worker::start_env(&sim(r#"{"poison_token": 999}"#), &env).await;
    let b = Worker::start_env(&sim("{}"), &env).await;
    let list = format!("{},{}", a.addr, b.addr);
    let router = Router::start_env(&["--workers", &list, "--policy", "round_robin"], &env).await;
    router.wait_placeable(2).await;

    // Two requests, each continuing its own client trace; round-robin sends at least one of
    // them to `a` first, so at least one trace holds a retry.
    let client_span = "00f067aa0ba902b7";
    let traces = ["4bf92f3577b34da6a3ce929d0e0e4736", "5bf92f3577b34da6a3ce929d0e0e4737"];
    for trace in traces {
        let r = reqwest::Client::new()
            .post(router.url("/v1/completions"))
            .header("traceparent", format!("00-{trace}-{client_span}-01"))
            .json(&json!({"model": "sim", "prompt": [5, 999, 7], "max_tokens": 4}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }

    let spans_of = |trace: &str| -> Vec<Received> {
        receiver.0.lock().unwrap().iter().filter(|r| hex(&r.span.trace_id) == trace).cloned().collect()
    };
    let named = |spans: &[Received], name: &str| -> Vec<Received> {
        spans.iter().filter(|r| r.span.name == name).cloned().collect()
    };
    // The trace with the retry: two attempts, and the worker spans of both (the failed one too).
    let (trace, spans) = eventually("a trace with a retry, fully exported", Duration::from_secs(20), || async {
        traces.iter().find_map(|t| {
            let spans = spans_of(t);
            let complete = named(&spans, "worker.attempt").len() == 2
                && named(&spans, "worker.generate").len() == 2
                && named(&spans, "decode").len() == 1
                && named(&spans, "POST /v1/completions").len() == 1;
            complete.then(|| (t.to_string(), spans))
        })
    })
    .await;

    let request = &named(&spans, "POST /v1/completions")[0];
    assert_eq!(request.service, "bellows-router");
    assert_eq!(hex(&request.span.parent_span_id), client_span, "the client's traceparent is continued");
    assert_eq!(attr(&request.span, "gen_ai.request.model").as_deref(), Some("sim"));
    assert_eq!(attr(&request.span, "gen_ai.operation.name").as_deref(), Some("text_completion"));
    assert_eq!(attr(&request.span, "gen_ai.usage.output_tokens").as_deref(), Some("4"));
    assert_eq!(attr(&request.span, "gen_ai.usage.input_tokens").as_deref(), Some("3"));
    assert_eq!(attr(&request.span, "http.response.status_code").as_deref(), Some("200"));
    assert!(attr(&request.span, "gen_ai.response.id").is_some_and(|id| id.starts_with("cmpl-")));
    assert_eq!(attr(&request.span, "gen_ai.response.finish_reasons").as_deref(), Some("length"));
    assert!(attr(&request.span, "bellows.prompt").is_none(), "no prompt text without --trace-text");

    let request_id = request.span.span_id.clone();
    let attempts = named(&spans, "worker.attempt");
    assert!(attempts.iter().all(|a| a.span.parent_span_id == request_id), "attempts are siblings under the request");
    let mut kinds: Vec<String> = attempts.iter().filter_map(|a| attr(&a.span, "bellows.attempt.kind")).collect();
    kinds.sort();
    assert_eq!(kinds, ["first", "retry"]);
    let placements = named(&spans, "placement");
    assert_eq!(placements.len(), 2);
    assert!(placements.iter().all(|p| attr(&p.span, "bellows.worker").is_some()));
    assert_eq!(named(&spans, "tokenize").len(), 1, "the prompt is tokenized (and hashed) once");

    // Each worker span is a child of one attempt, on the worker's side.
    let attempt_ids: Vec<_> = attempts.iter().map(|a| a.span.span_id.clone()).collect();
    for g in named(&spans, "worker.generate") {
        assert_eq!(g.service, "bellows-worker");
        assert!(attempt_ids.contains(&g.span.parent_span_id), "a worker span hangs under a router attempt");
    }
    // The served one shows its phases: queue, prefill (with chunk events), decode (first token).
    let decode = &named(&spans, "decode")[0];
    assert!(decode.span.events.iter().any(|e| e.name == "first_token"));
    assert_eq!(attr(&decode.span, "bellows.tokens").as_deref(), Some("4"));
    let prefill = named(&spans, "prefill");
    assert!(prefill.iter().any(|p| p.span.events.iter().any(|e| e.name == "prefill_chunk")));
    assert!(!named(&spans, "queue").is_empty());
    assert!(spans.iter().all(|s| hex(&s.span.trace_id) == trace), "one trace id throughout");
}
