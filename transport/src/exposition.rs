//! The HTTP endpoint that serves Prometheus metrics (`--metrics-listen HOST:PORT`,
//! `GET /metrics`): one small, bounded HTTP/1.x responder, for whatever renders the text
//! format (the runtime's `Metrics`, the bootstrap server's `BootstrapMetrics`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

/// Bytes of an HTTP request head the endpoint reads at most (a scrape's is ~200).
pub const METRICS_REQUEST_BYTES_MAX: usize = 8 << 10;
/// How long a scraper has to send its request and take the answer.
pub const METRICS_IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Scrapes served at once; more wait for one to end.
pub const METRICS_CONNECTIONS_MAX: usize = 16;

/// Metrics that render themselves in the Prometheus text format (0.0.4).
pub trait Exposition: Send + Sync + 'static {
    /// Everything, in the text format.
    fn encode(&self) -> String;
}

/// The HTTP endpoint serving one [`Exposition`]: stops when dropped.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl MetricsServer {
    /// Where it listens (the port chosen, when asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `metrics` at `http://listen/metrics` (`HOST:PORT`; port 0 picks one) on the
/// current tokio runtime, until the returned server is dropped. Each scrape has
/// [`METRICS_IO_TIMEOUT`] to send at most [`METRICS_REQUEST_BYTES_MAX`] bytes of request
/// head and read the answer; at most [`METRICS_CONNECTIONS_MAX`] are served at once.
///
/// # Errors
/// The listener could not bind `listen`.
pub async fn serve_metrics<E: Exposition>(
    listen: &str,
    metrics: Arc<E>,
) -> std::io::Result<MetricsServer> {
    let listener = TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    info!(%addr, "metrics at http://{addr}/metrics");
    let slots = Arc::new(Semaphore::new(METRICS_CONNECTIONS_MAX));
    let task = tokio::spawn(async move {
        loop {
            let Ok(permit) = slots.clone().acquire_owned().await else {
                return;
            };
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    warn!(error = %e, "metrics: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let served = tokio::time::timeout(METRICS_IO_TIMEOUT, scrape(stream, &*metrics));
                match served.await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => debug!(%peer, error = %e, "metrics: scrape failed"),
                    Err(_) => debug!(%peer, "metrics: scrape timed out"),
                }
                drop(permit);
            });
        }
    });
    Ok(MetricsServer { addr, task })
}

/// Answers one HTTP/1.x request on `stream`, then closes it.
async fn scrape<E: Exposition + ?Sized>(mut stream: TcpStream, metrics: &E) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() >= METRICS_REQUEST_BYTES_MAX {
            return respond(&mut stream, "431 Request Header Fields Too Large", "").await;
        }
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|b| *b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|b| *b == b' ');
    let (method, path) = (parts.next(), parts.next());
    match (method, path) {
        (Some(b"GET"), Some(b"/metrics")) => {
            respond(&mut stream, "200 OK", &metrics.encode()).await
        }
        (Some(b"GET"), _) => respond(&mut stream, "404 Not Found", "see /metrics\n").await,
        _ => respond(&mut stream, "405 Method Not Allowed", "").await,
    }
}

async fn respond(stream: &mut TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}
