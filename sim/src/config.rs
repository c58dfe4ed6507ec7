//! What a simulation is made of: the cluster's shape, the workload, the timing, the faults.
//!
//! Every number here is drawn from, or fixed alongside, one seed; [`SimConfig`]'s `Display`
//! prints all of them at the start of a run so a failure's settings are on screen.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use handoff_actors::machine::PeerMessage;
use handoff_actors::{KvShape, Timeouts, TransferMode};

use crate::rng::{Rng, PPM};
use crate::SimError;

/// How a worker lays out its layers' KV ranges (with [`Shape::layers`] > 0), as the
/// engines it stands in for do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum LayoutChoice {
    /// vLLM's per-layer tensors with K and V halves: two ranges per layer.
    PerLayer,
    /// Per-layer tensors with K and V interleaved per block: one range per layer.
    Interleaved,
    /// One allocation, every layer of a block together: one range.
    Contiguous,
}

impl LayoutChoice {
    /// The layout shape this stands for.
    pub fn shape(self) -> KvShape {
        match self {
            LayoutChoice::PerLayer => KvShape::KvHalves,
            LayoutChoice::Interleaved => KvShape::LayerBlocks,
            LayoutChoice::Contiguous => KvShape::Contiguous,
        }
    }
}

impl FromStr for LayoutChoice {
    type Err = SimError;
    fn from_str(s: &str) -> Result<Self, SimError> {
        match s {
            "per-layer" => Ok(Self::PerLayer),
            "interleaved" => Ok(Self::Interleaved),
            "contiguous" => Ok(Self::Contiguous),
            other => Err(SimError::Config(format!(
                "layout {other:?}: expected per-layer, interleaved or contiguous"
            ))),
        }
    }
}

/// Which transfer mode decode engines use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum ModeChoice {
    /// Every decode engine pushes.
    Push,
    /// Every decode engine pulls.
    Pull,
    /// Decode engines alternate: even ones push, odd ones pull.
    Mixed,
}

impl ModeChoice {
    /// The mode of decode engine `engine`.
    pub fn of(self, engine: u32) -> TransferMode {
        match self {
            ModeChoice::Push => TransferMode::Push,
            ModeChoice::Pull => TransferMode::Pull,
            ModeChoice::Mixed if engine % 2 == 0 => TransferMode::Push,
            ModeChoice::Mixed => TransferMode::Pull,
        }
    }
}

impl FromStr for ModeChoice {
    type Err = SimError;
    fn from_str(s: &str) -> Result<Self, SimError> {
        match s {
            "push" => Ok(Self::Push),
            "pull" => Ok(Self::Pull),
            "mixed" => Ok(Self::Mixed),
            other => Err(SimError::Config(format!(
                "mode {other:?}: expected push, pull or mixed"
            ))),
        }
    }
}

/// Tokens per block when blocks hold heads (`Shape::kv_heads`).
pub const SIM_BLOCK_TOKENS: u32 = 2;

/// The cluster: prefill engines of `dp × tp × pp` ranks, decode engines of `dp × tp` ranks
/// (decode has no pipeline split here: each prefill rank pairs with exactly one decode rank
/// of the same tp rank, which is what the bootstrap lookup resolves).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Shape {
    /// Prefill engines, named `P0`, `P1`, ...
    pub prefill_engines: u32,
    /// Decode engines, named `D0`, `D1`, ...
    pub decode_engines: u32,
    /// Tensor-parallel ranks per prefill dp group (and decode's, unless `decode_tp`).
    pub tp: u32,
    /// Decode's tensor-parallel ranks per dp group when they differ from prefill's (it must
    /// divide `tp` or be a multiple of it; needs `kv_heads`, `layers`, and `pp` 1).
    pub decode_tp: Option<u32>,
    /// The model's KV heads: 0 keeps each tp rank's blocks its own; otherwise every block
    /// is `SIM_BLOCK_TOKENS` tokens of these heads in each K and V half of every layer, and
    /// each tp rank holds its share (prefill head-major, decode token-major), filled and
    /// checked head by head.
    pub kv_heads: u32,
    /// Pipeline-parallel ranks of each prefill dp group.
    pub pp: u32,
    /// The dp ranks of every prefill engine; need not be dense nor start at zero (seed 001).
    pub prefill_dp_ranks: Vec<u32>,
    /// Dp ranks of every decode engine (dense, from zero).
    pub decode_dp: u32,
    /// KV blocks per worker.
    pub blocks_per_worker: u32,
    /// Bytes per KV block (the whole model's logical block).
    pub block_bytes: usize,
    /// Push, pull, or both.
    pub mode: ModeChoice,
    /// Model layers: 0 keeps blocks opaque (each prefill pipeline rank holds an equal byte
    /// share of every block, one contiguous region per worker); otherwise prefill rank `r`
    /// of `pp` holds layers `r × layers / pp .. (r + 1) × layers / pp` (uneven when `pp`
    /// does not divide `layers`), laid out as `prefill_layout` says, and decode holds every
    /// layer as `decode_layout` says.
    pub layers: u32,
    /// How prefill workers lay out their layers' ranges (with `layers > 0`).
    pub prefill_layout: LayoutChoice,
    /// How decode workers lay out their layers' ranges (with `layers > 0`).
    pub decode_layout: LayoutChoice,
    /// Hosts the workers are spread over, by worker index (`index % hosts`). A worker
    /// watches only the processes on its own host: a lost writer on another is not watched
    /// (`Link::writer_exit`), and a decode push over the RDMA plane with a prefill rank on
    /// another host runs as pull (`Link::unwatched`). 1: every worker on one host.
    pub hosts: u32,
}

