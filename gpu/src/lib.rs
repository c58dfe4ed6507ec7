//! `handoff-gpu`: the GPU side of handoff.
//!
//! It probes for a CUDA driver and devices at run time (through cudarc, never linking
//! CUDA at build time), allocates KV caches for tests and benchmarks, copies between host
//! memory and device memory named by address (an engine's KV tensors), checks contents
//! with a checksum, and names the memory kinds (host, CUDA) that transports register.
//! KV-cache layouts (which ranges a block id is made of) live in `handoff-transport`
//! (`handoff_transport::layout`), next to the regions and data planes that use them.
//!
//! No GPU, no driver, or `HANDOFF_CUDA_DISABLE=1` is an error value
//! ([`GpuError::NoDriver`], [`GpuError::NoDevice`]), never a panic: cudarc panics when
//! `libcuda` is missing, so the library's presence is checked before any driver call,
//! and every driver call also runs under `catch_unwind`.
//!
//! # Layout
//! - [`MemoryKind`]: where a region's bytes live.
//! - [`mod@probe`] (`probe.rs`): [`probe()`], [`GpuInfo`], [`DeviceInfo`], the
//!   `HANDOFF_CUDA_DISABLE` override. Creates no CUDA context.
//! - [`buffer`] (`buffer.rs`): the [`KvBuffer`] trait, [`HostBuffer`] (page-aligned heap
//!   memory).
//! - [`device`] (`device.rs`): [`DeviceBuffer`], CUDA memory through cudarc, with copies
//!   through `&self` (a registered buffer is shared with a transport) and the
//!   device-to-device reference copy [`DeviceBuffer::copy_to`]; [`DeviceCopier`] for
//!   copies to and from device memory by address; [`bind_device_to_thread`] for a
//!   transport's I/O thread.
//! - [`ipc`] (`ipc.rs`): CUDA IPC between processes of one host: [`ipc_export`],
//!   [`IpcMapping`] (a peer's allocation mapped here, with the bounds the driver mapped),
//!   [`DeviceCopier::copy_pieces`].
//! - [`checksum`] (`checksum.rs`): [`Checksum64`] / [`checksum64`] and the
//!   deterministic fill pattern.
//! - `error.rs`: [`GpuError`], the crate's one error type.
//!
//! # Why integrity is checked by copying back
//! A device buffer's checksum copies its bytes to the host (in bounded chunks) and
//! hashes them on the CPU, rather than hashing on the GPU with a kernel compiled by
//! NVRTC. The GPU machines we run on carry only the driver: NVRTC (part of the CUDA
//! toolkit) may be absent, and a missing NVRTC must not cost us verification.
//! Verification also runs outside the timed regions, so the copy's cost does not
//! matter. And one checksum function over host bytes means a host buffer and a device
//! buffer holding the same bytes give the same value, so the two sides of a transfer,
//! whatever their memory kinds, compare directly.

#![warn(missing_docs)]

pub mod buffer;
pub mod checksum;
pub mod device;
mod error;
pub mod ipc;
pub mod probe;

pub use buffer::{HostBuffer, KvBuffer, HOST_ALIGN_BYTES, STAGING_BYTES_MAX};
pub use checksum::{checksum64, Checksum64};
pub use device::{
    bind_device_to_thread, device_allocation, DeviceBuffer, DeviceContext, DeviceCopier,
    COPIES_PER_CALL_MAX,
};
pub use error::GpuError;
pub use ipc::{
    ipc_export, CopyPiece, IpcExport, IpcMapping, IPC_DESCRIPTOR_BYTES, IPC_HANDLE_BYTES,
};
pub use probe::{
    cuda_disabled_by_env, probe, DeviceInfo, DriverVersion, GpuInfo, CUDA_DISABLE_ENV,
    DEVICE_COUNT_MAX,
};

/// Where the bytes of a registered region live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary (or pinned) host memory.
    #[default]
    Host,
    /// CUDA device memory.
    Cuda,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Transports move buffers to their I/O threads and share them for reads.
    #[test]
    fn buffers_can_cross_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<HostBuffer>();
        assert_send_sync::<DeviceBuffer>();
        assert_send_sync::<GpuError>();
    }
}
