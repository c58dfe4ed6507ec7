//! The three seed documents as simulations, plus behaviours around them. Each test runs
//! the real runtimes in virtual time and asserts on how every rank ended.

use clap::Parser;
use handoff_sim::cli::SimArgs;
use handoff_sim::config::{DataPlane, MessageKind, Plane, Scripted, Target};
use handoff_sim::report::RequestOutcome;
use handoff_sim::{simulate, ModeChoice, Report, SimConfig, Violation};

fn base(seed: u64) -> SimConfig {
    let mut cfg = SimConfig::new(seed);
    cfg.workload.requests = 24;
    cfg.workload.liveness_requests = 6;
    cfg.keep_outcomes = true;
    cfg
}

fn run(cfg: &SimConfig) -> Report {
    let report = simulate(cfg).expect("the simulation runs");
    assert!(report.ok(), "{}\n{report}", cfg);
    report
}

/// Runs `cfg` (no faults): every invariant holds and every request ends `Done`.
fn every_request_done(cfg: &SimConfig) {
    let report = run(cfg);
    assert_eq!(report.safety.done, cfg.workload.requests, "{report}");
    assert_eq!(report.liveness.done, cfg.workload.liveness_requests);
}

fn ranks(report: &Report, key: &str) -> u64 {
    report.safety.ranks.get(key).copied().unwrap_or(0)
}

/// The integrity violations where a transfer landed in blocks already given back.
fn landed_after_release(report: &Report) -> Vec<&Violation> {
    report
        .violations
        .iter()
        .filter(|v| v.detail.contains("use after release"))
        .collect()
}

fn safety(report: &Report) -> impl Iterator<Item = &RequestOutcome> {
    report.outcomes.iter().filter(|o| !o.liveness)
}

// ----- seed 001: the bootstrap server -----

#[test]
fn seed_001_bootstrap_down_at_registration_is_retried_not_swallowed() {
    let mut cfg = base(1001);
    // Down longer than a decode's bootstrap deadline, while requests keep arriving.
    cfg.faults.bootstrap_down_at_start_ms = 500;
    cfg.workload.requests = 60;
    cfg.workload.arrival_gap_ms_max = 24;
    let report = run(&cfg);
    assert!(report.net.registrations_retried > 0, "{report}");
    // Requests that arrived while prefill could not register failed by their deadline with
    // a named reason; once the server came up, later ones went through.
    assert!(ranks(&report, "decode:bootstrap_timeout") > 0, "{report}");
    assert!(report.safety.done > 0, "{report}");
    assert_eq!(report.liveness.done, cfg.workload.liveness_requests);
}

#[test]
fn seed_001_a_failed_bootstrap_query_fails_the_request_with_a_named_reason() {
    let mut cfg = base(1002);
    cfg.faults.query_error_ppm = 1_000_000;
    let report = run(&cfg);
    let decode = ranks(&report, "decode:bootstrap_unavailable");
    assert_eq!(decode, cfg.workload.requests, "{report}");
    assert_eq!(report.safety.done, 0);
    // Prefill never hears from decode and ends at its bootstrap deadline: never silently dropped.
    assert_eq!(
        ranks(&report, "prefill:bootstrap_timeout"),
        cfg.workload.requests
    );
}

#[test]
fn seed_001_prefill_that_never_replies_fails_decode_at_its_waiting_deadline() {
    let mut cfg = base(1003);
    cfg.faults.never_send_ppm = 1_000_000;
    let report = run(&cfg);
    let n = cfg.workload.requests;
    // Whichever side's waiting deadline passes first fails and aborts the other.
    let timeouts =
        ranks(&report, "decode:waiting_timeout") + ranks(&report, "prefill:waiting_timeout");
    let aborted =
        ranks(&report, "decode:aborted_by_peer") + ranks(&report, "prefill:aborted_by_peer");
    assert_eq!(timeouts + aborted, 2 * n, "{report}");
    assert!(timeouts >= n, "{report}");
    for o in safety(&report) {
        let first = o.ranks.iter().map(|r| r.end_ms).min().unwrap_or(0);
        let last = o.ranks.iter().map(|r| r.end_ms).max().unwrap_or(0);
        let wait = cfg.timing.timeouts.waiting.as_millis() as u64;
        assert!(
            o.ranks.iter().all(|r| r.end_ms - r.opened_ms <= wait + 30),
            "{o:?}"
        );
        assert!(last - first <= wait, "{o:?}");
    }
}

#[test]
fn seed_001_request_prefill_never_opened_fails_decode_at_its_waiting_deadline() {
    let mut cfg = base(1004);
    cfg.faults.skip_prefill_ppm = 1_000_000;
    let report = run(&cfg);
    assert_eq!(
        ranks(&report, "decode:waiting_timeout"),
        cfg.workload.requests,
        "{report}"
    );
}

#[test]
fn seed_001_no_prefill_registered_fails_decode_at_its_bootstrap_deadline() {
    let mut cfg = base(1005);
    cfg.faults.ghost_prefill_ppm = 1_000_000;
    let report = run(&cfg);
    assert_eq!(
        ranks(&report, "decode:bootstrap_timeout"),
        cfg.workload.requests,
        "{report}"
    );
    assert_eq!(report.liveness.done, cfg.workload.liveness_requests);
}

#[test]
fn seed_001_sparse_dp_ranks_are_served() {
    let mut cfg = base(1006);
    cfg.shape.prefill_dp_ranks = vec![3, 7];
    cfg.shape.tp = 2;
    let report = run(&cfg);
    assert_eq!(report.safety.done, cfg.workload.requests, "{report}");
}

// ----- seed 002: blocks decode never reads -----

