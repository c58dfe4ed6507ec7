//! KV caches as engines hold them: a worker's KV memory as a set of registered ranges,
//! and the arithmetic that turns a block id into the byte segments it is made of.
//!
//! An engine does not keep one contiguous pool of equal blocks: vLLM holds one tensor per
//! layer (`[2, num_blocks, ...]`: K and V halves, or `[num_blocks, 2, ...]`: interleaved),
//! SGLang one K and one V buffer per layer, an MLA model one latent tensor per layer. Each
//! such tensor (or half) is a [`KvRange`]: block `b` of it is `bytes` bytes at
//! `addr + b × stride`. A [`KvLayout`] lists them in logical order (layer-major: layer 0 K,
//! layer 0 V, layer 1 K, ...), and a *logical block* is the concatenation, in that order, of
//! the block's bytes in every range. Everything above this module (checksums, copies,
//! [`crate::BlockSlice`], the wire) speaks logical bytes; only the data planes turn them into
//! physical [`Segment`]s ([`KvLayout::segments`]) and pair two sides' segments
//! ([`pair_segments`]).
//!
//! A layout is validated once ([`KvLayout::validate`]): when a worker registers its memory
//! and when a peer's descriptor arrives, so the per-request arithmetic below cannot overflow.

use crate::types::RankInfo;

/// The most ranges one layout may have: 1024 layers ([`LAYERS_MAX`]) with K and V as
/// separate ranges is 2048; twice that leaves room for engines that split further (e.g. a
/// scale tensor per layer), and bounds what a peer's descriptor can make us store.
pub const RANGES_MAX: usize = 4096;

/// The most layers a model may have. The deepest open models have ~130 layers; the bound
/// keeps layer arithmetic small and a peer's descriptor honest.
pub const LAYERS_MAX: u32 = 1024;

/// The most bytes a layout may describe (every block of every range): 1 TiB, more than
/// any machine's KV cache (8 × 141 GB GPUs), so that a mistaken or hostile descriptor is a
/// named error rather than arithmetic near the edge of `u64`.
pub const LAYOUT_BYTES_MAX: u64 = 1 << 40;

/// One registered range: block `b` of it is `bytes` bytes at `addr + b × stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvRange {
    /// Address of block 0: a host pointer, or a `CUdeviceptr`.
    pub addr: u64,
    /// Distance between consecutive blocks; at least `bytes`.
    pub stride: usize,
    /// Bytes of each block in this range.
    pub bytes: usize,
}

impl KvRange {
    /// A range of `blocks` contiguous blocks of `bytes` each (stride = bytes).
    pub fn contiguous(addr: u64, bytes: usize) -> Self {
        Self {
            addr,
            stride: bytes,
            bytes,
        }
    }

    /// Bytes from block 0's first byte to the last block's last byte:
    /// `(blocks - 1) × stride + bytes`; `None` on overflow or zero blocks.
    pub fn extent(&self, blocks: u32) -> Option<u64> {
        let last = u64::from(blocks.checked_sub(1)?);
        last.checked_mul(self.stride as u64)?
            .checked_add(self.bytes as u64)
    }
}

/// Which layers of the model this worker holds (pipeline parallelism): `count` layers
/// starting at `first`, of `total`. Whole-model block bytes = `total × (block_bytes / count)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayerSpan {
    /// First layer held.
    pub first: u32,
    /// Layers held.
    pub count: u32,
    /// Layers in the model.
    pub total: u32,
}

impl LayerSpan {
    /// The whole model as one opaque layer: what a region made without layer information
    /// ([`crate::Region::new`]) says. The runtime reads it as the rank's pipeline stage
    /// ([`PairSide::of`]).
    pub const WHOLE: Self = Self {
        first: 0,
        count: 1,
        total: 1,
    };

    /// Checks `first + count ≤ total`, `count ≥ 1`, `total ≤ LAYERS_MAX`.
    ///
    /// # Errors
    /// [`LayoutError::BadLayers`], [`LayoutError::TooManyLayers`].
    pub fn validate(&self) -> Result<(), LayoutError> {
        if self.total > LAYERS_MAX {
            return Err(LayoutError::TooManyLayers {
                total: self.total,
                max: LAYERS_MAX,
            });
        }
        let end = self.first.checked_add(self.count);
        if self.count == 0 || end.is_none_or(|end| end > self.total) {
            return Err(LayoutError::BadLayers { span: *self });
        }
        Ok(())
    }
}

/// Where a layout's memory lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvMemory {
    /// Host memory, dereferenced by the CPU.
    #[default]
    Host,
    /// CUDA device memory on `device`, reached only through driver copies and one-sided
    /// transports.
    Cuda {
        /// The device ordinal.
        device: u32,
    },
}

