//! UCX data plane: our own bindings to `libucp`, loaded at run time.
//!
//! Building needs no UCX, headers, bindgen or clang: [`sys`] hand-writes the C types and
//! resolves every function with `libloading` when first used. A machine without libucp
//! gets [`UcxError::LibraryNotFound`] naming every path tried, never a link error.
//!
//! The order of use is: a [`Context`] (one per process), a [`Worker`] on it (one per
//! thread that moves data), [`Worker::address`] sent to peers over the control plane,
//! [`Worker::connect`] to a peer's address for an [`Endpoint`]; [`MemoryRegion`]s
//! registered or allocated on the context, their [`MemoryRegion::pack_rkey`] bytes sent to
//! peers, which turn them into [`RemoteKey`]s with [`Endpoint::unpack_rkey`]. Then
//! [`Endpoint::put`], [`Endpoint::get`] or the batched [`Endpoint::transfer`] (one region
//! and key) and [`Endpoint::transfer_ranges`] (segments across several regions and keys:
//! a KV layout registers each of its ranges on its own), and [`Endpoint::flush`].
//!
//! Every wait progresses the worker until the operation is done or its deadline passes
//! ([`UcxError::Timeout`]). An endpoint whose peer dies, or whose operation times out, is
//! force-closed at once: UCX cancels what it still had in flight, so no operation can touch
//! our memory after the call that reported the error returned.
//!
//! Threads: UCX runs in single-thread mode, so every handle here is `!Send` and `!Sync`
//! (they share `Rc`s): create them on the thread that will drive them. The handles keep
//! what they need alive (an endpoint keeps its worker, a worker its context, a remote key
//! its endpoint), so any drop order is safe.
//!
//! # ABI notes (checked against UCX 1.13.1 and 1.22.0)
//! - `ucs_status_t` is a *packed* enum: one byte (`i8`), in returns and callback arguments.
//! - Parameter structs are the 1.13 layouts (1.22's `ucp_params_t`, `ucp_mem_map_params_t`
//!   and `ucp_request_param_t` are longer); only 1.13 `field_mask` bits are ever set.
//! - `ucp_init` and `UCS_PTR_IS_ERR`/`UCS_PTR_STATUS` are header inlines/macros:
//!   `ucp_init_version` and [`sys::ptr_is_err`] stand in for them.
//! - `ucp_worker_get_address` and `ucp_rkey_pack` moved to `ucp_compat.h` (deprecated) by
//!   1.22 but are still exported.
//! - With `UCP_ERR_HANDLING_MODE_PEER`, UCX drops the posix/sysv shared-memory transports
//!   unless `MM_ERROR_HANDLING=y`; [`ContextOptions`] sets it by default.
//! - A libucp loaded from a directory has its libucm/libucs/libuct loaded from the same
//!   directory first, so the system loader cannot pair it with another version's libucs.
//!
//! # Layout
//! - [`sys`]: raw types, constants, the function table ([`sys::api`], [`sys::load_from`]).
//! - `context`: [`Context`], [`ContextOptions`], [`Version`].
//! - `worker`: [`Worker`], [`Endpoint`], [`RemoteKey`], request waiting.
//! - `memory`: [`MemoryRegion`], [`MemoryType`].
//! - `batch`: [`Segment`], [`RangeSegment`], [`Direction`], [`coalesce`], the batched
//!   transfers.

#![warn(missing_docs)]

mod batch;
mod context;
mod maps;
mod memory;
pub(crate) mod rkey;
pub mod sys;
mod worker;

use std::time::Duration;

pub use batch::{coalesce, Direction, RangeCoalescer, RangeSegment, Segment, TransferStats};
pub use context::{Context, ContextOptions, Version, KEEPALIVE_INTERVAL_DEFAULT};
pub use memory::{MemoryRegion, MemoryType};
pub use worker::{Endpoint, RemoteKey, Worker};

/// Most RMA operations one batched transfer keeps posted before it waits for some to
/// complete. 128 × 16 KiB blocks keep 2 MiB in flight, enough to saturate shared memory and
/// a 200 Gb/s NIC in our runs, while bounding the requests UCX must hold for us.
pub const OPS_INFLIGHT_MAX: usize = 128;

/// Most segments one batched transfer accepts. A request's KV cache is at most a few
/// thousand blocks per layer group; this bounds the coalescing buffer a bad caller can make
/// us allocate (one million segments is 24 MiB).
pub const SEGMENTS_PER_BATCH_MAX: usize = 1 << 20;

/// How long dropping an endpoint waits for UCX to close it. A graceful close to a live peer
/// takes microseconds; a dead peer must not hold a drop for long, and after this the
/// worker's destruction releases whatever is left.
pub const ENDPOINT_CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

/// Largest worker address accepted from a peer. Addresses are a few hundred bytes (one
/// entry per transport and device); 64 KiB leaves room for many NICs and still bounds what
/// a malformed control message can make UCX parse.
pub const WORKER_ADDRESS_BYTES_MAX: usize = 64 * 1024;

/// Largest packed remote key accepted from a peer; a key holds one entry per memory domain,
/// tens to hundreds of bytes each. Same reasoning as [`WORKER_ADDRESS_BYTES_MAX`].
pub const RKEY_BYTES_MAX: usize = 64 * 1024;

