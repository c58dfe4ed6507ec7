//! The bootstrap server: a ractor actor that owns the [`Registry`] and answers workers over
//! a [`Router`].
//!
//! [`serve`] binds the router and spawns the (unnamed) server actor. The actor's `pre_start`
//! starts two tasks it owns: a *pump* that holds the router, hands each router event to the
//! actor and performs the replies and disconnects the actor queues for it (the router's
//! `recv` needs `&mut`, so one task holds it), and a sweep timer. Both end in `post_stop`,
//! which drops the router and with it every connection.
//!
//! Per message the actor decodes exactly one wire frame (with the shared key, if one is
//! configured), answers it, and refuses anything else with a [`ProtocolError`] (bounded
//! text) followed by closing that one connection; every refusal is logged with the peer's
//! address. A connection may open with `Hello` (answered `HelloAck`) or go straight to its
//! requests: the frame header's version is checked on every frame anyway, so a peer on
//! another protocol version is refused by name either way.
//!
//! Liveness: any valid message on a connection (heartbeats, in practice) refreshes the
//! records registered over it; a sweep every `expire_after / 4` removes records silent for
//! `expire_after`, and closes the connection they registered on if it is still open (its
//! client then reconnects and registers again). A record replaced by a newer incarnation
//! closes the connection the old one came over in the same way: a replaced process still
//! running learns it on registering again (`RegisterConflict`). A disconnect alone removes
//! nothing.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_transport::auth::Key;
use handoff_transport::wire::{
    self, check_hello, Heartbeat, HelloAck, Message, ProtocolError, QueryAnswer, QueryReply,
    RegisterConflict, RegisterOk, StatusReply, Unregistered,
};
use handoff_transport::zmtp::{ConnId, Router, RouterEvent};
use handoff_transport::EngineId;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};

use crate::metrics::BootstrapMetrics;

use super::registry::{Origin, RegisterOutcome, Registry};
use super::{
    BootstrapError, EXPIRE_AFTER_DEFAULT, SERVER_CALL_TIMEOUT, SERVER_EVENTS_INFLIGHT_MAX,
    SERVER_OUTBOX_MAX, SWEEP_INTERVAL_MIN,
};

/// How to run a bootstrap server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Where to listen: `tcp://HOST:PORT` (port 0 picks one; see
    /// [`BootstrapServer::local_addr`]).
    pub listen: String,
    /// The shared secret: with one, frames without a valid HMAC are refused.
    pub key: Option<Key>,
    /// How long a registered worker may stay silent before its record is removed. Default
    /// [`EXPIRE_AFTER_DEFAULT`] (three client heartbeat intervals).
    pub expire_after: Duration,
    /// Serve unauthenticated clients on a non-loopback address. Without it, and without
    /// `key`, such an address refuses to start (see [`crate::exposure`]).
    pub insecure: bool,
    /// Where registrations and lookups are counted (default: the server's own; see
    /// [`BootstrapServer::metrics`]).
    pub metrics: Option<Arc<BootstrapMetrics>>,
}

impl ServerConfig {
    /// A configuration listening on `listen`, without a key, with the default expiry.
    pub fn new(listen: impl Into<String>) -> ServerConfig {
        ServerConfig {
            listen: listen.into(),
            key: None,
            expire_after: EXPIRE_AFTER_DEFAULT,
            insecure: false,
            metrics: None,
        }
    }

    /// The same configuration, counting into `metrics` (made by the caller, to read them).
    pub fn with_metrics(mut self, metrics: Arc<BootstrapMetrics>) -> ServerConfig {
        self.metrics = Some(metrics);
        self
    }

    /// The same configuration, serving unauthenticated clients off loopback.
    pub fn with_insecure(mut self, insecure: bool) -> ServerConfig {
        self.insecure = insecure;
        self
    }

    /// The same configuration with a shared key.
    pub fn with_key(mut self, key: Key) -> ServerConfig {
        self.key = Some(key);
        self
    }

    /// The same configuration with another expiry.
    pub fn with_expire_after(mut self, expire_after: Duration) -> ServerConfig {
        self.expire_after = expire_after;
        self
    }

    /// How often the server sweeps for expired records: a quarter of `expire_after`, at
    /// least [`SWEEP_INTERVAL_MIN`].
    pub fn sweep_interval(&self) -> Duration {
        (self.expire_after / 4).max(SWEEP_INTERVAL_MIN)
    }
}

