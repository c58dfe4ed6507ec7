//! The root actor's rules, as plain data: which request a message is for, what to do with
//! a message for a request not opened yet or already ended, when a request is admitted,
//! and what a request whose actor died leaves behind.
//!
//! [`Router::handle`] takes one [`Input`] at a time, with the time it happens, and returns
//! the [`Action`]s the root actor performs in order: spawn an actor, deliver an event to one,
//! send a control message, arm a timer, fail, release or forget a request. It does no I/O
//! and reads no clock, so property tests drive it directly (`actors/tests/router.rs`). The
//! root actor only shuttles: it turns its mailbox into inputs and actions into calls on the
//! request actors, the [`crate::Link`] and the estates of requests whose actor is gone.
//!
//! What the router remembers, each with a bound:
//! - the live requests (opened, not yet ended) and whether the engine handed their blocks
//!   over (decode's admission control counts those still waiting);
//! - messages for requests not opened yet, and those the transport found invalid (they fail
//!   the request at its open) ([`RouterLimits::pending_requests`] requests,
//!   [`RouterLimits::pending_messages`] each, for the bootstrap timeout);
//! - how requests ended ([`RouterLimits::tombstones`], oldest forgotten), so a late message
//!   is answered instead of buffered as if its request were still to come;
//! - decode requests whose actor died while their blocks could still be written into
//!   (orphans), until the fence bound passes; past it, decode push over a one-sided plane
//!   keeps an orphan's blocks quarantined, as a live request's machine does
//!   ([`Action::Quarantine`]), until every prefill rank that could still write confirms
//!   (`AbortAck` or `Done`) or is reported gone ([`Input::WriterGone`]).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use handoff_transport::{BlockId, FailureReason, RequestId, Role, TransferMode};

use crate::config::{
    PENDING_BYTES_MAX, PENDING_MESSAGES_PER_REQUEST_MAX, PENDING_REQUESTS_MAX, TOMBSTONES_MAX,
};
use crate::event::FenceEnd;
use crate::machine::{Peer, PeerMessage, ReceiverEvent, SenderEvent, State, QUARANTINE_ASK_EVERY};
use crate::tombstones::Tombstones;

/// An event for either machine: the role decides which ([`MachineEvent::for_role`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MachineEvent {
    /// For a prefill request's machine.
    Sender(SenderEvent),
    /// For a decode request's machine.
    Receiver(ReceiverEvent),
}

impl MachineEvent {
    /// What `what` means to a machine of `role`: the one place the role picks the side.
    pub fn for_role(role: Role, what: Local) -> Self {
        match (role, what) {
            (Role::Prefill, Local::HandedOver { blocks, aux }) => {
                Self::Sender(SenderEvent::Input { blocks, aux })
            }
            (Role::Decode, Local::HandedOver { blocks, .. }) => {
                Self::Receiver(ReceiverEvent::Allocated { blocks })
            }
            (Role::Prefill, Local::Abort) => Self::Sender(SenderEvent::Abort),
            (Role::Decode, Local::Abort) => Self::Receiver(ReceiverEvent::Abort),
            // Only decode's handles can reject; a prefill machine drops it as the other
            // side's event.
            (_, Local::Reject) => Self::Receiver(ReceiverEvent::Reject {
                reason: FailureReason::RejectedBusy,
            }),
            (Role::Prefill, Local::Invalid { from, detail }) => {
                Self::Sender(SenderEvent::Unexpected {
                    from,
                    what: format!("invalid message: {detail}"),
                })
            }
            (Role::Decode, Local::Invalid { from, detail }) => {
                Self::Receiver(ReceiverEvent::Unexpected {
                    from,
                    what: format!("invalid message: {detail}"),
                })
            }
            (Role::Prefill, Local::PeerLost { peer }) => {
                Self::Sender(SenderEvent::PeerLost { peer })
            }
            (Role::Decode, Local::PeerLost { peer }) => {
                Self::Receiver(ReceiverEvent::PeerLost { peer })
            }
            // Only decode fences on a writer's confirmation; a prefill machine drops it as
            // the other side's event (the router sends it to decode requests only).
            (_, Local::PeerReplaced { peer }) => {
                Self::Receiver(ReceiverEvent::WriterReplaced { peer })
            }
            (Role::Prefill, Local::Superseded { detail }) => {
                Self::Sender(SenderEvent::Superseded { detail })
            }
            (Role::Decode, Local::Superseded { detail }) => {
                Self::Receiver(ReceiverEvent::Superseded { detail })
            }
        }
    }

    /// What a peer's control message means to a machine of `role`.
    pub fn inbound(role: Role, from: Peer, msg: PeerMessage) -> Self {
        match role {
            Role::Prefill => Self::Sender(match msg {
                PeerMessage::TransferInfo { mode, blocks } => {
                    SenderEvent::TransferInfo { from, mode, blocks }
                }
                PeerMessage::Queued => SenderEvent::Queued { from },
                PeerMessage::Rejected { reason } => SenderEvent::Rejected { from, reason },
                PeerMessage::ReadDone => SenderEvent::ReadDone { from },
                PeerMessage::Abort { reason } => SenderEvent::PeerAbort { from, reason },
                PeerMessage::AbortAck => SenderEvent::AbortAck { from },
                other => SenderEvent::Unexpected {
                    from,
                    what: format!("{other:?}"),
                },
            }),
            Role::Decode => Self::Receiver(match msg {
                PeerMessage::Done { aux } => ReceiverEvent::Done { from, aux },
                PeerMessage::Ready { blocks, aux, hold } => ReceiverEvent::Ready {
                    from,
                    blocks,
                    aux,
                    hold,
                },
                PeerMessage::Abort { reason } => ReceiverEvent::PeerAbort { from, reason },
                PeerMessage::AbortAck => ReceiverEvent::AbortAck { from },
                other => ReceiverEvent::Unexpected {
                    from,
                    what: format!("{other:?}"),
                },
            }),
        }
    }
}

