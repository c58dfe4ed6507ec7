//! Property tests for the lifecycle machines: arbitrary interleavings of events and
//! timeouts, driven as a correct driver would (a timeout is delivered when its deadline
//! passes), checking after every step that
//! - nothing panics,
//! - the state never moves backward, and every `StateChanged` action agrees with `state()`,
//! - every non-terminal state has a pending deadline,
//! - the machine is terminal no later than `created + Timeouts::lifetime_max()`,
//! - every block handed in is released exactly once, and none before the end (except
//!   blocks handed in twice or after the end, which go back at once),
//! - a lost writer's blocks (push over a one-sided plane) are never let go on a time bound
//!   while its driver watches it: they are quarantined until it is reported gone,
//! - once a new process holds a lost writer's rank, that rank's answers never let the
//!   blocks go: only the writer's confirmation before then, or its report as gone, does,
//! - `merge` is commutative, associative and idempotent, and `Failed` dominates.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use handoff_actors::link::PLANE_ANSWER_GRACE;
use handoff_actors::machine::{
    merge, merge_all, Action, PeerMessage, Phase, ReceiverEvent, ReceiverMachine, SenderEvent,
    SenderMachine, State, Timeouts, QUARANTINE_ASK_EVERY,
};
use handoff_actors::ReleaseReason;
use handoff_transport::{BlockId, FailureReason, RankInfo, TransferMode};
use proptest::prelude::*;

fn peer(i: u8) -> RankInfo {
    let mut r = RankInfo::single("peer");
    r.pp_rank = u32::from(i);
    r.pp_size = 2;
    r
}

fn timeouts() -> Timeouts {
    Timeouts {
        bootstrap: Duration::from_secs(10),
        waiting: Duration::from_secs(20),
        transfer: Duration::from_secs(5),
        pull_ttl: Duration::from_secs(30),
    }
}

fn reason() -> impl Strategy<Value = FailureReason> {
    prop_oneof![
        Just(FailureReason::RejectedBusy),
        Just(FailureReason::BootstrapTimeout),
        Just(FailureReason::TtlExpired),
        "[a-z]{0,4}".prop_map(|detail| FailureReason::Protocol { detail }),
        "[a-z]{0,4}".prop_map(|detail| FailureReason::Internal { detail }),
        "[a-z]{0,4}".prop_map(|detail| FailureReason::Superseded { detail }),
    ]
}

fn mode() -> impl Strategy<Value = TransferMode> {
    prop_oneof![Just(TransferMode::Push), Just(TransferMode::Pull)]
}

/// Block lists are drawn by length; ids are made unique per draw by the driver, so that
/// "released exactly once" can be checked per block.
fn len() -> impl Strategy<Value = usize> {
    0usize..4
}

#[derive(Clone, Debug)]
enum SOp {
    Info(u8, TransferMode, usize),
    Queued(u8),
    Rejected(u8, FailureReason),
    Input(usize),
    Complete(u8),
    TransferFailed(u8),
    ReadDone(u8),
    Abort,
    PeerAbort(u8, FailureReason),
    PeerLost(u8),
    Internal,
    Superseded,
}

fn sender_op() -> impl Strategy<Value = SOp> {
    prop_oneof![
        4 => (0u8..2, mode(), len()).prop_map(|(p, m, n)| SOp::Info(p, m, n)),
        1 => (0u8..2).prop_map(SOp::Queued),
        1 => (0u8..2, reason()).prop_map(|(p, r)| SOp::Rejected(p, r)),
        4 => len().prop_map(SOp::Input),
        3 => (0u8..2).prop_map(SOp::Complete),
        1 => (0u8..2).prop_map(SOp::TransferFailed),
        3 => (0u8..2).prop_map(SOp::ReadDone),
        1 => Just(SOp::Abort),
        1 => (0u8..2, reason()).prop_map(|(p, r)| SOp::PeerAbort(p, r)),
        1 => (0u8..2).prop_map(SOp::PeerLost),
        1 => Just(SOp::Internal),
        1 => Just(SOp::Superseded),
    ]
}