impl Default for Shape {
    fn default() -> Self {
        Self {
            prefill_engines: 2,
            decode_engines: 2,
            tp: 1,
            decode_tp: None,
            kv_heads: 0,
            pp: 1,
            prefill_dp_ranks: vec![0],
            decode_dp: 1,
            blocks_per_worker: 48,
            block_bytes: 32,
            mode: ModeChoice::Mixed,
            layers: 0,
            prefill_layout: LayoutChoice::Contiguous,
            decode_layout: LayoutChoice::Contiguous,
            hosts: 1,
        }
    }
}

impl Shape {
    /// Workers (runtimes) in the cluster.
    pub fn workers(&self) -> u64 {
        let p = u64::from(self.prefill_engines)
            * self.prefill_dp_ranks.len() as u64
            * u64::from(self.tp)
            * u64::from(self.pp);
        let d = u64::from(self.decode_engines)
            * u64::from(self.decode_dp)
            * u64::from(self.decode_tp());
        p + d
    }

    /// Whether workers `a` and `b` (by index) run on one host ([`Shape::hosts`]).
    pub fn same_host(&self, a: usize, b: usize) -> bool {
        let hosts = usize::try_from(self.hosts.max(1)).unwrap_or(1);
        a % hosts == b % hosts
    }

    /// Decode's tensor-parallel ranks per dp group.
    pub fn decode_tp(&self) -> u32 {
        self.decode_tp.unwrap_or(self.tp)
    }

    /// Checks the shape can be built.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |what: &str| Err(SimError::Config(what.to_string()));
        if self.prefill_engines == 0 || self.decode_engines == 0 {
            return bad("need at least one prefill and one decode engine");
        }
        if self.tp == 0 || self.pp == 0 || self.decode_dp == 0 {
            return bad("tp, pp and decode dp must be at least 1");
        }
        if self.hosts == 0 {
            return bad("the workers need at least one host");
        }
        if self.prefill_dp_ranks.is_empty() {
            return bad("prefill engines need at least one dp rank");
        }
        let mut dp = self.prefill_dp_ranks.clone();
        dp.sort_unstable();
        dp.dedup();
        if dp.len() != self.prefill_dp_ranks.len() {
            return bad("prefill dp ranks must be distinct");
        }
        if self.blocks_per_worker == 0 || self.block_bytes == 0 {
            return bad("workers need blocks of at least one byte");
        }
        if self.layers == 0 && self.block_bytes % self.pp as usize != 0 {
            return bad("block bytes must split evenly across the prefill pipeline ranks");
        }
        if self.layers > 0 {
            if self.layers < self.pp {
                return bad("every prefill pipeline rank needs at least one layer");
            }
            if self.block_bytes % (2 * self.layers as usize) != 0 {
                return bad("block bytes must split into a K and a V half of every layer");
            }
        }
        let decode_tp = self.decode_tp();
        if decode_tp == 0 {
            return bad("decode tp must be at least 1");
        }
        if self.kv_heads > 0 {
            let per_token =
                2 * self.layers as usize * self.kv_heads as usize * SIM_BLOCK_TOKENS as usize;
            if self.layers == 0 || self.block_bytes % per_token != 0 {
                return bad("with kv heads, block bytes must split into layers x K and V x heads x tokens of whole bytes");
            }
            for tp in [self.tp, decode_tp] {
                if let Err(e) = handoff_transport::tp::rank_heads(self.kv_heads, tp, 0) {
                    return Err(SimError::Config(format!("kv heads over tp {tp}: {e}")));
                }
            }
        }
        if decode_tp != self.tp {
            if self.kv_heads == 0 {
                return bad("a decode tp other than prefill's needs kv heads");
            }
            if self.tp % decode_tp != 0 && decode_tp % self.tp != 0 {
                return bad("one of prefill's and decode's tp must divide the other");
            }
            if self.pp != 1 {
                return bad(
                    "a decode tp other than prefill's needs pp 1 (both sides hold every layer)",
                );
            }
        }
        Ok(())
    }
}