/// Something this worker's engine or control loop says about a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Local {
    /// The engine handed the request's blocks over (`send` on prefill, `allocate` on
    /// decode).
    HandedOver {
        /// The blocks.
        blocks: Vec<BlockId>,
        /// Prefill's payload for decode's engine (empty if none).
        aux: Vec<u8>,
    },
    /// The engine aborted the request.
    Abort,
    /// Decode's engine refuses the request as busy.
    Reject,
    /// A peer sent a malformed or out-of-range message about the request.
    Invalid {
        /// Who sent it.
        from: Peer,
        /// What was wrong with it.
        detail: String,
    },
    /// A peer stopped answering (or could not be sent to).
    PeerLost {
        /// Which.
        peer: Peer,
    },
    /// A lost peer's rank is held by a new process now (`Input::PeerReplaced`).
    PeerReplaced {
        /// Which.
        peer: Peer,
    },
    /// A newer process holds this worker's own rank now (`Input::Superseded`).
    Superseded {
        /// Who holds it, as the directory said.
        detail: String,
    },
}

/// What happens, in the order the root actor learns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// The engine opened a request.
    Open {
        /// Its id.
        id: RequestId,
    },
    /// The engine (or the control loop) says something about one request.
    Local {
        /// Which.
        id: RequestId,
        /// What.
        what: Local,
    },
    /// A peer sent a control message about a request.
    Inbound {
        /// Who.
        from: Peer,
        /// About which request.
        id: RequestId,
        /// What.
        msg: PeerMessage,
    },
    /// A request's machine ended and nothing of it is in flight: `state` is how it ended.
    Ended {
        /// Which.
        id: RequestId,
        /// `Done` or `Failed`.
        state: State,
    },
    /// A request's actor died (a panic, or stopped before its request ended, or it could
    /// not start).
    ActorGone {
        /// Which request.
        id: RequestId,
        /// The request's state then (terminal if it had ended).
        state: State,
        /// Every peer the request had dealt with.
        peers: Vec<Peer>,
        /// Why the actor died.
        why: String,
    },
    /// A peer is gone: every live request that depends on it fails at once.
    PeerLost {
        /// Which.
        peer: Peer,
    },
    /// A new process holds a peer's rank now (a new incarnation), after the old one was
    /// lost (`PeerLost` came first). The new process answers an `Abort` for a request it
    /// never knew with `AbortAck`: for the requests live or orphaned now, that rank's
    /// confirmations speak for the new process, not for the old writer that may still hold
    /// a post, and end no fence or quarantine (only the old one's exit does).
    PeerReplaced {
        /// Which.
        peer: Peer,
    },
    /// A newer process holds this worker's own rank now (the directory says so): new
    /// requests no longer find this one, and peers that know the newer one refuse it.
    /// Every live request fails `Superseded` at once (each machine keeps its fences), and
    /// every request opened from then on is refused with the same reason.
    Superseded {
        /// Who holds the rank now, as the directory said.
        detail: String,
    },
    /// What the driver knows of a writer of a quarantined orphan ([`Action::Quarantine`]):
    /// its process exited (`exited`), or the driver cannot watch it (then the orphan's
    /// blocks go at the bound, as a live request's would).
    WriterGone {
        /// The orphan.
        id: RequestId,
        /// The writer.
        peer: Peer,
        /// Seen to exit (false: not watchable).
        exited: bool,
    },
    /// A timer armed by [`Action::After`] fired.
    Timer(Timer),
}

/// A timer the router asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Timer {
    /// The earliest buffered request's bootstrap deadline: expire what is due.
    ExpirePending,
    /// The fence bound of an orphan has passed: its blocks may go (or, with writers
    /// unconfirmed, are quarantined).
    OrphanDue(RequestId),
    /// A quarantined orphan asks its unconfirmed writers again.
    OrphanAsk(RequestId),
}

