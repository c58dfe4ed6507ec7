//! The UCX data plane on CUDA memory, in one process: two planes on one GPU (device to
//! device) and a device plane with a host plane (GPU to host and back), every transfer
//! checked by checksums of the destination blocks, computed from copies back to the host.
//! The two-process same-GPU case (`cuda_ipc`) is `tests/bench_cli.rs` at the workspace
//! root, which runs `handoff bench --memory cuda`.
//!
//! These tests need a GPU and a UCX built with CUDA, named by `HANDOFF_UCX_LIB` (the
//! `libucx-cu12` wheel's `libucp.so`); without either they print why and return. With
//! both, any failure is a failure. Without a GPU they still check that device regions
//! refuse CPU access by name.

mod data_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use data_common::{checksum, fill, ids, Rng};
use handoff_gpu::{DeviceBuffer, GpuError, MemoryKind};
use handoff_transport::data::{DataError, UcxDataPlane, UcxPlaneOptions};
use handoff_transport::region::RegionError;
use handoff_transport::{BlockId, RankInfo, Region, RequestId};

const BLOCKS: u32 = 64;
const BLOCK_BYTES: usize = 256 * 1024;
const DEADLINE: Duration = Duration::from_secs(60);

/// Says once per test binary, past the harness's capture, why these tests do not run.
fn skip(reason: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use std::io::Write;
        let line = format!("handoff-transport: CUDA data-plane tests skipped: {reason}\n");
        let _ = std::io::stderr().write_all(line.as_bytes());
    });
}

/// The GPU to use, or `None` (reason printed) where there is none or no CUDA-capable UCX.
fn gpu() -> Option<u32> {
    match handoff_gpu::probe() {
        Ok(_) => {}
        Err(e @ (GpuError::NoDriver { .. } | GpuError::NoDevice)) => {
            skip(&e.to_string());
            return None;
        }
        Err(other) => panic!("CUDA probe failed with a driver present: {other}"),
    }
    if std::env::var_os("HANDOFF_UCX_LIB").is_none() {
        skip("HANDOFF_UCX_LIB is not set: name a libucp built with CUDA (the libucx-cu12 wheel's)");
        return None;
    }
    Some(0)
}

fn device_plane(name: &str, device: u32) -> UcxDataPlane {
    let buffer = DeviceBuffer::alloc_zeroed(device, BLOCKS as usize * BLOCK_BYTES)
        .unwrap_or_else(|e| panic!("device allocation: {e}"));
    UcxDataPlane::start_on_device(
        Arc::new(buffer),
        BLOCKS,
        BLOCK_BYTES,
        &RankInfo::single(name),
        UcxPlaneOptions::default(),
    )
    .unwrap_or_else(|e| panic!("UCX plane on device memory: {e}"))
}

fn host_plane(name: &str, device: u32) -> UcxDataPlane {
    let options = UcxPlaneOptions {
        cuda_device: Some(device),
        ..UcxPlaneOptions::default()
    };
    UcxDataPlane::start(BLOCKS, BLOCK_BYTES, &RankInfo::single(name), options)
        .unwrap_or_else(|e| panic!("UCX plane on host memory: {e}"))
}

