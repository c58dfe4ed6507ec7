//! The data plane's common vocabulary: what the TCP and UCX transports share.
//!
//! The runtime moves KV blocks with one of two transports, both built on the shapes here:
//! - [`crate::tcp`]: a framed TCP protocol with a server that serves one [`Region`]
//!   and checks every operation against the runtime's [`Grants`] before a byte moves.
//! - [`ucx`]: [`UcxDataPlane`], one-sided RDMA through UCX on a dedicated thread.
//!
//! A transfer is always between blocks of equal size: `src[i]` goes to `dst[i]`.
//! [`plan`] turns the two block lists into byte ranges, merges contiguous runs and cuts
//! them into operations of bounded size.
//!
//! # Protection model
//! - TCP: the receiving server checks, per operation, that the peer holds a grant for
//!   exactly those blocks ([`Grants::with_grant`]), and performs the copy inside that call
//!   so the runtime revokes a grant only when no copy into its blocks is in flight.
//! - UCX: a write is one-sided RDMA, so no code of the receiver runs per operation. The
//!   protection is, as in NIXL and Mooncake Transfer Engine, the remote key's scope (the
//!   peer can only reach the region it registered), our bounds check of every block against
//!   the peer's [`RegionDescriptor`] before anything is posted, and the control plane's
//!   grant (the receiver only hands out blocks it allocated for the request).
//!
//! # Layout
//! - this module: [`DataError`], [`Access`], [`Grants`], [`GrantError`], [`AllowAll`],
//!   [`RefusalCode`].
//! - [`grants`]: [`GrantTable`], a worker's grants by request (the runtime's [`Grants`]).
//! - [`plan`]: block lists to coalesced, size-bounded operations.
//! - [`ucx`]: [`UcxDataPlane`] and its descriptor [`UcxPeer`].
//!
//! [`Region`]: crate::region::Region
//! [`RegionDescriptor`]: crate::wire::RegionDescriptor

pub mod grants;
pub mod plan;
pub mod ucx;

use std::fmt;
use std::time::Duration;

use crate::region::RegionError;
use crate::types::{BlockId, RankInfo, RequestId};
use crate::ucx::UcxError;

pub use grants::GrantTable;
pub use ucx::{UcxDataPlane, UcxPeer, UcxPlaneOptions, UcxRange};

/// Most blocks one transfer call may list: the wire protocol's bound on the blocks of one
/// request ([`crate::wire::limits::BLOCKS_PER_MESSAGE_MAX`]), so that a call's plan (a few
/// dozen bytes per block) stays bounded.
pub const BLOCKS_PER_CALL_MAX: usize = crate::wire::limits::BLOCKS_PER_MESSAGE_MAX;

/// Most slices of every block one transfer call may move: as many as one block pair takes
/// between TP ranks at most ([`crate::tp::TP_SPANS_PER_BLOCK_MAX`]).
pub const SLICES_PER_CALL_MAX: usize = crate::tp::TP_SPANS_PER_BLOCK_MAX;

/// What a peer asks to do to a region's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Access {
    /// The peer writes the blocks (push: prefill writes into decode's blocks).
    Write,
    /// The peer reads the blocks (pull: decode reads prefill's blocks).
    Read,
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Access::Write => "write",
            Access::Read => "read",
        })
    }
}

/// The runtime's record of which peer may touch which blocks, for which request.
///
/// Called by a data server for every operation a peer asks for, once its blocks were
/// checked against the region, and again around each piece of its bytes that moves (the
/// TCP server: each receive of a write's bytes straight into the blocks, never a wait for
/// them, so a slow peer cannot hold a grant). The implementation checks that `peer` was
/// granted `access` to every block of `blocks` (a subset of the request's grant) for
/// `request`; if so it calls `f` exactly once, which moves the bytes, and returns `Ok`. The runtime revokes a grant (when the
/// request ends) under the same lock, so no copy into a revoked block can be in flight.
/// `Err(reason)` refuses the operation: the reason goes back to the peer, and the
/// connection and the server go on.
pub trait Grants: Send + Sync + 'static {
    /// Checks the grant and, if it holds, runs `f` (the copy) while it is held.
    fn with_grant(
        &self,
        peer: &RankInfo,
        request: &RequestId,
        access: Access,
        blocks: &[BlockId],
        f: &mut dyn FnMut(),
    ) -> Result<(), GrantError>;

    /// Checks the grant as [`Grants::with_grant`] does and, if it holds, says which grant
    /// it is. A read sent without holding the grant (straight from the blocks into a
    /// socket) is good when the same generation still holds after its last byte left: a
    /// revoked grant never holds again, and a grant made after a revocation is a new
    /// generation, so the grant held the whole time. The default (generation 0) suits
    /// tables that never grant a request again once revoked.
    fn generation(
        &self,
        peer: &RankInfo,
        request: &RequestId,
        access: Access,
        blocks: &[BlockId],
    ) -> Result<u64, GrantError> {
        self.with_grant(peer, request, access, blocks, &mut || {})
            .map(|()| 0)
    }
}