/// What the root actor does, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Start the request's actor, feeding it `backlog` first (messages that came before it
    /// was opened, in arrival order); `reject`: decode is saturated, fail it `RejectedBusy`.
    Spawn {
        /// Which request.
        id: RequestId,
        /// Buffered events.
        backlog: Vec<MachineEvent>,
        /// Admission control refuses it.
        reject: bool,
    },
    /// The request ended here before (it is remembered), is open already, or this process
    /// was superseded: it fails at once with `reason`, and no actor runs for it.
    Refuse {
        /// Which.
        id: RequestId,
        /// Why.
        reason: FailureReason,
    },
    /// Hand `event` to the request's actor.
    Deliver {
        /// Which.
        id: RequestId,
        /// What.
        event: MachineEvent,
    },
    /// Send a control message to a peer.
    Send {
        /// Whom.
        to: Peer,
        /// About which request.
        id: RequestId,
        /// What.
        msg: PeerMessage,
    },
    /// Send a control message to every sibling rank (the other ranks of this engine).
    ToSiblings {
        /// About which request.
        id: RequestId,
        /// What.
        msg: PeerMessage,
    },
    /// Feed [`Input::Timer`] back after `delay`.
    After {
        /// How long from now.
        delay: Duration,
        /// Which timer.
        timer: Timer,
    },
    /// Revoke every remote access the request granted (before its blocks can go).
    Revoke {
        /// Which.
        id: RequestId,
    },
    /// Fail the request, if it is still live, with `reason`: `hold` keeps its blocks (an
    /// orphan's, until its fence bound), else they go with it.
    Fail {
        /// Which.
        id: RequestId,
        /// Why.
        reason: FailureReason,
        /// Keep the blocks.
        hold: bool,
    },
    /// An orphan's fence bound passed with these prefill ranks unconfirmed: watch each
    /// one's process where the link can and report it with [`Input::WriterGone`] when it
    /// exits, or at once (`exited: false`) when it cannot be watched. Its blocks stay held
    /// (and counted as quarantined) until [`Action::Release`].
    Quarantine {
        /// The orphan.
        id: RequestId,
        /// The writers.
        peers: Vec<Peer>,
        /// Those of `peers` whose rank a new process holds since ([`Input::PeerReplaced`]):
        /// watch the rank's earlier processes for them, not its current one.
        replaced: Vec<Peer>,
    },
    /// A new process took a quarantined orphan's writer's rank after the quarantine began:
    /// watch the rank's earlier processes as well, and report the writer gone
    /// ([`Input::WriterGone`]) once they have exited.
    WatchEarlier {
        /// The orphan.
        id: RequestId,
        /// The writer.
        peer: Peer,
    },
    /// Release every block the request still holds, as it ended (`fence`: how a fence on
    /// them ended, if one held them).
    Release {
        /// Which.
        id: RequestId,
        /// The fence's end.
        fence: Option<FenceEnd>,
    },
    /// The request ended normally: stop its actor and release what the engine handed over
    /// while it was ending (never seen by its machine).
    Retire {
        /// Which.
        id: RequestId,
    },
    /// The request is settled here: drop what the root keeps for it (its actor handle and
    /// deed to its estate), and free its id for the engine.
    Forget {
        /// Which.
        id: RequestId,
    },
    /// Something an operator should see in the log; changes nothing.
    Note(Note),
}

/// A decision worth a log line (the root actor logs it with the request id and peer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Note {
    /// A message for a request that ended here was answered or dropped.
    Late {
        /// The request.
        id: RequestId,
        /// Who sent it.
        from: Peer,
    },
    /// Too many requests have messages buffered: this one was refused with an abort.
    TooManyPending {
        /// The request.
        id: RequestId,
        /// Who sent it.
        from: Peer,
    },
    /// The messages buffered for requests not opened yet hold too many bytes: this one was
    /// refused with an abort (a new request) or dropped (one already buffered).
    BytesFull {
        /// The request.
        id: RequestId,
        /// Who sent it.
        from: Peer,
        /// What the buffered messages hold.
        held: usize,
        /// What this one would have added.
        bytes: usize,
    },
    /// The request's buffer is full: this message was dropped.
    BufferFull {
        /// The request.
        id: RequestId,
        /// Who sent it.
        from: Peer,
    },
    /// The engine never opened the request before its bootstrap deadline; its peers are told.
    NeverOpened {
        /// The request.
        id: RequestId,
        /// The peers that sent something for it.
        peers: Vec<Peer>,
    },
    /// An orphan's writer confirmed from a new process of its rank ([`Input::PeerReplaced`]):
    /// not the writer's confirmation, so it ended nothing.
    Unconfirmed {
        /// The orphan.
        id: RequestId,
        /// The rank.
        from: Peer,
    },
}

/// The `cause` of a confirmation that came from a writer's replacement, not the writer
/// ([`Note::Unconfirmed`], and a live request's `Action::Unconfirmed`).
pub const REPLACED_WRITER: &str = "replaced_writer";

impl Note {
    /// A short, stable name for what happened (the `cause` label of
    /// `handoff_messages_refused_total`).
    pub fn cause(&self) -> &'static str {
        match self {
            Note::Late { .. } => "late",
            Note::TooManyPending { .. } => "too_many_pending",
            Note::BytesFull { .. } => "bytes_full",
            Note::BufferFull { .. } => "buffer_full",
            Note::NeverOpened { .. } => "never_opened",
            Note::Unconfirmed { .. } => REPLACED_WRITER,
        }
    }
}

/// What a [`Router`] refused, dropped or answered late, counted since it was made: each
/// bound it met, beside the log line its [`Note`] gives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouterStats {
    /// Messages for ended requests, answered or dropped ([`Note::Late`]).
    pub late: u64,
    /// New ids refused: too many requests pending ([`Note::TooManyPending`]).
    pub too_many_pending: u64,
    /// Messages refused or dropped: the buffered bytes at their bound ([`Note::BytesFull`]).
    pub bytes_full: u64,
    /// Messages dropped: the request's buffer full ([`Note::BufferFull`]).
    pub buffer_full: u64,
    /// Requests never opened before their bootstrap deadline ([`Note::NeverOpened`]).
    pub never_opened: u64,
    /// Orphans' confirmations from a writer's replacement ([`Note::Unconfirmed`]).
    pub unconfirmed: u64,
}

impl RouterStats {
    fn count(&mut self, note: &Note) {
        let counter = match note {
            Note::Late { .. } => &mut self.late,
            Note::TooManyPending { .. } => &mut self.too_many_pending,
            Note::BytesFull { .. } => &mut self.bytes_full,
            Note::BufferFull { .. } => &mut self.buffer_full,
            Note::NeverOpened { .. } => &mut self.never_opened,
            Note::Unconfirmed { .. } => &mut self.unconfirmed,
        };
        *counter += 1;
    }
}

/// The router's bounds (defaults: the named limits in [`crate::config`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterLimits {
    /// Requests not opened yet with messages buffered.
    pub pending_requests: usize,
    /// Messages buffered per request not opened yet.
    pub pending_messages: usize,
    /// Bytes of messages buffered for requests not opened yet, all together
    /// ([`PeerMessage::held_bytes`]).
    pub pending_bytes: usize,
    /// Ended requests remembered.
    pub tombstones: usize,
}

