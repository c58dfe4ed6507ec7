//! The UCX data plane over KV layouts of several ranges, between two processes (the test
//! re-executes its own binary as a child, env `HANDOFF_UCX_LAYOUT_CHILD` naming the
//! child's layout): an engine-style vLLM layout (a `[2, blocks, ...]` tensor per layer, so
//! a K and a V range per layer, registered by address) moves blocks into and out of
//! differently laid out peers (FlashInfer-style one range per layer, SGLang-style separate
//! K and V buffers, one contiguous range), whole and by layer slices, every transfer
//! checked by checksums of the logical blocks on both sides. A peer whose layout lies
//! (ranges longer than what it advertises, blocks past its layout, sizes that do not add
//! up, bad keys) is refused by name with nothing posted. Skips with a printed reason when
//! libucp cannot be loaded.

mod data_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use data_common::{
    checksum, fill, format_ids, ids, layout_ready_line, parse_layout_ready, say, serve_commands,
    ChildPeer, Rng,
};
use handoff_transport::data::{DataError, UcxDataPlane, UcxPeer, UcxPlaneOptions, UcxRange};
use handoff_transport::ucx::ContextOptions;
use handoff_transport::{
    BlockId, BlockSlice, KvLayout, KvMemory, KvRange, LayerSpan, RankInfo, Region, RequestId,
};

const CHILD_ENV: &str = "HANDOFF_UCX_LAYOUT_CHILD";
const PREFIX: &str = "UCX_LAYOUT_CHILD ";
const BLOCKS: u32 = 48;
const LAYERS: usize = 4;
/// Bytes of one layer's K (or V) in one block.
const HALF: usize = 4 * 1024;
/// The logical block: every layer's K and V.
const BLOCK_BYTES: usize = LAYERS * 2 * HALF;
const STEP: Duration = Duration::from_secs(30);
const CHILD_LIFETIME: Duration = Duration::from_secs(120);

fn options() -> UcxPlaneOptions {
    UcxPlaneOptions {
        context: ContextOptions {
            keepalive_interval: Some(Duration::from_millis(200)),
            ..ContextOptions::default()
        },
        ..UcxPlaneOptions::default()
    }
}

fn layout(ranges: Vec<KvRange>) -> KvLayout {
    KvLayout {
        blocks: BLOCKS,
        ranges,
        memory: KvMemory::Host,
        layers: LayerSpan {
            first: 0,
            count: LAYERS as u32,
            total: LAYERS as u32,
        },
        block_tokens: 16,
        dtype_bytes: 2,
        heads: None,
    }
}

/// vLLM: one `[2, blocks, ...]` tensor per layer, K half then V half (offsets into one
/// heap allocation, as `Region::alloc` takes them).
fn vllm_layout() -> KvLayout {
    let tensor = 2 * BLOCKS as u64 * HALF as u64;
    let mut ranges = Vec::new();
    for layer in 0..LAYERS as u64 {
        // A gap between tensors, as separate allocations would have.
        let base = layer * (tensor + 4096);
        ranges.push(KvRange {
            addr: base,
            stride: HALF,
            bytes: HALF,
        });
        ranges.push(KvRange {
            addr: base + BLOCKS as u64 * HALF as u64,
            stride: HALF,
            bytes: HALF,
        });
    }
    layout(ranges)
}

/// SGLang: separate K and V buffers per layer, all K buffers first in memory (the
/// logical order stays layer 0 K, layer 0 V, ...).
fn sglang_layout() -> KvLayout {
    let buffer = BLOCKS as u64 * HALF as u64;
    let mut ranges = Vec::new();
    for layer in 0..LAYERS as u64 {
        ranges.push(KvRange {
            addr: layer * buffer,
            stride: HALF,
            bytes: HALF,
        });
        ranges.push(KvRange {
            addr: (LAYERS as u64 + layer) * buffer,
            stride: HALF,
            bytes: HALF,
        });
    }
    layout(ranges)
}

/// A plane over an engine-style heap layout, registered by address; `None` (reason
/// printed) where UCX cannot be loaded.
fn engine_plane(test: &str, name: &str, layout: KvLayout) -> Option<UcxDataPlane> {
    let region = Arc::new(Region::alloc(layout).expect("test layout"));
    match UcxDataPlane::start_on_region(region, &RankInfo::single(name), options()) {
        Ok(plane) => Some(plane),
        Err(e) if e.is_ucx_unavailable() => {
            let why = format!("libucp not usable here: {e}");
            handoff_testkit::skip(handoff_testkit::Need::Ucx, test, &why);
            None
        }
        Err(e) => panic!("{test}: UCX data plane failed to start: {e}"),
    }
}

