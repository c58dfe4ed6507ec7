//! The data plane as the network transport sees it, and the grants that bound it.
//!
//! A worker only lets a peer touch blocks it granted for one request: decode grants its
//! prefill peer *write* access to the destination blocks when it sends its transfer info;
//! prefill grants *read* access to its source blocks when it says `Ready`. Grants are
//! revoked when the request ends, before its blocks are released, and revoking waits for a
//! copy in flight under that grant to finish, so no byte lands in a block after the engine
//! got it back.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use handoff_transport::data::GrantError;
use handoff_transport::lease::Lease;
use handoff_transport::same_host::PeerProcess;
use handoff_transport::wire::messages::LayoutDescriptor;
use handoff_transport::{BlockId, BlockSlice, RankInfo, RequestId};

use crate::link::TransferFuture;

pub use handoff_transport::data::Access;

/// Moves blocks between this worker and its peers.
pub trait DataPlane: Send + Sync + 'static {
    /// Its name in logs and metrics: `ucx` or `tcp`.
    fn name(&self) -> &'static str;

    /// This worker's KV memory as peers see it, and how to reach it: its layout's ranges
    /// (with a remote key per range on one-sided planes), layers and per-token facts.
    /// Carried once per peer, in `Hello`/`HelloAck`; per-request messages name only blocks.
    fn descriptor(&self) -> LayoutDescriptor;

    /// The address (or name) registered with the bootstrap server.
    fn address(&self) -> String;

    /// True when writes are one-sided (RDMA) and cannot be refused on arrival.
    fn one_sided(&self) -> bool {
        false
    }

    /// Opaque details peers need to reach this plane (e.g. a UCX worker address), carried
    /// in the bootstrap record and in `Hello`/`HelloAck`; empty when the layout descriptor
    /// is enough.
    fn data_descriptor(&self) -> Vec<u8> {
        Vec::new()
    }

    /// True when the plane copies between host memory directly with a peer process on
    /// this host ([`handoff_transport::same_host`]) once the control plane verified it
    /// (`PlaneTransfer::process`): the control plane then offers our pid in `Hello`.
    fn same_host_copies(&self) -> bool {
        false
    }

    /// The grants this plane enforces.
    fn grants(&self) -> &Arc<GrantTable>;

    /// Writes local `t.src` blocks into the peer's `t.dst` blocks.
    fn write(&self, t: PlaneTransfer<'_>) -> TransferFuture;

    /// Reads the peer's `t.src` blocks into local `t.dst` blocks.
    fn read(&self, t: PlaneTransfer<'_>) -> TransferFuture;
}

/// One transfer, as the network link hands it to a data plane.
#[derive(Debug)]
pub struct PlaneTransfer<'a> {
    /// The request the blocks belong to (the peer checks its grant against it).
    pub id: &'a RequestId,
    /// The peer.
    pub peer: &'a RankInfo,
    /// The peer's [`DataPlane::data_descriptor`], from its hello.
    pub peer_data: &'a [u8],
    /// The peer's layout, from its hello (checked on arrival, and paired with ours when
    /// the request's transfer info or `Ready` arrived).
    pub peer_layout: &'a LayoutDescriptor,
    /// Source blocks (`src[i]` → `dst[i]`).
    pub src: Vec<BlockId>,
    /// Destination blocks.
    pub dst: Vec<BlockId>,
    /// The logical bytes of each block moved when the two sides hold different layers
    /// ([`BlockSlice::for_ranks`]); `None` moves whole blocks of equal size.
    pub slice: Option<BlockSlice>,
    /// The writer's lease with the peer ([`Lease`]): a one-sided plane posts a write only
    /// while it holds. Planes that check a grant per operation at the target ignore it.
    pub lease: Option<Arc<Lease>>,
    /// The transfer's one deadline, from the request's machine: the plane posts nothing
    /// after it and answers by it (`Link::write`).
    pub deadline: std::time::Instant,
    /// The peer's process, verified at connect to hold the other end of our control
    /// connection on this host (only for a plane with [`DataPlane::same_host_copies`]).
    pub process: Option<Arc<PeerProcess>>,
}

/// One request's grants: a request has one peer per pipeline rank of the other side
/// (decode grants each prefill pipeline rank write access to the same blocks), so each
/// peer's grant is its own entry.
#[derive(Default)]
struct Grants {
    by_peer: BTreeMap<(RankInfo, Access), BTreeSet<BlockId>>,
    revoked: bool,
}

/// Peers one request may grant to: the pipeline ranks of one engine at most.
const GRANTS_PER_REQUEST_MAX: usize = 64;

/// The grants of one worker, by request.
#[derive(Default)]
pub struct GrantTable {
    grants: Mutex<BTreeMap<RequestId, Arc<Mutex<Grants>>>>,
}

impl GrantTable {
    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<RequestId, Arc<Mutex<Grants>>>> {
        self.grants.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Grants `peer` `access` to `blocks` for request `id` (replacing that peer's earlier
    /// grant of that access; other peers' grants stand).
    pub fn grant(&self, peer: &RankInfo, id: &RequestId, access: Access, blocks: &[BlockId]) {
        let entry = self.map().entry(id.clone()).or_default().clone();
        let mut grants = entry.lock().unwrap_or_else(|e| e.into_inner());
        let key = (peer.clone(), access);
        if grants.by_peer.len() >= GRANTS_PER_REQUEST_MAX && !grants.by_peer.contains_key(&key) {
            tracing::warn!(request = %id, %peer, "too many peers granted for one request; grant dropped");
            return;
        }
        grants.by_peer.insert(key, blocks.iter().copied().collect());
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
    ) -> Result<(), GrantError> {
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
        let Some(granted) = grants.by_peer.get(&(peer.clone(), access)) else {
            return Err(GrantError::NotHeld {
                request: id.clone(),
                peer: peer.clone(),
                access,
            });
        };
        if let Some(b) = blocks.iter().find(|b| !granted.contains(b)) {
            return Err(GrantError::Block {
                request: id.clone(),
                block: *b,
                peer: peer.clone(),
            });
        }
        copy();
        Ok(())
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
impl handoff_transport::data::Grants for GrantTable {
    fn with_grant(
        &self,
        peer: &RankInfo,
        request: &RequestId,
        access: Access,
        blocks: &[BlockId],
        f: &mut dyn FnMut(),
    ) -> Result<(), GrantError> {
        self.check_and_copy(peer, request, access, blocks, f)
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
}
