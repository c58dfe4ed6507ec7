//! The request lifecycle as sans-IO state machines.
//!
//! A [`SenderMachine`] (one per request per prefill rank) and a [`ReceiverMachine`] (one per
//! request per decode rank) are plain data: they read no clock, do no IO and spawn nothing.
//! Their driver (the request actor, the simulator, a property test) calls, in any order:
//! - `handle(now, event)` when something happened,
//! - `handle_timeout(now)` when the instant from `poll_timeout()` has passed,
//! - `poll_action()` until it returns `None`, performing each action,
//! - `poll_timeout()` to learn when to call `handle_timeout` next.
//!
//! States only move forward (`Bootstrapping → WaitingForInput → Transferring → Done`);
//! `Failed` can be reached from any non-terminal state. Every non-terminal state has a
//! deadline. On entering a terminal state the machine emits exactly one
//! [`Action::Release`] holding every block it held; blocks handed to it after that are
//! released at once. Nothing a peer sends can make a machine panic: input that does not fit
//! the state is either ignored (duplicates, stale messages) or fails the request with
//! [`FailureReason::Protocol`].

mod receiver;
mod sender;

pub use receiver::{ReceiverEvent, ReceiverMachine};
pub use sender::{SenderEvent, SenderMachine};

use std::collections::VecDeque;
use std::fmt;
use std::time::{Duration, Instant};

use handoff_transport::{BlockId, FailureReason, RankInfo, TransferMode};

use crate::event::{FenceEnd, ReleaseReason};

/// Default time a request may spend in `Bootstrapping`: SGLang's
/// `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` default, 300 s. With admission control a
/// saturated decode answers `Rejected(Busy)` at once, so this is the bound for a peer that is
/// silent, not for one that is busy (seed 003).
pub const BOOTSTRAP_TIMEOUT_DEFAULT: Duration = Duration::from_secs(300);

/// Default time a request may spend in `WaitingForInput`: SGLang's waiting timeout, 300 s.
/// On prefill this bounds the engine's prefill; on decode it bounds the wait for prefill's
/// data (seed 001: a receive without a timeout hangs forever).
pub const WAITING_TIMEOUT_DEFAULT: Duration = Duration::from_secs(300);

/// Default time one push transfer (or one pull read, on decode) may take once started.
/// A long prompt's KV cache is a few GB; even at 1 GB/s that is seconds, so 60 s means a
/// transfer that is stuck, not one that is slow.
pub const TRANSFER_TIMEOUT_DEFAULT: Duration = Duration::from_secs(60);

/// Default time prefill holds blocks in pull mode waiting for decode to read them: vLLM's
/// `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, 480 s (seed 002).
pub const PULL_TTL_DEFAULT: Duration = Duration::from_secs(480);

/// How long past a transfer's deadline a data plane may take to answer: its teardown
/// (UCX force-closes the endpoint, cancelling what it had in flight) and the answer's way
/// back. The request actor waits this long before it reports the transfer failed itself,
/// which only a stuck plane makes it do (and says so in the log); every fence outlasts it.
pub const PLANE_ANSWER_GRACE: Duration = Duration::from_secs(5);

/// How often a decode request whose blocks are quarantined for lost writers asks each of
/// them again (`Abort`): its acknowledgement may have been lost with its connection, and a
/// writer that is back answers at once (its request has ended, or ends and answers once no
/// write of its is in flight).
pub const QUARANTINE_ASK_EVERY: Duration = Duration::from_secs(5);

/// The deadlines of every non-terminal state. Each is measured from entering the state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// Bound on `Bootstrapping`.
    pub bootstrap: Duration,
    /// Bound on `WaitingForInput`.
    pub waiting: Duration,
    /// Bound on `Transferring` in push mode, and on decode's reads in pull mode.
    pub transfer: Duration,
    /// Bound on prefill's `Transferring` in pull mode: how long blocks wait to be read.
    pub pull_ttl: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            bootstrap: BOOTSTRAP_TIMEOUT_DEFAULT,
            waiting: WAITING_TIMEOUT_DEFAULT,
            transfer: TRANSFER_TIMEOUT_DEFAULT,
            pull_ttl: PULL_TTL_DEFAULT,
        }
    }
}

impl Timeouts {
    /// The longest a request can live: the sum of every stage's bound. A machine is terminal
    /// by `created + lifetime_max()` whatever its inputs (the property tests check it).
    pub fn lifetime_max(&self) -> Duration {
        self.bootstrap + self.waiting + self.transfer.max(self.pull_ttl)
    }

