//! The in-process transport: prefill and decode runtimes in one process.
//!
//! A [`Fabric`] is a directory of the runtimes attached to it. Control messages become
//! messages to the destination runtime's root actor; data moves by bounds-checked copies
//! between the runtimes' [`Region`]s. It is a real transport for P and D in one process
//! (tests, examples, single-host setups), not a stand-in: the runtime above it is the same.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use handoff_transport::{BlockId, BlockSlice, EngineId, RankInfo, Region, RequestId, Role};

use crate::link::{
    Attach, Inbox, Link, LinkError, ResolveError, ResolveFuture, TransferError, TransferFuture,
};
use crate::machine::{Peer, PeerMessage};
use crate::Error;
use handoff_transport::data::{Access, GrantTable};

struct Node {
    role: Role,
    root: Inbox,
    region: Arc<Region>,
    /// What this runtime let its peers touch; every copy into or out of its region is
    /// checked against it, so nothing lands in blocks after their request ended here.
    grants: Arc<GrantTable>,
}

/// Decides whether one control message is delivered (`true`) or lost (`false`).
/// Arguments: sender, receiver, request, message.
pub type MessageFilter = dyn Fn(&Peer, &Peer, &RequestId, &PeerMessage) -> bool + Send + Sync;

/// The runtimes of one process that can reach each other. Share it with `Arc`.
#[derive(Default)]
pub struct Fabric {
    nodes: Mutex<BTreeMap<RankInfo, Node>>,
    filter: Mutex<Option<Arc<MessageFilter>>>,
}

impl Fabric {
    /// An empty fabric.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn nodes(&self) -> std::sync::MutexGuard<'_, BTreeMap<RankInfo, Node>> {
        // The map is consistent between operations; a panic elsewhere cannot tear it.
        self.nodes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Attaches a runtime's inbox and region; returns its link.
    fn attach_node(
        self: &Arc<Self>,
        rank: RankInfo,
        role: Role,
        root: Inbox,
        region: Arc<Region>,
    ) -> Result<Arc<InProcessLink>, Error> {
        let mut nodes = self.nodes();
        if nodes.contains_key(&rank) {
            return Err(Error::AlreadyAttached(rank));
        }
        let grants = Arc::new(GrantTable::default());
        nodes.insert(
            rank.clone(),
            Node {
                role,
                root,
                region: region.clone(),
                grants: grants.clone(),
            },
        );
        Ok(Arc::new(InProcessLink {
            fabric: self.clone(),
            me: rank,
            region,
            grants,
        }))
    }

    /// Fault injection: from now on, control messages for which `filter` returns false are
    /// lost in flight (the sender sees success, as on a real network).
    pub fn set_filter(
        &self,
        filter: impl Fn(&Peer, &Peer, &RequestId, &PeerMessage) -> bool + Send + Sync + 'static,
    ) {
        *self.filter.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(filter));
    }

    /// Removes the message filter: every message is delivered again.
    pub fn clear_filter(&self) {
        *self.filter.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    fn delivers(&self, from: &Peer, to: &Peer, id: &RequestId, msg: &PeerMessage) -> bool {
        let filter = self
            .filter
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        filter.is_none_or(|f| f(from, to, id, msg))
    }

    /// The runtimes attached now, with their roles.
    pub fn attached(&self) -> Vec<(RankInfo, Role)> {
        self.nodes()
            .iter()
            .map(|(r, n)| (r.clone(), n.role))
            .collect()
    }

    fn region_of(&self, peer: &Peer) -> Result<(Arc<Region>, Arc<GrantTable>), TransferError> {
        self.nodes()
            .get(peer)
            .map(|n| (n.region.clone(), n.grants.clone()))
            .ok_or_else(|| TransferError::NotAttached { peer: peer.clone() })
    }

    /// What a receiver of `msg` from `from` checks before a byte moves: the blocks `from`
    /// names are in its region, and the two layouts pair ([`BlockSlice::spans_for_ranks`]).
    fn check_pairing(&self, from: &Peer, to: &Peer, msg: &PeerMessage) -> Result<(), String> {
        let (blocks, from_sends) = match msg {
            PeerMessage::TransferInfo { blocks, .. } => (blocks, false),
            PeerMessage::Ready { blocks, .. } => (blocks, true),
            _ => return Ok(()),
        };
        let nodes = self.nodes();
        let (Some(sender), Some(receiver)) = (nodes.get(from), nodes.get(to)) else {
            return Ok(()); // a detached peer: the message finds no one either way
        };
        let (theirs, mine) = (sender.region.layout(), receiver.region.layout());
        if let Some(block) = blocks.iter().find(|b| b.0 >= theirs.blocks) {
            return Err(format!(
                "{from} names block {block}, but its layout has {} blocks",
                theirs.blocks
            ));
        }
        let paired = if from_sends {
            BlockSlice::spans_for_ranks(from, theirs, to, mine)
        } else {
            BlockSlice::spans_for_ranks(to, mine, from, theirs)
        };
        paired
            .map(|_| ())
            .map_err(|e| format!("blocks of {from} and {to} do not pair: {e}"))
    }

    fn resolve_now(
        &self,
        me: &RankInfo,
        prefill: &EngineId,
        dp: Option<u32>,
    ) -> Result<Vec<Peer>, ResolveError> {
        let nodes = self.nodes();
        let ranks: Vec<(&RankInfo, Role)> = nodes
            .iter()
            .filter(|(r, _)| r.engine_id == *prefill)
            .map(|(r, n)| (r, n.role))
            .collect();
        crate::link::select_prefill_peers(me, prefill, dp, ranks)
    }
}

/// One runtime's view of a [`Fabric`].
pub struct InProcessLink {
    fabric: Arc<Fabric>,
    me: RankInfo,
    region: Arc<Region>,
    grants: Arc<GrantTable>,
}