/// The requests.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Workload {
    /// Requests in the safety phase (faults on).
    pub requests: u64,
    /// Requests in the liveness phase (faults off; each must end `Done` everywhere); 0 skips it.
    pub liveness_requests: u64,
    /// Largest gap between two arrivals, in virtual ms (uniform in `0..=max`).
    pub arrival_gap_ms_max: u64,
    /// Requests per arrival (uniform in `1..=max`): large clusters need many per ms.
    pub burst_max: u64,
    /// Largest KV blocks per request (uniform in `1..=max`).
    pub blocks_per_request_max: u32,
    /// Prefill compute time per request, virtual ms (uniform in the range).
    pub compute_ms: (u64, u64),
}

impl Default for Workload {
    fn default() -> Self {
        Self {
            requests: 60,
            liveness_requests: 12,
            arrival_gap_ms_max: 6,
            burst_max: 1,
            blocks_per_request_max: 4,
            compute_ms: (1, 12),
        }
    }
}

/// Deadlines and delays, scaled down from production so a run spans seconds of virtual time.
///
/// Tokio's timer counts whole milliseconds, so every delay here is whole milliseconds too,
/// and the smallest network hop is 1 ms: think of one virtual millisecond as one hop.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Timing {
    /// The runtimes' deadlines.
    #[serde(skip)]
    pub timeouts: Timeouts,
    /// The loss window: each worker's real `PeerTable` loses a connected peer it has not
    /// heard from for longer (its loss timeout, the control loop's heartbeat interval ×
    /// beats missed: [`Timing::loss_timeout_ms`], this rounded up to whole intervals), at
    /// its next heartbeat tick. A control-plane cut shorter than the window less two
    /// intervals and a hop loses nobody (without delay spikes).
    pub heartbeat_ms: u64,
    /// One control message's delay, uniform in the range (jitter reorders messages).
    pub delay_ms: (u64, u64),
    /// A bootstrap query or registration that gets no answer is given up after this long.
    pub query_timeout_ms: u64,
    /// A data transfer takes `transfer_base_ms + blocks / blocks_per_ms` ms.
    pub transfer_base_ms: u64,
    /// See `transfer_base_ms`.
    pub blocks_per_ms: u64,
}

/// Heartbeats each worker sends a peer per loss window ([`Timing::heartbeat_ms`]), as the
/// control loop's `heartbeats_missed_max` (6 in production, fewer here: each beat costs
/// the simulator an event).
pub const HEARTBEATS_PER_WINDOW: u64 = 4;

impl Timing {
    /// The control loop's heartbeat interval, virtual ms: `heartbeat_ms /`
    /// [`HEARTBEATS_PER_WINDOW`], at least 1.
    pub fn heartbeat_interval_ms(&self) -> u64 {
        (self.heartbeat_ms / HEARTBEATS_PER_WINDOW).max(1)
    }

    /// The beats a peer may miss before it is lost: the window in whole intervals.
    pub fn heartbeats_missed_max(&self) -> u64 {
        self.heartbeat_ms.div_ceil(self.heartbeat_interval_ms())
    }

    /// The peer tables' loss timeout, virtual ms: interval × beats missed, as the control
    /// loop's (`heartbeat_ms` exactly when [`HEARTBEATS_PER_WINDOW`] divides it, else
    /// rounded up to whole intervals).
    pub fn loss_timeout_ms(&self) -> u64 {
        self.heartbeat_interval_ms() * self.heartbeats_missed_max()
    }

    /// How long a worker's directory refuses a rank it lost at an incarnation (the
    /// bootstrap client's `LostRanks`), virtual ms: [`LOST_KEPT_LOSS_TIMEOUTS`] loss timeouts.
    pub fn lost_kept_ms(&self) -> u64 {
        LOST_KEPT_LOSS_TIMEOUTS * self.loss_timeout_ms()
    }

    /// How long the simulated bootstrap server keeps a record its worker's client stopped
    /// heartbeating, virtual ms: a lost mark's life over [`LOST_KEPT_EXPIRIES`], as the
    /// bootstrap client keeps its marks for twice the server's `expire_after`.
    pub fn expire_after_ms(&self) -> u64 {
        (self.lost_kept_ms() / LOST_KEPT_EXPIRIES).max(1)
    }

    /// How often a registered worker's bootstrap client heartbeats the server, virtual ms:
    /// the expiry over [`EXPIRY_HEARTBEATS`], as in production.
    pub fn bootstrap_heartbeat_ms(&self) -> u64 {
        (self.expire_after_ms() / EXPIRY_HEARTBEATS).max(1)
    }

