//! A worker's KV block allocator, as the engine above the runtime keeps it.
//!
//! The simulated engine allocates blocks here, hands them to the runtime, and frees them
//! when a `Released` event gives them back. Each block records which request owns it, so
//! the data transport can tell a transfer that lands in blocks their request no longer
//! owns (a use after release). Freed blocks are reused last-in first-out, so a block given
//! back too early is handed to the next request at once and the misuse shows.

use handoff_actors::{BlockId, RequestId};

/// One worker's blocks and who owns each.
#[derive(Debug)]
pub struct Pool {
    owner: Vec<Option<RequestId>>,
    free: Vec<u32>,
}

impl Pool {
    /// `blocks` free blocks.
    pub fn new(blocks: u32) -> Self {
        Self {
            owner: vec![None; blocks as usize],
            free: (0..blocks).rev().collect(),
        }
    }

    /// Free blocks now.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// True when no block is owned.
    pub fn all_free(&self) -> bool {
        self.free.len() == self.owner.len()
    }

    /// The owned blocks and their owners (for leak reports).
    pub fn owned(&self) -> Vec<(BlockId, RequestId)> {
        self.owner
            .iter()
            .enumerate()
            .filter_map(|(i, o)| o.clone().map(|o| (BlockId(i as u32), o)))
            .collect()
    }

    /// `n` blocks for `owner`, or `None` (nothing taken) if fewer are free.
    pub fn alloc(&mut self, n: u32, owner: &RequestId) -> Option<Vec<BlockId>> {
        if (n as usize) > self.free.len() {
            return None;
        }
        let at = self.free.len() - n as usize;
        let blocks: Vec<BlockId> = self.free.drain(at..).rev().map(BlockId).collect();
        for b in &blocks {
            self.owner[b.0 as usize] = Some(owner.clone());
        }
        Some(blocks)
    }

    /// Frees `owner`'s blocks. `Err` names a block that `owner` did not own (a double or
    /// foreign release); nothing is freed then.
    pub fn free(&mut self, blocks: &[BlockId], owner: &RequestId) -> Result<(), String> {
        for b in blocks {
            match self.owner.get(b.0 as usize) {
                Some(Some(o)) if o == owner => {}
                Some(other) => {
                    return Err(format!(
                        "block {b} freed for {owner} but owned by {:?}",
                        other
                    ))
                }
                None => return Err(format!("block {b} is outside the pool")),
            }
        }
        for b in blocks {
            self.owner[b.0 as usize] = None;
            self.free.push(b.0);
        }
        Ok(())
    }

    /// Who owns `block` now.
    pub fn owner(&self, block: BlockId) -> Option<&RequestId> {
        self.owner.get(block.0 as usize).and_then(Option::as_ref)
    }

    /// True if every block of `blocks` is owned by `owner`.
    pub fn owns_all(&self, blocks: &[BlockId], owner: &RequestId) -> bool {
        blocks.iter().all(|b| self.owner(*b) == Some(owner))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_frees_and_refuses_double_or_foreign_frees() {
        let (a, b) = (RequestId::new("a"), RequestId::new("b"));
        let mut p = Pool::new(4);
        let x = p.alloc(3, &a).unwrap();
        assert!(p.alloc(2, &b).is_none(), "only one block left");
        assert!(p.free(&x, &b).is_err(), "foreign free");
        p.free(&x, &a).unwrap();
        assert!(p.free(&x, &a).is_err(), "double free");
        assert!(p.all_free());
        let y = p.alloc(1, &b).unwrap();
        assert_eq!(y[0], x[2], "last freed is reused first");
    }
}
