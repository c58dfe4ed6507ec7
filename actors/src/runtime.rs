//! The runtime: its root actor, which supervises one actor per live request, and the
//! engine-facing [`Runtime`] handle.
//!
//! # Supervision policy
//! The root actor is the supervisor of every request actor (a task of its own, see
//! `request`), and writes its policy out in `child_gone`:
//! - a request actor that **fails** (a panic or an error in a handler) ends its request
//!   `Failed(Internal)`: the root takes the request's estate from its deed and releases
//!   every block it held (at once, or at the fence bound if writes may land), the engine gets
//!   the events, the peers and sibling ranks get an `Abort`; the runtime and every other
//!   request go on. Requests are never restarted: a restarted actor would not know what its
//!   peer already did, and the engine can retry the whole request cheaply.
//! - a request actor is only ever stopped by the root (it retires ended requests, and
//!   stops them all when the runtime stops).
//! - a request actor that stops after its request ended is the normal case and is ignored.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use handoff_transport::wire::AUX_BYTES_MAX;
use handoff_transport::{BlockId, EngineId, RankInfo, Region, RequestId, Role, TransferMode};
use tracing::{debug, error, info, trace, warn, Instrument};

use crate::estate::{Consignment, Deed, Estate, ViewRx};

use crate::config::{RuntimeConfig, TransportChoice, REQUESTS_OPEN_MAX_DEFAULT};
use crate::event::{Doorbell, Event, EventQueue, ReleaseReason};
use crate::link::{Attach, Inbox, Link};
use crate::machine::{Peer, PeerMessage, State, Timeouts};
use crate::metrics::Metrics;
use crate::request::{self, Kind, RequestArgs, RequestMsg, RequestTask};
use crate::router::{
    Action, Input, Local, MachineEvent, Note, Router, RouterConfig, RouterLimits, Timer,
};
use crate::Error;

/// Messages the root actor handles.
#[derive(Debug)]
pub(crate) enum RootMsg {
    /// The engine opened a request: its estate comes with it, already in the deed its
    /// actor will use (dropped unhandled, the estate fails the request and gives its blocks
    /// back). A deed, not the estate itself: the mailbox's slots are as large as its
    /// largest message, and every message is copied in and out of one.
    Open {
        id: RequestId,
        deed: Deed,
        kind: OpenKind,
    },
    /// The engine handed the request's blocks over (and prefill's payload for decode).
    HandOver {
        id: RequestId,
        blocks: Consignment,
        aux: Vec<u8>,
    },
    /// The engine (or the control loop) says something about one request: an abort, a
    /// busy rejection, a peer's malformed message.
    Local { id: RequestId, what: Local },
    /// A peer sent a control message about a request.
    Inbound {
        from: Peer,
        id: RequestId,
        msg: PeerMessage,
    },
    /// A request actor's machine reached a terminal state, `state`, and has nothing in flight.
    Ended { id: RequestId, state: State },
    /// A peer stopped answering: fail every request that depends on it.
    PeerLost { peer: Peer },
    /// A new process holds a lost peer's rank (`Input::PeerReplaced`).
    PeerReplaced { peer: Peer },
    /// A newer process holds this worker's own rank (`Input::Superseded`).
    Superseded { detail: String },
    /// Fault injection: make the request's actor panic.
    InjectPanic { id: RequestId },
    /// Fault injection: make the root itself panic.
    InjectRootPanic,
    /// Wakes an idle root to see that it was asked to stop (`RootRef::stop`).
    Stop,
    /// The request actor of spawn `serial` failed (a panic in a handler) and is gone.
    ChildGone {
        id: RequestId,
        serial: u64,
        why: String,
    },
    /// A timer the router asked for fired.
    Timer(Timer),
    /// A writer of a quarantined orphan exited (its watch answered), or cannot be watched.
    WriterGone {
        id: RequestId,
        peer: Peer,
        exited: bool,
    },
}

#[derive(Debug)]
pub(crate) enum OpenKind {
    Sender,
    Receiver {
        prefill: EngineId,
        prefill_dp_rank: Option<u32>,
    },
}

