//! `handoff worker`: one prefill or decode worker process on the network transport.
//!
//! It registers with the bootstrap server, opens a numbered set of requests
//! (`{prefix}-0 .. {prefix}-{n-1}`; prefill and decode workers given the same prefix and
//! count serve the same requests, as a router would arrange), fills each prefill block with
//! a pattern derived from the request id and the block's position, verifies every block on
//! decode, and prints one JSON line per event on stdout:
//! - `{"event":"ready", "role", "rank", "control", "data", "transport", "incarnation", "metrics"}` once
//!   registered (`metrics`: where `--metrics-listen` serves, or null);
//! - `{"event":"opened", "request", "blocks"}` per request opened, with the blocks it is
//!   given (prefill hands them over after `--hold-ms`; a decode with `--no-alloc`, none);
//! - `{"event":"state", "request", "state"}` as a request moves (`Bootstrapping`,
//!   `WaitingForInput`: on prefill, decode's transfer info has arrived; `Transferring`);
//! - `{"event":"end", "request", "state", "kind", "reason", "verified", "ms"}` per request;
//! - `{"event":"released", "request", "blocks", "why", "kind", "fence"}` each time the
//!   runtime lets blocks go (every block the worker handed over appears in exactly one):
//!   `why` is `done` (delivered, or arrived), `failed` (`kind` names the failure; `fence`
//!   is `confirmed` when the blocks were held until every peer confirmed it could no longer
//!   touch them, `bound` when held until the fence bound passed, null when released at
//!   once), `late` (handed over after the request ended) or `shutdown` (the runtime
//!   stopped while holding them); releases after the last `end` (a fence still held, the
//!   shutdown) are printed before the summary;
//! - with `--keep-done` (decode), `{"event":"recheck", "request", "verified"}` per request
//!   that arrived, its blocks checked again when the worker stops;
//! - `{"event":"superseded", "detail"}` once, if a newer process took this worker's rank
//!   (this one was stopped or cut off past its record's lease, and another started in its
//!   place): every open request fails `superseded`, none more is opened, and the worker
//!   exits once they have all ended, `--serve` or not;
//! - `{"event":"summary", "done", "failed", "corrupted", "recheck_bad", "by_kind",
//!   "superseded"}` at the end (`superseded`: the detail above, or null).
//!
//! stdout holds nothing else: logs, UCX's included, go to stderr.
//!
//! It exits 0 when every request ended `Done` and verified (or, with `--serve`, when
//! stopped by SIGINT/SIGTERM), 1 otherwise (a superseded worker always exits 1). Used by
//! the multi-process tests and by hand.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::ValueEnum;
use handoff_actors::{
    BlockId, EngineId, Event, KvLayout, KvShape, LayerSpan, RankInfo, ReceiverSpec, Region,
    ReleaseReason, RequestId, Role, Runtime, State, Timeouts, TransferMode,
};
use handoff_gpu::checksum::{checksum64, fill_pattern};
use handoff_gpu::DeviceBuffer;
use handoff_net::{start_engine_runtime, DataTransport, EngineOptions, WorkerMemory};
use handoff_transport::tcp::BusyPoll;
use handoff_transport::tp::{HeadGeometry, HeadOrder};
use handoff_transport::KvHeads;
use serde_json::json;

/// Which side.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum RoleArg {
    /// Computes and sends KV blocks.
    Prefill,
    /// Receives KV blocks.
    Decode,
}

/// Which data plane moves the blocks.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum TransportArg {
    /// UCX when libucp loads (`HANDOFF_UCX_LIB`, else the system's), otherwise TCP, logged.
    Auto,
    /// UCX: one-sided puts and gets into UCX-allocated memory; an error if libucp is missing.
    Ucx,
    /// TCP: the built-in transport, every write checked against its grant on arrival.
    Tcp,
}

/// Where the KV pool lives.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum MemoryArg {
    /// Host memory.
    Host,
    /// CUDA device memory on `--cuda-device`, registered with UCX (a UCX built with
    /// CUDA: `HANDOFF_UCX_LIB`, e.g. the `libucx-cu12` wheel's).
    Cuda,
}

/// Push or pull.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum ModeArg {
    /// Prefill writes into decode's blocks.
    Push,
    /// Decode reads prefill's blocks.
    Pull,
}

