//! KV buffers: memory that holds a KV cache (or one region of it), on the host or on a
//! device, behind one trait so that tests, examples and benchmarks treat both alike.

use std::alloc::{self, Layout};
use std::ops::Range;
use std::ptr::NonNull;

use crate::checksum::{fill_pattern, Checksum64};
use crate::{GpuError, MemoryKind};

/// Alignment of host buffers: one page, which is what memory registration for RDMA
/// (`ibv_reg_mr`) and CUDA host pinning (`cuMemHostRegister`) work in.
pub const HOST_ALIGN_BYTES: usize = 4096;
const _: () = assert!(HOST_ALIGN_BYTES.is_power_of_two());

/// The most bytes staged on the host at once when a buffer is filled, copied or
/// checksummed through host memory: large enough that each copy is at full PCIe speed,
/// small enough that verifying a 70 GB cache does not need 70 GB of host memory.
pub const STAGING_BYTES_MAX: usize = 64 << 20;
/// Staging chunks hold whole checksum stripes and pattern words, so chunked work gives
/// the same result as work done in one piece (it would anyway; this keeps it fast).
const _: () = assert!(STAGING_BYTES_MAX % 32 == 0);

/// Memory that holds KV-cache bytes, on the host or on a device.
///
/// Allocated once by a test, example or benchmark; its [`KvBuffer::addr`] and
/// [`KvBuffer::len`] are what a transport registers. Offsets are bytes from the start.
pub trait KvBuffer {
    /// Where the bytes live.
    fn memory_kind(&self) -> MemoryKind;

    /// Length in bytes.
    fn len(&self) -> usize;

    /// Whether the buffer has no bytes (never true for buffers this crate allocates).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The base address: a host pointer, or a `CUdeviceptr`. Valid while `self` lives.
    fn addr(&self) -> u64;

    /// Copies `dst.len()` bytes starting at `offset` into `dst`.
    ///
    /// # Errors
    /// [`GpuError::OutOfBounds`], or a driver error for device buffers.
    fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError>;

    /// Copies `src` into the buffer starting at `offset`.
    ///
    /// # Errors
    /// [`GpuError::OutOfBounds`], or a driver error for device buffers.
    fn write_from(&mut self, offset: u64, src: &[u8]) -> Result<(), GpuError>;

    /// Fills the whole buffer with the pattern of `seed` (see
    /// [`crate::checksum::fill_pattern`]), staging through host memory in chunks.
    ///
    /// # Errors
    /// Those of [`KvBuffer::write_from`].
    fn fill_pattern(&mut self, seed: u64) -> Result<(), GpuError> {
        let mut staging = vec![0u8; self.len().min(STAGING_BYTES_MAX)];
        for chunk in chunks(0, self.len() as u64) {
            let staged = &mut staging[..chunk.len];
            fill_pattern(staged, seed, chunk.offset);
            self.write_from(chunk.offset, staged)?;
        }
        Ok(())
    }

    /// Feeds `len` bytes from `offset` into `checksum`, copying them back to the host in
    /// chunks of at most [`STAGING_BYTES_MAX`].
    ///
    /// # Errors
    /// Those of [`KvBuffer::read_into`].
    fn checksum_into(
        &self,
        offset: u64,
        len: u64,
        checksum: &mut Checksum64,
    ) -> Result<(), GpuError> {
        checked_range(offset, len, self.len())?;
        let mut staging = vec![
            0u8;
            usize::try_from(len)
                .unwrap_or(usize::MAX)
                .min(STAGING_BYTES_MAX)
        ];
        for chunk in chunks(offset, len) {
            let staged = &mut staging[..chunk.len];
            self.read_into(chunk.offset, staged)?;
            checksum.update(staged);
        }
        Ok(())
    }

    /// The checksum of `len` bytes from `offset`: equal for equal bytes, whatever the
    /// memory kind.
    ///
    /// # Errors
    /// Those of [`KvBuffer::read_into`].
    fn checksum(&self, offset: u64, len: u64) -> Result<u64, GpuError> {
        let mut checksum = Checksum64::new();
        self.checksum_into(offset, len, &mut checksum)?;
        Ok(checksum.finish())
    }
}

/// One staging step: `len` bytes at `offset`.
struct Chunk {
    offset: u64,
    len: usize,
}

