//! [`UcxDataPlane`]: the runtime's UCX data path, on one dedicated thread.
//!
//! UCX runs in single-thread mode (our handles are `!Send`), so the plane owns one thread
//! that creates the context, the worker and the memory, and executes every transfer; the
//! async [`UcxDataPlane::write`]/[`UcxDataPlane::read`] send it a job through a bounded
//! queue ([`UCX_JOBS_QUEUED_MAX`]) and await its answer.
//!
//! Memory is a set of *ranges* (a KV layout: vLLM's per-layer K and V tensors, SGLang's
//! per-layer buffers, or one contiguous pool), each registered once (`ucp_mem_map`) with
//! its own packed remote key. The engine's memory is registered as it is, by address
//! ([`UcxDataPlane::start_on_region`]: host, or CUDA as `UCS_MEMORY_TYPE_CUDA`, which
//! UCX moves with `cuda_ipc` between processes on one GPU and `cuda_copy` to or from host
//! memory). Without engine memory (`handoff worker`, the bench) the plane asks UCX to
//! allocate each range ([`UcxDataPlane::start`], [`UcxDataPlane::start_allocated`]): on one
//! host the shared-memory transports map that into peers directly, an order of magnitude
//! faster than registered heap memory (which UCX reaches with `cma`). Either way the
//! runtime sees an ordinary [`Region`] ([`UcxDataPlane::region`]) over the very same bytes,
//! so blocks the engine fills are the blocks peers read, without a copy. Memory the plane
//! allocated lives as long as its region (the region keeps the thread alive); memory the
//! engine gave is held by the thread until after its registration is gone.
//!
//! A transfer maps each (block, logical offset, length) of both sides to (range, address,
//! length) segments ([`KvLayout::segments_into`]), pairs them ([`pair_segments`]), merges pieces adjacent on both sides in
//! the same two ranges, and posts them with the range's registration and the peer range's
//! key. A peer's keys are unpacked once per endpoint and range, and dropped with the
//! endpoint.
//!
//! CUDA transports call the driver on the thread that drives UCX, so a plane whose memory
//! is on a device binds that device's primary context to its thread first; a host plane
//! that exchanges with peers' device memory names a device in
//! [`UcxPlaneOptions::cuda_device`] for the same reason.
//!
//! Protection: a write is one-sided RDMA into the peer's memory, so no code of the peer
//! runs per operation and no grant check can. What protects the peer is the remote key's
//! scope (only the ranges it registered), our checks before anything is posted (the peer's
//! layout is well formed, every range's blocks lie inside the length it advertised for
//! that range, every block is inside the layout: a violation is a protocol error naming
//! the peer, and nothing is written), the key's own check when it is unpacked (on shared
//! memory the advertised range, seen through the key, must lie in the segment the key
//! maps: [`Endpoint::unpack_rkey`]), and the control plane's grant (the peer handed out
//! these blocks for this request), as in NIXL and Mooncake Transfer Engine.
//!
//! Fencing the writer: [`UcxDataPlane::write_leased`] posts each put only while the writer's
//! [`Lease`] with the peer holds, checked immediately before each operation, so a writer
//! stopped or cut off past its lease posts nothing more when it resumes.
//!
//! Cancellation: dropping a call's future does not stop a job the thread has started; the
//! job ends by its deadline (the endpoint is force-closed then, cancelling what UCX had in
//! flight). Do not hand the blocks to another request before the call returned or its
//! deadline passed.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use handoff_gpu::{
    bind_device_to_thread, CopyPiece, DeviceBuffer, DeviceContext, DeviceCopier, IpcExport,
    IpcMapping, KvBuffer,
};
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

use super::plan;
use super::DataError;
use crate::layout::{pair_segments, KvLayout, KvMemory, KvRange, LayerSpan, Segment, RANGES_MAX};
use crate::lease::Lease;
use crate::region::{BlockSlice, Region};
use crate::same_host::{self, PeerProcess, Way};
use crate::types::{BlockId, RankInfo, RequestId};
use crate::ucx::{
    ContextOptions, Direction, Endpoint, MemoryRegion, MemoryType, RangeCoalescer, RangeSegment,
    RemoteKey, UcxError, Worker,
};
use crate::wire::limits::{DATA_DESCRIPTOR_BYTES_MAX, REMOTE_KEY_BYTES_MAX};
use crate::wire::messages::LayoutDescriptor;
use crate::wire::{RegionDescriptor, TransportKind};

/// Jobs waiting for or running on the UCX thread at most; a call beyond waits (within its
/// deadline) for a slot. The thread runs one job at a time, so a deep queue only adds
/// latency; 256 covers every request of a busy worker at once.
pub const UCX_JOBS_QUEUED_MAX: usize = 256;

/// Peers (endpoints) the thread keeps connected. A worker talks to the ranks of the
/// engines it pairs with: hundreds at most.
pub const UCX_ENDPOINTS_MAX: usize = 1024;

/// Remote keys the thread keeps unpacked over all peers (one per peer range). A peer
/// beyond it evicts other peers' keys (they are unpacked again when next used). 64 Ki
/// covers 1024 peers of 64 ranges (32 layers × K and V) while bounding UCX's key memory.
pub const UCX_RKEYS_MAX: usize = 64 * 1024;

/// Segments one posting round holds (a transfer of more is posted in rounds of whole
/// blocks): bounds the plan buffer (32 bytes a segment, 2 MiB) however many blocks and
/// ranges a transfer has. Every round is checked before the first is posted.
pub const UCX_SEGMENTS_PER_ROUND: usize = 64 * 1024;

/// How long the thread blocks waiting for a job before it progresses the worker again:
/// an idle target must still progress (wireup of new endpoints, keepalive, TCP lanes).
pub const UCX_IDLE_PROGRESS_INTERVAL: Duration = Duration::from_millis(1);

/// [`UCX_IDLE_PROGRESS_INTERVAL`] for a plane over registered host memory (an engine's
/// CPU tensors): UCX 1.13 emulates peers' RMA into it with active messages this thread
/// must serve, so an idle sleep is the first operation's latency. Only where the worker
/// has no event fd to wait on ([`UCX_WAKE_TIMEOUT`]): polling every 100 µs cost 14% of a
/// core per idle runtime here, taken from the engine's compute.
pub const UCX_IDLE_PROGRESS_INTERVAL_REGISTERED_HOST: Duration = Duration::from_micros(100);

/// A plane over host memory asks UCX for wakeup support: idle, its thread blocks on the
/// worker's event fd (a peer's operation, wireup, a keepalive wakes it) and on the plane's
/// doorbell (a job queued), for at most this long, then progresses anyway (UCX's timers).
/// Idle, it then costs nothing measurable. A device plane, or a UCX that cannot arm its
/// worker, polls on a timer as before.
pub const UCX_WAKE_TIMEOUT: Duration = Duration::from_millis(100);

/// After a job, or after progress that handled something (a peer's operation that needs
/// this side's progress), the thread polls without sleeping this long: back-to-back small
/// transfers then cost no thread wake-up (microseconds each on a busy host).
pub const UCX_BUSY_POLL: Duration = Duration::from_micros(200);

/// Bytes a same-host copy moves on the calling task's thread as it is (about 0.1–0.3 ms);
/// a larger one first hands the thread's other tasks to the runtime
/// (`tokio::task::block_in_place`, on a multi-thread runtime).
pub const SAME_HOST_INLINE_BYTES_MAX: u64 = 1 << 20;

/// Pieces smaller than this on average make a same-host read gather them
/// ([`same_host::read_gathered`]): engines with pages of one token (SGLang) give pieces
/// of a few hundred bytes, which the kernel copies several times faster read in spans.
pub const SAME_HOST_GATHER_PIECE_BYTES: u64 = 16 << 10;

/// How long a caller polls for the thread's answer before it parks: a one-block transfer
/// over shared memory takes a few microseconds, a parked task's wake-up as long again.
pub const UCX_REPLY_SPIN: Duration = Duration::from_micros(50);

/// How long a caller waits past its deadline for the thread's answer before it reports a
/// timeout itself (the thread enforces the deadline; this only covers a stuck thread).
pub const UCX_REPLY_GRACE: Duration = Duration::from_secs(2);

/// Default time for the thread to load UCX and allocate the memory.
pub const UCX_START_TIMEOUT_DEFAULT: Duration = Duration::from_secs(60);

/// How to start a [`UcxDataPlane`].
#[derive(Clone, Debug)]
pub struct UcxPlaneOptions {
    /// UCX context options (shared memory under peer-failure handling and a short
    /// keepalive by default).
    pub context: ContextOptions,
    /// A CUDA device whose primary context the plane's thread makes current before it
    /// starts UCX: for a host plane that reads or writes peers' device memory. A plane on
    /// device memory binds its memory's device whatever this says. Default: none.
    pub cuda_device: Option<u32>,
    /// Time for the thread to start.
    pub start_timeout: Duration,
    /// The nice value the plane's thread takes ([`crate::priority`]); `None` leaves it
    /// as it was born. Default: none.
    pub thread_nice: Option<i32>,
}

impl Default for UcxPlaneOptions {
    fn default() -> Self {
        Self {
            context: ContextOptions::default(),
            cuda_device: None,
            start_timeout: UCX_START_TIMEOUT_DEFAULT,
            thread_nice: None,
        }
    }
}

/// One range of a plane's memory as peers see it: its packed remote key and where its
/// blocks are (block `b` is `bytes` bytes at `addr + b × stride`, inside
/// `[addr, addr + len)`, which is what the key opens).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct UcxRange {
    /// The packed rkey of this range's registration, at most [`REMOTE_KEY_BYTES_MAX`].
    pub remote_key: Vec<u8>,
    /// Address of block 0, in the owner's address space.
    pub addr: u64,
    /// Bytes registered from `addr`.
    pub len: u64,
    /// Bytes from one block to the next.
    pub stride: u64,
    /// Bytes of each block in this range.
    pub bytes: u64,
    /// For device memory, the CUDA IPC descriptor of the allocation holding the range
    /// ([`handoff_gpu::IpcExport::to_bytes`]): a verified peer on this host copies with
    /// it directly ([`UcxPeer::process`]); empty: none.
    pub cuda_ipc: Vec<u8>,
}

