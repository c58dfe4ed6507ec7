//! From two block lists to operations: pair `local[i]` with `remote[i]`, merge runs that
//! are contiguous on both sides, and cut the result into operations of bounded size.
//!
//! Pure functions over offsets: the transports check the blocks against their regions
//! (ours and the peer's) before calling [`pieces`], and [`split`] is what bounds the bytes
//! staged by a server and the segments one frame lists.

use std::ops::Range;

use super::{DataError, BLOCKS_PER_CALL_MAX};
use crate::types::BlockId;

/// One contiguous byte range moved between the local and the peer's region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Piece {
    /// Byte offset in the local region.
    pub local: usize,
    /// Byte offset in the peer's region.
    pub remote: u64,
    /// Length in bytes, not zero.
    pub len: usize,
}

/// A transfer cut into operations: `ops[k]` is the range of `pieces` that operation `k`
/// moves. Every operation has at most the byte and piece bounds given to [`split`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Every piece, in order.
    pub pieces: Vec<Piece>,
    /// Each operation's pieces, as a range of `pieces`.
    pub ops: Vec<Range<usize>>,
}

impl Plan {
    /// Bytes moved by operation `k`.
    pub fn op_bytes(&self, k: usize) -> usize {
        self.ops
            .get(k)
            .map_or(0, |r| self.pieces[r.clone()].iter().map(|p| p.len).sum())
    }

    /// Bytes moved by the whole plan.
    pub fn total_bytes(&self) -> u64 {
        self.pieces.iter().map(|p| p.len as u64).sum()
    }
}

/// Checks the shape of a call: lists of equal length, within [`BLOCKS_PER_CALL_MAX`].
pub fn check_lists(local: &[BlockId], remote: &[BlockId]) -> Result<(), DataError> {
    if local.len() != remote.len() {
        return Err(DataError::Mismatch {
            detail: format!(
                "{} source blocks for {} destination blocks",
                local.len(),
                remote.len()
            ),
        });
    }
    if local.len() > BLOCKS_PER_CALL_MAX {
        return Err(DataError::TooLarge {
            what: "blocks in one transfer",
            count: local.len(),
            max: BLOCKS_PER_CALL_MAX,
        });
    }
    Ok(())
}

/// Pairs `local[i]` with `remote[i]` (blocks of `block_bytes` on both sides) and merges
/// each pair into the previous piece when it continues it on both sides. The caller has
/// checked both lists against their regions, so no offset overflows.
pub fn pieces(local: &[BlockId], remote: &[BlockId], block_bytes: usize) -> Vec<Piece> {
    let whole = Sliced {
        local_block_bytes: block_bytes,
        remote_block_bytes: block_bytes as u64,
        local_offset: 0,
        remote_offset: 0,
        len: block_bytes,
    };
    sliced_pieces(local, remote, &whole)
}

/// Where in each block a sliced transfer reads and writes, from the local side's view
/// (a [`crate::BlockSlice`] turned around for the direction of the call).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sliced {
    /// Bytes per local block.
    pub local_block_bytes: usize,
    /// Bytes per block of the peer's region.
    pub remote_block_bytes: u64,
    /// Offset of the slice in each local block.
    pub local_offset: usize,
    /// Offset of the slice in each of the peer's blocks.
    pub remote_offset: u64,
    /// Bytes per block.
    pub len: usize,
}

impl Sliced {
    /// The local view of `slice` for a write (we are the source) or a read (we are the
    /// destination), checked against both block sizes.
    pub fn new(
        slice: crate::BlockSlice,
        write: bool,
        local_block_bytes: usize,
        remote_block_bytes: u64,
    ) -> Result<Sliced, DataError> {
        let remote = usize::try_from(remote_block_bytes).unwrap_or(usize::MAX);
        let (local_offset, remote_offset) = if write {
            slice.check(local_block_bytes, remote)?;
            (slice.src_offset, slice.dst_offset)
        } else {
            slice.check(remote, local_block_bytes)?;
            (slice.dst_offset, slice.src_offset)
        };
        Ok(Sliced {
            local_block_bytes,
            remote_block_bytes,
            local_offset,
            remote_offset: remote_offset as u64,
            len: slice.len,
        })
    }
}

