//! What a request owns: its announced state, the blocks it holds, the peers it dealt with,
//! and the payloads prefill sent with its KV. One owner at a time, never two.
//!
//! - The engine's `sender`/`receiver` call makes the [`Estate`] and sends it to the root
//!   actor inside the `Open` message; the root moves it into a [`Deed`] that the request's
//!   actor alone reads and writes while it runs.
//! - When the actor dies (a panic, a stop before its request ended), the root takes the
//!   estate out of the deed ([`Deed::take`]) and owns it from then on: it fails the request,
//!   holds its blocks until the fence bound or releases them, as the router decides. The
//!   dead actor cannot write it any more; a stopping one finds its deed empty.
//! - Blocks the engine hands over travel to the owner in a [`Consignment`]: whoever takes
//!   them owns them; a consignment dropped on the way gives them back at once: `Late` when
//!   its request ended or its actor died, `Shutdown` when the runtime stopped.
//! - An estate dropped while its request is live (the runtime stopped before it was ever
//!   run) fails the request and gives every block back (`Shutdown`).
//!
//! The engine's handles read a published [`View`] (state and payloads) that only the owner
//! writes; lifecycle events go to the [`EventQueue`]. "Released exactly once" is decided
//! by the owner alone: a block is released only while held ([`Estate::release`] checks
//! before and after), never by deduplicating a second release.

use std::sync::{Arc, Mutex, MutexGuard};

use handoff_transport::{BlockId, FailureReason, RequestId, Role};
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;
use tracing::{debug, error};

use crate::event::{Event, EventQueue, FenceEnd, ReleaseReason};
use crate::machine::{Peer, State};
use crate::metrics::Metrics;

/// What the engine's handles see of a request: written by its owner alone.
#[derive(Clone, Debug)]
pub(crate) struct View {
    pub(crate) state: State,
    /// Decode: each prefill rank's per-request payload, in arrival order (one per rank).
    pub(crate) aux: Vec<(Peer, Vec<u8>)>,
}

/// The owner's side of a request's published [`View`]: it alone writes it.
pub(crate) struct ViewTx(Arc<ViewCell>);

/// A handle's side of a request's published [`View`]: reads it, waits for its end.
#[derive(Clone)]
pub(crate) struct ViewRx(Arc<ViewCell>);

/// One lock and one [`Notify`] (a watch channel wakes eight on every change, and a view
/// changes a few times per request with rarely anyone waiting).
struct ViewCell {
    view: Mutex<View>,
    changed: Notify,
    /// The owner is gone: the view holds what it last published.
    closed: AtomicBool,
    /// The engine handed the request's blocks over (its handles' fact, not the owner's:
    /// kept here so a request needs no allocation of its own for it).
    handed: AtomicBool,
}

impl ViewCell {
    fn lock(&self) -> MutexGuard<'_, View> {
        self.view.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A new view and its two sides.
fn view(view: View) -> (ViewTx, ViewRx) {
    let cell = Arc::new(ViewCell {
        view: Mutex::new(view),
        changed: Notify::new(),
        closed: AtomicBool::new(false),
        handed: AtomicBool::new(false),
    });
    (ViewTx(cell.clone()), ViewRx(cell))
}

impl ViewTx {
    fn modify(&self, f: impl FnOnce(&mut View)) {
        f(&mut self.0.lock());
        self.0.changed.notify_waiters();
    }
}

impl Drop for ViewTx {
    fn drop(&mut self) {
        self.0.closed.store(true, Ordering::Release);
        self.0.changed.notify_waiters();
    }
}

impl ViewRx {
    /// Marks the blocks handed over; true if they were already.
    pub(crate) fn mark_handed(&self) -> bool {
        self.0.handed.swap(true, Ordering::AcqRel)
    }

    /// The state published last.
    pub(crate) fn state(&self) -> State {
        self.0.lock().state.clone()
    }

    /// The payloads published so far.
    pub(crate) fn aux(&self) -> Vec<(Peer, Vec<u8>)> {
        self.0.lock().aux.clone()
    }