#[derive(Clone, Debug)]
enum ROp {
    /// `n` prefill ranks, those in the bit mask unwatched (another host).
    Peers(u8, u8),
    BootstrapFailed(FailureReason),
    Reject,
    AbortAck(u8),
    Allocated(usize),
    Done(u8),
    Ready(u8, usize, u64),
    ReadComplete(u8),
    TransferFailed,
    Abort,
    PeerAbort(u8, FailureReason),
    PeerLost(u8),
    Replaced(u8),
    Internal,
    Superseded,
}

fn receiver_op() -> impl Strategy<Value = ROp> {
    prop_oneof![
        3 => (0u8..3, prop_oneof![3 => Just(0u8), 1 => 0u8..8]).prop_map(|(n, u)| ROp::Peers(n, u)),
        1 => reason().prop_map(ROp::BootstrapFailed),
        1 => Just(ROp::Reject),
        2 => (0u8..3).prop_map(ROp::AbortAck),
        3 => len().prop_map(ROp::Allocated),
        3 => (0u8..3).prop_map(ROp::Done),
        3 => (0u8..3, len(), prop_oneof![Just(1u64), Just(50), Just(600_000)]).prop_map(|(p, n, h)| ROp::Ready(p, n, h)),
        3 => (0u8..3).prop_map(ROp::ReadComplete),
        1 => Just(ROp::TransferFailed),
        1 => Just(ROp::Abort),
        1 => (0u8..3, reason()).prop_map(|(p, r)| ROp::PeerAbort(p, r)),
        1 => (0u8..3).prop_map(ROp::PeerLost),
        1 => (0u8..3).prop_map(ROp::Replaced),
        1 => Just(ROp::Internal),
        1 => Just(ROp::Superseded),
    ]
}

/// What can happen to a push request's writers once its transfer info is out.
#[derive(Clone, Debug)]
enum QOp {
    Lost(u8),
    Replaced(u8),
    AbortAck(u8),
    Done(u8),
    Gone(u8, bool),
}

fn quarantine_op() -> impl Strategy<Value = QOp> {
    prop_oneof![
        2 => (0u8..3).prop_map(QOp::Lost),
        2 => (0u8..3).prop_map(QOp::Replaced),
        3 => (0u8..3).prop_map(QOp::AbortAck),
        1 => (0u8..3).prop_map(QOp::Done),
        1 => (0u8..3, any::<bool>()).prop_map(|(p, e)| QOp::Gone(p, e)),
    ]
}

/// What the checker remembers across steps.
struct Ledger {
    created: Instant,
    next_block: u32,
    given: BTreeMap<BlockId, u32>,
    released: BTreeMap<BlockId, u32>,
    phase: Phase,
    terminal_at: Option<Instant>,
    /// Latest instant a fence may hold blocks until (terminal time + fence_max).
    fenced_by: Option<Instant>,
    fence_max: Duration,
    /// Prefill ranks whose payload was handed to the engine.
    aux_from: Vec<RankInfo>,
    /// Lost prefill ranks whose blocks the machine quarantined past the fence bound.
    quarantined: Vec<RankInfo>,
    /// A fenced push whose prefill ranks include one that cannot be watched: it must run
    /// as pull (no transfer info says push).
    no_push: bool,
}

impl Ledger {
    fn new(created: Instant) -> Self {
        Self {
            created,
            next_block: 0,
            given: BTreeMap::new(),
            released: BTreeMap::new(),
            phase: Phase::Bootstrapping,
            terminal_at: None,
            fenced_by: None,
            fence_max: timeouts().fence_max(),
            aux_from: Vec::new(),
            quarantined: Vec::new(),
            no_push: false,
        }
    }

    fn blocks(&mut self, n: usize, handed_in: bool) -> Vec<BlockId> {
        let blocks: Vec<BlockId> = (0..n)
            .map(|_| {
                self.next_block += 1;
                BlockId(self.next_block)
            })
            .collect();
        if handed_in {
            for b in &blocks {
                *self.given.entry(*b).or_default() += 1;
            }
        }
        blocks
    }

