//! The bootstrap server's registry: plain data, no IO, no clock (every call takes `now`).
//!
//! The server actor feeds it decoded requests and turns its answers into replies; unit tests
//! drive it directly. Every rule about what a registration may do lives here.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use handoff_transport::wire::limits::ENGINES_MAX;
use handoff_transport::wire::{
    EngineStatus, QueryAnswer, StatusReply, WorkerRecord, WorkerSummary,
};
use handoff_transport::zmtp::ConnId;
use handoff_transport::{EngineId, Rank, RankInfo, Role};

use super::WORKERS_MAX;

/// Where a request came from: the connection (heartbeats on it keep its records alive) and
/// the peer's address (for logs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Origin {
    /// The connection the request arrived on.
    pub conn: ConnId,
    /// The peer's address.
    pub peer: SocketAddr,
}

/// What [`Registry::register`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegisterOutcome {
    /// A rank the registry did not hold.
    Added,
    /// The same record again (a retry, or a re-registration after a reconnect): kept,
    /// liveness refreshed.
    Refreshed,
    /// The rank's worker restarted: the newer incarnation replaced the older.
    Replaced {
        /// The incarnation that was replaced.
        old_incarnation: u64,
        /// The connection the replaced record was registered over.
        old_conn: ConnId,
    },
    /// The registration contradicts what the registry holds; the registry keeps its record.
    Conflict(Box<WorkerRecord>),
    /// A bound would be broken (registry full, engine full, bad sizes); the text says which.
    Refused(String),
}

/// A record removed by [`Registry::expire`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expired {
    /// The record.
    pub record: WorkerRecord,
    /// Where it last registered from.
    pub origin: Origin,
    /// How long it had been silent.
    pub silent: Duration,
}

struct Entry {
    record: WorkerRecord,
    origin: Origin,
    last_seen: Instant,
}

struct Engine {
    role: Role,
    /// (dp, tp, pp) sizes every rank of the engine agrees on.
    sizes: (u32, u32, u32),
    workers: BTreeMap<Rank, Entry>,
}

impl Engine {
    fn expected(&self) -> u32 {
        expected_ranks(self.sizes).unwrap_or(u32::MAX)
    }

    fn is_complete(&self) -> bool {
        self.workers.len() as u64 >= u64::from(self.expected())
    }

    fn first_other(&self, rank: Rank) -> Option<&WorkerRecord> {
        self.workers
            .iter()
            .find(|(r, _)| **r != rank)
            .map(|(_, e)| &e.record)
    }
}

fn sizes(rank: &RankInfo) -> (u32, u32, u32) {
    (rank.dp_size, rank.tp_size, rank.pp_size)
}

/// dp × tp × pp, or `None` when a size is zero or the product is not within
/// `1..=WORKERS_PER_ENGINE_MAX` (the wire layer refuses such records already; the registry
/// does not rely on it).
fn expected_ranks((dp, tp, pp): (u32, u32, u32)) -> Option<u32> {
    let n = u64::from(dp)
        .checked_mul(u64::from(tp))?
        .checked_mul(u64::from(pp))?;
    let max = handoff_transport::wire::limits::WORKERS_PER_ENGINE_MAX as u64;
    (1..=max).contains(&n).then_some(n as u32)
}

/// Every registered worker, by engine and rank, with when each was last heard from.
///
/// Bounded: at most [`ENGINES_MAX`] engines, at most dp × tp × pp ranks per engine (which
/// the wire limits cap at `WORKERS_PER_ENGINE_MAX`), at most [`WORKERS_MAX`] in all.
#[derive(Default)]
pub struct Registry {
    engines: BTreeMap<EngineId, Engine>,
    workers_total: usize,
    /// Which records each connection registered: heartbeats on a connection refresh these.
    by_conn: BTreeMap<ConnId, BTreeSet<(EngineId, Rank)>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Workers registered now, over every engine.
    pub fn workers(&self) -> usize {
        self.workers_total
    }

    /// Engines with at least one registered worker.
    pub fn engines(&self) -> usize {
        self.engines.len()
    }

