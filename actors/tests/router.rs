//! Property tests of the router (`handoff_actors::router`): the root actor's rules, driven
//! as plain data against a model of what they must be, on both roles, both modes, one- and
//! two-sided planes, with and without admission control, under small bounds.
//!
//! - Bounds: requests buffered, messages buffered per request and ended requests
//!   remembered never exceed their limits.
//! - A request is spawned only when opened and not live; events are delivered only to live
//!   requests.
//! - Ended requests never come back: while one is remembered, opening it again is refused
//!   and a message for it is only answered (an abort for transfer info or `Ready`, an
//!   acknowledgement for an abort unless its blocks are still held as an orphan), never
//!   delivered or buffered.
//! - A request opened after messages for it arrived gets exactly those messages, in order
//!   (as many as the per-request bound keeps); one never opened is answered at its bootstrap
//!   deadline: every peer that wrote gets an abort (and, on prefill, an acknowledgement:
//!   nothing of ours was written), and on prefill the id is remembered as failed.
//! - A lost peer reaches every live request exactly once, and every request not opened yet
//!   that it wrote to once that request opens (after its messages), and nothing else.
//! - Decode's admission control rejects an opened request exactly when as many live
//!   requests as its limit still wait for their blocks.
//! - A request whose actor died fails (if it had not ended), its grants are revoked before
//!   anything else, its peers are told, and its blocks go at once or, where a transfer may
//!   still land in them, only when the fence bound passes (then its peers get an
//!   acknowledgement); sibling ranks hear of every failure not caused by a peer's abort.
//! - Decode push over a one-sided plane: an orphan's blocks go before the bound only once
//!   every peer confirmed (`AbortAck`, `Done`); past it, the peers still unconfirmed are
//!   quarantined (watched, asked at once and again every interval), and its blocks go only
//!   once each of them confirmed or was reported gone, never on a timer. A writer whose rank
//!   a new process took (`PeerReplaced`) confirms no more (its new process answers for
//!   itself) and is not asked: only its report as gone lets it go. Decode's live requests
//!   are each told of the new process once.
//! - Every request that ends is forgotten exactly once.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use handoff_actors::event::FenceEnd;
use handoff_actors::machine::{
    Peer, PeerMessage, ReceiverEvent, SenderEvent, State, QUARANTINE_ASK_EVERY,
};
use handoff_actors::router::{
    Action, Input, Local, MachineEvent, Note, Router, RouterConfig, RouterLimits, RouterStats,
    Timer,
};
use handoff_transport::{BlockId, FailureReason, RankInfo, RequestId, Role, TransferMode};
use proptest::prelude::*;

const BOOTSTRAP: Duration = Duration::from_millis(100);
const FENCE: Duration = Duration::from_millis(250);
const LIMITS: RouterLimits = RouterLimits {
    pending_requests: 3,
    pending_messages: 2,
    // Binds before the count bounds do (a transfer info names 64 blocks here).
    pending_bytes: 900,
    tombstones: 4,
};

fn peer(i: u8) -> Peer {
    RankInfo::single(format!("P{i}").as_str())
}

fn rid(i: u8) -> RequestId {
    RequestId::new(format!("r{i}"))
}

#[derive(Clone, Copy, Debug)]
enum Msg {
    TransferInfo,
    Ready,
    Done,
    Abort,
    AbortAck,
    Queued,
    /// A message the transport found invalid (transfer info whose blocks do not pair):
    /// it reaches the router as the local event that fails the request by name.
    Invalid,
}

impl Msg {
    /// What the router is fed when `from` sends this about `id`.
    fn input(self, from: Peer, id: RequestId) -> Input {
        match self {
            Msg::Invalid => Input::Local {
                id,
                what: Local::Invalid {
                    from,
                    detail: "blocks do not pair".into(),
                },
            },
            m => Input::Inbound {
                from,
                id,
                msg: m.outbound(),
            },
        }
    }

    /// The event its request's machine gets.
    fn event(self, role: Role, from: Peer) -> MachineEvent {
        match self {
            Msg::Invalid => MachineEvent::for_role(
                role,
                Local::Invalid {
                    from,
                    detail: "blocks do not pair".into(),
                },
            ),
            m => MachineEvent::inbound(role, from, m.outbound()),
        }
    }

    /// What buffering it holds ([`PeerMessage::held_bytes`]).
    fn held_bytes(self) -> usize {
        match self {
            Msg::Invalid => 0,
            m => m.outbound().held_bytes(),
        }
    }

