//! The UCX data plane on CUDA memory between two processes (the test re-executes its
//! own binary as a child, env `HANDOFF_CUDA_PLANE_CHILD`): device to device on one GPU
//! (UCX's `cuda_ipc`), and device to host and back, every transfer checked by checksums
//! of the destination blocks, computed from copies back to the host. Two processes, not
//! two planes in one: `cuda_ipc` serves other processes only, as engines are. With the
//! child vouched for as a same-host peer, device to device is the plane's own CUDA IPC
//! lane instead (device copies through the child's allocations mapped here, bounded by
//! what the driver mapped), lies in its IPC descriptors included.
//!
//! These tests need a GPU and a UCX built with CUDA, named by `HANDOFF_UCX_LIB` (the
//! `libucx-cu12` wheel's `libucp.so`); without either they print why and return. With
//! both, any failure is a failure. Without a GPU they still check that device regions
//! refuse CPU access by name.

mod data_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use data_common::{
    checksum, fill, format_ids, ids, layout_ready_line, parse_layout_ready, say, serve_commands,
    ChildPeer, Rng,
};
use handoff_gpu::{DeviceBuffer, GpuError, IpcExport, KvBuffer, MemoryKind, IPC_DESCRIPTOR_BYTES};
use handoff_transport::data::{DataError, UcxDataPlane, UcxPeer, UcxPlaneOptions, UcxRange};
use handoff_transport::region::RegionError;
use handoff_transport::same_host::PeerProcess;
use handoff_transport::{
    BlockId, KvLayout, KvMemory, KvRange, LayerSpan, RankInfo, Region, RequestId,
};

const BLOCKS: u32 = 64;
const BLOCK_BYTES: usize = 256 * 1024;
const DEADLINE: Duration = Duration::from_secs(60);
const STEP: Duration = Duration::from_secs(60);
const CHILD_LIFETIME: Duration = Duration::from_secs(300);
const CHILD_ENV: &str = "HANDOFF_CUDA_PLANE_CHILD";
const PREFIX: &str = "CUDA_PLANE_CHILD ";