    /// Waits for a terminal state, or for the owner to be gone (an estate fails a live
    /// request before it is dropped, so the view then holds the end): the state then.
    pub(crate) async fn ended(&self) -> State {
        loop {
            let notified = self.0.changed.notified();
            tokio::pin!(notified);
            // Registered before the check, so a change between the two wakes it.
            notified.as_mut().enable();
            // Gone first, then the state: an owner that publishes its end and goes between
            // the two reads is seen with its end. (The other order returned the state from
            // before the end, `WaitingForInput`, as the request's end: the owner had
            // published `Done` and gone after the state was read and before `closed` was.)
            let closed = self.0.closed.load(Ordering::Acquire);
            #[cfg(test)]
            tests::between_reads();
            let state = self.state();
            if state.is_terminal() || closed {
                return state;
            }
            notified.await;
        }
    }
}

/// One request's state, blocks and peers (module docs).
pub(crate) struct Estate {
    id: RequestId,
    role: Role,
    state: State,
    held: Vec<BlockId>,
    peers: Vec<Peer>,
    view: ViewTx,
    events: Arc<EventQueue>,
    metrics: Arc<Metrics>,
    /// Counted in `handoff_fences_pending`: ended, still holding blocks.
    fenced: bool,
}

impl std::fmt::Debug for Estate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Estate({}, {}, {} held)",
            self.id,
            self.state,
            self.held.len()
        )
    }
}

impl Estate {
    /// A new request, `Bootstrapping`, and the view its handles read.
    pub(crate) fn new(
        id: RequestId,
        role: Role,
        events: Arc<EventQueue>,
        metrics: Arc<Metrics>,
    ) -> (Self, ViewRx) {
        let state = State::Bootstrapping;
        metrics.moved(role, None, &state);
        events.push(Event::State {
            id: id.clone(),
            role,
            state: state.clone(),
        });
        let (view, rx) = view(View {
            state: state.clone(),
            aux: Vec::new(),
        });
        let estate = Self {
            id,
            role,
            state,
            held: Vec::new(),
            peers: Vec::new(),
            view,
            events,
            metrics,
            fenced: false,
        };
        (estate, rx)
    }

    pub(crate) fn state(&self) -> &State {
        &self.state
    }

    /// Blocks held now.
    pub(crate) fn held(&self) -> usize {
        self.held.len()
    }

    pub(crate) fn peers(&self) -> &[Peer] {
        &self.peers
    }

    /// Takes the blocks a consignment carries. Live: they are held from now on and returned
    /// for the machine. Ended: they are given back at once (`Late`) and `None` is returned.
    pub(crate) fn receive(&mut self, consignment: Consignment) -> Option<Vec<BlockId>> {
        let blocks = consignment.take();
        if self.state.is_terminal() {
            debug!(request = %self.id, n = blocks.len(), "blocks handed over after the end: given back");
            self.give_back(blocks, 0, ReleaseReason::Late);
            return None;
        }
        self.held.extend_from_slice(&blocks);
        self.metrics.held(self.role, blocks.len());
        Some(blocks)
    }

    /// Keeps a prefill rank's payload for the engine (the latest, if a rank sent twice).
    pub(crate) fn add_aux(&mut self, from: Peer, bytes: Vec<u8>) {
        self.view
            .modify(|v| match v.aux.iter_mut().find(|(p, _)| *p == from) {
                Some(slot) => slot.1 = bytes,
                None => v.aux.push((from, bytes)),
            });
    }

    pub(crate) fn add_peer(&mut self, peer: &Peer) {
        if !self.peers.contains(peer) {
            self.peers.push(peer.clone());
        }
    }

    /// Records a state the machine moved to. Forward only. Entering a terminal state does
    /// not release blocks by itself: the machine says when (a failed push request on decode
    /// holds them until its prefill ranks stopped writing).
    pub(crate) fn transition(&mut self, state: State) {
        if self.enter(state) {
            self.publish();
        }
    }

    /// Enters a terminal `state` and releases `blocks` before publishing either: whoever the
    /// end wakes (an engine waiting on the request) finds the blocks' `Released` event
    /// beside it.
    pub(crate) fn end(&mut self, state: State, blocks: &[BlockId], why: ReleaseReason) {
        let entered = self.enter(state);
        self.release(blocks, why);
        if entered {
            self.publish();
        }
    }

    fn enter(&mut self, state: State) -> bool {
        if self.state.is_terminal() || state.phase() <= self.state.phase() {
            return false;
        }
        self.metrics.moved(self.role, Some(&self.state), &state);
        self.state = state;
        self.events.push(Event::State {
            id: self.id.clone(),
            role: self.role,
            state: self.state.clone(),
        });
        true
    }

