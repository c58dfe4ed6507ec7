//! Memory regions cut into blocks: a worker's KV memory as the runtime and its transports
//! see it, in host memory or in CUDA device memory, as one range or as many.
//!
//! A region is a [`KvLayout`]: ranges registered by address, each holding every block's
//! bytes of one tensor (or half of one), and logical blocks that concatenate them
//! ([`crate::layout`]). [`Region::new`], [`Region::from_external`] and
//! [`Region::on_device`] make one-range layouts (one contiguous pool of equal blocks);
//! [`Region::from_layout`] takes an engine's tensors as they are; [`Region::alloc`]
//! allocates host memory for a layout (tests, the simulator, the worker's `--layers`).
//! Block reads, writes and copies speak logical bytes and move physical segments.
//!
//! A region is shared between the engine (which fills and reads blocks) and the runtime
//! (which copies blocks on the engine's behalf), so it hands out copies and takes writes
//! through `&self`. The contract that makes this sound is the one every KV-cache allocator
//! already keeps: a block belongs to at most one live request at a time, so two writers
//! never touch the same block at once.
//!
//! A device region is never dereferenced by the CPU: its block reads and writes are
//! explicit copies through the driver ([`DeviceCopier`]), and [`Region::host_ptr`] is an
//! error ([`RegionError::NotHostMemory`]) for it. One-sided transports (UCX) register its
//! ranges by address and move its bytes on the device side.

use std::cell::UnsafeCell;
use std::ptr::NonNull;
use std::sync::Arc;

use handoff_gpu::{DeviceBuffer, DeviceCopier, GpuError, MemoryKind};

use crate::layout::{pair_segments, KvLayout, KvMemory, LayerSpan, LayoutError, PairSide, Segment};
use crate::types::{BlockId, RankInfo};

/// Largest region this type allocates: 64 GiB, more than one GPU's KV cache, so that a
/// mistaken size fails with a named error instead of exhausting host memory.
pub const REGION_BYTES_MAX: usize = 64 << 30;

/// Errors from region construction and block access.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum RegionError {
    /// The block count or block size was zero, or their product overflowed or passed
    /// [`REGION_BYTES_MAX`].
    #[error("bad region size: {blocks} blocks of {block_bytes} bytes")]
    BadSize {
        /// Blocks asked for.
        blocks: u32,
        /// Bytes per block asked for.
        block_bytes: usize,
    },
    /// A block id at or past the end of the region.
    #[error("block {block} out of range: region has {blocks} blocks")]
    OutOfRange {
        /// The block asked for.
        block: BlockId,
        /// Blocks in the region.
        blocks: u32,
    },
    /// Data of the wrong length for one block.
    #[error("block data is {got} bytes, blocks are {want} bytes")]
    WrongLength {
        /// Length given.
        got: usize,
        /// Block size.
        want: usize,
    },
    /// Two regions with different block sizes, or block lists of different lengths.
    #[error("mismatched copy: {detail}")]
    Mismatch {
        /// What differed.
        detail: String,
    },
    /// Two sides whose layouts cannot be paired (different models, or a malformed side).
    #[error("layouts do not pair: {0}")]
    Pairing(#[from] PairingError),
    /// A layout that breaks a bound, or a slice outside a block.
    #[error("bad layout: {0}")]
    Layout(#[from] LayoutError),
    /// A CPU access (`op`) to a region in device memory, which only copies through the
    /// driver and one-sided transports can reach.
    #[error("{op} needs host memory, but this region is CUDA memory on device {device}")]
    NotHostMemory {
        /// What was asked for.
        op: &'static str,
        /// The device the region is on.
        device: u32,
    },
    /// A single pointer asked of a region whose blocks are not one contiguous range.
    #[error("{op} needs one contiguous range, but this region has {ranges} ranges")]
    NotContiguous {
        /// What was asked for.
        op: &'static str,
        /// Ranges in the region.
        ranges: usize,
    },
    /// A device region larger than the buffer it was made over.
    #[error(
        "{blocks} blocks of {block_bytes} bytes do not fit a device buffer of {buffer_len} bytes"
    )]
    DeviceTooSmall {
        /// Blocks asked for.
        blocks: u32,
        /// Bytes per block asked for.
        block_bytes: usize,
        /// The buffer's length.
        buffer_len: usize,
    },
    /// A copy to or from device memory failed in the driver.
    #[error("device copy failed: {0}")]
    Device(#[from] GpuError),
}

/// Why two sides' layouts cannot be paired: found before a byte moves, and reported to the
/// request as a protocol error naming the peer.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum PairingError {
    /// One side's layers or block bytes are malformed.
    #[error("{side} side: {error}")]
    BadSide {
        /// `"source"` or `"destination"`.
        side: &'static str,
        /// What is wrong with it.
        error: LayoutError,
    },
    /// The whole-model logical block differs: different models, or layer counts.
    #[error("whole-model blocks differ: source {src} bytes, destination {dst} bytes")]
    WholeBlockBytes {
        /// Source's whole-model block bytes.
        src: u64,
        /// Destination's.
        dst: u64,
    },
    /// The bytes of one layer of one block differ.
    #[error("bytes per layer differ: source {src}, destination {dst}")]
    LayerBytes {
        /// Source's per-layer bytes.
        src: usize,
        /// Destination's.
        dst: usize,
    },
    /// Tokens per block differ.
    #[error("tokens per block differ: source {src}, destination {dst}")]
    BlockTokens {
        /// Source's.
        src: u32,
        /// Destination's.
        dst: u32,
    },
    /// Bytes per element differ.
    #[error("bytes per element differ: source {src}, destination {dst}")]
    DtypeBytes {
        /// Source's.
        src: u32,
        /// Destination's.
        dst: u32,
    },
    /// Ranks of different TP sizes whose heads cannot be paired (see [`crate::tp`]).
    #[error("heterogeneous TP, source tp {src_tp}, destination tp {dst_tp}: {error}")]
    Tp {
        /// Source's TP size.
        src_tp: u32,
        /// Destination's.
        dst_tp: u32,
        /// Why.
        error: crate::tp::TpError,
    },
    /// Ranks of different TP sizes in a pairing not supported yet.
    #[error(
        "heterogeneous TP, source tp {src_tp}, destination tp {dst_tp}: {what} is not supported"
    )]
    TpUnsupported {
        /// Source's TP size.
        src_tp: u32,
        /// Destination's.
        dst_tp: u32,
        /// What.
        what: &'static str,
    },
}

/// Which bytes of each logical block a transfer moves: `len` bytes from `src_offset` of
/// every source block to `dst_offset` of its destination block. Whole blocks
/// ([`BlockSlice::whole`]) unless the two sides hold different layers of a block
/// ([`BlockSlice::between`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockSlice {
    /// Offset in each source block.
    pub src_offset: usize,
    /// Offset in each destination block.
    pub dst_offset: usize,
    /// Bytes moved per block.
    pub len: usize,
}

