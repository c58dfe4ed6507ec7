//! [`BootstrapClient`]: registers a worker, keeps it registered, and resolves engines, each
//! call under the caller's deadline.
//!
//! One *driver* task owns the connection (a [`Dealer`]) and runs one exchange at a time, so
//! a reply always answers the request just sent; it is spawned on first use and ends when the
//! last clone of the client is dropped. Each exchange is bounded by the smaller of the
//! caller's deadline and [`ClientConfig::attempt_timeout`]; a connection that fails or stays
//! silent that long is dropped and the next exchange reconnects. Callers retry transient
//! failures (refused, timed out, disconnected) and `NotReady` answers with capped exponential
//! backoff until their deadline, then fail with a named [`BootstrapError`].
//!
//! Between calls the driver keeps registrations alive: every
//! [`ClientConfig::heartbeat_interval`] it sends a `Heartbeat` (reconnecting first if
//! needed), and on every new connection it registers again every record it holds, since the
//! server may have expired them or restarted. A record that meets a newer process of its
//! rank there is dropped and told to [`BootstrapClient::superseded`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use handoff_transport::auth::Key;
use handoff_transport::wire::{
    self, Heartbeat, Message, Query, QueryAnswer, StatusReply, StatusRequest, Unregister,
    WorkerRecord,
};
use handoff_transport::zmtp::{Dealer, ZmtpError};
use handoff_transport::{EngineId, Rank, RankInfo};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};

use super::{
    BootstrapError, ATTEMPT_TIMEOUT_DEFAULT, BACKOFF_MAX, BACKOFF_MIN, CACHED_ENGINES_MAX,
    CLIENT_CALLS_QUEUED_MAX, CLIENT_REGISTRATIONS_MAX, EXPIRE_AFTER_DEFAULT,
    HEARTBEAT_INTERVAL_DEFAULT,
};

/// The ZMTP identity the client announces (servers route by connection, not identity).
const IDENTITY: &[u8] = b"handoff-bootstrap-client";

/// How a [`BootstrapClient`] paces itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientConfig {
    /// How often a registered worker tells the server it lives. Default
    /// [`HEARTBEAT_INTERVAL_DEFAULT`]; keep the server's `expire_after` at about three of
    /// these, so one lost heartbeat does not expire a live worker.
    pub heartbeat_interval: Duration,
    /// Longest one exchange (connect, send, answer) may take before the connection is
    /// presumed dead. Default [`ATTEMPT_TIMEOUT_DEFAULT`].
    pub attempt_timeout: Duration,
    /// First pause between retries; doubled after each, up to `backoff_max`.
    pub backoff_min: Duration,
    /// Longest pause between retries.
    pub backoff_max: Duration,
    /// How long a worker this client was told it lost is refused to new lookups
    /// ([`BootstrapClient::mark_lost`]), unless its process answers a handshake again first
    /// ([`BootstrapClient::mark_found`]). Default [`LOST_KEPT_DEFAULT`]: longer than the
    /// server keeps a dead worker's record, so a record still there at that incarnation
    /// afterwards is one its process kept alive (a pause, not a death).
    pub lost_kept: Duration,
}

/// [`ClientConfig::lost_kept`]'s default: twice the server's default `expire_after`, which
/// removes a dead worker's record within `expire_after` and a quarter of it (its sweep).
pub const LOST_KEPT_DEFAULT: Duration = Duration::from_secs(2 * EXPIRE_AFTER_DEFAULT.as_secs());

impl Default for ClientConfig {
    fn default() -> ClientConfig {
        ClientConfig {
            heartbeat_interval: HEARTBEAT_INTERVAL_DEFAULT,
            attempt_timeout: ATTEMPT_TIMEOUT_DEFAULT,
            backoff_min: BACKOFF_MIN,
            backoff_max: BACKOFF_MAX,
            lost_kept: LOST_KEPT_DEFAULT,
        }
    }
}

/// A connection to one bootstrap server, shared by a worker's tasks. Cheap to clone.
///
/// Built once at worker startup ([`BootstrapClient::new`] never fails and connects lazily).
/// A prefill or decode worker calls [`register`](BootstrapClient::register) once, which
/// also starts the heartbeats; a decode worker calls [`query`](BootstrapClient::query) for
/// each prefill engine it meets (answers are cached) and
/// [`invalidate`](BootstrapClient::invalidate) when it loses a peer of that engine; a
/// worker shutting down cleanly calls [`unregister`](BootstrapClient::unregister).
#[derive(Clone)]
pub struct BootstrapClient {
    inner: Arc<Inner>,
}

