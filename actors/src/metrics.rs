//! Prometheus metrics of a worker's runtime and of the bootstrap server, and the HTTP
//! endpoint that serves them (`--metrics-listen HOST:PORT`, `GET /metrics`).
//!
//! Every runtime records into a [`Metrics`] (its own, or one given to
//! [`crate::RuntimeBuilder::metrics`] to share); recording is a few atomic adds, so it is
//! always on. The families, each named `handoff_*`:
//!
//! | family | type | labels | what |
//! | --- | --- | --- | --- |
//! | `handoff_requests_total` | counter | `role`, `outcome` (`done`/`failed`), `reason` | requests ended, by failure reason (`FailureReason::kind`; empty when done) |
//! | `handoff_requests_open` | gauge | `role`, `state` | live requests per lifecycle state |
//! | `handoff_blocks_held` | gauge | `role` | blocks the runtime holds for requests |
//! | `handoff_blocks_released_total` | counter | `role`, `why` | blocks given back (`done`, `failed`, `late`, `shutdown`) |
//! | `handoff_fences_pending` | gauge | `role` | ended requests whose blocks wait behind a fence |
//! | `handoff_transfers_total` | counter | `transport`, `op`, `outcome` | data-plane transfers (`write`/`read`) that answered `ok` or `failed` |
//! | `handoff_transfer_blocks_total` | counter | `transport`, `op` | blocks those transfers moved (ok ones) |
//! | `handoff_transfer_bytes_total` | counter | `transport`, `op` | bytes they moved (network planes: each block's share both ranks hold) |
//! | `handoff_transfer_seconds` | histogram | `transport`, `op` | how long each transfer took, ok or not |
//! | `handoff_block_bytes` | gauge | | bytes of one local block (all of its layers): blocks × this is bytes |
//! | `handoff_peers_lost_total` | counter | | peers declared lost (silent, restarted, unreachable) |
//! | `handoff_peers_live` | gauge | | peers with a live control connection (counted each heartbeat) |
//! | `handoff_messages_refused_total` | counter | `cause` | peer messages the runtime refused or dropped (`late`, `too_many_pending`, `bytes_full`, `buffer_full`, `never_opened`) |
//! | `handoff_frames_refused_total` | counter | `cause` | control frames refused (`auth`, `oversized`, `truncated`, `version`, `unexpected`, `malformed`, `stale_incarnation`, `queue_full`) |
//! | `handoff_bootstrap_registrations_total` | counter | `outcome` | bootstrap server: registrations by outcome |
//! | `handoff_bootstrap_lookups_total` | counter | `outcome` | bootstrap server: lookups by outcome |

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::event::ReleaseReason;
use crate::machine::State;
use handoff_transport::Role;

