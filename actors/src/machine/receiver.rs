//! The decode side of one request on one decode rank.
//!
//! A decode rank receives from every prefill rank that holds part of the request's KV cache
//! (e.g. each pipeline stage of prefill), so the receiver tracks each of them.
//!
//! ```text
//!                peers resolved + blocks allocated
//! Bootstrapping ──────────────────────────────────▶ WaitingForInput ──▶ Transferring ──▶ Done
//!   (peers known, no blocks yet: Queued to each)      push: first Done   push: Done from every peer
//!                                                     pull: first Ready  pull: every read complete
//!       └───────────────── any state ───────────────▶ Failed(reason)
//! ```

use std::time::{Duration, Instant};

use handoff_transport::{BlockId, FailureReason, TransferMode};

use super::{protocol, Action, Core, Peer, PeerMessage, State, Timeouts, QUARANTINE_ASK_EVERY};
use crate::event::FenceEnd;

/// What can happen to a receiver. Fed with [`ReceiverMachine::handle`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReceiverEvent {
    /// The bootstrap answer: the prefill ranks this request receives from.
    PeersResolved {
        /// The prefill ranks.
        peers: Vec<Peer>,
        /// Those of them whose process the driver cannot watch should it be lost as a
        /// writer (another host: `Link::unwatched`). A push over a one-sided plane
        /// ([`ReceiverMachine::fence_writes`]) with any of them runs as pull: a lost
        /// writer's quarantine could only end on a time bound, and no bound covers a writer
        /// stopped between its lease check and a post.
        unwatched: Vec<Peer>,
    },
    /// The bootstrap server could not answer in time.
    BootstrapFailed {
        /// Why.
        reason: FailureReason,
    },
    /// Admission control: this decode is saturated and refuses the request. Prefill ranks
    /// are told `Rejected` (as soon as they are known) and the request fails at once.
    Reject {
        /// Why (normally [`FailureReason::RejectedBusy`]).
        reason: FailureReason,
    },
    /// The engine allocated the destination blocks.
    Allocated {
        /// The blocks, in order.
        blocks: Vec<BlockId>,
    },
    /// Push: a prefill rank finished writing.
    Done {
        /// The prefill rank.
        from: Peer,
        /// Its engine's per-request payload (empty if none).
        aux: Vec<u8>,
    },
    /// Pull: a prefill rank's blocks are ready to be read.
    Ready {
        /// The prefill rank.
        from: Peer,
        /// Its source blocks.
        blocks: Vec<BlockId>,
        /// Its engine's per-request payload (empty if none).
        aux: Vec<u8>,
        /// How long, at the least, it keeps its blocks for our reads from sending `Ready`.
        hold: Duration,
    },
    /// Push: a prefill rank confirms no write of its into our blocks can land any more
    /// (it answers our abort, or its own failure).
    AbortAck {
        /// The prefill rank.
        from: Peer,
    },
    /// Pull: the read from one prefill rank finished.
    ReadComplete {
        /// The prefill rank.
        from: Peer,
    },
    /// The data plane failed.
    TransferFailed {
        /// What it said.
        detail: String,
    },
    /// The engine aborted the request.
    Abort,
    /// A peer (prefill, or another rank of this request) aborted or failed it.
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
    /// Push, one-sided plane, after [`Action::Quarantine`]: what the driver knows of a lost
    /// prefill rank that never confirmed. `exited`: its process has exited (the kernel
    /// says so), so nothing of it can write any more; `false`: the driver cannot watch
    /// it (another host), and the fence bound that has passed is all there is.
    WriterGone {
        /// The prefill rank.
        peer: Peer,
        /// Whether its process was seen to exit.
        exited: bool,
    },
    /// A lost prefill rank is back as a new process (a new incarnation took its rank).
    /// The new process never held this request's grant, and it answers an `Abort` for a
    /// request it does not know with `AbortAck` at once: from now on that rank's
    /// `AbortAck` and `Done` end nothing here. Only the old process's end does
    /// ([`ReceiverEvent::WriterGone`]), or the fence bound where the driver cannot watch it.
    WriterReplaced {
        /// The prefill rank.
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

/// How far one prefill rank has got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Progress {
    Waiting,
    Reading,
    Complete,
    /// Lost: it can no longer write, and it is not told anything.
    Gone,
}