    /// Checks the actions of one step against the state the machine reports.
    fn check(
        &mut self,
        now: Instant,
        state: &State,
        deadline: Option<Instant>,
        actions: Vec<Action>,
    ) {
        let mut last_change = None;
        for action in actions {
            match action {
                Action::Release { blocks, why } => {
                    // Why agrees with the end: the state the machine is in after this step
                    // (releases happen only at or after the end).
                    match (&why, state) {
                        (ReleaseReason::Done, State::Done) | (ReleaseReason::Late, _) => {}
                        (ReleaseReason::Failed { reason, .. }, State::Failed(r)) => {
                            assert_eq!(reason, r, "released for another failure")
                        }
                        _ => panic!("released for {why} in {state}"),
                    }
                    for b in blocks {
                        let n = self.released.entry(b).or_default();
                        *n += 1;
                        assert_eq!(*n, 1, "block {b} released twice");
                        assert!(
                            self.given.contains_key(&b),
                            "block {b} released but never given"
                        );
                    }
                }
                Action::StateChanged(s) => {
                    assert!(
                        s.phase() > self.phase,
                        "not forward: {:?} -> {s}",
                        self.phase
                    );
                    self.phase = s.phase();
                    last_change = Some(s);
                }
                Action::Write {
                    src,
                    dst,
                    deadline: by,
                    ..
                }
                | Action::Read {
                    src,
                    dst,
                    deadline: by,
                    ..
                } => {
                    assert_eq!(src.len(), dst.len(), "transfer with mismatched block lists");
                    // One deadline per transfer, decided here: in the future, no later than
                    // the state's own, and early enough that the plane's answer (by `by`
                    // plus its grace) comes before any fence this request could put up
                    // lifts by its bound.
                    assert!(by > now, "a transfer with no time left");
                    assert!(
                        deadline.is_some_and(|d| by <= d),
                        "a transfer deadline past the state's"
                    );
                    assert!(
                        by + PLANE_ANSWER_GRACE <= now + self.fence_max,
                        "a fence could lift before the plane answers"
                    );
                }
                Action::Send {
                    msg: PeerMessage::TransferInfo { mode, .. },
                    ..
                } => {
                    assert!(
                        !(self.no_push && mode == TransferMode::Push),
                        "a push to a writer that cannot be watched"
                    );
                }
                Action::Send { .. } => {}
                Action::PullsInstead { unwatched } => {
                    assert!(self.no_push, "pull instead of a push that could be fenced");
                    assert!(!unwatched.is_empty(), "pull instead, for nobody");
                }
                Action::Unconfirmed { from } => {
                    assert!(
                        state.is_terminal(),
                        "{from}'s confirmation refused before the end"
                    );
                }
                Action::WatchEarlier { peer } => {
                    assert!(
                        self.quarantined.contains(&peer),
                        "{peer}'s earlier processes watched outside a quarantine of it"
                    );
                }
                Action::Quarantine {
                    peers,
                    blocks,
                    replaced,
                } => {
                    assert!(state.is_terminal(), "quarantined before the end");
                    assert!(
                        replaced.iter().all(|p| peers.contains(p)),
                        "a replaced writer outside the quarantine"
                    );
                    assert!(!peers.is_empty(), "a quarantine waiting for nobody");
                    assert!(self.quarantined.is_empty(), "quarantined twice");
                    let held = self.given.keys().filter(|b| !self.released.contains_key(b));
                    assert_eq!(blocks, held.count(), "quarantine counts other blocks");
                    self.quarantined = peers;
                }
                Action::Aux { from, bytes } => {
                    assert!(!bytes.is_empty(), "an empty payload handed to the engine");
                    assert!(
                        self.phase < Phase::Terminal,
                        "payload from {from} after the request ended"
                    );
                    assert!(!self.aux_from.contains(&from), "two payloads from {from}");
                    self.aux_from.push(from);
                }
            }
        }
        if let Some(s) = last_change {
            assert_eq!(&s, state, "last StateChanged disagrees with state()");
        }
        assert_eq!(
            state.phase(),
            self.phase,
            "state() changed without a StateChanged action"
        );
        if state.is_terminal() {
            // A terminal receiver may still hold its blocks behind a fence, with the fence's
            // deadline armed; otherwise nothing is armed once terminal.
            if self.terminal_at.is_none() {
                self.terminal_at = Some(now);
                self.fenced_by = Some(now + self.fence_max);
            }
            // Quarantined: its deadlines only ask the lost writers again, one interval on.
            let bound = if self.quarantined.is_empty() {
                self.fenced_by
            } else {
                Some(now + QUARANTINE_ASK_EVERY)
            };
            assert!(
                deadline.is_none() || bound.is_some_and(|t| deadline <= Some(t)),
                "terminal state with a deadline past the fence bound"
            );
        } else {
            assert!(
                deadline.is_some(),
                "non-terminal state {state} without a deadline"
            );
            assert!(
                self.released.is_empty()
                    || self.released.keys().all(|b| self.given.contains_key(b))
            );
        }
    }