/// What the root keeps for a request the router has not forgotten: its actor (none once
/// it died or was stopped) and the deed to its estate (the actor's to use while it runs;
/// the root's once it is gone).
struct Entry {
    actor: Option<RequestTask>,
    deed: Deed,
    /// A quarantined orphan's blocks (counted in `handoff_blocks_quarantined`), and the
    /// tasks watching its writers' processes.
    quarantine: Option<(usize, Vec<tokio::task::AbortHandle>)>,
}

impl Entry {
    /// The orphan's quarantine ends (its blocks went, or the runtime stops): the gauge
    /// forgets its blocks and nothing watches its writers any more.
    fn unquarantine(&mut self, metrics: &Metrics, role: Role) {
        if let Some((blocks, watchers)) = self.quarantine.take() {
            metrics.quarantined(role, -(blocks as i64));
            for watcher in watchers {
                watcher.abort();
            }
        }
    }
}

/// The root actor's state: the router decides, this performs.
struct RootState {
    cfg: RuntimeConfig,
    link: Arc<dyn Link>,
    shared: Arc<Shared>,
    router: Router,
    entries: BTreeMap<RequestId, Entry>,
    /// The serial of the next request actor spawned.
    serial: u64,
    /// The timers the router armed, by when they fire (and the order they were armed in):
    /// the root's loop sleeps until the first, so a timer costs an entry here, not a task.
    timers: BTreeMap<(tokio::time::Instant, u64), Timer>,
    /// How many timers were ever armed: the second half of a timer's key.
    armed: u64,
    /// The router's actions are decided into this buffer, reused message after message.
    spare: Vec<Action>,
}

/// What the root actor and the engine's handles share: the event queue, the metrics and the
/// ids in use.
pub(crate) struct Shared {
    pub(crate) events: Arc<EventQueue>,
    pub(crate) metrics: Arc<Metrics>,
    /// Ids from `sender`/`receiver` returning until the root forgets the request: an id is
    /// not opened twice while the runtime still knows it.
    ids: Mutex<BTreeSet<RequestId>>,
    /// The runtime's memory, which a handle checks the blocks it is given against.
    region: Arc<Region>,
    /// Set once, by the root, when a newer process holds this worker's rank: what the
    /// directory said (`Runtime::superseded`).
    superseded: std::sync::OnceLock<String>,
}

impl Shared {
    fn ids(&self) -> std::sync::MutexGuard<'_, BTreeSet<RequestId>> {
        self.ids.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The root's address: its mailbox, and the signal that stops it. Cheap to clone.
///
/// The root is one tokio task reading one unbounded mailbox (bounded in practice: the
/// engine's opens by admission, peers' messages by the control loop's bounds, a request
/// actor's reports by the requests it holds), the same kind a request actor reads
/// ([`crate::mailbox`]): no actor framework sits between a message and the router.
#[derive(Clone)]
pub(crate) struct RootRef {
    tx: crate::mailbox::Sender<RootMsg>,
    stop: Arc<StopSignal>,
}

/// Asked once by [`Runtime::shutdown`]; the root's loop stops at its next turn (checked
/// before every message, so a long mailbox does not delay it; an idle root is woken by a
/// [`RootMsg::Stop`]).
#[derive(Default)]
struct StopSignal {
    asked: AtomicBool,
}

impl RootRef {
    /// Queues `msg` for the root; gives it back (dropped by the caller, it gives back what
    /// it carries) once the runtime is stopping or stopped.
    pub(crate) fn cast(&self, msg: RootMsg) -> Result<(), Box<RootMsg>> {
        // (A root that is gone closed its mailbox: the send gives the message back.)
        if self.stop.asked.load(Ordering::Acquire) {
            return Err(Box::new(msg));
        }
        self.tx.send(msg).map_err(Box::new)
    }

    /// The runtime was asked to stop, or its root is gone.
    fn stopping(&self) -> bool {
        self.stop.asked.load(Ordering::Acquire) || self.tx.is_closed()
    }