/// One request's lifecycle on one decode rank. See the [module docs](super).
#[derive(Clone, Debug)]
pub struct ReceiverMachine {
    core: Core,
    mode: TransferMode,
    /// The prefill ranks and how far each has got, once resolved.
    peers: Vec<(Peer, Progress)>,
    allocated: bool,
    queued_sent: bool,
    /// Set by `Reject` before the peers are known: reject them once they are.
    rejecting: Option<FailureReason>,
    /// Transfer info went out: in push mode, prefill ranks hold write grants from then on.
    info_sent: bool,
    /// Failed, with the blocks held until nothing can write into them any more: our own
    /// reads in flight (any data plane) and, with `fence_writes`, granted prefill ranks.
    fencing: bool,
    /// The one-sided write fence is part of `fencing`: granted prefill ranks must confirm.
    write_fence: bool,
    /// When the transfer info went out: every prefill rank's hold on its blocks for our
    /// reads started later than this.
    info_sent_at: Option<Instant>,
    /// Pull: until when each prefill rank surely holds its blocks for our reads (transfer
    /// info sent + the hold its `Ready` states). A read that completes later may have
    /// read blocks prefill already gave back: it fails `TtlExpired`, never `Done`.
    leases: Vec<(Peer, Option<Instant>)>,
    /// Pull: reads we posted that have not reported back. A read's completion copies into
    /// our blocks, so they are not released while one is in flight.
    reads_outstanding: u32,
    /// Pull: prefill ranks owed an `AbortAck` (they hold their blocks for our reads) once
    /// no read of ours is in flight.
    acks_owed: Vec<Peer>,
    /// Push: prefill ranks that said `AbortAck` before we failed (it overtook their
    /// `Abort`): they promised no write of theirs can land, so no fence waits for them.
    acked_early: Vec<Peer>,
    /// Push, one-sided: the fence bound passed with lost prefill ranks unconfirmed, and the
    /// blocks stay held until the driver reports each gone or it confirms after all.
    quarantined: bool,
    /// A lost writer was let go on the bound alone (its driver could not watch it).
    bound_only: bool,
    /// Lost prefill ranks now held by a new process ([`ReceiverEvent::WriterReplaced`]):
    /// their answers are the new process's, not the old writer's.
    replaced: Vec<Peer>,
    /// The data plane's writes are one-sided (RDMA): our side cannot refuse a late one, so a
    /// failed push request fences its blocks. Off for planes that check a grant per write.
    fence_writes: bool,
    /// The latest instant the driver gave (timeouts and events), for deadlines set inside.
    now: Instant,
}

impl ReceiverMachine {
    /// A new receiver in `Bootstrapping`, with its bootstrap deadline armed from `now`.
    pub fn new(now: Instant, timeouts: Timeouts, mode: TransferMode) -> Self {
        Self {
            core: Core::new(now, timeouts),
            mode,
            peers: Vec::new(),
            allocated: false,
            queued_sent: false,
            rejecting: None,
            info_sent: false,
            fencing: false,
            write_fence: false,
            info_sent_at: None,
            leases: Vec::new(),
            reads_outstanding: 0,
            acks_owed: Vec::new(),
            acked_early: Vec::new(),
            quarantined: false,
            bound_only: false,
            replaced: Vec::new(),
            fence_writes: false,
            now,
        }
    }

    /// Makes a failed push request hold its blocks until every granted prefill rank says
    /// `AbortAck` or `Done` (or the fence deadline passes): for data planes whose writes are
    /// one-sided, which the receiving side cannot refuse once a grant is revoked. A lost
    /// peer is not taken as stopped: a partitioned one may come back and write.
    pub fn fence_writes(mut self, on: bool) -> Self {
        self.fence_writes = on;
        self
    }