/// Says, past the harness's capture, why this test does not run (a GPU skip: allowed by
/// default, see `handoff_testkit`).
fn skip(reason: &str) {
    handoff_testkit::skip_this(handoff_testkit::Need::Gpu, reason);
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

/// Layers of the per-layer device layout: a K and a V range per layer.
const LAYERS: usize = 4;

/// A plane over an engine-style device layout: one device allocation per layer shaped
/// `[2, blocks, ...]` (vLLM), so 2 × [`LAYERS`] ranges, registered by address.
fn layered_device_plane(name: &str, device: u32) -> UcxDataPlane {
    let half = BLOCK_BYTES / (2 * LAYERS);
    let mut ranges = Vec::new();
    let mut buffers = Vec::new();
    for _ in 0..LAYERS {
        let buffer = DeviceBuffer::alloc_zeroed(device, 2 * BLOCKS as usize * half)
            .unwrap_or_else(|e| panic!("device allocation: {e}"));
        ranges.push(KvRange {
            addr: buffer.addr(),
            stride: half,
            bytes: half,
        });
        ranges.push(KvRange {
            addr: buffer.addr() + (BLOCKS as usize * half) as u64,
            stride: half,
            bytes: half,
        });
        buffers.push(buffer);
    }
    let layout = KvLayout {
        blocks: BLOCKS,
        ranges,
        memory: KvMemory::Cuda { device },
        layers: LayerSpan {
            first: 0,
            count: LAYERS as u32,
            total: LAYERS as u32,
        },
        block_tokens: 16,
        dtype_bytes: 2,
        heads: None,
    };
    // SAFETY: every range lies inside one of `buffers`, which the region keeps until it
    // drops; nothing references device memory from Rust.
    let region = unsafe { Region::from_layout(layout, Box::new(buffers)) }
        .unwrap_or_else(|e| panic!("device layout: {e}"));
    UcxDataPlane::start_on_region(
        Arc::new(region),
        &RankInfo::single(name),
        UcxPlaneOptions::default(),
    )
    .unwrap_or_else(|e| panic!("UCX plane on a device layout: {e}"))
}

fn host_plane(name: &str, device: u32) -> UcxDataPlane {
    let options = UcxPlaneOptions {
        cuda_device: Some(device),
        ..UcxPlaneOptions::default()
    };
    UcxDataPlane::start(BLOCKS, BLOCK_BYTES, &RankInfo::single(name), options)
        .unwrap_or_else(|e| panic!("UCX plane on host memory: {e}"))
}

/// Not a test by itself: the child process's entry point (a no-op unless `CHILD_ENV`
/// names its memory, `cuda` or `host`). It starts a plane, prints its descriptor, and
/// answers `checksum <blocks>` and `exit` on stdin.
#[test]
fn cuda_plane_child_process_entry() {
    let Some(memory) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let plane = if memory == "cuda" {
        device_plane("decode-child", 0)
    } else if memory == "cuda-layers" {
        layered_device_plane("decode-child", 0)
    } else {
        host_plane("decode-child", 0)
    };
    say(PREFIX, &layout_ready_line(&plane));
    serve_commands(PREFIX, plane.region(), CHILD_LIFETIME);
}

/// A child process with a plane in `memory` (`cuda` or `host`), and its descriptor.
fn spawn_child(memory: &str) -> (ChildPeer, UcxPeer) {
    let mut child = ChildPeer::spawn(
        "cuda_plane_child_process_entry",
        &[(CHILD_ENV, memory.into())],
        PREFIX,
    );
    let peer = parse_layout_ready(&child.expect(STEP), "decode-child");
    (child, peer)
}

/// Pushes half of `local`'s blocks to a permutation of the child's, checks the child's
/// bytes, then pulls them back into the other half of `local` and checks those.
async fn round_trip(local: &UcxDataPlane, child: &mut ChildPeer, peer: &UcxPeer, seed: u64) {
    let request = RequestId::new("cuda-round-trip");
    let half = BLOCKS / 2;
    let src = ids(0..half);
    let perm: Vec<BlockId> = Rng::new(seed)
        .permutation(BLOCKS)
        .into_iter()
        .take(half as usize)
        .collect();
    fill(local.region(), seed);
    let deadline = Instant::now() + DEADLINE;
    local
        .write(&request, peer, &src, &perm, deadline)
        .await
        .unwrap_or_else(|e| panic!("write: {e}"));
    let answer = child.ask(&format!("checksum {}", format_ids(&perm)), STEP);
    assert_eq!(
        answer,
        format!("checksum {}", checksum(local.region(), &src)),
        "pushed blocks differ"
    );
    let back = ids(half..BLOCKS);
    local
        .read(&request, peer, &perm, &back, deadline)
        .await
        .unwrap_or_else(|e| panic!("read: {e}"));
    assert_eq!(
        checksum(local.region(), &src),
        checksum(local.region(), &back),
        "pulled blocks differ"
    );
}

/// Two processes on one GPU: UCX's `cuda_ipc`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_to_device_between_two_processes_on_one_gpu() {
    let Some(device) = gpu() else { return };
    let local = device_plane("prefill-gpu", device);
    assert_eq!(local.region().memory_kind(), MemoryKind::Cuda);
    eprintln!("{}", local.version());
    let (mut child, peer) = spawn_child("cuda");
    round_trip(&local, &mut child, &peer, 11).await;
}

/// Device memory here, host memory in the other process, and the other way round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_to_host_and_host_to_device_between_two_processes() {
    let Some(device) = gpu() else { return };
    let on_gpu = device_plane("prefill-gpu", device);
    let (mut host_child, host_peer) = spawn_child("host");
    round_trip(&on_gpu, &mut host_child, &host_peer, 12).await;
    let on_host = host_plane("prefill-host", device);
    assert_eq!(on_host.region().memory_kind(), MemoryKind::Host);
    let (mut gpu_child, gpu_peer) = spawn_child("cuda");
    round_trip(&on_host, &mut gpu_child, &gpu_peer, 13).await;
}

