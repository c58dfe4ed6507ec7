//! The simulated cluster: its workers (real runtimes), the engines above them, the
//! workload, the faults, and the checks, driven by one main loop in virtual time.
//!
//! The main loop owns everything but the network. Each turn it runs the engine actions
//! due now (open a request on a rank, hand blocks over, crash a worker, ...), then the
//! network's due events, then drains every busy runtime's events and checks them, then
//! sleeps until the next thing is due. The runtimes' actors run whenever the loop sleeps;
//! tokio's paused clock jumps forward only when every actor is idle.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use handoff_actors::machine::QUARANTINE_ASK_EVERY;
use handoff_actors::{
    Attach, BlockId, Doorbells, EngineId, Error as ActorError, Event, KvLayout, LayerSpan,
    RankInfo, ReceiverHandle, ReceiverSpec, Region, RegionError, RequestId, Role, Runtime,
    SenderHandle, State, TransferMode, TransportChoice,
};

use crate::agenda::Agenda;
use crate::config::{Plane, Scripted, Shape, SimConfig, Target, SIM_BLOCK_TOKENS};
use crate::live::Live;
use crate::net::{req_index, SimAttach, SimNet};
use crate::pool::Pool;
use crate::report::{
    Invariant, Outcomes, Percentiles, RankOutcome, Report, RequestOutcome, Violation,
};
use crate::rng::{Rng, PPM};
use crate::trace::{push_blocks, push_num, Fnv64, Trace};
use crate::SimError;
use handoff_transport::tp::{HeadGeometry, HeadOrder};
use handoff_transport::KvHeads;

/// How often the engines drain their runtimes' events, virtual ms. One tick is the
/// resolution of every time the checks measure.
pub const DRAIN_STEP_MS: u64 = 1;

/// Extra time a rank may take past `Timeouts::lifetime_max()` before it counts as hung.
/// Each of a request's three deadlines is armed with a tokio timer that fires on the next
/// whole millisecond (+1 ms each, 3 in all), the engine sees the final event at its next
/// drain (+[`DRAIN_STEP_MS`]), and a timeout message is handled at the instant it fires.
/// 10 ms leaves room for two more ticks of scheduling and nothing else.
pub const HANG_SLACK_MS: u64 = 10;
const _: () = assert!(HANG_SLACK_MS > 3 + DRAIN_STEP_MS);

/// Requests whose engine could not get blocks wait at most this many per worker; past it
/// the request is left to its deadline (the engine drops the work).
pub const BLOCK_WAITERS_MAX: usize = 4_096;

enum Handle {
    Sender(SenderHandle),
    Receiver(ReceiverHandle),
}

/// Hand-over the engine still owes a request on a worker, waiting for free blocks.
#[derive(Clone, Copy)]
struct Waiter {
    req: u64,
    inc: u32,
}

struct Worker {
    idx: usize,
    /// `w<idx>.<inc>`, as the trace names this incarnation (written once, not per line).
    name: String,
    rank: RankInfo,
    role: Role,
    mode: TransferMode,
    inc: u32,
    rt: Option<Runtime>,
    region: Arc<Region>,
    pool: Arc<Mutex<Pool>>,
    handles: BTreeMap<u64, Handle>,
    waiters: VecDeque<Waiter>,
}