    fn outbound(self) -> PeerMessage {
        match self {
            Msg::TransferInfo => PeerMessage::TransferInfo {
                mode: TransferMode::Push,
                blocks: (0..64).map(BlockId).collect(),
            },
            Msg::Ready => PeerMessage::Ready {
                blocks: Vec::new(),
                aux: Vec::new(),
                hold: Duration::from_secs(1),
            },
            Msg::Done => PeerMessage::Done { aux: Vec::new() },
            Msg::Abort => PeerMessage::Abort {
                reason: FailureReason::RejectedBusy,
            },
            Msg::AbortAck => PeerMessage::AbortAck,
            Msg::Queued | Msg::Invalid => PeerMessage::Queued,
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Open(u8),
    HandOver(u8),
    Abort(u8),
    Inbound(u8, u8, Msg),
    /// The request's machine ended: done, failed, or failed by a peer's abort.
    End(u8, u8),
    /// The request's actor died; `true`: after its request had ended.
    Die(u8, bool),
    Lose(u8),
    /// The driver reports a quarantined writer gone (`true`: exited; `false`: unwatched).
    WriterGone(u8, u8, bool),
    /// A new process took the peer's rank.
    Replace(u8),
    /// A newer process took this worker's own rank (only in setups that allow it).
    Supersede,
    Wait(u64),
}

fn op() -> impl Strategy<Value = Op> {
    let msg = prop_oneof![
        Just(Msg::TransferInfo),
        Just(Msg::Ready),
        Just(Msg::Done),
        Just(Msg::Abort),
        Just(Msg::AbortAck),
        Just(Msg::Queued),
        Just(Msg::Invalid),
    ];
    prop_oneof![
        3 => (0u8..6).prop_map(Op::Open),
        2 => (0u8..6).prop_map(Op::HandOver),
        1 => (0u8..6).prop_map(Op::Abort),
        5 => (0u8..3, 0u8..6, msg).prop_map(|(p, i, m)| Op::Inbound(p, i, m)),
        2 => (0u8..6, 0u8..3).prop_map(|(i, how)| Op::End(i, how)),
        1 => (0u8..6, any::<bool>()).prop_map(|(i, ended)| Op::Die(i, ended)),
        1 => (0u8..3).prop_map(Op::Lose),
        1 => (0u8..3, 0u8..6, any::<bool>()).prop_map(|(p, i, e)| Op::WriterGone(p, i, e)),
        1 => (0u8..3).prop_map(Op::Replace),
        1 => Just(Op::Supersede),
        2 => (1u64..150).prop_map(Op::Wait),
    ]
}

#[derive(Clone, Debug)]
struct Setup {
    role: Role,
    mode: TransferMode,
    one_sided: bool,
    unallocated_max: Option<usize>,
    /// Whether a newer process may take this worker's rank in the run (a quarter of
    /// them: the rest run every op on requests that can still open).
    supersedes: bool,
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        prop_oneof![Just(Role::Prefill), Just(Role::Decode)],
        prop_oneof![Just(TransferMode::Push), Just(TransferMode::Pull)],
        any::<bool>(),
        prop_oneof![Just(None), (0usize..3).prop_map(Some)],
        prop_oneof![3 => Just(false), 1 => Just(true)],
    )
        .prop_map(
            |(role, mode, one_sided, unallocated_max, supersedes)| Setup {
                role,
                mode,
                one_sided,
                unallocated_max,
                supersedes,
            },
        )
}

/// Messages for a request not opened yet.
struct Buffered {
    deadline: Instant,
    order: u64,
    senders: Vec<Peer>,
    events: Vec<MachineEvent>,
    bytes: usize,
    /// Senders lost since they wrote: their loss follows the messages.
    lost: Vec<Peer>,
}

/// What the model expects the router to hold.
#[derive(Default)]
struct Model {
    /// Live requests: handed over yet?
    live: BTreeMap<RequestId, bool>,
    /// Messages for requests not opened yet.
    pending: BTreeMap<RequestId, Buffered>,
    /// Requests buffered so far (their order among equal deadlines).
    buffered: u64,
    /// Orphans.
    orphans: BTreeMap<RequestId, OrphanModel>,
    /// Requests ended and not yet forgotten.
    unforgotten: BTreeSet<RequestId>,
    /// Orphans' confirmations from a replaced writer, so far.
    unconfirmed: u64,
    /// A newer process took this worker's rank.
    superseded: bool,
}

/// An orphan as the model sees it.
struct OrphanModel {
    peers: Vec<Peer>,
    /// Confirmed before the bound.
    confirmed: BTreeSet<Peer>,
    /// Past the bound: writers still held for.
    quarantine: Option<BTreeSet<Peer>>,
    bound_only: bool,
    /// Writers still waited for when a new process took their rank.
    replaced: BTreeSet<Peer>,
}

impl OrphanModel {
    /// Whether the orphan still waits for `peer` (writes landing).
    fn waits_for(&self, peer: &Peer) -> bool {
        match &self.quarantine {
            Some(left) => left.contains(peer),
            None => self.peers.contains(peer) && !self.confirmed.contains(peer),
        }
    }
}

struct Harness {
    setup: Setup,
    router: Router,
    model: Model,
    now: Instant,
    timers: Vec<(Instant, Timer)>,
}

impl Harness {
    fn new(setup: Setup) -> Self {
        let router = Router::new(RouterConfig {
            role: setup.role,
            mode: setup.mode,
            one_sided: setup.one_sided,
            bootstrap: BOOTSTRAP,
            fence_max: FENCE,
            unallocated_max: setup.unallocated_max,
            limits: LIMITS,
        });
        Self {
            setup,
            router,
            model: Model::default(),
            now: Instant::now(),
            timers: Vec::new(),
        }
    }

    fn orphaning(&self) -> bool {
        self.setup.one_sided
            || (self.setup.role == Role::Decode && self.setup.mode == TransferMode::Pull)
    }

    /// Decode push over a one-sided plane: an orphan's prefill ranks may still write.
    fn writes_land(&self) -> bool {
        self.setup.one_sided
            && self.setup.role == Role::Decode
            && self.setup.mode == TransferMode::Push
    }

