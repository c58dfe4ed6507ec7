//! The full request lifecycle's latency, for `handoff bench`: a prefill and a decode
//! runtime in this process on the real network transport (ZMTP control channels and the
//! TCP or UCX data plane over loopback), peers already resolved and connected (the
//! bootstrap answer cached), then one-block requests one after the other, each timed from
//! opening both sides to decode's `Done`: transfer info, the write (or `Ready` and the
//! read), `Done`, and every actor hop in between.

use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_actors::{
    BlockId, EngineId, RankInfo, ReceiverSpec, Region, Role, Runtime, State, TransferMode,
    TransportChoice,
};
use handoff_bootstrap::Key;
use handoff_net::tcp::TcpDataPlane;
use handoff_net::ucx::UcxPlane;
use handoff_net::{DataPlane, NetConfig, NetTransport, StaticDirectory};
use handoff_transport::data::UcxPlaneOptions;

/// Blocks each side's pool holds; requests cycle through them.
const POOL_BLOCKS: u32 = 64;
/// Longest one request may take before the measurement gives up on it.
const REQUEST_DEADLINE: Duration = Duration::from_secs(10);

/// Which data plane the lifecycle runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plane {
    /// The TCP data plane.
    Tcp,
    /// The UCX data plane, over heap memory registered by address (an engine's tensors,
    /// which a verified same-host peer copies with the kernel) or over memory UCX allocates
    /// (`handoff worker`'s pool, which a same-host peer's UCX maps and writes through its
    /// thread).
    Ucx {
        /// Heap memory registered by address rather than memory UCX allocates.
        registered: bool,
    },
}

impl Plane {
    /// The plane's name in the bench's rows.
    pub fn name(self) -> &'static str {
        match self {
            Plane::Tcp => "tcp",
            Plane::Ucx { .. } => "ucx",
        }
    }

    /// What the lifecycle line says of the memory its write moves between.
    pub fn memory(self) -> &'static str {
        match self {
            Plane::Tcp => "",
            Plane::Ucx { registered: true } => {
                " between heap memory registered by address, as an engine's tensors (the write a same-host copy on the request's worker)"
            }
            Plane::Ucx { registered: false } => {
                " between memory UCX allocated (the write a job for the UCX thread)"
            }
        }
    }
}

async fn side(
    dir: &Arc<StaticDirectory>,
    role: Role,
    engine: &str,
    plane: Plane,
    block_bytes: usize,
    key: Option<&Key>,
) -> Result<Runtime, String> {
    let rank = RankInfo::single(engine);
    let (region, data): (Arc<Region>, Arc<dyn DataPlane>) = match plane {
        Plane::Ucx { registered: false } => {
            let p = UcxPlane::start(POOL_BLOCKS, block_bytes, &rank).map_err(|e| e.to_string())?;
            (p.region(), Arc::new(p))
        }
        Plane::Ucx { registered: true } => {
            let region = crate::bench::host_region(Region::new(POOL_BLOCKS, block_bytes))?;
            let p = UcxPlane::start_on_region(Arc::new(region), &rank, UcxPlaneOptions::default())
                .map_err(|e| e.to_string())?;
            (p.region(), Arc::new(p))
        }
        Plane::Tcp => {
            let region =
                Arc::new(Region::new(POOL_BLOCKS, block_bytes).map_err(|e| e.to_string())?);
            let p = TcpDataPlane::bind(
                "127.0.0.1:0",
                None,
                region.clone(),
                rank.clone(),
                key.cloned(),
            )
            .await
            .map_err(|e| e.to_string())?;
            (region, Arc::new(p))
        }
    };
    let cfg = NetConfig {
        key: key.cloned(),
        ..NetConfig::default()
    };
    let net = NetTransport::bind(cfg, rank.clone(), role, dir.clone(), data)
        .await
        .map_err(|e| e.to_string())?;
    Runtime::builder(role, rank)
        .mode(TransferMode::Push)
        .transport(TransportChoice::Custom(Arc::new(net)))
        .region(region)
        .start()
        .await
        .map_err(|e| e.to_string())
}

