//! Where a worker finds its peers: the bootstrap server (through its client) or an etcd
//! cluster (`etcd://` addresses) in production, or a fixed list for static deployments and
//! tests.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;

use handoff_transport::wire::messages::WorkerRecord;
use handoff_transport::{EngineId, RankInfo};

use handoff_actors::link::ResolveError;
use handoff_bootstrap::BootstrapError;

/// A boxed future, as the directory's methods return.
pub type DirectoryFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The registry of workers, as the network transport uses it.
pub trait Directory: Send + Sync + 'static {
    /// Registers this worker (and keeps it registered). Resolves once the registration is
    /// accepted, or with the reason it never was (naming the bootstrap address).
    fn register(&self, record: WorkerRecord) -> DirectoryFuture<Result<(), BootstrapError>>;

    /// Every worker of `engine`, once all its ranks have registered. `NotReady` while some
    /// are missing; `Fatal` when asking again will not help.
    fn lookup(&self, engine: &EngineId)
        -> DirectoryFuture<Result<Vec<WorkerRecord>, ResolveError>>;

    /// Every registered worker of `engine` as the directory holds them, workers it was told
    /// it lost included ([`lost`](Self::lost)): what a dial needs to reach a peer it already
    /// knows. The dial's handshake says whether that process answers, and as which
    /// incarnation; a writer lost while it was stopped, and since resumed, lost this worker
    /// too and will not dial it, so being asked whether it is done is its only way back.
    /// New requests are never paired through this ([`lookup`](Self::lookup) is for them).
    fn lookup_including_lost(
        &self,
        engine: &EngineId,
    ) -> DirectoryFuture<Result<Vec<WorkerRecord>, ResolveError>> {
        self.lookup(engine)
    }

    /// Forgets what is cached about `engine` (a peer of it was lost).
    fn invalidate(&self, engine: &EngineId);

    /// `peer` was lost at `incarnation`: besides forgetting its engine's cached answer,
    /// lookups should not hand that incarnation out again.
    fn lost(&self, peer: &RankInfo, incarnation: u64) {
        let _ = incarnation;
        self.invalidate(&peer.engine_id);
    }

    /// `peer`, [`lost`](Self::lost) at `incarnation`, answered a handshake as that very
    /// process: it was paused, not dead, and lookups may hand it out again. True when the
    /// directory had it marked lost.
    fn found(&self, peer: &RankInfo, incarnation: u64) -> bool {
        let _ = (peer, incarnation);
        false
    }

    /// Resolves once the directory holds `rank` for a newer process than this one
    /// (`incarnation`), saying which: new requests no longer find this process, and peers
    /// that know the newer one refuse it, so its open requests cannot end well. `None`
    /// where the directory cannot tell (the default).
    fn superseded(&self, rank: &RankInfo, incarnation: u64) -> Option<DirectoryFuture<String>> {
        let _ = (rank, incarnation);
        None
    }
}

/// A directory with a fixed set of workers: every registration is kept in memory, and
/// lookups answer from it. For static deployments (every address known in advance), and
/// for tests of the transport without a bootstrap server.
#[derive(Default)]
pub struct StaticDirectory {
    workers: Mutex<BTreeMap<EngineId, Vec<WorkerRecord>>>,
}

impl StaticDirectory {
    /// An empty directory.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces, by rank) a worker's record.
    pub fn insert(&self, record: WorkerRecord) {
        let mut workers = self.workers.lock().unwrap_or_else(|e| e.into_inner());
        let list = workers.entry(record.rank.engine_id.clone()).or_default();
        list.retain(|r| r.rank != record.rank);
        list.push(record);
    }
}

impl Directory for StaticDirectory {
    fn register(&self, record: WorkerRecord) -> DirectoryFuture<Result<(), BootstrapError>> {
        self.insert(record);
        Box::pin(async { Ok(()) })
    }

    fn lookup(
        &self,
        engine: &EngineId,
    ) -> DirectoryFuture<Result<Vec<WorkerRecord>, ResolveError>> {
        let workers = self.workers.lock().unwrap_or_else(|e| e.into_inner());
        let answer = match workers.get(engine) {
            None => Err(ResolveError::NotReady {
                detail: format!("no worker of {engine} registered"),
            }),
            Some(list) => {
                let expected = list
                    .first()
                    .map_or(0, |r| r.rank.dp_size * r.rank.tp_size * r.rank.pp_size);
                if list.len() as u32 >= expected {
                    Ok(list.clone())
                } else {
                    Err(ResolveError::NotReady {
                        detail: format!(
                            "{} of {expected} ranks of {engine} registered",
                            list.len()
                        ),
                    })
                }
            }
        };
        Box::pin(async move { answer })
    }

    fn invalidate(&self, _engine: &EngineId) {}
}

/// How long one lookup may keep retrying an unreachable or incomplete bootstrap server
/// before it reports back: an unreachable server fails the waiting requests by name
/// (`BootstrapUnavailable`, with the address and the last error) after this long, and an
/// incomplete engine is asked about again by the request until its bootstrap deadline.
pub const LOOKUP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// How long a registration may keep retrying; [`crate::NetConfig::register_timeout`]
/// bounds it again from outside.
const REGISTER_DEADLINE: std::time::Duration = std::time::Duration::from_secs(300);