struct Inner {
    address: String,
    key: Option<Key>,
    cfg: ClientConfig,
    cache: Mutex<BTreeMap<EngineId, Vec<WorkerRecord>>>,
    /// Ranks lost at an incarnation: the server may still hold their records until they
    /// expire, and a lookup must not hand a dead worker out again: it fails by name until
    /// the rank registers anew, its process answers a handshake, or the mark expires.
    lost: LostRanks,
    driver: Mutex<Option<DriverHandle>>,
    /// Registrations the server now holds for a newer process of their rank (what
    /// [`BootstrapClient::superseded`] waits on).
    superseded: SupersededBoard,
}

/// A registration this client kept alive that the server holds for a newer process of the
/// same rank now: heard as the `RegisterConflict` answering the client's registration
/// again after a reconnect (the server closes a replaced record's connection, and a silent
/// one's, so a replaced process that runs on hears it within a heartbeat or two).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superseded {
    /// Our record, as it was kept.
    pub ours: WorkerRecord,
    /// The record the server holds for the rank instead.
    pub holder: WorkerRecord,
}

impl Superseded {
    /// Whether `holder` is a newer process of `ours`'s rank (anything else holding it is a
    /// conflict, not a successor).
    pub(crate) fn succeeds(ours: &WorkerRecord, holder: &WorkerRecord) -> bool {
        holder.rank == ours.rank && holder.incarnation > ours.incarnation
    }

    fn of(&self, rank: &RankInfo, incarnation: u64) -> bool {
        self.ours.rank == *rank && self.ours.incarnation == incarnation
    }
}

/// Registrations lost to a newer process of their rank, at most
/// [`CLIENT_REGISTRATIONS_MAX`] (the oldest forgotten first): told by a directory's
/// keep-alive, waited on by its callers. Cheap to clone.
#[derive(Clone)]
pub(crate) struct SupersededBoard(Arc<watch::Sender<Vec<Superseded>>>);

impl SupersededBoard {
    pub(crate) fn new() -> SupersededBoard {
        SupersededBoard(Arc::new(watch::Sender::new(Vec::new())))
    }

    /// `holder` holds the rank of our record `ours` now: told, and true, if it is that
    /// rank at a newer incarnation (anything else is a conflict, not a successor).
    pub(crate) fn tell(&self, ours: &WorkerRecord, holder: &WorkerRecord) -> bool {
        if !Superseded::succeeds(ours, holder) {
            return false;
        }
        let lost = Superseded {
            ours: ours.clone(),
            holder: holder.clone(),
        };
        self.0.send_modify(|all| {
            if all.len() >= CLIENT_REGISTRATIONS_MAX {
                all.remove(0);
            }
            all.push(lost);
        });
        true
    }

    /// Resolves with the holder once our `rank` at `incarnation` is told superseded;
    /// pending until then (forever, if never).
    pub(crate) fn wait(
        &self,
        rank: &RankInfo,
        incarnation: u64,
    ) -> impl std::future::Future<Output = WorkerRecord> + Send + 'static {
        let mut rx = self.0.subscribe();
        let rank = rank.clone();
        async move {
            loop {
                let found = rx
                    .borrow_and_update()
                    .iter()
                    .find(|s| s.of(&rank, incarnation))
                    .map(|s| s.holder.clone());
                if let Some(holder) = found {
                    return holder;
                }
                if rx.changed().await.is_err() {
                    // Everything that could tell is gone.
                    std::future::pending::<()>().await;
                }
            }
        }
    }
}

/// Lost incarnations remembered per client: more than the ranks of the engines one worker
/// talks to, so a restart is never forgotten before the server expires the old record.
pub const LOST_INCARNATIONS_MAX: usize = 1024;

/// Whether a lookup hands out workers the directory was told it lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lost {
    /// A lost worker fails the answer ([`BootstrapError::Lost`]): a new request must not be
    /// paired with it.
    Refused,
    /// Lost workers are answered as the directory holds them: to dial a known peer, whose
    /// handshake tells whether it answers.
    Included,
}

