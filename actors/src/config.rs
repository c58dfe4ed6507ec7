//! How a runtime is configured: who it is, its deadlines, its limits, its transport.

use std::sync::Arc;

use handoff_transport::{RankInfo, Region, Role, TransferMode};

use crate::inproc::Fabric;
use crate::link::Attach;
use crate::machine::Timeouts;

/// Default bound on requests a runtime holds at once: live requests plus finished ones whose
/// final event the engine has not drained yet. Past it, `sender`/`receiver` return
/// [`crate::Error::TooManyRequests`] instead of queueing without bound. 65 536 is far above
/// one worker's concurrent requests (vLLM's default `max_num_seqs` is 256) and keeps the
/// event queue's worst case to a few MB.
pub const REQUESTS_OPEN_MAX_DEFAULT: usize = 65_536;

/// Bound on requests for which messages arrived before the engine created them (prefill and
/// decode start a request concurrently, so decode's transfer info can come first). Past it,
/// the newest such message is answered with an abort rather than buffered.
pub const PENDING_REQUESTS_MAX: usize = 4_096;

/// Bound on messages buffered per not-yet-created request: transfer info, a duplicate, an
/// abort from a sibling rank, with room to spare.
pub const PENDING_MESSAGES_PER_REQUEST_MAX: usize = 8;

/// Bound on the bytes of messages buffered for requests not created yet, all together:
/// what a peer's messages for ids the engine never opens can hold (a transfer info may name
/// a million blocks, 4 MiB, so the count bounds alone would allow 4 096 × 8 of them). Past
/// it, a message for a new id is answered with an abort and one for a buffered id dropped,
/// as at the count bounds. 32 MiB holds eight such messages, or 4 096 requests' transfer
/// infos of 1 000 blocks each.
pub const PENDING_BYTES_MAX: usize = 32 << 20;

/// How many ended requests a runtime remembers, so that a late message for one of them gets
/// an answer (an abort) instead of being buffered as if the request were still to come.
pub const TOMBSTONES_MAX: usize = 16_384;

const _: () = assert!(PENDING_REQUESTS_MAX <= REQUESTS_OPEN_MAX_DEFAULT);
const _: () = assert!(PENDING_MESSAGES_PER_REQUEST_MAX >= 2);

/// Which transport a runtime uses to reach its peers.
#[derive(Clone)]
pub enum TransportChoice {
    /// Prefill and decode runtimes in one process, attached to the same [`Fabric`]:
    /// control messages are actor messages, data moves by `memcpy` between host regions.
    InProcess(Arc<Fabric>),
    /// Any other transport: the simulator's network, or one an embedder writes.
    Custom(Arc<dyn Attach>),
}

impl std::fmt::Debug for TransportChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TransportChoice::InProcess(_) => f.write_str("InProcess"),
            TransportChoice::Custom(_) => f.write_str("Custom"),
        }
    }
}

/// Everything a [`crate::Runtime`] is built from. Made by [`crate::RuntimeBuilder`].
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    /// Prefill or decode.
    pub role: Role,
    /// This worker's engine and ranks.
    pub rank: RankInfo,
    /// Deadlines of every lifecycle state.
    pub timeouts: Timeouts,
    /// Decode only: whether prefill pushes or decode pulls.
    pub mode: TransferMode,
    /// Bound on open requests (see [`REQUESTS_OPEN_MAX_DEFAULT`]).
    pub requests_open_max: usize,
    /// Decode admission control: requests waiting for blocks past which new ones are
    /// rejected as busy (`None`: no limit).
    pub unallocated_max: Option<usize>,
    /// The transport.
    pub transport: TransportChoice,
    /// The KV memory this worker registers with its transport.
    pub region: Arc<Region>,
}