/// A directory's answer as a lookup reports it: an engine not (yet) complete is `NotReady`
/// (asked again until the request's deadline); anything else fails the request by name.
fn resolved(
    answer: Result<Vec<WorkerRecord>, BootstrapError>,
) -> Result<Vec<WorkerRecord>, ResolveError> {
    match answer {
        Ok(records) => Ok(records),
        Err(e @ (BootstrapError::NotReady { .. } | BootstrapError::UnknownEngine { .. })) => {
            Err(ResolveError::NotReady {
                detail: e.to_string(),
            })
        }
        Err(e) => Err(ResolveError::Fatal(e.failure_reason())),
    }
}

/// A lookup of `engine` through `query`, bounded by [`LOOKUP_DEADLINE`], answered as a
/// request reads it ([`resolved`]).
fn looked_up<F, Q>(
    engine: &EngineId,
    query: F,
) -> DirectoryFuture<Result<Vec<WorkerRecord>, ResolveError>>
where
    F: FnOnce(EngineId, std::time::Instant) -> Q + Send + 'static,
    Q: std::future::Future<Output = Result<Vec<WorkerRecord>, BootstrapError>> + Send + 'static,
{
    let engine = engine.clone();
    Box::pin(async move {
        let deadline = std::time::Instant::now() + LOOKUP_DEADLINE;
        resolved(query(engine, deadline).await)
    })
}

impl Directory for handoff_bootstrap::BootstrapClient {
    fn register(&self, record: WorkerRecord) -> DirectoryFuture<Result<(), BootstrapError>> {
        let client = self.clone();
        Box::pin(async move {
            let deadline = std::time::Instant::now() + REGISTER_DEADLINE;
            client.register(record, deadline).await
        })
    }

    fn lookup(
        &self,
        engine: &EngineId,
    ) -> DirectoryFuture<Result<Vec<WorkerRecord>, ResolveError>> {
        let client = self.clone();
        looked_up(engine, move |engine, deadline| async move {
            client.query(&engine, deadline).await
        })
    }

    fn lookup_including_lost(
        &self,
        engine: &EngineId,
    ) -> DirectoryFuture<Result<Vec<WorkerRecord>, ResolveError>> {
        let client = self.clone();
        looked_up(engine, move |engine, deadline| async move {
            client.query_including_lost(&engine, deadline).await
        })
    }

    fn invalidate(&self, engine: &EngineId) {
        handoff_bootstrap::BootstrapClient::invalidate(self, engine);
    }

    fn lost(&self, peer: &RankInfo, incarnation: u64) {
        self.mark_lost(peer, incarnation);
    }

    fn found(&self, peer: &RankInfo, incarnation: u64) -> bool {
        self.mark_found(peer, incarnation)
    }

    fn superseded(&self, rank: &RankInfo, incarnation: u64) -> Option<DirectoryFuture<String>> {
        let holder = handoff_bootstrap::BootstrapClient::superseded(self, rank, incarnation);
        Some(held_by(self.address().to_string(), holder, incarnation))
    }
}

/// What [`Directory::superseded`] says once `holder` resolves: who holds the rank now, and
/// which directory (`address`) says so.
fn held_by(
    address: String,
    holder: impl Future<Output = WorkerRecord> + Send + 'static,
    incarnation: u64,
) -> DirectoryFuture<String> {
    Box::pin(async move {
        let holder = holder.await;
        format!(
            "{address} holds rank {} for incarnation {} (at {}) now, not this process's {incarnation}",
            holder.rank, holder.incarnation, holder.control_address
        )
    })
}

impl Directory for handoff_bootstrap::EtcdDirectory {
    fn register(&self, record: WorkerRecord) -> DirectoryFuture<Result<(), BootstrapError>> {
        let dir = self.clone();
        Box::pin(async move {
            let deadline = std::time::Instant::now() + REGISTER_DEADLINE;
            dir.register(record, deadline).await
        })
    }

    fn lookup(
        &self,
        engine: &EngineId,
    ) -> DirectoryFuture<Result<Vec<WorkerRecord>, ResolveError>> {
        let dir = self.clone();
        looked_up(engine, move |engine, deadline| async move {
            dir.query(&engine, deadline).await
        })
    }

    fn lookup_including_lost(
        &self,
        engine: &EngineId,
    ) -> DirectoryFuture<Result<Vec<WorkerRecord>, ResolveError>> {
        let dir = self.clone();
        looked_up(engine, move |engine, deadline| async move {
            dir.query_including_lost(&engine, deadline).await
        })
    }

    fn invalidate(&self, engine: &EngineId) {
        handoff_bootstrap::EtcdDirectory::invalidate(self, engine);
    }

    fn lost(&self, peer: &RankInfo, incarnation: u64) {
        self.mark_lost(peer, incarnation);
    }

    fn found(&self, peer: &RankInfo, incarnation: u64) -> bool {
        self.mark_found(peer, incarnation)
    }

    fn superseded(&self, rank: &RankInfo, incarnation: u64) -> Option<DirectoryFuture<String>> {
        let holder = handoff_bootstrap::EtcdDirectory::superseded(self, rank, incarnation);
        Some(held_by(self.address(), holder, incarnation))
    }
}