/// Bytes of an HTTP request head the endpoint reads at most (a scrape's is ~200).
pub const METRICS_REQUEST_BYTES_MAX: usize = 8 << 10;
/// How long a scraper has to send its request and take the answer.
pub const METRICS_IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Scrapes served at once; more wait for one to end.
pub const METRICS_CONNECTIONS_MAX: usize = 16;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndLabels {
    role: &'static str,
    outcome: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    role: &'static str,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RoleLabel {
    role: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReleaseLabels {
    role: &'static str,
    why: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TransferLabels {
    transport: &'static str,
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TransferEnd {
    transport: &'static str,
    op: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabel {
    cause: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

fn transfer_histogram() -> Histogram {
    // 50 µs .. ~1.6 s, doubling: a block on loopback to a whole request over a slow link.
    Histogram::new(exponential_buckets(50e-6, 2.0, 16))
}

/// One process's metrics (module docs). Cheap to share: every family is reference-counted.
pub struct Metrics {
    registry: Registry,
    requests: Family<EndLabels, Counter>,
    open: Family<StateLabels, Gauge>,
    blocks_held: Family<RoleLabel, Gauge>,
    released: Family<ReleaseLabels, Counter>,
    fences: Family<RoleLabel, Gauge>,
    transfers: Family<TransferEnd, Counter>,
    transfer_blocks: Family<TransferLabels, Counter>,
    transfer_bytes: Family<TransferLabels, Counter>,
    transfer_seconds: Family<TransferLabels, Histogram, fn() -> Histogram>,
    block_bytes: Gauge,
    peers_lost: Counter,
    peers_live: Gauge,
    refused: Family<CauseLabel, Counter>,
    frames_refused: Family<CauseLabel, Counter>,
    registrations: Family<OutcomeLabel, Counter>,
    lookups: Family<OutcomeLabel, Counter>,
    /// Prefill's and decode's [`Side`].
    sides: [OnceLock<Side>; 2],
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

/// The live states, as `state` labels, in [`live_index`] order.
const LIVE_STATES: [&str; 3] = ["bootstrapping", "waiting_for_input", "transferring"];

/// Every `ReleaseReason::as_str`, in [`Side::released`] order.
const RELEASE_WHYS: [&str; 4] = ["done", "failed", "late", "shutdown"];

fn live_index(state: &State) -> Option<usize> {
    match state {
        State::Bootstrapping => Some(0),
        State::WaitingForInput => Some(1),
        State::Transferring => Some(2),
        State::Done | State::Failed(_) => None,
    }
}

/// One role's series on the hot path (a state change, a hand-over, a release): handles
/// into their families, so recording is an atomic add, not a labelled lookup.
struct Side {
    role: &'static str,
    open: [Gauge; 3],
    done: Counter,
    held: Gauge,
    released: [Counter; 4],
    fences: Gauge,
}

impl Metrics {
    /// Every family registered, all at zero.
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("handoff");
        let requests = Family::default();
        registry.register(
            "requests",
            "Requests ended, by role, outcome and failure reason",
            requests.clone(),
        );
        let open = Family::default();
        registry.register(
            "requests_open",
            "Live requests per lifecycle state",
            open.clone(),
        );
        let blocks_held = Family::default();
        registry.register(
            "blocks_held",
            "Blocks the runtime holds for requests",
            blocks_held.clone(),
        );
        let released = Family::default();
        registry.register(
            "blocks_released",
            "Blocks given back to the engine, by why",
            released.clone(),
        );
        let fences = Family::default();
        registry.register(
            "fences_pending",
            "Ended requests whose blocks wait behind a fence",
            fences.clone(),
        );
        let transfers = Family::default();
        registry.register(
            "transfers",
            "Data-plane transfers, by transport, op and outcome",
            transfers.clone(),
        );
        let transfer_blocks = Family::default();
        registry.register(
            "transfer_blocks",
            "Blocks moved by transfers that succeeded",
            transfer_blocks.clone(),
        );
        let transfer_bytes = Family::default();
        registry.register(
            "transfer_bytes",
            "Bytes moved by transfers that succeeded",
            transfer_bytes.clone(),
        );
        let transfer_seconds =
            Family::<TransferLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                transfer_histogram,
            );
        registry.register(
            "transfer_seconds",
            "Time from posting a transfer to its answer",
            transfer_seconds.clone(),
        );
        let block_bytes = Gauge::default();
        registry.register(
            "block_bytes",
            "Bytes of one local block, all of its layers",
            block_bytes.clone(),
        );
        let peers_lost = Counter::default();
        registry.register(
            "peers_lost",
            "Peers declared lost (silent, restarted or unreachable)",
            peers_lost.clone(),
        );
        let peers_live = Gauge::default();
        registry.register(
            "peers_live",
            "Peers with a live control connection, counted each heartbeat",
            peers_live.clone(),
        );
        let refused = Family::default();
        registry.register(
            "messages_refused",
            "Peer messages refused or dropped, by cause",
            refused.clone(),
        );
        let frames_refused = Family::default();
        registry.register(
            "frames_refused",
            "Control frames refused, by cause",
            frames_refused.clone(),
        );
        let registrations = Family::default();
        registry.register(
            "bootstrap_registrations",
            "Bootstrap server: worker registrations, by outcome",
            registrations.clone(),
        );
        let lookups = Family::default();
        registry.register(
            "bootstrap_lookups",
            "Bootstrap server: lookups, by outcome",
            lookups.clone(),
        );
        Arc::new(Self {
            registry,
            requests,
            open,
            blocks_held,
            released,
            fences,
            transfers,
            transfer_blocks,
            transfer_bytes,
            transfer_seconds,
            block_bytes,
            peers_lost,
            peers_live,
            refused,
            frames_refused,
            registrations,
            lookups,
            sides: [OnceLock::new(), OnceLock::new()],
        })
    }

    /// Everything, in the Prometheus text format (0.0.4).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a `String` cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        out
    }

    /// The hot path's handles for role `r`, made the first time the role records (so a
    /// worker exposes only its own role's series).
    fn side(&self, r: Role) -> &Side {
        let (slot, role) = match r {
            Role::Prefill => (&self.sides[0], "prefill"),
            Role::Decode => (&self.sides[1], "decode"),
        };
        slot.get_or_init(|| {
            let open = LIVE_STATES.map(|state| {
                let labels = StateLabels { role, state };
                self.open.get_or_create(&labels).clone()
            });
            let released = RELEASE_WHYS.map(|why| {
                let labels = ReleaseLabels { role, why };
                self.released.get_or_create(&labels).clone()
            });
            let done = EndLabels {
                role,
                outcome: "done",
                reason: "",
            };
            Side {
                role,
                open,
                done: self.requests.get_or_create(&done).clone(),
                held: self.blocks_held.get_or_create(&RoleLabel { role }).clone(),
                released,
                fences: self.fences.get_or_create(&RoleLabel { role }).clone(),
            }
        })
    }

    /// A request of `r` entered `to` (from `from`, `None` when it was just opened).
    pub(crate) fn moved(&self, r: Role, from: Option<&State>, to: &State) {
        let side = self.side(r);
        if let Some(i) = from.and_then(live_index) {
            side.open[i].dec();
        }
        match to {
            State::Done => {
                side.done.inc();
            }
            State::Failed(reason) => {
                let labels = EndLabels {
                    role: side.role,
                    outcome: "failed",
                    reason: reason.kind(),
                };
                self.requests.get_or_create(&labels).inc();
            }
            live => {
                if let Some(i) = live_index(live) {
                    side.open[i].inc();
                }
            }
        }
    }

    /// `n` blocks handed over to a request of `r` are held from now.
    pub(crate) fn held(&self, r: Role, n: usize) {
        self.side(r).held.inc_by(n as i64);
    }

    /// `n` blocks of a request of `r` go back for `why`; `held` of them were held.
    pub(crate) fn released(&self, r: Role, n: usize, held: usize, why: &ReleaseReason) {
        let side = self.side(r);
        let i = RELEASE_WHYS
            .iter()
            .position(|w| *w == why.as_str())
            .unwrap_or(0);
        side.released[i].inc_by(n as u64);
        if held > 0 {
            side.held.dec_by(held as i64);
        }
    }

    /// A request of `r` started (`true`) or stopped (`false`) waiting behind a fence.
    pub(crate) fn fenced(&self, r: Role, pending: bool) {
        let gauge = &self.side(r).fences;
        if pending {
            gauge.inc();
        } else {
            gauge.dec();
        }
    }

    /// A transfer over `transport` (`op`: `write` or `read`) of `blocks` answered after
    /// `took`, ok or not.
    pub(crate) fn transfer(
        &self,
        transport: &'static str,
        op: &'static str,
        blocks: usize,
        took: Duration,
        ok: bool,
    ) {
        let labels = TransferLabels { transport, op };
        self.transfer_seconds
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
        let outcome = if ok { "ok" } else { "failed" };
        let end = TransferEnd {
            transport,
            op,
            outcome,
        };
        self.transfers.get_or_create(&end).inc();
        if ok {
            self.transfer_blocks
                .get_or_create(&labels)
                .inc_by(blocks as u64);
        }
    }

    /// A transfer over `transport` (`op`) moved `bytes`.
    pub(crate) fn bytes_moved(&self, transport: &'static str, op: &'static str, bytes: u64) {
        let labels = TransferLabels { transport, op };
        self.transfer_bytes.get_or_create(&labels).inc_by(bytes);
    }

    /// The local block size (bytes, all layers).
    pub(crate) fn set_block_bytes(&self, bytes: usize) {
        self.block_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// A peer was declared lost.
    pub(crate) fn peer_lost(&self) {
        self.peers_lost.inc();
    }

    /// `n` peers have a live control connection now.
    pub(crate) fn set_peers_live(&self, n: usize) {
        self.peers_live.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// A peer message refused or dropped for `cause`.
    pub(crate) fn refused(&self, cause: &'static str) {
        self.refused.get_or_create(&CauseLabel { cause }).inc();
    }

    /// A control frame refused for `cause` ([`handoff_transport::wire::WireError::cause`],
    /// or the control loop's own).
    pub(crate) fn frame_refused(&self, cause: &'static str) {
        self.frames_refused
            .get_or_create(&CauseLabel { cause })
            .inc();
    }

    /// Bootstrap server: a registration ended as `outcome`.
    pub(crate) fn registration(&self, outcome: &'static str) {
        self.registrations
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    /// Bootstrap server: a lookup ended as `outcome`.
    pub(crate) fn lookup(&self, outcome: &'static str) {
        self.lookups.get_or_create(&OutcomeLabel { outcome }).inc();
    }
}

/// The HTTP endpoint serving one [`Metrics`]: stops when dropped.
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
pub async fn serve_metrics(listen: &str, metrics: Arc<Metrics>) -> std::io::Result<MetricsServer> {
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
                let served = tokio::time::timeout(METRICS_IO_TIMEOUT, scrape(stream, &metrics));
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
async fn scrape(mut stream: TcpStream, metrics: &Metrics) -> std::io::Result<()> {
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
