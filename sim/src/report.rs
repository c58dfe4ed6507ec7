//! What a simulation found: outcomes, latencies, invariant results, the trace hash.

use std::collections::BTreeMap;
use std::fmt;

use crate::net::NetStats;

/// The invariants a simulation checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub enum Invariant {
    /// Every rank of every request ends by its deadline.
    NoHang,
    /// Every block handed over is released exactly once, and every pool ends all free.
    NoLeak,
    /// No panic but the injected ones.
    NoCrash,
    /// A `Done` decode rank holds exactly the bytes prefill wrote; no transfer lands in
    /// blocks their request no longer owns.
    Integrity,
    /// No side claims success the other side cannot back (see the crate docs).
    Agreement,
    /// With faults off, every request ends `Done` on every rank.
    Liveness,
    /// The engine-facing API behaves as documented (states only move forward, calls that
    /// must succeed succeed).
    Api,
}

impl Invariant {
    /// Every invariant, in order.
    pub const ALL: [Invariant; 7] = [
        Invariant::NoHang,
        Invariant::NoLeak,
        Invariant::NoCrash,
        Invariant::Integrity,
        Invariant::Agreement,
        Invariant::Liveness,
        Invariant::Api,
    ];
}

/// One broken invariant, with what is needed to understand it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Violation {
    /// Which.
    pub invariant: Invariant,
    /// When, virtual ms.
    pub t_ms: u64,
    /// The request, if one is involved.
    pub request: Option<u64>,
    /// What broke.
    pub detail: String,
    /// The request's last trace lines (or the run's, if no request is involved).
    pub lines: Vec<String>,
}

/// Percentiles of a latency, virtual ms.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Percentiles {
    /// Samples.
    pub count: u64,
    /// Median.
    pub p50: u64,
    /// 90th percentile.
    pub p90: u64,
    /// 99th percentile.
    pub p99: u64,
    /// Largest.
    pub max: u64,
}

impl Percentiles {
    /// From unsorted samples.
    pub fn of(mut samples: Vec<u64>) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_unstable();
        let at = |q: u64| samples[((samples.len() as u64 - 1) * q / 100) as usize];
        Self {
            count: samples.len() as u64,
            p50: at(50),
            p90: at(90),
            p99: at(99),
            max: at(100),
        }
    }
}

/// Outcome counts of a set of requests.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Outcomes {
    /// Requests that ended `Done` on every rank.
    pub done: u64,
    /// Requests that failed, by the merged reason's kind.
    pub failed: BTreeMap<String, u64>,
    /// Requests whose ranks disagree (some `Done`, some `Failed`): possible when a final
    /// message races a failure; the merged state is `Failed`.
    pub split: u64,
    /// Final states of single ranks, as `side:kind` (`decode:done`, `prefill:ttl_expired`).
    pub ranks: BTreeMap<String, u64>,
}

/// How one rank of one request ended (kept when `SimConfig::keep_outcomes` is set).
#[derive(Clone, Debug, serde::Serialize)]
pub struct RankOutcome {
    /// The worker.
    pub worker: usize,
    /// Its engine (`P0`, `D1`, ...).
    pub engine: String,
    /// Prefill or decode.
    pub prefill: bool,
    /// Its tp rank.
    pub tp: u32,
    /// Its pp rank.
    pub pp: u32,
    /// `done` or the failure kind.
    pub end: String,
    /// When it opened, virtual ms.
    pub opened_ms: u64,
    /// When the engine saw it end, virtual ms.
    pub end_ms: u64,
}

/// How one request ended, rank by rank.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RequestOutcome {
    /// The request index (`r<index>`).
    pub req: u64,
    /// From the liveness phase.
    pub liveness: bool,
    /// Its ranks that opened.
    pub ranks: Vec<RankOutcome>,
}