    /// Asks the root to stop: it finishes the message in hand, closes every request it
    /// knows, and drops the rest of its mailbox.
    fn stop(&self) {
        self.stop.asked.store(true, Ordering::Release);
        let _ = self.tx.send(RootMsg::Stop);
    }
}

fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// The text of the panic [`Runtime::inject_root_panic`] causes.
pub(crate) const INJECTED_ROOT_PANIC: &str = "injected root panic (fault injection)";

impl RootState {
    /// Attaches the runtime to its transport and builds the root's state; an error leaves
    /// nothing attached.
    fn start(cfg: RuntimeConfig, shared: Arc<Shared>, me: &RootRef) -> Result<RootState, Error> {
        let (rank, role, region) = (cfg.rank.clone(), cfg.role, cfg.region.clone());
        let inbox = Inbox(me.clone(), shared.metrics.clone());
        let link: Arc<dyn Link> = match &cfg.transport {
            TransportChoice::InProcess(fabric) => fabric.attach(rank, role, inbox, region)?,
            TransportChoice::Custom(transport) => transport.attach(rank, role, inbox, region)?,
        };
        let fence = cfg.timeouts.fence_max();
        if let Some(loss) = link
            .loss_timeout()
            .filter(|l| link.one_sided() && *l >= fence)
        {
            link.detach();
            let grace = crate::machine::PLANE_ANSWER_GRACE;
            let why = format!(
                "peers are taken as lost only after {loss:?} without a word (heartbeat interval × heartbeats missed), \
                 not within the fence bound of {fence:?} (the request timeouts' sum + {grace:?}): \
                 over a data plane whose writes cannot be refused, a writer stopped before its last post could \
                 outlast the fence unseen; take fewer heartbeats to lose a peer, or longer request timeouts"
            );
            return Err(Error::Config(why));
        }
        info!(role = %cfg.role, rank = %cfg.rank, transport = ?cfg.transport, "runtime started");
        let router = Router::new(RouterConfig {
            role: cfg.role,
            mode: cfg.mode,
            one_sided: link.one_sided(),
            bootstrap: cfg.timeouts.bootstrap,
            fence_max: cfg.timeouts.fence_max(),
            unallocated_max: cfg.unallocated_max,
            limits: RouterLimits::default(),
        });
        Ok(RootState {
            cfg,
            link,
            shared,
            router,
            entries: BTreeMap::new(),
            serial: 0,
            timers: BTreeMap::new(),
            armed: 0,
            spare: Vec::new(),
        })
    }