/// Per-layer device ranges (one registration and key each) into one-range device and host
/// peers, and a one-range host plane into a per-layer device peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_layer_device_ranges_between_two_processes() {
    let Some(device) = gpu() else { return };
    let layered = layered_device_plane("prefill-gpu-layers", device);
    assert_eq!(layered.region().memory_kind(), MemoryKind::Cuda);
    assert_eq!(layered.descriptor().range_list().len(), 2 * LAYERS);
    let (mut gpu_child, gpu_peer) = spawn_child("cuda");
    round_trip(&layered, &mut gpu_child, &gpu_peer, 14).await;
    let (mut host_child, host_peer) = spawn_child("host");
    round_trip(&layered, &mut host_child, &host_peer, 15).await;
    let on_host = host_plane("prefill-host", device);
    let (mut layered_child, layered_peer) = spawn_child("cuda-layers");
    assert_eq!(layered_peer.range_list().len(), 2 * LAYERS);
    round_trip(&on_host, &mut layered_child, &layered_peer, 16).await;
}

/// Two writes (to the peer's first and last block) and a read (of its last) with a lying
/// `peer`: each must be a protocol error naming the lie, before anything moves.
async fn refused_by_name(local: &UcxDataPlane, peer: &UcxPeer, request: &RequestId, what: &str) {
    let (first, last) = ([BlockId(0)], [BlockId(BLOCKS - 1)]);
    for (dir, blocks) in [("write", &first), ("write", &last), ("read", &last)] {
        let deadline = Instant::now() + STEP;
        let result = if dir == "write" {
            local.write(request, peer, &first, blocks, deadline).await
        } else {
            local.read(request, peer, blocks, &first, deadline).await
        };
        match result {
            Err(e @ DataError::Protocol { .. }) => eprintln!("{what}, {dir}: refused: {e}"),
            other => panic!("{what}, {dir}: {other:?}"),
        }
    }
}

/// A peer whose descriptor lies about its device memory: `cuda_ipc` maps its allocation
/// into our context and copies with the driver, unchecked, so a range past that allocation
/// would write our own device memory or poison the context with an illegal address. Every
/// lie must be a named error before anything is posted, the liar's blocks unchanged, and
/// an honest transfer must still work after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_lies_about_its_device_memory_gets_a_named_error() {
    let Some(device) = gpu() else { return };
    let local = device_plane("prefill-gpu", device);
    let (mut liar, honest) = spawn_child("cuda");
    let all = format_ids(&ids(0..BLOCKS));
    let before = liar.ask(&format!("checksum {all}"), STEP);
    fill(local.region(), 21);
    let request = RequestId::new("lie");
    let ranges = honest.range_list();
    let (addr, len) = (ranges[0].addr, ranges[0].len);
    let block = BLOCK_BYTES as u64;
    type Lie<'a> = (&'a str, &'a dyn Fn(&mut UcxRange));
    let lies: [Lie; 4] = [
        ("4 MiB below the real base", &|r| r.addr = addr - (4 << 20)),
        ("one block past the end", &|r| r.addr = addr + block),
        ("far away", &|r| r.addr = addr.wrapping_add(1 << 40)),
        ("twice its length", &|r| r.len = 2 * len),
    ];
    for (what, edit) in lies {
        let mut lied = ranges.clone();
        edit(&mut lied[0]);
        let peer = UcxPeer {
            ranges: lied.into(),
            process: None,
            ..honest.clone()
        };
        refused_by_name(&local, &peer, &request, what).await;
        assert_eq!(liar.ask(&format!("checksum {all}"), STEP), before, "{what}");
    }
    round_trip(&local, &mut liar, &honest, 22).await;
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

/// The child as a verified same-host peer on `device` (the runtime verifies the process at
/// the other end of its control connection; the test started this one, so it vouches).
fn same_host(child: &ChildPeer, peer: &UcxPeer, device: u32) -> UcxPeer {
    let process = PeerProcess::vouched(child.child.id()).expect("our own child");
    UcxPeer {
        device: Some(device),
        ..peer.clone().with_process(Some(Arc::new(process)))
    }
}

