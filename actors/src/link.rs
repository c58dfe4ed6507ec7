//! What a runtime needs from a transport, as one trait.
//!
//! The request actors call it; the in-process [`crate::inproc::Fabric`] implements it today,
//! and the ZeroMQ control plane with UCX/TCP data planes implements it next. Every method
//! returns at once or with a future that the caller bounds with a deadline; none blocks.

use std::future::Future;
use std::pin::Pin;

use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_transport::data::{DataError, GrantError};
use handoff_transport::{
    BlockId, EngineId, FailureReason, RankInfo, Region, RegionError, RequestId, Role,
};

use crate::machine::{Peer, PeerMessage};
use crate::runtime::RootMsg;
use crate::Error;

pub use crate::machine::PLANE_ANSWER_GRACE;

/// Resolves once a peer's process has exited ([`Link::writer_exit`]).
pub type ExitFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The outcome of a data transfer.
pub type TransferFuture = Pin<Box<dyn Future<Output = Result<(), TransferError>> + Send>>;

/// Why a transfer failed, whichever plane ran it. The request fails
/// `TransferFailed` with this text; nothing here is retried.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The peer is not attached to this link (in process: it left the fabric).
    #[error("peer {peer} is not attached")]
    NotAttached {
        /// The peer.
        peer: Peer,
    },
    /// The peer's hello described no KV layout, so its memory cannot be addressed.
    #[error("{peer} described no KV layout when it connected")]
    NoLayout {
        /// The peer.
        peer: Peer,
    },
    /// The peer offers memory of another transport than this worker's data plane moves.
    #[error("{peer} offers {offered} memory; this worker moves data over {ours}")]
    WrongTransport {
        /// The peer.
        peer: Peer,
        /// What it offers.
        offered: String,
        /// What this side moves.
        ours: &'static str,
    },
    /// The two ranks' blocks cannot be paired (layouts, layer ranges).
    #[error("blocks of {src} and {dst} do not pair: {source}")]
    Pairing {
        /// The rank the bytes come from.
        src: String,
        /// The rank they go to.
        dst: String,
        /// Why.
        source: Box<RegionError>,
    },
    /// No data connection to the peer could be made by the transfer's deadline.
    #[error("no data connection to {address} by the transfer's deadline")]
    ConnectTimeout {
        /// The peer's data address.
        address: String,
    },
    /// The peer's write grant came over a control connection that has since closed: the
    /// peer may have taken us as lost and failed the request, so nothing is written.
    #[error("the write grant of {peer} came over a connection that has since closed: it may have failed the request and given the blocks back")]
    GrantFromOldConnection {
        /// The peer.
        peer: Peer,
    },
    /// The transfer was asked for after its deadline.
    #[error("the transfer's deadline passed before it started")]
    Late,
    /// The side whose memory it touches holds no grant covering it.
    #[error(transparent)]
    Grant(#[from] GrantError),
    /// The data plane failed it (connection, refusal, timeout, bounds).
    #[error(transparent)]
    Data(#[from] DataError),
    /// Copying between two regions of this process failed.
    #[error("copy: {0}")]
    Copy(Box<RegionError>),
    /// The data plane did not answer by the transfer's deadline and the grace after it.
    #[error("the data plane did not answer within {grace:?} of the transfer's deadline")]
    Unanswered {
        /// The grace waited past the deadline.
        grace: Duration,
    },
    /// A simulated data plane failed it (the simulator's faults, or a test's plane).
    #[error("{detail}")]
    Simulated {
        /// What the simulator says.
        detail: String,
    },
}

/// The outcome of a bootstrap lookup.
pub type ResolveFuture = Pin<Box<dyn Future<Output = Result<Vec<Peer>, ResolveError>> + Send>>;

/// The peers of [`Link::unwatched`] that the link cannot watch.
pub type UnwatchedFuture = Pin<Box<dyn Future<Output = Vec<Peer>> + Send>>;

/// Why a bootstrap lookup gave no peers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResolveError {
    /// Not every expected prefill rank has registered yet: worth asking again.
    NotReady {
        /// What is missing.
        detail: String,
    },
    /// Asking again will not help (e.g. incompatible parallel layouts).
    Fatal(FailureReason),
}

/// Why a control message could not be handed to the transport.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// The peer is not (or no longer) reachable.
    #[error("peer {0} is gone")]
    PeerGone(String),
}