impl Worker {
    fn pool(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank of one request, as the checks see it.
#[derive(Debug)]
struct RankRec {
    worker: usize,
    inc: u32,
    role: Role,
    tp: u32,
    pp: u32,
    opened_ms: u64,
    handed: Vec<BlockId>,
    released: Vec<BlockId>,
    state: State,
    end_ms: Option<u64>,
}

/// Faults the engine applies to one request.
#[derive(Clone, Copy, Debug, Default)]
struct ReqFaults {
    saturated: bool,
    never_send: bool,
    skip_prefill: bool,
    ghost: bool,
}

impl ReqFaults {
    /// Appends the faults as `{:?}` writes them (the `arrive` trace line, once per request),
    /// without the formatting machinery.
    fn push_text(&self, s: &mut String) {
        let flag = |s: &mut String, name: &str, on: bool| {
            s.push_str(name);
            s.push_str(if on { "true" } else { "false" });
        };
        flag(s, "ReqFaults { saturated: ", self.saturated);
        flag(s, ", never_send: ", self.never_send);
        flag(s, ", skip_prefill: ", self.skip_prefill);
        flag(s, ", ghost: ", self.ghost);
        s.push_str(" }");
    }
}

/// A role as `{}` writes it.
fn role_text(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

/// A transfer mode as `{:?}` writes it.
fn mode_text(mode: TransferMode) -> &'static str {
    match mode {
        TransferMode::Push => "Push",
        TransferMode::Pull => "Pull",
    }
}

#[derive(Debug)]
struct ReqRec {
    id: RequestId,
    arrived_ms: u64,
    blocks: u32,
    mode: TransferMode,
    prefill_pp: u32,
    liveness: bool,
    faults: ReqFaults,
    pgroup: usize,
    dgroup: usize,
    opens_pending: u32,
    ranks: Vec<RankRec>,
    /// Ranks that could not open (worker down, runtime refused).
    unopened: u32,
}

#[derive(Clone, Copy, Debug)]
enum Action {
    Arrive { req: u64, liveness: bool },
    Open { req: u64, worker: usize },
    HandOver { req: u64, worker: usize, inc: u32 },
    Abort { req: u64, worker: usize, inc: u32 },
    Panic { req: u64, worker: usize, inc: u32 },
    PanicAll { worker: usize },
    Crash { worker: usize, down_ms: u64 },
    Restart { worker: usize },
    BootstrapUp,
    FaultTick(TickKind),
    ScriptedPartition(usize),
    Freeze { worker: usize, for_ms: u64 },
}

/// A scripted partition: when, who, (one way?, which plane), how long.
type ScriptedPartition = (u64, BTreeSet<usize>, (bool, Plane), u64);

#[derive(Clone, Copy, Debug)]
enum TickKind {
    Partition,
    Crash,
    BootstrapOutage,
    Freeze,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Safety,
    Liveness,
    Done,
}

/// The whole simulated cluster.
pub(crate) struct World {
    cfg: SimConfig,
    net: Arc<SimNet>,
    attach: Arc<dyn Attach>,
    workers: Vec<Worker>,
    prefill_groups: Vec<(u32, u32, Vec<usize>)>,
    decode_groups: Vec<(u32, u32, Vec<usize>)>,
    agenda: Agenda<Action>,
    load: Rng,
    chaos: Rng,
    reqs: Live<ReqRec>,
    /// Each open rank's hang deadline, as (deadline, request, worker, incarnation), in
    /// that order and without repeats, as a B-tree set would hold them. A queue: ranks open
    /// in time order with one lifetime each, so a new deadline goes at the back or a few
    /// places before it, and the due ones come off the front.
    deadlines: VecDeque<(u64, u64, usize, u32)>,
    trace: Trace,
    violations: Vec<Violation>,
    phase: Phase,
    next_req: u64,
    safety_end: u64,
    liveness_end: u64,
    partition_seq: u64,
    safety: Outcomes,
    liveness: Outcomes,
    latencies: Vec<u64>,
    injected: BTreeMap<String, u64>,
    last_progress_ms: u64,
    scripted_outages: BTreeMap<u64, u64>,
    scripted_partitions: Vec<ScriptedPartition>,
    awaiting_registration: bool,
    /// Liveness requests arrive no earlier: the peer tables have decided about what they
    /// stopped hearing during the faults (`SimNet::settle_ms`).
    settled_at: u64,
    outcomes: Vec<RequestOutcome>,
    /// The drained events of one runtime, as the main loop handles them (kept for reuse).
    events: Vec<Event>,
    /// One block's bytes, as prefill fills it or the integrity check expects it (kept for
    /// reuse: a block is written and checked once per request and rank).
    block_bytes: Vec<u8>,
    /// A bit per worker, set while it holds a handle (`Worker::handles` not empty): whether
    /// any is busy, without looking at every worker of a thousand.
    busy: Vec<u64>,
    /// A bit per worker, rung by its runtime as it queues an event: a turn drains only
    /// workers holding a handle whose bell rang (most of a thousand have nothing new in a
    /// given millisecond, and looking at each cost a cache miss or two).
    bells: Arc<Doorbells>,
}

fn rank_info(engine: &str, dp: (u32, u32), tp: (u32, u32), pp: (u32, u32)) -> RankInfo {
    RankInfo {
        engine_id: EngineId::new(engine),
        dp_rank: dp.0,
        dp_size: dp.1,
        tp_rank: tp.0,
        tp_size: tp.1,
        pp_rank: pp.0,
        pp_size: pp.1,
    }
}

/// The whole `k`-th block of request `req` on tp rank `tp`, as decode must end up
/// holding it. A prefill pipeline rank holds only its layers: its slice of this pattern
/// ([`pipeline_range`]), and writes only that slice of decode's block.
fn pattern(req: u64, tp: u32, k: usize, block_bytes: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(block_bytes);
    pattern_into(&mut out, req, tp, k, block_bytes);
    out
}

/// [`pattern`], written into `out` (cleared first): the world fills and checks every
/// block of every request through one buffer rather than a new one per block.
fn pattern_into(out: &mut Vec<u8>, req: u64, tp: u32, k: usize, block_bytes: usize) {
    let mut rng = Rng::new(req.wrapping_mul(0x9e37_79b9) ^ (u64::from(tp) << 40) ^ k as u64);
    out.clear();
    while out.len() < block_bytes {
        out.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    out.truncate(block_bytes);
}

/// The layers prefill pipeline rank `pp_rank` of `pp_size` holds of a model of `layers`
/// (`layers > 0`): an uneven split when `pp_size` does not divide `layers`.
fn stage_layers(layers: u32, pp_rank: u32, pp_size: u32) -> LayerSpan {
    let pp = u64::from(pp_size.max(1));
    let at = |r: u32| (u64::from(layers) * u64::from(r) / pp) as u32;
    LayerSpan {
        first: at(pp_rank),
        count: at(pp_rank + 1) - at(pp_rank),
        total: layers,
    }
}

/// Where, in a block of `len` bytes, the slice a worker at `rank` holds lies: its pipeline
/// share (an equal byte share without layers, its layers' bytes with them). Decode holds
/// whole blocks.
fn pipeline_range(shape: &Shape, len: usize, rank: &RankInfo) -> Range<usize> {
    let (start, part) = if shape.layers == 0 {
        let part = len / rank.pp_size.max(1) as usize;
        (part * rank.pp_rank as usize, part)
    } else {
        let layer = len / shape.layers as usize;
        let span = stage_layers(shape.layers, rank.pp_rank, rank.pp_size);
        (span.first as usize * layer, span.count as usize * layer)
    };
    start.min(len)..(start + part).min(len)
}

/// A worker's region: each pipeline rank holds its share of every block; with layers, laid
/// out as its side's [`Shape::prefill_layout`] or [`Shape::decode_layout`] says.
fn worker_region(shape: &Shape, rank: &RankInfo, role: Role) -> Result<Region, RegionError> {
    if shape.layers == 0 {
        return Region::new(
            shape.blocks_per_worker,
            shape.block_bytes / rank.pp_size.max(1) as usize,
        );
    }
    let (layout, span) = match role {
        Role::Prefill => (
            shape.prefill_layout,
            stage_layers(shape.layers, rank.pp_rank, rank.pp_size),
        ),
        Role::Decode => (shape.decode_layout, stage_layers(shape.layers, 0, 1)),
    };
    let half = shape.block_bytes / (2 * shape.layers as usize);
    let Some((heads, held)) = held_heads(shape, rank, role) else {
        let mut kv = KvLayout::shaped(layout.shape(), span.count, shape.blocks_per_worker, half);
        kv.layers = span;
        return Region::alloc(kv);
    };
    // This rank's share of the model's heads in each K and V half.
    let half = half / shape.kv_heads as usize * held.len();
    let mut kv = KvLayout::shaped(layout.shape(), span.count, shape.blocks_per_worker, half);
    kv.layers = span;
    kv.block_tokens = SIM_BLOCK_TOKENS;
    kv.heads = Some(heads);
    Region::alloc(kv)
}

/// How a worker's blocks hold heads, and which of the model's it holds, when the shape
/// has heads: prefill head-major, decode token-major (so every transfer reorders them).
fn held_heads(shape: &Shape, rank: &RankInfo, role: Role) -> Option<(KvHeads, Range<u32>)> {
    if shape.kv_heads == 0 || shape.layers == 0 {
        return None;
    }
    let held =
        handoff_transport::tp::rank_heads(shape.kv_heads, rank.tp_size, rank.tp_rank).ok()?;
    let per_part = shape.block_bytes / (2 * shape.layers as usize);
    let head_bytes = (per_part / (shape.kv_heads as usize * SIM_BLOCK_TOKENS as usize)) as u64;
    let order = match role {
        Role::Prefill => HeadOrder::HeadMajor,
        Role::Decode => HeadOrder::TokenMajor,
    };
    Some((
        KvHeads {
            kv_heads: shape.kv_heads,
            order,
            head_bytes,
        },
        held,
    ))
}

/// The bytes of `whole` (the model's block: every part's heads, head-major) that a worker
/// at `rank` holds: its heads of every part, in its order.
fn head_part(shape: &Shape, whole: &[u8], rank: &RankInfo, role: Role) -> Option<Vec<u8>> {
    let (heads, held) = held_heads(shape, rank, role)?;
    let geometry = |order, count| HeadGeometry {
        order,
        heads: count,
        block_tokens: SIM_BLOCK_TOKENS,
        head_bytes: heads.head_bytes,
    };
    let model = geometry(HeadOrder::HeadMajor, shape.kv_heads);
    let mine = geometry(heads.order, held.end - held.start);
    let (model_part, part) = (model.block_bytes()? as usize, mine.block_bytes()? as usize);
    let parts = whole.len() / model_part.max(1);
    let hb = heads.head_bytes as usize;
    let mut out = vec![0u8; parts * part];
    for p in 0..parts {
        for h in 0..mine.heads {
            for t in 0..SIM_BLOCK_TOKENS {
                let from = p * model_part + model.offset(held.start + h, t) as usize;
                let to = p * part + mine.offset(h, t) as usize;
                out[to..to + hb].copy_from_slice(&whole[from..from + hb]);
            }
        }
    }
    Some(out)
}

/// A worker's bytes of the `k`-th block of request `req`: with heads, its heads of the
/// model's block; otherwise its tp rank's block, or its pipeline share of it.
/// Written into `out` (replacing what it held).
fn worker_bytes(
    out: &mut Vec<u8>,
    (shape, req, k): (&Shape, u64, usize),
    rank: &RankInfo,
    role: Role,
) {
    if shape.kv_heads > 0 {
        let whole = pattern(req, 0, k, shape.block_bytes);
        if let Some(mine) = head_part(shape, &whole, rank, role) {
            *out = mine;
            return;
        }
    }
    pattern_into(out, req, rank.tp_rank, k, shape.block_bytes);
    let whole = out;
    if role == Role::Prefill {
        // Its pipeline share, cut out of the pattern in place (all of it without pp).
        let part = pipeline_range(shape, whole.len(), rank);
        whole.truncate(part.end);
        whole.drain(..part.start);
    }
}

/// The checksum decode's blocks of `req` must hold; `scratch` holds each block's bytes
/// in turn.
fn expected_checksum(
    scratch: &mut Vec<u8>,
    shape: &Shape,
    req: u64,
    rank: &RankInfo,
    blocks: usize,
) -> u64 {
    let mut h = Fnv64::new();
    for k in 0..blocks {
        worker_bytes(scratch, (shape, req, k), rank, Role::Decode);
        h.bytes(scratch);
    }
    h.finish()
}

fn state_text(s: &State) -> String {
    s.to_string()
}

/// Writes a worker and its incarnation as the trace names them (`w3.1`): the current
/// incarnation's name as the worker keeps it, an earlier one's written out.
fn who(s: &mut String, worker: &Worker, inc: u32) {
    if worker.inc == inc {
        return s.push_str(&worker.name);
    }
    s.push('w');
    push_num(s, worker.idx as u64);
    s.push('.');
    push_num(s, u64::from(inc));
}

/// Writes request `req` as the trace names it (`r7`): its id when live (the same text),
/// else written out.
fn push_req(s: &mut String, rec: Option<&ReqRec>, req: u64) {
    match rec {
        Some(rec) => s.push_str(rec.id.as_str()),
        None => {
            s.push('r');
            push_num(s, req);
        }
    }
}

impl World {
    /// Builds the cluster and starts every worker's runtime (inside the simulation's runtime).
    pub(crate) async fn new(cfg: SimConfig) -> Result<Self, SimError> {
        let s = cfg.shape.clone();
        let mut ranks: Vec<(RankInfo, Role, TransferMode)> = Vec::new();
        let mut prefill_groups = Vec::new();
        let mut decode_groups = Vec::new();
        let dp_size = s.prefill_dp_ranks.len() as u32;
        for e in 0..s.prefill_engines {
            for &dp in &s.prefill_dp_ranks {
                let mut group = Vec::new();
                for tp in 0..s.tp {
                    for pp in 0..s.pp {
                        group.push(ranks.len());
                        let r = rank_info(&format!("P{e}"), (dp, dp_size), (tp, s.tp), (pp, s.pp));
                        ranks.push((r, Role::Prefill, TransferMode::Push));
                    }
                }
                prefill_groups.push((e, dp, group));
            }
        }
        for e in 0..s.decode_engines {
            for dp in 0..s.decode_dp {
                let mut group = Vec::new();
                let decode_tp = s.decode_tp();
                for tp in 0..decode_tp {
                    group.push(ranks.len());
                    let r = rank_info(&format!("D{e}"), (dp, s.decode_dp), (tp, decode_tp), (0, 1));
                    ranks.push((r, Role::Decode, s.mode.of(e)));
                }
                decode_groups.push((e, dp, group));
            }
        }
        // The ranks of each (engine, dp rank), in rank order: grouped once, rather than
        // every rank scanning every other (a million comparisons at a thousand workers).
        let mut groups: BTreeMap<(&EngineId, u32), Vec<&RankInfo>> = BTreeMap::new();
        for (r, _, _) in &ranks {
            groups.entry((&r.engine_id, r.dp_rank)).or_default().push(r);
        }
        let siblings: Vec<Vec<RankInfo>> = ranks
            .iter()
            .map(|(me, _, _)| {
                groups
                    .get(&(&me.engine_id, me.dp_rank))
                    .map(|group| {
                        group
                            .iter()
                            .filter(|r| **r != me)
                            .map(|r| (*r).clone())
                            .collect()
                    })
                    .unwrap_or_default()
            })
            .collect();
        let drops = cfg
            .script
            .iter()
            .filter_map(|s| match s {
                Scripted::Drop(kind) => Some(*kind),
                _ => None,
            })
            .collect();
        let net = SimNet::new(
            cfg.seed,
            ranks
                .iter()
                .map(|(r, role, _)| (r.clone(), *role))
                .collect(),
            siblings,
            cfg.faults.clone(),
            cfg.timing.clone(),
            drops,
            (cfg.data_plane, s.clone()),
        );
        let attach: Arc<dyn Attach> = Arc::new(SimAttach(net.clone()));
        let mut workers = Vec::with_capacity(ranks.len());
        for (idx, (rank, role, mode)) in ranks.into_iter().enumerate() {
            let region = Arc::new(worker_region(&s, &rank, role)?);
            workers.push(Worker {
                idx,
                name: format!("w{idx}.0"),
                rank,
                role,
                mode,
                inc: 0,
                rt: None,
                region,
                pool: Arc::new(Mutex::new(Pool::new(s.blocks_per_worker))),
                handles: BTreeMap::new(),
                waiters: VecDeque::new(),
            });
        }
        let workers_len = workers.len();
        let mut world = Self {
            load: Rng::fork(cfg.seed, "load"),
            chaos: Rng::fork(cfg.seed, "chaos"),
            trace: Trace::new(cfg.request_lines),
            cfg,
            net,
            attach,
            workers,
            prefill_groups,
            decode_groups,
            agenda: Agenda::new(),
            reqs: Live::new(),
            deadlines: VecDeque::new(),
            violations: Vec::new(),
            phase: Phase::Safety,
            next_req: 0,
            safety_end: 0,
            liveness_end: 0,
            partition_seq: 0,
            safety: Outcomes::default(),
            liveness: Outcomes::default(),
            latencies: Vec::new(),
            injected: BTreeMap::new(),
            last_progress_ms: 0,
            scripted_outages: BTreeMap::new(),
            scripted_partitions: Vec::new(),
            awaiting_registration: false,
            settled_at: 0,
            outcomes: Vec::new(),
            events: Vec::new(),
            block_bytes: Vec::new(),
            busy: vec![0; workers_len.div_ceil(64)],
            bells: Doorbells::new(workers_len),
        };
        world.trace.echo(world.cfg.echo_trace);
        world.start_cluster().await?;
        Ok(world)
    }

    async fn start_cluster(&mut self) -> Result<(), SimError> {
        let down = self.cfg.faults.bootstrap_down_at_start_ms;
        if down > 0 {
            self.net.set_bootstrap_up(false);
            self.schedule(down, Action::BootstrapUp);
            self.count("bootstrap_outage");
            self.trace.record(0, None, |s| {
                write!(s, "bootstrap down at start for {down} ms")
            });
        }
        for w in 0..self.workers.len() {
            self.start_worker(w).await?;
        }
        for s in self.cfg.script.clone() {
            self.schedule_scripted(&s);
        }
        let f = &self.cfg.faults;
        let ticks = [
            (f.partition_every_ms, TickKind::Partition),
            (f.crash_every_ms, TickKind::Crash),
            (f.bootstrap_outage_every_ms, TickKind::BootstrapOutage),
            (f.freeze_every_ms, TickKind::Freeze),
        ];
        for (every, kind) in ticks {
            if every > 0 {
                let at = self.chaos.range(every / 2, every + every / 2);
                self.schedule(at, Action::FaultTick(kind));
            }
        }
        self.safety_end = self.cfg.workload.requests;
        self.liveness_end = self.safety_end + self.cfg.workload.liveness_requests;
        if self.cfg.workload.requests > 0 {
            self.schedule(
                1,
                Action::Arrive {
                    req: 0,
                    liveness: false,
                },
            );
        }
        Ok(())
    }

    async fn start_worker(&mut self, w: usize) -> Result<(), SimError> {
        let timeouts = self.cfg.timing.timeouts;
        let worker = &mut self.workers[w];
        self.net
            .set_memory(w, worker.inc, worker.region.clone(), worker.pool.clone());
        let mut rt = Runtime::builder(worker.role, worker.rank.clone());
        if let Some(bell) = self.bells.bell(w) {
            rt = rt.doorbell(bell);
        }
        let rt = rt
            .timeouts(timeouts)
            .mode(worker.mode)
            .transport(TransportChoice::Custom(self.attach.clone()))
            .region(worker.region.clone())
            .start()
            .await?;
        worker.rt = Some(rt);
        Ok(())
    }

    fn now(&self) -> u64 {
        self.net.now_ms()
    }

    fn schedule(&mut self, at: u64, action: Action) {
        self.agenda.push(at, action);
    }

    fn count(&mut self, what: &str) {
        *self.injected.entry(what.to_string()).or_insert(0) += 1;
    }

    fn violate(&mut self, invariant: Invariant, req: Option<u64>, detail: String) {
        let lines = match req {
            Some(r) if self.cfg.request_lines => self.trace.request_lines(r),
            _ => self.trace.tail(),
        };
        let t_ms = self.now();
        self.violations.push(Violation {
            invariant,
            t_ms,
            request: req,
            detail,
            lines,
        });
    }

    /// Runs both phases to the end (or the first violation) and reports.
    pub(crate) async fn run(mut self) -> Report {
        loop {
            let now = self.now();
            self.turn(now).await;
            if !self.violations.is_empty() || self.phase == Phase::Done {
                break;
            }
            let next = self.next_wake(now);
            self.net.set_wake_at(next);
            let sleep = tokio::time::sleep_until(self.net.instant(next));
            tokio::select! {
                biased;
                _ = self.net.notified() => {}
                _ = sleep => {}
            }
        }
        self.finish().await
    }

    fn next_wake(&self, now: u64) -> u64 {
        let busy = !self.reqs.is_empty() || self.busy.iter().any(|&bits| bits != 0);
        let mut next = if busy { now + DRAIN_STEP_MS } else { u64::MAX };
        if let Some(t) = self.agenda.next_time() {
            next = next.min(t);
        }
        if let Some(t) = self.net.next_due() {
            next = next.min(t);
        }
        if next == u64::MAX {
            // Nothing scheduled and nothing live: the phase logic moves on next turn.
            next = now + DRAIN_STEP_MS;
        }
        next.max(now + 1).min(now.max(next))
    }

    async fn turn(&mut self, now: u64) {
        while let Some((_, action)) = self.agenda.pop_due(now) {
            self.act(now, action).await;
            if !self.violations.is_empty() {
                return;
            }
        }
        self.net.run_due(now);
        self.fold_net_notes();
        self.drain(now);
        self.check_deadlines(now);
        self.advance_phase(now).await;
    }

    fn fold_net_notes(&mut self) {
        let (notes, findings) = self.net.take_notes();
        for n in notes {
            self.trace.record(n.t_ms, n.req, |s| s.write_str(&n.text));
        }
        for f in findings {
            self.violate(Invariant::Integrity, f.req, f.detail);
        }
    }

    async fn act(&mut self, now: u64, action: Action) {
        match action {
            Action::Arrive { req, liveness } => self.arrive(now, req, liveness),
            Action::Open { req, worker } => self.open(now, req, worker),
            Action::HandOver { req, worker, inc } => self.hand_over(now, req, worker, inc, true),
            Action::Abort { req, worker, inc } => {
                let aborted = match self.live_handle(req, worker, inc) {
                    Some(Handle::Sender(h)) => {
                        h.abort();
                        true
                    }
                    Some(Handle::Receiver(h)) => {
                        h.abort();
                        true
                    }
                    None => false,
                };
                if aborted {
                    self.count("engine_abort");
                    self.trace.record(now, Some(req), |s| {
                        write!(s, "w{worker} engine aborts r{req}")
                    });
                }
            }
            Action::Panic { req, worker, inc } => {
                if self.live_handle(req, worker, inc).is_some() {
                    self.panic(now, req, worker);
                }
            }
            Action::PanicAll { worker } => {
                let held: Vec<u64> = self.workers[worker].handles.keys().copied().collect();
                for req in held {
                    self.panic(now, req, worker);
                }
            }
            Action::Crash { worker, down_ms } => self.crash(now, worker, down_ms).await,
            Action::Restart { worker } => self.restart(now, worker).await,
            Action::BootstrapUp => {
                self.net.set_bootstrap_up(true);
                self.trace
                    .record(now, None, |s| s.write_str("bootstrap up"));
            }
            Action::FaultTick(kind) => self.fault_tick(now, kind),
            Action::Freeze { worker, for_ms } => self.freeze(now, worker, for_ms),
            Action::ScriptedPartition(i) => {
                if let Some((_, group, how, for_ms)) = self.scripted_partitions.get(i).cloned() {
                    self.start_partition(now, group, how, for_ms);
                }
            }
        }
    }

    /// Makes the actor of `req` on `worker` panic.
    fn panic(&mut self, now: u64, req: u64, worker: usize) {
        if let Some(rt) = &self.workers[worker].rt {
            rt.inject_panic(&RequestId::new(format!("r{req}")));
            self.count("actor_panic");
            self.trace.record(now, Some(req), |s| {
                write!(s, "w{worker} panic injected in r{req}")
            });
        }
    }

    fn live_handle(&self, req: u64, worker: usize, inc: u32) -> Option<&Handle> {
        let w = &self.workers[worker];
        if w.inc != inc || w.rt.is_none() {
            return None;
        }
        w.handles.get(&req)
    }

    // ----- the workload -----

    /// A burst of requests arrives; the next burst is scheduled.
    fn arrive(&mut self, now: u64, first: u64, liveness: bool) {
        let end = if liveness {
            self.liveness_end
        } else {
            self.safety_end
        };
        let burst = self.load.range(1, self.cfg.workload.burst_max);
        let last = (first + burst).min(end);
        self.next_req = last;
        if last < end {
            let gap = self.load.range(0, self.cfg.workload.arrival_gap_ms_max);
            self.schedule(
                now + gap,
                Action::Arrive {
                    req: last,
                    liveness,
                },
            );
        }
        for req in first..last {
            self.arrive_one(now, req, liveness);
        }
    }

    fn arrive_one(&mut self, now: u64, req: u64, liveness: bool) {
        let f = if liveness {
            Default::default()
        } else {
            self.cfg.faults.clone()
        };
        let pg = self.load.below(self.prefill_groups.len() as u64) as usize;
        let dg = self.load.below(self.decode_groups.len() as u64) as usize;
        let blocks =
            self.load
                .range(1, u64::from(self.cfg.workload.blocks_per_request_max)) as u32;
        let rf = ReqFaults {
            saturated: self.chaos.chance(f.saturation_ppm),
            never_send: self.chaos.chance(f.never_send_ppm),
            skip_prefill: self.chaos.chance(f.skip_prefill_ppm),
            ghost: self.chaos.chance(f.ghost_prefill_ppm),
        };
        if self.chaos.chance(f.liar_ppm) {
            self.net.lie_for(req);
        }
        let (pworkers, dworkers) = (&self.prefill_groups[pg].2, &self.decode_groups[dg].2);
        let mode = self.workers[dworkers[0]].mode;
        self.net.engage(self.pairs(pg, dg), true);
        let mut opens: Vec<usize> = Vec::with_capacity(pworkers.len() + dworkers.len());
        if !rf.skip_prefill && !rf.ghost {
            opens.extend(pworkers);
        }
        opens.extend(dworkers);
        let mut id = String::with_capacity(12);
        id.push('r');
        push_num(&mut id, req);
        let id = RequestId::new(id);
        self.trace.record(now, Some(req), |s| {
            s.push_str("arrive r");
            push_num(s, req);
            s.push_str(" P-group ");
            push_num(s, pg as u64);
            s.push_str(" D-group ");
            push_num(s, dg as u64);
            s.push_str(" blocks ");
            push_num(s, u64::from(blocks));
            s.push(' ');
            s.push_str(mode_text(mode));
            s.push(' ');
            rf.push_text(s);
            if liveness {
                s.push_str(" liveness");
            }
            Ok(())
        });
        for &w in &opens {
            let skew = self.chaos.range(0, f.skew_ms_max);
            self.schedule(now + skew, Action::Open { req, worker: w });
        }
        for (ppm, what) in [(f.panic_ppm, 0u8), (f.abort_ppm, 1u8)] {
            if self.chaos.chance(ppm) {
                let Some(&w) = self.chaos.pick(&opens) else {
                    continue;
                };
                let at = now + f.skew_ms_max + self.chaos.range(0, 60);
                let inc = self.workers[w].inc;
                let action = if what == 0 {
                    Action::Panic {
                        req,
                        worker: w,
                        inc,
                    }
                } else {
                    Action::Abort {
                        req,
                        worker: w,
                        inc,
                    }
                };
                self.schedule(at, action);
            }
        }
        self.reqs.insert(
            req,
            ReqRec {
                id,
                arrived_ms: now,
                blocks,
                mode,
                prefill_pp: self.cfg.shape.pp,
                liveness,
                faults: rf,
                pgroup: pg,
                dgroup: dg,
                opens_pending: opens.len() as u32,
                ranks: Vec::with_capacity(opens.len()),
                unopened: 0,
            },
        );
    }

    fn open(&mut self, now: u64, req: u64, w: usize) {
        let Some(rec) = self.reqs.get_mut(&req) else {
            return;
        };
        rec.opens_pending = rec.opens_pending.saturating_sub(1);
        let (id, blocks, faults) = (rec.id.clone(), rec.blocks, rec.faults);
        let worker = &self.workers[w];
        let Some(rt) = &worker.rt else {
            rec.unopened += 1;
            self.trace.record(now, Some(req), |s| {
                write!(s, "w{w} is down: r{req} not opened there")
            });
            return self.settle_if_done(req);
        };
        let inc = worker.inc;
        let opened = match worker.role {
            Role::Prefill => rt.sender(id.clone()).map(Handle::Sender),
            Role::Decode => {
                let (pg_engine, pg_dp) = self.prefill_of(req);
                let prefill = if faults.ghost {
                    EngineId::new("Pghost")
                } else {
                    self.prefill_engine(req, pg_engine)
                };
                // One dp rank: sometimes let the runtime pick the lowest registered one.
                let dp = if self.cfg.shape.prefill_dp_ranks.len() == 1 && req % 2 == 0 {
                    None
                } else {
                    Some(pg_dp)
                };
                let wait = faults.saturated || worker.pool().free_count() < blocks as usize;
                let given = if wait {
                    None
                } else {
                    worker.pool().alloc(blocks, &id)
                };
                let spec = ReceiverSpec {
                    prefill,
                    prefill_dp_rank: dp,
                    blocks: given.clone(),
                };
                match rt.receiver(id.clone(), spec) {
                    Ok(h) => {
                        if let Some(b) = given {
                            self.record_open(now, req, w, inc, Some(b));
                            self.workers[w].handles.insert(req, Handle::Receiver(h));
                            self.mark_busy(w);
                            return;
                        }
                        Ok(Handle::Receiver(h))
                    }
                    Err(e) => {
                        if let Some(b) = given {
                            let _ = self.workers[w].pool().free(&b, &id);
                        }
                        Err(e)
                    }
                }
            }
        };
        match opened {
            Ok(handle) => {
                let role = self.workers[w].role;
                self.workers[w].handles.insert(req, handle);
                self.mark_busy(w);
                self.record_open(now, req, w, inc, None);
                let f = &self.cfg.faults;
                match role {
                    Role::Prefill if !faults.never_send => {
                        let (lo, hi) = self.cfg.workload.compute_ms;
                        let at = now + self.load.range(lo, hi);
                        self.schedule(
                            at,
                            Action::HandOver {
                                req,
                                worker: w,
                                inc,
                            },
                        );
                    }
                    Role::Decode if faults.saturated => {
                        let at = now + self.chaos.range(f.alloc_delay_ms.0, f.alloc_delay_ms.1);
                        self.schedule(
                            at,
                            Action::HandOver {
                                req,
                                worker: w,
                                inc,
                            },
                        );
                    }
                    Role::Decode => self.hand_over(now, req, w, inc, true),
                    Role::Prefill => {}
                }
            }
            Err(e) => self.refused(now, req, w, e),
        }
    }

    /// The workers a request of prefill group `pg` and decode group `dg` may connect:
    /// every prefill rank with every decode rank (a superset of the pairs it uses).
    fn pairs(&self, pg: usize, dg: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let (ps, ds) = (&self.prefill_groups[pg].2, &self.decode_groups[dg].2);
        ps.iter()
            .flat_map(move |&p| ds.iter().map(move |&d| (p, d)))
    }

    /// The prefill engine and dp rank that serve `req`.
    fn prefill_of(&self, req: u64) -> (u32, u32) {
        let pg = self.reqs.get(&req).map_or(0, |r| r.pgroup);
        (self.prefill_groups[pg].0, self.prefill_groups[pg].1)
    }

    /// The id of engine `P<engine>`, which serves `req`: its workers' own (no new string
    /// per request).
    fn prefill_engine(&self, req: u64, engine: u32) -> EngineId {
        let pg = self.reqs.get(&req).map_or(0, |r| r.pgroup);
        match self.prefill_groups[pg].2.first() {
            Some(&p) => self.workers[p].rank.engine_id.clone(),
            None => EngineId::new(format!("P{engine}")),
        }
    }

    fn refused(&mut self, now: u64, req: u64, w: usize, e: ActorError) {
        if let Some(rec) = self.reqs.get_mut(&req) {
            rec.unopened += 1;
        }
        match e {
            ActorError::TooManyRequests { .. } | ActorError::Stopped => {
                self.trace
                    .record(now, Some(req), |s| write!(s, "w{w} refused r{req}: {e}"));
                self.settle_if_done(req);
            }
            other => self.violate(
                Invariant::Api,
                Some(req),
                format!("w{w} refused to open r{req}: {other}"),
            ),
        }
    }

    fn record_open(
        &mut self,
        now: u64,
        req: u64,
        w: usize,
        inc: u32,
        blocks: Option<Vec<BlockId>>,
    ) {
        let worker = &self.workers[w];
        let (role, tp, pp) = (worker.role, worker.rank.tp_rank, worker.rank.pp_rank);
        let deadline =
            now + self.cfg.timing.timeouts.lifetime_max().as_millis() as u64 + HANG_SLACK_MS;
        let entry = (deadline, req, w, inc);
        match self.deadlines.back() {
            Some(last) if *last < entry => self.deadlines.push_back(entry),
            None => self.deadlines.push_back(entry),
            Some(_) => {
                if let Err(at) = self.deadlines.binary_search(&entry) {
                    self.deadlines.insert(at, entry);
                }
            }
        }
        let rec = self.reqs.get(&req);
        self.trace.record(now, Some(req), |s| {
            who(s, worker, inc);
            s.push_str(" opens ");
            push_req(s, rec, req);
            s.push_str(" as ");
            s.push_str(role_text(role));
            if let Some(b) = &blocks {
                s.push_str(" with blocks ");
                push_blocks(s, b);
            }
            Ok(())
        });
        if let Some(rec) = self.reqs.get_mut(&req) {
            rec.ranks.push(RankRec {
                worker: w,
                inc,
                role,
                tp,
                pp,
                opened_ms: now,
                handed: blocks.unwrap_or_default(),
                released: Vec::new(),
                state: State::Bootstrapping,
                end_ms: None,
            });
        }
    }

    /// The engine hands the request's blocks to the runtime: prefill after computing them
    /// (filled with the request's pattern), decode once allocated. Without free blocks the
    /// request waits for some (`queue`), or is left to its deadline.
    fn hand_over(&mut self, now: u64, req: u64, w: usize, inc: u32, queue: bool) {
        if self.live_handle(req, w, inc).is_none() {
            return;
        }
        let Some(rec) = self.reqs.get(&req) else {
            return;
        };
        let (id, n) = (rec.id.clone(), rec.blocks);
        let worker = &mut self.workers[w];
        let Some(blocks) = worker.pool().alloc(n, &id) else {
            if queue && worker.waiters.len() < BLOCK_WAITERS_MAX {
                worker.waiters.push_back(Waiter { req, inc });
                self.trace.record(now, Some(req), |s| {
                    write!(s, "w{w} has no free blocks for r{req}: waits")
                });
            }
            return;
        };
        if worker.role == Role::Prefill {
            for (k, b) in blocks.iter().enumerate() {
                let bytes = &mut self.block_bytes;
                worker_bytes(
                    bytes,
                    (&self.cfg.shape, req, k),
                    &worker.rank,
                    Role::Prefill,
                );
                if let Err(e) = worker.region.write_block(*b, bytes) {
                    let detail = format!("w{w} could not fill block {b}: {e}");
                    return self.violate(Invariant::Api, Some(req), detail);
                }
            }
        }
        let result = match worker.handles.get(&req) {
            Some(Handle::Sender(h)) => h.send(blocks.clone()),
            Some(Handle::Receiver(h)) => h.allocate(blocks.clone()),
            None => return,
        };
        match result {
            Ok(()) => {
                let (worker, rec) = (&self.workers[w], self.reqs.get(&req));
                self.trace.record(now, Some(req), |s| {
                    who(s, worker, inc);
                    s.push_str(" hands ");
                    push_req(s, rec, req);
                    s.push_str(" blocks ");
                    push_blocks(s, &blocks);
                    Ok(())
                });
                if let Some(r) = self.rank_mut(req, w, inc) {
                    r.handed = blocks;
                }
            }
            Err(ActorError::RequestEnded { blocks, state, .. }) => {
                let _ = self.workers[w].pool().free(&blocks, &id);
                self.trace.record(now, Some(req), |s| {
                    write!(s, "w{w}.{inc} hand-over of r{req} refused: ended {state}")
                });
            }
            Err(e) => {
                let _ = self.workers[w].pool().free(&blocks, &id);
                self.violate(
                    Invariant::Api,
                    Some(req),
                    format!("w{w} hand-over of r{req} refused: {e}"),
                );
            }
        }
    }

    fn serve_waiters(&mut self, now: u64, w: usize) {
        while let Some(next) = self.workers[w].waiters.front().copied() {
            let n = match self.reqs.get(&next.req) {
                Some(rec) if self.live_handle(next.req, w, next.inc).is_some() => rec.blocks,
                _ => {
                    self.workers[w].waiters.pop_front();
                    continue;
                }
            };
            if self.workers[w].pool().free_count() < n as usize {
                return;
            }
            self.workers[w].waiters.pop_front();
            self.hand_over(now, next.req, w, next.inc, false);
        }
    }

    fn rank_mut(&mut self, req: u64, w: usize, inc: u32) -> Option<&mut RankRec> {
        self.reqs
            .get_mut(&req)?
            .ranks
            .iter_mut()
            .find(|r| r.worker == w && r.inc == inc)
    }

    // ----- events and checks -----

    /// Worker `w` holds a handle now.
    fn mark_busy(&mut self, w: usize) {
        self.busy[w / 64] |= 1 << (w % 64);
    }

    fn drain(&mut self, now: u64) {
        // One buffer for every drain of the run (the runtimes keep theirs too), taken out
        // once a turn rather than once a worker.
        let mut events = std::mem::take(&mut self.events);
        // In worker order, each looked at as the loop reaches it (handling one worker's
        // events may settle requests, and so free other workers), as a scan of every
        // worker would; only the busy ones whose bell rang (an unrung queue is empty).
        let mut from = 0;
        while let Some(w) = self.bells.next(from) {
            from = w + 1;
            let worker = &self.workers[w];
            let Some(rt) = &worker.rt else {
                // (A stopped runtime's events went with it.)
                self.bells.clear(w);
                continue;
            };
            if worker.handles.is_empty() {
                // Left rung: drained once the worker holds a handle again, as before.
                continue;
            }
            self.bells.clear(w);
            rt.drain_events_into(&mut events);
            if events.is_empty() {
                continue;
            }
            self.last_progress_ms = now;
            let inc = worker.inc;
            for e in events.drain(..) {
                self.on_event(now, w, inc, e);
            }
            if !self.workers[w].waiters.is_empty() {
                self.serve_waiters(now, w);
            }
        }
        self.events = events;
    }

    fn on_event(&mut self, now: u64, w: usize, inc: u32, event: Event) {
        let Some(req) = req_index(event.id()) else {
            return self.violate(
                Invariant::Api,
                None,
                format!("w{w}: event for unknown request {:?}", event.id()),
            );
        };
        match event {
            Event::State { state, .. } => self.on_state(now, req, w, inc, state),
            Event::Released { blocks, .. } => self.on_released(now, req, w, inc, blocks),
        }
        self.settle_if_done(req);
    }

    fn on_state(&mut self, now: u64, req: u64, w: usize, inc: u32, state: State) {
        let (worker, rec) = (&self.workers[w], self.reqs.get(&req));
        self.trace.record(now, Some(req), |s| {
            who(s, worker, inc);
            s.push(' ');
            push_req(s, rec, req);
            s.push(' ');
            if let State::Failed(_) = state {
                return write!(s, "{state}");
            }
            s.push_str(state.name());
            Ok(())
        });
        let text = || state_text(&state);
        let Some(r) = self.rank_mut(req, w, inc) else {
            if state == State::Bootstrapping {
                return; // the open event of a rank recorded as it opened
            }
            return self.violate(
                Invariant::Api,
                Some(req),
                format!("w{w}: state {} for r{req}, not open there", text()),
            );
        };
        let backwards = r.state.is_terminal() || state.phase() < r.state.phase();
        if state == State::Bootstrapping && r.state == State::Bootstrapping {
            return;
        }
        if backwards || state.phase() == r.state.phase() {
            let prev = r.state.clone();
            return self.violate(
                Invariant::Api,
                Some(req),
                format!("w{w}: r{req} moved {prev} -> {}", text()),
            );
        }
        if state.is_terminal() {
            r.end_ms = Some(now);
        }
        r.state = state;
    }

    fn on_released(&mut self, now: u64, req: u64, w: usize, inc: u32, blocks: Vec<BlockId>) {
        let (worker, rec) = (&self.workers[w], self.reqs.get(&req));
        self.trace.record(now, Some(req), |s| {
            who(s, worker, inc);
            s.push(' ');
            push_req(s, rec, req);
            s.push_str(" released ");
            push_blocks(s, &blocks);
            Ok(())
        });
        let Some(rec) = self.reqs.get_mut(&req) else {
            return self.violate(
                Invariant::NoLeak,
                Some(req),
                format!("w{w}: release for settled r{req}"),
            );
        };
        let id = rec.id.clone();
        let Some(r) = rec.ranks.iter_mut().find(|r| r.worker == w && r.inc == inc) else {
            return self.violate(
                Invariant::NoLeak,
                Some(req),
                format!("w{w}: release of {blocks:?} for r{req}, never opened there"),
            );
        };
        for b in &blocks {
            if !r.handed.contains(b) || r.released.contains(b) {
                let detail = format!(
                    "w{w}: r{req} released block {b} (handed {:?}, released before {:?})",
                    r.handed, r.released
                );
                return self.violate(Invariant::NoLeak, Some(req), detail);
            }
        }
        r.released.extend_from_slice(&blocks);
        let check = (r.role == Role::Decode
            && r.state == State::Done
            && r.released.len() == r.handed.len())
        .then(|| r.handed.clone());
        if let Some(handed) = check {
            let rank = self.workers[w].rank.clone();
            let scratch = &mut self.block_bytes;
            let want = expected_checksum(scratch, &self.cfg.shape, req, &rank, handed.len());
            match self.workers[w].region.checksum(&handed) {
                Ok(got) if got == want => {}
                Ok(got) => {
                    let detail = format!("w{w}: r{req} Done but its blocks {handed:?} hold checksum {got:016x}, prefill wrote {want:016x}");
                    return self.violate(Invariant::Integrity, Some(req), detail);
                }
                Err(e) => {
                    return self.violate(
                        Invariant::Integrity,
                        Some(req),
                        format!("w{w}: r{req}: {e}"),
                    )
                }
            }
        }
        let freed = self.workers[w].pool().free(&blocks, &id);
        if let Err(e) = freed {
            self.violate(Invariant::NoLeak, Some(req), format!("w{w}: {e}"));
        }
    }

    fn check_deadlines(&mut self, now: u64) {
        while let Some(&(deadline, req, w, inc)) = self.deadlines.front() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_front();
            let Some(rec) = self.reqs.get(&req) else {
                continue;
            };
            let Some(r) = rec.ranks.iter().find(|r| r.worker == w && r.inc == inc) else {
                continue;
            };
            if !r.state.is_terminal() {
                let detail = format!(
                    "w{w}.{inc}: r{req} still {} {} ms after it opened (lifetime_max {:?} + {HANG_SLACK_MS} ms)",
                    r.state,
                    now - r.opened_ms,
                    self.cfg.timing.timeouts.lifetime_max()
                );
                return self.violate(Invariant::NoHang, Some(req), detail);
            }
        }
    }

    fn settle_if_done(&mut self, req: u64) {
        let Some(rec) = self.reqs.get(&req) else {
            return;
        };
        let settled = rec.opens_pending == 0
            && rec
                .ranks
                .iter()
                .all(|r| r.state.is_terminal() && r.released.len() == r.handed.len());
        if !settled {
            return;
        }
        let Some(rec) = self.reqs.remove(&req) else {
            return;
        };
        self.net.engage(self.pairs(rec.pgroup, rec.dgroup), false);
        for r in &rec.ranks {
            let w = &mut self.workers[r.worker];
            if w.inc == r.inc {
                w.handles.remove(&req);
                if w.handles.is_empty() {
                    self.busy[r.worker / 64] &= !(1 << (r.worker % 64));
                }
            }
        }
        self.check_agreement(req, &rec);
        self.tally(&rec);
        self.trace.forget(req);
    }

    /// What the two sides may disagree on, and what they may not.
    ///
    /// A decode rank's `Done` means it has the data, so it must be backed by the prefill
    /// ranks it received from: in push mode each of them ended `Done` (they send `Done` only
    /// after their write landed; with fan-out, a prefill rank serving several decode ranks
    /// may fail for another one after this one's write landed, so only opened is required);
    /// in pull mode each of them opened the request (they sent `Ready`), and the bytes
    /// themselves were checked at release. The converse is not
    /// required: prefill may end `Done` while decode fails (prefill's final `Done` lost;
    /// decode's `ReadDone` raced a failure), and ranks of one side may split `Done`/`Failed`
    /// when one rank finished before a sibling failed. Such splits are counted, not failed.
    fn check_agreement(&mut self, req: u64, rec: &ReqRec) {
        for d in rec
            .ranks
            .iter()
            .filter(|r| r.role == Role::Decode && r.state == State::Done)
        {
            // The prefill tp ranks it reads from: its own, or its share of prefill's.
            let (tp, decode_tp) = (self.cfg.shape.tp, self.cfg.shape.decode_tp());
            let share =
                handoff_transport::tp::prefill_share(tp, decode_tp, d.tp).unwrap_or(d.tp..d.tp + 1);
            // A push over the RDMA plane with a prefill rank on another host ran as pull
            // (`Link::unwatched`), as the decode rank decided it.
            let elsewhere = rec.ranks.iter().any(|p| {
                p.role == Role::Prefill
                    && share.contains(&p.tp)
                    && !self.cfg.shape.same_host(p.worker, d.worker)
            });
            let mode = match rec.mode {
                TransferMode::Push
                    if self.cfg.data_plane == crate::config::DataPlane::Rdma && elsewhere =>
                {
                    TransferMode::Pull
                }
                mode => mode,
            };
            for pp in 0..rec.prefill_pp {
                // (An iterator, not a list: walked once or twice, and listed only for a
                // report.)
                let peers = || {
                    rec.ranks
                        .iter()
                        .filter(|p| p.role == Role::Prefill && share.contains(&p.tp) && p.pp == pp)
                };
                // Fan-out (decode's TP above prefill's): a prefill rank tells each decode
                // rank `Done` once its own write landed, and may still fail for another
                // decode rank's write; the bytes themselves are checked at release.
                let fan_out = decode_tp > tp;
                let backed = match mode {
                    TransferMode::Push if !fan_out => peers().any(|p| p.state == State::Done),
                    _ => peers().next().is_some(),
                };
                if !backed {
                    let states: Vec<String> = peers()
                        .map(|p| format!("w{}: {}", p.worker, p.state))
                        .collect();
                    let detail = format!(
                        "decode w{} Done in {:?} mode, but prefill tp{} pp{pp} ended [{}]",
                        d.worker,
                        mode,
                        d.tp,
                        states.join(", ")
                    );
                    return self.violate(Invariant::Agreement, Some(req), detail);
                }
            }
        }
        let expected = (rec.opens_pending + rec.unopened) as usize + rec.ranks.len();
        let all_done = rec.unopened == 0
            && rec.ranks.len() == expected
            && rec.ranks.iter().all(|r| r.state == State::Done);
        let must_succeed =
            rec.liveness || (self.cfg.faults.is_none() && self.cfg.script.is_empty());
        if must_succeed && !all_done {
            let states: Vec<String> = rec
                .ranks
                .iter()
                .map(|r| format!("w{}: {}", r.worker, r.state))
                .collect();
            let detail = format!(
                "r{req} did not succeed with faults off: [{}]",
                states.join(", ")
            );
            self.violate(Invariant::Liveness, Some(req), detail);
        }
    }

    fn tally(&mut self, rec: &ReqRec) {
        let end_kind = |s: &State| -> std::borrow::Cow<'static, str> {
            match s {
                State::Failed(r) => r.kind().into(),
                State::Done => "done".into(),
                other => other.to_string().to_lowercase().into(),
            }
        };
        if self.cfg.keep_outcomes {
            let ranks = rec
                .ranks
                .iter()
                .map(|r| RankOutcome {
                    worker: r.worker,
                    engine: self.workers[r.worker].rank.engine_id.to_string(),
                    prefill: r.role == Role::Prefill,
                    tp: r.tp,
                    pp: r.pp,
                    end: end_kind(&r.state).into_owned(),
                    opened_ms: r.opened_ms,
                    end_ms: r.end_ms.unwrap_or(0),
                })
                .collect();
            let req = req_index(&rec.id).unwrap_or(0);
            self.outcomes.push(RequestOutcome {
                req,
                liveness: rec.liveness,
                ranks,
            });
        }
        let out = if rec.liveness {
            &mut self.liveness
        } else {
            &mut self.safety
        };
        // `role:end` keys, made into a `String` only the first time each is counted.
        let mut key = String::new();
        for r in &rec.ranks {
            // The common keys as they are; any other written out.
            let key = match (r.role, &r.state) {
                (Role::Prefill, State::Done) => "prefill:done",
                (Role::Decode, State::Done) => "decode:done",
                (role, state) => {
                    key.clear();
                    key.push_str(role_text(role));
                    key.push(':');
                    key.push_str(&end_kind(state));
                    key.as_str()
                }
            };
            match out.ranks.get_mut(key) {
                Some(n) => *n += 1,
                None => {
                    out.ranks.insert(key.to_string(), 1);
                }
            }
        }
        let states = || rec.ranks.iter().map(|r| &r.state);
        let any_done = states().any(|s| *s == State::Done);
        let merged = handoff_actors::merge_all(states());
        match merged {
            Some(State::Done) if rec.unopened == 0 => {
                out.done += 1;
                let end = rec
                    .ranks
                    .iter()
                    .filter(|r| r.role == Role::Decode)
                    .filter_map(|r| r.end_ms)
                    .max()
                    .unwrap_or(rec.arrived_ms);
                self.latencies.push(end - rec.arrived_ms);
            }
            Some(State::Failed(reason)) => {
                *out.failed.entry(reason.kind().to_string()).or_insert(0) += 1;
                if any_done {
                    out.split += 1;
                }
            }
            _ => *out.failed.entry("not_opened".to_string()).or_insert(0) += 1,
        }
    }
}

impl World {
    // ----- cluster faults -----

