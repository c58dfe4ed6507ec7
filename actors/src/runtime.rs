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

use std::collections::{BTreeMap, HashMap, VecDeque};
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

use crate::config::{
    RuntimeConfig, TransportChoice, PENDING_MESSAGES_PER_REQUEST_MAX, PENDING_REQUESTS_MAX,
    REQUESTS_OPEN_MAX_DEFAULT, TOMBSTONES_MAX,
};
use crate::event::{Event, EventQueue, FenceEnd, ReleaseReason};
use crate::ledger::{Ledger, Record};
use crate::link::{Attach, Inbox, Link};
use crate::machine::{Outbound, Peer, ReceiverEvent, SenderEvent, State, Timeouts};
use crate::request::{Kind, MachineEvent, RequestActor, RequestArgs, RequestMsg};
use crate::Error;

/// Messages the root actor handles.
#[derive(Debug)]
pub(crate) enum RootMsg {
    /// The engine opened a request.
    Open { ledger: Ledger, kind: OpenKind },
    /// The engine handed blocks over (already recorded in the ledger).
    HandedOver {
        id: RequestId,
        blocks: Vec<BlockId>,
        aux: Vec<u8>,
    },
    /// The engine aborted a request.
    Abort { id: RequestId },
    /// A peer sent a control message about a request.
    Inbound {
        from: Peer,
        id: RequestId,
        msg: Outbound,
    },
    /// A peer sent a malformed or out-of-range message about a request.
    Invalid {
        from: Peer,
        id: RequestId,
        detail: String,
    },
    /// The engine (or admission control) rejects a decode request as busy.
    Reject { id: RequestId },
    /// A request actor's machine reached a terminal state.
    Ended { id: RequestId },
    /// A peer stopped answering: fail every request that depends on it.
    PeerLost { peer: Peer },
    /// Fault injection: make the request's actor panic.
    InjectPanic { id: RequestId },
    /// A buffered request's bootstrap deadline has passed: expire what is due.
    ExpirePending,
    /// The fence bound of a request whose actor died has passed: release its blocks.
    ReleaseOrphan { id: RequestId },
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

struct Entry {
    actor: ActorRef<RequestMsg>,
    ledger: Ledger,
}

/// Messages for a request this runtime does not know yet.
struct Pending {
    expires: Instant,
    /// The peers that sent something, to be told if the request is never opened.
    from: Vec<Peer>,
    events: Vec<MachineEvent>,
}

struct RootState {
    cfg: RuntimeConfig,
    link: Arc<dyn Link>,
    shared: Arc<Shared>,
    requests: BTreeMap<RequestId, Entry>,
    by_actor: HashMap<ActorId, RequestId>,
    pending: BTreeMap<RequestId, Pending>,
    /// Pending requests in the order they expire (all live for the same bootstrap timeout).
    pending_order: VecDeque<(Instant, RequestId)>,
    tombstones: BTreeMap<RequestId, State>,
    /// Decode requests whose actor died while their blocks could still be written into
    /// (one-sided writes): held until the fence bound passes.
    orphans: BTreeMap<RequestId, Ledger>,
    tombstone_order: VecDeque<RequestId>,
}

/// State shared between the root actor and the engine's handles.
#[derive(Default)]
pub(crate) struct Shared {
    pub(crate) events: Arc<EventQueue>,
    /// Every request from `sender`/`receiver` returning until the root buries it. Held here,
    /// not only in the root's mailbox, so a request whose `Open` message is overtaken by a
    /// stop still ends `Failed` with its blocks released.
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
            // Requests that ended but still held blocks (a fence) give them back too: the
            // runtime is going away, and nothing it started can land after this.
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
        Ok(RootState {
            cfg: args.cfg,
            link,
            shared: args.shared,
            requests: BTreeMap::new(),
            by_actor: HashMap::new(),
            pending: BTreeMap::new(),
            pending_order: VecDeque::new(),
            tombstones: BTreeMap::new(),
            orphans: BTreeMap::new(),
            tombstone_order: VecDeque::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<RootMsg>,
        msg: RootMsg,
        state: &mut RootState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RootMsg::Open { ledger, kind } => state.open(&myself, ledger, kind).await,
            RootMsg::HandedOver { id, blocks, aux } => {
                let event = match state.cfg.role {
                    Role::Prefill => MachineEvent::Sender(SenderEvent::Input { blocks, aux }),
                    Role::Decode => MachineEvent::Receiver(ReceiverEvent::Allocated { blocks }),
                };
                state.deliver(&id, event);
            }
            RootMsg::Abort { id } => {
                let event = match state.cfg.role {
                    Role::Prefill => MachineEvent::Sender(SenderEvent::Abort),
                    Role::Decode => MachineEvent::Receiver(ReceiverEvent::Abort),
                };
                state.deliver(&id, event);
            }
            RootMsg::Inbound { from, id, msg } => state.inbound(&myself, from, id, msg),
            RootMsg::Invalid { from, id, detail } => {
                let what = format!("invalid message: {detail}");
                let event = match state.cfg.role {
                    Role::Prefill => MachineEvent::Sender(SenderEvent::Unexpected { from, what }),
                    Role::Decode => {
                        MachineEvent::Receiver(ReceiverEvent::Unexpected { from, what })
                    }
                };
                state.deliver(&id, event);
            }
            RootMsg::Reject { id } => {
                let reason = FailureReason::RejectedBusy;
                state.deliver(
                    &id,
                    MachineEvent::Receiver(ReceiverEvent::Reject { reason }),
                );
            }
            RootMsg::Ended { id } => state.ended(&id),
            RootMsg::PeerLost { peer } => state.peer_lost(&peer),
            RootMsg::ExpirePending => state.expire_pending(now()),
            RootMsg::ReleaseOrphan { id } => {
                if let Some(ledger) = state.orphans.remove(&id) {
                    ledger.release_all(ledger.ended_why(Some(FenceEnd::Bound)));
                    // Whatever the dead actor left in flight has ended by now.
                    for peer in ledger.peers() {
                        let _ = state.link.send(&peer, &id, Outbound::AbortAck);
                    }
                }
            }
            RootMsg::InjectPanic { id } => {
                if let Some(e) = state.requests.get(&id) {
                    let _ = e.actor.cast(RequestMsg::Panic);
                }
            }
        }
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
                state.child_gone(&myself, &cell, &format!("request actor failed: {err}"));
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                let why = reason.unwrap_or_else(|| "no reason given".into());
                state.child_gone(
                    &myself,
                    &cell,
                    &format!("request actor stopped before the request ended: {why}"),
                );
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
        for id in state.requests.keys() {
            state.link.request_ended(id);
        }
        for (_, ledger) in std::mem::take(&mut state.orphans) {
            ledger.release_all(ReleaseReason::Shutdown);
        }
        state.shared.fail_all("runtime stopped");
        for (_, entry) in std::mem::take(&mut state.requests) {
            entry.actor.stop(None);
        }
        state.by_actor.clear();
        info!(rank = %state.cfg.rank, "runtime stopped");
        Ok(())
    }
}

impl RootState {
    async fn open(&mut self, myself: &ActorRef<RootMsg>, ledger: Ledger, kind: OpenKind) {
        let id = ledger.id.clone();
        if let Some(ended) = self.tombstones.get(&id) {
            // Ended here already (or, on prefill, never opened before its bootstrap deadline,
            // with decode told that nothing of ours would be written): it fails at once,
            // rather than act on messages that would break that promise.
            let reason = ended.failure().cloned().unwrap_or(FailureReason::Protocol {
                detail: format!("request {id} already ended here ({ended})"),
            });
            warn!(request = %id, %reason, "request opened after it ended here");
            ledger.fail_if_live(reason);
            self.shared.open().remove(&id);
            return;
        }
        let backlog = self
            .pending
            .remove(&id)
            .map(|p| p.events)
            .unwrap_or_default();
        let kind = match kind {
            OpenKind::Sender => Kind::Sender,
            OpenKind::Receiver {
                prefill,
                prefill_dp_rank,
            } => Kind::Receiver {
                mode: self.cfg.mode,
                prefill,
                prefill_dp_rank,
            },
        };
        let args = RequestArgs {
            ledger: ledger.clone(),
            link: self.link.clone(),
            root: myself.clone(),
            timeouts: self.cfg.timeouts,
            kind,
            backlog,
        };
        let saturated = self.cfg.role == Role::Decode
            && self
                .cfg
                .unallocated_max
                .is_some_and(|max| self.unallocated() >= max);
        match Actor::spawn_linked(None, RequestActor, args, myself.get_cell()).await {
            Ok((actor, _)) => {
                if saturated {
                    warn!(request = %id, "decode saturated: rejecting");
                    let reason = FailureReason::RejectedBusy;
                    let _ = actor.cast(RequestMsg::Event(MachineEvent::Receiver(
                        ReceiverEvent::Reject { reason },
                    )));
                }
                self.by_actor.insert(actor.get_id(), id.clone());
                self.requests.insert(id.clone(), Entry { actor, ledger });
                debug!(request = %id, role = %self.cfg.role, "request opened");
            }
            Err(e) => {
                warn!(request = %id, error = %e, "could not start request actor");
                ledger.fail_if_live(FailureReason::Internal {
                    detail: format!("could not start request actor: {e}"),
                });
                self.shared.open().remove(&id);
            }
        }
    }

