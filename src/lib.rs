//! `handoff`: KV-cache handoff for disaggregated LLM serving, that never hangs, leaks
//! blocks or crashes.
//!
//! This facade re-exports the workspace's crates and holds what the `handoff` binary runs.
//!
//! # Layout
//! - [`actors`]: request lifecycle machines, request actors, the engine API ([`Runtime`]).
//! - [`transport`]: shared vocabulary, wire protocol, transports.
//! - [`gpu`]: CUDA probing, KV-cache layouts, buffers.
//! - [`sim`]: the deterministic simulated cluster.
//! - [`demo`]: the in-process demo behind `handoff demo`.
//! - [`bench`]: the data-plane benchmark behind `handoff bench`.
//! - [`lifecycle`]: the full-lifecycle latency measurement in `handoff bench`.
//! - [`worker`]: `handoff worker`, one worker process on the network transport.

pub mod bench;
pub mod demo;
pub mod lifecycle;
pub mod worker;

pub use handoff_actors as actors;
pub use handoff_actors::{Event, Runtime, State};
pub use handoff_gpu as gpu;
pub use handoff_sim as sim;
pub use handoff_transport as transport;
