//! Host buffers, the staging paths device buffers use (exercised here on the CPU), and
//! whole transfers between differently laid out host KV caches.

use handoff_gpu::checksum::fill_pattern;
use handoff_gpu::{
    checksum64, checksum_segments, copy_transfers, transfer_plan, GpuError, HostBuffer, KvBuffer,
    KvLayout, KvShape, LayoutKind, MemoryKind, Segment, Transfer, HOST_ALIGN_BYTES,
    STAGING_BYTES_MAX,
};
use proptest::prelude::*;

fn host(len: usize) -> HostBuffer {
    match HostBuffer::alloc_zeroed(len) {
        Ok(buffer) => buffer,
        Err(error) => panic!("host allocation of {len} bytes: {error}"),
    }
}

/// A host buffer that only implements reads and writes, so the trait's default
/// (staging) `fill_pattern` and `checksum_into` run: the same code that device buffers
/// use, tested here without a GPU.
struct Staged(HostBuffer);

impl KvBuffer for Staged {
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn addr(&self) -> u64 {
        self.0.addr()
    }
    fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        self.0.read_into(offset, dst)
    }
    fn write_from(&mut self, offset: u64, src: &[u8]) -> Result<(), GpuError> {
        self.0.write_from(offset, src)
    }
}

#[test]
fn host_buffers_are_page_aligned_and_zeroed() {
    let buffer = host(10_000);
    assert_eq!(buffer.as_ptr() as usize % HOST_ALIGN_BYTES, 0);
    assert_eq!(buffer.addr(), buffer.as_ptr() as u64);
    assert_eq!(buffer.len(), 10_000);
    assert_eq!(buffer.memory_kind(), MemoryKind::Host);
    assert!(buffer.as_slice().iter().all(|&b| b == 0));
    assert_eq!(
        HostBuffer::alloc_zeroed(0).err(),
        Some(GpuError::EmptyBuffer)
    );
    assert!(matches!(
        HostBuffer::alloc_zeroed(usize::MAX),
        Err(GpuError::Overflow { .. })
    ));
}

#[test]
fn ranges_outside_a_host_buffer_are_errors() {
    let mut buffer = host(100);
    let out = |offset, len| GpuError::OutOfBounds {
        offset,
        len,
        buffer_len: 100,
    };
    assert_eq!(buffer.bytes(90, 11).err(), Some(out(90, 11)));
    assert_eq!(buffer.bytes(u64::MAX, 2).err(), Some(out(u64::MAX, 2)));
    assert_eq!(buffer.write_from(99, &[1, 2]), Err(out(99, 2)));
    assert_eq!(buffer.read_into(101, &mut []), Err(out(101, 0)));
    assert_eq!(buffer.checksum(50, 51), Err(out(50, 51)));
    assert_eq!(buffer.bytes(100, 0).map(<[u8]>::len), Ok(0));
}

#[test]
fn host_fill_and_checksum_match_the_plain_functions() {
    let mut buffer = host(4096 + 5);
    assert_eq!(buffer.fill_pattern(9), Ok(()));
    let mut expected = vec![0u8; 4096 + 5];
    fill_pattern(&mut expected, 9, 0);
    assert_eq!(buffer.as_slice(), &expected[..]);
    assert_eq!(buffer.checksum(0, 4101), Ok(checksum64(&expected)));
    assert_eq!(buffer.checksum(3, 1000), Ok(checksum64(&expected[3..1003])));
}

#[test]
fn staged_fill_and_checksum_across_chunks_equal_in_place_ones() {
    // Past one staging chunk, with an odd tail: the chunk seams must not show.
    let len = STAGING_BYTES_MAX + 4096 + 3;
    let mut direct = host(len);
    let mut staged = Staged(host(len));
    assert_eq!(direct.fill_pattern(42), Ok(()));
    assert_eq!(staged.fill_pattern(42), Ok(()));
    assert!(direct.as_slice() == staged.0.as_slice());
    let whole = len as u64;
    assert_eq!(staged.checksum(0, whole), direct.checksum(0, whole));
    let seam = STAGING_BYTES_MAX as u64 - 17;
    assert_eq!(staged.checksum(seam, 100), direct.checksum(seam, 100));
}