    /// True once the machine is terminal and holds nothing back: its driver may stop.
    pub fn is_settled(&self) -> bool {
        self.core.state.is_terminal() && !self.fencing
    }

    /// The current state.
    pub fn state(&self) -> &State {
        &self.core.state
    }

    /// Who moves the bytes: the mode it was made with, or pull where a push could not be
    /// fenced (`unwatched` in [`ReceiverEvent::PeersResolved`]).
    pub fn mode(&self) -> TransferMode {
        self.mode
    }

    /// The prefill ranks this request receives from, once resolved.
    pub fn peers(&self) -> impl Iterator<Item = &Peer> {
        self.peers.iter().map(|(p, _)| p)
    }

    /// The peers whose loss fails this request at once: every prefill rank, once resolved.
    pub fn depends_on(&self) -> impl Iterator<Item = &Peer> {
        self.peers()
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
        let reason = match self.core.state {
            State::Bootstrapping => FailureReason::BootstrapTimeout,
            State::WaitingForInput => FailureReason::WaitingTimeout,
            State::Transferring => FailureReason::TransferTimeout,
            State::Done | State::Failed(_) if self.quarantined => return self.ask_lost(now),
            State::Done | State::Failed(_) => return self.on_fence_bound(),
        };
        self.fail(reason, None);
    }

    /// Feeds one event. Never panics, whatever the event and state.
    pub fn handle(&mut self, now: Instant, event: ReceiverEvent) {
        self.now = self.now.max(now);
        if self.core.state.is_terminal() {
            return self.handle_after_end(event);
        }
        match event {
            ReceiverEvent::PeersResolved { peers, unwatched } => {
                self.on_peers(now, peers, unwatched)
            }
            ReceiverEvent::BootstrapFailed { reason } => {
                if self.core.state == State::Bootstrapping {
                    self.fail(reason, None);
                }
            }
            ReceiverEvent::Reject { reason } => {
                if self.core.state == State::Bootstrapping {
                    self.rejecting = Some(reason);
                    self.try_reject();
                }
            }
            ReceiverEvent::Allocated { blocks } => self.on_allocated(now, blocks),
            ReceiverEvent::Done { from, aux } => self.on_done(now, from, aux),
            ReceiverEvent::Ready {
                from,
                blocks,
                aux,
                hold,
            } => self.on_ready(now, from, blocks, aux, hold),
            ReceiverEvent::ReadComplete { from } => self.on_read_complete(from),
            ReceiverEvent::TransferFailed { detail } => {
                self.reads_outstanding = self.reads_outstanding.saturating_sub(1);
                if self.core.state == State::Transferring {
                    self.fail(FailureReason::TransferFailed { detail }, None);
                }
            }
            ReceiverEvent::Abort => self.fail(FailureReason::AbortedByEngine, None),
            ReceiverEvent::PeerAbort { from, reason } => {
                let cause = reason.to_string();
                let peer = from.to_string();
                self.fail(FailureReason::AbortedByPeer { peer, cause }, Some(&from));
            }
            // An acknowledgement that overtook its `Abort` (control messages may be
            // reordered): remembered, so the failure it announces fences nothing for it.
            ReceiverEvent::AbortAck { from } => {
                if self.index(&from).is_some() && !self.acked_early.contains(&from) {
                    self.acked_early.push(from);
                }
            }
            ReceiverEvent::PeerLost { peer } => {
                if let Some(i) = self.index(&peer) {
                    self.peers[i].1 = Progress::Gone;
                    let name = peer.to_string();
                    self.fail(FailureReason::PeerLost { peer: name }, Some(&peer));
                }
            }
            ReceiverEvent::Unexpected { from, what } => {
                self.fail(protocol(&from, format!("unexpected {what}")), None)
            }
            ReceiverEvent::Internal { detail } => {
                self.fail(FailureReason::Internal { detail }, None)
            }
            ReceiverEvent::Superseded { detail } => {
                self.fail(FailureReason::Superseded { detail }, None)
            }
            // Only after the end: a replaced rank was lost, and a loss ends the request.
            ReceiverEvent::WriterReplaced { .. } | ReceiverEvent::WriterGone { .. } => {}
        }
    }