/// Ranks lost at an incarnation, oldest first, at most [`LOST_INCARNATIONS_MAX`]: what a
/// directory (the bootstrap server's client, or etcd's) must not hand out again, for as long
/// as a dead worker's record can outlive it there (`keep`: past that, a record still held
/// at that incarnation was kept alive by its process since the loss, which must then have
/// been a pause, not a death), or until that very process answers a handshake again
/// ([`found`](Self::found)). Plain data: every call is told the time, so the simulator
/// keeps one per worker in virtual time, as the clients keep theirs in real time.
pub struct LostRanks {
    marks: Mutex<std::collections::VecDeque<LostMark>>,
    keep: Duration,
}

struct LostMark {
    rank: RankInfo,
    incarnation: u64,
    at: Instant,
}

impl LostMark {
    fn of(&self, rank: &RankInfo, incarnation: u64) -> bool {
        self.rank == *rank && self.incarnation == incarnation
    }
}

impl LostRanks {
    /// No rank lost yet; each mark is kept for `keep`.
    pub fn new(keep: Duration) -> LostRanks {
        LostRanks {
            marks: Mutex::new(std::collections::VecDeque::new()),
            keep,
        }
    }

    /// The marks still kept at `now`, expired ones forgotten (they are in the order they
    /// were set).
    fn current(
        &self,
        now: Instant,
    ) -> std::sync::MutexGuard<'_, std::collections::VecDeque<LostMark>> {
        let mut marks = lock(&self.marks);
        while marks
            .front()
            .is_some_and(|m| now.saturating_duration_since(m.at) >= self.keep)
        {
            marks.pop_front();
        }
        marks
    }

    /// Remembers `rank` lost at `incarnation`, from `now` (the oldest is forgotten at the
    /// bound).
    pub fn insert(&self, rank: &RankInfo, incarnation: u64, now: Instant) {
        let mut marks = self.current(now);
        marks.retain(|m| !m.of(rank, incarnation));
        if marks.len() >= LOST_INCARNATIONS_MAX {
            marks.pop_front();
        }
        marks.push_back(LostMark {
            rank: rank.clone(),
            incarnation,
            at: now,
        });
    }

    /// The process of `rank` at `incarnation` answered a handshake: it lives, and may be
    /// handed out again. True when it was marked lost (at `now`, unexpired).
    pub fn found(&self, rank: &RankInfo, incarnation: u64, now: Instant) -> bool {
        let mut marks = self.current(now);
        let before = marks.len();
        marks.retain(|m| !m.of(rank, incarnation));
        marks.len() != before
    }

    /// [`BootstrapError::Lost`] for the first of `workers` marked lost at `now`: what it
    /// held is gone with it (`address`: the directory's, for the error).
    ///
    /// # Errors
    /// [`BootstrapError::Lost`].
    pub fn check(
        &self,
        address: &str,
        workers: &[WorkerRecord],
        now: Instant,
    ) -> Result<(), BootstrapError> {
        let marks = self.current(now);
        match workers
            .iter()
            .find(|w| marks.iter().any(|m| m.of(&w.rank, w.incarnation)))
        {
            Some(dead) => Err(BootstrapError::Lost {
                address: address.to_string(),
                rank: dead.rank.clone(),
                incarnation: dead.incarnation,
            }),
            None => Ok(()),
        }
    }
}