#[test]
fn segments_naming_missing_regions_are_errors() {
    let regions = [host(64)];
    let segment = Segment {
        region: 1,
        offset: 0,
        len: 8,
    };
    assert_eq!(
        checksum_segments(&regions, &[segment]),
        Err(GpuError::NoSuchRegion {
            region: 1,
            count: 1
        })
    );
    let mut dst = [host(64)];
    let plan = [Transfer {
        src: Segment {
            region: 0,
            ..segment
        },
        dst: Segment {
            offset: 60,
            ..Segment {
                region: 0,
                ..segment
            }
        },
    }];
    assert!(matches!(
        copy_transfers(&regions, &mut dst, &plan),
        Err(GpuError::OutOfBounds { .. })
    ));
    let far = [Transfer {
        src: Segment {
            offset: u64::MAX - 1,
            ..plan[0].src
        },
        dst: Segment {
            offset: 0,
            ..plan[0].dst
        },
    }];
    assert!(matches!(
        copy_transfers(&regions, &mut dst, &far),
        Err(GpuError::OutOfBounds { .. })
    ));
    let uneven = [Transfer {
        src: plan[0].src,
        dst: Segment {
            offset: 0,
            len: 4,
            region: 0,
        },
    }];
    assert_eq!(
        copy_transfers(&regions, &mut dst, &uneven),
        Err(GpuError::TransferLengthMismatch { src: 8, dst: 4 })
    );
    assert!(
        dst[0].as_slice().iter().all(|&b| b == 0),
        "a rejected plan wrote nothing"
    );
}

fn small_shape(num_blocks: u32) -> KvShape {
    KvShape {
        layers: 3,
        num_blocks,
        block_size_tokens: 4,
        kv_heads: 2,
        head_dim: 8,
        dtype_bytes: 2,
        tp_rank: 0,
        tp_size: 1,
    }
}

fn alloc_cache(layout: &KvLayout, seed: u64) -> Vec<HostBuffer> {
    (0..layout.region_count())
        .map(|region| {
            let mut buffer = host(layout.region_bytes() as usize);
            assert_eq!(buffer.fill_pattern(seed + u64::from(region)), Ok(()));
            buffer
        })
        .collect()
}

fn run_transfer(
    src_kind: LayoutKind,
    dst_kind: LayoutKind,
    src_blocks: &[u32],
    dst_blocks: &[u32],
) {
    let src = KvLayout::new(small_shape(16), src_kind).unwrap_or_else(|e| panic!("{e}"));
    let dst = KvLayout::new(small_shape(24), dst_kind).unwrap_or_else(|e| panic!("{e}"));
    let plan = transfer_plan(&src, src_blocks, &dst, dst_blocks).unwrap_or_else(|e| panic!("{e}"));
    let src_cache = alloc_cache(&src, 1);
    let mut dst_cache = alloc_cache(&dst, 100);
    let untouched_before = alloc_cache(&dst, 100);
    assert_eq!(copy_transfers(&src_cache, &mut dst_cache, &plan), Ok(()));

    // Every block arrived, position by position.
    for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
        let one = transfer_plan(&src, &[s], &dst, &[d]).unwrap_or_else(|e| panic!("{e}"));
        let sent: Vec<Segment> = one.iter().map(|t| t.src).collect();
        let landed: Vec<Segment> = one.iter().map(|t| t.dst).collect();
        assert_eq!(
            checksum_segments(&src_cache, &sent),
            checksum_segments(&dst_cache, &landed)
        );
    }
    // Nothing outside the granted blocks was written.
    let others: Vec<u32> = (0..24).filter(|b| !dst_blocks.contains(b)).collect();
    let others = dst.segments(&others).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        checksum_segments(&dst_cache, &others),
        checksum_segments(&untouched_before, &others)
    );
}

#[test]
fn transfers_between_every_pair_of_layout_kinds_land_exactly_on_the_granted_blocks() {
    let kinds = [LayoutKind::PerLayer, LayoutKind::BlockContiguous];
    for src_kind in kinds {
        for dst_kind in kinds {
            run_transfer(src_kind, dst_kind, &[3, 4, 5, 15, 0], &[10, 11, 23, 0, 1]);
        }
    }
}

proptest! {
    #[test]
    fn random_transfers_land_exactly_on_the_granted_blocks(
        picks in proptest::sample::subsequence((0u32..16).collect::<Vec<_>>(), 0..=16).prop_shuffle(),
        offset in 0u32..8,
        src_contiguous: bool,
        dst_contiguous: bool,
    ) {
        let kind = |contiguous| if contiguous { LayoutKind::BlockContiguous } else { LayoutKind::PerLayer };
        let dst_blocks: Vec<u32> = picks.iter().map(|b| (b * 7 + offset) % 24).collect();
        // 7 is coprime to 24, so distinct source ids map to distinct destination ids.
        let mut unique = dst_blocks.clone();
        unique.sort_unstable();
        unique.dedup();
        prop_assert_eq!(unique.len(), dst_blocks.len());
        run_transfer(kind(src_contiguous), kind(dst_contiguous), &picks, &dst_blocks);
    }
}