    /// At the end: terminal in time, and every block given released exactly once.
    fn check_end(&self, timeouts: &Timeouts) {
        let at = self
            .terminal_at
            .expect("machine never reached a terminal state");
        assert!(
            at.duration_since(self.created) <= timeouts.lifetime_max(),
            "terminal after {:?}, bound {:?}",
            at.duration_since(self.created),
            timeouts.lifetime_max()
        );
        assert_eq!(self.given, self.released, "blocks given != blocks released");
    }
}

fn drain_sender(m: &mut SenderMachine) -> Vec<Action> {
    std::iter::from_fn(|| m.poll_action()).collect()
}

fn drain_receiver(m: &mut ReceiverMachine) -> Vec<Action> {
    std::iter::from_fn(|| m.poll_action()).collect()
}

/// Delivers every timeout due by `until`, as a correct driver would.
macro_rules! fire_due {
    ($m:expr, $ledger:expr, $drain:ident, $until:expr) => {
        while let Some(d) = $m.poll_timeout() {
            if d > $until {
                break;
            }
            $m.handle_timeout(d);
            let actions = $drain(&mut $m);
            $ledger.check(d, $m.state(), $m.poll_timeout(), actions);
        }
    };
}

/// Decode ranks 0 and 1 of a tp-2 decode, and (2) rank 0 of that decode's other dp group.
fn fan_peer(i: u8) -> RankInfo {
    let mut r = RankInfo::single("decode");
    r.tp_size = 2;
    r.tp_rank = u32::from(i % 2);
    r.dp_size = 2;
    r.dp_rank = u32::from(i / 2);
    r
}

/// Sender ops over three peers ([`fan_peer`]), weighted towards the two that pair.
fn fan_op() -> impl Strategy<Value = SOp> {
    let p = || prop_oneof![4 => 0u8..2, 1 => Just(2u8)];
    prop_oneof![
        4 => (p(), mode(), len()).prop_map(|(p, m, n)| SOp::Info(p, m, n)),
        1 => p().prop_map(SOp::Queued),
        1 => (p(), reason()).prop_map(|(p, r)| SOp::Rejected(p, r)),
        4 => len().prop_map(SOp::Input),
        4 => p().prop_map(SOp::Complete),
        1 => p().prop_map(SOp::TransferFailed),
        4 => p().prop_map(SOp::ReadDone),
        1 => Just(SOp::Abort),
        1 => (p(), reason()).prop_map(|(p, r)| SOp::PeerAbort(p, r)),
        1 => p().prop_map(SOp::PeerLost),
        1 => Just(SOp::Internal),
        1 => Just(SOp::Superseded),
    ]
}

