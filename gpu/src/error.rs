//! The crate's one error type.

/// Everything that can go wrong in `handoff-gpu`.
///
/// Expected conditions (no driver, no device) have their own variants so that callers
/// (the runtime choosing a memory kind, a test deciding to skip) can match on them
/// instead of parsing messages.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    /// No usable CUDA driver: `libcuda` could not be loaded, or
    /// `HANDOFF_CUDA_DISABLE` asked us to behave as if it could not.
    #[error("no CUDA driver: {reason}")]
    NoDriver {
        /// Why, in words (which check failed).
        reason: String,
    },
    /// The driver loaded but reports no CUDA device.
    #[error("CUDA driver loaded but no CUDA device is visible")]
    NoDevice,
    /// A device ordinal past the number of devices the driver reports.
    #[error("CUDA device {ordinal} does not exist ({count} device(s) visible)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// How many devices the driver reports.
        count: u32,
    },
    /// The driver reports more devices than [`crate::DEVICE_COUNT_MAX`].
    #[error("CUDA driver reports {count} devices, more than the {max} we accept")]
    TooManyDevices {
        /// What the driver reported.
        count: i64,
        /// The limit.
        max: u32,
    },
    /// A CUDA driver call returned an error code.
    #[error("CUDA driver call {call} failed: {name} ({code})")]
    Driver {
        /// The driver call (or the cudarc operation) that failed.
        call: &'static str,
        /// The numeric `CUresult`.
        code: u32,
        /// The `CUresult`'s symbolic name, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
        name: String,
    },
    /// Code inside cudarc panicked (e.g. a symbol missing from an old driver); we caught
    /// it so that the process lives on.
    #[error("CUDA driver call {call} panicked inside cudarc: {message}")]
    DriverPanicked {
        /// The driver call (or the cudarc operation) that panicked.
        call: &'static str,
        /// The panic message.
        message: String,
    },
    /// A KV-cache layout dimension is zero; a layout with no bytes describes nothing.
    #[error("KV layout dimension `{field}` is zero")]
    ZeroDimension {
        /// The field that is zero.
        field: &'static str,
    },
    /// A KV-cache layout dimension is past its named limit.
    #[error("KV layout dimension `{field}` is {value}, more than the {max} allowed")]
    DimensionTooLarge {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The limit.
        max: u64,
    },
    /// Tensor-parallel settings that cannot describe a real split: the rank is not
    /// below the size, or the KV heads cannot be divided among (or replicated over) the ranks.
    #[error("invalid tensor parallelism: rank {tp_rank} of {tp_size} with {kv_heads} KV heads")]
    TensorParallel {
        /// This worker's TP rank.
        tp_rank: u32,
        /// The TP size.
        tp_size: u32,
        /// The model's total KV heads.
        kv_heads: u32,
    },
    /// Byte arithmetic overflowed `u64` (or `usize`); the layout is too large to address.
    #[error("arithmetic overflow computing {what}")]
    Overflow {
        /// The quantity being computed.
        what: &'static str,
    },
    /// A block id that is not below the layout's `num_blocks`.
    #[error("block {block} out of range: the layout has {num_blocks} blocks")]
    BlockOutOfRange {
        /// The offending block id.
        block: u32,
        /// The layout's block count.
        num_blocks: u32,
    },
    /// A block id named twice in one list: its bytes would be moved twice, or two
    /// source blocks would land on one destination block.
    #[error("block {block} appears twice in one block list")]
    DuplicateBlock {
        /// The repeated block id.
        block: u32,
    },
    /// A block list longer than [`crate::BLOCKS_PER_REQUEST_MAX`].
    #[error("block list of {count} blocks, more than the {max} allowed per request")]
    TooManyBlocks {
        /// The list's length.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// Two block lists that must pair up one to one have different lengths.
    #[error("block lists differ in length: {src} source blocks, {dst} destination blocks")]
    BlockCountMismatch {
        /// Source list length.
        src: usize,
        /// Destination list length.
        dst: usize,
    },
    /// Two layouts whose blocks cannot be copied into one another (different layer
    /// count or different bytes per block per layer).
    #[error("layouts do not match: {reason}")]
    LayoutMismatch {
        /// Which quantity differs, with both values.
        reason: String,
    },
    /// A copy whose source and destination lengths differ.
    #[error("transfer of {src} source bytes into {dst} destination bytes")]
    TransferLengthMismatch {
        /// Source length.
        src: u64,
        /// Destination length.
        dst: u64,
    },
    /// A segment names a region that the caller did not supply.
    #[error("segment names region {region}, but only {count} region(s) were given")]
    NoSuchRegion {
        /// The region index.
        region: u32,
        /// How many regions were given.
        count: usize,
    },
    /// A byte range that does not lie inside its buffer.
    #[error("byte range {offset}+{len} is outside a buffer of {buffer_len} bytes")]
    OutOfBounds {
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Length of the buffer.
        buffer_len: u64,
    },
    /// A buffer of zero bytes was asked for; allocators cannot hand one out.
    #[error("cannot allocate an empty buffer")]
    EmptyBuffer,
    /// The host allocator returned no memory.
    #[error("host allocation of {bytes} bytes failed")]
    HostAlloc {
        /// The size asked for.
        bytes: usize,
    },
}