    fn publish(&mut self) {
        let state = self.state.clone();
        self.view.modify(|v| v.state = state);
        self.count_fence();
    }

    /// Keeps `handoff_fences_pending` in step: an ended request still holding blocks.
    fn count_fence(&mut self) {
        let fenced = self.state.is_terminal() && !self.held.is_empty();
        if fenced != self.fenced {
            self.fenced = fenced;
            self.metrics.fenced(self.role, fenced);
        }
    }

    /// Releases `blocks`, each of which this request holds: a block not held here (released
    /// already, or never handed over) is a bug in whoever asked, reported and not released
    /// again.
    pub(crate) fn release(&mut self, blocks: &[BlockId], why: ReleaseReason) {
        let mut out = Vec::with_capacity(blocks.len());
        for b in blocks {
            match self.held.iter().position(|h| h == b) {
                Some(i) => out.push(self.held.swap_remove(i)),
                None => {
                    error!(request = %self.id, block = %b, %why, "release of a block this request does not hold");
                    debug_assert!(
                        false,
                        "request {} released block {b} it does not hold",
                        self.id
                    );
                }
            }
        }
        // Hand-overs refuse duplicate ids, so a released block is held no more.
        debug_assert!(
            out.iter().all(|b| !self.held.contains(b)),
            "request {}: a released block is still held",
            self.id
        );
        let n = out.len();
        self.give_back(out, n, why);
    }

    /// Releases every block still held, for `why`.
    pub(crate) fn release_all(&mut self, why: ReleaseReason) {
        let all = std::mem::take(&mut self.held);
        let n = all.len();
        self.give_back(all, n, why);
    }

    /// Tells the engine `blocks` are its own again (`held` of them were held here, and are
    /// no longer).
    fn give_back(&mut self, blocks: Vec<BlockId>, held: usize, why: ReleaseReason) {
        if blocks.is_empty() {
            return;
        }
        self.metrics.released(self.role, blocks.len(), held, &why);
        self.count_fence();
        self.events.push(Event::Released {
            id: self.id.clone(),
            blocks,
            why,
        });
    }

    /// Why blocks released now go, judged by how the request ended: `Done`, or `Failed`
    /// (`fence`: how a fence on them ended, if one held them). A request still live (which
    /// its callers rule out) counts as failed internally.
    pub(crate) fn ended_why(&self, fence: Option<FenceEnd>) -> ReleaseReason {
        match &self.state {
            State::Done => ReleaseReason::Done,
            State::Failed(reason) => ReleaseReason::Failed {
                reason: reason.clone(),
                fence,
            },
            live => ReleaseReason::Failed {
                reason: FailureReason::Internal {
                    detail: format!("released while {live}"),
                },
                fence,
            },
        }
    }

    /// Fails the request unless it has ended already, its blocks going as `Failed { reason }`;
    /// true if this call ended it.
    pub(crate) fn fail_if_live(&mut self, reason: FailureReason) -> bool {
        let why = ReleaseReason::Failed {
            reason: reason.clone(),
            fence: None,
        };
        self.fail_if_live_as(reason, why)
    }

    /// [`Estate::fail_if_live`], its blocks going for `why` (e.g. the runtime stopping).
    pub(crate) fn fail_if_live_as(&mut self, reason: FailureReason, why: ReleaseReason) -> bool {
        if !self.fail_holding(reason) {
            return false;
        }
        self.release_all(why);
        true
    }

    /// Fails the request unless it has ended already, keeping its blocks (an orphan's, until
    /// its fence bound); true if this call ended it.
    pub(crate) fn fail_holding(&mut self, reason: FailureReason) -> bool {
        // A live request's phase is always below `Failed`'s: `enter` takes it.
        let entered = self.enter(State::Failed(reason));
        if entered {
            self.publish();
        }
        entered
    }

    /// The runtime is done with the request (it stopped, or the request was retired): a
    /// live request fails, and whatever is still held goes for `why`.
    pub(crate) fn close(&mut self, why: ReleaseReason) {
        let detail = "runtime stopped".to_string();
        self.fail_holding(FailureReason::Internal { detail });
        self.release_all(why);
    }
}