/// Why a peer's write or read was refused by the side whose memory it would touch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    /// This side granted nothing for the request (never, or it ended and was forgotten).
    #[error("no grant for request {request}")]
    NoGrant {
        /// The request.
        request: RequestId,
    },
    /// The request's grants were revoked (it ended here).
    #[error("grant for request {request} revoked")]
    Revoked {
        /// The request.
        request: RequestId,
    },
    /// The peer holds no grant of this kind for the request.
    #[error("request {request}: {peer} holds no {access} grant")]
    NotHeld {
        /// The request.
        request: RequestId,
        /// The peer that asked.
        peer: RankInfo,
        /// What it asked for.
        access: Access,
    },
    /// A block outside what the peer was granted.
    #[error("request {request}: block {block} not granted to {peer}")]
    Block {
        /// The request.
        request: RequestId,
        /// The first block not granted.
        block: BlockId,
        /// The peer that asked.
        peer: RankInfo,
    },
}

/// Grants everything to everyone: for benchmarks and tests of the transport alone, where
/// no runtime keeps grants. Never use it for a server reachable by untrusted peers.
#[derive(Clone, Copy, Debug, Default)]
pub struct AllowAll;

impl Grants for AllowAll {
    fn with_grant(
        &self,
        _peer: &RankInfo,
        _request: &RequestId,
        _access: Access,
        _blocks: &[BlockId],
        f: &mut dyn FnMut(),
    ) -> Result<(), GrantError> {
        f();
        Ok(())
    }
}

/// Why a data server refused an operation; travels to the peer in an error frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RefusalCode {
    /// The runtime holds no grant for these blocks, this peer, this request and access.
    NotGranted,
    /// A byte range lies outside the served region.
    OutOfRange,
    /// The frame was malformed (bad magic, version, op, lengths, metadata).
    Malformed,
    /// Authentication failed (missing or wrong HMAC tag).
    AuthFailed,
    /// The server is at its connection limit.
    Busy,
    /// A bug or resource failure on the server.
    Internal,
}

impl RefusalCode {
    /// The code's number on the wire.
    pub fn to_wire(self) -> u16 {
        match self {
            RefusalCode::NotGranted => 1,
            RefusalCode::OutOfRange => 2,
            RefusalCode::Malformed => 3,
            RefusalCode::AuthFailed => 4,
            RefusalCode::Busy => 5,
            RefusalCode::Internal => 6,
        }
    }

    /// The code for a number from the wire, if it is one.
    pub fn from_wire(code: u16) -> Option<RefusalCode> {
        Some(match code {
            1 => RefusalCode::NotGranted,
            2 => RefusalCode::OutOfRange,
            3 => RefusalCode::Malformed,
            4 => RefusalCode::AuthFailed,
            5 => RefusalCode::Busy,
            6 => RefusalCode::Internal,
            _ => return None,
        })
    }
}

impl fmt::Display for RefusalCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RefusalCode::NotGranted => "not granted",
            RefusalCode::OutOfRange => "out of range",
            RefusalCode::Malformed => "malformed frame",
            RefusalCode::AuthFailed => "authentication failed",
            RefusalCode::Busy => "busy",
            RefusalCode::Internal => "internal error",
        })
    }
}

