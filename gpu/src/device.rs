//! Device memory through cudarc: the CUDA side of [`KvBuffer`], the device-to-device copy
//! that GPU benchmarks measure transports against, and binding a device's context to a
//! thread (which a transport's I/O thread needs before it touches CUDA memory).

use std::sync::Arc;

use cudarc::driver::{result as cu, CudaContext, CudaStream};

use crate::buffer::{checked_range, KvBuffer};
use crate::probe::{device_count, guarded, init_driver};
use crate::{GpuError, MemoryKind};

/// Most copies one [`DeviceBuffer::copy_to`] call may enqueue: a plan bigger than this
/// is a caller's mistake, not a workload (a 4 GiB region holds 262,144 16 KiB blocks).
pub const COPIES_PER_CALL_MAX: usize = 1 << 22;

/// A device's primary context, made current on the thread that asked for it.
///
/// Made by [`bind_device_to_thread`]. Keeps the primary context retained while it lives,
/// so a thread that holds one can keep calling into CUDA (and into libraries such as UCX
/// that call CUDA on its behalf). Dropping it releases the retention, not the binding.
#[derive(Debug)]
pub struct DeviceContext {
    /// Held only to keep the primary context retained.
    _context: Arc<CudaContext>,
    ordinal: u32,
}

impl DeviceContext {
    /// The device this context belongs to.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }
}

/// Retains device `ordinal`'s primary context (the one the CUDA runtime, and so PyTorch,
/// also uses) and makes it current on the calling thread.
///
/// # Errors
/// The probe errors ([`GpuError::NoDriver`], [`GpuError::NoDevice`]),
/// [`GpuError::NoSuchDevice`], and [`GpuError::Driver`].
pub fn bind_device_to_thread(ordinal: u32) -> Result<DeviceContext, GpuError> {
    let context = primary_context(ordinal)?;
    guarded("cuCtxSetCurrent", || context.bind_to_thread())?;
    Ok(DeviceContext {
        _context: context,
        ordinal,
    })
}

pub(crate) fn primary_context(ordinal: u32) -> Result<Arc<CudaContext>, GpuError> {
    init_driver()?;
    let count = device_count()?;
    if ordinal >= count {
        return Err(GpuError::NoSuchDevice { ordinal, count });
    }
    // `ordinal < count <= DEVICE_COUNT_MAX`, so it fits a usize.
    guarded("cuDevicePrimaryCtxRetain", || {
        CudaContext::new(ordinal as usize)
    })
}

/// A CUDA device allocation (`cuMemAlloc`) that this type owns and frees (`cuMemFree`).
///
/// Plain `cuMemAlloc` memory, not a stream-ordered pool allocation (`cuMemAllocAsync`,
/// which cudarc's own allocations use where the device supports it): PyTorch's caching
/// allocator, and so an engine's KV cache, is `cudaMalloc` memory, and only that kind can
/// be shared with another process through `cuIpcGetMemHandle`, which UCX's `cuda_ipc`
/// transport uses between processes on one GPU.
///
/// Allocated by GPU tests, examples, benchmarks and the worker's `--memory cuda`. Copies
/// to and from it are synchronous: each returns once the bytes have landed, so callers
/// never race the device. That costs speed, which is fine: this type serves setup and
/// verification, not the timed data path (transports read and write the memory directly
/// by address).
///
/// Copies take `&self` ([`DeviceBuffer::read_at`], [`DeviceBuffer::write_at`]) because a
/// registered buffer is shared between its owner and a transport, like a host region:
/// device memory is never behind a Rust reference, and the owner keeps the block
/// ownership contract (one live request per block) that makes concurrent copies into
/// different blocks sound.
#[derive(Debug)]
pub struct DeviceBuffer {
    /// The device address (`CUdeviceptr`) of `len` bytes we allocated.
    addr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    ordinal: u32,
}

impl DeviceBuffer {
    /// Allocates `len` zeroed bytes on device `ordinal`, retaining that device's primary
    /// context.
    ///
    /// # Errors
    /// The probe errors ([`GpuError::NoDriver`], [`GpuError::NoDevice`]) on machines
    /// without a GPU, [`GpuError::NoSuchDevice`], [`GpuError::EmptyBuffer`], and
    /// [`GpuError::Driver`] (e.g. `CUDA_ERROR_OUT_OF_MEMORY`).
    pub fn alloc_zeroed(ordinal: u32, len: usize) -> Result<Self, GpuError> {
        if len == 0 {
            return Err(GpuError::EmptyBuffer);
        }
        let context = primary_context(ordinal)?;
        guarded("cuCtxSetCurrent", || context.bind_to_thread())?;
        // SAFETY: a plain allocation in the current context (bound above); the pointer is
        // owned by the buffer made just below, which frees it once, on drop.
        let addr = guarded("cuMemAlloc", || unsafe { cu::malloc_sync(len) })?;
        let buffer = Self {
            addr,
            len,
            stream: context.default_stream(),
            ordinal,
        };
        // SAFETY: `len` bytes at `addr` were just allocated; nothing else uses them yet.
        guarded("cuMemsetD8", || unsafe { cu::memset_d8_sync(addr, 0, len) })?;
        buffer.synchronize()?;
        Ok(buffer)
    }

