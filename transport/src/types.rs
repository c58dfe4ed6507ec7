//! The vocabulary every layer shares: request and engine identities, ranks, blocks,
//! transfer modes and the reasons a request fails.
//!
//! These types travel on the wire (they derive bincode's `Encode`/`Decode`), so a change
//! here is a protocol change: bump [`crate::PROTOCOL_VERSION`] when a field changes.

use std::fmt;
use std::sync::Arc;

/// The engine's name for one request. Prefill and decode use the same id for the same request.
///
/// Cheap to clone (`Arc<str>`): a request id is copied into every message and log span.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, bincode::Encode, bincode::Decode)]
pub struct RequestId(pub Arc<str>);

impl RequestId {
    /// Builds a request id from anything string-like.
    pub fn new(id: impl AsRef<str>) -> Self {
        Self(Arc::from(id.as_ref()))
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", &*self.0)
    }
}

impl From<&str> for RequestId {
    fn from(s: &str) -> Self {
        Self::new(s)
    }
}

/// The name of one serving engine (one prefill or decode instance, all its ranks).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, bincode::Encode, bincode::Decode)]
pub struct EngineId(pub Arc<str>);

impl EngineId {
    /// Builds an engine id from anything string-like.
    pub fn new(id: impl AsRef<str>) -> Self {
        Self(Arc::from(id.as_ref()))
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for EngineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for EngineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", &*self.0)
    }
}

impl From<&str> for EngineId {
    fn from(s: &str) -> Self {
        Self::new(s)
    }
}

/// Which side of the handoff a worker is on.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, bincode::Encode, bincode::Decode,
)]
pub enum Role {
    /// Computes the prompt's KV cache and sends it.
    Prefill,
    /// Receives the KV cache and generates tokens from it.
    Decode,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        })
    }
}

/// Where one worker sits in its engine's parallel layout.
///
/// Ranks need not start at zero nor be dense (seed 001: non-sequential dp ranks); the
/// sizes say how many ranks of each kind the engine has, so a bootstrap query can tell
/// when all of them have registered.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, bincode::Encode, bincode::Decode)]
pub struct RankInfo {
    /// The engine this worker belongs to.
    pub engine_id: EngineId,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Number of data-parallel ranks in the engine.
    pub dp_size: u32,
    /// Tensor-parallel rank.
    pub tp_rank: u32,
    /// Number of tensor-parallel ranks.
    pub tp_size: u32,
    /// Pipeline-parallel rank.
    pub pp_rank: u32,
    /// Number of pipeline-parallel ranks.
    pub pp_size: u32,
}

impl RankInfo {
    /// A single-rank engine (dp = tp = pp = 1).
    pub fn single(engine_id: impl Into<EngineId>) -> Self {
        Self {
            engine_id: engine_id.into(),
            dp_rank: 0,
            dp_size: 1,
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
        }
    }

    /// The worker's position without the engine id, for compact logs and map keys.
    pub fn rank(&self) -> Rank {
        Rank {
            dp: self.dp_rank,
            tp: self.tp_rank,
            pp: self.pp_rank,
        }
    }
}

impl From<&str> for RankInfo {
    fn from(engine: &str) -> Self {
        Self::single(engine)
    }
}

impl From<EngineId> for RankInfo {
    fn from(engine: EngineId) -> Self {
        Self::single(engine)
    }
}

impl fmt::Display for RankInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.engine_id, self.rank())
    }
}

/// A worker's (dp, tp, pp) position inside its engine.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, bincode::Encode, bincode::Decode,
)]
pub struct Rank {
    /// Data-parallel rank.
    pub dp: u32,
    /// Tensor-parallel rank.
    pub tp: u32,
    /// Pipeline-parallel rank.
    pub pp: u32,
}

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp{}tp{}pp{}", self.dp, self.tp, self.pp)
    }
}

/// The index of one KV block inside a registered region.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, bincode::Encode, bincode::Decode,
)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The first block listed twice in `blocks`, if any (allocators mostly hand out
    /// ascending runs: no sort for a list that is one).
    pub fn first_repeat(blocks: &[BlockId]) -> Option<BlockId> {
        if blocks.windows(2).all(|w| w[0] < w[1]) {
            return None;
        }
        let mut sorted = blocks.to_vec();
        sorted.sort_unstable();
        sorted.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Who moves the bytes.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    bincode::Encode,
    bincode::Decode,
)]
pub enum TransferMode {
    /// Prefill writes into decode's blocks, then tells decode `Done`.
    #[default]
    Push,
    /// Prefill says `Ready`; decode reads, then tells prefill `ReadDone`. Prefill holds its
    /// blocks under a TTL meanwhile (seed 002).
    Pull,
}