/// Arguments of `handoff worker`.
#[derive(clap::Args, Debug, Clone)]
pub struct WorkerArgs {
    /// prefill or decode.
    #[arg(long, value_enum)]
    pub role: RoleArg,
    /// This worker's engine id (all ranks of one engine share it).
    #[arg(long)]
    pub engine: String,
    /// Where workers meet: a bootstrap server (`tcp://HOST:PORT`), or an etcd cluster
    /// (`etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]`, cluster `default` when none), where each
    /// worker's record lives under a lease it keeps alive (it expires within 10 s of the
    /// worker's death) and lookups are cached until a peer is lost.
    #[arg(
        long,
        value_name = "tcp://HOST:PORT",
        default_value = "tcp://127.0.0.1:7400"
    )]
    pub bootstrap: String,
    /// The etcd cluster (key prefix) to register in, for an `etcd://` bootstrap address that
    /// names none (the same as giving it as the address's path).
    #[arg(long, value_name = "NAME")]
    pub cluster: Option<String>,
    /// Where the control port listens (port 0 picks one).
    #[arg(
        long,
        value_name = "tcp://HOST:PORT",
        default_value = "tcp://127.0.0.1:0"
    )]
    pub control_listen: String,
    /// Where the TCP data port listens (port 0 picks one).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:0")]
    pub data_listen: String,
    /// The host peers should dial, when listening on 0.0.0.0.
    #[arg(long)]
    pub advertise_host: Option<String>,
    /// The data plane.
    #[arg(long, value_enum, default_value_t = TransportArg::Auto)]
    pub transport: TransportArg,
    /// Where the KV pool lives. `cuda` needs `--transport ucx` or `auto` (TCP copies
    /// through the CPU) and a UCX built with CUDA.
    #[arg(long, value_enum, default_value_t = MemoryArg::Host)]
    pub memory: MemoryArg,
    /// The CUDA device: it holds the pool with `--memory cuda`; with host memory over
    /// UCX, naming one binds the UCX thread to it, so that it can reach peers' device
    /// memory.
    #[arg(long)]
    pub cuda_device: Option<u32>,
    /// Data-parallel rank and size.
    #[arg(long, default_value_t = 0)]
    pub dp_rank: u32,
    #[arg(long, default_value_t = 1)]
    #[allow(missing_docs)]
    pub dp_size: u32,
    /// Tensor-parallel rank and size.
    #[arg(long, default_value_t = 0)]
    pub tp_rank: u32,
    #[arg(long, default_value_t = 1)]
    #[allow(missing_docs)]
    pub tp_size: u32,
    /// Pipeline-parallel rank and size.
    #[arg(long, default_value_t = 0)]
    pub pp_rank: u32,
    #[arg(long, default_value_t = 1)]
    #[allow(missing_docs)]
    pub pp_size: u32,
    /// Blocks in this worker's KV pool.
    #[arg(long, default_value_t = 1024)]
    pub pool_blocks: u32,
    /// Bytes per KV block (this worker's layers of it).
    #[arg(long, default_value_t = 64 * 1024)]
    pub block_bytes: usize,
    /// Hold the KV pool as an engine holds `N` layers: this worker allocates its own
    /// tensors, laid out as `--layout` says, and registers them by address (blocks of
    /// `--block-bytes` become N layers of a K and a V half each). With `--pp-size`, rank
    /// `r` holds layers `r × N .. (r + 1) × N` of `pp_size × N`. UCX registers every range
    /// by address; TCP moves them range by range.
    #[arg(long, value_name = "N")]
    pub layers: Option<u32>,
    /// How `--layers` are laid out: `per-layer` (one tensor per layer, K and V halves: two
    /// ranges per layer, vLLM's), `interleaved` (K and V together per block: one range per
    /// layer), `contiguous` (one allocation, every layer of a block together).
    #[arg(long, default_value = "per-layer", value_parser = parse_layout)]
    pub layout: KvShape,
    /// With `--layers`: the model's KV heads (all `--tp-size` ranks together), which this
    /// rank holds its share of (`kv_heads / tp_size` from `tp_rank × kv_heads / tp_size`,
    /// or one replicated head past that): the KV halves of every layer are then
    /// `--block-tokens` tokens of those heads, ordered as `--head-order` says. Needed on
    /// both sides to hand over between different TP sizes (one must divide the other: each
    /// decode rank gathers its heads from several prefill ranks, or takes its share of one);
    /// blocks are filled and checked head by head.
    #[arg(long, value_name = "H")]
    pub kv_heads: Option<u32>,
    /// With `--kv-heads`: tokens per block.
    #[arg(long, default_value_t = 16)]
    pub block_tokens: u32,
    /// With `--kv-heads`: `hnd` (head-major: each head's tokens together) or `nhd`
    /// (token-major: each token's heads together).
    #[arg(long, default_value = "hnd", value_parser = parse_head_order)]
    pub head_order: HeadOrder,
    /// Requests to open.
    #[arg(long, default_value_t = 0)]
    pub requests: u32,
    /// Request ids are `{prefix}-{n}`.
    #[arg(long, default_value = "req")]
    pub request_prefix: String,
    /// Blocks per request.
    #[arg(long, default_value_t = 4)]
    pub blocks_per_request: u32,
    /// Decode: the prefill engine to receive from.
    #[arg(long)]
    pub prefill: Option<String>,
    /// Decode: pull (decode reads prefill's blocks: the safe default, since no write of a
    /// frozen or cut-off peer can land in blocks decode gave back) or push (prefill writes;
    /// over UCX a failed request's blocks stay fenced until prefill confirms or, lost, its
    /// process exits; a request whose prefill rank runs on another host, where decode
    /// cannot watch it, runs as pull). With
    /// `--memory cuda` on one host, both are device copies through the peer's CUDA IPC
    /// handles; with HANDOFF_SAME_HOST_COPIES=0 UCX moves them, and push is far faster
    /// (UCX 1.22 emulates reads of device memory).
    #[arg(long, value_enum, default_value_t = ModeArg::Pull)]
    pub mode: ModeArg,
    /// Decode: reject new requests while this many wait for blocks (admission control).
    #[arg(long)]
    pub admission: Option<usize>,
    /// Decode: open requests without allocating blocks (a saturated decode).
    #[arg(long)]
    pub no_alloc: bool,
    /// Prefill: wait this long before handing the computed blocks over.
    #[arg(long, default_value_t = 0)]
    pub hold_ms: u64,
    /// Wait this long after registering before opening requests.
    #[arg(long, default_value_t = 0)]
    pub start_delay_ms: u64,
    /// Heartbeat interval on peer connections.
    #[arg(long, default_value_t = 1000)]
    pub heartbeat_ms: u64,
    /// TCP data plane: wait for bytes spinning up to this many microseconds before the
    /// thread sleeps, on both sides (each small operation's answer, each next frame): lower
    /// one-block latency for the CPU spun, for workers with cores to spare. 0 never spins.
    /// Unset (the default), only a client spins, up to 100 µs, for the answer to an
    /// operation of at most 256 KiB (one wake-up fewer per one-block transfer), and
    /// nothing spins while idle.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=1000))]
    pub tcp_busy_poll_us: Option<u64>,
    /// Heartbeats a peer may miss before it is lost (at least 2: the writer's lease over
    /// UCX runs from the last heartbeat the peer echoed).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(2..))]
    pub heartbeats_missed: u32,
    /// Bootstrapping deadline, seconds.
    #[arg(long, default_value_t = 300.0)]
    pub bootstrap_timeout_s: f64,
    /// WaitingForInput deadline, seconds.
    #[arg(long, default_value_t = 300.0)]
    pub waiting_timeout_s: f64,
    /// Transfer deadline, seconds.
    #[arg(long, default_value_t = 60.0)]
    pub transfer_timeout_s: f64,
    /// Pull-mode TTL of prefill's blocks, seconds.
    #[arg(long, default_value_t = 480.0)]
    pub pull_ttl_s: f64,
    /// File with the shared secret (frames are then authenticated); without it,
    /// `HANDOFF_SECRET_FILE`, then `HANDOFF_SECRET`, are read from the environment.
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// Accept unauthenticated peers on non-loopback addresses (a trusted network only).
    /// Without it, listening on or dialing such an address needs a secret.
    #[arg(long)]
    pub insecure: bool,
    /// Serve Prometheus metrics at `http://HOST:PORT/metrics` (port 0 picks one; the
    /// `ready` line's `metrics` field says where).
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
    /// Decode: after the first requests, open as many more for this prefill engine...
    #[arg(long)]
    pub then_prefill: Option<String>,
    /// Prefill: after the first requests, open as many more (the ids decode's
    /// `--then-prefill` opens), each handing its blocks over this long after it opened...
    #[arg(long, value_name = "MS")]
    pub then_hold_ms: Option<u64>,
    /// ...this long after the first ones were opened (both of the above).
    #[arg(long, default_value_t = 1000)]
    pub then_after_ms: u64,
    /// Stay up until SIGINT/SIGTERM instead of exiting when the requests end (or until a
    /// newer process takes this worker's rank: then it exits 1 once its requests ended).
    #[arg(long)]
    pub serve: bool,
    /// Decode: keep the blocks of requests that arrived (as an engine decoding from them
    /// would) instead of reusing them, and check them again when the worker stops: a
    /// `recheck` line per request, and `recheck_bad` in the summary. A late write from a
    /// frozen or cut-off prefill into blocks handed out since shows up here.
    #[arg(long)]
    pub keep_done: bool,
}

