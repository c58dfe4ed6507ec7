//! KV-cache layouts: pinned offsets for real model shapes, the validation errors, and
//! properties of segments and transfer plans over random block lists.

use handoff_gpu::{
    coalesce, transfer_plan, GpuError, KvLayout, KvShape, LayoutKind, Segment,
    BLOCKS_PER_REQUEST_MAX, LAYERS_MAX,
};
use proptest::prelude::*;

/// Llama-3-8B: 32 layers, 8 KV heads of 128, bf16, 16-token blocks; 1000 blocks.
fn llama3_8b(tp_rank: u32, tp_size: u32) -> KvShape {
    KvShape {
        layers: 32,
        num_blocks: 1000,
        block_size_tokens: 16,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        tp_rank,
        tp_size,
    }
}

fn layout(shape: KvShape, kind: LayoutKind) -> KvLayout {
    match KvLayout::new(shape, kind) {
        Ok(layout) => layout,
        Err(error) => panic!("test layout rejected: {error}"),
    }
}

fn seg(region: u32, offset: u64, len: u64) -> Segment {
    Segment {
        region,
        offset,
        len,
    }
}

/// K or V of one block in one layer: 16 tokens * 8 heads * 128 * 2 bytes.
const HALF: u64 = 32_768;

#[test]
fn llama3_8b_per_layer_sizes_are_pinned() {
    let kv = layout(llama3_8b(0, 1), LayoutKind::PerLayer);
    assert_eq!(kv.half_block_bytes(), HALF);
    assert_eq!(kv.block_bytes_per_layer(), Ok(65_536));
    assert_eq!(kv.block_bytes(), Ok(2_097_152));
    assert_eq!(kv.region_count(), 32);
    assert_eq!(kv.region_bytes(), 65_536_000);
    assert_eq!(kv.total_bytes(), 2_097_152_000);
}

#[test]
fn llama3_8b_per_layer_block_offsets_are_pinned() {
    let kv = layout(llama3_8b(0, 1), LayoutKind::PerLayer);
    let segments = kv.segments(&[7]).unwrap_or_default();
    assert_eq!(segments.len(), 64, "K and V in each of 32 layers");
    // K of block 7 at 7 * 32768; V after all 1000 K blocks.
    assert_eq!(segments[0], seg(0, 229_376, HALF));
    assert_eq!(segments[1], seg(0, 32_768_000 + 229_376, HALF));
    assert_eq!(segments[6], seg(3, 229_376, HALF));
    assert_eq!(segments[63], seg(31, 32_997_376, HALF));
}

#[test]
fn per_layer_consecutive_blocks_coalesce_within_each_layer_and_plane() {
    let kv = layout(llama3_8b(0, 1), LayoutKind::PerLayer);
    let segments = kv.segments(&[7, 8, 9]).unwrap_or_default();
    assert_eq!(segments.len(), 64);
    assert_eq!(segments[0], seg(0, 229_376, 3 * HALF));
    assert_eq!(segments[1], seg(0, 32_997_376, 3 * HALF));
    // Descending ids are not contiguous in list order, so nothing merges.
    assert_eq!(kv.segments(&[9, 8]).map(|s| s.len()), Ok(128));
}

#[test]
fn per_layer_last_k_block_runs_into_first_v_block() {
    // K of the last block ends exactly where V of block 0 starts: one range.
    let kv = layout(llama3_8b(0, 1), LayoutKind::PerLayer);
    // Order is K0, K999, V0, V999: K999 and V0 are adjacent in list and in memory.
    let segments = kv.segments(&[0, 999]).unwrap_or_default();
    assert_eq!(segments[0], seg(0, 0, HALF));
    assert_eq!(segments[1], seg(0, 999 * HALF, 2 * HALF));
    assert_eq!(segments[2], seg(0, 1000 * HALF + 999 * HALF, HALF));
    assert_eq!(segments.len(), 3 * 32);
}

