//! The swarm: a few hundred seeds, each with its own mix of faults and rates, on small
//! clusters with scaled-down timeouts. `HANDOFF_SIM_SEED=<n>` runs only that seed.

use handoff_sim::config::DataPlane;
use handoff_sim::{simulate, FaultPlan, Faults, ModeChoice, Report, SimConfig};

/// Seeds the swarm runs inside `cargo test`; the CLI sweeps more (`--seeds 0..10000`).
const SWARM_SEEDS: u64 = 300;

/// A small cluster whose shape also varies with the seed: tp, pp, sparse dp ranks, mode,
/// the data plane (half the seeds on the RDMA plane, where a late transfer lands), and
/// the hosts (half the seeds on two, where a worker cannot watch the other host's).
fn config(seed: u64) -> SimConfig {
    let mut cfg = SimConfig::new(seed);
    cfg.shape.tp = 1 + (seed % 2) as u32;
    cfg.shape.pp = 1 + (seed / 2 % 2) as u32;
    cfg.shape.prefill_engines = 1 + (seed / 4 % 2) as u32;
    cfg.shape.decode_engines = 1 + (seed / 8 % 2) as u32;
    cfg.shape.prefill_dp_ranks = if seed % 5 == 0 { vec![2, 9] } else { vec![0] };
    cfg.shape.mode = match seed % 3 {
        0 => ModeChoice::Push,
        1 => ModeChoice::Pull,
        _ => ModeChoice::Mixed,
    };
    cfg.data_plane = if seed / 3 % 2 == 0 {
        DataPlane::Fenced
    } else {
        DataPlane::Rdma
    };
    cfg.shape.hosts = 1 + (seed / 7 % 2) as u32;
    cfg.workload.requests = 24;
    cfg.workload.liveness_requests = 4;
    cfg.faults = Faults::from_plan(&FaultPlan::Swarm, seed);
    cfg
}

fn check(report: &Report, cfg: &SimConfig) {
    assert!(report.ok(), "{cfg}{report}");
}

#[test]
fn swarm_of_seeds_keeps_every_invariant() {
    if let Some(seed) = std::env::var("HANDOFF_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        let cfg = config(seed);
        print!("{cfg}");
        let report = simulate(&cfg).expect("runs");
        print!("{report}");
        return check(&report, &cfg);
    }
    // Two threads: each simulation owns its runtime, so they run side by side.
    let failures: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..2u64)
            .map(|t| {
                s.spawn(move || {
                    let mut failed = Vec::new();
                    for seed in (0..SWARM_SEEDS).filter(|s| s % 2 == t) {
                        let cfg = config(seed);
                        let report = simulate(&cfg).expect("runs");
                        if !report.ok() {
                            failed.push(format!("{cfg}{report}"));
                        }
                    }
                    failed
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("thread"))
            .collect()
    });
    assert!(
        failures.is_empty(),
        "{} seeds failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn swarm_draws_a_different_mix_per_seed() {
    let mixes: std::collections::BTreeSet<String> =
        (0..20).map(|s| config(s).faults.to_string()).collect();
    assert!(mixes.len() >= 18, "{mixes:?}");
}