/// Starts a bootstrap server: binds `cfg.listen` and spawns the server actor.
pub async fn serve(cfg: ServerConfig) -> Result<BootstrapServer, BootstrapError> {
    if cfg.expire_after.is_zero() {
        return Err(BootstrapError::Invalid {
            detail: "expire_after must be more than zero".into(),
        });
    }
    crate::exposure::raise_open_files();
    crate::exposure::check_exposure(
        &[("bootstrap listen", cfg.listen.as_str())],
        cfg.key.is_some(),
        cfg.insecure,
    )?;
    let metrics = cfg.metrics.clone().unwrap_or_else(BootstrapMetrics::new);
    let router = Router::bind_with(
        &cfg.listen,
        cfg.key.clone(),
        handoff_transport::wire::unauthenticated_refusal(),
    )
    .await
    .map_err(|e| BootstrapError::Bind {
        address: cfg.listen.clone(),
        detail: e.to_string(),
    })?;
    let local = router.local_addr();
    let incarnation = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let args = ServerArgs {
        router,
        cfg,
        incarnation,
        metrics: metrics.clone(),
    };
    let (actor, join) =
        Actor::spawn(None, ServerActor, args)
            .await
            .map_err(|e| BootstrapError::Actor {
                detail: e.to_string(),
            })?;
    Ok(BootstrapServer {
        actor,
        join: Some(join),
        local,
        metrics,
    })
}

/// A running bootstrap server. Dropping it stops the server (without waiting).
pub struct BootstrapServer {
    actor: ActorRef<ServerMsg>,
    join: Option<JoinHandle<()>>,
    local: SocketAddr,
    metrics: Arc<BootstrapMetrics>,
}

impl BootstrapServer {
    /// What the server counts (registrations and lookups); serve them with
    /// `handoff_transport::exposition::serve_metrics`.
    pub fn metrics(&self) -> &Arc<BootstrapMetrics> {
        &self.metrics
    }

    /// The address the server listens on (with the port chosen, if 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// [`BootstrapServer::local_addr`] as `tcp://IP:PORT`, what clients connect to.
    pub fn address(&self) -> String {
        format!("tcp://{}", self.local)
    }

    /// Every engine and worker the registry holds, asked of the actor directly (tests,
    /// embedding). Bounded by [`SERVER_CALL_TIMEOUT`].
    pub async fn status(&self) -> Result<StatusReply, BootstrapError> {
        self.call(ServerMsg::Status).await
    }

    /// What a `Query` for `engine` would be answered with now.
    pub async fn query(&self, engine: &EngineId) -> Result<QueryAnswer, BootstrapError> {
        let engine = engine.clone();
        self.call(|port| ServerMsg::Query(engine, port)).await
    }

    async fn call<T: Send + 'static>(
        &self,
        build: impl FnOnce(RpcReplyPort<T>) -> ServerMsg,
    ) -> Result<T, BootstrapError> {
        match self.actor.call(build, Some(SERVER_CALL_TIMEOUT)).await {
            Ok(ractor::rpc::CallResult::Success(v)) => Ok(v),
            Ok(ractor::rpc::CallResult::Timeout) => Err(BootstrapError::Actor {
                detail: format!("no answer within {SERVER_CALL_TIMEOUT:?}"),
            }),
            Ok(ractor::rpc::CallResult::SenderError) => Err(BootstrapError::Actor {
                detail: "the server dropped the call".into(),
            }),
            Err(e) => Err(BootstrapError::Actor {
                detail: e.to_string(),
            }),
        }
    }

    /// Waits until the server actor has ended (stopped, or failed). Cancel-safe.
    pub async fn stopped(&mut self) {
        if let Some(join) = self.join.as_mut() {
            let _ = join.await;
            self.join = None;
        }
    }

    /// Stops the server: closes every connection and the listener, and waits for the actor
    /// to end (at most [`SERVER_CALL_TIMEOUT`]). The listening port is released moments
    /// after this returns (the router's accept task ends on its next poll), so a server
    /// restarted in the same process on the same port may have to retry its bind briefly.
    pub async fn stop(mut self) {
        self.actor.stop(Some("stop requested".into()));
        if let Some(join) = self.join.take() {
            if tokio::time::timeout(SERVER_CALL_TIMEOUT, join)
                .await
                .is_err()
            {
                warn!(address = %self.local, "bootstrap server did not stop in time; killing it");
                self.actor.kill();
            }
        }
    }
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        if self.join.is_some() {
            self.actor.stop(Some("handle dropped".into()));
        }
    }
}

/// The server actor: data-free; see the module docs.
struct ServerActor;

