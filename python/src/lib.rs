//! `handoff._native`: the Python extension over [`handoff_actors`].
//!
//! The pure-Python package `handoff` (beside this crate) wraps it: it turns tensors and
//! arrays into address ranges and defines the exception classes this module raises (by the
//! stable reason names of `errors`). Each `Runtime` owns a small multi-thread tokio
//! runtime on which its handoff runtime runs; no call from Python blocks on the network
//! except the blocking helpers (`wait`, `shutdown`, construction), which release the GIL
//! and take a timeout.
//!
//! Nothing that comes from Python may panic: every argument is checked and every failure is
//! a Python exception naming what was wrong.
//!
//! # Layout
//! - `errors`: failure names and how they become Python exceptions.
//! - `memory`: the registered KV memory from address ranges.
//! - this file: the module, `Runtime`, the handles, `BootstrapServer`.

mod errors;
mod memory;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_actors::{
    BlockId, EngineId, Event, RankInfo, ReceiverSpec, RequestId, Role, State, Timeouts,
    TransferMode,
};
use handoff_bootstrap::{self as bootstrap, ServerConfig};
use handoff_net::engine::{
    HEARTBEATS_MISSED_MAX, HEARTBEATS_MISSED_MIN, HEARTBEAT_INTERVAL_MAX, HEARTBEAT_INTERVAL_MIN,
};
use handoff_net::{start_engine_runtime, DataTransport, EngineOptions};
use handoff_transport::priority::{NICE_RANGE, THREAD_NICE_DEFAULT};
use handoff_transport::wire::limits::{ENGINE_ID_BYTES_MAX, REQUEST_ID_BYTES_MAX};
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyList};

use errors::{Failure, NativeResult};

/// Worker threads of each runtime's tokio runtime: the handoff runtime's actors, its control
/// loop and its data plane are I/O-bound; two threads keep a slow task from stalling the
/// others without taking cores from the engine.
const TOKIO_WORKER_THREADS: usize = 2;

/// Longest a blocking call may be asked to wait, in seconds (a day): longer is a mistake.
const WAIT_SECONDS_MAX: f64 = 86_400.0;

/// Longest `shutdown` waits for the runtime to stop by default.
const SHUTDOWN_TIMEOUT_DEFAULT_S: f64 = 10.0;

/// A tokio runtime that knows the process that made it. Its worker threads do not survive
/// a `fork`: a child that inherited it (Python's `multiprocessing` forks by default) must
/// neither use it nor drop it (dropping waits for threads that are not there), so in any
/// other process it is refused ([`Tokio::here`]) and leaked.
struct Tokio {
    rt: std::mem::ManuallyDrop<tokio::runtime::Runtime>,
    pid: u32,
}

impl Tokio {
    /// The runtime, in the process that made it.
    fn here(&self) -> NativeResult<&tokio::runtime::Runtime> {
        if std::process::id() == self.pid {
            Ok(&self.rt)
        } else {
            Err(Failure::new(
                "runtime_stopped",
                format!(
                    "this handoff object was made in process {} and cannot be used in a forked child ({}); make a new one there",
                    self.pid,
                    std::process::id()
                ),
            ))
        }
    }
}

impl Drop for Tokio {
    fn drop(&mut self) {
        if std::process::id() == self.pid {
            // SAFETY: dropped once, here; `rt` is not used after.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.rt) };
        }
    }
}

/// The runtime's own tokio threads, at `nice` when given (`handoff_transport::priority`).
fn tokio_runtime(nice: Option<i32>) -> NativeResult<Arc<Tokio>> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(TOKIO_WORKER_THREADS)
        .thread_name("handoff-rt")
        .on_thread_start(move || handoff_transport::priority::apply(nice, "tokio"))
        .enable_all()
        .build()
        .map(|rt| {
            Arc::new(Tokio {
                rt: std::mem::ManuallyDrop::new(rt),
                pid: std::process::id(),
            })
        })
        .map_err(|e| Failure::new("internal_error", format!("cannot start tokio: {e}")))
}

/// Seconds from Python as a bounded duration.
fn seconds(what: &str, s: f64) -> NativeResult<Duration> {
    if !s.is_finite() || s < 0.0 {
        return Err(Failure::invalid(format!(
            "{what} must be a finite number of seconds >= 0, not {s}"
        )));
    }
    Ok(Duration::from_secs_f64(s.min(WAIT_SECONDS_MAX)))
}

/// A lifecycle deadline: a timeout of zero would fail every request at once.
fn deadline(what: &str, s: f64) -> NativeResult<Duration> {
    let d = seconds(what, s)?;
    if d.is_zero() {
        return Err(Failure::invalid(format!("{what} must be more than 0")));
    }
    Ok(d)
}