/// [`pieces`] for one slice of every block: `len` bytes at `local_offset` of `local[i]`
/// pair with `remote_offset` of `remote[i]`, merged where contiguous on both sides (whole
/// blocks only). The caller has checked the lists and the slice ([`Sliced::new`]).
pub fn sliced_pieces(local: &[BlockId], remote: &[BlockId], at: &Sliced) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::with_capacity(local.len().min(1024));
    for (l, r) in local.iter().zip(remote) {
        let piece = Piece {
            local: l.0 as usize * at.local_block_bytes + at.local_offset,
            remote: u64::from(r.0) * at.remote_block_bytes + at.remote_offset,
            len: at.len,
        };
        if let Some(last) = out.last_mut() {
            if last.local + last.len == piece.local && last.remote + last.len as u64 == piece.remote
            {
                last.len += piece.len;
                continue;
            }
        }
        out.push(piece);
    }
    out
}

/// One range of a KV layout as a data plane addresses it: block `b` is `bytes` bytes at
/// `addr + b × stride` (an absolute address in the owner's address space).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RangeGeom {
    /// Address of block 0.
    pub addr: u64,
    /// Bytes from one block to the next.
    pub stride: u64,
    /// Bytes of each block in this range, not zero.
    pub bytes: u64,
}

/// A layout's ranges, checked, with where each starts in the logical block (the
/// concatenation, in range order, of the block's bytes in every range).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    blocks: u32,
    ranges: Vec<RangeGeom>,
    /// `starts[i]`: logical offset of range `i` in a block; `starts[len]` = block bytes.
    starts: Vec<u64>,
}

/// One piece of a block in one range: `len` bytes at `offset` from the range's `addr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RangePiece {
    /// Index of the range.
    pub range: u32,
    /// Offset from the range's first byte (block 0's address).
    pub offset: u64,
    /// Length in bytes, not zero.
    pub len: u64,
}

/// One piece of a transfer: the same `len` bytes in a local range and a remote range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PairedPiece {
    /// The local side.
    pub local: RangePiece,
    /// The peer's side.
    pub remote: RangePiece,
}

impl Geometry {
    /// Checks a layout's shape: `1..=ranges_max` ranges, every range's blocks inside the
    /// address space (`addr + (blocks - 1) × stride + bytes` does not overflow), no empty
    /// range, a logical block that fits a `u64`. `what` names the side in errors.
    pub fn new(
        blocks: u32,
        ranges: Vec<RangeGeom>,
        ranges_max: usize,
        what: &str,
    ) -> Result<Geometry, String> {
        if blocks == 0 {
            return Err(format!("{what}: layout of zero blocks"));
        }
        if ranges.is_empty() || ranges.len() > ranges_max {
            return Err(format!(
                "{what}: {} ranges (expected 1..={ranges_max})",
                ranges.len()
            ));
        }
        let mut starts = Vec::with_capacity(ranges.len() + 1);
        let mut at = 0u64;
        for (i, r) in ranges.iter().enumerate() {
            if r.bytes == 0 {
                return Err(format!("{what}: range {i} has empty blocks"));
            }
            let end = u64::from(blocks - 1)
                .checked_mul(r.stride)
                .and_then(|o| o.checked_add(r.bytes))
                .and_then(|o| o.checked_add(r.addr));
            if end.is_none() {
                return Err(format!(
                    "{what}: range {i} ({blocks} blocks of {} bytes every {} from {:#x}) overflows",
                    r.bytes, r.stride, r.addr
                ));
            }
            starts.push(at);
            at = at
                .checked_add(r.bytes)
                .ok_or_else(|| format!("{what}: logical block size overflows"))?;
        }
        starts.push(at);
        Ok(Geometry {
            blocks,
            ranges,
            starts,
        })
    }

    /// Blocks in every range.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Bytes of one logical block.
    pub fn block_bytes(&self) -> u64 {
        self.starts.last().copied().unwrap_or(0)
    }

    /// The ranges.
    pub fn ranges(&self) -> &[RangeGeom] {
        &self.ranges
    }

    /// Bytes a range spans from its first block's start to its last block's end.
    pub fn range_span(&self, range: usize) -> u64 {
        self.ranges.get(range).map_or(0, |r| {
            // Checked in `new`.
            u64::from(self.blocks - 1) * r.stride + r.bytes
        })
    }

