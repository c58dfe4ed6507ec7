//! Prometheus metrics of a worker's runtime, served at `--metrics-listen HOST:PORT`
//! (`GET /metrics`).
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
//! | `handoff_blocks_quarantined` | gauge | `role` | blocks held past the fence bound for a lost writer on this host that may still land a write (until it exits or confirms) |
//! | `handoff_transfers_total` | counter | `transport`, `op`, `outcome` | data-plane transfers (`write`/`read`) that answered `ok` or `failed` |
//! | `handoff_transfer_blocks_total` | counter | `transport`, `op` | blocks those transfers moved (ok ones) |
//! | `handoff_transfer_bytes_total` | counter | `transport`, `op` | bytes they moved (network planes: each block's share both ranks hold) |
//! | `handoff_transfer_seconds` | histogram | `transport`, `op` | how long each transfer took, ok or not |
//! | `handoff_block_bytes` | gauge | | bytes of one local block (all of its layers): blocks × this is bytes |
//! | `handoff_peers_lost_total` | counter | | peers declared lost (silent, restarted, unreachable) |
//! | `handoff_peers_live` | gauge | | peers with a live control connection (counted each heartbeat) |
//! | `handoff_superseded` | gauge | | 1 once a newer process holds this worker's rank (every request fails `superseded`: stop this process), else 0 |
//! | `handoff_messages_refused_total` | counter | `cause` | peer messages the runtime refused or dropped (`late`, `too_many_pending`, `bytes_full`, `buffer_full`, `never_opened`; `replaced_writer`: a confirmation from a new process in a lost writer's rank, which ends nothing) |
//! | `handoff_pushes_as_pull_total` | counter | | decode requests made for push over a one-sided plane that ran as pull, since a prefill rank was a process this worker cannot watch (another host) |
//! | `handoff_frames_refused_total` | counter | `cause` | control frames refused (`auth`, `oversized`, `truncated`, `version`, `unexpected`, `malformed`, `stale_incarnation`, `queue_full`) |
//!
//! The bootstrap server has its own (`handoff_bootstrap::BootstrapMetrics`); both are
//! served by `handoff_transport::exposition::serve_metrics`.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::event::ReleaseReason;
use crate::machine::State;
use handoff_transport::Role;

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

fn transfer_histogram() -> Histogram {
    // 50 µs .. ~1.6 s, doubling: a block on loopback to a whole request over a slow link.
    Histogram::new(exponential_buckets(50e-6, 2.0, 16))
}

