//! KV-cache layouts: where a block's bytes live, so that a request's block list becomes
//! a list of byte ranges to move.
//!
//! A block here is what vLLM and SGLang call a page: `block_size_tokens` tokens of K and
//! V for every layer. Engines lay those bytes out differently; [`LayoutKind`] names the
//! two we support, and [`KvLayout`] computes every offset with checked arithmetic.

use std::ops::Range;

use crate::GpuError;

/// The most layers a layout may have. The deepest open models have ~130 layers; the
/// bound keeps `layers * 2 * blocks` segment lists small.
pub const LAYERS_MAX: u32 = 1024;

/// The most blocks one request may name. 65 536 blocks of 16 tokens is a million
/// tokens, beyond any served context; the bound caps the memory a block list (which may
/// come from a peer) can make us spend on segments.
pub const BLOCKS_PER_REQUEST_MAX: usize = 65_536;

/// K and V: the leading `2` of every KV tensor.
const KV_PLANES: u32 = 2;

/// The worst case segment count of one request (per-layer layout, nothing coalesces)
/// must fit a `u32`, so counts never overflow on 32-bit targets either.
const _: () = assert!(
    BLOCKS_PER_REQUEST_MAX as u64 * LAYERS_MAX as u64 * KV_PLANES as u64 <= u32::MAX as u64
);

/// The dimensions of one worker's KV cache, as the engine allocated it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvShape {
    /// Attention layers held by this worker (its pipeline stage's layers).
    pub layers: u32,
    /// Blocks (pages) per layer.
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size_tokens: u32,
    /// The model's total KV heads (before the tensor-parallel split).
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per element: 2 for bf16/fp16, 1 for fp8.
    pub dtype_bytes: u32,
    /// This worker's tensor-parallel rank.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
}

/// How the bytes of a KV cache are arranged in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayoutKind {
    /// vLLM's: one allocation (region) per layer, shaped
    /// `[2, num_blocks, block_size, heads, head_dim]`. One block is `2 * layers`
    /// separate ranges, so a request costs `2 * layers` segments per run of
    /// consecutive blocks.
    PerLayer,
    /// One allocation shaped `[num_blocks, layers, 2, block_size, heads, head_dim]`:
    /// a block's KV for every layer is one contiguous range, so a run of consecutive
    /// blocks is a single segment. This is what makes transfers cheap: one RDMA
    /// operation per run instead of `2 * layers`.
    BlockContiguous,
}

/// One contiguous byte range inside one region (allocation) of a KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Segment {
    /// Which region: the layer for [`LayoutKind::PerLayer`], always 0 for
    /// [`LayoutKind::BlockContiguous`].
    pub region: u32,
    /// Byte offset from the region's base.
    pub offset: u64,
    /// Length in bytes; never 0.
    pub len: u64,
}

impl Segment {
    /// Whether `next` starts exactly where `self` ends, in the same region.
    pub fn is_followed_by(&self, next: &Segment) -> bool {
        self.region == next.region && self.offset.checked_add(self.len) == Some(next.offset)
    }
}

/// One copy: `src` bytes go to `dst`; both have the same length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Transfer {
    /// Where the bytes are read (the prefill side).
    pub src: Segment,
    /// Where they are written (the decode side).
    pub dst: Segment,
}

/// Coalesces consecutive segments that are adjacent in memory into one, keeping order.
///
/// Order is kept, not sorted, because segment lists pair up by position with a peer's
/// list: sorting one side would scramble the pairing.
pub fn coalesce(segments: &[Segment]) -> Vec<Segment> {
    let mut out = Vec::with_capacity(segments.len());
    for &segment in segments {
        push_coalesced(&mut out, segment);
    }
    out
}

fn push_coalesced(out: &mut Vec<Segment>, next: Segment) {
    match out.last_mut() {
        Some(last) if last.is_followed_by(&next) => last.len += next.len,
        _ => out.push(next),
    }
}

fn push_transfer_coalesced(out: &mut Vec<Transfer>, next: Transfer) {
    match out.last_mut() {
        Some(last) if last.src.is_followed_by(&next.src) && last.dst.is_followed_by(&next.dst) => {
            last.src.len += next.src.len;
            last.dst.len += next.dst.len;
        }
        _ => out.push(next),
    }
}