    /// A lost rank's new process: its answers no longer speak for the lost writer. (A rank
    /// not lost here held no grant the new process could be confused with.)
    fn on_replaced(&mut self, peer: Peer) {
        let lost = self
            .index(&peer)
            .is_some_and(|i| self.peers[i].1 == Progress::Gone);
        if lost && !self.replaced.contains(&peer) {
            // (One that confirmed before we failed is not waited for, nor watched.)
            if self.quarantined && !self.acked_early.contains(&peer) {
                self.core
                    .actions
                    .push_back(Action::WatchEarlier { peer: peer.clone() });
            }
            self.replaced.push(peer);
        }
    }

    /// A confirmation from a replaced rank ends nothing; the driver logs and counts it.
    fn unconfirmed(&mut self, from: Peer) {
        self.core.actions.push_back(Action::Unconfirmed { from });
    }

    fn on_peers(&mut self, now: Instant, peers: Vec<Peer>, unwatched: Vec<Peer>) {
        if self.core.state != State::Bootstrapping || !self.peers.is_empty() {
            return; // a repeated answer
        }
        if peers.is_empty() {
            return self.fail(internal("bootstrap resolved no prefill ranks"), None);
        }
        let unwatched: Vec<Peer> = unwatched
            .into_iter()
            .filter(|u| peers.contains(u))
            .collect();
        if self.mode == TransferMode::Push && self.fence_writes && !unwatched.is_empty() {
            // Decided before any grant goes out: the transfer info says pull.
            self.mode = TransferMode::Pull;
            self.core
                .actions
                .push_back(Action::PullsInstead { unwatched });
        }
        self.peers = peers.into_iter().map(|p| (p, Progress::Waiting)).collect();
        if !self.try_reject() {
            self.try_send_info(now);
        }
    }

    /// Tells every known prefill rank `Rejected` and fails; false if there is nothing to
    /// reject or the peers are not known yet.
    fn try_reject(&mut self) -> bool {
        let Some(reason) = self.rejecting.clone() else {
            return false;
        };
        if self.peers.is_empty() {
            return false;
        }
        for (peer, _) in self.peers.clone() {
            let msg = PeerMessage::Rejected {
                reason: reason.clone(),
            };
            self.core.send(&peer, msg);
        }
        // The peers were told `Rejected`, which already means "free it": no abort as well.
        self.peers
            .iter_mut()
            .for_each(|(_, p)| *p = Progress::Complete);
        self.fail(reason, None);
        true
    }

    fn on_allocated(&mut self, now: Instant, blocks: Vec<BlockId>) {
        if self.allocated {
            return self.core.release_late(blocks);
        }
        self.allocated = true;
        self.core.held = blocks;
        if self.rejecting.is_none() {
            self.try_send_info(now);
        }
    }

    /// Sends the transfer info once both the peers and the blocks are known; with peers
    /// but no blocks, says `Queued` once so prefill knows this side lives (seed 003).
    fn try_send_info(&mut self, now: Instant) {
        if self.peers.is_empty() {
            return;
        }
        if !self.allocated {
            if !self.queued_sent {
                self.queued_sent = true;
                for (peer, _) in self.peers.clone() {
                    self.core.send(&peer, PeerMessage::Queued);
                }
            }
            return;
        }
        self.info_sent = true;
        self.info_sent_at.get_or_insert(now);
        for (peer, _) in self.peers.clone() {
            let msg = PeerMessage::TransferInfo {
                mode: self.mode,
                blocks: self.core.held.clone(),
            };
            self.core.send(&peer, msg);
        }
        let limit = self.core.timeouts.waiting;
        self.core.advance(now, State::WaitingForInput, limit);
    }

    fn index(&self, peer: &Peer) -> Option<usize> {
        self.peers.iter().position(|(p, _)| p == peer)
    }

