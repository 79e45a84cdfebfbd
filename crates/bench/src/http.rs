//! The little HTTP/1.1 plumbing the stand-in workers need, on hyper directly: a whole framework
//! would cost the benchmark machine CPU that the routers under test should have.

use std::{convert::Infallible, future::Future, net::SocketAddr};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::{
    Request, Response, StatusCode,
    body::{Frame, Incoming},
    header,
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::TokioIo;
use tokio::{net::TcpListener, sync::mpsc};
use tokio_stream::{StreamExt, wrappers::ReceiverStream};

pub type Body = BoxBody<Bytes, Infallible>;

/// Serve `handler` on `addr` (HTTP/1.1, keep-alive, no Nagle delay) until the process ends.
pub async fn serve<H, F>(addr: SocketAddr, handler: H) -> anyhow::Result<()>
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let listener = TcpListener::bind(addr).await?;
    eprintln!("listening on http://{}", listener.local_addr()?);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors and the like: wait for connections to close.
                eprintln!("accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let handler = handler.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let reply = handler(req);
                async move { Ok::<_, Infallible>(reply.await) }
            });
            let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

/// The whole body of a request (bodies here are small JSON documents).
pub async fn body_bytes(req: Request<Incoming>) -> Option<Bytes> {
    req.into_body().collect().await.ok().map(|c| c.to_bytes())
}

pub fn json(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(body.into()).boxed())
        .expect("a static response is valid")
}

/// An OpenAI-style error.
pub fn error(status: StatusCode, message: &str) -> Response<Body> {
    let body = serde_json::json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": null}});
    json(status, body.to_string())
}

/// A server-sent-event stream whose events are written into the returned sender; the response
/// ends when the sender is dropped.
pub fn sse() -> (mpsc::Sender<Bytes>, Response<Body>) {
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let body = StreamBody::new(ReceiverStream::new(rx).map(|b| Ok::<_, Infallible>(Frame::data(b))));
    let response = Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(BodyExt::boxed(body))
        .expect("a static response is valid");
    (tx, response)
}