/// The unit a block is cut into before coalescing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// The whole block (block-contiguous layouts only).
    WholeBlock,
    /// The K (`kv = 0`) or V (`kv = 1`) half of one layer.
    Half { layer: u32, kv: u32 },
}

/// A validated KV-cache layout: shape, kind, and every derived byte count.
///
/// Built once when an engine registers its KV cache (and when a peer's descriptor
/// arrives); then [`KvLayout::segments`] and [`transfer_plan`] turn block lists into
/// byte ranges, per request.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvLayout {
    shape: KvShape,
    kind: LayoutKind,
    kv_heads_per_rank: u32,
    half_block_bytes: u64,
    region_bytes: u64,
    total_bytes: u64,
}

impl KvLayout {
    /// Validates `shape` and computes the byte counts of `kind`.
    ///
    /// # Errors
    /// [`GpuError::ZeroDimension`] for any zero dimension, [`GpuError::DimensionTooLarge`]
    /// past [`LAYERS_MAX`], [`GpuError::TensorParallel`] for an impossible split,
    /// [`GpuError::Overflow`] when the byte counts do not fit a `u64`.
    pub fn new(shape: KvShape, kind: LayoutKind) -> Result<Self, GpuError> {
        check_nonzero(&shape)?;
        if shape.layers > LAYERS_MAX {
            return Err(GpuError::DimensionTooLarge {
                field: "layers",
                value: u64::from(shape.layers),
                max: u64::from(LAYERS_MAX),
            });
        }
        let kv_heads_per_rank = heads_per_rank(&shape)?;
        let half_block_bytes = [
            shape.block_size_tokens,
            kv_heads_per_rank,
            shape.head_dim,
            shape.dtype_bytes,
        ]
        .into_iter()
        .try_fold(1u64, |acc, dim| acc.checked_mul(u64::from(dim)))
        .ok_or(GpuError::Overflow {
            what: "bytes per block per layer",
        })?;
        let mut layout = Self {
            shape,
            kind,
            kv_heads_per_rank,
            half_block_bytes,
            region_bytes: 0,
            total_bytes: 0,
        };
        layout.region_bytes = layout.compute_region_bytes()?;
        layout.total_bytes = mul(layout.region_bytes, layout.region_count(), "total KV bytes")?;
        Ok(layout)
    }

    fn compute_region_bytes(&self) -> Result<u64, GpuError> {
        let per_block = match self.kind {
            LayoutKind::PerLayer => self.block_bytes_per_layer()?,
            LayoutKind::BlockContiguous => self.block_bytes()?,
        };
        mul(per_block, self.shape.num_blocks, "region bytes")
    }

    /// The shape this layout was built from.
    pub fn shape(&self) -> &KvShape {
        &self.shape
    }

    /// The memory arrangement.
    pub fn kind(&self) -> LayoutKind {
        self.kind
    }

    /// KV heads this rank holds: `kv_heads / tp_size`, or 1 when there are fewer KV
    /// heads than ranks and each is replicated (as vLLM does).
    pub fn kv_heads_per_rank(&self) -> u32 {
        self.kv_heads_per_rank
    }

    /// Which of the model's KV heads this rank holds.
    pub fn kv_heads_held(&self) -> Range<u32> {
        let shape = &self.shape;
        let start = if shape.kv_heads >= shape.tp_size {
            shape.tp_rank * self.kv_heads_per_rank
        } else {
            // Replicated: `tp_size / kv_heads` consecutive ranks share one head.
            shape.tp_rank / (shape.tp_size / shape.kv_heads)
        };
        start..start + self.kv_heads_per_rank
    }

    /// Bytes of K (or of V) for one block in one layer:
    /// `block_size_tokens * kv_heads_per_rank * head_dim * dtype_bytes`.
    pub fn half_block_bytes(&self) -> u64 {
        self.half_block_bytes
    }

    /// Bytes of K and V for one block in one layer.
    ///
    /// # Errors
    /// [`GpuError::Overflow`]; cannot happen for a layout that [`KvLayout::new`] accepted.
    pub fn block_bytes_per_layer(&self) -> Result<u64, GpuError> {
        mul(
            self.half_block_bytes,
            KV_PLANES,
            "bytes per block per layer",
        )
    }

