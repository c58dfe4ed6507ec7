//! `handoff-sim`: a deterministic simulated P/D cluster.
//!
//! It will run the real request actors and state machines of many prefill and decode
//! workers on one current-thread tokio runtime in virtual time, over a simulated network
//! and data transport, with faults drawn from one seed and invariants checked throughout.