    /// How often the simulated server sweeps for expired records: the real server's
    /// interval for [`Timing::expire_after_ms`] (`ServerConfig::sweep_interval`).
    pub fn sweep_ms(&self) -> u64 {
        let cfg = handoff_bootstrap::server::ServerConfig::new(crate::net::BOOTSTRAP_ADDRESS)
            .with_expire_after(Duration::from_millis(self.expire_after_ms()));
        u64::try_from(cfg.sweep_interval().as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }
}

/// A lost mark's life in loss timeouts, as in production: `handoff worker`'s 3 s loss
/// timeout against the bootstrap client's 12 s (`LOST_KEPT_DEFAULT`).
pub const LOST_KEPT_LOSS_TIMEOUTS: u64 = 4;

/// A lost mark's life in server record expiries, as in production: the client's
/// `LOST_KEPT_DEFAULT` (12 s) against the server's `EXPIRE_AFTER_DEFAULT` (6 s).
pub const LOST_KEPT_EXPIRIES: u64 = handoff_bootstrap::LOST_KEPT_DEFAULT.as_secs()
    / handoff_bootstrap::EXPIRE_AFTER_DEFAULT.as_secs();

/// The server's record expiry in client heartbeats, as in production:
/// `EXPIRE_AFTER_DEFAULT` (6 s) against `HEARTBEAT_INTERVAL_DEFAULT` (2 s).
pub const EXPIRY_HEARTBEATS: u64 = handoff_bootstrap::EXPIRE_AFTER_DEFAULT.as_secs()
    / handoff_bootstrap::HEARTBEAT_INTERVAL_DEFAULT.as_secs();

/// The scaled-down deadlines every simulation starts from.
pub fn sim_timeouts() -> Timeouts {
    Timeouts {
        bootstrap: Duration::from_millis(400),
        waiting: Duration::from_millis(400),
        transfer: Duration::from_millis(200),
        pull_ttl: Duration::from_millis(600),
    }
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            timeouts: sim_timeouts(),
            heartbeat_ms: 100,
            delay_ms: (1, 4),
            query_timeout_ms: 50,
            transfer_base_ms: 1,
            blocks_per_ms: 2,
        }
    }
}

/// A class of fault, as named on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub enum FaultKind {
    /// Control messages lost.
    Loss,
    /// Delay spikes and wide jitter (reordering).
    Delay,
    /// Control messages delivered twice.
    Dup,
    /// One-way and two-way partitions with durations.
    Partition,
    /// Worker crash and restart (a new incarnation).
    Crash,
    /// Bootstrap server down (also at registration), failed queries.
    Bootstrap,
    /// Decode opens requests without blocks and allocates later.
    Saturation,
    /// Slow data transfers.
    Slow,
    /// Ranks of one request open it at different times (seed 003).
    Skew,
    /// Injected panics in request actors.
    Panic,
    /// Engine aborts.
    Abort,
    /// Engines that stall: prefill never opens or never sends; decode asks for an
    /// unregistered prefill engine.
    Stall,
    /// Workers frozen (as by SIGSTOP) for a while: cut off from everyone, their transfers
    /// queued and posted when they resume, the writes under a lease that may have ended.
    Freeze,
    /// Peers that lie about their memory: a request's transfer info (decode) or `Ready`
    /// (prefill, pull) names blocks past the end of the sender's pool (the simulator's
    /// descriptor). The receiver must refuse it on arrival, by name, before a byte moves.
    Lie,
}

impl FaultKind {
    /// Every kind, in order.
    pub const ALL: [FaultKind; 14] = [
        FaultKind::Loss,
        FaultKind::Delay,
        FaultKind::Dup,
        FaultKind::Partition,
        FaultKind::Crash,
        FaultKind::Bootstrap,
        FaultKind::Saturation,
        FaultKind::Slow,
        FaultKind::Skew,
        FaultKind::Panic,
        FaultKind::Abort,
        FaultKind::Stall,
        FaultKind::Freeze,
        FaultKind::Lie,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Loss => "loss",
            FaultKind::Delay => "delay",
            FaultKind::Dup => "dup",
            FaultKind::Partition => "partition",
            FaultKind::Crash => "crash",
            FaultKind::Bootstrap => "bootstrap",
            FaultKind::Saturation => "saturation",
            FaultKind::Slow => "slow",
            FaultKind::Skew => "skew",
            FaultKind::Panic => "panic",
            FaultKind::Abort => "abort",
            FaultKind::Stall => "stall",
            FaultKind::Freeze => "freeze",
            FaultKind::Lie => "lie",
        }
    }
}

/// How faults are chosen for a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultPlan {
    /// No faults.
    None,
    /// These kinds, at fixed moderate rates.
    Kinds(Vec<FaultKind>),
    /// Each kind on with probability 1/2, at rates drawn from the seed.
    Swarm,
}

