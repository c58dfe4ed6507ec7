//! From two block lists to operations: pair `local[i]` with `remote[i]`, merge runs that
//! are contiguous on both sides, and cut the result into operations of bounded size.
//!
//! Pure functions over offsets: the transports check the blocks against their regions
//! (ours and the peer's) before calling [`sliced_pieces`], and [`split`] is what bounds the bytes
//! and the segments one frame carries.

use std::ops::Range;

use super::{DataError, BLOCKS_PER_CALL_MAX, SLICES_PER_CALL_MAX};
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

/// Checks that no block is listed twice as a destination: the bytes moved into one block
/// twice, perhaps at once (a copy's lanes, operations in flight), would be undefined.
pub fn check_destinations(blocks: &[BlockId]) -> Result<(), DataError> {
    match BlockId::first_repeat(blocks) {
        Some(block) => Err(DataError::Mismatch {
            detail: format!("destination block {block} listed twice"),
        }),
        None => Ok(()),
    }
}

/// Checks how many slices of every block a call moves: at most [`SLICES_PER_CALL_MAX`].
pub fn check_slices(slices: usize) -> Result<(), DataError> {
    if slices > SLICES_PER_CALL_MAX {
        return Err(DataError::TooLarge {
            what: "slices of every block in one transfer",
            count: slices,
            max: SLICES_PER_CALL_MAX,
        });
    }
    Ok(())
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

impl Sliced {
    /// Every slice of a call ([`check_slices`]) as seen from the local side, or the whole
    /// block when there are none, which needs blocks of one size on both sides (`peer`
    /// names the other side in the error).
    pub fn all(
        slices: &[crate::BlockSlice],
        write: bool,
        local_block_bytes: usize,
        remote_block_bytes: u64,
        peer: &str,
    ) -> Result<Vec<Sliced>, DataError> {
        check_slices(slices.len())?;
        if slices.is_empty() {
            if local_block_bytes as u64 != remote_block_bytes {
                return Err(DataError::Mismatch {
                    detail: format!(
                        "local blocks of {local_block_bytes} bytes, {peer}'s of {remote_block_bytes}"
                    ),
                });
            }
            let whole = crate::BlockSlice::whole(local_block_bytes);
            return Ok(vec![Sliced::new(
                whole,
                write,
                local_block_bytes,
                remote_block_bytes,
            )?]);
        }
        // Two slices into the same bytes of a destination block would write them twice,
        // perhaps at once (a read's pieces are buffers of ours, a copy's lanes run together).
        let mut into: Vec<(usize, usize)> = slices.iter().map(|s| (s.dst_offset, s.len)).collect();
        into.sort_unstable();
        if let Some(w) = into
            .windows(2)
            .find(|w| w[0].0.saturating_add(w[0].1) > w[1].0)
        {
            return Err(DataError::Mismatch {
                detail: format!(
                    "slices overlap in the destination block: [{}, +{}) and [{}, +{})",
                    w[0].0, w[0].1, w[1].0, w[1].1
                ),
            });
        }
        slices
            .iter()
            .map(|slice| Sliced::new(*slice, write, local_block_bytes, remote_block_bytes))
            .collect()
    }
}

/// One slice of every block pair: `len` bytes at `local_offset` of `local[i]` pair with
/// `remote_offset` of `remote[i]`, each merged into the previous piece where it continues
/// it on both sides (whole blocks only). The caller has checked both lists against their
/// regions, so no offset overflows, and the slice ([`Sliced::new`], [`Sliced::all`]).
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
    fn slices_into_the_same_destination_bytes_are_refused_by_name() {
        let slice = |src_offset, dst_offset, len| crate::BlockSlice {
            src_offset,
            dst_offset,
            len,
        };
        // Side by side, in any order, and from overlapping sources: fine.
        let fine = [slice(0, 64, 64), slice(0, 0, 64), slice(32, 128, 32)];
        for write in [true, false] {
            assert_eq!(Sliced::all(&fine, write, 256, 256, "p").unwrap().len(), 3);
        }
        let overlapping = [slice(0, 0, 64), slice(64, 200, 32), slice(128, 63, 16)];
        for write in [true, false] {
            let err = Sliced::all(&overlapping, write, 256, 256, "p").unwrap_err();
            assert!(
                matches!(&err, DataError::Mismatch { detail } if detail.contains("[0, +64) and [63, +16)")),
                "{err}"
            );
        }
    }

    #[test]
    fn a_destination_listed_twice_is_refused_by_name() {
        assert!(check_destinations(&[]).is_ok());
        assert!(check_destinations(&ids(&[0, 1, 7])).is_ok());
        assert!(check_destinations(&ids(&[9, 1, 7])).is_ok());
        let err = check_destinations(&ids(&[9, 1, 7, 1])).unwrap_err();
        assert!(
            matches!(&err, DataError::Mismatch { detail } if detail == "destination block #1 listed twice"),
            "{err}"
        );
        assert!(check_destinations(&ids(&[3, 3])).is_err());
    }

    /// Whole blocks of `block_bytes` on both sides, paired as a call with no slices is.
    fn pieces(local: &[BlockId], remote: &[BlockId], block_bytes: usize) -> Vec<Piece> {
        let whole = Sliced::all(&[], true, block_bytes, block_bytes as u64, "peer").unwrap();
        sliced_pieces(local, remote, &whole[0])
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

    #[test]
    fn mismatched_or_oversized_lists_are_refused() {
        assert!(check_lists(&ids(&[1]), &ids(&[1, 2])).is_err());
        assert!(check_lists(&ids(&[1, 2]), &ids(&[3, 4])).is_ok());
    }
}
