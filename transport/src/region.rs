//! Memory regions cut into equal blocks: a worker's KV pool as the runtime and its
//! transports see it, in host memory or in CUDA device memory.
//!
//! A region is shared between the engine (which fills and reads blocks) and the runtime
//! (which copies blocks on the engine's behalf), so it hands out copies and takes writes
//! through `&self`. The contract that makes this sound is the one every KV-cache allocator
//! already keeps: a block belongs to at most one live request at a time, so two writers
//! never touch the same block at once.
//!
//! A device region ([`Region::on_device`]) is never dereferenced by the CPU: its block
//! reads and writes are explicit copies through the driver ([`DeviceBuffer::read_at`],
//! [`DeviceBuffer::write_at`]), and [`Region::host_ptr`], which the TCP transport moves
//! bytes through, is an error ([`RegionError::NotHostMemory`]) for it. One-sided
//! transports (UCX) register it by address and move its bytes on the device side.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

use handoff_gpu::{DeviceBuffer, GpuError, KvBuffer, MemoryKind};

use crate::types::{BlockId, RankInfo};

/// Largest region this type allocates: 64 GiB, more than one GPU's KV cache, so that a
/// mistaken size fails with a named error instead of exhausting host memory.
pub const REGION_BYTES_MAX: usize = 64 << 30;

/// Errors from region construction and block access.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum RegionError {
    /// The block count or block size was zero, or their product overflowed or passed
    /// [`REGION_BYTES_MAX`].
    #[error("bad region size: {blocks} blocks of {block_bytes} bytes")]
    BadSize {
        /// Blocks asked for.
        blocks: u32,
        /// Bytes per block asked for.
        block_bytes: usize,
    },
    /// A block id at or past the end of the region.
    #[error("block {block} out of range: region has {blocks} blocks")]
    OutOfRange {
        /// The block asked for.
        block: BlockId,
        /// Blocks in the region.
        blocks: u32,
    },
    /// Data of the wrong length for one block.
    #[error("block data is {got} bytes, blocks are {want} bytes")]
    WrongLength {
        /// Length given.
        got: usize,
        /// Block size.
        want: usize,
    },
    /// Two regions with different block sizes, or block lists of different lengths.
    #[error("mismatched copy: {detail}")]
    Mismatch {
        /// What differed.
        detail: String,
    },
    /// A CPU access (`op`) to a region in device memory, which only copies through the
    /// driver and one-sided transports can reach.
    #[error("{op} needs host memory, but this region is CUDA memory on device {device}")]
    NotHostMemory {
        /// What was asked for.
        op: &'static str,
        /// The device the region is on.
        device: u32,
    },
    /// A device region larger than the buffer it was made over.
    #[error(
        "{blocks} blocks of {block_bytes} bytes do not fit a device buffer of {buffer_len} bytes"
    )]
    DeviceTooSmall {
        /// Blocks asked for.
        blocks: u32,
        /// Bytes per block asked for.
        block_bytes: usize,
        /// The buffer's length.
        buffer_len: usize,
    },
    /// A copy to or from device memory failed in the driver.
    #[error("device copy failed: {0}")]
    Device(#[from] GpuError),
}

/// The part of a pipeline-parallel KV block that one rank holds.
///
/// With pipeline parallelism each rank holds its own layers of every block. Blocks are
/// layer-major (`[layers, 2, tokens, heads, head_dim]`, as
/// `handoff_gpu::LayoutKind::BlockContiguous`), so a rank's layers are one contiguous
/// byte range of the whole block: rank `pp_rank` of `pp_size` holds `block_bytes` bytes at
/// offset `pp_rank × block_bytes` of a whole block of `pp_size × block_bytes` bytes. Layers
/// split evenly across ranks; an uneven split is refused by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PipelinePart {
    /// This rank's pipeline stage.
    pub pp_rank: u32,
    /// Pipeline stages.
    pub pp_size: u32,
    /// Bytes of each block this rank holds (its region's block size).
    pub block_bytes: usize,
}

