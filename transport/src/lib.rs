//! `handoff-transport`: everything that crosses a process boundary.
//!
//! It defines the shared vocabulary (request ids, ranks, blocks, failure reasons), the
//! versioned wire protocol for control messages, the ZeroMQ control channels, and the data
//! transports that move KV blocks: UCX (libucp loaded at run time), TCP, and in-process.
//! Nothing here knows about request lifecycles; the `handoff-actors` crate drives these
//! pieces.
//!
//! # Layout
//! - [`types`]: identities, ranks, blocks, [`types::FailureReason`].
//! - [`layout`]: KV memory as engines hold it: ranges, layers, block → segments.
//! - [`region`]: block-addressed memory over a layout ([`region::Region`]), host or CUDA,
//!   bounds-checked copies between layouts, layer pairing ([`region::BlockSlice`]).
//! - [`wire`]: frames, control messages, limits and wire errors.
//! - [`codec`]: the one place that touches bincode (payload bytes to messages and back).
//! - [`auth`]: the shared key: HMAC-SHA256 frame trailers, the Noise pre-shared key.
//! - [`noise`]: Noise sessions (fresh keys per connection, sequence-bound frames).
//! - [`zmtp`]: ZeroMQ's wire protocol (ZMTP 3.1), bounded: ROUTER and DEALER sockets.
//! - [`ucx`]: our bindings to libucp (loaded at run time) and the batched RMA transfer.
//! - [`data`]: the data plane's shared vocabulary ([`data::Grants`], [`data::GrantTable`], [`data::DataError`]),
//!   transfer planning, and the UCX data plane ([`data::UcxDataPlane`]).
//! - [`tcp`]: the TCP data transport ([`tcp::DataServer`], [`tcp::DataClient`]).
//! - [`tp`]: heterogeneous tensor parallelism as arithmetic: which heads a rank holds,
//!   which prefill rank a decode rank reads each from, where a run of heads lies in a block.
//! - [`exposition`]: the HTTP endpoint serving Prometheus metrics ([`exposition::serve_metrics`]).

mod admission;
pub mod auth;
pub mod codec;
pub mod data;
pub mod exposition;
pub mod layout;
pub mod lease;
pub mod noise;
pub mod priority;
pub mod region;
pub mod same_host;
pub mod tcp;
pub mod tp;
pub mod types;
pub mod ucx;
pub mod wire;
pub mod zmtp;

pub use layout::{
    pair_segments, KvHeads, KvLayout, KvMemory, KvRange, KvShape, LayerSpan, LayoutError, PairSide,
    Segment, LAYERS_MAX, LAYOUT_BYTES_MAX, RANGES_MAX,
};
pub use region::{BlockSlice, PairingError, Region, RegionError};
pub use types::{BlockId, EngineId, FailureReason, Rank, RankInfo, RequestId, Role, TransferMode};

/// The version of the wire protocol this build speaks. A peer on another version is
/// refused at connect time with an error that names both versions.
pub const PROTOCOL_VERSION: u16 = 7;
