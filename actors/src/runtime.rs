//! The runtime: its root actor, which supervises one actor per live request, and the
//! engine-facing [`Runtime`] handle.
//!
//! # Supervision policy
//! The root actor is the supervisor of every request actor (`spawn_linked`) and writes its
//! policy out in `handle_supervisor_evt` rather than taking ractor's default (which would
//! stop the root when any child stops):
//! - a request actor that **fails** (a panic or an error in a handler) ends its request
//!   `Failed(Internal)`: the request's ledger releases every block it held, the engine gets
//!   the events, the peers and sibling ranks get an `Abort`; the runtime and every other
//!   request go on. Requests are never restarted: a restarted actor would not know what its
//!   peer already did, and the engine can retry the whole request cheaply.
//! - a request actor that **stops** before its request ended is treated the same way.
//! - a request actor that stops after its request ended is the normal case and is ignored.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use handoff_transport::wire::AUX_BYTES_MAX;
use handoff_transport::{
    BlockId, EngineId, FailureReason, RankInfo, Region, RequestId, Role, TransferMode,
};
use ractor::{Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::config::{RuntimeConfig, TransportChoice, REQUESTS_OPEN_MAX_DEFAULT};
use crate::event::{Event, EventQueue, ReleaseReason};
use crate::ledger::{Ledger, Record};
use crate::link::{Attach, Inbox, Link};
use crate::machine::{Peer, PeerMessage, State, Timeouts};
use crate::request::{Kind, RequestActor, RequestArgs, RequestMsg};
use crate::router::{
    Action, Input, Local, MachineEvent, Note, Router, RouterConfig, RouterLimits, Timer,
};
use crate::Error;

/// Messages the root actor handles.
#[derive(Debug)]
pub(crate) enum RootMsg {
    /// The engine opened a request.
    Open { ledger: Ledger, kind: OpenKind },
    /// The engine (or the control loop) says something about one request: blocks handed
    /// over (already recorded in the ledger), an abort, a busy rejection, a peer's
    /// malformed message.
    Local { id: RequestId, what: Local },
    /// A peer sent a control message about a request.
    Inbound {
        from: Peer,
        id: RequestId,
        msg: PeerMessage,
    },
    /// A request actor's machine reached a terminal state.
    Ended { id: RequestId },
    /// A peer stopped answering: fail every request that depends on it.
    PeerLost { peer: Peer },
    /// Fault injection: make the request's actor panic.
    InjectPanic { id: RequestId },
    /// A timer the router asked for fired.
    Timer(Timer),
}

#[derive(Debug)]
pub(crate) enum OpenKind {
    Sender,
    Receiver {
        prefill: EngineId,
        prefill_dp_rank: Option<u32>,
    },
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Ledger({})", self.id)
    }
}

/// What the root keeps for a request the router has not forgotten: its actor (none once
/// it died or was stopped) and its ledger.
struct Entry {
    actor: Option<ActorRef<RequestMsg>>,
    ledger: Ledger,
}

/// The root actor's state: the router decides, this performs.
struct RootState {
    cfg: RuntimeConfig,
    link: Arc<dyn Link>,
    shared: Arc<Shared>,
    router: Router,
    entries: BTreeMap<RequestId, Entry>,
    by_actor: HashMap<ActorId, RequestId>,
}

/// State shared between the root actor and the engine's handles.
#[derive(Default)]
pub(crate) struct Shared {
    pub(crate) events: Arc<EventQueue>,
    /// Every request from `sender`/`receiver` returning until the root forgets it. Held
    /// here, not only in the root's mailbox, so a request whose `Open` message is overtaken
    /// by a stop still ends `Failed` with its blocks released.
    open: Mutex<BTreeMap<RequestId, Ledger>>,
}

impl Shared {
    fn open(&self) -> std::sync::MutexGuard<'_, BTreeMap<RequestId, Ledger>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Fails every request still open (the runtime is stopping), in request-id order.
    fn fail_all(&self, why: &str) {
        let open = std::mem::take(&mut *self.open());
        for ledger in open.values() {
            let detail = why.to_string();
            ledger.fail_if_live_as(FailureReason::Internal { detail }, ReleaseReason::Shutdown);
            // Requests that ended but still held blocks (a fence, an orphan) give them back
            // too: the runtime is going away, and nothing it started can land after this.
            ledger.release_all(ReleaseReason::Shutdown);
        }
    }
}