/// Pushes every block of `a` to a permutation of `b`'s, then pulls them back into other
/// positions of `a`, checking the bytes after each.
async fn round_trip(a: &UcxDataPlane, b: &UcxDataPlane, seed: u64) {
    let request = RequestId::new("cuda-round-trip");
    let half = BLOCKS / 2;
    let src = ids(0..half);
    let perm: Vec<BlockId> = Rng::new(seed)
        .permutation(BLOCKS)
        .into_iter()
        .take(half as usize)
        .collect();
    fill(a.region(), seed);
    let deadline = Instant::now() + DEADLINE;
    a.write(&request, b.descriptor(), &src, &perm, deadline)
        .await
        .unwrap_or_else(|e| panic!("write: {e}"));
    assert_eq!(
        checksum(a.region(), &src),
        checksum(b.region(), &perm),
        "pushed blocks differ"
    );
    // Pull them back into the other half of `a`.
    let back = ids(half..BLOCKS);
    a.read(&request, b.descriptor(), &perm, &back, deadline)
        .await
        .unwrap_or_else(|e| panic!("read: {e}"));
    assert_eq!(
        checksum(a.region(), &src),
        checksum(a.region(), &back),
        "pulled blocks differ"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_to_device_on_one_gpu() {
    let Some(device) = gpu() else { return };
    let a = device_plane("prefill-gpu", device);
    let b = device_plane("decode-gpu", device);
    assert_eq!(a.region().memory_kind(), MemoryKind::Cuda);
    eprintln!("{}", a.version());
    round_trip(&a, &b, 11).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_to_host_and_host_to_device() {
    let Some(device) = gpu() else { return };
    let gpu_side = device_plane("prefill-gpu", device);
    let host_side = host_plane("decode-host", device);
    assert_eq!(host_side.region().memory_kind(), MemoryKind::Host);
    // The device plane drives both directions, then the host plane does.
    round_trip(&gpu_side, &host_side, 12).await;
    round_trip(&host_side, &gpu_side, 13).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_plane_checks_blocks_and_sizes_before_posting() {
    let Some(device) = gpu() else { return };
    let a = device_plane("a", device);
    let b = device_plane("b", device);
    let request = RequestId::new("bad");
    let deadline = Instant::now() + DEADLINE;
    let err = a
        .write(
            &request,
            b.descriptor(),
            &[BlockId(0)],
            &[BlockId(BLOCKS)],
            deadline,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, DataError::Protocol { .. }), "{err}");
    let err = a
        .write(
            &request,
            b.descriptor(),
            &[BlockId(BLOCKS)],
            &[BlockId(0)],
            deadline,
        )
        .await
        .unwrap_err();
    assert!(matches!(err, DataError::Region(_)), "{err}");
    // A buffer smaller than the blocks asked for is refused before UCX starts.
    let small = Arc::new(DeviceBuffer::alloc_zeroed(device, BLOCK_BYTES).unwrap());
    let err = UcxDataPlane::start_on_device(
        small,
        2,
        BLOCK_BYTES,
        &RankInfo::single("small"),
        UcxPlaneOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(err, DataError::Region(RegionError::DeviceTooSmall { .. })),
        "{err}"
    );
}

/// Runs everywhere there is a GPU, UCX or not: a device region is reached by driver
/// copies, and refuses raw CPU access by name.
#[test]
fn device_region_copies_through_the_driver_and_refuses_cpu_pointers() {
    match handoff_gpu::probe() {
        Ok(_) => {}
        Err(e @ (GpuError::NoDriver { .. } | GpuError::NoDevice)) => {
            skip(&e.to_string());
            return;
        }
        Err(other) => panic!("CUDA probe failed with a driver present: {other}"),
    }
    let buffer = Arc::new(DeviceBuffer::alloc_zeroed(0, 8 * 4096).unwrap());
    let region = Region::on_device(Arc::clone(&buffer), 8, 4096).unwrap();
    assert_eq!(region.memory_kind(), MemoryKind::Cuda);
    assert!(matches!(
        region.host_ptr(),
        Err(RegionError::NotHostMemory { device: 0, .. })
    ));
    region.write_block(BlockId(3), &[7u8; 4096]).unwrap();
    assert_eq!(region.read_block(BlockId(3)).unwrap(), vec![7u8; 4096]);
    let host = Region::new(8, 4096).unwrap();
    Region::copy_blocks(&region, &[BlockId(3)], &host, &[BlockId(5)]).unwrap();
    assert_eq!(host.read_block(BlockId(5)).unwrap(), vec![7u8; 4096]);
    assert!(matches!(
        Region::on_device(buffer, 9, 4096),
        Err(RegionError::DeviceTooSmall { .. })
    ));
}
