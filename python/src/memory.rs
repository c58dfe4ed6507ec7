//! The KV memory a Python runtime registers: address ranges as the engine allocated them.
//!
//! Python hands over `(addr, stride, bytes)` ranges (made by the `handoff` package from
//! tensors, arrays or explicit tuples), the number of blocks in every range, and the
//! objects that own the memory (`keep`), which the region holds until it is dropped so the
//! memory cannot be freed under a transfer.

use handoff_actors::Region;
use handoff_transport::tp::HeadOrder;
use handoff_transport::{KvHeads, KvLayout, KvMemory, KvRange, LayerSpan, RANGES_MAX};
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
    /// How blocks hold KV heads (heterogeneous TP), when said.
    pub(crate) heads: Option<KvHeads>,
}

/// Holds the Python objects owning the memory while the region lives.
struct Keep(#[allow(dead_code)] Option<PyObject>);

/// `"cpu"` or `"cuda:N"` (`"cuda"` is device 0).
fn memory_of(device: &str) -> NativeResult<KvMemory> {
    let bad = || {
        Failure::invalid(format!(
            "device must be \"cpu\" or \"cuda:N\", not {device:?}"
        ))
    };
    match device.split_once(':') {
        None if device == "cpu" => Ok(KvMemory::Host),
        None if device == "cuda" => Ok(KvMemory::Cuda { device: 0 }),
        Some(("cuda", n)) => n
            .parse()
            .map(|device| KvMemory::Cuda { device })
            .map_err(|_| bad()),
        _ => Err(bad()),
    }
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
    if spec.ranges.len() > RANGES_MAX {
        return Err(Failure::new(
            "invalid_memory",
            format!(
                "{} ranges, more than the {RANGES_MAX} allowed",
                spec.ranges.len()
            ),
        ));
    }
    let mut ranges = Vec::with_capacity(spec.ranges.len());
    for (i, &(addr, stride, bytes)) in spec.ranges.iter().enumerate() {
        let size = |v: u64, what: &str| {
            usize::try_from(v).map_err(|_| {
                Failure::new("invalid_memory", format!("range {i}: {what} {v} too large"))
            })
        };
        ranges.push(KvRange {
            addr,
            stride: size(stride, "stride")?,
            bytes: size(bytes, "bytes")?,
        });
    }
    let layers = match spec.layers {
        Some((first, count, total)) => LayerSpan {
            first,
            count,
            total,
        },
        None => LayerSpan::WHOLE,
    };
    let layout = KvLayout {
        blocks,
        ranges,
        memory: memory_of(&spec.device)?,
        layers,
        block_tokens: spec.block_tokens,
        dtype_bytes: spec.dtype_bytes,
        heads: spec.heads,
    };
    layout
        .validate()
        .map_err(|e| Failure::new("invalid_memory", e.to_string()))?;
    // SAFETY: the layout was validated (non-null, non-overlapping blocks, bounded, no
    // overflow); that every range is valid, writable memory of its kind is the caller's
    // promise (the `handoff` package derives the ranges from live tensors or arrays, or the
    // user states them), and `keep` holds the objects owning that memory until the region,
    // and with it every transfer into it, is gone.
    unsafe { Region::from_layout(layout, Box::new(Keep(keep))) }
        .map_err(|e| Failure::new(region_kind(&e), e.to_string()))
}

/// The heads `kv_heads` (0: not said), `head_order` (`hnd`, `nhd` or `latent`) and
/// `head_bytes` describe; checked with the layout when it is registered.
pub(crate) fn heads(
    kv_heads: u32,
    head_order: &str,
    head_bytes: u64,
) -> Result<Option<KvHeads>, Failure> {
    if kv_heads == 0 {
        if head_bytes != 0 {
            return Err(Failure::new(
                "invalid_memory",
                "head_bytes (head_size) without kv_heads".to_string(),
            ));
        }
        return Ok(None);
    }
    let order = match head_order {
        "hnd" => HeadOrder::HeadMajor,
        "nhd" => HeadOrder::TokenMajor,
        "latent" => HeadOrder::Latent,
        other => {
            return Err(Failure::new(
                "invalid_memory",
                format!("head_order {other:?}: hnd, nhd or latent"),
            ))
        }
    };
    Ok(Some(KvHeads {
        kv_heads,
        order,
        head_bytes,
    }))
}