#[test]
fn llama3_8b_block_contiguous_offsets_are_pinned() {
    let kv = layout(llama3_8b(0, 1), LayoutKind::BlockContiguous);
    assert_eq!(kv.region_count(), 1);
    assert_eq!(kv.region_bytes(), 2_097_152_000);
    assert_eq!(kv.total_bytes(), 2_097_152_000);
    assert_eq!(kv.segments(&[7]), Ok(vec![seg(0, 14_680_064, 2_097_152)]));
    assert_eq!(
        kv.segments(&[7, 8, 9]),
        Ok(vec![seg(0, 14_680_064, 6_291_456)])
    );
    assert_eq!(
        kv.segments(&[3, 7, 8]),
        Ok(vec![
            seg(0, 6_291_456, 2_097_152),
            seg(0, 14_680_064, 4_194_304)
        ])
    );
}

#[test]
fn tensor_parallel_two_halves_the_heads() {
    let rank1 = layout(llama3_8b(1, 2), LayoutKind::PerLayer);
    assert_eq!(rank1.kv_heads_per_rank(), 4);
    assert_eq!(rank1.kv_heads_held(), 4..8);
    assert_eq!(rank1.half_block_bytes(), HALF / 2);
    assert_eq!(rank1.total_bytes(), 2_097_152_000 / 2);
    assert_eq!(
        rank1.segments(&[7]).map(|s| s[1]),
        Ok(seg(0, 1000 * 16_384 + 7 * 16_384, 16_384))
    );
}

#[test]
fn more_ranks_than_kv_heads_replicates_one_head_per_rank() {
    let rank5 = layout(llama3_8b(5, 16), LayoutKind::PerLayer);
    assert_eq!(rank5.kv_heads_per_rank(), 1);
    assert_eq!(rank5.kv_heads_held(), 2..3, "ranks 4 and 5 share head 2");
    assert_eq!(rank5.half_block_bytes(), HALF / 8);
}

#[test]
fn impossible_tensor_parallel_splits_are_named_errors() {
    let error = |tp_rank, tp_size| GpuError::TensorParallel {
        tp_rank,
        tp_size,
        kv_heads: 8,
    };
    assert_eq!(
        KvLayout::new(llama3_8b(0, 3), LayoutKind::PerLayer),
        Err(error(0, 3))
    );
    assert_eq!(
        KvLayout::new(llama3_8b(0, 12), LayoutKind::PerLayer),
        Err(error(0, 12))
    );
    assert_eq!(
        KvLayout::new(llama3_8b(2, 2), LayoutKind::PerLayer),
        Err(error(2, 2))
    );
}

#[test]
fn zero_dimensions_are_rejected_by_name() {
    type Setter = fn(&mut KvShape);
    let cases: [(&str, Setter); 7] = [
        ("layers", |s| s.layers = 0),
        ("num_blocks", |s| s.num_blocks = 0),
        ("block_size_tokens", |s| s.block_size_tokens = 0),
        ("kv_heads", |s| s.kv_heads = 0),
        ("head_dim", |s| s.head_dim = 0),
        ("dtype_bytes", |s| s.dtype_bytes = 0),
        ("tp_size", |s| s.tp_size = 0),
    ];
    for (field, set) in cases {
        let mut shape = llama3_8b(0, 1);
        set(&mut shape);
        assert_eq!(
            KvLayout::new(shape, LayoutKind::PerLayer),
            Err(GpuError::ZeroDimension { field })
        );
    }
}

#[test]
fn sizes_that_overflow_u64_are_a_named_error() {
    let shape = KvShape {
        layers: LAYERS_MAX,
        num_blocks: u32::MAX,
        block_size_tokens: u32::MAX,
        kv_heads: 1,
        head_dim: u32::MAX,
        dtype_bytes: 8,
        tp_rank: 0,
        tp_size: 1,
    };
    for kind in [LayoutKind::PerLayer, LayoutKind::BlockContiguous] {
        assert!(matches!(
            KvLayout::new(shape, kind),
            Err(GpuError::Overflow { .. })
        ));
    }
    let too_deep = KvShape {
        layers: LAYERS_MAX + 1,
        ..llama3_8b(0, 1)
    };
    assert!(matches!(
        KvLayout::new(too_deep, LayoutKind::PerLayer),
        Err(GpuError::DimensionTooLarge {
            field: "layers",
            ..
        })
    ));
}

