//! The errors the engine-facing API returns.

use handoff_transport::{BlockId, RankInfo, RegionError, RequestId};

use crate::machine::State;

/// Errors from building a runtime or calling it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The runtime was configured wrongly (the message says what to change).
    #[error("invalid runtime configuration: {0}")]
    Config(String),
    /// Another runtime with the same engine and ranks is already attached to the fabric.
    #[error("a runtime for {0} is already attached to this fabric")]
    AlreadyAttached(RankInfo),
    /// The runtime has stopped; nothing more can be done with it.
    #[error("the runtime has stopped")]
    Stopped,
    /// A request with this id is already open on this runtime.
    #[error("request {0} is already open on this runtime")]
    DuplicateRequest(RequestId),
    /// The runtime holds [`crate::RuntimeConfig::requests_open_max`] requests already; drain
    /// events or wait for requests to finish.
    #[error("too many open requests ({open}); drain events or wait for requests to end")]
    TooManyRequests {
        /// Requests open now.
        open: usize,
    },
    /// `sender` on a decode runtime or `receiver` on a prefill one.
    #[error("a {0} runtime cannot do that")]
    WrongRole(handoff_transport::Role),
    /// The request has already ended; the blocks passed in were not taken.
    #[error("request {id} already ended ({state}); {} blocks returned to the caller", blocks.len())]
    RequestEnded {
        /// The request.
        id: RequestId,
        /// How it ended.
        state: State,
        /// The blocks the call tried to hand over, still the caller's.
        blocks: Vec<BlockId>,
    },
    /// The same block was named twice in one hand-over; the blocks were not taken.
    #[error("request {id}: block {block} is named twice; {} blocks returned to the caller", blocks.len())]
    DuplicateBlock {
        /// The request.
        id: RequestId,
        /// The first block named twice.
        block: BlockId,
        /// The blocks the call tried to hand over, still the caller's.
        blocks: Vec<BlockId>,
    },
    /// The blocks were handed over already (`send` or `allocate` called twice).
    #[error("request {0}: blocks were already handed over")]
    AlreadyHandedOver(RequestId),
    /// A payload beside the KV larger than the wire carries.
    #[error("aux payload of {len} bytes is over the limit of {max}")]
    AuxTooLarge {
        /// Its length.
        len: usize,
        /// [`handoff_transport::wire::AUX_BYTES_MAX`].
        max: usize,
    },
    /// A block id outside this runtime's registered region.
    #[error(transparent)]
    Region(#[from] RegionError),
}