/// Not a test by itself: the child's entry point (a no-op unless `CHILD_ENV` is set).
#[test]
fn ucx_layout_child_process_entry() {
    let Some(kind) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let me = RankInfo::single("decode-child");
    let plane = match kind.to_str() {
        // FlashInfer: one `[blocks, 2, ...]` tensor per layer, UCX-allocated.
        Some("flashinfer") => {
            UcxDataPlane::start_allocated(BLOCKS, &[2 * HALF; LAYERS], &me, options())
        }
        Some("sglang") => {
            let region = Arc::new(Region::alloc(sglang_layout()).expect("test layout"));
            UcxDataPlane::start_on_region(region, &me, options())
        }
        _ => UcxDataPlane::start(BLOCKS, BLOCK_BYTES, &me, options()),
    };
    let plane = match plane {
        Ok(plane) => plane,
        Err(e) => {
            say(PREFIX, &format!("error {e}"));
            std::process::exit(0);
        }
    };
    say(PREFIX, &layout_ready_line(&plane));
    serve_commands(PREFIX, plane.region(), CHILD_LIFETIME);
}

fn spawn_child(kind: &str) -> (ChildPeer, UcxPeer) {
    let mut child = ChildPeer::spawn(
        "ucx_layout_child_process_entry",
        &[(CHILD_ENV, kind.into())],
        PREFIX,
    );
    let peer = parse_layout_ready(&child.expect(STEP), "decode-child");
    (child, peer)
}