impl KvMemory {
    /// The memory kind without the device.
    pub fn kind(&self) -> handoff_gpu::MemoryKind {
        match self {
            Self::Host => handoff_gpu::MemoryKind::Host,
            Self::Cuda { .. } => handoff_gpu::MemoryKind::Cuda,
        }
    }
}

/// How an engine lays out its KV tensors, for [`KvLayout::shaped`] (and
/// `handoff worker --layout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvShape {
    /// One tensor per layer, K half then V half (`[2, num_blocks, ...]`, vLLM with
    /// FlashAttention; SGLang's K and V buffers look the same): two ranges per layer.
    KvHalves,
    /// One tensor per layer with whole blocks (`[num_blocks, 2, ...]`: K and V interleaved
    /// per block; an MLA latent cache): one range per layer.
    LayerBlocks,
    /// One allocation with every layer of a block together (`[num_blocks, layers, 2,
    /// ...]`): one range.
    Contiguous,
}

impl std::str::FromStr for KvShape {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "per-layer" => Ok(Self::KvHalves),
            "interleaved" => Ok(Self::LayerBlocks),
            "contiguous" => Ok(Self::Contiguous),
            other => Err(format!(
                "unknown layout {other:?}: per-layer, interleaved or contiguous"
            )),
        }
    }
}

/// A worker's KV memory as the engine allocated it: `blocks` blocks in every one of
/// `ranges`, in logical order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Blocks in every range.
    pub blocks: u32,
    /// The ranges, in logical order (layer-major: layer 0 K, layer 0 V, layer 1 K, ...).
    pub ranges: Vec<KvRange>,
    /// Where the memory lives.
    pub memory: KvMemory,
    /// The layers held; [`LayerSpan::WHOLE`] when unknown.
    pub layers: LayerSpan,
    /// Tokens per block (compared between peers; 0 = unknown).
    pub block_tokens: u32,
    /// Bytes per element (compared between peers; 0 = unknown).
    pub dtype_bytes: u32,
    /// How each block holds KV heads, when the engine said (heterogeneous TP needs it on
    /// both sides); `None` when unknown.
    pub heads: Option<KvHeads>,
}

/// How a layout's blocks hold KV heads: the model's KV heads (all TP ranks together),
/// how each part of a range's block orders them (a range of K or V alone is one part, K
/// and V together two), and the bytes of one head for one token. The heads a rank holds
/// follow from its TP rank ([`crate::tp::rank_heads`]); tokens per block are the layout's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvHeads {
    /// KV heads of the model (1 for a latent cache).
    pub kv_heads: u32,
    /// How each part of a block orders its heads.
    pub order: crate::tp::HeadOrder,
    /// Bytes of one head for one token (head size × bytes per element).
    pub head_bytes: u64,
}

/// Errors from layout validation and segment arithmetic: every one a value, never a
/// panic, because layouts also come from peers.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    /// A layout without ranges.
    #[error("layout has no ranges")]
    NoRanges,
    /// More ranges than [`RANGES_MAX`].
    #[error("layout has {count} ranges, more than the {max} allowed")]
    TooManyRanges {
        /// Ranges given.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A layout of zero blocks.
    #[error("layout has zero blocks")]
    NoBlocks,
    /// Head information that describes no model (zero or too many heads, zero bytes per
    /// head, unknown tokens per block, a latent cache of several heads).
    #[error("KV heads {heads:?} with {block_tokens} tokens per block")]
    BadHeads {
        /// What was said.
        heads: KvHeads,
        /// The layout's tokens per block.
        block_tokens: u32,
    },
    /// A range whose blocks are empty, or whose stride is shorter than its blocks (they
    /// would overlap).
    #[error("range {range}: {bytes}-byte blocks at a stride of {stride} bytes")]
    BadRange {
        /// Index of the range.
        range: usize,
        /// Its block bytes.
        bytes: usize,
        /// Its stride.
        stride: usize,
    },
    /// A range whose address is null (host ranges must be real memory).
    #[error("range {range} has a null address")]
    NullAddress {
        /// Index of the range.
        range: usize,
    },
    /// A range whose blocks run past the end of the address space or of its registered
    /// length.
    #[error("range {range}: {blocks} blocks at {addr:#x} (stride {stride}, {bytes} bytes) do not fit {what}")]
    RangeOverflow {
        /// Index of the range.
        range: usize,
        /// Blocks in the layout.
        blocks: u32,
        /// Its address.
        addr: u64,
        /// Its stride.
        stride: usize,
        /// Its block bytes.
        bytes: usize,
        /// What it does not fit.
        what: &'static str,
    },
    /// The layout describes more than [`LAYOUT_BYTES_MAX`].
    #[error("layout describes more than {max} bytes")]
    TooLarge {
        /// The limit.
        max: u64,
    },
    /// A layer span that does not describe layers of a model.
    #[error("layers {} + {} of {} do not describe a model's layers", span.first, span.count, span.total)]
    BadLayers {
        /// The span.
        span: LayerSpan,
    },
    /// More layers than [`LAYERS_MAX`].
    #[error("model of {total} layers, more than the {max} allowed")]
    TooManyLayers {
        /// Layers claimed.
        total: u32,
        /// The limit.
        max: u32,
    },
    /// A logical block that does not divide into equal layers.
    #[error("{block_bytes}-byte blocks do not divide into {count} equal layers")]
    UnevenLayers {
        /// Logical block bytes.
        block_bytes: usize,
        /// Layers held.
        count: u32,
    },
    /// A block id at or past the layout's blocks.
    #[error("block {block} out of range: layout has {blocks} blocks")]
    BlockOutOfRange {
        /// The block asked for.
        block: u32,
        /// Blocks in the layout.
        blocks: u32,
    },
    /// A logical slice that is empty or runs past the end of a block.
    #[error("{len} bytes at offset {offset} do not fit a {block_bytes}-byte block")]
    SliceOutOfBlock {
        /// Offset asked for.
        offset: usize,
        /// Length asked for.
        len: usize,
        /// The logical block's bytes.
        block_bytes: usize,
    },
    /// Two segment lists of different total lengths paired.
    #[error("segment lists of {src} and {dst} bytes cannot pair")]
    Unpaired {
        /// Source bytes.
        src: u64,
        /// Destination bytes.
        dst: u64,
    },
}