    /// What releasing an orphan looks like: its blocks, an acknowledgement to each peer,
    /// and the id forgotten.
    fn orphan_released(&mut self, id: &RequestId, fence: FenceEnd) -> Vec<Action> {
        let Some(orphan) = self.model.orphans.remove(id) else {
            return Vec::new();
        };
        assert!(self.model.unforgotten.remove(id));
        let mut expect = vec![Action::Release {
            id: id.clone(),
            fence: Some(fence),
        }];
        for to in orphan.peers {
            expect.push(Action::Send {
                to,
                id: id.clone(),
                msg: PeerMessage::AbortAck,
            });
        }
        expect.push(Action::Forget { id: id.clone() });
        expect
    }

    /// A peer's `AbortAck` or `Done` for an orphan whose writers may land: it no longer
    /// holds the blocks; the last one releases them.
    fn orphan_confirmed(&mut self, id: &RequestId, from: &Peer) -> Vec<Action> {
        if !self.writes_land() {
            return Vec::new();
        }
        let Some(orphan) = self.model.orphans.get_mut(id) else {
            return Vec::new();
        };
        if !orphan.peers.contains(from) {
            return Vec::new();
        }
        if orphan.replaced.contains(from) {
            // Its new process answered: counted, and nothing else.
            self.model.unconfirmed += 1;
            return Vec::new();
        }
        let left = match &mut orphan.quarantine {
            Some(left) => {
                left.remove(from);
                !left.is_empty()
            }
            None => {
                orphan.confirmed.insert(from.clone());
                orphan.peers.iter().any(|p| !orphan.confirmed.contains(p))
            }
        };
        if left {
            return Vec::new();
        }
        let end = if orphan.bound_only {
            FenceEnd::Bound
        } else {
            FenceEnd::Confirmed
        };
        self.orphan_released(id, end)
    }

    /// A quarantined orphan's asks: an abort to each writer still held for, and the next.
    fn orphan_asks(&self, id: &RequestId) -> Vec<Action> {
        let Some(left) = self
            .model
            .orphans
            .get(id)
            .and_then(|o| o.quarantine.as_ref())
        else {
            return Vec::new();
        };
        // The peers in the order the orphan holds them (its peers' order); not a replaced
        // one's new process.
        let orphan = &self.model.orphans[id];
        let mut expect: Vec<Action> = orphan
            .peers
            .iter()
            .filter(|p| left.contains(p) && !orphan.replaced.contains(p))
            .map(|to| Action::Send {
                to: to.clone(),
                id: id.clone(),
                msg: PeerMessage::Abort {
                    reason: FailureReason::Internal {
                        detail: "injected".into(),
                    },
                },
            })
            .collect();
        expect.push(Action::After {
            delay: QUARANTINE_ASK_EVERY,
            timer: Timer::OrphanAsk(id.clone()),
        });
        expect
    }

    /// Feeds one input; collects the timers it arms and checks the bounds.
    fn feed(&mut self, input: Input) -> Vec<Action> {
        // Notes only log and count: the rules are in the other actions.
        let before = self.router.stats();
        let all = self.router.handle(self.now, input);
        let notes = all.iter().filter(|a| matches!(a, Action::Note(_))).count() as u64;
        let after = self.router.stats();
        let counted = |s: RouterStats| {
            s.late
                + s.too_many_pending
                + s.bytes_full
                + s.buffer_full
                + s.never_opened
                + s.unconfirmed
        };
        assert_eq!(
            counted(after) - counted(before),
            notes,
            "every note is counted"
        );
        let actions: Vec<Action> = all
            .into_iter()
            .filter(|a| !matches!(a, Action::Note(_)))
            .collect();
        for a in &actions {
            if let Action::After { delay, timer } = a {
                self.timers.push((self.now + *delay, timer.clone()));
            }
        }
        let (requests, most) = self.router.pending();
        assert!(
            requests <= LIMITS.pending_requests,
            "{requests} requests buffered"
        );
        assert!(
            most <= LIMITS.pending_messages,
            "{most} messages buffered for one"
        );
        assert!(self.router.remembered() <= LIMITS.tombstones);
        assert!(self.router.pending_bytes() <= LIMITS.pending_bytes);
        for a in &actions {
            if let Action::Deliver { id, .. } = a {
                assert!(self.model.live.contains_key(id) || self.router.is_live(id));
            }
        }
        actions
    }