    /// Registers `record`, arriving from `origin` at `now`. Idempotent: the same record again
    /// is [`RegisterOutcome::Refreshed`]. See [`RegisterOutcome`] for the rest.
    pub fn register(
        &mut self,
        record: WorkerRecord,
        origin: Origin,
        now: Instant,
    ) -> RegisterOutcome {
        let Some(expected) = expected_ranks(sizes(&record.rank)) else {
            let r = &record.rank;
            return RegisterOutcome::Refused(format!(
                "engine {}: sizes dp {} × tp {} × pp {} are not a valid layout",
                r.engine_id, r.dp_size, r.tp_size, r.pp_size
            ));
        };
        let rank = record.rank.rank();
        let engine_id = record.rank.engine_id.clone();
        let incarnation = record.incarnation;
        let refusal = match self.engines.get(&engine_id) {
            None => self.check_new_engine(&engine_id),
            Some(engine) => check_existing(engine, &record, expected).or_else(|| {
                let is_new_rank = !engine.workers.contains_key(&rank);
                if is_new_rank {
                    self.check_total()
                } else {
                    None
                }
            }),
        };
        if let Some(refusal) = refusal {
            return refusal;
        }
        let engine = self
            .engines
            .entry(engine_id.clone())
            .or_insert_with(|| Engine {
                role: record.role,
                sizes: sizes(&record.rank),
                workers: BTreeMap::new(),
            });
        // Only the rank being replaced could disagree (checked above): adopt the new layout.
        engine.role = record.role;
        engine.sizes = sizes(&record.rank);
        let entry = Entry {
            record,
            origin,
            last_seen: now,
        };
        let old = engine.workers.insert(rank, entry);
        let result = match old {
            None => {
                self.workers_total += 1;
                RegisterOutcome::Added
            }
            Some(old) => {
                self.unindex(old.origin.conn, &engine_id, rank);
                if old.record.incarnation == incarnation {
                    RegisterOutcome::Refreshed
                } else {
                    RegisterOutcome::Replaced {
                        old_incarnation: old.record.incarnation,
                        old_conn: old.origin.conn,
                    }
                }
            }
        };
        self.by_conn
            .entry(origin.conn)
            .or_default()
            .insert((engine_id, rank));
        result
    }

    fn check_new_engine(&self, engine_id: &EngineId) -> Option<RegisterOutcome> {
        if self.engines.len() >= ENGINES_MAX {
            return Some(RegisterOutcome::Refused(format!(
                "registry full: {} engines registered (ENGINES_MAX); engine {engine_id} refused",
                self.engines.len()
            )));
        }
        self.check_total()
    }

    fn check_total(&self) -> Option<RegisterOutcome> {
        (self.workers_total >= WORKERS_MAX).then(|| {
            RegisterOutcome::Refused(format!(
                "registry full: {} workers registered (WORKERS_MAX)",
                self.workers_total
            ))
        })
    }

    /// Refreshes every record registered over `conn` (a heartbeat, or any valid request, on
    /// it). Returns how many records were refreshed.
    pub fn touch(&mut self, conn: ConnId, now: Instant) -> usize {
        let Some(keys) = self.by_conn.get(&conn) else {
            return 0;
        };
        let mut touched = 0;
        for (engine_id, rank) in keys {
            if let Some(entry) = self
                .engines
                .get_mut(engine_id)
                .and_then(|e| e.workers.get_mut(rank))
            {
                entry.last_seen = now;
                touched += 1;
            }
        }
        touched
    }

    /// A connection closed: its records stay (the worker may reconnect and keep them alive)
    /// until they expire or are unregistered.
    pub fn disconnected(&mut self, conn: ConnId) {
        self.by_conn.remove(&conn);
    }

    /// Removes `rank`'s record if it has this `incarnation` (a late `Unregister` from a dead
    /// incarnation must not remove its successor). Returns the removed record, if any.
    pub fn unregister(&mut self, rank: &RankInfo, incarnation: u64) -> Option<WorkerRecord> {
        let key = rank.rank();
        let engine = self.engines.get_mut(&rank.engine_id)?;
        if engine.workers.get(&key)?.record.incarnation != incarnation {
            return None;
        }
        let entry = engine.workers.remove(&key)?;
        self.removed(&rank.engine_id, key, entry.origin.conn);
        Some(entry.record)
    }

    fn removed(&mut self, engine_id: &EngineId, rank: Rank, conn: ConnId) {
        self.workers_total = self.workers_total.saturating_sub(1);
        self.unindex(conn, engine_id, rank);
        if self
            .engines
            .get(engine_id)
            .is_some_and(|e| e.workers.is_empty())
        {
            self.engines.remove(engine_id);
        }
    }