#[test]
fn bad_block_lists_are_named_errors() {
    let kv = layout(llama3_8b(0, 1), LayoutKind::BlockContiguous);
    assert_eq!(
        kv.segments(&[3, 1000]),
        Err(GpuError::BlockOutOfRange {
            block: 1000,
            num_blocks: 1000
        })
    );
    assert_eq!(
        kv.segments(&[3, 4, 3]),
        Err(GpuError::DuplicateBlock { block: 3 })
    );
    let too_many = vec![0; BLOCKS_PER_REQUEST_MAX + 1];
    assert!(matches!(
        kv.segments(&too_many),
        Err(GpuError::TooManyBlocks { .. })
    ));
    assert_eq!(kv.segments(&[]), Ok(vec![]));
}

#[test]
fn coalesce_merges_only_runs_in_order_within_one_region() {
    let input = [
        seg(0, 0, 10),
        seg(0, 10, 5),
        seg(1, 15, 5),
        seg(1, 20, 5),
        seg(1, 0, 5),
        seg(1, 5, 5),
    ];
    assert_eq!(
        coalesce(&input),
        vec![seg(0, 0, 15), seg(1, 15, 10), seg(1, 0, 10)]
    );
}

#[test]
fn transfer_plan_between_block_contiguous_caches_is_one_copy_per_common_run() {
    let src = layout(llama3_8b(0, 1), LayoutKind::BlockContiguous);
    let dst = layout(
        KvShape {
            num_blocks: 50,
            ..llama3_8b(0, 1)
        },
        LayoutKind::BlockContiguous,
    );
    let plan = transfer_plan(&src, &[3, 4, 5], &dst, &[10, 11, 20]).unwrap_or_default();
    let block = 2_097_152;
    assert_eq!(plan.len(), 2);
    assert_eq!(
        (plan[0].src, plan[0].dst),
        (seg(0, 3 * block, 2 * block), seg(0, 10 * block, 2 * block))
    );
    assert_eq!(
        (plan[1].src, plan[1].dst),
        (seg(0, 5 * block, block), seg(0, 20 * block, block))
    );
}

#[test]
fn transfer_plan_from_per_layer_to_block_contiguous_pairs_each_layer_half() {
    let src = layout(llama3_8b(0, 1), LayoutKind::PerLayer);
    let dst = layout(llama3_8b(0, 1), LayoutKind::BlockContiguous);
    let plan = transfer_plan(&src, &[7], &dst, &[2]).unwrap_or_default();
    assert_eq!(plan.len(), 64);
    // V of layer 1 in block 7 goes to slot (layer 1, V) = 3 of block 2.
    assert_eq!(plan[3].src, seg(1, 32_768_000 + 7 * HALF, HALF));
    assert_eq!(plan[3].dst, seg(0, 2 * 2_097_152 + 3 * HALF, HALF));
}

#[test]
fn transfer_plan_rejects_mismatched_layouts_and_lists() {
    let src = layout(llama3_8b(0, 1), LayoutKind::PerLayer);
    let tp2 = layout(llama3_8b(0, 2), LayoutKind::PerLayer);
    assert!(matches!(
        transfer_plan(&src, &[1], &tp2, &[1]),
        Err(GpuError::LayoutMismatch { .. })
    ));
    assert_eq!(
        transfer_plan(&src, &[1, 2], &src, &[1]),
        Err(GpuError::BlockCountMismatch { src: 2, dst: 1 })
    );
    assert_eq!(
        transfer_plan(&src, &[1], &src, &[1000]),
        Err(GpuError::BlockOutOfRange {
            block: 1000,
            num_blocks: 1000
        })
    );
}

