//! The scale benchmark: growing fault-free clusters, wall time and simulated requests/s.
//!
//! `cargo run --release -p handoff-sim --example scale [-- REQUESTS_CAP [STEP]]`: every
//! step, or only step STEP (0-based, for profiling one), each capped at REQUESTS_CAP.

#[path = "shared/alloc.rs"]
mod alloc;

/// The simulation allocates heavily (messages, actors, tasks per request); mimalloc ran
/// the 1,000-worker steps about 1.5x faster than the system allocator here, with the same
/// trace hashes (the allocator does not touch determinism).
#[global_allocator]
static ALLOC: alloc::Mimalloc = alloc::Mimalloc;

fn main() {
    if !alloc::keep_freed_memory() {
        eprintln!("scale: mimalloc's purge delay is not where this build expects it; left as is");
    }
    let mut args = std::env::args().skip(1);
    let cap = args.next().and_then(|s| s.parse().ok()).unwrap_or(u64::MAX);
    let steps = &handoff_sim::cli::SCALE_STEPS;
    match args.next().and_then(|s| s.parse::<usize>().ok()) {
        Some(step) if step < steps.len() => handoff_sim::cli::scale(&steps[step..=step], cap),
        Some(step) => eprintln!("scale: no step {step} (0..{})", steps.len()),
        None => handoff_sim::cli::scale(steps, cap),
    }
}