impl BlockSlice {
    /// Whole blocks of `block_bytes` on both sides.
    pub fn whole(block_bytes: usize) -> Self {
        Self {
            src_offset: 0,
            dst_offset: 0,
            len: block_bytes,
        }
    }

    /// The bytes of each logical block that a source holding `src` and a destination
    /// holding `dst` have in common: the layers both hold, at `(layer - first) × per-layer
    /// bytes` of each side's block. `None` when they share no layer (nothing to move).
    ///
    /// # Errors
    /// [`RegionError::Pairing`]: a malformed side; whole-model blocks of different sizes;
    /// different bytes per layer (when both sides name real layers); different tokens
    /// per block or bytes per element (when both sides know them).
    pub fn between(src: PairSide, dst: PairSide) -> Result<Option<Self>, RegionError> {
        let (src_layer, src_whole) = side_bytes(&src, "source")?;
        let (dst_layer, dst_whole) = side_bytes(&dst, "destination")?;
        if src_whole != dst_whole {
            return Err(PairingError::WholeBlockBytes {
                src: src_whole,
                dst: dst_whole,
            }
            .into());
        }
        if src.layers_known && dst.layers_known && src_layer != dst_layer {
            return Err(PairingError::LayerBytes {
                src: src_layer,
                dst: dst_layer,
            }
            .into());
        }
        let known = |a: u32, b: u32| a != 0 && b != 0 && a != b;
        if known(src.block_tokens, dst.block_tokens) {
            return Err(PairingError::BlockTokens {
                src: src.block_tokens,
                dst: dst.block_tokens,
            }
            .into());
        }
        if known(src.dtype_bytes, dst.dtype_bytes) {
            return Err(PairingError::DtypeBytes {
                src: src.dtype_bytes,
                dst: dst.dtype_bytes,
            }
            .into());
        }
        // Byte ranges of the whole-model block; they fit (each ≤ the whole, a u64 checked
        // to fit a usize-sized block times LAYERS_MAX).
        let span = |s: &PairSide, layer: usize| {
            let start = s.layers.first as u64 * layer as u64;
            (start, start + s.layers.count as u64 * layer as u64)
        };
        let (a, b) = (span(&src, src_layer), span(&dst, dst_layer));
        let (start, end) = (a.0.max(b.0), a.1.min(b.1));
        if start >= end {
            return Ok(None);
        }
        // Each offset and length is inside one side's block, which is a usize.
        Ok(Some(Self {
            src_offset: (start - a.0) as usize,
            dst_offset: (start - b.0) as usize,
            len: (end - start) as usize,
        }))
    }

    /// [`BlockSlice::between`] two ranks with their layouts: `Ok(None)` when they share no
    /// layer, `Ok(Some(whole))` between ranks holding the same layers.
    ///
    /// # Errors
    /// Those of [`BlockSlice::between`].
    pub fn for_ranks(
        src: &RankInfo,
        src_layout: &KvLayout,
        dst: &RankInfo,
        dst_layout: &KvLayout,
    ) -> Result<Option<Self>, RegionError> {
        Self::between(
            PairSide::of_layout(src_layout, src),
            PairSide::of_layout(dst_layout, dst),
        )
    }

    /// The slices of each logical block a transfer from `src` to `dst` moves. Between ranks
    /// of one TP size, the layers both hold ([`BlockSlice::for_ranks`]: one slice, or none).
    /// Between TP sizes, the KV heads `dst` takes from `src` ([`crate::tp::tp_spans`]), one
    /// slice per span, none when `dst` takes nothing from `src`: both layouts must say how
    /// they hold heads ([`KvLayout::heads`]) and hold the same layers.
    ///
    /// # Errors
    /// Those of [`BlockSlice::for_ranks`]; [`PairingError::TpUnsupported`] (no head
    /// information, different layers); [`PairingError::Tp`] (heads that do not pair).
    pub fn spans_for_ranks(
        src: &RankInfo,
        src_layout: &KvLayout,
        dst: &RankInfo,
        dst_layout: &KvLayout,
    ) -> Result<Vec<Self>, RegionError> {
        if src.tp_size == dst.tp_size {
            return Ok(Self::for_ranks(src, src_layout, dst, dst_layout)?
                .into_iter()
                .collect());
        }
        let (src_tp, dst_tp) = (src.tp_size, dst.tp_size);
        let unsupported = |what| PairingError::TpUnsupported {
            src_tp,
            dst_tp,
            what,
        };
        let (Some(src_heads), Some(dst_heads)) = (src_layout.heads, dst_layout.heads) else {
            return Err(unsupported(
                "a side without its KV heads (kv_heads, head order, head size)",
            )
            .into());
        };
        let (src_side, dst_side) = (
            PairSide::of_layout(src_layout, src),
            PairSide::of_layout(dst_layout, dst),
        );
        if src_side.layers != dst_side.layers {
            return Err(unsupported("heads between different pipeline stages").into());
        }
        let side =
            |rank: &RankInfo, layout: &KvLayout, heads: crate::layout::KvHeads| crate::tp::TpSide {
                tp: rank.tp_size,
                rank: rank.tp_rank,
                heads: crate::tp::HeadLayout {
                    kv_heads: heads.kv_heads,
                    order: heads.order,
                    block_tokens: layout.block_tokens,
                    head_bytes: heads.head_bytes,
                },
                block_bytes: layout.block_bytes() as u64,
            };
        let spans = crate::tp::tp_spans(
            &side(src, src_layout, src_heads),
            &side(dst, dst_layout, dst_heads),
        )
        .map_err(|error| PairingError::Tp {
            src_tp,
            dst_tp,
            error,
        })?;
        let size =
            |v: u64| usize::try_from(v).map_err(|_| unsupported("a span past this address space"));
        spans
            .into_iter()
            .map(|s| {
                Ok(Self {
                    src_offset: size(s.src)?,
                    dst_offset: size(s.dst)?,
                    len: size(s.len)?,
                })
            })
            .collect::<Result<Vec<_>, PairingError>>()
            .map_err(RegionError::from)
    }

    /// Checks that the slice lies inside blocks of `src_block_bytes` and `dst_block_bytes`.
    ///
    /// # Errors
    /// [`RegionError::Mismatch`].
    pub fn check(&self, src_block_bytes: usize, dst_block_bytes: usize) -> Result<(), RegionError> {
        let fits = |offset: usize, block: usize| {
            offset.checked_add(self.len).is_some_and(|end| end <= block)
        };
        if self.len == 0
            || !fits(self.src_offset, src_block_bytes)
            || !fits(self.dst_offset, dst_block_bytes)
        {
            return Err(RegionError::Mismatch {
                detail: format!(
                    "{} bytes from offset {} of {}-byte source blocks to offset {} of {}-byte destination blocks",
                    self.len, self.src_offset, src_block_bytes, self.dst_offset, dst_block_bytes
                ),
            });
        }
        Ok(())
    }
}