/// Drives a sender at `tp` (size, rank) with `ops` against peers named by `peer`, checking
/// the ledger's properties at every step, and that a `Done` request delivered to every
/// decode rank that reads from it: written to and completed (push), or told `Ready` and
/// read by (pull), each exactly once.
fn run_sender(tp: (u32, u32), peer: fn(u8) -> RankInfo, ops: &[(u64, SOp)]) {
    let t = timeouts();
    let start = Instant::now();
    let mut now = start;
    let mut m = SenderMachine::new(now, t).tp(tp.0, tp.1);
    let mut ledger = Ledger::new(start);
    // Per peer: writes posted or `Ready` sent, and completions or `ReadDone` fed.
    let mut started: BTreeMap<RankInfo, u32> = BTreeMap::new();
    let mut finished: BTreeMap<RankInfo, u32> = BTreeMap::new();
    for (dt_ms, op) in ops.iter().cloned() {
        let next = now + Duration::from_millis(dt_ms);
        fire_due!(m, ledger, drain_sender, next);
        now = next;
        let before = m.state().clone();
        let event = match op {
            SOp::Info(p, mode, n) => SenderEvent::TransferInfo {
                from: peer(p),
                mode,
                blocks: ledger.blocks(n, false),
            },
            SOp::Queued(p) => SenderEvent::Queued { from: peer(p) },
            SOp::Rejected(p, reason) => SenderEvent::Rejected {
                from: peer(p),
                reason,
            },
            SOp::Input(n) => SenderEvent::Input {
                blocks: ledger.blocks(n, true),
                aux: vec![],
            },
            SOp::Complete(p) => SenderEvent::TransferComplete { to: peer(p) },
            SOp::TransferFailed(p) => SenderEvent::TransferFailed {
                to: peer(p),
                detail: "x".into(),
            },
            SOp::ReadDone(p) => SenderEvent::ReadDone { from: peer(p) },
            SOp::Abort => SenderEvent::Abort,
            SOp::PeerAbort(p, reason) => SenderEvent::PeerAbort {
                from: peer(p),
                reason,
            },
            SOp::PeerLost(p) => SenderEvent::PeerLost { peer: peer(p) },
            SOp::Internal => SenderEvent::Internal { detail: "x".into() },
            SOp::Superseded => SenderEvent::Superseded { detail: "y".into() },
        };
        let completion = match &event {
            SenderEvent::TransferComplete { to } => Some(to.clone()),
            SenderEvent::ReadDone { from } => Some(from.clone()),
            _ => None,
        };
        m.handle(now, event);
        let actions = drain_sender(&mut m);
        for a in &actions {
            match a {
                Action::Write { to, .. }
                | Action::Send {
                    to,
                    msg: PeerMessage::Ready { .. },
                } => {
                    *started.entry(to.clone()).or_default() += 1;
                }
                _ => {}
            }
        }
        if let Some(p) = completion {
            if before == State::Transferring {
                *finished.entry(p).or_default() += 1;
            }
        }
        ledger.check(now, m.state(), m.poll_timeout(), actions);
        if *m.state() == State::Done && before != State::Done {
            let readers: Vec<RankInfo> = m.peers().cloned().collect();
            let want = handoff_transport::tp::decode_share(tp.0, readers[0].tp_size, tp.1).unwrap();
            assert_eq!(readers.len(), want.len(), "done with {readers:?}");
            for r in &readers {
                assert!(
                    want.contains(&r.tp_rank),
                    "{r} does not read from this rank"
                );
                assert_eq!(started.get(r), Some(&1), "{r} not started exactly once");
                assert!(
                    finished.get(r).is_some_and(|&n| n >= 1),
                    "{r} never finished"
                );
            }
        }
        for p in m.depends_on().cloned().collect::<Vec<_>>() {
            let mut lost = m.clone();
            lost.handle(now, SenderEvent::PeerLost { peer: p.clone() });
            assert_lost_fails(m.state(), lost.state(), &p);
        }
    }
    // With no more input, the deadlines alone must end it.
    fire_due!(
        m,
        ledger,
        drain_sender,
        start + t.lifetime_max() + t.fence_max() + Duration::from_secs(1)
    );
    ledger.check_end(&t);
}