/// One physical piece of a logical block: `len` bytes at `addr`, in range `range`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Segment {
    /// Index of the range in the layout (which registration and remote key it is under).
    pub range: u32,
    /// Address of the first byte.
    pub addr: u64,
    /// Bytes; never 0.
    pub len: usize,
}

impl KvLayout {
    /// A one-range layout of `blocks` contiguous blocks of `block_bytes` at `addr` (today's
    /// single region).
    pub fn contiguous(addr: u64, blocks: u32, block_bytes: usize, memory: KvMemory) -> Self {
        Self {
            blocks,
            ranges: vec![KvRange::contiguous(addr, block_bytes)],
            memory,
            layers: LayerSpan::WHOLE,
            block_tokens: 0,
            dtype_bytes: 0,
            heads: None,
        }
    }

    /// Per-layer tensors shaped `[2, num_blocks, ...]` (vLLM with FlashAttention): tensor
    /// `l` at `bases[l]` holds every block's K half, then every block's V half, so each
    /// layer is two ranges: K at the base, V `blocks × half_bytes` further.
    pub fn kv_halves(bases: &[u64], blocks: u32, half_bytes: usize, memory: KvMemory) -> Self {
        let v_offset = u64::from(blocks).saturating_mul(half_bytes as u64);
        let ranges = bases
            .iter()
            .flat_map(|&base| {
                [
                    KvRange::contiguous(base, half_bytes),
                    KvRange::contiguous(base.saturating_add(v_offset), half_bytes),
                ]
            })
            .collect();
        Self::per_layer(ranges, bases.len(), blocks, memory)
    }

    /// Separate K and V buffers per layer (SGLang's `MHATokenToKVPool`): two ranges per
    /// layer, K at `k_bases[l]`, V at `v_bases[l]` (pairs up to the shorter list).
    pub fn k_and_v_buffers(
        k_bases: &[u64],
        v_bases: &[u64],
        blocks: u32,
        half_bytes: usize,
        memory: KvMemory,
    ) -> Self {
        let ranges = k_bases
            .iter()
            .zip(v_bases)
            .flat_map(|(&k, &v)| {
                [
                    KvRange::contiguous(k, half_bytes),
                    KvRange::contiguous(v, half_bytes),
                ]
            })
            .collect();
        Self::per_layer(ranges, k_bases.len().min(v_bases.len()), blocks, memory)
    }

    /// One tensor per layer whose blocks are whole (`[num_blocks, 2, ...]`: FlashInfer's K
    /// and V interleaved per block; or an MLA model's latent cache): one range per layer of
    /// `layer_block_bytes` per block.
    pub fn layer_blocks(
        bases: &[u64],
        blocks: u32,
        layer_block_bytes: usize,
        memory: KvMemory,
    ) -> Self {
        let ranges = bases
            .iter()
            .map(|&base| KvRange::contiguous(base, layer_block_bytes))
            .collect();
        Self::per_layer(ranges, bases.len(), blocks, memory)
    }