    /// The longest a failed push-mode decode request holds its blocks waiting for its
    /// prefill ranks to confirm that no write of theirs can still land (`AbortAck`). A
    /// prefill rank that got the transfer info can start a write no later than its waiting
    /// deadline and finish it within its transfer deadline; the info itself may still be in
    /// flight for up to a bootstrap timeout, and its plane answers within
    /// [`PLANE_ANSWER_GRACE`] of the transfer's deadline. Normally the acknowledgement
    /// comes in one round trip; this bound only matters when it is lost.
    pub fn fence_max(&self) -> Duration {
        self.lifetime_max() + PLANE_ANSWER_GRACE
    }
}

/// Where a request is in its lifecycle, on one rank.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum State {
    /// Waiting for the other side: prefill for decode's transfer info; decode for the
    /// bootstrap answer and its own block allocation.
    Bootstrapping,
    /// Waiting for the input: prefill for the engine's `send(blocks)`; decode for prefill's
    /// `Done` (push) or `Ready` (pull).
    WaitingForInput,
    /// Bytes are moving (or, pull mode on prefill, waiting to be read under a TTL).
    Transferring,
    /// The blocks arrived (decode) or were delivered (prefill).
    Done,
    /// The request ended without its blocks being delivered, for the reason given.
    Failed(FailureReason),
}

/// The phase of a [`State`], without the failure reason: what "forward only" is measured in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// See [`State::Bootstrapping`].
    Bootstrapping,
    /// See [`State::WaitingForInput`].
    WaitingForInput,
    /// See [`State::Transferring`].
    Transferring,
    /// Terminal: [`State::Done`] or [`State::Failed`].
    Terminal,
}

impl State {
    /// The state's name without its reason (`Bootstrapping`, ..., `Failed`), as event
    /// streams print it.
    pub fn name(&self) -> &'static str {
        match self {
            State::Bootstrapping => "Bootstrapping",
            State::WaitingForInput => "WaitingForInput",
            State::Transferring => "Transferring",
            State::Done => "Done",
            State::Failed(_) => "Failed",
        }
    }

    /// The state's phase.
    pub fn phase(&self) -> Phase {
        match self {
            State::Bootstrapping => Phase::Bootstrapping,
            State::WaitingForInput => Phase::WaitingForInput,
            State::Transferring => Phase::Transferring,
            State::Done | State::Failed(_) => Phase::Terminal,
        }
    }

    /// True for `Done` and `Failed`.
    pub fn is_terminal(&self) -> bool {
        self.phase() == Phase::Terminal
    }

    /// The failure reason, if the state is `Failed`.
    pub fn failure(&self) -> Option<&FailureReason> {
        match self {
            State::Failed(reason) => Some(reason),
            _ => None,
        }
    }

    /// Position in the merge order: `Failed` (by reason) below everything, then the least
    /// advanced state first.
    fn merge_rank(&self) -> u8 {
        match self {
            State::Failed(_) => 0,
            State::Bootstrapping => 1,
            State::WaitingForInput => 2,
            State::Transferring => 3,
            State::Done => 4,
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            State::Bootstrapping => f.write_str("Bootstrapping"),
            State::WaitingForInput => f.write_str("WaitingForInput"),
            State::Transferring => f.write_str("Transferring"),
            State::Done => f.write_str("Done"),
            State::Failed(reason) => write!(f, "Failed({reason})"),
        }
    }
}

/// Merges the states of two ranks of one request into the request's state.
///
/// A total function: `Failed` dominates (of two failures, the smaller reason in
/// [`FailureReason`]'s order, so the result does not depend on merge order); otherwise the
/// least advanced state. It is the minimum under one total order, hence commutative,
/// associative and idempotent. One rank `Failed` while another is still `Bootstrapping`
/// (seed 003) is an ordinary input: the request is `Failed`.
pub fn merge(a: &State, b: &State) -> State {
    let key = |s: &State| (s.merge_rank(), s.failure().cloned());
    if key(b) < key(a) {
        b.clone()
    } else {
        a.clone()
    }
}

/// Merges the states of every rank of one request; `None` for no ranks.
pub fn merge_all<'a>(states: impl IntoIterator<Item = &'a State>) -> Option<State> {
    states.into_iter().fold(None, |acc, s| match acc {
        None => Some(s.clone()),
        Some(a) => Some(merge(&a, s)),
    })
}

/// A peer rank, as the machines see it: who to send to, and whose messages to believe.
pub type Peer = RankInfo;