fn parse_layout(s: &str) -> Result<KvShape, String> {
    s.parse()
}

fn parse_head_order(s: &str) -> Result<HeadOrder, String> {
    match s {
        "hnd" => Ok(HeadOrder::HeadMajor),
        "nhd" => Ok(HeadOrder::TokenMajor),
        other => Err(format!("unknown head order {other:?}: hnd or nhd")),
    }
}

/// This worker's KV pool as `--layers N --layout ...` describe it, in its own allocation.
fn laid_out_region(a: &WorkerArgs, layers: u32) -> Result<Region, String> {
    let per_layer = 2 * layers.max(1) as usize;
    if layers == 0 || a.block_bytes % per_layer != 0 {
        return Err(format!(
            "--layers {layers}: --block-bytes {} does not split into a K and a V half of every layer",
            a.block_bytes
        ));
    }
    let mut layout = KvLayout::shaped(a.layout, layers, a.pool_blocks, a.block_bytes / per_layer);
    let total = layers
        .checked_mul(a.pp_size)
        .ok_or("--layers × --pp-size overflows")?;
    layout.layers = LayerSpan {
        first: layers.saturating_mul(a.pp_rank),
        count: layers,
        total,
    };
    if let Some(kv_heads) = a.kv_heads {
        let held = handoff_transport::tp::rank_heads(kv_heads, a.tp_size, a.tp_rank)
            .map_err(|e| format!("--kv-heads {kv_heads}: {e}"))?
            .len() as u64;
        let half = (a.block_bytes / per_layer) as u64;
        let per_head = held * u64::from(a.block_tokens.max(1));
        if a.block_tokens == 0 || half % per_head != 0 {
            return Err(format!(
                "--kv-heads {kv_heads}: a K or V half of {half} bytes is not {held} heads × {} tokens of whole bytes",
                a.block_tokens
            ));
        }
        layout.block_tokens = a.block_tokens;
        layout.heads = Some(KvHeads {
            kv_heads,
            order: a.head_order,
            head_bytes: half / per_head,
        });
    }
    let region = Region::alloc(layout).map_err(|e| format!("--layers {layers}: {e}"))?;
    // A pool peers copy into and out of: huge pages where the kernel has them.
    region.advise_huge_pages();
    Ok(region)
}

