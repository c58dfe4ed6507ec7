//! `handoff bench`: data-plane throughput and latency between two processes on one host,
//! next to the references that bound it (single-thread `memcpy`; raw TCP, `tcp_stream`,
//! beside the `tcp` rows; and `ucx_perftest` when installed).
//!
//! For each block size (16 KiB, 128 KiB, 1 MiB, 4 MiB) the bench starts a peer process
//! (this binary re-executed as `handoff bench --peer ...`: the subcommand must be wired as
//! `bench`) with a region of `--region-mib` on each side, fills the source with a seeded
//! pattern, and moves every block to a seeded random permutation of positions (so no two
//! blocks merge into one operation): a warm-up pass, then `--total-mib` of timed passes,
//! written (push) and read (pull). Every point is verified: the checksum of the
//! destination blocks, computed where they live, must equal the source's. One-block 16 KiB
//! latency (p50/p99 over `--latency-iters` transfers) follows.
//!
//! `--transport inproc` copies between two regions of this process with
//! `Region::copy_blocks`; `tcp` uses `DataServer`/`DataClient`; `ucx` the
//! `UcxDataPlane`; `auto` is UCX, or TCP (logged) where libucp cannot be loaded.
//!
//! `--memory cuda` puts both regions in device memory on `--cuda-device` (each process
//! allocates its own; UCX moves them with `cuda_ipc`), and `--peer-memory host` puts the
//! peer's in host memory (GPU↔host). The reference is then `cuda_memcpy`: one
//! `cuMemcpyDtoDAsync` per block of the same permutation, between two device buffers of
//! this process, as one stream's work. Checksums of device blocks are computed from copies
//! back to the host (see `handoff_gpu`).
//!
//! The full request lifecycle's latency (through the request actors, on the network
//! transport, peers cached) is [`Report::lifecycle`], measured by [`crate::lifecycle`].

use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_gpu::checksum::fill_pattern;
use handoff_gpu::{Checksum64, DeviceBuffer, GpuError};
use handoff_transport::data::{
    AllowAll, DataError, UcxDataPlane, UcxPeer, UcxPlaneOptions, UcxRange,
};
use handoff_transport::lease::Lease;
use handoff_transport::tcp::{BusyPoll, DataClient, DataServer};
use handoff_transport::wire::{RegionDescriptor, TransportKind};
use handoff_transport::{
    BlockId, KvLayout, KvMemory, KvRange, LayerSpan, RankInfo, Region, RequestId,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// Block sizes measured, in bytes.
pub const BLOCK_SIZES: [usize; 4] = [16 << 10, 128 << 10, 1 << 20, 4 << 20];

/// With `--layers`, the added block sizes must leave at least this many blocks in the
/// region (so the permutation still scatters them).
const LAYERED_BLOCKS_MIN: usize = 4;

/// Most layers `--layers` accepts (the layout's own bound).
const LAYERS_MAX: u32 = 1024;

/// Timed passes per point, at least, unless `--repeat` says otherwise.
pub const PASSES_MIN_DEFAULT: usize = 5;

/// Most timed passes `--repeat` accepts.
const PASSES_MAX: usize = 1000;

/// Block size of the latency measurement.
pub const LATENCY_BLOCK_BYTES: usize = 16 << 10;

/// Deadline of one timed transfer call (a whole pass over the region).
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// How long the lifecycle's two runtimes sit idle, connected, while the bench measures the
/// CPU the process spends (a note of the report): what an engine pays between requests.
const IDLE_WINDOW: Duration = Duration::from_secs(2);

/// Time for a peer process to start, answer a command, or exit.
const PEER_STEP_TIMEOUT: Duration = Duration::from_secs(60);

/// Time one `ucx_perftest` run may take.
const PERFTEST_TIMEOUT: Duration = Duration::from_secs(120);

/// Marks the peer's protocol lines on its stdout.
const PEER_PREFIX: &str = "HANDOFF_BENCH_PEER ";

/// Which transports to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchTransport {
    /// UCX when libucp loads, otherwise TCP (logged).
    Auto,
    /// The UCX data plane (shared memory between processes on one host).
    Ucx,
    /// The TCP data transport over loopback.
    Tcp,
    /// `Region::copy_blocks` between two regions of one process.
    Inproc,
}

impl BenchTransport {
    fn name(self) -> &'static str {
        match self {
            BenchTransport::Auto => "auto",
            BenchTransport::Ucx => "ucx",
            BenchTransport::Tcp => "tcp",
            BenchTransport::Inproc => "inproc",
        }
    }
}

/// Where a bench region lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchMemory {
    /// Host memory (UCX-allocated for UCX, heap for TCP).
    Host,
    /// CUDA device memory on `--cuda-device` (UCX only).
    Cuda,
}

impl BenchMemory {
    fn name(self) -> &'static str {
        match self {
            BenchMemory::Host => "host",
            BenchMemory::Cuda => "cuda",
        }
    }
}

/// How a UCX bench plane gets host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HostMemory {
    /// UCX allocates every range (`UCP_MEM_MAP_ALLOCATE`).
    Allocated,
    /// Heap memory, registered range by range by address (`UcxDataPlane::start_on_region`).
    Registered,
}

/// Arguments of `handoff bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Transports to measure, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "auto")]
    pub transport: Vec<BenchTransport>,
    /// A short run: 64 MiB regions, 256 MiB per point, 200 latency samples.
    #[arg(long)]
    pub quick: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Region size on each side, MiB.
    #[arg(long, default_value_t = 256)]
    pub region_mib: usize,
    /// Bytes moved per timed point (after a warm-up pass), MiB: at least `--repeat` passes
    /// over the region.
    #[arg(long, default_value_t = 1024)]
    pub total_mib: usize,
    /// Timed passes per point, at least (each moves the whole region): a point's rate is
    /// its median pass's, printed with its slowest and fastest pass's, so a swing between
    /// passes shows.
    #[arg(long, default_value_t = PASSES_MIN_DEFAULT)]
    pub repeat: usize,
    /// One-block transfers timed for the latency percentiles.
    #[arg(long, default_value_t = 1000)]
    pub latency_iters: usize,
    /// Seed of the patterns and permutations.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Skip the `ucx_perftest` reference.
    #[arg(long)]
    pub no_perftest: bool,
    /// Where this process's region lives. `cuda` moves device memory with UCX (a UCX
    /// built with CUDA: `HANDOFF_UCX_LIB`) and compares with a device-to-device copy.
    #[arg(long, value_enum, default_value = "host")]
    pub memory: BenchMemory,
    /// Where the peer process's region lives (default: as `--memory`); `--memory cuda
    /// --peer-memory host` measures GPU to host and back.
    #[arg(long, value_enum)]
    pub peer_memory: Option<BenchMemory>,
    /// The CUDA device both processes use for `cuda` memory.
    #[arg(long, default_value_t = 0)]
    pub cuda_device: u32,
    /// Also lay each side's region out as this many layers × K and V (2 × N ranges, one
    /// per vLLM-style `[2, num_blocks, ...]` half, so a block is 2 × N segments of
    /// block / 2N bytes) and measure the same points (same bytes per block, same
    /// permutation, same checksums) next to the one-range ones, with their ratio. Adds the
    /// block sizes whose segments are 128 KiB and 512 KiB. UCX only.
    #[arg(long)]
    pub layers: Option<u32>,
    /// UCX: also measure writes without the writer's lease (the fence checked before every
    /// put, as the runtime posts them), in turns with the leased ones, pass by pass, and
    /// print the leased/unleased ratio of each write point.
    #[arg(long)]
    pub lease_cost: bool,
    /// TCP: wait for bytes spinning up to this many microseconds before sleeping, on the
    /// client (each small operation's answer) and the server (each next frame), as
    /// `handoff worker --tcp-busy-poll-us` does: lower one-block latency for the CPU spun;
    /// 0 never spins. Unset, the runtime's default: only the client spins, up to 100 µs,
    /// for the answer to an operation of at most 256 KiB.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=1000))]
    pub tcp_busy_poll_us: Option<u64>,
    /// How UCX gets host regions: heap memory `registered` by address, as an engine's
    /// tensors are and as the NIXL and Mooncake references register theirs (the default
    /// between host memory: the runtime moves it by same-host copies), or `allocated` by
    /// UCX (same-host peers' UCX maps it through shared memory; the default when either
    /// side is CUDA).
    #[arg(long, value_enum)]
    pub host_memory: Option<HostMemory>,
    /// Block sizes to measure, KiB, comma-separated (default 16, 128, 1024, 4096, plus
    /// the `--layers` sizes).
    #[arg(long, value_delimiter = ',')]
    pub block_kib: Vec<usize>,
    /// Draw throughput against block size as an SVG: one line per transport and operation,
    /// the references (memcpy, ucx_perftest) dashed.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Internal: run as the peer process (`tcp:<blocks>:<block bytes>` or `ucx:...`).
    #[arg(long, hide = true)]
    pub peer: Option<String>,
}

/// One measured throughput point.
#[derive(Clone, Debug)]
pub struct Point {
    /// `memcpy`, `inproc`, `tcp`, `ucx`, `ucx_perftest`.
    pub transport: String,
    /// `copy`, `write`, `read`, `put_bw`, ...
    pub op: String,
    /// Block size in bytes.
    pub block_bytes: usize,
    /// Bytes moved in the timed part.
    pub bytes: u64,
    /// Seconds the timed part took (transports: the median pass's, times the passes).
    pub secs: f64,
    /// Seconds of each timed pass, fastest first (empty where the point has no passes of
    /// its own, e.g. `ucx_perftest`).
    pub pass_secs: Vec<f64>,
    /// Whether the destination's checksum matched (`None`: not checkable, e.g. perftest).
    pub verified: Option<bool>,
    /// Ranges each side's region is laid out in (1: one contiguous range; `--layers N`:
    /// 2N), so segments per block.
    pub ranges: usize,
    /// This point's throughput over the one-range point of the same transport, operation
    /// and block size in the same run (layered points only).
    pub vs_one_range: Option<f64>,
    /// A remark printed with the row.
    pub note: String,
}

