//! The prefill side of one request on one prefill rank.
//!
//! ```text
//!                 TransferInfo                 send(blocks)
//! Bootstrapping ─────────────▶ WaitingForInput ───────────▶ Transferring ──▶ Done
//!       │  (send(blocks) first: held, and TransferInfo goes straight to Transferring)
//!       │                                      push: Write, then TransferComplete → Done to decode
//!       │                                      pull: Ready to decode, then ReadDone
//!       └──────────── any state ──────────▶ Failed(reason)  (deadline, abort, peer lost, ...)
//! ```

use std::time::Instant;

use handoff_transport::{BlockId, FailureReason, TransferMode};

use super::{protocol, Action, Core, Peer, PeerMessage, State, Timeouts};
use crate::event::FenceEnd;

/// What can happen to a sender. Fed with [`SenderMachine::handle`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SenderEvent {
    /// Decode's transfer info: where the blocks go and whether it pushes or pulls.
    TransferInfo {
        /// The decode rank that sent it.
        from: Peer,
        /// Push or pull.
        mode: TransferMode,
        /// Decode's destination blocks.
        blocks: Vec<BlockId>,
    },
    /// Decode is alive but has no blocks for this request yet.
    Queued {
        /// The decode rank.
        from: Peer,
    },
    /// Decode refused the request (saturated).
    Rejected {
        /// The decode rank.
        from: Peer,
        /// Why, as decode said.
        reason: FailureReason,
    },
    /// The engine's `send(blocks)`: the prefill KV is computed and these blocks hold it.
    Input {
        /// The blocks, in order.
        blocks: Vec<BlockId>,
        /// The engine's per-request payload for decode (empty if none), sent with `Done`
        /// (push) or `Ready` (pull).
        aux: Vec<u8>,
    },
    /// Push: the data plane finished writing every block.
    TransferComplete,
    /// The data plane failed.
    TransferFailed {
        /// What it said.
        detail: String,
    },
    /// Decode confirms it will not read our blocks any more (pull), answering our abort or
    /// its own failure.
    AbortAck {
        /// The decode rank.
        from: Peer,
    },
    /// Pull: decode read every block.
    ReadDone {
        /// The decode rank.
        from: Peer,
    },
    /// The engine aborted the request.
    Abort,
    /// A peer (decode, or another rank of this request) aborted or failed it.
    PeerAbort {
        /// Who.
        from: Peer,
        /// Why, as the peer said.
        reason: FailureReason,
    },
    /// A peer stopped answering heartbeats.
    PeerLost {
        /// Who.
        peer: Peer,
    },
    /// A peer sent a message that has no place on this side of the protocol.
    Unexpected {
        /// Who.
        from: Peer,
        /// What it sent.
        what: String,
    },
    /// Something broke inside this runtime.
    Internal {
        /// What.
        detail: String,
    },
}

/// One request's lifecycle on one prefill rank. See the [module docs](super).
#[derive(Clone, Debug)]
pub struct SenderMachine {
    core: Core,
    /// The decode rank, once it has said `Queued` or sent its transfer info: the one to
    /// tell if this request fails.
    peer: Option<Peer>,
    mode: TransferMode,
    /// Decode's destination blocks, once its transfer info has arrived.
    dst: Option<Vec<BlockId>>,
    /// True once the engine has handed over its blocks.
    has_input: bool,
    /// The engine's payload for decode, handed over with the blocks.
    aux: Vec<u8>,
    /// A push write was handed to the data plane and has not reported back.
    write_outstanding: bool,
    /// Decode is owed an `AbortAck` as soon as no write is outstanding.
    ack_owed: bool,
    /// Reads are one-sided (RDMA): a failed pull request holds its source blocks until
    /// decode confirms it stopped reading.
    fence_reads: bool,
    /// Failed, with the source blocks held until decode confirms (pull, one-sided).
    fencing: bool,
    /// Pull: decode said `AbortAck` before we failed (it overtook decode's `Abort`): no
    /// read of its can land, so our failure fences nothing.
    acked_early: bool,
    /// The latest instant the driver gave, for deadlines set inside.
    now: Instant,
}