    /// Live decode requests still waiting for the engine to allocate their blocks.
    fn unallocated(&self) -> usize {
        self.requests
            .values()
            .filter(|e| !e.ledger.handed_over())
            .count()
    }

    fn deliver(&mut self, id: &RequestId, event: MachineEvent) {
        if let Some(entry) = self.requests.get(id) {
            let _ = entry.actor.cast(RequestMsg::Event(event));
        }
    }

    /// Routes a peer's message: to the live request, or an answer for an ended one, or a
    /// bounded buffer for one the engine has not opened yet.
    fn inbound(&mut self, myself: &ActorRef<RootMsg>, from: Peer, id: RequestId, msg: Outbound) {
        if let Some(ended) = self.tombstones.get(&id) {
            if matches!(msg, Outbound::TransferInfo { .. } | Outbound::Ready { .. }) {
                let reason = ended.failure().cloned().unwrap_or(FailureReason::Protocol {
                    detail: format!("request {id} already ended ({ended})"),
                });
                let _ = self.link.send(&from, &id, Outbound::Abort { reason });
            }
            // A request buried here is settled: no write of ours for it is in flight, so a
            // decode rank fencing its blocks can have its acknowledgement at once.
            // (Not an orphan, whose dead actor may have left a transfer in flight: it is
            // acknowledged when its fence bound passes.)
            if matches!(msg, Outbound::Abort { .. }) && !self.orphans.contains_key(&id) {
                let _ = self.link.send(&from, &id, Outbound::AbortAck);
            }
            debug!(request = %id, peer = %from, "message for an ended request dropped");
            return;
        }
        let is_abort = matches!(msg, Outbound::Abort { .. });
        let event = to_event(self.cfg.role, from.clone(), msg);
        if self.requests.contains_key(&id) {
            return self.deliver(&id, event);
        }
        if is_abort && self.cfg.role == Role::Prefill {
            // Not opened here yet, so nothing of ours was written: decode may release now.
            // (The abort is still buffered: the request fails as soon as it is opened.)
            let _ = self.link.send(&from, &id, Outbound::AbortAck);
        }
        self.buffer(myself, from, id, event);
    }