/// What [`serve`] hands the actor.
struct ServerArgs {
    router: Router,
    cfg: ServerConfig,
    incarnation: u64,
    metrics: Arc<BootstrapMetrics>,
}

/// The actor's messages.
pub(crate) enum ServerMsg {
    /// A router event, with the permit that bounds events in the mailbox.
    Router(RouterEvent, OwnedSemaphorePermit),
    /// Time to remove silent records.
    Sweep,
    /// The registry's status (for [`BootstrapServer::status`]).
    Status(RpcReplyPort<StatusReply>),
    /// A query answered directly (for [`BootstrapServer::query`]).
    Query(EngineId, RpcReplyPort<QueryAnswer>),
}

/// What the actor asks the pump to do with the router.
enum Outgoing {
    Send(ConnId, Vec<u8>),
    Disconnect(ConnId),
    /// A worker registered on this connection: a known peer from now on (outside the
    /// router's bounds on pending connections and their idle deadline).
    Admit(ConnId),
}

struct ServerState {
    cfg: ServerConfig,
    incarnation: u64,
    registry: Registry,
    metrics: Arc<BootstrapMetrics>,
    /// Open connections and their peers' addresses, for logs.
    conns: BTreeMap<ConnId, SocketAddr>,
    outbox: mpsc::Sender<Outgoing>,
    pump: JoinHandle<()>,
    sweep: JoinHandle<()>,
}

impl Actor for ServerActor {
    type Msg = ServerMsg;
    type State = ServerState;
    type Arguments = ServerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ServerMsg>,
        args: ServerArgs,
    ) -> Result<ServerState, ActorProcessingErr> {
        let local = args.router.local_addr();
        let (outbox, outbox_rx) = mpsc::channel(SERVER_OUTBOX_MAX);
        let pump = tokio::spawn(pump(args.router, outbox_rx, myself.clone()));
        let sweep = myself.send_interval(args.cfg.sweep_interval(), || ServerMsg::Sweep);
        info!(
            address = %local,
            authenticated = args.cfg.key.is_some(),
            expire_after = ?args.cfg.expire_after,
            "bootstrap server listening"
        );
        Ok(ServerState {
            metrics: args.metrics,
            cfg: args.cfg,
            incarnation: args.incarnation,
            registry: Registry::new(),
            conns: BTreeMap::new(),
            outbox,
            pump,
            sweep,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<ServerMsg>,
        msg: ServerMsg,
        state: &mut ServerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ServerMsg::Router(event, _permit) => state.on_router(event),
            ServerMsg::Sweep => state.sweep(Instant::now()),
            ServerMsg::Status(port) => {
                let _ = port.send(state.registry.status());
            }
            ServerMsg::Query(engine, port) => {
                let _ = port.send(state.registry.query(&engine));
            }
        }
        Ok(())
    }

    /// The server spawns no child actors (its pump and timer are tasks it aborts itself), so
    /// there is nothing to supervise; an unexpected event is logged, never fatal.
    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<ServerMsg>,
        evt: SupervisionEvent,
        _state: &mut ServerState,
    ) -> Result<(), ActorProcessingErr> {
        debug!(event = ?evt, "bootstrap server: supervision event ignored");
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ServerMsg>,
        state: &mut ServerState,
    ) -> Result<(), ActorProcessingErr> {
        state.sweep.abort();
        state.pump.abort();
        // Wait for the pump to have dropped the router, so its connections are closing when
        // `stop` returns. (The router's accept task is aborted by its `Drop`, which tokio
        // completes on the task's next poll: the listening port is released shortly after,
        // not synchronously.)
        let pump = std::mem::replace(&mut state.pump, tokio::spawn(async {}));
        if tokio::time::timeout(SERVER_CALL_TIMEOUT, pump)
            .await
            .is_err()
        {
            warn!("bootstrap server: the router task did not end in time");
        }
        info!(
            workers = state.registry.workers(),
            engines = state.registry.engines(),
            "bootstrap server stopped"
        );
        Ok(())
    }
}