#[test]
fn seed_002_decode_dies_before_reading_and_prefill_frees_its_blocks() {
    let mut cfg = base(2001);
    cfg.shape.mode = ModeChoice::Pull;
    cfg.shape.decode_engines = 1;
    // Decode never reads: its Ready never arrives; then it crashes mid-run.
    cfg.script.push(Scripted::Drop(MessageKind::Ready));
    cfg.script.push(Scripted::Crash {
        target: Target::Engine("D0".into()),
        at_ms: 60,
        for_ms: 300,
    });
    let report = run(&cfg);
    assert_eq!(report.safety.done, 0, "{report}");
    // Prefill ranks paired with the dead decode fail PeerLost one loss window later, or at their
    // TTL; either way their blocks are released (the no-leak invariant checked every pool).
    let freed = ranks(&report, "prefill:peer_lost") + ranks(&report, "prefill:ttl_expired");
    assert!(freed > 0, "{report}");
    assert_eq!(report.injected.get("crash"), Some(&1));
}

#[test]
fn seed_002_abort_lost_in_flight_leaves_prefill_to_free_at_ttl() {
    let mut cfg = base(2002);
    cfg.shape.mode = ModeChoice::Pull;
    cfg.script.push(Scripted::Drop(MessageKind::Ready));
    cfg.script.push(Scripted::Drop(MessageKind::Abort));
    let report = run(&cfg);
    let n = cfg.workload.requests;
    assert_eq!(ranks(&report, "decode:waiting_timeout"), n, "{report}");
    assert_eq!(ranks(&report, "prefill:ttl_expired"), n, "{report}");
    let ttl = cfg.timing.timeouts.pull_ttl.as_millis() as u64;
    for o in safety(&report) {
        for r in o.ranks.iter().filter(|r| r.prefill) {
            // Held no longer than waiting for decode plus the TTL.
            let held = r.end_ms - r.opened_ms;
            assert!(
                held >= ttl && held <= ttl + cfg.timing.timeouts.bootstrap.as_millis() as u64 + 20,
                "{held}"
            );
        }
    }
}

// ----- seed 003: decode saturation, pipeline ranks that disagree in time -----

fn seed_003_config(seed: u64) -> SimConfig {
    let mut cfg = base(seed);
    cfg.shape.pp = 2;
    cfg.shape.mode = ModeChoice::Push;
    // Decode saturated: it opens every request without blocks and allocates too late.
    cfg.faults.saturation_ppm = 1_000_000;
    cfg.faults.alloc_delay_ms = (500, 700);
    // Pipeline ranks open the same request up to 150 ms apart.
    cfg.faults.skew_ms_max = 150;
    cfg
}

#[test]
fn seed_003_saturated_decode_under_pp2_fails_softly() {
    let cfg = seed_003_config(3001);
    let report = run(&cfg);
    assert_eq!(report.safety.done, 0, "{report}");
    assert_eq!(report.liveness.done, cfg.workload.liveness_requests);
    // Decode said Queued, so prefill knew it lived; the first prefill rank to reach its
    // deadline failed, and told the others.
    assert!(ranks(&report, "prefill:bootstrap_timeout") > 0, "{report}");
    assert!(ranks(&report, "prefill:aborted_by_peer") > 0, "{report}");
}

#[test]
fn seed_003_ranks_that_disagree_in_time_end_failed_together() {
    let cfg = seed_003_config(3002);
    let report = run(&cfg);
    // Hop: the largest one-way delay, plus one drain tick on each side.
    let hop = cfg.timing.delay_ms.1 + 2;
    for o in safety(&report) {
        assert!(o.ranks.iter().all(|r| r.end != "done"), "{o:?}");
        let first = o.ranks.iter().map(|r| r.end_ms).min().unwrap_or(0);
        let last = o.ranks.iter().map(|r| r.end_ms).max().unwrap_or(0);
        // Every rank ends within two hops of the first failure (sibling abort, then the
        // abort to decode), not at its own, skewed deadline.
        assert!(
            last - first <= 2 * hop,
            "r{}: ranks ended {first}..{last} ms: {o:?}",
            o.req
        );
    }
}

// ----- the data plane -----

/// Decode opens each request up to 500 ms before prefill does, so prefill often starts
/// its push just as decode's waiting deadline passes: the race the data plane must survive.
fn late_prefill(seed: u64, plane: DataPlane) -> SimConfig {
    let mut cfg = base(seed);
    cfg.shape.mode = ModeChoice::Push;
    cfg.data_plane = plane;
    cfg.faults.skew_ms_max = 500;
    cfg.workload.requests = 100;
    cfg.workload.liveness_requests = 0;
    cfg
}

/// Found by this simulator, now fixed: in push mode decode used to release its blocks the
/// moment it failed, while prefill might still be writing into them (decode's abort in
/// flight, or prefill partitioned away); with RDMA semantics the write landed in memory the
/// engine had reused. Decode now fences a failed push request's blocks until every granted
/// prefill rank says `AbortAck` (or `Done`), or the fence deadline passes.
#[test]
fn push_writes_never_land_in_blocks_decode_released_under_rdma() {
    for seed in 0..20u64 {
        let report = simulate(&late_prefill(seed, DataPlane::Rdma)).expect("runs");
        let landed = landed_after_release(&report);
        assert!(
            landed.is_empty(),
            "seed {seed}: {landed:?}\nreplay: HANDOFF_SIM_SEED={seed}"
        );
    }
}

/// Push over RDMA with prefill engine P0 frozen (as by SIGSTOP) for `for_ms` (or, given
/// none, a fence bound and 2 s), from `60 + 13 × i` ms: long prefills, so that many
/// requests have their grant when the freeze comes and hand their blocks over while frozen.
fn frozen_writer((seed, i): (u64, u64), for_ms: Option<u64>) -> Report {
    frozen_writer_on((seed, i), for_ms, 1)
}