/// What a peer needs to reach a plane's memory: carried by the control plane (the worker
/// address in the bootstrap record's data descriptor and `Hello`, the ranges in the layout
/// descriptor, the region in `TransferInfo`/`Ready`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UcxPeer {
    /// The owner's name for errors and logs (`engine/rank`).
    pub name: String,
    /// The owner's UCX worker address, at most [`DATA_DESCRIPTOR_BYTES_MAX`] bytes.
    pub worker_address: Vec<u8>,
    /// The logical region: its blocks (`len / block_bytes`) and logical block size, and,
    /// when `ranges` is empty, its one range (packed rkey, base address, length; stride
    /// and bytes per block both `block_bytes`).
    pub region: RegionDescriptor,
    /// The ranges of a layout of several, in logical order (layer-major: layer 0 K,
    /// layer 0 V, layer 1 K, ...), each with its own key; empty for one range, which
    /// `region` then describes.
    pub ranges: Arc<[UcxRange]>,
    /// The peer's process, verified to be at the other end of our control connection on
    /// this host ([`PeerProcess::verify`]), when its memory is host memory: transfers with
    /// it between host memory on both sides are then same-host copies
    /// ([`crate::same_host`]) instead of UCX operations; when its memory and ours are
    /// device memory and its ranges carry CUDA IPC descriptors, they are device copies
    /// through its allocations mapped here ([`handoff_gpu::ipc`]). `None`: UCX only.
    pub process: Option<Arc<PeerProcess>>,
    /// The CUDA device holding the peer's memory; `None`: host memory (or not said).
    pub device: Option<u32>,
}

impl UcxPeer {
    /// A peer of one range, described by `region` (today's single-region descriptor).
    pub fn one_range(name: String, worker_address: Vec<u8>, region: RegionDescriptor) -> Self {
        Self {
            name,
            worker_address,
            region,
            ranges: Arc::from(Vec::new()),
            process: None,
            device: None,
        }
    }

    /// The peer a layout descriptor describes (from its `Hello`/`HelloAck`), reached at
    /// `worker_address`: one range per descriptor range, each with its remote key. Nothing
    /// is trusted here; the plane checks the ranges before it uses them.
    pub fn from_layout(name: String, worker_address: Vec<u8>, layout: &LayoutDescriptor) -> Self {
        let block_bytes = layout
            .ranges
            .iter()
            .fold(0u64, |sum, r| sum.saturating_add(r.bytes));
        let ranges: Vec<UcxRange> = layout
            .ranges
            .iter()
            .map(|r| UcxRange {
                remote_key: r.remote_key.clone(),
                addr: r.addr,
                len: r.len,
                stride: r.stride,
                bytes: r.bytes,
                cuda_ipc: r.cuda_ipc.clone(),
            })
            .collect();
        Self {
            name,
            worker_address,
            region: RegionDescriptor {
                transport: layout.transport,
                address: layout.address.clone(),
                remote_key: Vec::new(),
                base: 0,
                len: u64::from(layout.blocks).saturating_mul(block_bytes),
                block_bytes,
            },
            ranges: ranges.into(),
            process: None,
            device: layout.cuda_device,
        }
    }

    /// The same peer, reached by same-host copies through `process` (see
    /// [`UcxPeer::process`]).
    pub fn with_process(mut self, process: Option<Arc<PeerProcess>>) -> Self {
        self.process = process;
        self
    }

    /// The peer's ranges (one, from `region`, when `ranges` is empty).
    pub fn range_list(&self) -> Vec<UcxRange> {
        if self.ranges.is_empty() {
            vec![UcxRange {
                remote_key: self.region.remote_key.clone(),
                addr: self.region.base,
                len: self.region.len,
                stride: self.region.block_bytes,
                bytes: self.region.block_bytes,
                cuda_ipc: Vec::new(),
            }]
        } else {
            self.ranges.to_vec()
        }
    }

    /// Blocks in the peer's layout (`region.len / region.block_bytes`).
    fn blocks(&self) -> Result<u32, String> {
        if self.region.block_bytes == 0 {
            return Err("zero block size".into());
        }
        u32::try_from(self.region.len / self.region.block_bytes)
            .map_err(|_| format!("{} blocks", self.region.len / self.region.block_bytes))
    }
}

/// One transfer for the thread.
struct Job {
    direction: Direction,
    request: RequestId,
    peer: UcxPeer,
    local: Vec<BlockId>,
    remote: Vec<BlockId>,
    /// The slices of every block moved (none: whole blocks).
    slices: Vec<BlockSlice>,
    deadline: Instant,
    /// A writer's lease with the peer, checked before every post (`None`: unfenced).
    lease: Option<Arc<Lease>>,
    reply: oneshot::Sender<Result<(), DataError>>,
    /// The job's queue slot, released when the thread is done with it.
    _slot: OwnedSemaphorePermit,
}

enum Cmd {
    Transfer(Box<Job>),
    Stop,
}

/// The thread's handle; dropping the last one stops the thread, which then unmaps the memory.
struct PlaneThread {
    tx: mpsc::Sender<Cmd>,
    /// Rung after every command, to wake the thread blocked on its worker's event fd.
    bell: Arc<Doorbell>,
    slots: Arc<Semaphore>,
    /// Disconnects when the thread has torn UCX down (its sender is the thread's last
    /// value to drop).
    done: Mutex<mpsc::Receiver<()>>,
    id: std::thread::ThreadId,
    /// Transfers the thread's CUDA IPC lane carried.
    ipc_transfers: Arc<AtomicU64>,
}

/// How long dropping a plane waits for its thread to tear UCX down (endpoints closed,
/// memory deregistered, worker and context destroyed) before it gives up on it.
const STOP_WAIT: Duration = Duration::from_secs(10);

impl Drop for PlaneThread {
    /// Stops the thread and waits (at most [`STOP_WAIT`]) for UCX to be torn down: a
    /// process that exits while the thread still tears down races UCX's and CUDA's exit
    /// handlers (seen on a GPU: heap corruption at a peer's exit, `malloc_consolidate`).
    fn drop(&mut self) {
        let _ = self.tx.send(Cmd::Stop);
        self.bell.ring();
        if std::thread::current().id() == self.id {
            return;
        }
        let done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(mpsc::RecvTimeoutError::Timeout) = done.recv_timeout(STOP_WAIT) {
            tracing::warn!(wait = ?STOP_WAIT, "UCX thread still tearing down; not waiting longer");
        }
    }
}

/// One range the thread registers.
#[derive(Clone, Copy, Debug)]
struct RangeSpec {
    /// Where the engine's range is (ignored when allocating).
    addr: u64,
    /// Bytes to register (or allocate) from `addr`.
    len: usize,
    /// Bytes from one block to the next (allocations: `bytes`).
    stride: u64,
    /// Bytes per block.
    bytes: u64,
}

/// The memory a plane's thread registers.
enum Memory {
    /// Host memory UCX allocates, one allocation per range (`addr` ignored).
    Allocate(Vec<RangeSpec>),
    /// Memory someone else owns (an engine's KV cache, a device buffer), registered by
    /// address as `mem_type`; `keep` holds it and is dropped only after the registrations.
    Register {
        ranges: Vec<RangeSpec>,
        mem_type: MemoryType,
        keep: Box<dyn Send>,
    },
}

/// What the thread reports once it is up.
struct Ready {
    /// The ranges as registered, with their keys.
    ranges: Vec<UcxRange>,
    worker_address: Vec<u8>,
    version: String,
}

/// The UCX data path of one worker: its memory (UCX-allocated, or the engine's
/// registered by address), seen by the runtime as [`UcxDataPlane::region`], and the
/// transfers of blocks between it and peers' planes.
///
/// Made once per worker by the runtime's network link; its [`UcxDataPlane::descriptor`]
/// goes to peers over the control plane; then [`UcxDataPlane::write`] (push) and
/// [`UcxDataPlane::read`] (pull), from any task.
pub struct UcxDataPlane {
    thread: Arc<PlaneThread>,
    region: Arc<Region>,
    me: UcxPeer,
    version: String,
}

impl std::fmt::Debug for UcxDataPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxDataPlane")
            .field("name", &self.me.name)
            .field("region", &self.region)
            .field("ranges", &self.me.ranges.len().max(1))
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl DataError {
    /// Whether this error says UCX cannot be used on this machine at all (library missing,
    /// too old, unsupported): `--transport auto` then falls back to TCP.
    pub fn is_ucx_unavailable(&self) -> bool {
        matches!(
            self,
            DataError::Ucx(
                UcxError::LibraryNotFound { .. }
                    | UcxError::SymbolMissing { .. }
                    | UcxError::VersionTooOld { .. }
                    | UcxError::VersionUnsupported { .. }
            )
        )
    }
}

impl UcxDataPlane {
    /// Starts the UCX thread (loading libucp from `HANDOFF_UCX_LIB` or the system loader),
    /// which allocates one range of `blocks × block_bytes` bytes of zeroed memory. `me`
    /// names this worker in its descriptor.
    pub fn start(
        blocks: u32,
        block_bytes: usize,
        me: &RankInfo,
        options: UcxPlaneOptions,
    ) -> Result<UcxDataPlane, DataError> {
        Self::start_allocated(blocks, &[block_bytes], me, options)
    }

    /// Starts the UCX thread, which allocates one range per entry of `range_bytes`
    /// (`blocks` blocks of that many bytes each, zeroed): a KV layout without an engine
    /// (benchmarks, tests), e.g. 2 × layers ranges for vLLM's per-layer K and V tensors.
    /// The logical block is the concatenation of a block's bytes in every range.
    pub fn start_allocated(
        blocks: u32,
        range_bytes: &[usize],
        me: &RankInfo,
        options: UcxPlaneOptions,
    ) -> Result<UcxDataPlane, DataError> {
        if range_bytes.is_empty() || range_bytes.len() > RANGES_MAX {
            return Err(DataError::TooLarge {
                what: "ranges in one layout",
                count: range_bytes.len(),
                max: RANGES_MAX,
            });
        }
        let mut total = 0usize;
        let mut ranges = Vec::with_capacity(range_bytes.len());
        for &bytes in range_bytes {
            // Check the shape with the region's own rules before starting anything.
            let len = checked_len(blocks, bytes)?;
            total = total
                .checked_add(len)
                .filter(|&t| t <= crate::region::REGION_BYTES_MAX)
                .ok_or(crate::region::RegionError::BadSize {
                    blocks,
                    block_bytes: bytes,
                })?;
            ranges.push(RangeSpec {
                addr: 0,
                len,
                stride: bytes as u64,
                bytes: bytes as u64,
            });
        }
        let launched = Self::launch(Memory::Allocate(ranges), blocks, None, me, options)?;
        let (thread, ready) = launched;
        let keeper: Box<dyn Send + Sync> = Box::new(Arc::clone(&thread));
        let region = host_region(blocks, &ready.ranges, keeper)?;
        Ok(Self::assemble(thread, ready, Arc::new(region), me))
    }

