//! Host buffers and the staging paths device buffers use (exercised here on the CPU).
//! Transfers between differently laid out KV caches are `handoff-transport`'s (regions
//! over layouts).

use handoff_gpu::checksum::fill_pattern;
use handoff_gpu::{
    checksum64, GpuError, HostBuffer, KvBuffer, MemoryKind, HOST_ALIGN_BYTES, STAGING_BYTES_MAX,
};

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