/// [`frozen_writer`] with the workers spread over `hosts` hosts.
fn frozen_writer_on((seed, i): (u64, u64), for_ms: Option<u64>, hosts: u32) -> Report {
    let mut cfg = base(seed);
    cfg.shape.hosts = hosts;
    cfg.shape.mode = ModeChoice::Push;
    cfg.data_plane = DataPlane::Rdma;
    cfg.workload.requests = 80;
    cfg.workload.compute_ms = (40, 160);
    let past_the_fence = cfg.timing.timeouts.fence_max().as_millis() as u64 + 2_000;
    cfg.script.push(Scripted::Freeze {
        target: Target::Engine("P0".into()),
        at_ms: 60 + 13 * i,
        for_ms: for_ms.unwrap_or(past_the_fence),
    });
    let report = run(&cfg);
    assert_eq!(report.injected.get("freeze"), Some(&1), "{report}");
    report
}

/// A prefill engine frozen (as by SIGSTOP) past decode's loss timeout and fences, with its
/// writes queued, resumes: decode had failed its requests and given their blocks to
/// others, so each queued one-sided write must be refused by the writer's own lease, and
/// none may land. Push over RDMA, where nothing at the target can refuse a write.
#[test]
fn a_frozen_writer_that_resumes_lands_nothing_in_released_blocks() {
    let (mut deferred, mut refused, mut late) = (0, 0, 0);
    for seed in 0..8u64 {
        let report = frozen_writer((8100 + seed, seed), Some(1_500));
        assert!(
            report.net.peer_lost > 0,
            "decode declared it lost: {report}"
        );
        assert!(landed_after_release(&report).is_empty(), "{report}");
        deferred += report.net.deferred;
        refused += report.net.lease_refused;
        late += report.net.confirmed_late;
    }
    // Writes were queued during the freeze, and resumed ones refused by the lease; and a
    // write that landed while its writer was stopped was seen only as it resumed, past its
    // lease, so it failed rather than end the request `Done` on prefill alone (the UCX
    // plane's `ConfirmedLate`).
    assert!(
        deferred > 0 && refused > 0 && late > 0,
        "deferred {deferred}, refused {refused}, confirmed late {late}"
    );
}

/// A writer stopped between its lease check and its post, for longer than decode's fence
/// bound: as it resumes, that one write goes out unchecked (`posted_unchecked`), as a real
/// writer's would. Decode's fence has passed by then, so only its quarantine (the writer
/// is lost, not seen to exit) keeps the blocks from the engine: no byte may land in a
/// released block, and every quarantine ends once the writer is back and confirms.
#[test]
fn a_writer_stopped_between_check_and_post_lands_only_in_quarantined_blocks() {
    let mut unchecked = 0;
    for seed in 0..8u64 {
        let report = frozen_writer((8150 + seed, seed), None);
        assert!(landed_after_release(&report).is_empty(), "{report}");
        assert!(report.violations.is_empty(), "{report}");
        unchecked += report.net.posted_unchecked;
    }
    assert!(unchecked > 0, "no write went out unchecked");
}

/// The stopped writer of the test above, with the workers on two hosts: P0 shares one
/// with D0, not with D1. D1 cannot watch P0 as a lost writer, so a quarantine there could
/// only end on its bound, which no stop is bound by; D1's push requests with P0 run as pull
/// instead (`Link::unwatched`), while D0's stay pushes and quarantine as before. No byte
/// may land in a released block either way.
#[test]
fn a_push_to_a_writer_on_another_host_runs_as_pull() {
    let (mut unchecked, mut pulled) = (0, 0);
    for seed in 0..8u64 {
        let report = frozen_writer_on((8180 + seed, seed), None, 2);
        assert!(landed_after_release(&report).is_empty(), "{report}");
        assert!(report.violations.is_empty(), "{report}");
        unchecked += report.net.posted_unchecked;
        pulled += report.net.pulls_instead;
    }
    assert!(unchecked > 0, "no write went out unchecked");
    assert!(pulled > 0, "no push ran as pull");
}

/// The same stopped writer, and decode's request actors panic while their fences hold
/// (found by reading the code: the root released an orphan's blocks at the fence bound,
/// whatever its writers). The root now quarantines an orphan as the machine would have:
/// the writer's one unchecked post lands only in blocks no request has, and each orphan's
/// blocks go once the writer is back and confirms.
#[test]
fn an_orphan_fencing_a_stopped_writer_keeps_its_blocks_past_the_bound() {
    let (mut unchecked, mut panics) = (0, 0);
    for seed in 0..8u64 {
        let mut cfg = base(8170 + seed);
        cfg.shape.mode = ModeChoice::Push;
        cfg.data_plane = DataPlane::Rdma;
        cfg.workload.requests = 80;
        cfg.workload.compute_ms = (40, 160);
        let fence = cfg.timing.timeouts.fence_max().as_millis() as u64;
        let at_ms = 60 + 13 * seed;
        cfg.script.push(Scripted::Freeze {
            target: Target::Engine("P0".into()),
            at_ms,
            for_ms: fence + 2_000,
        });
        // Decode has lost P0 and fences by then; its fences end past the writer's resume.
        for engine in ["D0", "D1"] {
            let target = Target::Engine(engine.into());
            let at_ms = at_ms + 700;
            cfg.script.push(Scripted::Panic { target, at_ms });
        }
        let report = run(&cfg);
        assert!(landed_after_release(&report).is_empty(), "{report}");
        assert!(report.violations.is_empty(), "{report}");
        unchecked += report.net.posted_unchecked;
        panics += report.injected.get("actor_panic").copied().unwrap_or(0);
    }
    assert!(unchecked > 0, "no write went out unchecked");
    assert!(panics > 0, "no actor panicked");
}

