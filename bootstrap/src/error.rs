//! [`BootstrapError`]: everything the bootstrap server, its client and the CLI report.

use handoff_transport::wire::{WireError, WorkerRecord};
use handoff_transport::{EngineId, FailureReason, Rank, RankInfo};

/// What can go wrong serving, registering with or querying a bootstrap server.
///
/// Expected conditions (the server is down, an engine is not complete yet, a registration
/// conflicts) are their own variants, each naming the bootstrap address, so a worker that
/// fails to start or a request that fails says which server and why (seed 001: failures
/// that were only logged, or swallowed, left requests hanging).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BootstrapError {
    /// The server could not be reached, or every attempt failed (refused, timed out,
    /// disconnected), until the deadline ran out.
    #[error("bootstrap server {address} unavailable: {last_error}")]
    Unavailable {
        /// The bootstrap server's address.
        address: String,
        /// The last error seen (or why no attempt could be made).
        last_error: String,
    },
    /// The server answered, but the engine still lacked ranks when the deadline ran out.
    #[error(
        "bootstrap server {address}: engine {engine} not ready: {} of {expected} ranks registered",
        registered.len()
    )]
    NotReady {
        /// The bootstrap server's address.
        address: String,
        /// The engine asked about.
        engine: EngineId,
        /// The ranks registered at the last answer.
        registered: Vec<Rank>,
        /// How many ranks the engine has (dp × tp × pp).
        expected: u32,
    },
    /// The server answered, but no worker of the engine had registered when the deadline ran
    /// out.
    #[error("bootstrap server {address}: engine {engine} unknown (no worker registered)")]
    UnknownEngine {
        /// The bootstrap server's address.
        address: String,
        /// The engine asked about.
        engine: EngineId,
    },
    /// The server still holds the record of a worker this client lost (dead, its record not
    /// expired yet) and no newer incarnation of that rank has registered: what it held is
    /// gone with it, so the lookup fails at once instead of handing the dead worker out.
    #[error("bootstrap server {address}: {rank} (incarnation {incarnation}) was lost and has not registered again")]
    Lost {
        /// The bootstrap server's address.
        address: String,
        /// The lost worker.
        rank: RankInfo,
        /// Its lost incarnation.
        incarnation: u64,
    },
    /// The server holds a record that contradicts ours (same rank and incarnation with other
    /// addresses, an older incarnation, other engine sizes or role, or an engine that has all
    /// its ranks already). Never retried: the worker must not start with it.
    #[error(
        "bootstrap server {address} refused the registration: it holds {} (incarnation {}, control {}, data {})",
        existing.rank, existing.incarnation, existing.control_address, existing.data_address
    )]
    Conflict {
        /// The bootstrap server's address.
        address: String,
        /// The record the server holds, and keeps.
        existing: Box<WorkerRecord>,
    },
    /// The server refused the request with a protocol error (wrong shared key, a full
    /// registry, a frame it could not read). Not retried: the same request would be refused
    /// again.
    #[error("bootstrap server {address} refused the request: {detail}")]
    Refused {
        /// The bootstrap server's address.
        address: String,
        /// What the server said.
        detail: String,
    },
    /// The server's answer could not be read (bad frame, wrong key, an answer to another
    /// question). Not retried.
    #[error("bootstrap server {address} sent a bad answer: {detail}")]
    BadReply {
        /// The bootstrap server's address.
        address: String,
        /// What was wrong with it.
        detail: String,
    },
    /// Our own input is unusable: a malformed address, a record that breaks a wire limit, a
    /// secret file that cannot be read. Nothing was sent.
    #[error("invalid bootstrap input: {detail}")]
    Invalid {
        /// What is wrong and what to change.
        detail: String,
    },
    /// The server could not start listening.
    #[error("bootstrap server cannot listen on {address}: {detail}")]
    Bind {
        /// The address asked for.
        address: String,
        /// What the OS or the address parser said.
        detail: String,
    },
    /// The server's actor could not be started, or has stopped.
    #[error("bootstrap server actor: {detail}")]
    Actor {
        /// What ractor said.
        detail: String,
    },
    /// A non-loopback listen address without a shared secret or `insecure`.
    #[error(transparent)]
    Exposed(#[from] crate::exposure::Exposed),
}

impl BootstrapError {
    /// The reason to fail a request that needed this bootstrap answer.
    ///
    /// Everything that involves a server becomes [`FailureReason::BootstrapUnavailable`]
    /// with the address and this error's text; input and actor errors are ours, so
    /// [`FailureReason::Internal`].
    pub fn failure_reason(&self) -> FailureReason {
        let unavailable = |address: &str, last_error: String| {
            handoff_transport::wire::bounded_reason(FailureReason::BootstrapUnavailable {
                address: address.to_string(),
                last_error,
            })
        };
        match self {
            BootstrapError::Unavailable {
                address,
                last_error,
            } => unavailable(address, last_error.clone()),
            BootstrapError::Lost { rank, .. } => FailureReason::PeerLost {
                peer: rank.to_string(),
            },
            BootstrapError::NotReady { address, .. }
            | BootstrapError::UnknownEngine { address, .. }
            | BootstrapError::Conflict { address, .. }
            | BootstrapError::Refused { address, .. }
            | BootstrapError::BadReply { address, .. }
            | BootstrapError::Bind { address, .. } => unavailable(address, self.to_string()),
            BootstrapError::Invalid { .. }
            | BootstrapError::Actor { .. }
            | BootstrapError::Exposed(_) => {
                handoff_transport::wire::bounded_reason(FailureReason::Internal {
                    detail: self.to_string(),
                })
            }
        }
    }

    /// An [`BootstrapError::Invalid`] for one of our messages that breaks a wire limit.
    pub(crate) fn invalid_message(what: &str, e: WireError) -> BootstrapError {
        BootstrapError::Invalid {
            detail: format!("{what}: {e}"),
        }
    }
}