impl FromStr for FaultPlan {
    type Err = SimError;
    fn from_str(s: &str) -> Result<Self, SimError> {
        match s.trim() {
            "" | "none" => return Ok(Self::None),
            "swarm" => return Ok(Self::Swarm),
            "all" => return Ok(Self::Kinds(FaultKind::ALL.to_vec())),
            _ => {}
        }
        let mut kinds = Vec::new();
        for name in s.split(',').map(str::trim) {
            let kind = FaultKind::ALL
                .iter()
                .find(|k| k.name() == name)
                .ok_or_else(|| {
                    let names: Vec<&str> = FaultKind::ALL.iter().map(|k| k.name()).collect();
                    SimError::Config(format!(
                        "unknown fault {name:?}; expected none, all, swarm or a list of {}",
                        names.join(",")
                    ))
                })?;
            kinds.push(*kind);
        }
        kinds.sort();
        kinds.dedup();
        Ok(Self::Kinds(kinds))
    }
}

/// Every fault rate of a run. Rates are parts per million; intervals are virtual ms.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Faults {
    /// Control messages lost.
    pub loss_ppm: u32,
    /// Control messages delivered twice.
    pub dup_ppm: u32,
    /// Messages delayed by a spike.
    pub spike_ppm: u32,
    /// A spike's extra delay.
    pub spike_ms: (u64, u64),
    /// Extra jitter on every message, on top of the base delay (reorders).
    pub jitter_ms: u64,
    /// Mean gap between partitions (0: none).
    pub partition_every_ms: u64,
    /// A partition's duration.
    pub partition_ms: (u64, u64),
    /// Partitions that block one direction only.
    pub one_way_ppm: u32,
    /// Partitions that cut one plane only, the control plane or the data plane (half each).
    pub plane_only_ppm: u32,
    /// Mean gap between worker freezes (0: none).
    pub freeze_every_ms: u64,
    /// How long a worker stays frozen.
    pub freeze_ms: (u64, u64),
    /// Mean gap between worker crashes (0: none).
    pub crash_every_ms: u64,
    /// How long a crashed worker stays down (at least one heartbeat window).
    pub down_ms: (u64, u64),
    /// The bootstrap server is down when workers register at the start, for this long (0: up).
    pub bootstrap_down_at_start_ms: u64,
    /// Mean gap between bootstrap outages (0: none).
    pub bootstrap_outage_every_ms: u64,
    /// A bootstrap outage's duration.
    pub bootstrap_outage_ms: (u64, u64),
    /// Bootstrap queries answered with an error.
    pub query_error_ppm: u32,
    /// Decode requests opened without blocks (allocated later).
    pub saturation_ppm: u32,
    /// How long a saturated decode takes to allocate.
    pub alloc_delay_ms: (u64, u64),
    /// Data transfers slowed down.
    pub slow_ppm: u32,
    /// A slow transfer's slowdown factor.
    pub slow_factor: (u64, u64),
    /// Largest skew between the ranks of one request opening it (seed 003).
    pub skew_ms_max: u64,
    /// Requests with an injected panic on one rank.
    pub panic_ppm: u32,
    /// Requests the engine aborts on one rank.
    pub abort_ppm: u32,
    /// Requests prefill never opens (the router lost them).
    pub skip_prefill_ppm: u32,
    /// Requests prefill opens but never sends (the engine stalls).
    pub never_send_ppm: u32,
    /// Requests decode asks an unregistered prefill engine for.
    pub ghost_prefill_ppm: u32,
    /// Requests whose transfer info (even ones) or `Ready` (odd ones, pull) names blocks
    /// past the end of the sender's pool (a peer lying about its memory).
    pub liar_ppm: u32,
}

impl Faults {
    /// The faults of `plan` for `seed` (swarm draws from the seed's own stream).
    pub fn from_plan(plan: &FaultPlan, seed: u64) -> Self {
        match plan {
            FaultPlan::None => Self::default(),
            FaultPlan::Kinds(kinds) => {
                let mut f = Self::default();
                for k in kinds {
                    f.enable_fixed(*k);
                }
                f
            }
            FaultPlan::Swarm => Self::swarm(&mut Rng::fork(seed, "swarm")),
        }
    }

    /// True if nothing is injected.
    pub fn is_none(&self) -> bool {
        *self == Self::default()
    }