    /// Checks that `from` is one of our prefill ranks, that the input fits the mode, and
    /// that we have asked for it; fails the request otherwise.
    fn expect_input(&mut self, from: &Peer, mode: TransferMode, what: &str) -> Option<usize> {
        let Some(i) = self.index(from) else {
            self.fail(
                protocol(from, format!("{what} from a rank not serving this request")),
                None,
            );
            return None;
        };
        if self.mode != mode {
            let detail = format!("{what} in {:?} mode", self.mode);
            self.fail(protocol(from, detail), None);
            return None;
        }
        if self.core.state == State::Bootstrapping {
            self.fail(
                protocol(from, format!("{what} before transfer info was sent")),
                None,
            );
            return None;
        }
        Some(i)
    }

    fn enter_transferring(&mut self, now: Instant) {
        if self.core.state == State::WaitingForInput {
            let limit = self.core.timeouts.transfer;
            self.core.advance(now, State::Transferring, limit);
        }
    }

    fn on_done(&mut self, now: Instant, from: Peer, aux: Vec<u8>) {
        let Some(i) = self.expect_input(&from, TransferMode::Push, "Done") else {
            return;
        };
        if self.peers[i].1 == Progress::Complete {
            return; // a duplicate
        }
        self.peers[i].1 = Progress::Complete;
        self.take_aux(from, aux);
        self.finish_if_complete(now);
    }

    /// Hands a prefill rank's payload to the driver (once per rank: its input is accepted
    /// once), before the state that lets the engine read it.
    fn take_aux(&mut self, from: Peer, bytes: Vec<u8>) {
        if !bytes.is_empty() {
            self.core.actions.push_back(Action::Aux { from, bytes });
        }
    }

    fn on_ready(
        &mut self,
        now: Instant,
        from: Peer,
        blocks: Vec<BlockId>,
        aux: Vec<u8>,
        hold: Duration,
    ) {
        let Some(i) = self.expect_input(&from, TransferMode::Pull, "Ready") else {
            return;
        };
        if self.peers[i].1 != Progress::Waiting {
            return; // a duplicate
        }
        if blocks.len() != self.core.held.len() {
            let detail = format!(
                "Ready with {} blocks for {} granted",
                blocks.len(),
                self.core.held.len()
            );
            return self.fail(protocol(&from, detail), None);
        }
        self.peers[i].1 = Progress::Reading;
        // The hold started when prefill sent `Ready`, after our transfer info reached it:
        // counted from when we sent that info, the lease ends no later than the hold.
        let lease = self.info_sent_at.and_then(|at| at.checked_add(hold));
        self.leases.push((from.clone(), lease));
        if lease.is_some_and(|end| end <= now) {
            // The hold is over before we could read: prefill may have let the blocks go.
            // Nothing is read; prefill is told, and acknowledged so it can let go.
            return self.fail(FailureReason::TtlExpired, None);
        }
        self.reads_outstanding += 1;
        self.take_aux(from.clone(), aux);
        self.enter_transferring(now);
        let dst = self.core.held.clone();
        // One deadline for the read, decided here: the state's, or the end of prefill's
        // hold on its blocks if that comes first (no read is posted past it).
        let state_deadline = self
            .core
            .deadline
            .unwrap_or(now + self.core.timeouts.transfer);
        let deadline = lease.map_or(state_deadline, |l| l.min(state_deadline));
        self.core.actions.push_back(Action::Read {
            from,
            src: blocks,
            dst,
            deadline,
        });
    }

    fn on_read_complete(&mut self, from: Peer) {
        self.reads_outstanding = self.reads_outstanding.saturating_sub(1);
        let Some(i) = self.index(&from) else {
            return;
        };
        if self.peers[i].1 != Progress::Reading {
            return; // stale
        }
        let lease = self.leases.iter().find(|(p, _)| *p == from);
        if let Some((_, Some(end))) = lease {
            if self.now > *end {
                // Prefill's hold may have ended before the read did (we were frozen, or the
                // read stalled): what we read may be blocks it reused. Never `Done`.
                return self.fail(FailureReason::TtlExpired, None);
            }
        }
        self.peers[i].1 = Progress::Complete;
        self.core.send(&from, PeerMessage::ReadDone);
        if self.peers.iter().all(|(_, p)| *p == Progress::Complete) {
            self.core.finish(State::Done);
        }
    }

