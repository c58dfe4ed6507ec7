//! One networked runtime for an engine, assembled: the data plane (`auto|ucx|tcp`) over the
//! worker's KV memory, the bootstrap client, the control listener ([`NetTransport`]) and the
//! [`Runtime`] on top.
//!
//! [`start_engine_runtime`] is what every embedder calls: the `handoff worker` command and
//! the Python extension (`python/`). It runs on the caller's tokio runtime and returns once
//! the worker is registered with the bootstrap server (or with a named error: nothing is
//! left running then).

use std::sync::Arc;
use std::time::Duration;

use handoff_gpu::DeviceBuffer;
use handoff_transport::auth::Key;
use handoff_transport::tcp::BusyPoll;
use handoff_transport::{RankInfo, Region, Role, TransferMode};

use super::tcp::TcpDataPlane;
use super::ucx::UcxPlane;
use super::{
    DataPlane, Directory, NetConfig, NetError, NetTransport, HEARTBEATS_MISSED_MAX_DEFAULT,
    HEARTBEAT_INTERVAL_DEFAULT, REGISTER_TIMEOUT_DEFAULT,
};
use handoff_actors::config::TransportChoice;
use handoff_actors::machine::Timeouts;
use handoff_actors::Runtime;
use handoff_bootstrap::exposure;
use handoff_bootstrap::{BootstrapClient, ClientConfig, EtcdDirectory};

/// Shortest heartbeat interval accepted: below it heartbeats cost more than they tell.
pub const HEARTBEAT_INTERVAL_MIN: Duration = Duration::from_millis(10);

/// Longest heartbeat interval accepted: an hour; longer is a mistake (a silent peer would
/// hold its requests' blocks for hours), and bounding it keeps `interval × missed` finite.
pub const HEARTBEAT_INTERVAL_MAX: Duration = Duration::from_secs(3600);

/// Most heartbeats a peer may miss: with the longest interval, still a bounded lease.
pub const HEARTBEATS_MISSED_MAX: u32 = 1000;

/// The fewest heartbeats a peer may miss before it is lost. A writer's lease with a peer
/// runs for the peer's loss timeout from the last heartbeat the peer echoed, and the echo
/// comes a round trip after the beat: with one missed beat allowed the lease would lapse
/// before every next echo, and writes would fail between beats.
pub const HEARTBEATS_MISSED_MIN: u32 = 2;

/// Which data plane moves the blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataTransport {
    /// UCX when libucp loads (`HANDOFF_UCX_LIB`, else the system's) and can serve the
    /// memory, otherwise TCP; the fallback is logged.
    Auto,
    /// UCX only: an error if libucp is missing.
    Ucx,
    /// TCP only: every write checked against its grant on arrival.
    Tcp,
}

/// The KV memory a worker registers.
pub enum WorkerMemory {
    /// `blocks × block_bytes` bytes of zeroed host memory the data plane allocates: mapped by
    /// UCX (so same-host peers reach it through shared memory), heap memory under TCP.
    Pool {
        /// Blocks in the pool.
        blocks: u32,
        /// Bytes per block.
        block_bytes: usize,
    },
    /// The first `blocks × block_bytes` bytes of a CUDA buffer, registered with UCX (TCP
    /// copies through the CPU and refuses it).
    DevicePool {
        /// The buffer.
        buffer: Arc<DeviceBuffer>,
        /// Blocks in the pool.
        blocks: u32,
        /// Bytes per block.
        block_bytes: usize,
    },
    /// Memory the engine allocated and owns (its KV cache), registered as it is.
    Engine(Arc<Region>),
}

impl std::fmt::Debug for WorkerMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerMemory::Pool {
                blocks,
                block_bytes,
            } => write!(f, "Pool({blocks} × {block_bytes} B)"),
            WorkerMemory::DevicePool {
                buffer,
                blocks,
                block_bytes,
            } => write!(
                f,
                "DevicePool(cuda:{}, {blocks} × {block_bytes} B)",
                buffer.ordinal()
            ),
            WorkerMemory::Engine(region) => write!(f, "Engine({region:?})"),
        }
    }
}