    fn targets(&self, target: &Target) -> Vec<usize> {
        self.workers
            .iter()
            .filter(|w| match target {
                Target::Engine(e) => w.rank.engine_id.as_str() == e,
                Target::Rank { engine, dp, tp, pp } => {
                    w.rank.engine_id.as_str() == engine
                        && w.rank.dp_rank == *dp
                        && w.rank.tp_rank == *tp
                        && w.rank.pp_rank == *pp
                }
            })
            .map(|w| w.idx)
            .collect()
    }

    fn schedule_scripted(&mut self, s: &Scripted) {
        match s {
            Scripted::BootstrapDown { at_ms, for_ms } => {
                self.schedule(*at_ms, Action::FaultTick(TickKind::BootstrapOutage));
                // The tick draws its own length; a scripted one overrides it below.
                self.scripted_outages.insert(*at_ms, *for_ms);
            }
            Scripted::Crash {
                target,
                at_ms,
                for_ms,
            } => {
                for w in self.targets(target) {
                    self.schedule(
                        *at_ms,
                        Action::Crash {
                            worker: w,
                            down_ms: *for_ms,
                        },
                    );
                }
            }
            Scripted::Partition {
                target,
                at_ms,
                for_ms,
                one_way,
                plane,
            } => {
                let group: BTreeSet<usize> = self.targets(target).into_iter().collect();
                self.scripted_partitions
                    .push((*at_ms, group, (*one_way, *plane), *for_ms));
                let i = self.scripted_partitions.len() - 1;
                self.schedule(*at_ms, Action::ScriptedPartition(i));
            }
            Scripted::Freeze {
                target,
                at_ms,
                for_ms,
            } => {
                for w in self.targets(target) {
                    let for_ms = *for_ms;
                    self.schedule(*at_ms, Action::Freeze { worker: w, for_ms });
                }
            }
            Scripted::Panic { target, at_ms } => {
                for w in self.targets(target) {
                    self.schedule(*at_ms, Action::PanicAll { worker: w });
                }
            }
            Scripted::Drop(_) => {}
        }
    }