/// What [`measure`] measured.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    /// Each request's latency, µs, sorted.
    pub samples: Vec<f64>,
    /// With `floor`: the round trip of [`WokenEcho`], µs, sorted, one ping just before each
    /// timed request, so the floor and the requests are measured under the same conditions
    /// (this machine's wake-up latency drifts several-fold within seconds).
    pub woken: Vec<f64>,
    /// With `floor`: each request's latency over the round trip timed just before it,
    /// sorted: the ratio paired request by request, so a drift of the machine's wake-up
    /// latency between the two cancels out.
    pub paired: Vec<f64>,
    /// The CPU this process spent, as a share of one core, while the two runtimes sat idle
    /// after the requests (connected, heartbeating) for the window asked; `None` when not
    /// asked or not readable (`/proc/self/task/*/schedstat`).
    pub idle_core_share: Option<f64>,
}

/// Where [`measure`]'s requests are opened and awaited from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// A task of the runtime: the runtime's own path, as a request actor sees its peer's.
    Task,
    /// The calling thread, outside the runtime's workers, as an engine's thread calls: each
    /// request also pays the wake-up of a worker by the calls and of the caller by the end.
    Thread,
}

/// Times `iters` one-block requests (after one warm-up request), opened and awaited from
/// `caller`; the latencies, µs, sorted. With `key`, both sides authenticate every
/// connection with it (Noise sessions). With `floor`, pings a [`WokenEcho`] once before
/// each request ([`Measured::woken`]). With `idle`, then leaves both runtimes idle that
/// long and measures what the process spends.
pub async fn measure(
    plane: Plane,
    block_bytes: usize,
    iters: usize,
    key: Option<&Key>,
    idle: Option<Duration>,
    caller: Caller,
    floor: bool,
) -> Result<Measured, String> {
    let dir = Arc::new(StaticDirectory::new());
    let p = side(
        &dir,
        Role::Prefill,
        "bench-prefill",
        plane,
        block_bytes,
        key,
    )
    .await?;
    let d = side(&dir, Role::Decode, "bench-decode", plane, block_bytes, key).await?;
    let mut echo = match floor {
        true => Some(WokenEcho::start().await?),
        false => None,
    };
    let (p, d, echo, timed) = match caller {
        Caller::Thread => {
            let timed = requests(&p, &d, iters, echo.as_mut()).await;
            (p, d, echo, timed)
        }
        Caller::Task => {
            on_runtime(async move {
                let timed = requests(&p, &d, iters, echo.as_mut()).await;
                (p, d, echo, timed)
            })
            .await?
        }
    };
    if let Some(echo) = echo {
        echo.finish()?;
    }
    let (samples, woken, paired) = timed?;
    let mut idle_core_share = None;
    if let Some(window) = idle {
        // Past the planes' busy-poll windows first.
        tokio::time::sleep(IDLE_SETTLE).await;
        let (cpu0, t0) = (process_cpu(), Instant::now());
        tokio::time::sleep(window).await;
        if let (Some(a), Some(b)) = (cpu0, process_cpu()) {
            let wall = t0.elapsed().as_secs_f64();
            idle_core_share = Some(b.saturating_sub(a).as_secs_f64() / wall.max(f64::MIN_POSITIVE));
        }
    }
    p.shutdown().await;
    d.shutdown().await;
    Ok(Measured {
        samples,
        woken,
        paired,
        idle_core_share,
    })
}