/// One side's bytes per layer and whole-model block bytes, checked.
fn side_bytes(side: &PairSide, name: &'static str) -> Result<(usize, u64), PairingError> {
    let bad = |error| PairingError::BadSide { side: name, error };
    side.layers.validate().map_err(bad)?;
    let count = side.layers.count as usize;
    if side.block_bytes == 0 || side.block_bytes % count != 0 {
        return Err(bad(LayoutError::UnevenLayers {
            block_bytes: side.block_bytes,
            count: side.layers.count,
        }));
    }
    let layer = side.block_bytes / count;
    // total ≤ LAYERS_MAX (validated) and layer ≤ usize::MAX: the product fits a u64 only
    // if checked on 64-bit targets, so check.
    let whole = (layer as u64)
        .checked_mul(u64::from(side.layers.total))
        .ok_or(bad(LayoutError::TooLarge {
            max: crate::layout::LAYOUT_BYTES_MAX,
        }))?;
    Ok((layer, whole))
}

/// Where a region's bytes live.
enum Storage {
    /// Heap memory the region allocated and owns; the layout's ranges point into it.
    Owned(Box<[UnsafeCell<u8>]>),
    /// Host memory someone else allocated (an engine's tensors, a UCX allocation), kept
    /// alive by `_keeper` for as long as the region lives.
    External { _keeper: Box<dyn Send + Sync> },
    /// CUDA device memory: reached only through the driver's copies, never dereferenced.
    /// `buffer` is the allocation when the region was made over one; `_keeper` keeps
    /// whatever else the region depends on (an engine's tensors, a transport's
    /// registration).
    Device {
        copier: DeviceCopier,
        buffer: Option<Arc<DeviceBuffer>>,
        _keeper: Option<Box<dyn Send + Sync>>,
    },
}

/// A block-addressed memory region over a [`KvLayout`], in host or device memory.
///
/// Made by [`Region::new`] (zeroed heap memory, one range), [`Region::alloc`] (zeroed heap
/// memory for a layout), [`Region::from_external`] (host memory owned by something else,
/// one range), [`Region::from_layout`] (an engine's tensors as they are, host or device) or
/// [`Region::on_device`] (a CUDA allocation, one range).
pub struct Region {
    storage: Storage,
    layout: KvLayout,
    block_bytes: usize,
}

// SAFETY: all access goes through raw byte copies of blocks; the module contract (a block
// belongs to one live request at a time) keeps writers of one block exclusive.
unsafe impl Sync for Region {}
// SAFETY: the region owns its bytes (or a `Send` keeper that keeps them alive); moving it
// between threads moves that ownership.
unsafe impl Send for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("memory", &self.layout.memory)
            .field("blocks", &self.layout.blocks)
            .field("block_bytes", &self.block_bytes)
            .field("ranges", &self.layout.ranges.len())
            .field("layers", &self.layout.layers)
            .finish()
    }
}

impl Region {
    /// Allocates `blocks` zeroed blocks of `block_bytes` each, as one contiguous range.
    ///
    /// # Errors
    /// [`RegionError::BadSize`].
    pub fn new(blocks: u32, block_bytes: usize) -> Result<Self, RegionError> {
        Self::total_bytes(blocks, block_bytes)?;
        Self::alloc(KvLayout::contiguous(0, blocks, block_bytes, KvMemory::Host))
    }

    /// Allocates zeroed host memory for `layout`, whose range addresses are read as
    /// offsets into the new allocation (which is as long as the furthest range's end), and
    /// rebases them onto it. For tests, the simulator and workers that lay out memory of
    /// their own the way an engine would.
    ///
    /// # Errors
    /// [`RegionError::Layout`] for a layout that breaks a bound; [`RegionError::BadSize`]
    /// past [`REGION_BYTES_MAX`]; [`RegionError::NotHostMemory`] for a device layout.
    pub fn alloc(mut layout: KvLayout) -> Result<Self, RegionError> {
        if let KvMemory::Cuda { device } = layout.memory {
            return Err(RegionError::NotHostMemory {
                op: "allocating a region",
                device,
            });
        }
        let block_bytes = layout.validate()?;
        let bad_size = RegionError::BadSize {
            blocks: layout.blocks,
            block_bytes,
        };
        let mut total = 0u64;
        for range in &layout.ranges {
            let end = range
                .extent(layout.blocks)
                .and_then(|e| e.checked_add(range.addr))
                .ok_or(bad_size.clone())?;
            total = total.max(end);
        }
        let total = usize::try_from(total)
            .ok()
            .filter(|&t| t <= REGION_BYTES_MAX)
            .ok_or(bad_size)?;
        // `vec![0; n]` asks the allocator for zeroed pages (no per-byte loop, pages
        // faulted in on first touch), then the slice is re-typed as cells.
        let bytes: Box<[u8]> = vec![0u8; total].into_boxed_slice();
        // SAFETY: `UnsafeCell<u8>` is `repr(transparent)` over `u8`, so the two slice types
        // have the same layout; the box's ownership moves unchanged.
        let bytes = unsafe { Box::from_raw(Box::into_raw(bytes) as *mut [UnsafeCell<u8>]) };
        let base = UnsafeCell::raw_get(bytes.as_ptr()) as u64;
        for range in &mut layout.ranges {
            // Every range ends inside `total` (above), so base + addr stays inside the box.
            range.addr += base;
        }
        Ok(Self {
            storage: Storage::Owned(bytes),
            layout,
            block_bytes,
        })
    }

    /// A region over an engine's KV memory as it is: `layout`'s ranges, by address, without
    /// copying. Device layouts get a driver copier for their device (block reads and
    /// writes); `keeper` is dropped when the region is.
    ///
    /// # Safety
    /// Every range's blocks (`addr + b × stride .. + bytes` for every block `b`) must be
    /// valid, writable memory of `layout.memory` that stays allocated until `keeper` is
    /// dropped, that nothing accesses through Rust references, and whose writers (the
    /// engine, RDMA peers) follow the block-ownership contract of this module. Ranges must
    /// not overlap one another.
    ///
    /// # Errors
    /// [`RegionError::Layout`] for a layout that breaks a bound (or a null host range);
    /// [`RegionError::Device`] when a device layout's copier cannot be made.
    pub unsafe fn from_layout(
        layout: KvLayout,
        keeper: Box<dyn Send + Sync>,
    ) -> Result<Self, RegionError> {
        let block_bytes = layout.validate()?;
        let storage = match layout.memory {
            KvMemory::Host => {
                if let Some(range) = layout.ranges.iter().position(|r| r.addr == 0) {
                    return Err(LayoutError::NullAddress { range }.into());
                }
                Storage::External { _keeper: keeper }
            }
            KvMemory::Cuda { device } => Storage::Device {
                copier: DeviceCopier::new(device)?,
                buffer: None,
                _keeper: Some(keeper),
            },
        };
        Ok(Self {
            storage,
            layout,
            block_bytes,
        })
    }

