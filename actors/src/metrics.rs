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
//! | `handoff_messages_refused_total` | counter | `cause` | peer messages the runtime refused or dropped (`late`, `too_many_pending`, `bytes_full`, `buffer_full`, `never_opened`; `replaced_writer`: a confirmation from a new process in a lost writer's rank, which ends nothing) |
//! | `handoff_pushes_as_pull_total` | counter | | decode requests made for push over a one-sided plane that ran as pull, since a prefill rank was a process this worker cannot watch (another host) |
//! | `handoff_frames_refused_total` | counter | `cause` | control frames refused (`auth`, `oversized`, `truncated`, `version`, `unexpected`, `malformed`, `stale_incarnation`, `queue_full`) |
//!
//! The bootstrap server has its own (`handoff_bootstrap::BootstrapMetrics`); both are
//! served by `handoff_transport::exposition::serve_metrics`.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
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
    requests: Family<EndLabels, Counter>,
    open: Family<StateLabels, Gauge>,
    blocks_held: Family<RoleLabel, Gauge>,
    released: Family<ReleaseLabels, Counter>,
    fences: Family<RoleLabel, Gauge>,
    quarantined: Family<RoleLabel, Gauge>,
    transfers: Family<TransferEnd, Counter>,
    transfer_blocks: Family<TransferLabels, Counter>,
    transfer_bytes: Family<TransferLabels, Counter>,
    transfer_seconds: Family<TransferLabels, Histogram, fn() -> Histogram>,
    block_bytes: Gauge,
    peers_lost: Counter,
    peers_live: Gauge,
    refused: Family<CauseLabel, Counter>,
    frames_refused: Family<CauseLabel, Counter>,
    pushes_as_pull: Counter,
    /// Prefill's and decode's [`Side`].
    sides: [OnceLock<Side>; 2],
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

/// One role's series on the hot path (a state change, a hand-over, a release): handles
/// into their families, so recording is an atomic add, not a labelled lookup.
struct Side {
    role: &'static str,
    open: [Gauge; 3],
    done: Counter,
    held: Gauge,
    released: [Counter; 4],
    fences: Gauge,
    quarantined: Gauge,
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
        let quarantined = Family::default();
        registry.register(
            "blocks_quarantined",
            "Blocks held past the fence bound for a lost writer on this host that may still land a write",
            quarantined.clone(),
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
        let pushes_as_pull = Counter::default();
        registry.register(
            "pushes_as_pull",
            "Decode requests made for push over a one-sided plane that ran as pull (a prefill rank this worker cannot watch)",
            pushes_as_pull.clone(),
        );
        Arc::new(Self {
            registry,
            requests,
            open,
            blocks_held,
            released,
            fences,
            quarantined,
            transfers,
            transfer_blocks,
            transfer_bytes,
            transfer_seconds,
            block_bytes,
            peers_lost,
            peers_live,
            refused,
            frames_refused,
            pushes_as_pull,
            sides: [OnceLock::new(), OnceLock::new()],
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
                quarantined: self.quarantined.get_or_create(&RoleLabel { role }).clone(),
            }
        })
    }

    /// A request of `r` entered `to` (from `from`, `None` when it was just opened).
    pub fn moved(&self, r: Role, from: Option<&State>, to: &State) {
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
    pub fn held(&self, r: Role, n: usize) {
        self.side(r).held.inc_by(n as i64);
    }

    /// `n` blocks of a request of `r` go back for `why`; `held` of them were held.
    pub fn released(&self, r: Role, n: usize, held: usize, why: &ReleaseReason) {
        let side = self.side(r);
        side.released[release_index(why)].inc_by(n as u64);
        if held > 0 {
            side.held.dec_by(held as i64);
        }
    }

    /// A request of `r` started (`true`) or stopped (`false`) waiting behind a fence.
    pub fn fenced(&self, r: Role, pending: bool) {
        let gauge = &self.side(r).fences;
        if pending {
            gauge.inc();
        } else {
            gauge.dec();
        }
    }

    /// `delta` blocks of a request of `r` entered (positive) or left (negative) quarantine.
    pub fn quarantined(&self, r: Role, delta: i64) {
        self.side(r).quarantined.inc_by(delta);
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