/// One process's metrics (module docs). Cheap to share: every family is reference-counted.
pub struct Metrics {
    registry: Registry,
    /// Requests that failed, by reason (those done are [`SideValues::done`]).
    failed: Family<EndLabels, Counter>,
    /// Prefill's and decode's hot-path series, shared with the families that encode them.
    sides: Arc<[SideValues; 2]>,
    transfers: Family<TransferEnd, Counter>,
    transfer_blocks: Family<TransferLabels, Counter>,
    transfer_bytes: Family<TransferLabels, Counter>,
    transfer_seconds: Family<TransferLabels, Histogram, fn() -> Histogram>,
    block_bytes: Gauge,
    peers_lost: Counter,
    peers_live: Gauge,
    superseded: Gauge,
    refused: Family<CauseLabel, Counter>,
    frames_refused: Family<CauseLabel, Counter>,
    pushes_as_pull: Counter,
    /// Each (transport, op)'s [`TransferSeries`], made the first time it records: a
    /// handful (the transports this process uses, times `write` and `read`).
    transfer_series: Mutex<Vec<TransferSeries>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

/// The live states, as `state` labels, in [`live_index`] order.
const LIVE_STATES: [&str; 3] = ["bootstrapping", "waiting_for_input", "transferring"];

/// Every `ReleaseReason::as_str`, in [`release_index`] order.
const RELEASE_WHYS: [&str; 4] = ["done", "failed", "late", "shutdown"];

fn release_index(why: &ReleaseReason) -> usize {
    match why {
        ReleaseReason::Done => 0,
        ReleaseReason::Failed { .. } => 1,
        ReleaseReason::Late => 2,
        ReleaseReason::Shutdown => 3,
    }
}

fn live_index(state: &State) -> Option<usize> {
    match state {
        State::Bootstrapping => Some(0),
        State::WaitingForInput => Some(1),
        State::Transferring => Some(2),
        State::Done | State::Failed(_) => None,
    }
}

/// The `role` labels, in [`role_index`] order.
const ROLES: [&str; 2] = ["prefill", "decode"];

fn role_index(r: Role) -> usize {
    match r {
        Role::Prefill => 0,
        Role::Decode => 1,
    }
}

/// One role's series on the hot path (a state change, a hand-over, a release), side by
/// side: recording is an atomic add into the two cache lines a request's role touches, not
/// into a dozen series each in an allocation of its own (prometheus-client's handles), which
/// a worker among a thousand (the simulator's scale run) finds cold every time. Encoded by
/// [`SideFamily`] (and [`RequestsFamily`]), only once the role recorded (a worker exposes
/// only its own role's series).
#[derive(Debug, Default)]
#[repr(align(64))]
struct SideValues {
    used: AtomicBool,
    /// Live requests per state, in [`LIVE_STATES`] order.
    open: [AtomicI64; 3],
    done: AtomicU64,
    held: AtomicI64,
    /// Blocks released per why, in [`RELEASE_WHYS`] order.
    released: [AtomicU64; 4],
    fences: AtomicI64,
    quarantined: AtomicI64,
}

/// Which of a role's series a [`SideFamily`] encodes.
#[derive(Clone, Copy, Debug)]
enum SideSeries {
    Open,
    Held,
    Released,
    Fences,
    Quarantined,
}

/// One family of the roles' hot-path series, registered as any family is and read from
/// [`SideValues`] when scraped.
#[derive(Debug)]
struct SideFamily {
    sides: Arc<[SideValues; 2]>,
    series: SideSeries,
}

fn used(sides: &[SideValues; 2]) -> impl Iterator<Item = (&SideValues, &'static str)> {
    sides
        .iter()
        .zip(ROLES)
        .filter(|(side, _)| side.used.load(Ordering::Relaxed))
}

fn gauge(encoder: &mut MetricEncoder, labels: &impl EncodeLabelSet, v: &AtomicI64) -> Fmt {
    encoder
        .encode_family(labels)?
        .encode_gauge(&v.load(Ordering::Relaxed))
}

fn counter(encoder: &mut MetricEncoder, labels: &impl EncodeLabelSet, v: &AtomicU64) -> Fmt {
    encoder
        .encode_family(labels)?
        .encode_counter::<NoLabelSet, _, u64>(&v.load(Ordering::Relaxed), None)
}

type Fmt = Result<(), std::fmt::Error>;

impl EncodeMetric for SideFamily {
    fn encode(&self, mut encoder: MetricEncoder) -> Fmt {
        for (side, role) in used(&self.sides) {
            let e = &mut encoder;
            match self.series {
                SideSeries::Open => {
                    for (state, v) in LIVE_STATES.into_iter().zip(&side.open) {
                        gauge(e, &StateLabels { role, state }, v)?;
                    }
                }
                SideSeries::Released => {
                    for (why, v) in RELEASE_WHYS.into_iter().zip(&side.released) {
                        counter(e, &ReleaseLabels { role, why }, v)?;
                    }
                }
                SideSeries::Held => gauge(e, &RoleLabel { role }, &side.held)?,
                SideSeries::Fences => gauge(e, &RoleLabel { role }, &side.fences)?,
                SideSeries::Quarantined => gauge(e, &RoleLabel { role }, &side.quarantined)?,
            }
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        match self.series {
            SideSeries::Released => MetricType::Counter,
            _ => MetricType::Gauge,
        }
    }

    fn is_empty(&self) -> bool {
        used(&self.sides).next().is_none()
    }
}

/// `handoff_requests_total`: the roles' done counters ([`SideValues::done`]) and the
/// failed ones, by reason (a labelled family: failures are rare).
#[derive(Debug)]
struct RequestsFamily {
    sides: Arc<[SideValues; 2]>,
    failed: Family<EndLabels, Counter>,
}

impl EncodeMetric for RequestsFamily {
    fn encode(&self, mut encoder: MetricEncoder) -> Fmt {
        for (side, role) in used(&self.sides) {
            let done = EndLabels {
                role,
                outcome: "done",
                reason: "",
            };
            counter(&mut encoder, &done, &side.done)?;
        }
        self.failed.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Counter
    }