impl Drop for Estate {
    /// The last owner let go without closing the request: the runtime stopped before it
    /// ran (its `Open` never handled) or while the root held it.
    fn drop(&mut self) {
        if !self.state.is_terminal() || !self.held.is_empty() {
            debug!(request = %self.id, state = %self.state, held = self.held.len(), "request dropped by the runtime: closed");
            self.close(ReleaseReason::Shutdown);
        }
    }
}

/// Where a request's [`Estate`] lives while its actor runs: the actor alone uses it; the
/// root takes it out only once the actor is gone (or the runtime stops).
#[derive(Clone, Debug)]
pub(crate) struct Deed(Arc<Mutex<Option<Estate>>>);

impl Deed {
    pub(crate) fn new(estate: Estate) -> Self {
        Self(Arc::new(Mutex::new(Some(estate))))
    }

    fn lock(&self) -> MutexGuard<'_, Option<Estate>> {
        // A panic while holding it leaves the estate as its last complete step left it.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the estate; `None` once the root took it.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut Estate) -> R) -> Option<R> {
        self.lock().as_mut().map(f)
    }

    /// Takes the estate out: its owner from now on is the caller.
    pub(crate) fn take(&self) -> Option<Estate> {
        self.lock().take()
    }
}

/// Blocks the engine handed over, on their way to the request's owner (module docs).
#[derive(Debug)]
pub(crate) struct Consignment {
    id: RequestId,
    role: Role,
    blocks: Vec<BlockId>,
    events: Arc<EventQueue>,
    metrics: Arc<Metrics>,
}

impl Consignment {
    pub(crate) fn new(
        id: RequestId,
        role: Role,
        blocks: Vec<BlockId>,
        events: Arc<EventQueue>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            id,
            role,
            blocks,
            events,
            metrics,
        }
    }

    pub(crate) fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// The blocks, now the taker's.
    pub(crate) fn take(mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.blocks)
    }
}

impl Drop for Consignment {
    fn drop(&mut self) {
        if self.blocks.is_empty() {
            return;
        }
        debug!(request = %self.id, n = self.blocks.len(), "blocks handed over never reached the request: given back");
        let why = match self.events.stopping() {
            true => ReleaseReason::Shutdown,
            false => ReleaseReason::Late,
        };
        self.metrics.released(self.role, self.blocks.len(), 0, &why);
        self.events.push(Event::Released {
            id: self.id.clone(),
            blocks: std::mem::take(&mut self.blocks),
            why,
        });
    }
}

#[cfg(test)]
mod tests {
    thread_local! {
        /// What a test runs inside [`ViewRx::ended`], between its two reads.
        static BETWEEN_READS: std::cell::RefCell<Option<Box<dyn FnOnce()>>> =
            const { std::cell::RefCell::new(None) };
    }

    pub(super) fn between_reads() {
        if let Some(f) = BETWEEN_READS.with(|h| h.borrow_mut().take()) {
            f();
        }
    }

    /// Found by running the Python tests in a loop on a loaded machine: `Runtime.wait`
    /// answered `WaitingForInput` for a request that had ended `Done`. Its owner published
    /// the end and went between the waiter's read of the state and its read of `closed`.
    #[test]
    fn an_owner_that_ends_and_goes_between_the_waiters_reads_is_seen_ended() {
        use std::future::Future;
        use std::task::{Context, Poll, Waker};

        let (tx, rx) = view(View {
            state: State::WaitingForInput,
            aux: Vec::new(),
        });
        BETWEEN_READS.with(|h| {
            *h.borrow_mut() = Some(Box::new(move || {
                tx.modify(|v| v.state = State::Done);
                drop(tx);
            }))
        });
        let mut ended = Box::pin(rx.ended());
        let mut cx = Context::from_waker(Waker::noop());
        assert_eq!(ended.as_mut().poll(&mut cx), Poll::Ready(State::Done));
    }
    use super::*;

    fn estate(events: &Arc<EventQueue>) -> (Estate, ViewRx) {
        Estate::new(
            RequestId::from("r"),
            Role::Decode,
            events.clone(),
            Metrics::new(),
        )
    }

    fn consign(e: &Estate, ids: &[u32], events: &Arc<EventQueue>) -> Consignment {
        let metrics = e.metrics.clone();
        Consignment::new(e.id.clone(), e.role, blocks(ids), events.clone(), metrics)
    }

    fn blocks(ids: &[u32]) -> Vec<BlockId> {
        ids.iter().copied().map(BlockId).collect()
    }