fn request_id(id: &str) -> NativeResult<RequestId> {
    if id.is_empty() || id.len() > REQUEST_ID_BYTES_MAX {
        return Err(Failure::invalid(format!(
            "a request id has 1 to {REQUEST_ID_BYTES_MAX} bytes, not {}",
            id.len()
        )));
    }
    Ok(RequestId::new(id))
}

fn engine_id(id: &str) -> NativeResult<EngineId> {
    if id.is_empty() || id.len() > ENGINE_ID_BYTES_MAX {
        return Err(Failure::invalid(format!(
            "an engine id has 1 to {ENGINE_ID_BYTES_MAX} bytes, not {}",
            id.len()
        )));
    }
    Ok(EngineId::new(id))
}

/// Block ids from any iterable of non-negative ints below 2^32.
fn blocks_from(obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockId>> {
    let py = obj.py();
    let iter = obj.try_iter().map_err(|_| {
        Failure::invalid(format!(
            "blocks must be a list of ints, not {}",
            type_name(obj)
        ))
        .into_py(py)
    })?;
    let mut blocks = Vec::new();
    for item in iter {
        let item = item?;
        if item.is_instance_of::<PyBool>() || item.is_instance_of::<PyFloat>() {
            return Err(Failure::invalid(format!(
                "a block id must be an int, not {}",
                type_name(&item)
            ))
            .into_py(py));
        }
        // Anything with `__index__` (Python and numpy ints); an int too large even for
        // i128 is out of range like any other.
        let b: i128 = match item.extract() {
            Ok(b) => b,
            Err(e) if e.is_instance_of::<PyOverflowError>(py) => i128::MAX,
            Err(_) => {
                return Err(Failure::invalid(format!(
                    "a block id must be an int, not {}",
                    type_name(&item)
                ))
                .into_py(py))
            }
        };
        let b = u32::try_from(b).map_err(|_| {
            Failure::new(
                "block_out_of_range",
                format!("block id {b} is not in 0..2^32"),
            )
            .into_py(py)
        })?;
        blocks.push(BlockId(b));
    }
    Ok(blocks)
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// How often a blocking call comes back for the GIL to let Python handle signals
/// (Ctrl-C), so no wait is uninterruptible for longer than this.
const SIGNAL_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// Blocks (without the GIL) until `fut` resolves (`Some`) or `timeout` passes (`None`);
/// a pending signal's exception (e.g. `KeyboardInterrupt`) ends the wait and drops `fut`.
fn block_on<F: std::future::Future + Send>(
    py: Python<'_>,
    tokio: &Tokio,
    timeout: Duration,
    fut: F,
) -> PyResult<Option<F::Output>>
where
    F::Output: Send,
{
    let tokio = tokio.here().map_err(|f| f.into_py(py))?;
    let deadline = std::time::Instant::now() + timeout;
    let mut fut = Box::pin(fut);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let slice = left.min(SIGNAL_CHECK_INTERVAL);
        let got = py.allow_threads(|| {
            tokio.block_on(async { tokio::time::timeout(slice, &mut fut).await.ok() })
        });
        if got.is_some() {
            return Ok(got);
        }
        if left <= slice {
            return Ok(None);
        }
        py.check_signals()?;
    }
}

/// What both handles share.
struct HandleCore {
    id: RequestId,
    tokio: Arc<Tokio>,
}

/// A terminal state as what `wait` returns: `"Done"`, or the failure raised.
fn finished(state: &State) -> NativeResult<&'static str> {
    match state {
        State::Failed(reason) => Err(Failure::from_reason(reason)),
        other => Ok(other.name()),
    }
}

