//! `handoff`: KV-cache handoff for disaggregated LLM serving, that never hangs, leaks
//! blocks or crashes.
//!
//! This facade only re-exports what an engine embeds; it builds neither the simulator nor
//! the command line (those are `handoff-sim` and the `handoff` binary, `handoff-cli`).
//!
//! # Layout
//! - [`actors`]: request lifecycle machines, request actors, the engine API ([`Runtime`]).
//! - [`net`]: the network transport: control channels, heartbeats, data planes.
//! - [`bootstrap`]: the bootstrap server, its client, secure-by-default exposure.
//! - [`transport`]: shared vocabulary, wire protocol, data-plane transports.
//! - [`gpu`]: CUDA probing, KV-cache layouts, buffers.

pub use handoff_actors as actors;
pub use handoff_actors::{Event, Runtime, State};
pub use handoff_bootstrap as bootstrap;
pub use handoff_gpu as gpu;
pub use handoff_net as net;
pub use handoff_transport as transport;