    /// Calls `f` with every piece of `len` logical bytes at `offset` of `block`, in order.
    /// The caller has checked `block < blocks` and `offset + len <= block_bytes`.
    pub fn pieces(&self, block: u32, offset: u64, len: u64, mut f: impl FnMut(RangePiece)) {
        let end = offset.saturating_add(len).min(self.block_bytes());
        // The range holding `offset`: the last start at or before it.
        let mut i = self
            .starts
            .partition_point(|&s| s <= offset)
            .saturating_sub(1);
        let mut at = offset;
        while at < end && i < self.ranges.len() {
            let r = &self.ranges[i];
            let (start, stop) = (self.starts[i], self.starts[i + 1]);
            let take = stop.min(end) - at;
            if take > 0 {
                f(RangePiece {
                    range: i as u32,
                    offset: u64::from(block) * r.stride + (at - start),
                    len: take,
                });
            }
            at += take;
            i += 1;
        }
    }

    /// Pairs the pieces of `local` block `l` and `remote` block `r` for the slice `at`
    /// (the same logical bytes on both sides, cut wherever either side's ranges end).
    /// The caller has checked both blocks and the slice.
    pub fn pair(
        local: &Geometry,
        l: BlockId,
        remote: &Geometry,
        r: BlockId,
        at: &Sliced,
        mut f: impl FnMut(PairedPiece),
    ) {
        let len = at.len as u64;
        let mut theirs = Vec::new();
        remote.pieces(r.0, at.remote_offset, len, |p| theirs.push(p));
        let mut theirs = theirs.into_iter();
        let mut current: Option<RangePiece> = theirs.next();
        local.pieces(l.0, at.local_offset as u64, len, |mut mine| {
            while mine.len > 0 {
                let Some(other) = current.as_mut() else {
                    return;
                };
                let take = mine.len.min(other.len);
                f(PairedPiece {
                    local: RangePiece { len: take, ..mine },
                    remote: RangePiece {
                        len: take,
                        ..*other
                    },
                });
                mine.offset += take;
                mine.len -= take;
                other.offset += take;
                other.len -= take;
                if other.len == 0 {
                    current = theirs.next();
                }
            }
        });
    }
}

/// Cuts `pieces` into operations of at most `op_bytes_max` bytes and `pieces_per_op_max`
/// pieces, splitting a piece where an operation fills up.
pub fn split(pieces: &[Piece], op_bytes_max: usize, pieces_per_op_max: usize) -> Plan {
    assert!(
        op_bytes_max > 0 && pieces_per_op_max > 0,
        "limits must be positive"
    );
    let mut plan = Plan::default();
    let (mut op_start, mut op_bytes) = (0usize, 0usize);
    for piece in pieces {
        let mut rest = *piece;
        while rest.len > 0 {
            let take = rest.len.min(op_bytes_max - op_bytes);
            plan.pieces.push(Piece { len: take, ..rest });
            op_bytes += take;
            rest.local += take;
            rest.remote += take as u64;
            rest.len -= take;
            if op_bytes == op_bytes_max || plan.pieces.len() - op_start == pieces_per_op_max {
                plan.ops.push(op_start..plan.pieces.len());
                op_start = plan.pieces.len();
                op_bytes = 0;
            }
        }
    }
    if op_start < plan.pieces.len() {
        plan.ops.push(op_start..plan.pieces.len());
    }
    plan
}