impl Default for RouterLimits {
    fn default() -> Self {
        Self {
            pending_requests: PENDING_REQUESTS_MAX,
            pending_messages: PENDING_MESSAGES_PER_REQUEST_MAX,
            pending_bytes: PENDING_BYTES_MAX,
            tombstones: TOMBSTONES_MAX,
        }
    }
}

/// What the router is built from.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// This worker's role.
    pub role: Role,
    /// Decode: push or pull.
    pub mode: TransferMode,
    /// Whether the data plane writes without this side's help (RDMA): a dead decode
    /// request's blocks may then still be written into until the fence bound.
    pub one_sided: bool,
    /// How long messages for a request not opened yet are kept.
    pub bootstrap: Duration,
    /// The fence bound ([`crate::Timeouts::fence_max`]).
    pub fence_max: Duration,
    /// Decode admission control: requests waiting for blocks past which new ones are
    /// rejected (`None`: no limit).
    pub unallocated_max: Option<usize>,
    /// Bounds.
    pub limits: RouterLimits,
}

/// Messages for a request this runtime does not know yet.
#[derive(Debug)]
struct Pending {
    /// Which buffering of the request this is: its entry in `pending_order` carries the
    /// same number (a request opened and buffered again within one instant has two
    /// entries there with the same deadline, and only the later speaks for it).
    seq: u64,
    /// The peers that sent something, to be told if the request is never opened.
    from: Vec<Peer>,
    events: Vec<MachineEvent>,
    /// What `events` hold ([`PeerMessage::held_bytes`]).
    bytes: usize,
    /// Peers of `from` lost since they wrote: the request learns it after their messages.
    lost: Vec<Peer>,
}

impl Pending {
    /// The events a request opened now starts with: its messages, in order, then the loss
    /// of every peer lost since it wrote.
    fn backlog(self, role: Role) -> Vec<MachineEvent> {
        let mut events = self.events;
        events.extend(
            self.lost
                .into_iter()
                .map(|peer| MachineEvent::for_role(role, Local::PeerLost { peer })),
        );
        events
    }
}

/// A live request.
#[derive(Debug)]
struct Live {
    handed_over: bool,
}

/// A decode request whose actor died while a transfer could still land in its blocks.
#[derive(Debug)]
struct Orphan {
    /// Its peers: told when its blocks go.
    peers: Vec<Peer>,
    /// How it failed (what its writers are asked with).
    reason: FailureReason,
    /// The peers that may still write into its blocks and have not confirmed since the
    /// actor died (`AbortAck`, `Done`), nor been reported gone: all of its peers for decode
    /// push over a one-sided plane, none otherwise (only the bound counts then).
    waiting: Vec<Peer>,
    /// Past the bound with writers waited for: held until the last of them goes.
    quarantined: bool,
    /// A writer of the quarantine was let go unwatched: the fence ended at its bound.
    bound_only: bool,
    /// Writers now held by a new process ([`Input::PeerReplaced`]): their confirmations
    /// are not the writer's.
    replaced: Vec<Peer>,
}

/// The root actor's routing rules (module docs).
#[derive(Debug)]
pub struct Router {
    cfg: RouterConfig,
    /// Looked up for every message, walked only on a peer's loss or replacement (then in
    /// id order, sorted there): hashed, with std's keyed hasher (ids a peer chooses cannot
    /// be made to collide), where a B-tree's lookup compared the id with others, each
    /// behind its own pointer.
    live: HashMap<RequestId, Live>,
    /// Live requests whose blocks the engine has not handed over yet (admission control
    /// counts them on every open: kept here rather than counted).
    waiting: usize,
    pending: BTreeMap<RequestId, Pending>,
    /// What every pending request's messages hold, together.
    pending_bytes: usize,
    /// Pending requests in the order they expire (all live for the same bootstrap timeout),
    /// each with its [`Pending::seq`].
    pending_order: VecDeque<(Instant, u64, RequestId)>,
    /// The next [`Pending::seq`].
    pending_seq: u64,
    /// How requests ended, by id (at most `limits.tombstones`, oldest forgotten): looked up
    /// for every message and open, never walked, so hashed.
    tombstones: Tombstones,
    /// Orphans, with the peers to tell when their blocks go.
    orphans: BTreeMap<RequestId, Orphan>,
    /// Once a newer process holds this worker's rank: why every request fails here.
    superseded: Option<FailureReason>,
    stats: RouterStats,
}

/// Tells `from`, who sent what would start a transfer for `id`, that the request ended
/// here (`ended`): its failure, or a protocol error naming the end.
fn ended_abort(id: &RequestId, ended: &State, from: &Peer) -> Action {
    let reason = ended.failure().cloned().unwrap_or(FailureReason::Protocol {
        detail: format!("request {id} already ended ({ended})"),
    });
    Action::Send {
        to: from.clone(),
        id: id.clone(),
        msg: PeerMessage::Abort { reason },
    }
}

impl Router {
    /// A router with nothing open.
    pub fn new(cfg: RouterConfig) -> Self {
        let tombstones = Tombstones::new(cfg.limits.tombstones);
        Self {
            cfg,
            live: HashMap::new(),
            waiting: 0,
            pending: BTreeMap::new(),
            pending_bytes: 0,
            pending_order: VecDeque::new(),
            pending_seq: 0,
            tombstones,
            orphans: BTreeMap::new(),
            superseded: None,
            stats: RouterStats::default(),
        }
    }

    /// Handles one input at `now`; the actions to perform, in order.
    pub fn handle(&mut self, now: Instant, input: Input) -> Vec<Action> {
        let mut out = Vec::new();
        self.handle_into(now, input, &mut out);
        out
    }

