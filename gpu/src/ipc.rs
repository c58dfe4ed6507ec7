//! CUDA IPC between processes on one host: exporting the allocation that holds a device
//! range ([`ipc_export`]), opening a peer's ([`IpcMapping::open`]), and copying pieces
//! between device addresses on one stream ([`DeviceCopier::copy_pieces`]).
//!
//! Why our own and not UCX's: UCX's `cuda_ipc` transport reaches a peer's device memory
//! through the same handles, but its key carries no bounds we can see (a peer that
//! advertises a range its key does not cover makes UCX copy at the wrong offset, possibly
//! into another allocation of ours), and UCX 1.22 emulates gets from it in software
//! (0.8 GB/s). A mapping we open ourselves has exact bounds: the driver says how long the
//! allocation it mapped is, so every piece is checked against it before it is enqueued,
//! and reads are plain device copies.
//!
//! One process may hold one mapping of a handle per context (a second open answers
//! `CUDA_ERROR_ALREADY_MAPPED`): the caller keeps one [`IpcMapping`] per handle.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use crate::device::{device_allocation, primary_context, DeviceCopier};
use crate::probe::guarded;
use crate::GpuError;

/// Bytes of a CUDA IPC handle (`CUipcMemHandle`).
pub const IPC_HANDLE_BYTES: usize = 64;

/// Bytes of an IPC descriptor as it travels ([`IpcExport::to_bytes`]): the handle, then
/// the base address of the allocation it opens, in the exporter's address space
/// (little-endian).
pub const IPC_DESCRIPTOR_BYTES: usize = IPC_HANDLE_BYTES + 8;

/// The allocation holding a device range, exportable to another process on this host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IpcExport {
    /// The allocation's IPC handle.
    pub handle: [u8; IPC_HANDLE_BYTES],
    /// The allocation's first byte, in this process's address space.
    pub base: u64,
    /// The allocation's length in bytes.
    pub len: u64,
}

impl IpcExport {
    /// The descriptor that travels: handle, then base (see [`IPC_DESCRIPTOR_BYTES`]).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(IPC_DESCRIPTOR_BYTES);
        out.extend_from_slice(&self.handle);
        out.extend_from_slice(&self.base.to_le_bytes());
        out
    }

    /// The handle and base of a descriptor from [`IpcExport::to_bytes`]; `None` unless it
    /// is exactly [`IPC_DESCRIPTOR_BYTES`] long.
    pub fn parse(bytes: &[u8]) -> Option<([u8; IPC_HANDLE_BYTES], u64)> {
        if bytes.len() != IPC_DESCRIPTOR_BYTES {
            return None;
        }
        let (handle, base) = bytes.split_at(IPC_HANDLE_BYTES);
        Some((
            handle.try_into().ok()?,
            u64::from_le_bytes(base.try_into().ok()?),
        ))
    }
}

/// The exportable allocation holding device address `addr` on device `ordinal`:
/// `Ok(None)` when there is none (host memory, or memory CUDA IPC cannot share, such as
/// virtual-memory-management or stream-ordered pool allocations).
///
/// # Errors
/// The probe errors, [`GpuError::NoSuchDevice`], and [`GpuError::Driver`] for a failure
/// other than "not exportable".
pub fn ipc_export(ordinal: u32, addr: u64) -> Result<Option<IpcExport>, GpuError> {
    let context = primary_context(ordinal)?;
    guarded("cuCtxSetCurrent", || context.bind_to_thread())?;
    let Some((base, len)) = device_allocation(addr)? else {
        return Ok(None);
    };
    let mut handle = sys::CUipcMemHandle_st {
        reserved: [0; IPC_HANDLE_BYTES],
    };
    // SAFETY: `handle` is a valid out-parameter; the call only reads the allocation's
    // bookkeeping.
    let code = guarded("cuIpcGetMemHandle", || {
        Ok(unsafe { sys::cuIpcGetMemHandle(&raw mut handle, base) })
    })?;
    match code {
        sys::CUresult::CUDA_SUCCESS => Ok(Some(IpcExport {
            handle: handle.reserved.map(|b| b as u8),
            base,
            len,
        })),
        sys::CUresult::CUDA_ERROR_INVALID_VALUE | sys::CUresult::CUDA_ERROR_NOT_SUPPORTED => {
            Ok(None)
        }
        code => Err(driver("cuIpcGetMemHandle", code)),
    }
}

fn driver(call: &'static str, code: sys::CUresult) -> GpuError {
    GpuError::Driver {
        call,
        code: code as u32,
        name: format!("{code:?}"),
    }
}

/// A peer's allocation mapped into this process by its IPC handle, closed on drop.
///
/// [`IpcMapping::base`] and [`IpcMapping::len`] are what the driver mapped, whatever the
/// peer claimed: the bounds every copy through the mapping is checked against.
#[derive(Debug)]
pub struct IpcMapping {
    context: Arc<CudaContext>,
    base: u64,
    len: u64,
}

