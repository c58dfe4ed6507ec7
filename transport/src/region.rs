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

use crate::types::BlockId;

/// Largest region this type allocates: 64 GiB, more than one GPU's KV cache, so that a
/// mistaken size fails with a named error instead of exhausting host memory.
pub const REGION_BYTES_MAX: usize = 64 << 30;

/// Errors from region construction and block access.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
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

/// A block-addressed host memory region.
pub struct HostRegion {
    bytes: Box<[UnsafeCell<u8>]>,
    block_bytes: usize,
    blocks: u32,
}

// SAFETY: all access goes through raw byte copies of whole blocks; the module contract
// (a block belongs to one live request at a time) keeps writers of one block exclusive.
unsafe impl Sync for HostRegion {}
// SAFETY: the region owns its bytes; moving it between threads moves that ownership.
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
        let total = (blocks as usize)
            .checked_mul(block_bytes)
            .filter(|&t| t > 0 && t <= REGION_BYTES_MAX)
            .ok_or(RegionError::BadSize {
                blocks,
                block_bytes,
            })?;
        let bytes = (0..total).map(|_| UnsafeCell::new(0u8)).collect();
        Ok(Self {
            bytes,
            block_bytes,
            blocks,
        })
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

    fn ptr(&self, offset: usize) -> *mut u8 {
        UnsafeCell::raw_get(self.bytes[offset..].as_ptr())
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
}