struct DriverHandle {
    calls: mpsc::Sender<Call>,
    task: JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(d) = lock(&self.driver).take() {
            d.task.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One exchange asked of the driver.
struct Call {
    msg: Message,
    deadline: tokio::time::Instant,
    reply: oneshot::Sender<Result<Message, AttemptError>>,
}

/// Why one exchange failed.
#[derive(Debug)]
enum AttemptError {
    /// Worth retrying: refused, timed out, disconnected.
    Transient(String),
    /// Not worth retrying: the same request would fail the same way.
    Final(BootstrapError),
}

/// What a caller makes of one answer.
enum Judged<T> {
    Done(T),
    NotReady {
        registered: Vec<Rank>,
        expected: u32,
    },
    Unknown,
    Fail(BootstrapError),
}

/// The last thing seen before the deadline: what the final error says.
enum Last {
    Nothing,
    Error(String),
    NotReady {
        registered: Vec<Rank>,
        expected: u32,
    },
    Unknown,
}

impl BootstrapClient {
    /// A client for the server at `addr` (`tcp://HOST:PORT`), signing with `key` if given.
    /// Connects on first use; a bad address is reported by the first call.
    pub fn new(addr: &str, key: Option<Key>, cfg: ClientConfig) -> BootstrapClient {
        BootstrapClient {
            inner: Arc::new(Inner {
                address: addr.to_string(),
                key,
                cfg,
                cache: Mutex::new(BTreeMap::new()),
                lost: LostRanks::new(cfg.lost_kept),
                driver: Mutex::new(None),
                superseded: SupersededBoard::new(),
            }),
        }
    }

    /// The server's address, as given.
    pub fn address(&self) -> &str {
        &self.inner.address
    }

    /// Registers `record`, retrying transient failures until `deadline`, then keeps it
    /// registered (heartbeats; registering again after a reconnect) until
    /// [`unregister`](BootstrapClient::unregister) or the client is dropped.
    ///
    /// A conflicting record is [`BootstrapError::Conflict`] at once, never retried; a server
    /// that stays unreachable is [`BootstrapError::Unavailable`] at the deadline.
    pub async fn register(
        &self,
        record: WorkerRecord,
        deadline: Instant,
    ) -> Result<(), BootstrapError> {
        let address = self.inner.address.clone();
        self.retry(Message::Register(record), deadline, |reply| match reply {
            Message::RegisterOk(_) => Judged::Done(()),
            Message::RegisterConflict(c) => Judged::Fail(BootstrapError::Conflict {
                address: address.clone(),
                existing: Box::new(c.existing),
            }),
            other => Judged::Fail(unexpected(&address, &other)),
        })
        .await
    }

    /// Resolves once the server holds `rank` for a newer process than our `incarnation`
    /// (that process's record): this process is no longer found by new requests, and its
    /// peers refuse it. Pending for as long as that does not happen (a client with no such
    /// registration waits forever: race it against the caller's own end).
    pub fn superseded(
        &self,
        rank: &RankInfo,
        incarnation: u64,
    ) -> impl std::future::Future<Output = WorkerRecord> + Send + 'static {
        self.inner.superseded.wait(rank, incarnation)
    }

    /// Every worker of `engine`, once all its ranks have registered: from the cache if
    /// present, else asked of the server, retrying transient failures, `NotReady` and
    /// `UnknownEngine` (prefill and decode start concurrently) until `deadline`. A worker
    /// this client was told it lost ([`mark_lost`](Self::mark_lost)) fails the answer with
    /// [`BootstrapError::Lost`].
    pub async fn query(
        &self,
        engine: &EngineId,
        deadline: Instant,
    ) -> Result<Vec<WorkerRecord>, BootstrapError> {
        self.query_with(engine, deadline, Lost::Refused).await
    }

    /// [`query`](Self::query), with workers this client lost included: for dialing a peer
    /// already known, not for pairing a new request. The dial's handshake says whether that
    /// process answers, and as which incarnation; a writer that was lost while stopped and
    /// then resumed can only be asked whether it is done this way (it lost us too, and
    /// would not dial us). Not cached.
    pub async fn query_including_lost(
        &self,
        engine: &EngineId,
        deadline: Instant,
    ) -> Result<Vec<WorkerRecord>, BootstrapError> {
        self.query_with(engine, deadline, Lost::Included).await
    }

    async fn query_with(
        &self,
        engine: &EngineId,
        deadline: Instant,
        lost: Lost,
    ) -> Result<Vec<WorkerRecord>, BootstrapError> {
        // The cache holds only answers that passed the lost check (a loss drops its
        // engine's), so either kind of query may take them.
        if let Some(workers) = self.cached(engine) {
            return Ok(workers);
        }
        let address = self.inner.address.clone();
        let msg = Message::Query(Query {
            engine_id: engine.clone(),
        });
        let workers = self
            .retry(msg, deadline, |reply| match reply {
                Message::QueryReply(r) => match r.answer {
                    QueryAnswer::Ready { workers } => match lost {
                        Lost::Included => Judged::Done(workers),
                        Lost::Refused => {
                            match self.inner.lost.check(&address, &workers, Instant::now()) {
                                Err(dead) => Judged::Fail(dead),
                                Ok(()) => Judged::Done(workers),
                            }
                        }
                    },
                    QueryAnswer::NotReady {
                        registered,
                        expected,
                    } => Judged::NotReady {
                        registered,
                        expected,
                    },
                    QueryAnswer::UnknownEngine => Judged::Unknown,
                },
                other => Judged::Fail(unexpected(&address, &other)),
            })
            .await
            .map_err(|e| match e {
                BootstrapError::UnknownEngine { address, .. } => BootstrapError::UnknownEngine {
                    address,
                    engine: engine.clone(),
                },
                BootstrapError::NotReady {
                    address,
                    registered,
                    expected,
                    ..
                } => BootstrapError::NotReady {
                    address,
                    engine: engine.clone(),
                    registered,
                    expected,
                },
                other => other,
            })?;
        if lost == Lost::Refused {
            let mut cache = lock(&self.inner.cache);
            if cache.len() >= CACHED_ENGINES_MAX && !cache.contains_key(engine) {
                cache.pop_first();
            }
            cache.insert(engine.clone(), workers.clone());
        }
        Ok(workers)
    }

    /// The cached answer for `engine`, if any.
    pub fn cached(&self, engine: &EngineId) -> Option<Vec<WorkerRecord>> {
        lock(&self.inner.cache).get(engine).cloned()
    }

    /// Forgets the cached answer for `engine` (a peer of it was lost: it may have restarted
    /// elsewhere), so the next [`query`](BootstrapClient::query) asks the server.
    pub fn invalidate(&self, engine: &EngineId) {
        lock(&self.inner.cache).remove(engine);
    }

    /// Remembers that `rank` was lost at `incarnation` and forgets its engine's cached
    /// answer: until the rank registers again with a new incarnation, its process answers a
    /// handshake again ([`mark_found`](Self::mark_found)) or [`ClientConfig::lost_kept`]
    /// passes, lookups of its engine fail with [`BootstrapError::Lost`] rather than hand
    /// the dead worker out again.
    pub fn mark_lost(&self, rank: &RankInfo, incarnation: u64) {
        self.inner.lost.insert(rank, incarnation, Instant::now());
        self.invalidate(&rank.engine_id);
    }

    /// The process of `rank` at `incarnation`, lost before, answered a handshake: lookups
    /// hand it out again. True when it was marked lost.
    pub fn mark_found(&self, rank: &RankInfo, incarnation: u64) -> bool {
        self.inner.lost.found(rank, incarnation, Instant::now())
    }

    /// Everything the server holds, retrying transient failures until `deadline`.
    pub async fn status(&self, deadline: Instant) -> Result<StatusReply, BootstrapError> {
        let address = self.inner.address.clone();
        self.retry(
            Message::StatusRequest(StatusRequest),
            deadline,
            |reply| match reply {
                Message::StatusReply(s) => Judged::Done(s),
                other => Judged::Fail(unexpected(&address, &other)),
            },
        )
        .await
    }

    /// Removes this worker's record (only if the server holds this `incarnation`) and stops
    /// its heartbeats. Returns whether the server removed a record.
    pub async fn unregister(
        &self,
        rank: &RankInfo,
        incarnation: u64,
        deadline: Instant,
    ) -> Result<bool, BootstrapError> {
        let address = self.inner.address.clone();
        let msg = Message::Unregister(Unregister {
            rank: rank.clone(),
            incarnation,
        });
        self.retry(msg, deadline, |reply| match reply {
            Message::Unregistered(u) => Judged::Done(u.removed),
            other => Judged::Fail(unexpected(&address, &other)),
        })
        .await
    }

    /// Sends `msg` until `judge` accepts an answer, fails, or `deadline` passes.
    async fn retry<T>(
        &self,
        msg: Message,
        deadline: Instant,
        mut judge: impl FnMut(Message) -> Judged<T>,
    ) -> Result<T, BootstrapError> {
        let deadline = tokio::time::Instant::from_std(deadline);
        let cfg = self.inner.cfg;
        let mut backoff = cfg.backoff_min.max(Duration::from_millis(1));
        let mut last = Last::Nothing;
        while tokio::time::Instant::now() < deadline {
            match self.exchange(msg.clone(), deadline).await {
                Ok(reply) => match judge(reply) {
                    Judged::Done(v) => return Ok(v),
                    Judged::Fail(e) => return Err(e),
                    Judged::NotReady {
                        registered,
                        expected,
                    } => {
                        last = Last::NotReady {
                            registered,
                            expected,
                        }
                    }
                    Judged::Unknown => last = Last::Unknown,
                },
                Err(AttemptError::Final(e)) => return Err(e),
                Err(AttemptError::Transient(e)) => {
                    debug!(address = %self.inner.address, error = %e, "bootstrap attempt failed; retrying");
                    last = Last::Error(e);
                }
            }
            let wake = (tokio::time::Instant::now() + backoff).min(deadline);
            tokio::time::sleep_until(wake).await;
            backoff = (backoff * 2).min(cfg.backoff_max.max(backoff));
        }
        Err(self.deadline_error(msg, last))
    }

    fn deadline_error(&self, msg: Message, last: Last) -> BootstrapError {
        let address = self.inner.address.clone();
        let engine = match msg {
            Message::Query(q) => q.engine_id,
            _ => EngineId::new("-"),
        };
        match last {
            Last::Nothing => BootstrapError::Unavailable {
                address,
                last_error: "the deadline passed before any attempt could finish".into(),
            },
            Last::Error(last_error) => BootstrapError::Unavailable {
                address,
                last_error,
            },
            Last::NotReady {
                registered,
                expected,
            } => BootstrapError::NotReady {
                address,
                engine,
                registered,
                expected,
            },
            Last::Unknown => BootstrapError::UnknownEngine { address, engine },
        }
    }

    /// One exchange through the driver, waiting at most until `deadline`.
    async fn exchange(
        &self,
        msg: Message,
        deadline: tokio::time::Instant,
    ) -> Result<Message, AttemptError> {
        let calls = self.driver();
        let (reply, answer) = oneshot::channel();
        let call = Call {
            msg,
            deadline,
            reply,
        };
        let gone = || AttemptError::Transient("the client's driver task ended".into());
        match tokio::time::timeout_at(deadline, calls.send(call)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(gone()),
            Err(_) => {
                return Err(AttemptError::Transient(
                    "the client is busy: no exchange could start before the deadline".into(),
                ))
            }
        }
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(gone()),
            Err(_) => Err(AttemptError::Transient(
                "no answer before the deadline".into(),
            )),
        }
    }

