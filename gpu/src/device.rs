//! Device memory through cudarc: the CUDA side of [`KvBuffer`].

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

use crate::buffer::{checked_range, KvBuffer};
use crate::probe::{device_count, guarded, init_driver};
use crate::{GpuError, MemoryKind};

/// A CUDA device allocation that this type owns and frees (when dropped, on its stream).
///
/// Allocated by GPU tests, examples and benchmarks. Copies to and from it are
/// synchronous: each returns once the bytes have landed, so callers never race the
/// device. That costs speed, which is fine: this type serves setup and verification, not
/// the timed data path (transports read and write the memory directly by address).
#[derive(Debug)]
pub struct DeviceBuffer {
    slice: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    ordinal: u32,
    addr: u64,
}

impl DeviceBuffer {
    /// Allocates `len` zeroed bytes on device `ordinal`, retaining that device's primary
    /// context (the one the CUDA runtime, and so PyTorch, also uses).
    ///
    /// # Errors
    /// The probe errors ([`GpuError::NoDriver`], [`GpuError::NoDevice`]) on machines
    /// without a GPU, [`GpuError::NoSuchDevice`], [`GpuError::EmptyBuffer`], and
    /// [`GpuError::Driver`] (e.g. `CUDA_ERROR_OUT_OF_MEMORY`).
    pub fn alloc_zeroed(ordinal: u32, len: usize) -> Result<Self, GpuError> {
        if len == 0 {
            return Err(GpuError::EmptyBuffer);
        }
        init_driver()?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(GpuError::NoSuchDevice { ordinal, count });
        }
        // `ordinal < count <= DEVICE_COUNT_MAX`, so it fits a usize.
        let context = guarded("cuDevicePrimaryCtxRetain", || {
            CudaContext::new(ordinal as usize)
        })?;
        let stream = context.default_stream();
        let slice = guarded("cuMemAlloc", || stream.alloc_zeros::<u8>(len))?;
        let addr = {
            let (ptr, _record) = slice.device_ptr(&stream);
            ptr
        };
        let buffer = Self {
            slice,
            stream,
            ordinal,
            addr,
        };
        buffer.synchronize()?;
        Ok(buffer)
    }

    /// The device this memory is on.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Waits for the stream, then reports any error cudarc recorded on the way (its
    /// destructors and event bookkeeping record errors instead of returning them).
    fn synchronize(&self) -> Result<(), GpuError> {
        guarded("cuStreamSynchronize", || self.stream.synchronize())?;
        guarded("deferred CUDA error", || self.stream.context().check_err())
    }
}

impl KvBuffer for DeviceBuffer {
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Cuda
    }

    fn len(&self) -> usize {
        self.slice.len()
    }

    fn addr(&self) -> u64 {
        self.addr
    }

    fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        let range = checked_range(offset, dst.len() as u64, self.len())?;
        if range.is_empty() {
            return Ok(());
        }
        let out_of_bounds = out_of_bounds(offset, &range, self.len());
        let view = self.slice.try_slice(range).ok_or(out_of_bounds)?;
        guarded("cuMemcpyDtoHAsync", || self.stream.memcpy_dtoh(&view, dst))?;
        self.synchronize()
    }

    fn write_from(&mut self, offset: u64, src: &[u8]) -> Result<(), GpuError> {
        let range = checked_range(offset, src.len() as u64, self.len())?;
        if range.is_empty() {
            return Ok(());
        }
        let out_of_bounds = out_of_bounds(offset, &range, self.len());
        let stream = &self.stream;
        let mut view = self.slice.try_slice_mut(range).ok_or(out_of_bounds)?;
        guarded("cuMemcpyHtoDAsync", || stream.memcpy_htod(src, &mut view))?;
        self.synchronize()
    }
}

/// The error for a range cudarc refuses after [`checked_range`] accepted it: cannot
/// happen, but is an error value rather than cudarc's `unwrap`.
fn out_of_bounds(offset: u64, range: &std::ops::Range<usize>, buffer_len: usize) -> GpuError {
    GpuError::OutOfBounds {
        offset,
        len: range.len() as u64,
        buffer_len: buffer_len as u64,
    }
}