/// Holds the router: hands its events to the actor (at most [`SERVER_EVENTS_INFLIGHT_MAX`]
/// unhandled at once, so the actor's unbounded mailbox stays bounded) and performs the
/// actor's sends and disconnects.
async fn pump(
    mut router: Router,
    mut outbox: mpsc::Receiver<Outgoing>,
    actor: ActorRef<ServerMsg>,
) {
    let permits = Arc::new(Semaphore::new(SERVER_EVENTS_INFLIGHT_MAX));
    loop {
        let next_event = async {
            let permit = permits.clone().acquire_owned().await;
            (permit, router.recv().await)
        };
        tokio::select! {
            biased;
            out = outbox.recv() => match out {
                Some(Outgoing::Send(conn, frame)) => {
                    if let Err(e) = router.send(conn, vec![frame]) {
                        debug!(?conn, error = %e, "reply not sent");
                    }
                }
                Some(Outgoing::Disconnect(conn)) => router.disconnect(conn),
                Some(Outgoing::Admit(conn)) => router.admit(conn),
                None => return,
            },
            (permit, event) = next_event => {
                let (Ok(permit), Some(event)) = (permit, event) else {
                    error!("bootstrap server: the listener ended; stopping");
                    actor.stop(Some("listener ended".into()));
                    return;
                };
                if actor.cast(ServerMsg::Router(event, permit)).is_err() {
                    return;
                }
            }
        }
    }
}

impl ServerState {
    fn on_router(&mut self, event: RouterEvent) {
        match event {
            RouterEvent::Connected { conn, peer, .. } => {
                debug!(%peer, ?conn, "bootstrap client connected");
                self.conns.insert(conn, peer);
            }
            RouterEvent::Disconnected { conn, peer, reason } => {
                debug!(%peer, ?conn, %reason, "bootstrap client disconnected");
                self.conns.remove(&conn);
                self.registry.disconnected(conn);
            }
            RouterEvent::Message { conn, peer, frames } => {
                let origin = Origin { conn, peer };
                match <[Vec<u8>; 1]>::try_from(frames) {
                    Ok([frame]) => self.on_frame(origin, &frame),
                    Err(frames) => self.refuse_unread(
                        origin,
                        &format!("expected one frame per message, got {}", frames.len()),
                    ),
                }
            }
        }
    }

    fn on_frame(&mut self, origin: Origin, frame: &[u8]) {
        let msg = match wire::decode(frame, self.cfg.key.as_ref()) {
            Ok(msg) => msg,
            Err(e) => return self.refuse_unread(origin, &e.to_string()),
        };
        let now = Instant::now();
        self.registry.touch(origin.conn, now);
        let reply = match msg {
            Message::Hello(_) => match check_hello(&msg) {
                Ok(_) => Message::HelloAck(HelloAck::new(self.incarnation)),
                Err(e) => return self.refuse(origin, &e.to_string()),
            },
            Message::Heartbeat(hb) => Message::Heartbeat(Heartbeat {
                incarnation: self.incarnation,
                seq: hb.seq,
                echo: hb.seq,
                lease_ms: 0,
            }),
            Message::Register(record) => match self.register(origin, record, now) {
                Some(reply) => reply,
                None => return,
            },
            Message::Query(q) => {
                let answer = self.registry.query(&q.engine_id);
                self.metrics.lookup(match &answer {
                    QueryAnswer::Ready { .. } => "ready",
                    QueryAnswer::NotReady { .. } => "not_ready",
                    QueryAnswer::UnknownEngine => "unknown_engine",
                });
                Message::QueryReply(QueryReply {
                    answer,
                    engine_id: q.engine_id,
                })
            }
            Message::StatusRequest(_) => Message::StatusReply(self.registry.status()),
            Message::Unregister(u) => {
                let removed = self.registry.unregister(&u.rank, u.incarnation);
                if removed.is_some() {
                    info!(peer = %origin.peer, rank = %u.rank, incarnation = u.incarnation, "worker unregistered");
                }
                Message::Unregistered(Unregistered {
                    removed: removed.is_some(),
                })
            }
            Message::ProtocolError(p) => {
                warn!(peer = %origin.peer, detail = %p.detail, "bootstrap client reported a protocol error; closing");
                return self.disconnect(origin.conn);
            }
            other => {
                let detail = format!(
                    "unexpected {}: a bootstrap server serves Hello, Heartbeat, Register, Query, StatusRequest and Unregister",
                    other.message_type()
                );
                return self.refuse(origin, &detail);
            }
        };
        self.reply(origin, &reply);
    }