    fn fault_tick(&mut self, now: u64, kind: TickKind) {
        if self.phase != Phase::Safety {
            return;
        }
        let f = self.cfg.faults.clone();
        match kind {
            TickKind::Partition => {
                let group: BTreeSet<usize> = if self.chaos.chance(PPM / 2) {
                    [self.chaos.below(self.workers.len() as u64) as usize].into()
                } else {
                    let engines: BTreeSet<EngineId> = self
                        .workers
                        .iter()
                        .map(|w| w.rank.engine_id.clone())
                        .collect();
                    let engines: Vec<EngineId> = engines.into_iter().collect();
                    let e = self.chaos.pick(&engines).cloned();
                    self.workers
                        .iter()
                        .filter(|w| Some(&w.rank.engine_id) == e.as_ref())
                        .map(|w| w.idx)
                        .collect()
                };
                let one_way = self.chaos.chance(f.one_way_ppm);
                let plane = if !self.chaos.chance(f.plane_only_ppm) {
                    Plane::Both
                } else if self.chaos.chance(PPM / 2) {
                    Plane::Control
                } else {
                    Plane::Data
                };
                let for_ms = self.chaos.range(f.partition_ms.0, f.partition_ms.1);
                self.start_partition(now, group, (one_way, plane), for_ms);
                self.next_tick(now, f.partition_every_ms, kind);
            }
            TickKind::Freeze => {
                let w = self.chaos.below(self.workers.len() as u64) as usize;
                let for_ms = self.chaos.range(f.freeze_ms.0, f.freeze_ms.1);
                self.freeze(now, w, for_ms);
                self.next_tick(now, f.freeze_every_ms, kind);
            }
            TickKind::Crash => {
                let w = self.chaos.below(self.workers.len() as u64) as usize;
                let down = self.chaos.range(f.down_ms.0, f.down_ms.1);
                self.schedule(
                    now,
                    Action::Crash {
                        worker: w,
                        down_ms: down,
                    },
                );
                self.next_tick(now, f.crash_every_ms, kind);
            }
            TickKind::BootstrapOutage => {
                let for_ms = match self.scripted_outages.remove(&now) {
                    Some(ms) => ms,
                    None => {
                        self.next_tick(now, f.bootstrap_outage_every_ms, kind);
                        self.chaos
                            .range(f.bootstrap_outage_ms.0, f.bootstrap_outage_ms.1)
                    }
                };
                self.net.set_bootstrap_up(false);
                self.count("bootstrap_outage");
                self.trace
                    .record(now, None, |s| write!(s, "bootstrap down for {for_ms} ms"));
                self.schedule(now + for_ms, Action::BootstrapUp);
            }
        }
    }