    fn step(&mut self, op: Op) {
        match op {
            Op::Open(i) => self.open(rid(i)),
            Op::HandOver(i) => {
                let id = rid(i);
                let what = Local::HandedOver {
                    blocks: Vec::new(),
                    aux: Vec::new(),
                };
                let expect = self.local(&id, what.clone());
                let got = self.feed(Input::Local {
                    id: id.clone(),
                    what,
                });
                assert_eq!(got, expect);
                if let Some(handed) = self.model.live.get_mut(&id) {
                    *handed = true;
                }
            }
            Op::Abort(i) => {
                let id = rid(i);
                let expect = self.local(&id, Local::Abort);
                let got = self.feed(Input::Local {
                    id,
                    what: Local::Abort,
                });
                assert_eq!(got, expect);
            }
            Op::Inbound(p, i, m) => self.inbound(peer(p), rid(i), m),
            Op::End(i, how) => self.end(rid(i), how),
            Op::Die(i, ended) => self.die(rid(i), ended),
            Op::Lose(p) => {
                let lost = peer(p);
                let got = self.feed(Input::PeerLost { peer: lost.clone() });
                let what = Local::PeerLost { peer: lost.clone() };
                let expect: Vec<Action> = self
                    .model
                    .live
                    .keys()
                    .map(|id| Action::Deliver {
                        id: id.clone(),
                        event: MachineEvent::for_role(self.setup.role, what.clone()),
                    })
                    .collect();
                assert_eq!(got, expect, "a lost peer reaches every live request once");
                // And every request not opened yet that it wrote to, after its messages.
                for b in self.model.pending.values_mut() {
                    if b.senders.contains(&lost) && !b.lost.contains(&lost) {
                        b.lost.push(lost.clone());
                    }
                }
            }
            Op::Supersede if self.setup.supersedes => {
                let detail = "rank held by incarnation 9".to_string();
                let got = self.feed(Input::Superseded {
                    detail: detail.clone(),
                });
                let expect: Vec<Action> = if self.model.superseded {
                    Vec::new()
                } else {
                    let what = Local::Superseded { detail };
                    self.model
                        .live
                        .keys()
                        .map(|id| Action::Deliver {
                            id: id.clone(),
                            event: MachineEvent::for_role(self.setup.role, what.clone()),
                        })
                        .collect()
                };
                assert_eq!(got, expect, "every live request fails superseded, once");
                self.model.superseded = true;
            }
            Op::Supersede => {}
            Op::Wait(ms) => self.wait(Duration::from_millis(ms)),
            Op::WriterGone(p, i, exited) => self.writer_gone(peer(p), rid(i), exited),
            Op::Replace(p) => {
                let replaced = peer(p);
                let got = self.feed(Input::PeerReplaced {
                    peer: replaced.clone(),
                });
                let what = Local::PeerReplaced {
                    peer: replaced.clone(),
                };
                let expect: Vec<Action> = match self.setup.role {
                    Role::Decode => self
                        .model
                        .live
                        .keys()
                        .map(|id| Action::Deliver {
                            id: id.clone(),
                            event: MachineEvent::for_role(Role::Decode, what.clone()),
                        })
                        .collect(),
                    Role::Prefill => Vec::new(),
                };
                let mut expect = expect;
                if self.setup.role == Role::Decode && self.writes_land() {
                    for (id, orphan) in &mut self.model.orphans {
                        if orphan.waits_for(&replaced) && orphan.replaced.insert(replaced.clone()) {
                            // Quarantined already: the rank's earlier processes are watched.
                            if orphan.quarantine.is_some() {
                                expect.push(Action::WatchEarlier {
                                    id: id.clone(),
                                    peer: replaced.clone(),
                                });
                            }
                        }
                    }
                }
                assert_eq!(
                    got, expect,
                    "decode's live requests hear of a new process once, and quarantines watch the earlier ones"
                );
            }
        }
        assert_eq!(
            self.router.stats().unconfirmed,
            self.model.unconfirmed,
            "a replaced writer's confirmation is refused by name"
        );
        let live: Vec<&RequestId> = self.router.live().collect();
        let model: Vec<&RequestId> = self.model.live.keys().collect();
        assert_eq!(live, model, "live requests");
        let orphans: Vec<&RequestId> = self.router.orphans().collect();
        let model: Vec<&RequestId> = self.model.orphans.keys().collect();
        assert_eq!(orphans, model, "orphans");
    }

    fn local(&self, id: &RequestId, what: Local) -> Vec<Action> {
        if !self.model.live.contains_key(id) {
            return Vec::new();
        }
        let event = MachineEvent::for_role(self.setup.role, what);
        vec![Action::Deliver {
            id: id.clone(),
            event,
        }]
    }

    fn open(&mut self, id: RequestId) {
        let ended = self.router.ended(&id).cloned();
        let got = self.feed(Input::Open { id: id.clone() });
        if self.model.superseded {
            let reason = FailureReason::Superseded {
                detail: "rank held by incarnation 9".into(),
            };
            assert_eq!(
                got,
                vec![Action::Refuse { id, reason }],
                "a superseded worker refuses every open"
            );
            return;
        }
        if ended.is_some()
            || self.model.live.contains_key(&id)
            || self.model.orphans.contains_key(&id)
        {
            assert!(
                matches!(got.as_slice(), [Action::Refuse { id: r, .. }] if *r == id),
                "an ended or open request opened again is refused: {got:?}"
            );
            if let Some(State::Failed(reason)) = ended {
                assert!(matches!(&got[0], Action::Refuse { reason: r, .. } if *r == reason));
            }
            return;
        }
        let role = self.setup.role;
        let backlog = self
            .model
            .pending
            .remove(&id)
            .map(|p| {
                let lost = p
                    .lost
                    .into_iter()
                    .map(|peer| MachineEvent::for_role(role, Local::PeerLost { peer }));
                p.events.into_iter().chain(lost).collect()
            })
            .unwrap_or_default();
        let waiting = self.model.live.values().filter(|h| !**h).count();
        let reject = self.setup.role == Role::Decode
            && self.setup.unallocated_max.is_some_and(|m| waiting >= m);
        assert_eq!(
            got,
            vec![Action::Spawn {
                id: id.clone(),
                backlog,
                reject
            }]
        );
        self.model.live.insert(id, false);
    }