macro_rules! handle_methods {
    ($ty:ident, { $($extra:tt)* }) => {
        #[pymethods]
        impl $ty {
            $($extra)*

            /// The request's id.
            #[getter]
            fn id(&self) -> &str {
                self.core.id.as_str()
            }

            /// The state now: `Bootstrapping`, `WaitingForInput`, `Transferring`, `Done`
            /// or `Failed`. Never blocks.
            fn poll(&self) -> &'static str {
                self.inner.poll().name()
            }

            /// The failure's reason name (e.g. `peer_lost`) once `Failed`, else `None`.
            #[getter]
            fn reason(&self) -> Option<&'static str> {
                match self.inner.poll() {
                    State::Failed(r) => Some(r.kind()),
                    _ => None,
                }
            }

            /// The failure's description once `Failed`, else `None`.
            #[getter]
            fn detail(&self) -> Option<String> {
                match self.inner.poll() {
                    State::Failed(r) => Some(r.to_string()),
                    _ => None,
                }
            }

            /// Aborts the request: it fails `aborted_by_engine`, the peer is told, its
            /// blocks are released. Never blocks.
            fn abort(&self, py: Python<'_>) -> PyResult<()> {
                let _guard = self.core.tokio.here().map_err(|f| f.into_py(py))?.enter();
                self.inner.abort();
                Ok(())
            }

            /// Blocks (releasing the GIL) until the request ends: returns `"Done"`, raises
            /// the failure (e.g. `PeerLost`), or `WaitTimeout` after `timeout_s`.
            #[pyo3(signature = (timeout_s))]
            fn wait(&self, py: Python<'_>, timeout_s: f64) -> PyResult<&'static str> {
                let timeout = seconds("timeout_s", timeout_s).map_err(|f| f.into_py(py))?;
                let fut = self.inner.completion();
                match block_on(py, &self.core.tokio, timeout, fut)? {
                    Some(state) => finished(&state).map_err(|f| f.into_py(py)),
                    None => Err(Failure::new(
                        "wait_timeout",
                        format!(
                            "request {} still {} after {timeout_s} s",
                            self.core.id,
                            self.inner.poll().name()
                        ),
                    )
                    .into_py(py)),
                }
            }

            fn __repr__(&self) -> String {
                format!(
                    "<{} {:?} {}>",
                    stringify!($ty),
                    self.core.id.as_str(),
                    self.inner.poll().name()
                )
            }
        }
    };
}

/// The engine's handle on one prefill request.
#[pyclass(module = "handoff._native", frozen, weakref)]
struct SenderHandle {
    inner: handoff_actors::SenderHandle,
    core: HandleCore,
}

handle_methods!(SenderHandle, {
    /// The KV cache is computed and lives in `blocks`: hand them to the runtime, which
    /// holds them until the request ends (a `released` event gives them back). `aux`: bytes
    /// for decode's engine beside the KV (at most `AUX_BYTES_MAX`), read there with
    /// `ReceiverHandle.aux` once the request is `Done`.
    #[pyo3(signature = (blocks, aux = None))]
    fn send(&self, py: Python<'_>, blocks: &Bound<'_, PyAny>, aux: Option<&[u8]>) -> PyResult<()> {
        let blocks = blocks_from(blocks)?;
        let _guard = self.core.tokio.here().map_err(|f| f.into_py(py))?.enter();
        self.inner
            .send_with_aux(blocks, aux.map(<[u8]>::to_vec).unwrap_or_default())
            .map_err(|e| Failure::from_error(&e).into_py(py))
    }
});

/// The engine's handle on one decode request.
#[pyclass(module = "handoff._native", frozen, weakref)]
struct ReceiverHandle {
    inner: handoff_actors::ReceiverHandle,
    core: HandleCore,
}

handle_methods!(ReceiverHandle, {
    /// The destination blocks are allocated: the runtime tells prefill and holds them until
    /// the request ends (`released` after `Done` means they hold the KV cache).
    fn allocate(&self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let blocks = blocks_from(blocks)?;
        let _guard = self.core.tokio.here().map_err(|f| f.into_py(py))?.enter();
        self.inner
            .allocate(blocks)
            .map_err(|e| Failure::from_error(&e).into_py(py))
    }

    /// What prefill's engines sent beside the KV (`SenderHandle.send(blocks, aux)`): one
    /// `(rank, bytes)` per prefill rank that sent any, `rank` as `Runtime.rank` names it.
    /// Complete once the request is `Done`.
    #[getter]
    fn aux<'py>(&self, py: Python<'py>) -> Vec<(String, Bound<'py, pyo3::types::PyBytes>)> {
        self.inner
            .aux()
            .into_iter()
            .map(|(rank, bytes)| (rank.to_string(), pyo3::types::PyBytes::new(py, &bytes)))
            .collect()
    }

    /// Refuses the request because this decode is saturated: prefill is told at once.
    fn reject_busy(&self, py: Python<'_>) -> PyResult<()> {
        let _guard = self.core.tokio.here().map_err(|f| f.into_py(py))?.enter();
        self.inner.reject_busy();
        Ok(())
    }
});

/// One worker's handoff runtime (see the Python `handoff.Runtime`, which builds it).
#[pyclass(module = "handoff._native", frozen)]
struct Runtime {
    /// `None` once shut down.
    runtime: Mutex<Option<Arc<handoff_actors::Runtime>>>,
    /// Kept after shutdown so events can still be drained.
    events: Arc<handoff_actors::Runtime>,
    tokio: Arc<Tokio>,
    role: Role,
    rank: RankInfo,
    control_address: String,
    data_address: String,
    transport: &'static str,
    incarnation: u64,
    num_blocks: u32,
    block_bytes: usize,
    /// The runtime's metrics, and their HTTP endpoint when `metrics_listen` asked for one
    /// (served until this object goes, shutdown or not).
    metrics: Arc<handoff_actors::Metrics>,
    metrics_server: Option<handoff_transport::exposition::MetricsServer>,
}