    fn next_tick(&mut self, now: u64, every: u64, kind: TickKind) {
        if every > 0 && self.next_req < self.safety_end {
            let at = now + self.chaos.range(every / 2, every + every / 2).max(1);
            self.schedule(at, Action::FaultTick(kind));
        }
    }

    fn start_partition(
        &mut self,
        now: u64,
        group: BTreeSet<usize>,
        (one_way, plane): (bool, Plane),
        for_ms: u64,
    ) {
        if group.is_empty() || group.len() == self.workers.len() {
            return;
        }
        self.partition_seq += 1;
        let id = self.partition_seq;
        self.count(if one_way {
            "partition_one_way"
        } else {
            "partition_two_way"
        });
        match plane {
            Plane::Both => {}
            Plane::Control => self.count("partition_control_only"),
            Plane::Data => self.count("partition_data_only"),
        }
        self.trace.record(now, None, |s| {
            write!(
                s,
                "partition {id}: {group:?} cut off for {for_ms} ms (one_way {one_way}, {plane:?})"
            )
        });
        self.net.partition(id, group, (one_way, plane), for_ms);
    }

    /// Freezes worker `w` for `for_ms` (as by SIGSTOP; see `SimNet::freeze`).
    fn freeze(&mut self, now: u64, w: usize, for_ms: u64) {
        self.partition_seq += 1;
        let id = self.partition_seq;
        self.count("freeze");
        self.trace
            .record(now, None, |s| write!(s, "w{w} frozen for {for_ms} ms"));
        self.net.freeze(id, w, for_ms);
    }