    /// As [`Router::handle`], the actions appended to `out` (a buffer the caller reuses:
    /// most inputs decide one or two actions, and the root handles one per message).
    pub fn handle_into(&mut self, now: Instant, input: Input, out: &mut Vec<Action>) {
        let start = out.len();
        self.decide(now, input, out);
        for action in &out[start..] {
            if let Action::Note(note) = action {
                self.stats.count(note);
            }
        }
    }

    fn decide(&mut self, now: Instant, input: Input, out: &mut Vec<Action>) {
        match input {
            Input::Open { id } => self.open(id, out),
            Input::Local { id, what } => {
                let Some(live) = self.live.get_mut(&id) else {
                    if let Local::Invalid { from, detail } = what {
                        self.invalid_before_open(now, from, id, detail, out);
                    }
                    return;
                };
                if matches!(what, Local::HandedOver { .. }) && !live.handed_over {
                    live.handed_over = true;
                    self.waiting = self.waiting.saturating_sub(1);
                }
                let event = MachineEvent::for_role(self.cfg.role, what);
                out.push(Action::Deliver { id, event });
            }
            Input::Inbound { from, id, msg } => self.inbound(now, from, id, msg, out),
            Input::Ended { id, state } => {
                if self.remove_live(&id) {
                    out.push(Action::Retire { id: id.clone() });
                    self.bury(id, state, out);
                }
            }
            Input::ActorGone {
                id,
                state,
                peers,
                why,
            } => self.actor_gone(id, state, peers, why, out),
            Input::PeerLost { peer } => {
                // Every live request is told; its machine alone knows whether it depends
                // on the peer (`depends_on`) and fails `PeerLost` at once if it does.
                for id in self.live_sorted() {
                    let what = Local::PeerLost { peer: peer.clone() };
                    out.push(Action::Deliver {
                        id: id.clone(),
                        event: MachineEvent::for_role(self.cfg.role, what),
                    });
                }
                // A request not opened yet that holds the peer's messages learns of the loss
                // after them: its machine must not act on what a lost peer said (a transfer
                // info names blocks that peer's process no longer holds; a restarted one
                // under the same rank would take the writes).
                for pending in self.pending.values_mut() {
                    if pending.from.contains(&peer) && !pending.lost.contains(&peer) {
                        pending.lost.push(peer.clone());
                    }
                }
            }
            Input::PeerReplaced { peer } => self.peer_replaced(peer, out),
            Input::Superseded { detail } => {
                if self.superseded.is_some() {
                    return;
                }
                self.superseded = Some(FailureReason::Superseded {
                    detail: detail.clone(),
                });
                for id in self.live_sorted() {
                    let what = Local::Superseded {
                        detail: detail.clone(),
                    };
                    out.push(Action::Deliver {
                        id: id.clone(),
                        event: MachineEvent::for_role(self.cfg.role, what),
                    });
                }
            }
            Input::Timer(Timer::ExpirePending) => self.expire_pending(now, out),
            Input::Timer(Timer::OrphanDue(id)) => self.orphan_due(id, out),
            Input::Timer(Timer::OrphanAsk(id)) => self.orphan_ask(id, out),
            Input::WriterGone { id, peer, exited } => {
                let Some(orphan) = self.orphans.get_mut(&id).filter(|o| o.quarantined) else {
                    return;
                };
                if orphan.waiting.contains(&peer) {
                    orphan.bound_only |= !exited;
                    self.orphan_let_go(id, &peer, out);
                }
            }
        }
    }

    /// What the router refused, dropped or answered late so far (each also a [`Note`]).
    pub fn stats(&self) -> RouterStats {
        self.stats
    }

    /// Live requests, in id order.
    pub fn live(&self) -> impl Iterator<Item = &RequestId> {
        self.live_sorted().into_iter()
    }

    /// Live requests, in id order (what is done to each must not depend on the hasher).
    fn live_sorted(&self) -> Vec<&RequestId> {
        let mut ids: Vec<&RequestId> = self.live.keys().collect();
        ids.sort_unstable();
        ids
    }

    /// Whether `id` is live here.
    pub fn is_live(&self, id: &RequestId) -> bool {
        self.live.contains_key(id)
    }

    /// Orphans held for their fence bound, in id order.
    pub fn orphans(&self) -> impl Iterator<Item = &RequestId> {
        self.orphans.keys()
    }

    /// How `id` ended here, if it did and is still remembered.
    pub fn ended(&self, id: &RequestId) -> Option<&State> {
        self.tombstones.get(id)
    }

    /// Requests with messages buffered, and the most messages buffered for one of them.
    pub fn pending(&self) -> (usize, usize) {
        let most = self.pending.values().map(|p| p.events.len()).max();
        (self.pending.len(), most.unwrap_or(0))
    }

    /// Bytes the buffered messages hold, together ([`PeerMessage::held_bytes`]).
    pub fn pending_bytes(&self) -> usize {
        self.pending_bytes
    }

    /// Removes a pending request's buffer, and its bytes from the total.
    fn take_pending(&mut self, id: &RequestId) -> Option<Pending> {
        let p = self.pending.remove(id)?;
        self.pending_bytes -= p.bytes;
        Some(p)
    }

    /// Ended requests remembered.
    pub fn remembered(&self) -> usize {
        self.tombstones.len()
    }