/// Splits `len` bytes from `offset` into staging-sized chunks.
fn chunks(offset: u64, len: u64) -> impl Iterator<Item = Chunk> {
    let step = STAGING_BYTES_MAX as u64;
    (0..len.div_ceil(step)).map(move |i| Chunk {
        offset: offset + i * step,
        // Each chunk is at most STAGING_BYTES_MAX, which is a usize.
        len: (len - i * step).min(step) as usize,
    })
}

/// `offset..offset + len` as an index range, if it lies within `buffer_len` bytes.
pub(crate) fn checked_range(
    offset: u64,
    len: u64,
    buffer_len: usize,
) -> Result<Range<usize>, GpuError> {
    let out_of_bounds = GpuError::OutOfBounds {
        offset,
        len,
        buffer_len: buffer_len as u64,
    };
    let end = offset.checked_add(len).ok_or(out_of_bounds.clone())?;
    match (usize::try_from(offset), usize::try_from(end)) {
        (Ok(start), Ok(end)) if end <= buffer_len => Ok(start..end),
        _ => Err(out_of_bounds),
    }
}

/// A page-aligned, zero-initialised host allocation that this type owns and frees.
///
/// For host-memory KV caches in tests, examples and the TCP fallback. Plain pageable
/// memory: pinning (for DMA from a GPU) is the registering transport's business.
#[derive(Debug)]
pub struct HostBuffer {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: `HostBuffer` owns its allocation exclusively, like a `Box<[u8]>`; reads go
// through `&self` and writes through `&mut self`, so the borrow rules keep access sound
// across threads.
unsafe impl Send for HostBuffer {}
// SAFETY: as above; there is no interior mutability.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zeroed bytes aligned to [`HOST_ALIGN_BYTES`].
    ///
    /// # Errors
    /// [`GpuError::EmptyBuffer`] for `len == 0`, [`GpuError::Overflow`] for a size no
    /// allocation can have, [`GpuError::HostAlloc`] when the allocator fails.
    pub fn alloc_zeroed(len: usize) -> Result<Self, GpuError> {
        if len == 0 {
            return Err(GpuError::EmptyBuffer);
        }
        let layout =
            Layout::from_size_align(len, HOST_ALIGN_BYTES).map_err(|_| GpuError::Overflow {
                what: "host allocation size",
            })?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(GpuError::HostAlloc { bytes: len })?;
        Ok(Self { ptr, layout })
    }

    /// All the bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `layout.size()` initialised (zeroed at allocation)
        // bytes that we own, and `&self` forbids writes for the borrow's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    /// All the bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }

    /// The bytes of one range.
    ///
    /// # Errors
    /// [`GpuError::OutOfBounds`].
    pub fn bytes(&self, offset: u64, len: u64) -> Result<&[u8], GpuError> {
        let range = checked_range(offset, len, self.len())?;
        Ok(&self.as_slice()[range])
    }

    /// The bytes of one range, writable.
    ///
    /// # Errors
    /// [`GpuError::OutOfBounds`].
    pub fn bytes_mut(&mut self, offset: u64, len: u64) -> Result<&mut [u8], GpuError> {
        let range = checked_range(offset, len, self.len())?;
        Ok(&mut self.as_mut_slice()[range])
    }

    /// The base pointer, for registration with a transport.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The base pointer, writable, for registration with a transport.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed(self.layout)` and is freed only here.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl KvBuffer for HostBuffer {
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Host
    }

    fn len(&self) -> usize {
        self.layout.size()
    }

    fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        dst.copy_from_slice(self.bytes(offset, dst.len() as u64)?);
        Ok(())
    }

    fn write_from(&mut self, offset: u64, src: &[u8]) -> Result<(), GpuError> {
        self.bytes_mut(offset, src.len() as u64)?
            .copy_from_slice(src);
        Ok(())
    }

    fn fill_pattern(&mut self, seed: u64) -> Result<(), GpuError> {
        fill_pattern(self.as_mut_slice(), seed, 0);
        Ok(())
    }

    /// Hashes in place: host bytes need no staging copy.
    fn checksum_into(
        &self,
        offset: u64,
        len: u64,
        checksum: &mut Checksum64,
    ) -> Result<(), GpuError> {
        checksum.update(self.bytes(offset, len)?);
        Ok(())
    }
}
