//! The scale benchmark: growing fault-free clusters, wall time and simulated requests/s.
//!
//! `cargo run --release -p handoff-sim --example scale [-- REQUESTS_CAP]`

fn main() {
    let cap = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(u64::MAX);
    handoff_sim::cli::scale(&handoff_sim::cli::SCALE_STEPS, cap);
}
