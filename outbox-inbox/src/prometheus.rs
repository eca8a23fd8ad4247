//! The consumer's [`metrics`](crate::metrics) on a Prometheus endpoint of the consumer service's
//! own, with one call (feature `prometheus`).
//!
//! [`serve`] installs the same exporter as `outbox relay` (`metrics-exporter-prometheus`, with
//! the same latency buckets, so the relay's and the consumers' histograms aggregate together)
//! as the process's global recorder, and answers `GET /metrics` on the address given. Every
//! [`ConsumerEngine`](crate::ConsumerEngine) of the process then reports there: lag per
//! partition, parked and waiting messages, apply latency, outcomes and errors, each series
//! labelled with its `consumer`.
//!
//! ```no_run
//! # async fn run() -> Result<(), outbox_inbox::prometheus::ExporterError> {
//! // Once, at the start of the consumer service (before the engines run).
//! let endpoint = outbox_inbox::prometheus::serve("0.0.0.0:9465").await?;
//! println!("metrics on http://{}/metrics", endpoint.local_addr());
//! // ... build and run the ConsumerEngine(s) ...
//! # Ok(()) }
//! ```
//!
//! Scrape it as a job of its own; the alert rules in `deploy/prometheus/alerts.yml` (group
//! `outbox-consumer`) and the dashboard's consumer row read these series. A process that
//! already has a global recorder (it installed another exporter, or embeds `outbox relay`)
//! gets [`ExporterError::Install`]: render that recorder instead, the series are the same.

use std::net::SocketAddr;

use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};

/// Latency buckets (seconds), those of `outbox relay`: 1 ms to 10 min.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];

/// Why [`serve`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExporterError {
    /// The recorder could not be installed (another global recorder is installed already).
    #[error("cannot install the Prometheus recorder: {0}")]
    Install(#[from] BuildError),
    /// The address could not be bound.
    #[error("cannot listen for /metrics: {0}")]
    Listen(#[from] std::io::Error),
}

/// A running `/metrics` endpoint. The server runs until the process ends (or [`Self::stop`]).
#[derive(Debug)]
pub struct MetricsEndpoint {
    handle: PrometheusHandle,
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl MetricsEndpoint {
    /// The address it listens on (the port chosen when port 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The Prometheus text of every series recorded so far (what a scrape gets).
    pub fn render(&self) -> String {
        self.handle.render()
    }

    /// Stops answering (the recorder stays installed).
    pub fn stop(self) {
        self.task.abort();
    }
}

/// Installs the Prometheus recorder as the process's global recorder and serves `GET /metrics`
/// on `listen` (other paths: 404). Call it once, from inside a tokio runtime.
pub async fn serve(listen: impl ToSocketAddrs) -> Result<MetricsEndpoint, ExporterError> {
    let listener = TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)?
        .install_recorder()?;
    crate::metrics::describe();
    let served = handle.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let h = served.clone();
            tokio::spawn(async move {
                let _ = answer(stream, &h).await;
            });
        }
    });
    Ok(MetricsEndpoint { handle, addr, task })
}

/// Answers one HTTP/1.x request and closes the connection.
async fn answer(mut stream: TcpStream, handle: &PrometheusHandle) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    // The request line and headers; a body is neither expected nor read.
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16 * 1024 {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let request = String::from_utf8_lossy(&buf);
    let mut parts = request.split_whitespace();
    let (status, content_type, body) = match (parts.next(), parts.next()) {
        (Some("GET"), Some(path)) if path == "/metrics" || path.starts_with("/metrics?") => {
            ("200 OK", "text/plain; version=0.0.4", handle.render())
        }
        (Some("GET"), Some(_)) => ("404 Not Found", "text/plain", "not found\n".to_owned()),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "GET /metrics only\n".to_owned(),
        ),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}