/// Everything [`start_engine_runtime`] needs besides the memory.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Prefill or decode.
    pub role: Role,
    /// This worker's engine and ranks.
    pub rank: RankInfo,
    /// Where workers meet: a bootstrap server, `tcp://HOST:PORT`, or an etcd cluster,
    /// `etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]` (ARCHITECTURE, Discovery on etcd).
    pub bootstrap: String,
    /// Where the control port listens (`tcp://HOST:PORT`, port 0 picks one).
    pub control_listen: String,
    /// Where the TCP data port listens (`HOST:PORT`, port 0 picks one).
    pub data_listen: String,
    /// The host peers should dial, when listening on 0.0.0.0.
    pub advertise_host: Option<String>,
    /// The data plane.
    pub transport: DataTransport,
    /// With host memory over UCX, a CUDA device the UCX thread binds, so that it can reach
    /// peers' device memory.
    pub cuda_device: Option<u32>,
    /// The nice value of the data plane's own thread (UCX), so that a busy engine does
    /// not keep it from a core (`handoff_transport::priority`). The tokio runtime's
    /// threads are the caller's: give them one with
    /// `handoff_transport::priority::apply` in `on_thread_start`. Default: none (left as
    /// born).
    pub thread_nice: Option<i32>,
    /// TCP data plane: how long a client waits for the answer to a small operation, and a
    /// server for each next frame, spinning before the thread sleeps
    /// (`handoff_transport::tcp::BusyPoll`). Default: the client spins up to 100 µs for
    /// small operations' answers (one wake-up fewer per one-block transfer), the server
    /// never; nothing spins while idle. `BusyPoll::both` for workers with cores to spare,
    /// `BusyPoll::OFF` to never spin.
    pub tcp_busy_poll: BusyPoll,
    /// Heartbeat interval on peer connections (clamped to [`HEARTBEAT_INTERVAL_MIN`] ..
    /// [`HEARTBEAT_INTERVAL_MAX`]).
    pub heartbeat_interval: Duration,
    /// Heartbeats a peer may miss before it is lost (clamped to [`HEARTBEATS_MISSED_MIN`]
    /// .. [`HEARTBEATS_MISSED_MAX`]).
    pub heartbeats_missed_max: u32,
    /// Time to get registered with the bootstrap server at start.
    pub register_timeout: Duration,
    /// Deadlines of every lifecycle state.
    pub timeouts: Timeouts,
    /// Decode: push or pull. Default: pull, the safe mode where the data plane is
    /// one-sided (UCX): decode's reads land only in its own blocks, which it releases only
    /// once no read of its own is in flight, so no late write from a frozen or partitioned
    /// peer can reach a block the engine got back (ARCHITECTURE, Fences).
    pub mode: TransferMode,
    /// Decode: admission control (see [`handoff_actors::RuntimeBuilder::admission`]).
    pub admission: Option<usize>,
    /// Shared secret: frames are authenticated when set.
    pub key: Option<Key>,
    /// Accept unauthenticated peers on non-loopback addresses (listen, bootstrap,
    /// advertised). Without it, and without `key`, such an address refuses to start
    /// ([`NetError::Exposed`]).
    pub insecure: bool,
    /// Where the runtime records its metrics (default: its own; see
    /// [`handoff_actors::Runtime::metrics`]). Made first and served before the runtime starts, a bind
    /// failure of the endpoint leaves nothing running.
    pub metrics: Option<Arc<handoff_actors::Metrics>>,
}

impl EngineOptions {
    /// The UCX thread's options.
    fn ucx(&self) -> handoff_transport::data::UcxPlaneOptions {
        handoff_transport::data::UcxPlaneOptions {
            cuda_device: self.cuda_device,
            thread_nice: self.thread_nice,
            ..Default::default()
        }
    }

