//! [`UcxDataPlane`]: the runtime's UCX data path, on one dedicated thread.
//!
//! UCX runs in single-thread mode (our handles are `!Send`), so the plane owns one thread
//! that creates the context, the worker and the memory, and executes every transfer; the
//! async [`UcxDataPlane::write`]/[`UcxDataPlane::read`] send it a job through a bounded
//! queue ([`UCX_JOBS_QUEUED_MAX`]) and await its answer.
//!
//! Host memory is UCX's (`MemoryRegion::allocate`): on one host the shared-memory
//! transports map it into peers directly, an order of magnitude faster than registered
//! heap memory. Device memory is the engine's (a [`DeviceBuffer`], e.g. its KV cache),
//! registered as `UCS_MEMORY_TYPE_CUDA` ([`UcxDataPlane::start_on_device`]): between
//! processes on one GPU UCX moves it with `cuda_ipc`, and to or from host memory with
//! `cuda_copy`. Either way the runtime sees an ordinary [`Region`]
//! ([`UcxDataPlane::region`]) over the very same bytes, so blocks the engine fills are the
//! blocks peers read, without a copy. The region keeps the thread (and so the
//! registration) alive: the memory is unmapped only after the plane and every clone of
//! the region are dropped, and a device buffer is released only after that.
//!
//! CUDA transports call the driver on the thread that drives UCX, so a plane whose memory
//! is on a device binds that device's primary context to its thread first; a host plane
//! that exchanges with peers' device memory names a device in
//! [`UcxPlaneOptions::cuda_device`] for the same reason.
//!
//! Protection: a write is one-sided RDMA into the peer's memory, so no code of the peer
//! runs per operation and no grant check can. What protects the peer is the remote key's
//! scope (only the region it registered), our check of every block against the peer's
//! [`RegionDescriptor`] before anything is posted (an out-of-range block is a protocol
//! error naming the peer, and nothing is written), and the control plane's grant (the peer
//! handed out these blocks for this request), as in NIXL and Mooncake Transfer Engine.
//!
//! Cancellation: dropping a call's future does not stop a job the thread has started; the
//! job ends by its deadline (the endpoint is force-closed then, cancelling what UCX had in
//! flight). Do not hand the blocks to another request before the call returned or its
//! deadline passed.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff_gpu::{bind_device_to_thread, DeviceBuffer, DeviceContext, KvBuffer};
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

use super::plan;
use super::DataError;
use crate::region::{BlockSlice, Region};
use crate::types::{BlockId, RankInfo, RequestId};
use crate::ucx::{
    Context, ContextOptions, Direction, Endpoint, MemoryRegion, MemoryType, RemoteKey, Segment,
    UcxError, Worker,
};
use crate::wire::limits::{DATA_DESCRIPTOR_BYTES_MAX, REMOTE_KEY_BYTES_MAX};
use crate::wire::{RegionDescriptor, TransportKind};

/// Jobs waiting for or running on the UCX thread at most; a call beyond waits (within its
/// deadline) for a slot. The thread runs one job at a time, so a deep queue only adds
/// latency; 256 covers every request of a busy worker at once.
pub const UCX_JOBS_QUEUED_MAX: usize = 256;

/// Peers (endpoints) the thread keeps connected. A worker talks to the ranks of the
/// engines it pairs with: hundreds at most.
pub const UCX_ENDPOINTS_MAX: usize = 1024;

/// Remote keys the thread keeps unpacked (one per peer region, several per peer after
/// re-registrations).
pub const UCX_RKEYS_MAX: usize = 4096;

/// How long the thread blocks waiting for a job before it progresses the worker again:
/// an idle target must still progress (wireup of new endpoints, keepalive, TCP lanes).
pub const UCX_IDLE_PROGRESS_INTERVAL: Duration = Duration::from_millis(1);

/// After a job, the thread polls for the next one without sleeping this long: back-to-back
/// small transfers then cost no thread wake-up (microseconds each on a busy host).
pub const UCX_BUSY_POLL: Duration = Duration::from_micros(200);

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
    /// device memory binds its buffer's device whatever this says. Default: none.
    pub cuda_device: Option<u32>,
    /// Time for the thread to start.
    pub start_timeout: Duration,
}