    /// Bytes of one block across all layers.
    ///
    /// # Errors
    /// [`GpuError::Overflow`]; cannot happen for a layout that [`KvLayout::new`] accepted.
    pub fn block_bytes(&self) -> Result<u64, GpuError> {
        mul(
            self.block_bytes_per_layer()?,
            self.shape.layers,
            "bytes per block",
        )
    }

    /// How many separate allocations the cache is: `layers` or 1.
    pub fn region_count(&self) -> u32 {
        match self.kind {
            LayoutKind::PerLayer => self.shape.layers,
            LayoutKind::BlockContiguous => 1,
        }
    }

    /// Bytes of each region (all regions have the same size).
    pub fn region_bytes(&self) -> u64 {
        self.region_bytes
    }

    /// Bytes of the whole cache, all regions together.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// The byte ranges holding `blocks`, coalesced where consecutive, in a fixed order:
    /// for [`LayoutKind::PerLayer`] layer by layer, K then V, blocks in list order; for
    /// [`LayoutKind::BlockContiguous`] blocks in list order.
    ///
    /// # Errors
    /// [`GpuError::BlockOutOfRange`], [`GpuError::DuplicateBlock`],
    /// [`GpuError::TooManyBlocks`], [`GpuError::Overflow`].
    pub fn segments(&self, blocks: &[u32]) -> Result<Vec<Segment>, GpuError> {
        self.check_blocks(blocks)?;
        let mut out = Vec::new();
        for part in self.parts(self.kind == LayoutKind::BlockContiguous) {
            for &block in blocks {
                push_coalesced(&mut out, self.piece(block, part)?);
            }
        }
        Ok(out)
    }

    /// Checks a block list: not too long, every id in range, no id twice (a block named
    /// twice would be written twice, or overwrite itself).
    fn check_blocks(&self, blocks: &[u32]) -> Result<(), GpuError> {
        if blocks.len() > BLOCKS_PER_REQUEST_MAX {
            return Err(GpuError::TooManyBlocks {
                count: blocks.len(),
                max: BLOCKS_PER_REQUEST_MAX,
            });
        }
        let num_blocks = self.shape.num_blocks;
        if let Some(&block) = blocks.iter().find(|&&block| block >= num_blocks) {
            return Err(GpuError::BlockOutOfRange { block, num_blocks });
        }
        let mut sorted = blocks.to_vec();
        sorted.sort_unstable();
        match sorted.windows(2).find(|pair| pair[0] == pair[1]) {
            Some(pair) => Err(GpuError::DuplicateBlock { block: pair[0] }),
            None => Ok(()),
        }
    }

    /// The parts each block is cut into, in transfer order.
    fn parts(&self, whole_blocks: bool) -> Vec<Part> {
        if whole_blocks {
            return vec![Part::WholeBlock];
        }
        (0..self.shape.layers)
            .flat_map(|layer| (0..KV_PLANES).map(move |kv| Part::Half { layer, kv }))
            .collect()
    }

    /// Where one part of one block lives. The caller has checked `block`.
    fn piece(&self, block: u32, part: Part) -> Result<Segment, GpuError> {
        let half = self.half_block_bytes;
        match (self.kind, part) {
            (LayoutKind::PerLayer, Part::Half { layer, kv }) => {
                let plane = mul(
                    self.region_bytes / u64::from(KV_PLANES),
                    kv,
                    "V plane offset",
                )?;
                let offset = add(plane, mul(half, block, "block offset")?)?;
                Ok(Segment {
                    region: layer,
                    offset,
                    len: half,
                })
            }
            (LayoutKind::BlockContiguous, Part::Half { layer, kv }) => {
                let index = u64::from(layer) * u64::from(KV_PLANES) + u64::from(kv);
                let within = half.checked_mul(index).ok_or(GpuError::Overflow {
                    what: "offset in block",
                })?;
                let offset = add(mul(self.block_bytes()?, block, "block offset")?, within)?;
                Ok(Segment {
                    region: 0,
                    offset,
                    len: half,
                })
            }
            (LayoutKind::BlockContiguous, Part::WholeBlock) => {
                let len = self.block_bytes()?;
                Ok(Segment {
                    region: 0,
                    offset: mul(len, block, "block offset")?,
                    len,
                })
            }
            (LayoutKind::PerLayer, Part::WholeBlock) => Err(GpuError::LayoutMismatch {
                reason: "a per-layer layout has no contiguous whole block".into(),
            }),
        }
    }
}

