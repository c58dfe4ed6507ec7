//! How requests ended, remembered for a bounded number of them: the [`crate::router`]'s
//! answer to a message that comes after its request ended.
//!
//! Each tombstone is kept once, in a ring of at most `max` entries (the oldest is
//! overwritten first); a hash table of ring positions finds one by id. The table holds a
//! 4-byte position per tombstone, not a second copy of the id, and a request that ended
//! `Done` (nearly all of them) is stored as one word: a router remembering its 16,384 ends
//! (a thousand of them in the simulator's scale run) keeps about half the memory a map
//! from id to state and a queue of ids took. Lookups compare the ids themselves: exact.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

use handoff_transport::RequestId;
use hashbrown::HashTable;

use crate::machine::State;

/// How one request ended: a `Done` in one word, anything else boxed (failures are rare).
#[derive(Debug)]
enum Tomb {
    Done,
    Other(Box<State>),
}

/// `Done`, lent out by [`Tombstones::get`] for the requests stored as [`Tomb::Done`].
static DONE: State = State::Done;

impl Tomb {
    fn of(state: State) -> Self {
        match state {
            State::Done => Tomb::Done,
            other => Tomb::Other(Box::new(other)),
        }
    }

    fn state(&self) -> &State {
        match self {
            Tomb::Done => &DONE,
            Tomb::Other(state) => state,
        }
    }
}

/// How at most `max` requests ended, by id; the oldest forgotten first.
#[derive(Debug)]
pub(crate) struct Tombstones {
    /// Keyed per router (std's SipHash with random keys): ids chosen by a peer cannot be
    /// made to collide.
    hasher: RandomState,
    /// Positions in `ring`, found by the hash of the id there.
    table: HashTable<u32>,
    /// The tombstones, in the order they were written until the ring is full; then
    /// `next` is the oldest, overwritten by the next one.
    ring: Vec<(RequestId, Tomb)>,
    next: usize,
    max: usize,
}

impl Tombstones {
    /// Remembers at most `max` (at most `u32::MAX`; 0 remembers nothing).
    pub(crate) fn new(max: usize) -> Self {
        Self {
            hasher: RandomState::new(),
            table: HashTable::new(),
            ring: Vec::new(),
            next: 0,
            max: max.min(u32::MAX as usize),
        }
    }

    fn position(&self, hash: u64, id: &RequestId) -> Option<usize> {
        let ring = &self.ring;
        self.table
            .find(hash, |&i| ring[i as usize].0 == *id)
            .map(|&i| i as usize)
    }

    /// How `id` ended, if it is remembered.
    pub(crate) fn get(&self, id: &RequestId) -> Option<&State> {
        let i = self.position(self.hasher.hash_one(id), id)?;
        Some(self.ring[i].1.state())
    }

    /// Remembers how `id` ended: a request remembered already keeps its place in the order
    /// and takes the new state; a new one past `max` makes the oldest forgotten.
    pub(crate) fn insert(&mut self, id: RequestId, state: State) {
        let hash = self.hasher.hash_one(&id);
        if let Some(i) = self.position(hash, &id) {
            self.ring[i].1 = Tomb::of(state);
            return;
        }
        if self.max == 0 {
            return;
        }
        let i = if self.ring.len() < self.max {
            self.ring.push((id, Tomb::of(state)));
            self.ring.len() - 1
        } else {
            let i = self.next;
            self.next = (i + 1) % self.max;
            let old = self.hasher.hash_one(&self.ring[i].0);
            if let Ok(entry) = self.table.find_entry(old, |&j| j as usize == i) {
                entry.remove();
            }
            self.ring[i] = (id, Tomb::of(state));
            i
        };
        let (ring, hasher) = (&self.ring, &self.hasher);
        // `i < max <= u32::MAX`.
        self.table
            .insert_unique(hash, i as u32, |&j| hasher.hash_one(&ring[j as usize].0));
    }

    /// Requests remembered.
    pub(crate) fn len(&self) -> usize {
        self.ring.len()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use handoff_transport::FailureReason;
    use proptest::prelude::*;

    use super::*;

    fn failed(n: u8) -> State {
        State::Failed(FailureReason::Protocol {
            detail: format!("reason {n}"),
        })
    }

    /// What the ring must answer: a queue of (id, state), the oldest dropped past `max`.
    struct Model {
        max: usize,
        q: VecDeque<(RequestId, State)>,
    }

    impl Model {
        fn insert(&mut self, id: RequestId, state: State) {
            if let Some(e) = self.q.iter_mut().find(|(i, _)| *i == id) {
                e.1 = state;
                return;
            }
            if self.max == 0 {
                return;
            }
            self.q.push_back((id, state));
            if self.q.len() > self.max {
                self.q.pop_front();
            }
        }

        fn get(&self, id: &RequestId) -> Option<&State> {
            self.q.iter().find(|(i, _)| i == id).map(|(_, s)| s)
        }
    }

    proptest! {
        /// Any mix of ends (new ids, ids again, `Done` or a failure) over a small id space
        /// and a small bound: every id answers as the model does, and no more than `max`
        /// are remembered.
        #[test]
        fn remembers_the_newest_max_ends_exactly(
            max in 0usize..6,
            ops in proptest::collection::vec((0u8..12, 0u8..3), 0..80),
        ) {
            let mut ring = Tombstones::new(max);
            let mut model = Model { max, q: VecDeque::new() };
            for (id, how) in ops {
                let id = RequestId::new(format!("r{id}"));
                let state = if how == 0 { State::Done } else { failed(how) };
                ring.insert(id.clone(), state.clone());
                model.insert(id, state);
                prop_assert!(ring.len() <= max);
                prop_assert_eq!(ring.len(), model.q.len());
                for n in 0u8..12 {
                    let id = RequestId::new(format!("r{n}"));
                    prop_assert_eq!(ring.get(&id), model.get(&id), "id r{}", n);
                }
            }
        }
    }

    #[test]
    fn a_done_end_is_one_word() {
        assert_eq!(std::mem::size_of::<Tomb>(), std::mem::size_of::<usize>());
    }
}
