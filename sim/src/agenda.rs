//! The simulation's timed events, in order: by virtual time, then in the order they were
//! scheduled.
//!
//! Events fall on whole milliseconds, and most land a few milliseconds ahead, so the
//! agenda is one first-in-first-out queue per millisecond, the queues in a B-tree by time.
//! Scheduling appends to its millisecond's queue; the next event is the front of the first
//! queue. A B-tree keyed by (time, sequence number) gives the same order, but each event
//! then costs a tree insertion and a removal that shifts a leaf's entries; here most cost
//! a push and a pop, and a millisecond's queue, once empty, is kept for reuse.

use std::collections::{BTreeMap, VecDeque};

/// Empty queues kept for reuse: about as many as milliseconds in flight at once.
const SPARE_QUEUES_MAX: usize = 64;

/// Timed events of type `E` (module docs).
#[derive(Debug)]
pub struct Agenda<E> {
    at: BTreeMap<u64, VecDeque<E>>,
    spare: Vec<VecDeque<E>>,
    len: usize,
}

impl<E> Default for Agenda<E> {
    fn default() -> Self {
        Self {
            at: BTreeMap::new(),
            spare: Vec::new(),
            len: 0,
        }
    }
}

impl<E> Agenda<E> {
    /// An empty agenda.
    pub fn new() -> Self {
        Self::default()
    }

    /// Schedules `event` at virtual time `t`, after every event already scheduled then.
    pub fn push(&mut self, t: u64, event: E) {
        let spare = &mut self.spare;
        self.at
            .entry(t)
            .or_insert_with(|| spare.pop().unwrap_or_default())
            .push_back(event);
        self.len += 1;
    }

    /// When the next event is due.
    pub fn next_time(&self) -> Option<u64> {
        self.at.keys().next().copied()
    }

    /// Takes the next event if it is due at or before `now`, with its time.
    pub fn pop_due(&mut self, now: u64) -> Option<(u64, E)> {
        let mut first = self.at.first_entry()?;
        let t = *first.key();
        if t > now {
            return None;
        }
        let event = first.get_mut().pop_front();
        if first.get().is_empty() {
            let queue = first.remove();
            if self.spare.len() < SPARE_QUEUES_MAX {
                self.spare.push(queue);
            }
        }
        if event.is_some() {
            self.len -= 1;
        }
        event.map(|e| (t, e))
    }

    /// How many events are scheduled.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is scheduled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every event, in order.
    pub fn iter(&self) -> impl Iterator<Item = &E> {
        self.at.values().flatten()
    }

    /// Keeps only the events `keep` says to, in order.
    pub fn retain(&mut self, mut keep: impl FnMut(&E) -> bool) {
        for queue in self.at.values_mut() {
            queue.retain(&mut keep);
        }
        self.at.retain(|_, queue| !queue.is_empty());
        self.len = self.at.values().map(VecDeque::len).sum();
    }

    /// Takes out the events after `now` that `pick` says to, in order.
    pub fn take_after(&mut self, now: u64, mut pick: impl FnMut(&E) -> bool) -> Vec<E> {
        let mut taken = Vec::new();
        for (_, queue) in self.at.range_mut(now.saturating_add(1)..) {
            let mut kept = VecDeque::with_capacity(queue.len());
            for event in queue.drain(..) {
                if pick(&event) {
                    taken.push(event);
                } else {
                    kept.push_back(event);
                }
            }
            *queue = kept;
        }
        self.at.retain(|_, queue| !queue.is_empty());
        self.len -= taken.len();
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What the agenda must match: a B-tree keyed by (time, sequence number).
    #[derive(Default)]
    struct Reference {
        map: BTreeMap<(u64, u64), u32>,
        seq: u64,
    }

    impl Reference {
        fn push(&mut self, t: u64, e: u32) {
            self.seq += 1;
            self.map.insert((t, self.seq), e);
        }
        fn pop_due(&mut self, now: u64) -> Option<(u64, u32)> {
            let entry = self.map.first_entry()?;
            if entry.key().0 > now {
                return None;
            }
            let ((t, _), e) = entry.remove_entry();
            Some((t, e))
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Push { ahead: u64, e: u32 },
        Run { ahead: u64 },
        Retain { odd: bool },
        TakeAfter { ahead: u64 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0..12u64, any::<u32>()).prop_map(|(ahead, e)| Op::Push { ahead, e }),
            3 => (0..6u64).prop_map(|ahead| Op::Run { ahead }),
            1 => any::<bool>().prop_map(|odd| Op::Retain { odd }),
            1 => (0..6u64).prop_map(|ahead| Op::TakeAfter { ahead }),
        ]
    }

    proptest! {
        /// Whatever is scheduled, run, filtered or taken out, the agenda gives the events
        /// in the reference's order, at the same times.
        #[test]
        fn events_come_in_time_then_schedule_order(ops in prop::collection::vec(op(), 0..300)) {
            let mut agenda = Agenda::new();
            let mut reference = Reference::default();
            let mut now = 0u64;
            for op in ops {
                match op {
                    Op::Push { ahead, e } => {
                        agenda.push(now + ahead, e);
                        reference.push(now + ahead, e);
                    }
                    Op::Run { ahead } => {
                        now += ahead;
                        loop {
                            let got = agenda.pop_due(now);
                            prop_assert_eq!(got, reference.pop_due(now));
                            if got.is_none() {
                                break;
                            }
                        }
                    }
                    Op::Retain { odd } => {
                        agenda.retain(|e| (e % 2 == 1) == odd);
                        reference.map.retain(|_, e| (*e % 2 == 1) == odd);
                    }
                    Op::TakeAfter { ahead } => {
                        let after = now + ahead;
                        let taken = agenda.take_after(after, |e| e % 3 == 0);
                        let keys: Vec<(u64, u64)> = reference
                            .map
                            .iter()
                            .filter(|((t, _), e)| *t > after && *e % 3 == 0)
                            .map(|(k, _)| *k)
                            .collect();
                        let want: Vec<u32> =
                            keys.iter().filter_map(|k| reference.map.remove(k)).collect();
                        prop_assert_eq!(taken, want);
                    }
                }
                prop_assert_eq!(agenda.len(), reference.map.len());
                prop_assert_eq!(agenda.next_time(), reference.map.keys().next().map(|k| k.0));
                let order: Vec<u32> = agenda.iter().copied().collect();
                let want: Vec<u32> = reference.map.values().copied().collect();
                prop_assert_eq!(order, want);
            }
        }
    }
}