    /// Starts the UCX thread over the first `blocks × block_bytes` bytes of a CUDA
    /// allocation (an engine's KV cache, or one made for a test or benchmark), registered
    /// as CUDA memory; the thread binds the buffer's device first. The plane keeps the
    /// buffer alive until its registration is gone.
    ///
    /// Needs a UCX built with CUDA (e.g. the `libucx-cu12` wheel's, through
    /// `HANDOFF_UCX_LIB`); another UCX refuses the registration with a named error.
    pub fn start_on_device(
        buffer: Arc<DeviceBuffer>,
        blocks: u32,
        block_bytes: usize,
        me: &RankInfo,
        options: UcxPlaneOptions,
    ) -> Result<UcxDataPlane, DataError> {
        let len = checked_len(blocks, block_bytes)?;
        if len > buffer.len() {
            return Err(DataError::Region(
                crate::region::RegionError::DeviceTooSmall {
                    blocks,
                    block_bytes,
                    buffer_len: buffer.len(),
                },
            ));
        }
        let memory = Memory::Register {
            ranges: vec![RangeSpec {
                addr: buffer.addr(),
                len,
                stride: block_bytes as u64,
                bytes: block_bytes as u64,
            }],
            mem_type: MemoryType::Cuda,
            keep: Box::new(Arc::clone(&buffer)),
        };
        let device = Some(buffer.ordinal());
        let (thread, ready) = Self::launch(memory, blocks, device, me, options)?;
        let keeper: Box<dyn Send + Sync> = Box::new(Arc::clone(&thread));
        let region = Region::on_device_kept(buffer, blocks, block_bytes, Some(keeper))?;
        Ok(Self::assemble(thread, ready, Arc::new(region), me))
    }

    /// Starts the UCX thread over an engine's memory as it is: every range of `region`'s
    /// layout (host, or CUDA on its device) is registered by address, once, with its own
    /// remote key. Nothing is copied or allocated; the thread holds `region` until its
    /// registrations are gone. [`UcxDataPlane::region`] is `region` itself.
    pub fn start_on_region(
        region: Arc<Region>,
        me: &RankInfo,
        options: UcxPlaneOptions,
    ) -> Result<UcxDataPlane, DataError> {
        let (ranges, mem_type, device) = region_ranges(&region)?;
        let memory = Memory::Register {
            ranges,
            mem_type,
            keep: Box::new(Arc::clone(&region)),
        };
        let (thread, ready) = Self::launch(memory, region.blocks(), device, me, options)?;
        Ok(Self::assemble(thread, ready, region, me))
    }

    fn launch(
        memory: Memory,
        blocks: u32,
        device: Option<u32>,
        me: &RankInfo,
        options: UcxPlaneOptions,
    ) -> Result<(Arc<PlaneThread>, Ready), DataError> {
        let cuda_device = device.or(options.cuda_device);
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let (tx, rx) = mpsc::channel();
        let (done_tx, done) = mpsc::channel::<()>();
        let context = options.context.clone();
        let thread_nice = options.thread_nice;
        let bell = Arc::new(Doorbell::new());
        let thread_bell = Arc::clone(&bell);
        let ipc_transfers = Arc::new(AtomicU64::new(0));
        let thread_ipc = Arc::clone(&ipc_transfers);
        let name = format!("handoff-ucx-{me}");
        let spawned = std::thread::Builder::new()
            .name(name.chars().take(15).collect())
            .spawn(move || {
                crate::priority::apply(thread_nice, "ucx");
                let setup = Setup {
                    memory,
                    ipc_transfers: thread_ipc,
                    blocks,
                    cuda_device,
                    options: context,
                    bell: thread_bell,
                };
                thread_main(setup, ready_tx, rx);
                drop(done_tx);
            });
        let id = match spawned {
            Ok(handle) => handle.thread().id(),
            Err(e) => {
                return Err(DataError::PlaneStopped {
                    detail: format!("cannot spawn the UCX thread: {e}"),
                })
            }
        };
        let thread = Arc::new(PlaneThread {
            tx,
            bell,
            slots: Arc::new(Semaphore::new(UCX_JOBS_QUEUED_MAX)),
            done: Mutex::new(done),
            id,
            ipc_transfers,
        });
        let ready = match ready_rx.recv_timeout(options.start_timeout) {
            Ok(result) => result?,
            Err(_) => {
                return Err(DataError::PlaneStopped {
                    detail: format!("UCX thread not ready within {:?}", options.start_timeout),
                })
            }
        };
        Ok((thread, ready))
    }

    fn assemble(
        thread: Arc<PlaneThread>,
        ready: Ready,
        region: Arc<Region>,
        me: &RankInfo,
    ) -> UcxDataPlane {
        let name = me.to_string();
        let blocks = u64::from(region.blocks());
        let block_bytes = region.block_bytes() as u64;
        let (remote_key, base, len, ranges) = match ready.ranges.as_slice() {
            // One range: the region describes it; the list holds it too when it carries
            // what a region cannot (a CUDA IPC descriptor).
            [one] if one.stride == one.bytes && one.bytes == block_bytes => (
                one.remote_key.clone(),
                one.addr,
                blocks * block_bytes,
                if one.cuda_ipc.is_empty() {
                    Arc::from(Vec::new())
                } else {
                    Arc::from(ready.ranges.clone())
                },
            ),
            // Several ranges: the region is logical (blocks × logical block bytes from 0);
            // the keys and addresses are the ranges'.
            _ => (Vec::new(), 0, blocks * block_bytes, Arc::from(ready.ranges)),
        };
        let me = UcxPeer {
            name: name.clone(),
            worker_address: ready.worker_address,
            region: RegionDescriptor {
                transport: TransportKind::Ucx,
                address: name,
                remote_key,
                base,
                len,
                block_bytes,
            },
            ranges,
            process: None,
            device: match region.layout().memory {
                KvMemory::Host => None,
                KvMemory::Cuda { device } => Some(device),
            },
        };
        tracing::debug!(name = %me.name, version = %ready.version, ranges = me.ranges.len().max(1), "UCX data plane started");
        UcxDataPlane {
            thread,
            region,
            me,
            version: ready.version,
        }
    }

    /// The plane's memory as a block region: give it to the runtime as its KV pool.
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// What peers need to reach this plane's memory.
    pub fn descriptor(&self) -> &UcxPeer {
        &self.me
    }

    /// This plane's memory as peers are told it ([`LayoutDescriptor`], in `Hello` and
    /// `HelloAck`): the region's layout (ranges, layers, per-token facts) with each range's
    /// remote key and registered length.
    pub fn layout_descriptor(&self) -> LayoutDescriptor {
        let mut layout = LayoutDescriptor::of(
            TransportKind::Ucx,
            self.me.name.clone(),
            self.region.layout(),
        );
        for (range, ours) in layout.ranges.iter_mut().zip(self.me.range_list()) {
            range.remote_key = ours.remote_key;
            range.len = ours.len;
            range.cuda_ipc = ours.cuda_ipc;
        }
        layout
    }

    /// Transfers carried by device copies through same-host peers' CUDA IPC mappings
    /// rather than by UCX (see [`UcxPeer::process`]), since the plane started.
    pub fn cuda_ipc_transfers(&self) -> u64 {
        self.thread.ipc_transfers.load(Ordering::Relaxed)
    }

    /// The loaded UCX version and library path.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Push: writes our `src` blocks into `peer`'s `dst` blocks (`src[i]` → `dst[i]`)
    /// before `deadline`, then flushes (the bytes are in the peer's memory on `Ok`).
    pub async fn write(
        &self,
        request: &RequestId,
        peer: &UcxPeer,
        src: &[BlockId],
        dst: &[BlockId],
        deadline: Instant,
    ) -> Result<(), DataError> {
        self.submit(Direction::Put, request, peer, src, dst, &[], deadline, None)
            .await
    }
    /// [`UcxDataPlane::write`] of some slices of every block (none: whole blocks of equal
    /// size on both sides), for ranks that hold different parts of a block (pipeline
    /// stages' layers, TP ranks' heads): every slice of every block in one call.
    pub async fn write_slices(
        &self,
        request: &RequestId,
        peer: &UcxPeer,
        src: &[BlockId],
        dst: &[BlockId],
        slices: &[BlockSlice],
        deadline: Instant,
    ) -> Result<(), DataError> {
        self.submit(
            Direction::Put,
            request,
            peer,
            src,
            dst,
            slices,
            deadline,
            None,
        )
        .await
    }

    /// [`UcxDataPlane::write_slices`] fenced by the writer's [`Lease`] with the peer: the
    /// lease is checked before the job starts and immediately before every operation is
    /// posted; once it has ended nothing more is posted and the call fails
    /// [`UcxError::LeaseExpired`] naming the peer and the lease. A writer frozen or cut off
    /// past its lease therefore cannot land a write in blocks the peer has given back since.
    /// A write whose every operation was posted in time but whose completion is seen only
    /// after the lease ended (the writer stopped between its last post and its answer) fails
    /// too, [`DataError::ConfirmedLate`]: the peer may have taken us for lost and failed the
    /// request by then, so we do not call it done.
    #[allow(clippy::too_many_arguments)]
    pub async fn write_leased(
        &self,
        request: &RequestId,
        peer: &UcxPeer,
        src: &[BlockId],
        dst: &[BlockId],
        slices: &[BlockSlice],
        deadline: Instant,
        lease: Arc<Lease>,
    ) -> Result<(), DataError> {
        let result = self
            .submit(
                Direction::Put,
                request,
                peer,
                src,
                dst,
                slices,
                deadline,
                Some(Arc::clone(&lease)),
            )
            .await;
        lease.confirm(result, &peer.name, Instant::now())
    }

    /// Pull: reads `peer`'s `src` blocks into our `dst` blocks (`src[i]` → `dst[i]`)
    /// before `deadline`.
    pub async fn read(
        &self,
        request: &RequestId,
        peer: &UcxPeer,
        src: &[BlockId],
        dst: &[BlockId],
        deadline: Instant,
    ) -> Result<(), DataError> {
        self.submit(Direction::Get, request, peer, dst, src, &[], deadline, None)
            .await
    }

    /// [`UcxDataPlane::read`] of some slices of every block (none: whole blocks), in one
    /// call.
    pub async fn read_slices(
        &self,
        request: &RequestId,
        peer: &UcxPeer,
        src: &[BlockId],
        dst: &[BlockId],
        slices: &[BlockSlice],
        deadline: Instant,
    ) -> Result<(), DataError> {
        self.submit(
            Direction::Get,
            request,
            peer,
            dst,
            src,
            slices,
            deadline,
            None,
        )
        .await
    }