impl Report {
    /// Throughput against block size, one line per (transport, operation, ranges), the
    /// references dashed, as an SVG.
    pub fn chart(&self) -> String {
        use handoff_sim::chart::{svg, Panel, Series};
        let mut lines: Vec<Series> = Vec::new();
        for p in &self.points {
            let mut name = format!("{} {}", p.transport, p.op);
            if p.ranges > 1 {
                name.push_str(&format!(" ({} ranges)", p.ranges));
            }
            let point = (p.block_bytes as f64, p.gbps());
            match lines.iter_mut().find(|s| s.name == name) {
                Some(s) => s.points.push(point),
                None => lines.push(Series {
                    dashed: p.transport == self.reference
                        || p.transport.ends_with("perftest")
                        || p.transport == TCP_STREAM,
                    name,
                    points: vec![point],
                }),
            }
        }
        for s in &mut lines {
            s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        let panel = Panel {
            title: "Throughput by block size (dashed: references)".into(),
            x_label: "block size".into(),
            y_label: "GB/s".into(),
            log_x: true,
            series: lines,
        };
        svg("handoff bench", &[panel])
    }
}

impl Point {
    /// Throughput in GB/s (10⁹ bytes per second).
    pub fn gbps(&self) -> f64 {
        if self.secs > 0.0 {
            self.bytes as f64 / self.secs / 1e9
        } else {
            0.0
        }
    }

    /// The slowest and the fastest pass's throughput, GB/s (`None`: no passes).
    pub fn gbps_range(&self) -> Option<(f64, f64)> {
        let (fastest, slowest) = (*self.pass_secs.first()?, *self.pass_secs.last()?);
        let pass_bytes = self.bytes as f64 / self.pass_secs.len() as f64;
        (fastest > 0.0).then(|| (pass_bytes / slowest / 1e9, pass_bytes / fastest / 1e9))
    }
}

/// Seconds of every pass, sorted, and the point's time: its median pass's, times the
/// passes (a pass another process of a shared machine stalled does not decide it).
fn passes_timed(mut secs: Vec<f64>) -> (Vec<f64>, f64) {
    secs.sort_by(f64::total_cmp);
    let median = secs.get(secs.len() / 2).copied().unwrap_or(0.0);
    let total = median * secs.len() as f64;
    (secs, total)
}

/// Runs `pass` `passes` times, timing each: [`passes_timed`] of the times.
fn time_passes<E>(
    passes: usize,
    mut pass: impl FnMut() -> Result<(), E>,
) -> Result<(Vec<f64>, f64), E> {
    let mut each = Vec::with_capacity(passes);
    for _ in 0..passes {
        let started = Instant::now();
        pass()?;
        each.push(started.elapsed().as_secs_f64());
    }
    Ok(passes_timed(each))
}

/// Latency percentiles of one-block transfers.
#[derive(Clone, Debug)]
pub struct Latency {
    /// `tcp`, `ucx`, `inproc`, `ucx_perftest`, or `lifecycle` for the hook.
    pub transport: String,
    /// `write`, `put_lat`, ...
    pub op: String,
    /// Samples.
    pub samples: usize,
    /// Median, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// A remark printed with the row.
    pub note: String,
}

/// Everything one run measured.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Region size per side, bytes.
    pub region_bytes: usize,
    /// Bytes per timed point.
    pub total_bytes: usize,
    /// Timed passes over the region per point.
    pub passes: usize,
    /// Throughput points, in the order measured.
    pub points: Vec<Point>,
    /// Latency rows.
    pub latency: Vec<Latency>,
    /// Hook for the full request lifecycle latency through the request actors (filled by
    /// a later bench stage; printed when present).
    pub lifecycle: Option<Latency>,
    /// Remarks: fallbacks, skipped references, the machine.
    pub notes: Vec<String>,
    /// The reference rows' transport name (`memcpy`, or `cuda_memcpy` for device
    /// memory): the ratio column divides by it.
    pub reference: String,
}