    fn buffer(
        &mut self,
        myself: &ActorRef<RootMsg>,
        from: Peer,
        id: RequestId,
        event: MachineEvent,
    ) {
        let t = now();
        self.expire_pending(t);
        if !self.pending.contains_key(&id) {
            if self.pending.len() >= PENDING_REQUESTS_MAX {
                warn!(request = %id, peer = %from, "too many requests pending creation; refusing");
                let reason = FailureReason::Internal {
                    detail: "too many requests pending creation".into(),
                };
                let _ = self.link.send(&from, &id, Outbound::Abort { reason });
                return;
            }
            let expires = t + self.cfg.timeouts.bootstrap;
            self.pending.insert(
                id.clone(),
                Pending {
                    expires,
                    from: Vec::new(),
                    events: Vec::new(),
                },
            );
            self.pending_order.push_back((expires, id.clone()));
            // One timer per buffered request (bounded by PENDING_REQUESTS_MAX), so an
            // unopened request is answered at its deadline even if nothing else arrives.
            myself.send_after(self.cfg.timeouts.bootstrap, || RootMsg::ExpirePending);
        }
        let Some(pending) = self.pending.get_mut(&id) else {
            return;
        };
        if pending.events.len() >= PENDING_MESSAGES_PER_REQUEST_MAX {
            warn!(request = %id, peer = %from, "too many messages for a request not yet opened; dropped");
            return;
        }
        if !pending.from.contains(&from) {
            pending.from.push(from);
        }
        pending.events.push(event);
    }

