//! What a runtime needs from a transport, as one trait.
//!
//! The request actors call it; the in-process [`crate::inproc::Fabric`] implements it today,
//! and the ZeroMQ control plane with UCX/TCP data planes implements it next. Every method
//! returns at once or with a future that the caller bounds with a deadline; none blocks.

use std::future::Future;
use std::pin::Pin;

use handoff_transport::{BlockId, EngineId, FailureReason, RankInfo, RequestId};

use crate::machine::{Outbound, Peer};

/// The outcome of a data transfer: `Err` carries what the data plane said.
pub type TransferFuture = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// The outcome of a bootstrap lookup.
pub type ResolveFuture = Pin<Box<dyn Future<Output = Result<Vec<Peer>, ResolveError>> + Send>>;

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
    fn send(&self, to: &Peer, id: &RequestId, msg: Outbound) -> Result<(), LinkError>;

    /// The other ranks of this runtime's engine that serve the same requests (same dp
    /// rank): a failure here is told to them (seed 003).
    fn siblings(&self) -> Vec<Peer>;

    /// The prefill ranks a decode rank receives from for a request served by `prefill`
    /// (at `dp_rank`, or the lowest registered dp rank).
    fn resolve(&self, prefill: &EngineId, dp_rank: Option<u32>) -> ResolveFuture;

    /// Writes local `src` blocks into `to`'s `dst` blocks.
    fn write(&self, to: &Peer, src: Vec<BlockId>, dst: Vec<BlockId>) -> TransferFuture;

    /// Reads `from`'s `src` blocks into local `dst` blocks.
    fn read(&self, from: &Peer, src: Vec<BlockId>, dst: Vec<BlockId>) -> TransferFuture;

    /// Leaves the transport: peers see this runtime as gone from now on.
    fn detach(&self);
}