    /// Every block in the queue's `Released` events, with why, in order.
    fn released(events: &EventQueue) -> Vec<(BlockId, String)> {
        let mut out = Vec::new();
        for e in events.drain() {
            if let Event::Released { blocks, why, .. } = e {
                out.extend(blocks.into_iter().map(|b| (b, why.as_str().to_string())));
            }
        }
        out
    }

    #[test]
    fn the_owner_releases_what_it_holds_once_and_the_view_follows() {
        let events = Arc::new(EventQueue::default());
        let (mut e, view) = estate(&events);
        let taken = e.receive(consign(&e, &[1, 2, 3], &events));
        assert_eq!(taken, Some(blocks(&[1, 2, 3])));
        e.transition(State::Transferring);
        assert_eq!(view.state(), State::Transferring);
        e.end(State::Done, &blocks(&[1, 2]), ReleaseReason::Done);
        e.release_all(ReleaseReason::Done);
        e.release_all(ReleaseReason::Done);
        assert_eq!(view.state(), State::Done);
        let got = released(&events);
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(got.iter().all(|(_, why)| why == "done"));
        drop(e);
        assert!(
            released(&events).is_empty(),
            "an ended, empty estate gives nothing back when dropped"
        );
    }

    /// A debug build stops at the bug; a release build logs it and gives nothing back twice.
    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "does not hold"))]
    fn a_second_release_of_a_block_is_a_bug_not_a_second_event() {
        let events = Arc::new(EventQueue::default());
        let (mut e, _view) = estate(&events);
        e.receive(consign(&e, &[7], &events));
        e.release(&blocks(&[7]), ReleaseReason::Done);
        assert_eq!(released(&events), [(BlockId(7), "done".to_string())]);
        e.release(&blocks(&[7]), ReleaseReason::Done);
        assert!(released(&events).is_empty(), "a block released twice");
    }

    #[test]
    fn blocks_that_reach_an_ended_request_or_none_go_back_late() {
        let events = Arc::new(EventQueue::default());
        let (mut e, _view) = estate(&events);
        e.fail_if_live(FailureReason::AbortedByEngine);
        let late = consign(&e, &[4], &events);
        assert_eq!(e.receive(late), None);
        // A consignment no owner took (its message dropped on the way).
        drop(consign(&e, &[5], &events));
        let got = released(&events);
        assert_eq!(
            got,
            vec![(BlockId(4), "late".into()), (BlockId(5), "late".into())]
        );
    }

    #[test]
    fn an_estate_dropped_live_fails_its_request_and_gives_its_blocks_back() {
        let events = Arc::new(EventQueue::default());
        let (mut e, view) = estate(&events);
        e.receive(consign(&e, &[1, 2], &events));
        drop(e);
        assert!(matches!(
            view.state(),
            State::Failed(FailureReason::Internal { .. })
        ));
        let all = events.drain();
        assert!(all.iter().any(|ev| matches!(
            ev,
            Event::State {
                state: State::Failed(_),
                ..
            }
        )));
        let why: Vec<_> = all
            .iter()
            .filter_map(|ev| match ev {
                Event::Released { blocks: b, why, .. } => Some((b.clone(), why.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(why, vec![(blocks(&[1, 2]), ReleaseReason::Shutdown)]);
    }

    #[test]
    fn an_orphan_fails_holding_its_blocks_until_the_root_releases_them() {
        let events = Arc::new(EventQueue::default());
        let (e, _view) = estate(&events);
        let deed = Deed::new(e);
        deed.with(|e| e.receive(consign(e, &[3], &events)));
        // The actor is gone: the root takes the estate, and the actor's deed is empty.
        let mut taken = deed.take().expect("the estate");
        assert!(deed.with(|_| ()).is_none());
        let reason = FailureReason::Internal {
            detail: "request actor failed".into(),
        };
        assert!(taken.fail_holding(reason));
        assert!(released(&events).is_empty(), "held for the fence");
        taken.release_all(taken.ended_why(Some(FenceEnd::Bound)));
        let got = events.drain();
        assert!(
            matches!(
                &got[..],
                [Event::Released {
                    why: ReleaseReason::Failed {
                        fence: Some(FenceEnd::Bound),
                        ..
                    },
                    ..
                }]
            ),
            "{got:?}"
        );
    }
}