    fn unindex(&mut self, conn: ConnId, engine_id: &EngineId, rank: Rank) {
        if let Some(keys) = self.by_conn.get_mut(&conn) {
            keys.remove(&(engine_id.clone(), rank));
            if keys.is_empty() {
                self.by_conn.remove(&conn);
            }
        }
    }

    /// Removes every record not heard from for `expire_after` or longer, and returns them in
    /// engine and rank order.
    pub fn expire(&mut self, now: Instant, expire_after: Duration) -> Vec<Expired> {
        let stale: Vec<(EngineId, Rank)> = self
            .engines
            .iter()
            .flat_map(|(id, engine)| {
                engine
                    .workers
                    .iter()
                    .filter(|(_, e)| now.saturating_duration_since(e.last_seen) >= expire_after)
                    .map(move |(rank, _)| (id.clone(), *rank))
            })
            .collect();
        let mut expired = Vec::with_capacity(stale.len());
        for (engine_id, rank) in stale {
            let Some(entry) = self
                .engines
                .get_mut(&engine_id)
                .and_then(|e| e.workers.remove(&rank))
            else {
                continue;
            };
            self.removed(&engine_id, rank, entry.origin.conn);
            expired.push(Expired {
                silent: now.saturating_duration_since(entry.last_seen),
                record: entry.record,
                origin: entry.origin,
            });
        }
        expired
    }

    /// What a `Query` for `engine` is answered with.
    pub fn query(&self, engine: &EngineId) -> QueryAnswer {
        let Some(e) = self.engines.get(engine) else {
            return QueryAnswer::UnknownEngine;
        };
        if e.is_complete() {
            QueryAnswer::Ready {
                workers: e.workers.values().map(|w| w.record.clone()).collect(),
            }
        } else {
            QueryAnswer::NotReady {
                registered: e.workers.keys().copied().collect(),
                expected: e.expected(),
            }
        }
    }