    /// Drops messages for requests the engine never opened within the bootstrap timeout,
    /// and tells their senders (instead of leaving them to their own deadlines).
    fn expire_pending(&mut self, t: Instant) {
        while let Some((expires, _)) = self.pending_order.front() {
            if *expires > t {
                return;
            }
            let Some((expires, id)) = self.pending_order.pop_front() else {
                return;
            };
            // Opened since (entry gone) or re-buffered later: nothing to expire.
            if self.pending.get(&id).is_none_or(|p| p.expires != expires) {
                continue;
            }
            if let Some(p) = self.pending.remove(&id) {
                warn!(request = %id, peers = ?p.from, "request never opened here before its bootstrap deadline");
                if self.cfg.role == Role::Prefill {
                    // We tell decode nothing of ours will be written: keep that true if the
                    // engine opens the request after all, or its messages come late
                    // (found by the simulator: a late transfer info re-buffered, the engine
                    // opened the request, and prefill wrote into blocks decode had reused).
                    self.entomb(id.clone(), State::Failed(FailureReason::BootstrapTimeout));
                }
                for peer in p.from {
                    if self.cfg.role == Role::Prefill {
                        // Never opened here: nothing of ours was written (after the abort).
                        let abort = Outbound::Abort {
                            reason: FailureReason::BootstrapTimeout,
                        };
                        let _ = self.link.send(&peer, &id, abort);
                        let _ = self.link.send(&peer, &id, Outbound::AbortAck);
                        continue;
                    }
                    let _ = self.link.send(
                        &peer,
                        &id,
                        Outbound::Abort {
                            reason: FailureReason::BootstrapTimeout,
                        },
                    );
                }
            }
        }
    }

    fn ended(&mut self, id: &RequestId) {
        let Some(entry) = self.requests.remove(id) else {
            return;
        };
        self.by_actor.remove(&entry.actor.get_id());
        entry.actor.stop(None);
        // Blocks handed over while the request was ending, never seen by its machine.
        entry.ledger.release_all(ReleaseReason::Late);
        self.bury(&entry.ledger);
    }

    /// Remembers an ended request, tells sibling ranks if it failed here, and frees its id.
    fn bury(&mut self, ledger: &Ledger) {
        let state = ledger.state();
        if let State::Failed(reason) = &state {
            if !matches!(reason, FailureReason::AbortedByPeer { .. }) {
                for sibling in self.link.siblings() {
                    let _ = self.link.send(
                        &sibling,
                        &ledger.id,
                        Outbound::Abort {
                            reason: reason.clone(),
                        },
                    );
                }
            }
        }
        debug!(request = %ledger.id, %state, "request ended");
        self.entomb(ledger.id.clone(), state);
        self.shared.open().remove(&ledger.id);
    }

    /// Remembers how a request ended here (at most [`TOMBSTONES_MAX`], oldest forgotten).
    fn entomb(&mut self, id: RequestId, state: State) {
        if self.tombstones.insert(id.clone(), state).is_none() {
            self.tombstone_order.push_back(id);
        }
        while self.tombstone_order.len() > TOMBSTONES_MAX {
            if let Some(old) = self.tombstone_order.pop_front() {
                self.tombstones.remove(&old);
            }
        }
    }