/// The result of one simulation.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// Every setting, as printed at the start.
    pub settings: String,
    /// Workers in the cluster.
    pub workers: u64,
    /// Safety-phase outcomes.
    pub safety: Outcomes,
    /// Liveness-phase outcomes.
    pub liveness: Outcomes,
    /// Request arrival to the last decode rank's `Done`, for requests done everywhere.
    pub latency_ms: Percentiles,
    /// Every request's ranks, if kept.
    #[serde(skip)]
    pub outcomes: Vec<RequestOutcome>,
    /// Faults injected at the cluster level.
    pub injected: BTreeMap<String, u64>,
    /// Network counters.
    pub net: NetStats,
    /// Broken invariants (the run stops at the first).
    pub violations: Vec<Violation>,
    /// FNV-1a 64 of the canonical trace.
    pub trace_hash: u64,
    /// Trace lines hashed.
    pub trace_lines: u64,
    /// Virtual time simulated, ms.
    pub virtual_ms: u64,
    /// Wall time the run took, ms (not part of the trace).
    pub wall_ms: u64,
}

impl Report {
    /// True if no invariant broke.
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// Requests simulated, both phases.
    pub fn requests(&self) -> u64 {
        let n = |o: &Outcomes| o.done + o.failed.values().sum::<u64>();
        n(&self.safety) + n(&self.liveness)
    }

    /// The line that replays this run.
    pub fn replay_line(&self) -> String {
        format!("replay: HANDOFF_SIM_SEED={}", self.seed)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let outcomes = |o: &Outcomes| {
            let failed: Vec<String> = o.failed.iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!(
                "done {} failed {} [{}] split {}",
                o.done,
                o.failed.values().sum::<u64>(),
                failed.join(" "),
                o.split
            )
        };
        writeln!(
            f,
            "seed {}: {} workers, {} requests",
            self.seed,
            self.workers,
            self.requests()
        )?;
        writeln!(f, "  safety:   {}", outcomes(&self.safety))?;
        writeln!(f, "  liveness: {}", outcomes(&self.liveness))?;
        let l = &self.latency_ms;
        writeln!(
            f,
            "  transfer latency (virtual ms, arrival to decode Done): p50 {} p90 {} p99 {} max {} (n={})",
            l.p50, l.p90, l.p99, l.max, l.count
        )?;
        let injected: Vec<String> = self
            .injected
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        writeln!(f, "  injected: {}", injected.join(" "))?;
        let n = &self.net;
        writeln!(
            f,
            "  network: sent {} delivered {} lost {} partitioned {} dead_end {} dup {} stale {} refused {} heartbeats {} heard {} closed_unengaged {} transfers ok {} failed {} slow {} fenced {} stale_source {} peer_lost {} deferred {} lease_refused {} confirmed_late {} posted_unchecked {} pulls_instead {} queries_refused_lost {} lost_found {} records_expired {} registered_again {}",
            n.sent, n.delivered, n.lost, n.partitioned, n.dead_end, n.duplicated, n.stale, n.refused, n.heartbeats, n.heartbeats_heard, n.closed_unengaged,
            n.transfers_ok, n.transfers_failed, n.transfers_slow, n.fenced, n.stale_source, n.peer_lost,
            n.deferred, n.lease_refused, n.confirmed_late, n.posted_unchecked, n.pulls_instead,
            n.queries_refused_lost, n.lost_found, n.records_expired, n.registered_again
        )?;
        for inv in Invariant::ALL {
            let broken = self
                .violations
                .iter()
                .filter(|v| v.invariant == inv)
                .count();
            let verdict = if broken == 0 {
                "ok".to_string()
            } else {
                format!("VIOLATED ({broken})")
            };
            writeln!(f, "  invariant {inv:?}: {verdict}")?;
        }
        for v in &self.violations {
            let req = v
                .request
                .map(|r| format!(" request r{r}"))
                .unwrap_or_default();
            writeln!(
                f,
                "  violation {:?} at t={} ms{req}: {}",
                v.invariant, v.t_ms, v.detail
            )?;
            for line in &v.lines {
                writeln!(f, "    | {line}")?;
            }
        }
        writeln!(
            f,
            "  trace hash {:016x} ({} lines), {} virtual ms in {} wall ms",
            self.trace_hash, self.trace_lines, self.virtual_ms, self.wall_ms
        )?;
        if !self.ok() {
            writeln!(f, "{}", self.replay_line())?;
        }
        Ok(())
    }
}
