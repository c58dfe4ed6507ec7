//! `handoff sim`: the simulator's command line, as a library the facade's binary calls.
//!
//! The facade adds `Sim(handoff_sim::cli::SimArgs)` to its subcommands and calls
//! [`run`]. A run prints every setting first, then a summary; a failing run ends with
//! `replay: HANDOFF_SIM_SEED=<n>` and exit status 1. Without `--seed`, the seed comes from
//! `HANDOFF_SIM_SEED`, else from the wall clock (outside the simulation), and is printed.

use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::chart::{self, Panel, Progress, Series};
use crate::config::{DataPlane, FaultPlan, Faults, LayoutChoice, ModeChoice, SimConfig};
use crate::report::Report;
use crate::{simulate, SimError};

/// The environment variable that names a seed to replay.
pub const SEED_ENV: &str = "HANDOFF_SIM_SEED";

/// Above this many requests a run keeps no per-request trace lines (memory, time): a
/// violation then shows the run's last lines instead.
pub const REQUEST_LINES_REQUESTS_MAX: u64 = 20_000;

/// Arguments of `handoff sim`.
#[derive(clap::Args, Clone, Debug)]
pub struct SimArgs {
    /// The seed to run (default: $HANDOFF_SIM_SEED, else one from the wall clock, printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// A sweep: every seed in A..B (B excluded), e.g. `--seeds 0..1000`.
    #[arg(long, value_name = "A..B")]
    pub seeds: Option<String>,
    /// Prefill engines.
    #[arg(long, default_value_t = 2)]
    pub prefill: u32,
    /// Decode engines.
    #[arg(long, default_value_t = 2)]
    pub decode: u32,
    /// Tensor-parallel ranks of every dp group, both sides (prefill's, with `--decode-tp`).
    #[arg(long, default_value_t = 1)]
    pub tp: u32,
    /// Decode's tensor-parallel ranks when they differ from prefill's: one of the two must
    /// divide the other, and it needs `--kv-heads` and `--layers` (with `--pp 1`).
    #[arg(long)]
    pub decode_tp: Option<u32>,
    /// The model's KV heads: every block is 2 tokens of these heads in each K and V half
    /// of every layer, each tp rank holding its share (prefill head-major, decode
    /// token-major), filled and checked head by head. 0: each tp rank's blocks are its own.
    #[arg(long, default_value_t = 0)]
    pub kv_heads: u32,
    /// Pipeline-parallel ranks of every prefill dp group.
    #[arg(long, default_value_t = 1)]
    pub pp: u32,
    /// The dp ranks of every prefill engine, a comma list (need not be dense: `0,5`).
    #[arg(long, default_value = "0")]
    pub prefill_dp: String,
    /// Dp ranks of every decode engine.
    #[arg(long, default_value_t = 1)]
    pub decode_dp: u32,
    /// Bytes per KV block (the whole model's).
    #[arg(long, default_value_t = 32)]
    pub block_bytes: usize,
    /// Model layers (0: opaque blocks split evenly across prefill pipeline ranks);
    /// prefill stages split them unevenly when they must (61 over 2: 30 + 31).
    #[arg(long, default_value_t = 0)]
    pub layers: u32,
    /// How prefill workers lay out their layers: per-layer, interleaved or contiguous.
    #[arg(long, default_value = "contiguous")]
    pub prefill_layout: String,
    /// How decode workers lay out their layers: per-layer, interleaved or contiguous.
    #[arg(long, default_value = "contiguous")]
    pub decode_layout: String,
    /// Hosts the workers are spread over (round robin): a worker watches only processes on
    /// its own host, and a decode push over the RDMA plane with a prefill rank on another
    /// host runs as pull.
    #[arg(long, default_value_t = 1)]
    pub hosts: u32,
    /// Requests in the safety phase (faults on).
    #[arg(long, default_value_t = 200)]
    pub requests: u64,
    /// Requests in the liveness phase (faults off; all must succeed).
    #[arg(long, default_value_t = 20)]
    pub liveness_requests: u64,
    /// Faults: `none`, `all`, `swarm` (a mix drawn per seed), or a comma list of
    /// loss,delay,dup,partition,crash,bootstrap,saturation,slow,skew,panic,abort,stall,freeze,lie.
    #[arg(long, default_value = "swarm")]
    pub faults: String,
    /// Transfer mode of decode engines: push, pull or mixed.
    #[arg(long, default_value = "mixed")]
    pub mode: String,
    /// What a transfer into blocks taken back while it was in flight does: `fenced`
    /// (refused at landing) or `rdma` (lands: an integrity violation).
    #[arg(long, default_value = "fenced")]
    pub data_plane: String,
    /// Print the report as JSON (one object per seed, one per line).
    #[arg(long)]
    pub json: bool,
    /// Print every trace line as it happens (to replay a seed by eye).
    #[arg(long)]
    pub trace: bool,
    /// Print only failing seeds and the sweep's totals.
    #[arg(long)]
    pub quiet: bool,
    /// Run the scale benchmark instead (growing clusters and request counts, faults off).
    #[arg(long)]
    pub bench: bool,
    /// Draw the run as an SVG: each seed's requests done and failed (by reason), and its
    /// latency percentiles. A progress line goes to stderr while a sweep runs, when stderr
    /// is a terminal.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<std::path::PathBuf>,
}