    /// A region over `blocks × block_bytes` bytes of memory at `ptr` that something else
    /// allocated (the UCX data plane uses it so that the engine's blocks are the very memory
    /// peers write into): one contiguous range. `keeper` is dropped when the region is, and
    /// must keep the memory mapped until then.
    ///
    /// # Safety
    /// `ptr..ptr + blocks × block_bytes` must be valid, writable host memory that stays
    /// mapped until `keeper` is dropped, and that nothing accesses through Rust references
    /// (other writers, e.g. RDMA peers, follow the block-ownership contract of this module).
    pub unsafe fn from_external(
        ptr: NonNull<u8>,
        blocks: u32,
        block_bytes: usize,
        keeper: Box<dyn Send + Sync>,
    ) -> Result<Self, RegionError> {
        Self::total_bytes(blocks, block_bytes)?;
        let layout = KvLayout::contiguous(
            ptr.as_ptr().expose_provenance() as u64,
            blocks,
            block_bytes,
            KvMemory::Host,
        );
        // SAFETY: the caller's contract is this one's, for one range.
        unsafe { Self::from_layout(layout, keeper) }
    }

    /// A region over the first `blocks × block_bytes` bytes of a CUDA allocation, as one
    /// contiguous range. The region holds the buffer, so the memory lives at least as long
    /// as the region.
    ///
    /// # Errors
    /// [`RegionError::BadSize`], [`RegionError::DeviceTooSmall`], [`RegionError::Device`].
    pub fn on_device(
        buffer: Arc<DeviceBuffer>,
        blocks: u32,
        block_bytes: usize,
    ) -> Result<Self, RegionError> {
        Self::on_device_kept(buffer, blocks, block_bytes, None)
    }

    /// [`Region::on_device`], also holding `keeper` (e.g. a transport's handle that must
    /// outlive every user of the region) until the region drops.
    pub(crate) fn on_device_kept(
        buffer: Arc<DeviceBuffer>,
        blocks: u32,
        block_bytes: usize,
        keeper: Option<Box<dyn Send + Sync>>,
    ) -> Result<Self, RegionError> {
        use handoff_gpu::KvBuffer as _;
        let total = Self::total_bytes(blocks, block_bytes)?;
        if total > buffer.len() {
            return Err(RegionError::DeviceTooSmall {
                blocks,
                block_bytes,
                buffer_len: buffer.len(),
            });
        }
        let device = buffer.ordinal();
        let layout = KvLayout::contiguous(
            buffer.addr(),
            blocks,
            block_bytes,
            KvMemory::Cuda { device },
        );
        let block_bytes = layout.validate()?;
        Ok(Self {
            storage: Storage::Device {
                copier: DeviceCopier::new(device)?,
                buffer: Some(buffer),
                _keeper: keeper,
            },
            layout,
            block_bytes,
        })
    }

    fn total_bytes(blocks: u32, block_bytes: usize) -> Result<usize, RegionError> {
        (blocks as usize)
            .checked_mul(block_bytes)
            .filter(|&t| t > 0 && t <= REGION_BYTES_MAX)
            .ok_or(RegionError::BadSize {
                blocks,
                block_bytes,
            })
    }

    /// The same region, saying which layers it holds and the per-token facts peers compare
    /// (for regions made without them, e.g. by [`Region::new`]).
    ///
    /// # Errors
    /// [`RegionError::Layout`] when the span is malformed or the block does not divide
    /// into its layers.
    pub fn with_layers(
        mut self,
        layers: LayerSpan,
        block_tokens: u32,
        dtype_bytes: u32,
    ) -> Result<Self, RegionError> {
        self.layout.layers = layers;
        self.layout.block_tokens = block_tokens;
        self.layout.dtype_bytes = dtype_bytes;
        self.layout.validate()?;
        Ok(self)
    }

    /// Asks the kernel to back the memory this region allocated with huge pages (2 MiB
    /// `MADV_HUGEPAGE` over the aligned part, where transparent huge pages are in `madvise`
    /// or `always` mode), for a pool that a peer copies into and out of: the kernel's
    /// cross-process copy pins the peer's pages one by one, and a huge page is one pin
    /// and one TLB entry (a 256 MiB region read by 1 MiB blocks, this machine: 4.2 GB/s
    /// over 4 KiB pages, 6.0 over huge pages). Call it before the memory is first written;
    /// memory the region does not own (an engine's tensors) is left as its owner made it.
    /// Returns whether the advice was taken; a kernel without huge pages is not an error.
    pub fn advise_huge_pages(&self) -> bool {
        const HUGE: usize = 2 << 20;
        let Storage::Owned(bytes) = &self.storage else {
            return false;
        };
        let start = UnsafeCell::raw_get(bytes.as_ptr()) as usize;
        let (Some(first), Some(end)) = (
            start.checked_next_multiple_of(HUGE),
            start.checked_add(bytes.len()),
        ) else {
            return false;
        };
        let last = end - end % HUGE;
        if last <= first {
            return false;
        }
        // SAFETY: `[first, last)` lies inside the allocation this region owns; the advice
        // changes how its pages are backed, never their contents.
        unsafe {
            libc::madvise(
                first as *mut libc::c_void,
                last - first,
                libc::MADV_HUGEPAGE,
            ) == 0
        }
    }

    /// The layout: what a data plane registers and a peer is told.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The logical length of the region in bytes (`blocks × block_bytes`).
    pub fn len_bytes(&self) -> usize {
        self.layout.blocks as usize * self.block_bytes
    }

    /// Where the bytes live.
    pub fn memory_kind(&self) -> MemoryKind {
        self.layout.memory.kind()
    }

    /// The device buffer under a region made by [`Region::on_device`] (`None` otherwise).
    pub fn device_buffer(&self) -> Option<&Arc<DeviceBuffer>> {
        match &self.storage {
            Storage::Device { buffer, .. } => buffer.as_ref(),
            Storage::Owned(_) | Storage::External { .. } => None,
        }
    }

    /// The address of the first range's first byte: a host pointer, or a `CUdeviceptr`.
    /// For registration with a transport and for logs; never dereference it.
    pub fn base_addr(&self) -> u64 {
        self.layout.ranges.first().map_or(0, |r| r.addr)
    }

    /// The first byte of a one-range, contiguous host region, for transports that move
    /// whole runs of blocks through one pointer. Every access through it must stay inside
    /// [`Region::len_bytes`] and follow the module's block-ownership contract.
    ///
    /// # Errors
    /// [`RegionError::NotHostMemory`] for a device region, which the CPU must not touch;
    /// [`RegionError::NotContiguous`] for a region of several (or strided) ranges.
    pub fn host_ptr(&self) -> Result<*mut u8, RegionError> {
        self.check_host("direct CPU access")?;
        match self.layout.ranges.as_slice() {
            [range] if range.stride == range.bytes => Ok(self.host_at(range.addr)),
            ranges => Err(RegionError::NotContiguous {
                op: "a single pointer",
                ranges: ranges.len(),
            }),
        }
    }

