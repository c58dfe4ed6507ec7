//! [`GrantTable`]: a worker's grants, by request. A worker only lets a peer touch blocks it
//! granted for one request: decode grants its prefill peer *write* access to the
//! destination blocks when it sends its transfer info; prefill grants *read* access to its
//! source blocks when it says `Ready`. Grants are revoked when the request ends, before its
//! blocks are released, and revoking waits for a copy in flight under that grant to finish,
//! so no byte lands in a block after the engine got it back.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::{Access, GrantError};
use crate::types::{BlockId, RankInfo, RequestId};

/// One request's grants: a request has one peer per pipeline rank of the other side
/// (decode grants each prefill pipeline rank write access to the same blocks), so each
/// peer's grant is its own entry. Most requests grant one peer: the entries are a list
/// searched in order (at most [`GRANTS_PER_REQUEST_MAX`]), each peer's blocks sorted, so a
/// grant is two small allocations rather than a tree's nodes.
struct RequestGrants {
    by_peer: Vec<Grant>,
    revoked: bool,
    /// Which grant of the request this is: a grant made after a revocation is a new one.
    generation: u64,
}

/// What one peer may touch: `blocks` sorted, each once.
struct Grant {
    peer: RankInfo,
    access: Access,
    blocks: Vec<BlockId>,
}

impl RequestGrants {
    fn find(&self, peer: &RankInfo, access: Access) -> Option<usize> {
        self.by_peer
            .iter()
            .position(|g| g.access == access && g.peer == *peer)
    }
}

/// Peers one request may grant to: the pipeline ranks of one engine, times its tensor ranks
/// one decode rank reads from (heterogeneous TP), at most.
const GRANTS_PER_REQUEST_MAX: usize = 256;

/// The grants of one worker, by request.
#[derive(Default)]
pub struct GrantTable {
    grants: Mutex<BTreeMap<RequestId, Arc<Mutex<RequestGrants>>>>,
    /// The last generation handed out.
    generations: std::sync::atomic::AtomicU64,
}