    // One private funnel for the four public calls: its arguments are theirs.
    #[allow(clippy::too_many_arguments)]
    async fn submit(
        &self,
        direction: Direction,
        request: &RequestId,
        peer: &UcxPeer,
        local: &[BlockId],
        remote: &[BlockId],
        slices: &[BlockSlice],
        deadline: Instant,
        lease: Option<Arc<Lease>>,
    ) -> Result<(), DataError> {
        let started = Instant::now();
        plan::check_lists(local, remote)?;
        if direction == Direction::Get {
            // Reads land in our blocks, a copy's lanes at once.
            plan::check_destinations(local)?;
        }
        self.region.check_blocks(local)?;
        let at = check_peer(peer, remote, self.region.block_bytes(), slices, direction)?;
        if local.is_empty() {
            return Ok(());
        }
        if let Some(process) = peer.process.as_ref().filter(|_| {
            self.region.memory_kind() == handoff_gpu::MemoryKind::Host && peer.device.is_none()
        }) {
            // Same-host copies run here, on the caller's thread: no hop to the UCX thread
            // and back (each a thread wake-up, milliseconds on a host whose cores an
            // engine loop keeps busy). A large one lets the runtime move this worker's
            // other tasks elsewhere first.
            let run = || {
                copy_same_host(
                    self.region.layout(),
                    peer,
                    process,
                    direction,
                    local,
                    remote,
                    &at,
                    deadline,
                    lease.as_deref(),
                )
            };
            let per_block: u64 = at.iter().map(|a| a.len as u64).sum();
            let bytes = (local.len() as u64).saturating_mul(per_block);
            let multi_thread = same_host::may_block_in_place();
            let copied = if bytes > SAME_HOST_INLINE_BYTES_MAX && multi_thread {
                tokio::task::block_in_place(run)
            } else {
                run()
            };
            return copied.map(|pieces| {
                let took_us = started.elapsed().as_micros() as u64;
                tracing::debug!(%request, peer = %peer.name, bytes, pieces, took_us, "same-host copy");
            });
        }
        let timed_out = |op: &'static str| DataError::Timeout {
            peer: peer.name.clone(),
            op,
            after: started.elapsed(),
        };
        let until = tokio::time::Instant::from_std(deadline);
        let slot = tokio::time::timeout_at(until, Arc::clone(&self.thread.slots).acquire_owned())
            .await
            .map_err(|_| timed_out("waiting for the UCX thread"))?
            .map_err(|_| DataError::PlaneStopped {
                detail: "queue closed".into(),
            })?;
        let (reply, answer) = oneshot::channel();
        let job = Job {
            direction,
            request: request.clone(),
            peer: peer.clone(),
            local: local.to_vec(),
            remote: remote.to_vec(),
            slices: slices.to_vec(),
            deadline,
            lease,
            reply,
            _slot: slot,
        };
        self.thread
            .tx
            .send(Cmd::Transfer(Box::new(job)))
            .map_err(|_| DataError::PlaneStopped {
                detail: "the UCX thread has exited".into(),
            })?;
        self.thread.bell.ring();
        // A small transfer answers within microseconds: poll for it (yielding to other
        // tasks) before parking, which would add a thread wake-up to its latency.
        let mut answer = answer;
        let spin_until = Instant::now() + UCX_REPLY_SPIN;
        while Instant::now() < spin_until {
            match answer.try_recv() {
                Ok(result) => return result,
                Err(oneshot::error::TryRecvError::Empty) => tokio::task::yield_now().await,
                Err(oneshot::error::TryRecvError::Closed) => break,
            }
        }
        match tokio::time::timeout_at(until + UCX_REPLY_GRACE, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(DataError::PlaneStopped {
                detail: "the UCX thread dropped the job (panicked?)".into(),
            }),
            Err(_) => Err(timed_out("waiting for the UCX thread's answer")),
        }
    }
}

fn checked_len(blocks: u32, block_bytes: usize) -> Result<usize, crate::region::RegionError> {
    (blocks as usize)
        .checked_mul(block_bytes)
        .filter(|&t| t > 0 && t <= crate::region::REGION_BYTES_MAX)
        .ok_or(crate::region::RegionError::BadSize {
            blocks,
            block_bytes,
        })
}

/// The ranges of an engine's region to register (each from its first block's start to
/// its last block's end), their memory type, and the device to bind for CUDA memory.
fn region_ranges(region: &Region) -> Result<(Vec<RangeSpec>, MemoryType, Option<u32>), DataError> {
    let layout = region.layout();
    let mut specs = Vec::with_capacity(layout.ranges.len());
    for (i, r) in layout.ranges.iter().enumerate() {
        let len = r
            .extent(layout.blocks)
            .and_then(|e| usize::try_from(e).ok())
            .ok_or_else(|| DataError::Unsupported {
                what: format!("range {i} of the region does not fit this address space"),
            })?;
        specs.push(RangeSpec {
            addr: r.addr,
            len,
            stride: r.stride as u64,
            bytes: r.bytes as u64,
        });
    }
    let (mem_type, device) = match layout.memory {
        KvMemory::Host => (MemoryType::Host, None),
        KvMemory::Cuda { device } => (MemoryType::Cuda, Some(device)),
    };
    Ok((specs, mem_type, device))
}

/// The host region over the ranges UCX allocated for us; `keeper` keeps them mapped.
fn host_region(
    blocks: u32,
    ranges: &[UcxRange],
    keeper: Box<dyn Send + Sync>,
) -> Result<Region, DataError> {
    let layout = KvLayout {
        blocks,
        ranges: ranges
            .iter()
            .map(|r| KvRange {
                addr: r.addr,
                // Allocated here from `usize` lengths: they fit.
                stride: r.stride as usize,
                bytes: r.bytes as usize,
            })
            .collect(),
        memory: KvMemory::Host,
        layers: LayerSpan::WHOLE,
        block_tokens: 0,
        dtype_bytes: 0,
        heads: None,
    };
    // SAFETY: the thread mapped every range's `blocks × bytes` bytes of host memory (one
    // UCX allocation each, so no two overlap) and unmaps them only after `Stop`, which is
    // sent when the last `PlaneThread` handle drops, and `keeper` is one; nothing else
    // holds Rust references to them.
    Ok(unsafe { Region::from_layout(layout, keeper) }?)
}

/// The cheap checks of a call before it is queued: the peer's descriptor is UCX, its
/// worker address and range count are bounded, the blocks lie in its layout, and the slice
/// fits both sides' logical blocks. The thread checks the ranges themselves (once per peer
/// layout, when it unpacks their keys) and every segment again before posting.
fn check_peer(
    peer: &UcxPeer,
    remote: &[BlockId],
    block_bytes: usize,
    slices: &[BlockSlice],
    direction: Direction,
) -> Result<Vec<plan::Sliced>, DataError> {
    let protocol = |detail: String| DataError::Protocol {
        peer: peer.name.clone(),
        detail,
    };
    if peer.region.transport != TransportKind::Ucx {
        return Err(protocol(format!(
            "region descriptor for {:?}, not UCX",
            peer.region.transport
        )));
    }
    if peer.worker_address.is_empty() || peer.worker_address.len() > DATA_DESCRIPTOR_BYTES_MAX {
        return Err(protocol(format!(
            "worker address of {} bytes",
            peer.worker_address.len()
        )));
    }
    if peer.ranges.len() > RANGES_MAX {
        return Err(protocol(format!(
            "layout of {} ranges (at most {RANGES_MAX})",
            peer.ranges.len()
        )));
    }
    let bad_key = |len: usize| len == 0 || len > REMOTE_KEY_BYTES_MAX;
    if peer.ranges.is_empty() && bad_key(peer.region.remote_key.len()) {
        return Err(protocol(format!(
            "remote key of {} bytes",
            peer.region.remote_key.len()
        )));
    }
    if let Some((i, r)) = peer
        .ranges
        .iter()
        .enumerate()
        .find(|(_, r)| bad_key(r.remote_key.len()))
    {
        return Err(protocol(format!(
            "range {i}: remote key of {} bytes",
            r.remote_key.len()
        )));
    }
    let at = plan::Sliced::all(
        slices,
        direction == Direction::Put,
        block_bytes,
        peer.region.block_bytes,
        &peer.name,
    )?;
    peer.region
        .check_blocks(remote)
        .map_err(|e| protocol(e.to_string()))?;
    Ok(at)
}

// ---------------------------------------------------------------------- the thread

/// What the thread is started with.
struct Setup {
    memory: Memory,
    /// Counts the transfers the CUDA IPC lane carries.
    ipc_transfers: Arc<AtomicU64>,
    /// Blocks in every range.
    blocks: u32,
    /// The device whose context the thread binds before starting UCX.
    cuda_device: Option<u32>,
    options: ContextOptions,
    bell: Arc<Doorbell>,
}

/// A peer's ranges as the thread uses them: the layout checked, and one key per range,
/// unpacked on the peer's endpoint.
struct PeerKeys {
    /// What the keys were unpacked from (a peer whose layout changes gets new keys).
    region: RegionDescriptor,
    ranges: Arc<[UcxRange]>,
    /// The peer's layout, checked ([`peer_layout`]).
    layout: KvLayout,
    /// One per range, in order. Dropped before the endpoint (field order in `PeerConn`).
    rkeys: Vec<RemoteKey>,
}

/// A same-host peer's device ranges as this thread reaches them through CUDA IPC.
enum IpcPeer {
    /// Mapped for these ranges: every piece lies inside one window.
    Open {
        ranges: Arc<[UcxRange]>,
        /// The peer's layout, checked ([`peer_layout`]).
        layout: KvLayout,
        windows: Vec<IpcWindow>,
    },
    /// A handle did not open here (not this host's, its exporter gone, or already mapped
    /// by UCX): UCX carries the peer, which vets its keys as for any peer.
    Unusable { ranges: Arc<[UcxRange]> },
    /// The descriptor lies (a range outside the allocation its handle opens): every
    /// transfer with these ranges fails by name, before a byte moves.
    Refused {
        ranges: Arc<[UcxRange]>,
        error: DataError,
    },
}

impl IpcPeer {
    fn ranges(&self) -> &Arc<[UcxRange]> {
        match self {
            IpcPeer::Open { ranges, .. }
            | IpcPeer::Unusable { ranges }
            | IpcPeer::Refused { ranges, .. } => ranges,
        }
    }
}

/// One of the peer's allocations as mapped here: peer addresses `[start, start + len)`
/// are `mapping.base()..` here, `len` being what the driver mapped.
struct IpcWindow {
    start: u64,
    mapping: Arc<IpcMapping>,
}

impl IpcWindow {
    /// Where `[addr, addr + len)` of the peer is here, if it lies in this window.
    fn at(&self, addr: u64, len: u64) -> Option<u64> {
        self.mapping.at(addr.checked_sub(self.start)?, len)
    }
}

/// How often the UCX thread closes the CUDA IPC mappings of peers that have exited.
pub const IPC_SWEEP_INTERVAL: Duration = Duration::from_secs(1);

/// Bytes one round of the CUDA IPC lane copies at most: the deadline, the writer's lease
/// and the peer's life are checked between rounds, and a round is waited for before the
/// next, so this bounds what lands after a check (well under a millisecond on one GPU).
pub const IPC_BYTES_PER_ROUND: u64 = 64 << 20;