    /// The root's life: one message (or due timer) at a time, each handled synchronously,
    /// until the runtime is stopped. A panic in a handler (a bug in the root) stops the
    /// runtime as `shutdown` would: every request is closed and its blocks given back,
    /// rather than leaving them to a root that no longer answers.
    async fn run(mut self, me: RootRef, mut rx: crate::mailbox::Receiver<RootMsg>) {
        let sleep = tokio::time::sleep_until(tokio::time::Instant::now());
        tokio::pin!(sleep);
        loop {
            if me.stop.asked.load(Ordering::Acquire) {
                break;
            }
            let next = self.timers.first_key_value().map(|((at, _), _)| *at);
            if let Some(at) = next.filter(|at| *at != sleep.deadline()) {
                sleep.as_mut().reset(at);
            }
            let msg = tokio::select! {
                biased;
                () = &mut sleep, if next.is_some() => match self.timers.pop_first() {
                    Some((_, timer)) => RootMsg::Timer(timer),
                    None => continue,
                },
                msg = rx.recv() => match msg {
                    Some(RootMsg::Stop) | None => break,
                    Some(msg) => msg,
                },
            };
            let handled =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.handle(&me, msg)));
            if let Err(panic) = handled {
                let what = crate::request::panic_text(panic.as_ref());
                error!(rank = %self.cfg.rank, panic = %what, "the runtime's root failed: stopping the runtime, every request closed");
                me.stop.asked.store(true, Ordering::Release);
                break;
            }
            // The mailbox does not count against tokio's cooperative budget: each message
            // does, so a root that always has mail still lets its worker's other tasks run.
            tokio::task::consume_budget().await;
        }
        self.stop();
        // What the mailbox still holds goes after the event queue is marked stopping: an
        // `Open`'s estate closes its request, a consignment gives its blocks back.
        drop(rx);
    }

    fn handle(&mut self, myself: &RootRef, msg: RootMsg) {
        let input = match msg {
            RootMsg::Open { id, deed, kind } => return self.open(myself, id, deed, kind),
            RootMsg::HandOver { id, blocks, aux } => {
                return self.hand_over(myself, id, blocks, aux)
            }
            RootMsg::Local { id, what } => Input::Local { id, what },
            RootMsg::Inbound { from, id, msg } => {
                trace!(request = %id, peer = %from, "root: peer message");
                Input::Inbound { from, id, msg }
            }
            RootMsg::Ended { id, state } => Input::Ended { id, state },
            RootMsg::PeerLost { peer } => {
                debug!(%peer, "peer lost");
                self.shared.metrics.peer_lost();
                Input::PeerLost { peer }
            }
            RootMsg::PeerReplaced { peer } => {
                info!(%peer, "a new process holds this rank: its answers end no fence of a request its old process could still write for");
                Input::PeerReplaced { peer }
            }
            RootMsg::Superseded { detail } => {
                let _ = self.shared.superseded.set(detail.clone());
                self.shared.metrics.superseded();
                error!(rank = %self.cfg.rank, %detail, open = self.router.live().count(), "a newer process holds this worker's rank: every open request fails superseded, and new ones are refused (stop this process)");
                Input::Superseded { detail }
            }
            RootMsg::Timer(timer) => Input::Timer(timer),
            RootMsg::WriterGone { id, peer, exited } => Input::WriterGone { id, peer, exited },
            RootMsg::InjectPanic { id } => {
                if let Some(actor) = self.entries.get(&id).and_then(|e| e.actor.as_ref()) {
                    actor.cast(RequestMsg::Panic);
                }
                return;
            }
            RootMsg::ChildGone { id, serial, why } => {
                return self.child_gone(myself, id, serial, why)
            }
            RootMsg::InjectRootPanic => panic!("{INJECTED_ROOT_PANIC}"),
            // The loop stops on it before it gets here.
            RootMsg::Stop => return,
        };
        self.feed(myself, input);
    }

    /// The runtime stops: every request it knows is closed and its blocks given back.
    fn stop(&mut self) {
        self.shared.events.stop();
        self.link.detach();
        // In request-id order, so a simulated shutdown replays the same way.
        for id in self.router.live() {
            self.link.request_ended(id);
        }
        // Every request the router still knows (live ones and orphans), in id order: its
        // actor stops, and the root takes its estate to close it. Requests that ended but
        // still held blocks (a fence, an orphan) give them back too: the runtime is going
        // away, and nothing it started can land after this. Requests whose `Open` is still
        // in the mailbox are closed when it is dropped.
        for (_, mut entry) in std::mem::take(&mut self.entries) {
            entry.unquarantine(&self.shared.metrics, self.cfg.role);
            if let Some(actor) = entry.actor {
                actor.stop();
            }
            if let Some(mut estate) = entry.deed.take() {
                estate.close(ReleaseReason::Shutdown);
            }
        }
        self.timers.clear();
        info!(rank = %self.cfg.rank, "runtime stopped");
    }
}

impl RootState {
    /// Feeds the router one input and performs what it decides.
    fn feed(&mut self, myself: &RootRef, input: Input) {
        let mut actions = self.decide(input);
        for action in actions.drain(..) {
            self.perform(myself, action);
        }
        self.spare = actions;
    }

    /// The router's actions for `input`, in the root's reused buffer (give it back in
    /// `spare` once drained; one taken again meanwhile, by a nested input, is a new one).
    fn decide(&mut self, input: Input) -> Vec<Action> {
        let mut actions = std::mem::take(&mut self.spare);
        self.router.handle_into(now(), input, &mut actions);
        actions
    }

    fn open(&mut self, myself: &RootRef, id: RequestId, deed: Deed, kind: OpenKind) {
        let mut deed = Some(deed);
        let mut actions = self.decide(Input::Open { id });
        for action in actions.drain(..) {
            match action {
                Action::Spawn {
                    id,
                    backlog,
                    reject,
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
                    if let Some(deed) = deed.take() {
                        self.spawn(myself, id, deed, kind, backlog, reject);
                    }
                }
                Action::Refuse { id, reason } => {
                    warn!(request = %id, %reason, "request refused at open");
                    if let Some(deed) = deed.take() {
                        deed.with(|estate| estate.fail_if_live(reason));
                    }
                    self.shared.ids().remove(&id);
                }
                other => self.perform(myself, other),
            }
        }
        self.spare = actions;
    }