impl GrantTable {
    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<RequestId, Arc<Mutex<RequestGrants>>>> {
        self.grants.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Grants `peer` `access` to `blocks` for request `id` (replacing that peer's earlier
    /// grant of that access; other peers' grants stand).
    pub fn grant(&self, peer: &RankInfo, id: &RequestId, access: Access, blocks: &[BlockId]) {
        let entry = self
            .map()
            .entry(id.clone())
            .or_insert_with(|| {
                Arc::new(Mutex::new(RequestGrants {
                    by_peer: Vec::with_capacity(1),
                    revoked: false,
                    generation: self
                        .generations
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                        + 1,
                }))
            })
            .clone();
        let mut grants = entry.lock().unwrap_or_else(|e| e.into_inner());
        let mut sorted = blocks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        match grants.find(peer, access) {
            Some(i) => grants.by_peer[i].blocks = sorted,
            None if grants.by_peer.len() >= GRANTS_PER_REQUEST_MAX => {
                tracing::warn!(request = %id, %peer, "too many peers granted for one request; grant dropped");
            }
            None => grants.by_peer.push(Grant {
                peer: peer.clone(),
                access,
                blocks: sorted,
            }),
        }
    }

    /// Revokes every grant of request `id`; waits for a copy in flight under it to finish.
    pub fn revoke(&self, id: &RequestId) {
        let grant = self.map().remove(id);
        if let Some(grant) = grant {
            grant.lock().unwrap_or_else(|e| e.into_inner()).revoked = true;
        }
    }

    /// Runs `copy` if `peer` holds `access` to all of `blocks` for request `id`, holding the
    /// grant for the copy's duration; a named refusal otherwise.
    pub fn check_and_copy(
        &self,
        peer: &RankInfo,
        id: &RequestId,
        access: Access,
        blocks: &[BlockId],
        copy: &mut dyn FnMut(),
    ) -> Result<u64, GrantError> {
        let grant = self
            .map()
            .get(id)
            .cloned()
            .ok_or_else(|| GrantError::NoGrant {
                request: id.clone(),
            })?;
        let grants = grant.lock().unwrap_or_else(|e| e.into_inner());
        if grants.revoked {
            return Err(GrantError::Revoked {
                request: id.clone(),
            });
        }
        let Some(granted) = grants.find(peer, access).map(|i| &grants.by_peer[i].blocks) else {
            return Err(GrantError::NotHeld {
                request: id.clone(),
                peer: peer.clone(),
                access,
            });
        };
        if let Some(b) = blocks.iter().find(|b| granted.binary_search(b).is_err()) {
            return Err(GrantError::Block {
                request: id.clone(),
                block: *b,
                peer: peer.clone(),
            });
        }
        copy();
        Ok(grants.generation)
    }

    /// Requests with a live grant.
    pub fn len(&self) -> usize {
        self.map().len()
    }

    /// True with no live grant.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The data servers call this for every remote write or read.
impl super::Grants for GrantTable {
    fn with_grant(
        &self,
        peer: &RankInfo,
        request: &RequestId,
        access: Access,
        blocks: &[BlockId],
        f: &mut dyn FnMut(),
    ) -> Result<(), GrantError> {
        self.check_and_copy(peer, request, access, blocks, f)
            .map(|_| ())
    }

    fn generation(
        &self,
        peer: &RankInfo,
        request: &RequestId,
        access: Access,
        blocks: &[BlockId],
    ) -> Result<u64, GrantError> {
        self.check_and_copy(peer, request, access, blocks, &mut || {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_are_per_request_peer_access_and_block() {
        let t = GrantTable::default();
        let (p, q) = (RankInfo::single("P"), RankInfo::single("Q"));
        let id = RequestId::new("r");
        t.grant(&p, &id, Access::Write, &[BlockId(1), BlockId(2)]);
        let mut copies = 0;
        assert!(t
            .check_and_copy(&p, &id, Access::Write, &[BlockId(2)], &mut || copies += 1)
            .is_ok());
        assert!(t
            .check_and_copy(&q, &id, Access::Write, &[BlockId(2)], &mut || copies += 1)
            .is_err());
        assert!(t
            .check_and_copy(&p, &id, Access::Read, &[BlockId(2)], &mut || copies += 1)
            .is_err());
        assert!(t
            .check_and_copy(&p, &id, Access::Write, &[BlockId(3)], &mut || copies += 1)
            .is_err());
        // A second peer's grant for the same request (another pipeline rank) stands
        // beside the first.
        t.grant(&q, &id, Access::Write, &[BlockId(2)]);
        assert!(t
            .check_and_copy(&q, &id, Access::Write, &[BlockId(2)], &mut || copies += 1)
            .is_ok());
        assert!(t
            .check_and_copy(&p, &id, Access::Write, &[BlockId(1)], &mut || copies += 1)
            .is_ok());
        t.revoke(&id);
        for peer in [&p, &q] {
            assert!(t
                .check_and_copy(peer, &id, Access::Write, &[BlockId(2)], &mut || copies += 1)
                .is_err());
        }
        assert_eq!(copies, 3);
        assert!(t.is_empty());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Grant(usize, usize, bool, Vec<u32>),
        Revoke(usize),
        Check(usize, usize, bool, Vec<u32>),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let blocks = || proptest::collection::vec(0u32..12, 0..6);
        prop_oneof![
            (0..3usize, 0..3usize, any::<bool>(), blocks())
                .prop_map(|(r, p, w, b)| Op::Grant(r, p, w, b)),
            (0..3usize).prop_map(Op::Revoke),
            (0..3usize, 0..3usize, any::<bool>(), blocks())
                .prop_map(|(r, p, w, b)| Op::Check(r, p, w, b)),
        ]
    }

    proptest::proptest! {
        /// Any mix of grants (repeated blocks, repeated peers, both accesses), revocations
        /// and checks answers as a map from (request, peer, access) to a set of blocks does.
        #[test]
        fn answers_as_a_map_of_sets_would(ops in proptest::collection::vec(op(), 0..60)) {
            use std::collections::{BTreeMap, BTreeSet};
            let t = GrantTable::default();
            let peers = [RankInfo::single("P"), RankInfo::single("Q"), RankInfo::single("R")];
            let ids = [RequestId::new("a"), RequestId::new("b"), RequestId::new("c")];
            let access = |w: bool| if w { Access::Write } else { Access::Read };
            let mut model: BTreeMap<(usize, usize, bool), BTreeSet<u32>> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Grant(r, p, w, b) => {
                        let blocks: Vec<BlockId> = b.iter().copied().map(BlockId).collect();
                        t.grant(&peers[p], &ids[r], access(w), &blocks);
                        model.insert((r, p, w), b.into_iter().collect());
                    }
                    Op::Revoke(r) => {
                        t.revoke(&ids[r]);
                        model.retain(|k, _| k.0 != r);
                    }
                    Op::Check(r, p, w, b) => {
                        let blocks: Vec<BlockId> = b.iter().copied().map(BlockId).collect();
                        let mut copied = false;
                        let got = t.check_and_copy(&peers[p], &ids[r], access(w), &blocks, &mut || copied = true);
                        let want = model.get(&(r, p, w)).is_some_and(|set| b.iter().all(|x| set.contains(x)));
                        proptest::prop_assert_eq!(got.is_ok(), want);
                        proptest::prop_assert_eq!(copied, want);
                    }
                }
            }
            let live: BTreeSet<usize> = model.keys().map(|k| k.0).collect();
            proptest::prop_assert_eq!(t.len(), live.len());
        }
    }
}