/// Arguments of [`Runtime::new`] past who the worker is (all keyword-only in Python).
struct Settings {
    opts: EngineOptions,
    start_timeout: Duration,
}

#[allow(clippy::too_many_arguments)]
fn settings(
    role: &str,
    engine: &str,
    bootstrap: &str,
    ranks: [u32; 6],
    transport: &str,
    mode: &str,
    timeouts: [f64; 5],
    heartbeat_ms: u64,
    heartbeats_missed: u32,
    secret_file: Option<std::path::PathBuf>,
    admission: Option<usize>,
) -> NativeResult<Settings> {
    let role = match role {
        "prefill" => Role::Prefill,
        "decode" => Role::Decode,
        other => {
            return Err(Failure::invalid(format!(
                "role must be \"prefill\" or \"decode\", not {other:?}"
            )))
        }
    };
    let [dp_rank, dp_size, tp_rank, tp_size, pp_rank, pp_size] = ranks;
    for (what, rank, size) in [
        ("dp", dp_rank, dp_size),
        ("tp", tp_rank, tp_size),
        ("pp", pp_rank, pp_size),
    ] {
        if size == 0 || rank >= size {
            return Err(Failure::invalid(format!(
                "{what}_rank {rank} must be below {what}_size {size} (at least 1)"
            )));
        }
    }
    let rank = RankInfo {
        engine_id: engine_id(engine)?,
        dp_rank,
        dp_size,
        tp_rank,
        tp_size,
        pp_rank,
        pp_size,
    };
    let transport = match transport {
        "auto" => DataTransport::Auto,
        "ucx" => DataTransport::Ucx,
        "tcp" => DataTransport::Tcp,
        other => {
            return Err(Failure::invalid(format!(
                "transport must be \"auto\", \"ucx\" or \"tcp\", not {other:?}"
            )))
        }
    };
    let mode = match mode {
        "push" => TransferMode::Push,
        "pull" => TransferMode::Pull,
        other => {
            return Err(Failure::invalid(format!(
                "mode must be \"push\" or \"pull\", not {other:?}"
            )))
        }
    };
    let [bootstrap_s, waiting_s, transfer_s, pull_ttl_s, register_s] = timeouts;
    let key = handoff_bootstrap::exposure::resolve_key(secret_file.as_deref())
        .map_err(|e| Failure::invalid(e.to_string()))?;
    if admission == Some(0) {
        return Err(Failure::invalid("admission must be at least 1 (or None)"));
    }
    let heartbeat = Duration::from_millis(heartbeat_ms);
    if !(HEARTBEAT_INTERVAL_MIN..=HEARTBEAT_INTERVAL_MAX).contains(&heartbeat) {
        return Err(Failure::invalid(format!(
            "heartbeat_ms must be in {}..={}, not {heartbeat_ms}",
            HEARTBEAT_INTERVAL_MIN.as_millis(),
            HEARTBEAT_INTERVAL_MAX.as_millis()
        )));
    }
    if !(HEARTBEATS_MISSED_MIN..=HEARTBEATS_MISSED_MAX).contains(&heartbeats_missed) {
        return Err(Failure::invalid(format!(
            "heartbeats_missed must be in {HEARTBEATS_MISSED_MIN}..={HEARTBEATS_MISSED_MAX}, \
             not {heartbeats_missed} (the writer's lease needs two)"
        )));
    }
    let register_timeout = deadline("register_timeout_s", register_s)?;
    let opts = EngineOptions {
        transport,
        heartbeat_interval: heartbeat,
        heartbeats_missed_max: heartbeats_missed,
        register_timeout,
        timeouts: Timeouts {
            bootstrap: deadline("bootstrap_s", bootstrap_s)?,
            waiting: deadline("waiting_s", waiting_s)?,
            transfer: deadline("transfer_s", transfer_s)?,
            pull_ttl: deadline("pull_ttl_s", pull_ttl_s)?,
        },
        mode,
        admission,
        key,
        ..EngineOptions::new(role, rank, bootstrap)
    };
    Ok(Settings {
        opts,
        // Registration has its own deadline; the data plane's start (UCX) has its own too.
        start_timeout: register_timeout + Duration::from_secs(70),
    })
}

impl Runtime {
    fn live(&self) -> NativeResult<Arc<handoff_actors::Runtime>> {
        self.runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| Failure::new("runtime_stopped", "the runtime was shut down"))
    }

    fn core(&self, id: RequestId) -> HandleCore {
        HandleCore {
            id,
            tokio: self.tokio.clone(),
        }
    }
}