/// Opens a same-host peer's device ranges ([`UcxRange::cuda_ipc`]) in our context on
/// `device`: one mapping per distinct handle, and every range checked to lie inside the
/// allocation its handle opened (the bound the driver gives, not the peer's word).
fn open_ipc(peer: &UcxPeer, ranges: &Arc<[UcxRange]>, device: u32) -> IpcPeer {
    let protocol = |detail: String| DataError::Protocol {
        peer: peer.name.clone(),
        detail,
    };
    let layout = match peer_layout(peer, ranges) {
        Ok(layout) => layout,
        Err(error) => {
            return IpcPeer::Refused {
                ranges: Arc::clone(ranges),
                error,
            }
        }
    };
    let mut opened: Vec<([u8; handoff_gpu::IPC_HANDLE_BYTES], Arc<IpcMapping>)> = Vec::new();
    let mut windows: Vec<IpcWindow> = Vec::new();
    for (i, r) in ranges.iter().enumerate() {
        let Some((handle, start)) = IpcExport::parse(&r.cuda_ipc) else {
            return IpcPeer::Refused {
                ranges: Arc::clone(ranges),
                error: protocol(format!(
                    "range {i}: CUDA IPC descriptor of {} bytes",
                    r.cuda_ipc.len()
                )),
            };
        };
        let mapping = match opened.iter().find(|(h, _)| *h == handle) {
            Some((_, m)) => Arc::clone(m),
            None => match IpcMapping::open(device, &handle) {
                Ok(m) => {
                    let m = Arc::new(m);
                    opened.push((handle, Arc::clone(&m)));
                    m
                }
                Err(error) => {
                    tracing::warn!(peer = %peer.name, range = i, %error, "the peer's CUDA IPC handle does not open here; UCX carries its transfers");
                    return IpcPeer::Unusable {
                        ranges: Arc::clone(ranges),
                    };
                }
            },
        };
        let window = IpcWindow { start, mapping };
        if window.at(r.addr, r.len).is_none() {
            return IpcPeer::Refused {
                ranges: Arc::clone(ranges),
                error: protocol(format!(
                    "range {i} [{:#x}, +{}) is not inside the allocation its CUDA IPC handle opens ([{start:#x}, +{}))",
                    r.addr,
                    r.len,
                    window.mapping.len()
                )),
            };
        }
        windows.push(window);
    }
    windows.sort_by_key(|w| w.start);
    IpcPeer::Open {
        ranges: Arc::clone(ranges),
        layout,
        windows,
    }
}

/// Where `[addr, addr + len)` of the peer lies here: in the window of the latest start at
/// or below `addr`, or (windows of a lying peer may overlap) any window that holds it.
fn ipc_at(windows: &[IpcWindow], addr: u64, len: u64) -> Option<u64> {
    let i = windows.partition_point(|w| w.start <= addr);
    i.checked_sub(1)
        .and_then(|i| windows[i].at(addr, len))
        .or_else(|| windows.iter().find_map(|w| w.at(addr, len)))
}

/// One connected peer: its endpoint and its keys, dropped together.
struct PeerConn {
    keys: Option<PeerKeys>,
    /// The layout whose keys were refused, and why: asked again, it fails at once (a
    /// lying peer must not make us vet its keys, a fork each time, per request).
    refused: Option<(RegionDescriptor, Arc<[UcxRange]>, DataError)>,
    /// Vettings of its keys in a row that ended undecided ([`UcxError::KeysUndecided`]).
    undecided: u32,
    ep: Endpoint,
}

/// Vettings of a peer's keys in a row that may end undecided before its keys are refused:
/// each holds this thread up to the vetting bound, so keys that always stall the vetting
/// process are refused after this many, while an honest peer's whose vetting met a lock
/// held at the fork are tried again at their next use.
const KEYS_UNDECIDED_MAX: u32 = 3;

/// How a failure to unpack a peer's keys is kept, counting the vettings in a row that ended
/// undecided in `undecided`: `Some(error)` is remembered as the refusal of that layout
/// (asked again, it fails at once), `None` is tried again at the next use. A key found
/// malformed or unverified is refused at once; undecided keys at the
/// [`KEYS_UNDECIDED_MAX`]th time in a row, as malformed; anything else (no vetting process
/// could be made, the endpoint failed) never.
fn refusal(error: &UcxError, undecided: &mut u32) -> Option<UcxError> {
    match error {
        UcxError::MalformedKey { .. } | UcxError::UnverifiedKey { .. } => Some(error.clone()),
        UcxError::KeysUndecided { detail } => {
            *undecided += 1;
            (*undecided >= KEYS_UNDECIDED_MAX).then(|| UcxError::MalformedKey {
                detail: format!("{detail}, {KEYS_UNDECIDED_MAX} times in a row"),
            })
        }
        _ => None,
    }
}

/// Everything the thread owns. The registrations are `ManuallyDrop`: they are unmapped
/// only on an orderly stop, never by an unwinding panic while a `Region` may still point
/// at them (their `Rc` on the context then also keeps the context alive). What keeps the
/// engine's memory (`keep`) is `ManuallyDrop` for the same reason: it is released only
/// after its registrations.
struct State {
    worker: Worker,
    /// How long the idle thread sleeps between progress calls (no `wake`).
    idle: Duration,
    /// The worker's event fd and the plane's doorbell, when UCX gave one: the idle thread
    /// blocks on both instead of sleeping `idle`.
    wake: Option<Wake>,
    memory: ManuallyDrop<Vec<MemoryRegion>>,
    keep: ManuallyDrop<Option<Box<dyn Send>>>,
    /// The bound CUDA context, retained while the thread runs.
    _cuda: Option<DeviceContext>,
    /// Our ranges as registered (range `i` is `memory[i]`), checked.
    layout: KvLayout,
    peers: HashMap<Vec<u8>, PeerConn>,
    /// Keys unpacked over all peers, at most [`UCX_RKEYS_MAX`].
    rkeys: usize,
    /// Copies on our device, when our memory is device memory (the CUDA IPC lane).
    copier: Option<DeviceCopier>,
    /// Same-host peers' device memory mapped here by CUDA IPC, by worker address, with the
    /// peer's process (an exited one's are closed by [`State::sweep_ipc`]); at most
    /// [`UCX_ENDPOINTS_MAX`].
    ipc: HashMap<Vec<u8>, (Arc<PeerProcess>, IpcPeer)>,
    /// When [`State::sweep_ipc`] last looked.
    ipc_swept: Instant,
    /// Transfers the CUDA IPC lane carried ([`UcxDataPlane::cuda_ipc_transfers`]).
    ipc_transfers: Arc<AtomicU64>,
}

