//! The KV memory a Python runtime registers: address ranges as the engine allocated them.
//!
//! Python hands over `(addr, stride, bytes)` ranges (made by the `handoff` package from
//! tensors, arrays or explicit tuples), the number of blocks in every range, and the
//! objects that own the memory (`keep`), which the region holds until it is dropped so the
//! memory cannot be freed under a transfer.

use std::ptr::NonNull;

use handoff_actors::Region;
use pyo3::PyObject;

use crate::errors::{region_kind, Failure, NativeResult};

/// What Python says about its KV memory.
pub(crate) struct Spec {
    /// `(addr, stride, bytes)`: block `b` of a range is `bytes` bytes at `addr + b * stride`.
    pub(crate) ranges: Vec<(u64, u64, u64)>,
    /// Blocks in every range.
    pub(crate) num_blocks: u64,
    /// `"cpu"` or `"cuda:N"`.
    pub(crate) device: String,
    /// Layers held: `(first, count, total)`.
    pub(crate) layers: Option<(u32, u32, u32)>,
    /// Tokens per block (0: unknown).
    pub(crate) block_tokens: u32,
    /// Bytes per element (0: unknown).
    pub(crate) dtype_bytes: u32,
    /// This worker's pipeline rank and size.
    pub(crate) pp: (u32, u32),
}

/// Holds the Python objects owning the memory while the region lives.
struct Keep(#[allow(dead_code)] Option<PyObject>);

/// Checks one range and returns it as `(addr, stride, bytes)` in native sizes.
fn check_range(
    i: usize,
    r: (u64, u64, u64),
    blocks: u32,
) -> NativeResult<(NonNull<u8>, usize, usize)> {
    let (addr, stride, bytes) = r;
    let bad = |why: String| Failure::new("invalid_memory", format!("range {i}: {why}"));
    let ptr = usize::try_from(addr)
        .ok()
        .and_then(|a| NonNull::new(a as *mut u8))
        .ok_or_else(|| bad(format!("address {addr:#x} is null or not a pointer")))?;
    if bytes == 0 || stride < bytes {
        return Err(bad(format!(
            "{bytes} bytes per block at a stride of {stride}: a block needs at least one byte, and the stride must cover it"
        )));
    }
    let end = stride
        .checked_mul(u64::from(blocks) - 1)
        .and_then(|last| last.checked_add(bytes))
        .and_then(|len| addr.checked_add(len));
    if end.is_none() {
        return Err(bad(format!(
            "{blocks} blocks at a stride of {stride} overflow the address space"
        )));
    }
    let stride = usize::try_from(stride).map_err(|_| bad("stride too large".into()))?;
    let bytes = usize::try_from(bytes).map_err(|_| bad("block too large".into()))?;
    Ok((ptr, stride, bytes))
}

/// The region over `spec`'s memory, holding `keep` until it drops.
pub(crate) fn region(spec: Spec, keep: Option<PyObject>) -> NativeResult<Region> {
    let blocks = u32::try_from(spec.num_blocks)
        .ok()
        .filter(|&b| b > 0)
        .ok_or_else(|| {
            Failure::new(
                "invalid_memory",
                format!("num_blocks must be in 1..2^32, not {}", spec.num_blocks),
            )
        })?;
    if spec.device != "cpu" {
        return Err(Failure::new(
            "layout_unsupported",
            format!(
                "KV memory on {:?}: only host memory (\"cpu\") can be registered from Python yet",
                spec.device
            ),
        ));
    }
    if let Some((first, count, total)) = spec.layers {
        if count == 0 || first.checked_add(count).is_none_or(|end| end > total) {
            return Err(Failure::invalid(format!(
                "layers ({first}, {count}, {total}): count layers from first must fit in total"
            )));
        }
    }
    let _ = (spec.block_tokens, spec.dtype_bytes, spec.pp);
    let [range] = spec.ranges.as_slice() else {
        return Err(Failure::new(
            "layout_unsupported",
            format!(
                "{} ranges: only one contiguous range can be registered yet",
                spec.ranges.len()
            ),
        ));
    };
    let (ptr, stride, bytes) = check_range(0, *range, blocks)?;
    if stride != bytes && blocks > 1 {
        return Err(Failure::new(
            "layout_unsupported",
            format!("range 0: blocks of {bytes} bytes at a stride of {stride}: only contiguous blocks can be registered yet"),
        ));
    }
    // SAFETY: the range was checked to be non-null and not to wrap; that it is valid,
    // writable host memory is the caller's promise (the `handoff` package derives it from
    // live tensors or arrays, or the user states it), and `keep` holds the objects owning it
    // until the region, and with it every transfer into it, is gone.
    unsafe { Region::from_external(ptr, blocks, bytes, Box::new(Keep(keep))) }
        .map_err(|e| Failure::new(region_kind(&e), e.to_string()))
}