    fn finish_if_complete(&mut self, now: Instant) {
        if self.peers.iter().all(|(_, p)| *p == Progress::Complete) {
            self.core.finish(State::Done);
        } else {
            self.enter_transferring(now);
        }
    }

    /// Fails the request: tells every prefill rank but the one that caused the failure.
    /// In push mode, once transfer info went out, prefill ranks that have not said `Done`
    /// hold write grants on our blocks, and a one-sided write cannot be refused here: the
    /// blocks are then held (the fence) until each of them says `AbortAck`, says `Done`, or
    /// is lost, or until [`Timeouts::fence_max`] passes. Otherwise the blocks go at once.
    fn fail(&mut self, reason: FailureReason, caused_by: Option<&Peer>) {
        if self.core.state.is_terminal() {
            return;
        }
        for (peer, progress) in self.peers.clone() {
            let live = matches!(progress, Progress::Waiting | Progress::Reading);
            if caused_by != Some(&peer) && live {
                self.core.send(
                    &peer,
                    PeerMessage::Abort {
                        reason: reason.clone(),
                    },
                );
            }
        }
        self.write_fence = self.fence_writes
            && self.mode == TransferMode::Push
            && self.info_sent
            && self.writers_left();
        if self.mode == TransferMode::Pull {
            for (peer, progress) in &self.peers {
                if *progress == Progress::Reading {
                    self.acks_owed.push(peer.clone());
                }
            }
            self.pay_acks();
        }
        if self.write_fence || self.reads_outstanding > 0 {
            self.fencing = true;
            let until = self.now + self.core.timeouts.fence_max();
            self.core.finish_fenced(State::Failed(reason), until);
        } else {
            self.core.finish(State::Failed(reason));
        }
    }

    /// The fence's deadline, with no acknowledgement from some prefill ranks. Every rank's
    /// own deadlines have passed by now, so a live one (it answers heartbeats, so it is not
    /// stopped) posts nothing more. A lost one may be a writer stopped between the check of
    /// its lease and its next post (`SIGSTOP`, a frozen VM): whenever it resumes, that one
    /// post lands, and no time bound can cover a stop of any length. Its blocks are then
    /// quarantined ([`Action::Quarantine`]) until it confirms (`AbortAck`/`Done`, after it
    /// comes back) or the driver reports it gone ([`ReceiverEvent::WriterGone`]).
    fn on_fence_bound(&mut self) {
        let lost: Vec<Peer> = self
            .peers
            .iter()
            .filter(|(peer, p)| *p == Progress::Gone && !self.acked_early.contains(peer))
            .map(|(peer, _)| peer.clone())
            .collect();
        if !self.write_fence || lost.is_empty() {
            self.fencing = false;
            return self.core.release_now(FenceEnd::Bound);
        }
        // The live ones are past every deadline of theirs: only the lost ones are waited for.
        for (_, p) in &mut self.peers {
            if *p == Progress::Waiting {
                *p = Progress::Complete;
            }
        }
        self.quarantined = true;
        let blocks = self.core.held.len();
        let replaced = lost
            .iter()
            .filter(|p| self.replaced.contains(p))
            .cloned()
            .collect();
        self.core.actions.push_back(Action::Quarantine {
            peers: lost,
            blocks,
            replaced,
        });
        // The first ask after one interval: a driver that cannot watch the writers answers
        // at once, and the blocks go without a word to peers that are gone.
        self.core.deadline = Some(self.now + QUARANTINE_ASK_EVERY);
    }