fn thread_main(
    setup: Setup,
    ready: mpsc::SyncSender<Result<Ready, DataError>>,
    rx: mpsc::Receiver<Cmd>,
) {
    let mut state = match start_ucx(setup) {
        Ok((state, up)) => {
            if ready.send(Ok(up)).is_err() {
                // `start` gave up waiting: nobody can point at the memory; unmap it.
                teardown(state);
                return;
            }
            state
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut busy_until = Instant::now();
    loop {
        state.sweep_ipc(Instant::now());
        let mut served = false;
        while state.worker.progress() > 0 {
            served = true;
        }
        if served {
            // Peers' operations need our progress (wireup, and the RMA UCX emulates with
            // active messages, e.g. into registered heap memory over shared memory): keep
            // polling while they come, instead of sleeping between each.
            busy_until = Instant::now() + UCX_BUSY_POLL;
        }
        let cmd = if Instant::now() < busy_until {
            match rx.try_recv() {
                Ok(cmd) => cmd,
                Err(mpsc::TryRecvError::Empty) => continue,
                Err(mpsc::TryRecvError::Disconnected) => break,
            }
        } else if let Some(wake) = &state.wake {
            match rx.try_recv() {
                Ok(cmd) => cmd,
                Err(mpsc::TryRecvError::Disconnected) => break,
                Err(mpsc::TryRecvError::Empty) => {
                    if let Err(error) = wake.sleep(&state.worker) {
                        tracing::warn!(%error, "UCX worker cannot be armed; polling on a timer from now on");
                        state.wake = None;
                    }
                    continue;
                }
            }
        } else {
            match rx.recv_timeout(state.idle) {
                Ok(cmd) => cmd,
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        };
        match cmd {
            Cmd::Stop => break,
            Cmd::Transfer(job) => {
                let result = state.transfer(&job);
                if let Err(error) = &result {
                    tracing::warn!(request = %job.request, peer = %job.peer.name, %error, "UCX transfer failed");
                }
                let _ = job.reply.send(result);
                busy_until = Instant::now() + UCX_BUSY_POLL;
            }
        }
    }
    teardown(state);
}

fn start_ucx(setup: Setup) -> Result<(State, Ready), DataError> {
    let Setup {
        memory,
        ipc_transfers,
        blocks,
        cuda_device,
        mut options,
        bell,
    } = setup;
    // Before UCX starts: its CUDA transports look for a current context when they load.
    let cuda = cuda_device.map(bind_device_to_thread).transpose()?;
    let registered_host = matches!(
        &memory,
        Memory::Register {
            mem_type: MemoryType::Host,
            ..
        }
    );
    let host = cuda.is_none() && (registered_host || matches!(&memory, Memory::Allocate(_)));
    // Our memory is on this device: same-host peers' device memory is copied with through
    // CUDA IPC on it ([`State::copy_ipc`]).
    let device_memory = matches!(
        &memory,
        Memory::Register {
            mem_type: MemoryType::Cuda,
            ..
        }
    )
    .then_some(cuda_device)
    .flatten();
    options.wakeup |= host;
    let (ctx, worker) = match Worker::open(&options) {
        Ok(opened) => opened,
        Err(error) if options.wakeup => {
            tracing::warn!(%error, "UCX without wakeup support; its thread polls on a timer");
            options.wakeup = false;
            Worker::open(&options)?
        }
        Err(error) => return Err(error.into()),
    };
    let wake = match (options.wakeup, bell.raw()) {
        (true, Some(bell_fd)) => match worker.event_fd() {
            Ok(efd) => Some(Wake { efd, bell_fd, bell }),
            Err(error) => {
                tracing::warn!(%error, "UCX worker has no event fd; its thread polls on a timer");
                None
            }
        },
        _ => None,
    };
    let mut regions = Vec::new();
    let (specs, keep) = match memory {
        Memory::Allocate(specs) => {
            for spec in &specs {
                let memory = MemoryRegion::allocate(&ctx, spec.len, MemoryType::Host)?;
                // Zero it (UCX leaves it unspecified) and fault the pages in now, not in
                // the first transfer.
                // SAFETY: `len` bytes of host memory were just mapped at `as_ptr`; no one
                // else has them yet.
                unsafe { std::ptr::write_bytes(memory.as_ptr(), 0, spec.len) };
                regions.push(memory);
            }
            (specs, None)
        }
        Memory::Register {
            ranges,
            mem_type,
            keep,
        } => {
            for spec in &ranges {
                // SAFETY: `keep` holds the memory (an engine's region, a device buffer),
                // whose owner promised `len` bytes at `addr` of `mem_type` stay valid
                // while it lives; `State::keep` releases it only after unmapping. No Rust
                // reference points into it (device memory, or the region contract).
                let memory = unsafe {
                    MemoryRegion::register(&ctx, spec.addr as *mut u8, spec.len, mem_type)
                };
                match memory {
                    Ok(memory) => regions.push(memory),
                    Err(e) => {
                        // Unmap what was mapped before releasing the memory it maps.
                        drop(regions);
                        drop(keep);
                        return Err(e.into());
                    }
                }
            }
            (ranges, Some(keep))
        }
    };
    let worker_address = worker.address()?;
    if worker_address.len() > DATA_DESCRIPTOR_BYTES_MAX {
        return Err(DataError::Unsupported {
            what: format!(
                "UCX worker address of {} bytes (max {DATA_DESCRIPTOR_BYTES_MAX})",
                worker_address.len()
            ),
        });
    }
    let mut ranges = Vec::with_capacity(regions.len());
    for (spec, memory) in specs.iter().zip(&regions) {
        let rkey = memory.pack_rkey()?;
        if rkey.len() > REMOTE_KEY_BYTES_MAX {
            return Err(DataError::Unsupported {
                what: format!(
                    "UCX rkey of {} bytes (max {REMOTE_KEY_BYTES_MAX})",
                    rkey.len()
                ),
            });
        }
        let cuda_ipc = match device_memory.map(|d| handoff_gpu::ipc_export(d, spec.addr)) {
            Some(Ok(Some(export))) => export.to_bytes(),
            Some(Ok(None)) => {
                tracing::debug!(
                    addr = spec.addr,
                    "device range not exportable by CUDA IPC; peers reach it through UCX"
                );
                Vec::new()
            }
            Some(Err(error)) => {
                tracing::warn!(%error, addr = spec.addr, "cannot export a device range by CUDA IPC; peers reach it through UCX");
                Vec::new()
            }
            None => Vec::new(),
        };
        ranges.push(UcxRange {
            remote_key: rkey,
            addr: memory.address(),
            len: memory.len() as u64,
            stride: spec.stride,
            bytes: spec.bytes,
            cuda_ipc,
        });
    }
    let layout = KvLayout {
        blocks,
        ranges: specs
            .iter()
            .zip(&ranges)
            .map(|(spec, r)| KvRange {
                addr: r.addr,
                stride: spec.stride as usize,
                bytes: spec.bytes as usize,
            })
            .collect(),
        memory: KvMemory::Host,
        layers: LayerSpan::WHOLE,
        block_tokens: 0,
        dtype_bytes: 0,
        heads: None,
    };
    layout.validate().map_err(|e| DataError::Unsupported {
        what: format!("local layout: {e}"),
    })?;
    let copier = device_memory.map(DeviceCopier::on_own_stream).transpose()?;
    let up = Ready {
        ranges,
        worker_address,
        version: format!("UCX {} ({})", ctx.version(), ctx.library()),
    };
    let state = State {
        worker,
        wake,
        idle: if registered_host {
            UCX_IDLE_PROGRESS_INTERVAL_REGISTERED_HOST
        } else {
            UCX_IDLE_PROGRESS_INTERVAL
        },
        memory: ManuallyDrop::new(regions),
        keep: ManuallyDrop::new(keep),
        _cuda: cuda,
        layout,
        peers: HashMap::new(),
        rkeys: 0,
        copier,
        ipc: HashMap::new(),
        ipc_swept: Instant::now(),
        ipc_transfers: Arc::clone(&ipc_transfers),
    };
    Ok((state, up))
}

/// An eventfd rung by whoever queues a command for the thread, so that a thread blocked
/// on its worker's event fd wakes for it too. Owned here (not UCX's), so ringing it after
/// the thread is gone is harmless.
struct Doorbell(Option<std::os::fd::OwnedFd>);

impl Doorbell {
    /// A doorbell; one that could not get an eventfd never rings (the thread then has no
    /// `Wake` and polls on a timer).
    fn new() -> Self {
        // SAFETY: plain syscall; a non-negative result is a new fd we own.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Self(None);
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        Self(Some(unsafe {
            <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd)
        }))
    }

    fn raw(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.0.as_ref().map(|fd| fd.as_raw_fd())
    }

    fn ring(&self) {
        if let Some(fd) = self.raw() {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to our eventfd; a full counter (never,
            // at 2^64 - 1) only fails the write (EAGAIN), and the thread is awake anyway.
            let _ = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
        }
    }

    fn clear(&self) {
        if let Some(fd) = self.raw() {
            let mut n: u64 = 0;
            // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd.
            let _ = unsafe { libc::read(fd, (&mut n as *mut u64).cast(), 8) };
        }
    }
}

/// What the idle thread blocks on: the worker's event fd and the plane's doorbell.
struct Wake {
    /// UCX's, valid while the worker lives (the thread's whole life); never closed here.
    efd: std::os::fd::RawFd,
    /// The doorbell's eventfd, which it keeps open.
    bell_fd: std::os::fd::RawFd,
    bell: Arc<Doorbell>,
}

impl Wake {
    /// Blocks until the worker has an event, a command is queued, or [`UCX_WAKE_TIMEOUT`]
    /// passes; at once when events are already pending (the caller progresses next).
    fn sleep(&self, worker: &Worker) -> Result<(), UcxError> {
        if !worker.arm()? {
            return Ok(());
        }
        let mut fds = [
            libc::pollfd {
                fd: self.efd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.bell_fd,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let timeout = i32::try_from(UCX_WAKE_TIMEOUT.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: two initialised pollfds over fds that live through the call.
        let _ = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
        self.bell.clear();
        Ok(())
    }
}

fn teardown(mut state: State) {
    // Keys before endpoints before memory before worker, as UCX wants.
    state.peers.clear();
    // SAFETY: every `Region` over memory we allocated is gone (we got `Stop` or were never
    // handed out), and no operation is in flight (each job waits for its own).
    unsafe { ManuallyDrop::drop(&mut state.memory) };
    // SAFETY: dropped once, after the registrations above are gone.
    unsafe { ManuallyDrop::drop(&mut state.keep) };
}

impl State {
    fn transfer(&mut self, job: &Job) -> Result<(), DataError> {
        let peer = &job.peer;
        let started = Instant::now();
        if started >= job.deadline {
            return Err(DataError::Timeout {
                peer: peer.name.clone(),
                op: "queued for the UCX thread",
                after: Duration::ZERO,
            });
        }
        if let Some(ago) = job.lease.as_ref().and_then(|l| l.expired_for(started)) {
            return Err(ucx_error(
                peer,
                UcxError::LeaseExpired {
                    posted: 0,
                    ago: (ago != Duration::MAX).then_some(ago),
                },
                started,
            ));
        }
        // Checked again on this side of the queue: nothing unchecked is ever posted.
        let block_bytes = self.layout.block_bytes();
        let at = check_peer(peer, &job.remote, block_bytes, &job.slices, job.direction)?;
        let blocks = self.layout.blocks;
        if let Some(b) = job.local.iter().find(|b| b.0 >= blocks) {
            return Err(DataError::Region(crate::region::RegionError::OutOfRange {
                block: *b,
                blocks,
            }));
        }
        if let Some(copied) = self.copy_ipc(job, &at, started) {
            return copied;
        }
        let address = &peer.worker_address;
        self.connect(peer)?;
        let result = match self.peers.get(address) {
            Some(PeerConn {
                ep,
                keys: Some(keys),
                ..
            }) => {
                let locals: Vec<&MemoryRegion> = self.memory.iter().collect();
                post_rounds(ep, &locals, &self.layout, keys, job, &at)
            }
            _ => Err(UcxError::InvalidArgument {
                what: "endpoint or keys missing after connect".into(),
            }),
        };
        match result {
            Ok(()) => Ok(()),
            Err(error) => {
                // A failed or timed-out endpoint is force-closed: forget it (and its keys)
                // so a restarted peer gets a fresh one.
                self.forget(address);
                Err(ucx_error(peer, error, started))
            }
        }
    }

    /// Makes sure an endpoint to the peer exists (and is live) and holds keys for the
    /// peer's current layout, checked: every range well formed and inside the length it
    /// advertised, the logical block the size the peer's region says.
    fn connect(&mut self, peer: &UcxPeer) -> Result<(), DataError> {
        let address = &peer.worker_address;
        if self
            .peers
            .get(address)
            .is_some_and(|conn| conn.ep.error().is_some())
        {
            self.forget(address);
        }
        if !self.peers.contains_key(address) {
            if self.peers.len() >= UCX_ENDPOINTS_MAX {
                let victim = self.peers.keys().next().cloned();
                if let Some(victim) = victim {
                    self.forget(&victim);
                }
            }
            let ep = self
                .worker
                .connect(address)
                .map_err(|e| ucx_error(peer, e, Instant::now()))?;
            let conn = PeerConn {
                keys: None,
                refused: None,
                undecided: 0,
                ep,
            };
            self.peers.insert(address.clone(), conn);
        }
        let current = self.peers.get(address).is_some_and(|conn| {
            conn.keys.as_ref().is_some_and(|k| {
                (Arc::ptr_eq(&k.ranges, &peer.ranges) || k.ranges == peer.ranges)
                    && k.region == peer.region
            })
        });
        if current {
            return Ok(());
        }
        let refused = self.peers.get(address).and_then(|conn| {
            conn.refused
                .as_ref()
                .filter(|(region, ranges, _)| {
                    (Arc::ptr_eq(ranges, &peer.ranges) || **ranges == *peer.ranges)
                        && *region == peer.region
                })
                .map(|(_, _, error)| error.clone())
        });
        if let Some(error) = refused {
            return Err(error);
        }
        // New or changed layout: drop the old keys, check the new one, unpack its keys.
        let old = self
            .peers
            .get_mut(address)
            .and_then(|conn| conn.keys.take())
            .map_or(0, |k| k.rkeys.len());
        self.rkeys = self.rkeys.saturating_sub(old);
        let ranges = peer.range_list();
        let layout = peer_layout(peer, &ranges)?;
        if self.rkeys + ranges.len() > UCX_RKEYS_MAX {
            // Evict other peers' keys (unpacked again when next used).
            for conn in self.peers.values_mut() {
                conn.keys = None;
            }
            self.rkeys = 0;
        }
        let conn = self
            .peers
            .get_mut(address)
            .ok_or_else(|| DataError::PlaneStopped {
                detail: "endpoint vanished".into(),
            })?;
        let packed: Vec<(&[u8], u64, u64)> = ranges
            .iter()
            .map(|r| (r.remote_key.as_slice(), r.addr, r.len))
            .collect();
        let rkeys = match conn.ep.unpack_rkeys(&packed) {
            Ok(rkeys) => rkeys,
            Err((i, e)) => {
                // Only a refusal is remembered: a vetting process that could not be made
                // (out of processes, say) is tried again next time, and one that ended
                // undecided a bounded number of times in a row.
                let Some(refused) = refusal(&e, &mut conn.undecided) else {
                    return Err(ucx_error(peer, range_error(i, e), Instant::now()));
                };
                let error = ucx_error(peer, range_error(i, refused), Instant::now());
                let ranges = Arc::clone(&peer.ranges);
                conn.refused = Some((peer.region.clone(), ranges, error.clone()));
                return Err(error);
            }
        };
        conn.undecided = 0;
        self.rkeys += rkeys.len();
        conn.keys = Some(PeerKeys {
            region: peer.region.clone(),
            ranges: Arc::clone(&peer.ranges),
            layout,
            rkeys,
        });
        Ok(())
    }

    /// The CUDA IPC lane: a transfer with a verified same-host peer whose device ranges
    /// carry IPC descriptors, while our memory is device memory, is device copies through
    /// the peer's allocations mapped here, each piece checked against the mapping's bounds
    /// before it is enqueued. `None`: the lane does not apply (UCX carries the transfer).
    fn copy_ipc(
        &mut self,
        job: &Job,
        at: &[plan::Sliced],
        started: Instant,
    ) -> Option<Result<(), DataError>> {
        let peer = &job.peer;
        let process = peer.process.as_ref()?;
        let device = self.copier.as_ref()?.ordinal();
        if peer.device.is_none() || peer.ranges.is_empty() {
            return None;
        }
        if peer.ranges.iter().any(|r| r.cuda_ipc.is_empty()) {
            return None;
        }
        let address = &peer.worker_address;
        if !process.alive() {
            // Its mappings go with it (the allocations may be gone).
            self.ipc.remove(address);
            return Some(Err(DataError::SameHost {
                peer: peer.name.clone(),
                error: same_host::SameHostError::PeerExited { pid: process.pid() },
            }));
        }
        let current = self.ipc.get(address).is_some_and(|(_, p)| {
            Arc::ptr_eq(p.ranges(), &peer.ranges) || **p.ranges() == *peer.ranges
        });
        if !current {
            // The old mappings are closed before the new ones open (one per handle).
            self.ipc.remove(address);
            if self.ipc.len() >= UCX_ENDPOINTS_MAX {
                let victim = self.ipc.keys().next().cloned();
                if let Some(victim) = victim {
                    self.ipc.remove(&victim);
                }
            }
            let opened = open_ipc(peer, &peer.ranges, device);
            if let IpcPeer::Open { windows, .. } = &opened {
                tracing::info!(peer = %peer.name, allocations = windows.len(), "device copies with this peer through CUDA IPC");
            }
            self.ipc
                .insert(address.clone(), (Arc::clone(process), opened));
        }
        let (layout, windows) = match &self.ipc.get(address)?.1 {
            IpcPeer::Open {
                layout, windows, ..
            } => (layout, windows),
            IpcPeer::Unusable { .. } => return None,
            IpcPeer::Refused { error, .. } => return Some(Err(error.clone())),
        };
        let copier = self.copier.as_ref()?;
        let copied = ipc_rounds(copier, &self.layout, layout, windows, job, at, process);
        let result = copied.map(|(pieces, bytes)| {
            self.ipc_transfers.fetch_add(1, Ordering::Relaxed);
            let took_us = started.elapsed().as_micros() as u64;
            tracing::debug!(request = %job.request, peer = %peer.name, bytes, pieces, took_us, "CUDA IPC copy");
        });
        if matches!(result, Err(DataError::Gpu(_))) {
            // A driver failure may mean a broken mapping: the next transfer opens afresh.
            // (A fence, a deadline or a refused piece leaves the mappings as they are.)
            self.ipc.remove(address);
        }
        Some(result)
    }

    /// Closes the CUDA IPC mappings of peers whose process has exited, at most every
    /// [`IPC_SWEEP_INTERVAL`]: a mapping keeps the peer's whole allocation alive on the
    /// device, so a dead peer's must not wait for a transfer that will never come.
    fn sweep_ipc(&mut self, now: Instant) {
        if self.ipc.is_empty() || now < self.ipc_swept + IPC_SWEEP_INTERVAL {
            return;
        }
        self.ipc_swept = now;
        self.ipc.retain(|_, (process, _)| process.alive());
    }

    fn forget(&mut self, address: &[u8]) {
        if let Some(conn) = self.peers.remove(address) {
            let keys = conn.keys.as_ref().map_or(0, |k| k.rkeys.len());
            self.rkeys = self.rkeys.saturating_sub(keys);
        }
    }
}

/// Checks a peer's ranges: a well-formed layout ([`KvLayout::validate`]: bounded counts,
/// no overflow) whose blocks lie inside the length each range advertises (what its key
/// opens), whose logical block is the size, and whose block count the one, the peer's
/// region states. A protocol error names the peer and the range.
fn peer_layout(peer: &UcxPeer, ranges: &[UcxRange]) -> Result<KvLayout, DataError> {
    let protocol = |detail: String| DataError::Protocol {
        peer: peer.name.clone(),
        detail,
    };
    let blocks = peer
        .blocks()
        .map_err(|e| protocol(format!("region: {e}")))?;
    let mut list = Vec::with_capacity(ranges.len());
    for (i, r) in ranges.iter().enumerate() {
        let (Ok(stride), Ok(bytes)) = (usize::try_from(r.stride), usize::try_from(r.bytes)) else {
            return Err(protocol(format!(
                "range {i}: stride or block size past this address space"
            )));
        };
        list.push(KvRange {
            addr: r.addr,
            stride,
            bytes,
        });
    }
    let layout = KvLayout {
        blocks,
        ranges: list,
        memory: KvMemory::Host,
        layers: LayerSpan::WHOLE,
        block_tokens: 0,
        dtype_bytes: 0,
        heads: None,
    };
    let block_bytes = layout
        .validate()
        .map_err(|e| protocol(format!("layout: {e}")))?;
    for (i, (r, k)) in ranges.iter().zip(&layout.ranges).enumerate() {
        let extent = k.extent(blocks).unwrap_or(u64::MAX);
        if extent > r.len || r.addr.checked_add(r.len).is_none() {
            return Err(protocol(format!(
                "range {i}: {blocks} blocks of {} bytes every {} need {extent} bytes, the range advertises {} at {:#x}",
                r.bytes, r.stride, r.len, r.addr
            )));
        }
    }
    if block_bytes as u64 != peer.region.block_bytes {
        return Err(protocol(format!(
            "ranges add up to {block_bytes}-byte blocks, the region says {}",
            peer.region.block_bytes
        )));
    }
    Ok(layout)
}

/// Maps every block pair to both sides' segments ([`KvLayout::segments_into`]), pairs them
/// ([`pair_segments`]), merges pieces adjacent on both sides in the same two ranges (range
/// by range: [`RangeCoalescer`]), and posts them in rounds of at most [`UCX_SEGMENTS_PER_ROUND`] segments. Everything was
/// checked before the first round: both block lists against both layouts, the slice
/// against both logical block sizes, and every peer range's blocks against the length it
/// advertises, so every segment lies inside its registration and its key's range (which
/// the batch checks again per round).
fn post_rounds(
    ep: &Endpoint,
    locals: &[&MemoryRegion],
    ours: &KvLayout,
    keys: &PeerKeys,
    job: &Job,
    at: &[plan::Sliced],
) -> Result<(), UcxError> {
    let remotes: Vec<&RemoteKey> = keys.rkeys.iter().collect();
    let theirs = &keys.layout;
    let most = ours.ranges.len() + theirs.ranges.len();
    let mut segments: Vec<RangeSegment> =
        Vec::with_capacity(UCX_SEGMENTS_PER_ROUND.min(job.local.len().saturating_mul(most)));
    let mut runs = RangeCoalescer::new(ours.ranges.len());
    let (mut mine, mut other) = (Vec::new(), Vec::new());
    let layout_error = |e: crate::layout::LayoutError| UcxError::InvalidArgument {
        what: e.to_string(),
    };
    for ((l, r), at) in block_slices(&job.local, &job.remote, at) {
        let mut outside = None;
        pair_block(ours, theirs, *l, *r, at, &mut mine, &mut other, |m, o| {
            let start = ours.ranges.get(m.range as usize).map(|k| k.addr);
            let Some(local_offset) = start
                .and_then(|a| m.addr.checked_sub(a))
                .and_then(|o| usize::try_from(o).ok())
            else {
                outside = Some(m);
                return;
            };
            runs.push(
                RangeSegment {
                    local: m.range,
                    local_offset,
                    remote: o.range,
                    remote_addr: o.addr,
                    len: m.len,
                },
                &mut segments,
            );
        })
        .map_err(layout_error)?;
        if let Some(m) = outside {
            return Err(UcxError::InvalidArgument {
                what: format!("segment {m:?} is outside our range"),
            });
        }
        if segments.len() >= UCX_SEGMENTS_PER_ROUND {
            ep.transfer_ranges_leased(
                job.direction,
                locals,
                &remotes,
                &segments,
                job.deadline,
                job.lease.as_deref(),
            )?;
            segments.clear();
        }
    }
    runs.finish(&mut segments);
    if !segments.is_empty() {
        ep.transfer_ranges_leased(
            job.direction,
            locals,
            &remotes,
            &segments,
            job.deadline,
            job.lease.as_deref(),
        )?;
    }
    Ok(())
}

/// A transfer with a peer process on this host between host memory on both sides: kernel
/// copies ([`same_host::copy`]) of the same pieces UCX would have moved, in rounds of at
/// most [`UCX_SEGMENTS_PER_ROUND`], no UCX endpoint or thread involved. The peer's ranges
/// are checked as for UCX ([`peer_layout`]) before the first copy; `local` and `remote`
/// were checked against both layouts by the caller.
#[allow(clippy::too_many_arguments)]
fn copy_same_host(
    ours: &KvLayout,
    peer: &UcxPeer,
    process: &PeerProcess,
    direction: Direction,
    local: &[BlockId],
    remote: &[BlockId],
    at: &[plan::Sliced],
    deadline: Instant,
    lease: Option<&Lease>,
) -> Result<usize, DataError> {
    let theirs = peer_layout(peer, &peer.range_list())?;
    let way = match direction {
        Direction::Put => Way::Write,
        Direction::Get => Way::Read,
    };
    let copy = |pieces: &[same_host::Piece]| {
        let bytes: u64 = pieces.iter().map(|p| p.len as u64).sum();
        let small = bytes < (pieces.len() as u64).saturating_mul(SAME_HOST_GATHER_PIECE_BYTES);
        // A large copy runs in lanes, one thread each: the kernel copies in the calling
        // thread, so a single one caps the copy at one core's memcpy.
        let lanes = same_host::lanes_for(bytes);
        // SAFETY: every local piece lies in a block of our layout (checked by the caller,
        // mapped by `pair_block`), memory the plane keeps alive while it runs; the peer's
        // addresses need no promise (a bad one is `EFAULT`).
        let copied = if way == Way::Read && small {
            // The peer's ranges, for the spans read to stay within.
            let within: Vec<(u64, u64)> = theirs
                .ranges
                .iter()
                .filter_map(|r| Some((r.addr, r.addr.checked_add(r.extent(theirs.blocks)?)?)))
                .collect();
            // No two local pieces overlap: our blocks are distinct (`check_destinations`),
            // as are the slices in them (`Sliced::all`) and the layout's ranges.
            unsafe { same_host::read_gathered_in_lanes(process, pieces, &within, deadline, lanes) }
        } else {
            unsafe { same_host::copy_in_lanes(process, way, pieces, deadline, lease, lanes) }
        };
        copied.map_err(|error| DataError::SameHost {
            peer: peer.name.clone(),
            error,
        })
    };
    let mut pieces: Vec<same_host::Piece> =
        Vec::with_capacity(UCX_SEGMENTS_PER_ROUND.min(local.len().saturating_mul(2)));
    let (mut mine, mut other) = (Vec::new(), Vec::new());
    let mut copied = 0;
    for ((l, r), at) in block_slices(local, remote, at) {
        pair_block(ours, &theirs, *l, *r, at, &mut mine, &mut other, |m, o| {
            if let Some(last) = pieces.last_mut() {
                let len = last.len as u64;
                if last.local + len == m.addr && last.remote + len == o.addr {
                    last.len += m.len;
                    return;
                }
            }
            pieces.push(same_host::Piece {
                local: m.addr,
                remote: o.addr,
                len: m.len,
            });
        })
        .map_err(|e| failed_layout(peer, e))?;
        if pieces.len() >= UCX_SEGMENTS_PER_ROUND {
            copy(&pieces)?;
            copied += pieces.len();
            pieces.clear();
        }
    }
    if !pieces.is_empty() {
        copy(&pieces)?;
        copied += pieces.len();
    }
    Ok(copied)
}

/// The pieces of a job through the peer's mapped windows, copied in rounds of at most
/// [`IPC_BYTES_PER_ROUND`] bytes and [`UCX_SEGMENTS_PER_ROUND`] pieces; before each round
/// the deadline, the writer's lease and the peer's life are checked. Every piece is
/// checked to lie inside one window before its round is enqueued. Returns the pieces and
/// bytes copied.
fn ipc_rounds(
    copier: &DeviceCopier,
    ours: &KvLayout,
    theirs: &KvLayout,
    windows: &[IpcWindow],
    job: &Job,
    at: &[plan::Sliced],
    process: &PeerProcess,
) -> Result<(usize, u64), DataError> {
    let peer = &job.peer;
    let started = Instant::now();
    let mut round: Vec<CopyPiece> = Vec::new();
    let (mut round_bytes, mut pieces, mut bytes) = (0u64, 0usize, 0u64);
    let flush = |round: &mut Vec<CopyPiece>, moved: u64| -> Result<(), DataError> {
        let now = Instant::now();
        if now >= job.deadline {
            return Err(DataError::Timeout {
                peer: peer.name.clone(),
                op: "CUDA IPC copy",
                after: now.saturating_duration_since(started),
            });
        }
        if let Some(ago) = job.lease.as_ref().and_then(|l| l.expired_for(now)) {
            return Err(DataError::SameHost {
                peer: peer.name.clone(),
                error: same_host::SameHostError::LeaseExpired {
                    pid: process.pid(),
                    moved,
                    ago: (ago != Duration::MAX).then_some(ago),
                },
            });
        }
        if !process.alive() {
            return Err(DataError::SameHost {
                peer: peer.name.clone(),
                error: same_host::SameHostError::PeerExited { pid: process.pid() },
            });
        }
        // SAFETY: every local piece lies in a block of our layout (checked by the caller),
        // memory the plane keeps registered while it runs; every remote piece lies inside
        // a mapping this thread holds open for the call (checked by `ipc_at`).
        unsafe { copier.copy_pieces(round) }?;
        round.clear();
        Ok(())
    };
    let (mut mine, mut other) = (Vec::new(), Vec::new());
    let mut outside = None;
    for ((l, r), at) in block_slices(&job.local, &job.remote, at) {
        pair_block(ours, theirs, *l, *r, at, &mut mine, &mut other, |m, o| {
            if outside.is_some() {
                return;
            }
            let Some(there) = ipc_at(windows, o.addr, m.len as u64) else {
                outside = Some(o.addr);
                return;
            };
            let (dst, src) = match job.direction {
                Direction::Put => (there, m.addr),
                Direction::Get => (m.addr, there),
            };
            if let Some(last) = round.last_mut() {
                let len = last.len as u64;
                if last.dst + len == dst && last.src + len == src {
                    last.len += m.len;
                    return;
                }
            }
            round.push(CopyPiece {
                dst,
                src,
                len: m.len,
            });
        })
        .map_err(|e| failed_layout(peer, e))?;
        if let Some(addr) = outside {
            return Err(DataError::Protocol {
                peer: peer.name.clone(),
                detail: format!(
                    "block {} at {addr:#x} is not inside an allocation its CUDA IPC handles open",
                    r.0
                ),
            });
        }
        let pair_bytes = at.len as u64;
        round_bytes += pair_bytes;
        bytes += pair_bytes;
        if round.len() >= UCX_SEGMENTS_PER_ROUND || round_bytes >= IPC_BYTES_PER_ROUND {
            pieces += round.len();
            flush(&mut round, bytes - round_bytes)?;
            round_bytes = 0;
        }
    }
    if !round.is_empty() {
        pieces += round.len();
        flush(&mut round, bytes - round_bytes)?;
    }
    Ok((pieces, bytes))
}

/// Every block pair (`local[i]` with `remote[i]`) with every slice of a call, block by
/// block: what one call moves, in the order it moves it.
fn block_slices<'a>(
    local: &'a [BlockId],
    remote: &'a [BlockId],
    at: &'a [plan::Sliced],
) -> impl Iterator<Item = ((&'a BlockId, &'a BlockId), &'a plan::Sliced)> + 'a {
    local
        .iter()
        .zip(remote)
        .flat_map(move |pair| at.iter().map(move |a| (pair, a)))
}

/// Both sides' segments of one block pair (`l` ours, `r` the peer's), sliced by `at`,
/// paired into pieces of equal length for `f` (ours, theirs), in order. `mine` and `other`
/// are scratch lists.
#[allow(clippy::too_many_arguments)]
fn pair_block(
    ours: &KvLayout,
    theirs: &KvLayout,
    l: BlockId,
    r: BlockId,
    at: &plan::Sliced,
    mine: &mut Vec<Segment>,
    other: &mut Vec<Segment>,
    f: impl FnMut(Segment, Segment),
) -> Result<(), crate::layout::LayoutError> {
    mine.clear();
    other.clear();
    ours.segments_into(l.0, at.local_offset, at.len, mine)?;
    let remote_offset = usize::try_from(at.remote_offset).unwrap_or(usize::MAX);
    theirs.segments_into(r.0, remote_offset, at.len, other)?;
    pair_segments(mine, other, f)
}

/// A peer layout that cannot be paired with ours, block by block (checked before: a bug).
fn failed_layout(peer: &UcxPeer, e: crate::layout::LayoutError) -> DataError {
    DataError::Protocol {
        peer: peer.name.clone(),
        detail: format!("layout: {e}"),
    }
}

/// Names the peer in a UCX failure.
/// A key refused while unpacking a peer's ranges names which range it was.
fn range_error(range: usize, error: UcxError) -> UcxError {
    match error {
        UcxError::MalformedKey { detail } => UcxError::MalformedKey {
            detail: format!("range {range}: {detail}"),
        },
        other => other,
    }
}

fn ucx_error(peer: &UcxPeer, error: UcxError, started: Instant) -> DataError {
    match error {
        UcxError::Timeout { op, .. } => DataError::Timeout {
            peer: peer.name.clone(),
            op,
            after: started.elapsed(),
        },
        UcxError::EndpointFailed { .. } | UcxError::EndpointClosed { .. } => DataError::Io {
            peer: peer.name.clone(),
            detail: error.to_string(),
        },
        UcxError::OutOfRange { .. }
        | UcxError::UnverifiedKey { .. }
        | UcxError::MalformedKey { .. } => DataError::Protocol {
            peer: peer.name.clone(),
            detail: error.to_string(),
        },
        // Every other failure of an operation on a peer (connect, unpack, post) names it.
        other => DataError::Io {
            peer: peer.name.clone(),
            detail: other.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn undecided_keys_are_tried_again_a_bounded_number_of_times_then_refused() {
        let undecided = UcxError::KeysUndecided {
            detail: "the vetting process did not unpack the keys within 5s".into(),
        };
        // Tried again while fewer than the bound ended undecided in a row...
        let mut count = 0;
        for before in 0..KEYS_UNDECIDED_MAX - 1 {
            assert_eq!(refusal(&undecided, &mut count), None, "after {before}");
        }
        // ...then refused as malformed, saying how often.
        match refusal(&undecided, &mut count) {
            Some(UcxError::MalformedKey { detail }) => {
                assert!(detail.contains("did not unpack"), "{detail}");
                assert!(detail.contains("3 times in a row"), "{detail}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        // A malformed or unverified key is refused at once; what says nothing about the
        // keys (no vetting process, a failed endpoint) never is.
        let malformed = UcxError::MalformedKey {
            detail: "cut".into(),
        };
        assert_eq!(refusal(&malformed, &mut 0), Some(malformed.clone()));
        let unverified = UcxError::UnverifiedKey {
            base: 0x1000,
            len: 64,
            detail: "outside".into(),
        };
        assert_eq!(refusal(&unverified, &mut 0), Some(unverified.clone()));
        let unavailable = UcxError::InvalidArgument {
            what: "remote keys not vetted: fork: EAGAIN".into(),
        };
        assert_eq!(refusal(&unavailable, &mut (KEYS_UNDECIDED_MAX + 5)), None);
    }
}
