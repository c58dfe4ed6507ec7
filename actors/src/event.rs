//! Lifecycle events, collected without blocking by the engine once per step.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use std::fmt;

use handoff_transport::{BlockId, FailureReason, RequestId, Role};

use crate::machine::State;

/// One thing the engine should know about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A request changed state on this rank. `Done` and `Failed` are final.
    State {
        /// The request.
        id: RequestId,
        /// Which side this runtime is.
        role: Role,
        /// The new state.
        state: State,
    },
    /// The runtime no longer holds these blocks: on prefill the engine may free them; on
    /// decode, after `Done`, they hold the KV cache and are the engine's to decode from.
    /// Every block handed to the runtime appears in exactly one `Released` event.
    Released {
        /// The request they belonged to.
        id: RequestId,
        /// The blocks.
        blocks: Vec<BlockId>,
        /// Why the runtime let them go.
        why: ReleaseReason,
    },
}

/// Why the runtime let blocks go (carried by [`Event::Released`]), so that a release can be
/// checked from outside against the way its request ended.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReleaseReason {
    /// The request ended `Done`: the blocks were delivered (prefill) or arrived (decode).
    Done,
    /// The request failed for `reason`. With `fence: None` the blocks went when it failed
    /// (nothing could still touch them); otherwise they were held after the failure until
    /// the fence ended as `fence` says (peers could still write or read them).
    Failed {
        /// Why the request failed.
        reason: FailureReason,
        /// How the fence ended, if the blocks were held behind one.
        fence: Option<FenceEnd>,
    },
    /// Handed over after the request had ended (the API refuses that, but a race with the
    /// end can let blocks in): never used, given back at once.
    Late,
    /// The runtime stopped while it held them (the request was live, or its fence was).
    Shutdown,
}

/// How a fence on a failed request's blocks ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FenceEnd {
    /// Every peer that could still write or read the blocks said it no longer can
    /// (`AbortAck`, `Done`, `ReadDone`) or was declared lost, and no read of ours is in
    /// flight.
    Confirmed,
    /// The fence bound ([`crate::Timeouts::fence_max`]) passed without that: no operation
    /// started before the failure can still be running.
    Bound,
}

impl FenceEnd {
    /// A short, stable name: `confirmed` or `bound`.
    pub fn as_str(self) -> &'static str {
        match self {
            FenceEnd::Confirmed => "confirmed",
            FenceEnd::Bound => "bound",
        }
    }
}

impl ReleaseReason {
    /// A short, stable name: `done`, `failed`, `late` or `shutdown`.
    pub fn as_str(&self) -> &'static str {
        match self {
            ReleaseReason::Done => "done",
            ReleaseReason::Failed { .. } => "failed",
            ReleaseReason::Late => "late",
            ReleaseReason::Shutdown => "shutdown",
        }
    }

    /// The request's failure, for `Failed`.
    pub fn failure(&self) -> Option<&FailureReason> {
        match self {
            ReleaseReason::Failed { reason, .. } => Some(reason),
            _ => None,
        }
    }

    /// How the fence ended, when the blocks were held behind one.
    pub fn fence(&self) -> Option<FenceEnd> {
        match self {
            ReleaseReason::Failed { fence, .. } => *fence,
            _ => None,
        }
    }
}

impl fmt::Display for ReleaseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())?;
        if let Some(reason) = self.failure() {
            write!(f, " ({})", reason.kind())?;
        }
        if let Some(fence) = self.fence() {
            write!(f, " after the fence ({})", fence.as_str())?;
        }
        Ok(())
    }
}

impl Event {
    /// The request this event is about.
    pub fn id(&self) -> &RequestId {
        match self {
            Event::State { id, .. } | Event::Released { id, .. } => id,
        }
    }
}

/// The queue between the runtime's actors and the engine.
///
/// Bounded by admission, not by dropping: a request counts as open from its creation until
/// the engine drains its final `State` event, and the runtime refuses new requests past
/// its limit; each request emits at most a handful of events. So the queue holds at most
/// `requests_open_max × EVENTS_PER_REQUEST_MAX` events and never loses one.
#[derive(Debug, Default)]
pub struct EventQueue {
    events: Mutex<VecDeque<Event>>,
    open: AtomicUsize,
    /// The runtime is stopping: blocks that never reached their request go back as
    /// `Shutdown`, not `Late`.
    stopping: AtomicBool,
    /// Rung after every push, if the engine asked for it ([`Doorbells`]).
    bell: Option<Doorbell>,
}

/// One bit per runtime, set by a runtime as it queues an event: a caller that drives many
/// runtimes (an engine process with one per rank, the simulator's thousand workers) drains
/// only those that have something, without looking at the others.
///
/// A bit is set after its event is queued, so a caller that clears it ([`Doorbells::clear`])
/// before draining misses nothing: an event queued in between is drained now and leaves the
/// bit set for one empty drain later.
#[derive(Debug)]
pub struct Doorbells {
    words: Box<[AtomicU64]>,
}