    fn inbound(&mut self, from: Peer, id: RequestId, m: Msg) {
        let orphan = self.model.orphans.contains_key(&id);
        let confirmed = if matches!(m, Msg::AbortAck | Msg::Done) {
            self.orphan_confirmed(&id, &from)
        } else {
            Vec::new()
        };
        if let Some(ended) = self.router.ended(&id).cloned() {
            let pending = self.router.pending();
            let got = self.feed(m.input(from.clone(), id.clone()));
            let mut expect = confirmed;
            if matches!(m, Msg::TransferInfo | Msg::Ready | Msg::Invalid) {
                let reason = ended.failure().cloned();
                assert!(
                    matches!(&got.first(), Some(Action::Send { msg: PeerMessage::Abort { reason: r }, .. }) if reason.as_ref().is_none_or(|x| x == r)),
                    "a late transfer info or Ready is answered with an abort: {got:?}"
                );
                expect.push(got[0].clone());
            }
            if matches!(m, Msg::Abort) && !orphan {
                expect.push(Action::Send {
                    to: from,
                    id,
                    msg: PeerMessage::AbortAck,
                });
            }
            assert_eq!(
                got, expect,
                "a message for an ended request is only answered"
            );
            assert_eq!(self.router.pending(), pending, "nor buffered");
            return;
        }
        let bytes = m.held_bytes();
        let event = m.event(self.setup.role, from.clone());
        let got = self.feed(m.input(from.clone(), id.clone()));
        if self.model.live.contains_key(&id) {
            assert_eq!(got, vec![Action::Deliver { id, event }]);
            return;
        }
        // (An orphan whose tombstone was forgotten: its confirmation, then as any other.)
        let mut expect = confirmed;
        if matches!(m, Msg::Abort) && self.setup.role == Role::Prefill {
            expect.push(Action::Send {
                to: from.clone(),
                id: id.clone(),
                msg: PeerMessage::AbortAck,
            });
        }
        // Nothing is due: every timer up to now has fired.
        let buffered = self.model.pending.len();
        let held: usize = self.model.pending.values().map(|p| p.bytes).sum();
        let fits = held + bytes <= LIMITS.pending_bytes;
        match self.model.pending.get_mut(&id) {
            Some(p) => {
                if p.events.len() < LIMITS.pending_messages && fits {
                    if !p.senders.contains(&from) {
                        p.senders.push(from);
                    }
                    p.events.push(event);
                    p.bytes += bytes;
                }
            }
            None if buffered >= LIMITS.pending_requests || !fits => {
                let detail = if buffered >= LIMITS.pending_requests {
                    "too many requests pending creation".to_string()
                } else {
                    format!(
                        "messages for requests pending creation would hold more than {} bytes",
                        LIMITS.pending_bytes
                    )
                };
                let reason = FailureReason::Internal { detail };
                expect.push(Action::Send {
                    to: from,
                    id,
                    msg: PeerMessage::Abort { reason },
                });
            }
            None => {
                self.model.buffered += 1;
                let fresh = Buffered {
                    deadline: self.now + BOOTSTRAP,
                    order: self.model.buffered,
                    senders: vec![from],
                    events: vec![event],
                    bytes,
                    lost: Vec::new(),
                };
                self.model.pending.insert(id, fresh);
                expect.push(Action::After {
                    delay: BOOTSTRAP,
                    timer: Timer::ExpirePending,
                });
            }
        }
        assert_eq!(got, expect);
    }

    /// Sibling ranks hear of a failure that was not a peer's abort.
    fn siblings(id: &RequestId, state: &State) -> Vec<Action> {
        match state {
            State::Failed(FailureReason::AbortedByPeer { .. }) => Vec::new(),
            State::Failed(reason) => vec![Action::ToSiblings {
                id: id.clone(),
                msg: PeerMessage::Abort {
                    reason: reason.clone(),
                },
            }],
            _ => Vec::new(),
        }
    }

    fn end(&mut self, id: RequestId, how: u8) {
        let state = match how {
            0 => State::Done,
            1 => State::Failed(FailureReason::TtlExpired),
            _ => State::Failed(FailureReason::AbortedByPeer {
                peer: "P0".into(),
                cause: "test".into(),
            }),
        };
        let got = self.feed(Input::Ended {
            id: id.clone(),
            state: state.clone(),
        });
        if self.model.live.remove(&id).is_none() {
            assert_eq!(
                got,
                Vec::new(),
                "the end of a request not live changes nothing"
            );
            return;
        }
        let mut expect = vec![Action::Retire { id: id.clone() }];
        expect.extend(Self::siblings(&id, &state));
        expect.push(Action::Forget { id: id.clone() });
        assert_eq!(got, expect);
        assert_eq!(self.router.ended(&id), Some(&state));
    }