/// The simulation `args` describe, for `seed`.
pub fn config(args: &SimArgs, seed: u64) -> Result<SimConfig, SimError> {
    let mut cfg = SimConfig::new(seed);
    cfg.shape.prefill_engines = args.prefill;
    cfg.shape.decode_engines = args.decode;
    cfg.shape.tp = args.tp;
    cfg.shape.decode_tp = args.decode_tp;
    cfg.shape.kv_heads = args.kv_heads;
    cfg.shape.pp = args.pp;
    cfg.shape.decode_dp = args.decode_dp;
    cfg.shape.prefill_dp_ranks = args
        .prefill_dp
        .split(',')
        .map(|d| {
            d.trim()
                .parse::<u32>()
                .map_err(|e| SimError::Config(format!("--prefill-dp {d:?}: {e}")))
        })
        .collect::<Result<_, _>>()?;
    cfg.shape.mode = args.mode.parse::<ModeChoice>()?;
    cfg.shape.block_bytes = args.block_bytes;
    cfg.shape.layers = args.layers;
    cfg.shape.prefill_layout = args.prefill_layout.parse::<LayoutChoice>()?;
    cfg.shape.decode_layout = args.decode_layout.parse::<LayoutChoice>()?;
    cfg.shape.hosts = args.hosts;
    cfg.data_plane = args.data_plane.parse::<DataPlane>()?;
    cfg.workload.requests = args.requests;
    cfg.workload.liveness_requests = args.liveness_requests;
    cfg.workload.burst_max = burst_for(cfg.shape.workers());
    cfg.faults = Faults::from_plan(&args.faults.parse::<FaultPlan>()?, seed);
    cfg.request_lines = args.requests <= REQUEST_LINES_REQUESTS_MAX;
    cfg.echo_trace = args.trace;
    cfg.validate()?;
    Ok(cfg)
}

/// Requests per arrival for a cluster of `workers`: about one request per 8 workers per
/// virtual ms keeps every decode pool busy without starving it.
pub fn burst_for(workers: u64) -> u64 {
    (workers / 8).max(1)
}

fn parse_range(s: &str) -> Result<std::ops::Range<u64>, SimError> {
    let bad = || SimError::Config(format!("--seeds {s:?}: expected A..B"));
    let (a, b) = s.split_once("..").ok_or_else(bad)?;
    let a: u64 = a.trim().parse().map_err(|_| bad())?;
    let b: u64 = b.trim().parse().map_err(|_| bad())?;
    if b <= a {
        return Err(bad());
    }
    Ok(a..b)
}

fn pick_seed(args: &SimArgs) -> Result<u64, SimError> {
    if let Some(s) = args.seed {
        return Ok(s);
    }
    if let Ok(s) = std::env::var(SEED_ENV) {
        return s
            .trim()
            .parse()
            .map_err(|_| SimError::Config(format!("{SEED_ENV}={s:?} is not a u64")));
    }
    // The only wall-clock read: choosing a seed, outside the simulation, printed below.
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    Ok(nanos % 1_000_000_000)
}