impl Doorbells {
    /// Bells for `slots` runtimes, none rung.
    pub fn new(slots: usize) -> Arc<Self> {
        let words = (0..slots.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        Arc::new(Self { words })
    }

    /// The bell of slot `slot`, for [`crate::RuntimeBuilder::doorbell`]; `None` past the
    /// last slot.
    pub fn bell(self: &Arc<Self>, slot: usize) -> Option<Doorbell> {
        (slot < self.words.len() * 64).then(|| Doorbell {
            bells: Arc::clone(self),
            slot,
        })
    }

    /// The first rung slot at `from` or after, if any (it stays rung).
    pub fn next(&self, from: usize) -> Option<usize> {
        let mut word = from / 64;
        let mut bits = self.words.get(word)?.load(Ordering::Acquire) & (u64::MAX << (from % 64));
        while bits == 0 {
            word += 1;
            bits = self.words.get(word)?.load(Ordering::Acquire);
        }
        Some(word * 64 + bits.trailing_zeros() as usize)
    }

    /// Unrings slot `slot` (before draining its runtime's events).
    pub fn clear(&self, slot: usize) {
        if let Some(word) = self.words.get(slot / 64) {
            word.fetch_and(!(1 << (slot % 64)), Ordering::AcqRel);
        }
    }
}

/// One runtime's bit in a [`Doorbells`].
#[derive(Clone, Debug)]
pub struct Doorbell {
    bells: Arc<Doorbells>,
    slot: usize,
}

impl Doorbell {
    fn ring(&self) {
        if let Some(word) = self.bells.words.get(self.slot / 64) {
            word.fetch_or(1 << (self.slot % 64), Ordering::AcqRel);
        }
    }
}

/// Events one request can emit: four state changes, one release at the end, one for blocks
/// handed over after the end (which the API refuses, but a race with the end can let one in).
pub const EVENTS_PER_REQUEST_MAX: usize = 6;

impl EventQueue {
    /// A queue that rings `bell` at every push.
    pub(crate) fn with_bell(bell: Option<Doorbell>) -> Self {
        Self {
            bell,
            ..Self::default()
        }
    }

    pub(crate) fn push(&self, event: Event) {
        self.lock().push_back(event);
        if let Some(bell) = &self.bell {
            bell.ring();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Event>> {
        // A poisoned lock only means a panic elsewhere while holding it; the queue itself
        // is always in a consistent state between pushes and pops.
        self.events.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a new request if the runtime is under `max`; `Err(open)` otherwise.
    pub(crate) fn admit(&self, max: usize) -> Result<(), usize> {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .map(|_| ())
    }

    /// Un-counts a request that was admitted but never created.
    pub(crate) fn unadmit(&self) {
        let _ = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    /// Marks the runtime stopping (once it is, it does not start again).
    pub(crate) fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// Whether the runtime is stopping.
    pub(crate) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Requests open now (live, or ended with their final event not drained).
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Takes every queued event, oldest first. Never blocks on the runtime.
    pub fn drain(&self) -> Vec<Event> {
        // The queue's buffer becomes the answer (no copy of each event); the queue starts
        // a new one at its next push.
        let events = Vec::from(std::mem::take(&mut *self.lock()));
        for e in &events {
            if matches!(e, Event::State { state, .. } if state.is_terminal()) {
                self.unadmit();
            }
        }
        events
    }

    /// Moves every queued event to the end of `out`, oldest first, as [`drain`](Self::drain)
    /// takes them; the queue keeps its buffer (a caller that drains often, into a buffer of
    /// its own, allocates nothing once both have grown). Never blocks on the runtime.
    pub fn drain_into(&self, out: &mut Vec<Event>) {
        let from = out.len();
        out.extend(self.lock().drain(..));
        for e in &out[from..] {
            if matches!(e, Event::State { state, .. } if state.is_terminal()) {
                self.unadmit();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(id: &str, state: State) -> Event {
        Event::State {
            id: RequestId::new(id),
            role: Role::Decode,
            state,
        }
    }

    #[test]
    fn a_queue_rings_its_bell_at_each_push_and_only_its_own() {
        let bells = Doorbells::new(130);
        assert!(bells.bell(192).is_none(), "past the last word");
        let (a, b) = (
            EventQueue::with_bell(bells.bell(3)),
            EventQueue::with_bell(bells.bell(129)),
        );
        assert_eq!(bells.next(0), None, "nothing rung yet");
        a.push(state("r1", State::Bootstrapping));
        b.push(state("r2", State::Bootstrapping));
        assert_eq!(bells.next(0), Some(3));
        assert_eq!(bells.next(4), Some(129), "found in a later word");
        bells.clear(3);
        assert_eq!(bells.next(0), Some(129), "a cleared bell stays quiet");
        assert_eq!(a.drain().len(), 1);
        a.push(state("r1", State::Done));
        assert_eq!(bells.next(0), Some(3), "rung again by the next push");
        bells.clear(3);
        bells.clear(129);
        assert_eq!(bells.next(0), None);
        assert_eq!((a.drain().len(), b.drain().len()), (1, 1));
    }

    #[test]
    fn drain_into_appends_in_order_and_counts_final_states_as_drain_does() {
        let (a, b) = (EventQueue::default(), EventQueue::default());
        let events = [
            state("r1", State::Bootstrapping),
            state("r1", State::Done),
            Event::Released {
                id: RequestId::new("r1"),
                blocks: vec![BlockId(3)],
                why: ReleaseReason::Done,
            },
            state("r2", State::Done),
        ];
        for q in [&a, &b] {
            for _ in 0..3 {
                q.admit(8).unwrap();
            }
            for e in &events {
                q.push(e.clone());
            }
        }
        let mut out = vec![state("r0", State::Bootstrapping)];
        a.drain_into(&mut out);
        assert_eq!(
            out[0],
            state("r0", State::Bootstrapping),
            "kept what was there"
        );
        assert_eq!(out[1..], b.drain()[..]);
        assert_eq!((a.open(), b.open()), (1, 1), "two final states drained");
        out.clear();
        a.drain_into(&mut out);
        assert!(out.is_empty());
        a.push(state("r3", State::Bootstrapping));
        a.drain_into(&mut out);
        assert_eq!(out, [state("r3", State::Bootstrapping)]);
    }
}