/// One plane cut, the other up, over RDMA push and pull: a control-only cut stops the
/// heartbeats while data still flows (requests fail as lost peers, and no write lands in
/// blocks given back); a data-only cut fails transfers while the peers stay connected
/// (requests fail by their transfer, both sides agree, and no loss is declared).
#[test]
fn a_partition_of_one_plane_ends_every_request_cleanly() {
    for (seed, plane, mode) in [
        (8201, Plane::Control, ModeChoice::Push),
        (8202, Plane::Control, ModeChoice::Pull),
        (8203, Plane::Data, ModeChoice::Push),
        (8204, Plane::Data, ModeChoice::Pull),
    ] {
        let mut cfg = base(seed);
        cfg.shape.mode = mode;
        cfg.data_plane = DataPlane::Rdma;
        cfg.workload.requests = 80;
        cfg.script.push(Scripted::Partition {
            target: Target::Engine("P0".into()),
            at_ms: 30,
            for_ms: 600,
            one_way: false,
            plane,
        });
        let report = run(&cfg);
        assert!(landed_after_release(&report).is_empty(), "{report}");
        match plane {
            Plane::Control => assert!(report.net.peer_lost > 0, "{plane:?}: {report}"),
            _ => {
                assert_eq!(report.net.peer_lost, 0, "{plane:?}: {report}");
                assert!(report.net.transfers_failed > 0, "{plane:?}: {report}");
            }
        }
        assert!(!report.safety.failed.is_empty(), "{plane:?}: {report}");
    }
}

/// Peers that lie about their memory (issue 17): decode's transfer info (even requests) or
/// prefill's `Ready` (odd ones, pull) names blocks past the end of the sender's pool. The
/// receiver refuses each on arrival, with the control loop's own check
/// (`handoff_net::check_named_blocks`): the request fails there by name (a protocol error
/// naming the liar) before a byte moves, the liar ends by the abort it hears, every block
/// comes back, nothing crashes, and no transfer is attempted with a lying block list.
#[test]
fn a_peer_whose_messages_lie_about_its_memory_fails_its_requests_by_name() {
    for (seed, mode, plane) in [
        (8401, ModeChoice::Push, DataPlane::Rdma),
        (8402, ModeChoice::Pull, DataPlane::Rdma),
        (8403, ModeChoice::Push, DataPlane::Fenced),
        (8404, ModeChoice::Pull, DataPlane::Fenced),
    ] {
        let mut cfg = base(seed);
        cfg.shape.mode = mode;
        cfg.data_plane = plane;
        cfg.faults.liar_ppm = 1_000_000;
        let report = run(&cfg);
        assert!(report.net.refused > 0, "{mode:?}: {report}");
        assert_eq!(report.net.transfers_failed, 0, "{mode:?}: {report}");
        assert!(ranks(&report, "prefill:protocol_error") > 0, "{report}");
        if mode == ModeChoice::Pull {
            assert!(ranks(&report, "decode:protocol_error") > 0, "{report}");
        }
        // A request refused by name on one side ends failed on every side.
        for o in safety(&report) {
            let ends: Vec<&str> = o.ranks.iter().map(|r| r.end.as_str()).collect();
            if ends.contains(&"protocol_error") {
                assert!(!ends.contains(&"done"), "r{}: {ends:?}", o.req);
            }
        }
        assert_eq!(report.liveness.done, cfg.workload.liveness_requests);
    }
}

/// The real `PeerTable` decides liveness. A prefill engine frozen (as by SIGSTOP) past the
/// loss window, resuming with the same incarnation: decode's tables stop hearing it and
/// lose it, failing the requests that depended on it `PeerLost` while it is still frozen;
/// as it resumes, its own tick finds decode silent since the freeze (decode lost it and
/// stopped beating it), so its side of those requests fails `PeerLost` too, at once, instead
/// of staying open to a deadline; and every block comes back (the no-leak invariant).
#[test]
fn a_worker_frozen_past_the_window_loses_its_peers_as_it_resumes() {
    let (freeze_at, for_ms) = (60, 160);
    let resume = freeze_at + for_ms;
    let mut checked = 0;
    for seed in 0..4u64 {
        let mut cfg = base(8300 + seed);
        cfg.workload.requests = 40;
        // Long prefills: requests are open on both sides when the freeze comes.
        cfg.workload.compute_ms = (40, 160);
        cfg.script.push(Scripted::Freeze {
            target: Target::Engine("P0".into()),
            at_ms: freeze_at,
            for_ms,
        });
        let report = run(&cfg);
        let window = cfg.timing.heartbeat_ms;
        let interval = cfg.timing.heartbeat_interval_ms();
        assert!(report.net.peer_lost > 0, "{report}");
        // Requests open on P0 and on decode when P0 froze, long enough for P0 to have
        // heard decode's transfer info (a bootstrap query and a message: a few hops).
        for o in safety(&report) {
            let open_at_freeze = |r: &&handoff_sim::report::RankOutcome| {
                r.opened_ms + 20 < freeze_at && r.end_ms > freeze_at
            };
            let p0: Vec<_> = o
                .ranks
                .iter()
                .filter(|r| r.engine == "P0")
                .filter(open_at_freeze)
                .collect();
            let decode: Vec<_> = o
                .ranks
                .iter()
                .filter(|r| !r.prefill)
                .filter(open_at_freeze)
                .collect();
            if p0.is_empty() || decode.is_empty() {
                continue;
            }
            for d in decode {
                // Lost by decode's table: one window (and at most an interval and a hop)
                // after P0 was last heard, long before it resumes.
                assert_eq!(d.end, "peer_lost", "seed {seed}: {o:?}");
                assert!(
                    d.end_ms > freeze_at + window - interval
                        && d.end_ms <= freeze_at + window + 2 * interval,
                    "seed {seed}: {o:?}"
                );
            }
            for p in p0 {
                if p.end_ms < resume {
                    // Its own deadline passed while frozen (the simulated runtime's timers
                    // run on): its table, frozen too, lost nobody.
                    assert_ne!(p.end, "peer_lost", "seed {seed}: {o:?}");
                    continue;
                }
                // Still open as it resumes: lost by P0's own table on its first tick.
                checked += 1;
                assert_eq!(p.end, "peer_lost", "seed {seed}: {o:?}");
                assert!(p.end_ms <= resume + 2, "seed {seed}: {o:?}");
            }
        }
    }
    assert!(checked > 0, "no request was still open on P0 as it resumed");
}