    /// Turns one kind on at its fixed, moderate rates.
    pub fn enable_fixed(&mut self, kind: FaultKind) {
        match kind {
            FaultKind::Loss => self.loss_ppm = 20_000,
            FaultKind::Delay => {
                self.spike_ppm = 50_000;
                self.spike_ms = (10, 200);
                self.jitter_ms = 8;
            }
            FaultKind::Dup => self.dup_ppm = 20_000,
            FaultKind::Partition => {
                self.partition_every_ms = 150;
                self.partition_ms = (10, 400);
                self.one_way_ppm = PPM / 2;
                self.plane_only_ppm = PPM / 3;
            }
            FaultKind::Crash => {
                self.crash_every_ms = 200;
                self.down_ms = (120, 500);
            }
            FaultKind::Bootstrap => {
                self.bootstrap_down_at_start_ms = 150;
                self.bootstrap_outage_every_ms = 300;
                self.bootstrap_outage_ms = (20, 300);
                self.query_error_ppm = 10_000;
            }
            FaultKind::Saturation => {
                self.saturation_ppm = 200_000;
                self.alloc_delay_ms = (5, 600);
            }
            FaultKind::Slow => {
                self.slow_ppm = 50_000;
                self.slow_factor = (5, 200);
            }
            FaultKind::Skew => self.skew_ms_max = 200,
            FaultKind::Panic => self.panic_ppm = 20_000,
            FaultKind::Abort => self.abort_ppm = 20_000,
            FaultKind::Stall => {
                self.skip_prefill_ppm = 10_000;
                self.never_send_ppm = 10_000;
                self.ghost_prefill_ppm = 10_000;
            }
            FaultKind::Freeze => {
                self.freeze_every_ms = 300;
                self.freeze_ms = (20, 1_500);
            }
            FaultKind::Lie => self.liar_ppm = 20_000,
        }
    }

    /// A swarm mix: each kind on with probability 1/2, its rates drawn from wide ranges.
    pub fn swarm(rng: &mut Rng) -> Self {
        let mut f = Self::default();
        for kind in FaultKind::ALL {
            if !rng.chance(PPM / 2) {
                continue;
            }
            f.enable_fixed(kind);
            match kind {
                FaultKind::Loss => f.loss_ppm = rng.range(1_000, 100_000) as u32,
                FaultKind::Delay => {
                    f.spike_ppm = rng.range(1_000, 200_000) as u32;
                    f.spike_ms = (rng.range(5, 50), rng.range(50, 500));
                    f.jitter_ms = rng.range(0, 20);
                }
                FaultKind::Dup => f.dup_ppm = rng.range(1_000, 100_000) as u32,
                FaultKind::Partition => {
                    f.partition_every_ms = rng.range(50, 1_000);
                    f.partition_ms = (rng.range(1, 50), rng.range(50, 800));
                    f.one_way_ppm = rng.below(u64::from(PPM)) as u32;
                    f.plane_only_ppm = rng.below(u64::from(PPM)) as u32;
                }
                FaultKind::Crash => {
                    f.crash_every_ms = rng.range(80, 1_500);
                    f.down_ms = (rng.range(101, 200), rng.range(200, 900));
                }
                FaultKind::Bootstrap => {
                    f.bootstrap_down_at_start_ms = rng.range(0, 600);
                    f.bootstrap_outage_every_ms = rng.range(100, 2_000);
                    f.bootstrap_outage_ms = (rng.range(5, 100), rng.range(100, 900));
                    f.query_error_ppm = rng.range(0, 100_000) as u32;
                }
                FaultKind::Saturation => {
                    f.saturation_ppm = rng.range(10_000, 800_000) as u32;
                    f.alloc_delay_ms = (rng.range(1, 100), rng.range(100, 900));
                }
                FaultKind::Slow => {
                    f.slow_ppm = rng.range(1_000, 300_000) as u32;
                    f.slow_factor = (rng.range(2, 20), rng.range(20, 400));
                }
                FaultKind::Skew => f.skew_ms_max = rng.range(1, 500),
                FaultKind::Panic => f.panic_ppm = rng.range(1_000, 100_000) as u32,
                FaultKind::Abort => f.abort_ppm = rng.range(1_000, 100_000) as u32,
                FaultKind::Stall => {
                    f.skip_prefill_ppm = rng.range(0, 50_000) as u32;
                    f.never_send_ppm = rng.range(0, 50_000) as u32;
                    f.ghost_prefill_ppm = rng.range(0, 50_000) as u32;
                }
                FaultKind::Freeze => {
                    f.freeze_every_ms = rng.range(80, 1_500);
                    f.freeze_ms = (rng.range(1, 100), rng.range(100, 2_000));
                }
                FaultKind::Lie => f.liar_ppm = rng.range(1_000, 100_000) as u32,
            }
        }
        f
    }
}

impl fmt::Display for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_none() {
            return f.write_str("none");
        }
        // serde_json gives every field, in declaration order, without a hand-kept list.
        match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(map)) => {
                let parts: Vec<String> = map
                    .iter()
                    .filter(|(_, v)| !is_zero(v))
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                f.write_str(&parts.join(" "))
            }
            _ => write!(f, "{self:?}"),
        }
    }
}

fn is_zero(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Number(n) => n.as_u64() == Some(0),
        serde_json::Value::Array(a) => a.iter().all(is_zero),
        _ => false,
    }
}

