//! The prefill side of one request on one prefill rank.
//!
//! A prefill rank sends to every decode rank that reads from it: one, or, where decode's
//! TP size is a multiple of prefill's, `decode_tp / prefill_tp` of them, each taking its
//! own KV heads ([`handoff_transport::tp::decode_share`]). The request waits for every one
//! of them, moves to each, and is `Done` only when each has its blocks; any failure is told
//! to all of them.
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
    /// Push: the data plane finished writing every block to one decode rank.
    TransferComplete {
        /// The decode rank written to.
        to: Peer,
    },
    /// The data plane failed a write to one decode rank.
    TransferFailed {
        /// The decode rank written to.
        to: Peer,
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
    /// A newer process holds this worker's rank now ([`FailureReason::Superseded`]).
    Superseded {
        /// Who holds it, as the directory said.
        detail: String,
    },
}

/// One decode rank this prefill rank serves, and how far it has got.
#[derive(Clone, Debug)]
struct Reader {
    peer: Peer,
    /// Its destination blocks, once its transfer info has arrived.
    dst: Option<Vec<BlockId>>,
    /// Our write to it was posted (push) or `Ready` sent to it (pull).
    started: bool,
    /// Push: our write to it finished; pull: it read every block.
    finished: bool,
    /// A push write to it was handed to the data plane and has not reported back.
    write_outstanding: bool,
    /// It is owed an `AbortAck` as soon as no write to it is outstanding.
    ack_owed: bool,
    /// Pull: it said `AbortAck` before we failed (it overtook its `Abort`): no read of its
    /// can land, so our failure fences nothing for it.
    acked_early: bool,
    /// Failed, and its reads may still land in our blocks (pull, one-sided) until it
    /// confirms.
    fenced: bool,
}

impl Reader {
    fn new(peer: Peer) -> Self {
        Self {
            peer,
            dst: None,
            started: false,
            finished: false,
            write_outstanding: false,
            ack_owed: false,
            acked_early: false,
            fenced: false,
        }
    }
}

/// One request's lifecycle on one prefill rank. See the [module docs](super).
#[derive(Clone, Debug)]
pub struct SenderMachine {
    core: Core,
    /// This rank's TP group size and rank: which decode ranks read from it, and how many.
    tp: (u32, u32),
    /// The decode ranks paired so far (from `Queued` or transfer info), in arrival order.
    readers: Vec<Reader>,
    /// How many decode ranks read from this rank, once the first has said who it is.
    expected: usize,
    /// Push or pull, as the first transfer info said (every reader must agree).
    mode: Option<TransferMode>,
    /// True once the engine has handed over its blocks.
    has_input: bool,
    /// The engine's payload for decode, handed over with the blocks.
    aux: Vec<u8>,
    /// Reads are one-sided (RDMA): a failed pull request holds its source blocks until
    /// every decode rank that may be reading confirms it stopped.
    fence_reads: bool,
    /// The latest instant the driver gave, for deadlines set inside.
    now: Instant,
}