    /// Quarantined: asks every lost writer still unconfirmed to confirm (`Abort`; its
    /// `AbortAck` may have been lost with its connection), and again every
    /// [`QUARANTINE_ASK_EVERY`]. This deadline never releases anything.
    fn ask_lost(&mut self, now: Instant) {
        // Only a failed request fences (and so quarantines).
        let State::Failed(reason) = self.core.state.clone() else {
            return;
        };
        // (A replaced rank's new process would only answer for itself.)
        for (peer, p) in self.peers.clone() {
            if p == Progress::Gone && !self.replaced.contains(&peer) {
                let reason = reason.clone();
                self.core.send(&peer, PeerMessage::Abort { reason });
            }
        }
        self.core.deadline = Some(now + QUARANTINE_ASK_EVERY);
    }

    /// Pull: tells prefill ranks we stopped reading, once no read of ours is in flight.
    fn pay_acks(&mut self) {
        if self.reads_outstanding > 0 {
            return;
        }
        for peer in std::mem::take(&mut self.acks_owed) {
            self.core.send(&peer, PeerMessage::AbortAck);
        }
    }

    /// True when nothing can write into our blocks any more.
    fn fence_can_lift(&self) -> bool {
        self.reads_outstanding == 0 && !(self.write_fence && self.writers_left())
    }

    /// Push: prefill ranks that may still write into our blocks (a lost one may too).
    fn writers_left(&self) -> bool {
        self.peers.iter().any(|(peer, p)| {
            matches!(p, Progress::Waiting | Progress::Gone) && !self.acked_early.contains(peer)
        })
    }

    /// After the end: blocks handed over are released at once; while fencing, each
    /// prefill rank's `AbortAck`, `Done` or loss lifts its part of the fence.
    fn handle_after_end(&mut self, event: ReceiverEvent) {
        match event {
            ReceiverEvent::Allocated { blocks } => return self.core.release_late(blocks),
            ReceiverEvent::AbortAck { from } | ReceiverEvent::Done { from, .. }
                if self.replaced.contains(&from) =>
            {
                return self.unconfirmed(from);
            }
            ReceiverEvent::AbortAck { from } | ReceiverEvent::Done { from, .. } => {
                if let Some(i) = self.index(&from) {
                    self.peers[i].1 = Progress::Complete;
                }
            }
            ReceiverEvent::WriterReplaced { peer } => return self.on_replaced(peer),
            ReceiverEvent::WriterGone { peer, exited } => match self.index(&peer) {
                Some(i) if self.quarantined && self.peers[i].1 == Progress::Gone => {
                    self.peers[i].1 = Progress::Complete;
                    self.bound_only |= !exited;
                }
                _ => return,
            },
            // A writer lost after the end, while its part of the fence still holds: it
            // may be a stopped one, and is treated as one at the fence's bound.
            ReceiverEvent::PeerLost { peer } if self.write_fence => {
                if let Some(i) = self.index(&peer) {
                    if self.peers[i].1 == Progress::Waiting {
                        self.peers[i].1 = Progress::Gone;
                    }
                }
                return;
            }
            ReceiverEvent::ReadComplete { .. } | ReceiverEvent::TransferFailed { .. } => {
                self.reads_outstanding = self.reads_outstanding.saturating_sub(1);
                self.pay_acks();
            }
            // Pull: a prefill rank that offers (or re-offers) its blocks after we ended, or
            // aborts, holds them for us: tell it we will not read.
            ReceiverEvent::Ready { from, .. } | ReceiverEvent::PeerAbort { from, .. }
                if self.mode == TransferMode::Pull =>
            {
                if !self.acks_owed.contains(&from) {
                    self.acks_owed.push(from);
                }
                self.pay_acks();
                return;
            }
            _ => return,
        }
        if self.fencing && self.fence_can_lift() {
            self.fencing = false;
            let end = if self.bound_only {
                FenceEnd::Bound
            } else {
                FenceEnd::Confirmed
            };
            self.core.release_now(end);
        }
    }
}

fn internal(detail: &str) -> FailureReason {
    FailureReason::Internal {
        detail: detail.to_string(),
    }
}