    /// Checks that the region is host memory, for CPU access named `op`.
    ///
    /// # Errors
    /// [`RegionError::NotHostMemory`].
    pub fn check_host(&self, op: &'static str) -> Result<(), RegionError> {
        match self.layout.memory {
            KvMemory::Host => Ok(()),
            KvMemory::Cuda { device } => Err(RegionError::NotHostMemory { op, device }),
        }
    }

    /// The host pointer for address `addr` of a host region. Owned memory keeps the
    /// allocation's provenance; external memory's addresses were exposed by its owner.
    fn host_at(&self, addr: u64) -> *mut u8 {
        match &self.storage {
            Storage::Owned(bytes) => {
                let base = UnsafeCell::raw_get(bytes.as_ptr());
                base.wrapping_add((addr as usize).wrapping_sub(base as usize))
            }
            Storage::External { .. } | Storage::Device { .. } => {
                std::ptr::with_exposed_provenance_mut(addr as usize)
            }
        }
    }

    /// Number of blocks.
    pub fn blocks(&self) -> u32 {
        self.layout.blocks
    }

    /// Bytes per logical block (every range's bytes of the block).
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Checks one block id.
    ///
    /// # Errors
    /// [`RegionError::OutOfRange`].
    pub fn check_block(&self, block: BlockId) -> Result<(), RegionError> {
        if block.0 >= self.layout.blocks {
            return Err(RegionError::OutOfRange {
                block,
                blocks: self.layout.blocks,
            });
        }
        Ok(())
    }

    /// Checks every block of a list before anything is touched.
    ///
    /// # Errors
    /// [`RegionError::OutOfRange`].
    pub fn check_blocks(&self, blocks: &[BlockId]) -> Result<(), RegionError> {
        blocks.iter().try_for_each(|b| self.check_block(*b))
    }

    /// The physical segments of `len` logical bytes at `offset` of `block`, in logical
    /// order, appended to `out`.
    ///
    /// # Errors
    /// [`RegionError::OutOfRange`], [`RegionError::Layout`] for a slice outside the block.
    pub fn segments_into(
        &self,
        block: BlockId,
        offset: usize,
        len: usize,
        out: &mut Vec<Segment>,
    ) -> Result<(), RegionError> {
        self.check_block(block)?;
        Ok(self.layout.segments_into(block.0, offset, len, out)?)
    }

    /// The physical segments of `len` bytes at byte `offset` of the region's logical
    /// space (block `b`'s logical bytes at `b × block_bytes`, as a one-range region lays
    /// them out), in order, appended to `out`; neighbours adjacent in memory are merged, so
    /// a run of whole blocks of a contiguous region is one segment. For transports that
    /// address a peer's region by logical offset (TCP).
    ///
    /// # Errors
    /// [`RegionError::Layout`] when the range is empty or runs past the region's end.
    pub fn logical_segments_into(
        &self,
        offset: u64,
        len: usize,
        out: &mut Vec<Segment>,
    ) -> Result<(), RegionError> {
        let outside = LayoutError::SliceOutOfBlock {
            offset: usize::try_from(offset).unwrap_or(usize::MAX),
            len,
            block_bytes: self.len_bytes(),
        };
        let end = offset
            .checked_add(len as u64)
            .filter(|&end| len > 0 && end <= self.len_bytes() as u64)
            .ok_or(outside)?;
        let block_bytes = self.block_bytes as u64;
        let mut at = offset;
        while at < end {
            // `at < len_bytes`, so the block fits a u32 and the offset a usize.
            let (block, within) = ((at / block_bytes) as u32, (at % block_bytes) as usize);
            let take = (end - at).min(block_bytes - within as u64) as usize;
            let first = out.len();
            self.layout.segments_into(block, within, take, out)?;
            // Merge the new segments into the one before where they continue it.
            let mut keep = first;
            for i in first..out.len() {
                let seg = out[i];
                match keep.checked_sub(1).map(|k| &mut out[k]) {
                    Some(last)
                        if last.range == seg.range
                            && last.addr.checked_add(last.len as u64) == Some(seg.addr) =>
                    {
                        last.len += seg.len;
                    }
                    _ => {
                        out[keep] = seg;
                        keep += 1;
                    }
                }
            }
            out.truncate(keep);
            at += take as u64;
        }
        Ok(())
    }

    /// Copies `out.len()` bytes at logical byte `offset` of the region into `out` (see
    /// [`Region::logical_segments_into`]).
    ///
    /// # Errors
    /// [`RegionError::Layout`], [`RegionError::Device`].
    pub fn read_logical(&self, offset: u64, out: &mut [u8]) -> Result<(), RegionError> {
        let mut segments = Vec::new();
        self.logical_segments_into(offset, out.len(), &mut segments)?;
        self.read_segments(&segments, out)
    }

    /// Copies `data` to logical byte `offset` of the region. The blocks touched must be
    /// owned by the caller's request.
    ///
    /// # Errors
    /// [`RegionError::Layout`], [`RegionError::Device`].
    pub fn write_logical(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        let mut segments = Vec::new();
        self.logical_segments_into(offset, data.len(), &mut segments)?;
        self.write_segments(&segments, data)
    }

    /// The host bytes of one segment of this region, to read (e.g. straight into a
    /// socket).
    ///
    /// # Safety
    /// `seg` must come from this region's [`Region::segments_into`] or
    /// [`Region::logical_segments_into`]; the caller's request must own its block, and no
    /// mutable slice of those bytes may live meanwhile.
    ///
    /// # Errors
    /// [`RegionError::NotHostMemory`].
    pub unsafe fn host_bytes(&self, seg: &Segment) -> Result<&[u8], RegionError> {
        self.check_host("direct CPU access")?;
        // SAFETY: the caller's contract: the segment lies inside this region's memory,
        // which lives as long as `self`.
        Ok(unsafe { std::slice::from_raw_parts(self.host_at(seg.addr), seg.len) })
    }

    /// Where one segment of this host region starts, for the kernel to read from (a
    /// socket's send) or write into (a socket's receive, while the caller holds the right
    /// to write its block): no Rust reference to the bytes is made, so their owner may
    /// change them meanwhile (a released block the engine reuses), and the caller decides
    /// what that means for the bytes sent. `seg` must come from this region's
    /// [`Region::segments_into`] or [`Region::logical_segments_into`].
    ///
    /// # Errors
    /// [`RegionError::NotHostMemory`].
    pub fn host_segment_ptr(&self, seg: &Segment) -> Result<*const u8, RegionError> {
        self.check_host("direct CPU access")?;
        Ok(self.host_at(seg.addr).cast_const())
    }

    /// The host bytes of one segment of this region, to write (e.g. straight from a
    /// socket).
    ///
    /// # Safety
    /// As [`Region::host_bytes`], and no other slice of those bytes may live meanwhile.
    ///
    /// # Errors
    /// [`RegionError::NotHostMemory`].
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn host_bytes_mut(&self, seg: &Segment) -> Result<&mut [u8], RegionError> {
        self.check_host("direct CPU access")?;
        // SAFETY: as in `host_bytes`; exclusivity is the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.host_at(seg.addr), seg.len) })
    }

