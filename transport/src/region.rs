//! Host memory regions cut into equal blocks: the memory the in-process transport moves
//! bytes between, and what tests, examples and the simulator use as KV pools.
//!
//! A region is shared between the engine (which fills and reads blocks) and the runtime
//! (which copies blocks on the engine's behalf), so it hands out copies and takes writes
//! through `&self`. The contract that makes this sound is the one every KV-cache allocator
//! already keeps: a block belongs to at most one live request at a time, so two writers
//! never touch the same block at once.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::ptr::NonNull;

use crate::types::BlockId;

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
}

/// A block-addressed host memory region.
///
/// Made by [`HostRegion::new`] (zeroed heap memory) or [`HostRegion::from_external`]
/// (memory owned by something else, e.g. a UCX allocation that peers can write directly).
pub struct HostRegion {
    storage: Storage,
    block_bytes: usize,
    blocks: u32,
}

// SAFETY: all access goes through raw byte copies of whole blocks; the module contract
// (a block belongs to one live request at a time) keeps writers of one block exclusive.
unsafe impl Sync for HostRegion {}
// SAFETY: the region owns its bytes (or, for external memory, a `Send` keeper that keeps
// them alive); moving it between threads moves that ownership.
unsafe impl Send for HostRegion {}

impl std::fmt::Debug for HostRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegion")
            .field("blocks", &self.blocks)
            .field("block_bytes", &self.block_bytes)
            .finish()
    }
}

impl HostRegion {
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

    /// The first byte of the region, for transports that move bytes without a copy
    /// through a `Vec` (socket reads and writes, RDMA). Every access through it must stay
    /// inside [`HostRegion::len_bytes`] and follow the module's block-ownership contract.
    pub fn as_ptr(&self) -> *mut u8 {
        match &self.storage {
            Storage::Owned(bytes) => UnsafeCell::raw_get(bytes.as_ptr()),
            Storage::External { ptr, .. } => ptr.as_ptr(),
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

    /// The address of byte `offset`. Callers pass offsets of checked block ranges.
    fn ptr(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset <= self.len_bytes());
        // SAFETY: callers pass offsets inside the region (from `block_range`), so the result
        // stays inside the allocation.
        unsafe { self.as_ptr().add(offset) }
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
        // SAFETY: `range` is inside the region (checked above) and `data` is one block
        // long; the block is owned by the caller's request (module contract).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr(range.start), data.len()) };
        Ok(())
    }

    /// A copy of one block's bytes.
    pub fn read_block(&self, block: BlockId) -> Result<Vec<u8>, RegionError> {
        let range = self.block_range(block)?;
        let mut out = vec![0u8; self.block_bytes];
        // SAFETY: `range` is inside the region; `out` is one block long.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr(range.start), out.as_mut_ptr(), out.len())
        };
        Ok(out)
    }

    /// Copies `src_blocks` of `src` into `dst_blocks` of `dst`, pairwise. Every block of both
    /// lists is checked before the first byte moves, so a bad list copies nothing.
    pub fn copy_blocks(
        src: &HostRegion,
        src_blocks: &[BlockId],
        dst: &HostRegion,
        dst_blocks: &[BlockId],
    ) -> Result<(), RegionError> {
        if src.block_bytes != dst.block_bytes || src_blocks.len() != dst_blocks.len() {
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
        for (s, d) in src_blocks.iter().zip(dst_blocks) {
            let (s, d) = (src.block_range(*s)?, dst.block_range(*d)?);
            // SAFETY: both ranges are inside their regions (checked); they cannot overlap
            // unless src and dst are the same region and block, which copy (not
            // copy_nonoverlapping) tolerates.
            unsafe { std::ptr::copy(src.ptr(s.start), dst.ptr(d.start), src.block_bytes) };
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
        let a = HostRegion::new(4, 8).unwrap();
        let b = HostRegion::new(4, 8).unwrap();
        a.write_block(BlockId(1), &[7; 8]).unwrap();
        HostRegion::copy_blocks(&a, &[BlockId(1)], &b, &[BlockId(3)]).unwrap();
        assert_eq!(b.read_block(BlockId(3)).unwrap(), vec![7; 8]);
        let err =
            HostRegion::copy_blocks(&a, &[BlockId(1), BlockId(1)], &b, &[BlockId(0), BlockId(4)]);
        assert!(matches!(err, Err(RegionError::OutOfRange { .. })));
        assert_eq!(
            b.read_block(BlockId(0)).unwrap(),
            vec![0; 8],
            "nothing copied"
        );
        assert!(HostRegion::new(0, 8).is_err());
        assert!(HostRegion::new(u32::MAX, usize::MAX).is_err());
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
        let region = unsafe { HostRegion::from_external(ptr, 4, 8, keeper) }.unwrap();
        region.write_block(BlockId(2), &[9; 8]).unwrap();
        assert_eq!(region.as_ptr(), ptr.as_ptr());
        // SAFETY: byte 16 is inside the 32-byte backing, which the keeper keeps alive.
        assert_eq!(unsafe { *region.as_ptr().add(16) }, 9);
        assert_eq!(region.len_bytes(), 32);
        drop(region);
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
    }
}