    /// The device this memory is on.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Copies `dst.len()` bytes from `offset` to the host, and waits for them.
    ///
    /// # Errors
    /// [`GpuError::OutOfBounds`] (nothing copied), [`GpuError::Driver`].
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        let range = checked_range(offset, dst.len() as u64, self.len())?;
        // SAFETY: `range` lies inside our allocation (checked), which lives as long as
        // `self`.
        unsafe { read_device(&self.stream, self.addr + range.start as u64, dst) }
    }

    /// Copies `src` to the device at `offset`, and waits for it.
    ///
    /// # Errors
    /// [`GpuError::OutOfBounds`] (nothing copied), [`GpuError::Driver`].
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), GpuError> {
        let range = checked_range(offset, src.len() as u64, self.len())?;
        // SAFETY: as in `read_at`.
        unsafe { write_device(&self.stream, self.addr + range.start as u64, src) }
    }

    /// Copies `len` bytes from each `(src offset, dst offset)` pair of `pairs` into `dst`
    /// with `cuMemcpyDtoDAsync`, all enqueued on this buffer's stream, then waits for them:
    /// the device-to-device reference that GPU benchmarks compare transports against.
    ///
    /// # Errors
    /// [`GpuError::TooManyBlocks`], [`GpuError::OutOfBounds`] (every pair is checked
    /// before the first copy, so a bad plan copies nothing), [`GpuError::Driver`].
    pub fn copy_to(
        &self,
        dst: &DeviceBuffer,
        pairs: &[(u64, u64)],
        len: u64,
    ) -> Result<(), GpuError> {
        if pairs.len() > COPIES_PER_CALL_MAX {
            return Err(GpuError::TooManyBlocks {
                count: pairs.len(),
                max: COPIES_PER_CALL_MAX,
            });
        }
        let bytes = usize::try_from(len).map_err(|_| GpuError::Overflow {
            what: "copy length",
        })?;
        for &(from, to) in pairs {
            checked_range(from, len, self.len())?;
            checked_range(to, len, dst.len())?;
        }
        self.bind()?;
        for &(from, to) in pairs {
            // SAFETY: both ranges were checked to lie inside their allocations, which
            // live until the synchronize below returns (we borrow both buffers).
            guarded("cuMemcpyDtoDAsync", || unsafe {
                cu::memcpy_dtod_async(
                    dst.addr + to,
                    self.addr + from,
                    bytes,
                    self.stream.cu_stream(),
                )
            })?;
        }
        self.synchronize()
    }

    /// Makes this buffer's context current on the calling thread (raw driver calls need it).
    fn bind(&self) -> Result<(), GpuError> {
        bind_stream(&self.stream)
    }

    /// Waits for the stream, then reports any error cudarc recorded on the way.
    fn synchronize(&self) -> Result<(), GpuError> {
        synchronize_stream(&self.stream)
    }
}

/// Copies between host memory and device memory named by address, for memory the engine
/// allocated (its KV cache tensors), which no [`DeviceBuffer`] owns.
///
/// Made once per registered device region ([`DeviceCopier::new`]); every copy goes through
/// the device's primary context (the one PyTorch uses) on one stream of its own and is
/// waited for before the call returns, like [`DeviceBuffer::read_at`]. Setup, staging and
/// verification use it; one-sided transports move device bytes without it.
#[derive(Debug)]
pub struct DeviceCopier {
    stream: Arc<CudaStream>,
    ordinal: u32,
}

impl DeviceCopier {
    /// A copier for device `ordinal`, retaining its primary context.
    ///
    /// # Errors
    /// The probe errors ([`GpuError::NoDriver`], [`GpuError::NoDevice`]),
    /// [`GpuError::NoSuchDevice`], [`GpuError::Driver`].
    pub fn new(ordinal: u32) -> Result<Self, GpuError> {
        let context = primary_context(ordinal)?;
        guarded("cuCtxSetCurrent", || context.bind_to_thread())?;
        Ok(Self {
            stream: context.default_stream(),
            ordinal,
        })
    }

    /// A copier on a stream of its own (non-blocking: it does not wait for, or hold up,
    /// work on the context's legacy default stream, where an engine's kernels may run),
    /// as the transports' own copies want: their bytes are ready before they are asked.
    ///
    /// # Errors
    /// As [`DeviceCopier::new`].
    pub fn on_own_stream(ordinal: u32) -> Result<Self, GpuError> {
        let context = primary_context(ordinal)?;
        let stream = guarded("cuStreamCreate", || context.new_stream())?;
        Ok(Self { stream, ordinal })
    }

    /// The device this copier copies on.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Copies `dst.len()` bytes at device address `addr` to the host, and waits for them.
    ///
    /// # Safety
    /// `addr..addr + dst.len()` must be device memory of this copier's device that stays
    /// allocated for the call.
    ///
    /// # Errors
    /// [`GpuError::Driver`].
    pub unsafe fn read(&self, addr: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        // SAFETY: the caller's contract.
        unsafe { read_device(&self.stream, addr, dst) }
    }