    /// Copies the bytes of `segments` (this region's, from [`Region::segments_into`]) into
    /// `out`, in order; `out` is as long as the segments together.
    fn read_segments(&self, segments: &[Segment], out: &mut [u8]) -> Result<(), RegionError> {
        let mut at = 0;
        for seg in segments {
            let dst = &mut out[at..at + seg.len];
            match &self.storage {
                // SAFETY: the segment lies inside a range of this region (layout arithmetic
                // on a validated layout), which lives as long as `self`.
                Storage::Device { copier, .. } => unsafe { copier.read(seg.addr, dst)? },
                // SAFETY: as above, in host memory; `dst` is a separate buffer.
                Storage::Owned(_) | Storage::External { .. } => unsafe {
                    std::ptr::copy_nonoverlapping(self.host_at(seg.addr), dst.as_mut_ptr(), seg.len)
                },
            }
            at += seg.len;
        }
        Ok(())
    }

    /// Copies `data` into `segments` of this region, in order. Callers pass segments of
    /// blocks their request owns.
    fn write_segments(&self, segments: &[Segment], data: &[u8]) -> Result<(), RegionError> {
        let mut at = 0;
        for seg in segments {
            let src = &data[at..at + seg.len];
            match &self.storage {
                // SAFETY: as in `read_segments`; the block is owned by the caller's request
                // (module contract).
                Storage::Device { copier, .. } => unsafe { copier.write(seg.addr, src)? },
                // SAFETY: as above, in host memory.
                Storage::Owned(_) | Storage::External { .. } => unsafe {
                    std::ptr::copy_nonoverlapping(src.as_ptr(), self.host_at(seg.addr), seg.len)
                },
            }
            at += seg.len;
        }
        Ok(())
    }

    /// Copies `out.len()` logical bytes at `offset` of `block` into `out`.
    ///
    /// # Errors
    /// [`RegionError::OutOfRange`], [`RegionError::Layout`], [`RegionError::Device`].
    pub fn read_slice(
        &self,
        block: BlockId,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), RegionError> {
        let mut segments = Vec::new();
        self.segments_into(block, offset, out.len(), &mut segments)?;
        self.read_segments(&segments, out)
    }

    /// Copies `data` to logical byte `offset` of `block`. The block must be owned by the
    /// caller's request.
    ///
    /// # Errors
    /// [`RegionError::OutOfRange`], [`RegionError::Layout`], [`RegionError::Device`].
    pub fn write_slice(
        &self,
        block: BlockId,
        offset: usize,
        data: &[u8],
    ) -> Result<(), RegionError> {
        let mut segments = Vec::new();
        self.segments_into(block, offset, data.len(), &mut segments)?;
        self.write_segments(&segments, data)
    }

    /// Overwrites one block with `data` (exactly one block long).
    ///
    /// # Errors
    /// [`RegionError::OutOfRange`], [`RegionError::WrongLength`], [`RegionError::Device`].
    pub fn write_block(&self, block: BlockId, data: &[u8]) -> Result<(), RegionError> {
        self.check_block(block)?;
        if data.len() != self.block_bytes {
            return Err(RegionError::WrongLength {
                got: data.len(),
                want: self.block_bytes,
            });
        }
        self.write_slice(block, 0, data)
    }

    /// A copy of one block's logical bytes.
    ///
    /// # Errors
    /// [`RegionError::OutOfRange`], [`RegionError::Device`].
    pub fn read_block(&self, block: BlockId) -> Result<Vec<u8>, RegionError> {
        self.check_block(block)?;
        let mut out = vec![0u8; self.block_bytes];
        self.read_slice(block, 0, &mut out)?;
        Ok(out)
    }

    /// Copies `src_blocks` of `src` into `dst_blocks` of `dst`, pairwise. Every block of both
    /// lists is checked before the first byte moves, so a bad list copies nothing. The two
    /// regions may have different layouts of the same logical block.
    ///
    /// # Errors
    /// [`RegionError::Mismatch`] for different block sizes or list lengths,
    /// [`RegionError::OutOfRange`], [`RegionError::Device`].
    pub fn copy_blocks(
        src: &Region,
        src_blocks: &[BlockId],
        dst: &Region,
        dst_blocks: &[BlockId],
    ) -> Result<(), RegionError> {
        if src.block_bytes != dst.block_bytes {
            return Err(RegionError::Mismatch {
                detail: format!(
                    "{}-byte blocks into {}-byte blocks",
                    src.block_bytes, dst.block_bytes
                ),
            });
        }
        Self::copy_block_slices(
            src,
            src_blocks,
            dst,
            dst_blocks,
            BlockSlice::whole(src.block_bytes),
        )
    }

    /// [`Region::copy_blocks`] of one logical slice of every block (pipeline parallelism:
    /// each rank holds some layers of every block; see [`BlockSlice::between`]). Moves the
    /// physical segments of both layouts, paired; blocks of a device region go through
    /// host memory, one block at a time.
    ///
    /// # Errors
    /// Those of [`Region::copy_blocks`]; [`RegionError::Mismatch`] for a slice outside
    /// either side's blocks.
    pub fn copy_block_slices(
        src: &Region,
        src_blocks: &[BlockId],
        dst: &Region,
        dst_blocks: &[BlockId],
        slice: BlockSlice,
    ) -> Result<(), RegionError> {
        slice.check(src.block_bytes, dst.block_bytes)?;
        if src_blocks.len() != dst_blocks.len() {
            return Err(RegionError::Mismatch {
                detail: format!(
                    "{} blocks of {} bytes into {} blocks of {} bytes",
                    src_blocks.len(),
                    src.block_bytes,
                    dst_blocks.len(),
                    dst.block_bytes
                ),
            });
        }
        src.check_blocks(src_blocks)?;
        dst.check_blocks(dst_blocks)?;
        let on_host = src.check_host("").is_ok() && dst.check_host("").is_ok();
        // Device blocks go through host memory, and only the slice's bytes: another
        // pipeline rank may be filling the rest of the same destination block at once.
        let mut staged = if on_host {
            Vec::new()
        } else {
            vec![0u8; slice.len]
        };
        let (mut from, mut to) = (Vec::new(), Vec::new());
        for (s, d) in src_blocks.iter().zip(dst_blocks) {
            from.clear();
            to.clear();
            src.segments_into(*s, slice.src_offset, slice.len, &mut from)?;
            dst.segments_into(*d, slice.dst_offset, slice.len, &mut to)?;
            if on_host {
                pair_segments(&from, &to, |a, b| {
                    // SAFETY: both segments lie inside their regions' ranges (layout
                    // arithmetic on validated layouts); they cannot overlap unless src and
                    // dst are the same memory and block, which copy (not
                    // copy_nonoverlapping) tolerates.
                    unsafe { std::ptr::copy(src.host_at(a.addr), dst.host_at(b.addr), a.len) }
                })?;
            } else {
                src.read_segments(&from, &mut staged)?;
                dst.write_segments(&to, &staged)?;
            }
        }
        Ok(())
    }