struct RootActor;

struct RootArgs {
    cfg: RuntimeConfig,
    shared: Arc<Shared>,
}

fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

impl Actor for RootActor {
    type Msg = RootMsg;
    type State = RootState;
    type Arguments = RootArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<RootMsg>,
        args: RootArgs,
    ) -> Result<RootState, ActorProcessingErr> {
        let (rank, role, region) = (
            args.cfg.rank.clone(),
            args.cfg.role,
            args.cfg.region.clone(),
        );
        let inbox = Inbox(myself);
        let link: Arc<dyn Link> = match &args.cfg.transport {
            TransportChoice::InProcess(fabric) => fabric.attach(rank, role, inbox, region)?,
            TransportChoice::Custom(transport) => transport.attach(rank, role, inbox, region)?,
        };
        info!(role = %args.cfg.role, rank = %args.cfg.rank, transport = ?args.cfg.transport, "runtime started");
        let router = Router::new(RouterConfig {
            role: args.cfg.role,
            mode: args.cfg.mode,
            one_sided: link.one_sided(),
            bootstrap: args.cfg.timeouts.bootstrap,
            fence_max: args.cfg.timeouts.fence_max(),
            unallocated_max: args.cfg.unallocated_max,
            limits: RouterLimits::default(),
        });
        Ok(RootState {
            cfg: args.cfg,
            link,
            shared: args.shared,
            router,
            entries: BTreeMap::new(),
            by_actor: HashMap::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<RootMsg>,
        msg: RootMsg,
        state: &mut RootState,
    ) -> Result<(), ActorProcessingErr> {
        let input = match msg {
            RootMsg::Open { ledger, kind } => {
                state.open(&myself, ledger, kind).await;
                return Ok(());
            }
            RootMsg::Local { id, what } => Input::Local { id, what },
            RootMsg::Inbound { from, id, msg } => Input::Inbound { from, id, msg },
            RootMsg::Ended { id } => {
                let Some(entry) = state.entries.get(&id) else {
                    return Ok(());
                };
                let ended = entry.ledger.state();
                Input::Ended { id, state: ended }
            }
            RootMsg::PeerLost { peer } => {
                debug!(%peer, "peer lost");
                Input::PeerLost { peer }
            }
            RootMsg::Timer(timer) => Input::Timer(timer),
            RootMsg::InjectPanic { id } => {
                if let Some(actor) = state.entries.get(&id).and_then(|e| e.actor.as_ref()) {
                    let _ = actor.cast(RequestMsg::Panic);
                }
                return Ok(());
            }
        };
        state.feed(&myself, input);
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<RootMsg>,
        evt: SupervisionEvent,
        state: &mut RootState,
    ) -> Result<(), ActorProcessingErr> {
        match evt {
            SupervisionEvent::ActorFailed(cell, err) => {
                state.child_gone(&myself, &cell, format!("request actor failed: {err}"));
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                let why = reason.unwrap_or_else(|| "no reason given".into());
                let why = format!("request actor stopped before the request ended: {why}");
                state.child_gone(&myself, &cell, why);
            }
            _ => {}
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<RootMsg>,
        state: &mut RootState,
    ) -> Result<(), ActorProcessingErr> {
        state.link.detach();
        // In request-id order, so a simulated shutdown replays the same way.
        for id in state.router.live() {
            state.link.request_ended(id);
        }
        // Every ledger the router still knows (live requests and orphans) is in `open`.
        state.shared.fail_all("runtime stopped");
        for (_, entry) in std::mem::take(&mut state.entries) {
            if let Some(actor) = entry.actor {
                actor.stop(None);
            }
        }
        state.by_actor.clear();
        info!(rank = %state.cfg.rank, "runtime stopped");
        Ok(())
    }
}

impl RootState {
    /// Feeds the router one input and performs what it decides.
    fn feed(&mut self, myself: &ActorRef<RootMsg>, input: Input) {
        for action in self.router.handle(now(), input) {
            self.perform(myself, action);
        }
    }

    async fn open(&mut self, myself: &ActorRef<RootMsg>, ledger: Ledger, kind: OpenKind) {
        let id = ledger.id.clone();
        for action in self.router.handle(now(), Input::Open { id }) {
            match action {
                Action::Spawn {
                    backlog, reject, ..
                } => {
                    let kind = match &kind {
                        OpenKind::Sender => Kind::Sender,
                        OpenKind::Receiver {
                            prefill,
                            prefill_dp_rank,
                        } => Kind::Receiver {
                            mode: self.cfg.mode,
                            prefill: prefill.clone(),
                            prefill_dp_rank: *prefill_dp_rank,
                        },
                    };
                    self.spawn(myself, ledger.clone(), kind, backlog, reject)
                        .await;
                }
                Action::Refuse { id, reason } => {
                    warn!(request = %id, %reason, "request opened after it ended here");
                    ledger.fail_if_live(reason);
                    self.shared.open().remove(&id);
                }
                other => self.perform(myself, other),
            }
        }
    }

    async fn spawn(
        &mut self,
        myself: &ActorRef<RootMsg>,
        ledger: Ledger,
        kind: Kind,
        backlog: Vec<MachineEvent>,
        reject: bool,
    ) {
        let id = ledger.id.clone();
        let args = RequestArgs {
            ledger: ledger.clone(),
            link: self.link.clone(),
            root: myself.clone(),
            timeouts: self.cfg.timeouts,
            kind,
            backlog,
        };
        match Actor::spawn_linked(None, RequestActor, args, myself.get_cell()).await {
            Ok((actor, _)) => {
                if reject {
                    warn!(request = %id, "decode saturated: rejecting");
                    let event = MachineEvent::for_role(self.cfg.role, Local::Reject);
                    let _ = actor.cast(RequestMsg::Event(event));
                }
                self.by_actor.insert(actor.get_id(), id.clone());
                let actor = Some(actor);
                self.entries.insert(id.clone(), Entry { actor, ledger });
                debug!(request = %id, role = %self.cfg.role, "request opened");
            }
            Err(e) => {
                warn!(request = %id, error = %e, "could not start request actor");
                ledger.fail_if_live(FailureReason::Internal {
                    detail: format!("could not start request actor: {e}"),
                });
                let state = ledger.state();
                self.entries.insert(
                    id.clone(),
                    Entry {
                        actor: None,
                        ledger,
                    },
                );
                self.feed(myself, Input::Ended { id, state });
            }
        }
    }

    fn ledger(&self, id: &RequestId) -> Option<&Ledger> {
        self.entries.get(id).map(|e| &e.ledger)
    }

    fn perform(&mut self, myself: &ActorRef<RootMsg>, action: Action) {
        match action {
            Action::Deliver { id, event } => {
                if let Some(actor) = self.entries.get(&id).and_then(|e| e.actor.as_ref()) {
                    let _ = actor.cast(RequestMsg::Event(event));
                }
            }
            Action::Send { to, id, msg } => {
                if matches!(msg, PeerMessage::Abort { .. }) {
                    debug!(request = %id, peer = %to, "telling a peer the request ended here");
                }
                let _ = self.link.send(&to, &id, msg);
            }
            Action::ToSiblings { id, msg } => {
                for sibling in self.link.siblings() {
                    let _ = self.link.send(&sibling, &id, msg.clone());
                }
            }
            Action::After { delay, timer } => {
                myself.send_after(delay, move || RootMsg::Timer(timer));
            }
            Action::Revoke { id } => self.link.request_ended(&id),
            Action::Fail { id, reason, hold } => {
                let Some(ledger) = self.ledger(&id) else {
                    return;
                };
                warn!(request = %id, %reason, "request failed with its actor");
                if hold {
                    let wait = self.cfg.timeouts.fence_max();
                    warn!(request = %id, ?wait, "holding the blocks of a request whose actor died, for the fence bound");
                    ledger.transition(State::Failed(reason));
                } else {
                    ledger.fail_if_live(reason);
                }
            }
            Action::Release { id, fence } => {
                if let Some(ledger) = self.ledger(&id) {
                    ledger.release_all(ledger.ended_why(fence));
                }
            }
            Action::Retire { id } => {
                let Some(entry) = self.entries.get_mut(&id) else {
                    return;
                };
                if let Some(actor) = entry.actor.take() {
                    self.by_actor.remove(&actor.get_id());
                    actor.stop(None);
                }
                // Blocks handed over while the request was ending, never seen by its machine.
                entry.ledger.release_all(ReleaseReason::Late);
            }
            Action::Forget { id } => {
                if let Some(entry) = self.entries.remove(&id) {
                    if let Some(actor) = entry.actor {
                        self.by_actor.remove(&actor.get_id());
                    }
                    debug!(request = %id, state = %entry.ledger.state(), "request ended");
                }
                self.shared.open().remove(&id);
            }
            Action::Note(note) => match note {
                Note::Late { id, from } => {
                    debug!(request = %id, peer = %from, "message for an ended request answered or dropped");
                }
                Note::TooManyPending { id, from } => {
                    warn!(request = %id, peer = %from, "too many requests pending creation; refusing");
                }
                Note::BytesFull {
                    id,
                    from,
                    held,
                    bytes,
                } => {
                    warn!(request = %id, peer = %from, held, bytes, "messages for requests not yet opened would hold too many bytes; refused");
                }
                Note::BufferFull { id, from } => {
                    warn!(request = %id, peer = %from, "too many messages for a request not yet opened; dropped");
                }
                Note::NeverOpened { id, peers } => {
                    warn!(request = %id, ?peers, "request never opened here before its bootstrap deadline");
                }
            },
            // Only an open decides these, and `open` performs them itself.
            Action::Spawn { id, .. } | Action::Refuse { id, .. } => {
                warn!(request = %id, "open decision outside an open dropped");
            }
        }
    }

    /// A request actor died: the router decides what its request leaves behind.
    fn child_gone(&mut self, myself: &ActorRef<RootMsg>, cell: &ActorCell, why: String) {
        let Some(id) = self.by_actor.remove(&cell.get_id()) else {
            return;
        };
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        entry.actor = None;
        let (state, peers) = (entry.ledger.state(), entry.ledger.peers());
        if !state.is_terminal() {
            warn!(request = %id, %why, "request actor died");
        }
        self.feed(
            myself,
            Input::ActorGone {
                id,
                state,
                peers,
                why,
            },
        );
    }
}

/// Builds a [`Runtime`]. Made by [`Runtime::builder`].
#[derive(Clone, Debug)]
pub struct RuntimeBuilder {
    role: Role,
    rank: RankInfo,
    timeouts: Timeouts,
    mode: TransferMode,
    requests_open_max: usize,
    unallocated_max: Option<usize>,
    transport: Option<TransportChoice>,
    region: Option<Arc<Region>>,
}

impl RuntimeBuilder {
    /// Decode only: admission control. With `Some(n)`, a receiver opened without blocks
    /// while `n` requests already wait for blocks is rejected at once (`RejectedBusy`), and
    /// prefill is told `Rejected` instead of waiting out its bootstrap timeout (seed 003).
    /// Default `None`: no limit.
    pub fn admission(mut self, unallocated_max: Option<usize>) -> Self {
        self.unallocated_max = unallocated_max;
        self
    }

    /// Deadlines for every lifecycle state (defaults: [`Timeouts::default`]).
    pub fn timeouts(mut self, timeouts: Timeouts) -> Self {
        self.timeouts = timeouts;
        self
    }

    /// Decode only: push (default) or pull.
    pub fn mode(mut self, mode: TransferMode) -> Self {
        self.mode = mode;
        self
    }

    /// Bound on open requests (default [`REQUESTS_OPEN_MAX_DEFAULT`]).
    pub fn requests_open_max(mut self, max: usize) -> Self {
        self.requests_open_max = max;
        self
    }

    /// The transport (required).
    pub fn transport(mut self, transport: TransportChoice) -> Self {
        self.transport = Some(transport);
        self
    }

    /// The KV memory this worker registers (required).
    pub fn region(mut self, region: Arc<Region>) -> Self {
        self.region = Some(region);
        self
    }

    /// Starts the runtime's root actor on the current tokio runtime.
    pub async fn start(self) -> Result<Runtime, Error> {
        let transport = self
            .transport
            .ok_or_else(|| Error::Config("no transport chosen: call .transport(..)".into()))?;
        let region = self
            .region
            .ok_or_else(|| Error::Config("no memory region: call .region(..)".into()))?;
        if self.requests_open_max == 0 {
            return Err(Error::Config("requests_open_max must be at least 1".into()));
        }
        let cfg = RuntimeConfig {
            role: self.role,
            rank: self.rank,
            timeouts: self.timeouts,
            mode: self.mode,
            requests_open_max: self.requests_open_max,
            unallocated_max: self.unallocated_max,
            transport,
            region,
        };
        let shared = Arc::new(Shared::default());
        let args = RootArgs {
            cfg: cfg.clone(),
            shared: shared.clone(),
        };
        let (root, join) = Actor::spawn(None, RootActor, args)
            .await
            .map_err(|e| Error::Spawn(e.to_string()))?;
        Ok(Runtime {
            root,
            shared,
            cfg,
            join: Mutex::new(Some(join)),
        })
    }
}

/// One worker's handoff runtime: what an engine embeds (one per GPU worker process).
///
/// Calls on it never block on the network: they record what the engine asked for and hand
/// it to the runtime's actors. Progress is seen through [`SenderHandle::poll`] /
/// [`ReceiverHandle::poll`], awaited through `completion()`, or collected once per engine
/// step with [`Runtime::drain_events`].
pub struct Runtime {
    root: ActorRef<RootMsg>,
    shared: Arc<Shared>,
    cfg: RuntimeConfig,
    join: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// What a decode request receives from.
#[derive(Clone, Debug)]
pub struct ReceiverSpec {
    /// The prefill engine that computes this request's KV cache.
    pub prefill: EngineId,
    /// Its dp rank, if the router chose one; else the lowest registered.
    pub prefill_dp_rank: Option<u32>,
    /// The destination blocks, if allocated already; else call [`ReceiverHandle::allocate`]
    /// later (until then the request is `Bootstrapping` and prefill is told `Queued`).
    pub blocks: Option<Vec<BlockId>>,
}

impl Runtime {
    /// Starts building a runtime for one worker.
    pub fn builder(role: Role, rank: impl Into<RankInfo>) -> RuntimeBuilder {
        RuntimeBuilder {
            role,
            rank: rank.into(),
            timeouts: Timeouts::default(),
            mode: TransferMode::Push,
            requests_open_max: REQUESTS_OPEN_MAX_DEFAULT,
            unallocated_max: None,
            transport: None,
            region: None,
        }
    }

    /// This runtime's configuration.
    pub fn config(&self) -> &RuntimeConfig {
        &self.cfg
    }

    /// The KV memory this worker registered.
    pub fn region(&self) -> &Arc<Region> {
        &self.cfg.region
    }

    fn open(&self, id: RequestId, kind: OpenKind) -> Result<Ledger, Error> {
        use ractor::ActorStatus::{Draining, Stopped, Stopping};
        if matches!(self.root.get_status(), Stopping | Stopped | Draining) {
            return Err(Error::Stopped);
        }
        let ledger = {
            let mut open = self.shared.open();
            if open.contains_key(&id) {
                return Err(Error::DuplicateRequest(id));
            }
            self.shared
                .events
                .admit(self.cfg.requests_open_max)
                .map_err(|open| Error::TooManyRequests { open })?;
            let ledger = Ledger::new(id.clone(), self.cfg.role, self.shared.events.clone());
            open.insert(id.clone(), ledger.clone());
            ledger
        };
        if self
            .root
            .cast(RootMsg::Open {
                ledger: ledger.clone(),
                kind,
            })
            .is_err()
        {
            self.shared.open().remove(&id);
            ledger.fail_if_live_as(
                FailureReason::Internal {
                    detail: "runtime stopped".into(),
                },
                ReleaseReason::Shutdown,
            );
            return Err(Error::Stopped);
        }
        Ok(ledger)
    }

    /// Opens a prefill request. Call [`SenderHandle::send`] when its KV cache is computed.
    pub fn sender(&self, id: impl Into<RequestId>) -> Result<SenderHandle, Error> {
        if self.cfg.role != Role::Prefill {
            return Err(Error::WrongRole(self.cfg.role));
        }
        let ledger = self.open(id.into(), OpenKind::Sender)?;
        Ok(SenderHandle(Handle::new(ledger, self)))
    }

    /// Opens a decode request that receives from `spec.prefill`.
    pub fn receiver(
        &self,
        id: impl Into<RequestId>,
        spec: ReceiverSpec,
    ) -> Result<ReceiverHandle, Error> {
        if self.cfg.role != Role::Decode {
            return Err(Error::WrongRole(self.cfg.role));
        }
        if let Some(blocks) = &spec.blocks {
            self.cfg.region.check_blocks(blocks)?;
        }
        let kind = OpenKind::Receiver {
            prefill: spec.prefill,
            prefill_dp_rank: spec.prefill_dp_rank,
        };
        let handle = ReceiverHandle(Handle::new(self.open(id.into(), kind)?, self));
        if let Some(blocks) = spec.blocks {
            handle.allocate(blocks)?;
        }
        Ok(handle)
    }

    /// Every lifecycle event since the last call, oldest first. Never blocks.
    pub fn drain_events(&self) -> Vec<Event> {
        self.shared.events.drain()
    }

    /// Requests open now: live, or ended with their final event not yet drained.
    pub fn open_requests(&self) -> usize {
        self.shared.events.open()
    }

    /// Tells the runtime a peer is gone: every request depending on it fails at once with
    /// `PeerLost` (the control plane's heartbeats call this).
    pub fn peer_lost(&self, peer: Peer) {
        let _ = self.root.cast(RootMsg::PeerLost { peer });
    }

    /// Fault injection (tests, the simulator): makes the request's actor panic. The request
    /// must end `Failed(Internal)` with its blocks released, and nothing else may notice.
    pub fn inject_panic(&self, id: &RequestId) {
        let _ = self.root.cast(RootMsg::InjectPanic { id: id.clone() });
    }

    /// Stops the runtime: every live request fails with `Internal("runtime stopped")`, its
    /// blocks are released, and the runtime leaves its transport.
    pub async fn shutdown(&self) {
        self.root.stop(Some("shutdown".into()));
        let join = self.join.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(join) = join {
            let _ = join.await;
        }
        // Requests opened while the root was stopping never reached it.
        self.shared.fail_all("runtime stopped");
    }
}

/// What both handles share.
#[derive(Clone)]
struct Handle {
    ledger: Ledger,
    rx: watch::Receiver<Record>,
    root: ActorRef<RootMsg>,
    region: Arc<Region>,
}

impl Handle {
    fn new(ledger: Ledger, rt: &Runtime) -> Self {
        Self {
            rx: ledger.subscribe(),
            ledger,
            root: rt.root.clone(),
            region: rt.cfg.region.clone(),
        }
    }

    fn hand_over(&self, blocks: Vec<BlockId>, aux: Vec<u8>) -> Result<(), Error> {
        self.region.check_blocks(&blocks)?;
        if aux.len() > AUX_BYTES_MAX {
            return Err(Error::AuxTooLarge {
                len: aux.len(),
                max: AUX_BYTES_MAX,
            });
        }
        self.ledger.hand_over(blocks.clone())?;
        let id = self.ledger.id.clone();
        if self
            .root
            .cast(RootMsg::Local {
                id,
                what: Local::HandedOver { blocks, aux },
            })
            .is_err()
        {
            self.ledger.fail_if_live_as(
                FailureReason::Internal {
                    detail: "runtime stopped".into(),
                },
                ReleaseReason::Shutdown,
            );
        }
        Ok(())
    }

    fn poll(&self) -> State {
        self.rx.borrow().state.clone()
    }

    fn completion(&self) -> impl Future<Output = State> + Send + 'static {
        let mut rx = self.rx.clone();
        async move {
            let ended = rx
                .wait_for(|r| r.state.is_terminal())
                .await
                .map(|r| r.state.clone());
            // The ledger is gone only if every handle and actor is: report what we saw.
            ended.unwrap_or_else(|_| rx.borrow().state.clone())
        }
    }

    fn abort(&self) {
        let id = self.ledger.id.clone();
        let what = Local::Abort;
        if self.root.cast(RootMsg::Local { id, what }).is_err() {
            self.ledger.fail_if_live(FailureReason::AbortedByEngine);
        }
    }
}

/// The engine's handle on one prefill request.
#[derive(Clone)]
pub struct SenderHandle(Handle);

impl SenderHandle {
    /// The request's id.
    pub fn id(&self) -> &RequestId {
        &self.0.ledger.id
    }

    /// The prefill KV cache is computed and lives in `blocks`: hand them to the runtime,
    /// which holds them until the request ends (then a `Released` event gives them back).
    /// Refused, with the blocks still the caller's, if the request has ended already.
    pub fn send(&self, blocks: Vec<BlockId>) -> Result<(), Error> {
        self.0.hand_over(blocks, Vec::new())
    }

    /// [`send`](Self::send), with a payload for decode's engine beside the KV (at most
    /// [`AUX_BYTES_MAX`] bytes; SGLang's first output token and its metadata): decode's
    /// [`ReceiverHandle::aux`] holds it once the request is `Done` there.
    pub fn send_with_aux(&self, blocks: Vec<BlockId>, aux: Vec<u8>) -> Result<(), Error> {
        self.0.hand_over(blocks, aux)
    }

    /// The request's state now. Never blocks.
    pub fn poll(&self) -> State {
        self.0.poll()
    }

    /// Resolves with the terminal state (`Done` or `Failed`).
    pub fn completion(&self) -> impl Future<Output = State> + Send + 'static {
        self.0.completion()
    }

    /// Aborts the request: it fails `AbortedByEngine`, decode is told, blocks are released.
    pub fn abort(&self) {
        self.0.abort()
    }
}

/// The engine's handle on one decode request.
#[derive(Clone)]
pub struct ReceiverHandle(Handle);

impl ReceiverHandle {
    /// The request's id.
    pub fn id(&self) -> &RequestId {
        &self.0.ledger.id
    }

    /// The destination blocks are allocated: the runtime sends them to prefill and holds
    /// them until the request ends (`Released` after `Done` means they hold the KV cache).
    pub fn allocate(&self, blocks: Vec<BlockId>) -> Result<(), Error> {
        self.0.hand_over(blocks, Vec::new())
    }

    /// The payloads prefill ranks sent with their KV ([`SenderHandle::send_with_aux`]), one
    /// per rank that sent a non-empty one, in arrival order. Complete once the request is
    /// `Done`; a failed request's are not to be used.
    pub fn aux(&self) -> Vec<(RankInfo, Vec<u8>)> {
        self.0.rx.borrow().aux.clone()
    }

    /// The request's state now. Never blocks.
    pub fn poll(&self) -> State {
        self.0.poll()
    }

    /// Resolves with the terminal state (`Done` or `Failed`).
    pub fn completion(&self) -> impl Future<Output = State> + Send + 'static {
        self.0.completion()
    }

    /// Aborts the request: it fails `AbortedByEngine`, prefill is told, blocks are released.
    pub fn abort(&self) {
        self.0.abort()
    }

    /// Refuses the request because this decode is saturated: prefill is told `Rejected` at
    /// once (not after its bootstrap timeout) and the request fails `RejectedBusy`. Only
    /// meaningful before blocks are allocated.
    pub fn reject_busy(&self) {
        let id = self.0.ledger.id.clone();
        let what = Local::Reject;
        if self.0.root.cast(RootMsg::Local { id, what }).is_err() {
            self.0.ledger.fail_if_live(FailureReason::RejectedBusy);
        }
    }
}