impl SenderMachine {
    /// A new sender in `Bootstrapping`, with its bootstrap deadline armed from `now`.
    pub fn new(now: Instant, timeouts: Timeouts) -> Self {
        Self {
            core: Core::new(now, timeouts),
            tp: (1, 0),
            readers: Vec::new(),
            expected: 1,
            mode: None,
            has_input: false,
            aux: Vec::new(),
            fence_reads: false,
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

    /// This rank's place in its TP group (`tp_size`, `tp_rank`; 1 and 0 by default): the
    /// decode ranks that read from it are those of
    /// [`decode_share`](handoff_transport::tp::decode_share), and the request waits for
    /// each of them.
    pub fn tp(mut self, tp_size: u32, tp_rank: u32) -> Self {
        self.tp = (tp_size, tp_rank);
        self
    }

    /// True once the machine is terminal and no write of its is in flight: its driver may
    /// stop. (A write it started ends by its own deadline; until then the request's actor
    /// stays, so that `AbortAck` is sent only once the write can no longer land.)
    pub fn is_settled(&self) -> bool {
        self.core.state.is_terminal()
            && !self.readers.iter().any(|r| r.write_outstanding || r.fenced)
    }

    /// The current state.
    pub fn state(&self) -> &State {
        &self.core.state
    }

    /// The decode ranks this request is paired with so far (from `Queued` or transfer
    /// info), in the order they came.
    pub fn peers(&self) -> impl Iterator<Item = &Peer> {
        self.readers.iter().map(|r| &r.peer)
    }

    /// The peers whose loss fails this request at once: its decode ranks, once paired,
    /// until each has its blocks (one that has them may go: it needs nothing more of us).
    pub fn depends_on(&self) -> impl Iterator<Item = &Peer> {
        self.readers.iter().filter(|r| !r.finished).map(|r| &r.peer)
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
            (State::Transferring, Some(TransferMode::Pull)) => FailureReason::TtlExpired,
            (State::Transferring, _) => FailureReason::TransferTimeout,
            (State::Done | State::Failed(_), _) => {
                // The read fence's deadline: decode's reads have all ended by now.
                for r in &mut self.readers {
                    r.fenced = false;
                }
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
                // if it passes, this is a rank to tell.
                if let Err(detail) = self.pair(&from) {
                    self.refuse(&from, detail);
                }
            }
            SenderEvent::Rejected { from, reason } => self.fail(reason, Some(&from)),
            SenderEvent::Input { blocks, aux } => self.on_input(now, blocks, aux),
            SenderEvent::TransferComplete { to } => self.on_transfer_complete(&to),
            SenderEvent::TransferFailed { to, detail } => {
                if let Some(r) = self.reader_mut(&to) {
                    r.write_outstanding = false;
                }
                if self.core.state == State::Transferring {
                    self.fail(FailureReason::TransferFailed { detail }, None);
                }
            }
            SenderEvent::ReadDone { from } => self.on_read_done(from),
            // An acknowledgement that overtook decode's `Abort` (control messages may be
            // reordered): remembered, so the failure it announces fences nothing.
            SenderEvent::AbortAck { from } => {
                if let Some(r) = self.reader_mut(&from) {
                    r.acked_early = true;
                }
            }
            SenderEvent::Abort => self.fail(FailureReason::AbortedByEngine, None),
            SenderEvent::PeerAbort { from, reason } => {
                let cause = reason.to_string();
                let peer = from.to_string();
                self.fail(FailureReason::AbortedByPeer { peer, cause }, Some(&from));
            }
            SenderEvent::PeerLost { peer } => {
                if self.reader(&peer).is_some_and(|r| !r.finished) {
                    let name = peer.to_string();
                    self.fail(FailureReason::PeerLost { peer: name }, Some(&peer));
                }
            }
            SenderEvent::Unexpected { from, what } => {
                if self.readers.is_empty() {
                    // Not paired yet: its invalid message was the one that would have
                    // paired us (e.g. transfer info with a region we cannot use), and it
                    // now waits on us. Tell it, or it waits out its whole deadline.
                    self.readers.push(Reader::new(from.clone()));
                }
                self.fail(protocol(&from, format!("unexpected {what}")), None)
            }
            SenderEvent::Internal { detail } => self.fail(FailureReason::Internal { detail }, None),
            SenderEvent::Superseded { detail } => {
                self.fail(FailureReason::Superseded { detail }, None)
            }
        }
    }

    fn reader(&self, peer: &Peer) -> Option<&Reader> {
        self.readers.iter().find(|r| r.peer == *peer)
    }

    fn reader_mut(&mut self, peer: &Peer) -> Option<&mut Reader> {
        self.readers.iter_mut().find(|r| r.peer == *peer)
    }

    /// Pairs a decode rank with this request (if it is not already): one of the same
    /// decode engine and dp rank as those before it, whose TP rank reads from ours
    /// ([`decode_share`](handoff_transport::tp::decode_share)) and is not taken. Its index.
    fn pair(&mut self, from: &Peer) -> Result<usize, String> {
        if let Some(i) = self.readers.iter().position(|r| r.peer == *from) {
            return Ok(i);
        }
        let (tp_size, tp_rank) = self.tp;
        let share =
            handoff_transport::tp::decode_share(tp_size, from.tp_size, tp_rank).map_err(|e| {
                format!(
                    "decode tp {} against prefill tp {tp_size}: {e}",
                    from.tp_size
                )
            })?;
        if let Some(first) = self.readers.first() {
            let p = &first.peer;
            if (&p.engine_id, p.dp_rank, p.tp_size) != (&from.engine_id, from.dp_rank, from.tp_size)
            {
                return Err(format!(
                    "a rank of another decode for a request paired with {p}"
                ));
            }
        }
        if let Some(taken) = self.readers.iter().find(|r| r.peer.tp_rank == from.tp_rank) {
            return Err(format!(
                "transfer info for a request paired with {}",
                taken.peer
            ));
        }
        if !share.contains(&from.tp_rank) {
            return Err(format!(
                "decode tp rank {} does not read from prefill tp rank {tp_rank} (its decode ranks: {share:?})",
                from.tp_rank
            ));
        }
        self.expected = share.len();
        self.readers.push(Reader::new(from.clone()));
        Ok(self.readers.len() - 1)
    }

    /// Fails the request for a rank that cannot pair with it, and tells that rank too (it
    /// waits on us otherwise).
    fn refuse(&mut self, from: &Peer, detail: String) {
        let reason = protocol(from, detail);
        if self.reader(from).is_none() {
            self.core.send(
                from,
                PeerMessage::Abort {
                    reason: reason.clone(),
                },
            );
        }
        self.fail(reason, None)
    }

    /// Every decode rank of this request has said where its blocks go.
    fn all_infos_in(&self) -> bool {
        self.readers.len() == self.expected && self.readers.iter().all(|r| r.dst.is_some())
    }

    fn on_transfer_info(
        &mut self,
        now: Instant,
        from: Peer,
        mode: TransferMode,
        blocks: Vec<BlockId>,
    ) {
        let i = match self.pair(&from) {
            Ok(i) => i,
            Err(detail) => return self.refuse(&from, detail),
        };
        if let Some(dst) = &self.readers[i].dst {
            if *dst == blocks && self.mode == Some(mode) {
                return; // a duplicate (retry, duplicated frame): harmless
            }
            return self.fail(protocol(&from, "a second, different transfer info"), None);
        }
        if self.mode.is_some_and(|m| m != mode) {
            let detail = format!(
                "{mode:?} mode for a request another decode rank set to {:?}",
                self.mode
            );
            return self.fail(protocol(&from, detail), None);
        }
        self.mode = Some(mode);
        self.readers[i].dst = Some(blocks);
        if !self.all_infos_in() {
            return; // the other decode ranks are still to come, under the same deadline
        }
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
        let held = self.core.held.len();
        if let Some(r) = self
            .readers
            .iter()
            .find(|r| r.dst.as_ref().is_none_or(|d| d.len() != held))
        {
            let granted = r.dst.as_ref().map_or(0, Vec::len);
            let detail = format!("decode granted {granted} blocks, prefill holds {held}");
            let peer = r.peer.clone();
            return self.fail(protocol(&peer, detail), None);
        }
        match self.mode.unwrap_or(TransferMode::Push) {
            TransferMode::Push => {
                let limit = self.core.timeouts.transfer;
                self.core.advance(now, State::Transferring, limit);
                // The state's deadline is every write's: one deadline, decided here.
                let deadline = self.core.deadline.unwrap_or(now + limit);
                for r in &mut self.readers {
                    r.started = true;
                    r.write_outstanding = true;
                    self.core.actions.push_back(Action::Write {
                        to: r.peer.clone(),
                        src: self.core.held.clone(),
                        dst: r.dst.clone().unwrap_or_default(),
                        deadline,
                    });
                }
            }
            TransferMode::Pull => {
                let limit = self.core.timeouts.pull_ttl;
                self.core.advance(now, State::Transferring, limit);
                for i in 0..self.readers.len() {
                    self.readers[i].started = true;
                    let peer = self.readers[i].peer.clone();
                    let msg = PeerMessage::Ready {
                        blocks: self.core.held.clone(),
                        aux: self.aux.clone(),
                        hold: limit,
                    };
                    self.core.send(&peer, msg);
                }
            }
        }
    }

    /// Ends `Done` once every decode rank has its blocks.
    fn finish_if_all_done(&mut self) {
        if self.readers.len() == self.expected && self.readers.iter().all(|r| r.finished) {
            self.core.finish(State::Done);
        }
    }

    fn on_transfer_complete(&mut self, to: &Peer) {
        let push = self.core.state == State::Transferring && self.mode == Some(TransferMode::Push);
        let Some(r) = self.reader_mut(to) else {
            return; // not a write of ours
        };
        r.write_outstanding = false;
        if !push || r.finished || !r.started {
            return; // stale completion
        }
        r.finished = true;
        let peer = r.peer.clone();
        let aux = self.aux.clone();
        self.core.send(&peer, PeerMessage::Done { aux });
        self.finish_if_all_done();
    }

    fn on_read_done(&mut self, from: Peer) {
        let pull = self.core.state == State::Transferring && self.mode == Some(TransferMode::Pull);
        let state = self.core.state.clone();
        let mode = self.mode;
        let Some(r) = self.reader_mut(&from) else {
            return self.fail(
                protocol(&from, "ReadDone from a rank not paired with this request"),
                None,
            );
        };
        if !pull || !r.started {
            let detail = format!("ReadDone in {state} ({mode:?} mode)");
            return self.fail(protocol(&from, detail), None);
        }
        r.finished = true; // a second one is a harmless duplicate
        self.finish_if_all_done();
    }

    /// After the end: blocks handed over are released at once; a write reporting back
    /// settles its part (and pays an `AbortAck` owed); decode's abort is acknowledged; a
    /// decode rank that comes only now is told the request failed; the rest is stale.
    fn handle_after_end(&mut self, event: SenderEvent) {
        match event {
            SenderEvent::Input { blocks, .. } => self.core.release_late(blocks),
            SenderEvent::TransferComplete { to } | SenderEvent::TransferFailed { to, .. } => {
                if let Some(r) = self.reader_mut(&to) {
                    r.write_outstanding = false;
                }
                self.pay_acks();
            }
            SenderEvent::PeerAbort { from, .. } => {
                let push = self.mode == Some(TransferMode::Push);
                if let Some(r) = self.reader_mut(&from) {
                    r.ack_owed |= push && r.dst.is_some();
                }
                self.pay_acks();
            }
            SenderEvent::AbortAck { from } | SenderEvent::ReadDone { from } => {
                let fencing = self.readers.iter().any(|r| r.fenced);
                if let Some(r) = self.reader_mut(&from) {
                    r.fenced = false;
                }
                if fencing && !self.readers.iter().any(|r| r.fenced) {
                    self.core.release_now(FenceEnd::Confirmed);
                }
            }
            SenderEvent::TransferInfo { from, mode, .. } if self.reader(&from).is_none() => {
                self.tell_late(&from, Some(mode))
            }
            SenderEvent::Queued { from } if self.reader(&from).is_none() => {
                self.tell_late(&from, None)
            }
            _ => {}
        }
    }

    /// A decode rank of this request that comes after it failed waits on us: tell it.
    /// Nothing of ours was ever written into its blocks (push: it may release them).
    fn tell_late(&mut self, from: &Peer, mode: Option<TransferMode>) {
        if let State::Failed(reason) = self.core.state.clone() {
            self.core.send(from, PeerMessage::Abort { reason });
            if mode == Some(TransferMode::Push) {
                self.core.send(from, PeerMessage::AbortAck);
            }
        }
    }

    /// Push mode: each decode rank that granted its blocks holds them until we say no
    /// write of ours can land any more; says so to each whose write is not in flight.
    fn pay_acks(&mut self) {
        for i in 0..self.readers.len() {
            let r = &mut self.readers[i];
            if r.ack_owed && !r.write_outstanding {
                r.ack_owed = false;
                let peer = r.peer.clone();
                self.core.send(&peer, PeerMessage::AbortAck);
            }
        }
    }

    /// Fails the request: tells every paired decode rank (but the one that caused the
    /// failure), releases every held block (pull, one-sided: once every rank that may be
    /// reading confirms), and, in push mode, owes each decode rank that granted blocks an
    /// `AbortAck` once no write to it is in flight.
    fn fail(&mut self, reason: FailureReason, caused_by: Option<&Peer>) {
        if self.core.state.is_terminal() {
            return;
        }
        let readable = self.fence_reads
            && self.mode == Some(TransferMode::Pull)
            && self.core.state == State::Transferring;
        let push = self.mode == Some(TransferMode::Push);
        for i in 0..self.readers.len() {
            let r = &mut self.readers[i];
            // Decode may be reading our blocks one-sidedly: hold them until it confirms.
            r.fenced = readable && r.started && !r.finished && !r.acked_early;
            r.ack_owed = push && r.dst.is_some();
            if caused_by != Some(&r.peer) {
                let peer = r.peer.clone();
                let msg = PeerMessage::Abort {
                    reason: reason.clone(),
                };
                self.core.send(&peer, msg);
            }
        }
        if self.readers.iter().any(|r| r.fenced) {
            let until = self.now + self.core.timeouts.fence_max();
            self.core.finish_fenced(State::Failed(reason), until);
        } else {
            self.core.finish(State::Failed(reason));
        }
        self.pay_acks();
    }
}