    fn open(&mut self, id: RequestId, out: &mut Vec<Action>) {
        if let Some(reason) = &self.superseded {
            // No peer would pair with this process any more: it fails now, by name,
            // rather than at its bootstrap deadline.
            let reason = reason.clone();
            out.push(Action::Refuse { id, reason });
            return;
        }
        if let Some(ended) = self.tombstones.get(&id) {
            // Ended here already (or, on prefill, never opened before its bootstrap deadline,
            // with decode told that nothing of ours would be written): it fails at once,
            // rather than act on messages that would break that promise.
            let reason = ended.failure().cloned().unwrap_or(FailureReason::Protocol {
                detail: format!("request {id} already ended here ({ended})"),
            });
            out.push(Action::Refuse { id, reason });
            return;
        }
        if self.live.contains_key(&id) || self.orphans.contains_key(&id) {
            // (An orphan's id stays taken until its blocks go, even once its tombstone is
            // forgotten.)
            let reason = FailureReason::Protocol {
                detail: format!("request {id} is already open here"),
            };
            out.push(Action::Refuse { id, reason });
            return;
        }
        let role = self.cfg.role;
        let backlog = self
            .take_pending(&id)
            .map(|p| p.backlog(role))
            .unwrap_or_default();
        let reject = self.cfg.role == Role::Decode
            && self
                .cfg
                .unallocated_max
                .is_some_and(|max| self.waiting >= max);
        self.live.insert(id.clone(), Live { handed_over: false });
        self.waiting += 1;
        out.push(Action::Spawn {
            id,
            backlog,
            reject,
        });
    }

    /// Ends a live request here; false if it was not live.
    fn remove_live(&mut self, id: &RequestId) -> bool {
        let Some(live) = self.live.remove(id) else {
            return false;
        };
        if !live.handed_over {
            self.waiting = self.waiting.saturating_sub(1);
        }
        true
    }

    /// Routes a peer's message: to the live request, or an answer for an ended one, or a
    /// bounded buffer for one the engine has not opened yet.
    fn inbound(
        &mut self,
        now: Instant,
        from: Peer,
        id: RequestId,
        msg: PeerMessage,
        out: &mut Vec<Action>,
    ) {
        if matches!(msg, PeerMessage::AbortAck | PeerMessage::Done { .. }) {
            self.orphan_confirmed(id.clone(), &from, out);
        }
        if self.live.contains_key(&id) {
            // Looked up first: most messages are for live requests, and a live id is never
            // remembered as ended (`open` refuses one, and both ends remove it from `live`
            // before burying it).
            let event = MachineEvent::inbound(self.cfg.role, from, msg);
            out.push(Action::Deliver { id, event });
            return;
        }
        if let Some(ended) = self.tombstones.get(&id) {
            if matches!(
                msg,
                PeerMessage::TransferInfo { .. } | PeerMessage::Ready { .. }
            ) {
                out.push(ended_abort(&id, ended, &from));
            }
            // A request buried here is settled: no write of ours for it is in flight, so a
            // decode rank fencing its blocks can have its acknowledgement at once.
            // (Not an orphan, whose dead actor may have left a transfer in flight: it is
            // acknowledged when its fence bound passes.)
            if matches!(msg, PeerMessage::Abort { .. }) && !self.orphans.contains_key(&id) {
                out.push(Action::Send {
                    to: from.clone(),
                    id: id.clone(),
                    msg: PeerMessage::AbortAck,
                });
            }
            out.push(Action::Note(Note::Late { id, from }));
            return;
        }
        let is_abort = matches!(msg, PeerMessage::Abort { .. });
        let bytes = msg.held_bytes();
        let event = MachineEvent::inbound(self.cfg.role, from.clone(), msg);
        if is_abort && self.cfg.role == Role::Prefill {
            // Not opened here yet, so nothing of ours was written: decode may release now.
            // (The abort is still buffered: the request fails as soon as it is opened.)
            out.push(Action::Send {
                to: from.clone(),
                id: id.clone(),
                msg: PeerMessage::AbortAck,
            });
        }
        self.buffer(now, from, id, (event, bytes), out);
    }

    /// A peer's message about a request not live here, found invalid by the transport
    /// (decode's transfer info for blocks that do not pair with ours, before the engine
    /// opened the request): it is what a valid message would have been, so it is answered
    /// as one: an ended request's peer is told it ended, and for one not opened yet it is
    /// buffered, failing the request by name at its open (which tells the peer), or told
    /// to the peer at the buffer's expiry. Dropped, it left the peer waiting out its own
    /// deadline for an answer that never came (found by the Python layouts test on a
    /// loaded machine: decode `WaitingForInput` for 30 s).
    fn invalid_before_open(
        &mut self,
        now: Instant,
        from: Peer,
        id: RequestId,
        detail: String,
        out: &mut Vec<Action>,
    ) {
        if let Some(ended) = self.tombstones.get(&id) {
            out.push(ended_abort(&id, ended, &from));
            out.push(Action::Note(Note::Late { id, from }));
            return;
        }
        let what = Local::Invalid {
            from: from.clone(),
            detail,
        };
        let event = MachineEvent::for_role(self.cfg.role, what);
        self.buffer(now, from, id, (event, 0), out);
    }