    /// A 64-bit FNV-1a checksum of the listed blocks' logical bytes, in order.
    ///
    /// # Errors
    /// [`RegionError::OutOfRange`], [`RegionError::Device`].
    pub fn checksum(&self, blocks: &[BlockId]) -> Result<u64, RegionError> {
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        // One block's bytes and segments at a time, in buffers kept across the blocks.
        let mut bytes = vec![0u8; self.block_bytes];
        let mut segments = Vec::new();
        for b in blocks {
            segments.clear();
            self.segments_into(*b, 0, self.block_bytes, &mut segments)?;
            self.read_segments(&segments, &mut bytes)?;
            for byte in &bytes {
                hash = (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        Ok(hash)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_asks_for_huge_pages_over_what_it_owns_and_nothing_else() {
        let region = Region::new(8, 1 << 20).unwrap();
        assert!(region.advise_huge_pages());
        // An aligned 2 MiB inside the allocation carries the mark.
        let inside = (region.base_addr() as usize).next_multiple_of(2 << 20) + 4096;
        let flags = handoff_testkit::vm_flags(inside);
        assert!(flags.split(' ').any(|f| f == "hg"), "{flags}");
        // The contents are as before: zeroes, and what is written reads back.
        region.write_block(BlockId(3), &[7u8; 1 << 20]).unwrap();
        assert_eq!(region.read_block(BlockId(3)).unwrap(), vec![7u8; 1 << 20]);
        assert!(region
            .read_block(BlockId(4))
            .unwrap()
            .iter()
            .all(|&b| b == 0));
        // Too small to hold an aligned huge page: no advice.
        assert!(!Region::new(4, 4096).unwrap().advise_huge_pages());
    }

    #[test]
    fn copies_blocks_and_refuses_out_of_range_before_touching_anything() {
        let a = Region::new(4, 8).unwrap();
        let b = Region::new(4, 8).unwrap();
        a.write_block(BlockId(1), &[7; 8]).unwrap();
        Region::copy_blocks(&a, &[BlockId(1)], &b, &[BlockId(3)]).unwrap();
        assert_eq!(b.read_block(BlockId(3)).unwrap(), vec![7; 8]);
        let err = Region::copy_blocks(&a, &[BlockId(1), BlockId(1)], &b, &[BlockId(0), BlockId(4)]);
        assert!(matches!(err, Err(RegionError::OutOfRange { .. })));
        assert_eq!(
            b.read_block(BlockId(0)).unwrap(),
            vec![0; 8],
            "nothing copied"
        );
        assert!(Region::new(0, 8).is_err());
        assert!(Region::new(u32::MAX, usize::MAX).is_err());
    }

    /// A pipeline stage of a region without layer information: stage `pp_rank` of
    /// `pp_size` with `block_bytes` per block.
    fn stage(pp_rank: u32, pp_size: u32, block_bytes: usize) -> PairSide {
        let rank = RankInfo {
            pp_rank,
            pp_size,
            ..RankInfo::single("e")
        };
        PairSide::of(LayerSpan::WHOLE, block_bytes, 0, 0, &rank)
    }

    fn layers(first: u32, count: u32, total: u32, block_bytes: usize) -> PairSide {
        PairSide::of(
            LayerSpan {
                first,
                count,
                total,
            },
            block_bytes,
            16,
            2,
            &RankInfo::single("e"),
        )
    }

    #[test]
    fn pipeline_stages_meet_where_their_layers_overlap() {
        // Two prefill stages of 32 bytes each into a 64-byte decode block.
        assert_eq!(
            BlockSlice::between(stage(1, 2, 32), stage(0, 1, 64)),
            Ok(Some(BlockSlice {
                src_offset: 0,
                dst_offset: 32,
                len: 32
            }))
        );
        // Decode stage 0 reads its half from a whole prefill block.
        assert_eq!(
            BlockSlice::between(stage(0, 1, 64), stage(0, 2, 32)),
            Ok(Some(BlockSlice {
                src_offset: 0,
                dst_offset: 0,
                len: 32
            }))
        );
        // 3 stages against 2: stage 1 of 3 (bytes 20..40 of 60) meets stage 0 of 2 (0..30).
        assert_eq!(
            BlockSlice::between(stage(1, 3, 20), stage(0, 2, 30)),
            Ok(Some(BlockSlice {
                src_offset: 0,
                dst_offset: 20,
                len: 10
            }))
        );
        assert_eq!(
            BlockSlice::between(stage(0, 2, 32), stage(1, 2, 32)),
            Ok(None)
        );
        assert_eq!(
            BlockSlice::between(stage(0, 1, 8), stage(0, 1, 8)),
            Ok(Some(BlockSlice::whole(8)))
        );
        // Whole blocks of different sizes, and malformed parts, are named errors.
        for (a, b) in [
            (stage(0, 2, 32), stage(0, 1, 48)),
            (stage(2, 2, 32), stage(0, 1, 64)),
            (stage(0, 0, 32), stage(0, 1, 64)),
            (
                stage(u32::MAX - 1, u32::MAX, usize::MAX / 2),
                stage(0, 1, 64),
            ),
        ] {
            assert!(
                matches!(BlockSlice::between(a, b), Err(RegionError::Pairing(_))),
                "{a:?} {b:?}"
            );
        }
    }

    #[test]
    fn an_uneven_pipeline_split_pairs_by_layer() {
        // 61 layers of 8 bytes: prefill stages hold 31 and 30, decode holds all 61.
        let (first, second, whole) = (
            layers(0, 31, 61, 248),
            layers(31, 30, 61, 240),
            layers(0, 61, 61, 488),
        );
        assert_eq!(
            BlockSlice::between(first, whole),
            Ok(Some(BlockSlice {
                src_offset: 0,
                dst_offset: 0,
                len: 248
            }))
        );
        assert_eq!(
            BlockSlice::between(second, whole),
            Ok(Some(BlockSlice {
                src_offset: 0,
                dst_offset: 248,
                len: 240
            }))
        );
        // Decode split 20 + 41 meets prefill's 31 + 30 where they overlap.
        assert_eq!(
            BlockSlice::between(second, layers(20, 41, 61, 328)),
            Ok(Some(BlockSlice {
                src_offset: 0,
                dst_offset: 88,
                len: 240
            }))
        );
        assert_eq!(
            BlockSlice::between(first, layers(31, 30, 61, 240)),
            Ok(None)
        );
    }

    #[test]
    fn sides_that_cannot_pair_are_named_before_anything_moves() {
        let whole = layers(0, 4, 4, 64);
        assert_eq!(
            BlockSlice::between(whole, layers(0, 8, 8, 64)),
            Err(PairingError::LayerBytes { src: 16, dst: 8 }.into())
        );
        assert_eq!(
            BlockSlice::between(whole, layers(0, 4, 4, 128)),
            Err(PairingError::WholeBlockBytes { src: 64, dst: 128 }.into())
        );
        let tokens = PairSide {
            block_tokens: 32,
            ..whole
        };
        assert_eq!(
            BlockSlice::between(whole, tokens),
            Err(PairingError::BlockTokens { src: 16, dst: 32 }.into())
        );
        let dtype = PairSide {
            dtype_bytes: 1,
            ..whole
        };
        assert_eq!(
            BlockSlice::between(dtype, whole),
            Err(PairingError::DtypeBytes { src: 1, dst: 2 }.into())
        );
        let unknown = PairSide {
            dtype_bytes: 0,
            block_tokens: 0,
            ..whole
        };
        assert_eq!(
            BlockSlice::between(unknown, whole),
            Ok(Some(BlockSlice::whole(64)))
        );
        assert!(matches!(
            BlockSlice::between(layers(0, 3, 4, 64), whole),
            Err(RegionError::Pairing(PairingError::BadSide {
                side: "source",
                ..
            }))
        ));
    }

    fn per_layer(blocks: u32, layers: u32, half: usize) -> KvLayout {
        KvLayout::shaped(crate::KvShape::KvHalves, layers, blocks, half)
    }

    fn interleaved(blocks: u32, layers: u32, half: usize) -> KvLayout {
        KvLayout::shaped(crate::KvShape::LayerBlocks, layers, blocks, half)
    }

    #[test]
    fn blocks_copy_between_different_layouts_of_the_same_logical_block() {
        let a = Region::alloc(per_layer(4, 4, 6)).unwrap();
        let b = Region::alloc(interleaved(4, 4, 6)).unwrap();
        let c = Region::new(4, 48).unwrap();
        assert_eq!((a.block_bytes(), b.block_bytes()), (48, 48));
        let data: Vec<u8> = (0..48).collect();
        a.write_block(BlockId(1), &data).unwrap();
        Region::copy_blocks(&a, &[BlockId(1)], &b, &[BlockId(3)]).unwrap();
        Region::copy_blocks(&b, &[BlockId(3)], &c, &[BlockId(0)]).unwrap();
        assert_eq!(b.read_block(BlockId(3)).unwrap(), data);
        assert_eq!(c.read_block(BlockId(0)).unwrap(), data);
        assert_eq!(
            a.checksum(&[BlockId(1)]).unwrap(),
            c.checksum(&[BlockId(0)]).unwrap()
        );
        // Each block of each range holds its own bytes: block 1's layer-0 K half is
        // bytes 0..6 of the logical block, at 6 bytes past range 0's start.
        let k0 = a.layout().ranges[0].addr;
        // SAFETY: reading 6 bytes of the region's own allocation, which `a` keeps alive.
        let raw = unsafe { std::slice::from_raw_parts(a.host_at(k0 + 6), 6) };
        assert_eq!(raw, &data[..6]);
        assert!(matches!(
            a.host_ptr(),
            Err(RegionError::NotContiguous { .. })
        ));
        assert!(c.host_ptr().is_ok());
        // A slice past a block is refused before anything moves.
        assert!(Region::copy_block_slices(
            &a,
            &[BlockId(0)],
            &b,
            &[BlockId(0)],
            BlockSlice {
                src_offset: 40,
                dst_offset: 0,
                len: 9
            }
        )
        .is_err());
    }

    #[test]
    fn slices_of_blocks_copy_only_their_bytes_and_are_checked_first() {
        let half = Region::new(2, 4).unwrap();
        let whole = Region::new(2, 8).unwrap();
        half.write_block(BlockId(1), &[5; 4]).unwrap();
        let slice = BlockSlice {
            src_offset: 0,
            dst_offset: 4,
            len: 4,
        };
        Region::copy_block_slices(&half, &[BlockId(1)], &whole, &[BlockId(0)], slice).unwrap();
        assert_eq!(
            whole.read_block(BlockId(0)).unwrap(),
            [0, 0, 0, 0, 5, 5, 5, 5]
        );
        let too_long = BlockSlice { len: 5, ..slice };
        assert!(matches!(
            Region::copy_block_slices(&half, &[BlockId(1)], &whole, &[BlockId(1)], too_long),
            Err(RegionError::Mismatch { .. })
        ));
        assert!(matches!(
            Region::copy_blocks(&half, &[BlockId(1)], &whole, &[BlockId(1)]),
            Err(RegionError::Mismatch { .. })
        ));
        assert_eq!(
            whole.read_block(BlockId(1)).unwrap(),
            [0; 8],
            "nothing copied"
        );
    }

    #[test]
    fn logical_offsets_span_blocks_and_merge_where_memory_continues() {
        let one = Region::new(4, 8).unwrap();
        let mut segs = Vec::new();
        one.logical_segments_into(4, 20, &mut segs).unwrap();
        assert_eq!(
            segs.len(),
            1,
            "a contiguous region is one segment: {segs:?}"
        );
        let many = Region::alloc(per_layer(4, 2, 3)).unwrap();
        let data: Vec<u8> = (100..124).collect();
        many.write_logical(6, &data).unwrap();
        let mut back = vec![0u8; 24];
        many.read_logical(6, &mut back).unwrap();
        assert_eq!(back, data);
        assert_eq!(many.read_block(BlockId(1)).unwrap()[..6], data[6..12]);
        assert!(many.read_logical(40, &mut [0u8; 9]).is_err());
        assert!(many.read_logical(u64::MAX, &mut [0u8; 2]).is_err());
    }

    #[test]
    fn external_memory_is_used_in_place_and_its_keeper_dropped_with_the_region() {
        struct Keeper(
            std::sync::Arc<std::sync::atomic::AtomicBool>,
            #[allow(dead_code)] Box<[u8]>,
        );
        impl Drop for Keeper {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut backing = vec![0u8; 32].into_boxed_slice();
        let ptr = NonNull::new(backing.as_mut_ptr()).unwrap();
        let keeper = Box::new(Keeper(dropped.clone(), backing));
        // SAFETY: the keeper owns the 32 bytes and lives as long as the region.
        let region = unsafe { Region::from_external(ptr, 4, 8, keeper) }.unwrap();
        region.write_block(BlockId(2), &[9; 8]).unwrap();
        assert_eq!(region.host_ptr(), Ok(ptr.as_ptr()));
        assert_eq!(region.base_addr(), ptr.as_ptr() as u64);
        assert_eq!(region.memory_kind(), MemoryKind::Host);
        // SAFETY: byte 16 is inside the 32-byte backing, which the keeper keeps alive.
        assert_eq!(unsafe { *ptr.as_ptr().add(16) }, 9);
        assert_eq!(region.len_bytes(), 32);
        drop(region);
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
    }
}
