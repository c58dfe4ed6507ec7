//! Tests on real CUDA devices. Each one probes first: on a machine without a driver or a
//! device it prints why and returns (a skip, not a pass that pretends); with a GPU it
//! really allocates, fills, copies and checksums device memory.

use handoff_gpu::checksum::fill_pattern;
use handoff_gpu::{
    checksum64, probe, DeviceBuffer, DeviceCopier, GpuError, GpuInfo, HostBuffer, KvBuffer,
    MemoryKind, STAGING_BYTES_MAX,
};

/// The probe result, or `None` after printing why these tests cannot run here. Any
/// other probe error on a machine that has a driver is a real failure.
fn gpu() -> Option<GpuInfo> {
    match probe() {
        Ok(info) => Some(info),
        Err(reason @ (GpuError::NoDriver { .. } | GpuError::NoDevice)) => {
            skip(&reason);
            None
        }
        Err(other) => panic!("CUDA probe failed with a driver present: {other}"),
    }
}

/// Says, past the test harness's output capture, why this test does not run here (a GPU
/// skip: allowed by default, see `handoff_testkit`).
fn skip(reason: &GpuError) {
    handoff_testkit::skip_this(handoff_testkit::Need::Gpu, &reason.to_string());
}

fn device(len: usize) -> DeviceBuffer {
    DeviceBuffer::alloc_zeroed(0, len)
        .unwrap_or_else(|e| panic!("device allocation of {len} bytes: {e}"))
}

fn host(len: usize) -> HostBuffer {
    HostBuffer::alloc_zeroed(len).unwrap_or_else(|e| panic!("host allocation of {len} bytes: {e}"))
}

#[test]
fn device_allocation_without_a_gpu_returns_the_probe_error() {
    let Err(reason) = probe() else {
        eprintln!("skipping: a GPU is present, so there is no missing-driver path to check");
        return;
    };
    assert_eq!(DeviceBuffer::alloc_zeroed(0, 4096).err(), Some(reason));
}

#[test]
fn probe_describes_every_device() {
    let Some(info) = gpu() else { return };
    eprintln!("driver {}: {:?}", info.driver_version, info.devices);
    assert!(info.driver_version.major >= 11, "{}", info.driver_version);
    assert!(!info.devices.is_empty());
    for (index, device) in info.devices.iter().enumerate() {
        assert_eq!(device.ordinal as usize, index);
        assert!(!device.name.is_empty());
        assert!(device.total_memory_bytes >= 1 << 30, "{device:?}");
        assert!(device.compute_capability.0 >= 3, "{device:?}");
    }
}

#[test]
fn device_buffer_starts_zeroed_and_round_trips_host_bytes() {
    let Some(_) = gpu() else { return };
    let len = (1 << 20) + 3;
    let mut buffer = device(len);
    assert_eq!(buffer.memory_kind(), MemoryKind::Cuda);
    assert_eq!(buffer.len(), len);
    assert_ne!(buffer.addr(), 0);
    let mut back = vec![0xAAu8; len];
    assert_eq!(buffer.read_into(0, &mut back), Ok(()));
    assert!(
        back.iter().all(|&b| b == 0),
        "fresh device memory is zeroed"
    );

    let mut data = vec![0u8; len];
    fill_pattern(&mut data, 5, 0);
    assert_eq!(buffer.write_from(0, &data), Ok(()));
    assert_eq!(buffer.write_from(1001, b"handoff"), Ok(()));
    data[1001..1008].copy_from_slice(b"handoff");
    assert_eq!(buffer.read_into(0, &mut back), Ok(()));
    assert!(back == data);
    let mut middle = [0u8; 7];
    assert_eq!(buffer.read_into(1001, &mut middle), Ok(()));
    assert_eq!(&middle, b"handoff");
}

#[test]
fn device_and_host_checksums_agree_for_the_same_pattern() {
    let Some(_) = gpu() else { return };
    let len = 3 * 4096 + 11;
    let mut on_device = device(len);
    let mut on_host = host(len);
    assert_eq!(on_device.fill_pattern(77), Ok(()));
    assert_eq!(on_host.fill_pattern(77), Ok(()));
    for (offset, span) in [(0, len as u64), (5, 4096), (4095, 2), (len as u64 - 1, 1)] {
        assert_eq!(
            on_device.checksum(offset, span),
            on_host.checksum(offset, span),
            "{offset}+{span}"
        );
    }
    assert_eq!(on_device.checksum(0, 0), Ok(checksum64(&[])));
    assert_ne!(
        on_device.checksum(0, len as u64),
        on_device.checksum(1, len as u64 - 1)
    );
}

#[test]
fn device_checksum_spans_staging_chunks() {
    let Some(_) = gpu() else { return };
    let len = 2 * STAGING_BYTES_MAX + 12_345;
    let mut on_device = device(len);
    assert_eq!(on_device.fill_pattern(3), Ok(()));
    let mut expected = vec![0u8; len];
    fill_pattern(&mut expected, 3, 0);
    assert_eq!(on_device.checksum(0, len as u64), Ok(checksum64(&expected)));
}