/// Device to device with a verified same-host peer: every transfer is device copies
/// through the peer's CUDA IPC handles (none through UCX), one range and per-layer ranges,
/// checked by checksums both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_copies_through_cuda_ipc_between_two_processes() {
    let Some(device) = gpu() else { return };
    let local = device_plane("prefill-gpu", device);
    let (mut child, peer) = spawn_child("cuda");
    for r in peer.range_list() {
        assert_eq!(
            r.cuda_ipc.len(),
            IPC_DESCRIPTOR_BYTES,
            "the child exports its range"
        );
    }
    let peer = same_host(&child, &peer, device);
    round_trip(&local, &mut child, &peer, 31).await;
    assert_eq!(local.cuda_ipc_transfers(), 2, "the write and the read");

    let layered = layered_device_plane("prefill-gpu-layers", device);
    let (mut layered_child, layered_peer) = spawn_child("cuda-layers");
    assert_eq!(layered_peer.range_list().len(), 2 * LAYERS);
    let layered_peer = same_host(&layered_child, &layered_peer, device);
    round_trip(&layered, &mut layered_child, &layered_peer, 32).await;
    round_trip(&local, &mut layered_child, &layered_peer, 33).await;
    assert_eq!(layered.cuda_ipc_transfers(), 2);
    assert_eq!(local.cuda_ipc_transfers(), 4);
}

/// A verified same-host peer whose CUDA IPC descriptor lies (the allocation's base moved,
/// the range longer than the allocation, a descriptor of the wrong size): refused by name
/// before anything is copied, the liar's blocks unchanged; an honest transfer works after.
/// A handle that opens nothing is no lie we can prove: UCX carries that peer instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_whose_cuda_ipc_descriptor_lies_gets_a_named_error() {
    let Some(device) = gpu() else { return };
    let local = device_plane("prefill-gpu", device);
    let (mut liar, honest) = spawn_child("cuda");
    let honest = same_host(&liar, &honest, device);
    let all = format_ids(&ids(0..BLOCKS));
    let before = liar.ask(&format!("checksum {all}"), STEP);
    fill(local.region(), 41);
    let request = RequestId::new("ipc-lie");
    let ranges = honest.range_list();
    let (handle, base) = IpcExport::parse(&ranges[0].cuda_ipc).expect("an IPC descriptor");
    let at_base = |b: u64| {
        let mut d = handle.to_vec();
        d.extend_from_slice(&b.to_le_bytes());
        d
    };
    let len = ranges[0].len;
    type Lie<'a> = (&'a str, &'a dyn Fn(&mut UcxRange));
    let lies: [Lie; 4] = [
        ("the allocation claimed 4 MiB higher", &|r| {
            r.cuda_ipc = at_base(base + (4 << 20))
        }),
        ("the allocation claimed 4 MiB lower", &|r| {
            r.cuda_ipc = at_base(base - (4 << 20))
        }),
        ("twice its length", &|r| r.len = 2 * len),
        ("a descriptor one byte short", &|r| {
            r.cuda_ipc.truncate(IPC_DESCRIPTOR_BYTES - 1)
        }),
    ];
    let (first, last) = ([BlockId(0)], [BlockId(BLOCKS - 1)]);
    for (what, edit) in lies {
        let mut lied = ranges.clone();
        edit(&mut lied[0]);
        let peer = UcxPeer {
            ranges: lied.into(),
            ..honest.clone()
        };
        refused_by_name(&local, &peer, &request, what).await;
        assert_eq!(liar.ask(&format!("checksum {all}"), STEP), before, "{what}");
    }
    assert_eq!(local.cuda_ipc_transfers(), 0);
    round_trip(&local, &mut liar, &honest, 42).await;
    assert_eq!(local.cuda_ipc_transfers(), 2, "the honest descriptor opens");

    // A handle of zeros opens nothing: the lane stands aside, and UCX (whose key is
    // honest) carries the transfer.
    let mut zeroed = ranges.clone();
    zeroed[0].cuda_ipc = vec![0; IPC_DESCRIPTOR_BYTES];
    let peer = UcxPeer {
        ranges: zeroed.into(),
        ..honest.clone()
    };
    let deadline = Instant::now() + STEP;
    local
        .write(&request, &peer, &first, &last, deadline)
        .await
        .unwrap_or_else(|e| panic!("write past an unusable handle: {e}"));
    assert_eq!(local.cuda_ipc_transfers(), 2, "UCX carried it");
    assert_eq!(
        liar.ask(&format!("checksum {}", format_ids(&last)), STEP),
        format!("checksum {}", checksum(local.region(), &first)),
    );
}