    /// Every engine and its workers, in engine and rank order.
    pub fn status(&self) -> StatusReply {
        StatusReply {
            engines: self
                .engines
                .iter()
                .map(|(id, e)| EngineStatus {
                    engine_id: id.clone(),
                    role: e.role,
                    expected: e.expected(),
                    workers: e
                        .workers
                        .iter()
                        .map(|(rank, w)| WorkerSummary {
                            rank: *rank,
                            incarnation: w.record.incarnation,
                            control_address: w.record.control_address.clone(),
                            data_address: w.record.data_address.clone(),
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

/// The checks for a registration into an engine the registry holds; `None` if it may go in.
fn check_existing(
    engine: &Engine,
    record: &WorkerRecord,
    expected: u32,
) -> Option<RegisterOutcome> {
    let rank = record.rank.rank();
    let conflict =
        |existing: &WorkerRecord| Some(RegisterOutcome::Conflict(Box::new(existing.clone())));
    if let Some(entry) = engine.workers.get(&rank) {
        let old = &entry.record;
        if record.incarnation < old.incarnation {
            return conflict(old);
        }
        if record.incarnation == old.incarnation && record != old {
            return conflict(old);
        }
    }
    // Role and sizes must agree with every other rank of the engine.
    if let Some(other) = engine.first_other(rank) {
        if other.role != record.role || sizes(&other.rank) != sizes(&record.rank) {
            return conflict(other);
        }
    }
    let is_new_rank = !engine.workers.contains_key(&rank);
    if is_new_rank && engine.workers.len() as u64 >= u64::from(expected) {
        let held: Vec<String> = engine.workers.keys().map(Rank::to_string).collect();
        return Some(RegisterOutcome::Refused(format!(
            "engine {} has all its {expected} ranks ({}); rank {rank} refused",
            record.rank.engine_id,
            held.join(", ")
        )));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn origin(conn: u64) -> Origin {
        Origin {
            conn: ConnId(conn),
            peer: SocketAddr::from(([127, 0, 0, 1], 1000 + conn as u16)),
        }
    }

    fn record(engine: &str, dp_rank: u32, dp_size: u32, incarnation: u64) -> WorkerRecord {
        let mut rank = RankInfo::single(engine);
        rank.dp_rank = dp_rank;
        rank.dp_size = dp_size;
        WorkerRecord {
            rank,
            role: Role::Prefill,
            incarnation,
            control_address: format!("tcp://10.0.0.{dp_rank}:5000"),
            data_address: format!("10.0.0.{dp_rank}:6000"),
            data_descriptor: vec![],
        }
    }

    #[test]
    fn the_same_record_twice_is_refreshed_and_a_newer_incarnation_replaces() {
        let mut reg = Registry::new();
        let t = Instant::now();
        let r = record("e", 0, 1, 1);
        assert_eq!(
            reg.register(r.clone(), origin(1), t),
            RegisterOutcome::Added
        );
        assert_eq!(
            reg.register(r.clone(), origin(2), t),
            RegisterOutcome::Refreshed
        );
        let mut moved = r.clone();
        moved.control_address = "tcp://elsewhere:1".into();
        assert_eq!(
            reg.register(moved.clone(), origin(2), t),
            RegisterOutcome::Conflict(Box::new(r.clone()))
        );
        moved.incarnation = 2;
        assert_eq!(
            reg.register(moved.clone(), origin(3), t),
            RegisterOutcome::Replaced {
                old_incarnation: 1,
                old_conn: ConnId(2)
            }
        );
        assert_eq!(
            reg.register(r, origin(1), t),
            RegisterOutcome::Conflict(Box::new(moved))
        );
        assert_eq!(reg.workers(), 1);
    }

    #[test]
    fn sparse_dp_ranks_complete_an_engine_and_a_third_is_refused() {
        let mut reg = Registry::new();
        let t = Instant::now();
        let e = EngineId::new("e");
        assert_eq!(reg.query(&e), QueryAnswer::UnknownEngine);
        reg.register(record("e", 2, 2, 1), origin(1), t);
        assert!(matches!(
            reg.query(&e),
            QueryAnswer::NotReady { expected: 2, .. }
        ));
        reg.register(record("e", 5, 2, 1), origin(2), t);
        assert!(matches!(reg.query(&e), QueryAnswer::Ready { workers } if workers.len() == 2));
        assert!(matches!(
            reg.register(record("e", 7, 2, 1), origin(3), t),
            RegisterOutcome::Refused(_)
        ));
    }

    #[test]
    fn sizes_that_disagree_conflict_with_a_rank_already_held() {
        let mut reg = Registry::new();
        let t = Instant::now();
        let first = record("e", 0, 2, 1);
        reg.register(first.clone(), origin(1), t);
        assert_eq!(
            reg.register(record("e", 1, 4, 1), origin(2), t),
            RegisterOutcome::Conflict(Box::new(first.clone()))
        );
        let mut decode = record("e", 1, 2, 1);
        decode.role = Role::Decode;
        assert_eq!(
            reg.register(decode, origin(2), t),
            RegisterOutcome::Conflict(Box::new(first))
        );
    }

    #[test]
    fn silent_records_expire_heartbeats_keep_them_and_disconnects_do_not_remove() {
        let mut reg = Registry::new();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(6);
        reg.register(record("e", 0, 2, 1), origin(1), t0);
        reg.register(record("e", 1, 2, 1), origin(2), t0);
        reg.disconnected(ConnId(2));
        assert_eq!(reg.touch(ConnId(1), t0 + Duration::from_secs(5)), 1);
        let expired = reg.expire(t0 + ttl, ttl);
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].record.rank.dp_rank, 1);
        assert_eq!(reg.workers(), 1);
        assert!(reg.expire(t0 + Duration::from_secs(10), ttl).is_empty());
        assert_eq!(reg.expire(t0 + Duration::from_secs(11), ttl).len(), 1);
        assert_eq!(reg.engines(), 0);
    }

    #[test]
    fn unregister_removes_only_the_matching_incarnation() {
        let mut reg = Registry::new();
        let t = Instant::now();
        let r = record("e", 0, 1, 3);
        reg.register(r.clone(), origin(1), t);
        assert_eq!(reg.unregister(&r.rank, 2), None);
        assert_eq!(reg.unregister(&r.rank, 3), Some(r.clone()));
        assert_eq!(reg.unregister(&r.rank, 3), None);
        assert_eq!(reg.status().engines, vec![]);
        assert_eq!(reg.touch(ConnId(1), t), 0);
    }

    #[test]
    fn the_registry_refuses_engines_past_its_bound() {
        let mut reg = Registry::new();
        let t = Instant::now();
        for i in 0..ENGINES_MAX {
            let outcome = reg.register(record(&format!("e{i}"), 0, 1, 1), origin(1), t);
            assert_eq!(outcome, RegisterOutcome::Added);
        }
        assert!(matches!(
            reg.register(record("one-more", 0, 1, 1), origin(1), t),
            RegisterOutcome::Refused(text) if text.contains("ENGINES_MAX")
        ));
    }
}