/// What every line of output is made from.
fn emit(value: serde_json::Value) {
    println!("{value}");
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.clamp(0.001, 1e7))
}

/// The bytes of the `k`-th block of request `id` that a worker at `rank`, laid out as
/// `layout`, holds: prefill writes them, decode expects them. Every
/// byte is one of the model's block, so prefill ranks together fill a decode block, each
/// with its part: pipeline ranks hold consecutive slices of it (their layers); with heads
/// (`layout.heads`), each (part, head, token) is the model's own run of bytes, wherever
/// this rank's order puts it.
fn pattern(id: &RequestId, k: usize, rank: &RankInfo, layout: &KvLayout, bytes: &mut [u8]) {
    let seed = checksum64(id.as_str().as_bytes()) ^ k as u64;
    let Some(heads) = layout.heads else {
        let offset = u64::from(rank.pp_rank) * bytes.len() as u64;
        fill_pattern(bytes, seed, offset);
        return;
    };
    let Ok(mine) = handoff_transport::tp::rank_heads(heads.kv_heads, rank.tp_size, rank.tp_rank)
    else {
        return; // refused when the pool was laid out
    };
    let part = HeadGeometry {
        order: heads.order,
        heads: mine.end - mine.start,
        block_tokens: layout.block_tokens,
        head_bytes: heads.head_bytes,
    };
    let Some(part_bytes) = part.block_bytes().filter(|&b| b > 0) else {
        return; // refused when the pool was laid out
    };
    // A logical block is a run of parts (layer 0's K, its V, ...), whichever ranges hold
    // them: part `q`'s head `h` at token `t` is the model's (q, first + h, t).
    let (tokens, hb) = (u64::from(layout.block_tokens), heads.head_bytes);
    for q in 0..bytes.len() as u64 / part_bytes {
        for h in 0..part.heads {
            for t in 0..layout.block_tokens {
                let model = ((q * u64::from(heads.kv_heads) + u64::from(mine.start + h)) * tokens
                    + u64::from(t))
                    * hb;
                let start = (q * part_bytes + part.offset(h, t)) as usize;
                if let Some(chunk) = bytes.get_mut(start..start + hb as usize) {
                    fill_pattern(chunk, seed, model);
                }
            }
        }
    }
}