/// A control message between the two sides about one request: what a machine asks its
/// driver to send to a peer, and what a peer's machine sent (the root routes it to the
/// request's machine as an event, [`crate::router::MachineEvent::inbound`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerMessage {
    /// Decode → prefill: where to put the blocks, and how.
    TransferInfo {
        /// Push or pull.
        mode: TransferMode,
        /// Decode's destination blocks, in order.
        blocks: Vec<BlockId>,
    },
    /// Decode → prefill: alive, but no blocks allocated yet (saturated).
    Queued,
    /// Prefill → decode (pull): the blocks are ready to be read.
    Ready {
        /// Prefill's source blocks, in order.
        blocks: Vec<BlockId>,
        /// The engine's per-request payload (empty if none).
        aux: Vec<u8>,
        /// How long, at the least, prefill keeps the blocks from now (its pull TTL).
        hold: Duration,
    },
    /// Prefill → decode (push): every block has been written.
    Done {
        /// The engine's per-request payload (empty if none).
        aux: Vec<u8>,
    },
    /// Decode → prefill (pull): every block has been read.
    ReadDone,
    /// Decode → prefill: decode is saturated and refuses the request (sent by decode's
    /// admission control, never by a machine).
    Rejected {
        /// Why.
        reason: FailureReason,
    },
    /// Prefill → decode (push): this request ended here and no write of ours into your
    /// blocks is in flight or can start: you may release them.
    AbortAck,
    /// Either way: this request has failed here; free its blocks.
    Abort {
        /// Why.
        reason: FailureReason,
    },
}

impl PeerMessage {
    /// The message's name, as the wire calls it (for logs).
    pub fn name(&self) -> &'static str {
        match self {
            Self::TransferInfo { .. } => "TransferInfo",
            Self::Queued => "Queued",
            Self::Ready { .. } => "Ready",
            Self::Done { .. } => "Done",
            Self::ReadDone => "ReadDone",
            Self::Rejected { .. } => "Rejected",
            Self::AbortAck => "AbortAck",
            Self::Abort { .. } => "Abort",
        }
    }

    /// Bytes this message holds in memory: what a buffer of peers' messages is bounded by
    /// (a `TransferInfo` or `Ready` may name up to a million blocks).
    pub fn held_bytes(&self) -> usize {
        let payload = match self {
            Self::TransferInfo { blocks, .. } => std::mem::size_of_val(blocks.as_slice()),
            Self::Ready { blocks, aux, .. } => std::mem::size_of_val(blocks.as_slice()) + aux.len(),
            Self::Done { aux } => aux.len(),
            Self::Rejected { reason } | Self::Abort { reason } => reason.to_string().len(),
            Self::Queued | Self::ReadDone | Self::AbortAck => 0,
        };
        std::mem::size_of::<Self>() + payload
    }
}

/// What a machine asks its driver to do. Drained with `poll_action()`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send a control message to a peer.
    Send {
        /// The peer.
        to: Peer,
        /// The message.
        msg: PeerMessage,
    },
    /// Prefill, push mode: write `src` blocks into the peer's `dst` blocks, then report
    /// `TransferComplete` or `TransferFailed`.
    Write {
        /// The peer that granted `dst`.
        to: Peer,
        /// Local blocks, in order.
        src: Vec<BlockId>,
        /// The peer's blocks, in order; same length as `src`.
        dst: Vec<BlockId>,
        /// The transfer's one deadline, decided here: the data plane posts nothing after
        /// it and answers by it (`Link::write`).
        deadline: Instant,
    },
    /// Decode, pull mode: read the peer's `src` blocks into local `dst` blocks, then report
    /// `ReadComplete` or `TransferFailed`.
    Read {
        /// The peer holding `src`.
        from: Peer,
        /// The peer's blocks, in order.
        src: Vec<BlockId>,
        /// Local blocks, in order; same length as `src`.
        dst: Vec<BlockId>,
        /// The transfer's one deadline: the earlier of the request's transfer deadline and
        /// the end of the peer's hold on `src` (`Link::read`).
        deadline: Instant,
    },
    /// The machine no longer holds these blocks: the engine may free or reuse them.
    /// Emitted exactly once for every block the machine was given.
    Release {
        /// The blocks.
        blocks: Vec<BlockId>,
        /// Why they go.
        why: ReleaseReason,
    },
    /// Decode: a prefill rank's per-request payload arrived (non-empty only); the engine
    /// reads it with the request's blocks once the request is `Done`.
    Aux {
        /// The prefill rank that sent it.
        from: Peer,
        /// The bytes, as the prefill engine gave them.
        bytes: Vec<u8>,
    },
    /// Decode, push, one-sided plane: the fence bound passed while these lost prefill ranks
    /// had not confirmed. The request's `blocks` stay held; the driver reports each rank
    /// with [`ReceiverEvent::WriterGone`] once its
    /// process has exited (at once, `exited: false`, when it cannot watch it), unless the
    /// rank confirms first.
    Quarantine {
        /// The lost prefill ranks.
        peers: Vec<Peer>,
        /// How many blocks stay held.
        blocks: usize,
        /// Those of `peers` whose rank a new process holds since ([`ReceiverEvent::WriterReplaced`]):
        /// the writer to watch is one of the rank's earlier processes, not its current one.
        replaced: Vec<Peer>,
    },
    /// Decode, quarantined: a new process took a quarantined writer's rank after the
    /// quarantine began. Watch the rank's earlier processes as well (the quarantine's watch
    /// may have found the new one), and report the writer gone once they have exited.
    WatchEarlier {
        /// The prefill rank.
        peer: Peer,
    },
    /// Decode: an `AbortAck` or `Done` from a prefill rank that is a new process since it
    /// was lost ([`ReceiverEvent::WriterReplaced`]): the new process's answer, not the lost
    /// writer's, so it ended nothing. For logs and metrics.
    Unconfirmed {
        /// The prefill rank.
        from: Peer,
    },
    /// Decode: made for push over a one-sided plane, the request runs as pull, since these
    /// prefill ranks are processes the driver cannot watch (`ReceiverEvent::PeersResolved`).
    /// Emitted before the transfer info goes out. For logs and metrics.
    PullsInstead {
        /// The prefill ranks that cannot be watched.
        unwatched: Vec<Peer>,
    },
    /// The state changed (emitted after every transition, for events and logs).
    StateChanged(State),
}