fn small_shape() -> impl Strategy<Value = KvShape> {
    (1u32..5, 1u32..40, 1u32..5, 1u32..4, 1u32..9, 1u32..3).prop_map(
        |(layers, num_blocks, block_size_tokens, kv_heads, head_dim, dtype_bytes)| KvShape {
            layers,
            num_blocks,
            block_size_tokens,
            kv_heads,
            head_dim,
            dtype_bytes,
            tp_rank: 0,
            tp_size: 1,
        },
    )
}

fn kind() -> impl Strategy<Value = LayoutKind> {
    prop_oneof![
        Just(LayoutKind::PerLayer),
        Just(LayoutKind::BlockContiguous)
    ]
}

/// A shape and a shuffled list of distinct blocks in it.
fn shape_and_blocks() -> impl Strategy<Value = (KvShape, Vec<u32>)> {
    small_shape().prop_flat_map(|shape| {
        let all: Vec<u32> = (0..shape.num_blocks).collect();
        let n = all.len();
        (
            Just(shape),
            proptest::sample::subsequence(all, 0..=n).prop_shuffle(),
        )
    })
}

proptest! {
    #[test]
    fn segments_never_overlap_stay_inside_and_cover_exactly_the_blocks(
        (shape, blocks) in shape_and_blocks(),
        kind in kind(),
    ) {
        let kv = KvLayout::new(shape, kind).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let segments = kv.segments(&blocks).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let covered: u64 = segments.iter().map(|s| s.len).sum();
        prop_assert_eq!(covered, blocks.len() as u64 * kv.block_bytes().unwrap_or(0));
        for pair in segments.windows(2) {
            prop_assert!(!pair[0].is_followed_by(&pair[1]), "left uncoalesced: {:?}", pair);
        }
        let mut sorted = segments.clone();
        sorted.sort();
        for s in &sorted {
            prop_assert!(s.len > 0 && s.region < kv.region_count());
            prop_assert!(s.offset + s.len <= kv.region_bytes());
        }
        for pair in sorted.windows(2) {
            let overlap = pair[0].region == pair[1].region && pair[0].offset + pair[0].len > pair[1].offset;
            prop_assert!(!overlap, "overlap: {:?}", pair);
        }
    }

    #[test]
    fn transfer_plans_pair_equal_lengths_and_cover_both_sides(
        (shape, src_blocks) in shape_and_blocks(),
        src_kind in kind(),
        dst_kind in kind(),
        dst_extra in 0u32..20,
    ) {
        let src = KvLayout::new(shape, src_kind).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let dst_shape = KvShape { num_blocks: shape.num_blocks + dst_extra, ..shape };
        let dst = KvLayout::new(dst_shape, dst_kind).map_err(|e| TestCaseError::fail(e.to_string()))?;
        // Destination blocks: the source ids reversed and shifted, so runs differ.
        let dst_blocks: Vec<u32> = src_blocks.iter().rev().map(|b| b + dst_extra).collect();
        let plan = transfer_plan(&src, &src_blocks, &dst, &dst_blocks)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let expected = src_blocks.len() as u64 * src.block_bytes().unwrap_or(0);
        prop_assert!(plan.iter().all(|t| t.src.len == t.dst.len && t.src.len > 0));
        prop_assert_eq!(plan.iter().map(|t| t.src.len).sum::<u64>(), expected);
        let dst_segments: Vec<Segment> = plan.iter().map(|t| t.dst).collect();
        let mut sorted = dst_segments;
        sorted.sort();
        for pair in sorted.windows(2) {
            let overlap = pair[0].region == pair[1].region && pair[0].offset + pair[0].len > pair[1].offset;
            prop_assert!(!overlap, "destination overlap: {:?}", pair);
        }
    }
}