    async fn crash(&mut self, now: u64, w: usize, down_ms: u64) {
        if self.phase != Phase::Safety {
            return;
        }
        let Some(rt) = self.workers[w].rt.take() else {
            return;
        };
        let inc = self.workers[w].inc;
        self.count("crash");
        self.trace.record(now, None, |s| {
            write!(s, "w{w}.{inc} crashes for {down_ms} ms")
        });
        rt.shutdown().await;
        for e in rt.drain_events() {
            self.on_event(now, w, inc, e);
        }
        let worker = &mut self.workers[w];
        worker.waiters.clear();
        let live: Vec<u64> = worker.handles.keys().copied().collect();
        worker.handles.clear();
        self.busy[w / 64] &= !(1 << (w % 64));
        let owned = worker.pool().owned();
        if !owned.is_empty() {
            let detail = format!("w{w}.{inc} stopped, but its engine still holds {owned:?}");
            return self.violate(Invariant::NoLeak, None, detail);
        }
        for req in live {
            let open = self
                .reqs
                .get(&req)
                .and_then(|r| r.ranks.iter().find(|r| r.worker == w && r.inc == inc))
                .filter(|r| !r.state.is_terminal())
                .map(|r| r.state.clone());
            if let Some(state) = open {
                let detail = format!("w{w}.{inc} stopped, but r{req} is still {state} there");
                return self.violate(Invariant::NoHang, Some(req), detail);
            }
            self.settle_if_done(req);
        }
        // Its peers stop hearing it: their peer tables lose it.
        let down = down_ms.max(self.cfg.timing.heartbeat_ms + 1);
        self.schedule(now + down, Action::Restart { worker: w });
    }

