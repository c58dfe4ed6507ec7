//! The scale benchmark: growing fault-free clusters, wall time and simulated requests/s.
//!
//! `cargo run --release -p handoff-sim --example scale [-- REQUESTS_CAP]`

/// The simulation allocates heavily (messages, actors, tasks per request); mimalloc ran
/// the 1,000-worker steps about 1.5x faster than the system allocator here, with the same
/// trace hashes (the allocator does not touch determinism).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let cap = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(u64::MAX);
    handoff_sim::cli::scale(&handoff_sim::cli::SCALE_STEPS, cap);
}