/// The one error type of the UCX layer. Wrapped by the transport crate's error with `#[from]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UcxError {
    /// libucp (or its libucs) could not be loaded; `tried` lists every path or soname.
    #[error("UCX library not found (tried {tried:?}): {detail}")]
    LibraryNotFound {
        /// Paths and sonames tried, in order.
        tried: Vec<String>,
        /// The loader's message for the last failure.
        detail: String,
    },
    /// The library lacks a function we need (too old, or not libucp).
    #[error("UCX symbol `{name}` missing from the loaded library")]
    SymbolMissing {
        /// The C symbol name.
        name: &'static str,
    },
    /// The library is older than [`sys::VERSION_MIN`].
    #[error("UCX {found} is too old: need {min} or newer")]
    VersionTooOld {
        /// The version `ucp_get_version` reported.
        found: String,
        /// The oldest version accepted.
        min: String,
    },
    /// The library's major version is not 1; its ABI is unknown to these bindings.
    #[error("UCX {found} is not supported: only 1.x has the ABI these bindings describe")]
    VersionUnsupported {
        /// The version `ucp_get_version` reported.
        found: String,
    },
    /// A UCX call returned an error status.
    #[error("UCX {op} failed: {message} (status {code})")]
    Status {
        /// The UCX function (or our operation) that failed.
        op: &'static str,
        /// The `ucs_status_t` value.
        code: i32,
        /// `ucs_status_string` for `code`.
        message: String,
    },
    /// An operation did not complete before its deadline. When it was an endpoint's, the
    /// endpoint has been force-closed.
    #[error("UCX {op} timed out after {after:?}")]
    Timeout {
        /// The operation that was waited for.
        op: &'static str,
        /// How long we waited.
        after: Duration,
    },
    /// UCX reported the endpoint's peer failed (dead process, lost link). The endpoint has
    /// been force-closed; make a new one to talk to a restarted peer.
    #[error("UCX endpoint failed: {message} (status {code})")]
    EndpointFailed {
        /// The `ucs_status_t` the error handler got.
        code: i32,
        /// `ucs_status_string` for `code`.
        message: String,
    },
    /// The endpoint was force-closed by an earlier failure or timeout; `reason` is that error.
    #[error("UCX endpoint closed after an earlier error: {reason}")]
    EndpointClosed {
        /// The error that closed the endpoint.
        reason: Box<UcxError>,
    },
    /// The endpoint was closed with [`Endpoint::close`] (seen as the `reason` of
    /// [`UcxError::EndpointClosed`] by remote keys that outlived it).
    #[error("UCX endpoint closed by its owner")]
    ClosedByOwner,
    /// A range falls outside the local region or the remote key's region.
    #[error("{what} range [{offset}, +{len}) is outside [0, {limit})")]
    OutOfRange {
        /// Which side: "local region" or "remote region".
        what: &'static str,
        /// Start of the range (offset into the region).
        offset: u64,
        /// Length of the range in bytes.
        len: u64,
        /// Size of the region in bytes.
        limit: u64,
    },
    /// A peer's key does not open the range the peer advertised for it: on the shared-memory
    /// transports the range, seen through the key, is not inside the segment the key maps
    /// (a lie, or a stale or foreign key). Nothing was posted with it.
    #[error("remote key does not open [{base:#x}, +{len}): {detail}")]
    UnverifiedKey {
        /// The advertised start.
        base: u64,
        /// The advertised length.
        len: u64,
        /// What the check found.
        detail: String,
    },
    /// A peer's key that UCX must not be handed: cut short, a domain's bytes past its end,
    /// a memory type no one moves, or (UCX before 1.19) one whose unpacking killed, or was
    /// refused in, the child process that tried it first. Nothing was unpacked here.
    #[error("malformed remote key: {detail}")]
    MalformedKey {
        /// What is wrong with it.
        detail: String,
    },
    /// A peer's host keys (UCX before 1.19) whose vetting process neither answered nor
    /// died within its bound: nothing certain was learnt (a lock of UCX's memory hooks held
    /// at the fork stalls the child as a key could), so the keys are tried again at their
    /// next use, a bounded number of times, rather than refused. Nothing was unpacked here.
    #[error("remote keys not vetted: {detail}")]
    KeysUndecided {
        /// What the vetting saw.
        detail: String,
    },
    /// A writer's lease with the peer ended (or was revoked: the peer was lost) before
    /// every operation was posted: nothing more was, and the endpoint was force-closed.
    #[error("write lease with the peer {}, after {posted} operations were posted: the peer may have given our grant's blocks back", match .ago { Some(ago) => format!("ended {ago:?} ago"), None => "was revoked (the peer was lost)".to_string() })]
    LeaseExpired {
        /// Operations posted before the check failed.
        posted: usize,
        /// How long ago the lease ended; `None` when it was revoked.
        ago: Option<std::time::Duration>,
    },
    /// An argument is unusable: zero length, oversized peer bytes, NUL in a config string.
    #[error("invalid argument: {what}")]
    InvalidArgument {
        /// What was wrong.
        what: String,
    },
    /// More segments than [`SEGMENTS_PER_BATCH_MAX`] in one batch.
    #[error("{count} segments in one batch; at most {max}")]
    TooManySegments {
        /// Segments given.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// The memory region and the endpoint belong to different UCX contexts.
    #[error("memory region registered on another UCX context than the endpoint's worker")]
    ContextMismatch,
    /// Host-side access (read/write) asked of device memory.
    #[error("memory region is {found:?} memory, not host memory")]
    NotHostMemory {
        /// The region's memory type.
        found: MemoryType,
    },
}