fn deadline() -> Instant {
    Instant::now() + STEP
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_layer_ranges_move_into_differently_laid_out_peers_with_matching_checksums() {
    let Some(plane) = engine_plane("ucx layouts", "prefill", vllm_layout()) else {
        return;
    };
    let local = plane.region();
    assert_eq!(local.block_bytes(), BLOCK_BYTES);
    let r = RequestId::new("r1");
    for (i, kind) in ["flashinfer", "sglang", "one"].into_iter().enumerate() {
        let (mut child, peer) = spawn_child(kind);
        assert_eq!(
            peer.range_list().len(),
            match kind {
                "flashinfer" => LAYERS,
                "sglang" => 2 * LAYERS,
                _ => 1,
            }
        );
        // Push: our blocks 0..n into the child's permuted positions.
        fill(local, 31 + i as u64);
        let src = ids(0..BLOCKS);
        let dst = Rng::new(7 + i as u64).permutation(BLOCKS);
        plane
            .write(&r, &peer, &src, &dst, deadline())
            .await
            .unwrap();
        let remote = child.ask(&format!("checksum {}", format_ids(&dst)), STEP);
        assert_eq!(
            remote,
            format!("checksum {}", checksum(local, &src)),
            "write into {kind}"
        );
        // Runs of contiguous blocks in another order (each range's runs coalesce, and
        // close where the next block does not continue them): every byte lands.
        fill(local, 131 + i as u64);
        let runs: Vec<BlockId> = (0..BLOCKS)
            .collect::<Vec<_>>()
            .chunks(3)
            .rev()
            .flatten()
            .map(|&b| BlockId(b))
            .collect();
        plane
            .write(&r, &peer, &src, &runs, deadline())
            .await
            .unwrap();
        let remote = child.ask(&format!("checksum {}", format_ids(&runs)), STEP);
        assert_eq!(
            remote,
            format!("checksum {}", checksum(local, &src)),
            "runs into {kind}"
        );
        // Pull: the child's permuted blocks into ours.
        assert_eq!(child.ask("fill 9", STEP), "filled");
        let from = Rng::new(70 + i as u64).permutation(BLOCKS);
        plane
            .read(&r, &peer, &from, &src, deadline())
            .await
            .unwrap();
        let remote = child.ask(&format!("checksum {}", format_ids(&from)), STEP);
        assert_eq!(
            remote,
            format!("checksum {}", checksum(local, &src)),
            "read from {kind}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_slice_moves_only_those_layers() {
    let Some(plane) = engine_plane("ucx layer slice", "prefill", vllm_layout()) else {
        return;
    };
    let (mut child, peer) = spawn_child("flashinfer");
    let local = plane.region();
    fill(local, 5);
    assert_eq!(child.ask("fill 6", STEP), "filled");
    // Layers 1 and 2 of every block (a pipeline stage's share), into permuted blocks.
    let slice = BlockSlice {
        src_offset: 2 * HALF,
        dst_offset: 2 * HALF,
        len: 4 * HALF,
    };
    let src = ids(0..BLOCKS);
    let dst = Rng::new(3).permutation(BLOCKS);
    plane
        .write_slices(
            &RequestId::new("r1"),
            &peer,
            &src,
            &dst,
            &[slice],
            deadline(),
        )
        .await
        .unwrap();
    // What the child must now hold: its own pattern with those layers replaced.
    let expected = Region::new(BLOCKS, BLOCK_BYTES).unwrap();
    fill(&expected, 6);
    Region::copy_block_slices(local, &src, &expected, &dst, slice).unwrap();
    let all = ids(0..BLOCKS);
    let remote = child.ask(&format!("checksum {}", format_ids(&all)), STEP);
    assert_eq!(remote, format!("checksum {}", checksum(&expected, &all)));
    // Two slices in one call, each to another offset (as TP ranks' heads pair): layer 0's
    // K half into layer 3's V half, and half of layer 3's V half into layer 0's V half.
    let slices = [
        BlockSlice {
            src_offset: 0,
            dst_offset: 7 * HALF,
            len: HALF,
        },
        BlockSlice {
            src_offset: 7 * HALF,
            dst_offset: HALF,
            len: HALF / 2,
        },
    ];
    assert_eq!(child.ask("fill 8", STEP), "filled");
    plane
        .write_slices(
            &RequestId::new("r2"),
            &peer,
            &src,
            &dst,
            &slices,
            deadline(),
        )
        .await
        .unwrap();
    fill(&expected, 8);
    for slice in slices {
        Region::copy_block_slices(local, &src, &expected, &dst, slice).unwrap();
    }
    let remote = child.ask(&format!("checksum {}", format_ids(&all)), STEP);
    assert_eq!(remote, format!("checksum {}", checksum(&expected, &all)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_lying_about_its_layout_is_refused_by_name_with_nothing_posted() {
    let Some(plane) = engine_plane("ucx lying peer", "prefill", vllm_layout()) else {
        return;
    };
    let (mut child, peer) = spawn_child("flashinfer");
    assert_eq!(child.ask("fill 3", STEP), "filled");
    let all = ids(0..BLOCKS);
    let before = child.ask(&format!("checksum {}", format_ids(&all)), STEP);
    let r = RequestId::new("r1");
    let with_ranges = |f: &dyn Fn(&mut Vec<UcxRange>)| {
        let mut lying = peer.clone();
        let mut ranges = lying.ranges.to_vec();
        f(&mut ranges);
        lying.ranges = ranges.into();
        lying
    };
    let liars: Vec<(&str, UcxPeer)> = vec![
        (
            "a range shorter than its blocks",
            with_ranges(&|r| r[2].len -= 1),
        ),
        (
            "a range whose blocks run past the address space",
            with_ranges(&|r| r[1].addr = u64::MAX - 4096),
        ),
        (
            "a stride that walks out of the range",
            with_ranges(&|r| r[3].stride *= 2),
        ),
        (
            "ranges that do not add up to the block",
            with_ranges(&|r| {
                r.pop();
            }),
        ),
        (
            "an empty remote key",
            with_ranges(&|r| r[0].remote_key.clear()),
        ),
        ("more ranges than allowed", {
            with_ranges(&|r| {
                let one = r[0].clone();
                r.resize(handoff_transport::RANGES_MAX + 1, one);
            })
        }),
        ("more blocks than its ranges hold", {
            let mut lying = peer.clone();
            lying.region.len += BLOCK_BYTES as u64;
            lying
        }),
    ];
    for (what, lying) in liars {
        // Even block 0, which the true layout has, is refused: the layout is a lie.
        let err = plane
            .write(&r, &lying, &[BlockId(0)], &[BlockId(0)], deadline())
            .await
            .unwrap_err();
        assert!(
            matches!(&err, DataError::Protocol { peer, .. } if peer == "decode-child"),
            "{what}: {err}"
        );
        println!("{what}: {err}");
    }
    // A block past the (true) layout.
    let err = plane
        .write(&r, &peer, &[BlockId(0)], &[BlockId(BLOCKS)], deadline())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, DataError::Protocol { peer, .. } if peer == "decode-child"),
        "{err}"
    );
    let after = child.ask(&format!("checksum {}", format_ids(&all)), STEP);
    assert_eq!(before, after, "nothing was written");
    // The plane and the peer still work, with the true layout.
    plane
        .write(&r, &peer, &[BlockId(1)], &[BlockId(2)], deadline())
        .await
        .unwrap();
    let remote = child.ask("checksum 2", STEP);
    assert_eq!(
        remote,
        format!("checksum {}", checksum(plane.region(), &[BlockId(1)]))
    );
}