/// A runtime's connection to everything outside it.
pub trait Link: Send + Sync + 'static {
    /// This runtime's identity, as peers see it.
    fn me(&self) -> &RankInfo;

    /// Sends one control message about request `id` to `to`. Returns once queued.
    fn send(&self, to: &Peer, id: &RequestId, msg: PeerMessage) -> Result<(), LinkError>;

    /// The other ranks of this runtime's engine that serve the same requests (same dp
    /// rank): a failure here is told to them (seed 003).
    fn siblings(&self) -> Vec<Peer>;

    /// The prefill ranks a decode rank receives from for a request served by `prefill`
    /// (at `dp_rank`, or the lowest registered dp rank).
    fn resolve(&self, prefill: &EngineId, dp_rank: Option<u32>) -> ResolveFuture;

    /// Writes local `src` blocks into `to`'s `dst` blocks, for request `id` (the peer
    /// checks it granted those blocks for that request).
    ///
    /// `deadline` is the transfer's one deadline, decided by the request's machine. The
    /// data plane posts nothing after it and answers by it, give or take its bounded
    /// teardown ([`PLANE_ANSWER_GRACE`]); once the future has answered, no byte of this
    /// transfer can land. The machines rely on that: a failed request's blocks (push: the
    /// peer's, held until our `AbortAck`; pull: ours) go back only after the answer.
    fn write(
        &self,
        id: &RequestId,
        to: &Peer,
        src: Vec<BlockId>,
        dst: Vec<BlockId>,
        deadline: Instant,
    ) -> TransferFuture;

    /// Reads `from`'s `src` blocks into local `dst` blocks, for request `id`, by `deadline`
    /// (as [`Link::write`]).
    fn read(
        &self,
        id: &RequestId,
        from: &Peer,
        src: Vec<BlockId>,
        dst: Vec<BlockId>,
        deadline: Instant,
    ) -> TransferFuture;

    /// True when this link's data plane moves bytes one-sidedly (RDMA put and get): the
    /// side whose memory is touched cannot refuse a late operation, so a failed request
    /// fences its blocks until the peer acknowledges (decode in push mode, prefill in pull
    /// mode; see `ReceiverMachine::fence_writes`, `SenderMachine::fence_reads`). False when
    /// every operation is checked against a grant on arrival (TCP, in-process).
    fn one_sided(&self) -> bool {
        false
    }

    /// A lost peer that may still write into our blocks one-sidedly (it was stopped between
    /// the check of its lease and a post, say): a future that resolves once its process
    /// has exited, when this link can watch it (a process on this host, verified to hold
    /// the other end of our control connection). `None` when it cannot (another host, or
    /// a plane that checks every write on arrival).
    ///
    /// `replaced`: a new process (incarnation) has taken the rank since the request lost
    /// it (`Inbox::peer_replaced`), so the writer is one of the rank's earlier processes:
    /// the future waits for those, never for the process that holds the rank now. Otherwise
    /// the writer is the process this link knows for the rank.
    fn writer_exit(&self, peer: &Peer, replaced: bool) -> Option<ExitFuture> {
        let _ = (peer, replaced);
        None
    }

    /// Those of `peers` (a decode request's prefill ranks) whose process this link could
    /// not watch as a lost writer ([`Link::writer_exit`] would say `None`), once it knows:
    /// the link may first connect to them and check who they are, within its own bound,
    /// and answers every peer it could not check in time. Asked only on one-sided planes
    /// before a push's transfer info goes out; a push with any of them runs as pull
    /// (`ReceiverEvent::PeersResolved`). By default every peer, as `writer_exit` watches
    /// none.
    fn unwatched(&self, peers: &[Peer]) -> UnwatchedFuture {
        let peers = peers.to_vec();
        Box::pin(async move { peers })
    }

    /// How long this link goes without hearing from a peer before it takes the peer as
    /// lost, where it watches peers' liveness. On a one-sided plane it must be shorter than
    /// the fence bound (`Timeouts::fence_max`): at the bound a writer still heard is taken
    /// as done, and a writer stopped before its last post must be lost by then (the runtime
    /// refuses to start otherwise).
    fn loss_timeout(&self) -> Option<std::time::Duration> {
        None
    }

    /// The data plane's name in logs and metrics (`ucx`, `tcp`, `inproc`, `sim`).
    fn transport(&self) -> &'static str {
        "inproc"
    }

    /// The request has ended here: revoke whatever the transport granted peers for it
    /// (remote write or read access to its blocks). Called before the blocks are released,
    /// so no byte can land in a block the engine is about to reuse.
    fn request_ended(&self, id: &RequestId) {
        let _ = id;
    }

    /// Leaves the transport: peers see this runtime as gone from now on.
    fn detach(&self);
}