/// Which control messages a [`Scripted::Drop`] rule drops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum MessageKind {
    /// Decode's transfer info.
    TransferInfo,
    /// Decode's `Queued`.
    Queued,
    /// Prefill's `Ready` (pull).
    Ready,
    /// Prefill's `Done` (push).
    Done,
    /// Decode's `ReadDone` (pull).
    ReadDone,
    /// `Rejected`.
    Rejected,
    /// `Abort`, either way.
    Abort,
    /// Prefill's `AbortAck` (push): its writes are over.
    AbortAck,
}

impl MessageKind {
    /// The kind of `msg`.
    pub fn of(msg: &PeerMessage) -> Self {
        match msg {
            PeerMessage::TransferInfo { .. } => Self::TransferInfo,
            PeerMessage::Queued => Self::Queued,
            PeerMessage::Ready { .. } => Self::Ready,
            PeerMessage::Done { .. } => Self::Done,
            PeerMessage::ReadDone => Self::ReadDone,
            PeerMessage::Rejected { .. } => Self::Rejected,
            PeerMessage::Abort { .. } => Self::Abort,
            PeerMessage::AbortAck => Self::AbortAck,
        }
    }
}

/// Which plane a partition cuts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub enum Plane {
    /// Control messages and data transfers (the link is down).
    #[default]
    Both,
    /// Control messages only: heartbeats stop, data still flows (the data path is a
    /// separate network, or shared memory).
    Control,
    /// Data transfers only: control messages and heartbeats still flow.
    Data,
}

impl Plane {
    /// Whether control messages (and heartbeats) are cut.
    pub fn cuts_control(self) -> bool {
        matches!(self, Plane::Both | Plane::Control)
    }

    /// Whether data transfers are cut.
    pub fn cuts_data(self) -> bool {
        matches!(self, Plane::Both | Plane::Data)
    }
}

/// Which workers a scripted fault hits.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Target {
    /// Every rank of one engine (`P0`, `D1`, ...).
    Engine(String),
    /// One worker, by engine and ranks.
    Rank {
        /// The engine.
        engine: String,
        /// Its dp rank.
        dp: u32,
        /// Its tp rank.
        tp: u32,
        /// Its pp rank.
        pp: u32,
    },
}

/// A fault placed by hand at a given virtual time (scenario tests), on top of drawn ones.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Scripted {
    /// The bootstrap server is down from `at_ms` for `for_ms`.
    BootstrapDown {
        /// Start, virtual ms.
        at_ms: u64,
        /// Duration, virtual ms.
        for_ms: u64,
    },
    /// The targeted workers crash at `at_ms` and restart `for_ms` later.
    Crash {
        /// Who.
        target: Target,
        /// When.
        at_ms: u64,
        /// Down time (at least one heartbeat window).
        for_ms: u64,
    },
    /// Messages between the target and everyone else are cut (only those from the target,
    /// if `one_way`) from `at_ms` for `for_ms`.
    Partition {
        /// Who is cut off.
        target: Target,
        /// When.
        at_ms: u64,
        /// How long.
        for_ms: u64,
        /// Only the target's outgoing messages are lost.
        one_way: bool,
        /// Which plane is cut.
        plane: Plane,
    },
    /// The targeted workers freeze at `at_ms` (as by SIGSTOP) and resume `for_ms` later:
    /// cut off from everyone meanwhile, the transfers they start held until they resume.
    Freeze {
        /// Who.
        target: Target,
        /// When.
        at_ms: u64,
        /// How long.
        for_ms: u64,
    },
    /// Every request the targeted workers hold at `at_ms` (live, or ended and still
    /// holding blocks behind a fence) has its actor panic.
    Panic {
        /// Whose requests.
        target: Target,
        /// When.
        at_ms: u64,
    },
    /// Every message of this kind is lost, during the safety phase.
    Drop(MessageKind),
}

/// What the simulated data plane does with a transfer whose blocks were taken back by
/// their engine (released by the runtime, then freed or reused) while it was in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum DataPlane {
    /// RDMA semantics: a posted write or read lands whatever happened since; landing in
    /// destination blocks their request no longer owns is an integrity violation.
    Rdma,
    /// The target checks the grant at landing (as a TCP receiver can, or RDMA with
    /// per-request memory windows invalidated on release): such a transfer fails instead.
    Fenced,
}

impl FromStr for DataPlane {
    type Err = SimError;
    fn from_str(s: &str) -> Result<Self, SimError> {
        match s {
            "rdma" => Ok(Self::Rdma),
            "fenced" => Ok(Self::Fenced),
            other => Err(SimError::Config(format!(
                "data plane {other:?}: expected rdma or fenced"
            ))),
        }
    }
}