/// Pairs up `src_blocks` of `src` with `dst_blocks` of `dst`, position by position,
/// as a list of copies coalesced wherever both sides run on contiguously.
///
/// Called by the sender once the receiver's block list arrives. The layouts may differ
/// in kind and block count but must agree on what a block holds.
///
/// # Errors
/// [`GpuError::LayoutMismatch`] when blocks differ in content (layers, tokens, heads,
/// head size or dtype), [`GpuError::BlockCountMismatch`], and the block-list errors of
/// [`KvLayout::segments`].
pub fn transfer_plan(
    src: &KvLayout,
    src_blocks: &[u32],
    dst: &KvLayout,
    dst_blocks: &[u32],
) -> Result<Vec<Transfer>, GpuError> {
    check_compatible(src, dst)?;
    if src_blocks.len() != dst_blocks.len() {
        return Err(GpuError::BlockCountMismatch {
            src: src_blocks.len(),
            dst: dst_blocks.len(),
        });
    }
    src.check_blocks(src_blocks)?;
    dst.check_blocks(dst_blocks)?;
    let whole = src.kind == LayoutKind::BlockContiguous && dst.kind == LayoutKind::BlockContiguous;
    let mut out = Vec::new();
    for part in src.parts(whole) {
        for (&s, &d) in src_blocks.iter().zip(dst_blocks) {
            let next = Transfer {
                src: src.piece(s, part)?,
                dst: dst.piece(d, part)?,
            };
            push_transfer_coalesced(&mut out, next);
        }
    }
    Ok(out)
}

fn check_compatible(src: &KvLayout, dst: &KvLayout) -> Result<(), GpuError> {
    let fields = [
        ("layers", src.shape.layers, dst.shape.layers),
        (
            "block_size_tokens",
            src.shape.block_size_tokens,
            dst.shape.block_size_tokens,
        ),
        (
            "kv_heads_per_rank",
            src.kv_heads_per_rank,
            dst.kv_heads_per_rank,
        ),
        ("head_dim", src.shape.head_dim, dst.shape.head_dim),
        ("dtype_bytes", src.shape.dtype_bytes, dst.shape.dtype_bytes),
    ];
    match fields.into_iter().find(|(_, a, b)| a != b) {
        Some((field, a, b)) => Err(GpuError::LayoutMismatch {
            reason: format!("{field}: source {a}, destination {b}"),
        }),
        None => Ok(()),
    }
}

fn check_nonzero(shape: &KvShape) -> Result<(), GpuError> {
    let fields = [
        ("layers", shape.layers),
        ("num_blocks", shape.num_blocks),
        ("block_size_tokens", shape.block_size_tokens),
        ("kv_heads", shape.kv_heads),
        ("head_dim", shape.head_dim),
        ("dtype_bytes", shape.dtype_bytes),
        ("tp_size", shape.tp_size),
    ];
    match fields.into_iter().find(|&(_, value)| value == 0) {
        Some((field, _)) => Err(GpuError::ZeroDimension { field }),
        None => Ok(()),
    }
}

/// KV heads per rank, as vLLM splits them: evenly when there are at least as many heads
/// as ranks, otherwise one replicated head per rank. Both must divide exactly.
fn heads_per_rank(shape: &KvShape) -> Result<u32, GpuError> {
    let (heads, size) = (shape.kv_heads, shape.tp_size);
    let per_rank = if heads >= size {
        (heads % size == 0).then(|| heads / size)
    } else {
        (size % heads == 0).then_some(1)
    };
    match per_rank {
        Some(per_rank) if shape.tp_rank < size => Ok(per_rank),
        _ => Err(GpuError::TensorParallel {
            tp_rank: shape.tp_rank,
            tp_size: size,
            kv_heads: heads,
        }),
    }
}

fn mul(a: u64, b: u32, what: &'static str) -> Result<u64, GpuError> {
    a.checked_mul(u64::from(b))
        .ok_or(GpuError::Overflow { what })
}

fn add(a: u64, b: u64) -> Result<u64, GpuError> {
    a.checked_add(b).ok_or(GpuError::Overflow {
        what: "segment offset",
    })
}