impl PipelinePart {
    /// The byte range of a whole block this part holds.
    fn range(&self) -> Result<Range<usize>, RegionError> {
        let bad = || RegionError::Mismatch {
            detail: format!(
                "pipeline rank {} of {} with {}-byte blocks",
                self.pp_rank, self.pp_size, self.block_bytes
            ),
        };
        if self.pp_size == 0 || self.pp_rank >= self.pp_size || self.block_bytes == 0 {
            return Err(bad());
        }
        let start = (self.pp_rank as usize)
            .checked_mul(self.block_bytes)
            .ok_or_else(bad)?;
        let end = start.checked_add(self.block_bytes).ok_or_else(bad)?;
        Ok(start..end)
    }

    /// Bytes in a whole block (every stage's part together).
    fn whole_bytes(&self) -> Option<usize> {
        (self.pp_size as usize).checked_mul(self.block_bytes)
    }
}

/// Which bytes of each block a transfer moves: `len` bytes from `src_offset` of every
/// source block to `dst_offset` of its destination block. Whole blocks
/// ([`BlockSlice::whole`]) unless the two sides hold different pipeline parts of a block
/// ([`BlockSlice::between`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockSlice {
    /// Offset in each source block.
    pub src_offset: usize,
    /// Offset in each destination block.
    pub dst_offset: usize,
    /// Bytes moved per block.
    pub len: usize,
}

impl BlockSlice {
    /// Whole blocks of `block_bytes` on both sides.
    pub fn whole(block_bytes: usize) -> Self {
        Self {
            src_offset: 0,
            dst_offset: 0,
            len: block_bytes,
        }
    }

    /// The bytes of each block that a source holding `src` and a destination holding
    /// `dst` have in common; `None` when they share no layer (nothing to move).
    ///
    /// # Errors
    /// [`RegionError::Mismatch`] when the two sides disagree on the whole block's size
    /// (different models, or layers not split evenly), or a part is malformed.
    pub fn between(src: PipelinePart, dst: PipelinePart) -> Result<Option<Self>, RegionError> {
        let (a, b) = (src.range()?, dst.range()?);
        if src.whole_bytes() != dst.whole_bytes() {
            return Err(RegionError::Mismatch {
                detail: format!(
                    "whole blocks differ: source holds {} bytes as pipeline rank {} of {}, destination {} bytes as rank {} of {} (layers must split evenly across pipeline ranks)",
                    src.block_bytes, src.pp_rank, src.pp_size, dst.block_bytes, dst.pp_rank, dst.pp_size
                ),
            });
        }
        let (start, end) = (a.start.max(b.start), a.end.min(b.end));
        Ok((start < end).then(|| Self {
            src_offset: start - a.start,
            dst_offset: start - b.start,
            len: end - start,
        }))
    }

    /// [`BlockSlice::between`] two ranks, each with its region's block size: `Ok(None)`
    /// when they share no layer, `Ok(Some(whole))` between ranks without pipeline
    /// parallelism.
    ///
    /// # Errors
    /// Those of [`BlockSlice::between`].
    pub fn for_ranks(
        src: &RankInfo,
        src_block_bytes: usize,
        dst: &RankInfo,
        dst_block_bytes: usize,
    ) -> Result<Option<Self>, RegionError> {
        let part = |rank: &RankInfo, block_bytes| PipelinePart {
            pp_rank: rank.pp_rank,
            pp_size: rank.pp_size,
            block_bytes,
        };
        Self::between(part(src, src_block_bytes), part(dst, dst_block_bytes))
    }