    async fn restart(&mut self, now: u64, w: usize) {
        if self.workers[w].rt.is_some() {
            return;
        }
        let worker = &mut self.workers[w];
        worker.inc += 1;
        worker.name = format!("w{w}.{}", worker.inc);
        // A new process: new memory, a new pool.
        let s = &self.cfg.shape;
        match worker_region(s, &worker.rank, worker.role) {
            Ok(r) => worker.region = Arc::new(r),
            Err(e) => return self.violate(Invariant::Api, None, format!("w{w}: {e}")),
        }
        worker.pool = Arc::new(Mutex::new(Pool::new(s.blocks_per_worker)));
        let inc = worker.inc;
        if let Err(e) = self.start_worker(w).await {
            return self.violate(Invariant::Api, None, format!("w{w} could not restart: {e}"));
        }
        self.trace
            .record(now, None, |s| write!(s, "w{w}.{inc} restarted"));
    }

    // ----- phases -----

    async fn advance_phase(&mut self, now: u64) {
        let arrivals_done = self.next_req >= self.safety_end;
        match self.phase {
            Phase::Safety if arrivals_done && self.reqs.is_empty() && self.pending_scripts(now) => {
                self.stuck_check(now);
            }
            Phase::Safety if arrivals_done && self.reqs.is_empty() => {
                self.start_liveness(now).await;
            }
            Phase::Liveness if self.awaiting_registration => {
                if self.net.all_registered() && now >= self.settled_at {
                    self.awaiting_registration = false;
                    self.last_progress_ms = now;
                    let req = self.safety_end;
                    self.schedule(
                        now + 1,
                        Action::Arrive {
                            req,
                            liveness: true,
                        },
                    );
                } else if now
                    > self.last_progress_ms
                        + self.cfg.timing.timeouts.lifetime_max().as_millis() as u64
                {
                    let detail = "prefill workers did not register with the bootstrap server after faults ended".into();
                    self.violate(Invariant::Liveness, None, detail);
                }
            }
            Phase::Liveness if self.next_req >= self.liveness_end && self.reqs.is_empty() => {
                self.phase = Phase::Done;
            }
            _ => self.stuck_check(now),
        }
    }