    /// `ranges` of `layers` per-layer tensors holding every layer of the model (set
    /// [`KvLayout::layers`] for a pipeline stage).
    fn per_layer(ranges: Vec<KvRange>, layers: usize, blocks: u32, memory: KvMemory) -> Self {
        // A layer count past u32 is past LAYERS_MAX too: `validate` names it.
        let layers = u32::try_from(layers).unwrap_or(u32::MAX).max(1);
        Self {
            blocks,
            ranges,
            memory,
            layers: LayerSpan {
                first: 0,
                count: layers,
                total: layers,
            },
            block_tokens: 0,
            dtype_bytes: 0,
            heads: None,
        }
    }

    /// A host layout of `layers` layers of `half_bytes` per block for K and for V, laid out
    /// as `shape` says, with range addresses as offsets from 0 (for
    /// [`crate::Region::alloc`]): what tests, the simulator and `handoff worker --layout`
    /// allocate to stand in for an engine. Tensors are 64 bytes apart, so no two of them
    /// happen to be contiguous.
    pub fn shaped(shape: KvShape, layers: u32, blocks: u32, half_bytes: usize) -> Self {
        /// Gap between consecutive tensors.
        const TENSOR_GAP_BYTES: u64 = 64;
        let tensor = 2 * u64::from(blocks).saturating_mul(half_bytes as u64);
        let bases: Vec<u64> = (0..u64::from(layers))
            .map(|l| l.saturating_mul(tensor + TENSOR_GAP_BYTES))
            .collect();
        let mut layout = match shape {
            KvShape::KvHalves => Self::kv_halves(&bases, blocks, half_bytes, KvMemory::Host),
            KvShape::LayerBlocks => {
                Self::layer_blocks(&bases, blocks, 2 * half_bytes, KvMemory::Host)
            }
            KvShape::Contiguous => Self::contiguous(
                0,
                blocks,
                (2 * half_bytes).saturating_mul(layers as usize),
                KvMemory::Host,
            ),
        };
        layout.layers = LayerSpan {
            first: 0,
            count: layers.max(1),
            total: layers.max(1),
        };
        layout
    }

    /// Checks every bound, overflow-safe: ranges 1..=[`RANGES_MAX`], blocks ≥ 1, every
    /// range's blocks non-empty at a stride ≥ their bytes and inside the address space, the
    /// whole at most [`LAYOUT_BYTES_MAX`], layers valid and the logical block divisible
    /// into them. Returns the logical block's bytes.
    ///
    /// # Errors
    /// The [`LayoutError`] naming the first bound broken.
    pub fn validate(&self) -> Result<usize, LayoutError> {
        if self.ranges.is_empty() {
            return Err(LayoutError::NoRanges);
        }
        if self.ranges.len() > RANGES_MAX {
            return Err(LayoutError::TooManyRanges {
                count: self.ranges.len(),
                max: RANGES_MAX,
            });
        }
        if self.blocks == 0 {
            return Err(LayoutError::NoBlocks);
        }
        if let Some(heads) = self.heads {
            let latent = heads.order == crate::tp::HeadOrder::Latent;
            if heads.kv_heads == 0
                || heads.kv_heads > crate::tp::TP_HEADS_MAX
                || (latent && heads.kv_heads != 1)
                || heads.head_bytes == 0
                || self.block_tokens == 0
            {
                return Err(LayoutError::BadHeads {
                    heads,
                    block_tokens: self.block_tokens,
                });
            }
        }
        let too_large = LayoutError::TooLarge {
            max: LAYOUT_BYTES_MAX,
        };
        let mut block_bytes = 0u64;
        for (i, range) in self.ranges.iter().enumerate() {
            if range.bytes == 0 || range.stride < range.bytes {
                return Err(LayoutError::BadRange {
                    range: i,
                    bytes: range.bytes,
                    stride: range.stride,
                });
            }
            let overflow = |what| LayoutError::RangeOverflow {
                range: i,
                blocks: self.blocks,
                addr: range.addr,
                stride: range.stride,
                bytes: range.bytes,
                what,
            };
            let extent = range.extent(self.blocks).ok_or_else(|| overflow("a u64"))?;
            if extent > LAYOUT_BYTES_MAX {
                return Err(too_large);
            }
            range
                .addr
                .checked_add(extent)
                .ok_or_else(|| overflow("the address space"))?;
            block_bytes = block_bytes
                .checked_add(range.bytes as u64)
                .filter(|&b| b <= LAYOUT_BYTES_MAX)
                .ok_or(too_large.clone())?;
        }
        block_bytes
            .checked_mul(u64::from(self.blocks))
            .filter(|&b| b <= LAYOUT_BYTES_MAX)
            .ok_or(too_large.clone())?;
        let block_bytes = usize::try_from(block_bytes).map_err(|_| too_large)?;
        self.layers.validate()?;
        if block_bytes % self.layers.count as usize != 0 {
            return Err(LayoutError::UnevenLayers {
                block_bytes,
                count: self.layers.count,
            });
        }
        Ok(block_bytes)
    }