/// A prefill engine frozen past decode's loss window is refused to new requests by decode's
/// own directory (the bootstrap client's lost marks, kept in virtual time): decode's
/// queries for it fail `PeerLost` at once instead of handing out a worker that does not
/// answer. Once it resumes it is paired again (heard again, or its marks expired): the
/// liveness phase's requests on it end `Done`.
#[test]
fn a_prefill_lost_while_frozen_is_refused_to_new_requests_then_paired_again() {
    let (freeze_at, for_ms) = (60, 400);
    let (mut refused, mut paired_again) = (0, 0);
    for seed in 0..4u64 {
        let mut cfg = base(8350 + seed);
        cfg.workload.requests = 60;
        cfg.workload.liveness_requests = 12;
        cfg.script.push(Scripted::Freeze {
            target: Target::Engine("P0".into()),
            at_ms: freeze_at,
            for_ms,
        });
        let report = run(&cfg);
        assert!(report.net.peer_lost > 0, "{report}");
        refused += report.net.queries_refused_lost;
        for o in report.outcomes.iter().filter(|o| o.liveness) {
            for r in o.ranks.iter().filter(|r| r.engine == "P0") {
                assert_eq!(r.end, "done", "seed {seed}: {o:?}");
                paired_again += 1;
            }
        }
    }
    assert!(refused > 0, "no query was refused for the lost prefill");
    assert!(
        paired_again > 0,
        "no liveness request was paired with P0 again"
    );
}

/// Seed 98308 of an RDMA swarm sweep (10% of control messages lost, a freeze): a push
/// request's transfer info and abort were lost, its writer was frozen, so decode
/// quarantined the blocks, and then four of its asks in a row lost the `Abort` or the
/// writer's `AbortAck`. The quarantine was working, yet the run was reported stuck
/// (`NoLeak`) at three lost asks; the allowance now follows the run's loss rate, and the
/// quarantine ends with a later ask.
#[test]
fn a_quarantine_whose_asks_are_lost_round_after_round_is_not_taken_for_stuck() {
    let mut cfg = as_the_cli_makes_it(98308, &["--data-plane", "rdma"]);
    cfg.keep_outcomes = true;
    let report = run(&cfg);
    let ask_ms = handoff_actors::machine::QUARANTINE_ASK_EVERY.as_millis() as u64;
    let old_limit = cfg.timing.timeouts.fence_max().as_millis() as u64 + 3 * ask_ms;
    // Every invariant holds (`run`), and the run went on past the old allowance, where it
    // used to stop, until the quarantine's later ask was answered.
    assert!(report.virtual_ms > old_limit, "{report}");
}

/// A control-plane cut shorter than the loss window (less two intervals and a hop) loses
/// nobody: heartbeats are cut, but the peer tables hear them again in time. The same cut
/// past the window loses peers.
#[test]
fn a_control_cut_shorter_than_the_window_loses_nobody() {
    for (seed, for_ms, lost) in [(8401, 40, false), (8402, 40, false), (8403, 180, true)] {
        let mut cfg = base(seed);
        cfg.workload.requests = 60;
        cfg.script.push(Scripted::Partition {
            target: Target::Engine("P0".into()),
            at_ms: 30,
            for_ms,
            one_way: false,
            plane: Plane::Control,
        });
        let report = run(&cfg);
        let cut = report.net.heartbeats - report.net.heartbeats_heard;
        assert!(cut > 0, "heartbeats were cut: {report}");
        assert_eq!(report.net.peer_lost > 0, lost, "{for_ms} ms: {report}");
        if !lost {
            assert_eq!(ranks(&report, "decode:peer_lost"), 0, "{report}");
            assert_eq!(ranks(&report, "prefill:peer_lost"), 0, "{report}");
        }
    }
}

/// Connections between workers that share no live request close after a loss window idle
/// (the simulator's economy: `SimNet::engage`), and no request notices: nobody is lost and
/// every request of a fault-free run ends Done.
#[test]
fn idle_connections_without_a_live_request_close_and_no_request_notices() {
    let mut cfg = base(8501);
    cfg.shape.prefill_engines = 6;
    cfg.shape.decode_engines = 6;
    cfg.workload.requests = 120;
    cfg.workload.arrival_gap_ms_max = 40;
    let report = run(&cfg);
    assert!(report.net.closed_unengaged > 0, "{report}");
    assert_eq!(report.net.peer_lost, 0, "{report}");
    assert_eq!(report.safety.done, cfg.workload.requests, "{report}");
    assert_eq!(
        report.liveness.done, cfg.workload.liveness_requests,
        "{report}"
    );
}

#[test]
fn fenced_data_plane_refuses_transfers_into_released_blocks() {
    let mut fenced = 0;
    for seed in 0..20u64 {
        fenced += run(&late_prefill(seed, DataPlane::Fenced)).net.fenced;
    }
    assert!(fenced > 0);
}

// ----- faults off -----