    /// True while scripted faults are still to come (the safety phase lasts until then).
    fn pending_scripts(&self, now: u64) -> bool {
        self.scripted_partitions.iter().any(|p| p.0 > now)
            || self.agenda.iter().any(|a| {
                matches!(
                    a,
                    Action::Crash { .. } | Action::Restart { .. } | Action::Freeze { .. }
                )
            })
    }

    /// Requests that neither progress nor hit a deadline (a rank ended but never released
    /// its blocks, say) would keep the run going forever: past the longest a request may
    /// go quiet (a fence waiting out its bound, then a quarantine asking its lost writer
    /// again, [`World::quarantine_asks`] asks being lost or cut off) without any event,
    /// whatever is left is reported.
    fn stuck_check(&mut self, now: u64) {
        if self.reqs.is_empty() {
            return;
        }
        let asks = self.quarantine_asks() * QUARANTINE_ASK_EVERY.as_millis() as u64;
        let limit = self.cfg.timing.timeouts.fence_max().as_millis() as u64 + asks + HANG_SLACK_MS;
        if now < self.last_progress_ms + limit {
            return;
        }
        let Some((req, rec)) = self.reqs.first() else {
            return;
        };
        let ranks: Vec<String> = rec
            .ranks
            .iter()
            .map(|r| {
                format!(
                    "w{}.{} {} handed {:?} released {:?}",
                    r.worker, r.inc, r.state, r.handed, r.released
                )
            })
            .collect();
        let detail = format!(
            "no progress for {} ms; r{req} unsettled (opens pending {}): [{}]",
            now - self.last_progress_ms,
            rec.opens_pending,
            ranks.join("; ")
        );
        let inv = if rec.ranks.iter().all(|r| r.state.is_terminal()) {
            Invariant::NoLeak
        } else {
            Invariant::NoHang
        };
        self.violate(inv, Some(req), detail);
    }

    /// How many of a quarantine's asks may go unanswered before a quiet request counts as
    /// stuck. Each ask is a round of two messages (decode's `Abort`, the writer's
    /// `AbortAck`), each lost with the run's loss rate, and the faults stay on until every
    /// safety request settles: with a fixed count, a seed with heavy loss can lose them all
    /// and be reported stuck while the quarantine works (seed 98308 of an RDMA swarm sweep
    /// lost four rounds in a row at 10% loss). So: enough rounds that all of them fail with
    /// a chance below one in 10^9, and at least three (partitions cut asks too).
    fn quarantine_asks(&self) -> u64 {
        let p = (self.cfg.faults.loss_ppm as f64 / 1e6).clamp(0.0, 0.5);
        let round_fails = 1.0 - (1.0 - p) * (1.0 - p);
        let rounds = if round_fails > 0.0 {
            (1e-9f64.ln() / round_fails.ln()).ceil() as u64
        } else {
            0
        };
        rounds.max(3)
    }

    async fn start_liveness(&mut self, now: u64) {
        self.phase = Phase::Liveness;
        self.net.set_faults_on(false);
        self.net.heal_all();
        self.settled_at = now + self.net.settle_ms();
        self.agenda
            .retain(|a| !matches!(a, Action::FaultTick(_) | Action::BootstrapUp));
        self.trace
            .record(now, None, |s| s.write_str("liveness phase: faults off"));
        for w in 0..self.workers.len() {
            if self.workers[w].rt.is_none() {
                self.restart(now, w).await;
            }
        }
        self.leak_check();
        if self.cfg.workload.liveness_requests == 0 {
            self.phase = Phase::Done;
            return;
        }
        self.awaiting_registration = true;
        self.last_progress_ms = now;
    }

    /// Every pool of every worker up now is entirely free (at quiescence).
    fn leak_check(&mut self) {
        for w in 0..self.workers.len() {
            let owned = self.workers[w].pool().owned();
            if !owned.is_empty() {
                let detail = format!("w{w} at quiescence still owns {owned:?}");
                return self.violate(Invariant::NoLeak, None, detail);
            }
        }
    }

    async fn finish(mut self) -> Report {
        if self.violations.is_empty() {
            self.leak_check();
        }
        for w in 0..self.workers.len() {
            if let Some(rt) = self.workers[w].rt.take() {
                rt.shutdown().await;
            }
        }
        let virtual_ms = self.now();
        let net = self.net.stats();
        let mut h = Fnv64::new();
        h.bytes(&self.trace.hash().to_le_bytes());
        h.bytes(&self.net.hash().to_le_bytes());
        Report {
            seed: self.cfg.seed,
            settings: self.cfg.to_string(),
            workers: self.workers.len() as u64,
            safety: self.safety,
            liveness: self.liveness,
            latency_ms: Percentiles::of(std::mem::take(&mut self.latencies)),
            outcomes: std::mem::take(&mut self.outcomes),
            injected: self.injected,
            net,
            violations: self.violations,
            trace_hash: h.finish(),
            trace_lines: self.trace.lines(),
            virtual_ms,
            wall_ms: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_arrive_text_matches_the_formatter() {
        for bits in 0u8..16 {
            let rf = ReqFaults {
                saturated: bits & 1 != 0,
                never_send: bits & 2 != 0,
                skip_prefill: bits & 4 != 0,
                ghost: bits & 8 != 0,
            };
            let mut s = String::new();
            rf.push_text(&mut s);
            assert_eq!(s, format!("{rf:?}"));
        }
        for mode in [TransferMode::Push, TransferMode::Pull] {
            assert_eq!(mode_text(mode), format!("{mode:?}"));
        }
        for role in [Role::Prefill, Role::Decode] {
            assert_eq!(role_text(role), format!("{role}"));
        }
    }
}