/// A transport a runtime can attach to: the in-process [`crate::Fabric`], the simulator's
/// network, and (next) the ZeroMQ control plane.
pub trait Attach: Send + Sync + 'static {
    /// Attaches one runtime; messages for it go to `inbox`. Returns its link.
    fn attach(
        &self,
        rank: RankInfo,
        role: Role,
        inbox: Inbox,
        region: Arc<Region>,
    ) -> Result<Arc<dyn Link>, Error>;
}

/// Where a transport delivers what arrives for one runtime. Cheap to clone.
#[derive(Clone)]
pub struct Inbox(
    pub(crate) crate::runtime::RootRef,
    pub(crate) Arc<crate::metrics::Metrics>,
);

impl Inbox {
    /// Delivers a peer's control message about request `id`. False if the runtime is gone.
    pub fn deliver(&self, from: Peer, id: RequestId, msg: PeerMessage) -> bool {
        self.0.cast(RootMsg::Inbound { from, id, msg }).is_ok()
    }

    /// Reports a malformed or out-of-range message from a peer about request `id`: the
    /// request fails with a protocol error naming the peer.
    pub fn deliver_invalid(&self, from: Peer, id: RequestId, detail: String) -> bool {
        let what = crate::router::Local::Invalid { from, detail };
        self.0.cast(RootMsg::Local { id, what }).is_ok()
    }

    /// Reports a peer as gone: every request depending on it fails at once.
    pub fn peer_lost(&self, peer: Peer) -> bool {
        self.0.cast(RootMsg::PeerLost { peer }).is_ok()
    }

    /// Reports that a new process (a new incarnation) holds a lost peer's rank: its answers
    /// no longer confirm anything for requests its old process could still write for.
    /// Call it after [`Inbox::peer_lost`] for the old one, and before delivering anything
    /// the new one sent.
    pub fn peer_replaced(&self, peer: Peer) -> bool {
        self.0.cast(RootMsg::PeerReplaced { peer }).is_ok()
    }

    /// Reports that a newer process holds this worker's own rank (`detail`: who, as the
    /// directory said): every open request fails `Superseded` at once, and requests opened
    /// from now on are refused with it. False if the runtime is gone.
    pub fn superseded(&self, detail: String) -> bool {
        self.0.cast(RootMsg::Superseded { detail }).is_ok()
    }

    /// The runtime's metrics, for what the transport counts (frames refused, peers).
    pub fn metrics(&self) -> &Arc<crate::metrics::Metrics> {
        &self.1
    }
}

/// The prefill ranks a decode rank receives from, out of an engine's registered ranks:
/// the chosen dp rank (or the lowest registered), every pipeline rank, and the same tp rank,
/// or, between different TP sizes, the decode rank's share of prefill's tp ranks
/// (`handoff_transport::tp::prefill_share`: the ranks that hold its KV heads, several where
/// decode's TP size divides prefill's, one where prefill's divides decode's). Sizes
/// neither of which divides the other are refused by name; `NotReady` until all of those
/// have registered.
pub fn select_prefill_peers<'a>(
    me: &RankInfo,
    prefill: &EngineId,
    dp_rank: Option<u32>,
    registered: impl IntoIterator<Item = (&'a RankInfo, Role)>,
) -> Result<Vec<Peer>, ResolveError> {
    let ranks: Vec<&RankInfo> = registered
        .into_iter()
        .filter(|(_, role)| *role == Role::Prefill)
        .map(|(r, _)| r)
        .collect();
    let Some(first) = ranks.first() else {
        return Err(ResolveError::NotReady {
            detail: format!("no prefill rank of {prefill} registered"),
        });
    };
    let refused = |why: String| {
        ResolveError::Fatal(FailureReason::Protocol {
            detail: format!(
                "prefill {prefill} has tp_size {}, decode has {}: {why}",
                first.tp_size, me.tp_size
            ),
        })
    };
    // Equal sizes: the one rank of the same tp rank; fan-in: the decode rank's share of
    // prefill's ranks; fan-out: the one prefill rank holding all of its heads.
    let tp = handoff_transport::tp::prefill_share(first.tp_size, me.tp_size, me.tp_rank)
        .map_err(|e| refused(e.to_string()))?;
    let dp = dp_rank.unwrap_or_else(|| ranks.iter().map(|r| r.dp_rank).min().unwrap_or(0));
    let peers: Vec<Peer> = ranks
        .iter()
        .filter(|r| r.dp_rank == dp && tp.contains(&r.tp_rank))
        .map(|r| (*r).clone())
        .collect();
    let want = first.pp_size as usize * tp.len();
    if peers.len() < want {
        return Err(ResolveError::NotReady {
            detail: format!(
                "{} of {want} pipeline and tensor ranks of {prefill} dp{dp} tp{tp:?} registered",
                peers.len(),
            ),
        });
    }
    Ok(peers)
}
