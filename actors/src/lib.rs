//! `handoff-actors`: the request lifecycle, its actors, and the API an engine embeds.
//!
//! Each request is a state machine ([`machine`]) driven by its own actor, supervised by the
//! runtime's root actor. The engine talks to a [`Runtime`]: it opens senders (prefill) and
//! receivers (decode), hands blocks over, polls or awaits them, and drains [`Event`]s once
//! per step.
//!
//! # Layout
//! - [`machine`]: sans-IO sender and receiver machines, [`machine::State`], [`machine::merge`].
//! - [`runtime`]: the root actor (supervision policy in its docs), [`Runtime`] and the handles.
//! - [`router`]: the root actor's rules as plain data (routing, buffering, tombstones,
//!   admission, what a dead request actor leaves behind).
//! - `request`: the request actor that drives one machine.
//! - `estate`: what a request owns (state, blocks, peers), one owner at a time: its actor
//!   while it runs, the root after; blocks in transit travel as consignments.
//! - [`event`]: lifecycle events and their bounded queue.
//! - [`metrics`]: Prometheus metrics of the runtime and the bootstrap server, and their
//!   HTTP endpoint.
//! - [`link`]: what the runtime needs from a transport; [`inproc`]: the in-process one.
//! - [`config`]: configuration and named limits; [`Error`]: the API's errors.
//!
//! The network transport (`handoff-net`) and the bootstrap service (`handoff-bootstrap`)
//! are crates of their own, built on this one's [`link`].

pub mod config;
mod error;
mod estate;
pub mod event;
pub mod inproc;
pub mod link;
pub mod machine;
mod mailbox;
pub mod metrics;
mod request;
pub mod router;
pub mod runtime;
mod tombstones;

pub use config::{RuntimeConfig, TransportChoice};
pub use error::Error;
pub use event::{Doorbell, Doorbells, Event, FenceEnd, ReleaseReason};
pub use handoff_transport::{
    BlockId, BlockSlice, EngineId, FailureReason, KvLayout, KvMemory, KvRange, KvShape, LayerSpan,
    PairSide, PairingError, RankInfo, Region, RegionError, RequestId, Role, TransferMode,
};
pub use inproc::Fabric;
pub use link::{Attach, Inbox, Link};
pub use machine::{merge, merge_all, State, Timeouts};
pub use metrics::Metrics;
pub use runtime::{ReceiverHandle, ReceiverSpec, Runtime, RuntimeBuilder, SenderHandle};