    /// The driver's queue, spawning the driver on first use (or again, if it ended).
    fn driver(&self) -> mpsc::Sender<Call> {
        let mut slot = lock(&self.inner.driver);
        if let Some(d) = slot.as_ref().filter(|d| !d.task.is_finished()) {
            return d.calls.clone();
        }
        let (calls, rx) = mpsc::channel(CLIENT_CALLS_QUEUED_MAX);
        let driver = Driver {
            address: self.inner.address.clone(),
            key: self.inner.key.clone(),
            cfg: self.inner.cfg,
            dealer: None,
            kept: BTreeMap::new(),
            seq: 0,
            superseded: self.inner.superseded.clone(),
        };
        let task = tokio::spawn(driver.run(rx));
        *slot = Some(DriverHandle {
            calls: calls.clone(),
            task,
        });
        calls
    }
}

fn unexpected(address: &str, reply: &Message) -> BootstrapError {
    BootstrapError::BadReply {
        address: address.to_string(),
        detail: format!("unexpected {}", reply.message_type()),
    }
}

/// The task that owns the connection; see the module docs.
struct Driver {
    address: String,
    key: Option<Key>,
    cfg: ClientConfig,
    dealer: Option<Dealer>,
    /// Registrations to keep alive, by engine and rank; at most [`CLIENT_REGISTRATIONS_MAX`].
    kept: BTreeMap<(EngineId, Rank), WorkerRecord>,
    /// Heartbeat sequence number on the current connection.
    seq: u64,
    /// Where a registration lost to a newer process is told ([`Inner::superseded`]).
    superseded: SupersededBoard,
}