    /// Copies `src` to device address `addr`, and waits for it.
    ///
    /// # Safety
    /// As [`DeviceCopier::read`]; nothing else may write those bytes meanwhile.
    ///
    /// # Errors
    /// [`GpuError::Driver`].
    pub unsafe fn write(&self, addr: u64, src: &[u8]) -> Result<(), GpuError> {
        // SAFETY: the caller's contract.
        unsafe { write_device(&self.stream, addr, src) }
    }
}

fn bind_stream(stream: &CudaStream) -> Result<(), GpuError> {
    guarded("cuCtxSetCurrent", || stream.context().bind_to_thread())
}

/// Waits for the stream, then reports any error cudarc recorded on the way (its
/// destructors and event bookkeeping record errors instead of returning them).
fn synchronize_stream(stream: &CudaStream) -> Result<(), GpuError> {
    guarded("cuStreamSynchronize", || stream.synchronize())?;
    guarded("deferred CUDA error", || stream.context().check_err())
}

/// Device-to-host copy of `dst.len()` bytes at `addr` on `stream`, waited for.
///
/// # Safety
/// `addr..addr + dst.len()` is allocated device memory of the stream's context for the call.
unsafe fn read_device(stream: &CudaStream, addr: u64, dst: &mut [u8]) -> Result<(), GpuError> {
    if dst.is_empty() {
        return Ok(());
    }
    bind_stream(stream)?;
    // SAFETY: the caller's contract for the device side; `dst` is a host slice of exactly
    // that length that stays borrowed until the synchronize below has waited for the copy.
    guarded("cuMemcpyDtoHAsync", || unsafe {
        cu::memcpy_dtoh_async(dst, addr, stream.cu_stream())
    })?;
    synchronize_stream(stream)
}

/// Host-to-device copy of `src` to `addr` on `stream`, waited for.
///
/// # Safety
/// As [`read_device`].
unsafe fn write_device(stream: &CudaStream, addr: u64, src: &[u8]) -> Result<(), GpuError> {
    if src.is_empty() {
        return Ok(());
    }
    bind_stream(stream)?;
    // SAFETY: as in `read_device`, in the other direction.
    guarded("cuMemcpyHtoDAsync", || unsafe {
        cu::memcpy_htod_async(addr, src, stream.cu_stream())
    })?;
    synchronize_stream(stream)
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Finish any copy still queued on our stream, then free on the owning context.
        let freed = self
            .bind()
            .and_then(|()| self.synchronize())
            .and_then(|()| {
                // SAFETY: `addr` came from `cuMemAlloc` in this context and is freed only here;
                // the synchronize above waited for every copy this type enqueued.
                guarded("cuMemFree", || unsafe { cu::free_sync(self.addr) })
            });
        if let Err(error) = freed {
            tracing::warn!(%error, ordinal = self.ordinal, bytes = self.len, "freeing device memory failed");
        }
    }
}

impl KvBuffer for DeviceBuffer {
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Cuda
    }

    fn len(&self) -> usize {
        self.len
    }

    fn addr(&self) -> u64 {
        self.addr
    }

    fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        self.read_at(offset, dst)
    }

    fn write_from(&mut self, offset: u64, src: &[u8]) -> Result<(), GpuError> {
        self.write_at(offset, src)
    }
}

/// The device allocation that holds `addr`, as `(start, len)`, when the driver knows
/// `addr` as device memory in this process (its own allocations, and those another
/// process's allocation mapped here by CUDA IPC); `Ok(None)` when it does not (host memory,
/// an unmapped address). A remote key reached by pointer into device memory is checked
/// against this, as a shared mapping is for host memory.
///
/// # Errors
/// The probe errors ([`GpuError::NoDriver`], [`GpuError::NoDevice`]) and
/// [`GpuError::Driver`] for a failure other than "not a device pointer".
pub fn device_allocation(addr: u64) -> Result<Option<(u64, u64)>, GpuError> {
    use cudarc::driver::sys;
    init_driver()?;
    let attribute = |attribute: sys::CUpointer_attribute| -> Result<Option<u64>, GpuError> {
        let mut value: u64 = 0;
        let result = guarded("cuPointerGetAttribute", || {
            // SAFETY: the attributes asked for here write at most 8 bytes (a
            // `CUmemorytype`, a `CUdeviceptr`, a `size_t`) into `value`, which has 8.
            let code =
                unsafe { sys::cuPointerGetAttribute((&raw mut value).cast(), attribute, addr) };
            Ok(code)
        })?;
        match result {
            sys::CUresult::CUDA_SUCCESS => Ok(Some(value)),
            // Memory the driver does not know: not a device pointer.
            sys::CUresult::CUDA_ERROR_INVALID_VALUE => Ok(None),
            code => Err(GpuError::Driver {
                call: "cuPointerGetAttribute",
                code: code as u32,
                name: format!("{code:?}"),
            }),
        }
    };
    let Some(kind) = attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE)? else {
        return Ok(None);
    };
    if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u64 {
        return Ok(None);
    }
    let start = attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)?;
    let len = attribute(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE)?;
    Ok(start.zip(len))
}