/// `iters` one-block requests from prefill `p` to decode `d`, one after the other, each
/// timed from opening both sides to decode's `Done` (after one untimed): µs, sorted; and,
/// with `echo`, one round trip to it timed just before each timed request, µs, sorted, and
/// each request's latency over its round trip, sorted.
async fn requests(
    p: &Runtime,
    d: &Runtime,
    iters: usize,
    mut echo: Option<&mut WokenEcho>,
) -> Result<(Vec<f64>, Vec<f64>, Vec<f64>), String> {
    let mut samples = Vec::with_capacity(iters);
    let mut woken = Vec::with_capacity(if echo.is_some() { iters } else { 0 });
    let mut paired = Vec::with_capacity(woken.capacity());
    for i in 0..=iters {
        if let (Some(echo), true) = (echo.as_deref_mut(), i > 0) {
            woken.push(echo.ping().await?);
        }
        let id = format!("lat-{i}");
        let block = vec![BlockId(i as u32 % POOL_BLOCKS)];
        let started = Instant::now();
        let spec = ReceiverSpec {
            prefill: EngineId::new("bench-prefill"),
            prefill_dp_rank: None,
            blocks: Some(block.clone()),
        };
        let r = d.receiver(id.as_str(), spec).map_err(|e| e.to_string())?;
        p.sender(id.as_str())
            .map_err(|e| e.to_string())?
            .send(block)
            .map_err(|e| e.to_string())?;
        let end = tokio::time::timeout(REQUEST_DEADLINE, r.completion())
            .await
            .map_err(|_| format!("request {id} took over {REQUEST_DEADLINE:?}"))?;
        if end != State::Done {
            return Err(format!("request {id} ended {end}"));
        }
        if i > 0 {
            let us = started.elapsed().as_secs_f64() * 1e6;
            samples.push(us);
            if let Some(&floor) = woken.last() {
                paired.push(us / f64::max(floor, f64::MIN_POSITIVE));
            }
        }
        // Keep the engines' event queues (and their admission counts) drained.
        let _ = (p.drain_events(), d.drain_events());
    }
    samples.sort_by(f64::total_cmp);
    woken.sort_by(f64::total_cmp);
    paired.sort_by(f64::total_cmp);
    Ok((samples, woken, paired))
}

/// How long the runtimes rest after the requests before their idle CPU is measured.
const IDLE_SETTLE: Duration = Duration::from_millis(200);

/// The CPU time every thread of this process has run so far (Linux: the sum of
/// `/proc/self/task/*/schedstat`, nanoseconds; threads that already exited are not
/// counted, so only differences over a window where none exits mean anything).
fn process_cpu() -> Option<Duration> {
    let mut ns: u64 = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let Ok(task) = task else { continue };
        let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        let ran = text.split_whitespace().next()?.parse::<u64>().ok()?;
        ns = ns.saturating_add(ran);
    }
    Some(Duration::from_nanos(ns))
}

/// Runs `work` on a task of the current runtime and waits for it: what the runtime's own
/// tasks pay, without the wake-ups of a thread outside the runtime (the bench's, an
/// engine's) that calls and awaits.
async fn on_runtime<T: Send + 'static>(
    work: impl std::future::Future<Output = T> + Send + 'static,
) -> Result<T, String> {
    tokio::spawn(work)
        .await
        .map_err(|e| format!("a bench task failed: {e}"))
}

/// Bytes of one loopback ping: the size of a small control frame.
const PING_BYTES: usize = 64;