#[pymethods]
impl Runtime {
    /// Starts the runtime: the data plane over the given ranges, the control port, the
    /// registration with the bootstrap server (releasing the GIL while it waits).
    #[new]
    #[pyo3(signature = (
        role, engine, bootstrap, ranges, num_blocks, *, device="cpu", layers=None,
        block_tokens=0, dtype_bytes=0, kv_heads=0, head_order="hnd", head_bytes=0, dp_rank=0, dp_size=1, tp_rank=0, tp_size=1, pp_rank=0,
        pp_size=1, transport="auto", mode="pull", control_listen="tcp://127.0.0.1:0",
        data_listen="127.0.0.1:0", advertise_host=None, bootstrap_s=300.0, waiting_s=300.0,
        transfer_s=60.0, pull_ttl_s=480.0, register_timeout_s=30.0, heartbeat_ms=5000,
        heartbeats_missed=6, secret_file=None, admission=None, keep=None, insecure=false,
        metrics_listen=None, thread_nice=Some(THREAD_NICE_DEFAULT), tcp_busy_poll_us=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        role: &str,
        engine: &str,
        bootstrap: &str,
        ranges: Vec<(u64, u64, u64)>,
        num_blocks: u64,
        device: &str,
        layers: Option<(u32, u32, u32)>,
        block_tokens: u32,
        dtype_bytes: u32,
        kv_heads: u32,
        head_order: &str,
        head_bytes: u64,
        dp_rank: u32,
        dp_size: u32,
        tp_rank: u32,
        tp_size: u32,
        pp_rank: u32,
        pp_size: u32,
        transport: &str,
        mode: &str,
        control_listen: &str,
        data_listen: &str,
        advertise_host: Option<String>,
        bootstrap_s: f64,
        waiting_s: f64,
        transfer_s: f64,
        pull_ttl_s: f64,
        register_timeout_s: f64,
        heartbeat_ms: u64,
        heartbeats_missed: u32,
        secret_file: Option<std::path::PathBuf>,
        admission: Option<usize>,
        keep: Option<PyObject>,
        insecure: bool,
        metrics_listen: Option<String>,
        thread_nice: Option<i32>,
        tcp_busy_poll_us: Option<u64>,
    ) -> PyResult<Runtime> {
        let err = |f: Failure| f.into_py(py);
        let Settings {
            mut opts,
            start_timeout,
        } = settings(
            role,
            engine,
            bootstrap,
            [dp_rank, dp_size, tp_rank, tp_size, pp_rank, pp_size],
            transport,
            mode,
            [
                bootstrap_s,
                waiting_s,
                transfer_s,
                pull_ttl_s,
                register_timeout_s,
            ],
            heartbeat_ms,
            heartbeats_missed,
            secret_file,
            admission,
        )
        .map_err(err)?;
        opts.control_listen = control_listen.to_string();
        opts.data_listen = data_listen.to_string();
        opts.advertise_host = advertise_host;
        opts.insecure = insecure;
        if let Some(n) = thread_nice {
            if !NICE_RANGE.contains(&n) {
                return Err(err(Failure::invalid(format!(
                    "thread_nice is a nice value from -20 to 19 (or None), not {n}"
                ))));
            }
        }
        opts.thread_nice = thread_nice;
        let most = handoff_transport::tcp::BUSY_POLL_MAX.as_micros() as u64;
        if let Some(us) = tcp_busy_poll_us.filter(|&us| us > most) {
            return Err(err(Failure::invalid(format!(
                "tcp_busy_poll_us is 0 to {most} microseconds (or None), not {us}"
            ))));
        }
        opts.tcp_busy_poll = handoff_transport::tcp::BusyPoll::from_micros(tcp_busy_poll_us);
        let spec = memory::Spec {
            ranges,
            num_blocks,
            device: device.to_string(),
            layers,
            block_tokens,
            dtype_bytes,
            heads: memory::heads(kv_heads, head_order, head_bytes).map_err(err)?,
        };
        let region = memory::region(spec, keep).map_err(err)?;
        let (num_blocks, block_bytes) = (region.blocks(), region.block_bytes());
        let tokio = tokio_runtime(thread_nice).map_err(err)?;
        let (role, rank) = (opts.role, opts.rank.clone());
        // The endpoint first: if it cannot bind, nothing has started.
        let metrics = handoff_actors::Metrics::new();
        opts.metrics = Some(metrics.clone());
        let metrics_server = match metrics_listen {
            None => None,
            Some(listen) => {
                let serve = handoff_transport::exposition::serve_metrics(&listen, metrics.clone());
                match block_on(py, &tokio, start_timeout, serve)? {
                    Some(Ok(server)) => Some(server),
                    Some(Err(e)) => {
                        let detail = format!("metrics_listen {listen}: {e}");
                        return Err(err(Failure::new("bind_failed", detail)));
                    }
                    None => {
                        let detail = format!("metrics_listen {listen}: no answer");
                        return Err(err(Failure::new("bind_failed", detail)));
                    }
                }
            }
        };
        let started = block_on(
            py,
            &tokio,
            start_timeout,
            start_engine_runtime(opts, handoff_net::WorkerMemory::Engine(Arc::new(region))),
        )?;
        let engine = match started {
            Some(Ok(engine)) => engine,
            Some(Err(e)) => return Err(err(Failure::from_net(&e))),
            None => {
                return Err(err(Failure::new(
                    "start_failed",
                    format!("the runtime did not start within {start_timeout:?}"),
                )))
            }
        };
        let runtime = Arc::new(engine.runtime);
        Ok(Runtime {
            metrics,
            metrics_server,
            runtime: Mutex::new(Some(runtime.clone())),
            events: runtime,
            tokio,
            role,
            rank,
            control_address: engine.control_address,
            data_address: engine.data_address,
            transport: engine.transport,
            incarnation: engine.incarnation,
            num_blocks,
            block_bytes,
        })
    }

    /// `"prefill"` or `"decode"`.
    #[getter]
    fn role(&self) -> String {
        self.role.to_string()
    }

    /// This worker's engine id.
    #[getter]
    fn engine(&self) -> &str {
        self.rank.engine_id.as_str()
    }

    /// This worker's rank, as `engine/dp../tp../pp..`.
    #[getter]
    fn rank(&self) -> String {
        self.rank.to_string()
    }

    /// Where peers reach the control port.
    #[getter]
    fn control_address(&self) -> &str {
        &self.control_address
    }

    /// What the data plane registered.
    #[getter]
    fn data_address(&self) -> &str {
        &self.data_address
    }

    /// The data plane in use: `"tcp"` or `"ucx"`.
    #[getter]
    fn transport(&self) -> &'static str {
        self.transport
    }

    /// This worker's incarnation.
    #[getter]
    fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Blocks in the registered KV memory.
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Bytes of one logical block (every range's share, concatenated).
    #[getter]
    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Opens a prefill request. Never blocks.
    fn sender(&self, py: Python<'_>, id: &str) -> PyResult<SenderHandle> {
        let open = || -> NativeResult<SenderHandle> {
            let rt = self.live()?;
            let id = request_id(id)?;
            let _guard = self.tokio.here()?.enter();
            let inner = rt.sender(id.clone()).map_err(|e| Failure::from_error(&e))?;
            Ok(SenderHandle {
                inner,
                core: self.core(id),
            })
        };
        open().map_err(|f| f.into_py(py))
    }

    /// Opens a decode request receiving from `prefill_engine` (its `dp_rank`, or the lowest
    /// registered), with its destination `blocks` now or later through `allocate`.
    #[pyo3(signature = (id, prefill_engine, dp_rank=None, blocks=None))]
    fn receiver(
        &self,
        py: Python<'_>,
        id: &str,
        prefill_engine: &str,
        dp_rank: Option<u32>,
        blocks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<ReceiverHandle> {
        let blocks = blocks.map(blocks_from).transpose()?;
        let open = || -> NativeResult<ReceiverHandle> {
            let rt = self.live()?;
            let id = request_id(id)?;
            let spec = ReceiverSpec {
                prefill: engine_id(prefill_engine)?,
                prefill_dp_rank: dp_rank,
                blocks,
            };
            let _guard = self.tokio.here()?.enter();
            let inner = rt
                .receiver(id.clone(), spec)
                .map_err(|e| Failure::from_error(&e))?;
            Ok(ReceiverHandle {
                inner,
                core: self.core(id),
            })
        };
        open().map_err(|f| f.into_py(py))
    }

    /// Every event since the last call, oldest first, as tuples
    /// `(request_id, kind, state, reason, blocks, detail, why, fence)`. Never blocks.
    /// A `released` event's `why` is why the runtime let the blocks go (`done`, `failed`,
    /// `late`, `shutdown`); when `failed`, `reason` is the failure's kind and `detail` its
    /// text, and `fence` says how a fence that held them ended (`confirmed`, `bound`).
    fn drain_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.events.drain_events();
        let list = PyList::empty(py);
        for event in events {
            let tuple = match event {
                Event::State { id, state, .. } => {
                    let (reason, detail) = match &state {
                        State::Failed(r) => (Some(r.kind()), Some(r.to_string())),
                        _ => (None, None),
                    };
                    let blocks: Vec<u32> = Vec::new();
                    (
                        id.as_str().to_string(),
                        "state",
                        Some(state.name()),
                        reason,
                        blocks,
                        detail,
                        None::<&str>,
                        None::<&str>,
                    )
                        .into_pyobject(py)?
                }
                Event::Released { id, blocks, why } => {
                    let blocks: Vec<u32> = blocks.iter().map(|b| b.0).collect();
                    let failure = why.failure();
                    (
                        id.as_str().to_string(),
                        "released",
                        None::<&str>,
                        failure.map(|r| r.kind()),
                        blocks,
                        failure.map(|r| r.to_string()),
                        Some(why.as_str()),
                        why.fence().map(|f| f.as_str()),
                    )
                        .into_pyobject(py)?
                }
            };
            list.append(tuple)?;
        }
        Ok(list)
    }

    /// Requests open now: live, or ended with their final event not drained yet.
    fn open_requests(&self) -> usize {
        self.events.open_requests()
    }

    /// Blocks (releasing the GIL) until every handle's request has ended or `timeout_s`
    /// passes; returns `{id: "Done" | "Failed"}` for each, raising `WaitTimeout` (naming
    /// the requests still live) if they have not all ended.
    #[pyo3(signature = (handles, timeout_s))]
    fn wait<'py>(
        &self,
        py: Python<'py>,
        handles: &Bound<'py, PyAny>,
        timeout_s: f64,
    ) -> PyResult<Vec<(String, &'static str)>> {
        let timeout = seconds("timeout_s", timeout_s).map_err(|f| f.into_py(py))?;
        let mut waits = Vec::new();
        for h in handles.try_iter()? {
            let h = h?;
            let (id, fut): (
                RequestId,
                std::pin::Pin<Box<dyn std::future::Future<Output = State> + Send>>,
            ) = if let Ok(s) = h.downcast::<SenderHandle>() {
                let s = s.get();
                (s.core.id.clone(), Box::pin(s.inner.completion()))
            } else if let Ok(r) = h.downcast::<ReceiverHandle>() {
                let r = r.get();
                (r.core.id.clone(), Box::pin(r.inner.completion()))
            } else {
                return Err(Failure::invalid(format!(
                    "wait takes sender or receiver handles, not {}",
                    type_name(&h)
                ))
                .into_py(py));
            };
            waits.push((id, fut));
        }
        let ids: Vec<RequestId> = waits.iter().map(|(id, _)| id.clone()).collect();
        let results = Arc::new(Mutex::new(Vec::new()));
        let sink = results.clone();
        let all = async move {
            for (id, fut) in waits {
                let state = fut.await;
                sink.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((id.as_str().to_string(), state.name()));
            }
        };
        let ended = block_on(py, &self.tokio, timeout, all)?.is_some();
        let results = std::mem::take(&mut *results.lock().unwrap_or_else(|e| e.into_inner()));
        if !ended {
            let live: Vec<&str> = ids
                .iter()
                .map(|id| id.as_str())
                .filter(|id| !results.iter().any(|(done, _)| done == id))
                .collect();
            return Err(Failure::new(
                "wait_timeout",
                format!("still live after {timeout_s} s: {}", live.join(", ")),
            )
            .into_py(py));
        }
        Ok(results)
    }

    /// Stops the runtime (releasing the GIL, at most `timeout_s`): every live request fails
    /// (`internal_error`, "runtime stopped") and its blocks are released; events can still
    /// be drained. Idempotent.
    #[pyo3(signature = (timeout_s=SHUTDOWN_TIMEOUT_DEFAULT_S))]
    fn shutdown(&self, py: Python<'_>, timeout_s: f64) -> PyResult<bool> {
        let timeout = seconds("timeout_s", timeout_s).map_err(|f| f.into_py(py))?;
        let rt = self
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let Some(rt) = rt else { return Ok(true) };
        let stopped = block_on(py, &self.tokio, timeout, async move { rt.shutdown().await })?;
        Ok(stopped.is_some())
    }

    /// Where `metrics_listen` serves `/metrics` (`HOST:PORT`), or `None`.
    #[getter]
    fn metrics_address(&self) -> Option<String> {
        self.metrics_server
            .as_ref()
            .map(|s| s.local_addr().to_string())
    }

    /// The runtime's metrics now, in the Prometheus text format (what `/metrics` serves).
    fn metrics_text(&self) -> String {
        self.metrics.encode()
    }

    /// What the directory said if a newer process holds this worker's rank (every open
    /// request failed `Superseded`, and new ones are refused the same way: stop this
    /// process), else `None` (also once shut down).
    #[getter]
    fn superseded(&self) -> Option<String> {
        let rt = self.runtime.lock().unwrap_or_else(|e| e.into_inner());
        rt.as_ref().and_then(|rt| rt.superseded())
    }

    /// True until `shutdown`.
    #[getter]
    fn running(&self) -> bool {
        self.runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    fn __repr__(&self) -> String {
        format!(
            "<handoff Runtime {} {} transport={} blocks={}×{}B{}>",
            self.role,
            self.rank,
            self.transport,
            self.num_blocks,
            self.block_bytes,
            if self.running() { "" } else { " stopped" }
        )
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let rt = self
            .runtime
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        // Not shut down by the program: stop it so the engine's memory is no longer
        // registered once the Python object is gone. The runtime never needs the GIL. (In a
        // forked child there is nothing to stop: the threads stayed with the parent.)
        if let (Some(rt), Ok(tokio)) = (rt, self.tokio.here()) {
            let stop = async move { rt.shutdown().await };
            tokio.block_on(async {
                let _ = tokio::time::timeout(Duration::from_secs(5), stop).await;
            });
        }
    }
}