    /// Checks that the slice lies inside blocks of `src_block_bytes` and `dst_block_bytes`.
    ///
    /// # Errors
    /// [`RegionError::Mismatch`].
    pub fn check(&self, src_block_bytes: usize, dst_block_bytes: usize) -> Result<(), RegionError> {
        let fits = |offset: usize, block: usize| {
            offset.checked_add(self.len).is_some_and(|end| end <= block)
        };
        if self.len == 0
            || !fits(self.src_offset, src_block_bytes)
            || !fits(self.dst_offset, dst_block_bytes)
        {
            return Err(RegionError::Mismatch {
                detail: format!(
                    "{} bytes from offset {} of {}-byte source blocks to offset {} of {}-byte destination blocks",
                    self.len, self.src_offset, src_block_bytes, self.dst_offset, dst_block_bytes
                ),
            });
        }
        Ok(())
    }
}

/// Where a region's bytes live.
enum Storage {
    /// Heap memory the region allocated and owns.
    Owned(Box<[UnsafeCell<u8>]>),
    /// Memory someone else allocated (e.g. UCX, so that peers can map it), kept alive by
    /// `_keeper` for as long as the region lives.
    External {
        ptr: NonNull<u8>,
        _keeper: Box<dyn Send + Sync>,
    },
    /// CUDA device memory: reached only through the driver's copies, never dereferenced.
    /// `_keeper` keeps whatever else the region depends on (a transport's registration).
    Device {
        buffer: Arc<DeviceBuffer>,
        _keeper: Option<Box<dyn Send + Sync>>,
    },
}

/// A block-addressed memory region, in host or device memory.
///
/// Made by [`Region::new`] (zeroed heap memory), [`Region::from_external`] (host memory
/// owned by something else, e.g. a UCX allocation that peers can write directly) or
/// [`Region::on_device`] (a CUDA allocation, e.g. an engine's KV cache).
pub struct Region {
    storage: Storage,
    block_bytes: usize,
    blocks: u32,
}

// SAFETY: all access goes through raw byte copies of whole blocks; the module contract
// (a block belongs to one live request at a time) keeps writers of one block exclusive.
unsafe impl Sync for Region {}
// SAFETY: the region owns its bytes (or, for external memory, a `Send` keeper that keeps
// them alive); moving it between threads moves that ownership.
unsafe impl Send for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("memory", &self.memory_kind())
            .field("blocks", &self.blocks)
            .field("block_bytes", &self.block_bytes)
            .finish()
    }
}

impl Region {
    /// Allocates `blocks` zeroed blocks of `block_bytes` each.
    pub fn new(blocks: u32, block_bytes: usize) -> Result<Self, RegionError> {
        let total = Self::total_bytes(blocks, block_bytes)?;
        // `vec![0; n]` asks the allocator for zeroed pages (no per-byte loop, pages
        // faulted in on first touch), then the slice is re-typed as cells.
        let bytes: Box<[u8]> = vec![0u8; total].into_boxed_slice();
        // SAFETY: `UnsafeCell<u8>` is `repr(transparent)` over `u8`, so the two slice types
        // have the same layout; the box's ownership moves unchanged.
        let bytes = unsafe { Box::from_raw(Box::into_raw(bytes) as *mut [UnsafeCell<u8>]) };
        Ok(Self {
            storage: Storage::Owned(bytes),
            block_bytes,
            blocks,
        })
    }

    /// A region over `blocks × block_bytes` bytes of memory at `ptr` that something else
    /// allocated (the UCX data plane uses it so that the engine's blocks are the very memory
    /// peers write into). `keeper` is dropped when the region is, and must keep the memory
    /// mapped until then.
    ///
    /// # Safety
    /// `ptr..ptr + blocks × block_bytes` must be valid, writable host memory that stays
    /// mapped until `keeper` is dropped, and that nothing accesses through Rust references
    /// (other writers, e.g. RDMA peers, follow the block-ownership contract of this module).
    pub unsafe fn from_external(
        ptr: NonNull<u8>,
        blocks: u32,
        block_bytes: usize,
        keeper: Box<dyn Send + Sync>,
    ) -> Result<Self, RegionError> {
        Self::total_bytes(blocks, block_bytes)?;
        Ok(Self {
            storage: Storage::External {
                ptr,
                _keeper: keeper,
            },
            block_bytes,
            blocks,
        })
    }