    fn is_empty(&self) -> bool {
        used(&self.sides).next().is_none() && self.failed.is_empty()
    }
}

/// One (transport, op)'s series that every transfer that went well records: handles into
/// their families, as [`Side`] keeps for a role, so a transfer costs atomic adds, not three
/// labelled lookups (a failed transfer's counter is looked up: failures are rare).
struct TransferSeries {
    transport: &'static str,
    op: &'static str,
    seconds: Histogram,
    ok: Counter,
    blocks: Counter,
    bytes: Counter,
}

impl Metrics {
    /// Every family registered, all at zero.
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("handoff");
        let sides: Arc<[SideValues; 2]> = Arc::default();
        let failed = Family::default();
        registry.register(
            "requests",
            "Requests ended, by role, outcome and failure reason",
            RequestsFamily {
                sides: Arc::clone(&sides),
                failed: failed.clone(),
            },
        );
        let side_family = |series| SideFamily {
            sides: Arc::clone(&sides),
            series,
        };
        registry.register(
            "requests_open",
            "Live requests per lifecycle state",
            side_family(SideSeries::Open),
        );
        registry.register(
            "blocks_held",
            "Blocks the runtime holds for requests",
            side_family(SideSeries::Held),
        );
        registry.register(
            "blocks_released",
            "Blocks given back to the engine, by why",
            side_family(SideSeries::Released),
        );
        registry.register(
            "fences_pending",
            "Ended requests whose blocks wait behind a fence",
            side_family(SideSeries::Fences),
        );
        registry.register(
            "blocks_quarantined",
            "Blocks held past the fence bound for a lost writer on this host that may still land a write",
            side_family(SideSeries::Quarantined),
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
        let superseded = Gauge::default();
        registry.register(
            "superseded",
            "1 once a newer process holds this worker's rank (it refuses every request: stop it), else 0",
            superseded.clone(),
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
        let pushes_as_pull = Counter::default();
        registry.register(
            "pushes_as_pull",
            "Decode requests made for push over a one-sided plane that ran as pull (a prefill rank this worker cannot watch)",
            pushes_as_pull.clone(),
        );
        Arc::new(Self {
            registry,
            failed,
            sides,
            transfers,
            transfer_blocks,
            transfer_bytes,
            transfer_seconds,
            block_bytes,
            peers_lost,
            peers_live,
            superseded,
            refused,
            frames_refused,
            pushes_as_pull,
            transfer_series: Mutex::new(Vec::new()),
        })
    }

    /// Everything, in the Prometheus text format (0.0.4).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a `String` cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        out
    }

    /// Role `r`'s hot-path series, marked as recorded into (so that they are exposed).
    fn side(&self, r: Role) -> &SideValues {
        let side = &self.sides[role_index(r)];
        if !side.used.load(Ordering::Relaxed) {
            side.used.store(true, Ordering::Relaxed);
        }
        side
    }