    /// Defaults for everything but who the worker is and where the bootstrap server is:
    /// loopback listeners on any port, `auto` transport, pull, the default deadlines.
    pub fn new(role: Role, rank: RankInfo, bootstrap: impl Into<String>) -> EngineOptions {
        EngineOptions {
            role,
            rank,
            bootstrap: bootstrap.into(),
            control_listen: "tcp://127.0.0.1:0".into(),
            data_listen: "127.0.0.1:0".into(),
            advertise_host: None,
            transport: DataTransport::Auto,
            cuda_device: None,
            thread_nice: None,
            tcp_busy_poll: BusyPoll::default(),
            heartbeat_interval: HEARTBEAT_INTERVAL_DEFAULT,
            heartbeats_missed_max: HEARTBEATS_MISSED_MAX_DEFAULT,
            register_timeout: REGISTER_TIMEOUT_DEFAULT,
            timeouts: Timeouts::default(),
            mode: TransferMode::Pull,
            admission: None,
            key: None,
            insecure: false,
            metrics: None,
        }
    }
}

/// A started networked runtime and what its peers know it by.
pub struct EngineRuntime {
    /// The runtime the engine drives.
    pub runtime: Runtime,
    /// Where peers reach the control port.
    pub control_address: String,
    /// What the data plane registered (a TCP address, or the UCX worker's name).
    pub data_address: String,
    /// The data plane chosen: `"ucx"` or `"tcp"`.
    pub transport: &'static str,
    /// This worker's incarnation (grows with every start).
    pub incarnation: u64,
}

/// Starts one worker's networked runtime over `memory`: picks and starts the data plane,
/// binds the control port, registers with the bootstrap server (within
/// `opts.register_timeout`) and starts the runtime on the current tokio runtime.
///
/// # Errors
/// [`NetError::DataPlane`] (no plane can serve the memory, or it failed to start),
/// [`NetError::Bind`], [`NetError::Register`], [`NetError::Runtime`]; each names what failed.
pub async fn start_engine_runtime(
    mut opts: EngineOptions,
    memory: WorkerMemory,
) -> Result<EngineRuntime, NetError> {
    check_exposure(&opts)?;
    exposure::raise_open_files();
    let control_advertise = advertised_host(&opts, &opts.control_listen)?;
    let data_advertise = advertised_host(&opts, &opts.data_listen)?;
    opts.advertise_host = data_advertise;
    let (region, data, transport) = data_plane(&opts, memory).await?;
    let data_address = data.address();
    let directory = directory(&opts)?;
    let cfg = NetConfig {
        control_listen: opts.control_listen.clone(),
        advertise_host: control_advertise,
        heartbeat_interval: opts
            .heartbeat_interval
            .clamp(HEARTBEAT_INTERVAL_MIN, HEARTBEAT_INTERVAL_MAX),
        heartbeats_missed_max: heartbeats_missed(opts.heartbeats_missed_max),
        register_timeout: opts.register_timeout,
        key: opts.key.clone(),
        ..NetConfig::default()
    };
    let net = NetTransport::bind(cfg, opts.rank.clone(), opts.role, directory, data)
        .await
        .map_err(|e| match e {
            NetError::Register(why) => {
                NetError::Register(format!("at bootstrap server {}: {why}", opts.bootstrap))
            }
            other => other,
        })?;
    let (control_address, incarnation) = (net.control_address().to_string(), net.incarnation());
    let mut builder = Runtime::builder(opts.role, opts.rank.clone());
    if let Some(metrics) = opts.metrics.clone() {
        builder = builder.metrics(metrics);
    }
    let runtime = builder
        .timeouts(opts.timeouts)
        .mode(opts.mode)
        .admission(opts.admission)
        .transport(TransportChoice::Custom(Arc::new(net)))
        .region(region)
        .start()
        .await
        .map_err(NetError::Runtime)?;
    Ok(EngineRuntime {
        runtime,
        control_address,
        data_address,
        transport,
        incarnation,
    })
}

