//! The data plane as the network transport sees it. The grants that bound it are
//! [`GrantTable`] (`handoff_transport::data::grants`).

use std::sync::Arc;

use handoff_transport::lease::Lease;
use handoff_transport::same_host::PeerProcess;
use handoff_transport::wire::messages::LayoutDescriptor;
use handoff_transport::{BlockId, BlockSlice, RankInfo, RequestId};

use handoff_actors::link::TransferFuture;

pub use handoff_transport::data::{Access, GrantTable};

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

    /// True when the plane copies directly with a peer process on this host once the
    /// control plane verified it (`PlaneTransfer::process`): between host memory with the
    /// kernel ([`handoff_transport::same_host`]), between device memory through CUDA IPC.
    /// The control plane then welcomes copies in `Hello` (`copies`).
    fn same_host_copies(&self) -> bool {
        false
    }

    /// True when peers on this host should copy into and out of our memory directly
    /// (`Hello::copies`; the pid is offered on every one-sided plane, to be watched): a plane that copies that way, over memory that a peer's
    /// own data plane cannot reach as fast (an engine's registered tensors, which UCX 1.13
    /// reaches by emulated operations). Memory UCX allocated is mapped by a same-host
    /// peer's UCX and copied at memory speed, faster than the kernel's cross-process copy,
    /// so a plane over it offers nothing and peers move its blocks with UCX.
    fn offers_same_host_copies(&self) -> bool {
        self.same_host_copies()
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
    /// The logical bytes of each block moved when the two sides hold different parts of
    /// it (layers, heads: [`BlockSlice::spans_for_ranks`]), all in this one call; none
    /// moves whole blocks of equal size.
    pub slices: Vec<BlockSlice>,
    /// The writer's lease with the peer ([`Lease`]): a one-sided plane posts a write only
    /// while it holds; every plane reports a write seen done only after it ended as
    /// failed ([`Lease::confirm`]). TCP's target checks a grant per operation instead of
    /// the writer checking the lease before each.
    pub lease: Option<Arc<Lease>>,
    /// The transfer's one deadline, from the request's machine: the plane posts nothing
    /// after it and answers by it (`Link::write`).
    pub deadline: std::time::Instant,
    /// The peer's process, verified at connect to hold the other end of our control
    /// connection on this host (only for a plane with [`DataPlane::same_host_copies`]).
    pub process: Option<Arc<PeerProcess>>,
}
