//! The same seed gives the same trace, bit for bit: run twice, run on two threads at once.

use handoff_sim::{simulate, FaultPlan, Faults, SimConfig};

fn swarm(seed: u64) -> SimConfig {
    let mut cfg = SimConfig::new(seed);
    cfg.shape.tp = 2;
    cfg.shape.pp = 2;
    cfg.workload.requests = 30;
    cfg.workload.liveness_requests = 5;
    cfg.faults = Faults::from_plan(&FaultPlan::Swarm, seed);
    cfg
}

#[test]
fn same_seed_gives_the_same_trace_hash_twice() {
    for seed in [0u64, 1, 2, 3, 42] {
        let a = simulate(&swarm(seed)).expect("runs");
        let b = simulate(&swarm(seed)).expect("runs");
        assert_eq!(a.trace_hash, b.trace_hash, "seed {seed}:\n{a}\n{b}");
        assert_eq!(a.trace_lines, b.trace_lines);
        assert_eq!(a.virtual_ms, b.virtual_ms);
    }
}

#[test]
fn different_seeds_give_different_traces() {
    let a = simulate(&swarm(10)).expect("runs");
    let b = simulate(&swarm(11)).expect("runs");
    assert_ne!(a.trace_hash, b.trace_hash);
}

#[test]
fn simulations_on_two_threads_at_once_replay_the_same() {
    let alone = simulate(&swarm(7)).expect("runs").trace_hash;
    let hashes: Vec<u64> = std::thread::scope(|s| {
        let t: Vec<_> = (0..2)
            .map(|_| s.spawn(|| simulate(&swarm(7)).expect("runs").trace_hash))
            .collect();
        t.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    assert_eq!(hashes, vec![alone, alone]);
}