    fn die(&mut self, id: RequestId, ended: bool) {
        let state = if ended {
            State::Done
        } else {
            State::Transferring
        };
        let peers = vec![peer(0), peer(2)];
        let why = "injected".to_string();
        let got = self.feed(Input::ActorGone {
            id: id.clone(),
            state: state.clone(),
            peers: peers.clone(),
            why: why.clone(),
        });
        if self.model.live.remove(&id).is_none() {
            assert_eq!(got, Vec::new());
            return;
        }
        let orphan = self.orphaning();
        let mut expect = vec![Action::Revoke { id: id.clone() }];
        let reason = FailureReason::Internal { detail: why };
        let end = if ended {
            state
        } else {
            expect.push(Action::Fail {
                id: id.clone(),
                reason: reason.clone(),
                hold: orphan,
            });
            for to in &peers {
                expect.push(Action::Send {
                    to: to.clone(),
                    id: id.clone(),
                    msg: PeerMessage::Abort {
                        reason: reason.clone(),
                    },
                });
            }
            State::Failed(reason)
        };
        if orphan {
            expect.push(Action::After {
                delay: FENCE,
                timer: Timer::OrphanDue(id.clone()),
            });
            let orphan = OrphanModel {
                peers,
                confirmed: BTreeSet::new(),
                quarantine: None,
                bound_only: false,
                replaced: BTreeSet::new(),
            };
            self.model.orphans.insert(id.clone(), orphan);
            self.model.unforgotten.insert(id.clone());
        } else {
            expect.push(Action::Release {
                id: id.clone(),
                fence: None,
            });
        }
        expect.extend(Self::siblings(&id, &end));
        if !orphan {
            expect.push(Action::Forget { id: id.clone() });
        }
        assert_eq!(got, expect);
        assert_eq!(self.router.ended(&id), Some(&end));
    }

    fn writer_gone(&mut self, from: Peer, id: RequestId, exited: bool) {
        let got = self.feed(Input::WriterGone {
            id: id.clone(),
            peer: from.clone(),
            exited,
        });
        let Some(orphan) = self.model.orphans.get_mut(&id) else {
            return assert_eq!(got, Vec::new());
        };
        let Some(left) = orphan.quarantine.as_mut() else {
            return assert_eq!(got, Vec::new(), "only a quarantine waits for writers");
        };
        if !left.remove(&from) {
            return assert_eq!(got, Vec::new());
        }
        orphan.bound_only |= !exited;
        let expect = if left.is_empty() {
            let end = if orphan.bound_only {
                FenceEnd::Bound
            } else {
                FenceEnd::Confirmed
            };
            self.orphan_released(&id, end)
        } else {
            Vec::new()
        };
        assert_eq!(got, expect, "a quarantine ends with its last writer");
    }

    /// Every quarantined writer is reported gone (the end of a run).
    fn end_quarantines(&mut self) {
        let held: Vec<(RequestId, Vec<Peer>)> = self
            .model
            .orphans
            .iter()
            .filter_map(|(id, o)| Some((id.clone(), o.quarantine.clone()?.into_iter().collect())))
            .collect();
        for (id, peers) in held {
            for p in peers {
                self.writer_gone(p, id.clone(), true);
            }
        }
    }

    /// Time passes; every timer due fires at its time.
    fn wait(&mut self, d: Duration) {
        let until = self.now + d;
        loop {
            self.timers.sort_by_key(|(at, _)| *at);
            let Some(i) = self.timers.iter().position(|(at, _)| *at <= until) else {
                break;
            };
            let (at, timer) = self.timers.remove(i);
            self.now = self.now.max(at);
            self.fire(timer);
        }
        self.now = until;
    }