impl Default for UcxPlaneOptions {
    fn default() -> Self {
        Self {
            context: ContextOptions::default(),
            cuda_device: None,
            start_timeout: UCX_START_TIMEOUT_DEFAULT,
        }
    }
}

/// What a peer needs to reach a plane's region: carried by the control plane (the worker
/// address in the bootstrap record's data descriptor, the region in `TransferInfo`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UcxPeer {
    /// The owner's name for errors and logs (`engine/rank`).
    pub name: String,
    /// The owner's UCX worker address, at most [`DATA_DESCRIPTOR_BYTES_MAX`] bytes.
    pub worker_address: Vec<u8>,
    /// The region: packed rkey, base address, length, block size.
    pub region: RegionDescriptor,
}

/// One transfer for the thread.
struct Job {
    direction: Direction,
    request: RequestId,
    peer: UcxPeer,
    local: Vec<BlockId>,
    remote: Vec<BlockId>,
    /// The slice of every block moved (`None`: whole blocks).
    slice: Option<BlockSlice>,
    deadline: Instant,
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
    slots: Arc<Semaphore>,
}

impl Drop for PlaneThread {
    fn drop(&mut self) {
        let _ = self.tx.send(Cmd::Stop);
    }
}

/// The memory a plane's thread registers.
enum Memory {
    /// Host memory UCX allocates, of this many bytes.
    Allocate(usize),
    /// The first `usize` bytes of a device buffer.
    Device(Arc<DeviceBuffer>, usize),
}

/// What the thread reports once it is up.
struct Ready {
    ptr: usize,
    base: u64,
    worker_address: Vec<u8>,
    rkey: Vec<u8>,
    version: String,
}

