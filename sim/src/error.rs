//! The simulator's errors: things that stop a simulation from running at all. A run that
//! runs and breaks an invariant is not an error; it is a [`crate::Report`] with violations.

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The configuration cannot be built (the message says what to change).
    #[error("invalid simulation: {0}")]
    Config(String),
    /// A runtime could not be built or started.
    #[error("runtime: {0}")]
    Runtime(#[from] handoff_actors::Error),
    /// A worker's region could not be allocated.
    #[error("region: {0}")]
    Region(#[from] handoff_transport::RegionError),
    /// The tokio runtime could not be built.
    #[error("tokio runtime: {0}")]
    Io(#[from] std::io::Error),
}