    /// A request of `r` entered `to` (from `from`, `None` when it was just opened).
    pub fn moved(&self, r: Role, from: Option<&State>, to: &State) {
        let side = self.side(r);
        if let Some(i) = from.and_then(live_index) {
            side.open[i].fetch_sub(1, Ordering::Relaxed);
        }
        match to {
            State::Done => {
                side.done.fetch_add(1, Ordering::Relaxed);
            }
            State::Failed(reason) => {
                let labels = EndLabels {
                    role: ROLES[role_index(r)],
                    outcome: "failed",
                    reason: reason.kind(),
                };
                self.failed.get_or_create(&labels).inc();
            }
            live => {
                if let Some(i) = live_index(live) {
                    side.open[i].fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// `n` blocks handed over to a request of `r` are held from now.
    pub fn held(&self, r: Role, n: usize) {
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        self.side(r).held.fetch_add(n, Ordering::Relaxed);
    }

    /// `n` blocks of a request of `r` go back for `why`; `held` of them were held.
    pub fn released(&self, r: Role, n: usize, held: usize, why: &ReleaseReason) {
        let side = self.side(r);
        side.released[release_index(why)].fetch_add(n as u64, Ordering::Relaxed);
        if held > 0 {
            let held = i64::try_from(held).unwrap_or(i64::MAX);
            side.held.fetch_sub(held, Ordering::Relaxed);
        }
    }

    /// A request of `r` started (`true`) or stopped (`false`) waiting behind a fence.
    pub fn fenced(&self, r: Role, pending: bool) {
        let delta = if pending { 1 } else { -1 };
        self.side(r).fences.fetch_add(delta, Ordering::Relaxed);
    }

    /// `delta` blocks of a request of `r` entered (positive) or left (negative) quarantine.
    pub fn quarantined(&self, r: Role, delta: i64) {
        self.side(r).quarantined.fetch_add(delta, Ordering::Relaxed);
    }

    /// A transfer over `transport` (`op`: `write` or `read`) of `blocks` answered after
    /// `took`, ok or not.
    pub fn transfer(
        &self,
        transport: &'static str,
        op: &'static str,
        blocks: usize,
        took: Duration,
        ok: bool,
    ) {
        self.with_transfer_series(transport, op, |series| {
            series.seconds.observe(took.as_secs_f64());
            if ok {
                series.ok.inc();
                series.blocks.inc_by(blocks as u64);
            }
        });
        if !ok {
            let end = TransferEnd {
                transport,
                op,
                outcome: "failed",
            };
            self.transfers.get_or_create(&end).inc();
        }
    }

    /// A transfer over `transport` (`op`) moved `bytes`.
    pub fn bytes_moved(&self, transport: &'static str, op: &'static str, bytes: u64) {
        self.with_transfer_series(transport, op, |series| {
            series.bytes.inc_by(bytes);
        });
    }

    /// Runs `record` on the series of (`transport`, `op`), made on first use.
    fn with_transfer_series(
        &self,
        transport: &'static str,
        op: &'static str,
        record: impl FnOnce(&TransferSeries),
    ) {
        // A panic while recording leaves nothing half-done to see: go on with the list.
        let mut known = self
            .transfer_series
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(series) = known
            .iter()
            .find(|s| s.transport == transport && s.op == op)
        {
            return record(series);
        }
        let labels = TransferLabels { transport, op };
        let ok = TransferEnd {
            transport,
            op,
            outcome: "ok",
        };
        let series = TransferSeries {
            transport,
            op,
            seconds: self.transfer_seconds.get_or_create(&labels).clone(),
            ok: self.transfers.get_or_create(&ok).clone(),
            blocks: self.transfer_blocks.get_or_create(&labels).clone(),
            bytes: self.transfer_bytes.get_or_create(&labels).clone(),
        };
        record(&series);
        known.push(series);
    }

    /// The local block size (bytes, all layers).
    pub fn set_block_bytes(&self, bytes: usize) {
        self.block_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// A peer was declared lost.
    pub fn peer_lost(&self) {
        self.peers_lost.inc();
    }

    /// `n` peers have a live control connection now.
    pub fn set_peers_live(&self, n: usize) {
        self.peers_live.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// A newer process holds this worker's rank: it refuses every request from now on.
    pub fn superseded(&self) {
        self.superseded.set(1);
    }

    /// A peer message refused or dropped for `cause`.
    pub fn refused(&self, cause: &'static str) {
        self.refused.get_or_create(&CauseLabel { cause }).inc();
    }

    /// A push request that runs as pull (`Action::PullsInstead`).
    pub fn pulls_instead(&self) {
        self.pushes_as_pull.inc();
    }

    /// A control frame refused for `cause` ([`handoff_transport::wire::WireError::cause`],
    /// or the control loop's own).
    pub fn frame_refused(&self, cause: &'static str) {
        self.frames_refused
            .get_or_create(&CauseLabel { cause })
            .inc();
    }
}

impl handoff_transport::exposition::Exposition for Metrics {
    fn encode(&self) -> String {
        Metrics::encode(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the series whose line starts with `series` (name and labels).
    fn value(text: &str, series: &str) -> Option<String> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .map(str::to_string)
    }

    #[test]
    fn a_roles_series_count_what_it_recorded_and_only_a_role_that_recorded_shows() {
        let m = Metrics::new();
        let text = m.encode();
        for family in [
            "requests",
            "blocks_held",
            "blocks_released",
            "fences",
            "blocks_q",
        ] {
            assert!(
                !text.contains(&format!("handoff_{family}")),
                "no family before anything is recorded: {text}"
            );
        }
        let failed = State::Failed(handoff_transport::FailureReason::TtlExpired);
        m.moved(Role::Decode, None, &State::Bootstrapping);
        m.moved(
            Role::Decode,
            Some(&State::Bootstrapping),
            &State::WaitingForInput,
        );
        m.moved(Role::Decode, None, &State::Bootstrapping);
        m.held(Role::Decode, 5);
        m.moved(Role::Decode, Some(&State::WaitingForInput), &State::Done);
        m.released(Role::Decode, 3, 3, &ReleaseReason::Done);
        m.moved(Role::Decode, Some(&State::Bootstrapping), &failed);
        m.fenced(Role::Decode, true);
        m.quarantined(Role::Decode, 2);
        let text = m.encode();
        let at = |series: &str| value(&text, series);
        let expect = [
            (
                r#"handoff_requests_open{role="decode",state="bootstrapping"}"#,
                "0",
            ),
            (
                r#"handoff_requests_open{role="decode",state="waiting_for_input"}"#,
                "0",
            ),
            (
                r#"handoff_requests_open{role="decode",state="transferring"}"#,
                "0",
            ),
            (
                r#"handoff_requests_total{role="decode",outcome="done",reason=""}"#,
                "1",
            ),
            (
                r#"handoff_requests_total{role="decode",outcome="failed",reason="ttl_expired"}"#,
                "1",
            ),
            (r#"handoff_blocks_held{role="decode"}"#, "2"),
            (
                r#"handoff_blocks_released_total{role="decode",why="done"}"#,
                "3",
            ),
            (
                r#"handoff_blocks_released_total{role="decode",why="late"}"#,
                "0",
            ),
            (r#"handoff_fences_pending{role="decode"}"#, "1"),
            (r#"handoff_blocks_quarantined{role="decode"}"#, "2"),
        ];
        for (series, v) in expect {
            assert_eq!(at(series).as_deref(), Some(v), "{series}: {text}");
        }
        assert!(
            text.contains("# TYPE handoff_requests_total counter"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE handoff_requests_open gauge"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE handoff_blocks_released_total counter"),
            "{text}"
        );
        assert!(
            !text.contains(r#"role="prefill""#),
            "prefill recorded nothing: {text}"
        );
        m.moved(Role::Prefill, None, &State::Bootstrapping);
        let text = m.encode();
        let open = r#"handoff_requests_open{role="prefill",state="bootstrapping"}"#;
        assert_eq!(value(&text, open).as_deref(), Some("1"), "{text}");
    }

    #[test]
    fn transfers_count_by_transport_op_and_outcome_through_their_kept_series() {
        let m = Metrics::new();
        let took = Duration::from_micros(120);
        m.transfer("tcp", "write", 3, took, true);
        m.bytes_moved("tcp", "write", 3 * 4096);
        m.transfer("tcp", "write", 2, took, true);
        m.bytes_moved("tcp", "write", 2 * 4096);
        m.transfer("tcp", "write", 5, took, false);
        m.transfer("tcp", "read", 1, took, true);
        m.transfer("ucx", "write", 7, took, false);
        let text = m.encode();
        let at = |series: &str| value(&text, series);
        let tcp_write = r#"{transport="tcp",op="write"}"#;
        assert_eq!(
            at(r#"handoff_transfers_total{transport="tcp",op="write",outcome="ok"}"#).as_deref(),
            Some("2"),
            "{text}"
        );
        assert_eq!(
            at(r#"handoff_transfers_total{transport="tcp",op="write",outcome="failed"}"#)
                .as_deref(),
            Some("1")
        );
        assert_eq!(
            at(&format!("handoff_transfer_blocks_total{tcp_write}")).as_deref(),
            Some("5"),
            "only the ok transfers' blocks"
        );
        assert_eq!(
            at(&format!("handoff_transfer_bytes_total{tcp_write}")).as_deref(),
            Some("20480")
        );
        assert_eq!(
            at(&format!("handoff_transfer_seconds_count{tcp_write}")).as_deref(),
            Some("3"),
            "every transfer's time, ok or not"
        );
        assert_eq!(
            at(r#"handoff_transfers_total{transport="tcp",op="read",outcome="ok"}"#).as_deref(),
            Some("1")
        );
        assert_eq!(
            at(r#"handoff_transfers_total{transport="ucx",op="write",outcome="failed"}"#)
                .as_deref(),
            Some("1")
        );
        assert_eq!(
            at(r#"handoff_transfer_blocks_total{transport="ucx",op="write"}"#).as_deref(),
            Some("0"),
            "a failed transfer moves no blocks"
        );
    }
}