impl Driver {
    async fn run(mut self, mut calls: mpsc::Receiver<Call>) {
        let interval = self.cfg.heartbeat_interval.max(Duration::from_millis(1));
        let mut next_beat = tokio::time::Instant::now() + interval;
        loop {
            if self.kept.is_empty() {
                next_beat = tokio::time::Instant::now() + interval;
            }
            tokio::select! {
                call = calls.recv() => match call {
                    Some(call) => self.serve(call).await,
                    None => return,
                },
                () = tokio::time::sleep_until(next_beat), if !self.kept.is_empty() => {
                    self.keepalive().await;
                    next_beat = tokio::time::Instant::now() + interval;
                }
            }
        }
    }

    /// The configured attempt timeout; at least a millisecond, so an attempt can happen.
    fn attempt_timeout(&self) -> Duration {
        self.cfg.attempt_timeout.max(Duration::from_millis(1))
    }

    async fn serve(&mut self, call: Call) {
        if call.reply.is_closed() {
            return; // the caller gave up
        }
        let deadline = call
            .deadline
            .min(tokio::time::Instant::now() + self.attempt_timeout());
        let result = self.prepare(&call.msg);
        let result = match result {
            Ok(()) => self.attempt(&call.msg, deadline).await,
            Err(e) => Err(e),
        };
        if let (Message::Register(record), Ok(Message::RegisterOk(_))) = (&call.msg, &result) {
            let key = (record.rank.engine_id.clone(), record.rank.rank());
            self.kept.insert(key, record.clone());
        }
        let _ = call.reply.send(result);
    }