fn rank_of(a: &WorkerArgs) -> RankInfo {
    RankInfo {
        engine_id: EngineId::new(&a.engine),
        dp_rank: a.dp_rank,
        dp_size: a.dp_size,
        tp_rank: a.tp_rank,
        tp_size: a.tp_size,
        pp_rank: a.pp_rank,
        pp_size: a.pp_size,
    }
}

/// Runs the worker to completion.
pub async fn run(args: WorkerArgs) -> ExitCode {
    match run_inner(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("handoff worker: {e}");
            emit(json!({"event": "error", "error": e}));
            ExitCode::FAILURE
        }
    }
}

struct Plan {
    ids: Vec<(RequestId, Option<String>)>,
    pool: Vec<BlockId>,
}

async fn run_inner(a: WorkerArgs) -> Result<ExitCode, String> {
    let role = match a.role {
        RoleArg::Prefill => Role::Prefill,
        RoleArg::Decode => Role::Decode,
    };
    let rank = rank_of(&a);
    let key = handoff_bootstrap::exposure::resolve_key(a.secret_file.as_deref())
        .map_err(|e| e.to_string())?;
    let bootstrap = handoff_bootstrap::etcd::with_cluster(&a.bootstrap, a.cluster.as_deref())
        .map_err(|e| e.to_string())?;
    // One wave must fit; the second (`--then-prefill`) waits for blocks the first gives
    // back, as an engine waits for free blocks.
    let needed = a.requests as u64 * a.blocks_per_request as u64;
    if needed > a.pool_blocks as u64 {
        return Err(format!(
            "{needed} blocks needed ({} requests × {} blocks), pool has {}",
            a.requests, a.blocks_per_request, a.pool_blocks
        ));
    }
    let timeouts = Timeouts {
        bootstrap: secs(a.bootstrap_timeout_s),
        waiting: secs(a.waiting_timeout_s),
        transfer: secs(a.transfer_timeout_s),
        pull_ttl: secs(a.pull_ttl_s),
    };
    let mut opts = EngineOptions {
        control_listen: a.control_listen.clone(),
        data_listen: a.data_listen.clone(),
        advertise_host: a.advertise_host.clone(),
        transport: match a.transport {
            TransportArg::Auto => DataTransport::Auto,
            TransportArg::Ucx => DataTransport::Ucx,
            TransportArg::Tcp => DataTransport::Tcp,
        },
        cuda_device: a.cuda_device,
        heartbeat_interval: Duration::from_millis(a.heartbeat_ms),
        tcp_busy_poll: BusyPoll::from_micros(a.tcp_busy_poll_us),
        heartbeats_missed_max: a.heartbeats_missed,
        timeouts,
        mode: match a.mode {
            ModeArg::Push => TransferMode::Push,
            ModeArg::Pull => TransferMode::Pull,
        },
        admission: a.admission,
        key,
        insecure: a.insecure,
        ..EngineOptions::new(role, rank.clone(), bootstrap)
    };
    if a.memory == MemoryArg::Cuda
        && a.mode == ModeArg::Pull
        && !handoff_net::same_host_copies_enabled()
    {
        // Measured on an H200 with UCX 1.22 (ARCHITECTURE.md, open problems): `cuda_ipc`
        // serves puts (hundreds of GB/s) but reads of a peer's device memory are emulated.
        // Same-host copies (on by default) read through the peer's CUDA IPC handles instead.
        tracing::warn!(
            "--memory cuda in pull mode with same-host copies off: UCX reads of a peer's \
             device memory are emulated (under 1 GB/s on an H200 with UCX 1.22, against \
             hundreds of GB/s for writes); --mode push is the fast mode there"
        );
    }
    // The endpoint first: if it cannot bind, nothing has started.
    let registry = handoff_actors::Metrics::new();
    let metrics = match &a.metrics_listen {
        None => None,
        Some(listen) => Some(
            handoff_transport::exposition::serve_metrics(listen, registry.clone())
                .await
                .map_err(|e| format!("--metrics-listen {listen}: {e}"))?,
        ),
    };
    opts.metrics = Some(registry);
    let engine = start_engine_runtime(opts, memory(&a)?)
        .await
        .map_err(|e| e.to_string())?;
    let rt = engine.runtime;
    let (control, data_address, transport, incarnation) = (
        engine.control_address,
        engine.data_address,
        engine.transport,
        engine.incarnation,
    );
    let metrics_at = metrics.as_ref().map(|m| m.local_addr().to_string());
    emit(
        json!({"event": "ready", "role": role.to_string(), "rank": rank.to_string(), "control": control, "data": data_address, "transport": transport, "incarnation": incarnation, "metrics": metrics_at}),
    );
    tokio::time::sleep(Duration::from_millis(a.start_delay_ms)).await;
    let mut plan = Plan {
        ids: Vec::new(),
        pool: (0..a.pool_blocks).rev().map(BlockId).collect(),
    };
    for n in 0..a.requests {
        plan.ids.push((
            RequestId::new(format!("{}-{n}", a.request_prefix)),
            a.prefill.clone(),
        ));
    }
    let second = match role {
        Role::Decode => a.then_prefill.clone().map(Some),
        Role::Prefill => a.then_hold_ms.map(|_| None),
    };
    if let Some(second) = second {
        for n in 0..a.requests {
            plan.ids.push((
                RequestId::new(format!("{}-then-{n}", a.request_prefix)),
                second.clone(),
            ));
        }
    }
    let (code, summary) = drive(&a, &rt, role, plan).await;
    rt.shutdown().await;
    // What the runtime let go after the last request ended: fences still held, shutdown.
    for event in rt.drain_events() {
        if let Event::Released { id, blocks, why } = event {
            emit_released(&id, &blocks, &why);
        }
    }
    emit(summary);
    Ok(code)
}