/// The UCX data path of one worker: owns UCX-allocated memory (seen by the runtime as
/// [`UcxDataPlane::region`]) and moves blocks between it and peers' planes.
///
/// Made once per worker by the runtime's network link with [`UcxDataPlane::start`]; its
/// [`UcxDataPlane::descriptor`] goes to peers over the control plane; then
/// [`UcxDataPlane::write`] (push) and [`UcxDataPlane::read`] (pull), from any task.
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
    /// which allocates `blocks × block_bytes` bytes of zeroed memory. `me` names this
    /// worker in its descriptor.
    pub fn start(
        blocks: u32,
        block_bytes: usize,
        me: &RankInfo,
        options: UcxPlaneOptions,
    ) -> Result<UcxDataPlane, DataError> {
        // Check the shape with the region's own rules before starting anything.
        let len = checked_len(blocks, block_bytes)?;
        Self::launch(Memory::Allocate(len), blocks, block_bytes, me, options)
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
        Self::launch(
            Memory::Device(buffer, len),
            blocks,
            block_bytes,
            me,
            options,
        )
    }

    fn launch(
        memory: Memory,
        blocks: u32,
        block_bytes: usize,
        me: &RankInfo,
        options: UcxPlaneOptions,
    ) -> Result<UcxDataPlane, DataError> {
        let device = match &memory {
            Memory::Device(buffer, _) => Some(Arc::clone(buffer)),
            Memory::Allocate(_) => None,
        };
        let len = match &memory {
            Memory::Allocate(len) | Memory::Device(_, len) => *len,
        };
        let cuda_device = device.as_ref().map(|b| b.ordinal()).or(options.cuda_device);
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let (tx, rx) = mpsc::channel();
        let context = options.context.clone();
        let name = format!("handoff-ucx-{me}");
        let spawned = std::thread::Builder::new()
            .name(name.chars().take(15).collect())
            .spawn(move || {
                let setup = Setup {
                    memory,
                    block_bytes,
                    cuda_device,
                    options: context,
                };
                thread_main(setup, ready_tx, rx)
            });
        if let Err(e) = spawned {
            return Err(DataError::PlaneStopped {
                detail: format!("cannot spawn the UCX thread: {e}"),
            });
        }
        let thread = Arc::new(PlaneThread {
            tx,
            slots: Arc::new(Semaphore::new(UCX_JOBS_QUEUED_MAX)),
        });
        let ready = match ready_rx.recv_timeout(options.start_timeout) {
            Ok(result) => result?,
            Err(_) => {
                return Err(DataError::PlaneStopped {
                    detail: format!("UCX thread not ready within {:?}", options.start_timeout),
                })
            }
        };
        let keeper: Box<dyn Send + Sync> = Box::new(Arc::clone(&thread));
        let region = match device {
            Some(buffer) => Region::on_device_kept(buffer, blocks, block_bytes, Some(keeper))?,
            None => {
                let ptr =
                    NonNull::new(ready.ptr as *mut u8).ok_or_else(|| DataError::PlaneStopped {
                        detail: "UCX returned a null region".into(),
                    })?;
                // SAFETY: the thread mapped `len` bytes of host memory at `ptr` and unmaps
                // them only after `Stop`, which is sent when the last `PlaneThread` handle
                // drops, and `keeper` is one; nothing else holds Rust references to them.
                unsafe { Region::from_external(ptr, blocks, block_bytes, keeper) }?
            }
        };
        let me = UcxPeer {
            name: me.to_string(),
            worker_address: ready.worker_address,
            region: RegionDescriptor {
                transport: TransportKind::Ucx,
                address: me.to_string(),
                remote_key: ready.rkey,
                base: ready.base,
                len: len as u64,
                block_bytes: block_bytes as u64,
            },
        };
        tracing::debug!(name = %me.name, version = %ready.version, len, "UCX data plane started");
        Ok(UcxDataPlane {
            thread,
            region: Arc::new(region),
            me,
            version: ready.version,
        })
    }

    /// The plane's memory as a block region: give it to the runtime as its KV pool.
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// What peers need to reach this plane's region.
    pub fn descriptor(&self) -> &UcxPeer {
        &self.me
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
        self.submit(Direction::Put, request, peer, src, dst, None, deadline)
            .await
    }

    /// [`UcxDataPlane::write`] of one slice of every block (`None`: whole blocks of equal
    /// size on both sides), for pipeline ranks that hold different parts of a block.
    pub async fn write_slice(
        &self,
        request: &RequestId,
        peer: &UcxPeer,
        src: &[BlockId],
        dst: &[BlockId],
        slice: Option<BlockSlice>,
        deadline: Instant,
    ) -> Result<(), DataError> {
        self.submit(Direction::Put, request, peer, src, dst, slice, deadline)
            .await
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
        self.submit(Direction::Get, request, peer, dst, src, None, deadline)
            .await
    }

    /// [`UcxDataPlane::read`] of one slice of every block (`None`: whole blocks).
    pub async fn read_slice(
        &self,
        request: &RequestId,
        peer: &UcxPeer,
        src: &[BlockId],
        dst: &[BlockId],
        slice: Option<BlockSlice>,
        deadline: Instant,
    ) -> Result<(), DataError> {
        self.submit(Direction::Get, request, peer, dst, src, slice, deadline)
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
        slice: Option<BlockSlice>,
        deadline: Instant,
    ) -> Result<(), DataError> {
        let started = Instant::now();
        plan::check_lists(local, remote)?;
        self.region.check_blocks(local)?;
        check_peer(peer, remote, self.region.block_bytes(), slice, direction)?;
        if local.is_empty() {
            return Ok(());
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
            slice,
            deadline,
            reply,
            _slot: slot,
        };
        self.thread
            .tx
            .send(Cmd::Transfer(Box::new(job)))
            .map_err(|_| DataError::PlaneStopped {
                detail: "the UCX thread has exited".into(),
            })?;
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

/// Checks a peer's descriptor, our blocks in it and the slice before anything is posted;
/// returns where in each block the transfer reads and writes.
fn check_peer(
    peer: &UcxPeer,
    remote: &[BlockId],
    block_bytes: usize,
    slice: Option<BlockSlice>,
    direction: Direction,
) -> Result<plan::Sliced, DataError> {
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
    if peer.region.remote_key.is_empty() || peer.region.remote_key.len() > REMOTE_KEY_BYTES_MAX {
        return Err(protocol(format!(
            "remote key of {} bytes",
            peer.region.remote_key.len()
        )));
    }
    let at = match slice {
        None if peer.region.block_bytes != block_bytes as u64 => {
            return Err(DataError::Mismatch {
                detail: format!(
                    "local blocks of {block_bytes} bytes, {}'s of {}",
                    peer.name, peer.region.block_bytes
                ),
            })
        }
        None => BlockSlice::whole(block_bytes),
        Some(slice) => slice,
    };
    let at = plan::Sliced::new(
        at,
        direction == Direction::Put,
        block_bytes,
        peer.region.block_bytes,
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
    block_bytes: usize,
    /// The device whose context the thread binds before starting UCX.
    cuda_device: Option<u32>,
    options: ContextOptions,
}

/// Everything the thread owns. The memory is `ManuallyDrop`: it is unmapped only on an
/// orderly stop, never by an unwinding panic while a `Region` may still point at it
/// (its `Rc` on the context then also keeps the context alive). A device buffer is
/// `ManuallyDrop` for the same reason: it is released only after its registration.
struct State {
    worker: Worker,
    memory: ManuallyDrop<MemoryRegion>,
    device: ManuallyDrop<Option<Arc<DeviceBuffer>>>,
    /// The bound CUDA context, retained while the thread runs.
    _cuda: Option<DeviceContext>,
    block_bytes: usize,
    endpoints: HashMap<Vec<u8>, Endpoint>,
    /// Keyed by (worker address, packed key, base, len).
    rkeys: HashMap<(Vec<u8>, Vec<u8>, u64, u64), RemoteKey>,
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
        while state.worker.progress() > 0 {}
        let cmd = if Instant::now() < busy_until {
            match rx.try_recv() {
                Ok(cmd) => cmd,
                Err(mpsc::TryRecvError::Empty) => continue,
                Err(mpsc::TryRecvError::Disconnected) => break,
            }
        } else {
            match rx.recv_timeout(UCX_IDLE_PROGRESS_INTERVAL) {
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
        block_bytes,
        cuda_device,
        options,
    } = setup;
    // Before UCX starts: its CUDA transports look for a current context when they load.
    let cuda = cuda_device.map(bind_device_to_thread).transpose()?;
    let ctx = Context::with_options(&options)?;
    let worker = Worker::new(&ctx)?;
    let (memory, device) = match memory {
        Memory::Allocate(len) => {
            let memory = MemoryRegion::allocate(&ctx, len, MemoryType::Host)?;
            // Zero it (UCX leaves it unspecified) and fault the pages in now, not in the
            // first transfer.
            // SAFETY: `len` bytes of host memory were just mapped at `as_ptr`; no one else
            // has them yet.
            unsafe { std::ptr::write_bytes(memory.as_ptr(), 0, len) };
            (memory, None)
        }
        Memory::Device(buffer, len) => {
            // SAFETY: `len` bytes of device memory (checked against the buffer's length)
            // at the buffer's address stay allocated while `State::device` holds the
            // buffer, which `teardown` releases only after unmapping; no Rust reference
            // can point into device memory.
            let memory = unsafe {
                MemoryRegion::register(&ctx, buffer.addr() as *mut u8, len, MemoryType::Cuda)
            }?;
            (memory, Some(buffer))
        }
    };
    let worker_address = worker.address()?;
    let rkey = memory.pack_rkey()?;
    if worker_address.len() > DATA_DESCRIPTOR_BYTES_MAX || rkey.len() > REMOTE_KEY_BYTES_MAX {
        return Err(DataError::Unsupported {
            what: format!(
                "UCX worker address of {} bytes (max {DATA_DESCRIPTOR_BYTES_MAX}) or rkey of {} bytes (max {REMOTE_KEY_BYTES_MAX})",
                worker_address.len(),
                rkey.len()
            ),
        });
    }
    let up = Ready {
        ptr: memory.as_ptr() as usize,
        base: memory.address(),
        worker_address,
        rkey,
        version: format!("UCX {} ({})", ctx.version(), ctx.library()),
    };
    let state = State {
        worker,
        memory: ManuallyDrop::new(memory),
        device: ManuallyDrop::new(device),
        _cuda: cuda,
        block_bytes,
        endpoints: HashMap::new(),
        rkeys: HashMap::new(),
    };
    Ok((state, up))
}

fn teardown(mut state: State) {
    // Keys before endpoints before memory before worker, as UCX wants.
    state.rkeys.clear();
    state.endpoints.clear();
    // SAFETY: every `Region` over this memory is gone (we got `Stop` or were never
    // handed out), and no operation is in flight (each job waits for its own).
    unsafe { ManuallyDrop::drop(&mut state.memory) };
    // SAFETY: dropped once, after the registration above is gone.
    unsafe { ManuallyDrop::drop(&mut state.device) };
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
        // Checked again on this side of the queue: nothing unchecked is ever posted.
        let at = check_peer(
            peer,
            &job.remote,
            self.block_bytes,
            job.slice,
            job.direction,
        )?;
        let blocks = (self.memory.len() / self.block_bytes) as u64;
        if let Some(b) = job.local.iter().find(|b| u64::from(b.0) >= blocks) {
            return Err(DataError::Region(crate::region::RegionError::OutOfRange {
                block: *b,
                blocks: blocks as u32,
            }));
        }
        let segments: Vec<Segment> = plan::sliced_pieces(&job.local, &job.remote, &at)
            .into_iter()
            .map(|p| Segment {
                local_offset: p.local,
                remote_addr: peer.region.base + p.remote,
                len: p.len,
            })
            .collect();
        self.connect(peer)?;
        let address = &peer.worker_address;
        let key = (
            address.clone(),
            peer.region.remote_key.clone(),
            peer.region.base,
            peer.region.len,
        );
        let result = match (self.endpoints.get(address), self.rkeys.get(&key)) {
            (Some(ep), Some(rkey)) => {
                ep.transfer(job.direction, &self.memory, rkey, &segments, job.deadline)
            }
            _ => Err(UcxError::InvalidArgument {
                what: "endpoint or key missing after connect".into(),
            }),
        };
        match result {
            Ok(_) => Ok(()),
            Err(error) => {
                // A failed or timed-out endpoint is force-closed: forget it (and its keys)
                // so a restarted peer gets a fresh one.
                self.forget(address);
                Err(ucx_error(peer, error, started))
            }
        }
    }

    /// Makes sure an endpoint to the peer and its region's key exist (and are live).
    fn connect(&mut self, peer: &UcxPeer) -> Result<(), DataError> {
        let address = &peer.worker_address;
        if self
            .endpoints
            .get(address)
            .is_some_and(|ep| ep.error().is_some())
        {
            self.forget(address);
        }
        if !self.endpoints.contains_key(address) {
            if self.endpoints.len() >= UCX_ENDPOINTS_MAX {
                let victim = self.endpoints.keys().next().cloned();
                if let Some(victim) = victim {
                    self.forget(&victim);
                }
            }
            let ep = self
                .worker
                .connect(address)
                .map_err(|e| ucx_error(peer, e, Instant::now()))?;
            self.endpoints.insert(address.clone(), ep);
        }
        let key = (
            address.clone(),
            peer.region.remote_key.clone(),
            peer.region.base,
            peer.region.len,
        );
        if !self.rkeys.contains_key(&key) {
            if self.rkeys.len() >= UCX_RKEYS_MAX {
                self.rkeys.clear();
            }
            let ep = self
                .endpoints
                .get(address)
                .ok_or_else(|| DataError::PlaneStopped {
                    detail: "endpoint vanished".into(),
                })?;
            let rkey = ep
                .unpack_rkey(&peer.region.remote_key, peer.region.base, peer.region.len)
                .map_err(|e| ucx_error(peer, e, Instant::now()))?;
            self.rkeys.insert(key, rkey);
        }
        Ok(())
    }

    fn forget(&mut self, address: &[u8]) {
        self.rkeys.retain(|(a, ..), _| a.as_slice() != address);
        self.endpoints.remove(address);
    }
}

/// Names the peer in a UCX failure.
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
        UcxError::OutOfRange { .. } => DataError::Protocol {
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