#[test]
fn without_faults_every_request_succeeds_on_every_rank() {
    let mut cfg = base(5001);
    cfg.shape.tp = 2;
    cfg.shape.pp = 2;
    cfg.shape.prefill_dp_ranks = vec![0, 1];
    let report = run(&cfg);
    assert_eq!(report.safety.done, cfg.workload.requests, "{report}");
    assert!(report.safety.failed.is_empty());
    assert_eq!(
        report.latency_ms.count,
        cfg.workload.requests + cfg.workload.liveness_requests
    );
}

#[test]
fn crash_and_restart_is_a_new_incarnation_that_serves_again() {
    let mut cfg = base(6001);
    cfg.script.push(Scripted::Crash {
        target: Target::Engine("P0".into()),
        at_ms: 30,
        for_ms: 120,
    });
    cfg.workload.requests = 120;
    let report = run(&cfg);
    assert_eq!(report.injected.get("crash"), Some(&1));
    assert!(report.net.peer_lost > 0, "peers were told: {report}");
    // Requests routed to P0 after its restart succeed again.
    let p0_done_late = safety(&report).any(|o| {
        o.ranks.iter().all(|r| r.end == "done")
            && o.ranks
                .iter()
                .any(|r| r.engine == "P0" && r.opened_ms > 160)
    });
    assert!(p0_done_late, "{report}");
}

#[test]
fn a_long_partition_is_detected_as_lost_peers_and_healed() {
    let mut cfg = base(7001);
    cfg.workload.requests = 60;
    cfg.script.push(Scripted::Partition {
        target: Target::Engine("D0".into()),
        at_ms: 20,
        for_ms: 250,
        one_way: false,
        plane: Plane::Both,
    });
    let report = run(&cfg);
    assert!(report.net.partitioned > 0, "{report}");
    assert!(report.net.peer_lost > 0, "{report}");
    assert!(report.safety.done > 0, "{report}");
}

// ----- pipeline parallelism -----

/// Prefill pipeline ranks each hold their layers, a slice of every block, and each
/// delivers only its slice: decode's whole blocks must come out exactly as the model's
/// (the integrity invariant compares every byte), in push, pull and mixed modes, with 2
/// and 4 stages, on both data planes.
#[test]
fn pipeline_ranks_each_deliver_their_slice_of_every_block() {
    for (seed, pp, mode, plane) in [
        (6001, 2, ModeChoice::Push, DataPlane::Fenced),
        (6002, 2, ModeChoice::Pull, DataPlane::Fenced),
        (6003, 4, ModeChoice::Mixed, DataPlane::Rdma),
        (6004, 4, ModeChoice::Pull, DataPlane::Rdma),
    ] {
        let mut cfg = base(seed);
        cfg.shape.pp = pp;
        cfg.shape.mode = mode;
        cfg.data_plane = plane;
        every_request_done(&cfg);
    }
}

// ----- heterogeneous tensor parallelism -----

/// Prefill and decode at TP sizes one of which divides the other: each decode rank gathers
/// its KV heads from its share of prefill's ranks, or takes its share of one prefill
/// rank's heads (head-major there, token-major here), and the integrity invariant compares
/// every byte of its blocks with the model's heads. Without faults every request ends
/// `Done` on every rank, in every mode and on both data planes, replicated heads included
/// (8 prefill ranks over 4 heads; 4 decode ranks over 2).
#[test]
fn decode_ranks_gather_their_heads_from_prefill_ranks_of_another_tp_size() {
    use handoff_sim::LayoutChoice::{Contiguous, PerLayer};
    for (seed, tp, decode_tp, kv_heads, mode, plane) in [
        (7001, 2, 1, 4, ModeChoice::Push, DataPlane::Fenced),
        (7002, 4, 2, 8, ModeChoice::Pull, DataPlane::Fenced),
        (7003, 4, 1, 4, ModeChoice::Mixed, DataPlane::Rdma),
        (7004, 8, 2, 4, ModeChoice::Pull, DataPlane::Rdma),
        (7005, 1, 2, 4, ModeChoice::Push, DataPlane::Fenced),
        (7006, 2, 4, 8, ModeChoice::Pull, DataPlane::Rdma),
        (7007, 2, 4, 2, ModeChoice::Mixed, DataPlane::Fenced),
        (7008, 1, 4, 4, ModeChoice::Mixed, DataPlane::Rdma),
    ] {
        let mut cfg = base(seed);
        cfg.shape.tp = tp;
        cfg.shape.decode_tp = Some(decode_tp);
        cfg.shape.kv_heads = kv_heads;
        cfg.shape.layers = 2;
        cfg.shape.block_bytes = 2 * 2 * kv_heads as usize * 2 * 4;
        cfg.shape.prefill_layout = PerLayer;
        cfg.shape.decode_layout = Contiguous;
        cfg.shape.mode = mode;
        cfg.data_plane = plane;
        every_request_done(&cfg);
    }
}

/// The same pairings under every fault the swarm draws (crashes, partitions of one plane,
/// frozen writers, lost and duplicated messages, engine aborts): every invariant holds
/// (blocks released once, nothing landing after release, decode's blocks holding the
/// model's heads whenever it ends `Done`, every rank's end agreeing with its peers').
#[test]
fn heterogeneous_tp_under_swarm_faults_keeps_every_invariant() {
    for (seed, args) in [
        (
            7101,
            [
                "--tp",
                "4",
                "--decode-tp",
                "2",
                "--mode",
                "push",
                "--data-plane",
                "fenced",
            ],
        ),
        (
            7102,
            [
                "--tp",
                "4",
                "--decode-tp",
                "1",
                "--mode",
                "pull",
                "--data-plane",
                "rdma",
            ],
        ),
        (
            7103,
            [
                "--tp",
                "2",
                "--decode-tp",
                "1",
                "--mode",
                "mixed",
                "--data-plane",
                "fenced",
            ],
        ),
        (
            7104,
            [
                "--tp",
                "1",
                "--decode-tp",
                "2",
                "--mode",
                "push",
                "--data-plane",
                "rdma",
            ],
        ),
        (
            7105,
            [
                "--tp",
                "2",
                "--decode-tp",
                "4",
                "--mode",
                "mixed",
                "--data-plane",
                "fenced",
            ],
        ),
        (
            7106,
            [
                "--tp",
                "1",
                "--decode-tp",
                "4",
                "--mode",
                "pull",
                "--data-plane",
                "rdma",
            ],
        ),
    ] {
        let mut argv = args.to_vec();
        argv.extend(["--kv-heads", "4", "--layers", "2", "--block-bytes", "128"]);
        let cfg = as_the_cli_makes_it(seed, &argv);
        let report = simulate(&cfg).expect("runs");
        assert!(report.ok(), "{cfg}{report}");
    }
}