/// Refuses to start on a non-loopback address (listen, bootstrap, advertised) without a
/// secret or `insecure` (see [`handoff_bootstrap::exposure`]).
fn check_exposure(opts: &EngineOptions) -> Result<(), NetError> {
    let advertised = opts.advertise_host.as_deref().map(|h| format!("{h}:0"));
    let members = etcd_members(opts)?;
    let mut addresses = vec![
        ("control listen", opts.control_listen.as_str()),
        ("data listen", opts.data_listen.as_str()),
    ];
    match &members {
        // Without the shared key, an etcd member off loopback is as exposed as a bootstrap
        // server there (plain HTTP); with it, every record is tagged and checked.
        Some(members) => addresses.extend(members.iter().map(|m| ("etcd member", m.as_str()))),
        None => addresses.push(("bootstrap server", opts.bootstrap.as_str())),
    }
    if let Some(host) = &advertised {
        addresses.push(("advertised host", host.as_str()));
    }
    exposure::check_exposure(&addresses, opts.key.is_some(), opts.insecure)?;
    Ok(())
}

/// The members of an `etcd://` bootstrap address (`None` for a bootstrap server).
fn etcd_members(opts: &EngineOptions) -> Result<Option<Vec<String>>, NetError> {
    if !opts.bootstrap.starts_with(handoff_bootstrap::etcd::SCHEME) {
        return Ok(None);
    }
    let address = handoff_bootstrap::etcd::EtcdAddress::parse(&opts.bootstrap)
        .map_err(|e| NetError::Register(e.to_string()))?;
    Ok(Some(address.endpoints))
}

/// The directory the bootstrap address names: an etcd cluster (`etcd://`) or a bootstrap
/// server (`tcp://`).
fn directory(opts: &EngineOptions) -> Result<Arc<dyn Directory>, NetError> {
    if opts.bootstrap.starts_with(handoff_bootstrap::etcd::SCHEME) {
        let etcd = EtcdDirectory::new(&opts.bootstrap, opts.key.clone())
            .map_err(|e| NetError::Register(e.to_string()))?;
        return Ok(Arc::new(etcd));
    }
    Ok(Arc::new(BootstrapClient::new(
        &opts.bootstrap,
        opts.key.clone(),
        ClientConfig::default(),
    )))
}

/// Where the interface that reaches the directory is found: the bootstrap server, or the
/// first etcd member.
fn directory_host(opts: &EngineOptions) -> String {
    match etcd_members(opts) {
        Ok(Some(members)) => members.into_iter().next().unwrap_or_default(),
        _ => opts.bootstrap.clone(),
    }
}

/// The host peers dial for a listener on `listen`: the advertised host if one is given; none
/// (the bound address) for a specific address; for every interface (`0.0.0.0`, `::`), the
/// address of the interface that reaches the bootstrap server, or a named error: never
/// `127.0.0.1` for peers on other hosts.
fn advertised_host(opts: &EngineOptions, listen: &str) -> Result<Option<String>, NetError> {
    if let Some(host) = &opts.advertise_host {
        return Ok(Some(host.clone()));
    }
    if !exposure::is_unspecified(listen) {
        return Ok(None);
    }
    match exposure::route_to(&directory_host(opts)) {
        Some(ip) => {
            tracing::info!(%listen, advertised = %ip, bootstrap = %opts.bootstrap,
                "listening on every interface: advertising the one that reaches the bootstrap server");
            Ok(Some(ip.to_string()))
        }
        None => Err(NetError::NoAdvertisedHost {
            listen: listen.to_string(),
            detail: format!(
                "no interface reaches the bootstrap server {}",
                opts.bootstrap
            ),
        }),
    }
}

fn plane_error(what: &str, e: impl std::fmt::Display) -> NetError {
    NetError::DataPlane(format!("{what}: {e}"))
}

