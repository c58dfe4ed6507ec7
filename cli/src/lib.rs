//! `handoff-cli`: what the `handoff` binary runs (see `handoff --help`).
//!
//! # Layout
//! - [`demo`]: the in-process demo behind `handoff demo`.
//! - [`bench`](mod@bench): the data-plane benchmark behind `handoff bench`.
//! - [`lifecycle`]: the full-lifecycle latency measurement in `handoff bench`.
//! - [`worker`]: `handoff worker`, one worker process on the network transport.
//! - [`bootstrap`]: `handoff bootstrap [status]`, the bootstrap server and its status.

pub mod bench;
pub mod bootstrap;
pub mod demo;
pub mod lifecycle;
pub mod worker;