/// Everything the data plane reports. Errors about a peer name it (`peer` is its address,
/// or `engine/rank` once known).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DataError {
    /// The data server could not listen on the address.
    #[error("cannot bind data server to {addr}: {detail}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// The operating system's reason.
        detail: String,
    },
    /// A connection to the peer could not be made (refused, unreachable, handshake failed).
    #[error("cannot connect to data peer {peer}: {detail}")]
    Connect {
        /// The peer.
        peer: String,
        /// What failed.
        detail: String,
    },
    /// An established connection failed (reset, broken pipe).
    #[error("data connection with {peer} failed: {detail}")]
    Io {
        /// The peer.
        peer: String,
        /// The operating system's reason.
        detail: String,
    },
    /// The peer closed the connection before an operation completed (e.g. it died).
    #[error("data peer {peer} closed the connection during {op}")]
    PeerClosed {
        /// The peer.
        peer: String,
        /// What we were doing.
        op: &'static str,
    },
    /// The call's deadline passed before it completed.
    #[error("data transfer with {peer} timed out after {after:?} during {op}")]
    Timeout {
        /// The peer.
        peer: String,
        /// What we were waiting for.
        op: &'static str,
        /// How long the call ran.
        after: Duration,
    },
    /// The peer sent bytes that break the protocol.
    #[error("protocol error from data peer {peer}: {detail}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// The peer refused an operation (no grant, out of range, ...).
    #[error("data peer {peer} refused the operation ({code}): {detail}")]
    Refused {
        /// The peer.
        peer: String,
        /// Why, as a code.
        code: RefusalCode,
        /// The peer's explanation.
        detail: String,
    },
    /// A frame failed authentication, or a side with a key got a bare frame.
    #[error("authentication with data peer {peer} failed: {detail}")]
    Auth {
        /// The peer.
        peer: String,
        /// What failed.
        detail: String,
    },
    /// A block (or block list) of the local region is unusable.
    #[error("local region: {0}")]
    Region(#[from] RegionError),
    /// A destination or source block lies outside the peer's region: refused before
    /// anything was sent.
    #[error("block {block} is outside data peer {peer}'s region of {blocks} blocks")]
    OutsidePeerRegion {
        /// The peer.
        peer: String,
        /// The first block outside.
        block: BlockId,
        /// Blocks in the peer's region.
        blocks: u64,
    },
    /// The two block lists, or the two regions' block sizes, do not match.
    #[error("mismatched transfer: {detail}")]
    Mismatch {
        /// What differed.
        detail: String,
    },
    /// A call exceeded one of the data plane's limits.
    #[error("{what}: {count} given, at most {max}")]
    TooLarge {
        /// Which limit.
        what: &'static str,
        /// The size given.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A write finished (on a one-sided plane every operation posted under the writer's
    /// lease; on TCP every operation answered by the peer's grant check), but its
    /// completion was seen only after the lease with the peer ended or was revoked: the
    /// peer may have taken us for lost and failed the request meanwhile, so the write is
    /// not reported done ([`crate::lease::Lease::confirm`]).
    #[error("write to {peer} completed only after our lease with it {}: the peer may have failed the request meanwhile", match .ago { Some(ago) => format!("ended {ago:?} earlier"), None => "was revoked (the peer was lost)".to_string() })]
    ConfirmedLate {
        /// The peer.
        peer: String,
        /// How long before the completion was seen the lease ended; `None` when revoked.
        ago: Option<Duration>,
    },
    /// A UCX call failed.
    #[error("UCX: {0}")]
    Ucx(#[from] UcxError),
    /// A same-host copy ([`crate::same_host`]) with a data peer failed.
    #[error("data peer {peer}: same-host copy: {error}")]
    SameHost {
        /// The peer.
        peer: String,
        /// What failed.
        error: crate::same_host::SameHostError,
    },
    /// A CUDA driver call failed, or there is no usable GPU (e.g. binding a device's context
    /// to the UCX thread).
    #[error("GPU: {0}")]
    Gpu(#[from] handoff_gpu::GpuError),
    /// The UCX data plane's thread has stopped (it can no longer serve calls).
    #[error("UCX data plane thread stopped: {detail}")]
    PlaneStopped {
        /// Why, if known.
        detail: String,
    },
    /// Something this build or configuration does not support yet.
    #[error("unsupported: {what}")]
    Unsupported {
        /// What was asked for.
        what: String,
    },
    /// The call needs a tokio runtime and none is running on this thread.
    #[error("no tokio runtime: {detail}")]
    NoRuntime {
        /// The runtime's message.
        detail: String,
    },
}
