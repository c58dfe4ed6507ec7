//! `handoff sim` without the facade: `cargo run -p handoff-sim --example sim -- --seeds 0..100`.

use clap::Parser;

/// The simulator's command line.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    sim: handoff_sim::cli::SimArgs,
}

fn main() -> std::process::ExitCode {
    handoff_sim::cli::run(Cli::parse().sim)
}