    fn spawn(
        &mut self,
        myself: &RootRef,
        id: RequestId,
        deed: Deed,
        kind: Kind,
        backlog: Vec<MachineEvent>,
        reject: bool,
    ) {
        let args = RequestArgs {
            id: id.clone(),
            role: self.cfg.role,
            deed: deed.clone(),
            link: self.link.clone(),
            root: myself.clone(),
            timeouts: self.cfg.timeouts,
            kind,
            backlog,
            metrics: self.shared.metrics.clone(),
        };
        self.serial += 1;
        let actor = request::spawn(args, self.serial);
        if reject {
            warn!(request = %id, "decode saturated: rejecting");
            let event = MachineEvent::for_role(self.cfg.role, Local::Reject);
            actor.cast(RequestMsg::Event(event));
        }
        let actor = Some(actor);
        let quarantine = None;
        self.entries.insert(
            id.clone(),
            Entry {
                actor,
                deed,
                quarantine,
            },
        );
        debug!(request = %id, role = %self.cfg.role, "request opened");
    }

    /// The engine handed a request's blocks over: the router says whether it is live (and
    /// counts it for admission); the blocks travel to its actor in their consignment, and
    /// go back to the engine if they cannot reach it.
    fn hand_over(&mut self, myself: &RootRef, id: RequestId, blocks: Consignment, aux: Vec<u8>) {
        let what = Local::HandedOver {
            blocks: blocks.blocks().to_vec(),
            aux,
        };
        let mut blocks = Some(blocks);
        let mut actions = self.decide(Input::Local { id, what });
        for action in actions.drain(..) {
            match action {
                Action::Deliver { id, event } => {
                    let actor = self.entries.get(&id).and_then(|e| e.actor.as_ref());
                    if let (Some(actor), Some(blocks)) = (actor, blocks.take()) {
                        actor.cast(RequestMsg::HandOver { event, blocks });
                    }
                }
                other => self.perform(myself, other),
            }
        }
        self.spare = actions;
        // Not delivered (the request is not live here): `blocks`, dropped, go back.
    }

    /// Runs `f` on the estate of a request whose actor is gone (the root owns it then).
    fn estate<R>(&self, id: &RequestId, f: impl FnOnce(&mut Estate) -> R) -> Option<R> {
        let entry = self.entries.get(id)?;
        debug_assert!(
            entry.actor.is_none(),
            "request {id}: the root used the estate of a live actor"
        );
        entry.deed.with(f)
    }