    /// Bookkeeping before an exchange: an unregister stops heartbeats for that record even
    /// if the server cannot be told; a registration past the bound is refused here.
    fn prepare(&mut self, msg: &Message) -> Result<(), AttemptError> {
        match msg {
            Message::Unregister(u) => {
                let key = (u.rank.engine_id.clone(), u.rank.rank());
                if self
                    .kept
                    .get(&key)
                    .is_some_and(|r| r.incarnation == u.incarnation)
                {
                    self.kept.remove(&key);
                }
                Ok(())
            }
            Message::Register(r) => {
                let key = (r.rank.engine_id.clone(), r.rank.rank());
                if self.kept.len() >= CLIENT_REGISTRATIONS_MAX && !self.kept.contains_key(&key) {
                    return Err(AttemptError::Final(BootstrapError::Invalid {
                        detail: format!(
                            "one client keeps at most {CLIENT_REGISTRATIONS_MAX} registrations alive"
                        ),
                    }));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Connects if needed, then one exchange; a transient failure drops the connection.
    async fn attempt(
        &mut self,
        msg: &Message,
        deadline: tokio::time::Instant,
    ) -> Result<Message, AttemptError> {
        let result = match self.connect(deadline).await {
            Ok(()) => self.exchange(msg, deadline).await,
            Err(e) => Err(e),
        };
        if result.is_err() {
            self.dealer = None;
        }
        result
    }

    async fn keepalive(&mut self) {
        let deadline = tokio::time::Instant::now() + self.attempt_timeout();
        let incarnation = self.kept.values().next().map_or(0, |r| r.incarnation);
        let beat = Message::Heartbeat(Heartbeat {
            incarnation,
            seq: self.seq,
            echo: 0,
            lease_ms: 0,
        });
        self.seq = self.seq.wrapping_add(1);
        if let Err(e) = self.attempt(&beat, deadline).await {
            warn!(address = %self.address, error = ?e, "bootstrap heartbeat failed; will reconnect and register again");
        }
    }

    /// Opens a connection if there is none, and registers again every kept record on it.
    async fn connect(&mut self, deadline: tokio::time::Instant) -> Result<(), AttemptError> {
        if self.dealer.as_ref().is_some_and(|d| !d.is_closed()) {
            return Ok(());
        }
        self.dealer = None;
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        if remaining.is_zero() {
            return Err(AttemptError::Transient("no time left to connect".into()));
        }
        let dealer = Dealer::connect_with(&self.address, IDENTITY, remaining, self.key.clone())
            .await
            .map_err(|e| match e {
                ZmtpError::BadAddress(_) => AttemptError::Final(BootstrapError::Invalid {
                    detail: format!("bootstrap address: {e}"),
                }),
                // Another secret than the server's: the same handshake fails again.
                ZmtpError::Noise(_) => AttemptError::Final(BootstrapError::Refused {
                    address: self.address.clone(),
                    detail: e.to_string(),
                }),
                other => AttemptError::Transient(format!("connect: {other}")),
            })?;
        self.dealer = Some(dealer);
        self.seq = 0;
        self.register_kept(deadline).await
    }

    async fn register_kept(&mut self, deadline: tokio::time::Instant) -> Result<(), AttemptError> {
        let records: Vec<WorkerRecord> = self.kept.values().cloned().collect();
        for record in records {
            let rank = record.rank.clone();
            match self
                .exchange(&Message::Register(record.clone()), deadline)
                .await?
            {
                Message::RegisterOk(_) => {
                    info!(address = %self.address, %rank, "registered again after reconnecting");
                }
                Message::RegisterConflict(c) => {
                    error!(
                        address = %self.address, %rank,
                        existing_incarnation = c.existing.incarnation,
                        existing_control = %c.existing.control_address,
                        "registration lost: the server now holds a conflicting record; heartbeats for it stop"
                    );
                    self.kept.remove(&(rank.engine_id.clone(), rank.rank()));
                    self.superseded.tell(&record, &c.existing);
                }
                other => {
                    return Err(AttemptError::Final(unexpected(&self.address, &other)));
                }
            }
        }
        Ok(())
    }

    /// Sends `msg` and waits for its answer until `deadline`.
    async fn exchange(
        &mut self,
        msg: &Message,
        deadline: tokio::time::Instant,
    ) -> Result<Message, AttemptError> {
        let address = self.address.clone();
        let frame = wire::encode(msg, self.key.as_ref()).map_err(|e| {
            AttemptError::Final(BootstrapError::invalid_message(
                msg.message_type().name(),
                e,
            ))
        })?;
        let dealer = self
            .dealer
            .as_mut()
            .ok_or_else(|| AttemptError::Transient("not connected".into()))?;
        dealer
            .send(vec![frame])
            .map_err(|e| AttemptError::Transient(format!("send: {e}")))?;
        let frames = match tokio::time::timeout_at(deadline, dealer.recv()).await {
            Ok(Some(frames)) => frames,
            Ok(None) => return Err(AttemptError::Transient("connection closed".into())),
            Err(_) => return Err(AttemptError::Transient("no answer in time".into())),
        };
        let bad = |detail: String| {
            AttemptError::Final(BootstrapError::BadReply {
                address: address.clone(),
                detail,
            })
        };
        let [frame] = <[Vec<u8>; 1]>::try_from(frames)
            .map_err(|f| bad(format!("{} frames in one answer, expected 1", f.len())))?;
        let reply = match wire::decode(&frame, self.key.as_ref()) {
            Ok(reply) => reply,
            // A server refusing input it could not authenticate answers unsigned (it never
            // signs text chosen by an unauthenticated peer): read that refusal to name it.
            Err(e @ wire::WireError::AuthMissing) => match wire::decode(&frame, None) {
                Ok(Message::ProtocolError(p)) => Message::ProtocolError(p),
                _ => return Err(bad(e.with_peer(&address).to_string())),
            },
            Err(e) => return Err(bad(e.with_peer(&address).to_string())),
        };
        if let Message::ProtocolError(p) = reply {
            return Err(AttemptError::Final(BootstrapError::Refused {
                address,
                detail: p.detail,
            }));
        }
        if !answers(msg, &reply) {
            return Err(bad(format!(
                "{} is not an answer to {}",
                reply.message_type(),
                msg.message_type()
            )));
        }
        Ok(reply)
    }
}

/// Whether `reply` answers `request` (echoed fields match where the protocol echoes them).
fn answers(request: &Message, reply: &Message) -> bool {
    match (request, reply) {
        (Message::Register(r), Message::RegisterOk(ok)) => {
            ok.rank == r.rank && ok.incarnation == r.incarnation
        }
        (Message::Register(_), Message::RegisterConflict(_)) => true,
        (Message::Query(q), Message::QueryReply(a)) => a.engine_id == q.engine_id,
        (Message::StatusRequest(_), Message::StatusReply(_)) => true,
        (Message::Unregister(_), Message::Unregistered(_)) => true,
        (Message::Heartbeat(h), Message::Heartbeat(pong)) => pong.seq == h.seq,
        (Message::Hello(_), Message::HelloAck(_)) => true,
        _ => false,
    }
}
