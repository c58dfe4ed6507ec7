//! A simulated cluster from the library: the same runs `handoff sim` makes, driven from code.
//!
//! Runs a few seeds with a swarm of faults (each seed draws its own mix), prints each run's
//! report (outcomes by reason, latency in virtual time, invariant verdicts, trace hash), and
//! runs the first seed twice to show that a seed replays bit for bit.
//! Run with `cargo run --release --example simulate`.

use handoff_sim::{simulate, FaultPlan, Faults, SimConfig};

fn run(seed: u64) -> Result<handoff_sim::Report, handoff_sim::SimError> {
    let mut cfg = SimConfig::new(seed);
    cfg.faults = Faults::from_plan(&FaultPlan::Swarm, seed);
    simulate(&cfg)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for seed in [1, 2, 3] {
        let report = run(seed)?;
        println!("{report}");
        if !report.violations.is_empty() {
            return Err(
                format!("seed {seed} broke an invariant; replay: HANDOFF_SIM_SEED={seed}").into(),
            );
        }
    }
    let (a, b) = (run(1)?, run(1)?);
    println!(
        "seed 1 twice: trace hashes {:016x} and {:016x}",
        a.trace_hash, b.trace_hash
    );
    if a.trace_hash != b.trace_hash {
        return Err("the same seed gave two different traces".into());
    }
    Ok(())
}