    /// Bytes of one logical block: the sum of every range's block bytes (saturating; a
    /// validated layout never saturates).
    pub fn block_bytes(&self) -> usize {
        self.ranges
            .iter()
            .fold(0usize, |sum, r| sum.saturating_add(r.bytes))
    }

    /// The physical segments of `len` logical bytes at `offset` of block `block`, in
    /// logical order, appended to `out`. The layout must be validated
    /// ([`KvLayout::validate`]); the arithmetic is checked all the same.
    ///
    /// # Errors
    /// [`LayoutError::BlockOutOfRange`], [`LayoutError::SliceOutOfBlock`] (nothing
    /// appended).
    pub fn segments_into(
        &self,
        block: u32,
        offset: usize,
        len: usize,
        out: &mut Vec<Segment>,
    ) -> Result<(), LayoutError> {
        if block >= self.blocks {
            return Err(LayoutError::BlockOutOfRange {
                block,
                blocks: self.blocks,
            });
        }
        let block_bytes = self.block_bytes();
        let end = offset
            .checked_add(len)
            .filter(|&end| len > 0 && end <= block_bytes)
            .ok_or(LayoutError::SliceOutOfBlock {
                offset,
                len,
                block_bytes,
            })?;
        let mut start = 0usize;
        for (i, range) in self.ranges.iter().enumerate() {
            let range_end = start.saturating_add(range.bytes);
            let (lo, hi) = (offset.max(start), end.min(range_end));
            if lo < hi {
                let addr = (block as u64)
                    .checked_mul(range.stride as u64)
                    .and_then(|a| a.checked_add(range.addr))
                    .and_then(|a| a.checked_add((lo - start) as u64))
                    .ok_or(LayoutError::RangeOverflow {
                        range: i,
                        blocks: self.blocks,
                        addr: range.addr,
                        stride: range.stride,
                        bytes: range.bytes,
                        what: "the address space",
                    })?;
                out.push(Segment {
                    // i < RANGES_MAX for validated layouts; a longer list is cut by the
                    // `validate` contract, not here.
                    range: u32::try_from(i).unwrap_or(u32::MAX),
                    addr,
                    len: hi - lo,
                });
            }
            if range_end >= end {
                break;
            }
            start = range_end;
        }
        Ok(())
    }

    /// [`KvLayout::segments_into`] into a new list.
    ///
    /// # Errors
    /// Those of [`KvLayout::segments_into`].
    pub fn segments(
        &self,
        block: u32,
        offset: usize,
        len: usize,
    ) -> Result<Vec<Segment>, LayoutError> {
        let mut out = Vec::new();
        self.segments_into(block, offset, len, &mut out)?;
        Ok(out)
    }
}

/// Pairs two segment lists that carry the same logical bytes: calls `f(src, dst)` for
/// pieces of equal length, cut where either side's segments end, in order.
///
/// # Errors
/// [`LayoutError::Unpaired`] when the lists carry different byte counts (checked before
/// `f` is first called).
pub fn pair_segments(
    src: &[Segment],
    dst: &[Segment],
    mut f: impl FnMut(Segment, Segment),
) -> Result<(), LayoutError> {
    let total = |s: &[Segment]| s.iter().map(|s| s.len as u64).sum::<u64>();
    let (src_bytes, dst_bytes) = (total(src), total(dst));
    if src_bytes != dst_bytes {
        return Err(LayoutError::Unpaired {
            src: src_bytes,
            dst: dst_bytes,
        });
    }
    let (mut i, mut j) = (0, 0);
    let (mut src_done, mut dst_done) = (0usize, 0usize);
    while let (Some(s), Some(d)) = (src.get(i), dst.get(j)) {
        let len = (s.len - src_done).min(d.len - dst_done);
        if len > 0 {
            f(
                Segment {
                    range: s.range,
                    addr: s.addr + src_done as u64,
                    len,
                },
                Segment {
                    range: d.range,
                    addr: d.addr + dst_done as u64,
                    len,
                },
            );
        }
        src_done += len;
        dst_done += len;
        if src_done == s.len {
            i += 1;
            src_done = 0;
        }
        if dst_done == d.len {
            j += 1;
            dst_done = 0;
        }
    }
    Ok(())
}