impl SenderMachine {
    /// A new sender in `Bootstrapping`, with its bootstrap deadline armed from `now`.
    pub fn new(now: Instant, timeouts: Timeouts) -> Self {
        Self {
            core: Core::new(now, timeouts),
            peer: None,
            mode: TransferMode::Push,
            dst: None,
            has_input: false,
            aux: Vec::new(),
            write_outstanding: false,
            ack_owed: false,
            fence_reads: false,
            fencing: false,
            acked_early: false,
            now,
        }
    }

    /// Makes a failed pull request hold its source blocks until decode says `AbortAck` or
    /// `ReadDone` (or the fence deadline passes): for data planes whose reads are
    /// one-sided, which this side cannot refuse once a grant is revoked.
    pub fn fence_reads(mut self, on: bool) -> Self {
        self.fence_reads = on;
        self
    }

    /// True once the machine is terminal and no write of its is in flight: its driver may
    /// stop. (A write it started ends by its own deadline; until then the request's actor
    /// stays, so that `AbortAck` is sent only once the write can no longer land.)
    pub fn is_settled(&self) -> bool {
        self.core.state.is_terminal() && !self.write_outstanding && !self.fencing
    }

    /// The current state.
    pub fn state(&self) -> &State {
        &self.core.state
    }

    /// The decode rank this request is paired with, once known (from `Queued` or transfer info).
    pub fn peer(&self) -> Option<&Peer> {
        self.peer.as_ref()
    }

    /// The peers whose loss fails this request at once (its decode rank, once paired).
    pub fn depends_on(&self) -> impl Iterator<Item = &Peer> {
        self.peer.iter()
    }

    /// Blocks the machine holds now (released on the terminal state).
    pub fn held(&self) -> &[BlockId] {
        &self.core.held
    }