/// The part shared by both machines: the state, its deadline, the held blocks, the queue
/// of actions, and the one way to move to a new state.
#[derive(Clone, Debug)]
struct Core {
    state: State,
    deadline: Option<Instant>,
    held: Vec<BlockId>,
    actions: VecDeque<Action>,
    timeouts: Timeouts,
}

impl Core {
    fn new(now: Instant, timeouts: Timeouts) -> Self {
        Self {
            state: State::Bootstrapping,
            deadline: Some(now + timeouts.bootstrap),
            held: Vec::new(),
            actions: VecDeque::new(),
            timeouts,
        }
    }

    /// Moves forward to a non-terminal state and arms its deadline.
    fn advance(&mut self, now: Instant, next: State, limit: Duration) {
        debug_assert!(!next.is_terminal());
        debug_assert!(
            next.phase() > self.state.phase(),
            "{} -> {next}",
            self.state
        );
        self.state = next.clone();
        self.deadline = Some(now + limit);
        self.actions.push_back(Action::StateChanged(next));
    }

    /// Moves to `Failed` but keeps the blocks until [`Core::release_now`] (or the fence
    /// deadline `until`): peers may still be writing into them.
    fn finish_fenced(&mut self, end: State, until: Instant) {
        debug_assert!(end.is_terminal());
        if self.state.is_terminal() {
            return;
        }
        self.state = end.clone();
        self.deadline = Some(until);
        self.actions.push_back(Action::StateChanged(end));
    }

    /// Ends a fence (as `how` says): releases every held block.
    fn release_now(&mut self, how: FenceEnd) {
        self.deadline = None;
        let blocks = std::mem::take(&mut self.held);
        let why = self.ended_why(Some(how));
        self.actions.push_back(Action::Release { blocks, why });
    }

    /// Why blocks go now that the machine is terminal (`fence`: how a fence ended).
    fn ended_why(&self, fence: Option<FenceEnd>) -> ReleaseReason {
        match &self.state {
            State::Failed(reason) => ReleaseReason::Failed {
                reason: reason.clone(),
                fence,
            },
            _ => ReleaseReason::Done,
        }
    }

    /// Moves to `Done` or `Failed`, disarms the deadline and releases every held block.
    fn finish(&mut self, end: State) {
        debug_assert!(end.is_terminal());
        if self.state.is_terminal() {
            return;
        }
        self.state = end.clone();
        self.deadline = None;
        self.actions.push_back(Action::StateChanged(end));
        let blocks = std::mem::take(&mut self.held);
        let why = self.ended_why(None);
        self.actions.push_back(Action::Release { blocks, why });
    }

    /// Takes blocks that arrive after the end: they are released at once.
    fn release_late(&mut self, blocks: Vec<BlockId>) {
        if !blocks.is_empty() {
            self.actions.push_back(Action::Release {
                blocks,
                why: ReleaseReason::Late,
            });
        }
    }

    fn send(&mut self, to: &Peer, msg: PeerMessage) {
        self.actions.push_back(Action::Send {
            to: to.clone(),
            msg,
        });
    }

    fn timed_out(&self, now: Instant) -> bool {
        self.deadline.is_some_and(|d| now >= d)
    }
}

/// A protocol failure naming the peer.
fn protocol(peer: &Peer, detail: impl fmt::Display) -> FailureReason {
    FailureReason::Protocol {
        detail: format!("{peer}: {detail}"),
    }
}