/// Runs `handoff bench` (or, with the hidden `--peer`, the peer process it starts).
pub async fn run(args: BenchArgs) -> ExitCode {
    if let Some(spec) = &args.peer {
        return match peer_main(spec).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                println!("{PEER_PREFIX}error {e}");
                ExitCode::FAILURE
            }
        };
    }
    match measure(&args).await {
        Ok(report) => {
            print!("{}", report.table());
            if let Some(path) = &args.json {
                if let Err(e) = std::fs::write(path, report.to_json()) {
                    eprintln!("handoff bench: cannot write {}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
            }
            if let Some(path) = &args.plot {
                if let Err(e) = std::fs::write(path, report.chart()) {
                    eprintln!("handoff bench: cannot write {}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
                eprintln!("handoff bench: plot written to {}", path.display());
            }
            let failed = report.points.iter().any(|p| p.verified == Some(false));
            if failed {
                eprintln!("handoff bench: a checksum did not match");
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("handoff bench: {e}");
            ExitCode::from(2)
        }
    }
}

/// Shape of one run.
#[derive(Clone)]
struct Plan {
    region_bytes: usize,
    total_bytes: usize,
    /// Timed passes per point, at least.
    passes_min: usize,
    latency_iters: usize,
    seed: u64,
    /// Where this process's regions live.
    memory: BenchMemory,
    /// Where the peer's regions live.
    peer_memory: BenchMemory,
    cuda_device: u32,
    /// Block sizes measured.
    block_sizes: Vec<usize>,
    /// `--layers`: ranges of the layered regions (2 × layers), when asked for.
    layered_ranges: Option<usize>,
    /// Whether UCX host regions are heap memory registered by address.
    registered: bool,
    /// `--lease-cost`: UCX writes also measured without the lease.
    lease_cost: bool,
    /// How the TCP rows' client and server spin (`--tcp-busy-poll-us`, else the default).
    tcp_busy_poll: BusyPoll,
}

impl Plan {
    /// Whether UCX transfers here are same-host copies, as the runtime makes them with a
    /// peer on its host whose memory is registered by address (an engine's tensors), unless
    /// `HANDOFF_SAME_HOST_COPIES=0`. Memory UCX allocated is reached by UCX itself, which
    /// maps it through shared memory.
    fn same_host(&self) -> bool {
        !self.uses_cuda() && self.registered && handoff_net::same_host_copies_enabled()
    }

    /// Whether UCX transfers here are device copies through the peer's CUDA IPC handles,
    /// as the runtime makes them between device memory with a verified peer on its host,
    /// unless `HANDOFF_SAME_HOST_COPIES=0`.
    fn cuda_ipc(&self) -> bool {
        self.memory == BenchMemory::Cuda
            && self.peer_memory == BenchMemory::Cuda
            && handoff_net::same_host_copies_enabled()
    }

    fn uses_cuda(&self) -> bool {
        self.memory == BenchMemory::Cuda || self.peer_memory == BenchMemory::Cuda
    }
}

/// Measures every point `args` asks for.
pub async fn measure(args: &BenchArgs) -> Result<Report, String> {
    let (region_bytes, total_bytes, latency_iters) = if args.quick {
        (64 << 20, 256 << 20, 200)
    } else {
        (
            args.region_mib << 20,
            args.total_mib << 20,
            args.latency_iters,
        )
    };
    if args.repeat == 0 || args.repeat > PASSES_MAX {
        return Err(format!("--repeat must be 1..={PASSES_MAX}"));
    }
    let plan = Plan {
        region_bytes,
        total_bytes,
        passes_min: args.repeat,
        latency_iters,
        seed: args.seed,
        memory: args.memory,
        peer_memory: args.peer_memory.unwrap_or(args.memory),
        cuda_device: args.cuda_device,
        block_sizes: Vec::new(),
        layered_ranges: None,
        registered: match args.host_memory {
            Some(memory) => memory == HostMemory::Registered,
            None => {
                args.memory == BenchMemory::Host
                    && args.peer_memory.unwrap_or(args.memory) == BenchMemory::Host
            }
        },
        lease_cost: args.lease_cost,
        tcp_busy_poll: BusyPoll::from_micros(args.tcp_busy_poll_us),
    };
    let mut plan = plan;
    if let Some(layers) = args.layers {
        if layers == 0 || layers > LAYERS_MAX {
            return Err(format!("--layers must be 1..={LAYERS_MAX}"));
        }
        if plan.uses_cuda() {
            return Err("--layers runs with host memory only (run without --memory cuda)".into());
        }
        plan.layered_ranges = Some(2 * layers as usize);
    }
    plan.block_sizes = if args.block_kib.is_empty() {
        let mut sizes = BLOCK_SIZES.to_vec();
        if let Some(ranges) = plan.layered_ranges {
            // Segments of 128 KiB and 512 KiB, where the region holds a few such blocks.
            for segment in [128 << 10, 512 << 10] {
                let block = ranges * segment;
                if block * LAYERED_BLOCKS_MIN <= plan.region_bytes && !sizes.contains(&block) {
                    sizes.push(block);
                }
            }
        }
        sizes
    } else {
        args.block_kib.iter().map(|k| k << 10).collect()
    };
    if let Some(&bad) = plan.block_sizes.iter().find(|&&b| {
        b == 0 || b > plan.region_bytes || plan.layered_ranges.is_some_and(|r| b % r != 0)
    }) {
        return Err(format!(
            "block size {bad} bytes: must be positive, at most the region, and divisible into the layered ranges"
        ));
    }
    if plan.region_bytes < BLOCK_SIZES[3] || plan.total_bytes == 0 || plan.latency_iters == 0 {
        return Err(format!(
            "--region-mib must be at least {} and the counts positive",
            BLOCK_SIZES[3] >> 20
        ));
    }
    let mut report = Report {
        region_bytes: plan.region_bytes,
        total_bytes: passes(&plan) * plan.region_bytes,
        passes: passes(&plan),
        reference: if plan.uses_cuda() {
            "cuda_memcpy"
        } else {
            "memcpy"
        }
        .into(),
        ..Report::default()
    };
    report.notes.push(format!(
        "{} CPU cores; machine shared with other work: numbers are noisy",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    let transports = if plan.uses_cuda() {
        cuda_transports(&args.transport, &plan, &mut report)?
    } else {
        resolve_transports(&args.transport, &mut report)?
    };
    // A progress line on a terminal: one step per block size and transport.
    let steps = plan.block_sizes.len() * transports.len();
    let mut progress = handoff_sim::chart::Progress::new("bench", steps as u64, "points");
    for (n, &block) in plan.block_sizes.iter().enumerate() {
        progress.set((n * transports.len()) as u64);
        report.points.push(if plan.uses_cuda() {
            cuda_memcpy_point(&plan, block)?
        } else {
            memcpy_point(&plan, block, 1)?
        });
        if let (Some(ranges), false) = (plan.layered_ranges, plan.uses_cuda()) {
            let mut points = vec![memcpy_point(&plan, block, ranges)?];
            with_one_range_ratios_against(&mut points, report.points.last());
            report.points.extend(points);
        }
        if transports.contains(&BenchTransport::Tcp) {
            report.points.push(tcp_stream_point(&plan, block)?);
        }
        for (k, &t) in transports.iter().enumerate() {
            let layered = plan.layered_ranges.filter(|_| t == BenchTransport::Ucx);
            report
                .points
                .extend(transport_points(t, &plan, block, layered).await?);
            progress.set((n * transports.len() + k + 1) as u64);
        }
    }
    progress.finish();
    if transports.contains(&BenchTransport::Ucx) {
        report.notes.push(if plan.cuda_ipc() {
            format!("ucx rows between device memory are device copies through the peer's CUDA IPC handles (cuMemcpyAsync, bounds from the driver), as the runtime makes them with a verified peer on its host; {}=0 measures UCX's own operations (cuda_ipc)", handoff_net::SAME_HOST_ENV)
        } else if plan.same_host() {
            format!("ucx rows between registered host memory are same-host copies (kernel cross-memory attach, process_vm_readv/writev; one copy split over up to {} threads, one per whole MiB, at most this host's cores), as the runtime makes them with a verified peer on its host whose memory is registered; {}=0 measures UCX's own operations", handoff_transport::same_host::LANES_MAX, handoff_net::SAME_HOST_ENV)
        } else if plan.uses_cuda() || !handoff_net::same_host_copies_enabled() {
            "ucx rows are UCX operations (same-host copies off, or device memory)".into()
        } else {
            "ucx rows are UCX operations: memory UCX allocated, which the peer's UCX maps through shared memory (--host-memory allocated; the runtime makes same-host copies only with registered memory, an engine's)".into()
        });
    }
    if plan.registered {
        report.notes.push(
            "UCX host regions are heap memory registered by address, range by range, as an engine's tensors (--host-memory registered, the default between host memory). Without same-host copies, UCX (1.13 through 1.2x) has no cma lane for RMA under peer-failure handling, so it emulates RMA into them with active messages over shared memory that the peer's UCX thread serves".into(),
        );
    }
    if let Some(ranges) = plan.layered_ranges {
        report.notes.push(format!(
            "layered rows: each side's region is {} layers x K and V = {ranges} ranges (UCX: one registration and remote key per range), so a block is {ranges} segments; 'vs 1-range' is the ratio to the one-range row of the same transport and op (same run, same bytes and permutation; UCX's measured in turns, pass by pass); memcpy over {ranges} ranges is the same copy pattern without a transport: what scattered segments cost the memory system alone",
            ranges / 2
        ));
        if transports.iter().any(|&t| t != BenchTransport::Ucx) {
            report
                .notes
                .push("layered rows are measured for UCX only".into());
        }
    }
    // The lifecycle and perftest references run in host memory only.
    let network = transports.iter().find_map(|t| match t {
        _ if plan.uses_cuda() => None,
        BenchTransport::Ucx => Some(crate::lifecycle::Plane::Ucx {
            registered: plan.registered,
        }),
        BenchTransport::Tcp => Some(crate::lifecycle::Plane::Tcp),
        _ => None,
    });
    if let Some(plane) = network {
        let floor = crate::lifecycle::loopback_rtt(plan.latency_iters).await?;
        let floor = percentiles("loopback", "rtt", &floor, String::new());
        let woken = crate::lifecycle::loopback_rtt_across_threads(plan.latency_iters).await?;
        let woken = percentiles("loopback", "rtt-woken", &woken, String::new());
        use crate::lifecycle::Caller;
        let measured = crate::lifecycle::measure(
            plane,
            16 << 10,
            plan.latency_iters,
            None,
            Some(IDLE_WINDOW),
            Caller::Thread,
            true,
        )
        .await?;
        // The woken round trip once before each request: the floor under the same
        // conditions as the requests (the rows above are measured before them, and this
        // machine's wake-ups drift several-fold within seconds).
        let between = percentiles(
            "loopback",
            "rtt-woken-between",
            &measured.woken,
            "the woken round trip again, one before each lifecycle request: the floor under the same conditions as the requests".into(),
        );
        let mut lifecycle =
            percentiles("lifecycle", plane.name(), &measured.samples, String::new());
        if let Some(share) = measured.idle_core_share {
            report.notes.push(format!(
                "idle: a connected prefill and decode runtime ({}) left idle for {:?} cost this process {:.2}% of one core",
                plane.name(),
                IDLE_WINDOW,
                share * 100.0
            ));
        }
        // The same, every connection authenticated (Noise sessions), in the same run.
        let key = handoff_bootstrap::Key::new(b"handoff bench secret, 32 bytes..")
            .map_err(|e| e.to_string())?;
        let iters = plan.latency_iters;
        let (mut keyed, _) = lifecycle_row(
            "lifecycle+secret",
            plane,
            iters,
            Some(&key),
            Caller::Thread,
            false,
        )
        .await?;
        keyed.note = format!(
            "the same requests with a shared secret (every connection a Noise session): p50 {:.2}x, p99 {:.2}x without",
            keyed.p50_us / lifecycle.p50_us.max(f64::MIN_POSITIVE),
            keyed.p99_us / lifecycle.p99_us.max(f64::MIN_POSITIVE)
        );
        let paired = |q: f64| quantile(&measured.paired, q);
        lifecycle.note = format!(
            "one 16 KiB request{}: open both sides, transfer info, write, Done (peers cached); p50 {:.2}x the round trip that wakes its peer measured between the requests ({:.2}x the one measured before them), {:.2}x the one between two tasks; each request over the round trip timed just before it: median {:.2}x (middle half {:.2}-{:.2}x)",
            plane.memory(),
            lifecycle.p50_us / between.p50_us.max(f64::MIN_POSITIVE),
            lifecycle.p50_us / woken.p50_us.max(f64::MIN_POSITIVE),
            lifecycle.p50_us / floor.p50_us.max(f64::MIN_POSITIVE),
            paired(0.5),
            paired(0.25),
            paired(0.75),
        );
        report.latency.push(Latency {
            note: "64 B TCP ping-pong between two tasks of this process (when both run on one worker, no thread is woken)".into(),
            ..floor
        });
        report.latency.push(Latency {
            note: "the same with the echo on a thread of its own, asleep until each ping: the two wake-ups every request's transfer info and Done pay".into(),
            ..woken
        });
        report.latency.push(between);
        report.latency.push(keyed);
        // The same requests opened and awaited from a task of the runtime: the runtime's own
        // path, without the two wake-ups of a caller outside it.
        let (mut tasked, _) =
            lifecycle_row("lifecycle+task", plane, iters, None, Caller::Task, false).await?;
        tasked.note = format!(
            "the same requests opened and awaited from a task of the runtime, not this thread: p50 {:.2}x the lifecycle line's, whose rest is the wake-ups of a worker by the calls and of the calling thread by the end",
            tasked.p50_us / lifecycle.p50_us.max(f64::MIN_POSITIVE)
        );
        report.latency.push(tasked);
        // Over registered memory (an engine's tensors) the write is a same-host copy on
        // the request's own worker; over memory UCX allocated (`handoff worker`'s pool) it is
        // a job for the UCX thread. Both, in the same run.
        if let crate::lifecycle::Plane::Ucx { registered: true } = plane {
            let pool = crate::lifecycle::Plane::Ucx { registered: false };
            let (mut row, paired) =
                lifecycle_row("lifecycle+pool", pool, iters, None, Caller::Thread, true).await?;
            row.note = format!(
                "the same requests over memory UCX allocated (handoff worker's pool), each write a job for the UCX thread: p50 {:.2}x the lifecycle line's; each request over the round trip timed just before it: median {:.2}x (middle half {:.2}-{:.2}x)",
                row.p50_us / lifecycle.p50_us.max(f64::MIN_POSITIVE),
                quantile(&paired, 0.5),
                quantile(&paired, 0.25),
                quantile(&paired, 0.75),
            );
            report.latency.push(row);
        }
        report.lifecycle = Some(lifecycle);
    }
    // One-block latency of each transport, after the lifecycle rows: measured before them,
    // it slowed the lifecycle measured next in the same process (by a fifth, in medians
    // of eight runs), though no lifecycle transfer spins; measured after, each row is
    // what it was measured alone.
    for &t in &transports {
        // Awaited in a task of the runtime, as the runtime's sender awaits its transfers (a
        // thread blocked on the runtime pays one more wake-up per call: the lifecycle+task
        // row shows what that costs).
        let plan = plan.clone();
        let row = tokio::spawn(async move { latency(t, &plan).await })
            .await
            .map_err(|e| format!("{} latency: {e}", t.name()))??;
        report.latency.push(row);
    }
    if plan.uses_cuda() {
        report.notes.push(
            "device memory: the lifecycle latency and ucx_perftest rows run with host memory only (run without --memory cuda)"
                .into(),
        );
    } else if !args.no_perftest {
        perftest_points(&plan, &mut report).await;
    }
    Ok(report)
}

/// The transports `--memory cuda` can use (UCX alone: the others copy through the CPU),
/// after checking that there is a GPU and that UCX can register its memory.
fn cuda_transports(
    asked: &[BenchTransport],
    plan: &Plan,
    report: &mut Report,
) -> Result<Vec<BenchTransport>, String> {
    if let Some(t) = asked
        .iter()
        .find(|t| matches!(t, BenchTransport::Tcp | BenchTransport::Inproc))
    {
        return Err(format!(
            "--memory cuda moves device memory with UCX only; --transport {} copies through the CPU",
            t.name()
        ));
    }
    let info = handoff_gpu::probe().map_err(|e| match e {
        GpuError::NoDriver { .. } | GpuError::NoDevice => {
            format!("--memory cuda needs a GPU: {e}")
        }
        other => format!("--memory cuda: {other}"),
    })?;
    let device = info
        .devices
        .iter()
        .find(|d| d.ordinal == plan.cuda_device)
        .ok_or_else(|| {
            format!(
                "--cuda-device {}: {} device(s) visible",
                plan.cuda_device,
                info.devices.len()
            )
        })?;
    report.notes.push(format!(
        "device {}: {} ({} GiB), driver {}; this process {}, peer {}",
        device.ordinal,
        device.name,
        device.total_memory_bytes >> 30,
        info.driver_version,
        plan.memory.name(),
        plan.peer_memory.name()
    ));
    // A one-block plane on the device: fails here, with UCX's reason, where the loaded
    // UCX has no CUDA support.
    let probe_plane = bench_plane(
        plan.memory,
        plan.peer_memory,
        plan.cuda_device,
        1,
        4096,
        1,
        false,
    )
    .map_err(|e| format!("--memory cuda: UCX cannot use device memory here: {e}"))?;
    report.notes.push(probe_plane.version().to_string());
    Ok(vec![BenchTransport::Ucx])
}

/// A UCX plane of `blocks × block` bytes in `memory`, its thread bound to `device` when
/// either side's memory is CUDA.
// One argument per thing a bench process chooses about its plane.
#[allow(clippy::too_many_arguments)]
fn bench_plane(
    memory: BenchMemory,
    other: BenchMemory,
    device: u32,
    blocks: u32,
    block: usize,
    ranges: usize,
    registered: bool,
) -> Result<UcxDataPlane, String> {
    let me = RankInfo::single("bench");
    let mut options = UcxPlaneOptions::default();
    if other == BenchMemory::Cuda {
        options.cuda_device = Some(device);
    }
    match memory {
        BenchMemory::Host if registered => {
            let region = host_region(Region::alloc(layered_layout(blocks, block, ranges)))?;
            UcxDataPlane::start_on_region(Arc::new(region), &me, options)
        }
        BenchMemory::Host if ranges > 1 => {
            UcxDataPlane::start_allocated(blocks, &vec![block / ranges; ranges], &me, options)
        }
        BenchMemory::Host => UcxDataPlane::start(blocks, block, &me, options),
        BenchMemory::Cuda => {
            let buffer = DeviceBuffer::alloc_zeroed(device, blocks as usize * block)
                .map_err(|e| format!("device allocation: {e}"))?;
            UcxDataPlane::start_on_device(Arc::new(buffer), blocks, block, &me, options)
        }
    }
    .map_err(|e| e.to_string())
}

fn resolve_transports(
    asked: &[BenchTransport],
    report: &mut Report,
) -> Result<Vec<BenchTransport>, String> {
    let mut out = Vec::new();
    for &t in asked {
        let t = match t {
            BenchTransport::Auto => match UcxDataPlane::start(
                1,
                4096,
                &RankInfo::single("probe"),
                UcxPlaneOptions::default(),
            ) {
                Ok(_) => BenchTransport::Ucx,
                Err(e) if e.is_ucx_unavailable() => {
                    tracing::warn!(error = %e, "UCX unavailable; --transport auto uses TCP");
                    report
                        .notes
                        .push(format!("auto: UCX unavailable ({e}); using TCP"));
                    BenchTransport::Tcp
                }
                Err(e) => return Err(format!("UCX failed to start: {e}")),
            },
            BenchTransport::Ucx => {
                if let Err(e) = UcxDataPlane::start(
                    1,
                    4096,
                    &RankInfo::single("probe"),
                    UcxPlaneOptions::default(),
                ) {
                    return Err(format!("--transport ucx: {e}"));
                }
                BenchTransport::Ucx
            }
            other => other,
        };
        if !out.contains(&t) {
            out.push(t);
        }
    }
    Ok(out)
}

// ------------------------------------------------------------------ patterns, checks

/// splitmix64 permutation of `0..n` (Fisher-Yates), seeded.
fn permutation(seed: u64, n: u32) -> Vec<BlockId> {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut p: Vec<BlockId> = (0..n).map(BlockId).collect();
    for i in (1..p.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

fn fill(region: &Region, seed: u64) -> Result<(), String> {
    let mut buf = vec![0u8; region.block_bytes()];
    for b in 0..region.blocks() {
        fill_pattern(&mut buf, seed, u64::from(b) * region.block_bytes() as u64);
        region
            .write_block(BlockId(b), &buf)
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn checksum(region: &Region, blocks: &[BlockId]) -> Result<u64, String> {
    let mut sum = Checksum64::new();
    for b in blocks {
        sum.update(&region.read_block(*b).map_err(|e| e.to_string())?);
    }
    Ok(sum.finish())
}

fn all(n: u32) -> Vec<BlockId> {
    (0..n).map(BlockId).collect()
}

/// Timed passes over the region after the warm-up: enough to move `total_bytes`, and at
/// least `--repeat`.
fn passes(plan: &Plan) -> usize {
    plan.total_bytes
        .div_ceil(plan.region_bytes)
        .max(plan.passes_min)
        .max(1)
}

/// A host region for a bench point, backed by huge pages where the kernel has them, as a
/// worker's pool is ([`Region::advise_huge_pages`]): the memcpy reference and every
/// transport measure the same kind of memory (the lifecycle's registered pool as well).
pub(crate) fn host_region(
    region: Result<Region, handoff_transport::RegionError>,
) -> Result<Region, String> {
    let region = region.map_err(|e| e.to_string())?;
    region.advise_huge_pages();
    Ok(region)
}

fn blocks_of(plan: &Plan, block: usize) -> Result<u32, String> {
    u32::try_from(plan.region_bytes / block).map_err(|_| "region has too many blocks".to_string())
}

// ------------------------------------------------------------------ memcpy reference

/// `blocks` blocks of `block` bytes in `ranges` ranges of `block / ranges` bytes each, one
/// run of blocks per range (as separate per-layer tensors), at offsets for
/// `Region::alloc`; one range is contiguous blocks.
fn layered_layout(blocks: u32, block: usize, ranges: usize) -> KvLayout {
    let segment = block / ranges.max(1);
    KvLayout {
        blocks,
        ranges: (0..ranges.max(1))
            .map(|i| KvRange {
                addr: (i * blocks as usize * segment) as u64,
                stride: segment,
                bytes: segment,
            })
            .collect(),
        memory: KvMemory::Host,
        layers: LayerSpan::WHOLE,
        block_tokens: 0,
        dtype_bytes: 0,
        heads: None,
    }
}

/// Single-thread `memcpy` of the permutation between two host regions of this process,
/// each laid out in `ranges` ranges (1: contiguous blocks; more: one run of blocks per
/// range, as separate per-layer tensors, so a block is `ranges` copies).
fn memcpy_point(plan: &Plan, block: usize, ranges: usize) -> Result<Point, String> {
    let n = blocks_of(plan, block)?;
    let region = || host_region(Region::alloc(layered_layout(n, block, ranges)));
    let (src, dst) = (region()?, region()?);
    fill(&src, plan.seed)?;
    let from = all(n);
    let to = permutation(plan.seed ^ block as u64, n);
    src.check_host("memcpy").map_err(|e| e.to_string())?;
    dst.check_host("memcpy").map_err(|e| e.to_string())?;
    let (src_ranges, dst_ranges) = (src.layout().ranges.clone(), dst.layout().ranges.clone());
    let copy = || {
        for (s, d) in from.iter().zip(&to) {
            for (a, b) in src_ranges.iter().zip(&dst_ranges) {
                let s = a.addr as usize + s.0 as usize * a.stride;
                let d = b.addr as usize + d.0 as usize * b.stride;
                // SAFETY: both are block starts inside host ranges of `n` blocks of
                // `bytes` (the regions' own layouts); the two regions are distinct
                // allocations only this function touches.
                unsafe { std::ptr::copy_nonoverlapping(s as *const u8, d as *mut u8, a.bytes) };
            }
        }
    };
    copy();
    let (pass_secs, secs) = time_passes(passes(plan), || {
        copy();
        Ok::<(), String>(())
    })?;
    let verified = checksum(&src, &from)? == checksum(&dst, &to)?;
    Ok(Point {
        transport: "memcpy".into(),
        op: "copy".into(),
        block_bytes: block,
        bytes: (passes(plan) * n as usize * block) as u64,
        secs,
        pass_secs,
        verified: Some(verified),
        ranges,
        vs_one_range: None,
        note: "single thread, same permutation".into(),
    })
}

/// The transport name of the TCP reference rows ([`tcp_stream_point`]).
const TCP_STREAM: &str = "tcp_stream";

/// The TCP reference: the same permutation's bytes through one loopback connection
/// between two threads of this process, a block per `write`/`read` call, with no framing,
/// grants, pool or pipelining: raw TCP on this host, each byte copied into the socket and
/// out of it. A `tcp` row at or above it says the protocol costs nothing measurable (it
/// also sends many blocks per call, vectored, which raw block-size calls do not).
fn tcp_stream_point(plan: &Plan, block: usize) -> Result<Point, String> {
    use std::io::{Read, Write};
    let n = blocks_of(plan, block)?;
    let (src, dst) = (
        host_region(Region::new(n, block))?,
        host_region(Region::new(n, block))?,
    );
    fill(&src, plan.seed)?;
    let from = all(n);
    let to = permutation(plan.seed ^ block as u64, n);
    let at = |region: &Region, b: BlockId| -> Result<usize, String> {
        Ok(region.host_ptr().map_err(|e| e.to_string())? as usize + b.0 as usize * block)
    };
    let (src_at, dst_at) = (
        from.iter()
            .map(|&b| at(&src, b))
            .collect::<Result<Vec<_>, _>>()?,
        to.iter()
            .map(|&b| at(&dst, b))
            .collect::<Result<Vec<_>, _>>()?,
    );
    let io = |e: std::io::Error| format!("{TCP_STREAM} at {} KiB blocks: {e}", block >> 10);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(io)?;
    let mut tx = std::net::TcpStream::connect(listener.local_addr().map_err(io)?).map_err(io)?;
    let (mut rx, _) = listener.accept().map_err(io)?;
    for s in [&tx, &rx] {
        s.set_nodelay(true).map_err(io)?;
        // A wedged pass fails the point by name instead of hanging the bench.
        s.set_read_timeout(Some(CALL_TIMEOUT)).map_err(io)?;
        s.set_write_timeout(Some(CALL_TIMEOUT)).map_err(io)?;
    }
    let mut pass = || -> Result<(), String> {
        std::thread::scope(|scope| {
            let (tx, src_at) = (&mut tx, &src_at);
            let writer = scope.spawn(move || {
                for &a in src_at {
                    // SAFETY: a block start inside `src`, a host region of `n` blocks of
                    // `block` bytes that only this function touches; nothing writes it now.
                    let bytes = unsafe { std::slice::from_raw_parts(a as *const u8, block) };
                    tx.write_all(bytes)?;
                }
                Ok::<(), std::io::Error>(())
            });
            for &a in &dst_at {
                // SAFETY: a block start inside `dst`, as above; only this thread touches
                // `dst` during the pass, and the permutation names each block once.
                let bytes = unsafe { std::slice::from_raw_parts_mut(a as *mut u8, block) };
                rx.read_exact(bytes).map_err(io)?;
            }
            writer
                .join()
                .map_err(|_| format!("{TCP_STREAM}: the writer thread panicked"))?
                .map_err(io)
        })
    };
    pass()?;
    let (pass_secs, secs) = time_passes(passes(plan), &mut pass)?;
    let verified = checksum(&src, &from)? == checksum(&dst, &to)?;
    Ok(Point {
        transport: TCP_STREAM.into(),
        op: "stream".into(),
        block_bytes: block,
        bytes: (passes(plan) * n as usize * block) as u64,
        secs,
        pass_secs,
        verified: Some(verified),
        ranges: 1,
        vs_one_range: None,
        note: "raw TCP: one loopback connection, two threads, a block per call, no protocol".into(),
    })
}

/// The device reference: the same permutation as [`memcpy_point`], one
/// `cuMemcpyDtoDAsync` per block between two device buffers, each pass one stream's
/// work waited for at its end.
fn cuda_memcpy_point(plan: &Plan, block: usize) -> Result<Point, String> {
    let n = blocks_of(plan, block)?;
    let alloc = || {
        DeviceBuffer::alloc_zeroed(plan.cuda_device, n as usize * block)
            .map(Arc::new)
            .map_err(|e| format!("device allocation: {e}"))
    };
    let (src, dst) = (alloc()?, alloc()?);
    let on_device = |buffer: &Arc<DeviceBuffer>| {
        Region::on_device(Arc::clone(buffer), n, block).map_err(|e| e.to_string())
    };
    let (src_region, dst_region) = (on_device(&src)?, on_device(&dst)?);
    fill(&src_region, plan.seed)?;
    let from = all(n);
    let to = permutation(plan.seed ^ block as u64, n);
    let pairs: Vec<(u64, u64)> = from
        .iter()
        .zip(&to)
        .map(|(s, d)| (u64::from(s.0) * block as u64, u64::from(d.0) * block as u64))
        .collect();
    let copy = || {
        src.copy_to(&dst, &pairs, block as u64)
            .map_err(|e| format!("cuda_memcpy at {} KiB blocks: {e}", block >> 10))
    };
    copy()?;
    let (pass_secs, secs) = time_passes(passes(plan), copy)?;
    let verified = checksum(&src_region, &from)? == checksum(&dst_region, &to)?;
    Ok(Point {
        transport: "cuda_memcpy".into(),
        op: "dtod".into(),
        block_bytes: block,
        bytes: (passes(plan) * n as usize * block) as u64,
        secs,
        pass_secs,
        verified: Some(verified),
        ranges: 1,
        vs_one_range: None,
        note: "cuMemcpyDtoDAsync per block, one stream, same permutation".into(),
    })
}

// ------------------------------------------------------------------ transports

/// The two sides of one transport at one block size.
// One per measured point: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Link {
    Inproc {
        local: Arc<Region>,
        remote: Arc<Region>,
    },
    Tcp {
        local: Arc<Region>,
        client: DataClient,
        peer: PeerProcess,
    },
    Ucx {
        plane: UcxDataPlane,
        remote: UcxPeer,
        peer: PeerProcess,
        /// Writes are fenced by a lease, as the runtime's are (it holds for the whole run:
        /// what is measured is the check before every put); `None` for `--lease-cost`'s
        /// unleased reference.
        lease: Option<Arc<Lease>>,
    },
}

impl Link {
    async fn open(
        t: BenchTransport,
        plan: &Plan,
        blocks: u32,
        block: usize,
        ranges: usize,
    ) -> Result<Link, String> {
        let me = RankInfo::single("bench");
        match t {
            BenchTransport::Inproc => Ok(Link::Inproc {
                local: Arc::new(host_region(Region::new(blocks, block))?),
                remote: Arc::new(host_region(Region::new(blocks, block))?),
            }),
            BenchTransport::Tcp => {
                let busy_poll = plan.tcp_busy_poll;
                let spec = format!("tcp:{blocks}:{block}:{}", busy_poll.server.as_micros());
                let mut peer = PeerProcess::spawn(&spec).await?;
                let ready = peer.expect().await?;
                let addr = ready
                    .strip_prefix("ready tcp ")
                    .ok_or_else(|| format!("peer said {ready:?}"))?;
                let client =
                    DataClient::connect_with(addr, me, None, PEER_STEP_TIMEOUT, busy_poll.client)
                        .await
                        .map_err(|e| e.to_string())?;
                let local = Arc::new(host_region(Region::new(blocks, block))?);
                Ok(Link::Tcp {
                    local,
                    client,
                    peer,
                })
            }
            BenchTransport::Ucx | BenchTransport::Auto => {
                let spec = format!(
                    "ucx:{blocks}:{block}:{}:{}:{}:{ranges}:{}",
                    plan.peer_memory.name(),
                    plan.memory.name(),
                    plan.cuda_device,
                    u8::from(plan.registered)
                );
                let mut peer = PeerProcess::spawn(&spec).await?;
                let ready = peer.expect().await?;
                let mut remote = parse_ucx_ready(&ready)?;
                if plan.peer_memory == BenchMemory::Cuda {
                    remote.device = Some(plan.cuda_device);
                }
                if plan.same_host() || plan.cuda_ipc() {
                    // The runtime verifies its peer by the control connection; the bench
                    // started this one itself.
                    let pid = peer.child.id().ok_or("the peer process has exited")?;
                    let process = handoff_transport::same_host::PeerProcess::vouched(pid)
                        .map_err(|e| e.to_string())?;
                    remote = remote.with_process(Some(Arc::new(process)));
                }
                let plane = bench_plane(
                    plan.memory,
                    plan.peer_memory,
                    plan.cuda_device,
                    blocks,
                    block,
                    ranges,
                    plan.registered,
                )?;
                let lease = Arc::new(Lease::new());
                lease.extend_to(Instant::now() + Duration::from_secs(24 * 3600));
                Ok(Link::Ucx {
                    plane,
                    remote,
                    peer,
                    lease: Some(lease),
                })
            }
        }
    }

    fn local(&self) -> &Region {
        match self {
            Link::Inproc { local, .. } | Link::Tcp { local, .. } => local,
            Link::Ucx { plane, .. } => plane.region(),
        }
    }

    /// Push our `src` into the peer's `dst`.
    async fn write(
        &self,
        src: &[BlockId],
        dst: &[BlockId],
        deadline: Instant,
    ) -> Result<(), DataError> {
        let request = RequestId::new("bench");
        match self {
            Link::Inproc { local, remote } => Ok(Region::copy_blocks(local, src, remote, dst)?),
            Link::Tcp { local, client, .. } => {
                client.write(&request, local, src, dst, deadline).await
            }
            Link::Ucx {
                plane,
                remote,
                lease: Some(lease),
                ..
            } => {
                plane
                    .write_leased(&request, remote, src, dst, &[], deadline, lease.clone())
                    .await
            }
            Link::Ucx {
                plane,
                remote,
                lease: None,
                ..
            } => plane.write(&request, remote, src, dst, deadline).await,
        }
    }

    /// Pull the peer's `src` into our `dst`.
    async fn read(
        &self,
        src: &[BlockId],
        dst: &[BlockId],
        deadline: Instant,
    ) -> Result<(), DataError> {
        let request = RequestId::new("bench");
        match self {
            Link::Inproc { local, remote } => Ok(Region::copy_blocks(remote, src, local, dst)?),
            Link::Tcp { local, client, .. } => {
                client.read(&request, local, src, dst, deadline).await
            }
            Link::Ucx { plane, remote, .. } => {
                plane.read(&request, remote, src, dst, deadline).await
            }
        }
    }

    /// The peer's checksum of its blocks `permutation(seed, n)`, in that order.
    async fn remote_checksum(&mut self, seed: u64, n: u32) -> Result<u64, String> {
        match self {
            Link::Inproc { remote, .. } => checksum(remote, &permutation(seed, n)),
            Link::Tcp { peer, .. } | Link::Ucx { peer, .. } => {
                let answer = peer.ask(&format!("checksum {seed} {n}")).await?;
                answer
                    .strip_prefix("checksum ")
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| format!("peer said {answer:?}"))
            }
        }
    }

    async fn remote_fill(&mut self, seed: u64) -> Result<(), String> {
        match self {
            Link::Inproc { remote, .. } => fill(remote, seed),
            Link::Tcp { peer, .. } | Link::Ucx { peer, .. } => {
                match peer.ask(&format!("fill {seed}")).await?.as_str() {
                    "filled" => Ok(()),
                    other => Err(format!("peer said {other:?}")),
                }
            }
        }
    }

    async fn close(self) {
        match self {
            Link::Inproc { .. } => {}
            Link::Tcp { peer, client, .. } => {
                drop(client);
                peer.exit().await;
            }
            Link::Ucx { peer, plane, .. } => {
                drop(plane);
                peer.exit().await;
            }
        }
    }
}

/// The peer's `ready ucx <worker address> <blocks> <block bytes> <range>...` line, each
/// range `<rkey>:<addr>:<len>:<stride>:<bytes>:<cuda ipc>` (hex, the last empty for none; see
/// [`ucx_ready_line`]).
fn parse_ucx_ready(ready: &str) -> Result<UcxPeer, String> {
    let words: Vec<&str> = ready.split_whitespace().collect();
    let ["ready", "ucx", address, blocks, block, ranges @ ..] = words.as_slice() else {
        return Err(format!("peer said {ready:?}"));
    };
    let bad = |what: &str| format!("peer sent a bad {what}");
    let blocks: u64 = blocks.parse().map_err(|_| bad("block count"))?;
    let block: u64 = block.parse().map_err(|_| bad("block size"))?;
    let mut list = Vec::with_capacity(ranges.len());
    for range in ranges {
        let fields: Vec<&str> = range.split(':').collect();
        let [rkey, addr, len, stride, bytes, ipc] = fields.as_slice() else {
            return Err(bad("range"));
        };
        let num = |v: &str| v.parse::<u64>().map_err(|_| bad("range"));
        list.push(UcxRange {
            remote_key: unhex(rkey).ok_or_else(|| bad("rkey"))?,
            addr: num(addr)?,
            len: num(len)?,
            stride: num(stride)?,
            bytes: num(bytes)?,
            cuda_ipc: unhex(ipc).ok_or_else(|| bad("CUDA IPC descriptor"))?,
        });
    }
    Ok(UcxPeer {
        process: None,
        device: None,
        name: "bench-peer".into(),
        worker_address: unhex(address).ok_or_else(|| bad("worker address"))?,
        region: RegionDescriptor {
            transport: TransportKind::Ucx,
            address: "bench-peer".into(),
            remote_key: Vec::new(),
            base: 0,
            len: blocks.saturating_mul(block),
            block_bytes: block,
        },
        ranges: list.into(),
    })
}

/// The line a bench peer prints for its plane: everything [`parse_ucx_ready`] needs.
fn ucx_ready_line(plane: &UcxDataPlane) -> String {
    let d = plane.descriptor();
    let region = plane.region();
    let mut line = format!(
        "ready ucx {} {} {}",
        hex(&d.worker_address),
        region.blocks(),
        region.block_bytes()
    );
    for r in d.range_list() {
        line += &format!(
            " {}:{}:{}:{}:{}:{}",
            hex(&r.remote_key),
            r.addr,
            r.len,
            r.stride,
            r.bytes,
            hex(&r.cuda_ipc)
        );
    }
    line
}

/// One throughput point's setting: which blocks go where, how many passes.
struct Timed<'a> {
    name: &'static str,
    block: usize,
    src: &'a [BlockId],
    perm: &'a [BlockId],
    perm_seed: u64,
    plan: &'a Plan,
}

impl Timed<'_> {
    /// A warm-up pass over each link, then the timed passes, the links taking turns pass
    /// by pass (so a layered region and the one-range region it is compared with see the
    /// same moments of a shared machine), then both sides' checksums compared per link.
    /// A point's time is its median pass's, times the passes: a pass that another process
    /// of this shared machine stalled does not decide the ratio.
    async fn measure(
        &self,
        links: &mut [(usize, Link)],
        write: bool,
    ) -> Result<Vec<Point>, String> {
        let op = if write { "write" } else { "read" };
        let passes = passes(self.plan);
        let mut secs = vec![Vec::with_capacity(passes); links.len()];
        for pass in 0..=passes {
            for (i, (ranges, link)) in links.iter_mut().enumerate() {
                let deadline = Instant::now() + CALL_TIMEOUT;
                let started = Instant::now();
                let result = if write {
                    link.write(self.src, self.perm, deadline).await
                } else {
                    link.read(self.perm, self.src, deadline).await
                };
                result.map_err(|e| {
                    format!(
                        "{} {op} at {} KiB blocks in {ranges} ranges: {e}",
                        self.name,
                        self.block >> 10
                    )
                })?;
                // The first pass is the warm-up.
                if pass > 0 {
                    secs[i].push(started.elapsed().as_secs_f64());
                }
            }
        }
        let n = self.src.len() as u32;
        let mut points = Vec::with_capacity(links.len());
        for ((ranges, link), secs) in links.iter_mut().zip(secs) {
            let (pass_secs, secs) = passes_timed(secs);
            let verified =
                link.remote_checksum(self.perm_seed, n).await? == checksum(link.local(), self.src)?;
            points.push(Point {
                transport: self.name.into(),
                op: op.into(),
                block_bytes: self.block,
                bytes: (passes * n as usize * self.block) as u64,
                secs,
                pass_secs,
                verified: Some(verified),
                ranges: *ranges,
                vs_one_range: None,
                note: String::new(),
            });
        }
        Ok(points)
    }
}

/// Write and read points for one transport at one block size: each side's region in one
/// range, and, with `layered` ranges, the same points over regions of that many ranges,
/// measured in turns with the one-range ones (their ratio in `vs_one_range`).
async fn transport_points(
    t: BenchTransport,
    plan: &Plan,
    block: usize,
    layered: Option<usize>,
) -> Result<Vec<Point>, String> {
    let n = blocks_of(plan, block)?;
    let mut links = vec![(1, Link::open(t, plan, n, block, 1).await?)];
    if let Some(ranges) = layered {
        links.push((ranges, Link::open(t, plan, n, block, ranges).await?));
    }
    // `--lease-cost`: the one-range link again, its writes unfenced, measured in turns.
    let unleased = plan.lease_cost && t == BenchTransport::Ucx;
    if unleased {
        let mut link = Link::open(t, plan, n, block, 1).await?;
        if let Link::Ucx { lease, .. } = &mut link {
            *lease = None;
        }
        links.push((1, link));
    }
    let src = all(n);
    let perm_seed = plan.seed ^ (block as u64).rotate_left(17);
    let perm = permutation(perm_seed, n);
    let timed = Timed {
        name: t.name(),
        block,
        src: &src,
        perm: &perm,
        perm_seed,
        plan,
    };
    // Push: our blocks 0..n into the peer's permuted positions.
    for (_, link) in &links {
        fill(link.local(), plan.seed)?;
    }
    let mut points = timed.measure(&mut links, true).await?;
    // Pull: the peer's permuted positions into our blocks 0..n.
    for (_, link) in &mut links {
        link.remote_fill(plan.seed.wrapping_add(1)).await?;
    }
    points.extend(timed.measure(&mut links, false).await?);
    for (_, link) in links {
        link.close().await;
    }
    if unleased {
        lease_ratios(&mut points);
    }
    with_one_range_ratios(&mut points);
    // One-range rows first, then the layered ones.
    points.sort_by_key(|p| p.ranges);
    Ok(points)
}

/// `--lease-cost`: the points come per operation in link order, the unleased reference
/// last. Notes each leased write's ratio to the unleased one and drops the reference (its
/// number is in the ratio), so the table keeps one row per point.
fn lease_ratios(points: &mut Vec<Point>) {
    let per_op = points.len() / 2;
    if per_op < 2 {
        return;
    }
    let (write, read) = points.split_at(per_op);
    let (leased, unleased) = (&write[0], &write[per_op - 1]);
    let ratio = leased.gbps() / unleased.gbps().max(f64::MIN_POSITIVE);
    let note = format!(
        "leased/unleased {ratio:.3} ({:.2} GB/s without the lease, in turns)",
        unleased.gbps()
    );
    let mut kept: Vec<Point> = write[..per_op - 1].to_vec();
    kept[0].note = note;
    kept.extend_from_slice(&read[..per_op - 1]);
    *points = kept;
}

/// Sets the ratio of layered `points` to `one`, the one-range point they repeat.
fn with_one_range_ratios_against(points: &mut [Point], one: Option<&Point>) {
    let Some(gbps) = one.map(Point::gbps).filter(|&g| g > 0.0) else {
        return;
    };
    for p in points.iter_mut().filter(|p| p.ranges > 1) {
        p.vs_one_range = Some(p.gbps() / gbps);
    }
}

/// Sets every layered point's ratio to the one-range point of the same operation.
fn with_one_range_ratios(points: &mut [Point]) {
    let one: Vec<(String, f64)> = points
        .iter()
        .filter(|p| p.ranges == 1)
        .map(|p| (p.op.clone(), p.gbps()))
        .collect();
    for p in points.iter_mut().filter(|p| p.ranges > 1) {
        p.vs_one_range = one
            .iter()
            .find(|(op, _)| *op == p.op)
            .map(|(_, gbps)| *gbps)
            .filter(|&g| g > 0.0)
            .map(|g| p.gbps() / g);
    }
}

async fn latency(t: BenchTransport, plan: &Plan) -> Result<Latency, String> {
    let block = LATENCY_BLOCK_BYTES;
    let n = blocks_of(plan, block)?;
    let mut link = Link::open(t, plan, n, block, 1).await?;
    // Touch every page on both sides first: a first touch costs a page fault, not a transfer.
    fill(link.local(), plan.seed)?;
    link.remote_fill(plan.seed).await?;
    let perm = permutation(plan.seed ^ 0x1a7e, n);
    // One pass over the region warms what a long-running worker has warm: the peer's
    // memory mapped into this process (shared memory), connections, caches.
    link.write(&all(n), &perm, Instant::now() + CALL_TIMEOUT)
        .await
        .map_err(|e| format!("{} latency warm-up: {e}", t.name()))?;
    let warmup = (plan.latency_iters / 10).max(10);
    let mut samples = Vec::with_capacity(plan.latency_iters);
    for i in 0..warmup + plan.latency_iters {
        let src = [BlockId((i % n as usize) as u32)];
        let dst = [perm[i % n as usize]];
        let started = Instant::now();
        link.write(&src, &dst, Instant::now() + CALL_TIMEOUT)
            .await
            .map_err(|e| format!("{} latency write: {e}", t.name()))?;
        if i >= warmup {
            samples.push(started.elapsed());
        }
    }
    link.close().await;
    let mut micros: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    micros.sort_by(f64::total_cmp);
    let spin = plan.tcp_busy_poll;
    let polled = match t {
        BenchTransport::Tcp if spin == BusyPoll::OFF => "; no busy poll".to_string(),
        BenchTransport::Tcp if spin.server.is_zero() => format!(
            "; the client spins up to {} µs for each answer, the server sleeps",
            spin.client.as_micros()
        ),
        BenchTransport::Tcp => format!("; busy poll {} µs on both sides", spin.server.as_micros()),
        _ => String::new(),
    };
    Ok(percentiles(
        t.name(),
        "write",
        &micros,
        format!("one call per block, awaited in a task of the runtime{polled}"),
    ))
}

/// A latency row `op` of one-block lifecycles on `plane` (`key`: every connection
/// authenticated with it), opened and awaited from `caller`; with `paired`, each request's
/// ratio to the round trip timed just before it comes back too (else empty).
async fn lifecycle_row(
    op: &str,
    plane: crate::lifecycle::Plane,
    iters: usize,
    key: Option<&handoff_bootstrap::Key>,
    caller: crate::lifecycle::Caller,
    paired: bool,
) -> Result<(Latency, Vec<f64>), String> {
    let measured =
        crate::lifecycle::measure(plane, 16 << 10, iters, key, None, caller, paired).await?;
    let row = percentiles(op, plane.name(), &measured.samples, String::new());
    Ok((row, measured.paired))
}

/// The percentiles row of sorted `samples` (µs).
fn percentiles(transport: &str, op: &str, samples: &[f64], note: String) -> Latency {
    Latency {
        transport: transport.into(),
        op: op.into(),
        samples: samples.len(),
        p50_us: quantile(samples, 0.5),
        p99_us: quantile(samples, 0.99),
        note,
    }
}

/// The `q` quantile of `sorted` (the nearest rank); NaN when empty.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted
        .get(((sorted.len().max(1) as f64 - 1.0) * q).round() as usize)
        .copied()
        .unwrap_or(f64::NAN)
}

// ------------------------------------------------------------------ the peer process

/// The peer process: this binary re-executed as `handoff bench --peer <spec>`.
struct PeerProcess {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl PeerProcess {
    async fn spawn(spec: &str) -> Result<PeerProcess, String> {
        let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
        let mut child = Command::new(exe)
            .args(["bench", "--peer", spec])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start the peer process: {e}"))?;
        let stdin = child.stdin.take().ok_or("peer has no stdin")?;
        let stdout = child.stdout.take().ok_or("peer has no stdout")?;
        Ok(PeerProcess {
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
        })
    }

    /// The peer's next protocol line.
    async fn expect(&mut self) -> Result<String, String> {
        let next = async {
            loop {
                match self.lines.next_line().await {
                    Ok(Some(line)) => {
                        if let Some(at) = line.find(PEER_PREFIX) {
                            return Ok(line[at + PEER_PREFIX.len()..].to_string());
                        }
                    }
                    Ok(None) => return Err("the peer process exited".to_string()),
                    Err(e) => return Err(format!("reading from the peer: {e}")),
                }
            }
        };
        let line = tokio::time::timeout(PEER_STEP_TIMEOUT, next)
            .await
            .map_err(|_| format!("the peer said nothing within {PEER_STEP_TIMEOUT:?}"))??;
        match line.strip_prefix("error ") {
            Some(e) => Err(format!("peer: {e}")),
            None => Ok(line),
        }
    }

    async fn ask(&mut self, command: &str) -> Result<String, String> {
        self.stdin
            .write_all(format!("{command}\n").as_bytes())
            .await
            .map_err(|e| format!("writing to the peer: {e}"))?;
        self.expect().await
    }

    async fn exit(mut self) {
        let _ = self.stdin.write_all(b"exit\n").await;
        if tokio::time::timeout(PEER_STEP_TIMEOUT, self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// The peer side: serve a region over `tcp` or `ucx` and answer commands on stdin.
async fn peer_main(spec: &str) -> Result<(), String> {
    let parts: Vec<&str> = spec.split(':').collect();
    // `tcp:<blocks>:<block>:<busy poll µs>` or
    // `ucx:<blocks>:<block>:<memory>:<peer's memory>:<device>:<ranges>:<registered 0|1>`.
    let mut busy_poll = Duration::ZERO;
    let (kind, blocks, block, memory, ranges, registered) = match parts.as_slice() {
        [kind, blocks, block, micros] => {
            busy_poll = Duration::from_micros(micros.parse().map_err(|_| "bad busy poll")?);
            (*kind, *blocks, *block, None, "1", false)
        }
        [kind, blocks, block, memory, other, device, ranges, registered] => {
            let parse = |name: &str| match name {
                "host" => Ok(BenchMemory::Host),
                "cuda" => Ok(BenchMemory::Cuda),
                _ => Err(format!("bad memory {name:?} in peer spec")),
            };
            let device: u32 = device.parse().map_err(|_| "bad device in peer spec")?;
            (
                *kind,
                *blocks,
                *block,
                Some((parse(memory)?, parse(other)?, device)),
                *ranges,
                *registered == "1",
            )
        }
        _ => return Err(format!("bad peer spec {spec:?}")),
    };
    let blocks: u32 = blocks.parse().map_err(|_| "bad block count")?;
    let block: usize = block.parse().map_err(|_| "bad block size")?;
    let ranges: usize = ranges.parse().map_err(|_| "bad range count")?;
    let me = RankInfo::single("bench-peer");
    let (_keep, region): (Box<dyn std::any::Any>, Arc<Region>) = match kind {
        "tcp" => {
            let region = Arc::new(host_region(Region::new(blocks, block))?);
            let config = handoff_transport::tcp::ServerConfig {
                busy_poll,
                ..Default::default()
            };
            let server = DataServer::bind_with(
                "127.0.0.1:0",
                Arc::clone(&region),
                Arc::new(AllowAll),
                me,
                None,
                config,
            )
            .await
            .map_err(|e| e.to_string())?;
            say(&format!("ready tcp {}", server.local_addr()));
            (Box::new(server), region)
        }
        "ucx" => {
            let (memory, other, device) =
                memory.unwrap_or((BenchMemory::Host, BenchMemory::Host, 0));
            let plane = bench_plane(memory, other, device, blocks, block, ranges, registered)?;
            say(&ucx_ready_line(&plane));
            let region = Arc::clone(plane.region());
            (Box::new(plane), region)
        }
        other => return Err(format!("unknown peer transport {other:?}")),
    };
    // Stdin through a thread (the workspace's tokio has no `io-std`); bounded channel.
    let (tx, mut lines) = tokio::sync::mpsc::channel::<String>(16);
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.blocking_send(line).is_err() {
                break;
            }
        }
    });
    while let Some(line) = lines.recv().await {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["checksum", seed, n] => {
                let (seed, n) = (seed.parse().unwrap_or(0), n.parse().unwrap_or(0));
                say(&format!(
                    "checksum {}",
                    checksum(&region, &permutation(seed, n))?
                ));
            }
            ["fill", seed] => {
                fill(&region, seed.parse().unwrap_or(0))?;
                say("filled");
            }
            ["exit"] => break,
            _ => say(&format!("error unknown command {line:?}")),
        }
    }
    Ok(())
}

fn say(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{PEER_PREFIX}{text}");
    let _ = out.flush();
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

// ------------------------------------------------------------------ ucx_perftest

fn find_perftest() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("ucx_perftest"))
        .find(|p| p.is_file())
}

async fn perftest_points(plan: &Plan, report: &mut Report) {
    let Some(exe) = find_perftest() else {
        report
            .notes
            .push("ucx_perftest not installed: its reference is skipped".into());
        return;
    };
    report.notes.push(
        "ucx_perftest puts one buffer over and over (cache-resident for small sizes), \
         without peer-failure handling: an upper bound, not the same work"
            .into(),
    );
    for &block in &plan.block_sizes {
        let iters = (plan.total_bytes / block).max(16);
        match perftest(&exe, "ucp_put_bw", block, iters).await {
            Ok(final_line) => report.points.push(Point {
                transport: "ucx_perftest".into(),
                op: "put_bw".into(),
                block_bytes: block,
                bytes: (iters * block) as u64,
                secs: (iters * block) as f64 / (final_line.bandwidth_mib_s * 1_048_576.0),
                pass_secs: Vec::new(),
                verified: None,
                ranges: 1,
                vs_one_range: None,
                note: String::new(),
            }),
            Err(e) => report
                .notes
                .push(format!("ucx_perftest put_bw {} KiB: {e}", block >> 10)),
        }
    }
    match perftest(&exe, "ucp_put_lat", LATENCY_BLOCK_BYTES, plan.latency_iters).await {
        Ok(f) => report.latency.push(Latency {
            transport: "ucx_perftest".into(),
            op: "put_lat".into(),
            samples: plan.latency_iters,
            p50_us: f.p50_us,
            p99_us: f64::NAN,
            note: "ping-pong half round trip; perftest prints no p99 (average shown in JSON)"
                .into(),
        }),
        Err(e) => report.notes.push(format!("ucx_perftest put_lat: {e}")),
    }
}

/// The `Final:` line of a `ucx_perftest` run.
struct PerftestFinal {
    p50_us: f64,
    bandwidth_mib_s: f64,
}

/// Runs `ucx_perftest` as server and client on loopback and parses the client's result.
async fn perftest(
    exe: &std::path::Path,
    test: &str,
    size: usize,
    iters: usize,
) -> Result<PerftestFinal, String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port()
        .to_string();
    let mut server = Command::new(exe)
        .args(["-p", &port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start the server: {e}"))?;
    let run = async {
        // The server needs a moment to listen; retry the client a few times.
        let mut last = String::new();
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let out = Command::new(exe)
                .args([
                    "127.0.0.1",
                    "-p",
                    &port,
                    "-t",
                    test,
                    "-s",
                    &size.to_string(),
                    "-n",
                    &iters.to_string(),
                ])
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output()
                .await
                .map_err(|e| format!("cannot start the client: {e}"))?;
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            if let Some(f) = parse_perftest(&text) {
                return Ok(f);
            }
            last = format!("{}{}", text, String::from_utf8_lossy(&out.stderr));
        }
        Err(format!("no result: {}", last.lines().last().unwrap_or("")))
    };
    let result = tokio::time::timeout(PERFTEST_TIMEOUT, run)
        .await
        .unwrap_or_else(|_| Err("timed out".into()));
    let _ = server.kill().await;
    result
}

fn parse_perftest(text: &str) -> Option<PerftestFinal> {
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("Final:"))?;
    let fields: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|w| w.parse().ok())
        .collect();
    // iterations, p50, average, overall (µs), bandwidth average, overall (MB/s), rates.
    if fields.len() < 6 {
        return None;
    }
    Some(PerftestFinal {
        p50_us: fields[1],
        bandwidth_mib_s: fields[5],
    })
}

// ------------------------------------------------------------------ output

impl Report {
    /// The reference's throughput at one block size, when measured.
    fn reference_gbps(&self, block: usize) -> Option<f64> {
        self.points
            .iter()
            .find(|p| p.transport == self.reference && p.block_bytes == block)
            .map(Point::gbps)
            .filter(|&gbps| gbps > 0.0)
    }

    /// The human-readable table.
    pub fn table(&self) -> String {
        let mut out = format!(
            "handoff bench: {} MiB regions, {} MiB per point after a warm-up, {} passes over the region: the median pass's rate, and the slowest and fastest pass's; blocks to a seeded random permutation\n\n",
            self.region_bytes >> 20,
            self.total_bytes >> 20,
            self.passes,
        );
        out += &format!(
            "{:<13} {:<7} {:>8} {:>6} {:>9} {:>9} {:>13} {:>14} {:>10}  {}\n",
            "transport",
            "op",
            "block",
            "ranges",
            "segment",
            "GB/s",
            "min-max",
            format!("vs {}", self.reference),
            "vs 1-range",
            "checksum"
        );
        for p in &self.points {
            let ratio = self.reference_gbps(p.block_bytes).map(|m| p.gbps() / m);
            out += &format!(
                "{:<13} {:<7} {:>8} {:>6} {:>9} {:>9.2} {:>13} {:>14} {:>10}  {}{}\n",
                p.transport,
                p.op,
                size_label(p.block_bytes),
                p.ranges,
                size_label(p.block_bytes / p.ranges.max(1)),
                p.gbps(),
                p.gbps_range()
                    .map_or("-".into(), |(lo, hi)| format!("{lo:.2}-{hi:.2}")),
                ratio.map_or("-".into(), |r| format!("{r:.2}")),
                p.vs_one_range.map_or("-".into(), |r| format!("{r:.2}")),
                match p.verified {
                    Some(true) => "ok",
                    Some(false) => "MISMATCH",
                    None => "-",
                },
                if p.note.is_empty() {
                    String::new()
                } else {
                    format!("  ({})", p.note)
                }
            );
        }
        out += &format!(
            "\n{:<13} {:<8} {:>8} {:>10} {:>10}\n",
            "latency", "op", "samples", "p50 µs", "p99 µs"
        );
        for l in self.latency.iter().chain(&self.lifecycle) {
            out += &format!(
                "{:<13} {:<8} {:>8} {:>10.1} {:>10}  ({})\n",
                l.transport,
                l.op,
                l.samples,
                l.p50_us,
                if l.p99_us.is_nan() {
                    "-".into()
                } else {
                    format!("{:.1}", l.p99_us)
                },
                l.note
            );
        }
        if self.lifecycle.is_none() {
            out += "lifecycle     (full request lifecycle through the request actors: not measured yet)\n";
        }
        for n in &self.notes {
            out += &format!("note: {n}\n");
        }
        out
    }

    /// The report as JSON.
    pub fn to_json(&self) -> String {
        let num = |v: f64| {
            if v.is_finite() {
                format!("{v:.4}")
            } else {
                "null".into()
            }
        };
        let points: Vec<String> = self
            .points
            .iter()
            .map(|p| {
                format!(
                    "{{\"transport\":{},\"op\":{},\"block_bytes\":{},\"ranges\":{},\"segment_bytes\":{},\"bytes\":{},\"secs\":{},\"gbps\":{},\"gbps_min\":{},\"gbps_max\":{},\"pass_secs\":[{}],\"vs_reference\":{},\"vs_one_range\":{},\"verified\":{},\"note\":{}}}",
                    json_str(&p.transport),
                    json_str(&p.op),
                    p.block_bytes,
                    p.ranges,
                    p.block_bytes / p.ranges.max(1),
                    p.bytes,
                    num(p.secs),
                    num(p.gbps()),
                    p.gbps_range().map_or("null".into(), |(lo, _)| num(lo)),
                    p.gbps_range().map_or("null".into(), |(_, hi)| num(hi)),
                    p.pass_secs
                        .iter()
                        .map(|&v| format!("{v:.6}"))
                        .collect::<Vec<_>>()
                        .join(","),
                    self.reference_gbps(p.block_bytes).map_or("null".into(), |m| num(p.gbps() / m)),
                    p.vs_one_range.map_or("null".into(), num),
                    p.verified.map_or("null".into(), |v| v.to_string()),
                    json_str(&p.note)
                )
            })
            .collect();
        let latency = |l: &Latency| {
            format!(
                "{{\"transport\":{},\"op\":{},\"samples\":{},\"p50_us\":{},\"p99_us\":{},\"note\":{}}}",
                json_str(&l.transport),
                json_str(&l.op),
                l.samples,
                num(l.p50_us),
                num(l.p99_us),
                json_str(&l.note)
            )
        };
        let latencies: Vec<String> = self.latency.iter().map(latency).collect();
        let notes: Vec<String> = self.notes.iter().map(|n| json_str(n)).collect();
        format!(
            "{{\"region_bytes\":{},\"total_bytes\":{},\"passes\":{},\"reference\":{},\"points\":[{}],\"latency\":[{}],\"lifecycle\":{},\"notes\":[{}]}}\n",
            self.region_bytes,
            self.total_bytes,
            self.passes,
            json_str(&self.reference),
            points.join(","),
            latencies.join(","),
            self.lifecycle.as_ref().map_or("null".into(), latency),
            notes.join(",")
        )
    }
}

fn size_label(bytes: usize) -> String {
    if bytes >= 1 << 20 && bytes % (1 << 20) == 0 {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes % (1 << 10) == 0 {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutations_are_seeded_and_complete() {
        let p = permutation(3, 100);
        assert_eq!(p, permutation(3, 100));
        let mut sorted = p.clone();
        sorted.sort();
        assert_eq!(sorted, all(100));
        assert_ne!(p, all(100));
    }

    #[test]
    fn perftest_final_line_parses() {
        let text = "junk\nFinal:                   500     25.710    59.108    59.108    16918.11   16918.11       16918       16918\n";
        let f = parse_perftest(text).unwrap();
        assert!((f.bandwidth_mib_s - 16918.11).abs() < 1e-6 && (f.p50_us - 25.71).abs() < 1e-6);
        assert!(parse_perftest("Final: 1 2").is_none());
    }

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(json_str("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    }
}
