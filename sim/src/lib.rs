//! `handoff-sim`: a deterministic simulated P/D cluster.
//!
//! It runs the *real* runtimes of the actors crate (root actors, request actors, sans-IO
//! machines, estates) for many prefill and decode workers, each a rank of a TP × PP (× DP)
//! engine, on one current-thread tokio runtime in paused time, over a simulated network,
//! bootstrap server and data transport that move real bytes between [`Region`]s.
//! Every fault is drawn from one seed, printed at the start; the same seed gives the same
//! trace, bit for bit, and a failing run prints `replay: HANDOFF_SIM_SEED=<n>`.
//!
//! A run has two phases, as in TigerBeetle's VOPR: a **safety** phase with faults on, then,
//! once every request has settled, a **liveness** phase with faults off (partitions
//! healed, crashed workers restarted, bootstrap up) in which every request must succeed.
//!
//! # Invariants
//! Checked while the run goes and at its end; the first violation stops the run.
//! - **no hang**: every rank of every request ends `Done`/`Failed` within
//!   `Timeouts::lifetime_max()` of opening, plus [`HANG_SLACK_MS`].
//! - **no leak**: every block handed to a runtime appears in exactly one `Released` event
//!   of its request on that runtime; a stopped runtime has released everything; at
//!   quiescence every worker's pool is entirely free.
//! - **no crash**: no panic anywhere but the injected ones (a panic hook records them).
//! - **integrity**: a decode rank that ends `Done` holds exactly the bytes prefill wrote
//!   (checked by checksum when its blocks are released to the engine), and no data transfer
//!   lands in blocks their engine has taken back. Prefill pipeline ranks each hold only
//!   their slice of every block (`block_bytes / pp`), so with PP > 1 this also checks that
//!   every rank's slice landed in its place.
//! - **agreement**: a decode rank's `Done` is backed by its prefill ranks (push: each ended
//!   `Done`; pull: each opened the request). The converse cannot be required: a final
//!   message can be lost, so prefill `Done` with decode `Failed`, and ranks of one side
//!   split between `Done` and `Failed`, are possible and are counted as `split`.
//! - **liveness**: with faults off, every request ends `Done` on every rank.
//! - **api**: states only move forward; engine calls the docs promise to succeed do.
//!
//! # Layout
//! - [`config`]: the cluster's shape, workload, timing, fault kinds and rates, scripts.
//! - [`net`]: the simulated network, bootstrap server and data transport (`Attach`/`Link`).
//! - `world`: workers, engines, the workload, cluster faults, checks, the main loop.
//! - [`pool`]: a worker's block allocator with owners (catches use after release).
//! - [`live`]: the live requests by index, a window rather than a tree.
//! - [`sim`]: [`simulate`], one run on its own paused-time runtime.
//! - [`report`]: outcomes, latencies, invariant verdicts, the trace hash.
//! - [`trace`]: FNV-1a 64 and the trace; [`rng`]: the seeded generator.
//! - [`cli`]: the `handoff sim` subcommand ([`cli::SimArgs`], [`cli::run`]) and the scale bench.
//! - `panic`: the panic hook that tells injected panics from real ones.
//!
//! [`Region`]: handoff_transport::Region

pub mod agenda;
pub mod chart;
pub mod cli;
pub mod config;
mod error;
pub mod live;
pub mod net;
mod panic;
pub mod pool;
pub mod report;
pub mod rng;
pub mod sim;
pub mod trace;
mod world;

pub use config::{
    FaultKind, FaultPlan, Faults, LayoutChoice, MessageKind, ModeChoice, Scripted, Shape,
    SimConfig, Target, Timing, Workload,
};
pub use error::SimError;
pub use report::{Invariant, Report, Violation};
pub use sim::simulate;
pub use world::{DRAIN_STEP_MS, HANG_SLACK_MS};