impl IpcMapping {
    /// Opens `handle` in device `ordinal`'s primary context (peer access enabled as
    /// needed, for an allocation on another device of this host).
    ///
    /// # Errors
    /// The probe errors, [`GpuError::NoSuchDevice`], and [`GpuError::Driver`]: a handle
    /// that opens nothing (garbage, another host's, its exporter gone), one this process
    /// exported itself, or one already open in this context.
    pub fn open(ordinal: u32, handle: &[u8; IPC_HANDLE_BYTES]) -> Result<Self, GpuError> {
        let context = primary_context(ordinal)?;
        guarded("cuCtxSetCurrent", || context.bind_to_thread())?;
        let raw = sys::CUipcMemHandle_st {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut base: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint;
        // SAFETY: `base` is a valid out-parameter; the handle is passed by value.
        let code = guarded("cuIpcOpenMemHandle", || {
            Ok(unsafe { sys::cuIpcOpenMemHandle_v2(&raw mut base, raw, flags) })
        })?;
        if code != sys::CUresult::CUDA_SUCCESS {
            return Err(driver("cuIpcOpenMemHandle", code));
        }
        // From here the mapping is ours to close, whatever happens next.
        let mut mapping = IpcMapping {
            context,
            base,
            len: 0,
        };
        match device_allocation(base)? {
            Some((start, len)) if start == base && len > 0 => {
                mapping.len = len;
                Ok(mapping)
            }
            other => Err(GpuError::Driver {
                call: "cuPointerGetAttribute",
                code: 0,
                name: format!("the mapping at {base:#x} has no allocation of its own: {other:?}"),
            }),
        }
    }

    /// The mapping's first byte, in this process.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The mapped allocation's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the mapping is empty (never, once opened).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address here of `[offset, offset + len)` of the mapped allocation; `None`
    /// unless it lies inside.
    pub fn at(&self, offset: u64, len: u64) -> Option<u64> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then_some(self.base + offset)
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let closed = guarded("cuCtxSetCurrent", || self.context.bind_to_thread()).and_then(|()| {
            // SAFETY: `base` came from `cuIpcOpenMemHandle` in this context and is closed
            // only here; copies through it were waited for by the calls that made them.
            let code = guarded("cuIpcCloseMemHandle", || {
                Ok(unsafe { sys::cuIpcCloseMemHandle(self.base) })
            })?;
            match code {
                sys::CUresult::CUDA_SUCCESS => Ok(()),
                code => Err(driver("cuIpcCloseMemHandle", code)),
            }
        });
        if let Err(error) = closed {
            tracing::warn!(%error, base = self.base, "closing a CUDA IPC mapping failed");
        }
    }
}

/// One copy of [`DeviceCopier::copy_pieces`]: `len` bytes from `src` to `dst`, both
/// addresses the driver knows in the copier's context (device memory, a mapping).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyPiece {
    /// Destination address.
    pub dst: u64,
    /// Source address.
    pub src: u64,
    /// Bytes.
    pub len: usize,
}

impl DeviceCopier {
    /// Enqueues every piece on the copier's stream (`cuMemcpyAsync`), then waits for all
    /// of them: when it returns, every byte has landed, or an error says the stream failed.
    ///
    /// # Safety
    /// Every piece's source and destination must be memory of this context (device
    /// allocations, [`IpcMapping`]s, registered host memory) that stays allocated for the
    /// call, and nothing else may write the destinations meanwhile.
    ///
    /// # Errors
    /// [`GpuError::TooManyBlocks`] (nothing copied), [`GpuError::Driver`].
    pub unsafe fn copy_pieces(&self, pieces: &[CopyPiece]) -> Result<(), GpuError> {
        if pieces.len() > crate::COPIES_PER_CALL_MAX {
            return Err(GpuError::TooManyBlocks {
                count: pieces.len(),
                max: crate::COPIES_PER_CALL_MAX,
            });
        }
        let stream = self.stream();
        guarded("cuCtxSetCurrent", || stream.context().bind_to_thread())?;
        let mut enqueued = Ok(());
        for p in pieces {
            // SAFETY: the caller's contract.
            let code = guarded("cuMemcpyAsync", || {
                Ok(unsafe { sys::cuMemcpyAsync(p.dst, p.src, p.len, stream.cu_stream()) })
            })?;
            if code != sys::CUresult::CUDA_SUCCESS {
                enqueued = Err(driver("cuMemcpyAsync", code));
                break;
            }
        }
        // Whatever was enqueued is waited for before we return, error or not: the caller
        // may release the memory as soon as we do.
        let waited = guarded("cuStreamSynchronize", || stream.synchronize());
        enqueued?;
        waited
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_descriptor_round_trips_and_only_its_exact_size_parses() {
        let export = IpcExport {
            handle: std::array::from_fn(|i| i as u8),
            base: 0x7f00_1234_5000,
            len: 1 << 20,
        };
        let bytes = export.to_bytes();
        assert_eq!(bytes.len(), IPC_DESCRIPTOR_BYTES);
        assert_eq!(IpcExport::parse(&bytes), Some((export.handle, export.base)));
        assert_eq!(IpcExport::parse(&bytes[..IPC_DESCRIPTOR_BYTES - 1]), None);
        assert_eq!(IpcExport::parse(&[bytes.as_slice(), &[0]].concat()), None);
        assert_eq!(IpcExport::parse(&[]), None);
    }

    #[test]
    fn without_a_gpu_exporting_and_opening_are_errors_not_panics() {
        if crate::probe().is_ok() {
            eprintln!(
                "skipping: a GPU is present (transport/tests/data_ucx_cuda.rs opens real handles)"
            );
            return;
        }
        assert!(ipc_export(0, 0x1000).is_err());
        assert!(IpcMapping::open(0, &[0; IPC_HANDLE_BYTES]).is_err());
    }
}