    /// The next action to perform, if any.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.core.actions.pop_front()
    }

    /// When to call [`handle_timeout`](Self::handle_timeout); `None` once terminal.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.core.deadline
    }

    /// Fails the request if the current state's deadline has passed at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.now = self.now.max(now);
        if !self.core.timed_out(now) {
            return;
        }
        let reason = match (&self.core.state, self.mode) {
            (State::Bootstrapping, _) => FailureReason::BootstrapTimeout,
            (State::WaitingForInput, _) => FailureReason::WaitingTimeout,
            (State::Transferring, TransferMode::Push) => FailureReason::TransferTimeout,
            (State::Transferring, TransferMode::Pull) => FailureReason::TtlExpired,
            (State::Done | State::Failed(_), _) => {
                // The read fence's deadline: decode's reads have all ended by now.
                self.fencing = false;
                return self.core.release_now(FenceEnd::Bound);
            }
        };
        self.fail(reason, None);
    }

    /// Feeds one event. Never panics, whatever the event and state.
    pub fn handle(&mut self, now: Instant, event: SenderEvent) {
        self.now = self.now.max(now);
        if self.core.state.is_terminal() {
            return self.handle_after_end(event);
        }
        match event {
            SenderEvent::TransferInfo { from, mode, blocks } => {
                self.on_transfer_info(now, from, mode, blocks)
            }
            SenderEvent::Queued { from } => {
                // Decode lives but has no blocks yet; the bootstrap deadline still holds, and
                // if it passes, this is the rank to tell.
                self.peer.get_or_insert(from);
            }
            SenderEvent::Rejected { from, reason } => self.fail(reason, Some(&from)),
            SenderEvent::Input { blocks, aux } => self.on_input(now, blocks, aux),
            SenderEvent::TransferComplete => self.on_transfer_complete(),
            SenderEvent::TransferFailed { detail } => {
                self.write_outstanding = false;
                if self.core.state == State::Transferring {
                    self.fail(FailureReason::TransferFailed { detail }, None);
                }
            }
            SenderEvent::ReadDone { from } => self.on_read_done(from),
            // An acknowledgement that overtook decode's `Abort` (control messages may be
            // reordered): remembered, so the failure it announces fences nothing.
            SenderEvent::AbortAck { from } => {
                if self.peer.as_ref() == Some(&from) {
                    self.acked_early = true;
                }
            }
            SenderEvent::Abort => self.fail(FailureReason::AbortedByEngine, None),
            SenderEvent::PeerAbort { from, reason } => {
                let cause = reason.to_string();
                let peer = from.to_string();
                self.fail(FailureReason::AbortedByPeer { peer, cause }, Some(&from));
            }
            SenderEvent::PeerLost { peer } => {
                if self.peer.as_ref() == Some(&peer) {
                    let name = peer.to_string();
                    self.fail(FailureReason::PeerLost { peer: name }, Some(&peer));
                }
            }
            SenderEvent::Unexpected { from, what } => {
                if self.peer.is_none() && !self.core.state.is_terminal() {
                    // Not paired yet: its invalid message was the one that would have
                    // paired us (e.g. transfer info with a region we cannot use), and it
                    // now waits on us. Tell it, or it waits out its whole deadline.
                    self.peer = Some(from.clone());
                }
                self.fail(protocol(&from, format!("unexpected {what}")), None)
            }
            SenderEvent::Internal { detail } => self.fail(FailureReason::Internal { detail }, None),
        }
    }

    fn on_transfer_info(
        &mut self,
        now: Instant,
        from: Peer,
        mode: TransferMode,
        blocks: Vec<BlockId>,
    ) {
        if let Some(p) = &self.peer {
            if *p != from {
                let detail = format!("transfer info for a request paired with {p}");
                return self.fail(protocol(&from, detail), None);
            }
        }
        if let Some(dst) = &self.dst {
            if *dst == blocks && self.mode == mode {
                return; // a duplicate (retry, duplicated frame): harmless
            }
            return self.fail(protocol(&from, "a second, different transfer info"), None);
        }
        self.peer = Some(from);
        self.mode = mode;
        self.dst = Some(blocks);
        if self.has_input {
            self.start_transfer(now);
        } else {
            let limit = self.core.timeouts.waiting;
            self.core.advance(now, State::WaitingForInput, limit);
        }
    }

    fn on_input(&mut self, now: Instant, blocks: Vec<BlockId>, aux: Vec<u8>) {
        if self.has_input {
            // The engine sent twice: keep the first set, give the second back.
            return self.core.release_late(blocks);
        }
        self.has_input = true;
        self.core.held = blocks;
        self.aux = aux;
        if self.core.state == State::WaitingForInput {
            self.start_transfer(now);
        }
    }

    fn start_transfer(&mut self, now: Instant) {
        let (Some(peer), Some(dst)) = (self.peer.clone(), self.dst.clone()) else {
            return self.fail(internal("transfer started without transfer info"), None);
        };
        if dst.len() != self.core.held.len() {
            let detail = format!(
                "decode granted {} blocks, prefill holds {}",
                dst.len(),
                self.core.held.len()
            );
            return self.fail(protocol(&peer, detail), None);
        }
        let src = self.core.held.clone();
        match self.mode {
            TransferMode::Push => {
                let limit = self.core.timeouts.transfer;
                self.core.advance(now, State::Transferring, limit);
                self.write_outstanding = true;
                // The state's deadline is the write's: one deadline, decided here.
                let deadline = self.core.deadline.unwrap_or(now + limit);
                self.core.actions.push_back(Action::Write {
                    to: peer,
                    src,
                    dst,
                    deadline,
                });
            }
            TransferMode::Pull => {
                let limit = self.core.timeouts.pull_ttl;
                self.core.advance(now, State::Transferring, limit);
                let aux = self.aux.clone();
                let hold = limit;
                self.core.send(
                    &peer,
                    PeerMessage::Ready {
                        blocks: src,
                        aux,
                        hold,
                    },
                );
            }
        }
    }

    fn on_transfer_complete(&mut self) {
        self.write_outstanding = false;
        if self.core.state != State::Transferring || self.mode != TransferMode::Push {
            return; // stale completion
        }
        if let Some(peer) = self.peer.clone() {
            let aux = std::mem::take(&mut self.aux);
            self.core.send(&peer, PeerMessage::Done { aux });
        }
        self.core.finish(State::Done);
    }

    fn on_read_done(&mut self, from: Peer) {
        if self.peer.as_ref() != Some(&from) {
            return self.fail(
                protocol(&from, "ReadDone from a rank not paired with this request"),
                None,
            );
        }
        match (&self.core.state, self.mode) {
            (State::Transferring, TransferMode::Pull) => self.core.finish(State::Done),
            _ => {
                let detail = format!("ReadDone in {} ({:?} mode)", self.core.state, self.mode);
                self.fail(protocol(&from, detail), None)
            }
        }
    }

    /// After the end: blocks handed over are released at once; a write reporting back
    /// settles the machine (and pays an `AbortAck` owed); decode's abort is acknowledged;
    /// everything else is stale.
    fn handle_after_end(&mut self, event: SenderEvent) {
        match event {
            SenderEvent::Input { blocks, .. } => self.core.release_late(blocks),
            SenderEvent::TransferComplete | SenderEvent::TransferFailed { .. } => {
                self.write_outstanding = false;
                self.pay_ack();
            }
            SenderEvent::PeerAbort { from, .. } if self.peer.as_ref() == Some(&from) => {
                self.owe_ack();
            }
            SenderEvent::AbortAck { from } | SenderEvent::ReadDone { from }
                if self.fencing && self.peer.as_ref() == Some(&from) =>
            {
                self.fencing = false;
                self.core.release_now(FenceEnd::Confirmed);
            }
            _ => {}
        }
    }

    /// Push mode, decode granted its blocks: decode holds them until we say no write of
    /// ours can land any more.
    fn owe_ack(&mut self) {
        if self.mode == TransferMode::Push && self.dst.is_some() {
            self.ack_owed = true;
            self.pay_ack();
        }
    }

    fn pay_ack(&mut self) {
        if !self.ack_owed || self.write_outstanding {
            return;
        }
        if let Some(peer) = self.peer.clone() {
            self.ack_owed = false;
            self.core.send(&peer, PeerMessage::AbortAck);
        }
    }

    /// Fails the request: tells the paired decode rank (unless it is the one that caused
    /// the failure), releases every held block, and, in push mode, owes decode an
    /// `AbortAck` once no write is in flight.
    fn fail(&mut self, reason: FailureReason, caused_by: Option<&Peer>) {
        if self.core.state.is_terminal() {
            return;
        }
        if let Some(peer) = self.peer.clone() {
            if caused_by != Some(&peer) {
                self.core.send(
                    &peer,
                    PeerMessage::Abort {
                        reason: reason.clone(),
                    },
                );
            }
        }
        let readable = self.fence_reads
            && self.mode == TransferMode::Pull
            && self.core.state == State::Transferring
            && !self.acked_early;
        if readable {
            // Decode may be reading our blocks one-sidedly: hold them until it confirms.
            self.fencing = true;
            let until = self.now + self.core.timeouts.fence_max();
            self.core.finish_fenced(State::Failed(reason), until);
        } else {
            self.core.finish(State::Failed(reason));
        }
        self.owe_ack();
    }
}

fn internal(detail: &str) -> FailureReason {
    FailureReason::Internal {
        detail: detail.to_string(),
    }
}