/// Pairings that cannot work are refused when the cluster is configured, by name.
#[test]
fn tp_pairings_that_cannot_work_are_refused() {
    for (what, decode_tp, kv_heads, pp, want) in [
        ("no heads", 1, 0, 1, "needs kv heads"),
        ("not dividing", 3, 12, 1, "must divide"),
        ("pipeline stages", 1, 4, 2, "pp 1"),
    ] {
        let mut cfg = base(7201);
        cfg.shape.tp = 2;
        cfg.shape.decode_tp = Some(decode_tp);
        cfg.shape.kv_heads = kv_heads;
        cfg.shape.pp = pp;
        cfg.shape.layers = 2;
        cfg.shape.block_bytes = 2 * 2 * 12 * 2 * 4;
        let err = simulate(&cfg)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains(want), "{what}: {err}");
    }
}

/// A block size that does not split evenly across the pipeline ranks is refused when the
/// cluster is configured, by name.
#[test]
fn a_block_that_does_not_split_across_pipeline_ranks_is_refused() {
    let mut cfg = base(6005);
    cfg.shape.pp = 3;
    cfg.shape.block_bytes = 32;
    let err = simulate(&cfg)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("split evenly"), "{err}");
}

/// KV caches as engines hold them: 61 layers over 2 prefill pipeline stages (30 + 31), each
/// stage's memory in per-layer ranges (K and V halves: 2 ranges per layer) or interleaved,
/// decode's in one contiguous range or per layer. The integrity invariant compares every
/// byte of every decode block with what the prefill stages wrote, so each stage's layers
/// must land in their place through both layouts, in every mode and on both planes.
#[test]
fn per_layer_stages_of_an_uneven_split_fill_decode_blocks_of_another_layout() {
    use handoff_sim::LayoutChoice::{Contiguous, Interleaved, PerLayer};
    for (seed, mode, plane, prefill, decode) in [
        (
            7001,
            ModeChoice::Push,
            DataPlane::Fenced,
            PerLayer,
            Contiguous,
        ),
        (
            7002,
            ModeChoice::Pull,
            DataPlane::Rdma,
            PerLayer,
            Contiguous,
        ),
        (
            7003,
            ModeChoice::Mixed,
            DataPlane::Fenced,
            Contiguous,
            Interleaved,
        ),
        (
            7004,
            ModeChoice::Mixed,
            DataPlane::Rdma,
            Interleaved,
            PerLayer,
        ),
    ] {
        let mut cfg = base(seed);
        cfg.shape.pp = 2;
        cfg.shape.layers = 61;
        cfg.shape.block_bytes = 61 * 2 * 2;
        cfg.shape.prefill_layout = prefill;
        cfg.shape.decode_layout = decode;
        cfg.shape.mode = mode;
        cfg.data_plane = plane;
        every_request_done(&cfg);
    }
}

/// Layers that cannot be split (fewer than the stages, or blocks that do not hold a K and
/// a V half of every layer) are refused when the cluster is configured, by name.
#[test]
fn layers_that_do_not_fit_the_blocks_or_the_stages_are_refused() {
    for (pp, layers, block_bytes, name) in [
        (4, 3, 48, "at least one layer"),
        (2, 5, 32, "K and a V half"),
    ] {
        let mut cfg = base(7005);
        cfg.shape.pp = pp;
        cfg.shape.layers = layers;
        cfg.shape.block_bytes = block_bytes;
        let err = simulate(&cfg)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains(name), "{err}");
    }
}

// ----- one transfer deadline -----

/// Every transfer still in flight on a one-sided plane when its request's deadline
/// passes: each takes 30 to 60 times its deadline. The plane answers at the deadline with
/// nothing landed (`Link::write`), the machines hold the blocks until it has, and no write
/// or read lands in a block its engine got back. A plane that broke that promise (landing
/// late, answering late) is caught here as a use after release: the request actor stops
/// waiting for it `PLANE_ANSWER_GRACE` (5 s) past the deadline, before these land.
#[test]
fn transfers_past_their_deadline_land_nothing_in_released_blocks() {
    for mode in [ModeChoice::Push, ModeChoice::Pull] {
        for seed in 0..6u64 {
            let mut cfg = base(seed);
            cfg.shape.mode = mode;
            cfg.data_plane = DataPlane::Rdma;
            cfg.faults.slow_ppm = 1_000_000;
            cfg.faults.slow_factor = (2_000, 4_000);
            cfg.workload.requests = 12;
            cfg.workload.liveness_requests = 0;
            let report = run(&cfg);
            assert_eq!(
                report.safety.done, 0,
                "seed {seed}: every transfer is too slow"
            );
            let timed_out = report.safety.failed.get("transfer_timeout").copied();
            assert!(
                timed_out.unwrap_or(0) > 0 && report.net.transfers_failed > 0,
                "seed {seed} {mode:?}: no request hit its transfer deadline\n{report}"
            );
        }
    }
}