/// What pairing needs to know of one side: the layers it holds, its logical block size and
/// the per-token facts both sides must agree on.
///
/// Made by [`PairSide::of`] from a layout and a rank; compared by
/// [`crate::BlockSlice::between`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PairSide {
    /// Layers held.
    pub layers: LayerSpan,
    /// Logical block bytes (the layers held, every range).
    pub block_bytes: usize,
    /// Tokens per block; 0 = unknown.
    pub block_tokens: u32,
    /// Bytes per element; 0 = unknown.
    pub dtype_bytes: u32,
    /// Whether `layers` are real model layers (given by the engine), rather than pipeline
    /// stages standing in for them ([`LayerSpan::WHOLE`] on a pipeline-parallel rank). Two
    /// sides with real layers must agree on the bytes per layer.
    pub layers_known: bool,
}

impl PairSide {
    /// The side a worker with `layout` (logical blocks of `block_bytes`) at `rank` presents.
    /// A layout without layer information ([`LayerSpan::WHOLE`]) on a pipeline-parallel
    /// rank holds its stage: `first = pp_rank, count = 1, total = pp_size`, layer-major
    /// blocks split evenly (what regions without layers always meant).
    pub fn of(
        layers: LayerSpan,
        block_bytes: usize,
        block_tokens: u32,
        dtype_bytes: u32,
        rank: &RankInfo,
    ) -> Self {
        let (layers, layers_known) = if layers == LayerSpan::WHOLE && rank.pp_size > 1 {
            (
                LayerSpan {
                    first: rank.pp_rank,
                    count: 1,
                    total: rank.pp_size,
                },
                false,
            )
        } else {
            (layers, true)
        };
        Self {
            layers,
            block_bytes,
            block_tokens,
            dtype_bytes,
            layers_known,
        }
    }