    fn buffer(
        &mut self,
        now: Instant,
        from: Peer,
        id: RequestId,
        (event, bytes): (MachineEvent, usize),
        out: &mut Vec<Action>,
    ) {
        self.expire_pending(now, out);
        let fits = self.pending_bytes + bytes <= self.cfg.limits.pending_bytes;
        let too_many = Note::BytesFull {
            id: id.clone(),
            from: from.clone(),
            held: self.pending_bytes,
            bytes,
        };
        if !self.pending.contains_key(&id) {
            let full = self.pending.len() >= self.cfg.limits.pending_requests;
            if full || !fits {
                let (detail, note) = if full {
                    let note = Note::TooManyPending {
                        id: id.clone(),
                        from: from.clone(),
                    };
                    ("too many requests pending creation".to_string(), note)
                } else {
                    let detail = format!(
                        "messages for requests pending creation would hold more than {} bytes",
                        self.cfg.limits.pending_bytes
                    );
                    (detail, too_many)
                };
                let reason = FailureReason::Internal { detail };
                out.push(Action::Note(note));
                let msg = PeerMessage::Abort { reason };
                out.push(Action::Send { to: from, id, msg });
                return;
            }
            let expires = now + self.cfg.bootstrap;
            let seq = self.pending_seq;
            self.pending_seq += 1;
            let fresh = Pending {
                seq,
                from: Vec::new(),
                events: Vec::new(),
                bytes: 0,
                lost: Vec::new(),
            };
            self.pending.insert(id.clone(), fresh);
            self.pending_order.push_back((expires, seq, id.clone()));
            // One timer per buffered request (bounded like the buffer), so an unopened
            // request is answered at its deadline even if nothing else arrives.
            out.push(Action::After {
                delay: self.cfg.bootstrap,
                timer: Timer::ExpirePending,
            });
        }
        let Some(pending) = self.pending.get_mut(&id) else {
            return;
        };
        if pending.events.len() >= self.cfg.limits.pending_messages {
            out.push(Action::Note(Note::BufferFull { id, from }));
            return;
        }
        if !fits {
            out.push(Action::Note(too_many));
            return;
        }
        if !pending.from.contains(&from) {
            pending.from.push(from);
        }
        pending.events.push(event);
        pending.bytes += bytes;
        self.pending_bytes += bytes;
    }

    /// Drops messages for requests the engine never opened within the bootstrap timeout,
    /// and tells their senders (instead of leaving them to their own deadlines).
    fn expire_pending(&mut self, now: Instant, out: &mut Vec<Action>) {
        while let Some((expires, _, _)) = self.pending_order.front() {
            if *expires > now {
                return;
            }
            let Some((_, seq, id)) = self.pending_order.pop_front() else {
                return;
            };
            // Opened since (entry gone) or buffered again later: nothing to expire.
            if self.pending.get(&id).is_none_or(|p| p.seq != seq) {
                continue;
            }
            let Some(p) = self.take_pending(&id) else {
                continue;
            };
            let note = Note::NeverOpened {
                id: id.clone(),
                peers: p.from.clone(),
            };
            out.push(Action::Note(note));
            if self.cfg.role == Role::Prefill {
                // We tell decode nothing of ours will be written: keep that true if the
                // engine opens the request after all, or its messages come late (found by
                // the simulator: a late transfer info buffered again, the engine opened
                // the request, and prefill wrote into blocks decode had reused).
                self.tombstones
                    .insert(id.clone(), State::Failed(FailureReason::BootstrapTimeout));
            }
            for to in p.from {
                let abort = PeerMessage::Abort {
                    reason: FailureReason::BootstrapTimeout,
                };
                out.push(Action::Send {
                    to: to.clone(),
                    id: id.clone(),
                    msg: abort,
                });
                if self.cfg.role == Role::Prefill {
                    // Never opened here: nothing of ours was written (after the abort).
                    let msg = PeerMessage::AbortAck;
                    let id = id.clone();
                    out.push(Action::Send { to, id, msg });
                }
            }
        }
    }

    /// A request's actor died: the request fails (if it had not ended), its peers are told,
    /// and its blocks go now, or after the fence bound if a write or read it started may
    /// still land in them.
    fn actor_gone(
        &mut self,
        id: RequestId,
        state: State,
        peers: Vec<Peer>,
        why: String,
        out: &mut Vec<Action>,
    ) {
        if !self.remove_live(&id) {
            return;
        }
        let reason = FailureReason::Internal { detail: why };
        // With one-sided writes, a decode request's blocks may still be written into by a
        // prefill rank, and on any plane a pull decode's own read in flight copies into
        // them; the fence that tracked either died with the actor: hold them for the whole
        // fence bound instead of releasing now (found by the simulator: a dead pull
        // request's read landed in blocks the engine had reused).
        let orphan = self.cfg.one_sided
            || (self.cfg.role == Role::Decode && self.cfg.mode == TransferMode::Pull);
        // Revoke this request's grants before its blocks go, as its actor would have (found
        // by the simulator running the real grant table: a late write passed the dead
        // request's grant and landed in blocks the engine had reused).
        out.push(Action::Revoke { id: id.clone() });
        let state = if state.is_terminal() {
            state
        } else {
            out.push(Action::Fail {
                id: id.clone(),
                reason: reason.clone(),
                hold: orphan,
            });
            for to in &peers {
                let msg = PeerMessage::Abort {
                    reason: reason.clone(),
                };
                out.push(Action::Send {
                    to: to.clone(),
                    id: id.clone(),
                    msg,
                });
            }
            State::Failed(reason.clone())
        };
        if orphan {
            let writes_land = self.cfg.one_sided
                && self.cfg.role == Role::Decode
                && self.cfg.mode == TransferMode::Push;
            let reason = state.failure().cloned().unwrap_or(reason);
            let waiting = if writes_land {
                peers.clone()
            } else {
                Vec::new()
            };
            let orphan = Orphan {
                peers,
                reason,
                waiting,
                quarantined: false,
                bound_only: false,
                replaced: Vec::new(),
            };
            self.orphans.insert(id.clone(), orphan);
            out.push(Action::After {
                delay: self.cfg.fence_max,
                timer: Timer::OrphanDue(id.clone()),
            });
        } else {
            out.push(Action::Release {
                id: id.clone(),
                fence: None,
            });
        }
        self.bury(id, state, out);
    }

