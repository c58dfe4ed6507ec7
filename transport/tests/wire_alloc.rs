//! What decoding allocates, measured with a counting allocator: nothing before a header is
//! accepted, and never much more than a frame's own size, whatever its length prefixes claim.
//!
//! A separate test binary, so its global allocator counts only these tests; the counter is
//! per thread, so tests running in parallel do not see each other's allocations.

use handoff_transport::wire::limits::FRAME_PAYLOAD_BYTES_MAX;
use handoff_transport::wire::{self, frame, MessageType, WireError, HEADER_BYTES};
use handoff_transport::PROTOCOL_VERSION;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    /// Bytes requested from the allocator by this thread since the last [`reset`].
    static ALLOCATED_BYTES: Cell<usize> = const { Cell::new(0) };
}

fn count(bytes: usize) {
    // `try_with`: the slot may be gone while the thread shuts down.
    let _ = ALLOCATED_BYTES.try_with(|c| c.set(c.get().saturating_add(bytes)));
}

// SAFETY: forwards every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bytes this thread allocated while running `f`.
fn allocated_by<T>(f: impl FnOnce() -> T) -> (T, usize) {
    ALLOCATED_BYTES.with(|c| c.set(0));
    let out = f();
    (out, ALLOCATED_BYTES.with(Cell::get))
}

fn header(msg_type: MessageType, payload_len: u32) -> [u8; HEADER_BYTES] {
    frame::Header {
        version: PROTOCOL_VERSION,
        msg_type,
        flags: frame::Flags::NONE,
        payload_len,
    }
    .encode()
}

#[test]
fn a_4_gib_announcement_is_refused_without_allocating() {
    let bytes = header(MessageType::TransferInfo, u32::MAX);
    let (checked, allocated) = allocated_by(|| frame::check(&bytes));
    assert!(matches!(checked, Err(WireError::Oversized { .. })));
    assert_eq!(allocated, 0);
    let (decoded, allocated) = allocated_by(|| wire::decode_prefix(&bytes, None));
    assert!(matches!(decoded, Err(WireError::Oversized { .. })));
    assert_eq!(allocated, 0);
}

#[test]
fn waiting_for_the_rest_of_a_large_frame_allocates_nothing() {
    let bytes = header(MessageType::TransferInfo, FRAME_PAYLOAD_BYTES_MAX as u32);
    let (checked, allocated) = allocated_by(|| frame::check(&bytes));
    assert!(matches!(checked, Err(WireError::Incomplete { .. })));
    assert_eq!(allocated, 0);
}

#[test]
fn a_tiny_frame_claiming_a_huge_string_costs_no_large_allocation() {
    // Query { engine_id } whose length prefix claims almost 16 MiB (within the frame limit),
    // followed by 8 bytes.
    let mut payload = vec![0xfc]; // varint marker: a u32 follows
    payload.extend_from_slice(&(FRAME_PAYLOAD_BYTES_MAX as u32 - 1024).to_le_bytes());
    payload.extend_from_slice(b"prefill!");
    let mut bytes = header(MessageType::Query, payload.len() as u32).to_vec();
    bytes.extend_from_slice(&payload);
    let (decoded, allocated) = allocated_by(|| wire::decode(&bytes, None));
    assert!(
        matches!(decoded, Err(WireError::Decode { .. })),
        "{decoded:?}"
    );
    assert!(allocated < 64 * 1024, "allocated {allocated} bytes");
}

#[test]
fn a_tiny_frame_claiming_a_huge_block_list_costs_no_large_allocation() {
    // Ready { request_id: "r", blocks: <1M claimed, none present>, ... }
    let mut payload = vec![1, b'r', 0xfc];
    payload.extend_from_slice(&(1u32 << 20).to_le_bytes());
    let mut bytes = header(MessageType::Ready, payload.len() as u32).to_vec();
    bytes.extend_from_slice(&payload);
    let (decoded, allocated) = allocated_by(|| wire::decode(&bytes, None));
    assert!(
        matches!(decoded, Err(WireError::Decode { .. })),
        "{decoded:?}"
    );
    assert!(allocated < 64 * 1024, "allocated {allocated} bytes");
}