/// A request that depends on a peer (the runtime routes that peer's loss to it), in any
/// state before its end, fails `PeerLost` naming it at once when the peer is lost.
fn assert_lost_fails(before: &State, after: &State, peer: &RankInfo) {
    if before.is_terminal() {
        return;
    }
    match after {
        State::Failed(FailureReason::PeerLost { peer: named }) => {
            assert_eq!(named, &peer.to_string(), "failed for another peer")
        }
        other => panic!("{peer} lost in {before}: the request went to {other}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(handoff_testkit::proptest_cases(2000)))]

    #[test]
    fn sender_machine_properties(ops in prop::collection::vec((0u64..8_000, sender_op()), 0..24)) {
        run_sender((1, 0), peer, &ops);
    }

    /// Fan-out: prefill tp 1, decode tp 2 (each decode rank takes half the heads), plus a
    /// rank of another dp group that must not pair. The request is `Done` only once both
    /// decode ranks have their blocks.
    #[test]
    fn sender_machine_properties_fan_out(ops in prop::collection::vec((0u64..8_000, fan_op()), 0..32)) {
        run_sender((1, 0), fan_peer, &ops);
    }
    #[test]
    fn receiver_machine_properties(
        mode in mode(),
        fence in any::<bool>(),
        ops in prop::collection::vec((0u64..8_000, receiver_op()), 0..24),
    ) {
        let t = timeouts();
        let start = Instant::now();
        let mut now = start;
        let mut m = ReceiverMachine::new(now, t, mode).fence_writes(fence);
        let mut ledger = Ledger::new(start);
        // Quarantined writers that confirmed (their own process, after they came back).
        let mut confirmed: Vec<RankInfo> = Vec::new();
        for (dt_ms, op) in ops {
            let next = now + Duration::from_millis(dt_ms);
            fire_due!(m, ledger, drain_receiver, next);
            now = next;
            let event = match op {
                ROp::Peers(n, mask) => {
                    let peers: Vec<RankInfo> = (0..n).map(peer).collect();
                    let unwatched: Vec<RankInfo> = (0..n).filter(|i| mask & (1 << i) != 0).map(peer).collect();
                    let first = m.peers().next().is_none() && *m.state() == State::Bootstrapping;
                    if first && n > 0 && !unwatched.is_empty() && mode == TransferMode::Push && fence {
                        ledger.no_push = true;
                    }
                    ReceiverEvent::PeersResolved { peers, unwatched }
                }
                ROp::BootstrapFailed(reason) => ReceiverEvent::BootstrapFailed { reason },
                ROp::Reject => ReceiverEvent::Reject { reason: FailureReason::RejectedBusy },
                ROp::AbortAck(p) => ReceiverEvent::AbortAck { from: peer(p) },
                ROp::Allocated(n) => ReceiverEvent::Allocated { blocks: ledger.blocks(n, true) },
                ROp::Done(p) => ReceiverEvent::Done { from: peer(p), aux: vec![p] },
                ROp::Ready(p, n, h) => ReceiverEvent::Ready { from: peer(p), blocks: ledger.blocks(n, false), aux: vec![p], hold: Duration::from_millis(h) },
                ROp::ReadComplete(p) => ReceiverEvent::ReadComplete { from: peer(p) },
                ROp::TransferFailed => ReceiverEvent::TransferFailed { detail: "x".into() },
                ROp::Abort => ReceiverEvent::Abort,
                ROp::PeerAbort(p, reason) => ReceiverEvent::PeerAbort { from: peer(p), reason },
                ROp::PeerLost(p) => ReceiverEvent::PeerLost { peer: peer(p) },
                ROp::Replaced(p) => ReceiverEvent::WriterReplaced { peer: peer(p) },
                ROp::Internal => ReceiverEvent::Internal { detail: "x".into() },
                ROp::Superseded => ReceiverEvent::Superseded { detail: "y".into() },
            };
            // A quarantined writer that comes back (the same process) and confirms ends
            // its part of the quarantine; its new process's answer ends nothing.
            let answer = match &event {
                ReceiverEvent::AbortAck { from } | ReceiverEvent::Done { from, .. } => Some(from.clone()),
                _ => None,
            };
            m.handle(now, event);
            let actions = drain_receiver(&mut m);
            if let Some(p) = answer.filter(|p| ledger.quarantined.contains(p)) {
                if !actions.iter().any(|a| matches!(a, Action::Unconfirmed { from } if *from == p)) && !confirmed.contains(&p) {
                    confirmed.push(p);
                }
            }
            // (Blocks handed over after the end go back at once, `Late`: never the request's.)
            let lets_go = |a: &Action| matches!(a, Action::Release { why, .. } if *why != ReleaseReason::Late);
            if !ledger.quarantined.is_empty() && actions.iter().any(lets_go) {
                let held = ledger.quarantined.iter().find(|p| !confirmed.contains(p));
                prop_assert!(held.is_none(), "quarantined blocks let go while {:?} was unconfirmed", held);
            }
            ledger.check(now, m.state(), m.poll_timeout(), actions);
            for p in m.depends_on().cloned().collect::<Vec<_>>() {
                let mut lost = m.clone();
                lost.handle(now, ReceiverEvent::PeerLost { peer: p.clone() });
                assert_lost_fails(m.state(), lost.state(), &p);
            }
        }
        // The deadlines alone end it, and a fence lifts by its own deadline at the latest,
        // unless it quarantined lost writers: then only their end (or their confirmation,
        // had they come back) lets the blocks go.
        fire_due!(m, ledger, drain_receiver, start + t.lifetime_max() + t.fence_max() + Duration::from_secs(1));
        prop_assert!(ledger.quarantined.is_empty() || (fence && m.mode() == TransferMode::Push));
        let lost: Vec<RankInfo> = ledger.quarantined.iter().filter(|p| !confirmed.contains(p)).cloned().collect();
        prop_assert!(!ledger.no_push || m.mode() == TransferMode::Pull);
        // However long it waits, a quarantine only asks the lost writers again.
        let much_later = start + t.lifetime_max() + t.fence_max() * 10;
        fire_due!(m, ledger, drain_receiver, much_later);
        for (i, p) in lost.iter().enumerate() {
            prop_assert!(!m.is_settled(), "quarantined blocks let go before {p} was gone");
            let later = much_later;
            if i % 2 == 0 {
                // A new process takes the lost writer's rank and answers for itself: that
                // ends nothing (the old one may still hold a post).
                m.handle(later, ReceiverEvent::WriterReplaced { peer: p.clone() });
                m.handle(later, ReceiverEvent::AbortAck { from: p.clone() });
                m.handle(later, ReceiverEvent::Done { from: p.clone(), aux: vec![] });
                let actions = drain_receiver(&mut m);
                let refused = actions.iter().filter(|a| matches!(a, Action::Unconfirmed { from } if from == p)).count();
                prop_assert_eq!(refused, 2, "{:?}", actions);
                ledger.check(later, m.state(), m.poll_timeout(), actions);
                prop_assert!(!m.is_settled(), "{}'s new process ended the quarantine", p);
            }
            m.handle(later, ReceiverEvent::WriterGone { peer: p.clone(), exited: i % 2 == 0 });
            let actions = drain_receiver(&mut m);
            ledger.check(later, m.state(), m.poll_timeout(), actions);
        }
        prop_assert!(m.is_settled(), "receiver still fencing after the fence deadline");
        ledger.check_end(&t);
    }

    /// A push request over a one-sided plane with its transfer info out to every writer,
    /// then any interleaving of losses, new processes in lost ranks, confirmations,
    /// reports of writers gone and time: the blocks never go while a writer that was lost
    /// and then replaced before it confirmed has not been reported gone. (A writer still
    /// heard when the fence bound passed is past every deadline of its own by then, and a
    /// stop before its last post would have been a loss by then: the loss timeout is
    /// shorter than `fence_max`. Its later loss holds nothing.)
    #[test]
    fn a_replaced_writer_never_lets_the_blocks_go(
        n in 1u8..4,
        ops in prop::collection::vec((0u64..12_000, quarantine_op()), 0..32),
    ) {
        let t = timeouts();
        let start = Instant::now();
        let mut now = start;
        let mut m = ReceiverMachine::new(now, t, TransferMode::Push).fence_writes(true);
        let mut ledger = Ledger::new(start);
        m.handle(now, ReceiverEvent::PeersResolved { peers: (0..n).map(peer).collect(), unwatched: vec![] });
        m.handle(now, ReceiverEvent::Allocated { blocks: ledger.blocks(2, true) });
        let actions = drain_receiver(&mut m);
        ledger.check(now, m.state(), m.poll_timeout(), actions);
        // Per writer: lost, replaced while lost, confirmed by its own process, gone.
        let mut w: BTreeMap<u8, (bool, bool, bool, bool)> = BTreeMap::new();
        // Writers live when the fence bound passed.
        let mut live_at_bound: Vec<u8> = Vec::new();
        let held = |w: &BTreeMap<u8, (bool, bool, bool, bool)>, live: &[u8]| {
            w.iter().find(|(p, (_, replaced, confirmed, gone))| *replaced && !*confirmed && !*gone && !live.contains(p)).map(|(p, _)| *p)
        };
        let bound = |actions: &[Action], w: &BTreeMap<u8, (bool, bool, bool, bool)>, live: &mut Vec<u8>| {
            if actions.iter().any(|a| matches!(a, Action::Quarantine { .. })) {
                live.extend((0..n).filter(|p| !w.get(p).is_some_and(|e| e.0)));
            }
        };
        for (dt_ms, op) in ops {
            let next = now + Duration::from_millis(dt_ms);
            // Timeouts, as a driver delivers them: none may let the blocks go either.
            while let Some(d) = m.poll_timeout() {
                if d > next {
                    break;
                }
                m.handle_timeout(d);
                let actions = drain_receiver(&mut m);
                bound(&actions, &w, &mut live_at_bound);
                if let Some(p) = held(&w, &live_at_bound) {
                    prop_assert!(!actions.iter().any(|a| matches!(a, Action::Release { .. })), "released on a deadline while replaced writer {} was unconfirmed", p);
                }
                ledger.check(d, m.state(), m.poll_timeout(), actions);
            }
            now = next;
            let (p, event) = match op {
                QOp::Lost(p) => (p, ReceiverEvent::PeerLost { peer: peer(p) }),
                QOp::Replaced(p) => (p, ReceiverEvent::WriterReplaced { peer: peer(p) }),
                QOp::AbortAck(p) => (p, ReceiverEvent::AbortAck { from: peer(p) }),
                QOp::Done(p) => (p, ReceiverEvent::Done { from: peer(p), aux: vec![] }),
                QOp::Gone(p, exited) => (p, ReceiverEvent::WriterGone { peer: peer(p), exited }),
            };
            // (A rank this request never had: nothing of it counts.)
            let mut other = (false, false, false, false);
            let e = if p < n { w.entry(p).or_default() } else { &mut other };
            match &event {
                ReceiverEvent::PeerLost { .. } => e.0 = true,
                // Only a lost rank's new process is a replacement of the writer.
                ReceiverEvent::WriterReplaced { .. } => e.1 |= e.0,
                ReceiverEvent::AbortAck { .. } | ReceiverEvent::Done { .. } => e.2 |= !e.1,
                _ => e.3 = true,
            }
            m.handle(now, event);
            let actions = drain_receiver(&mut m);
            bound(&actions, &w, &mut live_at_bound);
            if let Some(p) = held(&w, &live_at_bound) {
                prop_assert!(!actions.iter().any(|a| matches!(a, Action::Release { .. })), "released while replaced writer {} was unconfirmed", p);
            }
            ledger.check(now, m.state(), m.poll_timeout(), actions);
        }
        // Every writer reported gone: the blocks go, exactly once.
        let later = now + t.lifetime_max() + t.fence_max();
        fire_due!(m, ledger, drain_receiver, later);
        for p in 0..n {
            m.handle(later, ReceiverEvent::WriterGone { peer: peer(p), exited: true });
            let actions = drain_receiver(&mut m);
            ledger.check(later, m.state(), m.poll_timeout(), actions);
        }
        fire_due!(m, ledger, drain_receiver, later + t.fence_max());
        prop_assert!(m.is_settled());
        ledger.check_end(&t);
    }

    #[test]
    fn merge_is_a_semilattice(a in state(), b in state(), c in state()) {
        prop_assert_eq!(merge(&a, &b), merge(&b, &a));
        prop_assert_eq!(merge(&merge(&a, &b), &c), merge(&a, &merge(&b, &c)));
        prop_assert_eq!(merge(&a, &a), a.clone());
        if a.failure().is_some() || b.failure().is_some() {
            prop_assert!(merge(&a, &b).failure().is_some(), "Failed must dominate");
        }
        if !a.is_terminal() || !b.is_terminal() {
            prop_assert_ne!(merge(&a, &b), State::Done);
        }
        let all = merge_all([&a, &b, &c]);
        prop_assert_eq!(all, Some(merge(&a, &merge(&b, &c))));
    }
}

fn state() -> impl Strategy<Value = State> {
    prop_oneof![
        Just(State::Bootstrapping),
        Just(State::WaitingForInput),
        Just(State::Transferring),
        Just(State::Done),
        reason().prop_map(State::Failed),
    ]
}

/// Seed 003: one pipeline rank `Failed`, the other still `Bootstrapping`. An ordinary
/// input: the request is `Failed`, and nothing asserts.
#[test]
fn merge_of_failed_and_bootstrapping_is_failed() {
    let failed = State::Failed(FailureReason::BootstrapTimeout);
    assert_eq!(merge(&failed, &State::Bootstrapping), failed);
    assert_eq!(merge(&State::Bootstrapping, &failed), failed);
    assert_eq!(
        merge_all([&State::Done, &State::Transferring]),
        Some(State::Transferring)
    );
    assert_eq!(merge_all(std::iter::empty()), None);
}