/// Copies under the owner's grant: refused (and nothing copied) unless `peer` holds
/// `access` to `checked` for request `id` in `grants`. Only the layers (and, between TP
/// sizes, the KV heads) both sides hold move ([`BlockSlice::spans_for_ranks`]), from each
/// side's ranges as its layout lays them out.
#[allow(clippy::too_many_arguments)]
fn copy_granted(
    grants: &GrantTable,
    peer: &Peer,
    id: &RequestId,
    access: Access,
    checked: &[BlockId],
    (from_rank, from, from_blocks): (&RankInfo, &Region, &[BlockId]),
    (to_rank, to, to_blocks): (&RankInfo, &Region, &[BlockId]),
) -> Result<(), TransferError> {
    let slices = BlockSlice::spans_for_ranks(from_rank, from.layout(), to_rank, to.layout())
        .map_err(|source| TransferError::Pairing {
            src: from_rank.to_string(),
            dst: to_rank.to_string(),
            source: Box::new(source),
        })?;
    if slices.is_empty() {
        return Ok(()); // nothing in common: nothing to move
    }
    let mut result = Ok(());
    grants.check_and_copy(peer, id, access, checked, &mut || {
        result = slices.iter().try_for_each(|&slice| {
            Region::copy_block_slices(from, from_blocks, to, to_blocks, slice)
                .map_err(|e| TransferError::Copy(Box::new(e)))
        });
    })?;
    result
}

impl Link for InProcessLink {
    fn me(&self) -> &RankInfo {
        &self.me
    }

    fn send(&self, to: &Peer, id: &RequestId, msg: PeerMessage) -> Result<(), LinkError> {
        let root = self.fabric.nodes().get(to).map(|n| n.root.clone());
        let root = root.ok_or_else(|| LinkError::PeerGone(to.to_string()))?;
        if !self.fabric.delivers(&self.me, to, id, &msg) {
            tracing::debug!(request = %id, from = %self.me, %to, ?msg, "message lost (injected)");
            return Ok(());
        }
        // Grant before the message leaves: the peer may act on it at once.
        match &msg {
            PeerMessage::TransferInfo { blocks, .. } => {
                self.grants.grant(to, id, Access::Write, blocks)
            }
            PeerMessage::Ready { blocks, .. } => self.grants.grant(to, id, Access::Read, blocks),
            _ => {}
        }
        // As on the network: the receiver checks the sender's blocks and layout against its
        // own when the transfer info or `Ready` arrives, and fails the request by name.
        if let Err(detail) = self.fabric.check_pairing(&self.me, to, &msg) {
            return if root.deliver_invalid(self.me.clone(), id.clone(), detail) {
                Ok(())
            } else {
                Err(LinkError::PeerGone(to.to_string()))
            };
        }
        if root.deliver(self.me.clone(), id.clone(), msg) {
            Ok(())
        } else {
            Err(LinkError::PeerGone(to.to_string()))
        }
    }

    fn siblings(&self) -> Vec<Peer> {
        self.fabric
            .nodes()
            .keys()
            .filter(|r| {
                r.engine_id == self.me.engine_id && r.dp_rank == self.me.dp_rank && **r != self.me
            })
            .cloned()
            .collect()
    }

    fn resolve(&self, prefill: &EngineId, dp_rank: Option<u32>) -> ResolveFuture {
        let answer = self.fabric.resolve_now(&self.me, prefill, dp_rank);
        Box::pin(async move { answer })
    }

    fn write(
        &self,
        id: &RequestId,
        to: &Peer,
        src: Vec<BlockId>,
        dst: Vec<BlockId>,
        deadline: Instant,
    ) -> TransferFuture {
        if let Some(late) = past(deadline) {
            return late;
        }
        let target = self.fabric.region_of(to);
        let (local, me, id, to) = (self.region.clone(), self.me.clone(), id.clone(), to.clone());
        Box::pin(async move {
            let (target, grants) = target?;
            copy_granted(
                &grants,
                &me,
                &id,
                Access::Write,
                &dst,
                (&me, &local, &src),
                (&to, &target, &dst),
            )
        })
    }

    fn read(
        &self,
        id: &RequestId,
        from: &Peer,
        src: Vec<BlockId>,
        dst: Vec<BlockId>,
        deadline: Instant,
    ) -> TransferFuture {
        if let Some(late) = past(deadline) {
            return late;
        }
        let source = self.fabric.region_of(from);
        let (local, me, id, from) = (
            self.region.clone(),
            self.me.clone(),
            id.clone(),
            from.clone(),
        );
        Box::pin(async move {
            let (source, grants) = source?;
            copy_granted(
                &grants,
                &me,
                &id,
                Access::Read,
                &src,
                (&from, &source, &src),
                (&me, &local, &dst),
            )
        })
    }

    fn request_ended(&self, id: &RequestId) {
        self.grants.revoke(id);
    }

    fn detach(&self) {
        self.fabric.nodes().remove(&self.me);
    }
}

/// Attaching through `Arc<Fabric>` (the fabric hands each link a clone of itself).
impl Attach for Arc<Fabric> {
    fn attach(
        &self,
        rank: RankInfo,
        role: Role,
        inbox: Inbox,
        region: Arc<Region>,
    ) -> Result<Arc<dyn Link>, Error> {
        Ok(self.attach_node(rank, role, inbox, region)?)
    }
}

/// A transfer asked for after its deadline is refused (the copy itself is immediate).
fn past(deadline: Instant) -> Option<TransferFuture> {
    (tokio::time::Instant::now().into_std() >= deadline)
        .then(|| -> TransferFuture { Box::pin(async { Err(TransferError::Late) }) })
}