/// Runs `handoff sim`.
pub fn run(args: SimArgs) -> ExitCode {
    match run_inner(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("handoff sim: {e}");
            ExitCode::from(2)
        }
    }
}

fn run_inner(args: &SimArgs) -> Result<bool, SimError> {
    if args.bench {
        scale(&SCALE_STEPS, args.requests.max(1));
        return Ok(true);
    }
    let seeds = match &args.seeds {
        Some(r) => parse_range(r)?,
        None => {
            let s = pick_seed(args)?;
            s..s + 1
        }
    };
    let sweep = seeds.end - seeds.start > 1;
    let (mut passed, mut failed, mut requests) = (0u64, Vec::new(), 0u64);
    let started = Instant::now();
    let mut progress = Progress::new("sim", seeds.end - seeds.start, "seeds");
    let mut plotted = Vec::new();
    for (n, seed) in seeds.enumerate() {
        progress.set(n as u64);
        let cfg = config(args, seed)?;
        if !(args.json || sweep && args.quiet) {
            print!("{cfg}");
        }
        let report = simulate(&cfg)?;
        requests += report.requests();
        if sweep {
            progress.finish();
        }
        print_report(args, &report, sweep);
        if args.plot.is_some() {
            plotted.push(Plotted::of(&report));
        }
        if report.ok() {
            passed += 1;
        } else {
            failed.push(seed);
        }
    }
    progress.finish();
    if let Some(path) = &args.plot {
        let svg = sweep_chart(&plotted);
        std::fs::write(path, svg)
            .map_err(|e| SimError::Config(format!("--plot {}: {e}", path.display())))?;
        eprintln!("handoff sim: plot written to {}", path.display());
    }
    if sweep && !args.json {
        println!(
            "sweep: {passed} seeds passed, {} failed {:?}; {requests} requests in {:.1} s",
            failed.len(),
            failed,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(failed.is_empty())
}

/// Failure reasons drawn as lines of their own in a sweep's picture (the rest are one line).
const PLOT_REASONS_MAX: usize = 5;

/// What the sweep's picture needs of one seed's report.
struct Plotted {
    seed: u64,
    done: u64,
    failed: BTreeMap<String, u64>,
    latency: [u64; 3],
}

impl Plotted {
    fn of(r: &Report) -> Self {
        let mut failed = r.safety.failed.clone();
        for (k, v) in &r.liveness.failed {
            *failed.entry(k.clone()).or_default() += v;
        }
        Self {
            seed: r.seed,
            done: r.safety.done + r.liveness.done,
            failed,
            latency: [r.latency_ms.p50, r.latency_ms.p90, r.latency_ms.p99],
        }
    }
}

/// Outcomes per seed (done, and failed by reason) above latency per seed.
fn sweep_chart(seeds: &[Plotted]) -> String {
    let line = |name: &str, f: &dyn Fn(&Plotted) -> f64| Series {
        name: name.to_string(),
        points: seeds.iter().map(|p| (p.seed as f64, f(p))).collect(),
        dashed: false,
    };
    let failed = |p: &Plotted| p.failed.values().sum::<u64>() as f64;
    let mut outcomes = vec![line("done", &|p| p.done as f64), line("failed", &failed)];
    // The most frequent reasons by name (one colour each), the rest together.
    let mut totals: BTreeMap<&String, u64> = BTreeMap::new();
    for p in seeds {
        for (k, v) in &p.failed {
            *totals.entry(k).or_default() += v;
        }
    }
    let mut ranked: Vec<(&String, u64)> = totals.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let named: BTreeSet<&String> = ranked.iter().take(PLOT_REASONS_MAX).map(|r| r.0).collect();
    for (reason, _) in ranked.iter().take(PLOT_REASONS_MAX) {
        outcomes.push(line(&format!("  {reason}"), &|p| {
            p.failed.get(*reason).copied().unwrap_or(0) as f64
        }));
    }
    if ranked.len() > PLOT_REASONS_MAX {
        outcomes.push(line("  other reasons", &|p| {
            let other = p.failed.iter().filter(|(k, _)| !named.contains(k));
            other.map(|(_, v)| *v).sum::<u64>() as f64
        }));
    }
    let latency = vec![
        line("p50", &|p| p.latency[0] as f64),
        line("p90", &|p| p.latency[1] as f64),
        line("p99", &|p| p.latency[2] as f64),
    ];
    let (first, last) = (
        seeds.first().map_or(0, |p| p.seed),
        seeds.last().map_or(0, |p| p.seed),
    );
    chart::svg(
        &format!("handoff sim, seeds {first}..={last}"),
        &[
            Panel {
                title: "Requests per seed, by outcome".into(),
                x_label: "seed".into(),
                y_label: "requests".into(),
                log_x: false,
                series: outcomes,
            },
            Panel {
                title: "Latency per seed (arrival to the last decode rank's Done)".into(),
                x_label: "seed".into(),
                y_label: "ms (virtual)".into(),
                log_x: false,
                series: latency,
            },
        ],
    )
}

fn print_report(args: &SimArgs, report: &Report, sweep: bool) {
    if args.json {
        match serde_json::to_string(report) {
            Ok(s) => println!("{s}"),
            Err(e) => eprintln!("handoff sim: could not encode the report: {e}"),
        }
    } else if !(sweep && args.quiet && report.ok()) {
        if sweep && args.quiet {
            print!("{}", report.settings);
        }
        print!("{report}");
    }
}

/// The scale benchmark's steps: (prefill engines, decode engines, tp, requests).
pub const SCALE_STEPS: [(u32, u32, u32, u64); 5] = [
    (5, 5, 1, 10_000),
    (50, 50, 1, 100_000),
    (500, 500, 1, 100_000),
    (250, 250, 2, 100_000),
    (500, 500, 1, 1_000_000),
];

/// Runs growing fault-free clusters and prints wall time and simulated requests per second.
/// `requests_cap` bounds each step's requests (for quick runs).
pub fn scale(steps: &[(u32, u32, u32, u64)], requests_cap: u64) {
    println!("workers  requests   wall_s   req_per_s  virtual_s  trace_hash        ok");
    let mut progress = Progress::new("scale", steps.len() as u64, "steps");
    for (n, &(p, d, tp, requests)) in steps.iter().enumerate() {
        progress.set(n as u64);
        let mut cfg = SimConfig::new(1);
        cfg.shape.prefill_engines = p;
        cfg.shape.decode_engines = d;
        cfg.shape.tp = tp;
        cfg.workload.requests = requests.min(requests_cap);
        cfg.workload.liveness_requests = 0;
        cfg.workload.burst_max = burst_for(cfg.shape.workers());
        cfg.request_lines = false;
        let workers = cfg.shape.workers();
        let result = simulate(&cfg);
        progress.finish();
        match result {
            Ok(r) => {
                let wall = r.wall_ms.max(1) as f64 / 1000.0;
                println!(
                    "{workers:>7} {:>9} {wall:>8.2} {:>11.0} {:>10.2}  {:016x}  {}",
                    r.requests(),
                    r.requests() as f64 / wall,
                    r.virtual_ms as f64 / 1000.0,
                    r.trace_hash,
                    if r.ok() { "yes" } else { "NO" }
                );
                if !r.ok() {
                    print!("{r}");
                }
            }
            Err(e) => println!("{workers:>7}: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        sim: SimArgs,
    }

    #[test]
    fn arguments_build_the_configuration_they_name() {
        let cli = Cli::parse_from([
            "sim",
            "--prefill",
            "3",
            "--tp",
            "2",
            "--pp",
            "2",
            "--prefill-dp",
            "0,5",
            "--faults",
            "loss,crash",
            "--mode",
            "pull",
        ]);
        let cfg = config(&cli.sim, 9).unwrap();
        assert_eq!(cfg.shape.prefill_dp_ranks, vec![0, 5]);
        assert_eq!(cfg.shape.workers(), 3 * 2 * 2 * 2 + 2 * 2);
        assert!(cfg.faults.loss_ppm > 0 && cfg.faults.crash_every_ms > 0);
        assert_eq!(cfg.faults.dup_ppm, 0);
        let bad = Cli::parse_from(["sim", "--faults", "meteor"]);
        assert!(config(&bad.sim, 1).is_err());
        assert!(parse_range("5..5").is_err());
        assert_eq!(parse_range("2..4").unwrap(), 2..4);
    }
}