/// The KV pool `--memory` and `--layers` ask for.
fn memory(a: &WorkerArgs) -> Result<WorkerMemory, String> {
    if a.kv_heads.is_some() && a.layers.is_none() {
        return Err("--kv-heads describes the layers of --layers: give both".into());
    }
    match a.memory {
        MemoryArg::Host => match a.layers {
            // Held as an engine holds its layers; UCX registers every range, TCP moves them.
            Some(layers) => Ok(WorkerMemory::Engine(Arc::new(laid_out_region(a, layers)?))),
            None => Ok(WorkerMemory::Pool {
                blocks: a.pool_blocks,
                block_bytes: a.block_bytes,
            }),
        },
        MemoryArg::Cuda => {
            if a.layers.is_some() {
                return Err("--layers holds host memory: the device pool is one UCX range".into());
            }
            if a.transport == TransportArg::Tcp {
                return Err(
                    "--memory cuda needs --transport ucx or auto: TCP copies through the CPU"
                        .into(),
                );
            }
            let device = a.cuda_device.unwrap_or(0);
            let len = a.pool_blocks as usize * a.block_bytes;
            let buffer = DeviceBuffer::alloc_zeroed(device, len).map_err(|e| {
                format!("--memory cuda: KV pool of {len} bytes on device {device}: {e}")
            })?;
            Ok(WorkerMemory::DevicePool {
                buffer: Arc::new(buffer),
                blocks: a.pool_blocks,
                block_bytes: a.block_bytes,
            })
        }
    }
}