#[test]
fn device_errors_are_values_not_panics() {
    let Some(info) = gpu() else { return };
    let mut buffer = device(4096);
    assert!(matches!(
        buffer.write_from(4095, &[1, 2]),
        Err(GpuError::OutOfBounds { .. })
    ));
    assert!(matches!(
        buffer.read_into(u64::MAX, &mut [0u8; 1]),
        Err(GpuError::OutOfBounds { .. })
    ));
    assert!(matches!(
        buffer.checksum(1, 4096),
        Err(GpuError::OutOfBounds { .. })
    ));
    let count = info.devices.len() as u32;
    assert_eq!(
        DeviceBuffer::alloc_zeroed(count, 4096).err(),
        Some(GpuError::NoSuchDevice {
            ordinal: count,
            count
        })
    );
    assert_eq!(
        DeviceBuffer::alloc_zeroed(0, 0).err(),
        Some(GpuError::EmptyBuffer)
    );
    // Twice the device's memory cannot be had: a driver error, named.
    let too_much = usize::try_from(info.devices[0].total_memory_bytes * 2).unwrap_or(usize::MAX);
    match DeviceBuffer::alloc_zeroed(0, too_much) {
        Err(GpuError::Driver { name, .. }) => assert!(name.contains("OUT_OF_MEMORY"), "{name}"),
        other => panic!("expected an out-of-memory driver error, got {other:?}"),
    }
    // And the device still works afterwards.
    assert_eq!(buffer.write_from(0, &[1, 2, 3]), Ok(()));
}

#[test]
fn a_copier_reads_and_writes_device_memory_by_address() {
    let Some(_) = gpu() else { return };
    let buffer = device(4096);
    let copier = DeviceCopier::new(buffer.ordinal()).unwrap_or_else(|e| panic!("{e}"));
    let data: Vec<u8> = (0..=255).collect();
    // SAFETY: 256 bytes at offset 1000 lie inside the 4096-byte buffer, alive here.
    unsafe { copier.write(buffer.addr() + 1000, &data) }.unwrap_or_else(|e| panic!("{e}"));
    let mut back = vec![0u8; 256];
    assert_eq!(buffer.read_at(1000, &mut back), Ok(()));
    assert_eq!(back, data);
    let mut again = vec![0u8; 256];
    // SAFETY: as above.
    unsafe { copier.read(buffer.addr() + 1000, &mut again) }.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(again, data);
}

#[test]
fn shared_copies_from_other_threads_and_the_device_to_device_reference() {
    let Some(_) = gpu() else { return };
    let block = 64 << 10;
    let blocks = 16u64;
    let src = std::sync::Arc::new(device(block * blocks as usize));
    let dst = device(block * blocks as usize);
    // Each thread writes its own blocks through `&DeviceBuffer`, as an engine and a
    // transport thread do with one registered buffer.
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let src = &src;
            scope.spawn(move || {
                for b in (t..blocks).step_by(4) {
                    let mut bytes = vec![0u8; block];
                    fill_pattern(&mut bytes, 9, b * block as u64);
                    src.write_at(b * block as u64, &bytes).unwrap();
                }
            });
        }
    });
    let mut expected = vec![0u8; block * blocks as usize];
    fill_pattern(&mut expected, 9, 0);
    assert_eq!(
        src.checksum(0, expected.len() as u64),
        Ok(checksum64(&expected))
    );
    // Reverse the blocks with the reference copy, then check every block landed.
    let pairs: Vec<(u64, u64)> = (0..blocks)
        .map(|b| (b * block as u64, (blocks - 1 - b) * block as u64))
        .collect();
    assert_eq!(src.copy_to(&dst, &pairs, block as u64), Ok(()));
    for b in 0..blocks {
        let at = ((blocks - 1 - b) * block as u64) as usize;
        let want = checksum64(&expected[(b as usize * block)..(b as usize + 1) * block]);
        assert_eq!(dst.checksum(at as u64, block as u64), Ok(want), "block {b}");
    }
    // A plan with one pair out of range copies nothing.
    let before = dst.checksum(0, dst.len() as u64);
    let bad = [(0, 0), (0, blocks * block as u64)];
    assert!(matches!(
        src.copy_to(&dst, &bad, block as u64),
        Err(GpuError::OutOfBounds { .. })
    ));
    assert_eq!(dst.checksum(0, dst.len() as u64), before);
}

#[test]
fn a_thread_binds_a_devices_context_and_an_unknown_device_is_named() {
    let Some(info) = gpu() else { return };
    let bound = std::thread::spawn(|| handoff_gpu::bind_device_to_thread(0).map(|c| c.ordinal()))
        .join()
        .unwrap();
    assert_eq!(bound, Ok(0));
    let count = info.devices.len() as u32;
    assert_eq!(
        handoff_gpu::bind_device_to_thread(count).err(),
        Some(GpuError::NoSuchDevice {
            ordinal: count,
            count
        })
    );
}

#[test]
fn the_allocation_of_a_device_pointer_is_found_and_a_host_pointer_has_none() {
    if gpu().is_none() {
        return;
    }
    let buffer = device(3 << 20);
    let base = buffer.addr();
    for inside in [base, base + 4096, base + (3 << 20) - 1] {
        let (start, len) = handoff_gpu::device_allocation(inside)
            .unwrap_or_else(|e| panic!("device_allocation({inside:#x}): {e}"))
            .unwrap_or_else(|| panic!("{inside:#x} is device memory"));
        assert_eq!(start, base);
        assert!(len >= 3 << 20, "{len}");
    }
    let on_host = vec![0u8; 4096];
    assert_eq!(
        handoff_gpu::device_allocation(on_host.as_ptr() as u64).unwrap(),
        None
    );
}