    fn fire(&mut self, timer: Timer) {
        match timer.clone() {
            Timer::ExpirePending => {
                let due: Vec<RequestId> = self
                    .model
                    .pending
                    .iter()
                    .filter(|(_, p)| p.deadline <= self.now)
                    .map(|(id, _)| id.clone())
                    .collect();
                let mut expect = Vec::new();
                let mut by_deadline: Vec<((Instant, u64), RequestId, Vec<Peer>)> = due
                    .into_iter()
                    .filter_map(|id| {
                        let p = self.model.pending.remove(&id)?;
                        Some(((p.deadline, p.order), id, p.senders))
                    })
                    .collect();
                by_deadline.sort_by_key(|d| d.0);
                for (_, id, senders) in &by_deadline {
                    for to in senders {
                        expect.push(Action::Send {
                            to: to.clone(),
                            id: id.clone(),
                            msg: PeerMessage::Abort {
                                reason: FailureReason::BootstrapTimeout,
                            },
                        });
                        if self.setup.role == Role::Prefill {
                            expect.push(Action::Send {
                                to: to.clone(),
                                id: id.clone(),
                                msg: PeerMessage::AbortAck,
                            });
                        }
                    }
                }
                let got = self.feed(Input::Timer(timer));
                assert_eq!(
                    got, expect,
                    "a request never opened is answered at its deadline"
                );
                if self.setup.role == Role::Prefill {
                    for (_, id, _) in &by_deadline {
                        let failed = State::Failed(FailureReason::BootstrapTimeout);
                        assert_eq!(self.router.ended(id), Some(&failed));
                    }
                }
            }
            Timer::OrphanDue(id) => {
                let got = self.feed(Input::Timer(timer));
                let writes_land = self.writes_land();
                let Some(orphan) = self.model.orphans.get_mut(&id) else {
                    assert_eq!(got, Vec::new());
                    return;
                };
                let unconfirmed: Vec<Peer> = orphan
                    .peers
                    .iter()
                    .filter(|p| !orphan.confirmed.contains(p))
                    .cloned()
                    .collect();
                if !writes_land || unconfirmed.is_empty() {
                    let expect = self.orphan_released(&id, FenceEnd::Bound);
                    assert_eq!(got, expect, "an orphan's blocks go at its fence bound");
                    return;
                }
                orphan.quarantine = Some(unconfirmed.iter().cloned().collect());
                let replaced = unconfirmed
                    .iter()
                    .filter(|p| orphan.replaced.contains(p))
                    .cloned()
                    .collect();
                let mut expect = vec![Action::Quarantine {
                    id: id.clone(),
                    peers: unconfirmed,
                    replaced,
                }];
                expect.extend(self.orphan_asks(&id));
                assert_eq!(
                    got, expect,
                    "past the bound, an orphan's unconfirmed writers are quarantined"
                );
            }
            Timer::OrphanAsk(id) => {
                let got = self.feed(Input::Timer(timer));
                assert_eq!(
                    got,
                    self.orphan_asks(&id),
                    "a quarantined orphan asks again"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(handoff_testkit::proptest_cases(512)))]

    #[test]
    fn the_router_keeps_its_rules(setup in setup(), ops in prop::collection::vec(op(), 1..80)) {
        let mut h = Harness::new(setup);
        for op in ops {
            h.step(op);
            let held: usize = h.model.pending.values().map(|p| p.bytes).sum();
            prop_assert_eq!(h.router.pending_bytes(), held);
        }
        // Every timer fires and every quarantined writer is reported gone: every orphan is
        // forgotten, nothing stays buffered.
        h.wait(FENCE + BOOTSTRAP);
        h.end_quarantines();
        prop_assert!(h.model.unforgotten.is_empty());
        prop_assert_eq!(h.router.pending().0, 0);
        prop_assert_eq!(h.router.pending_bytes(), 0);
        prop_assert!(h.router.orphans().next().is_none());
    }
}

/// Delivering an event for the other side is impossible by construction: the role picks the
/// machine, for every local event and every peer message.
#[test]
fn the_role_picks_the_machine() {
    let p = peer(0);
    for what in [
        Local::HandedOver {
            blocks: Vec::new(),
            aux: Vec::new(),
        },
        Local::Abort,
        Local::Invalid {
            from: p.clone(),
            detail: "x".into(),
        },
        Local::PeerLost { peer: p.clone() },
    ] {
        assert!(matches!(
            MachineEvent::for_role(Role::Prefill, what.clone()),
            MachineEvent::Sender(_)
        ));
        assert!(matches!(
            MachineEvent::for_role(Role::Decode, what),
            MachineEvent::Receiver(_)
        ));
    }
    assert_eq!(
        MachineEvent::inbound(Role::Prefill, p.clone(), PeerMessage::Queued),
        MachineEvent::Sender(SenderEvent::Queued { from: p.clone() })
    );
    assert_eq!(
        MachineEvent::inbound(Role::Decode, p.clone(), PeerMessage::AbortAck),
        MachineEvent::Receiver(ReceiverEvent::AbortAck { from: p })
    );
}

/// What the root logs comes from the router's notes: a request never opened, a buffer
/// full, a late message.
#[test]
fn the_router_notes_what_an_operator_should_see() {
    let mut r = Router::new(RouterConfig {
        role: Role::Prefill,
        mode: TransferMode::Push,
        one_sided: false,
        bootstrap: BOOTSTRAP,
        fence_max: FENCE,
        unallocated_max: None,
        limits: LIMITS,
    });
    let t = Instant::now();
    let (p, id) = (peer(1), rid(1));
    let info = || Msg::TransferInfo.outbound();
    let notes = |actions: Vec<Action>| -> Vec<Note> {
        actions
            .into_iter()
            .filter_map(|a| match a {
                Action::Note(n) => Some(n),
                _ => None,
            })
            .collect()
    };
    for _ in 0..LIMITS.pending_messages {
        let got = r.handle(
            t,
            Input::Inbound {
                from: p.clone(),
                id: id.clone(),
                msg: info(),
            },
        );
        assert!(notes(got).is_empty());
    }
    let got = r.handle(
        t,
        Input::Inbound {
            from: p.clone(),
            id: id.clone(),
            msg: info(),
        },
    );
    assert_eq!(
        notes(got),
        vec![Note::BufferFull {
            id: id.clone(),
            from: p.clone()
        }]
    );
    let got = r.handle(t + BOOTSTRAP, Input::Timer(Timer::ExpirePending));
    let never = Note::NeverOpened {
        id: id.clone(),
        peers: vec![p.clone()],
    };
    assert_eq!(notes(got), vec![never]);
    let got = r.handle(
        t + BOOTSTRAP,
        Input::Inbound {
            from: p.clone(),
            id: id.clone(),
            msg: info(),
        },
    );
    assert_eq!(notes(got), vec![Note::Late { id, from: p }]);
}

/// A message holds what it names: a transfer info of a million blocks is megabytes, which
/// is why the buffer for unopened requests is bounded in bytes, not only in count.
#[test]
fn a_message_holds_what_it_names() {
    let small = Msg::TransferInfo.outbound().held_bytes();
    let huge = PeerMessage::TransferInfo {
        mode: TransferMode::Pull,
        blocks: (0..1_000_000).map(BlockId).collect(),
    };
    assert!(huge.held_bytes() >= 4_000_000, "{}", huge.held_bytes());
    assert!(huge.held_bytes() > small);
    let ready = PeerMessage::Ready {
        blocks: Vec::new(),
        aux: vec![0; 4096],
        hold: Duration::ZERO,
    };
    assert!(ready.held_bytes() >= 4096);
}

/// Decode push over a one-sided plane: an orphan's blocks are held past the fence bound for
/// every prefill rank that has not confirmed, asked at once and again, and go only when the
/// last of them confirms (or is reported gone); a rank that confirmed before the bound is
/// not waited for, a stranger's acknowledgement counts for nothing, and an orphan whose
/// ranks all confirmed before the bound goes at once.
#[test]
fn an_orphan_past_its_bound_is_held_until_each_writer_confirms_or_is_gone() {
    let router = || {
        Router::new(RouterConfig {
            role: Role::Decode,
            mode: TransferMode::Push,
            one_sided: true,
            bootstrap: BOOTSTRAP,
            fence_max: FENCE,
            unallocated_max: None,
            limits: LIMITS,
        })
    };
    let t = Instant::now();
    let (p0, p1, p2) = (peer(0), peer(1), peer(2));
    let id = rid(0);
    let orphaned = |r: &mut Router| {
        r.handle(t, Input::Open { id: id.clone() });
        let died = Input::ActorGone {
            id: id.clone(),
            state: State::Failed(FailureReason::TtlExpired),
            peers: vec![p0.clone(), p2.clone()],
            why: "injected".into(),
        };
        r.handle(t, died);
    };
    let said = |r: &mut Router, from: &Peer, msg: PeerMessage| {
        let from = from.clone();
        let id = id.clone();
        r.handle(t, Input::Inbound { from, id, msg })
    };
    let released = |got: &[Action], fence: FenceEnd| {
        got.contains(&Action::Release {
            id: id.clone(),
            fence: Some(fence),
        }) && got.contains(&Action::Forget { id: id.clone() })
    };
    let abort = |to: &Peer| Action::Send {
        to: to.clone(),
        id: id.clone(),
        msg: PeerMessage::Abort {
            reason: FailureReason::TtlExpired,
        },
    };

    // P0 confirms before the bound; P2 does not: quarantined, asked at once and again.
    let mut r = router();
    orphaned(&mut r);
    assert!(!released(
        &said(&mut r, &p0, PeerMessage::AbortAck),
        FenceEnd::Confirmed
    ));
    let due = r.handle(t + FENCE, Input::Timer(Timer::OrphanDue(id.clone())));
    let quarantine = Action::Quarantine {
        id: id.clone(),
        peers: vec![p2.clone()],
        replaced: vec![],
    };
    assert_eq!(due[0], quarantine, "{due:?}");
    assert!(
        due.contains(&abort(&p2)) && !due.contains(&abort(&p0)),
        "{due:?}"
    );
    assert!(!due.iter().any(|a| matches!(a, Action::Release { .. })));
    let ask = r.handle(t + FENCE, Input::Timer(Timer::OrphanAsk(id.clone())));
    assert!(ask.contains(&abort(&p2)), "asked again: {ask:?}");
    // A stranger's acknowledgement, and P0's again, change nothing.
    for who in [&p1, &p0] {
        let got = said(&mut r, who, PeerMessage::AbortAck);
        assert!(
            !got.iter().any(|a| matches!(a, Action::Release { .. })),
            "{got:?}"
        );
    }
    assert_eq!(r.orphans().count(), 1);
    let done = said(&mut r, &p2, PeerMessage::Done { aux: Vec::new() });
    assert!(released(&done, FenceEnd::Confirmed), "{done:?}");
    assert_eq!(r.orphans().count(), 0);
    let ask = r.handle(t + FENCE, Input::Timer(Timer::OrphanAsk(id.clone())));
    assert_eq!(ask, Vec::new(), "nothing asked once released");

    // Reported gone: exited (confirmed), or not watchable (the bound).
    for (exited, fence) in [(true, FenceEnd::Confirmed), (false, FenceEnd::Bound)] {
        let mut r = router();
        orphaned(&mut r);
        r.handle(t + FENCE, Input::Timer(Timer::OrphanDue(id.clone())));
        let gone = |r: &mut Router, peer: &Peer| {
            let (id, peer) = (id.clone(), peer.clone());
            r.handle(t + FENCE, Input::WriterGone { id, peer, exited })
        };
        assert!(!released(&gone(&mut r, &p0), fence));
        assert!(
            !released(&gone(&mut r, &p0), fence),
            "one writer counts once"
        );
        assert!(released(&gone(&mut r, &p2), fence));
    }

    // Every rank confirmed before the bound: the blocks go at once, and the bound is moot.
    let mut r = router();
    orphaned(&mut r);
    said(&mut r, &p2, PeerMessage::AbortAck);
    let last = said(&mut r, &p0, PeerMessage::Done { aux: Vec::new() });
    assert!(released(&last, FenceEnd::Confirmed), "{last:?}");
    let due = r.handle(t + FENCE, Input::Timer(Timer::OrphanDue(id.clone())));
    assert_eq!(due, Vec::new());
}