    /// Registers and logs; `None` when the registration was refused (already answered).
    fn register(
        &mut self,
        origin: Origin,
        record: wire::WorkerRecord,
        now: Instant,
    ) -> Option<Message> {
        let ok = Message::RegisterOk(RegisterOk {
            rank: record.rank.clone(),
            incarnation: record.incarnation,
        });
        let (rank, role, incarnation) = (record.rank.clone(), record.role, record.incarnation);
        let control = record.control_address.clone();
        let outcome = self.registry.register(record, origin, now);
        self.metrics.registration(match &outcome {
            RegisterOutcome::Added => "added",
            RegisterOutcome::Refreshed => "refreshed",
            RegisterOutcome::Replaced { .. } => "replaced",
            RegisterOutcome::Conflict(_) => "conflict",
            RegisterOutcome::Refused(_) => "refused",
        });
        if matches!(
            outcome,
            RegisterOutcome::Added | RegisterOutcome::Refreshed | RegisterOutcome::Replaced { .. }
        ) {
            self.queue(Outgoing::Admit(origin.conn));
        }
        match outcome {
            RegisterOutcome::Added => {
                info!(peer = %origin.peer, %rank, %role, incarnation, %control, "worker registered");
                Some(ok)
            }
            RegisterOutcome::Refreshed => {
                debug!(peer = %origin.peer, %rank, incarnation, "worker registered again (same record)");
                Some(ok)
            }
            RegisterOutcome::Replaced {
                old_incarnation,
                old_conn,
            } => {
                info!(peer = %origin.peer, %rank, %role, incarnation, old_incarnation, %control, "worker restarted: record replaced");
                if old_conn != origin.conn && self.conns.contains_key(&old_conn) {
                    // The replaced process may live on (stopped, then resumed): closed, its
                    // client reconnects, registers again, and hears the conflict, as it
                    // would after its record expired; kept open, its heartbeats would go
                    // on answering and it would never learn that it is no longer found.
                    self.disconnect(old_conn);
                }
                Some(ok)
            }
            RegisterOutcome::Conflict(existing) => {
                warn!(
                    peer = %origin.peer, %rank, incarnation,
                    existing_incarnation = existing.incarnation,
                    existing_control = %existing.control_address,
                    "registration conflicts with the record held; refused"
                );
                Some(Message::RegisterConflict(RegisterConflict {
                    existing: *existing,
                }))
            }
            RegisterOutcome::Refused(why) => {
                self.refuse(origin, &why);
                None
            }
        }
    }

    fn sweep(&mut self, now: Instant) {
        for gone in self.registry.expire(now, self.cfg.expire_after) {
            info!(
                rank = %gone.record.rank,
                incarnation = gone.record.incarnation,
                peer = %gone.origin.peer,
                silent = ?gone.silent,
                "worker expired: no heartbeat"
            );
            if self.conns.contains_key(&gone.origin.conn) {
                // The connection is open but silent: close it, so a live client notices,
                // reconnects and registers again.
                self.disconnect(gone.origin.conn);
            }
        }
    }

    /// Logs the refusal with the peer, answers a signed [`ProtocolError`] and closes the
    /// connection: for messages that decoded (and so authenticated, with a key).
    fn refuse(&mut self, origin: Origin, detail: &str) {
        self.refuse_with(origin, detail, self.cfg.key.clone().as_ref());
    }

    /// As [`ServerState::refuse`], for input that did not decode: the answer is never
    /// signed, so an unauthenticated peer cannot make the server sign text it chose (error
    /// details quote the peer's bytes). An unkeyed peer reads it; a keyed one reads it too
    /// (the client decodes an unsigned `ProtocolError` to name the refusal).
    fn refuse_unread(&mut self, origin: Origin, detail: &str) {
        self.refuse_with(origin, detail, None);
    }

    fn refuse_with(&mut self, origin: Origin, detail: &str, key: Option<&Key>) {
        warn!(peer = %origin.peer, %detail, "bootstrap server refused a message; closing the connection");
        let msg = Message::ProtocolError(ProtocolError::new(detail.to_string()));
        self.send_with(origin, &msg, key);
        self.disconnect(origin.conn);
    }

    fn reply(&mut self, origin: Origin, msg: &Message) {
        self.send_with(origin, msg, self.cfg.key.clone().as_ref());
    }

    fn send_with(&mut self, origin: Origin, msg: &Message, key: Option<&Key>) {
        match wire::encode(msg, key) {
            Ok(frame) => self.queue(Outgoing::Send(origin.conn, frame)),
            Err(e) => {
                error!(peer = %origin.peer, reply = %msg.message_type(), error = %e, "cannot encode a reply (a bug)");
            }
        }
    }

    fn disconnect(&mut self, conn: ConnId) {
        self.conns.remove(&conn);
        self.registry.disconnected(conn);
        self.queue(Outgoing::Disconnect(conn));
    }

    fn queue(&self, out: Outgoing) {
        if self.outbox.try_send(out).is_err() {
            // The pump is SERVER_OUTBOX_MAX behind: drop this one; the client's deadline
            // covers a missing reply.
            warn!("bootstrap server outbox full; a reply or disconnect was dropped");
        }
    }
}