/// One simulation, fully described.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The seed every decision is drawn from.
    pub seed: u64,
    /// The cluster.
    pub shape: Shape,
    /// The requests.
    pub workload: Workload,
    /// Deadlines and delays.
    pub timing: Timing,
    /// The drawn faults' rates.
    pub faults: Faults,
    /// Faults placed by hand.
    pub script: Vec<Scripted>,
    /// What a transfer into taken-back blocks does.
    pub data_plane: DataPlane,
    /// Keep each live request's last trace lines for violation reports (memory and time;
    /// turn off for very large runs).
    pub request_lines: bool,
    /// Print every trace line as it happens.
    pub echo_trace: bool,
    /// Keep every request's per-rank outcome in the report (tests).
    pub keep_outcomes: bool,
}

impl SimConfig {
    /// A small default cluster with `seed` and no faults.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            shape: Shape::default(),
            workload: Workload::default(),
            timing: Timing::default(),
            faults: Faults::default(),
            script: Vec::new(),
            data_plane: DataPlane::Fenced,
            request_lines: true,
            echo_trace: false,
            keep_outcomes: false,
        }
    }

    /// Checks everything can be built.
    pub fn validate(&self) -> Result<(), SimError> {
        self.shape.validate()?;
        let t = &self.timing;
        if t.delay_ms.0 == 0 || t.delay_ms.1 < t.delay_ms.0 {
            return Err(SimError::Config(
                "delay_ms must be a range of at least 1 ms".into(),
            ));
        }
        if t.blocks_per_ms == 0 || t.heartbeat_ms == 0 || t.query_timeout_ms == 0 {
            return Err(SimError::Config(
                "blocks_per_ms, heartbeat_ms and query_timeout_ms must be positive".into(),
            ));
        }
        if u64::from(self.workload.blocks_per_request_max) > u64::from(self.shape.blocks_per_worker)
            || self.workload.blocks_per_request_max == 0
        {
            return Err(SimError::Config(
                "blocks_per_request_max must be in 1..=blocks_per_worker".into(),
            ));
        }
        Ok(())
    }
}

impl fmt::Display for SimConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.shape;
        writeln!(f, "seed: {}", self.seed)?;
        writeln!(
            f,
            "cluster: {} prefill engines (dp ranks {:?}, tp {}, pp {}), {} decode engines (dp {}, tp {}), {} workers on {} host(s), {} blocks x {} B each, mode {:?}",
            s.prefill_engines,
            s.prefill_dp_ranks,
            s.tp,
            s.pp,
            s.decode_engines,
            s.decode_dp,
            s.decode_tp(),
            s.workers(),
            s.hosts,
            s.blocks_per_worker,
            s.block_bytes,
            s.mode
        )?;
        let w = &self.workload;
        writeln!(
            f,
            "workload: {} requests + {} liveness, gap <= {} ms, <= {} per arrival, <= {} blocks, compute {:?} ms",
            w.requests,
            w.liveness_requests,
            w.arrival_gap_ms_max,
            w.burst_max,
            w.blocks_per_request_max,
            w.compute_ms
        )?;
        let t = &self.timing;
        writeln!(
            f,
            "timing: timeouts {:?}, lifetime_max {:?}, heartbeat {} ms, delay {:?} ms",
            t.timeouts,
            t.timeouts.lifetime_max(),
            t.heartbeat_ms,
            t.delay_ms
        )?;
        writeln!(
            f,
            "faults: {} (data plane {:?})",
            self.faults, self.data_plane
        )?;
        if !self.script.is_empty() {
            writeln!(f, "script: {:?}", self.script)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_lists_parse_and_unknown_names_are_named_errors() {
        assert_eq!("none".parse::<FaultPlan>().unwrap(), FaultPlan::None);
        assert_eq!("swarm".parse::<FaultPlan>().unwrap(), FaultPlan::Swarm);
        assert_eq!(
            "loss, crash".parse::<FaultPlan>().unwrap(),
            FaultPlan::Kinds(vec![FaultKind::Loss, FaultKind::Crash])
        );
        let err = "loss,gremlins".parse::<FaultPlan>().unwrap_err();
        assert!(err.to_string().contains("gremlins"), "{err}");
    }

    #[test]
    fn swarm_draws_differ_between_seeds_and_print_every_rate() {
        let a = Faults::from_plan(&FaultPlan::Swarm, 1);
        let b = Faults::from_plan(&FaultPlan::Swarm, 2);
        assert_ne!(a, b);
        assert_eq!(a, Faults::from_plan(&FaultPlan::Swarm, 1));
        let all = Faults::from_plan(&FaultPlan::Kinds(FaultKind::ALL.to_vec()), 0);
        let text = all.to_string();
        for key in [
            "loss_ppm",
            "partition_every_ms",
            "skew_ms_max",
            "never_send_ppm",
            "liar_ppm",
        ] {
            assert!(text.contains(key), "{text}");
        }
        assert_eq!(Faults::default().to_string(), "none");
    }
}