/// Found by running the runtime's own grant table under the simulator's faults: a request
/// whose actor dies (an injected panic) had its blocks released by the root at once. On a
/// plane that checks grants (TCP), in push mode, its grants were still live and a late
/// write passed them into blocks the engine had reused; in pull mode its own read in
/// flight landed there. The root now revokes the grants first, and holds a dead pull
/// decode request's blocks for the fence bound, as it does on one-sided planes.
#[test]
fn a_request_whose_actor_dies_lands_nothing_in_its_reused_blocks() {
    for (mode, seed) in [ModeChoice::Push, ModeChoice::Pull]
        .into_iter()
        .flat_map(|m| (0..40u64).map(move |s| (m, s)))
    {
        let mut cfg = base(seed);
        cfg.shape.mode = mode;
        cfg.data_plane = DataPlane::Fenced;
        cfg.faults.panic_ppm = 300_000;
        cfg.faults.slow_ppm = 500_000;
        cfg.faults.slow_factor = (5, 60);
        cfg.workload.liveness_requests = 0;
        let report = simulate(&cfg).expect("runs");
        let landed = landed_after_release(&report);
        assert!(
            landed.is_empty(),
            "{mode:?} seed {seed}: {landed:?}\nreplay: HANDOFF_SIM_SEED={seed}"
        );
    }
}

/// The sweep seeds (`handoff sim --seeds 30000..32000 --faults swarm --data-plane fenced`)
/// where a dead pull decode request's own read landed in blocks its engine had reused.
#[test]
fn the_sweep_seeds_where_a_dead_pull_request_read_into_reused_blocks() {
    for (seed, mode) in [
        (30748, "pull"),
        (30866, "pull"),
        (30427, "mixed"),
        (31267, "mixed"),
    ] {
        let cfg = as_the_cli_makes_it(seed, &["--data-plane", "fenced", "--mode", mode]);
        let report = simulate(&cfg).expect("runs");
        assert!(report.ok(), "{cfg}{report}");
    }
}

/// The configuration `handoff sim --seed <seed> --faults swarm <args>` runs.
fn as_the_cli_makes_it(seed: u64, args: &[&str]) -> SimConfig {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        sim: SimArgs,
    }
    let seed_arg = seed.to_string();
    let mut argv = vec!["sim", "--seed", &seed_arg, "--faults", "swarm"];
    argv.extend_from_slice(args);
    let cli = Cli::parse_from(argv);
    handoff_sim::cli::config(&cli.sim, seed).expect("a valid configuration")
}

/// A sweep seed (`--seeds 40000..42000 --data-plane rdma --mode push`): prefill's root let a
/// request it never opened expire (telling decode `Abort` and `AbortAck`: nothing of ours
/// will be written), then a late transfer info was buffered again and the engine opened
/// the request, and prefill wrote into blocks decode had reused. The expired id is now
/// remembered, so the late open fails at once and the late message is answered `Abort`.
#[test]
fn a_request_prefill_let_expire_is_never_written_after() {
    let cfg = as_the_cli_makes_it(40978, &["--data-plane", "rdma", "--mode", "push"]);
    let report = simulate(&cfg).expect("runs");
    assert!(report.ok(), "{cfg}{report}");
}

/// The bootstrap server's record expiry, with the real registry's rule: a prefill frozen
/// longer than [`Timing::expire_after_ms`] stops heartbeating its bootstrap client, and the
/// server expires its record; as it resumes, its client finds the connection closed and
/// registers again, and the liveness requests on it end `Done`. Frozen for less than the
/// expiry, it keeps its record. A prefill crashed for longer loses its record too, so new
/// requests for its engine fail by name at the bootstrap step instead of being paired with
/// a process that is gone; the restarted one registers anew and serves again.
///
/// [`Timing::expire_after_ms`]: handoff_sim::config::Timing::expire_after_ms
#[test]
fn records_of_workers_silent_past_the_expiry_expire_and_come_back_with_their_worker() {
    let expire = SimConfig::new(0).timing.expire_after_ms();
    for (seed, for_ms, expires) in [(8600, expire / 2, false), (8601, 2 * expire, true)] {
        let mut cfg = base(seed);
        cfg.workload.requests = 60;
        cfg.workload.liveness_requests = 12;
        cfg.script.push(Scripted::Freeze {
            target: Target::Engine("P0".into()),
            at_ms: 60,
            for_ms,
        });
        let report = run(&cfg);
        let net = &report.net;
        assert_eq!(
            net.records_expired > 0,
            expires,
            "frozen {for_ms} ms: {report}"
        );
        assert_eq!(
            net.registered_again > 0,
            expires,
            "frozen {for_ms} ms: {report}"
        );
        for o in report.outcomes.iter().filter(|o| o.liveness) {
            for r in o.ranks.iter().filter(|r| r.engine == "P0") {
                assert_eq!(r.end, "done", "seed {seed}: {o:?}");
            }
        }
    }
    let mut cfg = base(8602);
    cfg.workload.requests = 120;
    cfg.workload.liveness_requests = 12;
    cfg.script.push(Scripted::Crash {
        target: Target::Engine("P0".into()),
        at_ms: 30,
        for_ms: 3 * expire,
    });
    let report = run(&cfg);
    assert!(report.net.records_expired > 0, "{report}");
    // Without the expiry every one of them failed `peer_lost` (the dead record handed
    // out, refused by the lost marks or dialed in vain).
    assert!(
        ranks(&report, "decode:bootstrap_timeout") > 0,
        "no request found P0's engine gone from the server: {report}"
    );
    for o in report.outcomes.iter().filter(|o| o.liveness) {
        for r in o.ranks.iter().filter(|r| r.engine == "P0") {
            assert_eq!(r.end, "done", "{o:?}");
        }
    }
}
