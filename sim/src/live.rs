//! The live requests of a run, by index: a window over the request indices, not a tree.
//!
//! Requests are numbered in arrival order and most settle within a few milliseconds of
//! arriving, so the live ones are almost all of the indices between the oldest live one
//! and the newest: a slot per index in that window finds a request with one subtraction
//! (a B-tree needed about a dozen comparisons, on every event of every request). The
//! window's front moves past indices as they settle; its length is the span between the
//! oldest live request and the newest, which a request left to its deadline bounds.

use std::collections::VecDeque;

/// Values of type `T` by `u64` key, for keys that arrive about in increasing order and
/// leave about in the order they arrived. Iterates (only [`Live::first`]) in key order, as
/// a `BTreeMap` would.
#[derive(Debug)]
pub struct Live<T> {
    /// The key of `slots[0]`.
    base: u64,
    /// One slot per key from `base` on; the first and last are always full (or none is).
    slots: VecDeque<Option<T>>,
    len: usize,
}

impl<T> Default for Live<T> {
    fn default() -> Self {
        Self {
            base: 0,
            slots: VecDeque::new(),
            len: 0,
        }
    }
}

impl<T> Live<T> {
    /// An empty window.
    pub fn new() -> Self {
        Self::default()
    }

    /// The slot of `key`, if the window covers it.
    fn at(&self, key: u64) -> Option<usize> {
        let i = usize::try_from(key.checked_sub(self.base)?).ok()?;
        (i < self.slots.len()).then_some(i)
    }

    /// Inserts `value` at `key`; the value it replaces, if any.
    pub fn insert(&mut self, key: u64, value: T) -> Option<T> {
        if self.slots.is_empty() {
            self.base = key;
        }
        while key < self.base {
            self.slots.push_front(None);
            self.base -= 1;
        }
        let Ok(i) = usize::try_from(key - self.base) else {
            // Out of any reachable window (a key 2^64 apart on a 32-bit target).
            return None;
        };
        while self.slots.len() <= i {
            self.slots.push_back(None);
        }
        let old = self.slots[i].replace(value);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    /// The value at `key`.
    pub fn get(&self, key: &u64) -> Option<&T> {
        self.at(*key).and_then(|i| self.slots[i].as_ref())
    }

    /// The value at `key`, to change.
    pub fn get_mut(&mut self, key: &u64) -> Option<&mut T> {
        self.at(*key).and_then(|i| self.slots[i].as_mut())
    }

    /// Takes the value at `key` out; the window shrinks past empty slots at either end.
    pub fn remove(&mut self, key: &u64) -> Option<T> {
        let i = self.at(*key)?;
        let value = self.slots[i].take()?;
        self.len -= 1;
        while let Some(None) = self.slots.front() {
            self.slots.pop_front();
            self.base += 1;
        }
        while let Some(None) = self.slots.back() {
            self.slots.pop_back();
        }
        Some(value)
    }

    /// Whether nothing is live.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many values are live.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The value with the smallest key, and its key.
    pub fn first(&self) -> Option<(u64, &T)> {
        // The first slot is full whenever any is (`remove` trims the front).
        self.slots
            .front()
            .and_then(Option::as_ref)
            .map(|v| (self.base, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64, u32),
        Remove(u64),
        Get(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0..64u64, any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            3 => (0..64u64).prop_map(Op::Remove),
            1 => (0..64u64).prop_map(Op::Get),
        ]
    }

    proptest! {
        /// Whatever is inserted and removed, in any order, the window answers as a
        /// B-tree map does.
        #[test]
        fn answers_as_a_btree_map(ops in prop::collection::vec(op(), 0..400)) {
            let mut live = Live::new();
            let mut reference = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, v) => prop_assert_eq!(live.insert(k, v), reference.insert(k, v)),
                    Op::Remove(k) => prop_assert_eq!(live.remove(&k), reference.remove(&k)),
                    Op::Get(k) => {
                        prop_assert_eq!(live.get(&k), reference.get(&k));
                        if let Some(v) = live.get_mut(&k) {
                            *v = v.wrapping_add(1);
                        }
                        if let Some(v) = reference.get_mut(&k) {
                            *v = v.wrapping_add(1);
                        }
                    }
                }
                prop_assert_eq!(live.len(), reference.len());
                prop_assert_eq!(live.is_empty(), reference.is_empty());
                prop_assert_eq!(live.first(), reference.iter().next().map(|(k, v)| (*k, v)));
            }
        }
    }
}