    /// [`PairSide::of`] a layout.
    pub fn of_layout(layout: &KvLayout, rank: &RankInfo) -> Self {
        Self::of(
            layout.layers,
            layout.block_bytes(),
            layout.block_tokens,
            layout.dtype_bytes,
            rank,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layout(ranges: Vec<KvRange>, blocks: u32) -> KvLayout {
        KvLayout {
            blocks,
            ranges,
            memory: KvMemory::Host,
            layers: LayerSpan::WHOLE,
            block_tokens: 0,
            dtype_bytes: 0,
            heads: None,
        }
    }

    #[test]
    fn a_block_maps_to_its_bytes_in_every_range_in_order() {
        // K and V halves of one layer: K blocks at 0x1000, V blocks 4 blocks later.
        let l = layout(
            vec![
                KvRange::contiguous(0x1000, 16),
                KvRange::contiguous(0x1000 + 4 * 16, 16),
            ],
            4,
        );
        assert_eq!(l.validate(), Ok(32));
        assert_eq!(
            l.segments(2, 8, 16).unwrap(),
            vec![
                Segment {
                    range: 0,
                    addr: 0x1000 + 32 + 8,
                    len: 8
                },
                Segment {
                    range: 1,
                    addr: 0x1040 + 32,
                    len: 8
                },
            ]
        );
        assert_eq!(
            l.segments(4, 0, 1),
            Err(LayoutError::BlockOutOfRange {
                block: 4,
                blocks: 4
            })
        );
        assert!(matches!(
            l.segments(0, 30, 3),
            Err(LayoutError::SliceOutOfBlock { .. })
        ));
        assert!(matches!(
            l.segments(0, usize::MAX, 2),
            Err(LayoutError::SliceOutOfBlock { .. })
        ));
        assert!(matches!(
            l.segments(0, 0, 0),
            Err(LayoutError::SliceOutOfBlock { .. })
        ));
    }

    #[test]
    fn engine_shapes_make_the_ranges_engines_hold() {
        // vLLM `[2, 8, ...]` per layer: K then V, 8 blocks of 32 bytes each.
        let halves = KvLayout::kv_halves(&[0x1000, 0x9000], 8, 32, KvMemory::Cuda { device: 1 });
        assert_eq!(halves.ranges.len(), 4);
        assert_eq!(halves.ranges[1], KvRange::contiguous(0x1000 + 8 * 32, 32));
        assert_eq!(
            halves.layers,
            LayerSpan {
                first: 0,
                count: 2,
                total: 2
            }
        );
        assert_eq!(halves.validate(), Ok(128));
        let sglang =
            KvLayout::k_and_v_buffers(&[0x1000, 0x2000], &[0x5000, 0x6000], 8, 32, KvMemory::Host);
        assert_eq!(sglang.ranges[1], KvRange::contiguous(0x5000, 32));
        assert_eq!(sglang.layers.count, 2);
        let mla = KvLayout::layer_blocks(&[0x1000, 0x2000, 0x3000], 8, 64, KvMemory::Host);
        assert_eq!(
            (mla.ranges.len(), mla.layers.count, mla.validate()),
            (3, 3, Ok(192))
        );
        // Every shape of the same layers holds the same logical block.
        for shape in [KvShape::KvHalves, KvShape::LayerBlocks, KvShape::Contiguous] {
            let l = KvLayout::shaped(shape, 4, 8, 16);
            assert_eq!(l.validate(), Ok(4 * 2 * 16), "{shape:?}");
            assert_eq!(l.layers.count, 4);
        }
        assert_eq!("per-layer".parse(), Ok(KvShape::KvHalves));
        assert!("columnar".parse::<KvShape>().is_err());
    }

    #[test]
    fn layouts_that_break_a_bound_are_named_errors() {
        let ok = KvRange::contiguous(0x1000, 16);
        assert_eq!(layout(vec![], 4).validate(), Err(LayoutError::NoRanges));
        assert_eq!(layout(vec![ok], 0).validate(), Err(LayoutError::NoBlocks));
        assert!(matches!(
            layout(vec![ok; RANGES_MAX + 1], 4).validate(),
            Err(LayoutError::TooManyRanges { .. })
        ));
        let short = KvRange { stride: 8, ..ok };
        assert!(matches!(
            layout(vec![short], 4).validate(),
            Err(LayoutError::BadRange { .. })
        ));
        let wraps = KvRange {
            addr: u64::MAX - 10,
            ..ok
        };
        assert!(matches!(
            layout(vec![wraps], 4).validate(),
            Err(LayoutError::RangeOverflow { .. })
        ));
        let huge = KvRange {
            stride: usize::MAX,
            ..ok
        };
        assert!(matches!(
            layout(vec![huge], u32::MAX).validate(),
            Err(LayoutError::RangeOverflow { .. } | LayoutError::TooLarge { .. })
        ));
        let mut l = layout(vec![ok], 4);
        l.layers = LayerSpan {
            first: 3,
            count: 2,
            total: 4,
        };
        assert!(matches!(l.validate(), Err(LayoutError::BadLayers { .. })));
        l.layers = LayerSpan {
            first: u32::MAX,
            count: 2,
            total: u32::MAX,
        };
        assert!(matches!(
            l.validate(),
            Err(LayoutError::TooManyLayers { .. })
        ));
        l.layers = LayerSpan {
            first: 0,
            count: 3,
            total: 3,
        };
        assert!(matches!(
            l.validate(),
            Err(LayoutError::UnevenLayers { .. })
        ));
    }

    /// A random layout: 1..8 ranges, each either contiguous, strided with a gap, or one
    /// half of an interleaved K/V pair.
    fn arb_layout() -> impl Strategy<Value = KvLayout> {
        (
            1u32..6,
            prop::collection::vec((1usize..24, 0usize..3, 0usize..9), 1..8),
        )
            .prop_map(|(blocks, specs)| {
                let mut addr = 0x10_000u64;
                let mut ranges = Vec::new();
                for (bytes, kind, gap) in specs {
                    if ranges.len() >= 7 {
                        break;
                    }
                    match kind {
                        // Contiguous blocks.
                        0 => ranges.push(KvRange::contiguous(addr, bytes)),
                        // Strided, with a gap after each block.
                        1 => ranges.push(KvRange {
                            addr,
                            stride: bytes + gap,
                            bytes,
                        }),
                        // K and V interleaved per block: two ranges over one tensor.
                        _ => {
                            ranges.push(KvRange {
                                addr,
                                stride: 2 * bytes,
                                bytes,
                            });
                            ranges.push(KvRange {
                                addr: addr + bytes as u64,
                                stride: 2 * bytes,
                                bytes,
                            });
                        }
                    }
                    let last = ranges[ranges.len() - 1];
                    addr = last.addr + last.extent(blocks).unwrap() + 64;
                }
                layout(ranges, blocks)
            })
    }

    /// The bytes a layout's ranges cover, as one backing buffer indexed from 0x10_000.
    fn backing(l: &KvLayout) -> Vec<u8> {
        let end = l
            .ranges
            .iter()
            .map(|r| r.addr + r.extent(l.blocks).unwrap())
            .max()
            .unwrap();
        vec![0u8; (end - 0x10_000) as usize]
    }

    fn write_logical(l: &KvLayout, mem: &mut [u8], block: u32, data: &[u8]) {
        for seg in l.segments(block, 0, data.len()).unwrap() {
            let at = (seg.addr - 0x10_000) as usize;
            let logical = logical_offset(l, block, seg);
            mem[at..at + seg.len].copy_from_slice(&data[logical..logical + seg.len]);
        }
    }

    fn logical_offset(l: &KvLayout, block: u32, seg: Segment) -> usize {
        let before: usize = l.ranges[..seg.range as usize].iter().map(|r| r.bytes).sum();
        let r = l.ranges[seg.range as usize];
        before + (seg.addr - r.addr - u64::from(block) * r.stride as u64) as usize
    }

    proptest! {
        #[test]
        fn segments_cover_exactly_the_slice_inside_their_ranges(
            l in arb_layout(), block in 0u32..6, a in 0usize..200, b in 0usize..200,
        ) {
            let block_bytes = l.validate().unwrap();
            let (offset, end) = (a.min(b), a.max(b));
            let len = end - offset;
            let segs = l.segments(block, offset, len);
            if block >= l.blocks || len == 0 || end > block_bytes {
                prop_assert!(segs.is_err());
                return Ok(());
            }
            let segs = segs.unwrap();
            prop_assert_eq!(segs.iter().map(|s| s.len).sum::<usize>(), len);
            let mut next = offset;
            for s in &segs {
                prop_assert!(s.len > 0);
                let r = l.ranges[s.range as usize];
                let block_start = r.addr + u64::from(block) * r.stride as u64;
                prop_assert!(s.addr >= block_start);
                prop_assert!(s.addr + s.len as u64 <= block_start + r.bytes as u64);
                prop_assert_eq!(logical_offset(&l, block, *s), next);
                next += s.len;
            }
        }

        #[test]
        fn a_copy_between_two_layouts_preserves_every_byte(
            src in arb_layout(), dst in arb_layout(), seed in any::<u64>(),
            sb in 0u32..6, db in 0u32..6,
        ) {
            let (src_bytes, dst_bytes) = (src.validate().unwrap(), dst.validate().unwrap());
            let len = src_bytes.min(dst_bytes);
            let (sb, db) = (sb % src.blocks, db % dst.blocks);
            let data: Vec<u8> = (0..len as u64)
                .map(|i| (seed.wrapping_mul(i + 1) >> 13) as u8)
                .collect();
            let mut src_mem = backing(&src);
            let mut dst_mem = backing(&dst);
            write_logical(&src, &mut src_mem, sb, &data);
            let from = src.segments(sb, src_bytes - len, len).unwrap();
            let to = dst.segments(db, 0, len).unwrap();
            // The source's last `len` bytes go to the destination's first `len`.
            let mut src_data = vec![0u8; src_bytes];
            src_data[src_bytes - len..].copy_from_slice(&data);
            let mut fresh = backing(&src);
            write_logical(&src, &mut fresh, sb, &src_data);
            pair_segments(&from, &to, |s, d| {
                let (s, d, n) = ((s.addr - 0x10_000) as usize, (d.addr - 0x10_000) as usize, s.len);
                dst_mem[d..d + n].copy_from_slice(&fresh[s..s + n]);
            }).unwrap();
            let mut out = Vec::new();
            for seg in dst.segments(db, 0, len).unwrap() {
                let at = (seg.addr - 0x10_000) as usize;
                out.extend_from_slice(&dst_mem[at..at + seg.len]);
            }
            prop_assert_eq!(out, data);
            drop(src_mem);
        }

        #[test]
        fn hostile_layouts_and_slices_are_errors_not_panics(
            addr in any::<u64>(), stride in any::<usize>(), bytes in any::<usize>(),
            blocks in any::<u32>(), n in 0usize..5, block in any::<u32>(),
            offset in any::<usize>(), len in any::<usize>(),
            first in any::<u32>(), count in any::<u32>(), total in any::<u32>(),
        ) {
            let mut l = layout(vec![KvRange { addr, stride, bytes }; n], blocks);
            l.layers = LayerSpan { first, count, total };
            // Validated or not, the arithmetic answers with a value.
            let _ = l.validate();
            let _ = l.segments(block, offset, len);
            let _ = l.block_bytes();
        }
    }

    #[test]
    fn pairing_lists_of_different_lengths_is_refused_before_any_piece() {
        let a = [Segment {
            range: 0,
            addr: 0,
            len: 4,
        }];
        let b = [Segment {
            range: 0,
            addr: 0,
            len: 5,
        }];
        let mut called = false;
        assert!(matches!(
            pair_segments(&a, &b, |_, _| called = true),
            Err(LayoutError::Unpaired { src: 4, dst: 5 })
        ));
        assert!(!called);
    }
}
