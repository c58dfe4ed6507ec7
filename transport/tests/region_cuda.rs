//! Regions over device memory laid out as engines hold it: an engine's per-layer K and V
//! tensors registered by address, blocks read and written through the driver, copied to
//! and from host regions of other layouts. Needs a GPU; without one it prints why and
//! returns (device regions refusing CPU access are checked in `data_ucx_cuda.rs`).

use std::sync::Arc;

use handoff_gpu::{DeviceBuffer, KvBuffer};
use handoff_transport::{BlockId, KvLayout, KvMemory, KvShape, Region};

const BLOCKS: u32 = 16;
const HALF: usize = 96;
const LAYERS: u32 = 3;

#[test]
fn per_layer_device_tensors_round_trip_blocks_through_other_layouts() {
    let tensor = 2 * BLOCKS as usize * HALF;
    let buffer = match DeviceBuffer::alloc_zeroed(0, LAYERS as usize * tensor) {
        Ok(b) => Arc::new(b),
        Err(e) => {
            let why = format!("no device memory: {e}");
            handoff_testkit::skip_this(handoff_testkit::Need::Gpu, &why);
            return;
        }
    };
    let bases: Vec<u64> = (0..u64::from(LAYERS))
        .map(|l| buffer.addr() + l * tensor as u64)
        .collect();
    let layout = KvLayout::kv_halves(&bases, BLOCKS, HALF, KvMemory::Cuda { device: 0 });
    // SAFETY: every range lies inside `buffer`, which the region keeps alive; nothing else
    // touches it.
    let device = unsafe { Region::from_layout(layout, Box::new(Arc::clone(&buffer))) }
        .unwrap_or_else(|e| panic!("{e}"));
    let host = Region::alloc(KvLayout::shaped(KvShape::LayerBlocks, LAYERS, BLOCKS, HALF))
        .unwrap_or_else(|e| panic!("{e}"));
    let back = Region::new(BLOCKS, device.block_bytes()).unwrap_or_else(|e| panic!("{e}"));
    let data: Vec<u8> = (0..device.block_bytes())
        .map(|i| (i * 7 + 3) as u8)
        .collect();
    host.write_block(BlockId(2), &data)
        .unwrap_or_else(|e| panic!("{e}"));
    Region::copy_blocks(&host, &[BlockId(2)], &device, &[BlockId(9)])
        .unwrap_or_else(|e| panic!("{e}"));
    Region::copy_blocks(&device, &[BlockId(9)], &back, &[BlockId(0)])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back.read_block(BlockId(0)), Ok(data.clone()));
    // Layer 1's V half of block 9 sits where vLLM puts it: tensor 1, V half, block 9.
    let mut v = vec![0u8; HALF];
    let at = tensor + BLOCKS as usize * HALF + 9 * HALF;
    buffer
        .read_at(at as u64, &mut v)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(v, data[3 * HALF..4 * HALF]);
}