/// A bootstrap server running in this process, on its own tokio runtime.
#[pyclass(module = "handoff._native", frozen)]
struct BootstrapServer {
    server: Mutex<Option<bootstrap::BootstrapServer>>,
    address: String,
    tokio: Arc<Tokio>,
}

#[pymethods]
impl BootstrapServer {
    /// Binds `listen` (`tcp://HOST:PORT`, port 0 picks one) and serves until `stop`.
    #[new]
    #[pyo3(signature = (
        listen="tcp://127.0.0.1:0", *, secret_file=None, expire_after_s=None, insecure=false
    ))]
    fn new(
        py: Python<'_>,
        listen: &str,
        secret_file: Option<std::path::PathBuf>,
        expire_after_s: Option<f64>,
        insecure: bool,
    ) -> PyResult<BootstrapServer> {
        let make = || -> NativeResult<ServerConfig> {
            let mut cfg = ServerConfig::new(listen).with_insecure(insecure);
            let key = handoff_bootstrap::exposure::resolve_key(secret_file.as_deref())
                .map_err(|e| Failure::invalid(e.to_string()))?;
            if let Some(key) = key {
                cfg = cfg.with_key(key);
            }
            if let Some(s) = expire_after_s {
                cfg = cfg.with_expire_after(deadline("expire_after_s", s)?);
            }
            Ok(cfg)
        };
        let cfg = make().map_err(|f| f.into_py(py))?;
        let tokio = tokio_runtime(None).map_err(|f| f.into_py(py))?;
        let started = block_on(py, &tokio, Duration::from_secs(30), bootstrap::serve(cfg))?;
        let server = match started {
            Some(Ok(server)) => server,
            Some(Err(e)) => {
                let kind = match e {
                    bootstrap::BootstrapError::Exposed(_) => "insecure",
                    _ => "start_failed",
                };
                return Err(Failure::new(kind, format!("bootstrap server: {e}")).into_py(py));
            }
            None => {
                return Err(
                    Failure::new("start_failed", "bootstrap server did not start in 30 s")
                        .into_py(py),
                )
            }
        };
        Ok(BootstrapServer {
            address: server.address(),
            server: Mutex::new(Some(server)),
            tokio,
        })
    }

    /// `tcp://IP:PORT`: what workers pass as `bootstrap`.
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    /// Stops the server (releasing the GIL). Idempotent.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        let server = self.server.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(server) = server {
            block_on(py, &self.tokio, Duration::from_secs(10), server.stop())?;
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("<handoff BootstrapServer {}>", self.address)
    }
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        let server = self
            .server
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let (Some(server), Ok(tokio)) = (server, self.tokio.here()) {
            tokio.block_on(async {
                let _ = tokio::time::timeout(Duration::from_secs(5), server.stop()).await;
            });
        }
    }
}

/// Logs to stderr at `level` (`RUST_LOG` syntax, e.g. `"warn"` or `"handoff=debug"`), as
/// text or, with `json`, one JSON object per line with the request's span (id, role, rank,
/// peer). Call once, before starting runtimes; later calls do nothing.
#[pyfunction]
#[pyo3(signature = (level="warn", json=false))]
fn init_logging(level: &str, json: bool) -> bool {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        logs.json().with_current_span(true).try_init().is_ok()
    } else {
        logs.try_init().is_ok()
    }
}

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Runtime>()?;
    m.add_class::<SenderHandle>()?;
    m.add_class::<ReceiverHandle>()?;
    m.add_class::<BootstrapServer>()?;
    m.add_function(wrap_pyfunction!(init_logging, m)?)?;
    m.add("REQUEST_ID_BYTES_MAX", REQUEST_ID_BYTES_MAX)?;
    m.add("ENGINE_ID_BYTES_MAX", ENGINE_ID_BYTES_MAX)?;
    m.add("AUX_BYTES_MAX", handoff_transport::wire::AUX_BYTES_MAX)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("THREAD_NICE_DEFAULT", THREAD_NICE_DEFAULT)?;
    Ok(())
}