    /// A region over the first `blocks × block_bytes` bytes of a CUDA allocation. The
    /// region holds the buffer, so the memory lives at least as long as the region.
    ///
    /// # Errors
    /// [`RegionError::BadSize`], [`RegionError::DeviceTooSmall`].
    pub fn on_device(
        buffer: Arc<DeviceBuffer>,
        blocks: u32,
        block_bytes: usize,
    ) -> Result<Self, RegionError> {
        Self::on_device_kept(buffer, blocks, block_bytes, None)
    }

    /// [`Region::on_device`], also holding `keeper` (e.g. a transport's handle that must
    /// outlive every user of the region) until the region drops.
    pub(crate) fn on_device_kept(
        buffer: Arc<DeviceBuffer>,
        blocks: u32,
        block_bytes: usize,
        keeper: Option<Box<dyn Send + Sync>>,
    ) -> Result<Self, RegionError> {
        let total = Self::total_bytes(blocks, block_bytes)?;
        if total > buffer.len() {
            return Err(RegionError::DeviceTooSmall {
                blocks,
                block_bytes,
                buffer_len: buffer.len(),
            });
        }
        Ok(Self {
            storage: Storage::Device {
                buffer,
                _keeper: keeper,
            },
            block_bytes,
            blocks,
        })
    }

    fn total_bytes(blocks: u32, block_bytes: usize) -> Result<usize, RegionError> {
        (blocks as usize)
            .checked_mul(block_bytes)
            .filter(|&t| t > 0 && t <= REGION_BYTES_MAX)
            .ok_or(RegionError::BadSize {
                blocks,
                block_bytes,
            })
    }

    /// The region's length in bytes (`blocks × block_bytes`).
    pub fn len_bytes(&self) -> usize {
        self.blocks as usize * self.block_bytes
    }

    /// Where the bytes live.
    pub fn memory_kind(&self) -> MemoryKind {
        match &self.storage {
            Storage::Owned(_) | Storage::External { .. } => MemoryKind::Host,
            Storage::Device { .. } => MemoryKind::Cuda,
        }
    }

    /// The device buffer under a device region (`None` for host memory).
    pub fn device_buffer(&self) -> Option<&Arc<DeviceBuffer>> {
        match &self.storage {
            Storage::Device { buffer, .. } => Some(buffer),
            Storage::Owned(_) | Storage::External { .. } => None,
        }
    }

    /// The address of the first byte: a host pointer, or a `CUdeviceptr`. For
    /// registration with a transport and for logs; never dereference it.
    pub fn base_addr(&self) -> u64 {
        match &self.storage {
            Storage::Device { buffer, .. } => buffer.addr(),
            Storage::Owned(_) | Storage::External { .. } => self.raw_host_ptr() as u64,
        }
    }

    /// The first byte of a host region, for transports that move bytes without a copy
    /// through a `Vec` (socket reads and writes). Every access through it must stay
    /// inside [`Region::len_bytes`] and follow the module's block-ownership contract.
    ///
    /// # Errors
    /// [`RegionError::NotHostMemory`] for a device region, which the CPU must not touch.
    pub fn host_ptr(&self) -> Result<*mut u8, RegionError> {
        match &self.storage {
            Storage::Device { buffer, .. } => Err(RegionError::NotHostMemory {
                op: "direct CPU access",
                device: buffer.ordinal(),
            }),
            Storage::Owned(_) | Storage::External { .. } => Ok(self.raw_host_ptr()),
        }
    }