    /// A request actor died: its request fails (if it had not ended), its peers are told.
    fn child_gone(&mut self, myself: &ActorRef<RootMsg>, cell: &ActorCell, why: &str) {
        let Some(id) = self.by_actor.remove(&cell.get_id()) else {
            return;
        };
        let Some(entry) = self.requests.remove(&id) else {
            return;
        };
        let reason = FailureReason::Internal {
            detail: why.to_string(),
        };
        // With one-sided writes, a decode request's blocks may still be written into by a
        // prefill rank, and on any plane a pull decode's own read in flight copies into
        // them; the fence that tracked either died with the actor: hold them for the whole
        // fence bound instead of releasing now (found by the simulator: a dead pull
        // request's read landed in blocks the engine had reused).
        let orphan = self.link.one_sided()
            || (self.cfg.role == Role::Decode && self.cfg.mode == TransferMode::Pull);
        // Revoke this request's grants before its blocks go, as its actor would have (found
        // by the simulator running the real grant table: a late write passed the dead
        // request's grant and landed in blocks the engine had reused).
        self.link.request_ended(&id);
        let live = !entry.ledger.state().is_terminal();
        if live {
            warn!(request = %id, %why, "request failed with its actor");
            if orphan {
                entry.ledger.transition(State::Failed(reason.clone()));
            } else {
                entry.ledger.fail_if_live(reason.clone());
            }
            for peer in entry.ledger.peers() {
                let _ = self.link.send(
                    &peer,
                    &id,
                    Outbound::Abort {
                        reason: reason.clone(),
                    },
                );
            }
        }
        if orphan {
            let wait = self.cfg.timeouts.fence_max();
            warn!(request = %id, ?wait, "holding the blocks of a request whose actor died, for the fence bound");
            self.orphans.insert(id.clone(), entry.ledger.clone());
            let orphan_id = id.clone();
            myself.send_after(wait, move || RootMsg::ReleaseOrphan { id: orphan_id });
        } else {
            entry.ledger.release_all(entry.ledger.ended_why(None));
        }
        self.bury(&entry.ledger);
    }

    fn peer_lost(&mut self, peer: &Peer) {
        for (id, entry) in &self.requests {
            if entry.ledger.peers().contains(peer) {
                let event = match self.cfg.role {
                    Role::Prefill => {
                        MachineEvent::Sender(SenderEvent::PeerLost { peer: peer.clone() })
                    }
                    Role::Decode => {
                        MachineEvent::Receiver(ReceiverEvent::PeerLost { peer: peer.clone() })
                    }
                };
                debug!(request = %id, %peer, "peer lost");
                let _ = entry.actor.cast(RequestMsg::Event(event));
            }
        }
    }
}

/// What a peer's message means to this side's machine.
fn to_event(role: Role, from: Peer, msg: Outbound) -> MachineEvent {
    match role {
        Role::Prefill => MachineEvent::Sender(match msg {
            Outbound::TransferInfo { mode, blocks } => {
                SenderEvent::TransferInfo { from, mode, blocks }
            }
            Outbound::Queued => SenderEvent::Queued { from },
            Outbound::Rejected { reason } => SenderEvent::Rejected { from, reason },
            Outbound::ReadDone => SenderEvent::ReadDone { from },
            Outbound::Abort { reason } => SenderEvent::PeerAbort { from, reason },
            Outbound::AbortAck => SenderEvent::AbortAck { from },
            other => SenderEvent::Unexpected {
                from,
                what: format!("{other:?}"),
            },
        }),
        Role::Decode => MachineEvent::Receiver(match msg {
            Outbound::Done { aux } => ReceiverEvent::Done { from, aux },
            Outbound::Ready { blocks, aux, hold } => ReceiverEvent::Ready {
                from,
                blocks,
                aux,
                hold,
            },
            Outbound::Abort { reason } => ReceiverEvent::PeerAbort { from, reason },
            Outbound::AbortAck => ReceiverEvent::AbortAck { from },
            other => ReceiverEvent::Unexpected {
                from,
                what: format!("{other:?}"),
            },
        }),
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
            .cast(RootMsg::HandedOver { id, blocks, aux })
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
        if self.root.cast(RootMsg::Abort { id }).is_err() {
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
        if self.0.root.cast(RootMsg::Reject { id }).is_err() {
            self.0.ledger.fail_if_live(FailureReason::RejectedBusy);
        }
    }
}
