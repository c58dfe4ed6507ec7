//! The one record of a request that outlives its actor: its state and the blocks it holds.
//!
//! Written by the request actor as its machine moves, by the engine's handle when it hands
//! blocks over, and by the root actor when the request actor dies. All writes go through one
//! lock (the `watch` channel's), so the two rules hold even when an actor panics between two
//! messages: a terminal state is entered once, and every block handed over is released
//! exactly once (all blocks still held are released on entering the terminal state).

use std::sync::Arc;

use handoff_transport::{BlockId, FailureReason, RequestId, Role};
use tokio::sync::watch;

use crate::event::{Event, EventQueue, FenceEnd, ReleaseReason};
use crate::machine::{Peer, State};
use crate::Error;

/// What the ledger holds for one request.
#[derive(Clone, Debug)]
pub(crate) struct Record {
    pub(crate) state: State,
    pub(crate) held: Vec<BlockId>,
    pub(crate) handed_over: bool,
    pub(crate) peers: Vec<Peer>,
    /// Decode: each prefill rank's per-request payload, in arrival order (one per rank).
    pub(crate) aux: Vec<(Peer, Vec<u8>)>,
}

/// A shared handle on one request's [`Record`].
#[derive(Clone)]
pub(crate) struct Ledger {
    pub(crate) id: RequestId,
    pub(crate) role: Role,
    cell: Arc<watch::Sender<Record>>,
    events: Arc<EventQueue>,
}

impl Ledger {
    pub(crate) fn new(id: RequestId, role: Role, events: Arc<EventQueue>) -> Self {
        let record = Record {
            state: State::Bootstrapping,
            held: Vec::new(),
            handed_over: false,
            peers: Vec::new(),
            aux: Vec::new(),
        };
        events.push(Event::State {
            id: id.clone(),
            role,
            state: State::Bootstrapping,
        });
        Self {
            id,
            role,
            cell: Arc::new(watch::channel(record).0),
            events,
        }
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<Record> {
        self.cell.subscribe()
    }

    pub(crate) fn state(&self) -> State {
        self.cell.borrow().state.clone()
    }

    pub(crate) fn peers(&self) -> Vec<Peer> {
        self.cell.borrow().peers.clone()
    }

    /// The engine hands blocks over (`send` on prefill, `allocate` on decode).
    pub(crate) fn hand_over(&self, blocks: Vec<BlockId>) -> Result<(), Error> {
        let mut result = Ok(());
        self.cell.send_if_modified(|r| {
            if r.state.is_terminal() {
                let state = r.state.clone();
                result = Err(Error::RequestEnded {
                    id: self.id.clone(),
                    state,
                    blocks: blocks.clone(),
                });
                return false;
            }
            if r.handed_over {
                result = Err(Error::AlreadyHandedOver(self.id.clone()));
                return false;
            }
            r.handed_over = true;
            r.held.extend_from_slice(&blocks);
            true
        });
        result
    }

    /// Keeps a prefill rank's payload for the engine (the latest, if a rank sent twice).
    pub(crate) fn add_aux(&self, from: Peer, bytes: Vec<u8>) {
        self.cell.send_if_modified(|r| {
            match r.aux.iter_mut().find(|(p, _)| *p == from) {
                Some(slot) => slot.1 = bytes,
                None => r.aux.push((from, bytes)),
            }
            false
        });
    }

    pub(crate) fn add_peer(&self, peer: &Peer) {
        self.cell.send_if_modified(|r| {
            if r.peers.contains(peer) {
                return false;
            }
            r.peers.push(peer.clone());
            true
        });
    }

    /// Records a state the machine moved to. Forward only. Entering a terminal state does
    /// not release blocks by itself: the machine says when (a failed push request on decode
    /// holds them until its prefill ranks stopped writing), and whatever is left when the
    /// request is buried goes then ([`Ledger::release_all`]).
    pub(crate) fn transition(&self, state: State) {
        self.cell.send_if_modified(|r| self.enter(r, &state));
    }

    /// Enters a terminal `state` and releases `blocks` in one update: whoever the end wakes
    /// (an engine waiting on the request) finds the blocks' `Released` event beside it.
    pub(crate) fn end(&self, state: State, blocks: &[BlockId], why: ReleaseReason) {
        self.cell.send_if_modified(|r| {
            let entered = self.enter(r, &state);
            let released = self.release_held(r, Some(blocks), why);
            entered || released
        });
    }

    fn enter(&self, r: &mut Record, state: &State) -> bool {
        if r.state.is_terminal() || state.phase() <= r.state.phase() {
            return false;
        }
        r.state = state.clone();
        self.events.push(Event::State {
            id: self.id.clone(),
            role: self.role,
            state: state.clone(),
        });
        true
    }

    /// Releases every block still held, for `why`.
    pub(crate) fn release_all(&self, why: ReleaseReason) {
        self.cell
            .send_if_modified(|r| self.release_held(r, None, why.clone()));
    }

    /// Releases those of `blocks` that are still held (the rest were released already).
    pub(crate) fn release(&self, blocks: &[BlockId], why: ReleaseReason) {
        self.cell
            .send_if_modified(|r| self.release_held(r, Some(blocks), why.clone()));
    }

    /// Why blocks released now go, judged by how the request ended: `Done`, or
    /// `Failed` (`fence`: how a fence on them ended, if one held them). A request still
    /// live (which its callers rule out) counts as failed internally.
    pub(crate) fn ended_why(&self, fence: Option<FenceEnd>) -> ReleaseReason {
        match self.state() {
            State::Done => ReleaseReason::Done,
            State::Failed(reason) => ReleaseReason::Failed { reason, fence },
            live => ReleaseReason::Failed {
                reason: FailureReason::Internal {
                    detail: format!("released while {live}"),
                },
                fence,
            },
        }
    }

    /// Fails the request unless it has ended already; true if this call ended it. Its
    /// blocks go as `Failed { reason }`.
    pub(crate) fn fail_if_live(&self, reason: FailureReason) -> bool {
        let why = ReleaseReason::Failed {
            reason: reason.clone(),
            fence: None,
        };
        self.fail_if_live_as(reason, why)
    }

    /// [`Ledger::fail_if_live`], its blocks going for `why` (e.g. the runtime stopping).
    pub(crate) fn fail_if_live_as(&self, reason: FailureReason, why: ReleaseReason) -> bool {
        let mut ended = false;
        self.cell.send_if_modified(|r| {
            if r.state.is_terminal() {
                return false;
            }
            ended = true;
            r.state = State::Failed(reason.clone());
            self.events.push(Event::State {
                id: self.id.clone(),
                role: self.role,
                state: r.state.clone(),
            });
            self.release_held(r, None, why.clone());
            true
        });
        ended
    }

    /// Removes `which` (or everything) from `held` and reports what was removed.
    fn release_held(&self, r: &mut Record, which: Option<&[BlockId]>, why: ReleaseReason) -> bool {
        let released: Vec<BlockId> = match which {
            None => std::mem::take(&mut r.held),
            Some(blocks) => {
                let mut out = Vec::new();
                for b in blocks {
                    if let Some(i) = r.held.iter().position(|h| h == b) {
                        out.push(r.held.swap_remove(i));
                    }
                }
                out
            }
        };
        if released.is_empty() {
            return false;
        }
        self.events.push(Event::Released {
            id: self.id.clone(),
            blocks: released,
            why,
        });
        true
    }
}