    /// The host pointer of a host region; null for a device region (never dereferenced:
    /// every caller matches on the storage first).
    fn raw_host_ptr(&self) -> *mut u8 {
        match &self.storage {
            Storage::Owned(bytes) => UnsafeCell::raw_get(bytes.as_ptr()),
            Storage::External { ptr, .. } => ptr.as_ptr(),
            Storage::Device { .. } => std::ptr::null_mut(),
        }
    }

    /// Number of blocks.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Bytes per block.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The byte range of one block, checked.
    pub fn block_range(&self, block: BlockId) -> Result<Range<usize>, RegionError> {
        if block.0 >= self.blocks {
            return Err(RegionError::OutOfRange {
                block,
                blocks: self.blocks,
            });
        }
        let start = block.0 as usize * self.block_bytes;
        Ok(start..start + self.block_bytes)
    }

    /// Checks every block of a list before anything is touched.
    pub fn check_blocks(&self, blocks: &[BlockId]) -> Result<(), RegionError> {
        blocks
            .iter()
            .try_for_each(|b| self.block_range(*b).map(|_| ()))
    }

    /// The host address of byte `offset`. Callers pass offsets of checked block ranges of
    /// host regions.
    fn ptr(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset <= self.len_bytes());
        debug_assert!(self.device_buffer().is_none());
        // SAFETY: callers pass offsets inside the region (from `block_range`), so the result
        // stays inside the allocation.
        unsafe { self.raw_host_ptr().add(offset) }
    }

    /// Overwrites one block with `data` (exactly one block long).
    pub fn write_block(&self, block: BlockId, data: &[u8]) -> Result<(), RegionError> {
        let range = self.block_range(block)?;
        if data.len() != self.block_bytes {
            return Err(RegionError::WrongLength {
                got: data.len(),
                want: self.block_bytes,
            });
        }
        self.write_at(range.start, data)
    }

    /// Copies `out.len()` bytes at byte `offset` of the region into `out`. Callers pass
    /// ranges inside checked blocks.
    fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<(), RegionError> {
        debug_assert!(offset + out.len() <= self.len_bytes());
        if let Some(buffer) = self.device_buffer() {
            return Ok(buffer.read_at(offset as u64, out)?);
        }
        // SAFETY: the range is inside the host region (the callers' checks); `out` is a
        // separate buffer of that length.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `data` to byte `offset` of the region. Callers pass ranges inside checked
    /// blocks that their request owns.
    fn write_at(&self, offset: usize, data: &[u8]) -> Result<(), RegionError> {
        debug_assert!(offset + data.len() <= self.len_bytes());
        if let Some(buffer) = self.device_buffer() {
            return Ok(buffer.write_at(offset as u64, data)?);
        }
        // SAFETY: as in `read_at`, in the other direction; the block is owned by the
        // caller's request (module contract).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr(offset), data.len()) };
        Ok(())
    }

    /// A copy of one block's bytes.
    pub fn read_block(&self, block: BlockId) -> Result<Vec<u8>, RegionError> {
        let range = self.block_range(block)?;
        let mut out = vec![0u8; self.block_bytes];
        self.read_at(range.start, &mut out)?;
        Ok(out)
    }

    /// Copies `src_blocks` of `src` into `dst_blocks` of `dst`, pairwise. Every block of both
    /// lists is checked before the first byte moves, so a bad list copies nothing. Blocks
    /// of a device region go through host memory, one block at a time.
    pub fn copy_blocks(
        src: &Region,
        src_blocks: &[BlockId],
        dst: &Region,
        dst_blocks: &[BlockId],
    ) -> Result<(), RegionError> {
        if src.block_bytes != dst.block_bytes {
            return Err(RegionError::Mismatch {
                detail: format!(
                    "{}-byte blocks into {}-byte blocks",
                    src.block_bytes, dst.block_bytes
                ),
            });
        }
        Self::copy_block_slices(
            src,
            src_blocks,
            dst,
            dst_blocks,
            BlockSlice::whole(src.block_bytes),
        )
    }

    /// [`Region::copy_blocks`] of one slice of every block (pipeline parallelism: each
    /// rank holds a slice of every block; see [`BlockSlice::between`]).
    pub fn copy_block_slices(
        src: &Region,
        src_blocks: &[BlockId],
        dst: &Region,
        dst_blocks: &[BlockId],
        slice: BlockSlice,
    ) -> Result<(), RegionError> {
        slice.check(src.block_bytes, dst.block_bytes)?;
        if src_blocks.len() != dst_blocks.len() {
            return Err(RegionError::Mismatch {
                detail: format!(
                    "{} blocks of {} bytes into {} blocks of {} bytes",
                    src_blocks.len(),
                    src.block_bytes,
                    dst_blocks.len(),
                    dst.block_bytes
                ),
            });
        }
        src.check_blocks(src_blocks)?;
        dst.check_blocks(dst_blocks)?;
        if src.device_buffer().is_some() || dst.device_buffer().is_some() {
            // Through host memory, and only the slice's bytes: another pipeline rank may be
            // filling the rest of the same destination block at the same time.
            let mut staged = vec![0u8; slice.len];
            for (s, d) in src_blocks.iter().zip(dst_blocks) {
                src.read_at(src.block_range(*s)?.start + slice.src_offset, &mut staged)?;
                dst.write_at(dst.block_range(*d)?.start + slice.dst_offset, &staged)?;
            }
            return Ok(());
        }
        for (s, d) in src_blocks.iter().zip(dst_blocks) {
            let (s, d) = (src.block_range(*s)?, dst.block_range(*d)?);
            // SAFETY: both blocks are inside their regions (checked) and the slice inside
            // both blocks (`slice.check`); the ranges cannot overlap unless src and dst are
            // the same region and block, which copy (not copy_nonoverlapping) tolerates.
            unsafe {
                std::ptr::copy(
                    src.ptr(s.start + slice.src_offset),
                    dst.ptr(d.start + slice.dst_offset),
                    slice.len,
                )
            };
        }
        Ok(())
    }

    /// A 64-bit FNV-1a checksum of the listed blocks, in order.
    pub fn checksum(&self, blocks: &[BlockId]) -> Result<u64, RegionError> {
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        for b in blocks {
            for byte in self.read_block(*b)? {
                hash = (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        Ok(hash)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_blocks_and_refuses_out_of_range_before_touching_anything() {
        let a = Region::new(4, 8).unwrap();
        let b = Region::new(4, 8).unwrap();
        a.write_block(BlockId(1), &[7; 8]).unwrap();
        Region::copy_blocks(&a, &[BlockId(1)], &b, &[BlockId(3)]).unwrap();
        assert_eq!(b.read_block(BlockId(3)).unwrap(), vec![7; 8]);
        let err = Region::copy_blocks(&a, &[BlockId(1), BlockId(1)], &b, &[BlockId(0), BlockId(4)]);
        assert!(matches!(err, Err(RegionError::OutOfRange { .. })));
        assert_eq!(
            b.read_block(BlockId(0)).unwrap(),
            vec![0; 8],
            "nothing copied"
        );
        assert!(Region::new(0, 8).is_err());
        assert!(Region::new(u32::MAX, usize::MAX).is_err());
    }

    #[test]
    fn pipeline_parts_meet_where_their_layers_overlap() {
        let part = |pp_rank, pp_size, block_bytes| PipelinePart {
            pp_rank,
            pp_size,
            block_bytes,
        };
        // Two prefill stages of 32 bytes each into a 64-byte decode block.
        assert_eq!(
            BlockSlice::between(part(1, 2, 32), part(0, 1, 64)),
            Ok(Some(BlockSlice {
                src_offset: 0,
                dst_offset: 32,
                len: 32
            }))
        );
        // Decode stage 0 reads its half from a whole prefill block.
        assert_eq!(
            BlockSlice::between(part(0, 1, 64), part(0, 2, 32)),
            Ok(Some(BlockSlice {
                src_offset: 0,
                dst_offset: 0,
                len: 32
            }))
        );
        // 3 stages against 2: stage 1 of 3 (bytes 20..40 of 60) meets stage 0 of 2 (0..30).
        assert_eq!(
            BlockSlice::between(part(1, 3, 20), part(0, 2, 30)),
            Ok(Some(BlockSlice {
                src_offset: 0,
                dst_offset: 20,
                len: 10
            }))
        );
        assert_eq!(
            BlockSlice::between(part(0, 2, 32), part(1, 2, 32)),
            Ok(None)
        );
        assert_eq!(
            BlockSlice::between(part(0, 1, 8), part(0, 1, 8)),
            Ok(Some(BlockSlice::whole(8)))
        );
        // Whole blocks of different sizes, and malformed parts, are named errors.
        for (a, b) in [
            (part(0, 2, 32), part(0, 1, 48)),
            (part(2, 2, 32), part(0, 1, 64)),
            (part(0, 0, 32), part(0, 1, 64)),
            (part(u32::MAX - 1, u32::MAX, usize::MAX / 2), part(0, 1, 64)),
        ] {
            assert!(
                matches!(BlockSlice::between(a, b), Err(RegionError::Mismatch { .. })),
                "{a:?} {b:?}"
            );
        }
    }

    #[test]
    fn slices_of_blocks_copy_only_their_bytes_and_are_checked_first() {
        let half = Region::new(2, 4).unwrap();
        let whole = Region::new(2, 8).unwrap();
        half.write_block(BlockId(1), &[5; 4]).unwrap();
        let slice = BlockSlice {
            src_offset: 0,
            dst_offset: 4,
            len: 4,
        };
        Region::copy_block_slices(&half, &[BlockId(1)], &whole, &[BlockId(0)], slice).unwrap();
        assert_eq!(
            whole.read_block(BlockId(0)).unwrap(),
            [0, 0, 0, 0, 5, 5, 5, 5]
        );
        let too_long = BlockSlice { len: 5, ..slice };
        assert!(matches!(
            Region::copy_block_slices(&half, &[BlockId(1)], &whole, &[BlockId(1)], too_long),
            Err(RegionError::Mismatch { .. })
        ));
        assert!(matches!(
            Region::copy_blocks(&half, &[BlockId(1)], &whole, &[BlockId(1)]),
            Err(RegionError::Mismatch { .. })
        ));
        assert_eq!(
            whole.read_block(BlockId(1)).unwrap(),
            [0; 8],
            "nothing copied"
        );
    }

    #[test]
    fn external_memory_is_used_in_place_and_its_keeper_dropped_with_the_region() {
        struct Keeper(
            std::sync::Arc<std::sync::atomic::AtomicBool>,
            #[allow(dead_code)] Box<[u8]>,
        );
        impl Drop for Keeper {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut backing = vec![0u8; 32].into_boxed_slice();
        let ptr = NonNull::new(backing.as_mut_ptr()).unwrap();
        let keeper = Box::new(Keeper(dropped.clone(), backing));
        // SAFETY: the keeper owns the 32 bytes and lives as long as the region.
        let region = unsafe { Region::from_external(ptr, 4, 8, keeper) }.unwrap();
        region.write_block(BlockId(2), &[9; 8]).unwrap();
        assert_eq!(region.host_ptr(), Ok(ptr.as_ptr()));
        assert_eq!(region.base_addr(), ptr.as_ptr() as u64);
        assert_eq!(region.memory_kind(), MemoryKind::Host);
        // SAFETY: byte 16 is inside the 32-byte backing, which the keeper keeps alive.
        assert_eq!(unsafe { *ptr.as_ptr().add(16) }, 9);
        assert_eq!(region.len_bytes(), 32);
        drop(region);
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
    }
}