/// `iters` pings of [`PING_BYTES`] to the echo at `addr`, each timed to its answer, after a
/// tenth as many (at least 10) untimed: the samples in µs, unsorted.
async fn ping(addr: std::net::SocketAddr, iters: usize) -> std::io::Result<Vec<f64>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let mut buf = [1u8; PING_BYTES];
    let warmup = (iters / 10).max(10);
    let mut samples = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        let started = Instant::now();
        s.write_all(&buf).await?;
        s.read_exact(&mut buf).await?;
        if i >= warmup {
            samples.push(started.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(samples)
}

/// The floor under the lifecycle as a request pays it: an echo of small messages over
/// loopback TCP on a thread of its own that sleeps in `read` until each comes, pinged from
/// a task of this runtime, so every round trip wakes a sleeping thread twice, as a
/// request's transfer info and `Done` do between two runtimes (between two tasks of one
/// runtime, [`loopback_rtt`], a round trip may wake no one when both run on one worker:
/// a floor no request can reach).
pub struct WokenEcho {
    stream: tokio::net::TcpStream,
    addr: std::net::SocketAddr,
    thread: std::thread::JoinHandle<std::io::Result<()>>,
}

fn echo_error(e: std::io::Error) -> String {
    format!("loopback ping across threads: {e}")
}

impl WokenEcho {
    /// Starts the echo thread and connects to it.
    pub async fn start() -> Result<Self, String> {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(echo_error)?;
        let addr = listener.local_addr().map_err(echo_error)?;
        let thread = std::thread::Builder::new()
            .name("handoff-bench-echo".into())
            .spawn(move || -> std::io::Result<()> {
                let (mut s, _) = listener.accept()?;
                s.set_nodelay(true)?;
                // The bench's deadline, on the echo's side too.
                s.set_read_timeout(Some(REQUEST_DEADLINE))?;
                let mut buf = [0u8; PING_BYTES];
                loop {
                    match s.read_exact(&mut buf) {
                        Ok(()) => s.write_all(&buf)?,
                        // The client closed: done.
                        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                        Err(e) => return Err(e),
                    }
                }
            })
            .map_err(echo_error)?;
        let connected =
            tokio::time::timeout(REQUEST_DEADLINE, tokio::net::TcpStream::connect(addr)).await;
        let stream = match connected {
            Ok(Ok(stream)) => stream,
            failed => {
                // A poke takes the echo out of `accept` (it reads its end and returns).
                let _ = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1));
                let _ = thread.join();
                return Err(match failed {
                    Ok(Err(e)) => echo_error(e),
                    _ => format!(
                        "loopback ping across threads: no connection within {REQUEST_DEADLINE:?}"
                    ),
                });
            }
        };
        stream.set_nodelay(true).map_err(echo_error)?;
        Ok(Self {
            stream,
            addr,
            thread,
        })
    }

    /// One round trip of a small message (64 B, a control frame's size), µs.
    pub async fn ping(&mut self) -> Result<f64, String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = [1u8; PING_BYTES];
        let started = Instant::now();
        let trip = async {
            self.stream.write_all(&buf).await?;
            self.stream.read_exact(&mut buf).await
        };
        match tokio::time::timeout(REQUEST_DEADLINE, trip).await {
            Ok(Ok(_)) => Ok(started.elapsed().as_secs_f64() * 1e6),
            Ok(Err(e)) => Err(echo_error(e)),
            Err(_) => Err(format!(
                "loopback ping across threads took over {REQUEST_DEADLINE:?}"
            )),
        }
    }

    /// Closes the connection and waits for the echo thread to end.
    pub fn finish(self) -> Result<(), String> {
        let Self {
            stream,
            addr,
            thread,
        } = self;
        drop(stream);
        if !thread.is_finished() {
            // Closed, the echo reads its end; a poke covers an echo still in `accept`.
            let _ = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(100));
        }
        match thread.join() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(echo_error(e)),
            Err(_) => Err("loopback ping across threads: the echo thread panicked".into()),
        }
    }
}

/// [`WokenEcho`]'s round trip, `iters` times after a tenth as many (at least 10) untimed:
/// sorted, in µs.
pub async fn loopback_rtt_across_threads(iters: usize) -> Result<Vec<f64>, String> {
    let mut echo = WokenEcho::start().await?;
    let warmup = (iters / 10).max(10);
    let mut samples = Vec::with_capacity(iters);
    let mut failed = None;
    for i in 0..warmup + iters {
        match echo.ping().await {
            Ok(us) if i >= warmup => samples.push(us),
            Ok(_) => {}
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    let finished = echo.finish();
    if let Some(e) = failed {
        return Err(e);
    }
    finished?;
    samples.sort_by(f64::total_cmp);
    Ok(samples)
}

/// The floor under the lifecycle: the round trip of a small message between two tasks of
/// this runtime over loopback TCP (each request's transfer info and `Done` make one such
/// round trip between the two runtimes), `iters` times after a warm-up, sorted, in µs.
pub async fn loopback_rtt(iters: usize) -> Result<Vec<f64>, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("loopback ping: bind: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("loopback ping: {e}"))?;
    let echo = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        s.set_nodelay(true)?;
        let mut buf = [0u8; PING_BYTES];
        loop {
            s.read_exact(&mut buf).await?;
            s.write_all(&buf).await?;
        }
        #[allow(unreachable_code)]
        Ok::<(), std::io::Error>(())
    });
    let result = tokio::time::timeout(REQUEST_DEADLINE, ping(addr, iters)).await;
    echo.abort();
    let mut samples = result
        .map_err(|_| format!("loopback ping took over {REQUEST_DEADLINE:?}"))?
        .map_err(|e| format!("loopback ping: {e}"))?;
    samples.sort_by(f64::total_cmp);
    Ok(samples)
}