/// Why a request ended in `Failed`. Every path to `Failed` names one of these.
///
/// Ordered (`Ord`) so that merging the states of several ranks picks the same reason
/// whatever the order the ranks are merged in.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, bincode::Encode, bincode::Decode)]
pub enum FailureReason {
    /// The peer's transfer info (or the bootstrap answer) did not come before the bootstrap deadline.
    BootstrapTimeout,
    /// The bootstrap server could not be reached or answered with an error, past every retry.
    BootstrapUnavailable {
        /// The bootstrap server's address.
        address: String,
        /// The last error seen.
        last_error: String,
    },
    /// The input did not come before the waiting deadline: on prefill the engine never
    /// called `send`; on decode the prefill side never said it was done or ready (seed 001).
    WaitingTimeout,
    /// The data transfer did not complete before its deadline.
    TransferTimeout,
    /// The data plane reported an error moving the blocks.
    TransferFailed {
        /// What the data plane said.
        detail: String,
    },
    /// Pull mode: the decode side never read the blocks, and the prefill side freed them at
    /// the end of their time to live (seed 002).
    TtlExpired,
    /// A peer this request depends on stopped answering heartbeats or disconnected.
    PeerLost {
        /// The peer, as `engine/rank`.
        peer: String,
    },
    /// The decode side is saturated and refused the request at once (seed 003).
    RejectedBusy,
    /// The engine aborted the request.
    AbortedByEngine,
    /// The other side (or another rank of this request) aborted or failed the request.
    AbortedByPeer {
        /// The peer that aborted, as `engine/rank`.
        peer: String,
        /// Why the peer gave up, as it reported it.
        cause: String,
    },
    /// A peer sent something malformed, out of range or out of order for this request.
    Protocol {
        /// What was wrong, with the peer named.
        detail: String,
    },
    /// A bug or resource failure inside this runtime (e.g. a panic in the request's actor).
    Internal {
        /// What happened.
        detail: String,
    },
    /// A newer process holds this worker's rank now (this one was stopped, say, and a
    /// supervisor started another in its place): new requests no longer find this one and
    /// peers that know the newer one refuse it, so its open requests fail at once and new
    /// ones are refused. Last, so that every earlier reason keeps its encoding.
    Superseded {
        /// Who holds the rank now, as the directory said.
        detail: String,
    },
}

impl FailureReason {
    /// A short, stable name for the reason, for counters and summaries.
    pub fn kind(&self) -> &'static str {
        match self {
            FailureReason::BootstrapTimeout => "bootstrap_timeout",
            FailureReason::BootstrapUnavailable { .. } => "bootstrap_unavailable",
            FailureReason::WaitingTimeout => "waiting_timeout",
            FailureReason::TransferTimeout => "transfer_timeout",
            FailureReason::TransferFailed { .. } => "transfer_failed",
            FailureReason::TtlExpired => "ttl_expired",
            FailureReason::PeerLost { .. } => "peer_lost",
            FailureReason::RejectedBusy => "rejected_busy",
            FailureReason::AbortedByEngine => "aborted_by_engine",
            FailureReason::AbortedByPeer { .. } => "aborted_by_peer",
            FailureReason::Protocol { .. } => "protocol_error",
            FailureReason::Internal { .. } => "internal_error",
            FailureReason::Superseded { .. } => "superseded",
        }
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailureReason::BootstrapTimeout => f.write_str("bootstrap timeout"),
            FailureReason::BootstrapUnavailable {
                address,
                last_error,
            } => write!(f, "bootstrap server {address} unavailable: {last_error}"),
            FailureReason::WaitingTimeout => f.write_str("waiting timeout"),
            FailureReason::TransferTimeout => f.write_str("transfer timeout"),
            FailureReason::TransferFailed { detail } => write!(f, "transfer failed: {detail}"),
            FailureReason::TtlExpired => {
                f.write_str("TTL expired before the decode side read the blocks")
            }
            FailureReason::PeerLost { peer } => write!(f, "peer lost: {peer}"),
            FailureReason::RejectedBusy => f.write_str("rejected: decode busy"),
            FailureReason::AbortedByEngine => f.write_str("aborted by engine"),
            FailureReason::AbortedByPeer { peer, cause } => {
                write!(f, "aborted by peer {peer}: {cause}")
            }
            FailureReason::Protocol { detail } => write!(f, "protocol error: {detail}"),
            FailureReason::Internal { detail } => write!(f, "internal error: {detail}"),
            FailureReason::Superseded { detail } => {
                write!(f, "superseded by a newer process of this rank: {detail}")
            }
        }
    }
}