/// A `released` line.
fn emit_released(id: &RequestId, blocks: &[BlockId], why: &ReleaseReason) {
    let blocks: Vec<u32> = blocks.iter().map(|b| b.0).collect();
    emit(
        json!({"event": "released", "request": id.as_str(), "blocks": blocks,
        "why": why.as_str(), "kind": why.failure().map(|r| r.kind()),
        "fence": why.fence().map(|f| f.as_str())}),
    );
}

/// Opens the requests, then drains events until every one has ended (or, with `--serve`,
/// until a signal), printing each end and each release. Returns the exit code and the
/// summary line, printed once the runtime has stopped.
async fn drive(
    a: &WorkerArgs,
    rt: &Runtime,
    role: Role,
    mut plan: Plan,
) -> (ExitCode, serde_json::Value) {
    let total = plan.ids.len();
    let first_wave = a.requests as usize;
    let mut opened: BTreeMap<RequestId, (Instant, Vec<BlockId>)> = BTreeMap::new();
    let started = Instant::now();
    let mut next = 0usize;
    let (mut done, mut failed, mut corrupted) = (0u32, 0u32, 0u32);
    let mut by_kind: BTreeMap<String, u32> = BTreeMap::new();
    // `--keep-done`: the requests whose blocks arrived, kept out of the pool.
    let mut kept: Vec<(RequestId, Vec<BlockId>)> = Vec::new();
    let mut stop = Box::pin(shutdown_signal());
    // Once a newer process holds this rank, what the directory said.
    let mut superseded: Option<String> = None;
    loop {
        if superseded.is_none() {
            superseded = rt.superseded();
            if let Some(detail) = &superseded {
                emit(json!({"event": "superseded", "detail": detail}));
            }
        }
        // Open what is due: the first wave at once, the second after `then_after_ms`.
        while superseded.is_none()
            && next < total
            && (next < first_wave || started.elapsed() >= Duration::from_millis(a.then_after_ms))
            && plan.pool.len() >= a.blocks_per_request as usize
        {
            let (id, prefill) = plan.ids[next].clone();
            next += 1;
            let blocks: Vec<BlockId> = (0..a.blocks_per_request)
                .filter_map(|_| plan.pool.pop())
                .collect();
            let hold = match a.then_hold_ms {
                Some(ms) if next > first_wave => ms,
                _ => a.hold_ms,
            };
            match open(a, rt, role, &id, prefill, blocks.clone(), hold) {
                Ok(()) => {}
                Err(Opened::Refused(e)) => {
                    emit(json!({"event": "error", "request": id.as_str(), "error": e}));
                    plan.pool.extend(blocks);
                    failed += 1;
                    continue;
                }
                Err(Opened::EndedFirst(e)) => {
                    // The request is open but failed before its blocks were handed over:
                    // they stay the worker's, and its end still comes as an event, which
                    // counts it (once).
                    emit(json!({"event": "error", "request": id.as_str(), "error": e}));
                    plan.pool.extend(blocks);
                    opened.insert(id, (Instant::now(), Vec::new()));
                    continue;
                }
            }
            // The blocks this request is given (decode with --no-alloc gives none).
            let given: Vec<u32> = if role == Role::Decode && a.no_alloc {
                Vec::new()
            } else {
                blocks.iter().map(|b| b.0).collect()
            };
            emit(json!({"event": "opened", "request": id.as_str(), "blocks": given}));
            opened.insert(id, (Instant::now(), blocks));
        }
        for event in rt.drain_events() {
            match event {
                Event::State { id, state, .. } if state.is_terminal() => {
                    let (at, blocks) = opened.get(&id).cloned().unwrap_or((started, Vec::new()));
                    // Only decode can verify; prefill reports null.
                    let verified = (role == Role::Decode)
                        .then(|| state == State::Done && verify(rt, &rank_of(a), &id, &blocks));
                    let (kind, reason) = match &state {
                        State::Done => ("done".to_string(), String::new()),
                        State::Failed(r) => (r.kind().to_string(), r.to_string()),
                        _ => unreachable!("terminal states are Done and Failed"),
                    };
                    emit(
                        json!({"event": "end", "request": id.as_str(), "state": if state == State::Done { "Done" } else { "Failed" },
                        "kind": kind, "reason": reason, "verified": verified, "ms": at.elapsed().as_secs_f64() * 1e3}),
                    );
                    *by_kind.entry(kind).or_default() += 1;
                    if state == State::Done {
                        done += 1;
                        if verified == Some(false) {
                            corrupted += 1;
                        }
                    } else {
                        failed += 1;
                    }
                }
                Event::Released { id, blocks, why } => {
                    emit_released(&id, &blocks, &why);
                    if a.keep_done && role == Role::Decode && why == ReleaseReason::Done {
                        kept.push((id, blocks));
                    } else {
                        plan.pool.extend(blocks);
                    }
                }
                Event::State { id, state, .. } => {
                    emit(json!({"event": "state", "request": id.as_str(), "state": state.name()}));
                }
            }
        }
        // Every request opened (or refused) so far has ended.
        let opened_ended = (done + failed) as usize >= next;
        let all_ended = next == total && opened_ended;
        if (all_ended && !a.serve) || (superseded.is_some() && opened_ended) {
            break;
        }
        tokio::select! {
            biased;
            _ = &mut stop => break,
            _ = tokio::time::sleep(Duration::from_millis(5)) => {}
        }
    }
    // `--keep-done`: the blocks that arrived, checked again now.
    let mut recheck_bad = 0u32;
    for (id, blocks) in &kept {
        let verified = verify(rt, &rank_of(a), id, blocks);
        emit(json!({"event": "recheck", "request": id.as_str(), "verified": verified}));
        if !verified {
            recheck_bad += 1;
        }
    }
    let summary = json!({"event": "summary", "done": done, "failed": failed, "corrupted": corrupted, "recheck_bad": recheck_bad, "by_kind": by_kind, "superseded": superseded});
    let clean = done as usize == total && corrupted == 0 && recheck_bad == 0;
    let code = if superseded.is_none() && (a.serve || clean) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    };
    (code, summary)
}