/// The data plane `opts.transport` asks for, with the region it moves blocks of.
async fn data_plane(
    opts: &EngineOptions,
    memory: WorkerMemory,
) -> Result<(Arc<Region>, Arc<dyn DataPlane>, &'static str), NetError> {
    let region = match memory {
        WorkerMemory::DevicePool {
            buffer,
            blocks,
            block_bytes,
        } => {
            if opts.transport == DataTransport::Tcp {
                return Err(NetError::DataPlane(
                    "a KV pool in device memory needs the UCX transport (ucx or auto): TCP copies through the CPU".into(),
                ));
            }
            let device = buffer.ordinal();
            let plane =
                UcxPlane::start_on_device(buffer, blocks, block_bytes, &opts.rank, opts.ucx())
                    .map_err(|e| plane_error("UCX data plane on device memory", e))?;
            tracing::info!(
                version = plane.version(),
                device,
                "data plane: UCX, KV pool in device memory"
            );
            return Ok((plane.region(), Arc::new(plane), "ucx"));
        }
        WorkerMemory::Pool {
            blocks,
            block_bytes,
        } => {
            if opts.transport != DataTransport::Tcp {
                match UcxPlane::start_with(blocks, block_bytes, &opts.rank, opts.ucx()) {
                    Ok(plane) => {
                        tracing::info!(version = plane.version(), "data plane: UCX");
                        return Ok((plane.region(), Arc::new(plane), "ucx"));
                    }
                    Err(e) if opts.transport == DataTransport::Auto && e.is_ucx_unavailable() => {
                        tracing::warn!(error = %e, "UCX unavailable; using the TCP data plane");
                    }
                    Err(e) => return Err(plane_error("UCX data plane", e)),
                }
            }
            let pool = Region::new(blocks, block_bytes).map_err(|e| plane_error("KV pool", e))?;
            // The TCP data server copies into and out of it: huge pages where the kernel
            // has them.
            pool.advise_huge_pages();
            Arc::new(pool)
        }
        WorkerMemory::Engine(region) => {
            // The engine's memory as it is: UCX registers every range by address.
            if opts.transport != DataTransport::Tcp {
                match UcxPlane::start_on_region(region.clone(), &opts.rank, opts.ucx()) {
                    Ok(plane) => {
                        tracing::info!(
                            version = plane.version(),
                            ranges = region.layout().ranges.len(),
                            "data plane: UCX over the engine's KV memory"
                        );
                        return Ok((plane.region(), Arc::new(plane), "ucx"));
                    }
                    Err(e) if opts.transport == DataTransport::Auto && e.is_ucx_unavailable() => {
                        tracing::warn!(error = %e, "UCX unavailable; using the TCP data plane");
                    }
                    Err(e) => return Err(plane_error("UCX data plane", e)),
                }
            }
            region
        }
    };
    if let Err(e) = region.check_host("the TCP data plane") {
        return Err(plane_error(
            "the TCP data plane moves host memory only (device memory needs UCX)",
            e,
        ));
    }
    let data = TcpDataPlane::bind_with(
        &opts.data_listen,
        opts.advertise_host.as_deref(),
        region.clone(),
        opts.rank.clone(),
        opts.key.clone(),
        opts.tcp_busy_poll,
    )
    .await
    .map_err(|e| plane_error("TCP data plane", e))?;
    Ok((region, Arc::new(data), "tcp"))
}

/// The heartbeats a peer may miss, within [`HEARTBEATS_MISSED_MIN`]..=[`HEARTBEATS_MISSED_MAX`]
/// (said in the log when the asked-for count is outside).
fn heartbeats_missed(asked: u32) -> u32 {
    let used = asked.clamp(HEARTBEATS_MISSED_MIN, HEARTBEATS_MISSED_MAX);
    if used != asked {
        tracing::warn!(
            asked,
            used,
            "heartbeats missed before a peer is lost must be in \
             {HEARTBEATS_MISSED_MIN}..={HEARTBEATS_MISSED_MAX} (the writer's lease needs two)"
        );
    }
    used
}