    fn perform(&mut self, myself: &RootRef, action: Action) {
        match action {
            Action::Deliver { id, event } => {
                if let Some(actor) = self.entries.get(&id).and_then(|e| e.actor.as_ref()) {
                    actor.cast(RequestMsg::Event(event));
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
                self.armed += 1;
                let at = tokio::time::Instant::now() + delay;
                self.timers.insert((at, self.armed), timer);
            }
            Action::Revoke { id } => self.link.request_ended(&id),
            Action::Fail { id, reason, hold } => {
                warn!(request = %id, %reason, "request failed with its actor");
                if hold {
                    let wait = self.cfg.timeouts.fence_max();
                    warn!(request = %id, ?wait, "holding the blocks of a request whose actor died, for the fence bound");
                }
                self.estate(&id, |estate| match hold {
                    true => estate.fail_holding(reason),
                    false => estate.fail_if_live(reason),
                });
            }
            Action::Quarantine {
                id,
                peers,
                replaced,
            } => self.quarantine(myself, id, peers, &replaced),
            Action::WatchEarlier { id, peer } => {
                let Some(task) = self.watch(myself, &id, &peer, true) else {
                    return debug!(request = %id, %peer, "no earlier process of this rank to watch");
                };
                match self
                    .entries
                    .get_mut(&id)
                    .and_then(|e| e.quarantine.as_mut())
                {
                    Some((_, watchers)) => watchers.push(task),
                    None => task.abort(),
                }
            }
            Action::Release { id, fence } => {
                self.estate(&id, |estate| estate.release_all(estate.ended_why(fence)));
                if let Some(entry) = self.entries.get_mut(&id) {
                    entry.unquarantine(&self.shared.metrics, self.cfg.role);
                }
            }
            Action::Retire { id } => {
                let Some(entry) = self.entries.get_mut(&id) else {
                    return;
                };
                if let Some(actor) = entry.actor.take() {
                    actor.stop();
                }
                // The root takes the estate from the stopping actor: blocks handed over
                // while the request was ending, never seen by its machine, go back now.
                if let Some(mut estate) = entry.deed.take() {
                    estate.close(ReleaseReason::Late);
                }
            }
            Action::Forget { id } => {
                if let Some(mut entry) = self.entries.remove(&id) {
                    entry.unquarantine(&self.shared.metrics, self.cfg.role);
                    if let Some(actor) = entry.actor {
                        actor.stop();
                    }
                    if let Some(state) = entry.deed.with(|e| e.state().clone()) {
                        debug!(request = %id, %state, "request ended");
                    }
                }
                self.shared.ids().remove(&id);
            }
            Action::Note(note) => {
                self.shared.metrics.refused(note.cause());
                self.log(note)
            }
            // Only an open decides these, and `open` performs them itself.
            Action::Spawn { id, .. } | Action::Refuse { id, .. } => {
                warn!(request = %id, "open decision outside an open dropped");
            }
        }
    }

    /// An orphan's fence bound passed with writers unconfirmed: watch each one's process
    /// where the link can (its exit is reported to the router), and let the router know at
    /// once of each it cannot watch (its blocks then go at the bound, as a live request's).
    fn quarantine(&mut self, myself: &RootRef, id: RequestId, peers: Vec<Peer>, replaced: &[Peer]) {
        if !self.entries.contains_key(&id) {
            return; // (the router forgets an orphan only with its entry)
        }
        let (mut watched, mut watchers) = (Vec::new(), Vec::new());
        for peer in peers {
            match self.watch(myself, &id, &peer, replaced.contains(&peer)) {
                Some(task) => {
                    watched.push(peer.to_string());
                    watchers.push(task);
                }
                None => {
                    // After the router's other actions for this input.
                    let (id, exited) = (id.clone(), false);
                    let _ = myself.cast(RootMsg::WriterGone { id, peer, exited });
                }
            }
        }
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        if watched.is_empty() {
            return;
        }
        let blocks = entry.deed.with(|e| e.held()).unwrap_or(0);
        warn!(request = %id, writers = ?watched, blocks, "quarantined: the request's actor died while a lost writer on this host may still land one write in these blocks; they are held until it exits or confirms");
        self.shared
            .metrics
            .quarantined(self.cfg.role, blocks as i64);
        entry.quarantine = Some((blocks, watchers));
    }

    /// Watches the process(es) of `peer` that may still write into orphan `id`'s blocks
    /// ([`Link::writer_exit`]), reporting it gone once they have exited; `None` when the
    /// link cannot watch them.
    fn watch(
        &self,
        myself: &RootRef,
        id: &RequestId,
        peer: &Peer,
        replaced: bool,
    ) -> Option<tokio::task::AbortHandle> {
        let exit = self.link.writer_exit(peer, replaced)?;
        let (root, id, peer) = (myself.clone(), id.clone(), peer.clone());
        let task = tokio::spawn(async move {
            exit.await;
            let exited = true;
            let _ = root.cast(RootMsg::WriterGone { id, peer, exited });
        });
        Some(task.abort_handle())
    }

    fn log(&self, note: Note) {
        match note {
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
            Note::Unconfirmed { id, from } => {
                warn!(request = %id, peer = %from, "a confirmation from this rank's new process ends nothing: the lost one may still write into these blocks, and they are held until it exits");
            }
        }
    }

    /// A request actor died: the router decides what its request leaves behind.
    fn child_gone(&mut self, myself: &RootRef, id: RequestId, serial: u64, why: String) {
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        if entry.actor.as_ref().map(|a| a.serial) != Some(serial) {
            return; // an actor the root stopped already
        }
        entry.actor = None;
        let Some((state, peers)) = entry.deed.with(|e| (e.state().clone(), e.peers().to_vec()))
        else {
            return;
        };
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
    metrics: Option<Arc<Metrics>>,
    doorbell: Option<Doorbell>,
}

impl RuntimeBuilder {
    /// Rings `bell` whenever an event is queued for [`Runtime::drain_events`]: an engine
    /// that drives many runtimes drains only those whose bell rang ([`crate::Doorbells`]).
    /// Default: no bell.
    pub fn doorbell(mut self, bell: Doorbell) -> Self {
        self.doorbell = Some(bell);
        self
    }

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

    /// The metrics to record into (default: the runtime's own; see [`Runtime::metrics`]).
    /// Share one between runtimes of a process to serve them on one endpoint.
    pub fn metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
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
        let metrics = self.metrics.unwrap_or_else(Metrics::new);
        metrics.set_block_bytes(cfg.region.block_bytes());
        let shared = Arc::new(Shared {
            events: Arc::new(EventQueue::with_bell(self.doorbell)),
            metrics,
            ids: Mutex::default(),
            region: cfg.region.clone(),
            superseded: std::sync::OnceLock::new(),
        });
        let (tx, rx) = crate::mailbox::channel();
        let root = RootRef {
            tx,
            stop: Arc::default(),
        };
        let state = RootState::start(cfg.clone(), shared.clone(), &root)?;
        let span = tracing::info_span!("root", role = %cfg.role, rank = %cfg.rank);
        let join = tokio::spawn(state.run(root.clone(), rx).instrument(span));
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
    root: RootRef,
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
            metrics: None,
            doorbell: None,
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

    /// The metrics this runtime records into (its own, or the one given to
    /// [`RuntimeBuilder::metrics`]); serve them with
    /// [`handoff_transport::exposition::serve_metrics`].
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.shared.metrics
    }

    /// Makes the request's estate and sends it to the root; the handles get its view.
    fn open(&self, id: RequestId, kind: OpenKind) -> Result<Handle, Error> {
        if self.root.stopping() {
            return Err(Error::Stopped);
        }
        let (estate, view) = {
            let mut ids = self.shared.ids();
            if ids.contains(&id) {
                return Err(Error::DuplicateRequest(id));
            }
            self.shared
                .events
                .admit(self.cfg.requests_open_max)
                .map_err(|open| Error::TooManyRequests { open })?;
            ids.insert(id.clone());
            let (events, metrics) = (self.shared.events.clone(), self.shared.metrics.clone());
            Estate::new(id.clone(), self.cfg.role, events, metrics)
        };
        // Refused, the message comes back and is dropped: the estate fails the request.
        let deed = Deed::new(estate);
        if self
            .root
            .cast(RootMsg::Open {
                id: id.clone(),
                deed,
                kind,
            })
            .is_err()
        {
            self.shared.ids().remove(&id);
            return Err(Error::Stopped);
        }
        Ok(Handle {
            id,
            view,
            root: self.root.clone(),
            role: self.cfg.role,
            shared: self.shared.clone(),
        })
    }

    /// Opens a prefill request. Call [`SenderHandle::send`] when its KV cache is computed.
    pub fn sender(&self, id: impl Into<RequestId>) -> Result<SenderHandle, Error> {
        if self.cfg.role != Role::Prefill {
            return Err(Error::WrongRole(self.cfg.role));
        }
        Ok(SenderHandle(self.open(id.into(), OpenKind::Sender)?))
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
        let handle = ReceiverHandle(self.open(id.into(), kind)?);
        if let Some(blocks) = spec.blocks {
            handle.allocate(blocks)?;
        }
        Ok(handle)
    }

    /// Every lifecycle event since the last call, oldest first. Never blocks.
    pub fn drain_events(&self) -> Vec<Event> {
        self.shared.events.drain()
    }

    /// Every lifecycle event since the last call, oldest first, appended to `out` (the
    /// runtime keeps its queue's buffer: a caller that drains every step allocates nothing
    /// once both buffers have grown). Never blocks.
    pub fn drain_events_into(&self, out: &mut Vec<Event>) {
        self.shared.events.drain_into(out);
    }

    /// Requests open now: live, or ended with their final event not yet drained.
    pub fn open_requests(&self) -> usize {
        self.shared.events.open()
    }

    /// What the directory said if a newer process holds this worker's rank (it was stopped
    /// or cut off long enough for its record to lapse, and a supervisor started another in
    /// its place), else `None`. From then on every open request has failed `Superseded` and
    /// every new one is refused the same way: the process should stop (`handoff worker
    /// --serve` exits on it). Also the `handoff_superseded` gauge.
    pub fn superseded(&self) -> Option<String> {
        self.shared.superseded.get().cloned()
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

    /// Fault injection (tests): makes the runtime's root panic, as a bug in it would. The
    /// runtime must stop as [`shutdown`](Self::shutdown) stops it (every live request fails,
    /// every block it held comes back, later calls get [`Error::Stopped`]), not hang.
    pub fn inject_root_panic(&self) {
        let _ = self.root.cast(RootMsg::InjectRootPanic);
    }

    /// Stops the runtime: every live request fails with `Internal("runtime stopped")`, its
    /// blocks are released, and the runtime leaves its transport.
    pub async fn shutdown(&self) {
        // The root marks the event queue stopping before the rest of its mailbox (and any
        // consignment in it) is dropped.
        self.root.stop();
        let join = self.join.lock().unwrap_or_else(|e| e.into_inner()).take();
        // The root closed every request it knew; those whose `Open` it never handled were
        // closed when their message was dropped.
        if let Some(join) = join {
            let _ = join.await;
        }
    }
}

/// A block id named twice in `blocks`, if any: given back twice, it would be freed twice by
/// the engine.
fn first_duplicate(blocks: &[BlockId]) -> Option<BlockId> {
    let mut sorted = blocks.to_vec();
    sorted.sort_unstable();
    sorted.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}

/// What both handles share: the request's published view, which also says whether the
/// engine handed its blocks over (the engine's own fact, shared by the handle's clones).
#[derive(Clone)]
struct Handle {
    id: RequestId,
    view: ViewRx,
    root: RootRef,
    role: Role,
    shared: Arc<Shared>,
}

impl Handle {
    fn hand_over(&self, blocks: Vec<BlockId>, aux: Vec<u8>) -> Result<(), Error> {
        self.shared.region.check_blocks(&blocks)?;
        if let Some(block) = first_duplicate(&blocks) {
            let id = self.id.clone();
            return Err(Error::DuplicateBlock { id, block, blocks });
        }
        if aux.len() > AUX_BYTES_MAX {
            return Err(Error::AuxTooLarge {
                len: aux.len(),
                max: AUX_BYTES_MAX,
            });
        }
        let state = self.poll();
        if state.is_terminal() {
            let id = self.id.clone();
            return Err(Error::RequestEnded { id, state, blocks });
        }
        if self.view.mark_handed() {
            return Err(Error::AlreadyHandedOver(self.id.clone()));
        }
        // From here the blocks are the runtime's: the request's owner takes them, or, if the
        // request ended meanwhile (or the runtime stopped), they come back as `Late`.
        let id = self.id.clone();
        let (events, metrics) = (&self.shared.events, &self.shared.metrics);
        let blocks = Consignment::new(
            id.clone(),
            self.role,
            blocks,
            events.clone(),
            metrics.clone(),
        );
        let _ = self.root.cast(RootMsg::HandOver { id, blocks, aux });
        Ok(())
    }

    fn poll(&self) -> State {
        self.view.state()
    }

    fn completion(&self) -> impl Future<Output = State> + Send + 'static {
        let view = self.view.clone();
        async move { view.ended().await }
    }

    /// Tells the root `what`; a stopped runtime ended the request already.
    fn tell(&self, what: Local) {
        let id = self.id.clone();
        let _ = self.root.cast(RootMsg::Local { id, what });
    }
}

/// The engine's handle on one prefill request.
#[derive(Clone)]
pub struct SenderHandle(Handle);

impl SenderHandle {
    /// The request's id.
    pub fn id(&self) -> &RequestId {
        &self.0.id
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
        self.0.tell(Local::Abort)
    }
}

/// The engine's handle on one decode request.
#[derive(Clone)]
pub struct ReceiverHandle(Handle);

impl ReceiverHandle {
    /// The request's id.
    pub fn id(&self) -> &RequestId {
        &self.0.id
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
        self.0.view.aux()
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
        self.0.tell(Local::Abort)
    }

    /// Refuses the request because this decode is saturated: prefill is told `Rejected` at
    /// once (not after its bootstrap timeout) and the request fails `RejectedBusy`. Only
    /// meaningful before blocks are allocated.
    pub fn reject_busy(&self) {
        self.0.tell(Local::Reject)
    }
}