/// Why a request was not opened with its blocks.
enum Opened {
    /// Not opened at all: no event will come for it.
    Refused(String),
    /// Opened, but it ended before its blocks were handed over (they were not taken): its
    /// terminal event comes as any other's.
    EndedFirst(String),
}

fn open(
    a: &WorkerArgs,
    rt: &Runtime,
    role: Role,
    id: &RequestId,
    prefill: Option<String>,
    blocks: Vec<BlockId>,
    hold_ms: u64,
) -> Result<(), Opened> {
    let refused = |e: handoff_actors::Error| Opened::Refused(e.to_string());
    match role {
        Role::Prefill => {
            let sender = rt.sender(id.clone()).map_err(refused)?;
            let region = rt.region().clone();
            let (hold, id, rank) = (Duration::from_millis(hold_ms), id.clone(), rank_of(a));
            tokio::spawn(async move {
                tokio::time::sleep(hold).await;
                let mut bytes = vec![0u8; region.block_bytes()];
                for (k, b) in blocks.iter().enumerate() {
                    pattern(&id, k, &rank, region.layout(), &mut bytes);
                    if region.write_block(*b, &bytes).is_err() {
                        sender.abort();
                        return;
                    }
                }
                if let Err(e) = sender.send(blocks) {
                    // The request ended first: the blocks stay the worker's, never released.
                    tracing::warn!(request = %id, error = %e, "send refused");
                    emit(
                        json!({"event": "error", "request": id.as_str(), "error": format!("send refused: {e}")}),
                    );
                }
            });
        }
        Role::Decode => {
            let prefill = prefill
                .ok_or_else(|| Opened::Refused("a decode worker needs --prefill ENGINE".into()))?;
            let blocks = (!a.no_alloc).then_some(blocks);
            let spec = ReceiverSpec {
                prefill: EngineId::new(prefill),
                prefill_dp_rank: None,
                blocks,
            };
            rt.receiver(id.clone(), spec).map_err(|e| match e {
                e @ handoff_actors::Error::RequestEnded { .. } => Opened::EndedFirst(e.to_string()),
                e => refused(e),
            })?;
        }
    }
    Ok(())
}

fn verify(rt: &Runtime, rank: &RankInfo, id: &RequestId, blocks: &[BlockId]) -> bool {
    let mut want = vec![0u8; rt.region().block_bytes()];
    blocks.iter().enumerate().all(|(k, b)| {
        pattern(id, k, rank, rt.region().layout(), &mut want);
        rt.region().read_block(*b).is_ok_and(|got| got == want)
    })
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        biased;
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