/// The blocks that the byte range `offset..offset + len` touches, appended to `out`
/// (the servers' grant checks are per block).
pub fn touched_blocks(offset: u64, len: u64, block_bytes: u64, out: &mut Vec<BlockId>) {
    if len == 0 || block_bytes == 0 {
        return;
    }
    let first = offset / block_bytes;
    let last = (offset + len - 1) / block_bytes;
    for b in first..=last {
        let block = BlockId(b as u32);
        if out.last() != Some(&block) {
            out.push(block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().map(|&b| BlockId(b)).collect()
    }

    #[test]
    fn contiguous_runs_merge_and_permuted_blocks_do_not() {
        let p = pieces(&ids(&[0, 1, 2, 5]), &ids(&[3, 4, 5, 6]), 10);
        assert_eq!(
            p,
            vec![
                Piece {
                    local: 0,
                    remote: 30,
                    len: 30
                },
                Piece {
                    local: 50,
                    remote: 60,
                    len: 10
                },
            ]
        );
        let p = pieces(&ids(&[0, 1, 2]), &ids(&[2, 1, 0]), 10);
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn split_bounds_bytes_and_pieces_and_keeps_every_byte() {
        let p = vec![
            Piece {
                local: 0,
                remote: 0,
                len: 25,
            },
            Piece {
                local: 100,
                remote: 200,
                len: 3,
            },
            Piece {
                local: 300,
                remote: 400,
                len: 3,
            },
            Piece {
                local: 500,
                remote: 600,
                len: 3,
            },
        ];
        let plan = split(&p, 10, 2);
        assert_eq!(plan.total_bytes(), 34);
        for k in 0..plan.ops.len() {
            assert!(plan.op_bytes(k) <= 10);
            assert!(plan.ops[k].len() <= 2);
        }
        assert_eq!(
            plan.pieces[2],
            Piece {
                local: 20,
                remote: 20,
                len: 5
            }
        );
        assert_eq!(plan.ops[0], 0..1);
    }

    #[test]
    fn touched_blocks_cover_partial_blocks() {
        let mut out = Vec::new();
        touched_blocks(15, 20, 10, &mut out);
        assert_eq!(out, ids(&[1, 2, 3]));
        touched_blocks(35, 1, 10, &mut out);
        assert_eq!(out, ids(&[1, 2, 3]), "block 3 again is not repeated");
    }

    fn geom(blocks: u32, ranges: &[(u64, u64, u64)]) -> Geometry {
        let ranges = ranges
            .iter()
            .map(|&(addr, stride, bytes)| RangeGeom {
                addr,
                stride,
                bytes,
            })
            .collect();
        Geometry::new(blocks, ranges, 64, "test").unwrap()
    }

    #[test]
    fn a_block_maps_to_one_piece_per_range_and_slices_cut_them() {
        // Two layers, K and V each (vLLM `[2, blocks, ...]` per layer): 4 ranges of 8 bytes.
        let g = geom(4, &[(1000, 8, 8), (1032, 8, 8), (2000, 8, 8), (2032, 8, 8)]);
        assert_eq!(g.block_bytes(), 32);
        let mut out = Vec::new();
        g.pieces(2, 0, 32, |p| out.push(p));
        assert_eq!(out.len(), 4);
        assert_eq!(
            out[1],
            RangePiece {
                range: 1,
                offset: 16,
                len: 8
            }
        );
        out.clear();
        g.pieces(1, 12, 10, |p| out.push(p));
        assert_eq!(
            out,
            vec![
                RangePiece {
                    range: 1,
                    offset: 12,
                    len: 4
                },
                RangePiece {
                    range: 2,
                    offset: 8,
                    len: 6
                }
            ]
        );
    }

    #[test]
    fn pairing_cuts_where_either_side_changes_range() {
        // One range of 32-byte blocks against 4 ranges of 8 bytes.
        let one = geom(4, &[(0, 32, 32)]);
        let four = geom(4, &[(1000, 8, 8), (1032, 8, 8), (2000, 8, 8), (2032, 8, 8)]);
        let at = Sliced {
            local_block_bytes: 32,
            remote_block_bytes: 32,
            local_offset: 4,
            remote_offset: 0,
            len: 20,
        };
        let mut out = Vec::new();
        Geometry::pair(&four, BlockId(3), &one, BlockId(1), &at, |p| out.push(p));
        let lens: Vec<u64> = out.iter().map(|p| p.local.len).collect();
        assert_eq!(lens, vec![4, 8, 8]);
        assert_eq!(out.iter().map(|p| p.remote.len).sum::<u64>(), 20);
        assert_eq!(out[0].remote.offset, 32);
        assert_eq!(out[2].remote.offset, 32 + 12);
        assert_eq!(out[2].local.range, 2);
    }

    #[test]
    fn geometries_that_overflow_or_are_empty_are_refused() {
        let bad = |blocks, ranges: Vec<RangeGeom>| Geometry::new(blocks, ranges, 4, "peer");
        let r = RangeGeom {
            addr: 0,
            stride: 8,
            bytes: 8,
        };
        assert!(bad(0, vec![r]).is_err());
        assert!(bad(1, vec![]).is_err());
        assert!(bad(1, vec![r; 5]).is_err());
        assert!(bad(1, vec![RangeGeom { bytes: 0, ..r }]).is_err());
        assert!(bad(
            u32::MAX,
            vec![RangeGeom {
                stride: u64::MAX / 2,
                ..r
            }]
        )
        .is_err());
        assert!(bad(
            2,
            vec![RangeGeom {
                addr: u64::MAX - 8,
                ..r
            }]
        )
        .is_err());
        assert!(bad(2, vec![r; 4]).is_ok());
    }

    #[test]
    fn mismatched_or_oversized_lists_are_refused() {
        assert!(check_lists(&ids(&[1]), &ids(&[1, 2])).is_err());
        assert!(check_lists(&ids(&[1, 2]), &ids(&[3, 4])).is_ok());
    }
}
