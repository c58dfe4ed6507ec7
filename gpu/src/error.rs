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
    /// Byte arithmetic overflowed `u64` (or `usize`); the layout is too large to address.
    #[error("arithmetic overflow computing {what}")]
    Overflow {
        /// The quantity being computed.
        what: &'static str,
    },
    /// A copy plan longer than [`crate::COPIES_PER_CALL_MAX`].
    #[error("copy plan of {count} copies, more than the {max} allowed per call")]
    TooManyBlocks {
        /// The list's length.
        count: usize,
        /// The limit.
        max: usize,
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