    /// An orphan's fence bound passed. Its blocks go, unless prefill ranks that could still
    /// write into them have not confirmed: those are quarantined, as a live request's
    /// machine quarantines its lost writers (a writer stopped between its lease check and
    /// its post lands that post whenever it resumes, and no time bound covers that), asked
    /// at once and every [`QUARANTINE_ASK_EVERY`], and watched by the driver.
    fn orphan_due(&mut self, id: RequestId, out: &mut Vec<Action>) {
        let Some(orphan) = self.orphans.get_mut(&id).filter(|o| !o.quarantined) else {
            return; // gone, or quarantined already (no timer releases a quarantine)
        };
        if orphan.waiting.is_empty() {
            return self.release_orphan(id, FenceEnd::Bound, out);
        }
        orphan.quarantined = true;
        let replaced = orphan
            .waiting
            .iter()
            .filter(|p| orphan.replaced.contains(p))
            .cloned()
            .collect();
        out.push(Action::Quarantine {
            id: id.clone(),
            peers: orphan.waiting.clone(),
            replaced,
        });
        self.orphan_ask(id, out);
    }

    /// A quarantined orphan asks each writer still unconfirmed to confirm (its `AbortAck`
    /// may have gone to the dead actor, or been lost with its connection), and again later.
    fn orphan_ask(&mut self, id: RequestId, out: &mut Vec<Action>) {
        let Some(orphan) = self.orphans.get(&id).filter(|o| o.quarantined) else {
            return;
        };
        // (A replaced writer's new process would only answer for itself.)
        for to in orphan
            .waiting
            .iter()
            .filter(|p| !orphan.replaced.contains(p))
        {
            let msg = PeerMessage::Abort {
                reason: orphan.reason.clone(),
            };
            out.push(Action::Send {
                to: to.clone(),
                id: id.clone(),
                msg,
            });
        }
        out.push(Action::After {
            delay: QUARANTINE_ASK_EVERY,
            timer: Timer::OrphanAsk(id),
        });
    }

    /// A new process holds `peer`'s rank: decode's live requests are told (their machines
    /// know which of them the old process could still write for), and orphans waiting for
    /// it stop taking its confirmations.
    fn peer_replaced(&mut self, peer: Peer, out: &mut Vec<Action>) {
        if self.cfg.role != Role::Decode {
            return; // only decode fences on a writer's confirmation
        }
        for id in self.live_sorted() {
            let what = Local::PeerReplaced { peer: peer.clone() };
            out.push(Action::Deliver {
                id: id.clone(),
                event: MachineEvent::for_role(self.cfg.role, what),
            });
        }
        for (id, orphan) in &mut self.orphans {
            if orphan.waiting.contains(&peer) && !orphan.replaced.contains(&peer) {
                orphan.replaced.push(peer.clone());
                if orphan.quarantined {
                    out.push(Action::WatchEarlier {
                        id: id.clone(),
                        peer: peer.clone(),
                    });
                }
            }
        }
    }

    /// An orphan's peer confirmed (`AbortAck`, `Done`): the orphan stops waiting for it,
    /// unless the confirmation came from a new process of its rank.
    fn orphan_confirmed(&mut self, id: RequestId, from: &Peer, out: &mut Vec<Action>) {
        let replaced = self
            .orphans
            .get(&id)
            .is_some_and(|o| o.replaced.contains(from));
        if replaced {
            out.push(Action::Note(Note::Unconfirmed {
                id,
                from: from.clone(),
            }));
            return;
        }
        self.orphan_let_go(id, from, out);
    }

    /// The orphan stops waiting for `peer`: it confirmed it writes nothing more
    /// (`AbortAck`, `Done`; before the bound it is then not waited for), or in quarantine it
    /// was reported gone. Once no writer that could still land is left, the blocks go.
    fn orphan_let_go(&mut self, id: RequestId, peer: &Peer, out: &mut Vec<Action>) {
        let Some(orphan) = self.orphans.get_mut(&id) else {
            return;
        };
        let before = orphan.waiting.len();
        orphan.waiting.retain(|p| p != peer);
        if orphan.waiting.len() == before || !orphan.waiting.is_empty() {
            return;
        }
        let end = if orphan.bound_only {
            FenceEnd::Bound
        } else {
            FenceEnd::Confirmed
        };
        self.release_orphan(id, end, out);
    }

    /// An orphan's blocks go, its peers are told that nothing of it is in flight, and it
    /// is forgotten.
    fn release_orphan(&mut self, id: RequestId, fence: FenceEnd, out: &mut Vec<Action>) {
        let Some(orphan) = self.orphans.remove(&id) else {
            return;
        };
        out.push(Action::Release {
            id: id.clone(),
            fence: Some(fence),
        });
        // Whatever the dead actor left in flight has ended by now.
        for to in orphan.peers {
            let msg = PeerMessage::AbortAck;
            out.push(Action::Send {
                to,
                id: id.clone(),
                msg,
            });
        }
        out.push(Action::Forget { id });
    }

    /// Remembers an ended request, tells sibling ranks if it failed here, and (unless it is
    /// an orphan, forgotten when its fence bound passes) frees its id.
    fn bury(&mut self, id: RequestId, state: State, out: &mut Vec<Action>) {
        if let State::Failed(reason) = &state {
            if !matches!(reason, FailureReason::AbortedByPeer { .. }) {
                let msg = PeerMessage::Abort {
                    reason: reason.clone(),
                };
                out.push(Action::ToSiblings {
                    id: id.clone(),
                    msg,
                });
            }
        }
        self.tombstones.insert(id.clone(), state);
        if !self.orphans.contains_key(&id) {
            out.push(Action::Forget { id });
        }
    }
}
